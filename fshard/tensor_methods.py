"""Operators and methods of traced values, mirroring ``mindspore.Tensor``.

Attached to ``fshard.core.Tracer`` at import time, so code written against
MindSpore Tensors (``x @ w + b``, ``x.sum(axis=1)``, ``x.reshape(...)``) traces.
"""

from __future__ import annotations

import numpy as np

from fshard import dtypes, ops
from fshard.core import Tracer, typeof


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


# MindSpore 2.10 resolves several Tensor methods between a PyTorch-style and a
# NumPy-style overload; the helpers below follow its choices (checked against MindSpore
# in tests/test_interop.py): a positional int `dim` to max/min returns (values, indices),
# `transpose(a, b)` swaps two axes, and a dtype may come second in `sum`.


def _reduce_args(axis, rest, kw):
    """(axis, keepdims, dtype) from MindSpore's ``sum``/``mean`` overloads."""
    axis = kw.pop("dim", axis)
    keepdims = kw.pop("keepdim", kw.pop("keepdims", kw.pop("keep_dims", False)))
    dtype = kw.pop("dtype", None)
    for r in rest:
        if isinstance(r, bool):
            keepdims = r
        else:
            dtype = r
    if kw:
        raise TypeError(f"unexpected keyword arguments {sorted(kw)}")
    if isinstance(axis, (tuple, list)) and not axis:
        axis = None
    return axis, keepdims, dtype


# MindSpore's dtype rules for sums and means (checked against eager MindSpore for every
# dtype in tests/test_ms_oracle.py): ``sum`` adds bool and integers as int64; ``mean``
# keeps the dtype: integers are summed in their own dtype (wrapping, as MindSpore does)
# and divided with truncation, float16 is accumulated in float32, bool is refused.


def ms_sum(x, axis=None, keepdims=False, dtype=None):
    """``Tensor.sum`` / ``ops.sum`` / ``mint.sum`` with MindSpore's result dtype."""
    if dtype is not None:
        x = ops.cast(x, dtype)
    if not dtypes.is_float(typeof(x).dtype):
        x = ops.cast(x, dtypes.int64)
    return ops.reduce_sum(x, axis, keepdims)


def ms_mean(x, axis=None, keepdims=False, dtype=None, where=""):
    """``Tensor.mean`` / ``ops.mean`` / ``mint.mean`` with MindSpore's result dtype."""
    from fshard.errors import UnsupportedOpError

    if dtype is not None:
        x = ops.cast(x, dtype)
    dt = typeof(x).dtype
    if dt == dtypes.bool_:
        raise UnsupportedOpError(
            f"MindSpore's mean does not accept bool inputs{where}.\nFix: cast to a number "
            "first, e.g. x.astype(mindspore.float32).mean().")
    if dtypes.is_float(dt):
        if dt != dtypes.float16:
            return ops.mean(x, axis, keepdims)
        return ops.cast(ops.mean(ops.cast(x, dtypes.float32), axis, keepdims), dt)
    total = ops.reduce_sum(x, axis, keepdims)  # in x's dtype, wrapping as MindSpore
    n = typeof(x).size // max(typeof(total).size, 1)
    return ops.cast(ops.div(ops.cast(total, dtypes.float64), float(n)), dt)  # truncates


def _sum(self, axis=None, *rest, **kw):
    axis, keepdims, dtype = _reduce_args(axis, rest, kw)
    return ms_sum(self, axis, keepdims, dtype)


def _mean(self, axis=None, *rest, **kw):
    axis, keepdims, dtype = _reduce_args(axis, rest, kw)
    return ms_mean(self, axis, keepdims, dtype)


def _index64(x):
    return ops.cast(x, dtypes.int64)  # MindSpore's index dtype


def _extremum(reduce, arg):
    def method(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        if dim is not None:  # max(dim[, keepdim]) -> (values, indices)
            return reduce(self, dim, keepdim), _index64(arg(self, dim, keepdim))
        return reduce(self, axis, keepdim if keepdims is None else keepdims)

    return method


def _argmax(self, axis=None, keepdims=False, *, dim=None, keepdim=None):
    axis = dim if dim is not None else axis
    keepdims = keepdim if keepdim is not None else keepdims
    if axis is None:
        out = ops.argmax(ops.reshape(self, (-1,)), 0)
        return _index64(ops.reshape(out, (1,) * self.ndim) if keepdims else out)
    return _index64(ops.argmax(self, axis, keepdims))


def _torch_transpose(self, *axes):
    if len(axes) == 2 and all(isinstance(a, int) for a in axes):
        return ops.swapaxes(self, *axes)
    return _transpose(self, *axes)


def _flatten(self, start_dim=0, end_dim=-1):
    nd = max(self.ndim, 1)
    start, end = start_dim % nd, end_dim % nd
    shape = tuple(self.shape)
    return ops.reshape(self, shape[:start] + (-1,) + shape[end + 1:])


def _squeeze(self, *axis):
    if len(axis) == 1:
        axis = axis[0]
    return ops.squeeze(self, axis if axis != () else None)


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
    "sum": _sum, "mean": _mean,
    "max": _extremum(ops.reduce_max, ops.argmax),
    "min": _extremum(ops.reduce_min, ops.argmin),
    "argmax": _argmax,
    "reshape": _reshape, "view": _view,
    "transpose": _torch_transpose, "permute": _transpose,
    "swapaxes": ops.swapaxes,
    "expand_dims": ops.expand_dims, "unsqueeze": ops.expand_dims,
    "squeeze": _squeeze,
    "flatten": _flatten,
    "astype": lambda self, dtype, copy=True: ops.cast(self, dtype), "to": ops.cast,
    "float": lambda self: ops.cast(self, dtypes.float32),
    "half": lambda self: ops.cast(self, dtypes.canonical(np.float16)),
    "int": lambda self: ops.cast(self, dtypes.int32),
    "long": lambda self: ops.cast(self, dtypes.int64),
    "bool": lambda self: ops.cast(self, dtypes.bool_),
    "masked_fill": lambda self, mask, value: ops.where(mask, ops.cast(value, self.dtype), self),
    "numel": lambda self: self.size,
    "neg": ops.neg,
    "exp": ops.exp, "log": ops.log, "tanh": ops.tanh, "sigmoid": ops.sigmoid,
    "relu": ops.relu, "sqrt": ops.sqrt, "rsqrt": ops.rsqrt, "abs": ops.abs,
    "square": ops.square, "sign": ops.sign, "sin": ops.sin, "cos": ops.cos,
    "matmul": ops.matmul,
    "broadcast_to": ops.broadcast_to, "expand_as": lambda self, o: ops.broadcast_to(self, o.shape),
    "softmax": lambda self, axis=-1, dtype=None: ops.softmax(
        self if dtype is None else ops.cast(self, dtype), axis),
    "log_softmax": lambda self, axis=-1: ops.log_softmax(self, axis),
    "add": lambda self, other, *, alpha=1: ops.add(self, other if alpha == 1 else ops.mul(
        other, alpha)),
    "sub": lambda self, other, *, alpha=1: ops.sub(self, other if alpha == 1 else ops.mul(
        other, alpha)),
    "mul": ops.mul, "div": ops.div,
    "maximum": ops.maximum, "minimum": ops.minimum, "pow": ops.pow,
}

for _name, _fn in METHODS.items():
    setattr(Tracer, _name, _fn)


def _T(self):
    return ops.transpose(self)


Tracer.T = property(_T)
Tracer.mT = property(lambda self: ops.swapaxes(self, -1, -2))
