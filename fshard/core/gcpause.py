"""``paused_gc()``: Python's cyclic garbage collector paused while fshard traces and
plans.

Tracing and planning allocate many small objects (equations, candidates, layouts).
CPython starts a collection every few hundred allocations net, and now and then a full
one, which walks every object of the process, MindSpore's included: measured on the
wide MLP's step (8 devices, ``sharding_propagation``), a plan took 0.13-0.14 s, and
0.26 s when a full collection fell inside it. Paused, the same plans took
0.13-0.16 s. The collector runs as usual once the plan is made (nothing planning makes
is kept in cycles it alone can free), and a pause inside another keeps the outer one's
state, as ``timeit`` pauses it around what it times.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused_gc():
    """Python's cyclic collector off inside the block (if it was on), back on after."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
