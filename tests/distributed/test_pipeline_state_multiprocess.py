"""A pipelined job's update split by stage, in real 2- and 4-process jobs (2 stages x 1
and x 2 processes): each process keeps and updates only its own stage's parameters and
optimizer state (the other stages' leaves of its state are ``fs.RemoteArray``) and the
leaves no stage owns (Adam's step count, the loss scale), so it keeps the stage's share
``P / S`` (the formula, checked in bytes, and by ``memory_report``); the losses and the
gathered parameters and optimizer state equal one process's unpipelined run (Adam, a
global-norm clip whose norm combines the stages' partial sums, loss scaling with a NaN
gradient in stage 1 only, a state scalar summed over every stage); an update that
mixes the stages otherwise keeps the whole state on every process; and the refused
calls (reading another stage's leaf, saving the split state, a new AutoParallel's first
step on it) say the fix. One launch per job size runs every check
(tests/distributed/pipeline_state_checks.py)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import fshard as fs
from fshard import launch

# launched jobs: the full matrix
pytestmark = pytest.mark.full

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "pipeline_state_checks.py")
sys.path.insert(0, HERE)

import pipeline_state_checks as checks  # noqa: E402

STAGE_OF = {"w1": 0, "b1": 0, "w2": 1, "b2": 1}


@pytest.fixture(scope="module", params=[2, 4], ids=["2x1-processes", "2x2-processes"])
def job(request, tmp_path_factory):
    n = request.param
    out = str(tmp_path_factory.mktemp(f"pipeline_state{n}"))
    result = launch.run(SCRIPT, n, [out], timeout=600)
    assert result.ok, result.message + "\n" + "\n".join(
        result.output(r)[-3000:] for r in result.failed_ranks or range(n))
    ranks = []
    for r in range(n):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            ranks.append(json.load(fh))
    return n, ranks


_REFERENCES: dict = {}


def reference(opt: str, loss_name: str):
    """One process, no pipeline, the whole batch: losses, parameters, optimizer state."""
    key = (opt, loss_name)
    if key not in _REFERENCES:
        params, batches = checks.data()
        ap = fs.AutoParallel(checks.LOSSES[loss_name], checks.optimizer(opt), mesh=1)
        state = ap.init(params)
        losses = []
        for batch in batches[:checks.STEPS]:
            state, l = ap(state, *batch)
            losses.append(float(l.asnumpy()))
        _REFERENCES[key] = (losses, {k: v.asnumpy() for k, v in state.params.items()},
                            [np.asarray(x.asnumpy()) for x in fs.tree.leaves(state.opt_state)])
    return _REFERENCES[key]


def _close(got, want, what):
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64).reshape(want.shape), want,
                               rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(want).max())),
                               err_msg=what)


def test_losses_parameters_and_state_equal_the_unpipelined_run(job):
    n, ranks = job
    dp = n // 2
    for name, opt, loss_name, _, _, bcast in checks.CONFIGS:
        ref_losses, ref_params, ref_opt = reference(opt, loss_name)
        for r, res in enumerate(ranks):
            e = res["configs"][name]
            if r // dp == 1 or bcast:
                _close(e["losses"], ref_losses, f"{name} rank {r} losses")
            else:  # no loss on stage 0 without output_broadcast
                assert e["losses"] == [None] * checks.STEPS, (name, r)
            for k, want in ref_params.items():
                _close(e["params"][k], want, f"{name} rank {r} {k}")
                _close(e["gathered_params"][k], want, f"{name} rank {r} gathered {k}")
            assert len(e["opt_state"]) == len(ref_opt), name
            for i, (got, want) in enumerate(zip(e["opt_state"], ref_opt)):
                _close(got, want, f"{name} rank {r} opt_state leaf {i}")
            assert e["step"] == checks.STEPS


def test_every_step_skipped_when_stage_1_alone_has_a_nan_gradient(job):
    """Loss scaling's finiteness test combines both stages' partial sums: stage 0,
    whose gradients are finite, skips the step too."""
    params, _ = checks.data()
    _, ranks = job
    for res in ranks:
        e = res["configs"]["loss_scaled_nan"]
        for k, v in params.items():
            np.testing.assert_array_equal(np.asarray(e["params"][k]).reshape(v.shape), v)


def test_each_process_keeps_its_stages_share(job):
    """Per process: its stage's parameters (P / S, the embedding-free MLP's two layers)
    and their optimizer state, plus the leaves no stage owns; memory_report says so."""
    n, ranks = job
    dp = n // 2
    params, _ = checks.data()
    own = [sum(v.nbytes for k, v in params.items() if STAGE_OF[k] == s) for s in (0, 1)]
    total = sum(own)
    for name, opt, loss_name, *_ in checks.CONFIGS:
        ref_opt = reference(opt, loss_name)[2]
        opt_total = sum(x.nbytes for x in ref_opt)
        copies = {"adam": 2, "clipped": 2, "loss_scaled": 2, "summarising": 0,
                  "mixing": 1}[opt]  # optimizer-state leaves per parameter
        shared = opt_total - copies * total  # (step count, loss scale, the scalar)
        for r, res in enumerate(ranks):
            e = res["configs"][name]
            s = r // dp
            report = e["report"]
            assert report["stages"] == [{"params": b, "grads": b,
                                         "optimizer_state": copies * b} for b in own], name
            if name == "mixing":  # the update reads two stages: every process keeps all
                assert report["update"] == "whole", name
                assert "other than by a sum, maximum or minimum" in report["whole_because"]
                assert e["state_bytes"] == {"params": total, "opt_state": opt_total}
                assert all(e["kept"].values()) and not any(e["remote_opt"])
                continue
            assert report["update"] == "per_stage", name
            assert e["kept"] == {k: STAGE_OF[k] == s for k in params}, (name, r)
            assert e["state_bytes"] == {"params": own[s],
                                        "opt_state": copies * own[s] + shared}, (name, r)
            # the most any process keeps: stage 0's share
            assert (report["params"], report["grads"], report["optimizer_state"]) == (
                own[0], own[0], copies * own[0] + shared), name


def test_refused_calls_say_the_fix(job):
    n, ranks = job
    dp = n // 2
    for r, res in enumerate(ranks):
        e = res["errors"]
        other = 1 - r // dp
        holders = list(range(other * dp, (other + 1) * dp))
        for what in ("asnumpy", "eager", "gather_sharded"):
            assert e[what].startswith("ProcessLocalError: "), (what, e[what])
            assert f"it is pipeline stage {other}'s parameter or optimizer state, which " \
                f"only that stage's processes {holders} keep (an fs.RemoteArray)" in e[what]
            assert "Fix: call ap.gather_params(state)" in e[what]
        assert e["asnumpy"].startswith("ProcessLocalError: .asnumpy() needs the values")
        assert e["save"].startswith("CheckpointError: fs.checkpoint.save: leaf ")
        assert "is an fs.RemoteArray" in e["save"] and "Fix: save ap.gather(state)" in e["save"]
        assert e["fresh_ap"].startswith("ArgumentError: ") and "Fix: pass the whole state " \
            "to the first step" in e["fresh_ap"]
        assert e["repr"].startswith("RemoteArray(f32[")
        mine = "w1" if r // dp == 0 else "w2"
        assert e["own_remote"] == (
            f"ArgumentError: AutoParallel(loss)(state, *batch): state.params['{mine}'] is "
            f"an fs.RemoteArray (kept by stage {r // dp}'s processes "
            f"{list(range(r // dp * dp, (r // dp + 1) * dp))}), but this process (rank "
            f"{r}) is stage {r // dp}'s, which keeps and updates that leaf.\nFix: pass "
            "each process the state its own previous step returned (or the whole state: "
            "ap.init(params), ap.gather(state)).\nSee docs/errors.md#argumenterror"), \
            e["own_remote"]


def test_a_checkpoint_of_the_gathered_state_loads_split_and_whole(job):
    """Saved from ap.gather(state); loaded into the split state (each process reads its
    own stage's leaves, the others stay RemoteArrays) and into ap.init(params) (whole):
    one more step from either equals one more step from the state itself."""
    n, ranks = job
    dp = n // 2
    for r, res in enumerate(ranks):
        e = res["errors"]
        assert e["load_split_kept"] == {k: STAGE_OF[k] == r // dp for k in STAGE_OF}
        assert e["load_split_equal"] and e["load_whole_equal"] and e["resume_equal"]
        l1, l2, l3 = e["resume_losses"]
        if r // dp == 1:  # (stage 0 has no loss without output_broadcast)
            assert l1 == l2 == l3


def test_a_batch_of_another_shape_takes_the_split_state(job):
    """A smaller last batch after the first step: the split state trains on it (the
    micro-batch losses combine as the first step found), as the whole state does."""
    n, ranks = job
    dp = n // 2
    for r, res in enumerate(ranks):
        e = res["errors"]
        assert e["half_equal"] and e["half_kept"] == {k: STAGE_OF[k] == r // dp
                                                      for k in STAGE_OF}
        if r // dp == 1:
            a, b = e["half_losses"]
            assert a == b and np.isfinite(a)
