"""Sharding: layouts of values over a mesh, per-primitive factor rules, and the
plans that move a value from one layout to another.

Vocabulary (NB: Shardy's factor-based sharding rules, GSPMD's partial state):

- A *mesh* for partitioning (``ShardMesh``) has axes of prime size (8 devices ->
  (2, 2, 2)), so every MindSpore split count that divides the device count is a
  group of consecutive axes, and MindSpore's row-major rank order is preserved.
- A ``Sharding`` says, for every dimension of a value, which mesh axes split it
  (major first), and over which axes the value is a *pending sum* (``partial``).
  A value is replicated over every axis it does not mention.
- A primitive's sharding rule returns a ``FactorSpec``: each operand and output
  dimension is labelled with an iteration *factor* (like an einsum). Splitting a
  factor over mesh axes splits every dimension that carries it; a split
  contracted factor (``reduce``) leaves the output partial; ``nosplit`` factors
  are never split. One generic engine enumerates the candidate assignments of mesh
  axes to factors, so each primitive's rule is a few lines.
- A primitive that is linear in some operands lets a pending sum *pass through*
  (``FactorSpec.linear``, default from ``LINEAR_GROUPS``): ``add`` of two partial
  values is partial, ``reduce_sum`` of a partial value is partial, so the AllReduce
  is paid once, late, on the smallest value (GSPMD's partial propagation).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

from fshard import dtypes
from fshard.backend.mindspore import native_collectives
from fshard.core import ArrayType
from fshard.dims import dim_multiple_of, planning_prod, planning_size

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
        from fshard.layout import Layout

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
# ---------------------------------------------------------------------------


@dataclass
class FactorSpec:
    """An einsum-like description of how a primitive's iterations map to its arrays.

    ``inputs[i][d]`` / ``outputs[j][d]`` is the factor label of that dimension (None:
    the dimension is never split, e.g. a broadcast size-1 dim). ``sizes`` gives each
    factor's extent. Factors split over mesh axes split every dim carrying them;
    split ``reduce`` factors leave the outputs partial (pending sum).
    """

    inputs: list
    outputs: list
    sizes: dict
    reduce: frozenset = frozenset()
    nosplit: frozenset = frozenset()
    flops_per_point: float = 1.0
    # (params, local_in_avals, local_out_avals) -> params for the per-device equation
    local_params: Callable | None = None
    # Groups of operand indices in which the primitive is linear: when every operand
    # of a group is a pending sum over the same axes (and the others are not), the
    # output is a pending sum over them too. None: ``LINEAR_GROUPS`` by name.
    linear: tuple | None = None

    def splittable(self) -> list[str]:
        labels = []
        for lab in itertools.chain(*self.inputs, *self.outputs):
            if lab is not None and lab not in labels and lab not in self.nosplit:
                labels.append(lab)
        # A factor consumed without appearing in any output must be a sum to split.
        outs = {lab for o in self.outputs for lab in o}
        return [lab for lab in labels if lab in outs or lab in self.reduce]


def elementwise_spec(*avals: ArrayType, n_out: int = 1) -> FactorSpec:
    """All operands and outputs share one factor per dimension."""
    nd = avals[0].ndim
    labels = tuple(f"d{i}" for i in range(nd))
    return FactorSpec([labels] * len(avals), [labels] * n_out,
                      {f"d{i}": avals[0].shape[i] for i in range(nd)})


# Pending sums pass through these primitives (operand groups in which each is linear).
# ``cast`` only when it widens a float (its sharding rule says so): the sum of the
# exactly cast terms is then the sum computed in the wider type, while a narrowing or
# integer cast of each term is not the cast of their sum. (See ``FactorSpec.linear``.)
LINEAR_GROUPS: dict[str, tuple] = {
    "neg": ((0,),), "add": ((0, 1),), "sub": ((0, 1),), "mul": ((0,), (1,)),
    "div": ((0,),), "select": ((1, 2),), "cast": ((0,),), "matmul": ((0,), (1,)),
    "bias_add": ((0, 1),), "broadcast_to": ((0,),), "reshape": ((0,),),
    "transpose": ((0,),), "reduce_sum": ((0,),), "slice": ((0,),), "pad": ((0,),),
    "concat": ("all",), "stop_gradient": ((0,),),
}


def linear_groups(prim_name: str, spec: FactorSpec, n_operands: int) -> tuple:
    """The operand groups a pending sum may pass through (see ``LINEAR_GROUPS``)."""
    groups = spec.linear if spec.linear is not None else LINEAR_GROUPS.get(prim_name, ())
    return tuple(tuple(range(n_operands)) if g == "all" else tuple(g) for g in groups)


@dataclass(frozen=True)
class Candidate:
    """One way to run an equation: which mesh axes split each factor, and the pending
    sum (``carry`` axes) that operands ``carry_ops`` pass through to the outputs."""

    assign: tuple  # ((factor, axes), ...)
    carry: frozenset = frozenset()
    carry_ops: tuple = ()

    def axes(self, label) -> tuple:
        for lab, ax in self.assign:
            if lab == label:
                return ax
        return ()

    def sharding(self, labels, partial=frozenset()) -> Sharding:
        return Sharding(tuple(self.axes(lab) if lab is not None else () for lab in labels),
                        frozenset(partial))


def candidates(spec: FactorSpec, mesh: ShardMesh) -> list[Candidate]:
    """Every assignment of mesh axes to splittable factors whose split counts divide
    the factor sizes. Replicated computation is the empty assignment. A factor split
    over several axes comes in every order of them (major first), mesh order first:
    a ``Layout`` view such as ``(("mp", "dp"),)`` asks for a non-row-major one, and
    without its candidate every equation would redistribute it."""
    labels = spec.splittable()
    out = []
    for choice in itertools.product([None] + labels, repeat=len(mesh.sizes)):
        assign: dict = {}
        for axis, lab in enumerate(choice):
            if lab is not None:
                assign.setdefault(lab, []).append(axis)
        ok = all(dim_multiple_of(spec.sizes[lab], mesh.count(ax)) for lab, ax in assign.items())
        if ok:
            labs = list(assign)
            for orders in itertools.product(*[itertools.permutations(assign[lab])
                                              for lab in labs]):
                out.append(Candidate(tuple(zip(labs, orders))))
    return out


def candidate_shardings(spec: FactorSpec, cand: Candidate):
    """``(operand shardings, output shardings)`` a candidate requires and produces."""
    ins = [cand.sharding(lab, cand.carry if i in cand.carry_ops else frozenset())
           for i, lab in enumerate(spec.inputs)]
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


def compute_cost(spec: FactorSpec, cand: Candidate, mesh: ShardMesh) -> float:
    """Iteration points per device (times flops per point)."""
    points = math.prod(planning_size(s) for s in spec.sizes.values()) or 1
    par = math.prod(mesh.count(ax) for _, ax in cand.assign) or 1
    return spec.flops_per_point * points / par


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


def plan(src: Sharding, dst: Sharding, reduce_scatter: bool = True) -> list[Step]:
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
        steps.append(Step("psum", tuple(sorted(to_reduce))))
    for d, ax in new_axes.items():
        if ax:
            steps.append(Step("slice", ax, d))
    return steps


def after(sh: Sharding, st: Step) -> Sharding:
    """The layout a value has after step ``st``."""
    dims = list(sh.dims)
    if st.kind == "all_gather":
        dims[st.dim] = dims[st.dim][:len(dims[st.dim]) - len(st.axes)]
    elif st.kind in ("psum_scatter", "slice"):
        dims[st.dim] = dims[st.dim] + tuple(st.axes)
    partial = sh.partial - set(st.axes) if st.kind in ("psum", "psum_scatter") else sh.partial
    return Sharding(tuple(dims), frozenset(partial))


def native_reduce_scatter(native: dict) -> bool:
    """Whether the backend (its row of ``NATIVE_COLLECTIVES``) has a ReduceScatter for
    any group; else ``plan`` reduces whole and slices, as the emulation would."""
    return native.get("reduce_scatter") == "any"


def step_bytes(kind: str, local: float, n: int, world: bool, native: dict) -> float:
    """Bytes each device sends for one step on ``local`` bytes over ``n`` devices, as
    the backend runs it (ring algorithms). ``native`` is the backend's row of
    ``NATIVE_COLLECTIVES``; what is not native runs as its emulation (see
    ``_Comm`` in fshard/primitives/collectives.py): a reduce-scatter as an AllReduce
    and a slice, a gather over a sub-group as an AllReduce of a buffer n times larger.

    >>> step_bytes("psum_scatter", 800.0, 2, True, {"reduce_scatter": "any"})
    400.0
    >>> step_bytes("psum_scatter", 800.0, 2, True, {"all_reduce_sum": "any"})  # emulated
    800.0
    """
    def has(kind):
        where = native.get(kind)
        return where == "any" or (where == "world" and world)

    if kind == "slice" or n == 1:
        return 0.0
    all_reduce = 2 * local * (n - 1) / n
    if kind == "psum":
        return all_reduce
    if kind == "psum_scatter":
        return local * (n - 1) / n if has("reduce_scatter") else all_reduce
    assert kind == "all_gather", kind
    return local * (n - 1) if has("all_gather") else 2 * local * (n - 1)


def redistribution(src: Sharding, dst: Sharding, shape, itemsize: int, mesh: ShardMesh,
                   native: dict) -> tuple[float, list, list]:
    """``(bytes each device sends, steps, local bytes after each step)`` of moving a
    value of global ``shape`` from ``src`` to ``dst``: the one cost of a move, used by
    propagation, partitioning and search."""
    steps = plan(src, dst, native_reduce_scatter(native)) if src != dst else []
    local_shape = list(src.local_shape(shape, mesh))
    sent, sizes = 0.0, []
    for st in steps:
        n = mesh.count(st.axes)
        local = planning_prod(local_shape) * itemsize
        sent += step_bytes(st.kind, local, n, n == mesh.size, native)
        if st.kind == "all_gather":
            local_shape[st.dim] *= n
        elif st.kind in ("psum_scatter", "slice"):
            local_shape[st.dim] //= n
        sizes.append(float(planning_prod(local_shape) * itemsize))
    return sent, steps, sizes


def plan_bytes(src: Sharding, dst: Sharding, aval: ArrayType, mesh: ShardMesh,
               native: dict | None = None) -> float:
    """Bytes each device sends for the redistribution, as the backend runs it
    (``native``: its row of ``NATIVE_COLLECTIVES``; default the device target's)."""
    if src == dst:
        return 0.0
    if native is None:
        native = native_collectives()
    return redistribution(src, dst, aval.shape, dtypes.to_numpy(aval.dtype).itemsize, mesh,
                          native)[0]


def local_bytes(sh: Sharding, aval: ArrayType, mesh: ShardMesh) -> float:
    itemsize = dtypes.to_numpy(aval.dtype).itemsize
    return planning_prod(sh.local_shape(aval.shape, mesh)) * itemsize


@dataclass
class CostModel:
    """Objective per ``level`` (0: compute/communication balance as MindSpore's
    alpha*compute + beta*comm; 1: least memory per device; 2: fastest, with
    bandwidth and flop rates of this kind of machine)."""

    level: int = 0
    alpha: float = 1.0
    beta: float = 50.0          # MindSpore's GPU default weight of communication
    flops_per_s: float = 5e9     # per device
    bytes_per_s: float = 2e8     # per device over MCCL on loopback (measured ~0.16 GiB/s)
    latency_s: float = 1e-3      # per collective
    # Weight of communication that resolves a pending sum at a program output (e.g.
    # a gradient's AllReduce, which overlaps the rest of the step): MindSpore's
    # costmodel_gamma in comm_with_partial_para.
    gamma: float = 0.001
    extra: dict = field(default_factory=dict)
    # Which collectives the backend in use runs natively (the others are priced as
    # their emulations): its row of NATIVE_COLLECTIVES.
    native: dict = field(default_factory=native_collectives)

    def score(self, compute: float, comm_bytes: float, n_collectives: int, memory: float):
        if self.level == 0:
            return (comm_bytes > 0, self.alpha * compute + self.beta * comm_bytes, memory)
        if self.level == 1:
            return (memory, comm_bytes, compute)
        t = compute / self.flops_per_s + comm_bytes / self.bytes_per_s \
            + n_collectives * self.latency_s
        return (t, memory)
