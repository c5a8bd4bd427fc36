"""The GPT decoder of examples/train_gpt.py under every parallelism combination: memory
per device and step time.

``gpt_parallel``: for each combination of data (dp), tensor (tp), pipeline (pp) and
sequence (sp, over the tp devices) parallelism on a 4- or 8-device virtual mesh, the
per-device bytes of parameters, gradients, optimizer state and activations, measured
from what fshard runs, next to the formula of Megatron-LM's layout
(``measure_memory``, 4 layers), and an analytic prediction of the step on 8
accelerators (``predicted_step``). The benchmark itself (``TIMED``, a 2-layer
decoder) times each combination's step interleaved with the single-device
``fs.jit`` step and MindSpore's GRAPH-mode ``TrainOneStepCell`` (float32, Adam,
batch 16, sequence 16), with its first call, collectives and per-device bytes; on a
virtual mesh that is the emulation's overhead, not a speedup.

``gpt_jobs``: the same 2-layer decoder in real 4-process jobs (``fshard.launch``, this
module run as each rank: ``job_worker``), for every combination that fits 4 processes
(``JOB_LAUNCHES``), each rank's steps timed after warm-up and its losses checked
against one process's ``fs.jit`` step, which is the baseline. Four processes on two
cores show the job's cost, not a speedup.

What "measured" means here (``measure_memory``):

- parameters, gradients, optimizer state: ``ap.memory_report``, the bytes each device
  holds in the step's plan; with a pipeline whose update splits by stage (Adam's does)
  a device's own stage's state, the most any stage holds, in its tensor-parallel
  blocks on a stage with tp (docs/pipeline.md, "The optimizer update, stage by
  stage");
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

import contextlib
import os
import signal
import statistics
import sys
import time

import mindspore as ms
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


def formula(cfg: dict, layers: int = gpt.LAYERS, dim: int = gpt.DIM, ff: int = gpt.FF,
            vocab: int = gpt.VOCAB) -> dict:
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
    d, f, v = dim, ff, vocab
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
    report = ap.memory_report(state, *batch)
    same = dict(cfg)
    same.pop("pp")
    same["dp"] = same.get("dp", 1)
    key = (same.get("dp", 1), same.get("tp", 1), same.get("sp", False))
    base = (tp_residuals or {}).get(key)
    stage = 0.0 if base is None else base / (pp * step.M)
    return {"params": report["params"], "grads": report["grads"],
            "optimizer_state": report["optimizer_state"], "activations": kept + stage,
            "kept_inputs": kept, "update": report["update"]}


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
                   layers: int = gpt.LAYERS, rates: dict | None = None,
                   zero: str | None = None) -> float:
    """Seconds per step on accelerators with ``rates`` (fshard's nominal GPU row of
    ``BACKEND_RATES``: 1e13 flops/s, 20 µs and 50 GB/s per collective), float32:
    compute ``3 x`` the forward flops split over every device, stretched by the
    pipeline's bubble ``(M + pp - 1) / M``; per layer and micro-batch four tensor-
    parallel all-reduces of the activations (two forward, two backward; sequence
    parallelism moves the same bytes); one boundary transfer per micro-batch each way;
    one all-reduce of the gradients over dp. ZeRO (``zero``, fshard's ``hsdp`` levels)
    moves more bytes over dp, not fewer: level1 all-reduces the gradients whole and
    all-gathers the updated parameters; level2 reduce-scatters the gradients instead
    (with the all-gather, one all-reduce's bytes); level3 all-gathers the parameters
    for the forward and again for the backward, and reduce-scatters the gradients. The
    update itself (not counted) is split over dp."""
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
    grads = formula(cfg, layers, dim, ff, vocab)["grads"]

    def half(nbytes, n):  # a reduce-scatter or an all-gather: half an all-reduce's bytes
        return 0.0 if n == 1 else lat + (n - 1) / n * nbytes / bw

    dp_comm = {None: all_reduce(grads, dp),
               "level1": all_reduce(grads, dp) + half(grads, dp),
               "level2": 2 * half(grads, dp),
               "level3": 3 * half(grads, dp)}[zero]
    return compute + tp_comm + pp_comm + dp_comm


#: a GPT-2-XL-sized model (1.5B parameters) for the prediction at scale
LARGE = dict(batch=64, seq=1024, dim=1600, ff=6400, vocab=50304, layers=48)


def _uptime() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


#: the combinations timed (a 2-layer decoder, so that most first calls stay within the
#: 300 s limit on a loaded 2-core machine; pp is at most 2): (label, devices, build() arguments,
#: ZeRO level or None)
TIMED = [
    ("1 device", 1, dict(), None),
    ("dp=4", 4, dict(dp=4), None),
    ("pp=2", 2, dict(pp=2), None),
    ("dp=2 x pp=2", 4, dict(dp=2, pp=2), None),
    ("dp=8", 8, dict(dp=8), None),
    ("tp=4 + sp", 4, dict(tp=4, sp=True), None),
    ("dp=2 x tp=2 + sp", 4, dict(dp=2, tp=2, sp=True), None),
    ("dp=2 x tp=2 x pp=2 + sp", 8, dict(dp=2, tp=2, pp=2, sp=True), None),
    ("tp=4", 4, dict(tp=4), None),
    ("dp=2 x tp=4 + sp", 8, dict(dp=2, tp=4, sp=True), None),
    # ZeRO's first call is the slowest (minutes on a loaded machine): last
    ("dp=4 + ZeRO-1", 4, dict(dp=4), "level1"),
    ("dp=4 + ZeRO-2", 4, dict(dp=4), "level2"),
    ("dp=4 + ZeRO-3", 4, dict(dp=4), "level3"),
]
TIMED_LAYERS = 2


def _build_timed(cfg: dict, zero: str | None):
    ap = gpt.build(layers=TIMED_LAYERS, **cfg)
    if zero is not None:
        # threshold 0: this model's tensors are a few KB, under MindSpore's 64 KB default
        ap.hsdp(threshold=0, optimizer_level=zero)
    return ap


def _fs_jit_step(layers: int):
    """The single-device step without AutoParallel: ``fs.jit`` of the loss's
    ``fs.value_and_grad`` and ``fs.optim.adam``'s update, one program."""
    loss = gpt.make_loss(layers)
    opt = fs.optim.adam(3e-3)

    @fs.jit
    def step(params, opt_state, tokens, targets, scale):
        value, grads = fs.value_and_grad(loss)(params, tokens, targets, scale)
        updates, opt_state = opt.update(grads, opt_state, params)
        return fs.optim.apply_updates(params, updates), opt_state, value

    params = {k: ms.Tensor(v) for k, v in gpt.init_params(layers).items()}
    holder = {"state": (params, opt.init(params))}

    def run(*batch):
        p, o, value = step(*holder["state"], *batch)
        holder["state"] = (p, o)
        return value

    return run


def _ms_train_cell(layers: int):
    """MindSpore's own GRAPH-mode ``nn.TrainOneStepCell(loss, nn.Adam)`` on the same
    decoder (the same parameters, the same loss), written with ``mindspore.ops``."""
    Parameter, Tensor, nn, ops = ms.Parameter, ms.Tensor, ms.nn, ms.ops

    init = gpt.init_params(layers)
    hd = gpt.DIM // gpt.HEADS
    cos, sin = (Tensor(a) for a in gpt._rope(gpt.SEQ, hd))
    mask = Tensor(np.triu(np.ones((gpt.SEQ, gpt.SEQ), bool), 1))

    def norm(x, g):
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * g

    def rot(x):
        half = x.shape[-1] // 2
        return ops.cat((-x[..., half:], x[..., :half]), axis=-1)

    class GPT(nn.Cell):
        def __init__(self):
            super().__init__()
            self.names = sorted(init)
            self.p = ms.ParameterTuple(
                [Parameter(Tensor(init[k]), name=k.replace(".", "_")) for k in self.names])
            self.idx = {k: i for i, k in enumerate(self.names)}

        def w(self, name):
            return self.p[self.idx[name]]

        def construct(self, tokens, targets, scale):
            table = self.w("embed")
            x = ops.gather(table, tokens, 0)
            b, s, d = x.shape
            for i in range(layers):
                h = norm(x, self.w(f"layer{i}.attn_norm"))
                q, k, v = (ops.matmul(h, self.w(f"layer{i}.{n}")).reshape(
                    b, s, gpt.HEADS, hd).transpose(0, 2, 1, 3) for n in ("wq", "wk", "wv"))
                q = q * cos + rot(q) * sin
                k = k * cos + rot(k) * sin
                sc = ops.matmul(q, k.transpose(0, 1, 3, 2)) * float(1 / np.sqrt(hd))
                att = ops.matmul(ops.softmax(sc.masked_fill(mask, -3e4), axis=-1), v)
                att = att.transpose(0, 2, 1, 3).reshape(b, s, d)
                x = x + ops.matmul(att, self.w(f"layer{i}.wo"))
                h = norm(x, self.w(f"layer{i}.mlp_norm"))
                up = ops.silu(ops.matmul(h, self.w(f"layer{i}.w1"))) * ops.matmul(
                    h, self.w(f"layer{i}.w3"))
                x = x + ops.matmul(up, self.w(f"layer{i}.w2"))
            h = norm(x, self.w("final_norm"))
            logp = ops.log_softmax(ops.matmul(h, table.T), -1)
            picked = ops.gather_elements(logp, 2, targets.expand_dims(-1))
            return (-picked.mean((1, 2)) * scale).mean()

    net = GPT()
    train = nn.TrainOneStepCell(net, nn.Adam(net.trainable_params(), 3e-3))
    train.set_train()
    return train


def _graph_mode_call(train, *batch):
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        return float(train(*batch).asnumpy())
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


class _OverBudget(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise ``_OverBudget`` in this (main) thread after ``seconds``: a combination's
    first call (plan, trace, compile) that takes longer is skipped, not waited for."""
    def fire(signum, frame):
        raise _OverBudget

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _transfer_rounds(ap) -> int:
    """Transfer rounds (activations or cotangents crossing a stage boundary) in one
    step of a pipelined ``ap``'s program order."""
    step = next(iter(ap._pipeline._steps.values()))
    return sum(1 for item in step.order if type(item).__name__ != "Event")


def _collective_kinds(part) -> dict:
    kinds: dict = {}
    for name in part.collectives():
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


def _kib(b) -> str:
    return f"{b / 1024:.1f}"


def _interleaved(runners: dict, max_runs: int, budget_s: float) -> dict:
    """Seconds of each runner's calls, one call of each per round (the machine's load
    falls on all alike), until ``max_runs`` rounds or ``budget_s`` seconds of the
    first runner's calls."""
    times = {k: [] for k in runners}
    while len(times[next(iter(runners))]) < max_runs and \
            sum(times[next(iter(runners))]) < budget_s:
        for k, f in runners.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return times


@benchmark("gpt_parallel",
           title="GPT decoder: step time, collectives and memory per parallelism combination")
def gpt_parallel(ctx):
    """Each combination is built and compiled once (its first call timed: plan, trace
    and compile; skipped past ``compile_budget_s``), then its steps are timed
    interleaved with the single-device ``fs.jit`` step and MindSpore's GRAPH-mode
    ``TrainOneStepCell`` on the same decoder (one step of each per round, so that the
    machine's load falls on the three alike and the ratios are fair while the load
    moves), for ``max_runs`` rounds or ``budget_s`` seconds of the combination's steps.
    Each combination's line is printed as soon as it is measured."""
    max_runs, budget_s = ctx.runs(12, 3), (5.0 if not ctx.quick else 1.0)
    compile_budget_s = 300.0
    load_before = _uptime()
    tokens, targets = next(gpt.corpus(1))
    scale = np.ones(len(tokens), np.float32)
    # MindSpore tensors for every runner alike (the conversion is not timed)
    batch = tuple(ms.Tensor(a) for a in (tokens, targets, scale))
    notes = [f"decoder: {TIMED_LAYERS} layers, width {gpt.DIM}, {gpt.HEADS} heads, MLP "
             f"{gpt.FF}, vocabulary {gpt.VOCAB}, batch {gpt.BATCH}, sequence {gpt.SEQ}, "
             f"float32, Adam 3e-3; all devices of a virtual mesh run in this one process"]
    say = lambda msg: print(f"  [gpt_parallel] {msg}", flush=True)  # noqa: E731

    # the single-device references: fs.jit and MindSpore's TrainOneStepCell
    say("fs.jit, 1 device: first call ...")
    t0 = time.perf_counter()
    jit_run = _fs_jit_step(TIMED_LAYERS)
    jit_losses = [float(jit_run(*batch))]
    first_jit = time.perf_counter() - t0
    say("MindSpore TrainOneStepCell, GRAPH mode: first call ...")
    t0 = time.perf_counter()
    cell = _ms_train_cell(TIMED_LAYERS)
    ms_losses = [_graph_mode_call(cell, *batch)]
    first_ms = time.perf_counter() - t0
    for _ in range(2):
        jit_losses.append(float(jit_run(*batch)))
        ms_losses.append(_graph_mode_call(cell, *batch))
    np.testing.assert_allclose(jit_losses, ms_losses, rtol=1e-4)
    notes.append(f"fs.jit and TrainOneStepCell: the same first three losses "
                 f"{np.round(jit_losses, 5).tolist()}")
    refs = {"fs.jit": lambda: float(jit_run(*batch)),
            "ms": lambda: _graph_mode_call(cell, *batch)}
    t = _interleaved(refs, 2 * max_runs, 2 * budget_s)
    rows = [Row("fshard", "fs.jit step (1 device)", statistics.median(t["fs.jit"]),
                min(t["fs.jit"]), len(t["fs.jit"]), f"first call {first_jit:.1f} s"),
            Row("mindspore", "MindSpore TrainOneStepCell, GRAPH (1 device)",
                statistics.median(t["ms"]), min(t["ms"]), len(t["ms"]),
                f"first call {first_ms:.1f} s")]
    say(f"fs.jit {statistics.median(t['fs.jit']) * 1e3:.2f} ms, TrainOneStepCell "
        f"{statistics.median(t['ms']) * 1e3:.2f} ms (medians, interleaved)")

    whole = sum(v.nbytes for v in gpt.init_params(TIMED_LAYERS).values())
    skipped = []
    for label, n, cfg, zero in TIMED:
        say(f"{label} ({n} devices): first call ...")
        t0 = time.perf_counter()
        try:
            with _time_limit(compile_budget_s):
                ap = _build_timed(cfg, zero)
                holder = {"state": ap.init(gpt.init_params(TIMED_LAYERS))}
                holder["state"], loss = ap(holder["state"], *batch)
                loss0 = float(loss)
        except _OverBudget:
            skipped.append(label)
            say(f"{label}: skipped, its first call took over {compile_budget_s:.0f} s")
            continue
        first = time.perf_counter() - t0
        np.testing.assert_allclose(loss0, jit_losses[0], rtol=1e-4)
        rep = ap.memory_report(holder["state"], *batch)
        if cfg.get("pp", 1) == 1:
            kinds = _collective_kinds(ap.partitioned(holder["state"], *batch))
        else:
            kinds = {"stage transfer rounds": _transfer_rounds(ap)}

        def run(ap=ap, holder=holder):
            holder["state"], loss = ap(holder["state"], *batch)
            return float(loss)

        run()  # a second warm-up step (the first after compilation)
        t = _interleaved({"combo": run, **refs}, max_runs, budget_s)
        med = {k: statistics.median(v) for k, v in t.items()}
        form = formula(cfg, TIMED_LAYERS)
        coll = (f"{sum(kinds.values())} collectives ("
                + ", ".join(f"{c} {v}" for c, v in sorted(kinds.items())) + ")")
        note = (f"first call {first:.1f} s; {med['combo'] / med['fs.jit']:.2f}x fs.jit, "
                f"{med['combo'] / med['ms']:.2f}x TrainOneStepCell (same rounds: "
                f"{med['fs.jit'] * 1e3:.2f}, {med['ms'] * 1e3:.2f} ms); {coll}; device 0 "
                f"KiB: params {_kib(rep['params'])}, grads {_kib(rep['grads'])}, Adam "
                f"{_kib(rep['optimizer_state'])} (formula without ZeRO: "
                f"{_kib(form['params'])}, {_kib(form['grads'])}, "
                f"{_kib(form['optimizer_state'])}); load {_uptime()}")
        rows.append(Row("fshard", f"{label} ({n} devices)", med["combo"], min(t["combo"]),
                        len(t["combo"]), note))
        say(f"{label}: median {med['combo'] * 1e3:.2f} ms, min "
            f"{min(t['combo']) * 1e3:.2f} ms; {note}")
        del ap, holder, run
    notes.append(f"steps timed interleaved with the two references, at most {max_runs} "
                 f"rounds or {budget_s:.0f} s of the combination's steps; whole model "
                 f"{_kib(whole)} KiB")
    if skipped:
        notes.append(f"skipped (first call over {compile_budget_s:.0f} s): "
                     + ", ".join(skipped))
    notes.append(f"load average (1, 5, 15 min) before: {load_before}; after: {_uptime()}")
    return Result(rows, baseline="fs.jit step (1 device)",
                  target="overhead of the virtual mesh (one process, 2 cores): the ratio "
                         "to one device's fs.jit step is a cost, not a speedup",
                  notes=notes)


# -- in 4-process jobs ------------------------------------------------------------------

#: the combinations timed in 4-process jobs (one process per device), one launch per
#: group (a launch costs ~16 s of start-up; a group fails alone): (label, build()
#: arguments, ZeRO level or None)
JOB_LAUNCHES = [
    [("dp=4", dict(dp=4), None),
     ("tp=4", dict(tp=4), None),
     ("tp=4 + sp", dict(tp=4, sp=True), None),
     ("dp=2 x tp=2", dict(dp=2, tp=2), None),
     ("dp=2 x tp=2 + sp", dict(dp=2, tp=2, sp=True), None)],
    [("pp=2 x dp=2", dict(pp=2, dp=2), None),
     ("pp=2 x tp=2", dict(pp=2, tp=2), None),
     ("pp=2 x tp=2 + sp", dict(pp=2, tp=2, sp=True), None)],
    [("dp=4 + ZeRO-1", dict(dp=4), "level1"),
     ("dp=4 + ZeRO-2", dict(dp=4), "level2"),
     ("dp=4 + ZeRO-3", dict(dp=4), "level3")],
]
JOB_PROCESSES = 4
#: steps before the timed ones (the first call, then two): their losses are checked
JOB_WARMUP = 3


def _batch_tensors():
    tokens, targets = next(gpt.corpus(1))
    return tuple(ms.Tensor(a) for a in (tokens, targets, np.ones(len(tokens), np.float32)))


def job_worker(out_dir: str, launch: int, runs: int) -> None:
    """One rank of ``gpt_jobs``' job: for each combination of ``JOB_LAUNCHES[launch]``,
    the first call (plan, trace, compile), ``JOB_WARMUP`` losses, then ``runs`` timed
    steps, each waiting for its loss. Every process passes the whole batch (the
    decoder's dataset strategies say which rows each device takes). Writes
    ``rank<k>.json`` after each combination."""
    import json

    fs.distributed.init()
    rank = fs.distributed.rank()
    batch = _batch_tensors()
    results = {}
    for label, cfg, zero in JOB_LAUNCHES[launch]:
        t0 = time.perf_counter()
        ap = _build_timed(cfg, zero)
        state = ap.init(gpt.init_params(TIMED_LAYERS))
        losses, first = [], None
        for _ in range(JOB_WARMUP):
            state, loss = ap(state, *batch)
            losses.append(float(loss))
            first = first if first is not None else time.perf_counter() - t0
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            state, loss = ap(state, *batch)
            float(loss)
            times.append(time.perf_counter() - t0)
        collectives = (len(ap.partitioned(state, *batch).collectives())
                       if cfg.get("pp", 1) == 1 else None)
        results[label] = {"losses": losses, "first_s": first, "times": times,
                          "collectives": collectives}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(results, fh)
        del ap, state


def run_gpt_jobs(runs: int, say=print) -> tuple[dict, list]:
    """``({label: [per-rank results]}, [failure messages])``: one launch per group of
    ``JOB_LAUNCHES``, each rank running ``python -m benchmarks.gpt``."""
    import json
    import tempfile

    from fshard import launch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out, failed = {}, []
    for i, group in enumerate(JOB_LAUNCHES):
        d = tempfile.mkdtemp(prefix="gpt_jobs_")
        say(f"launch {i + 1} of {len(JOB_LAUNCHES)} ({', '.join(g[0] for g in group)}), "
            f"load {_uptime()} ...")
        t0 = time.perf_counter()
        res = launch.run("benchmarks.gpt", JOB_PROCESSES, [d, str(i), str(runs)],
                         timeout=1800, module=True, env={"PYTHONPATH": root})
        say(f"  launch {i + 1}: {'ok' if res.ok else 'FAILED'} in "
            f"{time.perf_counter() - t0:.0f} s, load {_uptime()}")
        if not res.ok:
            failed.append(f"launch {i + 1}: {res.message}")
        ranks = []
        for r in range(JOB_PROCESSES):
            path = os.path.join(d, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as fh:
                    ranks.append(json.load(fh))
        for label, _, _ in group:
            if len(ranks) == JOB_PROCESSES and all(label in r for r in ranks):
                out[label] = [r[label] for r in ranks]
    return out, failed


def _jit_reference(runs: int) -> tuple[list, list]:
    """The one-process references: the unsharded ``fs.jit`` step's first
    ``JOB_WARMUP`` losses and the seconds of ``runs`` steps after them."""
    batch = _batch_tensors()
    run = _fs_jit_step(TIMED_LAYERS)
    losses = [float(run(*batch)) for _ in range(JOB_WARMUP)]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        float(run(*batch))
        times.append(time.perf_counter() - t0)
    return losses, times


@benchmark("gpt_jobs",
           title="GPT decoder in 4-process jobs: step time per parallelism combination")
def gpt_jobs(ctx):
    """Each combination that fits 4 processes trains the 2-layer decoder of
    ``gpt_parallel`` in a real 4-process job (``fshard.launch``, one process per
    device, MindSpore's collectives over TCP): each rank times ``runs`` steps after
    ``JOB_WARMUP`` (median, min; each waits for its loss); the step time of a
    combination is the slowest rank's. Every rank's first ``JOB_WARMUP`` losses are
    checked against one process's unsharded ``fs.jit`` step (float32: rtol 1e-5,
    docs/gpt.md's tolerance), which is timed in this process before and after the
    jobs (the baseline). Four processes share the machine's two cores: a job can
    show the cost of its communication, not a speedup; the analytic prediction for
    accelerators (``predicted_step``) is in each row's note."""
    runs = ctx.runs(20, 4)
    say = lambda msg: print(f"  [gpt_jobs] {msg}", flush=True)  # noqa: E731
    load_before = _uptime()
    ref_losses, before = _jit_reference(runs)
    say(f"fs.jit, 1 process: median {statistics.median(before) * 1e3:.2f} ms, "
        f"losses {np.round(ref_losses, 5).tolist()}")
    jobs, failed = run_gpt_jobs(runs, say)
    _, after = _jit_reference(runs)
    base = before + after
    rows = [Row("fshard", "fs.jit step, 1 process (before and after the jobs)",
                statistics.median(base), min(base), len(base),
                f"before {statistics.median(before) * 1e3:.2f} ms, after "
                f"{statistics.median(after) * 1e3:.2f} ms (medians)")]
    wrong = []
    one = predicted_step({}, layers=TIMED_LAYERS)
    one_large = predicted_step({}, **LARGE)
    for group in JOB_LAUNCHES:
        for label, cfg, zero in group:
            ranks = jobs.get(label)
            if ranks is None:
                continue
            medians = [statistics.median(r["times"]) for r in ranks]
            mins = [min(r["times"]) for r in ranks]
            slow = int(np.argmax(medians))
            diff = max(float(np.max(np.abs(np.asarray(r["losses"]) / ref_losses - 1)))
                       for r in ranks)
            if diff > 1e-5:
                wrong.append(f"{label}: losses {[r['losses'] for r in ranks]} against "
                             f"{ref_losses}")
            coll = ranks[0]["collectives"]
            pred = (
                f"; predicted on {JOB_PROCESSES} accelerators: "
                f"{predicted_step(cfg, layers=TIMED_LAYERS, zero=zero) * 1e6:.0f} µs (1: "
                f"{one * 1e6:.0f}), a 1.5B model {predicted_step(cfg, zero=zero, **LARGE):.1f} s"
                f" (1: {one_large:.1f})")
            note = (f"slowest rank {slow}: medians per rank "
                    f"{', '.join(f'{m * 1e3:.1f}' for m in medians)} ms; "
                    f"{medians[slow] / statistics.median(base):.2f}x fs.jit; first call "
                    f"{max(r['first_s'] for r in ranks):.1f} s; "
                    + (f"{coll} collectives per step; " if coll is not None else
                       "stage transfers + the stages' own collectives; ")
                    + f"losses within {diff:.1e} of fs.jit" + pred)
            rows.append(Row("fshard", f"{label} ({JOB_PROCESSES} processes)",
                            medians[slow], mins[slow], len(ranks[slow]["times"]), note))
            say(f"{label}: median {medians[slow] * 1e3:.2f} ms, min "
                f"{mins[slow] * 1e3:.2f} ms; {note}")
    notes = [f"decoder: {TIMED_LAYERS} layers (gpt_parallel's), float32, Adam; every "
             f"rank passes the whole batch; {runs} timed steps per rank after "
             f"{JOB_WARMUP}",
             f"load average (1, 5, 15 min) before: {load_before}; after: {_uptime()}"]
    notes += [f"failed: {m}" for m in failed]
    if wrong:
        raise AssertionError("gpt_jobs: losses differ from the fs.jit step's: "
                             + "; ".join(wrong))
    return Result(rows, baseline=rows[0].label,
                  target=f"{JOB_PROCESSES} processes on 2 shared cores: the ratio to one "
                         "process's fs.jit step is a cost, not a speedup",
                  notes=notes)


if __name__ == "__main__":  # a rank of gpt_jobs' job
    job_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
