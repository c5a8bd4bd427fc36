"""Train mindcv's ResNet-18, unchanged, with ``fs.AutoParallel``: data parallel on a
virtual mesh or in a multi-process job.

    python examples/train_resnet.py                                # 1 device
    FSHARD_DEVICES=8 python examples/train_resnet.py               # virtual mesh of 8
    python -m fshard.launch -n 2 examples/train_resnet.py          # 2 processes

The data are scikit-learn's bundled digits, upsampled to ``--size`` x ``--size`` RGB
images (nearest neighbour), 10 classes. The network is ``mindcv.create_model
("resnet18")`` in training mode inside MindSpore's ``nn.WithLossCell``; the optimizer
is ``fs.optim.sgd(lr, momentum=0.9)``, MindSpore's ``nn.Momentum``. Its BatchNorm
layers normalise with the statistics of the whole global batch, whatever the number
of devices (as ``nn.SyncBatchNorm`` does), and their moving statistics are part of the
train state (``state.params["_backbone.bn1.moving_mean"]``), so the losses equal one
device's. In a job each process feeds only its own rows of every batch (process ``r``
of ``N``: rows ``[r * b, (r + 1) * b)``). Rank 0 shows a progress bar and logs the
loss in MindSpore's LossMonitor format (``epoch: 1 step: 10, loss is 1.234``);
``--out`` writes the losses as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import numpy as np

import fshard as fs

BATCH = 16
SIZE = 32
CLASSES = 10


def load_data(size: int = SIZE):
    """Digits as ``(1797, 3, size, size)`` float32 images (mean 0, std 1) and int32
    labels: each 8 x 8 image upsampled by repetition to ``size`` x ``size``, the same in
    the three channels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits.images.astype(np.float32)
    x = (x - x.mean()) / x.std()
    x = np.repeat(np.repeat(x, -(-size // 8), axis=1), -(-size // 8), axis=2)[:, :size, :size]
    x = np.ascontiguousarray(np.broadcast_to(x[:, None], (len(x), 3, size, size)))
    return x, digits.target.astype(np.int32)


def batches(steps: int, batch: int = BATCH, size: int = SIZE):
    """``steps`` consecutive batches of the digits (wrapping around)."""
    x, y = load_data(size)
    for i in range(steps):
        start = (i * batch) % (len(x) - batch)
        yield x[start:start + batch], y[start:start + batch]


def make_model(seed: int = 0, num_classes: int = CLASSES):
    """mindcv's ResNet-18 (random weights from ``seed``), in training mode."""
    import mindcv
    import mindspore as ms

    ms.set_seed(seed)
    with warnings.catch_warnings():  # mindcv's imports warn about deprecated names
        warnings.simplefilter("ignore")
        net = mindcv.create_model("resnet18", pretrained=False, num_classes=num_classes)
    net.set_train(True)
    return net


def loss_cell(net):
    """``net`` with MindSpore's mean sparse softmax cross-entropy: ``(x, y) -> loss``."""
    from mindspore import nn

    return nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True,
                                                                 reduction="mean"))


def make(net, lr: float = 0.01, mesh=None) -> fs.AutoParallel:
    """The data-parallel training step of ``net``: SGD with momentum 0.9, the batch
    split over every device."""
    ap = fs.AutoParallel(loss_cell(net), fs.optim.sgd(lr, momentum=0.9), mesh=mesh)
    ap.dataset_strategy("data_parallel")
    return ap


def train(steps: int, batch: int = BATCH, size: int = SIZE, lr: float = 0.01, mesh=None,
          log_every: int = 0, progress: bool = False):
    """Train for ``steps`` steps; ``(losses, state)``."""
    ap = make(make_model(), lr, mesh)
    state = ap.init()
    rank, n = fs.distributed.rank(), fs.distributed.world_size()
    if batch % max(n, ap.n_devices):
        raise SystemExit(f"--batch {batch} must be divisible by the {ap.n_devices} devices")
    losses = []
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task(f"resnet18 ({ap.n_devices} devices)", total=steps)
    try:
        for i, (x, y) in enumerate(batches(steps, batch, size)):
            if n > 1:  # a job: this process's rows only, as a sharded dataset gives
                rows = slice(rank * batch // n, (rank + 1) * batch // n)
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
    return losses, state


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=BATCH, help="global batch size")
    p.add_argument("--size", type=int, default=SIZE, help="image height and width")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default=None, help="write the losses here (JSON)")
    args = p.parse_args(argv)
    if fs.distributed.in_launcher():
        fs.distributed.init()
    rank = fs.distributed.rank()
    losses, _ = train(args.steps, args.batch, args.size, args.lr,
                      log_every=args.log_every if rank == 0 else 0,
                      progress=rank == 0 and os.isatty(1))
    if args.out:
        with open(f"{args.out}.rank{rank}.json", "w") as fh:
            json.dump(losses, fh)


if __name__ == "__main__":
    main()
