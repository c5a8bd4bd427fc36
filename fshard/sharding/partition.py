"""Partitioning: the per-device Program of a propagated one. Each equation runs on
local blocks with per-device parameters, and the collectives its operands' layout
changes need (``all_gather``, ``psum``, ``psum_scatter``, ``block_slice``) are inserted
as ordinary equations, each layout of a value computed once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from fshard.core.tracing import ArrayType, bind
from fshard.errors import ShardingError
from fshard.core.interpret import walk
from fshard.core.ir import Literal, Program, pretty
from fshard.primitives import collectives as C
from fshard.primitives.spmd import block_slice, layout_constraint_p
from fshard.sharding.cost import native_collectives, native_reduce_scatter, plan_bytes
from fshard.sharding.layouts import (Candidate, ShardMesh, Sharding, after, as_produced,
                                     candidate_shardings, plan)
from fshard.sharding.propagation import Propagated, propagate
from fshard.core.staging import StagedTracer, stage


def redistribute(x, src: Sharding, dst: Sharding, mesh: ShardMesh, native: dict) -> list:
    """Emit the collectives moving ``x`` from ``src`` to ``dst``; returns ``(layout,
    value)`` after each step (the last is ``dst``'s), so that a caller can keep the
    whole value an AllReduce made on its way to a slice."""
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
    # per-device Var made by a layout change -> the Var of the program it moves
    # (fs.AutoParallel's "index" fusion finds each gradient's AllReduce by it)
    origins: dict = field(default_factory=dict)
    # ``program`` as a virtual mesh runs it, with its mesh axes and boundary layouts
    # (``runtime.run_virtual``: axes used together merged), kept for that program
    virtual: tuple | None = field(default=None, repr=False)
    # ``(AllReduces merged, bytes)`` per bucket of several, when ``program``'s AllReduces
    # were bucketed (by default in a job, or fs.AutoParallel's comm_fusion; the
    # explanation prices them)
    fused: tuple = ()
    # the same for its AllGathers (bucketed by default in a job)
    fused_gathers: tuple = ()

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
        """Names of the communicating equations (collectives), in order; those inside
        the body of a loop or the branches of a cond are listed where the loop is, once
        (they run once per iteration). Local slices (``block_slice``: keep this device's
        block of a value it holds whole) are not communication and are not listed."""
        return _collectives(self.program)

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


def _collectives(program: Program) -> list[str]:
    out = []
    for eq in program.equations:
        if eq.prim in C.COLLECTIVES:
            out.append(eq.prim.name)
        for v in eq.params.values():  # a loop's body, a cond's branches
            for sub in (v if isinstance(v, tuple) else (v,)):
                if isinstance(sub, Program):
                    out += _collectives(sub)
    return out


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
    origins: dict = {}

    def note(x, sh):
        if isinstance(x, StagedTracer):
            annotations[x.ir_var] = sh
        return x

    def get(versions: dict, var, req):
        """The value of ``var`` in layout ``req``, moved from the cheapest layout held."""
        aval = var.aval
        if req in versions:
            return versions[req]
        sources = [s for s in versions if req.partial <= s.partial]
        src = min(sources, key=lambda s: (plan_bytes(s, req, aval, mesh, native),
                                          len(plan(s, req, scatter))))
        for sh, x in redistribute(versions[src], src, req, mesh, native):
            versions.setdefault(sh, note(x, sh))
            if isinstance(x, StagedTracer):
                origins[x.ir_var] = var
        return versions[req]

    choice = {id(eq): c for eq, c in zip(program.equations, prop.choice)}

    def rule(eq, operands):
        # Each operand is the dict of the layouts its value is held in (a literal: its
        # value); the result is held in the one layout the candidate produces.
        spec, cand = choice[id(eq)]
        ins, outs = candidate_shardings(spec, cand)
        args = [get(held, a, req) if isinstance(held, dict) else held
                for a, held, req in zip(eq.inputs, operands, ins)]
        if eq.prim is layout_constraint_p:  # its operand now has the fixed layout
            return [{outs[0]: args[0]}]
        params = eq.params
        if spec.local_params is not None:
            params = spec.local_params(
                params, [_local_aval(a.aval, s, mesh) for a, s in zip(eq.inputs, ins)],
                [_local_aval(v.aval, s, mesh) for v, s in zip(eq.outputs, outs)])
        if spec.partition_call is not None:  # a loop or cond: its bodies per device
            args, params = spec.partition_call(args, params, ins, outs, sub_program)
        res = bind(eq.prim, *args, **params)
        res = res if eq.prim.multiple_results else [res]
        return [{s: note(r, s)} for r, s in zip(res, outs)]

    def sub_program(body: Program, ins: list, outs: list):
        # A body partitioned like a program of its own, from the layouts at its
        # boundary (a loop's carry: the same layout in and out), with the collectives
        # it needs inside it.
        part = partition(propagate(body, ins, outs, mesh, prop.level))
        pd = part.program
        return Program(pd.inputs, pd.equations, pd.outputs), list(part.consts)

    def per_device(*local_inputs):
        held = [{s: note(x, s)} for x, s in zip(local_inputs, prop.in_shardings)]
        outs = walk(program, held, rule, "partitioning")
        results = []
        for k, (a, versions) in enumerate(zip(program.outputs, outs)):
            if isinstance(a, Literal):
                outs_sh[k] = Sharding.replicated(a.aval.ndim)
                results.append(a.value)
                continue
            if outs_sh[k] is None:
                outs_sh[k] = as_produced(versions, prop.shardings.get(a) or next(iter(versions)))
            results.append(get(versions, a, outs_sh[k]))
        return results

    local_avals = [_local_aval(v.aval, s, mesh) for v, s in zip(program.inputs, prop.in_shardings)]
    with contextlib.ExitStack() as stack:
        for name, size in zip(mesh.names, mesh.sizes):  # collectives read the axis sizes
            stack.enter_context(C.named_axis(name, size))
        pd_program, pd_consts = stage(per_device, local_avals)
    return Partitioned(prop, pd_program, pd_consts, prop.in_shardings, outs_sh, annotations,
                       origins=origins)


def apply_fixed(prop: Propagated, data: dict) -> Propagated:
    """Replace propagation's choices by those of a loaded strategy file."""
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
