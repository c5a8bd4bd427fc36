"""Tracing native MindSpore code (fshard/adapter/interop.py).

Every entry of ``interop.SUPPORTED_OPS``, ``SUPPORTED_TENSOR_METHODS`` and
``SUPPORTED_CELLS`` has a case here; each case is traced, then run both compiled
(``fs.jit``) and by eager evaluation of its Program, and compared with calling
MindSpore directly (or a NumPy reference where MindSpore has no CPU kernel). Also:
MindSpore is restored exactly after tracing (also on errors), unsupported ops and
Python control flow give fshard errors, and Cells trace with explicit parameters.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import fshard as fs
from fshard.adapter import interop
from fshard.core.interpret import eval_program

RNG = np.random.default_rng(0)


def _normal(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


X = _normal(4, 8)
Y = _normal(4, 8)
POS = np.abs(_normal(4, 8)) + 0.5
W = _normal(8, 3)
B = _normal(3)
X3 = _normal(2, 4, 8)
Y3 = _normal(2, 8, 4)
G = _normal(8)
LABELS = np.array([0, 2, 1, 2], np.int32)
LABELS64 = LABELS.astype(np.int64)
WT = Tensor(W)  # a MindSpore constant closed over by traced functions
BT = Tensor(B)
XT = Tensor(X)


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype)


def _log_softmax(x, axis=-1):
    m = x.max(axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis, keepdims=True))


def _layer_norm(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


# name -> (function, numpy arguments[, numpy reference when MindSpore cannot run it on CPU])
OP_CASES = {
    "ops.add": (lambda x, y: ops.add(x, y), [X, Y]),
    "ops.sub": (lambda x: ops.sub(x, 2.0), [X]),
    "ops.mul": (lambda x, y: ops.mul(x, y), [X, Y]),
    "ops.div": (lambda x, y: ops.div(x, y), [X, POS]),
    "ops.pow": (lambda x: ops.pow(x, 2.0), [X]),
    "ops.neg": (ops.neg, [X]),
    "ops.abs": (ops.abs, [X]),
    "ops.exp": (ops.exp, [X]),
    "ops.log": (ops.log, [POS]),
    "ops.tanh": (ops.tanh, [X]),
    "ops.sigmoid": (ops.sigmoid, [X]),
    "ops.relu": (ops.relu, [X]),
    "ops.gelu": (lambda x: ops.gelu(x) + ops.gelu(x, approximate="tanh"), [X]),
    "ops.sqrt": (ops.sqrt, [POS]),
    "ops.rsqrt": (ops.rsqrt, [POS]),
    "ops.square": (ops.square, [X]),
    "ops.erf": (ops.erf, [X]),
    "ops.sin": (ops.sin, [X]),
    "ops.cos": (ops.cos, [X]),
    "ops.sign": (ops.sign, [X]),
    "ops.floor": (ops.floor, [X]),
    "ops.round": (ops.round, [X]),
    "ops.maximum": (lambda x, y: ops.maximum(x, y) + ops.maximum(x, 0.0), [X, Y]),
    "ops.minimum": (lambda x, y: ops.minimum(x, y), [X, Y]),
    "ops.greater": (lambda x, y: ops.greater(x, y), [X, Y]),
    "ops.greater_equal": (lambda x: ops.greater_equal(x, 0.0), [X]),
    "ops.less": (lambda x, y: ops.less(x, y), [X, Y]),
    "ops.less_equal": (lambda x, y: ops.less_equal(x, y), [X, Y]),
    "ops.equal": (lambda x: ops.equal(x, ops.relu(x)), [X]),
    "ops.not_equal": (lambda x: ops.not_equal(x, ops.relu(x)), [X]),
    "ops.gt": (lambda x, y: ops.gt(x, y), [X, Y]),
    "ops.ge": (lambda x, y: ops.ge(x, y), [X, Y]),
    "ops.lt": (lambda x, y: ops.lt(x, y), [X, Y]),
    "ops.le": (lambda x, y: ops.le(x, y), [X, Y]),
    "ops.eq": (lambda x: ops.eq(x, ops.relu(x)), [X]),
    "ops.ne": (lambda x: ops.ne(x, ops.relu(x)), [X]),
    "ops.where": (lambda x, y: ops.where(x > 0, x, y) + ops.where(x > y, x, 0.0), [X, Y]),
    "ops.select": (lambda x, y: ops.select(x > y, x, y), [X, Y]),
    "ops.cast": (lambda x: ops.cast(x, ms.float16) + ops.cast(x > 0, ms.float16), [X]),
    "ops.zeros_like": (lambda x: ops.zeros_like(x) + x, [X]),
    "ops.ones_like": (lambda x: ops.ones_like(x) + x, [X]),
    "ops.matmul": (lambda x, w: ops.matmul(x, w), [X, W]),
    "ops.bias_add": (lambda x, b: ops.bias_add(ops.matmul(x, WT), b), [X, B]),
    "ops.softmax": (lambda x: ops.softmax(x, -1) + ops.softmax(x, 0), [X]),
    "ops.log_softmax": (lambda x: ops.log_softmax(x, -1), [X]),
    "ops.layer_norm": (lambda x, g, b: ops.layer_norm(x, (8,), g, b, 1e-5), [X, G, G],
                       lambda x, g, b: _layer_norm(x, g, b, 1e-5)),
    "ops.cross_entropy": (lambda x, y: ops.cross_entropy(ops.matmul(x, WT), y),
                          [X, LABELS]),
    "ops.one_hot": (lambda y: ops.one_hot(y, 3, Tensor(2.0), Tensor(-1.0)) + 0.5, [LABELS]),
    "ops.sum": (lambda x: ops.sum(x, 1) + ops.sum(x), [X]),
    "ops.mean": (lambda x: ops.mean(x, 1, keep_dims=True) + ops.mean(x), [X]),
    "ops.amax": (lambda x: ops.amax(x, 1), [X]),
    "ops.amin": (lambda x: ops.amin(x, (0, 1)), [X]),
    "ops.max": (lambda x: ops.max(x, 1), [X]),
    "ops.min": (lambda x: ops.min(x, 0, keepdims=True), [X]),
    "ops.argmax": (lambda x: (ops.argmax(x, 1), ops.argmax(x)), [X]),
    "ops.logsumexp": (lambda x: ops.logsumexp(x, 1), [X]),
    "ops.any": (lambda x: (ops.any(x), ops.any(x > 0, 1)), [X]),
    "ops.all": (lambda x: (ops.all(x), ops.all(x > 0, (0,), True)), [X]),
    "ops.reshape": (lambda x: ops.reshape(x, (8, -1)), [X]),
    "ops.transpose": (lambda x: ops.transpose(x, (2, 0, 1)), [X3]),
    "ops.permute": (lambda x: ops.permute(x, (1, 0, 2)), [X3]),
    "ops.expand_dims": (lambda x: ops.expand_dims(x, 1), [X]),
    "ops.squeeze": (lambda x: ops.squeeze(ops.expand_dims(x, 0)), [X]),
    "ops.broadcast_to": (lambda b: ops.broadcast_to(b, (4, 3)) + ops.broadcast_to(b, (-1,)),
                         [B]),
    "ops.flatten": (lambda x: ops.flatten(x), [X3]),
    "ops.concat": (lambda x, y: ops.concat((x, y), 1), [X, Y]),
    "ops.cat": (lambda x, y: ops.cat([x, y, x]), [X, Y]),
    "ops.split": (lambda x: ops.split(x, 2, 1) + ops.split(x, [3, 5], 1), [X]),
    "ops.gather": (lambda x, y: (ops.gather(x, y, 0), ops.gather(XT, y, 1)), [X, LABELS]),
    "mint.add": (lambda x, y: mint.add(x, y, alpha=2), [X, Y]),
    "mint.sub": (lambda x, y: mint.sub(x, y), [X, Y]),
    "mint.mul": (lambda x: mint.mul(x, 2.0), [X]),
    "mint.div": (lambda x, y: mint.div(x, y), [X, POS]),
    "mint.matmul": (lambda x, w: mint.matmul(x, w), [X, W]),
    "mint.bmm": (lambda x, y: mint.bmm(x, y), [X3, Y3]),
    "mint.exp": (mint.exp, [X]),
    "mint.log": (mint.log, [POS]),
    "mint.tanh": (mint.tanh, [X]),
    "mint.sigmoid": (mint.sigmoid, [X]),
    "mint.sqrt": (mint.sqrt, [POS]),
    "mint.rsqrt": (mint.rsqrt, [POS]),
    "mint.abs": (mint.abs, [X]),
    "mint.pow": (lambda x: mint.pow(x, 3.0), [X]),
    "mint.maximum": (lambda x, y: mint.maximum(x, y), [X, Y]),
    "mint.minimum": (lambda x, y: mint.minimum(x, y), [X, Y]),
    "mint.eq": (lambda x: mint.eq(x, ops.relu(x)), [X]),
    "mint.lt": (lambda x: mint.lt(x, 0.0), [X]),
    "mint.gt": (lambda x, y: mint.gt(x, y), [X, Y]),
    "mint.where": (lambda x, y: mint.where(x > y, x, y), [X, Y]),
    "mint.sum": (lambda x: mint.sum(x, 1), [X]),
    "mint.mean": (lambda x: mint.mean(x, 1), [X]),
    "mint.max": (lambda x, y: (mint.max(x), mint.max(x, 1), mint.max(x, y)), [X, Y]),
    "mint.min": (lambda x: (mint.min(x), mint.min(x, 0, True)), [X]),
    "mint.amax": (lambda x: mint.amax(x, 1), [X]),
    "mint.argmax": (lambda x: mint.argmax(x, 1), [X], lambda x: np.argmax(x, 1)),
    "mint.softmax": (lambda x: mint.softmax(x, -1), [X]),
    "mint.reshape": (lambda x: mint.reshape(x, (2, 16)), [X]),
    "mint.permute": (lambda x: mint.permute(x, (2, 1, 0)), [X3]),
    "mint.transpose": (lambda x: mint.transpose(x, 0, 2), [X3]),
    "mint.unsqueeze": (lambda x: mint.unsqueeze(x, -1), [X]),
    "mint.squeeze": (lambda x: mint.squeeze(mint.unsqueeze(x, 0), 0), [X]),
    "mint.broadcast_to": (lambda b: mint.broadcast_to(b, (2, 4, 3)), [B]),
    "mint.cat": (lambda x, y: mint.cat((x, y), 0), [X, Y]),
    "mint.split": (lambda x: mint.split(x, 3, 1), [X]),
    "mint.nn.functional.relu": (lambda x: mint.nn.functional.relu(x), [X]),
    "mint.nn.functional.gelu": (lambda x: mint.nn.functional.gelu(x), [X],
                                lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2.0)))),
}

# "<method>" or "<method>:<variant>" -> (function, numpy arguments)
METHOD_CASES = {
    "clip": (lambda x: x.clip(-0.5, 0.5), [X]),
    "clamp": (lambda x: x.clamp(-0.5, 0.5) + x.clamp(min=0.1), [X]),
    "var": (lambda x: x.var() + x.var(0) + x.var(1, ddof=1, keepdims=True), [X]),
    "std": (lambda x: x.std() + x.std(1), [X]),
    "any": (lambda x: (x > 0.5).any(1), [X]),
    "all": (lambda x: (x > -9.0).all(0), [X]),
    "norm": (lambda x: x.norm(), [X]),
    "copy": (lambda x: x.copy() * 2, [X]),
    "floor": (lambda x: x.floor(), [X]),
    "round": (lambda x: (x * 3).round(), [X]),
    "tile": (lambda x: (x.tile((2, 1)), x.tile((2,)), x.tile((2, 1, 3))), [X]),
    "__add__": (lambda x, y: x + y + 1, [X, Y]),
    "__add__:tensor_left": (lambda x: XT + x, [X]),
    "__radd__": (lambda x: 1.0 + x, [X]),
    "__sub__": (lambda x: XT - x - 1, [X]),
    "__rsub__": (lambda x: 1 - x, [X]),
    "__mul__": (lambda x, y: x * y * 2, [X, Y]),
    "__mul__:tensor_left": (lambda x: XT * x, [X]),
    "__rmul__": (lambda x: 3 * x, [X]),
    "__truediv__": (lambda x, y: x / y + XT / y, [X, POS]),
    "__rtruediv__": (lambda x: 1.0 / x, [POS]),
    "__matmul__": (lambda x, w: x @ w + x @ WT, [X, W]),
    "__matmul__:tensor_left": (lambda w: XT @ w, [W]),
    "__rmatmul__": (lambda w: np.float32(2) * (XT @ w), [W]),
    "__pow__": (lambda x: x ** 2 + Tensor(POS) ** x, [X]),
    "__neg__": (lambda x: -x, [X]),
    "__abs__": (lambda x: abs(x), [X]),
    "__lt__": (lambda x: (x < 0, XT < x), [X]),
    "__le__": (lambda x: (x <= 0, XT <= x), [X]),
    "__gt__": (lambda x: (x > 0, XT > x), [X]),
    "__ge__": (lambda x: (x >= 0, XT >= x), [X]),
    "__eq__": (lambda x: (x == 0, XT == x), [X]),
    "__ne__": (lambda x: (x != 0, XT != x), [X]),
    "__iadd__": (lambda x: _iadd(Tensor(Y), x), [X]),
    "sum": (lambda x: (x.sum(), x.sum(1), x.sum(axis=0, keepdims=True), x.sum(1, True)), [X]),
    "mean": (lambda x: (x.mean(), x.mean(1), x.mean(axis=0, keep_dims=True)), [X]),
    "max": (lambda x: (x.max(), x.max(1), x.max(axis=1), x.max(0, True)), [X]),
    "min": (lambda x: (x.min(), x.min(0), x.min(axis=1, keepdims=True)), [X]),
    "argmax": (lambda x: (x.argmax(), x.argmax(1), x.argmax(axis=0, keepdims=True)), [X]),
    "reshape": (lambda x: (x.reshape(8, 4), x.reshape((2, -1)), x.reshape([32])), [X]),
    "view": (lambda x: (x.view(8, 4), x.view((-1,))), [X]),
    "transpose": (lambda x: (x.transpose(), x.transpose(2, 0, 1), x.transpose(0, 2),
                             x.transpose((1, 0, 2))), [X3]),
    "permute": (lambda x: (x.permute(2, 0, 1), x.permute((1, 0, 2))), [X3]),
    "swapaxes": (lambda x: x.swapaxes(0, 2), [X3]),
    "expand_dims": (lambda x: x.expand_dims(1), [X]),
    "unsqueeze": (lambda x: x.unsqueeze(-1), [X]),
    "squeeze": (lambda x: (x.unsqueeze(0).squeeze(), x.unsqueeze(1).squeeze(1)), [X]),
    "flatten": (lambda x: (x.flatten(), x.flatten(start_dim=1), x.flatten(0, 1)), [X3]),
    "astype": (lambda x: x.astype(ms.float16), [X]),
    "to": (lambda x: x.to(ms.float16), [X]),
    "float": (lambda y: y.float(), [LABELS]),
    "exp": (lambda x: x.exp(), [X]),
    "log": (lambda x: x.log(), [POS]),
    "tanh": (lambda x: x.tanh(), [X]),
    "sigmoid": (lambda x: x.sigmoid(), [X]),
    "sqrt": (lambda x: x.sqrt(), [POS]),
    "rsqrt": (lambda x: x.rsqrt(), [POS]),
    "abs": (lambda x: x.abs(), [X]),
    "square": (lambda x: x.square(), [X]),
    "matmul": (lambda x, w: x.matmul(w), [X, W]),
    "broadcast_to": (lambda b: b.broadcast_to((4, 3)), [B]),
    "softmax": (lambda x: x.softmax(-1), [X]),
    "expand_as": (lambda b: b.reshape(1, 3).expand_as(XT[:, :3]), [B]),
    "neg": (lambda x: x.neg(), [X]),
    "masked_fill": (lambda x: x.masked_fill(x > 0, 0.5), [X]),
    "half": (lambda x: x.half(), [X]),
    "int": (lambda x: (x * 4).int(), [X]),
    "long": (lambda x: (x * 4).long(), [X]),
    "bool": (lambda x: x.bool(), [X]),
    "numel": (lambda x: x.sum() / x.numel(), [X]),
    "mT": (lambda x: x.mT, [X3]),
    "add": (lambda x, y: (x.add(y), x.add(1.0)), [X, Y]),
    "sub": (lambda x, y: x.sub(y), [X, Y]),
    "mul": (lambda x, y: x.mul(y), [X, Y]),
    "div": (lambda x, y: x.div(y), [X, POS]),
    "maximum": (lambda x, y: x.maximum(y), [X, Y]),
    "minimum": (lambda x, y: x.minimum(y), [X, Y]),
    "pow": (lambda x: x.pow(2), [X]),
    "T": (lambda x: x.T, [X]),
    "shape": (lambda x: x.reshape(x.shape[1], x.shape[0]), [X]),
    "dtype": (lambda y: y.astype(XT.dtype) if y.dtype != XT.dtype else y, [LABELS]),
    "ndim": (lambda x: x.sum(x.ndim - 1), [X3]),
    "size": (lambda x: x.sum() / x.size, [X]),
    "dim": (lambda x: x.sum(x.dim() - 2), [X3]),
}

# Native ops (docs/ops.md; their transforms are checked in tests/test_native_ops.py).
ROWS = np.array([0, 2, 0], np.int32)
OP_CASES.update({
    "ops.silu": (ops.silu, [X]),
    "ops.elu": (ops.elu, [X]),
    "ops.softplus": (lambda x: ops.softplus(x * 10, 2.0), [X]),
    "ops.mish": (ops.mish, [X]),
    "ops.hardswish": (lambda x: ops.hardswish(x * 3), [X]),
    "ops.selu": (ops.selu, [X]),
    "ops.prelu": (lambda x, g: ops.prelu(x, g), [X, G]),
    "ops.clamp": (lambda x, y: ops.clamp(x, -0.5, 0.5) + ops.clamp(x, y), [X, Y]),
    "ops.clip": (lambda x: ops.clip(x, None, 0.2), [X]),
    "ops.cumsum": (lambda x: ops.cumsum(x, 1), [X]),
    "ops.cumprod": (lambda x: ops.cumprod(x, 0), [X]),
    "ops.sort": (lambda x: ops.sort(x, 1, True), [X]),
    "ops.argsort": (lambda x: ops.argsort(x, 0), [X]),
    "ops.topk": (lambda x: ops.topk(x, 3), [X]),
    "ops.stack": (lambda x, y: ops.stack([x, y], 1), [X, Y]),
    "ops.unstack": (lambda x: ops.unstack(x, 1), [X]),
    "ops.tile": (lambda x: ops.tile(x, (2, 1)), [X]),
    "ops.repeat_interleave": (lambda x: ops.repeat_interleave(x, 2, 1), [X]),
    "ops.flip": (lambda x: ops.flip(x, (1,)), [X]),
    "ops.roll": (lambda x: ops.roll(x, 2, 1), [X], lambda x: np.roll(x, 2, 1)),
    "ops.pad": (lambda x: ops.pad(x, (1, 2), value=0.5), [X]),
    "ops.tril": (lambda x: ops.tril(x, -1), [X]),
    "ops.triu": (lambda x: ops.triu(x, 1), [X]),
    "ops.masked_fill": (lambda x: ops.masked_fill(x, x > 0, 2.0), [X]),
    "ops.floor_divide": (lambda x, y: ops.floor_divide(x, y), [X, POS]),
    "ops.remainder": (lambda x, y: ops.remainder(x, y), [X, POS]),
    "ops.isnan": (lambda x: ops.isnan(ops.log(x)), [X]),
    "ops.isinf": (lambda x: ops.isinf(x / (x - x)), [X]),
    "ops.isfinite": (lambda x: ops.isfinite(ops.log(x)), [X]),
    "ops.nan_to_num": (lambda x: ops.nan_to_num(ops.log(x), 1.0), [X]),
    "ops.logical_and": (lambda x: ops.logical_and(x > 0, x < 1), [X]),
    "ops.logical_or": (lambda x: ops.logical_or(x > 1, x < 0), [X]),
    "ops.logical_not": (lambda x: ops.logical_not(x > 0), [X]),
    "ops.logical_xor": (lambda x: ops.logical_xor(x > 0, x < 1), [X]),
    "ops.isclose": (lambda x, y: ops.isclose(x, y, 0.5, 0.5), [X, Y]),
    "ops.prod": (lambda x: ops.prod(x, 1), [X]),
    "ops.var": (lambda x: ops.var(x, 1, 1), [X]),
    "ops.std": (lambda x: ops.std(x), [X]),
    "ops.std_mean": (lambda x: ops.std_mean(x, 0), [X]),
    "ops.log1p": (ops.log1p, [POS]),
    "ops.expm1": (ops.expm1, [X]),
    "ops.atan2": (lambda x, y: ops.atan2(x, y), [X, Y]),
    "ops.reciprocal": (ops.reciprocal, [POS]),
    "ops.narrow": (lambda x: ops.narrow(x, 1, 2, 3), [X]),
    "ops.dense": (lambda x, w: ops.dense(x, w, BT), [X, W.T.copy()]),
    "ops.gather_nd": (lambda x: ops.gather_nd(x, Tensor(np.array([[0, 1], [3, 7]], np.int32))),
                      [X]),
    "ops.scatter_nd": (lambda x: ops.scatter_nd(Tensor(ROWS.reshape(3, 1)), x[:3], (4, 8)),
                       [X]),
    "ops.tensor_scatter_add": (lambda x, y: ops.tensor_scatter_add(
        x, Tensor(ROWS.reshape(3, 1)), y[:3]), [X, Y]),
    "ops.index_add": (lambda x, y: ops.index_add(x * 1.0, Tensor(ROWS), y[:3], 0), [X, Y]),
    "ops.binary_cross_entropy_with_logits": (
        lambda x, y: ops.binary_cross_entropy_with_logits(x, ops.sigmoid(y)), [X, Y]),
    "ops.kl_div": (lambda x, y: ops.kl_div(x, ops.softmax(y, 1), "sum"), [X, Y]),
    "ops.smooth_l1_loss": (lambda x, y: ops.smooth_l1_loss(x, y, 0.5), [X, Y]),
    "ops.cosine_similarity": (lambda x, y: ops.cosine_similarity(x, y), [X, Y]),
    "mint.clamp": (lambda x: mint.clamp(x, min=-0.3), [X]),
    "mint.stack": (lambda x, y: mint.stack((x, y)), [X, Y], lambda x, y: np.stack((x, y))),
    "mint.remainder": (lambda x: mint.remainder(x, 0.7), [X]),
    "mint.floor_divide": (lambda x: mint.floor_divide(x, 0.7), [X],
                          lambda x: np.floor_divide(x, np.float32(0.7))),
    "mint.narrow": (lambda x: mint.narrow(x, 0, 1, 2), [X]),
    "mint.index_add": (lambda x, y: mint.index_add(x, 0, Tensor(ROWS), y[:3]), [X, Y],
                       lambda x, y: _index_add_np(x, y)),
    "mint.nn.functional.silu": (mint.nn.functional.silu, [X]),
    "mint.nn.functional.pad": (lambda x: mint.nn.functional.pad(x, (1, 1)), [X],
                               lambda x: np.pad(x, ((0, 0), (1, 1)))),
})


IMG = _normal(2, 4, 5, 5)
C4 = _normal(4)


def _rms_norm_np(x, g):
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * g).astype(x.dtype)


def _batch_norm_np(x, m, v, w, b):
    x64, sh = x.astype(np.float64), (1, -1, 1, 1)
    mu, var = x64.mean((0, 2, 3)), x64.var((0, 2, 3))
    return ((x64 - mu.reshape(sh)) / np.sqrt(var.reshape(sh) + 1e-5) * w.reshape(sh)
            + b.reshape(sh)).astype(x.dtype)


# normalisation, interpolation and activations (docs/ops.md)
OP_CASES.update({
    "ops.batch_norm": (lambda x, m, v, w, b: ops.batch_norm(x, m * 1, v * 1, w, b, True),
                       [IMG, C4, np.abs(C4) + 0.5, C4, C4]),
    "ops.group_norm": (lambda x, w, b: ops.group_norm(x, 2, w, b), [IMG, C4, C4]),
    "ops.rms_norm": (lambda x, g: ops.rms_norm(x, g)[0], [X3, G], _rms_norm_np),
    "ops.interpolate": (lambda x: ops.interpolate(x, size=(7, 3), mode="bilinear"), [IMG]),
    "ops.relu6": (lambda x: ops.relu6(x * 4), [X]),
    "ops.hardtanh": (lambda x: ops.hardtanh(x, -0.5, 0.5), [X]),
    "ops.softsign": (ops.softsign, [X]),
    "ops.celu": (lambda x: ops.celu(x, 2.0), [X]),
    "ops.softshrink": (lambda x: ops.softshrink(x, 0.3), [X]),
    "ops.hardshrink": (lambda x: ops.hardshrink(x, 0.3), [X]),
    "ops.fast_gelu": (ops.fast_gelu, [X]),
    "mint.nn.functional.batch_norm": (
        lambda x, m, v, w, b: mint.nn.functional.batch_norm(x, m * 1, v * 1, w, b, True),
        [IMG, C4, np.abs(C4) + 0.5, C4, C4], _batch_norm_np),
    "mint.nn.functional.group_norm": (lambda x: mint.nn.functional.group_norm(x, 4), [IMG]),
    "mint.nn.functional.interpolate": (
        lambda x: mint.nn.functional.interpolate(x, size=(7, 3), mode="bilinear"), [IMG],
        lambda x: ops.interpolate(Tensor(x), size=(7, 3), mode="bilinear").asnumpy()),
    "mint.nn.functional.leaky_relu": (lambda x: mint.nn.functional.leaky_relu(x, 0.2), [X],
                                      lambda x: np.where(x > 0, x, 0.2 * x)),
    "mint.nn.functional.relu6": (lambda x: mint.nn.functional.relu6(x * 4), [X],
                                 lambda x: np.clip(x * 4, 0, 6)),
})


def _index_add_np(x, y):
    out = x.copy()
    np.add.at(out, ROWS, y[:3])
    return out


METHOD_CASES.update({
    "tensor_split": (lambda x: x.tensor_split(3, 1), [X]),
    "tensor_split:indices": (lambda x: x.tensor_split((1, 3), axis=0), [X]),
    "tensor_split:backwards": (lambda x: x.tensor_split((5, -6), axis=-1), [X]),
    "__floordiv__": (lambda x: x // 0.7, [X]),
    "__floordiv__:tensor_left": (lambda x: XT // x, [POS]),
    "__rfloordiv__": (lambda x: 3.0 // x, [POS]),
    "__mod__": (lambda x: x % 0.7, [X]),
    "__mod__:tensor_left": (lambda x: XT % x, [POS]),
    "__rmod__": (lambda x: 3.0 % x, [POS]),
    "__setitem__": (lambda x: _setitem(x * 1.0), [X]),
    "cumsum": (lambda x: (x.cumsum(0), x.cumsum(axis=1)), [X]),
    "cumprod": (lambda x: x.cumprod(1), [X]),
    "sort": (lambda x: x.sort(0), [X]),
    "argsort": (lambda x: x.argsort(), [X]),
    "topk": (lambda x: x.topk(2), [X]),
    "prod": (lambda x: (x.prod(), x.prod(1)), [X]),
    "flip": (lambda x: x.flip((0, 1)), [X]),
    "roll": (lambda x: x.roll(1, 0), [X], lambda x: np.roll(x, 1, 0)),
    "tril": (lambda x: x.tril(), [X]),
    "triu": (lambda x: x.triu(1), [X]),
    "narrow": (lambda x: x.narrow(1, 0, 2), [X]),
    "repeat_interleave": (lambda x: x.repeat_interleave(2, 0), [X]),
    "isnan": (lambda x: x.log().isnan(), [X]),
    "isclose": (lambda x, y: x.isclose(y, 0.5, 0.5), [X, Y]),
    "logical_and": (lambda x: (x > 0).logical_and(x < 1), [X]),
    "log1p": (lambda x: x.log1p(), [POS]),
    "remainder": (lambda x: x.remainder(0.7), [X]),
    "floor_divide": (lambda x: x.floor_divide(0.7), [X],
                     lambda x: np.floor_divide(x, np.float32(0.7))),
})


def _setitem(y):
    y[0, 1:3] = 2.0
    y[1] += 1.0
    return y




def _iadd(t, x):
    t += x
    return t


def _mlp():
    return nn.SequentialCell([nn.Dense(8, 16, activation="relu"), nn.Dense(16, 3)])


CELL_CASES = {
    "nn.Dense": (lambda: nn.Dense(8, 3), [X]),
    "nn.Dense:activation": (lambda: nn.Dense(8, 3, activation="relu"), [X3]),
    "nn.Dense:no_bias": (lambda: nn.Dense(8, 3, has_bias=False, activation=nn.Tanh()), [X]),
    "nn.ReLU": (lambda: nn.ReLU(), [X]),
    "nn.GELU": (lambda: nn.GELU(), [X]),
    "nn.GELU:exact": (lambda: nn.GELU(approximate=False), [X]),
    "nn.Sigmoid": (lambda: nn.Sigmoid(), [X]),
    "nn.Tanh": (lambda: nn.Tanh(), [X]),
    "nn.Flatten": (lambda: nn.Flatten(), [X3]),
    "nn.SequentialCell": (_mlp, [X]),
    "nn.LayerNorm": (lambda: nn.LayerNorm((8,)), [X3]),
    "nn.LayerNorm:2d": (lambda: nn.LayerNorm((4, 8), begin_norm_axis=1, begin_params_axis=1),
                        [X3]),
    "nn.Softmax": (lambda: nn.Softmax(), [X]),
    "nn.LogSoftmax": (lambda: nn.LogSoftmax(), [X]),
    "nn.SoftmaxCrossEntropyWithLogits": (
        lambda: nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
        [X[:, :3], LABELS]),
    "nn.SoftmaxCrossEntropyWithLogits:dense": (
        lambda: nn.SoftmaxCrossEntropyWithLogits(reduction="sum"),
        [X[:, :3], np.eye(3, dtype=np.float32)[LABELS]]),
}

CELL_CASES.update({
    "nn.SiLU": (lambda: nn.SiLU(), [X]),
    "nn.PReLU": (lambda: nn.PReLU(4, 0.2), [X3.transpose(0, 1, 2)[:, :, :4].reshape(2, 4, 4)]),
    "nn.ELU": (lambda: nn.ELU(), [X]),
    "nn.HSwish": (lambda: nn.HSwish(), [X]),
    "nn.Mish": (lambda: nn.Mish(), [X]),
    "nn.SeLU": (lambda: nn.SeLU(), [X]),
    "nn.BCEWithLogitsLoss": (lambda: nn.BCEWithLogitsLoss(), [X, (Y > 0).astype(np.float32)]),
    "nn.SmoothL1Loss": (lambda: nn.SmoothL1Loss(), [X, Y]),
})


CELL_CASES.update({
    "nn.BatchNorm2d": (lambda: nn.BatchNorm2d(4), [IMG]),
    "nn.BatchNorm1d": (lambda: nn.BatchNorm1d(8), [X]),
    "nn.GroupNorm": (lambda: nn.GroupNorm(2, 4), [IMG]),
    "nn.Upsample": (lambda: nn.Upsample(size=(9, 9), mode="nearest"), [IMG]),
    "nn.ReLU6": (lambda: nn.ReLU6(), [X]),
    "nn.MultiheadAttention": (lambda: nn.MultiheadAttention(8, 2, batch_first=True),
                              [X3, X3, X3]),
    "nn.TransformerEncoderLayer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0,
                                                                      batch_first=True),
                                   [X3]),
})


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _leaves(tree):
    return fs.tree.leaves(tree)


def _eval_ir(fn, *args):
    """Trace ``fn`` and evaluate its Program eagerly (not compiled)."""
    traced = fs.make_ir(fn)(*args)
    leaves = [Tensor(a) if isinstance(a, np.ndarray) else a for a in _leaves((args, {}))]
    outs = eval_program(traced.program, *traced.consts, *leaves)
    return fs.tree.unflatten(traced.out_tree, outs), traced


def _assert_same(got, expected, where):
    got_l, exp_l = _leaves(got), _leaves(expected)
    assert len(got_l) == len(exp_l), f"{where}: {len(got_l)} outputs, expected {len(exp_l)}"
    for g, e in zip(got_l, exp_l):
        g_np = g.asnumpy() if hasattr(g, "asnumpy") else np.asarray(g)
        e_np = e.asnumpy() if hasattr(e, "asnumpy") else np.asarray(e)
        if isinstance(e, Tensor):
            assert g.dtype == e.dtype, f"{where}: dtype {g.dtype}, MindSpore gives {e.dtype}"
        assert g_np.shape == e_np.shape, f"{where}: shape {g_np.shape} vs {e_np.shape}"
        tol = 2e-3 if g_np.dtype == np.float16 else 2e-5
        np.testing.assert_allclose(g_np.astype(np.float64), e_np.astype(np.float64),
                                   rtol=tol, atol=tol, err_msg=where)


def _check(fn, args, reference=None):
    if reference is not None:
        expected = reference(*args)
    else:
        expected = fn(*[Tensor(a) for a in args])
    eager, traced = _eval_ir(fn, *args)
    assert traced.program.equations, "nothing was traced"
    _assert_same(eager, expected, "eager evaluation of the Program")
    _assert_same(fs.jit(fn)(*args), expected, "fs.jit")


def _base(name):
    return name.split(":")[0]


# ---------------------------------------------------------------------------
# The supported lists, enumerated
# ---------------------------------------------------------------------------


def test_every_supported_entry_has_a_case():
    assert set(interop.SUPPORTED_OPS) == set(OP_CASES)
    assert set(interop.SUPPORTED_TENSOR_METHODS) == {_base(k) for k in METHOD_CASES}
    assert set(interop.SUPPORTED_CELLS) == {_base(k) for k in CELL_CASES}


@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_traces(name):
    _check(*OP_CASES[name])


@pytest.mark.parametrize("name", list(METHOD_CASES))
def test_tensor_method_traces(name):
    _check(*METHOD_CASES[name])


@pytest.mark.parametrize("name", list(CELL_CASES))
def test_cell_traces(name):
    make, args = CELL_CASES[name]
    cell = make()
    expected = cell(*[Tensor(a) for a in args])
    apply, params = fs.functional(cell)
    eager, traced = _eval_ir(apply, params, *args)
    _assert_same(eager, expected, "eager evaluation of the Program")
    _assert_same(fs.jit(cell)(*args), expected, "fs.jit")


# ---------------------------------------------------------------------------
# Cells: parameters are explicit inputs; fs.jit(cell) reads them at every call
# ---------------------------------------------------------------------------


def test_cell_parameters_are_program_inputs():
    net = _mlp()
    apply, params = fs.functional(net)
    traced = fs.make_ir(apply)(params, X)
    program = traced.program
    assert program.n_consts == 0
    assert [str(v.aval) for v in program.inputs] == [
        str(fs.typeof(p)) for _, p in sorted(params.items())] + ["f32[4,8]"]
    assert [e.prim.name for e in program.equations] == [
        "matmul", "bias_add", "relu", "matmul", "bias_add"]


def test_jit_cell_sees_parameter_updates_without_retracing():
    net = _mlp()
    f = fs.jit(net)
    _assert_same(f(X), net(XT), "before set_data")
    w = net[1].weight
    w.set_data(Tensor(np.full(w.shape, 0.25, np.float32)))
    _assert_same(f(X), net(XT), "after set_data")
    assert f.inner.trace_count == 1


class _Block(nn.Cell):
    """A pre-norm transformer block: causal softmax attention with batched matmuls."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm((d,)), nn.LayerNorm((d,))
        self.qkv, self.proj = nn.Dense(d, 3 * d), nn.Dense(d, d)
        self.mlp = nn.SequentialCell([nn.Dense(d, 4 * d), nn.GELU(), nn.Dense(4 * d, d)])

    def construct(self, x):
        b, t, d = x.shape
        dh = d // self.heads
        q, k, v = ops.split(self.qkv(self.ln1(x)), d, axis=-1)
        q, k, v = [a.reshape(b, t, self.heads, dh).transpose(0, 2, 1, 3) for a in (q, k, v)]
        causal = Tensor(np.tril(np.ones((t, t), np.bool_)))
        scores = ops.where(causal, ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(dh), -1e9)
        y = ops.matmul(ops.softmax(scores, -1), v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


def test_transformer_block_traces_end_to_end():
    ms.set_seed(0)
    block = _Block()
    x = _normal(2, 5, 16)
    apply, params = fs.functional(block)
    eager, traced = _eval_ir(apply, params, x)
    names = {e.prim.name for e in traced.program.equations}
    assert {"matmul", "softmax", "select", "gelu", "split", "rsqrt", "transpose"} <= names
    expected = block(Tensor(x))
    _assert_same(eager, expected, "eager evaluation of the Program")
    _assert_same(fs.jit(block)(x), expected, "fs.jit")


class _Classifier(nn.Cell):
    def __init__(self):
        super().__init__()
        self.body = nn.SequentialCell([nn.Dense(8, 16), nn.GELU(), nn.LayerNorm((16,)),
                                       nn.Dense(16, 3)])
        self.loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def construct(self, x, labels):
        return self.loss(self.body(x), labels)


def test_mlp_loss_and_gradients_match_mindspore():
    ms.set_seed(0)
    net = _Classifier()
    apply, params = fs.functional(net)
    loss, grads = fs.jit(fs.value_and_grad(apply))(params, X, LABELS)
    _assert_same(loss, net(XT, Tensor(LABELS)), "loss")
    weights = net.trainable_params()
    ms_grads = ms.grad(net, grad_position=None, weights=weights)(XT, Tensor(LABELS))
    for p, g in zip(weights, ms_grads):
        _assert_same(grads[p.name], g, f"gradient of {p.name}")


# ---------------------------------------------------------------------------
# MindSpore is left exactly as it was found
# ---------------------------------------------------------------------------


def _snapshot():
    return [(ns, name, orig) for ns, name, orig in interop.patched_objects()]


def _current(ns, name):
    table = ns if isinstance(ns, dict) else vars(ns)
    return table.get(name)


def _assert_restored(snapshot):
    changed = [(ns if isinstance(ns, type) else ns.get("__name__"), name)
               for ns, name, orig in snapshot if _current(ns, name) is not orig]
    assert not changed, f"not restored: {changed[:5]}"


def test_patched_objects_cover_the_entry_points():
    names = {name for _, name, _ in _snapshot()}
    assert {"pyboost_matmul_ext", "pyboost_cast", "_run_op", "_add_instance", "__add__",
            "__call__", "__new__", "isinstance"} <= names
    assert len(names) > 600


def test_tracing_swaps_then_restores_every_object():
    snapshot = _snapshot()
    swapped = []

    def f(x):
        swapped.extend(_current(ns, name) is not orig for ns, name, orig in snapshot)
        return ops.relu(x)

    fs.make_ir(f)(X)
    assert swapped and all(swapped)
    _assert_restored(snapshot)
    assert (XT + XT).shape == (4, 8)  # the Tensor operators work again


def test_tracing_restores_after_an_exception():
    snapshot = _snapshot()

    def f(x):
        ops.relu(x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fs.make_ir(f)(X)
    _assert_restored(snapshot)
    with pytest.raises(fs.UnsupportedOpError):
        fs.make_ir(lambda x: ops.nonzero(x))(X)
    _assert_restored(snapshot)


def test_nested_tracing_restores_only_at_the_outermost_exit():
    snapshot = _snapshot()
    add = ms.Tensor.__add__
    seen = []

    def inner(x):
        return ops.exp(x)

    def outer(x):
        fs.make_ir(inner)(X)
        seen.append(ms.Tensor.__add__ is add)  # still patched after the inner trace
        with pytest.raises(ValueError):
            fs.make_ir(lambda x: (_ for _ in ()).throw(ValueError("inner")))(X)
        seen.append(ms.Tensor.__add__ is add)
        return ops.relu(x)

    fs.make_ir(outer)(X)
    assert seen == [False, False]
    _assert_restored(snapshot)


# ---------------------------------------------------------------------------
# What users see when something does not trace
# ---------------------------------------------------------------------------


def test_op_without_a_converter_traces_as_one_generic_equation():
    def f(x):
        return ops.erfinv(ops.tanh(x))

    ir = fs.make_ir(f)(X)
    assert [eq.prim.name for eq in ir.program.equations] == ["tanh", "ms_op"]
    assert "= Erfinv " in str(ir)
    want = f(ms.Tensor(X)).asnumpy()
    np.testing.assert_allclose(fs.jit(f)(X).asnumpy(), want, rtol=1e-5, atol=1e-6)


def test_op_that_fails_in_mindspore_names_the_op_and_the_fix():
    with pytest.raises(fs.UnsupportedOpError) as info:
        fs.make_ir(lambda x: ops.inverse(x))(X)  # not square
    msg = str(info.value)
    assert "cannot run on operands of types (f32[4,8])" in msg
    assert "Fix:" in msg
    assert isinstance(info.value, NotImplementedError)


def test_rejected_tracer_argument_becomes_an_fshard_error():
    with pytest.raises(fs.UnsupportedOpError, match="MindSpore rejected a traced value"):
        fs.make_ir(lambda x: XT[:1].expand_as(x))(X)
    with pytest.raises(fs.UnsupportedOpError, match=r"tensor\[...\] = traced"):
        fs.make_ir(lambda x: XT.copy().__setitem__(0, x[0]))(X)


@pytest.mark.parametrize("fn", [
    lambda x: x if ops.sum(x) > 0 else -x,
    lambda x: x if XT.sum() < x.sum() else -x,
    lambda x: ops.relu(x) * float(ops.mean(x)),
    lambda x: nn.ReLU()(x) if mint.max(x) > 0 else x,
    lambda x: [x for _ in range(int(ops.argmax(x[0])))],
], ids=["ops", "tensor_vs_traced", "float", "mint", "int"])
def test_python_control_flow_raises_tracer_conversion_error(fn):
    with pytest.raises(fs.TracerConversionError, match="fs.ops.where"):
        fs.jit(fn)(X)


def test_calls_without_a_tracer_run_eagerly():
    def f(x):
        c = ops.exp(ops.add(XT, 1.0))  # no tracer: computed now, by MindSpore
        assert isinstance(c, Tensor)
        return x * c

    program = fs.make_ir(f)(X).program
    assert [e.prim.name for e in program.equations] == ["mul"]
    assert program.n_consts == 1


def test_tensor_constructor_on_a_traced_value():
    def f(x):
        return Tensor(x) + Tensor(x, ms.float16).astype(ms.float32)

    _check(f, [X])


# ---------------------------------------------------------------------------
# Tied weights: one Parameter used by several sub-Cells
# ---------------------------------------------------------------------------


class _Tied(nn.Cell):
    def __init__(self):
        super().__init__()
        self.a = nn.Dense(3, 3, has_bias=False)
        self.b = nn.Dense(3, 3, has_bias=False)
        self.b.weight = self.a.weight  # the same Parameter in two places

    def construct(self, x):
        return (self.b(ops.tanh(self.a(x))) ** 2).sum()


def test_tied_weights_see_one_value_and_sum_their_gradients():
    net = _Tied()
    x = Tensor(_normal(2, 3))
    apply, params = fs.functional(net)
    assert list(params) == ["a.weight"]
    w = _normal(3, 3)
    xs = x.asnumpy()

    def ref(w):  # both uses read w
        return float(((np.tanh(xs @ w.T) @ w.T) ** 2).sum())

    got = apply({"a.weight": Tensor(w)}, x)
    np.testing.assert_allclose(got.asnumpy(), ref(w), rtol=1e-4)
    np.testing.assert_allclose(fs.jit(apply)({"a.weight": Tensor(w)}, x).asnumpy(), ref(w),
                               rtol=1e-4)
    g = fs.grad(apply)({"a.weight": Tensor(w)}, x)["a.weight"].asnumpy()
    w64, eps = w.astype(np.float64), 1e-6
    fd = np.zeros_like(w64)
    for i in np.ndindex(w.shape):
        d = np.zeros_like(w64)
        d[i] = eps
        fd[i] = (ref(w64 + d) - ref(w64 - d)) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=1e-3, atol=1e-3 * np.abs(fd).max())
    # the Cell form differentiates the same way MindSpore does
    ms_g = ms.grad(net, None, net.trainable_params())(x)[0].asnumpy()
    fs_g = fs.grad(net)(x)["a.weight"].asnumpy()
    np.testing.assert_allclose(fs_g, ms_g, rtol=1e-5, atol=1e-5 * np.abs(ms_g).max())
    # and the Cell is left as it was
    assert net.b.weight is net.a.weight


# ---------------------------------------------------------------------------
# Stateful random ops: refused inside a transform (a draw would be frozen)
# ---------------------------------------------------------------------------

RANDOM_CALLS = {
    "ops.randn": lambda a: a + ops.randn((3,)),
    "ops.rand": lambda a: a + ops.rand((3,)),
    "ops.uniform": lambda a: a + ops.uniform((3,), Tensor(0.0), Tensor(1.0)),
    "ops.normal": lambda a: a + ops.normal((3,), Tensor(0.0), Tensor(1.0)),
    "ops.randint": lambda a: a + ops.randint(0, 5, (3,)).astype(ms.float32),
    "ops.randperm": lambda a: a + ops.randperm(3).astype(ms.float32),
    "ops.rand_like": lambda a: a + ops.rand_like(a),
    "ops.randn_like": lambda a: a + ops.randn_like(a),
    "ops.standard_normal": lambda a: a + ops.standard_normal((3,)),
    "ops.multinomial": lambda a: a + ops.multinomial(a, 3).astype(ms.float32),
    "ops.shuffle": lambda a: ops.shuffle(a),
    "ops.dropout": lambda a: ops.dropout(a, p=0.5),
    "mint.rand": lambda a: a + mint.rand(3),
    "mint.randn": lambda a: a + mint.randn(3),
    "mint.randint": lambda a: a + mint.randint(0, 4, (3,)).astype(ms.float32),
    "mint.rand_like": lambda a: a + mint.rand_like(a),
}


@pytest.mark.parametrize("name", list(RANDOM_CALLS))
@pytest.mark.parametrize("transform", ["jit", "vmap", "grad"])
def test_stateful_random_ops_are_refused_inside_transforms(name, transform):
    x = Tensor(np.ones(3, np.float32))
    f = RANDOM_CALLS[name]
    if transform == "grad":
        wrapped = fs.grad(lambda a: f(a).astype(ms.float32).sum())
    elif transform == "vmap":
        wrapped, x = fs.vmap(f), Tensor(np.ones((2, 3), np.float32))
    else:
        wrapped = fs.jit(f)
    with pytest.raises(fs.UnsupportedOpError, match=r"stateful MindSpore random op .* frozen "
                                                     r"into the program(.|\n)*pass them in"):
        wrapped(x)


def test_random_ops_run_normally_outside_transforms():
    a, b = ops.randn((1000,)), ops.randn((1000,))
    assert not np.array_equal(a.asnumpy(), b.asnumpy())
    # drawn outside and passed in, as the error suggests
    noise = ops.randn((3,))
    out = fs.jit(lambda x, n: x + n)(Tensor(np.ones(3, np.float32)), noise)
    np.testing.assert_allclose(out.asnumpy(), 1 + noise.asnumpy(), rtol=1e-6)


# ---------------------------------------------------------------------------
# cross_entropy labels: MindSpore's range [-C, C) (negative counts from the end),
# ignore_index ignored, anything else never a plausible number
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"reduction": "sum"}, {"reduction": "none"},
                                {"ignore_index": 1}, {"label_smoothing": 0.1}])
@pytest.mark.parametrize("labels", [[0, 1, 2], [0, -1, 2], [0, -4, 3], [0, -100, 2],
                                    [-100, -100, -100]])
def test_cross_entropy_labels_follow_mindspore(labels, kw):
    logits = Tensor(_normal(3, 4))
    y = Tensor(np.array(labels, np.int32))
    f = lambda lg, t: ops.cross_entropy(lg, t, **kw)  # noqa: E731
    try:
        want = f(logits, y).asnumpy()
    except RuntimeError:  # MindSpore refuses a label out of range: fshard gives NaN
        assert np.isnan(fs.jit(f)(logits, y).asnumpy()).any()
        return
    np.testing.assert_allclose(fs.jit(f)(logits, y).asnumpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("labels", [[0, 9, 2], [0, -5, 2]])
def test_cross_entropy_label_out_of_range_is_nan_for_that_example(labels):
    logits = Tensor(_normal(3, 4))
    y = Tensor(np.array(labels, np.int32))
    per_example = fs.jit(lambda lg, t: ops.cross_entropy(lg, t, reduction="none"))(logits, y)
    out = per_example.asnumpy()
    assert np.isnan(out[1]) and np.isfinite(out[[0, 2]]).all()
    assert np.isnan(fs.jit(lambda lg, t: ops.cross_entropy(lg, t))(logits, y).asnumpy())
    g = fs.grad(lambda lg: ops.cross_entropy(lg, y, reduction="none")[0])(logits)
    assert np.isfinite(g.asnumpy()).all()  # the valid examples still differentiate


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_any_and_all_count_every_nonzero_value_as_true(dtype):
    # 0.5 is true: a cast to int before the test would make it false.
    x = np.array([[0.5, 0.0, 0.0], [1.0, 2.0, 0.0]], np.float32).astype(dtype)
    cases = {
        "any": (lambda v: ops.any(v), lambda a: a.any()),
        "all": (lambda v: ops.all(v), lambda a: a.all()),
        "any axis 0": (lambda v: ops.any(v, (0,), True), lambda a: a.any(0, keepdims=True)),
        "all axis 1": (lambda v: ops.all(v, 1), lambda a: a.all(1)),
        "Tensor.any": (lambda v: v.any(1), lambda a: a.any(1)),
        "Tensor.all": (lambda v: v.all(0, keep_dims=True), lambda a: a.all(0, keepdims=True)),
    }
    for name, (fn, ref) in cases.items():
        got = fs.jit(fn)(Tensor(x)).asnumpy()
        np.testing.assert_array_equal(got, ref(x), err_msg=name)


def _clip_inputs():
    rng = np.random.default_rng(3)
    return [rng.standard_normal((3, 4)).astype(np.float32) * 3,
            rng.standard_normal(5).astype(np.float32)]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_by_norm_traces_as_mindspore_computes_it(norm_type, max_norm):
    # MindSpore's ops.clip_by_norm branches with a Python `if` on the norm; traced, the
    # branch is data. Its norm takes no absolute value for p != inf (an odd p of
    # negative entries gives MindSpore's number, not a norm): the traced one the same.
    a, b = _clip_inputs()
    one = fs.jit(lambda x: ops.clip_by_norm(x, max_norm, norm_type))(Tensor(a))
    want = ops.clip_by_norm(Tensor(a), max_norm, norm_type)
    np.testing.assert_allclose(one.asnumpy(), want.asnumpy(), rtol=1e-5, atol=1e-6)
    both = fs.jit(lambda x, y: ops.clip_by_norm([x, y], max_norm, norm_type))(
        Tensor(a), Tensor(b))
    want = ops.clip_by_norm([Tensor(a), Tensor(b)], max_norm, norm_type)
    assert type(both) is tuple and len(both) == 2
    for g, w in zip(both, want):
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-5, atol=1e-6)


def test_clip_by_norm_under_grad_vmap_and_shard():
    a, b = _clip_inputs()

    def f(x):
        return ops.clip_by_norm(x, 2.0).sum() * 1.5

    g = fs.grad(f)(Tensor(a))
    want = ms.grad(f)(Tensor(a))
    np.testing.assert_allclose(g.asnumpy(), want.asnumpy(), rtol=1e-5, atol=1e-6)
    xs = np.stack([a, a * 1e-3])  # one example clipped, one not
    got = fs.vmap(lambda x: ops.clip_by_norm(x, 2.0))(Tensor(xs))
    for k in range(2):
        np.testing.assert_allclose(got.asnumpy()[k],
                                   ops.clip_by_norm(Tensor(xs[k]), 2.0).asnumpy(),
                                   rtol=1e-5, atol=1e-7)
    split = fs.shard(lambda x: ops.clip_by_norm(x, 2.0), in_strategy=((1, 2),), mesh=2)
    np.testing.assert_allclose(split(Tensor(xs[0])).asnumpy(),
                               ops.clip_by_norm(Tensor(xs[0]), 2.0).asnumpy(),
                               rtol=1e-5, atol=1e-6)


def test_clip_by_norm_of_a_nan_leaves_the_input_and_mindspore_is_restored():
    x = np.array([1.0, np.nan, 3.0], np.float32)
    got = fs.jit(lambda v: ops.clip_by_norm(v, 0.1))(Tensor(x)).asnumpy()
    np.testing.assert_array_equal(got, ops.clip_by_norm(Tensor(x), 0.1).asnumpy())
    np.testing.assert_array_equal(got, x)
    from mindspore.ops.function import clip_func

    # MindSpore's function is itself again (its code swapped only while tracing)
    assert ops.clip_by_norm is clip_func.clip_by_norm
    assert clip_func.clip_by_norm.__code__.co_name == "clip_by_norm"
    assert clip_func.clip_by_norm.__defaults__ == (2.0, False)


def test_clip_by_norm_taken_before_tracing_traces_too():
    # a reference held before the transform runs (`from mindspore.ops import
    # clip_by_norm` at the top of a user's module) reaches the traced version as well
    from mindspore.ops import clip_by_norm

    x = Tensor(_clip_inputs()[0])
    got = fs.jit(lambda v: clip_by_norm(v, 0.5))(x)
    np.testing.assert_allclose(got.asnumpy(), clip_by_norm(x, 0.5).asnumpy(), rtol=1e-5,
                               atol=1e-6)


def test_clip_by_norm_refuses_error_if_nonfinite_while_traced():
    with pytest.raises(fs.errors.ArgumentError,
                       match="error_if_nonfinite=True.*\n.*Fix: pass error_if_nonfinite"):
        fs.jit(lambda v: ops.clip_by_norm(v, 1.0, error_if_nonfinite=True))(
            Tensor(np.ones(3, np.float32)))


def test_bincount_is_refused_with_its_reason_and_a_static_length_form():
    x = Tensor(np.array([0, 2, 2, 5], np.int32))
    w = Tensor(np.array([0.5, 1.0, 2.0, 4.0], np.float32))
    with pytest.raises(fs.errors.UnsupportedOpError,
                       match=r"(?s)bincount has an output shape that depends.*Fix: .*one_hot"):
        fs.jit(lambda v, u: ops.bincount(v, u))(x, w)
    # the form the fix names gives MindSpore's counts, weighted too
    got = fs.jit(lambda v, u: (fs.ops.one_hot(v, 6) * u[:, None]).sum(0))(x, w)
    np.testing.assert_allclose(got.asnumpy(), ops.bincount(x, w).asnumpy())
    assert ops.bincount(x).asnumpy().tolist() == [1, 0, 2, 0, 0, 1]  # eager: MindSpore's


@pytest.mark.parametrize("eps", [-1.0, 0.1])
def test_logit_gradient_is_the_derivative(eps):
    # ops.logit runs as MindSpore's Logit (the generic path); its gradient is checked
    # here against the derivative, not against MindSpore's eager LogitGrad, which
    # returns NaN in some long runs (tests/op_coverage.py, MINDSPORE_GRAD_WRONG).
    x = np.array([0.05, 0.2, 0.5, 0.8, 0.97], np.float32)
    g = fs.jit(fs.grad(lambda v: (ops.logit(v, eps) * 2.0).sum()))(Tensor(x)).asnumpy()
    xd = x.astype(np.float64)
    lo, hi = (eps, 1 - eps) if eps >= 0 else (0.0, 1.0)
    want = np.where((xd < lo) | (xd > hi), 0.0, 2.0 / (xd * (1 - xd)))
    np.testing.assert_allclose(g, want, rtol=1e-5)
