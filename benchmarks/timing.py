"""Timing primitives shared by the MindSpore side and the JAX subprocess.

Pure Python + NumPy (no MindSpore, no JAX) so that both environments import it.
Every measurement is a list of per-call wall times; we report the median (the
typical cost on a shared, noisy machine) and the minimum (the cost when nothing
else got in the way).

>>> t = measure(lambda: sum(range(10)), runs=50, warmup=5)
>>> t["runs"], t["median_s"] >= t["min_s"] > 0
(50, True)
"""

from __future__ import annotations

import gc
import statistics
import time


def _stats(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "runs": len(times)}


def measure(fn, runs: int, warmup: int = 3) -> dict:
    """Call ``fn()`` ``warmup`` times, then time ``runs`` calls one by one.

    ``fn`` must include waiting for its result (e.g. ``.asnumpy()``). The garbage
    collector is paused while timing, as ``timeit`` does.

    >>> measure(lambda: None, runs=10, warmup=0)["runs"]
    10
    """
    for _ in range(warmup):
        fn()
    times = []
    perf = time.perf_counter
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(runs):
            t0 = perf()
            fn()
            times.append(perf() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return _stats(times)


def compare(fns: dict, runs: int, warmup: int = 3, rounds: int = 5) -> dict:
    """Time several callables interleaved: ``rounds`` rounds, each running every
    callable ``runs // rounds`` times, so that a burst of noise on a shared machine
    hits all of them instead of whichever happened to run then.

    >>> r = compare({"a": lambda: None, "b": lambda: None}, runs=20, warmup=0)
    >>> sorted(r), r["a"]["runs"]
    (['a', 'b'], 20)
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    rounds = max(1, min(rounds, runs))
    per_round = [runs // rounds + (1 if i < runs % rounds else 0) for i in range(rounds)]
    times: dict = {k: [] for k in fns}
    perf = time.perf_counter
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for n in per_round:
            for k, fn in fns.items():
                acc = times[k]
                for _ in range(n):
                    t0 = perf()
                    fn()
                    acc.append(perf() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return {k: _stats(v) for k, v in times.items()}


def once(fn) -> tuple[float, object]:
    """``(seconds, result)`` of one call of ``fn()`` (for compile-like costs)."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure_each(make, runs: int) -> dict:
    """Time ``runs`` calls of a freshly made callable: ``make()`` (untimed) returns
    the thing to time, so every run pays the first-call costs (tracing, compiling).

    >>> measure_each(lambda: (lambda: None), runs=3)["runs"]
    3
    """
    times = []
    for _ in range(runs):
        fn = make()
        gc.collect()
        t, _ = once(fn)
        times.append(t)
    return _stats(times)


def measure_each_interleaved(makes: dict, runs: int) -> dict:
    """``measure_each`` of several callables, taking turns (``a, b, a, b, ...``) so that
    no one of them pays alone for what the process does once, nor for a busier spell of
    a shared machine.

    >>> sorted(measure_each_interleaved({"a": lambda: (lambda: None),
    ...                                  "b": lambda: (lambda: None)}, runs=2).items())[0][1]["runs"]
    2
    """
    times: dict = {name: [] for name in makes}
    for _ in range(runs):
        for name, make in makes.items():
            fn = make()
            gc.collect()
            t, _ = once(fn)
            times[name].append(t)
    return {name: _stats(ts) for name, ts in times.items()}
