"""``x ** n`` with a static integer ``n`` traces to ``integer_pow`` (JAX's): a square is
``x * x`` in the compiled program, the derivative keeps the exponent static, and the
numbers are MindSpore's ``Pow``'s. Any other exponent stays ``pow``."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

import fshard as fs

RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, 5)).astype(np.float32)  # negative values included
POS = (np.abs(X) + 0.5).astype(np.float32)


def _heads(f, *args):
    return [eq.prim.name for eq in fs.make_ir(f)(*args).program.equations]


@pytest.mark.parametrize("n", [2, 3, -1, 2.0, np.int64(3), np.float32(2.0)])
def test_a_static_integer_exponent_is_integer_pow(n):
    heads = _heads(lambda x: x ** n, X)
    assert "integer_pow" in heads and "pow" not in heads


@pytest.mark.parametrize("n", [0.5, 2 ** 20, True])
def test_other_exponents_stay_pow(n):
    assert "pow" in _heads(lambda x: x ** n, POS)


def test_an_integer_base_stays_pow():
    assert "pow" in _heads(lambda x: x ** 2, np.arange(4, dtype=np.int32))


@pytest.mark.parametrize("n", [2, 3, -1, -2, 0, 1, 5])
def test_values_and_gradients_equal_mindspores(n):
    x = POS if n < 0 else X

    def f(a):
        return (a ** n).sum()

    got = fs.jit(f)(x).asnumpy()
    want = f(Tensor(x)).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * max(1.0, abs(float(want))))
    g = fs.jit(fs.grad(f))(x).asnumpy()
    ms_g = ms.grad(f)(Tensor(x)).asnumpy()
    np.testing.assert_allclose(g, ms_g, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(ms_g).max()))


def test_a_square_is_the_correctly_rounded_product_eager_and_compiled():
    want = X * X  # NumPy's float32 product: the correctly rounded square
    np.testing.assert_array_equal(fs.jit(lambda a: a ** 2)(X).asnumpy(), want)
    np.testing.assert_array_equal(fs.ops.integer_pow(X, 2).asnumpy(), want)
    np.testing.assert_array_equal(ops.pow(Tensor(X), 2).asnumpy(), want)  # MindSpore's


def test_the_square_compiles_to_a_multiplication():
    text = fs.jit(lambda a: a ** 2).lower(X).as_text()
    assert "ms_mul" in text and "ms_pow" not in text


def test_second_derivative_and_vmap():
    def f(a):
        return (a ** 3).sum()

    hess_diag = fs.vmap(fs.grad(fs.grad(lambda a: a ** 3)))(X[0])
    np.testing.assert_allclose(hess_diag.asnumpy(), 6 * X[0], rtol=1e-6, atol=1e-6)
    per_row = fs.vmap(fs.grad(f))(X).asnumpy()
    np.testing.assert_allclose(per_row, 3 * X * X, rtol=1e-6, atol=1e-6)


def test_a_non_integer_exponent_is_refused_by_integer_pow():
    with pytest.raises(fs.ProgramTypeError, match="must be a Python int"):
        fs.ops.integer_pow(X, 2.5)
