"""Run inside a 4- then a 2-process job (see test_training_multiprocess.py).

``python -m fshard.launch -n N tests/distributed/training_checks.py OUT_DIR``

Every job:
- data parallelism with each process feeding its own slice of the batch
  (``dataset_strategy("data_parallel")``): 50 Adam steps of the digits MLP, losses and
  final parameters written for the test to compare with one process;
- ``fs.shard(..., dataset_strategy="data_parallel")`` with per-process slices, eager
  and under ``fs.jit``, its outputs this process's blocks.

The 4-process job also trains the 2 x 2 (dp x mp) Adam MLP with ZeRO level1 for 10
steps, saves a checkpoint with the plan's layouts (each process its blocks), trains 10
more, and writes every loss and the saved values. The 2-process job loads that
checkpoint into a data-parallel ZeRO level3 step and trains the same 10 steps, then
checks fs.checkpoint's own sharded save and a process killed during a save
(checkpoint_checks.py).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

import fshard as fs  # noqa: E402
from fshard import checkpoint as ckpt  # noqa: E402

import train_autoparallel as example  # noqa: E402

DP_STEPS = 50
RESUME_STEPS = 10


def n(x):
    return np.asarray(x.asnumpy() if hasattr(x, "asnumpy") else x)


STRATEGY_STEPS = 5


def strategy_net(strategy=((2, 2), (2, 1))):
    """A ReLU MLP with a loss whose first MatMul carries ``strategy`` (None: none)."""
    from mindspore import Parameter, Tensor, nn, ops

    class StrategyNet(nn.Cell):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(3)
            self.w1 = Parameter(Tensor((rng.standard_normal((16, 8)) * 0.3)
                                       .astype(np.float32)), name="w1")
            self.w2 = Parameter(Tensor((rng.standard_normal((8, 4)) * 0.3)
                                       .astype(np.float32)), name="w2")
            self.matmul1 = ops.MatMul().shard(strategy) if strategy else ops.MatMul()
            self.relu = ops.ReLU()

        def construct(self, x, y):
            return ((ops.matmul(self.relu(self.matmul1(x, self.w1)), self.w2) - y) ** 2).mean()

    return StrategyNet()


def strategy_batch():
    rng = np.random.default_rng(4)
    return (rng.standard_normal((8, 16)).astype(np.float32),
            rng.standard_normal((8, 4)).astype(np.float32))


def train_strategy_net(rank: int, size: int) -> dict:
    """(4-process job) ``STRATEGY_STEPS`` SGD steps of ``strategy_net()``, a Cell whose
    MatMul carries a 2 x 2 ``Primitive.shard`` strategy, each process passing its rows;
    the losses and the strategy of the first MatMul in the plan."""
    ap = fs.AutoParallel(strategy_net(), fs.optim.sgd(0.1))
    state = ap.init()
    x, y = strategy_batch()
    b = x.shape[0] // size
    xs, ys = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
    losses = []
    for _ in range(STRATEGY_STEPS):
        state, loss = ap(state, xs, ys)
        losses.append(float(n(loss)))
    eqs = ap.partitioned(state, xs, ys).strategies()["equations"]
    return {"losses": losses,
            "matmul": next(e["in_strategy"] for e in eqs if e["primitive"] == "matmul")}


def data_parallel(rank: int, size: int) -> dict:
    """50 Adam steps, each process passing rows [r * b, (r + 1) * b) of the batch."""
    ap = example.make()
    state = ap.init(example.init_params())
    b = example.BATCH // size
    losses = []
    for x, y in example.batches(DP_STEPS):
        state, loss = ap(state, x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
        losses.append(float(n(loss)))
    return {"losses": losses, "params": {k: n(v).tolist() for k, v in state.params.items()},
            "step": int(n(state.step))}


def shard_data_parallel(rank: int, size: int) -> dict:
    """fs.shard with per-process slices: unannotated arguments are this process's rows,
    unannotated outputs come back as this process's rows; an annotated (whole)
    argument is the global value."""
    b = 3
    x_all = np.arange(size * b * 4, dtype=np.float32).reshape(size * b, 4)
    pos = np.arange(size * b, dtype=np.float32) * 100
    w = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)
    mine = x_all[rank * b:(rank + 1) * b]

    def f(x, p, w):
        y = x @ w
        return y + p[:, None], y.sum()

    g = fs.shard(f, in_strategy=(None, (1,), (1, 1)), out_strategy=None,
                 dataset_strategy="data_parallel")
    out = {}
    for name, fn in (("eager", g), ("jit", fs.jit(g))):
        y, total = fn(mine, pos, w)
        want = x_all @ w
        out[name] = {
            "rows": bool(np.allclose(n(y), (want + pos[:, None])[rank * b:(rank + 1) * b])),
            "shape": list(n(y).shape),
            "total": bool(np.isclose(float(n(total)), float(want.sum()), rtol=1e-6)),
        }
    return out


def train_2x2_and_save(out: str) -> dict:
    """10 steps of the 2 x 2 Adam step with ZeRO level1, a checkpoint, 10 more."""
    ap = example.make(mp=2, zero="level1")
    state = ap.init(example.init_params())
    batches = list(example.batches(2 * RESUME_STEPS))
    losses = []
    for x, y in batches[:RESUME_STEPS]:
        state, loss = ap(state, x, y)
        losses.append(float(n(loss)))
    layouts = ap.state_strategies(state, *batches[0])
    d = ckpt.save(os.path.join(out, "ckpt4"), state, step=RESUME_STEPS, layouts=layouts)
    if fs.distributed.rank() == 0:
        np.savez(os.path.join(out, "saved4.npz"),
                 **{f"leaf{i}": n(v) for i, v in enumerate(fs.tree.leaves(state))})
    for x, y in batches[RESUME_STEPS:]:
        state, loss = ap(state, x, y)
        losses.append(float(n(loss)))
    return {"losses": losses, "dir": d,
            "param_layouts": {k: list(v) for k, v in layouts.params.items()}}


def resume_with_zero3(out: str, rank: int, size: int) -> dict:
    """The 4-process checkpoint onto 2 processes: data parallel (own slices), ZeRO
    level3; the next 10 steps."""
    ap = example.make(zero="level3")
    state = ckpt.load(os.path.join(out, "ckpt4"), ap.init(example.init_params()))
    b = example.BATCH // size
    losses = []
    for x, y in list(example.batches(2 * RESUME_STEPS))[RESUME_STEPS:]:
        state, loss = ap(state, x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
        losses.append(float(n(loss)))
    return {"losses": losses, "step": int(n(state.step))}


def main(out: str) -> None:
    fs.distributed.init()
    rank, size = fs.distributed.rank(), fs.distributed.world_size()
    report = {"data_parallel": data_parallel(rank, size),
              "shard": shard_data_parallel(rank, size)}
    if size == 4:
        report["strategy_net"] = train_strategy_net(rank, size)
        report["resume"] = train_2x2_and_save(out)
    else:
        report["resume"] = resume_with_zero3(out, rank, size)
    with open(os.path.join(out, f"training{size}_rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    if size == 2:
        import checkpoint_checks

        checkpoint_checks.main(out)


if __name__ == "__main__":
    main(sys.argv[1])
