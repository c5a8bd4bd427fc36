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

from fshard.core import context, dtypes, tree
from fshard import ops
from fshard.core.tracing import EvalTrace, current_trace, typeof
from fshard.errors import ArgumentError
from fshard.primitives.optimizers import adam_update, fusable as adam_fusable

# The dtype rules and the schedules are shared with optax's building blocks, which
# live below fs.optim's optimizers (fshard/training/optim_blocks.py).
from fshard.training.optim_blocks import (Schedule, _arrays, _as_array, _as_state, _count0,
                                 _hyper_dtype, _per_dtype, _state_dtype, _zeros_like,
                                 constant_schedule, cosine_decay_schedule, join_schedules,
                                 linear_schedule)

__all__ = ["Optimizer", "sgd", "adam", "adamw", "apply_updates", "chain",
           "clip_by_global_norm", "cosine_decay", "linear_warmup", "constant",
           "Schedule", "SgdState", "AdamState", "ClipState"]


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
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentError(f"fs.optim.{fn}({name}=...) must be a number; got {value!r}.")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # a Python int beyond the float range
        finite = False
    if not finite:
        # inf or nan would turn every parameter into inf or nan (or freeze training,
        # eps=inf) without an error: refused here, where the argument is known.
        raise ArgumentError(
            f"fs.optim.{fn}({name}=...) must be a finite number; got {value!r}.\nFix: pass "
            f"a finite {name}.")
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


def _check_mask(fn: str, mask) -> None:
    if mask is not None and not callable(mask) and not tree.leaves(mask):
        raise ArgumentError(
            f"fs.optim.{fn}(mask=...) must be None (MindSpore's rule), a pytree of bools "
            f"like the parameters (or a prefix of it), or a function params -> such a "
            f"pytree; got {mask!r}.")


def _same_structure(fn: str, what: str, a, b) -> None:
    ta, tb = tree.structure(a), tree.structure(b)
    if ta != tb:
        raise ArgumentError(
            f"fs.optim.{fn}: {what} do not have the structure of the parameters the state "
            f"was made for ({tb} expected, got {ta}).\nFix: pass gradients of the same "
            "pytree as the params given to init().")


# -- dtypes --------------------------------------------------------------------------
#
# A float32 or float64 leaf is updated in its own dtype, and so are the numbers the
# update is made of (the learning rate of a schedule, Adam's bias correction): a
# float64 parameter gets a float64 update computed from float64 hyperparameters.
# Every other leaf keeps its optimizer state and gets its update in float32, and
# apply_updates adds in float then casts back: a float16 leaf (in float16, Adam's
# eps = 1e-8 is 0 and a second moment of 1e-9 underflows, so a small or zero
# gradient gives inf or NaN), and integer or bool leaves, as optax updates them
# (the cast rounds towards zero, like NumPy's astype).


def _rate_fn(fn: str, schedule: Callable, count) -> Callable:
    """``dtype -> the learning rate of step count`` in that dtype (each computed once)."""
    return _per_dtype(lambda dtype: _evaluate(fn, schedule, count, dtype))


def _evaluate(fn: str, schedule: Callable, step, dtype):
    if isinstance(schedule, Schedule):
        return schedule(step, dtype)
    value = schedule(step)
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        # A schedule's own numbers can be checked when they are Python or NumPy values
        # (a traced one cannot be looked at).
        try:
            ok = math.isfinite(value) and value >= 0
        except OverflowError:
            ok = False
        if not ok:
            raise ArgumentError(
                f"fs.optim.{fn}(learning_rate=...): the schedule gave {value!r} for step "
                f"{_show_step(step)}; a learning rate must be a finite number >= 0.\nFix: "
                "correct the schedule.")
        return float(value)
    return ops.cast(_as_array(value), dtype)


def _show_step(step):
    try:
        return int(np.asarray(step.asnumpy() if hasattr(step, "asnumpy") else step))
    except Exception:  # noqa: BLE001  (a traced step has no value)
        return "t"


def _decay_mask(fn: str, mask, params) -> list:
    """Per leaf of ``params``: whether weight decay applies to it.

    Default (``mask=None``): MindSpore's rule for an optimizer given a Cell's
    parameters, ``'beta' not in name and 'gamma' not in name`` (a LayerNorm's or
    BatchNorm's scale and shift are not decayed), where a leaf's name is its key path
    joined by dots (``{'ln.gamma': ...}`` or ``{'ln': {'gamma': ...}}``: ``ln.gamma``).
    """
    paths, _, _ = tree.flatten_with_path(params)
    if mask is None:
        names = [".".join(str(k) for k in p) for p in paths]
        return ["beta" not in n and "gamma" not in n for n in names]
    given = mask(params) if callable(mask) else mask
    try:
        flags = tree.broadcast_prefix(given, params)
    except ValueError as e:
        raise ArgumentError(
            f"fs.optim.{fn}(mask=...) must have the structure of the parameters (or a "
            f"prefix of it), with a bool per leaf (True: decay it): {e}\nFix: e.g. "
            "mask=lambda params: {k: not k.endswith('bias') for k in params}.") from None
    for p, f in zip(paths, flags):
        if not isinstance(f, (bool, np.bool_)):
            raise ArgumentError(
                f"fs.optim.{fn}(mask=...) must hold a bool per parameter (True: decay "
                f"it); got {f!r} for {tree.keystr(p)}.\nFix: use True or False.")
    return [bool(f) for f in flags]


def _masked(flags: list, f, *trees):
    """``tree.map(f, *trees)`` on the leaves whose flag is set; the others as they are."""
    leaves = [tree.leaves(t) for t in trees]
    out = [f(*xs) if flag else xs[0] for flag, *xs in zip(flags, *leaves)]
    return tree.unflatten(tree.structure(trees[0]), out)


# -- schedules -----------------------------------------------------------------------
#
# One implementation per schedule (fshard/training/optim_blocks.py); fs.optim's older names are
# the same functions.

constant = constant_schedule
cosine_decay = cosine_decay_schedule


def linear_warmup(init_value: float, peak_value: float, warmup_steps: int,
                  after: Callable | None = None) -> Schedule:
    """From ``init_value`` to ``peak_value`` linearly over ``warmup_steps``, then
    ``after(step - warmup_steps)`` (default: ``peak_value``; e.g.
    ``cosine_decay(peak_value, ...)``): ``join_schedules([linear_schedule(init_value,
    peak_value, warmup_steps), after], [warmup_steps])``, optax's
    ``warmup_cosine_decay_schedule`` with a cosine ``after``.

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
    init_value, peak_value = float(init_value), float(peak_value)
    rest = constant_schedule(peak_value) if after is None else after
    joined = join_schedules([linear_schedule(init_value, peak_value, warmup_steps), rest],
                            [warmup_steps])
    return Schedule(joined, f"linear_warmup({init_value!r}, {peak_value!r}, "
                            f"{warmup_steps!r}, after={after!r})")




# -- optimizers ----------------------------------------------------------------------
#
# The arithmetic goes through fshard.ops, never Python operators on Tensors: outside a
# trace those are MindSpore's, which round a Python float to float32 first
# (0.9 * a float64 Tensor is 0.899999976...).


def sgd(learning_rate, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, mask=None) -> Optimizer:
    """MindSpore's ``nn.SGD`` (dampening 0): ``g += weight_decay * p``; with momentum
    ``v = momentum * v + g`` and the step ``v`` (``g + momentum * v`` with
    ``nesterov``); ``p -= lr * step``.

    ``mask`` says which parameters are decayed: by default every one whose name
    (key path joined by dots) contains neither ``beta`` nor ``gamma``, MindSpore's rule
    (a LayerNorm's scale and shift are not decayed); or a pytree of bools like the
    params (a prefix of it), or a function ``params -> such a pytree`` (optax's).

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
    _check_mask("sgd", mask)

    def init(params):
        mom = tree.map(_zeros_like, params) if momentum else ()
        return SgdState(_count0(), mom)

    def update(grads, state, params=None):
        _check_state("sgd", state, SgdState)
        grads, params = _arrays(grads), _arrays(params)
        # integer gradients are worked with in float32 (their updates stay float)
        grads = tree.map(lambda g: _as_state(g, _state_dtype(typeof(g).dtype)), grads)
        if weight_decay:
            _needs_params("sgd", "weight_decay", params)
            _same_structure("sgd", "the parameters", params, grads)
            grads = _masked(_decay_mask("sgd", mask, params),
                            lambda g, p: ops.add(g, ops.mul(_as_state(p, typeof(g).dtype),
                                                            weight_decay)), grads, params)
        rate = _rate_fn("sgd", lr, state.count)
        mom = state.momentum
        if not momentum:
            return tree.map(lambda s: _scaled(s, rate), grads), SgdState(state.count + 1, mom)
        _same_structure("sgd", "the gradients", grads, mom)

        def leaf(v, g):
            v = ops.add(ops.mul(v, momentum), g)
            return v, _scaled(ops.add(g, ops.mul(v, momentum)) if nesterov else v, rate)

        mom, updates = _fused_map(leaf, mom, grads)
        return updates, SgdState(state.count + 1, mom)

    return Optimizer(init, update)


# Inside a traced step, leaves of at most this many elements are updated together.
_FUSE_MAX = 1 << 16


def _fused_map(fn, *trees) -> tuple:
    """``fn`` applied leaf by leaf to ``trees`` (of one structure); ``fn`` is
    elementwise and returns a tuple of leaves, and the result is a tuple of trees.

    Inside a traced step (``fs.jit``, ``fs.grad``), the small leaves of one dtype go
    through ``fn`` together: flattened and concatenated, then split back (NB:
    PyTorch's multi-tensor apply). Every element sees the same operations, so the
    numbers are the same, and a compiled step runs a few kernels for all of them
    instead of several per leaf (MindSpore's per-kernel cost on CPU, tens of
    microseconds, is most of an optimizer update of small tensors). Large leaves, whose
    copies would cost more than their kernels, and everything under ``fs.shard``
    (whose layouts a concatenation would mix) go leaf by leaf, except an
    ``fs.AutoParallel`` update whose parameters and state are all whole on every device
    (``context.whole_updates``): one layout, nothing to mix. A pipeline splitting the
    update by stage traces it leaf by leaf (``context.split_updates``)."""
    flat = [tree.leaves(t) for t in trees]
    treedef = tree.structure(trees[0])
    n = len(flat[0])
    results: list = [None] * n
    groups: dict = {}
    if type(current_trace()) is not EvalTrace and not context.split_updates.get() and (
            not context.shard_depth.get() or context.whole_updates.get()):
        for i in range(n):
            avals = [typeof(leaves[i]) for leaves in flat]
            if 0 < math.prod(avals[0].shape) <= _FUSE_MAX and all(
                    a.shape == avals[0].shape for a in avals):
                groups.setdefault(tuple(a.dtype for a in avals), []).append(i)
    for idx in groups.values():
        if len(idx) < 2:
            continue
        sizes = [math.prod(typeof(flat[0][i]).shape) for i in idx]
        outs = fn(*(ops.concat([ops.reshape(leaves[i], (-1,)) for i in idx])
                    for leaves in flat))
        pieces = [ops.split(o, sizes) for o in outs]
        for k, i in enumerate(idx):
            shape = typeof(flat[0][i]).shape
            results[i] = tuple(ops.reshape(p[k], shape) for p in pieces)
    for i in range(n):
        if results[i] is None:
            results[i] = tuple(fn(*(leaves[i] for leaves in flat)))
    n_out = len(results[0]) if n else 0
    return tuple(tree.unflatten(treedef, [r[j] for r in results]) for j in range(n_out))


def _adam_map(leaf, rate, mu, nu, grads, b1, b2, eps, per_leaf: bool = False) -> tuple:
    """Adam's moments and updates, ``(mu, nu, updates)``: the float32 leaves on
    MindSpore's fused kernel, as ``nn.Adam`` (``adam_update``, which returns ``-rate m' /
    (sqrt(v') + eps)`` at the rate ``rate(float32)``); the other leaves by ``leaf(m, v,
    g) -> (m, v, update)``. The kernel's one pass and the copies of the moments into and
    out of its buffers replace eleven elementwise kernels (measured: a step over four
    leaves of 65K-1M floats ran in 10.6-11.8 ms so, in 20-22 ms elementwise).
    ``per_leaf``: one ``adam_update`` equation per leaf (each its own layout, and its
    own pipeline stage), not one for all (the program runs one kernel per leaf either
    way)."""
    flat = [tree.leaves(t) for t in (mu, nu, grads)]
    n = len(flat[0])
    on_kernel = [i for i in range(n) if typeof(flat[0][i]).dtype == dtypes.float32
                 and adam_fusable(typeof(flat[0][i]))
                 and math.prod(typeof(flat[0][i]).shape) > 0]
    results: list = [None] * n
    lr = rate(dtypes.float32) if on_kernel else None
    if lr is not None and typeof(lr).shape == () and typeof(lr).dtype == dtypes.float32:
        for group in [[i] for i in on_kernel] if per_leaf else [on_kernel]:
            outs = adam_update(*([leaves[i] for i in group] for leaves in flat), lr,
                               b1=b1, b2=b2, eps=eps)
            for k, i in enumerate(group):
                results[i] = tuple(o[k] for o in outs)
    for i in range(n):
        if results[i] is None:
            results[i] = tuple(leaf(*(leaves[i] for leaves in flat)))
    treedef = tree.structure(mu)
    return tuple(tree.unflatten(treedef, [r[j] for r in results]) for j in range(3))


def _scaled(s, rate):
    """``-rate * s`` in ``s``'s dtype, the rate computed in the matching dtype.

    The scalar rate is negated, not the product: the same bits (rounding is symmetric
    in sign) for one kernel less over every element."""
    d = typeof(s).dtype
    return _as_state(ops.mul(s, ops.neg(rate(_hyper_dtype(d)))), d)


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
    return _adam("adam", lr, b1, b2, eps, weight_decay=0.0, bias_correction=True, mask=None)


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-2, mask=None) -> Optimizer:
    """MindSpore's ``nn.AdamWeightDecay``: the moments of ``adam``, no bias correction,
    ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)`` (decoupled weight decay).

    ``mask`` says which parameters are decayed, as for ``sgd``: by default those whose
    name contains neither ``beta`` nor ``gamma`` (MindSpore's rule).

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
    _check_mask("adamw", mask)
    return _adam("adamw", lr, b1, b2, eps, weight_decay=weight_decay, bias_correction=False,
                 mask=mask)


def _check_betas(fn, b1, b2, eps) -> None:
    _check_number(fn, "b1", b1, low=0.0, high=1.0, high_open=True)
    _check_number(fn, "b2", b2, low=0.0, high=1.0, high_open=True)
    _check_number(fn, "eps", eps, low=0.0, low_open=True)


def _adam(fn, lr, b1, b2, eps, weight_decay, bias_correction, mask) -> Optimizer:
    def init(params):
        return AdamState(_count0(), tree.map(_zeros_like, params),
                         tree.map(_zeros_like, params))

    def update(grads, state, params=None):
        _check_state(fn, state, AdamState)
        grads, params = _arrays(grads), _arrays(params)
        _same_structure(fn, "the gradients", grads, state.mu)
        if weight_decay:
            _needs_params(fn, "weight_decay", params)
            _same_structure(fn, "the parameters", params, grads)
        grads = tree.map(lambda g, m: _as_state(g, typeof(m).dtype), grads, state.mu)
        count = state.count + 1
        lr_at = _rate_fn(fn, lr, state.count)
        cache: dict = {}

        def rate(dtype):  # the learning rate times the bias correction, once per dtype
            if dtype not in cache:
                r = lr_at(dtype)
                if bias_correction:
                    t = ops.cast(count, dtype)
                    r = ops.mul(ops.div(ops.sqrt(ops.sub(1.0, ops.pow(b2, t))),
                                        ops.sub(1.0, ops.pow(b1, t))), r)
                cache[dtype] = r
            return cache[dtype]

        def leaf(m, v, g):
            m = ops.add(ops.mul(m, b1), ops.mul(g, 1.0 - b1))
            v = ops.add(ops.mul(v, b2), ops.mul(ops.mul(g, g), 1.0 - b2))
            d = ops.div(m, ops.add(ops.sqrt(v), eps))
            return m, v, (d if weight_decay else _scaled(d, rate))

        planned = context.plan_updates.get()
        if not bias_correction or (context.shard_depth.get() and not planned) or (
                context.split_updates.get() and not planned):
            # adamw stays elementwise: nn.AdamWeightDecay rounds its moments without the
            # fused multiply-add of the Adam kernel (within 2e-5 of it over 5 steps; 8e-5
            # with the kernel). So does an update traced inside a user's fs.shard, whose
            # leaves may be laid out each its own way by a strategy fshard did not pick.
            mu, nu, updates = _fused_map(leaf, state.mu, state.nu, grads)
        else:
            # fs.AutoParallel's updates (every plan, pipeline and job) take the kernel
            # too, one equation per leaf: the kernel rounds an element alike wherever it
            # sits in a padded buffer (checked: a leaf whole and cut into 2, 3 or 8
            # blocks gives the same bits), so every plan still rounds as one device.
            mu, nu, updates = _adam_map(leaf, rate, state.mu, state.nu, grads, b1, b2, eps,
                                        per_leaf=planned)
        if weight_decay:
            updates = _masked(_decay_mask(fn, mask, params),
                              lambda d, p: ops.add(d, ops.mul(_as_state(p, typeof(d).dtype),
                                                              weight_decay)),
                              updates, params)
            updates = tree.map(lambda d: _scaled(d, rate), updates)
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
    Chain it before an optimizer: ``chain(clip_by_global_norm(1.0), adam(1e-3))``.

    The norm is computed in float64 when a leaf is float64 (else float32), scaled by
    the largest magnitude first, so it neither overflows nor underflows where the
    gradients themselves do not (``[3e19, 4e19]`` clips to ``[0.6, 0.8]`` in float32
    too). A NaN or infinite gradient makes the scaled gradients NaN (optax's and
    PyTorch's behaviour): the step is visibly broken rather than silently skipped.

    >>> import numpy as np, fshard as fs
    >>> u, _ = fs.optim.clip_by_global_norm(1.0).update({"g": np.array([3e19, 4e19])}, ())
    >>> [round(v, 12) for v in u["g"].asnumpy().tolist()]
    [0.6, 0.8]
    """
    _check_number("clip_by_global_norm", "max_norm", max_norm, low=0.0, low_open=True)
    max_norm = float(max_norm)

    def init(params):
        return ClipState()

    def update(grads, state, params=None):
        grads = _arrays(grads)
        leaves = tree.leaves(grads)
        # empty leaves add nothing (and MindSpore's ReduceMax refuses them)
        counted = [g for g in leaves if 0 not in tuple(typeof(g).shape)]
        if not counted:
            return grads, state
        ct = _hyper_dtype(dtypes.result_type(*[_state_dtype(typeof(g).dtype)
                                               for g in counted]))
        wide = [_as_state(g, ct) for g in counted]
        biggest = None
        for g in wide:
            m = ops.reduce_max(ops.abs(g))
            biggest = m if biggest is None else ops.maximum(biggest, m)
        # norm = biggest * r with r = ||g / biggest|| in [1, sqrt(n)]: nothing squared
        # overflows or underflows. An infinite biggest divides by 1 (r is inf or NaN).
        usable = ops.where(ops.less(biggest, float("inf")), biggest, 1.0)
        usable = ops.where(ops.greater(usable, 0.0), usable, 1.0)
        sq = None
        for g in wide:
            s = ops.reduce_sum(ops.square(ops.div(g, usable)))
            sq = s if sq is None else ops.add(sq, s)
        r = ops.sqrt(sq)
        # kept iff norm <= max_norm, i.e. r <= max_norm / usable (False for a NaN r)
        keep = ops.less_equal(r, ops.div(max_norm, usable))
        # clipped: (g / usable) * (max_norm / r), never forming the norm itself
        den = ops.where(keep, 1.0, usable)
        fac = ops.where(keep, 1.0, ops.div(max_norm, r))

        def clip(g):
            if 0 in tuple(typeof(g).shape):
                return g
            return _as_state(ops.mul(ops.div(_as_state(g, ct), den), fac), typeof(g).dtype)

        return tree.map(clip, grads), state

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
    """``params + updates``, leaf by leaf, cast to each parameter's dtype (optax's): an
    integer parameter adds its float update in float, then rounds towards zero
    (``5 + -0.3`` gives 4)."""
    _same_structure("apply_updates", "the updates", updates, params)
    params, updates = _arrays(params), _arrays(updates)
    return tree.map(lambda p, u: _as_state(ops.add(p, u), typeof(p).dtype), params, updates)


# optax's building blocks and schedules, by optax's names (fshard/training/optim_blocks.py)
from fshard.training.optim_blocks import *  # noqa: E402,F401,F403
from fshard.training.optim_blocks import __all__ as _blocks_all  # noqa: E402

__all__ += _blocks_all

# gradient accumulation (optax's MultiSteps: fshard/training/optim_accumulate.py)
from fshard.training.optim_accumulate import MultiSteps, MultiStepsState, multi_steps  # noqa: E402,F401
__all__ += ["MultiSteps", "MultiStepsState", "multi_steps"]
