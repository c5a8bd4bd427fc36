"""Scans and sorts along one axis: cumsum, cumprod, sort (and the op functions built on
them: argsort, topk).

Each primitive works along one ``axis`` and is independent along the others, so its
batching moves nothing (the batch axis is one more independent dimension) and its
sharding splits every dimension but ``axis``.
"""

from __future__ import annotations

import numpy as np
from mindspore import dtype as mstype
from mindspore import ops

from fshard.core import dtypes
from fshard.core.array_types import Array, ArrayLike, Int, Shaped
from fshard.core.tracing import ArrayType, Tracer, typeof
from fshard.errors import ArgumentError, ProgramTypeError
from fshard.core.factors import FactorSpec
from fshard.primitives.base import (
    Zero,
    _norm_axis,
    broadcast_to,
    def_primitive,
    deflinear,
    defjvp,
    instantiate,
    move_axis,
    reshape,
)
from fshard.primitives.elementwise import cast, mul
from fshard.primitives.structural import _slice_axis, gather_p
from fshard.core.rules import batching, jvp, sharding, unsupported

FAMILY = "scans"


def _check_axis(name: str, x: ArrayType, axis: int) -> None:
    if x.ndim == 0 or not (isinstance(axis, int) and 0 <= axis < x.ndim):
        raise ProgramTypeError(f"{name}: axis={axis!r} is not in [0, {x.ndim}) for {x}")


def _axis_batching(prim):
    """The batch axis is one more independent dimension: shift ``axis`` past it."""
    def rule(args, dims, *, axis, **params):
        (x,), (d,) = args, dims
        out = prim.bind(x, axis=axis + (axis >= d), **params)
        outs = out if prim.multiple_results else [out]
        return outs, [d] * len(outs)

    return rule


def _axis_sharding(x, *, axis, n_out=1, **_):
    """Every dimension but ``axis`` is parallel; ``axis`` stays whole."""
    lab = tuple(None if i == axis else f"d{i}" for i in range(x.ndim))
    sizes = {f"d{i}": x.shape[i] for i in range(x.ndim) if i != axis}
    return FactorSpec([lab], [lab] * n_out, sizes, flops_per_point=1.0)


# ---------------------------------------------------------------------------
# cumsum: inclusive running sum along an axis (``reverse``: from the end)
# ---------------------------------------------------------------------------


def _ms_cumsum(x, axis, reverse):
    return ops.CumSum(reverse=reverse)(x, axis)


def _cumsum_type(x, *, axis, reverse):
    _check_axis("cumsum", x, axis)
    if x.dtype == dtypes.bool_:
        raise ProgramTypeError(f"cumsum needs a numeric operand, got {x}")
    return x


cumsum_p = def_primitive("cumsum", FAMILY, _cumsum_type, _ms_cumsum)
batching.set(cumsum_p, _axis_batching(cumsum_p))


def _cumsum_sharding(x, *, axis, reverse):
    spec = _axis_sharding(x, axis=axis)
    spec.linear = ((0,),)  # a pending sum's running sums add up
    return spec


sharding.set(cumsum_p, _cumsum_sharding)
# Linear; its transpose is the running sum in the other direction.
deflinear(cumsum_p, lambda ct, x, *, axis, reverse: [
    cumsum_p.bind(instantiate(ct), axis=axis, reverse=not reverse)])


# ---------------------------------------------------------------------------
# cumprod: inclusive running product along an axis
# ---------------------------------------------------------------------------


def _ms_cumprod(x, axis, reverse):
    return ops.CumProd(reverse=reverse)(x, axis)


def _cumprod_type(x, *, axis, reverse):
    _check_axis("cumprod", x, axis)
    if x.dtype == dtypes.bool_:
        raise ProgramTypeError(f"cumprod needs a numeric operand, got {x}")
    return x


def _cumprod_jvp(t, ans, x, *, axis, reverse):
    # d out_i = sum_{j <= i} t_j * prod_{k <= i, k != j} x_k, in O(n) and exact at zeros:
    # with no zero among x_1..x_i it is out_i * sum_{j <= i} t_j / x_j; with exactly one,
    # at p, it is t_p times the product of the others; with two or more it is 0. (The
    # products skip the zeros: x with its zeros replaced by 1.)
    from fshard.primitives.elementwise import div, equal, where

    dt = dtypes.to_numpy(typeof(x).dtype)
    zero, one = np.zeros((), dt), np.ones((), dt)
    is_zero = equal(x, zero)
    nonzero = where(is_zero, one, x)
    skip = cumprod_p.bind(nonzero, axis=axis, reverse=reverse)
    zeros_so_far = cumsum_p.bind(cast(is_zero, typeof(x).dtype), axis=axis, reverse=reverse)
    none = cumsum_p.bind(div(t, nonzero), axis=axis, reverse=reverse)
    first = cumsum_p.bind(where(is_zero, t, zero), axis=axis, reverse=reverse)
    t_out = where(equal(zeros_so_far, zero), none, where(equal(zeros_so_far, one), first, zero))
    return mul(skip, t_out)


cumprod_p = def_primitive("cumprod", FAMILY, _cumprod_type, _ms_cumprod)
batching.set(cumprod_p, _axis_batching(cumprod_p))
sharding.set(cumprod_p, _axis_sharding)
defjvp(cumprod_p, _cumprod_jvp)
unsupported(cumprod_p, "transpose", "not linear")


# ---------------------------------------------------------------------------
# sort: values and int32 indices along an axis (stable: ties keep their order)
# ---------------------------------------------------------------------------


def _ms_sort(x, axis, descending):
    values, idx = ops.sort(x, axis, descending)
    if x.dtype == mstype.float64:
        # MindSpore's CPU Sort compares and returns float64 at float32 precision: read
        # the exact values back at the indices (their order among values closer than
        # float32's resolution stays MindSpore's).
        values = ops.gather_elements(x, axis, idx)
    return values, idx


def _sort_type(x, *, axis, descending):
    _check_axis("sort", x, axis)
    if x.dtype == dtypes.bool_:
        raise ProgramTypeError(f"sort needs a numeric operand, got {x} (MindSpore's "
                               "Sort has no bool kernel)")
    return [x, ArrayType(x.shape, dtypes.int32)]


def take_along_axis(x, indices, axis: int) -> Shaped[Array, "..."]:
    """``out[..., i, ...] = x[..., indices[..., i, ...], ...]`` along ``axis`` (indices
    of x's shape but for ``axis``), as one ``gather`` from the flattened value: linear
    in ``x``, its transpose a ``scatter_add``."""
    a, ia = typeof(x), typeof(indices)
    n, k = a.shape[axis], ia.shape[axis]
    xm = move_axis(x, axis, -1)
    im = move_axis(indices, axis, -1)
    lead = tuple(typeof(xm).shape[:-1])
    m = int(np.prod(lead, dtype=np.int64))
    offsets = np.arange(m, dtype=np.int64).reshape(lead + (1,)) * n
    from fshard.primitives.elementwise import add

    flat = add(cast(im, dtypes.int64), broadcast_to(offsets, lead + (k,)))
    out = gather_p.bind(reshape(xm, (m * n,)), flat, axis=0)
    return move_axis(out, -1, axis)


def _sort_jvp(primals, tangents, *, axis, descending):
    (x,), (t,) = primals, tangents
    values, idx = sort_p.bind(x, axis=axis, descending=descending)
    int_zero = Zero(typeof(idx))
    if isinstance(t, Zero):
        return [values, idx], [Zero(typeof(values)), int_zero]
    return [values, idx], [take_along_axis(t, idx, axis), int_zero]


sort_p = def_primitive("sort", FAMILY, _sort_type, _ms_sort, multiple_results=True)
batching.set(sort_p, _axis_batching(sort_p))
sharding.set(sort_p, lambda x, *, axis, descending: _axis_sharding(x, axis=axis, n_out=2))
jvp.set(sort_p, _sort_jvp)
unsupported(sort_p, "transpose", "not linear")


# ---------------------------------------------------------------------------
# extremum_with_index: the largest (``largest``; else least) element along an axis and
# its index, one ArgMaxWithValue (ArgMinWithValue) kernel, MindSpore's ops.max(x, axis).
# Its derivative goes to the element at the index alone (MindSpore's at ties; a
# reduce_max's is shared among them).
# ---------------------------------------------------------------------------


def _ms_extremum_with_index(x, axis, largest):
    values, index = (ops.max if largest else ops.min)(x, axis)
    return values, index.astype(mstype.int32)


def _with_index_type(x, *, axis, largest):
    _check_axis("extremum_with_index", x, axis)
    kept = tuple(d for i, d in enumerate(x.shape) if i != axis)
    return [ArrayType(kept, x.dtype), ArrayType(kept, dtypes.int32)]


def _with_index_batching(args, dims, *, axis, largest):
    (x,), (d,) = args, dims
    out = d - (axis < d)
    return extremum_with_index_p.bind(x, axis=axis + (axis >= d), largest=largest), [out, out]


def _with_index_sharding(x, *, axis, largest):
    spec = _axis_sharding(x, axis=axis)
    kept = tuple(lab for lab in spec.inputs[0] if lab is not None)
    return FactorSpec(spec.inputs, [kept, kept], spec.sizes, flops_per_point=1.0)


def _with_index_jvp(primals, tangents, *, axis, largest):
    (x,), (t,) = primals, tangents
    values, index = extremum_with_index_p.bind(x, axis=axis, largest=largest)
    if isinstance(t, Zero):
        return [values, index], [Zero(typeof(values)), Zero(typeof(index))]
    kept = tuple(1 if i == axis else n for i, n in enumerate(typeof(x).shape))
    # one gather of the tangent at the indices: its transpose a scatter, not a mask
    picked = take_along_axis(t, reshape(index, kept), axis)
    return [values, index], [reshape(picked, typeof(values).shape), Zero(typeof(index))]


extremum_with_index_p = def_primitive("extremum_with_index", FAMILY, _with_index_type,
                                      _ms_extremum_with_index, multiple_results=True)
batching.set(extremum_with_index_p, _with_index_batching)
sharding.set(extremum_with_index_p, _with_index_sharding)
jvp.set(extremum_with_index_p, _with_index_jvp)
unsupported(extremum_with_index_p, "transpose", "not linear")


# ---------------------------------------------------------------------------
# Op functions
# ---------------------------------------------------------------------------


def _axis_arg(name: str, x, axis) -> int:
    if isinstance(axis, Tracer) or not isinstance(axis, (int, np.integer)) or isinstance(
            axis, bool):
        raise ArgumentError(f"{name}(axis=...) must be a Python int, got {axis!r}.")
    nd = typeof(x).ndim
    if nd == 0:
        raise ArgumentError(f"{name} needs an array of rank >= 1, got a 0-d value "
                            f"{typeof(x)}.\nFix: reshape it to (1,) first.")
    return _norm_axis(int(axis), nd, f"{name}(axis=...)")


def _scan_input(name: str, x):
    if typeof(x).dtype == dtypes.bool_:  # MindSpore sums and multiplies bools as int64
        return cast(x, dtypes.int64)
    return x


def cumsum(x: ArrayLike, axis: int, reverse: bool = False) -> Shaped[Array, "*shape"]:
    """Running sum along ``axis`` (from the end if ``reverse``).

    >>> import numpy as np, fshard as fs
    >>> fs.ops.cumsum(np.array([1, 2, 3], np.float32), 0).asnumpy().tolist()
    [1.0, 3.0, 6.0]
    """
    axis = _axis_arg("cumsum", x, axis)
    return cumsum_p.bind(_scan_input("cumsum", x), axis=axis, reverse=bool(reverse))


def cumprod(x: ArrayLike, axis: int, reverse: bool = False) -> Shaped[Array, "*shape"]:
    """Running product along ``axis`` (from the end if ``reverse``); its derivative is
    exact where some entries are zero.

    >>> import numpy as np, fshard as fs
    >>> fs.ops.cumprod(np.array([1, 2, 3], np.float32), 0).asnumpy().tolist()
    [1.0, 2.0, 6.0]
    """
    axis = _axis_arg("cumprod", x, axis)
    return cumprod_p.bind(_scan_input("cumprod", x), axis=axis, reverse=bool(reverse))


def sort(x: ArrayLike, axis: int = -1, descending: bool = False) -> tuple:
    """``(values, indices)`` sorted along ``axis``; stable (equal values keep their
    order), indices int32, as ``mindspore.ops.sort``.

    >>> import numpy as np, fshard as fs
    >>> v, i = fs.ops.sort(np.array([3, 1, 2], np.float32))
    >>> v.asnumpy().tolist(), i.asnumpy().tolist()
    ([1.0, 2.0, 3.0], [1, 2, 0])
    """
    axis = _axis_arg("sort", x, axis)
    if typeof(x).dtype == dtypes.bool_:
        raise ArgumentError("sort of a bool array is not supported (MindSpore's Sort has "
                            "no bool kernel).\nFix: cast it to int32 first.")
    return tuple(sort_p.bind(x, axis=axis, descending=bool(descending)))


def argsort(x: ArrayLike, axis: int = -1, descending: bool = False) -> Int[Array, "*shape"]:
    """The int32 indices that sort ``x`` along ``axis`` (stable)."""
    return sort(x, axis, descending)[1]


def topk(x: ArrayLike, k: int, axis: int = -1, largest: bool = True,
         sorted: bool = True) -> tuple:  # noqa: A002  (MindSpore's name)
    """``(values, indices)`` of the ``k`` largest (``largest=False``: smallest) entries
    along ``axis``, in order; among equal values the lower index comes first.

    >>> import numpy as np, fshard as fs
    >>> v, i = fs.ops.topk(np.array([1, 3, 2], np.float32), 2)
    >>> v.asnumpy().tolist(), i.asnumpy().tolist()
    ([3.0, 2.0], [1, 2])
    """
    axis = _axis_arg("topk", x, axis)
    n = typeof(x).shape[axis]
    if isinstance(k, Tracer) or not isinstance(k, (int, np.integer)) or isinstance(
            k, bool) or not 0 <= k <= n:
        raise ArgumentError(
            f"topk(k={k!r}): k must be a Python int in [0, {n}] (the size of axis {axis} of "
            f"{typeof(x)}); it fixes the output shape, so it cannot be traced.")
    values, idx = sort(x, axis, descending=bool(largest))
    return _slice_axis(values, axis, 0, int(k)), _slice_axis(idx, axis, 0, int(k))


__all__ = ["cumsum", "cumprod", "sort", "argsort", "topk", "take_along_axis"]
