"""Layouts users write inside a sharded function, recorded as ``layout_constraint``
equations (fshard/primitives/spmd.py; fshard/sharding/constraints.py plans them):

- ``Primitive.shard(in_strategy, out_strategy)`` on a MindSpore operator called in a
  traced Cell or function (``operator_call``, from fshard/adapter/interop.py): its operands and
  outputs get those layouts, and the operator runs with exactly that strategy;
- an ``fs.shard(f, in_strategy, out_strategy)`` called inside ``fs.AutoParallel``'s
  loss (``annotated_call``, from transforms/shard.py): ``f``'s arguments and results
  get those layouts, ``f`` itself is traced inline (MindSpore's functional shard
  inside a network under semi-auto parallel).

They take effect only while ``fs.shard`` (or ``fs.AutoParallel``, which uses it) stages
a function. Elsewhere (eager code, ``jit``, ``vmap``, the ``grad`` family) a strategy
has no meaning, and, as in MindSpore's PyNative mode, nothing happens.
"""

from __future__ import annotations

import itertools
import math
import warnings

from fshard.core import context, tree
from fshard.core.tracing import Tracer, typeof
from fshard.errors import OperatorStrategyWarning, ShardingError
from fshard.meshes.layout import Layout
from fshard.primitives.spmd import layout_constraint
from fshard.sharding.layouts import ShardMesh
from fshard.sharding.strategy import (argument_strategies, is_strategy_leaf, parse_strategy,
                                      plural)

# One id per annotated call, tying its constraints together (like ir's Var ids).
_groups = itertools.count(1)


def shard_devices() -> int | None:
    """The device count of the ``fs.shard`` staging the running code, or None."""
    stack = context.shard_devices.get()
    return stack[-1] if stack else None


def operator_strategy(prim) -> dict | None:
    """The strategies ``Primitive.shard`` stored on a MindSpore primitive (its
    ``in_strategy``/``out_strategy`` or ``in_layout``/``out_layout`` attributes)."""
    attrs = getattr(prim, "attrs", None)
    if not isinstance(attrs, dict):
        return None
    found = {k: attrs[k] for k in ("in_strategy", "out_strategy", "in_layout", "out_layout")
             if attrs.get(k) is not None}
    return found or None


def _is_array(a) -> bool:
    return isinstance(a, Tracer) or (hasattr(a, "shape") and hasattr(a, "dtype")
                                     and hasattr(a, "asnumpy"))


def _as_layout(entry: dict):
    """MindSpore's stored layout (``device_matrix``, ``tensor_map`` counted from the
    right, ``alias_name``) as an ``fs.Layout`` view."""
    dev, names = tuple(entry["device_matrix"]), tuple(entry["alias_name"])

    def name(i):
        return "None" if i == -1 else names[len(dev) - 1 - i]

    spec = [tuple(name(i) for i in m) if isinstance(m, (tuple, list)) else name(m)
            for m in entry["tensor_map"]]
    return Layout(dev, names)(*spec)


def _strategies(found: dict) -> tuple:
    """``(in_strategy, out_strategy)`` as written: tuples of split counts or of
    ``fs.Layout`` views (None where not given)."""
    ins, outs = found.get("in_strategy"), found.get("out_strategy")
    if "in_layout" in found:
        ins = tuple(_as_layout(e) for e in found["in_layout"])
    if "out_layout" in found:
        outs = tuple(_as_layout(e) for e in found["out_layout"])
    return ins, outs


def _interleaved(found: dict) -> bool:
    return any(e.get("interleaved_parallel") for key in ("in_layout", "out_layout")
               for e in found.get(key, ()))


def _describe(found: dict) -> str:
    if _interleaved(found):  # no fs.Layout form: MindSpore's stored attributes
        return ", ".join(f"{k}={found[k]!r}" for k in ("in_layout", "out_layout") if k in found)
    ins, outs = _strategies(found)
    return repr(ins) + (f", out_strategy={outs!r}" if outs is not None else "")


def _constrain(x, entry, n: int, where: str, what: str, origin: str, group: int,
               role: tuple):
    sh = parse_strategy(entry, typeof(x), ShardMesh.for_devices(n), where, what)
    if sh is None:
        return x
    mesh = ShardMesh.for_devices(n)
    return layout_constraint(x, sh.dims, sh.strategy(mesh), n, origin, group, role,
                             exact=isinstance(entry, Layout))


def _user_warning(message: str, user_frame) -> None:
    if user_frame is None:
        warnings.warn(message, OperatorStrategyWarning, stacklevel=3)
        return
    warnings.warn_explicit(message, OperatorStrategyWarning, user_frame.f_code.co_filename,
                           user_frame.f_lineno, module=user_frame.f_globals.get("__name__"),
                           registry=user_frame.f_globals.setdefault("__warningregistry__", {}))


def operator_call(prim, args, kwargs, convert, user_frame):
    """``convert(*args, **kwargs)`` (the fshard form of a MindSpore operator call) with
    the operator's ``Primitive.shard`` strategy applied, when an ``fs.shard`` stages the
    call (see the module docstring)."""
    found = operator_strategy(prim)
    if found is None:
        return convert(*args, **kwargs)
    n = shard_devices()
    if n is None:
        if context.shard_map_depth.get():
            _user_warning(
                f"fshard does not apply the strategy of {prim.name}.shard("
                f"{_describe(found)}): inside fs.shard_map the function is already the "
                "per-device program, whose operators run on local blocks.\nFix: give "
                "layouts to fs.shard_map's in_strategy/out_strategy, or use fs.shard (or "
                "fs.AutoParallel) around the Cell; drop the .shard(...) call to silence this.",
                user_frame)
        elif context.shard_annotations.get():  # an AutoParallel pipeline's stages
            _user_warning(
                f"fshard does not apply the strategy of {prim.name}.shard("
                f"{_describe(found)}): with AutoParallel.pipeline(...) each stage here has "
                "one device, so there is nothing to split.\nFix: give the stages several "
                "devices each (a mesh of more devices than stages) to apply it; drop the "
                ".shard(...) call to silence this.", user_frame)
        return convert(*args, **kwargs)
    line = (f" at {user_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{user_frame.f_lineno}"
            if user_frame is not None else "")
    origin = f"{prim.name}.shard({_describe(found)}){line}"
    if _interleaved(found):
        _user_warning(
            f"fshard does not apply the strategy of {origin}: its Layout uses "
            "interleaved_parallel (Ascend's micro-interleaving of one device's work), which "
            "fshard has no counterpart of; propagation lays the operator out.\nFix: build "
            "the Layout without 'interleaved_parallel'.", user_frame)
        return convert(*args, **kwargs)
    group = next(_groups)
    arrays = [k for k, a in enumerate(args) if _is_array(a)]
    ins, outs = _strategies(found)
    args = list(args)
    if ins is not None:
        if len(ins) != len(arrays):
            raise ShardingError(
                f"{origin}: the strategy has {plural(len(ins), 'entry', 'entries')}, but "
                f"{prim.name} was called "
                f"with {len(arrays)} tensor operand{'s' if len(arrays) != 1 else ''} "
                f"({', '.join(str(typeof(args[k])) for k in arrays)}).\nRule: in_strategy "
                "gives one tuple of split counts per tensor operand, in order.\nFix: give "
                f"{len(arrays)} entries.")
        for j, (k, entry) in enumerate(zip(arrays, ins)):
            args[k] = _constrain(args[k], entry, n, f"{origin}: in_strategy[{j}]",
                                 f"operand {j} ({typeof(args[k])})", origin, group,
                                 ("in", j, len(arrays)))
    out = convert(*args, **kwargs)
    if outs is None:
        return out
    results = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(outs) != len(results):
        raise ShardingError(
            f"{origin}: out_strategy has {plural(len(outs), 'entry', 'entries')}, but "
            f"{prim.name} returns "
            f"{len(results)} output{'s' if len(results) != 1 else ''}.\nFix: give one "
            "strategy per output.")
    results = [_constrain(r, e, n, f"{origin}: out_strategy[{j}]", f"output {j} "
                          f"({typeof(r)})", origin, group, ("out", j, len(results)))
               for j, (r, e) in enumerate(zip(results, outs))]
    return type(out)(results) if isinstance(out, (tuple, list)) else results[0]


def annotated_call(fn, fname: str, args, in_strategy, out_strategy):
    """``fn(*args)`` traced inline inside ``fs.AutoParallel``'s step, its arguments and
    results constrained to ``in_strategy``/``out_strategy`` (pytree prefixes, None:
    left to the plan)."""
    n = shard_devices()
    group = next(_groups)
    origin = f"fs.shard({fname}, in_strategy={in_strategy!r}" + (
        f", out_strategy={out_strategy!r})" if out_strategy is not None else ")")
    flat = []  # (argument, path, leaf, strategy) of every leaf of every argument
    structures = []
    for i, (a, s) in enumerate(zip(args, in_strategy)):
        paths, leaves, structure, per_leaf = argument_strategies(origin, i, s, a)
        flat += [(i, p, x, e) for p, x, e in zip(paths, leaves, per_leaf)]
        structures.append((structure, len(leaves)))
    # Role ("arg", k, n): the k-th of the n leaves, so the equation consuming them all
    # in order runs on them (fshard/sharding/constraints.py).
    leaves = [_constrain(x, e, n, f"{origin}: in_strategy[{i}]{tree.keystr(p)}",
                         f"argument {i}{tree.keystr(p)} ({typeof(x)})", origin, group,
                         ("arg", k, len(flat))) if isinstance(x, Tracer) else x
              for k, (i, p, x, e) in enumerate(flat)]
    new_args, start = [], 0
    for structure, count in structures:
        new_args.append(tree.unflatten(structure, leaves[start:start + count]))
        start += count
    out = fn(*new_args)
    if out_strategy is None:
        return out
    paths, leaves, structure = tree.flatten_with_path(out)
    strat = out_strategy
    if len(leaves) == 1 and isinstance(strat, (tuple, list)) and not is_strategy_leaf(strat) \
            and len(strat) == 1 and not isinstance(out, (tuple, list)):
        strat = strat[0]  # MindSpore's 1-tuple for a single output
    try:
        per_leaf = tree.broadcast_prefix(strat, out, is_leaf=is_strategy_leaf)
    except ValueError as e:
        raise ShardingError(
            f"{origin}: out_strategy = {out_strategy!r} does not match the outputs of "
            f"{fname}: {e}\nFix: give a pytree prefix of the outputs.") from None
    leaves = [_constrain(x, e, n, f"{origin}: out_strategy{tree.keystr(p)}",
                         f"output{tree.keystr(p)} ({typeof(x)})", origin, group,
                         ("result", k, len(leaves))) if isinstance(x, Tracer) else x
              for k, (p, x, e) in enumerate(zip(paths, leaves, per_leaf))]
    return tree.unflatten(structure, leaves)


def with_sharding_constraint(x, strategy):
    """``x`` (a pytree of arrays), whose layout ``fs.shard`` must make ``strategy``
    (NB: ``jax.lax.with_sharding_constraint``).

    Inside a function staged by ``fs.shard`` (or ``fs.jit(..., in_shardings=...)``,
    ``fs.AutoParallel``), the value gets exactly that layout and propagation lays out
    the rest around it; the value itself is unchanged. Anywhere else (eager code,
    ``fs.jit`` alone, ``fs.vmap``, the ``grad`` family) it is the identity, as in
    MindSpore's PyNative mode.

    >>> import numpy as np, fshard as fs
    >>> def f(x, w):
    ...     h = fs.with_sharding_constraint(x @ w, (4, 1))  # rows split 4 ways
    ...     return fs.ops.relu(h)
    >>> x, w = np.ones((8, 4), np.float32), np.ones((4, 2), np.float32)
    >>> sharded = fs.shard(f, in_strategy=(None, None), mesh=4)
    >>> sharded(x, w).shape
    (8, 2)
    >>> [e["out_strategy"] for e in sharded.strategies(x, w)["equations"]
    ...  if e["primitive"] == "layout_constraint"]
    [[[4, 1]]]
    >>> f(x, w).shape  # unsharded: the identity
    (8, 2)

    Args:
        x: a pytree of arrays.
        strategy: split counts per dimension (``(4, 1)``), an ``fs.Layout`` view, or
            None (no constraint); or a pytree prefix of ``x`` holding them.

    Raises:
        ShardingError: a strategy that does not fit the value or the mesh.
    """
    paths, leaves, structure = tree.flatten_with_path(x)
    try:
        per_leaf = tree.broadcast_prefix(strategy, x, is_leaf=is_strategy_leaf)
    except ValueError as e:
        raise ShardingError(
            f"fs.with_sharding_constraint: the strategy {strategy!r} does not match x's "
            f"structure {tree.structure(x)}: {e}\nFix: give one strategy, or a pytree "
            "prefix of x holding strategies.") from None
    n = shard_devices()
    if n is None:  # not being sharded: check the strategy's form, change nothing
        for p, leaf, e in zip(paths, leaves, per_leaf):
            if e is None or isinstance(e, Layout):
                continue
            counts = e if isinstance(e, (tuple, list)) and all(
                isinstance(c, int) and c > 0 for c in e) else ()
            parse_strategy(e, typeof(leaf), ShardMesh.for_devices(math.prod(counts)),
                           f"fs.with_sharding_constraint: strategy{tree.keystr(p)}",
                           f"x{tree.keystr(p)} ({typeof(leaf)})")
        return x
    out = []
    for p, leaf, e in zip(paths, leaves, per_leaf):
        where = f"fs.with_sharding_constraint: strategy{tree.keystr(p)}"
        what = f"x{tree.keystr(p)} ({typeof(leaf)})"
        out.append(_constrain(leaf, e, n, where, what, f"fs.with_sharding_constraint(x, "
                              f"{e!r})", next(_groups), ("value", 0, 1)))
    return tree.unflatten(structure, out)
