"""Planning: how long ``fs.AutoParallel`` takes to plan a step, and what the plan runs.

For each program and parallel mode (``semi_auto``, ``sharding_propagation``,
``recursive_programming``), on 8 virtual devices with ``dataset_strategy
("data_parallel")`` and Adam:

- **planning**: the CPU time of ``ap.partitioned(state, *batch)`` on a fresh
  ``AutoParallel`` (tracing the step, planning every equation, partitioning; not
  MindSpore's compile), and its wall time (which the machine's load inflates);
- **predicted**: the plan's step time by the cost model (``ap.explain``);
- **measured**: the compiled step's median time (50 calls first, then 16 rounds of 10),
  every variant timed interleaved with
  the hand-written data-parallel step (``fs.jit`` of ``fs.shard_map`` of the local
  ``value_and_grad`` with ``fs.pmean``, plus the same update), the ratio's baseline;
- the collectives of the per-device program.

Then predicted against measured step time for 15 plans (``benchmarks/prediction.py``:
these steps, ``fs.shard`` hand plans, a searched 10-layer MLP, MindSpore's documented
MatMul strategy), with the load average; run ``fs.sharding.calibrate()`` first for
predictions in this machine's rates.

Two hand-written steps are timed with them: the data-parallel one, and the same step
unsharded (``fs.jit``), the plan in which every device computes everything.

Programs: the MLP 64-512-512-10 on a batch of 256; the digits MLP 64-128-10 of
examples/train_autoparallel.py on a batch of 64 (scikit-learn's digits); a wide MLP
256-2048-2048-10 on a batch of 16 (data parallelism is not its fastest plan); with an
MSE loss (``more_programs``), the Megatron MLP 512-2048-512 on a batch of 32, the
Llama-style block of ``benchmarks/transformers.py`` on a batch of 8 and an MLP of 100
64x64 layers on a batch of 256, the first two also timed with Megatron's hand-written
plan (``semi_auto`` with its ``parameter_plan``, the batch whole); and, planning
only, ``fs.shard(fs.value_and_grad(loss), search=True)`` of MLPs of 10, 100 and 1,000
64x64 layers (the growth with the program's length).

``python -m benchmarks --only planning [--quick]``.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np

from benchmarks.harness import Result, Row, benchmark

MODES = ("semi_auto", "sharding_propagation", "recursive_programming")
DEVICES = 8


def _params(sizes, seed=0):
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        params[f"b{i}"] = np.zeros(b, np.float32)
    return params


def _mlp(p, x):
    """The MLP of ``p`` (``w{i}``, ``b{i}``; ReLU between layers): its logits."""
    import fshard as fs

    n = len(p) // 2
    h = x
    for i in range(n):
        h = h @ p[f"w{i}"] + p[f"b{i}"]
        if i < n - 1:
            h = fs.ops.relu(h)
    return h


def _loss(p, x, y):
    import fshard as fs

    return fs.ops.softmax_cross_entropy(_mlp(p, x), y)


def programs():
    """``{name: (params, x, labels)}``."""
    rng = np.random.default_rng(1)
    mlp = (_params((64, 512, 512, 10)), rng.standard_normal((256, 64)).astype(np.float32),
           rng.integers(0, 10, 256).astype(np.int32))
    from sklearn.datasets import load_digits

    d = load_digits()
    digits = (_params((64, 128, 10)), (d.data[:64] / 16.0).astype(np.float32),
              d.target[:64].astype(np.int32))
    # Wide layers and a small batch: the weights' gradients and updates cost more than
    # the rows' compute, so data parallelism is not the fastest plan on a virtual mesh.
    wide = (_params((256, 2048, 2048, 10)), rng.standard_normal((16, 256)).astype(np.float32),
            rng.integers(0, 10, 16).astype(np.int32))
    return {"mlp 64-512-512-10": mlp, "digits 64-128-10": digits,
            "wide 256-2048-2048-10": wide}


def _mse(p, x, y):
    return ((_mlp(p, x) - y) ** 2).mean()


def _deep(p, x, y):
    import fshard as fs

    h = x
    for i in range(len(p)):
        h = fs.ops.relu(h @ p[f"w{i:03d}"])
    return ((h - y) ** 2).mean()


def more_programs():
    """``{name: (loss, params, x, y, Megatron's parameter_plan or None)}``: the Megatron
    MLP 512-2048-512 on a batch of 32, the Llama-style block of
    ``benchmarks/transformers.py`` on a batch of 8, and an MLP of 100 64x64 layers on a
    batch of 256, each with an MSE loss."""
    import fshard as fs
    from benchmarks.transformers import LlamaBlock, MSELoss

    rng = np.random.default_rng(2)
    megatron = (_mse, _params((512, 2048, 512)),
                rng.standard_normal((32, 512)).astype(np.float32),
                rng.standard_normal((32, 512)).astype(np.float32),
                {"w0": (1, DEVICES), "b0": (DEVICES,), "w1": (DEVICES, 1)})
    apply, weights = fs.functional(MSELoss(LlamaBlock()))
    weights = {k: v.asnumpy() for k, v in weights.items()}
    # Megatron's split of the block: the q, k, v and gate projections by columns (the
    # heads), the output and down projections by rows
    columns, rows = ("wq", "wk", "wv", "w1", "w3"), ("wo", "w2")
    llama_plan = {k: (1, DEVICES) if k.split(".")[-1] in columns else (DEVICES, 1)
                  for k in weights if k.split(".")[-1] in columns + rows}
    llama = (apply, weights, rng.standard_normal((8, 64, 128)).astype(np.float32),
             rng.standard_normal((8, 64, 128)).astype(np.float32), llama_plan)
    deep = (_deep, {f"w{i:03d}": (rng.standard_normal((64, 64)) / 8).astype(np.float32)
                    for i in range(100)},
            rng.standard_normal((256, 64)).astype(np.float32),
            rng.standard_normal((256, 64)).astype(np.float32), None)
    return {"Megatron MLP 512-2048-512": megatron, "Llama block": llama,
            "100-layer MLP 64": deep}


def hand_one_device(params, x, labels, opt, loss=_loss):
    """The same step unsharded (``fs.jit`` of ``value_and_grad`` and the update): the
    every-device-computes-everything plan, which a virtual mesh runs once."""
    import mindspore as ms

    import fshard as fs

    vg = fs.value_and_grad(loss)

    def step(p, o, x, labels):
        value, grads = vg(p, x, labels)
        updates, o = opt.update(grads, o, p)
        return fs.optim.apply_updates(p, updates), o, value

    p0 = {k: ms.Tensor(v) for k, v in params.items()}
    return fs.jit(step), (p0, opt.init(p0))


def hand_data_parallel(params, x, labels, opt, devices: int = DEVICES, loss=_loss,
                       gather: bool = False):
    """The hand-written data-parallel step: ``(step, state)``. ``gather``: instead, each
    device's rows all-gathered and the loss and gradients computed whole on every device
    (the plan of a searching mode's whole path in a job, ``search.whole_path``)."""
    import mindspore as ms

    import fshard as fs

    mesh = fs.Mesh((devices,), ("dp",))
    dp = fs.Layout(mesh.shape, mesh.axis_names)

    def local_loss(p, x, labels):
        return fs.pmean(loss(p, x, labels), "dp")

    def rows(a):  # split along the batch, every other dimension whole
        return dp("dp", *["None"] * (np.ndim(a) - 1))

    vg = fs.shard_map(fs.value_and_grad(local_loss),
                      in_strategy=(None, rows(x), rows(labels)),
                      out_strategy=((), None), mesh=mesh)
    if gather:
        # (the gradients outside fs.shard_map: taken inside it, each device would take
        # a share of the loss's seed and multiply its gradients back to the whole)
        rows_of = fs.shard_map(
            lambda *vs: tuple(fs.all_gather(v, "dp", tiled=True) for v in vs),
            in_strategy=(rows(x), rows(labels)), out_strategy=(None, None), mesh=mesh)

        def vg(p, x, labels):
            return fs.value_and_grad(loss)(p, *rows_of(x, labels))

    def step(p, o, x, labels):
        value, grads = vg(p, x, labels)
        updates, o = opt.update(grads, o, p)
        return fs.optim.apply_updates(p, updates), o, value

    jitted = fs.jit(step)
    p0 = {k: ms.Tensor(v) for k, v in params.items()}
    return jitted, (p0, opt.init(p0))


def _collectives(names) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(Counter(names).items())) or "none"


def plan_mode(mode, params, x, labels, loss=_loss, parameter_plan=None):
    """``(ap, state, cpu s, wall s, explanation, collectives)`` of a fresh plan; with
    ``parameter_plan`` the batch is whole (Megatron's plan: only the weights split)."""
    import fshard as fs

    ap = fs.AutoParallel(loss, fs.optim.adam(1e-3), mode, mesh=DEVICES)
    ap.dataset_strategy("full_batch" if parameter_plan else "data_parallel")
    if parameter_plan:
        ap.parameter_plan(parameter_plan)
    state = ap.init(params)
    c0, t0 = time.process_time(), time.perf_counter()
    part = ap.partitioned(state, x, labels)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return ap, state, cpu, wall, ap.explain(state, x, labels), part.collectives()


def deep_planning(layers: int, width: int = 64, rows: int = 256) -> tuple:
    """``(equations, cpu s, collectives)`` of planning a ``layers``-layer MLP's
    ``value_and_grad`` with ``fs.shard(..., search=True)`` on 8 devices."""
    from mindspore import Tensor, ops

    import fshard as fs

    rng = np.random.default_rng(0)
    ws = [Tensor((rng.standard_normal((width, width)) / 8).astype(np.float32))
          for _ in range(layers)]
    x = Tensor(rng.standard_normal((rows, width)).astype(np.float32))

    def loss(ws, x):
        h = x
        for w in ws:
            h = ops.relu(ops.matmul(h, w))
        return h.mean()

    f = fs.shard(fs.value_and_grad(loss), in_strategy=(None, (DEVICES, 1)), mesh=DEVICES,
                 level=2, search=True)
    c0 = time.process_time()
    part = f.partitioned(ws, x)
    return len(part.prop.program.equations), time.process_time() - c0, part.collectives()


def _program_rows(ctx, name, loss, params, x, labels, megatron=None) -> tuple[list, list]:
    """Rows and notes of one program: the hand-written steps and each mode's plan,
    timed interleaved."""
    import fshard as fs

    rows, notes, fns, info = [], [], {}, {}
    step, hstate = hand_data_parallel(params, x, labels, fs.optim.adam(1e-3), loss=loss)
    fns["hand"] = lambda step=step, s=hstate, x=x, y=labels: step(*s, x, y)[2].asnumpy()
    one, ostate = hand_one_device(params, x, labels, fs.optim.adam(1e-3), loss=loss)
    fns["one"] = lambda step=one, s=ostate, x=x, y=labels: step(*s, x, y)[2].asnumpy()
    hands = {"hand": ("hand-written data parallel", "fs.jit(fs.shard_map(value_and_grad)), "
                      "one psum per gradient and the loss's"),
             "one": ("hand-written one-device step",
                     "fs.jit(value_and_grad): every device computes everything")}
    if megatron:
        ap, state, _, _, _, colls = plan_mode("semi_auto", params, x, labels, loss, megatron)
        fns["megatron"] = lambda ap=ap, state=state, x=x, y=labels: ap(state, x, y)[
            1].asnumpy()
        hands["megatron"] = ("hand-written Megatron", "AutoParallel semi_auto with "
                             "Megatron's parameter_plan, the batch whole: "
                             + _collectives(colls))
    for mode in MODES:
        ap, state, cpu, wall, e, colls = plan_mode(mode, params, x, labels, loss)
        info[mode] = (cpu, wall, e, colls)
        fns[mode] = lambda ap=ap, state=state, x=x, y=labels: ap(state, x, y)[1].asnumpy()
    # 50 calls first (past MindSpore's choice of threads for each graph, as
    # benchmarks/prediction.py does), then 16 rounds of 10 calls each: fewer calls
    # after a 3-call warm-up put the same program at 1.0-1.4x itself (2026-11-29)
    t = ctx.compare(fns, runs=ctx.runs(160, 6), rounds=ctx.runs(16, 2),
                    warmup=ctx.runs(50, 3))
    for key, (label, note) in hands.items():
        rows.append(Row("fshard", f"{name}: {label}", t[key]["median_s"], t[key]["min_s"],
                        t[key]["runs"], note))
    best = min(t[k]["median_s"] for k in hands)
    for mode in MODES:
        cpu, wall, e, colls = info[mode]
        ratio = t[mode]["median_s"] / t["hand"]["median_s"]
        note = (f"planning {cpu:.3f} s CPU ({wall:.3f} s wall), predicted "
                f"{e.total_s * 1e3:.2f} ms, {_collectives(colls)}, "
                f"{ratio:.2f}x the hand-written data-parallel step, "
                f"{t[mode]['median_s'] / best:.2f}x the fastest hand-written step")
        rows.append(Row("fshard", f"{name}: {mode}", t[mode]["median_s"],
                        t[mode]["min_s"], t[mode]["runs"], note))
        notes.append(f"{name}: {mode}: {note}")
    return rows, notes


@benchmark("planning", title="AutoParallel's planning time and plans, per mode (8 virtual "
                              "devices, data_parallel batch, Adam)")
def planning(ctx):
    rows, notes = [], []
    for name, (params, x, labels) in programs().items():
        r, n = _program_rows(ctx, name, _loss, params, x, labels)
        rows += r
        notes += n
    for name, (loss, params, x, y, megatron) in more_programs().items():
        r, n = _program_rows(ctx, name, loss, params, x, y, megatron)
        rows += r
        notes += n
    baseline = rows[0].label
    # Predicted against measured step time, 15 plans (benchmarks/prediction.py): with
    # this machine's calibration table when fs.sharding.calibrate() has made one.
    from benchmarks import prediction
    from fshard.sharding.rates import calibrated

    notes.append(f"load average before the predictions: {os.getloadavg()[0]:.1f}; "
                 f"calibrated: {calibrated(DEVICES) is not None}")
    for r in prediction.measure(runs=ctx.runs(10, 2), rounds=ctx.runs(4, 1)):
        notes.append(f"{r['plan']}: predicted {r['predicted_s'] * 1e3:.1f} ms, measured "
                     f"{r['best_s'] * 1e3:.1f} ms (best round; median "
                     f"{r['median_s'] * 1e3:.1f} ms), predicted/median {r['ratio']:.2f}, "
                     f"{r['collectives']}")
    for layers in (10, 100) if ctx.quick else (10, 100, 1000):
        n, cpu, colls = deep_planning(layers)
        notes.append(f"{layers}-layer MLP value_and_grad ({n} equations), fs.shard "
                     f"search=True: planning {cpu:.3f} s CPU, {_collectives(colls)}")
    return Result(rows=rows, baseline=baseline, notes=notes,
                  target="planning <= 0.3 s for the MLPs, <= 1 s for 100 layers, linear "
                         "in the layers; each mode's step <= 1.05x the hand-written one")
