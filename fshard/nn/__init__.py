"""Neural-network functions that need keys: ``fs.nn.dropout``.

>>> import numpy as np, fshard as fs
>>> x = np.ones((2, 4), np.float32)
>>> y = fs.nn.dropout(fs.random.key(0), x, rate=0.5)
>>> sorted(set(y.asnumpy().ravel().tolist())) in ([0.0, 2.0], [0.0], [2.0])
True
"""

from __future__ import annotations

import numpy as np

from fshard.core import dtypes
from fshard import ops, random
from fshard.core.array_types import Array, Float, Key
from fshard.nn.attention import (  # noqa: F401
    dot_product_attention as dot_product_attention,
    ring_attention as ring_attention,
    unzigzag as unzigzag,
    zigzag as zigzag,
)
from fshard.core.tracing import typeof
from fshard.nn.moe import moe as moe  # noqa: F401
from fshard.errors import ArgumentError


@random._consumes
def dropout(key: Key, x: Float[Array, "*shape"], rate: float) -> Float[Array, "*shape"]:
    """Zero each element of ``x`` with probability ``rate`` and scale the others by
    ``1 / (1 - rate)`` (inverted dropout: the expectation is ``x``).

    The mask comes from ``key`` alone: thread a fresh subkey per step and per layer
    (``key, sub = fs.random.split(key)``); under ``vmap`` each lane's key gives that
    lane's mask. ``rate=0`` returns ``x``.

    >>> import numpy as np, fshard as fs
    >>> fs.nn.dropout(fs.random.key(0), np.ones(6, np.float32), 0.5).asnumpy().tolist()
    [0.0, 0.0, 2.0, 2.0, 0.0, 2.0]
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.floating)) \
            or not 0.0 <= float(rate) <= 1.0:
        raise ArgumentError(
            f"fs.nn.dropout(key, x, rate): rate must be a float in [0, 1], got {rate!r}."
            "\nFix: e.g. rate=0.1; pass rate=0 (or skip the call) at evaluation time.")
    a = typeof(x)
    if not dtypes.is_float(a.dtype):
        raise ArgumentError(f"fs.nn.dropout(key, x, rate): x must be a float array, got {a}.")
    random.refuse_symbolic(a.shape, "fs.nn.dropout(key, x, rate): x's shape")
    rate = float(rate)
    if rate == 0.0:
        return x
    if rate == 1.0:
        return ops.zeros_like(x)
    keep = random.bernoulli(key, 1.0 - rate, a.shape)
    scale = np.asarray(1.0 / (1.0 - rate), dtypes.to_numpy(a.dtype))
    return ops.where(keep, ops.mul(x, scale), np.asarray(0, dtypes.to_numpy(a.dtype)))
