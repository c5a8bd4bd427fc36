"""A pipelined job's update split by stage, in real 2- and 4-process jobs (2 stages x 1
and x 2 processes): each process keeps and updates only its own stage's parameters and
optimizer state (the other stages' leaves of its state are ``fs.RemoteArray``) and the
leaves no stage owns (Adam's step count, the loss scale), so it keeps the stage's share
``P / S`` (the formula, checked in bytes, and by ``memory_report``); the losses and the
gathered parameters and optimizer state equal one process's unpipelined run (Adam, a
global-norm clip whose norm combines the stages' partial sums, loss scaling with a NaN
gradient in stage 1 only, a state scalar summed over every stage); an update that
mixes the stages otherwise keeps the whole state on every process; the split state is
saved as it is, each process writing its own stage's leaves (dealt out in row blocks
between a stage's data-parallel processes), and loads back split (each process reading
its stage's blocks), whole into a fresh AutoParallel and whole in one process (equal to
``ap.gather(state)``), the runs resumed from it continuing the uninterrupted one; and
the refused calls (reading another stage's leaf, saving a state no process holds a leaf
of, a new AutoParallel's first step on a split state) say the fix. One launch per job
size runs every check (tests/distributed/pipeline_state_checks.py)."""

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


# -- the split state's checkpoint ---------------------------------------------------------


def _stage(path: str):
    """The stage keeping a leaf of the adam state, by its key path (None: no stage's)."""
    return next((s for k, s in STAGE_OF.items() if f"'{k}'" in path), None)


def _index(res) -> dict:
    with open(os.path.join(res["split_checkpoint"]["dir"], "index.json")) as fh:
        return json.load(fh)


def _like():
    params, _ = checks.data()
    return fs.AutoParallel(checks.loss, checks.optimizer("adam"), mesh=1).init(params)


def test_a_background_save_of_the_split_state_equals_the_saved_one(job):
    """``save(wait=False)`` of the split state, a step running meanwhile: the same
    files, block for block, as the synchronous save of the same state, and nothing of
    the writing left in the directory."""
    from safetensors.numpy import load_file

    _, ranks = job
    split = ranks[0]["split_checkpoint"]
    for res in ranks:
        assert res["split_checkpoint"]["async_dir"] == split["async_dir"]
    d, a = split["dir"], split["async_dir"]
    assert a != d and os.path.basename(a) == os.path.basename(d)
    assert sorted(os.listdir(a)) == sorted(os.listdir(d))
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            want, got = load_file(os.path.join(d, f)), load_file(os.path.join(a, f))
            assert sorted(got) == sorted(want), f
            for k in want:
                assert got[k].dtype == want[k].dtype and got[k].tobytes() == \
                    want[k].tobytes(), (f, k)
    with open(os.path.join(a, "index.json")) as fh:
        assert json.load(fh)["leaves"] == _index(ranks[0])["leaves"]


def test_the_split_state_is_saved_by_each_stages_processes(job):
    """Each stage's leaves are written by that stage's processes only (a stage of two
    processes deals each leaf's rows out between them), the leaves no stage owns by
    process 0; every row is written once, with the values of ap.gather(state); no
    gather ran during the save and the state stayed split."""
    from safetensors.numpy import load_file

    n, ranks = job
    dp = n // 2
    for res in ranks:  # (every process got the same directory)
        assert res["split_checkpoint"]["dir"] == ranks[0]["split_checkpoint"]["dir"]
    d = ranks[0]["split_checkpoint"]["dir"]
    index = _index(ranks[0])
    assert index["processes"] == n and sorted(index["files"]) == [
        f"shard-{r:05d}-of-{n:05d}.safetensors" for r in range(n)]
    assert not any(f.startswith(("holds-", "done-", ".lock")) for f in os.listdir(d))
    gathered = fs.checkpoint.load(os.path.join(os.path.dirname(os.path.dirname(d)),
                                               "gathered"), like=_like())
    whole = dict(zip((e["path"] for e in index["leaves"]),
                     (x.asnumpy() for x in fs.tree.leaves(gathered))))
    files = {f: load_file(os.path.join(d, f)) for f in index["files"]}
    written = {f: set() for f in files}
    for e in index["leaves"]:
        s = _stage(e["path"])
        rows = e["shape"][0] if e["shape"] else None
        if s is None:  # Adam's step count, the train step: process 0's, whole
            assert "holders" not in e and len(e["blocks"]) == 1, e
            assert e["blocks"][0]["file"] == f"shard-00000-of-{n:05d}.safetensors"
        else:
            holders = list(range(s * dp, (s + 1) * dp))
            assert (e["stage"], e["holders"]) == (s, holders), e
            assert [b["file"] for b in e["blocks"]] == [
                f"shard-{r:05d}-of-{n:05d}.safetensors" for r in holders], e
            assert [(b["start"][0], b["stop"][0]) for b in e["blocks"]] == [
                (j * rows // dp, (j + 1) * rows // dp) for j in range(dp)], e
        covered = 0
        for b in e["blocks"]:
            block = files[b["file"]][b["key"]]
            want = whole[e["path"]][tuple(slice(a, z) for a, z in zip(b["start"], b["stop"]))]
            assert block.dtype == want.dtype and block.tobytes() == want.tobytes(), b
            written[b["file"]].add(b["key"])
            covered += block.size
        assert covered == whole[e["path"]].size, e  # every element once
    for r in range(n):
        f = f"shard-{r:05d}-of-{n:05d}.safetensors"
        assert set(files[f]) == written[f]  # nothing else in the file
        stages = {_stage(e["path"]) for e in index["leaves"]
                  for b in e["blocks"] if b["file"] == f}
        assert stages == ({r // dp, None} if r == 0 else {r // dp}), (r, stages)
    for r, res in enumerate(ranks):
        e = res["split_checkpoint"]
        # the state is still split: its other stage's leaves hold nothing
        assert e["state_kept"] == [_stage(p) in (None, r // dp)
                                   for p in (x["path"] for x in index["leaves"])], r
        assert e["save_s"] > 0 and e["gather_save_s"] > 0


def test_the_split_checkpoint_loads_split_reading_only_the_stages_blocks(job):
    n, ranks = job
    dp = n // 2
    index = _index(ranks[0])
    paths = [e["path"] for e in index["leaves"]]
    for r, res in enumerate(ranks):
        e = res["split_checkpoint"]
        own = [p for p in paths if _stage(p) in (None, r // dp)]
        assert sorted({leaf for _, _, leaf in e["split_reads"]}) == sorted(own), r
        files = {f for f, _, _ in e["split_reads"]}
        assert files <= {f"shard-{q:05d}-of-{n:05d}.safetensors"
                         for q in [0] + list(range(r // dp * dp, (r // dp + 1) * dp))}, r
        assert e["split_kept"] == e["state_kept"] and e["split_equal"], r
        # a fresh AutoParallel's whole state reads every leaf
        assert sorted({leaf for _, _, leaf in e["whole_reads"]}) == sorted(paths)


def test_resuming_from_the_split_checkpoint_continues_the_run(job):
    """Two steps from the split state loaded back, and from a fresh AutoParallel's
    whole state loaded from the same checkpoint, equal two steps from the state itself,
    bit for bit (losses on the last stage; every gathered leaf)."""
    n, ranks = job
    dp = n // 2
    for r, res in enumerate(ranks):
        e = res["split_checkpoint"]
        assert e["resume_equal"], r
        if r // dp == 1:
            own, split, fresh = e["resume_losses"]
            assert own == split == fresh and all(np.isfinite(own)), e["resume_losses"]


def test_the_split_checkpoint_loads_whole_in_one_process_and_on_a_virtual_mesh(job):
    """Read by one process it is ap.gather(state): the checkpoint saved from the
    gathered state, and the gathered parameters and optimizer state the job reported;
    on a virtual mesh of 2 a pipelined AutoParallel resumes from it with the job's
    losses."""
    _, ranks = job
    d = ranks[0]["split_checkpoint"]["dir"]
    root = os.path.dirname(os.path.dirname(d))
    like = _like()
    back = fs.checkpoint.load(d, like=like)
    gathered = fs.checkpoint.load(os.path.join(root, "gathered"), like=like)
    for a, b in zip(fs.tree.leaves(back), fs.tree.leaves(gathered)):
        assert a.asnumpy().dtype == b.asnumpy().dtype
        assert a.asnumpy().tobytes() == b.asnumpy().tobytes()
    reported = ranks[0]["configs"]["adam"]
    for k, v in back.params.items():
        np.testing.assert_array_equal(
            v.asnumpy(), np.asarray(reported["gathered_params"][k], np.float32).reshape(
                v.shape))
    for got, want in zip(fs.tree.leaves(back.opt_state), reported["opt_state"]):
        np.testing.assert_array_equal(np.asarray(got.asnumpy(), np.float64).ravel(), want)
    assert int(back.step.asnumpy()) == checks.STEPS
    on2 = fs.checkpoint.load(d, like=like, mesh=2)
    for a, b in zip(fs.tree.leaves(on2), fs.tree.leaves(back)):
        assert a.asnumpy().tobytes() == b.asnumpy().tobytes()
    _, batches = checks.data()
    ap = fs.AutoParallel(checks.loss, checks.optimizer("adam"), mesh=2)
    ap.pipeline(stages=2, micro_batches=4, scheduler="1f1b")
    state, l1 = ap(on2, *batches[checks.STEPS])
    state, l2 = ap(state, *batches[0])
    want = ranks[-1]["split_checkpoint"]["resume_losses"][0]  # (the last stage's)
    _close([float(l1.asnumpy()), float(l2.asnumpy())], want, "virtual mesh resume")


def test_refused_saves_of_a_split_state_say_the_fix(job):
    """Every process refuses alike (they settle who holds what together): a leaf no
    process holds, processes saving different states, layouts for a stage's leaf."""
    n, ranks = job
    dp = n // 2
    stage0 = list(range(dp))
    for res in ranks:
        e = res["split_checkpoint"]
        assert e["no_holder"] == (
            "CheckpointError: fs.checkpoint.save: no process holds the values of leaf "
            "[0]['w1']: it is an fs.RemoteArray (pipeline stage 0's, kept by processes "
            f"{stage0}) on every process of this job, so none can write it.\nFix: call "
            "save in every process of the pipelined job, each with the state its own step "
            "returned (stage 0's processes hold that leaf), or save ap.gather(state) there "
            "(a collective).\nSee docs/errors.md#checkpointerror"), e["no_holder"]
        assert e["mismatch"] == (
            "CheckpointError: fs.checkpoint.save: the processes of this job save different "
            "states: leaf ['x'] is an array float32[4] on process 0 and an array "
            "float32[8] on process 1.\nFix: call save in every process with the same state "
            "(each process's own step's result).\nSee docs/errors.md#checkpointerror")
        assert e["layouts"] == (
            "CheckpointError: fs.checkpoint.save(..., layouts): layouts splits leaf "
            f"[0]['w1'] as [2, 1], but only processes {stage0} of this job hold it (a "
            "pipeline stage's leaf, an fs.RemoteArray on the others): a stage's leaf is "
            "written by its own processes, in row blocks dealt out between them.\nFix: "
            "give None for the leaves of a pipelined state split by stage (or leave "
            "layouts out).\nSee docs/errors.md#checkpointerror")
    # saved again after the refusal, with the state each process's step returned
    retry = ranks[0]["split_checkpoint"]["retry"]
    assert all(res["split_checkpoint"]["retry"] == retry for res in ranks)
    assert not any(f.startswith("holds-") for f in os.listdir(retry))
    like = _like()
    for a, b in zip(fs.tree.leaves(fs.checkpoint.load(retry, like=like)),
                    fs.tree.leaves(fs.checkpoint.load(ranks[0]["split_checkpoint"]["dir"],
                                                      like=like))):
        assert a.asnumpy().tobytes() == b.asnumpy().tobytes()
