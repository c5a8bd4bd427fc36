"""Strategies: what users write (MindSpore's split counts per dimension, an
``fs.Layout`` view, or None) as the layouts fshard partitions with.

One parser serves ``fs.shard``, ``fs.shard_map`` and ``AutoParallel``: ``is_strategy_leaf``
tells a strategy from a container of strategies (for pytrees of strategies, and
MindSpore's 1-tuple for a single output), ``fs.layout.check_strategy`` checks a tuple
of split counts against the value and the device count (the one check, also behind
``fs.visualize_sharding``), ``parse_strategy`` gives ``fs.shard`` its ``Sharding`` over
the prime axes of a ``ShardMesh``, and ``mesh_dims`` gives ``fs.shard_map`` the named
axes of its ``fs.Mesh``. Which mesh axes a tuple strategy
uses is chosen later, jointly for all of them (fshard/sharding/search.py
``choose_split_axes``); a ``Layout`` pins them.
"""

from __future__ import annotations

import itertools

import numpy as np

from fshard.core import tree
from fshard.core.tracing import ArrayType
from fshard.core.dims import dim_multiple_of
from fshard.errors import ShardingError
from fshard.meshes.layout import Layout, _divisors, _or_list, check_strategy
from fshard.sharding.layouts import ShardMesh, Sharding


def plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def is_count(c) -> bool:
    return isinstance(c, (int, np.integer)) and not isinstance(c, (bool, np.bool_))


def parse_strategy(entry, aval: ArrayType, mesh: ShardMesh, where: str,
                   what: str = "the value") -> Sharding | None:
    """A user strategy (tuple of split counts, ``fs.Layout`` view, or None) as a Sharding.

    ``where`` names the strategy in messages (``"shard(f): in_strategy[0]"``) and
    ``what`` the value it describes (``"argument 'x' (f32[32,128])"``).

    >>> from fshard.core.tracing import ArrayType
    >>> from fshard import dtypes
    >>> parse_strategy((4, 2), ArrayType((32, 128), dtypes.float32), ShardMesh.for_devices(8),
    ...                "in_strategy[0]").dims
    ((0, 1), (2,))
    """
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
    entry = check_strategy(entry, mesh.size, ndim=aval.ndim, name=where, what=what)
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


def _layout_axes(view, mesh: ShardMesh, where: str) -> list[tuple[int, ...]]:
    """Per device-matrix axis of a Layout, the prime mesh axes it is made of (major
    first), such that the Layout's ``rank_list`` puts every device where the mesh has
    it. Ranks are row-major on both; a rank_list that permutes whole axes (e.g. ranks
    ``[0, 4, 2, 6, 1, 5, 3, 7]`` for (2, 2, 2)) maps to a reordering of them."""
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
            f"{where} = {view!r} has {plural(view.ndim, 'entry', 'entries')}, but {what} "
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


def is_strategy_leaf(s) -> bool:
    """A strategy (not a container of strategies): None, a Layout, or a flat tuple."""
    if s is None or isinstance(s, Layout):
        return True
    if isinstance(s, (tuple, list)):
        # Split counts, not a container of arrays (a tuple (w, b) of parameters).
        return all(not isinstance(c, (tuple, list, dict, Layout)) and c is not None
                   and (isinstance(c, np.generic) or not hasattr(c, "shape")) for c in s)
    return not isinstance(s, dict)


def argument_strategies(origin: str, i: int, strategy, arg) -> tuple:
    """``(paths, leaves, structure, strategies)`` of positional argument ``i``:
    ``strategy`` (a pytree prefix of ``arg``) broadcast to one strategy per leaf. ``origin`` names the caller
    in the error (``shard(f)``)."""
    paths, leaves, structure = tree.flatten_with_path(arg)
    try:
        per_leaf = tree.broadcast_prefix(strategy, arg, is_leaf=is_strategy_leaf)
    except ValueError as e:
        raise ShardingError(
            f"{origin}: in_strategy[{i}] = {strategy!r} does not match the structure of "
            f"argument {i}: {e}\nFix: give one strategy per array (a pytree prefix of the "
            "argument), or None.") from None
    return paths, leaves, structure, per_leaf


# ---------------------------------------------------------------------------
# fs.shard_map: strategies over the named axes of an fs.Mesh
# ---------------------------------------------------------------------------


def _counts_to_mesh_axes(counts, ndim: int, mesh, where: str) -> tuple:
    """Split counts -> mesh axes: dims take consecutive mesh axes in order, each dim
    the shortest run (from the first unused axis) whose sizes multiply to its count."""
    counts = check_strategy(counts, mesh.size, ndim=ndim, name=where, what="the value")
    names, sizes = mesh.axis_names, mesh.shape
    dims, a = [], 0
    for k, c in enumerate(counts):
        axes, prod = [], 1
        while prod < c and a < len(names):
            axes.append(names[a])
            prod *= sizes[a]
            a += 1
        if prod != c:
            unused = ", ".join(f"{n!r} ({s})" for n, s in zip(names, sizes)
                               if n not in {x for d in dims for x in d})
            raise ShardingError(
                f"{where} = {counts!r} splits dimension {k} into {c} parts, but the mesh "
                f"{mesh!r} has no run of consecutive unused axes of total size {c} there "
                f"(unused axes in order: {unused or 'none'}). A tuple of split counts takes "
                "mesh axes in order, dimension by dimension.\nFix: pass a Layout view that "
                f"names the axes, e.g. mesh.layout(...), or choose counts that are products "
                "of consecutive mesh axis sizes.")
        dims.append(tuple(axes))
    return tuple(dims)


def _layout_to_mesh_axes(view: Layout, ndim: int, mesh, where: str) -> tuple:
    if not view.is_view:
        raise ShardingError(
            f"{where} is the Layout {view!r}, not a view of a tensor.\nFix: call it with one "
            f"entry per dimension, e.g. layout({view.alias_name[0]!r}, 'None').")
    if view.ndim != ndim:
        raise ShardingError(
            f"{where} = {view!r} names {view.ndim} dimensions, but the value has rank {ndim}."
            "\nFix: give the Layout view one entry per dimension ('None' for unsplit).")
    dims = []
    for entry in view.spec:
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,))
                     if a != "None")
        for a in axes:
            if a not in mesh.axis_names:
                raise ShardingError(
                    f"{where} = {view!r} splits over the axis {a!r}, which the mesh {mesh!r} "
                    "does not have.\nFix: use the mesh's axis names in the Layout, or pass "
                    "the matching mesh=fs.Mesh(...).")
            size = view.device_matrix[view.alias_name.index(a)]
            if size != mesh.axis_size(a):
                raise ShardingError(
                    f"{where} = {view!r} gives axis {a!r} {size} devices, but in the mesh "
                    f"{mesh!r} it has {mesh.axis_size(a)}.\nFix: build the Layout from the "
                    "mesh: mesh.layout(...).")
        dims.append(axes)
    return tuple(dims)


def mesh_dims(entry, ndim: int, mesh, where: str) -> tuple:
    """``fs.shard_map``'s form of a strategy: per dimension, the names of the axes of
    the ``fs.Mesh`` splitting it. Split counts take the mesh axes in order, dimension
    by dimension; a ``Layout`` view names them."""
    if entry is None:
        return ((),) * ndim
    if isinstance(entry, Layout):
        return _layout_to_mesh_axes(entry, ndim, mesh, where)
    if isinstance(entry, (tuple, list)):  # split counts, checked there
        return _counts_to_mesh_axes(entry, ndim, mesh, where)
    hint = ""
    if isinstance(entry, (int, np.integer)):
        hint = (" A bare int is not a strategy: if the function has one argument, wrap its "
                "strategy in a 1-tuple, e.g. in_strategy=((4, 1),).")
    raise ShardingError(
        f"{where} must be a tuple of split counts (one per dimension), a fs.Layout view, or "
        f"None (replicated); got {entry!r} ({type(entry).__name__}).{hint}")


class _Slot:
    """Stands for one array of an argument or output while strategies are broadcast
    over its pytree (so that a container of ints is never taken for a strategy)."""


def broadcast_strategies(prefix, structure) -> list:
    """One strategy per leaf of ``structure`` (a treedef) from the prefix tree."""
    slots = tree.unflatten(structure, [_Slot() for _ in range(structure.num_leaves)])
    return tree.broadcast_prefix(prefix, slots, is_leaf=is_strategy_leaf)
