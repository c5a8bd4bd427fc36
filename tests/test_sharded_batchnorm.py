"""BatchNorm's moving statistics under fs.shard: written once, whole, from the global
batch statistics, into the caller's tensors; equal to the unsharded run's."""

import warnings

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs

RNG = np.random.default_rng(0)
# channels with different means, so a per-device statistic would differ
X = ms.Tensor((RNG.standard_normal((8, 4, 6, 6)) +
               np.arange(4).reshape(1, 4, 1, 1)).astype(np.float32))
X2 = ms.Tensor(RNG.standard_normal((8, 4, 6, 6)).astype(np.float32) * 2.0)


def _bn():
    ms.set_seed(0)
    bn = nn.BatchNorm2d(4, momentum=0.8)
    bn.set_train(True)
    return bn


def _stats(bn):
    return bn.moving_mean.asnumpy(), bn.moving_variance.asnumpy()


def _same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * np.abs(w).max())


@pytest.fixture(scope="module")
def unsharded():
    bn = _bn()
    f = fs.jit(lambda x: bn(x))
    ys = [f(X).asnumpy(), f(X2).asnumpy()]
    return ys, _stats(bn)


def _two_steps(g):
    return [g(X).asnumpy(), g(X2).asnumpy()]


@pytest.mark.parametrize("strategy", [(2, 1, 1, 1), (1, 2, 1, 1), (2, 1, 2, 1)])
@pytest.mark.parametrize("form", ["closure", "cell", "jit"])
def test_moving_statistics_equal_the_unsharded_run(unsharded, form, strategy):
    want_ys, want = unsharded
    bn = _bn()
    mesh = 4 if strategy == (2, 1, 2, 1) else 2
    if form == "closure":  # the Cell's Parameters are constants of the sharded function
        g = fs.shard(lambda x: bn(x), (strategy,), mesh=mesh)
    elif form == "cell":
        g = fs.shard(bn, (strategy,), mesh=mesh)
    else:
        g = fs.jit(fs.shard(bn, (strategy,), mesh=mesh))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fs.errors.GenericOpWarning)
        ys = _two_steps(g)
    _same(ys, want_ys)
    _same(_stats(bn), want)


def test_the_per_device_program_writes_nothing(unsharded):
    """The statistics are outputs, replicated: every device holds the same values; the
    one write happens after the sharded call, into the caller's tensor."""
    bn = _bn()
    g = fs.shard(lambda x: bn(x), ((2, 1, 1, 1),), mesh=2)
    text = str(fs.make_ir(g)(X))
    assert "Assign" not in text
    assert text.count("psum") >= 2  # the batch statistics are all-reduced


def test_functional_statistics_and_replicas(unsharded):
    _, want = unsharded
    apply, params = fs.functional(_bn())
    stats = {k: ms.Tensor(v.asnumpy()) for k, v in params.items()}
    g = fs.shard(apply, (None, (2, 1, 1, 1)), mesh=4)  # 2 replicas of each batch half
    g(stats, X)
    g(stats, X2)
    _same((stats["moving_mean"].asnumpy(), stats["moving_variance"].asnumpy()), want)


def test_data_parallel_training_step_updates_the_statistics_as_unsharded():
    def run(mesh):
        bn, w = _bn(), ms.Tensor(np.full((4,), 0.5, np.float32))

        def loss(w, x):
            return ((bn(x) + 1.0) ** 2 * w.reshape(1, 4, 1, 1)).sum()

        step = fs.value_and_grad(loss)
        if mesh:
            step = fs.shard(step, (None, (mesh, 1, 1, 1)), mesh=mesh)
        step = fs.jit(step)
        out = [step(w, X), step(w, X2)]
        return [(float(v.asnumpy()), g.asnumpy()) for v, g in out], _stats(bn)

    (got, got_stats), (want, want_stats) = run(2), run(None)
    for (lg, gg), (lw, gw) in zip(got, want):
        np.testing.assert_allclose(lg, lw, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gg, gw, rtol=1e-4, atol=1e-5 * np.abs(gw).max())
    _same(got_stats, want_stats)
