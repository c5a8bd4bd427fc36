"""Context and sequence parallelism: ring attention, the zig-zag order and the
Megatron sequence-parallel block, against unsplit computations on a virtual mesh.
(The same ring attention in real 2- and 4-process jobs: tests/distributed/
collective_checks.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest

import fshard as fs
from fshard.primitives.collectives import named_axis


def _ref_attention(q, k, v, causal):
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _qkv(shape=(2, 3, 16, 8), seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=shape).astype(np.float32) for _ in range(3))


def _ring(n, causal, layout, axis=2):
    mesh = fs.Mesh((n,), ("cp",))
    spec = ["None"] * 4
    spec[axis] = "cp"
    seq = mesh.layout(*spec)

    def f(q, k, v):
        return fs.nn.ring_attention(q, k, v, "cp", causal=causal, layout=layout)

    return fs.shard_map(f, in_strategy=(seq, seq, seq), out_strategy=seq, mesh=mesh)


def test_dot_product_attention_matches_numpy():
    q, k, v = _qkv()
    for causal in (False, True):
        got = fs.nn.dot_product_attention(q, k, v, causal=causal).asnumpy()
        np.testing.assert_allclose(got, _ref_attention(q, k, v, causal), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,causal,layout", [
    (4, True, "zigzag"),
    pytest.param(2, False, "contiguous", marks=pytest.mark.full),
    pytest.param(4, True, "contiguous", marks=pytest.mark.full),
    pytest.param(2, True, "zigzag", marks=pytest.mark.full),
    pytest.param(8, True, "zigzag", marks=pytest.mark.full),
])
def test_ring_attention_equals_unsplit_attention(n, causal, layout):
    q, k, v = _qkv()
    ref = _ref_attention(q, k, v, causal)
    if layout == "zigzag":   # reorder the sequence, run the ring, restore the order
        zq, zk, zv = (fs.nn.zigzag(t, n).asnumpy() for t in (q, k, v))
        got = fs.nn.unzigzag(_ring(n, causal, layout)(zq, zk, zv), n).asnumpy()
    else:
        got = _ring(n, causal, layout)(q, k, v).asnumpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_ring_attention_gradients_equal_unsplit_gradients():
    q, k, v = _qkv(shape=(1, 2, 8, 4), seed=1)
    w = np.random.default_rng(2).normal(size=(1, 2, 8, 4)).astype(np.float32)
    ring = _ring(2, True, "contiguous")

    def split_loss(q, k, v):
        return (ring(q, k, v) * w).sum()

    def whole_loss(q, k, v):
        return (fs.nn.dot_product_attention(q, k, v, causal=True) * w).sum()

    got = fs.jit(fs.grad(split_loss, argnums=(0, 1, 2)))(q, k, v)
    want = fs.grad(whole_loss, argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        r = r.asnumpy()
        np.testing.assert_allclose(g.asnumpy(), r, rtol=1e-4, atol=1e-5 * np.abs(r).max())


def test_ring_attention_sends_each_block_round_the_ring_once():
    """n - 1 hops of k and of v, and no other communication: the volume per device
    is 2 (n - 1) blocks, the analytic minimum of a ring."""
    n = 4
    q, k, v = (t[:, :, :4] for t in _qkv())     # one device's blocks

    def local(q, k, v):
        return fs.nn.ring_attention(q, k, v, "cp", causal=True, layout="zigzag")

    with named_axis("cp", n):                    # the per-device program, as shard_map stages it
        ir = str(fs.make_ir(local)(q, k, v))
    assert len(re.findall(r"= ppermute\[", ir)) == 2 * (n - 1)
    assert not re.search(r"= (psum|all_gather|all_to_all|psum_scatter)", ir)


def test_zigzag_balances_causal_work():
    """Unmasked (query, key) pairs per device: contiguous gives the last device
    about 2n - 1 times the first's (here 228 against 36); zig-zag gives every device
    the same."""
    n, seq = 4, 32
    pos = np.arange(seq)

    def pairs(order):
        blocks = np.split(order, n)
        return [int((b[:, None] >= pos[None, :]).sum()) for b in blocks]

    contiguous = pairs(pos)
    zig = pairs(fs.nn.zigzag(pos, n, axis=0).asnumpy())
    assert contiguous == [36, 100, 164, 228]
    assert len(set(zig)) == 1 and sum(zig) == sum(contiguous)


def test_zigzag_round_trip():
    x = np.arange(2 * 24).reshape(2, 24)
    z = fs.nn.zigzag(x, 3, axis=1).asnumpy()
    assert z[0, :4].tolist() == [0, 1, 2, 3] and z[0, 4:8].tolist() == [20, 21, 22, 23]
    np.testing.assert_array_equal(fs.nn.unzigzag(z, 3, axis=1).asnumpy(), x)


def test_sequence_parallel_block_equals_the_unsplit_block():
    """Megatron sequence parallelism: the norm runs on each device's slice of the
    sequence; an all-gather of the sequence enters the column-parallel matmul and a
    reduce-scatter of the sequence leaves the row-parallel one: one all-gather and
    one reduce-scatter per block forward (the volume of tensor parallelism's one
    all-reduce), and activations outside the block stay 1/n per device."""
    n, b, s, h, f = 4, 2, 8, 6, 16
    rng = np.random.default_rng(3)
    x = rng.normal(size=(b, s, h)).astype(np.float32)
    w1 = rng.normal(0, 0.3, (h, f)).astype(np.float32)
    w2 = rng.normal(0, 0.3, (f, h)).astype(np.float32)
    g = (1 + 0.1 * rng.normal(size=(h,))).astype(np.float32)

    def norm(x, g):
        return x * fs.ops.rsqrt(fs.ops.mean(x * x, -1, keepdims=True) + 1e-6) * g

    def block(x, w1, w2, g):
        return fs.ops.add(x, fs.ops.matmul(fs.ops.silu(fs.ops.matmul(norm(x, g), w1)), w2))

    def sp_block(x, w1, w2, g):      # x: [b, s/n, h]; w1: [h, f/n]; w2: [f/n, h]
        full = fs.all_gather(norm(x, g), "tp", axis=1, tiled=True)
        partial = fs.ops.matmul(fs.ops.silu(fs.ops.matmul(full, w1)), w2)
        return x + fs.psum_scatter(partial, "tp", scatter_dimension=1, tiled=True)

    mesh = fs.Mesh((n,), ("tp",))
    seq = mesh.layout("None", "tp", "None")
    sp = fs.shard_map(sp_block, mesh=mesh, out_strategy=seq,
                      in_strategy=(seq, mesh.layout("None", "tp"), mesh.layout("tp", "None"),
                                   None))
    want = block(x, w1, w2, g).asnumpy()
    np.testing.assert_allclose(sp(x, w1, w2, g).asnumpy(), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    with named_axis("tp", n):
        ir = str(fs.make_ir(sp_block)(x[:, :2], w1[:, :4], w2[:4], g))
    assert len(re.findall(r"= all_gather\[", ir)) == 1
    assert len(re.findall(r"= psum_scatter\[", ir)) == 1
    assert not re.search(r"= (psum|ppermute|all_to_all)\[", ir)

    def loss(*a):
        return (sp(*a) ** 2).sum()

    def ref_loss(*a):
        return (block(*a) ** 2).sum()

    for got, ref in zip(fs.grad(loss, argnums=(0, 1, 2, 3))(x, w1, w2, g),
                        fs.grad(ref_loss, argnums=(0, 1, 2, 3))(x, w1, w2, g)):
        ref = ref.asnumpy()
        np.testing.assert_allclose(got.asnumpy(), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_ring_attention_errors_name_the_argument_and_the_fix():
    q, k, v = _qkv()
    with pytest.raises(fs.ArgumentError, match="layout must be one of"):
        fs.nn.ring_attention(q, k, v, "cp", layout="striped")
    with pytest.raises(fs.ArgumentError, match="even block length"):
        fs.shard_map(lambda q, k, v: fs.nn.ring_attention(q, k, v, "cp", layout="zigzag"),
                     in_strategy=(fs.Mesh((16,), ("cp",)).layout("None", "None", "cp",
                                                                  "None"),) * 3,
                     out_strategy=None, mesh=fs.Mesh((16,), ("cp",)))(q, k, v)
    with pytest.raises(fs.ArgumentError, match="must agree in every dimension"):
        fs.nn.dot_product_attention(q, k[..., :4], v)
    with pytest.raises(fs.ArgumentError, match=r"\[\.\.\., seq, head_dim\]"):
        fs.nn.dot_product_attention(q[0, 0, 0], k, v)
    with pytest.raises(fs.ArgumentError, match="scale must be a finite float"):
        fs.nn.dot_product_attention(q, k, v, scale=float("inf"))
    with pytest.raises(fs.ArgumentError, match="multiple of 2 \\* n = 6"):
        fs.nn.zigzag(q, 3)
    with pytest.raises(fs.AxisNameError, match="no enclosing fs.shard_map"):
        fs.nn.ring_attention(q, k, v, "cp")
