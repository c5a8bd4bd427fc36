"""Core objects: Symbol, ArrayType, Primitive, Trace, Tracer and ``bind``.

fshard is initial-style: a transform first *stages* a function into a Program
(``fshard.staging``), then re-interprets that Program equation by equation,
calling ``bind`` for every operation it emits. ``bind`` hands the operation to
the *current trace*: the eager ``EvalTrace`` (run MindSpore ops now) or a
``StagingTrace`` (record an equation). Because every transform emits its work
through ``bind``, transforms compose by nesting.

This module imports no transform and runs no MindSpore op.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from fshard import context, dtypes
from fshard.errors import ArgumentError, TracerConversionError, TracerLeakError
from fshard.rules import abstract_eval, impl

# ---------------------------------------------------------------------------
# Symbols: dimensions whose size is known only by its constraints
# ---------------------------------------------------------------------------

_symbol_ids = itertools.count()


class Symbol:
    """A symbolic dimension, with MindSpore's meaning: size = divisor * N + remainder.

    >>> s = Symbol(divisor=8)
    >>> s.accepts(16), s.accepts(12)
    (True, False)

    Args:
        max: upper bound on the size; 0 means unbounded (only effective if > ``min``).
        min: lower bound on the size (>= 1).
        divisor: the size is a multiple of it, plus ``remainder``.
        remainder: in ``[0, divisor)``.
        unique: every dimension annotated with this same Symbol object has equal size.
    """

    __slots__ = ("max", "min", "divisor", "remainder", "unique", "name")

    def __init__(self, max: int = 0, min: int = 1, divisor: int = 1, remainder: int = 0,
                 unique: bool = False):
        for arg, value in (("max", max), ("min", min), ("divisor", divisor),
                           ("remainder", remainder)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ArgumentError(
                    f"Symbol({arg}=...) must be an int, got {type(value).__name__} {value!r}.")
        if min <= 0:
            raise ArgumentError(f"Symbol(min=...) must be >= 1, got {min}.")
        if divisor <= 0:
            raise ArgumentError(f"Symbol(divisor=...) must be >= 1, got {divisor}.")
        if not 0 <= remainder < divisor:
            raise ArgumentError(
                f"Symbol(remainder=...) must be in [0, divisor={divisor}), got {remainder}.")
        if max < 0:
            raise ArgumentError(f"Symbol(max=...) must be >= 0 (0: unbounded), got {max}.")
        if max and max < min:
            raise ArgumentError(
                f"Symbol(max={max}, min={min}): max is below min, so no size satisfies it.\n"
                "Fix: max >= min, or max=0 for no upper bound.")
        if not isinstance(unique, bool):
            raise ArgumentError(f"Symbol(unique=...) must be a bool, got {unique!r}.")
        self.max, self.min, self.divisor, self.remainder = max, min, divisor, remainder
        self.unique = unique
        self.name = f"s{next(_symbol_ids)}"

    def accepts(self, size: int) -> bool:
        """Whether a concrete size satisfies this Symbol's constraints."""
        if size < self.min or (self.max > self.min and size > self.max):
            return False
        return size % self.divisor == self.remainder

    def __repr__(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k, default in
                 (("max", 0), ("min", 1), ("divisor", 1), ("remainder", 0), ("unique", False))
                 if getattr(self, k) != default]
        return f"Symbol({', '.join(parts)})" if parts else "Symbol()"

    def __str__(self) -> str:
        return self.name

    # arithmetic: a Symbol times or divided by a dimension is a DimExpr (a monomial)
    def __mul__(self, other):
        return dim_mul(self, other)

    __rmul__ = __mul__

    def __floordiv__(self, other):
        return dim_div(self, other)

    @property
    def id(self) -> int:
        return int(self.name[1:])


class DimExpr:
    """A product of Symbols with a rational coefficient, e.g. ``784*s0`` or ``s0/8``
    (what reshape, matmul and sharding make of symbolic dimensions).

    >>> s = Symbol(divisor=8)
    >>> str(s * 784) == f"784*{s}", str(s // 8) == f"{s}/8", (s * 784) // 784 is s
    (True, True, True)

    Built only through ``dim_mul``/``dim_div`` (and Symbol's ``*``, ``//``), which
    return an int or the Symbol itself when the product is one.
    """

    __slots__ = ("coeff", "factors")

    def __init__(self, coeff: Fraction, factors: tuple):
        self.coeff, self.factors = coeff, factors  # factors: ((Symbol, power), ...) by id

    def __eq__(self, other) -> bool:
        return (isinstance(other, DimExpr) and self.coeff == other.coeff
                and len(self.factors) == len(other.factors)
                and all(a is b and p == q for (a, p), (b, q) in zip(self.factors, other.factors)))

    def __hash__(self) -> int:
        return hash((self.coeff, tuple((id(s), p) for s, p in self.factors)))

    def __mul__(self, other):
        return dim_mul(self, other)

    __rmul__ = __mul__

    def __floordiv__(self, other):
        return dim_div(self, other)

    def __str__(self) -> str:
        syms = "*".join(s.name if p == 1 else f"{s.name}^{p}" for s, p in self.factors)
        num, den = self.coeff.numerator, self.coeff.denominator
        out = syms if num == 1 else f"{num}*{syms}"
        return out if den == 1 else f"{out}/{den}"

    __repr__ = __str__

    def symbols(self) -> list:
        return [s for s, _ in self.factors]


Dim = int | Symbol | DimExpr


def _monomial(d) -> tuple[Fraction, dict]:
    if isinstance(d, Symbol):
        return Fraction(1), {d: 1}
    if isinstance(d, DimExpr):
        return d.coeff, dict(d.factors)
    return Fraction(int(d)), {}


def _make_dim(coeff: Fraction, factors: dict):
    facs = tuple(sorted(((s, p) for s, p in factors.items() if p), key=lambda f: f[0].id))
    if not facs:
        if coeff.denominator != 1:
            raise ArgumentError(f"a dimension of {coeff} is not a whole number")
        return int(coeff)
    if coeff == 1 and len(facs) == 1 and facs[0][1] == 1:
        return facs[0][0]
    return DimExpr(coeff, facs)


def is_symbolic(d) -> bool:
    """Whether a dimension is a Symbol or a DimExpr (not an int)."""
    return isinstance(d, (Symbol, DimExpr))


def dim_mul(a, b):
    """``a * b`` of two dimensions (ints, Symbols, DimExprs)."""
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    ca, fa = _monomial(a)
    cb, fb = _monomial(b)
    for s, p in fb.items():
        fa[s] = fa.get(s, 0) + p
    return _make_dim(ca * cb, fa)


def dim_prod(dims):
    """The product of dimensions (1 for none)."""
    out = 1
    for d in dims:
        out = dim_mul(out, d)
    return out


def dim_multiple_of(d, k: int) -> bool:
    """Whether dimension ``d`` is provably a multiple of ``k`` for every size its Symbols
    accept (a Symbol of ``divisor=8, remainder=0`` is a multiple of 8, 4, 2 and 1)."""
    if isinstance(d, int):
        return d % k == 0
    coeff, factors = _monomial(d)
    if any(s.remainder for s in factors):  # only the coefficient is known
        whole = coeff
    else:
        whole = coeff * int(np.prod([s.divisor ** p for s, p in factors.items()]))
    return whole.denominator == 1 and whole.numerator % k == 0


def dim_div(a, b):
    """``a / b`` of two dimensions when it is provably a whole dimension for every size
    the Symbols accept; else an ArgumentError saying what would have to hold."""
    if isinstance(a, int) and isinstance(b, int):
        if b == 0 or a % b:
            raise ArgumentError(f"{a} is not a multiple of {b}")
        return a // b
    ca, fa = _monomial(a)
    cb, fb = _monomial(b)
    for s, p in fb.items():
        fa[s] = fa.get(s, 0) - p
    if cb == 0 or any(p < 0 for p in fa.values()):
        raise ArgumentError(f"{a} / {b} is not a dimension: {b} does not divide {a} "
                            "for every size the Symbols accept")
    coeff = ca / cb
    if coeff.denominator != 1:
        num = _make_dim(coeff.numerator * Fraction(1), fa)
        if not dim_multiple_of(num, coeff.denominator):
            raise ArgumentError(
                f"{a} / {b} is not a whole number for every size the Symbols accept: "
                f"{num} would have to be a multiple of {coeff.denominator}.\nFix: declare "
                f"the Symbol with a divisor that is a multiple of {coeff.denominator}.")
    return _make_dim(coeff, fa)


def dim_eval(d, sizes: dict) -> int:
    """The size of dimension ``d`` once each Symbol is bound (``sizes``: Symbol -> int)."""
    if isinstance(d, int):
        return d
    coeff, factors = _monomial(d)
    value = coeff * int(np.prod([sizes[s] ** p for s, p in factors.items()]))
    return int(value)


def dims_equal(a: Dim, b: Dim) -> bool:
    """Two dimensions are statically equal: equal ints, the same Symbol object, or
    equal products of Symbols."""
    return a is b or (isinstance(a, int) and isinstance(b, int) and a == b) or (
        isinstance(a, DimExpr) and a == b)


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
    """A named operation. Its rules live in the tables of ``fshard.rules``."""

    __slots__ = ("name", "multiple_results")

    def __init__(self, name: str, multiple_results: bool = False):
        self.name = name
        self.multiple_results = multiple_results

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
    has primitives for (they are attached by ``fshard.tensor_methods``).
    """

    __slots__ = ("trace", "aval")
    __array_priority__ = 1000

    def __init__(self, trace: Trace, aval: ArrayType):
        self.trace = trace
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
            raise TypeError("len() of a 0-d traced value")
        return self.aval.shape[0]

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
        # Type-check first, so a bad operand is an fshard error, never a MindSpore one.
        abstract_eval.lookup(prim, transform="eager evaluation")(
            *[typeof(x) for x in args], **params)
        kernel = impl.lookup(prim, transform="eager evaluation")
        with context.runtime_lock:  # MindSpore runs one op at a time (fshard.context)
            return kernel(*args, **params)


_EVAL = EvalTrace()


def current_trace() -> Trace:
    return context.trace.get() or _EVAL


def set_trace(trace: Trace):
    """``trace`` is the current trace inside the block (per thread; see fshard.context)."""
    return context.setting(context.trace, trace)


def bind(prim: Primitive, *args, **params):
    """Apply ``prim`` under the current trace. Operands positional, parameters keyword."""
    outs = (context.trace.get() or _EVAL).process(prim, args, params)
    return outs if prim.multiple_results else outs[0]


# ---------------------------------------------------------------------------
# typeof: the ArrayType of any value fshard accepts
# ---------------------------------------------------------------------------


def typeof(x) -> ArrayType:
    """The ArrayType of a Tracer, MindSpore Tensor, NumPy array or Python scalar."""
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
    raise ArgumentError(
        f"expected an array (mindspore.Tensor, numpy.ndarray or Python scalar), got "
        f"{type(x).__name__}: {x!r:.80}.\nFix: convert it with mindspore.Tensor(...), or "
        "pass it as a static argument.")
