"""Train the digits MLP with ``fs.AutoParallel``: data x model parallelism, ZeRO, any
parallel mode, on a virtual mesh or in a multi-process job.

    python examples/train_autoparallel.py                          # 1 device
    FSHARD_DEVICES=4 python examples/train_autoparallel.py --mp 2  # virtual 2 x 2
    python -m fshard.launch -n 4 examples/train_autoparallel.py --mp 2 --zero level1
    python -m fshard.launch -n 2 examples/train_autoparallel.py --mode sharding_propagation

``--mp`` splits the hidden layer over that many devices (Megatron's column/row split:
``w1`` by columns, ``w2`` by rows); the rest of the devices split the batch. Without
``--mp`` the step is data parallel and, in a job, each process feeds only its own rows
of every batch; with ``--mp`` every process passes the whole batch. ``--zero``
turns on ``hsdp`` at that level. Rank 0 shows a progress bar and logs the loss in the
seed's LossMonitor format (``epoch: 1 step: 10, loss is 1.234``); ``--out`` writes the
losses as JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import fshard as fs

HIDDEN = 128
BATCH = 64


def load_data():
    """Digits images in [0, 1] (1797, 64) float32 and int32 labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)


def init_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"w1": (rng.standard_normal((64, HIDDEN)) / 8).astype(np.float32),
            "b1": np.zeros(HIDDEN, np.float32),
            "w2": (rng.standard_normal((HIDDEN, 10)) / np.sqrt(HIDDEN)).astype(np.float32),
            "b2": np.zeros(10, np.float32)}


def loss_fn(params, x, y):
    h = fs.ops.relu(fs.ops.matmul(x, params["w1"]) + params["b1"])
    return fs.ops.softmax_cross_entropy(fs.ops.matmul(h, params["w2"]) + params["b2"], y)


def batches(steps: int):
    x, y = load_data()
    for i in range(steps):
        start = (i * BATCH) % (len(x) - BATCH)
        yield x[start:start + BATCH], y[start:start + BATCH]


def make(mode: str = "semi_auto", mp: int = 1, zero: str | None = None, lr: float = 1e-2,
         mesh=None) -> fs.AutoParallel:
    """The AutoParallel step: Adam, the hidden layer split over ``mp`` devices, the batch
    over the others."""
    ap = fs.AutoParallel(loss_fn, fs.optim.adam(lr), parallel_mode=mode, mesh=mesh)
    n = ap.n_devices
    if n % mp:
        raise SystemExit(f"--mp {mp} must divide the {n} devices")
    dp = n // mp
    if mp > 1:
        ap.parameter_plan({"w1": (1, mp), "b1": (mp,), "w2": (mp, 1)})
        ap.dataset_strategy(((dp, 1), (dp,)))
    if zero:
        ap.hsdp(threshold=0, optimizer_level=zero)
    return ap


def train(steps: int, mode: str = "semi_auto", mp: int = 1, zero: str | None = None,
          mesh=None, log_every: int = 0, progress: bool = False) -> list[float]:
    ap = make(mode, mp, zero, mesh=mesh)
    state = ap.init(init_params())
    losses = []
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task(f"training ({ap.n_devices} devices)", total=steps)
    # Data parallel in a job: each process feeds its own rows of every batch (as a
    # sharded dataset would), rows [r * b, (r + 1) * b) on process r of N.
    rank, n = fs.distributed.rank(), fs.distributed.world_size()
    own = mp == 1 and n > 1
    try:
        for i, (x, y) in enumerate(batches(steps)):
            if own:
                rows = slice(rank * BATCH // n, (rank + 1) * BATCH // n)
                x, y = x[rows], y[rows]
            state, loss = ap(state, x, y)
            losses.append(float(loss.asnumpy()))
            if bar is not None:
                bar.advance(task)
            if log_every and (i + 1) % log_every == 0:
                print(f"epoch: 1 step: {i + 1}, loss is {losses[-1]:.6f}", flush=True)
    finally:
        if bar is not None:
            bar.stop()
    return losses


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--mode", default="semi_auto",
                   choices=["semi_auto", "sharding_propagation", "recursive_programming"])
    p.add_argument("--mp", type=int, default=1, help="devices splitting the hidden layer")
    p.add_argument("--zero", choices=["level1", "level2", "level3"], default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default=None, help="write the losses here (JSON)")
    args = p.parse_args(argv)
    if fs.distributed.in_launcher():
        fs.distributed.init()
    rank = fs.distributed.rank()
    losses = train(args.steps, args.mode, args.mp, args.zero,
                   log_every=args.log_every if rank == 0 else 0,
                   progress=rank == 0 and os.isatty(1))
    if args.out:
        with open(f"{args.out}.rank{rank}.json", "w") as fh:
            json.dump(losses, fh)


if __name__ == "__main__":
    main()
