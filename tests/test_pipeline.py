"""Pipeline parallelism on a virtual mesh: schedules as data, the simulated timeline
against the bubble formulas, exact numbers against the unpipelined run for every
(stages, micro-batches, scheduler, interleave), stage markers in functions and Cells,
and the errors. (Real multi-process jobs: tests/distributed/test_pipeline_multiprocess.py.)
"""

from __future__ import annotations

import itertools
import os
import sys
from fractions import Fraction

import numpy as np
import pytest

import fshard as fs
from fshard.training.parallel.schedule import Round, Schedule

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_pipeline as example  # noqa: E402

STEPS = 20


def _configs():
    """Every valid (S, M, scheduler, interleave) of S in {2, 4}, M in {1, 2, 4, 8}."""
    out = []
    for S, M, sched, inter in itertools.product((2, 4), (1, 2, 4, 8), ("gpipe", "1f1b"),
                                                (False, True)):
        if (sched == "1f1b" and M < S) or (inter and M % S):
            continue
        out.append((S, M, sched, inter))
    return out


CONFIGS = _configs()
#: What the quick run trains (1F1B; the schedule tests above cover GPipe and interleaving);
#: ``--full`` trains every configuration.
QUICK_CONFIGS = {(2, 4, "1f1b", False)}


def _quick(configs, quick):
    return [c if c in quick else pytest.param(*c, marks=pytest.mark.full) for c in configs]


# -- schedules ---------------------------------------------------------------------


@pytest.mark.parametrize("S, M, sched, inter", CONFIGS)
def test_bubble_fraction_follows_the_formula(S, M, sched, inter):
    v = 2 if inter else 1
    t = Schedule(S, M, sched, v).timeline()
    assert t.bubble_fraction == Fraction(S - 1, v * M + S - 1)
    if inter:  # interleaving divides the idle time by v
        assert t.bubble * v == Schedule(S, M, sched).timeline().bubble
    else:
        assert t.bubble_fraction == Fraction(S - 1, M + S - 1)
    # every stage computes v * M forwards and as many backwards, each once
    for s in range(S):
        acts = Schedule(S, M, sched, v).compute(s)
        assert sorted((a.kind, a.micro_batch, a.chunk) for a in acts) == sorted(
            (k, m, c) for k in "FB" for m in range(M) for c in range(s, S * v, S))


@pytest.mark.parametrize("v", [3, 4])
def test_more_virtual_stages_divide_the_bubble_further(v):
    base = Schedule(4, 8, "1f1b").timeline()
    t = Schedule(4, 8, "1f1b", v).timeline()
    assert t.bubble * v == base.bubble
    assert t.bubble_fraction == Fraction(3, v * 8 + 3)


def test_1f1b_keeps_at_most_S_micro_batches_alive_and_gpipe_M():
    for S, M in [(2, 4), (4, 8), (4, 4)]:
        assert Schedule(S, M, "1f1b").timeline().peak_activations() == [
            S - s for s in range(S)]
        assert Schedule(S, M, "gpipe").timeline().peak_activations() == [M] * S


def test_actions_pair_every_send_with_a_receive_in_order():
    s = Schedule(2, 4, "1f1b")
    assert [a[:2] for a in s.actions(0) if a.kind in "FB"] == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert s.actions(0)[:2] == [("F", 0, 0, None), ("send_F", 0, 0, 1)]
    assert s.actions(1)[:2] == [("recv_F", 0, 1, 0), ("F", 0, 1, None)]
    for sched, v in [("1f1b", 1), ("gpipe", 1), ("1f1b", 2)]:
        sc = Schedule(4, 8, sched, v)
        for kind in "FB":
            sends = [(a.micro_batch, a.peer) for st in range(4) for a in sc.actions(st)
                     if a.kind == f"send_{kind}"]
            recvs = [(a.micro_batch, st) for st in range(4) for a in sc.actions(st)
                     if a.kind == f"recv_{kind}"]
            assert sorted(sends) == sorted(recvs) and sends
        # each stage's receive comes before the computation that uses it
        for st in range(4):
            seen = set()
            for a in sc.actions(st):
                if a.kind.startswith("recv"):
                    seen.add((a.kind[-1], a.chunk, a.micro_batch))
                elif a.kind in "FB" and not (a.kind == "F" and a.chunk == 0) and not (
                        a.kind == "B" and a.chunk == 4 * v - 1):
                    src = a.chunk - 1 if a.kind == "F" else a.chunk + 1
                    assert src % 4 == st or (a.kind, a.chunk, a.micro_batch) in seen


def test_program_order_puts_each_round_after_what_it_carries():
    t = Schedule(4, 8, "1f1b", 2).timeline()
    done = set()
    for item in t.program_order():
        if isinstance(item, Round):
            for src, _, chunk, m in item.forward:
                assert ("F", chunk - 1, m) in done
            for src, _, chunk, m in item.backward:
                assert ("B", chunk + 1, m) in done
        else:
            done.add((item.action.kind, item.action.chunk, item.action.micro_batch))


def test_timeline_pictures(tmp_path):
    from rich.console import Console

    t = Schedule(4, 8, "1f1b").timeline()
    console = Console(record=True, width=400)
    console.print(t.render())
    text = console.export_text()
    assert "bubble 27.3%" in text and text.count("stage ") == 4
    assert "F7" in text and "B7" in text
    t.plot(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 5000


# -- numbers -------------------------------------------------------------------------

#: One optimizer for every run: the pipelines' finishing programs are shared across
#: configurations (per optimizer), as the chunks' programs are (per chunk function).
OPT = fs.optim.sgd(0.03, momentum=0.9)
#: The transformer stack at its smallest (4 tokens of 16 pixels, width 8) and a batch of
#: 16 (2 rows per micro-batch at M = 8): every configuration stays cheap.
TINY = dict(d_model=8, seq=4)
BATCHES = {"mlp": example.BATCH, "transformer": 16}
_REFS: dict = {}


def _params(model, chunks):
    if model == "transformer":  # in float64: see _check_equal
        return {k: v.astype(np.float64) for k, v in example.transformer_params(
            chunks, **TINY).items()}
    return example.mlp_params(chunks)


def _reference(model, chunks):
    """Losses and parameters of the unpipelined training (one compiled step of
    value_and_grad and the optimizer, on the whole batch)."""
    key = (model, chunks)
    if key not in _REFS:
        loss_fn = example.MODELS[model][1]

        @fs.jit
        def step(params, opt_state, x, y):
            loss, g = fs.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = OPT.update(g, opt_state, params)
            return fs.optim.apply_updates(params, updates), opt_state, loss

        params = _params(model, chunks)
        opt_state, losses = OPT.init(params), []
        for x, y in example.batches(STEPS, BATCHES[model]):
            params, opt_state, loss = step(params, opt_state, x, y)
            losses.append(float(loss.asnumpy()))
        _REFS[key] = losses, {k: v.asnumpy() for k, v in params.items()}
    return _REFS[key]


def _check_equal(model, S, M, sched, inter, dp=1):
    chunks = S * (2 if inter else 1)
    ref_losses, ref_params = _reference(model, chunks)
    losses, state, ap = example.train(STEPS, model, S, M, sched, inter, mesh=S * dp, opt=OPT,
                                      params=_params(model, chunks), batch=BATCHES[model])
    # The rounding differs (micro-batch sums vs whole-batch sums) and training amplifies
    # it: the MLP in float32 stays within 1e-5, the small transformer in float32 reaches
    # 1.7e-5 of a tensor's scale after 20 steps, so it runs in float64, where every
    # configuration agrees to ~1e-15. Tolerances: 1e-5 (float32) or 1e-11 (float64) of
    # each value, or of its tensor's scale near zero.
    tol = 1e-11 if model == "transformer" else 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=tol)
    for k, want in ref_params.items():
        np.testing.assert_allclose(state.params[k].asnumpy(), want, rtol=tol,
                                   atol=tol * float(np.abs(want).max()), err_msg=k)
    assert int(state.step.asnumpy()) == STEPS
    assert ap.pipeline_schedule().virtual_stages == (2 if inter else 1)


@pytest.mark.parametrize("S, M, sched, inter", _quick(CONFIGS, QUICK_CONFIGS))
def test_mlp_trains_like_the_unpipelined_run(S, M, sched, inter):
    _check_equal("mlp", S, M, sched, inter)


@pytest.mark.parametrize("S, M, sched, inter", _quick(CONFIGS, set()))
def test_transformer_stack_trains_like_the_unpipelined_run(S, M, sched, inter):
    _check_equal("transformer", S, M, sched, inter)


def test_chunks_computing_the_same_function_share_compiled_programs():
    from fshard.training.parallel import pipeline as P

    x, y = next(example.batches(1, 16))
    a = P.Stages(example.transformer_loss, "t", _params("transformer", 8), (x, y), 2)
    b = P.Stages(example.transformer_loss, "t", _params("transformer", 4), (x, y), 2)
    # blocks 1..6 of the 8-block stack are one function; so are the first (embedding +
    # block) and the last (block + head + loss) chunks of both stacks
    keys = [a.chunk_key(c) for c in range(8)]
    assert None not in keys and len(set(keys[1:7])) == 1 and len(set(keys)) == 3
    assert b.chunk_key(0) == keys[0] and b.chunk_key(3) == keys[7]
    assert b.chunk_key(1) == keys[1]
    assert a.forward_fn(3) is a.forward_fn(5) is b.forward_fn(2)
    assert a.backward_fn(7) is b.backward_fn(3) and a.backward_fn(7) is not a.backward_fn(0)
    # other shapes (micro-batch rows) or other constants: other programs
    c = P.Stages(example.transformer_loss, "t", _params("transformer", 4), (x, y), 4)
    assert c.chunk_key(1) != keys[1]

    def scaled(k):
        def loss(p, x, y):
            h = fs.pipeline_split(fs.ops.relu(x @ p["w1"]) * k)
            return ((h @ p["w2"] - y) ** 2).mean()
        return loss

    p, x, y = _data()
    one, two, neg = (P.Stages(scaled(k), "s", p, (x, y), 4) for k in (1.5, 2.5, -0.0))
    zero = P.Stages(scaled(0.0), "s", p, (x, y), 4)
    assert one.chunk_key(0) != two.chunk_key(0) and one.chunk_key(1) == two.chunk_key(1)
    assert neg.chunk_key(0) != zero.chunk_key(0)


def test_data_parallel_inside_each_stage():
    _check_equal("mlp", 2, 4, "1f1b", False, dp=2)


def _dense_net():
    """A two-layer Cell for the digits (its stages are set by the tests)."""
    from mindspore import nn

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Dense(64, 32)
            self.relu = nn.ReLU()
            self.layer2 = nn.Dense(32, 10)

        def construct(self, x, y):
            h = self.relu(self.layer1(x))
            return fs.ops.softmax_cross_entropy(self.layer2(h), y)

    return Net()


def test_cells_with_pipeline_stage():
    x, y = next(example.batches(1))
    net = _dense_net()
    ref = fs.AutoParallel(net, fs.optim.sgd(0.1), mesh=1)
    s_ref = ref.init()
    net.layer1.pipeline_stage, net.layer2.pipeline_stage = 0, 1
    ap = fs.AutoParallel(net, fs.optim.sgd(0.1), mesh=2).pipeline(stages=2, micro_batches=4)
    s = ap.init()
    for _ in range(3):
        s_ref, l_ref = ref(s_ref, x, y)
        s, l = ap(s, x, y)
        np.testing.assert_allclose(float(l.asnumpy()), float(l_ref.asnumpy()), rtol=1e-5)
    plan = ap._pipeline.plan
    owners = {k: plan.param_owner[i] for i, k in enumerate(s.params)}
    assert owners == {"layer1.weight": 0, "layer1.bias": 0, "layer2.weight": 1,
                      "layer2.bias": 1}


def test_pipeline_split_is_the_identity_elsewhere():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    f = lambda v: (fs.pipeline_split(v * 2) ** 2).sum()  # noqa: E731
    assert float(fs.jit(f)(x).asnumpy()) == float((4 * x * x).sum())
    np.testing.assert_allclose(fs.grad(f)(x).asnumpy(), 8 * x)
    assert "pipeline_split" in str(fs.make_ir(f)(x))


# -- errors --------------------------------------------------------------------------


def _loss(p, x, y):
    h = fs.pipeline_split(fs.ops.relu(x @ p["w1"]))
    return ((h @ p["w2"] - y) ** 2).mean()


def _data():
    rng = np.random.default_rng(0)
    p = {"w1": rng.standard_normal((4, 8)).astype(np.float32),
         "w2": rng.standard_normal((8, 2)).astype(np.float32)}
    return p, rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal(
        (8, 2)).astype(np.float32)


def _step(loss, mesh=2, **kw):
    p, x, y = _data()
    kw.setdefault("stages", 2)
    kw.setdefault("micro_batches", 2)
    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=mesh).pipeline(**kw)
    return ap(ap.init(p), x, y)


@pytest.mark.parametrize("kw, match", [
    (dict(stages=3), "must divide the 4 devices"),
    (dict(stages=2, micro_batches=1, scheduler="1f1b"), "at least as many micro-batches"),
    (dict(stages=2, micro_batches=3, interleave=True), "multiple of stages=2"),
    (dict(stages=2, scheduler="zb"), "scheduler"),
    (dict(stages=0), "stages"),
    (dict(stages=2, interleave=1), "interleave"),
    (dict(stages=2, output_broadcast="yes"), "output_broadcast"),
    (dict(stages=1, micro_batches=4), "would be ignored"),
])
def test_bad_configuration_is_an_error(kw, match):
    ap = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=4)
    with pytest.raises(fs.ArgumentError, match=match):
        ap.pipeline(**kw)


def test_micro_batches_must_divide_the_batch():
    with pytest.raises(fs.ArgumentError, match="does not split into 3 micro-batches"):
        _step(_loss, micro_batches=3, scheduler="gpipe")
    with pytest.raises(fs.ArgumentError, match="4 x 2 = 8 must divide"):  # with dp = 2
        p, x, y = _data()
        ap = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=4).pipeline(
            stages=2, micro_batches=4)
        ap(ap.init(p), x[:4], y[:4])


def test_marker_count_must_match_the_stages():
    def three(p, x, y):
        h = fs.pipeline_split(fs.pipeline_split(fs.ops.relu(x @ p["w1"])) * 2)
        return ((h @ p["w2"] - y) ** 2).mean()

    def none(p, x, y):
        return ((fs.ops.relu(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    with pytest.raises(fs.ArgumentError, match="more markers than stages"):
        _step(three)
    with pytest.raises(fs.ArgumentError, match="too few markers"):
        _step(none)
    with pytest.raises(fs.ArgumentError, match="multiple of 2 chunks, more than 2"):
        _step(_loss, interleave=True)


def test_empty_stage_and_shared_parameter_are_errors():
    def empty(p, x, y):
        h = fs.pipeline_split(x)
        return ((fs.ops.relu(h @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    def shared(p, x, y):
        h = fs.pipeline_split(fs.ops.relu(x @ p["w1"]) @ p["w2"])
        return ((h @ fs.ops.transpose(p["w2"], (1, 0)) @ p["w2"] - y) ** 2).mean()

    with pytest.raises(fs.ArgumentError, match="stage 0 of 2 is empty"):
        _step(empty)
    with pytest.raises(fs.ArgumentError, match=r"used in stages \[0, 1\]"):
        _step(shared)


def test_value_flowing_backwards_between_cell_stages_is_an_error():
    from mindspore import nn

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Dense(4, 8), nn.Dense(8, 2)
            self.a.pipeline_stage, self.b.pipeline_stage = 1, 0

        def construct(self, x, y):
            return ((self.b(self.a(x)) - y) ** 2).mean()

    _, x, y = _data()
    ap = fs.AutoParallel(Net(), fs.optim.sgd(0.1), mesh=2).pipeline(stages=2, micro_batches=2)
    with pytest.raises(fs.ArgumentError, match="computed in stage 1 enters stage 0"):
        ap(ap.init(), x, y)


def test_marker_inside_vmap_is_an_error():
    with pytest.raises(fs.CompositionError, match="inside fs.vmap"):
        fs.vmap(fs.pipeline_split)(np.ones((3, 2), np.float32))


def test_integer_value_crossing_a_boundary_is_an_error():
    def loss(p, x, y):
        h = fs.ops.relu(x @ p["w1"])
        k = fs.ops.argmax(h, 1)  # an int32 value used in both stages
        h = fs.pipeline_split(h * fs.ops.cast(k, fs.dtypes.float32).mean())
        return ((h @ p["w2"] - y) ** 2).mean() + fs.ops.cast(k, fs.dtypes.float32).mean()

    with pytest.raises(fs.ArgumentError, match="only float values can"):
        _step(loss)


def test_pipeline_does_not_combine_with_other_plans():
    p, x, y = _data()
    ap = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=2).pipeline(stages=2, micro_batches=2)
    ap.comm_fusion({"allreduce": {"mode": "size", "config": 2}})
    with pytest.raises(fs.ArgumentError, match=r"cannot be combined with comm_fusion"):
        ap(ap.init(p), x, y)
    with pytest.raises(fs.ArgumentError, match="not one sharded program"):
        ap.state_strategies(ap.init(p), x, y)
    with pytest.raises(fs.ArgumentError, match="no pipeline is configured"):
        fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=2).pipeline_schedule()
    inter = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=2).pipeline(
        stages=2, micro_batches=2, interleave=True)
    with pytest.raises(fs.ArgumentError, match="known after the first step"):
        inter.pipeline_schedule()
    assert inter.pipeline_schedule(virtual_stages=2).virtual_stages == 2


def test_unbalanced_stages_warn_with_their_estimated_costs():
    def heavy_first(p, x, y):  # stage 0: four 4x64x64 matmuls; stage 1: one 4x64x2
        h = x @ p["w0"]
        for _ in range(4):
            h = fs.ops.relu(h @ p["w1"])
        return ((fs.pipeline_split(h) @ p["w2"] - y) ** 2).mean()

    rng = np.random.default_rng(0)
    p = {"w0": rng.standard_normal((4, 64)).astype(np.float32) / 2,
         "w1": rng.standard_normal((64, 64)).astype(np.float32) / 8,
         "w2": rng.standard_normal((64, 2)).astype(np.float32) / 8}
    _, x, y = _data()
    ap = fs.AutoParallel(heavy_first, fs.optim.sgd(0.1), mesh=2).pipeline(
        stages=2, micro_batches=2)
    with pytest.raises(fs.ArgumentError, match="run a step first"):
        ap.pipeline_stage_costs()
    with pytest.warns(fs.PipelineBalanceWarning) as rec:
        ap(ap.init(p), x, y)
    costs = ap.pipeline_stage_costs()
    # 4 rows per micro-batch: the matmuls' multiply-adds and the elementwise ops
    assert costs[0] > 60 * costs[1] > 0
    msg = str(rec[0].message)
    assert "stage 0 costs" in msg and "max_imbalance=8" in msg and "idle" in msg
    assert "pipeline_stage_costs()" in msg and "max_imbalance=None" in msg
    # the warning names where the step was called
    assert rec[0].filename == __file__
    # a looser bound, or none: no warning
    for bound in (None, 1000.0):
        quiet = fs.AutoParallel(heavy_first, fs.optim.sgd(0.1), mesh=2).pipeline(
            stages=2, micro_batches=2, max_imbalance=bound)
        quiet(quiet.init(p), x, y)
    # the transformer stack is balanced (to 25% at this width: the embedding in stage 0)
    t = fs.AutoParallel(example.transformer_loss, OPT, mesh=4).pipeline(
        stages=4, micro_batches=4)
    xs, ys = next(example.batches(1, 16))
    t(t.init(_params("transformer", 4)), xs, ys)
    costs = t.pipeline_stage_costs()
    assert max(costs) < 1.25 * min(costs) and costs.index(max(costs)) == 0


@pytest.mark.parametrize("bad", [0.5, "2", True, float("nan")])
def test_max_imbalance_must_be_a_number_at_least_one(bad):
    ap = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=2)
    with pytest.raises(fs.ArgumentError, match=r"max_imbalance=\.\.\.\) is the largest ratio"):
        ap.pipeline(stages=2, max_imbalance=bad)


def test_a_process_slice_must_split_into_micro_batches():
    from fshard.training.parallel.pipeline import batch_rows

    x = np.zeros((6, 3), np.float32)
    # a job's per-process slice is split into micro-batches only (dp is across processes)
    assert batch_rows("loss", (x[:4],), 4, 2, sliced=True) == 1
    assert batch_rows("loss", (x[:4],), 2, 2) == 1
    with pytest.raises(fs.ArgumentError, match="this process's slice of the batch has 6 "
                       "rows, which do not split into 4 equal micro-batches"):
        batch_rows("loss", (x,), 4, 2, sliced=True)


# -- operator parallelism inside each stage --------------------------------------------

#: (S, M, scheduler, interleave, devices per stage) with parameter strategies.
SHARDED_CONFIGS = [(2, 4, "1f1b", False, 4), (2, 2, "gpipe", False, 2),
                   (2, 4, "1f1b", True, 2), (4, 4, "gpipe", False, 2)]


@pytest.mark.parametrize("S, M, sched, inter, k", _quick(SHARDED_CONFIGS, SHARDED_CONFIGS[:1]))
def test_operator_parallelism_inside_each_stage(S, M, sched, inter, k):
    """parameter_plan with a pipeline: each stage's programs are fs.shard-ed over its
    k devices (the weights split as planned, collectives inside the stage), and the
    training equals the unpipelined run."""
    chunks = S * (2 if inter else 1)
    plan = example.model_parallel_plan("mlp", chunks, k)
    ref_losses, ref_params = _reference("mlp", chunks)
    losses, state, ap = example.train(STEPS, "mlp", S, M, sched, inter, mesh=S * k, opt=OPT,
                                      params=_params("mlp", chunks), plan=plan)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, want in ref_params.items():
        np.testing.assert_allclose(state.params[name].asnumpy(), want, rtol=1e-5,
                                   atol=1e-5 * float(np.abs(want).max()), err_msg=name)
    step = next(iter(ap._pipeline._steps.values()))
    assert step.sharding is not None and step.sharding.devices == k
    # chunk 0's forward on its stage: layer0.w arrives as column blocks of k, and the
    # stage communicates (its outputs are whole values)
    p = step.plan
    leaves = fs.tree.leaves(state.params)
    pv = [leaves[i] for i in p.chunk_params[0]]
    x, _ = next(example.batches(1))
    bv = [np.zeros(v.aval.shape, fs.dtypes.to_numpy(v.aval.dtype)) for v in p.batch_vars]
    part = p.forward_fn(0, step.sharding).fun.partitioned(pv, [], bv)
    names = [k_ for k_, _ in sorted(state.params.items())]
    w = p.chunk_params[0].index(names.index("layer0.w"))
    assert part.in_shardings[w].strategy(part.prop.mesh) == (1, k)
    assert part.collectives()


@pytest.mark.full  # slow: the full matrix (the quick run covers the feature elsewhere)
def test_transformer_stack_with_operator_parallelism_inside_stages():
    plan = example.model_parallel_plan("transformer", 2, 2)
    ref_losses, ref_params = _reference("transformer", 2)
    losses, state, _ = example.train(STEPS, "transformer", 2, 2, "1f1b", False, mesh=4,
                                     opt=OPT, params=_params("transformer", 2),
                                     batch=BATCHES["transformer"], plan=plan)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-11)
    for name, want in ref_params.items():
        np.testing.assert_allclose(state.params[name].asnumpy(), want, rtol=1e-11,
                                   atol=1e-11 * float(np.abs(want).max()), err_msg=name)


def test_operator_strategies_in_the_loss_apply_inside_each_stage():
    from mindspore import ops

    def make(relu):
        def loss(p, x, y):
            h = fs.pipeline_split(relu(x @ p["w1"]))
            return ((h @ p["w2"] - y) ** 2).mean()
        return loss

    p, x, y = _data()
    ref = fs.AutoParallel(make(ops.ReLU()), fs.optim.sgd(0.1), mesh=1)
    ap = fs.AutoParallel(make(ops.ReLU().shard(((2, 1),))), fs.optim.sgd(0.1), mesh=4).pipeline(stages=2, micro_batches=2)
    s_ref, s = ref.init(p), ap.init(p)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # applied: no OperatorStrategyWarning
        for _ in range(3):
            s_ref, l_ref = ref(s_ref, x, y)
            s, l = ap(s, x, y)
            np.testing.assert_allclose(float(l.asnumpy()), float(l_ref.asnumpy()), rtol=1e-5)
    step = next(iter(ap._pipeline._steps.values()))
    assert step.sharding is not None and step.plan.constrained
    for k in p:
        np.testing.assert_allclose(s.params[k].asnumpy(), s_ref.params[k].asnumpy(),
                                   rtol=1e-5, atol=1e-6)


def test_a_parameter_strategy_larger_than_a_stage_is_an_error():
    p, x, y = _data()
    ap = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=8).parameter_plan({"w1": (1, 8)})
    ap.pipeline(stages=2, micro_batches=2)
    with pytest.raises(fs.ArgumentError, match=r"(?s)the strategy \(1, 8\) of parameter "
                       r"\['w1'\] \(f32\[4,8\]\) splits it over 8 devices, but each stage "
                       r"has 4 \(8 devices / 2 stages\).*Fix: split counts whose product "
                       r"divides 4"):
        ap(ap.init(p), x, y)
    # a Layout describes a stage's devices too
    for devices, ok in ((4, True), (8, False)):
        view = fs.Layout((2, devices // 2), ("a", "b"))("None", "b")
        ap = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=8).parameter_plan({"w1": view})
        ap.pipeline(stages=2, micro_batches=2)
        if ok:
            ap(ap.init(p), x, y)
            continue
        with pytest.raises(fs.ArgumentError, match=r"(?s)the Layout .* of parameter \['w1'\] "
                           r"\(f32\[4,8\]\) has a device matrix of 8 devices, but each stage "
                           r"has 4.*Fix: a Layout whose device matrix has 4 devices"):
            ap(ap.init(p), x, y)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_parameter_plan_naming_no_parameter_is_an_error(stages):
    p, x, y = _data()
    ap = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=4).parameter_plan(
        {"w1": (1, 2), "w3": (2, 1)})
    if stages > 1:
        ap.pipeline(stages=stages, micro_batches=2)
    with pytest.raises(fs.ArgumentError, match=r"(?s)parameter_plan names \['w3'\], which is "
                       r"not a parameter of the model; its parameters are \['w1', 'w2'\]"
                       r".*Fix: use those names"):
        ap(ap.init(p), x, y)


def test_fs_shard_in_the_loss_applies_inside_stages_or_warns_with_one_device():
    """A stage of several devices honours an fs.shard written in the loss; with one
    device per stage there is nothing to split: a warning, and the function runs as it
    is (its own shard would wait for processes running other stages)."""
    inner = fs.shard(lambda h: fs.ops.relu(h), in_strategy=((2, 1),))

    def loss(p, x, y):
        h = fs.pipeline_split(inner(x @ p["w1"]))
        return ((h @ p["w2"] - y) ** 2).mean()

    p, x, y = _data()
    want = float(fs.jit(_loss)(p, x, y).asnumpy())
    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=4).pipeline(stages=2, micro_batches=2)
    _, l = ap(ap.init(p), x, y)
    np.testing.assert_allclose(float(l.asnumpy()), want, rtol=1e-6)
    assert next(iter(ap._pipeline._steps.values())).sharding is not None
    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=2).pipeline(stages=2, micro_batches=2)
    with pytest.warns(fs.OperatorStrategyWarning, match=r"(?s)does not apply fs.shard\(<lambda>"
                      r", in_strategy=\(\(2, 1\),\)\) inside the loss: .* each stage here has "
                      r"one device.*Fix: give the stages several devices"):
        _, l = ap(ap.init(p), x, y)
    np.testing.assert_allclose(float(l.asnumpy()), want, rtol=1e-6)


def test_an_operator_strategy_inside_a_loop_body_shards_the_stages_too():
    from mindspore import ops

    def make(relu):
        def loss(p, x, y):
            h, _ = fs.scan(lambda c, _: (relu(c) * 0.9, None), x @ p["w1"], None, length=3)
            return ((fs.pipeline_split(h) @ p["w2"] - y) ** 2).mean()
        return loss

    p, x, y = _data()
    ref = fs.AutoParallel(make(ops.ReLU()), fs.optim.sgd(0.1), mesh=1)
    ap = fs.AutoParallel(make(ops.ReLU().shard(((2, 1),))), fs.optim.sgd(0.1), mesh=4).pipeline(
        stages=2, micro_batches=2)
    s_ref, s = ref.init(p), ap.init(p)
    for _ in range(2):
        s_ref, l_ref = ref(s_ref, x, y)
        s, l = ap(s, x, y)
        np.testing.assert_allclose(float(l.asnumpy()), float(l_ref.asnumpy()), rtol=1e-5)
    assert next(iter(ap._pipeline._steps.values())).sharding is not None


def test_a_cells_parameter_plan_shards_its_stages():
    x, y = next(example.batches(1))
    net = _dense_net()
    ref = fs.AutoParallel(net, fs.optim.sgd(0.1), mesh=1)
    s_ref = ref.init()
    net.layer1.pipeline_stage, net.layer2.pipeline_stage = 0, 1
    ap = fs.AutoParallel(net, fs.optim.sgd(0.1), mesh=4).parameter_plan(
        {"layer1.weight": (2, 1), "layer2.weight": (1, 2)}).pipeline(stages=2, micro_batches=4)
    s = ap.init()
    for _ in range(3):
        s_ref, l_ref = ref(s_ref, x, y)
        s, l = ap(s, x, y)
        np.testing.assert_allclose(float(l.asnumpy()), float(l_ref.asnumpy()), rtol=1e-5)
    sharding = next(iter(ap._pipeline._steps.values())).sharding
    assert sharding is not None and (2, 1) in sharding.params and (1, 2) in sharding.params
    for k in s.params:
        want = s_ref.params[k].asnumpy()
        np.testing.assert_allclose(s.params[k].asnumpy(), want, rtol=1e-5,
                                   atol=1e-5 * float(np.abs(want).max()), err_msg=k)


def test_local_norms_and_the_seed_files_work_with_a_pipeline(tmp_path, capsys):
    # seed 001's knobs on a pipelined step (2 stages x 2 devices): the gradient norms
    # are those of the whole batch's gradient, the files written at the first step
    import json

    p, x, y = _data()
    _, grads = fs.value_and_grad(_loss)(p, x, y)
    ap = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=4).pipeline(stages=2, micro_batches=2)
    ap.print_local_norm().dump_local_norm(tmp_path / "norms").enable_device_local_norm()
    ap.save_param_strategy_file(tmp_path / "param.json")
    ap.set_group_ckpt_save_file(tmp_path / "groups.json")
    state = ap.init(p)
    state, loss = ap(state, x, y)
    ref = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=4).pipeline(stages=2, micro_batches=2)
    _, want = ref(ref.init(p), x, y)
    assert float(loss.asnumpy()) == float(want.asnumpy())  # training unchanged
    line = json.loads((tmp_path / "norms" / "local_norm_rank0.jsonl").read_text())
    assert line["step"] == 1
    total = 0.0
    for k, g in grads.items():
        g = g.asnumpy().astype(np.float64)
        np.testing.assert_allclose(line["norms"][k], np.linalg.norm(g), rtol=1e-5)
        total += float((g ** 2).sum())
    # every device holds every gradient (each process runs the whole optimizer)
    assert sorted(line["device_norms"]) == ["0", "1", "2", "3"]
    for v in line["device_norms"].values():
        np.testing.assert_allclose(v, np.sqrt(total), rtol=1e-5)
    printed = capsys.readouterr().out
    assert "local_norm: step 1 w1 block (0, 0): " in printed
    assert "device_local_norm: step 1 device 3" in printed
    param = json.loads((tmp_path / "param.json").read_text())
    assert param["params"] == {"w1": [1, 1], "w2": [1, 1]}
    assert param["stages"] == {"w1": 0, "w2": 1}
    groups = json.loads((tmp_path / "groups.json").read_text())
    assert groups["groups"] == {"pp": [0, 2], "dp": [0, 1]} and groups["rank"] == 0
    # the operator strategy file has no single plan to describe
    ap2 = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=4).pipeline(stages=2, micro_batches=2)
    ap2.save_operator_strategy_file(tmp_path / "op.json")
    with pytest.raises(fs.ArgumentError, match="save_operator_strategy_file"):
        ap2(ap2.init(p), x, y)
