"""The MindSpore backend: eager values, and lowering Programs to GRAPH mode.

Lowering emits straight-line Python source for a Program, writes it to a real
``.py`` file, imports it as a module registered in ``sys.modules`` (MindSpore's
AST parser resolves globals through ``__import__(fn.__module__)``, so ``exec``'d
code cannot be compiled) and wraps the function with ``mindspore.jit``. Each
primitive's lowering rule returns the source of one expression; constants
(primitive functions, dtypes, Tensors) become module globals.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import tempfile
import threading

import mindspore as ms
import numpy as np

from fshard import dtypes
from fshard.core import ArrayType
from fshard.ir import Literal, Program
from fshard.rules import lowering

Tensor = ms.Tensor


def is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def as_tensor(x):
    """MindSpore Tensor of ``x`` (Tensors pass through; NumPy keeps its dtype)."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (bool, int, float)):
        from fshard.core import typeof

        return Tensor(x, typeof(x).dtype)
    a = np.asarray(x)
    return Tensor(a, dtypes.from_numpy(a.dtype))


def to_numpy(x) -> np.ndarray:
    return x.asnumpy() if isinstance(x, Tensor) else np.asarray(x)


# ---------------------------------------------------------------------------
# Lowering
# ---------------------------------------------------------------------------

_SIMPLE = (bool, int, float, str, type(None))


def _is_literal_param(v) -> bool:
    if isinstance(v, _SIMPLE):
        return True
    if isinstance(v, tuple):
        return all(_is_literal_param(e) for e in v)
    return False


class LoweringContext:
    """Collects module globals while one Program is lowered."""

    def __init__(self, in_avals=(), out_avals=(), rank: int | None = None):
        self.globals: dict[str, object] = {}
        self._ids: dict[int, str] = {}
        self.in_avals = in_avals    # of the equation being lowered
        self.out_avals = out_avals
        self.rank = rank            # set when lowering one rank of a multi-process job

    def ref(self, obj, hint: str = "c") -> str:
        """A global name bound to ``obj`` in the generated module."""
        name = self._ids.get(id(obj))
        if name is None:
            base = getattr(obj, "__name__", hint).lstrip("_") or hint
            name = f"{base}_{len(self.globals)}"
            self.globals[name] = obj
            self._ids[id(obj)] = name
        return name

    def param(self, v) -> str:
        """Source text of a parameter value: a literal if reprable, else a global."""
        if isinstance(v, float) and not np.isfinite(v):
            return self.ref(v, "f")
        return repr(v) if _is_literal_param(v) else self.ref(v, "p")

    def call(self, fn, *exprs, **params) -> str:
        args = list(exprs) + [f"{k}={self.param(v)}" for k, v in params.items()]
        return f"{self.ref(fn)}({', '.join(args)})"


_gen_dir = None
_gen_counter = itertools.count()
_gen_lock = threading.Lock()


def _gen_path(name: str) -> tuple[str, str]:
    global _gen_dir
    with _gen_lock:
        if _gen_dir is None:
            _gen_dir = tempfile.mkdtemp(prefix="fshard_gen_")
        n = next(_gen_counter)
    modname = f"fshard_generated_{os.getpid()}_{n}"
    return modname, os.path.join(_gen_dir, f"{modname}.py")


def _py_name(s: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in s)
    return out if out and not out[0].isdigit() else f"f_{out}"


def lower_program(program: Program, consts: list, name: str = "fn",
                  rank: int | None = None) -> tuple[str, dict, int]:
    """Source of a function computing ``program`` (consts baked in as globals).

    Returns ``(source, globals, n_outputs)``; the function takes the non-constant
    inputs positionally and returns one value or a tuple.
    """
    ctx = LoweringContext(rank=rank)
    names: dict = {}
    counter = itertools.count()

    def fresh() -> str:
        return f"v{next(counter)}"

    for var, c in zip(program.inputs[: program.n_consts], consts, strict=True):
        names[var] = ctx.ref(as_tensor(c), "const")
    params = []
    for var in program.inputs[program.n_consts:]:
        names[var] = fresh()
        params.append(names[var])

    def read(a) -> str:
        if isinstance(a, Literal):
            return ctx.ref(Tensor(a.value, a.aval.dtype), "lit")
        return names[a]

    body = []
    for eq in program.equations:
        ctx.in_avals = [a.aval for a in eq.inputs]
        ctx.out_avals = [v.aval for v in eq.outputs]
        rule = lowering.lookup(eq.prim, transform="jit")
        expr = rule(ctx, *[read(a) for a in eq.inputs], **eq.params)
        outs = [fresh() for _ in eq.outputs]
        for v, n in zip(eq.outputs, outs):
            names[v] = n
        lhs = outs[0] if not eq.prim.multiple_results else (
            ", ".join(outs) + ("," if len(outs) == 1 else ""))
        if not outs:
            lhs = "_"
        body.append(f"    {lhs} = {expr}")
    outs = [read(a) for a in program.outputs]
    if len(outs) == 1:
        body.append(f"    return {outs[0]}")
    else:
        body.append(f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
    fname = _py_name(f"fshard_{name}")
    src = f"def {fname}({', '.join(params)}):\n" + "\n".join(body) + "\n"
    return src, ctx.globals, len(outs)


def load_module(src: str, globals_: dict, hint: str):
    """Write ``src`` to a real file and import it as a registered module."""
    modname, path = _gen_path(hint)
    header = f"# generated by fshard for {hint}\n"
    with open(path, "w") as fh:
        fh.write(header + src)
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    mod.__dict__.update(globals_)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod


def compile_source(src: str, globals_: dict, hint: str):
    """``mindspore.jit`` of the function defined by ``src``."""
    mod = load_module(src, globals_, hint)
    fname = src.split("(", 1)[0][4:]
    return ms.jit(getattr(mod, fname), fullgraph=True)


def globals_text(globals_: dict) -> str:
    """A readable listing of the module globals (for ``as_text``)."""
    lines = []
    for k, v in globals_.items():
        if isinstance(v, Tensor):
            desc = f"Tensor({ArrayType(tuple(v.shape), v.dtype)})"
            if v.size <= 4:
                desc = f"Tensor({v.asnumpy().tolist()}, {v.dtype})"
        elif callable(v) and hasattr(v, "__module__") and hasattr(v, "__qualname__"):
            desc = f"{v.__module__}.{v.__qualname__}"
        else:
            desc = repr(v)
        lines.append(f"# {k} = {desc}")
    return "\n".join(lines)
