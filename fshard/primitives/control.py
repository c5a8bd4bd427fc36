"""Call primitives that carry a body Program: ``custom_jvp`` and ``custom_vjp``.

``fs.custom_jvp`` and ``fs.custom_vjp`` let users replace the derivative fshard
would compute (NB: ``jax.custom_jvp`` / ``jax.custom_vjp``, same calling
conventions). Under any transform the decorated function is staged as one
equation of a call primitive whose parameters are closed Programs: the body and
the user's rules, staged when the function is called. Staging the rules at call
time (initial style) makes every value they close over an explicit operand, so
the rules survive any later transform: ``vmap`` batches the body *and* the rules,
``grad(vmap(f))`` still uses the custom derivative, and ``jit`` lowers the body as
a helper function of the generated module.

Primitives: ``custom_jvp_call``, ``custom_vjp_call`` and ``custom_lin`` (the
linear stand-in for a custom_vjp's derivative: transposing it runs ``bwd``).
The batching rules re-enter the batching interpreter (``fshard.core.interpret``) on the
bodies.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

from fshard.core import dtypes, tree
from fshard.core.tracing import ArrayType, EvalTrace, current_trace, typeof
from fshard.errors import DifferentiationError, ProgramTypeError
from fshard.core.interpret import batch_program, current_axis, eval_program
from fshard.core.ir import Literal, Program
from fshard.primitives.base import (Zero, batch_size, batch_to_front, def_primitive, instantiate,
                                    move_axis)
from fshard.primitives.structural import broadcast_to, expand_dims, getitem, stack, zeros
from fshard.core.rules import batching, sharding, transpose, unsupported
from fshard.core.rules import jvp as jvp_rules
from fshard.core.factors import FactorSpec
from fshard.core.staging import fun_name, stage

FAMILY = "control"


# ---------------------------------------------------------------------------
# Closed Programs: every value a staged function closes over becomes an input
# ---------------------------------------------------------------------------


def _stage_closed(fn, in_avals) -> tuple[Program, list]:
    """Stage ``fn(*flat) -> list`` into a Program whose inputs are ``consts + args``
    (``n_consts == 0``: the constants are ordinary inputs) and the constants' values."""
    program, consts = stage(fn, in_avals)
    return Program(program.inputs, program.equations, program.outputs), consts


def _split(xs, *counts):
    out, i = [], 0
    for n in counts:
        out.append(list(xs[i:i + n]))
        i += n
    out.append(list(xs[i:]))
    return out


def _resolve_args(fun, args, kwargs, api):
    """Keyword arguments become positional (NB: JAX's resolve_kwargs)."""
    if not kwargs:
        return tuple(args)
    try:
        bound = inspect.signature(fun).bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise DifferentiationError(
            f"{api} function {fun_name(fun)} was called with arguments that do not match "
            f"its signature: {e}") from None
    bound.apply_defaults()
    if bound.kwargs:
        raise DifferentiationError(
            f"{api} function {fun_name(fun)} has keyword-only parameters "
            f"{sorted(bound.kwargs)}; {api} functions take their arrays positionally.\n"
            "Fix: make them positional parameters.")
    return tuple(bound.args)


def _split_nondiff(args, nondiff_argnums):
    nums = {i % len(args) for i in nondiff_argnums} if args else set()
    nondiff = [args[i] for i in sorted(nums)]
    diff = [a for i, a in enumerate(args) if i not in nums]
    return nondiff, diff, sorted(nums)


def _merge_args(nondiff, nums, diff):
    it_n, it_d = iter(nondiff), iter(diff)
    return [next(it_n) if i in nums else next(it_d) for i in range(len(nondiff) + len(diff))]


def _describe(x) -> str:
    """``a tuple of length 3`` / ``f32[3]``: what a rule returned, for error messages."""
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of length {len(x)}"
    try:
        return str(typeof(x))
    except Exception:  # noqa: BLE001  (not an array: its Python type says enough)
        return type(x).__name__


def _check_same_types(api, fname, what, got_leaves, got_tree, want_avals, want_tree,
                      want_what):
    if got_tree != want_tree:
        raise DifferentiationError(
            f"{api} rule of {fname}: {what} must have the structure of {want_what}, "
            f"{want_tree}; got {got_tree}.")
    for i, (x, a) in enumerate(zip(got_leaves, want_avals)):
        t = typeof(x)
        if tuple(t.shape) != tuple(a.shape) or t.dtype != a.dtype:
            raise DifferentiationError(
                f"{api} rule of {fname}: leaf {i} of {what} has type {t}, but the "
                f"matching leaf of {want_what} has type {a}; they must be equal.\nFix: "
                "return arrays of the same shape and dtype (cast or broadcast them).")


def _closure_tangent_error(name, api):
    return DifferentiationError(
        f"{api} function {name} closes over a value that is being differentiated (a "
        "traced array captured from an enclosing scope, not passed as an argument). "
        "Its custom rule only sees its arguments, so that derivative would be lost.\n"
        "Fix: pass the value to the function as an explicit argument.")


# ---------------------------------------------------------------------------
# Helpers shared by the batching rules
# ---------------------------------------------------------------------------


def _batched_aval(a: ArrayType, d, size) -> ArrayType:
    return a if d is None else ArrayType((size,) + tuple(a.shape), a.dtype)


def _batch_closed(program: Program, dims: list, size: int, out_policy):
    """Stage the batched version of a closed ``program`` whose inputs have batch dims
    ``dims`` (each ``0`` or ``None``). ``out_policy(out_dims)`` turns each output's
    batch dim into the dim it must have (``0`` or ``None``).

    Returns ``(program, consts, out_dims)``.
    """
    # Batching a body re-enters the batching interpreter (NB: JAX's call-primitive
    # batchers call batching.batch_jaxpr the same way).
    axis = current_axis(size)
    in_avals = [_batched_aval(v.aval, d, size) for v, d in zip(program.inputs, dims)]
    box = []

    def fn(*xs):
        outs, out_dims = batch_program(program, list(xs), list(dims), axis)
        want = out_policy(out_dims)
        box.append(want)
        res = []
        for o, d, w in zip(outs, out_dims, want, strict=True):
            if w is None:
                assert d is None, "an output asked to be unbatched is batched"
                res.append(o)
            else:
                res.append(batch_to_front(o, d, size))
        return res

    closed, consts = _stage_closed(fn, in_avals)
    return closed, consts, box[0]


def _all_front(out_dims):
    return [0] * len(out_dims)


def _front_args(args, dims):
    """Move every batched operand's batch dim to 0."""
    return ([x if d is None else move_axis(x, d, 0) for x, d in zip(args, dims)],
            [None if d is None else 0 for d in dims])


# ---------------------------------------------------------------------------
# Lowering (shared): the body becomes a helper function of the generated module
# ---------------------------------------------------------------------------


def _body_operands(args, params) -> list:
    """The operands of a call equation that its body reads: its own constants and the
    arguments (the rules' constants sit between them)."""
    if "n_body_consts" in params:  # custom_jvp_call
        nb, n_rules = params["n_body_consts"], params["n_jvp_consts"]
    else:  # custom_vjp_call
        nb, nf, nw = params["n_consts"]
        n_rules = nf + nw
    return list(args[:nb]) + list(args[nb + n_rules:])


def _call_lowering(ctx, *exprs, body, **params):
    helper = ctx.function(body, "call")
    return f"{helper}({', '.join(_body_operands(exprs, params))})"


def _body_type(*avals, body, **_):
    return list(body.out_avals)


def _body_impl(*args, body, **params):
    return eval_program(body, *_body_operands(args, params))


def _call_sharding(avals, out_avals):
    """Sharding of a call primitive: every device runs the whole call on replicated
    operands. The equation then stays one equation of the per-device program, so its
    custom derivative still applies under ``grad(shard(f))``; splitting its body would
    need the body partitioned as a program of its own."""
    points = sum(math.prod(a.shape) for a in out_avals if a.is_static)
    return FactorSpec([(None,) * a.ndim for a in avals],
                      [(None,) * a.ndim for a in out_avals], {},
                      flops_per_point=float(max(points, 1)))


class BodyLinks:
    """Which dimensions of a body's values one factor ties together (a union-find over
    ``(value, dim)``), for the sharding rules of primitives with bodies (loops, cond).

    Every equation of a body links the dimensions its ``FactorSpec`` gives one
    splittable factor. A class containing a dimension that some equation cannot split
    freely (a contraction whose result is not small, ``SMALL_REDUCTION``; a ``nosplit``
    factor; an unlabelled dimension) or dimensions of different sizes is *blocked*:
    splitting it would make the body communicate a large value on every iteration. The other classes are the primitive's factors: a
    layout splitting them runs the body on local blocks with no communication.
    """

    def __init__(self):
        self.parent: dict = {}
        self.blocked: set = set()
        # Equations whose large reduction may stay a pending sum: id(eq) -> the body
        # output (an accumulator carry, ``accumulators``) the sum flows into linearly.
        self.pending_eqs: dict = {}
        self.pending: dict = {}  # body output index -> keys of the dims reduced into it

    def find(self, k):
        self.parent.setdefault(k, k)
        root = k
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[k] != root:  # path compression
            self.parent[k], k = root, self.parent[k]
        return root

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb
            if ra in self.blocked:
                self.blocked.add(rb)

    def block(self, k) -> None:
        self.blocked.add(self.find(k))

    def values(self, a, b) -> None:
        """Tie every dimension of body values ``a`` and ``b`` (a Literal blocks)."""
        from fshard.core.ir import Var

        nd = a.aval.ndim
        for d in range(nd):
            if isinstance(a, Var) and isinstance(b, Var):
                self.union((a, d), (b, d))
            else:
                for v in (a, b):
                    if isinstance(v, Var):
                        self.block((v, d))

    def program(self, program: Program) -> None:
        """Link the dimensions every equation of ``program`` ties together."""
        from fshard.core.ir import Var

        for eq in program.equations:
            spec = sharding.lookup(eq.prim, transform="shard")(
                *[a.aval for a in eq.inputs], **eq.params)
            free = set(spec.splittable())
            into = self.pending_eqs.get(id(eq))
            if into is not None:  # reduced into an accumulator: a pending sum
                for a, labels in zip(eq.inputs, spec.inputs):
                    if isinstance(a, Var):
                        self.pending.setdefault(into, []).extend(
                            (a, d) for d, lab in enumerate(labels)
                            if lab in spec.reduce and lab in free)
            elif not _small_result(eq):
                free -= set(spec.reduce)
            groups: dict = {}
            for a, labels in zip(list(eq.inputs) + list(eq.outputs),
                                 list(spec.inputs) + list(spec.outputs)):
                if not isinstance(a, Var):
                    continue
                for d, lab in enumerate(labels):
                    if lab is None or lab not in free:
                        self.block((a, d))
                    else:
                        groups.setdefault(lab, []).append((a, d))
            for keys in groups.values():
                for k in keys[1:]:
                    self.union(keys[0], k)

    def spec(self, in_keys: list, out_keys: list, flops: float, partition_call) -> FactorSpec:
        """The primitive's FactorSpec: ``in_keys[i][d]`` / ``out_keys[j][d]`` is the
        ``(body value, dim)`` an operand's / output's dimension d is, or None (never
        split, e.g. a scan's stacking axis)."""
        sizes: dict = {}
        for keys in in_keys + out_keys:
            for k in keys:
                if k is not None:
                    sizes.setdefault(self.find(k), set()).add(k[0].aval.shape[k[1]])
        names: dict = {}

        def label(k):
            if k is None:
                return None
            root = self.find(k)
            if root in self.blocked or len(sizes[root]) != 1:
                return None
            return names.setdefault(root, f"f{len(names)}")

        ins = [tuple(label(k) for k in keys) for keys in in_keys]
        outs = [tuple(label(k) for k in keys) for keys in out_keys]
        used = {lab for labels in ins + outs for lab in labels}
        partial_outputs: dict = {}
        for j, keys in self.pending.items():
            for k in keys:
                root = self.find(k)
                lab = names.get(root)
                if (lab in used and lab not in outs[j] and root not in self.blocked
                        and len(sizes[root]) == 1):
                    partial_outputs.setdefault(j, set()).add(lab)
        factor_sizes = {names[r]: next(iter(sizes[r])) for r in names}
        points = math.prod(int(n) if isinstance(n, int) else 1
                           for n in factor_sizes.values()) or 1
        return FactorSpec(ins, outs, factor_sizes, flops_per_point=max(flops, 1.0) / points,
                          linear=(), partition_call=partition_call,
                          reduce=frozenset(lab for v in partial_outputs.values() for lab in v),
                          partial_outputs={j: frozenset(v) for j, v in partial_outputs.items()})


def accumulators(body: Program, carry_in: list, n_carry: int) -> dict:
    """The carries a loop may hold as a per-device pending sum: ``acc_out = acc_in +
    t`` where ``acc_in`` has no other use, ``acc_out`` is only that carry's output, and
    ``t`` (used only there) comes from a reduction through primitives linear in it.
    Then the final carry is the initial one plus a sum of the ``t``s, and each device
    may sum its share of them, reduced once after the loop.

    Returns ``{id(eq): carry index}`` for the reductions (the equation ending each
    chain) whose sum may stay pending."""
    from fshard.core.factors import linear_groups
    from fshard.core.ir import Var

    uses: dict = {}
    producer: dict = {}
    for eq in body.equations:
        for a in eq.inputs:
            if isinstance(a, Var):
                uses[a] = uses.get(a, 0) + 1
        for v in eq.outputs:
            producer[v] = eq
    for v in body.outputs:
        if isinstance(v, Var):
            uses[v] = uses.get(v, 0) + 1
    out = {}
    for k in range(n_carry):
        acc_in, acc_out = carry_in[k], body.outputs[k]
        eq = producer.get(acc_out) if isinstance(acc_out, Var) else None
        if (eq is None or eq.prim.name != "add" or uses.get(acc_in) != 1
                or uses.get(acc_out) != 1 or not any(a is acc_in for a in eq.inputs)
                or acc_out.aval.dtype == dtypes.bool_):
            continue
        others = [a for a in eq.inputs if a is not acc_in]
        if len(others) != 1 or not isinstance(others[0], Var) \
                or others[0].aval.shape != acc_out.aval.shape:
            continue
        t = others[0]
        while True:
            e = producer.get(t)
            if e is None or uses.get(t) != 1 or len(e.outputs) != 1:
                break
            spec = sharding.lookup(e.prim, transform="shard")(
                *[a.aval for a in e.inputs], **e.params)
            # A small reduction is pending too when it is not a scalar (a bias's or a
            # small weight's gradient summed over micro-batches: one reduction after the
            # loop). A scalar (a loss) is reduced in the body, as before.
            if spec.reduce and (not _small_result(e) or e.outputs[0].aval.ndim):
                if spec.partial_outputs is None:
                    out[id(e)] = k
                break
            # on through a primitive linear in one computed operand, the others given
            computed = [i for i, a in enumerate(e.inputs) if isinstance(a, Var) and a in producer]
            groups = linear_groups(e.prim.name, spec, len(e.inputs))
            if len(computed) != 1 or (computed[0],) not in groups:
                break
            t = e.inputs[computed[0]]
    return out


# A reduction whose result is at most this fraction of its operands (a loss, a norm)
# may run on split operands inside a body: the sum of its partial results is a small
# AllReduce per iteration. Larger results (a matmul's contraction) block the split.
SMALL_REDUCTION = 1 / 64


def _small_result(eq) -> bool:
    def size(vals):
        return sum(math.prod(v.aval.shape) for v in vals)

    avals = [a.aval for a in eq.inputs] + [v.aval for v in eq.outputs]
    if not all(a.is_static for a in avals):
        return False
    return size(eq.outputs) <= max(size(eq.inputs) * SMALL_REDUCTION, 1)


def body_flops(program: Program) -> float:
    """One point per element each equation of ``program`` produces (a rough cost)."""
    total = 0.0
    for eq in program.equations:
        for v in eq.outputs:
            if v.aval.is_static:
                total += float(math.prod(v.aval.shape))
    return total


def dims_keys(v, skip_leading: bool = False) -> list:
    """The ``(value, dim)`` keys of a body value's dimensions (a leading None for an
    operand that stacks it along a leading axis)."""
    keys = [(v, d) for d in range(v.aval.ndim)]
    return ([None] + keys) if skip_leading else keys


def drop_leading(sh):
    """A stacked value's layout without its leading axis (one slice's layout)."""
    import dataclasses

    return dataclasses.replace(sh, dims=tuple(sh.dims[1:]))


def scalar_layout(like):
    """The replicated layout of a scalar (same class as ``like``)."""
    import dataclasses

    return dataclasses.replace(like, dims=(), partial=frozenset())


# ===========================================================================
# custom_jvp_call
# ===========================================================================
#
# Operands: body_consts + jvp_consts + args.
# Params: body (inputs body_consts + args), jvp (inputs jvp_consts + primals +
# tangents, outputs primals_out + tangents_out), n_body_consts, n_jvp_consts, name.

# Type / impl / lowering
custom_jvp_call_p = def_primitive("custom_jvp_call", FAMILY, _body_type, _body_impl,
                                  multiple_results=True, lower=_call_lowering)


# Batching
def _custom_jvp_call_batching(args, dims, *, body, jvp, n_body_consts, n_jvp_consts, name):
    """Batch the body and the JVP rule alike; a tangent is batched like its primal."""
    size = batch_size(args, dims)
    args, dims = _front_args(args, dims)
    bc, jc, xs = _split(args, n_body_consts, n_jvp_consts)
    dbc, djc, dxs = _split(dims, n_body_consts, n_jvp_consts)
    new_body, b_consts, _ = _batch_closed(body, dbc + dxs, size, _all_front)
    new_jvp, j_consts, _ = _batch_closed(jvp, djc + dxs + dxs, size, _all_front)
    outs = custom_jvp_call_p.bind(
        *b_consts, *bc, *j_consts, *jc, *xs, body=new_body, jvp=new_jvp,
        n_body_consts=len(b_consts) + len(bc), n_jvp_consts=len(j_consts) + len(jc),
        name=name)
    return outs, [0] * len(outs)


batching.set(custom_jvp_call_p, _custom_jvp_call_batching)


# Autodiff
def _custom_jvp_call_jvp(primals, tangents, *, body, jvp, n_body_consts, n_jvp_consts, name):
    """Run the user's rule (staged as ``jvp``) instead of differentiating the body."""
    n_c = n_body_consts + n_jvp_consts
    if not all(isinstance(t, Zero) for t in tangents[:n_c]):
        raise _closure_tangent_error(name, "custom_jvp")
    jc = primals[n_body_consts:n_c]
    xs = primals[n_c:]
    ts = [instantiate(t) for t in tangents[n_c:]]
    outs = eval_program(jvp, *jc, *xs, *ts)
    n_out = len(body.outputs)
    return outs[:n_out], outs[n_out:]


jvp_rules.set(custom_jvp_call_p, _custom_jvp_call_jvp)
unsupported(custom_jvp_call_p, "transpose",
            "not linear: its JVP rule replaces it before transposition")
sharding.set(custom_jvp_call_p,
             lambda *avals, body, **_: _call_sharding(avals, body.out_avals))


# ===========================================================================
# custom_vjp_call and custom_lin
# ===========================================================================
#
# custom_vjp_call operands: body_consts + fwd_consts + bwd_consts + args.
# Params: body (inputs body_consts + args), fwd (inputs fwd_consts + args, outputs
# outs + residuals), bwd (inputs bwd_consts + residuals + cts_out, outputs one
# cotangent per arg), n_consts = (n_body, n_fwd, n_bwd), n_res, name.
#
# Its JVP runs ``fwd`` and emits ``custom_lin(bwd_consts, residuals, tangents)``:
# a linear primitive with no forward evaluation. Reverse mode transposes it, which
# runs ``bwd``; evaluating it (forward mode) is an error, as in JAX.

custom_vjp_call_p = def_primitive("custom_vjp_call", FAMILY, _body_type, _body_impl,
                                  multiple_results=True, lower=_call_lowering)


# Batching
def _custom_vjp_call_batching(args, dims, *, body, fwd, bwd, n_consts, n_res, name):
    """Batch body, fwd and bwd. bwd's cotangent for an unbatched argument is the sum
    over the batch of the per-example cotangents."""
    from fshard.primitives.reductions import reduce_sum

    size = batch_size(args, dims)
    args, dims = _front_args(args, dims)
    nb, nf, nw = n_consts
    bc, fc, wc, xs = _split(args, nb, nf, nw)
    dbc, dfc, dwc, dxs = _split(dims, nb, nf, nw)
    n_out = len(body.outputs)
    new_body, b_consts, _ = _batch_closed(body, dbc + dxs, size, _all_front)
    # Primal outputs go to the front; residuals keep "unbatched" where they are.
    new_fwd, f_consts, f_dims = _batch_closed(
        fwd, dfc + dxs, size,
        lambda ds: [0] * n_out + [None if d is None else 0 for d in ds[n_out:]])
    res_dims = f_dims[n_out:]

    def ct_policy(ds):
        # Batched argument: cotangent at 0. Unbatched: summed below, so any dim.
        return [0 if dx is not None else (None if d is None else 0)
                for d, dx in zip(ds, dxs, strict=True)]

    new_bwd, w_consts, ct_dims = _batch_closed(bwd, dwc + res_dims + [0] * n_out, size,
                                               ct_policy)
    sum_dims = tuple(dx is None and d is not None for d, dx in zip(ct_dims, dxs))
    if any(sum_dims):
        new_bwd = _sum_unbatched(new_bwd, sum_dims, reduce_sum)
    outs = custom_vjp_call_p.bind(
        *b_consts, *bc, *f_consts, *fc, *w_consts, *wc, *xs,
        body=new_body, fwd=new_fwd, bwd=new_bwd,
        n_consts=(len(b_consts) + len(bc), len(f_consts) + len(fc), len(w_consts) + len(wc)),
        n_res=n_res, name=name)
    return outs, [0] * len(outs)


def _sum_unbatched(bwd: Program, which: tuple, reduce_sum) -> Program:
    """``bwd`` with the chosen outputs summed over their leading (batch) axis."""
    def fn(*xs):
        outs = eval_program(bwd, *xs)
        return [reduce_sum(o, 0) if s else o for o, s in zip(outs, which)]

    closed, consts = _stage_closed(fn, bwd.in_avals)
    assert not consts, "summing bwd outputs captured a constant"
    return closed


batching.set(custom_vjp_call_p, _custom_vjp_call_batching)


# Autodiff
def _custom_vjp_call_jvp(primals, tangents, *, body, fwd, bwd, n_consts, n_res, name):
    """Primal outputs from ``fwd``; tangents from ``custom_lin``, which only reverse
    mode can evaluate (by transposing it into ``bwd``)."""
    nb, nf, nw = n_consts
    n_c = nb + nf + nw
    if not all(isinstance(t, Zero) for t in tangents[:n_c]):
        raise _closure_tangent_error(name, "custom_vjp")
    _, fc, wc, xs = _split(primals, nb, nf, nw)
    ts = [instantiate(t) for t in tangents[n_c:]]
    n_out = len(body.outputs)
    outs_res = eval_program(fwd, *fc, *xs)
    outs, res = outs_res[:n_out], outs_res[n_out:]
    t_outs = custom_lin_p.bind(*wc, *res, *ts, bwd=bwd, n_consts=nw, n_res=n_res,
                               out_types=tuple(body.out_avals), name=name)
    return outs, t_outs


jvp_rules.set(custom_vjp_call_p, _custom_vjp_call_jvp)
unsupported(custom_vjp_call_p, "transpose",
            "not linear: its JVP (custom_lin) is what gets transposed")
sharding.set(custom_vjp_call_p,
             lambda *avals, body, **_: _call_sharding(avals, body.out_avals))


def _forward_mode_error(name):
    return DifferentiationError(
        f"can't apply forward-mode differentiation (jvp, jacfwd, hessian) to the "
        f"custom_vjp function {name}: it defines only a reverse-mode rule (fwd/bwd).\n"
        "Fix: use reverse mode (fs.grad, fs.vjp, fs.jacrev), or define the derivative "
        "with fs.custom_jvp, which serves both modes.")


def _custom_lin_type(*avals, out_types, **_):
    return list(out_types)


def _custom_lin_impl(*args, name, **_):
    raise _forward_mode_error(name)


def _custom_lin_lowering(ctx, *exprs, name, **_):
    raise _forward_mode_error(name)


custom_lin_p = def_primitive("custom_lin", FAMILY, _custom_lin_type, _custom_lin_impl,
                             multiple_results=True, lower=_custom_lin_lowering)


def _custom_lin_batching(args, dims, *, name, **_):
    # custom_lin only exists in tangent programs of forward mode: reverse mode
    # transposes it away before any vmap can see it.
    raise _forward_mode_error(name)


batching.set(custom_lin_p, _custom_lin_batching)


def _custom_lin_transpose(cts, *args, bwd, n_consts, n_res, out_types, name):
    """ct of the tangents = bwd(residuals, ct of the outputs)."""
    wc, res, _ = _split(args, n_consts, n_res)
    cts = [instantiate(c) for c in cts]
    cts_in = eval_program(bwd, *wc, *res, *cts)
    return [None] * (n_consts + n_res) + list(cts_in)


transpose.set(custom_lin_p, _custom_lin_transpose)
unsupported(custom_lin_p, "jvp", "forward mode through a custom_vjp function is undefined")
# Linear programs that grad(shard(f)) partitions contain it: replicated, like the call.
sharding.set(custom_lin_p,
             lambda *avals, out_types, **_: _call_sharding(avals, list(out_types)))


# ===========================================================================
# scan: a loop over the leading axis of its xs, one graph loop under jit
# ===========================================================================
#
# Operands: consts + carry + xs (each x stacked along a leading axis of ``length``).
# Params: body (consts + carry + one slice of each x -> carry + one y each), length,
# reverse, unroll (body copies per iteration of the graph loop), n_consts, n_carry.
# Results: the final carry, then each y stacked along a leading axis of ``length``.
#
# fs.scan binds it where a graph loop is the better form (the rule and its
# measurements: docs/control_flow.md); elsewhere it unrolls. Its JVP rule, which
# needs the JVP interpreter, sits with fs.scan in fshard.transforms.control_flow.


def _scan_type(*avals, body, length, reverse, unroll, n_consts, n_carry):
    carry = list(avals[n_consts:n_consts + n_carry])
    outs = list(body.out_avals)
    if outs[:n_carry] != carry:
        raise ProgramTypeError(
            f"scan: the body returns the carry {tuple(str(a) for a in outs[:n_carry])} for "
            f"a carry of {tuple(str(a) for a in carry)}; they must be equal.")
    for a in avals[n_consts + n_carry:]:
        if not a.ndim or a.shape[0] != length:
            raise ProgramTypeError(f"scan: every x must have a leading axis of the length "
                                   f"{length}, got {a}.")
    return carry + [ArrayType((length,) + tuple(a.shape), a.dtype) for a in outs[n_carry:]]


def _scan_order(length, reverse):
    return reversed(range(length)) if reverse else range(length)


def _scan_impl(*args, body, length, reverse, unroll, n_consts, n_carry):
    consts, carry, xs = _split(list(args), n_consts, n_carry)
    ys = [None] * length
    for i in _scan_order(length, reverse):
        outs = eval_program(body, *consts, *carry, *[getitem(x, i) for x in xs])
        carry, ys[i] = outs[:n_carry], outs[n_carry:]
    y_avals = body.out_avals[n_carry:]
    if length == 0:
        return carry + [zeros((0,) + tuple(a.shape), a.dtype) for a in y_avals]
    return carry + [stack([ys[i][k] for i in range(length)]) for k in range(len(y_avals))]


def _scan_lowering(ctx, *exprs, body, length, reverse, unroll, n_consts, n_carry):
    helper = ctx.scan_function(body, length, reverse, unroll, n_consts, n_carry)
    return f"{helper}({', '.join(exprs)})"


scan_p = def_primitive("scan", FAMILY, _scan_type, _scan_impl, multiple_results=True,
                       lower=_scan_lowering)


def _batch_carry_fixed_point(stage_with, batched: list):
    """Which carries a batched loop must batch: those batched at entry, grown until the
    body (``stage_with(batched) -> (result, carry_out_batched)``) keeps them. A carry the
    body never batches (e.g. a ``psum`` over the axis being batched) stays unbatched, so
    a replicated value stays replicated through the loop."""
    while True:
        result, out = stage_with(batched)
        grown = [b or o for b, o in zip(batched, out, strict=True)]
        if grown == batched:
            return result, batched
        batched = grown


def _scan_batching(args, dims, *, body, length, reverse, unroll, n_consts, n_carry):
    """The scan of the batched body: a carry batched at entry or by the body (a fixed
    point) has its batch axis in front, a batched x on its axis 1 (axis 0 is the
    scan's), so each slice is batched in front; a y the body batches comes out batched
    on axis 1, the others unbatched."""
    size = batch_size(args, dims)
    consts, carry, xs = _split(list(args), n_consts, n_carry)
    dc, dcarry, dxs = _split(list(dims), n_consts, n_carry)
    consts, dc = _front_args(consts, dc)
    xs = [x if d is None else move_axis(x, d, 1) for x, d in zip(xs, dxs)]
    d_slices = [None if d is None else 0 for d in dxs]

    def stage_with(batched):
        def policy(out_dims):
            return [0 if d is not None or (k < n_carry and batched[k]) else None
                    for k, d in enumerate(out_dims)]

        staged = _batch_closed(body, dc + [0 if b else None for b in batched] + d_slices,
                               size, policy)
        return staged, [w is not None for w in staged[2][:n_carry]]

    (new_body, b_consts, want), batched = _batch_carry_fixed_point(
        stage_with, [d is not None for d in dcarry])
    carry = [move_axis(x, d, 0) if d is not None else
             broadcast_to(expand_dims(x, 0), (size,) + tuple(typeof(x).shape)) if b else x
             for x, d, b in zip(carry, dcarry, batched)]
    outs = scan_p.bind(*b_consts, *consts, *carry, *xs, body=new_body, length=length,
                       reverse=reverse, unroll=unroll, n_consts=len(b_consts) + n_consts,
                       n_carry=n_carry)
    return outs, ([0 if b else None for b in batched]
                  + [None if w is None else 1 for w in want[n_carry:]])


batching.set(scan_p, _scan_batching)


def _scan_sharding(*avals, body, length, reverse, unroll, n_consts, n_carry):
    """The body's factors (``BodyLinks``), each carry dimension tied to itself across
    the iteration: the carry keeps its layout through the loop (a fixed point), xs are
    split on their non-scanned dimensions as the body uses them, ys stacked in the
    body's layout. The body is partitioned as a per-device program of its own."""
    links = BodyLinks()
    ins, outs = body.inputs, body.outputs
    links.pending_eqs = accumulators(body, list(ins[n_consts:n_consts + n_carry]), n_carry)
    links.program(body)
    for k in range(n_carry):
        links.values(ins[n_consts + k], outs[k])
    _unused_like_used(links, body, [i for i in range(len(ins))
                                    if not n_consts <= i < n_consts + n_carry])
    in_keys = [dims_keys(v, skip_leading=i >= n_consts + n_carry) for i, v in enumerate(ins)]
    out_keys = [dims_keys(ins[n_consts + k]) for k in range(n_carry)]
    out_keys += [dims_keys(v, skip_leading=True) if not isinstance(v, Literal)
                 else [None] * (v.aval.ndim + 1) for v in outs[n_carry:]]
    return links.spec(in_keys, out_keys, body_flops(body) * length, _scan_partition)


def _unused_like_used(links: BodyLinks, body: Program, which: list) -> None:
    """Tie each body input of ``which`` that the body never reads to a read one of the
    same type: its layout is then free to follow that one's (a reverse loop receives
    residuals it does not use; a factor of its own would have to stay whole, since the
    used ones take every mesh axis, and gathering it would be wasted communication)."""
    from fshard.core.ir import Var

    read = {a for eq in body.equations for a in eq.inputs if isinstance(a, Var)}
    read |= {v for v in body.outputs if isinstance(v, Var)}
    ins = [body.inputs[i] for i in which]
    used = [v for v in ins if v in read]
    for v in ins:
        if v in read:
            continue
        like = next((u for u in used if u.aval == v.aval), None)
        if like is not None:
            links.values(v, like)


def _scan_partition(operands, params, ins, outs, partition):
    n_c, n_v = params["n_consts"], params["n_carry"]
    # An accumulator carry (``accumulators``) comes out a pending sum: inside the loop
    # it is one too, started from the initial value on one device of each group
    # summed over and from zeros on the others.
    carry = [dataclasses.replace(s, partial=o.partial)
             for s, o in zip(ins[n_c:n_c + n_v], outs)]
    operands = list(operands)
    for k, s in enumerate(carry):
        if s.partial:
            operands[n_c + k] = _share_of_one(operands[n_c + k], s.partial)
    body_ins = list(ins[:n_c]) + carry + [drop_leading(s) for s in ins[n_c + n_v:]]
    body_outs = carry + [drop_leading(s) for s in outs[n_v:]]
    body, consts = partition(params["body"], body_ins, body_outs)
    return (consts + operands,
            dict(params, body=body, n_consts=len(consts) + n_c))


def _share_of_one(x, axes):
    """``x`` as a pending sum over mesh axes ``axes`` (the partitioner names them
    ``m<i>``): itself on the first device of each group summed over, zeros elsewhere."""
    from fshard.primitives.collectives import axis_index
    from fshard.primitives.elementwise import equal, where, zeros_like

    first = equal(axis_index(tuple(f"m{a}" for a in sorted(axes))), 0)
    return where(first, x, zeros_like(x))


sharding.set(scan_p, _scan_sharding)


# ===========================================================================
# The user API
# ===========================================================================


def _eager() -> bool:
    return type(current_trace()) is EvalTrace


# A rule may call its own function (``return f(x), t * g(x)``, JAX's idiom), and
# rules are staged when the function is called, so each such call stages the rule
# again. Nesting stops at this depth: deeper calls inline the function's body,
# which only matters for derivatives of order higher than this.
MAX_RULE_DEPTH = 3


class _Rules:
    """Counts how deeply one custom function's rules are being staged."""

    def __init__(self):
        self.depth = 0

    def __enter__(self):
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1


def _check_custom(kind: str, fun, nondiff_argnums) -> tuple:
    """The function and ``nondiff_argnums`` of a custom-derivative decorator, checked."""
    if not callable(fun):
        raise DifferentiationError(
            f"fs.{kind} decorates a function; got {type(fun).__name__} {fun!r}.\nFix: "
            f"@fs.{kind} above a def, or fs.{kind}(f).")
    if isinstance(nondiff_argnums, int) and not isinstance(nondiff_argnums, bool):
        nondiff_argnums = (nondiff_argnums,)
    if not isinstance(nondiff_argnums, (tuple, list)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in nondiff_argnums):
        raise DifferentiationError(
            f"fs.{kind}(nondiff_argnums=...) must be a tuple of ints; got "
            f"{nondiff_argnums!r}.")
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_POSITIONAL for p in params):
        n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        bad = [i for i in nondiff_argnums if not -n <= i < n]
        if bad:
            raise DifferentiationError(
                f"fs.{kind}(nondiff_argnums={tuple(nondiff_argnums)!r}): "
                f"{fun_name(fun)} has {n} positional parameters, so {bad} is out of range."
                f"\nFix: use positions in [{-n}, {n - 1}].")
    return tuple(nondiff_argnums)


def _check_rule(kind: str, method: str, arg: str, rule) -> None:
    if not callable(rule):
        raise DifferentiationError(
            f"fs.{kind}.{method}({arg}=...) must be a function; got {type(rule).__name__} "
            f"{rule!r}.")


class custom_jvp:  # noqa: N801  (mirrors jax.custom_jvp)
    """A function with a user-defined JVP rule, used by every derivative transform.

    >>> import numpy as np, fshard as fs
    >>> @fs.custom_jvp
    ... def softplus(x):
    ...     return fs.ops.log(1.0 + fs.ops.exp(x))
    >>> @softplus.defjvp
    ... def softplus_jvp(primals, tangents):
    ...     (x,), (t,) = primals, tangents
    ...     return softplus(x), t * fs.ops.sigmoid(x)
    >>> float(fs.grad(softplus)(np.float32(0.0)).asnumpy())
    0.5

    Args:
        fun: the primal function; its arguments are pytrees of arrays.
        nondiff_argnums: positions of arguments that are not differentiated (Python
            values such as a threshold); they are passed first to the JVP rule.

    The rule is ``jvp(primals, tangents) -> (primal_out, tangent_out)`` where
    ``primals`` and ``tangents`` are tuples of the (differentiable) arguments and the
    outputs have the structure, shapes and dtypes of ``fun``'s output. Reverse mode
    (``grad``) transposes the rule, so it must be linear in ``tangents``.

    See also: ``fs.custom_vjp``; docs/autodiff.md#custom-derivative-rules.
    """

    def __init__(self, fun, nondiff_argnums: tuple = ()):
        self.nondiff_argnums = _check_custom("custom_jvp", fun, nondiff_argnums)
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.jvp_rule = None
        self._staging = _Rules()

    def defjvp(self, jvp_rule):
        """Set the JVP rule (usable as a decorator); returns the rule."""
        _check_rule("custom_jvp", "defjvp", "jvp_rule", jvp_rule)
        self.jvp_rule = jvp_rule
        return jvp_rule

    def defjvps(self, *rules):
        """One rule per argument: ``rule_i(t_i, primal_out, *primals) -> tangent``
        (``None``: no dependence on that argument); the tangents are summed."""
        def jvp_rule(primals, tangents):
            out = self.fun(*primals)
            t_out = None
            for r, t in zip(rules, tangents, strict=True):
                if r is None:
                    continue
                c = r(t, out, *primals)
                t_out = c if t_out is None else tree.map(lambda a, b: a + b, t_out, c)
            if t_out is None:
                from fshard.primitives.elementwise import zeros_like

                t_out = tree.map(zeros_like, out)
            return out, t_out

        self.jvp_rule = jvp_rule

    def __get__(self, obj, objtype=None):  # usable as a method
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args, **kwargs):
        name = fun_name(self.fun)
        if self.jvp_rule is None:
            raise DifferentiationError(
                f"custom_jvp function {name} has no JVP rule.\nFix: define one with "
                f"@{name}.defjvp (a function of (primals, tangents)).")
        args = _resolve_args(self.fun, args, kwargs, "custom_jvp")
        if _eager() or self._staging.depth >= MAX_RULE_DEPTH:
            return self.fun(*args)
        nondiff, diff, nums = _split_nondiff(args, self.nondiff_argnums)
        leaves, in_tree = tree.flatten(tuple(diff))
        avals = [typeof(x) for x in leaves]
        n = len(leaves)
        box = []

        def body_fn(*flat):
            out = self.fun(*_merge_args(nondiff, nums, tree.unflatten(in_tree, list(flat))))
            out_leaves, out_tree = tree.flatten(out)
            box.append(out_tree)
            return out_leaves

        body, b_consts = _stage_closed(body_fn, avals)
        out_tree, out_avals = box[0], body.out_avals

        def jvp_fn(*flat):
            primals = tuple(tree.unflatten(in_tree, list(flat[:n])))
            tangents = tuple(tree.unflatten(in_tree, list(flat[n:])))
            res = self.jvp_rule(*nondiff, primals, tangents)
            if not (isinstance(res, (tuple, list)) and len(res) == 2):
                raise DifferentiationError(
                    f"custom_jvp rule of {name} must return a pair (primal_out, "
                    f"tangent_out); it returned {_describe(res)}.\nFix: return "
                    f"({name}(*primals), tangent_out).")
            p_leaves, p_tree = tree.flatten(res[0])
            t_leaves, t_tree = tree.flatten(res[1])
            _check_same_types("custom_jvp", name, "the primal output", p_leaves, p_tree,
                              out_avals, out_tree, f"{name}'s output")
            _check_same_types("custom_jvp", name, "the tangent output", t_leaves, t_tree,
                              out_avals, out_tree, "the primal output")
            return p_leaves + t_leaves

        with self._staging:
            jvp_prog, j_consts = _stage_closed(jvp_fn, avals + avals)
        outs = custom_jvp_call_p.bind(*b_consts, *j_consts, *leaves, body=body, jvp=jvp_prog,
                                      n_body_consts=len(b_consts), n_jvp_consts=len(j_consts),
                                      name=name)
        return tree.unflatten(out_tree, outs)


class custom_vjp:  # noqa: N801  (mirrors jax.custom_vjp)
    """A function with a user-defined reverse-mode rule.

    >>> import numpy as np, fshard as fs
    >>> @fs.custom_vjp
    ... def clip_gradient(x):
    ...     return x
    >>> def fwd(x):
    ...     return x, None
    >>> def bwd(res, g):
    ...     return (fs.ops.maximum(fs.ops.minimum(g, 1.0), -1.0),)
    >>> clip_gradient.defvjp(fwd, bwd)
    >>> fs.grad(lambda x: (3.0 * clip_gradient(x)).sum())(np.ones(2, np.float32)).asnumpy()
    array([1., 1.], dtype=float32)

    Args:
        fun: the primal function; its arguments are pytrees of arrays.
        nondiff_argnums: positions of arguments that are not differentiated; they are
            passed first to ``bwd``.

    ``fwd(*args) -> (out, residuals)`` computes the output and what ``bwd`` needs
    (a pytree of arrays, or None). ``bwd(residuals, ct_out) -> tuple`` returns one
    cotangent per (differentiable) argument, with its structure, shapes and dtypes
    (``None`` for a zero cotangent). Forward mode (``jvp``, ``jacfwd``) is an error.

    See also: ``fs.custom_jvp``; docs/autodiff.md#custom-derivative-rules.
    """

    def __init__(self, fun, nondiff_argnums: tuple = ()):
        self.nondiff_argnums = _check_custom("custom_vjp", fun, nondiff_argnums)
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.fwd = self.bwd = None
        self._staging = _Rules()

    def defvjp(self, fwd, bwd) -> None:
        """Set the forward (``fwd``) and backward (``bwd``) rules."""
        _check_rule("custom_vjp", "defvjp", "fwd", fwd)
        _check_rule("custom_vjp", "defvjp", "bwd", bwd)
        self.fwd, self.bwd = fwd, bwd

    def __get__(self, obj, objtype=None):
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args, **kwargs):
        name = fun_name(self.fun)
        if self.fwd is None:
            raise DifferentiationError(
                f"custom_vjp function {name} has no VJP rule.\nFix: define one with "
                f"{name}.defvjp(fwd, bwd).")
        args = _resolve_args(self.fun, args, kwargs, "custom_vjp")
        if _eager() or self._staging.depth >= MAX_RULE_DEPTH:
            return self.fun(*args)
        nondiff, diff, nums = _split_nondiff(args, self.nondiff_argnums)
        leaves, in_tree = tree.flatten(tuple(diff))
        avals = [typeof(x) for x in leaves]
        box = {}

        def full_args(flat):
            return _merge_args(nondiff, nums, tree.unflatten(in_tree, list(flat)))

        def body_fn(*flat):
            out_leaves, box["out"] = tree.flatten(self.fun(*full_args(flat)))
            return out_leaves

        body, b_consts = _stage_closed(body_fn, avals)
        out_tree, out_avals = box["out"], body.out_avals

        def fwd_fn(*flat):
            res = self.fwd(*full_args(flat))
            if not (isinstance(res, (tuple, list)) and len(res) == 2):
                raise DifferentiationError(
                    f"custom_vjp fwd rule of {name} must return a pair (output, "
                    f"residuals); it returned {_describe(res)}.\nFix: return "
                    "(output, residuals), with residuals=None if bwd needs nothing.")
            o_leaves, o_tree = tree.flatten(res[0])
            _check_same_types("custom_vjp fwd", name, "the output", o_leaves, o_tree,
                              out_avals, out_tree, f"{name}'s output")
            r_leaves, box["res"] = tree.flatten(res[1])
            return o_leaves + r_leaves

        with self._staging:
            fwd_prog, f_consts = _stage_closed(fwd_fn, avals)
        res_avals = fwd_prog.out_avals[len(out_avals):]
        n_res = len(res_avals)

        def bwd_fn(*flat):
            res = tree.unflatten(box["res"], list(flat[:n_res]))
            ct = tree.unflatten(out_tree, list(flat[n_res:]))
            cts = self.bwd(*nondiff, res, ct)
            return _check_bwd_output(name, cts, diff, avals)

        with self._staging:
            bwd_prog, w_consts = _stage_closed(bwd_fn, list(res_avals) + list(out_avals))
        outs = custom_vjp_call_p.bind(
            *b_consts, *f_consts, *w_consts, *leaves, body=body, fwd=fwd_prog, bwd=bwd_prog,
            n_consts=(len(b_consts), len(f_consts), len(w_consts)), n_res=n_res, name=name)
        return tree.unflatten(out_tree, outs)


def _check_bwd_output(name, cts, diff, avals) -> list:
    """Flat cotangents from bwd's tuple (one entry per argument; None means zero)."""
    if isinstance(cts, list):
        cts = tuple(cts)
    if not isinstance(cts, tuple) or len(cts) != len(diff):
        got = (f"a tuple of length {len(cts)}" if isinstance(cts, tuple)
               else type(cts).__name__)
        raise DifferentiationError(
            f"custom_vjp bwd rule of {name} must return a tuple with one cotangent per "
            f"differentiable argument ({len(diff)}); it returned {got}.\nFix: return "
            "(ct_x,) for a single argument; use None for a zero cotangent.")
    flat = []
    for i, (ct, arg) in enumerate(zip(cts, diff)):
        arg_leaves, arg_tree = tree.flatten(arg)
        if ct is None:
            flat += [Zero(typeof(a)) for a in arg_leaves]
            continue
        ct_leaves, ct_tree = tree.flatten(ct)
        if ct_tree != arg_tree:
            raise DifferentiationError(
                f"custom_vjp bwd rule of {name}: cotangent {i} must have the structure of "
                f"argument {i}, {arg_tree}; got {ct_tree}.")
        for c, a in zip(ct_leaves, arg_leaves):
            tc, ta = typeof(c), typeof(a)
            if tuple(tc.shape) != tuple(ta.shape):
                raise DifferentiationError(
                    f"custom_vjp bwd rule of {name}: cotangent {i} has type {tc}, but "
                    f"argument {i} has type {ta}; shapes must be equal.")
            if dtypes.is_float(ta.dtype) and tc.dtype != ta.dtype:
                raise DifferentiationError(
                    f"custom_vjp bwd rule of {name}: cotangent {i} has dtype {tc.dtype}, "
                    f"but argument {i} has dtype {ta.dtype}; they must be equal.\nFix: "
                    "cast the cotangent (ct.astype(x.dtype)).")
            flat.append(c if dtypes.is_float(ta.dtype) else Zero(ta))
    return [instantiate(c) for c in flat]
