"""Training CNNs written as MindSpore users write them, against MindSpore's own training.

- ``fs.jit(fs.value_and_grad(loss))`` with ``fs.optim.sgd(lr, momentum=0.9)`` gives the
  losses, parameters and BatchNorm moving statistics of MindSpore's GRAPH-mode
  ``nn.TrainOneStepCell(nn.WithLossCell(net, loss), nn.Momentum(...))`` from the same
  initial weights: a small Conv-BatchNorm-ReLU-MaxPool-Dense network over 20 steps in
  the quick run, mindcv's ResNet-18 (examples/train_resnet.py's model and data) in the
  full matrix (over its first 2 steps: see the note there);
- data parallelism (``fs.AutoParallel``, the batch split over a virtual mesh of 8)
  equals one device, moving statistics included: fshard's BatchNorm normalises with the
  statistics of the global batch, whatever the layout (the result of a sharded function
  equals the unsharded one's). MindSpore's own ``data_parallel`` mode instead
  normalises each device's rows with their own statistics (``nn.SyncBatchNorm``
  gives the global ones), so its losses depend on the number of devices; they are
  not compared here;
- per-example gradients ``fs.vmap(fs.grad(loss))`` (DP-SGD's) equal a loop of
  ``mindspore.grad`` calls, one example at a time.

The 2-process job is tests/distributed/test_resnet_multiprocess.py.

Tolerance: both sides compute in float32 with different summation orders (fshard's
gradient program is not MindSpore's), so losses agree to ~1e-6 relative at the first
step and the difference grows with training, as any two float32 implementations of
the same SGD do; the small CNN's losses stay within 1e-6 of MindSpore's over 20 steps.
"""

from __future__ import annotations

import os
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

import fshard as fs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import train_resnet as example  # noqa: E402

STEPS = 20

# Ops without a native rule run replicated under fs.shard, or as a loop under fs.vmap,
# and say so once (correct, slower); the tests hold on either path.
pytestmark = pytest.mark.filterwarnings("ignore::fshard.errors.GenericOpWarning")


def _close(got, want, rtol, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, what
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(float(np.abs(want).max()),
                                                                     1e-6), err_msg=what)


class SmallCNN(nn.Cell):
    """Conv-BatchNorm-ReLU-MaxPool, Conv-ReLU-AvgPool, Dense: digits (1 x 8 x 8) -> 10."""

    def __init__(self, batchnorm: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, has_bias=not batchnorm)
        self.bn = nn.BatchNorm2d(8) if batchnorm else nn.Identity()
        self.pool1 = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(8, 8, 3, has_bias=True)
        self.pool2 = nn.AvgPool2d(2, 2)
        self.fc = nn.Dense(8 * 2 * 2, 10)

    def construct(self, x):
        x = self.pool1(ops.relu(self.bn(self.conv1(x))))
        x = self.pool2(ops.relu(self.conv2(x)))
        return self.fc(x.reshape(x.shape[0], -1))


def _small(batchnorm: bool = True):
    ms.set_seed(0)
    net = SmallCNN(batchnorm)
    net.set_train(True)
    return net


def _digits(steps, batch=16):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = ((d.images - 8.0) / 8.0).astype(np.float32)[:, None]
    y = d.target.astype(np.int32)
    return [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(steps)]


def _loss_cell(net):
    return nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))


def train_mindspore(net, data, lr):
    """MindSpore's own GRAPH-mode training step; the losses (``net`` is updated)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        step = nn.TrainOneStepCell(_loss_cell(net), nn.Momentum(net.trainable_params(), lr,
                                                                0.9))
        step.set_train(True)
        return [float(step(ms.Tensor(x), ms.Tensor(y)).asnumpy()) for x, y in data]
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def train_fshard(net, data, lr):
    """``fs.jit(fs.value_and_grad(...))`` and ``fs.optim.sgd``; the losses. The trained
    parameters are written back into ``net``; its BatchNorm moving statistics (frozen
    Parameters, read by the Cell, not passed) are updated in place by every step, as
    in MindSpore."""
    apply, params = fs.functional(_loss_cell(net))
    train = {k: v for k, v in params.items() if v.requires_grad}
    opt = fs.optim.sgd(lr, momentum=0.9)

    @fs.jit
    def step(train, opt_state, x, y):
        loss, grads = fs.value_and_grad(apply)(train, x, y)
        updates, opt_state = opt.update(grads, opt_state, train)
        return fs.optim.apply_updates(train, updates), opt_state, loss

    state, losses = opt.init(train), []
    for x, y in data:
        train, state, loss = step(train, state, x, y)
        losses.append(float(loss.asnumpy()))
    assert step.trace_count == 1
    for k, v in train.items():
        params[k].set_data(v)
    return losses


def train_data_parallel(net, data, lr, mesh=8):
    """``fs.AutoParallel`` with the batch split over ``mesh`` devices; ``(losses,
    state)`` (the moving statistics are in ``state.params``)."""
    ap = fs.AutoParallel(_loss_cell(net), fs.optim.sgd(lr, momentum=0.9), mesh=mesh)
    ap.dataset_strategy("data_parallel")
    state, losses = ap.init(), []
    for x, y in data:
        state, loss = ap(state, x, y)
        losses.append(float(loss.asnumpy()))
    return losses, state


def _params(net):
    return {k: v.asnumpy() for k, v in net.parameters_and_names()}


def _same_params(got: dict, want: dict, rtol, prefix=""):
    assert sorted(got) == sorted(prefix + k for k in want)
    assert any("moving_mean" in k for k in want)
    for k, v in want.items():
        _close(got[prefix + k], v, rtol, k)


# ---------------------------------------------------------------------------
# A small CNN (quick run)
# ---------------------------------------------------------------------------

SMALL_LR = 0.1  # measured: losses within 1.1e-6 relative over 20 steps


@pytest.fixture(scope="module")
def small_runs():
    data = _digits(STEPS)
    ours, theirs = _small(), _small()
    _same_params(_params(ours), _params(theirs), 0)
    want = train_mindspore(theirs, data, SMALL_LR)
    got = train_fshard(ours, data, SMALL_LR)
    return data, (got, _params(ours)), (want, _params(theirs))


def test_small_cnn_trains_as_mindspore_train_one_step_cell(small_runs):
    _, (got, ours), (want, theirs) = small_runs
    assert np.mean(want[-5:]) < 0.9 * np.mean(want[:5])  # it trains
    _close(got, want, 1e-4, "losses")
    _same_params(ours, theirs, 1e-4)
    assert np.abs(theirs["bn.moving_mean"]).max() > 1e-3  # the statistics moved


def test_small_cnn_data_parallel_on_8_devices_equals_one_device(small_runs):
    data, (single, ours), _ = small_runs
    net = _small()
    got, state = train_data_parallel(net, data, SMALL_LR)
    _close(got, single, 1e-5, "losses")
    _same_params({k: v.asnumpy() for k, v in state.params.items()}, ours, 1e-5,
                 prefix="_backbone.")


# ---------------------------------------------------------------------------
# mindcv's ResNet-18 (full matrix: minutes on two busy cores)
# ---------------------------------------------------------------------------
# This model on these data is chaotic in float32, in MindSpore alone, and no realistic
# setting found keeps it otherwise for 20 steps. Measured: MindSpore's own
# TrainOneStepCell run against itself from trainable weights scaled by (1 + 1e-7 n),
# n ~ N(0, 1) (about one float32 rounding), relative loss difference at steps 1, 2, 3,
# 4 and the largest over 20 steps (runs are deterministic: an unperturbed repeat gives
# the same bits; load average 5-9 on the two cores):
#   32 x 32, batch 16, lr 0.002 (this setting)  5e-7 2e-4 9e-3 1e-1, 66%
#   32 x 32, batch 16, lr 0.0002                 5e-7 1e-4 6e-3 1e-2 (4 steps run)
#   32 x 32, batch 32, lr 0.002                  0    7e-4 1e-5 1e-1 (4 steps run)
#   64 x 64, batch 16, lr 0.01                   2e-7 3e-4 7e-3 4e-2, 149%
#   64 x 64, batch 16, lr 0.002                  2e-7 5e-5 7e-3 8e-2, 30%
# So larger inputs (the last stage 2 x 2 instead of 1 x 1) do not help, nor a 10x
# smaller learning rate. The jump at step 2 comes mostly from the first convolution:
# on these images (8 x 8 digits repeated into blocks of equal pixels) its gradient
# differs by 3.6e-3 of its largest value between the two runs at the first step, every
# other parameter's by at most 1.5e-5. Digits upsampled bilinearly (or with noise
# added, or random normal images) bring its difference to 1.5e-5 too, but only delay
# the divergence:
#   bilinear, 32 x 32, batch 16, lr 0.01         4e-7 4e-6 1e-2 7e-2, 90%
#   bilinear, 32 x 32, batch 16, lr 0.002        4e-7 3e-7 2e-5 6e-4, 113% (1e-2 at 5)
#   bilinear, 32 x 32, batch 16, lr 0.0005       4e-7 1e-6 9e-6 4e-4, 68%
#   bilinear, 32 x 32, batch 16, lr 0.0002       4e-7 7e-8 3e-3 2e-2, 29%
#   bilinear, 32 x 32, batch 32, lr 0.01         6e-7 7e-6 3e-3 2e-2 (6 steps run)
#   bilinear + noise 0.1, batch 16, lr 0.01      4e-7 5e-6 1e-3 3e-2 (6 steps run)
# Nor is it BatchNorm's batch statistics: with every BatchNorm frozen
# (use_batch_statistics=False: the moving statistics, as in fine-tuning),
#   32 x 32, batch 16, lr 0.002                  0    2e-7 7e-7 4e-5, 2e-2 (9e-4 at 7)
# and fshard against MindSpore there 4e-7 5e-7 2e-7 5e-5, 2e-2 (9e-4 at 7).
# (this training from random weights multiplied a difference by 15 to 2500 per step
# in these runs). fshard's losses (a different summation order, a smaller difference
# than the perturbation) stay within 1.2e-5 of MindSpore's for the first 4 steps at lr
# 0.002 (3e-7 1e-6 1e-5 1.2e-5) and then diverge as the perturbed run does (2.5e-2 at
# step 5, up to 51% over 20 steps; on the bilinear images 4e-7 4e-7 4e-6 8.5e-4, 7e-3
# at step 5), so the comparisons cover those steps (the data-parallel step sums the
# devices' partial gradients: another summation order, amplified the same way). With
# the native BatchNorm (its own summation order) step 3 was already 2.5e-2 apart on a
# fresh machine, so the comparisons cover the first 2 steps (within 1e-6 measured).

RESNET_LR, RESNET_STEPS = 0.002, 2
# The weights after those steps are not compared: the last step's gradients are
# already the amplified ones (measured: conv1.weight 6e-3 of its largest value apart,
# the BatchNorm shifts, which start at zero, up to 80% of theirs), while the losses,
# and the moving statistics, were computed before them. (The small CNN's weights are
# compared above.)


def _moving(params: dict) -> dict:
    return {k: v for k, v in params.items() if "moving_" in k}
RESNET_BATCH, RESNET_SIZE = 16, 32


@pytest.fixture(scope="module")
def resnet_runs():
    data = list(example.batches(RESNET_STEPS, RESNET_BATCH, RESNET_SIZE))
    ours, theirs = example.make_model(), example.make_model()
    _same_params(_params(ours), _params(theirs), 0)
    want = train_mindspore(theirs, data, RESNET_LR)
    got = train_fshard(ours, data, RESNET_LR)
    return data, (got, _params(ours)), (want, _params(theirs))


@pytest.mark.full
def test_resnet18_trains_as_mindspore_train_one_step_cell(resnet_runs):
    _, (got, ours), (want, theirs) = resnet_runs
    _close(got, want, 1e-4, "losses")
    _same_params(_moving(ours), _moving(theirs), 1e-3)


@pytest.mark.full
def test_resnet18_data_parallel_on_8_devices_equals_one_device(resnet_runs):
    _, (single, ours), _ = resnet_runs
    got, state = example.train(RESNET_STEPS, RESNET_BATCH, RESNET_SIZE, RESNET_LR, mesh=8)
    _close(got, single, 1e-4, "losses")
    _same_params(_moving({k: v.asnumpy() for k, v in state.params.items()}), _moving(ours),
                 1e-3, prefix="_backbone.")


# ---------------------------------------------------------------------------
# Per-example gradients (DP-SGD)
# ---------------------------------------------------------------------------


def _per_example_check(net, x, y, rtol=1e-4):
    apply, params = fs.functional(_loss_cell(net))
    train = {k: v for k, v in params.items() if v.requires_grad}

    def loss(train, x, y):  # one example
        return apply(train, x[None], y[None])

    got = fs.jit(fs.vmap(fs.grad(loss), in_axes=(None, 0, 0)))(train, x, y)
    names = list(train)
    lc = _loss_cell(net)
    weights = [dict(lc.parameters_and_names())[k] for k in names]
    for i in range(len(x)):
        want = ms.grad(lc, grad_position=None, weights=weights)(ms.Tensor(x[i:i + 1]),
                                                                ms.Tensor(y[i:i + 1]))
        for k, w in zip(names, want):
            _close(got[k].asnumpy()[i], w.asnumpy(), rtol, f"example {i}: {k}")


def test_per_example_gradients_of_a_cnn_equal_a_loop():
    net = _small(batchnorm=False)
    (x, y), = _digits(1, batch=3)
    _per_example_check(net, x, y)


@pytest.mark.full
def test_per_example_gradients_of_resnet18_in_eval_mode_equal_a_loop():
    net = example.make_model()
    net.set_train(False)  # BatchNorm with its moving statistics: per-example math
    x, y = next(example.batches(1, 4, RESNET_SIZE))
    _per_example_check(net, x, y)

