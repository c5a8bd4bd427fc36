"""``eval_program``: the one generic forward interpreter.

It evaluates a Program by calling ``bind`` for every equation, so it runs eagerly
under the EvalTrace and re-stages under a StagingTrace: any transform can be applied
to a Program by evaluating it inside that transform. Errors raised while evaluating
an equation get a note naming the equation and the user line that created it.
"""

from __future__ import annotations

from fshard.core import bind
from fshard.ir import Equation, Literal, Program


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
