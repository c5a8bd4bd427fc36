"""Reductions: reduce_max, reduce_min, argmax, argmin, the op functions reduce_sum and
mean (reduce_sum's primitive is in fshard/primitives/base.py: it is a broadcast's
transpose). Reduction primitives always drop the reduced axes; ``keepdims`` is a
reshape in the op function."""

from __future__ import annotations

from mindspore import dtype as mstype
from mindspore import ops

from fshard.core import dtypes
from fshard.core.array_types import Array, ArrayLike, Float, Int, Shaped
from fshard.core.tracing import ArrayType, dim_prod, is_symbolic, typeof
from fshard.primitives.base import (  # noqa: F401  (reduce_sum_p, lane_sum_p: re-exported)
    Zero,
    _kept_shape,
    _norm_axis,
    _reduce_sharding,
    _reduce_type,
    _reducer_batching,
    broadcast_to,
    def_primitive,
    defjvp,
    lane_sum_p,
    reduce_sum_p,
    reshape,
)
from fshard.core.rules import batching, jvp, sharding, unsupported
from fshard.core.factors import FactorSpec

FAMILY = "reductions"


def _ms_reduce_max(x, axes):
    if len(axes) == 0:
        return x
    if x.dtype == mstype.bool_:  # MindSpore's CPU ReduceMax has no bool kernel
        return ops.amax(x.astype(mstype.int32), axes, False) > 0
    if len(axes) == 1:
        # Over one axis, ArgMaxWithValue's values are ReduceMax's, NaNs and signed
        # zeros included, in 0.5-0.8 of its time on CPU (docs/performance.md,
        # "One-axis maxima").
        return ops.max(x, axes[0])[0]
    return ops.amax(x, axes, False)


def _ms_reduce_min(x, axes):
    if len(axes) == 0:
        return x
    if x.dtype == mstype.bool_:
        return ops.amin(x.astype(mstype.int32), axes, False) > 0
    if len(axes) == 1:  # ArgMinWithValue's values: as in _ms_reduce_max
        return ops.min(x, axes[0])[0]
    return ops.amin(x, axes, False)


def _minmax_jvp(t, ans, x, *, axes):
    # The tangent is averaged over the positions that attain the extremum.
    from fshard.primitives.elementwise import cast, div, equal, mul

    shape = typeof(x).shape
    kept = broadcast_to(reshape(ans, _kept_shape(shape, axes)), shape)
    mask = cast(equal(x, kept), typeof(x).dtype)
    count = reduce_sum_p.bind(mask, axes=axes)
    return div(reduce_sum_p.bind(mul(t, mask), axes=axes), count)


reduce_max_p = def_primitive("reduce_max", FAMILY, _reduce_type, _ms_reduce_max)
batching.set(reduce_max_p, _reducer_batching(reduce_max_p))
sharding.set(reduce_max_p, _reduce_sharding("max"))
defjvp(reduce_max_p, _minmax_jvp)
unsupported(reduce_max_p, "transpose", "not linear")

reduce_min_p = def_primitive("reduce_min", FAMILY, _reduce_type, _ms_reduce_min)
batching.set(reduce_min_p, _reducer_batching(reduce_min_p))
sharding.set(reduce_min_p, _reduce_sharding("min"))
defjvp(reduce_min_p, _minmax_jvp)
unsupported(reduce_min_p, "transpose", "not linear")


def _ms_argmax(x, axis):
    return ops.argmax(x, axis, False).astype(dtypes.int32)


def _ms_argmin(x, axis):
    return ops.argmin(x, axis, False).astype(dtypes.int32)


def _arg_type(x, *, axis):
    return ArrayType(tuple(d for i, d in enumerate(x.shape) if i != axis), dtypes.int32)


def _def_arg(name, ms_fn):
    prim = def_primitive(name, FAMILY, _arg_type, ms_fn)

    def rule(args, dims, *, axis):
        (x,), (d,) = args, dims
        return [prim.bind(x, axis=axis + (axis >= d))], [d - (axis < d)]

    batching.set(prim, rule)
    sharding.set(prim, lambda x, *, axis: _reduce_sharding("max")(x, axes=(axis,)))
    jvp.set(prim, lambda primals, tangents, **p: (
        [prim.bind(*primals, **p)],
        [Zero(_arg_type(typeof(primals[0]), **p))]))
    unsupported(prim, "transpose", "integer output")
    return prim


argmax_p = _def_arg("argmax", _ms_argmax)
argmin_p = _def_arg("argmin", _ms_argmin)

# ---------------------------------------------------------------------------
# dim_size: the number of elements along some axes, read at run time. What a mean
# over a symbolic dimension divides by; with static sizes ``mean`` uses a constant.
# ---------------------------------------------------------------------------


def _dim_size_type(x, *, axes, dtype):
    return ArrayType((), dtype)


def _ms_dim_size(x, axes, dtype):
    n = 1
    for a in axes:  # in a graph with dynamic shapes, x.shape[a] is read at run time
        n = n * x.shape[a]
    return ops.scalar_to_tensor(n, dtype)


dim_size_p = def_primitive("dim_size", FAMILY, _dim_size_type, _ms_dim_size)


def _dim_size_batching(args, dims, *, axes, dtype):
    (x,), (d,) = args, dims
    return [dim_size_p.bind(x, axes=tuple(a + (a >= d) for a in axes), dtype=dtype)], [None]


batching.set(dim_size_p, _dim_size_batching)
jvp.set(dim_size_p, lambda primals, tangents, **p: (
    [dim_size_p.bind(*primals, **p)], [Zero(_dim_size_type(typeof(primals[0]), **p))]))
unsupported(dim_size_p, "transpose", "its output does not depend on the values of its input")
# The size is global: a sharded input along a counted axis is gathered first.
sharding.set(dim_size_p, lambda x, *, axes, dtype: FactorSpec(
    [tuple(None if i in axes else f"d{i}" for i in range(x.ndim))], [()],
    {f"d{i}": x.shape[i] for i in range(x.ndim) if i not in axes}, flops_per_point=0.0))


def dim_size(x: ArrayLike, axes, dtype) -> Shaped[Array, ""]:
    """The number of elements of ``x`` along ``axes`` as a 0-d array of ``dtype``."""
    return dim_size_p.bind(x, axes=tuple(axes), dtype=dtype)


# ---------------------------------------------------------------------------
# Op functions
# ---------------------------------------------------------------------------


def _axes(x, axis) -> tuple:
    nd = typeof(x).ndim
    if axis is None or axis == ():
        return tuple(range(nd))
    if isinstance(axis, (list, tuple)):
        axes = [_norm_axis(a, nd) for a in axis]
        if len(set(axes)) != len(axes):
            from fshard.errors import ArgumentError

            raise ArgumentError(
                f"axis={tuple(axis)!r} names a dimension more than once (for a value of "
                f"rank {nd}).\nFix: list each axis once.")
        return tuple(sorted(axes))
    return (_norm_axis(axis, nd),)


def _reduce(prim, x, axis, keepdims):
    axes = _axes(x, axis)
    shape = typeof(x).shape
    out = prim.bind(x, axes=axes) if axes else x
    return reshape(out, _kept_shape(shape, axes)) if keepdims else out


def reduce_sum(x: ArrayLike, axis=None, keepdims: bool = False) -> Shaped[Array, "..."]:
    """Sum over ``axis`` (an int, a tuple, or None for all axes)."""
    if typeof(x).dtype == dtypes.bool_:
        from fshard.primitives.elementwise import cast

        x = cast(x, dtypes.int64)
    return _reduce(reduce_sum_p, x, axis, keepdims)


def reduce_max(x: ArrayLike, axis=None, keepdims: bool = False) -> Shaped[Array, "..."]:
    return _reduce(reduce_max_p, x, axis, keepdims)


def reduce_min(x: ArrayLike, axis=None, keepdims: bool = False) -> Shaped[Array, "..."]:
    return _reduce(reduce_min_p, x, axis, keepdims)


def count(x: ArrayLike, axis=None, dtype=dtypes.int64) -> Shaped[Array, ""]:
    """The number of elements of ``x`` along ``axis`` (an int, a tuple, or None for all
    axes): a Python int when those dimensions are static, else a 0-d array of ``dtype``
    read at run time (``dim_size``). What every mean, variance and element count divides
    by, so that a symbolic dimension never counts as a placeholder number."""
    axes = _axes(x, axis)
    shape = typeof(x).shape
    n = dim_prod([shape[a] for a in axes])
    return dim_size(x, axes, dtype) if is_symbolic(n) else n


def mean(x: ArrayLike, axis=None, keepdims: bool = False) -> Float[Array, "..."]:
    """Mean over ``axis`` (integer inputs average in float32)."""
    from fshard.primitives.elementwise import cast, div, mul

    if not dtypes.is_float(typeof(x).dtype):
        x = cast(x, dtypes.float32)
    n = count(x, axis, typeof(x).dtype)
    if not isinstance(n, int):  # a size known only at run time
        return div(reduce_sum(x, axis, keepdims), n)
    # The mean of nothing is nan, as in MindSpore and NumPy.
    return mul(reduce_sum(x, axis, keepdims), 1.0 / n if n else float("nan"))


def argmax(x: ArrayLike, axis: int = -1, keepdims: bool = False) -> Int[Array, "..."]:
    axis = _norm_axis(axis, typeof(x).ndim)
    out = argmax_p.bind(x, axis=axis)
    return reshape(out, _kept_shape(typeof(x).shape, (axis,))) if keepdims else out


def argmin(x: ArrayLike, axis: int = -1, keepdims: bool = False) -> Int[Array, "..."]:
    axis = _norm_axis(axis, typeof(x).ndim)
    out = argmin_p.bind(x, axis=axis)
    return reshape(out, _kept_shape(typeof(x).shape, (axis,))) if keepdims else out
