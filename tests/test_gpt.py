"""The GPT decoder of examples/train_gpt.py (Llama blocks, tied embedding and head)
trained with data, tensor, pipeline and sequence parallelism, recomputation and float16
with dynamic loss scaling: its losses equal one device's float32 training.

Tolerances. In float32 a parallel run differs from one device only by the order of its
sums: rtol 1e-5. With float16 compute (fs.amp O2) each operation rounds to float16's
11-bit significand, a relative error of up to 2**-11 = 4.9e-4 per operation; the loss
sums many such roundings (which mostly cancel) and Adam's steps carry them on. The
check is rtol 5e-3 (about ten float16 half-units), against float32 losses that fall by
a third over the steps compared: a precision bug (an overflow, a skipped or unscaled
step, a wrong scale) moves a loss by far more. Measured: at most 3e-4 over 3 steps.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import fshard as fs
from fshard import launch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import train_gpt as gpt  # noqa: E402

STEPS, LAYERS = 3, 2
FP32_RTOL, FP16_RTOL = 1e-5, 5e-3


@pytest.fixture(scope="module")
def single_device():
    """One device, float32, no recomputation: the reference losses."""
    losses, skipped = gpt.train(STEPS, layers=LAYERS)
    assert skipped == 0
    assert losses[-1] < 0.8 * losses[0]  # it trains
    return losses


def _check(losses, skipped, reference, rtol):
    assert skipped == 0
    np.testing.assert_allclose(losses, reference, rtol=rtol)


def test_gpt_pipeline_float16_equals_one_device(single_device):
    """2 virtual devices, a pipeline of two stages (the tied embedding handed from the
    first stage to the last), float16 with loss scaling. The full matrix adds data,
    tensor and sequence parallelism and recomputation on 8 devices and in a job."""
    losses, skipped = gpt.train(STEPS, layers=LAYERS, pp=2, amp=True)
    _check(losses, skipped, single_device, FP16_RTOL)
    assert not np.allclose(losses, single_device, rtol=1e-7)  # float16 did run


def test_tied_weight_through_a_stage_marker_gets_both_gradients():
    """A parameter handed to fs.pipeline_split belongs to the stage before the marker;
    its gradient sums its use there and its use after the marker (a parameter used in
    two stages was refused)."""
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(6, 6)).astype(np.float32),
              "v": rng.normal(size=(6, 6)).astype(np.float32)}
    x = rng.normal(size=(8, 6)).astype(np.float32)

    def loss(p, x):
        h = fs.ops.tanh(x @ p["w"])
        h, w = fs.pipeline_split((h, p["w"]))
        return fs.ops.mean((fs.ops.tanh(h @ p["v"]) @ fs.ops.swapaxes(w, 0, 1)) ** 2)

    want = fs.value_and_grad(loss)(params, x)
    ap = fs.AutoParallel(loss, fs.optim.sgd(1.0), mesh=2).pipeline(stages=2,
                                                                 micro_batches=2)
    state = ap.init(params)
    state, got = ap(state, x)
    np.testing.assert_allclose(float(got), float(want[0]), rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(state.params[k].asnumpy(),
                                   params[k] - want[1][k].asnumpy(), rtol=1e-5, atol=1e-6)


def test_tp_sp_splits_the_sequence_between_the_blocks():
    """With sp the norms run on a block of the sequence: the per-device program holds
    the residual stream as [batch, seq / tp, dim] and all-gathers it before the
    column-parallel matmuls."""
    ap = gpt.build(tp=2, sp=True, layers=1)
    state = ap.init(gpt.init_params(1))
    tokens, targets = next(gpt.corpus(1))
    part = ap.partitioned(state, tokens, targets, np.ones(len(tokens), np.float32))
    text = str(part)
    assert f"f32[{gpt.BATCH},{gpt.SEQ // 2},1]{{(1, 2, 1)}} = rsqrt" in text
    assert "all_gather" in part.collectives()


def test_dp2_tp4_sp_keeps_gradients_split_as_the_parameters():
    """On 8 devices (mesh axes 2 x 2 x 2) the column- and row-split weights must share
    the tp devices, away from the batch's dp axis: placed on the batch's axis, the plan
    gathered every weight's gradient whole before the update (the model's size per
    device where the parameters are a quarter of it)."""
    ap = gpt.build(dp=2, tp=4, sp=True, layers=1)
    state = ap.init(gpt.init_params(1))
    tokens, targets = next(gpt.corpus(1))
    batch = (tokens, targets, np.ones(len(tokens), np.float32))
    report = ap.memory_report(state, *batch)
    assert report["grads"] == report["params"]
    whole = sum(v.nbytes for v in gpt.init_params(1).values())
    assert report["params"] < 0.5 * whole
    part = ap.partitioned(state, *batch)
    mesh = part.prop.mesh
    s, _ = ap.sharded(state, *batch)
    params = _arg_layouts(ap, part, state, batch)
    names = sorted(gpt.init_params(1))
    for name, g in zip(names, s.grad_vars):
        layout = part.prop.shardings[g]
        assert layout.dims == params[name].dims, name
        if name.split(".")[-1] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            assert sorted(layout.strategy(mesh)) == [1, 4], name
    # the tp axes are not the batch's
    tp_axes = {a for d in params["layer0.wq"].dims for a in d}
    dp_axes = set(_arg_layouts(ap, part, state, batch, inputs=True)[0].dims[0])
    assert tp_axes and dp_axes and not tp_axes & dp_axes


def _arg_layouts(ap, part, state, batch, inputs=False):
    """The layouts the step takes the parameters in, by name (or, with ``inputs``, the
    batch's)."""
    from fshard.training.parallel.auto_parallel import _arg_shardings

    shs = _arg_shardings(part, (state, batch))
    if inputs:
        return shs[-len(batch):]
    return dict(zip(sorted(state.params), shs))


@pytest.mark.full
@pytest.mark.parametrize("config", [
    dict(dp=2, tp=2, pp=2, sp=True, amp=True, remat=True),
    dict(dp=2, tp=2, pp=2),
    dict(dp=2, tp=4, sp=True, amp=True, remat=True),
], ids=["dp2_tp2_pp2_sp_fp16_remat", "dp2_tp2_pp2_fp32", "dp2_tp4_sp_fp16_remat"])
def test_gpt_on_8_devices_equals_one_device(single_device, config):
    losses, skipped = gpt.train(STEPS, layers=LAYERS, **config)
    _check(losses, skipped, single_device, FP16_RTOL if config.get("amp") else FP32_RTOL)


@pytest.mark.full
def test_gpt_in_a_4_process_job_equals_one_device(single_device, tmp_path):
    sys.path.insert(0, os.path.join(HERE, "distributed"))
    import gpt_checks

    result = launch.run(os.path.join(HERE, "distributed", "gpt_checks.py"), 4,
                        [str(tmp_path)], timeout=1200)
    assert result.ok, result.message + "\n" + "\n".join(
        result.output(r)[-3000:] for r in result.failed_ranks or range(4))
    assert (gpt_checks.STEPS, gpt_checks.LAYERS) == (STEPS, LAYERS)
    for r in range(4):
        with open(tmp_path / f"rank{r}.json") as fh:
            ranks = json.load(fh)
        assert set(ranks["configs"]) == set(gpt_checks.CONFIGS)
        for name, got in ranks["configs"].items():
            _check(got["losses"], got["skipped"], single_device, FP16_RTOL)
