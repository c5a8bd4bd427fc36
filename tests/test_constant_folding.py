"""``fs.jit`` computes what reads only constants before lowering
(``passes.fold_constants``): MindSpore's graph compiler does not finish on some
constant chains (the gradient of a linear ``ops.interpolate`` times a constant never
compiled and took all memory), a closed-over Parameter is never folded (it changes
between calls), and folding never makes a constant much larger than those it reads."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

import fshard as fs
from fshard.primitives.passes import FOLD_ELEMENTS, fold_constants

A = np.random.default_rng(5).normal(size=(1, 4, 5)).astype(np.float32)
W = Tensor(np.random.default_rng(100).normal(size=(1, 4, 7)).astype(np.float32))


@pytest.mark.parametrize("mode,align", [("linear", None), ("linear", True), ("nearest", None)])
def test_gradient_that_does_not_depend_on_the_input_compiles(mode, align):
    def f(a):
        return (ops.interpolate(a, size=7, mode=mode, align_corners=align) * W).sum()

    lowered = fs.jit(fs.grad(f)).lower(A).as_text()
    # folded to a constant: nothing left for MindSpore's compiler to fold (asserted
    # before compiling: that is what never finished)
    assert "def fshard_f(v0):\n    return const_" in lowered, lowered
    got = fs.jit(fs.grad(f))(A).asnumpy()
    want = ms.grad(f)(Tensor(A)).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_parameter_is_never_folded():
    p = ms.Parameter(Tensor(np.ones(3, np.float32)), name="p")
    g = fs.jit(fs.grad(lambda x: (x * p).sum()))
    np.testing.assert_array_equal(g(np.ones(3, np.float32)).asnumpy(), [1, 1, 1])
    p.set_data(Tensor(np.full(3, 5, np.float32)))
    np.testing.assert_array_equal(g(np.ones(3, np.float32)).asnumpy(), [5, 5, 5])


def test_folding_never_grows_a_constant_past_the_limit():
    small = np.arange(512, dtype=np.float32)
    big = np.ones((300, 300), np.float32)  # more than FOLD_ELEMENTS elements
    assert big.size > FOLD_ELEMENTS

    def f(x):
        wide = fs.ops.broadcast_to(small, (512, 512))  # 512 -> 262,144 elements: kept
        same = fs.ops.exp(big)                        # as large as what it reads: folded
        return x + wide, x[:300, :300] + same

    x = np.zeros((512, 512), np.float32)
    ir = fs.make_ir(f)(x)
    program, consts = fold_constants(ir.program, list(ir.consts))
    prims = [eq.prim.name for eq in program.equations]
    assert "broadcast_to" in prims and "exp" not in prims, prims
    assert max(int(np.prod(c.shape)) for c in consts) == big.size
    wide, same = fs.jit(f)(x)
    np.testing.assert_array_equal(wide.asnumpy(), np.broadcast_to(small, (512, 512)))
    np.testing.assert_allclose(same.asnumpy(), np.exp(big), rtol=1e-6)


def test_folded_values_equal_the_compiled_ones():
    # a chain of constants through several kinds of primitive, folded, against the same
    # chain computed from an input (not folded)
    c = Tensor(np.linspace(-2, 2, 24, dtype=np.float32).reshape(4, 6))

    def chain(v):
        return fs.ops.softmax(ops.tanh(v) * 3.0, axis=-1).T.sum(axis=0)

    folded = fs.jit(lambda x: x + chain(c))
    program = folded.lower(np.zeros(4, np.float32)).run  # the Program compiled
    assert [eq.prim.name for eq in program.equations] == ["add"]
    np.testing.assert_array_equal(folded(np.zeros(4, np.float32)).asnumpy(),
                                  fs.jit(chain)(c).asnumpy())


def test_the_cost_model_prices_exactly_the_equations_lowering_runs():
    # passes.lowered_away names what fold_constants and implicit_broadcasts remove,
    # which the planner prices at nothing: an Adam update's scalar broadcasts
    from fshard.primitives.passes import implicit_broadcasts, lowered_away

    def adam_like(w, g, m, v):
        m = m * 0.9 + g * 0.1
        v = v * 0.999 + g * g * 0.001
        lr = 1e-3 * ops.sqrt(ms.Tensor(1 - 0.999 ** 3)) / (1 - 0.9 ** 3)
        return w - lr * m / (ops.sqrt(v) + 1e-8), m, v

    xs = [np.full((4, 8), k, np.float32) for k in (1.0, 0.5, 0.0, 0.0)]
    ir = fs.make_ir(adam_like)(*xs)
    away = lowered_away(ir.program)
    assert away, ir.program
    folded, consts = fold_constants(ir.program, list(ir.consts))
    lowered = implicit_broadcasts(folded)
    assert len(lowered.equations) == len(ir.program.equations) - len(away), (
        ir.program, lowered)
    # and the explanation of a plan charges those equations no compute
    e = fs.shard(adam_like, in_strategy=((2, 1),) * 4, mesh=2).explain(*xs)
    assert [r.compute_s == 0 for r in e.rows] == [
        i in away for i in range(len(ir.program.equations))]
