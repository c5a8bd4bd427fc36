"""``walk``: the one generic forward Program interpreter; ``eval_program`` and
``batch_program`` (the batching interpreter ``vmap`` and the batching rules of
higher-order primitives use) are built on it, as are the JVP interpreter, the
partitioner and the per-rank runners.

``walk`` keeps the environment from variables to values, reads literals, and adds to
every error raised while an equation is interpreted a note naming the equation and
the user line that created it. ``eval_program`` calls ``bind`` for every equation, so
it runs eagerly under the EvalTrace and re-stages under a StagingTrace: any transform
can be applied to a Program by evaluating it inside that transform.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fshard.core import context
from fshard.core.tracing import bind
from fshard.core.ir import Equation, Literal, Program
from fshard.core.rules import batching


def equation_note(eq: Equation, what: str) -> str:
    where = f" (created at {eq.source})" if eq.source else ""
    ins = ", ".join(str(a.aval) for a in eq.inputs)
    return f"while {what} equation '{eq.prim.name}' on ({ins}){where}"


def walk(program: Program, args, rule: Callable, what: str,
         literal: Callable = lambda a: a.value) -> list:
    """Interpret ``program`` forward on ``args`` (one per input, constants first):
    ``rule(eq, values)`` gets an equation and the values of its operands and returns
    the values of its outputs; ``literal(lit)`` is the value of a literal operand.
    Returns the values of the outputs. An error raised by ``rule`` gets a note
    "while {what} equation ...".
    """
    env = dict(zip(program.inputs, args, strict=True))
    read = walk_equations(program.equations, env, rule, what, literal)
    return [read(a) for a in program.outputs]


def walk_equations(equations, env: dict, rule: Callable, what: str,
                   literal: Callable = lambda a: a.value) -> Callable:
    """``walk``'s loop over a run of equations whose operands ``env`` already binds
    (a part of a Program, e.g. one pipeline stage); updates ``env`` in place and returns
    its reader (variable or literal -> value)."""

    def read(a):
        return literal(a) if isinstance(a, Literal) else env[a]

    for eq in equations:
        token = context.source.set(eq.source)
        try:
            outs = rule(eq, [read(a) for a in eq.inputs])
        except Exception as e:
            e.add_note(equation_note(eq, what))
            raise
        finally:
            context.source.reset(token)
        env.update(zip(eq.outputs, outs, strict=True))
    return read


def bind_equation(eq: Equation, values) -> list:
    """``bind`` the equation's primitive on ``values``; always a list of outputs."""
    outs = bind(eq.prim, *values, **eq.params)
    return outs if eq.prim.multiple_results else [outs]


def eval_program(program: Program, *args) -> list:
    """Evaluate ``program`` on ``args`` (constants first) under the current trace."""
    return walk(program, args, bind_equation, "evaluating")


@dataclass(frozen=True)
class AxisData:
    """The axis a batching interpreter is mapping over."""

    name: object  # the axis_name, or None
    size: int


def current_axis(size: int | None = None) -> AxisData:
    """The axis of the innermost ``batch_program`` running now (for collectives and
    call primitives). A batching rule called directly, outside vmap, passes ``size``
    and gets an anonymous axis of that size."""
    stack = context.batch_axes.get()
    if not stack and size is not None:
        return AxisData(None, size)
    assert stack, "current_axis() called outside a batching rule"
    return stack[-1]


def batching_axis(axis: AxisData):
    """Inside the block, ``current_axis()`` is ``axis`` (what ``batch_program`` does
    around its walk; for calling batching rules directly)."""
    return context.pushed(context.batch_axes, axis)


def _body_names_axis(eq: Equation, name) -> bool:
    """Whether a body of ``eq`` (a loop's, a cond's branches) has an equation over the
    axis ``name`` (a collective inside a loop): then ``eq`` depends on that axis even
    when none of its operands is batched."""
    for v in eq.params.values():
        for sub in (v if isinstance(v, tuple) else (v,)):
            if not isinstance(sub, Program):
                continue
            for e in sub.equations:
                names = e.params.get("axis_name")
                names = names if isinstance(names, tuple) else (names,)
                if ("axis_name" in e.params and name in names) or _body_names_axis(e, name):
                    return True
    return False


def batch_program(program: Program, args: list, dims: list, axis: AxisData):
    """Evaluate ``program`` on batched ``args`` (batch dim per arg, or None).

    Returns ``(outs, out_dims)``.
    """
    def rule(eq, pairs):
        vals, ds = zip(*pairs) if pairs else ((), ())
        if all(d is None for d in ds) and "axis_name" not in eq.params and not (
                axis.name is not None and _body_names_axis(eq, axis.name)):
            outs = bind_equation(eq, vals)
            out_ds = [None] * len(outs)
        else:
            outs, out_ds = batching.lookup(eq.prim, transform="vmap")(
                list(vals), list(ds), **eq.params)
        return list(zip(outs, out_ds, strict=True))

    with batching_axis(axis):
        outs = walk(program, list(zip(args, dims, strict=True)), rule, "batching",
                    literal=lambda a: (a.value, None))
    return [o for o, _ in outs], [d for _, d in outs]
