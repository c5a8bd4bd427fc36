"""Operators and methods of traced values, mirroring ``mindspore.Tensor``.

Attached to ``fshard.core.tracing.Tracer`` at import time, so code written against
MindSpore Tensors (``x @ w + b``, ``x.sum(axis=1)``, ``x.reshape(...)``) traces.
"""

from __future__ import annotations

import inspect
import types

import mindspore.ops
import numpy as np

from fshard.core import dtypes
from fshard import ops
from fshard.core.tracing import Tracer, typeof
from fshard.primitives.composite import extremum_with_index
from fshard.errors import UnsupportedOpError


def _r(fn):
    return lambda self, other: fn(other, self)


def _zero_d_kept(fn, kinds):
    """MindSpore's Mul and Div (as PyTorch's): a 0-d tensor next to a tensor of more
    dimensions, both of one of ``kinds`` (float; for Mul integer too), does not widen
    the result: a float16 array times a float32 0-d tensor is float16 (Add, Sub and the
    others widen it). The 0-d operand is cast to the array's dtype (float16 and
    bfloat16 compute in float32) and the result rounded once to the array's dtype."""
    def op(x, y):
        if isinstance(x, (bool, int, float)) or isinstance(y, (bool, int, float)):
            return fn(x, y)
        ax, ay = typeof(x), typeof(y)
        if (ax.ndim == 0) == (ay.ndim == 0):
            return fn(x, y)
        dt = (ax if ay.ndim == 0 else ay).dtype
        small = (ay if ay.ndim == 0 else ax).dtype
        if dt == small or not any(k(dt) and k(small) for k in kinds):
            return fn(x, y)
        math = dtypes.float32 if dtypes.is_half(dt) else dt
        out = fn(ops.cast(x, math), ops.cast(y, math))
        return out if typeof(out).dtype == dt else ops.cast(out, dt)

    return op


ms_mul = _zero_d_kept(ops.mul, (dtypes.is_float, dtypes.is_int))
ms_div = _zero_d_kept(ops.div, (dtypes.is_float,))


def _both_bool(x, y) -> bool:
    def is_bool(v):
        if isinstance(v, (bool, np.bool_)):
            return True
        return not isinstance(v, (int, float, complex)) and typeof(v).dtype == dtypes.bool_
    return is_bool(x) and is_bool(y)


def ms_add(x, y):
    """MindSpore's ``+`` (and ``+=``): between two bools a logical or (``ops.add`` has
    no bool kernel and refuses them)."""
    return ops.logical_or(x, y) if _both_bool(x, y) else ops.add(x, y)


def ms_sub(x, y):
    """MindSpore's ``-`` with a Tensor on the left: between two bools a logical xor
    (``ops.sub``, ``-=`` and ``True - tensor`` refuse them)."""
    return ops.logical_xor(x, y) if _both_bool(x, y) else ops.sub(x, y)


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
    if perm == (None,):  # numpy.transpose(traced)
        perm = ()
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
    if kw.pop("out", None) is not None:  # numpy.sum(traced) passes out=None
        from fshard.errors import TracerConversionError

        raise TracerConversionError(
            "a traced value cannot write its result into out=... (fshard programs are "
            "pure).\nFix: drop out= and use the returned value, e.g. m = numpy.max(x).")
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
    n = ops.count(x, axis, dtypes.float64)  # read at run time for a symbolic dimension
    return ops.cast(ops.div(ops.cast(total, dtypes.float64),
                            float(n) if isinstance(n, int) else n), dt)  # truncates


def _sum(self, axis=None, *rest, **kw):
    axis, keepdims, dtype = _reduce_args(axis, rest, kw)
    return ms_sum(self, axis, keepdims, dtype)


def _mean(self, axis=None, *rest, **kw):
    axis, keepdims, dtype = _reduce_args(axis, rest, kw)
    return ms_mean(self, axis, keepdims, dtype)


def _index64(x):
    return ops.cast(x, dtypes.int64)  # MindSpore's index dtype


def _no_out(out):
    if out is not None:  # numpy.max(traced) passes out=None
        from fshard.errors import TracerConversionError

        raise TracerConversionError(
            "a traced value cannot write its result into out=... (fshard programs are "
            "pure).\nFix: drop out= and use the returned value, e.g. m = numpy.max(x).")


def _extremum(largest: bool):
    reduce = ops.reduce_max if largest else ops.reduce_min

    def method(self, dim=None, keepdim=False, *, axis=None, keepdims=None, out=None,
               return_indices=False, **numpy_only):
        _no_out(out)
        if numpy_only:
            raise UnsupportedOpError(
                f"Tensor.max/min({', '.join(f'{k}=' for k in numpy_only)}...) is not "
                "traced by fshard.\nFix: reduce first, then combine: "
                "ops.maximum(x.max(axis), initial), or x.masked_fill(~where, -inf).max(axis).")
        if dim is not None and keepdims is None:  # max(dim[, keepdim]) -> (values, indices)
            values, index = extremum_with_index(self, dim, keepdim, largest)
            return values, _index64(index)
        # NumPy's form (MindSpore picks it when keepdims= is given): one Tensor; over
        # every axis MindSpore keeps none, even with keepdims=True (a 0-d result). Over
        # one axis it is ArgMaxWithValue's value (its gradient goes to the index, not
        # shared among ties), over several a ReduceMax.
        axis = dim if dim is not None else axis
        keep = keepdim if keepdims is None else keepdims
        if isinstance(axis, (int, np.integer)):
            values, index = extremum_with_index(self, int(axis), keep, largest)
            return (values, _index64(index)) if return_indices else values
        if return_indices:
            raise UnsupportedOpError(
                f"Tensor.max/min(axis={axis!r}, return_indices=True) is not traced by "
                "fshard: indices come with one axis.\nFix: pass one int axis, or reshape "
                "the axes into one first.")
        if axis is None:
            return reduce(self, None, False)
        return reduce(self, axis, keep)

    return method


def _argmax(self, axis=None, keepdims=False, *, dim=None, keepdim=None, out=None):
    _no_out(out)
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
    if axis is None or axis == ():
        return ops.squeeze(self, None)
    # MindSpore (as PyTorch) leaves a named dimension whose size is not 1 in place.
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    keep = tuple(a for a in axes if self.shape[a % max(self.ndim, 1)] == 1)
    return ops.squeeze(self, keep) if keep else self


METHODS = {
    "__add__": ms_add, "__radd__": _r(ms_add),
    "__sub__": ms_sub, "__rsub__": _r(ops.sub),
    "__mul__": ms_mul, "__rmul__": _r(ms_mul),
    # MindSpore's ``other / tensor`` is ``tensor.reciprocal() * other`` (Tensor's own
    # __rtruediv__): the same, bit for bit, and 1 / -0.0 stays -inf.
    "__truediv__": ms_div, "__rtruediv__": lambda self, other: ms_mul(
        ops.reciprocal(self), other),
    "__pow__": ops.pow, "__rpow__": _r(ops.pow),
    "__matmul__": ops.matmul, "__rmatmul__": _r(ops.matmul),
    "__neg__": ops.neg, "__pos__": lambda self: self, "__abs__": ops.abs,
    "__lt__": ops.less, "__le__": ops.less_equal,
    "__gt__": ops.greater, "__ge__": ops.greater_equal,
    "__eq__": ops.equal, "__ne__": ops.not_equal,
    "__getitem__": _getitem,
    "sum": _sum, "mean": _mean,
    "max": _extremum(True),
    "min": _extremum(False),
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
    "numel": lambda self: ops.count(self),
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

def _clip(self, min=None, max=None):  # noqa: A002  (MindSpore's parameter names)
    if min is None and max is None:
        return self

    def bound(b):  # a Python number takes the value's dtype, as MindSpore's, but a
        # float bound of an integer value makes the result float
        if isinstance(b, float) and not dtypes.is_float(typeof(self).dtype):
            return b
        return ops.cast(b, typeof(self).dtype) if isinstance(b, (int, float)) else b

    return ops.clamp(self, None if min is None else bound(min),
                     None if max is None else bound(max))


def _var(self, axis=None, ddof=0, keepdims=False, *, dtype=None, out=None, dim=None,
         correction=None, keepdim=None):
    """``Tensor.var``: the mean squared deviation (``ddof``: NumPy's delta degrees of
    freedom), in the input's float dtype (``dtype``, ``out``: ``numpy.var(traced)``).
    PyTorch's keywords (``dim``, ``correction``, default 1, ``keepdim``) pick its form,
    as in MindSpore."""
    _no_out(out)
    if dim is not None or correction is not None or keepdim is not None:
        axis = dim if dim is not None else axis
        ddof = 1 if correction is None else correction
        keepdims = keepdims if keepdim is None else keepdim
    if dtype is not None:
        self = ops.cast(self, dtype)
    x = self if dtypes.is_float(typeof(self).dtype) else ops.cast(self, dtypes.float32)
    dev = x - ops.mean(x, axis, True)
    squares = ops.reduce_sum(dev * dev, axis, keepdims)
    n = ops.count(x, axis, typeof(x).dtype)
    if isinstance(n, int):
        return squares * (1.0 / (n - ddof) if n > ddof else float("nan"))
    # A symbolic dimension: the count is read at run time; n <= ddof gives nan, as above.
    dof = ops.sub(n, float(ddof))
    return ops.where(ops.greater(dof, 0.0), ops.div(squares, dof), float("nan"))


def truthy_reduce(x, is_any: bool, axis=None, keepdims=False):
    """``any``/``all``: a value counts as true when it is non-zero (0.5 included, so
    the test is ``!= 0`` before any integer cast)."""
    flags = ops.cast(ops.not_equal(x, ops.zeros_like(x)), dtypes.int32)
    reduce = ops.reduce_max if is_any else ops.reduce_min
    return ops.greater(reduce(flags, axis, keepdims), 0)


def _any(self, axis=None, keep_dims=False, *, keepdims=None, out=None, dim=None,
         keepdim=None):
    _no_out(out)
    axis = dim if dim is not None else axis
    keep = keepdims if keepdims is not None else keepdim if keepdim is not None else keep_dims
    return truthy_reduce(self, True, axis, keep)


def _all(self, axis=None, keep_dims=False, *, keepdims=None, out=None, dim=None,
         keepdim=None):
    _no_out(out)
    axis = dim if dim is not None else axis
    keep = keepdims if keepdims is not None else keepdim if keepdim is not None else keep_dims
    return truthy_reduce(self, False, axis, keep)


def _norm(self, ord=None, dim=None, keepdim=False, *, axis=None, keepdims=None):  # noqa: A002
    if ord not in (None, 2, "fro"):
        raise UnsupportedOpError(
            f"a traced value's norm(ord={ord!r}) is not supported (only the 2-norm / "
            "Frobenius norm).\nFix: write it with fs.ops, e.g. abs(x).max() for ord=inf.")
    axis = dim if axis is None else axis
    keep = keepdim if keepdims is None else keepdims
    return ops.sqrt(ops.reduce_sum(self * self, axis, keep))


def _refuse_in_place(self, *args, **kwargs):
    from fshard.errors import TracerConversionError

    raise TracerConversionError(
        f"a traced value {self} cannot be updated in place (item assignment, fill_, ...): "
        "fshard programs are pure.\nFix: build a new value, e.g. fs.ops.where(mask, v, x) "
        "instead of x[mask] = v.")


def _setitem(self, idx, value):
    """``x[idx] = value`` on a traced value: ``x`` is rebound to the functional update
    (``fs.ops.index_update``). The staged program refers to values by their IR variable,
    and equations already recorded hold the old one: uses of ``x`` before the assignment
    see the old value, later ones the new (``x[idx] += v`` reads, adds, then assigns)."""
    from fshard.core.tracing import current_trace
    from fshard.errors import TracerConversionError
    from fshard.primitives.composite import index_update
    from fshard.core.staging import StagedTracer

    trace = current_trace()
    if not isinstance(self, StagedTracer) or self.owner is not trace or not trace.active:
        raise TracerConversionError(
            f"x[...] = value on a traced value {self} that belongs to an enclosing "
            "transform (a closed-over value, or one that escaped its transform): fshard can "
            "only rebind a value of the function being traced.\nFix: pass the value in as "
            "an argument, or assign into a copy made here: y = x + 0; y[...] = value "
            "(or use fs.ops.index_update(x, idx, value)).")
    if self.ir_var in trace.__dict__.get("view_vars", ()):
        raise UnsupportedOpError(
            f"x[...] = value on {self}, which was made from another traced value by "
            "indexing or a view method (x[...], reshape, view, transpose, squeeze, ...). In "
            "MindSpore that value shares memory with its source and the assignment writes "
            "into the source too; a traced program has no shared memory, so fshard "
            "refuses rather than leave the source unchanged.\nFix: assign into the source "
            "itself (x[0, 1] = v instead of row = x[0]; row[1] = v), or, if the source "
            "must not change, update a copy explicitly: "
            "row = fs.ops.index_update(row, 1, v).")
    new = index_update(self, idx, value)
    if new is self:
        return
    if not isinstance(new, StagedTracer) or new.owner is not trace:  # an untraced update
        raise TracerConversionError(f"x[...] = value could not be traced for {self}.")
    self.ir_var = new.ir_var


def _refuse_tolist(self):
    from fshard.errors import TracerConversionError

    raise TracerConversionError(
        f"a traced value {self} has no Python values yet (tolist() needs concrete data).\n"
        "Fix: return the value from the transformed function and call tolist() on the "
        "result.")


METHODS.update({
    "__and__": ops.bitwise_and, "__rand__": _r(ops.bitwise_and),
    "__or__": ops.bitwise_or, "__ror__": _r(ops.bitwise_or),
    "__xor__": ops.bitwise_xor, "__rxor__": _r(ops.bitwise_xor),
    "__lshift__": ops.shift_left, "__rlshift__": _r(ops.shift_left),
    "__rshift__": ops.shift_right, "__rrshift__": _r(ops.shift_right),
})
METHODS.update({
    "__floordiv__": ops.floor_divide, "__rfloordiv__": _r(ops.floor_divide),
    "__mod__": ops.remainder, "__rmod__": _r(ops.remainder),
})
def _invert(self):
    """``~``: a logical not of a bool value (MindSpore's and NumPy's ``~`` agree there).
    Of a number they differ (MindSpore's is a logical not, NumPy's a bitwise one), so
    which one is meant must be written out."""
    if typeof(self).dtype == dtypes.bool_:
        return ops.logical_not(self)

    raise UnsupportedOpError(
        f"the operator ~ on a traced {typeof(self)} value: MindSpore's Tensor computes it "
        f"as a logical not (a bool result), NumPy as a bitwise not, so fshard does not "
        f"guess.\nFix: write fs.ops.logical_not(x) (mindspore.ops.logical_not, "
        f"MindSpore's ~), or fs.ops.bitwise_xor(x, -1) for NumPy's bitwise ~ of an "
        f"integer.")


METHODS["__invert__"] = _invert

def _round(self, decimals=0, *, out=None):
    _no_out(out)
    if decimals != 0:
        raise UnsupportedOpError(
            f"a traced value's round(decimals={decimals!r}) is not supported (only "
            "decimals=0).\nFix: scale first, e.g. fs.ops.round(x * 100) / 100.")
    return ops.round(self)


def _tile(self, *multiples):
    """``Tensor.tile(multiples)`` (NumPy's ``tile``): each dimension repeated whole, by
    a broadcast of an interleaved reshape (no primitive of its own)."""
    reps = tuple(multiples[0]) if len(multiples) == 1 and isinstance(
        multiples[0], (tuple, list)) else tuple(multiples)
    if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0
               for r in reps):
        from fshard.errors import ArgumentError

        raise ArgumentError(f"tile(multiples=...) must be non-negative ints, got {reps!r}.")
    shape = tuple(self.shape)
    nd = max(len(shape), len(reps))
    shape, reps = (1,) * (nd - len(shape)) + shape, (1,) * (nd - len(reps)) + reps
    x = ops.reshape(self, tuple(d for s in shape for d in (1, s)))
    x = ops.broadcast_to(x, tuple(d for r, s in zip(reps, shape) for d in (r, s)))
    return ops.reshape(x, tuple(r * s for r, s in zip(reps, shape)))


def _axis_kw(axis, kw, default=None):
    """MindSpore's Tensor methods name the axis ``axis`` or ``dim``."""
    dim = kw.pop("dim", None)
    if kw:
        raise TypeError(f"unexpected keyword arguments {sorted(kw)}")
    return default if axis is None and dim is None else (axis if dim is None else dim)


def _integers_as(wide):
    """The dtype MindSpore's Tensor methods compute an integer or bool ``x`` in when no
    dtype is given (``x.prod()``, ``x.cumprod()``: int64; ``x.cumsum()``: int32 for
    those narrower than int32), or None to keep ``x``'s."""
    def rule(x):
        dt = typeof(x).dtype
        if dtypes.is_float(dt):
            return None
        if wide == dtypes.int32 and dt in (dtypes.int32, dtypes.int64):
            return None
        return wide if dt != wide else None

    return rule


def _running(fn, default=None):
    def method(self, axis=None, dtype=None, **kw):
        axis = _axis_kw(axis, kw)
        if dtype is None and default is not None:
            dtype = default(self)
        x = self if dtype is None else ops.cast(self, dtype)
        if axis is None:  # over the flattened value (NumPy's rule)
            x, axis = ops.reshape(x, (-1,)), 0
        return fn(x, axis)

    return method


def _sort(self, axis=None, descending=False, **kw):
    kw.pop("stable", None)
    return ops.sort(self, _axis_kw(axis, kw, -1), descending)


def _argsort(self, axis=None, descending=False, **kw):
    kw.pop("stable", None)
    return ops.argsort(self, _axis_kw(axis, kw, -1), descending)  # int32, as MindSpore


def _topk(self, k, dim=None, largest=True, sorted=True):  # noqa: A002
    return ops.topk(self, k, -1 if dim is None else dim, largest, sorted)


def _prod(self, axis=None, keep_dims=False, dtype=None, **kw):
    keep = kw.pop("keepdim", kw.pop("keepdims", keep_dims))
    if dtype is None:
        dtype = _integers_as(dtypes.int64)(self)
    return ops.prod(self, _axis_kw(axis, kw), keep, dtype)


METHODS.update({
    "cumsum": _running(ops.cumsum, _integers_as(dtypes.int32)),
    "cumprod": _running(ops.cumprod, _integers_as(dtypes.int64)),
    "sort": _sort, "argsort": _argsort, "topk": _topk, "prod": _prod,
    "flip": lambda self, dims: ops.flip(self, dims),
    "roll": lambda self, shifts, dims=None: ops.roll(self, shifts, dims),
    "tril": lambda self, diagonal=0: ops.tril(self, diagonal),
    "triu": lambda self, diagonal=0: ops.triu(self, diagonal),
    "narrow": lambda self, axis, start, length: ops.narrow(self, axis, start, length),
    "repeat_interleave": lambda self, repeats, dim=None: ops.repeat_interleave(
        self, repeats, dim),
    "isnan": ops.isnan, "isinf": ops.isinf, "isfinite": ops.isfinite,
    "nan_to_num": ops.nan_to_num,
    "logical_and": ops.logical_and, "logical_or": ops.logical_or,
    "logical_xor": ops.logical_xor, "logical_not": ops.logical_not,
    "isclose": ops.isclose, "log1p": ops.log1p, "expm1": ops.expm1,
    "reciprocal": ops.reciprocal, "atan2": ops.atan2, "arctan2": ops.atan2,
    "floor_divide": ops.floor_divide, "remainder": ops.remainder,
    "masked_fill": ops.masked_fill,
})


def _mindspore_function(name):
    """The Tensor method ``name`` as MindSpore's ``ops.<name>`` function, which traces
    (its pieces are slices and ``split``s): the same signature and the same pieces."""
    def method(self, *args, **kwargs):
        return getattr(mindspore.ops, name)(self, *args, **kwargs)

    method.__name__ = name
    return method


def _median(self, axis=-1, keepdims=False, *, dim=None, keepdim=None):
    """MindSpore's two overloads, ``(axis, keepdims)`` and ``(dim, keepdim)``: the
    median along one axis and its index."""
    return mindspore.ops.median(self, axis if dim is None else dim,
                                keepdims if keepdim is None else keepdim)


def _count_nonzero(self, axis=(), keep_dims=False, dtype=None):
    return mindspore.ops.count_nonzero(self, axis=axis, keep_dims=keep_dims,
                                       dtype=mindspore.int32 if dtype is None else dtype)


def _new_full(fill):
    def method(self, size, dtype=None):
        return ops.full(tuple(size) if isinstance(size, (list, tuple)) else (size,), fill,
                        self.dtype if dtype is None else dtype)
    return method


# Methods that are MindSpore's functions with the Tensor first (``Tensor.<name>``'s
# signature as MindSpore 2.10 dispatches it, checked in tests/test_hostile_parity.py).
METHODS.update({
    "median": _median,
    "nansum": lambda self, axis=(), keepdims=False, *, dtype=None: mindspore.ops.nansum(
        self, None if axis == () else axis, keepdims, dtype=dtype),
    "logsumexp": lambda self, dim, keepdim=False: mindspore.ops.logsumexp(self, dim,
                                                                          keepdim),
    "index_select": lambda self, axis, index: mindspore.ops.index_select(self, axis, index),
    "unbind": lambda self, dim=0: mindspore.ops.unbind(self, dim),
    "count_nonzero": _count_nonzero,
    "new_zeros": _new_full(0), "new_ones": _new_full(1),
})

# nn.MultiheadAttention splits its packed projection with ``tensor_split``.
METHODS.update({name: _mindspore_function(name) for name in ("split", "tensor_split", "chunk")})
# ops.diff gathers with the method; ops.nansum asks is_complex.
METHODS.update({"gather": _mindspore_function("gather"),
                "is_complex": lambda self: self.dtype in (mindspore.complex64,
                                                          mindspore.complex128)})

METHODS.update({
    "floor": ops.floor, "round": _round, "tile": _tile,
    "clip": _clip, "clamp": _clip, "var": _var,
    "std": lambda self, axis=None, ddof=0, keepdims=False, **kw: ops.sqrt(
        _var(self, axis, ddof, keepdims, **kw)),
    "any": _any, "all": _all, "norm": _norm,
    "copy": lambda self: self,
    "__setitem__": _setitem, "fill_": _refuse_in_place, "fill": _refuse_in_place,
    "tolist": _refuse_tolist,
})

# MindSpore Tensors share memory with their views: after ``v = x[0]`` (or
# ``x.reshape``, ``x.transpose``, ...), ``v[1] = 5`` writes into ``x`` too. A traced
# program has no aliasing, so the results of these methods are remembered (per trace,
# by IR variable) and assignment into one is refused instead of silently not writing
# through to ``x``.
_VIEW_METHODS = ("__getitem__", "reshape", "view", "transpose", "permute", "swapaxes",
                 "expand_dims", "unsqueeze", "squeeze", "flatten", "narrow", "T", "mT")


def _marks_view(method):
    def view_method(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        var = getattr(out, "ir_var", None)
        # (``self`` a Parameter, traced while tracing: its view is one too)
        if var is not None and out is not self and (
                not isinstance(self, Tracer) or out.owner is self.owner):
            views = out.owner.__dict__.setdefault("view_vars", set())
            views.add(var)
        return out

    view_method.__name__ = getattr(method, "__name__", "view_method")
    return view_method


for _name in _VIEW_METHODS:
    if _name in METHODS:
        METHODS[_name] = _marks_view(METHODS[_name])

for _name, _fn in METHODS.items():
    setattr(Tracer, _name, _fn)


def _missing_method(self, name):
    """A Tensor method fshard does not trace: an ``UnsupportedOpError`` naming it (an
    ``AttributeError`` for names no Tensor has)."""
    import sys

    from mindspore import Tensor

    if not name.startswith("_"):
        # A Tensor method MindSpore writes in Python (``ravel``, ``diagonal``, ...) is a
        # composition of ops: run MindSpore's own code on the traced value, so the ops
        # it calls trace (``ops.diagflat`` calls ``x.ravel()``, for one).
        fn = inspect.getattr_static(Tensor, name, None)
        if isinstance(fn, types.FunctionType) and fn.__module__ == "mindspore.common.tensor":
            return types.MethodType(fn, self)
    caller = sys._getframe(1).f_globals.get("__name__", "")
    # Libraries probe attributes with hasattr (which only catches AttributeError): only
    # a method called from the user's code gets the fshard error.
    if name.startswith("_") or not hasattr(Tensor, name) or caller.split(".")[0] in (
            "mindspore", "fshard", "numpy", "optree", "builtins"):
        raise AttributeError(f"a traced value has no attribute {name!r}")

    raise UnsupportedOpError(
        f"fshard cannot trace the Tensor method {name!r} on a traced value {self}.\nFix: "
        "write it with fshard.ops or supported methods (docs/tracing.md lists them), or "
        "compute it outside the transformed function.")


Tracer.__getattr__ = _missing_method


def _T(self):
    return ops.transpose(self)


Tracer.T = property(_marks_view(_T))
# An int for static shapes; with a symbolic dimension, a 0-d int64 value read at run time
# (a placeholder number would silently enter every average computed from it).
Tracer.size = property(lambda self: ops.count(self))
Tracer.mT = property(_marks_view(lambda self: ops.swapaxes(self, -1, -2)))
