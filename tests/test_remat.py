"""fs.remat: gradients equal the plain ones under every transform; the backward pass
keeps only what the policy saves and recomputes the rest; cell.recompute() is honoured."""

from __future__ import annotations

import re

import numpy as np
import pytest
from mindspore import Tensor, nn, ops

import fshard as fs
from fshard.transforms.remat import saved_residuals

RNG = np.random.default_rng(0)
W1 = (RNG.standard_normal((8, 16)) * 0.3).astype(np.float32)
W2 = (RNG.standard_normal((16, 8)) * 0.3).astype(np.float32)
X = RNG.standard_normal((4, 8)).astype(np.float32)


def n(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def assert_grads_equal(got, want, rtol=1e-5):
    for a, b in zip(got, want, strict=True):
        b = n(b)
        np.testing.assert_allclose(n(a), b, rtol=rtol, atol=rtol * float(np.abs(b).max()))


def block(w1, w2, h):
    return h + ops.sin(ops.relu(h @ w1)) @ w2


def make_loss(f):
    def loss(w1, w2, x):
        return (f(w1, w2, f(w1, w2, x)) ** 2).sum()
    return loss


PLAIN = make_loss(block)
WANT = fs.grad(PLAIN, argnums=(0, 1))(W1, W2, X)
POLICIES = [None, "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable",
            fs.remat_policies.save_only_these_names("h")]


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_grad_equals_the_plain_gradient(policy):
    loss = make_loss(fs.remat(block, policy=policy))
    assert_grads_equal(fs.grad(loss, argnums=(0, 1))(W1, W2, X), WANT)


def test_jit_grad_equals_and_the_compiled_program_recomputes():
    """The lowered program runs the forward matmuls again in the backward pass (behind
    ops.depend on a cotangent, so MindSpore's CSE keeps them apart)."""
    g_remat = fs.jit(fs.grad(make_loss(fs.remat(block)), argnums=(0, 1)))
    g_plain = fs.jit(fs.grad(PLAIN, argnums=(0, 1)))
    assert_grads_equal(g_remat(W1, W2, X), WANT)
    text_r, text_p = g_remat.lower(W1, W2, X).as_text(), g_plain.lower(W1, W2, X).as_text()
    # Two blocks: the backward pass recomputes h @ w1 of each (two more matmuls).
    def matmuls(text):
        return len(re.findall(r"= (?:ms_matmul|MatMul|BatchMatMul)_\d+\(", text))

    assert matmuls(text_r) == matmuls(text_p) + 2
    assert "Depend" in text_r and "Depend" not in text_p


def test_vmap_of_grad_gives_per_example_gradients():
    loss = make_loss(fs.remat(block, policy="dots_saveable"))
    got = fs.vmap(fs.grad(loss, argnums=(0, 1)), in_axes=(None, None, 0))(W1, W2, X[:, None])
    want = fs.vmap(fs.grad(PLAIN, argnums=(0, 1)), in_axes=(None, None, 0))(W1, W2, X[:, None])
    assert_grads_equal(got, want)


def test_grad_of_vmapped_remat():
    f = fs.vmap(fs.remat(block), in_axes=(None, None, 0))

    def loss(w1, w2, x):
        return (f(w1, w2, x[:, None]) ** 2).sum()

    want = fs.grad(lambda a, b, x: (block(a, b, x) ** 2).sum(), argnums=(0, 1))(W1, W2, X)
    assert_grads_equal(fs.grad(loss, argnums=(0, 1))(W1, W2, X), want)


def test_shard_of_grad_on_a_virtual_mesh():
    loss = make_loss(fs.remat(block))
    g = fs.jit(fs.shard(fs.grad(loss, argnums=(0, 1)), in_strategy=(None, None, (4, 1)),
                        mesh=4))
    assert_grads_equal(g(W1, W2, X), WANT, rtol=1e-4)


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.full)],
                         ids=["eager", "jit"])
def test_remat_inside_a_scan_body(full):
    ws = (RNG.standard_normal((6, 8, 8)) * 0.3).astype(np.float32)

    def layer(w, h):
        return ops.tanh(ops.sin(h @ w) @ w)

    def loss(ws, x, f):
        h, _ = fs.scan(lambda h, w: (f(w, h), None), x, ws)
        return (h ** 2).sum()

    want = fs.grad(loss)(ws, X, layer)
    for f in (fs.remat(layer), fs.remat(layer, policy="dots_saveable")):
        np.testing.assert_allclose(n(fs.grad(loss)(ws, X, f)), n(want), rtol=1e-5, atol=1e-6)
    if full:
        got = fs.jit(fs.grad(loss), static_argnums=2)(ws, X, fs.remat(layer))
        np.testing.assert_allclose(n(got), n(want), rtol=1e-5, atol=1e-6)


def test_forward_mode_and_second_derivatives():
    f = fs.remat(lambda x: ops.sin(ops.exp(x) * x))
    g = lambda x: ops.sin(ops.exp(x) * x)  # noqa: E731
    x = np.linspace(-1, 1, 5).astype(np.float32)
    t = np.ones(5, np.float32)
    np.testing.assert_allclose(n(fs.jvp(f, (x,), (t,))[1]), n(fs.jvp(g, (x,), (t,))[1]),
                               rtol=1e-6)
    h = fs.grad(lambda x: fs.grad(lambda y: f(y).sum())(x).sum())(x)
    h0 = fs.grad(lambda x: fs.grad(lambda y: g(y).sum())(x).sum())(x)
    np.testing.assert_allclose(n(h), n(h0), rtol=1e-5, atol=1e-6)


def test_closed_over_values_are_differentiated():
    def loss(w1, w2, x):
        inner = fs.remat(lambda h: block(w1, w2, h))  # closes over w1, w2
        return (inner(inner(x)) ** 2).sum()

    assert_grads_equal(fs.grad(loss, argnums=(0, 1))(W1, W2, X), WANT)


# --- what the backward pass keeps ----------------------------------------------------


def _mlp(depth, width=32, batch=16):
    ws = [(RNG.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
          for _ in range(depth)]
    x = RNG.standard_normal((batch, width)).astype(np.float32)
    return ws, x


def _mlp_loss(layer):
    def loss(ws, x):
        h = x
        for w in ws:
            h = layer(w, h)
        return (h ** 2).mean()
    return loss


def _mlp_layer(w, h):
    return h + ops.gelu(fs.checkpoint_name(h @ w, "pre"))


def _nbytes(avals):
    return sum(int(np.prod(a.shape)) * 4 for a in avals)


def test_residuals_of_a_24_layer_mlp_follow_the_policy():
    """Per layer of ``h + gelu(h @ w)`` with batch 16 and width 32 (one activation is
    2 KiB): without remat the backward pass keeps the matmul output and gelu's
    intermediates; with remat only the layer's output (the next layer's input); with
    the dots (or the named 'pre') policy also the matmul output."""
    ws, x = _mlp(24)
    act = 16 * 32 * 4
    plain = _nbytes(saved_residuals(_mlp_loss(_mlp_layer), ws, x))
    per_layer = {}
    for policy in (None, "dots_saveable", fs.remat_policies.save_only_these_names("pre")):
        res = saved_residuals(_mlp_loss(fs.remat(_mlp_layer, policy=policy)), ws, x)
        per_layer[str(policy)] = _nbytes(res) / 24
    assert plain / 24 > 3 * act
    assert per_layer["None"] <= act + 8  # the layer output (and the scalar loss)
    assert per_layer["dots_saveable"] <= 2 * act + 8
    assert per_layer[str(fs.remat_policies.save_only_these_names("pre"))] <= 2 * act + 8
    ws, x = ws[:3], x
    want = fs.grad(_mlp_loss(_mlp_layer))(ws, x)
    assert_grads_equal(fs.grad(_mlp_loss(fs.remat(_mlp_layer)))(ws, x), want)


def test_a_name_the_policy_saves_is_not_recomputed():
    def layer(w, h):
        a = fs.checkpoint_name(h @ w, "a")
        return ops.sin(a) * h

    def loss(w, x, f):
        return (f(w, f(w, x)) ** 2).sum()

    def matmuls(f):
        ir = fs.make_ir(fs.grad(loss), static_argnums=2)(w, X, f)
        return sum(eq.prim.name == "matmul" for eq in ir.program.equations)

    w = (RNG.standard_normal((8, 8)) * 0.3).astype(np.float32)
    kept = fs.remat(layer, policy=fs.remat_policies.save_only_these_names("a"))
    assert matmuls(kept) == matmuls(layer)  # the saved 'a' is not recomputed
    assert matmuls(fs.remat(layer)) == matmuls(layer) + 2
    assert matmuls(fs.remat(layer, policy=fs.remat_policies.save_any_names_but_these("a"))) \
        == matmuls(layer) + 2
    want = fs.grad(loss)(w, X, layer)
    np.testing.assert_allclose(n(fs.grad(loss)(w, X, kept)), n(want), rtol=1e-5, atol=1e-6)


# --- MindSpore's cell.recompute() ------------------------------------------------------


def test_cell_recompute_is_honoured():
    nets = []
    for recompute in (False, True):
        net = nn.SequentialCell([nn.Dense(8, 16, activation="tanh"), nn.Dense(16, 8)])
        if recompute:
            net.cell_list[0].recompute()
        nets.append(net)
    apply0, params = fs.functional(nets[0])
    apply1, _ = fs.functional(nets[1])

    def loss(apply):
        return lambda p, x: (apply(p, x) ** 2).sum()

    ir = str(fs.make_ir(fs.grad(loss(apply1)))(params, X))
    assert "remat_barrier" in ir
    assert "remat_barrier" not in str(fs.make_ir(fs.grad(loss(apply0)))(params, X))
    want = fs.grad(loss(apply0))(params, X)
    got = fs.jit(fs.grad(loss(apply1)))(params, X)
    for k in want:
        np.testing.assert_allclose(n(got[k]), n(want[k]), rtol=1e-5, atol=1e-6)


def test_remat_of_a_cell_and_eager_calls():
    net = nn.Dense(8, 8)
    x = Tensor(X)
    np.testing.assert_allclose(n(fs.remat(net)(x)), n(net(x)), rtol=1e-6)
    # eager: NumPy arguments reach the function as Tensors, as under fs.jit
    np.testing.assert_allclose(n(fs.remat(block)(W1, W2, X)), n(fs.jit(block)(W1, W2, X)),
                               rtol=1e-6)


# --- errors -------------------------------------------------------------------------


def test_errors_name_the_argument_and_the_fix():
    with pytest.raises(fs.ArgumentError, match=r"(?s)policy='dots'.*dots_saveable.*Fix"):
        fs.remat(block, policy="dots")
    with pytest.raises(fs.ArgumentError, match=r"(?s)policy=\.\.\..*got int 3.*Fix"):
        fs.remat(block, policy=3)
    with pytest.raises(fs.ArgumentError, match=r"(?s)name must be a str, got int 1.*Fix"):
        fs.checkpoint_name(np.ones(2, np.float32), 1)
    with pytest.raises(fs.ArgumentError, match=r"(?s)every name must be a str.*Fix"):
        fs.remat_policies.save_only_these_names(["a"])
    with pytest.raises(fs.ArgumentError, match=r"(?s)fs.remat expects a function.*got int 3.*Fix"):
        fs.remat(3)
    assert isinstance(fs.ArgumentError("x"), (TypeError, ValueError))


def test_shard_of_remat_and_grad_of_shard():
    """An undifferentiated remat_call is partitioned like its body (data parallel
    here), and grad(shard(f)) differentiates through it."""
    f = fs.remat(block)
    s = fs.shard(f, in_strategy=(None, None, (4, 1)), mesh=4)
    np.testing.assert_allclose(n(s(W1, W2, X)), n(fs.jit(block)(W1, W2, X)), rtol=1e-5,
                               atol=1e-5)
    part = s.partitioned(W1, W2, X)
    eq = next(e for e in part.program.equations if e.prim.name == "remat_call")
    assert eq.outputs[0].aval.shape == (1, 8)  # each device runs its quarter of the batch

    def loss(w1, w2, x):
        return (s(w1, w2, x) ** 2).sum()

    want = fs.grad(lambda a, b, x: (block(a, b, x) ** 2).sum(), argnums=(0, 1))(W1, W2, X)
    assert_grads_equal(fs.grad(loss, argnums=(0, 1))(W1, W2, X), want, rtol=1e-4)


def test_remat_in_pipeline_stages():
    """A rematted layer in each of two pipeline stages: the step equals the plain one."""
    def layer(w, h):
        return ops.tanh(ops.sin(h @ w) @ w)

    def make(f):
        def loss(p, x, y):
            h = fs.pipeline_split(f(p["w1"], x))
            return ((f(p["w2"], h) - y) ** 2).mean()
        return loss

    p = {"w1": (RNG.standard_normal((8, 8)) * 0.3).astype(np.float32),
         "w2": (RNG.standard_normal((8, 8)) * 0.3).astype(np.float32)}
    x, y = RNG.standard_normal((8, 8)).astype(np.float32), RNG.standard_normal((8, 8))
    y = y.astype(np.float32)
    out = []
    for f in (layer, fs.remat(layer)):
        ap = fs.AutoParallel(make(f), fs.optim.sgd(0.1), mesh=2).pipeline(stages=2,
                                                                          micro_batches=2)
        state, value = ap(ap.init(p), x, y)
        out.append((state.params, float(n(value))))
    assert out[1][1] == pytest.approx(out[0][1], rel=1e-6)
    for k in p:
        np.testing.assert_allclose(n(out[1][0][k]), n(out[0][0][k]), rtol=1e-5, atol=1e-6)


def test_an_output_and_a_recomputed_value_from_one_equation():
    """split gives an output of the function and a value its derivative recomputes:
    the recomputation defines both (the output is not also an input of it)."""
    def f(x):
        a, b = fs.ops.split(ops.sin(x), [2, 2], 0)
        return a, ops.exp(b) * a

    def loss(x, f):
        a, e = f(x)
        return (a * e).sum()

    x = RNG.standard_normal((4, 3)).astype(np.float32)
    want = fs.grad(loss)(x, f)
    for g in (fs.grad(loss)(x, fs.remat(f)), fs.jit(fs.grad(loss), static_argnums=1)(
            x, fs.remat(f))):
        np.testing.assert_allclose(n(g), n(want), rtol=1e-5, atol=1e-6)
