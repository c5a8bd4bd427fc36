"""Manual data parallelism with collectives: MindSpore's "manually parallel" example
(an MLP whose loss is AllReduce-averaged over the cards), written with fshard.

Each device takes its slice of the batch, computes the loss of an MLP
(64-512-512-10, on scikit-learn's bundled digits) and its gradients, and
``fs.pmean`` averages the loss over the data-parallel axis ``"dp"``. Differentiating
through ``pmean`` averages the gradients too, so every device applies the same
update, and the losses equal those of one device training on the whole batch.

The step is ``fs.jit(fs.shard_map(fs.value_and_grad(local_loss), ...))``: one graph
per process. The same script runs

    python examples/data_parallel_mlp.py                             # 1 device
    FSHARD_DEVICES=4 python examples/data_parallel_mlp.py            # virtual mesh of 4
    python -m fshard.launch -n 2 examples/data_parallel_mlp.py       # 2 processes
    python -m fshard.launch -n 4 examples/data_parallel_mlp.py       # 4 processes

and prints the loss every ``--log-every`` steps, as the seed's LossMonitor does.
"""

from __future__ import annotations

import argparse
import os

import mindspore as ms
import numpy as np

import fshard as fs

SIZES = (64, 512, 512, 10)


def load_data():
    """Digits images as float32 in [0, 1] (1797, 64) and int32 labels (1797,)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)


def init_params(seed: int = 0) -> dict:
    """He-initialised weights and zero biases of the MLP, as a dict of Tensors."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (n_in, n_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        params[f"w{i}"] = ms.Tensor((rng.standard_normal((n_in, n_out)) * np.sqrt(2.0 / n_in)
                                     ).astype(np.float32))
        params[f"b{i}"] = ms.Tensor(np.zeros((n_out,), np.float32))
    return params


def mlp(params, x):
    n = len(SIZES) - 1
    for i in range(n):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            x = fs.ops.relu(x)
    return x


def loss_fn(params, x, labels):
    """Mean softmax cross-entropy of the MLP on a batch."""
    return fs.ops.softmax_cross_entropy(mlp(params, x), labels)


def local_loss(params, x, labels):
    """Runs on each device's slice of the batch: the seed's AllReduce(loss) / device_num."""
    return fs.pmean(loss_fn(params, x, labels), "dp")


def make_step(mesh: fs.Mesh, lr: float):
    """One jitted SGD step: per-device loss and grads, averaged by ``fs.pmean``."""
    dp = fs.Layout(mesh.shape, mesh.axis_names)
    grads = fs.shard_map(fs.value_and_grad(local_loss),
                         in_strategy=(None, dp("dp", "None"), dp("dp")),  # params replicated
                         out_strategy=((), None),                          # loss, grads replicated
                         mesh=mesh)

    def step(params, x, labels):
        loss, g = grads(params, x, labels)
        return fs.tree.map(lambda p, gp: p - lr * gp, params, g), loss

    return fs.jit(step)


def make_reference_step(lr: float):
    """The same SGD step on one device and the whole batch (no shard_map)."""
    vg = fs.value_and_grad(loss_fn)

    def step(params, x, labels):
        loss, g = vg(params, x, labels)
        return fs.tree.map(lambda p, gp: p - lr * gp, params, g), loss

    return fs.jit(step)


def batches(x, y, batch_size: int, seed: int = 0):
    """Endless batches in a fixed shuffled order (the same on every rank)."""
    rng = np.random.default_rng(seed)
    n = len(x) // batch_size * batch_size
    while True:
        order = rng.permutation(len(x))[:n]
        for i in range(0, n, batch_size):
            idx = order[i:i + batch_size]
            yield x[idx], y[idx]


def train(steps: int, mesh: fs.Mesh | None = None, *, batch_size: int = 128, lr: float = 0.1,
          seed: int = 0, log_every: int = 0) -> list[float]:
    """Train for ``steps`` steps; ``mesh=None`` trains on one device without
    shard_map (the reference). Returns the per-step losses."""
    x, y = load_data()
    params = init_params(seed)
    step = make_reference_step(lr) if mesh is None else make_step(mesh, lr)
    losses = []
    data = batches(x, y, batch_size, seed)
    for i in range(1, steps + 1):
        xb, yb = next(data)
        params, loss = step(params, xb, yb)
        losses.append(float(loss.asnumpy()))
        if log_every and i % log_every == 0 and fs.distributed.rank() == 0:
            print(f"step: {i}, loss is {losses[-1]:.6f}", flush=True)
    return losses


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=20)
    args = p.parse_args(argv)
    if fs.distributed.in_launcher():
        fs.distributed.init()
    n = fs.distributed.world_size() if fs.distributed.is_initialized() else int(
        os.environ.get("FSHARD_DEVICES", "1"))
    mesh = fs.Mesh((n,), ("dp",))
    where = "processes" if not mesh.is_virtual else "virtual devices"
    if fs.distributed.rank() == 0:
        print(f"data parallel over {n} {where}, batch {args.batch_size} "
              f"({args.batch_size // n} per device)", flush=True)
    train(args.steps, mesh, batch_size=args.batch_size, lr=args.lr, log_every=args.log_every)


if __name__ == "__main__":
    main()
