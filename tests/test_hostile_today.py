"""Hostile checks of the native conv/pool and norm families, ring attention, MindSpore's
collective op classes and optimizers, and cell.shard / set_inputs: each one a case that
was wrong (or a raw Python error) before its fix."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

import fshard as fs


class _Outer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.inner = nn.Dense(4, 6)
        self.inner.shard(in_strategy=((2, 1),))

    def construct(self, x):
        return ops.relu(self.inner(x)).sum()


def test_cell_shard_on_a_sub_cell_never_called_eagerly():
    # the sub-Cell's first-call checks ran on tracers (a raw AttributeError) when the
    # network was traced before any eager call
    ms.set_seed(0)
    net = _Outer()
    x = Tensor(np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32))
    with fs.Mesh((2,), ("d",)):
        got = fs.jit(net)(x).asnumpy()
    want = net(x).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, abs(float(want))))


def test_set_inputs_with_a_dynamic_rank_takes_each_calls_shape():
    # Tensor(shape=None) is MindSpore's dynamic rank (shape [-2]); it was read as a
    # rank-1 declaration and every call was refused
    class Net(nn.Cell):
        def construct(self, x, y):
            return x.sum() + y.sum()

    net = Net()
    net.set_inputs(Tensor(shape=None, dtype=ms.float32), Tensor(shape=[None], dtype=ms.float32))
    f = fs.jit(net)
    y = Tensor(np.ones(2, np.float32))
    for shape in ((3, 4), (5,), (2, 1, 3)):
        x = Tensor(np.ones(shape, np.float32))
        assert float(f(x, y).asnumpy()) == float(net(x, y).asnumpy())
