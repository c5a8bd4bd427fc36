"""fshard in two minutes: make_ir, jit, vmap, grad and shard on a virtual 8-device mesh.

Run: python examples/demo.py   (no data to download: the data are generated here)
"""

from __future__ import annotations

import time

import mindspore as ms
import numpy as np
from mindspore import ops

import fshard as fs

rng = np.random.default_rng(0)


def section(title):
    print(f"\n=== {title} " + "=" * max(0, 60 - len(title)))


# A two-layer classifier on generated data: 3 Gaussian blobs in 16 dimensions.
n, d, h, k = 256, 16, 32, 3
centers = rng.normal(0, 3, (k, d)).astype(np.float32)
labels = rng.integers(0, k, n)
x = (centers[labels] + rng.normal(0, 1, (n, d))).astype(np.float32)
y = np.eye(k, dtype=np.float32)[labels]
params = {
    "w1": ms.Tensor(rng.normal(0, 0.3, (d, h)).astype(np.float32)),
    "b1": ms.Tensor(np.zeros(h, np.float32)),
    "w2": ms.Tensor(rng.normal(0, 0.3, (h, k)).astype(np.float32)),
}


def predict(p, x):
    hidden = ops.relu(ops.matmul(x, p["w1"]) + p["b1"])  # plain mindspore.ops
    return ops.matmul(hidden, p["w2"])


def loss(p, x, y):
    logp = ops.log_softmax(predict(p, x), -1)
    return -(logp * y).sum() / x.shape[0]


section("make_ir: the traced program")
print(fs.make_ir(loss)(params, x, y))

section("jit: one MindSpore GRAPH-mode program per signature")
step = fs.jit(fs.value_and_grad(loss))
lr = 0.5
for i in range(60):
    value, grads = step(params, x, y)
    params = {name: params[name] - lr * grads[name] for name in params}
    if i % 20 == 0 or i == 59:
        print(f"step {i:2d}  loss {float(value.asnumpy()):.4f}")
accuracy = (predict(params, ms.Tensor(x)).asnumpy().argmax(-1) == labels).mean()
print(f"training accuracy {accuracy:.3f}; traced {step.trace_count} time(s)")
start = time.perf_counter()
for _ in range(50):
    step(params, x, y)[0].asnumpy()
print(f"cached call: {(time.perf_counter() - start) / 50 * 1e3:.2f} ms per training step")

section("vmap(grad): per-example gradients, vectorised")
per_example = fs.jit(fs.vmap(fs.grad(loss), in_axes=(None, 0, 0)))
g = per_example(params, x[:, None], y[:, None])
print("per-example gradient of w1:", g["w1"].shape)
mean_err = np.abs(g["w1"].asnumpy().mean(0) - fs.grad(loss)(params, x, y)["w1"].asnumpy()).max()
print(f"mean of per-example grads equals the batch gradient (max |diff| {mean_err:.1e})")

section("shard: MindSpore's strategies on a virtual mesh of 8 devices")


def dense_relu(x, weight, bias):
    return ops.relu(ops.bias_add(ops.matmul(x, weight), bias))


xs = ms.Tensor(rng.uniform(0, 1, (32, 128)).astype(np.float32))
weight = ms.Tensor(rng.uniform(0, 1, (128, 10)).astype(np.float32))
bias = ms.Tensor(rng.uniform(0, 1, (10,)).astype(np.float32))
with fs.Mesh((8,), ("d",)):
    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None))
    result = sharded(xs, weight, bias)
print("result.shape:", result.shape)
err = np.abs(result.asnumpy() - dense_relu(xs, weight, bias).asnumpy()).max()
print(f"equal to the unsharded result (max |diff| {err:.1e})")
with fs.Mesh((8,), ("d",)):
    print(fs.make_ir(sharded)(xs, weight, bias))
