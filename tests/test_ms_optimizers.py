"""MindSpore optimizers translated to fs.optim: step for step equal to MindSpore's own
training (GRAPH-mode TrainOneStepCell with the same optimizer), and refused with an
fshard error where a setting is not translated."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs
from fshard.errors import ArgumentError
from fshard.training.parallel.ms_optimizers import from_mindspore

STEPS = 5


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1 = nn.Dense(4, 8)
        self.norm = nn.LayerNorm((8,))
        self.dense2 = nn.Dense(8, 2)

    def construct(self, x):
        return self.dense2(self.norm(self.dense1(x)).tanh())


def _nets():
    a, b = Net(), Net()
    for (_, pa), (_, pb) in zip(a.parameters_and_names(), b.parameters_and_names()):
        pb.set_data(ms.Tensor(pa.asnumpy()))
    return a, b


def _batches():
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(6, 4)).astype(np.float32),
             rng.normal(size=(6, 2)).astype(np.float32)) for _ in range(STEPS)]


def _weights(net):
    return [p for p in net.trainable_params() if "weight" in p.name or "gamma" in p.name]


def _others(net):
    ids = {id(p) for p in _weights(net)}
    return [p for p in net.trainable_params() if id(p) not in ids]


CASES = {
    "sgd": lambda n: nn.SGD(n.trainable_params(), 0.1),
    "sgd_nesterov_wd": lambda n: nn.SGD(n.trainable_params(), 0.1, momentum=0.9,
                                        nesterov=True, weight_decay=0.05),
    "momentum_groups_order": lambda n: nn.Momentum(
        [{"params": _weights(n), "weight_decay": 0.05}, {"params": _others(n), "lr": 0.02},
         {"order_params": n.trainable_params()}], learning_rate=0.1, momentum=0.9),
    "momentum_loss_scale_wd": lambda n: nn.Momentum(n.trainable_params(), 0.1, 0.9,
                                                    weight_decay=0.05, loss_scale=8.0),
    "adam_wd_piecewise": lambda n: nn.Adam(
        n.trainable_params(), nn.piecewise_constant_lr([2, 4, STEPS], [0.01, 0.005, 0.001]),
        weight_decay=0.05),
    "adam_exponential_decay": lambda n: nn.Adam(
        n.trainable_params(), nn.ExponentialDecayLR(0.01, 0.9, 2, is_stair=True)),
    "adamw_cosine_groups": lambda n: nn.AdamWeightDecay(
        [{"params": _weights(n), "weight_decay": 0.1}, {"params": _others(n)}],
        nn.CosineDecayLR(0.001, 0.01, 3)),
    "adamw_group_lr_lists": lambda n: nn.AdamWeightDecay(
        [{"params": _weights(n), "lr": [0.01, 0.02, 0.03, 0.02, 0.01]},
         {"params": _others(n)}], [0.001] * STEPS, weight_decay=0.01),
}
QUICK = ("sgd_nesterov_wd", "momentum_groups_order", "adam_wd_piecewise",
         "adamw_cosine_groups")


def _mindspore_training(net, opt, batches):
    """MindSpore's own training: GRAPH-mode TrainOneStepCell."""
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
        step.set_train()
        losses = [float(step(ms.Tensor(x), ms.Tensor(y)).asnumpy()) for x, y in batches]
    finally:
        ms.set_context(mode=mode)
    return losses, {n: p.asnumpy() for n, p in net.parameters_and_names()}


def _fshard_training(net, opt, batches):
    loss_cell = nn.WithLossCell(net, nn.MSELoss())
    apply, params = fs.functional(loss_cell)
    tx = from_mindspore(opt, params)
    values = {k: ms.Tensor(v.asnumpy()) for k, v in params.items()}
    state = tx.init(values)

    @fs.jit
    def step(values, state, x, y):
        loss, grads = fs.value_and_grad(apply)(values, x, y)
        updates, state = tx.update(grads, state, values)
        return fs.optim.apply_updates(values, updates), state, loss

    losses = []
    for x, y in batches:
        values, state, loss = step(values, state, x, y)
        losses.append(float(loss.asnumpy()))
    return losses, {k.removeprefix("_backbone."): v.asnumpy() for k, v in values.items()}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.full)
                                  for n in CASES])
def test_equals_mindspores_training_step_for_step(name):
    a, b = _nets()
    batches = _batches()
    before = {n: p.asnumpy().copy() for n, p in a.parameters_and_names()}
    want_losses, want = _mindspore_training(a, CASES[name](a), batches)
    got_losses, got = _fshard_training(b, CASES[name](b), batches)
    np.testing.assert_allclose(got_losses, want_losses, rtol=2e-5,
                               atol=2e-6 * max(abs(v) for v in want_losses))
    assert set(got) == set(want)
    for k in want:
        scale = float(np.abs(want[k]).max()) or 1.0
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6 * scale, err_msg=k)
    # the training moved every parameter (a step that updated nothing would not count)
    assert all(not np.array_equal(want[k], before[k]) for k in want)


def test_a_learning_rate_list_ends_visibly():
    """MindSpore's step raises past the end of a learning-rate list; a compiled fshard
    step cannot, so the rate there is NaN (it was the last value, silently)."""
    net = Net()
    loss_cell = nn.WithLossCell(net, nn.MSELoss())
    apply, params = fs.functional(loss_cell)
    tx = from_mindspore(nn.SGD(net.trainable_params(), [0.1, 0.2]), params)
    values = {k: ms.Tensor(v.asnumpy()) for k, v in params.items()}
    state = tx.init(values)

    @fs.jit
    def step(values, state, x, y):
        updates, state = tx.update(fs.grad(apply)(values, x, y), state, values)
        return fs.optim.apply_updates(values, updates), state

    (x, y), = _batches()[:1]
    for _ in range(2):
        values, state = step(values, state, x, y)
    assert all(np.isfinite(v.asnumpy()).all() for v in values.values())
    values, state = step(values, state, x, y)
    assert all(np.isnan(v.asnumpy()).all() for v in values.values())
