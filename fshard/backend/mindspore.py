"""The MindSpore backend: eager values, and lowering Programs to GRAPH mode.

Lowering emits straight-line Python source for a Program, writes it to a real
``.py`` file, imports it as a module registered in ``sys.modules`` (MindSpore's
AST parser resolves globals through ``__import__(fn.__module__)``, so ``exec``'d
code cannot be compiled) and wraps the function with ``mindspore.jit``. Each
primitive's lowering rule returns the source of one expression; constants
(primitive functions, dtypes, Tensors) become module globals.
"""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time

import mindspore as ms
import numpy as np

from fshard.core import context, dtypes
from fshard.core.tracing import ArrayType, DimExpr, Symbol, is_symbolic, kernel_dtype_errors
from fshard.errors import ShapeError
from fshard.core.interpret import walk
from fshard.core.ir import Program
from fshard.core.rules import lowering

Tensor = ms.Tensor
Parameter = ms.Parameter  # mutable by identity: a compiled program reads it at each call


def is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def as_tensor(x):
    """MindSpore Tensor of ``x`` (Tensors pass through; NumPy keeps its dtype)."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (bool, int, float)):
        from fshard.core.tracing import typeof

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


def _nan_safe(obj, name: str):
    """A graph constant that MindSpore keeps exact. MindSpore 2.10's graph compiler
    folds a constant Tensor that is all NaN as if it were the identity of the op using
    it (``x + nan`` gives ``x``, ``x * nan`` gives ``x``: measured on CPU, O0 and O1); a
    Parameter is not folded, so a float constant holding a NaN becomes one."""
    if type(obj) is not Tensor or not dtypes.is_float(obj.dtype):
        return obj
    try:
        has_nan = bool(np.isnan(obj.asnumpy()).any())
    except (TypeError, RuntimeError):  # a dtype NumPy cannot hold
        return obj
    return ms.Parameter(obj, name=f"fshard_{name}", requires_grad=False) if has_nan else obj


class LoweringContext:
    """Collects module globals while one Program is lowered."""

    def __init__(self, in_avals=(), out_avals=(), rank: int | None = None, mesh=None):
        self.globals: dict[str, object] = {}
        self._ids: dict[int, str] = {}
        self._keep: list = []  # the objects whose ids key _ids
        self._kernels: dict = {}  # (make, args) -> name of the Primitive made (``kernel``)
        self.in_avals = in_avals    # of the equation being lowered
        self.out_avals = out_avals
        self.rank = rank            # set when lowering one rank of a multi-process job
        self.mesh = mesh            # the mesh of collectives whose equations carry none
        # Collectives run in Program order on every rank: a rule that emits one sets
        # `sequenced`, and the next one's input waits for this equation's output.
        self.sequenced = False
        self.token: str | None = None
        # Effects (debug callbacks) run in program order and are never pruned: a rule
        # that emits one sets `effectful`; the next one's operands wait for its result
        # (`effect`), and so do the function's outputs.
        self.effectful = False
        self.effect: str | None = None
        self.helpers: list[str] = []  # sources of helper functions (call primitives' bodies)
        self.dims: dict = {}  # Symbol -> source of its size (an input's ``.shape[d]``)

    def function(self, program: Program, hint: str = "call") -> str:
        """Emit ``program`` as a helper function of the generated module; return its name.

        The helper takes all of ``program``'s inputs positionally and returns a tuple
        (how call primitives, e.g. ``custom_jvp_call``, lower their bodies).
        """
        i = len(self.helpers)
        name = _py_name(f"fshard_{hint}_{i}")
        self.helpers.append("")  # reserve the slot before lowering nested calls
        saved = self.in_avals, self.out_avals
        self.helpers[i] = _function_source(self, program, [], name, always_tuple=True)
        self.in_avals, self.out_avals = saved
        return name

    def while_function(self, cond: Program, body: Program, n_cond_consts: int,
                       n_body_consts: int) -> str:
        """Emit a MindSpore graph ``while`` loop as a helper function; return its name.

        The helper takes ``cond_consts + body_consts + carry``; ``cond`` maps
        ``cond_consts + carry`` to a scalar bool, ``body`` maps ``body_consts + carry``
        to the next carry.
        """
        c_name, b_name = self.function(cond, "cond"), self.function(body, "body")
        i = len(self.helpers)
        name = _py_name(f"fshard_while_{i}")
        n_carry = len(body.outputs)
        cc = [f"c{k}" for k in range(n_cond_consts)]
        bc = [f"b{k}" for k in range(n_body_consts)]
        xs = [f"x{k}" for k in range(n_carry)]
        lines = [f"def {name}({', '.join(cc + bc + xs)}):",
                 f"    while {c_name}({', '.join(cc + xs)})[0]:",
                 f"        r = {b_name}({', '.join(bc + xs)})"]
        lines += [f"        {x} = r[{k}]" for k, x in enumerate(xs)]
        lines.append(f"    return ({', '.join(xs)}{',' if n_carry == 1 else ''})")
        self.helpers.append("\n".join(lines) + "\n")
        return name

    def scan_function(self, body: Program, length: int, reverse: bool, unroll: int,
                      n_consts: int, n_carry: int) -> str:
        """Emit a scan as a MindSpore graph ``while`` loop; return the helper's name.

        The helper takes ``consts + carry + xs``; ``body`` maps ``consts + carry + one
        slice of each x`` to ``carry + one y each``. Each y is written into a buffer of
        ``length`` rows at its step's row (``tensor_scatter_update``: on the CPU backend
        no in-place row update is cheaper, measured); ``unroll`` body calls run per
        iteration, the remainder after the loop.
        """
        b_name = self.function(body, "scan_body")
        i = len(self.helpers)
        name = _py_name(f"fshard_scan_{i}")
        y_avals = list(body.out_avals[n_carry:])
        n_xs = len(body.inputs) - n_consts - n_carry
        cs = [f"c{k}" for k in range(n_consts)]
        vs = [f"v{k}" for k in range(n_carry)]
        xs = [f"x{k}" for k in range(n_xs)]
        ys = [f"y{k}" for k in range(len(y_avals))]
        zeros, gather = self.ref(ms.ops.zeros), self.ref(gather_any_rank)
        update, reshape = self.ref(ms.ops.tensor_scatter_update), self.ref(ms.ops.reshape)
        expand = self.ref(ms.ops.expand_dims)
        i32 = self.ref(ms.int32, "int32")
        lines = [f"def {name}({', '.join(cs + vs + xs)}):"]
        for y, a in zip(ys, y_avals):
            shape = "(" + "".join(self.dim(d) + ", " for d in (length,) + tuple(a.shape)) + ")"
            lines.append(f"    {y} = {zeros}({shape}, {self.ref(a.dtype, 'dt')})")

        def step(indent: str, index: str) -> list:
            # one body call at step ``index`` (a scalar int32 Tensor expression)
            out = [f"{indent}j = {index}" if not reverse else f"{indent}j = {length - 1} - ({index})"]
            slices = [f"{gather}({x}, j, 0)" for x in xs]
            out.append(f"{indent}r = {b_name}({', '.join(cs + vs + slices)})")
            out += [f"{indent}{v} = r[{k}]" for k, v in enumerate(vs)]
            out += [f"{indent}{y} = {update}({y}, {reshape}(j, (1, 1)), "
                    f"{expand}(r[{n_carry + k}], 0))" for k, y in enumerate(ys)]
            return out

        n_iter, rest = divmod(length, unroll)
        lines.append(f"    i = {zeros}((), {i32})")
        if n_iter:
            lines.append(f"    while i < {n_iter * unroll}:")
            for u in range(unroll):
                lines += step("        ", f"i + {u}" if u else "i")
            lines.append(f"        i = i + {unroll}")
        for u in range(rest):
            lines += step("    ", f"i + {u}" if u else "i")
        outs = vs + ys
        lines.append(f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
        self.helpers.append("\n".join(lines) + "\n")
        return name

    def cond_function(self, branches: list) -> str:
        """Emit a MindSpore graph ``if`` over ``branches`` as a helper function; return
        its name. The helper takes ``index`` then the branches' common inputs; branch
        ``k`` runs for the first ``k`` with ``index <= k``, the last one otherwise."""
        names = [self.function(b, "branch") for b in branches]
        i = len(self.helpers)
        name = _py_name(f"fshard_cond_{i}")
        xs = [f"x{k}" for k in range(len(branches[0].inputs))]
        args = ", ".join(xs)
        lines = [f"def {name}(index, {args}):" if xs else f"def {name}(index):"]
        for k, b in enumerate(names[:-1]):
            lines += [f"    {'if' if k == 0 else 'elif'} index <= {k}:", f"        r = {b}({args})"]
        lines += ["    else:", f"        r = {names[-1]}({args})", "    return r"]
        self.helpers.append("\n".join(lines) + "\n")
        return name

    def ref(self, obj, hint: str = "c") -> str:
        """A global name bound to ``obj`` in the generated module."""
        name = self._ids.get(id(obj))
        if name is None:
            base = getattr(obj, "__name__", hint).lstrip("_") or hint
            name = f"{base}_{len(self.globals)}"
            self.globals[name] = _nan_safe(obj, name)
            # keyed by id(obj): keep obj alive, or a later object could reuse its id
            self._ids[id(obj)] = name
            self._keep.append(obj)
        return name

    def kernel(self, make, *args) -> str:
        """A global name bound to ``make(*args)``, a MindSpore Primitive built here, at
        lowering time, once per distinct ``(make, args)`` in the module.

        Written in the generated source instead, ``ops.Conv2D(...)(x, w)`` makes
        MindSpore's compiler evaluate the Primitive's construction at every call site
        during type inference (~15-25 ms each, measured: 40 convolutions compile in
        0.5-1.0 s so and 0.06-0.09 s as calls of instances built beforehand); calling a
        ready instance costs what an ``ops.*`` function call costs. ``args`` must be
        hashable (shapes and attributes)."""
        key = (make, args)
        name = self._kernels.get(key)
        if name is None:
            prim = make(*args)
            name = self._kernels[key] = self.ref(prim, getattr(prim, "name", "k"))
        return name

    def param(self, v) -> str:
        """Source text of a parameter value: a literal if reprable, else a global (a
        shape with symbolic dimensions reads them from the inputs at run time)."""
        if isinstance(v, float) and not np.isfinite(v):
            return self.ref(v, "f")
        if isinstance(v, tuple) and any(is_symbolic(d) for d in v):
            return "(" + "".join(self.dim(d) + ", " for d in v) + ")"
        return repr(v) if _is_literal_param(v) else self.ref(v, "p")

    def dim(self, d) -> str:
        """Source of a dimension: an int, or an expression of the inputs' run-time sizes
        (``v0.shape[0]``) for a Symbol or a product of Symbols."""
        if isinstance(d, int):
            return repr(d)
        coeff, factors = d.coeff if isinstance(d, DimExpr) else 1, (
            d.factors if isinstance(d, DimExpr) else ((d, 1),))
        terms = []
        for sym, power in factors:
            if sym not in self.dims:
                raise ShapeError(
                    f"the dimension {sym} ({sym!r}) is used in the program but is the size of "
                    "none of its inputs, so its value is unknown when the program runs.\n"
                    "Fix: declare the Symbol on an input dimension.")
            terms += [self.dims[sym]] * power
        num, den = (coeff.numerator, coeff.denominator) if coeff != 1 else (1, 1)
        src = " * ".join(terms + ([str(num)] if num != 1 else []))
        return f"({src}) // {den}" if den != 1 else src

    def call(self, fn, *exprs, **params) -> str:
        args = list(exprs) + [f"{k}={self.param(v)}" for k, v in params.items()]
        return f"{self.ref(fn)}({', '.join(args)})"


_gen_dir = None
_gen_counter = itertools.count()
_gen_lock = threading.Lock()


def _remove_gen_dir(path: str, pid: int) -> None:
    """At exit, the generated sources go (only the process that made them removes
    them: a forked child shares the path)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def _remove_stale_gen_dirs(root: str) -> None:
    """Remove the generated sources of processes that are gone without running their
    exit handlers (a rank the launcher stopped, a killed test run). The directory name
    carries its process id; a directory of a live process, of another user, or touched
    within the last hour (its process may live in another PID namespace sharing this
    temp folder) stays."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for entry in names:
        parts = entry.split("_")
        if len(parts) < 4 or entry[:11] != "fshard_gen_" or not parts[2].isdigit():
            continue
        path = os.path.join(root, entry)
        try:
            st = os.stat(path)
            if st.st_uid != os.getuid() or time.time() - st.st_mtime < 3600:
                continue
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive under another user, or the entry vanished
            continue


def _gen_path(name: str) -> tuple[str, str]:
    global _gen_dir
    with _gen_lock:
        if _gen_dir is None:
            # one directory per process, removed at exit
            _remove_stale_gen_dirs(tempfile.gettempdir())
            _gen_dir = tempfile.mkdtemp(prefix=f"fshard_gen_{os.getpid()}_")
            atexit.register(_remove_gen_dir, _gen_dir, os.getpid())
        n = next(_gen_counter)
    modname = f"fshard_generated_{os.getpid()}_{n}"
    return modname, os.path.join(_gen_dir, f"{modname}.py")


def _py_name(s: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in s)
    return out if out and not out[0].isdigit() else f"f_{out}"


def lower_program(program: Program, consts: list, name: str = "fn",
                  rank: int | None = None, mesh=None,
                  return_effect: bool = False) -> tuple[str, dict, int]:
    """Source of a function computing ``program`` (consts baked in as globals).

    Returns ``(source, globals, n_outputs)``; the function takes the non-constant
    inputs positionally and returns one value or a tuple. ``return_effect``: a program
    with no outputs but effects returns its last effect (to be waited for and
    discarded; ``n_outputs`` stays 0), so that MindSpore does not prune it whole.
    """
    ctx = LoweringContext(rank=rank, mesh=mesh)
    src = _function_source(ctx, program, consts, _py_name(f"fshard_{name}"),
                           return_effect=return_effect)
    # the entry function comes first: compile_source takes the first `def`
    src = "\n\n".join([src] + ctx.helpers)
    return src, ctx.globals, len(program.outputs)


def _function_source(ctx: LoweringContext, program: Program, consts: list, fname: str,
                     always_tuple: bool = False, return_effect: bool = False) -> str:
    """Source of one generated function computing ``program``."""
    names: dict = {}
    counter = itertools.count()

    def fresh() -> str:
        return f"v{next(counter)}"

    for var, c in zip(program.inputs[: program.n_consts], consts, strict=True):
        names[var] = ctx.ref(as_tensor(c), "const")
    params = []
    saved_dims, ctx.dims = ctx.dims, {}
    for var in program.inputs[program.n_consts:]:
        names[var] = fresh()
        params.append(names[var])
        for d, size in enumerate(var.aval.shape):
            if isinstance(size, Symbol):
                ctx.dims.setdefault(size, f"{names[var]}.shape[{d}]")
    # A Symbol that no input has whole but one has as a block of it (``s0/2``: a
    # process's rows of a global batch it does not hold) is that size times its count.
    for var in program.inputs[program.n_consts:]:
        for d, size in enumerate(var.aval.shape):
            if isinstance(size, DimExpr) and len(size.factors) == 1 and \
                    size.factors[0][1] == 1 and size.factors[0][0] not in ctx.dims:
                num, den = size.coeff.numerator, size.coeff.denominator
                src = f"{names[var]}.shape[{d}]" + (f" * {den}" if den != 1 else "")
                ctx.dims[size.factors[0][0]] = f"({src}) // {num}" if num != 1 else src

    def literal(a) -> str:
        # NB: MindSpore's Tensor takes a NumPy bfloat16 array but not a bfloat16 scalar
        return ctx.ref(Tensor(np.asarray(a.value), a.aval.dtype), "lit")

    body = []

    def rule(eq, args) -> list:
        # one line of source per equation: its outputs' names = its lowering rule's
        # expression (a collective also becomes the token the next one waits for)
        ctx.in_avals = [a.aval for a in eq.inputs]
        ctx.out_avals = [v.aval for v in eq.outputs]
        lower = lowering.lookup(eq.prim, transform="jit")
        ctx.sequenced = ctx.effectful = False
        expr = lower(ctx, *args, **eq.params)
        outs = [fresh() for _ in eq.outputs]
        if ctx.effectful:
            ctx.effect = f"e{next(counter)}"
            body.append(f"    {ctx.effect} = {expr}")
            return outs
        if ctx.sequenced and outs:
            ctx.token = outs[0]
        lhs = outs[0] if not eq.prim.multiple_results else (
            ", ".join(outs) + ("," if len(outs) == 1 else ""))
        body.append(f"    {lhs if outs else '_'} = {expr}")
        return outs

    saved_token, ctx.token = ctx.token, None
    saved_effect, ctx.effect = ctx.effect, None
    # a nested function (a cond branch, a loop body) is lowered inside its equation's
    # rule: its last equation's flags must not become that equation's
    saved_flags = ctx.sequenced, ctx.effectful
    outs = walk(program, [names[v] for v in program.inputs], rule, "lowering", literal)
    if ctx.effect is not None:  # the outputs wait for the last effect: none is pruned
        outs = [ctx.call(depend, o, ctx.effect) for o in outs]
        if not outs and return_effect:
            outs = [ctx.effect]
    ctx.token, ctx.dims, ctx.effect = saved_token, saved_dims, saved_effect
    ctx.sequenced, ctx.effectful = saved_flags
    if len(outs) == 1 and not always_tuple:
        body.append(f"    return {outs[0]}")
    else:
        body.append(f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
    return f"def {fname}({', '.join(params)}):\n" + "\n".join(body) + "\n"


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


def compile_source(src: str, globals_: dict, hint: str, dynamic=None,
                   n_params: int = 0) -> "GraphFunction":
    """``mindspore.jit`` of the function defined by ``src``, with the fast call path
    of ``GraphFunction``. ``dynamic``: the ArrayTypes of the function's parameters when
    some have symbolic dimensions; the graph is then compiled once for all their sizes
    (``mindspore.enable_dynamic``, one ``mindspore.Symbol`` per fshard Symbol).
    ``n_params``: how many leading arguments are MindSpore Parameters (see
    ``GraphFunction``)."""
    mod = load_module(src, globals_, hint)
    fname = src.split("(", 1)[0][4:]
    fn = getattr(mod, fname)
    if dynamic is not None:
        symbols: dict = {}

        def ms_dim(d):
            if isinstance(d, int):
                return d
            if not isinstance(d, Symbol):  # a product of Symbols: any size
                return None
            if d not in symbols:
                symbols[d] = ms.Symbol(max=d.max, min=d.min, divisor=d.divisor,
                                       remainder=d.remainder, unique=True)
            return symbols[d]

        fn = ms.enable_dynamic(**{f"v{k}": Tensor(shape=[ms_dim(d) for d in a.shape],
                                                   dtype=a.dtype)
                                  for k, a in enumerate(dynamic) if not a.is_static})(fn)
    collective = any(isinstance(v, _COLLECTIVE_OPS) for v in globals_.values())
    return GraphFunction(ms.jit(fn, fullgraph=True), dynamic=dynamic is not None,
                         collective=collective, n_params=n_params)


# ---------------------------------------------------------------------------
# Progress markers for fshard.launch
# ---------------------------------------------------------------------------
#
# A rank started by fshard.launch writes one byte ``c`` to the launcher each time it
# enters a compiled graph that communicates (every collective of a job runs in one).
# When a rank dies waiting in a collective, the launcher compares the counts: the
# ranks with fewer had stopped making progress, and are named as hung.

#: MindSpore's collective op classes: a compiled graph holding one communicates.
_COLLECTIVE_OPS = (ms.ops.AllReduce, ms.ops.AllGather, ms.ops.Broadcast,
                   ms.ops.ReduceScatter, ms.ops.AlltoAll)
#: (pid, fd) of the pipe to fshard.launch, read once per process (a child process
#: inherits the variable but is not the rank: its pid differs).
_report_fd: tuple = (None, None)


def tell_launcher(status: bytes) -> None:
    """Send ``status`` to fshard.launch when it started this process (else nothing)."""
    global _report_fd
    pid = os.getpid()
    if _report_fd[0] != pid:
        fd, _, owner = os.environ.get("FSHARD_LAUNCH_REPORT_FD", "").partition(":")
        _report_fd = (pid, int(fd) if fd.isdigit() and owner == str(pid) else None)
    if _report_fd[1] is not None:
        try:
            os.write(_report_fd[1], status)
        except OSError:  # the launcher is gone
            _report_fd = (pid, None)


# ---------------------------------------------------------------------------
# Calling a compiled graph
# ---------------------------------------------------------------------------
#
# A call of a ``mindspore.jit`` function costs ~60-90 µs of Python before the graph
# runs: it builds a new ``_JitExecutor``, recomputes the argument key in C++, forms
# the phase string, checks the compile cache, converts the arguments, and runs the
# graph through the PyNative executor. For the same inputs all of that yields the
# same phase every time. ``GraphFunction`` calls ``mindspore.jit`` once, asks
# MindSpore (exactly as the wrapper does) which phase that call used, and from then
# on hands the tensors straight to the graph executor with that phase: the route
# ``nn.Cell`` itself takes for its cached predict graphs (``set_jit_config`` then
# ``executor(args, phase)``). What it skips only matters for arguments that are not
# plain tensors (Parameters, constant or lazily initialised tensors), under
# PyNative autograd, and inside another jit capture; those calls, and any call after
# an unexpected failure, take the ``mindspore.jit`` route.

try:  # private MindSpore API: without it every call takes the mindspore.jit route
    from mindspore.graph import api as _ms_api
    from mindspore.graph.jit_context import jit_context as _jit_context

    _requires_grad = _ms_api._pynative_executor.requires_grad
    _convert_output = _ms_api._convert_python_data
except (ImportError, AttributeError):  # pragma: no cover  (another MindSpore version)
    _ms_api = None

    def _jit_context():
        return None

    def _requires_grad():
        return False


def _plain_tensors(args, n_params: int = 0) -> bool:
    """Whether the direct route may take ``args``: plain, initialised, non-constant
    Tensors, except that the first ``n_params`` may be initialised Parameters."""
    for k, a in enumerate(args):
        if type(a) is not Tensor:
            if k >= n_params or not isinstance(a, Parameter) or a.has_init:
                return False
        elif a.const_arg or a.has_init:
            return False
    return True


# ---------------------------------------------------------------------------
# Collectives: which run natively
# ---------------------------------------------------------------------------

#: What MindSpore runs natively inside a compiled graph, per device target:
#: "any" group, or the "world" group only. Everything else is emulated with these
#: (AllReduce + slice for reduce-scatter, AllGather + reduce for pmax/pmin, AllGather
#: + static index for all_to_all and ppermute, and a one-hot slot buffer + sub-group
#: AllReduce for gathers over a sub-group). CPU is measured (2.10); the GPU and
#: Ascend rows follow MindSpore's documentation and are not exercised here.
NATIVE_COLLECTIVES: dict = {
    "CPU": {"all_reduce_sum": "any", "all_gather": "world", "broadcast": "world"},
    "GPU": {"all_reduce_sum": "any", "all_reduce_max": "any", "all_reduce_min": "any",
            "all_gather": "any", "reduce_scatter": "any", "broadcast": "any"},
    "Ascend": {"all_reduce_sum": "any", "all_reduce_max": "any", "all_reduce_min": "any",
               "all_gather": "any", "reduce_scatter": "any", "broadcast": "any"},
}


#: The dtypes each backend's collectives take (MindSpore 2.10's CPU AllReduce, measured:
#: "The supported data types are input[Float32] ... input[Float16]"). Others are carried
#: in float32 by fshard (see ``fshard.primitives.collectives``); absent: every dtype.
COLLECTIVE_DTYPES: dict = {"CPU": ("Float32", "Float16")}


def device_target() -> str:
    """MindSpore's device target, which selects the row of ``NATIVE_COLLECTIVES``."""
    return ms.get_context("device_target")


def ms_version() -> str:
    """MindSpore's version (calibration tables are per version)."""
    return ms.__version__


def native_collectives() -> dict:
    """The row of ``NATIVE_COLLECTIVES`` for the device target in use (the cost model
    prices each collective as it will run: natively, or emulated)."""
    return NATIVE_COLLECTIVES.get(device_target(), {})


def _auto_parallel_context():
    from mindspore.parallel._auto_parallel_context import auto_parallel_context

    return auto_parallel_context()


_ms_parallel = _auto_parallel_context()


class GraphFunction:
    """A ``mindspore.jit`` function for one input signature, with a direct route
    to its compiled graph after the first call.

    >>> import fshard as fs, mindspore as ms, numpy as np
    >>> x = ms.Tensor(np.ones(2, np.float32))
    >>> g = fs.jit(lambda x: x * 2.0).lower(x).compile().fn   # a GraphFunction
    >>> g(x).asnumpy(), g.fast          # first call: mindspore.jit compiles
    (array([2., 2.], dtype=float32), True)
    >>> g(x).asnumpy()                  # later calls: the graph executor directly
    array([2., 2.], dtype=float32)

    Every call must use arguments of the same shapes and dtypes (fshard's jit
    cache guarantees it: one GraphFunction per signature).

    ``n_params`` leading arguments are the Parameters a jitted function reaches
    through a closure (``fs.jit`` passes the same objects at every call, checked for
    their types): the direct route takes them as they are, reading their current
    values (measured on MindSpore 2.10: ``set_data``, ``assign`` and an optimizer
    step are all seen). Parameters elsewhere take the ``mindspore.jit`` route.
    """

    __slots__ = ("jitted", "_phase", "_executor", "_config", "_tried", "_sig", "dynamic",
                 "compiles", "collective", "n_params")

    def __init__(self, jitted, dynamic: bool = False, collective: bool = False,
                 n_params: int = 0):
        self.jitted = jitted
        self.n_params = n_params
        self.dynamic = dynamic  # compiled for every size of its symbolic dimensions
        self.collective = collective  # holds a collective op (reported to fshard.launch)
        self.compiles = 0       # MindSpore compilations this function caused
        self._phase = None      # set once the direct route is known to be usable
        self._executor = None
        self._config = None
        self._tried = False
        self._sig = None        # the input shapes the direct route's graph was compiled for

    @property
    def fast(self) -> bool:
        """Whether calls now go to the graph executor directly."""
        return self._phase is not None

    def __call__(self, *args):
        # MindSpore's graph compiler and executor keep process-global state (call
        # depth, compile cache): threads run graphs one at a time.
        if self.collective:
            tell_launcher(b"c")
        with context.runtime_lock, kernel_dtype_errors("a compiled program", compiled=True):
            mode = _ms_parallel.get_parallel_mode()
            if mode == "stand_alone":
                return self._call(*args)
            # fshard's programs are partitioned already: MindSpore's own partitioner
            # (parallel_mode set by ms.set_auto_parallel_context) must not run on them
            # (on CPU it refuses to compile at all). Its other settings stay as set.
            _ms_parallel.set_parallel_mode("stand_alone")
            try:
                return self._call(*args)
            finally:
                _ms_parallel.set_parallel_mode(mode)

    def _call(self, *args):
        # A Parameter passed as a value (a Cell's weights, the first step of a training
        # loop whose later steps pass the updated Tensors) goes in as the Tensor it
        # holds: MindSpore compiles a graph per argument kind, so the Parameter would
        # cost a second compile at the next call.
        # (Checked once per call, the conversion only when some argument is not a
        # plain Tensor: the direct route below stays as short as it was.)
        plain = _plain_tensors(args, self.n_params)
        if not plain:
            args = tuple(Tensor(a) if k >= self.n_params and isinstance(a, Parameter)
                         and not a.has_init else a for k, a in enumerate(args))
            plain = _plain_tensors(args, self.n_params)
        phase = self._phase
        if (phase is not None and plain and _jit_context() is None and not _requires_grad()
                and (self.dynamic or [a.shape for a in args] == self._sig)):
            try:
                self._executor.set_jit_config(self._config)
                return _convert_output(self._executor(args, phase))
            except Exception:
                if self._still_compiled(phase):
                    # The graph ran and failed: running it again through mindspore.jit
                    # would repeat its work (and, in a job, its collectives on this rank
                    # only, desynchronising the ranks). The error is the user's.
                    raise
                self._phase = None  # the graph is gone: compile through mindspore.jit
        n_cached = len(_ms_api.ms_compile_cache) if _ms_api is not None else 0
        out = self.jitted(*args)
        if _ms_api is not None and len(_ms_api.ms_compile_cache) != n_cached:
            self.compiles += 1
        if not self._tried:
            self._find_phase(args)
        return out

    def _still_compiled(self, phase) -> bool:
        try:
            return bool(self._executor.has_compiled(phase))
        except Exception:  # noqa: BLE001  the executor itself is unusable: it is gone
            return False

    def _find_phase(self, args) -> None:
        """Ask MindSpore which compiled phase ``self.jitted(*args)`` just ran."""
        if (_jit_context() is not None or _requires_grad()
                or not _plain_tensors(args, self.n_params)):
            return  # this call is special; a later plain one may enable the direct route
        self._tried = True
        if (_ms_api is None or os.getenv("MS_JIT") == "0"
                or os.getenv("MS_DEV_JIT_AST_ENABLE_GUARD") == "1"):
            return
        try:
            # the wrapper's own settings, from the closure mindspore.jit built
            code, cells = self.jitted.__code__, self.jitted.__closure__ or ()
            env = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
            func, config = env["func"], env["jit_config"]
            ex = _ms_api._JitExecutor(func, env["hash_obj"], None, None, config, env["dynamic"],
                                      getattr(self.jitted, "__jit_graph_name__", ""))
            n_cached = len(_ms_api.ms_compile_cache)
            phase = ex.compile(func.__name__, *args)
            if len(_ms_api.ms_compile_cache) != n_cached:
                return  # it compiled again, so it is not the wrapper's graph: don't guess
            executor = ex._graph_executor
            if not executor.has_compiled(phase):
                return
            self._executor = executor
            self._config = (config.jit_config_dict if config is not None else None) or \
                _ms_api._DEFAULT_JIT_CONFIG
            self._phase = phase
            self._sig = [a.shape for a in args]
        except Exception:  # noqa: BLE001  any surprise: keep the mindspore.jit route
            self._phase = None


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


# ---------------------------------------------------------------------------
# MindSpore's private API: the one place fshard reaches it
# ---------------------------------------------------------------------------
#
# Besides the jit fast path above, fshard needs a few names MindSpore does not make
# public; tests/test_backend_private_api.py keeps every such use in this module, so a
# MindSpore upgrade is checked here alone.

#: The module that holds MindSpore's communication state once it is imported.
_COMM_HELPER = "mindspore.communication._comm_helper"
#: The C++ bindings module (the pyboost entry points and Tensor's C++ base).
C_EXPRESSION = "mindspore._c_expression"
#: MindSpore's private argument-checking module, whose ``isinstance`` checks a traced
#: value must pass like a Tensor.
PRIVATE_CHECK_MODULES = ("mindspore._checkparam",)


def comm_loaded() -> bool:
    """Whether MindSpore's communication layer has been imported in this process."""
    return _COMM_HELPER in sys.modules


def comm_initialized() -> bool:
    """Whether MindSpore's communication has been initialised (``init()``) here."""
    comm = sys.modules.get(_COMM_HELPER)
    return comm is not None and bool(comm.GlobalComm.INITED)


def world_collective(kind: str):
    """A compiled call of MindSpore's own ``kind`` (``"all_reduce"``, a sum, or
    ``"all_gather"``, along dimension 0) over every rank of the job: what a job's plan
    runs, for ``fs.sharding.calibrate`` to time."""
    from mindspore import ops

    op = ops.AllReduce() if kind == "all_reduce" else ops.AllGather()

    def collective(v):
        return op(v)

    return ms.jit(collective)


def sync_pynative() -> None:
    """Wait for the queued PyNative work (and its collectives) to finish."""
    from mindspore.common.api import _pynative_executor

    _pynative_executor.sync()


def synchronize(tensors=()) -> None:
    """Wait until each of ``tensors`` holds its value (``fs.block_until_ready``); with
    none, until all queued operations and graphs have finished. Reading a tensor's value
    is how fshard waits for one (as ``Compiled`` does): much cheaper than the PyNative
    executor's sync (measured ~5 ms against ~20 ms on a loaded 2-core CPU), and
    ``Tensor.data_sync`` is deprecated in 2.10."""
    if tensors:
        for t in tensors:
            t.asnumpy()
        return
    if _ms_api is not None:
        _ms_api._pynative_executor.sync()
    else:  # pragma: no cover  (another MindSpore version)
        sync_pynative()
    if device_target() != "CPU":  # MindSpore's device synchronize refuses the CPU
        ms.runtime.synchronize()


def dtype_type_ids(ms_dtypes) -> dict:
    """``{type id: dtype}``: the enum ids MindSpore's generated op code passes for
    dtype arguments."""
    from mindspore.ops._utils.arg_handler import dtype_to_type_id

    return {dtype_to_type_id("Cast", "dtype", t): t for t in ms_dtypes}


def native_entry_points() -> list:
    """``[(object, kind)]``: MindSpore's module-global entry points into native code
    (kind ``"pyboost"``: a generated ``pyboost_*`` function; ``"overload"``: a
    ``functional_overload`` instance; ``"run_op"``: ``ops.primitive._run_op``)."""
    import mindspore._c_expression as cx
    from mindspore.ops import primitive

    out = []
    for name in dir(cx):
        obj = getattr(cx, name)
        if name.startswith("pyboost_"):
            out.append((obj, "pyboost"))
        elif name.startswith("_") and name.endswith("_instance") and hasattr(obj, "name"):
            out.append((obj, "overload"))
    out.append((primitive._run_op, "run_op"))
    return out


def tensor_classes() -> tuple:
    """``mindspore.Tensor`` and its C++ base class."""
    from mindspore._c_expression import TensorPy

    return (Tensor, TensorPy)


def pyboost_prim_classes() -> list:
    """The ``_Pyboost*Prim`` classes whose ``__call__`` runs a primitive natively."""
    from mindspore.ops.auto_generate import pyboost_inner_prim

    return [cls for name, cls in sorted(vars(pyboost_inner_prim).items())
            if isinstance(cls, type) and name.startswith("_Pyboost") and "__call__" in vars(cls)]


def tensor_text(array: np.ndarray) -> str:
    """How MindSpore's ``ops.Print`` shows a tensor (its ``Tensor`` repr)."""
    return repr(Tensor(np.asarray(array)))


# MindSpore's Gather kernel refuses an operand of more than 8 dimensions.
GATHER_MAX_RANK = 8


def gather_any_rank(x, indices, axis: int):
    """``ms.ops.gather(x, indices, axis)`` for an ``x`` of any rank: past
    ``GATHER_MAX_RANK`` dimensions (a vmapped or virtual-mesh program adds one per
    batching level) it gathers from ``x`` viewed as (before, axis, after) and restores
    the dimensions. (Plain loops: this runs inside MindSpore graphs too.)"""
    shape = x.shape
    if len(shape) <= GATHER_MAX_RANK:
        return ms.ops.gather(x, indices, axis)
    before, after = 1, 1
    for d in shape[:axis]:
        before = before * d
    for d in shape[axis + 1:]:
        after = after * d
    out = ms.ops.gather(ms.ops.reshape(x, (before, shape[axis], after)), indices, 1)
    return ms.ops.reshape(out, tuple(shape[:axis]) + tuple(indices.shape)
                          + tuple(shape[axis + 1:]))


def ms_slice(x, begin, size):
    return ms.ops.slice(x, begin, size)


def ms_strided_slice(x, begin, end, strides):
    return ms.ops.strided_slice(x, begin, end, strides)


def _unit_slice_sizes(begin, end, strides) -> tuple | None:
    """The sizes of a static slice ``x[begin:end:strides]`` that a ``Slice`` kernel can
    take (every stride 1, no piece empty), else None (``StridedSlice``). Why not always
    ``StridedSlice``: on CPU it stalls for 2-4 ms a call in spells in some graphs (four
    16x16 slices, each feeding one of the graph's outputs: 8-12 ms a call in spells, 0.14
    ms between them; one added to a step-shaped graph of 90 kernels: 3.3-4.0 ms against
    0.35-0.48), where ``Slice`` ran without a stall in the same tests; and ``Slice`` has a
    bfloat16 kernel on CPU, ``StridedSlice`` none."""
    if all(isinstance(v, (int, np.integer)) for v in (*begin, *end, *strides)) and \
            all(s == 1 for s in strides) and all(e > b for b, e in zip(begin, end)):
        return tuple(int(e - b) for b, e in zip(begin, end))
    return None


def slice_tensor(x, begin, end, strides):
    """``x[begin:end:strides]`` of a Tensor, eagerly, on the kernel ``lower_slice``
    gives the same slice in a compiled program."""
    sizes = _unit_slice_sizes(begin, end, strides)
    if sizes is not None:
        return ms_slice(x, tuple(int(b) for b in begin), sizes)
    return ms_strided_slice(x, tuple(begin), tuple(end), tuple(strides))


def lower_slice(ctx, x: str, begin, end, strides) -> str:
    """A static slice ``x[begin:end:strides]`` in a lowered program: a ``Slice`` kernel
    where ``_unit_slice_sizes`` allows it, ``StridedSlice`` otherwise."""
    sizes = _unit_slice_sizes(begin, end, strides)
    if sizes is not None:
        return ctx.call(ms_slice, x, begin=tuple(int(b) for b in begin), size=sizes)
    return ctx.call(ms_strided_slice, x, begin=tuple(begin), end=tuple(end),
                    strides=tuple(strides))


def as_rank1(x):
    """A 0-d tensor as shape ``(1,)``."""
    return ms.ops.reshape(x, (1,))


def depend(x, after):
    """``x``, once ``after`` is computed (MindSpore's ``ops.depend``)."""
    return ms.ops.depend(x, after)


def python_callback_op(fn, n_inputs: int):
    """A MindSpore op (``Custom``, ``func_type="pyfunc"``) that calls ``fn`` with its
    ``n_inputs`` operands as NumPy arrays when the graph runs; it returns a dummy
    float32 ``(1,)`` tensor, the token that orders it."""
    def run(*arrays):
        fn(*arrays)
        return np.zeros((1,), np.float32)

    # MindSpore reads the pyfunc's source and counts its parameters (a *args function
    # is refused as a tuple input): a fixed-arity function, written to a real file.
    names = ", ".join(f"a{i}" for i in range(n_inputs))
    src = f"def callback({names}):\n    return run({names})\n"
    fixed = load_module(src, {"run": run}, "callback").callback
    return ms.ops.Custom(fixed, out_shape=lambda *shapes: (1,),
                         out_dtype=lambda *types: ms.float32, func_type="pyfunc")


def own_call_prim_classes() -> list:
    """Primitive classes with a ``__call__`` of their own that never reaches
    ``_run_op``: ``Print`` (prints in Python) and the collectives that refuse PyNative."""
    return [cls for cls in (ms.ops.Print, ms.ops.NeighborExchange, ms.ops.NeighborExchangeV2)
            if "__call__" in vars(cls)]


def value_branching_functions() -> dict:
    """MindSpore's Python functions whose own code branches on a tensor's value with a
    Python ``if`` (so a traced value cannot run them), by name."""
    from mindspore.ops.function import clip_func, math_func

    return {"clip_by_norm": clip_func.clip_by_norm, "bincount": math_func.bincount}


def clip_total_norm(xs: list, norm_type: float):
    """The norm ``ops.clip_by_norm`` clips by, as MindSpore computes it (its private
    ``_cal_total_norm``: ``(sum x^p)^(1/p)`` of the inputs' own such norms, no absolute
    value taken), for a finite ``norm_type``."""
    from mindspore.ops.function import clip_func

    return clip_func._cal_total_norm(xs, norm_type)


def cell_declared_inputs(cell) -> tuple | None:
    """The input declarations ``cell.set_inputs(...)`` stored on the Cell, or None."""
    return getattr(cell, "_dynamic_shape_inputs", None)


def cell_params(cell) -> dict:
    """The Cell's own parameter slots (``{leaf name: Parameter}``; mutable)."""
    return cell._params


def cell_param_tuples(cell) -> dict:
    """The Cell's ``ParameterTuple`` attributes (``{name: tuple of Parameters}``):
    ``nn.LSTM``'s ``w_ih_list``, which its ``construct`` reads instead of the same
    Parameters' own slots. MindSpore 2.10 keeps them in the instance's ``__dict__``
    (older versions in ``_params_list``)."""
    found = dict(cell.__dict__.get("_params_list", {}))
    found.update({k: v for k, v in cell.__dict__.items()
                  if isinstance(v, (ms.ParameterTuple, SwappedParameterTuple))})
    return found


class SwappedParameterTuple(tuple):
    """A ``ParameterTuple`` whose members ``fs.functional`` replaced (by tracers or
    Tensors): still found by ``cell_param_tuples`` when a nested transform swaps again."""


def cell_param_tuple(cell, name: str) -> tuple:
    """What ``name`` (one of ``cell_param_tuples``) holds now (swapped: a plain tuple)."""
    held = cell.__dict__.get("_params_list", {})
    return held[name] if name in held else cell.__dict__[name]


def set_cell_param_tuple(cell, name: str, members: tuple) -> None:
    """Store ``members`` where ``cell_param_tuples`` found ``name`` (a
    ``SwappedParameterTuple`` unless it is a ``ParameterTuple``)."""
    if not isinstance(members, ms.ParameterTuple):
        members = SwappedParameterTuple(members)
    held = cell.__dict__.get("_params_list", {})
    if name in held:
        held[name] = members
    else:
        cell.__dict__[name] = members


def cell_children(cell) -> dict:
    """The Cell's direct sub-Cells (``{name: Cell}``)."""
    return cell._cells


def auto_parallel_settings() -> dict:
    """What ``ms.set_auto_parallel_context`` holds that fshard acts on, with whether
    the user set it (MindSpore's getters return a default otherwise):
    ``dataset_strategy`` (None: never set; "full_batch" / "data_parallel" (also from
    ``full_batch=``); a tuple of per-input strategies or of Layouts), ``device_num``
    (None: never set), ``parallel_mode``, ``search_mode``, ``gradients_mean``."""
    from mindspore.parallel._auto_parallel_context import auto_parallel_context

    ctx = auto_parallel_context()
    dataset = None
    given = [] if ctx._dataset_strategy_using_str else ctx.get_dataset_strategy()
    if ctx._dataset_layout is not None:
        dataset = tuple(ctx._dataset_layout)
    elif given:  # (after a reset MindSpore keeps the flag but the strategy is empty)
        dataset = tuple(tuple(s) for s in given)
    elif ctx.get_full_batch_is_set():
        dataset = "full_batch" if ctx.get_full_batch() else "data_parallel"
    return {"dataset_strategy": dataset,
            "device_num": ctx.get_device_num() if ctx.get_device_num_is_set() else None,
            "parallel_mode": ctx.get_parallel_mode(),
            "search_mode": ctx.get_strategy_search_mode(),
            "gradients_mean": bool(ctx.get_gradients_mean())}


def cell_first_call_checks(cell) -> None:
    """Run MindSpore's once-per-Cell checks (parameter names, lazy initialisation) on
    ``cell`` and its sub-Cells, as its first call would."""
    # every sub-Cell too: each one's first call checks its own Parameters, and a traced
    # sub-Cell (one with cell.shard) is entered later with tracers in its slots
    for c in [cell] + [c for _, c in cell.cells_and_names()]:
        if not getattr(c, "_is_check_and_refresh", True):
            c._self_check()
        if not getattr(c, "_init_flag", True):
            c._init_check()


def conv2d_backprop_filter_class():
    """MindSpore's ``Conv2DBackpropFilter`` primitive class (its module, ``_grad_ops``,
    is private): the weight gradient of a 2-D convolution."""
    from mindspore.ops.operations import _grad_ops

    return _grad_ops.Conv2DBackpropFilter


def hard_activation_grad_classes() -> tuple:
    """MindSpore's ``ReLU6Grad`` and ``HSwishGrad`` primitive classes (their module,
    ``_grad_ops``, is private): relu6's and hardswish's derivatives times ``dy``, each
    in one kernel."""
    from mindspore.ops.operations import _grad_ops

    return _grad_ops.ReLU6Grad, _grad_ops.HSwishGrad


def batch_norm_grad_class():
    """MindSpore's ``BatchNormGrad`` primitive class (generated into a private module):
    the fused gradient of a training-mode BatchNorm from its saved batch statistics."""
    from mindspore.ops.auto_generate import gen_ops_prim

    return gen_ops_prim.BatchNormGrad


def optimizer_lr_classes() -> tuple:
    """The private classes ``nn.Optimizer`` wraps a learning rate in:
    ``(a number in a group of dynamic learning rates, a list of per-step values)``."""
    from mindspore.nn.optim.optimizer import _ConvertToCell, _IteratorLearningRate

    return _ConvertToCell, _IteratorLearningRate


def split_with_size_class():
    """MindSpore's ``SplitWithSize`` primitive class (generated into a private module):
    one kernel cutting a tensor into pieces of given sizes along an axis, for every
    dtype on CPU (compiled, not into an empty piece off axis 0: "memcpy failed")."""
    from mindspore.ops.auto_generate import gen_ops_prim

    return gen_ops_prim.SplitWithSize


def softmax_kernel():
    """The Softmax primitive instance ``ops.softmax`` calls (``softmax_impl(x, axis)``,
    generated into a private module)."""
    from mindspore.ops.auto_generate import softmax_impl

    return softmax_impl
