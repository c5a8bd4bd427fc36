"""Sharding propagation: give every value of a Program a layout (MindSpore's
algorithm). Breadth-first from the annotated values (an equation's undecided producers
before its consumers), each equation takes the candidate that needs no communication
on its edges, else the cheapest under the cost model of ``level``; pending sums pass
through linear primitives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fshard.core import dtypes
from fshard.core.dims import dim_multiple_of
from fshard.core.ir import Program, Var
from fshard.core.rules import sharding as sharding_rules
from fshard.sharding.constraints import base_candidates, is_constraint
from fshard.sharding.cost import (CostModel, backend_rates, local_bytes, native_reduce_scatter,
                                  plan_bytes)
from fshard.sharding.layouts import (Candidate, ShardMesh, Sharding, SpecCache,
                                     candidate_shardings, carry_variants, plan, spec_key)


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
    memo: "Memo | None" = None  # what planning this program again can reuse


class Memo:
    """What propagating one program on one mesh at one level computes whatever its
    boundary layouts: the equations' specs and candidates, each (spec, candidate)'s
    layouts and compute, and each decision by its situation (a decision depends on
    nothing else). A search over boundary layouts (``choose_split_axes``) propagates
    the same program many times: each situation is then decided once across them all."""

    def __init__(self, program: Program, mesh: ShardMesh, level: int = 0):
        self.program, self.mesh, self.level = program, mesh, level
        self.model = CostModel(level=level, rates=backend_rates(mesh.size))
        self.specs = [_spec(eq) for eq in program.equations]
        self.skeys = [spec_key(sp) for sp in self.specs]
        # Layouts the user fixed (layout_constraint) and the operators they pin: one
        # candidate.
        self.bases = base_candidates(program, self.specs, mesh)
        self.cache = SpecCache(mesh, self.model.compute)
        self.decided: dict = {}

    def serves(self, program: Program, mesh: ShardMesh, level: int) -> bool:
        return self.program is program and self.mesh == mesh and self.level == level


def _spec(eq):
    rule = sharding_rules.lookup(eq.prim, transform="shard")
    return rule(*[a.aval for a in eq.inputs], **eq.params)


def undecided(program: Program, in_shardings: list, out_shardings: list, mesh: ShardMesh,
              level: int = 0) -> Propagated:
    """The problem ``propagate`` solves, nothing decided yet (every equation's
    candidate None): for planners that decide every equation themselves
    (``fshard.sharding.search.follow_inputs``)."""
    known = {v: s for v, s in zip(program.inputs, in_shardings) if s is not None}
    ins = [known.get(v, Sharding.replicated(v.aval.ndim)) for v in program.inputs]
    return Propagated(program, mesh, known, [(_spec(eq), None) for eq in program.equations],
                      ins, list(out_shardings), list(in_shardings), level)


def _eq_cost(eq, spec, cand, known: dict, demand: dict, mesh, model: CostModel,
             extra_comm: float = 0.0, out_demand: dict | None = None,
             desired: dict | None = None, layouts: tuple | None = None):
    ins, outs, compute = layouts or (*candidate_shardings(spec, cand),
                                     model.compute(spec, cand, mesh))
    comm, n_coll = extra_comm, 0
    for a, req in zip(eq.inputs, ins):
        if isinstance(a, Var) and a in known:
            b = plan_bytes(known[a], req, a.aval, mesh, model.native)
            comm += b
            n_coll += bool(plan(known[a], req, native_reduce_scatter(model.native)) and b)
    for v, out in zip(eq.outputs, outs):
        for req in demand.get(v, ()):
            if not req.partial <= out.partial:  # a pending sum cannot be made
                comm = float("inf")
            elif req.partial <= out.partial:
                b = plan_bytes(out, req, v.aval, mesh, model.native)
                comm += b
                n_coll += bool(b)
    # MindSpore's propagation ranks a strategy first by the redistribution on its edges
    # to other operators (a strategy with none wins); moving an output to the layout
    # the program's caller asks for, or to a desired layout, is not such an edge.
    edge = comm
    for v, out in zip(eq.outputs, outs):
        for req in (out_demand or {}).get(v, ()):
            if not req.partial <= out.partial:  # a loop body's pending-sum carry
                comm = float("inf")
                continue
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
    return model.score(compute, comm, n_coll, memory, edge)


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
        # A sum of one operand wanted whole is wanted from an operand whole in the
        # summed dimensions too: a split there would leave a pending sum, an AllReduce
        # at the end (the loss, a norm's weight gradient), to save a few flops.
        summed = spec.reduce if len(spec.inputs) == 1 else frozenset()
        for a, labels in zip(eq.inputs, spec.inputs):
            if not isinstance(a, Var) or a in desired or len(labels) != a.aval.ndim:
                continue
            if any(lab is not None and lab not in out_labels and lab not in summed
                   for lab in labels):
                continue
            dims = tuple(want.dims[out_labels.index(lab)]
                         if lab is not None and lab in out_labels else ()
                         for lab in labels)
            if any(d and not dim_multiple_of(a.aval.shape[k], mesh.count(d))
                   for k, d in enumerate(dims)):
                continue
            desired[a] = Sharding(dims)
    return desired


def _sink_pending_sums(program: Program, choice: list, known: dict, consumers: dict,
                       mesh: ShardMesh) -> None:
    """Pass pending sums through the linear equations that were decided to reduce them
    first, where that never costs more: an equation decided before its operands were
    (backwards, from a consumer that needs the whole value) cannot see that they will
    be pending sums, so a sum of two pending sums (the gradients meeting where a value
    feeds two matmuls with split weights) reduced each. Program order, so a chain
    (``reshape`` then ``add``) passes the sum along. Only where each pending operand
    has this equation as its one consumer (nothing else wants it reduced), the
    candidate moves nothing else, and the output is no larger than the operands: the
    operands' AllReduces become at most one, of the same size, on the output."""
    for i, eq in enumerate(program.equations):
        spec, cand = choice[i]
        if cand.carry:
            continue
        partials = [known[a].partial if isinstance(a, Var) and a in known else frozenset()
                    for a in eq.inputs]
        pending = [a for a, p in zip(eq.inputs, partials) if p]
        if not pending or any(set(consumers.get(a, ())) != {i} or a in program.outputs
                              for a in pending):
            continue
        for c in carry_variants(spec, cand, eq.prim.name, partials):
            ins, outs = candidate_shardings(spec, c)
            if any(isinstance(a, Var) and known.get(a) != req
                   for a, req in zip(eq.inputs, ins)):
                continue
            if _deferral_bytes(eq, spec, c, mesh) > 0:
                continue
            choice[i] = (spec, c)
            for v, out in zip(eq.outputs, outs):
                known[v] = out
            break


def _whole_reductions(program: Program, choice: list, known: dict, consumers: dict,
                      out_shardings: list, mesh: ShardMesh, model: CostModel) -> None:
    """Run whole a sum of a value every device holds whole (or will, once its own
    pending sum is reduced), where the propagation split it: a split of a replicated
    operand is a free local slice, but the split sum is a pending sum, one AllReduce
    more (the loss, an RMSNorm weight's gradient: a program output, whose AllReduce
    the level-0 objective discounts as overlapping the step). Kept whole when the
    AllReduce takes longer, at the backend's rates, than the compute the split saves;
    the equations that passed the pending sum along then run on the whole sum (each the
    only reader of the value it carried)."""
    latency, bandwidth = model.rates["all_reduce"]
    for i, eq in enumerate(program.equations):
        spec, cand = choice[i]
        if len(eq.inputs) != 1 or not spec.reduce or cand.carry or len(eq.outputs) != 1:
            continue
        (a,), (v,) = eq.inputs, eq.outputs
        out = known.get(v)
        # (an operand that is itself a pending sum is reduced first either way)
        if out is None or not out.partial or not isinstance(a, Var) or a not in known \
                or any(known[a].dims):
            continue
        # the pending sum's path: the single readers that pass it along
        path, cur = [], v
        while True:
            readers = consumers.get(cur, [])
            if len(readers) != 1 or cur in program.outputs:
                break
            j = readers[0]
            c_j = choice[j][1]
            if c_j.carry != out.partial or len(c_j.carry_ops) != 1 \
                    or program.equations[j].inputs[c_j.carry_ops[0]] is not cur \
                    or len(program.equations[j].outputs) != 1:
                break
            path.append(j)
            cur = program.equations[j].outputs[0]
        if any(o is cur and req is not None and req.partial
               for o, req in zip(program.outputs, out_shardings)):
            continue  # asked for as a pending sum (a loop body's accumulator)
        if any(program.equations[j].inputs[o] is cur for j in consumers.get(cur, [])
               for o in choice[j][1].carry_ops):
            continue  # a reader adds it to other pending sums (it must stay one)
        whole = Candidate(tuple((f, ax) for f, ax in cand.assign if f not in spec.reduce))
        saved = (model.compute(spec, whole, mesh) - model.compute(spec, cand, mesh)) \
            / model.flops_per_s
        reduced = local_bytes(known[cur], cur.aval, mesh)
        if saved >= latency + reduced / bandwidth:
            continue
        for k, c in [(i, whole)] + [(j, Candidate(choice[j][1].assign)) for j in path]:
            e = program.equations[k]
            choice[k] = (choice[k][0], c)
            _, outs = candidate_shardings(choice[k][0], c)
            known[e.outputs[0]] = outs[0]


def propagate(program: Program, in_shardings: list, out_shardings: list, mesh: ShardMesh,
              level: int = 0, memo: Memo | None = None) -> Propagated:
    """Give every value a sharding (MindSpore's BFS; see the module docstring). ``memo``
    (a ``Memo`` of the same program, mesh and level) carries work across calls."""
    if memo is None or not memo.serves(program, mesh, level):
        memo = Memo(program, mesh, level)
    model = memo.model
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
    specs, skeys, bases, cache = memo.specs, memo.skeys, memo.bases, memo.cache
    choice: list = [None] * len(program.equations)
    desired = _desired(program, specs, out_demand, mesh)
    # An equation's choice depends only on its spec, its values' sizes and the layouts
    # known or asked for around it: a program repeats few such situations (the layers
    # of a network, their gradients), so each is decided once (linear-time planning).
    decided = memo.decided
    akeys: dict = {}

    def aval_key(v):
        k = akeys.get(v)
        if k is None:
            k = akeys[v] = (tuple(v.aval.shape), dtypes.to_numpy(v.aval.dtype).itemsize)
        return k

    def situation(i):
        eq = program.equations[i]
        if skeys[i] is None:
            return None
        ins = tuple((known.get(a), a in producer, aval_key(a)) if isinstance(a, Var)
                    else ("literal", a.aval.shape) for a in eq.inputs)
        outs = tuple((tuple(demand.get(v, ())), tuple(out_demand.get(v, ())),
                      desired.get(v), aval_key(v)) for v in eq.outputs)
        return (skeys[i], eq.prim.name, specs[i].linear, tuple(bases[i]), ins, outs)

    def decide(i):
        eq, spec = program.equations[i], specs[i]
        key = situation(i)
        best = decided.get(key) if key is not None else None
        if best is not None:
            record(i, eq, spec, best)
            return
        best_score = None
        partials = [known[a].partial if isinstance(a, Var) and a in known else frozenset()
                    for a in eq.inputs]
        carry = any(partials)  # the spec's linear groups say where it may pass
        # A loop body's accumulator carry is requested as a pending sum at its end.
        wanted = {r.partial for v in eq.outputs for r in out_demand.get(v, ()) if r.partial}
        for base in bases[i]:
            options = [(base, 0.0)]
            if carry:
                options += [(c, _deferral_bytes(eq, spec, c, mesh))
                            for c in carry_variants(spec, base, eq.prim.name, partials)]
            for q in wanted:  # the output must be a pending sum: pass it through
                guess = [q if isinstance(a, Var) and a not in known and a in producer
                         else p for a, p in zip(eq.inputs, partials)]
                options += [(c, 0.0) for c in carry_variants(spec, base, eq.prim.name, guess)
                            if c.carry == q]
            for cand, extra in options:
                score = _eq_cost(eq, spec, cand, known, demand, mesh, model, extra,
                                 out_demand, desired, cache.get(spec, skeys[i], cand))
                if best_score is None or score < best_score:
                    best, best_score = cand, score
        if key is not None:
            decided[key] = best
        record(i, eq, spec, best)

    def record(i, eq, spec, best):
        choice[i] = (spec, best)
        ins, outs, _ = cache.get(spec, skeys[i], best)
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
    # The layouts the user fixed start the search too (MindSpore propagates from every
    # operator given a strategy): decided first, their consumers queued after the inputs'.
    for i, eq in enumerate(program.equations):
        if is_constraint(eq):
            decide(i)
            queue.extend(consumers.get(eq.outputs[0], []))
    while queue:
        i = queue.popleft()
        if choice[i] is not None:
            continue
        decide(i)
        eq = program.equations[i]
        for v in eq.outputs:
            queue.extend(j for j in consumers.get(v, []) if choice[j] is None)
        # Producers first: a layout an operator needs reaches back up the chain that
        # computes its operand before the breadth-first front arrives there from the
        # other side and splits that chain for free (a slice of a whole value), which
        # would then cost a gather (the RMSNorm between a Megatron attention and MLP).
        for a in eq.inputs:
            if isinstance(a, Var) and a in producer and choice[producer[a]] is None:
                queue.appendleft(producer[a])
    for i in range(len(program.equations)):  # unreachable from any annotation
        if choice[i] is None:
            decide(i)
    _sink_pending_sums(program, choice, known, consumers, mesh)
    _whole_reductions(program, choice, known, consumers, out_shardings, mesh, model)
    ins = [known.get(v, Sharding.replicated(v.aval.ndim)) for v in program.inputs]
    return Propagated(program, mesh, known, choice, ins, out_shardings, list(in_shardings), level,
                      memo)
