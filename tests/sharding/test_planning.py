"""Planning that is fast and right: ``fs.AutoParallel``'s three modes choose data
parallelism for an MLP step, the planners decide each repeated situation once without
changing a choice, the whole-program planner reaches the exhaustive optimum where
enumeration is possible and is never worse than greedy propagation or following the
inputs beyond it, and ``explain`` prices each equation of the plan that runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from mindspore import Tensor, ops

import fshard as fs
from fshard.sharding import explain as explain_mod
from fshard.sharding import propagation, search
from fshard.sharding.propagation import propagate
from fshard.sharding.strategy import split_alternatives

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import search as bench  # noqa: E402

MODES = ("semi_auto", "sharding_propagation", "recursive_programming")


def mlp_params(sizes, seed=0):
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        params[f"b{i}"] = (rng.standard_normal(b) * 0.1).astype(np.float32)
    return params


def ce_loss(p, x, y):
    n = len(p) // 2
    h = x
    for i in range(n):
        h = h @ p[f"w{i}"] + p[f"b{i}"]
        if i < n - 1:
            h = fs.ops.relu(h)
    return fs.ops.softmax_cross_entropy(h, y)


def _batch(rows, d_in, classes, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, d_in)).astype(np.float32),
            rng.integers(0, classes, rows).astype(np.int32))


@pytest.fixture(scope="module")
def mlp_step():
    """The 64-512-512-10 MLP, Adam, batch 256 on 8 devices: one AutoParallel per mode."""
    params = mlp_params((64, 512, 512, 10))
    x, y = _batch(256, 64, 10)
    aps = {m: fs.AutoParallel(ce_loss, fs.optim.adam(1e-3), m, mesh=8) for m in MODES}
    return params, x, y, aps


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_plans_the_mlp_step_data_parallel(mlp_step, mode):
    # One AllReduce per gradient and one for the loss, nothing gathered: greedy
    # propagation alone gathered three activations and ran the 512x512 update split
    # (six AllGathers and four AllReduces).
    params, x, y, aps = mlp_step
    ap = aps[mode]
    state = ap.init(params)
    part = ap.partitioned(state, x, y)
    shapes = sorted((eq.prim.name, tuple(eq.inputs[0].aval.shape))
                    for eq in part.program.equations
                    if eq.prim.name in ("psum", "all_gather", "psum_scatter"))
    assert shapes == sorted([("psum", p.shape) for p in params.values()] + [("psum", ())])


def test_explain_prices_the_plan_that_runs(mlp_step):
    params, x, y, aps = mlp_step
    plans = {}
    for mode in MODES:
        ap = aps[mode]
        state = ap.init(params)
        e = ap.explain(state, x, y)
        part = ap.partitioned(state, x, y)
        assert len(e.rows) == len(part.prop.program.equations)
        assert e.collectives == len(part.collectives())
        assert e.total_s == pytest.approx(e.compute_s + e.comm_s)
        # the objective's own time of the same assignment
        problem = search.Problem.from_propagated(part.prop)
        cost = problem.evaluate(part.prop.in_shardings, part.prop.choice)
        assert e.comm_s == pytest.approx(cost.comm_seconds, rel=1e-9)
        assert e.compute_s == pytest.approx(
            cost.compute / search.CostModel(level=2).flops_per_s, rel=1e-9)
        matmul = next(r for r in e.rows if r.primitive == "matmul")
        assert matmul.layout.startswith("(8, 1), (1, 1) -> (8, 1)")
        assert matmul.runner_up is not None and matmul.runner_up_s >= 0
        plans[mode] = e
    text = explain_mod.compare(plans)
    assert all(m in text for m in MODES) and len(text.splitlines()) == 4
    assert "runner-up" in str(plans["semi_auto"])


@pytest.mark.parametrize("method", ["explain", "partitioned", "sharded", "memory_report",
                                    "state_strategies"])
def test_reports_name_a_wrong_state(mlp_step, method):
    # a dict of parameters where the TrainState belongs is an fshard error naming the
    # method, not an AttributeError from inside the planner
    params, x, y, aps = mlp_step
    with pytest.raises(fs.ArgumentError, match=rf"\.{method}\(state, \*batch\): state must "
                       r"be the TrainState from ap.init\(params\); got dict"):
        getattr(aps["semi_auto"], method)(params, x, y)


def test_shard_explain():
    f = fs.shard(lambda x, w: ops.matmul(x, w), in_strategy=((8, 1), None), mesh=8)
    x, w = np.ones((16, 4), np.float32), np.ones((4, 6), np.float32)
    e = f.explain(x, w)
    assert [r.primitive for r in e.rows] == ["matmul"]
    assert e.rows[0].layout.count(" -> ") == 1
    assert e.collectives == len(f.partitioned(x, w).collectives())
    assert "matmul" in str(e)


def _deep(layers, width=16, rows=32):
    rng = np.random.default_rng(0)
    ws = [Tensor((rng.standard_normal((width, width)) / 4).astype(np.float32))
          for _ in range(layers)]
    x = Tensor(rng.standard_normal((rows, width)).astype(np.float32))

    def loss(ws, x):
        h = x
        for w in ws:
            h = ops.relu(ops.matmul(h, w))
        return h.mean()

    return fs.value_and_grad(loss), ws, x


def _choices(prop):
    return list(prop.in_shardings), [c for _, c in prop.choice]


def test_each_repeated_situation_is_decided_as_planning_each_equation(monkeypatch):
    # Propagation and following the inputs decide an equation once per situation
    # (its spec, sizes and the layouts around it): the same choices as deciding every
    # equation on its own (spec_key None turns the memo off).
    vg, ws, x = _deep(6)
    sharded = fs.shard(vg, in_strategy=(None, (8, 1)), mesh=8, level=2)
    plan = sharded._prepare((ws, x))[0]
    args = (plan.body, plan.in_shardings, plan.out_shardings, plan.mesh, 2)

    def plans():
        prop = propagate(*args)
        follow = search.follow_inputs(propagation.undecided(*args))
        return _choices(prop), _choices(follow), _choices(search.cheaper_path(prop))

    memo = plans()
    monkeypatch.setattr(propagation, "spec_key", lambda spec: None)
    monkeypatch.setattr(search, "spec_key", lambda spec: None)
    assert plans() == memo


def test_tracing_and_planning_run_with_the_cyclic_collector_paused(monkeypatch):
    import gc

    from fshard.core.gcpause import paused_gc

    seen = []
    real = propagation.propagate

    def spy(*a, **k):
        seen.append(gc.isenabled())
        return real(*a, **k)

    monkeypatch.setattr("fshard.sharding.plan.propagate", spy)
    vg, ws, x = _deep(2)

    def traced(ws, x):
        seen.append(gc.isenabled())
        return vg(ws, x)

    assert gc.isenabled()
    fs.shard(traced, in_strategy=(None, (8, 1)), mesh=8).partitioned(ws, x)
    assert seen == [False, False] and gc.isenabled()  # traced, planned; back on after
    # a pause inside another keeps the outer state; an error still turns it back on
    with paused_gc():
        with paused_gc():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError), paused_gc():
        1 / 0
    assert gc.isenabled()


def _tuple_strategy_plan(layers):
    vg, ws, x = _deep(layers)
    strategy = ([(1, 4) if i % 2 == 0 else (4, 1) for i in range(layers)], (2, 1))
    return fs.shard(vg, in_strategy=strategy, mesh=8, level=2), vg, ws, x


def test_propagations_sharing_a_memo_decide_as_fresh_ones():
    # choose_split_axes propagates one program under many boundary layouts with one
    # Memo: every decision it reuses must be the one a fresh propagation makes.
    f, _, ws, x = _tuple_strategy_plan(6)
    plan = f._prepare((ws, x))[0]
    memo = propagation.Memo(plan.body, plan.mesh, 2)
    base = list(plan.in_shardings)
    trials = [base]
    for k in range(len(base)):
        for alt in split_alternatives(base[k], plan.mesh)[1:] if base[k] else ():
            trials.append(base[:k] + [alt] + base[k + 1:])
    assert len(trials) > 10
    for ins in trials + trials[::-1]:
        args = (plan.body, ins, plan.out_shardings, plan.mesh, 2)
        shared, fresh = propagate(*args, memo=memo), propagate(*args)
        assert _choices(shared) == _choices(fresh)
        assert search.cost(shared).score(2) == search.cost(fresh).score(2)


def test_tuple_strategies_are_placed_in_trials_independent_of_the_layer_count(monkeypatch):
    # Each trial of a placement of tuple strategies propagates the whole step: values
    # given the same strategy move together, so the trials do not grow with the number
    # of parameters (a 24-layer step with 49 such values took 53+ trials before).
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return propagate(*args, **kwargs)

    monkeypatch.setattr(search, "propagate", counting)
    counts = []
    for layers in (4, 24):
        f, vg, ws, x = _tuple_strategy_plan(layers)
        calls.clear()
        f.partitioned(ws, x)
        counts.append(len(calls))
    # three starting layouts ((1, 4), (4, 1), (2, 1)), three placements each: 27 + 1
    assert counts == [28, 28]
    (v, gs), (want_v, want_gs) = f(ws, x), vg(ws, x)
    np.testing.assert_allclose(v.asnumpy(), want_v.asnumpy(), rtol=1e-5)
    for g, w in zip(gs, want_gs):
        w = w.asnumpy()
        np.testing.assert_allclose(g.asnumpy(), w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


@pytest.mark.parametrize("name,pattern,n", bench.FAST[:5],
                         ids=[f"{a}-{b}-{c}" for a, b, c in bench.FAST[:5]])
def test_whole_program_planner_reaches_the_exhaustive_optimum(name, pattern, n):
    case = bench.make_case(name, pattern, n, 2)
    refined = search.cost(search.refine(case.prop)).score(2)
    assert refined == search.exhaustive(case.prop).score
    assert search.cost(search.cheaper_path(case.prop)).score(2) <= search.cost(
        case.prop).score(2)


def test_a_program_too_large_for_the_dynamic_program_takes_the_cheaper_path():
    vg, ws, x = _deep(12)
    sharded = fs.shard(vg, in_strategy=(None, (8, 1)), mesh=8, level=2)
    plan = sharded._prepare((ws, x))[0]
    prop = propagate(plan.body, plan.in_shardings, plan.out_shardings, plan.mesh, 2)
    got = search.cost(search.refine(prop, budget=100)).score(2)
    problem = search.Problem.from_propagated(prop)
    lazy = problem.evaluate(*problem.assignment(problem.lazy_decisions())).score(2)
    assert got == min(search.cost(prop).score(2), lazy)


def test_the_whole_program_planner_gives_the_unsharded_numbers():
    vg, ws, x = _deep(12)
    sharded = fs.shard(vg, in_strategy=(None, (8, 1)), mesh=8, level=2, search=True)
    # data parallel: one AllReduce per weight gradient and one for the value
    assert sharded.partitioned(ws, x).collectives() == ["psum"] * 13
    (v, gs), (want_v, want_gs) = sharded(ws, x), vg(ws, x)
    np.testing.assert_allclose(v.asnumpy(), want_v.asnumpy(), rtol=1e-5)
    for g, w in zip(gs, want_gs):
        w = w.asnumpy()
        np.testing.assert_allclose(g.asnumpy(), w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


@pytest.mark.full
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_trains_like_one_device(mode):
    params = mlp_params((16, 64, 64, 4))
    x, y = _batch(64, 16, 4)

    def train(ap):
        state, losses = ap.init(params), []
        for _ in range(2):
            state, loss = ap(state, x, y)
            losses.append(float(loss.asnumpy()))
        return state, losses

    ref_state, ref = train(fs.AutoParallel(ce_loss, fs.optim.adam(1e-2), mesh=1))
    state, got = train(fs.AutoParallel(ce_loss, fs.optim.adam(1e-2), mode, mesh=8))
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    for k, p in ref_state.params.items():
        want = np.asarray(p.asnumpy() if hasattr(p, "asnumpy") else p)
        have = state.params[k]
        have = np.asarray(have.asnumpy() if hasattr(have, "asnumpy") else have)
        np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def _recursive_full_batch(params, plan=None):
    ap = fs.AutoParallel(ce_loss, fs.optim.adam(1e-2), "recursive_programming", mesh=8)
    ap.dataset_strategy("full_batch")
    if plan is not None:
        ap.parameter_plan(plan)
    return ap, ap.init(params)


@pytest.mark.parametrize("sizes,rows", [((64, 512, 512, 10), 256),
                                        ((256, 2048, 2048, 10), 16)])
def test_a_carried_state_is_planned_as_every_step_runs_it(sizes, rows):
    # The state a step returns is the next step's state. From a whole batch on every
    # device, the plan cheapest for one call may split the new state at its end (no
    # gather), and every later call then starts from that split; and from free state
    # layouts the search may miss the plan it finds from fixed ones. So the searching
    # mode also plans the state whole on both sides: its plan is never priced above the
    # one with every parameter whole (the default rates priced the first 36.1 ms
    # against 32.4 ms, the second 97.4 ms against 51.7 ms).
    params = mlp_params(sizes)
    x, y = _batch(rows, sizes[0], sizes[-1])
    ap, state = _recursive_full_batch(params)
    whole = _recursive_full_batch(params, {k: (1,) * v.ndim for k, v in params.items()})
    price = ap.explain(state, x, y).total_s
    assert price <= whole[0].explain(whole[1], x, y).total_s * (1 + 1e-9)
    if rows == 16:
        return
    ref_ap = fs.AutoParallel(ce_loss, fs.optim.adam(1e-2), mesh=1)
    ref_state, got, ref = ref_ap.init(params), [], []
    for _ in range(3):
        state, loss = ap(state, x, y)
        ref_state, want = ref_ap(ref_state, x, y)
        got.append(float(loss.asnumpy()))
        ref.append(float(want.asnumpy()))
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert ap.explain(state, x, y).total_s == price  # the steps after run that plan


def test_in_a_job_the_planners_also_try_computing_everything_whole(monkeypatch):
    # Where the devices are a job's processes, each computes its own copy at once: the
    # plan that gathers the batch where it is first used and computes every equation
    # whole (no gradient reduced) is one more path, taken where it is priced lowest.
    # On a virtual mesh it is not offered.
    from fshard.sharding import cost as cost_mod

    vg, ws, x = _deep(12)

    def plan(search_on):
        f = fs.shard(vg, in_strategy=(None, (8, 1)), mesh=8, level=2, search=search_on)
        p = f._prepare((ws, x))[0]
        return f, propagate(p.body, p.in_shardings, p.out_shardings, p.mesh, 2)

    _, prop = plan(False)
    assert search.whole_path(search.Problem.from_propagated(prop)) is None
    monkeypatch.setattr(cost_mod, "comm_initialized", lambda: True)
    f, prop = plan(True)
    problem = search.Problem.from_propagated(prop)
    assert problem.model.job
    ins, choice, score = search.whole_path(problem)

    def price(p):  # in the problem's rates
        return problem.evaluate(p.in_shardings, p.choice).score(2, problem.model)

    lazy = problem.evaluate(*problem.assignment(problem.lazy_decisions()))
    # the default rates price a CPU job's collectives above this program's compute
    assert score < min(lazy.score(2, problem.model), price(prop))
    chosen = search.cheaper_path(prop)
    assert price(chosen) == score
    split = [(v, sh) for eq in chosen.program.equations for v in eq.outputs
             for sh in [chosen.shardings[v]] if any(sh.dims) or sh.partial]
    assert not split, split
    assert price(search.refine(prop)) == score
    # run on the virtual mesh: one AllGather of the batch, the unsharded numbers
    assert f.partitioned(ws, x).collectives() == ["all_gather"]
    (v, gs), (want_v, want_gs) = f(ws, x), vg(ws, x)
    np.testing.assert_allclose(v.asnumpy(), want_v.asnumpy(), rtol=1e-5)
    for g, w in zip(gs, want_gs):
        w = w.asnumpy()
        np.testing.assert_allclose(g.asnumpy(), w, rtol=1e-4, atol=1e-5 * np.abs(w).max())
