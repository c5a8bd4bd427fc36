"""IR cleanup passes: named ``Program -> Program`` rewrites that ``jit`` applies before
lowering (NB: tinygrad's named ``graph_rewrite`` passes).

Transforms emit locally sensible IR that is globally redundant: ``vmap`` of a
per-example ``matmul`` reshapes ``(B, 1, k) -> (B, k)`` right after a reshape the
other way, batching rules broadcast operands that were already broadcast, and the
transpose of a ``mean`` re-broadcasts the same cotangent in several places. These
passes remove that, without changing any value:

- ``fold_structural``: reshape/broadcast/transpose chains collapse into one
  operation; reshapes, broadcasts, transposes and casts that change nothing vanish.
- ``cse``: an equation equal to an earlier one (same primitive, operands and
  parameters) reuses its outputs.
- ``dce``: equations whose outputs nothing reads are dropped.

``simplify`` runs them to a fixed point. Every pass is observable: with
``FSHARD_DUMP_IR=1`` each pass that changes the Program prints it before and after.
The passes never remove or reorder a Program's inputs, so a lowered function keeps
its signature. This module imports primitives, never transforms.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import numpy as np

from fshard.ir import Equation, Literal, Program, Var
from fshard.primitives.elementwise import cast_p
from fshard.primitives.structural import broadcast_to_p, reshape_p, transpose_p

PassFn = Callable[[Program], Program]


def _dump(name: str, before: Program, after: Program) -> None:
    if os.environ.get("FSHARD_DUMP_IR"):
        print(f"--- before {name} ---\n{before}\n--- after {name} ---\n{after}",
              file=sys.stderr)


def _rebuild(program: Program, equations: list, alias: dict) -> Program:
    """``program`` with new equations and outputs read through ``alias``."""
    outputs = [alias.get(a, a) if isinstance(a, Var) else a for a in program.outputs]
    return Program(program.inputs, equations, outputs, program.n_consts, program.meta)


# ---------------------------------------------------------------------------
# fold_structural: peephole rules on shape operations
# ---------------------------------------------------------------------------


def _identity(eq: Equation) -> bool:
    """The equation returns its operand unchanged."""
    (x,) = eq.inputs
    if eq.prim in (reshape_p, broadcast_to_p):
        return tuple(x.aval.shape) == tuple(eq.outputs[0].aval.shape)
    if eq.prim is transpose_p:
        return tuple(eq.params["perm"]) == tuple(range(len(eq.params["perm"])))
    if eq.prim is cast_p:
        return x.aval.dtype == eq.params["dtype"]
    return False


def _fold(eq: Equation, producer: dict) -> Equation:
    """Collapse ``eq`` with the shape operation that produced its operand, if any."""
    (x,) = eq.inputs
    src = producer.get(x) if isinstance(x, Var) else None
    if src is None or src.prim is not eq.prim:
        return eq
    (y,) = src.inputs
    if eq.prim is reshape_p or eq.prim is broadcast_to_p:
        # reshape(reshape(y)) == reshape(y); broadcasting is transitive too
        return Equation(eq.prim, [y], eq.params, eq.outputs, eq.source)
    if eq.prim is transpose_p:
        inner, outer = src.params["perm"], eq.params["perm"]
        perm = tuple(inner[p] for p in outer)
        return Equation(eq.prim, [y], {"perm": perm}, eq.outputs, eq.source)
    return eq


_STRUCTURAL = (reshape_p, broadcast_to_p, transpose_p, cast_p)


def fold_structural(program: Program) -> Program:
    """Collapse chains of reshape / broadcast_to / transpose and drop identities."""
    alias: dict = {}
    producer: dict = {}
    out = []
    for eq in program.equations:
        ins = [alias.get(a, a) if isinstance(a, Var) else a for a in eq.inputs]
        eq = Equation(eq.prim, ins, eq.params, eq.outputs, eq.source)
        if eq.prim in _STRUCTURAL and isinstance(ins[0], Var):
            eq = _fold(eq, producer)
            if _identity(eq):
                alias[eq.outputs[0]] = eq.inputs[0]
                continue
        out.append(eq)
        for v in eq.outputs:
            producer[v] = eq
    return _rebuild(program, out, alias)


# ---------------------------------------------------------------------------
# cse: common subexpressions
# ---------------------------------------------------------------------------


def _key(v):
    """A hashable stand-in for a parameter value (identity for objects like Programs)."""
    if isinstance(v, (list, tuple)):
        return tuple(_key(e) for e in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _key(e)) for k, e in v.items()))
    if isinstance(v, (Program, np.ndarray)):
        return ("id", id(v))
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return v


def _atom_key(a):
    if isinstance(a, Literal):
        return ("lit", a.value.item() if hasattr(a.value, "item") else a.value, str(a.aval))
    return ("var", id(a))


def cse(program: Program) -> Program:
    """Reuse the outputs of an earlier identical equation."""
    alias: dict = {}
    seen: dict = {}
    out = []
    for eq in program.equations:
        ins = [alias.get(a, a) if isinstance(a, Var) else a for a in eq.inputs]
        eq = Equation(eq.prim, ins, eq.params, eq.outputs, eq.source)
        key = (eq.prim, tuple(_atom_key(a) for a in ins), _key(eq.params))
        prev = seen.get(key)
        if prev is not None:
            alias.update(zip(eq.outputs, prev.outputs))
            continue
        seen[key] = eq
        out.append(eq)
    return _rebuild(program, out, alias)


# ---------------------------------------------------------------------------
# dce: dead equations
# ---------------------------------------------------------------------------


def dce(program: Program) -> Program:
    """Drop equations none of whose outputs is read (fshard primitives have no effects)."""
    live = {a for a in program.outputs if isinstance(a, Var)}
    kept = []
    for eq in reversed(program.equations):
        if any(v in live for v in eq.outputs):
            kept.append(eq)
            live.update(a for a in eq.inputs if isinstance(a, Var))
    kept.reverse()
    return Program(program.inputs, kept, program.outputs, program.n_consts, program.meta)


# ---------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------

PASSES: list[tuple[str, PassFn]] = [
    ("fold_structural", fold_structural),
    ("cse", cse),
    ("dce", dce),
]


def run_pass(name: str, fn: PassFn, program: Program) -> Program:
    """Apply one named pass (dumping the IR around it with ``FSHARD_DUMP_IR=1``)."""
    after = fn(program)
    if len(after.equations) != len(program.equations) or any(
            a is not b for a, b in zip(after.equations, program.equations)):
        _dump(name, program, after)
    return after


def simplify(program: Program, max_rounds: int = 4) -> Program:
    """Run every pass until the Program stops shrinking.

    >>> import numpy as np, fshard as fs
    >>> w = np.ones((4, 2), np.float32)
    >>> ir = fs.make_ir(fs.vmap(lambda x: fs.ops.matmul(x, w)))(np.ones((8, 4), np.float32))
    >>> print(simplify(ir.program))   # vmap's reshapes (8,4)->(8,1,4)->(8,4) cancel out
    { lambda b:f32[4,2]; a:f32[8,4] .
        c:f32[8,2] = matmul[transpose_a=False transpose_b=False] a b
      in (c) }
    >>> len(ir.program.equations)
    5
    """
    for _ in range(max_rounds):
        n = len(program.equations)
        for name, fn in PASSES:
            program = run_pass(name, fn, program)
        if len(program.equations) == n:
            break
    return program
