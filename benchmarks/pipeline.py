"""Pipeline parallelism in 2- and 4-process jobs: step time, the measured bubble against
``(S - 1) / (M + S - 1)``, and the activation memory each stage keeps (GPipe vs 1F1B).

The benchmark launches ``python -m fshard.launch -n N benchmarks/pipeline.py OUT`` for
N = 2 and 4; every rank trains the digits MLP (``examples/train_pipeline.py``, hidden
width ``HIDDEN``, batch ``BATCH``) with each configuration: 2 warm-up steps, then
``STEPS`` timed steps (each waits for its loss), then one profiled step in which every
computation is waited for and timed, which gives the stage's busy time. The measured
bubble of a stage is ``1 - busy / step time`` of the profiled step. Peak memory is the
most stage inputs a stage keeps between a forward and its backward, in micro-batches and
bytes. The baseline row is one process training the same model without a pipeline, in
the same run. MindSpore has no pipeline on CPU (its AutoParallel refuses the backend).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

HIDDEN = 512
BATCH = 256
STEPS = 5
# (stages, micro_batches, scheduler[, model_parallel]) per job size; the 4-process job
# also runs 2 x 2, with the stages' devices data parallel, then splitting the weights
CONFIGS = {2: [(2, 4, "gpipe"), (2, 4, "1f1b"), (2, 8, "gpipe"), (2, 8, "1f1b")],
           4: [(4, 8, "gpipe"), (4, 8, "1f1b"), (2, 4, "1f1b"), (2, 4, "1f1b", True)]}


def _setup():
    import train_pipeline as ex

    ex.HIDDEN, ex.BATCH = HIDDEN, BATCH
    return ex


def _time_steps(ap, state, data, steps):
    times = []
    for x, y in data[:steps]:
        t0 = time.perf_counter()
        state, loss = ap(state, x, y)
        loss.asnumpy()
        times.append(time.perf_counter() - t0)
    return state, sorted(times)[len(times) // 2]


def worker(out_dir: str) -> None:
    import numpy as np

    import fshard as fs

    ex = _setup()
    fs.distributed.init()
    rank, world = fs.distributed.rank(), fs.distributed.world_size()
    data = list(ex.batches(STEPS + 3, BATCH))
    results = {}
    for S, M, sched, *mp in CONFIGS[world]:
        dp = world // S
        plan = ex.model_parallel_plan("mlp", S, dp) if mp else None
        ap, params = ex.make("mlp", S, M, sched, output_broadcast=True, plan=plan)
        state = ap.init(params)
        # each process passes its data-parallel slice of the global batch of BATCH rows
        j, b = rank % dp, BATCH // dp
        mine = [(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b]) for x, y in data]
        state, _ = _time_steps(ap, state, mine, 2)
        state, step_s = _time_steps(ap, state, mine[2:], STEPS)
        step = next(iter(ap._pipeline._steps.values()))
        step.profile = True
        t0 = time.perf_counter()
        state, loss = ap(state, *mine[-1])
        loss.asnumpy()
        prof_s = time.perf_counter() - t0
        (st,) = step.stats
        results[f"{S}x{dp}{' model-parallel' if mp else ''}:{M}:{sched}"] = {
            "stage": st["stage"], "step_s": step_s, "profiled_step_s": prof_s,
            "busy_s": st["busy_s"], "peak_saved": st["peak_saved"],
            "peak_saved_bytes": st["peak_saved_bytes"],
            "loss": float(np.asarray(loss.asnumpy()))}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


def run_jobs() -> dict:
    """``{n: [per-rank results]}`` from one launch per job size."""
    from fshard import launch

    out = {}
    for n in CONFIGS:
        d = tempfile.mkdtemp()
        res = launch.run(os.path.abspath(__file__), n, [d], timeout=900)
        assert res.ok, res.message
        out[n] = []
        for r in range(n):
            with open(os.path.join(d, f"rank{r}.json")) as fh:
                out[n].append(json.load(fh))
    return out


def baseline_step_s() -> float:
    import fshard as fs

    ex = _setup()
    data = list(ex.batches(STEPS + 2, BATCH))
    ap = fs.AutoParallel(ex.mlp_loss, ex.optimizer("adam"), mesh=1)
    state = ap.init(ex.mlp_params(2))
    state, _ = _time_steps(ap, state, data, 2)
    return _time_steps(ap, state, data[2:], STEPS)[1]


def table(jobs: dict, base_s: float) -> list[dict]:
    """One row per configuration: step time (slowest rank), measured bubble (mean over
    the stages) and the formula's, peak kept inputs per stage."""
    from fractions import Fraction

    rows = []
    for n, ranks in jobs.items():
        for key in ranks[0]:
            S, M, sched = key.split(":")[0].split("x")[0], key.split(":")[1], key.split(":")[2]
            S, M = int(S), int(M)
            per = [r[key] for r in ranks]
            stages = sorted({p["stage"] for p in per})
            bubble = [1 - p["busy_s"] / p["profiled_step_s"] for p in per]
            peak = {s: max(p["peak_saved"] for p in per if p["stage"] == s) for s in stages}
            peak_b = {s: max(p["peak_saved_bytes"] for p in per if p["stage"] == s)
                      for s in stages}
            rows.append({
                "processes": n, "config": key, "step_s": max(p["step_s"] for p in per),
                "measured_bubble": sum(bubble) / len(bubble),
                "formula_bubble": float(Fraction(S - 1, M + S - 1)),
                "peak_micro_batches": [peak[s] for s in stages],
                "peak_kib": [round(peak_b[s] / 1024, 1) for s in stages],
                "vs_unpipelined": max(p["step_s"] for p in per) / base_s})
    return rows


def _register():
    from benchmarks.harness import Result, Row, benchmark

    @benchmark("pipeline", title="pipeline parallelism in 2- and 4-process jobs")
    def pipeline(ctx):
        base = baseline_step_s()
        rows = table(run_jobs(), base)
        out = [Row("fshard", f"unpipelined, 1 process (batch {BATCH}, hidden {HIDDEN})",
                   base, base, STEPS, "")]
        for r in rows:
            out.append(Row("fshard", f"{r['processes']} processes, {r['config']}",
                           r["step_s"], r["step_s"], STEPS,
                           f"bubble {r['measured_bubble']:.0%} measured / "
                           f"{r['formula_bubble']:.0%} formula; peak kept inputs per stage "
                           f"{r['peak_micro_batches']} micro-batches = {r['peak_kib']} KiB"))
        return Result(out, baseline=out[0].label,
                      target="bubble and memory as the formulas say (no speed-up expected "
                             "on 2 shared cores)",
                      notes=[f"median of {STEPS} steps after 2 warm-up steps; the bubble "
                             "from one profiled step (every computation waited for)"])


if __name__ == "__main__":
    worker(sys.argv[1])
else:
    _register()
