"""The one cost model: what a computation and a move between layouts cost, as the
backend in use runs them (its collectives, emulations included). Propagation,
partitioning and search all price with these functions.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field

from fshard.core import dtypes
from fshard.backend.mindspore import comm_initialized, device_target, native_collectives
from fshard.core.tracing import ArrayType
from fshard.core.dims import planning_prod, planning_size
from fshard.core.factors import FactorSpec
from fshard.sharding.layouts import Candidate, ShardMesh, Sharding, plan
from fshard.sharding.rates import calibrated

def compute_cost(spec: FactorSpec, cand: Candidate, mesh: ShardMesh) -> float:
    """Iteration points per device (times flops per point)."""
    points = math.prod(planning_size(s) for s in spec.sizes.values()) or 1
    par = math.prod(mesh.count(ax) for _, ax in cand.assign) or 1
    return spec.flops_per_point * points / par


def native_reduce_scatter(native: dict) -> bool:
    """Whether the backend (its row of ``NATIVE_COLLECTIVES``) has a ReduceScatter for
    any group; else ``plan`` reduces whole and slices, as the emulation would."""
    return native.get("reduce_scatter") == "any"


def step_bytes(kind: str, local: float, n: int, world: bool, native: dict) -> float:
    """Bytes each device sends for one step on ``local`` bytes over ``n`` devices, as
    the backend runs it (ring algorithms). ``native`` is the backend's row of
    ``NATIVE_COLLECTIVES``; what is not native runs as its emulation (see
    ``Comm`` in fshard/backend/collectives.py): a reduce-scatter as an AllReduce
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
                   native: dict) -> tuple[float, tuple, tuple]:
    """``(bytes each device sends, steps, local bytes after each step)`` of moving a
    value of global ``shape`` from ``src`` to ``dst``: the one cost of a move, used by
    propagation, partitioning and search."""
    return _redistribution(src, dst, tuple(shape), itemsize, mesh,
                           frozenset(native.items()))


@functools.lru_cache(maxsize=1 << 16)  # a pure function that planning calls very often
def _redistribution(src: Sharding, dst: Sharding, shape: tuple, itemsize: int,
                    mesh: ShardMesh, native_items: frozenset) -> tuple[float, tuple, tuple]:
    native = dict(native_items)
    steps = plan(src, dst, native_reduce_scatter(native)) if src != dst else ()
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
    return sent, steps, tuple(sizes)


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


#: What one device of each backend does per second, measured once by
#: ``benchmarks/cost_rates.py`` (docs/auto_parallel.md, "How the search prices a plan"):
#: ``flops_per_s``, the cost model's flops (``FactorSpec.flops_per_point`` times the
#: iteration points) per second over a whole training step as the backend compiles and
#: runs it; and per native collective ``(latency_s, bytes_per_s)``, the fixed cost of one
#: call inside a compiled step and the rate of the bytes each device sends
#: (``step_bytes``). CPU: MindSpore 2.10's CPU kernels and its collectives over loopback
#: between 2 processes on a 2-core machine. GPU and Ascend rows are not measured: they are
#: nominal (a fast device, a fast link) so that the search still weighs compute against
#: communication there.
BACKEND_RATES: dict = {
    "CPU": {"flops_per_s": 4.6e9,
            "all_reduce": (6.1e-4, 2.6e8), "all_gather": (6.1e-4, 1.3e8),
            "reduce_scatter": (6.1e-4, 2.6e8), "broadcast": (6.1e-4, 1.3e8)},
    "GPU": {"flops_per_s": 1.0e13,
            "all_reduce": (2.0e-5, 5.0e10), "all_gather": (2.0e-5, 5.0e10),
            "reduce_scatter": (2.0e-5, 5.0e10), "broadcast": (2.0e-5, 5.0e10)},
    "Ascend": {"flops_per_s": 1.0e14,
               "all_reduce": (2.0e-5, 5.0e10), "all_gather": (2.0e-5, 5.0e10),
               "reduce_scatter": (2.0e-5, 5.0e10), "broadcast": (2.0e-5, 5.0e10)},
}


def backend_rates(devices: int | None = None) -> dict:
    """The rates the planner prices with: the table ``fs.sharding.calibrate()`` measured
    on this machine for a virtual mesh of ``devices`` when there is one, or in a rank of
    a multi-process job the table it measured in a job of ``devices`` processes; else the
    row of ``BACKEND_RATES`` for the device target (CPU's for another)."""
    if devices is not None:
        table = calibrated(devices, job=comm_initialized())
        if table is not None:
            return rates_from_table(table)
    return BACKEND_RATES.get(device_target(), BACKEND_RATES["CPU"])


def rates_from_table(table: dict) -> dict:
    """The rates of a calibration table (fshard/sharding/calibration.py): a row like
    ``BACKEND_RATES``' plus ``op_s`` (one kernel's fixed cost), ``matmul_points``
    (a matmul kernel's seconds at the sizes measured), ``matmul_c`` and ``matmul_p``
    (its power law ``c·flops**p``, for other sizes; see ``matmul_seconds``; absent
    from tables of earlier versions, which price flops at ``flops_per_s``),
    ``point_s`` (an elementwise op's seconds per element), ``matmul_elem_s`` (a matmul
    kernel's seconds per element it reads and writes, its floor), ``adam_points``
    (Adam's fused update, seconds per element at the sizes measured),
    ``call_s`` (calling the compiled program), ``arg_s`` (each value passed in or out),
    ``lanes`` (the virtual devices one process computes for) and ``groups`` (per
    collective, per group size, ``(fixed s, s per byte of a device's block)`` as the
    virtual mesh runs it)."""
    groups = {op: {int(n): tuple(v) for n, v in table[op].items()}
              for op in ("all_reduce", "all_gather", "slice") if op in table}
    row = {"flops_per_s": table["flops_per_s"], "point_s": table["point_s"],
           "op_s": table["op_s"], "call_s": table["call_s"],
           "arg_s": table.get("arg_s", 0.0), "matmul_c": table.get("matmul_c"),
           "matmul_p": table.get("matmul_p", 1.0),
           # (tables of earlier versions: the elementwise rate)
           "matmul_elem_s": table.get("matmul_elem_s", table["point_s"]),
           "matmul_points": tuple(map(tuple, table.get("matmul_points", ()))),
           "adam_points": tuple(map(tuple, table.get("adam_points", ()))),
           "lanes": table["devices"] if table.get("lanes", True) else 1, "groups": groups}
    # The byte-rate view of the largest group, for what prices bytes alone (propagation).
    for op in ("all_reduce", "all_gather"):
        per_n = groups[op]
        a, b = per_n[max(per_n)] if per_n else (0.0, 1e-12)
        row[op] = (a, 1.0 / max(b, 1e-15))
    row["reduce_scatter"], row["broadcast"] = row["all_reduce"], row["all_gather"]
    return row


def _group_rate(per_n: dict, n: int) -> tuple:
    """The measured ``(fixed s, s per byte)`` of a group of ``n`` (the nearest size
    measured when ``n`` was not)."""
    if n in per_n:
        return per_n[n]
    return per_n[min(per_n, key=lambda m: (abs(m - n), m))]


def contracts(spec: FactorSpec) -> bool:
    """Whether ``spec`` is a contraction (a matmul, a convolution: a summed factor that
    two operands share), priced per flop; the others are priced per element."""
    return any(sum(lab in ins for ins in spec.inputs) >= 2 for lab in spec.reduce)


def compute_seconds(spec: FactorSpec, cand: Candidate, mesh: ShardMesh, rates: dict
                    ) -> float:
    """Seconds equation ``spec`` takes run as ``cand`` with a calibration table's rates
    (``rates_from_table``): each kernel's fixed cost (``spec.kernels`` of them), plus its
    work (a contraction's flops at the matmul rate, else its elements at the elementwise
    rate) times the devices the process computes it for. A virtual mesh batches an
    equation over the mesh axes its values differ along (the axes that split a factor or
    carry a pending sum) and runs it once for the rest (``run_batched``: a replicated
    value is not batched), so a replicated equation costs its work once, not once per
    device."""
    flops = compute_cost(spec, cand, mesh)
    fixed = rates["op_s"] * spec.kernels
    if not flops:
        return fixed
    varying = {a for _, axes in cand.assign for a in axes} | set(cand.carry)
    # (a job's table: each process computes its own block alone)
    lanes = mesh.count(tuple(sorted(varying))) if rates.get("lanes", 1) > 1 else 1
    if contracts(spec) and rates.get("matmul_c") is not None:
        # One batched kernel over the lanes: its rate depends on its whole size, and it
        # takes at least the time of the elements it reads and writes (a weight gradient
        # of a few rows per device writes a whole block per device for few flops).
        kernel = max(matmul_seconds(lanes * flops, rates),
                     _elements(spec, cand, mesh, varying if lanes > 1 else set())
                     * rates["matmul_elem_s"])
        return fixed + kernel + _broadcast_seconds(spec, cand, mesh, rates, lanes)
    if contracts(spec):
        work = flops / rates["flops_per_s"]
    elif rates.get(f"{spec.priced_as}_points"):
        # its own measured price per element, at the size one kernel runs on
        elements = lanes * flops / (spec.flops_per_point or 1.0)
        return fixed + elements * _per_element(elements, rates[f"{spec.priced_as}_points"])
    else:
        work = flops / (spec.flops_per_point or 1.0) * rates["point_s"] * spec.passes
    return fixed + lanes * work


def _per_element(elements: float, points) -> float:
    """Seconds per element at ``elements``, on the line in logarithms of sizes between
    the two nearest ``(elements, seconds per element)`` points, the nearest outside them.

    >>> round(_per_element(2 ** 20, ((2 ** 18, 2e-9), (2 ** 22, 4e-9))) * 1e9, 6)
    3.0
    """
    if elements <= points[0][0] or len(points) == 1:
        return points[0][1]
    if elements >= points[-1][0]:
        return points[-1][1]
    i = max(bisect.bisect_left(points, (elements,)), 1)
    (n0, s0), (n1, s1) = points[i - 1], points[i]
    return s0 + (s1 - s0) * math.log(elements / n0) / math.log(n1 / n0)


def matmul_seconds(flops: float, rates: dict) -> float:
    """A matmul kernel's seconds at ``flops`` (batched over the lanes): between two sizes
    the table measured, on the line between them in logarithms; outside them, the power
    law ``matmul_c·flops**matmul_p`` fitted through them all.

    >>> rates = {"matmul_c": 1e-9, "matmul_p": 1.0, "matmul_points": ((1e6, 1e-3),
    ...                                                               (1e8, 1e-2))}
    >>> round(matmul_seconds(1e7, rates), 6), round(matmul_seconds(1e9, rates), 6)
    (0.003162, 1.0)
    """
    points = rates.get("matmul_points") or ()
    if len(points) >= 2 and points[0][0] <= flops <= points[-1][0]:
        i = max(bisect.bisect_left(points, (flops,)), 1)
        (f0, t0), (f1, t1) = points[i - 1], points[i]
        return t0 * (t1 / t0) ** (math.log(flops / f0) / math.log(f1 / f0))
    return rates["matmul_c"] * flops ** rates["matmul_p"]


def _elements(spec: FactorSpec, cand: Candidate, mesh: ShardMesh, varying: set) -> int:
    """The elements a batched contraction reads and writes: each operand's and output's
    block, once per lane it differs on (an operand the same on every lane, such as a
    replicated weight under split rows, is read once; an output differs on every lane,
    a pending sum's included)."""
    def block(dims):
        return math.prod(planning_size(spec.sizes[lab]) // mesh.count(cand.axes(lab))
                         for lab in dims if lab is not None)

    total = sum(block(dims) for dims in spec.outputs) * mesh.count(tuple(sorted(varying)))
    for i, dims in enumerate(spec.inputs):
        own = {a for lab in dims if lab is not None for a in cand.axes(lab)}
        if i in cand.carry_ops:
            own |= set(cand.carry)
        total += block(dims) * mesh.count(tuple(sorted(own & varying)))
    return total


def _broadcast_seconds(spec: FactorSpec, cand: Candidate, mesh: ShardMesh, rates: dict,
                       lanes: int) -> float:
    """A virtual mesh's batched contraction whose left operand is the same on devices
    the equation differs over (a replicated activation times a weight's column blocks)
    runs on that operand copied out to every device (``batch_to_front``'s broadcast: a
    BatchMatMul takes both operands batched); an unbatched right operand folds into
    the rows instead, and so do a transposed right operand's blocks under an unbatched
    rank-2 left one (``g @ W^T``: nothing copied). That copy, at the elementwise rate."""
    if lanes == 1:
        return 0.0
    left = spec.inputs[0]
    if len(left) == 2 and spec.inputs[1][-1] in spec.reduce:  # transpose_b, rank 2
        return 0.0
    own = {a for lab in left if lab is not None for a in cand.axes(lab)}
    if 0 in cand.carry_ops:
        own |= set(cand.carry)
    if mesh.count(tuple(sorted(own))) == lanes:
        return 0.0
    sizes = [planning_size(spec.sizes[lab]) // mesh.count(cand.axes(lab))
             for lab in left if lab is not None]
    return lanes * math.prod(sizes) * rates["point_s"]


def step_op(kind: str, n: int, world: bool, native: dict) -> str | None:
    """The native collective a step of ``plan`` runs as on the backend (``native``: its
    row of ``NATIVE_COLLECTIVES``): None for a local slice; an emulated reduce-scatter
    or sub-group gather runs as an AllReduce.

    >>> step_op("psum_scatter", 2, True, {"all_reduce_sum": "any"})
    'all_reduce'
    >>> step_op("all_gather", 4, True, {"all_gather": "world"})
    'all_gather'
    """
    if kind == "slice" or n == 1:
        return None
    where = {"psum_scatter": native.get("reduce_scatter"),
             "all_gather": native.get("all_gather")}.get(kind)
    if kind == "psum" or where is None or (where == "world" and not world):
        return "all_reduce"
    return "reduce_scatter" if kind == "psum_scatter" else "all_gather"


def step_seconds(kind: str, local: float, n: int, world: bool, native: dict,
                 rates: dict, share: float = 1.0) -> float:
    """Seconds one step takes on ``local`` bytes over ``n`` devices: the fixed cost of the
    collective the backend runs plus the bytes each device sends at its rate.
    ``share``: the part of the mesh's devices whose blocks differ (a virtual mesh runs
    the collective batched over those devices only; its rates were measured with a
    block on every device).

    >>> rates = {"all_reduce": (1e-3, 1e8)}
    >>> round(step_seconds("psum", 1e6, 2, True, {"all_reduce_sum": "any"}, rates), 6)
    0.011
    """
    groups = rates.get("groups")
    if groups is not None:  # measured on a virtual mesh, as its batched run does it
        if n == 1:
            return 0.0
        if kind == "slice":
            # A transpose of the value the process holds: one block for each device it
            # differs on (tables from before it was measured price it at nothing).
            if not groups.get("slice"):
                return 0.0
            latency, per_byte = _group_rate(groups["slice"], n)
            return latency + per_byte * local * share * rates.get("lanes", 1)
        latency, per_byte = _group_rate(groups["all_gather" if kind == "all_gather"
                                                else "all_reduce"], n)
        return latency + per_byte * local * share
    op = step_op(kind, n, world, native)
    if op is None:
        return 0.0
    latency, bandwidth = rates[op]
    return latency + step_bytes(kind, local, n, world, native) / bandwidth


def redistribution_seconds(src: Sharding, dst: Sharding, shape, itemsize: int,
                           mesh: ShardMesh, native: dict, rates: dict) -> float:
    """Seconds the move of ``redistribution`` takes, step by step."""
    steps = plan(src, dst, native_reduce_scatter(native)) if src != dst else []
    local_shape = list(src.local_shape(shape, mesh))
    # The mesh axes the value's blocks differ along, step by step.
    varying = set(src.used)
    total = 0.0
    for st in steps:
        n = mesh.count(st.axes)
        local = planning_prod(local_shape) * itemsize
        share = mesh.count(tuple(sorted(varying))) / mesh.size
        total += step_seconds(st.kind, local, n, n == mesh.size, native, rates, share)
        if st.kind == "all_gather":
            local_shape[st.dim] *= n
        elif st.kind in ("psum_scatter", "slice"):
            local_shape[st.dim] //= n
        # (a reduce-scatter's blocks differ along its axes before and after)
        if st.kind in ("all_gather", "psum"):
            varying -= set(st.axes)
        elif st.kind == "slice":
            varying |= set(st.axes)
    return total


def _copy_byte_s(rates: dict) -> float:
    """Seconds to copy one byte of float32 (an elementwise op's rate per element; one
    flop per element where nothing was measured)."""
    return rates.get("point_s", 1.0 / rates["flops_per_s"]) / 4.0


def bucket_bytes(n: int, rates: dict, native: dict, kind: str = "psum") -> float:
    """The largest bucket of AllReduces (``kind="all_gather"``: of AllGathers) worth
    fusing in a job of ``n`` processes: one collective's fixed cost over the seconds a
    byte takes to be copied into the bucket and out of it (the concatenation and the
    split of ``passes.fuse_allreduces``). A bucket of ``k`` collectives of at most that
    many bytes saves ``k - 1`` fixed costs and copies for at most one's worth, so under
    the measured rates fusing never loses."""
    return step_seconds(kind, 0.0, n, True, native, rates) / (2.0 * _copy_byte_s(rates))


def fusion_seconds(buckets, n: int, rates: dict, native: dict, kind: str = "psum") -> float:
    """The seconds fusing saves (negative) on ``n`` processes: per bucket of ``k``
    AllReduces (``kind="all_gather"``: AllGathers) of ``nbytes`` in all
    (``fuse_allreduces``' report), ``k - 1`` fixed costs less the copies in and out."""
    latency = step_seconds(kind, 0.0, n, True, native, rates)
    return sum(2.0 * _copy_byte_s(rates) * nbytes - (k - 1) * latency
               for k, nbytes in buckets)


def local_bytes(sh: Sharding, aval: ArrayType, mesh: ShardMesh) -> float:
    itemsize = dtypes.to_numpy(aval.dtype).itemsize
    return planning_prod(sh.local_shape(aval.shape, mesh)) * itemsize


@dataclass
class CostModel:
    """Objective per ``level`` (0: compute/communication balance as MindSpore's
    alpha*compute + beta*comm; 1: least memory per device; 2: time, the seconds a
    device computes at the backend's flops rate plus the seconds each collective takes
    as the backend runs it: ``rates``, its row of ``BACKEND_RATES``)."""

    level: int = 0
    alpha: float = 1.0
    beta: float = 50.0          # MindSpore's GPU default weight of communication
    rates: dict = field(default_factory=backend_rates)
    # Weight of communication that resolves a pending sum at a program output (e.g.
    # a gradient's AllReduce, which overlaps the rest of the step): MindSpore's
    # costmodel_gamma in comm_with_partial_para.
    gamma: float = 0.001
    extra: dict = field(default_factory=dict)
    # Which collectives the backend in use runs natively (the others are priced as
    # their emulations): its row of NATIVE_COLLECTIVES.
    native: dict = field(default_factory=native_collectives)
    # The devices are a job's processes, each computing its own blocks at the same time
    # (not a virtual mesh's lanes, run one after another by one process).
    job: bool = field(default_factory=lambda: comm_initialized())

    def score(self, compute: float, comm_bytes: float, n_collectives: int, memory: float,
              edge_bytes: float | None = None):
        """A candidate's score in propagation; ``edge_bytes``: the part of
        ``comm_bytes`` that redistributes between operators (level 0 prefers none)."""
        if self.level == 0:
            edge = comm_bytes if edge_bytes is None else edge_bytes
            return (edge > 0, self.alpha * compute + self.beta * comm_bytes, memory)
        if self.level == 1:
            return (memory, comm_bytes, compute)
        # Propagation sees bytes only: priced at the AllReduce's rates.
        latency, bandwidth = self.rates["all_reduce"]
        t = compute / self.flops_per_s + comm_bytes / bandwidth + n_collectives * latency
        return (t, memory)

    @property
    def flops_per_s(self) -> float:
        return self.rates["flops_per_s"]

    @property
    def call_s(self) -> float:
        """The fixed cost of calling the compiled program (measured tables only)."""
        return self.rates.get("call_s", 0.0)

    def call_seconds(self, values: int) -> float:
        """Calling the compiled program with ``values`` inputs and outputs in all
        (measured tables only; the fixed cost was measured with one of each)."""
        return self.call_s + self.rates.get("arg_s", 0.0) * max(values - 2, 0)

    def compute(self, spec: FactorSpec, cand: Candidate, mesh: ShardMesh) -> float:
        """The compute of ``spec`` as ``cand``, in flops: ``compute_cost``, or at level 2
        with a measured table, its seconds (``compute_seconds``) as flops at the matmul
        rate, so ``compute / flops_per_s`` is the time either way."""
        if self.level != 2 or "point_s" not in self.rates:
            return compute_cost(spec, cand, mesh)
        return compute_seconds(spec, cand, mesh, self.rates) * self.flops_per_s
