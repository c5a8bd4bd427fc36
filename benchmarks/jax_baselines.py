"""JAX baselines for the benchmark suite; runs in the JAX environment only.

    .jaxenv/bin/python benchmarks/jax_baselines.py --only tiny_call,mlp_forward [--quick]

Prints one JSON document on its last line: ``{name: {label: timing}, "_meta": ...}``
where a timing is ``timing.measure``'s dict. Each baseline mirrors the fshard
benchmark of the same name (same shapes, dtypes, data and run counts) and waits
for its result with ``np.asarray`` (MindSpore's side uses ``.asnumpy()``); the
training steps wait for every output (``jax.block_until_ready``). A label starting
with ``_`` is not a timing: ``"_check"`` carries what the MindSpore side compares to
know both ran the same model (first losses from the initial values of
``model_specs.py``, parameter counts). Add a baseline as one function registered
in ``BASELINES``.
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
import model_specs  # noqa: E402
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
def clamps(quick):
    """relu6, clip, hard_swish, hard_sigmoid over 1M float32 values, forward and
    gradient (benchmarks/activations.py)."""
    x = jnp.asarray(np.random.default_rng(0).uniform(-8, 8, 1 << 20).astype(np.float32))
    fns = {"relu6": jax.nn.relu6, "clamp(x, 0, 3)": lambda v: jnp.clip(v, 0.0, 3.0),
           "hardswish": jax.nn.hard_swish, "hardsigmoid": jax.nn.hard_sigmoid}
    out = {}
    for name, f in fns.items():
        grad = jax.jit(jax.grad(lambda v, f=f: f(v).sum()))
        for label, g in ((f"jax.jit({name})", jax.jit(f)), (f"jax.jit(jax.grad({name}))", grad)):
            g(x).block_until_ready()
            out[label] = timing.measure(lambda g=g: np.asarray(g(x)), runs=_runs(quick, 60, 6),
                                        warmup=3)
    return out


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


def _first_and_steps(make, args, runs, first_runs, warmup):
    """A training step's timings: ``make()`` returns a fresh ``jax.jit`` step
    ``(state, *args) -> (state, loss)`` and its initial state. The first call (trace,
    compile, the step) is timed on a fresh step each time; the steady steps on one,
    each waiting for every output (``jax.block_until_ready``), the updated state fed
    back. Returns ``(first, steps, losses)``: the first three losses of one step."""
    def first():
        step, state = make()
        return lambda: jax.block_until_ready(step(state, *args))

    first_t = timing.measure_each(first, runs=first_runs)
    step, state = make()
    box = [state]
    losses = []
    for _ in range(3):
        box[0], loss = jax.block_until_ready(step(box[0], *args))
        losses.append(float(loss))

    def call():
        box[0], _ = jax.block_until_ready(step(box[0], *args))

    return first_t, timing.measure(call, runs=runs, warmup=warmup), losses


# ---------------------------------------------------------------------------
# ResNet-18 (benchmarks/resnet.py): mindcv's resnet18, in plain JAX
# ---------------------------------------------------------------------------

RESNET_LR, RESNET_MOMENTUM, BN_EPS, BN_MOMENTUM = 0.01, 0.9, 1e-5, 0.9


def _conv(x, w, stride, pad):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), ((pad, pad), (pad, pad)),
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))


def _batch_norm(x, p, stats, name, new_stats):
    """Training-mode BatchNorm2d (mindcv's: eps 1e-5, momentum 0.9): normalise with
    the batch's biased variance; the moving variance takes the unbiased one."""
    mean = x.mean((0, 2, 3))
    var = x.var((0, 2, 3))
    n = x.size // x.shape[1]
    m = jax.lax.stop_gradient
    new_stats[f"{name}.moving_mean"] = (BN_MOMENTUM * stats[f"{name}.moving_mean"]
                                        + (1 - BN_MOMENTUM) * m(mean))
    new_stats[f"{name}.moving_variance"] = (BN_MOMENTUM * stats[f"{name}.moving_variance"]
                                            + (1 - BN_MOMENTUM) * m(var) * n / (n - 1))
    shape = (1, -1, 1, 1)
    y = (x - mean.reshape(shape)) * jax.lax.rsqrt(var.reshape(shape) + BN_EPS)
    return y * p[f"{name}.gamma"].reshape(shape) + p[f"{name}.beta"].reshape(shape)


def resnet18(p, stats, x):
    """``(logits, new_stats)``: mindcv's resnet18 forward in training mode (NCHW)."""
    new = {}
    relu = jax.nn.relu
    x = relu(_batch_norm(_conv(x, p["conv1.weight"], 2, 3), p, stats, "bn1", new))
    # MaxPool2d(3, stride 2, pad_mode "same"): TF-style SAME padding, -inf outside
    x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "SAME")
    for stage, (_, stride) in enumerate(model_specs.RESNET_STAGES, 1):
        for block in range(2):
            pre = f"layer{stage}.{block}"
            s = stride if block == 0 else 1
            h = relu(_batch_norm(_conv(x, p[f"{pre}.conv1.weight"], s, 1), p, stats,
                                 f"{pre}.bn1", new))
            h = _batch_norm(_conv(h, p[f"{pre}.conv2.weight"], 1, 1), p, stats, f"{pre}.bn2",
                            new)
            if f"{pre}.down_sample.0.weight" in p:  # 1x1, stride s, "same": no padding
                x = _batch_norm(_conv(x, p[f"{pre}.down_sample.0.weight"], s, 0), p, stats,
                                f"{pre}.down_sample.1", new)
            x = relu(h + x)
    x = x.mean((2, 3))  # GlobalAvgPooling
    return x @ p["classifier.weight"].T + p["classifier.bias"], new


def _resnet18_state(seed=0):
    w = model_specs.resnet18_weights(seed)
    params = {k: jnp.asarray(v) for k, v in w.items() if model_specs.trainable(k)}
    stats = {k: jnp.asarray(v) for k, v in w.items() if not model_specs.trainable(k)}
    return params, jax.tree.map(jnp.zeros_like, params), stats


def _resnet18_make():
    def loss(p, stats, x, y):
        logits, new = resnet18(p, stats, x)
        return _xent(logits, y), new

    def step(state, x, y):
        # nn.Momentum / fs.optim.sgd(momentum=0.9): v = 0.9 v + g; p -= lr v
        p, v, stats = state
        (value, stats), g = jax.value_and_grad(loss, has_aux=True)(p, stats, x, y)
        v = jax.tree.map(lambda v, g: RESNET_MOMENTUM * v + g, v, g)
        p = jax.tree.map(lambda p, v: p - RESNET_LR * v, p, v)
        return (p, v, stats), value

    return jax.jit(step), _resnet18_state()


@baseline
def resnet18_train_step(quick):
    """mindcv's ResNet-18 training step in plain JAX (benchmarks/resnet.py): batch 16
    of 3x32x32, 10 classes, training-mode BatchNorm, SGD momentum 0.9."""
    x, y = (jnp.asarray(a) for a in model_specs.resnet18_batch())
    first, steps, losses = _first_and_steps(_resnet18_make, (x, y), _runs(quick, 20, 2),
                                            _runs(quick, 2, 1), warmup=2)
    params, _, stats = _resnet18_state()

    def count(tree):
        return int(sum(a.size for a in jax.tree.leaves(tree)))

    return {"step: jax.jit(value_and_grad) + SGD momentum": steps,
            "first call: trace + compile + step": first,
            "_check": {"losses": losses, "trainable": count(params),
                       "moving_stats": count(stats)}}


# ---------------------------------------------------------------------------
# The Llama-style block (benchmarks/transformers.py), in plain JAX
# ---------------------------------------------------------------------------

LLAMA_LR, ADAM_B1, ADAM_B2, ADAM_EPS = 1e-3, 0.9, 0.999, 1e-8


def _rms_norm(x, w, eps=1e-6):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def llama_block(p, x, cos, sin):
    b, s, d = x.shape
    heads = model_specs.LLAMA_HEADS
    hd = d // heads

    def split(t):
        return t.reshape(b, s, heads, hd).transpose(0, 2, 1, 3)

    h = _rms_norm(x, p["attn_norm"])
    q, k, v = split(h @ p["wq"]), split(h @ p["wk"]), split(h @ p["wv"])
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    scores = (q @ k.transpose(0, 1, 3, 2)) * float(1.0 / np.sqrt(hd))
    mask = jnp.triu(jnp.ones((s, s), bool), k=1)
    scores = jnp.where(mask, -1e9, scores)  # masked_fill
    att = jax.nn.softmax(scores, axis=-1) @ v
    x = x + att.transpose(0, 2, 1, 3).reshape(b, s, d) @ p["wo"]
    h = _rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]


def _llama_make():
    cos, sin = (jnp.asarray(a) for a in model_specs.llama_rotary())

    def loss(p, x, y):
        return jnp.mean((llama_block(p, x, cos, sin) - y) ** 2)

    def step(state, x, y):
        # nn.Adam / fs.optim.adam: p -= lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)
        p, m, v, t = state
        value, g = jax.value_and_grad(loss)(p, x, y)
        t = t + 1
        m = jax.tree.map(lambda m, g: ADAM_B1 * m + (1 - ADAM_B1) * g, m, g)
        v = jax.tree.map(lambda v, g: ADAM_B2 * v + (1 - ADAM_B2) * g * g, v, g)
        lr = LLAMA_LR * jnp.sqrt(1 - ADAM_B2 ** t) / (1 - ADAM_B1 ** t)
        p = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + ADAM_EPS), p, m, v)
        return (p, m, v, t), value

    params = {k: jnp.asarray(w) for k, w in model_specs.llama_weights().items()}
    zeros = jax.tree.map(jnp.zeros_like, params)
    return jax.jit(step), (params, zeros, zeros, jnp.float32(0))


@baseline
def llama_step(quick):
    """One Adam step of the Llama-style block in plain JAX (benchmarks/transformers.py):
    batch 4, sequence 64, width 128, 4 heads, MLP 352, MSE loss."""
    x, y = (jnp.asarray(a) for a in model_specs.llama_batch())
    first, steps, losses = _first_and_steps(_llama_make, (x, y), _runs(quick, 60, 6),
                                            _runs(quick, 3, 1), warmup=3)
    return {"step: jax.jit(value_and_grad + Adam)": steps,
            "first call: trace + compile + step": first,
            "_check": {"losses": losses}}


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
