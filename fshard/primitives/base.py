"""What every primitive family is built on: the declaration API, the helpers that
write the common rules, and the few primitives those helpers and every family's
rules are written with.

- declaring: ``def_primitive`` (type rule, eager implementation, lowering), then
  ``defjvp`` / ``deflinear`` (differentiation), ``vectorized`` / ``broadcasting``
  (batching) and ``rules.sharding.set`` with a ``FactorSpec``;
- symbolic zeros (``Zero``, ``instantiate``) and the linear operand of a transpose
  (``UndefinedPrimal``);
- batching helpers: ``move_axis``, ``batch_to_front``, ``batch_size``;
- the primitives these need, with all their rules: ``broadcast_to``, ``reshape``,
  ``transpose``, ``full`` (zeros), ``add`` (sums of tangents) and ``reduce_sum`` (the
  transpose of a broadcast). They call each other's rules (a broadcast transposes
  to a sum, a sum to a broadcast), so they live together here (NB: JAX's lax.py);
  their families' modules re-export them.

Every family module imports this one and nothing imports the families from here,
so the primitives' imports form no cycle. A primitive's eager implementation is a
plain MindSpore function ``ms_fn(*xs, **params)`` written in the subset of Python
that MindSpore's GRAPH mode parses: the same function serves eager evaluation and
lowering, so a primitive's MindSpore semantics live in one place.
"""

from __future__ import annotations

import math
import sys
from typing import Callable

import numpy as np
from mindspore import ops

from fshard.core import dtypes
from fshard.core.array_types import Array, ArrayLike, Shaped
from fshard.backend import mindspore as backend
from fshard.backend.mindspore import as_tensor
from fshard.core.tracing import (ArrayType, DimExpr, Primitive, Symbol, dim_div, dim_prod, dims_equal,
                         is_symbolic, typeof)
from fshard.errors import ArgumentError, ProgramTypeError, ShapeError
from fshard.core.factors import FactorSpec, elementwise_spec
from fshard.core.interpret import current_axis
from fshard.core.rules import abstract_eval, batching, impl, jvp, lowering, register_primitive, sharding
from fshard.core.rules import transpose as transpose_rules
from fshard.core.rules import unsupported

# ---------------------------------------------------------------------------
# Declaring a primitive, and its differentiation rules
# ---------------------------------------------------------------------------


def def_primitive(name: str, family: str, type_rule: Callable, ms_fn: Callable | None = None,
                  *, multiple_results: bool = False, lower: Callable | None = None,
                  eager: Callable | None = None, show: Callable | None = None,
                  effect: bool = False) -> Primitive:
    """Declare ``name`` with its type rule, eager implementation and lowering: the one
    way to declare a primitive. Its other rules follow with ``rules.<kind>.set``.

    ``type_rule(*avals, **params)`` returns an ArrayType (a list of them if
    ``multiple_results``). ``ms_fn(*tensors, **params)`` is the MindSpore function that
    serves both eager evaluation and, by default, lowering (``lower(ctx, *exprs,
    **params)`` otherwise). A primitive that is not one MindSpore function (a
    collective, a sharded call) gives ``eager(*values, **params) -> list`` and ``lower``
    instead of ``ms_fn``. ``show(params)`` gives the equation's head in printed IR
    (default ``name[params]``). ``effect``: the primitive does something besides
    computing its outputs (``Primitive.effect``).
    """
    assert (ms_fn is None) == (eager is not None), "give ms_fn, or eager and lower"
    assert ms_fn is not None or lower is not None, "give ms_fn, or eager and lower"
    prim = Primitive(name, multiple_results, show, effect)
    # the declaring module: the caller's (named in the errors of a missing rule)
    register_primitive(prim, family, sys._getframe(1).f_globals.get("__name__"))
    if ms_fn is not None:
        _KERNEL_PRIMITIVES.add(name)
    if multiple_results:
        abstract_eval.set(prim, lambda *a, **p: list(type_rule(*a, **p)))
    else:
        abstract_eval.set(prim, lambda *a, **p: [type_rule(*a, **p)])
    if eager is not None:
        impl.set(prim, eager)
    elif multiple_results:
        impl.set(prim, lambda *xs, **p: list(_run_eager(ms_fn, xs, p)))
    else:
        impl.set(prim, lambda *xs, **p: [_run_eager(ms_fn, xs, p)])
    lowering.set(prim, lower or (lambda ctx, *xs, **p: ctx.call(ms_fn, *xs, **p)))
    return prim


#: The primitives declared with one MindSpore function (``ms_fn``): what they compute
#: depends on their operands and parameters alone. The others (a collective, a sharded
#: or pipelined call) also depend on where they run.
_KERNEL_PRIMITIVES: set = set()


def is_kernel(prim: Primitive) -> bool:
    """Whether ``prim`` was declared with one MindSpore function (``def_primitive``'s
    ``ms_fn``): its value depends on its operands and parameters alone."""
    return prim.name in _KERNEL_PRIMITIVES


def _run_eager(ms_fn: Callable, xs, params):
    """``ms_fn`` on ``xs`` as Tensors. PyNative ops run asynchronously, so a kernel that
    refuses the operands' dtype fails at some later read; on CPU that is most kernels on
    bfloat16, so bfloat16 operands wait for their op: the refusal (an
    UnsupportedDtypeError naming the op) is raised by the op that caused it."""
    ts = [as_tensor(x) for x in xs]
    out = ms_fn(*ts, **params)
    if any(t.dtype == dtypes.bfloat16 for t in ts):
        backend.sync_pynative()
    return out


class Zero:
    """A symbolic zero tangent or cotangent of type ``aval`` (never materialised
    unless needed)."""

    __slots__ = ("aval",)

    def __init__(self, aval: ArrayType):
        self.aval = aval

    def __repr__(self) -> str:
        return f"Zero({self.aval})"


def defjvp(prim: Primitive, *rules: Callable | None) -> None:
    """Per-operand JVP: ``rule_i(t_i, ans, *primals, **params)`` is operand i's
    contribution to the output tangent; ``None`` marks a non-differentiable operand.
    Zero tangents are skipped, and a sum of contributions is formed (NB: JAX defjvp2)."""
    def rule(primals, tangents, **params):
        ans = prim.bind(*primals, **params)
        out_t = None
        for r, t in zip(rules, tangents):
            if r is None or isinstance(t, Zero):
                continue
            c = r(t, ans, *primals, **params)
            out_t = c if out_t is None else add_tangents(out_t, c)
        if out_t is None:
            out_t = Zero(typeof(ans))
        return [ans], [out_t]

    jvp.set(prim, rule)


def deflinear(prim: Primitive, transpose_rule: Callable) -> None:
    """A primitive linear in all its operands: jvp(x; t) = prim(t), transposed by
    ``transpose_rule(ct, *args, **params) -> cts``."""
    def rule(primals, tangents, **params):
        ans = prim.bind(*primals, **params)
        if all(isinstance(t, Zero) for t in tangents):
            outs = ans if prim.multiple_results else [ans]
            return ([ans] if not prim.multiple_results else ans), [Zero(typeof(o)) for o in outs]
        ts = [instantiate(t) for t in tangents]
        t_out = prim.bind(*ts, **params)
        if prim.multiple_results:
            return ans, t_out
        return [ans], [t_out]

    jvp.set(prim, rule)
    transpose_rules.set(prim, transpose_rule)


def instantiate(t):
    """Materialise a Zero as a zeros array; pass other values through."""
    if isinstance(t, Zero):
        return zeros(t.aval.shape, t.aval.dtype)
    return t


class UndefinedPrimal:
    """Marks the linear operand of a primitive being transposed (NB: JAX's
    ``ad.UndefinedPrimal``). Only its type is known."""

    __slots__ = ("aval",)

    def __init__(self, aval: ArrayType):
        self.aval = aval

    def __repr__(self) -> str:
        return f"UndefinedPrimal({self.aval})"


def is_undefined(x) -> bool:
    return isinstance(x, UndefinedPrimal)


# ---------------------------------------------------------------------------
# Batching helpers (NB: JAX batching.py's defvectorized / defbroadcasting). A batch
# dim ``d`` is an int axis or ``None`` (operand not batched).
# ---------------------------------------------------------------------------


def move_axis(x, src: int, dst: int):
    """Move axis ``src`` of ``x`` to position ``dst`` (a transpose, or nothing)."""

    nd = typeof(x).ndim
    src, dst = src % nd, dst % nd
    if src == dst:
        return x
    perm = [i for i in range(nd) if i != src]
    perm.insert(dst, src)
    return transpose(x, tuple(perm))


def batch_to_front(x, d, size: int):
    """``x`` with its batch dim at axis 0, broadcasting an unbatched ``x`` to ``size``."""

    if d is None:
        shape = typeof(x).shape
        return broadcast_to(x, (size,) + tuple(shape))
    return move_axis(x, d, 0)


def batch_size(args, dims) -> int:
    """The size of the batch axis: a batched operand's, else the axis being batched
    (an equation whose body uses that axis, e.g. a loop with collectives inside, is
    batched although none of its operands is)."""
    for x, d in zip(args, dims):
        if d is not None:
            return typeof(x).shape[d]
    return current_axis().size


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


# ---------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------


def _norm_axis(axis: int, ndim: int, what: str = "axis") -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise ArgumentError(f"{what} must be an int, got {type(axis).__name__} {axis!r}.")
    if not -ndim <= axis < max(ndim, 1):
        raise ArgumentError(
            f"{what}={axis} is out of range for an array of rank {ndim} "
            f"(valid: {-ndim}..{ndim - 1}).")
    return int(axis) % max(ndim, 1)


def _static_shape(shape, what="shape") -> tuple:
    """A shape argument as a tuple of ints (or Symbols), checked: MindSpore must never
    see a string, a float or a negative size (-1 is ``reshape``'s, checked there)."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    # a concrete integer Tensor (MindSpore's ops.reshape takes one) is its values
    if backend.is_tensor(shape) and dtypes.is_int(shape.dtype) and len(shape.shape) <= 1:
        shape = tuple(int(d) for d in shape.asnumpy().reshape(-1))
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise ArgumentError(f"{what} must be a tuple of ints, got {shape!r}.")
    out = []
    for d in shape:
        if backend.is_tensor(d) and dtypes.is_int(d.dtype) and d.shape == ():
            d = int(d.asnumpy())
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer, Symbol, DimExpr)):
            raise ArgumentError(
                f"{what} must be a tuple of ints, got {shape!r} (the entry {d!r} is a "
                f"{type(d).__name__}).\nFix: pass the sizes as Python ints; a shape must "
                "be known when the function is traced (x.shape gives the static sizes).")
        out.append(int(d) if isinstance(d, (int, np.integer)) else d)
    return tuple(out)


def _shape_str(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _nonnegative(shape, what) -> tuple:
    if any(isinstance(d, int) and d < 0 for d in shape):
        raise ShapeError(f"{what} must not have negative sizes, got {shape}.")
    return shape


def broadcast_shapes(*shapes) -> tuple:
    """NumPy broadcasting of static shapes; raises ShapeError naming both shapes."""
    nd = max(len(s) for s in shapes)
    out = []
    for i in range(nd):
        dim = 1
        for s in shapes:
            k = i - (nd - len(s))
            if k < 0:
                continue
            d = s[k]
            if dims_equal(d, dim) or (isinstance(d, int) and d == 1):
                continue
            if isinstance(dim, int) and dim == 1:
                dim = d
            elif is_symbolic(d) or is_symbolic(dim):
                raise ShapeError(
                    f"shapes {' and '.join(_shape_str(s) for s in shapes)} cannot be "
                    f"broadcast together: dimension {i} from the right-aligned end is {dim} "
                    f"in one and {d} in the other, and fshard cannot prove them equal.\n"
                    f"Fix: it would have to hold that {dim} == {d}: declare both with the "
                    "same fs.Symbol object (or make one of them 1).")
            else:
                raise ShapeError(
                    f"shapes {' and '.join(str(tuple(s)) for s in shapes)} cannot be "
                    f"broadcast together (dimension {i} from the right-aligned end: "
                    f"{dim} vs {d}).\nFix: reshape or expand_dims one operand so "
                    "each dimension is equal or 1.")
        out.append(dim)
    return tuple(out)



# ---------------------------------------------------------------------------
# broadcast_to: NumPy right-aligned broadcasting
# ---------------------------------------------------------------------------


def _ms_broadcast_to(x, shape):
    return ops.broadcast_to(x, shape)


def _broadcast_to_type(x, *, shape):
    if len(shape) < x.ndim or broadcast_shapes(tuple(x.shape), shape) != tuple(shape):
        raise ShapeError(f"cannot broadcast {x} to shape {shape}")
    return ArrayType(tuple(shape), x.dtype)


broadcast_to_p = def_primitive("broadcast_to", "structural", _broadcast_to_type, _ms_broadcast_to)


def _broadcast_to_batching(args, dims, *, shape):
    (x,), (d,) = args, dims
    xs = typeof(x).shape
    size = xs[d]
    x = move_axis(x, d, 0)
    rest = xs[:d] + xs[d + 1:]
    # Right-align the unbatched dims under `shape`, keeping the batch dim in front.
    x = reshape(x, (size,) + (1,) * (len(shape) - len(rest)) + tuple(rest))
    return [broadcast_to(x, (size,) + tuple(shape))], [0]


batching.set(broadcast_to_p, _broadcast_to_batching)


def _shape_param(params, local_in, local_out):
    return {**params, "shape": tuple(local_out[0].shape)}


def _broadcast_to_sharding(x, *, shape):
    """Output dims are factors; an input dim shares its factor unless it is a broadcast 1."""
    lead = len(shape) - x.ndim
    out = tuple(f"d{i}" for i in range(len(shape)))
    inp = tuple(out[lead + i] if x.shape[i] == shape[lead + i] else None
                for i in range(x.ndim))
    return FactorSpec([inp], [out], {lab: shape[i] for i, lab in enumerate(out)},
                      flops_per_point=0.0, local_params=_shape_param)


sharding.set(broadcast_to_p, _broadcast_to_sharding)


def _broadcast_to_transpose(ct, x, *, shape):
    xs = x.aval.shape
    lead = len(shape) - len(xs)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(xs) if d == 1 and shape[lead + i] != 1)
    out = reduce_sum_p.bind(ct, axes=axes) if axes else ct
    return [reshape(out, xs)]


deflinear(broadcast_to_p, _broadcast_to_transpose)


def broadcast_to(x: ArrayLike, shape) -> Shaped[Array, "..."]:
    """Broadcast ``x`` to ``shape`` with NumPy's rules."""
    shape = _static_shape(shape)
    if tuple(typeof(x).shape) == shape:
        return x
    if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
        # a Python scalar: MindSpore's weak typing (bool, int64 or float32), as promote
        dt = dtypes.bool_ if isinstance(x, bool) else (
            dtypes.int64 if isinstance(x, int) else dtypes.float32)
        x = dtypes.to_numpy(dt).type(x)
    return broadcast_to_p.bind(x, shape=shape)


# ---------------------------------------------------------------------------
# reshape
# ---------------------------------------------------------------------------


def _ms_reshape(x, shape):
    return ops.reshape(x, shape)


def _reshape_type(x, *, shape):
    if x.is_static and all(isinstance(d, int) for d in shape):
        if int(np.prod(shape, dtype=np.int64)) != x.size:
            raise ShapeError(f"cannot reshape {x} to {shape}: sizes differ")
    elif not dims_equal(dim_prod(shape), dim_prod(x.shape)):
        raise ShapeError(
            f"cannot reshape {x} to {_shape_str(shape)}: the sizes {dim_prod(x.shape)} and "
            f"{dim_prod(shape)} are not equal for every size the Symbols accept.")
    return ArrayType(tuple(shape), x.dtype)


reshape_p = def_primitive("reshape", "structural", _reshape_type, _ms_reshape)


def _reshape_batching(args, dims, *, shape):
    (x,), (d,) = args, dims
    x = move_axis(x, d, 0)
    return [reshape_p.bind(x, shape=(typeof(x).shape[0],) + tuple(shape))], [0]


batching.set(reshape_p, _reshape_batching)


def _reshape_groups(a: tuple, b: tuple):
    """Pair up runs of dims of ``a`` and ``b`` with equal products."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj = [i] if i < len(a) else [], [j] if j < len(b) else []
        pa = a[i] if i < len(a) else 1
        pb = b[j] if j < len(b) else 1
        i, j = i + bool(gi), j + bool(gj)
        while pa != pb:
            if pa < pb:
                gi.append(i)
                pa *= a[i]
                i += 1
            else:
                gj.append(j)
                pb *= b[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _reshape_sharding(x, *, shape):
    """Within each group of merged/split dims only the major dim can be split, and
    only by a divisor of both major dims (the split then keeps whole rows)."""
    ins, outs, sizes = [None] * x.ndim, [None] * len(shape), {}
    if x.is_static:
        for g, (gi, gj) in enumerate(_reshape_groups(tuple(x.shape), tuple(shape))):
            gi = [i for i in gi if x.shape[i] != 1]
            gj = [j for j in gj if shape[j] != 1]
            if gi and gj:
                lab = f"g{g}"
                ins[gi[0]], outs[gj[0]] = lab, lab
                sizes[lab] = math.gcd(x.shape[gi[0]], shape[gj[0]])
    return FactorSpec([tuple(ins)], [tuple(outs)], sizes, flops_per_point=0.0,
                      local_params=_shape_param)


sharding.set(reshape_p, _reshape_sharding)
deflinear(reshape_p, lambda ct, x, *, shape: [reshape(ct, x.aval.shape)])


def reshape(x: ArrayLike, shape) -> Shaped[Array, "..."]:
    """Reshape ``x``; one dimension may be -1."""
    shape = _static_shape(shape)
    a = typeof(x)
    if shape.count(-1) > 1:
        raise ArgumentError(f"reshape: at most one -1 in shape, got {shape}.")
    if -1 in shape:
        known = dim_prod([d for d in shape if not isinstance(d, int) or d != -1])
        if a.is_static and isinstance(known, int):
            if known == 0 or a.size % known:
                raise ShapeError(f"cannot reshape {a} to {shape}")
            rest = a.size // known
        else:
            try:
                rest = dim_div(dim_prod(a.shape), known)
            except ArgumentError as e:
                raise ShapeError(f"cannot reshape {a} to {_shape_str(shape)}: "
                                 f"{e.args[0].splitlines()[0]}.") from None
        shape = tuple(rest if isinstance(d, int) and d == -1 else d for d in shape)
    if len(shape) == a.ndim and all(dims_equal(p, q) for p, q in zip(shape, a.shape)):
        return x
    return reshape_p.bind(x, shape=shape)


# transpose
# ---------------------------------------------------------------------------


def _ms_transpose(x, perm):
    return ops.transpose(x, perm)


def _transpose_type(x, *, perm):
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeError(f"transpose: perm {perm} is not a permutation of range({x.ndim})")
    return ArrayType(tuple(x.shape[p] for p in perm), x.dtype)


transpose_p = def_primitive("transpose", "structural", _transpose_type, _ms_transpose)


def _transpose_batching(args, dims, *, perm):
    (x,), (d,) = args, dims
    x = move_axis(x, d, 0)
    return [transpose_p.bind(x, perm=(0,) + tuple(p + 1 for p in perm))], [0]


batching.set(transpose_p, _transpose_batching)
sharding.set(transpose_p, lambda x, *, perm: FactorSpec(
    [tuple(f"d{i}" for i in range(x.ndim))], [tuple(f"d{p}" for p in perm)],
    {f"d{i}": x.shape[i] for i in range(x.ndim)}, flops_per_point=0.0))
deflinear(transpose_p,
          lambda ct, x, *, perm: [transpose_p.bind(ct, perm=tuple(np.argsort(perm).tolist()))])


def transpose(x: Shaped[Array, "..."], perm=None) -> Shaped[Array, "..."]:
    a = typeof(x)
    perm = tuple(reversed(range(a.ndim))) if perm is None else tuple(
        _norm_axis(p, a.ndim, "perm entry") for p in perm)
    if perm == tuple(range(a.ndim)):
        return x
    return transpose_p.bind(x, perm=perm)


# full (zeros, ones): a constant array; no operands
# ---------------------------------------------------------------------------


def _ms_full(shape, value, dtype):
    return ops.fill(dtype, shape, value)


def _full_type(*, shape, value, dtype):
    return ArrayType(tuple(shape), dtype)


def _ms_broadcast_scalar(t, shape):
    return ops.broadcast_to(t, shape)


def _lower_full(ctx, *, shape, value, dtype):
    if isinstance(value, float) and (math.isnan(value) or dtype == dtypes.float64
                                     and float(np.float32(value)) != value) \
            or isinstance(value, int) and not -2**31 <= value < 2**31:
        # A NaN fill value is folded away by MindSpore's graph compiler, and a Python
        # scalar in a graph is a float32 or int32 one (a float64 fill would be rounded
        # to float32, an int64 one beyond int32 wrapped): a constant Tensor of the dtype
        # keeps the value exactly (through the backend's NaN-safe constants).
        from mindspore import Tensor

        return ctx.call(_ms_broadcast_scalar, ctx.ref(Tensor(value, dtype), "fill"),
                        ctx.param(tuple(shape)))
    return ctx.call(_ms_full, ctx.param(shape), ctx.param(value), ctx.param(dtype))


full_p = def_primitive("full", "structural", _full_type, lambda *, shape, value, dtype:
                       _ms_full(shape, value, dtype), lower=_lower_full)
batching.set(full_p, lambda args, dims, **p: ([full_p.bind(**p)], [None]))
sharding.set(full_p, lambda *, shape, value, dtype: FactorSpec(
    [], [tuple(f"d{i}" for i in range(len(shape)))], {f"d{i}": d for i, d in enumerate(shape)},
    flops_per_point=0.0, local_params=_shape_param))
jvp.set(full_p, lambda primals, tangents, **p: (
    [full_p.bind(**p)], [Zero(ArrayType(tuple(p["shape"]), p["dtype"]))]))
unsupported(full_p, "transpose", "has no operands")


def full(shape, value, dtype=dtypes.float32) -> Shaped[Array, "..."]:
    dtype = dtypes.canonical(dtype)
    value = bool(value) if dtype == dtypes.bool_ else (
        float(value) if dtypes.is_float(dtype) else int(value))
    return full_p.bind(shape=_nonnegative(_static_shape(shape), "full(shape=...)"),
                       value=value, dtype=dtype)


def zeros(shape, dtype=dtypes.float32) -> Shaped[Array, "..."]:
    return full(shape, 0, dtype)


def ones(shape, dtype=dtypes.float32) -> Shaped[Array, "..."]:
    return full(shape, 1, dtype)


# ---------------------------------------------------------------------------
# add: the sum of two tangents (and cotangents)
# ---------------------------------------------------------------------------


def _same_types(name, *avals):
    first = avals[0]
    for a in avals[1:]:
        if a != first:
            raise ProgramTypeError(
                f"{name} needs operands of one shape and dtype, got "
                f"{', '.join(str(v) for v in avals)} (the op functions in fshard.ops "
                "promote and broadcast; primitives do not)")
    return first


def _binary_type(name):
    return lambda x, y, **_: _same_types(name, x, y)


def _numeric_binary_type(name):
    """add, sub and the others MindSpore has no bool kernel for (it raises from C++).
    Tensor's ``+`` and ``-`` between bools are a logical or and xor."""
    operator = {"add": ("+", "or"), "sub": ("-", "xor")}.get(name)

    def rule(x, y, **_):
        out = _same_types(name, x, y)
        if out.dtype == dtypes.bool_:
            if operator is None:
                why, fix = f"MindSpore has no bool {name}", ""
            else:
                why = (f"MindSpore's {name} kernel has no bool version (ops.{name} refuses "
                       f"them; the Tensor operator {operator[0]} between two bool Tensors "
                       f"is a logical {operator[1]})")
                fix = f"use ops.logical_{operator[1]}(x, y), or "
            raise ProgramTypeError(
                f"{name} of bool operands ({x}, {y}) is not supported: {why}.\nFix: "
                f"{fix}cast the operands to an integer dtype first "
                "(x.astype(mindspore.int32)).")
        return out

    return rule


def _ms_add(x, y):
    return ops.add(x, y)


add_p = def_primitive("add", "elementwise", _numeric_binary_type("add"), _ms_add)
batching.set(add_p, broadcasting(add_p))
sharding.set(add_p, lambda *avals, **_: elementwise_spec(*avals))
deflinear(add_p, lambda ct, x, y: [ct, ct])


def add_tangents(a, b):
    """Sum of two tangents, either of which may be a symbolic Zero."""
    if isinstance(a, Zero):
        return b
    if isinstance(b, Zero):
        return a
    return add_p.bind(a, b)



# ---------------------------------------------------------------------------
# reduce_sum: the transpose of a broadcast
# ---------------------------------------------------------------------------


def _reduce_type(x, *, axes):
    for a in axes:
        assert 0 <= a < x.ndim, f"axis {a} out of range for {x}"
    return ArrayType(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)


def _reducer_batching(prim):
    """Shift reduced axes past the batch dim (NB: JAX defreducer)."""

    def rule(args, dims, *, axes):
        (x,), (d,) = args, dims
        new_axes = tuple(a + (a >= d) for a in axes)
        out_d = d - sum(a < d for a in axes)
        return [prim.bind(x, axes=new_axes)], [out_d]

    return rule


def _reduce_sharding(kind):
    """Reduced dims are a sum factor (split -> partial output) or, for max/min, never
    split; kept dims are parallel."""

    def rule(x, *, axes):
        labels = tuple(f"d{i}" for i in range(x.ndim))
        out = tuple(lab for i, lab in enumerate(labels) if i not in axes)
        red = frozenset(labels[a] for a in axes)
        return FactorSpec([labels], [out], {lab: x.shape[i] for i, lab in enumerate(labels)},
                          reduce=red if kind == "sum" else frozenset(),
                          nosplit=frozenset() if kind == "sum" else red)

    return rule


def _kept_shape(shape, axes):
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


# MindSpore reduces every axis when given none, so axes=() (a rank-0 operand, or a
# batched one) returns x itself.


def _ms_reduce_sum(x, axes):
    if len(axes) == 0:
        return x
    if len(axes) == 1 and 0 < axes[0] < len(x.shape) - 1:
        # A middle axis (a virtual mesh's psum sums each mesh axis's lanes in turn):
        # MindSpore's CPU kernel is slow there and fast over axis 0, so the axis moves
        # to the front first. Summing (2, 2, 2, 512, 512) over axis 2 took 10.6 ms
        # directly and 1.3 ms so; no shape measured was slower so.
        return _REDUCE_SUM(ops.transpose(x, _front(axes[0], len(x.shape))), 0)
    return _REDUCE_SUM(x, axes)  # keeps the dtype (ops.sum widens int32)


def _front(k: int, ndim: int) -> tuple:
    return (k,) + tuple(range(k)) + tuple(range(k + 1, ndim))


# made once: a Primitive built inside generated code is built again by MindSpore's
# compiler at each call site (see LoweringContext.kernel)
_REDUCE_SUM = ops.ReduceSum(False)


def _lower_reduce_sum(ctx, x, *, axes):
    # _ms_reduce_sum's choice made here: its branches would be parsed at each call site
    nd = len(ctx.in_avals[0].shape)
    if len(axes) == 0:
        return x
    if len(axes) == 1 and 0 < axes[0] < nd - 1:
        moved = f"{ctx.ref(ops.transpose)}({x}, {ctx.param(_front(axes[0], nd))})"
        return f"{ctx.ref(_REDUCE_SUM)}({moved}, 0)"
    return f"{ctx.ref(_REDUCE_SUM)}({x}, {ctx.param(tuple(axes))})"


reduce_sum_p = def_primitive("reduce_sum", "reductions", _reduce_type, _ms_reduce_sum,
                             lower=_lower_reduce_sum)
batching.set(reduce_sum_p, _reducer_batching(reduce_sum_p))
sharding.set(reduce_sum_p, _reduce_sharding("sum"))
deflinear(reduce_sum_p, lambda ct, x, *, axes: [
    broadcast_to(reshape(ct, _kept_shape(x.aval.shape, axes)), x.aval.shape)])


# lane_sum: the sum of a virtual mesh's lanes (the AllReduce of devices emulated in one
# process, ``psum``'s batching rule). The same value as ``reduce_sum``, but its own
# primitive, so the lane sums of one psum over several mesh axes (one per axis, as the
# batching interpreters meet them) merge into one reduction without ever merging with a
# device's own sums in the program (``passes.merge_lane_sums``), whose rounding must
# not depend on how the gradients are bucketed for the AllReduce.


def _ms_lane_sum(x, axes):
    if len(axes) == 0:
        return x
    shape = tuple(x.shape)
    lead = tuple(sorted(axes))
    if lead != tuple(range(len(lead))):
        # The lanes to the front (a sum over middle axes is slow on MindSpore's CPU
        # kernel, see _ms_reduce_sum).
        rest = tuple(i for i in range(len(shape)) if i not in axes)
        x = ops.transpose(x, lead + rest)
        shape = tuple(shape[i] for i in lead + rest)
    k = len(lead)
    # One axis of all the lanes: MindSpore's CPU ReduceSum over the leading axes
    # (2, 2, 2) of a (2, 2, 2, 512, 512) value took 8.5 ms, over the merged axis 1.0 ms
    # (one axis at a time: 7.7 ms). Over the leading axis of a value of 2 or more
    # dimensions the kernel adds the lanes in order, one after another, for every
    # element count; a whole 1-D value it sums in another order. So a scalar per lane
    # is summed as (lanes, 1): every lane sum adds in device order, and a value is
    # summed alike alone or in a fused bucket of gradients.
    x = ops.reshape(x, (math.prod(shape[:k]),) + (shape[k:] or (1,)))
    y = _REDUCE_SUM(x, 0)
    return y if shape[k:] else ops.reshape(y, ())


lane_sum_p = def_primitive("lane_sum", "collectives", _reduce_type, _ms_lane_sum)
batching.set(lane_sum_p, _reducer_batching(lane_sum_p))
sharding.set(lane_sum_p, _reduce_sharding("sum"))
deflinear(lane_sum_p, lambda ct, x, *, axes: [
    broadcast_to(reshape(ct, _kept_shape(x.aval.shape, axes)), x.aval.shape)])


def lane_sum(x, axes: tuple):
    """The sum of ``x`` over ``axes``, the lanes of a virtual mesh's devices."""
    return lane_sum_p.bind(x, axes=tuple(sorted(axes)))
