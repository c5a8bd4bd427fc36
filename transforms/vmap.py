"""``fs.vmap``: vectorise a function over a batch axis (NB: JAX's batching.py).

The function is staged once on *unbatched* types; ``batch_program`` (the batching
interpreter, in fshard/core/interpret.py beside the eager one) then walks the
Program, applying each primitive's batching rule to ``(value, batch_dim)`` pairs and
binding the rule's operations into the current trace. A batched Program is
therefore vectorised, never a loop: each equation becomes one equation (plus, at
most, moves of the batch axis).

Named axes: with ``axis_name``, collectives over that name (``fs.psum(x, "i")``) are
handled by their batching rules, which read the axis being batched from
``current_axis()``.
"""

from __future__ import annotations

import functools

from fshard.core import context, tree
from fshard.backend.mindspore import as_tensor
from fshard.core.tracing import ArrayType, Tracer, typeof
from fshard.errors import BatchingError
from fshard.core.interpret import AxisData, batch_program, current_axis  # noqa: F401
from fshard.primitives.base import move_axis
from fshard.primitives.collectives import named_axis
from fshard.core.staging import fun_name, trace_fun


def inside_vmap() -> bool:
    """Whether code runs while being staged for ``vmap`` (``shard`` must not)."""
    return context.vmap_staging.get() > 0


def type_tree(x) -> str:
    """``x`` with each array replaced by its type: ``{'w': f32[3,2], 'b': f32[2]}``."""
    if isinstance(x, tuple):
        return "(" + ", ".join(type_tree(e) for e in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, list):
        return "[" + ", ".join(type_tree(e) for e in x) + "]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {type_tree(v)}" for k, v in x.items()) + "}"
    if x is None:
        return "None"
    try:
        return str(typeof(x))
    except Exception:  # noqa: BLE001  (a leaf fshard cannot type: show its Python type)
        return type(x).__name__


def param_names(fun) -> list[str]:
    """Names of ``fun``'s positional parameters (empty if it has no signature)."""
    import inspect

    if fun is None:
        return []
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def arg_path(fun, i: int, path=()) -> str:
    """``args[1]['w'] (parameter 'params')``: a key path and the parameter it is in."""
    names = param_names(fun)
    where = f" (parameter '{names[i]}')" if i < len(names) else ""
    return f"args[{i}]{tree.keystr(path)}{where}"


def _is_axis(ax) -> bool:
    return ax is None or (isinstance(ax, int) and not isinstance(ax, bool))


def _flat_axes(in_axes, args, fun, fname):
    """One in-axis per leaf of ``args`` from the prefix tree ``in_axes``."""
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    if not (_is_axis(in_axes) or isinstance(in_axes, tuple)):
        fix = (f"wrap a pytree of axes in a tuple, e.g. in_axes=({in_axes!r},) for a "
               "function of one argument." if tree.leaves(in_axes) != [in_axes] else
               "use the index of the mapped axis, or None.")
        raise BatchingError(
            f"vmap({fname}): in_axes must be an int, None, or a tuple with one entry per "
            f"positional argument; got {in_axes!r}.\nFix: {fix}")
    if not isinstance(in_axes, tuple):
        in_axes = (in_axes,) * len(args)
    if len(in_axes) != len(args):
        entries = "entry" if len(in_axes) == 1 else "entries"
        raise BatchingError(
            f"vmap({fname}): in_axes has {len(in_axes)} {entries} but the function was "
            f"called with {len(args)} positional arguments.\nFix: give in_axes one entry "
            "per positional argument (an int, None, or a pytree prefix of the argument), "
            "or a single int or None for all of them.")
    flat = []
    for i, (ax, a) in enumerate(zip(in_axes, args)):
        try:
            flat += tree.broadcast_prefix(ax, a, is_leaf=lambda x: x is None)
        except ValueError:
            raise BatchingError(
                f"vmap({fname}): in_axes[{i}]={ax!r} is not a pytree prefix of "
                f"{arg_path(fun, i)}, which is {type_tree(a)}.\nFix: give in_axes[{i}] the "
                "containers of that argument with an int or None at each leaf (None for "
                "unbatched parts), or one int or None for the whole argument.") from None
    return flat


def _keypaths(fun, args) -> list[str]:
    out = []
    for i, a in enumerate(args):
        paths, _, _ = tree.flatten_with_path(a)
        out += [arg_path(fun, i, p) for p in paths]
    return out


def vmap(fun, in_axes=0, out_axes=0, axis_name=None, axis_size=None):
    """Vectorise ``fun`` over an axis of its arguments.

    >>> import numpy as np, fshard as fs
    >>> xs = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> fs.vmap(lambda x, w: (x * w).sum(), in_axes=(0, None))(xs, np.ones(2, np.float32))
    Tensor(shape=[3], dtype=Float32, value= [ 1.00000000e+00,  5.00000000e+00,  9.00000000e+00])

    Args:
        fun: a function of pytrees of arrays.
        in_axes: an int, None, or a pytree prefix of the positional arguments giving the
            mapped axis of each (None: not mapped). Negative axes count from the end.
        out_axes: the same for the outputs.
        axis_name: a name for the mapped axis, so collectives (``fs.psum(x, name)``) in
            ``fun`` reduce over it.
        axis_size: the batch size, needed when no argument is mapped.

    Raises:
        BatchingError: mismatched batch sizes, axes out of range, or in_axes/out_axes that
            do not match the arguments' structure.

    See also: docs/vmap.md.
    """
    from fshard.adapter.cells import maybe_cell

    if not callable(fun):
        raise BatchingError(f"vmap expects a function, got {type(fun).__name__}.")
    if axis_size is not None and (isinstance(axis_size, bool) or not isinstance(
            axis_size, int) or axis_size < 0):
        raise BatchingError(
            f"vmap(axis_size=...) must be None or an int >= 0 (the batch size); got "
            f"{axis_size!r}.")
    # A Cell's functional form takes its parameters first: they are never mapped.
    return maybe_cell(fun, lambda f: _vmap(f, in_axes, out_axes, axis_name, axis_size,
                                           params_first=f is not fun))


def _vmap(fun, in_axes, out_axes, axis_name, axis_size, params_first=False):
    fname = fun_name(fun)

    @functools.wraps(fun)
    def batched(*args, **kwargs):
        user_args = args[1:] if params_first else args
        user_fun = None if params_first else fun
        axes = _flat_axes(in_axes, user_args, user_fun, fname) + [0] * len(tree.leaves(kwargs))
        paths = _keypaths(user_fun, user_args) + [f"kwargs{tree.keystr(p)}"
                                                  for p in tree.flatten_with_path(kwargs)[0]]
        if params_first:
            n_params = len(tree.leaves(args[0]))
            axes = [None] * n_params + axes
            paths = ["params"] * n_params + paths
        leaves, in_tree = tree.flatten((args, kwargs))
        size, dims = _check_axes(fname, leaves, axes, paths, axis_size)
        in_avals = []
        for x, d in zip(leaves, dims):
            a = typeof(x)
            shape = a.shape if d is None else a.shape[:d] + a.shape[d + 1:]
            in_avals.append(ArrayType(tuple(shape), a.dtype))
        with context.counted(context.vmap_staging), named_axis(axis_name, size):
            traced = trace_fun(fun, in_tree, in_avals)  # collectives in fun read its size
        n = len(traced.consts)
        outs, out_dims = batch_program(traced.program, traced.consts + list(leaves),
                                       [None] * n + dims, AxisData(axis_name, size))
        return _place_outputs(fname, traced.out_tree, outs, out_dims, out_axes, size)

    return batched


def _check_axes(fname, leaves, axes, paths, axis_size):
    dims, sizes = [], {}
    for x, ax, path in zip(leaves, axes, paths):
        if ax is None:
            dims.append(None)
            continue
        if not _is_axis(ax):
            raise BatchingError(
                f"vmap({fname}): the in_axes entry for {path} must be an int or None, got "
                f"{ax!r}.\nFix: use the index of the mapped axis, or None if this argument "
                "is not batched.")
        a = typeof(x)
        nd = a.ndim
        if nd == 0:
            raise BatchingError(
                f"vmap({fname}): in_axes={ax} maps {path}, but it is a scalar ({a}) and "
                "has no axis to map over.\nFix: pass in_axes=None for it (every example "
                "then sees the same value), or give it a leading batch axis.")
        if not -nd <= ax < nd:
            raise BatchingError(
                f"vmap({fname}): in_axes={ax} is out of range for {path} of type {a} "
                f"(rank {nd}).\nFix: use an axis in [{-nd}, {nd - 1}], or None to leave "
                "this argument unbatched.")
        d = ax % nd
        dims.append(d)
        sizes[path] = a.shape[d]
    distinct = set(sizes.values()) | ({axis_size} if axis_size is not None else set())
    if len(distinct) > 1:
        listing = "\n".join(f"  {p}: size {s} along in_axes={ax}"
                            for (p, s), ax in zip(sizes.items(),
                                                  [a for a in axes if a is not None]))
        if axis_size is not None:
            listing += f"\n  axis_size={axis_size}"
        raise BatchingError(
            f"vmap({fname}) got inconsistent sizes for the mapped axis:\n{listing}\nFix: "
            "every mapped argument must have the same size along its in_axes; use "
            "in_axes=None for arguments that are not batched.")
    if not distinct:
        raise BatchingError(
            f"vmap({fname}): no argument is mapped (every in_axes entry is None) and "
            "axis_size was not given, so the size of the mapped axis is unknown.\nFix: "
            "pass axis_size=N, or map at least one argument.")
    return distinct.pop(), dims


def _out_path(paths, i) -> str:
    p = tree.keystr(paths[i])
    return f"output{p}" if p else "the output"


def _place_outputs(fname, out_tree, outs, out_dims, out_axes, size):
    if isinstance(out_axes, list):
        out_axes = tuple(out_axes)
    skeleton = tree.unflatten(out_tree, list(range(len(outs))))
    try:
        flat_out_axes = tree.broadcast_prefix(out_axes, skeleton, is_leaf=lambda x: x is None)
    except ValueError:
        shown = type_tree(tree.unflatten(out_tree, list(outs)))
        raise BatchingError(
            f"vmap({fname}): out_axes={out_axes!r} is not a pytree prefix of the output, "
            f"which is {shown} (batched).\nFix: give out_axes the containers of the "
            "output with an int or None at each leaf, or one int for all of it.") from None
    paths = tree.flatten_with_path(skeleton)[0]
    result = []
    for i, (o, d, ax) in enumerate(zip(outs, out_dims, flat_out_axes)):
        if ax is None:
            if d is not None:
                raise BatchingError(
                    f"vmap({fname}): {_out_path(paths, i)} ({typeof(o)} batched) varies "
                    "along the mapped axis, but its out_axes is None, which promises a "
                    "value that is the same for every example.\nFix: give it an int "
                    "out_axes, or make it independent of the mapped inputs.")
            result.append(o)
            continue
        if not _is_axis(ax):
            raise BatchingError(
                f"vmap({fname}): the out_axes entry for {_out_path(paths, i)} must be an "
                f"int or None, got {ax!r}.")
        if d is None:
            from fshard.primitives.base import batch_to_front

            o, d = batch_to_front(o, None, size), 0
        nd = typeof(o).ndim
        if not -nd <= ax < nd:
            raise BatchingError(
                f"vmap({fname}): out_axes={ax} is out of range for {_out_path(paths, i)}, "
                f"which has rank {nd} with the mapped axis.\nFix: use an axis in "
                f"[{-nd}, {nd - 1}].")
        result.append(move_axis(o, d, ax % nd))
    # an input returned unchanged is still a NumPy array: outputs are arrays of fshard
    result = [o if isinstance(o, Tracer) else as_tensor(o) for o in result]
    return tree.unflatten(out_tree, result)
