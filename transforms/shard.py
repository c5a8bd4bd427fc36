"""``fs.shard``: MindSpore's functional operator sharding, on any backend (the user API).

``shard(fn, in_strategy, ...)`` stages ``fn`` on global shapes, parses each strategy
(fshard/sharding/strategy.py) and binds one ``shard_call`` equation
(transforms/shard_call.py) whose ``ShardPlan`` (fshard/sharding/plan.py) does the rest:
propagation, partitioning into the per-device Program, and its run on a virtual mesh
or on this rank of a multi-process job. What stays here is what users touch: argument
and strategy checks, Cells and their ``parameter_plan``, strategy files, and the
composition rules (``shard`` sits outside ``vmap`` and cannot nest). docs/shard.md is
the user guide.
"""

from __future__ import annotations

import functools
import warnings

from fshard.core import context, tree
from fshard.meshes import distributed
from fshard.sharding import user_layouts
from fshard.core.gcpause import paused_gc
from fshard.core.tracing import EvalTrace, Tracer, current_trace, typeof
from fshard.errors import CompositionError, OperatorStrategyWarning, ShardingError
from fshard.adapter.cells import parameters
from fshard.adapter.interop import (CELL_SHARD_ATTR, context_dataset_strategy, context_mesh,
                                    context_search, register_cell_shard)
from fshard.core.ir import Equation, Program, Var
from fshard.primitives.generic import assign, ms_op_p
from fshard.primitives.structural import stop_gradient_p
from fshard.sharding.explain import explain as explain_plan
from fshard.sharding.layouts import ShardMesh, Sharding
from fshard.sharding.partition import Partitioned
from fshard.sharding.placement import placed_strategy
from fshard.sharding.plan import ShardPlan, read_strategy_file, write_json_atomic
from fshard.sharding.runtime import world_mesh
from fshard.sharding.strategy import (argument_strategies, is_count, is_strategy_leaf,
                                      parse_strategy, plural)
from fshard.core.staging import fun_name, trace_fun
from fshard.sharding import local_batch
from fshard.transforms.shard_call import shard_call_p


# ---------------------------------------------------------------------------
# The user API
# ---------------------------------------------------------------------------

_DEVICES = ("CPU", "GPU", "Ascend")


def _check_device(device, fname: str):
    """``device`` names where MindSpore runs ("CPU", "GPU", "Ascend", any case) or is None."""
    if device is None:
        return None
    names = {d.lower(): d for d in _DEVICES}
    if not isinstance(device, str) or device.lower() not in names:
        raise ShardingError(
            f"shard({fname}): device must be 'CPU', 'GPU', 'Ascend' or None; got "
            f"{device!r}.\nFix: pass the device MindSpore runs on, or None to use it.")
    device = names[device.lower()]
    import mindspore as ms

    target = ms.get_context("device_target")
    if device != target:
        raise ShardingError(
            f"shard({fname}): device={device!r} is not available: MindSpore runs on "
            f"{target!r} here (mindspore.get_context('device_target')).\nFix: pass "
            f"device={target!r} or None, or run where {device} devices exist and call "
            f"mindspore.set_device({device!r}) first.")
    return device


def _device_count(mesh, fname: str) -> int:
    """The number of devices: ``mesh`` (an int or fs.Mesh), else the mesh in effect."""
    from fshard.meshes.mesh import Mesh, resolve_mesh

    if mesh is None:
        return resolve_mesh(None).size
    if isinstance(mesh, Mesh):
        return mesh.size
    if is_count(mesh) and mesh >= 1:
        return int(mesh)
    raise ShardingError(
        f"shard({fname}): mesh must be an fs.Mesh, a positive device count, or None; got "
        f"{type(mesh).__name__} {mesh!r}.\nFix: mesh=8 or mesh=fs.Mesh((2, 4), ('dp', 'mp')).")


def _closure_unchanged(traced) -> bool:
    """Whether the arrays ``traced`` closes over still have the types it was traced
    with: ``set_data`` may give a Parameter another shape (then the function is traced
    and planned again)."""
    prog = traced.program
    return all(isinstance(c, Tracer) or typeof(c) == v.aval
               for c, v in zip(traced.consts, prog.inputs[:prog.n_consts]))


def _devices_and_place(mesh, fname: str, groups: int = 1) -> tuple[int, bool]:
    """``(device count, whether the devices are this multi-process job's ranks)``;
    ``groups``: the job's processes form that many equal groups of devices (see
    ``Sharded.process_groups``)."""
    from fshard.meshes import distributed
    from fshard.meshes.mesh import Mesh, resolve_mesh

    n = _device_count(mesh, fname)
    if isinstance(mesh, Mesh):
        in_job = not mesh.is_virtual
    elif mesh is None:
        in_job = not resolve_mesh(None).is_virtual
    else:
        in_job = distributed.is_initialized()
    if in_job and n * groups != distributed.world_size():
        raise ShardingError(
            f"shard({fname}): the mesh has {n} devices but this job has "
            f"{distributed.world_size()} processes (one device each).\nFix: use a mesh of "
            f"{distributed.world_size()} devices, or fs.Mesh(..., virtual=True) to simulate "
            "it in each process.")
    return n, in_job



def _arg_names(fn) -> list[str]:
    import inspect

    try:
        target = fn.construct if hasattr(fn, "construct") else fn
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


class Sharded:
    """The callable returned by ``fs.shard`` (see ``shard``).

    Besides calling it: ``partitioned(*args)`` gives the per-device program,
    ``strategies(*args)`` the strategy of every value (a strategy file's content),
    ``save_strategies(path, *args)`` / ``load_strategies(path)`` write and reuse them.
    """

    def __init__(self, fn, in_strategy, out_strategy, parameter_plan, device, level, mesh,
                 dataset_strategy, search, gather_outputs=True):
        fname = fun_name(fn)
        from fshard.adapter.cells import functional, is_cell

        if not callable(fn):
            raise ShardingError(
                f"fs.shard expects a function or an nn.Cell; got {type(fn).__name__} {fn!r}.")
        if type(level) is not int or level not in (0, 1, 2):
            raise ShardingError(
                f"shard({fname}): level must be 0 (best compute/communication ratio), 1 "
                f"(least memory) or 2 (fastest); got {level!r}.\nFix: pass level=0, 1 or 2.")
        # MindSpore's auto-parallel context fills what the call leaves unsaid.
        self._dataset_given = dataset_strategy is not None
        if dataset_strategy is None:
            dataset_strategy = context_dataset_strategy(
                f"shard({fname})", allow_tuple=False) or "full_batch"
        if search is None:
            search = bool(context_search(f"shard({fname})"))
        if not isinstance(search, bool):
            raise ShardingError(
                f"shard({fname}): search must be True (plan the whole program with "
                f"fshard's search) or False (propagation only); got {search!r}.")
        if not isinstance(gather_outputs, bool):
            raise ShardingError(
                f"shard({fname}): gather_outputs must be True (every process gets the "
                "global outputs) or False (in a multi-process job, split outputs stay "
                f"fs.ShardedArray blocks); got {gather_outputs!r}.")
        if dataset_strategy not in ("full_batch", "data_parallel"):
            raise ShardingError(
                f"shard({fname}): dataset_strategy must be 'full_batch' (inputs and outputs "
                "whole) or 'data_parallel' (inputs and outputs split along the batch); got "
                f"{dataset_strategy!r}.")
        if not isinstance(in_strategy, (tuple, list)):
            raise ShardingError(
                f"shard({fname}): in_strategy must be a tuple with one entry per positional "
                f"argument; got {type(in_strategy).__name__} {in_strategy!r}.\nFix: e.g. "
                "in_strategy=((4, 2), None, None).")
        self.device = _check_device(device, fname)
        mesh = context_mesh(mesh, f"shard({fname})")
        if mesh is None:  # made inside `with fs.Mesh(...)`: keep that mesh
            from fshard.meshes.mesh import current_mesh

            mesh = current_mesh()
        else:
            _device_count(mesh, fname)
        self.fn, self.in_strategy, self.out_strategy = fn, tuple(in_strategy), out_strategy
        self.parameter_plan, self.level, self.mesh = parameter_plan, level, mesh
        self.dataset_strategy, self.search = dataset_strategy, search
        self.gather_outputs = gather_outputs
        # The rewrite bucketing the per-device AllReduces, ``(Partitioned) -> Program``
        # (``fs.AutoParallel``'s ``comm_fusion``); None: in a job, buckets the
        # AllReduces and the AllGathers by the job's rates (``plan.bucket_collectives``),
        # on a virtual mesh one per value; False: one per value.
        self.comm_fusion = None
        self.passes = ()  # rewrites of the per-device program (fs.AutoParallel's)
        # The first ``carried`` output leaves are the next call's first ``carried``
        # argument leaves (fs.AutoParallel's train state): a tuple strategy given to
        # both takes the same mesh axes on both sides, so no step redistributes it.
        self.carried = 0
        # Pairs (argument leaf, argument leaf it copies): a copy left to the plan takes
        # the layout of the value it copies (an optimizer moment, its parameter's).
        self.copies = ()
        # ``(axis name, count)``: in a job, the devices are one of ``count`` equal groups
        # of the processes (consecutive ranks), this process's group, and all
        # communication stays inside it (a pipeline stage's devices); None: the world.
        self.process_groups = None
        self._cache: dict = {}
        self._fixed = None
        self._cell = None
        self._param_plan: dict = {}
        self._arg_names = _arg_names(fn)
        self._dynamic = None  # fs.jit of this function with declared shapes (set_inputs)
        if is_cell(fn):
            self._cell = fn
            self._apply, _ = functional(fn)
            self._param_plan = _resolve_parameter_plan(fn, parameter_plan, fname)
        elif parameter_plan:
            raise ShardingError(
                f"shard({fname}): parameter_plan applies to the parameters of an nn.Cell, "
                f"but {fname} is a function.\nFix: pass the function's arrays as arguments "
                "and give their strategies in in_strategy.")
        functools.update_wrapper(self, fn, updated=())

    # -- tracing -----------------------------------------------------------
    def _what(self, i: int, path, x) -> str:
        name = self._arg_names[i] if i < len(self._arg_names) else None
        label = f"argument {name!r}" if name else f"argument {i}"
        return f"{label}{tree.keystr(path)} ({typeof(x)})"

    def _flat_call(self, args):
        """(function of flat leaves, leaves, per-leaf (entry, where, what), in_tree)."""
        fname = fun_name(self.fn)
        if len(args) != len(self.in_strategy):
            hint = ""
            if self.in_strategy and all(is_count(c) for c in self.in_strategy):
                hint = (f" For one argument, write in_strategy=({self.in_strategy!r},) "
                        "(a tuple of strategies).")
            raise ShardingError(
                f"shard({fname}): in_strategy has "
                f"{plural(len(self.in_strategy), 'entry', 'entries')}, but {fname} was "
                f"called with {plural(len(args), 'positional argument', 'positional arguments')}."
                "\nRule: in_strategy gives one strategy (or None) per positional argument."
                f"\nFix: give {plural(len(args), 'entry', 'entries')}; None lets "
                f"propagation choose.{hint}")
        entries = []
        for i, (a, s) in enumerate(zip(args, self.in_strategy)):
            paths, leaves_i, _, per_leaf = argument_strategies(f"shard({fname})", i, s, a)
            for p, x, e in zip(paths, leaves_i, per_leaf):
                entries.append((e, f"shard({fname}): in_strategy[{i}]{tree.keystr(p)}",
                                self._what(i, p, x), True))
        fn = self.fn
        if self._cell is not None:
            params = parameters(self._cell)
            order = tree.leaves({n: n for n in params})
            p_entries = []
            for n in order:
                key, strat = self._param_plan.get(n, (None, None))
                p_entries.append((strat, f"shard({fname}): parameter_plan[{key!r}]",
                                  f"parameter {n!r} ({typeof(params[n])})", False))
            entries = p_entries + entries
            args = (params,) + tuple(args)
            fn = self._apply
        leaves, in_tree = tree.flatten((tuple(args), {}))
        assert len(leaves) == len(entries), "one strategy per leaf"
        return fn, leaves, entries, in_tree

    def _prepare(self, args):
        fn, leaves, entries, in_tree = self._flat_call(args)
        plan, traced = self._plan(fn, leaves, entries, in_tree)
        return plan, traced, leaves

    @property
    def __fshard_make_ir__(self):
        """What ``fs.make_ir`` shows for a sharded function: its per-device program."""
        return self.partitioned

    def partitioned(self, *args) -> Partitioned:
        """The per-device program for these arguments (print it to read it).

        Its ``collectives()`` lists the communication, ``strategies()`` the layouts.
        """
        return self._prepare(args)[0].partitioned()

    def explain(self, *args):
        """The plan for these arguments, per equation: the layouts chosen, the predicted
        compute and communication time, and the runner-up (print it; see
        ``fshard.sharding.explain``)."""
        part = self.partitioned(*args)
        return explain_plan(part.prop, fun_name(self.fn), fused=part.fused,
                            fused_gathers=part.fused_gathers)

    def _plan(self, fn, leaves, entries, in_tree):
        fname = fun_name(self.fn)
        groups = self.process_groups
        n, in_job = _devices_and_place(self.mesh, fname, groups[1] if groups else 1)
        # an argument left to propagation takes the strategy fs.device_put gave it
        entries = [(placed_strategy(x, n), f"shard({fname}): the fs.device_put placement "
                    f"of {what}", what, is_arg) if e is None and is_arg and
                   placed_strategy(x, n) is not None else (e, where, what, is_arg)
                   for (e, where, what, is_arg), x in zip(entries, leaves)]
        key = (in_tree, tuple((tuple(typeof(x).shape), typeof(x).dtype) for x in leaves), n,
               in_job, groups, tuple(placed_strategy(x, n) for x in leaves))
        hit = self._cache.get(key)
        if hit is not None and _closure_unchanged(hit[1]):
            return hit
        mesh = ShardMesh.for_devices(n)
        with context.counted(context.shard_depth), context.pushed(context.shard_devices, n), \
                paused_gc():
            traced = trace_fun(fn, in_tree, [typeof(x) for x in leaves])
        prog, writes = _hoist_writes(traced.program)
        avals = [v.aval for v in prog.inputs]
        n_c = prog.n_consts
        in_sh = [Sharding.replicated(a.ndim) for a in avals[:n_c]]
        flexible = [("in", n_c + k) for k, (e, *_) in enumerate(entries)
                    if isinstance(e, (tuple, list))]
        for (e, where, what, is_arg), a in zip(entries, avals[n_c:]):
            if e is None and is_arg and self.dataset_strategy == "data_parallel" and a.ndim:
                e = (n,) + (1,) * (a.ndim - 1)
                where = (f"shard({fname}): dataset_strategy='data_parallel' makes each "
                         "unannotated argument a batch slice per device, the strategy")
            in_sh.append(parse_strategy(e, a, mesh, where, what))
        n_out = len(prog.outputs) - len(writes)
        out_sh, out_flexible = self._out_shardings(
            Program(prog.inputs, prog.equations, prog.outputs[:n_out], prog.n_consts),
            mesh, fname, traced.out_tree)
        # the statistics written (whole on every device: the global batch's)
        out_sh += [Sharding.replicated(a.ndim) for a in prog.out_avals[n_out:]]
        flexible += [("out", k) for k in out_flexible]
        tied = [(("in", n_c + k), ("out", k)) for k in range(self.carried)]
        body = Program(prog.inputs, prog.equations, prog.outputs)
        plan = ShardPlan(body, in_sh, out_sh, mesh, self.level, fname, self.search,
                         self._fixed, world=world_mesh(mesh, groups) if in_job else None,
                         flexible=flexible, fusion=self.comm_fusion, tied=tied,
                         copies=[(n_c + a, n_c + b) for a, b in self.copies])
        plan.passes = self.passes
        plan.local_outputs = in_job and not self.gather_outputs
        plan.writes = tuple(writes)
        self._cache[key] = (plan, traced)
        return plan, traced

    def _out_shardings(self, prog, mesh, fname, out_tree):
        outs = prog.out_avals
        if self.out_strategy is None:
            if self.dataset_strategy == "data_parallel":
                return ([parse_strategy((mesh.size,) + (1,) * (a.ndim - 1), a, mesh,
                                       f"shard({fname}): dataset_strategy='data_parallel' "
                                       "splits each output along the batch, the strategy",
                                       f"output {k} ({a})") if a.ndim else
                        Sharding.replicated(0) for k, a in enumerate(outs)], [])
            return [Sharding.replicated(a.ndim) for a in outs], []
        strat = self.out_strategy
        shape = tree.unflatten(out_tree, [str(a) for a in outs])
        if out_tree.is_leaf():
            if isinstance(strat, (tuple, list)) and not is_strategy_leaf(strat):
                if len(strat) != 1:
                    raise ShardingError(
                        f"shard({fname}): out_strategy has {len(strat)} entries, but {fname} "
                        f"returns 1 array ({outs[0]}).\nRule: out_strategy gives one strategy "
                        "per output.\nFix: give one entry, e.g. out_strategy=((8, 1),), or "
                        "None for the default layout.")
                strat = strat[0]
            per_leaf = [strat]
        else:
            if isinstance(strat, (tuple, list)) and isinstance(shape, (tuple, list)) and \
                    not is_strategy_leaf(strat) and len(strat) != len(shape):
                raise ShardingError(
                    f"shard({fname}): out_strategy has {len(strat)} entries, but {fname} "
                    f"returns {len(shape)} outputs {shape}.\nRule: out_strategy gives one "
                    "strategy per output.\nFix: give one entry per output (None for the "
                    "default layout of that output).")
            try:
                per_leaf = tree.broadcast_prefix(strat, shape, is_leaf=is_strategy_leaf)
            except ValueError as e:
                raise ShardingError(
                    f"shard({fname}): out_strategy = {strat!r} does not match the outputs "
                    f"{shape}: {e}\nFix: give a pytree prefix of the outputs.") from None
        paths, _, _ = tree.flatten_with_path(shape)
        out = []
        for k, (s, a, p) in enumerate(zip(per_leaf, outs, paths)):
            sh = parse_strategy(s, a, mesh, f"shard({fname}): out_strategy{tree.keystr(p)}",
                                f"output {k} ({a})")
            # A carried output left unannotated takes its input's layout (ShardPlan).
            out.append(sh if sh is not None else
                       None if k < self.carried else Sharding.replicated(a.ndim))
        flexible = [k for k, s in enumerate(per_leaf) if isinstance(s, (tuple, list))]
        return out, flexible

    def set_inputs(self, *specs) -> "Sharded":
        """Declare the inputs' shapes, as ``fs.jit(f).set_inputs``: one entry per
        positional argument (an ``fs.ArrayType`` or a MindSpore placeholder
        ``Tensor(shape=[s0, 784], dtype=...)``, or None). A called sharded function then
        runs one program for every size the Symbols accept, partitioned and compiled
        once; the per-device program carries each split symbolic dimension as its own
        size (``s0/8``). Returns ``self``."""
        from fshard.transforms.jit import declared_types, jit

        specs = declared_types(specs, f"fs.shard({fun_name(self.fn)}).set_inputs")
        self._dynamic = jit(self).set_inputs(*specs)
        return self

    @property
    def trace_count(self) -> int:
        """Traces of the declared-shape program (0 without ``set_inputs``)."""
        return 0 if self._dynamic is None else self._dynamic.trace_count

    @property
    def compile_count(self) -> int:
        """MindSpore compiles of the declared-shape program (0 without ``set_inputs``)."""
        return 0 if self._dynamic is None else self._dynamic.compile_count

    # -- calling -------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        from fshard.transforms.vmap import inside_vmap

        if self._dynamic is not None and type(current_trace()) is EvalTrace:
            return self._dynamic(*args, **kwargs)  # called eagerly: the one program
        fname = fun_name(self.fn)
        if context.shard_depth.get() and context.shard_annotations.get():
            return self._annotate(fname, args, kwargs)
        if context.shard_annotations.get():
            # the loss of a pipeline whose stages have one device each: its own shard
            # would communicate with processes running other stages
            warnings.warn(OperatorStrategyWarning(
                f"fshard does not apply fs.shard({fname}, in_strategy="
                f"{self.in_strategy!r}) inside the loss: with AutoParallel.pipeline(...) "
                f"each stage here has one device, so there is nothing to split; {fname} "
                "runs as it is.\nFix: give the stages several devices each (a mesh of more "
                "devices than stages) to apply it; call the function without fs.shard to "
                "silence this."), stacklevel=2)
            return self.fn(*args, **kwargs)
        if inside_vmap():
            raise CompositionError(
                f"shard({fname}) is applied inside vmap, which fshard does not allow.\nRule: "
                "shard must sit outside vmap (as in MindSpore).\nAllowed form: "
                f"fs.shard(fs.vmap({fname}), in_strategy=...); refused: "
                f"fs.vmap(fs.shard({fname}, ...)).")
        if context.shard_depth.get():
            raise CompositionError(
                f"shard({fname}) is nested inside another fs.shard, which fshard does not "
                "allow.\nRule: shard cannot nest (as in MindSpore).\nAllowed form: one "
                "fs.shard around the whole computation; fix inner layouts with its "
                "in_strategy/out_strategy (or train with fs.AutoParallel, whose loss may "
                "call fs.shard to fix the layouts of a part: docs/shard.md).")
        if kwargs:
            raise ShardingError(
                f"shard({fname}) was called with keyword arguments {sorted(kwargs)}; a "
                "sharded function takes its arrays positionally (one in_strategy entry "
                "each).\nFix: pass them positionally.")
        fn, leaves, entries, in_tree = self._flat_call(args)
        groups = self.process_groups
        n, in_job = _devices_and_place(self.mesh, fname, groups[1] if groups else 1)
        # data_parallel in a job: each process passes its own slice of each unannotated
        # argument and gets its block of each unannotated output (local_batch.py).
        sliced = [in_job and self.dataset_strategy == "data_parallel" and e is None and
                  is_arg and typeof(x).ndim > 0 for (e, _, _, is_arg), x in zip(entries, leaves)]
        if any(sliced) and not groups:  # (a process group's copies may differ)
            local_batch.check_same_slices(
                [typeof(x).shape for s, x in zip(sliced, leaves) if s], f"shard({fname})")
        plan, traced = self._plan(fn, [local_batch.global_type(x, n) if s else x
                                       for s, x in zip(sliced, leaves)], entries, in_tree)
        if any(sliced):
            leaves = local_batch.place_inputs(plan.partitioned(), len(traced.consts), leaves,
                                              sliced, distributed.rank())
        outs = shard_call_p.bind(*traced.consts, *leaves, plan=plan)
        if any(sliced) and self.out_strategy is None:
            outs = local_batch.take_outputs(plan.partitioned(), outs, distributed.rank())
        if plan.writes:  # the writes the body made, into the caller's tensors
            outs, new = outs[:-len(plan.writes)], outs[-len(plan.writes):]
            operands = list(traced.consts) + list(leaves)
            for i, v in zip(plan.writes, new):
                assign(operands[i], v)
        # (an fs.ShardedArray output of data_parallel is already this process's rows)
        return tree.unflatten(traced.out_tree, outs)

    def _annotate(self, fname: str, args, kwargs, plan_taken: bool = False):
        """Called inside ``fs.AutoParallel``'s loss: ``fn`` traced inline, its arguments
        and results constrained to ``in_strategy``/``out_strategy`` (MindSpore's
        functional shard inside a network under semi-auto parallel). ``plan_taken``:
        the step's plan has this Cell's ``parameter_plan`` already (``cell.shard`` on
        a Cell of its network)."""
        n = context.shard_devices.get()[-1]
        why = None
        if kwargs:
            why = (f"it was called with keyword arguments {sorted(kwargs)}",
                   "pass the arrays positionally, one in_strategy entry each")
        elif self.parameter_plan and not plan_taken:
            why = ("it has a parameter_plan, which only an outermost fs.shard or a "
                   "cell.shard(...) on a Cell of the AutoParallel's network applies",
                   "give the parameters' strategies to AutoParallel.parameter_plan({...}), "
                   "or call cell.shard(..., parameter_plan=...) on the sub-Cell")
        elif self._dataset_given and self.dataset_strategy != "full_batch":
            # (one from MindSpore's context is the step's: the AutoParallel reads it)
            why = (f"it has dataset_strategy={self.dataset_strategy!r}, which only the "
                   "outermost step's batch can have",
                   "give it to AutoParallel.dataset_strategy(...)")
        elif self.mesh is not None and _device_count(self.mesh, fname) != n:
            why = (f"its mesh has {_device_count(self.mesh, fname)} devices but the "
                   f"AutoParallel step runs on {n}", "drop mesh= from the inner fs.shard")
        elif len(args) != len(self.in_strategy):
            why = (f"in_strategy has {plural(len(self.in_strategy), 'entry', 'entries')} "
                   f"but {fname} was called with "
                   f"{plural(len(args), 'positional argument', 'positional arguments')}",
                   "give one strategy (or None) per positional argument")
        if why is not None:
            raise ShardingError(
                f"shard({fname}) inside fs.AutoParallel's loss fixes the layouts of "
                f"{fname}'s arguments and results, but {why[0]}.\nFix: {why[1]}.")
        return user_layouts.annotated_call(self.fn, fname, args, self.in_strategy,
                                           self.out_strategy)

    # -- strategies ----------------------------------------------------------
    def strategies(self, *args) -> dict:
        """The strategy of every input, equation and output for these arguments: what
        MindSpore writes to a strategy file, plus the exact mesh axes.

        >>> import numpy as np, fshard as fs
        >>> f = fs.shard(lambda x: x * 2.0, in_strategy=((2, 1),), mesh=2)
        >>> f.strategies(np.ones((4, 3), np.float32))["inputs"][0]["strategy"]
        [2, 1]
        """
        out = self.partitioned(*args).strategies()
        out["function"] = fun_name(self.fn)
        return out

    def save_strategies(self, path, *args) -> dict:
        """Write ``strategies(*args)`` to ``path`` as JSON, atomically (a temporary file
        in the same directory, flushed and renamed: the previous file survives a
        failure); returns it."""
        data = self.strategies(*args)
        write_json_atomic(path, data, "strategy file")
        return data

    def load_strategies(self, path) -> "Sharded":
        """Use the strategies saved in ``path`` instead of propagating (the file is
        checked now; its fit to the program when called). Returns ``self``."""
        self._fixed = read_strategy_file(path)
        self._cache.clear()
        return self

    def __repr__(self) -> str:
        return f"fs.shard({fun_name(self.fn)})"


def _is_input_write(eq, origin: dict) -> bool:
    fn = eq.params.get("fn") if eq.prim is ms_op_p else None
    return (fn is not None and fn.call.name == "Assign" and fn.has_effect
            and isinstance(eq.inputs[0], Var) and eq.inputs[0] in origin
            and isinstance(eq.inputs[1], Var))


def _hoist_writes(program: Program) -> tuple[Program, list]:
    """``program`` without its ``Assign`` equations into its own inputs (BatchNorm's
    moving statistics in training mode), and the input indices written.

    Each written value becomes an extra output (after the others; the last write of an
    input wins), and a read of the input after its write reads the value instead, as
    MindSpore orders them. ``fs.shard`` writes the values into the caller's tensors
    after the sharded call, whole: inside the per-device program each device would
    write only its own block or copy of the input (on a virtual mesh, a temporary
    one), whereas these values are the same on every device (a batch statistic of a
    split batch is all-reduced) and equal the unsharded program's."""
    # input index of each input, and of its stop_gradient (a Cell's statistics under a
    # transform): the tensor an Assign into it writes
    origin = {v: i for i, v in enumerate(program.inputs)}
    alias: dict = {}
    written: dict = {}
    eqs = []
    for eq in program.equations:
        ins = [alias.get(a, a) if isinstance(a, Var) else a for a in eq.inputs]
        if eq.prim is stop_gradient_p and eq.inputs[0] in origin:
            origin[eq.outputs[0]] = origin[eq.inputs[0]]
        if _is_input_write(eq, origin):
            target, value = origin[eq.inputs[0]], ins[1]
            for v, i in origin.items():  # later reads of the tensor read the value
                if i == target:
                    alias[v] = value
            alias[eq.outputs[0]] = value
            written.pop(target, None)
            written[target] = value
            continue
        eqs.append(Equation(eq.prim, ins, eq.params, eq.outputs, eq.source)
                   if ins != list(eq.inputs) else eq)
    if not written:
        return program, []
    outputs = [alias.get(a, a) if isinstance(a, Var) else a for a in program.outputs]
    return (Program(program.inputs, eqs, outputs + list(written.values()),
                    program.n_consts, program.meta), list(written))


def _resolve_parameter_plan(cell, plan_, fname) -> dict:
    """parameter_plan keys -> ``{path inside the Cell: (key, strategy)}``.

    A key names a parameter by its path inside the sharded Cell (``'dense2.weight'``)
    or by its MindSpore name (``Parameter.name``, e.g. ``'block1.dense2.weight'`` for a
    sub-cell), either with a leading ``'self.'``. A key that names no parameter is an
    error (MindSpore skips it silently).
    """
    if not plan_:
        return {}
    if not isinstance(plan_, dict):
        raise ShardingError(
            f"shard({fname}): parameter_plan must be a dict {{parameter name: strategy}}; "
            f"got {type(plan_).__name__} {plan_!r}.")
    params = list(cell.parameters_and_names())
    by_name = {}
    for path, p in params:
        by_name.setdefault(path, path)
        by_name.setdefault(getattr(p, "name", path), path)
    out: dict = {}
    for key, strat in plan_.items():
        k = key[5:] if isinstance(key, str) and key.startswith("self.") else key
        path = by_name.get(k)
        if path is None:
            listing = ", ".join(path if p.name == path else f"{path} ({p.name})"
                                for path, p in params)
            raise ShardingError(
                f"shard({fname}): parameter_plan key {key!r} names no parameter of the "
                f"sharded {type(cell).__name__}.\nIts parameters (path inside the Cell, "
                f"and MindSpore name) are: {listing}.\nFix: use one of those names, "
                "optionally prefixed with 'self.'.")
        if path in out:
            raise ShardingError(
                f"shard({fname}): parameter_plan names the parameter {path!r} twice (as "
                f"{out[path][0]!r} and {key!r}).\nFix: keep one entry.")
        out[path] = (key, strat)
    return out


def shard(fn, in_strategy, out_strategy=None, parameter_plan=None, device=None, level=0,
          mesh=None, *, dataset_strategy=None, search=None, in_shapes=None,
          gather_outputs=True):
    """Shard ``fn`` over a mesh of devices (MindSpore's functional ``shard``).

    >>> import numpy as np, fshard as fs
    >>> from mindspore import ops
    >>> def dense_relu(x, w):
    ...     return ops.relu(ops.matmul(x, w))
    >>> x, w = np.ones((8, 4), np.float32), np.ones((4, 2), np.float32)
    >>> fs.shard(dense_relu, in_strategy=((4, 2), None), mesh=8)(x, w).shape
    (8, 2)

    The result equals ``fn``'s, whatever the strategies; only where the work and the
    communication happen changes. Inspect it with ``fs.make_ir(sharded)(*args)`` (the
    per-device program, with each value's layout and the collectives) and
    ``sharded.strategies(*args)``.

    Args:
        fn: a function of arrays (pytrees allowed) or an ``nn.Cell``.
        in_strategy: one entry per positional argument: split counts per dimension
            (``(4, 2)``: dim 0 in 4 parts, dim 1 in 2), an ``fs.Layout`` view, or None
            (derived by propagation). A product of split counts smaller than the device
            count leaves replicas. For a pytree argument, a pytree prefix of it.
        out_strategy: the same for the outputs (a pytree prefix of them); None:
            replicated (``full_batch``) or split along the batch (``data_parallel``).
        parameter_plan: for a Cell, ``{parameter name: strategy}``; names are paths
            inside the Cell or MindSpore names, optionally with ``'self.'``.
        device: "CPU", "GPU" or "Ascend" (checked against where MindSpore runs) or None.
        level: propagation objective: 0 compute/communication ratio, 1 least memory,
            2 fastest.
        mesh: an ``fs.Mesh`` or a device count; default: the ``with fs.Mesh`` block,
            the launcher's world, or ``FSHARD_DEVICES`` (``device_num`` of
            ``ms.set_auto_parallel_context``, when set, gives the count or is checked).
        dataset_strategy: "full_batch" (whole inputs, replicated outputs) or
            "data_parallel" (an unannotated argument is each device's batch slice; the
            outputs are split along the batch); default: the ``dataset_strategy`` (or
            ``full_batch``) of ``ms.set_auto_parallel_context`` if set, else
            "full_batch".
        search: refine propagation by a search over the whole program's cost; default:
            as ``ms.set_auto_parallel_context(parallel_mode="auto_parallel",
            search_mode=...)`` says ("recursive_programming": True), else False.
        in_shapes: declared input shapes with ``fs.Symbol`` dimensions, one entry per
            positional argument, as ``fs.jit``'s (``set_inputs`` is the same): every call
            whose shapes the Symbols accept runs one program, partitioned and compiled
            once; a split symbolic dimension must be provably divisible by its split
            count (docs/dynamic_shapes.md).
        gather_outputs: in a multi-process job, True (default) gives every process the
            global value of every output (an AllGather of each split output); False
            returns each split output as an ``fs.ShardedArray``, this process's block,
            which a sharded function taking it with the same layout uses as it is (no
            communication). On a virtual mesh every output is global either way.

    Raises:
        ShardingError: an invalid strategy, layout, mesh, device, level or parameter
            name (checked when the function is called, against the arguments).
        CompositionError: ``vmap(shard(f))`` or a shard nested in a shard.

    See also: docs/shard.md, ``fs.Layout``, ``fs.visualize_sharding``.
    """
    if isinstance(fn, Sharded):
        raise CompositionError(
            f"fs.shard was applied to {fn!r}, which is already sharded.\nRule: shard cannot "
            "nest (as in MindSpore).\nAllowed form: a single fs.shard around the whole "
            "computation.")
    out = Sharded(fn, in_strategy, out_strategy, parameter_plan, device, level, mesh,
                  dataset_strategy, search, gather_outputs)
    return out if in_shapes is None else out.set_inputs(*_in_shapes_tuple(in_shapes))


def _in_shapes_tuple(in_shapes) -> tuple:
    if not isinstance(in_shapes, (tuple, list)):
        raise ShardingError(
            f"fs.shard(in_shapes=...) must be a tuple with one entry per positional "
            f"argument, got {type(in_shapes).__name__} {in_shapes!r}.\nFix: in_shapes=("
            "fs.ArrayType((fs.Symbol(divisor=8), 784), mindspore.float32), None, ...).")
    return tuple(in_shapes)



def _cell_shard(cell, in_strategy, out_strategy, parameter_plan):
    """MindSpore's in-place ``cell.shard(in_strategy, out_strategy, parameter_plan)``:
    the Cell, whenever a transform traces it, runs as ``fs.shard(cell, ...)`` (checked
    now, as ``fs.shard`` checks its arguments). Inside an ``fs.shard`` (or an
    ``fs.AutoParallel`` step), which plans the whole network, its strategies fix the
    layouts of the Cell's inputs and outputs there instead (MindSpore's Cell.shard
    under semi-auto parallel); its parameter_plan is then part of the
    ``fs.AutoParallel`` step's plan (``cell_parameter_plans``)."""
    sharded = shard(cell, in_strategy, out_strategy, parameter_plan)
    fname = fun_name(cell)

    def run(args, kwargs):
        if context.shard_depth.get() and context.shard_annotations.get():
            # AutoParallel: layouts fixed inline; the parameter_plan is the step's
            return sharded._annotate(fname, args, kwargs,
                                     plan_taken=id(cell) in context.planned_cells.get())
        if context.shard_depth.get():
            return user_layouts.annotated_call(cell, fname, args, sharded.in_strategy,
                                               sharded.out_strategy)
        return sharded(*args, **kwargs)

    run.parameter_plan = sharded._param_plan  # {path inside the Cell: (key, strategy)}
    return run


def cell_parameter_plans(network) -> dict:
    """The ``parameter_plan`` entries of every ``cell.shard(...)`` on a Cell of
    ``network`` (itself included), by the parameter's path inside ``network``:
    ``{path: (how it was given, strategy)}``."""
    out: dict = {}
    for prefix, cell in network.cells_and_names():
        run = cell.__dict__.get(CELL_SHARD_ATTR)
        for path, (key, strategy) in getattr(run, "parameter_plan", {}).items():
            where = f"{prefix}.shard(parameter_plan={{{key!r}: {strategy!r}}})" if prefix \
                else f"shard(parameter_plan={{{key!r}: {strategy!r}}})"
            out[f"{prefix}.{path}" if prefix else path] = (where, strategy)
    return out


def cells_with_parameter_plans(network) -> tuple:
    """ids of the Cells of ``network`` annotated by ``cell.shard`` with a
    ``parameter_plan`` (see ``context.planned_cells``)."""
    return tuple(id(cell) for _, cell in network.cells_and_names()
                 if getattr(cell.__dict__.get(CELL_SHARD_ATTR), "parameter_plan", None))


register_cell_shard(_cell_shard)
