"""The benchmark registry, the run context, and reporting (table + JSON).

A benchmark is one function ``fn(ctx) -> Result`` registered with
``@benchmark(name, ...)``. It measures with ``ctx.compare`` / ``ctx.measure``
(median and min of ``ctx.runs(full, quick)`` calls, each including the wait for
its result), attaches JAX numbers with ``ctx.jax_rows(name)``, and returns a
``Result`` whose rows are reported relative to its ``baseline`` row.

    @benchmark("vmap_mlp", title="vmap of an MLP", jax="vmap_mlp")
    def vmap_mlp(ctx):
        t = ctx.compare({"fshard": ..., "mindspore": ...}, runs=ctx.runs(300, 30))
        return Result(rows=[Row("fshard", "fs.vmap", **t["fshard"]), ...],
                      baseline="fs.vmap", target="...")
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from typing import Callable

from benchmarks import timing


@dataclasses.dataclass
class Row:
    """One measured variant: which system, what was run, and its timings (seconds)."""

    system: str           # "fshard", "mindspore", "jax", "numpy"
    label: str            # what exactly was timed
    median_s: float
    min_s: float
    runs: int
    note: str = ""


@dataclasses.dataclass
class Result:
    """A benchmark's rows; ``baseline`` names the row the ratios are relative to."""

    rows: list
    baseline: str | None = None
    target: str = ""
    notes: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Benchmark:
    name: str
    title: str
    fn: Callable
    jax: tuple            # names of baselines in jax_baselines.py this benchmark reads


REGISTRY: dict[str, Benchmark] = {}


def benchmark(name: str, *, title: str, jax=()):
    """Register ``fn(ctx) -> Result`` as the benchmark ``name``.

    >>> @benchmark("noop", title="does nothing")
    ... def noop(ctx):
    ...     return Result(rows=[])
    >>> REGISTRY.pop("noop").title
    'does nothing'
    """
    jax = (jax,) if isinstance(jax, str) else tuple(jax)

    def deco(fn):
        if name in REGISTRY:
            raise ValueError(f"benchmark {name!r} is registered twice")
        REGISTRY[name] = Benchmark(name, title, fn, jax)
        return fn

    return deco


class Context:
    """What a benchmark function gets: the mode, timing helpers and JAX results."""

    def __init__(self, quick: bool, jax_results: dict | None = None):
        self.quick = quick
        self._jax = jax_results or {}

    def runs(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    measure = staticmethod(timing.measure)
    compare = staticmethod(timing.compare)
    measure_each = staticmethod(timing.measure_each)
    measure_each_interleaved = staticmethod(timing.measure_each_interleaved)

    def jax_rows(self, name: str) -> list[Row]:
        """The JAX baseline ``name`` as rows (empty, with a note, when unavailable)."""
        entry = self._jax.get(name)
        if not entry:
            return []
        return [Row("jax", label, t["median_s"], t["min_s"], t["runs"], t.get("note", ""))
                for label, t in entry.items() if not label.startswith("_")]

    def jax_check(self, name: str) -> dict | None:
        """What the JAX baseline ``name`` reports to check it ran the same model (its
        ``"_check"`` entry: first losses, parameter counts), or None without it."""
        return (self._jax.get(name) or {}).get("_check")

    def jax_error(self) -> str | None:
        return self._jax.get("_error")


def row(system: str, label: str, t: dict, note: str = "") -> Row:
    """A Row from a ``timing`` dict."""
    return Row(system, label, t["median_s"], t["min_s"], t["runs"], note)


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def fmt_time(s: float) -> str:
    """``1.5e-05`` -> ``'15.0 µs'``.

    >>> fmt_time(1.5e-05), fmt_time(0.0123), fmt_time(2.5)
    ('15.0 µs', '12.30 ms', '2.500 s')
    """
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def ratios(result: Result) -> list[str]:
    """Each row's median relative to the baseline row's median (``"1.00x"``)."""
    base = next((r for r in result.rows if r.label == result.baseline), None)
    out = []
    for r in result.rows:
        out.append("" if base is None or base.median_s == 0 else f"{r.median_s / base.median_s:.2f}x")
    return out


def machine() -> dict:
    """What ran the benchmarks (stored with the results)."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": _cpu_model(),
    }
    try:
        import mindspore
        import numpy

        info["mindspore"] = mindspore.__version__
        info["numpy"] = numpy.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def print_table(name: str, bench: Benchmark, result: Result) -> None:
    rs = ratios(result)
    header = ["system", "variant", "median", "min", "runs", "ratio"]
    body = [[r.system, r.label, fmt_time(r.median_s), fmt_time(r.min_s), str(r.runs), q]
            for r, q in zip(result.rows, rs)]
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"{name}: {bench.title}", title_justify="left")
        for i, h in enumerate(header):
            t.add_column(h, justify="right" if i >= 2 else "left")
        for b in body:
            t.add_row(*b)
        # a pipe or file gets a wide table too, not rich's 80-column default
        con = Console(width=None if os.isatty(1) else 120)
        con.print(t)
        con.print(f"  ratio: median relative to '{result.baseline}'", highlight=False)
        if result.target:
            con.print(f"  target: {result.target}", highlight=False)
        for n in result.notes:
            con.print(f"  note: {n}", highlight=False)
    except ImportError:
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
                  for i, h in enumerate(header)]
        print(f"\n{name}: {bench.title}")
        print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for b in body:
            print("  ".join(c.ljust(w) for c, w in zip(b, widths)))
        if result.target:
            print(f"  target: {result.target}")
        for n in result.notes:
            print(f"  note: {n}")


def markdown(name: str, entry: dict) -> str:
    """A stored result (one entry of latest.json) as a Markdown table, for the docs."""
    lines = [f"`{name}`: {entry['title']}"
             + (" (quick run: not a measurement)" if entry.get("quick") else ""), "",
             "| system | variant | median | min | runs | ratio |",
             "|---|---|---:|---:|---:|---:|"]
    for r in entry["rows"]:
        label = r["label"] + (f" ({r['note']})" if r.get("note") else "")
        lines.append(f"| {r['system']} | {label} | {fmt_time(r['median_s'])} | "
                     f"{fmt_time(r['min_s'])} | {r['runs']} | {r['ratio']} |")
    lines.append("")
    lines.append(f"Ratio: median relative to *{entry['baseline']}*. Measured {entry.get('date', '?')}.")
    return "\n".join(lines)


def to_json(name: str, bench: Benchmark, result: Result) -> dict:
    rs = ratios(result)
    return {
        "title": bench.title,
        "baseline": result.baseline,
        "target": result.target,
        "notes": result.notes,
        "rows": [dict(dataclasses.asdict(r), ratio=q) for r, q in zip(result.rows, rs)],
    }


def write_json(path: str, results: dict, meta: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    doc = {"meta": dict(meta, date=time.strftime("%Y-%m-%d %H:%M:%S")), "benchmarks": results}
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    os.replace(tmp, path)


def warm_up_compiler():
    """Compile and run one tiny ``mindspore.jit`` graph, untimed: MindSpore's first
    compile in a process pays its own start-up (~1-4 s), which the first call timed
    would otherwise carry alone."""
    import mindspore as ms

    ms.jit(_tiny)(ms.Tensor([1.0])).asnumpy()


def _tiny(a):
    return a * 2.0 + 1.0
