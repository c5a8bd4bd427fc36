"""fshard's IR: typed variables, equations and Programs, a verifier and a printer.

A Program is ``{ lambda inputs . equations in outputs }``: a straight-line list of
equations ``outs = prim[params] ins`` over typed variables. Inputs include the
constants the staged function closed over (``Program.n_consts`` of them, first).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fshard.core.tracing import ArrayType, Primitive
from fshard.errors import ProgramTypeError
from fshard.core.rules import abstract_eval

_var_ids = itertools.count()


class Var:
    """A variable of a Program; identity is object identity."""

    __slots__ = ("aval", "id")

    def __init__(self, aval: ArrayType):
        self.aval = aval
        self.id = next(_var_ids)

    def __repr__(self) -> str:
        return f"Var({self.id}:{self.aval})"


@dataclass(frozen=True, slots=True)
class Literal:
    """A scalar constant written into the Program (a NumPy scalar of its dtype)."""

    value: Any
    aval: ArrayType

    def __repr__(self) -> str:
        return str(self.value)


Atom = Var | Literal


@dataclass(slots=True)
class Equation:
    prim: Primitive
    inputs: list
    params: dict
    outputs: list
    source: str | None = None  # user file:line that created it, for error messages


@dataclass(slots=True)
class Program:
    inputs: list
    equations: list
    outputs: list
    n_consts: int = 0
    meta: dict = field(default_factory=dict)  # transforms may annotate (e.g. layouts)

    @property
    def in_avals(self) -> list:
        return [v.aval for v in self.inputs]

    @property
    def out_avals(self) -> list:
        return [v.aval for v in self.outputs]

    def __str__(self) -> str:
        return pretty(self)


# ---------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------


def _names() -> Any:
    for n in itertools.count():
        s, k = "", n
        while True:
            s = chr(ord("a") + k % 26) + s
            k = k // 26 - 1
            if k < 0:
                break
        yield s


def _fmt_param(v) -> str:
    if isinstance(v, Program):
        return "{...}"
    if isinstance(v, tuple) and v and all(isinstance(p, Program) for p in v):
        return "(" + ", ".join("{...}" for _ in v) + ")"  # the branches of a cond
    if isinstance(v, np.ndarray):
        return f"array{v.shape}"
    if callable(v) and hasattr(v, "__name__"):
        return v.__name__
    return str(v)


def pretty(prog: Program, annotate=None) -> str:
    """Readable text: one equation per line with types (and an optional annotation)."""
    names: dict = {}
    gen = _names()

    def name(a) -> str:
        if isinstance(a, Literal):
            return repr(a)
        if a not in names:
            names[a] = next(gen)
        return names[a]

    def decl(v) -> str:
        extra = annotate(v) if annotate else ""
        return f"{name(v)}:{v.aval}{extra}"

    consts = prog.inputs[: prog.n_consts]
    args = prog.inputs[prog.n_consts:]
    head = " ".join(decl(v) for v in args)
    if consts:
        head = "; ".join([" ".join(decl(v) for v in consts), head])
    lines = [f"{{ lambda {head} ."]
    for eq in prog.equations:
        outs = " ".join(decl(v) for v in eq.outputs)
        if eq.prim.show is not None:
            head = eq.prim.show(eq.params)
        else:
            params = " ".join(f"{k}={_fmt_param(v)}" for k, v in eq.params.items())
            head = eq.prim.name + (f"[{params}]" if params else "")
        ins = " ".join(name(a) for a in eq.inputs)
        lines.append(f"    {outs} = {head} {ins}".rstrip())
    outs = ", ".join(name(a) for a in prog.outputs)
    lines.append(f"  in ({outs}) }}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------


def verify(prog: Program) -> None:
    """Type-check a Program: every var defined once before use, every equation's
    output types equal to what its primitive's type rule says.

    >>> import numpy as np, fshard as fs
    >>> fs.verify(fs.make_ir(lambda x: x * 2.0)(np.ones(2, np.float32)).program)
    """
    defined = set()
    for v in prog.inputs:
        if v in defined:
            raise ProgramTypeError(f"input variable {v} is listed twice")
        defined.add(v)
    for i, eq in enumerate(prog.equations):
        for a in eq.inputs:
            if isinstance(a, Var) and a not in defined:
                raise ProgramTypeError(
                    f"equation {i} ({eq.prim}) uses variable {a} before it is defined")
        in_avals = [a.aval for a in eq.inputs]
        try:
            expected = abstract_eval.lookup(eq.prim, transform="verify")(*in_avals, **eq.params)
        except ProgramTypeError:
            raise
        except Exception as e:  # the rule itself rejected the operands
            raise ProgramTypeError(
                f"equation {i} ({eq.prim}) is ill-typed: {e}") from e
        got = [v.aval for v in eq.outputs]
        if list(expected) != got:
            raise ProgramTypeError(
                f"equation {i} ({eq.prim}) declares outputs "
                f"{[str(t) for t in got]} but its type rule gives "
                f"{[str(t) for t in expected]}")
        for v in eq.outputs:
            if v in defined:
                raise ProgramTypeError(f"equation {i} ({eq.prim}) redefines {v}")
            defined.add(v)
    for a in prog.outputs:
        if isinstance(a, Var) and a not in defined:
            raise ProgramTypeError(f"output {a} is never defined")
