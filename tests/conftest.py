"""Suite-wide settings: seeded randomness and synchronous PyNative execution.

``pynative_synchronize=True`` makes MindSpore run each eager op before returning
instead of queueing it; fshard's eager checks call ``.asnumpy()`` after almost every
op, and with an asynchronous queue each of those waits ~2 ms (the suite runs many
times faster synchronously). Results are identical.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

ms.set_context(pynative_synchronize=True)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
