"""jaxtyping names for the arrays in fshard's public signatures.

fshard's public functions take MindSpore Tensors and NumPy arrays (and, while a
transform traces, its tracers). Their annotations give the dtype family and the shape
in jaxtyping's notation, ``Float[Array, "b 784"]``, as ``ArrayType.jaxtyping()``
renders a type. They document; fshard checks shapes itself, with errors naming the
argument (jaxtyping's run-time checker is not applied).

>>> Float[Array, "b 784"]
typing.Union[jaxtyping.Float[Tensor, 'b 784'], jaxtyping.Float[ndarray, 'b 784']]
"""

from __future__ import annotations

from typing import Union

import numpy as np
from jaxtyping import Bool, Float, Int, Int32, Shaped, UInt, UInt32
from mindspore import Tensor

Array = Union[Tensor, np.ndarray]
"""An array argument: a MindSpore Tensor or a NumPy array."""

ArrayLike = Union[Shaped[Array, "..."], bool, int, float]
"""An op function's operand: an array or a Python scalar (a weakly typed constant)."""

ArrayTree = Union[Shaped[Array, "..."], tuple, list, dict]
"""An array, or a pytree (tuples, lists, dicts) of arrays."""

Key = UInt32[Array, "2"]
"""An ``fs.random`` key: two uint32 words."""

__all__ = ["Array", "ArrayLike", "ArrayTree", "Bool", "Float", "Int", "Int32", "Key",
           "Shaped", "UInt", "UInt32"]
