"""``fs.jit``: stage once per input signature, lower to a MindSpore GRAPH-mode
program, cache it, and call it.

Inside another transform (when the current trace is a staging trace) a jitted
function is simply inlined: its equations join the enclosing Program, which is
itself compiled if the outermost transform is ``jit``.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from fshard.core import context, dtypes, tree
from fshard.primitives import passes
from fshard.primitives.collectives import COLLECTIVES, shard_out_p
from fshard.backend import mindspore as backend
from fshard.core.tracing import (ArrayType, EvalTrace, Symbol, current_trace, dim_eval, is_symbolic,
                         typeof)
from fshard.errors import ArgumentError, ShapeError
from fshard.core.ir import Program, Var
from fshard.meshes.mesh import context_key as _mesh_key
from fshard.sharding.local import ShardedArray
from fshard.core.annotations import AnnotatedShapes
from fshard.transforms.shard_call import block_of, local_signature, localize, wrap_outputs
from fshard.core.staging import (Traced, check_function, check_static_args, fun_name, split_static,
                            trace_fun)


class Lowered:
    """A staged and lowered function: ``as_text()`` shows the MindSpore program."""

    def __init__(self, traced: Traced, source: str, globals_: dict, n_out: int,
                 wait: int | None = None, local=None, run=None, params=()):
        self.traced = traced
        # The program as compiled: the closure's Parameters lifted to its leading
        # inputs (``params``, read at each call; see ``lift_parameters``)
        self.run = run if run is not None else traced.program
        self.params = tuple(params)
        # In a job with fs.ShardedArray inputs or outputs: (the program as compiled, its
        # inputs and outputs blocks where they are; per output its block layout or None)
        self.local = local
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
            prog, run = self.traced.program, self.run
            in_avals = [v.aval for v in run.inputs[run.n_consts:]]
            fn = backend.compile_source(self.source, self.globals, self.traced.name,
                                        dynamic=in_avals if _symbolic(in_avals) else None,
                                        n_params=len(self.params))
            self._compiled = Compiled(fn, self.n_out, self.traced.out_tree, self.wait,
                                      [v.aval for v in prog.inputs[prog.n_consts:]],
                                      run.out_avals, self.traced.name, self.params)
            self._compiled.effectful = any(eq.prim.effect for eq in run.equations)
            if self.local is not None:
                self._compiled.local = (self.local[1], prog.out_avals)
            if fn.dynamic:  # the same source, compiled for the sizes of one call
                self._compiled.specialize = lambda: backend.compile_source(
                    self.source, self.globals, self.traced.name, n_params=len(self.params))
        return self._compiled


#: A dynamic-shape program compiles a static copy of itself for a binding of its
#: Symbols once that binding has been called this often (MindSpore runs dynamic-shape
#: graphs 1.4-2x slower on CPU), for at most MAX_SPECIALIZED bindings.
HOT_CALLS, MAX_SPECIALIZED = 8, 8


class Compiled:
    """The compiled graph of one input signature.

    A graph with several outputs returns once its last-computed output is ready
    (``wait``). MindSpore 2.10's CPU runtime waits for an output inefficiently once
    another output of the same running graph is ready: reading the loss of a
    ``value_and_grad`` step first, as training loops do, made the step twice as slow.
    Waiting here for the output the graph computes last avoids that.
    """

    __slots__ = ("fn", "n_out", "out_tree", "_bare", "_wait", "in_avals", "out_avals", "name",
                 "_checked", "specialize", "_calls", "static", "local", "params",
                 "_param_types", "effectful")

    def __init__(self, fn, n_out: int, out_tree, wait: int | None = None, in_avals=(),
                 out_avals=(), name: str = "f", params=()):
        self.fn, self.n_out, self.out_tree = fn, n_out, out_tree
        # The Parameters the function reaches through a closure: the graph's leading
        # inputs, read at each call (``lift_parameters``), with their types at tracing
        self.params = tuple(params)
        self._param_types = [(tuple(p.shape), p.dtype) for p in self.params]
        self.in_avals, self.out_avals, self.name = list(in_avals), list(out_avals), name
        # a function returning one array needs no unflattening
        self._bare = n_out == 1 and out_tree.is_leaf()
        self._wait = wait if n_out > 1 else None
        # a program with no outputs still runs for its effects (a debug callback, a
        # collective other ranks wait in): its lowering then returns the last effect,
        # and the call waits for it
        self.effectful = False
        self._checked: set = set()  # Symbol bindings whose output shapes were checked
        self.specialize = None      # () -> a GraphFunction for static shapes (dynamic only)
        self._calls: dict = {}      # binding -> calls so far
        self.static: dict = {}      # binding -> its static GraphFunction
        # In a job: (per output its block layout or None, the global output types):
        # the program takes blocks for fs.ShardedArray inputs and returns some.
        self.local = None

    @property
    def compiles(self) -> int:
        return self.fn.compiles + sum(g.compiles for g in self.static.values())

    def _graph_for(self, binding):
        """The graph to run for a binding of the Symbols: its static copy once the
        binding is hot, else the dynamic graph."""
        fn = self.static.get(binding)
        if fn is not None:
            return fn
        n = self._calls[binding] = self._calls.get(binding, 0) + 1
        if n >= HOT_CALLS and len(self.static) < MAX_SPECIALIZED:
            fn = self.static[binding] = self.specialize()
            return fn
        return self.fn

    def param_values(self) -> list:
        """The lifted Parameters, checked to have the types the program was traced for
        (the graph reads their values when it runs)."""
        for p, (shape, dtype) in zip(self.params, self._param_types):
            # `is not` first: MindSpore's dtype `!=` costs ~3 µs, identity ~0.1 µs
            if p.shape != shape or (p.dtype is not dtype and p.dtype != dtype):
                raise ParameterChanged(self, p, shape, dtype)
        return list(self.params)

    def call_flat(self, leaves, fn=None) -> list:
        if self.params:
            leaves = self.param_values() + list(leaves)
        if self.n_out == 0:
            if self.effectful:
                backend.synchronize([(fn or self.fn)(*leaves)])
            return []
        out = (fn or self.fn)(*leaves)
        if self._wait is not None:
            out[self._wait].asnumpy()
        return [out] if self.n_out == 1 else list(out)

    def call_leaves(self, leaves):
        """The output pytree for flat inputs ``leaves`` (any arrays or scalars).

        This is the per-call path of ``fs.jit``: keep it short.
        """
        if self.local is not None:
            return self._call_local(leaves)
        args = [x if isinstance(x, _Tensor) else backend.as_tensor(x) for x in leaves]
        if self.params:
            args = self.param_values() + args
        if self._bare:
            return self.fn(*args)
        if self.n_out == 0:
            if self.effectful:  # nothing to wait on but the call: it returns when done
                backend.synchronize([self.fn(*args)])
            return tree.unflatten(self.out_tree, ())
        out = self.fn(*args)
        if self._wait is not None:
            out[self._wait].asnumpy()
        return tree.unflatten(self.out_tree, (out,) if self.n_out == 1 else out)

    def _call_local(self, leaves, fn=None):
        """A call taking and returning ``fs.ShardedArray`` blocks."""
        out = self.call_flat([backend.as_tensor(block_of(x)) for x in leaves], fn)
        out = wrap_outputs(out, *self.local)
        return tree.unflatten(self.out_tree, out)

    def __call__(self, *leaves, names=None):
        """Run on flat inputs, checked against the types the program was traced for:
        a static dimension must match, a ``Symbol`` dimension must satisfy it (and one
        Symbol bind one size everywhere), and the outputs must have the shapes the
        program promises for that binding. ``names``: how errors name each input."""
        sizes = _bind(self.name, "input", self.in_avals, leaves, {}, names)
        binding = tuple(v[0] for v in sizes.values())
        out = self.call_flat([x if isinstance(x, _Tensor) else backend.as_tensor(block_of(x))
                              for x in leaves],
                             self._graph_for(binding) if self.specialize else None)
        # The output shapes follow from the input sizes: check them once per binding
        # (reading a dynamic output's shape waits for the graph to finish).
        if binding in self._checked:
            return tree.unflatten(self.out_tree, out)
        try:
            _bind(self.name, "output", self.out_avals, out, sizes)
            self._checked.add(binding)
            if self.local is not None:
                return tree.unflatten(self.out_tree, wrap_outputs(out, *self.local))
        except ShapeError as e:  # never hand back a result of another shape
            raise ShapeError(
                f"{self.name}: the compiled program returned outputs of other shapes than "
                f"it promises for these inputs ({e.args[0].splitlines()[0]}). fshard does "
                "not compile shape-polymorphic graphs yet.\nFix: call fs.jit(f)(...) "
                "directly (it compiles once per input shape).") from None
        if self.local is not None:
            out = wrap_outputs(out, *self.local)
        return tree.unflatten(self.out_tree, out)


_Tensor = backend.Tensor


class ParameterChanged(ShapeError):
    """A Parameter lifted into a compiled program has another shape or dtype than when
    the program was traced (``fs.jit`` catches it and traces again)."""

    def __init__(self, compiled: Compiled, param, shape: tuple, dtype):
        self.compiled = compiled
        now = ArrayType(tuple(param.shape), param.dtype)
        super().__init__(
            f"{compiled.name}: the Parameter {param.name!r} it reads through a closure is "
            f"{now} now, but the program was compiled for "
            f"{ArrayType(shape, dtypes.canonical(dtype))}.\nFix: call the fs.jit function "
            "itself (it traces again when a closed-over Parameter changes shape), or lower "
            "it again with .lower(...).")


def lift_parameters(program, consts) -> tuple:
    """``(program, consts, params)``: the MindSpore Parameters among ``program``'s
    constants moved to the front of its (non-constant) inputs.

    A Parameter is a variable: ``set_data``, ``assign`` and MindSpore's optimizers change
    it between calls. Baked into the graph as a module global it kept the memory it had
    when compiled (``set_data``, which gives it new memory, went unseen), so the
    compiled program takes it as an input instead, passed at each call
    (``Compiled.param_values``). Other arrays a
    function closes over (Tensors, NumPy arrays) stay constants, as in JAX. Transforms
    never see the difference: they ran before lowering, with every Parameter a constant
    (so ``grad`` does not differentiate with respect to it)."""
    n = program.n_consts
    lifted = [k for k, c in enumerate(consts) if isinstance(c, backend.Parameter)]
    if not lifted:
        return program, consts, ()
    kept = [k for k in range(n) if k not in set(lifted)]
    inputs = ([program.inputs[k] for k in kept] + [program.inputs[k] for k in lifted]
              + list(program.inputs[n:]))
    program = Program(inputs, program.equations, program.outputs, len(kept), program.meta)
    return program, [consts[k] for k in kept], tuple(consts[k] for k in lifted)


def _symbolic(avals) -> bool:
    return any(not a.is_static for a in avals)


def _spec_type(spec, where: str, ms_symbols: dict) -> ArrayType | None:
    """An input declaration as an ArrayType: an ``fs.ArrayType``, or a MindSpore
    placeholder ``Tensor(shape=[s0, 784], dtype=...)`` whose dims are ints,
    ``mindspore.Symbol`` (one object: one fshard Symbol) or None (a new Symbol)."""
    if isinstance(spec, ArrayType):
        for d in spec.shape:
            if d is not None and (not isinstance(d, (int, Symbol)) or isinstance(d, bool)):
                raise ArgumentError(
                    f"{where}: a declared dimension must be an int, an fs.Symbol or None, "
                    f"got {d!r} in {spec}.\nFix: use fs.Symbol(...) (or None) for a "
                    "dimension of any size.")
        # a NumPy or Python dtype (fs.ArrayType((b, 16), np.float32), as in JAX) is the
        # MindSpore dtype the arrays passed in have: compared as such at each call
        dtype = dtypes.canonical(spec.dtype)
        if None in spec.shape:  # as in a MindSpore placeholder: a new Symbol, any size
            return ArrayType(tuple(Symbol() if d is None else d for d in spec.shape), dtype)
        return spec if dtype is spec.dtype else ArrayType(spec.shape, dtype)
    if isinstance(spec, _Tensor) and tuple(spec.shape) == (-2,):
        # MindSpore's dynamic rank (Tensor(shape=None) or [-2]): any shape, so no
        # declaration; the type is taken from each call (not a rank-1 array of size -2)
        return None
    if isinstance(spec, _Tensor) and (getattr(spec, "symbolic_shape", None) is not None
                                      or -1 in tuple(spec.shape)):
        dims = []
        for d in getattr(spec, "symbolic_shape", None) or spec.shape:
            if isinstance(d, int) and d >= 0:
                dims.append(d)
            elif isinstance(d, dict):  # a mindspore.Symbol: its non-default fields (and
                # its id when unique=True: then one object is one size, as in MindSpore).
                # A unique=False Symbol carries no id: the same fields in one declaration
                # are taken as one Symbol (seed 003's input and label batch), so the trace
                # may use their equality, and every call checks it (_bind).
                key = d["id"] if "id" in d else tuple(sorted(d.items()))
                sym = ms_symbols.get(key)
                if sym is None:
                    sym = ms_symbols[key] = Symbol(
                        max=d.get("max", 0), min=d.get("min", 1), divisor=d.get("divisor", 1),
                        remainder=d.get("remainder", 0), unique="id" in d)
                dims.append(sym)
            else:  # None (-1): any size
                dims.append(Symbol())
        return ArrayType(tuple(dims), spec.dtype)
    if isinstance(spec, _Tensor):  # any other Tensor declares its (static) shape and dtype
        return ArrayType(tuple(int(d) for d in spec.shape), spec.dtype)
    raise ArgumentError(
        f"{where}: expected an fs.ArrayType, a MindSpore placeholder Tensor(shape=[...], "
        f"dtype=...) or None, got {type(spec).__name__} {spec!r}.\nFix: declare the "
        "argument as fs.ArrayType((fs.Symbol(divisor=8), 784), mindspore.float32), or pass "
        "None to take its shape from each call.")


def declared_types(specs, where: str, skip: int = 0) -> tuple:
    """Input declarations (one per argument: an ``fs.ArrayType``, a MindSpore placeholder
    Tensor, a pytree of them, or None) as ArrayTypes (``set_inputs`` of ``fs.jit``,
    ``fs.shard`` and ``fs.AutoParallel``). One ``mindspore.Symbol`` object with
    ``unique=True`` is one fshard Symbol across all of them. Errors count the
    arguments from the ``skip``-th (the first one a caller passes)."""
    ms_symbols: dict = {}

    def convert(spec, where):
        if spec is None:
            return None
        if isinstance(spec, (ArrayType, _Tensor)):
            return _spec_type(spec, where, ms_symbols)
        if isinstance(spec, (tuple, list, dict)):
            items = spec.items() if isinstance(spec, dict) else enumerate(spec)
            out = {k: convert(v, f"{where}[{k!r}]") for k, v in items}
            return out if isinstance(spec, dict) else type(spec)(out.values())
        return _spec_type(spec, where, ms_symbols)  # raises, naming the entry

    return tuple(convert(spec, f"{where}: argument {i - skip}")
                 for i, spec in enumerate(specs))


def _bind(name: str, what: str, avals, values, sizes: dict, names=None) -> dict:
    """Check ``values`` against ``avals``, binding each Symbol to the size it meets
    (``sizes``: Symbol -> (size, where)); an fshard error names the mismatch (as input
    ``k``, or as ``names()[k]``: names are only worked out for an error)."""
    if len(values) != len(avals):
        raise ShapeError(
            f"{name}: the compiled program takes {len(avals)} array {what}s, got "
            f"{len(values)}.\nFix: pass the flat arrays the program was lowered for.")

    def where(k):
        return f"{what} {k}" if names is None else names()[k]

    for k, (a, x) in enumerate(zip(avals, values)):
        t = typeof(x)
        if t.dtype != a.dtype or t.ndim != a.ndim:
            raise ShapeError(
                f"{name}: {where(k)} has type {t}, but the program was compiled for {a}.\n"
                f"Fix: pass a {a} (or call fs.jit({name}) directly, which compiles for "
                "each new type).")
        for d, (want, got) in enumerate(zip(a.shape, t.shape)):
            if isinstance(want, Symbol):
                if not want.accepts(got):
                    raise ShapeError(
                        f"{name}: {where(k)} has size {got} in dimension {d}, which "
                        f"{want.name} = {want!r} does not accept (size = divisor * N + "
                        "remainder, within [min, max]).\nFix: pad or trim that dimension to "
                        "a size the Symbol accepts.")
                bound = sizes.setdefault(want, (got, k, d))
                if bound[0] != got:
                    raise ShapeError(
                        f"{name}: {where(k)} has size {got} in dimension {d}, but the same "
                        f"{want.name} = {want!r} has size {bound[0]} in {where(bound[1])} "
                        f"dimension {bound[2]}; one Symbol object is one size in every place "
                        "it appears (a mindspore.Symbol with unique=False: the same fields in "
                        "one declaration).\nFix: make those dimensions equal, or declare them "
                        "with different Symbols (None for a dimension of its own size).")
            elif (dim_eval(want, {s: v[0] for s, v in sizes.items()}) if is_symbolic(want)
                  else want) != got:
                raise ShapeError(
                    f"{name}: {where(k)} has shape {tuple(t.shape)}, but the program was "
                    f"compiled for {a}: dimension {d} must be {want}.\nFix: pass that "
                    f"shape, or declare the dimension with fs.Symbol(...) when lowering.")
    return sizes


def bind_declared(name: str, what: str, avals, values) -> dict:
    """Check ``values`` against declared ``avals`` (an fshard error names the first
    mismatch); returns the sizes the Symbols take."""
    return _bind(name, what, avals, values, {})


def _last_computed(program) -> int | None:
    """Which output the graph computes last (None: fewer than two outputs, or not on
    CPU, where waiting would copy device memory to the host)."""
    if len(program.outputs) < 2 or backend.ms.get_context("device_target") != "CPU":
        return None
    return _last_output(program)


#: The equations whose lowering in a job joins the chain of collectives (a
#: ``shard_out`` gathers a split result).
_SEQUENCED = COLLECTIVES + (shard_out_p,)


def _last_output(program, sequenced: bool = True) -> int | None:
    """The output at the end of the longest chain of equations (MindSpore's runtime
    runs an equation once its operands are ready, so program order says little: an
    optimizer's last update in program order may be ready long before the gradient
    that backpropagation computes last); ties go to the later one in program order.
    In a job (``sequenced``) the lowering chains a program's collectives in program
    order (each waits for the previous one, so that every rank issues them in the same
    order): a collective ends after the one before it, whatever its operands. On a
    virtual mesh a per-device program's collectives become sums and gathers of the
    devices' lanes, which run as soon as their operands are ready: the data-parallel
    ``value_and_grad`` of an MLP, whose AllReduces the partitioner places at the
    outputs in output order, waited on the last layer's gradient (computed first) and
    ran 16 ms a call against 6 ms waiting on the first layer's."""
    depth: dict = {}
    defined: dict = {}
    chain = 0  # the depth of the last collective so far
    for i, eq in enumerate(program.equations):
        d = 1 + max((depth.get(a, 0) for a in eq.inputs if isinstance(a, Var)), default=0)
        if sequenced and eq.prim in _SEQUENCED:
            d = chain = max(d, chain + 1)
        for k, v in enumerate(eq.outputs):
            depth[v], defined[v] = d, (i, k)
    where = [defined.get(a, (-1, -1)) if isinstance(a, Var) else (-1, -1)
             for a in program.outputs]
    last = max(range(len(where)), key=lambda j: (
        depth.get(program.outputs[j], 0) if where[j][0] >= 0 else -1, where[j][0]))
    if where[last][0] < 0:
        return None
    eq = program.equations[where[last][0]]
    # All outputs of one call equation (e.g. a shard_call): look inside the program
    # it executes.
    plan = eq.params.get("plan")
    body = getattr(plan, "executed", None)
    if body is not None and all(w[0] == where[last][0] for w in where):
        inner = _last_output(body, sequenced=getattr(plan, "world", None) is not None)
        if inner is not None:
            for j, w in enumerate(where):
                if w[1] == inner:
                    return j
    return last


def _leaf_key(x):
    if isinstance(x, ShardedArray):  # this process's block: the layout is in the key
        return (x.shape, x.dtype, x.sharding, x.mesh)
    if type(x) is _Tensor:
        return (x.shape, x.dtype)  # Tensor.shape is already a tuple
    if isinstance(x, np.ndarray):  # the same key as the Tensor it becomes: no retrace
        return (x.shape, dtypes.from_numpy(x.dtype))
    shape = getattr(x, "shape", None)
    if shape is not None:
        return (tuple(shape), x.dtype)
    return (type(x),)


def _call_key(leaves, in_tree) -> tuple:
    """The key of ``Jitted._calls``: a call without static arguments or declarations."""
    return (in_tree, tuple([(x.shape, x.dtype) if type(x) is _Tensor else _leaf_key(x)
                            for x in leaves]), None, _mesh_key())


class Jitted:
    """The result of ``fs.jit(f)``: call it, ``lower`` it, count its traces."""

    def __init__(self, fun, static_argnums=(), static_argnames=(), donate_argnums=(),
                 donate_argnames=()):
        if isinstance(static_argnums, int):
            static_argnums = (static_argnums,)
        if isinstance(static_argnames, str):
            static_argnames = (static_argnames,)
        self.fun = fun
        self.static_argnums = tuple(static_argnums)
        self.static_argnames = tuple(static_argnames)
        self.trace_count = 0
        self._in_shapes = None   # one declaration per positional argument (set_inputs)
        self._annotated = None   # or: declarations read from jaxtyping annotations
        self._cache: dict = {}   # key -> Lowered
        self._calls: dict = {}   # key -> Compiled, for signatures without static arguments
        self._static = bool(self.static_argnums or self.static_argnames)
        # Accepted for JAX's API: MindSpore 2.10 cannot reuse an input's memory for an
        # output, so a donated argument stays valid (docs/jit.md).
        self.donate_argnums, self.donate_argnames = donate_argnums, donate_argnames
        functools.update_wrapper(self, fun, updated=())

    def set_inputs(self, *specs) -> "Jitted":
        """Declare the inputs' shapes, MindSpore's way: one entry per positional argument,
        an ``fs.ArrayType`` or a MindSpore placeholder ``Tensor(shape=[s0, 784], dtype=...)``
        (a pytree of them for a pytree argument) with ``fs.Symbol``/``mindspore.Symbol``/
        None dimensions, or None (the argument's shapes come from each call). Every call
        whose shapes satisfy the declarations then runs one program, traced and compiled
        once; a call that does not is an fshard error. Returns ``self``."""
        self._in_shapes = declared_types(specs, f"{self!r}.set_inputs",
                                         getattr(self.fun, "supplied_args", 0))
        return self

    @property
    def compile_count(self) -> int:
        """How many MindSpore graphs this function has compiled (a graph with dynamic
        shapes compiles once for every size its Symbols accept)."""
        return sum(low._compiled.compiles for low in self._cache.values()
                   if low._compiled is not None)

    def _prepare(self, args, kwargs):
        if self.static_argnums or self.static_argnames:
            dyn_args, dyn_kwargs, skey, rebuild = split_static(
                self.fun, args, kwargs, self.static_argnums, self.static_argnames)
        else:
            dyn_args, dyn_kwargs, skey, rebuild = args, kwargs, None, None
        leaves, in_tree = tree.flatten((dyn_args, dyn_kwargs))
        specs = self._annotated.declare(args) if self._annotated else self._in_shapes
        declared = self._declared(specs, args, dyn_args, dyn_kwargs) if specs else None
        if declared is None:
            key = (in_tree, tuple([_leaf_key(x) for x in leaves]), skey, _mesh_key())
        else:  # a declared argument is keyed by its declaration, not its shape
            key = (in_tree, tuple([_leaf_key(x) if a is None else ("declared", id(a))
                                   for x, a in zip(leaves, declared)]), skey, _mesh_key())
        return key, leaves, in_tree, rebuild, declared

    def _declared(self, declarations, args, dyn_args, dyn_kwargs) -> list:
        """The declared ArrayType (or None) of every array leaf of the dynamic arguments."""
        static = {i if i >= 0 else len(args) + i for i in self.static_argnums}
        specs = list(declarations) + [None] * (len(args) - len(declarations))
        if len(declarations) > len(args):
            raise ArgumentError(
                f"{self!r} declares {len(declarations)} inputs with set_inputs, but was "
                f"called with {len(args)} positional arguments.\nFix: pass every declared "
                "argument positionally.")
        prefix = (tuple(sp for i, sp in enumerate(specs) if i not in static),
                  {k: None for k in dyn_kwargs})
        try:
            out = tree.broadcast_prefix(prefix, (dyn_args, dyn_kwargs),
                                        is_leaf=lambda v: isinstance(v, ArrayType))
        except ValueError as e:
            raise ArgumentError(
                f"{self!r}: the set_inputs declarations do not match the arguments' "
                f"structure: {e}.\nFix: declare each argument with one entry (or a pytree "
                "of entries shaped like it).") from None
        return out

    def lower(self, *args, **kwargs) -> Lowered:
        key, leaves, in_tree, rebuild, declared = self._prepare(args, kwargs)
        return self._lower(key, leaves, in_tree, rebuild, declared)

    def _lower(self, key, leaves, in_tree, rebuild, declared=None) -> Lowered:
        lowered = self._cache.get(key)
        if lowered is None:
            self.trace_count += 1
            avals = [typeof(x) for x in leaves]
            if declared is not None:
                avals = [_declared_type(self, k, a, t) for k, (a, t) in
                         enumerate(zip(declared, avals))]
            traced = trace_fun(self.fun, in_tree, avals, rebuild)
            if self._annotated is not None:
                self._annotated.check_return(traced.program.out_avals, traced.out_tree)
            # the IR cleanup passes (fshard/primitives/passes.py) run on what is compiled only:
            # make_ir and .program show the staged Program as traced
            program = passes.simplify(traced.program)
            # what reads only constants (never a Parameter) computed now, not by
            # MindSpore's compiler, which does not finish on some such chains
            program, consts = passes.fold_constants(
                program, traced.consts, lambda c: not isinstance(c, backend.Parameter))
            # In a job: fs.ShardedArray inputs are taken as blocks, and shard calls asked
            # to keep their split outputs as blocks return them (transforms/shard_call.py).
            sig = local_signature(leaves)
            program, out_info = localize(program, {program.n_consts + k: v
                                                   for k, v in sig.items()})
            local = None if not sig and not any(out_info) else (program, out_info)
            program, consts, params = lift_parameters(program, consts)
            src, globals_, n_out = backend.lower_program(passes.implicit_broadcasts(program),
                                                         consts, traced.name,
                                                         return_effect=True)
            lowered = Lowered(traced, src, globals_, n_out, _last_computed(program), local,
                              program, params)
            self._cache[key] = lowered
        return lowered

    def __call__(self, *args, **kwargs):
        try:
            return self._call(args, kwargs)
        except ParameterChanged as e:
            # a Parameter the function closes over changed shape or dtype: trace again
            for cache in (self._calls, self._cache):
                for k in [k for k, v in cache.items()
                          if v is e.compiled or getattr(v, "_compiled", None) is e.compiled]:
                    del cache[k]
            return self._call(args, kwargs)

    def _call(self, args, kwargs):
        if type(current_trace()) is not EvalTrace:
            return self.fun(*args, **kwargs)  # inlined into the enclosing transform
        if context.jit_disabled.get():
            return self._eager(args, kwargs)
        if self.donate_argnums and len(args) <= max(self.donate_argnums):
            _check_donated(self, len(args))
        if self._in_shapes is not None or self._annotated is not None:
            # declared shapes: every call is checked
            key, leaves, in_tree, rebuild, declared = self._prepare(args, kwargs)
            lowered = self._cache.get(key) or self._lower(key, leaves, in_tree, rebuild,
                                                          declared)
            names = None if self._static else (lambda: _input_names(self.fun, args, kwargs))
            return (lowered._compiled or lowered.compile())(*leaves, names=names)
        if not self._static:
            # the hot path of a cached call: one flatten, one key, one dict lookup
            leaves, in_tree = tree.flatten((args, kwargs))
            key = _call_key(leaves, in_tree)
            compiled = self._calls.get(key)
            if compiled is None:
                lowered = self._lower(key, leaves, in_tree, None)
                compiled = self._calls[key] = lowered._compiled or lowered.compile()
            return compiled.call_leaves(leaves)
        key, leaves, in_tree, rebuild, _ = self._prepare(args, kwargs)
        lowered = self._cache.get(key)
        if lowered is None:
            lowered = self._lower(key, leaves, in_tree, rebuild)
        compiled = lowered._compiled or lowered.compile()
        return compiled.call_leaves(leaves)

    def compiled_for(self, *args):
        """The compiled program a call with ``args`` ran (``Compiled``: ``call_leaves``
        takes the arguments' flat leaves), or None when there is none or calls with
        them are checked each time (declared shapes, static arguments). A caller that
        keys its own calls can run it directly, without this function's flatten and
        key; a ``ParameterChanged`` it raises means: call this function instead."""
        if self._static or self._in_shapes is not None or self._annotated is not None:
            return None
        leaves, in_tree = tree.flatten((args, {}))
        return self._calls.get(_call_key(leaves, in_tree))

    def _eager(self, args, kwargs):
        """``fun`` run op by op (``fs.disable_jit``): its array arguments as Tensors, as
        a compiled call would take them; static arguments as they are."""
        static = {i if i >= 0 else len(args) + i for i in self.static_argnums}
        args = tuple(a if i in static else tree.map(_as_eager, a) for i, a in enumerate(args))
        kwargs = {k: v if k in self.static_argnames else tree.map(_as_eager, v)
                  for k, v in kwargs.items()}
        return self.fun(*args, **kwargs)

    def __repr__(self) -> str:
        return f"fs.jit({fun_name(self.fun)})"


def _as_eager(x):
    return backend.as_tensor(x) if isinstance(x, np.ndarray) else x


def _check_donated(jitted, nargs: int) -> None:
    bad = [i for i in jitted.donate_argnums if i >= nargs]
    if bad:
        raise ArgumentError(
            f"{jitted!r}: donate_argnums={jitted.donate_argnums} names argument "
            f"{bad[0]}, but the function was called with {nargs} positional "
            f"argument{'s' if nargs != 1 else ''}.\nFix: pass that argument positionally, "
            "or drop it from donate_argnums.")


@contextlib.contextmanager
def disable_jit(disable: bool = True):
    """Inside this block ``fs.jit`` functions run op by op, uncompiled (NB:
    ``jax.disable_jit``): each operation runs eagerly on MindSpore Tensors, so Python
    ``print`` and a debugger see values, and an error points at the line that raised it.

    >>> import numpy as np, fshard as fs
    >>> @fs.jit
    ... def f(x):
    ...     print("running with", type(x).__name__)
    ...     return x * 2.0
    >>> with fs.disable_jit():
    ...     y = f(np.ones(2, np.float32))
    running with Tensor
    >>> f.trace_count  # nothing was traced or compiled
    0

    Args:
        disable: False makes the block a no-op (jit as usual), e.g.
            ``fs.disable_jit(debugging)``.

    Only ``fs.jit`` is affected: ``fs.shard``, ``fs.vmap`` and the ``grad`` family
    still trace (they are not compilers), and a jitted function called inside another
    transform is inlined into it as always. The setting is per thread (a contextvar).
    """
    if not isinstance(disable, bool):
        raise ArgumentError(
            f"fs.disable_jit(disable=...) must be a bool; got {type(disable).__name__} "
            f"{disable!r}.\nFix: fs.disable_jit() or fs.disable_jit(False).")
    with context.setting(context.jit_disabled, disable):
        yield


def _argnums(api: str, name: str, value) -> tuple:
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ArgumentError(
            f"{api}({name}=...) must be a non-negative int or a tuple of them (argument "
            f"positions); got {value!r}.\nFix: e.g. {name}=(0,).")
    return tuple(sorted(set(value)))


def check_donation(api: str, fun, donate_argnums, donate_argnames, static_argnums,
                   static_argnames) -> tuple[tuple, tuple]:
    """``(donate_argnums, donate_argnames)`` checked: positions or parameter names of
    ``fun``, none of them static (a static argument is a Python value: nothing to
    donate)."""
    nums = _argnums(api, "donate_argnums", donate_argnums)
    if isinstance(donate_argnames, str):
        donate_argnames = (donate_argnames,)
    if not isinstance(donate_argnames, (tuple, list)) or not all(
            isinstance(n, str) for n in donate_argnames):
        raise ArgumentError(
            f"{api}(donate_argnames=...) must be a str or a tuple of str (parameter "
            f"names); got {donate_argnames!r}.")
    check_static_args(api, fun, (), donate_argnames)  # the names exist
    both = sorted(set(nums) & {i for i in static_argnums if i >= 0}) or sorted(
        set(donate_argnames) & set(static_argnames))
    if both:
        raise ArgumentError(
            f"{api}: argument {both[0]!r} is both static and donated; a static argument "
            "is a Python value, with no array memory to donate.\nFix: drop it from "
            "donate_argnums/donate_argnames (or from static_argnums/static_argnames).")
    return nums, tuple(donate_argnames)


def _input_names(fun, args, kwargs) -> list[str]:
    """``args[1] (parameter 'x')``-style names of the array leaves of a call (counted
    as its caller counts them: a Cell's parameters, which fshard supplies, are named
    as such)."""
    import inspect

    try:
        params = list(inspect.signature(fun).parameters)
    except (TypeError, ValueError):
        params = []
    skip = getattr(fun, "supplied_args", 0)
    out = []
    for path in tree.flatten_with_path((tuple(args), kwargs))[0]:
        if path and path[0] == 0 and len(path) > 1:
            i = path[1]
            if i < skip:
                out.append(f"the Cell's parameter {tree.keystr(path[2:])}")
                continue
            arg = f"args[{i - skip}]" + tree.keystr(path[2:])
            out.append(f"{arg} (parameter '{params[i]}')" if i < len(params) else arg)
        else:
            out.append("kwargs" + tree.keystr(path[1:]))
    return out


def _declared_type(jitted, k: int, declared, got: ArrayType) -> ArrayType:
    """The type input ``k`` is traced with: its declaration (checked against the first
    call's dtype and rank), or its own type."""
    if declared is None:
        return got
    if declared.dtype != got.dtype or declared.ndim != got.ndim:
        raise ShapeError(
            f"{jitted!r}: input {k} has type {got}, but set_inputs declared {declared}.\n"
            f"Fix: pass a {dtypes.short_name(declared.dtype)} array of rank "
            f"{declared.ndim}, or change the declaration.")
    return declared


class _Omitted:
    """The default of ``jit``'s ``fun``: ``fs.jit(static_argnums=...)`` without a
    function returns a decorator (an explicit ``None`` is an error)."""

    def __repr__(self) -> str:
        return "<omitted: a decorator>"


_DECORATOR = _Omitted()


def jit(fun=_DECORATOR, *, static_argnums=(), static_argnames=(), in_shapes=None,
        donate_argnums=(), donate_argnames=()):
    """Compile ``fun`` into one MindSpore GRAPH-mode program per input signature
    (``fs.jit``, which adds ``in_shardings``/``out_shardings``, documents the rest).

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
        in_shapes: declared input shapes, one entry per positional argument, as for
            ``set_inputs`` (``fs.Symbol`` dimensions: one program for every size).
        donate_argnums, donate_argnames: arguments whose memory the caller gives up
            (JAX's); checked, but MindSpore 2.10 cannot reuse it: they stay valid.

    Returns:
        a callable with ``.lower(*args)`` (``.as_text()``, ``.compile()``) and
        ``.trace_count``.

    See also: ``fs.make_ir``; docs/jit.md.
    """
    if fun is _DECORATOR:  # @fs.jit(static_argnums=...) as a decorator factory
        def decorate(f):
            check_function("fs.jit", f)
            return jit(f, static_argnums=static_argnums, static_argnames=static_argnames,
                       in_shapes=in_shapes, donate_argnums=donate_argnums,
                       donate_argnames=donate_argnames)

        return decorate
    from fshard.adapter.cells import is_cell, maybe_cell

    check_function("fs.jit", fun)
    static_argnums, static_argnames = check_static_args(
        "fs.jit", fun.construct if is_cell(fun) else fun, static_argnums, static_argnames)
    donate_argnums, donate_argnames = check_donation(
        "fs.jit", fun.construct if is_cell(fun) else fun, donate_argnums, donate_argnames,
        static_argnums, static_argnames)
    if is_cell(fun):  # the Cell's parameters become argument 0
        static_argnums = tuple(i + 1 if i >= 0 else i for i in static_argnums)
        donate_argnums = tuple(i + 1 for i in donate_argnums)
    if in_shapes is not None and in_shapes != "annotations" and not isinstance(
            in_shapes, (tuple, list)):
        raise ArgumentError(
            f"fs.jit(in_shapes=...) must be a tuple with one entry per positional argument, "
            f"or 'annotations', got {type(in_shapes).__name__}.\nFix: in_shapes=("
            "spec_of_arg0, spec_of_arg1, ...), or in_shapes='annotations' to read jaxtyping "
            "annotations.")

    def make(f):
        out = Jitted(f, static_argnums, static_argnames, donate_argnums, donate_argnames)
        if in_shapes == "annotations":
            if is_cell(fun):
                raise ArgumentError(
                    "fs.jit(cell, in_shapes='annotations'): a Cell's declarations are given "
                    "with set_inputs.\nFix: fs.jit(cell).set_inputs(Tensor(shape=[None, "
                    "784], dtype=...)).")
            out._annotated = AnnotatedShapes(fun, fun_name(fun))
            return out
        # a Cell's parameters (argument 0) take their shapes from the Cell; a Cell's
        # own cell.set_inputs(...) (MindSpore's) declares its inputs when in_shapes does not
        declared = in_shapes
        if declared is None and is_cell(fun):
            declared = backend.cell_declared_inputs(fun)
        return out if declared is None else out.set_inputs(
            *(((None,) if is_cell(fun) else ()) + tuple(declared)))

    return maybe_cell(fun, make)
