"""Dtypes: MindSpore's dtype objects are fshard's dtypes; NumPy does the promotion.

Only dtype *vocabulary* comes from MindSpore here (``mindspore.common.dtype``);
nothing executes.
"""

from __future__ import annotations

import numpy as np
from mindspore.common import dtype as mstype

_MS_TO_NP = {
    mstype.bool_: np.bool_,
    mstype.int8: np.int8,
    mstype.int16: np.int16,
    mstype.int32: np.int32,
    mstype.int64: np.int64,
    mstype.uint8: np.uint8,
    mstype.uint32: np.uint32,
    mstype.float16: np.float16,
    # NB: MindSpore registers a NumPy ``bfloat16`` dtype on import (``asnumpy()`` of a
    # bfloat16 Tensor returns one); it is storage and casts, NumPy has no arithmetic on it.
    mstype.bfloat16: np.dtype("bfloat16").type,
    mstype.float32: np.float32,
    mstype.float64: np.float64,
}
_NP_TO_MS = {np.dtype(v): k for k, v in _MS_TO_NP.items()}
_SHORT = {
    mstype.bool_: "bool",
    mstype.int8: "i8",
    mstype.int16: "i16",
    mstype.int32: "i32",
    mstype.int64: "i64",
    mstype.uint8: "u8",
    mstype.uint32: "u32",
    mstype.float16: "f16",
    mstype.bfloat16: "bf16",
    mstype.float32: "f32",
    mstype.float64: "f64",
}

float32 = mstype.float32
float64 = mstype.float64
float16 = mstype.float16
bfloat16 = mstype.bfloat16
int32 = mstype.int32
int64 = mstype.int64
uint32 = mstype.uint32
bool_ = mstype.bool_


# Values fshard carries but does not compute with: a MindSpore op on the generic path may
# return them (``ops.fft``); fshard's own ops refuse them (``from_numpy``).
_CARRIED = {mstype.complex64: np.complex64, mstype.complex128: np.complex128}


def to_numpy(dtype) -> np.dtype:
    """The NumPy dtype of a MindSpore dtype."""
    return np.dtype(_MS_TO_NP.get(dtype) or _CARRIED[dtype])


def from_numpy(dtype) -> mstype.Type:
    """The MindSpore dtype of a NumPy dtype (float64 stays float64)."""
    try:
        return _NP_TO_MS[np.dtype(dtype)]
    except (KeyError, TypeError):
        from fshard.errors import ArgumentError

        raise ArgumentError(
            f"dtype {dtype} is not supported by fshard; use one of "
            f"{', '.join(sorted(str(d) for d in _MS_TO_NP))}.\nFix: cast the value first "
            "(e.g. x.astype(mindspore.float32)); complex dtypes are not supported yet."
        ) from None


def canonical(dtype) -> mstype.Type:
    """Accept a MindSpore dtype, NumPy dtype, or Python type; return a MindSpore dtype."""
    if dtype in _MS_TO_NP:
        return dtype
    if dtype is float:
        return float32
    if dtype is int:
        return int64
    if dtype is bool:
        return bool_
    return from_numpy(dtype)


def short_name(dtype) -> str:
    return _SHORT.get(dtype, str(dtype))


def is_float(dtype) -> bool:
    return dtype in (mstype.float16, mstype.bfloat16, mstype.float32, mstype.float64)


def is_half(dtype) -> bool:
    """float16 or bfloat16: what MindSpore's kernels widen to float32 inside."""
    return dtype in (mstype.float16, mstype.bfloat16)


def is_int(dtype) -> bool:
    return dtype in (mstype.int8, mstype.int16, mstype.int32, mstype.int64, mstype.uint8,
                     mstype.uint32)


# (mantissa bits, exponent bits) of each float dtype.
_FLOAT_BITS = {mstype.float16: (10, 5), mstype.bfloat16: (7, 8), mstype.float32: (23, 8),
               mstype.float64: (52, 11)}


def is_widening_float(src, dst) -> bool:
    """Whether a cast from ``src`` to ``dst`` represents every ``src`` value exactly
    (float16 -> float32, float32 -> float64; not float32 -> float16, nor
    float16 <-> bfloat16).

    >>> is_widening_float(mstype.float16, float32), is_widening_float(float64, float32)
    (True, False)
    """
    a, b = _FLOAT_BITS.get(src), _FLOAT_BITS.get(dst)
    return a is not None and b is not None and b[0] >= a[0] and b[1] >= a[1]


def result_type(*dtypes) -> mstype.Type:
    """MindSpore's promotion of tensor dtypes: NumPy's within a kind, and bool/int with
    float gives the float (int32 + float32 -> float32, where NumPy says float64).

    >>> result_type(int32, float32), result_type(int32, int64)
    (mindspore.float32, mindspore.int64)
    """
    floats = [d for d in dtypes if is_float(d)]
    if floats:
        dtypes = floats
        if mstype.bfloat16 in floats and mstype.float16 in floats:
            # NumPy has no common type of the two; MindSpore's is float32 (or wider)
            dtypes = [float32 if d in (mstype.float16, mstype.bfloat16) else d for d in floats]
    return from_numpy(np.result_type(*[to_numpy(d) for d in dtypes]))
