"""Shape primitives: broadcast_to, reshape, transpose, concat, split, slice, pad,
gather, scatter_add, one_hot, full and stop_gradient.

All of these move data without arithmetic; most are linear and get transpose
rules (broadcast <-> sum, slice <-> pad, gather <-> scatter_add, concat <-> split).
"""

from __future__ import annotations

import numpy as np
from mindspore import ops

from fshard import dtypes
from fshard.core import ArrayType, typeof
from fshard.errors import ArgumentError, ProgramTypeError, ShapeError
from fshard.primitives._batching import batch_to_front, move_axis, vectorized
from fshard.primitives._define import Zero, def_primitive, defjvp, deflinear, is_undefined
from fshard.rules import batching, jvp, transpose, unsupported

FAMILY = "structural"


def _norm_axis(axis: int, ndim: int, what: str = "axis") -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise ArgumentError(f"{what} must be an int, got {type(axis).__name__} {axis!r}.")
    if not -ndim <= axis < max(ndim, 1):
        raise ArgumentError(
            f"{what}={axis} is out of range for an array of rank {ndim} "
            f"(valid: {-ndim}..{ndim - 1}).")
    return int(axis) % max(ndim, 1)


def _static_shape(shape, what="shape") -> tuple:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        return tuple(int(d) if isinstance(d, (int, np.integer)) else d for d in shape)
    except TypeError:
        raise ArgumentError(f"{what} must be a tuple of ints, got {shape!r}.") from None


# ---------------------------------------------------------------------------
# broadcast_to: NumPy right-aligned broadcasting
# ---------------------------------------------------------------------------


def _ms_broadcast_to(x, shape):
    return ops.broadcast_to(x, shape)


def _broadcast_to_type(x, *, shape):
    from fshard.primitives.elementwise import broadcast_shapes

    if len(shape) < x.ndim or broadcast_shapes(tuple(x.shape), shape) != tuple(shape):
        raise ShapeError(f"cannot broadcast {x} to shape {shape}")
    return ArrayType(tuple(shape), x.dtype)


broadcast_to_p = def_primitive("broadcast_to", FAMILY, _broadcast_to_type, _ms_broadcast_to)


def _broadcast_to_batching(args, dims, *, shape):
    (x,), (d,) = args, dims
    xs = typeof(x).shape
    size = xs[d]
    x = move_axis(x, d, 0)
    rest = xs[:d] + xs[d + 1:]
    # Right-align the unbatched dims under `shape`, keeping the batch dim in front.
    x = reshape(x, (size,) + (1,) * (len(shape) - len(rest)) + tuple(rest))
    return [broadcast_to(x, (size,) + tuple(shape))], [0]


batching.set(broadcast_to_p, _broadcast_to_batching)


def _broadcast_to_transpose(ct, x, *, shape):
    xs = x.aval.shape
    lead = len(shape) - len(xs)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(xs) if d == 1 and shape[lead + i] != 1)
    from fshard.primitives.reductions import reduce_sum

    out = reduce_sum(ct, axes) if axes else ct
    return [reshape(out, xs)]


deflinear(broadcast_to_p, _broadcast_to_transpose)


def broadcast_to(x, shape):
    """Broadcast ``x`` to ``shape`` with NumPy's rules."""
    shape = _static_shape(shape)
    if tuple(typeof(x).shape) == shape:
        return x
    if isinstance(x, (bool, int, float)):
        from fshard.primitives.elementwise import promote

        (x,) = promote(x)
    return broadcast_to_p.bind(x, shape=shape)


# ---------------------------------------------------------------------------
# reshape
# ---------------------------------------------------------------------------


def _ms_reshape(x, shape):
    return ops.reshape(x, shape)


def _reshape_type(x, *, shape):
    if x.is_static and int(np.prod(shape, dtype=np.int64)) != x.size:
        raise ShapeError(f"cannot reshape {x} to {shape}: sizes differ")
    return ArrayType(tuple(shape), x.dtype)


reshape_p = def_primitive("reshape", FAMILY, _reshape_type, _ms_reshape)


def _reshape_batching(args, dims, *, shape):
    (x,), (d,) = args, dims
    x = move_axis(x, d, 0)
    return [reshape_p.bind(x, shape=(typeof(x).shape[0],) + tuple(shape))], [0]


batching.set(reshape_p, _reshape_batching)
deflinear(reshape_p, lambda ct, x, *, shape: [reshape(ct, x.aval.shape)])


def reshape(x, shape):
    """Reshape ``x``; one dimension may be -1."""
    shape = _static_shape(shape)
    a = typeof(x)
    if shape.count(-1) > 1:
        raise ArgumentError(f"reshape: at most one -1 in shape, got {shape}.")
    if -1 in shape:
        known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
        if known == 0 or a.size % known:
            raise ShapeError(f"cannot reshape {a} to {shape}")
        shape = tuple(a.size // known if d == -1 else d for d in shape)
    if shape == tuple(a.shape):
        return x
    return reshape_p.bind(x, shape=shape)


def expand_dims(x, axis: int):
    a = typeof(x)
    axis = _norm_axis(axis, a.ndim + 1)
    return reshape(x, tuple(a.shape[:axis]) + (1,) + tuple(a.shape[axis:]))


def squeeze(x, axis=None):
    a = typeof(x)
    if axis is None:
        axes = [i for i, d in enumerate(a.shape) if d == 1]
    else:
        axes = [_norm_axis(ax, a.ndim) for ax in (axis if isinstance(axis, (tuple, list)) else (axis,))]
        for ax in axes:
            if a.shape[ax] != 1:
                raise ShapeError(f"squeeze: dimension {ax} of {a} has size {a.shape[ax]}, not 1")
    return reshape(x, tuple(d for i, d in enumerate(a.shape) if i not in axes))


def flatten(x, start_dim: int = 1):
    a = typeof(x)
    return reshape(x, tuple(a.shape[:start_dim]) + (-1,))


# ---------------------------------------------------------------------------
# transpose
# ---------------------------------------------------------------------------


def _ms_transpose(x, perm):
    return ops.transpose(x, perm)


def _transpose_type(x, *, perm):
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeError(f"transpose: perm {perm} is not a permutation of range({x.ndim})")
    return ArrayType(tuple(x.shape[p] for p in perm), x.dtype)


transpose_p = def_primitive("transpose", FAMILY, _transpose_type, _ms_transpose)


def _transpose_batching(args, dims, *, perm):
    (x,), (d,) = args, dims
    x = move_axis(x, d, 0)
    return [transpose_p.bind(x, perm=(0,) + tuple(p + 1 for p in perm))], [0]


batching.set(transpose_p, _transpose_batching)
deflinear(transpose_p,
          lambda ct, x, *, perm: [transpose_p.bind(ct, perm=tuple(np.argsort(perm).tolist()))])


def transpose(x, perm=None):
    a = typeof(x)
    perm = tuple(reversed(range(a.ndim))) if perm is None else tuple(
        _norm_axis(p, a.ndim, "perm entry") for p in perm)
    if perm == tuple(range(a.ndim)):
        return x
    return transpose_p.bind(x, perm=perm)


def swapaxes(x, a: int, b: int):
    nd = typeof(x).ndim
    perm = list(range(nd))
    a, b = _norm_axis(a, nd), _norm_axis(b, nd)
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, tuple(perm))


# ---------------------------------------------------------------------------
# full (zeros, ones): a constant array; no operands
# ---------------------------------------------------------------------------


def _ms_full(shape, value, dtype):
    return ops.fill(dtype, shape, value)


def _full_type(*, shape, value, dtype):
    return ArrayType(tuple(shape), dtype)


full_p = def_primitive("full", FAMILY, _full_type, lambda *, shape, value, dtype:
                       _ms_full(shape, value, dtype),
                       lower=lambda ctx, *, shape, value, dtype: ctx.call(
                           _ms_full, ctx.param(shape), ctx.param(value), ctx.param(dtype)))
batching.set(full_p, lambda args, dims, **p: ([full_p.bind(**p)], [None]))
jvp.set(full_p, lambda primals, tangents, **p: (
    [full_p.bind(**p)], [Zero(ArrayType(tuple(p["shape"]), p["dtype"]))]))
unsupported(full_p, "transpose", "has no operands")


def full(shape, value, dtype=dtypes.float32):
    dtype = dtypes.canonical(dtype)
    value = bool(value) if dtype == dtypes.bool_ else (
        float(value) if dtypes.is_float(dtype) else int(value))
    return full_p.bind(shape=_static_shape(shape), value=value, dtype=dtype)


def zeros(shape, dtype=dtypes.float32):
    return full(shape, 0, dtype)


def ones(shape, dtype=dtypes.float32):
    return full(shape, 1, dtype)


# ---------------------------------------------------------------------------
# stop_gradient: identity whose derivative is zero
# ---------------------------------------------------------------------------


def _ms_stop_gradient(x):
    return ops.stop_gradient(x)


stop_gradient_p = def_primitive("stop_gradient", FAMILY, lambda x: x, _ms_stop_gradient)
batching.set(stop_gradient_p, vectorized(stop_gradient_p))
defjvp(stop_gradient_p, None)
unsupported(stop_gradient_p, "transpose", "its JVP is zero, so it never appears in a linear program")


def stop_gradient(x):
    """Identity in the forward pass; blocks differentiation (``fs.stop_gradient``)."""
    from fshard import tree

    return tree.map(lambda v: stop_gradient_p.bind(v), x)
