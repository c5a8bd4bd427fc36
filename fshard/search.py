"""Search over sharding choices: the global cost of a propagated program, exhaustive
enumeration for small programs, and coordinate descent for larger ones.

MindSpore's propagation is greedy (breadth-first, each equation picks the cheapest
candidate given its already-decided neighbours). ``refine`` starts from that result
and searches for a lower total cost under the same cost model; ``exhaustive`` finds
the optimum by enumeration (for benchmarks and tests on small programs).
"""

from __future__ import annotations

import itertools
import math

from fshard.ir import Var
from fshard.sharding import (
    CostModel,
    Sharding,
    candidate_shardings,
    candidates,
    compute_cost,
    local_bytes,
    plan,
    plan_bytes,
)


def total_cost(prop, choice=None) -> float:
    """The scalar objective of ``level`` for a whole program with these choices.

    Unannotated inputs take the layout their first consumer needs; every other edge
    pays for its redistribution, and outputs pay to reach their requested layouts.
    """
    from fshard.transforms.shard import propagate  # noqa: F401  (same module family)

    program, mesh = prop.program, prop.mesh
    choice = prop.choice if choice is None else choice
    model = CostModel(level=getattr(prop, "level", 0))
    annotated = {v: s for v, s in zip(program.inputs, prop.given_inputs)
                 if s is not None} if hasattr(prop, "given_inputs") else {}
    cur: dict = dict(annotated)
    compute = comm = memory = 0.0
    n_coll = 0
    for eq, (spec, cand) in zip(program.equations, choice):
        ins, outs = candidate_shardings(spec, cand)
        compute += compute_cost(spec, cand, mesh)
        for a, req in zip(eq.inputs, ins):
            if not isinstance(a, Var):
                continue
            if a not in cur:
                cur[a] = req  # an unannotated input adopts its first consumer's layout
                continue
            b = plan_bytes(cur[a], req, a.aval, mesh)
            comm += b
            n_coll += len(plan(cur[a], req)) if b else 0
        for v, o in zip(eq.outputs, outs):
            cur[v] = o
            memory += local_bytes(o, v.aval, mesh)
    for v, s in zip(program.outputs, prop.out_shardings):
        if isinstance(v, Var) and v in cur:
            s = s if s is not None else Sharding.replicated(v.aval.ndim)
            b = plan_bytes(cur[v], s, v.aval, mesh)
            comm += b
            n_coll += len(plan(cur[v], s)) if b else 0
    if model.level == 0:
        return model.alpha * compute + model.beta * comm
    if model.level == 1:
        return memory + 1e-6 * (model.alpha * compute + model.beta * comm)
    return (compute / model.flops_per_s + comm / model.bytes_per_s
            + n_coll * model.latency_s)


def _all_candidates(prop):
    return [[(spec, c) for c in candidates(spec, prop.mesh)] for spec, _ in prop.choice]


def exhaustive(prop, limit: int = 200_000):
    """The optimal choices by enumeration (``None`` if more than ``limit`` combinations)."""
    options = _all_candidates(prop)
    if math.prod(len(o) for o in options) > limit:
        return None
    best, best_cost = None, None
    for combo in itertools.product(*options):
        c = total_cost(prop, list(combo))
        if best_cost is None or c < best_cost:
            best, best_cost = list(combo), c
    return best


def refine(prop, rounds: int = 4, exhaustive_limit: int = 20_000):
    """Improve a propagated program: exact search when small, else coordinate descent
    (each equation in turn takes its best candidate given all the others)."""
    from dataclasses import replace

    best = exhaustive(prop, exhaustive_limit)
    if best is not None:
        return _with_choice(prop, best, replace)
    options = _all_candidates(prop)
    choice = list(prop.choice)
    cost = total_cost(prop, choice)
    for _ in range(rounds):
        improved = False
        for i, opts in enumerate(options):
            for opt in opts:
                trial = choice[:i] + [opt] + choice[i + 1:]
                c = total_cost(prop, trial)
                if c < cost - 1e-9:
                    choice, cost, improved = trial, c, True
        if not improved:
            break
    return _with_choice(prop, choice, replace)


def _with_choice(prop, choice, replace):
    """A Propagated with new choices; unannotated inputs re-adopt their consumers' needs."""
    program = prop.program
    given = getattr(prop, "given_inputs", [None] * len(program.inputs))
    known = {v: s for v, s in zip(program.inputs, given) if s is not None}
    for eq, (spec, cand) in zip(program.equations, choice):
        ins, outs = candidate_shardings(spec, cand)
        for a, req in zip(eq.inputs, ins):
            if isinstance(a, Var) and a not in known:
                known[a] = req
        known.update(zip(eq.outputs, outs))
    ins = [known.get(v, Sharding.replicated(v.aval.ndim)) for v in program.inputs]
    return replace(prop, choice=choice, shardings=known, in_shardings=ins)
