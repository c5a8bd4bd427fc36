"""Checkpoints: saving and loading a 64 MB train state (16 float32 arrays of 1M).

``fs.checkpoint.save`` / ``load`` (safetensors + index, SHA-256 of every file,
fsync, atomic rename), whole and split 8 ways, against ``mindspore.save_checkpoint``
/ ``mindspore.load_checkpoint`` of the same arrays (protobuf ``.ckpt``). Each save
goes to a fresh directory of a temporary directory on the same disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import mindspore as ms
import numpy as np

import fshard as fs
from benchmarks.harness import Result, benchmark, row


@benchmark("checkpoint", title="save and load a 64 MB state")
def checkpoint(ctx):
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal((1024, 1024)).astype(np.float32) for i in range(16)}
    tensors = {k: ms.Tensor(v) for k, v in state.items()}
    layouts = {k: (8, 1) for k in state}
    root = tempfile.mkdtemp()
    count = [0]

    def fresh():
        count[0] += 1
        return os.path.join(root, str(count[0]))

    def fs_save():
        fs.checkpoint.save(fresh(), tensors)

    def fs_save_sharded():
        fs.checkpoint.save(fresh(), tensors, layouts=layouts, mesh=8)

    def ms_save():
        ms.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()],
                           fresh() + ".ckpt")

    whole = fs.checkpoint.save(os.path.join(root, "whole"), tensors)
    sharded = fs.checkpoint.save(os.path.join(root, "sharded"), tensors, layouts=layouts,
                                 mesh=8)
    ms_file = os.path.join(root, "ms.ckpt")
    ms.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()], ms_file)
    for d in (whole, sharded):
        back = fs.checkpoint.load(d, state)
        assert all(np.array_equal(back[k].asnumpy(), state[k]) for k in state)
    runs = ctx.runs(10, 2)
    try:
        t = ctx.compare({
            "fs_save": fs_save, "fs_save8": fs_save_sharded, "ms_save": ms_save,
            "fs_load": lambda: fs.checkpoint.load(whole, state),
            "fs_load8": lambda: fs.checkpoint.load(sharded, state),
            "fs_load_nv": lambda: fs.checkpoint.load(whole, state, verify=False),
            "ms_load": lambda: ms.load_checkpoint(ms_file),
        }, runs=runs, warmup=1, rounds=2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [
        row("fshard", "fs.checkpoint.save (whole leaves)", t["fs_save"]),
        row("fshard", "fs.checkpoint.save (layouts (8, 1), mesh=8)", t["fs_save8"]),
        row("mindspore", "mindspore.save_checkpoint", t["ms_save"]),
        row("fshard", "fs.checkpoint.load (whole; SHA-256 verified)", t["fs_load"]),
        row("fshard", "fs.checkpoint.load (8 blocks per leaf; verified)", t["fs_load8"]),
        row("fshard", "fs.checkpoint.load (verify=False)", t["fs_load_nv"]),
        row("mindspore", "mindspore.load_checkpoint", t["ms_load"]),
    ]
    return Result(rows, baseline="mindspore.save_checkpoint",
                  target="within 2x of MindSpore's own checkpoint files",
                  notes=[f"timed interleaved ({runs} calls each, 2 rounds); 64 MB state",
                         "fshard's saves fsync every file and the directories"])
