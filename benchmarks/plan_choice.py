"""The plan each mode picks, against the hand-written plans, in a multi-process job:
``python -m benchmarks.plan_choice --job N`` (``fshard.launch``, N processes).

For each program of ``benchmarks/planning.py`` (the MLP 64-512-512-10, the digits MLP,
the wide MLP 256-2048-2048-10), on every rank: ``fs.AutoParallel`` with Adam in each
mode (``dataset_strategy("data_parallel")``, each process passing its own rows), the
hand-written data-parallel step (``fs.jit`` of ``fs.shard_map`` of ``value_and_grad``
with ``fs.pmean``, the global batch), the hand-written plan of the searching modes'
whole path (each process's rows all-gathered inside ``fs.shard_map``, then the loss and
gradients computed whole on every process) and the same step unsharded on every process
(``fs.jit`` of the global batch: the plan in which every device computes everything).
``semi_auto, global batch`` is ``AutoParallel`` given what the hand-written
data-parallel step is given, the global batch on every process, split by a tuple
dataset strategy: the same plan and the same inputs, without the check of each
process's slices. ``<mode>, full_batch`` is each mode given what the one-device step is
given: the global batch whole on every process (``dataset_strategy("full_batch")``),
to split or not as the mode plans. The job is calibrated first (``fs.sharding.calibrate()`` on every
rank), so the modes plan with the job's rates. Every plan is called 50 times, then
timed in 8 rounds of 10 calls, each round after 20 untimed calls and each call after a
barrier (as the steps of a training loop meet at their collectives); rank 0 writes the
medians. Unlike a virtual mesh, where one process runs
every device and a split saves nothing, each process here computes only its own block.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

MODES = ("semi_auto", "sharding_propagation", "recursive_programming")


def _auto(mode, params, rows, labels, dataset="data_parallel"):
    """``(call, explain, collectives)`` of ``fs.AutoParallel`` in ``mode`` on this
    process's rows (with a tuple ``dataset`` strategy: on the global batch, which it
    splits); the call carries the state from step to step."""
    import fshard as fs
    from benchmarks import planning as P

    ap = fs.AutoParallel(P._loss, fs.optim.adam(1e-3), mode)
    ap.dataset_strategy(dataset)
    held = [ap.init(params)]
    colls = ap.partitioned(held[0], rows, labels).collectives()

    def call():
        held[0], loss = ap(held[0], rows, labels)
        loss.asnumpy()

    call()  # (the first step, from whole arrays, compiles once more than the others)
    return call, (lambda: ap.explain(held[0], rows, labels)), colls


class _Unpriced:
    """A hand-written step's explanation: no price."""
    total_s = float("nan")


def _hand(step, state, x, labels):
    held = [state]

    def call():
        p, o, value = step(*held[0], x, labels)
        held[0] = (p, o)
        value.asnumpy()

    return call


def worker(out_dir: str) -> None:
    """One rank of ``--job N``."""
    import mindspore as ms

    import fshard as fs
    from benchmarks import planning as P
    from benchmarks.prediction import JOB_WARM_CALLS, _timed
    from fshard.backend.mindspore import world_collective

    fs.distributed.init()
    n, rank = fs.distributed.world_size(), fs.distributed.rank()
    fs.sharding.calibrate()
    reduce = world_collective("all_reduce")
    token = ms.Tensor(np.zeros(1, np.float32))
    ps = {}
    for name, (params, x, labels) in P.programs().items():
        short = name.split(" ")[0]
        b = x.shape[0] // n
        rows, own = x[rank * b:(rank + 1) * b], labels[rank * b:(rank + 1) * b]
        for mode in MODES:
            call, explain, colls = _auto(mode, params, rows, own)
            ps[f"{short}: {mode}"] = (call, explain, colls)
        # what the one-device step is given: the global batch on every process, whole
        # (dataset_strategy("full_batch")), each mode free to split it or not
        for mode in MODES:
            ps[f"{short}: {mode}, full_batch"] = _auto(mode, params, x, labels,
                                                       "full_batch")
        # the hand-written data-parallel step's plan and inputs: the global batch on
        # every process, split by the dataset strategy (no slices, so no slice check)
        ps[f"{short}: semi_auto, global batch"] = _auto(
            "semi_auto", params, x, labels, ((n, 1), (n,)))
        step, state = P.hand_data_parallel(params, x, labels, fs.optim.adam(1e-3), n)
        ps[f"{short}: hand data parallel"] = (_hand(step, state, x, labels),
                                             _Unpriced, [])
        step, state = P.hand_data_parallel(params, x, labels, fs.optim.adam(1e-3), n,
                                           gather=True)
        ps[f"{short}: hand gather, then whole"] = (_hand(step, state, x, labels),
                                                  _Unpriced, [])
        step, state = P.hand_one_device(params, x, labels, fs.optim.adam(1e-3))
        ps[f"{short}: hand one-device"] = (_hand(step, state, x, labels),
                                          _Unpriced, [])
    rows = _timed(ps, 10, 8, barrier=lambda: reduce(token).asnumpy(), warm_s=0.0,
                  warm_calls=JOB_WARM_CALLS)
    if rank == 0:
        with open(os.path.join(out_dir, "rows.json"), "w") as fh:
            json.dump(rows, fh)


def measure_job(n: int = 2) -> list[dict]:
    """``--job N``: one row per plan (as ``benchmarks.prediction.measure``'s)."""
    from benchmarks.prediction import run_job

    return run_job("benchmarks.plan_choice", n, timeout=1800)


def table(rows) -> str:
    """Per program, each plan's median, its ratio to the faster hand-written step, and
    the modes' predictions."""
    lines = ["| plan | predicted | median | / faster hand-written | collectives |",
             "|---|---:|---:|---:|---|"]
    best: dict = {}
    for r in rows:
        prog = r["plan"].split(": ")[0]
        if "hand" in r["plan"]:
            best[prog] = min(best.get(prog, float("inf")), r["median_s"])
    for r in rows:
        prog = r["plan"].split(": ")[0]
        pred = "-" if r["predicted_s"] != r["predicted_s"] else f"{r['predicted_s'] * 1e3:.1f} ms"
        lines.append(f"| {r['plan']} | {pred} | {r['median_s'] * 1e3:.2f} ms | "
                     f"{r['median_s'] / best[prog]:.2f} | {r['collectives']} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1])
        sys.exit(0)
    n = int(sys.argv[sys.argv.index("--job") + 1]) if "--job" in sys.argv else 2
    print(f"uptime: {os.popen('uptime').read().strip()}")
    t0 = time.perf_counter()
    got = measure_job(n)
    print(f"a job of {n} processes, {time.perf_counter() - t0:.0f} s")
    print(table(got))
