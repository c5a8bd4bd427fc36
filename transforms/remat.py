"""``fs.remat``: recompute activations in the backward pass (NB: ``jax.checkpoint``).

``fs.remat(f, policy)`` stages ``f`` as one ``remat_call`` equation
(fshard/primitives/remat.py). Its derivative rules live here, next to the AD
interpreter they use:

- **JVP**: the ``remat_call`` of the body's JVP (primal and tangent outputs), so the
  recomputation boundary survives linearization.
- **Partial evaluation** (reverse mode): the JVP body splits like any Program into a
  known part (the forward values) and a linear part; the policy then chooses which
  known values the linear part may read from the forward pass (*saved*). The known
  part is inlined into the forward pass, computing the outputs and the saved values
  only; the linear part, preceded by the known equations it needs that were not
  saved (the *recomputation*), becomes a ``remat_call`` of its own.
- **Transpose** of that ``remat_call``: run the recomputation, behind a
  ``remat_barrier`` on the incoming cotangent (so it is neither merged with the
  forward pass nor scheduled before the backward pass reaches it), then transpose
  the linear part.

The function's inputs and outputs are always available to the backward pass (like
MindSpore's ``Cell.recompute``, which recomputes everything but the outputs).
"""

from __future__ import annotations

import functools
import types

from fshard.adapter.cells import maybe_cell
from fshard.core.tracing import Tracer, typeof
from fshard.core.ir import Equation, Program, Var
from fshard.primitives.base import UndefinedPrimal, Zero, instantiate
from fshard.primitives.control import _stage_closed
from fshard.primitives.remat import (barrier, checkpoint_name_p, dots_saveable,
                                     dots_with_no_batch_dims_saveable, everything_saveable,
                                     nothing_saveable, remat_call, remat_call_p,
                                     resolve_policy, save_any_names_but_these,
                                     save_only_these_names, saveable)
from fshard.core.rules import jvp as jvp_rules
from fshard.core.rules import partial_eval as partial_eval_rules
from fshard.core.rules import transpose as transpose_rules
from fshard.core import tree
from fshard.core.staging import check_function, fun_name, stage, trace_fun
from fshard.transforms.ad import backward_pass, jvp_program, partial_eval
from fshard.core.interpret import eval_program

# The policies, as ``fs.remat_policies.<name>`` (NB: ``jax.checkpoint_policies``).
remat_policies = types.SimpleNamespace(
    nothing_saveable=nothing_saveable,
    everything_saveable=everything_saveable,
    dots_saveable=dots_saveable,
    dots_with_no_batch_dims_saveable=dots_with_no_batch_dims_saveable,
    save_only_these_names=save_only_these_names,
    save_any_names_but_these=save_any_names_but_these,
)


# ---------------------------------------------------------------------------
# JVP
# ---------------------------------------------------------------------------


def _remat_jvp(primals, tangents, *, body, policy, name):
    nz = [not isinstance(t, Zero) for t in tangents]
    avals = list(body.in_avals)
    n = len(avals)

    def joint(*args):
        it = iter(args[n:])
        ts = [next(it) if z else Zero(a) for z, a in zip(nz, avals)]
        outs, touts = jvp_program(body, list(args[:n]), ts)
        return list(outs) + [instantiate(t) for t in touts]

    prog, consts = _stage_closed(joint, avals + [a for z, a in zip(nz, avals) if z])
    outs = remat_call_p.bind(*consts, *primals, *[t for t, z in zip(tangents, nz) if z],
                             body=prog, policy=policy, name=name)
    n_out = len(body.outputs)
    return list(outs[:n_out]), list(outs[n_out:])


jvp_rules.set(remat_call_p, _remat_jvp)


# ---------------------------------------------------------------------------
# Partial evaluation: what the forward pass saves, what the backward pass recomputes
# ---------------------------------------------------------------------------


def _remat_partial_eval(eq, mask):
    body, policy = eq.params["body"], eq.params["policy"]
    known_b, lin_b = partial_eval(body, mask)
    unknown_in = [v for v, u in zip(body.inputs, mask) if u]
    lin_defined = set(unknown_in) | {v for e in lin_b.equations for v in e.outputs}
    out_unknown = [isinstance(o, Var) and o in lin_defined for o in body.outputs]
    # Free for the backward pass: the known inputs and the known outputs.
    outer = {}  # body var -> the outer atom holding its value
    for v, a, u in zip(body.inputs, eq.inputs, mask):
        if not u:
            outer[v] = a
    for o, ov, u in zip(body.outputs, eq.outputs, out_unknown):
        if not u and isinstance(o, Var) and o not in outer:
            outer[o] = ov
    # What the linear part reads from the known side; walking the known equations
    # backwards, a needed value the policy saves is kept, any other is recomputed
    # (and what its equation reads is needed in turn).
    pending = {a for e in lin_b.equations for a in e.inputs
               if isinstance(a, Var) and a not in lin_defined and a not in outer}
    saved, recompute = set(), []
    for e in reversed(known_b.equations):
        hit = [o for o in e.outputs if o in pending]
        if not hit:
            continue
        if saveable(policy, e):
            saved.update(hit)
        else:
            recompute.append(e)
            pending.update(a for a in e.inputs if isinstance(a, Var) and a not in outer)
    recompute.reverse()
    # The forward pass: the known equations computing the known outputs and the saved
    # values, inlined (outer variables for their results).
    targets = saved | {o for o, u in zip(body.outputs, out_unknown)
                       if not u and isinstance(o, Var)}
    live, keep = set(targets), []
    for e in reversed(known_b.equations):
        if any(o in live for o in e.outputs):
            keep.append(e)
            live.update(a for a in e.inputs if isinstance(a, Var))
    keep.reverse()
    env = {v: a for v, a, u in zip(body.inputs, eq.inputs, mask) if not u}
    named = {}
    for o, ov, u in zip(body.outputs, eq.outputs, out_unknown):
        if not u and isinstance(o, Var) and o not in named and o not in env:
            named[o] = ov
    k_eqs = []
    for e in keep:
        outs = [named.get(o) or Var(o.aval) for o in e.outputs]
        k_eqs.append(Equation(e.prim, [env[a] if isinstance(a, Var) else a for a in e.inputs],
                              e.params, outs, e.source))
        env.update(zip(e.outputs, outs))
    for o, ov, u in zip(body.outputs, eq.outputs, out_unknown):
        if not u and not (isinstance(o, Var) and named.get(o) is ov):
            # an output that is an input, a literal or a repeated value: the identity
            src = env[o] if isinstance(o, Var) else o
            k_eqs.append(Equation(checkpoint_name_p, [src], {"name": "remat_output"}, [ov]))
    if not any(out_unknown):
        return k_eqs, []
    # The backward pass: the recomputation, then the linear part.
    reads = {a for e in recompute + lin_b.equations for a in e.inputs if isinstance(a, Var)}
    redone = {o for e in recompute for o in e.outputs}  # (another output of an equation
    # recomputed for a value the linear part needs may itself be an output)
    free = [v for v in list(body.inputs) + list(body.outputs)
            if isinstance(v, Var) and v in outer and v in reads and v not in redone]
    free = list(dict.fromkeys(free))
    kept = [o for e in known_b.equations for o in e.outputs if o in saved]
    u_body = Program(free + kept + unknown_in, recompute + list(lin_b.equations),
                     [o for o, u in zip(body.outputs, out_unknown) if u])
    operands = ([outer[v] for v in free] + [env[v] for v in kept]
                + [a for a, u in zip(eq.inputs, mask) if u])
    u_eq = Equation(remat_call_p, operands, dict(eq.params, body=u_body),
                    [ov for ov, u in zip(eq.outputs, out_unknown) if u], eq.source)
    return k_eqs, [u_eq]


partial_eval_rules.set(remat_call_p, _remat_partial_eval)


# ---------------------------------------------------------------------------
# Transpose: recompute, then transpose the linear part
# ---------------------------------------------------------------------------


def _remat_transpose(cts, *args, body, policy, name):
    mask = [isinstance(a, UndefinedPrimal) for a in args]
    nonzero = [c for c in cts if not isinstance(c, Zero) and c is not None]
    if not nonzero:
        return [None] * len(args)
    known, lin = partial_eval(body, mask)
    known_args = [a for a, u in zip(args, mask) if not u]
    if known.equations:
        # The recomputation waits for the cotangent and stays a computation of its own.
        where = [i for i, a in enumerate(known_args) if isinstance(a, Tracer)]
        fenced = barrier([known_args[i] for i in where], nonzero[0])
        for i, x in zip(where, fenced):
            known_args[i] = x
    residuals = eval_program(known, *known_args)
    cts_in = backward_pass(lin, len(known.outputs), residuals, list(cts))
    it = iter(cts_in)
    return [next(it) if u else None for u in mask]


transpose_rules.set(remat_call_p, _remat_transpose)


# ---------------------------------------------------------------------------
# The user API
# ---------------------------------------------------------------------------


def remat(fun=None, policy=None):
    """``fun`` whose derivative recomputes its intermediate values in the backward pass
    instead of keeping them from the forward pass (NB: ``jax.checkpoint`` /
    ``jax.remat``; MindSpore's ``Cell.recompute``).

    >>> import numpy as np, fshard as fs
    >>> layer = fs.remat(lambda w, x: fs.ops.tanh(x @ w))
    >>> w, x = np.eye(2, dtype=np.float32), np.ones((1, 2), np.float32)
    >>> fs.grad(lambda w: layer(w, x).sum())(w).asnumpy()
    array([[0.41997433, 0.41997433],
           [0.41997433, 0.41997433]], dtype=float32)

    Args:
        fun: a function of pytrees of arrays (or an ``nn.Cell``). Use as ``fs.remat(f)``,
            ``@fs.remat`` or ``@fs.remat(policy=...)``.
        policy: which intermediate values the backward pass may keep: ``None`` (keep
            none: recompute everything but the inputs and outputs), a name
            (``"nothing_saveable"``, ``"dots_saveable"``,
            ``"dots_with_no_batch_dims_saveable"``, ``"everything_saveable"``), a policy
            from ``fs.remat_policies`` (e.g. ``save_only_these_names("h")`` with
            ``fs.checkpoint_name(h, "h")`` in ``fun``), or a function
            ``(prim, *avals, **params) -> bool`` of one forward equation.

    Values and derivatives equal ``fun``'s; only what the backward pass holds changes.
    Array leaves of the arguments are traced; other leaves (Python numbers) are
    constants. See docs/remat.md.
    """
    pol = resolve_policy(policy)
    if fun is None:
        return lambda f: remat(f, policy=pol)
    check_function("fs.remat", fun)
    return maybe_cell(fun, lambda f: _remat(f, pol))


def _remat(fun, policy):
    name = fun_name(fun)

    @functools.wraps(fun)
    def rematted(*args, **kwargs):
        return remat_call(fun, args, kwargs, policy, name)

    return rematted


# ---------------------------------------------------------------------------
# Inspection: what the backward pass keeps from the forward pass
# ---------------------------------------------------------------------------


def saved_residuals(fun, *args) -> list:
    """The types of the values reverse-mode differentiation of ``fun`` at ``args``
    keeps from the forward pass for the backward pass (the residuals), the inputs
    excluded (NB: ``jax.ad_checkpoint.saved_residuals``).

    >>> import numpy as np, fshard as fs
    >>> from fshard.transforms.remat import saved_residuals
    >>> f = lambda x: fs.ops.sin(fs.ops.sin(x)).sum()
    >>> len(saved_residuals(f, np.ones(3, np.float32)))
    3
    >>> len(saved_residuals(fs.remat(f), np.ones(3, np.float32)))
    1
    """
    check_function("saved_residuals", fun)
    leaves, in_tree = tree.flatten((tuple(args), {}))
    traced = trace_fun(fun, in_tree, [typeof(x) for x in leaves])
    program, n_c = traced.program, len(traced.consts)
    in_avals = list(program.in_avals)
    n_in = len(in_avals)

    def jvp_flat(*a):
        ts = [Zero(x) for x in in_avals[:n_c]] + list(a[n_in:])
        outs, touts = jvp_program(program, list(a[:n_in]), ts)
        return outs + [instantiate(t) for t in touts]

    jprog, jconsts = stage(jvp_flat, in_avals + in_avals[n_c:])
    known, _ = partial_eval(jprog, [False] * (len(jconsts) + n_in) + [True] * (n_in - n_c))
    inputs = set(jprog.inputs)
    return [v.aval for v in known.outputs if v not in inputs]
