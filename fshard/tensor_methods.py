"""Operators and methods of traced values, mirroring ``mindspore.Tensor``.

Attached to ``fshard.core.Tracer`` at import time, so code written against
MindSpore Tensors (``x @ w + b``, ``x.sum(axis=1)``, ``x.reshape(...)``) traces.
"""

from __future__ import annotations

from fshard import dtypes, ops
from fshard.core import Tracer


def _r(fn):
    return lambda self, other: fn(other, self)


def _getitem(self, idx):
    from fshard.primitives.structural import getitem

    return getitem(self, idx)


def _reshape(self, *shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return ops.reshape(self, shape)


def _transpose(self, *perm):
    if len(perm) == 1 and isinstance(perm[0], (tuple, list)):
        perm = tuple(perm[0])
    return ops.transpose(self, perm or None)


def _view(self, *shape):
    return _reshape(self, *shape)


METHODS = {
    "__add__": ops.add, "__radd__": _r(ops.add),
    "__sub__": ops.sub, "__rsub__": _r(ops.sub),
    "__mul__": ops.mul, "__rmul__": _r(ops.mul),
    "__truediv__": ops.div, "__rtruediv__": _r(ops.div),
    "__pow__": ops.pow, "__rpow__": _r(ops.pow),
    "__matmul__": ops.matmul, "__rmatmul__": _r(ops.matmul),
    "__neg__": ops.neg, "__pos__": lambda self: self, "__abs__": ops.abs,
    "__lt__": ops.less, "__le__": ops.less_equal,
    "__gt__": ops.greater, "__ge__": ops.greater_equal,
    "__eq__": ops.equal, "__ne__": ops.not_equal,
    "__getitem__": _getitem,
    "sum": lambda self, axis=None, keepdims=False, dtype=None: ops.reduce_sum(
        self if dtype is None else ops.cast(self, dtype), axis, keepdims),
    "mean": lambda self, axis=None, keep_dims=False: ops.mean(self, axis, keep_dims),
    "max": lambda self, axis=None, keepdims=False: ops.reduce_max(self, axis, keepdims),
    "min": lambda self, axis=None, keepdims=False: ops.reduce_min(self, axis, keepdims),
    "argmax": lambda self, axis=None, keepdims=False: ops.argmax(
        ops.reshape(self, (-1,)) if axis is None else self, -1 if axis is None else axis,
        keepdims),
    "reshape": _reshape, "view": _view,
    "transpose": _transpose, "permute": _transpose,
    "swapaxes": ops.swapaxes,
    "expand_dims": ops.expand_dims, "unsqueeze": ops.expand_dims,
    "squeeze": lambda self, axis=None: ops.squeeze(self, axis),
    "flatten": lambda self, start_dim=0: ops.flatten(self, start_dim),
    "astype": ops.cast, "to": ops.cast,
    "float": lambda self: ops.cast(self, dtypes.float32),
    "exp": ops.exp, "log": ops.log, "tanh": ops.tanh, "sigmoid": ops.sigmoid,
    "relu": ops.relu, "sqrt": ops.sqrt, "rsqrt": ops.rsqrt, "abs": ops.abs,
    "square": ops.square, "sign": ops.sign, "sin": ops.sin, "cos": ops.cos,
    "matmul": ops.matmul,
    "broadcast_to": ops.broadcast_to, "expand_as": lambda self, o: ops.broadcast_to(self, o.shape),
    "softmax": lambda self, axis=-1: ops.softmax(self, axis),
    "log_softmax": lambda self, axis=-1: ops.log_softmax(self, axis),
    "add": ops.add, "sub": ops.sub, "mul": ops.mul, "div": ops.div,
    "maximum": ops.maximum, "minimum": ops.minimum, "pow": ops.pow,
}

for _name, _fn in METHODS.items():
    setattr(Tracer, _name, _fn)


def _T(self):
    return ops.transpose(self)


Tracer.T = property(_T)
Tracer.mT = property(lambda self: ops.swapaxes(self, -1, -2))
