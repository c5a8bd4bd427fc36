"""Helpers that declare a primitive and register its common rules in one call.

A primitive's eager implementation is a plain MindSpore function ``ms_fn(*xs, **params)``
written in the subset of Python that MindSpore's GRAPH mode parses. The same
function serves eager evaluation (called in PyNative) and lowering (the generated
graph source calls it), so a primitive's MindSpore semantics live in one place.
"""

from __future__ import annotations

from typing import Callable

from fshard.backend.mindspore import as_tensor
from fshard.core import ArrayType, Primitive
from fshard.rules import abstract_eval, impl, jvp, lowering, register_primitive


def def_primitive(name: str, family: str, type_rule: Callable, ms_fn: Callable, *,
                  multiple_results: bool = False, lower: Callable | None = None) -> Primitive:
    """Declare ``name`` with its type rule, eager impl and lowering.

    ``type_rule(*avals, **params)`` returns an ArrayType (a list of them if
    ``multiple_results``). ``lower(ctx, *exprs, **params)`` defaults to a call of
    ``ms_fn`` in the generated source.
    """
    prim = Primitive(name, multiple_results)
    register_primitive(prim, family)
    if multiple_results:
        abstract_eval.set(prim, lambda *a, **p: list(type_rule(*a, **p)))
        impl.set(prim, lambda *xs, **p: list(ms_fn(*map(as_tensor, xs), **p)))
    else:
        abstract_eval.set(prim, lambda *a, **p: [type_rule(*a, **p)])
        impl.set(prim, lambda *xs, **p: [ms_fn(*map(as_tensor, xs), **p)])
    lowering.set(prim, lower or (lambda ctx, *xs, **p: ctx.call(ms_fn, *xs, **p)))
    return prim


class Zero:
    """A symbolic zero tangent or cotangent of type ``aval`` (never materialised
    unless needed)."""

    __slots__ = ("aval",)

    def __init__(self, aval: ArrayType):
        self.aval = aval

    def __repr__(self) -> str:
        return f"Zero({self.aval})"


def defjvp(prim: Primitive, *rules: Callable | None) -> None:
    """Per-operand JVP: ``rule_i(t_i, ans, *primals, **params)`` is operand i's
    contribution to the output tangent; ``None`` marks a non-differentiable operand.
    Zero tangents are skipped, and a sum of contributions is formed (NB: JAX defjvp2)."""
    def rule(primals, tangents, **params):
        from fshard.primitives.elementwise import add_tangents

        ans = prim.bind(*primals, **params)
        out_t = None
        for r, t in zip(rules, tangents):
            if r is None or isinstance(t, Zero):
                continue
            c = r(t, ans, *primals, **params)
            out_t = c if out_t is None else add_tangents(out_t, c)
        if out_t is None:
            from fshard.core import typeof

            out_t = Zero(typeof(ans))
        return [ans], [out_t]

    jvp.set(prim, rule)


def deflinear(prim: Primitive, transpose_rule: Callable) -> None:
    """A primitive linear in all its operands: jvp(x; t) = prim(t), transposed by
    ``transpose_rule(ct, *args, **params) -> cts``."""
    from fshard.rules import transpose

    def rule(primals, tangents, **params):
        ans = prim.bind(*primals, **params)
        if all(isinstance(t, Zero) for t in tangents):
            outs = ans if prim.multiple_results else [ans]
            from fshard.core import typeof

            return ([ans] if not prim.multiple_results else ans), [Zero(typeof(o)) for o in outs]
        ts = [instantiate(t) for t in tangents]
        t_out = prim.bind(*ts, **params)
        if prim.multiple_results:
            return ans, t_out
        return [ans], [t_out]

    jvp.set(prim, rule)
    transpose.set(prim, transpose_rule)


def instantiate(t):
    """Materialise a Zero as a zeros array; pass other values through."""
    if isinstance(t, Zero):
        from fshard.primitives.structural import zeros

        return zeros(t.aval.shape, t.aval.dtype)
    return t


class UndefinedPrimal:
    """Marks the linear operand of a primitive being transposed (NB: JAX's
    ``ad.UndefinedPrimal``). Only its type is known."""

    __slots__ = ("aval",)

    def __init__(self, aval: ArrayType):
        self.aval = aval

    def __repr__(self) -> str:
        return f"UndefinedPrimal({self.aval})"


def is_undefined(x) -> bool:
    return isinstance(x, UndefinedPrimal)
