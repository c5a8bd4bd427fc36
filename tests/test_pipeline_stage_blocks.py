"""Tensor-parallel pipeline stages keep their state in blocks (a virtual mesh of 8
devices = 2 stages x (2 data-parallel x 2 tensor-parallel)): between steps each device of
a stage holds its tensor-parallel block of every parameter its ``parameter_plan`` splits,
of its gradient and of the optimizer state that copies it (Adam's moments), and the
stage's optimizer update runs on those blocks. ``memory_report`` gives the per-device
bytes of Megatron-LM's formula; the losses and parameters are those of one device (with
Adam, and with ``clip_by_global_norm`` before Adam, whose norm adds every stage's
blocks: a split leaf summed over its blocks, a replicated leaf once). An update that
does not split by stage runs whole on whole leaves, as before, and ``memory_report``
says why; a checkpoint of such a state restores it."""

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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import train_gpt as gpt  # noqa: E402

STEPS = 3
PLAN = {"w1": (1, 2), "w2": (2, 1)}  # column-split, then row-split (Megatron's MLP)


def _data():
    return pipeline_mlp.data(16, STEPS)


_loss = pipeline_mlp.loss


def _train(ap, params, batches, state=None):
    state = ap.init(params) if state is None else state
    losses = []
    for batch in batches:
        state, l = ap(state, *batch)
        losses.append(float(l.asnumpy()))
    return state, np.array(losses)


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(want))))


def _same_state(state, ref):
    for k in ref.params:
        # the stages sum a gradient in another order than one device, and Adam's
        # m / sqrt(v) enlarges that where a gradient is tiny (b1: 2.8e-7 of a largest
        # 0.03 after 4 steps of lr 1e-2, on MindSpore's fused Adam kernel)
        want = np.asarray(ref.params[k].asnumpy())
        np.testing.assert_allclose(np.asarray(state.params[k].asnumpy()), want, rtol=1e-5,
                                   atol=2e-5 * float(np.max(np.abs(want))))
    for got, want in zip(fs.tree.leaves(state.opt_state), fs.tree.leaves(ref.opt_state)):
        _close(np.asarray(got.asnumpy()), np.asarray(want.asnumpy()))


def _tp_pipeline(opt, loss=_loss, plan=PLAN):
    ap = fs.AutoParallel(loss, opt, mesh=8).parameter_plan(plan)
    return ap.pipeline(stages=2, micro_batches=2)


def _step(ap):
    return next(iter(ap._pipeline._steps.values()))


def _clip_adam():
    # max_norm well under the gradients' norm (~0.5 here): every step clips
    return fs.optim.chain(fs.optim.clip_by_global_norm(0.05), fs.optim.adam(1e-2))


@pytest.fixture(scope="module")
def mlp_reference():
    """One device: per optimizer name, the trained state and the losses."""
    params, batches = _data()
    return {name: _train(fs.AutoParallel(_loss, opt, mesh=1), params, batches)
            for name, opt in (("adam", fs.optim.adam(1e-2)), ("clip", _clip_adam()))}


def test_tp_stages_keep_state_in_blocks_and_train_as_one_device(mlp_reference):
    params, batches = _data()
    ap = _tp_pipeline(fs.optim.adam(1e-2))
    state, losses = _train(ap, params, batches)
    ref_state, ref_losses = mlp_reference["adam"]
    _close(losses, ref_losses)
    _same_state(state, ref_state)
    step = _step(ap)
    assert isinstance(step.split, pipeline_mod.StageUpdate)
    # the stage's update program takes w1's gradient, moments and value in column
    # blocks over the stage's 4 devices (2 replicas of each of the 2 blocks), b1 whole
    p_counts, g_counts, o_counts = step.zero
    assert p_counts == [None, None, (1, 2), (2, 1)] == g_counts  # (b1, b2, w1, w2)
    # the backward programs hand the gradient sums on in the same blocks (stage 0's
    # outputs: b1's and w1's sums)
    bwd = step.operator_strategies(state)["stages"][0]["chunks"][0]["backward"]
    assert [o["strategy"] for o in bwd["outputs"]] == [[1], [1, 2]]
    report = ap.memory_report(state, *batches[0])
    assert report["update"] == "per_stage" and report["stage_state"] == "blocks"
    f = 4  # float32
    stage0 = (16 * 32 // 2 + 32) * f   # w1's block, b1 whole
    stage1 = (32 * 16 // 2 + 16) * f
    assert report["stages"] == [{"params": b, "grads": b, "optimizer_state": 2 * b}
                                for b in (stage0, stage1)]
    # the most a device keeps: stage 0's, and Adam's step count (one int32)
    assert (report["params"], report["grads"], report["optimizer_state"]) == (
        stage0, stage0, 2 * stage0 + 4)


def test_tp_stages_clip_by_the_global_norm_of_the_blocks(mlp_reference):
    """The clip's global norm: each stage's partial program sums the squares of its
    blocks (a split leaf over its blocks, the replicated bias once) and the stages'
    partials add up; counting a replica twice, or a block once, gives other numbers."""
    params, batches = _data()
    ap = _tp_pipeline(_clip_adam())
    state, losses = _train(ap, params, batches)
    ref_state, ref_losses = mlp_reference["clip"]
    _close(losses, ref_losses)
    _same_state(state, ref_state)
    step = _step(ap)
    assert isinstance(step.split, pipeline_mod.StageUpdate)
    assert [r.prim.name for _, r in step.split.reductions] == ["maximum", "add"]
    report = ap.memory_report(state, *batches[0])
    assert (report["update"], report["stage_state"]) == ("per_stage", "blocks")
    assert report["params"] == (16 * 32 // 2 + 32) * 4
    # the norm's partial program of stage 0 reads w1's gradient in its column blocks
    # and sums over the stage's devices (fs.shard's collective), once per block
    partial = step.split.partials[1][0]
    strategies = [i["strategy"] for i in partial.sharded.strategies(
        partial.in_avals)["inputs"]]
    assert [1, 2] in strategies


def test_an_update_that_does_not_split_stays_whole_and_says_why(mlp_reference):
    """An update moving stage 1's weights by a sum of stage 0's gradient runs whole
    on every device, on whole leaves (as before), exact; memory_report names why."""
    opt = pipeline_mlp.mixing_optimizer()
    params, batches = _data()
    ref_state, ref_losses = _train(fs.AutoParallel(_loss, opt, mesh=1), params, batches)
    ap = _tp_pipeline(opt)
    state, losses = _train(ap, params, batches)
    _close(losses, ref_losses)
    _same_state(state, ref_state)
    assert _step(ap).zero is None
    report = ap.memory_report(state, *batches[0])
    assert report["update"] == report["stage_state"] == "whole"
    assert report["stage_state_because"].startswith(
        "the optimizer update runs whole on whole leaves: an operation (sub (at "
        "pipeline_mlp.py:")
    assert "reads the gradients, parameters or state of stages [0, 1]" in \
        report["stage_state_because"]
    total = sum(x.nbytes for x in params.values())
    assert (report["params"], report["optimizer_state"]) == (total, total)


def test_stages_without_split_counts_say_why():
    """A plan that splits nothing (every strategy whole): the stage is sharded, its
    state whole, and memory_report says why."""
    params, batches = _data()
    ap = _tp_pipeline(fs.optim.adam(1e-2), plan={"w1": (1, 1), "w2": (1, 1)})
    state, _ = _train(ap, params, batches[:1])
    report = ap.memory_report(state, *batches[0])
    assert report["stage_state"] == "whole"
    assert "no parameter has split counts in parameter_plan" in report["stage_state_because"]
    assert report["params"] == (16 * 32 + 32) * 4


def test_a_checkpoint_of_a_blocked_state_restores_it(tmp_path, mlp_reference):
    """Saved after one step, loaded into a fresh state's structure, trained on: the
    same numbers as the uninterrupted run (and as one device)."""
    params, batches = _data()
    ap = _tp_pipeline(_clip_adam())
    state, first = _train(ap, params, batches[:1])
    path = fs.checkpoint.save(str(tmp_path / "ckpt"), state, step=1)
    restored = fs.checkpoint.load(path, like=ap.init(params))
    for got, want in zip(fs.tree.leaves(restored), fs.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got.asnumpy() if hasattr(got, "asnumpy")
                                                 else got),
                                      np.asarray(want.asnumpy() if hasattr(want, "asnumpy")
                                                 else want))
    state, rest = _train(ap, params, batches[1:], restored)
    ref_state, ref_losses = mlp_reference["clip"]
    _close(np.concatenate([first, rest]), ref_losses)
    _same_state(state, ref_state)


# -- the GPT decoder (examples/train_gpt.py), Megatron's layout ----------------------

GPT_LAYERS = 2


def _gpt_ap(dp=1, tp=1, pp=1, sp=False):
    """The decoder with the embedding split by vocabulary too (Megatron's layout, so
    the per-device bytes are exactly the formula's)."""
    ap = gpt.build(dp=dp, tp=tp, pp=pp, sp=sp, layers=GPT_LAYERS)
    if tp > 1:
        ap.parameter_plan({**gpt.megatron_plan(GPT_LAYERS, tp), "embed": (tp, 1)})
    return ap


def _gpt_train(ap):
    state = ap.init(gpt.init_params(GPT_LAYERS))
    losses = []
    for tokens, targets in gpt.corpus(STEPS):
        state, loss = gpt.step(ap, state, tokens, targets)
        losses.append(loss)
    return state, np.array(losses)


@pytest.fixture(scope="module")
def gpt_reference():
    return _gpt_train(_gpt_ap())


def _formula_bytes(dp, tp, pp):
    d, f, v = gpt.DIM, gpt.FF, gpt.VOCAB
    per_layer = (4 * d * d + 3 * d * f) // tp + 2 * d   # the matrices split, the norms
    return (v * d // tp + per_layer * GPT_LAYERS // pp) * 4


# the GPT decoder in the full matrix (the quick run's MLP tests cover the blocks)
@pytest.mark.full
@pytest.mark.parametrize("sp", [False, True])
def test_gpt_dp2_tp2_pp2_state_is_the_formula_and_trains_as_one_device(sp, gpt_reference):
    ap = _gpt_ap(dp=2, tp=2, pp=2, sp=sp)
    state, losses = _gpt_train(ap)
    ref_state, ref_losses = gpt_reference
    _close(losses, ref_losses)
    # Adam divides each gradient by its own magnitude: where a gradient is near zero
    # the order of its sums moves the step by a fraction of the learning rate (3e-3);
    # measured at most 1.9e-6 after 3 steps. A wrong block would move it by ~lr.
    for k in ref_state.params:
        np.testing.assert_allclose(state.params[k].asnumpy(), ref_state.params[k].asnumpy(),
                                   rtol=1e-5, atol=3e-3 * 1e-2)
    tokens, targets = next(gpt.corpus(1))
    report = ap.memory_report(state, tokens, targets, np.ones(len(tokens), np.float32))
    assert (report["update"], report["stage_state"]) == ("per_stage", "blocks")
    want = _formula_bytes(2, 2, 2)  # stage 0: the embedding's block and one layer
    assert (report["params"], report["grads"]) == (want, want)
    assert report["optimizer_state"] == 2 * want + 4  # Adam's moments, its step count
