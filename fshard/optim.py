"""``fs.optim``: optimizers as pure functions of pytrees (optax's shape, MindSpore's
maths).

An optimizer is a pair of functions, ``init(params) -> state`` and
``update(grads, state, params=None) -> (updates, state)``; ``apply_updates(params,
updates)`` adds the updates. Nothing is mutated, so a whole train step composes with
``fs.jit``, ``fs.vmap``, ``fs.shard`` and the grad family:

>>> import numpy as np, fshard as fs
>>> opt = fs.optim.adam(1e-2)
>>> params = {"w": np.ones(3, np.float32)}
>>> state = opt.init(params)
>>> grads = fs.grad(lambda p: (p["w"] ** 2).sum())(params)
>>> updates, state = opt.update(grads, state, params)
>>> [round(float(v), 4) for v in fs.optim.apply_updates(params, updates)["w"].asnumpy()]
[0.99, 0.99, 0.99]

The update rules are MindSpore's (``nn.SGD``, ``nn.Adam``, ``nn.AdamWeightDecay``;
``tests/test_optim.py`` checks them step for step against MindSpore and NumPy);
docs/optim.md states where they differ from optax. The state holds an int32 step
count, so learning-rate schedules (``step -> lr``) and bias corrections run inside
compiled programs.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import numpy as np

from fshard import ops, tree
from fshard.backend.mindspore import as_tensor
from fshard.core import Tracer, typeof
from fshard.errors import ArgumentError

__all__ = ["Optimizer", "sgd", "adam", "adamw", "apply_updates", "chain",
           "clip_by_global_norm", "cosine_decay", "linear_warmup", "constant",
           "SgdState", "AdamState", "ClipState"]


class Optimizer(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params=None) -> (updates,
    state)``."""

    init: Callable
    update: Callable


class SgdState(NamedTuple):
    count: Any      # int32 scalar: steps taken
    momentum: Any   # pytree like params (empty tuple without momentum)


class AdamState(NamedTuple):
    count: Any
    mu: Any         # first moments
    nu: Any         # second moments


class ClipState(NamedTuple):
    pass


# -- argument checks -----------------------------------------------------------------


def _check_number(fn: str, name: str, value, low=None, high=None, low_open=False,
                  high_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or (
            isinstance(value, float) and math.isnan(value)):
        raise ArgumentError(f"fs.optim.{fn}({name}=...) must be a number; got {value!r}.")
    if low is not None and (value < low or (low_open and value == low)):
        bound = f"> {low}" if low_open else f">= {low}"
        raise ArgumentError(f"fs.optim.{fn}({name}=...) must be {bound}; got {value!r}.")
    if high is not None and (value > high or (high_open and value == high)):
        bound = f"< {high}" if high_open else f"<= {high}"
        raise ArgumentError(f"fs.optim.{fn}({name}=...) must be {bound}; got {value!r}.")


def _schedule(fn: str, learning_rate) -> Callable:
    """A float or a schedule ``step -> lr`` as a schedule."""
    if callable(learning_rate):
        return learning_rate
    _check_number(fn, "learning_rate", learning_rate, low=0.0)
    return constant(float(learning_rate))


def _zeros_like(x):
    return ops.zeros(tuple(typeof(x).shape), typeof(x).dtype)


def _count0():
    return as_tensor(np.int32(0))


def _same_structure(fn: str, what: str, a, b) -> None:
    ta, tb = tree.structure(a), tree.structure(b)
    if ta != tb:
        raise ArgumentError(
            f"fs.optim.{fn}: {what} do not have the structure of the parameters the state "
            f"was made for ({tb} expected, got {ta}).\nFix: pass gradients of the same "
            "pytree as the params given to init().")


def _lr_at(schedule: Callable, count):
    """The learning rate for step ``count`` (the step being taken, counted from 0)."""
    return schedule(count)


# -- schedules -----------------------------------------------------------------------


def constant(value: float) -> Callable:
    """The schedule ``step -> value``."""
    _check_number("constant", "value", value)

    def schedule(step):
        return float(value)

    return schedule


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> Callable:
    """``init_value * ((1 - alpha) * (1 + cos(pi * min(step, decay_steps) /
    decay_steps)) / 2 + alpha)`` (optax's ``cosine_decay_schedule``).

    >>> import fshard as fs
    >>> s = fs.optim.cosine_decay(1.0, 10)
    >>> [round(float(s(t)), 4) for t in (0, 5, 10, 20)]
    [1.0, 0.5, 0.0, 0.0]
    """
    _check_number("cosine_decay", "init_value", init_value)
    if isinstance(decay_steps, bool) or not isinstance(decay_steps, int) or decay_steps < 1:
        raise ArgumentError(
            f"fs.optim.cosine_decay(decay_steps=...) must be an int >= 1; got {decay_steps!r}.")
    _check_number("cosine_decay", "alpha", alpha, low=0.0, high=1.0)

    def schedule(step):
        t = ops.minimum(ops.cast(_as_array(step), np.float32), float(decay_steps))
        cos = ops.cos(t * (math.pi / decay_steps))
        return init_value * ((1.0 - alpha) * 0.5 * (cos + 1.0) + alpha)

    return schedule


def linear_warmup(init_value: float, peak_value: float, warmup_steps: int,
                  after: Callable | None = None) -> Callable:
    """From ``init_value`` to ``peak_value`` linearly over ``warmup_steps``, then
    ``after(step - warmup_steps)`` (default: ``peak_value``; e.g.
    ``cosine_decay(peak_value, ...)``; optax's ``warmup_cosine_decay_schedule``).

    >>> import fshard as fs
    >>> s = fs.optim.linear_warmup(0.0, 1.0, 4)
    >>> [round(float(s(t)), 4) for t in (0, 2, 4, 9)]
    [0.0, 0.5, 1.0, 1.0]
    """
    _check_number("linear_warmup", "init_value", init_value)
    _check_number("linear_warmup", "peak_value", peak_value)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ArgumentError(
            "fs.optim.linear_warmup(warmup_steps=...) must be an int >= 1; got "
            f"{warmup_steps!r}.")
    if after is not None and not callable(after):
        raise ArgumentError(
            f"fs.optim.linear_warmup(after=...) must be a schedule (step -> value); got "
            f"{after!r}.")

    def schedule(step):
        t = ops.cast(_as_array(step), np.float32)
        frac = ops.minimum(t, float(warmup_steps)) * (1.0 / warmup_steps)
        warm = init_value + (peak_value - init_value) * frac
        rest = peak_value if after is None else after(ops.maximum(t - warmup_steps, 0.0))
        return ops.where(t < warmup_steps, warm, rest)

    return schedule


def _arrays(t):
    """NumPy leaves as Tensors (Python operators on a Tensor and an ndarray fail)."""
    return None if t is None else tree.map(_as_array, t)


def _as_array(x):
    return x if isinstance(x, Tracer) or hasattr(x, "asnumpy") else as_tensor(np.asarray(x))


# -- optimizers ----------------------------------------------------------------------


def sgd(learning_rate, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0) -> Optimizer:
    """MindSpore's ``nn.SGD`` (dampening 0): ``g += weight_decay * p``; with momentum
    ``v = momentum * v + g`` and the step ``v`` (``g + momentum * v`` with
    ``nesterov``); ``p -= lr * step``.

    >>> import numpy as np, fshard as fs
    >>> opt = fs.optim.sgd(0.1, momentum=0.9)
    >>> s = opt.init({"w": np.ones(2, np.float32)})
    >>> u, s = opt.update({"w": np.ones(2, np.float32)}, s)
    >>> [round(float(v), 4) for v in u["w"].asnumpy()]
    [-0.1, -0.1]
    """
    lr = _schedule("sgd", learning_rate)
    _check_number("sgd", "momentum", momentum, low=0.0)
    _check_number("sgd", "weight_decay", weight_decay, low=0.0)
    if not isinstance(nesterov, bool):
        raise ArgumentError(f"fs.optim.sgd(nesterov=...) must be a bool; got {nesterov!r}.")
    if nesterov and momentum == 0:
        raise ArgumentError("fs.optim.sgd(nesterov=True) needs momentum > 0 (as in MindSpore).")

    def init(params):
        mom = tree.map(_zeros_like, params) if momentum else ()
        return SgdState(_count0(), mom)

    def update(grads, state, params=None):
        _check_state("sgd", state, SgdState)
        grads, params = _arrays(grads), _arrays(params)
        if weight_decay:
            _needs_params("sgd", "weight_decay", params)
            _same_structure("sgd", "the parameters", params, grads)
            grads = tree.map(lambda g, p: g + weight_decay * p, grads, params)
        step = grads
        mom = state.momentum
        if momentum:
            _same_structure("sgd", "the gradients", grads, mom)
            mom = tree.map(lambda v, g: momentum * v + g, mom, grads)
            step = (tree.map(lambda g, v: g + momentum * v, grads, mom) if nesterov else mom)
        rate = _lr_at(lr, state.count)
        updates = tree.map(lambda s: ops.cast(-rate * s, typeof(s).dtype), step)
        return updates, SgdState(state.count + 1, mom)

    return Optimizer(init, update)


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> Optimizer:
    """MindSpore's ``nn.Adam``: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`` (eps is added to
    the uncorrected ``sqrt(v)``; optax adds it to the corrected one).

    >>> import numpy as np, fshard as fs
    >>> opt = fs.optim.adam(0.1)
    >>> s = opt.init({"w": np.ones(2, np.float32)})
    >>> u, s = opt.update({"w": np.full(2, 3.0, np.float32)}, s)
    >>> [round(float(v), 4) for v in u["w"].asnumpy()]
    [-0.1, -0.1]
    """
    lr = _schedule("adam", learning_rate)
    _check_betas("adam", b1, b2, eps)
    return _adam("adam", lr, b1, b2, eps, weight_decay=0.0, bias_correction=True)


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-2) -> Optimizer:
    """MindSpore's ``nn.AdamWeightDecay``: the moments of ``adam``, no bias correction,
    ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)`` (decoupled weight decay).

    >>> import numpy as np, fshard as fs
    >>> opt = fs.optim.adamw(0.1, weight_decay=0.0)
    >>> s = opt.init({"w": np.ones(2, np.float32)})
    >>> u, s = opt.update({"w": np.full(2, 3.0, np.float32)}, s, {"w": np.ones(2, np.float32)})
    >>> [round(float(v), 4) for v in u["w"].asnumpy()]
    [-0.3162, -0.3162]
    """
    lr = _schedule("adamw", learning_rate)
    _check_betas("adamw", b1, b2, eps)
    _check_number("adamw", "weight_decay", weight_decay, low=0.0)
    return _adam("adamw", lr, b1, b2, eps, weight_decay=weight_decay, bias_correction=False)


def _check_betas(fn, b1, b2, eps) -> None:
    _check_number(fn, "b1", b1, low=0.0, high=1.0, high_open=True)
    _check_number(fn, "b2", b2, low=0.0, high=1.0, high_open=True)
    _check_number(fn, "eps", eps, low=0.0, low_open=True)


def _adam(fn, lr, b1, b2, eps, weight_decay, bias_correction) -> Optimizer:
    def init(params):
        return AdamState(_count0(), tree.map(_zeros_like, params),
                         tree.map(_zeros_like, params))

    def update(grads, state, params=None):
        _check_state(fn, state, AdamState)
        grads, params = _arrays(grads), _arrays(params)
        _same_structure(fn, "the gradients", grads, state.mu)
        if weight_decay:
            _needs_params(fn, "weight_decay", params)
        mu = tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, grads)
        nu = tree.map(lambda v, g: b2 * v + (1.0 - b2) * (g * g), state.nu, grads)
        count = state.count + 1
        rate = _lr_at(lr, state.count)
        if bias_correction:
            t = ops.cast(count, np.float32)
            rate = rate * ops.sqrt(1.0 - ops.pow(b2, t)) / (1.0 - ops.pow(b1, t))
        direction = tree.map(lambda m, v: m / (ops.sqrt(v) + eps), mu, nu)
        if weight_decay:
            direction = tree.map(lambda d, p: d + weight_decay * p, direction, params)
        updates = tree.map(lambda d: ops.cast(-rate * d, typeof(d).dtype), direction)
        return updates, AdamState(count, mu, nu)

    return Optimizer(init, update)


def _check_state(fn, state, cls) -> None:
    if not isinstance(state, cls):
        raise ArgumentError(
            f"fs.optim.{fn}.update(grads, state, ...): state must be the {cls.__name__} "
            f"its init() returned; got {type(state).__name__}.")


def _needs_params(fn, what, params) -> None:
    if params is None:
        raise ArgumentError(
            f"fs.optim.{fn}.update(grads, state, params): {what} needs the parameters.\n"
            "Fix: pass params as the third argument.")


# -- combinators -----------------------------------------------------------------------


def clip_by_global_norm(max_norm: float) -> Optimizer:
    """Scale the gradients so that their global norm (over every leaf) is at most
    ``max_norm`` (``mindspore.ops.clip_by_global_norm``; optax's of the same name).
    Chain it before an optimizer: ``chain(clip_by_global_norm(1.0), adam(1e-3))``."""
    _check_number("clip_by_global_norm", "max_norm", max_norm, low=0.0, low_open=True)

    def init(params):
        return ClipState()

    def update(grads, state, params=None):
        grads = _arrays(grads)
        leaves = tree.leaves(grads)
        if not leaves:
            return grads, state
        sq = None
        for g in leaves:
            s = ops.reduce_sum(ops.cast(g, np.float32) ** 2)
            sq = s if sq is None else sq + s
        norm = ops.sqrt(sq)
        scale = max_norm / ops.maximum(norm, max_norm)
        return tree.map(lambda g: ops.cast(g * scale, typeof(g).dtype), grads), state

    return Optimizer(init, update)


def chain(*optimizers: Optimizer) -> Optimizer:
    """Apply transformations in order: each one's updates are the next one's gradients
    (optax's ``chain``)."""
    for i, o in enumerate(optimizers):
        if not (hasattr(o, "init") and hasattr(o, "update")):
            raise ArgumentError(
                f"fs.optim.chain(...): argument {i} is not an optimizer (init/update); got "
                f"{o!r}.")

    def init(params):
        return tuple(o.init(params) for o in optimizers)

    def update(grads, state, params=None):
        if not isinstance(state, tuple) or len(state) != len(optimizers):
            raise ArgumentError(
                "fs.optim.chain: state must be the tuple its init() returned, one state "
                f"per optimizer ({len(optimizers)}).")
        new = []
        for o, s in zip(optimizers, state):
            grads, s = o.update(grads, s, params)
            new.append(s)
        return grads, tuple(new)

    return Optimizer(init, update)


def apply_updates(params, updates):
    """``params + updates``, leaf by leaf, in each parameter's dtype."""
    _same_structure("apply_updates", "the updates", updates, params)
    params, updates = _arrays(params), _arrays(updates)
    return tree.map(lambda p, u: ops.cast(ops.add(p, u), typeof(p).dtype), params, updates)


from fshard.optim_accumulate import MultiSteps, MultiStepsState, multi_steps  # noqa: E402,F401
