"""Tracing native MindSpore code: ``mindspore.ops`` functions, ``mint`` functions,
Tensor operators and methods, and ``nn`` Cells called on fshard tracers.

MindSpore ops reject non-Tensor arguments, so while a function is staged this module
swaps MindSpore's entry points for versions that send any call involving a Tracer to
fshard's op functions (``fshard.ops``); calls without a Tracer reach MindSpore
unchanged (that is how constants are computed eagerly while tracing). Everything is
here: one table, ``CONVERTERS``, maps a MindSpore primitive name (``'MatMulExt'``,
``'BiasAdd'``, ...) to a converter; the entry points are found once, lazily; and
``tracing()`` swaps them in for the outermost trace and always puts back the very
objects it found, also when the traced function raises.

The entry points (MindSpore 2.10): the generated ``pyboost_*`` functions in the module
globals of ``gen_ops_prim`` (and ``ops_def``), ``ops.primitive._run_op`` (legacy
primitives such as ``BiasAdd``), ``_Pyboost*Prim.__call__`` (``pyboost_inner_prim``),
the ``functional_overload`` instances behind ``mint``, ``nn.Cell.__call__`` (a Cell
called on a Tracer runs its ``construct`` directly), ``Tensor.__new__``
(``Tensor(traced)``) and the Tensor operators that never fall back to a Tracer's
reflected operator (``tensor + tracer``). MindSpore's Python
argument checks (``isinstance(x, Tensor)`` in ``Shape``, ``DType``, ``_check_is_tensor``,
``ops.flatten``, ...) see a module-global ``isinstance`` that accepts a Tracer. A
MindSpore Python function that branches on a tensor's value with a Python ``if``
(``ops.clip_by_norm``) has its code swapped for a trampoline to fshard's version
(``_CodePatch``), so every reference to it, however it was imported, traces.

This module imports MindSpore; nothing else in fshard's tracing depends on it.
"""

from __future__ import annotations

import contextlib
import itertools
import inspect
import math
import operator
import os
import sys
import threading
import types
import zlib
from typing import Callable

import numpy as np

from fshard.core import context, dtypes, tree
from fshard.meshes import distributed
from fshard import ops as fo
from fshard.backend import mindspore as backend
from fshard.core.tracing import Tracer, current_trace, is_symbolic, typeof
from fshard.errors import (ArgumentError, AxisNameError, FshardError, ProgramTypeError,
                           ShapeError, ShardingError, UnsupportedOpError)
from fshard.debug import debug_callback_p
from fshard.core.interpret import walk
from fshard.meshes.mesh import Mesh, resolve_mesh
from fshard.primitives import collectives as C
from fshard.primitives.composite import extremum_with_index
from fshard.primitives.conv import same_padding
from fshard.primitives.generic import assign, ms_call
from fshard.primitives.nn import batch_norm_parts, group_norm_parts
from fshard.primitives.pipeline import check_not_in_vmap, pipeline_split_p
from fshard.primitives.remat import nothing_saveable, remat_call
from fshard.sharding.runtime import bind_on_rank
from fshard.core.staging import register_user_code_hook, stage
from fshard.adapter.tensor_methods import (METHODS, ms_add, ms_div, ms_mean, ms_mul, ms_sub,
                                           ms_sum, truthy_reduce)
from fshard.sharding.user_layouts import operator_call, operator_strategy

# ---------------------------------------------------------------------------
# The converter table: MindSpore primitive name -> converter(prim, *args, **kwargs)
# ---------------------------------------------------------------------------

Converter = Callable[..., object]

#: MindSpore primitive name -> converter. A converter receives the MindSpore primitive
#: object (for its attributes) and the arguments exactly as MindSpore's entry point got
#: them, and returns fshard values (a tuple for multi-output primitives). Overloaded
#: ``mint`` functions are keyed ``'functional.<name>'`` and get the Python call's own
#: arguments.
CONVERTERS: dict[str, Converter] = {}


def converts(*names: str):
    """Register a converter for the MindSpore primitives ``names``.

    >>> @converts("MyExampleOp")
    ... def _my_example_op(prim, x):
    ...     return fo.exp(x)
    >>> "MyExampleOp" in CONVERTERS
    True
    >>> del CONVERTERS["MyExampleOp"]
    """
    def register(fn: Converter) -> Converter:
        for name in names:
            assert name not in CONVERTERS, f"converter for {name} registered twice"
            CONVERTERS[name] = fn
        return fn

    return register


# -- argument helpers --------------------------------------------------------

_TYPE_IDS: dict[int, object] = {}


def _dtype(d):
    """A MindSpore dtype argument (a dtype, or the enum id generated code passes)."""
    if d is None:
        return None
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
        if not _TYPE_IDS:
            _TYPE_IDS.update(backend.dtype_type_ids(
                (dtypes.bool_, dtypes.int32, dtypes.int64, dtypes.float32, dtypes.float64,
                 *dtypes._MS_TO_NP)))
        try:
            return _TYPE_IDS[int(d)]
        except KeyError:
            raise UnsupportedOpError(
                f"MindSpore dtype id {d} has no fshard dtype; fshard supports "
                f"{sorted(dtypes.short_name(t) for t in dtypes._MS_TO_NP)}.") from None
    return dtypes.canonical(d)


def _axis(axis):
    """A MindSpore axis argument -> None (all axes), an int or a tuple."""
    if axis is None:
        return None
    if isinstance(axis, (tuple, list)):
        return tuple(int(a) for a in axis) if len(axis) else None
    return int(axis)


def _scalar(v):
    """A 0-d constant Tensor argument (``on_value``, ``alpha``) as a Python scalar."""
    if isinstance(v, Tracer):
        return v
    if hasattr(v, "asnumpy"):
        return v.asnumpy().item()
    return v


def _with_dtype(x, dtype):
    return x if dtype is None else fo.cast(x, _dtype(dtype))


# -- elementwise -------------------------------------------------------------

for _names, _fn in (
    (("Neg",), fo.neg), (("Exp",), fo.exp), (("Log",), fo.log), (("Tanh",), fo.tanh),
    (("Sigmoid",), fo.sigmoid), (("ReLU",), fo.relu), (("Sqrt",), fo.sqrt),
    (("Rsqrt",), fo.rsqrt), (("Abs",), fo.abs), (("Sign",), fo.sign), (("Sin",), fo.sin),
    (("Cos",), fo.cos), (("Erf",), fo.erf), (("Square",), fo.square),
    (("Pow", "PowTensorScalar", "PowScalarTensor"), fo.pow),
    (("Maximum",), fo.maximum), (("Minimum",), fo.minimum),
    (("Greater",), fo.greater), (("GreaterEqual",), fo.greater_equal),
    (("Less",), fo.less), (("LessEqual",), fo.less_equal),
    (("Equal",), fo.equal), (("NotEqual",), fo.not_equal),
    (("Select",), fo.where),
):
    converts(*_names)(lambda prim, *args, _fn=_fn: _fn(*args))


@converts("Mul", "Div", "RealDiv")
def _ops_mul_div(prim, x, y):
    """``ops.mul`` and ``ops.div`` pass a Python float to MindSpore's Mul and Div as a
    float32 0-d tensor: a float16 array is multiplied in float32 and rounded once (the
    Tensor operators and ``mint`` round the number to float16 first). With a float64
    array fshard keeps the number exact, where MindSpore (every API) multiplies by its
    float32 rounding (``x * 0.1`` by 0.10000000149)."""
    fn = ms_mul if prim.name == "Mul" else ms_div
    num, other = (x, y) if type(x) is float else (y, x)
    if type(num) is float and typeof(other).dtype != dtypes.float64:
        num = np.asarray(num, np.float32)
        x, y = (num, other) if type(x) is float else (other, num)
    return fn(x, y)


_mul = converts("Muls")(lambda prim, x, y: ms_mul(x, y))
_div = converts("Divs")(lambda prim, x, y: ms_div(x, y))


def _scaled(y, alpha):
    """``alpha * y`` (MindSpore's ``alpha`` argument of add/sub)."""
    alpha = _scalar(alpha)
    return y if not isinstance(alpha, Tracer) and alpha == 1 else fo.mul(y, alpha)


@converts("Add", "AddExt", "AddScalar")
def _add(prim, x, y, alpha=1):
    return fo.add(x, _scaled(y, alpha))


@converts("Sub", "SubExt", "SubScalar")
def _sub(prim, x, y, alpha=1):
    return fo.sub(x, _scaled(y, alpha))


@converts("Floor")
def _floor(prim, x):
    return fo.floor(x)


@converts("Round")
def _round(prim, x, decimals=0):
    if _scalar(decimals) != 0:
        raise UnsupportedOpError(
            f"round(decimals={decimals!r}) on a traced value has no fshard primitive (only "
            "decimals=0).\nFix: scale first, e.g. fs.ops.round(x * 100) / 100.")
    return fo.round(x)


@converts("GeLU")
def _gelu(prim, x):
    return fo.gelu(x, "tanh")


@converts("Cast")
def _cast(prim, x, dtype):
    return fo.cast(x, _dtype(dtype))


@converts("OnesLike", "ZerosLike")
def _fill_like(prim, x):
    a = typeof(x)
    return fo.full(a.shape, 1 if prim.name == "OnesLike" else 0, a.dtype)


# -- linear algebra and nn ---------------------------------------------------


@converts("MatMulExt", "BatchMatMulExt")
def _matmul_ext(prim, x, y):
    return fo.matmul(x, y)


@converts("MatMul", "BatchMatMul")
def _matmul(prim, x, y, transpose_a=False, transpose_b=False):
    return fo.matmul(x, y, bool(transpose_a), bool(transpose_b))


@converts("BiasAdd")
def _bias_add(prim, x, b, data_format=0):
    if data_format not in (0, "NCHW", "NCDHW") and typeof(x).ndim > 2:  # channels last
        return fo.add(x, b)
    return fo.bias_add(x, b)


@converts("Softmax", "LogSoftmax", "LogSoftmaxExt")
def _softmax(prim, x, axis=-1, dtype=None):
    if isinstance(axis, (tuple, list)):
        if len(axis) != 1:
            raise UnsupportedOpError(
                f"MindSpore {prim.name} over several axes {tuple(axis)} has no fshard "
                "converter; fshard's softmax takes one axis.")
        axis = axis[0]
    x = _with_dtype(x, dtype)
    fn = fo.softmax if prim.name == "Softmax" else fo.log_softmax
    return fn(x, -1 if axis is None else int(axis))


def _layer_norm_parts(x, gamma, beta, begin_norm_axis, begin_params_axis, eps):
    """(y, mean, var, rstd) of MindSpore's layer norm; gamma/beta cover the dims from
    ``begin_params_axis`` on and are broadcast over the rest."""
    nd = typeof(x).ndim
    axes = tuple(range(begin_norm_axis % nd, nd))
    mu = fo.mean(x, axes, keepdims=True)
    xc = fo.sub(x, mu)
    var = fo.mean(fo.mul(xc, xc), axes, keepdims=True)
    rstd = fo.rsqrt(fo.add(var, float(eps)))
    y = fo.mul(xc, rstd)
    p_nd = nd - begin_params_axis % nd
    for p, op in ((gamma, fo.mul), (beta, fo.add)):
        if p is not None:
            if typeof(p).ndim != p_nd:  # nn.LayerNorm keeps the normalized shape
                p = fo.reshape(p, tuple(typeof(x).shape[nd - p_nd:]))
            y = op(y, p)
    return y, mu, var, rstd


@converts("LayerNorm")
def _layer_norm(prim, x, gamma, beta, begin_norm_axis=-1, begin_params_axis=-1, eps=1e-7):
    y, mu, var, _ = _layer_norm_parts(x, gamma, beta, begin_norm_axis, begin_params_axis, eps)
    return y, mu, var


@converts("LayerNormExt")
def _layer_norm_ext(prim, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    begin = -len(tuple(normalized_shape))
    y, mu, _, rstd = _layer_norm_parts(x, weight, bias, begin, begin, eps)
    return y, mu, rstd


def _write_statistics(stats: tuple, values: tuple) -> None:
    """Write BatchNorm's new moving statistics into the tensors MindSpore would update in
    place (a Cell's Parameters, or the tensors passed for them): one ``Assign`` each, an
    equation with an effect that dead-code elimination keeps."""
    for s, v in zip(stats, values):
        assign(s, v)


@converts("BatchNorm")
def _batch_norm(prim, x, scale, bias, mean, variance, is_training=False, epsilon=1e-5,
                momentum=0.1, data_format="NCHW"):
    training = bool(_scalar(is_training))
    if data_format not in ("NCHW", 0):
        raise UnsupportedOpError("MindSpore BatchNorm with data_format='NHWC' has no fshard "
                                 "converter (MindSpore runs it on GPU only); use NCHW.")
    y, new_mean, new_var, batch_mean, batch_var = batch_norm_parts(
        x, mean, variance, scale, bias, training, float(_scalar(momentum)),
        float(_scalar(epsilon)))
    zeros = fo.zeros((typeof(x).shape[1],), typeof(x).dtype)
    if not training:  # MindSpore's CPU kernel returns zeros for the auxiliary outputs
        return y, zeros, zeros, zeros, zeros
    _write_statistics((mean, variance), (new_mean, new_var))
    return y, zeros, zeros, batch_mean, batch_var


@converts("BatchNormExt")
def _batch_norm_ext(prim, x, weight=None, bias=None, running_mean=None, running_var=None,
                    training=False, momentum=0.1, epsilon=1e-5):
    training = bool(_scalar(training))
    stats = (running_mean, running_var)
    if running_mean is None or running_var is None:
        if not training:
            raise ArgumentError("batch_norm(training=False) normalises with running_mean "
                                "and running_var, and got None.\nFix: pass both, or "
                                "training=True.")
        c = typeof(x).shape[1]
        running_mean = fo.zeros((c,), typeof(x).dtype)
        running_var = fo.ones((c,), typeof(x).dtype)
        stats = ()
    y, new_mean, new_var, batch_mean, batch_var = batch_norm_parts(
        x, running_mean, running_var, weight, bias, training, float(_scalar(momentum)),
        float(_scalar(epsilon)))
    if training and stats:
        _write_statistics(stats, (new_mean, new_var))
    return y, batch_mean, batch_var


@converts("GroupNorm")
def _group_norm(prim, x, num_groups, weight=None, bias=None, eps=1e-5):
    return group_norm_parts(x, int(_scalar(num_groups)), weight, bias, float(_scalar(eps)))


@converts("RmsNorm")
def _rms_norm(prim, x, gamma, epsilon=None):
    eps = float(_scalar(_attr(prim, "epsilon", 1e-6) if epsilon is None else epsilon))
    nd, gd = typeof(x).ndim, typeof(gamma).ndim
    axes = tuple(range(nd - gd, nd))
    rstd = fo.rsqrt(fo.add(fo.mean(fo.mul(x, x), axes, keepdims=True), eps))
    return fo.mul(fo.mul(x, rstd), gamma), rstd


@converts("ResizeNearestNeighborV2", "ResizeBilinearV2")
def _resize_v2(prim, x, size, align_corners=False, half_pixel_centers=False):
    mode = "nearest" if "Nearest" in prim.name else "linear"
    coords = ("align_corners" if _scalar(align_corners) else
              "half_pixel" if _scalar(half_pixel_centers) else "asymmetric")
    return fo.interpolate(x, tuple(int(s) for s in _static_size(size)), mode, coords)


@converts("ResizeLinear1D")
def _resize_linear_1d(prim, x, size, coordinate_transformation_mode=None):
    mode = _scalar(_attr(prim, "coordinate_transformation_mode", "align_corners")
                   if coordinate_transformation_mode is None else coordinate_transformation_mode)
    # MindSpore's enum: 0 asymmetric, 1 align_corners, 2 half_pixel
    coords = {0: "asymmetric", 1: "align_corners", 2: "half_pixel"}.get(mode, mode)
    size = tuple(int(s) for s in _static_size(size))
    if size == (1,):  # MindSpore's kernel samples the first element then (measured)
        coords = "align_corners"
    return fo.interpolate(x, size, "linear", coords)


def _static_size(size):
    return size.asnumpy().tolist() if hasattr(size, "asnumpy") else size


@converts("UpsampleNearest1D", "UpsampleNearest2D", "UpsampleNearest3D", "UpsampleLinear1D",
          "UpsampleBilinear2D", "UpsampleTrilinear3D")
def _upsample(prim, x, output_size=None, scales=None, align_corners=False):
    # mint's (PyTorch's) convention: a given scale factor s samples at dst / s
    ratios = None if scales is None else tuple(1.0 / float(s) for s in scales)
    if output_size is None:
        output_size = tuple(int(d * s) for d, s in zip(typeof(x).shape[2:], scales))
    linear = "Nearest" not in prim.name
    coords = ("align_corners" if align_corners else "half_pixel") if linear else "asymmetric"
    return fo.interpolate(x, tuple(int(s) for s in output_size),
                          "linear" if linear else "nearest", coords,
                          None if coords == "align_corners" else ratios)


def _one_hot(labels, depth: int, dtype, on=1, off=0):
    """One-hot along a new last axis, with MindSpore's on/off values."""
    dtype = _dtype(dtype)
    out = fo.one_hot(labels, int(depth), dtype=dtype)
    on, off = _scalar(on), _scalar(off)
    if not (isinstance(on, (int, float)) and on == 1 and isinstance(off, (int, float))
            and off == 0):
        out = fo.where(fo.cast(out, dtypes.bool_), fo.cast(on, dtype), fo.cast(off, dtype))
    return out


@converts("OneHot", "OneHotExt")
def _one_hot_prim(prim, indices, depth, on_value=1, off_value=0, axis=-1):
    on_dtype = typeof(on_value).dtype if not isinstance(on_value, (int, float)) else (
        dtypes.int64)
    out = _one_hot(indices, depth, on_dtype, on_value, off_value)
    nd = typeof(out).ndim
    if axis not in (-1, nd - 1):
        perm = list(range(nd - 1))
        perm.insert(axis % nd, nd - 1)
        out = fo.transpose(out, tuple(perm))
    return out


@converts("SoftmaxCrossEntropyWithLogits")
def _softmax_xent(prim, logits, labels):
    logp = fo.log_softmax(logits, -1)
    loss = fo.neg(fo.reduce_sum(fo.mul(labels, logp), -1))
    return loss, fo.sub(fo.exp(logp), labels)  # (loss, its gradient: MindSpore's "backprop")


@converts("SparseSoftmaxCrossEntropyWithLogits")
def _sparse_softmax_xent(prim, logits, labels):
    if prim.attrs.get("is_grad"):
        raise UnsupportedOpError("SparseSoftmaxCrossEntropyWithLogits(is_grad=True) has no "
                                 "fshard converter; differentiate the loss with fs.grad.")
    onehot = _one_hot(labels, typeof(logits).shape[-1], typeof(logits).dtype)
    return fo.mean(fo.neg(fo.reduce_sum(fo.mul(onehot, fo.log_softmax(logits, -1)), -1)))


@converts("NLLLoss")
def _nll_loss(prim, logp, target, weight, reduction=1, ignore_index=-100):
    # reduction: MindSpore's enum (0: sum, 1: mean, 2: none) or its string.
    red = {0: "sum", 1: "mean", 2: "none"}.get(reduction, reduction)
    lg = typeof(logp)
    onehot = _one_hot(target, lg.shape[-1], lg.dtype)
    w = fo.reduce_sum(fo.mul(onehot, weight), -1)  # weight of each example's class
    keep = fo.cast(fo.not_equal(target, int(ignore_index)), lg.dtype)
    w = fo.mul(w, keep)
    per_example = fo.neg(fo.mul(fo.reduce_sum(fo.mul(onehot, logp), -1), w))
    total = fo.reduce_sum(w)
    if red == "none":
        return per_example, total
    if red == "sum":
        return fo.reduce_sum(per_example), total
    return fo.div(fo.reduce_sum(per_example), total), total


# -- reductions --------------------------------------------------------------


@converts("SumExt")
def _sum(prim, x, axis=None, keepdims=False, dtype=None):
    return ms_sum(x, _axis(axis), bool(keepdims), None if dtype is None else _dtype(dtype))


@converts("ReduceSum")
def _reduce_sum(prim, x, axis=(), keep_dims=False, skip_mode=False):
    if skip_mode and not axis:  # MindSpore: an empty axis with skip_mode is the identity
        return x
    # The primitive keeps the dtype: integers wrap, bool gives "any".
    out = fo.reduce_sum(x, _axis(axis), bool(keep_dims))
    return fo.cast(out, typeof(x).dtype) if typeof(x).dtype != typeof(out).dtype else out


@converts("MeanExt", "ReduceMean")
def _mean(prim, x, axis=None, keepdims=False, dtype=None):
    return ms_mean(x, _axis(axis), bool(keepdims), None if dtype is None else _dtype(dtype),
                   _call_site(_stack()))


@converts("ReduceMax", "ReduceMin")
def _reduce_max(prim, x, axis=None, keepdims=False):
    if typeof(x).dtype == dtypes.bool_:  # as MindSpore: its ReduceMax/Min take no bool
        which = "amax" if prim.name == "ReduceMax" else "amin"
        raise ProgramTypeError(
            f"ops.{which} got a bool tensor{_call_site(_stack())}; MindSpore's {prim.name} "
            f"takes no bool input. Use ops.{'any' if which == 'amax' else 'all'}(x) (or "
            f"cast to int32 first) instead.")
    fn = fo.reduce_max if prim.name == "ReduceMax" else fo.reduce_min
    return fn(x, _axis(axis), bool(keepdims))


@converts("Ones", "Zeros")
def _ones(prim, shape, dtype=None):
    value = 1 if prim.name == "Ones" else 0
    return fo.full(shape, value, dtypes.float32 if dtype is None else _dtype(dtype))


@converts("ReduceAny", "ReduceAll")
def _reduce_any(prim, x, axis=(), keep_dims=False):
    return truthy_reduce(x, prim.name == "ReduceAny", _axis(axis), bool(keep_dims))


def _arg(prim_is_max: bool, x, axis, keepdims):
    fn = fo.argmax if prim_is_max else fo.argmin
    if axis is None:  # over the flattened input
        out = fn(fo.reshape(x, (-1,)), 0)
        if keepdims:
            out = fo.reshape(out, (1,) * typeof(x).ndim)
    else:
        out = fn(x, int(axis), bool(keepdims))
    return fo.cast(out, dtypes.int64)  # MindSpore's index dtype


@converts("Argmax", "Argmin")
def _argmax(prim, x, axis=-1, output_type=None):
    out = _arg(prim.name == "Argmax", x, axis, False)
    return out if output_type is None else fo.cast(out, _dtype(output_type))


@converts("ArgMaxExt", "ArgMinExt")
def _argmax_ext(prim, x, dim=None, keepdim=False):
    return _arg(prim.name == "ArgMaxExt", x, dim, keepdim)


@converts("ArgMaxWithValue", "ArgMinWithValue")
def _arg_with_value(prim, x, axis=0, keep_dims=False):
    # (the value read at the index: its gradient goes there alone, as MindSpore's at ties)
    values, index = extremum_with_index(x, int(axis), bool(keep_dims),
                                        prim.name == "ArgMaxWithValue")
    return fo.cast(index, dtypes.int64), values  # MindSpore's order: (index, value)


# -- shape ops ---------------------------------------------------------------


@converts("Reshape", "View")
def _reshape(prim, x, shape):
    return fo.reshape(x, tuple(shape))


@converts("Transpose", "TransposeView")
def _transpose(prim, x, perm):
    return fo.transpose(x, tuple(perm))


@converts("TransposeExt", "TransposeExtView")
def _swapaxes(prim, x, dim0, dim1):
    return fo.swapaxes(x, dim0, dim1)


@converts("ExpandDims", "ExpandDimsView")
def _expand_dims(prim, x, axis):
    return fo.expand_dims(x, axis)


@converts("Squeeze")
def _squeeze(prim, x, axis=()):
    axes = _axis(axis)
    if axes is None or axes == ():
        return fo.squeeze(x, axes)
    # MindSpore (as PyTorch) leaves a named dimension whose size is not 1 in place.
    shape, nd = typeof(x).shape, typeof(x).ndim
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    keep = tuple(a for a in axes if shape[a % nd] == 1)
    return fo.squeeze(x, keep) if keep else x


@converts("BroadcastTo", "BroadcastToView")
def _broadcast_to(prim, x, shape):
    xs = typeof(x).shape
    lead = len(shape) - len(xs)
    shape = tuple(xs[i - lead] if d == -1 else d for i, d in enumerate(shape))
    return fo.broadcast_to(x, shape)


@converts("ExpandAs")
def _expand_as(prim, x, other):
    # MindSpore has no CPU kernel for ExpandAs in a compiled graph (eagerly it runs).
    return _broadcast_to(prim, x, tuple(typeof(other).shape))


@converts("Flatten")
def _flatten(prim, x):
    return fo.reshape(x, (typeof(x).shape[0], -1)) if typeof(x).ndim > 1 else x


@converts("Concat")
def _concat(prim, tensors, axis=0):
    return fo.concat(list(tensors), int(axis))


@converts("Meshgrid")
def _meshgrid(prim, inputs, *args):
    # Native, so that one input (which MindSpore's graph kernel refuses; eager returns it
    # as is) traces too. The indexing is an argument, or an attribute holding MindSpore's
    # Indexing enum (0 "ij", 1 "xy").
    indexing = args[0] if args else _attr(prim, "indexing", "xy")
    indexing = {0: "ij", 1: "xy"}.get(indexing, indexing)
    if indexing not in ("xy", "ij") or any(len(typeof(x).shape) != 1 for x in inputs):
        return ms_call("Meshgrid", prim, (inputs, *args), {})  # MindSpore's own error
    axes = list(range(len(inputs)))
    if indexing == "xy" and len(inputs) > 1:
        axes[0], axes[1] = 1, 0
    shape = [0] * len(inputs)
    for x, a in zip(inputs, axes):
        shape[a] = typeof(x).shape[0]
    return tuple(fo.broadcast_to(fo.reshape(x, tuple(n if i == a else 1
                                                     for i, n in enumerate(shape))),
                                 tuple(shape)) for x, a in zip(inputs, axes))


@converts("AssignAdd", "AssignSub")
def _assign_add(prim, variable, value):
    # As an Assign of the sum: MindSpore's in-place kernels refuse the views vmap's loop
    # and shard's local blocks hand them ("Check view and inplace failed").
    # The sum is returned (not Assign's output) so that it differentiates as MindSpore's
    # AssignAdd does: into the value too, where Assign's derivative is zero.
    if not isinstance(value, (Tracer, backend.Tensor)) or (
            typeof(value).dtype != typeof(variable).dtype
            or len(typeof(value).shape) != len(typeof(variable).shape)):
        return ms_call(prim.name, prim, (variable, value), {})  # MindSpore's own error
    op = fo.add if prim.name == "AssignAdd" else fo.sub
    new = op(variable, value)
    assign(variable, new)
    return new


@converts("Split")
def _split(prim, x, axis=0, output_num=1):
    return fo.split(x, typeof(x).shape[int(axis)] // int(output_num), int(axis))


@converts("SplitTensor", "SplitTensorView")
def _split_tensor(prim, x, split_size, dim=0):
    return fo.split(x, int(split_size), int(dim))


@converts("SplitWithSize", "SplitWithSizeView")
def _split_with_size(prim, x, sizes, dim=0):
    return fo.split(x, tuple(sizes), int(dim))


@converts("Gather")
def _gather(prim, x, indices, axis=0, batch_dims=0):
    if batch_dims:
        raise UnsupportedOpError("MindSpore Gather with batch_dims != 0 has no fshard converter.")
    return fo.gather(x, indices, int(axis))


@converts("GatherD")
def _gather_d(prim, x, dim, index):
    # out[..., j, ...] = x[..., index[..., j, ...], ...] along `dim` (NB: take_along_axis),
    # as a one-hot contraction: sum_n onehot(index)[..., n] * x[..., n, ...].
    a = typeof(x)
    dim = int(dim) % a.ndim
    if tuple(typeof(index).shape[:dim]) + tuple(typeof(index).shape[dim + 1:]) != (
            tuple(a.shape[:dim]) + tuple(a.shape[dim + 1:])):
        raise UnsupportedOpError(
            f"MindSpore GatherD with index {typeof(index)} smaller than x {a} outside "
            f"dim {dim} has no fshard converter.")
    # MindSpore's index range is [-n, n) (a negative index counts from the end, so a
    # label -1 is the last class); an index outside it is an error in MindSpore, which a
    # traced index cannot raise: its result is NaN (for integer x, the dtype's minimum),
    # never a plausible number.
    n = a.shape[dim]
    index = fo.where(fo.less(index, 0), fo.add(index, n), index)
    low = fo.less(index, 0)
    bad = fo.where(low, low, fo.greater_equal(index, n))
    onehot = fo.one_hot(index, n, dtype=a.dtype)
    perm = tuple(i for i in range(a.ndim) if i != dim) + (dim,)
    xt = fo.expand_dims(fo.transpose(x, perm), dim)
    out = fo.reduce_sum(fo.mul(onehot, xt), -1)
    flag = float("nan") if dtypes.is_float(a.dtype) else int(np.iinfo(
        dtypes.to_numpy(a.dtype)).min) if a.dtype != dtypes.bool_ else False
    return fo.where(bad, fo.cast(flag, a.dtype), out)


@converts("StridedSlice")
def _strided_slice(prim, x, begin, end, strides, begin_mask=0, end_mask=0, ellipsis_mask=0,
                   new_axis_mask=0, shrink_axis_mask=0):
    if begin_mask or end_mask or ellipsis_mask or new_axis_mask or shrink_axis_mask:
        raise UnsupportedOpError(
            "MindSpore StridedSlice with masks has no fshard converter; index the traced "
            "value with Python slices (x[a:b]) instead.")
    idx = tuple(slice(int(b), int(e), int(s)) for b, e, s in zip(begin, end, strides))
    return fo.getitem(x, idx)


# -- answered with static information -----------------------------------------


@converts("typeof")
def _typeof(prim, x):
    from mindspore.common import dtype as mstype

    return mstype.TensorType(typeof(x).dtype)


@converts("sequence_len")
def _sequence_len(prim, seq):
    # len() of a shape holding a symbolic dimension (MindSpore's losses take the rank
    # with ops.tuple_len(ops.shape(x))): the rank is static.
    return len(seq)


# -- overloaded functions (mint.*, some ops.*): the raw Python call ----------------


@converts("functional.add")
def _f_add(prim, input, other, *, alpha=1):
    return _add(prim, input, other, alpha)


@converts("functional.nansum")
def _f_nansum(prim, input, dim=None, keepdim=False, *, dtype=None):
    # MindSpore has no CPU graph kernel for Nansum: a sum with the NaNs made zeros.
    # An integer input keeps its dtype (a bool one sums in int64), unlike sum's int64.
    dt = typeof(input).dtype
    if dtypes.is_float(dt):
        input = fo.where(fo.isnan(input), 0.0, input)
    out = ms_sum(input, _axis(dim), bool(keepdim), None if dtype is None else _dtype(dtype))
    return fo.cast(out, dt) if dtype is None and dtypes.is_int(dt) else out


@converts("functional.imag")
def _f_imag(prim, input):
    # MindSpore's graph mode has no type inference for this view ("RealViewFuncImpl::
    # InferType is not implemented"): a real input's imaginary part is zeros; a complex
    # one goes to the generic path. (mint.real stays generic: MindSpore differentiates
    # it into a complex64 gradient, which fshard's identity would not match.)
    if str(typeof(input).dtype).startswith("Complex"):
        return ms_call("imag", prim, (input,), {})
    return fo.zeros_like(input)


@converts("functional.sub")
def _f_sub(prim, input, other, *, alpha=1):
    return _sub(prim, input, other, alpha)


@converts("functional.mul")
def _f_mul(prim, input, other):
    return _mul(prim, input, other)


@converts("functional.div")
def _f_div(prim, input, other, *, rounding_mode=None):
    if rounding_mode is not None:
        raise UnsupportedOpError(
            f"div(rounding_mode={rounding_mode!r}) has no fshard converter; only true "
            "division traces.")
    return _div(prim, input, other)


def _f_extremum(is_max: bool):
    def convert(prim, input, dim=None, keepdim=False, *, out=None):
        if dim is None:
            return (fo.reduce_max if is_max else fo.reduce_min)(input)
        if not isinstance(dim, int):  # max(input, other): elementwise
            return (fo.maximum if is_max else fo.minimum)(input, dim)
        prim_name = "ArgMaxWithValue" if is_max else "ArgMinWithValue"
        index, value = _arg_with_value(types.SimpleNamespace(name=prim_name), input, dim,
                                       keepdim)
        return value, index

    return convert


converts("functional.max")(_f_extremum(True))
converts("functional.min")(_f_extremum(False))


@converts("functional.where")
def _f_where(prim, condition, input=None, other=None):
    if input is None:
        raise UnsupportedOpError("where(condition) (the indices of nonzero elements) has a "
                                 "data-dependent shape and cannot be traced.")
    return fo.where(condition, input, other)


for _name, _fn in (("less", fo.less), ("eq", fo.equal), ("greater_equal", fo.greater_equal)):
    converts(f"functional.{_name}")(lambda prim, input, other, _fn=_fn: _fn(input, other))


@converts("functional.gelu")
def _f_gelu(prim, input, *, approximate="none"):
    return fo.gelu(input, approximate)


# -- native ops: activations, scans and sorts, structure, masks, statistics, index
# arithmetic and losses (fshard.primitives.composite and .scans) --------------------

_REDUCTIONS = {0: "sum", 1: "mean", 2: "none"}  # MindSpore's Reduction enum


def _attr(prim, name: str, default=None):
    """An attribute of a MindSpore primitive (legacy ones keep them in ``attrs``)."""
    attrs = getattr(prim, "attrs", None) or {}
    if name in attrs:
        return attrs[name]
    return getattr(prim, name, default)


def _reduction(r) -> str:
    return _REDUCTIONS.get(r, r) if not isinstance(r, str) else r


for _names, _fn in (
    (("SiLU",), fo.silu), (("Mish", "MishExt"), fo.mish), (("HSwish",), fo.hardswish),
    (("HSigmoid",), fo.hardsigmoid), (("SeLU", "SeLUExt"), fo.selu), (("PReLU",), fo.prelu),
    (("Log1p",), fo.log1p), (("Expm1",), fo.expm1), (("Atan2", "Atan2Ext"), fo.atan2),
    (("Reciprocal",), fo.reciprocal), (("FloorDiv",), fo.floor_divide),
    (("FloorMod",), fo.remainder), (("IsNan",), fo.isnan), (("IsInf",), fo.isinf),
    (("IsFinite",), fo.isfinite), (("LogicalAnd",), fo.logical_and),
    (("LogicalOr",), fo.logical_or), (("LogicalXor",), fo.logical_xor),
    (("LogicalNot",), fo.logical_not), (("GatherNd",), fo.gather_nd),
    (("TensorScatterAdd",), fo.tensor_scatter_add), (("ReLU6",), fo.relu6),
    (("Softsign",), fo.softsign), (("FastGeLU",), fo.fast_gelu),
):
    converts(*_names)(lambda prim, *args, _fn=_fn: _fn(*args))


@converts("Elu", "EluExt")
def _elu(prim, x, alpha=1.0):
    return fo.elu(x, float(_scalar(alpha)))


@converts("CeLU")
def _celu(prim, x, alpha=None):
    return fo.celu(x, float(_scalar(_attr(prim, "alpha", 1.0) if alpha is None else alpha)))


@converts("SoftShrink", "HShrink")
def _shrink(prim, x, lambd=None):
    fn = fo.softshrink if prim.name == "SoftShrink" else fo.hardshrink
    return fn(x, float(_scalar(_attr(prim, "lambd", 0.5) if lambd is None else lambd)))


@converts("Hardtanh")
def _hardtanh(prim, x, min_val=-1, max_val=1):
    return fo.hardtanh(x, float(_scalar(min_val)), float(_scalar(max_val)))


@converts("LeakyReLUExt")
def _leaky_relu_ext(prim, x, negative_slope=0.01):
    return fo.leaky_relu(x, float(_scalar(negative_slope)))


@converts("Softplus")
def _softplus(prim, x):
    return fo.softplus(x, 1.0, float("inf"))  # the primitive itself has no threshold


@converts("SoftplusExt")
def _softplus_ext(prim, x, beta=1, threshold=20):
    return fo.softplus(x, float(_scalar(beta)), float(_scalar(threshold)))


@converts("ClampScalar", "ClampTensor")
def _clamp(prim, x, min=None, max=None):  # noqa: A002
    # a Tensor bound, of any size, keeps its dtype in the promotion, as in MindSpore's
    # ClampTensor (float16 x clamped by a float32 Tensor is float32)
    return fo.clamp(x, min, max)


@converts("functional.clamp", "functional.clip")
def _f_clamp(prim, input, min=None, max=None):  # noqa: A002
    return fo.clamp(input, min, max)


def _exclusive(x, out, axis: int, reverse: bool, identity):
    """The running result shifted by one place, ``identity`` entering at the start."""
    a = typeof(x)
    n = a.shape[axis]
    edge = fo.full(tuple(1 if i == axis else d for i, d in enumerate(a.shape)), identity,
                   typeof(out).dtype)
    if reverse:
        return fo.concat([fo.slice_array(out, [1 if i == axis else 0 for i in range(a.ndim)],
                                         list(a.shape)), edge], axis)
    return fo.concat([edge, fo.slice_array(out, [0] * a.ndim, [n - 1 if i == axis else d
                                                               for i, d in
                                                               enumerate(a.shape)])], axis)


@converts("CumSum", "CumProd")
def _cum(prim, x, axis, exclusive=False, reverse=False):
    axis, exclusive, reverse = int(axis), bool(_scalar(exclusive)), bool(_scalar(reverse))
    fn = fo.cumsum if prim.name == "CumSum" else fo.cumprod
    out = fn(x, axis, reverse)
    if exclusive and typeof(x).shape[axis % typeof(x).ndim]:
        out = _exclusive(x, out, axis % typeof(x).ndim, reverse,
                         0 if prim.name == "CumSum" else 1)
    return out


@converts("CumsumExt")
def _cumsum_ext(prim, x, dim, dtype=None):
    return fo.cumsum(_with_dtype(x, dtype), int(dim))


@converts("Sort")
def _sort_prim(prim, x):
    return fo.sort(x, int(_attr(prim, "axis", -1)), bool(_attr(prim, "descending", False)))


@converts("ArgSort")
def _argsort(prim, x, dim=-1, descending=False, stable=False):
    return fo.cast(fo.argsort(x, int(dim), bool(descending)), dtypes.int64)


@converts("TopK")
def _topk(prim, x, k):
    return fo.topk(x, int(_scalar(k)))


@converts("TopkExt")
def _topk_ext(prim, x, k, dim=-1, largest=True, sorted=True):  # noqa: A002
    values, idx = fo.topk(x, int(_scalar(k)), int(dim), bool(largest))
    return values, fo.cast(idx, dtypes.int64)


@converts("Stack")
def _stack(prim, tensors):
    return fo.stack(list(tensors), int(_attr(prim, "axis", 0)))


@converts("StackExt")
def _stack_ext(prim, tensors, dim=0):
    return fo.stack(list(tensors), int(dim))


@converts("Unstack")
def _unstack(prim, x):
    return fo.unstack(x, int(_attr(prim, "axis", 0)))


@converts("UnstackExtView")
def _unstack_ext(prim, x, dim=0):
    return fo.unstack(x, int(dim))


@converts("Tile")
def _tile(prim, x, multiples):
    return fo.tile(x, tuple(multiples))


@converts("ReverseV2")
def _flip(prim, x, axis):
    return fo.flip(x, tuple(axis))


@converts("Roll")
def _roll(prim, x, shifts, dims=None):
    return fo.roll(x, shifts, dims)


@converts("PadV3")
def _pad_v3(prim, x, paddings, value=None):
    if not _attr(prim, "paddings_contiguous", True):
        raise UnsupportedOpError("MindSpore PadV3 with paddings_contiguous=False has no "
                                 "fshard converter; give (before, after) pairs.")
    mode = _attr(prim, "mode", "constant")
    mode = {"edge": "replicate"}.get(mode, mode)
    return fo.pad_nd(x, tuple(paddings), mode, _scalar(value))


@converts("ConstantPadND")
def _constant_pad(prim, x, padding, value=0):
    return fo.pad_nd(x, tuple(padding), "constant", _scalar(value))


@converts("ReflectionPad1D", "ReflectionPad2D", "ReflectionPad3D", "ReplicationPad1D",
          "ReplicationPad2D", "ReplicationPad3D")
def _mode_pad(prim, x, padding):
    return fo.pad_nd(x, tuple(padding), "reflect" if "Reflection" in prim.name else
                     "replicate")


@converts("Tril", "Triu", "TrilExt")
def _tri(prim, x, diagonal=None):
    d = _attr(prim, "diagonal", 0) if diagonal is None else diagonal
    return (fo.triu if prim.name == "Triu" else fo.tril)(x, int(_scalar(d)))


@converts("MaskedFill")
def _masked_fill(prim, x, mask, value):
    return fo.masked_fill(x, mask, _scalar(value))


@converts("functional.floor_divide")
def _f_floor_divide(prim, input, other):
    return fo.floor_divide(input, other)


@converts("functional.remainder")
def _f_remainder(prim, input, other):
    return fo.remainder(input, other)


@converts("NanToNum")
def _nan_to_num(prim, x, nan=None, posinf=None, neginf=None):
    nan = _attr(prim, "nan", 0.0) if nan is None else nan
    return fo.nan_to_num(x, float(_scalar(nan)), _scalar(posinf), _scalar(neginf))


@converts("IsClose")
def _isclose(prim, x, y, rtol=1e-5, atol=1e-8, equal_nan=False):
    return fo.isclose(x, y, float(_scalar(rtol)), float(_scalar(atol)), bool(equal_nan))


@converts("ProdExt")
def _prod(prim, x, axis=None, keep_dims=False, dtype=None):
    if dtype is None and not dtypes.is_float(typeof(x).dtype):
        dtype = dtypes.int64  # MindSpore multiplies bool and integers as int64
    return fo.prod(x, _axis(axis), bool(keep_dims), None if dtype is None else _dtype(dtype))


@converts("ReduceStd")
def _reduce_std(prim, x, axis=(), unbiased=False, keep_dims=False):
    v, mu = fo.var_mean(x, _axis(axis), 1 if unbiased else 0, bool(keep_dims))
    return fo.sqrt(v), mu


@converts("Std", "Var", "StdMean")
def _std_var(prim, x, dim=None, correction=1, keepdim=False):
    v, mu = fo.var_mean(x, _axis(dim), int(_scalar(correction)), bool(keepdim))
    if prim.name == "Var":
        return v
    return fo.sqrt(v) if prim.name == "Std" else (fo.sqrt(v), mu)


@converts("LpNorm")
def _lp_norm(prim, x):
    # MindSpore's LpNorm (ops.dist's) differentiates as x|x|^(p-2) / max(norm, eps)^(p-1):
    # 0 where the norm is 0 (but for p = 2 with eps = 0: NaN, as fs.ops.norm's and
    # ops.norm's). So a block that is all zeros takes its norm of ones, replaced by 0
    # after, and below eps the value is eps with that derivative. A half-precision
    # input is normed in float32, as MindSpore's kernel does: its eps (1e-12) is 0 in
    # float16, and 100 ** 3 overflows it.
    p, axis = float(_attr(prim, "p", 2)), _axis(_attr(prim, "axis", None))
    keep, eps = bool(_attr(prim, "keep_dims", False)), float(_attr(prim, "epsilon", 0.0))
    dtype = typeof(x).dtype
    half = dtypes.is_half(dtype)
    if half or not dtypes.is_float(dtype):
        x = fo.cast(x, dtypes.float32)
    if not eps and p == 2:
        out = fo.norm(x, p, axis, keep)
        return fo.cast(out, dtype) if half else out
    nonzero = fo.not_equal(fo.reduce_sum(fo.abs(x), axis, True), 0)  # (a NaN counts)
    out = fo.norm(fo.where(fo.broadcast_to(nonzero, typeof(x).shape), x, 1.0), p, axis, keep)
    out = fo.where(fo.reshape(nonzero, typeof(out).shape), out, 0.0)
    if eps:
        small = fo.less(out, eps)
        # (out / eps) ** (p - 1) where out < eps, else 1: at a norm far above eps the
        # power overflows, and the branch not taken must stay finite for the derivative
        scale = fo.stop_gradient(fo.pow(fo.div(fo.where(small, out, eps), eps), p - 1.0))
        below = fo.add(fo.mul(fo.sub(out, fo.stop_gradient(out)), scale), eps)
        out = fo.where(small, below, out)
    return fo.cast(out, dtype) if half else out


@converts("Slice")
def _slice(prim, x, begin, size):
    a = typeof(x)
    begin = tuple(int(b) for b in begin)
    limit = tuple(d if int(n) == -1 else b + int(n) for b, n, d in zip(begin, size, a.shape))
    return fo.slice_array(x, begin, limit)


@converts("NarrowView", "Narrow")
def _narrow(prim, x, dim, start, length):
    return fo.narrow(x, int(dim), int(_scalar(start)), int(_scalar(length)))


@converts("Dense")
def _dense(prim, x, w, b=None):
    return fo.dense(x, w, b)


# -- convolutions and pools (fshard.primitives.conv); a configuration the native ops
# do not cover (NHWC, a dilated max pool, a pooled depth) takes the generic path ------

_PAD_MODES = {0: "pad", 1: "same", 2: "valid"}  # MindSpore's PadMode enum


def _pad_mode(prim) -> str:
    m = _attr(prim, "pad_mode", "valid")
    return _PAD_MODES.get(m, m) if not isinstance(m, str) else m.lower()


def _hw(v) -> tuple:
    """A MindSpore (h, w) attribute given as an int, (h, w) or (1, 1, h, w)."""
    if isinstance(v, (int, np.integer)):
        return (int(v), int(v))
    return tuple(int(e) for e in tuple(v)[-2:])


def _nchw(prim) -> bool:
    return _attr(prim, "data_format", "NCHW") in ("NCHW", "NCDHW", 0)


def _conv_padding(prim, spatial, kernel, stride, dilation):
    mode = _pad_mode(prim)
    if mode == "pad":
        p = _attr(prim, "pad", 0)
        return tuple(int(e) for e in p) if isinstance(p, (tuple, list)) else int(p)
    if mode == "same":
        return sum((same_padding(n, k, s, d) for n, k, s, d in zip(spatial, kernel, stride,
                                                                      dilation)), ())
    return "valid"


@converts("Conv2D")
def _conv2d(prim, x, w):
    if not _nchw(prim):
        return ms_call("Conv2D", prim, (x, w), {})
    stride, dilation = _hw(_attr(prim, "stride", 1)), _hw(_attr(prim, "dilation", 1))
    pads = _conv_padding(prim, typeof(x).shape[2:], typeof(w).shape[2:], stride, dilation)
    return fo.conv2d(x, w, None, stride, pads, dilation, int(_attr(prim, "group", 1)))


@converts("Conv2DTranspose", "Conv2DBackpropInput")
def _conv2d_transpose(prim, dout, w, input_size):
    if not _nchw(prim) or any(isinstance(d, Tracer) for d in tuple(input_size)):
        return ms_call(prim.name, prim, (dout, w, input_size), {})
    shape = tuple(int(_scalar(d)) for d in tuple(input_size))
    stride, dilation = _hw(_attr(prim, "stride", 1)), _hw(_attr(prim, "dilation", 1))
    pads = _conv_padding(prim, shape[2:], typeof(w).shape[2:], stride, dilation)
    return fo.conv2d_input_grad(dout, w, shape, stride, pads, dilation,
                                int(_attr(prim, "group", 1)))


@converts("MaxPool")
def _max_pool(prim, x):
    if not _nchw(prim) or typeof(x).ndim != 4:
        return ms_call("MaxPool", prim, (x,), {})
    return fo.max_pool2d(x, _hw(_attr(prim, "kernel_size")), _hw(_attr(prim, "strides")),
                         _pad_mode(prim))


# argmax_type: a type id (MaxPoolWithArgmaxV2) or a name (MaxPool3DWithArgmax)
_ARGMAX_TYPES = {3: dtypes.int32, 4: dtypes.int64, "int32": dtypes.int32,
                 "int64": dtypes.int64}


@converts("MaxPoolWithArgmaxV2")
def _max_pool_argmax(prim, x):
    if (_hw(_attr(prim, "dilation", 1)) != (1, 1) or typeof(x).ndim != 4
            or _attr(prim, "argmax_type", 4) not in _ARGMAX_TYPES):
        return ms_call("MaxPoolWithArgmaxV2", prim, (x,), {})
    v, i = fo.max_pool2d_with_indices(x, _hw(_attr(prim, "kernel_size")),
                                      _hw(_attr(prim, "strides")), _hw(_attr(prim, "pads")),
                                      bool(_attr(prim, "ceil_mode", False)))
    return v, fo.cast(i, _ARGMAX_TYPES[_attr(prim, "argmax_type", 4)])


def _depth_one(prim, x, pads_name: str, ksize_name: str) -> bool:
    """A 3-D pool over a depth of 1 with a window of depth 1: a 2-D pool (how
    MindSpore runs nn.MaxPool2d and ops.avg_pool2d with explicit padding)."""
    k, s = tuple(_attr(prim, ksize_name))[-3:], tuple(_attr(prim, "strides"))[-3:]
    pads = tuple(_attr(prim, pads_name, (0,) * 6))
    dil = tuple(_attr(prim, "dilation", (1, 1, 1)))
    return (typeof(x).ndim == 5 and typeof(x).shape[2] == 1 and k[0] == 1 and s[0] == 1
            and pads[0] == 0 and (len(pads) == 3 or pads[1] == 0) and all(d == 1 for d in dil)
            and _nchw(prim))


@converts("MaxPool3DWithArgmax")
def _max_pool3d_argmax(prim, x):
    if not _depth_one(prim, x, "pads", "ksize") or \
            _attr(prim, "argmax_type", "int64") not in _ARGMAX_TYPES:
        return ms_call("MaxPool3DWithArgmax", prim, (x,), {})
    n, c, _, h, w = typeof(x).shape
    pads = tuple(_attr(prim, "pads"))
    pads = pads[1:] if len(pads) == 3 else pads[3::2]
    v, i = fo.max_pool2d_with_indices(fo.reshape(x, (n, c, h, w)),
                                      tuple(_attr(prim, "ksize"))[-2:],
                                      tuple(_attr(prim, "strides"))[-2:], pads,
                                      bool(_attr(prim, "ceil_mode", False)))
    s = typeof(v).shape
    i = fo.cast(i, _ARGMAX_TYPES[_attr(prim, "argmax_type", "int64")])
    return fo.reshape(v, (n, c, 1) + s[2:]), fo.reshape(i, (n, c, 1) + s[2:])


@converts("AvgPool")
def _avg_pool(prim, x, *attrs):
    # called with its attributes as arguments: (kernel_size, strides, pad_mode, data_format)
    k, s, mode, fmt = attrs or (_attr(prim, "kernel_size"), _attr(prim, "strides"),
                                _attr(prim, "pad_mode"), _attr(prim, "data_format", 0))
    if fmt not in (0, "NCHW") or typeof(x).ndim != 4:
        return ms_call("AvgPool", prim, (x, *attrs), {})
    mode = _PAD_MODES.get(mode, mode) if not isinstance(mode, str) else mode.lower()
    # 'same' counts only the input's positions (TensorFlow's convention)
    return fo.avg_pool2d(x, _hw(k), _hw(s), mode, count_include_pad=mode != "same")


@converts("AvgPool3D")
def _avg_pool3d(prim, x):
    if not _depth_one(prim, x, "pad_list", "kernel_size") or _pad_mode(prim) != "pad":
        return ms_call("AvgPool3D", prim, (x,), {})
    n, c, _, h, w = typeof(x).shape
    d = int(_attr(prim, "divisor_override", 0))
    y = fo.avg_pool2d(fo.reshape(x, (n, c, h, w)), tuple(_attr(prim, "kernel_size"))[-2:],
                      tuple(_attr(prim, "strides"))[-2:], tuple(_attr(prim, "pad_list"))[2:],
                      bool(_attr(prim, "ceil_mode", False)),
                      bool(_attr(prim, "count_include_pad", True)), d or None)
    return fo.reshape(y, (n, c, 1) + typeof(y).shape[2:])


@converts("AdaptiveAvgPool2D")
def _adaptive_avg_pool(prim, x):
    # MindSpore marks a kept size (None) as -1
    size = tuple(None if s is None or s == -1 else s for s in _attr(prim, "output_size"))
    if typeof(x).ndim == 3:
        return fo.adaptive_avg_pool2d(x[None], size)[0]
    return fo.adaptive_avg_pool2d(x, size)


@converts("ScatterNd")
def _scatter_nd(prim, indices, updates, shape):
    return fo.scatter_nd(indices, updates, tuple(shape))


@converts("ScatterAdd")
def _scatter_add_ref(prim, x, indices, updates):
    # On a traced value the update is functional: the result is the updated value.
    return fo.index_add(x, fo.reshape(indices, (-1,)) if typeof(indices).ndim != 1 else
                        indices, fo.reshape(updates, (-1,) + tuple(typeof(x).shape[1:]))
                        if typeof(indices).ndim != 1 else updates, 0)


@converts("IndexAdd")
def _index_add(prim, x, indices, y):
    return fo.index_add(x, indices, y, int(_attr(prim, "axis", 0)))


@converts("functional.index_add")
def _f_index_add(prim, input, dim, index, source, *, alpha=1):
    return fo.index_add(input, index, source, int(dim), _scalar(alpha))


@converts("ScatterAddExt")
def _scatter_add_ext(prim, x, dim, index, src):
    return fo.scatter_add_elements(x, int(dim), index, src)


@converts("functional.repeat_interleave")
def _f_repeat_interleave(prim, input, repeats, dim=None, *, output_size=None):
    return fo.repeat_interleave(input, repeats, dim)


@converts("BCEWithLogitsLoss")
def _bce_with_logits(prim, logits, label, weight=None, pos_weight=None, reduction=1):
    return fo.binary_cross_entropy_with_logits(logits, label, weight, pos_weight,
                                               _reduction(reduction))


@converts("KLDivLoss")
def _kl_div_loss(prim, logits, labels):
    return fo.kl_div(logits, labels, _attr(prim, "reduction", "mean"))


@converts("KLDiv")
def _kl_div(prim, logits, labels, reduction=1, log_target=False):
    return fo.kl_div(logits, labels, _reduction(reduction), bool(log_target))


@converts("SmoothL1Loss")
def _smooth_l1(prim, x, target, beta=1.0, reduction="none"):
    return fo.smooth_l1_loss(x, target, float(_scalar(beta)), _reduction(reduction))


# -- MindSpore's collective op classes ----------------------------------------------
#
# ops.AllReduce() and the others, called inside a function fshard traces, become
# fshard's collectives over the mesh axes their ``group`` names: the world group is
# every axis of the enclosing fs.shard_map (or, in a job's fs.jit outside any
# shard_map, every axis of the job's mesh); a group name equal to a mesh axis name is
# that axis; a group made by fs.distributed.create_group (or, in a job, by MindSpore's
# create_group) is the mesh axes its ranks differ along.

#: The primitives converted whenever a transform traces, even on constant operands:
#: run eagerly, MindSpore's collectives need a joined job (and crash without one), and
#: Print would print once, at trace time, instead of at every run.
_TRACE_ONLY = frozenset({"AllReduce", "AllGather", "ReduceScatter", "Broadcast", "AlltoAll",
                         "NeighborExchange", "NeighborExchangeV2", "Print"})

_WORLD_GROUPS = frozenset({"hccl_world_group", "nccl_world_group", "mccl_world_group"})


def _comm_axes(prim) -> tuple:
    """``(axis names, job mesh or None)`` that MindSpore's collective ``prim``
    communicates over. The job mesh is set only in a job's fs.jit outside any
    shard_map (the collectives then carry it themselves)."""
    group = prim.attrs.get("group", "hccl_world_group")
    body = C.replica_axes()
    if body:
        names, sizes, job_mesh = tuple(body), tuple(C.axis_size(n) for n in body), None
    else:
        job_mesh = resolve_mesh()
        if job_mesh.is_virtual:
            raise AxisNameError(
                f"ops.{prim.name}(group={group!r}){_call_site(_stack())} was traced outside "
                "any fs.shard_map, in one process: there are no devices to communicate "
                "with.\nFix: call it inside fs.shard_map(f, in_strategy, out_strategy, "
                "mesh=fs.Mesh((n,), ('dp',))) (a virtual mesh of n devices), or run the "
                "script as a job (python -m fshard.launch -n N script.py, after "
                "fs.distributed.init()), where an fs.jit function communicates over the "
                "job's world.")
        names, sizes = job_mesh.axis_names, job_mesh.shape
    if group in _WORLD_GROUPS or group == _world_group_name():
        return names, job_mesh
    if group in names:
        return (group,), job_mesh
    ranks = distributed.group_ranks(group)
    mesh = Mesh(sizes, names, virtual=True)
    if ranks is None:
        raise AxisNameError(
            f"ops.{prim.name}(group={group!r}){_call_site(_stack())}: fshard knows no group "
            f"of that name (the mesh axes here are {names}).\nFix: create it with "
            f"fs.distributed.create_group({group!r}, rank_ids) before tracing, or pass a "
            f"mesh axis name as the group (group={names[0]!r}).")
    for k in range(1, len(names) + 1):
        for combo in itertools.combinations(names, k):
            if max(ranks) < mesh.size and tuple(ranks) == mesh.axis_group(combo, ranks[0]):
                return combo, job_mesh
    groups = {c: mesh.axis_groups(c)[0] for c in names}
    raise AxisNameError(
        f"ops.{prim.name}(group={group!r}){_call_site(_stack())}: its ranks {list(ranks)} "
        f"are not the devices of some axes of the mesh {dict(zip(names, sizes))} (in "
        f"increasing order), which is what fshard can trace once for every device.\nFix: "
        f"use a group of the mesh's axes, e.g. "
        + ", ".join(f"{list(g)} (axis {c!r})" for c, g in groups.items())
        + ", or pass the axis name as the group.")


def _world_group_name() -> str:
    from mindspore.communication import GlobalComm

    return GlobalComm.WORLD_COMM_GROUP


def _communicate(prim, fn, *xs):
    """``fn(names, *xs)`` with fshard's collectives over ``prim``'s group. In a job's
    fs.jit outside any shard_map, ``fn`` is staged with the job's mesh axes bound and
    each of its equations bound on this rank with the mesh (as shard_map's body is)."""
    names, job_mesh = _comm_axes(prim)
    if job_mesh is None:
        return fn(names, *xs)
    return _on_job_axes(names, job_mesh, fn, f"running ops.{prim.name} on this rank:", *xs)


def _on_job_axes(names, job_mesh, fn, what: str, *xs):
    """``fn(names, *xs)`` staged with the job's mesh axes bound, each of its equations
    then bound on this rank with the job's mesh."""
    out_tree = []

    def flat(*args):
        leaves, treedef = tree.flatten(fn(names, *args))
        out_tree.append(treedef)
        return leaves

    with contextlib.ExitStack() as stack:
        for n, size in zip(job_mesh.axis_names, job_mesh.shape):
            stack.enter_context(C.named_axis(n, size))
        program, consts = stage(flat, [typeof(x) for x in xs])
    outs = walk(program, list(consts) + list(xs),
                lambda eq, vals: bind_on_rank(eq, vals, job_mesh), what)
    return tree.unflatten(out_tree[0], outs)


_REDUCE_OPS = ("sum", "max", "min", "prod")


def _reduce_op(prim) -> str:
    op = str(prim.attrs.get("op", "sum"))
    if op not in _REDUCE_OPS:
        raise UnsupportedOpError(
            f"ops.{prim.name}(op={op!r}){_call_site(_stack())}: fshard traces the reduce ops "
            f"{_REDUCE_OPS} (ReduceOp.SUM, MAX, MIN, PROD).\nFix: use one of them.")
    return op


def _all_reduce(x, names, op: str):
    if op == "sum":
        return C.psum(x, names)
    if op == "max":
        return C.pmax(x, names)
    if op == "min":
        return C.pmin(x, names)
    return fo.prod(C.all_gather(x, names, axis=0), 0)  # prod: gathered, multiplied here


def _dim0(prim, x, n: int) -> int:
    a = typeof(x)
    if a.ndim == 0:
        raise ShapeError(f"ops.{prim.name}{_call_site(_stack())} needs a tensor of rank >= 1 "
                         f"(it works along dimension 0); got {a}.\nFix: reshape it to (1,).")
    return a.shape[0]


@converts("AllReduce")
def _ms_all_reduce(prim, x):
    op = _reduce_op(prim)
    return _communicate(prim, lambda names, v: _all_reduce(v, names, op), x)


@converts("AllGather")
def _ms_all_gather(prim, x):
    _dim0(prim, x, 1)
    return _communicate(prim, lambda names, v: C.all_gather(v, names, axis=0, tiled=True), x)


@converts("ReduceScatter")
def _ms_reduce_scatter(prim, x):
    op = _reduce_op(prim)

    def run(names, v):
        n = 1
        for name in names:
            n *= C.axis_size(name)
        size = _dim0(prim, v, n)
        if isinstance(size, int) and size % n:
            raise ShapeError(
                f"ops.ReduceScatter{_call_site(_stack())} over {n} devices needs dimension 0 "
                f"of its input {typeof(v)} to be divisible by {n}.\nFix: pad it to a "
                f"multiple of {n}.")
        if op == "sum":
            return C.psum_scatter(v, names, scatter_dimension=0, tiled=True)
        y = _all_reduce(v, names, op)
        shape = typeof(y).shape
        blocks = fo.reshape(y, (n, shape[0] // n) + tuple(shape[1:]))
        return fo.gather(blocks, C.axis_index(names), 0)

    return _communicate(prim, run, x)


@converts("Broadcast")
def _ms_broadcast(prim, xs):
    root = prim.attrs["root_rank"]

    def run(names, *vs):
        mesh = _body_mesh()
        if not (isinstance(root, int) and 0 <= root < mesh.size):
            raise ArgumentError(
                f"ops.Broadcast(root_rank={root!r}){_call_site(_stack())}: the root must be "
                f"a rank of the {mesh.size} devices.\nFix: use a root_rank in "
                f"[0, {mesh.size}).")
        # root_rank is a world rank; on a sub-group, every group broadcasts from the
        # device at the root's place in its own group (the code runs on every device).
        index = mesh.axis_group(names, root).index(root)
        return tuple(C.broadcast(v, names, root=index) for v in vs)

    single = not isinstance(xs, (tuple, list))
    out = _communicate(prim, run, *((xs,) if single else xs))
    return out[0] if single else out


def _body_mesh() -> Mesh:
    """The mesh whose axes are bound here (a shard_map body's, or the job's), as a
    virtual mesh: only its shape and names are read."""
    names = C.replica_axes() or tuple(a.name for a in C.bound_axes())
    return Mesh(tuple(C.axis_size(n) for n in names), names, virtual=True)


@converts("AlltoAll")
def _ms_all_to_all(prim, x):
    split_count = int(prim.attrs["split_count"])
    split_dim, concat_dim = int(prim.attrs["split_dim"]), int(prim.attrs["concat_dim"])

    def run(names, v):
        n = 1
        for name in names:
            n *= C.axis_size(name)
        if split_count != n:
            raise ArgumentError(
                f"ops.AlltoAll(split_count={split_count}){_call_site(_stack())}: its group has "
                f"{n} devices, and MindSpore sends one chunk to each.\nFix: "
                f"split_count={n}.")
        return C.all_to_all(v, names, split_dim, concat_dim, tiled=True)

    return _communicate(prim, run, x)


@converts("Print")
def _ms_print(prim, *args):
    """MindSpore's ``ops.Print``: at every run, each string argument and each tensor (as
    MindSpore shows a Tensor) on a line of its own."""
    # MindSpore prints a Python number, and a tuple or list (its tensors as tensors),
    # as Python shows it: only the arrays are operands, the rest is text
    arrays = []

    def is_array(a):
        return isinstance(a, (Tracer, np.ndarray)) or backend.is_tensor(a)

    def collect(a):
        if is_array(a):
            arrays.append(a)
        elif isinstance(a, (tuple, list)):
            for b in a:
                collect(b)

    for a in args:
        collect(a)

    def ms_print(*values):
        it = iter(values)

        def text(a, top):
            if is_array(a):
                return backend.tensor_text(next(it))
            if isinstance(a, (tuple, list)):
                inner = ", ".join(text(b, False) for b in a)
                if isinstance(a, list):
                    return f"[{inner}]"
                return f"({inner}{',' if len(a) == 1 else ''})"
            return a if top and isinstance(a, str) else repr(a)

        print("\n".join(text(a, True) for a in args), flush=True)

    debug_callback_p.bind(*arrays, callback=ms_print)


# -- NeighborExchange, NeighborExchangeV2 ------------------------------------------------
#
# MindSpore's point-to-point exchanges name their peers by rank ids that each process
# computes for itself, so they are traced only where each process traces its own
# program: a job's fs.jit outside any shard_map. On CPU each is emulated with one
# AllGather of the pieces each rank sends (NeighborExchangeV2: the halos of its
# border; NeighborExchange: its tensors), flattened into one buffer padded to the
# longest rank's, from which each rank cuts what its peers send it (the pieces
# MindSpore's own Ascend lowering, an AlltoAllv, would carry). The ranks' shapes and
# arguments are exchanged first, while tracing, so that every rank knows what every
# other sends and a mismatch is an error on every rank, not a hang. A rank that
# receives nothing still takes part: it keeps the AllGather (C.after, C.keep).

#: The 8 directions of send_rank_ids / recv_rank_ids, in MindSpore's order.
_DIRECTIONS = ("top", "top-right", "right", "bottom-right", "bottom", "bottom-left",
               "left", "top-left")
#: The [top, bottom, left, right] lens that bound each direction's piece: (rows, cols);
#: None means the whole height (rows) or width (cols).
_PIECE_SIDES = ((0, None), (0, 3), (None, 3), (1, 3), (1, None), (1, 2), (None, 2), (0, 2))


def _neighbor_refusal(prim, why: str) -> UnsupportedOpError:
    return UnsupportedOpError(
        f"ops.{prim.name}{_call_site(_stack())} {why}\nFix: inside fs.shard_map (or on a "
        "virtual mesh) write the exchange with fs.ppermute(x, axis_name, perm) (a list "
        "of (source, destination) device pairs along a mesh axis), e.g. a halo: "
        "fs.ppermute(x[:, -1:], 'w', [(i, i + 1) for i in range(n - 1)]). "
        f"ops.{prim.name} itself works in a multi-process job (python -m "
        "fshard.launch -n N script.py, or msrun), in a function compiled with fs.jit "
        "outside any shard_map; docs/collectives.md.")


def _int_list(prim, name: str, size: int, low: int) -> list:
    value = prim.attrs.get(name)
    ok = (isinstance(value, (list, tuple)) and len(value) == size and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value))
    if not ok:
        what = ("rank ids, -1 for none" if low < 0 else "lengths >= 0")
        raise ArgumentError(
            f"ops.{prim.name}({name}={value!r}){_call_site(_stack())}: {name} must be a list "
            f"of {size} ints ({what}).\nFix: e.g. {name}="
            f"{[-1] * size if low < 0 else [0] * size}.")
    return list(value)


def _neighbor_v2_args(prim, aval) -> tuple:
    """MindSpore's checks of NeighborExchangeV2's arguments, as fshard errors naming
    the argument: ``(send_ids, send_lens, recv_ids, recv_lens)``."""
    send_ids = _int_list(prim, "send_rank_ids", 8, -1)
    recv_ids = _int_list(prim, "recv_rank_ids", 8, -1)
    send_lens = _int_list(prim, "send_lens", 4, 0)
    recv_lens = _int_list(prim, "recv_lens", 4, 0)
    site = _call_site(_stack())
    for name, ids in (("send_rank_ids", send_ids), ("recv_rank_ids", recv_ids)):
        real = [i for i in ids if i != -1]
        if len(set(real)) != len(real):
            raise ArgumentError(
                f"ops.{prim.name}({name}={ids}){site}: a rank id appears twice; MindSpore "
                f"exchanges one piece per pair of ranks.\nFix: name each neighbour once, "
                f"-1 for the other directions.")
    for side1, side2, corner in ((0, 2, 1), (2, 4, 3), (4, 6, 5), (6, 0, 7)):
        sides = recv_ids[side1] != -1 and recv_ids[side2] != -1
        if sides != (recv_ids[corner] != -1):
            raise ArgumentError(
                f"ops.{prim.name}(recv_rank_ids={recv_ids}){site}: the {_DIRECTIONS[corner]} "
                f"corner (index {corner}) is received exactly when both its sides "
                f"({_DIRECTIONS[side1]}, index {side1}; {_DIRECTIONS[side2]}, index "
                f"{side2}) are, so that the output is a full rectangle.\nFix: "
                + (f"set recv_rank_ids[{corner}] to the corner's rank." if sides else
                   f"set recv_rank_ids[{corner}] to -1."))
    fmt = prim.attrs.get("data_format")
    if fmt != "NCHW":
        raise ArgumentError(
            f"ops.{prim.name}(data_format={fmt!r}){site}: MindSpore supports only 'NCHW'.\n"
            "Fix: data_format='NCHW' (transpose the input to (N, C, H, W) first).")
    if aval.ndim != 4:
        raise ShapeError(
            f"ops.{prim.name}{site} takes an (N, C, H, W) tensor; got {aval}.\nFix: "
            "reshape it to 4 dimensions.")
    for i, name in enumerate(("top", "bottom", "left", "right")):
        size = aval.shape[2 if i < 2 else 3]
        if isinstance(size, int) and send_lens[i] > size:
            raise ArgumentError(
                f"ops.{prim.name}(send_lens={send_lens}){site}: send_lens[{i}] ({name}) is "
                f"{send_lens[i]}, more than the input's {'H' if i < 2 else 'W'} = {size} "
                f"({aval}).\nFix: send at most {size}.")
    return send_ids, send_lens, recv_ids, recv_lens


def _piece(shape, lens, direction: int) -> tuple:
    """``(begin, end)`` over (H, W) of the piece of an input of ``shape`` (N, C, H, W)
    sent in ``direction`` with send ``lens`` [top, bottom, left, right]."""
    rows, cols = _PIECE_SIDES[direction]
    h, w = shape[2], shape[3]
    r = (0, h) if rows is None else (0, lens[0]) if rows == 0 else (h - lens[1], h)
    c = (0, w) if cols is None else (w - lens[3], w) if cols == 3 else (0, lens[2])
    return r, c


def _gather_now(names, job_mesh, values: np.ndarray) -> np.ndarray:
    """Every rank's ``values`` (int32, the same length on every rank), gathered now,
    while tracing: a compiled AllGather of its own, run before the traced program."""
    with context.setting(context.trace, None):
        out = _on_job_axes(names, job_mesh, lambda ns, v: C.all_gather(v, ns, axis=0),
                           "exchanging the ranks' shapes", values)
    return backend.to_numpy(out)


@converts("NeighborExchangeV2")
def _ms_neighbor_exchange_v2(prim, x):
    aval = typeof(x)
    send_ids, send_lens, recv_ids, recv_lens = _neighbor_v2_args(prim, aval)
    names, job_mesh, members, me = _neighbor_job(prim)
    n = len(members)
    site = _call_site(_stack())
    _check_ids_in_group(prim, "send_rank_ids", send_ids, n)
    _check_ids_in_group(prim, "recv_rank_ids", recv_ids, n)
    if any(not isinstance(d, int) for d in aval.shape):
        raise ShapeError(f"ops.{prim.name}{site} needs a static input shape; got {aval}.\n"
                         "Fix: declare the input's shape without symbolic dimensions.")
    # Every rank's shape and arguments, exchanged once while tracing: a mismatch then
    # is an error on every rank, instead of an AllGather of unequal sizes (which
    # corrupts or hangs the job), and each rank cuts exactly what its peer sends it.
    code = _dtype_code(aval.dtype)
    mine = np.array(list(aval.shape) + [code] + send_ids + send_lens + recv_ids + recv_lens,
                    np.int32)
    table = _gather_now(names, job_mesh, mine).reshape(n, -1).tolist()
    ranks = [{"shape": tuple(t[:4]), "code": t[4], "send": t[5:13], "send_lens": t[13:17],
              "recv": t[17:25], "recv_lens": t[25:29]} for t in table]
    if any(r["code"] != ranks[0]["code"] for r in ranks):
        others = [members[i] for i, r in enumerate(ranks) if r["code"] != ranks[0]["code"]]
        raise ArgumentError(
            f"ops.{prim.name}{site}: the ranks' inputs differ in dtype: rank(s) {others} "
            f"hold another than rank {members[0]} (this rank's input: {aval}). fshard "
            "exchanges the halos on CPU with one AllGather, which needs one dtype on every "
            "rank of the group.\nFix: cast every rank's input to the same dtype.")
    # What each rank sends, in its buffer: (peer index, direction, rows, cols) in
    # direction order, each piece flattened, every buffer padded to the longest.
    pieces = []
    for rq in ranks:
        sent = []
        for d, q in enumerate(rq["send"]):
            if q != -1:
                r, c = _piece(rq["shape"], rq["send_lens"], d)
                sent.append((q, d, r, c))
        pieces.append(sent)
    sources = {}  # direction -> (peer index, offset in its buffer, piece shape)
    for a, ra in enumerate(ranks):
        for d in range(8):
            p = ra["recv"][d]
            if p == -1:
                continue
            rp = ranks[p]
            if a not in rp["send"]:
                raise ArgumentError(
                    f"ops.{prim.name}{site}: rank {members[a]} receives its "
                    f"{_DIRECTIONS[d]} piece from rank {members[p]} (its recv_rank_ids "
                    f"{ra['recv']}), but rank {members[p]} sends nothing to it (its "
                    f"send_rank_ids {rp['send']}); MindSpore would wait forever.\nFix: "
                    f"make each rank's recv_rank_ids mirror its neighbours' send_rank_ids.")
            if rp["shape"][:2] != ra["shape"][:2]:
                raise ShapeError(
                    f"ops.{prim.name}{site}: rank {members[a]} (input {ra['shape']}) "
                    f"receives its {_DIRECTIONS[d]} piece from rank {members[p]} (input "
                    f"{rp['shape']}), whose N and C differ from its own.\nFix: give "
                    "neighbours inputs of the same N and C (MindSpore requires it).")
            r, c = _piece(rp["shape"], rp["send_lens"], rp["send"].index(a))
            want = (ra["recv_lens"][_PIECE_SIDES[d][0]] if _PIECE_SIDES[d][0] is not None
                    else ra["shape"][2],
                    ra["recv_lens"][_PIECE_SIDES[d][1]] if _PIECE_SIDES[d][1] is not None
                    else ra["shape"][3])
            if (r[1] - r[0], c[1] - c[0]) != want:
                raise ArgumentError(
                    f"ops.{prim.name}{site}: rank {members[a]} receives its "
                    f"{_DIRECTIONS[d]} piece from rank {members[p]} as {want[0]} x "
                    f"{want[1]} (H x W; its recv_lens {ra['recv_lens']}), but rank "
                    f"{members[p]} sends {r[1] - r[0]} x {c[1] - c[0]} (its send_lens "
                    f"{rp['send_lens']}{'' if rp['shape'] == ra['shape'] else ', input '}"
                    f"{'' if rp['shape'] == ra['shape'] else rp['shape']}).\nFix: make "
                    "recv_lens match the neighbours' send_lens, and the neighbours' "
                    "inputs fit (MindSpore requires it).")
            if a == me:
                offset = 0
                for q, _, pr, pc in pieces[p]:
                    if q == a:
                        break
                    offset += _piece_size(rp["shape"], pr, pc)
                sources[d] = (p, offset, (*ra["shape"][:2], *want))
        for d in range(8):
            q = ra["send"][d]
            if q != -1 and a not in ranks[q]["recv"]:
                raise ArgumentError(
                    f"ops.{prim.name}{site}: rank {members[a]} sends its {_DIRECTIONS[d]} "
                    f"piece to rank {members[q]} (its send_rank_ids {ra['send']}), but rank "
                    f"{members[q]} receives nothing from it (its recv_rank_ids "
                    f"{ranks[q]['recv']}).\nFix: make each rank's recv_rank_ids mirror its "
                    "neighbours' send_rank_ids.")
    sizes = [sum(_piece_size(rq["shape"], r, c) for _, _, r, c in sent)
             for rq, sent in zip(ranks, pieces)]
    width = max(sizes)

    def widen(got, x):
        """This rank's input with the received pieces around it (MindSpore's layout)."""
        got = dict(got, center=x)
        bands = []
        for row in ((7, 0, 1), (6, "center", 2), (5, 4, 3)):
            if row[1] in got:
                band = [got[k] for k in row if k in got]
                bands.append(band[0] if len(band) == 1 else fo.concat(band, 3))
        return bands[0] if len(bands) == 1 else fo.concat(bands, 2)

    if width == 0:  # nothing is sent on any rank (only empty pieces): no collective
        return widen({d: fo.zeros(shape, aval.dtype) for d, (_, _, shape) in sources.items()},
                     x)
    # Only the pieces this rank sends travel, padded to the longest rank's: the
    # AllGather moves (n-1) x the largest rank's pieces to each rank, not whole inputs.
    flat = [fo.reshape(fo.slice_array(x, [0, 0, r[0], c[0]], [*aval.shape[:2], r[1], c[1]]),
                       (_piece_size(aval.shape, r, c),)) for _, _, r, c in pieces[me]]
    if sizes[me] < width:
        # the padding depends on the input (C.after): under grad the buffer then has a
        # tangent on every rank, and every rank transposes the AllGather alike
        flat.append(C.after_p.bind(fo.zeros((width - sizes[me],), aval.dtype), x))
    buffer = flat[0] if len(flat) == 1 else fo.concat(flat, 0)

    def run(names, v, x):
        g = C.all_gather(v, names, axis=0)  # (n, width), in group order
        got = {d: fo.reshape(fo.slice_array(g, [p, start], [p + 1, start + math.prod(shape)]),
                             shape) for d, (p, start, shape) in sources.items()}
        # a rank that receives nothing keeps the AllGather (the others wait in it), and
        # under grad transposes it as they do
        return widen(got, x) if got else C.after_p.bind(x, g)

    return _communicate(prim, run, buffer, x)


def _piece_size(shape, rows, cols) -> int:
    return shape[0] * shape[1] * (rows[1] - rows[0]) * (cols[1] - cols[0])


def _dtype_code(dtype) -> int:
    """A number naming ``dtype`` the same way in every process."""
    return zlib.crc32(str(dtypes.canonical(dtype)).encode()) % (1 << 30)


def _neighbor_job(prim):
    """``(names, job_mesh, members, me)`` for a NeighborExchange(V2) traced in a job's
    fs.jit; refused where one trace serves every device, or in one process."""
    if C.replica_axes():
        raise _neighbor_refusal(
            prim, "was traced inside fs.shard_map, whose body is one program for every "
            "device, while its rank ids are each process's own; fshard does not trace it "
            "there.")
    if resolve_mesh().is_virtual:
        raise _neighbor_refusal(
            prim, "was traced in one process (no multi-process job): its rank ids name "
            "processes of a job, and there are none to exchange with.")
    names, job_mesh = _comm_axes(prim)
    members = job_mesh.axis_group(names, distributed.rank())
    return names, job_mesh, members, members.index(distributed.rank())


def _check_ids_in_group(prim, name: str, ids, n: int) -> None:
    if ids and max(ids) >= n:
        raise ArgumentError(
            f"ops.{prim.name}({name}={list(ids)}){_call_site(_stack())}: rank {max(ids)} is "
            f"not in its group of {n} ranks.\nFix: use rank ids in [0, {n}) (-1 for none).")


def _shape_list(prim, name: str, value, count: int, ids_name: str) -> list:
    ok = isinstance(value, (list, tuple)) and len(value) == count and all(
        isinstance(s, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool)
                                             and d >= 0 for d in s) for s in value)
    if not ok:
        raise ArgumentError(
            f"ops.{prim.name}({name}={value!r}){_call_site(_stack())}: {name} must hold one "
            f"shape (a list of ints >= 0) for each of the {count} rank(s) of {ids_name}.\n"
            f"Fix: e.g. {name}=({', '.join(['[2, 2]'] * max(count, 1))},).")
    return [tuple(s) for s in value]


@converts("NeighborExchange")
def _ms_neighbor_exchange(prim, xs):
    """MindSpore's ``NeighborExchange``: this rank's ``xs[i]`` goes to
    ``send_rank_ids[i]``, and output ``j`` is what ``recv_rank_ids[j]`` sent it (None
    where recv_rank_ids is empty). On CPU: one AllGather of each rank's tensors,
    flattened into one buffer."""
    site = _call_site(_stack())
    xs = list(xs) if isinstance(xs, (tuple, list)) else [xs]
    ids = {}
    for name in ("send_rank_ids", "recv_rank_ids"):
        value = prim.attrs.get(name)
        if not (isinstance(value, (list, tuple)) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
                and len(set(value)) == len(value)):
            raise ArgumentError(
                f"ops.{prim.name}({name}={value!r}){site}: {name} must be a list of distinct "
                f"rank ids >= 0.\nFix: e.g. {name}=[1].")
        ids[name] = list(value)
    send_ids, recv_ids = ids["send_rank_ids"], ids["recv_rank_ids"]
    send_shapes = _shape_list(prim, "send_shapes", prim.attrs.get("send_shapes"),
                              len(send_ids), "send_rank_ids")
    recv_shapes = _shape_list(prim, "recv_shapes", prim.attrs.get("recv_shapes"),
                              len(recv_ids), "recv_rank_ids")
    recv_type = dtypes.canonical(prim.attrs.get("recv_type"))
    avals = [typeof(x) for x in xs]
    if len(xs) != len(send_ids) or any(a.shape != s for a, s in zip(avals, send_shapes)):
        raise ShapeError(
            f"ops.{prim.name}{site}: its input is one tensor per rank of send_rank_ids "
            f"{send_ids}, shaped as send_shapes {[list(s) for s in send_shapes]}; got "
            f"({', '.join(str(a) for a in avals)}).\nFix: pass a tuple of tensors of "
            "those shapes.")
    if any(a.dtype != recv_type for a in avals):
        raise ArgumentError(
            f"ops.{prim.name}(recv_type={recv_type}){site}: the tensors it sends are "
            f"({', '.join(str(a) for a in avals)}), and every rank receives recv_type.\n"
            f"Fix: cast the inputs to {recv_type}, or set recv_type to their dtype.")
    names, job_mesh, members, me = _neighbor_job(prim)
    n = len(members)
    _check_ids_in_group(prim, "send_rank_ids", send_ids, n)
    _check_ids_in_group(prim, "recv_rank_ids", recv_ids, n)
    # Every rank's arguments, exchanged while tracing (their length first): each rank
    # then knows where in a peer's buffer its piece lies, and a mismatch is an error on
    # every rank rather than an exchange of unequal sizes.
    mine = [_dtype_code(recv_type), len(send_ids), len(recv_ids)]
    for i, s in list(zip(send_ids, send_shapes)) + list(zip(recv_ids, recv_shapes)):
        mine += [i, len(s), *s]
    width = int(_gather_now(names, job_mesh, np.array([len(mine)], np.int32)).max())
    table = _gather_now(names, job_mesh, np.array(mine + [0] * (width - len(mine)), np.int32))
    ranks = []
    for row in table.reshape(n, width).tolist():
        code, n_send, n_recv, rest = row[0], row[1], row[2], row[3:]
        pairs = []
        for _ in range(n_send + n_recv):
            ndim = rest[1]
            pairs.append((rest[0], tuple(rest[2:2 + ndim])))
            rest = rest[2 + ndim:]
        ranks.append({"code": code, "send": pairs[:n_send], "recv": pairs[n_send:]})
    sizes = [sum(int(np.prod(s)) for _, s in r["send"]) for r in ranks]
    for a, ra in enumerate(ranks):
        for p, shape in ra["recv"]:
            sent = dict(ranks[p]["send"])
            problem = (f"rank {members[p]} sends nothing to it (its send_rank_ids "
                       f"{[i for i, _ in ranks[p]['send']]})" if a not in sent else
                       f"rank {members[p]} sends {list(sent[a])}" if sent[a] != shape else
                       f"rank {members[p]} sends another dtype"
                       if ranks[p]["code"] != ra["code"] else None)
            if problem:
                raise ArgumentError(
                    f"ops.{prim.name}{site}: rank {members[a]} receives a {list(shape)} "
                    f"tensor from rank {members[p]}, but {problem}; MindSpore would fail "
                    f"or wait forever.\nFix: make each rank's recv_rank_ids, recv_shapes "
                    f"and recv_type mirror what its peers send.")
        for q, _ in ra["send"]:
            if a not in dict(ranks[q]["recv"]):
                raise ArgumentError(
                    f"ops.{prim.name}{site}: rank {members[a]} sends a tensor to rank "
                    f"{members[q]}, which receives nothing from it (its recv_rank_ids "
                    f"{[i for i, _ in ranks[q]['recv']]}).\nFix: make each rank's "
                    "recv_rank_ids mirror its peers' send_rank_ids.")
    width = max(sizes)
    # A rank with no recv_rank_ids gets None: MindSpore's shape inference gives an
    # exchange with no recv_shapes no value (not an empty tuple).
    if width == 0:  # nothing is sent on any rank (or only empty tensors): no collective
        return tuple(fo.zeros(s, recv_type) for s in recv_shapes) if recv_ids else None
    flat = [fo.reshape(x, (int(np.prod(a.shape)),)) for x, a in zip(xs, avals)]
    if sizes[me] < width:
        pad = fo.zeros((width - sizes[me],), recv_type)
        # depending on what this rank sends (C.after), the padding gives the buffer a
        # tangent under grad wherever the sent tensors have one
        flat.append(C.after_p.bind(pad, xs[0]) if xs else pad)
    buffer = flat[0] if len(flat) == 1 else fo.concat(flat, 0)
    # Under grad each rank transposes the AllGather where its buffer has a tangent. A
    # rank that sends nothing has none (nothing of it is differentiated), and a rank
    # that receives nothing has no cotangent to start from: the others' transposed
    # AllGather would wait for them. Refused where a tangent meets it (C.keep's jvp):
    # an error on the differentiating ranks, which stops the job.
    mute = [members[a] for a, r in enumerate(ranks) if not r["send"]]
    refusal = (
        f"ops.{prim.name}{site}: differentiating it on rank {members[me]}, "
        + ("which sends tensors but receives nothing: their gradients are the receivers' "
           "cotangents, which fshard's per-rank differentiation does not bring back to a "
           "rank whose result holds no part of the exchange" if not recv_ids else
           f"while rank(s) {mute} send nothing: fshard differentiates each rank's "
           "program on its own, and theirs would not take part in the transposed "
           "exchange that brings the cotangents back")
        + "; the job stops.\nFix: have every rank send and receive a tensor (e.g. a "
        "small one back to the ranks it receives from), or stop the gradient of what "
        "is sent (ops.stop_gradient).")

    def run(names, v):
        g = C.all_gather(v, names, axis=0)  # (n, width), in group order
        if not recv_ids or mute:
            # this rank keeps the AllGather that the others wait in (an effect: with
            # no recv_rank_ids its program has no value that could depend on it)
            C.keep_p.bind(g, refusal=refusal)
        if not recv_ids:
            return ()
        outs = []
        for p, shape in zip(recv_ids, recv_shapes):
            start = 0
            for q, s in ranks[p]["send"]:
                if q == me:
                    break
                start += int(np.prod(s))
            size = int(np.prod(shape))
            piece = fo.slice_array(g, [p, start], [p + 1, start + size])
            outs.append(fo.reshape(piece, shape))
        return tuple(outs)

    out = _communicate(prim, run, buffer)
    return out if recv_ids else None


# ---------------------------------------------------------------------------
# Tensor operators with a Tracer on the right (``tensor + tracer``)
# ---------------------------------------------------------------------------

# MindSpore's C++ Tensor operators raise instead of returning NotImplemented, so
# Python never reaches Tracer.__radd__: these replace Tensor's forward operators.
_TENSOR_OPERATORS: dict[str, Callable] = {
    "__add__": ms_add, "__sub__": ms_sub, "__mul__": ms_mul, "__truediv__": ms_div,
    "__matmul__": fo.matmul, "__pow__": fo.pow,
    "__lt__": fo.less, "__le__": fo.less_equal, "__gt__": fo.greater,
    "__ge__": fo.greater_equal, "__eq__": fo.equal, "__ne__": fo.not_equal,
    # In-place operators become their functional form (``t += tracer`` rebinds ``t``).
    "__iadd__": ms_add, "__isub__": fo.sub, "__imul__": ms_mul, "__itruediv__": ms_div,
    "__getitem__": fo.getitem,
    "__and__": fo.bitwise_and, "__or__": fo.bitwise_or, "__xor__": fo.bitwise_xor,
    "__floordiv__": fo.floor_divide, "__mod__": fo.remainder,
    "__ifloordiv__": fo.floor_divide, "__imod__": fo.remainder,
}
_TENSOR_UNSUPPORTED = ("__setitem__",)


# ---------------------------------------------------------------------------
# Dispatch and errors
# ---------------------------------------------------------------------------

# fshard/ (this file is fshard/adapter/interop.py) and, beside it, transforms/
_FSHARD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FSHARD_ROOT = os.path.dirname(_FSHARD_DIR)


def _is_fshard_file(fn: str) -> bool:
    return fn.startswith(_FSHARD_DIR) or fn.startswith(os.path.join(_FSHARD_ROOT, "transforms"))


def _frame_name(f) -> str:
    mod = f.f_globals.get("__name__", "?")
    return f"{mod}.{getattr(f.f_code, 'co_qualname', f.f_code.co_name)}"


def _call_site(frames) -> str:
    """' (called as mindspore.ops.xxx at file.py:12)' from frames innermost first."""
    api, user = None, None
    for f in frames:
        fn = f.f_code.co_filename
        if "mindspore" in fn and not _is_fshard_file(fn):
            api = f
        elif not _is_fshard_file(fn):
            user = f
            break
    parts = []
    if api is not None:
        parts.append(f"called as {_frame_name(api)}")
    if user is not None:
        parts.append(f"at {os.path.basename(user.f_code.co_filename)}:{user.f_lineno}")
    return f" ({' '.join(parts)})" if parts else ""


def _stack():
    f = sys._getframe(1)
    while f is not None:
        yield f
        f = f.f_back


def _describe(args) -> str:
    def one(a):
        if isinstance(a, Tracer):
            return f"traced {a.aval}"
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return f"Tensor {typeof(a)}"
        if isinstance(a, (list, tuple)):
            inner = ", ".join(one(b) for b in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        return repr(a)

    return ", ".join(one(a) for a in args)


def _is_captured_constant(t) -> bool:
    """Whether the Tensor ``t`` is already a constant of the program being traced: the
    program reads it when it runs, so writing into it now would change the values its
    earlier uses see."""
    consts = getattr(current_trace(), "const_vars", None)
    return consts is not None and id(t) in consts and consts[id(t)][0] is t


def _unsupported_operator(name: str, args) -> UnsupportedOpError:
    if name == "__setitem__" and not _has_tracer(args[1:]):
        return UnsupportedOpError(
            f"a MindSpore Tensor that the traced function already used was written into "
            f"(tensor[...] = value){_call_site(_stack())}. The traced program reads that "
            "Tensor when it runs, so every use of it, also those before this write, would "
            "see the new value.\nFix: make a traced copy and assign into it (t = t + 0, "
            "then t[...] = value), or build the Tensor fully before the transformed "
            "function reads it.")
    if name == "__setitem__":
        return UnsupportedOpError(
            f"a traced value was written into a MindSpore Tensor (tensor[...] = traced)"
            f"{_call_site(_stack())}. That is an in-place update of a concrete Tensor, which "
            "a traced program cannot record.\nFix: build the new array functionally, e.g. "
            "with fs.ops.where(mask, traced, tensor), fs.ops.concat or fs.ops.scatter_add.")
    return UnsupportedOpError(
        f"fshard cannot trace the MindSpore Tensor operator {name}{_call_site(_stack())} "
        f"with a traced operand: it has no mapping to fshard ops. It was called on "
        f"({_describe(args)}).\nFix: add '{name}' to _TENSOR_OPERATORS in "
        "fshard/adapter/interop.py, mapped to an fshard op function (declare a primitive first if "
        "needed; see docs/adding_a_primitive.md), or compute the value another way.")


def _generic(name: str, fn):
    """The converter of an op without one: fshard's generic path (one ``ms_op``
    equation calling ``fn``, the MindSpore primitive or overload itself)."""
    return lambda prim, *args, **kwargs: ms_call(name, fn, args, kwargs)


def _convert(name: str, prim, args, kwargs, call=None):
    """``call``: the object to call with ``args``/``kwargs`` on the generic path (the
    primitive, by default)."""
    conv = CONVERTERS.get(name) or _generic(name, prim if call is None else call)
    if operator_strategy(prim) is None:
        return conv(prim, *args, **kwargs)
    # ops.MatMul().shard(...): fs.shard runs the operator with that strategy.
    user = next((f for f in _stack() if "mindspore" not in f.f_code.co_filename
                 and not _is_fshard_file(f.f_code.co_filename)), None)
    return operator_call(prim, args, kwargs, lambda *a, **k: conv(prim, *a, **k), user)


def _staged_parameter(*args) -> bool:
    """Whether an operand is a MindSpore Parameter and this thread is tracing (see
    ``_has_tracer``)."""
    return context.trace.get() is not None and any(
        isinstance(a, backend.Parameter) for a in args)


def _has_tracer(args) -> bool:
    """Whether a call must be converted: an operand is traced, a shape holds a
    symbolic dimension (which exists only in a traced program), or, in the thread that
    is tracing, an operand is a MindSpore Parameter: a Parameter is a variable the
    compiled program reads at each call (``lift_parameters`` in transforms/jit.py), so
    what is computed from it (``self.weight * self.mask`` in a Cell a traced function
    closes over) must be traced too, not computed once now and kept as a constant."""
    for a in args:
        if isinstance(a, Tracer) or is_symbolic(a) or _staged_parameter(a):
            return True
        if type(a) in (list, tuple):
            for b in a:
                if isinstance(b, Tracer) or is_symbolic(b) or _staged_parameter(b):
                    return True
    return False


# ---------------------------------------------------------------------------
# Patched entry points (each wraps the original object it replaces)
# ---------------------------------------------------------------------------


# MindSpore's stateful random ops: traced once, a draw would become a constant of the
# Program (the same numbers at every call of a jitted function, in every vmap lane).
_STATEFUL_RANDOM = frozenset({
    "StandardNormal", "UniformReal", "UniformInt", "Uniform", "RandpermV2", "Randperm",
    "RandpermExt", "RandExt", "Randn", "RandInt", "RandLikeExt", "RandnLike", "RandIntLike",
    "NormalFloatFloat", "NormalTensorTensor", "NormalTensorFloat", "NormalFloatTensor",
    "Gamma", "RandomGamma", "Poisson", "RandomPoisson", "RandomCategorical", "Multinomial",
    "MultinomialExt", "RandomShuffle", "Bernoulli", "BernoulliExt", "Dropout", "DropoutExt",
    "DropoutGenMask", "DropoutDoMask", "Dropout2D", "Dropout3D", "TruncatedNormal",
    "LogNormalReverse",
    "StandardLaplace", "RandomChoiceWithMask", "UniformCandidateSampler",
    "LogUniformCandidateSampler", "InplaceUniform", "InplaceNormal", "InplaceRandom"})


def _refuse_random(name: str) -> None:
    """Raise for a stateful random op called while a transform traces."""
    if name not in _STATEFUL_RANDOM:
        return
    raise UnsupportedOpError(
        f"fshard refuses the stateful MindSpore random op '{name}'{_call_site(_stack())} "
        "inside a transform: traced once, its draw would be frozen into the program (the "
        "same numbers at every call of a jitted function and in every vmap lane).\nFix: "
        "draw the random numbers outside the transformed function and pass them in, e.g. "
        "fs.jit(f)(x, ops.randn(x.shape)), or thread a key: key, sub = fs.random.split(key); "
        "noise = fs.random.normal(sub, shape) (docs/random.md).")


def _call_arguments(prim):
    """``(args, kwargs)`` of the outermost ``prim.__call__`` on the stack (None if there
    is none): what calling ``prim`` again, eagerly or in a graph, takes. The arguments
    a ``pyboost_*`` function or ``_run_op`` got went through MindSpore's argument
    handlers (dtypes as enum ids, a subclass's extra attributes appended)."""
    found = None
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "__call__" and f.f_locals.get("self") is prim:
            found = f
        f = f.f_back
    if found is None:
        return None
    code, loc = found.f_code, found.f_locals
    names = code.co_varnames
    args = tuple(loc[n] for n in names[1:code.co_argcount])
    i = code.co_argcount + code.co_kwonlyargcount
    kwargs = {n: loc[n] for n in names[code.co_argcount:i]}
    if code.co_flags & 0x04:  # *args
        args += tuple(loc[names[i]])
        i += 1
    if code.co_flags & 0x08:  # **kwargs
        kwargs.update(loc[names[i]])
    return args, kwargs


def _convert_native(name: str, prim, args):
    """``_convert`` for the entry points below the primitive's ``__call__``."""
    if name not in CONVERTERS:
        found = _call_arguments(prim)
        if found is not None:
            return _convert(name, prim, *found)
    return _convert(name, prim, args, {})


def _wrap_pyboost(orig):
    def pyboost(prim, args):
        _refuse_random(prim.name)
        if _has_tracer(args):
            return _convert_native(prim.name, prim, args)
        return orig(prim, args)

    pyboost.__name__ = getattr(orig, "__name__", "pyboost")
    pyboost.__wrapped__ = orig
    return pyboost


def _wrap_run_op(orig):
    def _run_op(obj, op_name, args):
        _refuse_random(op_name)
        if _has_tracer(args) or op_name in _TRACE_ONLY:
            return _convert_native(op_name, obj, args)
        return orig(obj, op_name, args)

    _run_op.__wrapped__ = orig
    return _run_op


def _wrap_overload(orig):
    key = f"functional.{orig.name}"

    def overload(*args, **kwargs):
        _refuse_random(orig.name)
        if _has_tracer(args) or (kwargs and _has_tracer(kwargs.values())):
            return _convert(key, orig, args, kwargs, call=orig)
        return orig(*args, **kwargs)

    overload.__wrapped__ = orig
    return overload


_builtin_isinstance = isinstance
_TENSOR_CLASSES: tuple = ()  # mindspore.Tensor and its C++ base, set up lazily


def _isinstance(obj, cls):
    """``isinstance`` for MindSpore's Python modules while tracing: a Tracer counts as a
    Tensor, so argument checks (``_check_is_tensor``, ``Shape``, ``DType``, ...) accept it."""
    if _builtin_isinstance(obj, Tracer):
        if cls in _TENSOR_CLASSES or (type(cls) is tuple and any(
                c in _TENSOR_CLASSES for c in cls)):
            return True
    return _builtin_isinstance(obj, cls)


def _wrap_prim_call(orig):
    def __call__(self, *args, **kwargs):
        _refuse_random(self.name)
        if (_has_tracer(args) or (kwargs and _has_tracer(kwargs.values()))
                or self.name in _TRACE_ONLY):
            return _convert(self.name, self, args, kwargs)
        return orig(self, *args, **kwargs)

    __call__.__wrapped__ = orig
    return __call__


def _holds_tracer(cell) -> bool:
    """Whether ``fs.functional`` swapped a traced value in for a parameter of ``cell``
    or of one of its sub-Cells (then even a call on concrete inputs must trace)."""
    return (any(isinstance(p, Tracer) for p in backend.cell_params(cell).values())
            or any(c is not None and _holds_tracer(c)
                   for c in backend.cell_children(cell).values()))


# MindSpore's in-place ``cell.shard(in_strategy, out_strategy, parameter_plan)``: made
# into ``fs.shard(cell, ...)`` on the spot (MindSpore itself drops it in a single
# process) and kept on the Cell, which then runs through it whenever a transform traces
# the Cell. transforms/shard.py provides the maker (``register_cell_shard``: the
# transforms sit above this module).
CELL_SHARD_ATTR = "_fshard_cell_shard"
_cell_shard_maker: list = []


def register_cell_shard(make: Callable) -> None:
    """``make(cell, in_strategy, out_strategy, parameter_plan)`` -> the callable that
    runs a Cell annotated by ``cell.shard(...)``, as ``run(args, kwargs)``."""
    _cell_shard_maker[:] = [make]


def _record_cell_shard(orig):
    def shard(self, in_strategy, out_strategy=None, parameter_plan=None):
        if _cell_shard_maker:
            self.__dict__[CELL_SHARD_ATTR] = _cell_shard_maker[0](
                self, in_strategy, out_strategy, parameter_plan)
        out = orig(self, in_strategy, out_strategy, parameter_plan)
        run = self.__dict__.get(CELL_SHARD_ATTR)
        if run is not None and self.__dict__.get("_shard_fn") is not None:
            # In a job (MindSpore sets _shard_fn only when its group has several
            # ranks) an eager call would compile the Cell with MindSpore's partitioner,
            # which refuses the CPU: it runs as fs.shard(cell, ...) instead, the Cell
            # executed sharded as MindSpore's PyNative Cell.shard executes it.
            self._shard_fn = _eager_cell_shard(self, run)
        return out

    shard.__wrapped__ = orig
    shard.__doc__ = orig.__doc__
    return shard


def _eager_cell_shard(cell, run):
    def shard_fn(*args, **kwargs):
        with context.pushed(context.sharded_cells, id(cell)):  # its own call inside
            return run(args, kwargs)                            # traces plainly
    return shard_fn


def install_cell_shard_recorder() -> None:
    """Make ``nn.Cell.shard`` remember its arguments on the Cell (then do what MindSpore
    does). Installed once, when fshard is imported: a Cell is annotated in its
    ``__init__``, before any transform traces it."""
    from mindspore import nn

    if not hasattr(nn.Cell.shard, "__wrapped__"):
        nn.Cell.shard = _record_cell_shard(nn.Cell.shard)


def _wrap_cell_call(orig):
    # A Cell called on a Tracer runs its construct directly: GRAPH_MODE compilation,
    # requires_grad bookkeeping and hooks would all hand the Tracer to C++.
    def __call__(self, *args, **kwargs):
        if (_has_tracer(args) or (kwargs and _has_tracer(kwargs.values()))
                or _holds_tracer(self)):
            run = self.__dict__.get(CELL_SHARD_ATTR)
            if run is not None and id(self) not in _sharded_cells():
                with context.pushed(context.sharded_cells, id(self)):
                    return run(args, kwargs)
            if _is_pipeline_grad_reducer(self):
                # MindSpore's PipelineGradReducer sums the micro-batches' gradients that
                # its Pipeline wrapper accumulated; fshard differentiates the whole
                # batch's loss (a Pipeline wrapper's loss is the batch's), so the
                # gradients it is given are complete already.
                return _pipeline_grads(self, *args, **kwargs)
            stage = self.__dict__.get("_pipeline_stage")
            if stage is not None:  # MindSpore's cell.pipeline_stage = k: the inputs enter k
                args, kwargs = _enter_stage((args, kwargs), stage)
            if self.__dict__.get("_has_config_recompute"):  # cell.recompute(): fs.remat
                return remat_call(self.construct, args, kwargs, nothing_saveable,
                                  type(self).__name__)
            return self.construct(*args, **kwargs)
        return orig(self, *args, **kwargs)

    __call__.__wrapped__ = orig
    return __call__


def _is_pipeline_grad_reducer(cell) -> bool:
    return any(c.__name__ == "PipelineGradReducer" and c.__module__.startswith(
        "mindspore.parallel") for c in type(cell).__mro__)


def _pipeline_grads(cell, grads=None, *rest, **kwargs):
    """MindSpore's ``PipelineGradReducer(grads)`` in traced code: ``grads``, as given."""
    if grads is None or rest or kwargs:
        given = (0 if grads is None else 1) + len(rest)
        raise ArgumentError(
            f"{type(cell).__name__}(grads): called with {given} positional and "
            f"{len(kwargs)} keyword arguments; it takes the gradients alone.\nFix: "
            "grads = pp_grad_reducer(grads).")
    return grads


def _sharded_cells() -> tuple:
    return context.sharded_cells.get()


def _enter_stage(values, stage: int):
    check_not_in_vmap()
    return tree.map(lambda v: pipeline_split_p.bind(v, stage=stage)
                    if isinstance(v, Tracer) else v, values)


def _wrap_tensor_new(orig):
    # Tensor(traced[, dtype]) is the traced value (cast): a Tensor cannot hold it.
    def __new__(cls, *args, **kwargs):
        x = args[0] if args else kwargs.get("input_data")
        if isinstance(x, Tracer):
            dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
            return x if dtype is None else fo.cast(x, dtype)
        return orig(cls, *args, **kwargs)

    __new__.__wrapped__ = orig
    return staticmethod(__new__)


def _wrap_tensor_operator(name, orig, fn):
    if fn is None:
        def dunder(self, other, *rest):
            if isinstance(other, Tracer) or (type(other) is tuple and _has_tracer(other)) or (
                    rest and _has_tracer(rest)) or (
                    name == "__setitem__" and _is_captured_constant(self)):
                raise _unsupported_operator(name, (self, other, *rest))
            return orig(self, other, *rest)
    else:
        def dunder(self, other):
            if isinstance(other, Tracer) or (type(other) is tuple and _has_tracer(other)) \
                    or _staged_parameter(self, other):
                return fn(self, other)
            return orig(self, other)

    dunder.__name__ = name
    dunder.__wrapped__ = orig
    return dunder


def _parameter_methods() -> list[str]:
    """The Tensor methods a traced value has (``METHODS``, not the operators, which
    ``_TENSOR_OPERATORS`` and the primitives' entry points see) that a Parameter
    inherits as methods: MindSpore runs some in C++ without reaching a primitive's
    entry point (``weight.sum()``)."""
    cls = backend.Parameter
    return [name for name in METHODS if not name.startswith("__")
            and callable(getattr(cls, name, None))
            and not inspect.isdatadescriptor(inspect.getattr_static(cls, name))]


def _wrap_parameter_method(orig, fn):
    """A Parameter's method: traced in the thread that is tracing (see
    ``_has_tracer``: what is computed from a Parameter is read at each call)."""
    def method(self, *args, **kwargs):
        if context.trace.get() is not None:
            return fn(self, *args, **kwargs)
        return orig(self, *args, **kwargs)

    method.__name__ = getattr(orig, "__name__", "method")
    method.__wrapped__ = orig
    return method


# ---------------------------------------------------------------------------
# Finding the entry points (once, lazily) and swapping them (every trace)
# ---------------------------------------------------------------------------

_MISSING = object()


class _DictPatch:
    """Replace some names in one module's globals by wrappers of what was found there."""

    __slots__ = ("module", "d", "keys", "get", "makers", "originals", "old", "new")

    def __init__(self, module: str, d: dict, makers: dict):
        self.module, self.d, self.makers = module, d, makers
        self.keys = tuple(makers)
        self.get = operator.itemgetter(*self.keys)
        self.originals = self.current()
        self.old = dict(zip(self.keys, self.originals))
        self.new = {k: makers[k](v) for k, v in self.old.items()}

    def current(self) -> tuple:
        found = self.get(self.d)
        return found if len(self.keys) > 1 else (found,)


def _wrap_bincount(orig):
    """``mindspore.ops.bincount`` refused while tracing with its reason: its output's
    length, ``max(input) + 1`` (at least ``minlength``), depends on the input's values
    (MindSpore's code tests them with a Python ``if``)."""

    def bincount(input, weights=None, minlength=0):  # noqa: A002 (MindSpore's name)
        if not _has_tracer([input, weights]):
            return orig(input, weights, minlength)
        raise UnsupportedOpError(
            "ops.bincount has an output shape that depends on its operands' values "
            "(max(input) + 1 counts, at least minlength), which a traced program cannot "
            "have (its shapes are fixed when it is traced).\nFix: count into a length you "
            "know, n: fs.ops.one_hot(input, n).sum(0) (times the weights, as a column, "
            "for weighted counts), or call ops.bincount outside the traced function.")

    return bincount


def _trampoline(*args, _fshard_call=None, **kwargs):
    return _fshard_call(*args, **kwargs)


class _CodePatch:
    """Make one MindSpore Python function call a wrapper while tracing, by whatever
    reference it is reached (``ops.clip_by_norm``, or a name imported before tracing):
    the function object stays, its code becomes ``_trampoline``'s, which calls the
    wrapper of a copy of the original function (``wrap(original)``) held in its
    keyword defaults."""

    __slots__ = ("fn", "saved", "new")

    def __init__(self, fn, wrap: Callable):
        self.fn = fn
        self.saved = (fn.__code__, fn.__defaults__, fn.__kwdefaults__)
        original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__,
                                      fn.__defaults__, fn.__closure__)
        original.__kwdefaults__ = fn.__kwdefaults__
        self.new = (_trampoline.__code__, None, {"_fshard_call": wrap(original)})

    def set(self, values) -> None:
        self.fn.__code__, self.fn.__defaults__, self.fn.__kwdefaults__ = values


class _AttrPatch:
    """Replace one attribute of a class by a wrapper. ``original`` is ``_MISSING`` when
    the class did not define the attribute itself (it was inherited): restoring then
    deletes it again."""

    __slots__ = ("cls", "name", "maker", "original", "new")

    def __init__(self, cls, name: str, maker: Callable):
        self.cls, self.name, self.maker = cls, name, maker
        self.original = cls.__dict__.get(name, _MISSING)
        self.new = maker(getattr(cls, name))


_dict_patches: list[_DictPatch] = []
_isinstance_modules: list[dict] = []  # module globals that get an `isinstance` while tracing
# MindSpore's Python-level ops, layers and argument checks (not its Tensor class, its
# compiler or C++ bindings): there a Tracer must pass `isinstance(x, Tensor)`.
_ISINSTANCE_SCOPE = ("mindspore.ops.", "mindspore.nn.layer.", "mindspore.nn.loss.",
                     "mindspore.mint", *backend.PRIVATE_CHECK_MODULES)
_attr_patches: list[_AttrPatch] = []
_code_patches: list[_CodePatch] = []
_scanned_modules: set[str] = set()
_n_modules_seen = -1
_entry_points: dict[int, tuple[object, Callable]] = {}  # id(object) -> (object, wrap)


def _code_names(code, out: set) -> None:
    out.update(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_names(c, out)


def _names_used_by(module) -> set:
    """Global names referenced by the functions and methods a module defines."""
    out: set = set()
    modname = module.__name__
    for v in list(vars(module).values()):
        if isinstance(v, types.FunctionType) and v.__module__ == modname:
            _code_names(v.__code__, out)
        elif isinstance(v, type) and v.__module__ == modname:
            for a in list(vars(v).values()):
                if isinstance(a, (staticmethod, classmethod)):
                    a = a.__func__
                if isinstance(a, property):
                    for acc in (a.fget, a.fset):
                        if isinstance(acc, types.FunctionType):
                            _code_names(acc.__code__, out)
                elif isinstance(a, types.FunctionType):
                    _code_names(a.__code__, out)
    return out


def _module_entry_points() -> dict[int, tuple[object, Callable]]:
    """id -> (object, wrap) for MindSpore's module-global entry points."""
    if not _entry_points:
        wraps = {"pyboost": _wrap_pyboost, "overload": _wrap_overload, "run_op": _wrap_run_op}
        for obj, kind in backend.native_entry_points():
            _entry_points[id(obj)] = (obj, wraps[kind])
    return _entry_points


def _wrap_clip_by_norm(orig):
    """``mindspore.ops.clip_by_norm`` as it traces. MindSpore's function scales only
    when ``max_norm / (norm + 1e-6) < 1``, with a Python ``if`` on that tensor, which a
    traced value cannot answer; here the branch is data (``where``), the norm
    MindSpore's own (``_cal_total_norm``: ``(sum x^p)^(1/p)`` of the inputs' norms, no
    absolute value taken; for ``inf`` the largest magnitude). A NaN norm leaves the
    inputs as they are, as MindSpore's ``if`` does."""

    def clip_by_norm(x, max_norm, norm_type=2.0, error_if_nonfinite=False):
        many = type(x) in (list, tuple)
        xs = list(x) if many else [x]
        if not _has_tracer(xs):
            return orig(x, max_norm, norm_type, error_if_nonfinite)
        if error_if_nonfinite:
            raise ArgumentError(
                "ops.clip_by_norm(..., error_if_nonfinite=True) raises when the norm is "
                "NaN or infinite, which a traced value cannot tell while it is traced.\n"
                "Fix: pass error_if_nonfinite=False and check the norm after the step "
                "(ops.isfinite of the returned values), or clip outside the transform.")
        if norm_type == float("inf"):
            total = fo.reduce_max(fo.stack([fo.reduce_max(fo.abs(v)) for v in xs]))
        else:
            total = backend.clip_total_norm(xs, norm_type)
        coef = max_norm / (total + 1e-6)
        out = tuple(fo.where(coef < 1, coef * v, v) for v in xs)
        return out if many else out[0]

    clip_by_norm.__wrapped__ = orig
    return clip_by_norm


def _scan_module(modname: str, module) -> None:
    """Record a patch of the entry points that ``module``'s own code looks up."""
    d = getattr(module, "__dict__", None)
    if d is None or modname == backend.C_EXPRESSION:
        return
    entry_points = _module_entry_points()
    makers = {}
    for k, v in list(d.items()):
        e = entry_points.get(id(v))
        if e is not None and e[0] is v:
            makers[k] = e[1]
    used = _names_used_by(module) if makers or modname.startswith(_ISINSTANCE_SCOPE) else ()
    makers = {k: m for k, m in makers.items() if k in used}
    if makers:
        _dict_patches.append(_DictPatch(modname, d, makers))
    if modname.startswith(_ISINSTANCE_SCOPE) and "isinstance" in used and (
            "isinstance" not in d):
        _isinstance_modules.append(d)


def _setup() -> None:
    """Find the entry points: class attributes once; the module globals of every
    MindSpore module not seen before (re-checked only when modules were imported)."""
    global _n_modules_seen
    if not _attr_patches:
        _setup_classes()
    if len(sys.modules) == _n_modules_seen:
        return
    for modname, module in list(sys.modules.items()):
        if modname.startswith("mindspore") and modname not in _scanned_modules:
            _scanned_modules.add(modname)
            if module is not None:
                _scan_module(modname, module)
    _n_modules_seen = len(sys.modules)


def _setup_classes() -> None:
    from mindspore import Tensor, nn

    global _TENSOR_CLASSES
    _TENSOR_CLASSES = backend.tensor_classes()
    patches = [_AttrPatch(cls, "__call__", _wrap_prim_call)
               for cls in backend.pyboost_prim_classes()]
    patches.append(_AttrPatch(nn.Cell, "__call__", _wrap_cell_call))
    # Their own __call__ prints (Print) or raises NotImplementedError (graph-only
    # collectives): traced, they reach their converter.
    patches += [_AttrPatch(cls, "__call__", _wrap_prim_call)
                for cls in backend.own_call_prim_classes()]
    patches.append(_AttrPatch(Tensor, "__new__", _wrap_tensor_new))
    for name, fn in _TENSOR_OPERATORS.items():
        patches.append(_AttrPatch(
            Tensor, name, lambda orig, name=name, fn=fn: _wrap_tensor_operator(name, orig, fn)))
    for name in _TENSOR_UNSUPPORTED:
        patches.append(_AttrPatch(
            Tensor, name, lambda orig, name=name: _wrap_tensor_operator(name, orig, None)))
    patches += [_AttrPatch(backend.Parameter, name,
                           lambda orig, name=name: _wrap_parameter_method(orig, METHODS[name]))
                for name in _parameter_methods()]
    _attr_patches[:] = patches
    # MindSpore's Python functions whose own code branches on a tensor's value
    wraps = {"clip_by_norm": _wrap_clip_by_norm, "bincount": _wrap_bincount}
    _code_patches[:] = [_CodePatch(fn, wraps[name])
                        for name, fn in backend.value_branching_functions().items()]


# The patches are process-wide (they replace MindSpore's module and class attributes),
# so how many tracing() blocks are open is process state, not per-thread state: two
# threads tracing at once share one installation, made by the first to enter and
# undone by the last to leave, under a lock (the wrappers pass calls without a
# Tracer through to MindSpore, so other threads' eager code is unaffected).
_depth = 0
_installed: list = []  # what the outermost tracing() swapped in, to undo
_lock = threading.RLock()


def _install() -> None:
    _setup()
    done: list = []
    try:
        for i, p in enumerate(_dict_patches):
            if p.current() != p.originals:  # replaced since recorded: wrap what is there
                p = _dict_patches[i] = _DictPatch(p.module, p.d, p.makers)
            p.d.update(p.new)
            done.append(p)
        for i, a in enumerate(_attr_patches):
            if a.cls.__dict__.get(a.name, _MISSING) is not a.original:
                a = _attr_patches[i] = _AttrPatch(a.cls, a.name, a.maker)
            setattr(a.cls, a.name, a.new)
            done.append(a)
        for d in _isinstance_modules:
            if "isinstance" not in d:  # a module defining its own `isinstance` keeps it
                d["isinstance"] = _isinstance
                done.append(d)
        for c in _code_patches:
            c.set(c.new)
            done.append(c)
    except BaseException:
        _uninstall(done)
        raise
    _installed[:] = done


def _uninstall(done: list) -> None:
    for p in reversed(done):
        if type(p) is dict:
            del p["isinstance"]
        elif isinstance(p, _CodePatch):
            p.set(p.saved)
        elif isinstance(p, _DictPatch):
            p.d.update(p.old)
        elif p.original is _MISSING:
            delattr(p.cls, p.name)
        else:
            setattr(p.cls, p.name, p.original)
    done.clear()


def _tracer_type_error(e: TypeError) -> UnsupportedOpError | None:
    """A MindSpore TypeError about a Tracer argument, as an UnsupportedOpError."""
    if isinstance(e, FshardError) or "Tracer" not in str(e):
        return None
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    # MindSpore's C++ argument parser names the offending class ("<class 'fshard...");
    # a Python check names it too, and then the error comes from a MindSpore frame.
    if "<class 'fshard." not in str(e) and not (
            frames and "mindspore" in frames[-1].f_code.co_filename):
        return None
    site = _call_site(reversed(frames))
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UnsupportedOpError(
        f"MindSpore rejected a traced value{site}: {first}\nfshard traces MindSpore ops "
        "and nn Cells called on traced values, and the methods of the traced values "
        "themselves, but not this call (for example a method of a concrete Tensor given a "
        "traced argument).\nFix: call the corresponding fshard.ops function or a method "
        "of the traced value instead, or teach fshard/adapter/interop.py this entry point (see "
        "docs/tracing.md).")


@contextlib.contextmanager
def tracing():
    """While active, MindSpore calls involving a Tracer build fshard equations.

    Re-entrant: only the outermost entry swaps MindSpore's entry points in, and its exit
    (normal or by exception) puts the original objects back.

    >>> import mindspore as ms
    >>> from mindspore import ops
    >>> before = ms.Tensor.__add__
    >>> with tracing():
    ...     ms.Tensor.__add__ is before
    False
    >>> ms.Tensor.__add__ is before
    True
    """
    global _depth
    with _lock:
        if _depth == 0:
            _install()
        _depth += 1
    try:
        yield
    except TypeError as e:
        wrapped = _tracer_type_error(e)
        if wrapped is None:
            raise
        raise wrapped from e
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _uninstall(_installed)


def patched_objects() -> list[tuple[object, str, object]]:
    """``(namespace, name, original)`` for every object ``tracing()`` swaps: a module's
    globals dict or a class, the name in it, and the object found there (``None`` when
    the name is absent: an inherited class attribute, or a module's ``isinstance``).

    >>> len(patched_objects()) > 600
    True
    """
    _setup()
    out = []
    for p in _dict_patches:
        out.extend((p.d, k, v) for k, v in p.old.items())
    for a in _attr_patches:
        out.append((a.cls, a.name, None if a.original is _MISSING else a.original))
    out.extend((d, "isinstance", None) for d in _isinstance_modules)
    return out


# ---------------------------------------------------------------------------
# What traces (enumerated by tests/test_interop.py; listed in docs/tracing.md)
# ---------------------------------------------------------------------------

#: User-facing MindSpore functions that trace into fshard Programs.
SUPPORTED_OPS: tuple[str, ...] = (
    # elementwise
    "ops.add", "ops.sub", "ops.mul", "ops.div", "ops.pow", "ops.neg", "ops.abs",
    "ops.exp", "ops.log", "ops.tanh", "ops.sigmoid", "ops.relu", "ops.gelu", "ops.sqrt",
    "ops.rsqrt", "ops.square", "ops.erf", "ops.sin", "ops.cos", "ops.sign", "ops.floor",
    "ops.round",
    "ops.maximum", "ops.minimum",
    "ops.greater", "ops.greater_equal", "ops.less", "ops.less_equal", "ops.equal",
    "ops.not_equal", "ops.gt", "ops.ge", "ops.lt", "ops.le", "ops.eq", "ops.ne",
    "ops.where", "ops.select", "ops.cast", "ops.zeros_like", "ops.ones_like",
    # linear algebra and nn
    "ops.matmul", "ops.bias_add", "ops.softmax", "ops.log_softmax", "ops.layer_norm",
    "ops.cross_entropy", "ops.one_hot",
    # reductions
    "ops.sum", "ops.mean", "ops.amax", "ops.amin", "ops.max", "ops.min", "ops.argmax",
    "ops.logsumexp", "ops.any", "ops.all",
    # shape
    "ops.reshape", "ops.transpose", "ops.permute", "ops.expand_dims", "ops.squeeze",
    "ops.broadcast_to", "ops.flatten", "ops.concat", "ops.cat", "ops.split", "ops.gather",
    # mint
    "mint.add", "mint.sub", "mint.mul", "mint.div", "mint.matmul", "mint.bmm", "mint.exp",
    "mint.log", "mint.tanh", "mint.sigmoid", "mint.sqrt", "mint.rsqrt", "mint.abs",
    "mint.pow", "mint.maximum", "mint.minimum", "mint.eq", "mint.lt", "mint.gt",
    "mint.where", "mint.sum", "mint.mean", "mint.max", "mint.min", "mint.amax",
    "mint.argmax", "mint.softmax", "mint.reshape", "mint.permute", "mint.transpose",
    "mint.unsqueeze", "mint.squeeze", "mint.broadcast_to", "mint.cat", "mint.split",
    "mint.nn.functional.relu", "mint.nn.functional.gelu",
    # native ops (docs/ops.md)
    "ops.silu", "ops.elu", "ops.softplus", "ops.mish", "ops.hardswish", "ops.selu",
    "ops.prelu", "ops.clamp", "ops.clip", "ops.cumsum", "ops.cumprod", "ops.sort",
    "ops.argsort", "ops.topk", "ops.stack", "ops.unstack", "ops.tile",
    "ops.repeat_interleave", "ops.flip", "ops.roll", "ops.pad", "ops.tril", "ops.triu",
    "ops.masked_fill", "ops.floor_divide", "ops.remainder", "ops.isnan", "ops.isinf",
    "ops.isfinite", "ops.nan_to_num", "ops.logical_and", "ops.logical_or",
    "ops.logical_not", "ops.logical_xor", "ops.isclose", "ops.prod", "ops.var", "ops.std",
    "ops.std_mean", "ops.log1p", "ops.expm1", "ops.atan2", "ops.reciprocal", "ops.narrow",
    "ops.dense", "ops.gather_nd", "ops.scatter_nd", "ops.tensor_scatter_add",
    "ops.index_add", "ops.binary_cross_entropy_with_logits", "ops.kl_div",
    "ops.smooth_l1_loss", "ops.cosine_similarity", "mint.clamp", "mint.stack",
    "mint.remainder", "mint.floor_divide", "mint.narrow", "mint.index_add",
    "mint.nn.functional.silu", "mint.nn.functional.pad",
    # normalisation, interpolation and activations (docs/ops.md)
    "ops.batch_norm", "ops.group_norm", "ops.rms_norm", "ops.interpolate", "ops.relu6",
    "ops.hardtanh", "ops.softsign", "ops.celu", "ops.softshrink", "ops.hardshrink",
    "ops.fast_gelu", "mint.nn.functional.batch_norm", "mint.nn.functional.group_norm",
    "mint.nn.functional.interpolate", "mint.nn.functional.leaky_relu",
    "mint.nn.functional.relu6",
)

#: Operators and methods of mindspore.Tensor that work on traced values (and, for the
#: binary operators, with a real Tensor on the left and a traced value on the right).
SUPPORTED_TENSOR_METHODS: tuple[str, ...] = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__matmul__", "__rmatmul__", "__pow__", "__neg__", "__abs__",
    "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__iadd__",
    "sum", "mean", "max", "min", "argmax", "reshape", "view", "transpose", "permute",
    "swapaxes", "expand_dims", "unsqueeze", "squeeze", "flatten", "astype", "to", "float",
    "exp", "log", "tanh", "sigmoid", "sqrt", "rsqrt", "abs", "square", "matmul",
    "broadcast_to", "expand_as", "softmax", "add", "sub", "mul", "div", "maximum",
    "minimum", "pow", "neg", "masked_fill", "half", "int", "long", "bool", "numel", "T",
    "mT", "shape", "dtype", "ndim", "size", "dim",
    "clip", "clamp", "var", "std", "any", "all", "norm", "copy", "floor", "round", "tile",
    # native ops (docs/ops.md) and item assignment (docs/tracing.md)
    "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__setitem__", "cumsum",
    "cumprod", "sort", "argsort", "topk", "prod", "flip", "roll", "tril", "triu", "narrow",
    "repeat_interleave", "isnan", "isclose", "logical_and", "log1p", "remainder",
    "floor_divide", "tensor_split",
)

#: nn Cells whose construct traces (user Cells built from these trace too).
SUPPORTED_CELLS: tuple[str, ...] = (
    "nn.Dense", "nn.ReLU", "nn.GELU", "nn.Sigmoid", "nn.Tanh", "nn.Flatten",
    "nn.SequentialCell", "nn.LayerNorm", "nn.Softmax", "nn.LogSoftmax",
    "nn.SoftmaxCrossEntropyWithLogits",
    # native ops (docs/ops.md)
    "nn.SiLU", "nn.PReLU", "nn.ELU", "nn.HSwish", "nn.Mish", "nn.SeLU",
    "nn.BCEWithLogitsLoss", "nn.SmoothL1Loss",
    "nn.BatchNorm2d", "nn.BatchNorm1d", "nn.GroupNorm", "nn.Upsample", "nn.ReLU6",
    "nn.MultiheadAttention", "nn.TransformerEncoderLayer",
)


# ---------------------------------------------------------------------------
# MindSpore's auto-parallel context (ms.set_auto_parallel_context)
# ---------------------------------------------------------------------------
# A MindSpore script configures parallelism globally; fshard reads the settings where
# its own defaults would otherwise apply, and refuses by name what it cannot honour.
# An argument given to fshard always wins over the context.

#: The AutoParallel mode each MindSpore (parallel_mode, search_mode) means.
_MODES = {("semi_auto_parallel", None): "semi_auto",
          ("auto_parallel", "sharding_propagation"): "sharding_propagation",
          ("auto_parallel", "recursive_programming"): "recursive_programming"}


def context_dataset_strategy(where: str, allow_tuple: bool):
    """The dataset strategy the user set in MindSpore's context (``dataset_strategy=``
    or ``full_batch=``), or None. A tuple of per-input strategies is returned only
    where it applies (``allow_tuple``: an AutoParallel step's batch)."""
    given = backend.auto_parallel_settings()["dataset_strategy"]
    if isinstance(given, tuple) and not allow_tuple:
        raise ShardingError(
            f"{where}: ms.set_auto_parallel_context(dataset_strategy={given!r}) gives the "
            "dataset's per-input strategies, which fs.shard has no dataset inputs to apply "
            "to.\nFix: give the strategies as fs.shard's in_strategy, or train with "
            "fs.AutoParallel (it takes them), or reset the context "
            "(ms.reset_auto_parallel_context()).")
    return given


def context_mesh(mesh, where: str):
    """``mesh``, or, when it is None and MindSpore's context has ``device_num``, that
    many devices (a job's world, checked; else a virtual mesh). A ``device_num`` the
    mesh contradicts is an error."""
    from fshard.meshes import distributed
    from fshard.meshes.mesh import Mesh, current_mesh

    n = backend.auto_parallel_settings()["device_num"]
    if n is None:
        return mesh
    if mesh is None:
        mesh = current_mesh()
    if mesh is None:
        if distributed.is_initialized() and distributed.world_size() != n:
            raise ShardingError(
                f"{where}: ms.set_auto_parallel_context(device_num={n}) but this job has "
                f"{distributed.world_size()} processes (one device each).\nFix: "
                f"device_num={distributed.world_size()}, or drop device_num.")
        return n
    size = mesh.size if isinstance(mesh, Mesh) else mesh
    if size != n:
        raise ShardingError(
            f"{where}: ms.set_auto_parallel_context(device_num={n}) but the mesh has {size} "
            f"devices.\nFix: make them agree (device_num={size}, or a mesh of {n} "
            "devices), or drop device_num.")
    return mesh


def context_search(where: str):
    """For ``fs.shard``: whether MindSpore's context asks for a search over the whole
    program (``parallel_mode="auto_parallel"`` with ``search_mode``
    ``"recursive_programming"``: True; ``"sharding_propagation"``: False), or None (the
    context says nothing: fs.shard's default). ``"dynamic_programming"`` is refused."""
    s = backend.auto_parallel_settings()
    if s["parallel_mode"] != "auto_parallel":
        return None
    if s["search_mode"] == "dynamic_programming":
        raise ShardingError(
            f"{where}: ms.set_auto_parallel_context(search_mode='dynamic_programming') "
            "names MindSpore's dynamic-programming search, which fshard does not have.\n"
            "Fix: search_mode='sharding_propagation' (propagation) or "
            "'recursive_programming' (fshard's whole-program search).")
    return s["search_mode"] == "recursive_programming"


def check_context_mode(parallel_mode: str, where: str) -> None:
    """``fs.AutoParallel``'s ``parallel_mode`` against MindSpore's context: a context
    left at ``stand_alone`` (or ``data_parallel`` for ``semi_auto``) agrees; another
    mode that names a different AutoParallel mode is an error naming both."""
    s = backend.auto_parallel_settings()
    mode = s["parallel_mode"]
    if mode == "stand_alone" or (mode == "data_parallel" and parallel_mode == "semi_auto"):
        return
    if mode == "hybrid_parallel":
        raise ArgumentError(
            f"{where}: ms.set_auto_parallel_context(parallel_mode='hybrid_parallel') asks "
            "for MindSpore's hand-written model parallelism, which fshard does not run.\n"
            "Fix: drop that setting (fs.AutoParallel's parallel_mode decides), or write "
            "the communication with fs.shard_map.")
    if mode == "data_parallel":
        raise ArgumentError(
            f"{where}: ms.set_auto_parallel_context(parallel_mode='data_parallel') asks "
            f"for data parallelism only, but this AutoParallel's parallel_mode is "
            f"{parallel_mode!r}.\nFix: AutoParallel(..., parallel_mode='semi_auto') or "
            "drop the context's parallel_mode.")
    meant = _MODES.get((mode, s["search_mode"] if mode == "auto_parallel" else None))
    if meant != parallel_mode:
        said = f"parallel_mode={mode!r}" + (
            f", search_mode={s['search_mode']!r}" if mode == "auto_parallel" else "")
        raise ArgumentError(
            f"{where}: ms.set_auto_parallel_context({said}) means "
            f"{'parallel_mode=' + repr(meant) if meant else 'a mode fshard does not have'}, "
            f"but this AutoParallel's parallel_mode is {parallel_mode!r}.\nFix: make them "
            "agree, or drop the context's parallel_mode (AutoParallel's own decides).")


register_user_code_hook(tracing)
install_cell_shard_recorder()
