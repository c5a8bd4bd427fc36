"""Batching-rule helpers shared by the primitive families (NB: JAX batching.py's
defvectorized / defbroadcasting). A batch dim ``d`` is an int axis or ``None``
(operand not batched)."""

from __future__ import annotations

from fshard.core import typeof


def move_axis(x, src: int, dst: int):
    """Move axis ``src`` of ``x`` to position ``dst`` (a transpose, or nothing)."""
    from fshard.primitives.structural import transpose

    nd = typeof(x).ndim
    src, dst = src % nd, dst % nd
    if src == dst:
        return x
    perm = [i for i in range(nd) if i != src]
    perm.insert(dst, src)
    return transpose(x, tuple(perm))


def batch_to_front(x, d, size: int):
    """``x`` with its batch dim at axis 0, broadcasting an unbatched ``x`` to ``size``."""
    from fshard.primitives.structural import broadcast_to

    if d is None:
        shape = typeof(x).shape
        return broadcast_to(x, (size,) + tuple(shape))
    return move_axis(x, d, 0)


def batch_size(args, dims) -> int:
    for x, d in zip(args, dims):
        if d is not None:
            return typeof(x).shape[d]
    raise AssertionError("batching rule called with no batched operand")


def vectorized(prim):
    """Rule for a primitive applied independently to each element of one operand."""

    def rule(args, dims, **params):
        out = prim.bind(*args, **params)
        outs = out if prim.multiple_results else [out]
        return outs, [dims[0]] * len(outs)

    return rule


def broadcasting(prim):
    """Rule for an n-ary primitive whose operands all have the same shape."""

    def rule(args, dims, **params):
        if all(d == dims[0] for d in dims):
            return [prim.bind(*args, **params)], [dims[0]]
        size = batch_size(args, dims)
        args = [batch_to_front(x, d, size) for x, d in zip(args, dims)]
        return [prim.bind(*args, **params)], [0]

    return rule
