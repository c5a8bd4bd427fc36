"""Optimizer primitives: ``adam_update``, the moments and the direction of an Adam step
on MindSpore's fused CPU kernel.

``fs.optim.adam`` written with elementwise primitives is 11 kernels over every element
(each a pass over memory plus MindSpore's per-kernel cost); ``nn.Adam`` runs one. The
fused kernels of MindSpore's CPU backend write their operands in place, which no
functional program may do to its inputs, so ``adam_update`` gives the kernel buffers of
its own: compiled, two Parameters of the generated module per leaf, which the moments
are assigned into and copied out of after ``AdamNoUpdateParam`` ran; eagerly, the
concatenation of the leaves. The caller's arrays are never written
(tests/test_adam_kernel.py checks it).

For ``n`` leaves the operands are ``m_1..m_n, v_1..v_n, g_1..g_n, lr`` (one float dtype;
``lr`` a scalar) and the outputs ``m'_1..m'_n, v'_1..v'_n, u_1..u_n``:

    m' = b1 m + (1 - b1) g,  v' = b2 v + (1 - b2) g^2,  u = -lr m' / (sqrt(v') + eps)

float32 runs MindSpore's kernel (which rounds ``b1 m + (1 - b1) g`` as one fused
multiply-add, ``1 - b1`` taken in float32); other dtypes, and a learning rate that
differs per example under ``fs.vmap``, the same formulas elementwise (within an ulp of
the kernel's rounding).
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import mindspore as ms
import numpy as np
from mindspore import ops

from fshard.backend.mindspore import as_tensor
from fshard.core import dtypes
from fshard.core.factors import FactorSpec
from fshard.core.rules import batching, jvp, sharding, unsupported
from fshard.core.tracing import ArrayType, is_symbolic, typeof
from fshard.errors import ProgramTypeError
from fshard.primitives.base import (Zero, batch_size, batch_to_front, def_primitive,
                                    instantiate)
from fshard.primitives.elementwise import add, div, mul, neg, sqrt
from fshard.primitives.structural import reshape

FAMILY = "optimizers"

# Built once (a Primitive built in generated code is built again at each call site).
_ADAM = ops.AdamNoUpdateParam()
_CONCAT = ops.Concat(0)
_RESHAPE = ops.Reshape()
_ASSIGN = ops.Assign()
_SLICE = ops.Slice()
_COPY = ops.Identity()


def _check(avals):
    if len(avals) % 3 != 1 or len(avals) < 4:
        raise ProgramTypeError(
            f"adam_update takes 3n + 1 operands (moments, second moments, gradients, "
            f"learning rate), got {len(avals)}")
    n = len(avals) // 3
    lr = avals[-1]
    dt = lr.dtype
    if lr.ndim != 0 or not dtypes.is_float(dt):
        raise ProgramTypeError(f"adam_update needs a float scalar learning rate, got {lr}")
    for i in range(n):
        m, v, g = avals[i], avals[n + i], avals[2 * n + i]
        if not (tuple(m.shape) == tuple(v.shape) == tuple(g.shape)) or not (
                m.dtype == v.dtype == g.dtype == dt):
            raise ProgramTypeError(
                f"adam_update needs each leaf's moment, second moment and gradient of one "
                f"shape, in the learning rate's dtype {dt}; leaf {i}: {m}, {v}, {g}")
    return n


def _type(*avals, b1, b2, eps):
    n = _check(avals)
    return [ArrayType(tuple(a.shape), a.dtype) for a in avals[:3 * n]]


def _formulas(n, xs, b1, b2, eps, lr, o):
    """The update elementwise with the ops of ``o`` (fshard's or MindSpore's; ``lr``
    broadcasts)."""
    outs_m, outs_v, outs_u = [], [], []
    for i in range(n):
        m, v, g = xs[i], xs[n + i], xs[2 * n + i]
        m2 = o.add(o.mul(m, b1), o.mul(g, 1.0 - b1))
        v2 = o.add(o.mul(v, b2), o.mul(o.mul(g, g), 1.0 - b2))
        u = o.div(o.mul(o.neg(lr), m2), o.add(o.sqrt(v2), eps))
        outs_m.append(m2)
        outs_v.append(v2)
        outs_u.append(u)
    return outs_m + outs_v + outs_u


def _f32(x):
    return ms.Tensor(np.float32(x))


def _kernel_args(mc, vc, gc, lr, b1, b2, eps, const):
    # beta powers 0: the kernel's bias correction sqrt(1 - 0) / (1 - 0) is exactly 1
    return (mc, vc, const(0.0), const(0.0), lr, const(b1), const(b2), const(eps), gc)


def _on_kernel(avals) -> bool:
    """Whether the fused kernel runs: float32, its only dtype."""
    return avals[-1].dtype == dtypes.float32


def _eager(*xs, b1, b2, eps):
    ts = [as_tensor(x) for x in xs]
    n = (len(ts) - 1) // 3
    if not _on_kernel([typeof(t) for t in ts]):
        return _formulas(n, ts, b1, b2, eps, ts[-1], _MS_OPS)
    shapes = [tuple(t.shape) for t in ts[:n]]
    sizes = [math.prod(s) for s in shapes]
    pad = _padding(sizes)
    flat = [[ops.reshape(t, (-1,)) for t in ts[k * n:(k + 1) * n]] + pad for k in range(3)]
    # eagerly, a concatenation is a new Tensor: the buffer the kernel overwrites (one
    # piece is copied: a concatenation of one Tensor may be that Tensor)
    mc, vc, gc = (ops.concat(f, 0) if len(f) > 1 else f[0].copy() for f in flat)
    u = _ADAM(*_kernel_args(mc, vc, gc, ts[-1], b1, b2, eps, _f32))
    return [ops.reshape(p, s) for whole in (mc, vc, u)
            for p, s in zip(ops.split(whole, sizes + [t.shape[0] for t in pad]), shapes)]


# MindSpore's CPU kernel runs blocks of 16 floats with a fused multiply-add and any rest
# one by one without; its threads' share of the buffer is tuned over the first calls,
# so an element near a share's end was rounded one way or the other from call to call
# (measured: 4 of 36 elements changed between calls 4 and 14; every length that is a
# multiple of 16 gave the same bits at every call). The buffers are padded to one.
_LANES = 16


def _padding(sizes) -> list:
    """A zeros Tensor padding ``sum(sizes)`` to a multiple of ``_LANES`` (or none)."""
    pad = -sum(sizes) % _LANES
    return [ms.Tensor(np.zeros(pad, np.float32))] if pad else []


_scratch_ids = itertools.count()


def _scratch(shape):
    """A float32 Parameter of the generated module: a buffer only the kernel writes."""
    return ms.Parameter(ms.Tensor(np.zeros(shape, np.float32)),
                        name=f"fshard_adam_scratch_{next(_scratch_ids)}", requires_grad=False)


def _lower(ctx, *xs, b1, b2, eps):
    if not _on_kernel(ctx.in_avals):
        return _lower_formulas(ctx, xs, b1, b2, eps)
    n = (len(xs) - 1) // 3
    r = ctx.ref
    args = [f"x{i}" for i in range(len(xs))]
    assign, copy = r(_ASSIGN, "Assign"), r(_COPY, "Identity")
    kernel = r(_ADAM, "AdamNoUpdateParam")

    def const(c):
        return r(_f32(c), "adam_const")

    # One kernel per leaf, on two Parameters of the module per leaf: the kernel writes
    # its moments in place, and in a compiled graph only a Parameter is a buffer of its
    # own (MindSpore folds a computed operand made of constants, and merges equal ones:
    # m and v both zeros). MindSpore orders the Parameters' side effects: the moments
    # are assigned in, updated, and copied out (``Identity``: an output is never a
    # Parameter that the next call overwrites, whatever MindSpore's executor does with
    # a Parameter returned; the copy cost nothing measurable). Per leaf rather than on one
    # concatenation of all leaves: the concatenation's reshapes, split and slices cost
    # MindSpore's compiler 2-5 ms each (measured: the Llama block's update compiled in
    # 0.31-0.43 s so and in 0.07-0.10 s per leaf, and ran in 3.4-12 against 1.7-2.2 ms).
    name = f"fshard_adam_update_{len(ctx.helpers)}"
    lines = [f"def {name}({', '.join(args)}):"]
    outs: list = [[], [], []]
    for i, a in enumerate(ctx.in_avals[:n]):
        shape, size = tuple(a.shape), math.prod(a.shape)
        pad = [r(t, "adam_pad") for t in _padding([size])]
        m, v, g = args[i], args[n + i], args[2 * n + i]
        if pad:  # flattened and padded to whole blocks of the kernel, and cut back after
            flat, cat = r(_RESHAPE, "Reshape"), r(_CONCAT, "Concat")
            m, v, g = (f"{cat}(({flat}({x}, (-1,)), {pad[0]}))" for x in (m, v, g))
        buffer = (size + (-size % _LANES),) if pad else shape
        sm, sv = (r(_scratch(buffer), "adam_scratch") for _ in range(2))
        operands = ", ".join(_kernel_args(sm, sv, g, args[-1], b1, b2, eps, const))
        lines += [f"    {assign}({sm}, {m})", f"    {assign}({sv}, {v})",
                  f"    u{i} = {kernel}({operands})"]
        for k, whole in enumerate((sm, sv, f"u{i}")):
            if pad:
                cut = f"{r(_SLICE, 'Slice')}({whole}, (0,), ({size},))"
                outs[k].append(cut if len(shape) == 1 else
                               f"{r(_RESHAPE, 'Reshape')}({cut}, {ctx.param(shape)})")
            else:
                outs[k].append(f"u{i}" if k == 2 else f"{copy}({whole})")
    lines.append(f"    return ({', '.join(outs[0] + outs[1] + outs[2])},)")
    ctx.helpers.append("\n".join(lines) + "\n")
    return f"{name}({', '.join(xs)})"


# the ops ``_formulas`` uses: MindSpore's (eager) and fshard's (batching, JVP)
_MS_OPS = SimpleNamespace(add=ops.add, mul=ops.mul, div=ops.div, sqrt=ops.sqrt, neg=ops.neg)
_FS_OPS = SimpleNamespace(add=add, mul=mul, div=div, sqrt=sqrt, neg=neg)


def _lower_formulas(ctx, xs, b1, b2, eps):
    """``_formulas`` as generated source (dtypes the fused kernel does not take)."""
    n = (len(xs) - 1) // 3
    r = ctx.ref
    add_, mul_, div_, sqrt_, neg_ = (r(f) for f in (ops.add, ops.mul, ops.div, ops.sqrt,
                                                    ops.neg))
    args = [f"x{i}" for i in range(len(xs))]
    name = f"fshard_adam_update_{len(ctx.helpers)}"
    lines = [f"def {name}({', '.join(args)}):", f"    nlr = {neg_}({args[-1]})"]
    for i in range(n):
        m, v, g = args[i], args[n + i], args[2 * n + i]
        lines += [f"    m{i} = {add_}({mul_}({m}, {b1!r}), {mul_}({g}, {1.0 - b1!r}))",
                  (f"    v{i} = {add_}({mul_}({v}, {b2!r}), {mul_}({mul_}({g}, {g}), "
                   f"{1.0 - b2!r}))"),
                  f"    u{i} = {div_}({mul_}(nlr, m{i}), {add_}({sqrt_}(v{i}), {eps!r}))"]
    outs = [f"{k}{i}" for k in "mvu" for i in range(n)]
    lines.append(f"    return ({', '.join(outs)},)")
    ctx.helpers.append("\n".join(lines) + "\n")
    return f"{name}({', '.join(xs)})"


adam_update_p = def_primitive("adam_update", FAMILY, _type, eager=_eager, lower=_lower,
                              multiple_results=True)


def _batching(args, dims, *, b1, b2, eps):
    size = batch_size(args, dims)
    n = (len(args) - 1) // 3
    xs = [batch_to_front(x, d, size) for x, d in zip(args[:-1], dims[:-1])]
    if dims[-1] is None:  # one learning rate for every example: the fused kernel
        outs = adam_update_p.bind(*xs, args[-1], b1=b1, b2=b2, eps=eps)
        return outs, [0] * len(outs)
    # a learning rate per example (a schedule of a batched step count): the formulas,
    # the rate shaped to broadcast against each leaf
    lr = batch_to_front(args[-1], dims[-1], size)
    per_leaf = [_formulas(1, xs[i::n], b1, b2, eps,
                          reshape(lr, (size,) + (1,) * (typeof(xs[i]).ndim - 1)), _FS_OPS)
                for i in range(n)]
    outs = [leaf[k] for k in range(3) for leaf in per_leaf]
    return outs, [0] * len(outs)


def _jvp(primals, tangents, *, b1, b2, eps):
    outs = adam_update_p.bind(*primals, b1=b1, b2=b2, eps=eps)
    if all(isinstance(t, Zero) for t in tangents):
        return outs, [Zero(typeof(o)) for o in outs]
    n = (len(primals) - 1) // 3
    lr, tlr = primals[-1], tangents[-1]
    tms, tvs, tus = [], [], []
    for i in range(n):
        m2, v2 = outs[i], outs[n + i]
        g = primals[2 * n + i]
        tm, tv, tg = (tangents[k * n + i] for k in range(3))
        terms_m, terms_v = [], []
        if not isinstance(tm, Zero):
            terms_m.append(mul(tm, b1))
        if not isinstance(tv, Zero):
            terms_v.append(mul(tv, b2))
        if not isinstance(tg, Zero):
            terms_m.append(mul(tg, 1.0 - b1))
            terms_v.append(mul(mul(g, tg), 2.0 * (1.0 - b2)))
        tm2 = _sum(terms_m) if terms_m else Zero(typeof(m2))
        tv2 = _sum(terms_v) if terms_v else Zero(typeof(v2))
        # u = -lr m' / (s + eps), s = sqrt(v'):
        # du = -(dlr m' / den + lr (dm' / den - m' dv' / (2 s den^2)))
        s = sqrt(v2)
        den = add(s, eps)
        terms_u = []
        if not isinstance(tlr, Zero):
            terms_u.append(mul(tlr, div(m2, den)))
        if not isinstance(tm2, Zero):
            terms_u.append(mul(lr, div(tm2, den)))
        if not isinstance(tv2, Zero):
            terms_u.append(neg(mul(lr, div(mul(m2, tv2), mul(mul(s, 2.0), mul(den, den))))))
        tms.append(tm2)
        tvs.append(tv2)
        tus.append(neg(_sum(terms_u)) if terms_u else Zero(typeof(m2)))
    return outs, [instantiate(t) for t in tms + tvs + tus]


def _sum(terms):
    out = terms[0]
    for t in terms[1:]:
        out = add(out, t)
    return out


def _sharding(*avals, b1, b2, eps):
    """Each leaf's moments, gradient and outputs share its factors; leaves are
    independent (the lowering concatenates whatever blocks a device holds)."""
    n = (len(avals) - 1) // 3
    labels = [tuple(f"l{i}d{k}" for k in range(avals[i].ndim)) for i in range(n)]
    sizes = {f"l{i}d{k}": avals[i].shape[k] for i in range(n) for k in range(avals[i].ndim)}
    # the kernels _lower runs per float32 leaf: the two moments assigned in, the Adam
    # kernel, the two copies out; a leaf padded to the kernel's blocks adds its three
    # concatenations and three slices (priced by the whole leaf's size: a block's may
    # differ)
    kernels = sum(5 + 6 * bool(math.prod(a.shape) % _LANES) for a in avals[:n]) \
        if _on_kernel(avals) else 12 * n  # _formulas: twelve elementwise kernels a leaf
    # Per element, the kernel's leaf costs about seven elementwise passes (measured on
    # the MLP 64-512-512-10's leaves, 301K floats: 0.62 ms, against 0.07 ms for one
    # pass at the calibrated rate plus 0.12 ms for its 30 kernels' fixed cost): the two
    # copies in, the kernel's reads and writes of three arrays with a sqrt and a
    # division, the two copies out. The formulas' twelve kernels are one pass each.
    # A calibration table prices the kernel's elements itself ("adam": measured on a
    # leaf in cache and one far larger, 0.9-2.5 and 1.9-2.9 ns per element here: the
    # copies run at the memory's speed). (The cost model counts the points of all factors
    # together: exact for the one leaf of each equation fs.AutoParallel traces, too
    # high for several.)
    return FactorSpec(labels * 3 + [()], labels * 3, sizes, kernels=kernels,
                      passes=7.0 if _on_kernel(avals) else 12.0,
                      priced_as="adam" if _on_kernel(avals) else None)


batching.set(adam_update_p, _batching)
jvp.set(adam_update_p, _jvp)
sharding.set(adam_update_p, _sharding)
unsupported(adam_update_p, "transpose", "not linear in any operand")


def fusable(aval) -> bool:
    """Whether ``adam_update`` takes a leaf of this type (a float of static shape)."""
    return dtypes.is_float(aval.dtype) and not any(is_symbolic(d) for d in aval.shape)


def adam_update(mu: list, nu: list, grads: list, lr, *, b1: float, b2: float,
                eps: float) -> tuple[list, list, list]:
    """One Adam step of the leaves ``mu``, ``nu``, ``grads`` (lists of one float dtype,
    ``lr`` a scalar of it): ``(new mu, new nu, updates)``, ``updates = -lr m' /
    (sqrt(v') + eps)`` (no bias correction: fold it into ``lr``)."""
    n = len(mu)
    outs = adam_update_p.bind(*mu, *nu, *grads, lr, b1=float(b1), b2=float(b2),
                              eps=float(eps))
    return list(outs[:n]), list(outs[n:2 * n]), list(outs[2 * n:])
