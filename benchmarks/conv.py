"""Convolution and pooling benchmarks: native rules against the generic path.

- ``cnn_step``: the weight gradients of a small CNN (conv 3->16 3x3, relu, max pool 2,
  conv 16->32 3x3 stride 2, relu, avg pool 2, adaptive average pool to 1x1, dense to
  10, softmax cross-entropy), batch 32, 32x32 float32 images, written with
  ``mindspore.ops``: ``fs.jit(fs.grad(loss))`` with the native conv family, the same
  with the conv and pool converters removed (every conv and pool on the generic path:
  one equation carrying the MindSpore primitive, its bprop as the derivative), and
  ``mindspore.jit(mindspore.grad(loss))``.
- ``resnet18_step``: mindcv's resnet18 (unchanged, 10 classes), batch 8, 32x32:
  forward and input gradient, the same three ways (skipped without mindcv).

First calls (trace + compile + run) are measured once each and given as notes.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import mindspore as ms
import numpy as np
from mindspore import ops

import fshard as fs
from benchmarks.harness import Result, benchmark, row
from fshard.adapter import interop

#: the MindSpore primitives the native conv family converts
NATIVE = ("Conv2D", "Conv2DTranspose", "Conv2DBackpropInput", "MaxPool", "MaxPoolWithArgmaxV2",
          "MaxPool3DWithArgmax", "AvgPool", "AvgPool3D", "AdaptiveAvgPool2D")


@contextlib.contextmanager
def generic_path():
    """Trace with the conv and pool converters removed: the generic path."""
    saved = {k: interop.CONVERTERS.pop(k) for k in NATIVE}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        interop.CONVERTERS.update(saved)


def _sync(out) -> None:
    for t in fs.tree.leaves(out):
        t.asnumpy()


def _first(fn, *args) -> float:
    t0 = time.perf_counter()
    _sync(fn(*args))
    return time.perf_counter() - t0


def cnn_data(rng, batch=32):
    def t(*s, scale=1.0):
        return ms.Tensor((rng.standard_normal(s) * scale).astype(np.float32))

    params = (t(16, 3, 3, 3, scale=0.2), t(32, 16, 3, 3, scale=0.1), t(32, 10, scale=0.2))
    x = t(batch, 3, 32, 32)
    y = ms.Tensor(rng.integers(0, 10, batch).astype(np.int32))
    return params, x, y


def cnn_loss(w1, w2, w3, x, y):
    h = ops.max_pool2d(ops.relu(ops.conv2d(x, w1, pad_mode="pad", padding=1)), 2)
    h = ops.relu(ops.conv2d(h, w2, stride=2, pad_mode="pad", padding=1))
    h = ops.adaptive_avg_pool2d(ops.avg_pool2d(h, 2), 1).reshape(x.shape[0], -1)
    return ops.cross_entropy(ops.matmul(h, w3), y)


def _three_ways(ctx, make_fs, make_ms, args, runs):
    native = make_fs()
    firsts = {"native": _first(native, *args)}
    generic = make_fs()
    with generic_path():
        firsts["generic"] = _first(generic, *args)
    mind = make_ms()
    firsts["ms"] = _first(mind, *args)
    t = ctx.compare({"native": lambda: _sync(native(*args)),
                     "generic": lambda: _sync(generic(*args)),
                     "ms": lambda: _sync(mind(*args))}, runs=runs)
    return t, firsts


def _notes(firsts) -> list:
    return [(f"first call (trace + compile + run), measured once: native "
             f"{firsts['native']:.2f} s, generic path {firsts['generic']:.2f} s, "
             f"mindspore.jit {firsts['ms']:.2f} s")]


@benchmark("cnn_step", title="a CNN's weight gradients: native conv/pool vs the generic path")
def cnn_step(ctx):
    params, x, y = cnn_data(np.random.default_rng(0))
    args = (*params, x, y)
    t, firsts = _three_ways(
        ctx, lambda: fs.jit(fs.grad(cnn_loss, argnums=(0, 1, 2))),
        lambda: ms.jit(ms.grad(cnn_loss, grad_position=(0, 1, 2))), args, ctx.runs(30, 6))
    rows = [row("fshard", "fs.jit(fs.grad(loss)), native conv and pools", t["native"]),
            row("fshard", "fs.jit(fs.grad(loss)), generic path", t["generic"]),
            row("mindspore", "mindspore.jit(mindspore.grad(loss))", t["ms"])]
    return Result(rows, baseline="mindspore.jit(mindspore.grad(loss))",
                  target="native at most the generic path, and near mindspore.jit",
                  notes=_notes(firsts))


@benchmark("resnet18_step", title="mindcv resnet18, forward and input gradient, batch 8")
def resnet18_step(ctx):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import mindcv
    except ImportError:
        return Result([], notes=["mindcv is not installed"])
    ms.set_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = mindcv.create_model("resnet18", pretrained=False, num_classes=10)
    net.set_train(False)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((8, 3, 32, 32)).astype(np.float32))

    def loss(x):
        return (net(x) ** 2).sum()

    t, firsts = _three_ways(ctx, lambda: fs.jit(fs.value_and_grad(loss)),
                            lambda: ms.jit(ms.value_and_grad(loss)), (x,), ctx.runs(12, 3))
    rows = [row("fshard", "fs.jit(fs.value_and_grad(loss)), native conv and pools",
                t["native"]),
            row("fshard", "fs.jit(fs.value_and_grad(loss)), generic path", t["generic"]),
            row("mindspore", "mindspore.jit(mindspore.value_and_grad(loss))", t["ms"])]
    return Result(rows, baseline="mindspore.jit(mindspore.value_and_grad(loss))",
                  target="native at most the generic path, and near mindspore.jit",
                  notes=_notes(firsts))
