"""MindSpore's functional shard examples (seeds/000), written with fshard, on 8 devices.

Run: python examples/shard_examples.py   (a virtual 8-device mesh in this process)

1. a function: dense + bias + ReLU with x split (4, 2), weight and bias derived;
2. a Cell with a parameter plan, sharded inside another Cell;
3. shard outside vmap (and the refused inside-out form);
4. a training step: shard(value_and_grad(loss)), jitted, data parallel.
Each sharded result is checked against the unsharded one.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

import fshard as fs


def check(name, got, want, tol=1e-4):
    err = float(np.max(np.abs(got.asnumpy() - want.asnumpy())))
    assert err < tol, f"{name}: sharded differs from unsharded by {err}"
    print(f"{name}: shape {tuple(got.shape)}, max |sharded - unsharded| = {err:.1e}")


# ---------------------------------------------------------------------------
# 1. seeds/000: functional shard of a function
# ---------------------------------------------------------------------------


def dense_relu(x, weight, bias):
    x = ops.matmul(x, weight)
    x = ops.bias_add(x, bias)
    return ops.relu(x)


x = Tensor(np.random.uniform(0, 1, (32, 128)), ms.float32)
weight = Tensor(np.random.uniform(0, 1, (128, 10)), ms.float32)
bias = Tensor(np.random.uniform(0, 1, (10,)), ms.float32)

with fs.Mesh((8,), ("d",)):          # or FSHARD_DEVICES=8, or 8 processes under the launcher
    # x split (4, 2); weight and bias derived by propagation
    result = fs.shard(dense_relu, in_strategy=((4, 2), None, None))(x, weight, bias)
print("result.shape:", result.shape)  # (32, 10), equal to dense_relu(x, weight, bias)
check("1. dense_relu", result, dense_relu(x, weight, bias))
print(fs.make_ir(fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8))(
    x, weight, bias))


# ---------------------------------------------------------------------------
# 2. seeds/000: shard of a Cell, with a parameter plan
# ---------------------------------------------------------------------------


class BasicBlock(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1 = nn.Dense(32, 32)
        self.gelu = nn.GELU()
        self.dense2 = nn.Dense(32, 32)

    def construct(self, x):
        return self.dense2(self.gelu(self.dense1(x)))


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.block1 = BasicBlock()
        self.block2 = BasicBlock()
        self.block3 = BasicBlock()
        # MindSpore's Cell.shard becomes fs.shard of the Cell; give the result another name
        self.block1_sharded = fs.shard(self.block1, in_strategy=((8, 1),),
                                       parameter_plan={"self.block1.dense2.weight": (8, 1)},
                                       mesh=8)

    def construct(self, x):
        x = self.block1_sharded(x)   # sharded
        x = self.block2(x)           # plain MindSpore
        return self.block3(x)


net = Net()
h = Tensor(np.random.uniform(-1, 1, (16, 32)), ms.float32)
check("2. Net with a sharded block", net(h), net.block3(net.block2(net.block1(h))))
strategies = net.block1_sharded.strategies(h)
print("   block1 inputs (parameters, then x):", [i["strategy"] for i in strategies["inputs"]])


# ---------------------------------------------------------------------------
# 3. seeds/000: shard outside vmap
# ---------------------------------------------------------------------------

xs = Tensor(np.random.uniform(0, 1, (8, 4, 128)), ms.float32)    # (batch, n, 128)
per_example = fs.vmap(dense_relu, in_axes=(0, None, None))
out = fs.shard(per_example, in_strategy=((8, 1, 1), None, None), mesh=8)(xs, weight, bias)
check("3. shard(vmap(dense_relu))", out, per_example(xs, weight, bias))
try:
    fs.vmap(fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8),
            in_axes=(0, None, None))(xs, weight, bias)
except fs.CompositionError as e:
    print("   vmap(shard(...)) is refused:", str(e).splitlines()[0])


# ---------------------------------------------------------------------------
# 4. a data-parallel training step: one AllReduce per gradient
# ---------------------------------------------------------------------------


def loss(params, x, labels):
    h = ops.relu(ops.matmul(x, params["w1"]) + params["b1"])
    logits = ops.matmul(h, params["w2"]) + params["b2"]
    return -(ops.log_softmax(logits, axis=-1) * labels).sum() / x.shape[0]


rng = np.random.default_rng(0)
params = {"w1": Tensor(rng.normal(0, 0.2, (128, 64)).astype(np.float32)),
          "b1": Tensor(np.zeros(64, np.float32)),
          "w2": Tensor(rng.normal(0, 0.2, (64, 10)).astype(np.float32)),
          "b2": Tensor(np.zeros(10, np.float32))}
data = Tensor(rng.normal(0, 1, (64, 128)).astype(np.float32))
labels = Tensor(np.eye(10, dtype=np.float32)[rng.integers(0, 10, 64)])

step = fs.shard(fs.value_and_grad(loss), in_strategy=(None, (8, 1), (8, 1)), mesh=8)
print("4. data-parallel step collectives:",
      step.partitioned(params, data, labels).collectives())
jitted = fs.jit(step)
value, grads = jitted(params, data, labels)
want_value, want_grads = fs.value_and_grad(loss)(params, data, labels)
check("   loss", value, want_value)
for k in params:
    check(f"   grad[{k!r}]", grads[k], want_grads[k])
