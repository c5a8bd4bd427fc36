"""``python -m benchmarks [--quick] [--only NAME[,NAME]] [--no-jax] [--list] [--report]``

Runs the registered benchmarks (run from the repository root with fshard's
environment), prints one table per benchmark and writes
``benchmarks/results/latest.json``. JAX baselines run first, in a subprocess of
the JAX environment (``benchmarks/jax_env.py`` creates it), so the two never
compete for the CPU.

Adding a benchmark: write ``@harness.benchmark(...)`` function in a module (one
module per area: ``foundation``, later ``vmap``, ``training``, ``collectives``,
``sharding``) and list the module in ``MODULES``; put its JAX counterpart, if
any, in ``jax_baselines.py`` under the same name.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

os.environ.setdefault("GLOG_v", "3")  # MindSpore: errors only, keep the tables readable

from benchmarks import harness, jax_env  # noqa: E402

MODULES = ["foundation", "vmap_grad", "collectives", "sharding", "search", "rng",
           "checkpointing", "control_flow", "dynamic_shapes", "training", "pipeline",
           "cost_rates", "transformers", "planning", "conv", "resnet", "norms", "gpt", "activations"]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "latest.json")


def _load() -> None:
    for m in MODULES:
        importlib.import_module(f"benchmarks.{m}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few runs: a smoke test, not a measurement")
    p.add_argument("--only", action="append", default=[],
                   help="run only these benchmarks (comma-separated or repeated)")
    p.add_argument("--no-jax", action="store_true", help="skip the JAX baselines")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--report", action="store_true",
                   help="print the stored results (--output) as Markdown tables and exit")
    p.add_argument("--output", default=RESULTS, help=f"JSON file to write (default {RESULTS})")
    args = p.parse_args(argv)

    if args.report:
        with open(args.output) as fh:
            doc = json.load(fh)
        only = [n for o in args.only for n in o.split(",") if n]
        print(f"Machine: {json.dumps(doc['meta'])}\n")
        for name, entry in doc["benchmarks"].items():
            if not only or name in only:
                print(harness.markdown(name, entry) + "\n")
        return 0
    _load()
    if args.list:
        for name, b in harness.REGISTRY.items():
            print(f"{name:20s} {b.title}")
        return 0
    only = [n for o in args.only for n in o.split(",") if n]
    unknown = [n for n in only if n not in harness.REGISTRY]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; known: {sorted(harness.REGISTRY)}")
    selected = [b for n, b in harness.REGISTRY.items() if not only or n in only]

    jax_names = sorted({j for b in selected for j in b.jax})
    jax_results: dict = {}
    jax_version = None
    if jax_names and not args.no_jax:
        t0 = time.perf_counter()
        print(f"JAX baselines ({', '.join(jax_names)}) ...", flush=True)
        jax_results = jax_env.run_baselines(jax_names, quick=args.quick)
        jax_version = jax_results.get("_meta", {}).get("jax")
        if "_error" in jax_results:
            print(f"  JAX baselines unavailable: {jax_results['_error']}", file=sys.stderr)
        else:
            print(f"  done in {time.perf_counter() - t0:.1f} s", flush=True)

    load_before = os.getloadavg()
    ctx = harness.Context(quick=args.quick, jax_results=jax_results)
    results: dict = {}
    for b in selected:
        t0 = time.perf_counter()
        print(f"\nrunning {b.name} ...", flush=True)
        result = b.fn(ctx)
        harness.print_table(b.name, b, result)
        entry = harness.to_json(b.name, b, result)
        entry.update(quick=args.quick, seconds=round(time.perf_counter() - t0, 1),
                     date=time.strftime("%Y-%m-%d %H:%M:%S"),
                     loadavg=[round(x, 2) for x in os.getloadavg()])
        results[b.name] = entry

    # a partial run (--only) updates its benchmarks and keeps the others' last results
    if only and os.path.exists(args.output):
        with open(args.output) as fh:
            previous = json.load(fh).get("benchmarks", {})
        results = {**previous, **results}
    # other work on a shared machine shows in the load average: keep it with the numbers
    meta = dict(harness.machine(), jax=jax_version or jax_env.version(), quick=args.quick,
                argv=sys.argv[1:] if argv is None else list(argv),
                loadavg_before=[round(x, 2) for x in load_before],
                loadavg_after=[round(x, 2) for x in os.getloadavg()])
    print(f"load average (1/5/15 min): before {meta['loadavg_before']}, "
          f"after {meta['loadavg_after']}")
    harness.write_json(args.output, results, meta)
    print(f"\nwrote {os.path.relpath(args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
