"""A mixture-of-experts layer with expert parallelism: ``fs.nn.moe``.

A router sends each token to its top-``k`` experts; each expert takes at most
``capacity`` tokens of a token group (GShard's rule: first choices first, then in
token order; the others are dropped and pass through as zeros). With ``axis_name``
(inside ``fs.shard_map``), the tokens *and* the experts are split over that axis: each
device routes its own tokens, one ``all_to_all`` sends every expert its tokens, the
device runs its own experts, and a second ``all_to_all`` brings the results home.
A device's tokens are one group, so the layer equals the unsplit layer applied to
each device's tokens.

>>> import numpy as np, fshard as fs
>>> rng = np.random.default_rng(0)
>>> x = rng.normal(size=(8, 4)).astype(np.float32)            # 8 tokens
>>> router = rng.normal(size=(4, 2)).astype(np.float32)       # 2 experts
>>> experts = rng.normal(size=(2, 4, 4)).astype(np.float32)   # one matrix each
>>> y, aux = fs.nn.moe(x, router, lambda w, t: fs.ops.matmul(t, w), experts, capacity=8)
>>> y.shape, aux.shape
((8, 4), ())
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from fshard.core import dtypes, tree
from fshard import ops
from fshard.core.array_types import Array, Float
from fshard.core.tracing import typeof
from fshard.errors import ArgumentError
from fshard.primitives import collectives


def _positive_int(api: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ArgumentError(f"{api}: {name} must be a positive int, got {v!r}.")
    return int(v)


def _route(x, router, k: int, capacity: int, n_experts: int):
    """Dispatch ``[T, E, C]`` (0/1), combine ``[T, E, C]`` (gate weights) and the
    load-balancing loss of one token group."""
    logits = ops.matmul(x, router)                                  # [T, E]
    probs = ops.softmax(logits, -1)
    top, idx = ops.topk(probs, k)                                   # [T, k]
    gates = top if k == 1 else ops.div(top, ops.reduce_sum(top, -1, keepdims=True))
    dtype = typeof(x).dtype
    dispatch = combine = None
    taken = None                                                    # [E]: slots used so far
    for choice in range(k):                                         # first choices first
        mask = ops.one_hot(ops.getitem(idx, (slice(None), choice)), n_experts, dtype)
        pos = ops.sub(ops.cumsum(mask, 0), np.asarray(1, dtypes.to_numpy(dtype)))
        if taken is not None:
            pos = ops.add(pos, taken)
        keep = ops.mul(mask, ops.cast(ops.less(pos, float(capacity)), dtype))
        slot = ops.one_hot(ops.cast(ops.mul(pos, keep), np.int32), capacity, dtype)
        d = ops.mul(ops.expand_dims(keep, 2), slot)                  # [T, E, C]
        g = ops.mul(d, ops.reshape(ops.getitem(gates, (slice(None), choice)), (-1, 1, 1)))
        dispatch = d if dispatch is None else ops.add(dispatch, d)
        combine = g if combine is None else ops.add(combine, g)
        used = ops.reduce_sum(mask, 0)
        taken = used if taken is None else ops.add(taken, used)
    # Switch Transformer's auxiliary loss: E * sum_e (share of first choices) * (mean prob)
    first = ops.one_hot(ops.getitem(idx, (slice(None), 0)), n_experts, dtype)
    aux = ops.mul(ops.reduce_sum(ops.mul(ops.mean(first, 0), ops.mean(probs, 0))),
                  np.asarray(n_experts, dtypes.to_numpy(dtype)))
    return dispatch, combine, aux


def moe(x: Float[Array, "tokens hidden"], router: Float[Array, "hidden experts"],
        expert_fn: Callable[[Any, Array], Array], expert_params: Any, *, k: int = 1,
        capacity: int, axis_name=None) -> tuple[Float[Array, "tokens hidden"], Array]:
    """A mixture-of-experts layer: ``(y, aux_loss)``.

    Args:
        x: the tokens ``[T, hidden]`` (this device's, under ``axis_name``).
        router: the router's weights ``[hidden, E]`` (E experts in all), replicated.
        expert_fn: ``expert_fn(params, tokens[C, hidden]) -> [C, hidden]``, one expert.
        expert_params: the experts' parameters, every leaf with a leading experts
            dimension (``E``, or ``E / n`` per device under ``axis_name``).
        k: experts per token; their gate weights are the router's probabilities,
            renormalised over the ``k`` choices when ``k > 1``.
        capacity: the most tokens each expert takes from one token group.
        axis_name: a mesh axis (inside ``fs.shard_map``) over which tokens and
            experts are both split: expert parallelism.

    Returns:
        ``y``, the gate-weighted sum of each token's experts' outputs (zeros for a
        token every choice of which was dropped), and the load-balancing loss of the
        token group (averaged over ``axis_name``'s devices).
    """
    api = "fs.nn.moe(x, router, expert_fn, expert_params, capacity=...)"
    ax, ar = typeof(x), typeof(router)
    if ax.ndim != 2 or ar.ndim != 2 or ar.shape[0] != ax.shape[1]:
        raise ArgumentError(f"{api}: x must be [tokens, hidden] and router [hidden, experts], "
                            f"got x {ax} and router {ar}.\nFix: flatten batch and sequence "
                            "into tokens (x.reshape(-1, hidden)).")
    n_experts = ar.shape[1]
    k = _positive_int(api, "k", k)
    capacity = _positive_int(api, "capacity", capacity)
    if k > n_experts:
        raise ArgumentError(f"{api}: k={k} is more than the {n_experts} experts.")
    n = 1 if axis_name is None else collectives.axis_size(axis_name)
    if n_experts % n:
        raise ArgumentError(f"{api}: the {n_experts} experts do not split over the {n} "
                            f"devices of {axis_name!r}.\nFix: use a multiple of {n} experts.")
    local = n_experts // n
    for leaf in tree.leaves(expert_params):
        if typeof(leaf).ndim < 1 or typeof(leaf).shape[0] != local:
            raise ArgumentError(
                f"{api}: every expert parameter needs a leading experts dimension of "
                f"{local} ({n_experts} experts over {n} devices), got {typeof(leaf)}."
                + ("\nFix: split the experts' parameters over the axis in in_strategy."
                   if n > 1 else ""))
    dispatch, combine, aux = _route(x, router, k, capacity, n_experts)
    # [E, C, hidden]: what each expert receives from this group
    inputs = ops.reshape(ops.matmul(ops.transpose(ops.reshape(
        dispatch, (ax.shape[0], n_experts * capacity)), (1, 0)), x),
        (n_experts, capacity, ax.shape[1]))
    if n > 1:   # to the experts' devices: [E/n, n*C, hidden], groups in device order
        inputs = collectives.all_to_all(inputs, axis_name, 0, 1, tiled=True)
    outputs = _vmap(expert_fn)(expert_params, inputs)
    if n > 1:   # and back: [E, C, hidden]
        outputs = collectives.all_to_all(outputs, axis_name, 1, 0, tiled=True)
        aux = collectives.pmean(aux, axis_name)
    y = ops.matmul(ops.reshape(combine, (ax.shape[0], n_experts * capacity)),
                   ops.reshape(outputs, (n_experts * capacity, -1)))
    return y, aux


def _vmap(fn):
    # fs.vmap lives in the transforms layer, above this one: run the experts one by
    # one instead (E / n is small; each is one matmul chain in the same program).
    def run(params, inputs):
        outs = []
        for e in range(typeof(inputs).shape[0]):
            p = tree.map(lambda leaf, e=e: ops.getitem(leaf, e), params)
            outs.append(fn(p, ops.getitem(inputs, e)))
        return ops.stack(outs, 0)
    return run
