"""Control flow on traced values: ``fs.cond``, ``fs.switch``, ``fs.while_loop``,
``fs.fori_loop`` and ``fs.scan`` (JAX's signatures and semantics).

How each is built, and why:

- ``while_loop`` is a primitive, ``while``, carrying its condition and body as closed
  Programs: its trip count is only known at run time. Eagerly it runs a Python loop;
  under ``jit`` it lowers to a MindSpore graph ``while`` loop; ``vmap`` with a batched
  condition runs until every lane is done, each lane keeping its carry once its own
  condition is false; forward mode carries tangents through the loop. Reverse mode is
  an error, as in JAX: the loop does not keep each iteration's values.
- ``scan`` traces its body once, then either unrolls it (short loops of small bodies:
  ``SCAN_UNROLL_EQUATIONS``, measured) or binds the ``scan`` primitive
  (``fshard.primitives.control``), one MindSpore graph loop under ``jit``. The
  primitive's JVP and transpose rules sit here (they need the JVP interpreter): the
  JVP is a primal scan stacking the residuals and a tangent scan linear in the
  tangents; its transpose is a reverse scan.
- ``fori_loop`` with static bounds is unrolled up to ``MAX_UNROLL`` iterations (the
  body traced per iteration, ``i`` a Python int) and a ``scan`` over ``(i, val)``
  beyond; with traced bounds it is a ``while_loop``.
- ``cond`` and ``switch`` call the chosen branch when the index is concrete. On a
  traced index they bind the ``cond`` primitive, which ``jit`` lowers in the faster
  form (measured, docs/performance.md): one MindSpore graph ``if`` for costly
  branches, every branch and a select (``where``) for cheap ones. Its JVP is a cond of
  the branches' JVPs and its transpose a cond of their transposes, so only the taken
  branch is ever differentiated. Branches must return the same types, checked by
  tracing each on the operands' types.
- Under ``shard`` the loops and cond are partitioned with their bodies as per-device
  programs of their own (their sharding rules: the carry keeps its layout), and stay
  one loop (or if) of the per-device program.

This module sits in the transforms layer because the JVP rules of ``while`` and
``scan`` need the JVP interpreter (``fshard.transforms.ad``).
"""

from __future__ import annotations

import contextlib

import numpy as np

from fshard.core import context, dtypes, tree
from fshard import random
from fshard.backend.mindspore import as_tensor
from fshard.core.tracing import ArrayType, Tracer, current_trace, typeof
from fshard.errors import ArgumentError, ProgramTypeError
from fshard.core.interpret import eval_program
from fshard.core.ir import Literal, Program, Var
from fshard.primitives import elementwise as E
from fshard.primitives import reductions as R
from fshard.primitives import structural as S
from fshard.primitives.base import UndefinedPrimal, Zero, batch_size, def_primitive, instantiate
from fshard.primitives.control import (BodyLinks, _all_front, _batch_carry_fixed_point,
                                       _batch_closed, _front_args,
                                       _split, _stage_closed, body_flops, dims_keys,
                                       scalar_layout, scan_p)
from fshard.core.rules import batching, jvp as jvp_rules, sharding, transpose, unsupported
from fshard.core.staging import fun_name
from fshard.transforms.ad import backward_pass, jvp_program, partial_eval

__all__ = ["cond", "switch", "while_loop", "fori_loop", "scan", "MAX_UNROLL",
           "GRAPH_IF_FLOPS", "SCAN_UNROLL_EQUATIONS"]

FAMILY = "control"
MAX_UNROLL = 256


# ---------------------------------------------------------------------------
# Staging user functions on pytrees
# ---------------------------------------------------------------------------


def _leaves_of(x, api: str, what: str):
    leaves, treedef = tree.flatten(x)
    out = []
    for leaf in leaves:
        try:
            typeof(leaf)
        except Exception:  # noqa: BLE001
            raise ArgumentError(
                f"{api}: {what} must be a pytree of arrays or numbers, got a leaf of type "
                f"{type(leaf).__name__}.") from None
        out.append(leaf if isinstance(leaf, Tracer) else as_tensor(leaf))
    return out, treedef


def _stage_tree_fn(fn, treedef, avals, api: str, name: str, star: bool = False,
                   key_uses: list | None = None, loop=None):
    """Stage ``fn(unflatten(treedef, xs))`` (``fn(*...)`` with ``star``) into a closed
    Program; also return its constants and its output tree. ``key_uses`` gets, per
    input, what consumed it as a random key inside ``fn`` (or None). ``loop``: the
    trace a loop whose body ``fn`` is was called in (its random draws are checked for
    keys no iteration changes)."""
    box = []

    def flat(*xs):
        args = tree.unflatten(treedef, list(xs))
        with random.loop_body(api, xs, loop) if loop else contextlib.nullcontext():
            out = fn(*args) if star else fn(args)
        if key_uses is not None:
            key_uses.append([random.consumed_by(x) for x in xs])
        leaves, out_tree = tree.flatten(out)
        for leaf in leaves:
            try:
                typeof(leaf)
            except Exception:  # noqa: BLE001
                raise ArgumentError(
                    f"{api}: {name} returned a leaf of type {type(leaf).__name__}; it must "
                    "return arrays or numbers.") from None
        box.append(out_tree)
        return [leaf if isinstance(leaf, Tracer) else as_tensor(leaf) for leaf in leaves]

    program, consts = _stage_closed(flat, avals)
    return program, consts, box[0]


def _check_fn(api: str, fn, name: str) -> None:
    if not callable(fn):
        raise ArgumentError(f"{api}: {name} must be a function, got {type(fn).__name__} "
                            f"{fn!r}.")


def _difference(tree_a, types_a, tree_b, types_b) -> str:
    """Where two typed pytrees differ: the first leaf by key path, or the structures."""
    if tree_a != tree_b:
        return f"structure {tree_a} vs {tree_b}"
    paths, _, _ = tree.flatten_with_path(tree.unflatten(tree_a, list(range(len(types_a)))))
    for p, a, b in zip(paths, types_a, types_b):
        if a != b:
            return f"leaf {tree.keystr(p) or '(the value itself)'}: {a} vs {b}"
    return "no difference"


def _types(avals) -> str:
    return "(" + ", ".join(str(a) for a in avals) + ("," if len(avals) == 1 else "") + ")"


# ===========================================================================
# while: the primitive
# ===========================================================================
#
# Operands: cond_consts + body_consts + carry.
# Params: cond (cond_consts + carry -> [pred]), body (body_consts + carry -> carry),
# n_cond_consts, n_body_consts.


def _while_type(*avals, cond, body, n_cond_consts, n_body_consts):
    carry = list(avals[n_cond_consts + n_body_consts:])
    if list(body.out_avals) != carry:
        raise ProgramTypeError(
            f"while: the body returns {_types(body.out_avals)} for a carry of "
            f"{_types(carry)}; they must be equal.")
    return carry


def _while_impl(*args, cond, body, n_cond_consts, n_body_consts):
    cc, bc, carry = _split(list(args), n_cond_consts, n_body_consts)
    while bool(np.asarray(eval_program(cond, *cc, *carry)[0].asnumpy())):
        carry = eval_program(body, *bc, *carry)
    return carry


def _while_lowering(ctx, *exprs, cond, body, n_cond_consts, n_body_consts):
    helper = ctx.while_function(cond, body, n_cond_consts, n_body_consts)
    return f"{helper}({', '.join(exprs)})"


while_p = def_primitive("while", FAMILY, _while_type, _while_impl, multiple_results=True,
                        lower=_while_lowering)


def _while_batching(args, dims, *, cond, body, n_cond_consts, n_body_consts):
    """Batch the loop. With an unbatched condition, a carry batched at entry or by the
    body (a fixed point) gets the batch axis in front and the others stay unbatched. A
    batched condition batches every carry and runs the loop while any lane's is true; a
    lane whose own condition is false keeps its carry."""
    size = batch_size(args, dims)
    args, dims = _front_args(args, dims)
    cc, bc, carry = _split(args, n_cond_consts, n_body_consts)
    dcc, dbc, dcarry = _split(dims, n_cond_consts, n_body_consts)

    def stage_with(batched):
        dk = [0 if b else None for b in batched]
        staged_cond = _batch_closed(cond, dcc + dk, size,
                                    lambda ds: [None if d is None else 0 for d in ds])
        if staged_cond[2][0] is not None:  # a per-lane condition: every carry batched
            return (staged_cond, None), [True] * len(batched)
        staged_body = _batch_closed(
            body, dbc + dk, size,
            lambda ds: [0 if d is not None or b else None for d, b in zip(ds, batched)])
        return (staged_cond, staged_body), [w is not None for w in staged_body[2]]

    ((new_cond, c_consts, c_dims), staged_body), batched = _batch_carry_fixed_point(
        stage_with, [d is not None for d in dcarry])
    carry = [x if d is not None else S.broadcast_to(
        S.expand_dims(x, 0), (size,) + tuple(typeof(x).shape)) if b else x
        for x, d, b in zip(carry, dcarry, batched)]
    front = [0 if b else None for b in batched]
    if c_dims[0] is None:
        new_body, b_consts, _ = staged_body
        cc, bc = list(c_consts) + cc, list(b_consts) + bc
        outs = while_p.bind(*cc, *bc, *carry, cond=new_cond, body=new_body,
                            n_cond_consts=len(cc), n_body_consts=len(bc))
        return outs, front
    new_body, b_consts, _ = _batch_closed(body, dbc + front, size, _all_front)
    cc, bc = list(c_consts) + cc, list(b_consts) + bc
    n_cc = len(cc)
    carry_avals = [typeof(x) for x in carry]

    def any_lane(*xs):
        pred = eval_program(new_cond, *xs)[0]
        return [E.greater(R.reduce_max(E.cast(pred, dtypes.int32)), 0)]

    def masked_body(*xs):
        ccs, bcs, old = _split(list(xs), n_cc, len(bc))
        pred = eval_program(new_cond, *ccs, *old)[0]
        new = eval_program(new_body, *bcs, *old)
        out = []
        for o, x in zip(old, new):
            p = S.reshape(pred, (size,) + (1,) * (typeof(x).ndim - 1))
            out.append(E.where(p, x, o))
        return out

    cond2, k1 = _stage_closed(any_lane, [typeof(x) for x in cc] + carry_avals)
    body2, k2 = _stage_closed(masked_body, [typeof(x) for x in cc + bc] + carry_avals)
    outs = while_p.bind(*k1, *cc, *k2, *cc, *bc, *carry, cond=cond2, body=body2,
                        n_cond_consts=len(k1) + n_cc, n_body_consts=len(k2) + n_cc + len(bc))
    return outs, front


batching.set(while_p, _while_batching)


def _while_jvp(primals, tangents, *, cond, body, n_cond_consts, n_body_consts):
    """Carry a tangent with every float carry (forward mode)."""
    cc, bc, carry = _split(list(primals), n_cond_consts, n_body_consts)
    _, tbc, tcarry = _split(list(tangents), n_cond_consts, n_body_consts)
    f_bc = [i for i, x in enumerate(bc) if dtypes.is_float(typeof(x).dtype)
            and not isinstance(tbc[i], Zero)]
    f_carry = [i for i, x in enumerate(carry) if dtypes.is_float(typeof(x).dtype)]
    tbc_f = [instantiate(tbc[i]) for i in f_bc]
    tcarry_f = [instantiate(tcarry[i]) for i in f_carry]
    n_bc, n_c = len(bc), len(carry)

    def body_jvp(*xs):
        b, tb, c, tc = _split(list(xs), n_bc, len(f_bc), n_c)
        tb_all = [Zero(typeof(x)) for x in b]
        for i, t in zip(f_bc, tb):
            tb_all[i] = t
        tc_all = [Zero(typeof(x)) for x in c]
        for i, t in zip(f_carry, tc):
            tc_all[i] = t
        outs, touts = jvp_program(body, b + c, tb_all + tc_all)
        return list(outs) + [instantiate(touts[i]) for i in f_carry]

    def cond_jvp(*xs):
        ccs, c, _ = _split(list(xs), n_cond_consts, n_c)
        return eval_program(cond, *ccs, *c)

    avals = [typeof(x) for x in bc + tbc_f + carry + tcarry_f]
    body2, k_b = _stage_closed(body_jvp, avals)
    cond2, k_c = _stage_closed(cond_jvp, [typeof(x) for x in cc + carry + tcarry_f])
    outs = while_p.bind(*k_c, *cc, *k_b, *bc, *tbc_f, *carry, *tcarry_f, cond=cond2,
                        body=body2, n_cond_consts=len(k_c) + len(cc),
                        n_body_consts=len(k_b) + n_bc + len(tbc_f))
    # The primal outputs come from a loop of their own: the joint loop depends on the
    # tangents, so reverse mode's partial evaluation would otherwise find no known
    # primal outputs (and must instead reach the transpose rule's error).
    primal_out = while_p.bind(*cc, *bc, *carry, cond=cond, body=body,
                              n_cond_consts=n_cond_consts, n_body_consts=n_body_consts)
    t_f = outs[n_c:]
    t_out = [Zero(typeof(x)) for x in primal_out]
    for i, t in zip(f_carry, t_f):
        t_out[i] = t
    return primal_out, t_out


jvp_rules.set(while_p, _while_jvp)
unsupported(while_p, "transpose",
            "reverse-mode differentiation of fs.while_loop: its trip count is known only "
            "at run time and the loop keeps no per-iteration values (as in JAX). Fix: use "
            "fs.fori_loop with static bounds or fs.scan (reverse mode works through both), "
            "or forward mode (fs.jvp, fs.jacfwd)")


def _while_sharding(*avals, cond, body, n_cond_consts, n_body_consts):
    """As scan's (``fshard.primitives.control._scan_sharding``): the body's factors,
    each carry dimension tied to itself across the iteration, so the carry keeps its
    layout; the condition reads the carry in that layout and its scalar is made the
    same on every device (a pending sum reduced inside the loop), so every device runs
    the same number of iterations."""
    links = BodyLinks()
    links.program(body)
    b_in, b_out, c_in = body.inputs, body.outputs, cond.inputs
    n_carry = len(b_out)
    for k in range(n_carry):
        links.values(b_in[n_body_consts + k], b_out[k])
        links.values(c_in[n_cond_consts + k], b_in[n_body_consts + k])
    in_keys = [dims_keys(v) for v in c_in[:n_cond_consts]] + [dims_keys(v) for v in b_in]
    out_keys = [dims_keys(b_in[n_body_consts + k]) for k in range(n_carry)]
    return links.spec(in_keys, out_keys, body_flops(body), _while_partition)


def _while_partition(operands, params, ins, outs, partition):
    if not ins:
        return operands, params
    ncc, nbc = params["n_cond_consts"], params["n_body_consts"]
    cc, bc, carry = _split(list(operands), ncc, nbc)
    s_cc, s_bc, s_carry = _split(list(ins), ncc, nbc)
    body, kb = partition(params["body"], s_bc + s_carry, s_carry)
    cond, kc = partition(params["cond"], s_cc + s_carry, [scalar_layout(ins[0])])
    return (kc + cc + kb + bc + carry,
            dict(params, cond=cond, body=body, n_cond_consts=len(kc) + ncc,
                 n_body_consts=len(kb) + nbc))


sharding.set(while_p, _while_sharding)


# ===========================================================================
# scan: the JVP and transpose rules of the primitive (fshard.primitives.control.scan_p)
# ===========================================================================


def _is_zero_tangent(t, x) -> bool:
    return isinstance(t, Zero) or not dtypes.is_float(typeof(x).dtype)


def _scan_jvp_loops(primals, tangents, *, body, length, reverse, unroll, n_consts, n_carry):
    """Two scans: the primal one, which also stacks the residuals (the values of each
    step that the tangents need), and a tangent scan, linear in the tangents, over the
    stacked residuals. Reverse mode transposes the tangent scan into a reverse loop
    (``_scan_transpose``)."""
    consts, carry, xs = _split(list(primals), n_consts, n_carry)
    tconsts, tcarry, txs = _split(list(tangents), n_consts, n_carry)
    nz_c = [not _is_zero_tangent(t, x) for t, x in zip(tconsts, consts)]
    nz_x = [not _is_zero_tangent(t, x) for t, x in zip(txs, xs)]
    nz_v = [not _is_zero_tangent(t, x) for t, x in zip(tcarry, carry)]
    n_y = len(body.outputs) - n_carry
    in_avals = list(body.in_avals)
    c_av, v_av, x_av = _split(in_avals, n_consts, n_carry)
    while True:  # the carries whose tangent is nonzero: a fixed point
        box = []

        def joint(*args, nz_v=tuple(nz_v)):
            ps = list(args[:len(in_avals)])
            ts_in = iter(args[len(in_avals):])
            ts = ([next(ts_in) if z else Zero(a) for z, a in zip(nz_c, c_av)]
                  + [next(ts_in) if z else Zero(a) for z, a in zip(nz_v, v_av)]
                  + [next(ts_in) if z else Zero(a) for z, a in zip(nz_x, x_av)])
            outs, touts = jvp_program(body, ps, ts)
            box.append([not isinstance(t, Zero) for t in touts])
            t_carry = [instantiate(t) for t, z in zip(touts[:n_carry], nz_v) if z]
            t_ys = [instantiate(t) for t in touts[n_carry:] if not isinstance(t, Zero)]
            return list(outs) + t_carry + t_ys

        t_avals = ([a for z, a in zip(nz_c, c_av) if z] + [a for z, a in zip(nz_v, v_av) if z]
                   + [a for z, a in zip(nz_x, x_av) if z])
        prog, k = _stage_closed(joint, in_avals + t_avals)
        out_nz = box[0]
        new_v = [a or (b and dtypes.is_float(av.dtype))
                 for a, b, av in zip(nz_v, out_nz[:n_carry], v_av)]
        if new_v == nz_v:
            break
        nz_v = new_v
    nz_y = out_nz[n_carry:]
    n_k, n_p, n_t = len(k), len(in_avals), len(t_avals)
    # constants the staging captured are primal inputs (known): passed as consts
    known, linear = partial_eval(prog, [False] * (n_k + n_p) + [True] * n_t)
    n_res = len(known.outputs)
    n_out = len(body.outputs)
    primal_outs = prog.outputs[:n_out]
    # Residuals that are loop constants are passed as such; the others are stacked.
    invariant = dict(zip(prog.inputs[:n_k + n_consts], list(k) + list(consts)))
    inv = [v in invariant for v in known.outputs]
    inv_vals = [invariant[v] for v, z in zip(known.outputs, inv) if z]
    var_avals = [v.aval for v, z in zip(known.outputs, inv) if not z]

    def primal_body(*args):
        r = eval_program(known, *args)
        env = dict(zip(known.outputs, r))
        vals = [a.value if isinstance(a, Literal) else env[a] for a in primal_outs]
        return vals + [x for x, z in zip(r, inv) if not z]

    p_body, p_k = _stage_closed(primal_body, [v.aval for v in prog.inputs[:n_k]] + in_avals)
    outs = scan_p.bind(*p_k, *k, *consts, *carry, *xs, body=p_body, length=length,
                       reverse=reverse, unroll=unroll, n_consts=len(p_k) + n_k + n_consts,
                       n_carry=n_carry)
    p_out, stacked_res = outs[:n_out], outs[n_out:]
    n_tc, n_tv, n_inv = sum(nz_c), sum(nz_v), len(inv_vals)

    def tangent_body(*args):
        ri, tc, tv, rv, tx = _split(list(args), n_inv, n_tc, n_tv, len(var_avals))
        it_i, it_v = iter(ri), iter(rv)
        res = [next(it_i) if z else next(it_v) for z in inv]
        r = eval_program(linear, *res, *tc, *tv, *tx)
        return r[n_out:]

    nz_c_av = [a for z, a in zip(nz_c, c_av) if z]
    nz_v_av = [a for z, a in zip(nz_v, v_av) if z]
    nz_x_av = [a for z, a in zip(nz_x, x_av) if z]
    t_body, t_k = _stage_closed(tangent_body, [typeof(v) for v in inv_vals] + nz_c_av
                                + nz_v_av + var_avals + nz_x_av)
    tc_in = [t for t, z in zip(tconsts, nz_c) if z]
    tv_in = [instantiate(t) if not isinstance(t, Zero) else instantiate(Zero(typeof(x)))
             for t, x, z in zip(tcarry, carry, nz_v) if z]
    tx_in = [t for t, z in zip(txs, nz_x) if z]
    t_outs = scan_p.bind(*t_k, *inv_vals, *tc_in, *tv_in, *stacked_res, *tx_in, body=t_body,
                         length=length, reverse=reverse, unroll=unroll,
                         n_consts=len(t_k) + n_inv + n_tc, n_carry=n_tv)
    t_iter = iter(t_outs)
    t_carry = [next(t_iter) if z else Zero(typeof(x)) for z, x in zip(nz_v, carry)]
    t_ys = [next(t_iter) if z else Zero(typeof(y)) for z, y in zip(nz_y, p_out[n_carry:])]
    return list(p_out), t_carry + t_ys


def _scan_transpose(cts, *args, body, length, reverse, unroll, n_consts, n_carry):
    """A reverse loop: carries the carry's cotangent and sums the constants'; each
    step transposes the body (its known part evaluated forward first)."""
    consts, carry, xs = _split(list(args), n_consts, n_carry)
    lin_c = [isinstance(a, UndefinedPrimal) for a in consts]
    lin_x = [isinstance(a, UndefinedPrimal) for a in xs]
    c_av, v_av, x_av = _split(list(body.in_avals), n_consts, n_carry)
    y_av = body.out_avals[n_carry:]
    known, lin = partial_eval(body, lin_c + [True] * n_carry + lin_x)
    n_res = len(known.outputs)
    res_c = [a for a, z in zip(consts, lin_c) if not z]
    res_x = [a for a, z in zip(xs, lin_x) if not z]
    lc_av = [a for a, z in zip(c_av, lin_c) if z]
    lx_av = [a for a, z in zip(x_av, lin_x) if z]

    def t_body(*a):
        rc, ctv, acc, rx, cty = _split(list(a), len(res_c), n_carry, len(lc_av), len(res_x))
        r = eval_program(known, *rc, *rx)
        cts_in = backward_pass(lin, n_res, r, list(ctv) + list(cty))
        cts_in = [instantiate(c) if not isinstance(c, Zero) else instantiate(Zero(av))
                  for c, av in zip(cts_in, lc_av + v_av + lx_av)]
        c_c, c_v, c_x = _split(cts_in, len(lc_av), n_carry)
        return list(c_v) + [E.add(x, y) for x, y in zip(acc, c_c)] + list(c_x)

    prog, k = _stage_closed(t_body, [typeof(a) for a in res_c] + list(v_av) + lc_av
                            + [ArrayType(tuple(typeof(x).shape[1:]), typeof(x).dtype)
                               for x in res_x] + list(y_av))
    ct_v = [instantiate(c) if not isinstance(c, Zero) else instantiate(Zero(a))
            for c, a in zip(cts[:n_carry], v_av)]
    ct_y = [instantiate(c) if not isinstance(c, Zero) else instantiate(
            Zero(ArrayType((length,) + tuple(a.shape), a.dtype)))
            for c, a in zip(cts[n_carry:], y_av)]
    acc0 = [instantiate(Zero(a)) for a in lc_av]
    outs = scan_p.bind(*k, *res_c, *ct_v, *acc0, *res_x, *ct_y, body=prog, length=length,
                       reverse=not reverse, unroll=unroll, n_consts=len(k) + len(res_c),
                       n_carry=n_carry + len(lc_av))
    ct_carry, ct_c, ct_x = _split(list(outs), n_carry, len(lc_av))
    it_c, it_x = iter(ct_c), iter(ct_x)
    return ([next(it_c) if z else None for z in lin_c] + list(ct_carry)
            + [next(it_x) if z else None for z in lin_x])


jvp_rules.set(scan_p, _scan_jvp_loops)
transpose.set(scan_p, _scan_transpose)


# ===========================================================================
# cond: the primitive (a traced index, costly branches, under jit)
# ===========================================================================
#
# Operands: index (int32 scalar) + consts + operands. Params: branches (one closed
# Program per branch, each taking consts + operands), n_consts. Branch k runs when
# index <= k (the first such k), the last one otherwise: the index is clamped.
#
# fs.cond / fs.switch bind it for every traced index. Its lowering is a graph ``if``
# where that is the faster form (measured: docs/performance.md): the branches not
# taken would cost more than MindSpore's graph control flow (~100 µs on the CPU
# backend); cheaper branches are all evaluated and selected with ``where``. Its JVP
# rule binds a primal and a tangent cond (only the taken branch is differentiated), its
# transpose a cond of the branches' transposes; a batched index selects.

GRAPH_IF_FLOPS = 1_000_000  # work of the branches not taken above which a graph if wins


def _cond_type(index, *avals, branches, n_consts):
    outs = list(branches[0].out_avals)
    for b in branches[1:]:
        if list(b.out_avals) != outs:
            raise ProgramTypeError(f"cond: the branches return {_types(outs)} and "
                                   f"{_types(b.out_avals)}; they must be equal.")
    return outs


def _branch_of(index, n: int) -> int:
    k = int(np.asarray(index.asnumpy() if hasattr(index, "asnumpy") else index))
    return min(max(k, 0), n - 1)


def _cond_impl(index, *args, branches, n_consts):
    return eval_program(branches[_branch_of(index, len(branches))], *args)


def _cond_lowering(ctx, index, *exprs, branches, n_consts):
    """A graph ``if`` when the branches not taken cost more than it (measured,
    ``GRAPH_IF_FLOPS``); below, every branch runs and ``where`` selects the result."""
    if any(_has_effect(b) for b in branches) or _graph_if_is_faster(branches):
        helper = ctx.cond_function(list(branches))
    else:
        selected, extra = _stage_closed(
            lambda i, *xs: _select_results(i, [eval_program(b, *xs) for b in branches]),
            [ArrayType((), dtypes.int32)] + list(branches[0].in_avals))
        assert not extra, "a select of closed branches captures no constant"
        helper = ctx.function(selected, "select")
    return f"{helper}({', '.join((index,) + exprs)})"


cond_p = def_primitive("cond", FAMILY, _cond_type, _cond_impl, multiple_results=True,
                       lower=_cond_lowering)


def _select_results(index, results):
    """``results[index]`` (clamped) by ``where``: ``index`` a scalar, or one per lane
    (batch axis in front) when the results are batched in front."""
    chosen = results[-1]
    for k in range(len(results) - 2, -1, -1):
        take = E.less_equal(index, k)
        picked = []
        for r, c in zip(results[k], chosen):
            t = take
            if typeof(take).ndim:  # per lane: align with the batch axis in front
                t = S.reshape(take, tuple(typeof(take).shape) + (1,) * (typeof(r).ndim - 1))
            picked.append(E.where(t, r, c))
        chosen = picked
    return chosen


def _uniform_branches(staged, in_avals):
    """Branch Programs over one input list (every branch's constants, then ``in_avals``)
    from ``(program, consts)`` pairs whose programs take their own constants first."""
    consts = [c for _, cs in staged for c in cs]
    const_avals = [typeof(c) for c in consts]
    programs, off = [], 0
    for prog, cs in staged:
        lo, hi = off, off + len(cs)

        def run(*xs, prog=prog, lo=lo, hi=hi):
            return eval_program(prog, *xs[lo:hi], *xs[len(consts):])

        closed, extra = _stage_closed(run, const_avals + list(in_avals))
        assert not extra, "a closed branch has no constants of its own"
        programs.append(closed)
        off = hi
    return programs, consts


def _cond_batching(args, dims, *, branches, n_consts):
    size = batch_size(args, dims)
    args, dims = _front_args(args, dims)
    index, rest, d_index, d_rest = args[0], list(args[1:]), dims[0], list(dims[1:])
    batched = [_batch_closed(b, d_rest, size, _all_front) for b in branches]
    if d_index is not None:  # each lane its own branch: every branch, then a select
        results = [eval_program(prog, *cs, *rest) for prog, cs, _ in batched]
        return _select_results(index, results), [0] * len(results[0])
    in_avals = [typeof(x) for x in rest]
    programs, consts = _uniform_branches([(p, cs) for p, cs, _ in batched], in_avals)
    outs = cond_p.bind(index, *consts, *rest, branches=tuple(programs), n_consts=len(consts))
    return outs, [0] * len(outs)


batching.set(cond_p, _cond_batching)


def _cond_of(index, staged, in_avals):
    """Bind ``cond`` over branches given as ``(program, constants)`` pairs, each program
    taking its constants then ``in_avals``; the operands follow."""
    programs, consts = _uniform_branches(staged, in_avals)
    return lambda *xs: cond_p.bind(index, *consts, *xs, branches=tuple(programs),
                                   n_consts=len(consts))


def _cond_jvp(primals, tangents, *, branches, n_consts):
    """A cond of the branches' JVPs, split as reverse mode needs it (NB: JAX's
    cond partial evaluation): a *primal* cond computing the outputs and the chosen
    branch's residuals (zeros in the other branches' slots), then a *tangent* cond,
    linear in the tangents, running the chosen branch's linear part on them. Only the
    chosen branch's derivative is ever evaluated, so a branch that is not taken cannot
    leak inf or NaN into the derivative (its partials are never multiplied by zero)."""
    index, args, targs = primals[0], list(primals[1:]), list(tangents[1:])
    in_avals = list(branches[0].in_avals)
    n_out = len(branches[0].outputs)
    nz_in = [not _is_zero_tangent(t, x) for t, x in zip(targs, args)]
    t_avals = [a for a, z in zip(in_avals, nz_in) if z]

    def joint(branch, want, box):
        def fn(*xs):
            it = iter(xs[len(in_avals):])
            ts = [next(it) if z else Zero(a) for z, a in zip(nz_in, in_avals)]
            outs, touts = jvp_program(branch, list(xs[:len(in_avals)]), ts)
            box.append([not isinstance(t, Zero) for t in touts])
            return list(outs) + [instantiate(t) for t, w in zip(touts, want) if w]
        return _stage_closed(fn, in_avals + t_avals)

    out_nz = [False] * n_out
    for b in branches:  # which outputs have a nonzero tangent in some branch
        box = []
        joint(b, [False] * n_out, box)
        out_nz = [x or y for x, y in zip(out_nz, box[0])]
    splits = []
    for b in branches:
        prog, k = joint(b, out_nz, [])
        known, linear = partial_eval(prog, [False] * (len(k) + len(in_avals))
                                     + [True] * len(t_avals))
        splits.append((prog, k, known, linear))
    res_avals = [[v.aval for v in known.outputs] for _, _, known, _ in splits]
    n_res = [len(r) for r in res_avals]
    all_res = [a for r in res_avals for a in r]

    primal_staged = []
    for j, (prog, k, known, _) in enumerate(splits):
        def primal(*xs, j=j, prog=prog, known=known):
            r = eval_program(known, *xs)
            env = dict(zip(known.outputs, r))
            outs = [a.value if isinstance(a, Literal) else env[a] for a in prog.outputs[:n_out]]
            res = []
            for i, avals in enumerate(res_avals):
                res += list(r) if i == j else [S.zeros(tuple(a.shape), a.dtype) for a in avals]
            return outs + res
        p, extra = _stage_closed(primal, [typeof(c) for c in k] + in_avals)
        primal_staged.append((p, list(extra) + list(k)))
    outs = _cond_of(index, primal_staged, in_avals)(*args)
    primal_out, residuals = outs[:n_out], outs[n_out:]

    tangent_staged = []
    for j, (_, _, _, linear) in enumerate(splits):
        lo = sum(n_res[:j])

        def tangent(*xs, lo=lo, j=j, linear=linear):
            res, ts = xs[:len(all_res)], xs[len(all_res):]
            return eval_program(linear, *res[lo:lo + n_res[j]], *ts)[n_out:]
        tangent_staged.append(_stage_closed(tangent, all_res + t_avals))
    t_in = [instantiate(t) for t, z in zip(targs, nz_in) if z]
    t_outs = iter(_cond_of(index, tangent_staged, all_res + t_avals)(*residuals, *t_in))
    return primal_out, [next(t_outs) if w else Zero(typeof(o))
                        for w, o in zip(out_nz, primal_out)]


def _cond_transpose(cts, index, *args, branches, n_consts):
    """A cond of the branches' transposes: only the chosen branch's runs (its known
    part evaluated forward first, then ``backward_pass``)."""
    lin = [isinstance(a, UndefinedPrimal) for a in args]
    in_avals = list(branches[0].in_avals)
    res = [a for a, z in zip(args, lin) if not z]
    res_avals = [typeof(a) for a in res]
    lin_avals = [a for a, z in zip(in_avals, lin) if z]
    out_avals = list(branches[0].out_avals)
    cts = [instantiate(c) if not isinstance(c, Zero) else instantiate(Zero(a))
           for c, a in zip(cts, out_avals)]
    staged = []
    for b in branches:
        # the branch with its linear inputs last (partial_eval splits by position)
        order = [v for v, z in zip(b.inputs, lin) if not z] + [v for v, z in zip(b.inputs, lin) if z]
        known, linear = partial_eval(Program(order, b.equations, b.outputs),
                                     [False] * len(res) + [True] * len(lin_avals))

        def transposed(*xs, known=known, linear=linear):
            r = eval_program(known, *xs[:len(res)])
            cts_in = backward_pass(linear, len(known.outputs), r, list(xs[len(res):]))
            return [instantiate(c) if not isinstance(c, Zero) else instantiate(Zero(a))
                    for c, a in zip(cts_in, lin_avals)]
        staged.append(_stage_closed(transposed, res_avals + out_avals))
    it = iter(_cond_of(index, staged, res_avals + out_avals)(*res, *cts))
    return [None] + [next(it) if z else None for z in lin]


jvp_rules.set(cond_p, _cond_jvp)
transpose.set(cond_p, _cond_transpose)


def _cond_sharding(index, *avals, branches, n_consts):
    """The factors the branches share (``BodyLinks`` over every branch, each input and
    output tied across the branches); each branch is partitioned as a per-device
    program of its own, from the operands' layouts to the same output layouts."""
    links = BodyLinks()
    for b in branches:
        links.program(b)
    first = branches[0]
    for b in branches[1:]:
        for x, y in zip(first.inputs, b.inputs):
            links.values(x, y)
        for x, y in zip(first.outputs, b.outputs):
            links.values(x, y)
    in_keys = [[]] + [dims_keys(v) for v in first.inputs]
    out_keys = []
    for j, a in enumerate(first.out_avals):
        v = next((b.outputs[j] for b in branches if isinstance(b.outputs[j], Var)), None)
        out_keys.append(dims_keys(v) if v is not None else [None] * a.ndim)
    return links.spec(in_keys, out_keys, max(body_flops(b) for b in branches),
                      _cond_partition)


def _cond_partition(operands, params, ins, outs, partition):
    index, rest = operands[0], list(operands[1:])
    parts = [partition(b, list(ins[1:]), list(outs)) for b in params["branches"]]
    consts = [c for _, cs in parts for c in cs]
    programs, off = [], 0
    for prog, cs in parts:  # every branch takes every branch's constants
        n = len(cs)
        before = [Var(typeof(c)) for c in consts[:off]]
        after = [Var(typeof(c)) for c in consts[off + n:]]
        programs.append(Program(before + list(prog.inputs[:n]) + after + list(prog.inputs[n:]),
                                prog.equations, prog.outputs))
        off += n
    return ([index] + consts + rest,
            dict(params, branches=tuple(programs), n_consts=len(consts) + params["n_consts"]))


sharding.set(cond_p, _cond_sharding)


def _flops(program) -> float:
    """A rough count of a Program's arithmetic: 2mnk for a matmul, one per output
    element otherwise (nested Programs count as costly)."""
    total = 0.0
    for eq in program.equations:
        outs = [v.aval for v in eq.outputs]
        if any(not a.is_static for a in outs):
            return float("inf")
        points = sum(float(np.prod(a.shape)) for a in outs)
        if eq.prim.name == "matmul":
            points *= 2 * max(int(eq.inputs[0].aval.shape[-1]), 1)
        elif any(isinstance(v, Program) for v in eq.params.values()):
            points = float("inf")
        total += points
    return total


def _graph_if_is_faster(programs) -> bool:
    """A graph ``if`` when the branches not taken would cost more than it (measured)."""
    costs = sorted(_flops(p) for p in programs)
    return sum(costs[:-1]) >= GRAPH_IF_FLOPS  # (not sum - max: inf - inf is nan)


def _has_effect(program) -> bool:
    """Whether a Program (or one nested in it) has an effect: a debug callback, which
    must run in the taken branch only, so its cond is a graph ``if``, never a select."""
    return any(eq.prim.effect or any(isinstance(v, Program) and _has_effect(v)
                                     for v in eq.params.values())
               for eq in program.equations)


# ===========================================================================
# The user API
# ===========================================================================


def while_loop(cond_fun, body_fun, init_val):
    """``while cond_fun(val): val = body_fun(val)``; return ``val`` (``jax.lax.while_loop``).

    >>> import fshard as fs
    >>> int(fs.while_loop(lambda i: i < 10, lambda i: i * 2, 1).asnumpy())
    16

    ``body_fun`` must return the carry's structure, shapes and dtypes; ``cond_fun`` a
    scalar bool. Runs as a MindSpore graph loop under ``jit``; forward-mode
    differentiable, not reverse mode (use ``fori_loop`` with static bounds or ``scan``).
    """
    api = "fs.while_loop"
    _check_fn(api, cond_fun, "cond_fun")
    _check_fn(api, body_fun, "body_fun")
    leaves, treedef = _leaves_of(init_val, api, "init_val")
    avals = [typeof(x) for x in leaves]
    body, b_consts, out_tree = _stage_tree_fn(body_fun, treedef, avals, api, "body_fun",
                                              loop=current_trace())
    if out_tree != treedef or list(body.out_avals) != avals:
        raise ProgramTypeError(
            f"{api}: body_fun({fun_name(body_fun)}) must return the carry's structure and "
            f"types; init_val vs what body_fun returns differ at "
            f"{_difference(treedef, avals, out_tree, list(body.out_avals))}.\nFix: return "
            "values of the same shapes and dtypes (cast, e.g. x.astype(init.dtype)).")
    cond, c_consts, c_tree = _stage_tree_fn(cond_fun, treedef, avals, api, "cond_fun")
    outs = cond.out_avals
    if len(outs) != 1 or outs[0].shape != () or outs[0].dtype != dtypes.bool_:
        raise ProgramTypeError(
            f"{api}: cond_fun({fun_name(cond_fun)}) must return one scalar bool, got "
            f"{_types(outs)}.\nFix: reduce it, e.g. (x > 0).all(), or compare scalars.")
    res = while_p.bind(*c_consts, *b_consts, *leaves, cond=cond, body=body,
                       n_cond_consts=len(c_consts), n_body_consts=len(b_consts))
    return tree.unflatten(treedef, res)


def _static_int(x) -> int | None:
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, (int, np.integer)):
        return int(x)
    return None


def fori_loop(lower, upper, body_fun, init_val, *, unroll: bool | None = None):
    """``for i in range(lower, upper): val = body_fun(i, val)``; return ``val``
    (``jax.lax.fori_loop``).

    >>> import numpy as np, fshard as fs
    >>> float(fs.fori_loop(0, 4, lambda i, x: x + i, np.float32(0)))
    6.0

    With static (Python int) bounds the loop is unrolled when it has at most
    ``MAX_UNROLL`` iterations (``unroll=None``) or when ``unroll=True``, and ``i`` is a
    Python int; with more iterations or ``unroll=False`` it is a ``scan`` over
    ``(i, val)``: one graph loop, ``i`` an int32 scalar. Every transform applies to
    both, reverse-mode ``grad`` included. With traced bounds it is a ``while_loop``:
    one graph loop, forward mode only.
    """
    api = "fs.fori_loop"
    _check_fn(api, body_fun, "body_fun")
    lo, hi = _static_int(lower), _static_int(upper)
    if unroll not in (None, True, False):
        raise ArgumentError(f"{api}(..., unroll=...): must be None, True or False, got "
                            f"{unroll!r}.")
    for name, v in (("lower", lower), ("upper", upper)):
        if _static_int(v) is None:
            a = typeof(v)
            if a.shape != () or not dtypes.is_int(a.dtype):
                raise ArgumentError(f"{api}: {name} must be an integer scalar, got {a}.")
    if lo is not None and hi is not None:
        if unroll is None:
            unroll = hi - lo <= MAX_UNROLL
        leaves, treedef = _leaves_of(init_val, api, "init_val")
        val = tree.unflatten(treedef, leaves)  # arrays: MindSpore's dtype rules
        types = [typeof(x) for x in leaves]

        def checked(i, val):
            # the same check as the while loop's, so the form never changes the answer
            val = body_fun(i, val)
            got, got_tree = tree.flatten(val)
            got_types = [typeof(x) for x in got]
            if got_tree != treedef or got_types != types:
                raise ProgramTypeError(
                    f"{api}: body_fun({fun_name(body_fun)}) must return the carry's "
                    f"structure and types; init_val vs what body_fun returns differ at "
                    f"{_difference(treedef, types, got_tree, got_types)}.\nFix: return "
                    "values of the same shapes and dtypes (cast, e.g. "
                    "x.astype(init.dtype)).")
            return val

        if unroll:
            with random.unrolled_loop(api) as loop:
                for i in range(lo, hi):
                    loop.iteration = i
                    val = checked(i, val)
            return val
        # A scan primitive over (i, val): one graph loop under jit, and reverse mode
        # works (its JVP rule unrolls), which a while loop's does not.
        outer = current_trace()

        def step(c, _):
            with random.loop_body(api, tree.flatten(c)[0], outer):
                return (c[0] + 1, checked(c[0], c[1])), None

        (_, val), _ = scan(step, (np.int32(lo), val), None, length=max(hi - lo, 0),
                           unroll=1)
        return val
    elif unroll:
        raise ArgumentError(
            f"{api}(..., unroll=True) needs static (Python int) bounds, got "
            f"{type(lower).__name__} and {type(upper).__name__}.")
    lo_t = E.cast(lower, dtypes.int32)
    hi_t = E.cast(upper, dtypes.int32)
    outer = current_trace()

    def body(c):
        with random.loop_body(api, tree.flatten(c)[0], outer):
            return E.add(c[0], 1), body_fun(c[0], c[1])

    _, val = while_loop(lambda c: E.less(c[0], hi_t), body, (lo_t, init_val))
    return val


def scan(f, init, xs=None, length=None, reverse: bool = False, unroll=None):
    """Loop ``carry, y = f(carry, x)`` over the leading axis of ``xs``; return
    ``(carry, stacked ys)`` (``jax.lax.scan``).

    >>> import numpy as np, fshard as fs
    >>> xs = np.arange(4, dtype=np.float32)
    >>> carry, ys = fs.scan(lambda c, x: (c + x, c * x), np.float32(0), xs)
    >>> float(carry), ys.asnumpy().tolist()
    (6.0, [0.0, 0.0, 2.0, 9.0])

    ``xs`` is a pytree of arrays sharing their leading length (or None with
    ``length``). ``f`` is traced once; the loop then runs in one of two forms:
    unrolled (the body repeated ``length`` times in the program) or a ``scan``
    primitive, one MindSpore graph loop under ``jit``. ``unroll`` as in JAX: an int
    ``k`` runs ``k`` body copies per iteration of the graph loop, ``True`` (or
    ``k >= length``) unrolls fully; ``None`` (the default) chooses by measurement:
    unrolled when ``length`` times the body's equation count is at most
    ``SCAN_UNROLL_EQUATIONS``, a graph loop beyond (docs/control_flow.md). Every
    transform applies to both forms, reverse-mode ``grad`` included; under ``shard``
    the graph loop's body is partitioned per device and the carry keeps its layout;
    inside ``shard_map`` it stays one loop, with collectives in its body.
    """
    api = "fs.scan"
    _check_fn(api, f, "f")
    if unroll is not None and not isinstance(unroll, bool) and (
            not isinstance(unroll, (int, np.integer)) or unroll < 1):
        raise ArgumentError(f"{api}(..., unroll=...): must be None, a bool or an int >= 1, "
                            f"got {unroll!r}.\nFix: unroll=1 for a graph loop, unroll=True "
                            "to unroll fully.")
    x_leaves, x_tree = _leaves_of(xs, api, "xs")
    lengths = {typeof(x).shape[0] if typeof(x).ndim else None for x in x_leaves}
    if None in lengths:
        raise ArgumentError(f"{api}: every leaf of xs needs a leading axis to scan over; "
                            "got a scalar.")
    if length is not None:
        if _static_int(length) is None or length < 0:
            raise ArgumentError(f"{api}: length must be a non-negative int, got {length!r}.")
        lengths.add(int(length))
    if not lengths:
        raise ArgumentError(f"{api}: with xs=None, pass length=.")
    if len(lengths) != 1:
        raise ArgumentError(
            f"{api}: the leading axes of xs{' and length' if length is not None else ''} "
            f"disagree: {sorted(lengths)}.\nFix: give every leaf of xs the same leading "
            "length.")
    n = lengths.pop()
    c_leaves, c_tree = _leaves_of(init, api, "init")
    c_types = [typeof(x) for x in c_leaves]
    n_carry = len(c_leaves)
    slice_avals = [ArrayType(tuple(typeof(x).shape[1:]), typeof(x).dtype) for x in x_leaves]
    box = []

    outer = current_trace()

    def body_fn(*flat):
        carry = tree.unflatten(c_tree, list(flat[:n_carry]))  # arrays: MindSpore's rules
        with random.loop_body(api, flat, outer):
            out = f(carry, tree.unflatten(x_tree, list(flat[n_carry:])))
        if not isinstance(out, tuple) or len(out) != 2:
            raise ArgumentError(
                f"{api}: f({fun_name(f)}) must return a pair (carry, y), got "
                f"{type(out).__name__}.")
        leaves, tr = tree.flatten(out[0])
        types = [typeof(x) for x in leaves]
        if tr != c_tree or types != c_types:
            raise ProgramTypeError(
                f"{api}: f({fun_name(f)}) must return a carry of the init's structure and "
                f"types; init vs the carry f returned differ at "
                f"{_difference(c_tree, c_types, tr, types)}.\nFix: return values of the "
                "same shapes and dtypes.")
        y_leaves, y_tree = _leaves_of(out[1], api, "the y f returns")
        box.append(y_tree)
        return list(leaves) + y_leaves

    body, consts = _stage_closed(body_fn, c_types + slice_avals)
    y_tree = box[0]
    if unroll is None:
        full = n * len(body.equations) <= SCAN_UNROLL_EQUATIONS
    else:
        full = unroll is True or (unroll is not False and int(unroll) >= n)
    if full or n == 0:
        outs = _scan_unrolled(body, consts, c_leaves, x_leaves, n, reverse)
    else:
        k = 1 if unroll is None or unroll is False else int(unroll)
        outs = scan_p.bind(*consts, *c_leaves, *x_leaves, body=body, length=n,
                           reverse=bool(reverse), unroll=k, n_consts=len(consts),
                           n_carry=n_carry)
    return tree.unflatten(c_tree, outs[:n_carry]), tree.unflatten(y_tree, outs[n_carry:])


# A scan whose length times its body's equation count is at most this is unrolled;
# beyond, it is one graph loop (measured: docs/performance.md#loops).
SCAN_UNROLL_EQUATIONS = 100


def _scan_unrolled(body, consts, carry, xs, n, reverse) -> list:
    """The staged body evaluated once per step: straight-line code in the program."""
    n_carry = len(carry)
    ys = [None] * n
    for i in (reversed(range(n)) if reverse else range(n)):
        outs = eval_program(body, *consts, *carry, *[S.getitem(x, i) for x in xs])
        carry, ys[i] = outs[:n_carry], outs[n_carry:]
    y_avals = body.out_avals[n_carry:]
    if n == 0:
        return list(carry) + [S.zeros((0,) + tuple(a.shape), a.dtype) for a in y_avals]
    return list(carry) + [S.stack([ys[i][k] for i in range(n)]) for k in range(len(y_avals))]


def switch(index, branches, *operands):
    """Call ``branches[index]`` on ``operands``, ``index`` clamped to the branches
    (``jax.lax.switch``).

    >>> import numpy as np, fshard as fs
    >>> float(fs.switch(1, [lambda x: x + 1, lambda x: x * 10], np.float32(2)))
    20.0

    Every branch must return the same structure, shapes and dtypes. A concrete index
    calls its branch; a traced one (under ``jit``, ``vmap``, ...) evaluates every branch
    and selects the result, so each lane of a ``vmap`` may take its own branch.
    """
    api = "fs.switch"
    branches = list(branches) if isinstance(branches, (list, tuple)) else None
    if not branches:
        raise ArgumentError(f"{api}(index, branches, *operands): branches must be a "
                            "non-empty list of functions.")
    for k, b in enumerate(branches):
        _check_fn(api, b, f"branches[{k}]")
    return _switch(api, index, branches, [f"branches[{k}]" for k in range(len(branches))],
                   operands)


def cond(pred, true_fun, false_fun, *operands):
    """``true_fun(*operands) if pred else false_fun(*operands)`` (``jax.lax.cond``).

    >>> import numpy as np, fshard as fs
    >>> float(fs.cond(np.float32(3) > 2, lambda x: x * 2, lambda x: -x, np.float32(3)))
    6.0

    ``pred`` is a scalar bool (or integer, nonzero meaning True); both branches must
    return the same structure, shapes and dtypes. With a traced ``pred``, costly
    branches run as one graph ``if`` under ``jit``, cheap ones are both evaluated and
    the result selected. Derivatives are those of the taken branch only (a branch
    that is inf or NaN where it is not taken does not reach the gradient), except
    under ``vmap`` with a per-lane ``pred``, where both branches run and are selected
    (docs/control_flow.md).
    """
    api = "fs.cond"
    _check_fn(api, true_fun, "true_fun")
    _check_fn(api, false_fun, "false_fun")
    if isinstance(pred, (bool, np.bool_, int, np.integer)):
        index = int(bool(pred))
    else:
        a = _scalar_index(api, "pred", pred)
        index = E.cast(E.not_equal(pred, 0) if a.dtype != dtypes.bool_ else pred,
                       dtypes.int32)
    return _switch(api, index, [false_fun, true_fun], ["false_fun", "true_fun"], operands)


def _scalar_index(api, name, x) -> ArrayType:
    try:
        a = typeof(x)
    except Exception:  # noqa: BLE001
        a = None
    if a is None or a.shape != () or not (dtypes.is_int(a.dtype) or a.dtype == dtypes.bool_):
        raise ArgumentError(
            f"{api}: {name} must be a scalar bool or integer, got "
            f"{a if a is not None else type(x).__name__}.\nFix: reduce it to a scalar "
            "(e.g. (x > 0).all()); under vmap each lane's scalar is its own.")
    return a


def _switch(api, index, branches, names, operands):
    leaves, treedef = _leaves_of(tuple(operands), api, "operands")
    operands = tree.unflatten(treedef, leaves)  # arrays, as the branches were traced with
    avals = [typeof(x) for x in leaves]
    outs, staged, key_uses = [], [], []
    for b, name in zip(branches, names):
        program, consts, out_tree = _stage_tree_fn(b, treedef, avals, api, name, star=True,
                                                   key_uses=key_uses)
        outs.append((name, out_tree, list(program.out_avals)))
        staged.append((program, consts))
    name0, tree0, types0 = outs[0]
    for name, tr, types in outs[1:]:
        if tr != tree0 or types != types0:
            raise ProgramTypeError(
                f"{api}: the branches return different types: {name0} vs {name} differ at "
                f"{_difference(tree0, types0, tr, types)}.\nFix: return the same "
                "structure, shapes and dtypes from every branch.")
    n = len(branches)
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return branches[min(max(int(index), 0), n - 1)](*operands)
    _scalar_index(api, "index", index)
    if not isinstance(index, Tracer):  # a concrete array: call its branch
        k = int(np.asarray(index.asnumpy() if hasattr(index, "asnumpy") else index))
        return branches[min(max(k, 0), n - 1)](*operands)
    if n == 1:
        return branches[0](*operands)
    index = E.cast(index, dtypes.int32)
    programs, consts = _uniform_branches(staged, avals)
    res = cond_p.bind(index, *consts, *leaves, branches=tuple(programs), n_consts=len(consts))
    # A key any branch drew from counts as consumed after the cond (each branch may
    # draw from the same key: only one of them runs).
    for leaf, used in zip(leaves, zip(*key_uses)):
        name = next((u for u in used if u is not None), None)
        if name is not None:
            random.mark_consumed(leaf, name)
    return tree.unflatten(tree0, res)
