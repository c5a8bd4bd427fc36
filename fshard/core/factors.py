"""The vocabulary of primitives' sharding rules: a ``FactorSpec`` labels each operand
and output dimension with an iteration *factor* (like an einsum), so one generic engine
(fshard/sharding/) can shard every primitive from a few lines of rule.

It sits below the primitives, which declare their rules with it; it knows nothing of
meshes, layouts or costs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from fshard.core.tracing import ArrayType


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
    # A primitive carrying sub-programs (a loop body, the branches of a cond) runs them
    # partitioned as per-device programs of their own:
    # ``(operands, params, in_shardings, out_shardings, partition) -> (operands, params)``
    # of the per-device equation, where ``partition(program, in_shardings,
    # out_shardings) -> (per-device program, its constants)``. It may only reorder the
    # given operands (opaque objects to it) and insert those constants.
    partition_call: Callable | None = None
    # Which split ``reduce`` factors leave which outputs partial: output index ->
    # labels (a loop whose accumulator carries alone hold a pending sum). None: every
    # reduce factor leaves every output partial.
    partial_outputs: dict | None = None
    # Kernels the lowering runs for the equation (the cost model's fixed cost is per
    # kernel): MindSpore's CPU backend cuts a split into one slice per piece.
    kernels: int = 1
    # Passes over the iteration space those kernels make, for the cost model's per
    # element price of an equation that is not a contraction (a fused kernel that reads
    # and writes several arrays, with copies around it, costs several).
    passes: float = 1.0
    # The name of a calibration table's own price for this primitive's elements
    # (``{name}_points``: seconds per element at the sizes measured), which replaces
    # ``passes`` at the elementwise rate when the table has it: a fused kernel whose
    # copies run at the memory's speed costs more per element out of cache than in it.
    priced_as: str | None = None

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
