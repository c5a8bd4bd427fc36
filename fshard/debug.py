"""Printing and inspecting values at run time, inside transformed and compiled code
(NB: ``jax.debug.print`` / ``jax.debug.callback``).

A Python ``print`` in a traced function runs once, while tracing, and shows tracers.
``fs.debug.print(fmt, *args)`` and ``fs.debug.callback(fn, *args)`` instead record a
``debug_callback`` equation, which calls a Python function with the values as NumPy
arrays every time the program runs: eagerly, and inside ``fs.jit`` as a MindSpore
``Custom`` op of type ``pyfunc`` (a Python call from the GRAPH-mode program).
MindSpore's own ``ops.Print`` traces to the same primitive (fshard/adapter/interop.py).

The primitive has an *effect*: it has no outputs, yet

- the IR passes (``dce``, ``cse``) keep every such equation, and
- the lowering chains them (each callback's operands wait for the previous callback's
  result, ``ops.depend``) and makes the program's outputs wait for the last one, so
  MindSpore neither prunes nor reorders them: callbacks run in program order.

Under the transforms:

- ``vmap`` (and a virtual mesh, which runs a ``shard_map`` body batched over its
  devices): the callback is called once per example (per device), in order, with that
  example's values; a value not batched is passed whole to every call;
- ``grad``/``vjp``/``jvp``: the callback runs in the forward pass, on the primal
  values; the backward pass calls nothing;
- ``fs.shard`` / ``AutoParallel``: its operands are made whole (replicated) first, so
  each device calls it with the global values; in a multi-process job each rank calls
  it (once per rank).
"""

from __future__ import annotations

import re
import string
import sys
from typing import Callable

import numpy as np

from fshard.core import tree
from fshard.backend import mindspore as backend
from fshard.core.tracing import Tracer, typeof
from fshard.errors import ArgumentError
from fshard.core.factors import FactorSpec
from fshard.core.interpret import current_axis
from fshard.primitives.base import def_primitive
from fshard.core.rules import batching, jvp, sharding, unsupported

__all__ = ["print", "callback", "debug_callback_p"]

_builtin_print = print


def _type(*avals, callback):
    return []


def _eager(*xs, callback):
    callback(*[backend.to_numpy(x) for x in xs])
    return []


def _lower(ctx, *xs, callback):
    # The effect chain (see _function_source): operands wait for the previous callback.
    ctx.effectful = True
    if ctx.effect is not None:
        xs = tuple(ctx.call(backend.depend, x, ctx.effect) for x in xs)
    # A pyfunc op takes tensors of rank >= 1 (a 0-d operand reaches it as a scalar,
    # which it refuses), and at least one operand.
    scalars = tuple(a.ndim == 0 for a in ctx.in_avals)
    xs = tuple(ctx.call(backend.as_rank1, x) if s else x for x, s in zip(xs, scalars))
    fn = callback

    def call(*arrays):
        # MindSpore reuses the buffers it hands over at the next call: copies, so that a
        # callback may keep what it is given
        fn(*[np.array(a).reshape(()) if s else np.array(a) for a, s in zip(arrays, scalars)])

    if not xs:
        xs = (ctx.ref(backend.as_tensor(np.zeros((1,), np.float32)), "nothing"),)
        call = lambda _: fn()  # noqa: E731
    call.__name__ = getattr(fn, "__name__", "callback")
    return ctx.call(backend.python_callback_op(call, len(xs)), *xs)


debug_callback_p = def_primitive(
    "debug_callback", "debug", _type, multiple_results=True, lower=_lower, eager=_eager,
    show=lambda params: f"debug_callback[{getattr(params['callback'], '__name__', '?')}]",
    effect=True)


def _batched_callback(callback, dims, size):
    """``callback`` for one example, called on each example of batched values in turn."""
    def each_example(*arrays):
        for i in range(size):
            callback(*[a if d is None else np.take(a, i, axis=d)
                       for a, d in zip(arrays, dims)])

    each_example.__name__ = getattr(callback, "__name__", "callback")
    return each_example


def _batching(args, dims, *, callback):
    size = next((typeof(x).shape[d] for x, d in zip(args, dims) if d is not None), None)
    if size is None:
        size = current_axis().size
    debug_callback_p.bind(*args, callback=_batched_callback(callback, tuple(dims), size))
    return [], []


def _jvp(primals, tangents, *, callback):
    debug_callback_p.bind(*primals, callback=callback)  # the forward pass only
    return [], []


batching.set(debug_callback_p, _batching)
jvp.set(debug_callback_p, _jvp)
unsupported(debug_callback_p, "transpose", "it is not linear: under grad it runs in the "
            "forward pass, on the primal values")
# Operands whole on every device: each device calls it with the global values.
sharding.set(debug_callback_p, lambda *avals, callback: FactorSpec(
    [(None,) * a.ndim for a in avals], [], {}, flops_per_point=0.0))


# ---------------------------------------------------------------------------
# The user functions
# ---------------------------------------------------------------------------


def _split_static(args, kwargs):
    """The array leaves of ``(args, kwargs)`` (to trace) and a rebuild from their values."""
    leaves, treedef = tree.flatten((tuple(args), dict(kwargs)))
    is_array = [isinstance(x, Tracer) or hasattr(x, "asnumpy") or isinstance(x, np.ndarray)
                for x in leaves]
    arrays = [x for x, a in zip(leaves, is_array) if a]

    def rebuild(values):
        it = iter(values)
        return tree.unflatten(treedef, [next(it) if a else x for x, a in zip(leaves, is_array)])

    return arrays, rebuild


def callback(fn: Callable, *args, **kwargs) -> None:
    """Call ``fn(*args, **kwargs)`` with the values (NumPy arrays) each time the
    program runs, also inside ``fs.jit`` (NB: ``jax.debug.callback``). Its return
    value is ignored. ``args`` may be pytrees; leaves that are not arrays are passed
    as they are.

    >>> import numpy as np, fshard as fs
    >>> seen = []
    >>> f = fs.jit(lambda x: (fs.debug.callback(seen.append, x * 2), x + 1)[1])
    >>> f(np.arange(3, dtype=np.float32)).asnumpy().tolist()
    [1.0, 2.0, 3.0]
    >>> seen[0].tolist()
    [0.0, 2.0, 4.0]

    Raises:
        ArgumentError: ``fn`` is not callable.

    See also: ``fs.debug.print``; docs/debugging.md.
    """
    if not callable(fn):
        raise ArgumentError(
            f"fs.debug.callback(fn, ...): fn must be callable, got {fn!r} "
            f"({type(fn).__name__}).\nFix: pass a function, e.g. "
            "fs.debug.callback(lambda x: print(x.mean()), x).")
    arrays, rebuild = _split_static(args, kwargs)

    def call(*values):
        a, k = rebuild(values)
        fn(*a, **k)

    call.__name__ = getattr(fn, "__name__", "callback")
    debug_callback_p.bind(*arrays, callback=call)


def _check_fields(fmt: str, n_args: int, kwargs: dict) -> None:
    """Check ``fmt``'s replacement fields against the arguments when tracing, so a
    mistake is an fshard error here, not a Python error raised in the running program."""
    def refuse(why):
        raise ArgumentError(
            f"fs.debug.print(fmt, *args, **kwargs): {why} (fmt = {fmt!r}, {n_args} "
            f"positional argument(s), keywords {sorted(kwargs)}).\nFix: give one argument "
            "per '{}' field, and a keyword for each named field.")

    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(fmt) if f is not None]
    except ValueError as e:
        refuse(f"the format string is malformed: {e}")
    heads = [re.split(r"[.\[]", f, maxsplit=1)[0] for f in fields]
    if "" in heads and any(h.isdigit() for h in heads):
        refuse("it mixes automatic '{}' and numbered '{0}' fields")
    auto = 0
    for field in fields:
        head = re.split(r"[.\[]", field, maxsplit=1)[0]
        if head == "":
            auto += 1
            if auto > n_args:
                refuse(f"field {auto} '{{{field}}}' has no positional argument")
        elif head.isdigit():
            if int(head) >= n_args:
                refuse(f"field '{{{field}}}' names positional argument {head}, which is "
                       "not given")
        elif head not in kwargs:
            refuse(f"field '{{{field}}}' names keyword {head!r}, which is not given")


def print(fmt: str, *args, **kwargs) -> None:  # noqa: A001 (the name JAX users know)
    """Print ``fmt.format(*args, **kwargs)`` with the values each time the program
    runs, also inside ``fs.jit`` (NB: ``jax.debug.print``). Under ``vmap`` (and on a
    virtual mesh) it prints once per example (per device); under ``grad`` in the
    forward pass only.

    >>> import numpy as np, fshard as fs
    >>> f = fs.jit(lambda x: (fs.debug.print("x = {}", x), x * 2)[1])
    >>> f(np.arange(3, dtype=np.float32)).asnumpy().tolist()
    x = [0. 1. 2.]
    [0.0, 2.0, 4.0]

    Raises:
        ArgumentError: ``fmt`` is not a str, or names an argument that is not given.

    See also: ``fs.debug.callback``; docs/debugging.md.
    """
    if not isinstance(fmt, str):
        raise ArgumentError(
            f"fs.debug.print(fmt, *args): fmt must be a format string, got {fmt!r} "
            f"({type(fmt).__name__}).\nFix: e.g. fs.debug.print('loss = {{}}', loss).")

    _check_fields(fmt, len(args), kwargs)

    def show(*a, **k):
        _builtin_print(fmt.format(*a, **k), flush=True)
        sys.stdout.flush()

    callback(show, *args, **kwargs)
