"""``fs.shard``: MindSpore's functional operator sharding, on any backend.

``shard(fn, in_strategy, ...)`` stages ``fn`` on global shapes, then:

1. **strategies** — each ``in_strategy`` entry (split counts, a ``Layout`` view, or
   None) becomes a ``Sharding`` over a mesh of prime-sized axes (fshard/sharding.py);
2. **propagation** — every unannotated value gets a sharding. MindSpore's
   algorithm: breadth-first from the annotated values, choosing for each equation
   the candidate that needs no communication on its edges, then the cheapest under
   the cost model of ``level``; ``search=True`` refines it by exact search;
3. **partitioning** — the Program is rewritten into the *per-device* Program: each
   equation runs on local blocks with per-device parameters, and the collectives
   its operands' layout changes need (``all_gather``, ``psum``, ``psum_scatter``,
   ``block_slice``) are inserted as ordinary equations;
4. **execution** — on a virtual mesh the per-device Program runs batched over the
   device axes (nested ``vmap`` with one axis name per mesh axis); in a
   multi-process job each process runs it on its own block with real collectives.

Because execution goes through the same interpreters as everything else,
``fs.jit``, ``fs.grad`` and ``fs.value_and_grad`` compose with ``shard``.
``shard`` must sit outside ``vmap`` and cannot nest.
"""

from __future__ import annotations

import functools
import math
import os
from collections import deque
from dataclasses import dataclass

from fshard import tree
from fshard.core import ArrayType, bind, typeof
from fshard.errors import CompositionError, ShardingError
from fshard.interpret import eval_program
from fshard.ir import Literal, Program, Var, pretty
from fshard.rules import sharding as sharding_rules
from fshard.sharding import (
    CostModel,
    ShardMesh,
    Sharding,
    candidate_shardings,
    candidates,
    compute_cost,
    local_bytes,
    plan,
    plan_bytes,
)
from fshard.staging import StagedTracer, fun_name, stage, trace_fun

_shard_depth = 0  # > 0 while a sharded function is being staged or run

# ---------------------------------------------------------------------------
# Strategies -> Shardings
# ---------------------------------------------------------------------------


def _fmt(entry) -> str:
    return repr(entry)


def parse_strategy(entry, aval: ArrayType, mesh: ShardMesh, where: str) -> Sharding | None:
    """A user strategy (tuple of split counts or Layout view) as a Sharding."""
    if entry is None:
        return None
    if hasattr(entry, "to_dict") and "tensor_map" in entry.to_dict():
        return _layout_to_sharding(entry, aval, mesh, where)
    if not isinstance(entry, (tuple, list)):
        raise ShardingError(
            f"{where} must be a tuple of split counts (one per dimension), a fs.Layout view, "
            f"or None; got {type(entry).__name__} {entry!r}.")
    if len(entry) != aval.ndim:
        raise ShardingError(
            f"{where} = {_fmt(entry)} has {len(entry)} entries, but the value it describes "
            f"has rank {aval.ndim} ({aval}).\nFix: give one split count per dimension, e.g. "
            f"{tuple([1] * aval.ndim)} for no split.")
    for i, c in enumerate(entry):
        if not isinstance(c, int) or isinstance(c, bool):
            raise ShardingError(
                f"{where}[{i}] must be a positive int split count, got {type(c).__name__} "
                f"{c!r}.")
        if c <= 0:
            raise ShardingError(f"{where}[{i}] must be a positive split count, got {c}.")
    total = math.prod(entry)
    if total > mesh.size:
        raise ShardingError(
            f"{where} = {_fmt(entry)} splits over {total} devices, but the mesh has "
            f"{mesh.size}.\nFix: make the product of the split counts at most {mesh.size} "
            "(and a divisor of it), or use a larger mesh (fs.Mesh / FSHARD_DEVICES).")
    if mesh.size % total:
        raise ShardingError(
            f"{where} = {_fmt(entry)} splits over {total} devices, which does not divide the "
            f"{mesh.size} devices of the mesh.\nFix: use split counts whose product divides "
            f"{mesh.size}; the remaining devices then hold replicas.")
    for i, (c, d) in enumerate(zip(entry, aval.shape)):
        if isinstance(d, int) and d % c:
            raise ShardingError(
                f"{where}[{i}] = {c} does not divide dimension {i} of size {d} ({aval}).\n"
                "fshard never replicates silently: every split dimension must be divisible "
                f"by its split count. Fix: choose a divisor of {d} or pad the input.")
    dims, used, start = [], set(), 0
    for c in entry:
        axes = _axes_for(mesh, c, start, used)
        if axes is None:
            raise ShardingError(
                f"{where} = {_fmt(entry)} cannot be laid out on a mesh of {mesh.size} devices "
                f"(its prime axes {mesh.sizes} cannot supply a split of {c} after the "
                "previous dimensions).\nFix: reorder or change the split counts.")
        used.update(axes)
        start = max(axes) + 1 if axes else start
        dims.append(axes)
    return Sharding(tuple(dims))


def _axes_for(mesh: ShardMesh, count: int, start: int, used: set):
    """Mesh axes supplying a split of ``count``: consecutive from ``start`` when possible
    (MindSpore's row-major rank order), else any unused ones."""
    if count == 1:
        return ()
    axes, a = mesh.axes_for_count(start, count)
    if axes is not None and not (set(axes) & used):
        return axes
    free = [a for a in range(len(mesh.sizes)) if a not in used]
    for r in range(1, len(free) + 1):
        import itertools

        for combo in itertools.combinations(free, r):
            if mesh.count(combo) == count:
                return tuple(combo)
    return None


def _layout_to_sharding(view, aval: ArrayType, mesh: ShardMesh, where: str) -> Sharding:
    d = view.to_dict()
    dev = tuple(d["device_matrix"])
    if math.prod(dev) != mesh.size:
        raise ShardingError(
            f"{where}: the Layout's device matrix {dev} has {math.prod(dev)} devices, but the "
            f"mesh has {mesh.size}.\nFix: build the Layout with a device matrix whose product "
            f"is {mesh.size}.")
    # Device-matrix dims consume the prime mesh axes left to right (row-major ranks).
    groups, start = [], 0
    for size in dev:
        axes, start2 = mesh.axes_for_count(start, size)
        if axes is None and size != 1:
            raise ShardingError(
                f"{where}: the Layout's device matrix {dev} cannot be mapped onto the prime "
                f"axes {mesh.sizes} of {mesh.size} devices in order.")
        groups.append(axes or ())
        start = start2 if axes else start
    tmap = d["tensor_map"]
    if len(tmap) != aval.ndim:
        raise ShardingError(
            f"{where}: the Layout view names {len(tmap)} dimensions, but the value has rank "
            f"{aval.ndim} ({aval}).")
    dims = []
    for i, m in enumerate(tmap):
        ms = m if isinstance(m, (tuple, list)) else (m,)
        axes = tuple(a for t in ms if t != -1 for a in groups[len(dev) - 1 - t])
        n = mesh.count(axes)
        if isinstance(aval.shape[i], int) and aval.shape[i] % n:
            raise ShardingError(
                f"{where}: dimension {i} of size {aval.shape[i]} is split {n} ways by the "
                "Layout, which does not divide it.")
        dims.append(axes)
    return Sharding(tuple(dims))


# ---------------------------------------------------------------------------
# Propagation
# ---------------------------------------------------------------------------


@dataclass
class Propagated:
    program: Program
    mesh: ShardMesh
    shardings: dict          # Var -> Sharding (as produced)
    choice: list             # per equation: (spec, candidate)
    in_shardings: list       # per program input
    out_shardings: list      # requested output shardings
    given_inputs: list = None  # the annotations propagation started from
    level: int = 0


def _spec(eq):
    rule = sharding_rules.lookup(eq.prim, transform="shard")
    return rule(*[a.aval for a in eq.inputs], **eq.params)


def _eq_cost(eq, spec, cand, known: dict, demand: dict, mesh, model: CostModel):
    ins, outs = candidate_shardings(spec, cand)
    comm, n_coll = 0.0, 0
    for a, req in zip(eq.inputs, ins):
        if isinstance(a, Var) and a in known:
            b = plan_bytes(known[a], req, a.aval, mesh)
            comm += b
            n_coll += bool(plan(known[a], req) and b)
    for v, out in zip(eq.outputs, outs):
        for req in demand.get(v, ()):
            if req.partial <= out.partial:
                b = plan_bytes(out, req, v.aval, mesh)
                comm += b
                n_coll += bool(b)
    memory = sum(local_bytes(o, v.aval, mesh) for o, v in zip(outs, eq.outputs))
    return model.score(compute_cost(spec, cand, mesh), comm, n_coll, memory)


def propagate(program: Program, in_shardings: list, out_shardings: list, mesh: ShardMesh,
              level: int = 0) -> Propagated:
    """Give every value a sharding (MindSpore's BFS; see the module docstring)."""
    model = CostModel(level=level)
    known: dict = {v: s for v, s in zip(program.inputs, in_shardings) if s is not None}
    demand: dict = {}
    for v, s in zip(program.outputs, out_shardings):
        if isinstance(v, Var) and s is not None:
            demand.setdefault(v, []).append(s)
    consumers: dict = {}
    producer: dict = {}
    for i, eq in enumerate(program.equations):
        for a in eq.inputs:
            if isinstance(a, Var):
                consumers.setdefault(a, []).append(i)
        for v in eq.outputs:
            producer[v] = i
    specs = [_spec(eq) for eq in program.equations]
    choice: list = [None] * len(program.equations)

    def decide(i):
        eq, spec = program.equations[i], specs[i]
        best, best_score = None, None
        for cand in candidates(spec, mesh):
            score = _eq_cost(eq, spec, cand, known, demand, mesh, model)
            if best_score is None or score < best_score:
                best, best_score = cand, score
        choice[i] = (spec, best)
        ins, outs = candidate_shardings(spec, best)
        for a, req in zip(eq.inputs, ins):
            if isinstance(a, Var) and a not in known:
                if a in producer:
                    demand.setdefault(a, []).append(req)
                else:  # an unannotated input adopts what its first consumer needs
                    known[a] = req
        for v, out in zip(eq.outputs, outs):
            known[v] = out

    queue = deque()  # breadth-first from the annotated values only (as MindSpore)
    for v in list(known):
        queue.extend(consumers.get(v, []))
    while queue:
        i = queue.popleft()
        if choice[i] is not None:
            continue
        decide(i)
        eq = program.equations[i]
        for v in eq.outputs:
            queue.extend(j for j in consumers.get(v, []) if choice[j] is None)
        for a in eq.inputs:
            if isinstance(a, Var) and a in producer and choice[producer[a]] is None:
                queue.append(producer[a])
    for i in range(len(program.equations)):  # unreachable from any annotation
        if choice[i] is None:
            decide(i)
    ins = [known.get(v, Sharding.replicated(v.aval.ndim)) for v in program.inputs]
    return Propagated(program, mesh, known, choice, ins, out_shardings, list(in_shardings), level)


# ---------------------------------------------------------------------------
# Partitioning: the per-device Program
# ---------------------------------------------------------------------------


def redistribute(x, src: Sharding, dst: Sharding, mesh: ShardMesh):
    """Emit the collectives moving ``x`` from ``src`` to ``dst``."""
    from fshard.primitives import collectives as C
    from fshard.primitives.spmd import block_slice

    for st in plan(src, dst):
        names = mesh.name(st.axes)
        if st.kind == "all_gather":
            x = C.all_gather(x, names, axis=st.dim, tiled=True)
        elif st.kind == "psum":
            x = C.psum(x, names)
        elif st.kind == "psum_scatter":
            x = C.psum_scatter(x, names, scatter_dimension=st.dim, tiled=True)
        else:
            x = block_slice(x, names, st.dim, tuple(mesh.sizes[a] for a in st.axes))
    return x


@dataclass
class Partitioned:
    """The per-device Program and the layouts at its boundary."""

    prop: Propagated
    program: Program          # per device; inputs are local blocks
    consts: list
    in_shardings: list
    out_shardings: list
    annotations: dict         # per-device Var -> Sharding (for printing)

    def __str__(self) -> str:
        mesh = self.prop.mesh

        def annotate(v):
            sh = self.annotations.get(v)
            return "{" + sh.describe(mesh) + "}" if sh is not None else ""

        head = (f"# per-device program on {mesh.size} devices (mesh axes {mesh.names} of "
                f"sizes {mesh.sizes}); {{strategy}} after each value\n")
        return head + pretty(self.program, annotate)

    def collectives(self) -> list[str]:
        """Names of the collective equations, in order."""
        names = {"psum", "all_gather", "psum_scatter", "all_to_all", "ppermute", "pmax",
                 "pmin", "block_slice", "broadcast"}
        return [eq.prim.name for eq in self.program.equations if eq.prim.name in names]

    def strategies(self) -> dict:
        """The strategy of every input, equation and output (a strategy file's content)."""
        mesh = self.prop.mesh
        eqs = []
        for eq, (spec, cand) in zip(self.prop.program.equations, self.prop.choice):
            ins, outs = candidate_shardings(spec, cand)
            eqs.append({"primitive": eq.prim.name,
                        "in_strategy": [s.strategy(mesh) for s in ins],
                        "out_strategy": [s.strategy(mesh) for s in outs],
                        "partial_sum": [mesh.count(s.partial) for s in outs if s.partial]})
        return {"device_num": mesh.size,
                "inputs": [s.strategy(mesh) for s in self.prop.in_shardings],
                "equations": eqs,
                "outputs": [s.strategy(mesh) for s in self.out_shardings]}


def _local_aval(aval, sh, mesh):
    return ArrayType(sh.local_shape(aval.shape, mesh), aval.dtype)


def partition(prop: Propagated) -> Partitioned:
    program, mesh = prop.program, prop.mesh
    outs_sh = [s if s is not None else Sharding.replicated(v.aval.ndim)
               for v, s in zip(program.outputs, prop.out_shardings)]
    annotations: dict = {}

    def note(x, sh):
        if isinstance(x, StagedTracer):
            annotations[x.var] = sh
        return x

    def per_device(*local_inputs):
        for x, sh in zip(local_inputs, prop.in_shardings):
            note(x, sh)
        env = dict(zip(program.inputs, local_inputs))
        cur = dict(zip(program.inputs, prop.in_shardings))
        for eq, (spec, cand) in zip(program.equations, prop.choice):
            ins, outs = candidate_shardings(spec, cand)
            args = []
            for a, req in zip(eq.inputs, ins):
                if isinstance(a, Literal):
                    args.append(a.value)
                else:
                    args.append(note(redistribute(env[a], cur[a], req, mesh), req))
            params = eq.params
            if spec.local_params is not None:
                params = spec.local_params(
                    params, [_local_aval(a.aval, s, mesh) for a, s in zip(eq.inputs, ins)],
                    [_local_aval(v.aval, s, mesh) for v, s in zip(eq.outputs, outs)])
            res = bind(eq.prim, *args, **params)
            res = res if eq.prim.multiple_results else [res]
            for v, r, s in zip(eq.outputs, res, outs):
                env[v], cur[v] = note(r, s), s
        results = []
        for a, s in zip(program.outputs, outs_sh):
            if isinstance(a, Literal):
                results.append(a.value)
            else:
                results.append(note(redistribute(env[a], cur[a], s, mesh), s))
        return results

    local_avals = [_local_aval(v.aval, s, mesh) for v, s in zip(program.inputs, prop.in_shardings)]
    pd_program, pd_consts = stage(per_device, local_avals)
    return Partitioned(prop, pd_program, pd_consts, prop.in_shardings, outs_sh, annotations)


# ---------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------


def _to_blocks(x, sh: Sharding, mesh: ShardMesh):
    """Global array -> (blocks over the splitting mesh axes, in mesh order) + local dims."""
    from fshard.primitives.structural import reshape, transpose

    shape = typeof(x).shape
    split_shape, axis_pos, local_pos = [], {}, []
    for d, (n, axes) in enumerate(zip(shape, sh.dims)):
        for a in axes:
            axis_pos[a] = len(split_shape)
            split_shape.append(mesh.sizes[a])
        local_pos.append(len(split_shape))
        split_shape.append(n // mesh.count(axes))
    x = reshape(x, tuple(split_shape))
    perm = [axis_pos[a] for a in sorted(axis_pos)] + local_pos
    return transpose(x, tuple(perm))


def _from_blocks(y, sh: Sharding, mesh: ShardMesh):
    """(all mesh axes..., local dims) -> the global array."""
    from fshard.primitives.structural import reshape, slice_array, transpose

    k = len(mesh.sizes)
    shape = typeof(y).shape
    # Replicated over an axis: every lane holds the same value; keep lane 0.
    used = {a for ax in sh.dims for a in ax}
    for a in range(k):
        if a not in used:
            start = [0] * len(shape)
            limit = list(shape)
            limit[a] = 1
            y = slice_array(y, tuple(start), tuple(limit))
            shape = typeof(y).shape
    nd = len(sh.dims)
    perm = []
    for d, axes in enumerate(sh.dims):
        perm.extend(axes)
        perm.append(k + d)
    perm.extend(a for a in range(k) if a not in used)
    y = transpose(y, tuple(perm))
    out_shape = []
    for d, axes in enumerate(sh.dims):
        out_shape.append(mesh.count(axes) * shape[k + d])
    del nd
    return reshape(y, tuple(out_shape))


def run_virtual(part: Partitioned, args: list):
    """Run the per-device Program batched over every mesh axis of a virtual mesh."""
    from fshard.transforms.vmap import vmap

    mesh = part.prop.mesh
    program, consts = part.program, part.consts
    blocks = [_to_blocks(x, sh, mesh) for x, sh in zip(args, part.in_shardings)]

    def f(*bs):
        return eval_program(program, *consts, *bs)

    for k in reversed(range(len(mesh.sizes))):
        in_axes = tuple(0 if any(k in ax for ax in sh.dims) else None
                        for sh in part.in_shardings)
        f = vmap(f, in_axes=in_axes, axis_name=f"m{k}", axis_size=mesh.sizes[k])
    outs = f(*blocks)
    return [_from_blocks(y, sh, mesh) for y, sh in zip(outs, part.out_shardings)]


# ---------------------------------------------------------------------------
# The user API
# ---------------------------------------------------------------------------

_DEVICES = ("CPU", "GPU", "Ascend")


def _check_device(device):
    if device is None:
        return
    if device not in _DEVICES:
        raise ShardingError(
            f"device must be one of {_DEVICES} or None, got {device!r}.")
    import mindspore as ms

    target = ms.get_context("device_target")
    if device != target:
        raise ShardingError(
            f"device={device!r} is not where MindSpore runs here (device_target is "
            f"{target!r}).\nFix: pass device={target!r} or None, or set "
            "mindspore.set_device(...) first.")


def _device_count(mesh) -> int:
    if mesh is not None:
        if isinstance(mesh, int):
            return mesh
        return mesh.size
    try:
        from fshard.mesh import resolve_mesh

        return resolve_mesh(None).size
    except ImportError:  # pragma: no cover - mesh module always present when installed
        return int(os.environ.get("FSHARD_DEVICES", "1"))


class Sharded:
    """The callable returned by ``fs.shard``."""

    def __init__(self, fn, in_strategy, out_strategy, parameter_plan, device, level, mesh,
                 dataset_strategy, search):
        if level not in (0, 1, 2):
            raise ShardingError(
                f"level must be 0 (best compute/communication ratio), 1 (least memory) or "
                f"2 (fastest), got {level!r}.")
        if dataset_strategy not in ("full_batch", "data_parallel"):
            raise ShardingError(
                f"dataset_strategy must be 'full_batch' or 'data_parallel', got "
                f"{dataset_strategy!r}.")
        if not isinstance(in_strategy, (tuple, list)):
            raise ShardingError(
                f"in_strategy must be a tuple with one entry per positional input, got "
                f"{type(in_strategy).__name__} {in_strategy!r}.\nFix: e.g. "
                "in_strategy=((4, 2), None, None).")
        _check_device(device)
        self.fn, self.in_strategy, self.out_strategy = fn, tuple(in_strategy), out_strategy
        self.parameter_plan, self.level, self.mesh = parameter_plan, level, mesh
        self.dataset_strategy, self.search = dataset_strategy, search
        self._cache: dict = {}
        self._cell = None
        self._param_names: list = []
        from fshard.cells import functional, is_cell

        if is_cell(fn):
            self._cell = fn
            self._apply, params = functional(fn)
            self._param_names = list(params)
            self._param_plan = _resolve_parameter_plan(fn, parameter_plan, self._param_names)
        elif parameter_plan:
            raise ShardingError("parameter_plan is only valid when sharding an nn.Cell.")
        functools.update_wrapper(self, fn if callable(fn) else self.__call__, updated=())

    # -- tracing -----------------------------------------------------------
    def _flat_call(self, args):
        """(function of flat leaves, leaves, per-leaf strategy entries, in_tree)."""
        fname = fun_name(self.fn)
        if len(args) != len(self.in_strategy):
            raise ShardingError(
                f"shard({fname}): in_strategy has {len(self.in_strategy)} entries but the "
                f"function was called with {len(args)} positional inputs.\nFix: give one "
                "strategy (or None) per positional input.")
        entries = []
        for i, (a, s) in enumerate(zip(args, self.in_strategy)):
            n = len(tree.leaves(a))
            if s is not None and n != 1:
                raise ShardingError(
                    f"shard({fname}): in_strategy[{i}] is set, but input {i} is a pytree with "
                    f"{n} arrays; strategies apply to single arrays.\nFix: pass None for it.")
            entries.extend([s] * n)
        fn = self.fn
        if self._cell is not None:
            params = {n: p for n, p in self._cell.parameters_and_names()}
            args = (params,) + tuple(args)
            entries = [self._param_plan.get(n) for n in sorted(params)] + entries
            fn = self._apply
        leaves, in_tree = tree.flatten((tuple(args), {}))
        return fn, leaves, entries, in_tree

    def partitioned(self, *args) -> Partitioned:
        """Propagate and partition for these arguments (cached by signature)."""
        fn, leaves, entries, in_tree = self._flat_call(args)
        return self._partition(fn, leaves, entries, in_tree)[0]

    def _partition(self, fn, leaves, entries, in_tree):
        n = _device_count(self.mesh)
        key = (in_tree, tuple((tuple(typeof(x).shape), typeof(x).dtype) for x in leaves), n)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        mesh = ShardMesh.for_devices(n)
        fname = fun_name(self.fn)
        global _shard_depth
        _shard_depth += 1
        try:
            traced = trace_fun(fn, in_tree, [typeof(x) for x in leaves])
        finally:
            _shard_depth -= 1
        prog = traced.program
        avals = [v.aval for v in prog.inputs]
        n_c = prog.n_consts
        in_sh = [Sharding.replicated(a.ndim) for a in avals[:n_c]]
        for i, (e, a) in enumerate(zip(entries, avals[n_c:])):
            where = f"shard({fname}): in_strategy[{i}]" if self._cell is None else \
                f"shard({fname}): strategy of input {i}"
            sh = parse_strategy(e, a, mesh, where)
            if sh is None and self.dataset_strategy == "data_parallel" and a.ndim and \
                    i >= len(self._param_names):
                sh = parse_strategy((mesh.size,) + (1,) * (a.ndim - 1), a, mesh, where)
            in_sh.append(sh)
        out_sh = self._out_shardings(prog, mesh, fname, traced.out_tree)
        prop = propagate(prog, in_sh, out_sh, mesh, self.level)
        if self.search:
            from fshard.search import refine

            prop = refine(prop)
        part = partition(prop)
        self._cache[key] = (part, traced)
        return part, traced

    def _out_shardings(self, prog, mesh, fname, out_tree):
        outs = prog.out_avals
        if self.out_strategy is None:
            if self.dataset_strategy == "data_parallel":
                return [parse_strategy((mesh.size,) + (1,) * (a.ndim - 1), a, mesh,
                                       f"shard({fname}) data_parallel output") if a.ndim else
                        Sharding.replicated(0) for a in outs]
            return [Sharding.replicated(a.ndim) for a in outs]
        strat = self.out_strategy
        if not isinstance(strat, (tuple, list)) or (outs and len(outs) == 1 and
                                                     strat and isinstance(strat[0], int)):
            strat = (strat,)
        if len(strat) != len(outs):
            raise ShardingError(
                f"shard({fname}): out_strategy has {len(strat)} entries but the function "
                f"returns {len(outs)} arrays.")
        return [parse_strategy(s, a, mesh, f"shard({fname}): out_strategy[{i}]") or
                Sharding.replicated(a.ndim) for i, (s, a) in enumerate(zip(strat, outs))]

    # -- calling -------------------------------------------------------------
    def __call__(self, *args):
        global _shard_depth
        from fshard.transforms.vmap import inside_vmap

        fname = fun_name(self.fn)
        if inside_vmap():
            raise CompositionError(
                f"shard({fname}) is applied inside vmap, which fshard does not allow: shard "
                "must sit outside vmap.\nAllowed form: fs.shard(fs.vmap(f), in_strategy=...). "
                "Refused: fs.vmap(fs.shard(f, ...)).")
        if _shard_depth:
            raise CompositionError(
                f"shard({fname}) is nested inside another fs.shard, which is not allowed.\n"
                "Allowed form: one fs.shard around the whole computation; annotate inner "
                "values through its in_strategy/out_strategy instead.")
        fn, leaves, entries, in_tree = self._flat_call(args)
        part, traced = self._partition(fn, leaves, entries, in_tree)
        _shard_depth += 1
        try:
            outs = run_virtual(part, list(traced.consts) + list(leaves))
        finally:
            _shard_depth -= 1
        return tree.unflatten(traced.out_tree, outs)

    def __repr__(self) -> str:
        return f"fs.shard({fun_name(self.fn)})"


def _resolve_parameter_plan(cell, plan_, names) -> dict:
    """parameter_plan keys -> parameter names; accepts 'self.'-prefixed and path names."""
    if not plan_:
        return {}
    out = {}
    prefix = getattr(cell, "param_prefix", "") or ""
    for key, strat in plan_.items():
        k = key[5:] if key.startswith("self.") else key
        match = [n for n in names if n == k or (prefix and f"{prefix}.{n}" == k)
                 or k.endswith("." + n) and _suffix_ok(k, n)]
        if not match:
            raise ShardingError(
                f"parameter_plan key {key!r} matches no parameter of "
                f"{type(cell).__name__}; its parameters are {names}.\nFix: use one of "
                "those names (optionally prefixed with 'self.' or the Cell's own path).")
        out[match[0]] = strat
    return out


def _suffix_ok(key: str, name: str) -> bool:
    return key.endswith("." + name)


def shard(fn, in_strategy, out_strategy=None, parameter_plan=None, device=None, level=0,
          mesh=None, *, dataset_strategy="full_batch", search=False):
    """Shard ``fn`` over a mesh of devices (MindSpore's functional ``shard``).

    >>> import numpy as np, fshard as fs
    >>> from mindspore import ops
    >>> def dense_relu(x, w):
    ...     return ops.relu(ops.matmul(x, w))
    >>> x, w = np.ones((8, 4), np.float32), np.ones((4, 2), np.float32)
    >>> fs.shard(dense_relu, in_strategy=((4, 2), None), mesh=8)(x, w).shape
    (8, 2)

    Args:
        fn: a function or ``nn.Cell``.
        in_strategy: one entry per positional input: split counts per dimension (e.g.
            ``(4, 2)``), a ``fs.Layout`` view, or None (derived by propagation).
        out_strategy: the same for the outputs; None: replicated (``full_batch``) or
            split along the batch (``data_parallel``).
        parameter_plan: for a Cell, ``{parameter name: strategy}``.
        device: "CPU", "GPU" or "Ascend" (checked against where MindSpore runs) or None.
        level: propagation objective: 0 compute/communication ratio, 1 memory, 2 speed.
        mesh: a ``fs.Mesh`` or a device count; default from ``with fs.Mesh``, the
            launcher's world, or ``FSHARD_DEVICES``.
        dataset_strategy: "full_batch" (default) or "data_parallel".
        search: refine propagation by exact search (small programs).

    See also: docs/shard.md, ``Sharded.partitioned(*args)`` for the per-device program.
    """
    if isinstance(fn, Sharded):
        raise CompositionError(
            "fs.shard was applied to a function that is already sharded; nested shard is "
            "not allowed.\nAllowed form: a single fs.shard around the whole computation.")
    return Sharded(fn, in_strategy, out_strategy, parameter_plan, device, level, mesh,
                   dataset_strategy, search)
