"""``fs.vmap``: vectorise a function over a batch axis (NB: JAX's batching.py).

The function is staged once on *unbatched* types; ``batch_program`` then walks the
Program, applying each primitive's batching rule to ``(value, batch_dim)`` pairs and
binding the rule's operations into the current trace. A batched Program is
therefore vectorised, never a loop: each equation becomes one equation (plus, at
most, moves of the batch axis).

Named axes: with ``axis_name``, collectives over that name (``fs.psum(x, "i")``) are
handled by their batching rules, which read the axis being batched from
``current_axis()``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

from fshard import tree
from fshard.core import ArrayType, bind, typeof
from fshard.errors import BatchingError
from fshard.interpret import equation_note
from fshard.ir import Literal, Program
from fshard.primitives._batching import move_axis
from fshard.rules import batching
from fshard.staging import fun_name, trace_fun


@dataclass(frozen=True)
class AxisData:
    """The axis a batching interpreter is mapping over."""

    name: object  # the axis_name, or None
    size: int


_axis_stack: list[AxisData] = []
_staging_depth = 0  # > 0 while a function is being staged for vmap


def inside_vmap() -> bool:
    """Whether code runs while being staged for ``vmap`` (``shard`` must not)."""
    return _staging_depth > 0


def current_axis() -> AxisData:
    """The axis of the innermost ``batch_program`` running now (for collectives)."""
    assert _axis_stack, "current_axis() called outside a batching rule"
    return _axis_stack[-1]


@contextlib.contextmanager
def _axis(data: AxisData):
    _axis_stack.append(data)
    try:
        yield
    finally:
        _axis_stack.pop()


def batch_program(program: Program, args: list, dims: list, axis: AxisData):
    """Evaluate ``program`` on batched ``args`` (batch dim per arg, or None).

    Returns ``(outs, out_dims)``.
    """
    env = dict(zip(program.inputs, zip(args, dims), strict=True))

    def read(a):
        return (a.value, None) if isinstance(a, Literal) else env[a]

    with _axis(axis):
        for eq in program.equations:
            vals, ds = zip(*[read(a) for a in eq.inputs]) if eq.inputs else ((), ())
            try:
                if all(d is None for d in ds) and "axis_name" not in eq.params:
                    outs = bind(eq.prim, *vals, **eq.params)
                    outs = outs if eq.prim.multiple_results else [outs]
                    out_ds = [None] * len(outs)
                else:
                    rule = batching.lookup(eq.prim, transform="vmap")
                    outs, out_ds = rule(list(vals), list(ds), **eq.params)
            except Exception as e:
                e.add_note(equation_note(eq, "batching"))
                raise
            for v, o, d in zip(eq.outputs, outs, out_ds, strict=True):
                env[v] = (o, d)
    outs = [read(a) for a in program.outputs]
    return [o for o, _ in outs], [d for _, d in outs]


def _flat_axes(in_axes, args, fname):
    """One in-axis per leaf of ``args`` from the prefix tree ``in_axes``."""
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    if not isinstance(in_axes, tuple):
        in_axes = (in_axes,) * len(args)
    if len(in_axes) != len(args):
        raise BatchingError(
            f"vmap({fname}): in_axes has {len(in_axes)} entries but the function was called "
            f"with {len(args)} positional arguments.\nFix: give in_axes one entry per "
            "positional argument (a pytree prefix of it), or a single int for all.")
    try:
        return tree.broadcast_prefix(in_axes, args, is_leaf=lambda x: x is None)
    except ValueError as e:
        raise BatchingError(
            f"vmap({fname}): in_axes is not a pytree prefix of the arguments: {e}\nFix: make "
            "in_axes mirror the structure of the arguments (use None for unbatched parts)."
        ) from None


def _keypaths(args) -> list[str]:
    paths, _, _ = tree.flatten_with_path(args)
    return [f"args{tree.keystr(p)}" for p in paths]


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
    from fshard.cells import maybe_cell

    if not callable(fun):
        raise BatchingError(f"vmap expects a function, got {type(fun).__name__}.")
    return maybe_cell(fun, lambda f: _vmap(f, in_axes, out_axes, axis_name, axis_size))


def _vmap(fun, in_axes, out_axes, axis_name, axis_size):
    fname = fun_name(fun)

    @functools.wraps(fun)
    def batched(*args, **kwargs):
        axes = _flat_axes(in_axes, args, fname) + [0] * len(tree.leaves(kwargs))
        leaves, in_tree = tree.flatten((args, kwargs))
        paths = _keypaths(args) + [f"kwargs{tree.keystr(p)}"
                                   for p in tree.flatten_with_path(kwargs)[0]]
        size, dims = _check_axes(fname, leaves, axes, paths, axis_size)
        in_avals = []
        for x, d in zip(leaves, dims):
            a = typeof(x)
            shape = a.shape if d is None else a.shape[:d] + a.shape[d + 1:]
            in_avals.append(ArrayType(tuple(shape), a.dtype))
        global _staging_depth
        _staging_depth += 1
        try:
            traced = trace_fun(fun, in_tree, in_avals)
        finally:
            _staging_depth -= 1
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
        if not isinstance(ax, int) or isinstance(ax, bool):
            raise BatchingError(
                f"vmap({fname}): in_axes for {path} must be an int or None, got {ax!r}.")
        nd = typeof(x).ndim
        if not -nd <= ax < nd:
            raise BatchingError(
                f"vmap({fname}): in_axes={ax} is out of range for {path} of type "
                f"{typeof(x)} (rank {nd}).\nFix: use an axis in [{-nd}, {nd - 1}], or None "
                "to leave this argument unbatched.")
        d = ax % nd
        dims.append(d)
        sizes[path] = typeof(x).shape[d]
    distinct = set(sizes.values()) | ({axis_size} if axis_size is not None else set())
    if len(distinct) > 1:
        listing = "\n".join(f"  {p}: axis size {s}" for p, s in sizes.items())
        if axis_size is not None:
            listing += f"\n  axis_size={axis_size}"
        raise BatchingError(
            f"vmap({fname}) got inconsistent sizes for the mapped axis:\n{listing}\nFix: "
            "every mapped argument must have the same size along its in_axes; use "
            "in_axes=None for arguments that are not batched.")
    if not distinct:
        raise BatchingError(
            f"vmap({fname}): no argument is mapped (all in_axes are None) and axis_size "
            "was not given.\nFix: pass axis_size=N, or map at least one argument.")
    return distinct.pop(), dims


def _place_outputs(fname, out_tree, outs, out_dims, out_axes, size):
    if isinstance(out_axes, list):
        out_axes = tuple(out_axes)
    try:
        flat_out_axes = tree.broadcast_prefix(
            out_axes, tree.unflatten(out_tree, list(range(len(outs)))),
            is_leaf=lambda x: x is None)
    except ValueError as e:
        raise BatchingError(
            f"vmap({fname}): out_axes is not a pytree prefix of the outputs: {e}") from None
    result = []
    for i, (o, d, ax) in enumerate(zip(outs, out_dims, flat_out_axes)):
        if ax is None:
            if d is not None:
                raise BatchingError(
                    f"vmap({fname}): output {i} varies along the mapped axis but its "
                    "out_axes is None.\nFix: give it an int out_axes, or make it not "
                    "depend on mapped inputs.")
            result.append(o)
            continue
        if d is None:
            from fshard.primitives._batching import batch_to_front

            o, d = batch_to_front(o, None, size), 0
        nd = typeof(o).ndim
        if not -nd <= ax < nd:
            raise BatchingError(
                f"vmap({fname}): out_axes={ax} is out of range for output {i} of rank {nd}.")
        result.append(move_axis(o, d, ax % nd))
    return tree.unflatten(out_tree, result)
