"""Layouts of values over a mesh, and the steps that move a value between them.

Vocabulary (NB: Shardy's factor-based sharding rules, GSPMD's partial state):

- A *mesh* for partitioning (``ShardMesh``) has axes of prime size (8 devices ->
  (2, 2, 2)), so every MindSpore split count that divides the device count is a
  group of consecutive axes, and MindSpore's row-major rank order is preserved.
- A ``Sharding`` says, for every dimension of a value, which mesh axes split it
  (major first), and over which axes the value is a *pending sum* (``partial``).
  A value is replicated over every axis it does not mention.
- A ``Candidate`` is one way to run an equation: which mesh axes split each factor of
  its primitive's ``FactorSpec`` (fshard/core/factors.py); ``candidates`` enumerates them.
- A primitive that is linear in some operands lets a pending sum *pass through*
  (``carry_variants``): the AllReduce is paid once, late, on the smallest value
  (GSPMD's partial propagation).
- ``plan`` gives the steps (gather, reduce, reduce-scatter, local slice) from one
  layout to another; fshard/sharding/cost.py prices them.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from fshard.core.dims import dim_multiple_of
from fshard.core.factors import FactorSpec, linear_groups

# ---------------------------------------------------------------------------
# Meshes and shardings
# ---------------------------------------------------------------------------


def prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@functools.lru_cache(maxsize=1 << 12)
def _axes_count(sizes: tuple, axes) -> int:
    return math.prod(sizes[a] for a in axes)


@dataclass(frozen=True)
class ShardMesh:
    """The mesh of prime-sized axes a sharded function is partitioned over."""

    sizes: tuple[int, ...]

    @staticmethod
    def for_devices(n: int) -> "ShardMesh":
        return ShardMesh(tuple(sorted(prime_factors(n), reverse=True)))

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"m{i}" for i in range(len(self.sizes)))

    def name(self, axes) -> tuple[str, ...]:
        return tuple(f"m{a}" for a in axes)

    def count(self, axes) -> int:
        # Planning asks this hundreds of thousands of times for a few axis sets.
        try:
            return _axes_count(self.sizes, axes)
        except TypeError:  # an unhashable collection of axes
            return math.prod(self.sizes[a] for a in axes)

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.sizes):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def groups(self, axes) -> list[list[int]]:
        """Rank groups that communicate over ``axes`` (one group per coordinate of the
        other axes), each ordered major-first over ``axes``."""
        others = [a for a in range(len(self.sizes)) if a not in axes]
        groups = {}
        for r in range(self.size):
            c = self.coords(r)
            groups.setdefault(tuple(c[a] for a in others), []).append(r)
        return list(groups.values())

    def axes_for_count(self, start: int, count: int) -> tuple[tuple[int, ...], int]:
        """Consecutive axes from ``start`` whose sizes multiply to ``count``."""
        axes, prod, a = [], 1, start
        while prod < count and a < len(self.sizes):
            axes.append(a)
            prod *= self.sizes[a]
            a += 1
        if prod != count:
            return None, a
        return tuple(axes), a


@dataclass(frozen=True)
class Sharding:
    """Per dimension, the mesh axes splitting it (major first); plus pending-sum axes."""

    dims: tuple[tuple[int, ...], ...]
    partial: frozenset = frozenset()

    # The search hashes layouts millions of times (dict keys of its states and
    # tables): hash the nested tuples once.
    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.dims, self.partial)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:  # (the hashes differ for almost every unequal pair)
        if self is other:
            return True
        if not isinstance(other, Sharding):
            return NotImplemented
        return (self._hash == other._hash and self.dims == other.dims
                and self.partial == other.partial)

    def __reduce__(self):  # rebuilt, so a copy in another process hashes there
        return Sharding, (self.dims, self.partial)

    @staticmethod
    def replicated(ndim: int) -> "Sharding":
        return Sharding(((),) * ndim)

    @property
    def used(self) -> set:
        return {a for d in self.dims for a in d} | set(self.partial)

    def local_shape(self, shape, mesh: ShardMesh) -> tuple:
        return tuple(d // mesh.count(ax) for d, ax in zip(shape, self.dims))

    def strategy(self, mesh: ShardMesh) -> tuple[int, ...]:
        """MindSpore's tuple-of-split-counts view."""
        return tuple(mesh.count(ax) for ax in self.dims)

    def describe(self, mesh: ShardMesh) -> str:
        s = "(" + ", ".join(str(c) for c in self.strategy(mesh)) + (
            ",)" if len(self.dims) == 1 else ")")
        if self.partial:
            s += f" partial-sum over {mesh.count(self.partial)}"
        return s

    def to_layout(self, mesh: ShardMesh):
        """The ``fs.Layout`` view of this sharding over the prime mesh axes (pending
        sums are not shown), e.g. for ``fs.visualize_sharding``."""
        from fshard.meshes.layout import Layout

        names = mesh.names
        base = Layout(mesh.sizes, names) if names else Layout((1,), ("m0",))
        entries = [tuple(names[a] for a in ax) if len(ax) > 1 else
                   (names[ax[0]] if ax else "None") for ax in self.dims]
        return base(*entries)

    def spec(self, mesh: ShardMesh) -> str:
        """Exact mesh-axis form, e.g. ``(m0, m1m2)``."""
        parts = ["".join(mesh.name(ax)) or "-" for ax in self.dims]
        s = "(" + ", ".join(parts) + ")"
        if self.partial:
            s += "+sum" + "".join(mesh.name(sorted(self.partial)))
        return s


# ---------------------------------------------------------------------------
# Factor rules
@dataclass(frozen=True)
class Candidate:
    """One way to run an equation: which mesh axes split each factor, and the pending
    sum (``carry`` axes) that operands ``carry_ops`` pass through to the outputs."""

    assign: tuple  # ((factor, axes), ...)
    carry: frozenset = frozenset()
    carry_ops: tuple = ()

    def __post_init__(self):  # hashed once (see Sharding)
        object.__setattr__(self, "_hash", hash((self.assign, self.carry, self.carry_ops)))
        object.__setattr__(self, "_axes", dict(self.assign))
        # (labels, partial) -> Sharding: a candidate is shared by the equations whose
        # specs split the same factors of the same sizes (``candidates``), and their
        # operands repeat few label tuples (planning a Llama block built 23K shardings)
        object.__setattr__(self, "_shardings", {})

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:  # (see Sharding.__eq__)
        if self is other:
            return True
        if not isinstance(other, Candidate):
            return NotImplemented
        return (self._hash == other._hash and self.assign == other.assign
                and self.carry == other.carry and self.carry_ops == other.carry_ops)

    def __reduce__(self):  # rebuilt (a str factor's hash differs between processes)
        return Candidate, (self.assign, self.carry, self.carry_ops)

    def axes(self, label) -> tuple:
        return self._axes.get(label, ())

    def sharding(self, labels, partial=frozenset()) -> Sharding:
        key = (tuple(labels), partial)
        try:
            return self._shardings[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable label
            key = None
        axes = self._axes
        sh = Sharding(tuple(axes.get(lab, ()) for lab in labels), frozenset(partial))
        if key is not None:
            self._shardings[key] = sh
        return sh


def candidates(spec: FactorSpec, mesh: ShardMesh) -> list[Candidate]:
    """Every assignment of mesh axes to splittable factors whose split counts divide
    the factor sizes. Replicated computation is the empty assignment. A factor split
    over several axes comes in every order of them (major first), mesh order first:
    a ``Layout`` view such as ``(("mp", "dp"),)`` asks for a non-row-major one, and
    without its candidate every equation would redistribute it."""
    labels = spec.splittable()
    # The candidates depend on the splittable factors' sizes and the mesh only: a
    # training step has many equations of few shapes, so each set is built once.
    try:
        key = (tuple(labels), tuple(spec.sizes[lab] for lab in labels), mesh)
        return list(_candidates(key))
    except TypeError:  # a size that does not hash
        return _enumerate_candidates(labels, spec.sizes, mesh)


@functools.lru_cache(maxsize=1 << 12)
def _candidates(key) -> tuple:
    labels, sizes, mesh = key
    return tuple(_enumerate_candidates(list(labels), dict(zip(labels, sizes)), mesh))


def _enumerate_candidates(labels: list, sizes: dict, mesh: ShardMesh) -> list[Candidate]:
    out = []
    for choice in itertools.product([None] + labels, repeat=len(mesh.sizes)):
        assign: dict = {}
        for axis, lab in enumerate(choice):
            if lab is not None:
                assign.setdefault(lab, []).append(axis)
        ok = all(dim_multiple_of(sizes[lab], mesh.count(ax)) for lab, ax in assign.items())
        if ok:
            labs = list(assign)
            for orders in itertools.product(*[itertools.permutations(assign[lab])
                                              for lab in labs]):
                out.append(Candidate(tuple(zip(labs, orders))))
    return out


def spec_key(spec: FactorSpec) -> tuple | None:
    """What the layouts, candidates and compute of a factor spec depend on, hashable
    (None if a size does not hash): the equations of a program repeat few of them, so
    planning computes each once (``SpecCache``)."""
    partial = None if spec.partial_outputs is None else tuple(sorted(
        (j, tuple(labs)) for j, labs in spec.partial_outputs.items()))
    key = (tuple(map(tuple, spec.inputs)), tuple(map(tuple, spec.outputs)),
           tuple(sorted(spec.sizes.items(), key=lambda kv: str(kv[0]))), spec.reduce,
           spec.nosplit, spec.flops_per_point, partial)
    try:
        hash(key)
    except TypeError:
        return None
    return key


class SpecCache:
    """``candidate_shardings`` and ``compute_cost`` per (spec, candidate), shared by the
    equations of one planning run whose specs are equal (``spec_key``)."""

    def __init__(self, mesh: ShardMesh, compute):
        self.mesh, self._compute = mesh, compute
        self._memo: dict = {}

    def get(self, spec: FactorSpec, key, cand: Candidate) -> tuple:
        """``(operand layouts, output layouts, compute)`` of ``spec`` run as ``cand``."""
        k = (key, cand)
        hit = self._memo.get(k) if key is not None else None
        if hit is None:
            ins, outs = candidate_shardings(spec, cand)
            hit = (ins, outs, self._compute(spec, cand, self.mesh))
            if key is not None:
                self._memo[k] = hit
        return hit


def candidate_shardings(spec: FactorSpec, cand: Candidate):
    """``(operand shardings, output shardings)`` a candidate requires and produces."""
    ins = [cand.sharding(lab, cand.carry if i in cand.carry_ops else frozenset())
           for i, lab in enumerate(spec.inputs)]
    if spec.partial_outputs is not None:
        outs = [cand.sharding(lab, frozenset(a for r in spec.partial_outputs.get(j, ())
                                             for a in cand.axes(r)) | cand.carry)
                for j, lab in enumerate(spec.outputs)]
        return ins, outs
    partial = frozenset(a for lab in spec.reduce for a in cand.axes(lab)) | cand.carry
    outs = [cand.sharding(lab, partial) for lab in spec.outputs]
    return ins, outs


def carry_variants(spec: FactorSpec, cand: Candidate, prim_name: str, operand_partials: list
                   ) -> list[Candidate]:
    """``cand`` with a pending sum passed through a linear operand group: every operand
    of the group is partial over the same axes ``P`` (``operand_partials[i]``; None for
    literals), the others are not, and the candidate splits nothing over ``P``."""
    out = []
    used = {a for _, ax in cand.assign for a in ax}
    for group in linear_groups(prim_name, spec, len(spec.inputs)):
        parts = {operand_partials[i] for i in group}
        if len(parts) != 1:
            continue
        p = parts.pop()
        if not p or p & used:
            continue
        if any(operand_partials[i] for i in range(len(spec.inputs)) if i not in group):
            continue
        out.append(Candidate(cand.assign, frozenset(p), tuple(group)))
    return out


def as_produced(versions: dict, produced: Sharding) -> Sharding:
    """The layout of an output left to propagation: as produced, except that a pending
    sum is resolved, reusing a reduced version of it that a consumer already made."""
    if not produced.partial:
        return produced
    for sh in versions:
        if not sh.partial:
            return sh
    return Sharding(produced.dims)


# ---------------------------------------------------------------------------
# Redistribution: the collectives that move a value between shardings
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    kind: str          # 'all_gather' | 'psum' | 'psum_scatter' | 'slice'
    axes: tuple        # mesh axes, major first
    dim: int = -1      # tensor dim (not for psum)


@functools.lru_cache(maxsize=1 << 16)  # (propagation asks for the same moves over and over)
def plan(src: Sharding, dst: Sharding, reduce_scatter: bool = True) -> tuple[Step, ...]:
    """The steps from ``src`` to ``dst`` (``dst`` must not add pending sums). Without
    ``reduce_scatter`` (a backend that would emulate it by an AllReduce and a slice) a
    pending sum is reduced whole and then sliced, so the whole value is held too."""
    assert dst.partial <= src.partial, "a redistribution cannot create a pending sum"
    steps: list[Step] = []
    new_axes: dict[int, tuple] = {}
    for d, (s, t) in enumerate(zip(src.dims, dst.dims, strict=True)):
        k = 0
        while k < min(len(s), len(t)) and s[k] == t[k]:
            k += 1
        if s[k:]:
            steps.append(Step("all_gather", tuple(s[k:]), d))
        if t[k:]:
            new_axes[d] = tuple(t[k:])
    to_reduce = set(src.partial - dst.partial)
    for d, ax in new_axes.items():
        if reduce_scatter and to_reduce and set(ax) <= to_reduce:
            steps.append(Step("psum_scatter", ax, d))
            to_reduce -= set(ax)
            new_axes[d] = ()
    if to_reduce:
        # Reduced before anything is gathered: the AllReduce then runs on the block,
        # not on the gathered value (a pending sum over axes disjoint from the split).
        steps.insert(0, Step("psum", tuple(sorted(to_reduce))))
    for d, ax in new_axes.items():
        if ax:
            steps.append(Step("slice", ax, d))
    return tuple(steps)


def after(sh: Sharding, st: Step) -> Sharding:
    """The layout a value has after step ``st``."""
    dims = list(sh.dims)
    if st.kind == "all_gather":
        dims[st.dim] = dims[st.dim][:len(dims[st.dim]) - len(st.axes)]
    elif st.kind in ("psum_scatter", "slice"):
        dims[st.dim] = dims[st.dim] + tuple(st.axes)
    partial = sh.partial - set(st.axes) if st.kind in ("psum", "psum_scatter") else sh.partial
    return Sharding(tuple(dims), frozenset(partial))
