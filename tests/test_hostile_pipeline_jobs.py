"""``fs.RemoteArray``, the leaf of a pipelined job's state that another stage's
processes keep (the jobs themselves: tests/distributed/test_pipeline_state_multiprocess.py):
every read of its values is refused with the fix, a checkpoint of one process will not
save it (no other process holds it), a load gives it back as it is, and a first
pipelined step refuses a state holding one; threads standing in for the processes of a
job save a split state, each leaf by the processes holding it."""

from __future__ import annotations

import numpy as np
import pytest

import fshard as fs


def _remote():
    return fs.RemoteArray((64, 32), fs.dtypes.float32, 1, (2, 3), 0)


def test_its_type_and_repr():
    x = _remote()
    assert fs.typeof(x) == fs.ArrayType((64, 32), fs.dtypes.float32)
    assert (x.ndim, x.size, x.stage, x.holders, x.rank) == (2, 2048, 1, (2, 3), 0)
    assert repr(x) == ("RemoteArray(f32[64,32], kept by pipeline stage 1: processes [2, 3]; "
                       "process 0 holds none of it)")
    assert fs.tree.leaves({"w": x}) == [x]


@pytest.mark.parametrize("what, call", [
    (".asnumpy()", lambda x: x.asnumpy()),
    ("numpy.asarray()", np.asarray),
    ("float()", float),
    ("the eager operator '+'", lambda x: x + 1),
    ("the eager operator '@'", lambda x: x @ np.ones((32, 2), np.float32)),
    ("the Tensor method .sum", lambda x: x.sum()),
    ("indexing x[...]", lambda x: x[0]),
    ("the eager operation 'add'", lambda x: fs.ops.add(x, 1.0)),
    ("fs.gather_sharded", lambda x: fs.gather_sharded({"w": x})),
])
def test_every_read_is_refused_with_the_fix(what, call):
    with pytest.raises(fs.ProcessLocalError) as e:
        call(_remote())
    assert str(e.value).startswith(
        f"{what} needs the values of a f32[64,32] array, but process 0 holds none of it: "
        "it is pipeline stage 1's parameter or optimizer state, which only that stage's "
        "processes [2, 3] keep (an fs.RemoteArray).\nFix: call ap.gather_params(state) "
        "(the parameters) or ap.gather(state) (the whole state) in every process first")
    assert isinstance(e.value, TypeError)


def test_a_missing_attribute_is_an_attribute_error():
    assert not hasattr(_remote(), "no_such_thing")


def test_a_checkpoint_refuses_it_and_loads_around_it(tmp_path):
    state = {"w1": np.ones((4, 2), np.float32), "w2": _remote()}
    # (in one process no other process can write it; in the pipelined job its stage's
    # processes do: tests/distributed/test_pipeline_state_multiprocess.py)
    with pytest.raises(fs.CheckpointError) as e:
        fs.checkpoint.save(tmp_path / "a", state)
    assert str(e.value) == (
        "fs.checkpoint.save: no process holds the values of leaf ['w2']: it is an "
        "fs.RemoteArray (pipeline stage 1's, kept by processes [2, 3]) on this process, "
        "which is not in a job with those processes, so none can write it.\nFix: call "
        "save in every process of the pipelined job, each with the state its own step "
        "returned (stage 1's processes hold that leaf), or save ap.gather(state) there "
        "(a collective).\nSee docs/errors.md#checkpointerror")
    assert not (tmp_path / "a").exists() and not list(tmp_path.iterdir())
    with pytest.raises(fs.CheckpointError, match="no process holds the values of leaf"):
        fs.checkpoint.save(tmp_path / "b", state, wait=False).wait()
    whole = {"w1": np.ones((4, 2), np.float32), "w2": np.full((64, 32), 2.0, np.float32)}
    path = fs.checkpoint.save(tmp_path / "c", whole)
    got = fs.checkpoint.load(path, like=state)
    assert got["w2"] is state["w2"]  # another stage's processes load it
    np.testing.assert_array_equal(got["w1"].asnumpy(), whole["w1"])
    with pytest.raises(fs.CheckpointError, match=r"was saved as float32\[64, 32\]"):
        fs.checkpoint.load(path, like={"w1": whole["w1"], "w2": fs.RemoteArray(
            (64, 16), fs.dtypes.float32, 1, (1,), 0)})


def test_a_first_pipelined_step_needs_the_whole_state():
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(0, 0.1, (8, 16)).astype(np.float32),
              "w2": rng.normal(0, 0.1, (16, 4)).astype(np.float32)}

    def loss(p, x):
        return (fs.pipeline_split(x @ p["w1"]) @ p["w2"]).mean()

    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=2).pipeline(stages=2)
    state = ap.init(params)
    assert ap.gather(state) is state  # (a virtual mesh: whole already)
    state = state._replace(params={"w1": state.params["w1"], "w2": fs.RemoteArray(
        (16, 4), fs.dtypes.float32, 1, (1,), 0)})
    with pytest.raises(fs.ArgumentError, match=r"evaluates the loss once on the whole "
                       r"parameters.*\nFix: pass the whole state to the first step"):
        ap(state, np.ones((4, 8), np.float32))


def _as_processes(monkeypatch, n, work):
    """Run ``work(rank)`` in ``n`` threads, each seen by fs.checkpoint as process
    ``rank`` of an ``n``-process job (the real jobs:
    tests/distributed/test_pipeline_state_multiprocess.py); return their results."""
    import threading

    from fshard.training import checkpoint as ckpt

    local = threading.local()
    monkeypatch.setattr(ckpt, "_world", lambda: (local.rank, n))
    monkeypatch.setattr(ckpt, "_next_attempt", lambda final: 1)  # (one per process)
    monkeypatch.setenv("MS_SCHED_PORT", "1")
    results: list = [None] * n

    def run(r):
        local.rank = r
        try:
            results[r] = work(r)
        except Exception as e:  # noqa: BLE001  (reported below)
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_a_split_state_is_saved_by_the_processes_holding_each_leaf(tmp_path, monkeypatch):
    """Three processes: stage 0 is process 0's, stage 1 processes 1 and 2's (data-parallel
    copies). Each stage's leaves are written by its processes only (stage 1's rows dealt
    out between its two), the leaf every process holds by process 0; loaded in one
    process the checkpoint is the whole state."""
    from safetensors.numpy import load_file

    whole = {"w1": np.arange(12, dtype=np.float32).reshape(4, 3),
             "w2": np.arange(15, dtype=np.float32).reshape(5, 3) + 100,
             "b2": np.float32(7), "count": np.int32(3)}
    stage = {"w1": 0, "w2": 1, "b2": 1}
    holders = {0: (0,), 1: (1, 2)}

    def state_of(r):
        s = 0 if r == 0 else 1
        return {k: v if stage.get(k, s) == s else fs.RemoteArray(
            np.shape(v), fs.typeof(v).dtype, stage[k], holders[stage[k]], r)
            for k, v in whole.items()}

    got = _as_processes(monkeypatch, 3, lambda r: fs.checkpoint.save(
        tmp_path, state_of(r), step=5, timeout=30))
    assert got == [str(tmp_path / "5")] * 3, got
    monkeypatch.undo()
    d = tmp_path / "5"
    index = _index_of(d)
    blocks = {e["path"]: [(b["file"][6:11], b["start"], b["stop"]) for b in e["blocks"]]
              for e in index["leaves"]}
    assert blocks == {"['b2']": [("00001", [], [])],  # 0-d: the stage's first process
                      "['count']": [("00000", [], [])],
                      "['w1']": [("00000", [0, 0], [4, 3])],
                      "['w2']": [("00001", [0, 0], [2, 3]), ("00002", [2, 0], [5, 3])]}
    held = {e["path"]: (e.get("stage"), e.get("holders")) for e in index["leaves"]}
    assert held == {"['b2']": (1, [1, 2]), "['count']": (None, None),
                    "['w1']": (0, [0]), "['w2']": (1, [1, 2])}
    assert sorted(load_file(str(d / "shard-00002-of-00003.safetensors"))) == ["3:1,0"]
    back = fs.checkpoint.load(d, like=whole)
    for k, v in whole.items():
        assert back[k].asnumpy().tobytes() == np.asarray(v).tobytes(), k
    # process 1's split state: its stage's leaves read, stage 0's given back as they are
    like = state_of(1)
    split = fs.checkpoint.load(d, like=like)
    assert split["w1"] is like["w1"]
    np.testing.assert_array_equal(split["w2"].asnumpy(), whole["w2"])


def test_saves_of_a_split_state_that_cannot_be_written_are_refused_everywhere(
        tmp_path, monkeypatch):
    def remote(r, stage, holders):
        return fs.RemoteArray((4, 2), fs.dtypes.float32, stage, holders, r)

    got = _as_processes(monkeypatch, 2, lambda r: fs.checkpoint.save(
        tmp_path / "a", {"w": remote(r, 1, (1,))}, timeout=30))
    for e in got:
        assert isinstance(e, fs.CheckpointError) and str(e).startswith(
            "fs.checkpoint.save: no process holds the values of leaf ['w']: it is an "
            "fs.RemoteArray (pipeline stage 1's, kept by processes [1]) on every process "
            "of this job, so none can write it."), e
    got = _as_processes(monkeypatch, 2, lambda r: fs.checkpoint.save(
        tmp_path / "b", {"w": np.ones((4, 2), np.float32)} if r else
        {"w": np.ones((4, 2), np.float32), "v": np.ones(2, np.float32)}, timeout=30))
    for e in got:
        assert isinstance(e, fs.CheckpointError) and str(e).startswith(
            "fs.checkpoint.save: the processes of this job save states of different "
            "structures"), e
    got = _as_processes(monkeypatch, 2, lambda r: fs.checkpoint.save(
        tmp_path / "c", {"w": np.ones((4, 2), np.float32) if r else remote(r, 1, (1,))},
        layouts={"w": (2, 1)}, timeout=30))
    for e in got:
        assert isinstance(e, fs.CheckpointError) and str(e).startswith(
            "fs.checkpoint.save(..., layouts): layouts splits leaf ['w'] as [2, 1], but "
            "only processes [1] of this job hold it"), e
    assert not any((tmp_path / d).exists() for d in "abc")


def _index_of(d):
    import json

    with open(d / "index.json") as fh:
        return json.load(fh)
