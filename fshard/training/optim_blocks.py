"""optax's building blocks and schedules, by optax's names, in ``fs.optim``.

Each block is a ``GradientTransformation``: ``init(params) -> state`` and
``update(updates, state, params=None) -> (updates, state)``, the same pair as
fshard's optimizers, so they chain with them (``fs.optim.chain``). The formulas are
optax's (``tests/test_jax_api.py`` checks them against optax's numbers); where
``fs.optim.adam``/``adamw`` follow MindSpore instead, the chain of blocks gives
optax's optimizer exactly:

>>> import numpy as np, fshard as fs
>>> optax_adamw = fs.optim.chain(
...     fs.optim.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
...     fs.optim.add_decayed_weights(1e-4),
...     fs.optim.scale_by_learning_rate(1e-3))       # = optax.adamw(1e-3, weight_decay=1e-4)
>>> params = {"w": np.ones(2, np.float32)}
>>> state = optax_adamw.init(params)
>>> updates, state = optax_adamw.update({"w": np.full(2, 0.5, np.float32)}, state, params)
>>> [round(float(u), 7) for u in updates["w"].asnumpy()]
[-0.0010001, -0.0010001]

Every number is computed in the dtype of the values updated (float64 updates get
float64 hyperparameters, bias corrections and schedules; see "dtypes" below), as in
fs.optim's optimizers, which share this module's dtype rules and schedules.

A schedule is a ``Schedule``: ``step -> value`` (step counted from 0), traceable, so
it runs inside compiled programs, and ``schedule(step, dtype)`` computes in ``dtype``.
A plain function ``step -> value`` works wherever a schedule is taken.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import numpy as np

from fshard.core import dtypes, tree
from fshard import ops
from fshard.backend.mindspore import as_tensor
from fshard.core.tracing import Tracer, typeof
from fshard.errors import ArgumentError

__all__ = [
    "GradientTransformation", "identity", "scale", "scale_by_learning_rate",
    "scale_by_schedule", "scale_by_adam", "add_decayed_weights", "trace", "masked",
    "inject_hyperparams", "constant_schedule", "linear_schedule", "polynomial_schedule",
    "cosine_decay_schedule", "warmup_cosine_decay_schedule", "exponential_decay",
    "piecewise_constant_schedule", "join_schedules", "EmptyState", "ScaleByScheduleState",
    "ScaleByAdamState", "TraceState", "MaskedState", "InjectHyperparamsState",
]


class GradientTransformation(NamedTuple):
    """optax's name for a pair ``init(params) -> state``, ``update(updates, state,
    params=None) -> (updates, state)`` (fshard's optimizers are such pairs too).

    >>> import numpy as np, fshard as fs
    >>> double = fs.optim.GradientTransformation(
    ...     init=lambda params: fs.optim.EmptyState(),
    ...     update=lambda updates, state, params=None: (fs.tree.map(lambda u: 2 * u, updates),
    ...                                                 state))
    >>> opt = fs.optim.chain(double, fs.optim.scale(-0.1))
    >>> u, _ = opt.update({"w": np.ones(2, np.float32)}, opt.init(None))
    >>> [round(float(v), 4) for v in u["w"].asnumpy()]
    [-0.2, -0.2]
    """

    init: Callable
    update: Callable


class EmptyState(NamedTuple):
    """The state of a stateless block."""


class ScaleByScheduleState(NamedTuple):
    count: Any  # int32 scalar: steps taken


class ScaleByAdamState(NamedTuple):
    count: Any
    mu: Any
    nu: Any


class TraceState(NamedTuple):
    trace: Any


class MaskedState(NamedTuple):
    inner_state: Any


class InjectHyperparamsState(NamedTuple):
    count: Any          # int32 scalar: steps taken
    hyperparams: dict   # name -> float64 scalar (the value of the step being taken)
    inner_state: Any


# -- helpers -------------------------------------------------------------------------


def _number(fn: str, name: str, value, low=None, low_open=False, high=None,
            high_open=False, integer=False) -> None:
    kinds = (int, np.integer) if integer else (int, float, np.number)
    what = "an int" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ArgumentError(f"fs.optim.{fn}({name}=...) must be {what}; got {value!r}.")
    if not integer:
        try:
            finite = math.isfinite(value)
        except OverflowError:  # a Python int beyond the float range
            finite = False
        if not finite:  # an inf or nan hyperparameter makes every value inf or nan
            raise ArgumentError(f"fs.optim.{fn}({name}=...) must be a finite number; got "
                                f"{value!r}.\nFix: pass a finite {name}.")
    if low is not None and (value < low or (low_open and value == low)):
        raise ArgumentError(
            f"fs.optim.{fn}({name}=...) must be {'>' if low_open else '>='} {low}; got "
            f"{value!r}.")
    if high is not None and (value > high or (high_open and value == high)):
        raise ArgumentError(
            f"fs.optim.{fn}({name}=...) must be {'<' if high_open else '<='} {high}; got "
            f"{value!r}.")


def _is_array(x) -> bool:
    return isinstance(x, Tracer) or hasattr(x, "asnumpy")


def _value(fn: str, name: str, value, **bounds) -> None:
    """A hyperparameter: a number (checked) or an array (``inject_hyperparams``)."""
    if not _is_array(value):
        _number(fn, name, value, **bounds)


def _as_array(x):
    return x if _is_array(x) else as_tensor(np.asarray(x))


def _arrays(t):
    """NumPy leaves as Tensors (Python operators on a Tensor and an ndarray fail)."""
    return None if t is None else tree.map(_as_array, t)


def _count0():
    return as_tensor(np.int32(0))


def _check_state(fn: str, state, cls) -> None:
    if not isinstance(state, cls):
        raise ArgumentError(
            f"fs.optim.{fn}.update(updates, state, ...): state must be the {cls.__name__} "
            f"its init() returned; got {type(state).__name__}.")


# -- dtypes ------------------------------------------------------------------------------
#
# Every number is computed in the dtype of the values it updates: a float64 leaf gets a
# float64 update made of float64 hyperparameters (bias corrections, schedules), a
# float32 leaf float32 ones. Any other leaf (float16, integers) is worked with in
# float32, its state too, and its update is float32 (apply_updates casts back): in
# float16, eps = 1e-8 is 0 and a second moment of 1e-9 underflows. fs.optim's
# optimizers follow the same rules (fshard/training/optim.py).
#
# The arithmetic goes through fshard.ops, never Python operators on Tensors: outside a
# trace those are MindSpore's, which round a Python float to float32 first (0.9 * a
# float64 Tensor is 0.899999976...). Two Python numbers are combined in Python
# (float64); ops.sub(1.0, 0.9) would be a float32 Tensor.


def _state_dtype(dtype):
    """The dtype of a leaf's state and update: its own for a float32 or float64 leaf,
    float32 otherwise."""
    return dtype if dtype in (dtypes.float32, dtypes.float64) else dtypes.float32


def _hyper_dtype(dtype):
    """The dtype a float leaf's hyperparameters are computed in."""
    return dtypes.float64 if dtype == dtypes.float64 else dtypes.float32


def _as_state(x, dtype):
    return x if typeof(x).dtype == dtype else ops.cast(x, dtype)


def _work(x):
    """A leaf in the dtype it is updated in."""
    x = _as_array(x)
    return _as_state(x, _state_dtype(typeof(x).dtype))


def _zeros_like(x):
    return ops.zeros(tuple(typeof(x).shape), _state_dtype(typeof(x).dtype))


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _hp(x, dtype):
    """A hyperparameter in ``dtype``: a number stays a Python float (fshard.ops computes
    it in the other operand's dtype), an array (``inject_hyperparams``) is cast."""
    return float(x) if _is_number(x) else _as_state(_as_array(x), dtype)


def _one_minus(x):
    return 1.0 - x if _is_number(x) else ops.sub(1.0, x)


def _per_dtype(fn: Callable) -> Callable:
    """``fn(dtype)``, computed once per dtype (one schedule value per leaf dtype)."""
    cache: dict = {}

    def at(dtype):
        if dtype not in cache:
            cache[dtype] = fn(dtype)
        return cache[dtype]

    return at


# -- the schedule protocol ---------------------------------------------------------------


class Schedule:
    """A schedule ``step -> value`` that computes in a given dtype:
    ``schedule(step, dtype=None)`` (default: the step's float dtype, else float32).
    Every fshard schedule is one; the optimizers and building blocks ask each leaf's
    dtype, so a float64 parameter gets a float64 learning rate. ``Schedule(fn, text)``
    makes one of ``fn(step, dtype)``; a plain function ``step -> value`` works too, its
    value cast to the dtype asked."""

    def __init__(self, fn: Callable, text: str):
        self._fn, self._text = fn, text

    def __call__(self, step, dtype=None):
        if dtype is None:
            d = typeof(step).dtype
            dtype = d if dtypes.is_float(d) else dtypes.float32
        return self._fn(step, dtypes.canonical(dtype))

    def __repr__(self) -> str:
        return self._text


def _scalar(value, dtype):
    """A number as a ``dtype`` scalar array, computed in the program (a captured Tensor
    would be a constant input of every compiled step). Not ``ops.full((), value)``:
    under ``fs.jit`` that rounds a float64 value to float32; 0 + value is exact."""
    return ops.add(ops.zeros((), dtype), float(value))


def _float_step(step, dtype):
    return ops.cast(_as_array(step), dtype)


def _schedule_value(schedule: Callable, step, dtype):
    """A schedule's value at ``step`` as a ``dtype`` scalar array."""
    if isinstance(schedule, Schedule):
        value = schedule(step, dtype)
    else:
        value = schedule(step)
    if _is_number(value):
        return _scalar(value, dtype)
    return _as_state(_as_array(value), dtype)


# -- transformations -------------------------------------------------------------------


def identity() -> GradientTransformation:
    """Updates unchanged (optax's ``identity``).

    >>> import numpy as np, fshard as fs
    >>> fs.optim.identity().update({"w": np.ones(2)}, fs.optim.EmptyState())[0]["w"].tolist()
    [1.0, 1.0]
    """
    return GradientTransformation(lambda params: EmptyState(),
                                  lambda updates, state, params=None: (updates, state))


def scale(step_size) -> GradientTransformation:
    """``updates * step_size`` (optax's ``scale``).

    >>> import numpy as np, fshard as fs
    >>> u, _ = fs.optim.scale(-0.5).update({"w": np.ones(2, np.float32)}, fs.optim.EmptyState())
    >>> u["w"].asnumpy().tolist()
    [-0.5, -0.5]
    """
    _value("scale", "step_size", step_size)

    def scaled(u):
        w = _work(u)
        return ops.mul(w, _hp(step_size, typeof(w).dtype))

    def update(updates, state, params=None):
        return tree.map(scaled, _arrays(updates)), state

    return GradientTransformation(lambda params: EmptyState(), update)


def scale_by_schedule(step_size_fn: Callable) -> GradientTransformation:
    """``updates * step_size_fn(count)``, ``count`` the steps taken before this one
    (optax's ``scale_by_schedule``).

    >>> import numpy as np, fshard as fs
    >>> t = fs.optim.scale_by_schedule(lambda n: 1.0 / (n + 1))
    >>> s = t.init({"w": np.ones(1, np.float32)})
    >>> for _ in range(3):
    ...     u, s = t.update({"w": np.ones(1, np.float32)}, s)
    >>> round(float(u["w"].asnumpy()[0]), 4)
    0.3333
    """
    if not callable(step_size_fn):
        raise ArgumentError(
            f"fs.optim.scale_by_schedule(step_size_fn=...) must be a schedule (step -> "
            f"value); got {step_size_fn!r}.\nFix: fs.optim.scale(value) for a constant.")

    def update(updates, state, params=None):
        _check_state("scale_by_schedule", state, ScaleByScheduleState)
        step_size = _per_dtype(lambda d: _schedule_value(step_size_fn, state.count, d))

        def scaled(u):
            w = _work(u)
            return ops.mul(w, step_size(typeof(w).dtype))

        return tree.map(scaled, _arrays(updates)), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(lambda params: ScaleByScheduleState(_count0()), update)


def scale_by_learning_rate(learning_rate, *, flip_sign: bool = True) -> GradientTransformation:
    """``-learning_rate * updates`` (a number or a schedule; optax's
    ``scale_by_learning_rate``).

    >>> import numpy as np, fshard as fs
    >>> t = fs.optim.scale_by_learning_rate(fs.optim.linear_schedule(0.5, 0.0, 10))
    >>> u, s = t.update({"w": np.ones(2, np.float32)}, t.init(None))
    >>> u["w"].asnumpy().tolist()
    [-0.5, -0.5]
    """
    if not isinstance(flip_sign, bool):
        raise ArgumentError(
            f"fs.optim.scale_by_learning_rate(flip_sign=...) must be a bool; got {flip_sign!r}.")
    if callable(learning_rate):
        if not flip_sign:
            return scale_by_schedule(learning_rate)
        return scale_by_schedule(Schedule(
            lambda step, dtype: ops.neg(_schedule_value(learning_rate, step, dtype)),
            f"-{learning_rate!r}"))
    _value("scale_by_learning_rate", "learning_rate", learning_rate)
    if not flip_sign:
        return scale(learning_rate)
    return scale(-learning_rate if _is_number(learning_rate) else ops.neg(learning_rate))


def scale_by_adam(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, *,
                  nesterov: bool = False) -> GradientTransformation:
    """Adam's direction, as optax computes it: ``mu = b1 mu + (1 - b1) g``, ``nu = b2 nu
    + (1 - b2) g^2``, ``mu_hat = mu / (1 - b1^t)``, ``nu_hat = nu / (1 - b2^t)``, update
    ``mu_hat / (sqrt(nu_hat + eps_root) + eps)`` (eps added to the corrected root;
    ``fs.optim.adam`` adds it to the uncorrected one, as MindSpore does). Chain it with
    ``scale_by_learning_rate`` for optax's ``adam``.

    >>> import numpy as np, fshard as fs
    >>> t = fs.optim.scale_by_adam()
    >>> s = t.init({"w": np.zeros(2, np.float32)})
    >>> u, s = t.update({"w": np.array([2.0, -3.0], np.float32)}, s)
    >>> [round(float(v), 4) for v in u["w"].asnumpy()]
    [1.0, -1.0]
    """
    for name, v in (("b1", b1), ("b2", b2)):
        _value("scale_by_adam", name, v, low=0.0, high=1.0, high_open=True)
    _value("scale_by_adam", "eps", eps, low=0.0)
    _value("scale_by_adam", "eps_root", eps_root, low=0.0)
    if not isinstance(nesterov, bool):
        raise ArgumentError(f"fs.optim.scale_by_adam(nesterov=...) must be a bool; got "
                            f"{nesterov!r}.")

    def init(params):
        zeros = tree.map(_zeros_like, _arrays(params))
        return ScaleByAdamState(_count0(), zeros, tree.map(_zeros_like, _arrays(params)))

    def update(updates, state, params=None):
        _check_state("scale_by_adam", state, ScaleByAdamState)
        # each gradient in the dtype of its moments (float32 for a float16 leaf)
        grads = tree.map(lambda g, m: _as_state(_as_array(g), typeof(m).dtype),
                         updates, state.mu)

        def first(m, g):
            h = _hp(b1, typeof(m).dtype)
            return ops.add(ops.mul(m, h), ops.mul(g, _one_minus(h)))

        def second(v, g):
            h = _hp(b2, typeof(v).dtype)
            return ops.add(ops.mul(v, h), ops.mul(ops.mul(g, g), _one_minus(h)))

        mu = tree.map(first, state.mu, grads)
        nu = tree.map(second, state.nu, grads)
        count = state.count + 1

        @_per_dtype
        def corrections(d):  # 1 - b1^t, 1 - b2^t, 1 - b1^(t+1) in the leaf's dtype
            t = ops.cast(count, d)
            h1 = _hp(b1, d)
            return (ops.sub(1.0, ops.pow(h1, t)), ops.sub(1.0, ops.pow(_hp(b2, d), t)),
                    ops.sub(1.0, ops.pow(h1, ops.add(t, 1.0))) if nesterov else None)

        def direction(m, v, g):
            d = typeof(m).dtype
            c1, c2, c1_next = corrections(d)
            if nesterov:  # optax: b1 mu / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t)
                h1 = _hp(b1, d)
                m_hat = ops.add(ops.div(ops.mul(m, h1), c1_next),
                                ops.div(ops.mul(g, _one_minus(h1)), c1))
            else:
                m_hat = ops.div(m, c1)
            root = ops.sqrt(ops.add(ops.div(v, c2), _hp(eps_root, d)))
            return ops.div(m_hat, ops.add(root, _hp(eps, d)))

        return tree.map(direction, mu, nu, grads), ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay=0.0, mask=None) -> GradientTransformation:
    """``updates + weight_decay * params`` (optax's ``add_decayed_weights``: decoupled
    weight decay when chained before ``scale_by_learning_rate``). ``mask``: a pytree of
    bools like the params (or a function ``params -> mask``); only True leaves decay.

    >>> import numpy as np, fshard as fs
    >>> t = fs.optim.add_decayed_weights(0.1)
    >>> u, _ = t.update({"w": np.zeros(2, np.float32)}, t.init(None), {"w": np.ones(2, np.float32)})
    >>> [round(float(v), 4) for v in u["w"].asnumpy()]
    [0.1, 0.1]
    """
    _value("add_decayed_weights", "weight_decay", weight_decay)

    def update(updates, state, params=None):
        if params is None:
            raise ArgumentError(
                "fs.optim.add_decayed_weights.update(updates, state, params): weight decay "
                "needs the parameters.\nFix: pass params as the third argument.")
        def decayed(u, p):
            w = _work(u)
            d = typeof(w).dtype
            return ops.add(w, ops.mul(_as_state(_as_array(p), d), _hp(weight_decay, d)))

        return tree.map(decayed, _arrays(updates), _arrays(params)), state

    inner = GradientTransformation(lambda params: EmptyState(), update)
    return inner if mask is None else masked(inner, mask)


def trace(decay, nesterov: bool = False) -> GradientTransformation:
    """Momentum, as optax's ``trace``: ``t = decay * t + g``; the update is ``t`` (``g +
    decay * t`` with ``nesterov``).

    >>> import numpy as np, fshard as fs
    >>> t = fs.optim.trace(0.9)
    >>> s = t.init({"w": np.zeros(1, np.float32)})
    >>> for _ in range(2):
    ...     u, s = t.update({"w": np.ones(1, np.float32)}, s)
    >>> [round(float(v), 4) for v in u["w"].asnumpy()]
    [1.9]
    """
    _value("trace", "decay", decay, low=0.0)
    if not isinstance(nesterov, bool):
        raise ArgumentError(f"fs.optim.trace(nesterov=...) must be a bool; got {nesterov!r}.")

    def init(params):
        return TraceState(tree.map(_zeros_like, _arrays(params)))

    def update(updates, state, params=None):
        _check_state("trace", state, TraceState)
        grads = tree.map(lambda g, t: _as_state(_as_array(g), typeof(t).dtype),
                         updates, state.trace)
        new = tree.map(lambda t, g: ops.add(ops.mul(t, _hp(decay, typeof(t).dtype)), g),
                       state.trace, grads)
        if not nesterov:
            return new, TraceState(new)
        out = tree.map(lambda g, t: ops.add(g, ops.mul(t, _hp(decay, typeof(t).dtype))),
                       grads, new)
        return out, TraceState(new)

    return GradientTransformation(init, update)


def masked(inner, mask) -> GradientTransformation:
    """Apply ``inner`` to the leaves where ``mask`` is True; pass the others through
    unchanged (optax's ``masked``). ``mask``: a pytree of bools shaped like the params
    (a prefix works), or a function ``params -> mask``.

    >>> import numpy as np, fshard as fs
    >>> params = {"w": np.ones(2, np.float32), "b": np.ones(2, np.float32)}
    >>> t = fs.optim.masked(fs.optim.scale(10.0), {"w": True, "b": False})
    >>> u, _ = t.update(params, t.init(params), params)
    >>> u["w"].asnumpy().tolist(), u["b"].asnumpy().tolist()
    ([10.0, 10.0], [1.0, 1.0])
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise ArgumentError(f"fs.optim.masked(inner, mask): inner must be a transformation "
                            f"(init/update); got {inner!r}.")

    def leaf_mask(tree_):
        m = mask(tree_) if callable(mask) else mask
        try:
            flags = tree.broadcast_prefix(m, tree_)
        except ValueError as e:
            raise ArgumentError(
                f"fs.optim.masked: the mask does not match the parameters' structure "
                f"{tree.structure(tree_)}: {e}\nFix: give a pytree of bools shaped like "
                "the params (or a prefix of it).") from None
        for f in flags:
            if not isinstance(f, (bool, np.bool_)):
                raise ArgumentError(
                    f"fs.optim.masked: mask leaves must be Python bools; got "
                    f"{type(f).__name__} {f!r}.")
        return flags

    def keep(tree_, flags):
        """``tree_`` with the unmasked leaves removed (None: an empty subtree)."""
        leaves, structure = tree.flatten(tree_)
        return tree.unflatten(structure, [x if f else None for x, f in zip(leaves, flags)])

    def init(params):
        return MaskedState(inner.init(keep(params, leaf_mask(params))))

    def update(updates, state, params=None):
        _check_state("masked", state, MaskedState)
        updates = _arrays(updates)
        flags = leaf_mask(updates)  # as optax: a mask function sees the updates here
        new, inner_state = inner.update(keep(updates, flags), state.inner_state,
                                        None if params is None else keep(params, flags))
        leaves, structure = tree.flatten(updates)
        done = iter(tree.leaves(new))
        out = [next(done) if f else x for x, f in zip(leaves, flags)]
        return tree.unflatten(structure, out), MaskedState(inner_state)

    return GradientTransformation(init, update)


def inject_hyperparams(inner_factory: Callable) -> Callable:
    """Make a transformation's hyperparameters part of its state (optax's
    ``inject_hyperparams``): ``inject_hyperparams(factory)(**hyperparams)``.

    The hyperparameters passed (not the factory's defaults, which optax stores too)
    live in ``state.hyperparams``: a number becomes a scalar array (replace it to change
    the value mid-training, e.g. from a validation loss); a schedule (``step ->
    value``) is evaluated at every step, its value stored there. They are float64
    scalars (the numbers passed, exactly); each block computes with them in its
    values' dtype. Each update calls
    ``inner_factory`` with the values of the step: ``learning_rate`` as a constant
    schedule (every fshard optimizer takes schedules there), the others as arrays (the
    building blocks take arrays; fshard's ``sgd``/``adam``/``adamw`` check their other
    hyperparameters as Python numbers, so inject only their ``learning_rate``).

    >>> import numpy as np, fshard as fs
    >>> opt = fs.optim.inject_hyperparams(fs.optim.adam)(
    ...     learning_rate=fs.optim.linear_schedule(0.1, 0.0, 10))
    >>> state = opt.init({"w": np.ones(2, np.float32)})
    >>> _, state = opt.update({"w": np.ones(2, np.float32)}, state)
    >>> round(float(state.hyperparams["learning_rate"].asnumpy()), 4)  # step 0's value
    0.1
    """
    if not callable(inner_factory):
        raise ArgumentError(f"fs.optim.inject_hyperparams(inner_factory): expected a "
                            f"function returning a transformation; got {inner_factory!r}.")

    def with_hyperparams(*args, **hyperparams) -> GradientTransformation:
        if args:
            raise ArgumentError(
                "fs.optim.inject_hyperparams(factory)(...) takes the hyperparameters by "
                "name.\nFix: e.g. inject_hyperparams(fs.optim.adam)(learning_rate=1e-3).")
        numeric = {k: v for k, v in hyperparams.items() if not callable(v)}
        schedules = {k: v for k, v in hyperparams.items() if callable(v)}
        for k, v in numeric.items():
            _value("inject_hyperparams", k, v)

        def values(count, stored, dtype):
            out = {k: _as_state(_as_array(v), dtype) for k, v in stored.items()}
            for k, s in schedules.items():
                out[k] = _schedule_value(s, count, dtype)
            return out

        def build(vals):
            return inner_factory(**{k: (lambda step, v=v: v) if k == "learning_rate" else v
                                    for k, v in vals.items()})

        # The values are kept in float64, the number passed exactly (init may not see
        # the parameters: init(None)); each block rounds them to its leaf's dtype.
        def init(params):
            count = _count0()
            vals = values(count, numeric, dtypes.float64)
            return InjectHyperparamsState(count, vals, build(vals).init(params))

        def update(updates, state, params=None):
            _check_state("inject_hyperparams", state, InjectHyperparamsState)
            vals = values(state.count, {k: state.hyperparams[k] for k in numeric},
                          dtypes.float64)
            new, inner_state = build(vals).update(updates, state.inner_state, params)
            return new, InjectHyperparamsState(state.count + 1, vals, inner_state)

        return GradientTransformation(init, update)

    return with_hyperparams


# -- schedules ---------------------------------------------------------------------------
#
# Each is a Schedule: schedule(step, dtype) computes in dtype (fs.optim's optimizers and
# the blocks above ask each leaf's), the Python numbers combined in Python.


def _steps(fn: str, name: str, value, low: int = 1) -> None:
    _number(fn, name, value, low=low, integer=True)


def constant_schedule(value) -> Schedule:
    """``step -> value`` (optax's ``constant_schedule``; also ``fs.optim.constant``).

    >>> import fshard as fs
    >>> float(fs.optim.constant_schedule(0.1)(7).asnumpy())
    0.10000000149011612
    """
    _number("constant_schedule", "value", value)
    value = float(value)
    return Schedule(lambda step, dtype: _scalar(value, dtype),
                    f"constant_schedule({value!r})")


def polynomial_schedule(init_value, end_value, power, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:
    """From ``init_value`` to ``end_value`` over ``transition_steps`` steps after
    ``transition_begin``: ``(init - end) * (1 - t / transition_steps)^power + end``
    (optax's ``polynomial_schedule``).

    >>> import fshard as fs
    >>> s = fs.optim.polynomial_schedule(1.0, 0.0, power=2, transition_steps=4)
    >>> [round(float(s(t).asnumpy()), 4) for t in (0, 2, 4)]
    [1.0, 0.25, 0.0]
    """
    for name, v in (("init_value", init_value), ("end_value", end_value), ("power", power)):
        _number("polynomial_schedule", name, v)
    _steps("polynomial_schedule", "transition_steps", transition_steps)
    _steps("polynomial_schedule", "transition_begin", transition_begin, low=0)
    init_value, end_value, power = float(init_value), float(end_value), float(power)

    def schedule(step, dtype):
        t = ops.sub(_float_step(step, dtype), float(transition_begin))
        t = ops.minimum(ops.maximum(t, 0.0), float(transition_steps))
        frac = ops.sub(1.0, ops.div(t, float(transition_steps)))
        return ops.add(ops.mul(ops.pow(frac, power), init_value - end_value), end_value)

    return Schedule(schedule, f"polynomial_schedule({init_value!r}, {end_value!r}, {power!r}, "
                              f"{transition_steps!r}, {transition_begin!r})")


def linear_schedule(init_value, end_value, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """Linearly from ``init_value`` to ``end_value`` over ``transition_steps`` steps
    after ``transition_begin`` (optax's ``linear_schedule``).

    >>> import fshard as fs
    >>> s = fs.optim.linear_schedule(1.0, 0.0, 4)
    >>> [round(float(s(t).asnumpy()), 4) for t in (0, 2, 4, 9)]
    [1.0, 0.5, 0.0, 0.0]
    """
    for name, v in (("init_value", init_value), ("end_value", end_value)):
        _number("linear_schedule", name, v)
    _steps("linear_schedule", "transition_steps", transition_steps)
    _steps("linear_schedule", "transition_begin", transition_begin, low=0)
    s = polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)
    return Schedule(s, f"linear_schedule({float(init_value)!r}, {float(end_value)!r}, "
                       f"{transition_steps!r}, {transition_begin!r})")


def cosine_decay_schedule(init_value, decay_steps: int, alpha=0.0, exponent=1.0) -> Schedule:
    """``init_value * ((1 - alpha) * ((1 + cos(pi * min(step, decay_steps) /
    decay_steps)) / 2)^exponent + alpha)`` (optax's ``cosine_decay_schedule``; also
    ``fs.optim.cosine_decay``).

    >>> import fshard as fs
    >>> s = fs.optim.cosine_decay_schedule(1.0, 10)
    >>> [round(float(s(t).asnumpy()), 4) for t in (0, 5, 10, 20)]
    [1.0, 0.5, 0.0, 0.0]
    """
    _number("cosine_decay_schedule", "init_value", init_value)
    _steps("cosine_decay_schedule", "decay_steps", decay_steps)
    _number("cosine_decay_schedule", "alpha", alpha)
    _number("cosine_decay_schedule", "exponent", exponent)
    init_value, alpha, exponent = float(init_value), float(alpha), float(exponent)

    def schedule(step, dtype):
        t = ops.minimum(_float_step(step, dtype), float(decay_steps))
        cosine = ops.mul(ops.add(ops.cos(ops.mul(t, math.pi / decay_steps)), 1.0), 0.5)
        decayed = ops.add(ops.mul(ops.pow(cosine, exponent), 1.0 - alpha), alpha)
        return ops.mul(decayed, init_value)

    return Schedule(schedule, f"cosine_decay_schedule({init_value!r}, {decay_steps!r}, "
                              f"alpha={alpha!r}, exponent={exponent!r})")


def join_schedules(schedules, boundaries) -> Schedule:
    """``schedules[0]`` until ``boundaries[0]``, then ``schedules[1]`` (counting from 0
    again at the boundary), ... (optax's ``join_schedules``). A schedule after a
    boundary is never asked for a step before it (it gets 0 there, its value unused).

    >>> import fshard as fs
    >>> s = fs.optim.join_schedules([fs.optim.constant_schedule(1.0),
    ...                              fs.optim.linear_schedule(1.0, 0.0, 2)], [3])
    >>> [round(float(s(t).asnumpy()), 4) for t in range(6)]
    [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    schedules, boundaries = list(schedules), list(boundaries)
    if len(schedules) != len(boundaries) + 1 or not all(callable(s) for s in schedules):
        raise ArgumentError(
            f"fs.optim.join_schedules: expected n + 1 schedules for n boundaries; got "
            f"{len(schedules)} schedules and {len(boundaries)} boundaries.")
    for b in boundaries:
        _steps("join_schedules", "boundaries", b, low=0)
    if boundaries != sorted(boundaries):
        raise ArgumentError(f"fs.optim.join_schedules: boundaries must increase; got "
                            f"{boundaries}.")

    def schedule(step, dtype):
        t = _float_step(step, dtype)
        out = _schedule_value(schedules[0], t, dtype)
        for b, s in zip(boundaries, schedules[1:]):
            later = ops.maximum(ops.sub(t, float(b)), 0.0)
            out = ops.where(ops.less(t, float(b)), out, _schedule_value(s, later, dtype))
        return out

    return Schedule(schedule, f"join_schedules({schedules!r}, {boundaries!r})")


def warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps: int, decay_steps: int,
                                 end_value=0.0, exponent=1.0) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then
    cosine decay to ``end_value`` at ``decay_steps`` (counted from step 0, warmup
    included; optax's ``warmup_cosine_decay_schedule``).

    >>> import fshard as fs
    >>> s = fs.optim.warmup_cosine_decay_schedule(0.0, 1.0, 2, 6)
    >>> [round(float(s(t).asnumpy()), 4) for t in (0, 1, 2, 4, 6)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    for name, v in (("init_value", init_value), ("peak_value", peak_value),
                    ("end_value", end_value)):
        _number("warmup_cosine_decay_schedule", name, v)
    _steps("warmup_cosine_decay_schedule", "warmup_steps", warmup_steps, low=0)
    _steps("warmup_cosine_decay_schedule", "decay_steps", decay_steps)
    if decay_steps <= warmup_steps:
        raise ArgumentError(
            f"fs.optim.warmup_cosine_decay_schedule: decay_steps ({decay_steps}) counts the "
            f"warmup too, so it must exceed warmup_steps ({warmup_steps}).")
    alpha = 0.0 if peak_value == 0 else end_value / peak_value
    decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)
    if warmup_steps == 0:
        return decay
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps), decay],
                          [warmup_steps])


def exponential_decay(init_value, transition_steps: int, decay_rate, transition_begin: int = 0,
                      staircase: bool = False, end_value=None) -> Schedule:
    """``init_value * decay_rate^((step - transition_begin) / transition_steps)``
    (the exponent floored with ``staircase``), ``init_value`` before
    ``transition_begin``, bounded by ``end_value`` (optax's ``exponential_decay``).

    >>> import fshard as fs
    >>> s = fs.optim.exponential_decay(1.0, 2, 0.5)
    >>> [round(float(s(t).asnumpy()), 4) for t in (0, 1, 2, 4)]
    [1.0, 0.7071, 0.5, 0.25]
    """
    _number("exponential_decay", "init_value", init_value)
    _steps("exponential_decay", "transition_steps", transition_steps)
    _number("exponential_decay", "decay_rate", decay_rate, low=0.0, low_open=True)
    _steps("exponential_decay", "transition_begin", transition_begin, low=0)
    if not isinstance(staircase, bool):
        raise ArgumentError(f"fs.optim.exponential_decay(staircase=...) must be a bool; got "
                            f"{staircase!r}.")
    if end_value is not None:
        _number("exponential_decay", "end_value", end_value)
    init_value, decay_rate = float(init_value), float(decay_rate)

    def schedule(step, dtype):
        t = ops.sub(_float_step(step, dtype), float(transition_begin))
        p = ops.div(t, float(transition_steps))
        if staircase:
            p = ops.floor(p)
        value = ops.where(ops.less_equal(t, 0.0), _scalar(init_value, dtype),
                          ops.mul(ops.pow(decay_rate, p), init_value))
        if end_value is not None:
            bound = ops.maximum if decay_rate < 1 else ops.minimum
            value = bound(value, float(end_value))
        return value

    return Schedule(schedule, f"exponential_decay({init_value!r}, {transition_steps!r}, "
                              f"{decay_rate!r}, {transition_begin!r}, {staircase!r}, "
                              f"{end_value!r})")


def piecewise_constant_schedule(init_value, boundaries_and_scales: dict | None = None
                                ) -> Schedule:
    """``init_value``, multiplied by ``scale`` from each ``boundary`` on (optax's
    ``piecewise_constant_schedule``: ``{boundary: scale}``).

    >>> import fshard as fs
    >>> s = fs.optim.piecewise_constant_schedule(1.0, {2: 0.1, 4: 0.5})
    >>> [round(float(s(t).asnumpy()), 4) for t in range(6)]
    [1.0, 1.0, 0.1, 0.1, 0.05, 0.05]
    """
    _number("piecewise_constant_schedule", "init_value", init_value)
    items = sorted((boundaries_and_scales or {}).items())
    for b, sc in items:
        _steps("piecewise_constant_schedule", "boundaries_and_scales", b, low=0)
        _number("piecewise_constant_schedule", "boundaries_and_scales", sc)
    init_value = float(init_value)

    def schedule(step, dtype):
        t = _float_step(step, dtype)
        value = _scalar(init_value, dtype)
        for b, sc in items:
            value = ops.where(ops.less(t, float(b)), value, ops.mul(value, float(sc)))
        return value

    return Schedule(schedule, f"piecewise_constant_schedule({init_value!r}, "
                              f"{dict(items)!r})")
