"""Constants keep their value in compiled programs: a Python scalar inside a MindSpore
graph is a float32 or int32 scalar, so a float64 or int64 fill must not reach the
graph as one."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

import fshard as fs

V64 = 0.1 + 1e-12            # not a float32 value
BIG = 2**40 + 1              # not an int32 value


@pytest.mark.parametrize("make", [
    lambda: fs.ops.full((3,), V64, ms.float64),
    lambda: ops.full((3,), V64, dtype=ms.float64),
    lambda: ops.fill(ms.float64, (3,), V64),
], ids=["fs.ops.full", "ops.full", "ops.fill"])
def test_float64_fill_is_exact_under_jit(make):
    x = np.zeros(3, np.float64)
    got = fs.jit(lambda x: x + make())(x).asnumpy()
    assert got.tolist() == [V64] * 3          # was 0.10000000149011612 (float32)


@pytest.mark.parametrize("value", [BIG, -2**62 + 1, 2**31, -2**31 - 1])
def test_int64_fill_beyond_int32_is_exact_under_jit(value):
    x = np.zeros(3, np.int64)
    got = fs.jit(lambda x: x + fs.ops.full((3,), value, ms.int64))(x).asnumpy()
    assert got.tolist() == [value] * 3         # was [1, 1, 1] for 2**40 + 1


def test_special_fills_still_work():
    x = np.zeros(2, np.float64)
    got = fs.jit(lambda x: x + fs.ops.full((2,), float("nan"), ms.float64))(x).asnumpy()
    assert np.isnan(got).all()
    assert fs.jit(lambda x: x + fs.ops.full((2,), 0.5, ms.float64))(x).asnumpy().tolist() \
        == [0.5, 0.5]
    assert fs.jit(lambda x: x + fs.ops.full((2,), float("inf"), ms.float32))(
        x.astype(np.float32)).asnumpy().tolist() == [np.inf, np.inf]
