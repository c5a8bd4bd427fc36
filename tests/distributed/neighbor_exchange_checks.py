"""MindSpore's ops.NeighborExchangeV2 in a real 4-process job: a 2x2 grid of ranks.

``python -m fshard.launch -n 4 tests/distributed/neighbor_exchange_checks.py OUT_DIR``.
Rank ``r`` holds block ``(r // 2, r % 2)`` of a global image and exchanges halos with
its neighbours, as a MindSpore user writes it: per-rank rank ids under ``fs.jit``. Each
rank writes its results to ``OUT_DIR/rank<k>.json`` for
tests/distributed/test_neighbor_exchange_multiprocess.py to compare with NumPy; the
error cases record their messages (they must be raised on every rank, not hang).
``... neighbor_exchange_checks.py one_way_grad`` (2 ranks) and ``mute_grad`` (3 ranks)
run the refused differentiations, each of which stops its job.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

N, C, H, W = 1, 2, 4, 5
G = np.arange(N * C * 2 * H * 2 * W, dtype=np.float32).reshape(N, C, 2 * H, 2 * W) / 8 - 3
#: send_lens [top, bottom, left, right]: unequal on purpose
SEND_LENS = [1, 2, 1, 2]
#: what a rank receives from each side is its neighbour's opposite piece
RECV_LENS = [SEND_LENS[1], SEND_LENS[0], SEND_LENS[3], SEND_LENS[2]]
#: the (row, col) step of each of MindSpore's 8 directions
STEPS = [(-1, 0), (-1, 1), (0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1)]


def block(rank: int) -> np.ndarray:
    i, j = divmod(rank, 2)
    return G[:, :, i * H:(i + 1) * H, j * W:(j + 1) * W]


def grid_ids(rank: int) -> list:
    """The rank in each direction on the 2x2 grid (-1 beyond its edge)."""
    i, j = divmod(rank, 2)
    return [2 * (i + di) + (j + dj) if 0 <= i + di < 2 and 0 <= j + dj < 2 else -1
            for di, dj in STEPS]


def tensor_a(rank: int) -> np.ndarray:
    return np.arange((rank + 1) * 2, dtype=np.float32).reshape(rank + 1, 2) + 10 * rank


def tensor_b(rank: int) -> np.ndarray:
    return np.array([rank, -rank, 0.5], np.float32)


def weights(shape, rank: int) -> np.ndarray:
    return np.cos(np.arange(int(np.prod(shape)), dtype=np.float32) + rank).reshape(shape)


def main(out_dir: str) -> None:
    import mindspore as ms
    from mindspore import ops
    from mindspore.communication import get_rank

    import fshard as fs

    fs.distributed.init()
    rank = get_rank()
    ids = grid_ids(rank)
    x = ms.Tensor(block(rank))
    out = {}

    halo = ops.NeighborExchangeV2(send_rank_ids=ids, send_lens=SEND_LENS, recv_rank_ids=ids,
                                  recv_lens=RECV_LENS, data_format="NCHW")
    out["grid"] = fs.jit(halo)(x).asnumpy().tolist()

    # only ranks 0 and 1 exchange (left/right); ranks 2 and 3 have no neighbour at all
    pair = {0: [-1, -1, 1, -1, -1, -1, -1, -1], 1: [-1] * 6 + [0, -1]}.get(rank, [-1] * 8)
    rows = ops.NeighborExchangeV2(send_rank_ids=pair, send_lens=[0, 0, 2, 3],
                                  recv_rank_ids=pair, recv_lens=[0, 0, 3, 2],
                                  data_format="NCHW")
    out["pair"] = fs.jit(rows)(x).asnumpy().tolist()

    # MindSpore's own example (its docstring, 2 ranks): rank 0 sends its bottom row to
    # rank 1 and receives rank 1's top row below its own; ranks 2 and 3 take no part
    net0 = [-1, -1, -1, -1, 1, -1, -1, -1]
    net1 = [0, -1, -1, -1, -1, -1, -1, -1]
    ids01 = {0: net0, 1: net1}.get(rank, [-1] * 8)
    lens01 = {0: [0, 1, 0, 0], 1: [1, 0, 0, 0]}.get(rank, [0] * 4)
    example = ops.NeighborExchangeV2(send_rank_ids=ids01, send_lens=lens01,
                                     recv_rank_ids=ids01, recv_lens=lens01, data_format="NCHW")
    ones = ms.Tensor(np.ones([1, 1, 2, 2]) * (rank + 1), dtype=ms.float32)
    out["doc_example"] = fs.jit(example)(ones).asnumpy().tolist()

    # gradients: each rank's loss weighs its own output; the gradient of the job's
    # total loss comes back to the rank whose input was sent
    wts = ms.Tensor(weights(tuple(np.array(out["grid"]).shape), rank))
    grad = fs.jit(fs.grad(lambda v: (halo(v) * wts).sum()))(x)
    out["grad"] = grad.asnumpy().tolist()

    # inside a Cell, as a MindSpore network holds it
    class Halo(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.exchange = halo

        def construct(self, v):
            return self.exchange(v * 2)
    out["cell"] = fs.jit(Halo())(x).asnumpy().tolist()

    # NeighborExchange: rank r sends A_r ((r + 1, 2)) to r + 1 and B_r ((3,)) to r + 2
    # (mod 4), and receives A from r - 1 and B from r + 2
    a, b = ms.Tensor(tensor_a(rank)), ms.Tensor(tensor_b(rank))
    ring = ops.NeighborExchange(
        send_rank_ids=[(rank + 1) % 4, (rank + 2) % 4],
        recv_rank_ids=[(rank - 1) % 4, (rank + 2) % 4],
        recv_shapes=([(rank - 1) % 4 + 1, 2], [3]), send_shapes=([rank + 1, 2], [3]),
        recv_type=ms.float32)
    got_a, got_b = fs.jit(lambda u, v: ring((u, v)))(a, b)
    out["ring"] = [got_a.asnumpy().tolist(), got_b.asnumpy().tolist()]
    wa, wb = (ms.Tensor(weights(s, rank)) for s in (tensor_a((rank - 1) % 4).shape, (3,)))

    def ring_loss(u, v):
        ra, rb = ring((u, v))
        return (ra * wa).sum() + (rb * wb).sum()
    grads = fs.jit(fs.grad(ring_loss, argnums=(0, 1)))(a, b)
    out["ring_grad"] = [g.asnumpy().tolist() for g in grads]

    def error(fn, *args):
        try:
            fn(*args)
        except fs.errors.FshardError as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    # rank 3's input is taller: every rank raises (no AllGather of unequal sizes)
    taller = ms.Tensor(np.zeros((N, C, H + (rank == 3), W), np.float32))
    out["shapes_differ"] = error(fs.jit(halo), taller)
    # rank 3's input is float16, rank 1's has 3 channels: every rank raises
    out["dtype_differ"] = error(fs.jit(halo), x.astype(ms.float16) if rank == 3 else x)
    wide = ms.Tensor(np.zeros((N, C + (rank == 1), H, W), np.float32))
    out["channels_differ"] = error(fs.jit(halo), wide)
    # rank 0 expects 1 row from its bottom neighbour, which sends 1 (its send_lens top)
    wrong = ops.NeighborExchangeV2(send_rank_ids=ids, send_lens=SEND_LENS, recv_rank_ids=ids,
                                   recv_lens=[1, 2, 2, 1] if rank == 0 else RECV_LENS,
                                   data_format="NCHW")
    out["lens_differ"] = error(fs.jit(wrong), x)
    # rank 1 sends nothing to the left, while rank 0 waits for its right piece
    mute = ops.NeighborExchangeV2(send_rank_ids=[-1] * 8 if rank == 1 else ids,
                                  send_lens=SEND_LENS, recv_rank_ids=ids, recv_lens=RECV_LENS,
                                  data_format="NCHW")
    out["no_sender"] = error(fs.jit(mute), x)
    # the top-left corner without its sides: refused on each rank, before communicating
    out["corner"] = error(fs.jit(ops.NeighborExchangeV2(
        send_rank_ids=[-1] * 8, send_lens=[0] * 4, recv_rank_ids=[-1] * 7 + [0],
        recv_lens=[1, 0, 1, 0], data_format="NCHW")), x)
    # rank 2 expects a (3, 2) tensor from rank 1, which sends (2, 2)
    bad = ops.NeighborExchange(
        send_rank_ids=[(rank + 1) % 4], recv_rank_ids=[(rank - 1) % 4],
        recv_shapes=([3 if rank == 2 else (rank - 1) % 4 + 1, 2],), send_shapes=([rank + 1, 2],),
        recv_type=ms.float32)
    out["ring_shapes_differ"] = error(fs.jit(lambda u: bad((u,))), a)
    # NeighborExchangeV2 one way: rank 0 sends its bottom row to rank 2 and receives
    # nothing (its output is its input); ranks 1 and 3 take no part. Under grad rank 0
    # gets rank 2's cotangent of that row back.
    down = {0: ([-1, -1, -1, -1, 2, -1, -1, -1], [-1] * 8, [0, 1, 0, 0], [0] * 4),
            2: ([-1] * 8, [0, -1, -1, -1, -1, -1, -1, -1], [0] * 4, [1, 0, 0, 0])}
    s_ids, r_ids, s_lens, r_lens = down.get(rank, ([-1] * 8, [-1] * 8, [0] * 4, [0] * 4))
    one_way_v2 = ops.NeighborExchangeV2(send_rank_ids=s_ids, send_lens=s_lens,
                                        recv_rank_ids=r_ids, recv_lens=r_lens,
                                        data_format="NCHW")
    got = fs.jit(one_way_v2)(x)
    out["one_way_v2"] = got.asnumpy().tolist()
    w1 = ms.Tensor(weights(tuple(got.shape), rank))
    out["one_way_v2_grad"] = fs.jit(fs.grad(lambda v: (one_way_v2(v) * w1).sum()))(
        x).asnumpy().tolist()
    # uneven blocks: rank 2's input is one row taller; ranks 0 and 2 swap rows
    tall = ms.Tensor(np.full((N, C, H + (rank == 2), W), rank, np.float32))
    vert = {0: [-1, -1, -1, -1, 2, -1, -1, -1], 2: [0] + [-1] * 7}.get(rank, [-1] * 8)
    uneven = ops.NeighborExchangeV2(send_rank_ids=vert, send_lens=[1, 2, 0, 0],
                                    recv_rank_ids=vert, recv_lens=[2, 1, 0, 0],
                                    data_format="NCHW")
    out["uneven"] = fs.jit(uneven)(tall).asnumpy().tolist()
    # NeighborExchange where ranks receive nothing: rank 0 sends P to rank 1 and Q to
    # rank 3 and receives R from rank 1; rank 3 only receives; rank 2 takes no part
    p_, q_, r_ = (np.arange(6, dtype=np.float32).reshape(2, 3) - 2, np.array([7.5], np.float32),
                  np.array([1, -2, 3, -4], np.float32))
    plan = {0: ([1, 3], [1], ([4],), ([2, 3], [1]), (p_, q_)),
            1: ([0], [0], ([2, 3],), ([4],), (r_,)),
            2: ([], [], (), (), ()),
            3: ([], [0], ([1],), (), ())}[rank]
    asym = ops.NeighborExchange(send_rank_ids=plan[0], recv_rank_ids=plan[1],
                                recv_shapes=plan[2], send_shapes=plan[3], recv_type=ms.float32)
    sent = tuple(ms.Tensor(t) for t in plan[4])
    res = fs.jit(lambda *ts: asym(ts))(*sent)
    out["asym"] = None if res is None else [t.asnumpy().tolist() for t in res]
    # only rank 0 sends (to rank 1): ranks 0, 2 and 3 receive nothing and get None, as
    # in MindSpore (their programs have no output, and still take part)
    a0 = ms.Tensor(tensor_a(0))
    one_way = ops.NeighborExchange(
        send_rank_ids=[1] if rank == 0 else [], recv_rank_ids=[0] if rank == 1 else [],
        recv_shapes=([1, 2],) if rank == 1 else (), send_shapes=([1, 2],) if rank == 0 else (),
        recv_type=ms.float32)
    res = fs.jit(lambda u: one_way((u,) if rank == 0 else ()))(a0)
    out["one_way"] = None if res is None else [t.asnumpy().tolist() for t in res]
    # and returning something else beside the exchange
    res = fs.jit(lambda u: (one_way((u,) if rank == 0 else ()), u * 2))(a0)
    out["one_way_beside"] = [None if res[0] is None else res[0][0].asnumpy().tolist(),
                             res[1].asnumpy().tolist()]
    # rank 1 waits for a tensor from rank 0, which sends nothing: refused on every rank
    deaf = ops.NeighborExchange(
        send_rank_ids=[], recv_rank_ids=[0] if rank == 1 else [],
        recv_shapes=([1, 2],) if rank == 1 else (), send_shapes=(), recv_type=ms.float32)
    out["no_sender_ne"] = error(fs.jit(lambda u: deaf(())), a0)
    # and the job still communicates correctly after the refusals
    out["after"] = fs.jit(halo)(x).asnumpy().tolist()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


def one_way_grad() -> None:
    """2 ranks: rank 0 sends a tensor to rank 1 and receives nothing, and both ranks
    differentiate: refused on rank 0 (its gradient is rank 1's cotangent), which stops
    the job. (tests/distributed/test_neighbor_exchange_multiprocess.py)"""
    import mindspore as ms
    from mindspore import ops
    from mindspore.communication import get_rank

    import fshard as fs

    fs.distributed.init()
    rank = get_rank()
    one_way = ops.NeighborExchange(
        send_rank_ids=[1] if rank == 0 else [], recv_rank_ids=[0] if rank == 1 else [],
        recv_shapes=([1, 2],) if rank == 1 else (), send_shapes=([1, 2],) if rank == 0 else (),
        recv_type=ms.float32)

    def loss(u):
        got = one_way((u * 3,) if rank == 0 else ())
        return (u * u).sum() + (0 if got is None else got[0].sum())

    fs.jit(fs.grad(loss))(ms.Tensor(tensor_a(0)))


def mute_grad() -> None:
    """3 ranks: ranks 0 and 1 swap tensors, rank 2 receives one from rank 0 and sends
    nothing; all differentiate: refused on ranks 0 and 1 (rank 2 would not take part
    in the transposed exchange), which stops the job."""
    import mindspore as ms
    from mindspore import ops
    from mindspore.communication import get_rank

    import fshard as fs

    fs.distributed.init()
    rank = get_rank()
    send, recv = {0: ([1, 2], [1]), 1: ([0], [0]), 2: ([], [0])}[rank]
    swap = ops.NeighborExchange(send_rank_ids=send, recv_rank_ids=recv,
                                recv_shapes=([1, 2],) * len(recv),
                                send_shapes=([1, 2],) * len(send), recv_type=ms.float32)

    def loss(u):
        got = swap(tuple(u * (k + 1) for k in range(len(send))))
        return (u * u).sum() + got[0].sum()

    fs.jit(fs.grad(loss))(ms.Tensor(tensor_a(0)))


if __name__ == "__main__":
    if sys.argv[1] == "one_way_grad":
        one_way_grad()
    elif sys.argv[1] == "mute_grad":
        mute_grad()
    else:
        main(sys.argv[1])
