"""Core objects: ArrayType, Primitive, Trace, Tracer and ``bind`` (dimensions, Symbols
included, are in ``fshard.core.dims``).

fshard is initial-style: a transform first *stages* a function into a Program
(``fshard.core.staging``), then re-interprets that Program equation by equation,
calling ``bind`` for every operation it emits. ``bind`` hands the operation to
the *current trace*: the eager ``EvalTrace`` (run MindSpore ops now) or a
``StagingTrace`` (record an equation). Because every transform emits its work
through ``bind``, transforms compose by nesting.

This module imports no transform and runs no MindSpore op.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from fshard.core import context, dtypes
from fshard.errors import (ArgumentError, TracerConversionError, TracerLeakError,
                           UnsupportedDtypeError, UnsupportedOpError)
from fshard.core.rules import abstract_eval, impl, takes_process_local

from fshard.core.dims import (  # noqa: F401  (the dimension types live beside the core)
    Dim, DimExpr, Symbol, dim_div, dim_eval, dim_mul, dim_multiple_of, dim_prod, dims_equal,
    is_symbolic,
)

# ---------------------------------------------------------------------------
# Abstract values
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ArrayType:
    """The abstract value of an array: its shape (ints or Symbols) and MindSpore dtype.

    >>> str(ArrayType((4, 8), dtypes.float32))
    'f32[4,8]'
    """

    shape: tuple
    dtype: Any

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.is_static else -1

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def __str__(self) -> str:
        return f"{dtypes.short_name(self.dtype)}[{','.join(str(d) for d in self.shape)}]"

    def jaxtyping(self) -> str:
        """The type in jaxtyping's notation.

        >>> ArrayType((4, 784), dtypes.float32).jaxtyping()
        'Float32[Tensor, "4 784"]'
        """
        short = dtypes.short_name(self.dtype)
        kinds = {"f": "Float", "i": "Int", "u": "UInt", "bool": "Bool"}
        kind = next((k for k in sorted(kinds, key=len, reverse=True)
                     if short.startswith(k) and (short[len(k):].isdigit() or k == "bool")),
                    None)
        name = short if kind is None else kinds[kind] + short[len(kind):]  # BFloat16, ...
        return f'{name}[Tensor, "{" ".join(str(d) for d in self.shape)}"]'

    def __eq__(self, other) -> bool:
        return (isinstance(other, ArrayType) and self.dtype == other.dtype
                and len(self.shape) == len(other.shape)
                and all(dims_equal(a, b) for a, b in zip(self.shape, other.shape)))

    def __hash__(self) -> int:
        return hash((tuple(d if isinstance(d, (int, DimExpr)) else id(d) for d in self.shape),
                     str(self.dtype)))


# ---------------------------------------------------------------------------
# Primitives and traces
# ---------------------------------------------------------------------------


class Primitive:
    """A named operation. Its rules live in the tables of ``fshard.core.rules``."""

    __slots__ = ("name", "multiple_results", "show", "effect")

    def __init__(self, name: str, multiple_results: bool = False, show=None,
                 effect: bool = False):
        self.name = name
        self.multiple_results = multiple_results
        # show(params) -> the equation's head in printed IR (default: name[params])
        self.show = show
        # An effect (a debug callback): its equations are never dropped or merged by the
        # IR passes, and the lowering keeps them in program order.
        self.effect = effect

    def __repr__(self) -> str:
        return self.name

    def bind(self, *args, **params):
        return bind(self, *args, **params)


class Trace:
    """Receives every ``bind``: ``process`` returns the list of outputs."""

    def process(self, prim: Primitive, args: tuple, params: dict) -> list:
        raise NotImplementedError  # abstract; every Trace subclass overrides it

    active = True


class Tracer:
    """A value being traced: it belongs to a trace and has an ArrayType.

    Tracer supports the operators and methods of ``mindspore.Tensor`` that fshard
    has primitives for (they are attached by ``fshard.adapter.tensor_methods``).
    """

    __slots__ = ("owner", "aval")
    __array_priority__ = 1000

    def __init__(self, trace: Trace, aval: ArrayType):
        # (not ``trace``: that is a Tensor method, ``x.trace()``)
        self.owner = trace
        self.aval = aval

    @property
    def shape(self) -> tuple:
        return self.aval.shape

    @property
    def dtype(self):
        return self.aval.dtype

    @property
    def ndim(self) -> int:
        return self.aval.ndim

    @property
    def size(self) -> int:
        return self.aval.size

    def dim(self) -> int:
        return self.aval.ndim

    def __len__(self) -> int:
        if not self.aval.shape:
            raise TracerConversionError(
                f"len() of a 0-d traced value {self.aval}: it has no first dimension."
                "\nFix: use it as a scalar, or give it a dimension (x.reshape((1,))).")
        n = self.aval.shape[0]
        if is_symbolic(n):
            raise TracerConversionError(
                f"len() of a traced value {self.aval}: its first dimension {n} ({n!r}) is "
                "symbolic, a size known only when the program runs, and len() must return "
                "a Python int.\nFix: pass x.shape[0] where a dimension is expected "
                "(ops.reshape, ops.zeros((x.shape[0], k))); for the size as a value use "
                "fs.ops.count(x, 0) (or x.size), and ops.mean for an average.")
        return n

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def _concrete_error(self, what: str):
        raise TracerConversionError(
            f"{what} was called on a traced value of type {self.aval}. Inside fshard "
            "transforms (jit, vmap, grad, shard) values are abstract: their contents are "
            "not known while the function is traced, so Python control flow cannot depend "
            "on them.\nFix: express the choice as data with fs.ops.where(cond, x, y) "
            "(or fs.ops.maximum/minimum), or pass the value as a static argument "
            "(fs.jit(f, static_argnums=...)) so it is concrete.")

    def __bool__(self):
        self._concrete_error("bool() (an `if`, `while`, `and`/`or` or `assert`)")

    def __float__(self):
        self._concrete_error("float()")

    def __int__(self):
        self._concrete_error("int()")

    def __index__(self):
        self._concrete_error("operator.index() (using the value as an index or size)")

    def item(self):
        self._concrete_error(".item()")

    def asnumpy(self):
        self._concrete_error(".asnumpy()")

    def __array__(self, *args, **kwargs):
        self._concrete_error("numpy.asarray()")

    def __hash__(self):
        return id(self)

    def __repr__(self) -> str:
        return f"Traced<{self.aval}>"


def is_concrete(x) -> bool:
    return not isinstance(x, Tracer)


class ProcessLocalValue:
    """A concrete value of which this process holds only a part (``fs.ShardedArray``):
    eager operations refuse it (``refuse``) except the primitives listed in
    ``rules.takes_process_local`` (a sharded call, which takes the block)."""

    __slots__ = ()

    def refuse(self, what: str):
        raise NotImplementedError  # ShardedArray says which block it holds and the fix


class EvalTrace(Trace):
    """The outermost trace: run each primitive's eager implementation now."""

    def process(self, prim, args, params):
        for x in args:
            if isinstance(x, Tracer):
                raise TracerLeakError(
                    f"a traced value {x} reached '{prim}' outside the transform that "
                    "created it. It escaped through a global, a closure cell, or an "
                    "attribute set during tracing.\nFix: return the value from the "
                    "transformed function instead of storing it.")
            if isinstance(x, ProcessLocalValue) and prim not in takes_process_local:
                x.refuse(f"the eager operation '{prim}'")
        # Type-check first, so a bad operand is an fshard error, never a MindSpore one.
        abstract_eval.lookup(prim, transform="eager evaluation")(
            *[typeof(x) for x in args], **params)
        kernel = impl.lookup(prim, transform="eager evaluation")
        with context.runtime_lock, kernel_dtype_errors(
                lambda: f"the eager '{prim}' of {', '.join(str(typeof(x)) for x in args)}"):
            # MindSpore runs one op at a time (fshard.core.context)
            return kernel(*args, **params)


_KERNEL_REFUSED = re.compile(r"Select (\w+) operator\[(\w+)\] fail! Unsupported data type")
_KERNEL_GOT = re.compile(r"but get input\[(.*?)\]", re.S)
_NO_KERNEL = re.compile(r"Unsupported op \[(\w+)\] on (\w+)")


@contextlib.contextmanager
def kernel_dtype_errors(where, compiled: bool = False):
    """Turn MindSpore's "Select CPU operator[Op] fail! Unsupported data type" (a kernel
    that lacks the operands' dtype, e.g. bfloat16 MatMul on CPU) into an
    UnsupportedDtypeError that names the op; other errors pass unchanged. ``where`` is a
    string or a function giving it (built only on failure: eager ops are hot).

    With ``compiled`` (a graph fshard lowered and compiled), "Unsupported op [Op] on
    CPU" (an op that runs eagerly but has no kernel in a compiled graph) becomes an
    UnsupportedOpError that names the op. (Eagerly, the generic path words it itself.)"""
    try:
        yield
    except (TypeError, RuntimeError) as e:
        m = _KERNEL_REFUSED.search(str(e))
        if m is None:
            none = _NO_KERNEL.search(str(e)) if compiled else None
            if none is None:
                raise
            raise UnsupportedOpError(
                f"MindSpore has no {none.group(2)} kernel for the op '{none.group(1)}' in a "
                f"compiled graph (in {where() if callable(where) else where}); eager "
                "MindSpore runs it another way.\nFix: call it outside fs.jit, or write it "
                "with fshard.ops (docs/ops.md lists the native ops).") from None
        got = _KERNEL_GOT.search(str(e))
        kinds = sorted(set(re.findall(r"\b[A-Z][A-Za-z]*\d*\b", got.group(1)))) if got else []
        raise UnsupportedDtypeError(
            f"MindSpore's {m.group(1)} kernel for '{m.group(2)}' (in "
            f"{where() if callable(where) else where}) does not "
            "accept its operands' dtypes"
            f"{' (' + ', '.join(kinds) + ')' if kinds else ''}.\nFix: compute "
            "that op in a dtype the kernel takes: cast its operands (x.astype("
            "mindspore.float32)), or use an fs.amp policy whose compute dtype is float16 "
            "or float32; docs/amp.md lists which ops run in which dtype.") from None


_EVAL = EvalTrace()


def current_trace() -> Trace:
    return context.trace.get() or _EVAL


def set_trace(trace: Trace):
    """``trace`` is the current trace inside the block (per thread; see fshard.core.context)."""
    return context.setting(context.trace, trace)


def bind(prim: Primitive, *args, **params):
    """Apply ``prim`` under the current trace. Operands positional, parameters keyword."""
    outs = (context.trace.get() or _EVAL).process(prim, args, params)
    return outs if prim.multiple_results else outs[0]


# ---------------------------------------------------------------------------
# typeof: the ArrayType of any value fshard accepts
# ---------------------------------------------------------------------------


def typeof(x) -> ArrayType:
    """The ArrayType of a Tracer, MindSpore Tensor, NumPy array or Python scalar.

    >>> import numpy as np, fshard as fs
    >>> fs.typeof(np.ones((2, 3), np.float32)), fs.typeof(1.0)
    (ArrayType(shape=(2, 3), dtype=mindspore.float32), ArrayType(shape=(), dtype=mindspore.float32))
    """
    if isinstance(x, Tracer):
        return x.aval
    if isinstance(x, ArrayType):
        return x
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return ArrayType(tuple(shape), dtypes.canonical(dtype))
    if isinstance(x, bool):
        return ArrayType((), dtypes.bool_)
    if isinstance(x, int):
        if not -2**63 <= x < 2**63:
            raise ArgumentError(
                f"the Python int {x} does not fit in int64, the widest integer dtype of "
                "MindSpore.\nFix: pass it as a float, or as a static argument "
                "(static_argnums) if it is a Python value the function uses.")
        return ArrayType((), dtypes.int64)
    if isinstance(x, float):
        return ArrayType((), dtypes.float32)
    if is_symbolic(x):
        raise ArgumentError(
            f"the symbolic dimension {x} ({x!r}) was used as a value; its size is known "
            "only when the program runs.\nFix: use ops.mean (it divides by the run-time "
            "size), or fs.ops.dim_size(x, axes, dtype) for the size as a 0-d array.")
    raise ArgumentError(
        f"expected an array (mindspore.Tensor, numpy.ndarray or Python scalar), got "
        f"{type(x).__name__}: {x!r:.80}.\nFix: convert it with mindspore.Tensor(...), or "
        "pass it as a static argument.")
