"""Passes that cut the kernels of a compiled program without changing a value: the
lowering leaves broadcasts to MindSpore's arithmetic kernels
(``passes.implicit_broadcasts``), a negation read once moves past a sum or into a
subtraction (``passes.sink_neg``), and ``x * y`` / ``y * x`` are computed once
(``passes.cse``)."""

import numpy as np
import pytest

import fshard as fs
from fshard.primitives import passes

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 3, 5, 5)).astype(np.float32)
W = RNG.standard_normal(3).astype(np.float32)


def _close(got, want):
    got = np.asarray(got.asnumpy() if hasattr(got, "asnumpy") else got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(want).max()))


def _lowered_ops(f, *args) -> list:
    src = fs.jit(f).lower(*args).source
    body = src.split("\n\n")[0].splitlines()[1:]
    return [line.split("= ", 1)[1].split("(")[0] for line in body if " = " in line]


def test_scalar_and_per_channel_broadcasts_are_left_to_the_kernels():
    def f(x, w):
        return (x * 0.5 + fs.ops.reshape(w, (1, 3, 1, 1))) / 3.0 - fs.ops.maximum(x, 0.1)

    ops = _lowered_ops(f, X, W)
    assert not any("broadcast_to" in o for o in ops), ops
    _close(fs.jit(f)(X, W), (X * 0.5 + W[None, :, None, None]) / 3.0 - np.maximum(X, 0.1))


def test_a_broadcast_read_elsewhere_is_kept():
    def f(x, w):
        b = fs.ops.broadcast_to(fs.ops.reshape(w, (1, 3, 1, 1)), X.shape)
        return x * b, b.sum((0, 2, 3)), b

    ops = _lowered_ops(f, X, W)
    assert sum("broadcast_to" in o for o in ops) == 1, ops
    y, s, b = fs.jit(f)(X, W)
    full = np.broadcast_to(W[None, :, None, None], X.shape)
    _close(y, X * full)
    _close(s, full.sum((0, 2, 3)))
    _close(b, full)


def test_both_operands_broadcast_to_a_larger_shape():
    a = RNG.standard_normal((1, 3)).astype(np.float32)
    c = RNG.standard_normal((2, 1)).astype(np.float32)

    def f(a, c):
        return fs.ops.broadcast_to(a, (2, 3)) * fs.ops.broadcast_to(c, (2, 3))

    assert fs.jit(f)(a, c).shape == (2, 3)
    _close(fs.jit(f)(a, c), a * c)


def test_gradients_and_optimizer_update_unchanged():
    def loss(w, x):
        return ((x * fs.ops.reshape(w, (1, 3, 1, 1))) ** 2).mean()

    g = fs.jit(fs.grad(loss))(W, X)
    _close(g, (2 * X ** 2 * W[None, :, None, None]).mean((0, 2, 3)) / 3)
    opt = fs.optim.adam(0.1)
    params = {"w": W}
    state = opt.init(params)

    def update(p, s, g):
        u, s = opt.update(g, s, p)
        return fs.optim.apply_updates(p, u), s

    assert not any("broadcast_to" in o for o in _lowered_ops(update, params, state, params))
    got, _ = fs.jit(update)(params, state, params)
    want, _ = update(params, state, params)  # eager: the Program as traced
    _close(got["w"], want["w"].asnumpy())


def test_the_pass_leaves_a_program_without_broadcasts_alone():
    ir = fs.make_ir(lambda x: x * x)(X)
    assert passes.implicit_broadcasts(ir.program) is ir.program


@pytest.mark.parametrize("dtype", [np.int32, np.float16])
def test_other_dtypes(dtype):
    x = (X * 4).astype(dtype)
    _close(fs.jit(lambda x: x * 2 + 1)(x), (x * 2 + 1))


def _prims(program) -> list:
    return [eq.prim.name for eq in program.equations]


def test_sink_neg_and_commutative_cse_are_exact():
    def f(a, b):
        s = fs.ops.neg(a * b).sum(0)          # reduce_sum(neg) -> neg(reduce_sum)
        d = a + fs.ops.neg(b)                 # add(a, neg b) -> sub(a, b)
        return s, d, b * a + a * b            # b * a is a * b

    prog = passes.simplify(fs.make_ir(f)(X[0, 0], X[1, 1]).program)
    names = _prims(prog)
    assert names.count("mul") == 1 and "sub" in names, names
    assert names.index("reduce_sum") < names.index("neg"), names
    a, b = X[0, 0], X[1, 1]
    got = fs.jit(f)(a, b)
    want = [-(a * b).sum(0), a - b, 2 * (a * b)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.asnumpy(), w.astype(np.float32))


def test_a_neg_read_twice_stays():
    def f(a):
        n = fs.ops.neg(a)
        return n.sum(0), n * 2.0

    prog = passes.simplify(fs.make_ir(f)(X[0, 0]).program)
    assert _prims(prog).count("neg") == 1
    s, m = fs.jit(f)(X[0, 0])
    np.testing.assert_array_equal(s.asnumpy(), -X[0, 0].sum(0))
    np.testing.assert_array_equal(m.asnumpy(), -X[0, 0] * 2.0)


def test_kernel_counts_of_a_training_step():
    """The elementwise Adam update of one parameter: 12 full-size kernels, down from 18 as
    traced (broadcasts of the constants). float64: a float32 leaf runs the fused kernel."""
    opt = fs.optim.adam(1e-3)
    params = {"w": np.asarray(X[0], np.float64)}
    state = opt.init(params)

    def update(p, s, g):
        u, s = opt.update(g, s, p)
        return fs.optim.apply_updates(p, u), s

    prog = fs.make_ir(update)(params, state, params).program

    def full_size(program):
        return sum(tuple(eq.outputs[0].aval.shape) == X[0].shape for eq in program.equations)

    assert full_size(prog) == 18
    assert full_size(passes.implicit_broadcasts(passes.simplify(prog))) == 12


def test_the_fused_update_negates_the_rate_not_the_update():
    """Concatenated leaves are split after the update, so ``p + neg(u)`` cannot become
    ``p - u`` there: the optimizer negates the scalar rate instead (the same bits)."""
    opt = fs.optim.adamw(1e-3, weight_decay=0.0)  # adam's small leaves run its kernel
    params = {"a": X[0], "b": X[1]}
    grads = {k: v * 0.5 + 0.25 for k, v in params.items()}
    state = opt.init(params)

    def update(p, s, g):
        u, s = opt.update(g, s, p)
        return fs.optim.apply_updates(p, u), s

    prog = fs.make_ir(update)(params, state, grads).program
    assert "concat" in _prims(prog)
    negs = [eq for eq in prog.equations if eq.prim.name == "neg"]
    assert negs and all(eq.outputs[0].aval.shape == () for eq in negs), negs
    # the values of the old order, -(d * r), written in NumPy
    got, _ = fs.jit(update)(params, state, grads)
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    f32 = np.float32
    rate = f32(lr)  # adamw: no bias correction
    for k, p in params.items():
        g = grads[k]
        m = p * 0 * f32(b1) + g * f32(1.0 - b1)
        v = p * 0 * f32(b2) + (g * g) * f32(1.0 - b2)
        want = p + (-((m / (np.sqrt(v) + f32(eps))) * rate))
        np.testing.assert_allclose(got[k].asnumpy(), want, rtol=1e-6,
                                   atol=1e-6 * np.abs(want).max())


def _ADAM():
    return fs.optim.adam(0.1)


@pytest.mark.parametrize("make", [_ADAM, lambda: fs.optim.adamw(0.1),
                                  lambda: fs.optim.sgd(0.1, momentum=0.9),
                                  lambda: fs.optim.sgd(0.1, momentum=0.9, nesterov=True)],
                         ids=["adam", "adamw", "momentum", "nesterov"])
def test_small_leaves_update_together_with_the_same_bits(make):
    """Inside a traced step the small leaves of one dtype go through the optimizer's
    arithmetic concatenated (one kernel per operation for all of them)."""
    opt = make()
    params = {"a": X[0], "b": W, "c": X[1, 0], "big": np.ones((300, 300), np.float32),
              "h": X[2].astype(np.float16)}
    grads = {k: (v * 0.5 + 0.25).astype(v.dtype) for k, v in params.items()}
    state = opt.init(params)

    def update(p, s, g):
        u, s = opt.update(g, s, p)
        return fs.optim.apply_updates(p, u), s

    eager = update(params, state, grads)   # leaf by leaf
    fused = fs.jit(update)(params, state, grads)
    for e, f in zip(fs.tree.leaves(eager), fs.tree.leaves(fused)):
        np.testing.assert_array_equal(np.asarray(f.asnumpy()), np.asarray(e.asnumpy()))
    again = fs.jit(update)(*fused, grads)   # a second step from the fused state
    want = update(*eager, grads)
    for e, f in zip(fs.tree.leaves(want), fs.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(f.asnumpy()), np.asarray(e.asnumpy()))
    prog = fs.make_ir(update)(params, state, grads).program
    together = "adam_update" if make is _ADAM else "concat"  # adam: one fused kernel
    assert sum(eq.prim.name == together for eq in prog.equations) >= (1 if make is _ADAM else 2)
    # under fs.shard, leaf by leaf (a concatenation would mix the leaves' layouts)
    sharded = fs.make_ir(fs.shard(update, (None, None, None), mesh=2))(params, state, grads)
    assert "concat" not in str(sharded) and "adam_update" not in str(sharded)


def _random_view_chain(rng, n):
    """A random shape of ``n`` elements and a chain of 1-5 reshapes and transposes."""
    def shape_of(m):
        fs_ = []
        while m > 1:
            d = rng.choice([d for d in range(2, m + 1) if m % d == 0])
            fs_.append(int(d))
            m //= int(d)
        rng.shuffle(fs_)
        out = []
        for f in fs_:
            if out and rng.random() < 0.4:
                out[-1] *= f
            else:
                out.append(f)
        if rng.random() < 0.2:
            out.insert(int(rng.integers(len(out) + 1)), 1)
        return tuple(out) or (1,)

    shape = shape_of(n)
    y, ops = np.arange(n).reshape(shape), []
    for _ in range(int(rng.integers(1, 6))):
        if rng.random() < 0.5:
            perm = tuple(int(p) for p in rng.permutation(y.ndim))
            ops.append(("transpose", perm))
            y = y.transpose(perm)
        else:
            s = shape_of(n)
            ops.append(("reshape", s))
            y = y.reshape(s)
    return shape, ops, y


def test_compose_views_equals_the_chain_it_replaces():
    rng = np.random.default_rng(7)
    folded = 0
    for _ in range(2000):
        n = int(rng.choice([16, 24, 36, 64, 96, 128]))
        shape, ops, want = _random_view_chain(rng, n)
        got = passes.compose_views(shape, ops)
        if got is None:  # a reshape mixing pieces no split separates: left alone
            continue
        view, perm, out = got
        folded += 1
        np.testing.assert_array_equal(np.arange(n).reshape(shape).reshape(view)
                                      .transpose(perm).reshape(out), want)
    assert folded > 1500


def test_a_chain_of_reshapes_and_transposes_runs_as_one_transpose():
    x = RNG.standard_normal((8, 6, 4)).astype(np.float32)

    def f(x):
        y = fs.ops.transpose(fs.ops.reshape(x, (2, 4, 6, 4)), (1, 0, 2, 3))
        y = fs.ops.transpose(fs.ops.reshape(y, (4, 2, 24)), (1, 0, 2))
        return fs.ops.reshape(y, (8, 24)) * 2.0

    ops = _lowered_ops(f, x)
    assert sum("transpose" in o for o in ops) <= 1, ops
    want = x.reshape(2, 4, 6, 4).transpose(1, 0, 2, 3).reshape(4, 2, 24).transpose(
        1, 0, 2).reshape(8, 24) * 2.0
    _close(fs.jit(f)(x), want)
    # a link read elsewhere too stays, and so does what reads it
    def g(x):
        y = fs.ops.transpose(fs.ops.reshape(x, (2, 4, 6, 4)), (1, 0, 2, 3))
        return fs.ops.transpose(fs.ops.reshape(y, (4, 2, 24)), (1, 0, 2)), y
    a, b = fs.jit(g)(x)
    _close(a, x.reshape(2, 4, 6, 4).transpose(1, 0, 2, 3).reshape(4, 2, 24).transpose(1, 0, 2))
    _close(b, x.reshape(2, 4, 6, 4).transpose(1, 0, 2, 3))


def test_a_two_axis_plan_moves_its_device_axes_once_per_value():
    """``fs.shard`` on a 2 x 4 mesh: the virtual mesh's batching moved device axes back
    and forth (25 transposes in the per-device step of this MLP); folded, 7."""
    rng = np.random.default_rng(1)
    sizes = (32, 64, 64, 10)
    p = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        p[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        p[f"b{i}"] = np.zeros(b, np.float32)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)

    def loss(p, x, y):
        h = fs.ops.relu(x @ p["w0"] + p["b0"])
        h = fs.ops.relu(h @ p["w1"] + p["b1"])
        return fs.ops.softmax_cross_entropy(h @ p["w2"] + p["b2"], y)

    vg = fs.value_and_grad(loss)
    rep = {k: (1,) * v.ndim for k, v in p.items()}
    f = fs.shard(vg, in_strategy=(dict(rep, w0=(1, 4), b0=(4,), w1=(4, 1)), (2, 1), (2,)),
                 mesh=8)
    assert fs.jit(f).lower(p, x, y).source.count("transpose") <= 8
    (l, g), (l0, g0) = fs.jit(f)(p, x, y), fs.jit(vg)(p, x, y)
    _close(l, np.asarray(l0.asnumpy()))
    for k in p:
        _close(g[k], np.asarray(g0[k].asnumpy()))


# ---------------------------------------------------------------------------
# fuse_adam_updates: a planned step's per-leaf updates run as one equation
# ---------------------------------------------------------------------------


def _defined_before_use(program) -> bool:
    from fshard.core.ir import Var

    seen = set(program.inputs)
    for eq in program.equations:
        if any(isinstance(a, Var) and a not in seen for a in eq.inputs):
            return False
        seen.update(eq.outputs)
    return all(not isinstance(a, Var) or a in seen for a in program.outputs)


def _adam_program(second_reads_first: bool):
    """Two one-leaf updates of one rate, a reader of the first between them."""
    from fshard.primitives.optimizers import adam_update

    def f(m1, v1, g1, m2, v2, g2, lr):
        a = adam_update([m1], [v1], [g1], lr, b1=0.9, b2=0.999, eps=1e-8)
        r = a[2][0] * 2.0
        b = adam_update([m2], [v2], [a[2][0] if second_reads_first else g2], lr,
                        b1=0.9, b2=0.999, eps=1e-8)
        return r, b[0][0], b[2][0], a[1][0]

    args = [RNG.standard_normal(6).astype(np.float32) for _ in range(6)]
    args[1], args[4] = np.abs(args[1]), np.abs(args[4])  # second moments
    return fs.make_ir(f)(*args, np.float32(0.01)).program, args + [np.float32(0.01)]


def test_fuse_adam_updates_moves_a_reader_after_the_fused_update():
    from fshard.core.interpret import eval_program
    from fshard.primitives.optimizers import adam_update_p

    program, args = _adam_program(second_reads_first=False)
    fused = passes.fuse_adam_updates(program)
    updates = [eq for eq in fused.equations if eq.prim is adam_update_p]
    assert len(updates) == 1 and len(updates[0].inputs) == 7
    assert _defined_before_use(fused)
    kinds = [eq.prim.name for eq in fused.equations]
    assert kinds.index("mul") > kinds.index("adam_update"), kinds
    for got, want in zip(eval_program(fused, *args), eval_program(program, *args)):
        np.testing.assert_array_equal(np.asarray(got.asnumpy()), np.asarray(want.asnumpy()))


def test_fuse_adam_updates_leaves_an_update_reading_another():
    from fshard.primitives.optimizers import adam_update_p

    program, _ = _adam_program(second_reads_first=True)
    fused = passes.fuse_adam_updates(program)
    assert sum(eq.prim is adam_update_p for eq in fused.equations) == 2
    assert fused is program


def test_a_planned_steps_updates_lower_to_one_helper_with_the_same_bits(monkeypatch):
    params = {f"w{i}": (RNG.standard_normal((8, 8)) / 3).astype(np.float32)
              for i in range(5)}
    x = RNG.standard_normal((16, 8)).astype(np.float32)

    def loss(p, x):
        h = x
        for i in range(5):
            h = fs.ops.tanh(h @ p[f"w{i}"])
        return (h ** 2).mean()

    def run():
        ap = fs.AutoParallel(loss, fs.optim.adam(1e-2), "semi_auto", mesh=8)
        ap.dataset_strategy("data_parallel")
        state = ap.init(params)
        src = ap._sharded(state, (x,))[1].lower(state.params, state.opt_state,
                                                state.step, x).source
        for _ in range(3):
            state, value = ap(state, x)
        return src.count("def fshard_adam_update"), state, value

    helpers, state, value = run()
    assert helpers == 1
    with monkeypatch.context() as m:  # one update equation (and helper) per leaf
        m.setattr(passes, "fuse_adam_updates", lambda program: program)
        helpers, other, want = run()
    assert helpers == len(params)
    # the same kernels either way: the same bits, step after step
    assert value.asnumpy() == want.asnumpy()
    for k in params:
        np.testing.assert_array_equal(state.params[k].asnumpy(), other.params[k].asnumpy())


def _psums_program(sizes):
    """One psum over axis "d" per input, of float32 vectors of ``sizes``."""
    from fshard.core import dtypes
    from fshard.core.ir import Equation, Program, Var
    from fshard.core.tracing import ArrayType
    from fshard.primitives.collectives import psum_p

    ins = [Var(ArrayType((k,), dtypes.float32)) for k in sizes]
    outs = [Var(v.aval) for v in ins]
    eqs = [Equation(psum_p, [a], {"axis_name": ("d",)}, [o]) for a, o in zip(ins, outs)]
    return Program(ins, eqs, outs)


def test_an_allreduce_larger_than_the_bucket_stays_alone_and_the_bucket_open():
    # small, big, small: the two small ones share a bucket around the big one
    report = []
    fused = passes.fuse_allreduces(_psums_program([4, 1000, 6]), 100.0, report=report)
    psums = [eq for eq in fused.equations if eq.prim.name == "psum"]
    assert sorted(int(np.prod(eq.inputs[0].aval.shape)) for eq in psums) == [10, 1000]
    assert report == [(2, 40.0)]  # two AllReduces merged, 40 bytes
    assert _defined_before_use(fused)
    report = []
    alone = passes.fuse_allreduces(_psums_program([4, 1000]), 100.0, report=report)
    assert [eq.prim.name for eq in alone.equations] == ["psum", "psum"]
    assert report == []  # nothing merged: nothing reported


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32, np.int64])
def test_integer_gathers_ride_in_the_float_gathers_bucket_exactly(dtype):
    # a batch's float rows and its integer labels (two of them here): with a float32
    # carrier one AllGather, the integers carried as 16-bit chunks and back to the bit,
    # their extremes included (int64's near 2**63, where MindSpore's CPU FloorDiv
    # rounds); without one, a bucket per dtype
    import functools

    from fshard.core import dtypes

    info = np.iinfo(dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 3)).astype(np.float32)
    y = np.resize(np.array([info.min, info.max - 1, 0, 1, 12345 % info.max], dtype),
                  (8, 2)).astype(dtype)
    z = np.resize(np.array([info.min + 1, info.max, 7], dtype), (8,)).astype(dtype)

    def f(x, y, z):
        return x * 2.0, y + 1, z - 1

    def gathered(carrier):
        s = fs.shard(f, in_strategy=((4, 1), (4, 1), (4,)),
                     out_strategy=((1, 1), (1, 1), (1,)), mesh=4)
        report = []
        s.passes = (functools.partial(passes.fuse_allgathers, bucket_bytes=1e9,
                                      carrier=carrier, report=report),)
        outs = [o.asnumpy() for o in s(x, y, z)]
        return outs, s.partitioned(x, y, z).collectives(), report

    (a, b, c), colls, report = gathered(dtypes.float32)
    assert colls == ["all_gather"] and [k for k, _ in report] == [3]
    np.testing.assert_array_equal(a, x * 2.0)
    assert b.dtype == y.dtype and c.dtype == z.dtype
    np.testing.assert_array_equal(b, y + 1)
    np.testing.assert_array_equal(c, z - 1)
    (a2, b2, c2), colls, report = gathered(None)
    assert colls == ["all_gather", "all_gather"] and [k for k, _ in report] == [2]
    np.testing.assert_array_equal(b2, b)
    np.testing.assert_array_equal(c2, c)
