"""Layouts the user fixed: the ``layout_constraint`` equations of a Program (written
by ``Primitive.shard`` on a MindSpore operator inside a traced Cell, or by an
``fs.shard`` inside ``fs.AutoParallel``'s loss) and the operators they pin.

A constraint's output has exactly its layout. An equation whose every operand is
the output of the ``("in", k, n)`` constraint of one operator call, in order, *is*
that operator (or its tangent): it runs with exactly the user's strategy, as
MindSpore's semi-auto mode runs it. Its factors get the user's split counts, over
mesh axes taken row-major in the order the factors first appear (MindSpore's device
matrix: ``MatMul.shard(((2, 4), (4, 1)))`` is the device matrix ``(2, 4, 1)`` over
rows, contraction and columns), and each operand constraint takes the operand's
layout under that assignment, so a factor two operands share is split over the same
devices. Constraints of one value that no operator consumes whole keep the layout
written into them (the split counts row-major, or the mesh axes of an ``fs.Layout``).

The arguments of an ``fs.shard`` inside ``fs.AutoParallel``'s loss (``("arg", k, n)``)
pin the same way the equation that consumes all of them, in order (``x @ w`` in
``fs.shard(lambda x, w: x @ w, ...)``): the counts written for them are split over
consistent mesh axes.

``base_candidates`` gives propagation (fshard/sharding/propagation.py) and the
search (fshard/sharding/search.py) the candidates of every equation: the one fixed
candidate of a constraint or a pinned operator, all of them for the others.
"""

from __future__ import annotations

import math

from fshard.core.dims import dim_multiple_of
from fshard.errors import ShardingError
from fshard.core.ir import Program, Var
from fshard.primitives.spmd import layout_constraint_p
from fshard.sharding.layouts import Candidate, ShardMesh, Sharding, candidates
from fshard.sharding.strategy import _axes_for


def is_constraint(eq) -> bool:
    return eq.prim is layout_constraint_p


def _identity_candidate(sh: Sharding) -> Candidate:
    return Candidate(tuple((f"d{d}", ax) for d, ax in enumerate(sh.dims) if ax))


def _bad(origin: str, why: str, fix: str):
    raise ShardingError(f"{origin}: {why}.\nFix: {fix}.")


def _joint(eq, spec, constraint_params: list, mesh: ShardMesh) -> tuple[Candidate, list]:
    """The candidate running ``eq`` with the split counts of its operand constraints,
    and the layout of each operand under it."""
    origin = constraint_params[0]["origin"]
    count: dict = {}
    first: dict = {}
    labels_of = []
    for k, (labels, p) in enumerate(zip(_operand_labels(eq, spec), constraint_params)):
        labels_of.append(labels)
        for d, (lab, c) in enumerate(zip(labels, p["counts"])):
            if lab is None and c == 1:
                continue
            if c > 1 and (lab is None or lab in spec.nosplit or lab not in spec.splittable()):
                _bad(origin, f"in_strategy[{k}] splits dimension {d} of operand {k} "
                     f"({eq.inputs[k].aval}) {c} ways, but fshard's '{eq.prim.name}' cannot "
                     "split that dimension (it is broadcast, or every output needs it whole)",
                     f"give dimension {d} of in_strategy[{k}] the split count 1")
            if lab in count and count[lab] != c:
                k0, d0 = first[lab]
                _bad(origin, f"in_strategy[{k0}] gives dimension {d0} of operand {k0} the "
                     f"split count {count[lab]} and in_strategy[{k}] gives dimension {d} of "
                     f"operand {k} the split count {c}, but the operator uses these "
                     "dimensions together (the same index runs over both)",
                     "give both dimensions the same split count, as MindSpore requires")
            count.setdefault(lab, c)
            first.setdefault(lab, (k, d))
    assign, used, start = [], set(), 0
    for lab in first:  # in the order the factors first appear: the device matrix
        c = count[lab]
        if c == 1:
            continue
        if not dim_multiple_of(spec.sizes[lab], c):
            k, d = first[lab]
            _bad(origin, f"in_strategy[{k}] splits dimension {d} of operand {k} "
                 f"({eq.inputs[k].aval}) {c} ways, which does not divide it",
                 "choose split counts that divide the operand's dimensions")
        axes = _axes_for(mesh, c, start, used)
        if axes is None:
            _bad(origin, f"its split counts {tuple(count.values())} need "
                 f"{math.prod(count.values())} devices, which a mesh of {mesh.size} devices "
                 "cannot provide", f"choose split counts whose product divides {mesh.size}")
        used.update(axes)
        start = max(axes) + 1
        assign.append((lab, axes))
    cand = Candidate(tuple(assign))
    return cand, [cand.sharding(labels) for labels in labels_of]


def _written(p: dict, aval, mesh: ShardMesh) -> Sharding:
    """The layout written into a constraint: its fs.Layout's mesh axes, or its split
    counts over mesh axes taken row-major, dimension by dimension (as fs.shard lays out
    a tuple strategy)."""
    if p["exact"]:
        if p["n"] != mesh.size:
            _bad(p["origin"], f"its Layout is for {p['n']} devices, but the program is "
                 f"partitioned over {mesh.size}", f"use a device matrix of {mesh.size} devices")
        return Sharding(p["axes"])
    dims, used, start = [], set(), 0
    for d, c in enumerate(p["counts"]):
        axes = _axes_for(mesh, c, start, used) if mesh.size % c == 0 else None
        if axes is None:
            _bad(p["origin"], f"the split counts {p['counts']} of {aval} cannot be laid out "
                 f"on {mesh.size} devices", f"choose split counts whose product divides "
                 f"{mesh.size}")
        used.update(axes)
        start = max(axes) + 1 if axes else start
        dims.append(axes)
    return Sharding(tuple(dims))


def _operand_labels(eq, spec) -> list:
    return [spec.inputs[k] for k in range(len(eq.inputs))]


def fixed_choices(program: Program, specs: list, mesh: ShardMesh) -> dict:
    """Equation index -> its one fixed candidate, for every constraint and every
    operator it pins (see the module docstring)."""
    eqs = program.equations
    producer = {}
    layouts = {}
    for i, eq in enumerate(eqs):
        if not is_constraint(eq):
            continue
        p = eq.params
        producer[eq.outputs[0]] = i
        layouts[i] = _written(p, eq.inputs[0].aval, mesh)
    out: dict = {}
    if not layouts:
        return out
    for i, eq in enumerate(eqs):
        if is_constraint(eq) or not eq.inputs:
            continue
        if not all(isinstance(a, Var) and a in producer for a in eq.inputs):
            continue
        params = [eqs[producer[a]].params for a in eq.inputs]
        roles = [p["role"] for p in params]
        group = params[0]["group"]
        kind = roles[0][0]
        if kind not in ("in", "arg") or any(p["group"] != group for p in params) or roles != [
                (kind, k, len(eq.inputs)) for k in range(len(eq.inputs))]:
            continue
        if any(p["exact"] for p in params):
            # An fs.Layout fixed every operand's mesh axes: the operator follows them.
            fits = [c for c in candidates(specs[i], mesh) if all(
                c.sharding(specs[i].inputs[k]) == layouts[producer[a]]
                for k, a in enumerate(eq.inputs))]
            if fits:
                out[i] = fits
            continue
        cand, operand_layouts = _joint(eq, specs[i], params, mesh)
        out[i] = [cand]
        for a, sh in zip(eq.inputs, operand_layouts):
            layouts[producer[a]] = sh
    for i, sh in layouts.items():
        out[i] = [_identity_candidate(sh)]
    return out


def base_candidates(program: Program, specs: list, mesh: ShardMesh) -> list:
    """The candidates of every equation: the fixed one of a constraint or a pinned
    operator (``fixed_choices``), every candidate of the others."""
    fixed = fixed_choices(program, specs, mesh)
    return [fixed[i] if i in fixed else candidates(spec, mesh)
            for i, spec in enumerate(specs)]
