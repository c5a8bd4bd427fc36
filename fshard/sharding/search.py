"""Sharding search: the cost of a whole sharded program, and the search for its best
layouts.

One objective is the single source of truth. ``Problem.evaluate`` simulates what
``partition`` (fshard/sharding/partition.py) executes for a full *assignment* (a candidate per
equation, a layout per input), without staging anything: each operand is moved from
the cheapest layout its value already holds (the partitioner keeps every layout a value
has been moved to), pending sums pass through linear operations as the candidates
say, the outputs are moved to their requested layouts, and a pending sum resolved only
at an output is weighted by ``CostModel.gamma``. It returns a ``Cost``; ``Cost.score``
orders assignments by ``level``:

- 0: ``alpha * compute + beta * bytes`` (MindSpore's cost, gamma-weighted), then memory;
- 1: peak memory per device, then the level-0 cost;
- 2: time: the compute at the backend's measured flops rate plus each collective
  as the backend runs it (its fixed cost plus the bytes each device sends at its rate;
  ``BACKEND_RATES`` in fshard/sharding/cost.py), unweighted, then memory.

Its users: ``cost(prop)`` (what greedy propagation costs), ``exhaustive`` (branch and
bound over every assignment: the reference on small programs), ``search`` (a dynamic
program over the equations in program order whose states are the layouts each live
value holds, exact while the states fit in ``width``, a beam search beyond; the greedy
path is always kept, and coordinate descent polishes the result) and ``refine``
(``fs.shard(..., search=True)``). It reads the layout rules (fshard/sharding/layouts.py)
for carries and output layouts, and imports no MindSpore itself.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass, replace

from fshard.core import dtypes
from fshard.core.dims import planning_prod
from fshard.core.factors import linear_groups
from fshard.core.ir import Literal, Program, Var
from fshard.primitives.passes import lowered_away
from fshard.sharding.cost import (CostModel, backend_rates, redistribution,
                                  redistribution_seconds)
from fshard.sharding.layouts import (
    Candidate,
    Sharding,
    SpecCache,
    spec_key,
    after,
    as_produced,
    candidate_shardings,
    carry_variants,
)
from fshard.sharding.propagation import Memo, propagate
from fshard.sharding.layouts import ShardMesh
from fshard.sharding.strategy import split_alternatives
from fshard.sharding.constraints import base_candidates

# ---------------------------------------------------------------------------
# The objective
# ---------------------------------------------------------------------------


def _q(x: float) -> float:
    # Sums of the same terms in another order differ in the last bits; ten significant
    # digits make equal costs compare equal.
    return float(f"{x:.10g}")


@dataclass(frozen=True)
class Cost:
    """What one assignment costs per device.

    ``comm_bytes`` is what each device sends (ring algorithms: AllGather ``(n-1)·S``,
    AllReduce ``2(n-1)/n·S``, ReduceScatter ``(n-1)/n·S``); ``weighted_bytes`` the same
    with an AllReduce that only resolves an output weighted by ``CostModel.gamma``;
    ``memory`` the peak bytes a device holds (every value and each layout it was moved
    to, from its definition to its last use, plus the transients of a move);
    ``comm_seconds`` the time the collectives take as the backend runs them.

    >>> Cost(compute=100.0, comm_bytes=8.0, weighted_bytes=8.0).score(0)
    (500.0, 0.0)
    """

    compute: float = 0.0
    comm_bytes: float = 0.0
    weighted_bytes: float = 0.0
    collectives: int = 0
    memory: float = 0.0
    comm_seconds: float = 0.0

    def score(self, level: int, model: CostModel | None = None) -> tuple:
        """The objective of ``level`` (a tuple, compared lexicographically)."""
        return _score(model or CostModel(level=level), self.compute, self.weighted_bytes,
                      self.comm_bytes, self.collectives, self.memory, self.comm_seconds)

    def seconds(self, model: CostModel | None = None) -> float:
        """The time of the assignment (level 2's objective): compute at the backend's
        flops rate plus the collectives' time."""
        model = model or CostModel(level=2)
        return self.compute / model.flops_per_s + self.comm_seconds


def _score(model: CostModel, compute, wbytes, nbytes, ncoll, memory, ctime=0.0) -> tuple:
    if model.level == 2:
        return (_q(compute / model.flops_per_s + ctime), _q(memory))
    s = _q(model.alpha * compute + model.beta * wbytes)
    return (s, _q(memory)) if model.level == 0 else (_q(memory), s)


class _State:
    """The partitioner's state after some equations: the layouts each live value holds
    (in the order they were made; the first is the produced one) and the running costs."""

    __slots__ = ("held", "live", "peak", "compute", "comm", "wcomm", "ncoll", "ctime")

    def __init__(self):
        self.held: dict = {}
        self.live = self.peak = self.compute = self.comm = self.wcomm = self.ctime = 0.0
        self.ncoll = 0

    def copy(self) -> "_State":
        s = _State.__new__(_State)
        s.held = dict(self.held)
        s.live, s.peak, s.compute = self.live, self.peak, self.compute
        s.comm, s.wcomm, s.ncoll, s.ctime = self.comm, self.wcomm, self.ncoll, self.ctime
        return s

    def cost(self) -> Cost:
        return Cost(self.compute, self.comm, self.wcomm, self.ncoll, self.peak, self.ctime)


def _strip(sh: Sharding) -> Sharding:
    return Sharding(sh.dims) if sh.partial else sh


def _coarser(sh: Sharding) -> list:
    """``sh`` and every layout it is a local slice of (each dimension's axes cut to a
    prefix), ``sh`` first.

    >>> [s.dims for s in _coarser(Sharding(((0, 1), ())))]
    [((0, 1), ()), ((0,), ()), ((), ())]
    """
    per_dim = [[ax[:k] for k in range(len(ax), -1, -1)] for ax in sh.dims]
    return [Sharding(tuple(dims)) for dims in itertools.product(*per_dim)]


def _axis_permutations(mesh) -> list[dict]:
    """Every permutation of the mesh axes that only swaps axes of equal size."""
    groups: dict = {}
    for a, size in enumerate(mesh.sizes):
        groups.setdefault(size, []).append(a)
    gs = [g for g in groups.values() if len(g) > 1]
    flat = [a for g in gs for a in g]
    return [dict(zip(flat, [a for p in ps for a in p]))
            for ps in itertools.product(*[itertools.permutations(g) for g in gs])]


def _permuted(sh: Sharding, m: dict) -> Sharding:
    return Sharding(tuple(tuple(m.get(a, a) for a in ax) for ax in sh.dims),
                    frozenset(m.get(a, a) for a in sh.partial))


class Problem:
    """A program to shard: its equations' factor specs, the mesh, the fixed input and
    requested output layouts, the objective; the decisions open at each equation and
    the one simulator (``step``, ``finish``) every cost in this module comes from.

    ``given_inputs[k]`` is None for an input whose layout is free: it is decided at its
    first consumer, as the layout that consumer needs, or, when the input has other
    consumers, as any coarser layout (fewer axes at the end of a dimension's split, down
    to whole) from which that need is a local slice, so later consumers may slice it too.
    """

    def __init__(self, program, mesh, specs, given_inputs, out_shardings, level: int = 0,
                 model: CostModel | None = None, seed_inputs=None, memo: Memo | None = None):
        self.program, self.mesh, self.specs = program, mesh, list(specs)
        self.eqs = program.equations
        self.n = len(self.eqs)
        self.level = level
        if memo is not None and model is None:  # the same specs: their caches serve
            self.model = memo.model
        else:
            memo = None
            self.model = model or CostModel(level=level, rates=backend_rates(mesh.size))
        self.out_shardings = list(out_shardings)
        uses: dict = {}
        last: dict = {}
        first: dict = {}
        for i, eq in enumerate(self.eqs):
            for a in eq.inputs:
                if isinstance(a, Var):
                    uses[a] = uses.get(a, 0) + 1
                    last[a] = i
                    first.setdefault(a, i)
        for a in program.outputs:
            if isinstance(a, Var):
                last[a] = self.n
        # Values freed after equation i (every layout they hold).
        self.dying = [[] for _ in range(max(self.n, 1))]
        for v, i in last.items():
            if i < self.n:
                self.dying[i].append(v)
        for i, eq in enumerate(self.eqs):
            self.dying[i].extend(v for v in eq.outputs if v not in last)
        self.given: dict = {}
        self.free_at = [[] for _ in range(self.n)]  # free inputs first consumed at i
        self.free_unused = []
        for v, g in zip(program.inputs, given_inputs, strict=True):
            if g is not None:
                self.given[v] = g
            elif v in first:
                self.free_at[first[v]].append(v)
            else:
                self.free_unused.append(v)
            if v not in last and self.n:
                self.dying[0].append(v)
        if memo is not None:
            self._skeys, self._cands, self.base = memo.skeys, memo.cache, memo.bases
        else:
            self._skeys = [spec_key(sp) for sp in self.specs]
            self._cands = SpecCache(mesh, self.model.compute)
            self.base = base_candidates(program, self.specs, mesh)  # fixed layouts: one
        # Equations lowering runs no kernel for (folded, or broadcast in the kernel of
        # their reader) compute nothing, whatever their layout.
        self.away = lowered_away(program)
        # Mesh axes the fixed layouts mention (for the symmetry of the others).
        self.fixed_axes = frozenset(a for sh in list(self.given.values()) + [
            o for o in self.out_shardings if o is not None] for a in sh.used)
        # A free input with several uses may be held coarser than its first use needs,
        # or as ``seed_inputs`` holds it (propagation's choice), up to a swap of equal
        # mesh axes (so the options stay symmetric).
        self.multi_use = {v for f in self.free_at for v in f if uses[v] > 1}
        self.seed_options: dict = {}
        seeds = dict(zip(program.inputs, seed_inputs or [None] * len(program.inputs)))
        for v in self.multi_use:
            if seeds.get(v) is not None:
                self.seed_options[v] = list(dict.fromkeys(
                    _permuted(seeds[v], m) for m in _axis_permutations(mesh)))
        self._plans: dict = {}
        self._bytes: dict = {}
        self._akeys: dict = {}

    @functools.cached_property
    def min_compute(self) -> list:
        """Per equation, a lower bound of the compute still to come (a carry computes
        as its base); only searches need it."""
        out = [0.0] * (self.n + 1)
        least: dict = {}  # (spec key, base candidates) -> least compute
        for i in reversed(range(self.n)):
            k = (self._skeys[i], tuple(self.base[i]), i in self.away)
            m = least.get(k) if self._skeys[i] is not None else None
            if m is None:
                m = least[k] = min(self.shardings(i, c)[2] for c in self.base[i])
            out[i] = out[i + 1] + m
        return out

    def shardings(self, i: int, cand: Candidate) -> tuple:
        """``(operand layouts, output layouts, compute)`` of equation ``i`` as ``cand``."""
        got = self._cands.get(self.specs[i], self._skeys[i], cand)
        return (got[0], got[1], 0.0) if i in self.away else got

    @staticmethod
    def from_propagated(prop) -> "Problem":
        """The problem ``propagate`` solved greedily (same boundary layouts and level)."""
        given = prop.given_inputs if prop.given_inputs is not None else prop.in_shardings
        memo = prop.memo
        if memo is not None and (len(prop.choice) != len(memo.specs) or any(
                spec is not mine for (spec, _), mine in zip(prop.choice, memo.specs))):
            memo = None
        return Problem(prop.program, prop.mesh, [spec for spec, _ in prop.choice], given,
                       prop.out_shardings, prop.level, seed_inputs=prop.in_shardings,
                       memo=memo)

    # -- sizes and moves ---------------------------------------------------------
    def _aval_key(self, v) -> tuple:
        # ArrayType hashes slowly (symbolic dims); a value's static shape and item size
        # say all that sizes need.
        k = self._akeys.get(v)
        if k is None:
            k = self._akeys[v] = (tuple(v.aval.shape), dtypes.to_numpy(v.aval.dtype).itemsize)
        return k

    def nbytes(self, v, sh: Sharding) -> float:
        key = (v, sh)
        b = self._bytes.get(key)
        if b is None:
            shape, itemsize = self._aval_key(v)
            b = self._bytes[key] = float(planning_prod(sh.local_shape(shape, self.mesh))
                                         * itemsize)
        return b

    def cheapest_move(self, v, versions, dst: Sharding) -> tuple | None:
        """The cheapest ``_plan`` of bringing ``v``, held in each of the layouts
        ``versions``, to ``dst`` (fewest bytes, then fewest steps); None if no version
        can get there (a move cannot add a pending sum)."""
        best = None
        for src in versions:
            if dst.partial <= src.partial:
                info = self._plan(v, src, dst)
                if best is None or info[:2] < best[:2]:
                    best = info
        return best

    def _plan(self, v, src: Sharding, dst: Sharding) -> tuple:
        """``(bytes sent, steps, collectives, transient bytes, only psums, layouts passed
        through, seconds)`` of moving ``v``: ``sharding.redistribution``, the one cost of
        a move."""
        akey = self._aval_key(v)
        key = (akey, src, dst)
        info = self._plans.get(key)
        if info is not None:
            return info
        gshape, itemsize = akey
        sent, steps, sizes = redistribution(src, dst, gshape, itemsize, self.mesh,
                                            self.model.native)
        # While a step runs, its operand (if not the held source) and result both exist.
        transient = max((s + (sizes[j - 1] if j else 0.0) for j, s in enumerate(sizes)),
                        default=0.0)
        # Every layout passed through is held too (as the partitioner keeps them).
        passed, sh = [], src
        for st in steps[:-1]:
            sh = after(sh, st)
            passed.append(sh)
        seconds = redistribution_seconds(src, dst, gshape, itemsize, self.mesh,
                                         self.model.native, self.model.rates)
        info = (sent, len(steps), sum(st.kind != "slice" for st in steps), transient,
                bool(steps) and all(st.kind == "psum" for st in steps), tuple(passed),
                seconds)
        self._plans[key] = info
        return info

    def _move(self, st: _State, v, req: Sharding, at_output: bool) -> bool:
        """Give ``v`` the layout ``req`` from the cheapest one it holds (as ``partition``'s
        ``get``); False if no held layout can reach it (a pending sum cannot be made)."""
        versions = st.held[v]
        if req in versions:
            return True
        best = self.cheapest_move(v, versions, req)
        if best is None:
            return False
        sent, _, ncoll, transient, only_psum, passed, seconds = best
        st.comm += sent
        st.ctime += seconds
        # A pending sum resolved at an output (a gradient's AllReduce) overlaps the rest
        # of a step: MindSpore's costmodel_gamma, as propagation weighs it.
        st.wcomm += sent * (self.model.gamma if at_output and only_psum else 1.0)
        st.ncoll += ncoll
        st.peak = max(st.peak, st.live + transient)
        passed = tuple(p for p in passed if p not in versions and p != req)
        st.live += self.nbytes(v, req) + sum(self.nbytes(v, p) for p in passed)
        st.held[v] = versions + passed + (req,)
        return True

    def boundary_seconds(self, v, sh: Sharding) -> float:
        """Seconds of taking a program input ``v`` into the layout ``sh``, or a result
        out of it. A virtual mesh's process holds every argument and result whole, and
        the program copies a split one into the devices' blocks on the way in (a reshape
        or a transpose: MindSpore's CPU Reshape copies too) and back on the way out, at
        the elementwise rate: for a 2048 x 2048 weight split over 8 devices, its Adam
        moments and the results, 6 copies of 1 ms a step. A job's process holds its own
        block: nothing."""
        rates = self.model.rates
        if rates.get("lanes", 1) <= 1 or not any(sh.dims):
            return 0.0
        return rates["op_s"] + planning_prod(v.aval.shape) * rates["point_s"]

    # -- the simulator -----------------------------------------------------------
    def initial(self, layouts: dict | None = None) -> _State:
        """The state before the first equation: the inputs not decided at a consumer."""
        st = _State()
        for v in self.program.inputs:
            if v in self.given:
                sh = layouts.get(v, self.given[v]) if layouts else self.given[v]
            elif v in self.free_unused:
                sh = layouts[v] if layouts else Sharding.replicated(v.aval.ndim)
            else:
                continue
            if v not in st.held:
                st.held[v] = (sh,)
                st.live += self.nbytes(v, sh)
                st.ctime += self.boundary_seconds(v, sh)
        st.peak = st.live
        return st

    def step(self, st: _State, i: int, cand: Candidate, inputs=(), copy: bool = True
             ) -> _State | None:
        """The state after equation ``i`` runs as ``cand``; ``inputs`` gives the layouts
        of the free inputs first consumed here. None if the candidate is infeasible.
        ``copy=False`` updates ``st`` itself (one path: a copy per equation would make
        its simulation quadratic in the program's length)."""
        if copy:
            st = st.copy()
        for x, sh in inputs:
            b = self.nbytes(x, sh)
            st.held[x] = (sh,)
            st.live += b
            st.ctime += self.boundary_seconds(x, sh)
            st.peak += b  # an input is held from the start: every earlier moment grows
        eq = self.eqs[i]
        ins, outs, flops = self.shardings(i, cand)
        for a, req in zip(eq.inputs, ins):
            if isinstance(a, Literal):
                if req.partial:  # a literal is whole: it cannot be one term of a sum
                    return None
                continue
            if not self._move(st, a, req, False):
                return None
        st.compute += flops
        for v, o in zip(eq.outputs, outs):
            st.held[v] = (o,)
            st.live += self.nbytes(v, o)
        st.peak = max(st.peak, st.live)
        for v in self.dying[i]:
            versions = st.held.pop(v, ())
            st.live -= sum(self.nbytes(v, s) for s in versions)
        return st

    def finish(self, st: _State) -> _State | None:
        """The state after the outputs are moved to their layouts, in order (as
        ``partition``): requested, or as produced with a pending sum resolved."""
        st = st.copy()
        for a, req in zip(self.program.outputs, self.out_shardings):
            if isinstance(a, Literal):
                continue
            if req is None:
                req = as_produced(dict.fromkeys(st.held[a]), st.held[a][0])
            if not self._move(st, a, req, True):
                return None
            st.ctime += self.boundary_seconds(a, req)
        return st

    def score(self, st: _State) -> tuple:
        return _score(self.model, st.compute, st.wcomm, st.comm, st.ncoll, st.peak, st.ctime)

    def bound(self, st: _State, i: int) -> tuple:
        """A lower bound of the score of every completion of ``st`` (from equation i)."""
        return _score(self.model, st.compute + self.min_compute[i], st.wcomm, st.comm,
                      st.ncoll, st.peak, st.ctime)

    def evaluate(self, in_shardings, choice) -> Cost | None:
        """The cost of a full assignment (None if infeasible): the objective.

        ``in_shardings`` gives every input's layout, ``choice`` every equation's
        candidate (``Candidate`` or ``(spec, Candidate)``).
        """
        layouts = dict(zip(self.program.inputs, in_shardings, strict=True))
        st = self.initial(layouts)
        for i, c in enumerate(choice):
            c = c[1] if isinstance(c, tuple) else c
            st = self.step(st, i, c, tuple((x, layouts[x]) for x in self.free_at[i]),
                           copy=False)
            if st is None:
                return None
        st = self.finish(st)
        return None if st is None else st.cost()

    # -- the decisions -----------------------------------------------------------
    def decisions(self, st: _State, i: int, first=None):
        """Every ``(candidate, input layouts)`` open at equation ``i`` in state ``st``:
        the factor rule's candidates, those passing on the operands' pending sums
        (as propagation makes them), and the layouts of the free inputs first
        consumed here. ``first`` (a decision, e.g. greedy propagation's) comes first when
        it is among them."""
        eq, spec = self.eqs[i], self.specs[i]
        cands = list(self.base[i])
        partials = [st.held[a][0].partial if isinstance(a, Var) and a in st.held
                    else frozenset() for a in eq.inputs]
        if any(partials):  # each spec's linear groups say where a pending sum may pass
            cands += [c for b in self.base[i]
                      for c in carry_variants(spec, b, eq.prim.name, partials)]
        new = self.free_at[i]
        out = []
        for cand in cands:
            if not new:
                out.append((cand, ()))
                continue
            ins = self.shardings(i, cand)[0]
            opts = []
            for x in new:
                adopt = _strip(next(r for a, r in zip(eq.inputs, ins) if a is x))
                opts.append(list(dict.fromkeys(_coarser(adopt) + self.seed_options.get(x, [])))
                            if x in self.multi_use else [adopt])
            for combo in itertools.product(*opts):
                out.append((cand, tuple(zip(new, combo))))
        if first is not None and first in out:
            out.remove(first)
            out.insert(0, first)
        return out

    def assignment(self, decisions) -> tuple[list, list]:
        """``(in_shardings, candidates)`` of a list of decisions (one per equation)."""
        layouts = {v: self.given.get(v, Sharding.replicated(v.aval.ndim))
                   for v in self.program.inputs}
        for _, inputs in decisions:
            layouts.update(inputs)
        return [layouts[v] for v in self.program.inputs], [c for c, _ in decisions]

    def decisions_of(self, in_shardings, choice) -> list:
        """The decisions of an assignment (e.g. greedy propagation's)."""
        layouts = dict(zip(self.program.inputs, in_shardings, strict=True))
        return [(c[1] if isinstance(c, tuple) else c,
                 tuple((x, layouts[x]) for x in self.free_at[i]))
                for i, c in enumerate(choice)]

    def added(self, st: _State, i: int, cand: Candidate, inputs=()) -> tuple | None:
        """``(bytes sent, compute)`` that equation ``i`` as ``cand`` adds in state
        ``st`` (what ``step`` would add, without building the new state); None if
        infeasible."""
        eq = self.eqs[i]
        ins, _, flops = self.shardings(i, cand)
        fresh = dict(inputs)
        sent, done = 0.0, set()
        for a, req in zip(eq.inputs, ins):
            if isinstance(a, Literal):
                if req.partial:
                    return None
                continue
            versions = (fresh[a],) if a in fresh else st.held[a]
            if req in versions or (a, req) in done:
                continue
            best = self.cheapest_move(a, versions, req)
            if best is None:
                return None
            sent += best[0]
            done.add((a, req))
        return sent, flops

    def lazy_decisions(self, whole: bool = False) -> list:
        """The decisions that communicate as late as possible: at each equation, the one
        adding the fewest bytes now, then the fewest split or pending layouts among its
        operands and results (whole rather than sliced: what is replicated stays so),
        then the most compute, no pending sum carried on. From split batches and
        whole weights this is data parallelism: each gradient reduced where it is first
        used. A second path the search keeps through its cuts, next to greedy
        propagation's (which can miss it: it decides each value by its neighbours).
        Linear in the program: each decision is priced without building its state.

        ``whole``: the fewest split or pending layouts among the equation's operands and
        results first, then the fewest bytes: every equation computed whole on every
        device, a split input gathered where it is first used (``whole_path``). (By
        layouts, not by compute: a measured table may price a block's kernel above the
        whole one's. So, for the same reason, is "whole rather than sliced" above:
        ranked by compute, a measured table of 8 virtual devices sliced semi_auto's
        whole-batch MLP step locally and reduced it again, 16 collectives where none
        are needed.)"""
        st = self.initial()
        out = []
        # The choice depends on the spec, the sizes and the layouts the operands hold
        # only: a program repeats few such situations, each is decided once.
        memo: dict = {}
        for i in range(self.n):
            key = None
            eq, fresh = self.eqs[i], self.free_at[i]
            if self._skeys[i] is not None:
                key = (self._skeys[i], tuple(self.base[i]), tuple(
                    ("literal", a.aval.shape) if isinstance(a, Literal) else
                    (fresh.index(a), a in self.multi_use, tuple(self.seed_options.get(a, ())),
                     self._aval_key(a)) if a in fresh else
                    (st.held[a], self._aval_key(a)) for a in eq.inputs))
                hit = memo.get(key)
                if hit is not None:  # (the free inputs by their place among ``fresh``)
                    d = (hit[0], tuple((fresh[k], sh) for k, sh in hit[1]))
                    out.append(d)
                    if self.step(st, i, *d, copy=False) is None:
                        return []
                    continue
            best = None
            for d in self.decisions(st, i):
                if d[0].carry:
                    continue
                add = self.added(st, i, *d)
                if add is None or (not whole and best is not None and add[0] > best[0][0]):
                    continue  # (more bytes than the best: its layouts need no count)
                k = (self._split_layouts(i, d[0]), add[0]) if whole else \
                    (add[0], self._split_layouts(i, d[0]), -add[1])
                if best is None or k < best[0]:
                    best = (k, d)
            if best is None:
                return []
            out.append(best[1])
            if key is not None:
                memo[key] = (best[1][0], tuple((fresh.index(x), sh) for x, sh in best[1][1]))
            if self.step(st, i, *best[1], copy=False) is None:
                return []
        return out

    def _split_layouts(self, i: int, cand: Candidate) -> int:
        """How many of equation ``i``'s operand and result layouts as ``cand`` are
        split or hold a pending sum."""
        ins, outs, _ = self.shardings(i, cand)
        return sum(any(sh.dims) or bool(sh.partial) for sh in (*ins, *outs))

    def run(self, decisions) -> list:
        """The states along a list of decisions (``len + 1`` of them; None once
        infeasible)."""
        states = [self.initial()]
        for i, (c, inputs) in enumerate(decisions):
            prev = states[-1]
            states.append(None if prev is None else self.step(prev, i, c, inputs))
        return states


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass
class Found:
    """An assignment and its cost: ``in_shardings`` per input, ``choice`` a candidate
    per equation. ``exact``: proven optimal. ``evaluations``: simulated equations."""

    in_shardings: list
    choice: list
    cost: Cost
    score: tuple
    exact: bool
    evaluations: int
    seconds: float = 0.0


def cost(prop) -> Cost:
    """The cost of a propagated program as ``partition`` will run it (e.g. greedy
    propagation's).

    >>> import numpy as np, fshard as fs
    >>> from fshard.sharding.propagation import propagate
    >>> f = fs.shard(lambda x, w: x @ w, in_strategy=((2, 1), None), mesh=2)
    >>> p = f._prepare((np.ones((4, 3), np.float32), np.ones((3, 5), np.float32)))[0]
    >>> prop = propagate(p.body, p.in_shardings, p.out_shardings, p.mesh)
    >>> cost(prop).collectives  # the output is gathered: one AllGather
    1
    """
    problem = Problem.from_propagated(prop)
    c = problem.evaluate(prop.in_shardings, prop.choice)
    assert c is not None, "a propagated program is always feasible"
    return c


def score(prop) -> tuple:
    """The objective of a propagated program in the rates of its own problem (a job's
    or a calibrated table's, not the defaults): what ``refine`` compares plans by."""
    problem = Problem.from_propagated(prop)
    return problem.evaluate(prop.in_shardings, prop.choice).score(prop.level, problem.model)


class _Budget(Exception):
    pass


def _key(st: _State) -> tuple:
    """What the future of a state depends on: the layouts each live value holds."""
    return tuple(st.held.items())  # (a Var compares and hashes by identity)


def _fresh_groups(P: Problem, st: _State) -> list:
    """Mesh axes of equal size that nothing held or requested mentions: swapping them
    maps every completion to one of equal cost (the candidates are closed under it)."""
    used = set(P.fixed_axes)
    for versions in st.held.values():
        for sh in versions:
            used |= sh.used
    groups: dict = {}
    for a, size in enumerate(P.mesh.sizes):
        if a not in used:
            groups.setdefault(size, []).append(a)
    return [g for g in groups.values() if len(g) > 1]


def _canonical(d, perms) -> tuple:
    """The least key of decision ``d`` over the axis permutations ``perms``."""
    cand, inputs = d

    def key(m):
        assign = tuple(sorted((lab, tuple(m.get(a, a) for a in ax)) for lab, ax in cand.assign))
        carry = tuple(sorted(m.get(a, a) for a in cand.carry))
        ins = tuple((tuple(tuple(m.get(a, a) for a in ax) for ax in sh.dims),
                     tuple(sorted(m.get(a, a) for a in sh.partial))) for _, sh in inputs)
        return (assign, carry, cand.carry_ops, ins)

    return min(key(m) for m in perms)


def exhaustive(prop, limit: int = 5_000_000, prune: bool = True, memo: bool = True,
               symmetry: bool = True) -> Found | None:
    """The optimal assignment, by enumerating every one (None past ``limit`` simulated
    equations).

    Depth-first over the equations in program order, greedy's path first. Three exact
    cuts (each can be turned off, e.g. to check them): ``prune`` skips a branch whose
    lower bound (costs so far plus the least compute still to come) cannot beat the best
    found (branch and bound); ``memo`` skips a branch that reaches a state (the layouts
    each live value holds) already reached with costs at least as good, since both have
    the same completions; ``symmetry`` tries one decision of each class that differs
    only by a swap of equal mesh axes nothing mentions yet.

    >>> import numpy as np, fshard as fs
    >>> from fshard.sharding.propagation import propagate
    >>> f = fs.shard(lambda x, w: x @ w, in_strategy=((2, 1), None), mesh=2)
    >>> p = f._prepare((np.ones((4, 3), np.float32), np.ones((3, 5), np.float32)))[0]
    >>> prop = propagate(p.body, p.in_shardings, p.out_shardings, p.mesh)
    >>> exhaustive(prop).exact
    True
    """
    t0 = time.perf_counter()
    P = Problem.from_propagated(prop)
    greedy = P.decisions_of(prop.in_shardings, prop.choice)
    best: list = [None, None]  # score, decisions
    count = [0]
    seen: dict = {}  # (i, state key) -> costs-so-far front

    def dfs(i, st, path):
        if i == P.n:
            fin = P.finish(st)
            if fin is not None:
                sc = P.score(fin)
                if best[0] is None or sc < best[0]:
                    best[0], best[1] = sc, list(path)
            return
        options = P.decisions(st, i, greedy[i])
        groups = _fresh_groups(P, st) if symmetry else []
        if groups:
            perms = [dict(zip(sum(groups, []), sum(map(list, p), [])))
                     for p in itertools.product(*[itertools.permutations(g) for g in groups])]
            classes: set = set()
            kept = []
            for d in options:
                k = _canonical(d, perms)
                if k not in classes:
                    classes.add(k)
                    kept.append(d)
            options = kept
        for d in options:
            count[0] += 1
            if count[0] > limit:
                raise _Budget
            s2 = P.step(st, i, *d)
            if s2 is None:
                continue
            if prune and best[0] is not None and P.bound(s2, i + 1) >= best[0]:
                continue
            if memo and not _insert(seen, (i, _key(s2)), P.score(s2), None, None, P.level):
                continue
            path.append(d)
            dfs(i + 1, s2, path)
            path.pop()

    try:
        dfs(0, P.initial(), [])
    except _Budget:
        return None
    ins, choice = P.assignment(best[1])
    c = P.evaluate(ins, choice)
    return Found(ins, choice, c, c.score(P.level, P.model), True, count[0],
                 time.perf_counter() - t0)


class _Estimate:
    """The cost still to come from a state, to rank the beam's states (not a bound).

    Each equation is valued by its best candidate given one operand's layout (its first
    operand that is not a free input: the one charged with it) plus the estimated
    futures of its outputs; every other operand adds what its own layout forces beyond
    the equation's unconstrained best (its excess). Equations without such an operand
    are valued on their own. Memoized per (value, consumer, layout), filled in reverse
    program order.
    """

    def __init__(self, P: Problem):
        self.P = P
        self.cons: dict = {}
        for j, eq in enumerate(P.eqs):
            for a in eq.inputs:
                if isinstance(a, Var):
                    lst = self.cons.setdefault(a, [])
                    if not lst or lst[-1] != j:
                        lst.append(j)
        free = {x for f in P.free_at for x in f}
        self.primary = []
        for eq in P.eqs:
            vs = [a for a in eq.inputs if isinstance(a, Var) and a not in free]
            self.primary.append(vs[0] if vs else None)
        self.out_req: dict = {}
        for a, req in zip(P.program.outputs, P.out_shardings):
            if isinstance(a, Var):
                self.out_req.setdefault(a, []).append(req)
        self._edge: dict = {}
        self._future: dict = {}
        self._held: dict = {}  # (value, its layouts, i) -> what it adds from equation i
        self._tables: dict = {}
        self._rest: dict = {}
        self.best = [0.0] * P.n  # each equation's unconstrained best
        self.rootless = [0.0] * (P.n + 1)  # suffix sums of the equations valued alone
        for j in reversed(range(P.n)):  # futures first, so the recursion stays shallow
            self.best[j] = min(self.rest(j, c) for c in P.base[j])
            alone = self.best[j] if self.primary[j] is None else 0.0
            self.rootless[j] = self.rootless[j + 1] + alone

    def rest(self, j: int, c: Candidate) -> float:
        """Equation ``j``'s compute as ``c`` plus the futures of its outputs."""
        key = (j, c)
        r = self._rest.get(key)
        if r is None:
            _, outs, flops = self.P.shardings(j, c)
            r = self._rest[key] = self.unit(flops) + sum(
                self.future(w, o) for w, o in zip(self.P.eqs[j].outputs, outs))
        return r

    def unit(self, compute=0.0, nbytes=0.0, wbytes=0.0, seconds=0.0) -> float:
        """The additive part of the objective of the level."""
        m = self.P.model
        if m.level == 2:
            return compute / m.flops_per_s + seconds
        return m.alpha * compute + m.beta * wbytes

    def move(self, v, src: Sharding, req: Sharding, at_output: bool = False) -> float:
        if src == req:
            return 0.0
        if not req.partial <= src.partial:
            return math.inf
        sent, _, _, _, only_psum, _, seconds = self.P._plan(v, src, req)
        w = sent * (self.P.model.gamma if at_output and only_psum else 1.0)
        return self.unit(0.0, sent, w, seconds)

    def _table(self, j: int, v, partial) -> list:
        """``[(layouts v needs, best rest of j)]`` over the candidates of consumer ``j``
        (with those passing on a pending sum over ``partial``)."""
        key = (j, v, partial)
        table = self._tables.get(key)
        if table is not None:
            return table
        P, eq, spec = self.P, self.P.eqs[j], self.P.specs[j]
        cands = list(P.base[j])
        if partial:
            pos = {k for k, a in enumerate(eq.inputs) if a is v}
            for g in linear_groups(eq.prim.name, spec, len(eq.inputs)):
                if pos & set(g):
                    partials = [partial if k in g else frozenset() for k in range(len(eq.inputs))]
                    cands += [c for b in P.base[j]
                              for c in carry_variants(spec, b, eq.prim.name, partials)]
        best: dict = {}
        for c in cands:
            ins = P.shardings(j, c)[0]
            reqs = tuple(dict.fromkeys(req for a, req in zip(eq.inputs, ins) if a is v))
            r = self.rest(j, c)
            if r < best.get(reqs, math.inf):
                best[reqs] = r
        table = self._tables[key] = list(best.items())
        return table

    def edge(self, v, j: int, src: Sharding) -> float:
        """What consumer ``j`` of ``v`` costs when ``v`` is held as ``src``: all of it
        for its charged operand, the excess over its best for another."""
        key = (v, j, src)
        r = self._edge.get(key)
        if r is None:
            r = min((rest + sum(self.move(v, src, req) for req in reqs)
                     for reqs, rest in self._table(j, v, src.partial)), default=0.0)
            if self.primary[j] is not v:
                r = max(0.0, r - self.best[j])
            self._edge[key] = r
        return r

    def future(self, w, sh: Sharding) -> float:
        """What every consumer of ``w`` (and its output move) costs from ``sh``."""
        key = (w, sh)
        r = self._future.get(key)
        if r is None:
            r = sum(self.edge(w, j, sh) for j in self.cons.get(w, ()))
            for req in self.out_req.get(w, ()):
                r += self.move(w, sh, req or Sharding(sh.dims), True)
            self._future[key] = r
        return r

    def __call__(self, st: _State, i: int) -> float:
        """The estimated cost of equations ``i``.. and the output moves."""
        h = self.rootless[i]
        memo = self._held
        for v, versions in st.held.items():
            # (many states of a beam hold a value the same way: priced once)
            c = memo.get((v, versions, i))
            if c is None:
                c = 0.0
                for j in self.cons.get(v, ()):
                    if j >= i:
                        c += min(self.edge(v, j, s) for s in versions)
                for req in self.out_req.get(v, ()):
                    c += min(self.move(v, s, req or Sharding(s.dims), True) for s in versions)
                memo[(v, versions, i)] = c
            h += c
        return h


def _dominates(level: int, a: tuple, b: tuple) -> bool:
    """Whether entry ``a`` (additive score, peak) is at least as good as ``b`` in every
    completion. Levels 0 and 2 rank by the additive score first, so the lexicographic
    order is exact; level 1 ranks by the peak (a maximum) first: both must be no worse."""
    if level == 1:
        return a[0] <= b[0] and a[1] <= b[1]
    return a <= b


def search(prop, width: int | None = None, polish: int | None = None,
           budget: int = 60_000) -> Found:
    """The best assignment found by a dynamic program over the equations.

    The states after equation ``i`` are the layouts each live value holds: two partial
    assignments that reach the same state have the same future, so only the better
    (for level 1: each on the Pareto front of peak memory and cost) is kept. While no
    more than ``width`` states survive a step, the result is optimal (``exact``); past
    that, the ``width`` states with the lowest bound are kept (a beam), plus the states
    on greedy propagation's path and on ``lazy_decisions``' (data parallelism when the
    batch is split and the weights whole), so the result is never worse than either. Coordinate
    descent (each equation in turn tries every decision, the others fixed) then
    polishes it, within ``polish`` simulated equations.

    By default both follow from ``budget`` (simulated equations, about 0.1 ms each):
    the beam is as wide as the budget allows for the program's candidates (4 to 48
    states), and the polish gets half of it.

    >>> import numpy as np, fshard as fs
    >>> from fshard.sharding.propagation import propagate
    >>> f = fs.shard(lambda x, w: x @ w, in_strategy=((2, 1), None), mesh=2)
    >>> p = f._prepare((np.ones((4, 3), np.float32), np.ones((3, 5), np.float32)))[0]
    >>> prop = propagate(p.body, p.in_shardings, p.out_shardings, p.mesh)
    >>> search(prop).score <= cost(prop).score(0)
    True
    """
    t0 = time.perf_counter()
    P = Problem.from_propagated(prop)
    if width is None:
        width = max(4, min(48, budget // max(1, sum(len(b) for b in P.base))))
    if polish is None:
        polish = budget // 2
    level = P.level
    greedy = P.decisions_of(prop.in_shardings, prop.choice)
    greedy_states = P.run(greedy)
    lazy = P.lazy_decisions()
    lazy_states = P.run(lazy) if lazy else [None] * (P.n + 1)
    count = 0
    exact = True
    key = _key
    merit = P.score  # the costs so far, for dominance between equal states
    estimate = None  # built when the first cut is needed

    def rank(st, i):
        total = estimate.unit(st.compute, st.comm, st.wcomm, st.ctime) + estimate(st, i)
        return (_q(st.peak), total) if level == 1 else (total, _q(st.peak))
    # entries: state key -> list of (merit, state, path); a path is (parent path, decision)
    entries = {key(greedy_states[0]): [(merit(greedy_states[0]), greedy_states[0], None)]}
    for i in range(P.n):
        new: dict = {}
        for front in entries.values():
            for _, st, path in front:
                for d in P.decisions(st, i, greedy[i]):
                    count += 1
                    s2 = P.step(st, i, *d)
                    if s2 is None:
                        continue
                    _insert(new, key(s2), merit(s2), s2, (path, d), level)
        if sum(len(f) for f in new.values()) > width:
            if estimate is None:
                estimate = _Estimate(P)
            flat = [(rank(e[1], i + 1), k, e) for k, front in new.items() for e in front]
        else:
            flat = [(None, k, e) for k, front in new.items() for e in front]
        if len(flat) > width:
            exact = False
            flat.sort(key=lambda t: t[0])
            flat = flat[:width]
        entries = {}
        for _, k, e in flat:
            entries.setdefault(k, []).append(e)
        for path, states in ((greedy, greedy_states), (lazy, lazy_states)):
            g = states[i + 1]
            if g is not None:  # greedy's and the lazy path survive every cut
                _insert(entries, key(g), merit(g), g, _path_of(path[:i + 1]), level)
    best = None
    for front in entries.values():
        for _, st, path in front:
            fin = P.finish(st)
            if fin is not None:
                sc = P.score(fin)
                if best is None or sc < best[0]:
                    best = (sc, _unpath(path))
    decisions = best[1]
    if not exact and polish:
        decisions, n = _coordinate_descent(P, decisions, polish)
        count += n
    ins, choice = P.assignment(decisions)
    c = P.evaluate(ins, choice)
    return Found(ins, choice, c, c.score(level, P.model), exact, count,
                 time.perf_counter() - t0)


def _insert(table: dict, k, m, st, path, level: int) -> bool:
    """Add ``(m, st, path)`` to the front of state ``k`` unless an entry there dominates
    it (then False); drop the entries it dominates."""
    front = table.get(k)
    if front is None:
        table[k] = [(m, st, path)]
        return True
    if any(_dominates(level, f[0], m) for f in front):
        return False
    front[:] = [f for f in front if not _dominates(level, m, f[0])]
    front.append((m, st, path))
    return True


def _path_of(decisions) -> tuple | None:
    path = None
    for d in decisions:
        path = (path, d)
    return path


def _unpath(path) -> list:
    out = []
    while path is not None:
        path, d = path
        out.append(d)
    return out[::-1]


def _coordinate_descent(P: Problem, decisions: list, budget: int) -> tuple[list, int]:
    """Each equation in turn takes its best decision with the others fixed (a later
    candidate that can no longer carry a pending sum falls back to its base), until no
    move improves or ``budget`` simulated equations are spent."""
    count = 0

    def complete(states, i, d, best_score):
        """Score of the assignment with decision ``d`` at ``i`` (None: worse/infeasible)."""
        nonlocal count
        st = P.step(states[i], i, *d)
        count += 1
        path = [d]
        for j in range(i + 1, P.n):
            if st is None or P.bound(st, j) >= best_score:
                return None
            c, inputs = decisions[j]
            s2 = P.step(st, j, c, inputs)
            count += 1
            if s2 is None and c.carry:
                c = Candidate(c.assign)
                s2 = P.step(st, j, c, inputs)
                count += 1
            st = s2
            path.append((c, inputs))
        if st is None:
            return None
        fin = P.finish(st)
        return None if fin is None else (P.score(fin), path)

    states = P.run(decisions)
    best_score = P.score(P.finish(states[-1]))
    improved = True
    while improved and count < budget:
        improved = False
        for i in range(P.n):
            for d in P.decisions(states[i], i):
                if d == decisions[i]:
                    continue
                r = complete(states, i, d, best_score)
                if r is not None and r[0] < best_score:
                    best_score, decisions = r[0], decisions[:i] + r[1]
                    states = P.run(decisions)
                    improved = True
                if count >= budget:
                    return decisions, count
    return decisions, count


def _static(prop) -> bool:
    return all(v.aval.is_static for v in prop.program.inputs) and all(
        v.aval.is_static for eq in prop.program.equations for v in eq.outputs)


def whole_path(problem: Problem) -> tuple | None:
    """``(in_shardings, choice, score)`` of the plan computing every equation whole on
    every device (``lazy_decisions(whole=True)``: a split batch gathered where it is
    first used, no gradient reduced), or None when it is not open.

    Open only for the time objective (level 2) where the mesh's devices are a job's
    processes (``CostModel.job``): there each process computes its own copy at once,
    and on a CPU job, whose collectives cost more than a small program's compute, it is
    often the fastest plan (measured: 1.4-2.8x faster than data parallelism for the
    small MLPs of benchmarks/plan_choice.py). On a virtual mesh one process runs every
    device, so a split never saves time there and this path would win almost every
    program; the virtual mesh's plan is the N-device program it stands for, so it is not
    offered there.
    """
    if problem.level != 2 or not problem.model.job:
        return None
    decisions = problem.lazy_decisions(whole=True)
    if not decisions:
        return None
    ins, choice = problem.assignment(decisions)
    found = problem.evaluate(ins, choice)
    return None if found is None else (ins, choice, found.score(problem.level, problem.model))


def cheaper_path(prop, problem: "Problem | None" = None):
    """``prop``, the plan that follows the inputs (``lazy_decisions``: data parallel
    from a split batch and whole weights), or in a job the plan computing everything
    whole (``whole_path``), whichever the objective prices lowest (``prop`` on a tie).
    Two or three simulations of the program: linear in its length.
    ``fs.AutoParallel``'s ``"sharding_propagation"``: greedy propagation decides each
    value by its neighbours and can gather activations where data parallelism needs no
    collective but the gradients' AllReduces."""
    if not _static(prop):
        return prop
    problem = problem or Problem.from_propagated(prop)
    greedy = problem.evaluate(prop.in_shardings, prop.choice)
    best, best_score = None, greedy.score(prop.level, problem.model)
    decisions = problem.lazy_decisions()
    if decisions:
        ins, choice = problem.assignment(decisions)
        lazy = problem.evaluate(ins, choice)
        if lazy is not None and lazy.score(prop.level, problem.model) < best_score:
            best, best_score = (ins, choice), lazy.score(prop.level, problem.model)
    whole = whole_path(problem)
    if whole is not None and whole[2] < best_score:
        best = whole[:2]
    return prop if best is None else with_assignment(prop, *best)


#: Simulated equations ``refine`` may spend on the dynamic program (about 20-50 µs
#: each): a program whose narrowest beam (4 states per equation) needs more is planned
#: by ``cheaper_path`` alone, so planning stays linear in the program's length.
REFINE_BUDGET = 6_000


def refine(prop, budget: int = REFINE_BUDGET):
    """``prop`` with the choices of ``search`` (``fs.shard(..., search=True)``); ``prop``
    itself when the shapes are symbolic or the search finds nothing better. A program
    too large for the dynamic program within ``budget`` simulated equations takes the
    cheaper of greedy propagation and following the inputs (``cheaper_path``).

    >>> import numpy as np, fshard as fs
    >>> from fshard.sharding.propagation import propagate
    >>> f = fs.shard(lambda x, w: x @ w, in_strategy=((2, 1), None), mesh=2)
    >>> p = f._prepare((np.ones((4, 3), np.float32), np.ones((3, 5), np.float32)))[0]
    >>> prop = propagate(p.body, p.in_shardings, p.out_shardings, p.mesh)
    >>> cost(refine(prop)).score(0) <= cost(prop).score(0)
    True
    """
    if not _static(prop):
        return prop
    problem = Problem.from_propagated(prop)
    if 4 * sum(len(b) for b in problem.base) > budget:
        return cheaper_path(prop, problem)
    found = search(prop, budget=budget)
    # (every score in the rates of the problem: a calibrated table's, not the defaults)
    greedy = problem.evaluate(prop.in_shardings, prop.choice).score(prop.level, problem.model)
    whole = whole_path(problem)
    if whole is not None and whole[2] < min(found.score, greedy):
        return with_assignment(prop, *whole[:2])
    if found.score >= greedy:
        return prop
    return with_assignment(prop, found.in_shardings, found.choice)


def follow_inputs(prop):
    """``prop`` planned as MindSpore's semi-auto parallel plans an operator without a
    strategy: each equation takes the decision that communicates as late as possible
    (``Problem.lazy_decisions``), so from split batches and whole weights every
    unconstrained operator runs data parallel and each gradient is reduced where it is
    first used; the given layouts and operator strategies stay. None when the shapes
    are symbolic or no such plan exists. ``prop`` needs no decisions of its own
    (``propagation.undecided``): only its equations' specs and boundary layouts."""
    if not _static(prop):
        return None
    problem = Problem.from_propagated(prop)
    decisions = problem.lazy_decisions()
    if not decisions:
        return None
    return with_assignment(prop, *problem.assignment(decisions))


def with_assignment(prop, in_shardings, choice):
    """A Propagated running ``choice`` (a candidate per equation) from ``in_shardings``."""
    program = prop.program
    known = dict(zip(program.inputs, in_shardings, strict=True))
    pairs = []
    for eq, (spec, _), cand in zip(program.equations, prop.choice, choice, strict=True):
        known.update(zip(eq.outputs, candidate_shardings(spec, cand)[1]))
        pairs.append((spec, cand))
    return replace(prop, choice=pairs, shardings=known, in_shardings=list(in_shardings))


def choose_split_axes(body: Program, in_shardings: list, out_shardings: list,
                      mesh: ShardMesh, level: int, flexible, tied=()) -> tuple[list, list]:
    """``(in_shardings, out_shardings)`` with the layouts at ``flexible`` (``("in", k)``
    or ``("out", k)``: those given as tuple strategies) moved to the mesh axes that
    make the whole plan cheapest. Each pair in ``tied`` (an input and the output it
    becomes at the next call, given the same strategy) moves together: a carried value
    keeps its devices from call to call.

    With few choices, every combination is scored. Otherwise the layouts given the same
    strategy move together (MindSpore derives every operator's devices from its
    strategy by one rule, so equal strategies share devices): every combination of
    those groups when there are few, else coordinate descent over them from the
    row-major default. The default wins ties, so a plan only changes when another
    assignment is strictly cheaper; each trial propagates the whole step, so the
    trials are bounded whatever the program's number of parameters."""
    start = {"in": list(in_shardings), "out": list(out_shardings)}
    follower = {b: a for a, b in tied if a in flexible and b in flexible
                and start[a[0]][a[1]] is not None
                and start[a[0]][a[1]] == start[b[0]][b[1]]}
    leaders: dict = {}
    for b, a in follower.items():
        leaders.setdefault(a, []).append(b)
    options = {(side, k): split_alternatives(start[side][k], mesh) for side, k in flexible
               if start[side][k] is not None and (side, k) not in follower}
    options = {key: v for key, v in options.items() if len(v) > 1}
    if not options or not all(v.aval.is_static for v in body.inputs):
        return start["in"], start["out"]
    if math.prod(len(v) for v in options.values()) > _EXHAUSTIVE:
        # One option per starting layout: moving it moves every value that starts there.
        groups: dict = {}
        for key in options:
            groups.setdefault(start[key[0]][key[1]], []).append(key)
        options = {tuple(keys): options[keys[0]] for keys in groups.values()}
    else:
        options = {(key,): alts for key, alts in options.items()}

    def with_(base, option, sh):
        new = {"in": list(base["in"]), "out": list(base["out"])}
        for key in option:
            for side, k in [key, *leaders.get(key, ())]:
                new[side][k] = sh
        return new

    memo = Memo(body, mesh, level)  # the trials share their decisions

    def score(s):
        return cost(propagate(body, s["in"], s["out"], mesh, level, memo)).score(level)

    best, best_score = start, score(start)
    if math.prod(len(v) for v in options.values()) <= _EXHAUSTIVE:
        for combo in itertools.product(*options.values()):
            trial = start
            for option, sh in zip(options, combo):
                trial = with_(trial, option, sh)
            s = score(trial)
            if s < best_score:
                best, best_score = trial, s
        return best["in"], best["out"]
    moved = [key for option in options for k in option for key in [k, *leaders.get(k, ())]]
    for _ in range(3):
        improved = False
        for option, alts in options.items():
            side, k = option[0]
            for sh in alts:
                if sh == best[side][k]:
                    continue
                trial = with_(best, option, sh)
                s = score(trial)
                if s < best_score:
                    best, best_score, improved = trial, s, True
        for trial in _relabelled(best, moved, mesh):
            s = score(trial)
            if s < best_score:
                best, best_score, improved = trial, s, True
        if not improved:
            break
    return best["in"], best["out"]


def _relabelled(base: dict, keys: list, mesh: ShardMesh):
    """Trials of ``choose_split_axes``'s descent: for each axes tuple ``old`` that some
    layout at ``keys`` splits a dimension over, and each other tuple ``new`` of as many
    devices, ``base`` with every such dimension split over ``new``. Layouts of different
    strategies then move together: tensor parallelism's column-split ``(1, tp)`` and
    row-split ``(tp, 1)`` weights must share their devices, and moving either group
    alone costs more than it saves (their matmuls then disagree), so the one-group moves
    stop at the default even when both moved are cheaper (``dp=2 x tp=4`` on
    ``(2, 2, 2)``: weights on axes ``(0, 1)`` where the batch is on ``0``). A layout the
    move would give an axis twice stays as it is."""
    olds = sorted({ax for side, k in keys for ax in base[side][k].dims if ax})
    axes = range(len(mesh.sizes))
    for old in olds:
        size = mesh.count(old)
        for r in axes:
            for new in itertools.combinations(axes, r + 1):
                if new == old or mesh.count(new) != size:
                    continue
                trial = {"in": list(base["in"]), "out": list(base["out"])}
                changed = False
                for side, k in keys:
                    sh = base[side][k]
                    dims = tuple(new if ax == old else ax for ax in sh.dims)
                    flat = [a for ax in dims for a in ax] + list(sh.partial)
                    if dims != sh.dims and len(flat) == len(set(flat)):
                        trial[side][k] = Sharding(dims, sh.partial)
                        changed = True
                if changed:
                    yield trial


# Boundary-layout combinations scored one by one at most (each propagates the program).
_EXHAUSTIVE = 64
