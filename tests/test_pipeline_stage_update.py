"""A pipeline's optimizer update split by stage on a virtual mesh: each stage's devices
update only their own parameters and optimizer state and keep only those
(``memory_report``), with the numbers of the unpipelined run: Adam, SGD, AdamW, frozen
parameters, a global-norm clip, whose norm sums the stages' partial sums, and loss
scaling, whose finiteness test does. An update that couples the stages otherwise (one
stage's update reading another's gradient) runs whole on every device, exact, also
with ZeRO, and ``memory_report`` says why."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import fshard as fs
from fshard.training.parallel import pipeline as pipeline_mod

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # tests/ is not a package
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_mlp  # noqa: E402

STEPS = 3


def _data():
    return pipeline_mlp.data(16, STEPS)


_loss = pipeline_mlp.loss


def _train(ap, params, batches):
    state = ap.init(params)
    losses = []
    for x, y in batches:
        state, l = ap(state, x, y)
        losses.append(float(l.asnumpy()))
    return state, np.array(losses)


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(want))))


def _check_like_unpipelined(opt, loss=_loss, params=None, batches=None):
    """Trains pipelined (2 stages x 2 devices) and unpipelined; returns the pipelined
    AutoParallel, its state and the first batch."""
    if params is None:
        params, batches = _data()
    ref_state, ref_losses = _train(fs.AutoParallel(loss, opt, mesh=4), params, batches)
    ap = fs.AutoParallel(loss, opt, mesh=4).pipeline(stages=2, micro_batches=2)
    state, losses = _train(ap, params, batches)
    _close(losses, ref_losses)
    for k in ref_state.params:
        _close(state.params[k].asnumpy(), ref_state.params[k].asnumpy())
    for got, want in zip(fs.tree.leaves(state.opt_state), fs.tree.leaves(ref_state.opt_state)):
        _close(np.asarray(got.asnumpy()), np.asarray(want.asnumpy()))
    return ap, state, batches[0]


def _step(ap):
    return next(iter(ap._pipeline._steps.values()))


def test_adam_updates_each_stage_on_its_own():
    params, _ = _data()
    ap, state, batch = _check_like_unpipelined(fs.optim.adam(1e-2))
    split = _step(ap).split
    assert isinstance(split, pipeline_mod.StageUpdate)
    names = sorted(params)  # (the leaves' order: b1, b2, w1, w2)
    assert [[names[i] for i in split.p_idx[s]] for s in (0, 1)] == [["b1", "w1"],
                                                                     ["b2", "w2"]]
    # each stage's program reads its two parameters' moments (Adam's mu and nu); the
    # step count is every stage's
    assert [len(split.o_idx[s]) for s in (0, 1)] == [4, 4] and len(split.o_idx[None]) == 1
    report = ap.memory_report(state, *batch)
    own = [sum(params[k].nbytes for k in ks) for ks in (("w1", "b1"), ("w2", "b2"))]
    assert report["update"] == "per_stage" and "whole_because" not in report
    assert report["stages"] == [{"params": b, "grads": b, "optimizer_state": 2 * b}
                                for b in own]
    # the most a device keeps: stage 0's state (the larger) and the step count
    assert (report["params"], report["grads"], report["optimizer_state"]) == (
        own[0], own[0], 2 * own[0] + 4)


def test_stage_programs_read_only_their_own_leaves():
    """Each stage's compiled update takes its own leaves alone: a program of stage 0
    called with stage 1's parameters would not even have their shapes."""
    ap, state, batch = _check_like_unpipelined(fs.optim.sgd(0.1, momentum=0.9))
    split = _step(ap).split
    p_leaves = fs.tree.leaves(state.params)
    for s in (0, 1):
        shapes = {tuple(p_leaves[i].shape) for i in split.p_idx[s]}
        assert shapes == ({(16, 32), (32,)} if s == 0 else {(32, 16), (16,)})


def test_split_update_runs_as_pieces(monkeypatch):
    """A step too large to compile whole calls each stage's update program."""
    monkeypatch.setattr(pipeline_mod, "FUSE_LIMIT", 0)
    ap, _, _ = _check_like_unpipelined(fs.optim.adamw(1e-2, weight_decay=0.1))
    assert not _step(ap).fused
    assert isinstance(_step(ap).split, pipeline_mod.StageUpdate)


def test_global_norm_clip_sums_the_stages_norms():
    """The clip's norm covers every stage's gradients: each stage reduces its own
    leaves (their largest magnitude, then their sum of squares) and the partial
    results combine, as a pmax and a psum over the pipeline would. Clipping by each
    stage's own norm would give other numbers than the unpipelined run."""
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.05), fs.optim.adam(1e-2))
    ap, state, batch = _check_like_unpipelined(opt)
    split = _step(ap).split
    assert isinstance(split, pipeline_mod.StageUpdate)
    assert [r.prim.name for _, r in split.reductions] == ["maximum", "add"]
    for _, r in split.reductions:  # each stage's two leaves reduced on that stage
        assert sorted(r.terms) == [0, 1] and [len(r.terms[s]) for s in (0, 1)] == [2, 2]
    report = ap.memory_report(state, *batch)
    assert report["update"] == "per_stage"
    own = sum(_data()[0][k].nbytes for k in ("w1", "b1"))
    assert report["params"] == own


def test_global_norm_clip_that_does_not_clip():
    """A norm under max_norm leaves the gradients alone, split or not."""
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1e6), fs.optim.sgd(0.1))
    ap, _, _ = _check_like_unpipelined(opt)
    assert isinstance(_step(ap).split, pipeline_mod.StageUpdate)


def test_an_optimizer_mixing_stages_otherwise_stays_whole_and_exact():
    """A hand-written update whose stage-1 updates subtract a sum of stage 0's
    gradient: not a reduction over the stages, so the update runs whole."""
    def init(params):
        return ()

    def update(grads, state, params=None):
        pull = fs.ops.reduce_sum(grads["w1"]) * 0.01
        return {k: g * -0.1 - (pull if k.endswith("2") else 0.0)
                for k, g in grads.items()}, state

    ap, state, batch = _check_like_unpipelined(fs.optim.Optimizer(init, update))
    report = ap.memory_report(state, *batch)
    assert report["update"] == "whole"
    assert "reads the gradients, parameters or state of stages [0, 1], other than by a " \
        "sum, maximum or minimum" in report["whole_because"]
    assert report["params"] == sum(x.nbytes for x in _data()[0].values())


def test_with_zero_an_update_that_does_not_split_runs_whole_and_exact():
    """hsdp level2 with the stage-mixing update: one program over every device, each
    stage's leaves split over its 2 devices, every device holding every stage's."""
    opt = pipeline_mlp.mixing_optimizer()
    params, batches = _data()
    ref_state, ref_losses = _train(fs.AutoParallel(_loss, opt, mesh=4), params, batches)
    ap = fs.AutoParallel(_loss, opt, mesh=4).hsdp(threshold=0, optimizer_level="level2")
    ap.pipeline(stages=2, micro_batches=2)
    state, losses = _train(ap, params, batches)
    _close(losses, ref_losses)
    for k in params:
        _close(state.params[k].asnumpy(), ref_state.params[k].asnumpy())
    report = ap.memory_report(state, *batches[0])
    assert report["update"] == "whole"
    total = sum(x.nbytes for x in params.values())
    assert (report["params"], report["grads"], report["optimizer_state"]) == (
        total, total // 2, total // 2)


def test_an_update_of_one_stage_from_another_stays_whole():
    """Stage 0's bias moved by stage 1's gradient (an output reading another stage)."""
    def init(params):
        return ()

    def update(grads, state, params=None):
        out = {k: g * -0.1 for k, g in grads.items()}
        out["b1"] = out["b1"] - fs.ops.reduce_sum(grads["b2"]) * 0.01
        return out, state

    ap, state, batch = _check_like_unpipelined(fs.optim.Optimizer(init, update))
    assert ap.memory_report(state, *batch)["update"] == "whole"


def test_a_state_leaf_summarising_every_gradient():
    """A state scalar no parameter owns, updated from every stage's gradients (a
    running sum of squares): a cross-stage sum that every stage holds."""
    def init(params):
        return (np.zeros((), np.float32),)

    def update(grads, state, params=None):
        sq = sum(fs.ops.reduce_sum(g * g) for g in fs.tree.leaves(grads))
        return {k: g * -0.1 for k, g in grads.items()}, (state[0] * 0.5 + sq,)

    ap, state, batch = _check_like_unpipelined(fs.optim.Optimizer(init, update))
    split = _step(ap).split
    assert isinstance(split, pipeline_mod.StageUpdate)
    assert split.o_idx[None] == [0] and len(split.reductions) == 1
    report = ap.memory_report(state, *batch)
    own = sum(_data()[0][k].nbytes for k in ("w1", "b1"))
    assert (report["update"], report["params"], report["optimizer_state"]) == (
        "per_stage", own, 4)


def test_a_stage_without_parameters_and_a_frozen_one():
    """Stage 1 computes the loss from its input alone (nothing to update); a frozen
    parameter of stage 0 stays as it was."""
    import mindspore as ms
    from mindspore import nn

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.d1 = nn.Dense(8, 8)
            self.scale = ms.Parameter(ms.Tensor(np.arange(1, 9, dtype=np.float32)),
                                      name="scale", requires_grad=False)

        def construct(self, x, y):
            h = fs.pipeline_split(self.d1(x) * self.scale)
            return ((h - y) ** 2).mean()

    rng = np.random.default_rng(1)
    x, y = (rng.normal(size=(16, 8)).astype(np.float32) for _ in range(2))
    net = Net()
    piped = fs.AutoParallel(net, fs.optim.adam(0.1), mesh=4).pipeline(stages=2,
                                                                      micro_batches=2)
    plain = fs.AutoParallel(net, fs.optim.adam(0.1), mesh=4)
    s1, s2 = piped.init(), plain.init()
    for _ in range(2):
        s1, l1 = piped(s1, x, y)
        s2, l2 = plain(s2, x, y)
    _close(l1.asnumpy(), l2.asnumpy())
    for k in s2.params:
        _close(s1.params[k].asnumpy(), s2.params[k].asnumpy())
    np.testing.assert_array_equal(s1.params["scale"].asnumpy(), np.arange(1, 9))
    report = piped.memory_report(s1, x, y)
    assert report["update"] == "per_stage"
    assert report["stages"][1] == {"params": 0, "grads": 0, "optimizer_state": 0}
    assert report["stages"][0]["params"] == (8 * 8 + 8 + 8) * 4


def test_a_non_finite_gradient_in_one_stage_skips_every_stage():
    """Loss scaling's finiteness test sums every stage's gradients: a NaN in stage 1's
    bias gradient alone must skip the step on stage 0 too."""
    def loss(p, x, y):
        h = fs.ops.relu(x @ p["w1"] + p["b1"])
        h = fs.pipeline_split(h)
        # sqrt(b2 - b2) is 0, its gradient 0 / 0: NaN in stage 1 only
        return fs.ops.softmax_cross_entropy(h @ p["w2"] + p["b2"], y) + \
            fs.ops.sqrt(p["b2"] - p["b2"]).mean()

    params, batches = _data()
    scaled = fs.amp.loss_scaled(fs.optim.adam(1e-2), fs.amp.DynamicLossScale(2.0 ** 4))
    ap, state, batch = _check_like_unpipelined(scaled, loss, params, batches)
    assert isinstance(_step(ap).split, pipeline_mod.StageUpdate)
    assert int(state.opt_state.loss_scale.skipped.asnumpy()) == STEPS
    for k in params:
        np.testing.assert_array_equal(state.params[k].asnumpy(), params[k])


@pytest.mark.full  # ~5 s: another configuration compiled
def test_gradient_accumulation_splits_by_stage():
    """multi_steps accumulates each leaf on its own; it trains as unpipelined."""
    ap, _, _ = _check_like_unpipelined(fs.optim.multi_steps(fs.optim.adam(1e-2), 2))
    assert isinstance(_step(ap).split, pipeline_mod.StageUpdate)
