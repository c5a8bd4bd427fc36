"""fs.Model: MindSpore's Model.train driving fshard's AutoParallel step, with
MindSpore's own callbacks and output, equal to MindSpore's Model training."""

from __future__ import annotations

import re

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
import pytest
from mindspore import nn
from mindspore.train import LossMonitor
from mindspore.train import Model as MsModel

import fshard as fs
from fshard.errors import ArgumentError


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.layer1 = nn.Dense(16, 32)
        self.relu = nn.ReLU()
        self.layer2 = nn.Dense(32, 10)

    def construct(self, x):
        return self.layer2(self.relu(self.layer1(self.flatten(x))))


def _nets():
    a, b = Net(), Net()
    for (_, pa), (_, pb) in zip(a.parameters_and_names(), b.parameters_and_names()):
        pb.set_data(ms.Tensor(pa.asnumpy()))
    return a, b


def _dataset():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4, 4)).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int32)
    return ds.NumpySlicesDataset({"image": x, "label": y}, shuffle=False).batch(8)


def _losses(text: str) -> list:
    return [(int(e), int(s), float(v)) for e, s, v in
            re.findall(r"epoch: (\d+) step: (\d+), loss is ([-0-9.e]+)", text)]


@pytest.fixture
def graph_mode():
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=mode)


def _train_both(capsys, make_loss, make_opt, make_network, epochs=2, **kwargs):
    a, b = _nets()
    MsModel(a, make_loss(), make_opt(a), **kwargs).train(epochs, _dataset(),
                                                         callbacks=[LossMonitor(1)])
    want = _losses(capsys.readouterr().out)
    model = fs.Model(network=make_network(b), loss_fn=make_loss(), optimizer=make_opt(b),
                     **kwargs)
    model.train(epochs, _dataset(), callbacks=[LossMonitor(1)], dataset_sink_mode=False)
    got = _losses(capsys.readouterr().out)
    assert [g[:2] for g in got] == [w[:2] for w in want] and len(want) == 4 * epochs
    np.testing.assert_allclose([g[2] for g in got], [w[2] for w in want], rtol=2e-5)
    for (n, pa), (_, pb) in zip(a.parameters_and_names(), b.parameters_and_names()):
        scale = float(np.abs(pa.asnumpy()).max())
        np.testing.assert_allclose(pb.asnumpy(), pa.asnumpy(), rtol=2e-5, atol=2e-6 * scale,
                                   err_msg=n)
    return model, a, b


def test_model_train_of_an_autoparallel_equals_mindspores_model(capsys, graph_mode):
    """The seed's form: AutoParallel without an optimizer, the optimizer and the loss
    given to Model; LossMonitor prints MindSpore's lines with MindSpore's numbers, and
    the trained values are in the Cell's Parameters afterwards."""
    model, a, b = _train_both(
        capsys, lambda: nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
        lambda n: nn.Momentum(n.trainable_params(), 0.1, 0.9, weight_decay=0.01),
        lambda n: fs.AutoParallel(n, parallel_mode="semi_auto", mesh=2))
    # Model.eval runs MindSpore's evaluation on the trained Parameters
    data = _dataset()
    want = MsModel(a, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
                   metrics={"loss"}).eval(data)
    model2 = fs.Model(fs.AutoParallel(b, "semi_auto", mesh=2),
                      nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
                      nn.SGD(b.trainable_params(), 0.1), metrics={"loss"})
    got = model2.eval(_dataset())
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-5)


def test_a_loss_with_reduction_none_trains_on_its_sum_as_mindspore_does(capsys, graph_mode):
    """Seed 003's loss, SoftmaxCrossEntropyWithLogits(True) (reduction "none"): MindSpore's
    TrainOneStepCell differentiates the sum of the per-example losses; LossMonitor
    prints their mean. A plain Cell given to fs.Model trains as MindSpore's Model."""
    _train_both(capsys, lambda: nn.SoftmaxCrossEntropyWithLogits(True),
                lambda n: nn.SGD(n.trainable_params(), 1e-2), lambda n: n)


@pytest.mark.full  # the same path as the tests above, twice
def test_the_optimizer_state_carries_over_between_train_calls(capsys, graph_mode):
    a, b = _nets()
    MsModel(a, nn.MSELoss(), nn.Adam(a.trainable_params(), 1e-2)).train(
        2, _regression(), callbacks=[LossMonitor(1)])
    want = _losses(capsys.readouterr().out)
    model = fs.Model(fs.AutoParallel(b, mesh=2), nn.MSELoss(),
                     nn.Adam(b.trainable_params(), 1e-2))
    model.train(1, _regression(), callbacks=[LossMonitor(1)])
    model.train(2, _regression(), callbacks=[LossMonitor(1)], initial_epoch=1)
    got = _losses(capsys.readouterr().out)
    np.testing.assert_allclose([g[2] for g in got], [w[2] for w in want], rtol=2e-5)


def _regression():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 16)).astype(np.float32)
    y = rng.normal(size=(16, 10)).astype(np.float32)
    return ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(8)


def test_autoparallel_without_an_optimizer_is_refused_when_it_would_train():
    ap = fs.AutoParallel(Net(), parallel_mode="semi_auto", mesh=2)
    with pytest.raises(ArgumentError, match="(?s)has no optimizer.*fs.Model"):
        ap.init()
    with pytest.raises(ArgumentError, match="a MindSpore optimizer updates a Cell"):
        fs.AutoParallel(lambda p, x: (p["w"] * x).sum(), nn.SGD(Net().trainable_params()))


def test_model_refusals_name_the_argument_and_the_fix():
    net = Net()
    opt = nn.SGD(net.trainable_params(), 0.1)
    with pytest.raises(ArgumentError, match=r"(?s)amp_level='O2'.*Fix: amp_level='O0'"):
        fs.Model(net, nn.MSELoss(), opt, amp_level="O2")
    with pytest.raises(ArgumentError, match="must be an fs.AutoParallel or an nn.Cell"):
        fs.Model(lambda x: x, nn.MSELoss(), opt)
    with pytest.raises(ArgumentError, match="has no optimizer"):
        fs.Model(fs.AutoParallel(net, mesh=2), nn.MSELoss())
    manager = ms.amp.DynamicLossScaleManager()
    with pytest.raises(ArgumentError, match="only FixedLossScaleManager"):
        fs.Model(net, nn.MSELoss(), opt, loss_scale_manager=manager)


@pytest.mark.parametrize("make, match", [
    (lambda p: nn.SGD(p, 0.1, momentum=0.9, dampening=0.1), r"nn.SGD: dampening=0.1"),
    (lambda p: nn.Adam(p, 1e-3, use_amsgrad=True), r"nn.Adam: use_amsgrad=True"),
    (lambda p: nn.Adam(p, 1e-3, use_nesterov=True), r"nn.Adam: use_nesterov=True"),
    (lambda p: nn.Lamb(p, 1e-3), r"mindspore.nn.optim.lamb.Lamb is not one fshard"),
    (lambda p: nn.SGD([{"params": p, "grad_centralization": True}], 0.1),
     "'grad_centralization': True"),
    (lambda p: nn.Adam(p, 1e-3, weight_decay=nn.ExponentialDecayLR(0.1, 0.9, 1)),
     "weight_decay given as a Cell"),
])
def test_untranslated_mindspore_optimizer_settings_are_refused(make, match):
    net = Net()
    with pytest.raises(ArgumentError, match=match):
        fs.AutoParallel(net, make(net.trainable_params()), mesh=2)


def test_an_optimizer_that_has_taken_steps_or_holds_other_parameters_is_refused():
    net = Net()
    opt = nn.SGD(net.trainable_params(), 0.1)
    opt.global_step.set_data(ms.Tensor(np.array([3], np.int32)))
    with pytest.raises(ArgumentError, match="already taken 3 steps"):
        fs.AutoParallel(net, opt, mesh=2)
    with pytest.raises(ArgumentError, match="not the network's"):
        fs.AutoParallel(net, nn.SGD(Net().trainable_params(), 0.1), mesh=2)


def test_the_autoparallels_own_mindspore_optimizer_follows_the_loss_model_adds(capsys):
    """An AutoParallel made with a MindSpore optimizer, given a loss by Model: the
    parameters are renamed (WithLossCell's '_backbone.'), the optimizer still applies."""
    net = Net()
    before = net.layer1.weight.asnumpy().copy()
    ap = fs.AutoParallel(net, nn.SGD(net.trainable_params(), 0.1), mesh=2)
    fs.Model(ap, nn.SoftmaxCrossEntropyWithLogits(True, "mean")).train(1, _dataset())
    assert not np.array_equal(net.layer1.weight.asnumpy(), before)


def test_a_loss_scale_manager_needs_a_mindspore_optimizer():
    net = Net()
    manager = ms.amp.FixedLossScaleManager(8.0, drop_overflow_update=False)
    with pytest.raises(ArgumentError, match="needs a MindSpore optimizer"):
        fs.Model(fs.AutoParallel(net, fs.optim.sgd(0.1), mesh=2), nn.MSELoss(),
                 loss_scale_manager=manager)


@pytest.mark.full  # the same path as the quick tests, with a loss scale
def test_a_fixed_loss_scale_manager_trains_as_mindspores(capsys, graph_mode):
    _train_both(capsys, lambda: nn.SoftmaxCrossEntropyWithLogits(True, "mean"),
                lambda n: nn.Momentum(n.trainable_params(), 0.1, 0.9, loss_scale=8.0),
                lambda n: fs.AutoParallel(n, mesh=2),
                loss_scale_manager=ms.amp.FixedLossScaleManager(8.0, False))


def test_parameters_made_under_no_init_parameters_are_initialised():
    """Seed 001 builds its network under no_init_parameters() and the optimizer over
    it: MindSpore's optimizer clears the pending values (a raw MindSpore TypeError
    before); the step initialises them from their initializers."""
    from mindspore.nn.utils import no_init_parameters

    with no_init_parameters():
        net = Net()
    opt = nn.SGD(net.trainable_params(), 0.1)
    ap = fs.AutoParallel(net, opt, mesh=2)
    state = ap.init()
    w = state.params["layer1.weight"].asnumpy()
    assert w.shape == (32, 16) and np.isfinite(w).all() and np.abs(w).max() > 0
    assert not net.layer1.weight.has_init
    np.testing.assert_array_equal(net.layer1.weight.asnumpy(), w)


def test_model_stops_at_the_end_of_a_learning_rate_list_as_mindspore_does():
    net = Net()
    model = fs.Model(fs.AutoParallel(net, mesh=2), nn.SoftmaxCrossEntropyWithLogits(True),
                     nn.SGD(net.trainable_params(), [0.1, 0.1, 0.05]))
    with pytest.raises(ArgumentError, match=r"(?s)step 4 is past the end of the "
                       r"learning-rate list of nn.SGD, which covers 3 steps.*Fix"):
        model.train(1, _dataset())
