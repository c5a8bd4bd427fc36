"""Running a per-device Program, for ``fs.shard`` and ``fs.shard_map`` alike: on a
virtual mesh, batched over the mesh axes in one process (``to_blocks``,
``run_batched``, ``from_blocks``); in a multi-process job, this rank's share with the
job's collectives (``run_on_rank``).

A value's layout here is, per dimension, the names of the mesh axes splitting it
(major first); ``axes`` lists the mesh's ``(name, size)`` pairs in mesh order.
Per-rank execution binds each equation with ``bind_on_rank``.
"""

from __future__ import annotations

import math

import numpy as np

from fshard.core.tracing import ArrayType, bind, typeof
from fshard.core.interpret import AxisData, batch_program, eval_program, walk
from fshard.core.ir import Equation, Program
from fshard.primitives import collectives as C
from fshard.primitives.base import batch_to_front
from fshard.primitives.spmd import block_slice_p
from fshard.primitives.structural import gather_p, reshape, transpose
from fshard.sharding.layouts import ShardMesh, Sharding
from fshard.sharding.partition import Partitioned
from fshard.core.staging import stage


def _count(axes, sizes: dict) -> int:
    return math.prod(sizes[a] for a in axes)


def to_blocks(x, dims, axes):
    """Global value -> one leading axis per mesh axis splitting it (in mesh order), then
    the local block's dimensions."""
    sizes = dict(axes)
    shape = typeof(x).shape
    split, axis_pos, local_pos = [], {}, []
    for n, dim_axes in zip(shape, dims):
        for a in dim_axes:
            axis_pos[a] = len(split)
            split.append(sizes[a])
        local_pos.append(len(split))
        split.append(n // _count(dim_axes, sizes))
    if not axis_pos:
        return x
    x = reshape(x, tuple(split))
    lead = [axis_pos[a] for a, _ in axes if a in axis_pos]
    return transpose(x, tuple(lead + local_pos))


def from_blocks(y, dims, axes):
    """The inverse of ``to_blocks``: leading block axes (mesh order) + local dims -> the
    global value."""
    sizes = dict(axes)
    split = {a for dim_axes in dims for a in dim_axes}
    used = [a for a, _ in axes if a in split]
    if not used:
        return y
    shape = typeof(y).shape
    k = len(used)
    perm, out = [], []
    for d, dim_axes in enumerate(dims):
        perm.extend(used.index(a) for a in dim_axes)
        perm.append(k + d)
        out.append(shape[k + d] * _count(dim_axes, sizes))
    return reshape(transpose(y, tuple(perm)), tuple(out))


def run_batched(program, args, in_splits, out_splits, axes, varying=None) -> list:
    """Run ``program`` on every device of a virtual mesh at once: batched over each of
    ``axes`` (``(name, size)``, mesh order), one axis name per mesh axis, so collectives
    over a name act across that axis's lanes. Argument i carries a leading block axis
    for each mesh axis in ``in_splits[i]`` (as ``to_blocks`` makes them); output j gets
    one for each axis in ``out_splits[j]``. An output that differs across the lanes of
    an axis it is not split over calls ``varying(j, name)`` (which may raise), then
    device 0 of that axis gives its value."""
    def level(k, xs):
        if k == len(axes):
            return eval_program(program, *xs)
        name, size = axes[k]
        dims = [0 if name in s else None for s in in_splits]
        avals = []
        for x, d in zip(xs, dims):
            a = typeof(x)
            avals.append(a if d is None else ArrayType(tuple(a.shape[1:]), a.dtype))
        inner, consts = stage(lambda *ys: level(k + 1, ys), avals)
        outs, out_ds = batch_program(inner, list(consts) + list(xs),
                                     [None] * len(consts) + dims, AxisData(name, size))
        res = []
        for j, (o, d) in enumerate(zip(outs, out_ds)):
            if name in out_splits[j]:
                res.append(batch_to_front(o, d, size))
            elif d is None:
                res.append(o)
            else:
                if varying is not None:
                    varying(j, name)
                res.append(gather_p.bind(o, np.int32(0), axis=d))
        return res

    return level(0, list(args))


def _names(sh: Sharding, mesh: ShardMesh) -> tuple:
    return tuple(mesh.name(ax) for ax in sh.dims)


def run_virtual(part: Partitioned, args: list):
    """Run ``fs.shard``'s per-device Program on a virtual mesh: split the global
    inputs into blocks, run every device at once, reassemble the global outputs.
    Mesh axes the plan only ever uses together run as one (``merge_axes``)."""
    # (once per per-device program: an eager call of fs.shard comes here every time)
    if part.virtual is None or part.virtual[0] is not part.program:
        mesh = part.prop.mesh
        axes = list(zip(mesh.names, mesh.sizes))
        in_dims = [_names(sh, mesh) for sh in part.in_shardings]
        out_dims = [_names(sh, mesh) for sh in part.out_shardings]
        part.virtual = (part.program, *merge_axes(part.program, axes, [in_dims, out_dims]))
    _, program, axes, (in_dims, out_dims) = part.virtual
    blocks = [to_blocks(x, d, axes) for x, d in zip(args, in_dims)]
    splits = [frozenset(a for ax in d for a in ax) for d in in_dims]
    outs = run_batched(program, list(part.consts) + blocks,
                       [frozenset()] * len(part.consts) + splits,
                       [frozenset(a for ax in d for a in ax) for d in out_dims], axes)
    return [from_blocks(y, d, axes) for y, d in zip(outs, out_dims)]


# ---------------------------------------------------------------------------
# Mesh axes used together run as one
# ---------------------------------------------------------------------------
#
# A virtual mesh runs a per-device Program batched once per mesh axis: every value
# split over the prime axes of 8 devices carries three lane dimensions (2, 2, 2). Where
# the plan never uses those axes apart (data parallelism over every device: each split
# and each collective names all three, in mesh order), one lane dimension of 8 is the
# same program with fewer dimensions in every kernel: a Llama block's data-parallel
# step ran 1.08x slower with three (a hand-written shard_map on a (2, 2, 2) mesh
# against an (8,) one, the same program otherwise).

#: The primitives naming mesh axes whose meaning is kept when consecutive axes named
#: together, in mesh order, become one axis of their sizes' product (a device's index
#: over them is row-major either way). Another primitive naming axes (``ppermute``'s
#: ``perm`` and ``broadcast``'s ``root`` are per-axis) keeps the mesh as it is.
_MERGEABLE = frozenset(["psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter",
                        "axis_index", "block_slice", "replica_sum", "replica_split"])


def _bodies(params: dict) -> dict:
    """The sub-Programs among an equation's parameters (a loop's body, a cond's
    branches)."""
    return {k: v for k, v in params.items() if isinstance(v, Program) or (
        isinstance(v, tuple) and v and all(isinstance(p, Program) for p in v))}


def _axis_uses(program: Program, out: list) -> bool:
    """Append every tuple of axis names ``program``'s equations name to ``out``; False
    when one of them cannot be merged."""
    for eq in program.equations:
        if "axis_name" in eq.params:
            if eq.prim.name not in _MERGEABLE:
                return False
            out.append(tuple(eq.params["axis_name"]))
        for v in _bodies(eq.params).values():
            if not all(_axis_uses(p, out) for p in (v if isinstance(v, tuple) else (v,))):
                return False
    return True


def merge_axes(program: Program, axes: list, dims: list) -> tuple:
    """``(program, axes, dims)`` with every run of consecutive mesh axes that each use
    names all or none of, in mesh order, merged into one axis (named as its first, of
    the product of their sizes). ``axes``: the mesh's ``(name, size)`` pairs; ``dims``:
    lists of layouts (per value, per dimension, the axis names splitting it, major
    first). Unchanged when nothing merges, or when the program names an axis of no
    mesh (an enclosing transform's)."""
    uses: list = [ax for group in dims for d in group for ax in d if ax]
    names = [a for a, _ in axes]
    if len(axes) < 2 or not _axis_uses(program, uses) or not set().union(*uses) <= set(names):
        return program, axes, dims

    def together(a: str, b: str) -> bool:
        return all((a in u) == (b in u) and (a not in u or u.index(b) == u.index(a) + 1)
                   for u in uses)

    runs = [[axes[0]]]
    for (a, s), prev in zip(axes[1:], names):
        (runs[-1].append((a, s)) if together(prev, a) else runs.append([(a, s)]))
    if len(runs) == len(axes):
        return program, axes, dims
    head = {a: run[0][0] for run in runs for a, _ in run}
    size = {run[0][0]: math.prod(s for _, s in run) for run in runs}

    def rename(ax: tuple) -> tuple:
        return tuple(dict.fromkeys(head[a] for a in ax))  # (a run's names are adjacent)

    def params_of(eq) -> dict:
        params = dict(eq.params)
        if "axis_name" in params:
            params["axis_name"] = new = rename(params["axis_name"])
            for k in ("axis_sizes", "sizes"):
                if k in params:
                    params[k] = tuple(size[a] for a in new)
        for k, v in _bodies(params).items():
            params[k] = (program_of(v) if isinstance(v, Program)
                         else tuple(program_of(p) for p in v))
        return params

    def program_of(p: Program) -> Program:
        eqs = [Equation(eq.prim, eq.inputs, params_of(eq), eq.outputs, eq.source)
               for eq in p.equations]
        return Program(p.inputs, eqs, p.outputs, p.n_consts, p.meta)

    merged = [(run[0][0], size[run[0][0]]) for run in runs]
    return (program_of(program), merged,
            [[tuple(rename(ax) for ax in d) for d in group] for group in dims])


def world_mesh(mesh: ShardMesh, groups: tuple | None = None):
    """The ``fs.Mesh`` of ``mesh``'s prime axes over the ranks of this job (row-major,
    so rank r has the same coordinates on both). ``groups = (name, count)``: the job's
    ranks are ``count`` consecutive copies of ``mesh``, told apart by a leading axis
    ``name`` that no collective of the plan names, so each copy communicates inside
    itself."""
    from fshard.meshes.mesh import Mesh

    sizes, names = (mesh.sizes, mesh.names) if mesh.sizes else ((1,), ("m0",))
    if groups is not None:
        sizes, names = (groups[1],) + tuple(sizes), (groups[0],) + tuple(names)
    return Mesh(sizes, names)


def run_on_rank(part: Partitioned, args: list, mesh, local_in=frozenset(),
                local_out=frozenset()):
    """Run this rank's share of a partitioned program in a multi-process job: it keeps
    its block of each global input (``shard_in``), runs the per-device Program with the
    job's collectives, and gathers the global outputs (``shard_out``). Inputs in
    ``local_in`` are this rank's block already (an ``fs.ShardedArray`` laid out as the
    plan wants it) and go in as they are; outputs in ``local_out`` stay this rank's
    block (no AllGather). ``mesh`` is ``world_mesh(...)``."""

    pmesh = part.prop.mesh

    def dims(sh: Sharding) -> tuple:
        return _names(sh, pmesh)

    blocks = [x if i in local_in else C.shard_in_p.bind(x, dims=dims(sh), mesh=mesh)
              for i, (x, sh) in enumerate(zip(args, part.in_shardings))]
    program = part.program
    outs = walk(program, list(part.consts) + blocks,
                lambda eq, vals: bind_on_rank(eq, vals, mesh), "running on this rank")
    return [y if j in local_out else C.shard_out_p.bind(y, dims=dims(sh), mesh=mesh)
            for j, (y, sh) in enumerate(zip(outs, part.out_shardings))]


def bind_on_rank(eq, values, mesh) -> list:
    """``bind`` one equation of a per-device Program on this rank of a job (``mesh``:
    the job's ``fs.Mesh``): collectives and ``axis_index`` get the mesh, so they lower
    to the job's communication; a ``block_slice`` (a value held whole, cut to this
    device's block) becomes this rank's block (``shard_in``). Shared by ``fs.shard``
    and ``fs.shard_map``."""
    prim, params = _on_rank(eq, mesh)
    outs = bind(prim, *values, **params)
    return outs if prim.multiple_results else [outs]


def _on_rank(eq, mesh) -> tuple:
    """The primitive and parameters ``eq`` runs with on this rank of a job (see
    ``bind_on_rank``); the bodies of a loop or cond are rewritten the same way, so
    collectives inside a loop body use the job's mesh too."""
    if eq.prim is block_slice_p:
        d = [()] * eq.inputs[0].aval.ndim
        d[eq.params["dim"]] = tuple(eq.params["axis_name"])
        return C.shard_in_p, {"dims": tuple(d), "mesh": mesh}
    params = eq.params
    if eq.prim in C.NAMED_AXIS_PRIMITIVES:
        params = dict(params, mesh=mesh)
    bodies = _bodies(params)
    if bodies:
        params = dict(params)
        for k, v in bodies.items():
            params[k] = (_program_on_rank(v, mesh) if isinstance(v, Program)
                         else tuple(_program_on_rank(p, mesh) for p in v))
    return eq.prim, params


def _program_on_rank(program: Program, mesh) -> Program:
    eqs = []
    for eq in program.equations:
        prim, params = _on_rank(eq, mesh)
        eqs.append(Equation(prim, eq.inputs, params, eq.outputs, eq.source))
    return Program(program.inputs, eqs, program.outputs, program.n_consts)
