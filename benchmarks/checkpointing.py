"""Checkpoints: saving and loading a 200 MiB train state (50 float32 arrays of 1M), and
the step-time cost of saving in the background (``wait=False``) against saving first.

``fs.checkpoint.save`` / ``load`` (safetensors + index, SHA-256 of every file,
fsync, atomic rename), whole and split 8 ways, against ``mindspore.save_checkpoint``
/ ``mindspore.load_checkpoint`` of the same arrays (protobuf ``.ckpt``). Each save
goes to a fresh directory of a temporary directory on the same disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import mindspore as ms
import numpy as np

import fshard as fs
from benchmarks.harness import Result, benchmark, row

MIB = 200  # the state's size


@benchmark("checkpoint", title="save and load a 200 MiB state")
def checkpoint(ctx):
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal((1024, 1024)).astype(np.float32) for i in range(50)}
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
    runs = ctx.runs(6, 2)
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
                  notes=[f"timed interleaved ({runs} calls each, 2 rounds); 200 MiB state",
                         "fshard's saves fsync every file and the directories",
                         "MB/s (median): " + ", ".join(
                             f"{k} {MIB * 2**20 / 1e6 / t[k]['median_s']:.0f}" for k in t)])


@benchmark("checkpoint_async", title="train steps while a 192 MiB train state is saved")
def checkpoint_async(ctx):
    """An Adam train step of a 4-layer MLP (2048 wide: 64 MiB of parameters, 192 MiB of
    state with the moments): 5 steps after a synchronous save, against 5 steps run
    while the save proceeds in the background (then waited for), against 5 steps
    without saving."""
    rng = np.random.default_rng(0)
    width, steps = 2048, 5
    params = {f"w{i}": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(
        np.float32) for i in range(4)}
    x = rng.standard_normal((64, width)).astype(np.float32)

    def loss(p, x):
        h = x
        for i in range(4):
            h = fs.ops.relu(h @ p[f"w{i}"])
        return (h * h).mean()

    ap = fs.AutoParallel(loss, fs.optim.adam(1e-4), mesh=1)
    state = ap.init(params)
    state, _ = ap(state, x)  # compile
    root = tempfile.mkdtemp()
    count = [0]

    def train(s):
        for _ in range(steps):
            s, l = ap(s, x)
        l.asnumpy()
        return s

    def no_save():
        train(state)

    def sync():
        count[0] += 1
        fs.checkpoint.save(root, state, step=count[0])
        train(state)

    def background():
        count[0] += 1
        h = fs.checkpoint.save(root, state, step=count[0], wait=False)
        train(state)
        h.wait()

    def background_steps():  # the steps alone, the save still running after them
        count[0] += 1
        h = fs.checkpoint.save(root, state, step=count[0], wait=False)
        t0 = time.perf_counter()
        train(state)
        times.append(time.perf_counter() - t0)
        h.wait()

    times: list = []
    runs = ctx.runs(6, 2)
    try:
        t = ctx.compare({"none": no_save, "sync": sync, "async": background,
                         "async_steps": background_steps}, runs=runs, warmup=1, rounds=2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    per = {k: v["median_s"] / steps for k, v in t.items()}
    rows = [
        row("fshard", f"{steps} steps, no checkpoint", t["none"]),
        row("fshard", f"save (wait=True), then {steps} steps", t["sync"]),
        row("fshard", f"save (wait=False), {steps} steps, wait()", t["async"]),
        row("fshard", f"the {steps} steps alone while a save runs", t["async_steps"]),
    ]
    return Result(rows, baseline=f"{steps} steps, no checkpoint",
                  target="a background save costs the steps less than a synchronous one",
                  notes=[f"timed interleaved ({runs} calls each, 2 rounds)",
                         "step-time overhead per step over no checkpoint (median): "
                         f"sync {1e3 * (per['sync'] - per['none']):.0f} ms, "
                         f"async {1e3 * (per['async'] - per['none']):.0f} ms "
                         f"(steps alone {1e3 * (per['async_steps'] - per['none']):.0f} ms)"])
