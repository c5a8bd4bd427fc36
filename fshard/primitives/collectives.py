"""Collectives: communication over named mesh axes (NB: JAX's ``lax.parallel``).

``psum``, ``pmean``, ``pmax``, ``pmin``, ``all_gather``, ``psum_scatter``,
``all_to_all``, ``ppermute``, ``broadcast`` and ``axis_index`` name one mesh axis or
a tuple of them (``axis_name``, always stored as a tuple). They have a meaning only
where those names are bound: inside ``fs.shard_map`` (the mesh axes) or
``fs.vmap(..., axis_name=...)``. Each primitive carries all of its rules:

- **type**; shapes that depend on the axis size read it when the collective is
  staged (``axis_sizes``), from the enclosing ``named_axis`` environment;
- **batching** is how a virtual mesh runs a collective: when the batching
  interpreter's current axis is one of the collective's names, the collective
  becomes array ops over the batch dimension; the other names are re-bound, so an
  outer interpreter handles them;
- **JVP and transpose** with per-device *true transposes*: ``psum^T = psum``,
  ``all_gather^T = psum_scatter``, ``all_to_all^T`` swaps its axes, ``ppermute^T``
  inverts the permutation. Differentiation inside ``shard_map`` adds the two
  boundary rules of replicated values (``seed_cotangents``/``input_cotangents``,
  primitives ``replica_split``/``replica_sum``). docs/collectives.md has the
  convention and why;
- **eager impl**: with no axis bound it raises ``AxisNameError``; inside a
  multi-process job (the equation carries a real ``mesh``) it runs the collective as
  a one-equation compiled graph;
- **lowering** for one rank of a multi-process job, through the backend's ``Comm``
  (fshard/backend/collectives.py): MindSpore's own ops where the backend has them
  (``NATIVE_COLLECTIVES``), else the emulations verified on CPU. Every rank lowers
  the same Program; ranks differ only by baked-in constants, so every rank issues the
  same sequence of collectives.

``after`` and ``keep`` keep a collective in the program of a rank whose result does
not read it (in a job, where each rank traces its own program: MindSpore's
NeighborExchange), so that the rank still takes part, also in the backward pass.

The boundary primitives of a multi-process ``shard_map`` (``shard_in``: this rank's
block of a global value; ``shard_out``: the global value from the blocks) live here
too, with the same lowering helpers. This module imports no transform at import time.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import numpy as np

from fshard.core import context, dtypes
from fshard.core.array_types import Array, ArrayTree, Int32, Shaped
from fshard.core.tracing import ArrayType, Primitive, typeof
from fshard.core.dims import dim_multiple_of
from fshard.errors import (ArgumentError, AxisNameError, ProgramTypeError, ShapeError,
                           UnsupportedOpError)
from fshard.backend import mindspore as backend
from fshard.backend.collectives import Comm, local_slice, this_rank
from fshard.core.interpret import AxisData, batch_program, current_axis
from fshard.primitives.base import (UndefinedPrimal, Zero, batch_to_front, def_primitive,
                                    deflinear, instantiate, lane_sum, move_axis, zeros)
from fshard.core.rules import abstract_eval, batching, jvp, transpose, unsupported

FAMILY = "collectives"

# ---------------------------------------------------------------------------
# Axis names and the environment of bound axes
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def named_axis(name, size: int) -> Iterator[None]:
    """Bind ``name`` (of ``size`` devices) while a function is staged, so collectives
    staged in it know the axis size. ``fs.vmap(axis_name=...)`` and ``fs.shard_map``
    use it; so should any interpreter that later batches over a named axis.

    >>> with named_axis("i", 4):
    ...     axis_size("i")
    4
    """
    if name is None:
        yield
        return
    with context.pushed(context.named_axes, AxisData(name, size)):
        yield


def bound_axes() -> list:
    """Every named axis bound here: staged ones and the one being batched (innermost last)."""
    return list(context.named_axes.get()) + [a for a in context.batch_axes.get()
                                             if a.name is not None]


def _bound_names() -> str:
    names = []
    for a in bound_axes():
        if a.name not in names:
            names.append(a.name)
    return ", ".join(f"{n!r} (size {s})" for n, s in (
        (n, axis_size(n)) for n in names)) or "none"


def axis_size(name) -> int:
    """The size of the bound axis ``name`` (innermost binding wins).

    Raises:
        AxisNameError: no enclosing shard_map or vmap binds ``name``.
    """
    for a in reversed(bound_axes()):
        if a.name == name:
            return a.size
    raise AxisNameError(_unbound_message("axis_size", (name,)))


def _unbound_message(api: str, names) -> str:
    missing = ", ".join(repr(n) for n in names)
    shown = repr(names[0]) if len(names) == 1 else repr(tuple(names))
    return (
        f"fs.{api} names the axis {missing}, but no enclosing fs.shard_map or "
        f"fs.vmap binds it (bound axes: {_bound_names()}). A collective communicates "
        "between the devices of a mesh axis, so it only has a meaning inside a function "
        "mapped over that axis.\nFix: call it inside fs.shard_map(f, in_strategy, "
        f"out_strategy, mesh=fs.Mesh((n,), ({shown},))), or inside "
        f"fs.vmap(f, axis_name={shown}); or use one of the bound axis names.")


def _norm_names(axis_name, api: str) -> tuple:
    """``axis_name`` as a non-empty tuple of distinct hashable names."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    ok = bool(names) and all(n is not None and not isinstance(n, (tuple, list, dict, set))
                             for n in names)
    if ok:
        try:
            ok = len(set(names)) == len(names)
        except TypeError:
            ok = False
    if not ok:
        raise ArgumentError(
            f"fs.{api}: axis_name must be a mesh axis name or a non-empty tuple of distinct "
            f"names, got {axis_name!r}.\nFix: e.g. fs.{api}(x, 'dp') or "
            f"fs.{api}(x, ('dp', 'mp')).")
    return names


def _sizes(names: tuple, api: str) -> tuple:
    """Sizes of the bound axes ``names``, read when a collective is staged."""
    env = {}
    for a in bound_axes():
        env[a.name] = a.size
    missing = [n for n in names if n not in env]
    if missing:
        raise AxisNameError(_unbound_message(api, missing))
    return tuple(env[n] for n in names)


# ---------------------------------------------------------------------------
# Declaring a collective
# ---------------------------------------------------------------------------


def _declare(name: str, type_rule: Callable, lower: Callable) -> Primitive:
    prim = _PRIMS[name] = def_primitive(name, FAMILY, type_rule, lower=lower, eager=_eager(name))
    unsupported(prim, "sharding", "a collective already runs per device: fs.shard inserts "
                "collectives, it does not partition them")
    return prim


def _eager(name: str):
    """A collective runs eagerly only inside a multi-process job (its equation then
    carries the job's mesh), as a one-equation compiled graph."""
    def run(*args, **params):
        mesh = params.get("mesh")
        if mesh is not None and not getattr(mesh, "is_virtual", True):
            return _run_compiled(_PRIMS[name], args, params)
        if "axis_name" not in params:  # shard_in / shard_out
            raise AxisNameError(
                f"{name} is the boundary of a multi-process fs.shard_map and runs only "
                f"inside a job, on the mesh of the job's world; here its mesh is {mesh!r}.\n"
                "Fix: call the shard_map itself; it inserts these where they apply.")
        raise AxisNameError(_unbound_message(name, params["axis_name"]))

    return run


_PRIMS: dict = {}  # name -> the collective primitive (filled as they are declared)


_compiled: dict = {}


def _run_compiled(prim: Primitive, args, params) -> list:
    """Run one equation as its own compiled graph (a collective executed eagerly
    inside a multi-process job; MindSpore's PyNative collectives are not used)."""
    from fshard.backend import mindspore as backend
    from fshard.core.ir import Equation, Program, Var

    avals = tuple(typeof(a) for a in args)
    key = (prim.name, avals, tuple(sorted(params.items(), key=lambda kv: kv[0])))
    fn = _compiled.get(key)
    if fn is None:
        ins = [Var(a) for a in avals]
        outs = [Var(a) for a in abstract_eval.lookup(prim, transform="eager")(*avals, **params)]
        program = Program(ins, [Equation(prim, ins, dict(params), outs)], outs)
        src, globals_, _ = backend.lower_program(program, [], name=prim.name)
        fn = _compiled[key] = backend.compile_source(src, globals_, prim.name)
    out = fn(*[backend.as_tensor(a) for a in args])
    return [out]


def _same(x: ArrayType, **_) -> ArrayType:
    return x


def _dim_type(api):
    def check(x: ArrayType, dim: int, what: str):
        if not (isinstance(dim, int) and 0 <= dim < x.ndim):
            raise ProgramTypeError(f"{api}: {what}={dim!r} is not an axis of {x}")
    return check


def _total(axis_sizes) -> int:
    return int(math.prod(axis_sizes))


def _current():
    return current_axis()


def _others(names: tuple, name) -> tuple:
    return tuple(n for n in names if n != name)


def _others_sizes(names: tuple, sizes: tuple, name) -> tuple:
    return tuple(s for n, s in zip(names, sizes) if n != name)


# ---------------------------------------------------------------------------
# psum, pmean, pmax, pmin: reductions over devices
# ---------------------------------------------------------------------------


def _reduce_batching(prim, reduce_lanes):
    """Batching of a reduction over devices: reduce the lanes of the current axis,
    re-bind the rest. The result is the same on every lane (unbatched)."""

    def rule(args, dims, *, axis_name, **params):
        (x,), (d,) = args, dims
        axis = _current()
        if axis.name not in axis_name:
            return [prim.bind(x, axis_name=axis_name, **params)], [d]
        y = reduce_lanes(x, d, axis.size)
        rest = _others(axis_name, axis.name)
        if rest:
            y = prim.bind(y, axis_name=rest, **params)
        return [y], [None]

    return rule


def _sum_lanes(x, d, n):
    from fshard.primitives.elementwise import mul

    if d is None:  # the same value on every device: the sum is n copies
        return mul(x, _scalar(n, x))
    # lane_sum, not reduce_sum: the sums of a psum over several mesh axes (one per
    # axis) merge into one (passes.merge_lane_sums), never with the program's own.
    return lane_sum(x, (d,))


def _mean_lanes(x, d, n):
    from fshard.primitives.reductions import mean

    return x if d is None else mean(x, d)


def _max_lanes(x, d, n):
    from fshard.primitives.reductions import reduce_max

    return x if d is None else reduce_max(x, d)


def _min_lanes(x, d, n):
    from fshard.primitives.reductions import reduce_min

    return x if d is None else reduce_min(x, d)


def _scalar(v, like):
    """``v`` as a NumPy scalar of ``like``'s dtype (keeps the operand's dtype)."""
    return dtypes.to_numpy(typeof(like).dtype).type(v)


def _lower_psum(ctx, x, *, axis_name, **params):
    comm = Comm(ctx, axis_name, params, "psum")
    return x if comm.n == 1 else comm.all_reduce(x, dtype=ctx.in_avals[0].dtype)


def _lower_pmean(ctx, x, *, axis_name, **params):
    comm = Comm(ctx, axis_name, params, "pmean")
    return x if comm.n == 1 else comm.mean(x, ctx.in_avals[0].dtype)


def _lower_pminmax(kind):
    def lower(ctx, x, *, axis_name, **params):
        comm = Comm(ctx, axis_name, params, f"p{kind}")
        return x if comm.n == 1 else comm.extremum(x, ctx.in_avals[0], kind)

    return lower


psum_p = _declare("psum", _same, _lower_psum)
pmean_p = _declare("pmean", _same, _lower_pmean)
pmax_p = _declare("pmax", _same, _lower_pminmax("max"))
pmin_p = _declare("pmin", _same, _lower_pminmax("min"))

batching.set(psum_p, _reduce_batching(psum_p, _sum_lanes))
batching.set(pmean_p, _reduce_batching(pmean_p, _mean_lanes))
batching.set(pmax_p, _reduce_batching(pmax_p, _max_lanes))
batching.set(pmin_p, _reduce_batching(pmin_p, _min_lanes))


def _self_transpose(prim):
    """psum^T = psum and pmean^T = pmean: the per-device maps are symmetric."""

    def rule(ct, x, **params):
        if isinstance(ct, Zero):
            return [Zero(x.aval)]
        return [prim.bind(ct, **params)]

    return rule


deflinear(psum_p, _self_transpose(psum_p))
deflinear(pmean_p, _self_transpose(pmean_p))


def _pminmax_jvp(prim):
    """d pmax(x) = the tangent of the device holding the max (ties share equally)."""

    def rule(primals, tangents, **params):
        from fshard.primitives.elementwise import cast, div, equal, mul

        (x,), (t,) = primals, tangents
        ans = prim.bind(x, **params)
        if isinstance(t, Zero):
            return [ans], [Zero(typeof(ans))]
        hit = cast(equal(x, ans), typeof(x).dtype)
        num = psum_p.bind(mul(t, hit), **params)
        count = psum_p.bind(hit, **params)
        return [ans], [div(num, count)]

    return rule


jvp.set(pmax_p, _pminmax_jvp(pmax_p))
jvp.set(pmin_p, _pminmax_jvp(pmin_p))
unsupported(pmax_p, "transpose", "not linear")
unsupported(pmin_p, "transpose", "not linear")

# ---------------------------------------------------------------------------
# all_gather (tiled): concatenate every device's block along `axis`
# ---------------------------------------------------------------------------


def _all_gather_type(x, *, axis_name, axis_sizes, axis, **_):
    _dim_type("all_gather")(x, axis, "axis")
    shape = list(x.shape)
    shape[axis] = shape[axis] * _total(axis_sizes)
    return ArrayType(tuple(shape), x.dtype)


def _lanes_into_dim(x, k: int):
    """``x`` of shape (n, ..., L at k+1, ...) -> (..., n*L at k, ...), lane-major."""
    from fshard.primitives.structural import reshape

    shape = typeof(x).shape
    x = move_axis(x, 0, k)
    return reshape(x, tuple(shape[1:k + 1]) + (shape[0] * shape[k + 1],) + tuple(shape[k + 2:]))


def _regroup(y, k: int, outer: int, inner: int, mid: int):
    """Dim ``k`` of ``y`` is laid out (outer, inner, mid, rest): make it (outer, mid,
    inner, rest). Used when the current axis sits between other gathered axes."""
    from fshard.primitives.structural import reshape, transpose as tr

    shape = typeof(y).shape
    rest = shape[k] // (outer * inner * mid)
    split = tuple(shape[:k]) + (outer, inner, mid, rest) + tuple(shape[k + 1:])
    y = reshape(y, split)
    perm = list(range(len(split)))
    perm[k + 1], perm[k + 2] = perm[k + 2], perm[k + 1]
    y = tr(y, tuple(perm))
    return reshape(y, tuple(shape))


def _all_gather_batching(args, dims, *, axis_name, axis_sizes, axis, **params):
    (x,), (d,) = args, dims
    cur = _current()
    if cur.name not in axis_name:
        if d is None:
            return [all_gather_p.bind(x, axis_name=axis_name, axis_sizes=axis_sizes,
                                      axis=axis, **params)], [None]
        x = move_axis(x, d, 0)
        return [all_gather_p.bind(x, axis_name=axis_name, axis_sizes=axis_sizes,
                                  axis=axis + 1, **params)], [0]
    j = axis_name.index(cur.name)
    n = axis_sizes[j]
    y = _lanes_into_dim(batch_to_front(x, d, n), axis)
    rest = _others(axis_name, cur.name)
    if rest:
        rest_sizes = _others_sizes(axis_name, axis_sizes, cur.name)
        y = all_gather_p.bind(y, axis_name=rest, axis_sizes=rest_sizes, axis=axis, **params)
        n_pre, n_post = _total(axis_sizes[:j]), _total(axis_sizes[j + 1:])
        if n_post > 1:  # gathered as (pre, post, n): the order must be (pre, n, post)
            y = _regroup(y, axis, n_pre, n_post, n)
    return [y], [None]


def _lower_all_gather(ctx, x, *, axis_name, axis_sizes, axis, **params):
    comm = Comm(ctx, axis_name, params, "all_gather")
    return comm.all_gather(x, ctx.in_avals[0], axis)


def _all_gather_transpose(ct, x, *, axis_name, axis_sizes, axis, **params):
    if isinstance(ct, Zero):
        return [Zero(x.aval)]
    return [psum_scatter_p.bind(ct, axis_name=axis_name, axis_sizes=axis_sizes,
                                scatter_dimension=axis, **params)]


all_gather_p = _declare("all_gather", _all_gather_type, _lower_all_gather)
batching.set(all_gather_p, _all_gather_batching)
deflinear(all_gather_p, _all_gather_transpose)

# ---------------------------------------------------------------------------
# after, keep: a collective's value kept on a rank whose result does not use it
# ---------------------------------------------------------------------------
#
# In a job each rank traces its own program (MindSpore's NeighborExchange names its
# peers per rank), and a rank whose result does not read a collective would drop it
# (dce, MindSpore's pruning) while the other ranks wait in it. ``after(x, dep)`` is
# ``x``, computed once ``dep`` is: whatever reads ``x`` keeps the collective. It is
# linear in both operands, and its transpose gives ``dep`` a zero cotangent that is
# instantiated, not symbolic, so the collective's own transpose runs on this rank as
# it does on the others. ``keep(dep)`` is the same with no value to hang ``dep`` on:
# an effect (never dropped; the program's outputs wait for it).


def _lower_after(ctx, x, dep):
    return ctx.call(backend.depend, x, dep)


def _after_transpose(ct, x, dep):
    # dep's zeros are computed from ct: a constant would let a collective transposed
    # from it run eagerly, while tracing, on this rank alone
    zero = after_p.bind(zeros(dep.aval.shape, dep.aval.dtype), ct)
    return [ct if isinstance(x, UndefinedPrimal) else None,
            zero if isinstance(dep, UndefinedPrimal) else None]


after_p = def_primitive("after", FAMILY, lambda x, dep: x, lower=_lower_after,
                        eager=lambda x, dep: [x])
deflinear(after_p, _after_transpose)
batching.set(after_p, lambda args, dims: ([after_p.bind(*args)], [dims[0]]))
unsupported(after_p, "sharding", "it orders a job's per-rank collectives; fs.shard does not "
            "partition it")


def _lower_keep(ctx, dep, *, refusal):
    ctx.effectful = True  # the effect chain (backend/mindspore.py) keeps and orders it
    return dep


def _keep_jvp(primals, tangents, *, refusal):
    # reached only with a tangent: the collective is differentiated on this rank, where
    # its transpose could not be matched on every rank (``refusal`` says why and the fix)
    raise UnsupportedOpError(refusal)


keep_p = def_primitive("keep", FAMILY, lambda dep, *, refusal: [], multiple_results=True,
                       lower=_lower_keep, eager=lambda dep, *, refusal: [], effect=True,
                       show=lambda params: "keep")
jvp.set(keep_p, _keep_jvp)
unsupported(keep_p, "batching", "it keeps a job's per-rank collective, which is never batched")
unsupported(keep_p, "transpose", "its differentiation is refused (its jvp rule)")
unsupported(keep_p, "sharding", "it keeps a job's per-rank collective; fs.shard does not "
            "partition it")

# ---------------------------------------------------------------------------
# psum_scatter (tiled): sum over devices, each keeps its block of one dimension
# ---------------------------------------------------------------------------


def _psum_scatter_type(x, *, axis_name, axis_sizes, scatter_dimension, **_):
    _dim_type("psum_scatter")(x, scatter_dimension, "scatter_dimension")
    n = _total(axis_sizes)
    shape = list(x.shape)
    if shape[scatter_dimension] % n:
        raise ShapeError(
            f"psum_scatter over {axis_name} ({n} devices) needs dimension "
            f"{scatter_dimension} of {x} to be divisible by {n}.")
    shape[scatter_dimension] //= n
    return ArrayType(tuple(shape), x.dtype)


def _psum_scatter_batching(args, dims, *, axis_name, axis_sizes, scatter_dimension, **params):
    from fshard.primitives.reductions import reduce_sum
    from fshard.primitives.structural import reshape

    (x,), (d,) = args, dims
    k = scatter_dimension
    cur = _current()
    if cur.name not in axis_name:
        if d is None:
            return [psum_scatter_p.bind(x, axis_name=axis_name, axis_sizes=axis_sizes,
                                        scatter_dimension=k, **params)], [None]
        x = move_axis(x, d, 0)
        return [psum_scatter_p.bind(x, axis_name=axis_name, axis_sizes=axis_sizes,
                                    scatter_dimension=k + 1, **params)], [0]
    j = axis_name.index(cur.name)
    n = axis_sizes[j]
    n_pre = _total(axis_sizes[:j])
    total = reduce_sum(batch_to_front(x, d, n), 0)
    shape = typeof(total).shape
    # Block index = (pre, n, post): lane c keeps the (pre, c, post) blocks of the sum.
    split = tuple(shape[:k]) + (n_pre, n, shape[k] // (n_pre * n)) + tuple(shape[k + 1:])
    y = move_axis(reshape(total, split), k + 1, 0)
    y = reshape(y, (n,) + tuple(shape[:k]) + (shape[k] // n,) + tuple(shape[k + 1:]))
    rest = _others(axis_name, cur.name)
    if rest:
        y = psum_scatter_p.bind(y, axis_name=rest,
                                axis_sizes=_others_sizes(axis_name, axis_sizes, cur.name),
                                scatter_dimension=k + 1, **params)
    return [y], [0]


def _lower_psum_scatter(ctx, x, *, axis_name, axis_sizes, scatter_dimension, **params):
    comm = Comm(ctx, axis_name, params, "psum_scatter")
    return comm.reduce_scatter(x, ctx.in_avals[0], scatter_dimension)


def _psum_scatter_transpose(ct, x, *, axis_name, axis_sizes, scatter_dimension, **params):
    if isinstance(ct, Zero):
        return [Zero(x.aval)]
    return [all_gather_p.bind(ct, axis_name=axis_name, axis_sizes=axis_sizes,
                              axis=scatter_dimension, **params)]


psum_scatter_p = _declare("psum_scatter", _psum_scatter_type, _lower_psum_scatter)
batching.set(psum_scatter_p, _psum_scatter_batching)
deflinear(psum_scatter_p, _psum_scatter_transpose)

# ---------------------------------------------------------------------------
# axis_index: this device's position along the axes
# ---------------------------------------------------------------------------


def _axis_index_type(*, axis_name, axis_sizes, **_):
    return ArrayType((), dtypes.int32)


def _axis_index_batching(args, dims, *, axis_name, axis_sizes, **params):
    from fshard.primitives.elementwise import add, mul

    cur = _current()
    if cur.name not in axis_name:
        return [axis_index_p.bind(axis_name=axis_name, axis_sizes=axis_sizes, **params)], [None]
    j = axis_name.index(cur.name)
    n_post = _total(axis_sizes[j + 1:])
    idx = np.arange(axis_sizes[j], dtype=np.int32) * np.int32(n_post)
    if j > 0:  # index = pre * (n * post) + lane * post + post_index
        pre = axis_index_p.bind(axis_name=axis_name[:j], axis_sizes=axis_sizes[:j], **params)
        idx = add(idx, mul(pre, np.int32(axis_sizes[j] * n_post)))
    if j + 1 < len(axis_name):
        idx = add(idx, axis_index_p.bind(axis_name=axis_name[j + 1:],
                                         axis_sizes=axis_sizes[j + 1:], **params))
    from fshard.backend.mindspore import as_tensor

    return [as_tensor(idx) if isinstance(idx, np.ndarray) else idx], [0]


def _lower_axis_index(ctx, *, axis_name, axis_sizes, **params):
    from fshard.backend.mindspore import Tensor

    comm = Comm(ctx, axis_name, params, "axis_index")
    return ctx.ref(Tensor(np.int32(comm.index)), "axis_index")


axis_index_p = _declare("axis_index", _axis_index_type, _lower_axis_index)
batching.set(axis_index_p, _axis_index_batching)
unsupported(axis_index_p, "jvp", "no operands: an integer constant on each device")
unsupported(axis_index_p, "transpose", "no operands: not a linear map")

# ---------------------------------------------------------------------------
# all_to_all (tiled): chunk j of `split_axis` goes to device j, received chunks are
# concatenated along `concat_axis` in device order
# ---------------------------------------------------------------------------


def _all_to_all_type(x, *, axis_name, axis_sizes, split_axis, concat_axis, **_):
    _dim_type("all_to_all")(x, split_axis, "split_axis")
    _dim_type("all_to_all")(x, concat_axis, "concat_axis")
    n = _total(axis_sizes)
    shape = list(x.shape)
    if shape[split_axis] % n:
        raise ShapeError(
            f"all_to_all over {axis_name} ({n} devices) needs split_axis {split_axis} of "
            f"{x} to be divisible by {n}.")
    shape[split_axis] //= n
    shape[concat_axis] *= n
    return ArrayType(tuple(shape), x.dtype)


def _all_to_all_expanded(x, *, axis_name, axis_sizes, split_axis, concat_axis, **params):
    """all_to_all from all_gather + axis_index: what a virtual mesh runs."""
    from fshard.primitives.structural import expand_dims, gather_p, reshape

    n = _total(axis_sizes)
    g = all_gather_p.bind(expand_dims(x, 0), axis_name=axis_name, axis_sizes=axis_sizes,
                          axis=0, **params)                   # (n_src, ..., S, ...)
    shape = typeof(g).shape
    s = split_axis + 1
    g = reshape(g, tuple(shape[:s]) + (n, shape[s] // n) + tuple(shape[s + 1:]))
    me = axis_index_p.bind(axis_name=axis_name, axis_sizes=axis_sizes, **params)
    g = gather_p.bind(g, me, axis=s)                           # my chunk from every source
    return _lanes_into_dim(g, concat_axis)


def _batch_expansion(expansion, args, dims, **params):
    """Batch ``expansion(*args, **params)`` (written with other collectives) over the
    current axis: stage it on unbatched types and run the batching interpreter."""
    from fshard.core.staging import stage

    avals = []
    for x, d in zip(args, dims):
        a = typeof(x)
        shape = a.shape if d is None else a.shape[:d] + a.shape[d + 1:]
        avals.append(ArrayType(tuple(shape), a.dtype))
    program, consts = stage(lambda *xs: [expansion(*xs, **params)], avals)
    return batch_program(program, list(consts) + list(args),
                         [None] * len(consts) + list(dims), _current())


def _all_to_all_batching(args, dims, *, axis_name, axis_sizes, split_axis, concat_axis,
                         **params):
    (x,), (d,) = args, dims
    cur = _current()
    p = dict(axis_name=axis_name, axis_sizes=axis_sizes, **params)
    if cur.name not in axis_name:
        if d is None:
            return [all_to_all_p.bind(x, split_axis=split_axis, concat_axis=concat_axis,
                                      **p)], [None]
        x = move_axis(x, d, 0)
        return [all_to_all_p.bind(x, split_axis=split_axis + 1, concat_axis=concat_axis + 1,
                                  **p)], [0]
    return _batch_expansion(_all_to_all_expanded, [x], [d], split_axis=split_axis,
                            concat_axis=concat_axis, **p)


def _lower_all_to_all(ctx, x, *, axis_name, axis_sizes, split_axis, concat_axis, **params):
    comm = Comm(ctx, axis_name, params, "all_to_all")
    return comm.all_to_all(x, ctx.in_avals[0], split_axis, concat_axis)


def _all_to_all_transpose(ct, x, *, axis_name, axis_sizes, split_axis, concat_axis, **params):
    if isinstance(ct, Zero):
        return [Zero(x.aval)]
    return [all_to_all_p.bind(ct, axis_name=axis_name, axis_sizes=axis_sizes,
                              split_axis=concat_axis, concat_axis=split_axis, **params)]


all_to_all_p = _declare("all_to_all", _all_to_all_type, _lower_all_to_all)
batching.set(all_to_all_p, _all_to_all_batching)
deflinear(all_to_all_p, _all_to_all_transpose)

# ---------------------------------------------------------------------------
# ppermute: device src sends x to device dst for each (src, dst) in perm; devices
# that receive nothing get zeros (NB: also MindSpore's NeighborExchange)
# ---------------------------------------------------------------------------


def _ppermute_type(x, *, axis_name, axis_sizes, perm, **_):
    return x


def _sources(perm, n: int) -> list:
    """``src[dst]``: which device each device receives from (None: nothing)."""
    src = [None] * n
    for s, t in perm:
        src[t] = s
    return src


def _ppermute_expanded(x, *, axis_name, axis_sizes, perm, **params):
    """ppermute from all_gather + axis_index (a one-hot row picks the source)."""
    from fshard.primitives.elementwise import mul
    from fshard.primitives.reductions import reduce_sum
    from fshard.primitives.structural import broadcast_to, expand_dims, gather_p, reshape

    n = _total(axis_sizes)
    g = all_gather_p.bind(expand_dims(x, 0), axis_name=axis_name, axis_sizes=axis_sizes,
                          axis=0, **params)
    table = np.zeros((n, n), dtypes.to_numpy(typeof(x).dtype))
    for t, s in enumerate(_sources(perm, n)):
        if s is not None:
            table[t, s] = 1
    me = axis_index_p.bind(axis_name=axis_name, axis_sizes=axis_sizes, **params)
    row = gather_p.bind(table, me, axis=0)                     # (n_src,)
    shape = typeof(g).shape
    row = broadcast_to(reshape(row, (n,) + (1,) * (len(shape) - 1)), shape)
    return reduce_sum(mul(g, row), 0)


def _ppermute_batching(args, dims, *, axis_name, axis_sizes, perm, **params):
    from fshard.primitives.elementwise import mul
    from fshard.primitives.structural import gather_p

    (x,), (d,) = args, dims
    cur = _current()
    p = dict(axis_name=axis_name, axis_sizes=axis_sizes, perm=perm, **params)
    if cur.name not in axis_name:
        if d is None:
            return [ppermute_p.bind(x, **p)], [None]
        return [ppermute_p.bind(move_axis(x, d, 0), **p)], [0]
    if len(axis_name) > 1:
        return _batch_expansion(_ppermute_expanded, [x], [d], **p)
    n = cur.size
    src = _sources(perm, n)
    if d is None and all(s is not None for s in src):
        return [x], [None]  # every device sends the same value: nothing changes
    x = batch_to_front(x, d, n)
    y = gather_p.bind(x, np.asarray([s or 0 for s in src], np.int32), axis=0)
    if any(s is None for s in src):
        mask = np.asarray([s is not None for s in src], dtypes.to_numpy(typeof(x).dtype))
        y = mul(y, mask.reshape((n,) + (1,) * (typeof(y).ndim - 1)))
    return [y], [0]


def _lower_ppermute(ctx, x, *, axis_name, axis_sizes, perm, **params):
    comm = Comm(ctx, axis_name, params, "ppermute")
    return comm.ppermute(x, ctx.in_avals[0], _sources(perm, comm.n)[comm.index])


def _ppermute_transpose(ct, x, *, axis_name, axis_sizes, perm, **params):
    if isinstance(ct, Zero):
        return [Zero(x.aval)]
    inverse = tuple((t, s) for s, t in perm)
    return [ppermute_p.bind(ct, axis_name=axis_name, axis_sizes=axis_sizes, perm=inverse,
                            **params)]


ppermute_p = _declare("ppermute", _ppermute_type, _lower_ppermute)
batching.set(ppermute_p, _ppermute_batching)
deflinear(ppermute_p, _ppermute_transpose)

# ---------------------------------------------------------------------------
# broadcast: every device gets the value of device `root`
# ---------------------------------------------------------------------------


def _broadcast_type(x, *, axis_name, axis_sizes, root, **_):
    return x


def _broadcast_batching(args, dims, *, axis_name, axis_sizes, root, **params):
    from fshard.primitives.structural import gather_p

    (x,), (d,) = args, dims
    cur = _current()
    if cur.name not in axis_name:
        p = dict(axis_name=axis_name, axis_sizes=axis_sizes, root=root, **params)
        if d is None:
            return [broadcast_p.bind(x, **p)], [None]
        return [broadcast_p.bind(move_axis(x, d, 0), **p)], [0]
    j = axis_name.index(cur.name)
    coords = np.unravel_index(root, axis_sizes)
    y = x if d is None else gather_p.bind(x, np.int32(coords[j]), axis=d)
    rest = _others(axis_name, cur.name)
    if rest:
        rest_sizes = _others_sizes(axis_name, axis_sizes, cur.name)
        rest_root = int(np.ravel_multi_index(
            tuple(int(c) for i, c in enumerate(coords) if i != j), rest_sizes))
        y = broadcast_p.bind(y, axis_name=rest, axis_sizes=rest_sizes, root=rest_root, **params)
    return [y], [None]


def _lower_broadcast(ctx, x, *, axis_name, axis_sizes, root, **params):
    comm = Comm(ctx, axis_name, params, "broadcast")
    return comm.broadcast(x, root, ctx.in_avals[0].dtype)


def _broadcast_transpose(ct, x, *, axis_name, axis_sizes, root, **params):
    """broadcast^T: the root receives the sum of every device's cotangent."""
    from fshard.primitives.elementwise import cast, equal, mul

    if isinstance(ct, Zero):
        return [Zero(x.aval)]
    total = psum_p.bind(ct, axis_name=axis_name, **params)
    me = axis_index_p.bind(axis_name=axis_name, axis_sizes=axis_sizes, **params)
    is_root = cast(equal(me, np.int32(root)), typeof(ct).dtype)
    return [mul(total, is_root)]


broadcast_p = _declare("broadcast", _broadcast_type, _lower_broadcast)
batching.set(broadcast_p, _broadcast_batching)
deflinear(broadcast_p, _broadcast_transpose)

# ---------------------------------------------------------------------------
# Differentiation inside shard_map: the boundary rules of replicated values
# ---------------------------------------------------------------------------
#
# Transposes here are per-device true transposes: the cotangent a device holds for
# a value replicated over an axis is its *share*, and the shares sum to the
# cotangent of the one logical value. A vjp taken inside a shard_map body therefore
# (1) splits the seed of an output replicated over axes A into |A| shares
# (``replica_split``) and (2) sums the shares of an input replicated over axes B
# (``replica_sum``). Which axes a value is replicated over is known only later
# (batching: the value is unbatched; multi-process: the shard_map VMA pass), so
# both are primitives whose ``like`` operand is the primal value in question.

def replica_axes_of_body(names: tuple):
    """While a shard_map body is staged: vjps inside it use ``names`` as mesh axes."""
    return context.pushed(context.replica_axes, tuple(names))


def replica_axes() -> tuple:
    """Mesh axes of the innermost shard_map body being staged (empty outside)."""
    return context.innermost(context.replica_axes, ())


def _marker_type(ct, like, *, axis_name, **_):
    return ct


def _marker_batching(prim, combine):
    def rule(args, dims, *, axis_name, **params):
        (ct, like), (dc, dl) = args, dims
        cur = _current()
        if cur.name not in axis_name:
            return [prim.bind(ct, like, axis_name=axis_name, **params)], [dc]
        if dl is None:  # `like` is replicated over this axis
            ct, dc = combine(ct, dc, cur.size)
        rest = _others(axis_name, cur.name)
        if rest:
            ct = prim.bind(ct, like, axis_name=rest, **params)
        return [ct], [dc]

    return rule


def _sum_shares(ct, dc, n):
    return _sum_lanes(ct, dc, n), None


def _split_seed(ct, dc, n):
    from fshard.primitives.elementwise import div

    return div(ct, _scalar(n, ct)), dc


def _marker_lowering(name):
    def lower(ctx, *args, **params):
        raise AssertionError(f"{name} reached lowering: shard_map resolves it first")

    return lower


def _marker_rules(prim):
    def jvp_rule(primals, tangents, **params):
        (ct, like), (t, _) = primals, tangents
        out = prim.bind(ct, like, **params)
        t_out = Zero(typeof(out)) if isinstance(t, Zero) else prim.bind(t, like, **params)
        return [out], [t_out]

    def transpose_rule(ct, x, like, **params):  # both markers are self-adjoint
        if isinstance(ct, Zero):
            return [Zero(x.aval), None]
        return [prim.bind(ct, like, **params), None]

    jvp.set(prim, jvp_rule)
    transpose.set(prim, transpose_rule)


replica_sum_p = _declare("replica_sum", _marker_type, _marker_lowering("replica_sum"))
replica_split_p = _declare("replica_split", _marker_type, _marker_lowering("replica_split"))
batching.set(replica_sum_p, _marker_batching(replica_sum_p, _sum_shares))
batching.set(replica_split_p, _marker_batching(replica_split_p, _split_seed))
_marker_rules(replica_sum_p)
_marker_rules(replica_split_p)


def seed_cotangents(cts: list, outs: list, names: tuple) -> list:
    """The seeds of a vjp inside a shard_map body: split over replicas of each output."""
    if not names:
        return cts
    return [c if isinstance(c, Zero) or not dtypes.is_float(typeof(c).dtype) else
            replica_split_p.bind(c, o, axis_name=tuple(names)) for c, o in zip(cts, outs)]


def input_cotangents(cts: list, ins: list, names: tuple) -> list:
    """The cotangents a vjp inside a shard_map body returns: summed over the replicas
    of each input."""
    if not names:
        return cts
    return [c if isinstance(c, Zero) or not dtypes.is_float(typeof(c).dtype) else
            replica_sum_p.bind(c, x, axis_name=tuple(names)) for c, x in zip(cts, ins)]


# ---------------------------------------------------------------------------
# Varying-manual-axes (VMA) rules: over which mesh axes a value may differ
# ---------------------------------------------------------------------------


def _vma_reduce(vmas, *, axis_name, **_):
    return [vmas[0] - set(axis_name)]


def _vma_add(vmas, *, axis_name, **_):
    return [vmas[0] | set(axis_name)]


def _vma_ppermute(vmas, *, axis_name, axis_sizes, perm, **_):
    full = all(s is not None for s in _sources(perm, _total(axis_sizes)))
    return [vmas[0] if full else vmas[0] | set(axis_name)]


def _vma_axis_index(vmas, *, axis_name, **_):
    return [frozenset(axis_name)]


def _vma_replica_sum(vmas, *, axis_name, **_):
    return [vmas[0] - (set(axis_name) - vmas[1])]


#: Per primitive ``rule(in_vmas, **params) -> out_vmas``; every other primitive's
#: outputs vary over the union of its operands' axes.
VMA_RULES: dict = {
    psum_p: _vma_reduce, pmean_p: _vma_reduce, pmax_p: _vma_reduce, pmin_p: _vma_reduce,
    all_gather_p: _vma_reduce, broadcast_p: _vma_reduce,
    psum_scatter_p: _vma_add, all_to_all_p: _vma_add, ppermute_p: _vma_ppermute,
    axis_index_p: _vma_axis_index,
    replica_sum_p: _vma_replica_sum, replica_split_p: lambda vmas, **_: [vmas[0]],
}

#: The collectives: the primitives that communicate between devices (the one list;
#: ``Partitioned.collectives()`` and the benchmarks count these).
COLLECTIVES = (psum_p, pmean_p, pmax_p, pmin_p, all_gather_p, psum_scatter_p, all_to_all_p,
               ppermute_p, broadcast_p)
#: The primitives that name mesh axes: the collectives and ``axis_index``. In a
#: multi-process job each gets the job's mesh as a parameter.
NAMED_AXIS_PRIMITIVES = COLLECTIVES + (axis_index_p,)

# ---------------------------------------------------------------------------
# The boundary of a multi-process shard_map
# ---------------------------------------------------------------------------
#
# ``dims`` gives, per dimension, the mesh axes splitting it (major first). Outside
# the body every rank holds the whole (replicated) value and its full cotangent.
# shard_in^T gathers the blocks' cotangents and sums over the axes the input is
# replicated over; shard_out^T takes this rank's block of the cotangent and splits
# it between the replicas (docs/collectives.md#differentiation).


def _unmentioned(dims, mesh) -> tuple:
    used = {a for axes in dims for a in axes}
    return tuple(n for n in mesh.axis_names if n not in used)


def _shard_in_type(x, *, dims, mesh):
    shape = list(x.shape)
    for k, axes in enumerate(dims):
        n = _total(mesh.axis_size(a) for a in axes)
        if not dim_multiple_of(shape[k], n):
            raise ShapeError(f"shard_in: dimension {k} of {x} is not divisible by {n}")
        shape[k] //= n
    return ArrayType(tuple(shape), x.dtype)


def _shard_out_type(x, *, dims, mesh):
    shape = list(x.shape)
    for k, axes in enumerate(dims):
        shape[k] *= _total(mesh.axis_size(a) for a in axes)
    return ArrayType(tuple(shape), x.dtype)


def _lower_shard_in(ctx, x, *, dims, mesh):
    rank = this_rank(ctx)
    shape = ctx.in_avals[0].shape
    begin, end = [0] * len(shape), list(shape)
    for k, axes in enumerate(dims):
        if not axes:
            continue
        comm = Comm(ctx, axes, {"mesh": mesh}, "shard_map", rank=rank)
        block = shape[k] // comm.n  # s0/8 of a symbolic s0: sizes read at run time
        begin[k] = comm.index * block if comm.index else 0
        end[k] = (comm.index + 1) * block
    return local_slice(ctx, x, shape, begin, end)


def _lower_shard_out(ctx, x, *, dims, mesh):
    aval = ctx.in_avals[0]
    for k, axes in enumerate(dims):
        if not axes:
            continue
        comm = Comm(ctx, axes, {"mesh": mesh}, "shard_map")
        x = comm.all_gather(x, aval, k)
        shape = list(aval.shape)
        shape[k] *= comm.n
        aval = ArrayType(tuple(shape), aval.dtype)
    return x


def _boundary_batching(prim):
    def rule(args, dims_, *, dims, mesh):
        (x,), (d,) = args, dims_
        if d is None:
            return [prim.bind(x, dims=dims, mesh=mesh)], [None]
        return [prim.bind(move_axis(x, d, 0), dims=((),) + tuple(dims), mesh=mesh)], [0]

    return rule


def _shard_in_transpose(ct, x, *, dims, mesh):
    if isinstance(ct, Zero):
        return [Zero(x.aval)]
    for k, axes in enumerate(dims):
        if axes:
            ct = all_gather_p.bind(ct, axis_name=tuple(axes),
                                   axis_sizes=tuple(mesh.axis_size(a) for a in axes),
                                   axis=k, mesh=mesh)
    rest = _unmentioned(dims, mesh)
    if rest:
        ct = psum_p.bind(ct, axis_name=rest, mesh=mesh)
    return [ct]


def _shard_out_transpose(ct, x, *, dims, mesh):
    from fshard.primitives.elementwise import div

    if isinstance(ct, Zero):
        return [Zero(x.aval)]
    ct = shard_in_p.bind(instantiate(ct), dims=dims, mesh=mesh)
    n = _total(mesh.axis_size(a) for a in _unmentioned(dims, mesh))
    return [div(ct, _scalar(n, ct)) if n > 1 else ct]


shard_in_p = _declare("shard_in", _shard_in_type, _lower_shard_in)
shard_out_p = _declare("shard_out", _shard_out_type, _lower_shard_out)
batching.set(shard_in_p, _boundary_batching(shard_in_p))
batching.set(shard_out_p, _boundary_batching(shard_out_p))
deflinear(shard_in_p, _shard_in_transpose)
deflinear(shard_out_p, _shard_out_transpose)

# ---------------------------------------------------------------------------
# The user functions
# ---------------------------------------------------------------------------


def _map(fn, x):
    from fshard.core import tree

    return tree.map(fn, x)


def psum(x: ArrayTree, axis_name) -> ArrayTree:
    """Sum ``x`` over the devices of ``axis_name``; every device gets the sum
    (NB: ``jax.lax.psum``). ``x`` may be a pytree.

    >>> import numpy as np, fshard as fs
    >>> xs = np.arange(4, dtype=np.float32)
    >>> fs.vmap(lambda x: fs.psum(x, "i"), axis_name="i")(xs).asnumpy().tolist()
    [6.0, 6.0, 6.0, 6.0]

    Args:
        x: an array (or pytree of arrays) on each device.
        axis_name: a mesh axis name, or a tuple of names to sum over all of them.

    Raises:
        AxisNameError: no enclosing ``fs.shard_map``/``fs.vmap`` binds the name.

    See also: ``pmean``, ``psum_scatter``; docs/collectives.md.
    """
    names = _norm_names(axis_name, "psum")
    return _map(lambda v: psum_p.bind(v, axis_name=names), x)


def pmean(x: ArrayTree, axis_name) -> ArrayTree:
    """Mean of ``x`` over the devices of ``axis_name`` (NB: ``jax.lax.pmean``).

    >>> import numpy as np, fshard as fs
    >>> xs = np.arange(4, dtype=np.float32)
    >>> fs.vmap(lambda x: fs.pmean(x, "i"), axis_name="i")(xs).asnumpy().tolist()
    [1.5, 1.5, 1.5, 1.5]

    See also: ``psum``; docs/collectives.md.
    """
    names = _norm_names(axis_name, "pmean")

    def one(v):
        if not dtypes.is_float(typeof(v).dtype):
            raise ArgumentError(
                f"fs.pmean needs a floating-point value, got {typeof(v)}.\nFix: cast it "
                "first (x.astype(mindspore.float32)), or use fs.psum.")
        return pmean_p.bind(v, axis_name=names)

    return _map(one, x)


def pmax(x: Shaped[Array, "*shape"], axis_name) -> Shaped[Array, "*shape"]:
    """Elementwise maximum of ``x`` over the devices of ``axis_name``.

    >>> import numpy as np, fshard as fs
    >>> xs = np.array([[1, 5], [4, 2]], np.float32)
    >>> fs.vmap(lambda x: fs.pmax(x, "i"), axis_name="i")(xs).asnumpy().tolist()
    [[4.0, 5.0], [4.0, 5.0]]
    """
    names = _norm_names(axis_name, "pmax")
    return _map(lambda v: pmax_p.bind(v, axis_name=names), x)


def pmin(x: Shaped[Array, "*shape"], axis_name) -> Shaped[Array, "*shape"]:
    """Elementwise minimum of ``x`` over the devices of ``axis_name``.

    >>> import numpy as np, fshard as fs
    >>> xs = np.array([[1, 5], [4, 2]], np.float32)
    >>> fs.vmap(lambda x: fs.pmin(x, "i"), axis_name="i")(xs).asnumpy().tolist()
    [[1.0, 2.0], [1.0, 2.0]]
    """
    names = _norm_names(axis_name, "pmin")
    return _map(lambda v: pmin_p.bind(v, axis_name=names), x)


def _axis_arg(x, axis, what: str, api: str, extra: int = 0) -> int:
    nd = typeof(x).ndim + extra
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -nd <= axis < nd:
        raise ArgumentError(
            f"fs.{api}: {what}={axis!r} is not an axis of a value of type {typeof(x)}.\n"
            f"Fix: use an int in [{-nd}, {nd - 1}].")
    return int(axis) % nd


def all_gather(x: Shaped[Array, "..."], axis_name, *, axis: int = 0,
               tiled: bool = False) -> Shaped[Array, "..."]:
    """Every device's ``x``, gathered from all devices of ``axis_name`` in device
    order (NB: ``jax.lax.all_gather``).

    ``tiled=False`` stacks the blocks along a new dimension ``axis``; ``tiled=True``
    concatenates them along the existing dimension ``axis``.

    >>> import numpy as np, fshard as fs
    >>> xs = np.arange(4, dtype=np.float32).reshape(2, 2)
    >>> g = fs.vmap(lambda x: fs.all_gather(x, "i", tiled=True), axis_name="i")(xs)
    >>> g.asnumpy().tolist()
    [[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]]

    See also: ``psum_scatter`` (its transpose); docs/collectives.md.
    """
    from fshard.primitives.structural import expand_dims

    names = _norm_names(axis_name, "all_gather")
    sizes = _sizes(names, "all_gather")

    def one(v):
        if tiled:
            k = _axis_arg(v, axis, "axis", "all_gather")
            if typeof(v).ndim == 0:
                raise ArgumentError("fs.all_gather(tiled=True) needs an operand of rank >= 1; "
                                    "use tiled=False to stack scalars.")
            return all_gather_p.bind(v, axis_name=names, axis_sizes=sizes, axis=k)
        k = _axis_arg(v, axis, "axis", "all_gather", extra=1)
        return all_gather_p.bind(expand_dims(v, k), axis_name=names, axis_sizes=sizes, axis=k)

    return _map(one, x)


def psum_scatter(x: Shaped[Array, "..."], axis_name, *, scatter_dimension: int = 0,
                 tiled: bool = False) -> Shaped[Array, "..."]:
    """Sum ``x`` over the devices of ``axis_name``; device ``i`` keeps block ``i`` of
    ``scatter_dimension`` (NB: ``jax.lax.psum_scatter``, MindSpore's ReduceScatter).

    ``tiled=False`` needs that dimension's size to equal the number of devices and
    removes it; ``tiled=True`` keeps it, ``1/n`` as large.

    >>> import numpy as np, fshard as fs
    >>> xs = np.arange(8, dtype=np.float32).reshape(2, 4)
    >>> f = lambda x: fs.psum_scatter(x, "i", tiled=True)
    >>> fs.vmap(f, axis_name="i")(xs).asnumpy().tolist()
    [[4.0, 6.0], [8.0, 10.0]]

    See also: ``all_gather`` (its transpose); docs/collectives.md.
    """
    from fshard.primitives.structural import squeeze

    names = _norm_names(axis_name, "psum_scatter")
    sizes = _sizes(names, "psum_scatter")
    n = _total(sizes)

    def one(v):
        k = _axis_arg(v, scatter_dimension, "scatter_dimension", "psum_scatter")
        size = typeof(v).shape[k]
        if not tiled and size != n:
            raise ShapeError(
                f"fs.psum_scatter(tiled=False) over {names} ({n} devices) needs dimension "
                f"{k} of {typeof(v)} to have size {n}, got {size}.\nFix: use tiled=True to "
                "scatter blocks of a larger dimension.")
        if tiled and size % n:
            raise ShapeError(
                f"fs.psum_scatter over {names} ({n} devices) needs dimension {k} of "
                f"{typeof(v)} (size {size}) to be divisible by {n}.\nFix: pad it to a "
                f"multiple of {n}, or scatter another dimension.")
        y = psum_scatter_p.bind(v, axis_name=names, axis_sizes=sizes, scatter_dimension=k)
        return y if tiled else squeeze(y, k)

    return _map(one, x)


def all_to_all(x: Shaped[Array, "..."], axis_name, split_axis: int, concat_axis: int, *,
               tiled: bool = False) -> Shaped[Array, "..."]:
    """Device ``i`` sends chunk ``j`` of ``split_axis`` to device ``j`` and
    concatenates what it receives along ``concat_axis`` in device order
    (NB: ``jax.lax.all_to_all``, MindSpore's AlltoAll).

    ``tiled=False`` (JAX's default) needs ``split_axis`` to have exactly one entry per
    device: it is removed and a new axis of that size is inserted at ``concat_axis``.

    >>> import numpy as np, fshard as fs
    >>> xs = np.arange(4, dtype=np.float32).reshape(2, 2)    # device i holds [2i, 2i+1]
    >>> f = lambda x: fs.all_to_all(x, "i", 0, 0, tiled=True)
    >>> fs.vmap(f, axis_name="i")(xs).asnumpy().tolist()
    [[0.0, 2.0], [1.0, 3.0]]

    See also: docs/collectives.md.
    """
    names = _norm_names(axis_name, "all_to_all")
    sizes = _sizes(names, "all_to_all")
    n = _total(sizes)

    def one(v):
        s = _axis_arg(v, split_axis, "split_axis", "all_to_all")
        size = typeof(v).shape[s]
        if tiled:
            c = _axis_arg(v, concat_axis, "concat_axis", "all_to_all")
            if size % n:
                raise ShapeError(
                    f"fs.all_to_all over {names} ({n} devices) needs split_axis {s} of "
                    f"{typeof(v)} (size {size}) to be divisible by {n}.")
            return all_to_all_p.bind(v, axis_name=names, axis_sizes=sizes, split_axis=s,
                                     concat_axis=c)
        c = _axis_arg(v, concat_axis, "concat_axis", "all_to_all")
        if size != n:
            raise ShapeError(
                f"fs.all_to_all(tiled=False) over {names} ({n} devices) needs split_axis {s} "
                f"of {typeof(v)} to have size {n}, got {size}.\nFix: use tiled=True to "
                "exchange chunks of a larger axis.")
        y = all_to_all_p.bind(v, axis_name=names, axis_sizes=sizes, split_axis=s,
                              concat_axis=s)
        return move_axis(y, s, c)

    return _map(one, x)


def ppermute(x: Shaped[Array, "*shape"], axis_name, perm) -> Shaped[Array, "*shape"]:
    """Send ``x`` from device ``src`` to device ``dst`` for each pair in ``perm``;
    a device that receives nothing gets zeros (NB: ``jax.lax.ppermute``; covers
    MindSpore's NeighborExchange).

    >>> import numpy as np, fshard as fs
    >>> xs = np.arange(3, dtype=np.float32)
    >>> ring = [(0, 1), (1, 2), (2, 0)]
    >>> fs.vmap(lambda x: fs.ppermute(x, "i", ring), axis_name="i")(xs).asnumpy().tolist()
    [2.0, 0.0, 1.0]

    Raises:
        ArgumentError: a device index out of range, or a device that sends or
            receives twice.
    """
    names = _norm_names(axis_name, "ppermute")
    sizes = _sizes(names, "ppermute")
    n = _total(sizes)
    try:
        pairs = tuple((int(s), int(t)) for s, t in perm)
    except (TypeError, ValueError):
        raise ArgumentError(
            f"fs.ppermute: perm must be a sequence of (source, destination) index pairs, "
            f"got {perm!r}.\nFix: e.g. perm=[(0, 1), (1, 0)].") from None
    for s, t in pairs:
        if not (0 <= s < n and 0 <= t < n):
            raise ArgumentError(
                f"fs.ppermute: perm pair ({s}, {t}) names a device outside [0, {n}) of "
                f"axis {names}.")
    srcs, dsts = [s for s, _ in pairs], [t for _, t in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ArgumentError(
            f"fs.ppermute: perm {list(pairs)} sends from or to a device more than once; each "
            "device may appear at most once as a source and once as a destination.")
    return _map(lambda v: ppermute_p.bind(v, axis_name=names, axis_sizes=sizes, perm=pairs), x)


def broadcast(x: Shaped[Array, "*shape"], axis_name,
              root: int = 0) -> Shaped[Array, "*shape"]:
    """Every device of ``axis_name`` gets device ``root``'s ``x`` (MindSpore's
    Broadcast; NB: ``jax.lax.pbroadcast``).

    >>> import numpy as np, fshard as fs
    >>> xs = np.arange(3, dtype=np.float32)
    >>> fs.vmap(lambda x: fs.broadcast(x, "i", root=2), axis_name="i")(xs).asnumpy().tolist()
    [2.0, 2.0, 2.0]
    """
    names = _norm_names(axis_name, "broadcast")
    sizes = _sizes(names, "broadcast")
    n = _total(sizes)
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= root < n:
        raise ArgumentError(
            f"fs.broadcast: root={root!r} must be a device index in [0, {n}) of axis {names}.")
    return _map(lambda v: broadcast_p.bind(v, axis_name=names, axis_sizes=sizes,
                                           root=int(root)), x)


def axis_index(axis_name) -> Int32[Array, ""]:
    """This device's index along ``axis_name`` (int32; for a tuple of names, the
    index in the flattened axes, the first name most significant).

    >>> import numpy as np, fshard as fs
    >>> f = lambda x: x * fs.axis_index("i")
    >>> fs.vmap(f, axis_name="i")(np.ones(3, np.int32)).asnumpy().tolist()
    [0, 1, 2]
    """
    names = _norm_names(axis_name, "axis_index")
    sizes = _sizes(names, "axis_index")
    return axis_index_p.bind(axis_name=names, axis_sizes=sizes)


__all__ = ["psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all",
           "ppermute", "broadcast", "axis_index", "named_axis", "axis_size", "bound_axes",
           "VMA_RULES", "COLLECTIVES", "NAMED_AXIS_PRIMITIVES"]
