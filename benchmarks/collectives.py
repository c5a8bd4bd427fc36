"""Collective benchmarks: fshard's collectives in real 2- and 4-process jobs.

For 1 MiB and 64 MiB of float32 per rank, each collective runs as
``fs.jit(fs.shard_map(f, ...))`` on a block split over the ranks (the graph fshard
lowers for one rank: a slice at the boundary, then the collective) and, where
MindSpore has the op on CPU (AllReduce, AllGather, Broadcast), as
``ms.jit`` of that op called directly. The collectives MindSpore's CPU backend lacks
are emulated by fshard (docs/collectives.md#lowering); their rows compare the
emulation with the native op it is built on: reduce-scatter = AllReduce + slice
(vs AllReduce alone), pmax = AllGather + max, ppermute and all_to_all = AllGather +
index (vs AllGather alone), and a gather over a sub-group of a 2x2 mesh = one-hot
slot buffer + sub-group AllReduce (vs a world AllGather of the same block).

Every timed call is preceded by a barrier (a 4-byte AllReduce, not timed) and ends
with ``.asnumpy()``; times are rank 0's. "bytes" is what each rank sends under
ring algorithms: the collective's own volume, and, for an emulation, the volume of
what actually runs. One job per process count: ``python -m benchmarks --only
collectives`` or ``python -m benchmarks.collectives [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

SIZES = {"1MiB": 1 << 20, "64MiB": 64 << 20}
PROCS = (2, 4)
RUNS = {"1MiB": (30, 5), "64MiB": (5, 2)}  # (full, quick) per size


# ---------------------------------------------------------------------------
# Inside the job (every rank)
# ---------------------------------------------------------------------------


def _variants(n: int, size: int):
    """``(name, system, fn, arg, bytes_logical, bytes_run)`` for one data size."""
    import mindspore as ms
    from mindspore import ops

    import fshard as fs

    rows = size // 4 // 64
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.standard_normal((rows, 64), np.float32))          # one rank's block
    xs = ms.Tensor(rng.standard_normal((n * rows, 64), np.float32))     # every rank's block
    S = float(size)
    mesh = fs.Mesh((n,), ("d",))

    def sm(f, out=None, m=mesh):
        # The input is split over the ranks (each rank's block differs, so no collective
        # can be skipped as a no-op); the boundary costs one slice. check_vma=False:
        # varying outputs stay per rank (no gather at the boundary).
        split = fs.Layout(m.shape, m.axis_names)(m.axis_names, "None")
        return fs.jit(fs.shard_map(f, (split,), out, mesh=m, check_vma=False))

    ring = [(i, (i + 1) % n) for i in range(n)]
    ar, ag, bc = ops.AllReduce(), ops.AllGather(), ops.Broadcast(0)

    def ms_allreduce(v):
        return ar(v)

    def ms_allgather(v):
        return ag(v)

    def ms_broadcast(v):
        return bc((v,))[0]

    ms_ar, ms_ag, ms_bc = ms.jit(ms_allreduce), ms.jit(ms_allgather), ms.jit(ms_broadcast)
    allreduce_bytes = 2 * (n - 1) / n * S
    allgather_bytes = (n - 1) * S
    out = [
        ("psum", "fshard", sm(lambda v: fs.psum(v, "d")), xs, allreduce_bytes,
         allreduce_bytes),
        ("psum", "mindspore", ms_ar, x, allreduce_bytes, allreduce_bytes),
        ("pmean", "fshard", sm(lambda v: fs.pmean(v, "d")), xs, allreduce_bytes,
         allreduce_bytes),
        ("all_gather", "fshard", sm(lambda v: fs.all_gather(v, "d", tiled=True)), xs,
         allgather_bytes, allgather_bytes),
        ("all_gather", "mindspore", ms_ag, x, allgather_bytes, allgather_bytes),
        ("broadcast", "fshard", sm(lambda v: fs.broadcast(v, "d", root=0)), xs, S, S),
        ("broadcast", "mindspore", ms_bc, x, S, S),
        ("psum_scatter (AllReduce + slice)", "fshard",
         sm(lambda v: fs.psum_scatter(v, "d", tiled=True)), xs, (n - 1) / n * S,
         allreduce_bytes),
        ("pmax (AllGather + max)", "fshard", sm(lambda v: fs.pmax(v, "d")), xs,
         allreduce_bytes, allgather_bytes),
        ("ppermute ring (AllGather + index)", "fshard",
         sm(lambda v: fs.ppermute(v, "d", ring)), xs, S, allgather_bytes),
        ("all_to_all (AllGather + slice)", "fshard",
         sm(lambda v: fs.all_to_all(v, "d", 0, 0, tiled=True)), xs, (n - 1) / n * S,
         allgather_bytes),
    ]
    if n == 4:  # a gather over one axis of a 2x2 mesh: a sub-group of 2 ranks
        sub = sm(lambda v: fs.all_gather(v, "b", tiled=True), m=fs.Mesh((2, 2), ("a", "b")))
        out.append(("sub-group all_gather (slot + AllReduce)", "fshard", sub, xs, S,
                    2 * (2 - 1) * S))
    return out


def _worker(out_dir: str, quick: bool) -> None:
    import mindspore as ms
    from mindspore import ops

    import fshard as fs

    fs.distributed.init()
    rank, n = fs.distributed.rank(), fs.distributed.world_size()
    tiny = ms.Tensor(np.ones(1, np.float32))
    barrier_op = ops.AllReduce()

    def barrier_fn(v):
        return barrier_op(v)

    barrier = ms.jit(barrier_fn)
    results = {}
    for label, size in SIZES.items():
        runs = RUNS[label][1 if quick else 0]
        for name, system, fn, arg, logical, moved in _variants(n, size):
            fn(arg).asnumpy()  # compile and warm up
            times = []
            for _ in range(runs):
                barrier(tiny).asnumpy()
                t0 = time.perf_counter()
                fn(arg).asnumpy()
                times.append(time.perf_counter() - t0)
            results[f"{name}|{system}|{label}"] = {
                "median_s": float(np.median(times)), "min_s": float(np.min(times)),
                "runs": runs, "bytes": logical, "bytes_run": moved}
    if rank == 0:
        with open(os.path.join(out_dir, f"collectives_{n}.json"), "w") as fh:
            json.dump(results, fh)


# ---------------------------------------------------------------------------
# The benchmark (in the launching process)
# ---------------------------------------------------------------------------


def _launch(n: int, quick: bool) -> dict:
    from fshard import launch

    out = tempfile.mkdtemp(prefix="fshard-bench-collectives-")
    args = ["--worker", out] + (["--quick"] if quick else [])
    result = launch.run("benchmarks.collectives", n, args, timeout=1800, module=True)
    result.check()
    with open(os.path.join(out, f"collectives_{n}.json")) as fh:
        return json.load(fh)


def _gibs(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 2**30:.3f} GiB/s" if seconds > 0 else "-"


def _rows(measured: dict):
    from benchmarks.harness import Row

    rows, notes = [], []
    for n, results in measured.items():
        for key, t in results.items():
            name, system, label = key.split("|")
            vs = ""
            if system == "fshard":  # the MindSpore op it is, or the op it is built on
                base = {"psum": "psum", "pmean": "psum", "all_gather": "all_gather",
                        "broadcast": "broadcast"}.get(name)
                emulated = base is None
                if emulated:
                    base = "psum" if name.startswith("psum_scatter") else "all_gather"
                ref = results.get(f"{base}|mindspore|{label}")
                op = {"psum": "AllReduce", "all_gather": "AllGather",
                      "broadcast": "Broadcast"}[base]
                if ref:
                    vs = (f", {t['median_s'] / ref['median_s']:.2f}x "
                          + (f"the {op} alone" if emulated else f"MindSpore's {op}"))
            note = (f"{t['bytes'] / 2**20:.1f} MiB/rank"
                    + (f" ({t['bytes_run'] / 2**20:.1f} MiB run)"
                       if t["bytes_run"] != t["bytes"] else "")
                    + f", {_gibs(t['bytes'], t['median_s'])}{vs}")
            rows.append(Row(system, f"{name} {label} n={n}", t["median_s"], t["min_s"],
                            t["runs"], note))
    notes.append("bytes: what each rank sends under ring algorithms; 'run' is what the "
                 "emulation sends instead. GiB/s = bytes / median time (algorithm bandwidth).")
    notes.append("ratio column: relative to MindSpore's AllReduce of 1 MiB on 2 processes.")
    return rows, notes


def run(quick: bool = False):
    from benchmarks.harness import Result

    measured = {n: _launch(n, quick) for n in PROCS}
    rows, notes = _rows(measured)
    return Result(rows=rows, baseline="psum 1MiB n=2", target="fshard's native collectives "
                  "within 1.1x of calling MindSpore's op directly", notes=notes)


def collectives(ctx):
    result = run(quick=ctx.quick)
    # the ratio column is relative to the first row with the baseline label: MindSpore's
    result.rows.sort(key=lambda r: (r.label != result.baseline or r.system != "mindspore"))
    return result


if __name__ != "__main__":  # `python -m benchmarks.collectives` imports the module again
    from benchmarks.harness import benchmark as _register

    _register("collectives", title="collectives in 2- and 4-process jobs, vs MindSpore's ops")(
        collectives)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.collectives",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few runs: a smoke test")
    p.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.quick)
        return 0
    from benchmarks import __main__ as suite

    return suite.main(["--only", "collectives", "--no-jax"] + (["--quick"] if args.quick else []))


if __name__ == "__main__":
    sys.exit(main())
