"""Sharding search benchmark: greedy propagation, the search, and the exhaustive optimum.

Small programs (MLP variants, attention-like matmul chains, elementwise chains,
reductions) on 4 and 8 devices, each with a few annotation patterns. For each case,
the objective of ``level`` (fshard/sharding/search.py: the cost of an assignment as the
partitioner runs it) of three assignments:

- **greedy**: ``propagate`` (MindSpore's breadth-first propagation), what
  ``fs.shard`` does by default;
- **search**: ``fshard.sharding.search.search`` (``fs.shard(..., search=True)``), a dynamic
  program over the equations, a beam when its states do not fit, then coordinate
  descent;
- **optimum**: ``fshard.sharding.search.exhaustive``, branch and bound over every assignment.

and the time each takes. The summary says how often the search reaches the optimum
and its worst gap. ``python -m benchmarks --only search [--quick]``, or ``python -m
benchmarks.search [--quick]`` for the Markdown table of docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

# ---------------------------------------------------------------------------
# The programs
# ---------------------------------------------------------------------------


def _ops():
    from mindspore import ops

    return ops


def mlp2(x, w1, w2):
    ops = _ops()
    return ops.matmul(ops.relu(ops.matmul(x, w1)), w2)


def mlp2_bias(x, w1, b1, w2, b2):
    ops = _ops()
    return ops.matmul(ops.relu(ops.matmul(x, w1) + b1), w2) + b2


def mlp3(x, w1, w2, w3):
    ops = _ops()
    return ops.matmul(ops.relu(ops.matmul(ops.relu(ops.matmul(x, w1)), w2)), w3)


def mlp_loss(x, w1, w2):
    return mlp2(x, w1, w2).sum()


def residual(x, w1, w2):
    return x + mlp2(x, w1, w2)


def attention(q, k, v):
    ops = _ops()
    return ops.matmul(ops.softmax(ops.matmul(q, ops.transpose(k, (1, 0))), -1), v)


def attention_proj(x, wq, wk, wv):
    ops = _ops()
    q, k, v = ops.matmul(x, wq), ops.matmul(x, wk), ops.matmul(x, wv)
    return ops.matmul(ops.softmax(ops.matmul(q, ops.transpose(k, (1, 0))), -1), v)


def elementwise(x, y, z):
    ops = _ops()
    return ops.tanh(x * y + z) * x


def row_norm(x, w):
    ops = _ops()
    y = ops.matmul(x, w)
    return y / ops.sqrt((y * y).sum(1, keepdims=True))


def square_loss(x, w, y):
    ops = _ops()
    d = ops.matmul(x, w) - y
    return (d * d).sum()


# name -> (function, shapes, annotation patterns as functions of the device count)
def _dp(n, nargs):
    return ((n, 1),) + (None,) * (nargs - 1)


PROGRAMS = {
    "mlp2": (mlp2, [(32, 64), (64, 128), (128, 32)], {
        "none": lambda n: (None, None, None),
        "dp": lambda n: _dp(n, 3),
        "megatron": lambda n: (None, (1, n), (n, 1)),
        "2d": lambda n: ((2, 1), (1, n // 2), None)}),
    "mlp2_bias": (mlp2_bias, [(32, 64), (64, 128), (128,), (128, 32), (32,)], {
        "dp": lambda n: _dp(n, 5),
        "megatron": lambda n: (None, (1, n), None, None, None)}),
    "mlp3": (mlp3, [(32, 64), (64, 128), (128, 64), (64, 32)], {
        "none": lambda n: (None,) * 4,
        "dp": lambda n: _dp(n, 4)}),
    "mlp_loss": (mlp_loss, [(32, 64), (64, 128), (128, 32)], {
        "none": lambda n: (None, None, None),
        "dp": lambda n: _dp(n, 3)}),
    "residual": (residual, [(32, 64), (64, 128), (128, 64)], {
        "dp": lambda n: _dp(n, 3),
        "megatron": lambda n: (None, (1, n), None)}),
    "attention": (attention, [(32, 16), (32, 16), (32, 16)], {
        "none": lambda n: (None, None, None),
        "rows": lambda n: ((n, 1), None, None)}),
    "attention_proj": (attention_proj, [(16, 32), (32, 32), (32, 32), (32, 32)], {
        "rows": lambda n: ((n, 1), None, None, None),
        "heads": lambda n: (None, (1, n), (1, n), None)}),
    "elementwise": (elementwise, [(32, 64), (32, 64), (32, 64)], {
        "none": lambda n: (None, None, None),
        "mixed": lambda n: ((n, 1), (1, n), None)}),
    "row_norm": (row_norm, [(32, 64), (64, 32)], {
        "none": lambda n: (None, None),
        "cols": lambda n: (None, (1, n))}),
    "square_loss": (square_loss, [(32, 64), (64, 16), (32, 16)], {
        "dp": lambda n: ((n, 1), None, (n, 1)),
        "k_split": lambda n: ((1, n), None, None)}),
}

DEVICES = (4, 8)
#: The cases of the fast test subset (tests/sharding/test_search.py): small enough that the
#: exhaustive optimum takes well under a second each.
FAST = [("mlp2", "megatron", 4), ("mlp2", "2d", 8), ("mlp_loss", "none", 4),
        ("residual", "dp", 4), ("attention", "rows", 4), ("elementwise", "mixed", 8),
        ("row_norm", "cols", 4), ("square_loss", "dp", 8), ("mlp2_bias", "megatron", 4)]


@dataclasses.dataclass
class Case:
    name: str
    pattern: str
    devices: int
    level: int
    prop: object          # the greedy Propagated
    greedy_s: float       # propagation time

    @property
    def label(self) -> str:
        return f"{self.name}/{self.pattern} on {self.devices}, level {self.level}"


def make_case(name: str, pattern: str, devices: int, level: int = 0) -> Case:
    """Stage ``name`` with the annotations of ``pattern`` and propagate greedily."""
    import fshard as fs
    from fshard.sharding.propagation import propagate

    fn, shapes, patterns = PROGRAMS[name]
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    sharded = fs.shard(fn, in_strategy=patterns[pattern](devices), mesh=devices, level=level)
    plan = sharded._prepare(args)[0]
    t0 = time.perf_counter()
    prop = propagate(plan.body, plan.in_shardings, plan.out_shardings, plan.mesh, level)
    return Case(name, pattern, devices, level, prop, time.perf_counter() - t0)


def all_cases(levels=(0,)):
    for name, (_, _, patterns) in PROGRAMS.items():
        for pattern in patterns:
            for n in DEVICES:
                for level in levels:
                    yield name, pattern, n, level


def run_case(case: Case, limit: int = 2_500_000) -> dict:
    """Greedy, search and exhaustive costs and times of one case."""
    from fshard.sharding import search

    greedy = search.cost(case.prop).score(case.level)
    found = search.search(case.prop)
    best = search.exhaustive(case.prop, limit=limit)
    return {
        "case": case.label, "equations": len(case.prop.program.equations),
        "greedy": greedy[0], "search": found.score[0],
        "optimum": None if best is None else best.score[0],
        "search_full": list(found.score), "optimum_full": None if best is None
        else list(best.score),
        "search_exact": found.exact,
        "greedy_s": case.greedy_s, "search_s": found.seconds,
        "exhaustive_s": None if best is None else best.seconds,
        "search_evals": found.evaluations,
        "exhaustive_evals": None if best is None else best.evaluations,
    }


def summary(rows: list) -> dict:
    done = [r for r in rows if r["optimum"] is not None]
    hit = [r for r in done if r["search_full"] == r["optimum_full"]]
    greedy_hit = [r for r in done if r["greedy"] <= r["optimum"] * (1 + 1e-9)]
    gaps = [r["search"] / r["optimum"] - 1 for r in done if r["optimum"]]
    ggaps = [r["greedy"] / r["optimum"] - 1 for r in done if r["optimum"]]
    return {"cases": len(rows), "with_optimum": len(done), "search_optimal": len(hit),
            "greedy_optimal": len(greedy_hit), "worst_search_gap": max(gaps, default=0.0),
            "worst_greedy_gap": max(ggaps, default=0.0),
            "search_worse_than_greedy": sum(r["search"] > r["greedy"] * (1 + 1e-9)
                                            for r in rows)}


def measure(quick: bool = False, levels=(0, 1, 2)) -> list:
    rows = []
    for name, pattern, n, level in all_cases(levels):
        if quick and (name, pattern, n) not in FAST:
            continue
        r = run_case(make_case(name, pattern, n, level))
        print(f"  {r['case']:45s} greedy {r['greedy']:>12.6g}  search {r['search']:>12.6g}  "
              f"optimum {r['optimum'] if r['optimum'] is None else format(r['optimum'], '>12.6g')}"
              f"  ({r['search_s'] * 1e3:.0f} ms / {(r['exhaustive_s'] or 0) * 1e3:.0f} ms)",
              flush=True)
        rows.append(r)
    return rows


def markdown(rows: list) -> str:
    """Every case as a Markdown row (≠ marks a search result that is not the optimum)."""
    lines = ["| program / annotations | devices | level | eqs | greedy | search | optimum | "
             "propagate | search | exhaustive |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name, rest = r["case"].split(" on ")
        n, level = rest.split(", level ")
        opt = "-" if r["optimum"] is None else _num(r["optimum"])
        mark = "" if r["optimum"] is None or r["search_full"] == r["optimum_full"] else " ≠"
        lines.append(
            f"| {name} | {n} | {level} | {r['equations']} | {_num(r['greedy'])} | "
            f"{_num(r['search'])}{mark} | {opt} | {r['greedy_s'] * 1e3:.1f} ms | "
            f"{r['search_s'] * 1e3:.0f} ms | "
            + ("-" if r["exhaustive_s"] is None else f"{r['exhaustive_s'] * 1e3:.0f} ms")
            + " |")
    return "\n".join(lines)


def summary_markdown(rows: list) -> str:
    """One line per level: how often search and greedy reach the optimum, and times."""
    lines = ["| level | cases | with optimum | search = optimum | greedy = optimum | "
             "worst greedy / optimum | search time (median / max) | "
             "exhaustive time (median / max) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for level in sorted({r["case"].rsplit(" ", 1)[1] for r in rows}):
        rs = [r for r in rows if r["case"].endswith(f"level {level}")]
        s = summary(rs)
        st = sorted(r["search_s"] for r in rs)
        et = sorted(r["exhaustive_s"] for r in rs if r["exhaustive_s"] is not None)
        lines.append(
            f"| {level} | {s['cases']} | {s['with_optimum']} | {s['search_optimal']} | "
            f"{s['greedy_optimal']} | {1 + s['worst_greedy_gap']:.1f}x | "
            f"{st[len(st) // 2] * 1e3:.0f} / {st[-1] * 1e3:.0f} ms | "
            f"{et[len(et) // 2] * 1e3:.0f} / {et[-1] * 1e3:.0f} ms |")
    return "\n".join(lines)


def _num(x: float) -> str:
    return f"{x:.4g}" if x < 1 else f"{x:,.0f}"


# ---------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------


def search_benchmark(ctx):
    from benchmarks.harness import Result, Row

    rows = measure(ctx.quick)
    out = []
    for r in rows:
        note = (f"greedy {_num(r['greedy'])}, search {_num(r['search'])}, optimum "
                f"{'-' if r['optimum'] is None else _num(r['optimum'])}")
        for system, key in (("greedy", "greedy_s"), ("search", "search_s"),
                            ("exhaustive", "exhaustive_s")):
            if r[key] is not None:
                out.append(Row("fshard", f"{r['case']}: {system}", r[key], r[key], 1, note))
    s = summary(rows)
    notes = [
        f"search reaches the exhaustive optimum in {s['search_optimal']} of "
        f"{s['with_optimum']} cases with one (worst search / optimum "
        f"{1 + s['worst_search_gap']:.3f}x); greedy propagation in {s['greedy_optimal']} "
        f"(worst greedy / optimum {1 + s['worst_greedy_gap']:.1f}x); search worse than "
        f"greedy: {s['search_worse_than_greedy']} of {s['cases']}",
        "costs are the objective of the level (0: alpha*compute + beta*bytes; 1: peak "
        "bytes per device; 2: seconds); each time is one run",
        "per level: " + summary_markdown(rows).replace("\n", " / "),
    ]
    return Result(out, baseline=None, target="search = exhaustive optimum on every case",
                  notes=notes)


def _register():
    from benchmarks import harness

    harness.benchmark("search", title="sharding search vs greedy propagation and the "
                      "exhaustive optimum")(search_benchmark)


_register()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.search")
    p.add_argument("--quick", action="store_true", help="the fast subset only")
    p.add_argument("--level", type=int, action="append",
                   help="objective level(s) (default 0, 1 and 2)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = measure(args.quick, tuple(args.level or (0, 1, 2)))
    if args.json:
        import json

        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    print()
    print(markdown(rows))
    print()
    print(summary_markdown(rows))
    print()
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
