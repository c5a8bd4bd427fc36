"""``fs.jit``: stage once per input signature, lower to a MindSpore GRAPH-mode
program, cache it, and call it.

Inside another transform (when the current trace is a staging trace) a jitted
function is simply inlined: its equations join the enclosing Program, which is
itself compiled if the outermost transform is ``jit``.
"""

from __future__ import annotations

import functools

import numpy as np

from fshard import dtypes, tree
from fshard import passes
from fshard.backend import mindspore as backend
from fshard.core import EvalTrace, Symbol, current_trace, typeof
from fshard.errors import ShapeError
from fshard.mesh import context_key as _mesh_key
from fshard.staging import (Traced, check_function, check_static_args, fun_name, split_static,
                            trace_fun)


class Lowered:
    """A staged and lowered function: ``as_text()`` shows the MindSpore program."""

    def __init__(self, traced: Traced, source: str, globals_: dict, n_out: int,
                 wait: int | None = None):
        self.traced = traced
        self.source = source
        self.globals = globals_
        self.n_out = n_out
        self.wait = wait  # see Compiled
        self._compiled = None

    @property
    def program(self):
        return self.traced.program

    def as_text(self) -> str:
        """The generated source MindSpore compiles, with its module globals."""
        return backend.globals_text(self.globals) + "\n" + self.source

    def compile(self) -> "Compiled":
        if self._compiled is None:
            fn = backend.compile_source(self.source, self.globals, self.traced.name)
            prog = self.traced.program
            self._compiled = Compiled(fn, self.n_out, self.traced.out_tree, self.wait,
                                      [v.aval for v in prog.inputs[prog.n_consts:]],
                                      prog.out_avals, self.traced.name)
        return self._compiled


class Compiled:
    """The compiled graph of one input signature.

    A graph with several outputs returns once its last-computed output is ready
    (``wait``). MindSpore 2.10's CPU runtime waits for an output inefficiently once
    another output of the same running graph is ready: reading the loss of a
    ``value_and_grad`` step first, as training loops do, made the step twice as slow.
    Waiting here for the output the graph computes last avoids that.
    """

    __slots__ = ("fn", "n_out", "out_tree", "_bare", "_wait", "in_avals", "out_avals", "name")

    def __init__(self, fn, n_out: int, out_tree, wait: int | None = None, in_avals=(),
                 out_avals=(), name: str = "f"):
        self.fn, self.n_out, self.out_tree = fn, n_out, out_tree
        self.in_avals, self.out_avals, self.name = list(in_avals), list(out_avals), name
        # a function returning one array needs no unflattening
        self._bare = n_out == 1 and out_tree.is_leaf()
        self._wait = wait if n_out > 1 else None

    def call_flat(self, leaves) -> list:
        if self.n_out == 0:
            return []
        out = self.fn(*leaves)
        if self._wait is not None:
            out[self._wait].asnumpy()
        return [out] if self.n_out == 1 else list(out)

    def call_leaves(self, leaves):
        """The output pytree for flat inputs ``leaves`` (any arrays or scalars).

        This is the per-call path of ``fs.jit``: keep it short.
        """
        args = [x if isinstance(x, _Tensor) else backend.as_tensor(x) for x in leaves]
        if self._bare:
            return self.fn(*args)
        if self.n_out == 0:
            return tree.unflatten(self.out_tree, ())
        out = self.fn(*args)
        if self._wait is not None:
            out[self._wait].asnumpy()
        return tree.unflatten(self.out_tree, (out,) if self.n_out == 1 else out)

    def __call__(self, *leaves):
        """Run on flat inputs, checked against the types the program was traced for:
        a static dimension must match, a ``Symbol`` dimension must satisfy it (and one
        Symbol bind one size everywhere), and the outputs must have the shapes the
        program promises for that binding."""
        sizes = _bind(self.name, "input", self.in_avals, leaves, {})
        out = self.call_flat([x if isinstance(x, _Tensor) else backend.as_tensor(x)
                              for x in leaves])
        try:
            _bind(self.name, "output", self.out_avals, out, sizes)
        except ShapeError as e:  # never hand back a result of another shape
            raise ShapeError(
                f"{self.name}: the compiled program returned outputs of other shapes than "
                f"it promises for these inputs ({e.args[0].splitlines()[0]}). fshard does "
                "not compile shape-polymorphic graphs yet.\nFix: call fs.jit(f)(...) "
                "directly (it compiles once per input shape).") from None
        return tree.unflatten(self.out_tree, out)


_Tensor = backend.Tensor


def _bind(name: str, what: str, avals, values, sizes: dict) -> dict:
    """Check ``values`` against ``avals``, binding each Symbol to the size it meets
    (``sizes``: Symbol -> (size, where)); an fshard error names the mismatch."""
    if len(values) != len(avals):
        raise ShapeError(
            f"{name}: the compiled program takes {len(avals)} array {what}s, got "
            f"{len(values)}.\nFix: pass the flat arrays the program was lowered for.")
    for k, (a, x) in enumerate(zip(avals, values)):
        t = typeof(x)
        where = f"{what} {k}"
        if t.dtype != a.dtype or t.ndim != a.ndim:
            raise ShapeError(
                f"{name}: {where} has type {t}, but the program was compiled for {a}.\n"
                f"Fix: pass a {a} (or call fs.jit({name}) directly, which compiles for "
                "each new type).")
        for d, (want, got) in enumerate(zip(a.shape, t.shape)):
            if isinstance(want, Symbol):
                if not want.accepts(got):
                    raise ShapeError(
                        f"{name}: {where} has size {got} in dimension {d}, which {want!r} "
                        "does not accept (size = divisor * N + remainder, within [min, max])."
                        f"\nFix: pad or trim that dimension to a size the Symbol accepts.")
                bound = sizes.setdefault(want, (got, f"{where} dimension {d}"))
                if bound[0] != got:
                    raise ShapeError(
                        f"{name}: {where} has size {got} in dimension {d}, but the same "
                        f"{want!r} has size {bound[0]} in {bound[1]}; one Symbol object is one "
                        "size in every place it appears.\nFix: make those dimensions equal, "
                        "or declare them with different Symbol objects.")
            elif want != got:
                raise ShapeError(
                    f"{name}: {where} has shape {tuple(t.shape)}, but the program was "
                    f"compiled for {a}: dimension {d} must be {want}.\nFix: pass that "
                    f"shape, or declare the dimension with fs.Symbol(...) when lowering.")
    return sizes


def _last_computed(program) -> int | None:
    """Which output the graph computes last (None: fewer than two outputs, or not on
    CPU, where waiting would copy device memory to the host)."""
    if len(program.outputs) < 2 or backend.ms.get_context("device_target") != "CPU":
        return None
    return _last_output(program)


def _last_output(program) -> int | None:
    defined = {v: (i, k) for i, eq in enumerate(program.equations)
               for k, v in enumerate(eq.outputs)}
    where = [defined.get(a, (-1, -1)) for a in program.outputs]
    last = max(range(len(where)), key=lambda j: where[j][0])
    if where[last][0] < 0:
        return None
    eq = program.equations[where[last][0]]
    # All outputs of one call equation (e.g. a shard_call): look inside the program
    # it executes.
    body = getattr(eq.params.get("plan"), "executed", None)
    if body is not None and all(w[0] == where[last][0] for w in where):
        inner = _last_output(body)
        if inner is not None:
            for j, w in enumerate(where):
                if w[1] == inner:
                    return j
    return last


def _leaf_key(x):
    if type(x) is _Tensor:
        return (x.shape, x.dtype)  # Tensor.shape is already a tuple
    if isinstance(x, np.ndarray):  # the same key as the Tensor it becomes: no retrace
        return (x.shape, dtypes.from_numpy(x.dtype))
    shape = getattr(x, "shape", None)
    if shape is not None:
        return (tuple(shape), x.dtype)
    return (type(x),)


class Jitted:
    """The result of ``fs.jit(f)``: call it, ``lower`` it, count its traces."""

    def __init__(self, fun, static_argnums=(), static_argnames=()):
        if isinstance(static_argnums, int):
            static_argnums = (static_argnums,)
        if isinstance(static_argnames, str):
            static_argnames = (static_argnames,)
        self.fun = fun
        self.static_argnums = tuple(static_argnums)
        self.static_argnames = tuple(static_argnames)
        self.trace_count = 0
        self._cache: dict = {}   # key -> Lowered
        self._calls: dict = {}   # key -> Compiled, for signatures without static arguments
        self._static = bool(self.static_argnums or self.static_argnames)
        functools.update_wrapper(self, fun, updated=())

    def _prepare(self, args, kwargs):
        if self.static_argnums or self.static_argnames:
            dyn_args, dyn_kwargs, skey, rebuild = split_static(
                self.fun, args, kwargs, self.static_argnums, self.static_argnames)
        else:
            dyn_args, dyn_kwargs, skey, rebuild = args, kwargs, None, None
        leaves, in_tree = tree.flatten((dyn_args, dyn_kwargs))
        key = (in_tree, tuple([_leaf_key(x) for x in leaves]), skey, _mesh_key())
        return key, leaves, in_tree, rebuild

    def lower(self, *args, **kwargs) -> Lowered:
        key, leaves, in_tree, rebuild = self._prepare(args, kwargs)
        return self._lower(key, leaves, in_tree, rebuild)

    def _lower(self, key, leaves, in_tree, rebuild) -> Lowered:
        lowered = self._cache.get(key)
        if lowered is None:
            self.trace_count += 1
            traced = trace_fun(self.fun, in_tree, [typeof(x) for x in leaves], rebuild)
            # the IR cleanup passes (fshard/passes.py) run on what is compiled only:
            # make_ir and .program show the staged Program as traced
            program = passes.simplify(traced.program)
            src, globals_, n_out = backend.lower_program(program, traced.consts, traced.name)
            lowered = Lowered(traced, src, globals_, n_out, _last_computed(program))
            self._cache[key] = lowered
        return lowered

    def __call__(self, *args, **kwargs):
        if type(current_trace()) is not EvalTrace:
            return self.fun(*args, **kwargs)  # inlined into the enclosing transform
        if not self._static:
            # the hot path of a cached call: one flatten, one key, one dict lookup
            leaves, in_tree = tree.flatten((args, kwargs))
            key = (in_tree, tuple([(x.shape, x.dtype) if type(x) is _Tensor else _leaf_key(x)
                                   for x in leaves]), None, _mesh_key())
            compiled = self._calls.get(key)
            if compiled is None:
                lowered = self._lower(key, leaves, in_tree, None)
                compiled = self._calls[key] = lowered._compiled or lowered.compile()
            return compiled.call_leaves(leaves)
        key, leaves, in_tree, rebuild = self._prepare(args, kwargs)
        lowered = self._cache.get(key)
        if lowered is None:
            lowered = self._lower(key, leaves, in_tree, rebuild)
        compiled = lowered._compiled or lowered.compile()
        return compiled.call_leaves(leaves)

    def __repr__(self) -> str:
        return f"fs.jit({fun_name(self.fun)})"


class _Omitted:
    """The default of ``jit``'s ``fun``: ``fs.jit(static_argnums=...)`` without a
    function returns a decorator (an explicit ``None`` is an error)."""

    def __repr__(self) -> str:
        return "<omitted: a decorator>"


_DECORATOR = _Omitted()


def jit(fun=_DECORATOR, *, static_argnums=(), static_argnames=()):
    """Compile ``fun`` into one MindSpore GRAPH-mode program per input signature.

    >>> import numpy as np, fshard as fs
    >>> f = fs.jit(lambda x, y: fs.ops.relu(x @ y))
    >>> f(np.eye(2, dtype=np.float32), -np.ones((2, 2), np.float32)).shape
    (2, 2)
    >>> f.trace_count
    1

    Args:
        fun: a function of pytrees of arrays (or an ``nn.Cell``).
        static_argnums: positions of arguments that are Python values, part of the
            cache key and passed to ``fun`` unchanged.
        static_argnames: the same, for keyword arguments.

    Returns:
        a callable with ``.lower(*args)`` (``.as_text()``, ``.compile()``) and
        ``.trace_count``.

    See also: ``fs.make_ir``; docs/jit.md.
    """
    if fun is _DECORATOR:  # @fs.jit(static_argnums=...) as a decorator factory
        def decorate(f):
            check_function("fs.jit", f)
            return jit(f, static_argnums=static_argnums, static_argnames=static_argnames)

        return decorate
    from fshard.cells import is_cell, maybe_cell

    check_function("fs.jit", fun)
    static_argnums, static_argnames = check_static_args(
        "fs.jit", fun.construct if is_cell(fun) else fun, static_argnums, static_argnames)
    if is_cell(fun):  # the Cell's parameters become argument 0
        static_argnums = tuple(i + 1 if i >= 0 else i for i in static_argnums)
    return maybe_cell(fun, lambda f: Jitted(f, static_argnums, static_argnames))
