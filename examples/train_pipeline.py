"""Pipeline-parallel training with ``fs.AutoParallel(...).pipeline(...)``: the digits
MLP or a small transformer-block stack, cut into stages with ``fs.pipeline_split``.

    python examples/train_pipeline.py --stages 2 --micro-batches 4            # virtual mesh
    python examples/train_pipeline.py --stages 4 --micro-batches 8 --interleave
    python -m fshard.launch -n 2 examples/train_pipeline.py --stages 2 --micro-batches 4
    python -m fshard.launch -n 4 examples/train_pipeline.py --stages 2 --scheduler gpipe
    python -m fshard.launch -n 4 examples/train_pipeline.py --stages 2 --model-parallel

On a virtual mesh the mesh has ``stages`` devices (``--dp`` more per stage); under the
launcher every process is one device and the job's ``n / stages`` devices per stage
split each micro-batch (data parallel), or with ``--model-parallel`` the stage's
weights too (operator parallelism inside each stage). ``--show-schedule`` prints the schedule's
timeline; ``--plot PATH`` saves it as an image. The last stage logs the loss in the
seed's LossMonitor format (``epoch: 1 step: 10, loss is 1.234``); ``--out`` writes the
losses as JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import fshard as fs

BATCH = 64
HIDDEN = 64
D_MODEL, SEQ = 16, 8


def load_data():
    """Digits images in [0, 1] (1797, 64) float32 and int32 labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)


def batches(steps: int, batch: int = BATCH):
    x, y = load_data()
    for i in range(steps):
        start = (i * batch) % (len(x) - batch)
        yield x[start:start + batch], y[start:start + batch]


# -- the digits MLP: one dense layer per chunk --------------------------------------


def mlp_params(n_chunks: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    dims = [64] + [HIDDEN] * (n_chunks - 1) + [10] if n_chunks > 1 else [64, HIDDEN, 10]
    out = {}
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        out[f"layer{i}.w"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        out[f"layer{i}.b"] = np.zeros(b, np.float32)
    return out


def mlp_loss(params, x, y):
    """Dense + ReLU layers, a stage boundary after each hidden layer, cross-entropy."""
    n = len(params) // 2
    h = x
    for i in range(n - 1):
        h = fs.ops.relu(fs.ops.matmul(h, params[f"layer{i}.w"]) + params[f"layer{i}.b"])
        h = fs.pipeline_split(h)
    logits = fs.ops.matmul(h, params[f"layer{n - 1}.w"]) + params[f"layer{n - 1}.b"]
    return fs.ops.softmax_cross_entropy(logits, y)


# -- a transformer-block stack: one block per chunk ----------------------------------


def transformer_params(n_chunks: int, seed: int = 0, d_model: int = D_MODEL,
                       seq: int = SEQ) -> dict:
    """``n_chunks`` blocks of width ``d_model`` over ``seq`` tokens (of 64 / seq pixels)."""
    rng = np.random.default_rng(seed)
    d = d_model

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    out = {"embed": w(64 // seq, d), "head": w(d, 10)}
    res = np.float32(1 / np.sqrt(2 * n_chunks))  # residual branches scaled by depth
    for i in range(n_chunks):
        out.update({f"block{i}.qkv": w(d, 3 * d), f"block{i}.proj": w(d, d) * res,
                    f"block{i}.up": w(d, 2 * d), f"block{i}.down": w(2 * d, d) * res,
                    f"block{i}.g1": np.ones(d, np.float32), f"block{i}.g2": np.ones(d, np.float32)})
    return out


def _norm(x, g):
    return fs.ops.layer_norm(x, g)


def _block(p, i, x):
    d = x.shape[-1]
    h = _norm(x, p[f"block{i}.g1"])
    qkv = fs.ops.matmul(h, p[f"block{i}.qkv"])
    q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
    att = fs.ops.softmax(fs.ops.matmul(q, fs.ops.swapaxes(k, -1, -2)) * (d ** -0.5), -1)
    x = x + fs.ops.matmul(fs.ops.matmul(att, v), p[f"block{i}.proj"])
    h = _norm(x, p[f"block{i}.g2"])
    return x + fs.ops.matmul(fs.ops.gelu(fs.ops.matmul(h, p[f"block{i}.up"])),
                             p[f"block{i}.down"])


def transformer_loss(params, x, y):
    """Pixels as tokens (8 of 8 by default), an embedding, one block per stage, mean
    pool, head."""
    n = sum(k.endswith(".qkv") for k in params)
    width = params["embed"].shape[0]  # pixels per token
    h = fs.ops.matmul(fs.ops.reshape(x, (x.shape[0], 64 // width, width)), params["embed"])
    for i in range(n):
        if i:
            h = fs.pipeline_split(h)
        h = _block(params, i, h)
    return fs.ops.softmax_cross_entropy(fs.ops.matmul(fs.ops.mean(h, 1), params["head"]), y)


MODELS = {"mlp": (mlp_params, mlp_loss), "transformer": (transformer_params, transformer_loss)}


def model_parallel_plan(model: str, n_chunks: int, devices: int) -> dict:
    """Strategies splitting each stage's weights over its ``devices`` devices (operator
    parallelism inside the stages): the MLP's hidden layers by columns and its last
    layer by rows, each block's feed-forward pair column- then row-wise."""
    if model == "mlp":
        n = max(n_chunks, 2)
        return {f"layer{i}.w": (1, devices) if i < n - 1 else (devices, 1) for i in range(n)}
    plan = {}
    for i in range(n_chunks):
        plan[f"block{i}.up"], plan[f"block{i}.down"] = (1, devices), (devices, 1)
    return plan


def optimizer(name):
    """"adam", "momentum", "clipped" (Adam after a global-norm clip, which couples every
    parameter's update), or an fshard optimizer (used as it is)."""
    if not isinstance(name, str):
        return name
    if name == "clipped":
        return fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adam(1e-2))
    return fs.optim.adam(1e-2) if name == "adam" else fs.optim.sgd(0.03, momentum=0.9)


def make(model: str = "mlp", stages: int = 1, micro_batches: int = 1,
         scheduler: str = "1f1b", interleave: bool = False, output_broadcast: bool = False,
         mesh=None, opt="adam", dataset: str = "data_parallel", plan: dict | None = None):
    """``(ap, params)``: the model cut into ``stages`` (x2 with interleave), trained by
    ``opt`` ("adam", "momentum" or an fshard optimizer); ``plan``: parameter strategies
    (operator parallelism inside each stage)."""
    init, loss = MODELS[model]
    chunks = stages * (2 if interleave else 1)
    ap = fs.AutoParallel(loss, optimizer(opt), mesh=mesh).dataset_strategy(dataset)
    if plan:
        ap.parameter_plan(plan)
    if stages > 1:
        ap.pipeline(stages=stages, micro_batches=micro_batches, scheduler=scheduler,
                    interleave=interleave, output_broadcast=output_broadcast)
    return ap, init(chunks)


def train(steps: int, model: str = "mlp", stages: int = 1, micro_batches: int = 1,
          scheduler: str = "1f1b", interleave: bool = False, output_broadcast: bool = False,
          mesh=None, chunks: int | None = None, log_every: int = 0, opt="adam",
          params=None, batch: int = BATCH, dataset: str = "data_parallel",
          part: tuple | None = None, plan: dict | None = None):
    """``(losses, state, ap)`` after ``steps`` steps on batches of ``batch``. ``chunks``
    fixes the model's size (default: ``stages``, doubled with interleave), so an
    unpipelined run (``stages=1``) of the same model is the reference; ``params``: the
    initial parameters (default: the model's own for ``chunks``). ``part=(j, n)``: this
    process passes block ``j`` of ``n`` of each batch (its data-parallel slice); ``plan``:
    parameter strategies inside each stage."""
    init, loss = MODELS[model]
    ap, _ = make(model, stages, micro_batches, scheduler, interleave, output_broadcast, mesh,
                 opt, dataset, plan)
    if params is None:
        params = init(chunks or stages * (2 if interleave else 1))
    state = ap.init(params)
    losses = []
    for i, (x, y) in enumerate(batches(steps, batch)):
        if part is not None:
            j, n = part
            b = len(x) // n
            x, y = x[j * b:(j + 1) * b], y[j * b:(j + 1) * b]
        state, l = ap(state, x, y)
        losses.append(float(l.asnumpy()))
        if log_every and (i + 1) % log_every == 0:
            print(f"epoch: 1 step: {i + 1}, loss is {losses[-1]:.6f}", flush=True)
    return losses, state, ap


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mlp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--scheduler", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--interleave", action="store_true")
    p.add_argument("--dp", type=int, default=1, help="devices per stage (virtual mesh)")
    p.add_argument("--model-parallel", action="store_true",
                   help="split the weights over each stage's devices (model_parallel_plan)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--show-schedule", action="store_true")
    p.add_argument("--plot", default=None, help="save the schedule's timeline here (PNG)")
    p.add_argument("--out", default=None, help="write the losses here (JSON)")
    args = p.parse_args(argv)
    mesh = None
    if fs.distributed.in_launcher():
        fs.distributed.init()
    else:
        mesh = args.stages * args.dp
    rank = fs.distributed.rank()
    n = fs.distributed.world_size() if mesh is None else mesh
    dp = n // args.stages
    last = rank // dp == args.stages - 1 or mesh is not None
    chunks = args.stages * (2 if args.interleave else 1)
    plan = model_parallel_plan(args.model, chunks, dp) if args.model_parallel else None
    # in a job each process passes its data-parallel slice of every batch
    losses, state, ap = train(args.steps, args.model, args.stages, args.micro_batches,
                              args.scheduler, args.interleave, mesh=mesh,
                              log_every=args.log_every if last else 0,
                              part=None if mesh is not None else (rank % dp, dp), plan=plan)
    if rank == 0 and (args.show_schedule or args.plot):
        timeline = ap.pipeline_schedule().timeline()
        if args.show_schedule:
            from rich.console import Console

            Console().print(timeline.render())
        if args.plot:
            timeline.plot(args.plot)
    if args.out:
        with open(f"{args.out}.rank{rank}.json", "w") as fh:
            json.dump(losses, fh)


if __name__ == "__main__":
    main()
