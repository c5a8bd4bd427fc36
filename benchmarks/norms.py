"""Normalisation benchmarks: a training step of a BatchNorm-heavy network with
BatchNorm traced natively (fshard's composite: reductions, ``rsqrt``, ``mul``; the
moving statistics written with ``Assign``) against the same network with BatchNorm on
the generic path (one MindSpore ``BatchNorm`` equation, MindSpore's bprop) and against
``mindspore.jit(mindspore.value_and_grad(...))``.

- ``batchnorm_cnn_step``: three blocks of ``Conv2d(3x3) -> BatchNorm2d -> ReLU`` (16,
  32, 32 channels) on a (16, 3, 16, 16) batch, training mode, loss ``mean(out**2)``,
  gradients for every weight.
- ``resnet18_bn_step``: mindcv's resnet18 (20 BatchNorm2d layers), training mode, a
  (8, 3, 32, 32) batch, the same loss (skipped without mindcv).

The generic variant is traced with the ``BatchNorm`` converter taken out of
``fshard.adapter.interop.CONVERTERS`` (and put back before anything else is traced). Every
timed call waits for its outputs.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import mindspore as ms
import numpy as np
from mindspore import nn

import fshard as fs
from fshard.adapter import interop
from benchmarks.harness import Result, Row, benchmark, row


@contextlib.contextmanager
def generic_batchnorm():
    """Trace MindSpore's BatchNorm on the generic path (as fshard did before it was
    native)."""
    conv = interop.CONVERTERS.pop("BatchNorm")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        interop.CONVERTERS["BatchNorm"] = conv


def _sync(out) -> None:
    for t in fs.tree.leaves(out):
        t.asnumpy()


def small_cnn() -> nn.Cell:
    layers = []
    for cin, cout in ((3, 16), (16, 32), (32, 32)):
        layers += [nn.Conv2d(cin, cout, 3, pad_mode="same", has_bias=False),
                   nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.SequentialCell(layers)


def _step_benchmark(ctx, make, x_shape, runs):
    """Time a training step of ``make()`` three ways; each way gets its own network (the
    steps update their moving statistics)."""
    x = ms.Tensor(np.random.default_rng(0).standard_normal(x_shape).astype(np.float32))
    nets = {}
    for k in ("native", "generic", "mindspore"):
        ms.set_seed(0)
        nets[k] = make()
        nets[k].set_train(True)

    def fs_step(net):
        # the functional form: gradients for the trainable Parameters; the moving
        # statistics (the Cell's own Parameters) are written in place
        apply, params = fs.functional(net)
        weights = {k: v for k, v in params.items() if v.requires_grad}
        stats = {k: v for k, v in params.items() if not v.requires_grad}

        def loss(ws, stats, x):
            return (apply({**ws, **stats}, x) ** 2).mean()

        f = fs.jit(fs.value_and_grad(loss))
        return lambda: _sync(f(weights, stats, x))

    def ms_step(net):
        weights = net.trainable_params()

        def loss(x):
            return (net(x) ** 2).mean()

        f = ms.jit(ms.value_and_grad(loss, None, weights))
        return lambda: _sync(f(x))

    steps, first = {}, {}
    for k, make_step in (("native", fs_step), ("mindspore", ms_step), ("generic", fs_step)):
        step = make_step(nets[k])
        t0 = time.perf_counter()
        if k == "generic":
            with generic_batchnorm():
                step()
        else:
            step()
        first[k] = time.perf_counter() - t0
        steps[k] = step
    t = ctx.compare(steps, runs=runs, warmup=2, rounds=5)
    mm = {k: nets[k].parameters_dict() for k in nets}
    stat = [n for n in mm["native"] if "moving_mean" in n or n.endswith(".mean")][0]
    same = all(np.allclose(mm[k][stat].asnumpy(), mm["mindspore"][stat].asnumpy(),
                           rtol=1e-4, atol=1e-6) for k in ("native", "generic"))
    rows = [
        row("fshard", "fs.jit(fs.value_and_grad(loss)), BatchNorm native", t["native"]),
        row("fshard", "fs.jit(fs.value_and_grad(loss)), BatchNorm generic", t["generic"]),
        row("mindspore", "mindspore.jit(mindspore.value_and_grad(loss))", t["mindspore"]),
    ] + [Row(sys_, f"first call (trace + compile): {k}", first[k], first[k], 1)
         for k, sys_ in (("native", "fshard"), ("generic", "fshard"),
                         ("mindspore", "mindspore"))]
    return Result(rows, baseline="mindspore.jit(mindspore.value_and_grad(loss))",
                  target="the native step no slower than MindSpore's own",
                  notes=[f"timed interleaved ({runs} calls each, 5 rounds)",
                         "moving statistics equal after every variant's steps: "
                         f"{same} (each variant ran the same number of steps)"])


@benchmark("batchnorm_cnn_step", title="A training step of a small CNN with BatchNorm2d")
def batchnorm_cnn_step(ctx):
    return _step_benchmark(ctx, small_cnn, (16, 3, 16, 16), ctx.runs(30, 6))


@benchmark("resnet18_bn_step", title="A training step of mindcv's resnet18 (BatchNorm2d)")
def resnet18_bn_step(ctx):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import mindcv
    except ImportError:
        return Result([], notes=["mindcv is not installed"])

    def make():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return mindcv.create_model("resnet18", pretrained=False, num_classes=10)

    return _step_benchmark(ctx, make, (8, 3, 32, 32), ctx.runs(20, 4))
