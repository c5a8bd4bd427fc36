"""The per-call path of ``fs.AutoParallel``: a call with the structure, shapes and
dtypes of an earlier one, under the same MindSpore context and mesh, runs that call's
compiled step from one lookup (no planning-cache key, one context read, no retrace);
anything that could change the plan (new shapes, the context, the mesh, the
configuration) takes the full path again, with its checks.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

import fshard as fs
from fshard.training.parallel import auto_parallel as ap_module


def loss(p, x, y):
    return fs.ops.softmax_cross_entropy(x @ p["w"] + p["b"], y)


def data(rows=16, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": (rng.standard_normal((8, 4)) * 0.1).astype(np.float32),
              "b": np.zeros(4, np.float32)}
    return (params, ms.Tensor(rng.standard_normal((rows, 8)).astype(np.float32)),
            ms.Tensor(rng.integers(0, 4, rows).astype(np.int32)))


@pytest.fixture(scope="module")
def trained():
    """An AutoParallel on 4 virtual devices after one step (its step compiled)."""
    params, x, y = data()
    ap = fs.AutoParallel(loss, fs.optim.adam(1e-2), mesh=4)
    ap.dataset_strategy("data_parallel")
    state = ap.init(params)
    state, _ = ap(state, x, y)
    return ap, state, x, y


class Counter:
    """Wraps ``name`` of ``obj`` to count its calls."""

    def __init__(self, monkeypatch, obj, name):
        self.n = 0
        inner = getattr(obj, name)

        def counted(*a, **k):
            self.n += 1
            return inner(*a, **k)

        monkeypatch.setattr(obj, name, counted)


def test_a_repeated_call_takes_the_hot_path(trained, monkeypatch):
    ap, state, x, y = trained
    sharded = Counter(monkeypatch, ap_module.AutoParallel, "_sharded")
    in_job = Counter(monkeypatch, ap_module.AutoParallel, "_in_job")
    settings = Counter(monkeypatch, ap_module, "auto_parallel_settings")
    _, step = ap._sharded(state, (x, y))
    sharded.n = 0
    traces = step.trace_count
    for _ in range(3):
        state, value = ap(state, x, y)
    assert (sharded.n, in_job.n) == (0, 0)  # no planning-cache key, no mesh read
    assert settings.n == 3  # the context read once per call
    assert step.trace_count == traces


def test_the_hot_path_steps_like_the_full_path(trained):
    ap, state, x, y = trained
    hot = ap(state, x, y)
    ap._calls.clear()  # the full path, the same step
    full = ap(state, x, y)
    np.testing.assert_array_equal(hot[1].asnumpy(), full[1].asnumpy())
    for a, b in zip(fs.tree.leaves(hot[0]), fs.tree.leaves(full[0])):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def test_new_shapes_take_the_full_path(trained, monkeypatch):
    ap, state, x, y = trained
    sharded = Counter(monkeypatch, ap_module.AutoParallel, "_sharded")
    _, x8, y8 = data(rows=8, seed=1)
    _, value = ap(state, x8, y8)
    assert sharded.n == 1
    ref = fs.ops.softmax_cross_entropy(x8 @ state.params["w"] + state.params["b"], y8)
    np.testing.assert_allclose(value.asnumpy(), ref.asnumpy(), rtol=1e-5, atol=1e-6)
    # a batch the plan cannot split evenly is still refused on a later call
    _, x6, y6 = data(rows=6, seed=2)
    ap(state, x, y)
    with pytest.raises(fs.FshardError):
        ap(state, x6, y6)


def test_a_changed_context_is_checked_again(trained):
    ap, state, x, y = trained
    ap(state, x, y)
    ms.set_auto_parallel_context(parallel_mode="hybrid_parallel")
    try:
        with pytest.raises(fs.ArgumentError, match="hybrid_parallel"):
            ap(state, x, y)
    finally:
        ms.reset_auto_parallel_context()
    ap(state, x, y)


def test_a_changed_configuration_plans_again(monkeypatch):
    params, x, y = data()
    ap = fs.AutoParallel(loss, fs.optim.adam(1e-2), mesh=4)
    ap.dataset_strategy("data_parallel")
    state = ap.init(params)
    state, _ = ap(state, x, y)
    sharded = Counter(monkeypatch, ap_module.AutoParallel, "_sharded")
    ap.dataset_strategy("full_batch")
    assert ap._calls == {}
    state, value = ap(state, x, y)
    assert sharded.n == 1
    assert np.isfinite(value.asnumpy())
    ap.set_inputs(fs.ArrayType((fs.Symbol(divisor=4), 8), ms.float32), None)
    with pytest.raises(fs.FshardError):
        ap(state, x[:6], y[:6])  # the declaration is checked on every call


def test_a_parameter_the_loss_reads_changing_shape_traces_again():
    # The hot path runs the compiled step directly; a Parameter the loss closes over
    # that changed shape since (set_data) makes it trace the step again, as fs.jit does.
    params, x, y = data()
    scale = ms.Parameter(ms.Tensor(np.ones(4, np.float32)), name="scale",
                         requires_grad=False)

    def scaled_loss(p, x, y):
        return fs.ops.softmax_cross_entropy((x @ p["w"] + p["b"]) * scale, y)

    ap = fs.AutoParallel(scaled_loss, fs.optim.sgd(0.0), mesh=4)
    ap.dataset_strategy("data_parallel")
    state = ap.init(params)
    _, first = ap(state, x, y)
    _, again = ap(state, x, y)  # the hot path
    assert float(again.asnumpy()) == float(first.asnumpy())
    scale.set_data(ms.Tensor(np.full((1, 4), 0.5, np.float32)))
    _, changed = ap(state, x, y)
    logits = (x.asnumpy() @ params["w"] + params["b"]) * 0.5
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    want = -logp[np.arange(len(logp)), y.asnumpy()].mean()
    np.testing.assert_allclose(float(changed.asnumpy()), want, rtol=1e-5)


def test_a_step_called_inside_fs_jit_after_a_call_is_traced_into_it():
    # A signature the hot path knows, met again while fs.jit traces a loop of steps:
    # the step's program is inlined into the loop's, not called on the tracers.
    params, x, y = data()
    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=4).dataset_strategy("data_parallel")
    s0 = ap.init(params)
    s1, l1 = ap(s0, x, y)
    _, l2 = ap(s1, x, y)

    @fs.jit
    def two_steps(s):
        s, a = ap(s, x, y)
        s, b = ap(s, x, y)
        return s, a, b

    _, a, b = two_steps(s0)
    np.testing.assert_allclose([float(a.asnumpy()), float(b.asnumpy())],
                               [float(l1.asnumpy()), float(l2.asnumpy())], rtol=1e-6)
