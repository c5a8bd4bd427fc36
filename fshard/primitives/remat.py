"""Recomputation (rematerialisation): ``remat_call``, ``checkpoint_name`` and
``remat_barrier`` (NB: JAX's ``checkpoint`` / ``remat_p`` and ``name_p``).

A function wrapped in ``fs.remat`` stages as one ``remat_call`` equation whose body
is the function's Program and whose ``policy`` says which of the body's values the
backward pass may keep from the forward pass. Evaluated, batched or lowered, the
equation is just its body. Its derivative rules (transforms/remat.py) split the
linearized body: the forward pass computes the outputs and the values the policy
saves; the backward pass recomputes the rest from the saved values before
transposing.

``remat_barrier`` makes the recomputation a computation of its own: its outputs are
its first operands, but they depend on its last operand (a cotangent), so neither
fshard's common-subexpression pass nor MindSpore's graph compiler merges the
recomputed values with the forward ones, and the recomputation cannot run before
the backward pass reaches it (lowered as ``ops.depend``).

``checkpoint_name`` is the identity that tags a value for ``save_only_these_names``.

The policies live here too: a policy is a function ``policy(prim, *avals, **params)
-> bool`` of one equation of the forward pass, True when its outputs may be saved
(JAX's signature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from mindspore import Tensor, ops

from fshard.core import tree
from fshard.backend.mindspore import as_tensor
from fshard.core.tracing import EvalTrace, Tracer, current_trace, typeof
from fshard.errors import ArgumentError
from fshard.core.factors import FactorSpec, elementwise_spec
from fshard.core.interpret import eval_program
from fshard.primitives.base import (batch_size, deflinear, def_primitive, instantiate,
                                    vectorized)
from fshard.core.ir import Var
from fshard.primitives.control import (BodyLinks, _all_front, _batch_closed, _front_args,
                                      _stage_closed, body_flops, dims_keys)
from fshard.core.rules import batching, jvp, sharding, transpose, unsupported

FAMILY = "control"


# ---------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """A named recomputation policy: ``fn(prim, *avals, **params) -> bool``."""

    name: str
    fn: Callable

    def __call__(self, prim, *avals, **params) -> bool:
        return bool(self.fn(prim, *avals, **params))

    def __repr__(self) -> str:
        return self.name


def _is_dot(prim) -> bool:
    return prim.name == "matmul"


nothing_saveable = Policy("nothing_saveable", lambda prim, *a, **p: False)
everything_saveable = Policy("everything_saveable", lambda prim, *a, **p: True)
dots_saveable = Policy("dots_saveable", lambda prim, *a, **p: _is_dot(prim))
# A matmul of two matrices: a batched matmul (an attention score) is not saved.
dots_with_no_batch_dims_saveable = Policy(
    "dots_with_no_batch_dims_saveable",
    lambda prim, *a, **p: _is_dot(prim) and all(x.ndim <= 2 for x in a))


def save_only_these_names(*names: str) -> Policy:
    """Save only the values tagged with ``fs.checkpoint_name(x, name)`` for a name in
    ``names``; recompute everything else."""
    for n in names:
        if not isinstance(n, str):
            raise ArgumentError(
                f"save_only_these_names(*names): every name must be a str, got "
                f"{type(n).__name__} {n!r}.\nFix: pass the names given to "
                "fs.checkpoint_name, e.g. save_only_these_names('ffn_out').")
    wanted = frozenset(names)
    return Policy(f"save_only_these_names{tuple(names)!r}",
                  lambda prim, *a, name=None, **p: prim is checkpoint_name_p
                  and name in wanted)


def save_any_names_but_these(*names: str) -> Policy:
    """Save every value tagged with ``fs.checkpoint_name`` except those in ``names``."""
    excluded = save_only_these_names(*names)
    return Policy(f"save_any_names_but_these{tuple(names)!r}",
                  lambda prim, *a, **p: prim is checkpoint_name_p
                  and not excluded(prim, *a, **p))


POLICIES = {p.name: p for p in (nothing_saveable, everything_saveable, dots_saveable,
                                dots_with_no_batch_dims_saveable)}


def resolve_policy(policy, api: str = "fs.remat") -> Policy:
    """A ``Policy`` from ``None`` (save nothing), a policy's name, a ``Policy`` or a
    function ``(prim, *avals, **params) -> bool``."""
    if policy is None:
        return nothing_saveable
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        if policy in POLICIES:
            return POLICIES[policy]
        raise ArgumentError(
            f"{api}(policy={policy!r}): unknown policy name; expected one of "
            f"{sorted(POLICIES)}.\nFix: use one of these names, a policy from "
            "fs.remat_policies (e.g. fs.remat_policies.save_only_these_names('h')), or "
            "a function (prim, *avals, **params) -> bool.")
    if callable(policy):
        return Policy(getattr(policy, "__name__", "custom_policy"), policy)
    raise ArgumentError(
        f"{api}(policy=...): expected None, a policy name (str), a policy from "
        f"fs.remat_policies or a function (prim, *avals, **params) -> bool; got "
        f"{type(policy).__name__} {policy!r:.60}.\nFix: e.g. "
        "policy=fs.remat_policies.dots_saveable.")


def saveable(policy: Policy, eq) -> bool:
    """Whether the policy lets the backward pass keep ``eq``'s outputs."""
    return policy(eq.prim, *[a.aval for a in eq.inputs], **eq.params)


# ---------------------------------------------------------------------------
# checkpoint_name: the identity, tagging a value for a policy
# ---------------------------------------------------------------------------


def _ms_identity(x, name):
    return x


checkpoint_name_p = def_primitive("checkpoint_name", FAMILY, lambda x, *, name: x,
                                  _ms_identity, lower=lambda ctx, x, name: x)
batching.set(checkpoint_name_p, vectorized(checkpoint_name_p))
sharding.set(checkpoint_name_p, lambda x, *, name: elementwise_spec(x))
deflinear(checkpoint_name_p, lambda ct, x, *, name: [ct])


def checkpoint_name(x, name: str):
    """Tag ``x`` (an array or a pytree of arrays) as ``name`` for a recomputation
    policy (``fs.remat_policies.save_only_these_names``); returns ``x``.

    >>> import numpy as np, fshard as fs
    >>> fs.checkpoint_name(np.float32(2.0), "h").asnumpy()
    array(2., dtype=float32)
    """
    if not isinstance(name, str):
        raise ArgumentError(
            f"fs.checkpoint_name(x, name): name must be a str, got {type(name).__name__} "
            f"{name!r}.\nFix: fs.checkpoint_name(x, 'ffn_out').")
    return tree.map(lambda v: checkpoint_name_p.bind(v, name=name), x)


# ---------------------------------------------------------------------------
# remat_barrier: xs, ordered after (and not merged across) a dependency
# ---------------------------------------------------------------------------
#
# Operands: xs + [dep]. Results: xs.


def _barrier_lower(ctx, *exprs):
    *xs, dep = exprs
    return "(" + "".join(f"{ctx.call(ops.depend, x, dep)}, " for x in xs) + ")"


remat_barrier_p = def_primitive("remat_barrier", FAMILY, lambda *avals: list(avals[:-1]),
                                eager=lambda *args: list(args[:-1]), lower=_barrier_lower,
                                multiple_results=True)
batching.set(remat_barrier_p, lambda args, dims: (remat_barrier_p.bind(*args), list(dims[:-1])))


def _barrier_jvp(primals, tangents):
    return remat_barrier_p.bind(*primals), [instantiate(t) for t in tangents[:-1]]


jvp.set(remat_barrier_p, _barrier_jvp)
unsupported(remat_barrier_p, "transpose",
            "its JVP passes the tangents through, so it never appears in a linear program")


def _barrier_sharding(*avals):
    """Each x keeps its layout. The dependency's values are never read, so any layout
    of it would do; a factor rule splits each mesh axis over one factor, so the
    dependency shares the factors of an x of its shape (the cotangent of a block's
    output and the block's input: both stay split alike, with no communication), or
    else has factors of its own ('reduce' factors that leave no output partial)."""
    *xs, dep = avals
    ins = [tuple(f"x{i}_{d}" for d in range(a.ndim)) for i, a in enumerate(xs)]
    twin = next((i for i, a in enumerate(xs) if tuple(a.shape) == tuple(dep.shape)), None)
    own = twin is None
    dep_labels = tuple(f"dep_{d}" for d in range(dep.ndim)) if own else ins[twin]
    sizes = {lab: a.shape[d] for labels, a in zip(ins + [dep_labels], list(xs) + [dep])
             for d, lab in enumerate(labels)}
    return FactorSpec(ins + [dep_labels], list(ins), sizes,
                      reduce=frozenset(dep_labels) if own else frozenset(),
                      partial_outputs={}, flops_per_point=0.0, linear=())


sharding.set(remat_barrier_p, _barrier_sharding)


def barrier(xs: list, dep) -> list:
    """``xs``, computed after ``dep`` and never merged with equal values."""
    if not xs:
        return []
    return list(remat_barrier_p.bind(*xs, dep))


# ---------------------------------------------------------------------------
# remat_call
# ---------------------------------------------------------------------------
#
# Operands: the body's inputs (its captured constants first). Params: body (a closed
# Program), policy (a Policy), name (the function's, for messages).


def _remat_type(*avals, body, policy, name):
    return list(body.out_avals)


def _remat_impl(*args, body, policy, name):
    return eval_program(body, *args)


def _remat_lower(ctx, *exprs, body, policy, name):
    helper = ctx.function(body, "remat")
    return f"{helper}({', '.join(exprs)})"


remat_call_p = def_primitive("remat_call", FAMILY, _remat_type, eager=_remat_impl,
                             lower=_remat_lower, multiple_results=True)


def _remat_batching(args, dims, *, body, policy, name):
    size = batch_size(args, dims)
    args, dims = _front_args(args, dims)
    new_body, consts, _ = _batch_closed(body, dims, size, _all_front)
    outs = remat_call_p.bind(*consts, *args, body=new_body, policy=policy, name=name)
    return outs, [0] * len(outs)


batching.set(remat_call_p, _remat_batching)


def _remat_sharding(*avals, body, policy, name):
    """The body's factors (``BodyLinks``, as for a cond's branches); the body is
    partitioned as a per-device program of its own. (A gradient's program holds the
    forward equations and the recomputation inline: only an undifferentiated
    remat_call, or one in ``grad(shard(f))``, reaches the partitioner.)"""
    links = BodyLinks()
    links.program(body)
    in_keys = [dims_keys(v) for v in body.inputs]
    out_keys = [dims_keys(v) if isinstance(v, Var) else [None] * v.aval.ndim
                for v in body.outputs]
    return links.spec(in_keys, out_keys, body_flops(body), _remat_partition)


def _remat_partition(operands, params, ins, outs, partition):
    body, consts = partition(params["body"], list(ins), list(outs))
    return list(consts) + list(operands), dict(params, body=body)


sharding.set(remat_call_p, _remat_sharding)


def _is_operand(x) -> bool:
    return isinstance(x, (Tracer, Tensor, np.ndarray, np.generic))


def remat_call(fun, args: tuple, kwargs: dict, policy: Policy, name: str):
    """Call ``fun(*args, **kwargs)`` as one ``remat_call`` equation. Array leaves of
    the arguments are its operands; other leaves (Python numbers, strings) are
    constants of the body. Outside any transform, just calls ``fun``."""
    if type(current_trace()) is EvalTrace:  # NumPy arrays reach it as Tensors, as in jit
        args, kwargs = tree.map(lambda a: as_tensor(a) if isinstance(a, np.ndarray) else a,
                                (tuple(args), dict(kwargs)))
        return fun(*args, **kwargs)
    leaves, in_tree = tree.flatten((tuple(args), dict(kwargs)))
    where = [i for i, x in enumerate(leaves) if _is_operand(x)]
    operands = [leaves[i] for i in where]
    box = []

    def flat(*xs):
        full = list(leaves)
        for i, x in zip(where, xs):
            full[i] = x
        a, k = tree.unflatten(in_tree, full)
        out_leaves, out_tree = tree.flatten(fun(*a, **k))
        box.append(out_tree)
        return out_leaves

    body, consts = _stage_closed(flat, [typeof(x) for x in operands])
    outs = remat_call_p.bind(*consts, *operands, body=body, policy=policy, name=name)
    return tree.unflatten(box[0], outs)
