"""Pipeline parallelism in real 2- and 4-process jobs (pp x dp = 2 x 1, 2 x 2, 4 x 1):
every configuration of tests/distributed/pipeline_checks.py (each process passing its
data-parallel slice of the batch, or with "full_batch" the whole batch) trains to the
losses and parameters of one process's unpipelined run on the whole batch, and its
stage transfers are collectives in each process's compiled program."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

from fshard import launch

# launched jobs: the full matrix (tests/test_launch.py has the quick run's one job)
pytestmark = pytest.mark.full

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "pipeline_checks.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

import pipeline_checks as checks  # noqa: E402
import train_pipeline as example  # noqa: E402

_COLLECTIVE = re.compile(r"\b(AllReduce|AllGather)_\d+\(")


@pytest.fixture(scope="module", params=[2, 4], ids=["2-processes", "4-processes"])
def job(request, tmp_path_factory):
    n = request.param
    out = str(tmp_path_factory.mktemp(f"pipeline{n}"))
    result = launch.run(SCRIPT, n, [out], timeout=600)
    assert result.ok, result.message + "\n" + "\n".join(
        result.output(r)[-3000:] for r in result.failed_ranks or range(n))
    ranks = []
    for r in range(n):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            ranks.append(json.load(fh))
    return n, ranks


_REFERENCES: dict = {}


def reference(model: str, chunks: int, opt: str = "momentum"):
    """One process, no pipeline, the same model: losses and final parameters."""
    key = (model, chunks, opt)
    if key not in _REFERENCES:
        losses, state, _ = example.train(checks.STEPS, model, 1, chunks=chunks, mesh=1,
                                         opt=opt)
        _REFERENCES[key] = losses, {k: v.asnumpy() for k, v in state.params.items()}
    return _REFERENCES[key]


def _close(got, want, what):
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got, want.dtype), want, rtol=1e-5,
                               atol=1e-6 * max(1.0, float(np.abs(want).max())), err_msg=what)


def test_losses_and_parameters_equal_the_unpipelined_run(job):
    n, ranks = job
    for name, model, stages, micro, sched, inter, bcast, _, *extras in checks.CONFIGS[n]:
        opt = extras[0].get("opt", "momentum") if extras else "momentum"
        ref_losses, ref_params = reference(model, stages * (2 if inter else 1), opt)
        assert ref_losses[-1] < ref_losses[0]
        owned = set()
        for r, res in enumerate(ranks):
            e = res["configs"][name]
            assert e["stage"] == r // (n // stages)
            if e["stage"] == stages - 1 or bcast:  # the last chunk is on the last stage
                _close(e["losses"], ref_losses, f"{name} rank {r} losses")
            else:  # no loss on the other stages without output_broadcast
                assert all(v is None for v in e["losses"]), (name, r)
            for k, v in e["owned"].items():
                _close(v, ref_params[k], f"{name} rank {r} {k}")
                owned.add(k)
            for k, v in e["gathered"].items():
                _close(v, ref_params[k], f"{name} rank {r} gathered {k}")
            assert e["kept"] == sorted(e["owned"]), (name, r)  # its stage's alone
            for k, v in e["params"].items():  # ap.gather(state): what a save writes
                _close(v, ref_params[k], f"{name} rank {r} gathered state.params {k}")
            for a, b in zip(e["opt_state"], ranks[0]["configs"][name]["opt_state"]):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} rank {r} opt_state")
        assert owned == set(ref_params), name  # every parameter trained by some stage


def test_stage_transfers_are_collectives_in_every_process(job):
    n, ranks = job
    for name, *_ in checks.CONFIGS[n]:
        for r, res in enumerate(ranks):
            programs = res["configs"][name]["transfer_programs"]
            assert programs, (name, r)
            for key, text in programs.items():
                # the CPU emulation of a point-to-point transfer: one collective over
                # the pipeline group per round and direction
                assert len(_COLLECTIVE.findall(text)) == 1, (name, r, key, text)


def test_model_parallel_stages_communicate_inside_the_stage(job):
    """With model_parallel the stage's first chunk is one fs.shard over the stage's
    processes: its per-device program has collectives, and they are in the compiled
    program of every process."""
    n, ranks = job
    configs = [c for c in checks.CONFIGS[n] if c[8:] and c[8].get("mp")]
    assert configs or n == 2
    for name, *_ in configs:
        for r, res in enumerate(ranks):
            e = res["configs"][name]["stage_collectives"]
            assert e["collectives"], (name, r)
            assert _COLLECTIVE.findall(e["lowered"]), (name, r)
