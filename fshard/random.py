"""Counter-based random numbers: keys are values, draws are pure functions of them.

A key is a ``uint32[2]`` array. Every draw hashes the key with a counter (the flat
index of each element) through Threefry-2x32 (20 rounds), built from fshard's bitwise
primitives, so the numbers depend only on the key and the shape: the same eagerly,
under ``jit``, in each ``vmap`` lane (each lane's key gives that lane's numbers) and
under ``shard`` (each device computes its block's counters). The bits are those of
``jax.random`` (threefry, partitionable): ``fs.random.bits(fs.random.key(s), shape)``
equals ``jax.random.bits(jax.random.key(s), shape)``, and ``split``, ``fold_in`` and
``uniform`` follow.

>>> import fshard as fs
>>> key = fs.random.key(0)
>>> key, sub = fs.random.split(key)
>>> fs.random.uniform(sub, (2,)).shape
(2,)

Draw a new subkey for every use: the same key always gives the same numbers.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from contextvars import ContextVar
from typing import Any

import mindspore
import numpy as np

from fshard.core import context, dtypes
from fshard import ops
from fshard.core.array_types import Array, Bool, Float, Int, Key, Shaped, UInt, UInt32
from fshard.core.tracing import Tracer, is_symbolic, typeof
from fshard.errors import ArgumentError, KeyReuseWarning
from fshard.primitives.elementwise import broadcast_shapes

__all__ = ["key", "PRNGKey", "split", "fold_in", "bits", "uniform", "normal",
           "truncated_normal", "bernoulli", "randint", "gumbel", "categorical",
           "permutation"]

_U32 = dtypes.uint32
_MASK = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_FLOATS = {dtypes.float16: 10, dtypes.float32: 23, dtypes.float64: 52}  # mantissa bits
_MAX_PERMUTATION = 1 << 14


# ---------------------------------------------------------------------------
# Threefry-2x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011)
# ---------------------------------------------------------------------------


def _rotl(v, d: int):
    return ops.bitwise_or(ops.shift_left(v, d), ops.shift_right(v, 32 - d))


def _threefry2x32(k0, k1, x0, x1):
    """Hash counters ``(x0, x1)`` (uint32 arrays) under key ``(k0, k1)`` (uint32)."""
    ks = (k0, k1, ops.bitwise_xor(ops.bitwise_xor(k0, k1), 0x1BD11BDA))
    x0 = ops.add(x0, ks[0])
    x1 = ops.add(x1, ks[1])
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = ops.add(x0, x1)
            x1 = ops.bitwise_xor(x0, _rotl(x1, r))
        x0 = ops.add(x0, ks[(i + 1) % 3])
        x1 = ops.add(ops.add(x1, ks[(i + 2) % 3]), i + 1)
    return x0, x1


def _counters(shape: tuple[int, ...]):
    """The (high, low) 32-bit halves of each element's row-major flat index."""
    n = math.prod(shape)
    if n >= 1 << 32:
        raise ArgumentError(
            f"fs.random: a draw of shape {shape} has {n} elements; at most 2**32 - 1 are "
            "supported.\nFix: draw in pieces with keys from fs.random.split.")
    return np.arange(n, dtype=np.uint32).reshape(shape)


def _hash(k, shape: tuple[int, ...]):
    k0, k1 = ops.getitem(k, 0), ops.getitem(k, 1)
    lo = _counters(shape)
    hi = ops.broadcast_to(ops.cast(0, _U32), shape)
    return _threefry2x32(k0, k1, hi, lo)


# ---------------------------------------------------------------------------
# Reused keys: a hint where it can be seen
# ---------------------------------------------------------------------------
# Inside one traced function a key is a tracer: the trace records which tracers a draw
# or a split consumed, and a second consumption of the same key is a KeyReuseWarning.
# Concrete keys (eager code, keys closed over) are not tracked: drawing twice from one
# key on purpose (to reproduce numbers) is common there. fold_in does not consume: a
# family of keys fold_in(key, i) from one key is the usual idiom.


class _KeyUses:
    """The keys consumed in one trace (kept on the trace object, so it goes with it)."""

    def __init__(self):
        self.seen: dict[int, tuple[Any, str]] = {}  # id -> (key tracer, what used it)


#: True while a draw runs: the draws it makes itself (normal's uniform) are part of it.
_drawing: ContextVar[bool] = ContextVar("fshard_random_drawing", default=False)


def _uses(trace) -> _KeyUses:
    uses = getattr(trace, "_fshard_key_uses", None)
    if uses is None:
        uses = trace._fshard_key_uses = _KeyUses()
    return uses


def _record(key, name: str, stacklevel: int) -> None:
    """Record that ``name`` consumed the key tracer ``key``; warn if it was before."""
    uses = _uses(key.owner)
    before = uses.seen.get(id(key))
    if before is not None:
        warnings.warn(KeyReuseWarning(
            f"{name}: this key was already consumed by {before[1]} in the same "
            f"traced function ({typeof(key)} key); both see the same random bits, "
            "so their numbers are equal or correlated.\nFix: split it and give "
            "each use its own key: key, sub = fs.random.split(key).\nSee "
            "docs/errors.md#keyreusewarning"), stacklevel=stacklevel + 1)
    else:
        uses.seen[id(key)] = (key, name)


class _LoopBody:
    """A loop body being staged: its trace and the values that change between
    iterations (its inputs, and everything computed from them so far)."""

    def __init__(self, api: str, inputs, outer):
        self.api = api
        self.outer = outer  # the trace the loop itself is called in
        self.trace = inputs[0].owner if inputs else None
        self.varying = {id(x.ir_var) for x in inputs if hasattr(x, "ir_var")}
        self.seen = 0  # equations of the trace already propagated

    def varies(self, x) -> bool | None:
        """Whether ``x`` changes between iterations: False for a constant or a value of
        the trace around the loop (closed over), None when it cannot be told (a value
        of a trace staged inside the body, e.g. a branch's operand)."""
        if not isinstance(x, Tracer) or x.owner is self.outer:
            return False
        if x.owner is not self.trace:
            return None
        equations = self.trace.equations
        for eq in equations[self.seen:]:
            if any(id(a) in self.varying for a in eq.inputs):
                self.varying.update(id(o) for o in eq.outputs)
        self.seen = len(equations)
        return id(x.ir_var) in self.varying


@contextlib.contextmanager
def loop_body(api: str, inputs, outer):
    """Inside the block, the body of the loop ``api`` (called in the trace ``outer``) is
    staged with ``inputs`` (its tracers, which change between iterations); a draw there
    from a key that does not depend on them is a KeyReuseWarning: every iteration
    would see the same numbers."""
    with context.pushed(context.loop_bodies, _LoopBody(api, list(inputs), outer)):
        yield


class _UnrolledLoop:
    """A loop unrolled in Python (``fori_loop`` with static bounds): each iteration runs
    in the enclosing trace, so a concrete key drawn from in two iterations is seen by
    its value (a traced one by the usual check of a key consumed twice)."""

    def __init__(self, api: str):
        self.api = api
        self.iteration = None
        self.seen: dict[bytes, object] = {}  # key data -> the iteration that drew


@contextlib.contextmanager
def unrolled_loop(api: str):
    """Inside the block, the iterations of ``api`` run one after another; set
    ``.iteration`` on the object it yields before each."""
    loop = _UnrolledLoop(api)
    with context.pushed(context.loop_bodies, loop):
        yield loop


def _check_loop_key(key, name: str, stacklevel: int) -> None:
    body = context.innermost(context.loop_bodies)
    if isinstance(body, _UnrolledLoop):
        if isinstance(key, Tracer):
            return
        try:
            data = np.asarray(key.asnumpy() if hasattr(key, "asnumpy") else key).tobytes()
        except Exception:  # noqa: BLE001  (not a key: the draw reports it)
            return
        first = body.seen.setdefault(data, body.iteration)
        if first == body.iteration:
            return
    elif body is None or body.trace is None or body.varies(key) is not False:
        return
    warnings.warn(KeyReuseWarning(
        f"{name} inside the body of {body.api}: its key is the same in every iteration "
        "(a key from outside the loop, or computed from one), so every iteration draws "
        "the same numbers.\nFix: carry the key through the loop and split it in each "
        "iteration (key, sub = fs.random.split(key)), or fold in the loop index: "
        "fs.random.fold_in(key, i).\nSee docs/errors.md#keyreusewarning"),
        stacklevel=stacklevel + 1)


def consumed_by(x) -> str | None:
    """What consumed the key tracer ``x`` in its own trace (None: nothing, or ``x`` is
    not a tracer). A staged body (a branch of ``fs.cond``) reports its operands' uses
    with it, and its caller records them on the keys it passed (``mark_consumed``)."""
    if not isinstance(x, Tracer):
        return None
    hit = _uses(x.owner).seen.get(id(x))
    return None if hit is None else hit[1]


def mark_consumed(x, name: str) -> None:
    """Record that ``name`` consumed the key tracer ``x`` (inside a staged body that
    received it); warn if it was consumed before."""
    if isinstance(x, Tracer):
        _record(x, name, stacklevel=3)


def _consumes(fn):
    """Record that ``fn`` consumes its key; warn when the key was consumed before."""
    name = f"fs.{fn.__module__.split('.', 1)[1]}.{fn.__name__}"  # fs.random.normal

    @functools.wraps(fn)
    def draw(key, *args, **kwargs):
        if _drawing.get():  # a draw made by another draw is part of it
            return fn(key, *args, **kwargs)
        with context.setting(_drawing, True):
            if context.loop_bodies.get():
                _check_loop_key(key, name, stacklevel=2)
            if isinstance(key, Tracer):
                _record(key, name, stacklevel=2)
            return fn(key, *args, **kwargs)

    return draw


# ---------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------


def _is_int_value(x) -> bool:
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (int, np.integer)):
        return True
    try:
        a = typeof(x)
    except Exception:  # noqa: BLE001  (not an array: the caller reports it)
        return False
    return a.ndim == 0 and dtypes.is_int(a.dtype)


def key(seed) -> Key:
    """A key from an integer seed (Python int, or an integer scalar, traced or not).

    Equal to ``jax.random.key(seed)``'s data (``jax.random.PRNGKey(seed)``) in JAX's
    default mode (64-bit values disabled): ``[0, seed mod 2**32]`` for every integer seed,
    negative and wider than 32 bits included (``key(-1)`` is ``[0, 4294967295]``,
    ``key(2**40 + 5)`` is ``[0, 5]``).

    >>> import fshard as fs
    >>> fs.random.key(42).asnumpy().tolist()
    [0, 42]
    """
    if not _is_int_value(seed):
        raise ArgumentError(
            f"fs.random.key(seed): seed must be an integer (a Python int or an integer "
            f"scalar), got {type(seed).__name__} {seed!r}.\nFix: pass e.g. "
            "fs.random.key(0).")
    if isinstance(seed, (int, np.integer)):
        seed = int(seed)
        if not -(1 << 63) <= seed < (1 << 63):
            raise ArgumentError(
                f"fs.random.key(seed): seed must fit in int64, got {seed}.")
        # JAX without x64 keeps the seed's low 32 bits (it converts the seed to int32).
        return mindspore.Tensor(np.array([0, seed & _MASK], np.uint32))
    return ops.stack([ops.cast(0, _U32), ops.cast(seed, _U32)])


PRNGKey = key


def _check_key(k, fn: str):
    try:
        a = typeof(k)
    except Exception:  # noqa: BLE001
        a = None
    if a is None or a.shape != (2,) or a.dtype != _U32:
        got = f"{type(k).__name__}" if a is None else str(a)
        hint = ("\nFix: draw in each lane with fs.vmap, e.g. fs.vmap(lambda k: "
                f"fs.random.{fn}(k, shape))(keys)." if a is not None and a.ndim == 2
                and a.shape[-1:] == (2,) else
                "\nFix: make one with fs.random.key(seed) and new ones with "
                "fs.random.split(key).")
        raise ArgumentError(
            f"fs.random.{fn}(key, ...): key must be one key, a u32[2] array, got {got}."
            + hint)
    return k


def _check_shape(shape, fn: str) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        shape = tuple(shape)
    except TypeError:
        shape = None
    if shape is not None:
        refuse_symbolic(shape, f"fs.random.{fn}(..., shape): shape")
    if shape is None or not all(isinstance(d, (int, np.integer)) and not isinstance(
            d, (bool, np.bool_)) and d >= 0 for d in shape):
        raise ArgumentError(
            f"fs.random.{fn}(..., shape): shape must be a tuple of non-negative ints, "
            f"got {shape!r}.")
    return tuple(int(d) for d in shape)


def refuse_symbolic(shape, what: str) -> None:
    """An error naming ``what`` if ``shape`` holds a symbolic dimension."""
    if any(is_symbolic(d) for d in shape):
        raise ArgumentError(
            f"{what} ({', '.join(str(d) for d in shape)}) has a "
            "symbolic dimension (an fs.Symbol of in_shapes / set_inputs); random bits are "
            "drawn for static shapes only (each element's counter is its flat index).\n"
            "Fix: draw the numbers outside the function and pass them in as an argument "
            "declared with the same Symbol, or call this function with static shapes "
            "(no Symbol for this input).")


@_consumes
def split(key: Key, num: int = 2) -> UInt32[Array, "num 2"]:
    """``num`` new keys, a ``u32[num, 2]`` array; equal to ``jax.random.split``.

    >>> import fshard as fs
    >>> key, sub = fs.random.split(fs.random.key(0))
    >>> fs.random.split(fs.random.key(0), 3).shape
    (3, 2)
    """
    _check_key(key, "split")
    if not isinstance(num, (int, np.integer)) or isinstance(num, bool) or num < 0:
        raise ArgumentError(
            f"fs.random.split(key, num): num must be a non-negative int, got {num!r}.")
    x0, x1 = _hash(key, (int(num),))
    return ops.stack([x0, x1], axis=1)


def fold_in(key: Key, data) -> Key:
    """A new key from ``key`` and an integer ``data`` (e.g. a step or a rank);
    equal to ``jax.random.fold_in``.

    >>> import fshard as fs
    >>> fs.random.fold_in(fs.random.key(0), 3).asnumpy().tolist()
    [2467461003, 3840466878]
    """
    _check_key(key, "fold_in")
    if not _is_int_value(data):
        raise ArgumentError(
            f"fs.random.fold_in(key, data): data must be an integer, got "
            f"{type(data).__name__} {data!r}.")
    if isinstance(data, (int, np.integer)):
        data = np.uint32(int(data) & _MASK)
    k0, k1 = ops.getitem(key, 0), ops.getitem(key, 1)
    x0, x1 = _threefry2x32(k0, k1, ops.cast(0, _U32), ops.cast(data, _U32))
    return ops.stack([x0, x1])


# ---------------------------------------------------------------------------
# Draws
# ---------------------------------------------------------------------------


@_consumes
def bits(key: Key, shape=(), dtype=_U32) -> UInt[Array, "*shape"]:
    """Uniform random ``uint32`` bits of ``shape``; equal to ``jax.random.bits``.

    >>> import fshard as fs
    >>> fs.random.bits(fs.random.key(0), (3,)).asnumpy().tolist()
    [4070199207, 4202968722, 1427181096]
    """
    _check_key(key, "bits")
    shape = _check_shape(shape, "bits")
    if _dtype(dtype, "bits", _U32) != _U32:
        raise ArgumentError(
            f"fs.random.bits(..., dtype): only uint32 is supported, got {dtype!r}.\nFix: "
            "draw uint32 bits and cast them.")
    x0, x1 = _hash(key, shape)
    return ops.bitwise_xor(x0, x1)


def _dtype(dtype, fn: str, default):
    """Any spelling of a dtype fshard accepts (a MindSpore dtype, a NumPy dtype or type,
    a string such as ``"float32"``; None: ``default``) as a MindSpore dtype."""
    if dtype is None:
        return default
    try:
        return dtypes.canonical(dtype)
    except (ArgumentError, TypeError):
        raise ArgumentError(
            f"fs.random.{fn}(..., dtype): {dtype!r} is not a dtype fshard knows.\nFix: "
            "pass e.g. mindspore.float32, numpy.float32 or 'float32'.") from None


def _check_float(dtype, fn: str):
    dtype = _dtype(dtype, fn, dtypes.float32)
    if dtype not in _FLOATS:
        raise ArgumentError(
            f"fs.random.{fn}(..., dtype): dtype must be float16, float32 or float64, "
            f"got {dtype}.\nFix: pass one of them (as "
            "mindspore.float32, numpy.float32 or 'float32'); draw integers with "
            "fs.random.randint or fs.random.bits.")
    return dtype


def _unit(key, shape, dtype):
    """Uniform floats in [0, 1) with the dtype's mantissa bits of randomness."""
    if dtype == dtypes.float64:
        x0, x1 = _hash(key, shape)  # the 64 random bits are (x0 << 32) | x1
        m = ops.add(ops.mul(ops.cast(x0, dtype), float(1 << 20)),
                    ops.cast(ops.shift_right(x1, 12), dtype))
        return ops.mul(m, 2.0 ** -52)
    b = bits(key, shape)
    if dtype == dtypes.float16:
        b = ops.bitwise_and(b, 0xFFFF)
        m = ops.shift_right(b, 16 - 10)
    else:
        m = ops.shift_right(b, 32 - 23)
    # m < 2**23 converts exactly; scaling by a power of two is exact.
    return ops.mul(ops.cast(ops.cast(m, dtypes.int32), dtype), 2.0 ** -_FLOATS[dtype])


def _as(value, dtype):
    if isinstance(value, Tracer) or not isinstance(value, (int, float, np.generic,
                                                             np.ndarray)):
        return ops.cast(value, dtype)
    return np.asarray(value, dtypes.to_numpy(dtype))


# jax.random.uniform computes ``u * (maxval - minval) + minval`` with XLA, which fuses
# it into one multiply-add on CPU for float32 and float64 (one rounding of the exact
# value) and computes float16 in float32, rounded once to float16. fshard reproduces the
# fused result exactly with error-free transformations in float64 (Knuth's TwoSum,
# Dekker's TwoProduct), then settles the one case a second rounding can get wrong: a tie
# whose exact value lies off the midpoint.


def _two_sum(a, b):
    """``(s, e)`` with ``s = fl(a + b)`` and ``a + b = s + e`` exactly."""
    s = ops.add(a, b)
    bb = ops.sub(s, a)
    return s, ops.add(ops.sub(a, ops.sub(s, bb)), ops.sub(b, bb))


def _split(a):
    c = ops.mul(a, 134217729.0)  # 2**27 + 1 (Veltkamp): a = high + low, 26 bits each
    high = ops.sub(c, ops.sub(c, a))
    return high, ops.sub(a, high)


def _two_product(a, b):
    """``(p, e)`` with ``p = fl(a * b)`` and ``a * b = p + e`` exactly (float64)."""
    p = ops.mul(a, b)
    ah, al = _split(a)
    bh, bl = _split(b)
    e = ops.add(ops.add(ops.add(ops.sub(ops.mul(ah, bh), p), ops.mul(ah, bl)),
                        ops.mul(al, bh)), ops.mul(al, bl))
    return p, e


def _fused_affine(u, span, lo, dtype):
    """``u * span + lo`` rounded once to ``dtype`` (float32 or float64), as XLA's fused
    multiply-add computes it."""
    f64 = dtypes.float64
    if dtype == dtypes.float32:
        p = ops.mul(ops.cast(u, f64), ops.cast(span, f64))  # exact: 24 + 24 bits
        s, rest = _two_sum(p, ops.cast(lo, f64))
        r = ops.cast(s, dtype)
        r64 = ops.cast(r, f64)
        e = ops.sub(s, r64)  # exact
        t64 = ops.add(r64, ops.mul(e, 2.0))  # exact
        t = ops.cast(t64, dtype)
        tie = ops.bitwise_and(ops.not_equal(e, 0.0), ops.bitwise_and(
            ops.equal(ops.cast(t, f64), t64), ops.not_equal(t64, r64)))
    else:
        uh, ul = _two_product(u, span)
        th, tl = _two_sum(lo, uh)
        v, rest = _two_sum(tl, ul)
        r, e = _two_sum(th, v)
        t = ops.add(r, ops.mul(e, 2.0))
        tie = ops.bitwise_and(ops.not_equal(e, 0.0), ops.bitwise_and(
            ops.equal(ops.sub(t, r), ops.mul(e, 2.0)), ops.not_equal(t, r)))
    same_side = ops.greater(ops.mul(ops.sign(rest), ops.sign(e)), 0.0)
    return ops.where(ops.bitwise_and(tie, same_side), t, r)


@_consumes
def uniform(key: Key, shape=(), dtype=dtypes.float32, minval=0.0,
            maxval=1.0) -> Float[Array, "*shape"]:
    """Uniform floats in ``[minval, maxval)``; equal to ``jax.random.uniform`` bit for
    bit (``minval``/``maxval`` are converted to ``dtype`` first, as JAX does).

    >>> import fshard as fs
    >>> [round(float(v), 4) for v in fs.random.uniform(fs.random.key(0), (3,)).asnumpy()]
    [0.9477, 0.9786, 0.3323]
    """
    _check_key(key, "uniform")
    shape = _check_shape(shape, "uniform")
    dtype = _check_float(dtype, "uniform")
    lo, hi = _as(minval, dtype), _as(maxval, dtype)
    span = hi - lo if isinstance(lo, np.ndarray) and isinstance(hi, np.ndarray) else \
        ops.sub(hi, lo)
    u = _unit(key, shape, dtype)
    if dtype == dtypes.float16:
        # XLA's CPU backend computes float16 arithmetic in float32 and rounds the result
        # once (the product of two float16 values is exact in float32)
        f32 = dtypes.float32
        out = ops.cast(ops.add(ops.mul(ops.cast(u, f32), ops.cast(span, f32)),
                               ops.cast(lo, f32)), dtype)
    else:
        out = _fused_affine(u, span, lo, dtype)
    return ops.broadcast_to(ops.maximum(lo, out), shape)


# Giles, "Approximating the erfinv function" (GPU Computing Gems, 2011), single precision.
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06,
                   0.00021858087, -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844,
                0.00573950773, -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


def _log(x):
    """``log`` of a float32 value computed in float64: MindSpore's float32 CPU ``Log`` is
    accurate in absolute terms only (3% relative error at ``log(0.9999)``), which the
    tails of ``normal`` and ``gumbel`` would magnify."""
    a = typeof(x)
    if a.dtype == dtypes.float64:
        return ops.log(x)
    return ops.cast(ops.log(ops.cast(x, dtypes.float64)), a.dtype)


def _erfinv(x, dtype):
    """The inverse error function on (-1, 1), ±inf at ±1."""
    x32 = ops.cast(x, dtypes.float32)
    # w = -log1p(-x**2) with x**2 rounded to float32 (as XLA's ErfInv does, so normal
    # draws match jax.random's); 1 - x**2 is exact in float64.
    xx = ops.cast(ops.mul(x32, x32), dtypes.float64)
    w = ops.cast(ops.neg(ops.log(ops.sub(1.0, xx))), dtypes.float32)
    central = ops.less(w, 5.0)
    w = ops.where(central, ops.sub(w, 2.5), ops.sub(ops.sqrt(w), 3.0))
    p = ops.where(central, np.float32(_ERFINV_CENTRAL[0]), np.float32(_ERFINV_TAIL[0]))
    for c, t in zip(_ERFINV_CENTRAL[1:], _ERFINV_TAIL[1:]):
        p = ops.add(ops.where(central, np.float32(c), np.float32(t)), ops.mul(p, w))
    if dtype == dtypes.float64:
        return _erfinv64(x)
    y = ops.cast(ops.mul(p, x32), dtype)
    edge = ops.equal(ops.abs(x), 1.0)
    return ops.where(edge, ops.mul(x, np.asarray(np.inf, dtypes.to_numpy(dtype))), y)


def _erfinv64(x):
    """The inverse error function in float64, to a few float64 ulp of the exact value
    for every ``x`` in (-1, 1) (±inf at ±1).

    Giles' single-precision polynomial, evaluated in float64 on ``w = -log((1-|x|)(1+|x|))``
    (exact enough near ±1, where ``x**2`` in float32 would round to 1), is refined by
    Newton's method; near ±1 the residual is taken against ``erfc``, since ``1 - |x|``
    is exact there while ``erf(y) - |x|`` would lose every digit to cancellation.
    """
    f64 = dtypes.float64
    ax = ops.abs(x)
    q = ops.sub(1.0, ax)  # exact for |x| >= 0.5
    w = ops.neg(ops.log(ops.mul(q, ops.add(1.0, ax))))
    central = ops.less(w, 5.0)
    w_safe = ops.where(ops.less(w, 1e300), w, 1e300)  # w = inf at |x| = 1
    t = ops.where(central, ops.sub(w_safe, 2.5), ops.sub(ops.sqrt(w_safe), 3.0))
    p = ops.where(central, _ERFINV_CENTRAL[0], _ERFINV_TAIL[0])
    for c, d in zip(_ERFINV_CENTRAL[1:], _ERFINV_TAIL[1:]):
        p = ops.add(ops.where(central, np.float64(c), np.float64(d)), ops.mul(p, t))
    y = ops.mul(p, ax)
    # The polynomial is fitted to float32's range (w < 16.6); beyond, the asymptotic
    # erfc(y) ~ exp(-y**2) / (y sqrt(pi)) gives y**2 ~ L - log(pi L) / 2, L = -log(1-|x|).
    big_l = ops.neg(ops.log(ops.where(ops.greater(q, 0.0), q, 1e-300)))
    deep = ops.sqrt(ops.sub(big_l, ops.mul(0.5, ops.log(ops.mul(math.pi, big_l)))))
    y = ops.where(ops.greater(w, 16.0), deep, y)
    near_one = ops.greater_equal(ax, 0.5)
    # Halley's method (cubic convergence; erf'' = -2y erf'): three steps reach float64.
    for _ in range(3):
        slope = ops.mul(2.0 / math.sqrt(math.pi), ops.exp(ops.neg(ops.square(y))))
        residual = ops.where(near_one, ops.sub(q, ops.erfc(y)), ops.sub(ops.erf(y), ax))
        step = ops.div(residual, ops.where(ops.greater(slope, 0.0), slope, 1.0))
        step = ops.div(step, ops.add(1.0, ops.mul(y, step)))
        y = ops.where(ops.greater(slope, 0.0), ops.sub(y, step), y)
    y = ops.where(ops.equal(ax, 1.0), np.float64(np.inf), y)
    return ops.mul(ops.sign(x), ops.cast(y, f64))


@_consumes
def normal(key: Key, shape=(), dtype=dtypes.float32) -> Float[Array, "*shape"]:
    """Standard normal floats: ``sqrt(2) * erfinv(u)`` for ``u`` uniform in (-1, 1)
    (``jax.random.normal``'s construction).

    >>> import fshard as fs
    >>> [round(float(v), 3) for v in fs.random.normal(fs.random.key(0), (3,)).asnumpy()]
    [1.623, 2.025, -0.434]
    """
    _check_key(key, "normal")
    shape = _check_shape(shape, "normal")
    dtype = _check_float(dtype, "normal")
    npd = dtypes.to_numpy(dtype)
    lo = np.nextafter(np.asarray(-1.0, npd), np.asarray(0.0, npd))
    u = uniform(key, shape, dtype, lo, np.asarray(1.0, npd))
    return ops.mul(np.asarray(np.sqrt(2), npd), _erfinv(u, dtype))


@_consumes
def truncated_normal(key: Key, lower, upper, shape=None,
                     dtype=dtypes.float32) -> Float[Array, "*shape"]:
    """Standard normal floats conditioned on ``lower < x < upper``: JAX's construction,
    ``sqrt(2) * erfinv(u)`` for ``u`` uniform in ``[erf(lower/sqrt2), erf(upper/sqrt2))``
    (the same ``u`` as ``jax.random.truncated_normal`` when the two ``erf`` agree),
    clamped to the open interval. ``erfinv`` is evaluated in float64 and rounded once,
    so a draw is within an ulp of the exact inverse CDF of its ``u``.

    >>> import fshard as fs
    >>> x = fs.random.truncated_normal(fs.random.key(0), -1.0, 1.0, (3,))
    >>> [round(float(v), 3) for v in x.asnumpy()]
    [0.862, 0.941, -0.291]
    """
    _check_key(key, "truncated_normal")
    dtype = _check_float(dtype, "truncated_normal")
    if shape is None:
        shape = broadcast_shapes(typeof(lower).shape, typeof(upper).shape)
    shape = _check_shape(shape, "truncated_normal")
    npd = dtypes.to_numpy(dtype)
    sqrt2 = np.asarray(np.sqrt(2), npd)
    lower, upper = _as(lower, dtype), _as(upper, dtype)
    a = ops.erf(ops.div(lower, sqrt2))
    b = ops.erf(ops.div(upper, sqrt2))
    u = ops.cast(uniform(key, shape, dtype, a, b), dtypes.float64)
    # Near a bound close to +-1 the inverse CDF magnifies any rounding: no float32 step.
    out = ops.cast(ops.mul(np.sqrt(2.0), _erfinv64(u)), dtype)
    # Keep the bounds themselves out, as the open interval promises.
    lo = np.nextafter(lower, np.asarray(np.inf, npd)) if isinstance(lower, np.ndarray) \
        else lower
    hi = np.nextafter(upper, np.asarray(-np.inf, npd)) if isinstance(upper, np.ndarray) \
        else upper
    return ops.minimum(ops.maximum(out, lo), hi)


@_consumes
def bernoulli(key: Key, p=0.5, shape=None) -> Bool[Array, "*shape"]:
    """Booleans that are True with probability ``p`` (``uniform < p``).

    >>> import fshard as fs
    >>> fs.random.bernoulli(fs.random.key(0), 0.5, (4,)).asnumpy().tolist()
    [False, False, True, True]
    """
    _check_key(key, "bernoulli")
    dtype = typeof(p).dtype if isinstance(p, Tracer) else dtypes.float32
    if not dtypes.is_float(dtype):
        raise ArgumentError(
            f"fs.random.bernoulli(key, p): p must be a float probability, got {dtype}.")
    if shape is None:
        shape = typeof(p).shape
    shape = _check_shape(shape, "bernoulli")
    return ops.less(uniform(key, shape, dtype), _as(p, dtype))


@_consumes
def randint(key: Key, shape, minval, maxval, dtype=dtypes.int32) -> Int[Array, "*shape"]:
    """Integers uniform in ``[minval, maxval)`` (``minval`` where ``maxval <= minval``).

    >>> import fshard as fs
    >>> fs.random.randint(fs.random.key(0), (4,), 0, 10).asnumpy().tolist()
    [9, 9, 3, 4]

    The offset is ``floor(bits * span / 2**32)`` (Lemire's multiply-shift): bias below
    ``span / 2**32``.
    """
    _check_key(key, "randint")
    shape = _check_shape(shape, "randint")
    dtype = _dtype(dtype, "randint", dtypes.int32)
    if not dtypes.is_int(dtype) or dtype in (_U32, dtypes.canonical(np.uint8)):
        raise ArgumentError(
            f"fs.random.randint(..., dtype): dtype must be a signed integer dtype, got "
            f"{dtype}.\nFix: pass e.g. mindspore.int32 or 'int32'.")
    for name, v in (("minval", minval), ("maxval", maxval)):
        a = typeof(v)
        if not (dtypes.is_int(a.dtype) or isinstance(v, (int, np.integer))):
            raise ArgumentError(
                f"fs.random.randint(..., {name}): must be an integer, got {a}.")
    i64 = dtypes.int64
    lo, hi = ops.cast(minval, i64), ops.cast(maxval, i64)
    span = ops.maximum(ops.sub(hi, lo), 1)
    b = ops.cast(bits(key, shape), i64)
    # floor(b * span / 2**32) without overflowing int64: b = bh * 2**16 + bl.
    bh, bl = ops.shift_right(b, 16), ops.bitwise_and(b, 0xFFFF)
    low = ops.shift_right(ops.mul(bl, span), 16)
    offset = ops.shift_right(ops.add(ops.mul(bh, span), low), 16)
    return ops.cast(ops.broadcast_to(ops.add(lo, offset), shape), dtype)


@_consumes
def gumbel(key: Key, shape=(), dtype=dtypes.float32) -> Float[Array, "*shape"]:
    """Standard Gumbel floats, ``-log(-log(u))``.

    >>> import fshard as fs
    >>> [round(float(v), 3) for v in fs.random.gumbel(fs.random.key(0), (3,)).asnumpy()]
    [2.923, 3.833, -0.097]
    """
    _check_key(key, "gumbel")
    dtype = _check_float(dtype, "gumbel")
    tiny = np.finfo(dtypes.to_numpy(dtype)).tiny
    u = uniform(key, shape, dtype, tiny, 1.0)
    return ops.neg(_log(ops.neg(_log(u))))


@_consumes
def categorical(key: Key, logits: Float[Array, "..."], axis: int = -1,
                shape=None) -> Int[Array, "..."]:
    """Indices drawn with probabilities ``softmax(logits, axis)`` (the Gumbel-max
    trick). ``shape`` (default: ``logits``' shape without ``axis``) may add leading
    dimensions.

    >>> import numpy as np, fshard as fs
    >>> p = np.array([[0.1, 0.2, 0.7], [0.9, 0.05, 0.05]], np.float32)
    >>> fs.random.categorical(fs.random.key(0), np.log(p)).asnumpy().tolist()
    [1, 0]
    """
    _check_key(key, "categorical")
    a = typeof(logits)
    if not dtypes.is_float(a.dtype) or a.ndim == 0:
        raise ArgumentError(
            f"fs.random.categorical(key, logits): logits must be a float array with at "
            f"least one axis, got {a}.")
    if not -a.ndim <= axis < a.ndim:
        raise ArgumentError(
            f"fs.random.categorical(..., axis={axis}): out of range for logits {a}.")
    axis %= a.ndim
    batch = a.shape[:axis] + a.shape[axis + 1:]
    shape = batch if shape is None else _check_shape(shape, "categorical")
    if shape[len(shape) - len(batch):] != batch:
        raise ArgumentError(
            f"fs.random.categorical(..., shape={shape}): must end with the logits' batch "
            f"shape {batch}.")
    prefix = shape[:len(shape) - len(batch)]
    g = gumbel(key, prefix + a.shape, a.dtype)
    return ops.argmax(ops.add(g, logits), axis=len(prefix) + axis)


@_consumes
def permutation(key: Key, x, axis: int = 0) -> Shaped[Array, "..."]:
    """A random permutation of ``range(x)`` (int ``x``) or of ``x`` along ``axis``.

    >>> import fshard as fs
    >>> fs.random.permutation(fs.random.key(0), 5).asnumpy().tolist()
    [2, 3, 4, 0, 1]

    Ranks ``n`` random keys by comparing every pair: O(n**2) work and memory, for
    ``n`` up to 16384.
    """
    _check_key(key, "permutation")
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        n, array = int(x), None
    else:
        a = typeof(x)
        if a.ndim == 0 or not -a.ndim <= axis < a.ndim:
            raise ArgumentError(
                f"fs.random.permutation(key, x, axis={axis}): x must be an int or an "
                f"array with that axis, got {a}.")
        axis %= a.ndim
        n, array = a.shape[axis], x
    if not 0 <= n <= _MAX_PERMUTATION:
        raise ArgumentError(
            f"fs.random.permutation: n must be in [0, {_MAX_PERMUTATION}], got {n}.\nFix: "
            "permute in blocks, or draw the permutation outside the transformed function.")
    u = ops.cast(bits(key, (n,)), dtypes.int64)
    idx = np.arange(n, dtype=np.int32)
    ui, uj = ops.reshape(u, (n, 1)), ops.reshape(u, (1, n))
    before = ops.bitwise_or(ops.less(uj, ui),
                            ops.bitwise_and(ops.equal(uj, ui), idx[None, :] < idx[:, None]))
    rank = ops.reduce_sum(ops.cast(before, dtypes.int32), axis=1)  # a permutation
    hit = ops.equal(ops.reshape(rank, (n, 1)), idx[None, :])  # hit[i, k]: rank[i] == k
    perm = ops.reduce_sum(ops.where(hit, idx[:, None], np.int32(0)), axis=0)
    return perm if array is None else ops.gather(array, perm, axis=axis)
