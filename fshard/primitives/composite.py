"""Op functions composed of other primitives: activations, masks, flips and rolls,
padding modes, statistics, index arithmetic (gather_nd, scatter_nd, index_add) and
losses. None declares a primitive: each is a few equations of primitives whose rules
(batching, JVP and transpose, sharding) already hold, so they need none of their own.

Semantics follow ``mindspore.ops`` (argument names, defaults, dtype promotion), checked
against eager MindSpore in tests/test_native_ops.py.
"""

from __future__ import annotations

import functools

import numpy as np

from fshard.core import dtypes
from fshard.core.array_types import Array, ArrayLike, Bool, Float, Shaped
from fshard.core.tracing import Tracer, typeof
from fshard.errors import ArgumentError, ShapeError, UnsupportedOpError
from fshard.primitives.base import _norm_axis, broadcast_shapes, broadcast_to, reshape, transpose
from fshard.primitives.elementwise import (
    clamp_p,
    _is_weak,
    abs,
    add,
    bitwise_and,
    bitwise_or,
    bitwise_xor,
    cast,
    div,
    equal,
    exp,
    expm1,
    greater,
    hardsigmoid as _hardsigmoid,
    hardswish as _hardswish,
    less,
    less_equal,
    log,
    log1p,
    maximum,
    minimum,
    mul,
    neg,
    not_equal,
    promote,
    relu,
    relu6 as _relu6,
    sigmoid,
    sqrt,
    sub,
    tanh,
    where,
)
from fshard.primitives.linalg import matmul
from fshard.primitives.reductions import (_axes, argmax, argmin, mean, reduce_max, reduce_min,
                                          reduce_sum)
from fshard.primitives.scans import cumprod, extremum_with_index_p, sort
from fshard.primitives.structural import (
    _concrete_index,
    _index_array,
    _int_dims,
    _slice_axis,
    _static_ints,
    concat,
    expand_dims,
    gather_p,
    scatter_add,
    scatter_add_p,
    slice_array,
    split,
    squeeze,
)

# ---------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------


def extremum_with_index(x: ArrayLike, axis: int, keepdims: bool = False,
                        largest: bool = True) -> tuple:
    """``(values, indices)``: the largest (``largest``) or least element along ``axis`` and
    its index, as MindSpore's ``ArgMaxWithValue`` / ``ArgMinWithValue`` (``ops.max(x,
    axis)``, ``Tensor.max(axis)``) compute them, with that kernel. Its derivative goes to
    the element at the index alone, as MindSpore's does where several elements tie (a
    ``reduce_max``'s, ``ops.amax``'s, is shared among them).

    >>> import numpy as np, fshard as fs
    >>> x = np.array([[1.0, 3.0, 3.0]], np.float32)
    >>> fs.grad(lambda x: extremum_with_index(x, 1)[0].sum())(x)
    Tensor(shape=[1, 3], dtype=Float32, value=
    [[ 0.00000000e+00,  1.00000000e+00,  0.00000000e+00]])
    """
    a = typeof(x)
    axis = _norm_axis(axis, a.ndim)
    # A size known at run time only: the derivative's gather needs every size (its
    # flat offsets), so reduce_max and argmax, whose derivative is shared among ties.
    if not all(type(d) is int for d in a.shape):
        return ((reduce_max if largest else reduce_min)(x, axis, keepdims),
                (argmax if largest else argmin)(x, axis, keepdims))
    values, index = extremum_with_index_p.bind(x, axis=axis, largest=largest)
    if keepdims:
        kept = tuple(1 if i == axis else d for i, d in enumerate(a.shape))
        values, index = reshape(values, kept), reshape(index, kept)
    return values, index


def _float(x):
    if _is_weak(x):
        return np.float32(x)
    return x if dtypes.is_float(typeof(x).dtype) else cast(x, dtypes.float32)


def _half_in_float32(fn):
    """``fn`` of a float16 or bfloat16 ``x`` computed in float32 and rounded once at the
    end, as MindSpore's activation kernels compute a half-precision input. Its Log1p and
    Expm1 kernels compute in the input's own precision: log1p(4.5e-5) is 0 in float16,
    which made softplus(-10) 0 instead of 4.5e-5 and elu(-1e-3) 2% off."""
    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        x = _float(x)
        dtype = typeof(x).dtype
        if dtypes.is_half(dtype):
            return cast(fn(cast(x, dtypes.float32), *args, **kwargs), dtype)
        return fn(x, *args, **kwargs)
    return wrapper


def silu(x: ArrayLike) -> Float[Array, "*shape"]:
    """``x * sigmoid(x)`` (swish).

    >>> import numpy as np, fshard as fs
    >>> print(f"{float(fs.ops.silu(np.float32(1.0)).asnumpy()):.4f}")
    0.7311
    """
    x = _float(x)
    return mul(x, sigmoid(x))


@_half_in_float32
def elu(x: ArrayLike, alpha: float = 1.0) -> Float[Array, "*shape"]:
    """``x`` where ``x > 0``, else ``alpha * (exp(x) - 1)``."""
    x = _float(x)
    pos = greater(x, 0.0)
    # expm1 of the negative part only: exp(x) of a large x is inf, and the branch not
    # taken would make the derivative 0 * inf = NaN
    return where(pos, x, mul(expm1(where(pos, 0.0, x)), float(alpha)))


@_half_in_float32
def softplus(x: ArrayLike, beta: float = 1.0, threshold: float = 20.0) -> Float[Array, "*shape"]:
    """``log(1 + exp(beta * x)) / beta``, and ``x`` itself where ``beta * x >
    threshold`` (as ``mindspore.ops.softplus``)."""
    x = _float(x)
    bx = mul(x, float(beta))
    # log(1 + e^z) = max(z, 0) + log1p(e^-|z|): no overflow for large |z|. Both made of
    # selects, so that at z = 0 -|z| is z itself: the derivative there is sigmoid(0) =
    # 1/2 (relu's and abs's derivatives at 0 are 0, which gave 0).
    pos = greater(bx, 0.0)
    soft = add(where(pos, bx, 0.0), log1p(exp(where(pos, neg(bx), bx))))
    if beta != 1:
        soft = div(soft, float(beta))
    return where(greater(bx, float(threshold)), x, soft)


@_half_in_float32
def mish(x: ArrayLike) -> Float[Array, "*shape"]:
    """``x * tanh(softplus(x))``, computed as ``x * n (n + 2) / (n (n + 2) + 2)`` with
    ``n = e^x`` (the same function: ``tanh(log(1 + n)) = ((1 + n)^2 - 1) / ((1 + n)^2 +
    1)``). MindSpore's Tanh kernel rounds to 1 early (``tanh(5.0067)`` is 1.0, not
    0.99991), which put ``mish(5)`` at 5.0 against 4.99955; this form is within the Exp
    kernel's few ulps everywhere. ``e^x`` is taken at ``min(x, 20)``: from there the
    fraction is 1 in float32 and float64 alike (2 / e^40 is 8e-18)."""
    x = _float(x)
    n = exp(where(greater(x, 20.0), 20.0, x))
    r = mul(n, add(n, 2.0))
    return mul(x, div(r, add(r, 2.0)))


def hardswish(x: ArrayLike) -> Float[Array, "*shape"]:
    """``x * relu6(x + 3) / 6``; its derivative is MindSpore's: ``(2x + 3) / 6`` on
    ``[-3, 3]``, ends included (-0.5 at -3, 1.5 at 3), 0 below and 1 above."""
    return _hardswish(_float(x))


def hardsigmoid(x: ArrayLike) -> Float[Array, "*shape"]:
    """``relu6(x + 3) / 6``; its derivative is MindSpore's: 1/6 strictly between -3 and
    3, 0 at and beyond them."""
    return _hardsigmoid(_float(x))


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


@_half_in_float32
def selu(x: ArrayLike) -> Float[Array, "*shape"]:
    """``scale * (x if x > 0 else alpha * (exp(x) - 1))`` with SELU's constants."""
    return mul(elu(x, _SELU_ALPHA), _SELU_SCALE)


def relu6(x: ArrayLike) -> Float[Array, "*shape"]:
    """``min(max(x, 0), 6)``; its derivative is MindSpore's: 1 on ``(0, 6]`` (0 at 0, as
    relu's, and 1 at 6), else 0."""
    return _relu6(_float(x))


def hardtanh(x: ArrayLike, min_val: float = -1.0, max_val: float = 1.0) -> Float[Array, "*shape"]:
    """``x`` clamped to ``[min_val, max_val]``: ``minimum(maximum(x, min_val), max_val)``,
    whose derivative at either bound is 1/2, as MindSpore's hardtanh (unlike ``clamp``)."""
    return _clamped(_float(x), float(min_val), float(max_val))


def leaky_relu(x: ArrayLike, negative_slope: float = 0.01) -> Float[Array, "*shape"]:
    """``x`` where ``x > 0``, else ``negative_slope * x``."""
    x = _float(x)
    return where(greater(x, 0.0), x, mul(x, float(negative_slope)))


def softsign(x: ArrayLike) -> Float[Array, "*shape"]:
    """``x / (1 + |x|)``, and +-1 at +-inf with derivative 0 there (as MindSpore's
    derivative; ``inf / inf`` made both NaN, MindSpore's value too)."""
    x = _float(x)
    inf = equal(abs(x), float("inf"))
    finite = where(inf, 0.0, x)  # (the branch not taken kept finite: no NaN derivative)
    return where(inf, where(greater(x, 0.0), 1.0, -1.0),
                 div(finite, add(abs(finite), 1.0)))


@_half_in_float32
def celu(x: ArrayLike, alpha: float = 1.0) -> Float[Array, "*shape"]:
    """``max(0, x) + min(0, alpha * (exp(x / alpha) - 1))``."""
    x = _float(x)
    alpha = float(alpha)
    pos = greater(x, 0.0)
    return where(pos, x, mul(expm1(div(where(pos, 0.0, x), alpha)), alpha))  # (as elu's)


def softshrink(x: ArrayLike, lambd: float = 0.5) -> Float[Array, "*shape"]:
    """``x - lambd`` above ``lambd``, ``x + lambd`` below ``-lambd``, else 0."""
    x = _float(x)
    lambd = float(lambd)
    return where(greater(x, lambd), sub(x, lambd),
                 where(less(x, -lambd), add(x, lambd), mul(x, 0.0)))


def hardshrink(x: ArrayLike, lambd: float = 0.5) -> Float[Array, "*shape"]:
    """``x`` where ``|x| > lambd``, else 0."""
    x = _float(x)
    return where(greater(abs(x), float(lambd)), x, mul(x, 0.0))


def fast_gelu(x: ArrayLike) -> Float[Array, "*shape"]:
    """MindSpore's FastGeLU: ``x / (1 + exp(-1.702 |x|)) * exp(0.851 (x - |x|))``."""
    x = _float(x)
    ax = abs(x)
    return mul(div(x, add(exp(mul(ax, -1.702)), 1.0)), exp(mul(sub(x, ax), 0.851)))


def prelu(x: ArrayLike, weight: ArrayLike) -> Float[Array, "*shape"]:
    """``x`` where ``x > 0``, else ``weight * x``; ``weight`` has one entry per channel
    (dimension 1; the last dimension of a 1-D ``x``) or a single entry."""
    a, w = typeof(x), typeof(weight)
    if w.ndim > 1:
        raise ShapeError(f"prelu(weight=...) must be 1-D (one entry per channel), got {w}.")
    n = w.shape[0] if w.ndim else 1
    if a.ndim >= 2 and n != 1:
        if a.shape[1] != n:
            raise ShapeError(
                f"prelu(x, weight): weight has {n} entries but x {a} has {a.shape[1]} "
                "channels (dimension 1).\nFix: give one weight per channel, or a single one.")
        weight = reshape(weight, (1, n) + (1,) * (a.ndim - 2))
    elif w.ndim:
        weight = reshape(weight, (n,) if a.ndim == 1 else ())
    pos = greater(x, 0.0)
    # the weight multiplies the negative part only: weight * inf in the branch not taken
    # would give the weight's derivative inf * 0 = NaN
    return where(pos, x, mul(weight, where(pos, 0.0, x)))


def _clamped(x, lo, hi):
    out = x
    if lo is not None:
        out = maximum(out, lo)
    if hi is not None:
        out = minimum(out, hi)
    return out


def clamp(x: ArrayLike, min=None, max=None) -> Shaped[Array, "..."]:  # noqa: A002
    """``minimum(maximum(x, min), max)``; ``min``/``max`` are scalars, arrays or None
    (as ``mindspore.ops.clamp``: where ``min > max`` the result is ``max``). Its
    derivative is MindSpore's: 1 where ``min <= x <= max``, bounds included (not the
    1/2 of maximum's and minimum's ties), 0 elsewhere."""
    if min is None and max is None:
        raise ArgumentError("clamp(x, min=None, max=None): give at least one bound.")
    bounds = "both" if min is not None and max is not None else "lo" if max is None else "hi"
    return clamp_p.bind(*promote(*[v for v in (x, min, max) if v is not None]),
                        bounds=bounds)


clip = clamp

# ---------------------------------------------------------------------------
# Floating-point classes and logic
# ---------------------------------------------------------------------------


def _bool_const(x, value: bool):
    return broadcast_to(np.bool_(value), tuple(typeof(x).shape))


def isnan(x: ArrayLike) -> Bool[Array, "*shape"]:
    """Where ``x`` is NaN (never, for integers)."""
    if not dtypes.is_float(typeof(x).dtype):
        return _bool_const(x, False)
    return not_equal(x, x)


def isinf(x: ArrayLike) -> Bool[Array, "*shape"]:
    """Where ``x`` is +inf or -inf."""
    if not dtypes.is_float(typeof(x).dtype):
        return _bool_const(x, False)
    return equal(abs(x), float("inf"))


def isfinite(x: ArrayLike) -> Bool[Array, "*shape"]:
    """Where ``x`` is neither infinite nor NaN."""
    if not dtypes.is_float(typeof(x).dtype):
        return _bool_const(x, True)
    return less(abs(x), float("inf"))  # NaN < inf is False


def nan_to_num(x: ArrayLike, nan: float = 0.0, posinf: float | None = None,
               neginf: float | None = None) -> Shaped[Array, "*shape"]:
    """NaN -> ``nan``, +inf -> ``posinf``, -inf -> ``neginf`` (defaults: the dtype's
    largest and lowest finite values)."""
    dt = typeof(x).dtype
    if not dtypes.is_float(dt):
        return x
    info = np.finfo(dtypes.to_numpy(dt))
    posinf = float(info.max) if posinf is None else float(posinf)
    neginf = float(info.min) if neginf is None else float(neginf)
    x = where(isnan(x), float(nan), x)
    x = where(equal(x, float("inf")), posinf, x)
    return where(equal(x, float("-inf")), neginf, x)


def _truth(x):
    if _is_weak(x):
        return np.bool_(x)
    return x if typeof(x).dtype == dtypes.bool_ else not_equal(x, 0)


def logical_and(x: ArrayLike, y: ArrayLike) -> Bool[Array, "..."]:
    """Elementwise ``x and y`` (non-zero counts as true)."""
    return bitwise_and(_truth(x), _truth(y))


def logical_or(x: ArrayLike, y: ArrayLike) -> Bool[Array, "..."]:
    return bitwise_or(_truth(x), _truth(y))


def logical_xor(x: ArrayLike, y: ArrayLike) -> Bool[Array, "..."]:
    return bitwise_xor(_truth(x), _truth(y))


def logical_not(x: ArrayLike) -> Bool[Array, "*shape"]:
    return bitwise_xor(_truth(x), np.bool_(True))


def isclose(x: ArrayLike, y: ArrayLike, rtol: float = 1e-5, atol: float = 1e-8,
            equal_nan: bool = False) -> Bool[Array, "..."]:
    """``|x - y| <= atol + rtol * |y|`` elementwise (equal infinities are close; NaNs
    only with ``equal_nan``)."""
    x, y = promote(x, y)
    if not dtypes.is_float(typeof(x).dtype):
        x, y = cast(x, dtypes.float32), cast(y, dtypes.float32)
    close = less_equal(abs(sub(x, y)), add(float(atol), mul(float(rtol), abs(y))))
    out = bitwise_or(close, equal(x, y))  # inf == inf; inf - inf would be NaN
    if equal_nan:
        out = bitwise_or(out, bitwise_and(isnan(x), isnan(y)))
    return out


# ---------------------------------------------------------------------------
# Reductions built from others
# ---------------------------------------------------------------------------


def prod(x: ArrayLike, axis=None, keepdims: bool = False, dtype=None) -> Shaped[Array, "..."]:
    """Product over ``axis`` (an int, a tuple or None for all): the last entry of a
    running product, so its derivative is exact where entries are zero."""
    if dtype is not None:
        x = cast(x, dtype)
    if typeof(x).dtype == dtypes.bool_:
        x = cast(x, dtypes.int64)
    a = typeof(x)
    axes = _axes(x, axis)
    kept = tuple(d for i, d in enumerate(a.shape) if i not in axes)
    if not axes:
        return x
    n = int(np.prod([a.shape[i] for i in axes], dtype=np.int64))
    perm = tuple(i for i in range(a.ndim) if i not in axes) + axes
    flat = reshape(transpose(x, perm) if perm != tuple(range(a.ndim)) else x, kept + (n,))
    if n == 0:
        out = broadcast_to(np.ones((), dtypes.to_numpy(a.dtype)), kept)
    elif dtypes.is_half(a.dtype):
        # multiplied in float32 and rounded once, as MindSpore's ReduceProd: a running
        # product of float16 overflows (300 * 300) where the whole product does not
        wide = cumprod(cast(flat, dtypes.float32), len(kept))
        out = cast(reshape(_slice_axis(wide, len(kept), n - 1, n), kept), a.dtype)
    else:
        out = reshape(_slice_axis(cumprod(flat, len(kept)), len(kept), n - 1, n), kept)
    if keepdims:
        out = reshape(out, tuple(1 if i in axes else d for i, d in enumerate(a.shape)))
    return out


def var(x: ArrayLike, axis=None, correction: int = 0, keepdims: bool = False) -> Float[Array, "..."]:
    """Variance over ``axis`` with ``correction`` (Bessel's: 1) degrees of freedom."""
    return var_mean(x, axis, correction, keepdims)[0]


def var_mean(x: ArrayLike, axis=None, correction: int = 0, keepdims: bool = False) -> tuple:
    """``(variance, mean)`` over ``axis``."""
    x = _float(x)
    a = typeof(x)
    axes = _axes(x, axis)
    n = int(np.prod([a.shape[i] for i in axes], dtype=np.int64))
    mu = mean(x, axes, keepdims=True)
    dev = sub(x, mu)
    denom = n - correction
    v = mul(reduce_sum(mul(dev, dev), axes, keepdims), 1.0 / denom if denom > 0 else float("nan"))
    return v, (mu if keepdims else reshape(mu, tuple(typeof(v).shape)))


def std(x: ArrayLike, axis=None, correction: int = 0, keepdims: bool = False) -> Float[Array, "..."]:
    return sqrt(var(x, axis, correction, keepdims))


def std_mean(x: ArrayLike, axis=None, correction: int = 0, keepdims: bool = False) -> tuple:
    """``(standard deviation, mean)`` over ``axis``."""
    v, mu = var_mean(x, axis, correction, keepdims)
    return sqrt(v), mu


# ---------------------------------------------------------------------------
# Structure: unstack, tile, repeat_interleave, flip, roll, padding modes, tril/triu
# ---------------------------------------------------------------------------


def unstack(x: Shaped[Array, "..."], axis: int = 0) -> tuple:
    """The slices of ``x`` along ``axis``, that axis removed."""
    a = typeof(x)
    axis = _norm_axis(axis, a.ndim, "unstack(axis=...)")
    if a.shape[axis] == 0:
        return ()
    return tuple(squeeze(p, axis) for p in split(x, 1, axis))


def tile(x: Shaped[Array, "..."], multiples) -> Shaped[Array, "..."]:
    """Repeat the whole of ``x`` ``multiples[i]`` times along dimension ``i`` (leading
    ones are added to the shorter of ``x.shape`` and ``multiples``)."""
    reps = _static_ints(multiples, "tile(multiples=...)")
    if any(r < 0 for r in reps):
        raise ArgumentError(f"tile(multiples=...) must be non-negative ints, got {reps!r}.")
    shape = tuple(typeof(x).shape)
    nd = max(len(shape), len(reps))
    shape, reps = (1,) * (nd - len(shape)) + shape, (1,) * (nd - len(reps)) + reps
    y = reshape(x, tuple(d for s in shape for d in (1, s)))
    y = broadcast_to(y, tuple(d for r, s in zip(reps, shape) for d in (r, s)))
    return reshape(y, tuple(r * s for r, s in zip(reps, shape)))


def repeat_interleave(x: Shaped[Array, "..."], repeats, axis=None) -> Shaped[Array, "..."]:
    """Repeat each entry of ``x`` along ``axis`` (None: of the flattened ``x``)
    ``repeats`` times (an int, or one static count per entry)."""
    if axis is None:
        x, axis = reshape(x, (-1,)), 0
    a = typeof(x)
    axis = _norm_axis(axis, a.ndim, "repeat_interleave(axis=...)")
    if isinstance(repeats, Tracer):
        raise UnsupportedOpError(
            "repeat_interleave with traced repeats: the output's length would depend on "
            "the data.\nFix: pass the repeats as a Python int, list or concrete Tensor.")
    reps = np.asarray(repeats.asnumpy() if hasattr(repeats, "asnumpy") else repeats)
    if reps.ndim == 0 or reps.size == 1:
        r = int(reps.reshape(()))
        y = expand_dims(x, axis + 1)
        shape = tuple(a.shape)
        y = broadcast_to(y, shape[:axis + 1] + (r,) + shape[axis + 1:])
        return reshape(y, shape[:axis] + (shape[axis] * r,) + shape[axis + 1:])
    if reps.shape != (a.shape[axis],):
        raise ShapeError(
            f"repeat_interleave(repeats=...): {reps.size} counts for {a.shape[axis]} "
            f"entries along axis {axis} of {a}.\nFix: give one count per entry, or one int.")
    return gather_p.bind(x, np.repeat(np.arange(a.shape[axis], dtype=np.int32), reps),
                         axis=axis)


def _axes_arg(x, dims, what: str) -> tuple:
    nd = typeof(x).ndim
    dims = (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    return tuple(_norm_axis(int(d), nd, what) for d in dims)


def flip(x: Shaped[Array, "..."], dims) -> Shaped[Array, "..."]:
    """Reverse the order of entries along each of ``dims``."""
    for d in _axes_arg(x, dims, "flip(dims=...)"):
        n = typeof(x).shape[d]
        if n > 1:
            x = gather_p.bind(x, np.arange(n - 1, -1, -1, dtype=np.int32), axis=d)
    return x


def roll(x: Shaped[Array, "..."], shifts, dims=None) -> Shaped[Array, "..."]:
    """Shift entries by ``shifts`` along ``dims`` cyclically (None: of the flattened
    ``x``, reshaped back)."""
    if dims is None:
        shape = tuple(typeof(x).shape)
        return reshape(roll(reshape(x, (-1,)), shifts, 0), shape)
    dims = _axes_arg(x, dims, "roll(dims=...)")
    shifts = _static_ints(shifts, "roll(shifts=...)")
    if len(shifts) != len(dims):
        raise ArgumentError(f"roll: {len(shifts)} shifts for {len(dims)} dims.")
    for s, d in zip(shifts, dims):
        n = typeof(x).shape[d]
        s = s % n if n else 0
        if s:
            x = concat([_slice_axis(x, d, n - s, n), _slice_axis(x, d, 0, n - s)], d)
    return x


def _pad_index(n: int, lo: int, hi: int, mode: str) -> np.ndarray:
    """Source positions of a padded axis of size ``n`` (``reflect``: mirrored without
    the edge; ``replicate``: the edge repeated; ``circular``: wrapped)."""
    pos = np.arange(-lo, n + hi)
    if mode == "replicate":
        return np.clip(pos, 0, n - 1)
    if mode == "circular":
        return pos % n
    period = 2 * (n - 1)
    pos = np.abs(pos) % period if period else np.zeros_like(pos)
    return np.where(pos >= n, period - pos, pos)


def pad_nd(x: Shaped[Array, "..."], padding, mode: str = "constant",
           value=None) -> Shaped[Array, "..."]:
    """``mindspore.ops.pad``: ``padding`` holds (before, after) pairs starting from the
    LAST dimension; negative widths crop. ``mode`` is 'constant' (fill ``value``,
    default 0), 'reflect', 'replicate' or 'circular'."""
    a = typeof(x)
    padding = _static_ints(padding, "pad(padding=...)")
    if len(padding) % 2 or len(padding) // 2 > a.ndim:
        raise ArgumentError(
            f"pad(padding={padding}): needs (before, after) pairs for at most {a.ndim} "
            f"dimensions of {a}, last dimension first.")
    lo, hi = [0] * a.ndim, [0] * a.ndim
    for k in range(len(padding) // 2):
        lo[a.ndim - 1 - k], hi[a.ndim - 1 - k] = padding[2 * k], padding[2 * k + 1]
    # Crop first (negative widths), then pad with non-negative widths.
    starts = [max(-v, 0) for v in lo]
    limits = [d - max(-v, 0) for d, v in zip(a.shape, hi)]
    if any(starts) or any(lim != d for lim, d in zip(limits, a.shape)):
        x = slice_array(x, starts, limits)
    lo, hi = [max(v, 0) for v in lo], [max(v, 0) for v in hi]
    if not any(lo + hi):
        return x
    if mode == "constant":
        from fshard.primitives.structural import pad

        out = pad(x, lo, hi)
        if value is not None and not (not isinstance(value, Tracer) and value == 0):
            inside = np.zeros(tuple(typeof(x).shape), bool)
            mask = np.pad(inside, list(zip(lo, hi)), constant_values=True)
            out = where(mask, cast(value, typeof(x).dtype), out)
        return out
    if mode not in ("reflect", "replicate", "circular"):
        raise ArgumentError(
            f"pad(mode={mode!r}): expected 'constant', 'reflect', 'replicate' or "
            "'circular'.")
    for d in range(a.ndim):
        if lo[d] or hi[d]:
            n = typeof(x).shape[d]
            if mode == "reflect" and (lo[d] >= n or hi[d] >= n):
                raise ArgumentError(
                    f"pad(mode='reflect'): widths ({lo[d]}, {hi[d]}) must be smaller than "
                    f"dimension {d} of size {n}.")
            x = gather_p.bind(x, _pad_index(n, lo[d], hi[d], mode).astype(np.int32), axis=d)
    return x


def _tri(x, diagonal: int, lower: bool):
    a = typeof(x)
    if a.ndim < 2:
        raise ShapeError(f"{'tril' if lower else 'triu'} needs a value of rank >= 2, got {a}.")
    m, n = a.shape[-2:]
    mask = (np.tril if lower else np.triu)(np.ones((m, n), bool), int(diagonal))
    zero = np.zeros((), dtypes.to_numpy(a.dtype))
    return where(broadcast_to(mask, tuple(a.shape)), x, zero)


def tril(x: Shaped[Array, "..."], diagonal: int = 0) -> Shaped[Array, "..."]:
    """The lower triangle of the last two dimensions (entries above ``diagonal``
    zeroed)."""
    return _tri(x, diagonal, True)


def triu(x: Shaped[Array, "..."], diagonal: int = 0) -> Shaped[Array, "..."]:
    """The upper triangle of the last two dimensions (entries below ``diagonal``
    zeroed)."""
    return _tri(x, diagonal, False)


def masked_fill(x: Shaped[Array, "..."], mask, value) -> Shaped[Array, "..."]:
    """``value`` where ``mask`` (broadcast), else ``x``."""
    if not _is_weak(mask) and typeof(mask).dtype != dtypes.bool_:
        raise ArgumentError(f"masked_fill(mask=...) must be a bool array, got {typeof(mask)}.")
    value = cast(value, typeof(x).dtype)
    shape = broadcast_shapes(tuple(typeof(x).shape), tuple(typeof(mask).shape))
    return where(mask, value, broadcast_to(x, shape) if shape != tuple(typeof(x).shape) else x)


def narrow(x: Shaped[Array, "..."], axis: int, start: int, length: int) -> Shaped[Array, "..."]:
    """``length`` entries of ``x`` from ``start`` along ``axis``."""
    a = typeof(x)
    axis = _norm_axis(axis, a.ndim, "narrow(axis=...)")
    n = a.shape[axis]
    start, length = _static_ints((start, length), "narrow(start, length)")
    if start < 0:
        start += n
    if not (0 <= start <= n and 0 <= length and start + length <= n):
        raise ArgumentError(
            f"narrow(axis={axis}, start={start}, length={length}) is outside dimension "
            f"{axis} of size {n} of {a}.")
    return _slice_axis(x, axis, start, start + length)


def dense(x: Shaped[Array, "... k"], weight: Shaped[Array, "n k"],
          bias=None) -> Shaped[Array, "... n"]:
    """``x @ weight.T + bias`` (``mindspore.ops.dense``)."""
    out = matmul(x, weight, transpose_b=True) if typeof(weight).ndim == 2 else matmul(x, weight)
    return out if bias is None else add(out, bias)


# ---------------------------------------------------------------------------
# Index arithmetic: gather_nd, scatter_nd and its additive relatives
# ---------------------------------------------------------------------------


def _flat_index(indices, shape: tuple):
    """Row-major flat positions of the index tuples in ``indices[..., :K]`` for
    ``shape[:K]`` (negative entries count from the end)."""
    k = typeof(indices).shape[-1]
    strides = np.array([int(np.prod(shape[i + 1:k], dtype=np.int64)) for i in range(k)],
                       np.int64)
    dims = np.array(shape[:k], np.int64)
    if isinstance(indices, Tracer):
        idx = cast(indices, dtypes.int64)
        idx = where(less(idx, 0), add(idx, broadcast_to(dims, tuple(typeof(idx).shape))), idx)
        return reduce_sum(mul(idx, broadcast_to(strides, tuple(typeof(idx).shape))), -1)
    idx = np.asarray(indices.asnumpy() if hasattr(indices, "asnumpy") else indices, np.int64)
    if idx.size and ((idx < -dims) | (idx >= dims)).any():
        raise ArgumentError(f"an index in {idx.tolist()!r:.80} is out of bounds for shape "
                            f"{tuple(shape[:k])}.")
    return ((idx % dims) * strides).sum(-1)


def gather_nd(x: Shaped[Array, "..."], indices) -> Shaped[Array, "..."]:
    """``out[i...] = x[indices[i..., 0], ..., indices[i..., K-1], ...]``."""
    a, ia = typeof(x), typeof(indices)
    k = ia.shape[-1] if ia.ndim else 0
    if ia.ndim == 0 or k > a.ndim:
        raise ShapeError(f"gather_nd(indices=...) must have a last dimension of at most "
                         f"{a.ndim} (the rank of x {a}), got {ia}.")
    flat = _flat_index(indices, tuple(a.shape))
    rows = int(np.prod(a.shape[:k], dtype=np.int64))
    return gather_p.bind(reshape(x, (rows,) + tuple(a.shape[k:])),
                         _index_array(flat, "gather_nd(indices=...)"), axis=0)


def scatter_nd(indices, updates, shape) -> Shaped[Array, "..."]:
    """Zeros of ``shape`` with ``updates`` added at the index tuples ``indices[...,
    :K]`` (repeated indices accumulate, as MindSpore's ScatterNd)."""
    shape = _static_ints(shape, "scatter_nd(shape=...)")
    ia = typeof(indices)
    k = ia.shape[-1]
    flat = _index_array(_flat_index(indices, shape), "scatter_nd(indices=...)")
    rows = int(np.prod(shape[:k], dtype=np.int64))
    out = scatter_add(updates, flat, (rows,) + tuple(shape[k:]), 0)
    return reshape(out, shape)


def tensor_scatter_add(x: Shaped[Array, "..."], indices, updates) -> Shaped[Array, "..."]:
    """``x`` plus ``scatter_nd(indices, updates, x.shape)``."""
    return add(x, cast(scatter_nd(indices, updates, tuple(typeof(x).shape)), typeof(x).dtype))


def index_add(x: Shaped[Array, "..."], indices, y, axis: int = 0,
              alpha=1) -> Shaped[Array, "..."]:
    """``x`` with ``alpha * y[..., j, ...]`` added at ``x[..., indices[j], ...]`` along
    ``axis``."""
    a = typeof(x)
    axis = _norm_axis(axis, a.ndim, "index_add(axis=...)")
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        y = mul(y, alpha)
    return add(x, cast(scatter_add(y, indices, tuple(a.shape), axis), a.dtype))


def scatter_add_elements(x: Shaped[Array, "..."], axis: int, index, src) -> Shaped[Array, "..."]:
    """``x`` with ``src[i][j]`` added at ``x[index[i][j]][j]`` (for ``axis=0``; likewise
    along any axis), as ``mint.scatter_add`` / PyTorch's ``scatter_add``. ``index`` may
    be smaller than ``src`` and ``x`` outside ``axis``."""
    a, ia = typeof(x), typeof(index)
    axis = _norm_axis(axis, a.ndim, "scatter_add(dim=...)")
    ish = tuple(ia.shape)
    src = slice_array(src, (0,) * len(ish), ish) if tuple(typeof(src).shape) != ish else src
    grid = np.indices(ish, dtype=np.int64)
    strides = [int(np.prod(a.shape[i + 1:], dtype=np.int64)) for i in range(a.ndim)]
    const = sum(grid[d] * strides[d] for d in range(a.ndim) if d != axis)
    idx = cast(index, dtypes.int64) if isinstance(index, Tracer) else np.asarray(
        index.asnumpy() if hasattr(index, "asnumpy") else index, np.int64)
    flat = add(mul(idx, strides[axis]), const)
    n = int(np.prod(a.shape, dtype=np.int64))
    out = scatter_add(reshape(src, (-1,)), reshape(flat, (-1,)), (n,), 0)
    return add(x, cast(reshape(out, tuple(a.shape)), a.dtype))


# ---------------------------------------------------------------------------
# index_update: x[idx] = value, functionally (NB: JAX's x.at[idx].set(value))
# ---------------------------------------------------------------------------


def index_update(x: Shaped[Array, "..."], idx, value) -> Shaped[Array, "..."]:
    """``x`` with ``x[idx]`` replaced by ``value`` (broadcast, cast to ``x``'s dtype),
    as a new value: what ``x[idx] = value`` on a traced value records. ``idx`` is any
    static NumPy index (ints, slices, ``None``, ``...``, integer arrays, boolean masks),
    or a traced boolean mask of ``x``'s shape. Where an integer-array index repeats a
    position, the last assignment wins (as NumPy).

    >>> import numpy as np, fshard as fs
    >>> x = np.zeros((2, 3), np.float32)
    >>> fs.ops.index_update(x, (0, slice(1, None)), 5.0).asnumpy().tolist()
    [[0.0, 5.0, 5.0], [0.0, 0.0, 0.0]]
    """
    a = typeof(x)
    _int_dims(a, "item assignment")
    value = cast(value, a.dtype)
    entries = idx if isinstance(idx, tuple) else (idx,)
    if any(isinstance(e, Tracer) for e in entries):
        if len(entries) == 1 and typeof(entries[0]).dtype == dtypes.bool_:
            mask = entries[0]
            if tuple(typeof(mask).shape) != tuple(a.shape) or typeof(value).ndim:
                raise ArgumentError(
                    f"x[mask] = value with a traced mask {typeof(mask)} on x {a}: fshard "
                    "supports a traced boolean mask of x's own shape with a scalar value.\n"
                    "Fix: use fs.ops.where(mask, value, x) with broadcastable operands.")
            return where(mask, value, x)
        return _update_at_traced_index(x, entries, value)
    np_idx = tuple(_concrete_index(e) for e in entries) if isinstance(idx, tuple) else (
        _concrete_index(idx))
    try:
        pos = np.arange(a.size, dtype=np.int64).reshape(a.shape)[np_idx]
    except (IndexError, TypeError, ValueError) as err:
        raise ArgumentError(f"x[{idx!r:.60}] = value on a traced value {a}: {err}.") from None
    pos = np.asarray(pos)
    vshape = tuple(typeof(value).shape)
    try:
        target = broadcast_shapes(vshape, pos.shape)
    except ShapeError:
        target = None
    if target != pos.shape:
        raise ShapeError(
            f"x[{idx!r:.60}] = value: a value of shape {vshape} cannot be broadcast to the "
            f"indexed shape {pos.shape} of x {a}.\nFix: reshape the value to {pos.shape} "
            "(or to a shape that broadcasts to it).")
    if pos.size == 0:
        return x
    flat_pos = pos.ravel()
    # Where a position repeats, the last write wins: keep each position's last entry.
    _, last_rev = np.unique(flat_pos[::-1], return_index=True)
    keep = np.sort(flat_pos.size - 1 - last_rev)
    if tuple(vshape) != pos.shape:
        value = broadcast_to(value, pos.shape)
    v = reshape(value, (flat_pos.size,))
    if keep.size != flat_pos.size:
        v = gather_p.bind(v, keep.astype(np.int32), axis=0)
    rows = flat_pos[keep]
    if rows.size == a.size and a.size and np.array_equal(np.sort(rows), np.arange(a.size)):
        # every position is written: the result is a permutation of the values
        order = np.empty(a.size, np.int64)
        order[rows] = np.arange(a.size)
        out = v if np.array_equal(order, np.arange(a.size)) else gather_p.bind(
            v, order.astype(np.int32), axis=0)
        return reshape(out, tuple(a.shape))
    scattered = _scatter_any(v, rows.astype(np.int32), (a.size,), 0)
    mask = np.zeros(a.size, bool)
    mask[rows] = True
    flat = reshape(x, (a.size,)) if a.ndim != 1 else x
    return reshape(where(mask, scattered, flat), tuple(a.shape))


_SCATTER_DTYPES = (dtypes.float32, dtypes.float64, dtypes.int32, dtypes.int64)


def _scatter_any(v, indices, shape, axis):
    """``scatter_add`` of values that land on distinct positions, for any dtype:
    MindSpore's CPU segment sum has no bool or small-integer kernel, so those are moved
    as int32 (float16 as float32) and cast back, exactly."""
    dt = typeof(v).dtype
    if dt in _SCATTER_DTYPES:
        return scatter_add_p.bind(v, indices, shape=shape, axis=axis)
    via = dtypes.float32 if dtypes.is_float(dt) else dtypes.int32
    return cast(scatter_add_p.bind(cast(v, via), indices, shape=shape, axis=axis), dt)


def _update_at_traced_index(x, entries, value):
    """``x[..., i, ...] = value`` for one traced integer index ``i`` (any shape) along
    one axis, every other entry a whole slice ``:`` (or ``...``). A position that ``i``
    repeats takes the last write (as NumPy); out-of-range positions are dropped (a
    traced index cannot raise)."""
    a = typeof(x)
    traced = [k for k, e in enumerate(entries) if isinstance(e, Tracer)]
    n_ell = sum(e is Ellipsis for e in entries)
    others_ok = all(k in traced or entries[k] is Ellipsis or (
        isinstance(entries[k], slice) and entries[k] == slice(None))
        for k in range(len(entries)))
    if len(traced) != 1 or n_ell > 1 or not others_ok or not dtypes.is_int(
            typeof(entries[traced[0]]).dtype):
        raise ArgumentError(
            f"x[idx] = value with a traced index on {a}: fshard supports one traced integer "
            "index along one axis, the other entries whole slices (x[i] = v, x[:, i] = v, "
            "x[..., i] = v), or a traced boolean mask of x's shape.\nFix: for additions "
            "use fs.ops.index_add(x, indices, updates, axis) (repeats accumulate); for a "
            "mask use x[mask] = scalar or fs.ops.where(mask, value, x).")
    k = traced[0]
    if n_ell:
        e = entries.index(Ellipsis)
        axis = k if k < e else a.ndim - (len(entries) - k)
    else:
        axis = k
    if not 0 <= axis < a.ndim:
        raise ArgumentError(f"x[idx] = value: too many indices for {a}.")
    n = a.shape[axis]
    i = entries[k]
    ishape = tuple(typeof(i).shape)
    m = int(np.prod(ishape, dtype=np.int64))
    i = cast(reshape(i, (m,)), dtypes.int32)
    i = where(less(i, 0), add(i, n), i)
    target = tuple(a.shape[:axis]) + ishape + tuple(a.shape[axis + 1:])
    vshape = tuple(typeof(value).shape)
    try:
        ok = broadcast_shapes(vshape, target) == target
    except ShapeError:
        ok = False
    if not ok:
        raise ShapeError(
            f"x[...] = value: a value of shape {vshape} cannot be broadcast to the indexed "
            f"shape {target} of x {a}.\nFix: reshape the value to {target}.")
    v = broadcast_to(value, target) if vshape != target else value
    v = reshape(v, tuple(a.shape[:axis]) + (m,) + tuple(a.shape[axis + 1:]))
    if m > 1:
        # An entry is superseded when a later entry writes the same position: zero it,
        # so the scatter's sum is the last write. A stable sort puts equal positions
        # next to each other in their original order: each but the last of a run is
        # superseded; scattering the flags back through the sort's permutation puts
        # them at the entries' places (O(m log m)).
        s, perm = sort(i, 0)
        nxt = equal(slice_array(s, (0,), (m - 1,)), slice_array(s, (1,), (m,)))
        flags = concat([cast(nxt, dtypes.int32), np.zeros((1,), np.int32)], 0)
        superseded = greater(scatter_add_p.bind(flags, perm, shape=(m,), axis=0), 0)
        mask_shape = (1,) * axis + (m,) + (1,) * (a.ndim - axis - 1)
        superseded = broadcast_to(reshape(superseded, mask_shape), typeof(v).shape)
        v = where(superseded, np.zeros((), dtypes.to_numpy(a.dtype)), v)
    scattered = _scatter_any(v, i, tuple(a.shape), axis)
    hits = scatter_add_p.bind(broadcast_to(np.ones((), np.int32), (m,)), i, shape=(n,), axis=0)
    hit = reshape(greater(hits, 0), (1,) * axis + (n,) + (1,) * (a.ndim - axis - 1))
    return where(broadcast_to(hit, tuple(a.shape)), scattered, x)


# ---------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------


def _reduce_loss(loss, reduction: str, what: str):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return reduce_sum(loss)
    if reduction == "mean":
        return mean(loss)
    raise ArgumentError(f"{what}(reduction={reduction!r}): expected 'none', 'mean' or 'sum'.")


def _log_sigmoid(x):
    # log(sigmoid(x)) = -softplus(-x) = min(x, 0) - log1p(exp(-|x|)), stable for any x
    return sub(minimum(x, 0.0), log1p(exp(neg(abs(x)))))


def binary_cross_entropy_with_logits(logits, labels, weight=None, pos_weight=None,
                                     reduction: str = "mean") -> Float[Array, "..."]:
    """``-weight * (pos_weight * y * log(sigmoid(x)) + (1 - y) * log(1 - sigmoid(x)))``,
    computed stably from the logits, then reduced."""
    x, y = promote(logits, labels)
    pos = mul(y, _log_sigmoid(x))
    if pos_weight is not None:
        pos = mul(pos, pos_weight)
    loss = neg(add(pos, mul(sub(1.0, y), _log_sigmoid(neg(x)))))
    if weight is not None:
        loss = mul(loss, weight)
    return _reduce_loss(loss, reduction, "binary_cross_entropy_with_logits")


def kl_div(logits, labels, reduction: str = "mean",
           log_target: bool = False) -> Float[Array, "..."]:
    """``labels * (log(labels) - logits)`` (``log_target``: ``exp(labels) * (labels -
    logits)``), reduced; 'batchmean' divides the sum by the first dimension."""
    x, y = promote(logits, labels)
    if log_target:
        loss = mul(exp(y), sub(y, x))
    else:
        # 0 * log(0) = 0 (as MindSpore): the log is taken of 1 where the label is 0.
        pos = greater(y, 0.0)
        loss = where(pos, mul(y, sub(log(where(pos, y, 1.0)), x)), mul(y, neg(x)))
    if reduction == "batchmean":
        n = typeof(x).shape[0] if typeof(x).ndim else 1
        return div(reduce_sum(loss), float(n))
    return _reduce_loss(loss, reduction, "kl_div")


def smooth_l1_loss(x, target, beta: float = 1.0,
                   reduction: str = "none") -> Float[Array, "..."]:
    """``0.5 * d**2 / beta`` where ``d = |x - target| < beta``, else ``d - 0.5 * beta``."""
    x, target = promote(x, target)
    d = abs(sub(x, target))
    loss = where(less(d, float(beta)), div(mul(0.5, mul(d, d)), float(beta)),
                 sub(d, 0.5 * float(beta)))
    return _reduce_loss(loss, reduction, "smooth_l1_loss")


def norm(x, p: float = 2.0, axis=None, keepdims: bool = False,
         epsilon: float = 0.0) -> Float[Array, "..."]:
    """The ``p``-norm over ``axis`` (p = 1, 2 or any positive float; 'inf' for the
    largest magnitude)."""
    from fshard.primitives.reductions import reduce_max

    x = _float(x)
    if p in (float("inf"), "inf"):
        return reduce_max(abs(x), axis, keepdims)
    if p == 2:
        out = sqrt(reduce_sum(mul(x, x), axis, keepdims))
    elif p == 1:
        out = reduce_sum(abs(x), axis, keepdims)
    elif isinstance(p, (int, float)) and p > 0:
        from fshard.primitives.elementwise import pow as pow_

        out = pow_(reduce_sum(pow_(abs(x), float(p)), axis, keepdims), 1.0 / p)
    else:
        raise UnsupportedOpError(f"norm(p={p!r}) is not supported on a traced value; only "
                                 "p > 0 and inf.")
    return maximum(out, float(epsilon)) if epsilon else out


def cosine_similarity(x1, x2, dim: int = 1, eps: float = 1e-8) -> Float[Array, "..."]:
    """``sum(x1 * x2) / max(|x1| * |x2|, eps)`` along ``dim``."""
    x1, x2 = promote(_float(x1), _float(x2))
    num = reduce_sum(mul(x1, x2), dim)
    den = mul(norm(x1, 2.0, dim), norm(x2, 2.0, dim))
    return div(num, maximum(den, float(eps)))


__all__ = [n for n in dir() if not n.startswith("_") and callable(globals()[n]) and getattr(
    globals()[n], "__module__", None) == __name__]
