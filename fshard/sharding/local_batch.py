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

Every process must pass slices of the same shapes: ``check_same_slices`` all-gathers
the shapes before each call plans or runs anything (see there for why every call).
"""

from __future__ import annotations

import hashlib

import numpy as np

from fshard.meshes import distributed
from fshard.backend.mindspore import as_tensor
from fshard.core.tracing import ArrayType, Tracer, typeof
from fshard.errors import ArgumentError
from fshard.primitives.structural import pad, slice_array
from fshard.sharding.layouts import ShardMesh
from fshard.sharding.local import ShardedArray


def global_type(x, n: int) -> ArrayType:
    """The global type of a batch slice split ``n`` ways along its first dimension."""
    a = typeof(x)
    return ArrayType((a.shape[0] * n,) + tuple(a.shape[1:]), a.dtype)


def _signature(shapes) -> list[float]:
    """A fixed-length summary of the slices' shapes, exact in float32 (the collectives'
    dtype on CPU): the first slice's rows, the number of slices, and 48 bits of a
    digest of every shape, in 16-bit parts."""
    digest = int.from_bytes(hashlib.sha256(repr(shapes).encode()).digest()[:6], "big")
    rows = shapes[0][0] if shapes else 0
    return [float(rows), float(len(shapes))] + [
        float((digest >> k) & 0xFFFF) for k in (0, 16, 32)]


def check_same_slices(shapes, what: str) -> None:
    """Raise on every process of the job unless every process passes slices of the same
    ``shapes`` (the shapes of its batch slices, in argument order).

    Each process plans the program for the global batch its own slice implies, so
    slices of 2 rows on one process and 3 on another would make two different
    programs whose collectives still match up: the job would run, and the copies of the
    parameters silently diverge. The check is an AllGather of a few numbers per
    process, on every call: a check only when a process's own shapes change would be a
    collective that process alone enters, desynchronising the job. (Under ``fs.jit``
    the check runs when a call is traced, so a shape that changes on one process only,
    after the first call, is not caught there.)"""
    n, rank = distributed.world_size(), distributed.rank()
    if n == 1:
        return
    sig = np.asarray(_signature([tuple(int(d) for d in sh) for sh in shapes]), np.float32)
    every = np.zeros((n, sig.size), np.float32)
    every[rank] = sig
    mesh = ShardMesh.for_devices(n)
    got = ShardedArray.cut(every, (n, 1), mesh, rank).gather().asnumpy()
    if (got == got[0]).all():
        return
    if (got[:, :2] == got[0, :2]).all():
        differ = "shapes"
        detail = ", ".join(f"rank {r}" for r in range(n) if not (got[r] == sig).all())
        detail = (f"the slices of {detail} differ in shape from this process's "
                  f"{[tuple(sh) for sh in shapes]}")
    else:
        differ = "row counts"
        detail = ", ".join(f"{int(got[r, 0])} rows (rank {r})" for r in range(n))
        detail = f"the first batch input has {detail}"
    raise ArgumentError(
        f"{what}: with dataset_strategy('data_parallel') in a multi-process job every "
        f"process passes a slice of the same shape (process r of {n}: rows [r * b, "
        f"(r + 1) * b) of a global batch of {n} * b), but the processes' {differ} differ: "
        f"{detail}. Each process would train on a different global batch and the copies "
        "of the parameters diverge.\nFix: give every process the same number of rows "
        "(drop the last, incomplete batch), or pass the whole batch on every process "
        "with dataset_strategy(((N, 1), ...)) (one split per input).")


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
