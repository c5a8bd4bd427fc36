"""Shape primitives: concat, split, slice, pad, gather, scatter_add, one_hot and
stop_gradient (broadcast_to, reshape, transpose and full, which every family's rules
use, are declared in fshard/primitives/base.py and re-exported here), plus the shape
functions built on them (expand_dims, squeeze, stack, getitem, ...).

All of these move data without arithmetic; most are linear and get transpose
rules (slice <-> pad, gather <-> scatter_add, concat <-> split).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mindspore import ops

from fshard.backend.mindspore import (Tensor, as_tensor, gather_any_rank, lower_slice,
                                      slice_tensor, split_with_size_class)
from fshard.core import dtypes
from fshard.core.array_types import Array, ArrayLike, Int, Shaped
from fshard.core.tracing import ArrayType, Symbol, Tracer, dims_equal, is_symbolic, typeof
from fshard.core.dims import dim_min
from fshard.errors import ArgumentError, ProgramTypeError, ShapeError
from fshard.core.factors import FactorSpec, elementwise_spec
from fshard.primitives.base import (  # noqa: F401  (re-exported: the shape primitives)
    Zero,
    _ms_full,
    _norm_axis,
    _shape_param,
    batch_size,
    batch_to_front,
    broadcast_shapes,
    broadcast_to,
    broadcast_to_p,
    def_primitive,
    defjvp,
    deflinear,
    full,
    full_p,
    instantiate,
    is_undefined,
    move_axis,
    ones,
    reshape,
    reshape_p,
    transpose,
    transpose_p,
    vectorized,
    zeros,
)
from fshard.core.rules import batching, jvp, sharding, unsupported
from fshard.core.rules import transpose as transpose_rules  # `transpose` is also an op here

FAMILY = "structural"


def expand_dims(x: ArrayLike, axis: int) -> Shaped[Array, "..."]:
    a = typeof(x)
    axis = _norm_axis(axis, a.ndim + 1)
    return reshape(x, tuple(a.shape[:axis]) + (1,) + tuple(a.shape[axis:]))


def squeeze(x: Shaped[Array, "..."], axis=None) -> Shaped[Array, "..."]:
    a = typeof(x)
    if axis is None:
        axes = [i for i, d in enumerate(a.shape) if d == 1]
    else:
        axes = [_norm_axis(ax, a.ndim) for ax in (axis if isinstance(axis, (tuple, list)) else (axis,))]
        for ax in axes:
            if a.shape[ax] != 1:
                raise ShapeError(f"squeeze: dimension {ax} of {a} has size {a.shape[ax]}, not 1")
    return reshape(x, tuple(d for i, d in enumerate(a.shape) if i not in axes))


def flatten(x: Shaped[Array, "..."], start_dim: int = 1) -> Shaped[Array, "..."]:
    a = typeof(x)
    return reshape(x, tuple(a.shape[:start_dim]) + (-1,))


def swapaxes(x: Shaped[Array, "..."], a: int, b: int) -> Shaped[Array, "..."]:
    nd = typeof(x).ndim
    perm = list(range(nd))
    a, b = _norm_axis(a, nd), _norm_axis(b, nd)
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, tuple(perm))


# ---------------------------------------------------------------------------
# stop_gradient: identity whose derivative is zero
# ---------------------------------------------------------------------------


def _ms_stop_gradient(x):
    return ops.stop_gradient(x)


stop_gradient_p = def_primitive("stop_gradient", FAMILY, lambda x: x, _ms_stop_gradient)
batching.set(stop_gradient_p, vectorized(stop_gradient_p))
sharding.set(stop_gradient_p, lambda x: elementwise_spec(x))
defjvp(stop_gradient_p, None)
unsupported(stop_gradient_p, "transpose", "its JVP is zero, so it never appears in a linear program")


def stop_gradient(x: ArrayLike) -> Shaped[Array, "*shape"]:
    """Identity in the forward pass; blocks differentiation (``fs.stop_gradient``).

    >>> import numpy as np, fshard as fs
    >>> fs.grad(lambda x: (x * fs.stop_gradient(x)).sum())(np.full(2, 3.0, np.float32))
    Tensor(shape=[2], dtype=Float32, value= [ 3.00000000e+00,  3.00000000e+00])
    """
    from fshard.core import tree

    return tree.map(lambda v: stop_gradient_p.bind(v), x)


# ---------------------------------------------------------------------------
# Helpers shared by the data-movement primitives below
# ---------------------------------------------------------------------------


def _static_ints(values, what: str) -> tuple:
    """A tuple of Python ints, or an ArgumentError naming ``what``."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        values = (values,)
    try:
        out = tuple(values)
    except TypeError:
        raise ArgumentError(
            f"{what} must be a tuple of ints, got {type(values).__name__} {values!r}.") from None
    for v in out:
        if isinstance(v, Tracer):
            raise ArgumentError(
                f"{what} must be static Python ints, got a traced value {v}. Sizes and "
                "offsets fix the output shape, so they cannot depend on traced data.\n"
                "Fix: pass Python ints (mark the argument static in fs.jit).")
        if is_symbolic(v):  # a symbolic dimension (a Symbol's size is static per call)
            continue
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ArgumentError(
                f"{what} must be a tuple of ints, got {values!r} (entry {v!r} is "
                f"{type(v).__name__}).")
    return tuple(v if is_symbolic(v) else int(v) for v in out)


def _int_dims(a: ArrayType, prim: str) -> None:
    if not a.is_static:
        raise ShapeError(f"{prim} needs static dimensions, got {a}.")


def _is_index_dtype(dtype) -> bool:
    return dtype in (dtypes.int32, dtypes.int64)


def _check_rank(prim: str, x: ArrayType, what: str = "operand") -> None:
    if x.ndim == 0:
        raise ProgramTypeError(f"{prim} needs an {what} of rank >= 1, got {x}")


def _check_axis(prim: str, axis: int, ndim: int) -> None:
    if not (isinstance(axis, int) and 0 <= axis < ndim):
        raise ProgramTypeError(f"{prim}: axis={axis!r} is not in [0, {ndim})")


def _slice_axis(x, axis: int, start: int, stop: int):
    """``x[..., start:stop, ...]`` along one axis (a ``slice`` equation)."""
    shape = typeof(x).shape
    if start == 0 and stop == shape[axis]:
        return x
    starts = tuple(start if i == axis else 0 for i in range(len(shape)))
    limits = tuple(stop if i == axis else d for i, d in enumerate(shape))
    return slice_p.bind(x, start=starts, limit=limits, strides=(1,) * len(shape))


def _insert(t: tuple, i: int, v) -> tuple:
    return tuple(t[:i]) + (v,) + tuple(t[i:])


# ---------------------------------------------------------------------------
# concat: join any number of operands along an existing axis
# ---------------------------------------------------------------------------


def _ms_concat(*xs, axis):
    return ops.concat(xs, axis)


def _concat_type(*xs, axis):
    if not xs:
        raise ProgramTypeError("concat needs at least one operand")
    first = xs[0]
    _check_rank("concat", first)
    _check_axis("concat", axis, first.ndim)
    for i, x in enumerate(xs):
        if x.dtype != first.dtype or x.ndim != first.ndim or not all(
                dims_equal(a, b) for k, (a, b) in enumerate(zip(x.shape, first.shape))
                if k != axis):
            raise ShapeError(
                f"concat along axis {axis}: operand {i} is {x} but operand 0 is {first}; "
                "operands need one dtype and equal sizes in every other dimension")
        if not isinstance(x.shape[axis], int):
            raise ShapeError(
                f"concat along axis {axis}, a symbolic dimension of {x}: fshard cannot yet "
                "express a sum of symbolic sizes.\nFix: concatenate along a static axis, "
                "or stack the pieces on a new static axis and reshape.")
    size = sum(x.shape[axis] for x in xs)
    return ArrayType(_insert(tuple(first.shape[:axis]), axis, size) + tuple(first.shape[axis + 1:]),
                     first.dtype)


concat_p = def_primitive("concat", FAMILY, _concat_type, _ms_concat)


def _concat_batching(args, dims, *, axis):
    if all(d == dims[0] for d in dims):  # all batched along one dim
        d = dims[0]
        return [concat_p.bind(*args, axis=axis + (axis >= d))], [d]
    size = batch_size(args, dims)
    args = [batch_to_front(x, d, size) for x, d in zip(args, dims)]
    return [concat_p.bind(*args, axis=axis + 1)], [0]


def _concat_transpose(ct, *xs, axis):
    """concat^T slices the cotangent back into one piece per operand."""
    ct = instantiate(ct)
    cts, start = [], 0
    for x in xs:
        n = (x.aval if is_undefined(x) else typeof(x)).shape[axis]
        cts.append(_slice_axis(ct, axis, start, start + n) if is_undefined(x) else None)
        start += n
    return cts


batching.set(concat_p, _concat_batching)
deflinear(concat_p, _concat_transpose)


def _concat_sharding(*xs, axis):
    """Every dim but ``axis`` is parallel across all operands; ``axis`` stays whole
    (concatenated blocks would interleave the operands)."""
    labels = tuple(None if i == axis else f"d{i}" for i in range(xs[0].ndim))
    return FactorSpec([labels] * len(xs), [labels],
                      {lab: xs[0].shape[i] for i, lab in enumerate(labels) if lab},
                      flops_per_point=0.0)


sharding.set(concat_p, _concat_sharding)


def concat(xs: Sequence[Shaped[Array, "..."]], axis: int = 0) -> Shaped[Array, "..."]:
    """Join arrays along an existing ``axis`` (``mindspore.ops.concat``).

    Operands are promoted to one dtype; every dimension other than ``axis`` must match.

    >>> import numpy as np, fshard as fs
    >>> fs.ops.concat([np.zeros((2, 1), np.float32), np.ones((2, 2), np.float32)], 1).shape
    (2, 3)

    See also: ``stack``, ``split``.
    """
    if not isinstance(xs, (list, tuple)) or not xs:
        raise ArgumentError(
            f"concat(xs=...) must be a non-empty list or tuple of arrays, got {xs!r:.80}.")
    avals = [typeof(x) for x in xs]
    for i, a in enumerate(avals):
        if a.ndim == 0:
            raise ShapeError(
                f"concat(xs=...): operand {i} is a scalar ({a}); concat joins arrays of "
                "rank >= 1.\nFix: use fs.ops.stack to join scalars into a vector.")
    nd = avals[0].ndim
    axis = _norm_axis(axis, nd, "concat(axis=...)")
    for i, a in enumerate(avals):
        if a.ndim != nd or any(not dims_equal(p, q) for k, (p, q) in
                               enumerate(zip(a.shape, avals[0].shape)) if k != axis):
            raise ShapeError(
                f"concat(xs=..., axis={axis}): operand {i} has shape {tuple(a.shape)} but "
                f"operand 0 has shape {tuple(avals[0].shape)}; all dimensions except "
                f"axis {axis} must be equal.\nFix: reshape or slice the operands so they "
                "differ only along the concatenation axis.")
    if len(xs) == 1:
        return xs[0]
    dt = dtypes.result_type(*[a.dtype for a in avals])
    from fshard.primitives.elementwise import cast

    return concat_p.bind(*[cast(x, dt) for x in xs], axis=axis)


def stack(xs: Sequence[Shaped[Array, "..."]], axis: int = 0) -> Shaped[Array, "..."]:
    """Join arrays of one shape along a new ``axis`` (``mindspore.ops.stack``).

    >>> import numpy as np, fshard as fs
    >>> fs.ops.stack([np.zeros(3, np.float32), np.ones(3, np.float32)], 1).shape
    (3, 2)
    """
    if not isinstance(xs, (list, tuple)) or not xs:
        raise ArgumentError(
            f"stack(xs=...) must be a non-empty list or tuple of arrays, got {xs!r:.80}.")
    shapes = [tuple(typeof(x).shape) for x in xs]
    for i, s in enumerate(shapes):
        if s != shapes[0]:
            raise ShapeError(
                f"stack(xs=...): operand {i} has shape {s} but operand 0 has shape "
                f"{shapes[0]}; stacked arrays must have equal shapes.\nFix: broadcast_to "
                "or reshape the operands first.")
    axis = _norm_axis(axis, len(shapes[0]) + 1, "stack(axis=...)")
    return concat([expand_dims(x, axis) for x in xs], axis)


# ---------------------------------------------------------------------------
# split: cut one operand into consecutive pieces of given sizes along an axis
# ---------------------------------------------------------------------------


def _ms_split(x, sizes, axis):
    return ops.split(x, sizes, axis)


# ``ops.split`` slices piece by piece in a Python loop that MindSpore's graph compiler
# unrolls while inferring types: 2.4 s of compile for one split into ~60 pieces (a
# multi-tensor optimizer update's), against ~0.1 s for one SplitWithSize, made once.
# Compiled, SplitWithSize fails on an empty piece off axis 0 ("memcpy failed"):
# a split with an empty piece keeps ops.split.
_SPLIT_WITH_SIZE = split_with_size_class()()


def _lower_split(ctx, x, *, sizes, axis):
    if min(sizes) == 0:
        return ctx.call(_ms_split, x, sizes=sizes, axis=axis)
    return f"{ctx.ref(_SPLIT_WITH_SIZE)}({x}, {ctx.param(tuple(sizes))}, {axis})"


def _split_type(x, *, sizes, axis):
    _check_rank("split", x)
    _check_axis("split", axis, x.ndim)
    if not sizes or any(s < 0 for s in sizes) or sum(sizes) != x.shape[axis]:
        raise ShapeError(
            f"split: sizes {sizes} must be >= 0 and sum to dimension {axis} of {x}")
    return [ArrayType(tuple(x.shape[:axis]) + (s,) + tuple(x.shape[axis + 1:]), x.dtype)
            for s in sizes]


split_p = def_primitive("split", FAMILY, _split_type, _ms_split, multiple_results=True,
                        lower=_lower_split)


def _split_batching(args, dims, *, sizes, axis):
    (x,), (d,) = args, dims
    outs = split_p.bind(x, sizes=sizes, axis=axis + (axis >= d))
    return outs, [d] * len(outs)


def _split_transpose(cts, x, *, sizes, axis):
    """split^T concatenates the cotangents (a zero cotangent becomes zeros)."""
    shape = x.aval.shape
    pieces = []
    for ct, s in zip(cts, sizes, strict=True):
        if ct is None or isinstance(ct, Zero):
            ct = zeros(tuple(shape[:axis]) + (s,) + tuple(shape[axis + 1:]), x.aval.dtype)
        pieces.append(ct)
    return [pieces[0] if len(pieces) == 1 else concat_p.bind(*pieces, axis=axis)]


batching.set(split_p, _split_batching)
deflinear(split_p, _split_transpose)


def _split_sharding(x, *, sizes, axis):
    """Every dim but ``axis`` is parallel across the operand and all pieces."""
    labels = tuple(None if i == axis else f"d{i}" for i in range(x.ndim))
    return FactorSpec([labels], [labels] * len(sizes),
                      {lab: x.shape[i] for i, lab in enumerate(labels) if lab},
                      flops_per_point=0.0, linear=((0,),), kernels=len(sizes))


sharding.set(split_p, _split_sharding)


def split(x: Shaped[Array, "..."], split_size_or_sections, axis: int = 0) -> tuple:
    """Split ``x`` along ``axis`` (``mindspore.ops.split``).

    An int gives pieces of that size (the last may be smaller); a tuple or list gives
    the size of each piece.

    >>> import numpy as np, fshard as fs
    >>> [p.shape for p in fs.ops.split(np.zeros((5, 2), np.float32), 2)]
    [(2, 2), (2, 2), (1, 2)]
    >>> [p.shape for p in fs.ops.split(np.zeros((5, 2), np.float32), (1, 4))]
    [(1, 2), (4, 2)]

    See also: ``concat``.
    """
    a = typeof(x)
    if a.ndim == 0:
        raise ShapeError(f"split(x=...): x is a scalar ({a}); split needs rank >= 1.")
    axis = _norm_axis(axis, a.ndim, "split(axis=...)")
    n = a.shape[axis]
    _int_dims(ArrayType((n,), a.dtype), "split")
    if isinstance(split_size_or_sections, (int, np.integer)) and not isinstance(
            split_size_or_sections, bool):
        s = int(split_size_or_sections)
        if s <= 0:
            raise ArgumentError(
                f"split(split_size_or_sections={s}): a piece size must be >= 1.")
        sizes = (s,) * (n // s) + ((n % s,) if n % s else ())
    else:
        sizes = _static_ints(split_size_or_sections, "split(split_size_or_sections=...)")
        if not sizes or any(v < 0 for v in sizes) or sum(sizes) != n:
            raise ShapeError(
                f"split(split_size_or_sections={sizes}, axis={axis}): the sizes must be >= 0 "
                f"and sum to {n}, the size of dimension {axis} of x {a}.\nFix: adjust the "
                "sizes, or pass an int piece size.")
    return tuple(split_p.bind(x, sizes=sizes, axis=axis))


# ---------------------------------------------------------------------------
# slice: static start/limit/strides (NB: lax.slice)
# ---------------------------------------------------------------------------


def _ms_slice(x, start, limit, strides):
    return slice_tensor(x, start, limit, strides)


def _sliced_size(start: int, limit: int, stride: int) -> int:
    return max(0, (limit - start + stride - 1) // stride)


def _slice_type(x, *, start, limit, strides):
    _check_rank("slice", x)
    for lo, hi, st, n in zip(start, limit, strides, x.shape):
        if is_symbolic(n) and not (lo == 0 and dims_equal(hi, n) and st == 1):
            raise ShapeError(
                f"slice of {x}: a symbolic dimension ({n}) can only be taken whole, got "
                f"start={lo}, limit={hi}, stride={st}.\nFix: slice only static dimensions, "
                "or make this one static.")
    if not len(start) == len(limit) == len(strides) == x.ndim:
        raise ProgramTypeError(
            f"slice: start {start}, limit {limit} and strides {strides} need one entry "
            f"per dimension of {x}")
    for lo, hi, st, n in zip(start, limit, strides, x.shape):
        if is_symbolic(n):
            continue
        if not (0 <= lo <= hi <= n and st >= 1):
            raise ShapeError(
                f"slice of {x}: need 0 <= start <= limit <= size and stride >= 1, got "
                f"start={start}, limit={limit}, strides={strides}")
    return ArrayType(tuple(n if is_symbolic(n) else _sliced_size(*a)
                           for n, a in zip(x.shape, zip(start, limit, strides))), x.dtype)


def _lower_slice(ctx, x, *, start, limit, strides):
    return lower_slice(ctx, x, start, limit, strides)


slice_p = def_primitive("slice", FAMILY, _slice_type, _ms_slice, lower=_lower_slice)


def _slice_batching(args, dims, *, start, limit, strides):
    (x,), (d,) = args, dims
    size = typeof(x).shape[d]
    return [slice_p.bind(x, start=_insert(start, d, 0), limit=_insert(limit, d, size),
                         strides=_insert(strides, d, 1))], [d]


def _slice_transpose(ct, x, *, start, limit, strides):
    """slice^T pads the cotangent back: zeros before, between (strides) and after."""
    shape = x.aval.shape
    out = _slice_type(x.aval, start=start, limit=limit, strides=strides).shape
    if 0 in out:
        return [zeros(shape, x.aval.dtype)]
    high = tuple(n - (lo + (m - 1) * st + 1) for n, lo, m, st in zip(shape, start, out, strides))
    return [pad_p.bind(instantiate(ct), low=tuple(start), high=high,
                       interior=tuple(st - 1 for st in strides))]


batching.set(slice_p, _slice_batching)
deflinear(slice_p, _slice_transpose)


def _slice_splittable(n: int, lo: int, hi: int, st: int) -> bool:
    """Whether dim ``x[lo:hi:st]`` of size ``n`` commutes with splitting: every block of
    ``st * k`` elements yields ``k`` consecutive outputs when the slice starts in the
    first stride (``lo < st``) and runs to the end (one output per stride of ``n``)."""
    return lo < st and n % st == 0 and _sliced_size(lo, hi, st) == n // st


def _slice_sharding(x, *, start, limit, strides):
    """A dim is parallel when the slice takes one element per stride of the whole dim
    (full dims, and ``x[1::2]``-style strided dims whose blocks are multiples of the
    stride); other dims stay whole."""
    ins, outs, sizes = [], [], {}
    for i, (n, lo, hi, st) in enumerate(zip(x.shape, start, limit, strides)):
        lab = f"d{i}" if _slice_splittable(n, lo, hi, st) else None
        ins.append(lab)
        outs.append(lab)
        if lab:
            sizes[lab] = n // st  # a split count must divide the output extent
    return FactorSpec([tuple(ins)], [tuple(outs)], sizes, flops_per_point=0.0,
                      local_params=_slice_local_params)


def _slice_local_params(params, local_in, local_out):
    """A split dim slices its block from the same offset up to the block's end."""
    start, limit, strides = params["start"], params["limit"], params["strides"]
    glob = [_sliced_size(*a) for a in zip(start, limit, strides)]
    limit = tuple(hi if m == g else min(local_in[0].shape[i], lo + max(m - 1, 0) * st + 1)
                  for i, (lo, hi, st, m, g) in enumerate(
                      zip(start, limit, strides, local_out[0].shape, glob)))
    return {**params, "limit": limit}


sharding.set(slice_p, _slice_sharding)


def slice_array(x: Shaped[Array, "..."], start, limit, strides=None) -> Shaped[Array, "..."]:
    """``x[start[0]:limit[0]:strides[0], ...]`` with static bounds (NB: ``lax.slice``).

    >>> import numpy as np, fshard as fs
    >>> x = np.arange(10, dtype=np.float32)
    >>> fs.ops.slice_array(x, (1,), (8,), (3,)).asnumpy().tolist()
    [1.0, 4.0, 7.0]

    See also: ``getitem`` (``x[1:8:3]`` on a traced value), ``pad``.
    """
    a = typeof(x)
    start = _static_ints(start, "slice_array(start=...)")
    limit = _static_ints(limit, "slice_array(limit=...)")
    strides = (1,) * a.ndim if strides is None else _static_ints(
        strides, "slice_array(strides=...)")
    if not len(start) == len(limit) == len(strides) == a.ndim:
        raise ArgumentError(
            f"slice_array: start {start}, limit {limit} and strides {strides} need one "
            f"entry per dimension of x {a}.")
    for i, (lo, hi, st, n) in enumerate(zip(start, limit, strides, a.shape)):
        if is_symbolic(n) or is_symbolic(hi):
            continue  # the type rule checks that a symbolic dimension is taken whole
        if not (0 <= lo <= hi <= n and st >= 1):
            raise ShapeError(
                f"slice_array: dimension {i} of x {a} has size {n}, but got start={lo}, "
                f"limit={hi}, stride={st}; need 0 <= start <= limit <= {n} and stride >= "
                "1.\nFix: clip the bounds, or use x[...] indexing for negative bounds "
                "and steps.")
    if start == (0,) * a.ndim and limit == tuple(a.shape) and strides == (1,) * a.ndim:
        return x
    return slice_p.bind(x, start=start, limit=limit, strides=strides)


# ---------------------------------------------------------------------------
# pad: zeros before (low), after (high) and between (interior) elements
# ---------------------------------------------------------------------------


def _ms_pad(x, low, high, interior):
    # Interior padding: interleave each row with `i` zero rows, then drop the trailing
    # ones. The loop runs over static tuples, so GRAPH mode unrolls it.
    nd = len(low)
    for ax in range(nd):
        i = interior[ax]
        if i > 0:
            shape = x.shape
            n = shape[ax]
            y = ops.expand_dims(x, ax + 1)
            z = ops.zeros(shape[:ax + 1] + (i,) + shape[ax + 1:], x.dtype)
            y = ops.reshape(ops.concat((y, z), ax + 1),
                            shape[:ax] + (n * (i + 1),) + shape[ax + 1:])
            x = ops.narrow(y, ax, 0, n * (i + 1) - i)
    pads = ()
    for ax in range(nd):
        pads = (low[ax], high[ax]) + pads  # ops.pad lists the last dimension first
    return ops.pad(x, pads)


# ops.pad is Python (argument checks, a scalar conversion) that MindSpore's graph
# compiler interprets at each call site (~50 ms each, measured): without interior
# padding, the lowering calls the PadV3 instance ops.pad would, made once.
_PAD = ops.PadV3(mode="constant", paddings_contiguous=True)


def _lower_pad(ctx, x, *, low, high, interior):
    if any(interior):
        return ctx.call(_ms_pad, x, low=low, high=high, interior=interior)
    aval = ctx.in_avals[0]
    padded = [ax for ax in range(len(low)) if low[ax] or high[ax]]
    floats = (dtypes.float16, dtypes.float32, dtypes.float64)
    if len(padded) == 1 and aval.dtype in floats and all(isinstance(d, int)
                                                         for d in aval.shape):
        # One padded dimension (a slice's transpose, as in a rotary embedding's
        # backward): zero blocks concatenated around x. PadV3 took 34 us to 0.3 ms more
        # per call on (4, 4, 64, 32) float32 (GRAPH mode, CPU, measured).
        ax = padded[0]
        parts = []
        for width in (low[ax], None, high[ax]):
            if width is None:
                parts.append(x)
            elif width:
                shape = aval.shape[:ax] + (width,) + aval.shape[ax + 1:]
                parts.append(ctx.call(_ms_full, ctx.param(shape), ctx.param(0.0),
                                       ctx.param(aval.dtype)))
        return ctx.call(_ms_concat, *parts, axis=ax)
    pads = ()
    for lo, hi in zip(low, high):
        pads = (lo, hi) + pads  # the last dimension first
    zero = ctx.ref(Tensor(0, ctx.in_avals[0].dtype), "zero")
    return f"{ctx.ref(_PAD)}({x}, {ctx.param(pads)}, {zero})"


def _padded_size(n: int, lo: int, hi: int, i: int) -> int:
    return lo + hi + n + max(n - 1, 0) * i


def _pad_type(x, *, low, high, interior):
    _check_rank("pad", x)
    _int_dims(x, "pad")
    if not len(low) == len(high) == len(interior) == x.ndim:
        raise ProgramTypeError(
            f"pad: low {low}, high {high} and interior {interior} need one entry per "
            f"dimension of {x}")
    if any(v < 0 for v in low + high + interior):
        raise ShapeError(f"pad: widths must be >= 0, got low={low}, high={high}, "
                         f"interior={interior}")
    return ArrayType(tuple(_padded_size(*a) for a in zip(x.shape, low, high, interior)),
                     x.dtype)


pad_p = def_primitive("pad", FAMILY, _pad_type, _ms_pad, lower=_lower_pad)


def _pad_batching(args, dims, *, low, high, interior):
    (x,), (d,) = args, dims
    return [pad_p.bind(x, low=_insert(low, d, 0), high=_insert(high, d, 0),
                       interior=_insert(interior, d, 0))], [d]


def _pad_transpose(ct, x, *, low, high, interior):
    """pad^T slices the original elements back out of the cotangent."""
    shape = x.aval.shape
    if 0 in shape:
        return [zeros(shape, x.aval.dtype)]
    limit = tuple(lo + (n - 1) * (i + 1) + 1 for lo, n, i in zip(low, shape, interior))
    return [slice_p.bind(instantiate(ct), start=tuple(low), limit=limit,
                         strides=tuple(i + 1 for i in interior))]


batching.set(pad_p, _pad_batching)
deflinear(pad_p, _pad_transpose)


def _pad_sharding(x, *, low, high, interior):
    """A dim is parallel when its padding repeats with every element: none, or
    ``interior`` zeros before each element (``low == interior``, ``high == 0``) or after
    each (``low == 0``, ``high == interior``); each block is then padded alike. Other
    padded dims stay whole (their zeros sit at the ends of the whole dim)."""
    labels = tuple(f"d{i}" if (lo, hi) in ((it, 0), (0, it)) else None
                   for i, (lo, hi, it) in enumerate(zip(low, high, interior)))
    return FactorSpec([labels], [labels],
                      {lab: x.shape[i] for i, lab in enumerate(labels) if lab},
                      flops_per_point=0.0)


sharding.set(pad_p, _pad_sharding)


def pad(x: Shaped[Array, "..."], low, high, interior=None) -> Shaped[Array, "..."]:
    """Zero-pad ``x``: ``low[i]`` zeros before, ``high[i]`` after and ``interior[i]``
    between the elements of dimension ``i`` (NB: ``lax.pad`` with non-negative widths).

    >>> import numpy as np, fshard as fs
    >>> fs.ops.pad(np.ones(3, np.float32), (1,), (2,), (1,)).asnumpy().tolist()
    [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]

    See also: ``slice_array`` (its transpose).
    """
    a = typeof(x)
    low = _static_ints(low, "pad(low=...)")
    high = _static_ints(high, "pad(high=...)")
    interior = (0,) * a.ndim if interior is None else _static_ints(interior, "pad(interior=...)")
    if not len(low) == len(high) == len(interior) == a.ndim:
        raise ArgumentError(
            f"pad: low {low}, high {high} and interior {interior} need one entry per "
            f"dimension of x {a}.")
    if any(v < 0 for v in low + high + interior):
        raise ArgumentError(
            f"pad: widths must be >= 0, got low={low}, high={high}, interior={interior}.\n"
            "Fix: use slice_array (or x[...]) to remove elements.")
    if not any(low + high + interior):
        return x
    return pad_p.bind(x, low=low, high=high, interior=interior)


# ---------------------------------------------------------------------------
# gather: take entries along one axis at an integer index array of any shape
# ---------------------------------------------------------------------------


def _ms_gather(x, indices, axis):
    return gather_any_rank(x, indices, axis)


def _gather_type(x, indices, *, axis):
    _check_rank("gather", x)
    _check_axis("gather", axis, x.ndim)
    if not _is_index_dtype(indices.dtype):
        raise ProgramTypeError(f"gather needs int32 or int64 indices, got {indices}")
    return ArrayType(tuple(x.shape[:axis]) + tuple(indices.shape) + tuple(x.shape[axis + 1:]),
                     x.dtype)


gather_p = def_primitive("gather", FAMILY, _gather_type, _ms_gather)


def _offset_indices(indices, n: int):
    """Batched indices (batch dim first) into a batch-major flattening of the
    indexed axis: row b of ``indices`` is shifted by ``b * n``."""
    from fshard.primitives.elementwise import add

    a = typeof(indices)
    offsets = (np.arange(a.shape[0]) * n).astype(dtypes.to_numpy(a.dtype))
    return add(indices, offsets.reshape((-1,) + (1,) * (a.ndim - 1)))


def _gather_batching(args, dims, *, axis):
    (x, indices), (dx, di) = args, dims
    if di is None:
        # Gather along the same logical axis of the batched x.
        ax = axis + (axis >= dx)
        out_d = dx if dx < ax else dx - 1 + typeof(indices).ndim
        return [gather_p.bind(x, indices, axis=ax)], [out_d]
    if dx is None:
        return [gather_p.bind(x, indices, axis=axis)], [axis + di]
    # Both batched: put the batch next to the indexed axis, flatten the two, and
    # shift each example's indices into its own block.
    size = batch_size(args, dims)
    x = move_axis(x, dx, axis)
    xs = typeof(x).shape
    n = xs[axis + 1]
    x = reshape(x, tuple(xs[:axis]) + (size * n,) + tuple(xs[axis + 2:]))
    indices = _offset_indices(move_axis(indices, di, 0), n)
    return [gather_p.bind(x, indices, axis=axis)], [axis]


def _gather_transpose(ct, x, indices, *, axis):
    """gather^T adds each cotangent row back at its index (scatter_add)."""
    assert is_undefined(x) and not is_undefined(indices), "gather is linear in x only"
    return [scatter_add_p.bind(instantiate(ct), indices, shape=tuple(x.aval.shape), axis=axis),
            None]


batching.set(gather_p, _gather_batching)
defjvp(gather_p, lambda t, ans, x, indices, *, axis: gather_p.bind(t, indices, axis=axis), None)
transpose_rules.set(gather_p, _gather_transpose)


def _gather_sharding(x, indices, *, axis):
    """The indices' dims and the table's other dims are parallel. The gathered axis
    stays whole: a device holding rows [lo, hi) would need shifted, masked indices
    (a different local computation), which a factor rule cannot express."""
    xl = tuple(None if i == axis else f"x{i}" for i in range(x.ndim))
    il = tuple(f"i{j}" for j in range(indices.ndim))
    out = xl[:axis] + il + xl[axis + 1:]
    sizes = {lab: x.shape[i] for i, lab in enumerate(xl) if lab}
    sizes.update({lab: indices.shape[j] for j, lab in enumerate(il)})
    return FactorSpec([xl, il], [out], sizes, flops_per_point=0.0, linear=((0,),))


sharding.set(gather_p, _gather_sharding)


def _index_array(indices, what: str):
    """Validate an index operand: integer Tracer/Tensor, or a list/NumPy array."""
    if isinstance(indices, (list, tuple)) or isinstance(indices, (int, np.integer)):
        indices = np.asarray(indices)
        if indices.size == 0:
            indices = indices.astype(np.int64)
    a = typeof(indices)
    if a.dtype == dtypes.bool_:
        raise ArgumentError(
            f"{what} is a boolean array {a}; boolean masks select a data-dependent number "
            "of elements, which fshard's static shapes cannot express.\nFix: use "
            "fs.ops.where(mask, x, 0) to zero the unselected elements instead.")
    if not dtypes.is_int(a.dtype):
        raise ArgumentError(
            f"{what} must be an integer array, got {a}.\nFix: cast the indices with "
            "fs.ops.cast(indices, mindspore.int32).")
    if not _is_index_dtype(a.dtype):
        from fshard.primitives.elementwise import cast

        indices = cast(indices, dtypes.int32)
    return indices


def gather(x: Shaped[Array, "..."], indices: Int[Array, "..."],
           axis: int = 0) -> Shaped[Array, "..."]:
    """Take the entries of ``x`` at ``indices`` along ``axis`` (``mindspore.ops.gather``).

    The result has shape ``x.shape[:axis] + indices.shape + x.shape[axis+1:]``: an
    embedding lookup is ``gather(table, ids)``. Indices must lie in
    ``[0, x.shape[axis])``; ``x[...]`` indexing also accepts negative ones.

    >>> import numpy as np, fshard as fs
    >>> table = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> fs.ops.gather(table, np.array([[2, 0]], np.int32)).shape
    (1, 2, 2)

    See also: ``scatter_add`` (its transpose), ``getitem``.
    """
    a = typeof(x)
    if a.ndim == 0:
        raise ShapeError(f"gather(x=...): x is a scalar ({a}); gather needs rank >= 1.")
    axis = _norm_axis(axis, a.ndim, "gather(axis=...)")
    indices = _index_array(indices, "gather(indices=...)")
    _check_index_range(indices, a.shape[axis], "gather(indices=...)")
    return gather_p.bind(x, indices, axis=axis)


def _check_index_range(indices, n, what: str) -> None:
    """Concrete indices are checked against ``[0, n)`` before MindSpore sees them (its
    CPU kernels fail later, asynchronously, or give zeros); traced ones cannot be."""
    if isinstance(indices, Tracer) or not isinstance(n, int):
        return
    values = indices.asnumpy() if hasattr(indices, "asnumpy") else np.asarray(indices)
    if values.size and (values.min() < 0 or values.max() >= n):
        bad = values[(values < 0) | (values >= n)].ravel()[:5].tolist()
        raise ArgumentError(
            f"{what} has entries {bad} outside [0, {n}) (the size of the gathered axis).\n"
            "Fix: clip or correct the indices; x[...] indexing accepts negative ones.")


# ---------------------------------------------------------------------------
# scatter_add: add slices of `updates` into zeros of `shape` at indices along an axis
# ---------------------------------------------------------------------------


def _ms_scatter_add(updates, indices, shape, axis):
    # unsorted_segment_sum sums along leading dims, so move the index dims to the
    # front, sum into `shape[axis]` segments, then move the segment dim to `axis`.
    k = len(indices.shape)
    if k == 0:
        updates = ops.expand_dims(updates, axis)
        indices = ops.reshape(indices, (1,))
        k = 1
    nd = len(updates.shape)
    perm_in = tuple(range(axis, axis + k)) + tuple(range(axis)) + tuple(range(axis + k, nd))
    out = ops.unsorted_segment_sum(ops.transpose(updates, perm_in), indices, shape[axis])
    perm_out = tuple(range(1, axis + 1)) + (0,) + tuple(range(axis + 1, len(shape)))
    return ops.transpose(out, perm_out)


def _scatter_add_type(updates, indices, *, shape, axis):
    if not shape:
        raise ProgramTypeError("scatter_add needs an output shape of rank >= 1")
    _check_axis("scatter_add", axis, len(shape))
    if not _is_index_dtype(indices.dtype):
        raise ProgramTypeError(f"scatter_add needs int32 or int64 indices, got {indices}")
    expected = tuple(shape[:axis]) + tuple(indices.shape) + tuple(shape[axis + 1:])
    if updates.ndim != len(expected) or not all(
            dims_equal(a, b) for a, b in zip(updates.shape, expected)):
        raise ShapeError(
            f"scatter_add into shape {shape} along axis {axis} with indices {indices} "
            f"needs updates of shape {expected}, got {updates}")
    return ArrayType(tuple(shape), updates.dtype)


scatter_add_p = def_primitive("scatter_add", FAMILY, _scatter_add_type, _ms_scatter_add)


def _scatter_add_batching(args, dims, *, shape, axis):
    (updates, indices), (du, di) = args, dims
    size = batch_size(args, dims)
    if di is None:
        # Every example scatters into its own output: prepend the batch to `shape`.
        updates = move_axis(updates, du, 0)
        return [scatter_add_p.bind(updates, indices, shape=(size,) + tuple(shape),
                                   axis=axis + 1)], [0]
    # Batched indices: scatter into a batch-major flattening of the indexed axis.
    updates = batch_to_front(updates, du, size)
    updates = move_axis(updates, 0, axis)
    n = shape[axis]
    indices = _offset_indices(move_axis(indices, di, 0), n)
    flat = tuple(shape[:axis]) + (size * n,) + tuple(shape[axis + 1:])
    out = scatter_add_p.bind(updates, indices, shape=flat, axis=axis)
    return [reshape(out, tuple(shape[:axis]) + (size, n) + tuple(shape[axis + 1:]))], [axis]


def _scatter_add_transpose(ct, updates, indices, *, shape, axis):
    """scatter_add^T reads each cotangent row back at its index (gather)."""
    assert is_undefined(updates) and not is_undefined(indices), \
        "scatter_add is linear in updates only"
    return [gather_p.bind(instantiate(ct), indices, axis=axis), None]


batching.set(scatter_add_p, _scatter_add_batching)
defjvp(scatter_add_p,
       lambda t, ans, u, indices, *, shape, axis: scatter_add_p.bind(
           t, indices, shape=shape, axis=axis),
       None)
transpose_rules.set(scatter_add_p, _scatter_add_transpose)


def _scatter_add_sharding(updates, indices, *, shape, axis):
    """The output's other dims are parallel. The indices' dims are a sum: a device
    holding some of the updates (and their indices) scatters them into zeros, and the
    per-device outputs add up to the result (a pending sum). The scattered axis of the
    output stays whole."""
    ol = tuple(None if i == axis else f"o{i}" for i in range(len(shape)))
    il = tuple(f"i{j}" for j in range(indices.ndim))
    sizes = {lab: shape[i] for i, lab in enumerate(ol) if lab}
    sizes.update({lab: indices.shape[j] for j, lab in enumerate(il)})
    return FactorSpec([ol[:axis] + il + ol[axis + 1:], il], [ol], sizes,
                      reduce=frozenset(il), local_params=_shape_param, linear=((0,),))


sharding.set(scatter_add_p, _scatter_add_sharding)


def scatter_add(updates: Shaped[Array, "..."], indices: Int[Array, "..."], shape,
                axis: int = 0) -> Shaped[Array, "..."]:
    """Zeros of ``shape`` with ``updates`` added at ``indices`` along ``axis``; repeated
    indices accumulate (``mindspore.ops.unsorted_segment_sum`` along ``axis``).

    ``updates`` has shape ``shape[:axis] + indices.shape + shape[axis+1:]``; this is
    the transpose of ``gather``.

    >>> import numpy as np, fshard as fs
    >>> fs.ops.scatter_add(np.ones(3, np.float32), np.array([0, 2, 0], np.int32), (3,)
    ...                    ).asnumpy().tolist()
    [2.0, 0.0, 1.0]
    """
    shape = _static_ints(shape, "scatter_add(shape=...)")
    if not shape:
        raise ArgumentError("scatter_add(shape=()): the output needs rank >= 1.")
    axis = _norm_axis(axis, len(shape), "scatter_add(axis=...)")
    indices = _index_array(indices, "scatter_add(indices=...)")
    _check_index_range(indices, shape[axis], "scatter_add(indices=...)")
    ua, ia = typeof(updates), typeof(indices)
    expected = tuple(shape[:axis]) + tuple(ia.shape) + tuple(shape[axis + 1:])
    if tuple(ua.shape) != expected:
        raise ShapeError(
            f"scatter_add(updates=..., indices=..., shape={shape}, axis={axis}): updates "
            f"has shape {tuple(ua.shape)}, but indices of shape {tuple(ia.shape)} need "
            f"updates of shape {expected} (shape[:axis] + indices.shape + "
            "shape[axis+1:]).\nFix: reshape the updates or the indices.")
    return scatter_add_p.bind(updates, indices, shape=shape, axis=axis)


# ---------------------------------------------------------------------------
# one_hot: integer indices -> indicator vectors along a new last axis
# ---------------------------------------------------------------------------


def _ms_one_hot(indices, depth, dtype):
    return _ms_one_hot_of(indices, ops.arange(depth, dtype=indices.dtype), dtype)


def _lower_one_hot(ctx, indices, *, depth, dtype):
    # the 0..depth-1 row as a constant: ``ops.arange`` is Python that MindSpore's compiler
    # interprets at each call site (~0.6 s of compile, measured)
    row = ctx.ref(as_tensor(np.arange(depth, dtype=dtypes.to_numpy(ctx.in_avals[0].dtype))),
                  "iota")
    return ctx.call(_ms_one_hot_of, indices, row, dtype=dtype)


def _ms_one_hot_of(indices, row, dtype):
    return ops.cast(ops.equal(ops.expand_dims(indices, -1), row), dtype)


def _one_hot_type(indices, *, depth, dtype):
    if not _is_index_dtype(indices.dtype):
        raise ProgramTypeError(f"one_hot needs int32 or int64 indices, got {indices}")
    if not (isinstance(depth, int) and depth >= 1):
        raise ProgramTypeError(f"one_hot depth must be an int >= 1, got {depth!r}")
    return ArrayType(tuple(indices.shape) + (depth,), dtype)


one_hot_p = def_primitive("one_hot", FAMILY, _one_hot_type, _ms_one_hot, lower=_lower_one_hot)
batching.set(one_hot_p, vectorized(one_hot_p))  # the new axis is last: batch dim unmoved
sharding.set(one_hot_p, lambda indices, *, depth, dtype: FactorSpec(
    # The indices' dims are parallel; the new depth axis stays whole (a block of it
    # would need indices shifted by the block's offset).
    [tuple(f"d{i}" for i in range(indices.ndim))],
    [tuple(f"d{i}" for i in range(indices.ndim)) + (None,)],
    {f"d{i}": n for i, n in enumerate(indices.shape)}, flops_per_point=0.0))
jvp.set(one_hot_p, lambda primals, tangents, **p: (
    [one_hot_p.bind(*primals, **p)], [Zero(_one_hot_type(typeof(primals[0]), **p))]))
unsupported(one_hot_p, "transpose", "not linear (integer operand)")


def one_hot(indices: Int[Array, "*shape"], depth: int,
            dtype=dtypes.float32) -> Shaped[Array, "*shape depth"]:
    """``out[..., j] = (indices[...] == j)`` for ``j < depth``, as ``dtype``. Indices
    outside ``[0, depth)`` give all-zero rows.

    >>> import numpy as np, fshard as fs
    >>> fs.ops.one_hot(np.array([2, 0], np.int32), 3).asnumpy().tolist()
    [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    """
    if isinstance(depth, Tracer) or not isinstance(depth, (int, np.integer)) or isinstance(
            depth, bool) or depth < 1:
        raise ArgumentError(
            f"one_hot(depth=...) must be a Python int >= 1, got {depth!r}; the depth is "
            "the size of the new axis, so it must be static.")
    indices = _index_array(indices, "one_hot(indices=...)")
    return one_hot_p.bind(indices, depth=int(depth), dtype=dtypes.canonical(dtype))


# ---------------------------------------------------------------------------
# getitem: NumPy indexing on traced values (Tracer.__getitem__)
# ---------------------------------------------------------------------------


def _is_array_index(e) -> bool:
    return not isinstance(e, (slice, type(None), type(Ellipsis), int, np.integer))


def getitem(x: Shaped[Array, "..."], idx) -> Shaped[Array, "..."]:
    """``x[idx]`` with NumPy semantics for ints, slices (any step), ``None``, ``...``,
    concrete 1-D boolean masks and integer-array indices (a ``gather``; negative
    entries count from the end; several broadcast together, as NumPy's advanced
    indexing).

    >>> import numpy as np, fshard as fs
    >>> x = np.arange(12, dtype=np.float32).reshape(3, 4)
    >>> fs.ops.getitem(x, (slice(None, None, -2), None, 1)).asnumpy().tolist()
    [[9.0], [1.0]]
    >>> fs.ops.getitem(x, (1, [3, 0])).asnumpy().tolist()
    [7.0, 4.0]

    See also: ``slice_array``, ``gather``.
    """
    a = typeof(x)
    idx = idx if isinstance(idx, tuple) else (idx,)
    # A concrete 1-D boolean mask (a list of bools too) selects a known number of
    # entries: its positions.
    idx = tuple(np.asarray(e) if type(e) is list and e and all(
        isinstance(v, (bool, np.bool_)) for v in e) else e for e in idx)
    idx = tuple(np.nonzero(np.asarray(_concrete_index(e)))[0] if (
        not isinstance(e, Tracer) and getattr(e, "ndim", 0) == 1
        and typeof(e).dtype == dtypes.bool_) else e for e in idx)
    for e in idx:
        if isinstance(e, (bool, np.bool_)):
            raise ArgumentError(
                f"x[{e}]: boolean scalars are not supported as indices.\nFix: use None to "
                "add an axis.")
    n_ellipsis = sum(e is Ellipsis for e in idx)
    if n_ellipsis > 1:
        raise ArgumentError(f"x[...]: an index can hold at most one Ellipsis, got {idx!r}.")
    n_arrays = sum(_is_array_index(e) for e in idx)
    consumed = sum(e is not None and e is not Ellipsis for e in idx)
    if consumed > a.ndim:
        raise ArgumentError(
            f"x[...]: too many indices for a value of type {a}: {consumed} indexed "
            f"dimensions, but it has {a.ndim}.")
    fill = (slice(None),) * (a.ndim - consumed)
    if n_ellipsis:
        k = next(i for i, e in enumerate(idx) if e is Ellipsis)
        idx = idx[:k] + fill + idx[k + 1:]
    else:
        idx = idx + fill
    if n_arrays > 1:
        x, idx = _one_array_index(x, idx, a)
        a, n_arrays = typeof(x), 1

    dim = 0
    for pos, e in enumerate(idx):  # an int index into a symbolic dimension: a gather
        if e is None:
            continue
        if isinstance(e, (int, np.integer)) and is_symbolic(a.shape[dim]):
            return _symbolic_int_index(x, idx, pos, dim, int(e), n_arrays)
        dim += 1

    starts, limits, strides = [], [], []
    result_shape = []   # after the slice and reshape; the array index keeps a full dim
    reversed_axes = []  # result axes to flip (negative steps)
    array_axis = array = None
    advanced_pos = []   # positions in idx of the array index and of ints (NumPy's rule)
    dim = 0
    for pos, e in enumerate(idx):
        if e is None:
            result_shape.append(1)
            continue
        n = a.shape[dim]
        if isinstance(e, slice) and is_symbolic(n) and e == slice(None):
            starts.append(0)  # a symbolic dimension taken whole
            limits.append(n)
            strides.append(1)
            result_shape.append(n)
        elif isinstance(e, slice):
            _int_dims(ArrayType((n,), a.dtype), "indexing")
            lo, hi, st = e.indices(n)
            m = len(range(lo, hi, st))
            if st < 0:  # take the same elements with a positive step, then flip them
                lo, st = (lo + (m - 1) * st if m else 0), -st
                if m > 1:
                    reversed_axes.append(len(result_shape))
            starts.append(lo)
            limits.append(lo + (m - 1) * st + 1 if m else lo)
            strides.append(st)
            result_shape.append(m)
        elif isinstance(e, (int, np.integer)):
            i = int(e)
            if not isinstance(n, int) or not -n <= i < n:
                raise ArgumentError(
                    f"x[...]: index {i} is out of bounds for dimension {dim} of {a} "
                    f"(size {n}).")
            i %= n
            starts.append(i)
            limits.append(i + 1)
            strides.append(1)
            advanced_pos.append(pos)
        else:
            array_axis, array = len(result_shape), _normalized_index(e, n, dim, a)
            starts.append(0)
            limits.append(n)
            strides.append(1)
            result_shape.append(n)
            advanced_pos.append(pos)
        dim += 1

    y = slice_array(x, starts, limits, strides) if a.ndim else x
    y = reshape(y, tuple(result_shape))
    for ax in reversed_axes:
        m = result_shape[ax]
        y = gather_p.bind(y, np.arange(m - 1, -1, -1, dtype=np.int32), axis=ax)
    if array is None:
        return y
    y = gather_p.bind(y, array, axis=array_axis)
    k = typeof(array).ndim
    contiguous = advanced_pos == list(range(advanced_pos[0], advanced_pos[-1] + 1))
    if not contiguous and array_axis:
        # NumPy puts the array's dims first when the advanced indices are separated.
        nd = typeof(y).ndim
        moved = list(range(array_axis, array_axis + k))
        y = transpose(y, tuple(moved + [i for i in range(nd) if i not in moved]))
    return y


def _one_array_index(x, idx: tuple, a: ArrayType) -> tuple:
    """``x[idx]`` with several integer-array indices as ``x2[idx2]`` with one: the
    indexed dimensions moved together and merged into one, indexed by the flat
    position of each broadcast combination (NumPy's rule for where the broadcast
    dimensions land: at the first array's place when the advanced indices, arrays and
    ints, are adjacent; first otherwise). ``idx`` has no Ellipsis."""
    from fshard.primitives.elementwise import add, mul

    dims, d = [], 0
    for e in idx:
        dims.append(None if e is None else d)
        d += e is not None
    arrays = [p for p, e in enumerate(idx) if _is_array_index(e)]
    advanced = [p for p, e in enumerate(idx)
                if _is_array_index(e) or isinstance(e, (int, np.integer))]
    adjacent = advanced == list(range(advanced[0], advanced[-1] + 1))
    sizes = [a.shape[dims[p]] for p in arrays]
    if not all(isinstance(n, int) for n in sizes):
        raise ArgumentError(
            f"x[...] with {len(arrays)} integer-array indices into a dimension of symbolic "
            f"size ({a}): fshard merges the indexed dimensions, which needs their sizes."
            "\nFix: index in steps, e.g. x[i][:, j], or use fs.ops.gather.")
    indices = [_normalized_index(idx[p], n, dims[p], a) for p, n in zip(arrays, sizes)]
    shape = np.broadcast_shapes(*[tuple(typeof(i).shape) for i in indices])
    flat = None
    for i, n in zip(indices, sizes):
        i = np.broadcast_to(i, shape) if isinstance(i, np.ndarray) else broadcast_to(i, shape)
        flat = i if flat is None else add(mul(flat, n), i)
    rest = [p for p in range(len(idx)) if p not in arrays]
    if adjacent:  # the merged dimension at the first array's place
        order = [q for p in range(len(idx)) if idx[p] is not None and p not in arrays[1:]
                 for q in ([dims[r] for r in arrays] if p == arrays[0] else [dims[p]])]
        new_idx = tuple(flat if p == arrays[0] else idx[p] for p in range(len(idx))
                        if p not in arrays[1:])
    else:  # NumPy puts the broadcast dimensions first
        order = [dims[p] for p in arrays] + [dims[p] for p in rest if dims[p] is not None]
        new_idx = (flat,) + tuple(idx[p] for p in rest)
    at = order.index(dims[arrays[0]])
    y = transpose(x, tuple(order))
    merged = tuple(a.shape[q] for q in order)
    y = reshape(y, merged[:at] + (int(np.prod(sizes)),) + merged[at + len(arrays):])
    return y, new_idx


def _symbolic_int_index(x, idx: tuple, pos: int, dim: int, i: int, n_arrays: int):
    """``x[..., i, ...]`` where ``i`` (at ``idx[pos]``) indexes the symbolic dimension
    ``dim``: in bounds for every size when ``-smallest <= i < smallest`` (the smallest
    size the Symbols accept); a negative ``i`` counts from the size read at run time."""
    from fshard.primitives.elementwise import add
    from fshard.primitives.reductions import dim_size

    a = typeof(x)
    n = a.shape[dim]
    low = dim_min(n)
    if not -low <= i < low:
        raise ArgumentError(
            f"x[...]: index {i} may be out of bounds for dimension {dim} of {a}: its size "
            f"{n} can be as small as {low} ({_describe_symbols(n)}).\nFix: declare the "
            f"Symbol with min > {i if i >= 0 else -i - 1}, e.g. fs.Symbol(min="
            f"{i + 1 if i >= 0 else -i}), or index within the smallest size.")
    if n_arrays:
        raise ArgumentError(
            f"x[...]: an int index into the symbolic dimension {dim} of {a} together with "
            "an integer-array index is not supported.\nFix: index in steps, e.g. "
            "x[0][:, j].")
    index = np.int32(i) if i >= 0 else add(dim_size(x, (dim,), dtypes.int32), np.int32(i))
    y = gather_p.bind(x, index, axis=dim)
    rest = idx[:pos] + idx[pos + 1:]
    return getitem(y, rest) if rest else y


def _describe_symbols(d) -> str:
    syms = [d] if isinstance(d, Symbol) else d.symbols()
    return ", ".join(f"{s} = {s!r}" for s in syms)


def _normalized_index(e, n, dim: int, a: ArrayType):
    """An integer index array with negative entries wrapped (checked if concrete)."""
    indices = _index_array(e, f"x[...] (the index for dimension {dim})")
    if isinstance(indices, np.ndarray):
        if indices.size and not ((indices >= -n) & (indices < n)).all():
            bad = indices[(indices < -n) | (indices >= n)].ravel()[0]
            raise ArgumentError(
                f"x[...]: index {bad} is out of bounds for dimension {dim} of {a} "
                f"(size {n}).")
        return np.where(indices < 0, indices + n, indices).astype(indices.dtype)
    from fshard.primitives.elementwise import add, less, where

    return where(less(indices, 0), add(indices, n), indices)


# ---------------------------------------------------------------------------
# index_update: x[idx] = value, functionally (NB: JAX's x.at[idx].set(value))
# ---------------------------------------------------------------------------


def _concrete_index(e):
    """A static index entry as NumPy (concrete Tensors included), or None if traced."""
    if isinstance(e, Tracer):
        return None
    if hasattr(e, "asnumpy"):
        return e.asnumpy()
    return e
