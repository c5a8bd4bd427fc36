"""Per-process batch slices in a multi-process job (``dataset_strategy="data_parallel"``).

Under ``fshard.launch`` or ``msrun`` a sharded program runs with the *global* shapes:
every process holds the whole of each input and keeps its own block (``shard_in``).
With ``dataset_strategy("data_parallel")`` each process instead passes only its own
slice of the batch, as MindSpore's data-parallel datasets do (``num_shards`` /
``shard_id``). The slice is placed at its block of a global-shaped value (zeros
elsewhere, no communication): the program reads nothing but this process's block,
so the zeros are never used. Outputs split along the batch come back the same way:
this process's block of the global output.

Which slice a process passes: with ``data_parallel`` the batch dimension is split over
all devices in rank order, so process ``r`` of ``N`` passes rows ``[r * b, (r + 1) * b)``
of a global batch of ``N * b`` rows. ``block_index`` reads the block from the plan's
layout, so placement and the plan always agree.

Every process passes slices of the same shapes (``check_same_slices`` all-gathers the
shapes before each call plans or runs anything), except that ``fs.AutoParallel`` also
takes slices of different row counts (an uneven last batch): ``rebalance`` makes them
equal blocks of the same global batch, the processes' rows in rank order.

A declared slice (``set_inputs``) declares the global batch ``global_declared``: its
first dimension's Symbol scaled by the process count, so that one program serves every
slice size.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from fshard.meshes import distributed
from fshard.backend.mindspore import GraphFunction, as_tensor, world_collective
from fshard.core import tree
from fshard.core.dims import Symbol
from fshard.core.tracing import ArrayType, Tracer, typeof
from fshard.errors import ArgumentError
from fshard.primitives.structural import pad, slice_array
from fshard.sharding.cost import CostModel, backend_rates, step_seconds
from fshard.sharding.local import ShardedArray


def global_type(x, n: int) -> ArrayType:
    """The global type of a batch slice split ``n`` ways along its first dimension."""
    a = typeof(x)
    if a.ndim == 0:  # (no batch dimension: the plan refuses it, naming the input)
        return a
    return ArrayType((a.shape[0] * n,) + tuple(a.shape[1:]), a.dtype)


def _signature(shapes, dtypes) -> list[float]:
    """A fixed-length summary of the slices, exact in float32 (the collectives' dtype
    on CPU): the first slice's rows, the number of slices, and 48 bits of a digest of
    every shape, then 48 bits of a digest of the rest (every shape but its rows, the
    dtypes), in 16-bit parts."""
    rows = shapes[0][0] if shapes and shapes[0] else 0
    return [float(rows), float(len(shapes))] + _digest(shapes) + _digest(
        ([sh[1:] for sh in shapes], [str(d) for d in dtypes]))


def _digest(value) -> list[float]:
    digest = int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:6], "big")
    return [float((digest >> k) & 0xFFFF) for k in (0, 16, 32)]


def _all_gather_rows(mine: np.ndarray) -> np.ndarray:
    """Every process's ``mine`` (a float32 vector of the same length on each), as the
    rows of an ``(N, len)`` array: an AllGather, entered by every process. MindSpore's
    own, compiled once and called by the graph executor directly (it runs on every call
    of a job's step)."""
    return _world_all_gather()(as_tensor(mine.reshape(1, -1))).asnumpy()


@functools.cache
def _world_all_gather() -> GraphFunction:
    return GraphFunction(world_collective("all_gather"), collective=True)


def slice_check_seconds(n: int) -> float:
    """The predicted time of ``slice_rows``' check on ``n`` processes, in the job's
    rates: a compiled call of its own, an AllGather of the 8-number signature."""
    if n == 1:
        return 0.0
    model = CostModel(level=2, rates=backend_rates(n))
    nbytes = 4.0 * len(_signature([], ()))
    return model.call_seconds(2) + step_seconds("all_gather", nbytes, n, True, model.native,
                                                model.rates)


def slice_rows(shapes, what: str, dtypes=()) -> list[tuple[int, ...]] | None:
    """Every process's row counts of its batch slices (``shapes``: this process's, in
    argument order), as ``[(rows of each slice) for each rank]``; None when every
    process passes slices of the same shapes (the usual case: one AllGather of a few
    numbers). Slices that differ in more than their rows (another number of batch
    inputs, other trailing dimensions, other ``dtypes`` when given) raise on every
    process of the job.

    The AllGather runs on every call: a check only when a process's own shapes change
    would be a collective that process alone enters, desynchronising the job. (Under
    ``fs.jit`` it runs when a call is traced, so a shape that changes on one process
    only, after the first call, is not caught there.)"""
    n = distributed.world_size()
    if n == 1:
        return None
    shapes = [tuple(int(d) for d in sh) for sh in shapes]
    sig = np.asarray(_signature(shapes, dtypes), np.float32)
    got = _all_gather_rows(sig)
    if (got == got[0]).all():
        return None
    if (got[:, 1] == got[0, 1]).all() and (got[:, 5:] == got[0, 5:]).all():
        # only the rows differ: a second AllGather (every process takes this branch)
        # of each slice's rows, as many on every process
        every = _all_gather_rows(np.asarray([sh[0] if sh else 1 for sh in shapes],
                                            np.float32))
        return [tuple(int(v) for v in row) for row in every]
    detail = ", ".join(f"rank {r}" for r in range(n) if not (got[r] == sig).all())
    raise ArgumentError(
        f"{what}: with dataset_strategy('data_parallel') in a multi-process job every "
        f"process passes its rows of the same batch inputs (process r of {n}: rows "
        f"[r * b, (r + 1) * b) of a global batch of {n} * b), but the slices of {detail} "
        f"differ from this process's {shapes} in more than their row counts. Each "
        "process would train on a different global batch and the copies of the "
        "parameters diverge.\nFix: pass the same batch inputs, with the same trailing "
        "dimensions and dtypes, on every process.")


def rows_differ_error(what: str, rows, n: int) -> ArgumentError:
    """The error for slices of different row counts where they must be equal."""
    detail = ", ".join(f"{r[0]} rows (rank {k})" for k, r in enumerate(rows))
    return ArgumentError(
        f"{what}: with dataset_strategy('data_parallel') in a multi-process job every "
        f"process passes a slice of the same shape (process r of {n}: rows [r * b, "
        f"(r + 1) * b) of a global batch of {n} * b), but the processes' row counts differ: "
        f"the first batch input has {detail}. Each process would train on a different "
        "global batch and the copies of the parameters diverge.\nFix: give every process "
        "the same number of rows (drop the last, incomplete batch), or pass the whole batch "
        "on every process with dataset_strategy(((N, 1), ...)) (one split per input).")


def check_same_slices(shapes, what: str) -> None:
    """Raise on every process of the job unless every process passes slices of the same
    ``shapes`` (the shapes of its batch slices, in argument order).

    Each process plans the program for the global batch its own slice implies, so
    slices of 2 rows on one process and 3 on another would make two different
    programs whose collectives still match up: the job would run, and the copies of the
    parameters silently diverge (``slice_rows`` says why the check runs every call)."""
    rows = slice_rows(shapes, what)
    if rows is not None:
        raise rows_differ_error(what, rows, distributed.world_size())


def rebalance(slices, rows, what: str) -> list[np.ndarray]:
    """This process's even block of the global batch that slices of different row
    counts make (``rows``: every process's rows of each slice, from ``slice_rows``):
    each batch input's global value is every process's rows in rank order, and process
    ``r`` of ``N`` takes its rows ``[r * G / N, (r + 1) * G / N)``, as if every process
    had passed an equal slice of the same global batch. One AllGather per batch input
    (of the slices padded to a power of two of rows, as float32: a float32 input as it
    is, any other dtype byte by byte, so every value arrives exactly). A global batch
    of ``G`` rows not divisible by ``N`` raises on every process."""
    n, rank = distributed.world_size(), distributed.rank()
    out = []
    for j, x in enumerate(slices):
        counts = [r[j] for r in rows]
        total = sum(counts)
        if total % n:
            detail = ", ".join(f"{c} rows (rank {k})" for k, c in enumerate(counts))
            raise ArgumentError(
                f"{what}: with dataset_strategy('data_parallel') in a multi-process job the "
                f"processes' slices make one global batch (their rows in rank order), "
                f"which the step splits evenly over the {n} devices; but batch input {j} "
                f"has {detail}: {total} rows, not divisible by {n}.\nFix: give the "
                f"processes rows that add up to a multiple of {n} (or drop the last, "
                "incomplete batch).")
        a = x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)
        width = int(np.prod(a.shape[1:], dtype=np.int64))
        if a.dtype == np.float32:
            flat = a.reshape(a.shape[0], width)
        else:  # byte by byte: exact for every dtype
            flat = np.ascontiguousarray(a).reshape(a.shape[0], width).view(np.uint8)
            flat = flat.astype(np.float32)
        # padded to a power of two: the AllGather, compiled once per block shape, serves
        # every batch of up to that many rows
        longest = 1 << max(0, max(counts) - 1).bit_length()
        mine = np.zeros((longest, flat.shape[1]), np.float32)
        mine[:flat.shape[0]] = flat
        every = _all_gather_rows(mine.reshape(-1)).reshape(n, longest, flat.shape[1])
        whole = np.concatenate([every[k, :c] for k, c in enumerate(counts)])
        block = whole[rank * total // n:(rank + 1) * total // n]
        if a.dtype != np.float32:
            block = block.astype(np.uint8).view(a.dtype)
        out.append(np.ascontiguousarray(block.reshape((total // n,) + a.shape[1:])))
    return out


def global_declared(specs, n: int) -> tuple | None:
    """The declared global batch of per-process slices declared ``specs`` (one
    ArrayType, pytree of them or None per batch input) on ``n`` processes: each slice's
    first dimension times ``n``: an int ``b`` as ``n * b``, a Symbol as the Symbol of
    ``n`` times its sizes (``Symbol(divisor=8)`` on 2 processes: ``Symbol(divisor=16,
    min=2)``), the same Symbol for the same Symbol; the other dimensions as declared.
    None when a Symbol of a first dimension is also another dimension (its global
    batch could not be one size there and ``n`` times it here)."""
    scaled: dict = {}
    others = set()
    for spec in specs:
        for a in tree.leaves(spec):
            others.update(id(d) for d in a.shape[1:] if isinstance(d, Symbol))

    def scale(d):
        if not isinstance(d, Symbol):
            return d * n
        g = scaled.get(id(d))
        if g is None:
            g = scaled[id(d)] = Symbol(max=d.max * n, min=d.min * n, divisor=d.divisor * n,
                                       remainder=d.remainder * n, unique=d.unique)
        return g

    def global_spec(a):
        if a.ndim == 0 or id(a.shape[0]) in others:
            raise LookupError
        return ArrayType((scale(a.shape[0]),) + tuple(a.shape[1:]), a.dtype)

    try:
        return tuple(None if sp is None else tree.map(global_spec, sp) for sp in specs)
    except LookupError:
        return None


def block_index(sharding, mesh, rank: int) -> tuple[tuple[int, int], ...]:
    """Per dimension, ``(block index, block count)`` of ``rank`` under ``sharding``
    (a ``fshard.sharding.layouts.Sharding`` on the prime-axis mesh ``mesh``, whose ranks are
    row-major like the job's)."""
    coords = mesh.coords(rank)
    out = []
    for axes in sharding.dims:
        index = 0
        for a in axes:  # major first
            index = index * mesh.sizes[a] + coords[a]
        out.append((index, mesh.count(axes)))
    return tuple(out)


def to_global(x, where):
    """``x`` (this process's block) placed at its block of a zero global value."""
    shape = typeof(x).shape
    if not isinstance(x, Tracer):  # a concrete batch: NumPy, 5-15x faster than a pad op
        a = x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)
        out = np.zeros(tuple(d * n for d, (_, n) in zip(shape, where)), a.dtype)
        out[tuple(slice(i * d, (i + 1) * d) for d, (i, _) in zip(shape, where))] = a
        return as_tensor(out)
    low = [i * d for (i, _), d in zip(where, shape)]
    high = [(n - 1 - i) * d for (i, n), d in zip(where, shape)]
    return pad(x, low, high)


def to_local(y, where):
    """This process's block of the global value ``y``."""
    shape = typeof(y).shape
    block = [d // n for (_, n), d in zip(where, shape)]
    start = [i * b for (i, _), b in zip(where, block)]
    return slice_array(y, start, [s + b for s, b in zip(start, block)])


def place_inputs(part, n_consts: int, leaves, sliced, rank: int) -> list:
    """The inputs of a partitioned program ``part`` with the ``sliced`` ones (this
    process's slices) placed at their blocks."""
    shs = part.in_shardings[n_consts:]
    return [to_global(x, block_index(sh, part.prop.mesh, rank)) if s else x
            for x, s, sh in zip(leaves, sliced, shs, strict=True)]


def take_outputs(part, outs, rank: int) -> list:
    """This process's block of each output split along the batch."""
    out = []
    for y, sh in zip(outs, part.out_shardings, strict=True):
        if isinstance(y, ShardedArray):  # (gather_outputs=False) already this block
            out.append(y.block)
        elif sh.dims and sh.dims[0]:
            out.append(to_local(y, block_index(sh, part.prop.mesh, rank)))
        else:
            out.append(y)
    return out
