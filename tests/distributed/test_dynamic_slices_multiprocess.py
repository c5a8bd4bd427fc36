"""``fs.AutoParallel`` with a declared batch and ``dataset_strategy('data_parallel')`` in
a real 2-process job: one program for every slice size, slices of different row
counts included, every step's loss and parameters equal to one process's static step
on the global batch (tests/distributed/dynamic_slices_checks.py; one launch)."""

from __future__ import annotations

import os

import pytest

from fshard import launch

# a launched job: the full matrix
pytestmark = pytest.mark.full

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dynamic_slices_checks.py")


def test_one_program_for_every_slice_size_in_a_job(tmp_path):
    result = launch.run(SCRIPT, 2, [], timeout=420, log_dir=str(tmp_path))
    assert result.ok, result.message
    for rank in range(2):
        out = result.output(rank)
        assert "ALL CHECKS PASSED" in out, out
        # 7 steps (3 slice sizes, 2 of them uneven) + 2 uneven steps of another size,
        # each a loss and 3 parameters
        assert out.count(" loss ok") == 9, out
        assert out.count(" parameter ") == 27, out
        # one trace and one compile for every slice size (it compiled once per size)
        # (over every program the AutoParallel planned)
        assert "CHECK equal slices of 3 sizes: 1 programs traced 1 compiled 1 ok" in out, out
        assert ("CHECK 4 slice sizes: 1 programs traced 1 compiled 1, the step traced 1 "
                "compiled 1 ok") in out, out
        # a global batch the declaration refuses (16 + 8 rows): planned and compiled
        # for its size, once
        assert ("CHECK uneven global batch of another size: 2 programs traced 2 compiled 2 "
                "ok") in out, out
        assert "CHECK a refused slice on one process raises on every process ok" in out, out
