"""Attention for long sequences: the plain kernel, ring attention (context
parallelism) and the zig-zag sequence order that balances causal work.

``dot_product_attention(q, k, v)`` is the reference: ``softmax(q k^T * scale) v`` over
the last two dimensions (``[..., seq, head_dim]``). ``ring_attention`` computes the same
thing inside ``fs.shard_map`` when the sequence is split over a mesh axis: each device
keeps its queries, and the key/value blocks travel round the ring with ``ppermute``,
one hop per step, while the device attends to the block it holds. The softmax is
accumulated online (a running maximum and normaliser), so no device ever holds more
than two key/value blocks, and the result equals unsplit attention.

Causal attention over a contiguous split leaves the last device with ``n`` blocks of
work and the first with one. ``zigzag(x, n)`` reorders the sequence so that a
contiguous split gives device ``i`` chunks ``i`` and ``2n - 1 - i`` of ``2n``: every
device then does the same work. Pass ``layout="zigzag"`` to ``ring_attention`` so its
causal mask uses the original positions, and ``unzigzag`` to restore the order.

>>> import numpy as np, fshard as fs
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.normal(size=(2, 16, 8)).astype(np.float32) for _ in range(3))
>>> mesh = fs.Mesh((4,), ("cp",))
>>> seq = mesh.layout("None", "cp", "None")          # split the sequence over cp
>>> ring = fs.shard_map(lambda q, k, v: fs.nn.ring_attention(q, k, v, "cp", causal=True),
...                     in_strategy=(seq, seq, seq), out_strategy=seq, mesh=mesh)
>>> ref = fs.nn.dot_product_attention(q, k, v, causal=True)
>>> bool(np.allclose(ring(q, k, v).asnumpy(), ref.asnumpy(), rtol=1e-5, atol=1e-6))
True
"""

from __future__ import annotations

import math

import numpy as np

from fshard.core import dtypes
from fshard import ops
from fshard.core.array_types import Array, Float
from fshard.core.tracing import typeof
from fshard.errors import ArgumentError
from fshard.primitives import collectives

_LAYOUTS = ("contiguous", "zigzag")


def _check_qkv(api: str, q, k, v):
    aq, ak, av = typeof(q), typeof(k), typeof(v)
    for name, a in (("q", aq), ("k", ak), ("v", av)):
        if a.ndim < 2 or not dtypes.is_float(a.dtype):
            raise ArgumentError(
                f"{api}: {name} must be a float array [..., seq, head_dim], got {a}."
                "\nFix: put the sequence in the second-to-last dimension and the head "
                "dimension last (e.g. [batch, heads, seq, head_dim]).")
    if ak.shape != av.shape[:-1] + (ak.shape[-1],) or ak.shape[:-1] != av.shape[:-1]:
        raise ArgumentError(f"{api}: k and v must have the same shape up to the last "
                            f"dimension, got k {ak} and v {av}.")
    if aq.shape[-1] != ak.shape[-1] or aq.shape[:-2] != ak.shape[:-2]:
        raise ArgumentError(
            f"{api}: q {aq} and k {ak} must agree in every dimension but the sequence "
            "(second-to-last).")
    return aq, ak, av


def _scale(scale, head_dim: int, api: str) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) \
            or not math.isfinite(float(scale)):
        raise ArgumentError(f"{api}: scale must be a finite float or None (1/sqrt(head_dim)), "
                            f"got {scale!r}.")
    return float(scale)


def _neg_big(dtype) -> np.ndarray:
    # A finite stand-in for -inf: masked scores must not turn a fully masked block's
    # running maximum into -inf (exp(-inf - -inf) is NaN).
    np_dtype = dtypes.to_numpy(dtype)
    return np.asarray(np.finfo(np_dtype).min / 2, np_dtype)


def dot_product_attention(q: Float[Array, "*b sq d"], k: Float[Array, "*b sk d"],
                          v: Float[Array, "*b sk dv"], *, causal: bool = False,
                          scale: float | None = None) -> Float[Array, "*b sq dv"]:
    """``softmax(q k^T * scale) v`` over the last two dimensions (``scale`` defaults to
    ``1/sqrt(head_dim)``); ``causal=True`` lets query ``i`` see keys ``0..i``.

    >>> import numpy as np, fshard as fs
    >>> q = k = v = np.eye(2, dtype=np.float32)
    >>> fs.nn.dot_product_attention(q, k, v, causal=True).asnumpy().astype(float).round(2).tolist()
    [[1.0, 0.0], [0.33, 0.67]]
    """
    api = "fs.nn.dot_product_attention(q, k, v)"
    aq, ak, _ = _check_qkv(api, q, k, v)
    s = ops.mul(ops.matmul(q, ops.swapaxes(k, -1, -2)),
                np.asarray(_scale(scale, aq.shape[-1], api), dtypes.to_numpy(aq.dtype)))
    if causal:
        sq, sk = aq.shape[-2], ak.shape[-2]
        keep = np.arange(sq)[:, None] + (sk - sq) >= np.arange(sk)[None, :]
        s = ops.where(keep, s, _neg_big(aq.dtype))
    return ops.matmul(ops.softmax(s, -1), v)


def _positions(block, n: int, size: int, layout: str):
    """The original sequence positions of the ``size`` rows that block ``block``
    (a traced device index) holds."""
    if layout == "contiguous":
        return ops.add(np.arange(size, dtype=np.int32), ops.mul(block, np.int32(size)))
    half = size // 2
    first = ops.add(np.arange(half, dtype=np.int32), ops.mul(block, np.int32(half)))
    second = ops.add(np.arange(half, dtype=np.int32),
                     ops.mul(ops.sub(np.int32(2 * n - 1), block), np.int32(half)))
    return ops.concat([first, second], 0)


def ring_attention(q: Float[Array, "*b sq d"], k: Float[Array, "*b sk d"],
                   v: Float[Array, "*b sk dv"], axis_name, *, causal: bool = False,
                   scale: float | None = None,
                   layout: str = "contiguous") -> Float[Array, "*b sq dv"]:
    """Attention over a sequence split across the devices of ``axis_name`` (context
    parallelism), called inside ``fs.shard_map`` on each device's blocks.

    Each device keeps its queries; the key/value blocks go round the ring with
    ``fs.ppermute``, one hop per step (``n - 1`` hops in all), and the softmax is
    accumulated online, so the result equals ``dot_product_attention`` of the whole
    sequence. The hop that fetches the next block does not depend on the current
    block's scores, so the backend may overlap it with them.

    Args:
        q: this device's queries, ``[..., seq_block, head_dim]``.
        k: this device's keys, the same shape but for the sequence length.
        v: this device's values, ``[..., seq_block, value_dim]``.
        axis_name: the mesh axis the sequence is split over.
        causal: mask by the original sequence positions.
        scale: the score scale; ``1/sqrt(head_dim)`` by default.
        layout: ``"contiguous"`` (device ``i`` holds block ``i``) or ``"zigzag"``
            (the sequence was reordered by ``fs.nn.zigzag``: balanced causal work).

    Raises:
        ArgumentError: shapes that do not match, an unknown ``layout``, or a
            ``"zigzag"`` block of odd length.
        AxisNameError: ``axis_name`` is not bound (call it inside ``fs.shard_map``).
    """
    api = "fs.nn.ring_attention(q, k, v, axis_name)"
    aq, ak, _ = _check_qkv(api, q, k, v)
    if layout not in _LAYOUTS:
        raise ArgumentError(f"{api}: layout must be one of {_LAYOUTS}, got {layout!r}.")
    if layout == "zigzag" and (aq.shape[-2] % 2 or ak.shape[-2] % 2):
        raise ArgumentError(
            f"{api}: layout='zigzag' needs an even block length (two chunks per device), "
            f"got q {aq} and k {ak}.\nFix: make the sequence length a multiple of 2 * devices.")
    n = collectives.axis_size(axis_name)
    me = collectives.axis_index(axis_name)
    dtype = dtypes.to_numpy(aq.dtype)
    q = ops.mul(q, np.asarray(_scale(scale, aq.shape[-1], api), dtype))
    ring = [(j, (j + 1) % n) for j in range(n)]
    row_shape = aq.shape[:-1] + (1,)
    m = ops.full(row_shape, _neg_big(aq.dtype), aq.dtype)        # running row maximum
    l = ops.zeros(row_shape, aq.dtype)                           # running normaliser
    o = ops.zeros(aq.shape[:-1] + (typeof(v).shape[-1],), aq.dtype)
    qpos = _positions(me, n, aq.shape[-2], layout) if causal else None
    for step in range(n):
        if step < n - 1:            # fetch the next block before using this one
            k_next, v_next = (collectives.ppermute(t, axis_name, ring) for t in (k, v))
        s = ops.matmul(q, ops.swapaxes(k, -1, -2))
        keep = None
        if causal:
            src = ops.remainder(ops.sub(ops.add(me, np.int32(n)), np.int32(step)), np.int32(n))
            kpos = _positions(src, n, ak.shape[-2], layout)
            keep = ops.greater_equal(ops.expand_dims(qpos, 1), ops.expand_dims(kpos, 0))
            s = ops.where(keep, s, _neg_big(aq.dtype))
        m_new = ops.maximum(m, ops.reduce_max(s, -1, keepdims=True))
        p = ops.exp(ops.sub(s, m_new))
        if causal:
            p = ops.where(keep, p, np.asarray(0, dtype))
        correction = ops.exp(ops.sub(m, m_new))
        l = ops.add(ops.mul(l, correction), ops.reduce_sum(p, -1, keepdims=True))
        o = ops.add(ops.mul(o, correction), ops.matmul(p, v))
        m = m_new
        if step < n - 1:
            k, v = k_next, v_next
    return ops.div(o, l)


def _check_zig(api: str, x, n, axis: int):
    a = typeof(x)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ArgumentError(f"{api}: n must be a positive int (the devices), got {n!r}.")
    if not -a.ndim <= axis < a.ndim:
        raise ArgumentError(f"{api}: axis {axis} is out of range for {a}.")
    axis %= a.ndim
    if a.shape[axis] % (2 * n):
        raise ArgumentError(
            f"{api}: the sequence length {a.shape[axis]} (axis {axis}) must be a multiple "
            f"of 2 * n = {2 * n}.\nFix: pad the sequence.")
    return a, axis


def _zig_order(n: int) -> list[int]:
    return [c for i in range(n) for c in (i, 2 * n - 1 - i)]


def zigzag(x: Array, n: int, axis: int = -2) -> Array:
    """Reorder the sequence (``axis``) into ``2n`` chunks so that a contiguous split
    over ``n`` devices gives device ``i`` chunks ``i`` and ``2n - 1 - i``: causal
    attention then costs every device the same. ``unzigzag`` undoes it.

    >>> import numpy as np, fshard as fs
    >>> fs.nn.zigzag(np.arange(8), 2, axis=0).asnumpy().tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    a, axis = _check_zig("fs.nn.zigzag(x, n, axis)", x, n, axis)
    chunks = ops.split(x, a.shape[axis] // (2 * n), axis)
    return ops.concat([chunks[c] for c in _zig_order(n)], axis)


def unzigzag(x: Array, n: int, axis: int = -2) -> Array:
    """The inverse of ``zigzag``: restore the original sequence order.

    >>> import numpy as np, fshard as fs
    >>> fs.nn.unzigzag(fs.nn.zigzag(np.arange(8), 2, axis=0), 2, axis=0).asnumpy().tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    a, axis = _check_zig("fs.nn.unzigzag(x, n, axis)", x, n, axis)
    chunks = ops.split(x, a.shape[axis] // (2 * n), axis)
    order = _zig_order(n)
    return ops.concat([chunks[order.index(c)] for c in range(2 * n)], axis)
