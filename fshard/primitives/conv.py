"""Convolutions and pools over the two trailing (spatial) dims of NCHW arrays.

Three bilinear primitives are one closed family: ``conv2d`` (x, w) -> y, its transpose
in x ``conv2d_input_grad`` (ct, w) -> dx (the transposed convolution) and its
transpose in w ``conv2d_filter_grad`` (x, ct) -> dw. Each transposes, in either
operand, into another of the three, so reverse mode of any order stays within them.
They lower to MindSpore's Conv2D, Conv2DBackpropInput and Conv2DBackpropFilter
kernels; MindSpore's CPU kernels have no float64, so float64 runs a patch-wise
(im2col) form of the same sums, written with matmuls.

Parameters are canonical: ``stride`` and ``dilation`` are (h, w) pairs, ``padding``
is ((top, bottom), (left, right)) of explicit zero padding ('same' and 'valid' are
resolved by the op functions), ``groups`` splits the channels into independent
groups (``groups == C``: depthwise).

Batching folds the mapped axis into N when only the activations are mapped, and
into the channel groups when the weights are (one grouped convolution of B * groups
groups): never a loop.

Sharding: the batch (N) and the output channels split with no communication; the
input channels are a summed factor (a split leaves a pending sum, then a psum). With
groups > 1 the groups split instead. A spatial dim splits only where the windows tile
it (kernel == stride, no padding); otherwise it stays whole.

Pools: ``max_pool2d`` (MaxPool on a -inf padded input), ``max_pool2d_argmax`` (the
values and where they came from, MaxPoolWithArgmaxV2: the JVP gathers the tangent
there with ``pool_gather``, whose transpose ``pool_scatter`` adds back, per plane) and
``avg_pool2d`` (the window sums of a zero-padded input over the window size, AvgPool;
linear, transposed by a depthwise ``conv2d_input_grad`` of ones). N and C split.
"""

from __future__ import annotations

import numpy as np
from mindspore import dtype as mstype
from mindspore import ops

from fshard.core import dtypes
from fshard.backend.mindspore import Tensor, conv2d_backprop_filter_class
from fshard.core.array_types import Array, Float, Int
from fshard.core.tracing import ArrayType, typeof
from fshard.errors import ArgumentError, ProgramTypeError, ShapeError
from fshard.core.factors import FactorSpec
from fshard.primitives.base import (
    Zero,
    add_tangents,
    batch_to_front,
    def_primitive,
    deflinear,
    full,
    instantiate,
    is_undefined,
    move_axis,
    reshape,
)
from fshard.primitives.elementwise import add, floor_divide, mul, remainder, sub
from fshard.primitives.nn import bias_add
from fshard.primitives.reductions import mean
from fshard.primitives.structural import concat, pad, slice_array
from fshard.core.rules import batching, jvp, sharding, transpose, unsupported

FAMILY = "conv"

# MindSpore's weight-gradient kernel (a private class, named once here)
Conv2DBackpropFilter = conv2d_backprop_filter_class()

# ---------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------


def conv_out_size(n: int, k: int, s: int, lo: int, hi: int, d: int) -> int:
    """Output length of a convolution/pool along one dim (floor mode)."""
    return (n + lo + hi - d * (k - 1) - 1) // s + 1


def _conv_out_shape(x_shape, w_shape, stride, padding, dilation):
    n, _, h, w = x_shape
    o, _, kh, kw = w_shape
    ho = conv_out_size(h, kh, stride[0], *padding[0], dilation[0])
    wo = conv_out_size(w, kw, stride[1], *padding[1], dilation[1])
    return (n, o, ho, wo)


def _check_float(name, *avals):
    for a in avals:
        if not dtypes.is_float(a.dtype) or a.dtype != avals[0].dtype:
            raise ProgramTypeError(
                f"{name} needs float operands of one dtype, got "
                f"{', '.join(str(v) for v in avals)}")
        if a.ndim != 4:
            raise ProgramTypeError(f"{name} needs rank-4 (NCHW) operands, got {a}")


def _check_conv(name, x_shape, w_shape, stride, padding, dilation, groups):
    """x (N, C, H, W), w (O, C/groups, kh, kw): the output shape, or a ProgramTypeError."""
    c, o, cg = x_shape[1], w_shape[0], w_shape[1]
    if groups < 1 or c % groups or o % groups or cg * groups != c:
        raise ProgramTypeError(
            f"{name}: input of shape {tuple(x_shape)} and weight of shape {tuple(w_shape)} "
            f"do not fit groups={groups} (need C == groups * weight.shape[1] and O "
            "divisible by groups)")
    out = _conv_out_shape(x_shape, w_shape, stride, padding, dilation)
    if out[2] < 1 or out[3] < 1 or min(stride + dilation) < 1 or min(sum(padding, ())) < 0:
        raise ShapeError(
            f"{name}: input {tuple(x_shape)} with kernel {tuple(w_shape[2:])}, stride "
            f"{stride}, padding {padding} and dilation {dilation} gives the empty output "
            f"{out}")
    return out


# ---------------------------------------------------------------------------
# MindSpore implementations: the kernels, and float64's patch-wise form
# ---------------------------------------------------------------------------


def _conv_kernel(w_shape, stride, padding, dilation, groups):
    p = (padding[0][0], padding[0][1], padding[1][0], padding[1][1])
    return ops.Conv2D(w_shape[0], (w_shape[2], w_shape[3]), pad_mode="pad", pad=p,
                      stride=stride, dilation=dilation, group=groups)


def _input_grad_kernel(w_shape, stride, padding, dilation, groups):
    p = (padding[0][0], padding[0][1], padding[1][0], padding[1][1])
    return ops.Conv2DBackpropInput(w_shape[0], (w_shape[2], w_shape[3]), pad_mode="pad",
                                   pad=p, pad_list=p, stride=stride, dilation=dilation,
                                   group=groups)


def _filter_grad_kernel(kernel_shape, stride, padding, dilation, groups):
    p = (padding[0][0], padding[0][1], padding[1][0], padding[1][1])
    return Conv2DBackpropFilter(
        kernel_shape[0], (kernel_shape[2], kernel_shape[3]), pad_mode="pad", pad=p,
        pad_list=p, stride=stride, dilation=dilation, group=groups)


def _ms_conv(x, w, stride, padding, dilation, groups):
    return _conv_kernel(w.shape, stride, padding, dilation, groups)(x, w)


def _ms_conv_input_grad(ct, w, stride, padding, dilation, groups, input_shape):
    return _input_grad_kernel(w.shape, stride, padding, dilation, groups)(ct, w, input_shape)


def _ms_conv_filter_grad(x, ct, stride, padding, dilation, groups, kernel_shape):
    return _filter_grad_kernel(kernel_shape, stride, padding, dilation, groups)(
        ct, x, kernel_shape)


def _patch(xp, i, j, ho, wo, stride, dilation):
    """The (N, C, ho, wo) inputs that kernel tap (i, j) meets."""
    h0, w0 = i * dilation[0], j * dilation[1]
    return xp[:, :, h0:h0 + (ho - 1) * stride[0] + 1:stride[0],
              w0:w0 + (wo - 1) * stride[1] + 1:stride[1]]


def _ms_conv_f64(x, w, stride, padding, dilation, groups):
    n = x.shape[0]
    o, cg, kh, kw = w.shape
    xp = ops.pad(x, (padding[1][0], padding[1][1], padding[0][0], padding[0][1]))
    ho = (xp.shape[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (xp.shape[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    wg = ops.reshape(w, (groups, o // groups, cg, kh, kw))
    out = ops.zeros((n, groups, o // groups, ho * wo), x.dtype)
    for i in range(kh):
        for j in range(kw):
            p = ops.reshape(_patch(xp, i, j, ho, wo, stride, dilation), (n, groups, cg, ho * wo))
            out = out + ops.matmul(wg[:, :, :, i, j], p)
    return ops.reshape(out, (n, o, ho, wo))


def _ms_conv_input_grad_f64(ct, w, stride, padding, dilation, groups, input_shape):
    n, c, h, wd = input_shape
    o, cg, kh, kw = w.shape
    ho, wo = ct.shape[2], ct.shape[3]
    hp, wp = h + padding[0][0] + padding[0][1], wd + padding[1][0] + padding[1][1]
    wg = ops.transpose(ops.reshape(w, (groups, o // groups, cg, kh, kw)), (0, 2, 1, 3, 4))
    ctg = ops.reshape(ct, (n, groups, o // groups, ho * wo))
    dxp = ops.zeros((n, c, hp, wp), ct.dtype)
    for i in range(kh):
        for j in range(kw):
            v = ops.reshape(ops.matmul(wg[:, :, :, i, j], ctg), (n, c, ho, 1, wo, 1))
            # spread to every stride-th position, then shift to tap (i, j)'s origin
            v = ops.pad(v, (0, stride[1] - 1, 0, 0, 0, stride[0] - 1))
            v = ops.reshape(v, (n, c, ho * stride[0], wo * stride[1]))
            h0, w0 = i * dilation[0], j * dilation[1]
            v = ops.pad(v, (w0, max(0, wp - w0 - wo * stride[1]),
                            h0, max(0, hp - h0 - ho * stride[0])))
            dxp = dxp + v[:, :, :hp, :wp]
    return dxp[:, :, padding[0][0]:padding[0][0] + h, padding[1][0]:padding[1][0] + wd]


def _ms_conv_filter_grad_f64(x, ct, stride, padding, dilation, groups, kernel_shape):
    n = x.shape[0]
    o, cg, kh, kw = kernel_shape
    ho, wo = ct.shape[2], ct.shape[3]
    xp = ops.pad(x, (padding[1][0], padding[1][1], padding[0][0], padding[0][1]))
    ctg = ops.reshape(ct, (n, groups, o // groups, ho * wo))
    taps = []
    for i in range(kh):
        for j in range(kw):
            p = ops.reshape(_patch(xp, i, j, ho, wo, stride, dilation), (n, groups, cg, ho * wo))
            taps.append(ops.reshape(ops.sum(ops.matmul(ctg, ops.transpose(p, (0, 1, 3, 2))), 0),
                                    (o, cg)))
    return ops.reshape(ops.stack(taps, 2), (o, cg, kh, kw))


def _by_dtype(kernel, exact, lower_kernel=None):
    """The eager implementation and the lowering: MindSpore's kernel, or for float64
    (which its CPU kernels lack) the exact patch-wise form. ``lower_kernel(ctx, *xs,
    **params)``, if given, lowers the kernel's case (with the Primitive built at
    lowering time: ``LoweringContext.kernel``)."""
    def impl(*xs, **params):
        fn = exact if xs[0].dtype == mstype.float64 else kernel
        return fn(*xs, **params)

    def lower(ctx, *xs, **params):
        if ctx.in_avals[0].dtype == dtypes.float64:
            return ctx.call(exact, *xs, **params)
        if lower_kernel is not None and all(a.is_static for a in ctx.in_avals):
            return lower_kernel(ctx, *xs, **params)
        return ctx.call(kernel, *xs, **params)

    return impl, lower


def _lower_conv(ctx, x, w, *, stride, padding, dilation, groups):
    k = ctx.kernel(_conv_kernel, tuple(ctx.in_avals[1].shape), stride, padding, dilation,
                   groups)
    return f"{k}({x}, {w})"


def _lower_input_grad(ctx, ct, w, *, stride, padding, dilation, groups, input_shape):
    k = ctx.kernel(_input_grad_kernel, tuple(ctx.in_avals[1].shape), stride, padding,
                   dilation, groups)
    return f"{k}({ct}, {w}, {ctx.param(tuple(input_shape))})"


def _lower_filter_grad(ctx, x, ct, *, stride, padding, dilation, groups, kernel_shape):
    k = ctx.kernel(_filter_grad_kernel, tuple(kernel_shape), stride, padding, dilation,
                   groups)
    return f"{k}({ct}, {x}, {ctx.param(tuple(kernel_shape))})"


# ---------------------------------------------------------------------------
# The three primitives
# ---------------------------------------------------------------------------


def _conv_type(x, w, *, stride, padding, dilation, groups):
    _check_float("conv2d", x, w)
    return ArrayType(_check_conv("conv2d", x.shape, w.shape, stride, padding, dilation,
                                 groups), x.dtype)


def _input_grad_type(ct, w, *, stride, padding, dilation, groups, input_shape):
    _check_float("conv2d_input_grad", ct, w)
    want = _check_conv("conv2d_input_grad", input_shape, w.shape, stride, padding, dilation,
                       groups)
    if tuple(ct.shape) != want:
        raise ShapeError(f"conv2d_input_grad: the cotangent {ct} does not have the shape "
                         f"{want} of the convolution of an input of shape {input_shape}")
    return ArrayType(tuple(input_shape), ct.dtype)


def _filter_grad_type(x, ct, *, stride, padding, dilation, groups, kernel_shape):
    _check_float("conv2d_filter_grad", x, ct)
    want = _check_conv("conv2d_filter_grad", x.shape, kernel_shape, stride, padding,
                       dilation, groups)
    if tuple(ct.shape) != want:
        raise ShapeError(f"conv2d_filter_grad: the cotangent {ct} does not have the shape "
                         f"{want} of the convolution of {x} with a {kernel_shape} kernel")
    return ArrayType(tuple(kernel_shape), x.dtype)


_impl, _lower = _by_dtype(_ms_conv, _ms_conv_f64, _lower_conv)
conv2d_p = def_primitive("conv2d", FAMILY, _conv_type, _impl, lower=_lower)
_impl, _lower = _by_dtype(_ms_conv_input_grad, _ms_conv_input_grad_f64, _lower_input_grad)
conv2d_input_grad_p = def_primitive("conv2d_input_grad", FAMILY, _input_grad_type, _impl,
                                    lower=_lower)
_impl, _lower = _by_dtype(_ms_conv_filter_grad, _ms_conv_filter_grad_f64,
                          _lower_filter_grad)
conv2d_filter_grad_p = def_primitive("conv2d_filter_grad", FAMILY, _filter_grad_type, _impl,
                                     lower=_lower)


def _conv(x, w, **p):
    return conv2d_p.bind(x, w, **p)


def _input_grad(ct, w, input_shape, **p):
    return conv2d_input_grad_p.bind(ct, w, input_shape=tuple(input_shape), **p)


def _filter_grad(x, ct, kernel_shape, **p):
    return conv2d_filter_grad_p.bind(x, ct, kernel_shape=tuple(kernel_shape), **p)


# -- differentiation: each is bilinear; each transposes into the others ------------


def _bilinear_jvp(prim):
    def rule(primals, tangents, **params):
        a, b = primals
        ans = prim.bind(a, b, **params)
        out = Zero(typeof(ans))
        ta, tb = tangents
        if not isinstance(ta, Zero):
            out = prim.bind(ta, b, **params)
        if not isinstance(tb, Zero):
            t = prim.bind(a, tb, **params)
            out = add_tangents(out, t)
        return [ans], [out]

    return rule


def _conv_transpose(ct, x, w, **p):
    ct = instantiate(ct)
    cx = _input_grad(ct, w, x.aval.shape, **p) if is_undefined(x) else None
    cw = _filter_grad(x, ct, w.aval.shape, **p) if is_undefined(w) else None
    return [cx, cw]


def _input_grad_transpose(ct, c, w, *, input_shape, **p):
    ct = instantiate(ct)
    cc = _conv(ct, w, **p) if is_undefined(c) else None
    cw = _filter_grad(ct, c, w.aval.shape, **p) if is_undefined(w) else None
    return [cc, cw]


def _filter_grad_transpose(ct, x, c, *, kernel_shape, **p):
    ct = instantiate(ct)
    cx = _input_grad(c, ct, x.aval.shape, **p) if is_undefined(x) else None
    cc = _conv(x, ct, **p) if is_undefined(c) else None
    return [cx, cc]


for _prim, _rule in ((conv2d_p, _conv_transpose), (conv2d_input_grad_p, _input_grad_transpose),
                     (conv2d_filter_grad_p, _filter_grad_transpose)):
    jvp.set(_prim, _bilinear_jvp(_prim))
    transpose.set(_prim, _rule)


# -- batching: fold the mapped axis into N, or into the channel groups --------------


def _fold_batch(v, d, size):
    """(B, N, C, ...) -> (N, B*C, ...): example b's channels become groups of their own."""
    v = move_axis(batch_to_front(v, d, size), 0, 1)
    s = typeof(v).shape
    return reshape(v, (s[0], s[1] * s[2]) + tuple(s[3:]))


def _fold_weight(w, d, size):
    """(B, O, C/g, kh, kw) -> (B*O, C/g, kh, kw)."""
    w = batch_to_front(w, d, size)
    s = typeof(w).shape
    return reshape(w, (s[0] * s[1],) + tuple(s[2:]))


def _unfold_channels(y, size):
    """(N, B*C, ...) -> (N, B, C, ...), batch axis 1."""
    s = typeof(y).shape
    return reshape(y, (s[0], size, s[1] // size) + tuple(s[2:]))


def _fold_n(x, d):
    """(B, N, ...) -> (B*N, ...)."""
    x = move_axis(x, d, 0)
    s = typeof(x).shape
    return reshape(x, (s[0] * s[1],) + tuple(s[2:])), s[0]


def _unfold_n(y, size):
    s = typeof(y).shape
    return reshape(y, (size, s[0] // size) + tuple(s[1:]))


def _size(args, dims):
    return next(typeof(a).shape[d] for a, d in zip(args, dims) if d is not None)


def _conv_batching(args, dims, *, groups, **p):
    (x, w), (dx, dw) = args, dims
    if dw is None:
        xf, size = _fold_n(x, dx)
        return [_unfold_n(_conv(xf, w, groups=groups, **p), size)], [0]
    size = _size(args, dims)
    out = _conv(_fold_batch(x, dx, size), _fold_weight(w, dw, size), groups=groups * size, **p)
    return [_unfold_channels(out, size)], [1]


def _input_grad_batching(args, dims, *, groups, input_shape, **p):
    (c, w), (dc, dw) = args, dims
    n, ch = input_shape[0], input_shape[1]
    if dw is None:
        cf, size = _fold_n(c, dc)
        out = _input_grad(cf, w, (size * n,) + tuple(input_shape[1:]), groups=groups, **p)
        return [_unfold_n(out, size)], [0]
    size = _size(args, dims)
    out = _input_grad(_fold_batch(c, dc, size), _fold_weight(w, dw, size),
                      (n, size * ch) + tuple(input_shape[2:]), groups=groups * size, **p)
    return [_unfold_channels(out, size)], [1]


def _filter_grad_batching(args, dims, *, groups, kernel_shape, **p):
    (x, c), (dx, dc) = args, dims
    size = _size(args, dims)
    out = _filter_grad(_fold_batch(x, dx, size), _fold_batch(c, dc, size),
                       (size * kernel_shape[0],) + tuple(kernel_shape[1:]),
                       groups=groups * size, **p)
    return [_unfold_n(out, size)], [0]


batching.set(conv2d_p, _conv_batching)
batching.set(conv2d_input_grad_p, _input_grad_batching)
batching.set(conv2d_filter_grad_p, _filter_grad_batching)


# -- sharding ---------------------------------------------------------------------
#
# Labels: n (batch), o (output channels), c (input channels, summed over), g (groups,
# when groups > 1: a block of channels holds whole groups); spatial dims stay whole.


def _local_params(params, local_in, local_out):
    """The per-device equation's groups (a block of channels holds whole groups: its
    channel count over the weight's channels per group) and shape parameters."""
    out = dict(params)
    if "input_shape" in params:  # conv2d_input_grad (ct, w) -> dx
        out["input_shape"] = tuple(local_out[0].shape)
        out["groups"] = local_out[0].shape[1] // local_in[1].shape[1]
    elif "kernel_shape" in params:  # conv2d_filter_grad (x, ct) -> dw
        out["kernel_shape"] = tuple(local_out[0].shape)
        out["groups"] = local_in[0].shape[1] // local_out[0].shape[1]
    else:  # conv2d (x, w) -> y
        out["groups"] = local_in[0].shape[1] // local_in[1].shape[1]
    return out


def _labels(groups):
    return ("g", "g", None) if groups > 1 else ("c", "o", "c")


def _tiles(n, k, stride, lo, hi, dilation=1):
    """Whether the windows along a dim tile it (kernel == stride, whole windows, no
    padding the windows reach): a block of whole windows then pools or convolves on
    its own."""
    return k == stride and lo == 0 and hi < k and n % k == 0 and (dilation == 1 or k == 1)


def _spatial(x_shape, kernel, stride, padding, dilation=(1, 1)):
    """Labels and sizes (in windows) of the spatial dims that tile, else None."""
    labels, sizes = [], {}
    for d in range(2):
        n = x_shape[2 + d]
        if _tiles(n, kernel[d], stride[d], *padding[d], dilation[d]):
            labels.append(f"s{d}")
            sizes[f"s{d}"] = n // kernel[d]
        else:
            labels.append(None)
    return tuple(labels), sizes


def _conv_sharding(x, w, *, groups, stride, padding, dilation):
    xc, oc, wc = _labels(groups)
    y = _conv_out_shape(x.shape, w.shape, stride, padding, dilation)
    sp, sizes = _spatial(x.shape, w.shape[2:], stride, padding, dilation)
    sizes.update({"n": x.shape[0], "o": w.shape[0], "c": x.shape[1], "g": groups})
    return FactorSpec([("n", xc) + sp, (oc, wc, None, None)], [("n", oc) + sp],
                      sizes, reduce=frozenset({"c"} if groups == 1 else ()),
                      flops_per_point=2.0 * y[2] * y[3] * w.shape[2] * w.shape[3],
                      local_params=_local_params, linear=((0,), (1,)))


def _input_grad_sharding(ct, w, *, groups, input_shape, stride, padding, dilation):
    xc, oc, wc = _labels(groups)
    sp, sizes = _spatial(input_shape, w.shape[2:], stride, padding, dilation)
    sizes.update({"n": ct.shape[0], "o": w.shape[0], "c": input_shape[1], "g": groups})
    return FactorSpec([("n", oc) + sp, (oc, wc, None, None)], [("n", xc) + sp],
                      sizes, reduce=frozenset({"o"} if groups == 1 else ()),
                      flops_per_point=2.0 * ct.shape[2] * ct.shape[3] * w.shape[2] * w.shape[3],
                      local_params=_local_params, linear=((0,), (1,)))


def _filter_grad_sharding(x, ct, *, groups, kernel_shape, stride, padding, dilation):
    xc, oc, wc = _labels(groups)
    sp, sizes = _spatial(x.shape, kernel_shape[2:], stride, padding, dilation)
    sizes.update({"n": x.shape[0], "o": kernel_shape[0], "c": x.shape[1], "g": groups})
    return FactorSpec([("n", xc) + sp, ("n", oc) + sp], [(oc, wc, None, None)],
                      sizes, reduce=frozenset({"n"} | {lab for lab in sp if lab}),
                      flops_per_point=2.0 * ct.shape[2] * ct.shape[3] * kernel_shape[2]
                      * kernel_shape[3], local_params=_local_params,
                      linear=((0,), (1,)))


sharding.set(conv2d_p, _conv_sharding)
sharding.set(conv2d_input_grad_p, _input_grad_sharding)
sharding.set(conv2d_filter_grad_p, _filter_grad_sharding)


# ---------------------------------------------------------------------------
# Pools: kernel, stride and explicit padding as (h, w) pairs / ((top, bottom),
# (left, right)); the op functions resolve 'same', ceil_mode and the divisors.
# ---------------------------------------------------------------------------


def _pool_type(name):
    def rule(x, *, kernel, stride, padding):
        if x.ndim != 4 or not dtypes.is_float(x.dtype):
            raise ProgramTypeError(f"{name} needs a float NCHW operand, got {x}")
        out = _conv_out_shape(x.shape, (x.shape[1], 1) + tuple(kernel), stride, padding,
                              (1, 1))
        if out[2] < 1 or out[3] < 1 or min(stride) < 1 or min(sum(padding, ())) < 0:
            raise ShapeError(f"{name}: input {x} with kernel {kernel}, stride {stride} and "
                             f"padding {padding} gives the empty output {out}")
        return ArrayType(out, x.dtype)

    return rule


def _ms_pool_pad(x, padding, value):
    if padding[0][0] + padding[0][1] + padding[1][0] + padding[1][1] > 0:
        x = ops.pad(x, (padding[1][0], padding[1][1], padding[0][0], padding[0][1]),
                    value=value)
    return x


def _ms_max_pool(x, kernel, stride, padding):
    return ops.MaxPool(kernel, stride, "VALID")(_ms_pool_pad(x, padding, float("-inf")))


def _ms_max_pool_argmax(x, kernel, stride, padding):
    """The pooled values and, for each, its flat index in its padded (Hp * Wp) plane."""
    x = _ms_pool_pad(x, padding, float("-inf"))
    y = x if x.dtype != mstype.float16 else ops.cast(x, mstype.float32)
    v, i = ops.MaxPoolWithArgmaxV2(kernel, stride, (0, 0), (1, 1), False, mstype.int32)(y)
    return ops.cast(v, x.dtype), i


def _ms_avg_pool(x, kernel, stride, padding):
    return ops.AvgPool(kernel, stride, "VALID")(_ms_pool_pad(x, padding, 0.0))


# Lowered, the pools call kernels built at lowering time (LoweringContext.kernel) on the
# input padded by one shared PadV3: ops.pad is Python that MindSpore's compiler
# interprets at each call site.
_PAD = ops.PadV3(mode="constant", paddings_contiguous=True)


def _pool_pad_src(ctx, x, padding, value) -> str:
    if padding[0][0] + padding[0][1] + padding[1][0] + padding[1][1] == 0:
        return x
    pads = (padding[1][0], padding[1][1], padding[0][0], padding[0][1])
    fill = ctx.ref(Tensor(value, ctx.in_avals[0].dtype), "fill")
    return f"{ctx.ref(_PAD)}({x}, {pads!r}, {fill})"


def _lower_pool(cls, value):
    def lower(ctx, x, *, kernel, stride, padding):
        k = ctx.kernel(cls, kernel, stride, "VALID")
        return f"{k}({_pool_pad_src(ctx, x, padding, value)})"

    return lower


def _argmax_kernel(kernel, stride):
    return ops.MaxPoolWithArgmaxV2(kernel, stride, (0, 0), (1, 1), False, mstype.int32)


def _lower_max_pool_argmax(ctx, x, *, kernel, stride, padding):
    if ctx.in_avals[0].dtype != dtypes.float32:  # the kernel is float32: casts around it
        return ctx.call(_ms_max_pool_argmax, x, kernel=kernel, stride=stride,
                        padding=padding)
    k = ctx.kernel(_argmax_kernel, kernel, stride)
    return f"{k}({_pool_pad_src(ctx, x, padding, float('-inf'))})"


# MindSpore's CPU pooling kernels compute float64 at float32 precision; float64 takes
# the window's taps one by one (exact).


def _ms_pool_taps(x, kernel, stride, padding, value):
    xp = _ms_pool_pad(x, padding, value)
    ho = (xp.shape[2] - kernel[0]) // stride[0] + 1
    wo = (xp.shape[3] - kernel[1]) // stride[1] + 1
    taps = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            taps.append(_patch(xp, i, j, ho, wo, stride, (1, 1)))
    return ops.stack(taps, 0)


def _ms_max_pool_f64(x, kernel, stride, padding):
    return ops.amax(_ms_pool_taps(x, kernel, stride, padding, float("-inf")), 0)


def _ms_max_pool_argmax_f64(x, kernel, stride, padding):
    return _ms_max_pool_f64(x, kernel, stride, padding), \
        _ms_max_pool_argmax(x, kernel, stride, padding)[1]


def _ms_avg_pool_f64(x, kernel, stride, padding):
    return ops.mean(_ms_pool_taps(x, kernel, stride, padding, 0.0), 0)


_impl, _lower = _by_dtype(_ms_max_pool, _ms_max_pool_f64,
                          _lower_pool(ops.MaxPool, float("-inf")))
max_pool2d_p = def_primitive("max_pool2d", FAMILY, _pool_type("max_pool2d"), _impl,
                             lower=_lower)
_impl, _lower = _by_dtype(_ms_max_pool_argmax, _ms_max_pool_argmax_f64,
                          _lower_max_pool_argmax)
max_pool2d_argmax_p = def_primitive(
    "max_pool2d_argmax", FAMILY,
    lambda x, **p: [_pool_type("max_pool2d_argmax")(x, **p),
                    ArrayType(_pool_type("max_pool2d_argmax")(x, **p).shape, dtypes.int32)],
    _impl, multiple_results=True, lower=_lower)
_impl, _lower = _by_dtype(_ms_avg_pool, _ms_avg_pool_f64, _lower_pool(ops.AvgPool, 0.0))
avg_pool2d_p = def_primitive("avg_pool2d", FAMILY, _pool_type("avg_pool2d"), _impl,
                             lower=_lower)


def _pool_batching(prim):
    def rule(args, dims, **p):
        (x,), (d,) = args, dims
        xf, size = _fold_n(x, d)
        out = prim.bind(xf, **p)
        outs = out if prim.multiple_results else [out]
        return [_unfold_n(o, size) for o in outs], [0] * len(outs)

    return rule


def _pool_sharding(n_out=1, linear=None):
    """N and C split; a spatial dim whose windows tile it splits too. (The argmax's
    flat indices are per plane: a spatial split would make them block-local, so
    max_pool2d_argmax keeps its spatial dims whole.)"""
    def rule(x, **p):
        k = p["kernel"]
        sp, sizes = _spatial(x.shape, k, p["stride"], p["padding"])
        if n_out > 1:
            sp, sizes = (None, None), {}
        lab = ("n", "c") + sp
        sizes.update({"n": x.shape[0], "c": x.shape[1]})
        return FactorSpec([lab], [lab] * n_out, sizes,
                          flops_per_point=float(k[0] * k[1] * x.shape[2] * x.shape[3]),
                          linear=linear)

    return rule


# pool_gather (t, idx) -> t at idx in each (n, c) plane, and its transpose pool_scatter
# (ct, idx) -> ct added at idx into zero planes: the max pool's derivative, per plane,
# so a batch or channel split stays split (a gather from the flattened array would
# gather every block first).


def _ms_pool_gather(t, idx):
    n, c, hp, wp = t.shape
    ho, wo = idx.shape[2], idx.shape[3]
    out = ops.gather_elements(ops.reshape(t, (n, c, hp * wp)), 2,
                              ops.reshape(idx, (n, c, ho * wo)))
    return ops.reshape(out, (n, c, ho, wo))


# made once: ops.zeros is Python the graph compiler interprets at each call site
_ZEROS = ops.Zeros()


def _ms_pool_scatter(ct, idx, plane):
    n, c, ho, wo = ct.shape
    zeros = _ZEROS((n, c, plane[0] * plane[1]), ct.dtype)
    out = ops.tensor_scatter_elements(zeros, ops.reshape(idx, (n, c, ho * wo)),
                                      ops.reshape(ct, (n, c, ho * wo)), 2, "add")
    return ops.reshape(out, (n, c, plane[0], plane[1]))


def _check_pool_index(name, v, idx):
    if v.ndim != 4 or idx.ndim != 4 or tuple(v.shape[:2]) != tuple(idx.shape[:2]) or \
            idx.dtype != dtypes.int32 or not dtypes.is_float(v.dtype):
        raise ProgramTypeError(f"{name} needs float (N, C, H, W) values and int32 (N, C, h, "
                               f"w) indices, got {v} and {idx}")


def _pool_gather_type(t, idx):
    _check_pool_index("pool_gather", t, idx)
    return ArrayType(tuple(idx.shape), t.dtype)


def _pool_scatter_type(ct, idx, *, plane):
    _check_pool_index("pool_scatter", ct, idx)
    if tuple(ct.shape) != tuple(idx.shape):
        raise ProgramTypeError(f"pool_scatter needs values and indices of one shape, got "
                               f"{ct} and {idx}")
    return ArrayType(tuple(ct.shape[:2]) + tuple(plane), ct.dtype)


pool_gather_p = def_primitive("pool_gather", FAMILY, _pool_gather_type, _ms_pool_gather)
pool_scatter_p = def_primitive("pool_scatter", FAMILY, _pool_scatter_type, _ms_pool_scatter)


def _planes_batching(prim):
    """Fold the mapped axis into N (an unmapped operand is broadcast first)."""
    def rule(args, dims, **p):
        size = _size(args, dims)
        folded = [_fold_n(batch_to_front(a, d, size), 0)[0] for a, d in zip(args, dims)]
        return [_unfold_n(prim.bind(*folded, **p), size)], [0]

    return rule


def _planes_sharding(scatter: bool):
    """N and C split; so do the index's positions (each reads, or adds into, the whole
    plane: a scatter's split leaves the planes a pending sum)."""
    def rule(v, idx, **p):
        sizes = {"n": idx.shape[0], "c": idx.shape[1], "h": idx.shape[2], "w": idx.shape[3]}
        plane, at = ("n", "c", None, None), ("n", "c", "h", "w")
        return FactorSpec([at if scatter else plane, at], [plane if scatter else at], sizes,
                          reduce=frozenset({"h", "w"} if scatter else ()),
                          flops_per_point=0.0, linear=((0,),))

    return rule


batching.set(pool_gather_p, _planes_batching(pool_gather_p))
batching.set(pool_scatter_p, _planes_batching(pool_scatter_p))
sharding.set(pool_gather_p, _planes_sharding(False))
sharding.set(pool_scatter_p, _planes_sharding(True))
def _linear_in_values(prim):
    """JVP of a primitive linear in its values (operand 0), its indices fixed."""
    def rule(primals, tangents, **p):
        ans = prim.bind(*primals, **p)
        t = tangents[0]
        return [ans], [Zero(typeof(ans)) if isinstance(t, Zero)
                       else prim.bind(t, primals[1], **p)]

    return rule


jvp.set(pool_gather_p, _linear_in_values(pool_gather_p))
jvp.set(pool_scatter_p, _linear_in_values(pool_scatter_p))
transpose.set(pool_gather_p, lambda ct, t, idx: [
    pool_scatter_p.bind(instantiate(ct), idx, plane=tuple(t.aval.shape[2:])), None])
transpose.set(pool_scatter_p, lambda ct, c, idx, *, plane: [
    pool_gather_p.bind(instantiate(ct), idx), None])


def _gather_at_argmax(t, idx, padding):
    """``t`` zero-padded, read where each window's max came from: the max's tangent."""
    t = pad(instantiate(t), (0, 0, padding[0][0], padding[1][0]),
            (0, 0, padding[0][1], padding[1][1]))
    return pool_gather_p.bind(t, idx)


def _max_pool_argmax_jvp(primals, tangents, *, padding, **p):
    (x,), (t,) = primals, tangents
    v, i = max_pool2d_argmax_p.bind(x, padding=padding, **p)
    tv = Zero(typeof(v)) if isinstance(t, Zero) else _gather_at_argmax(t, i, padding)
    return [v, i], [tv, Zero(typeof(i))]


def _max_pool_jvp(primals, tangents, *, padding, **p):
    (x,), (t,) = primals, tangents
    if isinstance(t, Zero):
        y = max_pool2d_p.bind(x, padding=padding, **p)
        return [y], [Zero(typeof(y))]
    v, i = max_pool2d_argmax_p.bind(x, padding=padding, **p)
    return [v], [_gather_at_argmax(t, i, padding)]


def _avg_pool_transpose(ct, x, *, kernel, stride, padding):
    # The window mean spreads each output's cotangent evenly over its window: the
    # transposed depthwise convolution with a kernel of 1 / (kh * kw).
    c, dt = x.aval.shape[1], x.aval.dtype
    w = full((c, 1) + tuple(kernel), 1.0 / (kernel[0] * kernel[1]), dt)
    return [_input_grad(instantiate(ct), w, x.aval.shape, stride=stride, padding=padding,
                        dilation=(1, 1), groups=c)]


batching.set(max_pool2d_p, _pool_batching(max_pool2d_p))
batching.set(max_pool2d_argmax_p, _pool_batching(max_pool2d_argmax_p))
batching.set(avg_pool2d_p, _pool_batching(avg_pool2d_p))
sharding.set(max_pool2d_p, _pool_sharding())
sharding.set(max_pool2d_argmax_p, _pool_sharding(2))
sharding.set(avg_pool2d_p, _pool_sharding(linear=((0,),)))
jvp.set(max_pool2d_p, _max_pool_jvp)
jvp.set(max_pool2d_argmax_p, _max_pool_argmax_jvp)
unsupported(max_pool2d_p, "transpose", "not linear")
unsupported(max_pool2d_argmax_p, "transpose", "not linear")
deflinear(avg_pool2d_p, _avg_pool_transpose)


# ---------------------------------------------------------------------------
# Op functions (fshard.ops): MindSpore's and PyTorch's conventions, resolved into the
# primitives' canonical parameters
# ---------------------------------------------------------------------------


def _pair(v, what: str) -> tuple:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return (int(v), int(v))
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(
            isinstance(e, (int, np.integer)) and not isinstance(e, bool) for e in v):
        return (int(v[0]), int(v[1]))
    raise ArgumentError(f"{what} must be an int or a pair of ints (height, width), got {v!r}.")


def _positive_pair(v, what: str) -> tuple:
    out = _pair(v, what)
    if min(out) < 1:
        raise ArgumentError(f"{what} must be positive, got {v!r}.")
    return out


def same_padding(n: int, k: int, s: int, d: int = 1) -> tuple:
    """'same' padding along one dim: ceil(n / s) outputs, the extra zero at the end."""
    total = max((-(-n // s) - 1) * s + d * (k - 1) + 1 - n, 0)
    return (total // 2, total - total // 2)


def _padding(padding, spatial, kernel, stride, dilation, what: str) -> tuple:
    """'same', 'valid', an int, (h, w) or MindSpore's (top, bottom, left, right) ->
    ((top, bottom), (left, right))."""
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            return ((0, 0), (0, 0))
        if mode == "same":
            return tuple(same_padding(n, k, s, d)
                         for n, k, s, d in zip(spatial, kernel, stride, dilation))
        raise ArgumentError(f"{what} must be 'same', 'valid' or sizes, got {padding!r}.")
    if isinstance(padding, (tuple, list)) and len(padding) == 4:
        p = tuple(padding)
        if all(isinstance(e, (int, np.integer)) and not isinstance(e, bool) and e >= 0
               for e in p):
            return ((int(p[0]), int(p[1])), (int(p[2]), int(p[3])))
    try:
        ph, pw = _pair(padding, what)
    except ArgumentError:
        raise ArgumentError(
            f"{what} must be 'same', 'valid', an int, (height, width) or (top, bottom, "
            f"left, right), got {padding!r}.") from None
    if min(ph, pw) < 0:
        raise ArgumentError(f"{what} must be >= 0, got {padding!r}.")
    return ((ph, ph), (pw, pw))


def _check_image(x, w, name: str) -> None:
    a = typeof(x)
    if a.ndim != 4:
        raise ShapeError(f"{name}: x must be (N, C, H, W), got {a}.\nFix: add the batch dim "
                         "with x[None] (or reshape).")
    if w is not None and typeof(w).ndim != 4:
        raise ShapeError(f"{name}: weight must be (out_channels, in_channels / groups, kh, "
                         f"kw), got {typeof(w)}.")


def _with_bias(y, bias, name: str):
    if bias is None:
        return y
    c = typeof(y).shape[1]
    if tuple(typeof(bias).shape) != (c,):
        raise ShapeError(f"{name}: bias must have shape ({c},), got {typeof(bias)}.")
    return bias_add(y, bias)


def _same_dtype(x, w, name: str):
    ax, aw = typeof(x), typeof(w)
    if not dtypes.is_float(ax.dtype) or ax.dtype != aw.dtype:
        raise ProgramTypeError(
            f"{name}: x and weight must be floats of one dtype, got x: {ax} and weight: "
            f"{aw}.\nFix: cast one of them (x.astype(weight.dtype)).")


def _check_groups(name, c_in, w_shape, groups, w_in_axis):
    if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool) or groups < 1:
        raise ArgumentError(f"{name}: groups must be a positive int, got {groups!r}.")
    if c_in % groups or c_in != w_shape[w_in_axis] * (groups if w_in_axis == 1 else 1):
        want = (f"in_channels / groups = {c_in} / {groups}" if w_in_axis == 1
                else f"in_channels = {c_in}")
        raise ShapeError(
            f"{name}: x has {c_in} channels and weight has shape {tuple(w_shape)}: "
            f"weight.shape[{w_in_axis}] must be {want} (groups={groups}).")


def conv2d(x: Float[Array, "n c h w"], weight: Float[Array, "o c_g kh kw"], bias=None,
           stride=1, padding=0, dilation=1, groups: int = 1) -> Float[Array, "n o ho wo"]:
    """2-D convolution of NCHW ``x`` with an (O, C / groups, kh, kw) ``weight`` (as
    ``mindspore.ops.conv2d`` with ``pad_mode='pad'``, or ``'same'``/``'valid'`` as
    ``padding``), plus an optional (O,) ``bias``.

    >>> import numpy as np, fshard as fs
    >>> x = np.ones((1, 1, 4, 4), np.float32)
    >>> fs.ops.conv2d(x, np.ones((1, 1, 3, 3), np.float32), padding=1)[0, 0, 0].asnumpy().tolist()
    [4.0, 6.0, 6.0, 4.0]
    """
    _check_image(x, weight, "conv2d")
    _same_dtype(x, weight, "conv2d")
    xs, ws = typeof(x).shape, typeof(weight).shape
    _check_groups("conv2d", xs[1], ws, groups, 1)
    if ws[0] % groups:
        raise ShapeError(f"conv2d: weight.shape[0] = {ws[0]} output channels are not "
                         f"divisible by groups={groups}.")
    stride = _positive_pair(stride, "conv2d(stride=...)")
    dilation = _positive_pair(dilation, "conv2d(dilation=...)")
    pads = _padding(padding, xs[2:], ws[2:], stride, dilation, "conv2d(padding=...)")
    out = _conv_out_shape(xs, ws, stride, pads, dilation)
    if out[2] < 1 or out[3] < 1:
        raise ShapeError(f"conv2d: a {tuple(ws[2:])} kernel (dilation {dilation}) does not "
                         f"fit the {tuple(xs[2:])} input padded by {pads}.")
    y = _conv(x, weight, stride=stride, padding=pads, dilation=dilation, groups=int(groups))
    return _with_bias(y, bias, "conv2d")


def conv1d(x: Float[Array, "n c l"], weight: Float[Array, "o c_g k"], bias=None, stride=1,
           padding=0, dilation=1, groups: int = 1) -> Float[Array, "n o lo"]:
    """1-D convolution of (N, C, L) ``x`` with an (O, C / groups, k) ``weight``: a 2-D
    convolution over a height of 1."""
    a, b = typeof(x), typeof(weight)
    if a.ndim != 3 or b.ndim != 3:
        raise ShapeError(f"conv1d: x must be (N, C, L) and weight (O, C / groups, k), got "
                         f"x: {a} and weight: {b}.")

    def one(v, what):
        if isinstance(v, str):
            return v
        if isinstance(v, (tuple, list)) and len(v) == 1:
            v = v[0]
        if isinstance(v, (tuple, list)) and len(v) == 2 and what == "padding":
            return (0, 0) + tuple(v)
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ArgumentError(f"conv1d({what}=...) must be an int, got {v!r}.")
        return (1, v) if what != "padding" else (0, 0, v, v)

    y = conv2d(reshape(x, (a.shape[0], a.shape[1], 1, a.shape[2])),
               reshape(weight, (b.shape[0], b.shape[1], 1, b.shape[2])), bias,
               one(stride, "stride"), one(padding, "padding"), one(dilation, "dilation"),
               groups)
    s = typeof(y).shape
    return reshape(y, (s[0], s[1], s[3]))


def conv2d_input_grad(dout: Float[Array, "n o ho wo"], weight: Float[Array, "o c_g kh kw"],
                      input_shape, stride=1, padding=0, dilation=1,
                      groups: int = 1) -> Float[Array, "n c h w"]:
    """The gradient of ``conv2d(x, weight, ...)`` with respect to an ``x`` of shape
    ``input_shape``, given the output's cotangent ``dout`` (MindSpore's
    ``Conv2DBackpropInput`` and ``Conv2DTranspose``; ``padding`` as in ``conv2d``, 'same'
    relative to ``input_shape``)."""
    _check_image(dout, weight, "conv2d_input_grad")
    _same_dtype(dout, weight, "conv2d_input_grad")
    shape = tuple(int(d) for d in input_shape)
    ws = typeof(weight).shape
    if len(shape) != 4:
        raise ArgumentError(f"conv2d_input_grad: input_shape must be (N, C, H, W), got "
                            f"{input_shape!r}.")
    _check_groups("conv2d_input_grad", shape[1], ws, groups, 1)
    stride = _positive_pair(stride, "conv2d_input_grad(stride=...)")
    dilation = _positive_pair(dilation, "conv2d_input_grad(dilation=...)")
    pads = _padding(padding, shape[2:], ws[2:], stride, dilation,
                    "conv2d_input_grad(padding=...)")
    want = _conv_out_shape(shape, ws, stride, pads, dilation)
    if tuple(typeof(dout).shape) != want:
        raise ShapeError(
            f"conv2d_input_grad: dout has shape {tuple(typeof(dout).shape)}, but the "
            f"convolution of an input of shape {shape} with weight {tuple(ws)} (stride "
            f"{stride}, padding {pads}, dilation {dilation}) has shape {want}.")
    return _input_grad(dout, weight, shape, stride=stride, padding=pads, dilation=dilation,
                       groups=int(groups))


def conv_transpose2d(x: Float[Array, "n c h w"], weight: Float[Array, "c o_g kh kw"],
                     bias=None, stride=1, padding=0, output_padding=0, groups: int = 1,
                     dilation=1) -> Float[Array, "n o ho wo"]:
    """Transposed 2-D convolution (PyTorch's ``conv_transpose2d``): the gradient of
    ``conv2d`` with respect to its input. ``weight`` is (C, O / groups, kh, kw); the
    output is ((H - 1) * stride - 2 * padding + dilation * (kh - 1) + output_padding + 1)
    high (alike in width)."""
    _check_image(x, weight, "conv_transpose2d")
    _same_dtype(x, weight, "conv_transpose2d")
    xs, ws = typeof(x).shape, typeof(weight).shape
    _check_groups("conv_transpose2d", xs[1], ws, groups, 0)
    stride = _positive_pair(stride, "conv_transpose2d(stride=...)")
    dilation = _positive_pair(dilation, "conv_transpose2d(dilation=...)")
    ph, pw = _pair(padding, "conv_transpose2d(padding=...)")
    oph, opw = _pair(output_padding, "conv_transpose2d(output_padding=...)")
    if min(ph, pw, oph, opw) < 0 or oph >= stride[0] or opw >= stride[1]:
        raise ArgumentError(
            f"conv_transpose2d: padding {padding!r} must be >= 0 and output_padding "
            f"{output_padding!r} must be >= 0 and smaller than the stride {stride}.")
    h = (xs[2] - 1) * stride[0] - 2 * ph + dilation[0] * (ws[2] - 1) + oph + 1
    w = (xs[3] - 1) * stride[1] - 2 * pw + dilation[1] * (ws[3] - 1) + opw + 1
    if h < 1 or w < 1:
        raise ShapeError(f"conv_transpose2d: the output would be {h} x {w}.")
    # output_padding adds rows the forward convolution never reached (their gradient is 0)
    y = _input_grad(x, weight, (xs[0], ws[1] * groups, h, w), stride=stride,
                    padding=((ph, ph), (pw, pw)),
                    dilation=dilation, groups=int(groups))
    return _with_bias(y, bias, "conv_transpose2d")


def _pool_pads(n: int, k: int, s: int, lo: int, hi: int, ceil_mode: bool) -> tuple:
    """(lo, hi) with ceil_mode's extra positions at the end (PyTorch's rule: the last
    window must start inside the input or its leading padding)."""
    if not ceil_mode:
        return (lo, hi)
    out = -(-(n + lo + hi - k) // s) + 1
    if (out - 1) * s >= n + lo:
        out -= 1
    return (lo, max(hi, (out - 1) * s + k - n - lo))


def _pool_args(name, x, kernel_size, stride, padding, ceil_mode):
    a = typeof(x)
    if a.ndim != 4 or not dtypes.is_float(a.dtype):
        raise ShapeError(f"{name}: x must be a float (N, C, H, W) array, got {a}.\nFix: add "
                         "the batch dim with x[None], or cast to float.")
    kernel = _positive_pair(kernel_size, f"{name}(kernel_size=...)")
    stride = kernel if stride is None else _positive_pair(stride, f"{name}(stride=...)")
    pads = _padding(padding, a.shape[2:], kernel, stride, (1, 1), f"{name}(padding=...)")
    if not isinstance(padding, str) and any(p > k // 2 for p, k in zip(
            (max(pads[0]), max(pads[1])), kernel)):
        raise ArgumentError(f"{name}: padding {padding!r} must be at most half the kernel "
                            f"size {kernel}.")
    given = pads
    pads = tuple(_pool_pads(n, k, s, lo, hi, ceil_mode)
                 for n, k, s, (lo, hi) in zip(a.shape[2:], kernel, stride, pads))
    out = _conv_out_shape(a.shape, (1, 1) + kernel, stride, pads, (1, 1))
    if out[2] < 1 or out[3] < 1:
        raise ShapeError(f"{name}: a {kernel} window does not fit the {tuple(a.shape[2:])} "
                         f"input padded by {given}.")
    return kernel, stride, pads, given


def max_pool2d(x: Float[Array, "n c h w"], kernel_size, stride=None, padding=0,
               ceil_mode: bool = False) -> Float[Array, "n c ho wo"]:
    """Max over ``kernel_size`` windows every ``stride`` (default: the kernel size) of
    NCHW ``x``, padded with -inf (``padding``: sizes, or 'same'/'valid').

    >>> import numpy as np, fshard as fs
    >>> fs.ops.max_pool2d(np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4), 2).asnumpy()
    array([[[[ 5.,  7.],
             [13., 15.]]]], dtype=float32)
    """
    kernel, stride, pads, _ = _pool_args("max_pool2d", x, kernel_size, stride, padding,
                                         ceil_mode)
    return max_pool2d_p.bind(x, kernel=kernel, stride=stride, padding=pads)


def max_pool2d_with_indices(x: Float[Array, "n c h w"], kernel_size, stride=None, padding=0,
                            ceil_mode: bool = False
                            ) -> tuple[Float[Array, "n c ho wo"], Int[Array, "n c ho wo"]]:
    """``max_pool2d`` and, for each output, the flat index (h * W + w) in its (H, W)
    input plane of the value it took."""
    kernel, stride, pads, _ = _pool_args("max_pool2d", x, kernel_size, stride, padding,
                                         ceil_mode)
    v, i = max_pool2d_argmax_p.bind(x, kernel=kernel, stride=stride, padding=pads)
    if pads[0][0] == pads[1][0] == pads[1][1] == 0:  # the padded plane's rows are the input's
        return v, i
    w = typeof(x).shape[3]
    wp = w + pads[1][0] + pads[1][1]
    r = sub(floor_divide(i, np.int32(wp)), np.int32(pads[0][0]))
    c = sub(remainder(i, np.int32(wp)), np.int32(pads[1][0]))
    return v, add(mul(r, np.int32(w)), c)


def _window_counts(n: int, k: int, s: int, lo: int, hi_given: int, out: int, include_pad):
    """How many positions of each window count: inside the input, or inside the input
    and its given padding (not ceil_mode's extra positions)."""
    lo_edge, hi_edge = (-lo, n + hi_given) if include_pad else (0, n)
    start = np.arange(out) * s - lo
    return np.minimum(start + k, hi_edge) - np.maximum(start, lo_edge)


def avg_pool2d(x: Float[Array, "n c h w"], kernel_size, stride=None, padding=0,
               ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override=None) -> Float[Array, "n c ho wo"]:
    """Mean over ``kernel_size`` windows every ``stride`` of NCHW ``x`` (PyTorch's and
    MindSpore's ``avg_pool2d``): the zero padding counts in the divisor if
    ``count_include_pad``; ``divisor_override`` replaces the divisor."""
    kernel, stride, pads, given = _pool_args("avg_pool2d", x, kernel_size, stride, padding,
                                             ceil_mode)
    y = avg_pool2d_p.bind(x, kernel=kernel, stride=stride, padding=pads)
    a, out = typeof(x), typeof(y).shape
    if divisor_override:
        scale = np.full(out[2:], kernel[0] * kernel[1] / float(divisor_override))
    else:
        counts = [_window_counts(n, k, s, lo, hi, o, count_include_pad)
                  for n, k, s, (lo, _), (_, hi), o in zip(a.shape[2:], kernel, stride, pads,
                                                            given, out[2:])]
        scale = kernel[0] * kernel[1] / np.outer(counts[0], counts[1])
    if np.all(scale == 1.0):
        return y
    return mul(y, np.broadcast_to(scale.astype(dtypes.to_numpy(a.dtype)), out))


def _adaptive_windows(n: int, m: int) -> list:
    return [(i * n // m, -(-(i + 1) * n // m)) for i in range(m)]


def adaptive_avg_pool2d(x: Float[Array, "n c h w"], output_size) -> Float[Array, "n c oh ow"]:
    """Mean over the ``output_size`` windows that tile NCHW ``x`` (window i of n inputs
    into m outputs spans [floor(i n / m), ceil((i + 1) n / m))); None in
    ``output_size`` keeps that size."""
    a = typeof(x)
    if a.ndim != 4 or not dtypes.is_float(a.dtype):
        raise ShapeError(f"adaptive_avg_pool2d: x must be a float (N, C, H, W) array, got {a}.")
    if not isinstance(output_size, (tuple, list)):
        output_size = (output_size, output_size)
    if len(output_size) != 2:
        raise ArgumentError(f"adaptive_avg_pool2d: output_size must be an int or a pair, "
                            f"got {output_size!r}.")
    size = tuple(n if m is None else m for n, m in zip(a.shape[2:], output_size))
    if any(not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m < 1
           for m in size):
        raise ArgumentError(f"adaptive_avg_pool2d: output_size must be positive ints (or "
                            f"None), got {output_size!r}.")
    if size == (1, 1):
        return mean(x, (2, 3), keepdims=True)
    if all(n % m == 0 for n, m in zip(a.shape[2:], size)):
        k = tuple(n // m for n, m in zip(a.shape[2:], size))
        return avg_pool2d_p.bind(x, kernel=k, stride=k, padding=((0, 0), (0, 0)))
    for axis, (n, m) in ((2, (a.shape[2], size[0])), (3, (a.shape[3], size[1]))):
        if n % m:
            shape = typeof(x).shape
            parts = []
            for lo, hi in _adaptive_windows(n, m):
                start, limit = [0] * 4, list(shape)
                start[axis], limit[axis] = lo, hi
                parts.append(mean(slice_array(x, tuple(start), tuple(limit)), axis,
                                  keepdims=True))
            x = concat(parts, axis)
        elif n != m:
            k = (n // m, 1) if axis == 2 else (1, n // m)
            x = avg_pool2d_p.bind(x, kernel=k, stride=k, padding=((0, 0), (0, 0)))
    return x


def _pool1d(fn, name, x, kernel_size, stride, padding, **kw):
    a = typeof(x)
    if a.ndim != 3:
        raise ShapeError(f"{name}: x must be (N, C, L), got {a}.")

    def one(v, what):
        if isinstance(v, (tuple, list)) and len(v) == 1:
            v = v[0]
        if isinstance(v, str) or v is None:
            return v
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ArgumentError(f"{name}({what}=...) must be an int, got {v!r}.")
        return (0, v) if what == "padding" else (1, v)

    y = fn(reshape(x, (a.shape[0], a.shape[1], 1, a.shape[2])), one(kernel_size, "kernel_size"),
           one(stride, "stride"), one(padding, "padding"), **kw)
    s = typeof(y).shape
    return reshape(y, (s[0], s[1], s[3]))


def max_pool1d(x: Float[Array, "n c l"], kernel_size, stride=None, padding=0,
               ceil_mode: bool = False) -> Float[Array, "n c lo"]:
    """``max_pool2d`` over the last dim of (N, C, L) ``x``."""
    return _pool1d(max_pool2d, "max_pool1d", x, kernel_size, stride, padding,
                   ceil_mode=ceil_mode)


def avg_pool1d(x: Float[Array, "n c l"], kernel_size, stride=None, padding=0,
               ceil_mode: bool = False, count_include_pad: bool = True) -> Float[Array, "n c lo"]:
    """``avg_pool2d`` over the last dim of (N, C, L) ``x``."""
    return _pool1d(avg_pool2d, "avg_pool1d", x, kernel_size, stride, padding,
                   ceil_mode=ceil_mode, count_include_pad=count_include_pad)
