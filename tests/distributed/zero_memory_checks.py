"""Run inside a 4-process job, once per ZeRO level (see test_zero_memory_multiprocess.py).

``python -m fshard.launch -n 4 tests/distributed/zero_memory_checks.py OUT_DIR LEVEL``

A ReLU-free 16-layer tanh MLP of 1024 x 1024 weights (P = 16,777,216 parameters, 64 MiB
of float32 gradients) trained by ``fs.AutoParallel`` with SGD momentum, each process
feeding its own 4 rows (``dataset_strategy("data_parallel")``), LEVEL one of ``none``,
``level1``, ``level2``, ``level3``. Each process writes ``zero_<LEVEL>_rank<r>.json``: its
``memory_report``; its resident memory (``VmRSS``) before the first step, its peak
(``VmHWM``) after it, its resident memory once settled (``settle``) and its peak in
steps 2 and 3; the losses; and how many programs the steps compiled.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys

import numpy as np

import fshard as fs

LAYERS, WIDTH, ROWS, STEPS = 16, 1024, 4, 3


def rss() -> dict:
    """This process's resident memory now (``VmRSS``) and at its peak (``VmHWM``), in
    bytes."""
    with open("/proc/self/status") as fh:
        fields = dict(line.split(":", 1) for line in fh)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def settle() -> None:
    """Free what is garbage, hand the allocator's free memory back to the system and
    restart the peak (``VmHWM``) at the resident memory now, so that the peak of the
    steps that follow is theirs (Linux: ``5`` to ``/proc/self/clear_refs``)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def loss(p, x, y):
    h = x
    for i in range(LAYERS):
        h = fs.ops.tanh(h @ p[f"w{i}"])
    return ((h - y) ** 2).mean()


def params():
    rng = np.random.default_rng(0)
    return {f"w{i}": (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
            for i in range(LAYERS)}


def batch(rank: int):
    rng = np.random.default_rng(100 + rank)
    return (rng.standard_normal((ROWS, WIDTH)).astype(np.float32),
            np.zeros((ROWS, WIDTH), np.float32))


def main(out: str, level: str) -> None:
    fs.distributed.init()
    rank = fs.distributed.rank()
    ap = fs.AutoParallel(loss, fs.optim.sgd(0.01, momentum=0.9))
    ap.dataset_strategy("data_parallel")
    if level != "none":
        ap.hsdp(threshold=0, optimizer_level=level)
    state = ap.init(params())
    x, y = batch(rank)
    report = ap.memory_report(state, x, y)
    before = rss()
    losses = []
    first = None
    for i in range(STEPS):
        state, l = ap(state, x, y)
        losses.append(float(l.asnumpy()))
        if i == 0:
            first = rss()
            settle()
            steady = rss()
    after = rss()
    compiles = sum(compiled.compile_count for _, compiled in ap._steps.values())
    with open(os.path.join(out, f"zero_{level}_rank{rank}.json"), "w") as fh:
        json.dump({"report": report, "before": before, "first": first, "steady": steady,
                   "after": after, "losses": losses,
                   "parameters": LAYERS * WIDTH * WIDTH, "compiles": compiles}, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
