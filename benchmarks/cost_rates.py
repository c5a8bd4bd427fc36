"""The rates behind the search's time objective (``BACKEND_RATES`` in
fshard/sharding/cost.py), measured on this machine's backend.

1. **flops per second**: the cost model's flops (``FactorSpec.flops_per_point`` times
   the iteration points, as ``fshard.sharding.search.cost`` counts them) of one
   unsharded Adam step of the MLP 784-512-512-10 on a batch of 128, over its measured
   time (``fs.jit``, one process). One rate for every primitive: the planner needs what
   a step's mix of matmuls and elementwise work runs at, not a kernel's peak.
2. **each collective's fixed cost and rate**, in a 2-process ``fshard.launch`` job:
   ``mindspore.jit`` of ``ops.AllReduce`` and ``ops.AllGather`` on 4 KiB and 4 MiB of
   float32 per rank, each call after an untimed barrier (as in a step, where the
   devices meet at each collective). The fixed cost is the 4 KiB time; the rate is the
   bytes each rank sends (``step_bytes``: AllReduce ``2(n-1)/n·S``, AllGather
   ``(n-1)·S``) over the extra time of 4 MiB.

``python -m benchmarks --only cost_rates`` prints the measured row next to the one in
``BACKEND_RATES``; ``python -m benchmarks.cost_rates --worker OUT`` is the job's side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

SMALL, LARGE = 4 * 1024, 4 * 2**20
RUNS = (30, 6)


def _median_call(fn, arg, barrier, runs: int) -> float:
    fn(arg).asnumpy()
    times = []
    for _ in range(runs):
        barrier()
        t0 = time.perf_counter()
        fn(arg).asnumpy()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def worker(out_dir: str, quick: bool) -> None:
    import mindspore as ms
    from mindspore import ops

    import fshard as fs

    fs.distributed.init()
    n = fs.distributed.world_size()
    all_reduce, all_gather = ops.AllReduce(), ops.AllGather()

    def ar(v):
        return all_reduce(v)

    def ag(v):
        return all_gather(v)

    ar_jit, ag_jit = ms.jit(ar), ms.jit(ag)
    token = ms.Tensor(np.zeros(1, np.float32))

    def barrier():
        ar_jit(token).asnumpy()

    runs = RUNS[1 if quick else 0]
    out = {}
    for name, fn, sent in (("all_reduce", ar_jit, lambda s: 2 * (n - 1) / n * s),
                           ("all_gather", ag_jit, lambda s: (n - 1) * s)):
        t_small = _median_call(fn, ms.Tensor(np.ones(SMALL // 4, np.float32)), barrier, runs)
        t_large = _median_call(fn, ms.Tensor(np.ones(LARGE // 4, np.float32)), barrier, runs)
        out[name] = {"latency_s": t_small,
                     "bytes_per_s": (sent(LARGE) - sent(SMALL)) / max(t_large - t_small, 1e-9),
                     "small_s": t_small, "large_s": t_large}
    if fs.distributed.rank() == 0:
        with open(os.path.join(out_dir, "rates.json"), "w") as fh:
            json.dump({"collectives": out, "loadavg": os.getloadavg()}, fh)


def flops_rate(quick: bool) -> dict:
    """The cost model's flops of the unsharded step over its median time."""
    import mindspore as ms

    import fshard as fs
    from benchmarks import timing
    from benchmarks.training import init, loss
    from fshard.sharding.search import cost

    params, x, labels = init(np.random.default_rng(0))
    opt = fs.optim.adam(1e-3)
    ap = fs.AutoParallel(loss, opt, mesh=1)
    state = ap.init(params)
    flops = cost(ap.partitioned(state, x, labels).prop).compute
    xs, ls = ms.Tensor(x), ms.Tensor(labels)
    box = [state]

    def one():
        box[0], value = ap(box[0], xs, ls)
        value.asnumpy()

    t = timing.measure(one, runs=RUNS[1 if quick else 0] * 2, warmup=3)
    return {"flops": flops, "median_s": t["median_s"], "min_s": t["min_s"],
            "flops_per_s": flops / t["median_s"], "loadavg": os.getloadavg()}


def cost_rates(ctx):
    from benchmarks.harness import Result, row
    from fshard import launch
    from fshard.sharding.cost import BACKEND_RATES

    f = flops_rate(ctx.quick)
    out = tempfile.mkdtemp(prefix="fshard-bench-rates-")
    args = ["--worker", out] + (["--quick"] if ctx.quick else [])
    result = launch.run("benchmarks.cost_rates", 2, args, timeout=600, module=True)
    result.check()
    with open(os.path.join(out, "rates.json")) as fh:
        job = json.load(fh)
    table = BACKEND_RATES["CPU"]
    rows = [row("fshard", "unsharded MLP Adam step", {"median_s": f["median_s"],
                                                      "min_s": f["min_s"], "runs": 0})]
    rows += [row("mindspore", f"{k} of 4 KiB, 2 processes",
                 {"median_s": v["small_s"], "min_s": v["small_s"], "runs": 0})
             for k, v in job["collectives"].items()]
    notes = [f"flops per second: measured {f['flops_per_s']:.3g} ({f['flops']:.4g} flops "
             f"in {f['median_s'] * 1e3:.1f} ms; load {f['loadavg'][0]:.1f}); "
             f"BACKEND_RATES['CPU'] {table['flops_per_s']:.3g}"]
    for k, v in job["collectives"].items():
        notes.append(f"{k}: measured latency {v['latency_s'] * 1e3:.2f} ms, "
                     f"{v['bytes_per_s']:.3g} B/s; BACKEND_RATES['CPU'] "
                     f"{table[k][0] * 1e3:.2f} ms, {table[k][1]:.3g} B/s")
    notes.append(f"load average during the job: {job['loadavg']}")
    return Result(rows, notes=notes)


def _register():
    from benchmarks.harness import benchmark

    benchmark("cost_rates", title="The search's time objective: flops and collective "
              "rates of this backend")(cost_rates)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    sys.exit(worker(a.worker, a.quick))
else:
    _register()
