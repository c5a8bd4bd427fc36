"""MindSpore as an independent oracle: the same functions, written with
``mindspore.ops`` and ``nn`` Cells, differentiated and vectorised by MindSpore's own
``ms.grad`` / ``ms.value_and_grad`` / ``ms.vmap`` / ``ms.jacrev`` / ``ms.jacfwd`` in
PyNative mode, and by fshard (which traces the same code through its adapter).

Two implementations built independently must agree; a bug in a shared rule shows
here even when fshard's own references share it.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

import fshard as fs

TOL = dict(rtol=2e-5, atol=2e-6)


def T(a, dtype=np.float32):
    return ms.Tensor(np.asarray(a, dtype))


def rand(r, *shape):
    return T(r.standard_normal(shape))


def np_(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def agree(got, want):
    g, w = fs.tree.leaves(got), fs.tree.leaves(want)
    assert len(g) == len(w), (len(g), len(w))
    for a, b in zip(g, w):
        assert np_(a).shape == np_(b).shape
        np.testing.assert_allclose(np_(a), np_(b), **TOL)


@pytest.fixture(autouse=True)
def pynative():
    assert ms.get_context("mode") == ms.PYNATIVE_MODE
    yield


# ---------------------------------------------------------------------------
# Shared cases: plain mindspore.ops code
# ---------------------------------------------------------------------------


def smooth(x):
    return ops.sum(ops.sin(x) * x * x + ops.exp(-x * x))


def two_args(x, w):
    return ops.sum(ops.tanh(ops.matmul(x, w)) ** 2)


def mlp_loss(w1, b1, w2, b2, x, y):
    h = ops.relu(ops.matmul(x, w1) + b1)
    logits = ops.matmul(h, w2) + b2
    logp = ops.log_softmax(logits, -1)
    onehot = ops.one_hot(y, 3, T(1.0), T(0.0))
    return -ops.mean(ops.sum(logp * onehot, -1))


def vector_fn(x):
    return ops.sigmoid(x) * ops.cos(x) + x * x


def mlp_params(r):
    return [rand(r, 4, 5), rand(r, 5), rand(r, 5, 3), rand(r, 3)]


def test_grad():
    x = rand(np.random.default_rng(0), 6)
    agree(fs.grad(smooth)(x), ms.grad(smooth)(x))


def test_grad_with_several_positions():
    r = np.random.default_rng(0)
    x, w = rand(r, 3, 4), rand(r, 4, 2)
    agree(fs.grad(two_args, argnums=(0, 1))(x, w),
          ms.grad(two_args, grad_position=(0, 1))(x, w))


def test_value_and_grad_of_an_mlp_loss():
    r = np.random.default_rng(0)
    params = mlp_params(r)
    x, y = rand(r, 8, 4), ms.Tensor(r.integers(0, 3, 8).astype(np.int32))
    v_fs, g_fs = fs.value_and_grad(mlp_loss, argnums=(0, 1, 2, 3))(*params, x, y)
    v_ms, g_ms = ms.value_and_grad(mlp_loss, grad_position=(0, 1, 2, 3))(*params, x, y)
    agree(v_fs, v_ms)
    agree(g_fs, g_ms)
    # and compiled
    v_jit, g_jit = fs.jit(fs.value_and_grad(mlp_loss, argnums=(0, 1, 2, 3)))(*params, x, y)
    agree(v_jit, v_ms)
    agree(g_jit, g_ms)


def per_example(x, w):  # x: (4,), w: (4, 2)
    # NB: written without a 1-D ops.matmul: ms.vmap of MatMulExt with a 1-D operand
    # returns wrong shapes or fails in MindSpore 2.10 (fs.vmap handles it; test_vmap.py)
    return ops.tanh(ops.sum(ops.expand_dims(x, 1) * w, 0)) * ops.sum(x)


@pytest.mark.parametrize("in_axes", [0, (1, None), (None, 0), (0, 1), (-1, 2)])
def test_vmap(in_axes):
    r = np.random.default_rng(0)
    x, w = r.standard_normal((3, 4)), r.standard_normal((3, 4, 2))  # batch of 3
    ax_x, ax_w = (in_axes, in_axes) if isinstance(in_axes, int) else in_axes
    x = T(x[0] if ax_x is None else np.moveaxis(x, 0, ax_x))
    w = T(w[0] if ax_w is None else np.moveaxis(w, 0, ax_w))
    agree(fs.vmap(per_example, in_axes=in_axes)(x, w),
          ms.vmap(per_example, in_axes=in_axes)(x, w))


def test_per_example_gradients():
    r = np.random.default_rng(0)
    params = mlp_params(r)
    x, y = rand(r, 6, 4), ms.Tensor(r.integers(0, 3, 6).astype(np.int32))

    def example_loss(w1, b1, w2, b2, x, y):
        return mlp_loss(w1, b1, w2, b2, x[None], y[None])

    in_axes = (None, None, None, None, 0, 0)
    got = fs.vmap(fs.grad(example_loss, argnums=(0, 1, 2, 3)), in_axes=in_axes)(*params, x, y)
    want = ms.vmap(ms.grad(example_loss, grad_position=(0, 1, 2, 3)), in_axes=in_axes)(
        *params, x, y)
    agree(got, want)


def test_grad_of_vmap():
    r = np.random.default_rng(0)
    x, w = rand(r, 5, 4), rand(r, 4, 2)

    def total(w, x):
        return ops.sum(fs.vmap(per_example, in_axes=(0, None))(x, w) ** 2)

    def total_ms(w, x):
        return ops.sum(ms.vmap(per_example, in_axes=(0, None))(x, w) ** 2)

    agree(fs.grad(total)(w, x), ms.grad(total_ms)(w, x))


@pytest.mark.parametrize("mode", ["jacrev", "jacfwd"])
def test_jacobians(mode):
    x = rand(np.random.default_rng(0), 4)
    fs_jac = getattr(fs, mode)(vector_fn)(x)
    ms_jac = getattr(ms, mode)(vector_fn)(x)
    agree(fs_jac, ms_jac)


def test_hessian():
    x = rand(np.random.default_rng(0), 3)
    agree(fs.hessian(smooth)(x), ms.jacfwd(ms.jacrev(smooth))(x))


def test_jvp():
    r = np.random.default_rng(0)
    x, t = rand(r, 4), rand(r, 4)
    out, t_out = fs.jvp(vector_fn, (x,), (t,))
    ms_out, ms_t = ms.jvp(vector_fn, x, t)
    agree((out, t_out), (ms_out, ms_t))


def test_vjp():
    r = np.random.default_rng(0)
    x, ct = rand(r, 4), rand(r, 4)
    out, f_vjp = fs.vjp(vector_fn, x)
    ms_out, ms_vjp = ms.vjp(vector_fn, x)
    agree(out, ms_out)
    agree(f_vjp(ct)[0], ms_vjp(ct)[0])


# ---------------------------------------------------------------------------
# An nn.Cell: its parameters' gradients
# ---------------------------------------------------------------------------


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(4, 8)
        self.act = nn.GELU()
        self.fc2 = nn.Dense(8, 3)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_cell_parameter_gradients():
    ms.set_seed(0)
    net = Net()
    r = np.random.default_rng(0)
    x, y = rand(r, 6, 4), ms.Tensor(r.integers(0, 3, 6).astype(np.int32))
    loss_cell = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def loss(x, y):
        return loss_cell(net(x), y)

    weights = net.trainable_params()
    want = ms.grad(loss, grad_position=None, weights=weights)(x, y)
    apply, params = fs.functional(net)
    got = fs.grad(lambda p, x, y: loss_cell(apply(p, x), y))(params, x, y)
    agree([got[w.name] for w in weights], want)


def test_custom_vjp_matches_mindspore_custom_bprop():
    # MindSpore's own custom derivative: a Cell with a bprop
    class ClipGrad(nn.Cell):
        def construct(self, x):
            return x * 1.0

        def bprop(self, x, out, dout):
            return (ops.clip_by_value(dout, T(-1.0), T(1.0)),)

    @fs.custom_vjp
    def clip(x):
        return x

    clip.defvjp(lambda x: (x, None), lambda _, g: (fs.ops.minimum(fs.ops.maximum(g, -1.0), 1.0),))
    x = T([-2.0, 0.1, 0.7, 3.0])
    cell = ClipGrad()
    want = ms.grad(lambda x: ops.sum(3.0 * cell(x) ** 2))(x)
    got = fs.grad(lambda x: ops.sum(3.0 * clip(x) ** 2))(x)
    agree(got, want)


# ---------------------------------------------------------------------------
# Result dtypes and values of reductions, for every input dtype
# ---------------------------------------------------------------------------

REDUCTIONS = {
    "ops.sum": lambda a: ops.sum(a), "Tensor.sum": lambda a: a.sum(),
    "mint.sum": lambda a: ms.mint.sum(a), "ops.sum(axis)": lambda a: ops.sum(a, 0),
    "ops.ReduceSum": lambda a: ops.ReduceSum()(a),
    "ops.ReduceSum(keep_dims)": lambda a: ops.ReduceSum(keep_dims=True)(a, 0),
    "ops.mean": lambda a: ops.mean(a), "Tensor.mean": lambda a: a.mean(),
    "mint.mean": lambda a: ms.mint.mean(a), "ops.mean(axis)": lambda a: ops.mean(a, 0),
    "ops.ReduceMean": lambda a: ops.ReduceMean()(a),
    "ops.amax": lambda a: ops.amax(a), "ops.amin": lambda a: ops.amin(a),
    "ops.argmax": lambda a: ops.argmax(a),
}
# Values chosen where dtype rules matter: sums that overflow the input dtype, means
# that are not integers, a float16 sum beyond float16's range.
REDUCTION_INPUTS = {
    "bool": np.array([True, True, False, True]),
    "int8": np.array([100, 100, -3, 7], np.int8),
    "int16": np.array([30000, 30000, -5, 2], np.int16),
    "int32": np.array([2**31 - 1, 1, 5, -2], np.int32),
    "int64": np.array([2**40, 3, -7, 1], np.int64),
    "uint8": np.array([250, 10, 3, 1], np.uint8),
    "float16": np.array([60000, 60000, -1.5, 2.25], np.float16),
    "float32": np.array([1.5, -2.25, 3.0, 1e-3], np.float32),
    "float64": np.array([1e8 + 1, -1e8, 0.5, 0.25], np.float64),
}


def _result(fn, x):
    try:
        out = fn(x)
    except Exception as e:  # noqa: BLE001  (compared: both must refuse)
        return ("error", type(e).__name__)
    return (out.dtype, out.asnumpy().tolist())


@pytest.mark.parametrize("dtype", list(REDUCTION_INPUTS))
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reductions_keep_mindspores_dtype_and_value(name, dtype):
    fn, x = REDUCTIONS[name], ms.Tensor(REDUCTION_INPUTS[dtype])
    want = _result(fn, x)
    got = _result(fs.jit(fn), x)
    if want[0] == "error":
        assert got[0] == "error", f"MindSpore refuses {name} of {dtype}, fshard gave {got}"
        return
    assert got[0] == want[0], f"{name} of {dtype}: dtype {got[0]}, MindSpore {want[0]}"
    np.testing.assert_allclose(np.asarray(got[1], np.float64), np.asarray(want[1], np.float64),
                               rtol=1e-6 if dtype != "float16" else 1e-3)
