"""``fs.jit(f).lower(...).compile()``: a compiled program checks what it is given.

A program lowered for ``fs.Symbol`` dimensions runs any size the Symbols accept (one
Symbol binding one size everywhere) and never returns a result of another shape than
it promises; a static program refuses other shapes.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

import fshard as fs

W = ms.Tensor(np.arange(7840, dtype=np.float32).reshape(784, 10) / 7840)


def _x(b):
    return ms.Tensor(np.random.default_rng(b).standard_normal((b, 784)).astype(np.float32))


def test_a_symbolic_program_runs_every_accepted_size_with_the_right_shape():
    f = fs.jit(lambda x: ops.matmul(x, W))
    compiled = f.lower(fs.ArrayType((fs.Symbol(divisor=8), 784), ms.float32)).compile()
    for b in (8, 16, 8, 24):  # 16 after 8 once returned an (8, 10) result
        x = _x(b)
        out = compiled(x)
        assert out.shape == (b, 10)
        np.testing.assert_allclose(out.asnumpy(), x.asnumpy() @ W.asnumpy(), rtol=1e-4,
                                   atol=1e-4)


def test_a_size_the_symbol_refuses_is_an_error_naming_it():
    f = fs.jit(lambda x: ops.matmul(x, W))
    compiled = f.lower(fs.ArrayType((fs.Symbol(divisor=8, max=32), 784), ms.float32)).compile()
    with pytest.raises(fs.ShapeError, match=r"input 0 has size 12 in dimension 0, which "
                                            r"s\d+ = Symbol\(max=32, divisor=8\) does not accept"):
        compiled(_x(12))
    with pytest.raises(fs.ShapeError, match="size 40"):
        compiled(_x(40))


def test_one_symbol_binds_one_size():
    s = fs.Symbol(divisor=4)
    f = fs.jit(lambda a, b: a.sum() + b.sum())
    compiled = f.lower(fs.ArrayType((s, 3), ms.float32), fs.ArrayType((s,), ms.float32)
                       ).compile()
    ok = compiled(np.ones((8, 3), np.float32), np.ones((8,), np.float32))
    assert float(ok.asnumpy()) == 32.0
    with pytest.raises(fs.ShapeError, match=r"same s\d+ = Symbol\(divisor=4\) has size 8 in input 0 "
                                            "dimension 0"):
        compiled(np.ones((8, 3), np.float32), np.ones((4,), np.float32))


def test_a_static_program_refuses_another_shape():
    f = fs.jit(lambda x: ops.matmul(x, W))
    compiled = f.lower(_x(8)).compile()
    with pytest.raises(fs.ShapeError, match=r"input 0 has shape \(16, 784\), but the program "
                                            r"was compiled for f32\[8,784\]"):
        compiled(_x(16))
    with pytest.raises(fs.ShapeError, match="has type f64"):
        compiled(np.ones((8, 784)))


# ---------------------------------------------------------------------------
# NaN constants survive compilation (MindSpore folds an all-NaN graph constant as
# the identity of the op using it: x + nan gave x)
# ---------------------------------------------------------------------------

NAN_CASES = {
    "full(nan) + x": lambda a: fs.ops.full((2, 3), float("nan")) + a,
    "x * nan": lambda a: a * float("nan"),
    "x + nan": lambda a: a + float("nan"),
    "x / nan": lambda a: a / float("nan"),
    "where(.., nan)": lambda a: fs.ops.where(a > 100, a, float("nan")),
    "maximum(x, nan)": lambda a: ops.maximum(a, ms.Tensor(np.float32("nan"))),
    "x + nan tensor": lambda a: a + ms.Tensor(np.full((2, 3), np.nan, np.float32)),
    "mean of nothing": lambda a: a[:0].mean(0),
    "x + inf - inf": lambda a: a + float("inf") - float("inf"),
}


@pytest.mark.parametrize("name", list(NAN_CASES))
def test_nan_constants_survive_compilation(name):
    x = ms.Tensor(np.full((2, 3), 2.0, np.float32))
    f = NAN_CASES[name]
    got = fs.jit(f)(x).asnumpy()
    assert np.isnan(got).all(), got
