"""Mixed precision: policies that say which dtype parameters, computation and outputs
use, ``autocast`` that applies one to a function, and dynamic loss scaling as pure
functions over a small state (NB: jmp's ``Policy`` and ``DynamicLossScale``; MindSpore's
``auto_mixed_precision`` levels and ``DynamicLossScaler``).

Part of the training layer: built on the transforms (``autocast`` re-interprets the
traced Program of the function it wraps), never imported by the core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from fshard.core import dtypes, tree
from fshard import ops
from fshard.backend.mindspore import as_tensor
from fshard.core.tracing import typeof
from fshard.errors import ArgumentError
from fshard.core.interpret import bind_equation, walk
from fshard.core.ir import Program
from fshard.training.optim import Optimizer
from fshard.core.staging import check_function, trace_fun

__all__ = ["Policy", "policy", "autocast", "LEVELS", "LOW_PRECISION_OPS", "FLOAT32_OPS",
           "DynamicLossScale", "LossScaleState", "all_finite", "select_tree",
           "loss_scaled", "LossScaledState"]

LEVELS = ("O0", "O1", "O2", "O3")

# O1 runs these primitives in the compute dtype and everything else in float32
# (MindSpore's O1 white list: MatMul, BatchMatMul, Dense, Conv*, ReLU, PReLU).
LOW_PRECISION_OPS = frozenset({"matmul"})

# O2 runs everything in the compute dtype except these, which run in float32: the
# normalisations and the ops whose float16 results overflow or lose the loss
# (MindSpore's O2 black list holds only BatchNorm and LayerNorm: fshard traces LayerNorm
# as the reductions and rsqrt below, and training-mode BatchNorm as its fused kernels).
FLOAT32_OPS = frozenset({"softmax", "log_softmax", "reduce_sum", "exp", "log", "pow",
                         "rsqrt", "sqrt", "erf", "batch_norm_train", "batch_norm_tangent",
                         "batch_norm_grad"})

_LOW = (dtypes.float16, dtypes.bfloat16)


@dataclass(frozen=True)
class Policy:
    """Which dtype each kind of value uses (NB: jmp.Policy), and the MindSpore level
    that says which operations run in ``compute_dtype``.

    >>> import mindspore
    >>> p = policy("O2", mindspore.float16)
    >>> p.param_dtype, p.compute_dtype, p.output_dtype
    (mindspore.float32, mindspore.float16, mindspore.float32)

    Args:
        param_dtype: the dtype parameters are kept (and updated) in.
        compute_dtype: the low-precision dtype of the computation.
        output_dtype: the dtype the function's floating outputs are cast to.
        level: ``"O0"`` nothing in ``compute_dtype``; ``"O1"`` only
            ``LOW_PRECISION_OPS``; ``"O2"`` everything but ``FLOAT32_OPS``; ``"O3"``
            everything.

    See also: ``policy``, ``autocast``.
    """

    param_dtype: Any = dtypes.float32
    compute_dtype: Any = dtypes.float16
    output_dtype: Any = dtypes.float32
    level: str = "O2"

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            d = getattr(self, name)
            try:
                ok = dtypes.is_float(dtypes.canonical(d))
            except ArgumentError:
                ok = False
            if not ok:
                raise ArgumentError(
                    f"fs.amp.Policy({name}=...) must be a floating dtype (mindspore.float16, "
                    f"bfloat16, float32 or float64); got {d!r}.")
            object.__setattr__(self, name, dtypes.canonical(d))
        _check_level("fs.amp.Policy", self.level)

    def cast_to_param(self, x):
        """``x``'s floating leaves in ``param_dtype``."""
        return _cast_floats(x, self.param_dtype)

    def cast_to_compute(self, x):
        """``x``'s floating leaves in ``compute_dtype``."""
        return _cast_floats(x, self.compute_dtype)

    def cast_to_output(self, x):
        """``x``'s floating leaves in ``output_dtype``."""
        return _cast_floats(x, self.output_dtype)


def _check_level(where: str, level) -> None:
    if level not in LEVELS:
        raise ArgumentError(
            f"{where}(level=...) must be one of {', '.join(LEVELS)} (MindSpore's "
            f"auto_mixed_precision levels); got {level!r}.")


def policy(level: str = "O2", dtype=dtypes.float16) -> Policy:
    """The preset of a MindSpore ``auto_mixed_precision`` level: parameters and outputs
    in float32, ``dtype`` (float16 or bfloat16) where the level says.

    >>> import mindspore
    >>> policy("O1").level, policy("O0").compute_dtype
    ('O1', mindspore.float32)

    Raises:
        ArgumentError: an unknown level, or a ``dtype`` that is not float16/bfloat16.

    See also: ``Policy``, ``autocast``.
    """
    _check_level("fs.amp.policy", level)
    try:
        d = dtypes.canonical(dtype)
    except ArgumentError:
        d = None
    if d not in _LOW:
        raise ArgumentError(
            f"fs.amp.policy(dtype=...) must be mindspore.float16 or mindspore.bfloat16 "
            f"(the low-precision compute dtype); got {dtype!r}.\nFix: for float32 "
            "throughout use level='O0'.")
    return Policy(dtypes.float32, dtypes.float32 if level == "O0" else d, dtypes.float32,
                  level)


def _is_float_leaf(x) -> bool:
    try:
        return dtypes.is_float(typeof(x).dtype)
    except Exception:  # noqa: BLE001  not an array (a string, None, a Python object)
        return False


def _cast_floats(x, dtype):
    return tree.map(lambda a: ops.cast(a, dtype) if _is_float_leaf(a)
                    and not isinstance(a, (float, int)) else a, x)


def _higher_order(eq) -> bool:
    """An equation with a body (scan, cond, custom rules): its body was traced for its
    operands' types, so they get exactly those."""
    return any(isinstance(v, Program) or (isinstance(v, tuple) and any(
        isinstance(s, Program) for s in v)) for v in eq.params.values())


def _equation_dtype(p: Policy, eq):
    """The dtype ``eq``'s floating operands are cast to under ``p`` (None: as traced)."""
    name = eq.prim.name
    if p.level == "O0" or name == "cast" or _higher_order(eq):
        return None
    if p.level == "O1":
        return p.compute_dtype if name in LOW_PRECISION_OPS else None
    if p.level == "O2" and name in FLOAT32_OPS:
        return p.param_dtype
    return p.compute_dtype


def autocast(fn: Callable, policy: Policy | str = "O2") -> Callable:
    """``fn`` with ``policy`` applied: its operations run in the dtype the policy's level
    gives them and its floating outputs come back in ``policy.output_dtype``; its
    inputs (parameters in float32) are cast where they are used, so gradients with
    respect to them are float32 (NB: MindSpore's ``auto_mixed_precision(net, level)``,
    for a function instead of a Cell). Composes with ``fs.grad``, ``fs.jit``,
    ``fs.vmap`` and ``fs.shard``: the wrapper re-evaluates the traced ``fn`` with casts.

    >>> import numpy as np, mindspore, fshard as fs
    >>> f = fs.amp.autocast(lambda w, x: fs.ops.matmul(x, w).sum(), "O1")
    >>> fs.make_ir(f)(np.ones((3, 2), np.float32), np.ones((4, 3), np.float32))
    { lambda a:f32[3,2] b:f32[4,3] .
        c:f16[4,3] = cast[dtype=Float16] b
        d:f16[3,2] = cast[dtype=Float16] a
        e:f16[4,2] = matmul[transpose_a=False transpose_b=False] c d
        f:f32[4,2] = cast[dtype=Float32] e
        g:f32[] = reduce_sum[axes=(0, 1)] f
      in (g) }

    Args:
        fn: the function (a loss, a model's apply).
        policy: a ``Policy``, or a level (``"O0"``..``"O3"``) for ``policy(level)``
            with float16.

    Raises:
        ArgumentError: ``policy`` is neither a Policy nor a level.

    See also: ``policy``, ``DynamicLossScale``.
    """
    check_function("fs.amp.autocast", fn)
    if isinstance(policy, str):
        _check_level("fs.amp.autocast", policy)
        pol = globals()["policy"](policy)
    elif isinstance(policy, Policy):
        pol = policy
    else:
        raise ArgumentError(
            f"fs.amp.autocast(fn, policy=...) must be an fs.amp.Policy or a level "
            f"({', '.join(LEVELS)}); got {policy!r}.")

    def rule(casts, eq, values):
        dtype = _equation_dtype(pol, eq)
        vals = []
        for a, v in zip(eq.inputs, values, strict=True):
            if not dtypes.is_float(a.aval.dtype) or isinstance(v, (float, int)):
                vals.append(v)
            else:  # to the policy's dtype, or back to the traced one; once per value
                key = (id(v), dtype or a.aval.dtype)
                if key not in casts:
                    casts[key] = (v, ops.cast(v, key[1]))  # v kept alive: its id stays
                vals.append(casts[key][1])
        outs = bind_equation(eq, vals)
        if pol.level == "O1" and dtype is not None:  # O1: only the op is low precision
            outs = [ops.cast(o, a.aval.dtype) if dtypes.is_float(a.aval.dtype) else o
                    for a, o in zip(eq.outputs, outs, strict=True)]
        return outs

    def wrapped(*args, **kwargs):
        flat, in_tree = tree.flatten((args, kwargs))
        traced = trace_fun(fn, in_tree, [typeof(x) for x in flat])
        casts = {}
        outs = walk(traced.program, list(traced.consts) + flat,
                    lambda eq, values: rule(casts, eq, values), "autocasting")
        outs = [ops.cast(o, pol.output_dtype) if _is_float_leaf(o)
                and not isinstance(o, (float, int)) else o for o in outs]
        return tree.unflatten(traced.out_tree, outs)

    wrapped.__name__ = getattr(fn, "__name__", "fn")
    wrapped.__doc__ = getattr(fn, "__doc__", None)
    return wrapped


# -- loss scaling --------------------------------------------------------------------


class LossScaleState(NamedTuple):
    """The state of dynamic loss scaling (a pytree: carry it through ``fs.jit``)."""

    scale: Any        # float32 scalar: the factor the loss is multiplied by
    good_steps: Any   # int32 scalar: finite steps since the scale last changed
    skipped: Any      # int32 scalar: steps skipped because a gradient was not finite


def _number(fn: str, name: str, value, low: float, low_open: bool = False,
            integer: bool = False):
    ok = (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if low_open else value >= low)
          and (not integer or float(value).is_integer()))
    if not ok:
        bound = f"> {low}" if low_open else f">= {low}"
        kind = "an integer" if integer else "a finite number"
        raise ArgumentError(f"fs.amp.{fn}({name}=...) must be {kind} {bound}; got "
                            f"{value!r}.")


@dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling as pure functions (NB: jmp.DynamicLossScale; MindSpore's
    DynamicLossScaleManager): multiply the loss by ``scale`` before differentiating,
    divide the gradients by it, skip a step whose gradients are not finite and divide
    the scale by 2 (``backoff_factor``), multiply it by ``growth_factor`` after
    ``growth_interval`` finite steps in a row. No Python branches on values: it runs
    inside ``fs.jit`` and ``fs.shard``.

    >>> ls = DynamicLossScale(initial_scale=1024.0, growth_interval=2)
    >>> s = ls.init()
    >>> s = ls.adjust(s, all_finite([np.float32(np.inf)]))
    >>> float(s.scale.asnumpy()), int(s.skipped.asnumpy())
    (512.0, 1)

    See also: ``all_finite``, ``loss_scaled``.
    """

    initial_scale: float = 2.0 ** 15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0

    def __post_init__(self):
        _number("DynamicLossScale", "initial_scale", self.initial_scale, 0.0, low_open=True)
        _number("DynamicLossScale", "growth_factor", self.growth_factor, 1.0)
        _number("DynamicLossScale", "growth_interval", self.growth_interval, 1, integer=True)
        _number("DynamicLossScale", "min_scale", self.min_scale, 0.0, low_open=True)
        if not (isinstance(self.backoff_factor, (int, float)) and 0 < self.backoff_factor < 1):
            raise ArgumentError(
                "fs.amp.DynamicLossScale(backoff_factor=...) must be a number in (0, 1) "
                f"(the factor the scale is multiplied by on overflow); got "
                f"{self.backoff_factor!r}.")

    def init(self) -> LossScaleState:
        """The state before the first step."""
        return LossScaleState(as_tensor(np.float32(self.initial_scale)),
                              as_tensor(np.int32(0)), as_tensor(np.int32(0)))

    def scale(self, state: LossScaleState, loss):
        """``loss * scale``, in the loss's dtype (float32 under a policy's output)."""
        return ops.mul(loss, ops.cast(state.scale, typeof(loss).dtype))

    def unscale(self, state: LossScaleState, grads):
        """``grads / scale``, computed in float32, each leaf in its own dtype."""
        inv = ops.div(np.float32(1.0), state.scale)

        def one(g):
            if not _is_float_leaf(g):
                return g
            return ops.cast(ops.mul(ops.cast(g, dtypes.float32), inv), typeof(g).dtype)
        return tree.map(one, grads)

    def adjust(self, state: LossScaleState, finite) -> LossScaleState:
        """The state after a step whose gradients were ``finite`` (a bool scalar)."""
        finite = ops.cast(finite, dtypes.bool_)
        good = ops.add(state.good_steps, np.int32(1))
        grown = ops.mul(state.scale, np.float32(self.growth_factor))
        grow = ops.where(finite, ops.greater_equal(good, np.int32(self.growth_interval)),
                         False)
        # never grow into float32 overflow (MindSpore's DynamicLossScaler checks too)
        grow = ops.where(grow, ops.less(grown, np.float32(np.finfo(np.float32).max)), False)
        backed = ops.maximum(ops.mul(state.scale, np.float32(self.backoff_factor)),
                             np.float32(self.min_scale))
        scale = ops.where(finite, ops.where(grow, grown, state.scale), backed)
        good = ops.where(finite, ops.where(grow, np.int32(0), good), np.int32(0))
        skipped = ops.add(state.skipped, ops.cast(ops.where(finite, 0, 1), dtypes.int32))
        return LossScaleState(scale, ops.cast(good, dtypes.int32), skipped)


def all_finite(grads):
    """A bool scalar: whether every floating leaf of ``grads`` is finite (no inf, no
    NaN). NB: MindSpore's ``amp.all_finite``; ``x * 0`` is NaN exactly where ``x`` is
    not finite, and a sum with a NaN is NaN.

    >>> bool(all_finite({"w": np.ones(3, np.float32)}).asnumpy())
    True
    """
    total = np.float32(0.0)
    for g in tree.leaves(grads):
        if _is_float_leaf(g) and not isinstance(g, (float, int)):
            total = ops.add(total, ops.sum(ops.mul(ops.cast(g, dtypes.float32),
                                                   np.float32(0.0))))
    return as_tensor(np.bool_(True)) if isinstance(total, np.floating) else \
        ops.equal(total, np.float32(0.0))


def select_tree(pred, on_true, on_false):
    """``on_true`` where the bool scalar ``pred`` holds, else ``on_false``, leaf by
    leaf (the two trees have one structure)."""
    return tree.map(lambda a, b: ops.where(pred, a, b), on_true, on_false)


class LossScaledState(NamedTuple):
    """``loss_scaled``'s optimizer state: the loss scale's and the inner optimizer's."""

    loss_scale: LossScaleState
    inner: Any


def loss_scaled(optimizer, loss_scale: DynamicLossScale):
    """An optimizer that undoes loss scaling around ``optimizer``: its ``update``
    divides the gradients by the current scale, applies ``optimizer`` only when they
    are all finite (a skipped step leaves the parameters and ``optimizer``'s state as
    they were and is counted in ``state.loss_scale.skipped``) and adjusts the scale.
    For ``fs.AutoParallel``, whose loss function cannot read the optimizer state: pass
    ``state.opt_state.loss_scale.scale`` as a batch input and multiply the loss by it.

    See also: ``DynamicLossScale``; docs/amp.md.
    """
    if not isinstance(loss_scale, DynamicLossScale):
        raise ArgumentError(
            "fs.amp.loss_scaled(optimizer, loss_scale=...) must be an "
            f"fs.amp.DynamicLossScale; got {loss_scale!r}.")
    if not isinstance(optimizer, Optimizer):
        raise ArgumentError(
            "fs.amp.loss_scaled(optimizer=...) must be an fs.optim optimizer (fs.optim.sgd, "
            f"adam, chain, ...); got {optimizer!r}.")

    def init(params):
        return LossScaledState(loss_scale.init(), optimizer.init(params))

    def update(grads, state, params=None):
        grads = loss_scale.unscale(state.loss_scale, grads)
        finite = all_finite(grads)
        # a non-finite gradient must not reach the inner state (Adam's moments keep a NaN)
        safe = tree.map(lambda g: ops.where(finite, g, ops.zeros_like(g))
                        if _is_float_leaf(g) else g, grads)
        updates, inner = optimizer.update(safe, state.inner, params)
        updates = tree.map(lambda u: ops.where(finite, u, ops.zeros_like(u))
                           if _is_float_leaf(u) else u, updates)
        inner = select_tree(finite, inner, state.inner)
        return updates, LossScaledState(loss_scale.adjust(state.loss_scale, finite), inner)

    return Optimizer(init, update)
