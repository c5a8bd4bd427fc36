"""Why a plan is what it is: per equation, the layouts chosen, the predicted compute and
communication time, and the runner-up (``fs.shard(...).explain``,
``fs.AutoParallel.explain``).

The times come from the one objective (``fshard.sharding.search.Problem``) priced at
level 2 (the rates ``fs.sharding.calibrate()`` measured on this machine when it has,
else ``fshard.sharding.cost.BACKEND_RATES``), whatever level planned the program, so
plans of different planners compare in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fshard.core.ir import Literal
from fshard.sharding.cost import CostModel, backend_rates, fusion_seconds
from fshard.sharding.search import Problem


@dataclass
class EquationPlan:
    """One equation of a plan: its ``layout`` (each operand's and output's split counts,
    MindSpore's notation, ``partial-sum`` where a pending sum is produced), the
    predicted ``compute_s`` and ``comm_s`` (moving its operands to that layout), and the
    best other layout for this equation alone (its operands as the plan holds them):
    ``runner_up`` and its time ``runner_up_s`` (None when it has no other)."""

    index: int
    primitive: str
    layout: str
    compute_s: float
    comm_s: float
    collectives: int
    runner_up: str | None = None
    runner_up_s: float | None = None


@dataclass
class Explanation:
    """A plan, equation by equation (``rows``), plus the moves of the outputs to their
    requested layouts (``output_comm_s``); ``total_s`` is the predicted step time (with
    ``call_s``, calling the compiled program, when the rates were measured by
    ``fs.sharding.calibrate``) and ``collectives`` the number of collectives."""

    name: str
    devices: int
    rows: list = field(default_factory=list)
    output_comm_s: float = 0.0
    output_collectives: int = 0
    # Calling the compiled program: a measured table's ``call_s``, and its ``arg_s``
    # for each value passed in or out.
    call_s: float = 0.0
    # Taking the inputs given a layout into it (a virtual mesh copies a split one into
    # its devices' blocks: ``Problem.boundary_seconds``; the outputs' is in
    # ``output_comm_s``, an input decided at its first consumer's in that row).
    inputs_s: float = 0.0
    # Work outside the program on every call: in a job, ``fs.AutoParallel``'s check
    # that every process passes slices of the same shapes (``local_batch.slice_rows``).
    checks_s: float = 0.0
    # AllReduces bucketed into fewer (by default in a job, AllGathers too;
    # ``fs.AutoParallel``'s ``comm_fusion``): the seconds that saves (negative: the fixed
    # costs of the collectives merged, less the copies in and out of the buckets) and how
    # many it merges away.
    fusion_s: float = 0.0
    fused: int = 0

    @property
    def compute_s(self) -> float:
        return sum(r.compute_s for r in self.rows)

    @property
    def comm_s(self) -> float:
        return sum(r.comm_s for r in self.rows) + self.output_comm_s + self.fusion_s

    @property
    def total_s(self) -> float:
        return self.call_s + self.checks_s + self.inputs_s + self.compute_s + self.comm_s

    @property
    def collectives(self) -> int:
        return sum(r.collectives for r in self.rows) + self.output_collectives - self.fused

    def __str__(self) -> str:
        head = (f"# plan of {self.name} on {self.devices} devices: predicted "
                f"{self.total_s * 1e3:.3f} ms (compute {self.compute_s * 1e3:.3f} ms, "
                f"communication {self.comm_s * 1e3:.3f} ms, {self.collectives} collectives)")
        lines = [head, f"{'#':>4}  {'primitive':<16} {'layout':<40} {'compute ms':>10} "
                       f"{'comm ms':>9}  runner-up (ms)"]
        if self.inputs_s:
            lines.append(f"{'':>4}  {'(inputs)':<16} {'':<40} {'':>10} "
                         f"{self.inputs_s * 1e3:>9.4f}")
        for r in self.rows:
            other = "-" if r.runner_up is None else f"{r.runner_up} ({r.runner_up_s * 1e3:.3f})"
            lines.append(f"{r.index:>4}  {r.primitive:<16} {r.layout:<40} "
                         f"{r.compute_s * 1e3:>10.4f} {r.comm_s * 1e3:>9.4f}  {other}")
        lines.append(f"{'':>4}  {'(outputs)':<16} {'':<40} {'':>10} "
                     f"{self.output_comm_s * 1e3:>9.4f}")
        if self.fused:
            lines.append(f"{'':>4}  {'(comm_fusion)':<16} {f'{self.fused} collectives fewer':<40} "
                         f"{'':>10} {self.fusion_s * 1e3:>9.4f}")
        if self.call_s:
            lines.append(f"{'':>4}  {'(call)':<16} {'':<40} {self.call_s * 1e3:>10.4f}")
        if self.checks_s:
            lines.append(f"{'':>4}  {'(slice check)':<16} {'':<40} {'':>10} "
                         f"{self.checks_s * 1e3:>9.4f}")
        return "\n".join(lines)


def _layout(problem: Problem, i: int, cand) -> str:
    ins, outs, _ = problem.shardings(i, cand)
    mesh = problem.mesh
    eq = problem.eqs[i]
    operands = [sh.describe(mesh) for a, sh in zip(eq.inputs, ins)
                if not isinstance(a, Literal)]
    return ", ".join(operands) + " -> " + ", ".join(sh.describe(mesh) for sh in outs)


def _local_seconds(problem: Problem, held: dict, i: int, cand, model: CostModel
                   ) -> float | None:
    """Equation ``i`` as ``cand`` alone: its compute plus moving its operands from the
    layouts they hold (``held``: value -> its layouts; None if infeasible)."""
    eq = problem.eqs[i]
    ins, _, flops = problem.shardings(i, cand)
    total, done = flops / model.flops_per_s, set()
    for a, req in zip(eq.inputs, ins):
        if isinstance(a, Literal):
            if req.partial:
                return None
            continue
        versions = held.get(a, (req,))
        if req in versions or (a, req) in done:
            continue
        best = problem.cheapest_move(a, versions, req)
        if best is None:
            return None
        total += best[6]
        done.add((a, req))
    return total


def explain(prop, name: str = "f", runner_up: bool = True, fused=(),
            fused_gathers=()) -> Explanation:
    """The plan ``prop`` (a ``Propagated`` as partitioned), priced per equation;
    ``fused``: its AllReduces' buckets (``Partitioned.fused``), priced as a whole;
    ``fused_gathers``: its AllGathers' (``Partitioned.fused_gathers``)."""
    model = CostModel(level=2, rates=backend_rates(prop.mesh.size))
    problem = Problem(prop.program, prop.mesh, [spec for spec, _ in prop.choice],
                      prop.given_inputs if prop.given_inputs is not None
                      else prop.in_shardings, prop.out_shardings, 2, model=model)
    layouts = dict(zip(prop.program.inputs, prop.in_shardings, strict=True))
    st = problem.initial(layouts)
    out = Explanation(name, prop.mesh.size, call_s=model.call_seconds(
        len(prop.program.inputs) + len(prop.program.outputs)), inputs_s=st.ctime)
    for i, (_, cand) in enumerate(prop.choice):
        inputs = tuple((x, layouts[x]) for x in problem.free_at[i])
        before_t, before_n = st.ctime, st.ncoll
        flops = problem.shardings(i, cand)[2]
        alt, alt_s = None, None
        if runner_up:
            held = {**st.held, **{x: (sh,) for x, sh in inputs}}
            for c in problem.base[i]:
                if c == cand:
                    continue
                s = _local_seconds(problem, held, i, c, model)
                if s is not None and (alt_s is None or s < alt_s):
                    alt, alt_s = c, s
        st = problem.step(st, i, cand, inputs, copy=False)
        assert st is not None, "a partitioned plan is feasible"
        out.rows.append(EquationPlan(
            i, problem.eqs[i].prim.name, _layout(problem, i, cand),
            flops / model.flops_per_s, st.ctime - before_t, st.ncoll - before_n,
            None if alt is None else _layout(problem, i, alt), alt_s))
    before_t, before_n = st.ctime, st.ncoll
    fin = problem.finish(st)
    out.output_comm_s = fin.ctime - before_t
    out.output_collectives = fin.ncoll - before_n
    if fused or fused_gathers:
        n = prop.mesh.size
        out.fusion_s = (fusion_seconds(fused, n, model.rates, model.native)
                        + fusion_seconds(fused_gathers, n, model.rates, model.native,
                                         "all_gather"))
        out.fused = sum(k - 1 for k, _ in (*fused, *fused_gathers))
    return out


def compare(explanations: dict) -> str:
    """A table of several plans of one program (``{label: Explanation}``): predicted
    step, compute, communication and collectives per plan."""
    lines = [f"{'plan':<24} {'predicted ms':>12} {'compute ms':>10} {'comm ms':>9} "
             f"{'collectives':>11}"]
    for label, e in explanations.items():
        lines.append(f"{label:<24} {e.total_s * 1e3:>12.3f} {e.compute_s * 1e3:>10.3f} "
                     f"{e.comm_s * 1e3:>9.3f} {e.collectives:>11}")
    return "\n".join(lines)
