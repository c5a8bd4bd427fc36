"""Dynamic shapes: one program for every batch size against one per size.

The step is ``value_and_grad`` of a 784-512-10 ReLU MLP's squared error. Rows:

* per batch size (16, 64, 160), the steady time of a step declared with a ``Symbol``
  batch (``fs.jit(..., in_shapes=...)``: traced and compiled once, MindSpore dynamic
  shapes; a size called often runs a static copy of the program), of its dynamic graph
  alone, of the static step compiled for that size (``fs.jit``), and of MindSpore's
  own dynamic function (``mindspore.enable_dynamic`` + ``mindspore.jit`` of
  ``mindspore.value_and_grad``) and MindSpore's ``set_inputs`` network (a Cell with a
  jitted ``construct`` and ``Cell.set_inputs``);
* the total time of 20 steps over 20 different batch sizes (8, 16, ..., 160),
  compiles included, for the same three (the static one compiles 20 times).
"""

from __future__ import annotations

import time

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

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


class _MsStepCell(nn.Cell):
    """MindSpore's own ``set_inputs`` network: a Cell with a jitted ``construct``."""

    @ms.jit
    def construct(self, w1, w2, x, y):
        return _ms_grad(w1, w2, x, y)


def _ms_cell():
    cell, s = _MsStepCell(), ms.Symbol(unique=True)
    cell.set_inputs(Tensor(shape=[784, 512], dtype=ms.float32),
                    Tensor(shape=[512, 10], dtype=ms.float32),
                    Tensor(shape=[s, 784], dtype=ms.float32),
                    Tensor(shape=[s, 10], dtype=ms.float32))
    return cell


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
            fs.value_and_grad(_fs_loss, argnums=(0, 1)))), ("ms_dynamic", _ms_dynamic),
                       ("ms_cell", _ms_cell)):
        f = make()
        t0 = time.perf_counter()
        losses = [_wait(f(w1, w2, *_data(b, np.random.default_rng(b)))) for b in sizes]
        totals[name] = (time.perf_counter() - t0, losses, f)
    ref = totals["fs_static"][1]
    for name in ("fs_dynamic", "ms_dynamic", "ms_cell"):
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
             "ms_dynamic": "mindspore.jit + enable_dynamic",
             "ms_cell": "mindspore Cell.set_inputs + jitted construct"}
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


# -- the seed's sharded network -------------------------------------------------------

SHARDED_SIZES = (8, 16, 24, 48)


def _seed_loss(p, x, labels):
    h = ops.reshape(x, (-1, 64))
    h = ops.relu(ops.matmul(h, p["fc1"]))
    h = ops.relu(ops.matmul(h, p["fc2"]))
    logp = ops.log_softmax(ops.matmul(h, p["fc3"]), 1)
    return ops.mean(-ops.gather_elements(logp, 1, ops.expand_dims(labels, 1)))


def _seed_step(p, x, labels):
    loss, grads = fs.value_and_grad(_seed_loss)(p, x, labels)
    return {k: p[k] - 0.5 * grads[k] for k in p}, loss


_SEED_STRATEGY = ({"fc1": (4, 1), "fc2": (8, 1), "fc3": None}, (2, 1, 4, 1), None)


def _seed_sharded(dynamic: bool):
    p_strategy = _SEED_STRATEGY[0]
    sharded = fs.shard(_seed_step, in_strategy=_SEED_STRATEGY, out_strategy=(p_strategy, None),
                       mesh=8)
    if not dynamic:
        return fs.jit(sharded)
    s0 = fs.Symbol(divisor=8)
    return sharded.set_inputs(None, fs.ArrayType((s0, 1, 8, 8), ms.float32),
                              fs.ArrayType((s0,), ms.int32))


@benchmark("dynamic_shapes_sharded",
           title="the seed's sharded network on 8 virtual devices: a Symbol batch")
def dynamic_shapes_sharded(ctx):
    rng = np.random.default_rng(0)
    params = {k: Tensor((rng.normal(size=s) * 0.1).astype(np.float32))
              for k, s in (("fc1", (64, 64)), ("fc2", (64, 64)), ("fc3", (64, 10)))}
    batches = {b: (Tensor(rng.random((b, 1, 8, 8), np.float32)),
                   Tensor(rng.integers(0, 10, b).astype(np.int32))) for b in SHARDED_SIZES}
    sizes = SHARDED_SIZES if not ctx.quick else SHARDED_SIZES[:3]
    totals, steps = {}, {}
    for name, dynamic in (("dynamic", True), ("static", False)):
        f = steps[name] = _seed_sharded(dynamic)
        t0 = time.perf_counter()
        losses = [float(f(params, *batches[b])[1].asnumpy()) for b in sizes]
        totals[name] = (time.perf_counter() - t0, losses)
    np.testing.assert_allclose(totals["dynamic"][1], totals["static"][1], rtol=1e-5)
    fns = {f"{name}_{b}": (lambda f=f, b=b: f(params, *batches[b])[1].asnumpy())
           for name, f in steps.items() for b in (16, 48)}
    t = ctx.compare(fns, runs=ctx.runs(30, 3), warmup=2, rounds=2)
    label = {"dynamic": "fs.shard(...).set_inputs(Symbol(divisor=8) batch)",
             "static": "fs.jit(fs.shard(...)), compiled for this size"}
    rows = [row("fshard", f"{label[name]}, step at batch {b}", t[f"{name}_{b}"])
            for b in (16, 48) for name in steps]
    for name, (total, _) in totals.items():
        rows.append(Row("fshard", f"{label[name]}: {len(sizes)} steps over {len(sizes)} "
                        "sizes, compiles included", total, total, 1))
    dyn = steps["dynamic"]
    return Result(rows, baseline=f"{label['static']}, step at batch 48",
                  target="one compile for every size; steps close to the static ones",
                  notes=[f"dynamic: trace_count {dyn.trace_count}, compile_count "
                         f"{dyn.compile_count}; every loss equal to the static program's"])
