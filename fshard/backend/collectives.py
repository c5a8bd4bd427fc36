"""How a rank's graph communicates: each collective as MindSpore's own op where the
backend has it (``NATIVE_COLLECTIVES``), else as the emulation verified on CPU
(reduce-scatter = AllReduce + this rank's slice; pmax/pmin = AllGather + reduce;
all_to_all and ppermute = AllGather + static index; a gather over a mesh sub-axis =
one-hot slot buffer + sub-group AllReduce), and values the backend's collectives do
not carry (bool, integers on CPU) carried exactly in float32.

The collective primitives (fshard/primitives/collectives.py) lower through ``Comm``;
the cost model prices each collective as this module runs it (fshard/sharding/cost.py
``step_bytes``). Every rank lowers the same Program and issues the same sequence of
collectives; ranks differ only by baked-in constants.
"""

from __future__ import annotations

import math

import numpy as np
from mindspore import dtype as mstype
from mindspore import ops

from fshard.core import dtypes
from fshard.backend.mindspore import (COLLECTIVE_DTYPES, NATIVE_COLLECTIVES, Tensor,
                                      device_target, gather_any_rank, lower_slice)
from fshard.core.tracing import ArrayType
from fshard.core.dims import dims_equal
from fshard.errors import ArgumentError, AxisNameError

def this_rank(ctx) -> int:
    """The rank whose graph ``ctx`` lowers (the process's own, unless set)."""
    if getattr(ctx, "rank", None) is not None:
        return ctx.rank
    from fshard.meshes import distributed

    return distributed.rank()


def _mesh_axes(mesh) -> tuple:
    """``(axis names, sizes)`` of an ``fs.Mesh`` (or any mesh with names and sizes)."""
    names = getattr(mesh, "axis_names", None) or getattr(mesh, "names")
    sizes = getattr(mesh, "shape", None) or getattr(mesh, "sizes")
    return tuple(names), tuple(int(s) for s in sizes)


def carries(dtype) -> bool:
    """Whether the backend's collectives take ``dtype`` as it is."""
    allowed = COLLECTIVE_DTYPES.get(device_target())
    return allowed is None or str(dtype) in allowed


class Comm:
    """The communication of one rank over some mesh axes: its group (ranks ordered
    by their index along the axes, the first axis most significant), its position
    in it, and the MindSpore ops or emulations to emit."""

    def __init__(self, ctx, names, params, api: str, rank: int | None = None):
        mesh = params.get("mesh") or getattr(ctx, "mesh", None)
        if mesh is None:
            raise AxisNameError(
                f"fs.{api} over {tuple(names)!r} was compiled outside any fs.shard_map: no "
                "mesh binds those axis names, so there is no device to communicate with.\n"
                "Fix: call the collective inside fs.shard_map(f, ..., mesh=...) (or "
                "fs.vmap(f, axis_name=...)), and jit the shard_map.")
        self.ctx = ctx
        mesh_names, mesh_sizes = _mesh_axes(mesh)
        for n in names:
            if n not in mesh_names:
                raise AxisNameError(
                    f"fs.{api} names the axis {n!r}, which is not an axis of the mesh "
                    f"(axes {mesh_names!r}).\nFix: use one of the mesh's axis names.")
        self.rank = this_rank(ctx) if rank is None else rank
        size = math.prod(mesh_sizes)
        coords = list(np.unravel_index(self.rank, mesh_sizes))
        axes = [mesh_names.index(n) for n in names]
        group = []
        for combo in np.ndindex(*[mesh_sizes[a] for a in axes]):
            c = list(coords)
            for a, v in zip(axes, combo):
                c[a] = v
            group.append(int(np.ravel_multi_index(c, mesh_sizes)))
        self.group = tuple(group)
        self.n = len(group)
        self.index = group.index(self.rank)
        self.world = self.n == size
        self.sorted = self.group == tuple(sorted(self.group))

    # -- which ops --------------------------------------------------------------

    def native(self, kind: str) -> bool:
        where = NATIVE_COLLECTIVES.get(device_target(), {}).get(kind)
        return where == "any" or (where == "world" and self.world)

    def group_name(self) -> str | None:
        """None for the world group; else the sub-group (created on first use)."""
        if self.world:
            return None
        from fshard.meshes import distributed

        if distributed.is_initialized():
            return distributed.group_for(sorted(self.group))
        return distributed.group_name(sorted(self.group))  # lowering for inspection only

    def _op(self, cls, hint: str, **kwargs) -> str:
        g = self.group_name()
        if g is not None:
            kwargs["group"] = g
        return self.ctx.ref(cls(**kwargs), hint)

    # -- building blocks ----------------------------------------------------------

    def _after(self, x: str) -> str:
        """``x``, made to wait for the previous collective of the program: MindSpore
        may otherwise run independent collectives in a different order on each rank."""
        self.ctx.sequenced = True
        token = getattr(self.ctx, "token", None)
        return x if token is None else self.ctx.call(_ms_after, x, token)

    def all_reduce(self, x: str, op: str = "sum", dtype=None) -> str:
        """AllReduce of ``x`` (of ``dtype``). Where the backend's AllReduce lacks the
        dtype (the CPU one takes float32 and float16 only), fshard carries the values in
        float32 exactly: bools as 0/1, integers as 16-bit chunks (a sum of n chunks stays
        below 2**24 for n <= 256), and recombines them."""
        kind = {"sum": ops.ReduceOp.SUM, "max": ops.ReduceOp.MAX, "min": ops.ReduceOp.MIN}[op]

        def native(v: str) -> str:
            return f"{self._op(ops.AllReduce, 'AllReduce', op=kind)}({self._after(v)})"

        if dtype is None or carries(dtype):
            return native(x)
        ctx = self.ctx
        if dtype == dtypes.bool_:
            return ctx.call(_ms_from_float_bool, native(ctx.call(_ms_to_float32, x)))
        if dtype == dtypes.bfloat16 and carries(dtypes.float32):
            # exact in float32 (bfloat16 is float32's upper half); one rounding at the end
            return ctx.call(_ms_cast, native(ctx.call(_ms_to_float32, x)), dtype=dtype)
        if dtypes.is_int(dtype) and op == "sum":
            if self.n > 256:
                raise ArgumentError(
                    f"an integer sum over {self.n} devices exceeds what fshard can carry "
                    "exactly in this backend's float32 AllReduce (256 devices).\nFix: sum in "
                    "float32, or over fewer devices.")
            chunks = max(1, np.dtype(dtypes.to_numpy(dtype)).itemsize // 2)
            y = native(ctx.call(_ms_int_chunks, x, n_chunks=chunks))
            return ctx.call(_ms_int_unchunk, y, n_chunks=chunks, dtype=dtype)
        if dtypes.is_int(dtype):  # max / min: gather exactly, then reduce here
            raise AssertionError("integer pmax/pmin go through gather_stacked")
        raise ArgumentError(
            f"a collective of {dtype} values: this backend's collectives take "
            f"{', '.join(COLLECTIVE_DTYPES.get(device_target(), ()))} only.\nFix: cast to "
            "float32 before communicating (x.astype(mindspore.float32)).")

    def gather_stacked(self, x: str, aval: ArrayType) -> str:
        """Every member's ``x`` stacked along a new leading dim, in member order."""
        ctx = self.ctx
        if aval.dtype == dtypes.bool_ and not carries(aval.dtype):
            stacked = self.gather_stacked(ctx.call(_ms_to_float32, x),
                                          ArrayType(aval.shape, dtypes.float32))
            return ctx.call(_ms_from_float_bool, stacked)
        if self._gathers_int_chunks(aval.dtype):
            chunks, c_aval, n_chunks = self._int_chunks(x, aval)
            return ctx.call(_ms_int_unchunk, self.gather_stacked(chunks, c_aval),
                            n_chunks=n_chunks, dtype=aval.dtype)
        if self.native("all_gather") and carries(aval.dtype):
            expanded = self._after(ctx.call(_ms_expand0, x))
            gathered = f"{self._op(ops.AllGather, 'AllGather')}({expanded})"
            order = sorted(self.group)  # native results come in rank order
            perm = [order.index(r) for r in self.group]
            if perm == list(range(self.n)):
                return gathered
            return ctx.call(_ms_take, gathered, ctx.ref(Tensor(np.asarray(perm, np.int32)),
                                                         "order"))
        # One-hot slot buffer: my value in my slot, zeros elsewhere, summed over the group.
        slot = np.zeros((self.n,) + (1,) * aval.ndim, dtypes.to_numpy(aval.dtype))
        slot[self.index] = 1
        buf = ctx.call(_ms_slot, x, ctx.ref(Tensor(slot), "slot"))
        return self.all_reduce(buf, dtype=aval.dtype)

    def _gathers_int_chunks(self, dtype) -> bool:
        """Whether integers of ``dtype`` are gathered as float32 chunks: the backend's
        AllGather runs natively but lacks ``dtype`` (the CPU one: float32 and float16
        only). A gather moves the chunks as they are, so they come back exact; this
        costs one native AllGather instead of an AllReduce of a slot buffer
        ``n`` times the value's size (on 2 CPU processes 0.6 ms less for 128 int32s)."""
        return (self.native("all_gather") and dtypes.is_int(dtype)
                and not carries(dtype) and carries(dtypes.float32))

    def _int_chunks(self, x: str, aval: ArrayType) -> tuple[str, ArrayType, int]:
        """``x``'s integers as float32 16-bit chunks along a new last axis, the chunks'
        type and their number."""
        n_chunks = max(1, np.dtype(dtypes.to_numpy(aval.dtype)).itemsize // 2)
        return (self.ctx.call(_ms_int_chunks, x, n_chunks=n_chunks),
                ArrayType(tuple(aval.shape) + (n_chunks,), dtypes.float32), n_chunks)

    def all_gather(self, x: str, aval: ArrayType, axis: int) -> str:
        if self.n == 1:
            return x
        if axis == 0 and self.native("all_gather") and self.sorted and carries(aval.dtype):
            # MindSpore's AllGather concatenates along dim 0 in rank order already
            return f"{self._op(ops.AllGather, 'AllGather')}({self._after(x)})"
        if axis == 0 and self.sorted and self._gathers_int_chunks(aval.dtype):
            chunks, c_aval, n_chunks = self._int_chunks(x, aval)
            return self.ctx.call(_ms_int_unchunk, self.all_gather(chunks, c_aval, 0),
                                 n_chunks=n_chunks, dtype=aval.dtype)
        stacked = self.gather_stacked(x, aval)
        return self.ctx.call(_ms_lanes_into_dim, stacked, **_merge_params(aval.shape, self.n, axis))

    def reduce_scatter(self, x: str, aval: ArrayType, dim: int) -> str:
        if self.n == 1:
            return x
        shape = aval.shape
        if self.native("reduce_scatter") and self.sorted:
            perm = _to_front(len(shape), dim)
            y = x if dim == 0 else self.ctx.call(_ms_transpose, x, perm=perm)
            y = f"{self._op(ops.ReduceScatter, 'ReduceScatter')}({self._after(y)})"
            return y if dim == 0 else self.ctx.call(_ms_transpose, y, perm=_inverse(perm))
        block = shape[dim] // self.n
        begin, end = [0] * len(shape), list(shape)
        begin[dim], end[dim] = self.index * block, (self.index + 1) * block
        return lower_slice(self.ctx, self.all_reduce(x, dtype=aval.dtype), begin, end,
                           (1,) * len(shape))

    def all_to_all(self, x: str, aval: ArrayType, split: int, concat: int) -> str:
        if self.n == 1:
            return x
        stacked = self.gather_stacked(x, aval)            # (n, ..., S at split+1, ...)
        shape = aval.shape
        chunk = shape[split] // self.n
        full = (self.n,) + tuple(shape)
        begin, end = [0] * len(full), list(full)
        begin[split + 1], end[split + 1] = self.index * chunk, (self.index + 1) * chunk
        mine = lower_slice(self.ctx, stacked, begin, end, (1,) * len(full))
        local = list(shape)
        local[split] = chunk
        return self.ctx.call(_ms_lanes_into_dim, mine, **_merge_params(local, self.n, concat))

    def ppermute(self, x: str, aval: ArrayType, source: int | None) -> str:
        # Every member takes part in the gather, receiving or not: all ranks must
        # issue the same collectives.
        stacked = self.gather_stacked(x, aval)
        return self.ctx.call(_ms_pick, stacked, index=source or 0, keep=source is not None)

    def mean(self, x: str, dtype) -> str:
        return self.ctx.call(_ms_scale, self.all_reduce(x, dtype=dtype), factor=1.0 / self.n)

    def extremum(self, x: str, aval: ArrayType, kind: str) -> str:
        """pmax (``kind="max"``) or pmin: a native AllReduce where the backend has one,
        else every member's value gathered and reduced here."""
        dtype = aval.dtype
        if self.native(f"all_reduce_{kind}") and (carries(dtype) or dtype == dtypes.bool_):
            return self.all_reduce(x, op=kind, dtype=dtype)
        reduce = _ms_reduce_max0 if kind == "max" else _ms_reduce_min0
        if dtype == dtypes.bool_ and not carries(dtype):  # no bool ReduceMax on CPU
            stacked = self.gather_stacked(self.ctx.call(_ms_to_float32, x),
                                          ArrayType(aval.shape, dtypes.float32))
            return self.ctx.call(_ms_from_float_bool, self.ctx.call(reduce, stacked))
        return self.ctx.call(reduce, self.gather_stacked(x, aval))

    def broadcast(self, x: str, root: int, dtype=None) -> str:
        if self.n == 1:
            return x
        if self.native("broadcast") and self.sorted and (dtype is None
                                                         or carries(dtype)):
            op = self._op(ops.Broadcast, "Broadcast", root_rank=self.group[root])
            return f"{op}(({self._after(x)},))[0]"
        # The root contributes its value, the others zeros: the same code on every rank.
        return self.all_reduce(self.ctx.call(_ms_keep, x, keep=self.index == root),
                               dtype=dtype)


def local_slice(ctx, x: str, shape, begin, end) -> str:
    """This rank's block ``[begin, end)`` of a value it holds whole (no communication)."""
    if list(begin) == [0] * len(shape) and all(dims_equal(e, d) for e, d in zip(end, shape)):
        return x
    return lower_slice(ctx, x, begin, end, (1,) * len(shape))


def _merge_params(shape, n: int, axis: int) -> dict:
    """``_ms_lanes_into_dim`` parameters: (n, *shape) -> lanes merged into ``axis``."""
    nd = len(shape)
    perm = tuple(list(range(1, axis + 1)) + [0] + list(range(axis + 1, nd + 1)))
    out = list(shape)
    out[axis] = out[axis] * n
    return {"perm": perm, "shape": tuple(out)}


def _to_front(nd: int, dim: int) -> tuple:
    return (dim,) + tuple(i for i in range(nd) if i != dim)


def _inverse(perm) -> tuple:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


# MindSpore functions called by the generated graph source (GRAPH-mode Python).


def _ms_after(x, token):
    return ops.depend(x, token)


def _ms_scale(x, factor):
    return x * factor


def _ms_expand0(x):
    return ops.expand_dims(x, 0)


def _ms_to_float32(x):
    return x.astype(mstype.float32)


def _ms_cast(x, dtype):
    return x.astype(dtype)


def _ms_from_float_bool(x):
    return x > 0.5


def _ms_int_chunks(x, n_chunks):
    """Integers as ``n_chunks`` float32 16-bit chunks along a new last axis: the low
    ones in [0, 65535] (within 65536 of it where a division rounds), the top one
    signed (x = sum of chunk_k * 65536**k)."""
    # q_k+1 = q_k // 65536 and chunk_k = q_k - 65536 * q_k+1: the chunks add up to x in
    # int64 whatever the divisions round to (MindSpore's CPU FloorDiv of an int64 near
    # 2**63 is off by one), each within float32's exact integers
    q = x.astype(mstype.int64)
    parts = []
    for _ in range(n_chunks - 1):
        nxt = ops.floor_divide(q, 65536)
        parts.append(q - nxt * 65536)
        q = nxt
    parts.append(q)
    return ops.stack(parts, -1).astype(mstype.float32)


def _ms_int_unchunk(y, n_chunks, dtype):
    y = ops.round(y).astype(mstype.int64)
    total = y[..., 0]
    for k in range(1, n_chunks):
        total = total + y[..., k] * (65536 ** k)
    return total.astype(dtype)


def _ms_slot(x, slot):
    return ops.expand_dims(x, 0) * slot


def _ms_take(x, index):
    return gather_any_rank(x, index, 0)


def _ms_pick(x, index, keep):
    y = x[index]
    # depend: this rank's graph keeps the gather even when it uses no value of it
    return ops.depend(y if keep else ops.zeros_like(y), x)


def _ms_keep(x, keep):
    return x if keep else ops.zeros_like(x)


def _ms_lanes_into_dim(x, perm, shape):
    return ops.reshape(ops.transpose(x, perm), shape)


def _ms_transpose(x, perm):
    return ops.transpose(x, perm)


def _ms_reduce_max0(x):
    if x.dtype == mstype.bool_:  # no bool ReduceMax kernel on CPU
        return ops.amax(x.astype(mstype.int32), 0) > 0
    return ops.amax(x, 0)


def _ms_reduce_min0(x):
    if x.dtype == mstype.bool_:
        return ops.amin(x.astype(mstype.int32), 0) > 0
    return ops.amin(x, 0)
