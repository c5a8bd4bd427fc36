# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Per-example gradients and differentially private SGD
#
# Plain SGD averages the gradient over a batch and never sees the gradient of one
# example. **DP-SGD** (Abadi et al., 2016) needs exactly that: it clips each example's
# gradient to a norm `C`, so that no single example can move the model much, sums
# the clipped gradients, adds Gaussian noise of scale `σ·C` and averages. The noise
# hides any one example; the clipping bounds how much there is to hide.
#
# With fshard, per-example gradients are one line: the gradient of the loss of
# **one** example, vectorised over the batch and compiled,
#
# ```python
# per_example_grads = fs.jit(fs.vmap(fs.grad(loss), in_axes=(None, 0, 0)))
# ```
#
# `in_axes=(None, 0, 0)`: the parameters are shared, the inputs and labels are
# mapped along their first axis. No loop over examples runs: `vmap` rewrites the
# gradient program into one batched program (the weight gradients become batched
# outer products), and `jit` compiles it into one MindSpore graph.
#
# We train a small classifier on scikit-learn's `load_digits` (8×8 images of the
# digits 0–9, shipped with scikit-learn) with DP-SGD and with plain SGD.

# %%
import io

import matplotlib.pyplot as plt
import mindspore as ms
import numpy as np
from IPython.display import Image, display
from sklearn.datasets import load_digits

import fshard as fs
from fshard import ops

# %% [markdown]
# ## Data
#
# 1797 images of 64 pixels with values 0–16. We scale them to [0, 1] and hold out
# 297 images for testing.

# %%
digits = load_digits()
rng = np.random.default_rng(0)
order = rng.permutation(len(digits.target))
X = (digits.data[order] / 16.0).astype(np.float32)
Y = digits.target[order].astype(np.int32)
X_train, Y_train = X[:1500], Y[:1500]
X_test, Y_test = X[1500:], Y[1500:]
print("train", X_train.shape, "test", X_test.shape)

# %% [markdown]
# ## The model and the loss of one example
#
# A two-layer MLP, 64 → 64 → 10, with its parameters in a list of `(w, b)` pairs
# (any pytree works). `loss` is written for a **single** example: `x` has shape
# `(64,)` and `y` is one integer label.

# %%
def init_params(rng, sizes=(64, 64, 10)):
    params = []
    for m, n in zip(sizes[:-1], sizes[1:]):
        w = rng.standard_normal((m, n)).astype(np.float32) / np.sqrt(m)
        params.append((ms.Tensor(w), ms.Tensor(np.zeros(n, np.float32))))
    return params


def mlp(params, x):
    for i, (w, b) in enumerate(params):
        x = ops.matmul(x, w) + b
        if i < len(params) - 1:
            x = ops.tanh(x)
    return x


def loss(params, x, y):
    """Softmax cross-entropy of one example."""
    return ops.softmax_cross_entropy(mlp(params, x[None]), y[None])


per_example_grads = fs.jit(fs.vmap(fs.grad(loss), in_axes=(None, 0, 0)))

# %% [markdown]
# Each leaf of the result has a leading batch axis: `grads[0][0]` holds one
# `64 × 64` weight gradient per example. Their mean is the ordinary batch gradient,
# which we check against `fs.grad` of the mean loss.

# %%
params = init_params(np.random.default_rng(1))
xb, yb = ms.Tensor(X_train[:8]), ms.Tensor(Y_train[:8])
grads = per_example_grads(params, xb, yb)
print("per-example weight gradients:", grads[0][0].shape)


def batch_loss(params, x, y):
    return ops.softmax_cross_entropy(mlp(params, x), y)


batch_grads = fs.grad(batch_loss)(params, xb, yb)
for g_each, g_batch in zip(fs.tree.leaves(grads), fs.tree.leaves(batch_grads)):
    np.testing.assert_allclose(g_each.asnumpy().mean(0), g_batch.asnumpy(), atol=1e-6)
print("mean of per-example gradients == batch gradient")

# %% [markdown]
# ## One DP-SGD step
#
# For each example `i`: its gradient's global norm `‖g_i‖` (over all parameters),
# the clipped gradient `g_i · min(1, C / ‖g_i‖)`; then
# `g̃ = (Σ_i clipped g_i + σ·C·z) / B` with `z ~ N(0, I)`, and `params -= lr · g̃`.
# The whole step is one compiled graph: `per_example_grads` is itself an `fs.jit`
# function, and a jitted function called inside another transform is inlined. The
# noise `z` is drawn with NumPy and passed in, so runs are reproducible.

# %%
BATCH, C, SIGMA, LR = 64, 1.0, 0.8, 0.5


def global_norms(grads):
    """The norm of each example's whole gradient: shape (batch,)."""
    squares = [(g * g).reshape(g.shape[0], -1).sum(1) for g in fs.tree.leaves(grads)]
    return ops.sqrt(sum(squares[1:], squares[0]))


@fs.jit
def dp_sgd_step(params, x, y, noise):
    grads = per_example_grads(params, x, y)
    norms = global_norms(grads)
    factor = ops.minimum(1.0, C / (norms + 1e-12))  # clip each example to norm C

    def private(g, z):
        clipped = g * factor.reshape((-1,) + (1,) * (g.ndim - 1))
        return (clipped.sum(0) + SIGMA * C * z) / x.shape[0]

    new = fs.tree.map(lambda p, g, z: p - LR * private(g, z), params, grads, noise)
    return new, norms


@fs.jit
def sgd_step(params, x, y):
    grads = fs.grad(batch_loss)(params, x, y)
    return fs.tree.map(lambda p, g: p - LR * g, params, grads)


eval_loss = fs.jit(batch_loss)
predict = fs.jit(lambda params, x: ops.argmax(mlp(params, x), -1))

# %% [markdown]
# ## Training
#
# 400 steps of batch 64 (about 17 epochs), for DP-SGD and, from the same
# initialisation and batches, for plain SGD. Every 20 steps we record the loss on
# the whole training set.

# %%
def train(private: bool, steps: int = 400, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = init_params(np.random.default_rng(1))
    x_all, y_all = ms.Tensor(X_train), ms.Tensor(Y_train)
    history, clipped = [], []
    for step in range(steps + 1):
        if step % 20 == 0:
            history.append((step, float(eval_loss(params, x_all, y_all).asnumpy())))
        if step == steps:
            break
        idx = rng.choice(len(X_train), BATCH, replace=False)
        x, y = ms.Tensor(X_train[idx]), ms.Tensor(Y_train[idx])
        if private:
            noise = [tuple(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32))
                           for p in wb) for wb in params]
            params, norms = dp_sgd_step(params, x, y, noise)
            clipped.append(float((norms.asnumpy() > C).mean()))
        else:
            params = sgd_step(params, x, y)
    return params, np.array(history), np.array(clipped)


def accuracy(params):
    return float((predict(params, ms.Tensor(X_test)).asnumpy() == Y_test).mean())


dp_params, dp_history, dp_clipped = train(private=True)
sgd_params, sgd_history, _ = train(private=False)
print(f"DP-SGD (C={C}, sigma={SIGMA}): test accuracy {accuracy(dp_params):.3f}, "
      f"{100 * dp_clipped.mean():.0f}% of example gradients clipped")
print(f"SGD:                        test accuracy {accuracy(sgd_params):.3f}")

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(sgd_history[:, 0], sgd_history[:, 1], label="SGD")
ax.plot(dp_history[:, 0], dp_history[:, 1], label=f"DP-SGD (C={C}, σ={SIGMA})")
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.set_yscale("log")
ax.legend()
ax.grid(alpha=0.3)
fig.tight_layout()
png = io.BytesIO()
fig.savefig(png, format="png", dpi=100)
plt.close(fig)
display(Image(png.getvalue()))

# %% [markdown]
# DP-SGD reaches a somewhat higher loss than SGD: the clipping biases each step and
# the noise slows convergence, the price of bounding each example's influence. How
# much privacy this buys (the `(ε, δ)` of the run) follows from `σ`, the sampling
# rate `B / N` and the number of steps with a privacy accountant; that accounting is
# independent of how the gradients are computed and is left out here.
#
# ## What ran
#
# `fs.jit(dp_sgd_step).lower(...)` shows the MindSpore program of one step. The
# per-example weight gradients are batched matrix products; there is no loop.

# %%
lowered = dp_sgd_step.lower(params, xb, yb, [tuple(np.zeros(p.shape, np.float32) for p in wb)
                                             for wb in params])
text = lowered.as_text()
print(sum(1 for line in text.splitlines() if line.startswith("    v")), "operations;",
      text.count("batch_matmul"), "batched matmuls")
