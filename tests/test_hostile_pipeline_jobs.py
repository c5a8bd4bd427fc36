"""``fs.RemoteArray``, the leaf of a pipelined job's state that another stage's
processes keep (the jobs themselves: tests/distributed/test_pipeline_state_multiprocess.py):
every read of its values is refused with the fix, a checkpoint will not save it, a load
gives it back as it is, and a first pipelined step refuses a state holding one."""

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
    with pytest.raises(fs.CheckpointError, match=r"leaf \['w2'\] is an fs.RemoteArray: "
                       r"pipeline stage 1's, which only its processes \[2, 3\] keep .*\n"
                       r"Fix: save ap.gather\(state\)"):
        fs.checkpoint.save(tmp_path / "a", state)
    assert not (tmp_path / "a").exists()
    with pytest.raises(fs.CheckpointError, match="is an fs.RemoteArray"):
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
