"""The one cost model: what a computation and a move between layouts cost, as the
backend in use runs them (its collectives, emulations included). Propagation,
partitioning and search all price with these functions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from fshard.core import dtypes
from fshard.backend.mindspore import device_target, native_collectives
from fshard.core.tracing import ArrayType
from fshard.core.dims import planning_prod, planning_size
from fshard.core.factors import FactorSpec
from fshard.sharding.layouts import Candidate, ShardMesh, Sharding, plan

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


def backend_rates() -> dict:
    """The row of ``BACKEND_RATES`` for the device target in use (CPU's for another)."""
    return BACKEND_RATES.get(device_target(), BACKEND_RATES["CPU"])


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
                 rates: dict) -> float:
    """Seconds one step takes on ``local`` bytes over ``n`` devices: the fixed cost of the
    collective the backend runs plus the bytes each device sends at its rate.

    >>> rates = {"all_reduce": (1e-3, 1e8)}
    >>> round(step_seconds("psum", 1e6, 2, True, {"all_reduce_sum": "any"}, rates), 6)
    0.011
    """
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
    total = 0.0
    for st in steps:
        n = mesh.count(st.axes)
        local = planning_prod(local_shape) * itemsize
        total += step_seconds(st.kind, local, n, n == mesh.size, native, rates)
        if st.kind == "all_gather":
            local_shape[st.dim] *= n
        elif st.kind in ("psum_scatter", "slice"):
            local_shape[st.dim] //= n
    return total


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

    def score(self, compute: float, comm_bytes: float, n_collectives: int, memory: float):
        if self.level == 0:
            return (comm_bytes > 0, self.alpha * compute + self.beta * comm_bytes, memory)
        if self.level == 1:
            return (memory, comm_bytes, compute)
        # Propagation sees bytes only: priced at the AllReduce's rates.
        latency, bandwidth = self.rates["all_reduce"]
        t = compute / self.flops_per_s + comm_bytes / bandwidth + n_collectives * latency
        return (t, memory)

    @property
    def flops_per_s(self) -> float:
        return self.rates["flops_per_s"]
