"""Normalisation layers, interpolation, attention and activations traced natively
(fshard/primitives/nn.py, composite.py), against eager MindSpore: the value under
``fs.jit``, the gradient under ``fs.grad`` against ``mindspore.grad``, ``fs.vmap`` against
a loop of eager calls, and ``fs.shard`` on a virtual mesh against the unsharded result,
with the collectives each split needs (a split batch all-reduces BatchNorm's statistics;
a split channel or head needs none)."""

from __future__ import annotations

import warnings

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import fshard as fs
import fshard.testing

RNG = np.random.default_rng(0)


def _t(*shape, scale=1.0, shift=0.0):
    return Tensor((RNG.standard_normal(shape) * scale + shift).astype(np.float32))


IMG = _t(4, 4, 6, 6, scale=2.0, shift=1.0)
W4, B4 = _t(4), _t(4)
MEAN4, VAR4 = _t(4), Tensor(RNG.uniform(0.5, 2.0, 4).astype(np.float32))
G6 = _t(6)

ms.set_seed(0)
_BN_EVAL = nn.BatchNorm2d(4, gamma_init="normal", beta_init="normal")
_BN_EVAL.set_train(False)
_BN_EVAL.moving_mean.set_data(MEAN4)
_BN_EVAL.moving_variance.set_data(VAR4)
_GN = nn.GroupNorm(2, 4, gamma_init="normal", beta_init="normal")
_LN = nn.LayerNorm((6, 6), begin_norm_axis=2, begin_params_axis=2, gamma_init="normal")


def _bn_train(x):  # functional: output from the batch statistics, into fresh tensors
    return ops.batch_norm(x, MEAN4 * 1, VAR4 * 1, W4, B4, training=True, momentum=0.2)


def _rms_ref(x):
    x = x.astype(np.float64)
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * G6.asnumpy()).astype(np.float32)


def _leaky_ref(x):
    return np.where(x > 0, x, 0.2 * x)


# name -> function of the (4, 4, 6, 6) image. Every one is native: no generic equation.
CASES = {
    "nn.BatchNorm2d(eval)": lambda x: _BN_EVAL(x),
    "ops.batch_norm(train)": _bn_train,
    "ops.batch_norm(eval)": lambda x: ops.batch_norm(x, MEAN4, VAR4, W4, B4),
    "nn.GroupNorm": lambda x: _GN(x),
    "ops.group_norm": lambda x: ops.group_norm(x, 4, W4, B4, 1e-3),
    "mint.group_norm": lambda x: mint.nn.functional.group_norm(x, 1),
    "nn.LayerNorm": lambda x: _LN(x),
    "ops.rms_norm": lambda x: ops.rms_norm(x, G6)[0],
    "interpolate(nearest)": lambda x: ops.interpolate(x, size=(9, 4), mode="nearest"),
    "interpolate(bilinear)": lambda x: ops.interpolate(x, size=(11, 4), mode="bilinear"),
    "interpolate(align_corners)": lambda x: ops.interpolate(x, size=(9, 13), mode="bilinear",
                                                            align_corners=True),
    "mint.interpolate(nearest)": lambda x: mint.nn.functional.interpolate(
        x, scale_factor=1.5, mode="nearest"),
    "mint.interpolate(bilinear)": lambda x: mint.nn.functional.interpolate(
        x, size=(11, 4), mode="bilinear"),
    "interpolate(linear)": lambda x: ops.interpolate(x[:, :, 0], size=11, mode="linear"),
    "interpolate(linear, 1)": lambda x: ops.interpolate(x[:, :, 0], size=1, mode="linear"),
    "interpolate(trilinear)": lambda x: ops.interpolate(x[:, None], size=(3, 7, 9),
                                                        mode="trilinear"),
    "nn.Upsample": lambda x: nn.Upsample(scale_factor=2.0, mode="nearest",
                                         recompute_scale_factor=True)(x),
    "relu6": lambda x: ops.relu6(x * 3),
    "softsign": lambda x: ops.softsign(x),
    "celu": lambda x: ops.celu(x, 1.5),
    "softshrink": lambda x: ops.softshrink(x, 0.7),
    "hardshrink": lambda x: ops.hardshrink(x, 0.7),
    "hardtanh": lambda x: ops.hardtanh(x, -0.5, 1.5),
    "fast_gelu": lambda x: ops.fast_gelu(x),
    "mint.leaky_relu": lambda x: mint.nn.functional.leaky_relu(x, 0.2),
}
# MindSpore 2.10 has no CPU kernel for these: NumPy (or the same op by another name)
REFERENCE = {
    "ops.rms_norm": _rms_ref,
    "mint.interpolate(bilinear)": lambda x: ops.interpolate(Tensor(x), size=(11, 4),
                                                            mode="bilinear").asnumpy(),
    "mint.leaky_relu": _leaky_ref,
}
QUICK = ("nn.BatchNorm2d(eval)", "ops.batch_norm(train)", "nn.GroupNorm", "ops.rms_norm",
         "interpolate(bilinear)", "mint.interpolate(nearest)", "celu")


def _params(names=CASES):
    return [pytest.param(n, marks=() if n in QUICK else pytest.mark.full) for n in names]


def _np(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def _eager(name, x):
    if name in REFERENCE:
        return REFERENCE[name](_np(x))
    return _np(CASES[name](x))


def _close(got, want, rtol=2e-5):
    got, want = _np(got), _np(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


def _prims(fn, *args):
    return {line.split("=", 1)[1].split()[0].split("[")[0]
            for line in str(fs.make_ir(fn)(*args)).splitlines() if " = " in line}


@pytest.mark.parametrize("name", _params())
def test_traces_natively(name):
    prims = _prims(CASES[name], IMG) - {"Assign"}  # the moving statistics' write
    assert all(p[0].islower() for p in prims), f"{name}: generic equations in {prims}"


@pytest.mark.parametrize("name", _params())
def test_jit_matches_eager(name):
    _close(fs.jit(CASES[name])(IMG), _eager(name, IMG))


@pytest.mark.parametrize("name", _params([n for n in CASES if n not in REFERENCE]))
def test_grad_matches_mindspore(name):
    fn = CASES[name]
    loss = lambda a: (fn(a) * ops.cos(fn(a))).sum()  # noqa: E731  (a non-constant cotangent)
    _close(fs.jit(fs.grad(loss))(IMG), ms.grad(loss)(IMG), 1e-4)


def test_grad_of_rms_norm_matches_finite_differences():
    x = _t(3, 6).asnumpy().astype(np.float64)
    g = G6.asnumpy().astype(np.float64)
    loss = fs.jit(lambda a: ops.cos(ops.rms_norm(a, Tensor(g))[0]).sum())
    got = _np(fs.grad(lambda a: ops.cos(ops.rms_norm(a, Tensor(g))[0]).sum())(Tensor(x)))
    want, eps = np.zeros_like(x), 1e-6
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = eps
        want[i] = (_np(loss(Tensor(x + e))) - _np(loss(Tensor(x - e)))) / (2 * eps)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", _params([n for n in CASES if n != "ops.batch_norm(train)"]))
def test_vmap_matches_loop(name):
    xs = Tensor(np.stack([IMG.asnumpy(), IMG.asnumpy()[::-1] * 0.5]))
    want = np.stack([_eager(name, Tensor(xs.asnumpy()[i])) for i in range(2)])
    _close(fs.vmap(CASES[name])(xs), want)


# ---------------------------------------------------------------------------
# Sharding: the statistics of a split batch are all-reduced; channels need nothing
# ---------------------------------------------------------------------------


def _collectives(part) -> list:
    return [line.split("=", 1)[1].split()[0].split("[")[0]
            for line in str(part).splitlines()[3:] if " = " in line
            if line.split("=", 1)[1].split()[0].split("[")[0] in
            ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute")]


@pytest.mark.parametrize("name,strategy,inside", [
    ("ops.batch_norm(train)", (2, 1, 1, 1), ["psum", "psum"]),  # sum and sum of squares
    ("ops.batch_norm(train)", (1, 2, 1, 1), []),
    ("nn.BatchNorm2d(eval)", (2, 2, 1, 1), []),
    ("nn.GroupNorm", (2, 2, 1, 1), []),  # 2 groups of 2 channels: a group per device
    ("fs.ops.rms_norm", (2, 2, 1, 1), []),
    ("interpolate(bilinear)", (2, 2, 1, 1), []),
])
def test_shard_matches_unsharded_with_the_needed_collectives(name, strategy, inside):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no generic op runs replicated
        fn = (lambda x: fs.ops.rms_norm(x, G6)) if name == "fs.ops.rms_norm" else CASES[name]
        part = fs.testing.check_sharding(fn, (IMG,), (strategy,), mesh=4,
                                         rtol=1e-4, atol=1e-4)
    got = _collectives(part)
    while got and got[-1] == "all_gather":  # the unsharded result is replicated at the end
        got.pop()
    assert got == inside


def test_training_batch_norm_sharded_by_batch_uses_the_global_statistics():
    # SyncBatchNorm's semantics: each device normalises its block by the statistics of
    # the whole batch (MindSpore's data-parallel BatchNorm uses each device's own)
    bn, ref = nn.BatchNorm2d(4), nn.BatchNorm2d(4)
    bn.set_train(True)
    ref.set_train(True)
    y = fs.shard(lambda x: bn(x), in_strategy=((4, 1, 1, 1),), mesh=4)(IMG)
    _close(y, ref(IMG), 1e-4)


def test_training_batch_norm_under_vmap_is_refused():
    bn = nn.BatchNorm2d(4)
    bn.set_train(True)
    xs = Tensor(np.stack([IMG.asnumpy()] * 2))
    with pytest.raises(fs.UnsupportedOpError, match=r"(?s)Assign writes into.*set_train\(False\)"):
        fs.vmap(lambda x: bn(x))(xs)
    bn.set_train(False)
    _close(fs.vmap(lambda x: bn(x))(xs), np.stack([bn(IMG).asnumpy()] * 2))


B, L, E, H = 2, 5, 8, 4


def _attention(x, wq, wk, wv):
    def heads(y):
        return y.reshape(B, L, H, E // H).transpose(0, 2, 1, 3)

    q, k, v = heads(ops.matmul(x, wq)), heads(ops.matmul(x, wk)), heads(ops.matmul(x, wv))
    return fs.ops.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_splits_by_heads_without_communication():
    args = (_t(B, L, E), _t(E, E), _t(E, E), _t(E, E))
    part = fs.testing.check_sharding(_attention, args, ((1, 1, 1), (1, 4), (1, 4), (1, 4)),
                                     mesh=4, rtol=1e-4, atol=1e-5)
    text = str(part)
    assert "f32[2,1,5,5]" in text  # each device holds the scores of its one head
    assert _collectives(part) == ["all_gather"]  # the replicated result only


def test_scaled_dot_product_attention_matches_numpy():
    q, k, v = _t(2, 3, 4, 8), _t(2, 3, 6, 8), _t(2, 3, 6, 5)
    mask = Tensor(RNG.uniform(size=(4, 6)) > 0.3)
    got = fs.jit(lambda q, k, v, m: fs.ops.scaled_dot_product_attention(q, k, v, m))(
        q, k, v, mask)
    s = np.einsum("bhld,bhsd->bhls", q.asnumpy(), k.asnumpy()) / np.sqrt(8)
    s = np.where(mask.asnumpy(), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    _close(got, np.einsum("bhls,bhse->bhle", p, v.asnumpy()), 1e-5)


@pytest.fixture(scope="module")
def mha():
    ms.set_seed(0)
    cell = nn.MultiheadAttention(8, 2, batch_first=True)
    cell.set_train(False)
    return cell


def test_multihead_attention_traces_natively(mha):
    q = _t(2, 5, 8)
    f = lambda a: mha(a, a, a)[0]  # noqa: E731
    assert all(p[0].islower() for p in _prims(f, q))
    _close(fs.jit(f)(q), f(q))
    loss = lambda a: (f(a) ** 2).sum()  # noqa: E731
    _close(fs.jit(fs.grad(loss))(q), ms.grad(loss)(q), 1e-4)
    # its (L, N*H, D) layout merges the batch as the minor factor: a batch split is
    # regathered there (correct, not communication-free)
    fs.testing.check_sharding(f, (q,), ((2, 1, 1),), mesh=2, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# BatchNorm's moving statistics: written in place, as MindSpore does
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("momentum,shape", [(0.9, (4, 4, 6, 6)), (0.7, (8, 4))])
def test_moving_statistics_follow_mindspore(momentum, shape):
    x = _t(*shape, scale=2.0, shift=1.0)
    cls = nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d
    ours, theirs = cls(4, momentum=momentum), cls(4, momentum=momentum)
    ours.set_train(True)
    theirs.set_train(True)

    def loss_ours(a):
        return (ours(a) ** 2).sum()

    def loss_theirs(a):
        return (theirs(a) ** 2).sum()

    f, g = fs.jit(fs.value_and_grad(loss_ours)), ms.jit(ms.value_and_grad(loss_theirs))
    for _ in range(3):
        (v, d), (w, e) = f(x), g(x)
        _close(v, w, 1e-4)
        _close(d, e, 1e-4)
    _close(ours.moving_mean, theirs.moving_mean, 1e-5)
    _close(ours.moving_variance, theirs.moving_variance, 1e-5)


def test_statistics_are_written_when_the_output_is_unused():
    # dead-code elimination keeps the write: the generic BatchNorm was dropped
    bn = nn.BatchNorm2d(4)
    bn.set_train(True)

    def f(x):
        bn(x)
        return x.sum()

    fs.jit(f)(IMG)
    _close(bn.moving_mean, 0.1 * IMG.asnumpy().mean((0, 2, 3)), 1e-5)


def test_functional_batch_norm_writes_the_tensors_passed():
    m, v = Tensor(MEAN4.asnumpy()), Tensor(VAR4.asnumpy())
    m2, v2 = Tensor(MEAN4.asnumpy()), Tensor(VAR4.asnumpy())
    fs.jit(lambda x, m, v: ops.batch_norm(x, m, v, W4, B4, True, 0.3))(IMG, m, v)
    ops.batch_norm(IMG, m2, v2, W4, B4, True, 0.3)
    _close(m, m2, 1e-5)
    _close(v, v2, 1e-5)


def test_fs_batch_norm_returns_the_new_statistics():
    y, m, v = fs.jit(lambda x: fs.ops.batch_norm(x, MEAN4, VAR4, training=True,
                                                 momentum=0.25))(IMG)
    x = IMG.asnumpy().astype(np.float64)
    _close(m, 0.75 * MEAN4.asnumpy() + 0.25 * x.mean((0, 2, 3)), 1e-5)
    _close(v, 0.75 * VAR4.asnumpy() + 0.25 * x.var((0, 2, 3), ddof=1), 1e-5)
    _close(MEAN4, MEAN4.asnumpy())  # the inputs are not written


# ---------------------------------------------------------------------------
# Misuse
# ---------------------------------------------------------------------------


def test_group_norm_refuses_groups_that_do_not_divide_the_channels():
    with pytest.raises(fs.ShapeError, match=r"(?s)num_groups=3.*4 channels.*Fix"):
        fs.ops.group_norm(IMG, 3)


def test_batch_norm_refuses_statistics_of_the_wrong_size():
    with pytest.raises(fs.ShapeError, match=r"running_var=\.\.\.\) must have shape \(4,\)"):
        fs.ops.batch_norm(IMG, MEAN4, _t(3))


def test_interpolate_refuses_an_unknown_mode():
    with pytest.raises(fs.ProgramTypeError, match=r"(?s)mode=.area.*Fix"):
        fs.ops.interpolate(IMG, (3, 3), "area")


# ---------------------------------------------------------------------------
# Training-mode BatchNorm on MindSpore's fused kernels (float32): BatchNorm forward,
# BatchNormGrad backward; every transform against the decomposition and MindSpore
# ---------------------------------------------------------------------------

DY = _t(4, 4, 6, 6)


def _bn_loss(x, w, b):
    y, _, _ = fs.ops.batch_norm(x, MEAN4, VAR4, w, b, training=True)
    return (y * ops.cos(y) * DY).sum()


def _f64(*xs):
    return tuple(Tensor(_np(x).astype(np.float64)) for x in xs)


def _bn_loss64(x, w, b):  # float64: the decomposition into reductions and elementwise ops
    m, v = _f64(MEAN4, VAR4)
    y, _, _ = fs.ops.batch_norm(x, m, v, w, b, training=True)
    return (y * ops.cos(y) * Tensor(_np(DY).astype(np.float64))).sum()


def test_training_batch_norm_runs_the_fused_kernels():
    text = str(fs.make_ir(fs.grad(_bn_loss, argnums=(0, 1, 2)))(IMG, W4, B4))
    assert "batch_norm_train" in text and "batch_norm_grad" in text
    assert "axes=(0, 2, 3)" not in text  # no statistic is computed outside the kernels
    lowered = fs.jit(fs.grad(_bn_loss, argnums=(0, 1, 2))).lower(IMG, W4, B4).as_text()
    assert "= ms_bn_train_" in lowered and "= ms_bn_grad_" in lowered  # the kernels (float32)


def test_training_batch_norm_gradients_match_mindspore_cell():
    ms.set_seed(0)
    ours = nn.BatchNorm2d(4, gamma_init="normal", beta_init="normal", momentum=0.8)
    theirs = nn.BatchNorm2d(4, momentum=0.8)
    theirs.gamma.set_data(ours.gamma.value() * 1)
    theirs.beta.set_data(ours.beta.value() * 1)
    ours.set_train(True)
    theirs.set_train(True)
    apply, params = fs.functional(ours)
    train = {k: v for k, v in params.items() if v.requires_grad}

    def loss(p, x):
        y = apply(p, x)
        return (y * ops.cos(y) * DY).sum()

    def their_loss(x):
        y = theirs(x)
        return (y * ops.cos(y) * DY).sum()

    grads = fs.jit(fs.grad(loss, argnums=(0, 1)))(train, IMG)
    want = ms.grad(their_loss, grad_position=0, weights=theirs.trainable_params())(IMG)
    got = {k.split(".")[-1]: v for k, v in grads[0].items()}
    _close(grads[1], want[0], 1e-4)
    _close(got["gamma"], want[1][0], 1e-4)
    _close(got["beta"], want[1][1], 1e-4)
    # the moving statistics, from the fused kernel's batch statistics (one step each)
    _close(ours.moving_mean, theirs.moving_mean, 1e-5)
    _close(ours.moving_variance, theirs.moving_variance, 1e-5)


def test_fused_batch_norm_matches_the_decomposition():
    got = fs.jit(fs.value_and_grad(_bn_loss, argnums=(0, 1, 2)))(IMG, W4, B4)
    want = fs.value_and_grad(_bn_loss64, argnums=(0, 1, 2))(*_f64(IMG, W4, B4))
    _close(got[0], want[0], 1e-4)
    for g, w in zip(got[1], want[1]):
        _close(g, w, 1e-4)
    y, m, v = fs.jit(lambda x: fs.ops.batch_norm(x, MEAN4, VAR4, W4, B4, True, 0.3))(IMG)
    y2, m2, v2 = fs.ops.batch_norm(*_f64(IMG, MEAN4, VAR4, W4, B4), True, 0.3)
    for a, b in ((y, y2), (m, m2), (v, v2)):
        _close(a, b, 1e-5)


def test_fused_batch_norm_second_order_matches_the_decomposition():
    t = _t(4, 4, 6, 6)

    def hvp(loss, x, w, b, t):  # reverse over reverse, and forward over reverse
        g = lambda a: fs.grad(loss)(a, w, b)  # noqa: E731
        rev = fs.grad(lambda a: (g(a) * t).sum())(x)
        return rev, fs.jvp(g, (x,), (t,))[1]

    got = fs.jit(lambda x, t: hvp(_bn_loss, x, W4, B4, t))(IMG, t)
    want = hvp(_bn_loss64, *_f64(IMG, W4, B4, t))
    for g, w in zip(got, want):
        _close(g, w, 1e-3)
    # forward mode of the primitive itself
    tan = fs.jvp(lambda x: _bn_loss(x, W4, B4), (IMG,), (t,))[1]
    tan64 = fs.jvp(lambda x: _bn_loss64(x, *_f64(W4, B4)), _f64(IMG), _f64(t))[1]
    _close(tan, tan64, 1e-4)


def test_fused_batch_norm_under_vmap_uses_each_examples_statistics():
    xs = Tensor(np.stack([IMG.asnumpy(), IMG.asnumpy()[::-1] * 0.5 + 1.0]))
    f = lambda x: fs.ops.batch_norm(x, MEAN4, VAR4, W4, B4, training=True)  # noqa: E731
    got = fs.jit(fs.vmap(f))(xs)
    per_example = fs.jit(fs.vmap(fs.grad(_bn_loss, argnums=(0, 1)), in_axes=(0, None, None)))(
        xs, W4, B4)
    for i in range(2):
        x = Tensor(xs.asnumpy()[i])
        for a, b in zip(got, fs.ops.batch_norm(*_f64(x, MEAN4, VAR4, W4, B4), training=True)):
            _close(_np(a)[i], b, 1e-5)
        for a, b in zip(per_example, fs.grad(_bn_loss64, argnums=(0, 1))(*_f64(x, W4, B4))):
            _close(_np(a)[i], b, 1e-4)


@pytest.mark.parametrize("strategy,psums", [((2, 1, 1, 1), True), ((1, 2, 1, 1), False)])
def test_fused_batch_norm_gradient_under_shard(strategy, psums):
    # the plan expands the fused primitives: a batch split all-reduces the statistics
    # and their gradient's sums (SyncBatchNorm); a channel split needs nothing
    g = fs.grad(_bn_loss, argnums=(0, 1, 2))
    part = fs.testing.check_sharding(g, (IMG, W4, B4), (strategy, None, None), mesh=2,
                                     rtol=1e-4, atol=1e-4)
    assert ("psum" in _collectives(part)) == psums
    assert "batch_norm" not in str(part)


def test_fused_batch_norm_sharding_rule_splits_channels_only():
    from fshard.primitives.nn import batch_norm_grad_p, batch_norm_train_p

    for prim in (batch_norm_train_p, batch_norm_grad_p):
        spec = fs.rules.sharding.lookup(prim, transform="test")(
            *[fs.core.tracing.typeof(a) for a in (IMG, W4, MEAN4, VAR4, IMG)][
                :3 if prim is batch_norm_train_p else 5], eps=1e-5)
        assert spec.splittable() == ["c"]


def test_fused_batch_norm_stays_float32_under_amp_o2():
    # MindSpore's O2 keeps BatchNorm in float32 (its black list): so does fs.amp
    f = fs.amp.autocast(lambda x: (fs.ops.batch_norm(x, MEAN4, VAR4, W4, B4, True)[0] ** 2)
                        .sum(), "O2")
    text = str(fs.make_ir(fs.grad(f))(IMG))
    eqs = [line for line in text.splitlines() if "batch_norm_" in line]
    assert eqs and all("f16" not in line for line in eqs), eqs
