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
# # A tour of `fs.shard`
#
# MindSpore's functional `shard` splits a function over devices from a few
# *strategies*: `in_strategy=((4, 2), None, None)` says "split the first argument's
# rows 4 ways and its columns 2 ways; derive the rest". fshard implements the same
# contract on any backend, in one process: a *virtual mesh* of 8 devices runs here,
# on the CPU.
#
# This tour covers
#
# 1. strategies (tuples and `fs.Layout` views) and what each device holds;
# 2. **propagation**: how the layouts nobody wrote down are chosen (MindSpore's worked
#    example);
# 3. the **per-device program**, with each value's layout and the collectives;
# 4. **how many collectives** the partitioner inserts, against the analytic minimum;
# 5. composition with `grad`, `value_and_grad` and `jit`.

# %%
import numpy as np
from mindspore import Tensor, ops

import fshard as fs

rng = np.random.default_rng(0)


def tensor(*shape, low=None):
    if low is None:
        return Tensor(rng.standard_normal(shape).astype(np.float32))
    return Tensor(rng.uniform(low, 1, shape).astype(np.float32))


mesh = fs.Mesh((8,), ("d",))  # 8 virtual devices

# %% [markdown]
# ## 1. Strategies
#
# The seed example: a dense layer with ReLU, `x` split `(4, 2)` on 8 devices, the
# weight and bias left to propagation (`None`).

# %%
def dense_relu(x, weight, bias):
    x = ops.matmul(x, weight)
    x = ops.bias_add(x, bias)
    return ops.relu(x)


x = tensor(32, 128, low=0)
weight = tensor(128, 10, low=0)
bias = tensor(10, low=0)

with mesh:
    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None))
    result = sharded(x, weight, bias)
print("result.shape:", result.shape)
print("max |sharded - unsharded| =",
      float(np.abs(result.asnumpy() - dense_relu(x, weight, bias).asnumpy()).max()))

# %% [markdown]
# `(4, 2)` splits dim 0 in 4 and dim 1 in 2: each device holds an `8 x 64` block. The
# picture lists, for every block, the ranks that hold it (ranks are row-major over
# the device matrix, as in MindSpore):

# %%
fs.visualize_sharding((32, 128), (4, 2), mesh=mesh)

# %% [markdown]
# A product of split counts smaller than the device count leaves *replicas*. MindSpore
# puts the repeated factor on the right, so replicas are neighbours: with `(2, 2)`,
# ranks 0 and 1 hold the same block.

# %%
fs.visualize_sharding((32, 128), (2, 2), mesh=mesh)

# %% [markdown]
# A `fs.Layout` says exactly which device axis splits which dimension. On a
# `(2, 4)` device matrix `("dp", "mp")`, `layout("mp", "dp")` splits rows over `mp`
# and columns over `dp`:

# %%
layout = fs.Layout((2, 4), ("dp", "mp"))
fs.visualize_sharding((32, 128), layout("mp", "dp"))

# %% [markdown]
# ## 2. Propagation
#
# Every value nobody annotated gets a layout from **sharding propagation**, as in
# MindSpore: breadth-first from the annotated values, each equation takes the
# candidate strategy that needs no communication with its already-decided neighbours,
# then the cheapest under the cost model of `level` (0: compute/communication
# balance, 1: memory, 2: time).
#
# MindSpore's documented worked example: a feed-forward block where only the first
# matmul is configured, `((2, 1), (1, 4))`. MindSpore's IR shows the bias add and
# ReLU at `(2, 4)`, the second matmul at `((2, 4), (4, 1))` and one AllReduce over
# each row of 4 devices. fshard finds the same:

# %%
def ffn(x, w1, b1, w2):
    return ops.matmul(ops.relu(ops.matmul(x, w1) + b1), w2)


x1, w1, b1, w2 = tensor(16, 32), tensor(32, 64), tensor(64), tensor(64, 32)
ffn_sharded = fs.shard(ffn, in_strategy=(layout("dp", "None"), layout("None", "mp"), None,
                                         None), out_strategy=((2, 1),), mesh=mesh)
strategies = ffn_sharded.strategies(x1, w1, b1, w2)
for eq in strategies["equations"]:
    partial = f"   (partial sum over {eq['partial_sum'][0]})" if eq["partial_sum"] else ""
    print(f"{eq['primitive']:<13} in {eq['in_strategy']} -> out {eq['out_strategy']}{partial}")

# %% [markdown]
# `strategies(*args)` is the content of a strategy file (JSON-ready); save it with
# `save_strategies(path, *args)` and reuse it with `load_strategies(path)`. The derived
# layouts can be drawn too: here the second weight, whose rows follow the hidden
# dimension split over `mp`.

# %%
part = ffn_sharded.partitioned(x1, w1, b1, w2)
fs.visualize_sharding((64, 32), part.input_layouts()[3])

# %% [markdown]
# ## 3. The per-device program
#
# `fs.make_ir(sharded)(*args)` prints what each device runs: local block shapes, each
# value's strategy in MindSpore's notation (and "partial-sum" for a value that still
# has to be summed over devices), and the collectives the partitioner inserted.

# %%
print(fs.make_ir(sharded)(x, weight, bias))

# %% [markdown]
# The contraction dimension of the matmul is split 2 ways, so its output is a partial
# sum. The bias add is not linear in it, so the partial sum is reduced there. On a
# backend with a ReduceScatter (`psum_scatter`) that is what the plan uses; on CPU,
# which would emulate it with an AllReduce, the plan is an AllReduce (`psum`) and a
# local slice (`block_slice`). Either way the bias and ReLU then run on an `(8, 1)`
# block, and one AllGather gives the replicated output that `full_batch` asks for.

# %% [markdown]
# ## 4. Counting collectives
#
# The partitioner keeps pending sums alive through linear operations (`add`, `sum`,
# `reshape`, `transpose`, a matmul with a replicated operand, ...) and reduces them
# once, as late as possible, on the smallest value. Each value also remembers every
# layout it has been moved to, so a second consumer never pays again.
#
# **Megatron MLP**: the first weight split by columns, the second by rows. The math
# needs one AllReduce in the forward pass and one in the backward pass (for the
# gradient of the input). `fs.grad(fs.shard(f))` shards the backward as a program of
# its own, so its collectives are counted the same way.

# %%
from fshard.transforms.shard_call import shard_call_p


def mlp_sum(x, w1, w2):
    return ops.matmul(ops.relu(ops.matmul(x, w1)), w2).sum()


def sharded_programs(fun, *args):
    """The per-device programs of every sharded computation ``fun`` runs."""
    program = fs.make_ir(fun)(*args).program
    return [eq.params["plan"].partitioned() for eq in program.equations
            if eq.prim is shard_call_p]


xm, wm1, wm2 = tensor(16, 32), tensor(32, 64), tensor(64, 32)
megatron = fs.shard(mlp_sum, in_strategy=(None, (1, 8), (8, 1)), mesh=mesh)
forward, backward = sharded_programs(fs.grad(megatron), xm, wm1, wm2)
print("forward :", forward.collectives())
print("backward:", backward.collectives())
print(backward)

# %% [markdown]
# **Data parallelism**: batch split 8 ways, parameters replicated. Each gradient is a
# sum over the batch slices: one AllReduce per gradient, plus one for the loss.

# %%
def classifier_loss(params, x, labels):
    h = ops.relu(ops.matmul(x, params["w1"]) + params["b1"])
    logits = ops.matmul(h, params["w2"]) + params["b2"]
    return -(ops.log_softmax(logits, axis=-1) * labels).sum() / x.shape[0]


params = {"w1": tensor(32, 64), "b1": tensor(64), "w2": tensor(64, 10), "b2": tensor(10)}
xd = tensor(64, 32)
labels = Tensor(np.eye(10, dtype=np.float32)[rng.integers(0, 10, 64)])
dp_step = fs.shard(fs.value_and_grad(classifier_loss), in_strategy=(None, (8, 1), (8, 1)),
                   mesh=mesh)
print(dp_step.partitioned(params, xd, labels).collectives())

# %% [markdown]
# **2-D**: data parallel over `dp` and Megatron over `mp` on a `(2, 4)` mesh. The
# analytic minimum is 4: y's reduction over `mp`, the loss over all devices, and one
# AllReduce over `dp` per weight gradient. Propagation reduces y as a ReduceScatter
# followed by an AllGather (the same bytes as one AllReduce; the squares then run on a
# quarter of y each).

# %%
def mse(x, w1, w2):
    return (ops.matmul(ops.relu(ops.matmul(x, w1)), w2) ** 2).mean()


step_2d = fs.shard(fs.value_and_grad(mse, argnums=(1, 2)),
                   in_strategy=(layout("dp", "None"), layout("None", "mp"),
                                layout("mp", "None")),
                   out_strategy=(None, (layout("None", "mp"), layout("mp", "None"))),
                   mesh=mesh)
program_2d = step_2d.partitioned(xm, wm1, wm2).program
print([(eq.prim.name, eq.params["axis_name"]) for eq in program_2d.equations
       if eq.prim.name in ("psum", "psum_scatter", "all_gather")])

# %% [markdown]
# | computation | collectives measured | analytic minimum |
# |---|---|---|
# | Megatron MLP, forward | 1 AllReduce | 1 |
# | Megatron MLP, backward (grad of the input) | 1 AllReduce | 1 |
# | data-parallel step, 4 parameters | 5 AllReduce (4 gradients + loss) | 5 |
# | 2-D MLP step | 3 AllReduce + ReduceScatter/AllGather pair | 4 (same bytes) |

# %%
import matplotlib.pyplot as plt

names = ["Megatron fwd", "Megatron bwd", "data parallel", "2-D step"]
measured = [len(forward.collectives()), len(backward.collectives()),
            len(dp_step.partitioned(params, xd, labels).collectives()),
            sum(eq.prim.name in ("psum", "psum_scatter", "all_gather")
                for eq in program_2d.equations)]
minimum = [1, 1, 5, 4]
fig, ax = plt.subplots(figsize=(6, 3))
at = np.arange(len(names))
ax.bar(at - 0.2, measured, 0.4, label="inserted by fs.shard")
ax.bar(at + 0.2, minimum, 0.4, label="analytic minimum")
ax.set_xticks(at, names)
ax.set_ylabel("collectives")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Composition
#
# `shard` sits outside `vmap`, and composes with the `grad` family and `jit` in any
# order; every form gives the unsharded numbers. Under `fs.jit` the whole sharded
# step (forward and backward, both partitioned) becomes one MindSpore GRAPH-mode
# program.

# %%
vg = fs.value_and_grad(mlp_sum, argnums=(0, 1, 2))
_, want = vg(xm, wm1, wm2)
variants = {
    "grad(shard(f))": fs.grad(megatron, argnums=(0, 1, 2)),
    "shard(value_and_grad(f))": lambda *a: fs.shard(vg, in_strategy=(None, (1, 8), (8, 1)),
                                                     mesh=mesh)(*a)[1],
    "jit(grad(shard(f)))": fs.jit(fs.grad(megatron, argnums=(0, 1, 2))),
}
for name, fn in variants.items():
    grads = fn(xm, wm1, wm2)
    err = max(float(np.abs(g.asnumpy() - w.asnumpy()).max()) for g, w in zip(grads, want))
    print(f"{name:<26} max |grad - unsharded grad| = {err:.2e}")

# %% [markdown]
# The two forms that fshard refuses raise a `CompositionError` that shows the allowed
# form:

# %%
try:
    fs.vmap(fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=mesh),
            in_axes=(0, None, None))(Tensor(np.ones((2, 32, 128), np.float32)), weight, bias)
except fs.CompositionError as e:
    print(e)

# %% [markdown]
# Bad strategies are `ShardingError`s that name the argument, the rule and the fix;
# fshard never falls back to replication silently:

# %%
try:
    fs.shard(dense_relu, in_strategy=((3, 2), None, None), mesh=mesh)(x, weight, bias)
except fs.ShardingError as e:
    print(e)
