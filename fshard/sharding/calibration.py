"""This machine's rates, measured: ``fs.sharding.calibrate()`` times the collectives of a
virtual mesh and the compute of the dominant primitives as fshard compiles them, and
caches the table on disk; the cost model (``fshard.sharding.cost``) prices plans with it
when it is there, with ``cost.BACKEND_RATES`` otherwise.

What is measured (each time the median of every call of a compiled program over
several rounds, after ``WARMUP_CALLS`` untimed calls, each rate a robust line through
several sizes, so a busy machine moves the numbers little):

- ``op_s``: the fixed cost of one more kernel in a compiled program (graphs shaped like
  a training step's, forward, backward and update, of 144 to 288 kernels on small
  blocks);
- ``call_s``: the fixed cost of calling a compiled program (the intercept of chains of 1
  to 65 small adds);
- ``arg_s``: what each more value passed in or out of the call adds (programs of 1, 17
  and 33 inputs and outputs): a training step's state crosses the call leaf by leaf;
- ``matmul_points``: a matmul kernel's seconds at each size measured (its flops,
  ``2·m·k·n`` per device times the devices it is batched over, as a virtual mesh runs
  it), over thin, wide and square block shapes with the right operand per device and
  shared: a small matmul runs far below a large one's rate. Below ``CHAINED_FLOPS`` a
  matmul is timed as it runs between a step's other kernels (the extra time of more
  matmuls and relus in a chain), above it alone in its program. A size between two
  measured is priced on the line between them in logarithms; ``matmul_c``,
  ``matmul_p``: the power law ``c·flops**p`` through them all, for sizes outside;
  ``flops_per_s``, the rate at 1 Gflop;
- ``matmul_elem_s``: the seconds per element a matmul kernel reads and writes, measured
  on two that move many elements for their flops (a weight gradient of 2 rows per
  device, whose output is one whole block per device; 2 rows times a weight of each
  device's own): a matmul is priced at the slower of its flops and its elements;
- ``point_s``: the seconds per element of an elementwise op as a step runs it
  (step-shaped graphs of 90 kernels over blocks of three sizes);
- ``adam_points``: Adam's fused update of one leaf (``adam_update``: MindSpore's
  kernel with the moments copied in and out), seconds per element at 256K and 4M
  elements (``[elements, seconds]`` pairs);
- per collective (``all_reduce``, ``all_gather``) and group size ``n``:
  ``(fixed seconds, seconds per byte of each device's block)`` of the virtual mesh's
  collective over an axis of ``n`` devices of a mesh of ``devices``, three block sizes;
  ``slice``: the same for a relayout's local slice (each device taking its block of a
  value the same on the axis's devices), per byte of the value as the process holds it
  (a virtual mesh runs it as a transpose; a job's rank as a Slice of its own value).

A virtual mesh runs every device in this process, batched over the device axis, so a
per-device computation costs ``devices`` times its work (``lanes``); a collective's time
is measured as it runs there. The cache file is per backend, MindSpore version and device
count, in ``$FSHARD_CACHE_DIR`` (default ``$XDG_CACHE_HOME/fshard`` or ``~/.cache/fshard``).
In a rank of a multi-process job, ``calibrate()`` (called on every rank) measures the
job instead: each process's compute as one device, and MindSpore's AllReduce and
AllGather over the job's processes; every rank keeps rank 0's numbers, in a table of its
own (``cache_path(n, job=True)``), which the ranks of later jobs of ``n`` processes plan
with. Without one a job prices with ``cost.BACKEND_RATES`` (``benchmarks/cost_rates.py``
measured it between 2 processes).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable

import numpy as np

from fshard.core import dtypes
from fshard.backend import mindspore as backend
from fshard.core.tracing import ArrayType
from fshard.errors import ShardingError
from fshard.meshes import distributed
from fshard.primitives import collectives as C
from fshard.primitives.elementwise import add, maximum, mul, sub
from fshard.primitives.linalg import matmul
from fshard.primitives.optimizers import adam_update
from fshard.primitives.spmd import block_slice
from fshard.sharding.rates import (FORMAT, cache_path, check_devices, default_devices,
                                   load_cache_clear)
from fshard.sharding.runtime import run_batched
from fshard.core.staging import stage

#: Group sizes measured (those dividing the device count).
GROUPS = (2, 4, 8)

#: Calls of a program before it is timed. MindSpore's runtime runs a graph of at most
#: 100 kernels on several threads for its first 40 calls, times calls 31-40 and then
#: 41-50 on one thread, and keeps the faster way from call 51 on: a step's graph is
#: timed in the way it keeps, so a calibration's programs are too.
WARMUP_CALLS = 50

#: Matmuls below this size (flops, batched over the devices) are timed in chains of
#: ``PAIRS[0]`` and ``PAIRS[1]`` pairs, larger ones alone (``_compute_programs``).
CHAINED_FLOPS = 5e7
PAIRS = (1, 3)
#: Layers of the step-shaped graphs an element's price is measured on.
POINT_LAYERS = 10
#: Leaf sizes Adam's fused update is timed at: in cache (1 MiB) and far out of it.
ADAM_SIZES = (1 << 18, 1 << 22)


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


def _times(items, runs: int, rounds: int = 3, barrier=None) -> list[float]:
    """Seconds of one call of each ``(compiled, args)``: the median of all its calls,
    ``runs`` per round over ``rounds`` rounds, the items interleaved. On a shared machine
    a program's round medians spread widely (two identical programs, timed interleaved,
    4.2-8.0 ms a round), so the least of a few of them is a draw of its own; the median
    of every call holds within a few percent between programs and processes, and is
    what ``benchmarks/prediction.py`` compares the plans' predictions with.
    ``barrier``: called before each call, untimed (in a job: every rank runs the same
    program at the same time, as in a step, whose collectives keep the ranks in step;
    ranks that drift apart run their kernels beside the other's idle moments, faster
    than a step does)."""
    for compiled, args in items:
        for _ in range(WARMUP_CALLS):
            _call(compiled, args)
    calls: list[list[float]] = [[] for _ in items]
    for _ in range(rounds):
        for j, (compiled, args) in enumerate(items):
            for _ in range(runs):
                if barrier is not None:
                    barrier()
                t0 = time.perf_counter()
                _call(compiled, args)
                calls[j].append(time.perf_counter() - t0)
    return [float(np.median(ts)) for ts in calls]


def _fit(xs, ts, clip: bool = True) -> tuple[float, float]:
    """A line ``t = a + b·x`` through the measurements, robustly (Theil-Sen: the median
    of the slopes between every two sizes, then the median intercept), so one call that
    another process slowed cannot tilt it; both kept >= 0 unless ``clip`` is False."""
    xs, ts = np.asarray(xs, float), np.asarray(ts, float)
    i, j = np.triu_indices(len(xs), 1)
    keep = xs[j] != xs[i]
    b = float(np.median((ts[j] - ts[i])[keep] / (xs[j] - xs[i])[keep]))
    a = float(np.median(ts - b * xs))
    return (max(a, 0.0), max(b, 1e-15)) if clip else (a, b)


def _tensor(shape, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return backend.as_tensor((scale * rng.standard_normal(shape)).astype(np.float32))


def _f32(shape) -> ArrayType:
    return ArrayType(tuple(shape), dtypes.float32)


def _chain(k: int):
    def fn(x):
        for _ in range(k):
            x = add(x, x)
        return [x]
    return fn


def _batched_matmul(m: int, k: int, n: int, devices: int, both: bool, pairs: int = 0
                    ) -> tuple:
    """A matmul ``(m, k) @ (k, n)`` as a virtual mesh runs it, batched over ``devices``,
    the right operand batched too (``both``) or shared; ``pairs`` > 0: a chain of that
    many pairs ``relu(relu(x @ w1) @ w2)``, ``w2`` of shape ``(n, k)`` (two matmuls of
    the same flops, each followed by a kernel of another kind, as in a step)."""
    def per_device(a, w1, w2=None):
        if not pairs:
            return [matmul(a, w1)]
        h = a
        for _ in range(pairs):
            h = maximum(matmul(maximum(matmul(h, w1), 0.0), w2), 0.0)
        return [h]

    shapes = [(m, k), (k, n)] + ([(n, k)] if pairs else [])
    inner, consts = stage(per_device, [_f32(s) for s in shapes])
    axes, lanes = [("g", devices)], frozenset({"g"})
    right = lanes if both else frozenset()
    b_lead = (devices,) if both else ()

    def whole(*xs):
        return run_batched(inner, list(consts) + list(xs), [frozenset()] * len(consts) + [
            lanes] + [right] * (len(xs) - 1), [lanes], axes)

    avals = [(devices, m, k)] + [b_lead + s for s in shapes[1:]]
    # (weights of variance 2/fan-in: a chain's values keep their size through the relus)
    args = [_tensor(avals[0])] + [_tensor(a, i + 1, np.sqrt(2.0 / a[-2]))
                                  for i, a in enumerate(avals[1:])]
    return _compile(whole, [_f32(a) for a in avals]), args


def _step_shaped(layers: int):
    """A graph shaped like a training step's, on small blocks: a forward chain through
    ``layers`` weights, a backward chain that reads the saved activations back, and an
    update of each weight on its own (``9·layers`` kernels). A kernel costs more in such a
    graph than in a chain of one kind: values live long and are read by several kernels,
    and kinds alternate."""
    def fn(x, *ws):
        hs = [x]
        for w in ws:
            hs.append(maximum(mul(hs[-1], w), 0.0))
        g, grads = hs[-1], []
        for w, h in zip(reversed(ws), reversed(hs[:-1])):
            grads.append(mul(g, h))
            g = mul(g, w)
        return [sub(w, mul(mul(gr, 0.1), add(mul(gr, gr), 1e-8)))
                for w, gr in zip(ws, reversed(grads))]
    return fn


def _chained_kernel_s(short_s: float, long_s: float, relu_elements: int, op_s: float,
                      point_s: float) -> float:
    """One matmul kernel's seconds from the chains of ``PAIRS[0]`` and ``PAIRS[1]`` pairs
    (``_batched_matmul``): each more pair runs two matmuls and two relus, each kernel
    at ``op_s`` plus its work (the relus' ``relu_elements``, both outputs of a pair
    over every device, at ``point_s``).

    >>> more = PAIRS[1] - PAIRS[0]       # 20 us a matmul, 3 us a kernel, 100K elements
    >>> long = 1e-3 + more * (2 * 20e-6 + 4 * 3e-6 + 1e5 * 1e-10)
    >>> round(_chained_kernel_s(1e-3, long, 100_000, 3e-6, 1e-10) * 1e6, 3)
    20.0
    """
    per_pair = (long_s - short_s) / (PAIRS[1] - PAIRS[0])
    return max(per_pair - 4 * op_s - point_s * relu_elements, 4e-7) / 2


def _adam(m, v, g, lr):
    mu, nu, updates = adam_update([m], [v], [g], lr, b1=0.9, b2=0.999, eps=1e-8)
    return mu + nu + updates


def _many(k: int):
    def fn(*xs):
        return [add(x, x) for x in xs]
    return fn


def _compute_programs(devices: int) -> tuple[list, Callable[[list], dict]]:
    """The compute's programs (``(compiled, args)``) and the function that makes the
    table's compute numbers of their times."""
    x = _tensor((64,))
    # The first calls of a process pay one-off costs: warm up on a program of its own.
    _times([(_compile(_chain(2), [_f32((64,))]), [x])], 3, 1)
    items: list = []

    def add(group):
        start = len(items)
        items.extend(group)
        return slice(start, len(items))

    chain_ks = (1, 9, 17, 33, 65)
    chains = add([(_compile(_chain(k), [_f32((64,))]), [x]) for k in chain_ks])
    many_ks = (1, 17, 33)
    many = add([(_compile(_many(k), [_f32((64,))] * k),
                 [_tensor((64,), i) for i in range(k)]) for k in many_ks])
    # MindSpore's CPU runtime launches each kernel of a graph of more than about 100 at
    # a higher cost (2-3 us below, 4-5 us above in a chain of adds, on 2 cores), and a
    # kernel of a step-shaped graph costs more again (5-12 us): one kernel's cost is
    # measured on step-shaped graphs of 144 to 288 kernels (``_step_shaped``), the
    # call and its values taken out: the median of their times per kernel (steadier
    # than a line's slope, which the jumps between lengths tilt).
    layers = (16, 24, 32)
    steps = add([(_compile(_step_shaped(n), [_f32((16, 16))] * (n + 1)),
                  [_tensor((16, 16), i) for i in range(n + 1)]) for n in layers])
    # Matmuls as a virtual mesh runs them: each device's block, batched over the devices,
    # the right operand batched too (a weight gradient's) or shared (a replicated weight);
    # the thin and wide shapes of split activations, small and larger square-ish ones.
    # A small one is priced as it runs inside a step: the extra time of ``PAIRS[1] -
    # PAIRS[0]`` more pairs of matmuls in a chain (each followed by a relu), so the call
    # falls out. Alone in a program, a 2-Mflop matmul took 35-73 us, in a chain 18-30 us
    # (its kernel in a step, profiled: 15-18 us); from 50 Mflop on, the two mostly agree
    # within 20% and a large one is timed alone (a chain of them would take seconds).
    shapes = ((8, 128, 16), (8, 64, 128), (32, 64, 64), (32, 64, 512), (64, 512, 32),
              (64, 256, 256), (32, 512, 512), (512, 32, 512), (256, 64, 512),
              (128, 512, 256), (256, 512, 512))
    sized = [(both, (m, k, n), 2.0 * devices * m * k * n)
             for both in (True, False) for m, k, n in shapes]
    chained = [(both, s, f) for both, s, f in sized if f < CHAINED_FLOPS]
    alone = [(both, s, f) for both, s, f in sized if f >= CHAINED_FLOPS]
    flops = [f for _, _, f in chained] + [f for _, _, f in alone]
    chains_mm = add([_batched_matmul(*s, devices, both, pairs)
                     for both, s, _ in chained for pairs in PAIRS])
    matmuls = add([_batched_matmul(*s, devices, both) for both, s, _ in alone])
    # Matmuls that move many elements for their flops, timed alone: a weight gradient of
    # a few rows per device (its output, one block per device, far larger than its
    # operands) and a few rows times a weight each device holds its own copy of. Such a
    # kernel's time is its elements', not its flops' (at 2 Mflop per 1M elements out:
    # 3-6x what the flop rate gives), so its elements' rate is measured on its own.
    moving = [(1024, 2, 8192 // devices), (2, 1024, 8192 // devices)]
    moved = [devices * (m * k + k * n + m * n) for m, k, n in moving]
    movers = add([_batched_matmul(m, k, n, devices, True) for m, k, n in moving])
    # Adam's fused update of one leaf (MindSpore's kernel, the moments copied in and
    # out), per element, in cache and far out of it: its copies run at the memory's
    # speed, so a large leaf costs more per element.
    adams = add([(_compile(_adam, [_f32((n,))] * 3 + [_f32(())]),
                  [_tensor((n,), i) for i in range(3)] + [_tensor(())])
                 for n in ADAM_SIZES])
    # An elementwise op's seconds per element as it runs in a step: the extra time of
    # step-shaped graphs of ``POINT_LAYERS`` layers (90 kernels, as many as most steps
    # run) over larger blocks, so the call and the kernels' fixed costs fall out. (In
    # a chain of adds over values in cache, an element cost about half as much: 85-140
    # ps, against 120-300 ps in a step-shaped graph, where values live long and are
    # read by several kernels.) The sizes of a step's blocks and weights, 16K-256K elements.
    sizes = (1 << 14, 1 << 16, 1 << 18)
    points = add([(_compile(_step_shaped(POINT_LAYERS), [_f32((size,))] * (POINT_LAYERS + 1)),
                   [_tensor((size,), i) for i in range(POINT_LAYERS + 1)])
                  for size in sizes])

    def fit(ts: list) -> dict:
        call_s, small_op_s = _fit(chain_ks, ts[chains])
        # Each more k: one input, one output and one add.
        arg_s = max(_fit(many_ks, ts[many])[1] - small_op_s, 0.0) / 2
        op_s = float(np.median([max(t - call_s - arg_s * (2 * n - 1), 0.0) / (9 * n)
                                for n, t in zip(layers, ts[steps])]))
        _, point_s = _fit(sizes, [t / (9 * POINT_LAYERS) for t in ts[points]])
        # A matmul kernel's own seconds (alone in its program, it passes one value more
        # than the call's: two in, one out).
        chain_t = ts[chains_mm]
        seconds = [_chained_kernel_s(chain_t[2 * i], chain_t[2 * i + 1], m * (n + k) * devices,
                                     op_s, point_s)
                   for i, (_, (m, k, n), _) in enumerate(chained)]
        seconds += [max(t - call_s - arg_s - op_s, 1e-7) for t in ts[matmuls]]
        # The rate rises with the kernel's size (8.4 Mflop run at half the rate of 1
        # Gflop): a power law ``t = c·flops**p`` through the kernels' own times, fitted
        # as a line in logarithms; flops_per_s is the rate it gives at 1 Gflop.
        kernel = np.log(seconds)
        _, p = _fit(np.log(flops), kernel, clip=False)
        # A kernel's time grows at most as its flops and at least as their square root:
        # a busy machine that slowed one size can tilt the line past either, so the
        # exponent is kept in between and the factor fitted to it.
        p = min(max(p, 0.5), 1.0)
        log_c = float(np.median(kernel - p * np.log(flops)))
        # The points themselves, for sizes between the least and the largest measured:
        # a size's kernels are priced from the nearest sizes measured, not through a
        # line that every other size tilts (its exponent moved between 0.6 and 0.97
        # from process to process). Shapes of equal flops, and the two right operands,
        # give their median.
        mm = sorted((f, float(np.median([t for g, t in zip(flops, seconds) if g == f])))
                    for f in set(flops))
        elem_s = float(np.median([max(t - call_s - arg_s - op_s, 1e-7) / e
                                  for t, e in zip(ts[movers], moved)]))
        # (seven values cross the call, two of them in call_s; five kernels a leaf)
        adam = [[float(n), max(t - call_s - 5 * arg_s - 5 * op_s, 1e-7) / n]
                for n, t in zip(ADAM_SIZES, ts[adams])]
        return {"call_s": call_s, "op_s": op_s, "arg_s": arg_s, "matmul_elem_s": elem_s,
                "flops_per_s": 1e9 / (np.exp(log_c) * 1e9 ** p),
                "matmul_c": float(np.exp(log_c)), "matmul_p": float(p),
                "matmul_points": [list(pt) for pt in mm], "point_s": point_s,
                "adam_points": adam}

    return items, fit


def _collective_programs(kind: str, n: int, devices: int) -> tuple[list, Callable]:
    """The programs of ``kind`` over an axis of ``n`` devices of a virtual mesh of
    ``devices``, as ``fs.shard`` runs it (batched), and the function that makes their
    times ``(fixed s, s per byte of a device's block)``; for ``"slice"`` (each device
    taking its block of a value the same on the axis's devices: a relayout's step that
    sends nothing, which a virtual mesh runs as a transpose of the value), per byte of
    the value as the process holds it (one block per device it differs on)."""
    axes = [("g", n)] + ([("r", devices // n)] if devices > n else [])
    sizes, items = (1 << 8, 1 << 14, 1 << 17), []
    every = frozenset(a for a, _ in axes)
    # (a slice's value is the same on the devices of "g" and differs along the others)
    split = every - {"g"} if kind == "slice" else every
    lead = tuple(s for a, s in axes if a in split)
    for elems in sizes:
        local = _f32((elems,))

        def per_device(x):
            if kind == "all_reduce":
                return [C.psum_p.bind(x, axis_name=("g",))]
            if kind == "slice":
                return [block_slice(x, ("g",), 0, (n,))]
            return [C.all_gather_p.bind(x, axis_name=("g",), axis_sizes=(n,), axis=0)]

        inner, inner_consts = stage(per_device, [local])
        # The result of a reduction or gather is the same on the group's devices: a
        # plan's next equation takes it unbatched over "g" (not copied out to every
        # device, which would be priced too); a slice's differs on them.
        out = every if kind == "slice" else every - {"g"}

        def whole(blocks, inner=inner, inner_consts=inner_consts, out=out):
            return run_batched(inner, list(inner_consts) + [blocks],
                               [frozenset()] * len(inner_consts) + [split], [out], axes)

        items.append((_compile(whole, [_f32(lead + (elems,))]), [_tensor(lead + (elems,))]))
    held = math.prod(lead) if kind == "slice" else 1
    return items, lambda ts: _fit([4.0 * e * held for e in sizes], ts)


def programs(devices: int) -> tuple[list, Callable[[list], dict]]:
    """Every program the calibration of a virtual mesh of ``devices`` times, as
    ``(compiled, args)`` pairs, and the function that makes the table (the rates, not
    yet saved) of their times, one per program in seconds. ``measure`` times them all
    interleaved, so every rate is measured over the same stretch of time (this
    machine's speed moves up to 3x within 30 s)."""
    devices = check_devices(devices)
    items, fit_compute = _compute_programs(devices)
    groups = []
    for kind in ("all_reduce", "all_gather", "slice"):
        ns = [n for n in GROUPS if n <= devices and devices % n == 0]
        if devices > 1 and devices not in ns:
            ns.append(devices)
        for n in ns:
            more, fit = _collective_programs(kind, n, devices)
            groups.append((kind, n, slice(len(items), len(items) + len(more)), fit))
            items = items + more

    def fit(ts: list) -> dict:
        table = {"format": FORMAT, "backend": backend.device_target(),
                 "mindspore": backend.ms_version(), "devices": devices, "lanes": True}
        compute = fit_compute(ts)
        table.update(compute)
        table.update({"all_reduce": {}, "all_gather": {}, "slice": {}})
        for kind, n, where, fit_group in groups:
            a, b = fit_group(ts[where])
            # The call's own fixed cost is in every program once, not per collective.
            table[kind][str(n)] = [max(a - compute["call_s"], 0.0), b]
        return table

    return items, fit


def _measure_job(devices: int, runs: int) -> dict:
    """A job's table, measured by every rank at once (as a step runs): each process's
    compute (one device each, nothing batched) and MindSpore's AllReduce and AllGather
    over the job, each call after a barrier (the ranks meet at each collective of a
    step). Every rank returns rank 0's numbers: the ranks must plan alike."""
    world = distributed.world_size()
    if devices != world:
        raise ShardingError(
            f"fs.sharding.calibrate(devices={devices}) in a job of {world} processes: a "
            f"job's table is for its own processes.\nFix: call fs.sharding.calibrate() "
            f"(or devices={world}) on every rank.")
    t0 = time.perf_counter()
    table = {"format": FORMAT, "backend": backend.device_target(),
             "mindspore": backend.ms_version(), "devices": devices, "lanes": False}
    reduce = backend.world_collective("all_reduce")
    token = _tensor((1,))
    items, fit = _compute_programs(1)
    compute = fit(_times(items, runs, barrier=lambda: backend.to_numpy(reduce(token))))
    table.update(compute)
    # Every size of both collectives interleaved, a few calls each per round: a slow
    # spell of the machine (MindSpore's CPU collectives sometimes wait out a 4 ms
    # scheduler tick for seconds) then slows every size alike instead of one, which
    # measured one after another, fitted an AllGather of 3.8 ms whatever its size.
    sizes = (1 << 8, 1 << 14, 1 << 17)
    kinds = ("all_reduce", "all_gather")
    items = [(backend.world_collective(kind), (_tensor((elems,)),))
             for kind in kinds for elems in sizes]
    ts = _times(items, 3, rounds=runs, barrier=lambda: backend.to_numpy(reduce(token)))
    for k, kind in enumerate(kinds):
        a, b = _fit([4.0 * e for e in sizes], ts[k * len(sizes):(k + 1) * len(sizes)])
        table[kind] = {str(world): [max(a - compute["call_s"], 0.0), b]}
    keys = [k for k in _NUMBERS if k in table]
    points = table["matmul_points"]  # the same sizes on every rank
    adam = table["adam_points"]
    numbers = [table[k] for k in keys] + table["all_reduce"][str(world)] \
        + table["all_gather"][str(world)] + [t for _, t in points] + [t for _, t in adam]
    mine = np.asarray(numbers, np.float32) * (distributed.rank() == 0)
    shared = [float(v) for v in backend.to_numpy(reduce(backend.as_tensor(mine)))]
    table.update(zip(keys, shared))
    k = len(keys)
    table["all_reduce"] = {str(world): shared[k:k + 2]}
    table["all_gather"] = {str(world): shared[k + 2:k + 4]}
    table["matmul_points"] = [[f, t] for (f, _), t in zip(points, shared[k + 4:])]
    table["adam_points"] = [[n, t] for (n, _), t in zip(adam, shared[k + 4 + len(points):])]
    table["seconds"] = time.perf_counter() - t0
    table["loadavg"] = list(os.getloadavg())
    return table


#: A table's measured numbers (all but the collectives).
_NUMBERS = ("call_s", "op_s", "arg_s", "flops_per_s", "matmul_c", "matmul_p", "point_s",
            "matmul_elem_s")


def measure(devices: int, runs: int = 7) -> dict:
    """A fresh table for ``devices`` virtual devices, or in a rank of a multi-process job
    for the job's processes (not saved)."""
    devices = check_devices(devices)
    if backend.comm_initialized():
        return _measure_job(devices, runs)
    t0 = time.perf_counter()
    items, fit = programs(devices)
    table = fit(_times(items, runs))
    table["seconds"] = time.perf_counter() - t0
    table["loadavg"] = list(os.getloadavg())
    return table


def calibrate(devices: int | None = None, *, runs: int = 7) -> dict:
    """Measure this machine's rates for a virtual mesh of ``devices`` (default
    ``FSHARD_DEVICES``, else 8) and cache them on disk (``cache_path(devices)``); the
    planner prices plans with them from now on (and in later processes). Returns the
    table. A few seconds; re-run it after a change of machine, backend or MindSpore
    version (each has its own file) or to measure again. In a multi-process job, call
    it on every rank: it measures the job's processes (``devices`` defaults to, and
    must be, their number) and caches that table for later jobs of as many.

    >>> import fshard as fs
    >>> table = fs.sharding.calibrate(devices=2, runs=3)   # doctest: +SKIP
    >>> sorted(table["all_reduce"])                        # doctest: +SKIP
    ['2']
    """
    job = backend.comm_initialized()
    if devices is None:
        devices = distributed.world_size() if job else default_devices()
    devices = check_devices(devices)
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ShardingError(f"fs.sharding.calibrate: runs must be a positive int (calls "
                            f"timed per measurement); got {runs!r}.\nFix: pass e.g. runs=7.")
    table = measure(devices, runs)
    path = cache_path(devices, job)
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
