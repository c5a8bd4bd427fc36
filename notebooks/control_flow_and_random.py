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
# # Loops, branches and random numbers inside transformed code
#
# Three small programs that need what plain tracing cannot give: random numbers that
# follow the program through `vmap` and `jit`, a loop whose gradient we want, and a
# training loop compiled as one program.
#
# - **Monte-Carlo**: estimate π with `fs.vmap` over random keys.
# - **An RNN with `fs.scan`**, and its gradient through time.
# - **A dropout MLP trained with `fs.scan`**: several optimizer steps, a fresh dropout
#   key per step, in one compiled program.

# %%
import os

os.environ.setdefault("GLOG_v", "3")

import matplotlib.pyplot as plt
import numpy as np
from sklearn.datasets import load_digits

import fshard as fs

# %% [markdown]
# ## 1. Monte-Carlo with keys
#
# A key is a value: `fs.random.split` makes new ones, and a draw depends only on its
# key and shape. `fs.vmap` over 64 keys gives 64 independent estimates — each lane
# draws its own points — and the result is the same as the Python loop over the keys.

# %%
def estimate_pi(key, n=4096):
    kx, ky = fs.random.split(key)
    x, y = fs.random.uniform(kx, (n,)), fs.random.uniform(ky, (n,))
    inside = fs.ops.cast(x * x + y * y < 1.0, fs.dtypes.float32)
    return 4.0 * inside.mean()


keys = fs.random.split(fs.random.key(0), 64)
estimates = fs.jit(fs.vmap(estimate_pi))(keys).asnumpy()
looped = np.array([estimate_pi(keys[i]).asnumpy() for i in range(4)])
assert np.array_equal(estimates[:4], looped)  # vmap = the loop, lane by lane
print(f"pi ~ {estimates.mean():.4f} +- {estimates.std() / np.sqrt(len(estimates)):.4f}")
assert abs(estimates.mean() - np.pi) < 5 * estimates.std() / np.sqrt(len(estimates))

# %% [markdown]
# ## 2. An RNN with `fs.scan`, and its gradient through time
#
# `fs.scan(cell, h0, xs)` runs `h, y = cell(h, x)` over the time axis of `xs`. The loop
# is unrolled when traced, so `fs.grad` differentiates through every step (backprop
# through time). We check the gradient against central differences.

# %%
rng = np.random.default_rng(0)
W, U = rng.standard_normal((8, 8)) * 0.4, rng.standard_normal((8, 3))
xs = rng.standard_normal((12, 3))


def rnn_loss(W, U, xs):
    def cell(h, x):
        h = fs.ops.tanh(fs.ops.matmul(W, h) + fs.ops.matmul(U, x))
        return h, h

    _, hs = fs.scan(cell, np.zeros(8), xs)
    return (hs[-1] ** 2).sum()


g = fs.jit(fs.grad(rnn_loss))(W, U, xs).asnumpy()
eps, i, j = 1e-6, 2, 5
E = np.zeros_like(W)
E[i, j] = eps
numeric = (rnn_loss(W + E, U, xs).asnumpy() - rnn_loss(W - E, U, xs).asnumpy()) / (2 * eps)
print(f"dL/dW[{i},{j}]: fs.grad {g[i, j]:.8f}, central difference {numeric:.8f}")
assert abs(g[i, j] - numeric) < 1e-6 * max(1.0, abs(numeric))

# %% [markdown]
# ## 3. A dropout MLP trained with `fs.scan`
#
# One training step: split the key, compute the loss with dropout and its gradient,
# apply Adam. `fs.scan` over a chunk of batches runs several steps as **one**
# compiled program; the Python loop only walks over chunks. The losses are the same,
# bit for bit, as the step jitted on its own and called once per batch.

# %%
X, Y = load_digits(return_X_y=True)
X, Y = (X / 16).astype(np.float32), Y.astype(np.int32)
steps_per_call, batch = 4, 64
opt = fs.optim.adam(1e-2)


def loss(p, key, x, y):
    h = fs.ops.relu(fs.ops.matmul(x, p["w1"]) + p["b1"])
    h = fs.nn.dropout(key, h, rate=0.2)
    return fs.ops.softmax_cross_entropy(fs.ops.matmul(h, p["w2"]) + p["b2"], y)


def step(carry, b):
    params, opt_state, key = carry
    key, sub = fs.random.split(key)
    value, grads = fs.value_and_grad(loss)(params, sub, *b)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (fs.optim.apply_updates(params, updates), opt_state, key), value


train_chunk = fs.jit(lambda carry, xs, ys: fs.scan(step, carry, (xs, ys)))

params = {"w1": (rng.standard_normal((64, 64)) * 0.1).astype(np.float32),
          "b1": np.zeros(64, np.float32),
          "w2": (rng.standard_normal((64, 10)) * 0.1).astype(np.float32),
          "b2": np.zeros(10, np.float32)}
carry = (params, opt.init(params), fs.random.key(1))
losses = []
for epoch in range(3):
    order = np.random.default_rng(epoch).permutation(len(X))
    for c in range(len(X) // (steps_per_call * batch)):
        idx = order[c * steps_per_call * batch:(c + 1) * steps_per_call * batch]
        xs_c = X[idx].reshape(steps_per_call, batch, 64)
        ys_c = Y[idx].reshape(steps_per_call, batch)
        carry, chunk_losses = train_chunk(carry, xs_c, ys_c)
        losses.extend(chunk_losses.asnumpy().tolist())
print(f"{len(losses)} steps in {train_chunk.trace_count} compiled program; "
      f"loss {losses[0]:.3f} -> {np.mean(losses[-4:]):.3f}")
assert train_chunk.trace_count == 1 and np.mean(losses[-4:]) < 0.5 * losses[0]

logits = fs.ops.matmul(fs.ops.relu(fs.ops.matmul(X, carry[0]["w1"]) + carry[0]["b1"]),
                       carry[0]["w2"]) + carry[0]["b2"]
accuracy = (logits.asnumpy().argmax(1) == Y).mean()
print(f"training accuracy without dropout: {accuracy:.3f}")

# %%
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(losses)
ax.set_xlabel("step")
ax.set_ylabel("loss (with dropout)")
ax.set_title("dropout MLP on digits, 4 steps per fs.scan call")
fig.tight_layout()
plt.show()
