"""vmap and grad benchmarks: per-example gradients and a full training step.

- ``per_example_grads``: the gradient of the MLP loss for each of 128 examples,
  ``fs.jit(fs.vmap(fs.grad(loss), in_axes=(None, 0, 0)))``, against the same
  computation batched by hand in one MindSpore graph (batched forward, manual
  backward with per-example outer products) and against
  ``ms.jit(ms.vmap(ms.grad(...)))``.
- ``train_step``: ``fs.jit(fs.value_and_grad(loss))`` on the MLP against the
  fastest hand-written MindSpore graphs, ``ms.jit(ms.value_and_grad(...))`` and
  ``ms.jit(ms.grad(...))``, and against JAX.

The MLP is 784-512-512-10 with relu and softmax cross-entropy, batch 128, float32
(the same data as the JAX baselines of the same names). Every timed call waits for
all of its outputs (``.asnumpy()``).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

import fshard as fs
from fshard.primitives import passes
from benchmarks.foundation import MLP_SIZES, mlp_params
from benchmarks.harness import Result, benchmark, row

BATCH = 128


def data(rng):
    """Parameters ``[(w, b), ...]``, inputs ``(128, 784)`` and integer labels, as NumPy."""
    params = mlp_params(rng, MLP_SIZES)
    x = rng.standard_normal((BATCH, MLP_SIZES[0]), dtype=np.float32)
    y = rng.integers(0, MLP_SIZES[-1], BATCH).astype(np.int32)
    return params, x, y


def _sync(out) -> None:
    for t in fs.tree.leaves(out):
        t.asnumpy()


# ---------------------------------------------------------------------------
# The model, written three ways
# ---------------------------------------------------------------------------


def mlp_fs(params, x):
    for i, (w, b) in enumerate(params):
        x = fs.ops.matmul(x, w) + b
        if i < len(params) - 1:
            x = fs.ops.relu(x)
    return x


def loss_fs(params, x, y):
    """Mean softmax cross-entropy of a batch (``x``: (B, 784), ``y``: (B,))."""
    return fs.ops.softmax_cross_entropy(mlp_fs(params, x), y)


def example_loss_fs(params, x, y):
    """The loss of one example (``x``: (784,), ``y``: ())."""
    return fs.ops.softmax_cross_entropy(mlp_fs(params, x[None]), y[None])


def loss_ms(w1, b1, w2, b2, w3, b3, x, y):
    h = ops.relu(ops.matmul(x, w1) + b1)
    h = ops.relu(ops.matmul(h, w2) + b2)
    return ops.cross_entropy(ops.matmul(h, w3) + b3, y)


def example_loss_ms(w1, b1, w2, b2, w3, b3, x, y):
    return loss_ms(w1, b1, w2, b2, w3, b3, x[None], y[None])


_bmm = ops.BatchMatMul()


def per_example_by_hand(w1, b1, w2, b2, w3, b3, x, y):
    """Per-example gradients batched by hand: the batched forward pass, then the
    backward pass with each weight gradient an outer product per example, as a
    batched matmul ``(B, m, 1) @ (B, 1, n)`` (a broadcast multiply
    ``x[:, :, None] * d[:, None, :]`` is ~2x slower on MindSpore's CPU backend)."""
    z1 = ops.matmul(x, w1) + b1
    h1 = ops.relu(z1)
    z2 = ops.matmul(h1, w2) + b2
    h2 = ops.relu(z2)
    logits = ops.matmul(h2, w3) + b3
    d3 = ops.softmax(logits, -1) - ops.one_hot(y, 10, ms.Tensor(1.0, ms.float32),
                                               ms.Tensor(0.0, ms.float32))
    g_w3 = _bmm(ops.expand_dims(h2, 2), ops.expand_dims(d3, 1))
    d2 = ops.matmul(d3, w3.T) * (z2 > 0).astype(ms.float32)
    g_w2 = _bmm(ops.expand_dims(h1, 2), ops.expand_dims(d2, 1))
    d1 = ops.matmul(d2, w2.T) * (z1 > 0).astype(ms.float32)
    g_w1 = _bmm(ops.expand_dims(x, 2), ops.expand_dims(d1, 1))
    return g_w1, d1, g_w2, d2, g_w3, d3


# ---------------------------------------------------------------------------
# (a) per-example gradients
# ---------------------------------------------------------------------------


@benchmark("per_example_grads",
           title="per-example gradients, MLP 784-512-512-10, batch 128",
           jax="per_example_grads")
def per_example_grads(ctx):
    rng = np.random.default_rng(0)
    params_np, x_np, y_np = data(rng)
    params = [(ms.Tensor(w), ms.Tensor(b)) for w, b in params_np]
    flat = [t for wb in params for t in wb]
    x, y = ms.Tensor(x_np), ms.Tensor(y_np)

    f_fs = fs.jit(fs.vmap(fs.grad(example_loss_fs), in_axes=(None, 0, 0)))
    f_hand = ms.jit(per_example_by_hand)
    f_ms = ms.jit(ms.vmap(ms.grad(example_loss_ms, grad_position=(0, 1, 2, 3, 4, 5)),
                          in_axes=(None,) * 6 + (0, 0)))
    got = [t for wb in f_fs(params, x, y) for t in wb]
    for name, other in (("by hand", f_hand(*flat, x, y)), ("ms.vmap", f_ms(*flat, x, y))):
        for a, b in zip(got, other):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-3, atol=1e-5,
                                       err_msg=f"fs.vmap(fs.grad) vs {name}")
    runs = ctx.runs(30, 3)
    t = ctx.compare({
        "fs": lambda: _sync(f_fs(params, x, y)),
        "hand": lambda: _sync(f_hand(*flat, x, y)),
        "ms": lambda: _sync(f_ms(*flat, x, y)),
    }, runs=runs, warmup=2, rounds=3)
    rows = [
        row("fshard", "fs.jit(fs.vmap(fs.grad(loss)))", t["fs"]),
        row("mindspore", "batched by hand, mindspore.jit", t["hand"],
            "batched forward + manual backward with outer products"),
        row("mindspore", "mindspore.jit(mindspore.vmap(mindspore.grad(loss)))", t["ms"]),
        *ctx.jax_rows("per_example_grads"),
    ]
    return Result(rows, baseline="batched by hand, mindspore.jit",
                  target="fs.vmap(fs.grad) within 10% of hand batching",
                  notes=[f"timed interleaved ({runs} calls each, 3 rounds); each call "
                         "returns 128 copies of every gradient (~340 MB)"] + _jax_note(ctx))


# ---------------------------------------------------------------------------
# (b) a training step: loss and gradients of the whole batch
# ---------------------------------------------------------------------------


@benchmark("train_step", title="fs.jit(fs.value_and_grad(loss)), MLP 784-512-512-10, batch 128",
           jax="train_step")
def train_step(ctx):
    rng = np.random.default_rng(0)
    params_np, x_np, y_np = data(rng)
    params = [(ms.Tensor(w), ms.Tensor(b)) for w, b in params_np]
    flat = [t for wb in params for t in wb]
    x, y = ms.Tensor(x_np), ms.Tensor(y_np)
    pos = (0, 1, 2, 3, 4, 5)

    f_vg = fs.jit(fs.value_and_grad(loss_fs))
    f_g = fs.jit(fs.grad(loss_fs))
    m_vg = ms.jit(ms.value_and_grad(loss_ms, grad_position=pos))
    m_g = ms.jit(ms.grad(loss_ms, grad_position=pos))
    v_fs, g_fs = f_vg(params, x, y)
    v_ms, g_ms = m_vg(*flat, x, y)
    np.testing.assert_allclose(v_fs.asnumpy(), v_ms.asnumpy(), rtol=1e-5)
    for a, b in zip([t for wb in g_fs for t in wb], g_ms):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-4, atol=1e-6)
    runs = ctx.runs(400, 30)
    t = ctx.compare({
        "fs_vg": lambda: _sync(f_vg(params, x, y)),
        "ms_g": lambda: _sync(m_g(*flat, x, y)),
        "ms_vg": lambda: _sync(m_vg(*flat, x, y)),
        "fs_g": lambda: _sync(f_g(params, x, y)),
    }, runs=runs, warmup=10, rounds=10)
    staged = f_vg.lower(params, x, y).program
    n_eqs, n_simple = len(staged.equations), len(passes.simplify(staged).equations)
    rows = [
        row("fshard", "fs.jit(fs.value_and_grad(loss))", t["fs_vg"]),
        row("mindspore", "mindspore.jit(mindspore.grad(loss))", t["ms_g"],
            "gradients only"),
        row("mindspore", "mindspore.jit(mindspore.value_and_grad(loss))", t["ms_vg"]),
        row("fshard", "fs.jit(fs.grad(loss))", t["fs_g"]),
        *ctx.jax_rows("train_step"),
    ]
    return Result(rows, baseline="mindspore.jit(mindspore.grad(loss))",
                  target="fs.jit(fs.value_and_grad) at most 5% slower than the fastest "
                         "hand-written MindSpore graph",
                  notes=[f"timed interleaved ({runs} calls each, 10 rounds)",
                         f"the staged Program has {n_eqs} equations, {n_simple} after the "
                         "cleanup passes (fshard/primitives/passes.py)"] + _jax_note(ctx))


def _jax_note(ctx):
    err = ctx.jax_error()
    return [f"JAX baseline missing: {err}"] if err else []
