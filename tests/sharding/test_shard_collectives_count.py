"""How many collectives ``fs.shard`` inserts: counted in the per-device programs and
compared with the analytic minimum of each computation.

A sharded function's derivative is sharded as a program of its own (the transposed
global program is propagated and partitioned like the forward one), so
``grad(shard(f))`` stages two ``shard_call`` equations: the forward (primal outputs
and residuals) and the backward. Each one's per-device program is counted here.

Notation: ``psum`` is an AllReduce, ``all_gather`` an AllGather, ``psum_scatter`` a
ReduceScatter. ``block_slice`` (a device keeps its block of a value it holds whole)
is not communication and is not counted.
"""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor, ops

import fshard as fs
from fshard.transforms.shard_call import shard_call_p


def _np(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def plans(fun, *args):
    traced = fs.make_ir(fun)(*args)
    return [eq.params["plan"] for eq in traced.program.equations if eq.prim is shard_call_p]


def collectives(plan) -> list[str]:
    return plan.partitioned().collectives()


def reduced_axes(plan) -> list[tuple]:
    """The mesh axes of every psum, in order."""
    return [eq.params["axis_name"] for eq in plan.partitioned().program.equations
            if eq.prim.name == "psum"]


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def tensors(rng, *shapes):
    return [Tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes]


# ---------------------------------------------------------------------------
# Megatron-style MLP: first weight split by columns, second by rows
# ---------------------------------------------------------------------------
#
# y = relu(x @ W1) @ W2 with W1 (1, 8) and W2 (8, 1). Each device computes
# relu(x @ W1[:, cols]) @ W2[cols, :], a partial sum of y: the math needs exactly one
# AllReduce of y (or of anything linear computed from it, such as its sum). The
# backward is the same structure transposed: dx = (dy @ W2^T * mask) @ W1^T, partial
# over the split hidden dimension, so exactly one AllReduce of dx; dW1 and dW2 are
# computed on the devices that hold W1 and W2's blocks and need no communication.

MEGATRON = (None, (1, 8), (8, 1))


def mlp(x, w1, w2):
    return ops.matmul(ops.relu(ops.matmul(x, w1)), w2)


def mlp_sum(x, w1, w2):
    return mlp(x, w1, w2).sum()


def test_megatron_forward_has_one_allreduce(rng):
    args = tensors(rng, (16, 32), (32, 64), (64, 32))
    sharded = fs.shard(mlp, in_strategy=MEGATRON, mesh=8)
    assert sharded.partitioned(*args).collectives() == ["psum"]
    np.testing.assert_allclose(_np(sharded(*args)), _np(mlp(*args)), rtol=1e-4, atol=1e-4)


def test_megatron_sum_reduces_once_on_a_scalar(rng):
    # sum is linear: the pending sum passes through it, the AllReduce is on a scalar.
    args = tensors(rng, (16, 32), (32, 64), (64, 32))
    part = fs.shard(mlp_sum, in_strategy=MEGATRON, mesh=8).partitioned(*args)
    psums = [eq for eq in part.program.equations if eq.prim.name == "psum"]
    assert part.collectives() == ["psum"]
    assert psums[0].outputs[0].aval.shape == ()


@pytest.mark.parametrize("argnums", [0, (0, 1, 2)])
def test_megatron_grad_of_shard_one_allreduce_each_way(rng, argnums):
    args = tensors(rng, (16, 32), (32, 64), (64, 32))
    sharded = fs.shard(mlp_sum, in_strategy=MEGATRON, mesh=8)
    forward, backward = plans(fs.grad(sharded, argnums=argnums), *args)
    assert collectives(forward) == ["psum"]
    assert collectives(backward) == ["psum"]
    got = fs.grad(sharded, argnums=argnums)(*args)
    want = fs.grad(mlp_sum, argnums=argnums)(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        np.testing.assert_allclose(_np(g), _np(w), rtol=1e-4, atol=1e-4)


def test_megatron_shard_of_value_and_grad_two_allreduces(rng):
    args = tensors(rng, (16, 32), (32, 64), (64, 32))
    vg = fs.value_and_grad(mlp_sum, argnums=(0, 1, 2))
    # Keep the weight gradients in their weights' layouts (as an optimizer wants them).
    sharded = fs.shard(vg, in_strategy=MEGATRON,
                       out_strategy=(None, (None, (1, 8), (8, 1))), mesh=8)
    assert sharded.partitioned(*args).collectives() == ["psum", "psum"]
    (value, grads), (want_value, want_grads) = sharded(*args), vg(*args)
    np.testing.assert_allclose(_np(value), _np(want_value), rtol=1e-4)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(_np(g), _np(w), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------
# Data parallelism: batch split over every device, parameters replicated
# ---------------------------------------------------------------------------
#
# Each device computes the loss and gradients of its batch slice; the math needs one
# AllReduce per gradient (the sum over slices) and one for the loss value. Nothing
# else: the forward and backward run on the local slice.


def classifier_loss(params, x, labels):
    h = ops.relu(ops.matmul(x, params["w1"]) + params["b1"])
    logits = ops.matmul(h, params["w2"]) + params["b2"]
    return -(ops.log_softmax(logits, axis=-1) * labels).sum() / x.shape[0]


def test_data_parallel_step_one_allreduce_per_gradient(rng):
    w1, b1, w2, b2, x = tensors(rng, (32, 64), (64,), (64, 10), (10,), (64, 32))
    params = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    labels = Tensor(np.eye(10, dtype=np.float32)[rng.integers(0, 10, 64)])
    step = fs.value_and_grad(classifier_loss)
    sharded = fs.shard(step, in_strategy=(None, (8, 1), (8, 1)), mesh=8)
    part = sharded.partitioned(params, x, labels)
    assert part.collectives() == ["psum"] * (len(params) + 1)
    assert all(axes == ("m0", "m1", "m2") for axes in
               [eq.params["axis_name"] for eq in part.program.equations
                if eq.prim.name == "psum"])
    (loss, grads), (want_loss, want_grads) = sharded(params, x, labels), step(params, x, labels)
    np.testing.assert_allclose(_np(loss), _np(want_loss), rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(_np(grads[k]), _np(want_grads[k]), rtol=1e-4, atol=1e-6)


def test_data_parallel_via_dataset_strategy(rng):
    w1, b1, w2, b2, x = tensors(rng, (32, 64), (64,), (64, 10), (10,), (64, 32))
    params = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    labels = Tensor(np.eye(10, dtype=np.float32)[rng.integers(0, 10, 64)])
    replicated = {k: (1,) * v.ndim for k, v in params.items()}
    sharded = fs.shard(fs.value_and_grad(classifier_loss),
                       in_strategy=(replicated, None, None), mesh=8,
                       out_strategy=(None, None), dataset_strategy="data_parallel")
    assert sharded.partitioned(params, x, labels).collectives() == ["psum"] * 5


# ---------------------------------------------------------------------------
# 2-D: data x model parallel MLP on a (2, 4) mesh
# ---------------------------------------------------------------------------
#
# x (batch split over dp), W1 columns and W2 rows split over mp; loss = mean(y^2).
# Analytic minimum (4 collectives):
#   forward  1. y = h @ W2 is partial over mp and squared next: reduce it over mp
#               (an AllReduce, or a ReduceScatter + AllGather moving the same bytes);
#            2. the loss is a sum over the dp-split batch: one scalar AllReduce;
#   backward 3. dW1 = x^T @ dh and 4. dW2 = h^T @ dy contract over the dp-split
#               batch: one AllReduce over dp each (each device keeps its mp block).
# dx is not needed for training; the backward needs nothing over mp because dy is
# replicated over mp exactly like y (Megatron's f/g operators).


def mse(x, w1, w2):
    return (mlp(x, w1, w2) ** 2).mean()


@pytest.mark.parametrize("search", [False, True])
def test_data_and_model_parallel_mlp_on_a_2x4_mesh(rng, search):
    x, w1, w2 = tensors(rng, (16, 32), (32, 64), (64, 32))
    mesh = fs.Mesh((2, 4), ("dp", "mp"))
    L = fs.Layout((2, 4), ("dp", "mp"))
    step = fs.value_and_grad(mse, argnums=(1, 2))
    sharded = fs.shard(step, in_strategy=(L("dp", "None"), L("None", "mp"), L("mp", "None")),
                       out_strategy=(None, (L("None", "mp"), L("mp", "None"))), mesh=mesh,
                       search=search)
    part = sharded.partitioned(x, w1, w2)
    dp, mp, both = ("m0",), ("m1", "m2"), ("m0", "m1", "m2")
    psums = sorted(eq.params["axis_name"] for eq in part.program.equations
                   if eq.prim.name == "psum")
    # 1: y over mp; 2: the loss over everything; 3 and 4: one AllReduce over dp per
    # weight gradient. On CPU (no ReduceScatter) y's reduction is an AllReduce.
    assert psums == [dp, dp, both, mp]
    others = [(eq.prim.name, eq.params["axis_name"]) for eq in part.program.equations
              if eq.prim.name in ("psum_scatter", "all_gather")]
    if search:  # the analytic minimum
        assert others == []
    else:  # greedy squares y's slice and gathers dy back for the backward
        assert others in ([], [("all_gather", mp)])
    (value, grads), (want_value, want_grads) = sharded(x, w1, w2), step(x, w1, w2)
    np.testing.assert_allclose(_np(value), _np(want_value), rtol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(_np(g), _np(w), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------
# The seed example and MindSpore's propagation worked example
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["CPU", "GPU"])
def test_seed_example_collectives(rng, monkeypatch, target):
    # x (4, 2): the matmul's contraction is split 2 ways (one reduction) and the output
    # must come back whole (one gather): 2 is the minimum. Where the backend has a
    # ReduceScatter (GPU), the reduction is one, because the bias and relu then run on
    # an (8, 1) block; on CPU, which would emulate it with an AllReduce, the plan is
    # the AllReduce itself (and a local slice).
    from fshard.backend import mindspore as backend

    monkeypatch.setattr(backend, "device_target", lambda: target)  # what the plan prices
    x, w, b = tensors(rng, (32, 128), (128, 10), (10,))

    def dense_relu(x, weight, bias):
        return ops.relu(ops.bias_add(ops.matmul(x, weight), bias))

    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8)
    part = sharded.partitioned(x, w, b)
    first = "psum_scatter" if target == "GPU" else "psum"
    assert part.collectives() == [first, "all_gather"]
    np.testing.assert_allclose(_np(sharded(x, w, b)), _np(dense_relu(x, w, b)), rtol=1e-4,
                               atol=1e-4)


def test_mindspore_worked_example_ffn(rng):
    # sharding_propagation.md: only dense1's matmul is configured ((2, 1), (1, 4));
    # propagation gives the bias add and relu (2, 4) and the second matmul
    # ((2, 4), (4, 1)) followed by one AllReduce over the 4 devices of each row group.
    x, w1, b1, w2 = tensors(rng, (16, 32), (32, 64), (64,), (64, 32))
    layout = fs.Layout((2, 4), ("dp", "mp"))

    def ffn(x, w1, b1, w2):
        return ops.matmul(ops.relu(ops.matmul(x, w1) + b1), w2)

    sharded = fs.shard(ffn, in_strategy=(layout("dp", "None"), layout("None", "mp"), None,
                                         None), out_strategy=((2, 1),), mesh=8)
    part = sharded.partitioned(x, w1, b1, w2)
    s = sharded.strategies(x, w1, b1, w2)
    assert [(e["primitive"], e["out_strategy"]) for e in s["equations"]] == [
        ("matmul", [[2, 4]]), ("broadcast_to", [[2, 4]]), ("add", [[2, 4]]),
        ("relu", [[2, 4]]), ("matmul", [[2, 1]])]
    assert part.collectives() == ["psum"]
    assert reduced_axes(sharded._prepare((x, w1, b1, w2))[0]) == [("m1", "m2")]
    np.testing.assert_allclose(_np(sharded(x, w1, b1, w2)), _np(ffn(x, w1, b1, w2)),
                               rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------
# Tuple strategies: split counts, with the mesh axes chosen jointly
# ---------------------------------------------------------------------------


def mlp_bias(x, w1, b, w2):
    return ops.matmul(ops.relu(ops.matmul(x, w1) + b), w2)


def test_tuple_strategies_get_disjoint_axes_and_one_allreduce_over_groups_of_4(rng):
    # MindSpore's documented result for these split counts on 8 devices: the batch
    # split (2) and the hidden split (4) use different devices, one AllReduce over
    # groups of 4, no gather.
    args = tensors(rng, (16, 32), (32, 64), (64,), (64, 32))
    sharded = fs.shard(mlp_bias, in_strategy=((2, 1), (1, 4), None, None),
                       out_strategy=((2, 1),), mesh=8)
    part = sharded.partitioned(*args)
    assert part.collectives() == ["psum"]
    (psum,) = [eq for eq in part.program.equations if eq.prim.name == "psum"]
    assert len(psum.params["axis_name"]) == 2  # two prime axes of size 2: groups of 4
    x_axes, w1_axes = part.in_shardings[0].dims[0], part.in_shardings[1].dims[1]
    assert not set(x_axes) & set(w1_axes)
    np.testing.assert_allclose(_np(sharded(*args)), _np(mlp_bias(*args)), rtol=1e-4, atol=1e-4)
    # a whole output costs one gather more, never a gather of the input x
    whole = fs.shard(mlp_bias, in_strategy=((2, 1), (1, 4), None, None), mesh=8)
    part = whole.partitioned(*args)
    assert len(part.collectives()) == 2
    assert not set(part.in_shardings[0].dims[0]) & set(part.in_shardings[1].dims[1])
    np.testing.assert_allclose(_np(whole(*args)), _np(mlp_bias(*args)), rtol=1e-4, atol=1e-4)


def test_a_layout_pins_the_axes_that_a_tuple_leaves_free(rng):
    args = tensors(rng, (16, 32), (32, 64), (64,), (64, 32))
    mesh = fs.Mesh((2, 2, 2), ("a", "b", "c"))
    pinned = fs.shard(mlp_bias, in_strategy=(mesh.layout("a", "None"),
                                             mesh.layout("None", ("a", "b")), None, None),
                      mesh=mesh)
    part = pinned.partitioned(*args)
    assert set(part.in_shardings[0].dims[0]) <= set(part.in_shardings[1].dims[1])
    np.testing.assert_allclose(_np(pinned(*args)), _np(mlp_bias(*args)), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------
# MindSpore's documented operator strategy followed by an unannotated operator
# ---------------------------------------------------------------------------
#
# MatMul().shard(((4, 1), (1, 2))) leaves its output split (4, 2). MindSpore's
# propagation gives the next, unannotated MatMul the strategy that needs no
# redistribution of that output: ((4, 2), (2, 1)), contracting the split columns (a
# pending sum, reduced by the MatMul's own AllReduce). Gathering the columns and
# slicing the rows instead (an AllGather and a block_slice) is a redistribution
# MindSpore does not make.


def _operator_chain(rng):
    from mindspore import Parameter, nn

    w1, w2 = tensors(rng, (32, 16), (16, 8))

    class Chain(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = Parameter(w1, name="w1"), Parameter(w2, name="w2")
            self.matmul1 = ops.MatMul().shard(((4, 1), (1, 2)))
            self.matmul2 = ops.MatMul()

        def construct(self, x):
            return self.matmul2(self.matmul1(x, self.w1), self.w2)

    return Chain()


def test_documented_matmul_strategy_then_unannotated_matmul_keeps_the_layout(rng):
    net = _operator_chain(rng)
    (x,) = tensors(rng, (64, 32))
    sharded = fs.shard(net, in_strategy=(None,), mesh=8)
    part = sharded.partitioned(x)
    names = [eq.prim.name for eq in part.program.equations]
    first, second = [i for i, n in enumerate(names) if n == "matmul"]
    # nothing moves between the two MatMuls: the second takes the first's output as is
    assert names[first + 1:second] == []
    assert "block_slice" not in names
    second_eq = part.program.equations[second]
    assert second_eq.inputs[0] is part.program.equations[first].outputs[0]
    assert tuple(second_eq.inputs[0].aval.shape) == (64 // 4, 16 // 2)
    # the MatMul's own AllReduce (over the 2 devices splitting the contraction) and the
    # gather of the replicated output: MindSpore's communication, no more
    assert sorted(part.collectives()) == ["all_gather", "psum"]
    np.testing.assert_allclose(_np(sharded(x)), _np(net(x)), rtol=1e-5,
                               atol=1e-5 * np.abs(_np(net(x))).max())


def test_a_pending_sum_is_reduced_before_it_is_gathered(rng):
    # The chain's output is split (4, 1) and a pending sum over the other 2 devices; the
    # caller wants it whole: the AllReduce runs on each device's 16x8 block, then the
    # AllGather (reducing the gathered 64x8 value would send 4x the bytes).
    net = _operator_chain(rng)
    (x,) = tensors(rng, (64, 32))
    sharded = fs.shard(net, in_strategy=(None,), mesh=8)
    eqs = [eq for eq in sharded.partitioned(x).program.equations
           if eq.prim.name in ("psum", "all_gather")]
    assert [eq.prim.name for eq in eqs] == ["psum", "all_gather"]
    assert tuple(eqs[0].inputs[0].aval.shape) == (64 // 4, 8)
    np.testing.assert_allclose(_np(sharded(x)), _np(net(x)), rtol=1e-5,
                               atol=1e-5 * np.abs(_np(net(x))).max())


# ---------------------------------------------------------------------------
# A sum of a value every device holds whole stays whole
# ---------------------------------------------------------------------------
#
# Splitting the sum of a replicated value is a free local slice, but it leaves a pending
# sum: an AllReduce more, to save a few flops (the loss of a Megatron block, an RMSNorm
# weight's gradient). Such a sum runs whole on every device.


def _rms_mlp_loss(p, x, y):
    h = x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * p["g"]
    out = ops.matmul(ops.relu(ops.matmul(h, p["w1"])), p["w2"])
    return ((out - y) ** 2).mean()


def test_the_sum_of_a_replicated_value_needs_no_allreduce(rng):
    (x,) = tensors(rng, (16, 32))
    sharded = fs.shard(lambda x: (x * x).sum(), in_strategy=(None,), mesh=4)
    assert sharded.partitioned(x).collectives() == []
    np.testing.assert_allclose(_np(sharded(x)), float((_np(x) ** 2).sum()), rtol=1e-5)


def test_megatron_norm_weight_and_loss_are_computed_whole(rng):
    # value_and_grad of RMSNorm + Megatron MLP: the forward's AllReduce and one in the
    # backward (of the input gradient, or of the norm weight's gradient computed from
    # its pending sum); the loss is a sum of a replicated value, reduced by nobody
    x, y, w1, w2 = tensors(rng, (16, 32), (16, 32), (32, 64), (64, 32))
    params = {"g": Tensor(np.ones(32, np.float32)), "w1": w1, "w2": w2}
    vg = fs.value_and_grad(_rms_mlp_loss)
    strategy = {"g": None, "w1": (1, 4), "w2": (4, 1)}
    sharded = fs.shard(vg, in_strategy=(strategy, None, None), out_strategy=(None, strategy),
                       mesh=4)
    part = sharded.partitioned(params, x, y)
    assert part.collectives() == ["psum", "psum"]
    shapes = [eq.inputs[0].aval.shape for eq in part.program.equations
              if eq.prim.name == "psum"]
    assert shapes[0] == (16, 32) and shapes[1] in ((16, 32), (32,)), shapes
    (value, grads), (want_value, want_grads) = sharded(params, x, y), vg(params, x, y)
    np.testing.assert_allclose(_np(value), _np(want_value), rtol=1e-5)
    for k in params:
        want = _np(want_grads[k])
        np.testing.assert_allclose(_np(grads[k]), want, rtol=1e-4,
                                   atol=1e-5 * np.abs(want).max())
