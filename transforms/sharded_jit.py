"""``fs.jit``: the user API of ``jit``, with JAX's ``in_shardings``/``out_shardings``.

``fs.jit(f, in_shardings=..., out_shardings=...)`` is ``fs.jit(fs.shard(f,
in_strategy=in_shardings, out_strategy=out_shardings))``: fs.shard's strategies,
propagation and partitioning, compiled as one program per input signature. It lives
above both transforms (``shard`` uses ``jit`` for its declared shapes); without
shardings it is transforms/jit.py's ``jit`` itself.
"""

from __future__ import annotations

import inspect

from fshard.adapter.cells import is_cell, maybe_cell
from fshard.errors import ArgumentError
from fshard.core.staging import check_function, fun_name
from fshard.transforms.jit import _DECORATOR, check_donation
from fshard.transforms.jit import jit as _jit
from fshard.transforms.shard import shard


def jit(fun=_DECORATOR, *, static_argnums=(), static_argnames=(), in_shapes=None,
        donate_argnums=(), donate_argnames=(), in_shardings=None, out_shardings=None):
    """Compile ``fun`` into one MindSpore GRAPH-mode program per input signature.

    >>> import numpy as np, fshard as fs
    >>> f = fs.jit(lambda x, y: fs.ops.relu(x @ y))
    >>> f(np.eye(2, dtype=np.float32), -np.ones((2, 2), np.float32)).shape
    (2, 2)
    >>> f.trace_count
    1

    With shardings, the compiled program is the sharded one (as ``fs.shard``, on the
    mesh in effect when ``fs.jit`` is applied):

    >>> with fs.Mesh(2, "d"):
    ...     g = fs.jit(lambda x, w: x @ w, in_shardings=((2, 1), None),
    ...                out_shardings=(2, 1))
    >>> g(np.ones((4, 3), np.float32), np.ones((3, 2), np.float32)).asnumpy().tolist()
    [[3.0, 3.0], [3.0, 3.0], [3.0, 3.0], [3.0, 3.0]]

    Args:
        fun: a function of pytrees of arrays (or an ``nn.Cell``).
        static_argnums: positions of arguments that are Python values, part of the
            cache key and passed to ``fun`` unchanged.
        static_argnames: the same, for keyword arguments.
        in_shapes: declared input shapes, one entry per positional argument, as for
            ``set_inputs`` (``fs.Symbol`` dimensions: one program for every size).
        donate_argnums: positions of arguments whose memory the caller gives up (JAX's
            buffer donation). Checked (non-negative ints, not static, within the call's
            arguments), but MindSpore 2.10 has no donation: the memory is not reused and
            the arguments stay valid. Write it for code shared with JAX.
        donate_argnames: the same, by parameter name.
        in_shardings: ``fs.shard``'s ``in_strategy``: one strategy per positional
            argument (split counts, an ``fs.Layout`` view or None). None with
            ``out_shardings``: every input left to propagation.
        out_shardings: ``fs.shard``'s ``out_strategy`` (a pytree prefix of the
            outputs); None: replicated outputs.

    Returns:
        a callable with ``.lower(*args)`` (``.as_text()``, ``.compile()``),
        ``.set_inputs(...)`` and ``.trace_count``.

    Raises:
        ArgumentError: a bad ``static_argnums``/``donate_argnums`` and the like, or
            shardings together with static arguments (close over the static value).
        ShardingError: a strategy that does not fit the arguments (when called).

    See also: ``fs.make_ir``, ``fs.shard``, ``fs.disable_jit``; docs/jit.md.
    """
    if fun is _DECORATOR:  # @fs.jit(static_argnums=...) as a decorator factory
        def decorate(f):
            check_function("fs.jit", f)
            return jit(f, static_argnums=static_argnums, static_argnames=static_argnames,
                       in_shapes=in_shapes, donate_argnums=donate_argnums,
                       donate_argnames=donate_argnames, in_shardings=in_shardings,
                       out_shardings=out_shardings)

        return decorate
    check_function("fs.jit", fun)
    if in_shardings is None and out_shardings is None:
        return _jit(fun, static_argnums=static_argnums, static_argnames=static_argnames,
                    in_shapes=in_shapes, donate_argnums=donate_argnums,
                    donate_argnames=donate_argnames)
    if static_argnums or static_argnames:
        raise ArgumentError(
            f"fs.jit({fun_name(fun)}, in_shardings/out_shardings=...) with static "
            "arguments: a sharded function takes arrays only (one strategy each).\nFix: "
            "close over the static value (fs.jit(functools.partial(f, n=3), "
            "in_shardings=...)), or use one jit per value.")
    if in_shardings is None:
        in_shardings = (None,) * _positional_count(fun)
    if not is_cell(fun):
        sharded = shard(fun, in_strategy=in_shardings, out_strategy=out_shardings)
        return _jit(sharded, in_shapes=in_shapes, donate_argnums=donate_argnums,
                    donate_argnames=donate_argnames)
    # A Cell: its functional form, the parameters as argument 0 (left to propagation),
    # so every call reads the Cell's current parameters (fs.shard(cell) would read them
    # once, when the program is traced, and compile them in as constants).
    donate_argnums, donate_argnames = check_donation(
        "fs.jit", fun.construct, donate_argnums, donate_argnames, (), ())
    if not isinstance(in_shardings, (tuple, list)):
        raise ArgumentError(
            f"fs.jit({fun_name(fun)}, in_shardings=...) must be a tuple with one strategy "
            f"(or None) per positional argument of the Cell; got {in_shardings!r}.\nFix: "
            "e.g. in_shardings=((4, 1),) for one input split along its rows.")

    def make(apply):
        sharded = shard(apply, in_strategy=(None, *in_shardings), out_strategy=out_shardings)
        shapes = in_shapes if in_shapes is None or isinstance(in_shapes, str) else (
            None, *in_shapes)
        return _jit(sharded, in_shapes=shapes,
                    donate_argnums=tuple(i + 1 for i in donate_argnums),
                    donate_argnames=donate_argnames)

    return maybe_cell(fun, make)


def _positional_count(fun) -> int:
    target = fun.construct if hasattr(fun, "construct") else fun
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        params = None
    if params is None or any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ArgumentError(
            f"fs.jit({fun_name(fun)}, out_shardings=...) without in_shardings: the number "
            "of positional arguments cannot be read from the function's signature.\nFix: "
            "give in_shardings too, one strategy (or None) per positional argument.")
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and
               p.default is p.empty for p in params)
