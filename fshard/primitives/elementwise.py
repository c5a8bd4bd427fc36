"""Elementwise primitives: unary math, binary arithmetic, comparisons, select, cast.

Binary primitives take operands of one shape and dtype; the op functions here
(``add``, ``mul``, ...) promote dtypes and broadcast first, as ``mindspore.ops`` does,
so the IR shows every broadcast explicitly.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from mindspore import ops
from mindspore.common import dtype as mstype

from fshard.backend.mindspore import hard_activation_grad_classes
from fshard.core import dtypes
from fshard.core.array_types import Array, ArrayLike, Bool, Float, Shaped
from fshard.core.tracing import ArrayType, typeof
from fshard.errors import ProgramTypeError
from fshard.primitives.base import (  # noqa: F401  (add, broadcast_shapes: re-exported)
    Zero,
    _binary_type,
    _numeric_binary_type,
    _same_types,
    add_p,
    broadcast_shapes,
    broadcast_to,
    broadcasting,
    def_primitive,
    defjvp,
    deflinear,
    full,
    is_undefined,
    vectorized,
    zeros,
)
from fshard.core.rules import batching, sharding, transpose, unsupported
from fshard.core.factors import elementwise_spec

FAMILY = "elementwise"

# ---------------------------------------------------------------------------
# Operand preparation for op functions: promotion and broadcasting
# ---------------------------------------------------------------------------


def _is_weak(x) -> bool:
    # NumPy scalars (np.float64 subclasses float) carry their dtype: they are strong.
    return isinstance(x, (bool, int, float)) and not isinstance(x, np.generic)


def _scalar_kind(x, numpy_weak: bool):
    """``bool``, ``int`` or ``float`` for a weakly typed scalar operand, else None."""
    if isinstance(x, np.generic):
        # MindSpore's Tensor operators treat a NumPy bool, integer or float scalar as the
        # Python scalar of that kind (Tensor(f32) + np.float64(2) is float32), but only
        # next to an array: between NumPy scalars alone their own dtypes decide.
        if not numpy_weak:
            return None
        x = x.item() if isinstance(x, (np.bool_, np.integer, np.floating)) else None
    if isinstance(x, bool):
        return bool
    if isinstance(x, int):
        return int
    if isinstance(x, float):
        return float
    return None


def promote(*xs):
    """Promote operands to one dtype (Python scalars, and NumPy scalars next to an array,
    are weakly typed) and broadcast them to one shape. Returns fshard values (Tracers,
    Tensors or NumPy scalars)."""
    numpy_weak = any(not isinstance(x, (bool, int, float, complex, np.generic)) for x in xs)
    kinds = [_scalar_kind(x, numpy_weak) for x in xs]
    strong = [typeof(x).dtype for x, k in zip(xs, kinds) if k is None]
    weak_float = float in kinds
    weak_int = int in kinds
    # As MindSpore: a Python float makes an integer or bool result float32, and a Python
    # int makes a bool result int64; otherwise the tensors' dtype wins.
    dt = dtypes.result_type(*strong) if strong else dtypes.bool_
    if weak_float and not dtypes.is_float(dt):
        dt = dtypes.float32
    elif weak_int and dt == dtypes.bool_:
        dt = dtypes.int64
    shape = broadcast_shapes(*[() if k is not None else tuple(typeof(x).shape)
                               for x, k in zip(xs, kinds)])
    out = []
    for x, k in zip(xs, kinds):
        if k is not None:
            x = dtypes.to_numpy(dt).type(x)
        elif typeof(x).dtype != dt:
            x = cast(x, dt)
        if tuple(typeof(x).shape) != shape:
            x = broadcast_to(x, shape)
        out.append(x)
    return out


# ---------------------------------------------------------------------------
# Type rules
# ---------------------------------------------------------------------------


def _unary_type(x: ArrayType, **_) -> ArrayType:
    return x


def _float_unary_type(name):
    def rule(x: ArrayType, **_) -> ArrayType:
        if not dtypes.is_float(x.dtype):
            raise ProgramTypeError(f"{name} needs a float operand, got {x}")
        return x

    return rule


def _compare_type(name):
    return lambda x, y, **_: ArrayType(_same_types(name, x, y).shape, dtypes.bool_)


def _elementwise_sharding(*avals, **params):
    """Every operand and the output share one factor per dimension."""
    return elementwise_spec(*avals)


# ---------------------------------------------------------------------------
# Unary math
# ---------------------------------------------------------------------------


def def_unary(name, ms_fn, jvp_rule, float_only=True):
    """A unary elementwise primitive with vectorized batching and a JVP rule."""
    rule = _float_unary_type(name) if float_only else _unary_type
    prim = def_primitive(name, FAMILY, rule, ms_fn)
    batching.set(prim, vectorized(prim))
    defjvp(prim, jvp_rule)
    sharding.set(prim, _elementwise_sharding)
    unsupported(prim, "transpose", "not linear")
    return prim


def _ms_neg(x):
    return ops.neg(x)


def _ms_exp(x):
    return ops.exp(x)


def _ms_log(x):
    return ops.log(x)


def _ms_tanh(x):
    return ops.tanh(x)


def _ms_sigmoid(x):
    return ops.sigmoid(x)


def _ms_relu(x):
    return ops.relu(x)


def _ms_gelu(x, approximate):
    return ops.gelu(x, approximate)


def _ms_sqrt(x):
    return ops.sqrt(x)


def _ms_rsqrt(x):
    return ops.rsqrt(x)


def _ms_reciprocal(x):
    return ops.reciprocal(x)


def _ms_abs(x):
    return ops.abs(x)


def _ms_sign(x):
    return ops.sign(x)


def _ms_sin(x):
    return ops.sin(x)


def _ms_cos(x):
    return ops.cos(x)


def _ms_erf(x):
    return ops.erf(x)


def _ms_erfc(x):
    return ops.erfc(x)


neg_p = def_primitive("neg", FAMILY, _unary_type, _ms_neg)
batching.set(neg_p, vectorized(neg_p))
sharding.set(neg_p, _elementwise_sharding)
deflinear(neg_p, lambda ct, x: [neg(ct)])

exp_p = def_unary("exp", _ms_exp, lambda t, ans, x: mul(t, ans))
log_p = def_unary("log", _ms_log, lambda t, ans, x: div(t, x))
tanh_p = def_unary("tanh", _ms_tanh, lambda t, ans, x: mul(t, sub(1.0, mul(ans, ans))))
sigmoid_p = def_unary("sigmoid", _ms_sigmoid,
                      lambda t, ans, x: mul(t, mul(ans, sub(1.0, ans))))
relu_p = def_unary("relu", _ms_relu,
                   lambda t, ans, x: mul(t, cast(greater(x, 0.0), typeof(x).dtype)),
                   float_only=False)
sqrt_p = def_unary("sqrt", _ms_sqrt, lambda t, ans, x: div(t, mul(2.0, ans)))
rsqrt_p = def_unary("rsqrt", _ms_rsqrt,
                    lambda t, ans, x: mul(t, mul(-0.5, div(ans, x))))
# Its own kernel, not 1 / x: MindSpore's Div kernel gives 1 / -0.0 as +inf (the sign of
# a zero divisor is lost), its Reciprocal -inf, as IEEE and MindSpore's ``1 / x`` do.
reciprocal_p = def_unary("reciprocal", _ms_reciprocal,
                         lambda t, ans, x: mul(t, neg(mul(ans, ans))))
abs_p = def_unary("abs", _ms_abs, lambda t, ans, x: mul(t, sign(x)), float_only=False)
sin_p = def_unary("sin", _ms_sin, lambda t, ans, x: mul(t, cos(x)))
cos_p = def_unary("cos", _ms_cos, lambda t, ans, x: mul(t, neg(sin(x))))
erf_p = def_unary("erf", _ms_erf,
                  lambda t, ans, x: mul(t, mul(2.0 / math.sqrt(math.pi), exp(neg(mul(x, x))))))
# erfc = 1 - erf, accurate where erf is near 1 (the tails of an inverse normal CDF)
erfc_p = def_unary("erfc", _ms_erfc,
                   lambda t, ans, x: mul(t, mul(-2.0 / math.sqrt(math.pi), exp(neg(mul(x, x))))))

# The hard activations. Their derivatives at the kinks are MindSpore's (relu6: 0 at 0, 1
# at 6; hardswish: -0.5 at -3, 1.5 at 3; hardsigmoid: 0 at both ends): rules of their
# own give them to the JVP only, so the forward is MindSpore's kernel alone. The kernels,
# not a faster composite: relu6(x + 3) / 6 takes 1.8 ms over 1M float32 elements against
# HSigmoid's 5.5 ms, but gives 0 at NaN where HSigmoid gives NaN, and x * relu6(x + 3) / 6
# gives NaN at -inf where HSwish gives 0 (docs/performance.md, "The clamps").


def _ms_relu6(x):
    if x.dtype == mstype.float64:  # ReLU6 has no float64 kernel
        return ops.minimum(ops.maximum(x, 0.0), 6.0)
    return ops.relu6(x)


def _ms_hardsigmoid(x):
    return ops.hardsigmoid(x)


def _ms_hardswish(x):
    return ops.hardswish(x)


def _where_t(mask, t):
    """``t`` where ``mask``, else 0: linear in ``t``."""
    return select(mask, t, zeros_like(t))


def _hardsigmoid_jvp(t, ans, x):
    # as MindSpore's HSigmoidGrad: 1/6 unless x <= -3 or x >= 3 (so 1/6 at NaN)
    outside = bitwise_or(less_equal(x, -3.0), greater_equal(x, 3.0))
    return mul(t, where(outside, 0.0, 1.0 / 6.0))


relu6_p = def_unary("relu6", _ms_relu6, lambda t, ans, x: relu6_tangent_p.bind(t, x))
hardsigmoid_p = def_unary("hardsigmoid", _ms_hardsigmoid, _hardsigmoid_jvp)
hardswish_p = def_unary("hardswish", _ms_hardswish,
                        lambda t, ans, x: hardswish_tangent_p.bind(t, x))

# The tangents of relu6 and hardswish, t times the derivative at x: MindSpore's ReLU6Grad
# and HSwishGrad kernels, 0.6 and 4.3 ms over 1M float32 values against 5.8 ms for
# relu6's comparisons and select and 11 ms for hardswish's composite. Linear in t.
_ReLU6Grad, _HSwishGrad = hard_activation_grad_classes()


def _ms_relu6_tangent(t, x):
    if t.dtype == mstype.float64:  # ReLU6Grad rounds float64 to float32
        return ops.select(ops.logical_and(x > 0.0, x <= 6.0), t, ops.zeros_like(t))
    return _ReLU6Grad()(t, x)


def _ms_hardswish_tangent(t, x):
    return _HSwishGrad()(t, x)


def _def_tangent(name, ms_fn, second):
    """``prim(t, x)``: linear in ``t`` (its own transpose); ``second(t_x, t, x)`` is its
    derivative in ``x`` (None: zero, the derivative being piecewise constant)."""
    prim = def_primitive(name, FAMILY, _binary_type(name), ms_fn)
    batching.set(prim, broadcasting(prim))
    sharding.set(prim, _elementwise_sharding)
    defjvp(prim, lambda tt, ans, t, x: prim.bind(tt, x),
           None if second is None else (lambda tx, ans, t, x: second(tx, t, x)))
    transpose.set(prim, lambda ct, t, x: [prim.bind(ct, x), None])
    return prim


relu6_tangent_p = _def_tangent("relu6_tangent", _ms_relu6_tangent, None)
# hardswish'' = 1/3 on (-3, 3)
hardswish_tangent_p = _def_tangent("hardswish_tangent", _ms_hardswish_tangent,
                                   lambda tx, t, x: mul(mul(tx, t), where(
                                       bitwise_and(greater(x, -3.0), less(x, 3.0)),
                                       1.0 / 3.0, 0.0)))

sign_p = def_primitive("sign", FAMILY, _unary_type, _ms_sign)
batching.set(sign_p, vectorized(sign_p))
sharding.set(sign_p, _elementwise_sharding)
defjvp(sign_p, None)  # piecewise constant: zero derivative
unsupported(sign_p, "transpose", "not linear")


def _ms_floor(x):
    return ops.floor(x)


def _ms_round(x):
    return ops.round(x)  # half to even, as NumPy


def _def_step(name, ms_fn):
    """A piecewise-constant float primitive (floor, round): zero derivative."""
    prim = def_primitive(name, FAMILY, _float_unary_type(name), ms_fn)
    batching.set(prim, vectorized(prim))
    sharding.set(prim, _elementwise_sharding)
    defjvp(prim, None)
    unsupported(prim, "transpose", "not linear")
    return prim


floor_p = _def_step("floor", _ms_floor)
round_p = _def_step("round", _ms_round)


_GELU_C = math.sqrt(2.0 / math.pi)


def _gelu_jvp(t, ans, x, *, approximate):
    if approximate == "tanh":
        # d/dx 0.5 x (1 + tanh(u)) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) u', with
        # 0.5 (1 + tanh(u)) = sigmoid(2u) and 1 - tanh(u)^2 = 4 sigmoid(2u) sigmoid(-2u):
        # 1 - tanh(u)^2 is 0 in float32 from u = 9 on (and MindSpore's Tanh is 1e-5 off
        # above 4), where the derivative still differs from 1. A half-precision x is
        # differentiated in float32: x ** 3 overflows float16 from x = 41.
        dtype = typeof(x).dtype
        half = dtypes.is_half(dtype)
        xf = cast(x, dtypes.float32) if half else x
        x2 = mul(xf, xf)
        u2 = mul(2 * _GELU_C, add(xf, mul(0.044715, mul(x2, xf))))
        up, down = sigmoid(u2), sigmoid(neg(u2))
        du = mul(_GELU_C, add(1.0, mul(3 * 0.044715, x2)))
        d = add(up, mul(mul(2.0, xf), mul(mul(up, down), du)))
        return mul(t, cast(d, dtype) if half else d)
    cdf = mul(0.5, add(1.0, erf(mul(x, 1.0 / math.sqrt(2.0)))))
    pdf = mul(1.0 / math.sqrt(2.0 * math.pi), exp(mul(-0.5, mul(x, x))))
    return mul(t, add(cdf, mul(x, pdf)))


def _gelu_type(x, *, approximate):
    if approximate not in ("tanh", "none"):
        raise ProgramTypeError(f"gelu approximate must be 'tanh' or 'none', got {approximate!r}")
    return _float_unary_type("gelu")(x)


gelu_p = def_primitive("gelu", FAMILY, _gelu_type, _ms_gelu)
batching.set(gelu_p, vectorized(gelu_p))
sharding.set(gelu_p, _elementwise_sharding)
defjvp(gelu_p, _gelu_jvp)
unsupported(gelu_p, "transpose", "not linear")

# log1p and expm1: accurate near zero, where log(1 + x) and exp(x) - 1 lose the digits.
# MindSpore's CPU Expm1 kernel computes exp(x) - 1 as written (expm1(1e-5) is 1.00136e-5,
# expm1(-1e-6) -1.0133e-6), and so did elu, celu and selu near 0 (1.3% off at -1e-6,
# where MindSpore's CeLU and SeLU kernels are right). Below |x| = 0.5 it is
# 2 t / (1 - t) with t = tanh(x / 2), whose kernel keeps the digits there. Its Log1p
# kernel is log(1 + x) as written too (log1p(1e-9) is 0, log1p(3.06e-7) 3.58e-7: 17%
# off, and so is MindSpore's own Softplus at -15), and its Log is about 6e-8 off near 1,
# so Goldberg's log(1 + x) x / ((1 + x) - 1) does not mend it. Below |x| = 0.5 the
# kernel's y is corrected by one Newton step on that accurate expm1:
# y - (expm1(y) - x) / (1 + x), which doubles its correct digits. (Not further out:
# near x = -1 that step divides a rounding error by 1 + x.)


def _ms_expm1(x):
    t = ops.tanh(x * 0.5)
    return ops.select(ops.abs(x) < 0.5, 2 * t / (1 - t), ops.exp(x) - 1)


def _ms_log1p(x):
    y = ops.log1p(x)
    # expm1(y) as 2 t / (1 - t), t = tanh(y / 2), for every y the step is taken at
    # (|y| < 0.7: no digits lost). This is the forward computation only (log1p's
    # derivative is its own rule), so what the step gives where it is not taken
    # (NaN at x = -1) is never read.
    t = ops.tanh(y * 0.5)
    return ops.select(ops.abs(x) < 0.5, y - (2 * t / (1 - t) - x) / (x + 1), y)


log1p_p = def_unary("log1p", _ms_log1p, lambda t, ans, x: div(t, add(x, 1.0)))
expm1_p = def_unary("expm1", _ms_expm1, lambda t, ans, x: mul(t, add(ans, 1.0)))

# ---------------------------------------------------------------------------
# Binary arithmetic
# ---------------------------------------------------------------------------


def _ms_sub(x, y):
    return ops.sub(x, y)


def _ms_mul(x, y):
    return ops.mul(x, y)


def _ms_div(x, y):
    return ops.div(x, y)


def _ms_pow(x, y):
    return ops.pow(x, y)


def _ms_maximum(x, y):
    return ops.maximum(x, y)


def _ms_minimum(x, y):
    return ops.minimum(x, y)


sub_p = def_primitive("sub", FAMILY, _numeric_binary_type("sub"), _ms_sub)
batching.set(sub_p, broadcasting(sub_p))
sharding.set(sub_p, _elementwise_sharding)
deflinear(sub_p, lambda ct, x, y: [ct, neg(ct)])

mul_p = def_primitive("mul", FAMILY, _binary_type("mul"), _ms_mul)
batching.set(mul_p, broadcasting(mul_p))
sharding.set(mul_p, _elementwise_sharding)
defjvp(mul_p, lambda t, ans, x, y: mul(t, y), lambda t, ans, x, y: mul(x, t))


def _mul_transpose(ct, x, y):
    # mul is linear in whichever operand is undefined (never both).
    assert not (is_undefined(x) and is_undefined(y)), "mul transposed in both operands"
    if is_undefined(x):
        return [mul(ct, y), None]
    return [None, mul(x, ct)]


transpose.set(mul_p, _mul_transpose)

div_p = def_primitive("div", FAMILY, _binary_type("div"), _ms_div)
batching.set(div_p, broadcasting(div_p))
sharding.set(div_p, _elementwise_sharding)
defjvp(div_p, lambda t, ans, x, y: div(t, y),
       lambda t, ans, x, y: neg(mul(t, div(ans, y))))


def _div_transpose(ct, x, y):
    assert is_undefined(x) and not is_undefined(y), "div is linear only in its numerator"
    return [div(ct, y), None]


transpose.set(div_p, _div_transpose)

pow_p = def_primitive("pow", FAMILY, _binary_type("pow"), _ms_pow)
batching.set(pow_p, broadcasting(pow_p))
sharding.set(pow_p, _elementwise_sharding)


def _pow_jvp_exponent(t, ans, x, y):
    # d/dy x ** y = x ** y * log(x). At x == 0 that product is 0 * -inf or inf * -inf:
    # MindSpore's Pow gradient gives its limit there, 0 for y >= 0 and -inf for y < 0.
    # A negative base has no real logarithm: NaN, as in MindSpore and JAX.
    zero = equal(x, 0.0)
    a = typeof(ans)
    at_zero = where(less(y, 0.0), full(a.shape, -np.inf, a.dtype), zeros_like(ans))
    return mul(t, where(zero, at_zero, mul(ans, log(where(zero, 1.0, x)))))


defjvp(pow_p,
       lambda t, ans, x, y: mul(t, mul(y, pow(x, sub(y, 1.0)))),
       _pow_jvp_exponent)
unsupported(pow_p, "transpose", "not linear")


# x ** n for a Python integer n (JAX's integer_pow). With the exponent a broadcast
# tensor, MindSpore's Pow kernel costs 0.6 ms over 32K float32 elements against 0.07 ms
# with a scalar exponent and 0.02 ms for x * x (GRAPH mode, measured): a squared error
# and its derivative were two of the costliest kernels of a transformer's step. x * x
# is the correctly rounded square, as Pow's; the derivative n * x ** (n - 1) keeps the
# exponent static too (2 * x for a square).


def _ms_integer_pow(x, y):
    return ops.mul(x, x) if y == 2 else ops.pow(x, float(y))


def _lower_integer_pow(ctx, x, *, y):
    if y == 2:
        return ctx.call(_ms_mul, x, x)
    return ctx.call(_ms_pow, x, ctx.param(float(y)))


def _integer_pow_type(x, *, y):
    if not isinstance(y, int) or isinstance(y, bool):
        raise ProgramTypeError(f"integer_pow: the exponent y must be a Python int, got {y!r}")
    return _float_unary_type("integer_pow")(x)


integer_pow_p = def_primitive("integer_pow", FAMILY, _integer_pow_type, _ms_integer_pow,
                              lower=_lower_integer_pow)
batching.set(integer_pow_p, vectorized(integer_pow_p))
sharding.set(integer_pow_p, _elementwise_sharding)
defjvp(integer_pow_p,
       lambda t, ans, x, *, y: t if y == 1 else mul(t, mul(float(y), integer_pow(x, y - 1))))
unsupported(integer_pow_p, "transpose", "not linear")


def _minmax_jvp(pick_first):
    # d max(x, y) = tx where x > y, ty where y > x, and the average at ties (as JAX).
    def rule_x(t, ans, x, y):
        w = add(cast(pick_first(x, y), typeof(x).dtype), mul(0.5, cast(equal(x, y), typeof(x).dtype)))
        return mul(t, w)

    def rule_y(t, ans, x, y):
        w = add(cast(pick_first(y, x), typeof(x).dtype), mul(0.5, cast(equal(x, y), typeof(x).dtype)))
        return mul(t, w)

    return rule_x, rule_y


maximum_p = def_primitive("maximum", FAMILY, _binary_type("maximum"), _ms_maximum)
batching.set(maximum_p, broadcasting(maximum_p))
sharding.set(maximum_p, _elementwise_sharding)
defjvp(maximum_p, *_minmax_jvp(lambda a, b: greater(a, b)))
unsupported(maximum_p, "transpose", "not linear")

minimum_p = def_primitive("minimum", FAMILY, _binary_type("minimum"), _ms_minimum)
batching.set(minimum_p, broadcasting(minimum_p))
sharding.set(minimum_p, _elementwise_sharding)
defjvp(minimum_p, *_minmax_jvp(lambda a, b: less(a, b)))
unsupported(minimum_p, "transpose", "not linear")

# clamp(x, lo, hi) = minimum(maximum(x, lo), hi), lo and/or hi (``bounds`` names which
# operands follow x). Its derivatives are MindSpore's (_clamp_jvp). The forward is the
# two kernels alone (MindSpore's ClampScalar costs more: 2.4 against 2.1 ms over 1M
# float32 elements, the same values).


def _ms_clamp(x, *b, bounds):
    if bounds != "hi":
        x = ops.maximum(x, b[0])
    return ops.minimum(x, b[-1]) if bounds != "lo" else x


def _clamp_type(x, *b, bounds):
    if bounds not in ("lo", "hi", "both") or len(b) != (2 if bounds == "both" else 1):
        raise ProgramTypeError(
            f"clamp: bounds must be 'lo', 'hi' or 'both' with one operand per bound, got "
            f"bounds={bounds!r} and {len(b)} bound operand(s)")
    return _same_types("clamp", x, *b)


def _clamp_jvp(primals, tangents, *, bounds):
    """As MindSpore's: x moves the result where lo <= x <= hi; lo where x < lo < hi; hi
    where x > hi or lo > hi (an empty range gives hi). Where x < lo == hi none does."""
    x, *b = primals
    lo = b[0] if bounds != "hi" else None
    hi = b[-1] if bounds != "lo" else None
    t_x, *t_b = tangents
    t_lo = t_b[0] if lo is not None else None
    t_hi = t_b[-1] if hi is not None else None
    ans = clamp_p.bind(*primals, bounds=bounds)
    if not dtypes.is_float(typeof(ans).dtype):
        return [ans], [Zero(typeof(ans))]
    terms = []
    if not isinstance(t_x, Zero):
        inside = [greater_equal(x, lo)] if lo is not None else []
        inside += [less_equal(x, hi)] if hi is not None else []
        terms.append(_where_t(functools.reduce(bitwise_and, inside), t_x))
    if lo is not None and not isinstance(t_lo, Zero):
        moves = less(x, lo) if hi is None else bitwise_and(less(x, lo), less(lo, hi))
        terms.append(_where_t(moves, t_lo))
    if hi is not None and not isinstance(t_hi, Zero):
        moves = greater(x, hi) if lo is None else bitwise_or(greater(x, hi), greater(lo, hi))
        terms.append(_where_t(moves, t_hi))
    if not terms:
        return [ans], [Zero(typeof(ans))]
    return [ans], [functools.reduce(add, terms)]


clamp_p = def_primitive("clamp", FAMILY, _clamp_type, _ms_clamp)
batching.set(clamp_p, broadcasting(clamp_p))
sharding.set(clamp_p, _elementwise_sharding)
unsupported(clamp_p, "transpose", "not linear")

# atan2(y, x): the angle of the point (x, y), in (-pi, pi].


def _ms_atan2(y, x):
    return ops.atan2(y, x)


def _atan2_type(y, x):
    a = _same_types("atan2", y, x)
    if not dtypes.is_float(a.dtype):
        raise ProgramTypeError(f"atan2 needs float operands, got {y}, {x}")
    return a


atan2_p = def_primitive("atan2", FAMILY, _atan2_type, _ms_atan2)
batching.set(atan2_p, broadcasting(atan2_p))
sharding.set(atan2_p, _elementwise_sharding)
defjvp(atan2_p,
       lambda t, ans, y, x: mul(t, div(x, add(mul(x, x), mul(y, y)))),
       lambda t, ans, y, x: mul(t, neg(div(y, add(mul(x, x), mul(y, y))))))
unsupported(atan2_p, "transpose", "not linear")


# floor_div and floor_mod: Python's // and % (the quotient rounds toward -inf; the
# remainder has the divisor's sign), which are MindSpore's FloorDiv and FloorMod, for
# integers and floats alike. floor_div is piecewise constant; floor_mod is
# x - floor_div(x, y) * y, so its derivative is 1 in x and -floor_div(x, y) in y.


def _ms_floor_div(x, y):
    return ops.floor_divide(x, y)


def _ms_floor_mod(x, y):
    return ops.floor_mod(x, y)


floor_div_p = def_primitive("floor_div", FAMILY, _numeric_binary_type("floor_div"),
                            _ms_floor_div)
batching.set(floor_div_p, broadcasting(floor_div_p))
sharding.set(floor_div_p, _elementwise_sharding)
defjvp(floor_div_p, None, None)
unsupported(floor_div_p, "transpose", "not linear")

floor_mod_p = def_primitive("floor_mod", FAMILY, _numeric_binary_type("floor_mod"),
                            _ms_floor_mod)
batching.set(floor_mod_p, broadcasting(floor_mod_p))
sharding.set(floor_mod_p, _elementwise_sharding)
defjvp(floor_mod_p, lambda t, ans, x, y: t,
       lambda t, ans, x, y: mul(t, neg(floor_div_p.bind(x, y))))
unsupported(floor_mod_p, "transpose", "not linear")

# ---------------------------------------------------------------------------
# Comparisons (boolean outputs, zero derivative)
# ---------------------------------------------------------------------------


def _ms_equal(x, y):
    return ops.equal(x, y)


def _ms_not_equal(x, y):
    return ops.ne(x, y)


def _ms_less(x, y):
    return ops.less(x, y)


def _ms_less_equal(x, y):
    return ops.le(x, y)


def _ms_greater(x, y):
    return ops.gt(x, y)


def _ms_greater_equal(x, y):
    return ops.ge(x, y)


def _def_compare(name, ms_fn):
    prim = def_primitive(name, FAMILY, _compare_type(name), ms_fn)
    batching.set(prim, broadcasting(prim))
    sharding.set(prim, _elementwise_sharding)
    defjvp(prim, None, None)
    unsupported(prim, "transpose", "not linear (boolean output)")
    return prim


# ---------------------------------------------------------------------------
# Bitwise operations (integers and bool): fs.random's counter-based generator
# ---------------------------------------------------------------------------


def _bitwise_type(name, shift=False):
    def rule(x, y, **_):
        a = _same_types(name, x, y)
        if not (dtypes.is_int(a.dtype) or (a.dtype == dtypes.bool_ and not shift)):
            raise ProgramTypeError(
                f"{name} needs integer{'' if shift else ' or bool'} operands, got {a}.\nFix: "
                "cast to an integer dtype (e.g. x.astype(mindspore.uint32)).")
        return a

    return rule


def _def_bitwise(name, ms_fn, shift=False):
    prim = def_primitive(name, FAMILY, _bitwise_type(name, shift), ms_fn)
    batching.set(prim, broadcasting(prim))
    sharding.set(prim, _elementwise_sharding)
    defjvp(prim, None, None)  # integers: no tangents
    unsupported(prim, "transpose", "not linear (integer output)")
    return prim


def _ms_bitwise_and(x, y):
    return ops.bitwise_and(x, y)


def _ms_bitwise_or(x, y):
    return ops.bitwise_or(x, y)


def _ms_bitwise_xor(x, y):
    return ops.bitwise_xor(x, y)


def _ms_shift_left(x, y):
    return ops.bitwise_left_shift(x, y)


def _ms_shift_right(x, y):
    return ops.bitwise_right_shift(x, y)


bitwise_and_p = _def_bitwise("bitwise_and", _ms_bitwise_and)
bitwise_or_p = _def_bitwise("bitwise_or", _ms_bitwise_or)
bitwise_xor_p = _def_bitwise("bitwise_xor", _ms_bitwise_xor)
# Shifts by amounts in [0, bits of the dtype); shift_right is logical for unsigned and
# arithmetic for signed integers (as MindSpore's and NumPy's).
shift_left_p = _def_bitwise("shift_left", _ms_shift_left, shift=True)
shift_right_p = _def_bitwise("shift_right", _ms_shift_right, shift=True)

equal_p = _def_compare("equal", _ms_equal)
not_equal_p = _def_compare("not_equal", _ms_not_equal)
less_p = _def_compare("less", _ms_less)
less_equal_p = _def_compare("less_equal", _ms_less_equal)
greater_p = _def_compare("greater", _ms_greater)
greater_equal_p = _def_compare("greater_equal", _ms_greater_equal)

# ---------------------------------------------------------------------------
# select and cast
# ---------------------------------------------------------------------------


def _ms_select(cond, x, y):
    return ops.select(cond, x, y)


def _select_type(cond, x, y):
    if cond.dtype != dtypes.bool_:
        raise ProgramTypeError(f"select needs a bool condition, got {cond}")
    if cond.shape != x.shape:
        _same_types("select", ArrayType(cond.shape, x.dtype), x, y)
    return _same_types("select", x, y)


select_p = def_primitive("select", FAMILY, _select_type, _ms_select)
batching.set(select_p, broadcasting(select_p))
sharding.set(select_p, _elementwise_sharding)
defjvp(select_p, None,
       lambda t, ans, c, x, y: select(c, t, zeros_like(t)),
       lambda t, ans, c, x, y: select(c, zeros_like(t), t))


def _select_transpose(ct, c, x, y):
    assert not is_undefined(c), "select is not linear in its condition"
    z = zeros_like(ct)
    return [None,
            select(c, ct, z) if is_undefined(x) else None,
            select(c, z, ct) if is_undefined(y) else None]


transpose.set(select_p, _select_transpose)


def _ms_cast(x, dtype):
    return ops.cast(x, dtype)


def _cast_type(x, *, dtype):
    return ArrayType(x.shape, dtype)


cast_p = def_primitive("cast", FAMILY, _cast_type, _ms_cast)
batching.set(cast_p, vectorized(cast_p))


def _cast_sharding(x, *, dtype):
    """Elementwise. A pending sum passes through a widening float cast only: the sum of
    truncated or booleanised terms is not the cast of their sum, and a narrowing cast
    rounds each partial sum before the reduction (float32 partials 1024.5 and -1024.0
    cast to float16 sum to 0, the float16 cast of their sum is 0.5)."""
    spec = elementwise_spec(x)
    spec.linear = ((0,),) if dtypes.is_widening_float(x.dtype, dtype) else ()
    return spec


sharding.set(cast_p, _cast_sharding)


def _cast_jvp(primals, tangents, *, dtype):
    (x,), (t,) = primals, tangents
    out = cast(x, dtype)
    if isinstance(t, Zero) or not (dtypes.is_float(dtype) and dtypes.is_float(typeof(x).dtype)):
        return [out], [Zero(typeof(out))]
    return [out], [cast(t, dtype)]


from fshard.core.rules import jvp as _jvp_table  # noqa: E402

_jvp_table.set(cast_p, _cast_jvp)
_jvp_table.set(clamp_p, _clamp_jvp)
transpose.set(cast_p, lambda ct, x, *, dtype: [cast(ct, x.aval.dtype)])

# ---------------------------------------------------------------------------
# Op functions (the public base layer, re-exported by fshard.ops)
# ---------------------------------------------------------------------------


def _un(prim):
    def op(x: ArrayLike, **params) -> Shaped[Array, "*shape"]:
        return prim.bind(x, **params)

    op.__name__ = prim.name
    op.__doc__ = f"Elementwise ``{prim.name}`` (primitive ``{prim.name}``)."
    return op


def _bin(prim):
    def op(x: ArrayLike, y: ArrayLike) -> Shaped[Array, "..."]:
        x, y = promote(x, y)
        return prim.bind(x, y)

    op.__name__ = prim.name
    op.__doc__ = (f"Elementwise ``{prim.name}`` with MindSpore's dtype promotion and "
                  "NumPy broadcasting.")
    return op


def _float_arg(x):
    """Math functions on integer inputs compute in float32 (as MindSpore does)."""
    if not _is_weak(x) and not dtypes.is_float(typeof(x).dtype):
        return cast(x, dtypes.float32)
    if _is_weak(x):
        return np.float32(x)
    return x


def _float_un(prim):
    def op(x: ArrayLike) -> Float[Array, "*shape"]:
        return prim.bind(_float_arg(x))

    op.__name__ = prim.name
    op.__doc__ = f"Elementwise ``{prim.name}`` (integer inputs are computed in float32)."
    return op


neg = _un(neg_p)
exp = _float_un(exp_p)
log = _float_un(log_p)
tanh = _float_un(tanh_p)
sigmoid = _float_un(sigmoid_p)
relu = _un(relu_p)
sqrt = _float_un(sqrt_p)
rsqrt = _float_un(rsqrt_p)
reciprocal = _float_un(reciprocal_p)
abs = _un(abs_p)  # noqa: A001
sign = _un(sign_p)
relu6 = _float_un(relu6_p)
hardsigmoid = _float_un(hardsigmoid_p)
hardswish = _float_un(hardswish_p)


def _int_identity_un(prim):
    def op(x: ArrayLike) -> Shaped[Array, "*shape"]:
        if not dtypes.is_float(typeof(x).dtype):  # an integer is its own floor / rounding
            return x
        return prim.bind(x)

    op.__name__ = prim.name
    op.__doc__ = (f"Elementwise ``{prim.name}`` (primitive ``{prim.name}``; integers are "
                  "returned unchanged).")
    return op


floor = _int_identity_un(floor_p)
round = _int_identity_un(round_p)  # noqa: A001  (MindSpore's name)
sin = _float_un(sin_p)
cos = _float_un(cos_p)
erf = _float_un(erf_p)
erfc = _float_un(erfc_p)


def gelu(x: ArrayLike, approximate: str = "tanh") -> Float[Array, "*shape"]:
    """GELU, exact (``approximate='none'``) or with the tanh approximation."""
    return gelu_p.bind(_float_arg(x), approximate=approximate)


log1p = _float_un(log1p_p)
expm1 = _float_un(expm1_p)


def atan2(y: ArrayLike, x: ArrayLike) -> Float[Array, "..."]:
    """The angle of the point ``(x, y)`` elementwise (MindSpore's ``ops.atan2(input,
    other)``: ``input`` is ``y``); integer operands compute in float32.

    >>> import numpy as np, fshard as fs
    >>> print(f"{float(fs.ops.atan2(np.float32(1), np.float32(-1)).asnumpy()):.4f}")
    2.3562
    """
    y, x = promote(y, x)
    if not dtypes.is_float(typeof(y).dtype):
        y, x = cast(y, dtypes.float32), cast(x, dtypes.float32)
    return atan2_p.bind(y, x)


def _floor_operands(name, x, y):
    x, y = promote(x, y)
    if typeof(x).dtype == dtypes.bool_:
        from fshard.errors import ArgumentError

        raise ArgumentError(
            f"{name}(x, y): bool operands are not supported.\n"
            "Fix: cast them to an integer dtype first, e.g. x.astype(mindspore.int32).")
    return x, y


def floor_divide(x: ArrayLike, y: ArrayLike) -> Shaped[Array, "..."]:
    """``x // y``: the quotient rounded toward minus infinity (integers stay integers),
    with MindSpore's promotion.

    >>> import numpy as np, fshard as fs
    >>> fs.ops.floor_divide(np.array([-7, 7], np.int32), 2).asnumpy().tolist()
    [-4, 3]
    """
    return floor_div_p.bind(*_floor_operands("floor_divide", x, y))


def remainder(x: ArrayLike, y: ArrayLike) -> Shaped[Array, "..."]:
    """``x % y``: ``x - floor(x / y) * y``, which has the sign of ``y`` (as Python's
    ``%``, MindSpore's ``ops.remainder`` / ``floor_mod``).

    >>> import numpy as np, fshard as fs
    >>> fs.ops.remainder(np.array([-7, 7], np.int32), 3).asnumpy().tolist()
    [2, 1]
    """
    return floor_mod_p.bind(*_floor_operands("remainder", x, y))


add = _bin(add_p)
sub = _bin(sub_p)
mul = _bin(mul_p)
maximum = _bin(maximum_p)
bitwise_and = _bin(bitwise_and_p)
bitwise_or = _bin(bitwise_or_p)
bitwise_xor = _bin(bitwise_xor_p)
shift_left = _bin(shift_left_p)
shift_right = _bin(shift_right_p)
minimum = _bin(minimum_p)
equal = _bin(equal_p)
not_equal = _bin(not_equal_p)
less = _bin(less_p)
less_equal = _bin(less_equal_p)
greater = _bin(greater_p)
greater_equal = _bin(greater_equal_p)


def div(x: ArrayLike, y: ArrayLike) -> Shaped[Array, "..."]:
    """True division; integer operands divide in float32, as MindSpore's ``ops.div``."""
    x, y = promote(x, y)
    if not dtypes.is_float(typeof(x).dtype):
        x, y = cast(x, dtypes.float32), cast(y, dtypes.float32)
    return div_p.bind(x, y)


def pow(x: ArrayLike, y: ArrayLike) -> Shaped[Array, "..."]:  # noqa: A001
    """``x ** y`` elementwise."""
    if _static_int_exponent(y) and not _is_weak(x) and not isinstance(x, np.generic) \
            and dtypes.is_float(typeof(x).dtype):
        return integer_pow(x, int(y))
    x, y = promote(x, y)
    return pow_p.bind(x, y)


def _static_int_exponent(y) -> bool:
    """A Python (or NumPy) scalar with an integral value: ``x ** 2``, ``x ** 2.0``."""
    if isinstance(y, (bool, np.bool_)) or not isinstance(y, (int, float, np.integer,
                                                             np.floating)):
        return False
    # (a chained comparison, not abs(): this module's abs is the traced op)
    return math.isfinite(y) and float(y).is_integer() and -2 ** 16 <= y <= 2 ** 16


def integer_pow(x: Float[Array, "*shape"], y: int) -> Float[Array, "*shape"]:
    """``x ** y`` for a static integer ``y`` (float ``x``): ``x * x`` for a square.
    ``x ** 2`` (or ``x ** 2.0``) on a float array traces to it.

    >>> import numpy as np, fshard as fs
    >>> fs.ops.integer_pow(np.array([1.5, -2.0], np.float32), 3).asnumpy().tolist()
    [3.375, -8.0]
    """
    if y == 1:
        return x
    if y == 0:
        return ones_like(x)
    return integer_pow_p.bind(x, y=y)


def square(x: ArrayLike) -> Shaped[Array, "*shape"]:
    return mul(x, x)


def cast(x: ArrayLike, dtype) -> Shaped[Array, "*shape"]:
    """Convert ``x`` to ``dtype`` (a MindSpore or NumPy dtype)."""
    if dtype is None:
        from fshard.errors import ArgumentError

        raise ArgumentError(
            "cast(x, dtype): dtype is None; give the target dtype, e.g. mindspore.float32.")
    dtype = dtypes.canonical(dtype)
    if _is_weak(x):
        return dtypes.to_numpy(dtype).type(x)
    if typeof(x).dtype == dtype:
        return x
    return cast_p.bind(x, dtype=dtype)


def where(cond: Bool[Array, "..."], x: ArrayLike,
          y: ArrayLike) -> Shaped[Array, "..."]:
    """``x`` where ``cond`` else ``y``, with broadcasting (NB: ``select`` primitive)."""
    x, y = promote(x, y)
    if _is_weak(cond):
        cond = np.bool_(cond)
    cond, x, y = _broadcast3(cond, x, y)
    if typeof(cond).dtype != dtypes.bool_:
        cond = cast(cond, dtypes.bool_)
    return select_p.bind(cond, x, y)


def _broadcast3(c, x, y):
    shape = broadcast_shapes(tuple(typeof(c).shape), tuple(typeof(x).shape),
                             tuple(typeof(y).shape))
    return [v if tuple(typeof(v).shape) == shape else broadcast_to(v, shape) for v in (c, x, y)]


def select(cond: Bool[Array, "..."], x: ArrayLike,
           y: ArrayLike) -> Shaped[Array, "..."]:
    return select_p.bind(cond, x, y)


def zeros_like(x: ArrayLike) -> Shaped[Array, "*shape"]:
    a = typeof(x)
    return zeros(a.shape, a.dtype)


def ones_like(x: ArrayLike) -> Shaped[Array, "*shape"]:
    a = typeof(x)
    return full(a.shape, 1, a.dtype)


__all__ = [n for n in dir() if not n.startswith("_") and n not in (
    "annotations", "math", "np", "ops", "dtypes", "ArrayType", "Tracer", "typeof",
    "ProgramTypeError", "broadcasting", "vectorized", "Zero", "is_undefined", "broadcast_to",
    "zeros", "full", "def_primitive", "defjvp", "deflinear", "batching", "transpose", "unsupported",
    "FAMILY")]
