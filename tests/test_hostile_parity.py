"""Hostile checks against MindSpore run side by side: each case gave a number, a sign,
a dtype or a gradient different from MindSpore's before its fix (float16 activations,
division by -0.0, the integer dtypes of Tensor methods, derivatives at clamp bounds)."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

import fshard as fs

NEG16 = np.array([-10.0, -7.5, -5.0, -1e-3, -5e-2, 0.0, 2.0], np.float16)


@pytest.mark.parametrize("name", ["softplus", "mish", "elu", "celu", "selu"])
def test_float16_activations_are_computed_in_float32_as_mindspore(name):
    # log1p and expm1 in float16 lose small values (log1p(4.5e-5) is 0): softplus(-10)
    # was 0 and mish(-10) -0 instead of 4.5e-5 and -4.5e-4
    f = getattr(ops, name)
    x = Tensor(NEG16)
    got = fs.jit(f)(x)
    want = f(x).asnumpy().astype(np.float64)
    exact = f(Tensor(NEG16.astype(np.float32))).asnumpy().astype(np.float64)
    assert got.dtype == ms.float16
    got = got.asnumpy().astype(np.float64)
    # within two float16 steps of MindSpore's and of the float32 value, scaled to each
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-7)
    np.testing.assert_allclose(got, exact, rtol=2e-3, atol=1e-7)


def test_division_by_negative_zero_keeps_its_sign():
    # 1 / x was traced as div(1, x), and MindSpore's Div kernel loses the sign of a zero
    # divisor; MindSpore's own 1 / x is x.reciprocal() * 1
    z = Tensor(np.array([-0.0, 0.0, 2.0, -4.0], np.float32))
    for f in (lambda x: 1 / x, lambda x: 3 / x, lambda x: -2.5 / x, ops.reciprocal,
              lambda x: x.reciprocal()):
        np.testing.assert_array_equal(fs.jit(f)(z).asnumpy(), f(z).asnumpy())
        np.testing.assert_array_equal(fs.vmap(f)(z).asnumpy(), f(z).asnumpy())
    assert fs.jit(lambda x: (1 / x) < 0)(z).asnumpy().tolist() == [True, False, False, True]
    # the same bits as MindSpore's scalar / tensor (not the correctly rounded quotient)
    x = Tensor(np.random.default_rng(0).uniform(0.1, 10, 4096).astype(np.float32))
    np.testing.assert_array_equal(fs.jit(lambda v: 3 / v)(x).asnumpy(), (3 / x).asnumpy())
    # and its derivative, -1 / x**2
    g = fs.grad(lambda v: ops.reciprocal(v).sum())(Tensor(np.array([0.5, -2.0], np.float32)))
    np.testing.assert_allclose(g.asnumpy(), [-4.0, -0.25], rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.bool_])
def test_integer_tensor_methods_have_mindspores_dtypes(dtype):
    # x.prod() and x.cumprod() of integers are int64, x.cumsum() at least int32
    x = Tensor(np.array([1, 2, 3, 1]).astype(dtype))
    for f in (lambda v: v.prod(), lambda v: v.prod(0), lambda v: v.cumprod(0),
              lambda v: v.cumsum(0), lambda v: ops.prod(v)):
        got, want = fs.jit(f)(x), f(x)
        assert got.dtype == want.dtype, (dtype, got.dtype, want.dtype)
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


@pytest.mark.parametrize("sides", ["both", "min", "max"])
def test_clamp_gradients_with_ties_everywhere_are_mindspores(sides):
    # small integers: x, min and max tie often, and min > max occurs
    rng = np.random.default_rng(7)
    x, lo, hi = (Tensor(rng.integers(-3, 4, 400).astype(np.float32)) for _ in range(3))
    w = Tensor(rng.uniform(1, 2, 400).astype(np.float32))
    f = {"both": lambda v, a, b: ops.clamp(v, a, b), "min": lambda v, a, b: ops.clamp(v, a),
         "max": lambda v, a, b: ops.clamp(v, None, b)}[sides]

    def loss(v, a, b):
        return (f(v, a, b) * w).sum()

    np.testing.assert_array_equal(fs.jit(f)(x, lo, hi).asnumpy(), f(x, lo, hi).asnumpy())
    got = fs.jit(fs.grad(loss, argnums=(0, 1, 2)))(x, lo, hi)
    want = ms.grad(loss, grad_position=(0, 1, 2))(x, lo, hi)
    for g, m in zip(got, want):
        np.testing.assert_array_equal(g.asnumpy(), m.asnumpy())


def test_clamps_forward_is_their_kernels_alone():
    # the masks of MindSpore's derivatives are in the JVP only: a forward program runs
    # the clamp's two kernels (relu6: one), not the comparisons and select
    x = np.linspace(-8, 8, 64, dtype=np.float32)
    for f, prim in [(lambda v: ops.clamp(v, 0.0, 3.0), "clamp"), (ops.relu6, "relu6"),
                    (ops.hardswish, "hardswish"), (ops.hardsigmoid, "hardsigmoid")]:
        ir = fs.make_ir(f)(x)
        assert [e.prim.name for e in ir.program.equations if e.prim.name not in
                ("broadcast_to",)] == [prim], str(ir)
    # int8 values whose running sum leaves int8: computed in int32 as MindSpore
    big = Tensor(np.array([100, 100, 100], np.int8))
    np.testing.assert_array_equal(fs.jit(lambda v: v.cumsum(0))(big).asnumpy(), [100, 200, 300])


AT_BOUNDS = np.array([-5.0, -3.0, 0.0, 1.0, 3.0, 6.0, 7.0], np.float32)
KINKED = {
    "ops.clamp": lambda v: ops.clamp(v, 0.0, 3.0),
    "ops.clamp min": lambda v: ops.clamp(v, min=0.0),
    "ops.clamp max": lambda v: ops.clamp(v, max=3.0),
    "ops.clamp tensors": lambda v: ops.clamp(v, Tensor(0.0), Tensor(3.0)),
    "ops.clip": lambda v: ops.clip(v, 0.0, 3.0),
    "Tensor.clamp": lambda v: v.clamp(0.0, 3.0),
    "ops.relu6": ops.relu6,
    "nn.ReLU6": nn.ReLU6(),
    "ops.hardswish": ops.hardswish,
    "ops.hardsigmoid": ops.hardsigmoid,
    # these two are maximum and minimum in MindSpore: 1/2 at a bound, as fshard's
    "ops.hardtanh": lambda v: ops.hardtanh(v, 0.0, 3.0),
    "ops.clip_by_value": lambda v: ops.clip_by_value(v, Tensor(0.0), Tensor(3.0)),
}


@pytest.mark.parametrize("name", list(KINKED))
def test_derivatives_at_the_bounds_are_mindspores(name):
    # clamp's derivative at a bound was maximum's tie rule (1/2), MindSpore's is 1:
    # clamp(x, min=0) of data with exact zeros halved their gradients
    f = KINKED[name]

    def loss(v):
        return f(v).sum()

    x = Tensor(AT_BOUNDS)
    np.testing.assert_allclose(fs.grad(loss)(x).asnumpy(), ms.grad(loss)(x).asnumpy(),
                               rtol=1e-6, atol=1e-7)
    special = Tensor(np.array([np.nan, -np.inf, np.inf, -3.0, 3.0], np.float32))
    np.testing.assert_array_equal(fs.jit(f)(special).asnumpy(), f(special).asnumpy())


def test_clamp_by_array_bounds_and_their_gradient():
    # a bound of more than one element was read as a scalar (a raw ValueError)
    x = Tensor(np.array([-2.0, -0.5, 0.0, 0.5, 2.0], np.float32))
    lo = Tensor(np.array([-1.0, -0.5, 0.0, 1.0, 1.0], np.float32))
    hi = Tensor(np.array([1.0, 1.0, 0.0, 1.0, 3.0], np.float32))
    f = lambda v, a, b: ops.clamp(v, a, b)  # noqa: E731
    np.testing.assert_array_equal(fs.jit(f)(x, lo, hi).asnumpy(), f(x, lo, hi).asnumpy())
    const = fs.jit(lambda v: ops.clamp(v, lo, hi))(x).asnumpy()
    np.testing.assert_array_equal(const, f(x, lo, hi).asnumpy())
    got = [g.asnumpy() for g in fs.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(x, lo, hi)]
    want = [g.asnumpy() for g in ms.grad(lambda *a: f(*a).sum(), grad_position=(0, 1, 2))(
        x, lo, hi)]
    for g, w in zip(got, want):  # min == max with x outside: neither bound moves it
        np.testing.assert_array_equal(g, w)
    # an integer value clamped by a float bound is float, as MindSpore's
    i = Tensor(np.array([-5, 0, 2, 7], np.int32))
    got, want = fs.jit(lambda v: v.clamp(0.5, 3))(i), i.clamp(0.5, 3)
    assert got.dtype == want.dtype == ms.float32
    np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


_CLAMP_X = {"f16": np.float16, "f32": np.float32, "i32": np.int32}
_CLAMP_BOUNDS = {
    "ints": (0, 2), "floats": (0.0, 2.5), "int and float": (0, 2.5),
    "f32 tensors": (Tensor(0.0), Tensor(2.5)),
    "i32 tensors": (Tensor(np.int32(0)), Tensor(np.int32(2))),
    "f16 tensors": (Tensor(np.float16(0)), Tensor(np.float16(2.5))), "max only": (None, 2),
}


@pytest.mark.parametrize("clamp", ["ops.clamp", "mint.clamp", "Tensor.clamp"])
def test_clamp_result_dtype_is_mindspores_for_every_bound_kind(clamp):
    # a 0-d Tensor bound was read as a Python number, so its dtype did not promote:
    # float16 x clamped by float32 Tensors stayed float16 (MindSpore: float32)
    from mindspore import mint

    fn = {"ops.clamp": ops.clamp, "mint.clamp": mint.clamp,
          "Tensor.clamp": lambda v, a, b: v.clamp(a, b)}[clamp]
    for xn, dt in _CLAMP_X.items():
        x = Tensor(np.array([-2, 0.5, 3]).astype(dt))
        for bn, (lo, hi) in _CLAMP_BOUNDS.items():
            got, want = fs.jit(lambda v: fn(v, lo, hi))(x), fn(x, lo, hi)
            assert got.dtype == want.dtype, (xn, bn, got.dtype, want.dtype)
            np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


_ZERO_D_OPS = {
    "x * s": lambda a, b: a * b, "s * x": lambda a, b: b * a, "x / s": lambda a, b: a / b,
    "s / x": lambda a, b: b / a, "ops.mul": ops.mul, "ops.div": ops.div,
    "ops.true_divide": ops.true_divide, "x + s": lambda a, b: a + b,
    "ops.maximum": ops.maximum, "x - s": lambda a, b: a - b,
}


@pytest.mark.parametrize("op", list(_ZERO_D_OPS))
def test_a_0d_tensor_operand_promotes_as_in_mindspore(op):
    # MindSpore's Mul and Div keep the dtype of the operand with dimensions when the
    # other is a 0-d tensor of the same kind (float16 array * float32 0-d tensor is
    # float16, computed in float32 and rounded once); Add, Sub, Maximum widen. fshard
    # widened for all of them.
    f = _ZERO_D_OPS[op]
    rng = np.random.default_rng(3)
    arrays = {"f16": Tensor(rng.uniform(-100, 100, 64).astype(np.float16)),
              "f32": Tensor(rng.uniform(-100, 100, 64).astype(np.float32)),
              "i32": Tensor(rng.integers(1, 100, 64).astype(np.int32))}
    scalars = {"f32 0-d": Tensor(np.float32(0.1)), "f64 0-d": Tensor(np.float64(0.3)),
               "f16 0-d": Tensor(np.float16(0.7)), "i64 0-d": Tensor(np.int64(3)),
               "python float": 0.1, "python int": 3}
    for xn, x in arrays.items():
        for sn, s in scalars.items():
            try:
                want = f(x, s)
            except (TypeError, ValueError, RuntimeError):
                continue
            got = fs.jit(lambda v: f(v, s))(x)
            assert got.dtype == want.dtype, (xn, sn, got.dtype, want.dtype)
            np.testing.assert_array_equal(got.asnumpy(), want.asnumpy(), err_msg=f"{xn} {sn}")
            # a computed 0-d value counts as a 0-d tensor too
            if isinstance(s, Tensor):
                got = fs.jit(lambda v, t: f(v, t.sum()))(x, s)
                assert got.dtype == want.dtype, (xn, sn, "traced", got.dtype, want.dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32])
def test_ops_mul_and_div_by_a_python_float_are_mindspores(dtype):
    # ops.mul and ops.div pass a Python float to MindSpore's kernels as a float32 0-d
    # tensor: float16 computed in float32 and rounded once (fshard rounded 0.1 to
    # float16 first: 36% of products differed); the Tensor operators and mint keep the
    # number. With float64, MindSpore multiplies by float32(0.1) whatever the API;
    # fshard keeps 0.1 exact.
    from mindspore import mint

    xv = np.random.default_rng(0).uniform(-10, 10, 1000).astype(dtype)
    x = Tensor(xv)
    mul, div = (lambda a: a * 0.1), (lambda a: a / 0.1)
    for f, ref in ((lambda a: ops.mul(a, 0.1), mul), (lambda a: ops.mul(0.1, a), mul),
                   (lambda a: ops.div(a, 0.1), div), (lambda a: ops.true_divide(a, 0.1), div),
                   (lambda a: a * 0.1, mul), (lambda a: a / 0.1, div),
                   (lambda a: mint.mul(a, 0.1), mul), (lambda a: mint.div(a, 0.1), div),
                   (lambda a: ops.mul(a.sum(), 0.1), lambda a: a.sum() * 0.1)):
        got, want = fs.jit(f)(x), f(x)
        assert got.dtype == want.dtype
        if dtype == np.float64:
            np.testing.assert_allclose(got.asnumpy(), ref(xv), rtol=1e-13)  # a sum's order
            np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=2e-8)
        else:
            np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


def test_eager_grad_of_a_generic_op_with_one_value_in_several_slots():
    # eager GradOperation gave each slot holding the same Tensor the whole gradient, so
    # fs.grad (not under jit) of cdist(a, a) was twice MindSpore's, addcmul(a, a, a) 3x
    a = Tensor(np.array([[0.5, 1.0], [2.0, -1.0], [0.0, 3.0]], np.float32))
    p = Tensor(np.array([[0.5, 1.0], [2.0, 1.5]], np.float32))
    for f, x in ((lambda v: ops.cdist(v, v).sum(), a), (lambda v: ops.xlogy(v, v).sum(), p),
                 (lambda v: ops.addcmul(v, v, v, Tensor(0.5)).sum(), p)):
        want = ms.grad(f)(x).asnumpy()
        for g in (fs.grad(f), fs.jit(fs.grad(f))):
            np.testing.assert_allclose(g(x).asnumpy(), want, rtol=1e-6, atol=1e-7)


def test_tensor_max_with_numpy_keepdims_is_one_tensor():
    # x.max(0, keepdims=True) is NumPy's form in MindSpore (one Tensor); fshard took
    # the PyTorch form, (values, indices), so x - x.max(1, keepdims=True)[0] was silently
    # x minus the first row's maxima
    x = Tensor(np.array([[1., 5., 2.], [3., 2., 0.], [4., 4., 9.]], np.float32))
    for f in (lambda v: v.max(0, keepdims=True), lambda v: v.min(1, keepdims=True),
              lambda v: v.max(-1, keepdims=False), lambda v: v - v.max(1, keepdims=True)[0],
              lambda v: v.max(1)[0], lambda v: v.max(1)[1]):
        np.testing.assert_array_equal(fs.jit(f)(x).asnumpy(), f(x).asnumpy())
    with pytest.raises(fs.errors.UnsupportedOpError, match="initial"):
        fs.jit(lambda v: v.max(0, initial=4.0))(x)


_TIED = np.array([[1., 3., 3., 0.], [2., 2., 2., 2.], [0., 0., -1., 0.]], np.float32)
_ONE_AXIS_EXTREMA = {
    "ops.max(x, 1)": lambda x: ops.max(x, 1)[0],
    "ops.max(x, 0, keepdims)": lambda x: ops.max(x, 0, keepdims=True)[0],
    "ops.min(x, 1)": lambda x: ops.min(x, 1)[0],
    "mint.max(x, 1)": lambda x: ms.mint.max(x, 1)[0],
    "mint.min(x, -1)": lambda x: ms.mint.min(x, -1)[0],
    "x.max(axis=1)": lambda x: x.max(axis=1),
    "x.min(axis=0, keepdims)": lambda x: x.min(axis=0, keepdims=True),
    "x.max(1)": lambda x: x.max(1)[0],
    "x.max(axis=1, return_indices)": lambda x: x.max(axis=1, return_indices=True)[0],
    "ArgMaxWithValue": lambda x: ops.ArgMaxWithValue(1)(x)[1],
    "ArgMinWithValue": lambda x: ops.ArgMinWithValue(0)(x)[1],
}


@pytest.mark.parametrize("name", sorted(_ONE_AXIS_EXTREMA))
def test_one_axis_max_and_min_give_ties_derivative_to_the_index(name):
    # MindSpore's ArgMaxWithValue reads the value at the index: at ties, the whole
    # derivative goes to the first of them. fshard shared it among the ties (as
    # reduce_max does): a silently different gradient, e.g. of a max over ReLU zeros.
    f = _ONE_AXIS_EXTREMA[name]
    x = Tensor(_TIED)

    def loss(v):
        out = f(v)
        n = int(np.prod(out.shape))
        return (out * Tensor(np.arange(1, n + 1, dtype=np.float32).reshape(out.shape))).sum()

    want = ms.grad(loss)(x).asnumpy()
    np.testing.assert_array_equal(fs.grad(loss)(x).asnumpy(), want)
    np.testing.assert_array_equal(fs.jit(fs.grad(loss))(x).asnumpy(), want)
    np.testing.assert_array_equal(fs.jit(f)(x).asnumpy(), f(x).asnumpy())
    # per example, as a loop of MindSpore's
    xs = Tensor(np.stack([_TIED, _TIED[::-1].copy(), -_TIED]))
    got = fs.vmap(fs.grad(loss))(xs).asnumpy()
    np.testing.assert_array_equal(got, np.stack([ms.grad(loss)(xs[i]).asnumpy()
                                                 for i in range(3)]))


def test_one_axis_max_values_and_indices_with_nan_inf_and_signed_zero():
    x = np.array([[np.nan, 1., 2.], [-np.inf, -np.inf, -np.inf], [-0.0, -1., -2.],
                  [np.inf, 1., np.inf], [3., np.nan, 3.]], np.float32)
    for f in (lambda v: ops.max(v, 1), lambda v: ops.min(v, 1), lambda v: v.max(axis=1),
              lambda v: ops.ArgMaxWithValue(1)(v)):
        want, got = f(Tensor(x)), fs.jit(f)(Tensor(x))
        want = want if isinstance(want, tuple) else (want,)
        got = got if isinstance(got, tuple) else (got,)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())
            if w.dtype == ms.float32:
                assert (np.signbit(g.asnumpy()) == np.signbit(w.asnumpy())).all()
    ints = Tensor(np.array([[3, 7, 7], [-1, -5, 0]], np.int32))
    for f in (lambda v: ops.max(v, 1), lambda v: v.min(axis=0)):
        for g, w in zip(*(r if isinstance(r, tuple) else (r,) for r in (
                fs.jit(f)(ints), f(ints)))):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())
    with pytest.raises(fs.errors.UnsupportedOpError, match="one int axis"):
        fs.jit(lambda v: v.max(axis=(0, 1), return_indices=True))(Tensor(x))


def test_one_axis_max_gradient_sharded_over_the_reduced_axis():
    x = Tensor(np.tile(_TIED, (2, 2)))

    def loss(v):
        return (ops.max(v, 1)[0] * ops.arange(1, 7).astype(ms.float32)).sum()

    want = ms.grad(loss)(x).asnumpy()
    for strategy in ((1, 4), (2, 2), (2, 1)):
        got = fs.shard(fs.grad(loss), in_strategy=(strategy,), mesh=4)(x)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_tensor_method_keywords_of_pytorchs_form():
    # x.trace() called the tracer's own trace (a StagingTrace); std/any refused dim=
    x = Tensor(np.array([[1., 5., 2.], [3., 2., 0.], [4., 4., 9.]], np.float32))
    for f in (lambda v: v.trace(), lambda v: v.std(dim=1, correction=0, keepdim=True),
              lambda v: v.any(dim=1, keepdim=True), lambda v: v.all(dim=0)):
        got, want = fs.jit(f)(x), f(x)
        assert got.shape == want.shape
        np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-6)


def test_bool_tensor_plus_and_minus_are_logical_or_and_xor():
    # MindSpore's Tensor + and - between bools are a logical or and xor (ops.add and
    # ops.sub refuse bools); fshard refused them, with a message saying MindSpore had
    # no bool add
    b = Tensor(np.array([True, False, True, False]))
    c = Tensor(np.array([True, True, False, False]))
    for f in (lambda b, c: b + c, lambda b, c: b - c, lambda b, c: b + True,
              lambda b, c: b - True, lambda b, c: True + b, lambda b, c: b + 1,
              lambda b, c: b - c.astype(ms.int32)):
        want = f(b, c)
        for got in (fs.jit(f)(b, c), fs.vmap(f)(b, c)):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
    with pytest.raises(fs.errors.ProgramTypeError, match=r"ops\.logical_or\(x, y\)"):
        fs.jit(ops.add)(b, c)
    with pytest.raises(fs.errors.ProgramTypeError, match=r"logical xor"):
        fs.jit(ops.sub)(b, c)


_METHOD_CASES = {
    "median()": lambda t: t.median(), "median(0)": lambda t: t.median(0),
    "median(dim=0, keepdim=True)": lambda t: t.median(dim=0, keepdim=True),
    "median(axis=1, keepdims=True)": lambda t: t.median(axis=1, keepdims=True),
    "nansum()": lambda t: t.nansum(), "nansum(1)": lambda t: t.nansum(1),
    "nansum(0, True)": lambda t: t.nansum(0, True),
    "logsumexp(1)": lambda t: t.logsumexp(1), "logsumexp(0, True)": lambda t: t.logsumexp(0, True),
    "new_zeros((2, 2))": lambda t: t.new_zeros((2, 2)), "new_ones(3)": lambda t: t.new_ones(3),
    "new_zeros((2,), dtype=int32)": lambda t: t.new_zeros((2,), dtype=ms.int32),
    "index_select(1, i)": lambda t: t.index_select(1, Tensor(np.array([2, 0], np.int32))),
    "unbind(0)": lambda t: t.unbind(0), "unbind(1)": lambda t: t.unbind(1),
    "count_nonzero()": lambda t: t.count_nonzero(),
    "count_nonzero(1)": lambda t: t.count_nonzero(1),
    "count_nonzero(axis=0, keep_dims=True)": lambda t: t.count_nonzero(axis=0, keep_dims=True),
    # over every axis MindSpore's max/min keep no dimension, even with keepdims=True
    "max(axis=None, keepdims=True)": lambda t: t.max(axis=None, keepdims=True),
    "min(axis=None, keepdims=True)": lambda t: t.min(axis=None, keepdims=True),
    "max(keepdims=True)": lambda t: t.max(keepdims=True),
    "max(axis=1, keepdims=True)": lambda t: t.max(axis=1, keepdims=True),
}


@pytest.mark.parametrize("case", sorted(_METHOD_CASES))
def test_tensor_methods_mindspore_has(case):
    # median, nansum, logsumexp, index_select, unbind, count_nonzero, new_zeros/ones
    # were refused on traced values; max/min over all axes with keepdims=True kept them
    f = _METHOD_CASES[case]
    for x in (np.array([[1.0, 5.0, 3.0], [4.0, 0.0, -2.0]], np.float32),
              np.array([[1.0, np.nan, 3.0], [4.0, 0.0, -2.0]], np.float32),
              np.array([[1, 0, 3], [0, 0, -2]], np.int32)):
        t = Tensor(x)
        try:
            want = f(t)
            wants = list(want) if isinstance(want, (tuple, list)) else [want]
            [w.asnumpy() for w in wants]  # MindSpore raises when the value is read
        except (TypeError, ValueError, RuntimeError):
            continue  # MindSpore has no kernel for this dtype
        got = fs.jit(f)(t)
        gots = list(got) if isinstance(got, (tuple, list)) else [got]
        assert len(gots) == len(wants)
        for g, w in zip(gots, wants):
            assert g.shape == w.shape and g.dtype == w.dtype, (g, w)
            np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6, equal_nan=True)


_X4 = np.random.default_rng(0).standard_normal((3, 4, 5, 6)).astype(np.float32)
_I, _J, _K = np.array([0, -1, 2]), np.array([[1], [3]]), np.array([4, 0, 3])


@pytest.mark.parametrize("index", [
    (_I, _J), (_I, slice(None), _K), (slice(None), _I, 0, _K), (_I, 0, _K),
    (0, _I, _J, slice(1, 4)), (Ellipsis, _I, _K), (_I, None, _J),
    (slice(None, None, -1), _I, slice(None), _K), ([0, 2], [1, 1], [3, 4], [5, 0]),
    (_I, _J, _K), ([True, False, True],)], ids=str)
def test_indexing_with_several_integer_arrays_and_list_masks(index):
    # several integer-array indices broadcast together (NumPy's advanced indexing,
    # which MindSpore follows) and a list of bools as a mask were refused
    want = _X4[index]
    ti = tuple(Tensor(e.astype(np.int32)) if isinstance(e, np.ndarray) else e for e in index)
    got = fs.jit(lambda x: x[ti])(_X4)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.asnumpy(), want)
    mine = Tensor(_X4)[ti]
    if not (isinstance(index[0], slice) and index[0].step == -1):  # MindSpore's own gives shape (3, 0, 5) there
        np.testing.assert_array_equal(got.asnumpy(), mine.asnumpy())
    grad = fs.grad(lambda x: (x[ti] ** 2).sum())(_X4).asnumpy()
    ref = np.zeros_like(_X4)
    np.add.at(ref, index, 2 * want)
    np.testing.assert_allclose(grad, ref, rtol=1e-6, atol=1e-6)


def test_several_traced_integer_array_indices_under_vmap():
    i = np.array([[0, 1], [2, 3], [1, 1]], np.int32)
    j = np.array([[4, 0], [1, 2], [3, 3]], np.int32)
    got = fs.vmap(lambda x, i, j: x[i, j])(_X4, Tensor(i), Tensor(j))
    np.testing.assert_array_equal(got.asnumpy(), np.stack([_X4[b][i[b], j[b]] for b in range(3)]))


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("eps", [1e-12, 0.5, 0.0])
def test_lp_norm_and_dist_derivatives_at_zero_and_below_eps_are_mindspores(p, eps):
    # ops.dist(x, x) (LpNorm of zeros) had a NaN gradient where MindSpore's is 0:
    # LpNorm differentiates as x|x|^(p-2) / max(norm, eps)^(p-1)
    x = np.array([[0., 0.], [3., 4.], [0., -2.], [0.03, 0.04], [1e-3, 0.]], np.float32)
    for axis, keep in ((1, False), (0, True), ((0, 1), False)):
        def f(v):
            return ops.LpNorm(axis=axis, p=p, epsilon=eps, keep_dims=keep)(v)

        def loss(v):
            return (f(v) * 1.5).sum()

        np.testing.assert_allclose(fs.jit(f)(Tensor(x)).asnumpy(), f(Tensor(x)).asnumpy(),
                                   rtol=1e-5)
        np.testing.assert_allclose(fs.jit(fs.grad(loss))(Tensor(x)).asnumpy(),
                                   ms.grad(loss)(Tensor(x)).asnumpy(), rtol=1e-4,
                                   atol=1e-6, equal_nan=True)
    if p == 2 and eps:
        y = Tensor(x)
        for want, got in zip(ms.grad(ops.dist, (0, 1))(y, y * 1),
                             fs.grad(ops.dist, (0, 1))(y, y * 1)):
            np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.uint8])
def test_one_axis_amax_and_amin_are_reducemaxs_values(dtype):
    # fshard lowers a max (min) over one axis to ArgMaxWithValue, faster than ReduceMax
    # on CPU: its values must be ReduceMax's, NaNs and signed zeros included
    rng = np.random.default_rng(0)
    for shape, axis in (((4, 33, 3), 1), ((5, 7), 0), ((3, 1, 6), -1), ((2, 3, 4), (0, 2))):
        if np.issubdtype(dtype, np.floating):
            x = rng.choice(np.array([0., -0., 1., -1., 2., np.nan, np.inf, -np.inf]),
                           size=shape).astype(dtype)
        else:
            x = rng.integers(0, 9, size=shape).astype(dtype)
        for f in (lambda v: ops.amax(v, axis), lambda v: ops.amin(v, axis),
                  lambda v: v.amax(axis, keepdims=True)):
            want, got = f(Tensor(x)).asnumpy(), fs.jit(f)(Tensor(x)).asnumpy()
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
            assert (np.signbit(got) == np.signbit(want)).all()


def test_one_axis_max_gradient_with_a_batch_size_known_at_run_time():
    # the index's gather needs static sizes: a symbolic batch takes reduce_max and argmax
    # (it failed with a raw TypeError)
    x = Tensor(np.array([[1., 3., 2.], [0., 5., 1.]], np.float32))

    def loss(v):
        return ops.max(v, 1)[0].sum()

    b = fs.Symbol()
    for spec in (fs.ArrayType((b, 3), ms.float32), fs.ArrayType((2, b), ms.float32)):
        got = fs.jit(fs.grad(loss), in_shapes=(spec,))(x).asnumpy()
        np.testing.assert_array_equal(got, ms.grad(loss)(x).asnumpy())


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_pow_exponent_derivative_at_zero_and_negative_bases_is_mindspores(dtype):
    # d/dy x ** y = x ** y * log(x): it was 0 for a negative base (NaN in MindSpore and
    # JAX: no real logarithm) and NaN at x = 0, y < 0 (MindSpore gives the limit, -inf)
    x = Tensor(np.array([0, 0, 0, 2, -2, 0, -0.5], dtype))
    y = Tensor(np.array([-1, 2, 0, 0.5, 2, 0.5, -3], dtype))

    def f(x, y):
        return ops.pow(x, y).sum()

    want = [g.asnumpy() for g in ms.grad(f, grad_position=(0, 1))(x, y)]
    assert np.isneginf(want[1][0]) and np.isnan(want[1][4])   # what is pinned down
    for grad in (fs.grad(f, argnums=(0, 1)), fs.jit(fs.grad(f, argnums=(0, 1)))):
        got = [g.asnumpy() for g in grad(x, y)]
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=4e-3 if dtype == np.float16 else 1e-5)
    per = fs.vmap(fs.grad(lambda a, b: ops.pow(a, b), argnums=1))(x, y).asnumpy()
    np.testing.assert_allclose(per, want[1], rtol=4e-3 if dtype == np.float16 else 1e-5)


def _tensors(*values, dtype=np.float32):
    return [Tensor(np.asarray(v, dtype)) for v in values]


# (label, function of tensors to a tensor, its inputs): each was a silent wrong number
# (fshard's derivative or value against MindSpore's, which is right in each of these)
EDGE_CASES = [
    # relu(z) + log1p(exp(-|z|)) has derivative 0 at z = 0 (relu's and abs's), not 1/2
    ("softplus at 0", ops.softplus, [[0.0, -0.0, 1.0, -30.0, 30.0]]),
    ("softplus beta 2 at 0", lambda x: ops.softplus(x, 2, 5), [[0.0, -0.0, 2.6, 3.0]]),
    # exp(x) of the branch not taken is inf: its derivative 0 * inf was NaN
    ("elu at large x", ops.elu, [[89.0, 100.0, -100.0, 0.5]]),
    ("celu at large x", lambda x: ops.celu(x, 0.5), [[45.0, 100.0, 0.5]]),
    ("prelu weight with inf", lambda x, w: ops.prelu(x, w), [[-1.0, 2.0, np.inf], [0.25]]),
    # LpNorm's eps (1e-12) is 0 in float16: every derivative was NaN
    ("norm p=3 float16", lambda x: ops.norm(x, 3, dim=-1), [[[0.5, 0.25], [1, 1]]]),
    ("cosine_similarity float16", lambda a, b: ops.cosine_similarity(a, b, 1),
     [[[1.0, 0.5]], [[0.5, 1.0]]]),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("label,f,values", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_derivatives_at_edge_points_are_mindspores(label, f, values, dtype):
    args = _tensors(*values, dtype=dtype)
    argnums = tuple(range(len(args)))

    def total(*a):
        return f(*a).sum()

    want = ms.grad(total, grad_position=argnums)(*args)
    want = [w.asnumpy() for w in (want if isinstance(want, tuple) else (want,))]
    rtol = 4e-3 if dtype == np.float16 else 1e-5
    for grad in (fs.grad(total, argnums=argnums), fs.jit(fs.grad(total, argnums=argnums))):
        got = [g.asnumpy() for g in grad(*args)]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * 1e-3, err_msg=label)
    np.testing.assert_allclose(fs.jit(f)(*args).asnumpy(), f(*args).asnumpy(), rtol=rtol,
                               atol=rtol * 1e-3, err_msg=label)
    if len(args) == 1:  # per row (per element of a vector)
        per = fs.vmap(fs.grad(total))(*args).asnumpy()
        np.testing.assert_allclose(per, want[0], rtol=rtol, atol=rtol * 1e-3, err_msg=label)


def test_gelu_tanh_derivative_where_tanh_rounds_to_one():
    # 1 - tanh(u)^2 is 0 in float32 from u = 9 on: the derivative was exactly 1 from x = 4
    # (1.000335 in float64); and x ** 3 overflowed float16 (NaN at x = 1e4)
    x = np.array([-5, -3, -1, 0, 0.5, 1, 3, 4, 5, 10], np.float64)
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x ** 3))
    exact = 0.5 * (1 + t) + 0.5 * x * (1 - t ** 2) * c * (1 + 3 * 0.044715 * x ** 2)

    def f(v):
        return ops.gelu(v, approximate="tanh").sum()

    for grad in (fs.grad(f), fs.jit(fs.grad(f))):
        np.testing.assert_allclose(grad(Tensor(x.astype(np.float32))).asnumpy(), exact,
                                   rtol=2e-6, atol=1e-7)
    h = Tensor(np.array([1e4, -1e4, 3.0, 0.5], np.float16))
    np.testing.assert_allclose(fs.grad(f)(h).asnumpy(), ms.grad(f)(h).asnumpy(), rtol=4e-3)


def test_float16_products_and_norms_do_not_overflow_midway():
    # a running product of float16 overflowed (300 * 300) where the product does not,
    # and 100 ** 3 in a float16 3-norm under vmap; MindSpore computes both in float32
    x = Tensor(np.array([[300, 300, 0.5, 0.5], [100, -100, 50, 0], [1, 2, 3, 4]], np.float16))
    for f in (lambda a: ops.prod(a, -1), lambda a: a.prod(-1),
              lambda a: ops.norm(a, 3, dim=-1)):
        want = f(x).asnumpy().astype(np.float64)
        assert np.isfinite(want).all()
        for g in (fs.jit(f), fs.vmap(f)):
            got = g(x)
            assert got.dtype == ms.float16
            np.testing.assert_allclose(got.asnumpy().astype(np.float64), want, rtol=2e-3)


def test_expm1_and_the_elus_keep_their_digits_near_zero():
    # MindSpore's Expm1 kernel is exp(x) - 1 as written (expm1(-1e-6) = -1.0133e-6): elu,
    # celu and selu built on it were 1.3% off at -1e-6, where MindSpore's CeLU and SeLU
    # kernels are right (its Elu kernel has the same error: fshard's is right)
    v = np.array([-1e-6, -1e-5, -1e-4, -1e-3, 1e-7, 1e-5, -0.3, 0.45, -0.5, 0.5, -3.0, 2.0])
    for dtype, rtol in ((np.float32, 2e-6), (np.float64, 1e-13)):
        x = Tensor(v.astype(dtype))
        for f in (fs.jit(ops.expm1), fs.ops.expm1):
            np.testing.assert_allclose(f(x).asnumpy(), np.expm1(v), rtol=rtol)
    x = Tensor(v.astype(np.float32))
    for f in (ops.celu, ops.selu):
        np.testing.assert_allclose(fs.jit(f)(x).asnumpy(), f(x).asnumpy(), rtol=2e-6)
    np.testing.assert_allclose(fs.jit(ops.elu)(x).asnumpy(), np.where(v > 0, v, np.expm1(v)),
                               rtol=2e-6)


def test_log1p_and_softplus_keep_their_digits_near_zero():
    # MindSpore's Log1p kernel is log(1 + x) as written: log1p(1e-9) = 0, and
    # log1p(3.06e-7) = 3.58e-7, so softplus(-15) was 17% off (in MindSpore's own
    # Softplus too). fshard corrects it below |x| = 0.5 by a Newton step on expm1.
    v = np.array([1e-30, -1e-30, 1e-9, -1e-9, 3.06e-7, 1e-5, -1e-5, 1e-3, -0.2, 0.3, -0.43,
                  0.49, -0.5, 0.5, -0.9, -0.999999, 3.0, 1e10])
    for dtype, rtol in ((np.float32, 1e-6), (np.float64, 1e-13)):
        x = Tensor(v.astype(dtype))
        want = np.log1p(v.astype(dtype).astype(np.float64))
        for f in (fs.jit(ops.log1p), fs.ops.log1p, fs.vmap(ops.log1p)):
            np.testing.assert_allclose(f(x).asnumpy(), want, rtol=rtol)
    edges = Tensor(np.array([-1.0, -2.0, np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32))
    got = fs.jit(ops.log1p)(edges).asnumpy()
    # (log1p(-0) is +0, as MindSpore's kernel gives it; NumPy's is -0)
    np.testing.assert_array_equal(got, [-np.inf, np.nan, np.inf, np.nan, np.nan, 0.0, 0.0])
    # softplus: within MindSpore's Exp kernel's own error (up to 8e-6 relative at -30;
    # MindSpore's Softplus gives 0 at -20 and -30)
    z = np.array([-15.0, -20.0, -30.0, -5.0, 0.0, 4.0])
    np.testing.assert_allclose(fs.jit(ops.softplus)(Tensor(z.astype(np.float32))).asnumpy(),
                               np.log1p(np.exp(z)), rtol=2e-5)
    # the derivative is 1 / (1 + x) as before
    np.testing.assert_allclose(fs.jit(fs.grad(lambda t: ops.log1p(t).sum()))(
        Tensor(v[:8].astype(np.float32))).asnumpy(), 1 / (1 + v[:8]), rtol=1e-6)


def test_mish_keeps_its_digits_where_tanh_saturates():
    # x * tanh(softplus(x)) on MindSpore's Tanh, which rounds to 1 early: mish(5) was 5.0
    # against 4.99955. Now within MindSpore's Exp kernel's error (9e-6 relative at -24.6).
    v = np.concatenate([np.linspace(-30, 30, 601), [19.99, 20.01, 100.0, 1e4]])

    def ref(x):
        return x * np.tanh(np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0))

    for dtype, rtol in ((np.float32, 3e-5), (np.float64, 1e-13)):
        x = Tensor(v.astype(dtype))
        want = ref(v.astype(dtype).astype(np.float64))
        for f in (fs.jit(ops.mish), fs.vmap(ops.mish)):
            np.testing.assert_allclose(f(x).asnumpy(), want, rtol=rtol, atol=1e-30)
    # float64 against central differences, whose rounding is about 1e-16 |mish| / h
    # (7e-9 at x = 30)
    h = 1e-6
    x = Tensor(v[:601])
    np.testing.assert_allclose(fs.jit(fs.grad(lambda t: ops.mish(t).sum()))(x).asnumpy(),
                               (ref(v[:601] + h) - ref(v[:601] - h)) / (2 * h), rtol=1e-7,
                               atol=5e-8)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_softsign_at_infinity_is_one_with_derivative_zero(dtype):
    # x / (1 + |x|) is inf / inf at +-inf: NaN, and NaN derivatives (MindSpore's value is
    # NaN too; its derivative 0). Finite values keep MindSpore's bits.
    v = np.array([np.inf, -np.inf, 1e30, -2.0, 0.0, 0.5, 3e4, np.nan])
    with np.errstate(all="ignore"):  # (1e30 is inf in float16)
        x = Tensor(v.astype(dtype))
        want = np.where(np.isinf(v), np.sign(v), v / (1 + np.abs(v))).astype(dtype)
    for f in (fs.jit(ops.softsign), fs.vmap(ops.softsign)):
        np.testing.assert_allclose(f(x).asnumpy(), want, rtol=2e-3 if dtype == np.float16
                                   else 1e-6)
    grad = fs.jit(fs.grad(lambda t: ops.softsign(t).sum()))(x).asnumpy()
    assert grad[0] == grad[1] == 0 and grad[4] == 1 and np.isnan(grad[-1])
    r = Tensor(np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 10)
    np.testing.assert_array_equal(fs.jit(ops.softsign)(r).asnumpy(), ops.softsign(r).asnumpy())
