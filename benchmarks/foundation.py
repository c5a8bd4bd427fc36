"""Foundation benchmarks: the cost of a cached ``fs.jit`` call, a compiled MLP
forward pass, and tracing/lowering time of a deep program.

Every timed call waits for its result (``.asnumpy()`` on each output; JAX uses
``np.asarray``), so asynchronous dispatch cannot hide work.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

import fshard as fs
from benchmarks.harness import Result, benchmark, row
from fshard.backend import mindspore as backend

# interleave compared variants finely: on 2 shared cores, noise comes in bursts
ROUNDS = 20

# ---------------------------------------------------------------------------
# (a) a cached call on tiny inputs
# ---------------------------------------------------------------------------


def tiny_fs(a, b, c):
    return fs.ops.add(fs.ops.relu(fs.ops.matmul(a, b)), c)


def tiny_ms(a, b, c):
    return ops.add(ops.relu(ops.matmul(a, b)), c)


@benchmark("tiny_call", title="cached jit call, 2x2 inputs: matmul -> relu -> add",
           jax="tiny_call")
def tiny_call(ctx):
    rng = np.random.default_rng(0)
    a, b, c = (ms.Tensor(rng.standard_normal((2, 2), dtype=np.float32)) for _ in range(3))
    f_fs = fs.jit(tiny_fs)
    # fullgraph=True is what fshard compiles with: the graphs are the same and only
    # the call path differs (the default, fullgraph=False, costs the same per call)
    f_ms = ms.jit(tiny_ms, fullgraph=True)
    # the same compiled graph called through MindSpore's graph executor with no
    # Python wrapper: the floor any caller of a MindSpore graph can reach
    f_floor = backend.GraphFunction(ms.jit(tiny_ms, fullgraph=True))
    expect = f_ms(a, b, c).asnumpy()
    for f in (f_fs, f_floor):
        np.testing.assert_allclose(f(a, b, c).asnumpy(), expect, rtol=1e-6)
    notes = [] if f_floor.fast else [
        "the direct graph-executor route did not engage: the 'floor' row and fs.jit "
        "both went through mindspore.jit"]
    # fshard's own per-call work: the same fs.jit call with the graph call replaced
    # by returning a ready tensor
    f_stub = fs.jit(tiny_fs)
    ready = f_stub(a, b, c)
    for compiled in f_stub._calls.values():
        compiled.fn = lambda *args: ready

    runs = ctx.runs(3000, 200)
    t = ctx.compare({
        "fs": lambda: f_fs(a, b, c).asnumpy(),
        "ms": lambda: f_ms(a, b, c).asnumpy(),
        "floor": lambda: f_floor(a, b, c).asnumpy(),
    }, runs=runs, warmup=20, rounds=ROUNDS)
    dispatch = ctx.measure(lambda: f_stub(a, b, c), runs=runs, warmup=20)
    eager = ctx.measure(lambda: tiny_ms(a, b, c).asnumpy(), runs=ctx.runs(1000, 100), warmup=10)
    ref = [rng.standard_normal((2, 2), dtype=np.float32) for _ in range(3)]
    numpy_t = ctx.measure(lambda: np.maximum(ref[0] @ ref[1], 0) + ref[2], runs=runs, warmup=10)
    rows = [
        row("fshard", "fs.jit + .asnumpy()", t["fs"]),
        row("mindspore", "mindspore.jit + .asnumpy()", t["ms"]),
        row("mindspore", "compiled graph via graph executor + .asnumpy()", t["floor"],
            "no Python wrapper: the floor"),
        row("fshard", "fs.jit dispatch alone (graph call stubbed out)", dispatch,
            "flatten, cache key, lookup, unflatten"),
        row("mindspore", "PyNative, 3 ops + .asnumpy()", eager),
        *ctx.jax_rows("tiny_call"),
        row("numpy", "numpy, 3 ops", numpy_t),
    ]
    return Result(rows, baseline="fs.jit + .asnumpy()",
                  target="fs.jit <= mindspore.jit (~140-350 µs); as close to JAX's ~8 µs "
                         "as MindSpore allows",
                  notes=[f"fshard, mindspore.jit and the floor are timed interleaved "
                         f"({runs} calls each, in {ROUNDS} rounds)"] + notes + _jax_note(ctx))


def _jax_note(ctx):
    err = ctx.jax_error()
    return [f"JAX baseline missing: {err}"] if err else []


# ---------------------------------------------------------------------------
# (b) a compiled MLP forward pass
# ---------------------------------------------------------------------------

MLP_SIZES = [784, 512, 512, 10]


def mlp_params(rng, sizes):
    """``[(w, b), ...]`` as NumPy float32, the same as the JAX baseline's."""
    params = []
    for m, n in zip(sizes[:-1], sizes[1:]):
        w = (rng.standard_normal((m, n)) / np.sqrt(m)).astype(np.float32)
        b = (0.1 * rng.standard_normal(n)).astype(np.float32)
        params.append((w, b))
    return params


def mlp_fs(params, x):
    for i, (w, b) in enumerate(params):
        x = fs.ops.add(fs.ops.matmul(x, w), b)
        if i < len(params) - 1:
            x = fs.ops.relu(x)
    return x


def mlp3_ms(w1, b1, w2, b2, w3, b3, x):
    h = ops.relu(ops.matmul(x, w1) + b1)
    h = ops.relu(ops.matmul(h, w2) + b2)
    return ops.matmul(h, w3) + b3


@benchmark("mlp_forward", title="compiled MLP forward, batch 128, 784-512-512-10, relu",
           jax="mlp_forward")
def mlp_forward(ctx):
    rng = np.random.default_rng(0)
    params = [(ms.Tensor(w), ms.Tensor(b)) for w, b in mlp_params(rng, MLP_SIZES)]
    x = ms.Tensor(rng.standard_normal((128, 784), dtype=np.float32))
    flat = [t for wb in params for t in wb]
    f_fs = fs.jit(mlp_fs)
    f_ms = ms.jit(mlp3_ms)
    np.testing.assert_allclose(f_fs(params, x).asnumpy(), f_ms(*flat, x).asnumpy(),
                               rtol=1e-4, atol=1e-4)
    runs = ctx.runs(300, 30)
    t = ctx.compare({
        "fs": lambda: f_fs(params, x).asnumpy(),
        "ms": lambda: f_ms(*flat, x).asnumpy(),
    }, runs=runs, warmup=10, rounds=ROUNDS)
    rows = [
        row("fshard", "fs.jit (params as a pytree) + .asnumpy()", t["fs"]),
        row("mindspore", "mindspore.jit (hand-written) + .asnumpy()", t["ms"]),
        *ctx.jax_rows("mlp_forward"),
    ]
    return Result(rows, baseline="fs.jit (params as a pytree) + .asnumpy()",
                  target="fs.jit <= mindspore.jit: the graph is the same, fshard adds "
                         "only its per-call path",
                  notes=[f"fshard and mindspore.jit timed interleaved ({runs} calls each, "
                         f"{ROUNDS} rounds)"]
                  + _jax_note(ctx))


# ---------------------------------------------------------------------------
# (c) tracing and lowering a 100-layer MLP
# ---------------------------------------------------------------------------

DEEP_LAYERS, DEEP_WIDTH, DEEP_BATCH = 100, 32, 8


def deep_fn():
    """A fresh function object each time, so no cache can answer."""
    def deep(params, x):
        for w, b in params:
            x = fs.ops.relu(fs.ops.add(fs.ops.matmul(x, w), b))
        return x
    return deep


@benchmark("trace_100", title="trace + lower a 100-layer MLP (fresh function each time)",
           jax="trace_100")
def trace_100(ctx):
    rng = np.random.default_rng(0)
    params = [(ms.Tensor(w), ms.Tensor(b))
              for w, b in mlp_params(rng, [DEEP_WIDTH] * (DEEP_LAYERS + 1))]
    x = ms.Tensor(rng.standard_normal((DEEP_BATCH, DEEP_WIDTH), dtype=np.float32))
    n_eqs = len(fs.make_ir(deep_fn())(params, x).program.equations)
    runs = ctx.runs(20, 3)
    lower = ctx.measure_each(lambda: lambda: fs.jit(deep_fn()).lower(params, x), runs=runs)
    stage = ctx.measure_each(lambda: lambda: fs.make_ir(deep_fn())(params, x), runs=runs)

    leaves = fs.tree.leaves((params, x))

    def first_call():  # untimed: staging and lowering; timed: compile and one run
        lowered = fs.jit(deep_fn()).lower(params, x)
        return lambda: lowered.compile()(*leaves).asnumpy()

    compile_t = ctx.measure_each(first_call, runs=ctx.runs(5, 1))
    rows = [
        row("fshard", "fs.jit(f).lower (stage + generate source)", lower),
        row("fshard", "fs.make_ir (stage only)", stage),
        *ctx.jax_rows("trace_100"),
        row("mindspore", "MindSpore compile + first run of the lowered source", compile_t,
            "not part of the target; for scale"),
    ]
    return Result(rows, baseline="fs.jit(f).lower (stage + generate source)",
                  target="trace + lower within a small factor of jax.make_jaxpr",
                  notes=[f"{n_eqs} equations; layers of width {DEEP_WIDTH}, batch {DEEP_BATCH}",
                         "each run uses a new function and a new fs.jit, so nothing is cached"]
                  + _jax_note(ctx))
