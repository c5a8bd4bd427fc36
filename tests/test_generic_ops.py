"""The generic path: MindSpore ops without a native fshard rule (fshard/primitives/generic.py).

A registry of (op, sample input) pairs, each checked against eager MindSpore under
``fs.jit``, ``fs.grad`` (against ``mindspore.grad``), ``fs.vmap`` (against a loop of
eager calls) and ``fs.shard`` on a virtual mesh (against the unsharded result). The
quick run checks a few representative ops; ``--full`` checks every one.
"""

from __future__ import annotations

import warnings

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint, nn, ops

import fshard as fs
import fshard.testing
from fshard.primitives import generic

rng = np.random.default_rng(0)


def _t(*shape, low=None):
    if low is not None:
        return ms.Tensor(rng.uniform(low, low + 1.5, shape).astype(np.float32))
    return ms.Tensor(rng.standard_normal(shape).astype(np.float32))


IMG = _t(2, 3, 8, 8)
W = _t(4, 3, 3, 3)
ms.set_seed(0)
_MAXPOOL3D = nn.MaxPool3d(2, 2)


def _max_pool3d(x):
    """A pool over (depth, height, width): MaxPool3D, which has no native rule (the 2-D
    convolutions and pools have: tests/test_conv_pool.py)."""
    n, c, h, w = x.shape
    return _MAXPOOL3D(x.reshape(n, 1, c, h, w)).reshape(n, 1, h // 2, w // 2)


#: name -> (function of one float image, elementwise?). Every op here has no native
#: fshard rule (a native one, when added, takes precedence: the test still holds).
OPS = {
    "nn.MaxPool3d": (_max_pool3d, False),
    "ops.lrn": (lambda x: ops.lrn(x), False),
    "ops.erfc": (lambda x: ops.erfc(x), True),
    "ops.asinh": (lambda x: ops.asinh(x), True),
}
QUICK = ("nn.MaxPool3d", "ops.lrn", "ops.erfc")


def _params():
    return [pytest.param(name, marks=() if name in QUICK else pytest.mark.full)
            for name in OPS]


def _close(got, want, rtol=1e-4):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    scale = max(float(np.abs(want).max()), 1.0)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


def _loss(f):
    return lambda x: (f(x) ** 2).sum()


@pytest.mark.parametrize("name", _params())
def test_jit_matches_mindspore(name):
    f, _ = OPS[name]
    _close(fs.jit(f)(IMG).asnumpy(), f(IMG).asnumpy())


@pytest.mark.parametrize("name", _params())
def test_grad_matches_mindspore_grad(name):
    f, _ = OPS[name]
    want = ms.grad(_loss(f))(IMG).asnumpy()
    _close(fs.jit(fs.grad(_loss(f)))(IMG).asnumpy(), want)


@pytest.mark.parametrize("name", _params())
def test_vmap_matches_a_loop(name):
    f, _ = OPS[name]
    xs = ms.Tensor(np.stack([IMG.asnumpy(), -IMG.asnumpy()]))
    want = np.stack([f(xs[i]).asnumpy() for i in range(2)])
    _close(fs.jit(fs.vmap(f))(xs).asnumpy(), want)


@pytest.mark.parametrize("name", _params())
def test_shard_matches_unsharded(name, monkeypatch):
    f, elementwise = OPS[name]
    monkeypatch.setattr(generic, "_warned", set())
    if elementwise:  # keeps its layout: no warning, no collective before it
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            part = fs.testing.check_sharding(f, (IMG,), ((2, 1, 1, 1),), mesh=2,
                                             rtol=1e-4, atol=1e-4)
        lines = str(part).splitlines()
        k = next(i for i, line in enumerate(lines) if "= " + name.split(".")[1] in line.lower())
        assert "f32[1,3,8,8]" in lines[k]  # each device computes its own block
        assert not any("= all_gather" in line for line in lines[:k])
    else:
        with pytest.warns(fs.GenericOpWarning, match="runs replicated"):
            fs.testing.check_sharding(f, (IMG,), ((2, 1, 1, 1),), mesh=2, rtol=1e-4,
                                      atol=1e-4)


# ---------------------------------------------------------------------------
# Tracing: one equation by its MindSpore name, lowered to the same primitive
# ---------------------------------------------------------------------------


def test_ir_prints_the_mindspore_name_and_attributes():
    text = str(fs.make_ir(_MAXPOOL3D)(_t(2, 1, 3, 8, 8)))
    assert "MaxPool3D[" in text and "kernel_size=(1, 1, 2, 2, 2)" in text
    assert text.count("\n") == 2  # one equation


def test_lowered_graph_calls_the_mindspore_primitive():
    prim = ops.operations.MatrixBandPart()
    f = fs.jit(lambda x: prim(x, 0, 1))
    _close(f(IMG).asnumpy(), prim(IMG, 0, 1).asnumpy())
    eq, = [e for e in fs.make_ir(lambda x: prim(x, 0, 1))(IMG).program.equations]
    assert eq.params["fn"].graph_fn.__globals__["op_0"] is prim


def test_multi_output_op_returns_a_tuple():
    values, indices = fs.jit(lambda x: ops.sort(x, axis=-1))(IMG)
    want_v, want_i = ops.sort(IMG, axis=-1)
    _close(values.asnumpy(), want_v.asnumpy())
    np.testing.assert_array_equal(indices.asnumpy(), want_i.asnumpy())


def test_mint_overload_takes_the_generic_path():
    x = _t(4, 5)
    f = lambda x: mint.erfc(x)  # noqa: E731
    assert "Erfc" in str(fs.make_ir(f)(x)) or "erfc" in str(fs.make_ir(f)(x))
    _close(fs.jit(f)(x).asnumpy(), ops.erfc(x).asnumpy())


# ---------------------------------------------------------------------------
# Differentiation: MindSpore's bprop, forward mode through it, higher order
# ---------------------------------------------------------------------------


def test_jvp_is_the_transposed_bprop():
    x, t = _t(3, 4), _t(3, 4)
    out, tan = fs.jit(lambda x, t: fs.jvp(lambda y: ops.cumsum(ops.erfc(y), 1), (x,), (t,)))(
        x, t)
    d = -2 / np.sqrt(np.pi) * np.exp(-x.asnumpy() ** 2) * t.asnumpy()
    _close(tan.asnumpy(), np.cumsum(d, 1))


@pytest.mark.full
def test_hessian_through_the_bprop_of_a_bprop():
    x = _t(4)
    h = fs.jit(fs.hessian(lambda y: ops.atan(y).sum()))(x).asnumpy()
    xv = x.asnumpy()
    _close(h, np.diag(-2 * xv / (1 + xv ** 2) ** 2))


def test_grad_of_grad_matches_mindspore():
    x = _t(2, 3, 5, 5)

    def f(y):
        return (_max_pool3d(y) ** 3).sum()

    want = ms.grad(ms.grad(f))(x).asnumpy()
    _close(fs.jit(fs.grad(lambda y: fs.grad(f)(y).sum()))(x).asnumpy(), want)


def test_forward_mode_without_a_second_order_bprop_is_a_clear_error():
    f = lambda x: ops.max_pool3d(x.reshape(2, 1, 3, 8, 8), 2, 2)  # noqa: E731
    with pytest.raises(fs.UnsupportedOpError, match="reverse mode") as info:
        fs.jvp(f, (IMG,), (IMG,))
    assert "MaxPool3DWithArgmax" in str(info.value)


def test_integer_output_gets_no_tangent():
    x = _t(3, 5)
    g = fs.grad(lambda y: ops.topk(y, 2)[0].sum())(x).asnumpy()
    want = ms.grad(lambda y: ops.topk(y, 2)[0].sum())(x).asnumpy()
    _close(g, want)


# ---------------------------------------------------------------------------
# vmap: MindSpore's batching rule, or a loop with a warning
# ---------------------------------------------------------------------------


def test_vmap_without_a_mindspore_rule_loops_with_a_warning(monkeypatch):
    monkeypatch.setattr(generic, "_warned", set())
    xs = _t(3, 4)
    f = lambda a: ops.diag(a)  # noqa: E731  no MindSpore vmap rule
    with pytest.warns(fs.GenericOpWarning, match="Diag.*once per example"):
        got = fs.vmap(f)(xs)
    _close(got.asnumpy(), np.stack([f(xs[i]).asnumpy() for i in range(3)]))


def test_vmap_of_a_wrong_mindspore_rule_loops():
    # MindSpore's Addcdiv batching rule fails on these shapes: fshard checks a rule
    # once against the op itself and loops instead
    xs = _t(3, 4, 5)
    f = lambda a: ops.addcdiv(a, a, a * a + 1, ms.Tensor(0.5))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fs.GenericOpWarning)
        got = fs.vmap(f)(xs)
    _close(got.asnumpy(), np.stack([f(xs[i]).asnumpy() for i in range(3)]))


def test_per_example_gradients():
    xs = _t(3, 6)
    got = fs.jit(fs.vmap(fs.grad(lambda x: (ops.cumsum(x, 0) ** 2).sum())))(xs).asnumpy()
    want = np.stack([ms.grad(lambda x: (ops.cumsum(x, 0) ** 2).sum())(xs[i]).asnumpy()
                     for i in range(3)])
    _close(got, want)


@pytest.mark.full
def test_per_example_gradients_of_a_cnn():
    xs = _t(3, 3, 6, 6)

    def loss(x):
        return (ops.max_pool2d(ops.relu(ops.conv2d(x[None], W)), 2) ** 2).sum()

    got = fs.jit(fs.vmap(fs.grad(loss)))(xs).asnumpy()
    want = np.stack([ms.grad(loss)(xs[i]).asnumpy() for i in range(3)])
    _close(got, want)


# ---------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [lambda x: ops.nonzero(x), lambda x: ops.unique(x)[0],
                                lambda x: ops.masked_select(x, x > 0)],
                         ids=["nonzero", "unique", "masked_select"])
def test_data_dependent_shapes_are_refused_with_a_fix(fn):
    with pytest.raises(fs.UnsupportedOpError, match="depends on its operands' values") as info:
        fs.jit(fn)(_t(6))
    assert "Fix:" in str(info.value) and "outside the traced function" in str(info.value)


def test_stateful_random_ops_are_still_refused():
    with pytest.raises(fs.UnsupportedOpError, match="stateful"):
        fs.jit(lambda x: ops.dropout(x, 0.5))(_t(4))


def test_symbolic_dims_are_refused_clearly():
    f = fs.jit(lambda x: ops.matrix_band_part(x, 0, 1))
    f.set_inputs(fs.ArrayType((fs.Symbol(max=16), 3), ms.float32))
    with pytest.raises(fs.UnsupportedOpError, match="static shapes"):
        f(_t(4, 3))


def test_op_that_fails_in_mindspore_fails_at_trace_time():
    with pytest.raises(fs.UnsupportedOpError, match="cannot run on operands") as info:
        fs.jit(lambda x: ops.cholesky(x))(_t(3, 4))
    assert "Cholesky" in str(info.value)


def test_op_with_a_restricted_domain_traces():
    # Cholesky refuses zeros, ones and random matrices: shape inference tries a
    # positive definite sample too
    a = rng.standard_normal((3, 3))
    spd = ms.Tensor((a @ a.T + 3 * np.eye(3)).astype(np.float32))
    _close(fs.jit(lambda m: ops.cholesky(m))(spd).asnumpy(), ops.cholesky(spd).asnumpy())


def test_op_without_a_mindspore_gradient_is_a_clear_error():
    a = rng.standard_normal((3, 3))
    spd = ms.Tensor((a @ a.T + 3 * np.eye(3)).astype(np.float32))
    with pytest.raises(fs.UnsupportedOpError, match="MindSpore has no gradient for it") as info:
        fs.grad(lambda m: ops.cholesky(m).sum())(spd)
    assert "Cholesky" in str(info.value) and "CholeskyGrad" in str(info.value)


# ---------------------------------------------------------------------------
# State a layer updates: BatchNorm's moving statistics in training mode
# ---------------------------------------------------------------------------


def _training_bn():
    bn = nn.BatchNorm2d(3)
    bn.set_train(True)
    return bn


def test_batchnorm_training_updates_its_statistics_as_mindspore_jit():
    x = ms.Tensor(rng.standard_normal((4, 3, 5, 5)).astype(np.float32) * 2 + 1)
    ours, theirs = _training_bn(), _training_bn()
    f, g = fs.jit(ours), ms.jit(theirs.construct)
    for _ in range(2):
        _close(f(x).asnumpy(), g(x).asnumpy())
        _close(ours.moving_mean.asnumpy(), theirs.moving_mean.asnumpy(), 1e-5)
        _close(ours.moving_variance.asnumpy(), theirs.moving_variance.asnumpy(), 1e-5)
    assert not np.allclose(ours.moving_mean.asnumpy(), 0)


def test_batchnorm_training_under_grad_updates_its_statistics_once():
    # MindSpore's bprop runs the op again: the derivative must not update them again
    x = ms.Tensor(rng.standard_normal((4, 3, 5, 5)).astype(np.float32) * 2 + 1)
    ours, theirs = _training_bn(), _training_bn()
    got = fs.jit(fs.grad(lambda x: (ours(x) ** 2).sum()))(x).asnumpy()
    want = ms.grad(lambda x: (theirs(x) ** 2).sum())(x).asnumpy()
    _close(got, want)
    _close(ours.moving_mean.asnumpy(), theirs.moving_mean.asnumpy(), 1e-5)
    _close(ours.moving_variance.asnumpy(), theirs.moving_variance.asnumpy(), 1e-5)
