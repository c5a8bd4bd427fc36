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
