"""A GPT-style decoder (Llama blocks stacked, a token embedding and an output head tied
to it) trained with ``fs.AutoParallel``: data (dp), tensor (tp), pipeline (pp) and
Megatron sequence parallelism (sp, over the tp devices), with recomputation
(``fs.remat``) and float16 compute with dynamic loss scaling.

    python examples/train_gpt.py                                  # one device, float32
    python examples/train_gpt.py --dp 2 --tp 2 --pp 2 --sp --amp --remat --plot gpt.png
    python -m fshard.launch -n 4 examples/train_gpt.py --dp 2 --tp 2 --sp --amp

On a virtual mesh the mesh has ``dp * tp * pp`` devices; under the launcher every
process is one device (the product must be the job's size). The task is next-token
prediction on a fixed synthetic corpus (a noisy repeating sequence), so the loss falls
from about ``log(vocab)``. ``--plot PATH`` saves the loss curve; ``--out PATH`` writes
the losses as JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import fshard as fs

VOCAB, DIM, HEADS, FF, SEQ, LAYERS = 64, 32, 4, 64, 16, 4
BATCH = 16


def init_params(layers: int = LAYERS, seed: int = 0, vocab: int = VOCAB, dim: int = DIM,
                ff: int = FF) -> dict:
    """The decoder's parameters (float32 NumPy arrays), by name: ``embed`` (also the
    output head), ``layer{i}.*`` (the Llama block of docs/models.md) and ``final_norm``.
    The residual branches' output projections are scaled by ``1 / sqrt(2 layers)``
    (GPT-2's rule), so the stack starts near the identity."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[0])).astype(np.float32)

    res = 1 / np.sqrt(2 * layers)
    out = {"embed": (rng.standard_normal((vocab, dim)) * 0.2).astype(np.float32)}
    for i in range(layers):
        out.update({f"layer{i}.attn_norm": np.ones(dim, np.float32),
                    f"layer{i}.wq": w(dim, dim), f"layer{i}.wk": w(dim, dim),
                    f"layer{i}.wv": w(dim, dim), f"layer{i}.wo": w(dim, dim, scale=res),
                    f"layer{i}.mlp_norm": np.ones(dim, np.float32),
                    f"layer{i}.w1": w(dim, ff), f"layer{i}.w3": w(dim, ff),
                    f"layer{i}.w2": w(ff, dim, scale=res)})
    out["final_norm"] = np.ones(dim, np.float32)
    return out


def corpus(steps: int, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB,
           seed: int = 1):
    """``steps`` batches of (tokens, targets), int32 ``[batch, seq]``: windows of a
    period-11 sequence with 10% of the tokens replaced at random; the targets are the
    next tokens."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab, 11)
    for _ in range(steps):
        start = rng.integers(0, 11, batch)
        idx = (start[:, None] + np.arange(seq + 1)[None]) % 11
        toks = base[idx]
        noise = rng.random(toks.shape) < 0.1
        toks = np.where(noise, rng.integers(0, vocab, toks.shape), toks).astype(np.int32)
        yield toks[:, :-1], toks[:, 1:]


def _rms_norm(x, g):
    return x * fs.ops.rsqrt(fs.ops.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _rotate_half(x):
    half = x.shape[-1] // 2
    return fs.ops.concat((-x[..., half:], x[..., :half]), -1)


def _rope(seq: int, head_dim: int):
    inv = 1.0 / (10000 ** (np.arange(0, head_dim, 2) / head_dim))
    angles = np.outer(np.arange(seq), inv)
    angles = np.concatenate([angles, angles], -1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def block(p: dict, x, heads: int = HEADS, sp=None):
    """The Llama block of docs/models.md on ``x`` ``[batch, seq, dim]``; ``p`` holds one
    layer's weights without their prefix. ``sp`` (split counts of ``x``, e.g.
    ``(dp, tp, 1)``) keeps the norms' inputs and outputs split over the sequence:
    Megatron's sequence parallelism, the all-gather before the column-parallel matmuls
    and the reduce-scatter after the row-parallel ones are then propagation's."""
    b, s, d = x.shape
    hd = d // heads
    cos, sin = _rope(s, hd)
    mask = np.triu(np.ones((s, s), bool), 1)

    def seq_split(t):
        return t if sp is None else fs.with_sharding_constraint(t, sp)

    def split_heads(t):
        return fs.ops.transpose(fs.ops.reshape(t, (b, s, heads, hd)), (0, 2, 1, 3))

    h = seq_split(_rms_norm(seq_split(x), p["attn_norm"]))
    q, k, v = (split_heads(fs.ops.matmul(h, p[n])) for n in ("wq", "wk", "wv"))
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    scores = fs.ops.matmul(q, fs.ops.swapaxes(k, -1, -2)) * float(1 / np.sqrt(hd))
    att = fs.ops.matmul(fs.ops.softmax(fs.ops.masked_fill(scores, mask, -3e4), -1), v)
    att = fs.ops.reshape(fs.ops.transpose(att, (0, 2, 1, 3)), (b, s, d))
    x = seq_split(x + fs.ops.matmul(att, p["wo"]))
    h = seq_split(_rms_norm(x, p["mlp_norm"]))
    up = fs.ops.silu(fs.ops.matmul(h, p["w1"])) * fs.ops.matmul(h, p["w3"])
    return seq_split(x + fs.ops.matmul(up, p["w2"]))


def make_loss(layers: int = LAYERS, stages: int = 1, remat: bool = False, sp=None,
              amp: bool = False, heads: int = HEADS):
    """``loss(params, tokens, targets, scale)``: the mean next-token cross entropy times
    ``scale`` (a float32 array of one row per example, every entry the loss scale: it
    is split into micro-batches with the batch, and the loss is a mean over the
    examples, which the pipeline combines exactly). ``stages`` > 1 cuts the stack into
    that many pipeline stages of ``layers / stages`` blocks; the output head is the
    embedding (tied), which the first stage hands to the last through the stage
    markers. ``remat`` recomputes each block in the backward pass. ``amp`` runs the
    model under ``fs.amp.autocast`` (O2, float16); the scaling and the mean stay in
    float32 (a float16 sum of scaled losses would overflow)."""
    if layers % stages:
        raise ValueError(f"make_loss: layers={layers} must be a multiple of "
                         f"stages={stages}")
    per_stage = layers // stages

    def one_block(p, x):
        return block(p, x, heads, sp)

    run_block = fs.remat(one_block) if remat else one_block

    def per_example(params, tokens, targets):
        table = params["embed"]
        x = fs.ops.gather(table, tokens, 0)
        for i in range(layers):
            if i and i % per_stage == 0:
                x, table = fs.pipeline_split((x, table))
            p = {k.split(".", 1)[1]: v for k, v in params.items()
                 if k.startswith(f"layer{i}.")}
            x = run_block(p, x)
        h = _rms_norm(x, params["final_norm"])
        logits = fs.ops.matmul(h, fs.ops.swapaxes(table, 0, 1))
        logp = fs.ops.log_softmax(logits, -1)
        picked = fs.ops.take_along_axis(logp, fs.ops.expand_dims(targets, -1), -1)
        return -fs.ops.mean(picked, (1, 2))

    if amp:
        per_example = fs.amp.autocast(per_example, fs.amp.policy("O2"))

    def loss(params, tokens, targets, scale):
        return fs.ops.mean(per_example(params, tokens, targets) * scale, 0)

    return loss


def megatron_plan(layers: int, tp: int) -> dict:
    """Megatron's tensor parallelism over ``tp`` devices: q, k, v and the MLP's gate and
    up projections split by columns (whole heads, whole hidden units per device), the
    two output projections by rows. The embedding stays whole."""
    plan = {}
    for i in range(layers):
        for n in ("wq", "wk", "wv", "w1", "w3"):
            plan[f"layer{i}.{n}"] = (1, tp)
        for n in ("wo", "w2"):
            plan[f"layer{i}.{n}"] = (tp, 1)
    return plan


def build(dp: int = 1, tp: int = 1, pp: int = 1, sp: bool = False, amp: bool = False,
          remat: bool = False, layers: int = LAYERS, micro_batches: int | None = None,
          lr: float = 3e-3, initial_scale: float = 2.0 ** 12, mesh=None):
    """An ``fs.AutoParallel`` training the decoder on ``dp * tp * pp`` devices (or
    ``mesh``). With ``amp`` the loss runs under ``fs.amp.autocast`` (O2, float16) and
    the optimizer is ``fs.amp.loss_scaled(adam, DynamicLossScale(initial_scale))``;
    step it with :func:`step`."""
    if sp and tp == 1:
        raise ValueError("build: sp=True splits the sequence over the tp devices; "
                         "give tp > 1")
    n = dp * tp * pp
    # inside a stage the devices are (dp, tp), row-major: a weight split (1, tp) is
    # replicated over dp, the activations (dp, tp, 1) split the batch and the sequence
    loss = make_loss(layers, pp, remat, (dp, tp, 1) if sp else None, amp)
    if amp:
        opt = fs.amp.loss_scaled(fs.optim.adam(lr),
                                 fs.amp.DynamicLossScale(initial_scale))
    else:
        opt = fs.optim.adam(lr)
    ap = fs.AutoParallel(loss, opt, mesh=mesh if mesh is not None else n)
    plan = megatron_plan(layers, tp) if tp > 1 else {}
    if plan:
        ap.parameter_plan(plan)
    if pp > 1:
        # every process passes the whole batch (in a job; each stage's devices take
        # their rows of each micro-batch); every stage returns the loss
        ap.dataset_strategy("full_batch")
        ap.pipeline(stages=pp, micro_batches=micro_batches or pp, output_broadcast=True)
    elif n > 1:
        # the rows over dp only (the tp devices of a row block hold the same rows)
        ap.dataset_strategy(((dp, 1), (dp, 1), (dp,)))
    return ap


def step(ap, state, tokens, targets):
    """One training step; returns the new state and the (unscaled) float32 loss."""
    ls = getattr(state.opt_state, "loss_scale", None)
    scale = 1.0 if ls is None else float(ls.scale)
    rows = np.full(tokens.shape[0], scale, np.float32)
    state, loss = ap(state, tokens, targets, rows)
    return state, float(loss) / scale


def train(steps: int = 20, progress: bool = False, **config):
    """Train ``steps`` steps from the same initial parameters; the list of losses and
    the number of skipped (non-finite) steps."""
    ap = build(**config)
    state = ap.init(init_params(config.get("layers", LAYERS)))
    losses = []
    bar = task = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task("training", total=steps)
    try:
        for tokens, targets in corpus(steps):
            state, loss = step(ap, state, tokens, targets)
            losses.append(loss)
            if bar is not None:
                bar.update(task, advance=1, description=f"loss {loss:.4f}")
    finally:
        if bar is not None:
            bar.stop()
    ls = getattr(state.opt_state, "loss_scale", None)
    return losses, (0 if ls is None else int(ls.skipped))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism over tp")
    parser.add_argument("--amp", action="store_true", help="float16 + loss scaling")
    parser.add_argument("--remat", action="store_true", help="recompute every block")
    parser.add_argument("--micro-batches", type=int, default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--plot", default=None, help="save the loss curve here")
    parser.add_argument("--out", default=None, help="write the losses here (JSON)")
    args = parser.parse_args(argv)
    if fs.distributed.in_launcher():
        fs.distributed.init()  # one device per process: the job is the mesh
    first = fs.distributed.rank() == 0
    losses, skipped = train(args.steps, progress=first, dp=args.dp, tp=args.tp,
                            pp=args.pp, sp=args.sp, amp=args.amp, remat=args.remat,
                            micro_batches=args.micro_batches)
    if not first:
        return
    print(f"dp={args.dp} tp={args.tp} pp={args.pp} sp={args.sp} amp={args.amp} "
          f"remat={args.remat}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"{skipped} skipped steps")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "skipped": skipped}, f)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(losses) + 1), losses)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"GPT, dp={args.dp} tp={args.tp} pp={args.pp}"
                     + (" sp" if args.sp else "") + (" float16" if args.amp else ""))
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"loss plot: {args.plot}")


if __name__ == "__main__":
    main()
