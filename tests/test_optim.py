"""``fs.optim``: each update rule against a NumPy reference and against MindSpore's
own optimizer on the same gradients, schedules, clipping and chaining, composition
with jit / vmap / shard / grad, and errors."""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs
from fshard import tree

STEPS = 4


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((3, 2)).astype(np.float32),
            "b": rng.standard_normal((2,)).astype(np.float32)}


def _grads(step, seed=1):
    rng = np.random.default_rng(seed + step)
    return {"w": rng.standard_normal((3, 2)).astype(np.float32),
            "b": rng.standard_normal((2,)).astype(np.float32)}


def _run(opt, params, steps=STEPS):
    state = opt.init(params)
    for t in range(steps):
        updates, state = opt.update(_grads(t), state, params)
        params = fs.optim.apply_updates(params, updates)
    return {k: v.asnumpy() for k, v in params.items()}, state


def close(a, b, rtol=1e-5):
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol,
                                   atol=rtol * max(1.0, float(np.abs(b[k]).max())))


# -- NumPy references -------------------------------------------------------------------


def np_sgd(params, lr, momentum=0.0, nesterov=False, wd=0.0, steps=STEPS):
    p = {k: v.astype(np.float64) for k, v in params.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t in range(steps):
        g = {k: x.astype(np.float64) for k, x in _grads(t).items()}
        for k in p:
            gk = g[k] + wd * p[k]
            if momentum:
                v[k] = momentum * v[k] + gk
                step = gk + momentum * v[k] if nesterov else v[k]
            else:
                step = gk
            p[k] = p[k] - lr(t) * step
    return p


def np_adam(params, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, correct=True, steps=STEPS):
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(x) for k, x in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t in range(steps):
        g = _grads(t)
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            rate = lr(t)
            if correct:
                rate = rate * math.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1))
            p[k] = p[k] - rate * (m[k] / (np.sqrt(v[k]) + eps) + wd * p[k])
    return p


def const(x):
    return lambda t: x


@pytest.mark.parametrize("kw", [dict(), dict(momentum=0.9), dict(momentum=0.9, nesterov=True),
                                dict(momentum=0.5, weight_decay=0.1), dict(weight_decay=0.01)])
def test_sgd_matches_numpy(kw):
    params = _params()
    got, state = _run(fs.optim.sgd(0.1, **kw), params)
    want = np_sgd(params, const(0.1), kw.get("momentum", 0.0), kw.get("nesterov", False),
                  kw.get("weight_decay", 0.0))
    close(got, want)
    assert int(state.count.asnumpy()) == STEPS


@pytest.mark.parametrize("kw", [dict(), dict(b1=0.8, b2=0.99, eps=1e-6)])
def test_adam_matches_numpy(kw):
    params = _params()
    got, _ = _run(fs.optim.adam(0.05, **kw), params)
    close(got, np_adam(params, const(0.05), **kw))


def test_adamw_matches_numpy():
    params = _params()
    got, _ = _run(fs.optim.adamw(0.05, weight_decay=0.1), params)
    close(got, np_adam(params, const(0.05), wd=0.1, correct=False))


def test_schedules_drive_the_learning_rate():
    sched = fs.optim.linear_warmup(0.0, 0.1, 2, after=fs.optim.cosine_decay(0.1, 4))
    want_lr = [0.0, 0.05, 0.1, 0.1 * (1 + math.cos(math.pi / 4)) / 2]
    assert [round(float(sched(t)), 6) for t in range(4)] == [round(x, 6) for x in want_lr]
    params = _params()
    got, _ = _run(fs.optim.sgd(sched, momentum=0.9), params)
    close(got, np_sgd(params, lambda t: want_lr[t], 0.9))
    got, _ = _run(fs.optim.adam(sched), params)
    close(got, np_adam(params, lambda t: want_lr[t]))


def test_clip_by_global_norm_then_sgd():
    params = _params()
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.sgd(0.1))
    got, _ = _run(opt, params, steps=1)
    g = _grads(0)
    norm = math.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in g.values()))
    want = {k: params[k] - 0.1 * g[k] * min(1.0, 0.5 / norm) for k in params}
    close(got, want)


# -- against MindSpore's optimizers -------------------------------------------------------


class _Cell(nn.Cell):
    def __init__(self, params):
        super().__init__()
        self.w = ms.Parameter(ms.Tensor(params["w"]), name="w")
        self.b = ms.Parameter(ms.Tensor(params["b"]), name="b")


@pytest.mark.parametrize("name", ["sgd", "sgd_momentum", "sgd_nesterov_wd", "adam", "adamw"])
def test_matches_mindsporess_optimizer_step_for_step(name):
    params = _params()
    cell = _Cell(params)
    ms_opt, fs_opt = {
        "sgd": (lambda p: nn.SGD(p, learning_rate=0.1), fs.optim.sgd(0.1)),
        "sgd_momentum": (lambda p: nn.SGD(p, learning_rate=0.1, momentum=0.9),
                         fs.optim.sgd(0.1, momentum=0.9)),
        "sgd_nesterov_wd": (lambda p: nn.SGD(p, learning_rate=0.1, momentum=0.9, nesterov=True,
                                             weight_decay=0.01),
                            fs.optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
        "adam": (lambda p: nn.Adam(p, learning_rate=0.05), fs.optim.adam(0.05)),
        "adamw": (lambda p: nn.AdamWeightDecay(p, learning_rate=0.05, weight_decay=0.1),
                  fs.optim.adamw(0.05, weight_decay=0.1)),
    }[name]
    opt = ms_opt(cell.trainable_params())
    for t in range(STEPS):
        g = _grads(t)
        opt((ms.Tensor(g["w"]), ms.Tensor(g["b"])))
    got, _ = _run(fs_opt, params)
    close(got, {"w": cell.w.asnumpy(), "b": cell.b.asnumpy()}, rtol=2e-5)


# -- composition ------------------------------------------------------------------------


def _loss(p, x, y):
    return ((x @ p["w"] + p["b"] - y) ** 2).mean()


def _xy(seed=2):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((8, 3)).astype(np.float32),
            rng.standard_normal((8, 2)).astype(np.float32))


def _step(opt):
    def step(params, state, x, y):
        loss, grads = fs.value_and_grad(_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return fs.optim.apply_updates(params, updates), state, loss
    return step


def test_a_jitted_train_step_equals_the_eager_one():
    opt = fs.optim.adam(0.05)
    params, (x, y) = _params(), _xy()
    eager = jitted = (params, opt.init(params))
    step, jstep = _step(opt), fs.jit(_step(opt))
    for _ in range(3):
        *eager, le = step(*eager, x, y)
        *jitted, lj = jstep(*jitted, x, y)
        np.testing.assert_allclose(lj.asnumpy(), le.asnumpy(), rtol=1e-5)
    close({k: v.asnumpy() for k, v in jitted[0].items()},
          {k: v.asnumpy() for k, v in eager[0].items()})
    assert jstep.trace_count == 1


def test_vmap_trains_independent_parameter_sets():
    opt = fs.optim.sgd(0.1, momentum=0.9)
    x, y = _xy()
    sets = [_params(s) for s in range(3)]
    stacked = tree.map(lambda *a: np.stack(a), *sets)
    states = fs.vmap(opt.init)(stacked)
    new, _, losses = fs.vmap(_step(opt), in_axes=(0, 0, None, None))(stacked, states, x, y)
    for i, p in enumerate(sets):
        want, _, loss = _step(opt)(p, opt.init(p), x, y)
        np.testing.assert_allclose(losses.asnumpy()[i], loss.asnumpy(), rtol=1e-5)
        close({k: v.asnumpy()[i] for k, v in new.items()}, {k: v.asnumpy() for k, v in want.items()})


def test_a_sharded_train_step_equals_the_unsharded_one():
    opt = fs.optim.adam(0.05)
    params, (x, y) = _params(), _xy()
    state = opt.init(params)
    want = _step(opt)(params, state, x, y)
    sharded = fs.shard(_step(opt), in_strategy=(None, None, (4, 1), (4, 1)), mesh=4)
    got = sharded(params, state, x, y)
    np.testing.assert_allclose(got[2].asnumpy(), want[2].asnumpy(), rtol=1e-5)
    close({k: v.asnumpy() for k, v in got[0].items()}, {k: v.asnumpy() for k, v in want[0].items()})


def test_digits_mlp_trains_with_adam_in_one_compiled_step():
    from sklearn.datasets import load_digits

    X, labels = load_digits(return_X_y=True)
    X = (X[:512] / 16.0).astype(np.float32)
    Y = np.eye(10, dtype=np.float32)[labels[:512]]
    rng = np.random.default_rng(0)
    params = {"w1": (rng.standard_normal((64, 32)) * 0.1).astype(np.float32),
              "b1": np.zeros(32, np.float32),
              "w2": (rng.standard_normal((32, 10)) * 0.1).astype(np.float32),
              "b2": np.zeros(10, np.float32)}

    def loss(p, x, y):
        h = fs.ops.relu(x @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        return -(fs.ops.log_softmax(logits, -1) * y).sum(-1).mean()

    opt = fs.optim.chain(fs.optim.clip_by_global_norm(5.0), fs.optim.adam(1e-2))

    @fs.jit
    def step(p, s, x, y):
        l, g = fs.value_and_grad(loss)(p, x, y)
        u, s = opt.update(g, s, p)
        return fs.optim.apply_updates(p, u), s, l

    state, losses = opt.init(params), []
    for _ in range(60):
        params, state, l = step(params, state, X, Y)
        losses.append(float(l.asnumpy()))
    assert losses[-1] < 0.3 * losses[0]
    assert step.trace_count == 1


# -- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: fs.optim.sgd(-0.1), r"learning_rate=\.\.\.\) must be >= 0"),
    (lambda: fs.optim.sgd(0.1, momentum=-1), "momentum"),
    (lambda: fs.optim.sgd(0.1, nesterov=True), "needs momentum > 0"),
    (lambda: fs.optim.adam(0.1, b1=1.0), r"b1=\.\.\.\) must be < 1"),
    (lambda: fs.optim.adam(0.1, eps=0.0), r"eps=\.\.\.\) must be > 0"),
    (lambda: fs.optim.adamw(0.1, weight_decay=-1), "weight_decay"),
    (lambda: fs.optim.adam("fast"), "must be a number"),
    (lambda: fs.optim.cosine_decay(1.0, 0), "decay_steps"),
    (lambda: fs.optim.linear_warmup(0.0, 1.0, 2, after=3), "after"),
    (lambda: fs.optim.clip_by_global_norm(0), "max_norm"),
    (lambda: fs.optim.chain(fs.optim.sgd(0.1), 3), "argument 1 is not an optimizer"),
])
def test_bad_arguments_are_fshard_errors(make, match):
    with pytest.raises(fs.ArgumentError, match=match):
        make()


def test_mismatched_structures_and_missing_params_are_fshard_errors():
    opt = fs.optim.adam(0.1)
    state = opt.init(_params())
    with pytest.raises(fs.ArgumentError, match="structure of the parameters"):
        opt.update({"w": _grads(0)["w"]}, state)
    with pytest.raises(fs.ArgumentError, match="must be the AdamState"):
        opt.update(_grads(0), fs.optim.sgd(0.1).init(_params()))
    with pytest.raises(fs.ArgumentError, match="needs the parameters"):
        fs.optim.adamw(0.1).update(_grads(0), fs.optim.adamw(0.1).init(_params()))
    with pytest.raises(fs.ArgumentError, match="structure of the parameters"):
        fs.optim.apply_updates(_params(), {"w": _grads(0)["w"]})


# -- clipping: the norm in the gradients' dtype, never overflowing ----------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("g, max_norm, want", [
    ([3e19, 4e19], 1.0, [0.6, 0.8]),             # squares overflow float32
    ([3e-30, 4e-30], 1e-30, [0.6e-30, 0.8e-30]),  # squares underflow both
    ([3e37, 4e37], 1.0, [0.6, 0.8]),             # the norm itself overflows float32
    ([3.0, 4.0], 10.0, [3.0, 4.0]),              # under max_norm: unchanged, exactly
    ([0.0, 0.0], 1.0, [0.0, 0.0]),
])
def test_clip_by_global_norm_at_extreme_magnitudes(dtype, g, max_norm, want):
    clip = fs.optim.clip_by_global_norm(max_norm)
    u, _ = clip.update({"g": np.array(g, dtype)}, clip.init(None))
    got = u["g"].asnumpy()
    assert got.dtype == dtype
    np.testing.assert_allclose(got, np.array(want, dtype), rtol=4 * np.finfo(dtype).eps,
                               atol=0)


def test_clip_by_global_norm_over_mixed_dtypes_is_float64_and_jits():
    g = {"a": np.array([3e-300, 0.0]), "b": np.array([4e-300], np.float64),
         "c": np.zeros(0, np.float32), "d": np.array([0.0], np.float32)}
    clip = fs.optim.clip_by_global_norm(1e-300)
    for update in (clip.update, fs.jit(clip.update)):
        u, _ = update(g, ())
        np.testing.assert_allclose(u["a"].asnumpy(), [0.6e-300, 0.0], rtol=1e-15)
        np.testing.assert_allclose(u["b"].asnumpy(), [0.8e-300], rtol=1e-15)
        assert u["c"].shape == (0,) and u["d"].asnumpy().dtype == np.float32


def test_clip_by_global_norm_makes_non_finite_gradients_visible():
    clip = fs.optim.clip_by_global_norm(1.0)
    u, _ = clip.update({"a": np.array([1.0, np.inf], np.float32), "b": np.array([2.0])}, ())
    assert u["a"].asnumpy()[0] == 0 and np.isnan(u["a"].asnumpy()[1])  # optax's result
    assert u["b"].asnumpy()[0] == 0
    u, _ = clip.update({"a": np.array([1.0, np.nan], np.float32)}, ())
    assert np.isnan(u["a"].asnumpy()).all()


# -- float64 parameters: every number of the update in float64 --------------------------


def _f64_run(opt, jit=False, steps=6):
    rng = np.random.default_rng(3)
    p0 = rng.standard_normal(5)
    gs = [rng.standard_normal(5) for _ in range(steps)]

    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return fs.optim.apply_updates(p, u), s

    step = fs.jit(step) if jit else step
    p, s = {"w": p0}, opt.init({"w": p0})
    for g in gs:
        p, s = step(p, s, {"w": g})
    return p0, gs, p["w"].asnumpy()


def _rel_error_of_the_change(p0, got, want):
    assert got.dtype == np.float64
    return float(np.abs((got - want) / (want - p0)).max())


@pytest.mark.parametrize("jit", [False, True])
def test_float64_adam_bias_correction_is_float64(jit):
    p0, gs, got = _f64_run(fs.optim.adam(0.01), jit)
    p, m, v = p0.copy(), 0.0, 0.0
    for t, g in enumerate(gs):
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        p = p - 0.01 * math.sqrt(1 - 0.999 ** (t + 1)) / (1 - 0.9 ** (t + 1)) * m / (
            np.sqrt(v) + 1e-8)
    assert _rel_error_of_the_change(p0, got, p) < 1e-13  # float32 corrections: 7e-6


@pytest.mark.parametrize("jit", [False, True])
def test_float64_schedules_are_float64(jit):
    sched = fs.optim.linear_warmup(0.01, 0.1, 3, after=fs.optim.cosine_decay(0.1, 4))
    p0, gs, got = _f64_run(fs.optim.sgd(sched), jit)
    p = p0.copy()
    for t, g in enumerate(gs):
        lr = 0.01 + 0.09 * t / 3 if t < 3 else 0.05 * (1 + math.cos(math.pi * min(t - 3, 4) / 4))
        p = p - lr * g
    assert _rel_error_of_the_change(p0, got, p) < 1e-13  # float32 schedules: 5e-8
    assert float(sched(4, np.float64).asnumpy()) == 0.05 * (1 + math.cos(math.pi / 4))


def test_schedules_compute_in_the_dtype_asked():
    s = fs.optim.cosine_decay(1.0, 3)
    assert s(1).dtype == ms.float32 and s(1, np.float64).dtype == ms.float64
    assert s(np.float64(1)).dtype == ms.float64
    # one implementation under both names
    assert fs.optim.cosine_decay is fs.optim.cosine_decay_schedule
    assert fs.optim.constant is fs.optim.constant_schedule
    assert repr(s) == "cosine_decay_schedule(1.0, 3, alpha=0.0, exponent=1.0)"


# -- float64 through optax's building blocks and schedules -------------------------------


def _adam_ref(gs, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, nesterov=False):
    """optax's scale_by_adam on a list of gradients: the directions, in float64."""
    m = v = 0.0
    out = []
    for t, g in enumerate(gs, 1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        m_hat = (b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1 ** t) if nesterov
                 else m / (1 - b1 ** t))
        out.append(m_hat / (np.sqrt(v / (1 - b2 ** t) + eps_root) + eps))
    return out


def _exp_decay(t, init, steps, rate, begin=0, staircase=False, end=None):
    p = (t - begin) / steps
    v = init if t - begin <= 0 else init * rate ** (math.floor(p) if staircase else p)
    return v if end is None else (max(v, end) if rate < 1 else min(v, end))


def _cosine(t, init, steps, alpha=0.0, exponent=1.0):
    return init * ((1 - alpha) * (0.5 * (1 + math.cos(math.pi * min(t, steps) / steps)))
                   ** exponent + alpha)


def _poly(t, init, end, power, steps, begin=0):
    return (init - end) * (1 - min(max(t - begin, 0), steps) / steps) ** power + end


def _ref_sgd_with(lrs, p0, gs, directions=None):
    p = p0.copy()
    for t, g in enumerate(gs):
        p = p - lrs(t) * (g if directions is None else directions[t])
    return p


# (the chain, its float64 NumPy reference p0, gs -> final params)
BLOCK_CHAINS = {
    "adam_scale": (
        lambda: fs.optim.chain(fs.optim.scale_by_adam(), fs.optim.scale(-1e-3)),
        lambda p0, gs: p0 - 1e-3 * sum(_adam_ref(gs))),
    "adam_nesterov_eps_root": (
        lambda: fs.optim.chain(fs.optim.scale_by_adam(0.8, 0.95, 1e-6, 1e-9, nesterov=True),
                               fs.optim.scale(-0.05)),
        lambda p0, gs: p0 - 0.05 * sum(_adam_ref(gs, 0.8, 0.95, 1e-6, 1e-9, True))),
    "adamw_decay_schedule": (  # optax.adamw(warmup-cosine, weight_decay=1e-2)
        lambda: fs.optim.chain(
            fs.optim.scale_by_adam(), fs.optim.add_decayed_weights(1e-2),
            fs.optim.scale_by_learning_rate(
                fs.optim.warmup_cosine_decay_schedule(0.0, 0.1, 2, 5, end_value=0.01))),
        None),
    "trace_nesterov": (
        lambda: fs.optim.chain(fs.optim.trace(0.9, nesterov=True), fs.optim.scale(-0.1)),
        None),
    "inject_adam": (
        lambda: fs.optim.chain(fs.optim.inject_hyperparams(fs.optim.scale_by_adam)(b1=0.8),
                               fs.optim.inject_hyperparams(fs.optim.scale)(step_size=-0.3)),
        lambda p0, gs: p0 - 0.3 * sum(_adam_ref(gs, b1=0.8))),
    "inject_sgd_schedule": (
        lambda: fs.optim.inject_hyperparams(fs.optim.sgd)(
            learning_rate=fs.optim.exponential_decay(0.5, 1, 0.7)),
        lambda p0, gs: _ref_sgd_with(lambda t: 0.5 * 0.7 ** t, p0, gs)),
    "plain_callable_schedule": (
        lambda: fs.optim.scale_by_learning_rate(lambda step: 0.1),
        lambda p0, gs: _ref_sgd_with(lambda t: 0.1, p0, gs)),
}


def _adamw_ref(p0, gs):
    p = p0.copy()
    for t, (g, d) in enumerate(zip(gs, _adam_ref(gs))):
        lr = 0.1 * t / 2 if t < 2 else _cosine(t - 2, 0.1, 3, alpha=0.1)
        p = p - lr * (d + 1e-2 * p)
    return p


def _trace_ref(p0, gs):
    p, tr = p0.copy(), 0.0
    for g in gs:
        tr = 0.9 * tr + g
        p = p - 0.1 * (g + 0.9 * tr)
    return p


BLOCK_CHAINS["adamw_decay_schedule"] = (BLOCK_CHAINS["adamw_decay_schedule"][0], _adamw_ref)
BLOCK_CHAINS["trace_nesterov"] = (BLOCK_CHAINS["trace_nesterov"][0], _trace_ref)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", sorted(BLOCK_CHAINS))
def test_float64_building_blocks_are_float64(name, jit):
    # Each number of the update was float32 before (0.9 * a float64 Tensor rounds 0.9
    # to float32 first): 6 steps of scale_by_adam + scale(-1e-3) were 4e-6 off.
    make, reference = BLOCK_CHAINS[name]
    p0, gs, got = _f64_run(make(), jit)
    assert _rel_error_of_the_change(p0, got, reference(p0, gs)) < 1e-13


def test_inject_hyperparams_keeps_the_numbers_passed_in_float64():
    # They were float32: a float64 run stepped by 0.10000000149 for 0.1, even when init
    # never saw the parameters.
    p64, p32 = {"w": np.ones(2)}, {"w": np.ones(2, np.float32)}
    for opt in (fs.optim.inject_hyperparams(fs.optim.sgd)(
                    learning_rate=fs.optim.exponential_decay(0.5, 1, 0.7)),
                fs.optim.inject_hyperparams(fs.optim.trace)(decay=0.7)):
        s64 = opt.init(p64)
        assert {v.dtype for v in s64.hyperparams.values()} == {ms.float64}
        for _ in range(2):
            _, s64 = opt.update(p64, s64, p64)
        (value,) = s64.hyperparams.values()
        assert value.dtype == ms.float64 and float(value.asnumpy()) in (0.5 * 0.7, 0.7)
        u32, _ = opt.update(p32, opt.init(p32), p32)  # float32 leaves: float32 updates
        assert u32["w"].dtype == ms.float32
    scale = fs.optim.inject_hyperparams(fs.optim.scale)(step_size=-0.1)
    u, _ = scale.update({"w": np.ones(2)}, scale.init(None))
    assert u["w"].asnumpy().tolist() == [-0.1, -0.1]


def test_building_blocks_update_float16_as_the_optimizers_do():
    # float16 and integer updates are worked with in float32 (state too) and come out
    # float32: in float16, eps = 1e-8 is 0; an integer update scaled by 0.5 was
    # truncated to an integer.
    g16 = {"w": np.array([0.0, 1e-3, 0.5], np.float16)}
    g32 = {"w": g16["w"].astype(np.float32)}
    for t in (fs.optim.scale_by_adam(), fs.optim.trace(0.9), fs.optim.scale(0.5),
              fs.optim.add_decayed_weights(0.1)):
        s16, s32 = t.init(g16), t.init(g32)
        assert all(x.dtype in (ms.int32, ms.float32) for x in tree.leaves(s16))
        u16, _ = t.update(g16, s16, g16)
        u32, _ = t.update(g32, s32, g32)
        assert u16["w"].dtype == ms.float32
        np.testing.assert_array_equal(u16["w"].asnumpy(), u32["w"].asnumpy())
    u, _ = fs.optim.scale(0.5).update({"w": np.array([3, -5], np.int32)}, fs.optim.EmptyState())
    assert u["w"].asnumpy().tolist() == [1.5, -2.5]


# each optax-named schedule, and its float64 formula (optax's)
F64_SCHEDULES = {
    "constant_schedule": (fs.optim.constant_schedule(0.3), lambda t: 0.3),
    "linear_schedule": (fs.optim.linear_schedule(1.0, 0.1, 8, transition_begin=2),
                        lambda t: _poly(t, 1.0, 0.1, 1, 8, 2)),
    "polynomial_schedule": (fs.optim.polynomial_schedule(1.0, 0.1, 2.0, 8, 1),
                            lambda t: _poly(t, 1.0, 0.1, 2.0, 8, 1)),
    "cosine_decay_schedule": (fs.optim.cosine_decay_schedule(2.0, 10, 0.1, 2.0),
                              lambda t: _cosine(t, 2.0, 10, 0.1, 2.0)),
    "warmup_cosine_decay_schedule": (
        fs.optim.warmup_cosine_decay_schedule(0.0, 1.0, 3, 11, end_value=0.05),
        lambda t: t / 3 if t < 3 else _cosine(t - 3, 1.0, 8, alpha=0.05)),
    "exponential_decay": (fs.optim.exponential_decay(1.0, 3, 0.7, 2, end_value=0.2),
                          lambda t: _exp_decay(t, 1.0, 3, 0.7, 2, end=0.2)),
    "exponential_decay_staircase": (fs.optim.exponential_decay(1.0, 3, 0.3, staircase=True),
                                    lambda t: _exp_decay(t, 1.0, 3, 0.3, staircase=True)),
    "piecewise_constant_schedule": (
        fs.optim.piecewise_constant_schedule(1.0, {3: 0.3, 7: 0.1}),
        lambda t: 1.0 * (0.3 if t >= 3 else 1) * (0.1 if t >= 7 else 1)),
    "join_schedules": (
        fs.optim.join_schedules([fs.optim.constant_schedule(0.7),
                                 fs.optim.linear_schedule(0.7, 0.1, 3)], [5]),
        lambda t: 0.7 if t < 5 else _poly(t - 5, 0.7, 0.1, 1, 3)),
    "linear_warmup": (fs.optim.linear_warmup(0.1, 0.7, 3, after=lambda s: 0.3),
                      lambda t: 0.1 + 0.6 * t / 3 if t < 3 else 0.3),
}
SCHEDULE_STEPS = range(13)


@pytest.fixture(scope="module")
def jitted_schedules():
    """Every schedule in float64 in one compiled program (the step traced)."""
    names = sorted(F64_SCHEDULES)
    f = fs.jit(lambda t: [F64_SCHEDULES[k][0](t, np.float64) for k in names])
    return {t: dict(zip(names, f(np.int32(t)))) for t in SCHEDULE_STEPS}


@pytest.mark.parametrize("name", sorted(F64_SCHEDULES))
def test_float64_schedules_equal_float64_maths(name, jitted_schedules):
    # float32 before: 1e-8 relative off (0.3 was 0.30000001192...).
    schedule, formula = F64_SCHEDULES[name]
    want = np.array([formula(t) for t in SCHEDULE_STEPS])
    for got in ([schedule(t, np.float64) for t in SCHEDULE_STEPS],
                [jitted_schedules[t][name] for t in SCHEDULE_STEPS]):
        assert {x.dtype for x in got} == {ms.float64}
        got = np.array([float(x.asnumpy()) for x in got])
        np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-15 * np.abs(want).max())
    # float32 when asked (and by default for an integer step)
    assert schedule(3).dtype == ms.float32 and schedule(3, np.float32).dtype == ms.float32


# -- integer parameters: updated in float, as optax does -------------------------------


def test_integer_parameters_move_as_in_optax():
    # optax: apply_updates((5, -5), -0.1 * (3, -3)) = ((5 - 0.3).astype(int), ...) = (4, -4)
    p = {"w": np.array([5, -5], np.int32)}
    opt = fs.optim.sgd(0.1)
    u, _ = opt.update({"w": np.array([3, -3], np.int32)}, opt.init(p), p)
    assert u["w"].asnumpy().dtype == np.float32
    got = fs.optim.apply_updates(p, u)["w"].asnumpy()
    assert got.dtype == np.int32 and got.tolist() == [4, -4]
    for opt in (fs.optim.sgd(0.1, momentum=0.9), fs.optim.adam(0.5)):
        s = opt.init(p)
        assert all(x.asnumpy().dtype == np.float32 for x in tree.leaves(s)[1:])
        u, s2 = opt.update({"w": np.array([3, -3], np.int32)}, s, p)
        assert tree.structure(s2) == tree.structure(s)
        got = fs.optim.apply_updates(p, u)["w"].asnumpy()
        want = (p["w"] + u["w"].asnumpy()).astype(np.int32)
        assert got.tolist() == want.tolist() and got.tolist() != [5, -5]


# -- weight decay: MindSpore's decay filter, or a mask ----------------------------------


class _LNNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(3, 4)
        self.ln = nn.LayerNorm((4,))

    def construct(self, x):
        return self.ln(self.dense(x))


def _ln_params(net):
    rng = np.random.default_rng(5)
    for p in net.trainable_params():
        v = rng.standard_normal(p.shape).astype(np.float32) * 0.5 + (1.5 if "gamma" in p.name else 0)
        p.set_data(ms.Tensor(v))
    _, params = fs.functional(net)
    return {k: v.asnumpy().copy() for k, v in params.items()}  # (asnumpy shares memory)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_weight_decay_skips_gamma_and_beta_as_mindspore_does(name):
    net = _LNNet()
    params = _ln_params(net)
    ms_opt, opt = {
        "adamw": (nn.AdamWeightDecay(net.trainable_params(), 0.05, weight_decay=0.1),
                  fs.optim.adamw(0.05, weight_decay=0.1)),
        "sgd": (nn.SGD(net.trainable_params(), 0.1, weight_decay=0.1),
                fs.optim.sgd(0.1, weight_decay=0.1)),
    }[name]
    state = opt.init(params)
    rng = np.random.default_rng(6)
    for _ in range(10):
        g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
        ms_opt(tuple(ms.Tensor(g[p.name]) for p in net.trainable_params()))
        u, state = opt.update(g, state, params)
        params = {k: v.asnumpy() for k, v in fs.optim.apply_updates(params, u).items()}
    want = {p.name: p.asnumpy() for p in net.trainable_params()}
    assert sorted(want) == ["dense.bias", "dense.weight", "ln.beta", "ln.gamma"]
    # Decaying gamma/beta puts them 1e-2 off; MindSpore's AdamWeightDecay kernel is itself
    # ~1e-5 off float64 maths per step (fshard's float32 updates are closer).
    close(params, want, rtol=5e-4 if name == "adamw" else 1e-6)


def test_the_weight_decay_mask_is_configurable():
    params = {"ln": {"gamma": np.ones(2, np.float32)}, "w": np.ones(2, np.float32)}
    grads = tree.map(np.zeros_like, params)

    def moved(**kw):
        opt = fs.optim.sgd(1.0, weight_decay=0.5, **kw)
        u, _ = opt.update(grads, opt.init(params), params)
        return {k: bool(np.any(v.asnumpy() != 0)) for k, v in
                zip(["gamma", "w"], tree.leaves(u))}

    assert moved() == {"gamma": False, "w": True}            # nested key path ln.gamma
    assert moved(mask=True) == {"gamma": True, "w": True}    # a prefix: every leaf
    assert moved(mask={"ln": False, "w": True}) == {"gamma": False, "w": True}
    assert moved(mask=lambda p: {"ln": {"gamma": True}, "w": False}) == {"gamma": True,
                                                                        "w": False}
    opt = fs.optim.adamw(0.1, mask={"ln": True, "w": False})
    u, _ = opt.update(grads, opt.init(params), params)
    assert np.all(u["ln"]["gamma"].asnumpy() != 0) and np.all(u["w"].asnumpy() == 0)
    # positional leaves have no names: all decayed
    opt = fs.optim.sgd(1.0, weight_decay=0.5)
    u, _ = opt.update([np.zeros(1)], opt.init([np.ones(1)]), [np.ones(1)])
    assert u[0].asnumpy().tolist() == [-0.5]


@pytest.mark.parametrize("mask, match", [
    ({"ln": True}, r"mask=\.\.\.\) must have the structure of the parameters"),
    ({"ln": {"gamma": 1}, "w": True}, r"must hold a bool per parameter .*got 1 for \['ln'\]"),
    (lambda p: "yes", r"must hold a bool per parameter"),
])
def test_a_wrong_mask_is_an_fshard_error(mask, match):
    params = {"ln": {"gamma": np.ones(2, np.float32)}, "w": np.ones(2, np.float32)}
    opt = fs.optim.adamw(0.1, mask=mask)
    with pytest.raises(fs.ArgumentError, match=match):
        opt.update(params, opt.init(params), params)


# -- non-finite hyperparameters ----------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: fs.optim.sgd(math.inf), r"sgd\(learning_rate=\.\.\.\) must be a finite number; got inf"),
    (lambda: fs.optim.sgd(0.1, momentum=math.inf), r"sgd\(momentum=\.\.\.\) must be a finite"),
    (lambda: fs.optim.sgd(0.1, weight_decay=np.float32(np.inf)), r"sgd\(weight_decay=\.\.\.\) must be a finite"),
    (lambda: fs.optim.adamw(0.1, weight_decay=math.inf), r"adamw\(weight_decay=\.\.\.\) must be a finite"),
    (lambda: fs.optim.adam(0.1, eps=math.inf), r"adam\(eps=\.\.\.\) must be a finite"),
    (lambda: fs.optim.adam(math.nan), r"adam\(learning_rate=\.\.\.\) must be a finite number; got nan"),
    (lambda: fs.optim.adam(0.1, b2=np.float64(np.nan)), r"adam\(b2=\.\.\.\) must be a finite"),
    (lambda: fs.optim.sgd(10 ** 400), r"sgd\(learning_rate=\.\.\.\) must be a finite"),
    (lambda: fs.optim.clip_by_global_norm(math.inf), r"max_norm=\.\.\.\) must be a finite"),
    (lambda: fs.optim.cosine_decay(math.inf, 10), r"init_value=\.\.\.\) must be a finite"),
    (lambda: fs.optim.linear_warmup(0.0, math.nan, 3), r"peak_value=\.\.\.\) must be a finite"),
    (lambda: fs.optim.constant(-math.inf), r"constant_schedule\(value=\.\.\.\) must be a finite"),
    (lambda: fs.optim.sgd(0.1, mask=()), r"sgd\(mask=\.\.\.\) must be None"),
    # optax's blocks and schedules: an inf made every value inf without an error
    (lambda: fs.optim.scale(math.inf), r"scale\(step_size=\.\.\.\) must be a finite"),
    (lambda: fs.optim.linear_schedule(0.0, math.inf, 3), r"end_value=\.\.\.\) must be a fin"),
    (lambda: fs.optim.scale_by_adam(eps=math.inf), r"adam\(eps=\.\.\.\) must be a finite"),
    (lambda: fs.optim.exponential_decay(1.0, 2, 0.5, end_value=-math.inf), "end_value"),
])
def test_non_finite_hyperparameters_are_fshard_errors(make, match):
    with pytest.raises(fs.ArgumentError, match=match) as e:
        make()
    assert "Fix:" in str(e.value) or "mask" in match


@pytest.mark.parametrize("value", [math.inf, np.float32(np.nan), -0.5])
def test_a_schedule_giving_a_bad_learning_rate_is_an_fshard_error(value):
    opt = fs.optim.sgd(lambda step: value)
    p = {"w": np.ones(2, np.float32)}
    with pytest.raises(fs.ArgumentError, match=r"the schedule gave .* for step 0; a learning "
                                               r"rate must be a finite number >= 0"):
        opt.update(p, opt.init(p), p)


def test_float16_parameters_keep_float32_state_and_never_divide_by_zero():
    # In float16, eps = 1e-8 is 0 and 0.001 * (1e-3)^2 underflows: a zero or small
    # gradient made Adam's update NaN or -inf.
    p16 = {"w": np.array([1.0, 2.0, -3.0], np.float16)}
    g16 = {"w": np.array([0.0, 1e-3, 0.5], np.float16)}
    p32, g32 = tree.map(lambda x: x.astype(np.float32), p16), tree.map(
        lambda x: x.astype(np.float32), g16)
    for opt in (fs.optim.adam(0.1), fs.optim.adamw(0.1), fs.optim.sgd(0.1, momentum=0.9)):
        s16, s32 = opt.init(p16), opt.init(p32)
        assert all(x.dtype in (ms.int32, ms.float32) for x in tree.leaves(s16))
        u16, _ = opt.update(g16, s16, p16)
        u32, _ = opt.update(g32, s32, p32)
        np.testing.assert_array_equal(u16["w"].asnumpy(), u32["w"].asnumpy())
        new = fs.optim.apply_updates(p16, u16)["w"].asnumpy()
        assert new.dtype == np.float16 and np.isfinite(new).all()
        np.testing.assert_array_equal(
            new, (p32["w"] + u32["w"].asnumpy()).astype(np.float16))
