"""JAX baselines for the benchmark suite; runs in the JAX environment only.

    .jaxenv/bin/python benchmarks/jax_baselines.py --only tiny_call,mlp_forward [--quick]

Prints one JSON document on its last line: ``{name: {label: timing}, "_meta": ...}``
where a timing is ``timing.measure``'s dict. Each baseline mirrors the fshard
benchmark of the same name (same shapes, dtypes, data and run counts) and waits
for its result with ``np.asarray`` (MindSpore's side uses ``.asnumpy()``).
Add a baseline as one function registered in ``BASELINES``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

BASELINES = {}


def baseline(fn):
    BASELINES[fn.__name__] = fn
    return fn


def _runs(quick, full, q):
    return q if quick else full


@baseline
def tiny_call(quick):
    """Cached jit call on 2x2 inputs: matmul -> relu -> add."""
    rng = np.random.default_rng(0)
    a, b, c = (jnp.asarray(rng.standard_normal((2, 2), dtype=np.float32)) for _ in range(3))

    def f(a, b, c):
        return jnp.maximum(a @ b, 0.0) + c

    jf = jax.jit(f)
    jf(a, b, c).block_until_ready()
    runs = _runs(quick, 3000, 200)
    t = timing.compare({
        "jax.jit + np.asarray": lambda: np.asarray(jf(a, b, c)),
        "jax.jit + block_until_ready": lambda: jf(a, b, c).block_until_ready(),
    }, runs=runs, warmup=20)
    t["jax eager, 3 ops + np.asarray"] = timing.measure(
        lambda: np.asarray(f(a, b, c)), runs=_runs(quick, 1000, 100), warmup=10)
    return t


def mlp_params(rng, sizes):
    params = []
    for m, n in zip(sizes[:-1], sizes[1:]):
        w = (rng.standard_normal((m, n)) / np.sqrt(m)).astype(np.float32)
        b = (0.1 * rng.standard_normal(n)).astype(np.float32)
        params.append((w, b))
    return params


def mlp(params, x):
    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1:
            x = jnp.maximum(x, 0.0)
    return x


@baseline
def mlp_forward(quick):
    """Compiled MLP forward, batch 128, 784-512-512-10, relu."""
    rng = np.random.default_rng(0)
    params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in mlp_params(rng, [784, 512, 512, 10])]
    x = jnp.asarray(rng.standard_normal((128, 784), dtype=np.float32))
    jf = jax.jit(mlp)
    jf(params, x).block_until_ready()
    return {"jax.jit + np.asarray": timing.measure(
        lambda: np.asarray(jf(params, x)), runs=_runs(quick, 300, 30), warmup=10)}


DEEP_LAYERS, DEEP_WIDTH, DEEP_BATCH = 100, 32, 8


@baseline
def trace_100(quick):
    """Trace (and lower, and compile) a 100-layer MLP, a fresh function each time."""
    rng = np.random.default_rng(0)
    params = mlp_params(rng, [DEEP_WIDTH] * (DEEP_LAYERS + 1))
    x = rng.standard_normal((DEEP_BATCH, DEEP_WIDTH), dtype=np.float32)

    def fresh():
        return lambda p, x: mlp(p, x)

    runs = _runs(quick, 20, 3)
    out = {
        "jax.make_jaxpr": timing.measure_each(lambda: lambda: jax.make_jaxpr(fresh())(params, x),
                                              runs=runs),
        "jax.jit(f).lower (trace + StableHLO)": timing.measure_each(
            lambda: lambda: jax.jit(fresh()).lower(params, x), runs=runs),
    }

    def compile_only():
        lowered = jax.jit(fresh()).lower(params, x)
        return lowered.compile

    out["XLA compile (lowered.compile)"] = timing.measure_each(compile_only,
                                                               runs=_runs(quick, 5, 1))
    return out


def _mlp_data(rng, batch=128):
    """The data of ``benchmarks/vmap_grad.py``: params, inputs, integer labels."""
    params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in mlp_params(rng, [784, 512, 512, 10])]
    x = jnp.asarray(rng.standard_normal((batch, 784), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, 10, batch).astype(np.int32))
    return params, x, y


def _xent(logits, y):
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))


def _sync(out):
    for t in jax.tree_util.tree_leaves(out):
        np.asarray(t)


@baseline
def per_example_grads(quick):
    """jit(vmap(grad(loss))) of the MLP, batch 128 (benchmarks/vmap_grad.py)."""
    params, x, y = _mlp_data(np.random.default_rng(0))

    def example_loss(p, x, y):
        return _xent(mlp(p, x[None]), y[None])

    f = jax.jit(jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0)))
    _sync(f(params, x, y))
    return {"jax.jit(jax.vmap(jax.grad(loss)))": timing.measure(
        lambda: _sync(f(params, x, y)), runs=_runs(quick, 30, 3), warmup=2)}


@baseline
def train_step(quick):
    """jit(value_and_grad(loss)) of the MLP, batch 128 (benchmarks/vmap_grad.py)."""
    params, x, y = _mlp_data(np.random.default_rng(0))

    def loss(p, x, y):
        return _xent(mlp(p, x), y)

    f = jax.jit(jax.value_and_grad(loss))
    _sync(f(params, x, y))
    return {"jax.jit(jax.value_and_grad(loss))": timing.measure(
        lambda: _sync(f(params, x, y)), runs=_runs(quick, 400, 30), warmup=10)}


@baseline
def random_normal(quick):
    """1M float32 normals from a key (benchmarks/rng.py)."""
    draw = jax.jit(lambda k: jax.random.normal(k, (1000, 1000)))
    key = jax.random.split(jax.random.key(0), 8)[1]
    draw(key).block_until_ready()
    return {"jax.jit(jax.random.normal)": timing.measure(
        lambda: np.asarray(draw(key)), runs=_runs(quick, 40, 4), warmup=3)}


@baseline
def loops(quick):
    """fori_loop of x * 1.01 + 1 on 1,000 float32 values (benchmarks/control_flow.py)."""
    x = jnp.ones(1000, jnp.float32)
    out = {}
    for steps in (10, 100, 1000):
        f = jax.jit(lambda x, s=steps: jax.lax.fori_loop(0, s, lambda i, x: x * 1.01 + 1.0, x))
        f(x).block_until_ready()
        out[f"jax.lax.fori_loop, {steps} steps"] = timing.measure(
            lambda f=f: np.asarray(f(x)), runs=_runs(quick, 30, 3), warmup=2)
    return out


@baseline
def cond(quick):
    """lax.cond on a traced predicate, cheap and heavy branches (benchmarks/control_flow.py)."""
    out = {}
    rng = np.random.default_rng(0)
    for size, n in ((1000, 1), (256, 4)):
        shape = (size, size) if n > 1 else (size,)
        x = jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.1)
        w = jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.1)

        def branch(x, w, sign, n=n):
            for _ in range(n):
                x = jnp.tanh(x @ w if x.ndim == 2 else x * w) * sign
            return x

        f = jax.jit(lambda p, x, w: jax.lax.cond(p, lambda x, w: branch(x, w, 1.0),
                                                 lambda x, w: branch(x, w, -1.0), x, w))
        p = jnp.bool_(True)
        f(p, x, w).block_until_ready()
        what = (f"{n} x (matmul + tanh) on {size}x{size}" if n > 1
                else f"tanh(x * w) on {size} values")
        out[f"jax.lax.cond, {what}"] = timing.measure(
            lambda f=f, x=x, w=w: np.asarray(f(p, x, w)), runs=_runs(quick, 40, 4), warmup=2)
    return out


@baseline
def train_scan(quick):
    """10 dropout-MLP training steps on digits, Adam: lax.scan vs a loop of jitted
    steps (benchmarks/control_flow.py)."""
    k, b = 10, 32
    rng = np.random.default_rng(0)
    # Inputs of the digits' shapes and range (this environment has no scikit-learn;
    # the time does not depend on the values).
    xs = jnp.asarray(rng.uniform(0, 1, (k, b, 64)).astype(np.float32))
    ys = jnp.asarray(rng.integers(0, 10, (k, b)).astype(np.int32))
    params = {"w1": jnp.asarray((rng.standard_normal((64, 32)) * 0.1).astype(np.float32)),
              "b1": jnp.zeros(32), "w2": jnp.asarray(
                  (rng.standard_normal((32, 10)) * 0.1).astype(np.float32)),
              "b2": jnp.zeros(10)}

    def loss(p, key, x, y):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        h = jnp.where(keep, h / 0.9, 0.0)
        logits = h @ p["w2"] + p["b2"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    def step(carry, batch):
        p, m, v, t, key = carry
        key, sub = jax.random.split(key)
        value, g = jax.value_and_grad(loss)(p, sub, *batch)
        t = t + 1
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, g)
        lr = 1e-2 * jnp.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        p = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8), p, m, v)
        return (p, m, v, t, key), value

    zeros = jax.tree.map(jnp.zeros_like, params)
    carry = (params, zeros, zeros, jnp.float32(0), jax.random.key(0))
    scanned = jax.jit(lambda c: jax.lax.scan(step, c, (xs, ys)))
    jstep = jax.jit(step)
    scanned(carry)[1].block_until_ready()

    def loop():
        c = carry
        out = []
        for i in range(k):
            c, value = jstep(c, (xs[i], ys[i]))
            out.append(value)
        return np.asarray(jnp.stack(out))

    loop()
    runs = _runs(quick, 30, 3)
    return {"jax.jit(jax.lax.scan(step)) over 10 steps": timing.measure(
                lambda: np.asarray(scanned(carry)[1]), runs=runs, warmup=2),
            "Python loop of 10 jax.jit(step) calls": timing.measure(loop, runs=runs, warmup=2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default=",".join(BASELINES))
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    out = {"_meta": {"jax": jax.__version__, "numpy": np.__version__,
                     "devices": [str(d) for d in jax.devices()]}}
    for n in names:
        if n not in BASELINES:
            out.setdefault("_missing", []).append(n)
            continue
        out[n] = BASELINES[n](args.quick)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
