"""Gradient accumulation: fs.optim.multi_steps (optax MultiSteps) and
AutoParallel.gradient_accumulation(k): k micro-steps then one update, equal to the
large-batch step, with the data-parallel gradient reductions once per update."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import fshard as fs

RNG = np.random.default_rng(0)


def n(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def loss(p, x, y):
    h = fs.ops.tanh(x @ p["w1"] + p["b1"])
    return ((h @ p["w2"] - y) ** 2).mean()


PARAMS = {"w1": (RNG.standard_normal((64, 64)) * 0.3).astype(np.float32),
          "b1": np.zeros(64, np.float32),
          "w2": (RNG.standard_normal((64, 2)) * 0.3).astype(np.float32)}
X = RNG.standard_normal((512, 64)).astype(np.float32)
Y = RNG.standard_normal((512, 2)).astype(np.float32)


def assert_tree_close(a, b, rtol=1e-5):
    for k in b:
        want = n(b[k])
        np.testing.assert_allclose(n(a[k]), want, rtol=rtol,
                                   atol=rtol * max(float(np.abs(want).max()), 1e-3))


# --- fs.optim.multi_steps -------------------------------------------------------------


def test_multi_steps_equals_the_large_batch_step_under_jit():
    """k micro-batch calls of the jitted step: zero updates k-1 times, then Adam's update
    for the mean gradient, equal to one Adam step on the whole batch."""
    k = 4
    opt = fs.optim.multi_steps(fs.optim.adam(1e-2), k)
    grad = fs.grad(loss)

    @fs.jit
    def step(params, state, x, y):
        updates, state = opt.update(grad(params, x, y), state, params)
        return fs.optim.apply_updates(params, updates), state

    params, state = PARAMS, opt.init(PARAMS)
    for j, (x, y) in enumerate(zip(np.split(X, k), np.split(Y, k))):
        new, state = step(params, state, x, y)
        if j < k - 1:
            assert_tree_close(new, params, rtol=0)  # zero updates until the k-th
            assert int(n(state.mini_step)) == j + 1
        params = new
    assert int(n(state.mini_step)) == 0 and int(n(state.gradient_step)) == 1
    assert bool(n(opt.has_updated(state)))
    ref = fs.optim.adam(1e-2)
    u, _ = ref.update(grad(PARAMS, X, Y), ref.init(PARAMS), PARAMS)
    assert_tree_close(params, fs.optim.apply_updates(PARAMS, u), rtol=1e-5)


def test_multi_steps_keeps_the_inner_state_between_updates():
    """The inner optimizer's state (momentum, step count) advances once per update."""
    opt = fs.optim.multi_steps(fs.optim.sgd(0.1, momentum=0.9), 2)
    ref = fs.optim.sgd(0.1, momentum=0.9)
    p = {"w": np.zeros(3, np.float32)}
    s, rs = opt.init(p), ref.init(p)
    gs = [np.full(3, v, np.float32) for v in (1.0, 3.0, -2.0, 4.0)]
    for i, g in enumerate(gs):
        u, s = opt.update({"w": g}, s)
        if i % 2:
            ru, rs = ref.update({"w": (gs[i - 1] + g) / 2}, rs)
            np.testing.assert_allclose(n(u["w"]), n(ru["w"]), rtol=1e-6)
            np.testing.assert_allclose(n(s.inner_state.momentum["w"]),
                                       n(rs.momentum["w"]), rtol=1e-6)
        else:
            np.testing.assert_array_equal(n(u["w"]), 0)
    assert int(n(s.inner_state.count)) == 2


def test_multi_steps_errors():
    with pytest.raises(fs.ArgumentError, match=r"(?s)k must be an int >= 1.*got int 0.*Fix"):
        fs.optim.multi_steps(fs.optim.sgd(0.1), 0)
    with pytest.raises(fs.ArgumentError, match=r"(?s)k must be an int >= 1.*got float 2.0"):
        fs.optim.multi_steps(fs.optim.sgd(0.1), 2.0)
    with pytest.raises(fs.ArgumentError, match=r"(?s)opt must be an optimizer.*got str"):
        fs.optim.multi_steps("adam", 2)
    opt = fs.optim.multi_steps(fs.optim.sgd(0.1), 2)
    with pytest.raises(fs.ArgumentError, match=r"state must be the MultiStepsState"):
        opt.update({"w": np.ones(2, np.float32)}, fs.optim.sgd(0.1).init({"w": 0}))
    s = opt.init({"w": np.ones(2, np.float32)})
    with pytest.raises(fs.ArgumentError, match=r"(?s)do not have the structure.*Fix"):
        opt.update({"v": np.ones(2, np.float32)}, s)


# --- AutoParallel.gradient_accumulation ------------------------------------------------


def _psums(program, depth=0, acc=None):
    """Counter of (loop depth, value type) of the psums in a per-device program."""
    acc = Counter() if acc is None else acc
    for e in program.equations:
        if e.prim.name == "psum":
            acc[(depth, str(e.outputs[0].aval))] += 1
        for v in e.params.values():
            if hasattr(v, "equations"):
                _psums(v, depth + 1, acc)
    return acc


def _steps(k, params, x, y, mesh, mode="semi_auto"):
    ap = fs.AutoParallel(loss, fs.optim.adam(1e-2), mode, mesh=mesh).gradient_accumulation(k)
    state = ap.init(params)
    losses = []
    for _ in range(2):
        state, value = ap(state, x, y)
        losses.append(float(n(value)))
    return ap, state, losses


def test_gradient_accumulation_equals_the_large_batch_step():
    """Two steps of 4 micro-batches equal two steps on the whole batch (a small model
    on 2 virtual devices, the layouts propagated: no plan search)."""
    p = {"w1": PARAMS["w1"][:6, :8], "b1": PARAMS["b1"][:8], "w2": PARAMS["w2"][:8]}
    x, y = X[:32, :6], Y[:32]
    _, s4, l4 = _steps(4, p, x, y, 2, "sharding_propagation")
    opt = fs.optim.adam(1e-2)
    params, state, l1 = p, opt.init(p), []
    for _ in range(2):  # the large-batch steps, unsharded and eager
        value, g = fs.value_and_grad(loss)(params, x, y)
        u, state = opt.update(g, state, params)
        params = fs.optim.apply_updates(params, u)
        l1.append(float(n(value)))
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    assert_tree_close(s4.params, params, rtol=1e-5)
    assert int(n(s4.step)) == 2


@pytest.mark.full
def test_gradient_reductions_run_once_per_update():
    """On 4 devices, data parallel: the steps are equal, and each gradient is
    AllReduced once, after the loop over the micro-batches (the loop body holds only
    the scalar loss's reduction)."""
    ap1, s1, l1 = _steps(1, PARAMS, X, Y, 4)
    ap4, s4, l4 = _steps(4, PARAMS, X, Y, 4)
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    assert_tree_close(s4.params, s1.params, rtol=1e-5)
    once = _psums(ap1.partitioned(s1, X, Y).program)
    accumulated = _psums(ap4.partitioned(s4, X, Y).program)
    grads = {"f32[64,64]", "f32[64]", "f32[64,2]"}
    assert {t for (d, t) in accumulated if d == 0} == grads
    assert all(t not in grads for (d, t) in accumulated if d > 0)
    assert sum(c for (d, t), c in accumulated.items() if t in grads) == \
        sum(c for (d, t), c in once.items() if t in grads)


def test_gradient_accumulation_errors():
    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=4)
    with pytest.raises(fs.ArgumentError, match=r"(?s)k must be an int >= 1.*got int 0.*Fix"):
        ap.gradient_accumulation(0)
    ap.gradient_accumulation(3)
    state = ap.init(PARAMS)
    with pytest.raises(fs.ArgumentError,
                       match=r"(?s)gradient_accumulation\(3\).*f32\[512,64\].*multiple of 12"):
        ap(state, X, Y)


def test_gradient_accumulation_with_aux_stacks_it_per_micro_batch():
    def loss_aux(p, x, y):
        r = x @ p["w"] - y
        return (r ** 2).mean(), r.sum()

    p = {"w": (RNG.standard_normal((4, 1))).astype(np.float32)}
    x, y = RNG.standard_normal((16, 4)).astype(np.float32), np.ones((16, 1), np.float32)
    ap = fs.AutoParallel(loss_aux, fs.optim.sgd(0.1), "sharding_propagation", mesh=2,
                         has_aux=True).gradient_accumulation(2)
    _, (value, aux) = ap(ap.init(p), x, y)
    r = x @ p["w"] - y
    np.testing.assert_allclose(float(n(value)), (r ** 2).mean(), rtol=1e-5)
    # micro-batch j: the j-th half of each device's 8 rows
    halves = [np.concatenate([r[0:4], r[8:12]]), np.concatenate([r[4:8], r[12:16]])]
    np.testing.assert_allclose(n(aux), [h.sum() for h in halves], rtol=1e-5, atol=1e-5)


def test_accumulation_and_a_pipeline_are_refused_in_either_order():
    """A pipeline accumulates its own micro-batches: combined with
    gradient_accumulation(k) one of the two would be silently ignored."""
    def staged(p, x, y):
        h = fs.pipeline_split(fs.ops.tanh(x @ p["w1"] + p["b1"]))
        return ((h @ p["w2"] - y) ** 2).mean()

    ap = fs.AutoParallel(staged, fs.optim.sgd(0.1), "semi_auto", mesh=2)
    with pytest.raises(fs.ArgumentError, match=r"(?s)gradient_accumulation\(4\) is set.*"
                                               r"micro_batches=8\) alone"):
        ap.gradient_accumulation(4).pipeline(2, micro_batches=2)
    ap = fs.AutoParallel(staged, fs.optim.sgd(0.1), "semi_auto", mesh=2)
    with pytest.raises(fs.ArgumentError, match="a pipeline already accumulates"):
        ap.pipeline(2, micro_batches=2).gradient_accumulation(4)
