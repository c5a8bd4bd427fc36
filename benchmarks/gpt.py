"""The GPT decoder of examples/train_gpt.py under every parallelism combination: memory
per device and step time.

``gpt_parallel``: for each combination of data (dp), tensor (tp), pipeline (pp) and
sequence (sp, over the tp devices) parallelism on a 4- or 8-device virtual mesh, the
per-device bytes of parameters, gradients, optimizer state and activations, measured
from what fshard runs, next to the formula of Megatron-LM's layout; and the step's
time (float32, Adam, 4 layers, batch 16, sequence 16), against data parallelism on
the same number of devices and next to an analytic prediction for 8 accelerators.

What "measured" means here (``measure_memory``):

- parameters, gradients, optimizer state without a pipeline: ``ap.memory_report``,
  the bytes each device holds in the step's plan;
- with a pipeline: fshard keeps the whole train state on every device and gives every
  device every gradient (docs/pipeline.md, "How a step runs"), so the whole model;
- activations without a pipeline: the forward values the backward pass reads (the
  residuals), summed over the per-device program of the step (``residual_bytes``:
  values the loss depends on that a computation outside the forward reads);
- activations with a pipeline: the stage inputs a device keeps between a micro-batch's
  forward and its backward (its peak, counted by the pipeline while it runs), plus the
  residuals of one stage on one micro-batch, which exist while that backward
  recomputes (the non-pipelined run's residuals, times ``1 / (pp M)``: a stage's layers
  on a micro-batch).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

import fshard as fs
from benchmarks.harness import Result, Row, benchmark
from fshard.sharding.cost import BACKEND_RATES

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "examples"))
import train_gpt as gpt  # noqa: E402

#: (label, devices, build() arguments)
COMBOS = [
    ("1 device", 1, dict()),
    ("dp=4", 4, dict(dp=4)),
    ("tp=4", 4, dict(tp=4)),
    ("tp=4 + sp", 4, dict(tp=4, sp=True)),
    ("pp=4", 4, dict(pp=4)),
    ("dp=2 x tp=2 + sp", 4, dict(dp=2, tp=2, sp=True)),
    ("dp=8", 8, dict(dp=8)),
    ("dp=4 x pp=2", 8, dict(dp=4, pp=2)),
    ("dp=2 x tp=4 + sp", 8, dict(dp=2, tp=4, sp=True)),
    ("dp=2 x tp=2 x pp=2", 8, dict(dp=2, tp=2, pp=2)),
    ("dp=2 x tp=2 x pp=2 + sp", 8, dict(dp=2, tp=2, pp=2, sp=True)),
]

F32 = 4


def _batch():
    tokens, targets = next(gpt.corpus(1))
    return tokens, targets, np.ones(len(tokens), np.float32)


def residual_bytes(program) -> int:
    """Bytes of the forward values that the backward pass reads, in a per-device step
    program (shapes are per device): the values the loss (the program's last output)
    depends on, computed by an equation, and read by an equation outside that set."""
    producer = {}
    for i, eq in enumerate(program.equations):
        for v in eq.outputs:
            producer[v] = i
    forward, todo = set(), [program.outputs[-1]]
    while todo:
        v = todo.pop()
        i = producer.get(v)
        if i is None or i in forward:
            continue
        forward.add(i)
        todo.extend(u for u in program.equations[i].inputs if hasattr(u, "aval"))
    read = set()
    for i, eq in enumerate(program.equations):
        if i not in forward:
            read.update(u for u in eq.inputs if u in producer and producer[u] in forward)
    return sum(int(np.prod(v.aval.shape)) * np.dtype(_np_dtype(v.aval.dtype)).itemsize
               for v in read)


def _np_dtype(dtype):
    from fshard import dtypes

    return dtypes.to_numpy(dtype)


def _tree_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.asnumpy().dtype).itemsize
               for x in fs.tree.leaves(tree) if hasattr(x, "shape"))


def formula(cfg: dict, layers: int = gpt.LAYERS) -> dict:
    """Megatron-LM's per-device bytes for the combination (float32, Adam): each layer's
    matrices split over tp, its norms whole, ``layers / pp`` layers per device; the
    embedding (tied to the head) split over tp by vocabulary, held by the first and the
    last stage; gradients as the parameters; Adam's two moments twice them.
    Activations: the one-device residuals ``A1`` divided by ``dp * tp * pp`` with
    sequence parallelism (Megatron splits every activation of a layer over tp), and by
    ``dp * pp`` only for the share kept whole without it (``replicated_share``); a
    pipeline (1F1B) holds ``pp`` micro-batches of ``1 / M`` of the batch on its first
    stage, which ``1 / pp`` of the layers cancels."""
    dp, tp, pp = cfg.get("dp", 1), cfg.get("tp", 1), cfg.get("pp", 1)
    d, f, v = gpt.DIM, gpt.FF, gpt.VOCAB
    per_layer = (4 * d * d + 3 * d * f) / tp + 2 * d
    params = (v * d / tp + per_layer * layers / pp + (d if pp == 1 else 0)) * F32
    return {"params": params, "grads": params, "optimizer_state": 2 * params}


def measure_memory(label: str, cfg: dict, residuals_1: float | None = None,
                   tp_residuals: dict | None = None) -> dict:
    """Per-device bytes of the combination (see the module docstring), for device 0."""
    ap = gpt.build(**cfg)
    state = ap.init(gpt.init_params())
    batch = _batch()
    pp = cfg.get("pp", 1)
    if pp == 1:
        report = ap.memory_report(state, *batch)
        part = ap.partitioned(state, *batch)
        report["activations"] = residual_bytes(part.program)
        report["collectives"] = len(part.collectives())
        return report
    state, _ = ap(state, *batch)  # the plan and the compiled pieces
    step = next(iter(ap._pipeline._steps.values()))
    step.profile = True          # run as pieces: the stage inputs kept are counted
    ap(state, *batch)
    kept = max(s["peak_saved_bytes"] for s in step.stats)
    whole = _tree_bytes(state.params)
    same = dict(cfg)
    same.pop("pp")
    same["dp"] = same.get("dp", 1)
    key = (same.get("dp", 1), same.get("tp", 1), same.get("sp", False))
    base = (tp_residuals or {}).get(key)
    stage = 0.0 if base is None else base / (pp * step.M)
    return {"params": whole, "grads": whole, "optimizer_state": _tree_bytes(state.opt_state),
            "activations": kept + stage, "kept_inputs": kept}


def step_time(cfg: dict, runs: int) -> dict:
    """Median and min seconds of a training step (after two warm-up steps), each
    waiting for its loss."""
    ap = gpt.build(**cfg)
    state = ap.init(gpt.init_params())
    batch = _batch()
    for _ in range(2):
        state, loss = ap(state, *batch)
        float(loss)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        state, loss = ap(state, *batch)
        float(loss)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "runs": runs}


def predicted_step(cfg: dict, *, batch: int = gpt.BATCH, seq: int = gpt.SEQ,
                   dim: int = gpt.DIM, ff: int = gpt.FF, vocab: int = gpt.VOCAB,
                   layers: int = gpt.LAYERS, rates: dict | None = None) -> float:
    """Seconds per step on accelerators with ``rates`` (fshard's nominal GPU row of
    ``BACKEND_RATES``: 1e13 flops/s, 20 µs and 50 GB/s per collective), float32:
    compute ``3 x`` the forward flops split over every device, stretched by the
    pipeline's bubble ``(M + pp - 1) / M``; per layer and micro-batch four tensor-
    parallel all-reduces of the activations (two forward, two backward; sequence
    parallelism moves the same bytes); one boundary transfer per micro-batch each way;
    one all-reduce of the gradients over dp."""
    r = rates or BACKEND_RATES["GPU"]
    dp, tp, pp = cfg.get("dp", 1), cfg.get("tp", 1), cfg.get("pp", 1)
    m = cfg.get("micro_batches") or pp
    lat, bw = r["all_reduce"]
    flops_fwd = batch * seq * (layers * (2 * (4 * dim * dim + 3 * dim * ff)
                                         + 4 * seq * dim) + 2 * vocab * dim)
    compute = 3 * flops_fwd / (dp * tp * pp) / r["flops_per_s"] * (m + pp - 1) / m
    act = batch // dp // m * seq * dim * F32

    def all_reduce(nbytes, n):
        return 0.0 if n == 1 else lat + 2 * (n - 1) / n * nbytes / bw

    tp_comm = 4 * (layers // pp) * m * all_reduce(act, tp)
    pp_comm = 0.0 if pp == 1 else 2 * (m + pp - 1) * (lat + act / tp / bw)
    grads = formula(cfg, layers)["grads"]
    return compute + tp_comm + pp_comm + all_reduce(grads, dp)


#: a GPT-2-XL-sized model (1.5B parameters) for the prediction at scale
LARGE = dict(batch=64, seq=1024, dim=1600, ff=6400, vocab=50304, layers=48)


def _uptime() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


@benchmark("gpt_parallel",
           title="GPT decoder: memory per device and step time per parallelism combination")
def gpt_parallel(ctx):
    runs = ctx.runs(7, 2)
    load_before = _uptime()
    rows, notes, memory = [], [], {}
    residuals: dict = {}
    for label, n, cfg in COMBOS:
        if cfg.get("pp", 1) == 1:
            mem = measure_memory(label, cfg)
            residuals[(cfg.get("dp", 1), cfg.get("tp", 1), cfg.get("sp", False))] = \
                mem["activations"] * cfg.get("dp", 1)
        else:
            mem = None
        memory[label] = mem
    for label, n, cfg in COMBOS:
        if memory[label] is None:
            memory[label] = measure_memory(label, cfg, tp_residuals=residuals)
    a1 = memory["1 device"]["activations"]
    for label, n, cfg in COMBOS:
        mem, form = memory[label], formula(cfg)
        dp, tp, pp = cfg.get("dp", 1), cfg.get("tp", 1), cfg.get("pp", 1)
        notes.append(
            f"memory {label}: " + ", ".join(
                f"{k} {mem[k] / 1024:.1f} KiB (formula {form[k] / 1024:.1f})"
                for k in ("params", "grads", "optimizer_state"))
            + f", activations {mem['activations'] / 1024:.1f} KiB (ideal "
            f"A1/(dp tp pp) {a1 / (dp * tp * pp) / 1024:.1f})"
            + (f", kept stage inputs {mem['kept_inputs'] / 1024:.1f} KiB"
               if "kept_inputs" in mem else "")
            + (f", {mem['collectives']} collectives" if "collectives" in mem else ""))
        t = step_time(cfg, runs)
        pred = predicted_step(cfg) * 1e6
        big = predicted_step(cfg, **LARGE) * 1e3
        rows.append(Row("fshard", f"{label} ({n} devices)", t["median_s"], t["min_s"],
                        t["runs"], f"predicted on {n} GPUs: {pred:.0f} µs; "
                        f"1.5B model: {big:.0f} ms"))
    notes.append(f"load average before: {load_before}; after: {_uptime()}")
    return Result(rows, baseline="dp=8 (8 devices)",
                  target="memory: the formula where fshard's layout is Megatron's; "
                         "time: measured on the shared CPU, predicted for 8 GPUs",
                  notes=notes)
