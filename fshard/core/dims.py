"""Dimensions: ints, ``Symbol`` (a size known only by its constraints) and ``DimExpr``
(a product of Symbols), with the arithmetic shape rules need: products, exact
division, provable divisibility and equality.

This module imports nothing of fshard but its errors.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np

from fshard.errors import ArgumentError

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
    if len(factors) == 1 and list(factors.values()) == [1]:
        # c * (divisor * N + remainder) for every N: c * gcd(divisor, remainder) divides it
        (s,) = factors
        whole = coeff * math.gcd(s.divisor, s.remainder)
    elif any(s.remainder for s in factors):  # only the coefficient is known
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


def dim_min(d) -> int:
    """The smallest size dimension ``d`` can have: an int is itself; a Symbol is the
    smallest size >= its ``min`` that it accepts (so ``x[0]`` of a ``Symbol(min=1)``
    dimension is provably in bounds).

    >>> dim_min(5), dim_min(Symbol()), dim_min(Symbol(min=3, divisor=4, remainder=1))
    (5, 1, 5)
    """
    if isinstance(d, int):
        return d
    coeff, factors = _monomial(d)
    value = coeff
    for s, p in factors.items():
        value *= (s.min + (s.remainder - s.min) % s.divisor) ** p
    return int(value)


def dims_equal(a: Dim, b: Dim) -> bool:
    """Two dimensions are statically equal: equal ints, the same Symbol object, or
    equal products of Symbols."""
    return a is b or (isinstance(a, int) and isinstance(b, int) and a == b) or (
        isinstance(a, DimExpr) and a == b)


# ---------------------------------------------------------------------------
# Planning: cost models compare layouts by bytes and flops, so a symbolic dimension
# stands for one representative size while a plan is chosen (the plan itself, and
# the program it makes, stay symbolic and serve every size).
# ---------------------------------------------------------------------------

PLANNING_SIZE = 128


def planning_size(d) -> int:
    """The size a cost model assumes for dimension ``d``: an int is itself; a Symbol
    is its ``max`` when bounded, else ``PLANNING_SIZE`` rounded up to a size it accepts.

    >>> planning_size(7), planning_size(Symbol(divisor=24)), planning_size(Symbol(max=16))
    (7, 144, 16)
    """
    if isinstance(d, int):
        return d
    coeff, factors = _monomial(d)
    value = coeff
    for s, p in factors.items():
        if s.max > s.min:
            size = s.max
        else:
            size = max(s.min, PLANNING_SIZE)
            size += (s.remainder - size) % s.divisor
        value *= size ** p
    return max(1, int(value))


def planning_prod(shape) -> int:
    """The number of elements of ``shape`` as a cost model counts it (``planning_size``
    of each dimension)."""
    out = 1
    for d in shape:
        out *= planning_size(d)
    return out
