"""One ``PrimitiveSpec`` per fshard primitive: the OpInfo-like records that drive
``tests/test_primitive_rules.py`` (NB: JAX's ``op_record``, PyTorch's ``OpInfo``).

A spec says how to make valid operands for its primitive (``samples(rng, dtype)``:
scalars where valid, size-1 dims, a few ranks; binary primitives take operands of
one shape, so there is no broadcasting here), which dtypes to run, which operands
are differentiable, in which operands the primitive is linear (for the transpose
test), and the tolerance of float32 results. The NumPy reference is
``tests/references.py``'s entry for the same name.

Adding a primitive means adding a spec here; a primitive without one fails
``test_every_primitive_has_a_spec``.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest

from fshard import dtypes, rules
from fshard.core.tracing import ArrayType, Primitive, typeof
from fshard.core.ir import Program
import fshard as fs
from fshard.errors import AxisNameError, DifferentiationError
from fshard.debug import debug_callback_p
from fshard.primitives import collectives as K
from fshard.primitives import conv as CV
from fshard.primitives import control as C
from fshard.transforms import control_flow as CF
from fshard.primitives import elementwise as E
from fshard.primitives import generic as G
from fshard.primitives import linalg as L
from fshard.primitives import nn as N
from fshard.primitives import optimizers as OPT
from fshard.primitives import pipeline as PL
from fshard.primitives import remat as RM
from fshard.primitives import reductions as R
from fshard.primitives import scans as SC
from fshard.primitives import spmd as P
from fshard.primitives import structural as S


def quick_first(params: list, per=lambda p: p.values[0]) -> list:
    """``params`` with every case but the first of each group (by ``per``: the
    primitive, by default) marked ``full``: the quick run checks each primitive's rule
    once, the full matrix (``pytest --full``) every sample, dtype and mesh."""
    seen, out = set(), []
    for p in params:
        key = per(p)
        key = getattr(key, "name", key)
        if key in seen:
            p = pytest.param(*p.values, id=p.id, marks=(*p.marks, pytest.mark.full))
        seen.add(key)
        out.append(p)
    return out


if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # tests/ is not a package
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from references import (LANES, REFERENCES, W, block_index, shard_in_block,  # noqa: E402
                        shard_in_transpose, shard_out_global)

F32, F64, I32, I64, BOOL = np.float32, np.float64, np.int32, np.int64, np.bool_

# Every linear operand of the primitive at once (for variadic primitives like concat).
ALL = "all"
# The linear operands depend on the parameters: each Sample gives its linear_groups.
PER_SAMPLE = "per sample"


# ---------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """Operands (NumPy arrays) and parameters for one application of a primitive."""

    args: tuple
    params: dict = field(default_factory=dict)
    # Per-sample overrides of the spec's (operands that are constants are not
    # differentiable; a call primitive's linear operands depend on its parameters).
    diff_argnums: tuple | None = None
    linear_groups: tuple | None = None

    @property
    def id(self) -> str:
        types = ",".join(str(typeof(a)) for a in self.args)
        params = ",".join(f"{k}={_short(v)}" for k, v in self.params.items())
        return f"{types}|{params}" if params else types


def _shard_call_p():
    from fshard.transforms.shard_call import shard_call_p

    return shard_call_p


def _short(v) -> str:
    if isinstance(v, tuple):
        return "(" + ",".join(_short(e) for e in v) + ")"
    if isinstance(v, (int, float, str, bool)) or v is None:
        return str(v)
    if isinstance(v, Program):
        return "{...}"
    if isinstance(v, ArrayType):
        return str(v)
    if hasattr(v, "partitioned"):  # shard_call's plan
        return str(v)
    return dtypes.short_name(v)


@dataclass(frozen=True)
class PrimitiveSpec:
    """Everything the registry-driven tests need to check one primitive.

    Attributes:
        prim: the primitive.
        samples: ``samples(rng, dtype) -> list[Sample]``; ``dtype`` is the dtype of
            the data operands (index operands keep their integer dtypes).
        dtypes: dtypes for the impl / type-rule / jit / batching checks. Derivative
            checks always use float64.
        diff_argnums: operands a tangent may flow through (float data operands).
        linear_groups: groups of operands in which the primitive is linear, the other
            operands held fixed (``(0, 1)`` for add, ``(0,), (1,)`` for mul, ``ALL``
            for every operand); empty if the primitive has no transpose rule.
        zero_derivative: the derivative is zero by definition (stop_gradient, sign,
            comparisons), so the JVP must be zero instead of matching differences.
        tol: ``(rtol, atol)`` for float32 results.
        jit_samples: how many samples (of the first dtype) the jit check compiles
            (each costs a graph compilation); ``None`` for all of them.
        rule_samples: how many samples the batching and derivative checks use (spread
            over the list, first and last included); ``None`` for all of them.
        op: applies the primitive, ``op(*operands, **params)``; defaults to ``bind``.
        eager_error: the error the primitive raises, by design, when evaluated outside
            the transform that gives it meaning (``block_slice`` outside a sharded
            computation, ``custom_lin`` in forward mode). The checks then assert that
            error, and forward values come from the NumPy reference.
        forward_mode: False if forward-mode differentiation is an error by design
            (``custom_vjp_call``): the JVP check asserts the error, and derivatives are
            checked in reverse mode against finite differences.
        custom_checks: ``{kind: check(spec, sample)}`` replacing the generic check of
            that kind ("batching", "jvp", "transpose", "vjp"), for primitives whose
            semantics need a context (a named axis).
    """

    prim: Primitive
    samples: Callable[[np.random.Generator, type], list]
    dtypes: tuple = (F32,)
    diff_argnums: tuple = (0,)
    linear_groups: tuple = ()
    zero_derivative: bool = False
    tol: tuple = (1e-5, 1e-6)
    jit_samples: int | None = 1
    rule_samples: int | None = 4
    op: Callable | None = None
    eager_error: type | None = None
    forward_mode: bool = True
    custom_checks: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.prim.name

    @property
    def reference(self) -> Callable:
        return REFERENCES[self.prim.name]

    def apply(self, *args, **params):
        """Apply the primitive under the current trace (a list if multiple results)."""
        return (self.op or self.prim.bind)(*args, **params)

    def evaluate(self, *args, **params) -> list[np.ndarray]:
        """Concrete outputs: the eager impl, or the reference if the primitive has no
        eager meaning (``eager_error``)."""
        if self.eager_error is not None:
            return [np.asarray(o) for o in _as_list(self.reference(*args, **params))]
        from fshard.rules import impl

        outs = impl.lookup(self.prim, transform="test")(*args, **params)
        return [o.asnumpy() if hasattr(o, "asnumpy") else np.asarray(o) for o in outs]

    def diff(self, sample: Sample) -> tuple:
        """Operands of ``sample`` a tangent may flow through."""
        nums = self.diff_argnums if sample.diff_argnums is None else sample.diff_argnums
        return tuple(k for k in nums if k < len(sample.args)
                     and np.asarray(sample.args[k]).dtype.kind == "f")

    def groups(self, sample: Sample) -> list[tuple]:
        """The linear groups of ``sample`` with ``ALL`` expanded."""
        groups = self.linear_groups if sample.linear_groups is None else sample.linear_groups
        return [tuple(range(len(sample.args))) if g == ALL else g for g in groups]

    def all_samples(self, dtype) -> list[Sample]:
        """This spec's samples for ``dtype``, from a fixed seed."""
        return self.samples(np.random.default_rng(0), dtype)

    def rule_check_samples(self, dtype) -> list[Sample]:
        """The samples the batching and derivative checks use."""
        samples = self.all_samples(dtype)
        k = self.rule_samples
        if k is None or len(samples) <= k:
            return samples
        return [samples[i] for i in sorted({round(j * (len(samples) - 1) / (k - 1))
                                            for j in range(k)})]


# ---------------------------------------------------------------------------
# Operand generators
# ---------------------------------------------------------------------------

# Ranks 0-3, with size-1 dimensions in several positions.
SHAPES = [(), (1,), (3,), (2, 3), (1, 4, 1), (2, 1, 3)]


def values(rng, shape, dtype, kind: str = "any") -> np.ndarray:
    """Random operand: ``kind`` is 'any' (|x| in [0.1, 2], away from the kinks of
    abs/relu/sign), 'positive' ([0.5, 2]) or 'unit' (uniform in [-1, 1])."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.kind in "iu":
        if kind == "shift":  # shift amounts: within the width of every integer dtype
            return np.asarray(rng.integers(0, 8, size=shape), dtype)
        lo = 1 if kind == "positive" else -5
        return np.asarray(rng.integers(lo, 6, size=shape), dtype)
    if kind == "positive":
        v = rng.uniform(0.5, 2.0, shape)
    elif kind == "unit":
        v = rng.uniform(-1.0, 1.0, shape)
    else:
        v = rng.uniform(0.1, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    return np.asarray(v, dtype)


def indices(rng, shape, n: int, dtype=I32) -> np.ndarray:
    """Valid indices into a dimension of size ``n`` (repeats allowed)."""
    return np.asarray(rng.integers(0, n, size=shape), dtype)


def unary(kind="any", shapes=SHAPES):
    return lambda rng, dt: [Sample((values(rng, s, dt, kind),)) for s in shapes]


def binary(kind_x="any", kind_y="any", shapes=SHAPES):
    return lambda rng, dt: [Sample((values(rng, s, dt, kind_x), values(rng, s, dt, kind_y)))
                            for s in shapes]


# ---------------------------------------------------------------------------
# Per-primitive sample generators (the ones that need parameters)
# ---------------------------------------------------------------------------


def _gelu(rng, dt):
    return [Sample((values(rng, s, dt),), {"approximate": a})
            for s, a in zip(SHAPES, itertools.cycle(["tanh", "none"]))]


def _wide(scale):
    """Values over ``scale`` times the usual range: both sides of relu6's and the hard
    activations' kinks (random values meet a kink with probability 0)."""
    return lambda rng, dt: [Sample(((values(rng, s, dt) * scale).astype(dt),)) for s in SHAPES]


def _tangent(scale):
    """(t, x) of an activation's tangent, x on both sides of its kinks."""
    return lambda rng, dt: [Sample((values(rng, s, dt), (values(rng, s, dt) * scale).astype(dt)))
                            for s in SHAPES]


def _clamp(rng, dt):
    out = []
    for s, bounds in zip(SHAPES, itertools.cycle(["both", "lo", "hi"])):
        x = values(rng, s, dt)
        lo, hi = values(rng, s, dt, "unit"), values(rng, s, dt, "unit")
        if bounds == "both":  # lo < hi mostly, lo > hi (an empty range) sometimes
            args = (x, np.minimum(lo, hi), np.maximum(lo, hi)) if len(out) % 4 else (x, lo, hi)
        else:
            args = (x, lo if bounds == "lo" else hi)
        out.append(Sample(args, {"bounds": bounds}, diff_argnums=tuple(range(len(args)))))
    return out


def _integer_pow(rng, dt):
    # negative exponents on positive values (no division by zero); 2 is lowered as x * x
    exps = [2, 3, -1, 2, 0, -2]
    return [Sample((values(rng, s, dt, "positive" if n < 0 else "any"),), {"y": n})
            for s, n in zip(SHAPES, itertools.cycle(exps))]


def _running(rng, dt):
    cases = [((3,), 0, False), ((2, 3), 1, True), ((2, 3), 0, False), ((1, 4, 1), 1, True),
             ((2, 1, 3), 2, False), ((1,), 0, True)]
    return [Sample((values(rng, a, dt),), {"axis": ax, "reverse": r}) for a, ax, r in cases]


def _cumprod(rng, dt):
    out = _running(rng, dt)
    x = values(rng, (2, 4), dt)
    x[0, 1] = 0  # a zero factor: the derivative leaves it out instead of dividing by it
    x[1, 2] = 0
    return out + [Sample((x,), {"axis": 1, "reverse": False}),
                  Sample((x,), {"axis": 1, "reverse": True})]


def _sort(rng, dt):
    cases = [((4,), 0, False), ((2, 3), 1, True), ((3, 2), 0, False), ((1, 4, 1), 1, True),
             ((2, 1, 3), 2, False)]
    return [Sample((values(rng, a, dt),), {"axis": ax, "descending": d}) for a, ax, d in cases]


# (x shape, w shape, stride, padding, dilation, groups): every parameter path, the
# first (the quick run's) with uneven padding, a stride and a dilation
CONV_CASES = [
    ((2, 3, 5, 6), (4, 3, 3, 3), (2, 1), ((1, 0), (2, 1)), (1, 2), 1),
    ((1, 4, 5, 5), (6, 2, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 2),
    ((2, 3, 6, 6), (6, 1, 3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1), 3),
    ((1, 2, 4, 3), (3, 2, 2, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1),
]


def _conv_params(xs, ws, st, pad, dil, g):
    return {"stride": st, "padding": pad, "dilation": dil, "groups": g}


def _conv_out(xs, ws, st, pad, dil, g):
    return tuple(REFERENCES["conv2d"](np.zeros(xs), np.zeros(ws), **_conv_params(
        xs, ws, st, pad, dil, g)).shape)


def _conv(rng, dt):
    return [Sample((values(rng, c[0], dt), values(rng, c[1], dt)), _conv_params(*c))
            for c in CONV_CASES]


def _conv_input_grad(rng, dt):
    return [Sample((values(rng, _conv_out(*c), dt), values(rng, c[1], dt)),
                   {**_conv_params(*c), "input_shape": c[0]}) for c in CONV_CASES]


def _conv_filter_grad(rng, dt):
    return [Sample((values(rng, c[0], dt), values(rng, _conv_out(*c), dt)),
                   {**_conv_params(*c), "kernel_shape": c[1]}) for c in CONV_CASES]


# (x shape, kernel, stride, padding): leftover rows, uneven padding, ceil_mode's extra
POOL_CASES = [
    ((1, 2, 6, 5), (3, 3), (2, 1), ((1, 1), (1, 0))),
    ((2, 3, 5, 5), (2, 2), (2, 2), ((0, 0), (0, 0))),
    ((2, 1, 4, 4), (3, 2), (1, 2), ((1, 2), (0, 1))),
]


# (values shape, index shape): the index reads any position of its plane, repeats included
PLANE_CASES = [((2, 3, 4, 5), (2, 3, 2, 3)), ((1, 1, 3, 3), (1, 1, 2, 2)),
               ((4, 2, 3, 3), (4, 2, 4, 1))]


# Training-mode batch norm: (N, C, H, W) shapes; the tangent's and the gradient's
# mean/var operands are x's batch statistics (as the rules make them)
BN_SHAPES = [(4, 3, 2, 3), (2, 2, 1, 1), (3, 1, 4, 2)]


def _bn_stats(x):
    x64 = x.astype(np.float64)
    return x64.mean((0, 2, 3)).astype(x.dtype), x64.var((0, 2, 3)).astype(x.dtype)


def _bn_train(rng, dt):
    return [Sample((values(rng, s, dt), values(rng, s[1:2], dt), values(rng, s[1:2], dt)),
                   {"eps": 1e-5}) for s in BN_SHAPES]


def _bn_tangent(rng, dt):
    out = []
    for s in BN_SHAPES:
        x = values(rng, s, dt)
        out.append(Sample((x, values(rng, s[1:2], dt), *_bn_stats(x), values(rng, s, dt),
                           values(rng, s[1:2], dt), values(rng, s[1:2], dt)), {"eps": 1e-3}))
    return out


def _bn_grad(rng, dt):
    out = []
    for s in BN_SHAPES:
        x = values(rng, s, dt)
        out.append(Sample((x, values(rng, s[1:2], dt), *_bn_stats(x), values(rng, s, dt)),
                          {"eps": 1e-3}))
    return out


ADAM_LEAVES = [[(3, 4)], [(2, 3), (4,), ()], [(2, 2, 2)]]


def _adam_update(rng, dt):
    """Moments, positive second moments, gradients and a positive rate; n leaves."""
    out = []
    for shapes in ADAM_LEAVES:
        ms_ = [values(rng, s, dt) for s in shapes]
        vs = [values(rng, s, dt, "positive") for s in shapes]
        gs = [values(rng, s, dt) for s in shapes]
        lr = np.asarray(rng.uniform(0.01, 0.1), dt)
        out.append(Sample((*ms_, *vs, *gs, lr), {"b1": 0.9, "b2": 0.999, "eps": 1e-8},
                          diff_argnums=tuple(range(3 * len(shapes) + 1))))
    return out


def _pool_gather(rng, dt):
    return [Sample((values(rng, vs, dt), rng.integers(0, vs[2] * vs[3], ish).astype(I32)))
            for vs, ish in PLANE_CASES]


def _pool_scatter(rng, dt):
    return [Sample((values(rng, ish, dt), rng.integers(0, vs[2] * vs[3], ish).astype(I32)),
                   {"plane": vs[2:]}) for vs, ish in PLANE_CASES]


def _pool(rng, dt):
    return [Sample((values(rng, xs, dt),), {"kernel": k, "stride": s, "padding": p})
            for xs, k, s, p in POOL_CASES]


def _select(rng, dt):
    return [Sample((values(rng, s, BOOL), values(rng, s, dt), values(rng, s, dt)))
            for s in SHAPES]


def _cast(rng, dt):
    out = []
    floats = [dtypes.float32, dtypes.float64]
    for s, target in zip(SHAPES, itertools.cycle(
            floats + [dtypes.int32, dtypes.bool_] if np.dtype(dt).kind == "f" else
            [dtypes.float32, dtypes.int64, dtypes.bool_])):
        out.append(Sample((values(rng, s, dt),), {"dtype": target}))
    if np.dtype(dt) == F64:  # a float64 -> float64 cast keeps derivative checks exact
        out.append(Sample((values(rng, (2, 3), dt),), {"dtype": dtypes.float64}))
    return out


def _matmul(rng, dt):
    cases = [((2, 3), (3, 4), False, False), ((3, 2), (3, 4), True, False),
             ((2, 3), (4, 3), False, True), ((3, 2), (4, 3), True, True),
             ((1, 1), (1, 1), False, False), ((2, 2, 3), (2, 3, 1), False, False),
             ((1, 3, 2), (1, 4, 3), True, True),
             # batching folds a batched transposed left operand into the rows when
             # m <= n, else copies the right one out: both sides of that
             ((3, 5), (3, 2), True, False), ((3, 5), (2, 3), True, True)]
    return [Sample((values(rng, a, dt), values(rng, b, dt)),
                   {"transpose_a": ta, "transpose_b": tb}) for a, b, ta, tb in cases]


def _broadcast_to(rng, dt):
    cases = [((), (2, 3)), ((3,), (2, 3)), ((1, 3), (4, 3)), ((2, 1), (2, 5)),
             ((1,), (1,)), ((2, 1, 3), (2, 2, 4, 3))]
    return [Sample((values(rng, a, dt),), {"shape": s}) for a, s in cases]


def _reshape(rng, dt):
    cases = [((2, 3), (3, 2)), ((6,), (1, 2, 3)), ((), (1, 1)), ((1, 4, 1), (4,)),
             ((2, 1, 3), (6,))]
    return [Sample((values(rng, a, dt),), {"shape": s}) for a, s in cases]


def _transpose(rng, dt):
    cases = [((), ()), ((3,), (0,)), ((2, 3), (1, 0)), ((1, 4, 2), (2, 0, 1)),
             ((2, 1, 3), (1, 2, 0))]
    return [Sample((values(rng, a, dt),), {"perm": p}) for a, p in cases]


def _full(rng, dt):
    return [Sample((), {"shape": (2, 3), "value": 1.5, "dtype": dtypes.float32}),
            Sample((), {"shape": (), "value": 2, "dtype": dtypes.int32}),
            Sample((), {"shape": (1, 2), "value": True, "dtype": dtypes.bool_})]


def _reduce(rng, dt):
    cases = [((2, 3), (1,)), ((2, 3), (0, 1)), ((1, 4, 1), (0, 2)), ((3,), (0,)),
             ((2, 1, 3), (1,)), ((2, 4, 3), (0, 2)), ((), ())]
    return [Sample((values(rng, a, dt),), {"axes": ax}) for a, ax in cases]


def _arg(rng, dt):
    cases = [((2, 3), 1), ((3,), 0), ((1, 4, 1), 1), ((2, 1, 3), 2), ((4, 3), 0)]
    return [Sample((values(rng, a, dt),), {"axis": ax}) for a, ax in cases]


def _with_index(rng, dt):
    cases = [((2, 3), 1, True), ((3,), 0, False), ((1, 4, 1), 1, True), ((2, 1, 3), 2, False),
             ((4, 3), 0, True)]
    return [Sample((values(rng, a, dt),), {"axis": ax, "largest": big})
            for a, ax, big in cases]


def _dim_size(rng, dt):
    cases = [((2, 3), (1,)), ((3,), (0,)), ((2, 1, 4), (0, 2)), ((2, 3), ())]
    return [Sample((values(rng, a, dt),), {"axes": ax, "dtype": dtypes.float32})
            for a, ax in cases]


def _bias_add(rng, dt):
    cases = [((2, 3), (3,)), ((2, 3, 4), (3,)), ((1, 1), (1,)), ((2, 1, 2, 1), (1,))]
    return [Sample((values(rng, a, dt), values(rng, b, dt))) for a, b in cases]


def _softmax(rng, dt):
    cases = [((2, 3), 1), ((3,), 0), ((2, 1, 3), 0), ((1, 4, 1), 1), ((2, 3, 2), 2)]
    return [Sample((values(rng, a, dt),), {"axis": ax}) for a, ax in cases]


def _concat(rng, dt):
    cases = [([(2, 3), (2, 1)], 1), ([(1,), (3,), (2,)], 0), ([(2, 2, 3), (2, 1, 3)], 1),
             ([(3,)], 0), ([(1, 2), (2, 2)], 0)]
    return [Sample(tuple(values(rng, s, dt) for s in shapes), {"axis": ax})
            for shapes, ax in cases]


def _split(rng, dt):
    cases = [((5, 2), (2, 3), 0), ((2, 6), (1, 2, 3), 1), ((3,), (3,), 0),
             ((2, 4, 1), (1, 3), 1), ((4,), (0, 4), 0)]
    return [Sample((values(rng, a, dt),), {"sizes": sz, "axis": ax}) for a, sz, ax in cases]


def _slice(rng, dt):
    cases = [((5,), (1,), (5,), (2,)), ((3, 4), (0, 1), (3, 4), (2, 3)),
             ((1, 4, 1), (0, 1, 0), (1, 3, 1), (1, 1, 1)), ((4, 2), (2, 0), (2, 2), (1, 1)),
             ((6,), (0,), (6,), (1,)), ((7, 3), (1, 0), (6, 3), (3, 2))]
    return [Sample((values(rng, a, dt),), {"start": lo, "limit": hi, "strides": st})
            for a, lo, hi, st in cases]


def _pad(rng, dt):
    cases = [((3,), (1,), (2,), (0,)), ((2, 3), (0, 1), (2, 0), (1, 2)),
             ((1, 4, 1), (1, 0, 0), (0, 0, 1), (0, 1, 0)), ((1,), (0,), (0,), (3,)),
             ((2, 2), (0, 0), (0, 0), (0, 0))]
    return [Sample((values(rng, a, dt),), {"low": lo, "high": hi, "interior": i})
            for a, lo, hi, i in cases]


def _gather(rng, dt):
    cases = [((5, 3), (4,), 0, I32), ((2, 5), (2, 3), 1, I64), ((4,), (), 0, I32),
             ((2, 3, 4), (2, 2), 1, I32), ((1,), (3,), 0, I64), ((3, 2), (1, 1), 1, I32)]
    return [Sample((values(rng, xs, dt), indices(rng, ish, xs[ax], idt)), {"axis": ax})
            for xs, ish, ax, idt in cases]


def _scatter_add(rng, dt):
    cases = [((5, 3), (4,), 0, I32), ((2, 5), (2, 3), 1, I64), ((4,), (), 0, I32),
             ((2, 3, 4), (3,), 2, I32), ((1,), (3,), 0, I64), ((3, 2), (1, 1), 1, I32)]
    out = []
    for shape, ish, ax, idt in cases:
        ushape = shape[:ax] + ish + shape[ax + 1:]
        out.append(Sample((values(rng, ushape, dt), indices(rng, ish, shape[ax], idt)),
                          {"shape": shape, "axis": ax}))
    return out


def _one_hot(rng, dt):
    cases = [((3,), 4, dtypes.float32, I32), ((), 2, dtypes.int32, I64),
             ((2, 3), 5, dtypes.bool_, I32), ((1, 1), 1, dtypes.float64, I32)]
    return [Sample((indices(rng, s, depth, idt),), {"depth": depth, "dtype": out_dt})
            for s, depth, out_dt, idt in cases]


# ---------------------------------------------------------------------------
# Call primitives: samples are staged from fs.custom_jvp / fs.custom_vjp functions
# ---------------------------------------------------------------------------


_W = {np.dtype(d): W.astype(d) for d in (F32, F64)}


def _w(x):
    """The constant ``W`` in ``x``'s dtype (closed over: it becomes an operand)."""
    return _W[dtypes.to_numpy(typeof(x).dtype)]


@fs.custom_jvp
def sin_times(x, y):
    """Two operands, two outputs."""
    return fs.ops.sin(x) * y, x + y


@sin_times.defjvp
def _sin_times_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    return sin_times(x, y), (fs.ops.cos(x) * y * tx + fs.ops.sin(x) * ty, tx + ty)


@fs.custom_jvp
def scaled(x):
    """Closes over W, so the body and the rule have constant operands."""
    return x * _w(x)


@scaled.defjvp
def _scaled_jvp(primals, tangents):
    return scaled(primals[0]), tangents[0] * _w(primals[0])


@fs.custom_vjp
def sin_vjp(x):
    return fs.ops.sin(x)


sin_vjp.defvjp(lambda x: (fs.ops.sin(x), fs.ops.cos(x)), lambda c, ct: (c * ct,))


@fs.custom_vjp
def scaled_vjp(x):
    return x * _w(x)


scaled_vjp.defvjp(lambda x: (x * _w(x), None), lambda res, ct: (ct * _w(ct),))


def _staged_equation(fn, args, prim):
    """The first ``prim`` equation of ``fn`` staged on ``args``, with the concrete
    values of its operands (the equations before it are evaluated eagerly)."""
    from fshard.core.ir import Literal
    from fshard.rules import impl

    traced = fs.make_ir(fn)(*args)
    env = dict(zip(traced.program.inputs, list(traced.consts) + list(args)))

    def read(a):
        return a.value if isinstance(a, Literal) else env[a]

    for eq in traced.program.equations:
        vals = [read(a) for a in eq.inputs]
        if eq.prim is prim:
            return eq, tuple(np.asarray(v.asnumpy() if hasattr(v, "asnumpy") else v)
                             for v in vals)
        env.update(zip(eq.outputs, impl.lookup(eq.prim, transform="test")(*vals, **eq.params)))
    raise AssertionError(f"{fn} staged no {prim} equation")


def _call_shapes(dt):
    return [(2, 3), (1, 3)] if np.dtype(dt) == F64 else [(2, 3), (1, 3), (3, 3)]


def _custom_jvp_call(rng, dt):
    out = []
    for shape in _call_shapes(dt):
        x, y = values(rng, shape, dt), values(rng, shape, dt)
        for fn, args in ((sin_times, (x, y)), (scaled, (x,))):
            eq, vals = _staged_equation(fn, args, C.custom_jvp_call_p)
            n_c = eq.params["n_body_consts"] + eq.params["n_jvp_consts"]
            out.append(Sample(vals, eq.params, diff_argnums=tuple(range(n_c, len(vals)))))
    return out


def _while_loop_fn(n, x, y):
    """Loop n times: a float carry updated non-linearly, a body constant y."""
    return fs.while_loop(
        lambda c: c[0] < n,
        lambda c: (c[0] + 1, c[1] * 0.75 + fs.ops.sin(c[1]) * y),
        (np.int32(0), x))


def _while(rng, dt):
    out = []
    for shape in _call_shapes(dt):
        x, y = values(rng, shape, dt), values(rng, shape, dt)
        for n in (0, 1, 3):
            eq, vals = _staged_equation(_while_loop_fn, (np.int32(n), x, y), CF.while_p)
            out.append(Sample(vals, eq.params,
                              diff_argnums=tuple(k for k in range(len(vals))
                                                 if np.asarray(vals[k]).dtype.kind == "f")))
    return out


def _scan_fn(length, reverse, unroll):
    """A scan with a body constant y, a float and an int carry, an x, and two ys."""
    def fn(x, y, xs):
        def body(c, xi):
            k, v = c
            v = v * 0.75 + fs.ops.sin(v) * y + xi
            return (k + 1, v), (v * xi, k)
        return fs.scan(body, (np.int32(0), x), xs, length=length, reverse=reverse,
                       unroll=unroll)
    return fn


def _scan(rng, dt):
    """scan equations: unroll=1 or 2 binds the primitive (a graph loop under jit)."""
    out = []
    for shape in _call_shapes(dt):
        x, y = values(rng, shape, dt), values(rng, shape, dt)
        for n, reverse, unroll in ((2, False, 1), (3, True, 2), (4, False, 1)):
            xs = values(rng, (n,) + shape, dt)
            eq, vals = _staged_equation(_scan_fn(n, reverse, unroll), (x, y, xs), C.scan_p)
            out.append(Sample(vals, eq.params,
                              diff_argnums=tuple(k for k in range(len(vals))
                                                 if np.asarray(vals[k]).dtype.kind == "f"),
                              linear_groups=()))
            # a body linear in the carry and the xs (what reverse mode transposes)
            eq, vals = _staged_equation(_linear_scan_fn(reverse, unroll), (y, x, xs), C.scan_p)
            nc = eq.params["n_consts"]
            out.append(Sample(vals, eq.params, diff_argnums=tuple(range(len(vals))),
                              linear_groups=((nc, nc + 1),)))
    return out


def _linear_scan_fn(reverse, unroll):
    def fn(a, c, xs):
        return fs.scan(lambda c, x: (c * a + x * 0.5, c * 2.0 - x), c, xs, reverse=reverse,
                       unroll=unroll)
    return fn


def _switch_fn(k, x, y):
    """Three branches of different work on two operands (the index is clamped)."""
    return fs.switch(k, [lambda x, y: (x * y + 1.0, x),
                         lambda x, y: (fs.ops.sin(x) * y, y * 2.0),
                         lambda x, y: (x - y, x * x)], x, y)


def _linear_switch_fn(k, x, y):
    """Three branches linear in both operands (what reverse mode transposes)."""
    return fs.switch(k, [lambda x, y: (x * 2.0 + y, x), lambda x, y: (y * -3.0, x + y),
                         lambda x, y: (x - y, y * 0.5)], x, y)


def _cond(rng, dt):
    """cond equations (fs.switch binds the primitive on a traced index): nonlinear
    branches, and branches linear in the operands for the transpose checks."""
    out = []
    for shape in _call_shapes(dt):
        x, y = values(rng, shape, dt), values(rng, shape, dt)
        for k in (-1, 1, 5):
            eq, vals = _staged_equation(_switch_fn, (np.int32(k), x, y), CF.cond_p)
            out.append(Sample(vals, eq.params, diff_argnums=tuple(
                i for i in range(1, len(vals)) if np.asarray(vals[i]).dtype.kind == "f"),
                linear_groups=()))
        eq, vals = _staged_equation(_linear_switch_fn, (np.int32(1), x, y), CF.cond_p)
        n = len(vals)
        out.append(Sample(vals, eq.params, diff_argnums=tuple(range(1, n)),
                          linear_groups=(tuple(range(1, n)),)))
    return out


def loop_sharding_samples(rng) -> dict:
    """scan, while and cond equations whose dimensions divide by the meshes' sizes, so
    that the sharding rules of the primitives with bodies get split (the generic
    samples above favour odd and size-1 dimensions): tests/sharding/test_sharding_rules.py."""
    x, y, xs = (values(rng, s, F32) for s in ((4, 2), (4, 2), (3, 4, 2)))
    out = {"scan": [], "while": [], "cond": []}
    for fn, args in ((_scan_fn(3, False, 1), (x, y, xs)), (_scan_fn(3, True, 2), (x, y, xs)),
                     (_linear_scan_fn(False, 1), (y, x, xs))):
        eq, vals = _staged_equation(fn, args, C.scan_p)
        out["scan"].append(Sample(vals, eq.params))
    eq, vals = _staged_equation(_while_loop_fn, (np.int32(3), x, y), CF.while_p)
    out["while"].append(Sample(vals, eq.params))
    for k in (0, 2):
        eq, vals = _staged_equation(_switch_fn, (np.int32(k), x, y), CF.cond_p)
        out["cond"].append(Sample(vals, eq.params))
    return out


def _while_vjp(spec, sample):
    """Reverse mode through a while loop is an error naming the fix."""
    args, params = list(sample.args), sample.params
    diff = spec.diff(sample)

    def f(*d):
        operands = list(args)
        for k, v in zip(diff, d):
            operands[k] = v
        return spec.apply(*operands, **params)

    def loss(*d):
        return sum(fs.ops.reduce_sum(o) for o in f(*d) if typeof(o).dtype in (
            dtypes.float32, dtypes.float64))

    with pytest.raises(fs.MissingRuleError, match="fs.fori_loop with static bounds"):
        fs.grad(loss, argnums=tuple(range(len(diff))))(*[args[k] for k in diff])


def _custom_vjp_call(rng, dt):
    out = []
    for shape in _call_shapes(dt):
        x = values(rng, shape, dt)
        for fn in (sin_vjp, scaled_vjp):
            eq, vals = _staged_equation(fn, (x,), C.custom_vjp_call_p)
            n_c = sum(eq.params["n_consts"])
            out.append(Sample(vals, eq.params, diff_argnums=tuple(range(n_c, len(vals)))))
    return out


def _ms_op(rng, dt):
    """Generic equations: MindSpore's MatrixBandPart (linear) and Xdivy (two operands;
    its divisor kept away from 0), two ops fshard has no native rule for."""
    from mindspore import ops

    out = []
    for shape in ((3, 3), (2, 3), (2, 1, 3)):
        x, y = values(rng, shape, dt), values(rng, shape, dt)
        eq, vals = _staged_equation(lambda a: ops.matrix_band_part(a, 0, 1), (x,), G.ms_op_p)
        out.append(Sample(vals, eq.params, linear_groups=((0,),)))
        y = (np.abs(y) + 1).astype(y.dtype)
        eq, vals = _staged_equation(lambda a, b: ops.xdivy(a, b), (x, y), G.ms_op_p)
        out.append(Sample(vals, eq.params, diff_argnums=(0, 1), linear_groups=()))
    return out


def _custom_lin(rng, dt):
    """custom_lin equations from the JVP of custom_vjp functions (forward mode stages
    them; only transposition can evaluate them)."""
    out = []
    for shape in _call_shapes(dt):
        x, t = values(rng, shape, dt), values(rng, shape, dt)
        for fn in (sin_vjp, scaled_vjp):
            eq, vals = _staged_equation(lambda x, t: fs.jvp(fn, (x,), (t,)), (x, t),
                                        C.custom_lin_p)
            n_lin = eq.params["n_consts"] + eq.params["n_res"]
            out.append(Sample(vals, eq.params, diff_argnums=(),
                              linear_groups=(tuple(range(n_lin, len(vals))),)))
    return out


def _custom_lin_batching(spec, sample):
    """custom_lin exists only between forward and reverse mode; vmap never sees it
    unless forward mode is applied to a custom_vjp function, which is an error."""
    import pytest

    batched = [np.stack([a, a]) for a in sample.args]
    with pytest.raises(DifferentiationError, match="forward-mode"):
        fs.vmap(lambda *xs: spec.apply(*xs, **sample.params))(*batched)


# ---------------------------------------------------------------------------
# fs.remat: remat_call, checkpoint_name, remat_barrier
# ---------------------------------------------------------------------------


def _remat_fn(policy):
    def fn(x, y):
        return fs.remat(lambda x, y: (fs.ops.sin(x) * y * _w(x), x + y), policy=policy)(x, y)
    return fn


def _remat_linear_fn(x, y):
    return fs.remat(lambda x, y: x * _w(x) + y)(x, y)


def _remat_call(rng, dt):
    """remat_call equations: a nonlinear body (two outputs, a closed-over constant)
    under two policies, and a body linear in its arguments (what reverse mode
    transposes)."""
    out = []
    for shape in _call_shapes(dt):
        x, y = values(rng, shape, dt), values(rng, shape, dt)
        for policy in (None, "everything_saveable"):
            eq, vals = _staged_equation(_remat_fn(policy), (x, y), RM.remat_call_p)
            out.append(Sample(vals, eq.params, diff_argnums=tuple(range(len(vals))),
                              linear_groups=()))
        eq, vals = _staged_equation(_remat_linear_fn, (x, y), RM.remat_call_p)
        nc = len(vals) - 2
        out.append(Sample(vals, eq.params, diff_argnums=tuple(range(len(vals))),
                          linear_groups=((nc, nc + 1),)))
    return out


def _checkpoint_name(rng, dt):
    return [Sample((values(rng, shape, dt),), {"name": "h"}) for shape in SHAPES]


def _remat_barrier(rng, dt):
    """The dependency (last) shaped like an x, and not."""
    return [Sample((values(rng, (2, 4), dt), values(rng, (3,), dt), values(rng, (2, 4), dt))),
            Sample((values(rng, (2, 3), dt), values(rng, (3,), dt), values(rng, (4,), dt))),
            Sample((values(rng, (), dt), values(rng, (2, 2), dt)))]


# ---------------------------------------------------------------------------
# layout_constraint: the identity, with a layout fs.shard's planner must give it
# ---------------------------------------------------------------------------


def _layout_constraint(rng, dt):
    cases = [((4, 6), ((0,), ()), (2, 1)), ((4, 6), ((), (0,)), (1, 2)), ((6,), ((),), (1,))]
    return [Sample((values(rng, shape, dt),), {
        "axes": axes, "counts": counts, "n": 2, "origin": "MatMul.shard(...) at net.py:12",
        "group": 1, "role": ("in", 0, 1), "exact": False}) for shape, axes, counts in cases]


# ---------------------------------------------------------------------------
# block_slice: a device's block of a dimension, along named mesh axes
# ---------------------------------------------------------------------------


def _block_slice(rng, dt):
    cases = [((4, 3), ("i",), 0, (2,)), ((2, 6), ("i",), 1, (3,)),
             ((4, 2), ("i", "j"), 0, (2, 2)), ((3, 16), ("i", "j", "k"), 1, (2, 2, 2))]
    return [Sample((values(rng, a, dt),), {"axis_name": names, "dim": d, "sizes": sz})
            for a, names, d, sz in cases]


def _over_mesh(f, names, sizes, in_axes=None, inner_axes=None):
    """``f`` vmapped over the mesh axes, outermost first (a virtual mesh): lane
    ``(i, j, ...)`` is device ``i * sizes[1] + j ...`` (row-major, as the partitioner
    numbers them). ``in_axes`` maps the outermost axis, ``inner_axes`` the others."""
    for k in reversed(range(len(names))):
        f = fs.vmap(f, in_axes=in_axes if k == 0 else inner_axes, axis_size=sizes[k],
                    axis_name=names[k])
    return f


def _blocks(x, dim, n) -> np.ndarray:
    return np.stack(np.split(np.asarray(x), n, axis=dim))


def _block_slice_batching(spec, sample):
    """On a virtual mesh (vmap with the axis names), lane k keeps block k of x; a plain
    batch axis inside the mesh axes is carried through."""
    (x,), p = sample.args, sample.params
    names, sizes, dim = p["axis_name"], p["sizes"], p["dim"]
    n = int(np.prod(sizes))
    f = lambda v: spec.apply(v, **p)  # noqa: E731
    got = np.asarray(_over_mesh(f, names, sizes)(x).asnumpy())
    want = _blocks(x, dim, n).reshape(tuple(sizes) + got.shape[len(sizes):])
    np.testing.assert_array_equal(got, want, err_msg="x replicated over the mesh")
    # Each lane of the first mesh axis with its own x.
    xs = np.stack([x * (1 + k) for k in range(sizes[0])])
    got = np.asarray(_over_mesh(f, names, sizes, in_axes=0)(xs).asnumpy())
    per = n // sizes[0]
    want = np.stack([_blocks(xs[i], dim, n)[i * per:(i + 1) * per] for i in range(sizes[0])])
    np.testing.assert_array_equal(got, want.reshape(got.shape), err_msg="x mapped per lane")
    # A plain batch axis (not a mesh axis) inside the mesh axes.
    xb = np.stack([x, -x])
    got = np.asarray(_over_mesh(fs.vmap(f), names, sizes)(xb).asnumpy())
    want = np.stack([_blocks(xb[b], dim, n) for b in range(2)], axis=1)
    np.testing.assert_array_equal(got, want.reshape(got.shape), err_msg="inner batch axis")


def _block_slice_jvp(spec, sample):
    """d block_slice(x) = block_slice(t), on every lane."""
    (x,), p = sample.args, sample.params
    t = np.random.default_rng(1).standard_normal(x.shape).astype(x.dtype)
    names, sizes, dim = p["axis_name"], p["sizes"], p["dim"]
    n = int(np.prod(sizes))
    out, t_out = _over_mesh(lambda v, w: fs.jvp(lambda u: spec.apply(u, **p), (v,), (w,)),
                            names, sizes)(x, t)
    np.testing.assert_array_equal(np.asarray(t_out.asnumpy()).reshape((n,) + t_out.shape[
        len(sizes):]), _blocks(t, dim, n))


def _block_slice_transpose(spec, sample):
    """Dot-product test across the mesh: lane k's cotangent is for block k, and every
    lane's transposed cotangent is the tiled gather of all of them."""
    (x,), p = sample.args, sample.params
    names, sizes, dim = p["axis_name"], p["sizes"], p["dim"]
    n = int(np.prod(sizes))
    rng = np.random.default_rng(2)
    block_shape = _blocks(x, dim, n).shape[1:]
    cts = rng.standard_normal(tuple(sizes) + block_shape).astype(x.dtype)

    def lane(v, ct):
        _, vjp_fn = fs.vjp(lambda u: spec.apply(u, **p), v)
        return vjp_fn(ct)[0]

    got = np.asarray(_over_mesh(lambda v, ct: lane(v, ct), names, sizes, in_axes=(None, 0))(
        x, cts).asnumpy()) if len(names) == 1 else None
    if got is None:  # several mesh axes: map the cotangent over every axis
        f = lane
        for k in reversed(range(len(names))):
            f = fs.vmap(f, in_axes=(None, 0), axis_name=names[k])
        got = np.asarray(f(x, cts).asnumpy())
    full = np.concatenate(list(cts.reshape((n,) + block_shape)), axis=dim)
    want = np.broadcast_to(full, tuple(sizes) + full.shape)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# shard_call: a sharded computation (fs.shard) as one equation
# ---------------------------------------------------------------------------
#
# Samples are the equations fs.shard stages, on 2 virtual devices: a bilinear body
# (linear in each operand) and a nonlinear one; the reference (tests/references.py,
# SHARDED) is the unsharded function, looked up by the plan's name.


def sharded_matmul(x, w):
    return fs.ops.matmul(x, w)


def sharded_tanh(x, w):
    return fs.ops.tanh(fs.ops.matmul(x, w)).sum(axis=1)


def _shard_call(rng, dt):
    from fshard.transforms.shard_call import shard_call_p

    out = []
    for fn, strategy, groups in ((sharded_matmul, ((2, 1), None), ((0,), (1,))),
                                 (sharded_tanh, ((1, 2), None), ())):
        x, w = values(rng, (4, 6), dt), values(rng, (6, 3), dt)
        sharded = fs.shard(fn, strategy, mesh=2)
        eq, vals = _staged_equation(lambda x, w: sharded(x, w), (x, w), shard_call_p)
        out.append(Sample(vals, eq.params, linear_groups=groups))
    return out


# ---------------------------------------------------------------------------
# Collectives: checked on a virtual mesh against their semantics over all devices
# ---------------------------------------------------------------------------


def _collective(cases):
    """Samples ``(shape, axis_name, axis_sizes, extra params)``."""
    def samples(rng, dt):
        return [Sample((values(rng, shape, dt),) if shape is not None else (),
                       {"axis_name": names, "axis_sizes": sizes, **extra})
                for shape, names, sizes, extra in cases]

    return samples


def _lanes_np(x):
    return np.asarray(x.asnumpy() if hasattr(x, "asnumpy") else x)


def _collective_setup(spec, sample, dtype=None):
    p = sample.params
    names, sizes = p["axis_name"], p["axis_sizes"]
    n = int(np.prod(sizes))
    return p, names, sizes, n, (lambda *v: spec.apply(*v, **p)), LANES[spec.name]


def _lane_operands(x, n, rng) -> np.ndarray:
    return rng.standard_normal((n,) + np.shape(x)).astype(np.asarray(x).dtype)


def _collective_batching(spec, sample):
    """On a virtual mesh: every device with its own operand, every device with the same
    operand, and a plain batch axis inside the mesh axes."""
    p, names, sizes, n, f, lanes = _collective_setup(spec, sample)
    if not sample.args:  # axis_index
        got = _lanes_np(_over_mesh(f, names, sizes)())
        np.testing.assert_array_equal(got.reshape(n), lanes(n, p))
        return
    x = sample.args[0]
    xs = _lane_operands(x, n, np.random.default_rng(3))
    got = _lanes_np(_over_mesh(f, names, sizes, 0, 0)(xs.reshape(tuple(sizes) + x.shape)))
    want = lanes(xs, p)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-6,
                               err_msg="one operand per device")
    got = _lanes_np(_over_mesh(f, names, sizes)(x))
    want = lanes(np.stack([x] * n), p)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-6,
                               err_msg="the same operand on every device")
    xb = np.stack([xs, -2 * xs], axis=1)  # (n, 2, ...): batch axis inside the mesh axes
    got = _lanes_np(_over_mesh(fs.vmap(f), names, sizes, 0, 0)(
        xb.reshape(tuple(sizes) + xb.shape[1:])))
    want = np.stack([lanes(xb[:, b], p) for b in range(2)], axis=1)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-6,
                               err_msg="a batch axis inside the mesh axes")


def _collective_jvp(spec, sample):
    """Forward mode on every device vs central differences of the global semantics."""
    p, names, sizes, n, f, lanes = _collective_setup(spec, sample)
    x = sample.args[0]
    rng = np.random.default_rng(4)
    xs, ts = _lane_operands(x, n, rng), _lane_operands(x, n, rng)
    shape = tuple(sizes) + x.shape
    _, t_out = _over_mesh(lambda v, t: fs.jvp(f, (v,), (t,)), names, sizes, 0, 0)(
        xs.reshape(shape), ts.reshape(shape))
    eps = 1e-6
    want = (lanes(xs + eps * ts, p) - lanes(xs - eps * ts, p)) / (2 * eps)
    np.testing.assert_allclose(_lanes_np(t_out).reshape(want.shape), want, rtol=1e-6,
                               atol=1e-6)


def _collective_transpose(spec, sample):
    """Dot-product test over all devices: sum_i <ct_i, (L t)_i> == sum_i <(L^T ct)_i, t_i>
    with L^T from fs.vjp on every device."""
    p, names, sizes, n, f, lanes = _collective_setup(spec, sample)
    x = sample.args[0]
    rng = np.random.default_rng(5)
    ts = _lane_operands(x, n, rng)
    l_t = lanes(ts, p)
    cts = rng.standard_normal(l_t.shape).astype(l_t.dtype)

    def lane(v, ct):
        return fs.vjp(f, v)[1](ct)[0]

    got = _lanes_np(_over_mesh(lane, names, sizes, 0, 0)(
        ts.reshape(tuple(sizes) + x.shape), cts.reshape(tuple(sizes) + l_t.shape[1:])))
    lhs = float(np.sum(cts.astype(np.float64) * l_t))
    rhs = float(np.sum(got.reshape(ts.shape).astype(np.float64) * ts))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-9, atol=1e-9)


def _collective_vjp(spec, sample):
    """Reverse mode on every device: sum_i <ct_i, (J t)_i> == sum_i <vjp(ct)_i, t_i>,
    with J t from central differences of the global semantics."""
    p, names, sizes, n, f, lanes = _collective_setup(spec, sample)
    x = sample.args[0]
    rng = np.random.default_rng(6)
    xs, ts = _lane_operands(x, n, rng), _lane_operands(x, n, rng)
    eps = 1e-6
    j_t = (lanes(xs + eps * ts, p) - lanes(xs - eps * ts, p)) / (2 * eps)
    cts = rng.standard_normal(j_t.shape).astype(xs.dtype)
    got = _lanes_np(_over_mesh(lambda v, ct: fs.vjp(f, v)[1](ct)[0], names, sizes, 0, 0)(
        xs.reshape(tuple(sizes) + x.shape), cts.reshape(tuple(sizes) + j_t.shape[1:])))
    lhs = float(np.sum(cts * j_t))
    rhs = float(np.sum(got.reshape(ts.shape) * ts))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-6, atol=1e-6)


def _collective_spec(prim, cases, *, linear=True, differentiable=True):
    checks = {"batching": _collective_batching}
    if differentiable:
        checks["jvp"] = _collective_jvp
        checks["vjp"] = _collective_vjp
    if linear:
        checks["transpose"] = _collective_transpose
    return PrimitiveSpec(prim, _collective(cases), diff_argnums=(0,) if differentiable else (),
                         linear_groups=((0,),) if linear else (), eager_error=AxisNameError,
                         custom_checks=checks)


# replica_sum / replica_split: the cotangent boundary of a replicated value inside a
# shard_map body. Over an axis where ``like`` is replicated, replica_sum sums the
# devices' cotangents and replica_split divides a seed among them; where ``like`` is
# split they are the identity.
MARKER_MESH = {("i",): (3,), ("i", "j"): (2, 2)}
MARKERS = {
    "replica_sum": lambda cts, n: np.broadcast_to(cts.sum(0), cts.shape),
    "replica_split": lambda cts, n: cts / n,
}


def _markers(rng, dt):
    return [Sample((values(rng, s, dt), values(rng, s, dt)), {"axis_name": names})
            for s, names in (((2, 3), ("i",)), ((), ("i",)), ((3,), ("i", "j")))]


def _marker_setup(spec, sample):
    names = sample.params["axis_name"]
    sizes = MARKER_MESH[names]
    n = int(np.prod(sizes))
    f = lambda ct, like: spec.apply(ct, like, **sample.params)  # noqa: E731
    return names, sizes, n, f


def _marker_lanes(spec, cts, replicated, n):
    return MARKERS[spec.name](cts, n) if replicated else cts


def _marker_batching(spec, sample):
    names, sizes, n, f = _marker_setup(spec, sample)
    ct, like = sample.args
    cts = _lane_operands(ct, n, np.random.default_rng(7))
    shape = tuple(sizes) + ct.shape
    for replicated in (True, False):
        like_arg = like if replicated else np.stack([like] * n).reshape(shape)
        got = _lanes_np(_over_mesh(f, names, sizes, (0, None if replicated else 0),
                                   (0, None if replicated else 0))(cts.reshape(shape), like_arg))
        want = _marker_lanes(spec, cts, replicated, n)
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-6, atol=1e-6,
                                   err_msg=f"like replicated={replicated}")


def _marker_jvp(spec, sample):
    """Linear in the cotangent operand: the tangent goes through the same map."""
    names, sizes, n, f = _marker_setup(spec, sample)
    ct, like = sample.args
    rng = np.random.default_rng(8)
    cts, ts = _lane_operands(ct, n, rng), _lane_operands(ct, n, rng)
    shape = tuple(sizes) + ct.shape
    _, t_out = _over_mesh(lambda c, t: fs.jvp(lambda u: f(u, like), (c,), (t,)), names,
                          sizes, 0, 0)(cts.reshape(shape), ts.reshape(shape))
    want = _marker_lanes(spec, ts, True, n)
    np.testing.assert_allclose(_lanes_np(t_out).reshape(want.shape), want, rtol=1e-9)


def _marker_transpose(spec, sample):
    """Self-adjoint: the dot-product test over all devices, with fs.vjp on each."""
    names, sizes, n, f = _marker_setup(spec, sample)
    ct, like = sample.args
    rng = np.random.default_rng(9)
    ts, cs = _lane_operands(ct, n, rng), _lane_operands(ct, n, rng)
    shape = tuple(sizes) + ct.shape
    got = _lanes_np(_over_mesh(lambda t, c: fs.vjp(lambda u: f(u, like), t)[1](c)[0], names,
                               sizes, 0, 0)(ts.reshape(shape), cs.reshape(shape)))
    lhs = float(np.sum(cs * _marker_lanes(spec, ts, True, n)))
    rhs = float(np.sum(got.reshape(ts.shape) * ts))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-9, atol=1e-9)


def _marker_spec(prim):
    return PrimitiveSpec(prim, _markers, linear_groups=((0,),), eager_error=AxisNameError,
                         custom_checks={"batching": _marker_batching, "jvp": _marker_jvp,
                                        "transpose": _marker_transpose,
                                        "jit": _marker_jit})


def _marker_jit(spec, sample):
    """The markers never reach lowering: on a virtual mesh the batching rule resolves
    them, so fs.jit of the mapped function compiles and matches eager."""
    names, sizes, n, f = _marker_setup(spec, sample)
    ct, like = sample.args
    cts = _lane_operands(ct, n, np.random.default_rng(10)).reshape(tuple(sizes) + ct.shape)
    mapped = _over_mesh(f, names, sizes, (0, None), (0, None))
    np.testing.assert_allclose(_lanes_np(fs.jit(mapped)(cts, like)),
                               _lanes_np(mapped(cts, like)), rtol=1e-6)


# ---------------------------------------------------------------------------
# shard_in / shard_out: the boundary of a multi-process shard_map
# ---------------------------------------------------------------------------
#
# They have no eager meaning outside a job (eager_error) and no virtual-mesh batching
# (their batching rule re-binds them), so their values are checked where they run:
# the Program is lowered once for EVERY rank of a simulated job (``LoweringContext``
# ``rank=``, ``mesh=``), as each process of the job would. shard_in is a static slice
# per rank: each rank's graph is compiled and run here and compared with the NumPy
# block of that rank (tests/references.py). shard_out gathers, which needs real
# communication: per rank its source must issue the same collectives and differ only
# in constants; its numerics run in tests/distributed/test_collectives_multiprocess.py.

# (global shape, mesh shape, mesh axis names, dims): the axes splitting each dimension.
BOUNDARY_CASES = [
    ((4, 3), (2,), ("i",), (("i",), ())),
    ((2, 6), (2,), ("i",), ((), ("i",))),
    ((3,), (2,), ("i",), ((),)),                      # replicated over the mesh
    ((4, 6), (2, 2), ("i", "j"), (("i",), ("j",))),   # one axis per dimension
    ((8, 3), (2, 2), ("i", "j"), (("i", "j"), ())),   # two axes on one dimension
    ((2, 4), (2, 2), ("i", "j"), ((), ("j", "i"))),   # two axes, the minor one major
    ((4, 2), (2, 2), ("i", "j"), (("j",), ())),       # split over j, replicated over i
    ((), (2, 2), ("i", "j"), ()),
]
_COLLECTIVE_CALL = re.compile(r"\b(AllReduce|AllGather|Broadcast|ReduceScatter)_\d+\(")


def _block_shape(shape, dims, mesh) -> tuple:
    return tuple(s // n for s, (_, n) in zip(shape, block_index(dims, mesh, 0)))


def _boundary(kind):
    """Samples of shard_in (operand: the global value) or shard_out (operand: a block)."""
    def samples(rng, dt):
        out = []
        for shape, mesh_shape, names, dims in BOUNDARY_CASES:
            mesh = fs.Mesh(mesh_shape, names)
            if kind == "shard_out":
                shape = _block_shape(shape, dims, mesh)
            out.append(Sample((values(rng, shape, dt),), {"dims": dims, "mesh": mesh}))
        return out

    return samples


def _staged(fn, args):
    """``fn(*tracers) -> list`` staged once on the types of ``args``."""
    from fshard.core import staging

    return staging.stage(fn, [typeof(a) for a in args])


def _per_rank_sources(program, consts, mesh) -> list:
    """``(source, globals)`` of ``program`` lowered for each rank of a job on ``mesh``."""
    from fshard.backend import mindspore as backend

    return [backend.lower_program(program, consts, name=f"rank{r}", rank=r, mesh=mesh)[:2]
            for r in range(mesh.size)]


def _run_per_rank(program, consts, mesh, *args) -> list[list[np.ndarray]]:
    """Every rank's outputs of a Program without communication, each rank's graph
    compiled and run in this process."""
    from fshard.backend import mindspore as backend

    out = []
    for r, (src, globals_) in enumerate(_per_rank_sources(program, consts, mesh)):
        assert not _COLLECTIVE_CALL.findall(src), f"rank {r} communicates:\n{src}"
        res = backend.compile_source(src, globals_, f"rank{r}")(
            *[backend.as_tensor(a) for a in args])
        out.append([_lanes_np(o) for o in _as_list(res)])
    return out


def _assert_same_collectives(program, consts, mesh, expected: int) -> None:
    """Every rank issues the same ``expected`` collectives, in the same order, and the
    ranks' sources differ only in constants (numbers)."""
    sources = [src for src, _ in _per_rank_sources(program, consts, mesh)]
    sequences = [_COLLECTIVE_CALL.findall(s) for s in sources]
    assert len(sequences[0]) == expected, sources[0]
    assert all(seq == sequences[0] for seq in sequences), sequences
    masked = [re.sub(r"\d+|True|False", "#", s) for s in sources]
    assert all(m == masked[0] for m in masked), sources


def _n_split(dims) -> int:
    return sum(1 for axes in dims if axes)


def _boundary_jit(spec, sample):
    """Lowering, rank by rank: shard_in runs as each rank's static slice; shard_out
    issues the same gathers on every rank (one per split dimension)."""
    (x,), p = sample.args, sample.params
    mesh = p["mesh"]
    program, consts = _staged(lambda v: [spec.apply(v, **p)], (x,))
    if spec.name == "shard_out":
        _assert_same_collectives(program, consts, mesh, _n_split(p["dims"]))
        return
    for r, (got,) in enumerate(_run_per_rank(program, consts, mesh, x)):
        want = shard_in_block(x, dims=p["dims"], mesh=mesh, rank=r)
        assert got.shape == want.shape, f"rank {r}: {got.shape} vs {want.shape}"
        np.testing.assert_array_equal(got, want, err_msg=f"rank {r}'s block")


def _boundary_batching(spec, sample):
    """The rule re-binds with a leading unsplit dimension: for every placement of the
    batch dim (and none), the staged output's type, and for shard_in each rank's
    values (lowered and run) against the per-example NumPy blocks."""
    from fshard import rules
    from fshard.core.interpret import AxisData
    from fshard.core.interpret import batching_axis as _axis

    (x,), p = sample.args, sample.params
    mesh, dims = p["mesh"], p["dims"]
    rule = rules.batching.lookup(spec.prim, transform="test")
    examples = [x, (2 * x + 1).astype(x.dtype), (-x).astype(x.dtype)]
    want_type = out_types(spec.prim, (x,), p)[0]
    for d in [None] + list(range(x.ndim + 1)):
        xb = x if d is None else np.stack(examples, axis=d)
        out_dims = []

        def batched(v):
            with _axis(AxisData(None, len(examples))):
                outs, od = rule([v], [d], **p)
            out_dims.extend(od)
            return outs

        program, consts = _staged(batched, (xb,))
        got_type = program.outputs[0].aval
        if d is None:
            assert out_dims == [None] and got_type == want_type, (d, out_dims, got_type)
            continue
        assert out_dims == [0], f"in dim {d}: out dim {out_dims}"
        assert got_type == ArrayType((len(examples),) + want_type.shape, want_type.dtype), (
            f"in dim {d}: {got_type}")
        eq = program.equations[-1]
        assert eq.prim is spec.prim and eq.params["dims"] == ((),) + tuple(dims), eq
        if spec.name == "shard_out":
            _assert_same_collectives(program, consts, mesh, _n_split(dims))
            continue
        for r, (got,) in enumerate(_run_per_rank(program, consts, mesh, xb)):
            want = np.stack([shard_in_block(e, dims=dims, mesh=mesh, rank=r)
                             for e in examples])
            np.testing.assert_array_equal(got, want, err_msg=f"in dim {d}, rank {r}")


def _boundary_jvp(spec, sample):
    """Linear: the tangent goes through the same primitive (shard_in: run per rank)."""
    from fshard import rules

    (x,), p = sample.args, sample.params
    mesh, dims = p["mesh"], p["dims"]
    t = np.random.default_rng(11).standard_normal(x.shape).astype(x.dtype)
    rule = rules.jvp.lookup(spec.prim, transform="test")
    program, consts = _staged(lambda v, w: [o for outs in rule([v], [w], **p) for o in outs],
                              (x, t))
    want_type = out_types(spec.prim, (x,), p)[0]
    assert [o.aval for o in program.outputs] == [want_type, want_type]
    if spec.name == "shard_out":
        assert [e.prim for e in program.equations] == [spec.prim] * 2, program.equations
        assert all(e.params == p for e in program.equations)
        return
    for r, (out, t_out) in enumerate(_run_per_rank(program, consts, mesh, x, t)):
        np.testing.assert_array_equal(out, shard_in_block(x, dims=dims, mesh=mesh, rank=r))
        np.testing.assert_array_equal(t_out, shard_in_block(t, dims=dims, mesh=mesh, rank=r))


def _boundary_transpose(spec, sample):
    """Dot-product test summed over the ranks of the simulated job.

    shard_in^T (gathers and psums: it communicates) runs on a virtual mesh of the
    same axes, every rank with its own block cotangent ct_r; each rank must get the
    full cotangent sum_r place_r(ct_r) (NumPy), and <x, that> == sum_r <ct_r,
    block_r(x)>. shard_out^T (a static slice and a division by the replica count) is
    lowered per rank and run: rank r gets block_r(ct) / replicas, and
    sum_r <ct^T_r, b_r> == <ct, shard_out(b)> for consistent blocks b_r.
    """
    from fshard import rules
    from fshard.primitives.base import UndefinedPrimal

    (x,), p = sample.args, sample.params
    mesh, dims = p["mesh"], p["dims"]
    x = x.astype(np.float64)
    rule = rules.transpose.lookup(spec.prim, transform="test")
    rng = np.random.default_rng(12)
    out_type = out_types(spec.prim, (x,), p)[0]
    undefined = UndefinedPrimal(typeof(x))
    # the transposed cotangent has the operand's type
    program, _ = _staged(lambda c: rule(c, undefined, **p), (np.zeros(out_type.shape),))
    assert program.outputs[0].aval == typeof(x), program.outputs[0].aval
    if spec.name == "shard_in":
        cts = rng.standard_normal((mesh.size,) + out_type.shape)
        f = lambda c: rule(c, undefined, **p)[0]  # noqa: E731
        for k in reversed(range(mesh.ndim)):
            f = fs.vmap(f, axis_name=mesh.axis_names[k], axis_size=mesh.shape[k])
        got = _lanes_np(f(cts.reshape(tuple(mesh.shape) + out_type.shape)))
        got = got.reshape((mesh.size,) + x.shape)
        want = shard_in_transpose(list(cts), dims=dims, mesh=mesh)
        for r in range(mesh.size):
            np.testing.assert_allclose(got[r], want, rtol=1e-12, atol=1e-12,
                                       err_msg=f"rank {r}'s cotangent")
        lhs = sum(float(np.sum(c * shard_in_block(x, dims=dims, mesh=mesh, rank=r)))
                  for r, c in enumerate(cts))
        np.testing.assert_allclose(lhs, float(np.sum(got[0] * x)), rtol=1e-12)
        return
    ct = rng.standard_normal(out_type.shape)
    program, consts = _staged(lambda c: rule(c, undefined, **p), (ct,))
    got = [o for (o,) in _run_per_rank(program, consts, mesh, ct)]
    replicas = mesh.size // int(np.prod([n for _, n in block_index(dims, mesh, 0)]))
    g = shard_out_global([x] * mesh.size, dims=dims, mesh=mesh)
    blocks = [shard_in_block(g, dims=dims, mesh=mesh, rank=r) for r in range(mesh.size)]
    for r in range(mesh.size):
        np.testing.assert_allclose(got[r], shard_in_block(ct, dims=dims, mesh=mesh, rank=r)
                                   / replicas, rtol=1e-12, err_msg=f"rank {r}")
    rhs = sum(float(np.sum(c * b)) for c, b in zip(got, blocks))
    np.testing.assert_allclose(float(np.sum(ct * g)), rhs, rtol=1e-12)


def _boundary_spec(prim):
    """shard_in / shard_out, checked on a 1-D mesh of 2 and a (2, 2) mesh. Type rule:
    vs the NumPy block (gathered value) shapes. Eager: AxisNameError. Lowering: per
    rank; shard_in's graphs run here, shard_out's need real communication, so only
    their collective sequence is checked here and their numerics in
    tests/distributed/test_collectives_multiprocess.py."""
    return PrimitiveSpec(prim, _boundary(prim.name), (F32, I32), linear_groups=((0,),),
                         eager_error=AxisNameError, jit_samples=None, custom_checks={
                             "jit": _boundary_jit, "batching": _boundary_batching,
                             "jvp": _boundary_jvp, "transpose": _boundary_transpose})


ONE, TWO = (("i",), (3,)), (("i", "j"), (2, 2))
_REDUCE_CASES = [((2, 3), *ONE, {}), ((), ("i",), (2,), {}), ((4,), *TWO, {})]


# ---------------------------------------------------------------------------
# The specs
# ---------------------------------------------------------------------------

NUMERIC = (F32, I32)
DATA = (F32, I32, BOOL)  # structural primitives move any dtype
# Primitives whose samples each take a different path through the rules.
THOROUGH = dict(jit_samples=2, rule_samples=None)


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


# debug_callback: no outputs; it calls its callback with the operands (NumPy arrays),
# in fs.jit too, and once per example under batching.


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *arrays):
        self.calls.append([np.array(a) for a in arrays])

    def __repr__(self):  # test ids must not depend on addresses (pytest-xdist collects twice)
        return "recorder"


def _debug_callback(rng, dt):
    return [Sample((values(rng, (2, 3), dt), values(rng, (), dt)), {"callback": _Recorder()})]


def _debug_jit(spec, sample):
    rec = _Recorder()
    f = fs.jit(lambda *xs: (debug_callback_p.bind(*xs, callback=rec), xs[0] + xs[0])[1])
    fs.block_until_ready(f(*sample.args))
    assert len(rec.calls) == 1
    for got, want in zip(rec.calls[0], sample.args, strict=True):
        np.testing.assert_array_equal(got, want)


def _debug_batching(spec, sample):
    rec = _Recorder()
    x, y = sample.args
    rules.batching.lookup(debug_callback_p, transform="test")(
        [x, y], [1, None], callback=rec)  # binds the per-example callback eagerly
    assert len(rec.calls) == x.shape[1]
    for i, (xi, yi) in enumerate(rec.calls):
        np.testing.assert_array_equal(xi, x[:, i])
        np.testing.assert_array_equal(yi, y)


# after(x, dep): x, once dep is computed; linear in both, dep's cotangent an
# instantiated zero. keep(dep): no outputs, an effect; differentiating it is refused.


def _after(rng, dt):
    return [Sample((values(rng, shape, dt), values(rng, (2, 1), dt)), {})
            for shape in ((), (3,), (2, 3))]


def _keep(rng, dt):
    return [Sample((values(rng, (2, 3), dt),), {"refusal": "refused here.\nFix: none."})]


def _keep_jit(spec, sample):
    f = fs.jit(lambda x: (K.keep_p.bind(x, **sample.params), x + x)[1])
    x = sample.args[0]
    np.testing.assert_array_equal(f(x).asnumpy(), np.asarray(x + x))
    assert "keep" in str(fs.make_ir(lambda x: (K.keep_p.bind(x, **sample.params), x)[1])(
        *sample.args))


def _keep_batching(spec, sample):
    with pytest.raises(fs.errors.FshardError, match="never batched"):
        fs.vmap(lambda x: (K.keep_p.bind(x, **sample.params), x)[1])(sample.args[0])


def _keep_jvp(spec, sample):
    x = sample.args[0].astype(np.float32)
    with pytest.raises(fs.errors.UnsupportedOpError, match="refused here"):
        fs.jvp(lambda v: (K.keep_p.bind(v, **sample.params), v)[1], (x,), (x,))


def _specs() -> list[PrimitiveSpec]:
    def float_unary(prim, kind="any", **kw):
        return PrimitiveSpec(prim, unary(kind), **kw)

    out = [
        PrimitiveSpec(E.neg_p, unary(), NUMERIC, linear_groups=((0,),)),
        float_unary(E.exp_p),
        float_unary(E.log_p, "positive"),
        float_unary(E.tanh_p),
        float_unary(E.sigmoid_p),
        PrimitiveSpec(E.relu_p, unary(), NUMERIC),
        float_unary(E.sqrt_p, "positive"),
        float_unary(E.rsqrt_p, "positive"),
        float_unary(E.reciprocal_p, "positive"),
        PrimitiveSpec(E.abs_p, unary(), NUMERIC),
        float_unary(E.sin_p),
        float_unary(E.cos_p),
        float_unary(E.erf_p),
        float_unary(E.erfc_p),
        PrimitiveSpec(E.sign_p, unary(), NUMERIC, zero_derivative=True),
        float_unary(E.floor_p, zero_derivative=True),
        float_unary(E.round_p, zero_derivative=True),
        PrimitiveSpec(E.gelu_p, _gelu),
        float_unary(E.log1p_p, "positive"),
        float_unary(E.expm1_p),
        PrimitiveSpec(E.atan2_p, binary(), (F32,), (0, 1)),
        PrimitiveSpec(E.floor_div_p, binary("any", "positive"), NUMERIC, (0, 1),
                      zero_derivative=True),
        PrimitiveSpec(E.floor_mod_p, binary("any", "positive"), NUMERIC, (0, 1)),
        PrimitiveSpec(SC.cumsum_p, _running, NUMERIC, linear_groups=((0,),), **THOROUGH),
        PrimitiveSpec(SC.cumprod_p, _cumprod, (F32,), **THOROUGH),
        PrimitiveSpec(SC.sort_p, _sort, (F32,), **THOROUGH),
        PrimitiveSpec(CV.conv2d_p, _conv, (F32,), (0, 1), ((0,), (1,)), tol=(1e-5, 1e-5),
                      **THOROUGH),
        PrimitiveSpec(CV.conv2d_input_grad_p, _conv_input_grad, (F32,), (0, 1), ((0,), (1,)),
                      tol=(1e-5, 1e-5), **THOROUGH),
        PrimitiveSpec(CV.conv2d_filter_grad_p, _conv_filter_grad, (F32,), (0, 1),
                      ((0,), (1,)), tol=(1e-5, 1e-5), **THOROUGH),
        PrimitiveSpec(CV.max_pool2d_p, _pool, (F32,), **THOROUGH),
        PrimitiveSpec(CV.max_pool2d_argmax_p, _pool, (F32,), **THOROUGH),
        PrimitiveSpec(CV.avg_pool2d_p, _pool, (F32,), linear_groups=((0,),), **THOROUGH),
        PrimitiveSpec(CV.pool_gather_p, _pool_gather, (F32,), linear_groups=((0,),),
                      **THOROUGH),
        PrimitiveSpec(CV.pool_scatter_p, _pool_scatter, (F32,), linear_groups=((0,),),
                      **THOROUGH),
        # mean/var are x's statistics: a derivative in x accounts for them, so x is
        # differentiated through batch_norm_train (tests/test_native_norms.py checks
        # the second order against finite differences)
        PrimitiveSpec(N.batch_norm_train_p, _bn_train, (F32,), (0, 1, 2), tol=(1e-5, 1e-5),
                      **THOROUGH),
        PrimitiveSpec(N.batch_norm_tangent_p, _bn_tangent, (F32,), (1, 4, 5, 6),
                      ((4, 5, 6),), tol=(1e-4, 1e-5), **THOROUGH),
        PrimitiveSpec(N.batch_norm_grad_p, _bn_grad, (F32,), (1, 4), ((4,),),
                      tol=(1e-4, 1e-5), **THOROUGH),
        PrimitiveSpec(OPT.adam_update_p, _adam_update, (F32,), tol=(1e-5, 1e-7), **THOROUGH),
        PrimitiveSpec(E.add_p, binary(), NUMERIC, (0, 1), ((0, 1),)),
        PrimitiveSpec(E.sub_p, binary(), NUMERIC, (0, 1), ((0, 1),)),
        PrimitiveSpec(E.mul_p, binary(), NUMERIC, (0, 1), ((0,), (1,))),
        PrimitiveSpec(E.div_p, binary("any", "positive"), (F32,), (0, 1), ((0,),)),
        PrimitiveSpec(E.pow_p, binary("positive", "unit"), (F32,), (0, 1)),
        PrimitiveSpec(E.integer_pow_p, _integer_pow, (F32,), rule_samples=None,
                      jit_samples=None),
        PrimitiveSpec(E.maximum_p, binary(), NUMERIC, (0, 1)),
        PrimitiveSpec(E.minimum_p, binary(), NUMERIC, (0, 1)),
        PrimitiveSpec(E.clamp_p, _clamp, NUMERIC, (0, 1, 2)),
        PrimitiveSpec(E.relu6_p, _wide(4.0)),
        PrimitiveSpec(E.relu6_tangent_p, _tangent(4.0), (F32,), (0,), ((0,),)),
        PrimitiveSpec(E.hardswish_tangent_p, _tangent(3.0), (F32,), (0, 1), ((0,),)),
        PrimitiveSpec(E.hardsigmoid_p, _wide(3.0)),
        PrimitiveSpec(E.hardswish_p, _wide(3.0)),
    ]
    for prim in (E.bitwise_and_p, E.bitwise_or_p, E.bitwise_xor_p):
        out.append(PrimitiveSpec(prim, binary(), (I32, np.uint32, BOOL), ()))
    for prim in (E.shift_left_p, E.shift_right_p):
        out.append(PrimitiveSpec(prim, binary("any", "shift"), (np.uint32, I32), ()))
    for prim in (E.equal_p, E.not_equal_p, E.less_p, E.less_equal_p, E.greater_p,
                 E.greater_equal_p):
        out.append(PrimitiveSpec(prim, binary(), NUMERIC, (0, 1), zero_derivative=True))
    out += [
        PrimitiveSpec(E.select_p, _select, NUMERIC, (1, 2), ((1, 2),)),
        PrimitiveSpec(E.cast_p, _cast, NUMERIC, linear_groups=((0,),)),
        PrimitiveSpec(L.matmul_p, _matmul, NUMERIC, (0, 1), ((0,), (1,))),
        PrimitiveSpec(S.broadcast_to_p, _broadcast_to, DATA, linear_groups=((0,),)),
        PrimitiveSpec(S.reshape_p, _reshape, DATA, linear_groups=((0,),)),
        PrimitiveSpec(S.transpose_p, _transpose, DATA, linear_groups=((0,),)),
        PrimitiveSpec(S.full_p, _full, (F32,), diff_argnums=()),
        PrimitiveSpec(S.stop_gradient_p, unary(), DATA, zero_derivative=True),
        PrimitiveSpec(PL.pipeline_split_p, unary(), DATA, linear_groups=((0,),)),
        PrimitiveSpec(debug_callback_p, _debug_callback, DATA, diff_argnums=(),
                      custom_checks={"jit": _debug_jit, "batching": _debug_batching}),
        PrimitiveSpec(S.concat_p, _concat, DATA, (0, 1, 2), (ALL,), **THOROUGH),
        PrimitiveSpec(S.split_p, _split, DATA, linear_groups=((0,),), **THOROUGH),
        PrimitiveSpec(S.slice_p, _slice, DATA, linear_groups=((0,),), **THOROUGH),
        PrimitiveSpec(S.pad_p, _pad, DATA, linear_groups=((0,),), **THOROUGH),
        PrimitiveSpec(S.gather_p, _gather, DATA, linear_groups=((0,),), **THOROUGH),
        PrimitiveSpec(S.scatter_add_p, _scatter_add, NUMERIC, linear_groups=((0,),), **THOROUGH),
        PrimitiveSpec(S.one_hot_p, _one_hot, (F32,), diff_argnums=(), **THOROUGH),
        PrimitiveSpec(R.reduce_sum_p, _reduce, NUMERIC, linear_groups=((0,),)),
        PrimitiveSpec(R.lane_sum_p, _reduce, NUMERIC, linear_groups=((0,),)),
        PrimitiveSpec(R.reduce_max_p, _reduce, NUMERIC),
        PrimitiveSpec(R.reduce_min_p, _reduce, NUMERIC),
        PrimitiveSpec(R.argmax_p, _arg, (F32,), zero_derivative=True),
        PrimitiveSpec(R.argmin_p, _arg, (F32,), zero_derivative=True),
        PrimitiveSpec(SC.extremum_with_index_p, _with_index, (F32, I32)),
        PrimitiveSpec(R.dim_size_p, _dim_size, (F32,), zero_derivative=True),
        PrimitiveSpec(N.bias_add_p, _bias_add, (F32,), (0, 1), ((0, 1),)),
        PrimitiveSpec(N.softmax_p, _softmax, tol=(1e-5, 1e-5)),
        PrimitiveSpec(N.log_softmax_p, _softmax, tol=(1e-5, 1e-5)),
        # Call primitives (control)
        PrimitiveSpec(C.custom_jvp_call_p, _custom_jvp_call, rule_samples=None,
                      jit_samples=2),
        PrimitiveSpec(C.custom_vjp_call_p, _custom_vjp_call, rule_samples=None,
                      jit_samples=2, forward_mode=False),
        PrimitiveSpec(G.ms_op_p, _ms_op, linear_groups=(PER_SAMPLE,), jit_samples=2),
        PrimitiveSpec(C.custom_lin_p, _custom_lin, diff_argnums=(), linear_groups=(PER_SAMPLE,),
                      eager_error=DifferentiationError,
                      custom_checks={"batching": _custom_lin_batching}),
        PrimitiveSpec(CF.while_p, _while, rule_samples=3, jit_samples=2,
                      custom_checks={"vjp": _while_vjp}),
        PrimitiveSpec(CF.cond_p, _cond, rule_samples=3, jit_samples=3,
                      linear_groups=(PER_SAMPLE,)),
        PrimitiveSpec(C.scan_p, _scan, rule_samples=3, jit_samples=2,
                      linear_groups=(PER_SAMPLE,)),
        PrimitiveSpec(RM.remat_call_p, _remat_call, rule_samples=None, jit_samples=2,
                      linear_groups=(PER_SAMPLE,)),
        PrimitiveSpec(RM.checkpoint_name_p, _checkpoint_name, DATA, linear_groups=((0,),)),
        PrimitiveSpec(RM.remat_barrier_p, _remat_barrier, diff_argnums=(0, 1, 2)),
        # Per-device primitives (spmd)
        PrimitiveSpec(P.layout_constraint_p, _layout_constraint, DATA, linear_groups=((0,),)),
        PrimitiveSpec(P.block_slice_p, _block_slice, eager_error=AxisNameError,
                      linear_groups=((0,),), custom_checks={
                          "batching": _block_slice_batching, "jvp": _block_slice_jvp,
                          "transpose": _block_slice_transpose}),
        # fs.shard's call primitive
        PrimitiveSpec(_shard_call_p(), _shard_call, diff_argnums=(0, 1),
                      linear_groups=(PER_SAMPLE,), rule_samples=None, tol=(1e-4, 1e-4)),
        # Collectives
        _collective_spec(K.psum_p, _REDUCE_CASES),
        _collective_spec(K.pmean_p, _REDUCE_CASES),
        _collective_spec(K.pmax_p, _REDUCE_CASES, linear=False),
        _collective_spec(K.pmin_p, _REDUCE_CASES, linear=False),
        _collective_spec(K.all_gather_p, [((2, 3), *ONE, {"axis": 0}),
                                          ((2, 3), ("i",), (2,), {"axis": 1}),
                                          ((1, 2), *TWO, {"axis": 1})]),
        _collective_spec(K.psum_scatter_p, [((6, 2), *ONE, {"scatter_dimension": 0}),
                                            ((2, 4), ("i",), (2,), {"scatter_dimension": 1}),
                                            ((4,), *TWO, {"scatter_dimension": 0})]),
        _collective_spec(K.all_to_all_p, [((6, 2), *ONE, {"split_axis": 0, "concat_axis": 1}),
                                          ((2, 4), ("i",), (2,),
                                           {"split_axis": 1, "concat_axis": 0}),
                                          ((4, 2), *TWO, {"split_axis": 0, "concat_axis": 0})]),
        _collective_spec(K.ppermute_p, [((2, 3), *ONE, {"perm": ((0, 1), (1, 2), (2, 0))}),
                                        ((3,), *ONE, {"perm": ((0, 1),)}),
                                        ((2,), *TWO, {"perm": ((0, 3), (3, 0), (1, 2))})]),
        _collective_spec(K.broadcast_p, [((2, 3), *ONE, {"root": 1}),
                                         ((), ("i",), (2,), {"root": 0}),
                                         ((3,), *TWO, {"root": 2})]),
        _collective_spec(K.axis_index_p, [(None, *ONE, {}), (None, ("i", "j"), (2, 3), {})],
                         linear=False, differentiable=False),
        PrimitiveSpec(K.after_p, _after, DATA, diff_argnums=(0, 1), linear_groups=(ALL,)),
        PrimitiveSpec(K.keep_p, _keep, DATA, diff_argnums=(), custom_checks={
            "jit": _keep_jit, "batching": _keep_batching, "jvp": _keep_jvp}),
        _marker_spec(K.replica_sum_p),
        _marker_spec(K.replica_split_p),
        _boundary_spec(K.shard_in_p),
        _boundary_spec(K.shard_out_p),
    ]
    return out


SPECS: dict[str, PrimitiveSpec] = {}
for _spec in _specs():
    assert _spec.name not in SPECS, f"two specs for {_spec.name}"
    SPECS[_spec.name] = _spec


def out_types(prim: Primitive, args, params) -> list[ArrayType]:
    """The abstract output types the primitive's type rule gives for ``args``."""
    from fshard.rules import abstract_eval

    return abstract_eval.lookup(prim, transform="test")(*[typeof(a) for a in args], **params)
