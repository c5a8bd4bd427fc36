"""The state tracing needs, in one place, as ``contextvars``.

Every transform keeps a little state while it runs: the trace that ``bind`` sends
equations to, the named axes bound by ``vmap(axis_name=...)`` and ``shard_map``, the
axis a batching interpreter maps over, whether ``vmap`` or ``shard`` is staging, the
mesh axes of the ``shard_map`` body being staged, and the ``with fs.Mesh(...)`` in
effect. Each is a ``ContextVar`` holding an immutable value (a tuple for stacks), so
two threads tracing at once each see only their own (a thread starts from the
defaults), and a context manager restores the previous value by token even when an
exception unwinds it (NB: JAX's ``jax._src.core.trace_ctx``).

This module imports nothing from fshard: every layer may read it.
"""

from __future__ import annotations

import contextlib
import threading
from contextvars import ContextVar
from typing import Iterator

#: The current trace (``core.current_trace``); None means core's eager trace.
trace: ContextVar = ContextVar("fshard_trace", default=None)
#: Named axes bound while staging (``AxisData``, innermost last).
named_axes: ContextVar[tuple] = ContextVar("fshard_named_axes", default=())
#: Axes the batching interpreter is mapping over (``AxisData``, innermost last).
batch_axes: ContextVar[tuple] = ContextVar("fshard_batch_axes", default=())
#: How many ``vmap`` stagings enclose the running code.
vmap_staging: ContextVar[int] = ContextVar("fshard_vmap_staging", default=0)
#: How many ``shard`` stagings or runs enclose the running code.
shard_depth: ContextVar[int] = ContextVar("fshard_shard_depth", default=0)
#: Device counts of the ``shard`` stagings enclosing the running code (innermost last).
shard_devices: ContextVar[tuple] = ContextVar("fshard_shard_devices", default=())
#: How many ``fs.AutoParallel`` steps are being staged around the running code (an
#: ``fs.shard`` called there annotates layouts instead of nesting).
shard_annotations: ContextVar[int] = ContextVar("fshard_shard_annotations", default=0)
#: Inside an ``fs.AutoParallel`` step's update whose parameters and optimizer state are
#: whole on every device by its strategies: ``fs.optim`` updates small leaves together
#: there (one concatenation cannot mix layouts that are all the same), as under
#: ``fs.jit``; elsewhere inside ``fs.shard`` it updates them leaf by leaf.
whole_updates: ContextVar[bool] = ContextVar("fshard_whole_updates", default=False)
#: Tracing an optimizer update that a pipeline splits by stage (each stage updating
#: only its own parameters and optimizer state): ``fs.optim`` updates leaf by leaf
#: there, so that no concatenation ties one stage's leaves to another's.
split_updates: ContextVar[bool] = ContextVar("fshard_split_updates", default=False)
#: Inside ``fs.AutoParallel``'s optimizer update (its step, its pipelines' updates):
#: ``fs.optim.adam`` runs MindSpore's fused Adam kernel there, one equation per leaf
#: (each leaf its own layout and stage), under ``fs.shard`` and ``split_updates`` too:
#: every plan (whole, split, pipelined, in a job) rounds alike.
plan_updates: ContextVar[bool] = ContextVar("fshard_plan_updates", default=False)
#: How many ``shard_map`` bodies are being staged or run around the running code.
shard_map_depth: ContextVar[int] = ContextVar("fshard_shard_map_depth", default=0)
#: Mesh axis names of the ``shard_map`` bodies being staged (innermost last).
replica_axes: ContextVar[tuple] = ContextVar("fshard_replica_axes", default=())
#: ids of the Cells whose ``cell.shard(...)`` is running them now (their own calls
#: inside then trace plainly).
sharded_cells: ContextVar[tuple] = ContextVar("fshard_sharded_cells", default=())
#: ids of the Cells whose ``cell.shard(..., parameter_plan=...)`` the enclosing
#: ``fs.AutoParallel`` step has taken into its own plan (their parameters are its).
planned_cells: ContextVar[tuple] = ContextVar("fshard_planned_cells", default=())
#: The ``with fs.Mesh(...)`` meshes in effect (innermost last).
meshes: ContextVar[tuple] = ContextVar("fshard_meshes", default=())
#: Inside ``with fs.disable_jit():``: ``fs.jit`` functions run op by op, uncompiled.
jit_disabled: ContextVar[bool] = ContextVar("fshard_jit_disabled", default=False)

#: The ``file:line`` of the equation a transform is interpreting: the equations it
#: creates (its JVP, its transpose, its batched form) keep the line of the user's code
#: that created the original (``fs.profile`` groups the backward pass by it).
source: ContextVar = ContextVar("fshard_source", default=None)

#: The loop bodies (``scan``, ``fori_loop``, ``while_loop``) being staged, innermost
#: last: ``fs.random`` warns when a draw there uses a key that no iteration changes.
loop_bodies: ContextVar[tuple] = ContextVar("fshard_loop_bodies", default=())


#: Held while MindSpore runs an eager op or a compiled graph. Its PyNative runtime and
#: graph executor keep process-global state (measured: concurrent eager ops from two
#: threads crash it, concurrent graph calls fail with "call depth is already 0"), so
#: threads tracing at once take turns only for the MindSpore calls themselves.
runtime_lock = threading.RLock()


@contextlib.contextmanager
def setting(var: ContextVar, value) -> Iterator:
    """``var`` set to ``value`` inside the block, restored after it."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def pushed(var: ContextVar, item):
    """``item`` appended to the stack ``var`` holds, inside the block."""
    return setting(var, var.get() + (item,))


def counted(var: ContextVar):
    """The counter ``var`` holds, one higher inside the block."""
    return setting(var, var.get() + 1)


def innermost(var: ContextVar, default=None):
    """The last item of the stack ``var`` holds, or ``default``."""
    stack = var.get()
    return stack[-1] if stack else default
