"""Staging: turn a Python callable into a Program (NB: JAX's make_jaxpr).

``stage(fn, in_avals)`` runs ``fn`` on Tracers of a fresh StagingTrace; every
``bind`` records an equation. Values the function closes over (MindSpore Tensors,
NumPy arrays, tracers of an enclosing trace) become the Program's leading
*constant* inputs; Python scalars become Literals. While staging, the MindSpore
adapter (``fshard.adapter.interop``) is installed so native ``mindspore.ops`` calls,
Tensor operators and ``nn.Cell``s trace too.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Sequence

import numpy as np

from fshard.core import context
from fshard.core.tracing import ArrayType, Trace, Tracer, set_trace, typeof
from fshard.errors import FshardError
from fshard.core.ir import Equation, Literal, Program, Var
from fshard.core.rules import abstract_eval

# fshard/ (this file is fshard/core/staging.py) and, beside it, transforms/
_FSHARD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP_DIRS = (_FSHARD_DIR, os.path.dirname(_FSHARD_DIR) + os.sep + "transforms")


def _user_frame() -> str | None:
    """file:line of the innermost frame outside fshard and MindSpore."""
    f = sys._getframe(3)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_SKIP_DIRS) and "mindspore" not in fn:
            return f"{os.path.basename(fn)}:{f.f_lineno}"
        f = f.f_back
    return None


class StagedTracer(Tracer):
    # ``ir_var``, not ``var``: a traced value must answer ``x.var()`` like a Tensor.
    __slots__ = ("ir_var",)

    def __init__(self, trace: "StagingTrace", var: Var):
        super().__init__(trace, var.aval)
        self.ir_var = var


class StagingTrace(Trace):
    """Records every bound primitive as an Equation."""

    def __init__(self):
        self.equations: list[Equation] = []
        self.const_vars: dict[int, tuple[object, Var]] = {}  # id(value) -> (value, var)
        self.active = True

    def new_arg(self, aval: ArrayType) -> StagedTracer:
        return StagedTracer(self, Var(aval))

    def to_atom(self, x):
        if isinstance(x, StagedTracer) and x.owner is self:
            return x.ir_var
        if isinstance(x, (bool, int, float)):
            aval = typeof(x)
            return Literal(_np_scalar(x, aval), aval)
        if isinstance(x, np.generic):
            return Literal(x, typeof(x))
        entry = self.const_vars.get(id(x))
        if entry is None:
            entry = (x, Var(typeof(x)))
            self.const_vars[id(x)] = entry
        return entry[1]

    def process(self, prim, args, params):
        atoms = [self.to_atom(x) for x in args]
        rule = abstract_eval.lookup(prim, transform="tracing")
        out_avals = rule(*[a.aval for a in atoms], **params)
        outs = [Var(a) for a in out_avals]
        self.equations.append(Equation(prim, atoms, params, outs,
                                        context.source.get() or _user_frame()))
        return [StagedTracer(self, v) for v in outs]


def _np_of(aval):
    from fshard.core import dtypes

    return dtypes.to_numpy(aval.dtype)


def _np_scalar(x, aval):
    return _np_of(aval).type(x)


# Context managers entered around the user code ``stage`` runs. fshard.adapter.interop
# registers the one that lets MindSpore's ops, Tensor methods and Cells trace: it
# knows every primitive, so it sits above them and staging cannot import it.
_user_code_hooks: list[Callable] = []


def register_user_code_hook(hook: Callable) -> None:
    """Enter ``hook()`` around every function ``stage`` runs."""
    if hook not in _user_code_hooks:
        _user_code_hooks.append(hook)


def stage(fn: Callable, in_avals: Sequence[ArrayType]) -> tuple[Program, list]:
    """Stage ``fn(*tracers) -> list`` into ``(program, consts)``.

    ``program.inputs`` is ``const_vars + arg_vars``; ``consts`` are the concrete (or
    outer-trace) values of the constants, in order.
    """
    trace = StagingTrace()
    args = [trace.new_arg(a) for a in in_avals]
    # The inputs' variables, read now: ``x[i] = v`` inside ``fn`` rebinds the tracer ``x``
    # to the updated value (fshard.adapter.tensor_methods), and that must not change the inputs.
    arg_vars = [a.ir_var for a in args]
    try:
        with set_trace(trace), contextlib.ExitStack() as around:
            for hook in _user_code_hooks:
                around.enter_context(hook())
            outs = fn(*args)
    finally:
        trace.active = False
    out_atoms = [trace.to_atom(x) for x in outs]
    consts = [v for v, _ in trace.const_vars.values()]
    const_vars = [var for _, var in trace.const_vars.values()]
    program = Program(const_vars + arg_vars, trace.equations, out_atoms,
                      n_consts=len(consts))
    return program, consts


def check_leak(x) -> None:
    if isinstance(x, Tracer) and not x.owner.active:
        from fshard.errors import TracerLeakError

        raise TracerLeakError(f"the traced value {x} escaped the transform that created it.")


__all__ = ["stage", "StagingTrace", "StagedTracer", "FshardError"]


# ---------------------------------------------------------------------------
# Tracing a user function with pytree arguments and static arguments
# ---------------------------------------------------------------------------


class Traced:
    """A staged user function: its Program and how its pytrees map to flat lists."""

    __slots__ = ("program", "consts", "in_tree", "out_tree", "name")

    def __init__(self, program, consts, in_tree, out_tree, name):
        self.program, self.consts = program, consts
        self.in_tree, self.out_tree, self.name = in_tree, out_tree, name

    def __str__(self) -> str:
        return str(self.program)

    def __repr__(self) -> str:
        return str(self.program)

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self.program))


def fun_name(fun) -> str:
    return getattr(fun, "__name__", None) or type(fun).__name__


def check_function(api: str, fun) -> None:
    """Every transform checks its function when it is applied, not at the first call."""
    if not callable(fun):
        from fshard.errors import ArgumentError

        raise ArgumentError(
            f"{api} expects a function (or an nn.Cell) as its first argument; got "
            f"{type(fun).__name__} {fun!r}.\nFix: pass the function itself, e.g. "
            f"{api}(loss_fn).")


def check_static_args(api: str, fun, static_argnums, static_argnames) -> tuple[tuple, tuple]:
    """``(static_argnums, static_argnames)`` as tuples, checked: ints and names of
    ``fun``'s parameters."""
    import inspect

    from fshard.errors import ArgumentError

    if isinstance(static_argnums, int) and not isinstance(static_argnums, bool):
        static_argnums = (static_argnums,)
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)
    if not isinstance(static_argnums, (tuple, list)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in static_argnums):
        raise ArgumentError(
            f"{api}(static_argnums=...) must be an int or a tuple of ints (argument "
            f"positions); got {static_argnums!r}.\nFix: e.g. static_argnums=(1,), or "
            "static_argnames=('name',) for keyword arguments.")
    if not isinstance(static_argnames, (tuple, list)) or not all(
            isinstance(n, str) for n in static_argnames):
        raise ArgumentError(
            f"{api}(static_argnames=...) must be a str or a tuple of str (parameter names); "
            f"got {static_argnames!r}.")
    if static_argnames:
        try:
            sig = inspect.signature(fun)
        except (TypeError, ValueError):
            sig = None
        if sig is not None and not any(p.kind is p.VAR_KEYWORD
                                       for p in sig.parameters.values()):
            unknown = [n for n in static_argnames if n not in sig.parameters]
            if unknown:
                raise ArgumentError(
                    f"{api}(static_argnames={tuple(static_argnames)!r}): {fun_name(fun)} has "
                    f"no parameter named {', '.join(map(repr, unknown))} (its parameters: "
                    f"{', '.join(sig.parameters)}).")
    return tuple(static_argnums), tuple(static_argnames)


def split_static(fun, args, kwargs, static_argnums, static_argnames):
    """Separate static arguments (hashed, passed as Python values) from dynamic ones.

    Returns ``(dyn_args, dyn_kwargs, static_key, rebuild)`` where ``rebuild(dyn_args,
    dyn_kwargs)`` gives the full call arguments back.
    """
    nargs = len(args)
    nums = tuple(sorted({(i if i >= 0 else nargs + i) for i in static_argnums}))
    for i in nums:
        if not 0 <= i < nargs:
            from fshard.errors import ArgumentError

            raise ArgumentError(
                f"static_argnums contains {i}, but {fun_name(fun)} was called with {nargs} "
                "positional arguments.\nFix: pass that argument positionally or drop it "
                "from static_argnums.")
    static_pos = {i: args[i] for i in nums}
    static_kw = {k: kwargs[k] for k in static_argnames if k in kwargs}
    for where, v in list(static_pos.items()) + list(static_kw.items()):
        try:
            hash(v)
        except TypeError:
            from fshard.errors import ArgumentError

            raise ArgumentError(
                f"static argument {where!r} of {fun_name(fun)} must be hashable, got "
                f"{type(v).__name__}.\nFix: pass a tuple instead of a list, or make the "
                "argument dynamic.") from None
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_kw}
    key = (tuple(static_pos.items()), tuple(sorted(static_kw.items())))

    def rebuild(d_args, d_kwargs):
        it = iter(d_args)
        full = [static_pos[i] if i in static_pos else next(it) for i in range(nargs)]
        return tuple(full), {**d_kwargs, **static_kw}

    return dyn_args, dyn_kwargs, key, rebuild


def trace_fun(fun, in_tree, in_avals, rebuild=None) -> Traced:
    """Stage ``fun`` whose flat dynamic inputs have types ``in_avals`` (structure
    ``in_tree`` of ``(args, kwargs)``)."""
    from fshard.core import tree

    out_tree_box = []

    def flat_fun(*flat):
        args, kwargs = tree.unflatten(in_tree, list(flat))
        if rebuild is not None:
            args, kwargs = rebuild(args, kwargs)
        out = fun(*args, **kwargs)
        leaves, out_tree = tree.flatten(out)
        out_tree_box.append(out_tree)
        return leaves

    program, consts = stage(flat_fun, in_avals)
    return Traced(program, consts, in_tree, out_tree_box[0], fun_name(fun))


def make_ir(fun, static_argnums=(), static_argnames=()):
    """The Program fshard traces ``fun`` into (NB: ``jax.make_jaxpr``).

    >>> import numpy as np, fshard as fs
    >>> print(fs.make_ir(lambda x: fs.ops.exp(x) * 2.0)(np.ones(3, np.float32)))
    { lambda a:f32[3] .
        b:f32[3] = exp a
        c:f32[3] = broadcast_to[shape=(3,)] 2.0
        d:f32[3] = mul b c
      in (d) }

    For a function made by ``fs.shard``, the result is its per-device program instead
    (``Partitioned``): every value's layout and the inserted collectives.

    See also: ``fs.jit(f).lower(*args).as_text()`` for the MindSpore program.
    """
    from fshard.core import tree

    check_function("fs.make_ir", fun)
    custom = getattr(fun, "__fshard_make_ir__", None)  # e.g. fs.shard's per-device program
    if custom is not None:
        return custom
    static_argnums, static_argnames = check_static_args("fs.make_ir", fun, static_argnums,
                                                        static_argnames)

    def wrapped(*args, **kwargs):
        dyn_args, dyn_kwargs, _, rebuild = split_static(
            fun, args, kwargs, static_argnums, static_argnames)
        leaves, in_tree = tree.flatten((dyn_args, dyn_kwargs))
        return trace_fun(fun, in_tree, [typeof(x) for x in leaves], rebuild)

    return wrapped
