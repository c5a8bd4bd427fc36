"""Neural-network primitives: bias_add, softmax, log_softmax; and composites built
from primitives: layer_norm, softmax_cross_entropy, logsumexp.

Composites need no rules of their own: their IR is made of primitives.
"""

from __future__ import annotations

from mindspore import ops

from fshard import dtypes
from fshard.array_types import Array, Float, Shaped
from fshard.core import typeof
from fshard.errors import ProgramTypeError, ShapeError
from fshard.primitives._batching import batch_to_front, batch_size, move_axis
from fshard.primitives._define import def_primitive, defjvp, deflinear
from fshard.primitives.elementwise import exp, log, mul, rsqrt, sub
from fshard.primitives.reductions import mean, reduce_max, reduce_sum
from fshard.primitives.structural import _norm_axis, broadcast_to, reshape
from fshard.rules import batching, sharding, unsupported
from fshard.sharding import FactorSpec

FAMILY = "nn"

# ---------------------------------------------------------------------------
# bias_add: MindSpore's BiasAdd adds a (C,) bias along axis 1 of an (N, C, ...) input
# ---------------------------------------------------------------------------


def _ms_bias_add(x, b):
    return ops.bias_add(x, b)


def _bias_add_type(x, b):
    if x.ndim < 2 or b.ndim != 1 or x.shape[1] != b.shape[0] or x.dtype != b.dtype:
        raise ProgramTypeError(
            f"bias_add needs x of rank >= 2 and a bias of shape (x.shape[1],) with x's "
            f"dtype, got x: {x} and bias: {b}")
    return x


bias_add_p = def_primitive("bias_add", FAMILY, _bias_add_type, _ms_bias_add)


def _bias_add_batching(args, dims):
    (x, b), (dx, db) = args, dims
    if db is None:
        # Fold the batch into N: (B, N, C, ...) -> (B*N, C, ...).
        x = move_axis(x, dx, 0)
        s = typeof(x).shape
        out = bias_add_p.bind(reshape(x, (s[0] * s[1],) + tuple(s[2:])), b)
        return [reshape(out, s)], [0]
    from fshard.primitives.elementwise import add

    size = batch_size(args, dims)
    x = batch_to_front(x, dx, size)
    b = batch_to_front(b, db, size)
    s = typeof(x).shape
    bb = reshape(b, (size, 1, s[2]) + (1,) * (len(s) - 3))
    return [add(x, broadcast_to(bb, s))], [0]


batching.set(bias_add_p, _bias_add_batching)


def _bias_add_sharding(x, b):
    labels = tuple(f"d{i}" for i in range(x.ndim))
    return FactorSpec([labels, (labels[1],)], [labels],
                      {lab: x.shape[i] for i, lab in enumerate(labels)})


sharding.set(bias_add_p, _bias_add_sharding)


def _bias_add_transpose(ct, x, b):
    from fshard.primitives._define import is_undefined

    nd = len(ct.shape) if hasattr(ct, "shape") else typeof(ct).ndim
    cx = ct if is_undefined(x) else None
    cb = reduce_sum(ct, tuple(i for i in range(nd) if i != 1)) if is_undefined(b) else None
    return [cx, cb]


deflinear(bias_add_p, _bias_add_transpose)


def bias_add(x: Shaped[Array, "*batch c"], bias: Shaped[Array, "c"]) -> Shaped[Array, "*batch c"]:
    """Add a 1-D ``bias`` along axis 1 of ``x`` (MindSpore's ``ops.bias_add``)."""
    return bias_add_p.bind(x, bias)


# ---------------------------------------------------------------------------
# softmax / log_softmax over one axis
# ---------------------------------------------------------------------------


def _ms_softmax(x, axis):
    return ops.softmax(x, axis)


def _ms_log_softmax(x, axis):
    return ops.log_softmax(x, axis)


def _ms_log_softmax_exact(x, axis):
    # MindSpore's CPU LogSoftmax kernel computes float64 at float32 precision (errors
    # ~3e-6), which breaks float64 derivative checks; this form is exact.
    m = ops.amax(x, axis, True)
    z = x - m
    return z - ops.log(ops.sum(ops.exp(z), axis, True))


def _log_softmax_impl(x, axis):
    fn = _ms_log_softmax_exact if x.dtype == dtypes.float64 else _ms_log_softmax
    return fn(x, axis)


def _log_softmax_lower(ctx, x, *, axis):
    exact = ctx.in_avals[0].dtype == dtypes.float64
    return ctx.call(_ms_log_softmax_exact if exact else _ms_log_softmax, x, axis=axis)


def _softmax_type(name):
    def rule(x, *, axis):
        if not dtypes.is_float(x.dtype):
            raise ProgramTypeError(f"{name} needs a float operand, got {x}")
        assert 0 <= axis < x.ndim
        return x

    return rule


def _axis_sharding(x, *, axis):
    """Parallel over every dim but the normalised axis, which stays whole."""
    labels = tuple(f"d{i}" for i in range(x.ndim))
    return FactorSpec([labels], [labels], {lab: x.shape[i] for i, lab in enumerate(labels)},
                      nosplit=frozenset({labels[axis]}), flops_per_point=5.0)


def _axis_batching(prim):
    def rule(args, dims, *, axis):
        (x,), (d,) = args, dims
        return [prim.bind(x, axis=axis + (axis >= d))], [d]

    return rule


softmax_p = def_primitive("softmax", FAMILY, _softmax_type("softmax"), _ms_softmax)
batching.set(softmax_p, _axis_batching(softmax_p))
sharding.set(softmax_p, _axis_sharding)
# d softmax = y * (t - sum(y * t))
defjvp(softmax_p, lambda t, y, x, *, axis: mul(
    y, sub(t, reduce_sum(mul(y, t), axis, keepdims=True))))
unsupported(softmax_p, "transpose", "not linear")

log_softmax_p = def_primitive("log_softmax", FAMILY, _softmax_type("log_softmax"),
                              _log_softmax_impl, lower=_log_softmax_lower)
batching.set(log_softmax_p, _axis_batching(log_softmax_p))
sharding.set(log_softmax_p, _axis_sharding)
# d log_softmax = t - sum(softmax * t)
defjvp(log_softmax_p, lambda t, y, x, *, axis: sub(
    t, reduce_sum(mul(exp(y), t), axis, keepdims=True)))
unsupported(log_softmax_p, "transpose", "not linear")


def softmax(x: Float[Array, "*shape"], axis: int = -1) -> Float[Array, "*shape"]:
    return softmax_p.bind(x, axis=_norm_axis(axis, typeof(x).ndim))


def log_softmax(x: Float[Array, "*shape"], axis: int = -1) -> Float[Array, "*shape"]:
    return log_softmax_p.bind(x, axis=_norm_axis(axis, typeof(x).ndim))


# ---------------------------------------------------------------------------
# Composites
# ---------------------------------------------------------------------------


def logsumexp(x: Float[Array, "..."], axis: int = -1,
              keepdims: bool = False) -> Float[Array, "..."]:
    from fshard.primitives.elementwise import add
    from fshard.primitives.structural import stop_gradient

    m = stop_gradient(reduce_max(x, axis, keepdims=True))
    out = add(log(reduce_sum(exp(sub(x, m)), axis, keepdims=True)), m)
    return out if keepdims else reshape(out, tuple(
        d for i, d in enumerate(typeof(out).shape) if i != _norm_axis(axis, typeof(x).ndim)))


def layer_norm(x: Float[Array, "..."], gamma=None, beta=None, axis: int = -1,
               eps: float = 1e-5) -> Float[Array, "..."]:
    """Layer normalisation over the trailing axes from ``axis`` on (as ``nn.LayerNorm``'s
    ``begin_norm_axis``); ``gamma``/``beta`` have the normalised shape."""
    from fshard.primitives.elementwise import add

    nd = typeof(x).ndim
    axis = _norm_axis(axis, nd)
    axes = tuple(range(axis, nd))
    mu = mean(x, axes, keepdims=True)
    xc = sub(x, mu)
    var = mean(mul(xc, xc), axes, keepdims=True)
    y = mul(xc, rsqrt(add(var, eps)))
    if gamma is not None:
        y = mul(y, gamma)
    if beta is not None:
        y = add(y, beta)
    return y


def softmax_cross_entropy(logits: Float[Array, "n c"], labels: Shaped[Array, "n ..."],
                          reduction: str = "mean") -> Float[Array, "..."]:
    """Cross-entropy of ``logits`` (N, C) against integer class ``labels`` (N,) or
    one-hot/probability ``labels`` (N, C)."""
    from fshard.primitives.elementwise import neg

    logp = log_softmax(logits, -1)
    la, lg = typeof(labels), typeof(logits)
    if la.ndim == lg.ndim - 1:
        from fshard.primitives.structural import one_hot

        labels = one_hot(labels, lg.shape[-1], dtype=lg.dtype)
    elif tuple(la.shape) != tuple(lg.shape):
        raise ShapeError(
            f"softmax_cross_entropy: labels {la} must be class indices of shape "
            f"{tuple(lg.shape[:-1])} or probabilities of shape {tuple(lg.shape)}.")
    per_example = neg(reduce_sum(mul(labels, logp), -1))
    if reduction == "mean":
        return mean(per_example)
    if reduction == "sum":
        return reduce_sum(per_example)
    if reduction == "none":
        return per_example
    raise ProgramTypeError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


