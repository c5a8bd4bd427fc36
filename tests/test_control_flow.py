"""fs.cond / fs.switch / fs.while_loop / fs.fori_loop / fs.scan under every transform,
against NumPy loops and finite differences. (The ``while`` primitive's rules are also
checked by the registry: tests/primitive_specs.py.)"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

import fshard as fs
from fshard.testing import assert_close


def n(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def t(x):
    return ms.Tensor(np.asarray(x))


# --- while_loop -----------------------------------------------------------------------


def collatz_steps(x):
    """Steps of the Collatz map until 1: a trip count only known at run time."""
    def body(c):
        k, v = c
        odd = fs.ops.equal(v - (v >> 1) * 2, 1)
        return k + 1, fs.ops.where(odd, 3 * v + 1, v >> 1)

    return fs.while_loop(lambda c: c[1] > 1, body, (np.int32(0), x))[0]


def collatz_np(v):
    k = 0
    while v > 1:
        v, k = (3 * v + 1 if v % 2 else v // 2), k + 1
    return k


def test_while_loop_eager_jit_and_a_graph_loop():
    for v in (1, 6, 27):
        assert int(n(collatz_steps(t(np.int32(v))))) == collatz_np(v)
    f = fs.jit(collatz_steps)
    assert [int(n(f(t(np.int32(v))))) for v in (6, 7, 27)] == [collatz_np(v) for v in (6, 7, 27)]
    assert f.trace_count == 1
    assert "while " in f.lower(t(np.int32(6))).as_text()  # one MindSpore graph loop


def test_while_loop_vmap_runs_each_lane_to_its_own_end():
    vs = np.array([1, 6, 27, 7], np.int32)
    want = [collatz_np(v) for v in vs]
    assert n(fs.vmap(collatz_steps)(t(vs))).tolist() == want
    assert n(fs.jit(fs.vmap(collatz_steps))(t(vs))).tolist() == want

    def grow(limit, x):  # a batched carry with an unbatched condition, and vice versa
        return fs.while_loop(lambda c: c[0] < limit, lambda c: (c[0] + 1, c[1] * 2.0),
                             (np.int32(0), x))[1]

    xs = np.array([1.0, 2.0, 3.0], np.float32)
    assert n(fs.vmap(grow, in_axes=(None, 0))(t(np.int32(3)), xs)).tolist() == [8, 16, 24]
    limits = np.array([0, 1, 4], np.int32)
    assert n(fs.vmap(grow, in_axes=(0, None))(t(limits), np.float32(1))).tolist() == [1, 2, 16]


def newton_sqrt(a):
    """sqrt(a) by Newton's method until converged: forward-differentiable."""
    def body(c):
        x, _ = c
        new = 0.5 * (x + a / x)
        return new, fs.ops.abs(new - x).max()

    return fs.while_loop(lambda c: c[1] > 1e-12, body, (a, np.float64(1.0)))[0]


def test_while_loop_forward_mode_and_reverse_mode_error():
    a = np.array([2.0, 9.0, 0.25])
    assert_close(n(newton_sqrt(a)), np.sqrt(a), rtol=1e-12)
    _, tangent = fs.jvp(newton_sqrt, (a,), (np.ones(3),))
    assert_close(n(tangent), 0.5 / np.sqrt(a), rtol=1e-9)
    assert_close(n(fs.jacfwd(newton_sqrt)(a)), np.diag(0.5 / np.sqrt(a)), rtol=1e-9)
    with pytest.raises(fs.MissingRuleError, match="fs.fori_loop with static bounds or fs.scan"):
        fs.grad(lambda a: newton_sqrt(a).sum())(a)


def test_while_loop_under_shard_equals_unsharded():
    xs = np.arange(1, 9, dtype=np.float32)

    def f(x):
        y = fs.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 1.5 + 1),
                          (np.int32(0), x))[1]
        return y * 2

    assert_close(n(fs.shard(f, in_strategy=((4,),), mesh=4)(xs)), n(f(xs)))


def test_while_loop_errors():
    x = np.float32(1)
    with pytest.raises(fs.ProgramTypeError, match=r"(?s)body_fun.*must return the carry's"):
        fs.while_loop(lambda v: v < 3, lambda v: v.astype(ms.float64) + 1, x)
    with pytest.raises(fs.ProgramTypeError, match=r"differ at leaf \['n'\]: i32\[\] vs f32\[\]"):
        fs.while_loop(lambda c: c["n"] < 3, lambda c: {"n": c["n"] * 1.5, "x": c["x"]},
                      {"n": np.int32(0), "x": x})
    with pytest.raises(fs.ProgramTypeError, match="cond_fun.*one scalar bool"):
        fs.while_loop(lambda v: v + 1, lambda v: v, x)
    with pytest.raises(fs.ProgramTypeError, match="cond_fun.*one scalar bool"):
        fs.while_loop(lambda v: v < 3, lambda v: v, np.ones(2, np.float32))
    with pytest.raises(fs.ArgumentError, match="body_fun must be a function"):
        fs.while_loop(lambda v: v < 3, 3, x)
    with pytest.raises(fs.ArgumentError, match="init_val must be a pytree of arrays"):
        fs.while_loop(lambda v: v < 3, lambda v: v, "a")


# --- fori_loop ----------------------------------------------------------------------------


def power_iteration(m, v, steps, unroll=None):
    def body(i, v):
        w = fs.ops.matmul(m, v)
        return w / fs.ops.sqrt((w * w).sum())

    return fs.fori_loop(0, steps, body, v, unroll=unroll)


def test_fori_loop_static_unrolled_grad_and_while_form():
    rng = np.random.default_rng(0)
    m = rng.standard_normal((4, 4))
    m = m @ m.T
    v0 = np.ones(4)
    want = v0
    for _ in range(6):
        want = m @ want
        want = want / np.linalg.norm(want)
    assert_close(n(power_iteration(m, v0, 6)), want, rtol=1e-12)
    assert_close(n(fs.jit(lambda m, v: power_iteration(m, v, 6))(m, v0)), want, rtol=1e-12)
    # reverse mode through the unrolled loop, against central differences
    g = n(fs.grad(lambda m: power_iteration(m, v0, 6)[0])(m))
    eps, num = 1e-6, np.zeros_like(m)
    for i in range(4):
        for j in range(4):
            d = np.zeros_like(m)
            d[i, j] = eps
            num[i, j] = (n(power_iteration(m + d, v0, 6))[0]
                         - n(power_iteration(m - d, v0, 6))[0]) / (2 * eps)
    assert_close(g, num, rtol=1e-6, atol=1e-8)
    # unroll=False: one scan primitive (a graph loop), the same numbers and gradient
    ir = str(fs.make_ir(lambda v: fs.fori_loop(0, 6, lambda i, v: v * 2.0, v, unroll=False))(v0))
    assert "scan[" in ir and "while" not in ir
    assert n(fs.fori_loop(0, 6, lambda i, v: v * 2.0 + i, v0, unroll=False)).tolist() == \
        n(fs.fori_loop(0, 6, lambda i, v: v * 2.0 + i, v0)).tolist()
    assert_close(n(fs.jit(lambda m, v: power_iteration(m, v, 6, unroll=False))(m, v0)), want,
                 rtol=1e-12)
    g_loop = n(fs.jit(fs.grad(lambda m: power_iteration(m, v0, 6, unroll=False)[0]))(m))
    assert_close(g_loop, g, rtol=1e-10, atol=1e-12)


def test_fori_loop_traced_bounds_and_vmap():
    f = fs.jit(lambda lo, hi, x: fs.fori_loop(lo, hi, lambda i, v: v + i, x))
    assert float(n(f(t(np.int32(2)), t(np.int32(5)), np.float32(0)))) == 9.0
    assert float(n(f(t(np.int32(5)), t(np.int32(2)), np.float32(0)))) == 0.0  # no iteration
    his = np.array([0, 3, 5], np.int32)
    got = fs.vmap(lambda hi: fs.fori_loop(0, hi, lambda i, v: v + i, np.int32(0)))(t(his))
    assert n(got).tolist() == [0, 3, 10]
    with pytest.raises(fs.ArgumentError, match="unroll=True\\) needs static"):
        fs.fori_loop(t(np.int32(0)), 3, lambda i, v: v, np.float32(0), unroll=True)
    with pytest.raises(fs.ArgumentError, match="upper must be an integer scalar"):
        fs.fori_loop(0, np.float32(3), lambda i, v: v, np.float32(0))


def test_fori_loop_checks_the_carry_unrolled_as_in_a_graph_loop():
    init = {"a": np.float32(1), "b": np.int32(1)}
    for unroll in (True, False):
        with pytest.raises(fs.ProgramTypeError,
                           match=r"must return the carry's .* differ at leaf (\[1\])?\['b'\]: "
                                 r"i32\[\] vs f32\[\]"):
            fs.fori_loop(0, 3, lambda i, v: {"a": v["a"], "b": v["b"] * 2.0}, init,
                         unroll=unroll)
    with pytest.raises(fs.ProgramTypeError, match=r"leaf \(the value itself\): f32\[\] vs f64"):
        fs.jit(lambda x: fs.fori_loop(0, 3, lambda i, v: v.astype(ms.float64), x))(
            np.float32(1))


def test_a_training_loop_compiled_as_one_program():
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((32, 5)).astype(np.float32), rng.standard_normal((32, 1)).astype(np.float32)

    def loss(w):
        return ((fs.ops.matmul(x, w) - y) ** 2).mean()

    def train(w):
        return fs.fori_loop(0, 20, lambda i, w: w - 0.1 * fs.grad(loss)(w), w)

    w0 = np.zeros((5, 1), np.float32)
    w = w0
    for _ in range(20):
        w = w - 0.1 * n(fs.grad(loss)(w))
    assert_close(n(fs.jit(train)(w0)), w, rtol=1e-5)


# --- scan ---------------------------------------------------------------------------------


def rnn(params, xs):
    """An Elman RNN over time: h' = tanh(W h + U x); ys = h'."""
    w, u = params

    def cell(h, x):
        h = fs.ops.tanh(fs.ops.matmul(w, h) + fs.ops.matmul(u, x))
        return h, h

    return fs.scan(cell, np.zeros(3), xs)


def rnn_np(params, xs):
    w, u = params
    h, ys = np.zeros(3), []
    for x in xs:
        h = np.tanh(w @ h + u @ x)
        ys.append(h)
    return h, np.stack(ys)


def test_scan_matches_a_python_loop_under_jit_vmap_and_grad():
    rng = np.random.default_rng(2)
    params = (rng.standard_normal((3, 3)) * 0.5, rng.standard_normal((3, 2)))
    xs = rng.standard_normal((5, 2))
    h, ys = rnn(params, xs)
    h_np, ys_np = rnn_np(params, xs)
    assert_close(n(h), h_np, rtol=1e-12)
    assert_close(n(ys), ys_np, rtol=1e-12)
    h_j, ys_j = fs.jit(rnn)(params, xs)
    assert_close(n(ys_j), ys_np, rtol=1e-12)
    batch = rng.standard_normal((4, 5, 2))
    _, ys_v = fs.vmap(rnn, in_axes=(None, 0))(params, batch)
    assert_close(n(ys_v), np.stack([rnn_np(params, b)[1] for b in batch]), rtol=1e-12)
    g = fs.grad(lambda p: rnn(p, xs)[1].sum())(params)
    eps = 1e-6
    for k in range(2):
        num = np.zeros_like(params[k])
        for idx in np.ndindex(params[k].shape):
            d = np.zeros_like(params[k])
            d[idx] = eps
            plus = list(params)
            minus = list(params)
            plus[k], minus[k] = params[k] + d, params[k] - d
            num[idx] = (rnn_np(plus, xs)[1].sum() - rnn_np(minus, xs)[1].sum()) / (2 * eps)
        assert_close(n(g[k]), num, rtol=1e-6, atol=1e-9)


def test_scan_reverse_length_and_pytrees():
    xs = {"a": np.arange(4, dtype=np.float32), "b": np.ones((4, 2), np.float32)}
    carry, ys = fs.scan(lambda c, x: (c + x["a"], {"s": c, "b2": x["b"] * 2}),
                        np.float32(0), xs, reverse=True)
    assert float(n(carry)) == 6.0
    # reverse: the iterations run 3, 2, 1, 0 and ys stay in the order of xs
    assert n(ys["s"]).tolist() == [6.0, 5.0, 3.0, 0.0]
    assert n(ys["b2"]).shape == (4, 2)
    count, _ = fs.scan(lambda c, _: (c + 1, None), np.int32(0), None, length=7)
    assert int(n(count)) == 7
    with pytest.raises(fs.ArgumentError, match="leading axes of xs disagree"):
        fs.scan(lambda c, x: (c, x), 0.0, (np.ones(3), np.ones(4)))
    with pytest.raises(fs.ProgramTypeError, match=r"carry of the init's .* f32\[\] vs f64\[\]"):
        fs.scan(lambda c, x: (c.astype(ms.float64), x), np.float32(0), np.ones(3, np.float32))
    with pytest.raises(fs.ArgumentError, match=r"must return a pair \(carry, y\)"):
        fs.scan(lambda c, x: c, np.float32(0), np.ones(3, np.float32))
    with pytest.raises(fs.ArgumentError, match="with xs=None, pass length"):
        fs.scan(lambda c, x: (c, x), np.float32(0), None)


def _scan_step(c, x):
    """A pytree carry (a float state and an int count), pytree xs and ys."""
    h = np.tanh if isinstance(c["h"], np.ndarray) else fs.ops.tanh
    state = h(c["h"] * 0.9 + x[0] * x[1][:, None])
    return {"h": state, "k": c["k"] + np.int32(1)}, (state.sum(), {"k": c["k"], "x": x[1] * 2})


def _scan_np(c, xs, reverse):
    c = {"h": np.asarray(c["h"]), "k": np.asarray(c["k"])}
    length = xs[0].shape[0]
    ys = [None] * length
    for i in (reversed(range(length)) if reverse else range(length)):
        c, ys[i] = _scan_step(c, (xs[0][i], xs[1][i]))
    return c, (np.stack([y[0] for y in ys]),
               {"k": np.stack([y[1]["k"] for y in ys]),
                "x": np.stack([y[1]["x"] for y in ys])})


def _scan_inputs(length=7):
    rng = np.random.default_rng(5)
    c = {"h": rng.standard_normal((3, 2)), "k": np.int32(0)}
    xs = (rng.standard_normal((length, 3, 2)), rng.standard_normal((length, 3)))
    return c, xs


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("unroll", [1, 3, True])
def test_scan_graph_loop_equals_the_unrolled_scan_and_a_python_loop(unroll, reverse):
    """unroll=1 and 3 bind the scan primitive (one graph loop under jit, 3 body copies
    per iteration and a remainder of 1 for length 7); True unrolls. Every form equals
    a Python loop, eagerly, under jit and vmap; its gradient equals the unrolled one's."""
    c, xs = _scan_inputs()

    def run(c, xs, unroll=unroll):
        return fs.scan(_scan_step, c, xs, reverse=reverse, unroll=unroll)

    ir = str(fs.make_ir(run)(c, xs))
    assert ("scan[" in ir) == (unroll is not True), ir
    want = fs.tree.flatten(_scan_np(c, xs, reverse))[0]
    for got in (run(c, xs), fs.jit(run)(c, xs)):
        got = fs.tree.flatten(got)[0]
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert n(a).dtype == b.dtype
            assert_close(n(a), b, rtol=1e-12)
    # vmap over the batch of h and of the xs (axis 1 of both xs leaves)
    batch_c = {"h": np.stack([c["h"], -c["h"]]), "k": np.int32(0)}
    batch_xs = (np.stack([xs[0], xs[0] * 2], 1), np.stack([xs[1], -xs[1]], 1))
    for g in (fs.vmap(run, in_axes=({"h": 0, "k": None}, 1)),
              fs.jit(fs.vmap(run, in_axes=({"h": 0, "k": None}, 1)))):
        got = fs.tree.flatten(g(batch_c, batch_xs))[0]
        for lane in range(2):
            lane_want = fs.tree.flatten(_scan_np(
                {"h": batch_c["h"][lane], "k": np.int32(0)},
                (batch_xs[0][:, lane], batch_xs[1][:, lane]), reverse))[0]
            for a, b in zip(got, lane_want):  # out_axes=0: every output's lane
                assert_close(n(a)[lane], b, rtol=1e-12)

    def loss(h0, xs0, unroll):
        carry, (s, ys) = run({"h": h0, "k": np.int32(0)}, (xs0, xs[1]), unroll)
        return (carry["h"] ** 2).sum() + (s * s).sum() + ys["x"].sum()

    g_ref = fs.grad(loss, argnums=(0, 1))(c["h"], xs[0], True)
    for grad in (fs.grad(loss, argnums=(0, 1)), fs.jit(fs.grad(loss, argnums=(0, 1)),
                                                       static_argnums=2)):
        for a, b in zip(grad(c["h"], xs[0], unroll), g_ref):
            assert_close(n(a), n(b), rtol=1e-12)
    # forward mode through the primitive equals reverse mode
    tangent = np.ones_like(c["h"])
    _, jv = fs.jvp(lambda h0: loss(h0, xs[0], unroll), (c["h"],), (tangent,))
    assert_close(float(n(jv)), float((n(g_ref[0]) * tangent).sum()), rtol=1e-10)


@pytest.mark.full  # slow; the quick run covers it elsewhere
def test_the_gradient_of_a_graph_loop_scan_is_a_reverse_loop():
    """grad of a 300-step scan: a primal loop stacking residuals and a reverse loop, a
    program of a few equations whatever the length, equal to central differences."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 4)) * 0.3
    xs = rng.standard_normal((300, 4))

    def loss(w, unroll=1):
        _, ys = fs.scan(lambda c, x: (fs.ops.tanh(fs.ops.matmul(w, c) + x),) * 2,
                        np.zeros(4), xs, unroll=unroll)
        return (ys ** 2).sum()

    def loss_np(w):
        c, total = np.zeros(4), 0.0
        for x in xs:
            c = np.tanh(w @ c + x)
            total += (c ** 2).sum()
        return total

    program = fs.make_ir(fs.grad(loss))(w).program
    assert len(program.equations) < 30
    assert [eq.params["reverse"] for eq in program.equations if eq.prim.name == "scan"] == [
        False, True]
    g = n(fs.jit(fs.grad(loss))(w))
    eps, num = 1e-6, np.zeros_like(w)
    for idx in np.ndindex(w.shape):
        d = np.zeros_like(w)
        d[idx] = eps
        num[idx] = (loss_np(w + d) - loss_np(w - d)) / (2 * eps)
    assert_close(g, num, rtol=1e-6, atol=1e-8)
    assert_close(n(fs.grad(lambda w: loss(w, 7))(w)), num, rtol=1e-6, atol=1e-8)
    # second order: the Hessian-vector product through both loops
    v = rng.standard_normal((4, 4))
    _, hv = fs.jvp(fs.grad(loss), (w,), (v,))
    _, hv_ref = fs.jvp(fs.grad(lambda w: loss(w, True)), (w,), (v,))
    assert_close(n(hv), n(hv_ref), rtol=1e-8, atol=1e-10)


def test_scan_graph_loop_with_length_and_no_xs():
    def powers(x):
        return fs.scan(lambda c, _: (c * 2.0, c), x, None, length=5, unroll=1)

    assert "scan[" in str(fs.make_ir(powers)(np.float32(1)))
    for f in (powers, fs.jit(powers)):
        c, ys = f(np.float32(1.5))
        assert float(n(c)) == 48.0
        assert n(ys).tolist() == [1.5, 3.0, 6.0, 12.0, 24.0]
    assert_close(n(fs.grad(lambda x: powers(x)[1].sum())(np.float32(1.5))), 31.0)


def test_scan_chooses_a_graph_loop_for_long_or_large_loops():
    """unroll=None (the default): unrolled while length x body equations is at most
    SCAN_UNROLL_EQUATIONS, a graph loop beyond; length 0 returns empty ys."""
    from fshard.transforms.control_flow import SCAN_UNROLL_EQUATIONS

    def run(x, length):
        return fs.scan(lambda c, _: (c * 1.01 + 1.0, c), x, None, length=length)

    x = np.float32(0)
    short, long_ = 4, SCAN_UNROLL_EQUATIONS  # the body has 2 equations
    assert "scan[" not in str(fs.make_ir(lambda x: run(x, short))(x))
    assert "scan[" in str(fs.make_ir(lambda x: run(x, long_))(x))
    c, ys = fs.jit(lambda x: run(x, long_))(x)
    v, want = 0.0, []
    for _ in range(long_):
        want.append(v)
        v = np.float32(v * np.float32(1.01) + 1)
    assert_close(n(ys), np.array(want, np.float32), rtol=1e-6)
    c, ys = fs.scan(lambda c, x: (c + x, c * x), np.ones(3, np.float32),
                    np.zeros((0, 3), np.float32))
    assert n(c).tolist() == [1.0, 1.0, 1.0] and n(ys).shape == (0, 3)
    with pytest.raises(fs.ArgumentError, match=r"unroll=\.\.\.\): must be None, a bool or an int >= 1"):
        fs.scan(lambda c, x: (c, x), np.float32(0), np.ones(3, np.float32), unroll=0)


# --- cond and switch --------------------------------------------------------------------


def piecewise(x):
    return fs.cond(x.sum() > 0, lambda x: (x ** 2).sum(), lambda x: -x.sum() * 3.0, x)


def test_cond_concrete_traced_and_per_lane():
    pos, neg = np.array([1.0, 2.0]), np.array([-1.0, -2.0])
    assert float(n(piecewise(pos))) == 5.0 and float(n(piecewise(neg))) == 9.0
    f = fs.jit(piecewise)
    assert float(n(f(pos))) == 5.0 and float(n(f(neg))) == 9.0 and f.trace_count == 1
    assert n(fs.vmap(piecewise)(np.stack([pos, neg]))).tolist() == [5.0, 9.0]
    assert n(fs.grad(piecewise)(pos)).tolist() == [2.0, 4.0]
    assert n(fs.grad(piecewise)(neg)).tolist() == [-3.0, -3.0]
    assert n(fs.vmap(fs.grad(piecewise))(np.stack([pos, neg]))).tolist() == \
        [[2.0, 4.0], [-3.0, -3.0]]
    assert n(fs.jacfwd(piecewise)(pos)).tolist() == [2.0, 4.0]
    # integer predicates: nonzero is True
    assert float(n(fs.jit(lambda k, x: fs.cond(k, lambda x: x, lambda x: -x, x))(
        t(np.int32(5)), np.float32(2)))) == 2.0


def test_switch_clamps_and_selects_per_lane():
    branches = [lambda x: x - 1, lambda x: x * 10, lambda x: x ** 2]
    x = np.float32(3)
    for k, want in ((-2, 2.0), (0, 2.0), (1, 30.0), (2, 9.0), (7, 9.0)):
        assert float(n(fs.switch(k, branches, x))) == want
        assert float(n(fs.jit(lambda i, x: fs.switch(i, branches, x))(t(np.int32(k)), x))) == want
    ks = np.array([0, 1, 2, 5], np.int32)
    got = fs.vmap(lambda i, x: fs.switch(i, branches, x), in_axes=(0, None))(t(ks), x)
    assert n(got).tolist() == [2.0, 30.0, 9.0, 9.0]
    one = fs.jit(lambda i, x: fs.switch(i, [lambda x: x * 2], x))  # one branch: no choice
    assert float(n(one(t(np.int32(5)), x))) == 6.0


def test_cond_under_shard_equals_unsharded():
    xs = np.arange(16, dtype=np.float32).reshape(8, 2) - 5

    def f(x):
        return fs.vmap(lambda r: fs.cond(r.sum() > 0, lambda r: r * 2.0, lambda r: -r, r))(x)

    assert_close(n(fs.shard(f, in_strategy=((4, 1),), mesh=4)(xs)), n(f(xs)))


def _costly(x, w, sign):
    for _ in range(2):  # 2 x 2 * 64**3 flops: a graph if beats computing both branches
        x = fs.ops.tanh(fs.ops.matmul(x, w)) * sign
    return x


def test_cond_with_costly_branches_is_a_graph_if_under_jit():
    rng = np.random.default_rng(3)
    x, w = (rng.standard_normal((2, 64, 64)) * 0.2).astype(np.float32)

    def f(p, x, w):
        return fs.cond(p, lambda x, w: _costly(x, w, 1.0), lambda x, w: _costly(x, w, -1.0),
                       x, w)

    jf = fs.jit(f)
    for p in (True, False):
        assert_close(n(jf(np.bool_(p), x, w)), n(_costly(x, w, 1.0 if p else -1.0)))
    assert "if index <= 0" in jf.lower(np.bool_(True), x, w).as_text()  # one graph if
    assert " cond[" in str(fs.make_ir(f)(np.bool_(True), x, w))
    # cheap branches are lowered to a select of both
    assert "if index" not in fs.jit(piecewise).lower(np.array([1.0, 2.0])).as_text()
    # reverse mode: the gradient of the taken branch
    for p in (True, False):
        g = fs.jit(fs.grad(lambda x: f(np.bool_(p), x, w).sum()))(x)
        g_ref = fs.grad(lambda x: _costly(x, w, 1.0 if p else -1.0).sum())(x)
        assert_close(n(g), n(g_ref))
    # vmap: per-lane predicates select, a shared one keeps the graph if
    ps, xs = np.array([True, False]), np.stack([x[:8], -x[:8]])
    got = fs.jit(fs.vmap(f, in_axes=(0, 0, None)))(ps, xs, w)
    assert_close(n(got), np.stack([n(_costly(xs[0], w, 1.0)), n(_costly(xs[1], w, -1.0))]))
    got = fs.jit(fs.vmap(f, in_axes=(None, 0, None)))(np.bool_(False), xs, w)
    assert_close(n(got), np.stack([n(_costly(v, w, -1.0)) for v in xs]))
    # under shard each branch is partitioned as a per-device program of its own
    s = fs.shard(lambda x: f(x.sum() > 0, x, w), in_strategy=((4, 1),), mesh=4)
    assert_close(n(s(x)), n(f(np.bool_(x.sum() > 0), x, w)))
    assert_close(n(fs.jit(s)(x)), n(f(np.bool_(x.sum() > 0), x, w)))


def _central_difference(f, x, eps=1e-3):
    x = np.float64(x)
    return (float(n(f(x + eps))) - float(n(f(x - eps)))) / (2 * eps)


NAN_BRANCHES = {
    # (function of x, a point where a branch not taken is inf or NaN there, a point
    # where another branch is taken)
    "sqrt": (lambda x: fs.cond(x > 0, fs.ops.sqrt, lambda x: x * 1.5, x), -1.0, 4.0),
    "log": (lambda x: fs.cond(x > 0, fs.ops.log, lambda x: x * x, x), -2.0, 3.0),
    "division by zero": (lambda x: fs.cond(x < 1, lambda x: x * 3.0,
                                           lambda x: 1.0 / (x - x), x), -1.0, None),
    "switch of 3": (lambda x: fs.switch(
        fs.ops.cast(x > 0, ms.int32) + fs.ops.cast(x > 10, ms.int32),
        [lambda x: x * 2.0, fs.ops.log, lambda x: 1.0 / (x - x)], x), -3.0, 4.0),
}


@pytest.mark.parametrize("name", list(NAN_BRANCHES))
def test_the_derivative_of_a_cond_never_sees_the_branch_not_taken(name):
    """cond's JVP is a cond of the branches' JVPs and its transpose a cond of their
    transposes: the branch not taken is never differentiated, so its inf or NaN cannot
    reach the derivative (grad, jit(grad), jvp, jit(jvp)), which equals finite
    differences."""
    f, x0, x1 = NAN_BRANCHES[name]
    for x in (x0, x1) if x1 is not None else (x0,):
        want = _central_difference(f, x)
        x = np.float64(x)
        one = np.float64(1.0)
        for got in (fs.grad(f)(x), fs.jit(fs.grad(f))(x), fs.jvp(f, (x,), (one,))[1],
                    fs.jit(lambda x: fs.jvp(f, (x,), (one,))[1])(x)):
            assert np.isfinite(float(n(got))), got
            assert_close(float(n(got)), want, rtol=1e-5, atol=1e-6)


def test_the_nan_safe_derivative_of_cond_and_where_vmap_selects():
    """vmap(grad) keeps the guarantee (the chosen branch's derivative is selected per
    lane). grad(vmap) with a per-lane predicate runs both branches as a select, as
    JAX does, and then the branch not taken can make the gradient NaN."""
    f = NAN_BRANCHES["sqrt"][0]
    xs = np.array([-1.0, 4.0])
    assert n(fs.vmap(fs.grad(f))(xs)).tolist() == [1.5, 0.25]
    per_lane = n(fs.grad(lambda xs: fs.vmap(f)(xs).sum())(xs))
    assert np.isnan(per_lane[0]) and per_lane[1] == 0.25


def test_cond_and_switch_errors_name_both_branches():
    x = np.ones(3, np.float32)
    with pytest.raises(fs.ProgramTypeError,
                       match=r"false_fun vs true_fun differ at leaf .*: f32\[2\] vs f32\[3\]"):
        fs.cond(t(True), lambda x: x, lambda x: x[:2], x)
    with pytest.raises(fs.ProgramTypeError,
                       match=r"branches\[0\] vs branches\[1\] differ at structure"):
        fs.switch(0, [lambda x: x, lambda x: (x, x)], x)
    with pytest.raises(fs.ProgramTypeError,
                       match=r"differ at leaf \['b'\]: f64\[3\] vs f32\[3\]"):
        fs.cond(t(True), lambda x: {"a": x, "b": x},
                lambda x: {"a": x, "b": x.astype(ms.float64)}, x)
    with pytest.raises(fs.ArgumentError, match="pred must be a scalar bool or integer"):
        fs.cond(t(np.array([True, False])), lambda x: x, lambda x: x, x)
    with pytest.raises(fs.ArgumentError, match="pred must be a scalar bool or integer"):
        fs.cond(t(np.float32(1)), lambda x: x, lambda x: x, x)
    with pytest.raises(fs.ArgumentError, match="branches must be a non-empty list"):
        fs.switch(0, [], x)
    with pytest.raises(fs.ArgumentError, match="true_fun must be a function"):
        fs.cond(True, None, lambda x: x, x)


# --- layouts under shard ------------------------------------------------------------------


def _carry_programs():
    A, T, M = fs.ops.add, fs.ops.tanh, fs.ops.matmul
    return {
        "scan": lambda h, w, xs: fs.scan(lambda h, x: (T(A(M(h, w), x)),) * 2, h, xs),
        "scan unroll=1": lambda h, w, xs: fs.scan(lambda h, x: (T(A(M(h, w), x)),) * 2, h,
                                                  xs, unroll=1),
        "fori_loop unrolled": lambda h, w, xs: fs.fori_loop(
            0, 5, lambda i, h: T(A(M(h, w), xs[i])), h),
        "cond per row": lambda h, w, xs: fs.vmap(
            lambda r: fs.cond(r.sum() > 0, lambda r: r * 2.0, lambda r: -r, r))(h),
        "while_loop": lambda h, w, xs: fs.while_loop(
            lambda c: c[0] < 5, lambda c: (c[0] + 1, T(A(M(c[1], w), 1.0))),
            (np.int32(0), h))[1],
    }


@pytest.mark.parametrize("name", list(_carry_programs()))
def test_a_split_carry_keeps_its_layout_under_shard(name):
    """A batch-split carry stays split through scan, fori_loop, while_loop and cond: the
    per-device program has no collective."""
    rng = np.random.default_rng(0)
    h = rng.standard_normal((8, 4)).astype(np.float32)
    w = (rng.standard_normal((4, 4)) * 0.5).astype(np.float32)
    xs = rng.standard_normal((5, 8, 4)).astype(np.float32)
    f = _carry_programs()[name]
    out = ((4, 1), (1, 4, 1)) if name.startswith("scan") else (4, 1)
    s = fs.shard(f, in_strategy=((4, 1), (1, 1), (1, 4, 1)), out_strategy=out, mesh=4)
    got, want = fs.tree.flatten(s(h, w, xs))[0], fs.tree.flatten(f(h, w, xs))[0]
    for a, b in zip(got, want):
        assert_close(n(a), n(b))
    part = s.partitioned(h, w, xs)
    assert part.collectives() == []
    assert str(part.output_layouts()[0]).endswith("(('m0', 'm1'), 'None')")


def _loop_programs():
    T, M = fs.ops.tanh, fs.ops.matmul
    f32 = ms.float32

    def rnn(h, w, xs):  # 200 steps of a body of 4 equations: a graph loop
        return fs.scan(lambda h, x: (T(M(h, w) + x), (h * h).sum(1)), h, xs)

    def fori(h, w, xs):  # 300 static steps: a scan over (i, h)
        return fs.fori_loop(0, 300, lambda i, h: T(M(h, w) + fs.ops.cast(i, f32) * 1e-3), h)

    def while_(h, w, xs):  # a trip count known at run time, from the split carry
        return fs.while_loop(lambda h: (h * h).sum() > 0.5, lambda h: T(M(h, w)) * 0.9, h)

    return {"scan": (rnn, "scan"), "fori_loop": (fori, "scan"),
            "while_loop": (while_, "while")}


@pytest.mark.parametrize("mesh", ["8", "2x4"])
@pytest.mark.parametrize("name", list(_loop_programs()))
def test_a_sharded_loop_is_one_loop_of_the_per_device_program(name, mesh):
    """Under fs.shard a loop's body is partitioned as a per-device program of its own:
    the carry keeps its split layout (no gather of it, output layout = input layout),
    the loop stays one loop primitive (not unrolled), and the results equal the
    unsharded ones, eagerly and under jit."""
    rng = np.random.default_rng(1)
    h = rng.standard_normal((16, 4)).astype(np.float32)
    w = (rng.standard_normal((4, 4)) * 0.5).astype(np.float32)
    xs = rng.standard_normal((200, 16, 4)).astype(np.float32)
    f, prim = _loop_programs()[name]
    m = fs.Mesh((8,), ("d",)) if mesh == "8" else fs.Mesh((2, 4), ("dp", "mp"))
    split = (8, 1)
    out = ((8, 1), (1, 8)) if name == "scan" else (8, 1)
    s = fs.shard(f, in_strategy=(split, None, (1, 8, 1)), out_strategy=out, mesh=m)
    want = fs.tree.flatten(f(h, w, xs))[0]
    for got in (s(h, w, xs), fs.jit(s)(h, w, xs)):
        for a, b in zip(fs.tree.flatten(got)[0], want):
            scale = max(1.0, float(np.abs(n(b)).max()))
            assert_close(n(a), n(b), rtol=1e-4, atol=1e-5 * scale)
    part = s.partitioned(h, w, xs)
    names = [eq.prim.name for eq in part.program.equations]
    assert names == [prim], part  # one loop, the carry never gathered
    assert str(part.output_layouts()[0]) == str(part.input_layouts()[-3])  # h's
    cond_program = part.program.equations[0].params.get("cond")
    if name == "while_loop":  # the condition's sum over the split carry, inside the loop
        assert part.collectives() == ["psum"]
        assert [eq.prim.name for eq in cond_program.equations].count("psum") == 1
    else:  # each step's y sums over a dimension that is not split: no communication
        assert part.collectives() == []


def _rnn_with_loss(h, w, xs):
    def step(h, x):
        h = fs.ops.tanh(fs.ops.matmul(h, w) + x)
        return h, (h * h).sum()  # a scalar per step: a sum over the split batch
    return fs.scan(step, h, xs, unroll=1)


def test_a_loop_reducing_its_split_carry_keeps_it_split(monkeypatch):
    """A body that sums its split carry to a scalar (a loss) keeps the carry split and
    reduces inside the loop (a small AllReduce per step). With such reductions blocked
    (as a large contraction is), the loop receives its operands whole and the body's
    own propagation splits work inside it: the body then slices and sums over the mesh
    while the loop's operands are not split, which the virtual mesh must still run as
    one loop per device."""
    from fshard.primitives import control
    from fshard.sharding import propagation

    rng = np.random.default_rng(4)
    h = rng.standard_normal((8, 4)).astype(np.float32)
    w = (rng.standard_normal((4, 4)) * 0.5).astype(np.float32)
    xs = rng.standard_normal((200, 8, 4)).astype(np.float32)
    want = _rnn_with_loss(h, w, xs)
    for blocked in (False, True):
        if blocked:  # (and sums of whole values left split, to keep the body's split)
            monkeypatch.setattr(control, "_small_result", lambda eq: False)
            monkeypatch.setattr(propagation, "_whole_reductions", lambda *a: None)
        s = fs.shard(_rnn_with_loss, in_strategy=((8, 1), None, (1, 8, 1)),
                     out_strategy=((8, 1), None), mesh=8)
        part = s.partitioned(h, w, xs)
        names = [eq.prim.name for eq in part.program.equations]
        if not blocked:
            assert names == ["scan"] and part.collectives() == ["psum"]
        else:  # whole operands in, work split inside the body
            assert part.collectives()[:2] == ["all_gather", "all_gather"]
            assert "block_slice" in [e.prim.name for e in
                                      part.program.equations[names.index("scan")]
                                      .params["body"].equations]
        for got in (s(h, w, xs), fs.jit(s)(h, w, xs)):
            for a, b in zip(got, want):
                assert_close(n(a), n(b), rtol=1e-4, atol=1e-5 * max(1.0, float(
                    np.abs(n(b)).max())))


@pytest.mark.full  # slow: the full matrix (the quick run covers the feature elsewhere)
def test_a_long_sharded_scan_compiles_as_a_loop_and_its_gradient_matches():
    """A 300-step scan under fs.shard stays one scan primitive in the per-device
    program (so its compile time does not grow with the length), and the gradient of
    the sharded scan, either way round, equals the unsharded one."""
    rng = np.random.default_rng(2)
    h = rng.standard_normal((8, 4)).astype(np.float32)
    w = (rng.standard_normal((4, 4)) * 0.5).astype(np.float32)
    xs = rng.standard_normal((300, 8, 4)).astype(np.float32)

    def loss(h, w, xs):
        c, ys = fs.scan(lambda h, x: (fs.ops.tanh(fs.ops.matmul(h, w) + x),) * 2, h, xs)
        return (ys ** 2).sum() + c.sum()

    s = fs.shard(loss, in_strategy=((8, 1), None, (1, 8, 1)), mesh=8)
    part = s.partitioned(h, w, xs)
    scans = [eq for eq in part.program.equations if eq.prim.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 300
    assert len(part.program.equations) < 10  # not unrolled
    assert "while i < 300" in fs.jit(s).lower(h, w, xs).as_text()
    assert_close(n(fs.jit(s)(h, w, xs)), n(loss(h, w, xs)), rtol=1e-4)
    want = fs.grad(loss, argnums=(0, 1))(h, w, xs)
    for got in (fs.grad(s, argnums=(0, 1))(h, w, xs),
                fs.jit(fs.shard(fs.grad(loss, argnums=(0, 1)), in_strategy=(
                    (8, 1), None, (1, 8, 1)), mesh=8))(h, w, xs)):
        for a, b in zip(got, want):
            assert_close(n(a), n(b), rtol=1e-4, atol=1e-4 * float(np.abs(n(b)).max()))


# --- a functional training loop as one program --------------------------------------------


def _digits_steps(k, b=32):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x[:k * b] / 16).astype(np.float32), y[:k * b].astype(np.int32)
    return x.reshape(k, b, 64), y.reshape(k, b)


def _dropout_mlp_step(opt):
    def loss(p, key, x, y):
        h = fs.ops.relu(fs.ops.matmul(x, p["w1"]) + p["b1"])
        h = fs.nn.dropout(key, h, 0.1)
        return fs.ops.softmax_cross_entropy(fs.ops.matmul(h, p["w2"]) + p["b2"], y)

    def step(carry, batch):
        params, opt_state, key = carry
        key, sub = fs.random.split(key)
        value, grads = fs.value_and_grad(loss)(params, sub, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (fs.optim.apply_updates(params, updates), opt_state, key), value

    return step


def test_a_scan_over_training_steps_equals_the_jitted_steps():
    rng = np.random.default_rng(0)
    params = {"w1": (rng.standard_normal((64, 32)) * 0.1).astype(np.float32),
              "b1": np.zeros(32, np.float32),
              "w2": (rng.standard_normal((32, 10)) * 0.1).astype(np.float32),
              "b2": np.zeros(10, np.float32)}
    opt = fs.optim.adam(1e-2)
    step = _dropout_mlp_step(opt)
    xs, ys = _digits_steps(3)
    carry = (params, opt.init(params), fs.random.key(0))
    (p_scan, _, key_scan), losses = fs.jit(
        lambda c, xs, ys: fs.scan(step, c, (xs, ys)))(carry, xs, ys)
    jstep, c, looped = fs.jit(step), carry, []
    for k in range(3):
        c, value = jstep(c, (xs[k], ys[k]))
        looped.append(float(n(value)))
    assert n(losses).tolist() == looped  # bit-identical
    assert n(key_scan).tolist() == n(c[2]).tolist()
    for name in params:
        assert n(p_scan[name]).tobytes() == n(c[0][name]).tobytes()


# --- loops inside fs.shard_map ---------------------------------------------------------


def _smap_rnn(w, h, xs):
    """This device's rows of an RNN whose every step reads the sum over all devices
    (a psum in the body); ys: the global sum of the state, the same on every device."""
    def step(c, x):
        c = fs.ops.tanh(c @ w + x + 0.01 * fs.psum(c.sum(0), "d"))
        return c, fs.psum(c.sum(), "d")

    return fs.scan(step, h, xs)


def _global_rnn(w, h, xs):
    """``_smap_rnn`` on the whole batch at once: what the shard_map must equal."""
    def step(c, x):
        c = fs.ops.tanh(c @ w + x + 0.01 * c.sum(0))
        return c, c.sum()

    return fs.scan(step, h, xs)


def _rnn_np(w, h, xs):
    c, ys = h.astype(np.float64), []
    for x in xs:
        c = np.tanh(c @ w + x + 0.01 * c.sum(0))
        ys.append(c.sum())
    return c, np.array(ys)


_SMAP_RNN = ((None, (8, 1), (1, 8, 1)), ((8, 1), None))


def _rnn_inputs(steps=300):
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((4, 4)) * 0.4).astype(np.float32)
    h = (rng.standard_normal((16, 4)) * 0.3).astype(np.float32)
    xs = (rng.standard_normal((steps, 16, 4)) * 0.3).astype(np.float32)
    return w, h, xs


@pytest.mark.full  # slow: the full matrix (the quick run covers the feature elsewhere)
def test_a_long_scan_inside_shard_map_is_one_loop_with_its_psum_inside():
    """A 300-step scan with a psum in its body, inside shard_map on a virtual mesh of
    8: one scan primitive (a graph loop under jit, not 300 copies of the body), equal
    to a NumPy loop over the global batch, and its gradient equal to the unsharded
    scan's."""
    w, h, xs = _rnn_inputs()
    mesh = fs.Mesh((8,), ("d",))
    sm = fs.shard_map(_smap_rnn, *_SMAP_RNN, mesh=mesh)
    program = fs.make_ir(sm)(w, h, xs).program
    scans = [eq for eq in program.equations if eq.prim.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 300
    assert len(program.equations) < 20  # not unrolled
    assert "while i < 300" in fs.jit(sm).lower(w, h, xs).as_text()
    c, ys = fs.jit(sm)(w, h, xs)
    c_np, ys_np = _rnn_np(w, h, xs)
    assert_close(n(c), c_np, rtol=1e-4, atol=1e-5)
    assert_close(n(ys), ys_np, rtol=1e-4, atol=1e-4 * float(np.abs(ys_np).max()))

    def loss(run):
        def f(w, h, xs):
            c, ys = run(w, h, xs)
            return (c ** 2).sum() + ys.sum()
        return f

    want = fs.grad(loss(_global_rnn), argnums=(0, 1))(w, h, xs)
    for got in (fs.grad(loss(fs.jit(sm)), argnums=(0, 1))(w, h, xs),
                fs.jit(fs.grad(loss(sm), argnums=(0, 1)))(w, h, xs)):
        for a, b in zip(got, want):
            assert_close(n(a), n(b), rtol=1e-4, atol=1e-4 * float(np.abs(n(b)).max()))


def test_fori_loop_and_while_loop_inside_shard_map_stay_loops():
    """A 300-step fori_loop (a scan) and a while_loop whose condition reads a psum, both
    inside shard_map: one loop each, equal to NumPy; the fori_loop's gradient equals
    the unsharded one. The while loop's carry, replicated by the psum, stays
    replicated (its output needs no split)."""
    w, h, _ = _rnn_inputs()
    mesh = fs.Mesh((8,), ("d",))

    def fori(w, h):
        def body(i, c):
            return fs.ops.tanh(c @ w + 0.01 * fs.psum(c.sum(0), "d") + 0.001 * i)
        return fs.fori_loop(0, 300, body, h)

    def fori_global(w, h):
        return fs.fori_loop(0, 300, lambda i, c: fs.ops.tanh(c @ w + 0.01 * c.sum(0)
                                                             + 0.001 * i), h)

    sm = fs.shard_map(fori, (None, (8, 1)), (8, 1), mesh=mesh)
    names = [eq.prim.name for eq in fs.make_ir(sm)(w, h).program.equations]
    assert names.count("scan") == 1 and len(names) < 20
    c = h.astype(np.float64)
    for i in range(300):
        c = np.tanh(c @ w + 0.01 * c.sum(0) + 0.001 * i)
    assert_close(n(fs.jit(sm)(w, h)), c, rtol=1e-4, atol=1e-5)
    want = fs.grad(lambda w, h: (fori_global(w, h) ** 2).sum(), argnums=(0, 1))(w, h)
    got = fs.grad(lambda w, h: (fs.jit(sm)(w, h) ** 2).sum(), argnums=(0, 1))(w, h)
    for a, b in zip(got, want):
        assert_close(n(a), n(b), rtol=1e-4, atol=1e-4 * float(np.abs(n(b)).max()))

    def shrink(h):
        def cond(c):
            return fs.psum((c[1] ** 2).sum(), "d") > 0.5

        def body(c):
            return c[0] + 1, c[1] * 0.9, fs.psum(c[1].sum(), "d")

        return fs.while_loop(cond, body, (np.int32(0), h, np.float32(0)))

    sw = fs.shard_map(shrink, ((8, 1),), (None, (8, 1), None), mesh=mesh)
    names = [eq.prim.name for eq in fs.make_ir(sw)(h).program.equations]
    assert names.count("while") == 1 and len(names) < 20
    k, v, total = h.astype(np.float64), 0, 0.0
    while (k ** 2).sum() > 0.5:
        v, total, k = v + 1, k.sum(), k * 0.9
    assert v > 3
    for run in (sw, fs.jit(sw)):
        got_k, got_v, got_total = run(h)
        assert int(n(got_k)) == v
        assert_close(n(got_v), k, rtol=1e-4, atol=1e-6)
        assert_close(float(n(got_total)), total, rtol=1e-4, atol=1e-5)


def _reverse_scan(program):
    scans = [eq for eq in program.equations if eq.prim.name == "scan" and eq.params["reverse"]]
    assert len(scans) == 1
    return scans[0]


@pytest.mark.parametrize("linear", [True, pytest.param(False, marks=pytest.mark.full)],
                         ids=["accumulated", "nonlinear carry"])
def test_a_reverse_loop_accumulates_weight_gradients_as_a_pending_sum(linear):
    """grad of a sharded 200-step RNN scan: the reverse loop keeps the batch split, each
    device sums its share of the weight gradient in the carry, and one psum per weight
    gradient runs after the loop. A carry the body uses non-linearly keeps the gathered
    path; both equal the unsharded gradient."""
    from fshard.primitives.collectives import COLLECTIVES

    rng = np.random.default_rng(3)
    h = rng.standard_normal((16, 4)).astype(np.float32)
    w = (rng.standard_normal((4, 4)) * 0.5).astype(np.float32)
    xs = rng.standard_normal((200, 16, 4)).astype(np.float32)

    def loss(w, h, xs):
        def body(c, x):
            c = fs.ops.tanh(fs.ops.matmul(c, w) + x)
            return c, c.sum()
        c, ys = fs.scan(body, h, xs)
        return (c * c).sum() + ys.sum()

    g = fs.grad(loss)
    want = n(g(w, h, xs))
    sg = fs.shard(g, in_strategy=(None, (8, 1), (1, 8, 1)), mesh=8)
    gs = fs.grad(fs.shard(loss, in_strategy=(None, (8, 1), (1, 8, 1)), mesh=8))
    for got in (sg(w, h, xs), gs(w, h, xs)):
        assert_close(n(got), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    part = sg.partitioned(w, h, xs)
    assert "all_gather" not in part.collectives()  # the batch is never gathered
    rev = _reverse_scan(part.program)
    assert not any(eq.prim in COLLECTIVES for eq in rev.params["body"].equations)
    n_c = rev.params["n_consts"]
    carries = [v.aval.shape for v in rev.inputs[n_c:n_c + rev.params["n_carry"]]]
    assert (2, 4) in carries  # the cotangent of h stays split 8 ways
    after = part.program.equations[part.program.equations.index(rev) + 1:]
    assert [eq.prim.name for eq in after if eq.prim in COLLECTIVES] == ["psum"]
    partial = [part.annotations[v].partial for v in rev.outputs]
    assert [len(p) for p in partial] == [0, 3]  # the weight gradient: a sum over 8

    if linear:
        return
    # The same gradient accumulated non-linearly (tanh(acc) + ...): no pending carry.
    def loss2(w, h, xs):
        def body(carry, x):
            c, acc = carry
            c = fs.ops.tanh(fs.ops.matmul(c, w) + x)
            return (c, fs.ops.tanh(acc) + fs.ops.matmul(c.T, c)), c.sum()
        (c, acc), ys = fs.scan(body, (h, fs.ops.zeros((4, 4), np.float32)), xs)
        return (c * c).sum() + ys.sum() + acc.sum()

    g2 = fs.grad(loss2)
    want2 = n(g2(w, h, xs))
    s2 = fs.shard(g2, in_strategy=(None, (8, 1), (1, 8, 1)), mesh=8)
    assert_close(n(s2(w, h, xs)), want2, rtol=1e-4, atol=1e-4 * float(np.abs(want2).max()))
    part2 = s2.partitioned(w, h, xs)
    for eq in part2.program.equations:
        if eq.prim.name == "scan" and not eq.params["reverse"]:  # acc feeds tanh
            assert not any(part2.annotations[v].partial for v in eq.outputs)
