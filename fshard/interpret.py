"""``eval_program``: the one generic forward interpreter; ``batch_program``: the
batching interpreter ``vmap`` and the batching rules of higher-order primitives use.

It evaluates a Program by calling ``bind`` for every equation, so it runs eagerly
under the EvalTrace and re-stages under a StagingTrace: any transform can be applied
to a Program by evaluating it inside that transform. Errors raised while evaluating
an equation get a note naming the equation and the user line that created it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fshard import context
from fshard.core import bind
from fshard.ir import Equation, Literal, Program
from fshard.rules import batching


def equation_note(eq: Equation, what: str) -> str:
    where = f" (created at {eq.source})" if eq.source else ""
    ins = ", ".join(str(a.aval) for a in eq.inputs)
    return f"while {what} equation '{eq.prim.name}' on ({ins}){where}"


def eval_program(program: Program, *args) -> list:
    """Evaluate ``program`` on ``args`` (constants first) under the current trace."""
    env = dict(zip(program.inputs, args, strict=True))

    def read(a):
        return a.value if isinstance(a, Literal) else env[a]

    for eq in program.equations:
        try:
            outs = bind(eq.prim, *[read(a) for a in eq.inputs], **eq.params)
        except Exception as e:
            e.add_note(equation_note(eq, "evaluating"))
            raise
        if not eq.prim.multiple_results:
            outs = [outs]
        env.update(zip(eq.outputs, outs, strict=True))
    return [read(a) for a in program.outputs]


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


def batch_program(program: Program, args: list, dims: list, axis: AxisData):
    """Evaluate ``program`` on batched ``args`` (batch dim per arg, or None).

    Returns ``(outs, out_dims)``.
    """
    env = dict(zip(program.inputs, zip(args, dims), strict=True))

    def read(a):
        return (a.value, None) if isinstance(a, Literal) else env[a]

    with batching_axis(axis):
        for eq in program.equations:
            vals, ds = zip(*[read(a) for a in eq.inputs]) if eq.inputs else ((), ())
            try:
                if all(d is None for d in ds) and "axis_name" not in eq.params:
                    outs = bind(eq.prim, *vals, **eq.params)
                    outs = outs if eq.prim.multiple_results else [outs]
                    out_ds = [None] * len(outs)
                else:
                    rule = batching.lookup(eq.prim, transform="vmap")
                    outs, out_ds = rule(list(vals), list(ds), **eq.params)
            except Exception as e:
                e.add_note(equation_note(eq, "batching"))
                raise
            for v, o, d in zip(eq.outputs, outs, out_ds, strict=True):
                env[v] = (o, d)
    outs = [read(a) for a in program.outputs]
    return [o for o, _ in outs], [d for _, d in outs]
