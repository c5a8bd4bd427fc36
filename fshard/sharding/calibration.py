"""This machine's rates, measured: ``fs.sharding.calibrate()`` times the collectives of a
virtual mesh and the compute of the dominant primitives as fshard compiles them, and
caches the table on disk; the cost model (``fshard.sharding.cost``) prices plans with it
when it is there, with ``cost.BACKEND_RATES`` otherwise.

What is measured (each time the median of several calls of a compiled program, each
rate a least-squares line through several sizes, so a busy machine moves the numbers
little):

- ``op_s``: the fixed cost of one more kernel in a compiled program (a chain of 1 and of
  65 small adds);
- ``call_s``: the fixed cost of calling a compiled program (the intercept of that chain);
- ``flops_per_s``: a matmul's flops (``2·m·k·n`` per device) per second, batched over
  the devices as a virtual mesh runs it, over four thin and wide block shapes, with the
  right operand per device and shared;
- ``point_s``: the seconds per element of an elementwise op (an add over three sizes);
- per collective (``all_reduce``, ``all_gather``) and group size ``n``:
  ``(fixed seconds, seconds per byte of each device's block)`` of the virtual mesh's
  collective over an axis of ``n`` devices of a mesh of ``devices``, three block sizes.

A virtual mesh runs every device in this process, batched over the device axis, so a
per-device computation costs ``devices`` times its work (``lanes``); a collective's time
is measured as it runs there. The cache file is per backend, MindSpore version and device
count, in ``$FSHARD_CACHE_DIR`` (default ``$XDG_CACHE_HOME/fshard`` or ``~/.cache/fshard``).
A multi-process job keeps the default table (``benchmarks/cost_rates.py`` measured it
between processes): measuring a job's collectives needs the job.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from fshard.core import dtypes
from fshard.backend import mindspore as backend
from fshard.core.tracing import ArrayType
from fshard.errors import ShardingError
from fshard.primitives import collectives as C
from fshard.primitives.elementwise import add
from fshard.primitives.linalg import matmul
from fshard.sharding.rates import (FORMAT, cache_path, check_devices, default_devices,
                                   load_cache_clear)
from fshard.sharding.runtime import run_batched
from fshard.core.staging import stage

#: Group sizes measured (those dividing the device count).
GROUPS = (2, 4, 8)


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


def _compile(fn, avals):
    program, consts = stage(fn, avals)
    src, globals_, _ = backend.lower_program(program, consts, "calibrate")
    return backend.compile_source(src, globals_, "calibrate")


def _call(compiled, args) -> None:
    out = compiled(*args)
    backend.to_numpy(out[0] if isinstance(out, tuple) else out)


def _times(items, runs: int, rounds: int = 3) -> list[float]:
    """Seconds of one call of each ``(compiled, args)``: timed interleaved in ``rounds``,
    each round's median of ``runs`` calls, the least round kept (another process's work
    only ever adds time, and it comes and goes)."""
    for compiled, args in items:
        _call(compiled, args)
    best = [float("inf")] * len(items)
    for _ in range(rounds):
        for j, (compiled, args) in enumerate(items):
            ts = []
            for _ in range(runs):
                t0 = time.perf_counter()
                _call(compiled, args)
                ts.append(time.perf_counter() - t0)
            best[j] = min(best[j], float(np.median(ts)))
    return best


def _fit(xs, ts) -> tuple[float, float]:
    """Least squares ``t = a + b·x`` (both kept >= 0: a noisy machine can tilt a line)."""
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ts, float), 1)
    return max(float(a), 0.0), max(float(b), 1e-15)


def _tensor(shape, seed=0):
    rng = np.random.default_rng(seed)
    return backend.as_tensor(rng.standard_normal(shape).astype(np.float32))


def _f32(shape) -> ArrayType:
    return ArrayType(tuple(shape), dtypes.float32)


def _chain(k: int):
    def fn(x):
        for _ in range(k):
            x = add(x, x)
        return [x]
    return fn


def _batched_matmul(m: int, k: int, n: int, devices: int, both: bool) -> tuple:
    inner, consts = stage(lambda a, b: [matmul(a, b)], [_f32((m, k)), _f32((k, n))])
    axes, lanes = [("g", devices)], frozenset({"g"})
    b_lead = (devices,) if both else ()

    def whole(a, b):
        return run_batched(inner, list(consts) + [a, b], [frozenset()] * len(consts) + [
            lanes, lanes if both else frozenset()], [lanes], axes)

    return (_compile(whole, [_f32((devices, m, k)), _f32(b_lead + (k, n))]),
            [_tensor((devices, m, k)), _tensor(b_lead + (k, n), 1)])


def _measure_compute(runs: int, devices: int) -> dict:
    x = _tensor((64,))
    # The first calls of a process pay one-off costs: warm up on a program of its own.
    _times([(_compile(_chain(2), [_f32((64,))]), [x])], 3, 1)
    ks = (1, 65)
    ts = _times([(_compile(_chain(k), [_f32((64,))]), [x]) for k in ks], runs)
    call_s, op_s = _fit(ks, ts)
    # Matmuls as a virtual mesh runs them: each device's block, batched over the devices,
    # the right operand batched too (a weight gradient's) or shared (a replicated weight);
    # the thin and wide shapes of split activations, not a square peak-rate kernel.
    shapes = ((32, 64, 512), (64, 512, 32), (32, 512, 512), (512, 32, 512))
    items, flops = [], []
    for both in (True, False):
        for m, k, n in shapes:
            items.append(_batched_matmul(m, k, n, devices, both))
            flops.append(2.0 * devices * m * k * n)
    _, s_per_flop = _fit(flops, _times(items, runs))
    sizes = (1 << 16, 1 << 20, 1 << 22)
    items = [(_compile(lambda a, b: [add(a, b)], [_f32((size,)), _f32((size,))]),
              [_tensor((size,)), _tensor((size,), 1)]) for size in sizes]
    _, point_s = _fit(sizes, _times(items, runs))
    return {"call_s": call_s, "op_s": op_s, "flops_per_s": 1.0 / s_per_flop,
            "point_s": point_s}


def _measure_collective(kind: str, n: int, devices: int, runs: int) -> tuple[float, float]:
    """``(fixed s, s per byte of a device's block)`` of ``kind`` over an axis of ``n``
    devices of a virtual mesh of ``devices``, as ``fs.shard`` runs it (batched)."""
    axes = [("g", n)] + ([("r", devices // n)] if devices > n else [])
    sizes, items = (1 << 8, 1 << 14, 1 << 17), []
    for elems in sizes:
        local = _f32((elems,))

        def per_device(x):
            if kind == "all_reduce":
                return [C.psum_p.bind(x, axis_name=("g",))]
            return [C.all_gather_p.bind(x, axis_name=("g",), axis_sizes=(n,), axis=0)]

        inner, inner_consts = stage(per_device, [local])
        split = frozenset(a for a, _ in axes)
        lead = tuple(s for _, s in axes)

        def whole(blocks):
            return run_batched(inner, list(inner_consts) + [blocks],
                               [frozenset()] * len(inner_consts) + [split], [split], axes)

        items.append((_compile(whole, [_f32(lead + (elems,))]), [_tensor(lead + (elems,))]))
    return _fit([4.0 * e for e in sizes], _times(items, runs))


def measure(devices: int, runs: int = 7) -> dict:
    """A fresh table for ``devices`` virtual devices (not saved)."""
    devices = check_devices(devices)
    t0 = time.perf_counter()
    table = {"format": FORMAT, "backend": backend.device_target(),
             "mindspore": backend.ms_version(), "devices": devices, "lanes": True}
    compute = _measure_compute(runs, devices)
    table.update(compute)
    for kind in ("all_reduce", "all_gather"):
        per_n = {}
        for n in GROUPS:
            if n <= devices and devices % n == 0:
                a, b = _measure_collective(kind, n, devices, runs)
                # The call's own fixed cost is in every program once, not per collective.
                per_n[str(n)] = [max(a - compute["call_s"], 0.0), b]
        if devices > 1 and str(devices) not in per_n:
            a, b = _measure_collective(kind, devices, devices, runs)
            per_n[str(devices)] = [max(a - compute["call_s"], 0.0), b]
        table[kind] = per_n
    table["seconds"] = time.perf_counter() - t0
    table["loadavg"] = list(os.getloadavg())
    return table


def calibrate(devices: int | None = None, *, runs: int = 7) -> dict:
    """Measure this machine's rates for a virtual mesh of ``devices`` (default
    ``FSHARD_DEVICES``, else 8) and cache them on disk (``cache_path(devices)``); the
    planner prices plans with them from now on (and in later processes). Returns the
    table. A few seconds; re-run it after a change of machine, backend or MindSpore
    version (each has its own file) or to measure again.

    >>> import fshard as fs
    >>> table = fs.sharding.calibrate(devices=2, runs=3)   # doctest: +SKIP
    >>> sorted(table["all_reduce"])                        # doctest: +SKIP
    ['2']
    """
    devices = check_devices(default_devices() if devices is None else devices)
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ShardingError(f"fs.sharding.calibrate: runs must be a positive int (calls "
                            f"timed per measurement); got {runs!r}.\nFix: pass e.g. runs=7.")
    table = measure(devices, runs)
    path = cache_path(devices)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        raise ShardingError(
            f"fs.sharding.calibrate: cannot write the table to {str(path)!r} ({e}).\nFix: "
            f"set FSHARD_CACHE_DIR to a writable directory.") from e
    load_cache_clear()
    return table
