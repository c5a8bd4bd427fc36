"""``fs.shard_map``: run a function on each device's block, with explicit collectives
(NB: ``jax.shard_map``, in MindSpore's strategy vocabulary).

``shard_map(f, in_strategy, out_strategy, mesh)`` splits each input over mesh axes,
calls ``f`` on every device's local block (``f`` communicates with ``fs.psum`` and
the other collectives, naming mesh axes), and reassembles the global outputs.

- **Strategies.** Each entry is a ``fs.Layout`` view (it names the mesh axes), a
  tuple of split counts, or None (replicated); docs/shard_map.md defines how split
  counts map onto mesh axes. An output not split over a mesh axis is promised to be
  the same on every device of that axis (checked unless ``check_vma=False``).
- **Virtual mesh** (one process): nested batching, one level per mesh axis with that
  axis's name, over the blocks; the collectives' batching rules do the
  communication as array ops.
- **Multi-process job** (the mesh is the world): each process runs ``f`` once on its
  own block. The body is interpreted into the enclosing trace with the mesh
  attached to every collective; ``shard_in``/``shard_out`` mark the boundary. Called
  eagerly, the whole shard_map is compiled first: collectives only run in graphs.
- **Differentiation** inside ``f`` treats replicated values by the boundary rules of
  fshard.primitives.collectives (seeds split over replicas, replicated inputs' cotangents
  summed); the varying-manual-axes (VMA) pass below tells, in a multi-process job,
  which values are replicated over which axes.

This module owns the transform only; the primitives are in fshard/primitives/collectives.py.
"""

from __future__ import annotations

import contextlib
import functools
import math

from fshard.core import context, tree
from fshard.core.tracing import ArrayType, EvalTrace, Tracer, current_trace, typeof
from fshard.errors import AxisNameError, CompositionError, ShardingError
from fshard.core.interpret import eval_program, walk
from fshard.meshes.layout import Layout
from fshard.meshes.mesh import Mesh, current_mesh, resolve_mesh
from fshard.primitives import collectives as C
from fshard.primitives.control import _stage_closed, scan_p
from fshard.sharding.runtime import bind_on_rank, from_blocks, run_batched, to_blocks
from fshard.sharding.strategy import broadcast_strategies, is_strategy_leaf, mesh_dims
from fshard.core.staging import fun_name, trace_fun
from fshard.transforms.control_flow import cond_p, while_p

# ---------------------------------------------------------------------------
# Strategies -> per-dimension mesh axes
# ---------------------------------------------------------------------------


def _axes_of(dims) -> frozenset:
    return frozenset(a for axes in dims for a in axes)


def _count(dims_k, mesh: Mesh) -> int:
    return math.prod(mesh.axis_size(a) for a in dims_k)


def _spec_text(dims) -> str:
    return "(" + ", ".join("+".join(d) if d else "-" for d in dims) + \
        ("," if len(dims) == 1 else "") + ")"


def _varying_output_error(sm, out_name, axis, dims) -> ShardingError:
    return ShardingError(
        f"shard_map({sm.name}): {out_name} varies over the mesh axis {axis!r}, but "
        f"out_strategy {_spec_text(dims)} does not split it over {axis!r}, which promises "
        f"the same value on every device of {axis!r}.\nFix: split that output over "
        f"{axis!r} in out_strategy, or make it the same everywhere (e.g. fs.psum/fs.pmean/"
        f"fs.all_gather over {axis!r}); pass check_vma=False to skip this check (device 0 "
        "of the axis then gives the value).")


# ---------------------------------------------------------------------------
# Multi-process job: the body on this rank, with the VMA pass
# ---------------------------------------------------------------------------


def _vma_out(eq, in_vmas) -> list:
    rule = C.VMA_RULES.get(eq.prim)
    if rule is not None:
        return [frozenset(v) for v in rule(in_vmas, **eq.params)]
    union = frozenset().union(*in_vmas) if in_vmas else frozenset()
    return [union] * len(eq.outputs)


#: Collectives whose result, for an operand replicated over their axes, is local:
#: psum is n * x, the others x itself.
_LOCAL_IF_REPLICATED = (C.psum_p, C.pmean_p, C.pmax_p, C.pmin_p, C.broadcast_p)


def _rank_rule(mesh: Mesh):
    """The walk rule running one equation of a shard_map body on this rank, on
    ``(value, vma)`` pairs: collectives get the mesh, replica markers become
    psums/divisions by what the VMA pass knows, reductions of values already
    replicated stay local; loops and cond have their bodies rewritten the same way."""
    from fshard.primitives.elementwise import div, mul

    names = frozenset(mesh.axis_names)

    def psum_here(x, vma, axes):
        """The psum of ``x`` (varying over ``vma``) over ``axes`` on this rank: a
        collective over the axes where it may differ; over the others, where it is the
        same on every device, n times ``x``."""
        axes = [a for a in mesh.axis_names if a in axes]
        varying = tuple(a for a in axes if a in vma)
        n = math.prod(mesh.axis_size(a) for a in axes if a not in vma)
        out = C.psum_p.bind(x, axis_name=varying, mesh=mesh) if varying else x
        return mul(out, C._scalar(n, out)) if n > 1 else out

    def rule(eq, pairs):
        vals, vmas = zip(*pairs) if pairs else ((), ())
        if eq.prim in _BODY_RULES:
            outs, out_vmas = _BODY_RULES[eq.prim](eq, list(vals), list(vmas), rule)
            return [(o, frozenset(m) & names) for o, m in zip(outs, out_vmas, strict=True)]
        out_vmas = _vma_out(eq, list(vmas))
        if eq.prim is C.replica_sum_p:  # the shares of an input replicated over axes
            outs = [psum_here(vals[0], vmas[0], [a for a in eq.params["axis_name"]
                                                 if a not in vmas[1]])]
        elif eq.prim is C.replica_split_p:
            n = math.prod(mesh.axis_size(a) for a in eq.params["axis_name"]
                          if a not in vmas[1])
            outs = [div(vals[0], C._scalar(n, vals[0])) if n > 1 else vals[0]]
        elif eq.prim in _LOCAL_IF_REPLICATED and not (vmas[0] & set(eq.params["axis_name"])):
            # the operand is the same on every device of the axes: no communication
            outs = [psum_here(vals[0], vmas[0], eq.params["axis_name"])
                    if eq.prim is C.psum_p else vals[0]]
        else:
            outs = bind_on_rank(eq, vals, mesh)
        return [(o, m & names) for o, m in zip(outs, out_vmas, strict=True)]

    return rule


# Loop bodies and cond branches: each is staged again as this rank's Program, walked
# with the VMA state of its inputs. A loop's carry is walked to a fixed point: a carry
# the body makes varying over an axis is varying at entry too (the first iteration
# cannot know it is the last one that stays replicated), so the rewrite of the body is
# valid for every iteration, and the loop stays one loop.


def _body_on_rank(program, in_vmas, rule) -> tuple:
    """``program`` (closed) as this rank's closed Program: ``(body, consts, out_vmas)``,
    the body taking ``consts`` (values it now closes over, e.g. scalars) first."""
    box = []

    def fn(*xs):
        outs = walk(program, list(zip(xs, in_vmas, strict=True)), rule,
                    "running a loop body or cond branch on its rank:",
                    literal=lambda a: (a.value, frozenset()))
        box.append([m for _, m in outs])
        return [v for v, _ in outs]

    body, consts = _stage_closed(fn, program.in_avals)
    return body, consts, box[0]


def _fixed_point(stage_with, carry_vmas: list):
    """Grow the carry's VMA until the body (``stage_with(carry_vmas) -> (result,
    carry_out_vmas)``) keeps it; at most one round per mesh axis and carry."""
    while True:
        result, out = stage_with(carry_vmas)
        grown = [frozenset(a | b) for a, b in zip(carry_vmas, out, strict=True)]
        if grown == carry_vmas:
            return result, carry_vmas
        carry_vmas = grown


def _scan_on_rank(eq, vals, vmas, rule):
    p = eq.params
    n_c, n_k = p["n_consts"], p["n_carry"]
    c_m, k_m, x_m = vmas[:n_c], vmas[n_c:n_c + n_k], vmas[n_c + n_k:]

    def stage_with(k):
        staged = _body_on_rank(p["body"], c_m + k + x_m, rule)
        return staged, staged[2][:n_k]

    (body, extra, out_m), k_m = _fixed_point(stage_with, [frozenset(m) for m in k_m])
    outs = scan_p.bind(*extra, *vals, **dict(p, body=body, n_consts=len(extra) + n_c))
    return outs, k_m + out_m[n_k:]


def _while_on_rank(eq, vals, vmas, rule):
    p = eq.params
    n_cc, n_bc = p["n_cond_consts"], p["n_body_consts"]
    cc, bc, carry = vals[:n_cc], vals[n_cc:n_cc + n_bc], vals[n_cc + n_bc:]
    cc_m, bc_m, k_m = vmas[:n_cc], vmas[n_cc:n_cc + n_bc], vmas[n_cc + n_bc:]

    def stage_with(k):
        # a predicate varying over an axis runs a different number of iterations on its
        # devices: every carry then varies over it
        cond = _body_on_rank(p["cond"], cc_m + k, rule)
        body = _body_on_rank(p["body"], bc_m + k, rule)
        return (cond, body), [m | cond[2][0] for m in body[2]]

    ((cond, c_extra, _), (body, b_extra, _)), k_m = _fixed_point(
        stage_with, [frozenset(m) for m in k_m])
    outs = while_p.bind(*c_extra, *cc, *b_extra, *bc, *carry,
                        **dict(p, cond=cond, body=body, n_cond_consts=len(c_extra) + n_cc,
                               n_body_consts=len(b_extra) + n_bc))
    return outs, k_m


def _cond_on_rank(eq, vals, vmas, rule):
    p = eq.params
    staged = [_body_on_rank(b, vmas[1:], rule) for b in p["branches"]]
    extras = [c for _, consts, _ in staged for c in consts]
    # every branch takes every branch's new constants, then the operands
    avals = [typeof(c) for c in extras] + list(p["branches"][0].in_avals)
    branches, offset = [], 0
    for body, consts, _ in staged:
        lo, n_extra = offset, len(consts)

        def call(*xs, body=body, lo=lo, n=n_extra):
            return eval_program(body, *xs[lo:lo + n], *xs[len(extras):])

        closed, more = _stage_closed(call, avals)
        assert not more, "a call of closed programs closes over nothing"
        branches.append(closed)
        offset += n_extra
    outs = cond_p.bind(vals[0], *extras, *vals[1:],
                       **dict(p, branches=tuple(branches), n_consts=len(extras) + p["n_consts"]))
    # a varying index takes different branches on different devices
    out_m = [frozenset(vmas[0]).union(*(s[2][j] for s in staged))
             for j in range(len(outs))]
    return outs, out_m


_BODY_RULES = {scan_p: _scan_on_rank, while_p: _while_on_rank, cond_p: _cond_on_rank}


def _run_body_on_rank(sm, program, args, in_vmas, out_dims, mesh: Mesh, out_names):
    """Interpret the body into the current trace with ``_rank_rule`` and check that
    outputs promised replicated are."""
    rule = _rank_rule(mesh)
    outs = walk(program, list(zip(args, in_vmas, strict=True)), rule,
                f"running shard_map({sm.name}) on its rank:",
                literal=lambda a: (a.value, frozenset()))
    results = []
    for j, ((value, vma), dims) in enumerate(zip(outs, out_dims)):
        extra = [n for n in mesh.axis_names if n in vma and n not in _axes_of(dims)]
        if extra and sm.check_vma:
            raise _varying_output_error(sm, out_names[j], extra[0], dims)
        results.append(value)
    return results


# ---------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------


class ShardMapped:
    """The callable returned by ``fs.shard_map``."""

    def __init__(self, fun, in_strategy, out_strategy, mesh, check_vma):
        self.fun = fun
        self.name = fun_name(fun)
        if not isinstance(in_strategy, (tuple, list)):
            raise ShardingError(
                f"shard_map({self.name}): in_strategy must be a tuple with one entry per "
                f"positional argument, got {in_strategy!r}.\nFix: e.g. in_strategy="
                "((4, 1), None) for f(x, w); a function of one argument needs a 1-tuple: "
                "in_strategy=((4, 1),).")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise ShardingError(
                f"shard_map({self.name}): mesh must be an fs.Mesh or None, got {mesh!r}.\n"
                "Fix: mesh=fs.Mesh((4,), ('dp',)).")
        self.in_strategy = tuple(in_strategy)
        self.out_strategy = out_strategy
        self.mesh = mesh
        self.check_vma = bool(check_vma)
        self._jitted = None
        functools.update_wrapper(self, fun, updated=())

    def __repr__(self) -> str:
        return f"fs.shard_map({self.name})"

    # -- mesh and strategies ------------------------------------------------------

    def _resolve_mesh(self) -> Mesh:
        if self.mesh is not None:
            return self.mesh
        entries = tree.flatten(self.in_strategy, is_leaf=is_strategy_leaf)[0]
        views = [e for e in entries if isinstance(e, Layout)]
        if views and current_mesh() is None:
            v = views[0]  # the mesh the Layout describes
            return Mesh(v.device_matrix, v.alias_name)
        return resolve_mesh(None)

    def _in_dims(self, args, mesh):
        from fshard.transforms.vmap import arg_path, type_tree

        if len(args) != len(self.in_strategy):
            raise ShardingError(
                f"shard_map({self.name}): in_strategy has {len(self.in_strategy)} entries but "
                f"the function was called with {len(args)} positional arguments.\nFix: give "
                "one entry (a strategy, a Layout view or None) per positional argument.")
        out = []
        for i, (entry, a) in enumerate(zip(self.in_strategy, args)):
            try:
                flat = broadcast_strategies(entry, tree.structure(a))
            except ValueError:
                raise ShardingError(
                    f"shard_map({self.name}): in_strategy[{i}] = {entry!r} is neither a "
                    f"strategy nor a pytree prefix of {arg_path(self.fun, i)}, which is "
                    f"{type_tree(a)}.\nFix: one strategy for the whole argument, or its "
                    "containers with a strategy at each leaf.") from None
            paths, leaves, _ = tree.flatten_with_path(a)
            for p, x, e in zip(paths, leaves, flat):
                where = f"shard_map({self.name}): in_strategy[{i}]" + (
                    f" (for {arg_path(self.fun, i, p)})" if p else "")
                aval = typeof(x)
                dims = mesh_dims(e, aval.ndim, mesh, where)
                for k, (n, axes) in enumerate(zip(aval.shape, dims)):
                    c = _count(axes, mesh)
                    if isinstance(n, int) and n % c:
                        raise ShardingError(
                            f"{where} splits dimension {k} of {arg_path(self.fun, i, p)} "
                            f"({aval}) over mesh axes {axes} ({c} devices), but {n} is not "
                            f"divisible by {c}. Each dimension split over mesh axes must be "
                            f"divisible by their total size.\nFix: pad dimension {k} to a "
                            f"multiple of {c}, or split it over fewer devices.")
                out.append(dims)
        return out

    def _out_dims(self, out_tree, out_avals, mesh):
        skeleton = tree.unflatten(out_tree, list(range(len(out_avals))))
        strat = self.out_strategy
        if (out_tree.is_leaf() and isinstance(strat, (tuple, list)) and len(strat) == 1
                and not is_strategy_leaf(strat) and is_strategy_leaf(strat[0])):
            strat = strat[0]  # MindSpore's tuple of one strategy for a single output
        try:
            flat = broadcast_strategies(strat, out_tree)
        except ValueError:
            raise ShardingError(
                f"shard_map({self.name}): out_strategy = {self.out_strategy!r} is not a "
                f"strategy nor a pytree prefix of the output, which is "
                f"{tree.unflatten(out_tree, [str(a) for a in out_avals])} (per device).\n"
                "Fix: one strategy per output leaf (None: replicated), in the output's "
                "containers, e.g. out_strategy=((), None) for (loss, grads).") from None
        paths = tree.flatten_with_path(skeleton)[0]
        names = [f"output{tree.keystr(p)}" if p else "the output" for p in paths]
        dims = [mesh_dims(e, a.ndim, mesh, f"shard_map({self.name}): out_strategy for {n}")
                for e, a, n in zip(flat, out_avals, names)]
        return dims, names

    # -- calling ------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise ShardingError(
                f"shard_map({self.name}) takes positional arguments only (in_strategy has "
                f"one entry per position); got keyword arguments {sorted(kwargs)}.")
        if context.shard_map_depth.get():
            raise CompositionError(
                f"shard_map({self.name}) is called inside another fs.shard_map body, which "
                "fshard does not allow.\nAllowed form: one fs.shard_map over all the mesh "
                "axes, with collectives naming them inside.")
        mesh = self._resolve_mesh()
        if not mesh.is_virtual and type(current_trace()) is EvalTrace:
            # Collectives run only in compiled graphs: compile the whole shard_map.
            if self._jitted is None:
                from fshard.transforms.jit import jit

                self._jitted = jit(functools.wraps(self.fun)(lambda *a: self._call(a)))
            return self._jitted(*args)
        return self._call(args)

    def _call(self, args):
        mesh = self._resolve_mesh()
        if not mesh.is_virtual:
            from fshard.meshes import distributed

            if mesh.size != distributed.world_size():
                raise ShardingError(
                    f"shard_map({self.name}): the mesh {mesh!r} has {mesh.size} devices but "
                    f"this job has {distributed.world_size()} processes (one device each).\n"
                    f"Fix: use a mesh of {distributed.world_size()} devices, or "
                    "fs.Mesh(..., virtual=True) to simulate it in each process.")
        in_dims = self._in_dims(args, mesh)
        leaves, in_tree = tree.flatten((tuple(args), {}))
        local = []
        for x, dims in zip(leaves, in_dims):
            a = typeof(x)
            local.append(ArrayType(tuple(n // _count(d, mesh) for n, d in zip(a.shape, dims)),
                                   a.dtype))
        outer = {a.name for a in C.bound_axes()}
        with contextlib.ExitStack() as stack:
            for name, size in zip(mesh.axis_names, mesh.shape):
                stack.enter_context(C.named_axis(name, size))
            stack.enter_context(context.counted(context.shard_map_depth))
            stack.enter_context(C.replica_axes_of_body(mesh.axis_names))
            traced = trace_fun(self.fun, in_tree, local)
        program = traced.program
        self._check_axis_names(program, mesh, outer)
        out_dims, out_names = self._out_dims(traced.out_tree, program.out_avals, mesh)
        n_c = len(traced.consts)
        with contextlib.ExitStack() as stack:
            for name, size in zip(mesh.axis_names, mesh.shape):
                stack.enter_context(C.named_axis(name, size))
            stack.enter_context(context.counted(context.shard_map_depth))
            if mesh.is_virtual:
                axes = list(zip(mesh.axis_names, mesh.shape))
                blocks = [to_blocks(x, d, axes) for x, d in zip(leaves, in_dims)]
                splits = [frozenset()] * n_c + [_axes_of(d) for d in in_dims]

                def varying(j, axis):
                    if self.check_vma:
                        raise _varying_output_error(self, out_names[j], axis, out_dims[j])

                outs = run_batched(program, list(traced.consts) + blocks, splits,
                                   [_axes_of(d) for d in out_dims], axes, varying)
                outs = [from_blocks(y, d, axes) for y, d in zip(outs, out_dims)]
            else:
                consts = [C.shard_in_p.bind(c, dims=((),) * typeof(c).ndim, mesh=mesh)
                          if isinstance(c, Tracer) else c for c in traced.consts]
                blocks = [C.shard_in_p.bind(x, dims=d, mesh=mesh)
                          for x, d in zip(leaves, in_dims)]
                vmas = [frozenset()] * n_c + [_axes_of(d) for d in in_dims]
                outs = _run_body_on_rank(self, program, consts + blocks, vmas, out_dims, mesh,
                                         out_names)
                outs = [C.shard_out_p.bind(y, dims=d, mesh=mesh)
                        for y, d in zip(outs, out_dims)]
        return tree.unflatten(traced.out_tree, outs)

    def _check_axis_names(self, program, mesh, outer):
        known = set(mesh.axis_names) | outer
        for eq in program.equations:
            names = eq.params.get("axis_name") if eq.prim in C.NAMED_AXIS_PRIMITIVES else None
            for n in names or ():
                if n not in known:
                    raise AxisNameError(
                        f"shard_map({self.name}): the body calls fs.{eq.prim.name} over the "
                        f"axis {n!r}, which is not an axis of the mesh {mesh!r} (axes "
                        f"{mesh.axis_names!r}).\nFix: name one of the mesh's axes, or add "
                        f"{n!r} to the mesh." + (f" (called at {eq.source})" if eq.source
                                                 else ""))


def shard_map(f, in_strategy, out_strategy, mesh: Mesh | None = None, *,
              check_vma: bool = True) -> ShardMapped:
    """Run ``f`` on every device's block of its inputs; ``f`` communicates with
    collectives over the mesh axes (NB: ``jax.shard_map``).

    >>> import numpy as np, fshard as fs
    >>> mesh = fs.Mesh((4,), ("dp",))
    >>> def local_sum(x):                  # x: this device's block, f32[2]
    ...     return fs.psum(x.sum(), "dp")
    >>> f = fs.shard_map(local_sum, in_strategy=((4,),), out_strategy=(), mesh=mesh)
    >>> float(f(np.arange(8, dtype=np.float32)).asnumpy())
    28.0

    Args:
        f: a function of the local blocks (pytrees of arrays), returning a pytree.
        in_strategy: one entry per positional argument, applied to each of its arrays
            (or a pytree prefix of the argument): a tuple of split counts per dimension
            (``(4, 1)``; counts take mesh axes in order, see docs/shard_map.md), a
            ``fs.Layout`` view naming mesh axes (``layout("dp", "None")``), or None
            (replicated: every device gets the whole value).
        out_strategy: the same for the outputs (a pytree prefix of ``f``'s output);
            ``()`` for a replicated scalar. A dimension not split over a mesh axis is
            promised equal on every device of that axis.
        mesh: an ``fs.Mesh``; default: the mesh the Layout views describe, else
            ``with fs.Mesh(...)``, the launcher's world, or ``FSHARD_DEVICES``.
        check_vma: check that outputs promised replicated do not vary over any axis.

    Returns:
        A callable taking the global inputs and returning the global outputs.

    Raises:
        ShardingError: a strategy of the wrong rank, a dimension not divisible by its
            split, an axis the mesh lacks, or an output varying over an axis its
            out_strategy does not split.
        AxisNameError: ``f`` names an axis that no mesh or enclosing vmap binds.
        CompositionError: a shard_map inside another shard_map's body.

    See also: ``fs.psum`` and the other collectives; docs/shard_map.md.
    """
    if isinstance(f, ShardMapped):
        raise CompositionError(
            f"fs.shard_map was applied to {f!r}, which is already a shard_map; nesting is "
            "not allowed.\nAllowed form: one fs.shard_map over all the mesh axes.")
    if not callable(f):
        raise ShardingError(f"shard_map expects a function, got {type(f).__name__}.")
    return ShardMapped(f, in_strategy, out_strategy, mesh, check_vma)
