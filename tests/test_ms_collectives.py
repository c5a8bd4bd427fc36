"""MindSpore's collective op classes (ops.AllReduce, AllGather, ReduceScatter, Broadcast,
AlltoAll) traced by fs.shard_map on a virtual mesh, against NumPy; their groups
(world, a mesh axis name, fs.distributed.create_group rank lists) and ReduceOp variants;
the errors for what fshard cannot trace (NeighborExchange(V2) under shard_map and in
one process; their argument checks). The same code in a launched job:
tests/distributed/test_ms_collectives_multiprocess.py and, for the neighbour exchanges,
tests/distributed/test_neighbor_exchange_multiprocess.py."""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor, nn, ops
from mindspore.ops import ReduceOp

import fshard as fs

RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 4)).astype(np.float32)  # 4 devices x 2 rows
MESH = fs.Mesh((4,), ("dp",))
MESH2 = fs.Mesh((2, 2), ("a", "b"))


def _run(fn, x=X, in_s=((4, 1),), out_s=(4, 1), mesh=MESH):
    f = fs.shard_map(fn, in_strategy=in_s, out_strategy=out_s, mesh=mesh)
    return f(Tensor(x)).asnumpy()


def _blocks(x=X, n=4):
    return np.split(x, n)


def _tol(v):
    return 1e-6 * max(1.0, float(np.abs(v).max()))


@pytest.mark.parametrize("op,np_op", [(ReduceOp.SUM, np.sum), (ReduceOp.MAX, np.max),
                                      (ReduceOp.MIN, np.min), (ReduceOp.PROD, np.prod)])
def test_all_reduce_ops(op, np_op):
    got = _run(ops.AllReduce(op))
    want = np.tile(np_op(np.stack(_blocks()), axis=0), (4, 1))
    np.testing.assert_allclose(got, want, atol=_tol(want))


def test_all_gather_concatenates_dim0_in_rank_order():
    got = _run(ops.AllGather(), out_s=(4, 1))
    np.testing.assert_allclose(got, np.tile(X, (4, 1)))


@pytest.mark.parametrize("op,np_op", [(ReduceOp.SUM, np.sum), (ReduceOp.MAX, np.max)])
def test_reduce_scatter(op, np_op):
    # every device holds all of X (replicated in) times (rank + 1): the reduction over
    # devices, device i keeping block i of dim 0
    def f(v):
        return ops.ReduceScatter(op)(v * (fs.axis_index("dp") + 1).astype(v.dtype))
    got = _run(f, in_s=(None,))
    want = np_op(np.stack([X * (i + 1) for i in range(4)]), axis=0)
    np.testing.assert_allclose(got, want, atol=_tol(want))


def test_broadcast_takes_a_tuple_and_sends_the_roots_value():
    got = _run(lambda v: ops.Broadcast(2)((v, v * 2))[1])
    np.testing.assert_allclose(got, np.tile(_blocks()[2] * 2, (4, 1)))


def test_all_to_all():
    x = RNG.normal(size=(4, 8)).astype(np.float32)  # device i: column block i, (4, 2)
    got = _run(ops.AlltoAll(4, 0, 1), x=x, in_s=((1, 4),), out_s=(4, 1))
    # device i sends row j of its block to device j, which concatenates along dim 1:
    # device j gets row j of X, whole
    np.testing.assert_allclose(got, x)


def test_groups_on_a_2d_mesh():
    x = RNG.normal(size=(4, 3)).astype(np.float32)  # one row per device of (a, b)
    fs.distributed.create_group("seedapi_b", [0, 1])  # the devices along "b"
    fs.distributed.create_group("seedapi_a", [0, 2])  # along "a"
    rows = x.reshape(2, 2, 3)
    for group, want in (("seedapi_b", rows.sum(1, keepdims=True).repeat(2, 1)),
                        ("seedapi_a", rows.sum(0, keepdims=True).repeat(2, 0)),
                        ("b", rows.sum(1, keepdims=True).repeat(2, 1)),
                        ("hccl_world_group", np.broadcast_to(rows.sum((0, 1)), rows.shape))):
        got = _run(ops.AllReduce(group=group), x=x, in_s=((4, 1),), out_s=(4, 1), mesh=MESH2)
        np.testing.assert_allclose(got, want.reshape(4, 3), atol=_tol(want), err_msg=group)
    # a sub-group's Broadcast root is a world rank: its place in its own group
    got = _run(ops.Broadcast(3, group="seedapi_a"), x=x, mesh=MESH2)
    np.testing.assert_allclose(got, rows[1][None].repeat(2, 0).reshape(4, 3))


class _ReduceLoss(nn.Cell):
    """Seed 002's loss: each device's loss, AllReduce'd and divided by the device count."""

    def __init__(self):
        super().__init__()
        self.loss = nn.CrossEntropyLoss()
        self.all_reduce = ops.AllReduce()

    def construct(self, data, label):
        return self.all_reduce(self.loss(data, label)) / 4


def test_seed_002_reduce_loss_gives_the_full_batch_loss_and_gradients():
    w = RNG.normal(size=(4, 3)).astype(np.float32)
    labels = RNG.integers(0, 3, 8).astype(np.int32)
    loss_cell = _ReduceLoss()

    def local(w, x, y):
        return loss_cell(ops.matmul(x, w), y)

    step = fs.jit(fs.shard_map(fs.value_and_grad(local), in_strategy=(None, (4, 1), (4,)),
                               out_strategy=((), None), mesh=MESH))
    value, grad = step(Tensor(w), Tensor(X), Tensor(labels))
    full = lambda w, x, y: nn.CrossEntropyLoss()(ops.matmul(x, w), y)  # noqa: E731
    want_v, want_g = fs.value_and_grad(full)(Tensor(w), Tensor(X), Tensor(labels))
    np.testing.assert_allclose(value.asnumpy(), want_v.asnumpy(), rtol=1e-5)
    np.testing.assert_allclose(grad.asnumpy(), want_g.asnumpy(), atol=1e-6)


def test_errors_name_the_op_and_the_fix():
    with pytest.raises(fs.errors.AxisNameError, match=r"(?s)AllReduce.*outside any "
                       r"fs\.shard_map.*Fix: call it inside fs\.shard_map"):
        fs.jit(lambda v: ops.AllReduce()(v))(Tensor(X))
    with pytest.raises(fs.errors.AxisNameError, match=r"(?s)'nope'.*knows no group.*create_group"):
        _run(ops.AllReduce(group="nope"))
    fs.distributed.create_group("seedapi_diag", [0, 3])
    with pytest.raises(fs.errors.AxisNameError, match=r"(?s)\[0, 3\] are not the devices.*"
                       r"\[0, 1\] \(axis 'b'\)"):
        _run(ops.AllReduce(group="seedapi_diag"), x=X[:4], mesh=MESH2)
    with pytest.raises(fs.errors.ArgumentError, match=r"(?s)split_count=2.*Fix: split_count=4"):
        _run(ops.AlltoAll(2, 0, 0))
    with pytest.raises(fs.errors.ArgumentError, match=r"(?s)root_rank=7.*\[0, 4\)"):
        _run(lambda v: ops.Broadcast(7)((v,))[0])
    with pytest.raises(fs.errors.DistributedError, match=r"already names ranks \[0, 1\]"):
        fs.distributed.create_group("seedapi_b2", [0, 1])
        fs.distributed.create_group("seedapi_b2", [2, 3])


_NCHW = np.zeros((4, 1, 4, 4), np.float32)


def _halo(send_ids=(-1,) * 8, send_lens=(0,) * 4, recv_ids=(-1,) * 8, recv_lens=(0,) * 4,
          data_format="NCHW"):
    return ops.NeighborExchangeV2(send_rank_ids=list(send_ids), send_lens=list(send_lens),
                                  recv_rank_ids=list(recv_ids), recv_lens=list(recv_lens),
                                  data_format=data_format)


def test_neighbor_exchange_is_refused_where_one_trace_serves_every_device():
    # NeighborExchangeV2 runs in a job's fs.jit (tests/distributed/
    # test_neighbor_exchange_multiprocess.py); under shard_map and in one process the
    # refusal says where it works and what to write instead
    with pytest.raises(fs.errors.UnsupportedOpError, match=r"(?s)NeighborExchangeV2.*inside "
                       r"fs\.shard_map.*Fix:.*fs\.ppermute.*works in a multi-process job"):
        _run(_halo(), x=_NCHW, in_s=((4, 1, 1, 1),), out_s=(4, 1, 1, 1))
    with pytest.raises(fs.errors.UnsupportedOpError, match=r"(?s)in one process.*Fix:.*"
                       r"fs\.ppermute.*fshard\.launch -n N"):
        fs.jit(_halo())(Tensor(_NCHW))
    with pytest.raises(fs.errors.UnsupportedOpError, match=r"(?s)NeighborExchange \(.*in one "
                       r"process.*Fix:.*fs\.ppermute.*ops\.NeighborExchange itself works"):
        fs.jit(lambda v: ops.NeighborExchange([0], [0], ([4, 1, 4, 4],), ([4, 1, 4, 4],),
                                              v.dtype)((v,)))(Tensor(_NCHW))


@pytest.mark.parametrize("kwargs,error,pattern", [
    ({"send_ids": (-1,) * 7}, fs.errors.ArgumentError, r"send_rank_ids must be a list of 8"),
    ({"recv_lens": (0, -1, 0, 0)}, fs.errors.ArgumentError,
     r"recv_lens must be a list of 4 ints \(lengths >= 0\)"),
    ({"send_ids": (0, -1, -1, -1, 0, -1, -1, -1)}, fs.errors.ArgumentError,
     r"send_rank_ids=\[0, .*a rank id appears twice"),
    ({"send_lens": (5, 0, 0, 0)}, fs.errors.ArgumentError,
     r"send_lens\[0\] \(top\) is 5, more than the input's H = 4.*Fix: send at most 4"),
    ({"data_format": "NHWC"}, fs.errors.ArgumentError, r"data_format='NHWC'.*only 'NCHW'"),
    ({"recv_ids": (-1,) * 7 + (0,)}, fs.errors.ArgumentError,
     (r"recv_rank_ids=.*top-left corner \(index 7\) is received exactly when both its "
      r"sides.*Fix: set recv_rank_ids\[7\] to -1")),
])
def test_neighbor_exchange_arguments_are_checked_before_communicating(kwargs, error, pattern):
    with pytest.raises(error, match="(?s)" + pattern):
        fs.jit(_halo(**kwargs))(Tensor(_NCHW))


def test_neighbor_exchange_needs_nchw():
    with pytest.raises(fs.errors.ShapeError, match=r"takes an \(N, C, H, W\) tensor; got "
                       r"f32\[4,4\]"):
        fs.jit(_halo())(Tensor(_NCHW[0, 0]))
