"""The seed's dynamic-shape network in real 2- and 4-process jobs (one launch each,
many checks): a ``Symbol(divisor=8)`` batch of a new size every step, sharded with the
seed's split counts and through ``fs.AutoParallel``, compiled once, every step's loss
equal to the unsharded static-shape step (tests/distributed/dynamic_checks.py); with
``dataset_strategy('data_parallel')`` a declared batch is each process's slice."""

from __future__ import annotations

import os

import pytest

from fshard import launch

# launched jobs: the full matrix (tests/test_launch.py has the quick run's one job)
pytestmark = pytest.mark.full

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dynamic_checks.py")


@pytest.mark.parametrize("processes", [2, 4])
def test_the_seeds_dynamic_network_in_a_multi_process_job(tmp_path, processes):
    result = launch.run(SCRIPT, processes, [], timeout=420, log_dir=str(tmp_path))
    assert result.ok, result.message
    for rank in range(processes):
        out = result.output(rank)
        assert "ALL CHECKS PASSED" in out, out
        assert out.count("CHECK seed step ") == 12, out
        assert out.count("CHECK AutoParallel step ") == 6, out
        assert "CHECK seed compiled 1 1 ok" in out, out
        assert "CHECK AutoParallel compiled 1 1 ok" in out, out
        # data_parallel: set_inputs declares each process's slice (MindSpore's meaning)
        assert out.count("CHECK declared slices step ") == 3, out
        assert "CHECK declared slices refuse a size the Symbol does not accept ok" in out
