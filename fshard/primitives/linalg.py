"""Linear algebra: ``matmul`` with transpose flags and leading batch dimensions.

``matmul(x, y, transpose_a, transpose_b)`` takes operands of rank >= 2 with equal
leading (batch) dims; the ``matmul`` op function broadcasts batch dims first. Rank 2
lowers to MindSpore's MatMul, higher ranks to BatchMatMul.
"""

from __future__ import annotations

from mindspore import ops

from fshard.core import dtypes
from fshard.core.array_types import Array, Shaped
from fshard.core.tracing import ArrayType, typeof
from fshard.errors import ProgramTypeError, ShapeError
from fshard.primitives.base import (batch_size, batch_to_front, def_primitive, defjvp,
                                    is_undefined, move_axis)
from fshard.core.rules import batching, sharding, transpose
from fshard.core.factors import FactorSpec

FAMILY = "linalg"


def _ms_matmul(x, y, transpose_a, transpose_b):
    return ops.MatMul(transpose_a, transpose_b)(x, y)


def _ms_batch_matmul(x, y, transpose_a, transpose_b):
    return ops.BatchMatMul(transpose_a, transpose_b)(x, y)


def _matmul_type(x, y, *, transpose_a, transpose_b):
    if x.dtype == dtypes.bool_ or y.dtype == dtypes.bool_:
        raise ProgramTypeError(
            f"matmul of bool operands ({x} and {y}) is not supported (MindSpore's CPU MatMul "
            "has no bool kernel).\nFix: cast to a number first, e.g. x.astype(mindspore."
            "float32).")
    if x.dtype != y.dtype:
        raise ProgramTypeError(f"matmul operands have different dtypes: {x} and {y}")
    if x.ndim < 2 or x.ndim != y.ndim:
        raise ProgramTypeError(f"matmul needs operands of equal rank >= 2, got {x} and {y}")
    if tuple(x.shape[:-2]) != tuple(y.shape[:-2]):
        raise ShapeError(f"matmul batch dims differ: {x} and {y}")
    m, k = (x.shape[-1], x.shape[-2]) if transpose_a else (x.shape[-2], x.shape[-1])
    k2, n = (y.shape[-1], y.shape[-2]) if transpose_b else (y.shape[-2], y.shape[-1])
    if k != k2 and not (not isinstance(k, int) and k is k2):
        raise ShapeError(
            f"matmul contraction sizes differ: {x} (transpose_a={transpose_a}) has {k}, "
            f"{y} (transpose_b={transpose_b}) has {k2}")
    return ArrayType(tuple(x.shape[:-2]) + (m, n), x.dtype)


#: Rows of a float32 ``x @ y^T`` (rank 2) that MindSpore's CPU ``MatMul`` runs
#: slower with ``transpose_b`` than as ``(y @ x^T)^T``, the small result transposed:
#: measured (medians of 30 calls, interleaved) 1.0-7.3x slower at 16 to 48 rows (16 rows
#: times a 2048 x 2048 weight: 6.9 against 0.9-1.6 ms; 32 times 4096 x 1024: 13.0
#: against 2.9 ms), never faster; at 8 and 12 rows and at 64 sometimes faster, so
#: those keep MindSpore's form. It is a Dense layer's forward and every ``g @ W^T`` of
#: a backward pass at small batches. (The two forms may round a sum differently.)
_SWAPPED_ROWS = range(16, 49)


def _swapped(x, y, transpose_a: bool, transpose_b: bool) -> bool:
    return (transpose_b and not transpose_a and len(x.shape) == 2
            and x.dtype == y.dtype == dtypes.float32
            and isinstance(x.shape[0], int) and x.shape[0] in _SWAPPED_ROWS)


def _matmul_lower(ctx, x, y, *, transpose_a, transpose_b):
    # the Primitive built here, not in the graph (see LoweringContext.kernel)
    if _swapped(*ctx.in_avals, transpose_a, transpose_b):
        return (f"{ctx.kernel(ops.Transpose)}({ctx.kernel(ops.MatMul, False, True)}"
                f"({y}, {x}), (1, 0))")
    cls = ops.MatMul if len(ctx.in_avals[0].shape) == 2 else ops.BatchMatMul
    return f"{ctx.kernel(cls, transpose_a, transpose_b)}({x}, {y})"


def _matmul_impl(x, y, transpose_a, transpose_b):
    fn = _ms_matmul if len(x.shape) == 2 else _ms_batch_matmul
    return fn(x, y, transpose_a, transpose_b)


matmul_p = def_primitive("matmul", FAMILY, _matmul_type, _matmul_impl, lower=_matmul_lower)


def _matmul_batching(args, dims, *, transpose_a, transpose_b):
    (x, y), (dx, dy) = args, dims
    p = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    nx = typeof(x).ndim
    # An unbatched rank-2 weight stays rank 2: fold the batch into the rows of x.
    if dy is None and nx == 3 and not transpose_a:
        x = move_axis(x, dx, 0)
        b, m, k = typeof(x).shape
        out = matmul_p.bind(reshape(x, (b * m, k)), y, **p)
        return [reshape(out, (b, m, typeof(out).shape[-1]))], [0]
    # The same under a transposed left operand (a weight gradient, ``h^T @ g``, with ``g``
    # shared): ``(b, k, m)`` transposed once to ``(b, m, k)`` and folded into the rows,
    # when that moves fewer elements than copying the weight out to every batch entry
    # (``b·k·n``): 25-35% faster for a row-split layer's gradient on a virtual mesh.
    if dy is None and nx == 3 and transpose_a:
        x = move_axis(x, dx, 0)
        b, k, m = typeof(x).shape
        n = typeof(y).shape[0 if transpose_b else 1]
        if m <= n:
            flat = reshape(move_axis(x, 2, 1), (b * m, k))
            out = matmul_p.bind(flat, y, transpose_a=False, transpose_b=transpose_b)
            return [reshape(out, (b, m, n))], [0]
        dx = 0
    # A shared left operand times batched weights (``g @ W^T`` in a column-split layer's
    # backward): the batch folded into the columns, ``(m, k) @ (k, b·n)``, the result's
    # batch left at axis 1, rather than the left operand copied out to every entry.
    if dx is None and nx == 2:
        y = move_axis(y, dy, 0)
        b, r, c = typeof(y).shape
        m = typeof(x).shape[1 if transpose_a else 0]
        if transpose_b:  # (b, n, k) is (b·n, k) as it lies: nothing moves
            out = matmul_p.bind(x, reshape(y, (b * r, c)), **p)
            return [reshape(out, (m, b, r))], [1]
        dy = 0
    size = batch_size(args, dims)
    x, y = batch_to_front(x, dx, size), batch_to_front(y, dy, size)
    return [matmul_p.bind(x, y, **p)], [0]


batching.set(matmul_p, _matmul_batching)


def _matmul_sharding(x, y, *, transpose_a, transpose_b):
    """Batch dims b*, rows m, contraction k (split k -> partial sum), columns n."""
    nb = x.ndim - 2
    b = tuple(f"b{i}" for i in range(nb))
    xl = b + (("k", "m") if transpose_a else ("m", "k"))
    yl = b + (("n", "k") if transpose_b else ("k", "n"))
    m = x.shape[-1] if transpose_a else x.shape[-2]
    k = x.shape[-2] if transpose_a else x.shape[-1]
    n = y.shape[-2] if transpose_b else y.shape[-1]
    sizes = {f"b{i}": x.shape[i] for i in range(nb)}
    sizes.update(m=m, k=k, n=n)
    return FactorSpec([xl, yl], [b + ("m", "n")], sizes, reduce=frozenset({"k"}),
                      flops_per_point=2.0)


sharding.set(matmul_p, _matmul_sharding)


defjvp(matmul_p,
       lambda t, ans, x, y, **p: matmul_p.bind(t, y, **p),
       lambda t, ans, x, y, **p: matmul_p.bind(x, t, **p))


def _matmul_transpose(ct, x, y, *, transpose_a, transpose_b):
    # out = A @ B with A = x or x^T, B = y or y^T.  dA = ct @ B^T, dB = A^T @ ct.
    assert is_undefined(x) != is_undefined(y), "matmul is bilinear: one operand must be known"
    if is_undefined(x):
        if transpose_a:  # dx = (ct @ B^T)^T = B @ ct^T
            return [matmul_p.bind(y, ct, transpose_a=transpose_b, transpose_b=True), None]
        return [matmul_p.bind(ct, y, transpose_a=False, transpose_b=not transpose_b), None]
    if transpose_b:  # dy = (A^T @ ct)^T = ct^T @ A
        return [None, matmul_p.bind(ct, x, transpose_a=True, transpose_b=transpose_a)]
    return [None, matmul_p.bind(x, ct, transpose_a=not transpose_a, transpose_b=False)]


transpose.set(matmul_p, _matmul_transpose)


def reshape(x, shape):
    from fshard.primitives.structural import reshape as _reshape

    return _reshape(x, shape)


def matmul(x: Shaped[Array, "..."], y: Shaped[Array, "..."], transpose_a: bool = False,
           transpose_b: bool = False) -> Shaped[Array, "..."]:
    """Matrix product with NumPy semantics for 1-D operands and broadcast batch dims.

    ``transpose_a``/``transpose_b`` transpose the last two dims of an operand first.
    """
    from fshard.primitives.structural import broadcast_to

    ax, ay = typeof(x), typeof(y)
    if ax.dtype != ay.dtype:
        from fshard.core import dtypes
        from fshard.primitives.elementwise import cast

        dt = dtypes.result_type(ax.dtype, ay.dtype)
        x, y = cast(x, dt), cast(y, dt)
    if ax.ndim == 0 or ay.ndim == 0:
        raise ShapeError(f"matmul needs operands of rank >= 1, got {ax} and {ay}")
    squeeze_l = ax.ndim == 1
    squeeze_r = ay.ndim == 1
    if squeeze_l:
        x = reshape(x, (1,) + tuple(ax.shape))
    if squeeze_r:
        y = reshape(y, tuple(ay.shape) + (1,))
    ax, ay = typeof(x), typeof(y)
    if ax.ndim != ay.ndim or ax.shape[:-2] != ay.shape[:-2]:
        from fshard.primitives.elementwise import broadcast_shapes

        batch = broadcast_shapes(tuple(ax.shape[:-2]), tuple(ay.shape[:-2]))
        # A rank-2 right operand under a batched left one: fold batch into rows.
        if ay.ndim == 2 and not transpose_a:
            k = ax.shape[-1]
            xb = broadcast_to(x, batch + tuple(ax.shape[-2:]))
            flat = reshape(xb, (-1, k))
            out = matmul_p.bind(flat, y, transpose_a=False, transpose_b=transpose_b)
            out = reshape(out, batch + (ax.shape[-2], typeof(out).shape[-1]))
            return _squeeze_out(out, squeeze_l, squeeze_r)
        x = broadcast_to(x, batch + tuple(ax.shape[-2:]))
        y = broadcast_to(y, batch + tuple(ay.shape[-2:]))
    out = matmul_p.bind(x, y, transpose_a=transpose_a, transpose_b=transpose_b)
    return _squeeze_out(out, squeeze_l, squeeze_r)


def _squeeze_out(out, squeeze_l, squeeze_r):
    shape = typeof(out).shape
    if squeeze_l and squeeze_r:
        return reshape(out, tuple(shape[:-2]))
    if squeeze_l:
        return reshape(out, tuple(shape[:-2]) + (shape[-1],))
    if squeeze_r:
        return reshape(out, tuple(shape[:-1]))
    return out

