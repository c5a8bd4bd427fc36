"""Gradient accumulation: ``fs.optim.multi_steps(opt, k)`` (NB: optax's ``MultiSteps``).

The wrapped optimizer sees the mean of ``k`` consecutive gradients: each call adds
its gradients to an accumulator; every ``k``-th call passes the mean to ``opt`` and
returns its updates (and clears the accumulator), the other calls return zero
updates and leave ``opt``'s state alone. The choice is arithmetic (a select on the
micro-step counter), not Python control flow, so a whole training step with it
compiles once under ``fs.jit`` and runs every call.

>>> import numpy as np, fshard as fs
>>> opt = fs.optim.multi_steps(fs.optim.sgd(1.0), k=2)
>>> params = {"w": np.zeros(1, np.float32)}
>>> state = opt.init(params)
>>> u, state = opt.update({"w": np.ones(1, np.float32)}, state)
>>> float(u["w"].asnumpy()[0])
0.0
>>> u, state = opt.update({"w": 3 * np.ones(1, np.float32)}, state)
>>> float(u["w"].asnumpy()[0])
-2.0
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from fshard import ops
from fshard.core import tree
from fshard.backend.mindspore import as_tensor
from fshard.core.tracing import Tracer, typeof
from fshard.errors import ArgumentError


class MultiStepsState(NamedTuple):
    mini_step: Any      # int32 scalar: gradients accumulated since the last update
    gradient_step: Any  # int32 scalar: updates the inner optimizer has made
    inner_state: Any    # the inner optimizer's state
    acc_grads: Any      # pytree like params: the sum of the accumulated gradients


class MultiSteps(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params=None) -> (updates,
    state)``; ``has_updated(state)``: whether the call that returned ``state`` applied
    the inner optimizer (a bool scalar array)."""

    init: Callable
    update: Callable
    has_updated: Callable


def _array(x):
    return x if isinstance(x, Tracer) or hasattr(x, "asnumpy") else as_tensor(np.asarray(x))


def _zeros_like(x):
    return ops.zeros(tuple(typeof(x).shape), typeof(x).dtype)


def multi_steps(opt, k: int) -> MultiSteps:
    """Accumulate ``k`` gradients and apply ``opt`` to their mean every ``k``-th call
    (optax's ``MultiSteps``); the other calls return zero updates.

    Args:
        opt: an ``fs.optim`` optimizer (``init``, ``update``).
        k: the number of micro-steps per update (an int >= 1).

    ``k`` calls on ``k`` equal-sized micro-batches of a mean loss give the update of
    one call on their concatenation (to rounding). See docs/optim.md.
    """
    if not (hasattr(opt, "init") and hasattr(opt, "update")):
        raise ArgumentError(
            f"fs.optim.multi_steps(opt, k): opt must be an optimizer with init(params) and "
            f"update(grads, state, params); got {type(opt).__name__} {opt!r:.60}.\nFix: "
            "pass e.g. fs.optim.adam(1e-3).")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ArgumentError(
            f"fs.optim.multi_steps(opt, k): k must be an int >= 1 (micro-steps per update); "
            f"got {type(k).__name__} {k!r}.\nFix: e.g. multi_steps(opt, k=4).")
    k = int(k)

    def init(params):
        params = tree.map(_array, params)
        zero = as_tensor(np.int32(0))
        return MultiStepsState(zero, zero, opt.init(params), tree.map(_zeros_like, params))

    def update(grads, state, params=None):
        if not isinstance(state, MultiStepsState):
            raise ArgumentError(
                "fs.optim.multi_steps(...).update(grads, state, ...): state must be the "
                f"MultiStepsState its init() returned; got {type(state).__name__}.")
        grads = tree.map(_array, grads)
        if tree.structure(grads) != tree.structure(state.acc_grads):
            raise ArgumentError(
                "fs.optim.multi_steps(...).update: the gradients do not have the structure "
                f"of the parameters the state was made for ({tree.structure(state.acc_grads)}"
                f" expected, got {tree.structure(grads)}).\nFix: pass gradients of the same "
                "pytree as the params given to init().")
        acc = tree.map(lambda a, g: a + ops.cast(g, typeof(a).dtype), state.acc_grads, grads)
        emit = ops.equal(state.mini_step, k - 1)
        mean = tree.map(lambda a: a / float(k), acc)
        # The inner step runs every call; its results are kept on the k-th only (a
        # select, so the step stays one straight-line program).
        inner_updates, inner_state = opt.update(mean, state.inner_state, params)
        updates = tree.map(lambda u: ops.where(emit, u, ops.zeros_like(u)), inner_updates)
        new_inner = tree.map(lambda new, old: ops.where(emit, new, _array(old)),
                             inner_state, state.inner_state)
        new_acc = tree.map(lambda a: ops.where(emit, ops.zeros_like(a), a), acc)
        mini = ops.where(emit, ops.zeros_like(state.mini_step), state.mini_step + 1)
        step = state.gradient_step + ops.cast(emit, typeof(state.gradient_step).dtype)
        return updates, MultiStepsState(mini, step, new_inner, new_acc)

    def has_updated(state):
        return ops.equal(state.mini_step, 0)

    return MultiSteps(init, update, has_updated)
