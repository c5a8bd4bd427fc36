"""Operands past MindSpore's kernel rank limits: its Gather takes at most 8 dimensions,
and every batching level (fs.vmap, each axis of a virtual mesh) adds one, so a
program of modest rank reaches it. fshard's gather takes any rank, eager and compiled."""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, ops

import fshard as fs

RNG = np.random.default_rng(0)
X9 = RNG.standard_normal((2, 3, 1, 2, 2, 1, 2, 3, 2)).astype(np.float32)
IDX = np.array([[2, 0], [1, 1]], np.int32)


def _take(a):
    return fs.ops.gather(a, IDX, axis=7)


def test_gather_of_a_nine_dimensional_operand():
    want = np.take(X9, IDX, axis=7)
    np.testing.assert_array_equal(_take(Tensor(X9)).asnumpy(), want)
    np.testing.assert_array_equal(fs.jit(_take)(Tensor(X9)).asnumpy(), want)


def test_gather_of_an_eight_dimensional_operand_under_vmap():
    got = fs.vmap(lambda a: fs.ops.gather(a, IDX, axis=6))(Tensor(X9))
    np.testing.assert_array_equal(got.asnumpy(), np.take(X9, IDX, axis=7))


def test_gradient_of_a_nine_dimensional_gather():
    got = fs.grad(lambda a: (_take(a) ** 2).sum())(Tensor(X9)).asnumpy()
    want = np.zeros_like(X9)
    np.add.at(want, (slice(None),) * 7 + (IDX,), 2 * np.take(X9, IDX, axis=7))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_flip_of_a_nine_dimensional_operand():
    got = fs.jit(lambda a: ops.flip(a, (1, 8)))(Tensor(X9))
    np.testing.assert_array_equal(got.asnumpy(), np.flip(X9, (1, 8)))


def test_sharded_tile_relayout_on_a_two_axis_virtual_mesh():
    # A block_slice of tile's 6-dimensional broadcast, run on a 2x2 virtual mesh, is a
    # Gather of 6 + 2 lane dimensions plus the lane's block.
    x = Tensor(RNG.uniform(-2, 2, (4, 6)).astype(np.float32))
    sharded = fs.shard(lambda a: ops.tile(a, (2, 1, 2)), in_strategy=((2, 2),),
                       mesh=fs.Mesh((4,), ("d",)))
    want = np.tile(x.asnumpy(), (2, 1, 2))
    np.testing.assert_array_equal(sharded(x).asnumpy(), want)
    np.testing.assert_array_equal(fs.jit(sharded)(x).asnumpy(), want)
