"""Convolutions and pools (fshard/primitives/conv.py): MindSpore's layers and ops traced
natively, side by side with eager MindSpore (forward, and gradient against
``mindspore.grad``), under vmap (against a loop) and shard (against the unsharded
run, with the collectives each split needs), and their errors.

The primitives' rules one by one are checked by tests/test_primitive_rules.py and
tests/sharding/test_sharding_rules.py (the specs in tests/primitive_specs.py).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

import fshard as fs
import fshard.testing

rng = np.random.default_rng(0)


def _t(*shape):
    return ms.Tensor(rng.standard_normal(shape).astype(np.float32))


X = _t(2, 4, 9, 8)
X1 = _t(2, 4, 9)
W = _t(6, 4, 3, 3)
W1 = _t(6, 4, 3)
ms.set_seed(0)

#: name -> (function, input). Every configuration MindSpore's layers and ops reach.
CASES = {
    "ops.conv2d pad": (lambda x: ops.conv2d(x, W, pad_mode="pad", padding=(1, 2)), X),
    "ops.conv2d same stride 2": (lambda x: ops.conv2d(x, W, pad_mode="same", stride=2), X),
    "ops.conv2d valid dilation 2": (lambda x: ops.conv2d(x, W, dilation=2), X),
    "ops.conv1d": (lambda x: ops.conv1d(x, W1, pad_mode="pad", padding=1, stride=2), X1),
    "nn.Conv2d": (nn.Conv2d(4, 6, 3, has_bias=True), X),
    "nn.Conv2d groups stride 2": (nn.Conv2d(4, 6, 3, stride=2, group=2, has_bias=True), X),
    "nn.Conv2d depthwise": (nn.Conv2d(4, 8, 3, pad_mode="pad", padding=1, group=4), X),
    "nn.Conv1d": (nn.Conv1d(4, 6, 3, has_bias=True), X1),
    "nn.Conv2dTranspose same": (nn.Conv2dTranspose(4, 6, 3, stride=2), X),
    "nn.Conv2dTranspose valid": (nn.Conv2dTranspose(4, 6, 3, stride=2, pad_mode="valid"), X),
    "nn.Conv2dTranspose pad": (nn.Conv2dTranspose(4, 6, 3, stride=2, pad_mode="pad",
                                                  padding=1, has_bias=True), X),
    "nn.Conv2dTranspose groups": (nn.Conv2dTranspose(4, 6, 3, group=2), X),
    "ops.max_pool2d": (lambda x: ops.max_pool2d(x, 2), X),
    "ops.max_pool2d ceil_mode": (lambda x: ops.max_pool2d(x, 3, 2, padding=1, ceil_mode=True),
                                 X),
    "ops.max_pool2d indices": (lambda x: ops.max_pool2d(
        x, 3, 2, padding=1, return_indices=True)[1].astype(ms.float32) + x[:, :, :5, :4], X),
    "nn.MaxPool2d same": (nn.MaxPool2d(3, 2, pad_mode="same"), X),
    "nn.MaxPool2d valid": (nn.MaxPool2d(2, 2), X),
    "nn.MaxPool2d pad ceil_mode": (nn.MaxPool2d(3, 2, pad_mode="pad", padding=1,
                                                ceil_mode=True), X),
    "nn.AvgPool2d": (nn.AvgPool2d(2, 2), X),
    "nn.AvgPool2d same": (nn.AvgPool2d(3, 2, pad_mode="same"), X),
    "nn.AvgPool2d pad": (nn.AvgPool2d(3, 2, pad_mode="pad", padding=1), X),
    "nn.AvgPool2d pad, padding not counted": (nn.AvgPool2d(3, 2, pad_mode="pad", padding=1,
                                                           count_include_pad=False), X),
    "ops.avg_pool2d ceil_mode": (lambda x: ops.avg_pool2d(
        x, 3, 2, padding=1, count_include_pad=False, ceil_mode=True), X),
    "ops.avg_pool2d divisor_override": (lambda x: ops.avg_pool2d(x, 2, 2, divisor_override=3),
                                        X),
    "nn.AdaptiveAvgPool2d (2, 3)": (nn.AdaptiveAvgPool2d((2, 3)), X),
    "nn.AdaptiveAvgPool2d (4, 5)": (nn.AdaptiveAvgPool2d((4, 5)), X),
    "nn.AdaptiveAvgPool2d 1": (nn.AdaptiveAvgPool2d(1), X),
    "nn.AdaptiveAvgPool2d (None, 3)": (nn.AdaptiveAvgPool2d((None, 3)), X),
    "ops.adaptive_avg_pool2d of CHW": (lambda x: ops.adaptive_avg_pool2d(x[0], 3), X),
    "nn.MaxPool1d": (nn.MaxPool1d(2, 2), X1),
    "nn.AvgPool1d": (nn.AvgPool1d(3, 2), X1),
}
QUICK = ("ops.conv2d same stride 2", "nn.Conv2dTranspose pad", "nn.MaxPool2d pad ceil_mode",
         "ops.avg_pool2d ceil_mode", "nn.AdaptiveAvgPool2d (4, 5)")


def _params():
    return [pytest.param(name, marks=() if name in QUICK else pytest.mark.full)
            for name in CASES]


def _close(got, want, rtol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol,
                               atol=rtol * max(float(np.abs(want).max()), 1.0))


def _loss(f):
    return lambda x: (f(x) ** 2).sum()


def _no_generic_equation(f, x):
    """Every equation is a native fshard primitive (none carries a MindSpore op)."""
    eqs = fs.make_ir(f)(x).program.equations
    assert not [e.prim.name for e in eqs if e.prim.name == "ms_op"]


@pytest.mark.parametrize("name", _params())
def test_native_and_equal_to_mindspore(name):
    f, x = CASES[name]
    _no_generic_equation(f, x)
    _close(fs.jit(f)(x).asnumpy(), f(x).asnumpy())
    _close(fs.jit(fs.grad(_loss(f)))(x).asnumpy(), ms.grad(_loss(f))(x).asnumpy())


def test_weight_gradients_equal_mindspore():
    conv = nn.Conv2d(4, 6, 3, stride=2, group=2, has_bias=True)
    params = conv.trainable_params()
    want = ms.grad(lambda: (conv(X) ** 2).sum(), None, params)()

    def loss(w, b):
        y = ops.conv2d(X, w, stride=2, groups=2, pad_mode="same") + b.reshape(1, -1, 1, 1)
        return (y ** 2).sum()

    got = fs.jit(fs.grad(loss, argnums=(0, 1)))(params[0], params[1])
    for g, w in zip(got, want):
        _close(g.asnumpy(), w.asnumpy())


def test_forward_mode_equals_reverse_mode():
    def f(x):
        return ops.max_pool2d(ops.relu(ops.conv2d(x, W, pad_mode="pad", padding=1)), 2)

    t = _t(*X.shape)
    _, tan = fs.jvp(f, (X,), (t,))
    ct = _t(*tan.shape)
    (back,) = fs.vjp(f, X)[1](ct)
    np.testing.assert_allclose(float((tan.asnumpy() * ct.asnumpy()).sum()),
                               float((back.asnumpy() * t.asnumpy()).sum()), rtol=1e-4)


# ---------------------------------------------------------------------------
# vmap: the mapped axis folds into the batch or the channel groups (no loop)
# ---------------------------------------------------------------------------


def _vmapped_equations(f, *xs, in_axes=0):
    return [e.prim.name for e in fs.make_ir(fs.vmap(f, in_axes=in_axes))(*xs).program.equations]


def test_vmap_over_images_folds_into_the_batch():
    xs = _t(3, 2, 4, 9, 8)
    def f(x):
        return ops.avg_pool2d(ops.max_pool2d(ops.conv2d(x, W, pad_mode="same"), 2), 2)

    names = _vmapped_equations(f, xs)
    assert names.count("conv2d") == 1 and "while" not in names
    want = np.stack([f(xs[i]).asnumpy() for i in range(3)])
    _close(fs.jit(fs.vmap(f))(xs).asnumpy(), want)


def test_vmap_over_weights_folds_into_groups():
    ws = _t(3, 6, 2, 3, 3)
    f = lambda w: ops.conv2d(X, w, stride=2, groups=2)  # noqa: E731
    names = _vmapped_equations(f, ws)
    assert names.count("conv2d") == 1
    want = np.stack([f(ws[i]).asnumpy() for i in range(3)])
    _close(fs.jit(fs.vmap(f))(ws).asnumpy(), want)


def test_vmap_over_images_and_weights_at_other_axes():
    xs, ws = _t(2, 4, 9, 8, 3), _t(4, 3, 6, 3, 3)
    def f(x, w):
        return fs.ops.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1)

    got = fs.jit(fs.vmap(f, in_axes=(4, 1)))(xs, ws).asnumpy()
    want = np.stack([f(xs[..., i], ws[:, i]).asnumpy() for i in range(3)])
    _close(got, want)


def _cnn_loss(x, w):
    y = ops.relu(ops.conv2d(x[None], w, pad_mode="pad", padding=1))
    return (ops.adaptive_avg_pool2d(ops.max_pool2d(y, 2), 1) ** 2).sum()


def test_per_example_gradients_of_a_cnn_equal_a_loop():
    xs = _t(3, 4, 9, 8)
    got_x, got_w = fs.jit(fs.vmap(fs.grad(_cnn_loss, argnums=(0, 1)), in_axes=(0, None)))(xs, W)
    for i in range(3):
        want_x, want_w = ms.grad(_cnn_loss, (0, 1))(xs[i], W)
        _close(got_x[i].asnumpy(), want_x.asnumpy())
        _close(got_w[i].asnumpy(), want_w.asnumpy())


# ---------------------------------------------------------------------------
# shard: batch and output-channel splits need no communication; an input-channel
# split is a pending sum (one all_reduce); pools keep batch and channel splits
# ---------------------------------------------------------------------------


def _conv(x, w):
    return ops.conv2d(x, w, pad_mode="pad", padding=1)


@pytest.mark.parametrize("in_strategy,out,collectives", [
    (((2, 1, 1, 1), (1, 1, 1, 1)), (2, 1, 1, 1), []),  # batch
    (((1, 1, 1, 1), (2, 1, 1, 1)), (1, 2, 1, 1), []),  # output channels
    (((1, 2, 1, 1), (1, 2, 1, 1)), (1, 1, 1, 1), ["psum"]),  # input channels
], ids=["batch", "out-channels", "in-channels"])
def test_conv_shard_splits_and_their_collectives(in_strategy, out, collectives):
    part = fs.testing.check_sharding(_conv, (X, W), in_strategy, mesh=2,
                                     out_strategy=(out,), rtol=1e-5, atol=1e-5)
    assert part.collectives() == collectives


@pytest.mark.parametrize("f", [lambda x: ops.max_pool2d(x, 3, 2, padding=1),
                               lambda x: ops.avg_pool2d(x, 2, 2),
                               lambda x: ops.adaptive_avg_pool2d(x, (3, 3))],
                         ids=["max", "avg", "adaptive"])
def test_pools_keep_batch_and_channel_splits(f):
    part = fs.testing.check_sharding(f, (X,), ((2, 2, 1, 1),), mesh=4,
                                     out_strategy=((2, 2, 1, 1),))
    assert part.collectives() == []


@pytest.mark.full
def test_spatial_split_gathers_and_stays_correct():
    f = lambda x: ops.max_pool2d(_conv(x, W), 3, 1, padding=1)  # noqa: E731
    fs.testing.check_sharding(f, (X,), ((1, 1, 1, 2),), mesh=2)


def test_sharded_training_step_of_a_cnn_equals_unsharded():
    """Data parallel: the weight gradient is a pending sum over the batch split."""
    x = _t(4, 4, 9, 8)
    part = fs.testing.check_sharding(lambda x_, w: fs.grad(lambda w: _cnn_loss_batch(x_, w))(w),
                                     (x, W), ((2, 1, 1, 1), None), mesh=2, rtol=1e-4,
                                     atol=1e-4)
    assert part.collectives() == ["psum"]  # the weight gradient's, and nothing else


def _cnn_loss_batch(x, w):
    y = ops.relu(ops.conv2d(x, w, pad_mode="pad", padding=1))
    return (ops.adaptive_avg_pool2d(ops.max_pool2d(y, 2), 1) ** 2).sum()


# ---------------------------------------------------------------------------
# float64: MindSpore's CPU kernels have none; fshard computes it exactly
# ---------------------------------------------------------------------------


def test_float64_is_exact():
    x = rng.standard_normal((1, 2, 5, 5))
    w = rng.standard_normal((3, 2, 3, 3))
    got = fs.ops.conv2d(x, w, padding=1).asnumpy()
    assert got.dtype == np.float64
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.zeros((1, 3, 5, 5))
    for i in range(5):
        for j in range(5):
            want[0, :, i, j] = np.einsum("cij,ocij->o", xp[0, :, i:i + 3, j:j + 3], w)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    _close(fs.jit(lambda a: fs.ops.max_pool2d(a, 2))(x).asnumpy(),
           x[:, :, :4, :4].reshape(1, 2, 2, 2, 2, 2).max((3, 5)), 1e-12)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_channel_mismatch_names_both_shapes():
    with pytest.raises(fs.ShapeError, match=r"(?s)x has 4 channels and weight has shape "
                                            r"\(6, 3, 3, 3\).*weight.shape\[1\] must be"):
        fs.ops.conv2d(X, _t(6, 3, 3, 3))


def test_groups_must_divide_the_channels():
    with pytest.raises(fs.ShapeError, match="groups=3"):
        fs.ops.conv2d(X, _t(6, 2, 3, 3), groups=3)


def test_kernel_larger_than_the_input_is_refused():
    with pytest.raises(fs.ShapeError, match="does not fit"):
        fs.ops.conv2d(X, _t(6, 4, 11, 3))


def test_bad_padding_and_stride_are_refused():
    with pytest.raises(fs.ArgumentError, match="'same', 'valid'"):
        fs.ops.conv2d(X, W, padding="full")
    with pytest.raises(fs.ArgumentError, match="stride.*positive"):
        fs.ops.conv2d(X, W, stride=0)
    with pytest.raises(fs.ArgumentError, match="at most half the kernel"):
        fs.ops.max_pool2d(X, 2, padding=2)


def test_rank_and_dtype_are_checked():
    with pytest.raises(fs.ShapeError, match=r"(?s)\(N, C, H, W\).*x\[None\]"):
        fs.ops.conv2d(X[0], W)
    with pytest.raises(fs.ProgramTypeError, match="(?s)one dtype.*cast"):
        fs.ops.conv2d(X, W.astype(ms.float16))
    with pytest.raises(fs.ShapeError, match="float"):
        fs.ops.max_pool2d(X.astype(ms.int32), 2)


def test_conv_transpose_output_padding_must_be_below_the_stride():
    with pytest.raises(fs.ArgumentError, match="output_padding"):
        fs.ops.conv_transpose2d(X, _t(4, 6, 3, 3), stride=2, output_padding=2)

