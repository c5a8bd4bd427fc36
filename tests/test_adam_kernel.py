"""``adam_update``: fs.optim.adam's moments and update on MindSpore's fused Adam kernel,
which writes in place. The kernel must only ever write buffers of its own (never the
caller's moments), give MindSpore's numbers, and compose with every transform."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs
from fshard.primitives.optimizers import adam_update

SHAPES = [(3, 4), (5,), (), (2, 2, 2)]


def _leaves(seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    m = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    v = [rng.uniform(0.1, 2.0, s).astype(np.float32) for s in shapes]
    g = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    return m, v, g


def _reference(m, v, g, lr, b1=0.9, b2=0.999, eps=1e-8):
    m2 = [b1 * a.astype(np.float64) + (1 - b1) * c for a, c in zip(m, g)]
    v2 = [b2 * b.astype(np.float64) + (1 - b2) * c.astype(np.float64) ** 2
          for b, c in zip(v, g)]
    return m2, v2, [-lr * a / (np.sqrt(b) + eps) for a, b in zip(m2, v2)]


def _close(got, want):
    for a, b in zip(got, want):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a.asnumpy(), np.float64), b, rtol=2e-6,
                                   atol=2e-6 * max(1.0, float(np.abs(b).max(initial=0))))


def _update(m, v, g, lr):
    return adam_update(m, v, g, lr, b1=0.9, b2=0.999, eps=1e-8)


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("n", [1, 4])
def test_the_kernel_never_writes_its_operands(how, n):
    m, v, g = _leaves(shapes=SHAPES[:n])
    tm, tv, tg = ([ms.Tensor(a) for a in xs] for xs in (m, v, g))
    lr = ms.Tensor(np.float32(1e-2))
    f = _update if how == "eager" else fs.jit(_update)
    for _ in range(2):  # a second call would see a first call's writes
        outs = f(tm, tv, tg, lr)
        for t, a in zip(tm + tv + tg, m + v + g):
            np.testing.assert_array_equal(t.asnumpy(), a)
    want = _reference(m, v, g, 1e-2)
    for got, ref in zip(outs, want):
        _close(got, ref)


def test_a_calls_outputs_survive_the_next_call():
    """The kernel's buffers belong to the compiled function and every call overwrites
    them: a call's moments are copies (or cuts) of them, which the next call leaves
    alone (read only after it). Leaves of whole 16-float blocks and padded ones."""
    shapes = [(16, 4), (5,), (3, 7)]
    m, v, g = _leaves(8, shapes=shapes)
    f = fs.jit(_update)
    want = [x.asnumpy() for o in f(m, v, g, np.float32(1e-2)) for x in o]
    again = [x for o in f(m, v, g, np.float32(1e-2)) for x in o]
    f(*_leaves(9, shapes=shapes), np.float32(1e-2))
    for got, w in zip(again, want):
        np.testing.assert_array_equal(got.asnumpy(), w)


def test_eager_and_compiled_give_the_same_bits():
    m, v, g = _leaves(1)
    lr = np.float32(3e-3)
    eager = _update(m, v, g, lr)
    compiled = fs.jit(_update)(m, v, g, lr)
    for a, b in zip(eager, compiled):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.asnumpy(), y.asnumpy())


def test_float32_leaves_share_one_update():
    rng = np.random.default_rng(2)
    params = {"big": rng.standard_normal((300, 300)).astype(np.float32),
              "w": rng.standard_normal((3, 4)).astype(np.float32),
              "b": np.zeros(4, np.float32)}
    opt = fs.optim.adam(1e-3)
    state = opt.init(params)
    grads = fs.tree.map(lambda p: np.ones_like(p), params)
    program = fs.make_ir(lambda g, s, p: opt.update(g, s, p))(grads, state, params).program
    eqs = [eq for eq in program.equations if eq.prim.name == "adam_update"]
    # every float32 leaf, large or small, in one equation (a kernel per leaf)
    assert [len(eq.inputs) // 3 for eq in eqs] == [3]
    # the float64 leaves of another model keep the elementwise update
    p64 = fs.tree.map(lambda p: p.astype(np.float64), params)
    program = fs.make_ir(lambda g, s, p: opt.update(g, s, p))(
        fs.tree.map(lambda p: np.ones_like(p), p64), opt.init(p64), p64).program
    assert not [eq for eq in program.equations if eq.prim.name == "adam_update"]


class _Net(nn.Cell):
    def __init__(self, params):
        super().__init__()
        self.w = ms.Parameter(ms.Tensor(params["w"]), name="w")
        self.b = ms.Parameter(ms.Tensor(params["b"]), name="b")


@pytest.mark.parametrize("rows,cols", [(6, 5), (300, 256)])
def test_steps_match_nn_adam(rows, cols):
    """MindSpore's nn.Adam runs the same kernel family: the parameters agree to a few
    float32 ulps after several steps (the decomposed update drifted to 1e-5), a matrix
    larger than 65,536 floats too."""
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((rows, cols)).astype(np.float32),
              "b": rng.standard_normal(cols).astype(np.float32)}
    net = _Net(params)
    ms_opt = nn.Adam(net.trainable_params(), learning_rate=0.05)
    opt = fs.optim.adam(0.05)
    state = opt.init(params)
    @fs.jit
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return fs.optim.apply_updates(p, u), s

    p = params
    for t in range(6):
        g = {"w": rng.standard_normal((rows, cols)).astype(np.float32),
             "b": rng.standard_normal(cols).astype(np.float32)}
        ms_opt((ms.Tensor(g["w"]), ms.Tensor(g["b"])))
        p, state = step(p, state, g)
    for k in ("w", "b"):
        want = getattr(net, k).asnumpy()
        np.testing.assert_allclose(p[k].asnumpy(), want, rtol=0,
                                   atol=8 * np.finfo(np.float32).eps * np.abs(want).max())


def test_vmap_over_an_ensemble_with_its_own_step_counts():
    """Each member's bias correction differs (a batched learning rate): the update is
    then computed elementwise, and equals a loop of single updates (on the kernel, which
    takes ``1 - b2`` in float32: 1.3e-5 below 0.001, so ``v`` and ``u`` differ by a few
    1e-6 relative)."""
    opt = fs.optim.adam(1e-2)
    rng = np.random.default_rng(4)
    params = {"w": rng.standard_normal((3, 2, 3)).astype(np.float32)}
    grads = {"w": rng.standard_normal((3, 2, 3)).astype(np.float32)}
    states = fs.vmap(opt.init)(params)
    states = states._replace(count=np.array([0, 3, 7], np.int32))

    def one(g, s):
        return opt.update(g, s)

    got_u, got_s = fs.jit(fs.vmap(one))(grads, states)
    for i in range(3):
        s_i = fs.tree.map(lambda x, i=i: x[i], states)
        u, s = one({"w": grads["w"][i]}, s_i)
        np.testing.assert_allclose(got_u["w"].asnumpy()[i], u["w"].asnumpy(), rtol=2e-5,
                                   atol=1e-9)
        np.testing.assert_allclose(got_s.nu["w"].asnumpy()[i], s.nu["w"].asnumpy(),
                                   rtol=2e-5)


def test_gradient_through_an_adam_step():
    """A meta-gradient (the loss after one Adam step, differentiated in the initial
    parameters) through the kernel equals the one through the elementwise formulas."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 3)).astype(np.float32)
    p0 = {"w": rng.standard_normal(3).astype(np.float32)}
    opt = fs.optim.adam(0.1)

    def loss(p):
        return ((x @ p["w"]) ** 2).mean()

    def after_step(p, update):
        s = opt.init(p)
        g = fs.grad(loss)(p)
        u, _ = update(g, s, p)
        return loss(fs.optim.apply_updates(p, u))

    def by_formulas(g, s, p):  # nn.Adam's maths written out
        m = g["w"] * (1 - 0.9)
        v = g["w"] * g["w"] * (1 - 0.999)
        rate = 0.1 * np.sqrt(1 - 0.999) / (1 - 0.9)
        return {"w": -rate * m / (fs.ops.sqrt(v) + 1e-8)}, s

    got = fs.jit(fs.grad(lambda p: after_step(p, opt.update)))(p0)["w"].asnumpy()
    want = fs.jit(fs.grad(lambda p: after_step(p, by_formulas)))(p0)["w"].asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


def test_moments_made_inside_the_compiled_function():
    """``init`` inside the compiled step makes both moments the same constant zeros,
    which a graph compiler folds and merges: the kernel must still update each of its
    own buffers, at every call."""
    rng = np.random.default_rng(6)
    params = {"w": rng.standard_normal((3, 4)).astype(np.float32),
              "b": rng.standard_normal(4).astype(np.float32)}
    grads = fs.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)
    opt = fs.optim.adam(0.1)

    def first_step(g, p):
        u, s = opt.update(g, opt.init(p), p)
        return u, s.mu, s.nu

    want = first_step(grads, params)
    f = fs.jit(first_step)
    for _ in range(3):
        got = f(grads, params)
        for a, b in zip(fs.tree.leaves(got), fs.tree.leaves(want)):
            np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    # the kernel takes 1 - b2 in float32: 1.3e-5 below 0.001
    np.testing.assert_allclose(got[2]["w"].asnumpy(), 0.001 * grads["w"] ** 2, rtol=3e-5)


def test_every_call_gives_the_same_bits():
    """MindSpore tunes how its threads share the kernel's buffer over the first calls;
    the padding to whole SIMD blocks keeps every element's rounding the same (36
    elements changed 4 of them between calls 4 and 14 without it; these leaves, 440
    elements over 30 calls). Large leaves are shared among threads: one a whole number
    of blocks, the others padded."""
    m, v, g = _leaves(7, shapes=[(8, 4), (4,), (1000,), (12345,), (300, 301), (304, 300)])
    f = fs.jit(_update)
    first = [x.asnumpy() for o in f(m, v, g, np.float32(1e-3)) for x in o]
    for _ in range(30):
        again = [x.asnumpy() for o in f(m, v, g, np.float32(1e-3)) for x in o]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
