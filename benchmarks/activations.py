"""The clamps: ``ops.relu6``, ``ops.clamp``, ``ops.hardswish`` and ``ops.hardsigmoid``
over 1M float32 values in [-8, 8], forward and gradient, ``fs.jit`` against
``mindspore.jit`` of the same function and ``jax.jit`` of its JAX counterpart.

Each clamp is a primitive of fshard's with MindSpore's derivative at its bounds in its
JVP rule, so the forward program runs MindSpore's kernels alone (``clamp``: Maximum
and Minimum, which MindSpore's ClampScalar matches value for value). Every timed call
reads its result back; the variants are timed interleaved.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

import fshard as fs
from benchmarks.harness import Result, benchmark, row

N = 1 << 20


def relu6(x):
    return ops.relu6(x)


def clamp(x):
    return ops.clamp(x, 0.0, 3.0)


def hardswish(x):
    return ops.hardswish(x)


def hardsigmoid(x):
    return ops.hardsigmoid(x)


FUNCTIONS = {"relu6": relu6, "clamp(x, 0, 3)": clamp, "hardswish": hardswish,
             "hardsigmoid": hardsigmoid}


def _loss(f):
    def loss(x):
        return f(x).sum()

    return loss


def _rows_against_mindspore(t: dict, names) -> list:
    """Per function: fshard's and MindSpore's forward, then their gradients (the keys
    ``fs NAME``, ``ms NAME``, ``fs grad NAME``, ``ms grad NAME`` of ``t``)."""
    rows = []
    for name in names:
        rows += [row("fshard", f"fs.jit({name})", t[f"fs {name}"]),
                 row("mindspore", f"mindspore.jit({name})", t[f"ms {name}"]),
                 row("fshard", f"fs.jit(fs.grad({name}))", t[f"fs grad {name}"]),
                 row("mindspore", f"mindspore.jit(mindspore.grad({name}))",
                     t[f"ms grad {name}"])]
    return rows


@benchmark("clamps", title="relu6, clamp, hardswish, hardsigmoid: forward and gradient, "
           "1M float32", jax="clamps")
def clamps(ctx):
    x = ms.Tensor(np.random.default_rng(0).uniform(-8, 8, N).astype(np.float32))
    calls, agree = {}, []
    for name, f in FUNCTIONS.items():
        fwd_fs, fwd_ms = fs.jit(f), ms.jit(f)
        grad_fs, grad_ms = fs.jit(fs.grad(_loss(f))), ms.jit(ms.grad(_loss(f)))
        agree.append(np.array_equal(fwd_fs(x).asnumpy(), fwd_ms(x).asnumpy())
                     and np.array_equal(grad_fs(x).asnumpy(), grad_ms(x).asnumpy()))
        for key, g in ((f"fs {name}", fwd_fs), (f"ms {name}", fwd_ms),
                       (f"fs grad {name}", grad_fs), (f"ms grad {name}", grad_ms)):
            calls[key] = lambda g=g: g(x).asnumpy()
    t = ctx.compare(calls, runs=ctx.runs(60, 6), warmup=3, rounds=5)
    rows = _rows_against_mindspore(t, FUNCTIONS)
    rows += ctx.jax_rows("clamps")
    return Result(rows, baseline="mindspore.jit(relu6)",
                  target="each fshard row no slower than MindSpore's row below it",
                  notes=["values and gradients equal to MindSpore's bit for bit: "
                         f"{all(agree)}", "timed interleaved, 5 rounds"])


def max_over_rows(x):
    return ops.max(x, 1)


def amax_over_rows(x):
    return ops.amax(x, 1)


def max_shared_at_ties(x):
    # fshard's composition before one-axis maxima read their value at the index: the
    # derivative shared among ties, unlike MindSpore's
    return fs.ops.reduce_max(x, 1), fs.ops.argmax(x, 1)


@benchmark("extrema", title="ops.max(x, 1) with its indices, forward and gradient, and "
           "ops.amax(x, 1): 1024 x 1024 float32 with ties")
def extrema(ctx):
    # ReLU outputs: half of each row 0, the maxima mostly unique, the zeros tied
    rng = np.random.default_rng(0)
    x = ms.Tensor(np.maximum(rng.normal(size=(1024, 1024)), 0).astype(np.float32))
    xz = ms.Tensor(np.zeros((1024, 1024), np.float32))  # every row one tie

    def loss(f):
        return lambda v: f(v)[0].sum()

    calls, agree = {}, []
    for key, f, jit, grad in (("fs", max_over_rows, fs.jit, fs.grad),
                              ("ms", max_over_rows, ms.jit, ms.grad),
                              ("fs shared", max_shared_at_ties, fs.jit, fs.grad)):
        fwd, g = jit(f), jit(grad(loss(f)))
        calls[key] = lambda fwd=fwd: fwd(x)[0].asnumpy()
        calls[f"{key} grad"] = lambda g=g: g(x).asnumpy()
        agree.append((g(x).asnumpy(), g(xz).asnumpy()))
    for key, jit in (("fs amax", fs.jit), ("ms amax", ms.jit)):
        calls[key] = lambda f=jit(amax_over_rows): f(x).asnumpy()
    t = ctx.compare(calls, runs=ctx.runs(40, 6), warmup=3, rounds=5)
    same = all(np.array_equal(a, b) for a, b in zip(agree[0], agree[1]))
    return Result([
        row("fshard", "fs.jit(ops.max(x, 1))", t["fs"]),
        row("mindspore", "mindspore.jit(ops.max(x, 1))", t["ms"]),
        row("fshard", "fs.jit: reduce_max and argmax (shared at ties)", t["fs shared"]),
        row("fshard", "fs.jit(fs.grad(ops.max(x, 1)[0].sum()))", t["fs grad"]),
        row("mindspore", "mindspore.jit(mindspore.grad(...))", t["ms grad"]),
        row("fshard", "fs.jit(fs.grad(...)): reduce_max (shared at ties)", t["fs shared grad"]),
        row("fshard", "fs.jit(ops.amax(x, 1)): ArgMaxWithValue's values", t["fs amax"]),
        row("mindspore", "mindspore.jit(ops.amax(x, 1)): ReduceMax", t["ms amax"]),
    ], baseline="mindspore.jit(ops.max(x, 1))",
        target="fshard's derivative at ties MindSpore's, at MindSpore's speed",
        notes=[f"gradients equal to MindSpore's on ReLU outputs and on zeros: {same}",
               "timed interleaved, 5 rounds"])


def elu(x):
    return ops.elu(x)


def selu(x):
    return ops.selu(x)


def softplus(x):
    return ops.softplus(x)


def gelu_tanh(x):
    return ops.gelu(x, approximate="tanh")


def mish(x):
    return ops.mish(x)


SMOOTH = {"elu": elu, "selu": selu, "softplus": softplus, "gelu(tanh)": gelu_tanh,
          "mish": mish}


@benchmark("smooth", title="elu, selu, softplus, gelu(tanh), mish: forward and gradient, "
           "1M float32")
def smooth(ctx):
    """fshard's elu and selu build on an expm1 that keeps its digits below |x| = 0.5
    (MindSpore's Expm1 kernel is exp(x) - 1), softplus on selects with the right
    derivative at 0 and on a log1p corrected by a Newton step, gelu's derivative on
    sigmoids, mish on exp alone (MindSpore's Tanh rounds to 1 early): what those cost
    against MindSpore's single kernels."""
    x = ms.Tensor(np.random.default_rng(0).uniform(-8, 8, N).astype(np.float32))
    calls = {}
    for name, f in SMOOTH.items():
        for key, g in ((f"fs {name}", fs.jit(f)), (f"ms {name}", ms.jit(f)),
                       (f"fs grad {name}", fs.jit(fs.grad(_loss(f)))),
                       (f"ms grad {name}", ms.jit(ms.grad(_loss(f))))):
            calls[key] = lambda g=g: g(x).asnumpy()
    t = ctx.compare(calls, runs=ctx.runs(40, 6), warmup=3, rounds=5)
    rows = _rows_against_mindspore(t, SMOOTH)
    return Result(rows, baseline="mindspore.jit(elu)", notes=["timed interleaved, 5 rounds"])
