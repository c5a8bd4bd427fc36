"""fs.checkpoint: bit-exact round trips, sharded writing, atomicity, every corruption an
error naming the file and the leaf, exact resumption of training, MindSpore and
safetensors interoperability. (Multi-process saves: tests/distributed.)"""

from __future__ import annotations

import json
import os
import re
import struct
import threading

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs
from fshard import checkpoint as ckpt


def n(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def _index(d):
    with open(os.path.join(d, "index.json")) as fh:
        return json.load(fh)


def same_bits(a, b):
    a, b = n(a), n(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def state_of_every_dtype(rng):
    f32 = rng.standard_normal((4, 6)).astype(np.float32)
    f32[0, 0], f32[0, 1], f32[0, 2] = np.nan, np.inf, -0.0
    return {
        "f32": f32,
        "f64": rng.standard_normal(5),
        "f16": rng.standard_normal((2, 3)).astype(np.float16),
        "i32": rng.integers(-2**31, 2**31 - 1, (3,), dtype=np.int32),
        "i64": np.array([-(2**62), 2**62], np.int64),
        "u8": np.arange(8, dtype=np.uint8),
        "u32": np.array([0, 2**32 - 1], np.uint32),
        "bool": np.array([True, False, True]),
        "scalar": np.float32(3.5),
        "nested": [ms.Tensor(np.ones((2, 2), np.float32)), (np.int32(7), {"e": np.zeros(0)})],
    }


def test_round_trip_is_bit_identical_for_every_dtype(tmp_path):
    state = state_of_every_dtype(np.random.default_rng(0))
    d = ckpt.save(tmp_path, state, step=3)
    assert d == str(tmp_path / "3") and ckpt.latest(tmp_path) == d
    back = ckpt.load(d, state)
    assert fs.tree.structure(back) == fs.tree.structure(state)
    for a, b in zip(fs.tree.leaves(back), fs.tree.leaves(state)):
        same_bits(a, b)
    assert ckpt.load(tmp_path, state)["u32"].asnumpy().tolist() == [0, 2**32 - 1]  # latest


def test_the_index_describes_every_leaf_and_the_files_are_safetensors(tmp_path):
    state = {"w": np.ones((4, 2), np.float32), "step": np.int32(0)}
    d = ckpt.save(tmp_path / "c", state)
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    assert index["format"] == "fshard-checkpoint" and index["processes"] == 1
    leaves = {e["path"]: e for e in index["leaves"]}
    assert leaves["['w']"]["shape"] == [4, 2] and leaves["['w']"]["dtype"] == "float32"
    (file, info), = index["files"].items()
    raw = (tmp_path / "c" / file).read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    assert json.loads(raw[8:8 + header_len])["__metadata__"]["format"] == "fshard-checkpoint"
    assert info["bytes"] == len(raw)
    assert sorted(os.listdir(d)) == sorted(["index.json", file])  # no markers left


@pytest.mark.parametrize("layouts", [
    {"w": (4, 2), "b": (8,), "s": None},
    {"w": (2, 1), "b": (2,), "s": None},
    {"w": fs.Layout((2, 4), ("dp", "mp"))("mp", "dp"), "b": None, "s": None},
])
def test_sharded_layouts_write_each_block_once(tmp_path, layouts):
    rng = np.random.default_rng(1)
    state = {"w": rng.standard_normal((8, 8)).astype(np.float32),
             "b": rng.standard_normal(16).astype(np.float32), "s": np.int32(5)}
    d = ckpt.save(tmp_path, state, step=1, layouts=layouts, mesh=8)
    index = _index(d)
    for e in index["leaves"]:
        cover = np.zeros(e["shape"], np.int32)
        for b in e["blocks"]:
            cover[tuple(slice(s, t) for s, t in zip(b["start"], b["stop"]))] += 1
        assert (cover == 1).all(), e["path"]  # every element in exactly one block
    w = next(e for e in index["leaves"] if e["path"] == "['w']")
    spec = layouts["w"]
    want = np.prod(spec.to_strategy() if hasattr(spec, "to_strategy") else spec)
    assert len(w["blocks"]) == want
    back = ckpt.load(d, state)
    for k in state:
        same_bits(back[k], state[k])


def test_layouts_from_an_auto_parallel_plan(tmp_path):
    def loss(p, x, y):
        return ((x @ p["w"] + p["b"] - y) ** 2).mean()

    ap = fs.AutoParallel(loss, fs.optim.adam(1e-2), mesh=4).hsdp(threshold=0, optimizer_level="level3")
    params = {"w": np.ones((8, 2), np.float32), "b": np.zeros((2,), np.float32)}
    state = ap.init(params)
    x, y = np.ones((8, 8), np.float32), np.ones((8, 2), np.float32)
    layouts = ap.state_strategies(state, x, y)
    assert layouts.params["w"] == (4, 1)  # ZeRO level3: parameters split over 4
    d = ckpt.save(tmp_path, state, step=0, layouts=layouts, mesh=4)
    index = _index(d)
    w = next(e for e in index["leaves"] if e["path"].endswith("['w']")
             and e["path"].startswith("[0]"))
    assert len(w["blocks"]) == 4
    for a, b in zip(fs.tree.leaves(ckpt.load(d, state)), fs.tree.leaves(state)):
        same_bits(a, b)


def test_latest_ignores_unfinished_saves_and_never_overwrites(tmp_path):
    state = {"w": np.ones(3, np.float32)}
    assert ckpt.latest(tmp_path) is None and ckpt.latest(tmp_path / "nope") is None
    ckpt.save(tmp_path, state, step=1)
    ckpt.save(tmp_path, state, step=10)
    ckpt.save(tmp_path, state, step=2)
    (tmp_path / ".tmp-11-123-0").mkdir()  # a save that died
    (tmp_path / "12").mkdir()  # not a checkpoint (no index)
    (tmp_path / "notes").mkdir()
    assert ckpt.latest(tmp_path) == str(tmp_path / "10")
    with pytest.raises(fs.CheckpointError, match="never overwritten"):
        ckpt.save(tmp_path, state, step=10)
    assert ckpt.clean(tmp_path) == [str(tmp_path / ".tmp-11-123-0")]
    assert ckpt.latest(tmp_path) == str(tmp_path / "10")


def test_a_process_that_never_finishes_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    state = {"w": np.arange(4, dtype=np.float32)}
    good = ckpt.save(tmp_path, state, step=1)
    monkeypatch.setattr(ckpt, "_world", lambda: (0, 2))  # process 1 never writes
    monkeypatch.setenv("MS_SCHED_PORT", "1")
    # process 1 never calls save: process 0 waits for it to say what it holds
    with pytest.raises(fs.CheckpointError) as e:
        ckpt.save(tmp_path, {"w": state["w"] + 1}, step=2, timeout=0.3)
    assert str(e.value).startswith(
        f"fs.checkpoint.save: process(es) [1] did not start saving "
        f"{str(tmp_path / '2')!r} within 0 s; nothing was written, earlier checkpoints are "
        "intact.\nFix: call fs.checkpoint.save in every process of the job")
    assert not (tmp_path / "2").exists()
    # process 1 said it holds what process 0 holds, then never wrote its part
    monkeypatch.setattr(ckpt, "_exchange", lambda tmp, rank, nproc, attempt, kinds, *a: [
        [k, k] for k in kinds])
    with pytest.raises(fs.CheckpointError, match=r"process\(es\) \[1\] did not finish"):
        ckpt.save(tmp_path, {"w": state["w"] + 1}, step=2, timeout=0.3)
    assert not (tmp_path / "2").exists()
    assert ckpt.latest(tmp_path) == good
    same_bits(ckpt.load(tmp_path, state)["w"], state["w"])


def test_a_retried_save_never_takes_a_part_of_the_timed_out_attempt(tmp_path, monkeypatch):
    """Process 1 finishes its part of a timed-out attempt after process 0 gave up; the
    retry must wait for process 1's new part, not publish the checkpoint with the old
    one (whose file process 1 is about to rewrite)."""
    state = {"w": np.arange(4, dtype=np.float32)}
    monkeypatch.setattr(ckpt, "_world", lambda: (0, 2))
    monkeypatch.setenv("MS_SCHED_PORT", "1")
    monkeypatch.setattr(ckpt, "_exchange", lambda tmp, rank, nproc, attempt, kinds, *a: [
        [k, k] for k in kinds])
    with pytest.raises(fs.CheckpointError, match=r"process\(es\) \[1\] did not finish"):
        ckpt.save(tmp_path, state, step=2, timeout=0.3)
    (tmp,) = [p for p in tmp_path.iterdir() if p.name.startswith(ckpt._TMP_PREFIX)]
    (mine,) = [p.name for p in tmp.iterdir() if re.fullmatch(r"done-\d+-0\.json", p.name)]
    late = tmp / mine.replace("-0.json", "-1.json")  # process 1, late, for that attempt
    late.write_text(json.dumps({"file": "shard-00001-of-00002.safetensors", "bytes": 8,
                                "header_sha256": "0" * 64, "blocks": {}}))
    with pytest.raises(fs.CheckpointError, match=r"process\(es\) \[1\] did not finish"):
        ckpt.save(tmp_path, state, step=2, timeout=0.3)
    assert not (tmp_path / "2").exists()
    assert ckpt.latest(tmp_path) is None


def _corrupt_setup(tmp_path):
    state = {"a": np.arange(64, dtype=np.float32), "b": np.ones((2, 2), np.int32)}
    d = ckpt.save(tmp_path, state, step=0, layouts={"a": (2,), "b": None}, mesh=2)
    index = _index(d)
    return state, d, index


def test_corruption_is_an_error_naming_the_file_and_the_leaf(tmp_path):
    state, d, index = _corrupt_setup(tmp_path)
    file = os.path.join(d, next(iter(index["files"])))
    with open(file, "rb") as fh:
        data = fh.read()
    with open(file, "wb") as fh:
        fh.write(data[:-7])  # truncated
    with pytest.raises(fs.CheckpointError, match=r"(?s)bytes, the index says.*\['a'\]"):
        ckpt.load(d, state)
    flipped = bytearray(data)
    flipped[-3] ^= 0x10  # one flipped bit in the payload
    with open(file, "wb") as fh:
        fh.write(bytes(flipped))
    with pytest.raises(fs.CheckpointError, match=r"(?s)SHA-256.*\['a'\]"):
        ckpt.load(d, state)
    os.remove(file)
    with pytest.raises(fs.CheckpointError, match=r"(?s)is missing; it holds leaves.*\['a'\]"):
        ckpt.load(d, state)


def test_unverified_loads_still_catch_missing_files(tmp_path):
    state, d, index = _corrupt_setup(tmp_path)
    os.remove(os.path.join(d, next(iter(index["files"]))))
    with pytest.raises(fs.CheckpointError, match="is missing"):
        ckpt.load(d, state, verify=False)


def test_other_structure_shape_or_dtype_is_an_error_naming_the_leaf(tmp_path):
    state, d, _ = _corrupt_setup(tmp_path)
    with pytest.raises(fs.CheckpointError, match=r"(?s)another structure.*\['c'\]"):
        ckpt.load(d, {"a": state["a"], "c": state["b"]})
    with pytest.raises(fs.CheckpointError, match=r"leaf \['a'\] was saved as float32\[64\]"):
        ckpt.load(d, {"a": np.zeros(32, np.float32), "b": state["b"]})
    with pytest.raises(fs.CheckpointError, match=r"leaf \['b'\] was saved as int32"):
        ckpt.load(d, {"a": state["a"], "b": fs.ArrayType((2, 2), fs.dtypes.float32)})
    with pytest.raises(fs.CheckpointError, match="holds no checkpoint"):
        ckpt.load(tmp_path / "empty", state)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "index.json").write_text('{"format": "something else"}')
    with pytest.raises(fs.CheckpointError, match="not an fshard checkpoint index"):
        ckpt.load(tmp_path / "x", state)
    with pytest.raises(fs.CheckpointError, match="leaves must be MindSpore Tensors"):
        ckpt.save(tmp_path / "y", {"f": object()})


# --- resuming training ----------------------------------------------------------------


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x[:256] / 16).astype(np.float32), y[:256].astype(np.int32)


def _mlp_params():
    rng = np.random.default_rng(0)
    return {"w1": (rng.standard_normal((64, 32)) * 0.1).astype(np.float32),
            "b1": np.zeros(32, np.float32),
            "w2": (rng.standard_normal((32, 10)) * 0.1).astype(np.float32),
            "b2": np.zeros(10, np.float32)}


def _loss(p, x, y):
    h = fs.ops.relu(x @ p["w1"] + p["b1"])
    return fs.ops.softmax_cross_entropy(h @ p["w2"] + p["b2"], y)


def _batches(steps):
    x, y = _digits()
    return [(x[(i * 32) % 256:(i * 32) % 256 + 32], y[(i * 32) % 256:(i * 32) % 256 + 32])
            for i in range(steps)]


def _train(ap, state, batches):
    losses = []
    for x, y in batches:
        state, loss = ap(state, x, y)
        losses.append(n(loss).item())
    return state, losses


def test_resume_exactly_on_the_same_mesh(tmp_path):
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0),
                         fs.optim.adamw(fs.optim.cosine_decay(1e-2, 20)))
    batches = _batches(20)
    ap = fs.AutoParallel(_loss, opt, mesh=2)
    _, whole = _train(ap, ap.init(_mlp_params()), batches)

    ap1 = fs.AutoParallel(_loss, opt, mesh=2)
    state, first = _train(ap1, ap1.init(_mlp_params()), batches[:10])
    d = ckpt.save(tmp_path, state, step=10, layouts=ap1.state_strategies(state, *batches[0]),
                  mesh=2)
    del state, ap1
    ap2 = fs.AutoParallel(_loss, opt, mesh=2)
    like = ap2.init(_mlp_params())  # a fresh start: step 0, zero moments
    state = ckpt.load(ckpt.latest(tmp_path), like)
    assert d == ckpt.latest(tmp_path) and int(n(state.step)) == 10
    _, second = _train(ap2, state, batches[10:])
    assert first + second == whole  # bit-identical losses


@pytest.mark.full  # slow: the full matrix (the quick run covers the feature elsewhere)
def test_resume_on_another_mesh_with_zero(tmp_path):
    opt = fs.optim.adam(1e-2)
    batches = _batches(20)
    ap = fs.AutoParallel(_loss, opt, mesh=2)
    _, whole = _train(ap, ap.init(_mlp_params()), batches)

    ap1 = fs.AutoParallel(_loss, opt, mesh=2)
    state, first = _train(ap1, ap1.init(_mlp_params()), batches[:10])
    ckpt.save(tmp_path, state, step=10, layouts=ap1.state_strategies(state, *batches[0]),
              mesh=2)
    ap2 = fs.AutoParallel(_loss, opt, mesh=4).hsdp(threshold=0, optimizer_level="level3")
    state = ckpt.load(tmp_path, ap2.init(_mlp_params()))
    _, second = _train(ap2, state, batches[10:])
    np.testing.assert_allclose(first + second, whole, rtol=1e-6)


# --- MindSpore and safetensors files ----------------------------------------------------


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1 = nn.Dense(4, 3)
        self.dense2 = nn.Dense(3, 2)

    def construct(self, x):
        return self.dense2(ms.ops.relu(self.dense1(x)))


def test_mindspore_checkpoints_both_ways(tmp_path):
    x = ms.Tensor(np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32))
    net = Net()
    apply, params = fs.functional(net)
    trained = {k: ms.Tensor(n(v) * 2 + 1) for k, v in params.items()}  # "trained" weights
    ckpt.save_mindspore(tmp_path / "fs.ckpt", trained)
    other = Net()
    not_loaded, _ = ms.load_param_into_net(other, ms.load_checkpoint(str(tmp_path / "fs.ckpt")))
    assert not not_loaded
    same_bits(other(x), apply(trained, x))

    ms.save_checkpoint(other, str(tmp_path / "ms.ckpt"))
    back = ckpt.load_mindspore(tmp_path / "ms.ckpt", params)
    for k in params:
        same_bits(back[k], trained[k])
    with pytest.raises(fs.CheckpointError, match=r"has no parameter\(s\) \['extra'\]"):
        ckpt.load_mindspore(tmp_path / "ms.ckpt", dict(params, extra=np.zeros(1, np.float32)))
    with pytest.raises(fs.CheckpointError, match="like lacks"):
        ckpt.load_mindspore(tmp_path / "ms.ckpt", {"dense1.weight": params["dense1.weight"]})
    part = ckpt.load_mindspore(tmp_path / "ms.ckpt", {"dense1.weight": params["dense1.weight"]},
                               strict=False)
    same_bits(part["dense1.weight"], trained["dense1.weight"])
    with pytest.raises(fs.CheckpointError, match=r"'dense1.bias' in .* is float32\[3\]"):
        ckpt.load_mindspore(tmp_path / "ms.ckpt", dict(params, **{
            "dense1.bias": np.zeros(4, np.float32)}))
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(fs.CheckpointError, match="not a readable MindSpore checkpoint"):
        ckpt.load_mindspore(tmp_path / "bad.ckpt", params)
    with pytest.raises(fs.CheckpointError, match="does not exist"):
        ckpt.load_mindspore(tmp_path / "none.ckpt", params)


def test_safetensors_files_both_ways(tmp_path):
    from safetensors.numpy import load_file, save_file

    params = {"layer": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
              "b": np.array([1, 2], np.int64)}
    ckpt.save_safetensors(tmp_path / "p.safetensors", params)
    raw = load_file(str(tmp_path / "p.safetensors"))
    assert sorted(raw) == ["b", "layer.w"]
    same_bits(raw["layer.w"], params["layer"]["w"])
    save_file({"layer.w": np.ones((2, 3), np.float32), "b": np.zeros(2, np.int64)},
              str(tmp_path / "q.safetensors"))
    back = ckpt.load_safetensors(tmp_path / "q.safetensors", params)
    assert n(back["layer"]["w"]).tolist() == [[1.0] * 3] * 2
    (tmp_path / "r.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(fs.CheckpointError, match="not a readable safetensors file"):
        ckpt.load_safetensors(tmp_path / "r.safetensors", params)
    with pytest.raises(fs.CheckpointError, match="two leaves are both named 'a.b'"):
        ckpt.save_safetensors(tmp_path / "s.safetensors", {"a": {"b": 1.0}, "a.b": 2.0})


# --- saving in the background ---------------------------------------------------------


def test_a_background_save_keeps_the_values_of_its_call(tmp_path):
    state = {"w": np.arange(1 << 16, dtype=np.float32), "step": np.int32(3)}
    handle = ckpt.save(tmp_path, state, step=3, wait=False)
    assert isinstance(handle, ckpt.SaveHandle) and handle.path == str(tmp_path / "3")
    state["w"] += 1  # the caller goes on changing its arrays
    assert handle.wait() == str(tmp_path / "3") and handle.done()
    assert ckpt.latest(tmp_path) == str(tmp_path / "3")
    back = ckpt.load(tmp_path, state)
    same_bits(back["w"], np.arange(1 << 16, dtype=np.float32))
    # errors: at once when the call itself is wrong, at wait() when the writing fails
    with pytest.raises(fs.CheckpointError, match="never overwritten"):
        ckpt.save(tmp_path, state, step=3, wait=False)
    with pytest.raises(fs.CheckpointError, match="leaves must be MindSpore Tensors"):
        ckpt.save(tmp_path, {"f": object()}, step=4, wait=False)
    bad = ckpt.save(tmp_path, state, step=5, layouts={"w": (3,), "step": None}, mesh=2,
                    wait=False)
    with pytest.raises(fs.ShardingError, match="into 3 blocks"):
        bad.wait()
    assert ckpt.latest(tmp_path) == str(tmp_path / "3")


def test_training_goes_on_while_a_checkpoint_is_written(tmp_path):
    opt = fs.optim.adam(1e-2)
    batches = _batches(6)
    ap = fs.AutoParallel(_loss, opt, mesh=2)
    state, whole = _train(ap, ap.init(_mlp_params()), batches)
    ap1 = fs.AutoParallel(_loss, opt, mesh=2)
    state, first = _train(ap1, ap1.init(_mlp_params()), batches[:3])
    handle = ckpt.save(tmp_path, state, step=3, wait=False,
                       layouts=ap1.state_strategies(state, *batches[0]), mesh=2)
    _, second = _train(ap1, state, batches[3:])  # while the files are written
    assert first + second == whole
    resumed = ckpt.load(handle.wait(), ap1.init(_mlp_params()))
    _, again = _train(ap1, resumed, batches[3:])
    assert again == second


# -- hostile input: steps, failures, races, Python scalars ---------------------------------


def _leftovers(root):
    return [d for d in os.listdir(root) if d.startswith(".tmp-")] if os.path.isdir(root) else []


@pytest.mark.parametrize("step", [np.int32(5), np.int64(5), np.array(5), np.array(5, np.uint8),
                                  ms.Tensor(np.int32(5))])
def test_a_numpy_or_0d_integer_step_is_an_int(tmp_path, step):
    d = ckpt.save(tmp_path, {"w": np.ones(2, np.float32)}, step=step)
    assert d == str(tmp_path / "5") and _index(d)["step"] == 5
    assert type(_index(d)["step"]) is int and ckpt.latest(tmp_path) == d


@pytest.mark.parametrize("step, got", [
    (1.5, "1.5 (float)"), (True, "True (bool)"), (-1, "-1"), ("../x", "'../x' (str)"),
    (np.float64(2.0), "(float64)"), (np.array([1]), "(ndarray)"), (np.bool_(True), "(bool"),
    (np.array(3.0), "(ndarray)"),
])
@pytest.mark.parametrize("wait", [True, False])
def test_a_bad_step_is_refused_before_anything_is_written(tmp_path, step, got, wait):
    root = tmp_path / "run"
    with pytest.raises(fs.ArgumentError, match=r"(?s)save\(step=\.\.\.\) must be a "
                       r"non-negative integer [^\n]*got [^\n]*" + re.escape(got)
                       + r".*Fix: pass the training step as an int"):
        ckpt.save(root, {"w": np.ones(2, np.float32)}, step=step, wait=wait)
    assert not root.exists()


def test_a_failed_save_leaves_no_temporary_directory(tmp_path, monkeypatch):
    with pytest.raises(fs.CheckpointError, match="has dtype complex64"):
        ckpt.save(tmp_path, {"z": np.ones(2, np.complex64)}, step=1)
    with pytest.raises(fs.CheckpointError, match="cannot save a leaf of type object"):
        ckpt.save(tmp_path, {"o": object()}, step=1)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "_write_safetensors_durably", full)
    with pytest.raises(fs.CheckpointError, match=r"(?s)writing '.*1' failed: \[Errno 28\] "
                                                 r"No space left.*earlier checkpoints are intact"):
        ckpt.save(tmp_path, {"w": np.ones(2, np.float32)}, step=1)
    handle = ckpt.save(tmp_path, {"w": np.ones(2, np.float32)}, step=2, wait=False)
    with pytest.raises(fs.CheckpointError, match=r"No space left"):
        handle.wait()
    assert os.listdir(tmp_path) == []


def test_a_save_that_loses_the_race_for_its_step_is_an_error_and_removes_its_files(
        tmp_path, monkeypatch):
    mine, theirs = {"w": np.zeros(3, np.float32)}, {"w": np.ones(3, np.float32)}
    fsync_dir, raced = ckpt._fsync_dir, []

    def other_program_saves_first(path):  # just before this save renames its directory
        if os.path.basename(path).startswith(".tmp-") and not raced:
            raced.append(path)
            ckpt.save(tmp_path, theirs, step=5)
        fsync_dir(path)

    monkeypatch.setattr(ckpt, "_fsync_dir", other_program_saves_first)
    with pytest.raises(fs.CheckpointError, match=r"(?s)'.*5' was completed by another save "
                       r"while this one was writing; a checkpoint is never overwritten.*Fix:"):
        ckpt.save(tmp_path, mine, step=5)
    assert os.listdir(tmp_path) == ["5"]
    same_bits(ckpt.load(tmp_path, theirs)["w"], theirs["w"])


def test_clean_leaves_a_background_save_alone(tmp_path, monkeypatch):
    release, writing = threading.Event(), threading.Event()
    write = ckpt._write_safetensors_durably

    def slow(*args, **kwargs):
        writing.set()  # the save holds its directory's lock while it writes
        assert release.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(ckpt, "_write_safetensors_durably", slow)
    (tmp_path / ".tmp-7-123-0").mkdir()  # a save that died (before locks existed)
    dead = tmp_path / ".tmp-8-456-0"     # a save whose process died: its lock is free
    dead.mkdir()
    (dead / ".lock").touch()
    state = {"w": np.arange(4, dtype=np.float32)}
    handle = ckpt.save(tmp_path, state, step=9, wait=False)
    try:
        # the thread has made its directory and taken its lock (the lock file alone
        # exists a moment before the lock is held: a clean() then may remove it, and
        # the save makes a new directory)
        assert writing.wait(30)
        live = [d for d in _leftovers(tmp_path) if d.startswith(".tmp-9-")]
        assert live
        assert ckpt.clean(tmp_path) == [str(tmp_path / ".tmp-7-123-0"), str(dead)]
        assert _leftovers(tmp_path) == live
    finally:
        release.set()
    assert handle.wait() == str(tmp_path / "9")
    assert sorted(os.listdir(tmp_path)) == ["9"] and ckpt.clean(tmp_path) == []
    assert sorted(os.listdir(tmp_path / "9")) == ["index.json", "shard-00000-of-00001.safetensors"]
    same_bits(ckpt.load(tmp_path, state)["w"], state["w"])


def test_python_scalars_round_trip_with_the_dtypes_fshard_gives_them(tmp_path):
    state = {"lr": 0.1, "n": 3, "on": True}
    d = ckpt.save(tmp_path, state, step=1)
    assert [e["dtype"] for e in _index(d)["leaves"]] == ["float32", "int64", "bool"]
    back = ckpt.load(d, state)  # a like of Python scalars: float32, int64, bool
    same_bits(back["lr"], np.float32(0.1))
    same_bits(back["n"], np.int64(3))
    same_bits(back["on"], np.bool_(True))
    # both directions against float32 arrays
    same_bits(ckpt.load(d, {"lr": np.float32(0), "n": np.int64(0), "on": False})["lr"],
              np.float32(0.1))
    d2 = ckpt.save(tmp_path, {"lr": np.float32(0.25)}, step=2)
    same_bits(ckpt.load(d2, {"lr": 0.1})["lr"], np.float32(0.25))
    # a float64 stays float64, and a Python float like says what it expects
    d3 = ckpt.save(tmp_path, {"lr": np.float64(0.1)}, step=3)
    with pytest.raises(fs.CheckpointError, match=r"saved as float64\[\], like has float32\[\]"):
        ckpt.load(d3, {"lr": 0.1})
    # the same rule for single safetensors files and MindSpore .ckpt files
    ckpt.save_safetensors(tmp_path / "p.safetensors", {"lr": 0.1})
    same_bits(ckpt.load_safetensors(tmp_path / "p.safetensors", {"lr": 0.1})["lr"],
              np.float32(0.1))
    ckpt.save_mindspore(tmp_path / "p.ckpt", {"lr": 0.1})
    same_bits(ckpt.load_mindspore(tmp_path / "p.ckpt", {"lr": 0.1})["lr"], np.float32(0.1))


def _placement(x):
    from fshard.sharding.placement import PLACEMENT

    return getattr(x, PLACEMENT, None)


def test_load_with_a_mesh_places_each_leaf_on_it(tmp_path):
    # saved on a mesh of 4 (w in row blocks, b in halves), loaded on meshes of 2, 8 and
    # 2 x 4: the values are the saved ones, each leaf placed with the layout asked for
    state = {"w": np.arange(48, dtype=np.float32).reshape(8, 6),
             "b": np.arange(6, dtype=np.float32), "s": np.int32(3)}
    d = ckpt.save(tmp_path / "a", state, layouts={"w": (4, 1), "b": (2,), "s": None}, mesh=4)
    for mesh in (2, 8, fs.Mesh((2, 4), ("dp", "mp"))):
        back = ckpt.load(d, state, mesh=mesh)
        for k in state:
            same_bits(back[k], state[k])
        n = getattr(mesh, "size", mesh)
        # the saved layout where it fits the new mesh ((4, 1) does not split on 2)
        assert _placement(back["w"]) == (None if n == 2 else ((4, 1), n))
        assert _placement(back["b"]) == ((2,), n) and _placement(back["s"]) is None
    # the layouts asked for (None: whole), or those like's leaves were placed with
    back = ckpt.load(d, state, mesh=8, layouts={"w": (1, 2), "b": None, "s": None})
    assert _placement(back["w"]) == ((1, 2), 8) and _placement(back["b"]) is None
    like = dict(state, w=fs.device_put(state["w"], (2, 2), mesh=8))
    back = ckpt.load(d, like, mesh=8)
    assert _placement(back["w"]) == ((2, 2), 8)
    # a placed value is laid out that way by a sharded function that leaves it free
    with fs.Mesh(8, "d"):
        f = fs.shard(lambda w: w * 2.0, in_strategy=(None,))
        assert f.strategies(back["w"])["inputs"][0]["strategy"] == [2, 2]
    with pytest.raises(fs.ShardingError, match=r"mesh=8, layouts\) leaf \['s'\] = \(2,\)"):
        ckpt.load(d, state, mesh=8, layouts={"w": None, "b": None, "s": (2,)})


def test_a_train_state_saved_on_one_mesh_resumes_on_another(tmp_path):
    def loss(p, x, y):
        return ((x @ p["w"] + p["b"] - y) ** 2).mean()

    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((8, 4)).astype(np.float32),
              "b": np.zeros((4,), np.float32)}
    x, y = rng.standard_normal((16, 8)).astype(np.float32), np.ones((16, 4), np.float32)
    a = fs.AutoParallel(loss, fs.optim.adam(1e-2), mesh=4).hsdp(threshold=0)
    state = a.init(params)
    for _ in range(2):
        state, _ = a(state, x, y)
    d = ckpt.save(tmp_path, state, step=2, layouts=a.state_strategies(state, x, y), mesh=4)
    b = fs.AutoParallel(loss, fs.optim.adam(1e-2), mesh=8).parameter_plan({"w": (1, 2)})
    like = b.init(params)
    back = ckpt.load(d, like, mesh=8, layouts=b.state_strategies(like, x, y))
    for got, want in zip(fs.tree.leaves(back), fs.tree.leaves(state)):
        same_bits(got, want)
    assert _placement(back.params["w"]) == ((1, 2), 8)
    _, l_a = a(state, x, y)
    _, l_b = b(back, x, y)
    np.testing.assert_allclose(float(l_b.asnumpy()), float(l_a.asnumpy()), rtol=1e-5)
