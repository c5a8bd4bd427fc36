"""``block_slice``: each device keeps its own block of a dimension it holds whole;
``layout_constraint``: a layout the user fixed (see its section below).

This is the SPMD partitioner's "split further" step (a value replicated over mesh
axes becomes split over them). No communication: device ``i`` along the axes takes
block ``i``. Under a virtual mesh its batching rule selects each lane's block;
under a multi-process job it lowers to a static slice at the rank's coordinates.
Its transpose is a tiled ``all_gather`` (the blocks are disjoint).
"""

from __future__ import annotations

import numpy as np

from fshard.backend.mindspore import lower_slice
from fshard.core.tracing import ArrayType, typeof
from fshard.core.dims import dim_multiple_of
from fshard.errors import AxisNameError
from fshard.core.interpret import current_axis
from fshard.primitives.base import batch_to_front, def_primitive, deflinear, move_axis
from fshard.core.factors import FactorSpec
from fshard.core.rules import batching, sharding, unsupported

FAMILY = "spmd"


def _type(x: ArrayType, *, axis_name, dim, sizes):
    n = int(np.prod(sizes))
    assert dim_multiple_of(x.shape[dim], n), f"block_slice: dim {dim} of {x} not divisible by {n}"
    shape = list(x.shape)
    shape[dim] //= n
    return ArrayType(tuple(shape), x.dtype)


def _impl(x, *, axis_name, dim, sizes):
    raise AxisNameError(
        f"block_slice over mesh axes {axis_name} ran outside a sharded computation: no "
        "enclosing fs.shard/fs.shard_map binds those axes.")


def _lower(ctx, x, *, axis_name, dim, sizes):
    if not hasattr(ctx, "axis_coords"):
        # Only a multi-process lowering knows this rank's coordinates; fs.shard's
        # per-rank run replaces block_slice by shard_in, which carries its mesh.
        _impl(x, axis_name=axis_name, dim=dim, sizes=sizes)
    coords = ctx.axis_coords(axis_name)
    index = 0
    for c, s in zip(coords, sizes):
        index = index * s + c
    shape = ctx.in_avals[0].shape
    block = shape[dim] // int(np.prod(sizes))
    begin = [0] * len(shape)
    end = list(shape)
    begin[dim], end[dim] = index * block, (index + 1) * block
    return lower_slice(ctx, x, begin, end, (1,) * len(shape))


block_slice_p = def_primitive("block_slice", FAMILY, _type, _impl, lower=_lower)


def _batching(args, dims, *, axis_name, dim, sizes):
    from fshard.primitives.structural import gather_p, reshape

    (x,), (d,) = args, dims
    axis = current_axis()
    if axis.name not in axis_name:
        if d is None:  # the same value in every lane: slice it once
            return [block_slice_p.bind(x, axis_name=axis_name, dim=dim, sizes=sizes)], [None]
        x = move_axis(x, d, 0)
        return [block_slice_p.bind(x, axis_name=axis_name, dim=dim + 1, sizes=sizes)], [0]
    i = axis_name.index(axis.name)
    n = sizes[i]
    pre = int(np.prod(sizes[:i]))
    if d is None:
        # The same value in every lane: lane j's block j is a reshape, no gather.
        shape = typeof(x).shape
        post = shape[dim] // (pre * n)
        split = tuple(shape[:dim]) + (pre, n, post) + tuple(shape[dim + 1:])
        blocks = move_axis(reshape(x, split), dim + 1, 0)  # (lane, ..., pre, post, ...)
        out = reshape(blocks, (n,) + tuple(shape[:dim]) + (pre * post,)
                      + tuple(shape[dim + 1:]))
    else:
        x = batch_to_front(x, d, axis.size)  # (n, ..., D, ...)
        shape = typeof(x).shape
        post = shape[dim + 1] // (pre * n)
        split = tuple(shape[:dim + 1]) + (pre, n, post) + tuple(shape[dim + 2:])
        xs = move_axis(reshape(x, split), dim + 2, 1)  # (lane, block, ...)
        # Lane j keeps block j: the diagonal of (lane, block), gathered from their
        # merged axis at j * (n + 1). (A one-hot mask and a sum would turn booleans
        # into integers and an inf in another block into NaN.)
        rest_shape = tuple(typeof(xs).shape[2:])
        diag = np.arange(n, dtype=np.int32) * (n + 1)
        picked = gather_p.bind(reshape(xs, (n * n,) + rest_shape), diag, axis=0)
        out = reshape(picked, tuple(shape[:dim + 1]) + (pre * post,)
                      + tuple(shape[dim + 2:]))
    rest = axis_name[:i] + axis_name[i + 1:]
    if rest:
        out = block_slice_p.bind(out, axis_name=rest, dim=dim + 1,
                                 sizes=sizes[:i] + sizes[i + 1:])
    return [out], [0]


batching.set(block_slice_p, _batching)
unsupported(block_slice_p, "sharding",
            "it exists only in per-device programs: fs.shard's partitioner emits it on "
            "local blocks, naming mesh axes that the partitioned program binds; programs "
            "of global values, which fs.shard partitions, never contain it")


def _transpose(ct, x, *, axis_name, dim, sizes):
    from fshard.primitives.collectives import all_gather

    return [all_gather(ct, axis_name, axis=dim, tiled=True)]


deflinear(block_slice_p, _transpose)


def block_slice(x, axis_name: tuple, dim: int, sizes: tuple):
    """This device's block of dimension ``dim``, split over the mesh axes ``axis_name``."""
    return block_slice_p.bind(x, axis_name=tuple(axis_name), dim=dim, sizes=tuple(sizes))


# ---------------------------------------------------------------------------
# layout_constraint: a layout the user fixed (an operator's ``Primitive.shard``
# strategy, or an ``fs.shard`` inside ``fs.AutoParallel``'s loss)
# ---------------------------------------------------------------------------
#
# The identity on values. fs.shard's planner gives its output exactly the layout
# ``axes`` (the prime mesh axes splitting each dimension, for a mesh of ``n``
# devices); ``counts`` are the user's split counts (``exact``: an ``fs.Layout`` named
# the mesh axes), ``origin`` says where they were written (for messages), and
# ``group``/``role`` tie the constraints written for the operands (``("in", k, n)``)
# and outputs (``("out", k, n)``) of one operator call together,
# so the planner can run that operator with exactly the user's strategy
# (fshard/sharding/constraints.py). Outside fs.shard it does nothing: its derivatives
# and batched forms carry the same constraint.


def _constraint_type(x: ArrayType, **_):
    return x


def _constraint_eager(x, **_):
    return [x]


def _constraint_lower(ctx, x, **_):
    return x


layout_constraint_p = def_primitive("layout_constraint", FAMILY, _constraint_type,
                                    eager=_constraint_eager, lower=_constraint_lower)


def _constraint_batching(args, dims, *, axes, counts, **params):
    (x,), (d,) = args, dims
    if d is None:
        return [layout_constraint_p.bind(x, axes=axes, counts=counts, **params)], [None]
    # The batch dimension is not split: the constraint lays out each lane's value.
    return [layout_constraint_p.bind(x, axes=axes[:d] + ((),) + axes[d:],
                                     counts=counts[:d] + (1,) + counts[d:], **params)], [d]


batching.set(layout_constraint_p, _constraint_batching)


def _constraint_sharding(x, **_):
    labels = tuple(f"d{i}" for i in range(x.ndim))
    # linear=(): a pending sum never passes through: the fixed layout is a whole value.
    return FactorSpec([labels], [labels], {lab: s for lab, s in zip(labels, x.shape)},
                      linear=())


sharding.set(layout_constraint_p, _constraint_sharding)


def _constraint_transpose(ct, x, **params):
    # The cotangent of a value laid out as the user said is laid out the same way.
    return [layout_constraint_p.bind(ct, **params)]


deflinear(layout_constraint_p, _constraint_transpose)


def layout_constraint(x, axes: tuple, counts: tuple, n: int, origin: str,
                      group: int = 0, role: tuple = ("value", 0, 1), exact: bool = False):
    """``x``, whose layout fs.shard's planner must make ``axes`` (the prime mesh axes of
    each dimension on ``n`` devices; ``counts`` the split counts the user wrote)."""
    return layout_constraint_p.bind(x, axes=tuple(tuple(d) for d in axes),
                                    counts=tuple(int(c) for c in counts), n=int(n),
                                    origin=str(origin), group=int(group), role=tuple(role),
                                    exact=bool(exact))
