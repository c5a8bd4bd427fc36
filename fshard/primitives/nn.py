"""Neural-network primitives: bias_add, softmax, log_softmax, training-mode batch norm
on MindSpore's fused kernels (batch_norm_train, batch_norm_tangent, batch_norm_grad);
and composites built from primitives: layer_norm, softmax_cross_entropy, logsumexp.

Composites need no rules of their own: their IR is made of primitives.
"""

from __future__ import annotations

import numpy as np
from mindspore import ops

from fshard.backend.mindspore import as_tensor, batch_norm_grad_class, softmax_kernel
from fshard.core import dtypes
from fshard.core.array_types import Array, Float, Shaped
from fshard.core.interpret import bind_equation, walk
from fshard.core.ir import Equation, Literal, Program
from fshard.core.staging import stage
from fshard.core.tracing import ArrayType, typeof
from fshard.errors import ProgramTypeError, ShapeError
from fshard.primitives.base import (Zero, batch_size, batch_to_front, def_primitive, defjvp,
                                    deflinear, full, instantiate, is_undefined, move_axis)
from fshard.primitives.elementwise import exp, log, mul, rsqrt, sub
from fshard.primitives.reductions import mean, reduce_max, reduce_sum
from fshard.primitives.structural import _norm_axis, broadcast_to, reshape
from fshard.primitives.structural import stop_gradient as _stop_gradient
from fshard.core.rules import batching, jvp, sharding, transpose, unsupported
from fshard.core.factors import FactorSpec

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
    # the kernel ops.softmax calls, without its Python argument checks, which MindSpore's
    # graph compiler would interpret at each call site (~8 ms each, measured)
    return _SOFTMAX(x, axis)


_SOFTMAX = softmax_kernel()


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




# ---------------------------------------------------------------------------
# Normalisation layers over the channel axis 1 (MindSpore's NCHW layout): batch,
# group and RMS norm. Composites: their statistics are reductions, so under fs.shard
# a split batch (or spatial) dimension leaves the sums pending and the partitioner
# all-reduces them (SyncBatchNorm's statistics), and a split channel needs nothing.
# ---------------------------------------------------------------------------


def _channel_shaped(v, nd: int):
    """A (C,) per-channel vector as (1, C, 1, ...) to broadcast against (N, C, ...)."""
    c = typeof(v).shape[0]
    return reshape(v, (1, c) + (1,) * (nd - 2))


def _check_channels(what: str, x, params: dict) -> int:
    a = typeof(x)
    if a.ndim < 2:
        raise ShapeError(f"{what}(x=...) needs an input of shape (N, C, ...), got {a}.\n"
                         "Fix: add the batch dimension, e.g. x[None].")
    c = a.shape[1]
    for name, v in params.items():
        if v is not None and tuple(typeof(v).shape) != (c,):
            raise ShapeError(f"{what}({name}=...) must have shape ({c},) (one entry per "
                             f"channel of x: {a}), got {typeof(v)}.")
    return c


def _affine(y, weight, bias, nd: int):
    from fshard.primitives.elementwise import add

    if weight is not None:
        y = mul(y, _channel_shaped(weight, nd))
    if bias is not None:
        y = add(y, _channel_shaped(bias, nd))
    return y


# ---------------------------------------------------------------------------
# Training-mode batch norm as MindSpore's fused kernels. Three primitives over (N, C,
# H, W) arrays and per-channel (C,) vectors, with ``eps`` as a parameter:
#
# - ``batch_norm_train(x, scale, bias) -> (y, batch_mean, batch_var)``: MindSpore's
#   BatchNorm (is_training=True), the statistics with the biased variance;
# - ``batch_norm_tangent(x, scale, mean, var, tx, tscale, tbias) -> ty``: y's tangent
#   (its JVP), linear in the last three operands, transposed by
# - ``batch_norm_grad(x, scale, mean, var, ct) -> (dx, dscale, dbias)``: MindSpore's
#   BatchNormGrad from the saved statistics, linear in ``ct``, transposed by the tangent.
#
# So reverse mode runs one BatchNorm and one BatchNormGrad kernel per layer, as
# MindSpore does. ``mean``/``var`` are always ``x``'s batch statistics (only these rules
# make the equations), so a derivative in ``x`` accounts for them: the JVPs of the
# tangent and of the gradient (second order) are those of their decompositions into
# reductions and elementwise ops (``_DECOMPOSE``), which recompute the statistics from
# ``x``. Batching folds the mapped axis into the channels (each example its own
# statistics). Under ``fs.shard`` a plan expands the three into those decompositions
# before propagation (``decompose_batch_norm``): a split batch then all-reduces the
# statistics' sums (SyncBatchNorm). Their own sharding rules split the channels only.
# MindSpore's CPU kernels are float32: other dtypes run the same formulas in MindSpore
# ops.
# ---------------------------------------------------------------------------

_BatchNormGrad = batch_norm_grad_class()
_BN_AXES = (0, 2, 3)


def _ms_chan(v):
    return ops.reshape(v, (1, v.shape[0], 1, 1))


def _ms_project(u, xh, r):
    """``r * (u - mean(u) - xh * mean(u * xh))`` per channel: the normalisation's
    derivative (self-adjoint)."""
    return r * (u - ops.mean(u, _BN_AXES, True) - xh * ops.mean(u * xh, _BN_AXES, True))


def _ms_bn_train_exact(x, scale, bias, eps):
    mean = ops.mean(x, _BN_AXES)
    xc = x - _ms_chan(mean)
    var = ops.mean(xc * xc, _BN_AXES)
    y = xc * ops.rsqrt(_ms_chan(var) + eps) * _ms_chan(scale) + _ms_chan(bias)
    return y, mean, var


def _ms_bn_train_with(bn, x, scale, bias):
    # MindSpore's kernel also writes the moving statistics into its 4th and 5th
    # operands: scratch tensors here (fshard computes the moving statistics itself).
    # ZerosLike/OnesLike, not ops.zeros/ops.ones: those are Python that the graph
    # compiler interprets at each call site (~15 ms each, measured).
    out = bn(x, scale, bias, _ZEROS_LIKE(scale), _ONES_LIKE(scale))
    return out[0], out[3], out[4]


_ZEROS_LIKE, _ONES_LIKE = ops.ZerosLike(), ops.OnesLike()


def _ms_bn_tangent(x, scale, mean, var, tx, tscale, tbias, eps):
    r = ops.rsqrt(_ms_chan(var) + eps)
    xh = (x - _ms_chan(mean)) * r
    return _ms_chan(scale) * _ms_project(tx, xh, r) + _ms_chan(tscale) * xh + _ms_chan(tbias)


def _ms_bn_grad_exact(x, scale, mean, var, ct, eps):
    r = ops.rsqrt(_ms_chan(var) + eps)
    xh = (x - _ms_chan(mean)) * r
    return (_ms_chan(scale) * _ms_project(ct, xh, r), ops.sum(ct * xh, _BN_AXES),
            ops.sum(ct, _BN_AXES))


def _ms_bn_grad_with(bn_grad, x, scale, mean, var, ct):
    out = bn_grad(ct, x, scale, mean, var, var)
    return out[0], out[1], out[2]


def _bn_by_dtype(fused, exact, kernel):
    """float32 runs MindSpore's fused kernel (``fused(kernel(eps), *xs)`` lowered, with
    the kernel built at lowering time: ``LoweringContext.kernel``); other dtypes the
    exact form."""
    def impl(*xs, eps):
        xs = [as_tensor(x) for x in xs]
        if dtypes.canonical(xs[0].dtype) != dtypes.float32:
            return list(exact(*xs, eps=eps))
        return list(fused(kernel(eps), *xs))

    def lower(ctx, *xs, eps):
        if ctx.in_avals[0].dtype != dtypes.float32:
            return ctx.call(exact, *xs, eps=eps)
        return ctx.call(fused, ctx.kernel(kernel, eps), *xs)

    return impl, lower


def _bn_kernel(eps):
    return ops.BatchNorm(is_training=True, epsilon=eps)


def _bn_grad_kernel(eps):
    return _BatchNormGrad(is_training=True, epsilon=eps)


def _bn_check(name, images, vectors):
    x = images[0]
    if x.ndim != 4 or not dtypes.is_float(x.dtype):
        raise ProgramTypeError(f"{name} needs a float (N, C, H, W) operand, got {x}")
    for a in images:
        if tuple(a.shape) != tuple(x.shape) or a.dtype != x.dtype:
            raise ProgramTypeError(f"{name} needs operands of one type, got {x} and {a}")
    for a in vectors:
        if tuple(a.shape) != (x.shape[1],) or a.dtype != x.dtype:
            raise ProgramTypeError(f"{name} needs per-channel operands of shape "
                                   f"({x.shape[1]},) and dtype {x.dtype}, got {a}")
    return x, ArrayType((x.shape[1],), x.dtype)


def _bn_train_type(x, scale, bias, *, eps):
    x, c = _bn_check("batch_norm_train", [x], [scale, bias])
    return [x, c, c]


def _bn_tangent_type(x, scale, mean, var, tx, tscale, tbias, *, eps):
    return _bn_check("batch_norm_tangent", [x, tx], [scale, mean, var, tscale, tbias])[0]


def _bn_grad_type(x, scale, mean, var, ct, *, eps):
    x, c = _bn_check("batch_norm_grad", [x, ct], [scale, mean, var])
    return [x, c, c]


_impl, _lower = _bn_by_dtype(_ms_bn_train_with, _ms_bn_train_exact, _bn_kernel)
batch_norm_train_p = def_primitive("batch_norm_train", FAMILY, _bn_train_type,
                                   eager=_impl, lower=_lower, multiple_results=True)
batch_norm_tangent_p = def_primitive("batch_norm_tangent", FAMILY, _bn_tangent_type,
                                     _ms_bn_tangent)
_impl, _lower = _bn_by_dtype(_ms_bn_grad_with, _ms_bn_grad_exact, _bn_grad_kernel)
batch_norm_grad_p = def_primitive("batch_norm_grad", FAMILY, _bn_grad_type, eager=_impl,
                                  lower=_lower, multiple_results=True)

# Which operands are images (N, C, H, W): the others are per-channel vectors.
_BN_IMAGES = {batch_norm_train_p: (0,), batch_norm_tangent_p: (0, 4),
              batch_norm_grad_p: (0, 4)}


# -- the decompositions (fshard ops): second-order derivatives and fs.shard -------------


def _stats(x):
    """Batch mean and biased variance of (N, C, H, W) ``x``, as (1, C, 1, 1), and its
    normalised form; differentiable in ``x``."""
    from fshard.primitives.elementwise import add

    mu = mean(x, _BN_AXES, keepdims=True)
    xc = sub(x, mu)
    var = mean(mul(xc, xc), _BN_AXES, keepdims=True)
    return mu, var, xc, lambda eps: rsqrt(add(var, float(eps)))


def _project(u, xh, r):
    return mul(r, sub(sub(u, mean(u, _BN_AXES, keepdims=True)),
                      mul(xh, mean(mul(u, xh), _BN_AXES, keepdims=True))))


def _decompose_train(x, scale, bias, *, eps):
    mu, var, xc, rstd = _stats(x)
    c = typeof(x).shape[1]
    return [_affine(mul(xc, rstd(eps)), scale, bias, 4), reshape(mu, (c,)),
            reshape(var, (c,))]


def _decompose_tangent(x, scale, mean_, var_, tx, tscale, tbias, *, eps):
    from fshard.primitives.elementwise import add

    _, _, xc, rstd = _stats(x)
    r = rstd(eps)
    xh = mul(xc, r)
    out = mul(_channel_shaped(scale, 4), _project(tx, xh, r))
    return [add(add(out, mul(_channel_shaped(tscale, 4), xh)), _channel_shaped(tbias, 4))]


def _decompose_grad(x, scale, mean_, var_, ct, *, eps):
    _, _, xc, rstd = _stats(x)
    r = rstd(eps)
    xh = mul(xc, r)
    return [mul(_channel_shaped(scale, 4), _project(ct, xh, r)),
            reduce_sum(mul(ct, xh), _BN_AXES), reduce_sum(ct, _BN_AXES)]


_DECOMPOSE = {batch_norm_train_p: _decompose_train, batch_norm_tangent_p: _decompose_tangent,
              batch_norm_grad_p: _decompose_grad}


def _decomposition_jvp(prim):
    """The JVP of ``prim``'s decomposition (the statistics recomputed from ``x``, so
    the tangents of the ``mean``/``var`` operands are not read)."""
    def rule(primals, tangents, **params):
        program, consts = stage(lambda *xs: _DECOMPOSE[prim](*xs, **params),
                                [typeof(p) for p in primals])
        tangents = list(tangents)
        for i in (2, 3):  # mean, var: functions of x
            tangents[i] = Zero(typeof(primals[i]))

        def eq_rule(eq, pairs):
            ps, ts = zip(*pairs) if pairs else ((), ())
            if all(isinstance(t, Zero) for t in ts):
                return [(o, Zero(v.aval)) for o, v in zip(bind_equation(eq, ps), eq.outputs)]
            outs, touts = jvp.lookup(eq.prim, transform="differentiation (jvp/grad)")(
                list(ps), list(ts), **eq.params)
            return list(zip(outs, touts))

        args = [(c, Zero(typeof(c))) for c in consts] + list(zip(primals, tangents))
        res = walk(program, args, eq_rule, "differentiating",
                   literal=lambda a: (a.value, Zero(a.aval)))
        # the primal outputs from the primitive itself (one fused kernel)
        outs = prim.bind(*primals, **params)
        # a tangent that does not depend on the given ones is zeros, not symbolic
        return (list(outs) if prim.multiple_results else [outs],
                [instantiate(t) for _, t in res])

    return rule


def decompose_batch_norm(program):
    """``program`` with every fused batch-norm equation replaced by its decomposition
    into reductions and elementwise ops (``fs.shard`` plans: a split batch then
    all-reduces the statistics' sums). Equations inside sub-programs are left fused:
    their sharding rules split the channels only, which is correct, if slower."""
    if not any(eq.prim in _DECOMPOSE for eq in program.equations):
        return program
    alias: dict = {}

    def read(a):
        return a if isinstance(a, Literal) else alias.get(a, a)

    equations = []
    for eq in program.equations:
        ins = [read(a) for a in eq.inputs]
        if eq.prim not in _DECOMPOSE:
            equations.append(Equation(eq.prim, ins, eq.params, eq.outputs, eq.source))
            continue
        sub_prog, consts = stage(lambda *xs, eq=eq: _DECOMPOSE[eq.prim](*xs, **eq.params),
                                 [a.aval for a in eq.inputs])
        if consts:  # not expected (its constants are scalars): keep it fused
            equations.append(Equation(eq.prim, ins, eq.params, eq.outputs, eq.source))
            continue
        inner = dict(zip(sub_prog.inputs, ins))
        for se in sub_prog.equations:
            equations.append(Equation(se.prim, [inner.get(a, a) if not isinstance(
                a, Literal) else a for a in se.inputs], se.params, se.outputs, eq.source))
        for o, so in zip(eq.outputs, sub_prog.outputs):
            alias[o] = so if isinstance(so, Literal) else inner.get(so, so)
    outputs = [read(a) for a in program.outputs]
    return Program(program.inputs, equations, outputs, program.n_consts, program.meta)


# -- differentiation ---------------------------------------------------------------


def _bn_train_jvp(primals, tangents, *, eps):
    x, scale, bias = primals
    outs = batch_norm_train_p.bind(x, scale, bias, eps=eps)
    zeros = [Zero(typeof(o)) for o in outs]
    if all(isinstance(t, Zero) for t in tangents):
        return outs, zeros
    ts = [instantiate(t) for t in tangents]
    ty = batch_norm_tangent_p.bind(x, scale, outs[1], outs[2], *ts, eps=eps)
    if isinstance(tangents[0], Zero):  # the statistics do not depend on scale, bias
        return outs, [ty] + [instantiate(z) for z in zeros[1:]]
    # the statistics' own tangents (batch_norm_parts stops their gradient, so reverse
    # mode drops these)
    tx = tangents[0]
    t_mean = mean(tx, _BN_AXES)
    t_var = mul(mean(mul(sub(x, _channel_shaped(outs[1], 4)), tx), _BN_AXES), 2.0)
    return outs, [ty, t_mean, t_var]


def _bn_tangent_transpose(ct, x, scale, mean_, var_, tx, tscale, tbias, *, eps):
    if isinstance(ct, Zero):
        return [None] * 7
    dx, ds, db = batch_norm_grad_p.bind(x, scale, mean_, var_, ct, eps=eps)
    return [None] * 4 + [c if is_undefined(t) else None
                         for c, t in zip((dx, ds, db), (tx, tscale, tbias))]


def _bn_grad_transpose(cts, x, scale, mean_, var_, ct, *, eps):
    if all(isinstance(c, Zero) for c in cts) or not is_undefined(ct):
        return [None] * 5
    cts = [instantiate(c) for c in cts]
    return [None] * 4 + [batch_norm_tangent_p.bind(x, scale, mean_, var_, *cts, eps=eps)]


jvp.set(batch_norm_train_p, _bn_train_jvp)
unsupported(batch_norm_train_p, "transpose", "not linear")
jvp.set(batch_norm_tangent_p, _decomposition_jvp(batch_norm_tangent_p))
transpose.set(batch_norm_tangent_p, _bn_tangent_transpose)
jvp.set(batch_norm_grad_p, _decomposition_jvp(batch_norm_grad_p))
transpose.set(batch_norm_grad_p, _bn_grad_transpose)


# -- batching: the mapped axis folds into the channels --------------------------------


def _bn_batching(prim):
    images = _BN_IMAGES[prim]

    def rule(args, dims, **params):
        size = batch_size(args, dims)
        folded = []
        for i, (v, d) in enumerate(zip(args, dims)):
            v = batch_to_front(v, d, size)
            s = tuple(typeof(v).shape)
            if i in images:  # (B, N, C, H, W) -> (N, B*C, H, W)
                v = reshape(move_axis(v, 0, 1), (s[1], s[0] * s[2]) + s[3:])
            else:  # (B, C) -> (B*C,)
                v = reshape(v, (s[0] * s[1],))
            folded.append(v)
        outs = prim.bind(*folded, **params)
        outs = outs if prim.multiple_results else [outs]
        res, out_dims = [], []
        for o in outs:
            s = tuple(typeof(o).shape)
            if len(s) == 4:
                res.append(reshape(o, (s[0], size, s[1] // size) + s[2:]))
                out_dims.append(1)
            else:
                res.append(reshape(o, (size, s[0] // size)))
                out_dims.append(0)
        return res, out_dims

    return rule


# -- sharding: the channels split; a batch or spatial split needs the decomposition ----


def _bn_sharding(prim):
    images = _BN_IMAGES[prim]

    def rule(*avals, **params):
        img, vec = ("n", "c", "h", "w"), ("c",)
        outs = [img, vec, vec] if prim.multiple_results else [img]
        x = avals[0]
        return FactorSpec([img if i in images else vec for i in range(len(avals))],
                          outs, dict(zip(img, x.shape)), nosplit=frozenset("nhw"),
                          flops_per_point=10.0)

    return rule


for _prim in _DECOMPOSE:
    batching.set(_prim, _bn_batching(_prim))
    sharding.set(_prim, _bn_sharding(_prim))


def _fused_batch_norm(x, scale, bias, eps):
    """Training-mode ``(y, batch_mean, batch_var)`` from the fused primitive (the
    statistics without gradient, as the decomposition's), or None where it does not
    apply (not float32, a scale or bias of another dtype, symbolic shapes)."""
    a = typeof(x)
    if a.dtype != dtypes.float32 or not a.is_static or not 2 <= a.ndim <= 4 or any(
            v is not None and typeof(v).dtype != a.dtype for v in (scale, bias)):
        return None
    c = a.shape[1]
    scale = full((c,), 1.0, a.dtype) if scale is None else scale
    bias = full((c,), 0.0, a.dtype) if bias is None else bias
    x4 = reshape(x, tuple(a.shape) + (1,) * (4 - a.ndim))
    y, m, v = batch_norm_train_p.bind(x4, scale, bias, eps=float(eps))
    return reshape(y, tuple(a.shape)), _stop_gradient(m), _stop_gradient(v)


def batch_norm(x: Float[Array, "n c *spatial"], running_mean: Float[Array, "c"],
               running_var: Float[Array, "c"], weight=None, bias=None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> tuple:
    """Batch normalisation over axis 1 of ``x`` (N, C, ...), as ``mindspore.ops.batch_norm``.

    Returns ``(y, new_running_mean, new_running_var)``. In training mode ``y`` uses the
    batch's statistics (mean and biased variance over every axis but 1) and the
    running statistics move towards them: ``new = (1 - momentum) * running + momentum *
    batch``, with the unbiased batch variance (MindSpore's convention; ``nn.BatchNorm2d``'s
    ``momentum=0.9`` is ``1 - momentum`` here). In inference mode ``y`` uses the running
    statistics, which are returned unchanged. The new statistics carry no gradient.

    >>> import numpy as np, fshard as fs
    >>> x = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> y, m, v = fs.ops.batch_norm(x, np.zeros(2, np.float32), np.ones(2, np.float32),
    ...                             training=True)
    >>> print(m.asnumpy(), v.asnumpy())
    [0.3 0.4] [1.5666666 1.5666666]
    """
    return batch_norm_parts(x, running_mean, running_var, weight, bias, training, momentum,
                            eps)[:3]


def batch_norm_parts(x, running_mean, running_var, weight=None, bias=None,
                     training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> tuple:
    """``batch_norm``'s ``(y, new_mean, new_var, batch_mean, batch_var)``: the batch's own
    mean and biased variance too (MindSpore's BatchNorm returns them), from the same
    equations as ``y`` (in inference mode: the running statistics)."""
    from fshard.primitives.elementwise import add
    from fshard.primitives.structural import stop_gradient

    c = _check_channels("batch_norm", x, {"running_mean": running_mean,
                                          "running_var": running_var, "weight": weight,
                                          "bias": bias})
    a = typeof(x)
    nd = a.ndim
    if not training:
        scale = rsqrt(add(running_var, float(eps)))
        y = mul(sub(x, _channel_shaped(running_mean, nd)), _channel_shaped(scale, nd))
        return (_affine(y, weight, bias, nd), running_mean, running_var, running_mean,
                running_var)
    axes = (0,) + tuple(range(2, nd))
    n = 1
    for i in axes:
        n *= a.shape[i]
    fused = _fused_batch_norm(x, weight, bias, eps)
    if fused is not None:  # MindSpore's BatchNorm and BatchNormGrad kernels
        y, batch_mean, batch_var = fused
    else:
        mu = mean(x, axes, keepdims=True)
        xc = sub(x, mu)
        var = mean(mul(xc, xc), axes, keepdims=True)
        y = _affine(mul(xc, rsqrt(add(var, float(eps)))), weight, bias, nd)
        batch_mean = stop_gradient(reshape(mu, (c,)))
        batch_var = stop_gradient(reshape(var, (c,)))
    m = float(momentum)
    unbiased = mul(batch_var, n / (n - 1)) if n > 1 else batch_var
    new_mean = add(mul(stop_gradient(running_mean), 1.0 - m), mul(batch_mean, m))
    new_var = add(mul(stop_gradient(running_var), 1.0 - m), mul(unbiased, m))
    return y, new_mean, new_var, batch_mean, batch_var


def group_norm(x: Float[Array, "n c *spatial"], num_groups: int, weight=None, bias=None,
               eps: float = 1e-5) -> Float[Array, "n c *spatial"]:
    """Group normalisation (``mindspore.ops.group_norm``): the C channels of each example
    fall into ``num_groups`` groups, each normalised by its own mean and biased variance;
    ``weight``/``bias`` are per channel.

    >>> import numpy as np, fshard as fs
    >>> x = np.arange(8, dtype=np.float32).reshape(1, 4, 2)
    >>> print(fs.ops.group_norm(x, 2).asnumpy().round(3)[0, 0])
    [-1.342 -0.447]
    """
    return group_norm_parts(x, num_groups, weight, bias, eps)[0]


def group_norm_parts(x, num_groups: int, weight=None, bias=None, eps: float = 1e-5) -> tuple:
    """``group_norm``'s ``(y, mean, rstd)``, the statistics of shape (N, num_groups) from
    the same equations as ``y`` (MindSpore's GroupNorm returns them)."""
    from fshard.primitives.elementwise import add
    from fshard.primitives.structural import stop_gradient

    c = _check_channels("group_norm", x, {"weight": weight, "bias": bias})
    if not isinstance(num_groups, int) or num_groups < 1 or c % num_groups:
        raise ShapeError(f"group_norm(num_groups={num_groups!r}): the {c} channels of x "
                         f"({typeof(x)}) must split into num_groups equal groups.\nFix: "
                         "pass a positive divisor of the channel count.")
    a = typeof(x)
    s = tuple(a.shape)
    g = reshape(x, (s[0], num_groups, c // num_groups) + s[2:])
    axes = tuple(range(2, len(s) + 1))
    mu = mean(g, axes, keepdims=True)
    gc = sub(g, mu)
    var = mean(mul(gc, gc), axes, keepdims=True)
    rstd = rsqrt(add(var, float(eps)))
    y = reshape(mul(gc, rstd), s)
    stat = (s[0], num_groups)
    return (_affine(y, weight, bias, a.ndim), stop_gradient(reshape(mu, stat)),
            stop_gradient(reshape(rstd, stat)))


def rms_norm(x: Float[Array, "..."], weight=None, axis: int = -1,
             eps: float = 1e-6) -> Float[Array, "..."]:
    """Root-mean-square normalisation over the trailing axes from ``axis`` on:
    ``x * rsqrt(mean(x**2) + eps) * weight`` (``mindspore.ops.rms_norm``'s first output;
    ``weight`` has the normalised shape).

    >>> import numpy as np, fshard as fs
    >>> print(fs.ops.rms_norm(np.array([3.0, 4.0], np.float32), eps=0.0).asnumpy())
    [0.84852815 1.1313709 ]
    """
    from fshard.primitives.elementwise import add

    nd = typeof(x).ndim
    axes = tuple(range(_norm_axis(axis, nd), nd))
    y = mul(x, rsqrt(add(mean(mul(x, x), axes, keepdims=True), float(eps))))
    return y if weight is None else mul(y, weight)


# ---------------------------------------------------------------------------
# interpolate: resizing the spatial axes (2 on) of (N, C, ...). Separable: each axis is
# a gather of static indices (nearest) or of two neighbours blended with static weights
# (linear), so batching, derivatives (gather's transpose is scatter_add) and sharding
# (over N and C) are those of gather, mul and add.
# ---------------------------------------------------------------------------

#: How a destination index maps to a source coordinate: MindSpore's ResizeNearestNeighborV2
#: and ResizeBilinearV2 attributes (align_corners, half_pixel_centers) and the mint
#: (PyTorch) convention, which is half_pixel for linear and asymmetric for nearest.
_COORDS = ("asymmetric", "half_pixel", "align_corners")


def _source_coords(n_in: int, n_out: int, coords: str, ratio) -> np.ndarray:
    d = np.arange(n_out, dtype=np.float64)
    if coords == "align_corners":
        return d * ((n_in - 1) / (n_out - 1) if n_out > 1 else 0.0)
    r = n_in / n_out if ratio is None else ratio
    return (d + 0.5) * r - 0.5 if coords == "half_pixel" else d * r


def _resize_axis(x, axis: int, n_out: int, mode: str, coords: str, ratio=None):
    from fshard.primitives.elementwise import add
    from fshard.primitives.structural import gather

    n_in = typeof(x).shape[axis]
    if n_in == n_out and ratio in (None, 1.0):
        return x
    src = _source_coords(n_in, n_out, coords, ratio)
    if mode == "nearest":
        if coords == "align_corners":
            idx = np.round(src)
        elif coords == "half_pixel":  # ResizeNearestNeighborV2(half_pixel_centers=True)
            idx = np.floor(src + 0.5)
        else:
            idx = np.floor(src)
        idx = np.clip(idx, 0, n_in - 1).astype(np.int32)
        return gather(x, idx, axis)
    src = np.clip(src, 0.0, n_in - 1)
    i0 = np.floor(src).astype(np.int32)
    i1 = np.minimum(i0 + 1, n_in - 1).astype(np.int32)
    w1 = (src - i0).astype(dtypes.to_numpy(typeof(x).dtype))
    shape = [1] * typeof(x).ndim
    shape[axis] = n_out
    w1 = w1.reshape(shape)
    return add(mul(gather(x, i0, axis), 1 - w1), mul(gather(x, i1, axis), w1))


def interpolate(x: Float[Array, "n c *spatial"], size, mode: str = "nearest",
                coords: str | None = None, ratios=None) -> Float[Array, "n c *out"]:
    """Resize the spatial axes (2 on) of ``x`` to ``size`` (one entry per spatial axis).

    ``mode`` is ``"nearest"`` or ``"linear"`` (``"bilinear"``, ``"trilinear"``: linear
    along each axis). ``coords`` maps a destination index to a source coordinate:
    ``"asymmetric"`` (``dst * in / out``; the default for nearest, as
    ``mindspore.ops.interpolate``), ``"half_pixel"`` (``(dst + 0.5) * in / out - 0.5``;
    the default for linear) or ``"align_corners"``. ``ratios`` overrides ``in / out`` per
    axis (a given ``scale_factor`` is ``1 / scale_factor``).

    >>> import numpy as np, fshard as fs
    >>> x = np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)
    >>> print(fs.ops.interpolate(x, (3, 3), "linear", "align_corners").asnumpy()[0, 0])
    [[0.  0.5 1. ]
     [1.  1.5 2. ]
     [2.  2.5 3. ]]
    """
    a = typeof(x)
    size = (size,) * (a.ndim - 2) if isinstance(size, int) else tuple(int(s) for s in size)
    linear = {"nearest": False, "linear": True, "bilinear": True, "trilinear": True}.get(mode)
    if linear is None:
        raise ProgramTypeError(f"interpolate(mode={mode!r}): fshard computes 'nearest' and "
                               "'linear'/'bilinear'/'trilinear'.\nFix: use one of them (other "
                               "modes of mindspore.ops.interpolate take the generic path).")
    coords = coords or ("half_pixel" if linear else "asymmetric")
    if coords not in _COORDS:
        raise ProgramTypeError(f"interpolate(coords={coords!r}) must be one of {_COORDS}.")
    if a.ndim < 3 or len(size) != a.ndim - 2 or any(s < 1 for s in size):
        raise ShapeError(f"interpolate(size={size}): x ({a}) needs one positive output size "
                         "per spatial axis (its axes 2 on).")
    ratios = (None,) * len(size) if ratios is None else tuple(ratios)
    for i, (n, r) in enumerate(zip(size, ratios)):
        x = _resize_axis(x, i + 2, n, "linear" if linear else "nearest", coords, r)
    return x


def scaled_dot_product_attention(query: Float[Array, "*b l d"], key: Float[Array, "*b s d"],
                                 value: Float[Array, "*b s e"], attn_mask=None,
                                 is_causal: bool = False,
                                 scale: float | None = None) -> Float[Array, "*b l e"]:
    """``softmax(query @ key^T * scale + mask) @ value`` over the leading (batch, head)
    axes; ``scale`` defaults to ``1/sqrt(d)``. ``attn_mask`` is boolean (True: attend) or
    added to the scores; ``is_causal`` masks the keys after each query.

    Every equation keeps the leading axes, so under ``fs.shard`` a split of the head axis
    (Megatron's attention) needs no communication inside attention.

    >>> import numpy as np, fshard as fs
    >>> q = np.ones((1, 2, 4), np.float32)
    >>> v = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    >>> print(fs.ops.scaled_dot_product_attention(q, q, v, is_causal=True).asnumpy()[0])
    [[0. 1. 2. 3.]
     [2. 3. 4. 5.]]
    """
    from fshard.primitives.elementwise import add, where
    from fshard.primitives.linalg import matmul

    qa, ka = typeof(query), typeof(key)
    if qa.ndim < 2 or ka.ndim != qa.ndim or typeof(value).ndim != qa.ndim or \
            qa.shape[-1] != ka.shape[-1] or ka.shape[-2] != typeof(value).shape[-2]:
        raise ShapeError(
            f"scaled_dot_product_attention(query={qa}, key={ka}, value={typeof(value)}): "
            "needs (..., L, D) queries, (..., S, D) keys and (..., S, E) values of one rank.")
    d = qa.shape[-1]
    s = matmul(query, key, transpose_b=True)
    s = mul(s, float(1.0 / np.sqrt(d) if scale is None else scale))
    if is_causal:
        L, S = qa.shape[-2], ka.shape[-2]
        keep = np.tril(np.ones((L, S), bool))
        s = where(keep, s, float("-inf"))
    if attn_mask is not None:
        if typeof(attn_mask).dtype == dtypes.bool_:
            s = where(attn_mask, s, float("-inf"))
        else:
            s = add(s, attn_mask)
    return matmul(softmax(s, -1), value)
