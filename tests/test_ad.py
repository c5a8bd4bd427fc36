"""Reverse and forward mode: ``grad``, ``value_and_grad``, ``jvp``, ``vjp``, ``jacfwd``,
``jacrev``, ``hessian``, ``stop_gradient``, ``custom_jvp`` / ``custom_vjp``, and the
errors of the grad family (golden messages).

Numbers are checked in float64 against NumPy formulas or central finite differences
(NB: JAX ``check_grads``), so a wrong rule cannot hide behind float32 noise.
"""

from __future__ import annotations

import functools
import re

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs
from fshard.testing import assert_close
from fshard import ops

F64 = np.float64


def rng():
    return np.random.default_rng(0)


def np_(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def close(a, b, tol=1e-9):
    assert_close(a, b, rtol=tol, atol=tol)


def numerical_grad(f, x, eps=1e-6):
    """Central differences of a scalar NumPy function at a float64 array."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = eps
        g[i] = (f(x + e) - f(x - e)) / (2 * eps)
    return g


def numerical_jacobian(f, x, eps=1e-6):
    """``out.shape + x.shape`` Jacobian of a NumPy function by central differences."""
    out = np.asarray(f(x))
    jac = np.zeros(out.shape + x.shape)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = eps
        jac[(...,) + i] = (np.asarray(f(x + e)) - np.asarray(f(x - e))) / (2 * eps)
    return jac


def message(fn, cls) -> str:
    with pytest.raises(cls) as info:
        fn()
    return str(info.value)


# ---------------------------------------------------------------------------
# grad / value_and_grad
# ---------------------------------------------------------------------------


def f_np(x):
    return np.sum(np.sin(x) * x ** 2)


def f_fs(x):
    return (ops.sin(x) * x ** 2).sum()


def test_grad_matches_formula_and_finite_differences():
    x = rng().standard_normal((3, 2))
    g = fs.grad(f_fs)(x)
    close(g, np.cos(x) * x ** 2 + 2 * x * np.sin(x))
    close(g, numerical_grad(f_np, x), tol=1e-7)


def test_value_and_grad_returns_the_value():
    x = rng().standard_normal(4)
    v, g = fs.value_and_grad(f_fs)(x)
    close(v, f_np(x))
    close(g, fs.grad(f_fs)(x))


@pytest.mark.parametrize("argnums,expect", [(0, "x"), (1, "y"), (-1, "y"), ((0, 1), "xy"),
                                            ((1, 0), "yx")])
def test_grad_argnums(argnums, expect):
    r = rng()
    x, y = r.standard_normal(3), r.standard_normal(3)

    def f(x, y):
        return (x * y * y).sum()

    gx, gy = y * y, 2 * x * y
    want = {"x": gx, "y": gy, "xy": (gx, gy), "yx": (gy, gx)}[expect]
    got = fs.grad(f, argnums=argnums)(x, y)
    if isinstance(argnums, tuple):
        assert isinstance(got, tuple) and len(got) == 2
        for a, b in zip(got, want):
            close(a, b)
    else:
        close(got, want)


def test_grad_has_aux():
    x = rng().standard_normal(3)
    g, aux = fs.grad(lambda x: ((x ** 2).sum(), {"norm": x * 1.0, "n": 3}), has_aux=True)(x)
    close(g, 2 * x)
    close(aux["norm"], x)
    (v, aux), g2 = fs.value_and_grad(lambda x: ((x ** 2).sum(), x.sum()), has_aux=True)(x)
    close(v, (x ** 2).sum())
    close(aux, x.sum())
    close(g2, 2 * x)


def test_grad_with_keyword_arguments_and_integer_closure():
    x = rng().standard_normal((4, 3))
    labels = np.array([0, 2, 1, 2], np.int32)

    def loss(w, x, *, labels, scale=1.0):
        return ops.softmax_cross_entropy(ops.matmul(x, w), labels) * scale

    w = rng().standard_normal((3, 3))
    g = fs.grad(loss)(w, x, labels=labels, scale=2.0)

    def loss_np(w):
        z = x @ w
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        return -2.0 * logp[np.arange(4), labels].mean()

    close(g, numerical_grad(loss_np, w), tol=1e-7)


def test_grad_of_pytree_params():
    r = rng()
    params = {"layers": [(r.standard_normal((3, 4)), r.standard_normal(4)),
                         (r.standard_normal((4, 2)), r.standard_normal(2))],
              "scale": np.float64(1.5)}
    x = r.standard_normal((5, 3))

    def mlp(p, x):
        for w, b in p["layers"]:
            x = ops.tanh(ops.matmul(x, w) + b)
        return (x * p["scale"]).sum()

    g = fs.grad(mlp)(params, x)
    assert fs.tree.structure(g) == fs.tree.structure(params)
    leaves, treedef = fs.tree.flatten(params)

    def flat_np(i):
        def f(v):
            ls = list(leaves)
            ls[i] = v
            p = fs.tree.unflatten(treedef, ls)
            h = x
            for w, b in p["layers"]:
                h = np.tanh(h @ w + b)
            return float((h * p["scale"]).sum())
        return f

    for i, (leaf, gl) in enumerate(zip(leaves, fs.tree.leaves(g))):
        close(gl, numerical_grad(flat_np(i), np.asarray(leaf, F64)), tol=1e-7)


class TwoLayer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.d1 = nn.Dense(3, 4)
        self.d2 = nn.Dense(4, 2)

    def construct(self, x):
        return self.d2(ops.tanh(self.d1(x)))


def test_grad_of_cell_params_via_functional():
    ms.set_seed(0)
    net = TwoLayer()
    apply, params = fs.functional(net)
    x = ms.Tensor(rng().standard_normal((5, 3)).astype(np.float32))
    g = fs.grad(lambda p, x: (apply(p, x) ** 2).sum())(params, x)
    assert set(g) == {"d1.weight", "d1.bias", "d2.weight", "d2.bias"}
    # NumPy reference (nn.Dense: x @ W.T + b)
    p = {k: v.asnumpy().astype(F64) for k, v in params.items()}
    xn = x.asnumpy().astype(F64)

    def fwd(p):
        return ((np.tanh(xn @ p["d1.weight"].T + p["d1.bias"]) @ p["d2.weight"].T
                 + p["d2.bias"]) ** 2).sum()

    for k in p:
        def f(v, k=k):
            return fwd({**p, k: v})
        np.testing.assert_allclose(np_(g[k]), numerical_grad(f, p[k]), rtol=1e-3, atol=1e-3)
    # the Cell still owns its Parameters afterwards
    assert isinstance(net.d1.weight, ms.Parameter)


class SquaredLoss(nn.Cell):
    def __init__(self):
        super().__init__()
        self.net = TwoLayer()

    def construct(self, x):
        return (self.net(x) ** 2).sum()


def test_grad_of_a_cell_differentiates_its_parameters():
    ms.set_seed(0)
    loss = SquaredLoss()
    x = ms.Tensor(rng().standard_normal((5, 3)).astype(np.float32))
    apply, params = fs.functional(loss)
    g = fs.grad(apply)(params, x)
    g_cell = fs.grad(loss)(x)  # a Cell: gradients with respect to its parameters
    assert set(g_cell) == set(g) == {"net.d1.weight", "net.d1.bias", "net.d2.weight",
                                     "net.d2.bias"}
    for k in g:
        close(g_cell[k], g[k], tol=1e-6)


# ---------------------------------------------------------------------------
# jvp, vjp, jacobians, hessian
# ---------------------------------------------------------------------------


def g_np(x):
    return np.stack([np.sin(x[0]) * x[1], np.exp(x[1]) - x[2] ** 3])


def g_fs(x):
    return ops.stack([ops.sin(x[0]) * x[1], ops.exp(x[1]) - x[2] ** 3])


def test_jvp_matches_finite_differences():
    x = rng().standard_normal(3)
    t = rng().standard_normal(3)
    out, t_out = fs.jvp(g_fs, (x,), (t,))
    close(out, g_np(x))
    close(t_out, numerical_jacobian(g_np, x) @ t, tol=1e-7)


def test_jvp_with_pytrees_and_has_aux():
    x = {"a": rng().standard_normal(2), "b": rng().standard_normal(2)}
    t = {"a": np.ones(2), "b": np.zeros(2)}
    out, t_out, aux = fs.jvp(lambda d: ((d["a"] * d["b"]).sum(), d["a"] * 2.0), (x,), (t,),
                             has_aux=True)
    close(out, (x["a"] * x["b"]).sum())
    close(t_out, x["b"].sum())
    close(aux, 2 * x["a"])


def test_vjp_matches_transposed_jacobian():
    x = rng().standard_normal(3)
    ct = rng().standard_normal(2)
    out, f_vjp = fs.vjp(g_fs, x)
    close(out, g_np(x))
    (g,) = f_vjp(ct)
    close(g, ct @ numerical_jacobian(g_np, x), tol=1e-7)


def test_vjp_and_jvp_agree_dot_product():
    # <ct, J t> == <J^T ct, t>
    r = rng()
    x, t, ct = r.standard_normal(3), r.standard_normal(3), r.standard_normal(2)
    _, jt = fs.jvp(g_fs, (x,), (t,))
    (jtct,) = fs.vjp(g_fs, x)[1](ct)
    close(np.dot(ct, np_(jt)), np.dot(np_(jtct), t))


@pytest.mark.parametrize("jac", [fs.jacfwd, fs.jacrev], ids=["jacfwd", "jacrev"])
def test_jacobian_matches_finite_differences(jac):
    x = rng().standard_normal(3)
    close(jac(g_fs)(x), numerical_jacobian(g_np, x), tol=1e-7)


@pytest.mark.parametrize("jac", [fs.jacfwd, fs.jacrev], ids=["jacfwd", "jacrev"])
def test_jacobian_of_pytrees_with_argnums_tuple(jac):
    r = rng()
    w, x = r.standard_normal((2, 3)), r.standard_normal(3)

    def f(p, x):
        return {"y": ops.tanh(ops.matmul(p["w"], x)), "s": (p["w"] ** 2).sum() * x}

    J = jac(f, argnums=(0, 1))({"w": w}, x)
    dy_dw = np.einsum("i,ij,k->ijk", 1 - np.tanh(w @ x) ** 2, np.eye(2), x)
    dy_dx = (1 - np.tanh(w @ x) ** 2)[:, None] * w
    ds_dw = np.einsum("k,ij->kij", x, 2 * w)
    ds_dx = (w ** 2).sum() * np.eye(3)
    close(J["y"][0]["w"], dy_dw)
    close(J["y"][1], dy_dx)
    close(J["s"][0]["w"], ds_dw)
    close(J["s"][1], ds_dx)


def test_jacobian_has_aux():
    x = rng().standard_normal(3)
    for jac in (fs.jacfwd, fs.jacrev):
        j, aux = jac(lambda x: (x * 2.0, x.sum()), has_aux=True)(x)
        close(j, 2 * np.eye(3))
        close(aux, x.sum())


def test_hessian_matches_formula():
    x = rng().standard_normal(3)
    h = fs.hessian(lambda x: (ops.sin(x) * x).sum() + (x[0] * x[1]) ** 2)(x)
    want = np.diag(2 * np.cos(x) - x * np.sin(x))
    want[0, 0] += 2 * x[1] ** 2
    want[1, 1] += 2 * x[0] ** 2
    want[0, 1] += 4 * x[0] * x[1]
    want[1, 0] += 4 * x[0] * x[1]
    close(h, want)


def test_grad_of_grad():
    x = rng().standard_normal(4)
    d2 = fs.vmap(fs.grad(fs.grad(lambda v: ops.sin(v) * v)))(x)
    close(d2, 2 * np.cos(x) - x * np.sin(x))


# ---------------------------------------------------------------------------
# stop_gradient and non-differentiable primitives
# ---------------------------------------------------------------------------


def test_stop_gradient_blocks_the_derivative():
    x = rng().standard_normal(3)
    g = fs.grad(lambda x: (x * fs.stop_gradient(x)).sum())(x)
    close(g, x)  # d/dx (x * c) with c = x held constant
    g2 = fs.grad(lambda d: (d["a"] * fs.stop_gradient(d)["b"]).sum())({"a": x, "b": x})
    close(g2["a"], x)
    close(g2["b"], np.zeros(3))


def test_comparisons_and_argmax_have_zero_derivative():
    x = rng().standard_normal(5)

    def f(x):
        mask = ops.cast(x > 0.0, ms.float64)  # a comparison: no derivative
        i = ops.argmax(x)                     # an integer: no derivative
        onehot = ops.one_hot(i, 5, dtype=ms.float64)
        return (mask * x).sum() + (onehot * x * x).sum()

    g = fs.grad(f)(x)
    want = (x > 0).astype(F64)
    want[np.argmax(x)] += 2 * x[np.argmax(x)]
    close(g, want)
    _, t = fs.jvp(lambda x: ops.argmax(x), (x,), (x,))
    assert np_(t).dtype.kind == "i" and not np_(t).any()


def test_grad_of_an_integer_output_is_a_clear_error():
    x = rng().standard_normal(5)
    msg = message(lambda: fs.grad(lambda x: ops.argmax(x))(x), fs.DifferentiationError)
    assert msg.startswith("grad(<lambda>) needs a function that returns a scalar float, but "
                          "it returned i32[].")


def test_relu_maximum_and_abs_derivatives_away_from_kinks():
    x = np.array([-1.5, -0.3, 0.4, 2.0])
    close(fs.grad(lambda x: ops.relu(x).sum())(x), (x > 0).astype(F64))
    close(fs.grad(lambda x: ops.abs(x).sum())(x), np.sign(x))
    close(fs.grad(lambda x: ops.maximum(x, 0.1).sum())(x), (x > 0.1).astype(F64))


# ---------------------------------------------------------------------------
# custom_jvp: a numerically stable log(1 + exp(x))
# ---------------------------------------------------------------------------


@fs.custom_jvp
def log1pexp(x):
    # stable: max(x, 0) + log(1 + exp(-|x|))
    return ops.maximum(x, 0.0) + ops.log(1.0 + ops.exp(-ops.abs(x)))


@log1pexp.defjvp
def _log1pexp_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return log1pexp(x), t * ops.sigmoid(x)


@fs.custom_jvp
def naive_log1pexp(x):
    return ops.log(1.0 + ops.exp(x))


@naive_log1pexp.defjvp
def _naive_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return naive_log1pexp(x), t * (1.0 - 1.0 / (1.0 + ops.exp(x)))


def sigmoid_np(x):
    return 1 / (1 + np.exp(-x))


XS = np.array([-30.0, -1.0, 0.0, 2.0, 30.0])


def test_custom_jvp_rule_is_used_by_grad_and_jvp():
    close(log1pexp(XS), np.logaddexp(0, XS))           # eager: just the function
    close(fs.vmap(log1pexp)(XS), np.logaddexp(0, XS))
    close(fs.jit(log1pexp)(XS), np.logaddexp(0, XS))   # the body lowered as a helper
    close(fs.vmap(fs.grad(log1pexp))(XS), sigmoid_np(XS))
    _, t = fs.jvp(log1pexp, (XS,), (np.full(5, 2.0),))
    close(t, 2 * sigmoid_np(XS))


def test_custom_jvp_avoids_the_nan_of_autodiff():
    x = np.array([100.0], np.float32)
    plain = fs.grad(lambda x: ops.log(1.0 + ops.exp(x)).sum())(x)
    assert np.isnan(np_(plain)).all()  # inf / inf
    assert np_(fs.grad(lambda x: naive_log1pexp(x).sum())(x)).tolist() == [1.0]


@pytest.mark.parametrize("stack", ["grad", "vmap(grad)", "grad(vmap)", "jit(grad)",
                                   "jit(vmap(grad))", "grad(jit(vmap))", "grad(grad)"])
def test_custom_jvp_under_every_stack(stack):
    def total(x):
        return fs.vmap(log1pexp)(x).sum()

    fns = {
        "grad": lambda: fs.grad(lambda x: log1pexp(x).sum())(XS),
        "vmap(grad)": lambda: fs.vmap(fs.grad(log1pexp))(XS),
        "grad(vmap)": lambda: fs.grad(total)(XS),
        "jit(grad)": lambda: fs.jit(fs.grad(lambda x: log1pexp(x).sum()))(XS),
        "jit(vmap(grad))": lambda: fs.jit(fs.vmap(fs.grad(log1pexp)))(XS),
        "grad(jit(vmap))": lambda: fs.grad(lambda x: fs.jit(fs.vmap(log1pexp))(x).sum())(XS),
    }
    if stack == "grad(grad)":
        close(fs.vmap(fs.grad(fs.grad(log1pexp)))(XS), sigmoid_np(XS) * (1 - sigmoid_np(XS)))
    else:
        close(fns[stack](), sigmoid_np(XS))


def test_custom_jvp_rule_survives_vmap_before_grad():
    # grad(vmap(f)): the batched equation still carries the (batched) rule
    ir = str(fs.make_ir(fs.vmap(naive_log1pexp))(XS))
    assert "custom_jvp_call" in ir
    x = np.array([1.0, 100.0], np.float32)
    g = fs.grad(lambda x: fs.vmap(naive_log1pexp)(x).sum())(x)
    np.testing.assert_allclose(np_(g), [sigmoid_np(1.0), 1.0], rtol=1e-6)


def test_custom_jvp_with_pytrees_nondiff_argnums_and_kwargs():
    @functools.partial(fs.custom_jvp, nondiff_argnums=(0,))
    def scaled(power, d, shift=0.0):
        return {"y": d["x"] ** power + shift}

    @scaled.defjvp
    def scaled_jvp(power, primals, tangents):
        d, shift = primals
        td, tshift = tangents
        out = scaled(power, d, shift)
        return out, {"y": power * d["x"] ** (power - 1) * td["x"] * 10.0 + tshift}

    x = np.array([1.0, 2.0])
    g = fs.grad(lambda x: scaled(3, {"x": x}, shift=1.0)["y"].sum())(x)
    close(g, 30.0 * x ** 2)  # the rule's (deliberately scaled) derivative, not autodiff
    g_shift = fs.grad(lambda s: scaled(2, {"x": x}, s)["y"].sum())(np.float64(0.0))
    close(g_shift, 2.0)


def test_custom_jvp_defjvps():
    @fs.custom_jvp
    def f(x, y):
        return x * y

    f.defjvps(lambda tx, out, x, y: tx * y * 2.0, lambda ty, out, x, y: x * ty)
    x, y = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    gx, gy = fs.grad(lambda x, y: f(x, y).sum(), argnums=(0, 1))(x, y)
    close(gx, 2 * y)
    close(gy, x)


def test_custom_jvp_closing_over_a_constant():
    scale = np.array([2.0, 3.0])

    @fs.custom_jvp
    def f(x):
        return x * scale

    f.defjvp(lambda p, t: (f(p[0]), t[0] * scale * 100.0))
    close(fs.grad(lambda x: f(x).sum())(np.ones(2)), [200.0, 300.0])
    close(fs.jit(fs.vmap(f))(np.ones((3, 2)))[2], [2.0, 3.0])


# ---------------------------------------------------------------------------
# custom_vjp: gradient clipping
# ---------------------------------------------------------------------------


@fs.custom_vjp
def clip_gradient(lo, hi, x):
    return x  # identity on the way forward


def _clip_fwd(lo, hi, x):
    return x, (lo, hi)


def _clip_bwd(res, g):
    lo, hi = res
    return None, None, ops.minimum(ops.maximum(g, lo), hi)


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


def clipped_loss(x):
    return (3.0 * clip_gradient(-1.0, 1.0, x) ** 2).sum()


def test_custom_vjp_replaces_the_gradient():
    x = np.array([-2.0, 0.1, 0.5, 3.0])
    close(clipped_loss(x), (3 * x ** 2).sum())           # eager: just the function
    close(fs.jit(clipped_loss)(x), (3 * x ** 2).sum())
    close(fs.vmap(functools.partial(clip_gradient, -1.0, 1.0))(x), x)
    close(fs.grad(clipped_loss)(x), np.clip(6 * x, -1, 1))  # the gradient is clipped


@pytest.mark.parametrize("stack", ["vmap(grad)", "grad(vmap)", "jit(grad)",
                                   "jit(vmap(grad))", "grad(jit)", "vjp"])
def test_custom_vjp_under_every_stack(stack):
    x = np.array([-2.0, 0.1, 0.5, 3.0])

    def per_example(v):
        return 3.0 * clip_gradient(-1.0, 1.0, v) ** 2

    fns = {
        "vmap(grad)": lambda: fs.vmap(fs.grad(per_example))(x),
        "grad(vmap)": lambda: fs.grad(lambda x: fs.vmap(per_example)(x).sum())(x),
        "jit(grad)": lambda: fs.jit(fs.grad(clipped_loss))(x),
        "jit(vmap(grad))": lambda: fs.jit(fs.vmap(fs.grad(per_example)))(x),
        "grad(jit)": lambda: fs.grad(fs.jit(clipped_loss))(x),
        "vjp": lambda: fs.vjp(lambda x: 3.0 * clip_gradient(-1.0, 1.0, x) ** 2, x)[1](
            np.ones(4))[0],
    }
    close(fns[stack](), np.clip(6 * x, -1, 1))


def test_custom_vjp_unbatched_argument_under_vmap_sums_per_example_cotangents():
    @fs.custom_vjp
    def scale(w, x):
        return w * x

    scale.defvjp(lambda w, x: (w * x, (w, x)), lambda r, g: (r[1] * g * 10.0, r[0] * g))
    xs = rng().standard_normal((4, 2))
    w = np.array([1.0, 2.0])
    gw = fs.grad(lambda w: fs.vmap(scale, in_axes=(None, 0))(w, xs).sum())(w)
    close(gw, 10.0 * xs.sum(0))
    gx = fs.grad(lambda xs: fs.vmap(scale, in_axes=(None, 0))(w, xs).sum())(xs)
    close(gx, np.broadcast_to(w, xs.shape))


def test_custom_vjp_residuals_and_pytree_arguments():
    @fs.custom_vjp
    def norm(d):
        return ops.sqrt((d["a"] ** 2).sum() + (d["b"] ** 2).sum())

    def fwd(d):
        n = norm(d)
        return n, (d, n)

    def bwd(res, g):
        d, n = res
        return ({"a": g * d["a"] / n, "b": g * d["b"] / n * 0.0},)

    norm.defvjp(fwd, bwd)
    d = {"a": np.array([3.0]), "b": np.array([4.0])}
    g = fs.grad(norm)(d)
    close(g["a"], [0.6])
    close(g["b"], [0.0])
    close(fs.jit(fs.grad(norm))(d)["a"], [0.6])


def test_grad_of_grad_through_custom_vjp_differentiates_bwd():
    @fs.custom_vjp
    def cube(x):
        return x ** 3

    cube.defvjp(lambda x: (x ** 3, x), lambda x, g: (3.0 * x ** 2 * g,))
    x = np.array([1.0, 2.0])
    close(fs.vmap(fs.grad(fs.grad(cube)))(x), 6 * x)


def test_forward_mode_through_custom_vjp_is_a_clear_error():
    x = np.ones(3)
    want = ("can't apply forward-mode differentiation (jvp, jacfwd, hessian) to the "
            "custom_vjp function clip_gradient: it defines only a reverse-mode rule "
            "(fwd/bwd).\nFix: use reverse mode (fs.grad, fs.vjp, fs.jacrev), or define the "
            "derivative with fs.custom_jvp, which serves both modes.\n"
            "See docs/errors.md#differentiationerror")
    f = functools.partial(clip_gradient, -1.0, 1.0)
    for run in (lambda: fs.jvp(f, (x,), (x,)),
                lambda: fs.jacfwd(f)(x),
                lambda: fs.jit(lambda x: fs.jvp(f, (x,), (x,))[1])(x),
                lambda: fs.vmap(lambda x: fs.jvp(f, (x,), (x,))[1])(x)):
        assert message(run, fs.DifferentiationError).startswith(want)


# ---------------------------------------------------------------------------
# custom rule errors (golden)
# ---------------------------------------------------------------------------


def test_custom_jvp_without_rule():
    @fs.custom_jvp
    def f(x):
        return x

    assert message(lambda: f(np.ones(2)), fs.DifferentiationError) == (
        "custom_jvp function f has no JVP rule.\nFix: define one with @f.defjvp (a function "
        "of (primals, tangents)).\nSee docs/errors.md#differentiationerror")


def test_custom_jvp_rule_with_wrong_tangent_type():
    @fs.custom_jvp
    def f(x):
        return x * 2.0

    f.defjvp(lambda p, t: (f(p[0]), t[0].sum()))
    msg = message(lambda: fs.grad(lambda x: f(x).sum())(np.ones(3)), fs.DifferentiationError)
    assert msg.startswith(
        "custom_jvp rule of f: leaf 0 of the tangent output has type f64[], but the matching "
        "leaf of the primal output has type f64[3]; they must be equal.\nFix: return arrays "
        "of the same shape and dtype (cast or broadcast them).")


def test_custom_jvp_rule_not_returning_a_pair():
    @fs.custom_jvp
    def f(x):
        return x

    f.defjvp(lambda p, t: t[0])
    msg = message(lambda: fs.grad(lambda x: f(x).sum())(np.ones(3)), fs.DifferentiationError)
    assert msg.startswith("custom_jvp rule of f must return a pair (primal_out, tangent_out); "
                          "it returned f64[3].\nFix: return (f(*primals), tangent_out).")


def test_custom_vjp_bwd_with_wrong_number_of_cotangents():
    @fs.custom_vjp
    def f(x, y):
        return x * y

    f.defvjp(lambda x, y: (x * y, (x, y)), lambda r, g: (g * r[1],))
    msg = message(lambda: fs.grad(lambda x: f(x, x).sum())(np.ones(3)), fs.DifferentiationError)
    assert msg.startswith(
        "custom_vjp bwd rule of f must return a tuple with one cotangent per differentiable "
        "argument (2); it returned a tuple of length 1.\nFix: return (ct_x,) for a single "
        "argument; use None for a zero cotangent.")


def test_custom_rule_closing_over_a_differentiated_value():
    def loss(w, x):
        @fs.custom_jvp
        def f(x):
            return x * w

        f.defjvp(lambda p, t: (f(p[0]), t[0] * w))
        return f(x).sum()

    msg = message(lambda: fs.grad(loss)(np.ones(2), np.ones(2)), fs.DifferentiationError)
    assert msg.startswith(
        "custom_jvp function f closes over a value that is being differentiated (a traced "
        "array captured from an enclosing scope, not passed as an argument). Its custom rule "
        "only sees its arguments, so that derivative would be lost.\nFix: pass the value to "
        "the function as an explicit argument.")
    # differentiating the other argument is fine: w's tangent is zero
    close(fs.grad(loss, argnums=1)(np.full(2, 3.0), np.ones(2)), [3.0, 3.0])


# ---------------------------------------------------------------------------
# errors of the grad family (golden)
# ---------------------------------------------------------------------------

X3 = np.ones(3, np.float32)


def loss_vec(x):
    return x * 2.0


GOLDEN = {
    "non-scalar output": (
        lambda: fs.grad(loss_vec)(X3),
        "grad(loss_vec) needs a function that returns a scalar float, but it returned f32[3].\n"
        "Fix: reduce the output (e.g. .sum() or .mean()); for vector outputs use fs.vjp, "
        "fs.jacrev or fs.jacfwd; with an auxiliary output use has_aux=True."),
    "integer input": (
        lambda: fs.grad(lambda x, n: (x * n).sum(), argnums=1)(X3, np.ones(3, np.int32)),
        "grad(<lambda>): args[1] (parameter 'n') has dtype Int32 (i32[3]), but only "
        "floating-point inputs can be differentiated.\nFix: cast it to float32 "
        "(x.astype(mindspore.float32)), or leave it out of argnums (only the arguments in "
        "argnums are differentiated)."),
    "integer leaf of a pytree": (
        lambda: fs.value_and_grad(lambda p: p["w"].sum())({"w": X3, "steps": np.int64(3)}),
        "value_and_grad(<lambda>): args[0]['steps'] (parameter 'p') has dtype Int64 (i64[]), "
        "but only floating-point inputs can be differentiated.\nFix: cast it to float32 "
        "(x.astype(mindspore.float32)), or leave it out of argnums (only the arguments in "
        "argnums are differentiated)."),
    "has_aux with a single output": (
        lambda: fs.grad(lambda x: x.sum(), has_aux=True)(X3),
        "grad(<lambda>) was called with has_aux=True, so <lambda> must return a pair "
        "(output, aux); it returned f32[].\nFix: return (output, aux), or drop has_aux=True."),
    "has_aux with a triple": (
        lambda: fs.grad(lambda x: (x.sum(), x, x), has_aux=True)(X3),
        "grad(<lambda>) was called with has_aux=True, so <lambda> must return a pair "
        "(output, aux); it returned (f32[], f32[3], f32[3]).\nFix: return (output, aux), or "
        "drop has_aux=True."),
    "argnums out of range": (
        lambda: fs.grad(lambda x, y: (x * y).sum(), argnums=2)(X3, X3),
        "grad(<lambda>): argnums=2 refers to positional argument 2, but <lambda> was called "
        "with 2 positional arguments.\nFix: use argnums in [-2, 1]; to differentiate a "
        "keyword argument, pass it positionally."),
    "argnums tuple out of range": (
        lambda: fs.jacrev(lambda x: x, argnums=(0, -2))(X3),
        "jacrev(<lambda>): argnums=(0, -2) refers to positional argument -2, but <lambda> was "
        "called with 1 positional argument.\nFix: use argnums in [-1, 0]; to differentiate a "
        "keyword argument, pass it positionally."),
    "argnums of the wrong type": (
        lambda: fs.grad(lambda x: x.sum(), argnums="x")(X3),
        "grad(<lambda>): argnums must be an int or a non-empty tuple of ints, got 'x'."),
    "jvp tangent structure": (
        lambda: fs.jvp(lambda x, y: x * y, (X3, X3), (X3,)),
        "jvp(<lambda>): tangents must have the structure of primals; primals are (f32[3], "
        "f32[3]) but tangents are (f32[3],).\nFix: pass one tangent per primal, in the same "
        "containers."),
    "jvp tangent dtype": (
        lambda: fs.jvp(lambda d: d["x"] * 2.0, ({"x": X3},), ({"x": X3.astype(F64)},)),
        "jvp(<lambda>): the tangent for args[0]['x'] (parameter 'd') has type f64[3], but "
        "the primal has type f32[3]; a tangent must have its primal's shape and dtype.\n"
        "Fix: build the tangent like the primal (e.g. np.ones_like(x)), or cast it "
        "(t.astype(x.dtype))."),
    "vjp cotangent structure": (
        lambda: fs.vjp(lambda x: (x, x), X3)[1](X3),
        "vjp(<lambda>): the cotangent must have the structure of the output, which is "
        "(f32[3], f32[3]); got f32[3].\nFix: pass one cotangent per output leaf, in the "
        "output's containers."),
}


@pytest.mark.parametrize("case", list(GOLDEN))
def test_golden_error(case):
    run, want = GOLDEN[case]
    msg = message(run, fs.DifferentiationError)
    assert msg == want + "\nSee docs/errors.md#differentiationerror", msg


def test_differentiation_error_is_a_type_error():
    with pytest.raises(TypeError, match=re.escape("needs a function that returns a scalar")):
        fs.grad(loss_vec)(X3)


# ---------------------------------------------------------------------------
# Repeated argnums: every listed position gets its gradient (as in JAX)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["grad", "value_and_grad", "jacrev", "jacfwd"])
def test_repeated_argnums_give_each_position_its_gradient(api):
    x = rng().standard_normal(3)
    y = rng().standard_normal(3) + 2.0
    if api in ("grad", "value_and_grad"):
        f = lambda a, b: (a * b * a).sum()  # noqa: E731
        dx, dy = 2 * x * y, x * x
    else:
        f = lambda a, b: a * b * a  # noqa: E731
        dx, dy = np.diag(2 * x * y), np.diag(x * x)
    out = getattr(fs, api)(f, argnums=(0, 1, 0))(x, y)
    grads = out[1] if api == "value_and_grad" else out
    assert len(grads) == 3
    for g, want in zip(grads, (dx, dy, dx)):
        close(g, want)
