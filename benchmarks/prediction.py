"""Predicted against measured step time, for plans of several programs, modes and hand
plans on 8 virtual devices (part of ``python -m benchmarks --only planning``;
``python -m benchmarks.prediction`` runs it alone and prints the table;
``--calibrate`` calibrates four times during the run; ``--profile`` prints each plan's
kernels as MindSpore's profiler records them).

The prediction is ``explain(...).total_s``: the cost model at level 2 with the rates
``fs.sharding.calibrate()`` measured on this machine (without a table the default
rates, for a multi-process job, price a virtual mesh's step far too low). The
measurement times the compiled step as a training loop runs it: every plan is first
called ``WARMUP_CALLS`` times (past MindSpore's choice of threads for the graph, as the
calibration's programs are), then ``rounds`` rounds, every plan in each round running
untimed for ``WARM_S`` and then timed for ``runs`` calls, each waiting for its result;
``median`` is the median of all calls, ``best`` the least round median. The prediction
is compared with ``median``, the number the calibration keeps too (the median of every
call of its programs): a plan's round medians spread widely (the same program 4.2-8.0
ms a round), the median of every call holds within a few percent between identical
programs. With ``--calibrate`` the rounds are split into four blocks, each after a
calibration, and the prediction is the median of the four prices: this machine's speed
moves 1.5-2x from minute to minute, so a table measured minutes before the steps are
timed prices them at another speed. The load average is recorded next to the numbers.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np

DEVICES = 8
#: Seconds each plan runs untimed before its timed calls, in every round.
WARM_S = 0.2
#: Calls each plan runs untimed before its timed calls, every round, in a job (a count
#: the ranks agree on; about ``WARM_S`` of a 10 ms step).
JOB_WARM_CALLS = 20


def _collectives(names) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(Counter(names).items())) or "none"


def _mlp_params(sizes, seed=0):
    rng = np.random.default_rng(seed)
    p = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        p[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        p[f"b{i}"] = np.zeros(b, np.float32)
    return p


def _mlp_vg(n: int):
    """The MLP 64-512-512-10's ``value_and_grad`` on a batch of 256: ``(rng, vg, (params,
    x, labels), every input replicated, Megatron's split over n)``."""
    import mindspore as ms

    import fshard as fs
    from benchmarks.planning import _loss

    rng = np.random.default_rng(1)
    p = {k: ms.Tensor(v) for k, v in _mlp_params((64, 512, 512, 10)).items()}
    x = ms.Tensor(rng.standard_normal((256, 64)).astype(np.float32))
    y = ms.Tensor(rng.integers(0, 10, 256).astype(np.int32))
    rep = {k: (1,) * v.ndim for k, v in p.items()}
    megatron = dict(rep, w0=(1, n), b0=(n,), w1=(n, 1))
    return rng, fs.value_and_grad(_loss), (p, x, y), rep, megatron


def _shard_plans():
    """``{label: (fs.shard-ed function, args)}``: hand plans and searched plans."""
    import mindspore as ms
    from mindspore import ops

    import fshard as fs

    rng, vg, (p, x, y), rep, megatron = _mlp_vg(DEVICES)
    plans = {
        "MLP vg: data parallel (hand)": (fs.shard(vg, in_strategy=(rep, (DEVICES, 1), (
            DEVICES,)), mesh=DEVICES), (p, x, y)),
        "MLP vg: Megatron column-row (hand)": (fs.shard(vg, in_strategy=(megatron, (1, 1), (
            1,)), mesh=DEVICES), (p, x, y)),
        "MLP vg: replicated (hand)": (fs.shard(vg, in_strategy=(rep, (1, 1), (1,)),
                                               mesh=DEVICES), (p, x, y)),
        "MLP vg: 2x4 batch x hidden (hand)": (fs.shard(vg, in_strategy=(
            dict(rep, w0=(1, 4), b0=(4,), w1=(4, 1)), (2, 1), (2,)), mesh=DEVICES),
            (p, x, y)),
    }
    ws = [ms.Tensor((rng.standard_normal((64, 64)) / 8).astype(np.float32))
          for _ in range(10)]
    xd = ms.Tensor(rng.standard_normal((256, 64)).astype(np.float32))

    def deep(ws, x):
        h = x
        for w in ws:
            h = ops.relu(ops.matmul(h, w))
        return h.mean()

    plans["10-layer 64x64 MLP vg: search=True"] = (fs.shard(
        fs.value_and_grad(deep), in_strategy=(None, (DEVICES, 1)), mesh=DEVICES, level=2,
        search=True), (ws, xd))
    a = ms.Tensor(rng.standard_normal((512, 256)).astype(np.float32))
    b = ms.Tensor(rng.standard_normal((256, 256)).astype(np.float32))
    c = ms.Tensor(rng.standard_normal((256, 256)).astype(np.float32))

    def chain(a, b, c):
        return ops.matmul(ops.matmul(a, b), c)

    plans["MatMul ((4,1),(1,2)) then MatMul"] = (fs.shard(
        chain, in_strategy=((4, 1), (1, 2), None), mesh=DEVICES), (a, b, c))
    return plans


def _auto_plans():
    """``{label: (call, explain, collectives)}`` of AutoParallel's steps (``explain()``:
    the plan's explanation, priced with the table as it is now)."""
    import fshard as fs
    from benchmarks import planning as P

    out = {}
    for name, (params, x, labels) in P.programs().items():
        short = name.split(" ")[0]
        for mode in P.MODES:
            ap, state, _, _, _, colls = P.plan_mode(mode, params, x, labels)
            out[f"{short} Adam step: {mode}"] = (
                lambda ap=ap, state=state, x=x, labels=labels:
                ap(state, x, labels)[1].asnumpy(),
                lambda ap=ap, state=state, x=x, labels=labels: ap.explain(state, x, labels),
                colls)
    del fs
    return out


def _job_plans(n: int):
    """``{label: (fs.shard-ed function, args)}`` of a job of ``n`` processes: the MLP's
    hand plans, each rank holding the global inputs."""
    import mindspore as ms

    import fshard as fs

    rng, vg, (p, x, y), rep, megatron = _mlp_vg(n)
    a = ms.Tensor(rng.standard_normal((512, 256)).astype(np.float32))
    b = ms.Tensor(rng.standard_normal((256, 256)).astype(np.float32))

    def chain(a, b, c):
        return ms.ops.matmul(ms.ops.matmul(a, b), c)

    return {
        "MLP vg: data parallel (hand)": (fs.shard(vg, in_strategy=(rep, (n, 1), (n,))),
                                         (p, x, y)),
        "MLP vg: Megatron column-row (hand)": (fs.shard(vg, in_strategy=(
            megatron, (1, 1), (1,))), (p, x, y)),
        "MLP vg: replicated (hand)": (fs.shard(vg, in_strategy=(rep, (1, 1), (1,))),
                                      (p, x, y)),
        f"MatMul (({n},1),(1,1)) then MatMul": (fs.shard(
            chain, in_strategy=((n, 1), (1, 1), None)), (a, b, b)),
        f"MatMul ((1,{n}),({n},1)) then MatMul": (fs.shard(
            chain, in_strategy=((1, n), (n, 1), None)), (a, b, b)),
    }


def job_worker(out_dir: str) -> None:
    """One rank of ``--job N``: calibrate the job, then time every plan interleaved
    (each call after a barrier), rank 0 writing the rows."""
    import json

    import fshard as fs
    from fshard.backend.mindspore import world_collective

    fs.distributed.init()
    n = fs.distributed.world_size()
    t0 = time.perf_counter()
    fs.sharding.calibrate()
    seconds = time.perf_counter() - t0
    reduce = world_collective("all_reduce")
    token = np.zeros(1, np.float32)
    import mindspore as ms

    token = ms.Tensor(token)
    ps = {}
    for label, (f, args) in _job_plans(n).items():
        jitted = fs.jit(f)
        ps[label] = (lambda f=jitted, args=args: _wait(f(*args)),
                     lambda f=f, args=args: f.explain(*args),
                     f.partitioned(*args).collectives())
    # (warm-up by count, not time: the ranks must agree on the number of calls)
    rows = _timed(ps, 10, 8, barrier=lambda: reduce(token).asnumpy(), warm_s=0.0,
                  warm_calls=JOB_WARM_CALLS)
    if fs.distributed.rank() == 0:
        with open(os.path.join(out_dir, "rows.json"), "w") as fh:
            json.dump({"rows": rows, "calibrated_s": seconds}, fh)


def run_job(module: str, n: int, timeout: float = 1200):
    """Run ``python -m module --worker DIR`` as a job of ``n`` processes
    (``fshard.launch``) and return what its rank 0 wrote to ``DIR/rows.json``."""
    import json
    import tempfile

    from fshard import launch

    out = tempfile.mkdtemp(prefix="fshard-bench-")
    launch.run(module, n, ["--worker", out], timeout=timeout, module=True).check()
    with open(os.path.join(out, "rows.json")) as fh:
        return json.load(fh)


def measure_job(n: int = 2) -> tuple[list[dict], float]:
    """``--job N``: the job's rows (as ``measure``'s) and its calibration's seconds."""
    got = run_job("benchmarks.prediction", n)
    return got["rows"], got["calibrated_s"]


def _wait(out):
    import fshard as fs

    fs.block_until_ready(out)


def plans():
    """``{label: (call, explain, collectives)}`` of every plan measured (an ``fs.shard``
    plan runs under ``fs.jit``, as a training step would; ``explain()`` prices the plan
    with the table as it is when called)."""
    import fshard as fs

    out = _auto_plans()
    for label, (f, args) in _shard_plans().items():
        colls = f.partitioned(*args).collectives()
        jitted = fs.jit(f)
        out[label] = (lambda f=jitted, args=args: _wait(f(*args)),
                      lambda f=f, args=args: f.explain(*args), colls)
    return out


def measure(runs: int = 10, rounds: int = 16, calibrations: int = 0,
            warm_s: float = WARM_S) -> list[dict]:
    """One dict per plan: label, predicted (and ``prices_s``, each calibration's price),
    best, median (seconds), ratio (predicted over median), collectives; plus the load
    averages before and after. ``calibrations``: 0
    prices every plan with the table on disk; n > 0 runs ``fs.sharding.calibrate`` n
    times, each followed by ``rounds // n`` of the rounds, and the prediction is the
    median of the n prices (so the rates and the steps are measured over the same
    minute, not minutes apart: this machine's speed moves 1.5-2x from minute to minute).
    """
    return _timed(plans(), runs, rounds, calibrations=calibrations, warm_s=warm_s)


def _timed(ps: dict, runs: int, rounds: int, barrier=None, calibrations: int = 0,
           warm_s: float = WARM_S, warm_calls: int = 0) -> list[dict]:
    """``warm_s``: seconds each plan runs untimed before its timed calls, every round;
    ``warm_calls``: a number of calls instead (a job's ranks must agree on it)."""
    import fshard as fs
    from fshard.sharding.calibration import WARMUP_CALLS

    for call, _, _ in ps.values():
        for _ in range(WARMUP_CALLS):  # past MindSpore's choice of threads (calibration.py)
            if barrier is not None:
                barrier()
            call()
    load0 = os.getloadavg()
    times = {k: [] for k in ps}
    best = {k: float("inf") for k in ps}
    prices: dict = {k: [] for k in ps}
    for block in np.array_split(np.arange(rounds), max(calibrations, 1)):
        if calibrations:
            fs.sharding.calibrate(DEVICES)
        for k, (_, explain, _) in ps.items():
            prices[k].append(explain().total_s)
        for _ in block:
            for k, (call, _, _) in ps.items():
                # The plan runs on its own first, as a training loop's step runs after
                # the previous step: a small step called right after another program
                # runs up to 2x slower for its next 10-50 calls.
                end, k_warm = time.perf_counter() + warm_s, 0
                while time.perf_counter() < end or k_warm < warm_calls:
                    if barrier is not None:
                        barrier()
                    call()
                    k_warm += 1
                ts = []
                for _ in range(runs):
                    if barrier is not None:
                        barrier()
                    t0 = time.perf_counter()
                    call()
                    ts.append(time.perf_counter() - t0)
                times[k] += ts
                best[k] = min(best[k], float(np.median(ts)))
    load1 = os.getloadavg()
    rows = []
    for k, (_, _, colls) in ps.items():
        predicted = float(np.median(prices[k]))
        rows.append({"plan": k, "predicted_s": predicted, "prices_s": prices[k],
                     "best_s": best[k],
                     "median_s": float(np.median(times[k])),
                     "ratio": predicted / float(np.median(times[k])),
                     "collectives": _collectives(colls),
                     "load": (load0[0], load1[0])})
    return rows


def profile(calls: int = 30, only: str = "") -> list[dict]:
    """``--profile``: each plan's kernels as MindSpore's profiler records them (CPU op
    timestamps), one dict per plan: label, predicted and equations (the explanation's),
    kernels per step, busy (the kernels' own time per step), span (first kernel's start
    to last one's end), the kernel types that take the most time, and ``counts``, the
    kernels per step by type (``only``: the plans whose label contains it; default all).
    The profiler adds a few microseconds to each kernel: compare plans with each other,
    not with the timed medians."""
    import glob
    import shutil
    import tempfile

    from mindspore import Profiler

    rows = []
    for label, (call, explain, _) in plans().items():
        if only not in label:
            continue
        e = explain()
        call()
        out = tempfile.mkdtemp(prefix="fshard-profile-")
        prof = Profiler(output_path=out)
        for _ in range(calls):
            call()
            time.sleep(0.002)  # a gap to tell the steps apart
        prof.analyse()
        events = []
        for path in glob.glob(out + "/*/FRAMEWORK/cpu_op_execute_timestamp_*.txt"):
            for line in open(path):
                name, _, stamps = line.strip().partition(";HostCpuOps;")
                kind = name.split("/")[-1].split("-op")[0]
                for item in stamps.split():
                    start, ms, _ = item.split(",")
                    events.append((int(start) * 1e-9, float(ms) * 1e-3, kind))
        shutil.rmtree(out, ignore_errors=True)
        events.sort()
        steps = [[events[0]]]
        for ev in events[1:]:
            last = steps[-1][-1]
            (steps.append([ev]) if ev[0] - (last[0] + last[1]) > 1.5e-3
             else steps[-1].append(ev))
        by_kind: Counter = Counter()
        count: Counter = Counter()
        for st in steps:
            for _, s, kind in st:
                by_kind[kind] += s / len(steps)
                count[kind] += 1 / len(steps)
        rows.append({"plan": label, "predicted_s": e.total_s, "equations": len(e.rows),
                     "kernels": float(np.median([len(st) for st in steps])),
                     "busy_s": float(np.median([sum(s for _, s, _ in st) for st in steps])),
                     "span_s": float(np.median([st[-1][0] + st[-1][1] - st[0][0]
                                                for st in steps])),
                     "top": by_kind.most_common(3),
                     "counts": {k: round(n, 1) for k, n in count.most_common()}})
    return rows


def profile_table(rows) -> str:
    """The markdown table of ``profile``'s rows."""
    lines = ["| plan | predicted | equations | kernels | busy | span | most time |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        top = ", ".join(f"{k} {s * 1e3:.2f}" for k, s in r["top"])
        lines.append(f"| {r['plan']} | {r['predicted_s'] * 1e3:.2f} ms | {r['equations']} | "
                     f"{r['kernels']:.0f} | {r['busy_s'] * 1e3:.2f} ms | "
                     f"{r['span_s'] * 1e3:.2f} ms | {top} |")
    return "\n".join(lines)


def table(rows) -> str:
    """The markdown table of ``measure``'s rows."""
    lines = ["| plan | predicted | measured (best round) | measured (median) | "
             "predicted / median | collectives | load avg |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['plan']} | {r['predicted_s'] * 1e3:.1f} ms | "
                     f"{r['best_s'] * 1e3:.1f} ms | {r['median_s'] * 1e3:.1f} ms | "
                     f"{r['ratio']:.2f} | {r['collectives']} | "
                     f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    import sys

    if "--worker" in sys.argv:
        job_worker(sys.argv[sys.argv.index("--worker") + 1])
        sys.exit(0)
    if "--job" in sys.argv:
        n = int(sys.argv[sys.argv.index("--job") + 1])
        print(f"uptime: {os.popen('uptime').read().strip()}")
        rows, seconds = measure_job(n)
        print(f"a job of {n} processes, calibrated in {seconds:.1f} s")
        print(table(rows))
        sys.exit(0)
    if "--profile" in sys.argv:  # [substring of the plans' labels]
        at = sys.argv.index("--profile") + 1
        print(profile_table(profile(only=sys.argv[at] if at < len(sys.argv) else "")))
        sys.exit(0)
    calibrations = 4 if "--calibrate" in sys.argv else 0
    print(f"uptime: {os.popen('uptime').read().strip()}")
    t0 = time.perf_counter()
    rows = measure(calibrations=calibrations)
    print(f"measured in {time.perf_counter() - t0:.0f} s "
          f"({calibrations or 'no'} calibrations)")
    print(table(rows))
    inside = sum(abs(r["ratio"] - 1) <= 0.25 for r in rows)
    print(f"within 25%: {inside} of {len(rows)}")
