"""The sharding search (fshard/sharding/search.py): its objective is what the partitioner runs,
its search reaches the exhaustive optimum on the small benchmark programs
(benchmarks/search.py) and is never worse than greedy propagation, and the levels
trade memory against communication.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from mindspore import Tensor, ops

import fshard as fs
from fshard import dtypes
from fshard.sharding import search
from fshard.sharding.cost import CostModel, native_collectives, step_bytes
from fshard.sharding.propagation import propagate
from fshard.transforms.shard_call import shard_call_p

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import search as bench  # noqa: E402

def collective_bytes(part) -> tuple[float, int]:
    """Bytes each device sends for the collectives of a per-device program (each
    counted from its local operand as the backend in use runs it: ``step_bytes``),
    and their number."""
    mesh = part.prop.mesh
    sizes = dict(zip(mesh.names, mesh.sizes))
    native = native_collectives()
    total, count = 0.0, 0
    for eq in part.program.equations:
        if eq.prim.name in ("psum", "all_gather", "psum_scatter"):
            a = eq.inputs[0].aval
            local = math.prod(a.shape) * dtypes.to_numpy(a.dtype).itemsize
            n = math.prod(sizes[name] for name in eq.params["axis_name"])
            total += step_bytes(eq.prim.name, local, n, n == mesh.size, native)
            count += 1
    assert count == len(part.collectives()), "only these collectives are inserted"
    return total, count


def _np(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def _args(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [Tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes]


def _prop(fn, shapes, strategy, n, level=0, out_strategy=None):
    sharded = fs.shard(fn, in_strategy=strategy, out_strategy=out_strategy, mesh=n,
                       level=level)
    plan = sharded._prepare(_args(shapes))[0]
    return propagate(plan.body, plan.in_shardings, plan.out_shardings, plan.mesh, level)


# ---------------------------------------------------------------------------
# The objective counts what the partitioned program communicates
# ---------------------------------------------------------------------------


def mlp_sum(x, w1, w2):
    return bench.mlp2(x, w1, w2).sum()


def twice(x, w):
    y = ops.relu(ops.matmul(x, w))
    return ops.matmul(y, ops.transpose(w, (1, 0))) + x, y.sum()


OBJECTIVE_CASES = [
    # (function, shapes, in_strategy, out_strategy, devices): carries through linear
    # ops, reuse of a value's layouts by several consumers, outputs reduced at the end
    # (gamma), split outputs (ReduceScatter), several outputs.
    (bench.mlp2, [(16, 32), (32, 64), (64, 32)], (None, (1, 8), (8, 1)), None, 8),
    (mlp_sum, [(16, 32), (32, 64), (64, 32)], (None, (1, 4), (4, 1)), None, 4),
    (bench.residual, [(32, 64), (64, 128), (128, 64)], (None, (1, 8), None), None, 8),
    (bench.attention, [(32, 16), (32, 16), (32, 16)], ((4, 1), None, None), None, 4),
    (bench.row_norm, [(32, 64), (64, 32)], (None, (1, 4)), None, 4),
    (bench.mlp2, [(16, 32), (32, 64), (64, 32)], ((2, 1), (1, 4), None), ((8, 1),), 8),
    (twice, [(16, 32), (32, 32)], ((2, 2), None), None, 4),
    (bench.square_loss, [(32, 64), (64, 16), (32, 16)], ((1, 8), None, None), None, 8),
]


@pytest.mark.parametrize("use_search", [False, True], ids=["greedy", "search"])
@pytest.mark.parametrize("case", range(len(OBJECTIVE_CASES)))
def test_objective_counts_the_bytes_of_the_partitioned_program(case, use_search):
    fn, shapes, strategy, out, n = OBJECTIVE_CASES[case]
    args = _args(shapes)
    sharded = fs.shard(fn, in_strategy=strategy, out_strategy=out, mesh=n, search=use_search)
    part = sharded.partitioned(*args)
    cost = search.cost(part.prop)
    assert collective_bytes(part) == (pytest.approx(cost.comm_bytes), cost.collectives)
    if use_search:  # and the searched layouts compute the same function
        got, want = sharded(*args), fn(*args)
        for g, w in zip(got if isinstance(got, tuple) else [got],
                        want if isinstance(want, tuple) else [want]):
            np.testing.assert_allclose(_np(g), _np(w), rtol=1e-4, atol=1e-4)


@pytest.mark.full  # slow; the quick run covers it elsewhere
def test_objective_of_a_sharded_gradient_counts_both_programs():
    # grad(shard(f)) stages a forward and a backward shard_call: each is its own program.
    args = _args([(16, 32), (32, 64), (64, 32)])
    sharded = fs.shard(mlp_sum, in_strategy=(None, (1, 8), (8, 1)), mesh=8, search=True)
    f = fs.grad(sharded, argnums=(0, 1, 2))
    plans = [eq.params["plan"] for eq in fs.make_ir(f)(*args).program.equations
             if eq.prim is shard_call_p]
    assert len(plans) == 2
    for plan in plans:
        part = plan.partitioned()
        cost = search.cost(part.prop)
        assert collective_bytes(part) == (pytest.approx(cost.comm_bytes), cost.collectives)
    for g, w in zip(f(*args), fs.grad(mlp_sum, argnums=(0, 1, 2))(*args)):
        np.testing.assert_allclose(_np(g), _np(w), rtol=1e-4, atol=1e-4)


def test_cost_weighs_an_output_allreduce_by_gamma():
    prop = _prop(bench.mlp2, [(16, 32), (32, 64), (64, 32)], (None, (1, 4), (4, 1)), 4)
    cost = search.cost(prop)  # Megatron: one AllReduce, of the output
    assert cost.collectives == 1
    assert cost.weighted_bytes == pytest.approx(cost.comm_bytes * fs.sharding.cost.CostModel().gamma)


# ---------------------------------------------------------------------------
# Search against exhaustive enumeration
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("name,pattern,n", bench.FAST, ids=[f"{a}-{b}-{c}" for a, b, c in
                                                            bench.FAST])
def test_search_reaches_the_exhaustive_optimum(name, pattern, n, level):
    case = bench.make_case(name, pattern, n, level)
    greedy = search.cost(case.prop).score(level)
    found = search.search(case.prop)
    best = search.exhaustive(case.prop)
    assert best is not None
    assert found.score == best.score
    assert found.score <= greedy
    # the reported cost is the objective of the assignment found
    problem = search.Problem.from_propagated(case.prop)
    assert problem.evaluate(found.in_shardings, found.choice) == found.cost


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("name,pattern", [("mlp2", "dp"), ("attention", "none"),
                                          ("elementwise", "mixed")])
def test_exhaustive_cuts_are_exact(name, pattern, level):
    # Branch and bound, the memo of states and the axis symmetry against plain
    # enumeration of every assignment.
    case = bench.make_case(name, pattern, 4, level)
    plain = search.exhaustive(case.prop, prune=False, memo=False, symmetry=False)
    fast = search.exhaustive(case.prop)
    assert fast.score == plain.score
    assert fast.evaluations < plain.evaluations


def test_dynamic_program_is_exact_when_its_states_fit():
    case = bench.make_case("residual", "dp", 4)
    found = search.search(case.prop, width=10**6)
    assert found.exact
    assert found.score == search.exhaustive(case.prop).score


def test_search_improves_on_greedy():
    # Unannotated attention: propagation splits everything and gathers the output;
    # the best layouts keep the scores local.
    case = bench.make_case("attention", "none", 4)
    greedy = search.cost(case.prop).score(0)
    found = search.search(case.prop)
    assert found.score[0] < 0.5 * greedy[0]


def test_shard_with_search_runs_the_searched_layouts():
    args = _args([(32, 16), (32, 16), (32, 16)])
    plain = fs.shard(bench.attention, in_strategy=(None, None, None), mesh=4)
    searched = fs.shard(bench.attention, in_strategy=(None, None, None), mesh=4, search=True)
    p0, p1 = plain.partitioned(*args), searched.partitioned(*args)
    c0, c1 = search.cost(p0.prop), search.cost(p1.prop)
    assert c1.score(0) < c0.score(0)
    assert c1.score(0) == search.search(p0.prop).score
    np.testing.assert_allclose(_np(searched(*args)), _np(bench.attention(*args)), rtol=1e-4,
                               atol=1e-5)


# ---------------------------------------------------------------------------
# Levels: communication against memory against time
# ---------------------------------------------------------------------------


def wide(x, w):
    return ops.matmul(x, w)


def _wide_found() -> dict:
    # x (16, 64) split by rows, w (64, 1024) free, the output replicated.
    return {level: search.search(_prop(wide, [(16, 64), (64, 1024)], ((8, 1), None), 8, level))
            for level in (0, 1, 2)}


def _w_strategy(found) -> tuple:
    return found.in_shardings[1].strategy(fs.sharding.layouts.ShardMesh.for_devices(8))


def test_memory_level_holds_less_per_device_than_level_0():
    # Level 1 splits w by columns and gathers x instead: an eighth of w per device.
    # Level 0 splits the contraction (w by rows) and reduces the output at the end,
    # which gamma discounts; level 2 keeps w whole and gathers the output.
    found = _wide_found()
    c0, c1, c2 = (found[k].cost for k in (0, 1, 2))
    assert c1.memory < c0.memory < c2.memory
    assert [_w_strategy(found[k]) for k in (0, 1, 2)] == [(8, 1), (1, 8), (1, 1)]


def test_each_level_chooses_differently():
    found = _wide_found()
    chosen = {(tuple(f.in_shardings), tuple(f.choice)) for f in found.values()}
    assert len(chosen) == 3
    c0, c1, c2 = (found[k].cost for k in (0, 1, 2))
    # level 2 prices time: on this backend a collective's fixed cost outweighs the
    # tiny matmul, so it gathers x's 512-byte blocks once and computes the whole output
    # on every device (the most compute, the fewest bytes and collectives)
    assert c2.comm_bytes < min(c0.comm_bytes, c1.comm_bytes)
    assert c2.collectives < min(c0.collectives, c1.collectives)
    assert c2.compute > max(c0.compute, c1.compute)
    assert c2.seconds() < min(c0.seconds(), c1.seconds())
    # level 0 counts an AllReduce that only resolves an output at gamma
    assert c0.weighted_bytes < c1.weighted_bytes
    for level, f in found.items():
        prop = _prop(wide, [(16, 64), (64, 1024)], ((8, 1), None), 8, level)
        assert f.score == search.exhaustive(prop).score


# ---------------------------------------------------------------------------
# Level 2: time at the backend's measured rates
# ---------------------------------------------------------------------------


def megatron_mse(x, w1, w2, t):
    return ((bench.mlp2(x, w1, w2) - t) ** 2).mean()


@pytest.mark.parametrize("shapes", [[(16, 32), (32, 64), (64, 32)],
                                    [(128, 512), (512, 2048), (2048, 512)]],
                         ids=["small", "large"])
def test_time_level_plans_the_megatron_mlp_with_one_allreduce(shapes):
    # W1 split by columns, W2 by rows on 8 virtual devices: forward and the gradients
    # of both weights (kept in their weights' layouts) need one AllReduce, of y.
    args = _args(shapes + [(shapes[0][0], shapes[2][1])])
    forward = fs.shard(bench.mlp2, in_strategy=(None, (1, 8), (8, 1)), mesh=8, level=2,
                       search=True)
    assert forward.partitioned(*args[:3]).collectives() == ["psum"]
    vg = fs.value_and_grad(megatron_mse, argnums=(1, 2))
    sharded = fs.shard(vg, in_strategy=(None, (1, 8), (8, 1), None),
                       out_strategy=(None, ((1, 8), (8, 1))), mesh=8, level=2, search=True)
    assert sharded.partitioned(*args).collectives() == ["psum"]
    (value, grads), (want_value, want_grads) = sharded(*args), vg(*args)
    np.testing.assert_allclose(_np(value), _np(want_value), rtol=1e-4)
    for g, w in zip(grads, want_grads):
        w = _np(w)
        np.testing.assert_allclose(_np(g), w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


def test_time_is_compute_at_the_flops_rate_plus_each_collective_as_it_runs():
    # The cost of the level-2 plan of the Megatron forward on 8 devices: its flops at
    # the backend's rate, plus one AllReduce of y's (16, 32) float32 block: the fixed
    # cost and the bytes a device sends (2 (n-1)/n of the block) at the AllReduce's rate.
    prop = _prop(bench.mlp2, [(16, 32), (32, 64), (64, 32)], (None, (1, 8), (8, 1)), 8, 2)
    c = search.cost(prop)
    model = CostModel(level=2)
    latency, rate = model.rates["all_reduce"]
    assert c.comm_seconds == pytest.approx(latency + 2 * 7 / 8 * 16 * 32 * 4 / rate)
    assert c.seconds(model) == pytest.approx(c.compute / model.flops_per_s + c.comm_seconds)
    assert c.score(2, model)[0] == pytest.approx(c.seconds(model), rel=1e-9)


def test_a_candidates_shardings_are_built_once_per_labels_and_pending_sum():
    from fshard.sharding.layouts import Candidate, Sharding

    cand = Candidate((("i", (0, 1)), ("k", (2,))))
    a = cand.sharding(("i", "j"))
    assert a == Sharding(((0, 1), ()))
    assert cand.sharding(["i", "j"]) is a                 # the same labels, as a list
    partial = cand.sharding(("i", "j"), frozenset({2}))
    assert partial == Sharding(((0, 1), ()), frozenset({2})) and partial is not a
    assert cand.sharding(("k",)) == Sharding(((2,),))
