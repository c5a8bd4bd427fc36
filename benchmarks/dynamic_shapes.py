"""Dynamic shapes: one program for every batch size against one per size.

The step is ``value_and_grad`` of a 784-512-10 ReLU MLP's squared error. Rows:

* per batch size (16, 64, 160), the steady time of a step declared with a ``Symbol``
  batch (``fs.jit(..., in_shapes=...)``: traced and compiled once, MindSpore dynamic
  shapes; a size called often runs a static copy of the program), of its dynamic graph
  alone, of the static step compiled for that size (``fs.jit``), and of MindSpore's
  own dynamic function (``mindspore.enable_dynamic`` + ``mindspore.jit`` of
  ``mindspore.value_and_grad``);
* the total time of 20 steps over 20 different batch sizes (8, 16, ..., 160),
  compiles included, for the same three (the static one compiles 20 times).
"""

from __future__ import annotations

import time

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

import fshard as fs
from benchmarks.harness import Result, Row, benchmark, row

SIZES = tuple(range(8, 168, 8))
STEADY = (16, 64, 160)


def _loss(w1, w2, x, y):
    h = ops.relu(ops.matmul(x, w1))
    d = ops.matmul(h, w2) - y
    return ops.sum(d * d) / x.shape[0]


def _fs_loss(w1, w2, x, y):
    h = ops.relu(ops.matmul(x, w1))
    d = ops.matmul(h, w2) - y
    return ops.mean(ops.sum(d * d, 1))


def _fs_dynamic():
    s = fs.Symbol()
    return fs.jit(fs.value_and_grad(_fs_loss, argnums=(0, 1)), in_shapes=(
        None, None, fs.ArrayType((s, 784), ms.float32), fs.ArrayType((s, 10), ms.float32)))


_ms_grad = ms.value_and_grad(_loss, grad_position=(0, 1))


def _ms_step(w1, w2, x, y):
    return _ms_grad(w1, w2, x, y)


def _ms_dynamic():
    s = ms.Symbol(unique=True)
    return ms.jit(ms.enable_dynamic(x=Tensor(shape=[s, 784], dtype=ms.float32),
                                    y=Tensor(shape=[s, 10], dtype=ms.float32))(_ms_step))


def _data(b, rng):
    return (Tensor(rng.normal(size=(b, 784)).astype(np.float32)),
            Tensor(rng.normal(size=(b, 10)).astype(np.float32)))


def _wait(out):
    loss, (g1, g2) = out
    g1.asnumpy()
    return float(loss.asnumpy())


@benchmark("dynamic_shapes", title="a Symbol batch: compiled once vs once per size")
def dynamic_shapes(ctx):
    rng = np.random.default_rng(0)
    w1 = Tensor(rng.normal(size=(784, 512)).astype(np.float32) * 0.03)
    w2 = Tensor(rng.normal(size=(512, 10)).astype(np.float32) * 0.03)
    sizes = SIZES if not ctx.quick else SIZES[:6]
    totals, notes = {}, []
    for name, make in (("fs_dynamic", _fs_dynamic), ("fs_static", lambda: fs.jit(
            fs.value_and_grad(_fs_loss, argnums=(0, 1)))), ("ms_dynamic", _ms_dynamic)):
        f = make()
        t0 = time.perf_counter()
        losses = [_wait(f(w1, w2, *_data(b, np.random.default_rng(b)))) for b in sizes]
        totals[name] = (time.perf_counter() - t0, losses, f)
    ref = totals["fs_static"][1]
    for name in ("fs_dynamic", "ms_dynamic"):
        np.testing.assert_allclose(totals[name][1], ref, rtol=1e-4)
    dyn = totals["fs_dynamic"][2]
    notes.append(f"fs_dynamic over {len(sizes)} sizes: trace_count {dyn.trace_count}, "
                 f"compile_count {dyn.compile_count}; fs_static: compile_count "
                 f"{totals['fs_static'][2].compile_count}")
    # the dynamic graph alone: the same program with the static copies of hot sizes off
    graph_only = _fs_dynamic()
    _wait(graph_only(w1, w2, *_data(8, rng)))
    next(iter(graph_only._cache.values()))._compiled.specialize = None
    variants = {**{k: v[2] for k, v in totals.items()}, "fs_dynamic_graph": graph_only}
    fns = {}
    for b in STEADY:
        x, y = _data(b, rng)
        for name, f in variants.items():
            fns[f"{name}_{b}"] = lambda f=f, x=x, y=y: _wait(f(w1, w2, x, y))
    t = ctx.compare(fns, runs=ctx.runs(30, 3), warmup=2, rounds=2)
    label = {"fs_dynamic": "fs.jit(in_shapes=Symbol batch), hot size: its static copy",
             "fs_dynamic_graph": "fs.jit(in_shapes=Symbol batch), the dynamic graph",
             "fs_static": "fs.jit, compiled for this size",
             "ms_dynamic": "mindspore.jit + enable_dynamic"}
    rows = []
    for b in STEADY:
        for name in variants:
            system = "mindspore" if name.startswith("ms") else "fshard"
            rows.append(row(system, f"{label[name]}, step at batch {b}", t[f"{name}_{b}"]))
    for name, (total, _, _) in totals.items():
        system = "mindspore" if name.startswith("ms") else "fshard"
        what = "fs.jit(in_shapes=Symbol batch)" if name == "fs_dynamic" else label[name]
        rows.append(Row(system, f"{what}: {len(sizes)} steps over {len(sizes)} sizes, "
                        "compiles included", total, total, 1))
    return Result(rows, baseline="fs.jit, compiled for this size, step at batch 64",
                  target="dynamic step <= 1.2x the static one; 20 sizes several times "
                         "faster than recompiling", notes=notes)
