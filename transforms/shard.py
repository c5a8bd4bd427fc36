"""``fs.shard``: MindSpore's functional operator sharding, on any backend.

``shard(fn, in_strategy, ...)`` stages ``fn`` on global shapes, then:

1. **strategies** — each ``in_strategy`` entry (split counts, a ``Layout`` view, or
   None) becomes a ``Sharding`` over a mesh of prime-sized axes (fshard/sharding.py);
2. **propagation** — every unannotated value gets a sharding. MindSpore's
   algorithm: breadth-first from the annotated values, choosing for each equation
   the candidate that needs no communication on its edges, then the cheapest under
   the cost model of ``level``; pending sums pass through linear primitives;
   ``search=True`` refines it by a search over the whole program;
3. **partitioning** — the Program is rewritten into the *per-device* Program: each
   equation runs on local blocks with per-device parameters, and the collectives
   its operands' layout changes need (``all_gather``, ``psum``, ``psum_scatter``,
   ``block_slice``) are inserted as ordinary equations, each layout of a value
   computed once;
4. **execution** — one ``shard_call`` equation holds the global Program and its
   boundary layouts (a ``ShardPlan``). On a virtual mesh the per-device Program runs
   batched over the device axes (nested ``vmap``, one axis name per mesh axis); in a
   multi-process job each process runs it on its own block with real collectives.

``shard_call``'s JVP and transpose rules work on the *global* Program, so the
derivative of a sharded function is propagated and partitioned as a program of its
own: ``fs.grad(fs.shard(f))`` pays the collectives of the backward math, and
``fs.jit`` of any composition is one MindSpore graph. ``shard`` must sit outside
``vmap`` and cannot nest. docs/shard.md is the user guide.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
from collections import deque

import numpy as np
from dataclasses import dataclass

from fshard import context, distributed, dtypes, tree
from fshard.core import ArrayType, EvalTrace, bind, current_trace, typeof
from fshard.dims import dim_multiple_of
from fshard.errors import CompositionError, ShardingError
from fshard.interpret import eval_program
from fshard.ir import Literal, Program, Var, pretty
from fshard.rules import sharding as sharding_rules
from fshard.sharding import (
    CostModel,
    ShardMesh,
    Sharding,
    as_produced,
    candidate_shardings,
    candidates,
    carry_variants,
    compute_cost,
    after,
    local_bytes,
    native_collectives,
    native_reduce_scatter,
    plan,
    plan_bytes,
)
from fshard.staging import StagedTracer, fun_name, stage, trace_fun
from fshard.transforms import local_batch


# ---------------------------------------------------------------------------
# Strategies -> Shardings
# ---------------------------------------------------------------------------


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _or_list(xs) -> str:
    xs = [str(x) for x in xs]
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " or " + xs[-1]


def _is_count(c) -> bool:
    import numpy as np

    return isinstance(c, (int, np.integer)) and not isinstance(c, (bool, np.bool_))


def parse_strategy(entry, aval: ArrayType, mesh: ShardMesh, where: str,
                   what: str = "the value") -> Sharding | None:
    """A user strategy (tuple of split counts, ``fs.Layout`` view, or None) as a Sharding.

    ``where`` names the strategy in messages (``"shard(f): in_strategy[0]"``) and
    ``what`` the value it describes (``"argument 'x' (f32[32,128])"``).

    >>> from fshard.core import ArrayType
    >>> from fshard import dtypes
    >>> parse_strategy((4, 2), ArrayType((32, 128), dtypes.float32), ShardMesh.for_devices(8),
    ...                "in_strategy[0]").dims
    ((0, 1), (2,))
    """
    from fshard.layout import Layout

    if entry is None:
        return None
    if isinstance(entry, Layout):
        return _layout_to_sharding(entry, aval, mesh, where, what)
    if not isinstance(entry, (tuple, list)):
        raise ShardingError(
            f"{where} must be a tuple of split counts (one per dimension), an fs.Layout "
            f"view, or None; got {type(entry).__name__} {entry!r}.\nFix: e.g. "
            f"{tuple([1] * aval.ndim)} for {what} unsplit, or None to let propagation "
            "choose.")
    entry = tuple(entry)
    for i, c in enumerate(entry):
        if not _is_count(c):
            raise ShardingError(
                f"{where} = {entry!r} has the split count {c!r} ({type(c).__name__}) for "
                f"dimension {i}.\nRule: split counts are positive ints.\nFix: use 1 for a "
                "dimension that is not split.")
        if c <= 0:
            raise ShardingError(
                f"{where} = {entry!r} has the split count {c} for dimension {i}.\nRule: "
                "split counts are positive ints.\nFix: use 1 for a dimension that is not "
                "split.")
    entry = tuple(int(c) for c in entry)
    if len(entry) != aval.ndim:
        raise ShardingError(
            f"{where} = {entry!r} has {_plural(len(entry), 'entry', 'entries')}, but {what} "
            f"has rank {aval.ndim}.\nRule: a strategy gives one split count per dimension.\nFix: "
            f"give {aval.ndim} split counts, e.g. {tuple([1] * aval.ndim)!r} for no split.")
    total = math.prod(entry)
    if total > mesh.size or mesh.size % total:
        how = (f"but the mesh has only {_plural(mesh.size, 'device', 'devices')}"
               if total > mesh.size else
               f"which does not divide the {mesh.size} devices of the mesh")
        raise ShardingError(
            f"{where} = {entry!r} splits {what} into {total} blocks, {how}.\nRule: the "
            "product of the split counts must divide the device count (the remaining "
            "factor holds replicas).\nFix: use split counts whose product is "
            f"{_or_list(_divisors(mesh.size))}, or another mesh (fs.Mesh, mesh=N or "
            "FSHARD_DEVICES).")
    for i, (c, d) in enumerate(zip(entry, aval.shape)):
        if d % c if isinstance(d, int) else _symbol_bad(d, c):
            raise ShardingError(
                f"{where} = {entry!r} splits dimension {i} (size {d}) of {what} into {c} "
                f"parts, but {d} is not divisible by {c}.\nRule: every split dimension must "
                "be divisible by its split count; fshard never falls back to replication."
                f"\nFix: {_divisible_fix(d, c, mesh)}")
    dims, used, start = [], set(), 0
    for c in entry:
        axes = _axes_for(mesh, c, start, used)
        if axes is None:
            raise ShardingError(
                f"{where} = {entry!r} cannot be laid out on {mesh.size} devices: after the "
                f"previous dimensions, the remaining devices cannot be split {c} ways.\n"
                "Fix: reorder or change the split counts, or give an fs.Layout view.")
        used.update(axes)
        start = max(axes) + 1 if axes else start
        dims.append(axes)
    return Sharding(tuple(dims))


def _symbol_bad(d, c) -> bool:
    # A symbolic dimension is divisible when it provably is for every size it accepts.
    return not dim_multiple_of(d, c)


def _divisible_fix(d, c, mesh) -> str:
    if not isinstance(d, int):
        declared = f"{d} is declared {d!r}; " if hasattr(d, "divisor") else ""
        return (f"{declared}declare it with fs.Symbol(divisor={c}) (or a multiple of {c}), "
                "or split it fewer ways.")
    ok = [k for k in _divisors(d) if mesh.size % k == 0]
    return f"split it into {_or_list(ok)} parts, or pad it to a multiple of {c}."


def _axes_for(mesh: ShardMesh, count: int, start: int, used: set):
    """Mesh axes supplying a split of ``count``: consecutive from ``start`` when possible
    (MindSpore's row-major rank order: the replicas of a strategy that uses fewer devices
    are neighbours), else any unused ones."""
    if count == 1:
        return ()
    axes, _ = mesh.axes_for_count(start, count)
    if axes is not None and not (set(axes) & used):
        return axes
    free = [a for a in range(len(mesh.sizes)) if a not in used]
    for r in range(1, len(free) + 1):
        for combo in itertools.combinations(free, r):
            if mesh.count(combo) == count:
                return tuple(combo)
    return None


def split_alternatives(sh: Sharding, mesh: ShardMesh) -> list[Sharding]:
    """Every layout splitting each dimension as many ways as ``sh`` does, over disjoint
    mesh axes (each dimension's in mesh order), ``sh`` first.

    A tuple strategy says how many ways each dimension is split, not over which devices
    (MindSpore derives each operator's device matrix from the split counts of all its
    operands), so the mesh axes of tuple strategies are chosen together, by the cost
    of the whole plan (``ShardPlan``); a ``Layout`` pins them.

    >>> mesh = ShardMesh.for_devices(4)
    >>> [s.dims for s in split_alternatives(Sharding(((0,), ())), mesh)]
    [((0,), ()), ((1,), ())]
    """
    counts = [mesh.count(ax) for ax in sh.dims]
    out = [sh]

    def extend(i, used, dims):
        if i == len(counts):
            cand = Sharding(tuple(dims), sh.partial)
            if cand not in out:
                out.append(cand)
            return
        if counts[i] == 1:
            extend(i + 1, used, dims + [()])
            return
        free = [a for a in range(len(mesh.sizes)) if a not in used]
        for r in range(1, len(free) + 1):
            for combo in itertools.combinations(free, r):
                if mesh.count(combo) == counts[i]:
                    extend(i + 1, used | set(combo), dims + [combo])

    extend(0, frozenset(), [])
    return out


def choose_split_axes(body: Program, in_shardings: list, out_shardings: list,
                      mesh: ShardMesh, level: int, flexible) -> tuple[list, list]:
    """``(in_shardings, out_shardings)`` with the layouts at ``flexible`` (``("in", k)``
    or ``("out", k)``: those given as tuple strategies) moved to the mesh axes that
    make the whole plan cheapest: every combination when there are few, else
    coordinate descent from the row-major default (which wins ties, so a plan only
    changes when another assignment is strictly cheaper)."""
    from fshard.search import cost

    start = {"in": list(in_shardings), "out": list(out_shardings)}
    options = {(side, k): split_alternatives(start[side][k], mesh) for side, k in flexible
               if start[side][k] is not None}
    options = {key: v for key, v in options.items() if len(v) > 1}
    if not options or not all(v.aval.is_static for v in body.inputs):
        return start["in"], start["out"]

    def with_(base, changes):
        new = {"in": list(base["in"]), "out": list(base["out"])}
        for (side, k), sh in changes:
            new[side][k] = sh
        return new

    def score(s):
        return cost(propagate(body, s["in"], s["out"], mesh, level)).score(level)

    best, best_score = start, score(start)
    if math.prod(len(v) for v in options.values()) <= 64:
        for combo in itertools.product(*options.values()):
            trial = with_(start, zip(options, combo))
            s = score(trial)
            if s < best_score:
                best, best_score = trial, s
        return best["in"], best["out"]
    for _ in range(3):
        improved = False
        for (side, k), alts in options.items():
            for sh in alts:
                if sh == best[side][k]:
                    continue
                trial = with_(best, [((side, k), sh)])
                s = score(trial)
                if s < best_score:
                    best, best_score, improved = trial, s, True
        if not improved:
            break
    return best["in"], best["out"]


def _layout_axes(view, mesh: ShardMesh, where: str) -> list[tuple[int, ...]]:
    """Per device-matrix axis of a Layout, the prime mesh axes it is made of (major
    first), such that the Layout's ``rank_list`` puts every device where the mesh has
    it. Ranks are row-major on both; a rank_list that permutes whole axes (e.g. ranks
    ``[0, 4, 2, 6, 1, 5, 3, 7]`` for (2, 2, 2)) maps to a reordering of them."""
    import numpy as np

    dev = tuple(view.device_matrix)
    ranks = list(view.rank_list)
    coords = [np.unravel_index(p, dev) for p in range(len(ranks))]
    want = [mesh.coords(r) for r in ranks]

    def fits(groups) -> bool:
        for c, q in zip(coords, want):
            for axis, axes in enumerate(groups):
                idx = 0
                for a in axes:
                    idx = idx * mesh.sizes[a] + q[a]
                if idx != c[axis]:
                    return False
        return True

    def search(k, used, groups):
        if k == len(dev):
            return groups if fits(groups) else None
        if dev[k] == 1:
            return search(k + 1, used, groups + [()])
        free = [a for a in range(len(mesh.sizes)) if a not in used]
        options = []
        for r in range(1, len(free) + 1):
            for combo in itertools.permutations(free, r):
                if mesh.count(combo) == dev[k]:
                    options.append(combo)
        # Consecutive, in mesh order, first: the identity rank_list is found at once.
        options.sort(key=lambda c: (list(c) != sorted(c), c))
        for combo in options:
            found = search(k + 1, used | set(combo), groups + [combo])
            if found is not None:
                return found
        return None

    groups = search(0, frozenset(), [])
    if groups is None:
        raise ShardingError(
            f"{where} = {view!r}: its rank_list places the devices in an order fshard "
            "cannot express on this mesh (it must reorder whole device-matrix axes).\nFix: "
            "use rank_list=None (row-major ranks), or an order that permutes whole axes.")
    return groups


def _layout_to_sharding(view, aval: ArrayType, mesh: ShardMesh, where: str,
                        what: str = "the value") -> Sharding:
    if not view.is_view:
        raise ShardingError(
            f"{where} = {view!r} is a Layout, not a view of a tensor.\nFix: call it with one "
            f"entry per dimension, e.g. layout({view.alias_name[0]!r}, 'None').")
    n = view.n_devices
    if n != mesh.size:
        raise ShardingError(
            f"{where} = {view!r} has a device matrix of {n} devices, but the mesh has "
            f"{mesh.size}.\nRule: the product of a Layout's device_matrix must equal the "
            f"device count.\nFix: use a device matrix whose product is {mesh.size}, or a "
            f"mesh of {n} devices.")
    if view.ndim != aval.ndim:
        raise ShardingError(
            f"{where} = {view!r} has {_plural(view.ndim, 'entry', 'entries')}, but {what} "
            f"has rank {aval.ndim}."
            "\nRule: a Layout view gives one entry per dimension.\nFix: give "
            f"{aval.ndim} entries ('None' for a dimension that is not split).")
    groups = _layout_axes(view, mesh, where)
    dims = []
    for i, dim_axes in enumerate(view.dim_axes):
        axes = tuple(a for k in dim_axes for a in groups[k])
        c, d = mesh.count(axes), aval.shape[i]
        if d % c if isinstance(d, int) else _symbol_bad(d, c):
            raise ShardingError(
                f"{where} = {view!r} splits dimension {i} (size {d}) of {what} into {c} "
                f"parts, but {d} is not divisible by {c}.\nRule: every split dimension must "
                "be divisible by its split count; fshard never falls back to replication."
                f"\nFix: {_divisible_fix(d, c, mesh)}")
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


def _eq_cost(eq, spec, cand, known: dict, demand: dict, mesh, model: CostModel,
             extra_comm: float = 0.0, out_demand: dict | None = None,
             desired: dict | None = None):
    ins, outs = candidate_shardings(spec, cand)
    comm, n_coll = extra_comm, 0
    for a, req in zip(eq.inputs, ins):
        if isinstance(a, Var) and a in known:
            b = plan_bytes(known[a], req, a.aval, mesh, model.native)
            comm += b
            n_coll += bool(plan(known[a], req, native_reduce_scatter(model.native)) and b)
    for v, out in zip(eq.outputs, outs):
        for req in demand.get(v, ()):
            if req.partial <= out.partial:
                b = plan_bytes(out, req, v.aval, mesh, model.native)
                comm += b
                n_coll += bool(b)
        for req in (out_demand or {}).get(v, ()):
            steps = plan(out, req, native_reduce_scatter(model.native))
            b = plan_bytes(out, req, v.aval, mesh, model.native)
            # A pending sum resolved at a program output (a gradient's AllReduce) runs
            # after everything else and overlaps the rest of the step: MindSpore weighs
            # such communication by gamma (comm_with_partial_para).
            if steps and all(st.kind == "psum" for st in steps):
                b *= model.gamma
            comm += b
            n_coll += bool(b)
        want = (desired or {}).get(v)
        if want is not None and not demand.get(v) and not (out_demand or {}).get(v):
            b = plan_bytes(out, want, v.aval, mesh, model.native)
            comm += b
            n_coll += bool(b)
    memory = sum(local_bytes(o, v.aval, mesh) for o, v in zip(outs, eq.outputs))
    return model.score(compute_cost(spec, cand, mesh), comm, n_coll, memory)


def _deferral_bytes(eq, spec, cand, mesh) -> float:
    """What passing a pending sum through ``eq`` costs later: the AllReduce then runs
    on the output instead of the operand, which costs more when the output is larger
    (a broadcast), and less (never negative here) when it is smaller (a reduction)."""
    ins, outs = candidate_shardings(spec, cand)
    n = mesh.count(cand.carry)
    before = max(local_bytes(s, a.aval, mesh) for k, (a, s) in enumerate(zip(eq.inputs, ins))
                 if k in cand.carry_ops)
    after = max(local_bytes(s, v.aval, mesh) for v, s in zip(eq.outputs, outs))
    return max(0.0, 2.0 * (after - before) * (n - 1) / n)


def _desired(program: Program, specs: list, out_demand: dict, mesh: ShardMesh) -> dict:
    """The layouts values should end in so that the requested output layouts need no
    move: each output's requested layout, pulled back through the equations that map
    every operand dimension to an output dimension (elementwise operations,
    broadcasts), last equation first. Propagation counts the move to a value's desired
    layout when nothing else asks for it yet, so it does not split a computation that
    the outputs want whole (a free local slice now, an AllGather at the end)."""
    desired = {v: reqs[0] for v, reqs in out_demand.items() if not reqs[0].partial}
    for eq, spec in zip(reversed(program.equations), reversed(specs)):
        if len(eq.outputs) != 1 or eq.outputs[0] not in desired:
            continue
        want, out_labels = desired[eq.outputs[0]], spec.outputs[0]
        for a, labels in zip(eq.inputs, spec.inputs):
            if not isinstance(a, Var) or a in desired or len(labels) != a.aval.ndim:
                continue
            if any(lab is not None and lab not in out_labels for lab in labels):
                continue
            dims = tuple(want.dims[out_labels.index(lab)] if lab is not None else ()
                         for lab in labels)
            if any(d and not dim_multiple_of(a.aval.shape[k], mesh.count(d))
                   for k, d in enumerate(dims)):
                continue
            desired[a] = Sharding(dims)
    return desired


def propagate(program: Program, in_shardings: list, out_shardings: list, mesh: ShardMesh,
              level: int = 0) -> Propagated:
    """Give every value a sharding (MindSpore's BFS; see the module docstring)."""
    model = CostModel(level=level)
    known: dict = {v: s for v, s in zip(program.inputs, in_shardings) if s is not None}
    demand: dict = {}     # Var -> layouts its decided consumers need
    out_demand: dict = {}  # Var -> layouts requested for it as a program output
    for v, s in zip(program.outputs, out_shardings):
        if isinstance(v, Var) and s is not None:
            out_demand.setdefault(v, []).append(s)
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
    desired = _desired(program, specs, out_demand, mesh)

    def decide(i):
        eq, spec = program.equations[i], specs[i]
        best, best_score = None, None
        partials = [known[a].partial if isinstance(a, Var) and a in known else frozenset()
                    for a in eq.inputs]
        carry = any(partials)  # the spec's linear groups say where it may pass
        for base in candidates(spec, mesh):
            options = [(base, 0.0)]
            if carry:
                options += [(c, _deferral_bytes(eq, spec, c, mesh))
                            for c in carry_variants(spec, base, eq.prim.name, partials)]
            for cand, extra in options:
                score = _eq_cost(eq, spec, cand, known, demand, mesh, model, extra,
                                 out_demand, desired)
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
    # A replicated annotation constrains nothing (any block of it is a free local
    # slice): start from the split ones, so their layouts reach those consumers first.
    seeds = [v for v, s in known.items() if s.used] or list(known)
    for v in seeds:
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


def redistribute(x, src: Sharding, dst: Sharding, mesh: ShardMesh, native: dict) -> list:
    """Emit the collectives moving ``x`` from ``src`` to ``dst``; returns ``(layout,
    value)`` after each step (the last is ``dst``'s), so that a caller can keep the
    whole value an AllReduce made on its way to a slice."""
    from fshard.primitives import collectives as C
    from fshard.primitives.spmd import block_slice

    out = []
    for st in plan(src, dst, native_reduce_scatter(native)):
        names = mesh.name(st.axes)
        if st.kind == "all_gather":
            x = C.all_gather(x, names, axis=st.dim, tiled=True)
        elif st.kind == "psum":
            x = C.psum(x, names)
        elif st.kind == "psum_scatter":
            x = C.psum_scatter(x, names, scatter_dimension=st.dim, tiled=True)
        else:
            x = block_slice(x, names, st.dim, tuple(mesh.sizes[a] for a in st.axes))
        src = after(src, st)
        out.append((src, x))
    return out


#: Primitives that communicate between devices.
COLLECTIVE_NAMES = frozenset({"psum", "all_gather", "psum_scatter", "all_to_all", "ppermute",
                              "pmax", "pmin", "pmean", "pbroadcast", "broadcast"})


@dataclass
class Partitioned:
    """The per-device Program and the layouts at its boundary."""

    prop: Propagated
    program: Program          # per device; inputs are local blocks
    consts: list
    in_shardings: list
    out_shardings: list
    annotations: dict         # per-device Var -> Sharding (for printing)
    name: str = ""

    def __str__(self) -> str:
        mesh = self.prop.mesh

        def annotate(v):
            sh = self.annotations.get(v)
            return "{" + sh.describe(mesh) + "}" if sh is not None else ""

        of = f" of {self.name}" if self.name else ""
        axes = ", ".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.sizes)) or "none"
        colls = ", ".join(self.collectives()) or "none"
        head = (f"# per-device program{of} on {mesh.size} devices (prime mesh axes {axes})\n"
                "# {split counts per dimension} after each value, as MindSpore writes "
                "strategies\n"
                f"# collectives: {colls}\n")
        return head + pretty(self.program, annotate)

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))

    def input_layouts(self) -> list:
        """The ``fs.Layout`` view of every input (for ``fs.visualize_sharding``)."""
        return [s.to_layout(self.prop.mesh) for s in self.in_shardings]

    def output_layouts(self) -> list:
        """The ``fs.Layout`` view of every output."""
        return [s.to_layout(self.prop.mesh) for s in self.out_shardings]

    def collectives(self) -> list[str]:
        """Names of the communicating equations (collectives), in order. Local slices
        (``block_slice``: keep this device's block of a value it holds whole) are not
        communication and are not listed."""
        return [eq.prim.name for eq in self.program.equations
                if eq.prim.name in COLLECTIVE_NAMES]

    def strategies(self) -> dict:
        """The strategy of every input, equation and output (a strategy file's content,
        JSON-ready): MindSpore's split counts per operand, plus the exact mesh axes
        (``layout``, ``assignment``) that ``Sharded.load_strategies`` reads back."""
        mesh = self.prop.mesh

        def value(s: Sharding) -> dict:
            d = {"strategy": list(s.strategy(mesh)),
                 "layout": [list(mesh.name(ax)) for ax in s.dims]}
            if s.partial:
                d["partial_sum"] = list(mesh.name(sorted(s.partial)))
            return d

        eqs = []
        for eq, (spec, cand) in zip(self.prop.program.equations, self.prop.choice):
            ins, outs = candidate_shardings(spec, cand)
            entry = {"primitive": eq.prim.name,
                     "in_strategy": [list(s.strategy(mesh)) for s in ins],
                     "out_strategy": [list(s.strategy(mesh)) for s in outs],
                     "partial_sum": [mesh.count(s.partial) for s in outs if s.partial],
                     "assignment": [[lab, list(mesh.name(ax))] for lab, ax in cand.assign]}
            if cand.carry:
                entry["carry"] = list(mesh.name(sorted(cand.carry)))
                entry["carry_operands"] = list(cand.carry_ops)
            eqs.append(entry)
        return {"device_num": mesh.size,
                "mesh_axes": list(mesh.sizes),
                "inputs": [value(s) for s in self.prop.in_shardings],
                "equations": eqs,
                "outputs": [value(s) for s in self.out_shardings]}


def _local_aval(aval, sh, mesh):
    return ArrayType(sh.local_shape(aval.shape, mesh), aval.dtype)


def partition(prop: Propagated) -> Partitioned:
    """The per-device Program of a propagated one: each equation on local blocks, and
    the collectives its operands' layout changes need.

    Each value keeps every layout it has been moved to, so a second consumer that needs
    the same layout (e.g. the reduced form of a pending sum) reuses it instead of
    communicating again, and a new layout is reached from the cheapest one held.
    """
    program, mesh = prop.program, prop.mesh
    native = native_collectives()
    scatter = native_reduce_scatter(native)
    outs_sh = list(prop.out_shardings)
    annotations: dict = {}

    def note(x, sh):
        if isinstance(x, StagedTracer):
            annotations[x.ir_var] = sh
        return x

    def per_device(*local_inputs):
        for x, sh in zip(local_inputs, prop.in_shardings):
            note(x, sh)
        held = {v: {s: x} for v, x, s in zip(program.inputs, local_inputs, prop.in_shardings)}

        def get(a, req):
            versions = held[a]
            if req in versions:
                return versions[req]
            sources = [s for s in versions if req.partial <= s.partial]
            src = min(sources, key=lambda s: (plan_bytes(s, req, a.aval, mesh, native),
                                              len(plan(s, req, scatter))))
            for sh, x in redistribute(versions[src], src, req, mesh, native):
                versions.setdefault(sh, note(x, sh))
            return versions[req]

        for eq, (spec, cand) in zip(program.equations, prop.choice):
            ins, outs = candidate_shardings(spec, cand)
            args = [a.value if isinstance(a, Literal) else get(a, req)
                    for a, req in zip(eq.inputs, ins)]
            params = eq.params
            if spec.local_params is not None:
                params = spec.local_params(
                    params, [_local_aval(a.aval, s, mesh) for a, s in zip(eq.inputs, ins)],
                    [_local_aval(v.aval, s, mesh) for v, s in zip(eq.outputs, outs)])
            res = bind(eq.prim, *args, **params)
            res = res if eq.prim.multiple_results else [res]
            for v, r, s in zip(eq.outputs, res, outs):
                held[v] = {s: note(r, s)}
        results = []
        for k, a in enumerate(program.outputs):
            if isinstance(a, Literal):
                outs_sh[k] = Sharding.replicated(a.aval.ndim)
                results.append(a.value)
                continue
            if outs_sh[k] is None:
                outs_sh[k] = as_produced(held[a], prop.shardings.get(a) or next(iter(held[a])))
            results.append(get(a, outs_sh[k]))
        return results

    local_avals = [_local_aval(v.aval, s, mesh) for v, s in zip(program.inputs, prop.in_shardings)]
    from fshard.primitives.collectives import named_axis

    with contextlib.ExitStack() as stack:
        for name, size in zip(mesh.names, mesh.sizes):  # collectives read the axis sizes
            stack.enter_context(named_axis(name, size))
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


def world_mesh(mesh: ShardMesh):
    """The ``fs.Mesh`` of ``mesh``'s prime axes over the ranks of this job (row-major,
    so rank r has the same coordinates on both)."""
    from fshard.mesh import Mesh

    return Mesh(mesh.sizes, mesh.names) if mesh.sizes else Mesh((1,), ("m0",))


def run_on_rank(part: Partitioned, args: list, mesh):
    """Run this rank's share of a partitioned program in a multi-process job: every
    process holds the global inputs; it keeps its blocks (``shard_in``), runs the
    per-device Program with the job's collectives, and gathers the global outputs
    (``shard_out``). ``mesh`` is ``world_mesh(...)``."""
    from fshard.primitives import collectives as C
    from fshard.primitives.spmd import block_slice_p

    pmesh = part.prop.mesh

    def dims(sh: Sharding) -> tuple:
        return tuple(pmesh.name(ax) for ax in sh.dims)

    blocks = [C.shard_in_p.bind(x, dims=dims(sh), mesh=mesh)
              for x, sh in zip(args, part.in_shardings)]
    program = part.program
    env = dict(zip(program.inputs, list(part.consts) + blocks, strict=True))

    def read(a):
        return a.value if isinstance(a, Literal) else env[a]

    for eq in program.equations:
        vals = [read(a) for a in eq.inputs]
        if eq.prim is block_slice_p:  # this rank's block of a value it holds whole
            d = [()] * eq.inputs[0].aval.ndim
            d[eq.params["dim"]] = tuple(eq.params["axis_name"])
            outs = [C.shard_in_p.bind(vals[0], dims=tuple(d), mesh=mesh)]
        else:
            params = dict(eq.params, mesh=mesh) if eq.prim in C.COLLECTIVES else eq.params
            outs = bind(eq.prim, *vals, **params)
            outs = outs if eq.prim.multiple_results else [outs]
        env.update(zip(eq.outputs, outs, strict=True))
    return [C.shard_out_p.bind(read(a), dims=dims(sh), mesh=mesh)
            for a, sh in zip(program.outputs, part.out_shardings)]


# ---------------------------------------------------------------------------
# shard_call: one sharded computation as one equation
# ---------------------------------------------------------------------------
#
# ``fs.shard`` binds ``shard_call`` with a ShardPlan: the *global* body Program, the
# layouts at its boundary (None: left to propagation), the mesh and the objective.
# Keeping the global body is what makes the derivative of a sharded function sharded
# as well as the function itself (NB: JAX's pjit_p keeps its jaxpr the same way):
#
# - JVP: the body's JVP is split (partial evaluation) into a *known* shard_call
#   (primal outputs + residuals) and a *linear* shard_call (residuals + tangents),
#   both with the layouts the primal call's propagation chose;
# - transpose: the linear body is transposed as a global Program, then propagated and
#   partitioned like any other, so ``grad(shard(f))`` pays the collectives the
#   backward math needs (one AllReduce for a Megatron MLP), never a per-device
#   transpose of the forward collectives;
# - lowering: on a virtual mesh, the per-device Program batched over the devices
#   becomes one helper function of the generated MindSpore module.


class ShardPlan:
    """What one ``shard_call`` runs. Propagated and partitioned once, on first use."""

    def __init__(self, body: Program, in_shardings, out_shardings, mesh: ShardMesh,
                 level: int = 0, name: str = "f", search: bool = False, fixed=None,
                 world=None, flexible=(), fusion: float | None = None):
        assert body.n_consts == 0, "a shard_call body takes its constants as inputs"
        self.body, self.mesh, self.level, self.name = body, mesh, level, name
        self.in_shardings, self.out_shardings = list(in_shardings), list(out_shardings)
        self.search, self.fixed = search, fixed
        # Inputs given as tuple strategies: their mesh axes are chosen with the plan.
        self.flexible = tuple(flexible)
        # Bucket size (bytes) for fusing the per-device AllReduces (None: no fusion).
        self.fusion = fusion
        # The fs.Mesh of prime axes of a multi-process job (one device per process), or
        # None on a virtual mesh.
        self.world = world
        self._part = None
        self._virtual = None
        self._compiled = None

    def derive(self, body: Program, in_shardings, out_shardings, what: str) -> "ShardPlan":
        """A plan for a program derived from this one (its JVP, transpose, batching):
        same mesh, objective, search and place of execution."""
        return ShardPlan(body, in_shardings, out_shardings, self.mesh, self.level,
                         f"{self.name}:{what}", self.search, world=self.world,
                         fusion=self.fusion)

    @property
    def executed(self) -> Program:
        """The Program whose equations actually run: the per-device program (its
        outputs correspond one to one with the body's)."""
        return self.partitioned().program

    def partitioned(self) -> Partitioned:
        if self._part is None:
            if self.flexible and self.fixed is None:
                self.in_shardings, self.out_shardings = choose_split_axes(
                    self.body, self.in_shardings, self.out_shardings, self.mesh, self.level,
                    self.flexible)
                self.flexible = ()
            prop = propagate(self.body, self.in_shardings, self.out_shardings, self.mesh,
                             self.level)
            if self.fixed is not None:
                prop = _apply_fixed(prop, self.fixed)
            elif self.search:
                from fshard.search import refine

                prop = refine(prop)
            self._part = partition(prop)
            self._part.name = self.name
            if self.fusion is not None:
                from fshard.passes import fuse_allreduces

                self._part.program = fuse_allreduces(self._part.program, self.fusion)
            for rewrite in getattr(self, "passes", ()):
                self._part.program = rewrite(self._part.program)
        return self._part

    def virtual_program(self) -> tuple[Program, list]:
        """The whole run as one Program, for lowering: on a virtual mesh, split the
        inputs, run the per-device Program batched over the devices, reassemble; in a
        multi-process job, this rank's blocks in, its per-device Program with the
        job's collectives, the global outputs out."""
        if self._virtual is None:
            from fshard import passes

            part = self.partitioned()
            run = run_virtual if self.world is None else functools.partial(
                run_on_rank, mesh=self.world)
            program, consts = stage(lambda *xs: run(part, list(xs)),
                                    [v.aval for v in self.body.inputs])
            # The block shuffles around the batched program fold into few operations.
            self._virtual = passes.simplify(program), consts
        return self._virtual

    def compiled(self):
        """The whole run compiled (collectives of a job only run in graphs)."""
        if self._compiled is None:
            from fshard.backend import mindspore as backend

            program, consts = self.virtual_program()
            src, globals_, _ = backend.lower_program(program, consts, f"shard_{self.name}")
            self._compiled = backend.compile_source(src, globals_, f"shard_{self.name}")
        return self._compiled

    def __str__(self) -> str:
        return f"<{self.name} on {self.mesh.size} devices>"

    __repr__ = __str__


def _shard_call_type(*avals, plan):
    assert [tuple(a.shape) for a in avals] == [tuple(v.aval.shape) for v in plan.body.inputs], \
        f"shard_call operands {avals} do not match its body"
    return list(plan.body.out_avals)


def _shard_call_impl(*args, plan):
    if plan.world is not None:
        from fshard.backend.mindspore import as_tensor

        out = _differentiable_call(plan)(*[as_tensor(x) for x in args])
        return [out] if len(plan.body.outputs) == 1 else list(out)
    return run_virtual(plan.partitioned(), list(args))


def _differentiable_call(plan):
    """The compiled per-device program of a multi-process job as an ``nn.Cell`` whose
    ``bprop`` is fshard's own derivative of the sharded function: MindSpore's autodiff
    (``mindspore.grad`` over a function calling an ``fs.shard`` function) must not
    differentiate the per-device graph itself, whose collectives' MindSpore gradients
    do not match their meaning here (wrong numbers, or ReduceScatter on CPU)."""
    cell = getattr(plan, "_ms_cell", None)
    if cell is None:
        from mindspore import nn, ops

        from fshard.transforms.ad import vjp

        class ShardCall(nn.Cell):
            def construct(self, *args):
                return plan.compiled()(*args)

            def bprop(self, *args_out_dout):
                args, dout = args_out_dout[:-2], args_out_dout[-1]
                diff = [i for i, a in enumerate(args) if dtypes.is_float(typeof(a).dtype)]

                def f(*d):
                    full = list(args)
                    for i, x in zip(diff, d):
                        full[i] = x
                    return tuple(shard_call_p.bind(*full, plan=plan))

                _, vjp_fn = vjp(f, *[args[i] for i in diff])
                cts = tuple(dout) if isinstance(dout, (tuple, list)) else (dout,)
                grads = vjp_fn(cts)
                out = [ops.zeros_like(a) for a in args]
                for i, g in zip(diff, grads):
                    out[i] = g
                return tuple(out)

        cell = plan._ms_cell = ShardCall()
    return cell


def _shard_call_lowering(ctx, *exprs, plan):
    from fshard.backend.mindspore import as_tensor

    program, consts = plan.virtual_program()
    closed = Program(program.inputs, program.equations, program.outputs)
    args = [ctx.ref(as_tensor(c), "const") for c in consts] + list(exprs)
    return f"{ctx.function(closed, 'shard')}({', '.join(args)})"


def _closed(program: Program) -> Program:
    return Program(program.inputs, program.equations, program.outputs)


def _shard_call_jvp(primals, tangents, *, plan):
    """Known shard_call (primal outputs + residuals), then linear shard_call."""
    from fshard.primitives._define import Zero, instantiate
    from fshard.transforms.ad import jvp_program, partial_eval

    body, part = plan.body, plan.partitioned()
    ins, outs = part.in_shardings, part.out_shardings
    nz = [i for i, t in enumerate(tangents) if not isinstance(t, Zero)]
    in_avals = [v.aval for v in body.inputs]
    n_in, n_out = len(in_avals), len(body.outputs)

    def jvp_flat(*xs):
        ts = [Zero(a) for a in in_avals]
        for i, t in zip(nz, xs[n_in:]):
            ts[i] = t
        o, to = jvp_program(body, list(xs[:n_in]), ts)
        return list(o) + [instantiate(t) for t in to]

    jprog, jconsts = stage(jvp_flat, in_avals + [in_avals[i] for i in nz])
    n_jc = len(jconsts)
    known, linear = partial_eval(jprog, [False] * (n_jc + n_in) + [True] * len(nz))
    primal_out = {}
    for j, a in enumerate(jprog.outputs[:n_out]):
        if isinstance(a, Var):
            primal_out.setdefault(a, outs[j])
    const_sh = [Sharding.replicated(v.aval.ndim) for v in jprog.inputs[:n_jc]]
    known_plan = plan.derive(_closed(known), const_sh + list(ins),
                             [primal_out.get(r) for r in known.outputs], "primal")
    res = shard_call_p.bind(*jconsts, *primals, plan=known_plan)
    value = dict(zip(known.outputs, res))
    primals_out = [a.value if isinstance(a, Literal) else value[a]
                   for a in jprog.outputs[:n_out]]
    res_sh = known_plan.partitioned().out_shardings
    lin = Program(linear.inputs, linear.equations, linear.outputs[n_out:])
    lin_plan = plan.derive(lin, list(res_sh) + [ins[i] for i in nz], list(outs), "tangent")
    tangents_out = shard_call_p.bind(*res, *[tangents[i] for i in nz], plan=lin_plan)
    return primals_out, list(tangents_out)


def _shard_call_transpose(cts, *args, plan):
    """Transpose the global body, then shard it like any Program."""
    from fshard.primitives._define import Zero, instantiate, is_undefined
    from fshard.transforms.ad import backward_pass, partial_eval

    body, part = plan.body, plan.partitioned()
    ins, outs = part.in_shardings, part.out_shardings
    lin = [i for i, a in enumerate(args) if is_undefined(a)]
    res = [i for i, a in enumerate(args) if not is_undefined(a)]
    nzc = [j for j, c in enumerate(cts) if not isinstance(c, Zero)]
    if not nzc:
        return [Zero(args[i].aval) if i in lin else None for i in range(len(args))]
    reordered = Program([body.inputs[i] for i in res] + [body.inputs[i] for i in lin],
                        body.equations, body.outputs)
    known, linear = partial_eval(reordered, [False] * len(res) + [True] * len(lin))

    def transposed(*xs):
        residuals = eval_program(known, *xs[:len(res)])
        cs = [Zero(a.aval) for a in body.outputs]
        for j, c in zip(nzc, xs[len(res):]):
            cs[j] = c
        cts_in = backward_pass(linear, len(known.outputs), residuals, cs)
        return [instantiate(c) for c in cts_in]

    t_prog, t_consts = stage(transposed, [body.inputs[i].aval for i in res]
                             + [body.outputs[j].aval for j in nzc])
    t_plan = plan.derive(
        _closed(t_prog),
        [Sharding.replicated(v.aval.ndim) for v in t_prog.inputs[:len(t_consts)]]
        + [ins[i] for i in res] + [outs[j] for j in nzc],
        [ins[i] for i in lin], "transpose")
    cts_in = shard_call_p.bind(*t_consts, *[args[i] for i in res],
                               *[cts[j] for j in nzc], plan=t_plan)
    it = iter(cts_in)
    return [next(it) if i in lin else None for i in range(len(args))]


def _shard_call_batching(args, dims, *, plan):
    """A batched shard_call shards the batched body; the batch dimension is replicated
    (this serves ``jacrev``/``hessian`` of a sharded function; ``vmap(shard(f))`` itself
    is refused before it gets here, see ``Sharded.__call__``)."""
    from fshard.primitives._batching import move_axis
    from fshard.transforms.vmap import batch_program, current_axis

    axis = current_axis()
    args = [x if d is None else move_axis(x, d, 0) for x, d in zip(args, dims)]
    dims = [None if d is None else 0 for d in dims]
    body = plan.body
    in_avals = [v.aval if d is None else ArrayType((axis.size,) + tuple(v.aval.shape),
                                                   v.aval.dtype)
                for v, d in zip(body.inputs, dims)]

    def batched(*xs):
        from fshard.primitives._batching import batch_to_front

        o, od = batch_program(body, list(xs), list(dims), axis)
        return [batch_to_front(y, d, axis.size) for y, d in zip(o, od)]

    b_prog, b_consts = stage(batched, in_avals)

    def lift(sh):
        return None if sh is None else Sharding(((),) + tuple(sh.dims), sh.partial)

    b_plan = plan.derive(
        _closed(b_prog),
        [Sharding.replicated(v.aval.ndim) for v in b_prog.inputs[:len(b_consts)]]
        + [sh if d is None else lift(sh) for sh, d in zip(plan.in_shardings, dims)],
        [lift(sh) for sh in plan.out_shardings], "batched")
    outs = shard_call_p.bind(*b_consts, *args, plan=b_plan)
    return list(outs), [0] * len(outs)


def _def_shard_call():
    from fshard.core import Primitive
    from fshard.rules import (
        abstract_eval,
        batching,
        impl,
        jvp,
        lowering,
        register_primitive,
        transpose,
        unsupported,
    )

    prim = Primitive("shard_call", multiple_results=True)
    register_primitive(prim, "spmd")
    abstract_eval.set(prim, _shard_call_type)
    impl.set(prim, _shard_call_impl)
    lowering.set(prim, _shard_call_lowering)
    jvp.set(prim, _shard_call_jvp)
    transpose.set(prim, _shard_call_transpose)
    batching.set(prim, _shard_call_batching)
    unsupported(prim, "sharding", "fs.shard cannot nest: a shard_call is never re-sharded")
    return prim


shard_call_p = _def_shard_call()


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
    from fshard.mesh import Mesh, resolve_mesh

    if mesh is None:
        return resolve_mesh(None).size
    if isinstance(mesh, Mesh):
        return mesh.size
    if _is_count(mesh) and mesh >= 1:
        return int(mesh)
    raise ShardingError(
        f"shard({fname}): mesh must be an fs.Mesh, a positive device count, or None; got "
        f"{type(mesh).__name__} {mesh!r}.\nFix: mesh=8 or mesh=fs.Mesh((2, 4), ('dp', 'mp')).")


def _devices_and_place(mesh, fname: str) -> tuple[int, bool]:
    """``(device count, whether the devices are this multi-process job's ranks)``."""
    from fshard import distributed
    from fshard.mesh import Mesh, resolve_mesh

    n = _device_count(mesh, fname)
    if isinstance(mesh, Mesh):
        in_job = not mesh.is_virtual
    elif mesh is None:
        in_job = not resolve_mesh(None).is_virtual
    else:
        in_job = distributed.is_initialized()
    if in_job and n != distributed.world_size():
        raise ShardingError(
            f"shard({fname}): the mesh has {n} devices but this job has "
            f"{distributed.world_size()} processes (one device each).\nFix: use a mesh of "
            f"{distributed.world_size()} devices, or fs.Mesh(..., virtual=True) to simulate "
            "it in each process.")
    return n, in_job


def _is_strategy_leaf(s) -> bool:
    """A strategy (not a container of strategies): None, a Layout, or a flat tuple."""
    from fshard.layout import Layout

    if s is None or isinstance(s, Layout):
        return True
    if isinstance(s, (tuple, list)):
        # Split counts, not a container of arrays (a tuple (w, b) of parameters).
        return all(not isinstance(c, (tuple, list, dict, Layout)) and c is not None
                   and (isinstance(c, np.generic) or not hasattr(c, "shape")) for c in s)
    return not isinstance(s, dict)


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
                 dataset_strategy, search):
        fname = fun_name(fn)
        from fshard.cells import functional, is_cell

        if not callable(fn):
            raise ShardingError(
                f"fs.shard expects a function or an nn.Cell; got {type(fn).__name__} {fn!r}.")
        if type(level) is not int or level not in (0, 1, 2):
            raise ShardingError(
                f"shard({fname}): level must be 0 (best compute/communication ratio), 1 "
                f"(least memory) or 2 (fastest); got {level!r}.\nFix: pass level=0, 1 or 2.")
        if not isinstance(search, bool):
            raise ShardingError(
                f"shard({fname}): search must be True (plan the whole program with "
                f"fshard's search) or False (propagation only); got {search!r}.")
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
        if mesh is None:  # made inside `with fs.Mesh(...)`: keep that mesh
            from fshard.mesh import current_mesh

            mesh = current_mesh()
        else:
            _device_count(mesh, fname)
        self.fn, self.in_strategy, self.out_strategy = fn, tuple(in_strategy), out_strategy
        self.parameter_plan, self.level, self.mesh = parameter_plan, level, mesh
        self.dataset_strategy, self.search = dataset_strategy, search
        # Bucket size in bytes for fusing gradient AllReduces (``fs.AutoParallel``'s
        # ``comm_fusion``); None: one AllReduce per value.
        self.comm_fusion = None
        self.passes = ()  # rewrites of the per-device program (fs.AutoParallel's)
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
            if self.in_strategy and all(_is_count(c) for c in self.in_strategy):
                hint = (f" For one argument, write in_strategy=({self.in_strategy!r},) "
                        "(a tuple of strategies).")
            raise ShardingError(
                f"shard({fname}): in_strategy has "
                f"{_plural(len(self.in_strategy), 'entry', 'entries')}, but {fname} was "
                f"called with {_plural(len(args), 'positional argument', 'positional arguments')}."
                "\nRule: in_strategy gives one strategy (or None) per positional argument."
                f"\nFix: give {_plural(len(args), 'entry', 'entries')}; None lets "
                f"propagation choose.{hint}")
        entries = []
        for i, (a, s) in enumerate(zip(args, self.in_strategy)):
            paths, leaves_i, _ = tree.flatten_with_path(a)
            try:
                per_leaf = tree.broadcast_prefix(s, a, is_leaf=_is_strategy_leaf)
            except ValueError as e:
                raise ShardingError(
                    f"shard({fname}): in_strategy[{i}] = {s!r} does not match the structure "
                    f"of argument {i}: {e}\nFix: give one strategy per array (a pytree "
                    "prefix of the argument), or None.") from None
            for p, x, e in zip(paths, leaves_i, per_leaf):
                entries.append((e, f"shard({fname}): in_strategy[{i}]{tree.keystr(p)}",
                                self._what(i, p, x), True))
        fn = self.fn
        if self._cell is not None:
            params = dict(self._cell.parameters_and_names())
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

    def _plan(self, fn, leaves, entries, in_tree):
        fname = fun_name(self.fn)
        n, in_job = _devices_and_place(self.mesh, fname)
        key = (in_tree, tuple((tuple(typeof(x).shape), typeof(x).dtype) for x in leaves), n,
               in_job)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        mesh = ShardMesh.for_devices(n)
        with context.counted(context.shard_depth):
            traced = trace_fun(fn, in_tree, [typeof(x) for x in leaves])
        prog = traced.program
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
        out_sh, out_flexible = self._out_shardings(prog, mesh, fname, traced.out_tree)
        flexible += [("out", k) for k in out_flexible]
        body = Program(prog.inputs, prog.equations, prog.outputs)
        plan = ShardPlan(body, in_sh, out_sh, mesh, self.level, fname, self.search,
                         self._fixed, world=world_mesh(mesh) if in_job else None,
                         flexible=flexible, fusion=self.comm_fusion)
        plan.passes = self.passes
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
            if isinstance(strat, (tuple, list)) and not _is_strategy_leaf(strat):
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
                    not _is_strategy_leaf(strat) and len(strat) != len(shape):
                raise ShardingError(
                    f"shard({fname}): out_strategy has {len(strat)} entries, but {fname} "
                    f"returns {len(shape)} outputs {shape}.\nRule: out_strategy gives one "
                    "strategy per output.\nFix: give one entry per output (None for the "
                    "default layout of that output).")
            try:
                per_leaf = tree.broadcast_prefix(strat, shape, is_leaf=_is_strategy_leaf)
            except ValueError as e:
                raise ShardingError(
                    f"shard({fname}): out_strategy = {strat!r} does not match the outputs "
                    f"{shape}: {e}\nFix: give a pytree prefix of the outputs.") from None
        paths, _, _ = tree.flatten_with_path(shape)
        out = []
        for k, (s, a, p) in enumerate(zip(per_leaf, outs, paths)):
            sh = parse_strategy(s, a, mesh, f"shard({fname}): out_strategy{tree.keystr(p)}",
                                f"output {k} ({a})")
            out.append(sh if sh is not None else Sharding.replicated(a.ndim))
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
                "in_strategy/out_strategy.")
        if kwargs:
            raise ShardingError(
                f"shard({fname}) was called with keyword arguments {sorted(kwargs)}; a "
                "sharded function takes its arrays positionally (one in_strategy entry "
                "each).\nFix: pass them positionally.")
        fn, leaves, entries, in_tree = self._flat_call(args)
        n, in_job = _devices_and_place(self.mesh, fname)
        # data_parallel in a job: each process passes its own slice of each unannotated
        # argument and gets its block of each unannotated output (local_batch.py).
        sliced = [in_job and self.dataset_strategy == "data_parallel" and e is None and
                  is_arg and typeof(x).ndim > 0 for (e, _, _, is_arg), x in zip(entries, leaves)]
        plan, traced = self._plan(fn, [local_batch.global_type(x, n) if s else x
                                       for s, x in zip(sliced, leaves)], entries, in_tree)
        if any(sliced):
            leaves = local_batch.place_inputs(plan.partitioned(), len(traced.consts), leaves,
                                              sliced, distributed.rank())
        outs = shard_call_p.bind(*traced.consts, *leaves, plan=plan)
        if any(sliced) and self.out_strategy is None:
            outs = local_batch.take_outputs(plan.partitioned(), outs, distributed.rank())
        return tree.unflatten(traced.out_tree, outs)

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


def write_json_atomic(path, data, what: str) -> None:
    """Write ``data`` as JSON to ``path``: to a temporary file in the same directory,
    flushed to disk, then renamed over ``path`` (so ``path`` is always a whole file)."""
    import os
    import tempfile

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ShardingError(
            f"cannot write the {what} {path!r}: the directory {folder!r} does not exist.\n"
            "Fix: create it first (os.makedirs).")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".fshard-", suffix=".json.tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise ShardingError(
            f"cannot write the {what} {path!r}: {e.strerror or e}. The previous file, if any, "
            "is unchanged.\nFix: free disk space or choose another path.") from e
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def read_strategy_file(path) -> dict:
    """The content of a strategy file written by ``save_strategies``, checked for form
    (every problem an error naming the file)."""
    def bad(why, fix="save it again with save_strategies"):
        raise ShardingError(f"strategy file {path!r}: {why}.\nFix: {fix}.")

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        bad("no such file", "give the path save_strategies wrote")
    except IsADirectoryError:
        bad("is a directory, not a file", "give the path of the .json file")
    except UnicodeDecodeError:
        bad("is not text (not a JSON strategy file)")
    except json.JSONDecodeError as e:
        bad(f"is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); it may be "
            "truncated")
    except RecursionError:
        bad("is nested too deeply to be a strategy file")
    except OSError as e:
        bad(f"cannot be read ({e.strerror or e})", "check the path and its permissions")
    if not isinstance(data, dict):
        bad(f"holds a JSON {type(data).__name__}, not the object save_strategies writes")
    if not isinstance(data.get("device_num"), int):
        bad("has no integer 'device_num'")
    for key in ("inputs", "equations"):
        if not isinstance(data.get(key), list):
            bad(f"has no list '{key}'")
    for k, entry in enumerate(data["inputs"]):
        if not (isinstance(entry, dict) and isinstance(entry.get("layout"), list)):
            bad(f"inputs[{k}] has no 'layout' list")
        for d in entry["layout"]:
            _check_axis_list(bad, f"inputs[{k}].layout", d)
    for k, entry in enumerate(data["equations"]):
        if not (isinstance(entry, dict) and isinstance(entry.get("primitive"), str)):
            bad(f"equations[{k}] has no 'primitive' name")
        if not isinstance(entry.get("assignment"), list):
            bad(f"equations[{k}] ('{entry['primitive']}') has no 'assignment' list (the "
                "mesh axes of each factor)")
        for pair in entry["assignment"]:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                bad(f"equations[{k}].assignment has the entry {pair!r}, not [factor, axes]")
            _check_axis_list(bad, f"equations[{k}].assignment", pair[1])
        for key in ("carry",):
            if key in entry:
                _check_axis_list(bad, f"equations[{k}].{key}", entry[key])
    return data


def _check_axis_list(bad, where, axes) -> None:
    if not (isinstance(axes, list) and all(
            isinstance(a, str) and len(a) > 1 and a[0] == "m" and a[1:].isdigit()
            for a in axes)):
        bad(f"{where} has {axes!r} where a list of mesh axis names like ['m0', 'm1'] "
            "belongs")


def _apply_fixed(prop: Propagated, data: dict) -> Propagated:
    """Replace propagation's choices by those of a loaded strategy file."""
    from fshard.sharding import Candidate

    mesh, program = prop.mesh, prop.program

    def axes_of(names):
        axes = tuple(int(n[1:]) for n in names)
        if any(a >= len(mesh.sizes) for a in axes):
            bad(f"it names mesh axes {list(names)}, but this mesh has "
                f"{len(mesh.sizes)} prime axes (m0..m{len(mesh.sizes) - 1})")
        return axes

    def bad(why):
        raise ShardingError(
            f"the loaded strategy file does not fit this program: {why}.\nFix: save the "
            "strategies again (save_strategies) for this function and these argument "
            "shapes.")

    if data.get("device_num") != mesh.size:
        bad(f"it is for {data.get('device_num')} devices, the mesh has {mesh.size}")
    eqs = data.get("equations", [])
    if len(eqs) != len(program.equations):
        bad(f"it has {len(eqs)} equations, the program {len(program.equations)}")
    known = {}
    ins = []
    for v, entry in zip(program.inputs, data["inputs"]):
        sh = Sharding(tuple(axes_of(d) for d in entry["layout"]))
        known[v] = sh
        ins.append(sh)
    choice = []
    for k, (eq, entry, (spec, _)) in enumerate(zip(program.equations, eqs, prop.choice)):
        if entry["primitive"] != eq.prim.name:
            bad(f"equation {k} is '{eq.prim.name}' here but '{entry['primitive']}' in the "
                "file")
        cand = Candidate(tuple((lab, axes_of(ax)) for lab, ax in entry["assignment"]),
                         frozenset(axes_of(entry.get("carry", []))),
                         tuple(entry.get("carry_operands", [])))
        choice.append((spec, cand))
        _, outs = candidate_shardings(spec, cand)
        known.update(zip(eq.outputs, outs))
    return Propagated(program, mesh, known, choice, ins, prop.out_shardings,
                      prop.given_inputs, prop.level)


def shard(fn, in_strategy, out_strategy=None, parameter_plan=None, device=None, level=0,
          mesh=None, *, dataset_strategy="full_batch", search=False, in_shapes=None):
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
            the launcher's world, or ``FSHARD_DEVICES``.
        dataset_strategy: "full_batch" (default: whole inputs, replicated outputs) or
            "data_parallel" (an unannotated argument is each device's batch slice; the
            outputs are split along the batch).
        search: refine propagation by a search over the whole program's cost.
        in_shapes: declared input shapes with ``fs.Symbol`` dimensions, one entry per
            positional argument, as ``fs.jit``'s (``set_inputs`` is the same): every call
            whose shapes the Symbols accept runs one program, partitioned and compiled
            once; a split symbolic dimension must be provably divisible by its split
            count (docs/dynamic_shapes.md).

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
                  dataset_strategy, search)
    return out if in_shapes is None else out.set_inputs(*_in_shapes_tuple(in_shapes))


def _in_shapes_tuple(in_shapes) -> tuple:
    if not isinstance(in_shapes, (tuple, list)):
        raise ShardingError(
            f"fs.shard(in_shapes=...) must be a tuple with one entry per positional "
            f"argument, got {type(in_shapes).__name__} {in_shapes!r}.\nFix: in_shapes=("
            "fs.ArrayType((fs.Symbol(divisor=8), 784), mindspore.float32), None, ...).")
    return tuple(in_shapes)
