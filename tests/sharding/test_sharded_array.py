"""fs.ShardedArray in one process: what it is, what refuses it, and fs.checkpoint's reads.
Its use in real jobs (steps taking and returning blocks, checkpoints reading only a
process's blocks) is checked by tests/distributed/test_training_multiprocess.py."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import pytest

import fshard as fs
from fshard import checkpoint as ckpt
from fshard.sharding.layouts import ShardMesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed"))
from training_checks import CountedReads  # noqa: E402


def _cut(rank=1):
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    return x, fs.ShardedArray.cut(x, (2, 1), ShardMesh((2,)), rank)


def test_a_sharded_array_has_the_global_type_and_this_process_block():
    x, y = _cut(rank=1)
    assert fs.typeof(y) == fs.ArrayType((4, 6), fs.dtypes.float32)
    assert y.shape == (4, 6) and y.local_shape == (2, 6) and y.strategy == (2, 1)
    assert y.bounds == ((2, 4), (0, 6))
    np.testing.assert_array_equal(y.block.asnumpy(), x[2:])
    assert "process 1 holds [(2, 4), (0, 6)]" in repr(y)
    # over 4 devices as (2, 2): rank 2 is row block 1, column block 0
    z = fs.ShardedArray.cut(x, (2, 2), ShardMesh((2, 2)), 2)
    assert z.bounds == ((2, 4), (0, 3))
    np.testing.assert_array_equal(z.block.asnumpy(), x[2:, :3])


@pytest.mark.parametrize("use", ["asnumpy", "array", "float", "eager op", "jit constant"])
def test_reading_a_sharded_array_without_gathering_is_an_error_naming_the_fix(use):
    _, y = _cut()
    attempt = {"asnumpy": lambda: y.asnumpy(), "array": lambda: np.asarray(y),
               "float": lambda: float(y), "eager op": lambda: fs.ops.relu(y),
               "jit constant": lambda: fs.jit(lambda a: a + y)(np.ones((4, 6), np.float32))}
    with pytest.raises(fs.ShardingError, match=r"(?s)holds only its block \[\(2, 4\), \(0, 6\)\]"
                       r".*Fix: call x.gather\(\).*collective"):
        attempt[use]()


def test_gather_outputs_is_checked_and_changes_nothing_on_a_virtual_mesh():
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    f = fs.shard(lambda v: v * 2.0, in_strategy=((2, 1),), out_strategy=((2, 1),), mesh=2,
                 gather_outputs=False)
    for g in (f, fs.jit(f)):
        out = g(x)
        assert not isinstance(out, fs.ShardedArray)
        np.testing.assert_array_equal(out.asnumpy(), 2 * x)
    with pytest.raises(fs.ShardingError, match="gather_outputs must be True"):
        fs.shard(lambda v: v, in_strategy=(None,), mesh=2, gather_outputs="no")(x)


def test_sharded_arrays_of_another_job_size_are_checkpoint_errors(tmp_path):
    _, y = _cut()
    with pytest.raises(fs.CheckpointError, match="job of 2 processes, this job has 1"):
        ckpt.save(tmp_path / "a", {"y": y})
    d = ckpt.save(tmp_path / "b", {"y": np.zeros((4, 6), np.float32)})
    with pytest.raises(fs.CheckpointError, match="job of 2 processes, this job has 1"):
        ckpt.load(d, {"y": y})


def test_a_whole_load_reads_each_byte_once_and_layouts_need_a_job(tmp_path):
    state = {"w": np.arange(64, dtype=np.float32).reshape(16, 4), "s": np.int32(3)}
    d = ckpt.save(tmp_path / "c", state, layouts={"w": (2, 1), "s": None}, mesh=2)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
               if f.endswith(".safetensors"))
    with CountedReads() as reads:
        back = ckpt.load(d, state, layouts={"w": (2, 1), "s": None})  # one process: whole
    assert reads.bytes == size  # verified while read: no second pass over the files
    assert not isinstance(back["w"], fs.ShardedArray)
    np.testing.assert_array_equal(back["w"].asnumpy(), state["w"])


def test_a_version_1_checkpoint_with_one_sha256_per_file_still_loads(tmp_path):
    state = {"w": np.arange(6, dtype=np.float32)}
    d = ckpt.save(tmp_path / "v1", state)
    path = os.path.join(d, "index.json")
    with open(path) as fh:
        index = json.load(fh)
    index["version"] = 1
    for file, info in index["files"].items():
        with open(os.path.join(d, file), "rb") as fh:
            info["sha256"] = hashlib.sha256(fh.read()).hexdigest()
        del info["header_sha256"]
    with open(path, "w") as fh:
        json.dump(index, fh)
    np.testing.assert_array_equal(ckpt.load(d, state)["w"].asnumpy(), state["w"])
    with open(os.path.join(d, next(iter(index["files"]))), "r+b") as fh:
        fh.seek(-2, 2)
        fh.write(b"\x00\x01")
    with pytest.raises(fs.CheckpointError, match="does not match its SHA-256"):
        ckpt.load(d, state)
