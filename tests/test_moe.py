"""fs.nn.moe: routing against a NumPy reference, capacity drops, and expert
parallelism on a virtual mesh against the unsplit layer."""

from __future__ import annotations

import re

import numpy as np
import pytest

import fshard as fs
from fshard.primitives.collectives import named_axis

E, H, F = 8, 6, 10


def expert(p, t):
    return fs.ops.matmul(fs.ops.silu(fs.ops.matmul(t, p["w1"])), p["w2"])


def _np_expert(p, e, t):
    a = t @ p["w1"][e]
    return (a / (1 + np.exp(-a))) @ p["w2"][e]


def _data(tokens, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, H)).astype(np.float32)
    router = rng.normal(size=(H, E)).astype(np.float32)
    params = {"w1": rng.normal(0, 0.4, (E, H, F)).astype(np.float32),
              "w2": rng.normal(0, 0.4, (E, F, H)).astype(np.float32)}
    return x, router, params


def _np_moe(x, router, params, k, capacity):
    """GShard routing in NumPy: first choices claim slots first, in token order."""
    x64 = x.astype(np.float64)
    logits = x64 @ router
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    order = np.argsort(-probs, 1, kind="stable")[:, :k]
    gates = np.take_along_axis(probs, order, 1)
    if k > 1:
        gates /= gates.sum(1, keepdims=True)
    used = np.zeros(E, int)
    y = np.zeros_like(x64)
    for choice in range(k):
        for t in range(len(x)):
            e = order[t, choice]
            if used[e] < capacity:
                y[t] += gates[t, choice] * _np_expert(params, e, x64[t:t + 1])[0]
            used[e] += 1
    first = np.eye(E)[order[:, 0]]
    aux = E * (first.mean(0) * probs.mean(0)).sum()
    return y, aux


@pytest.mark.parametrize("k,capacity", [(2, 3), pytest.param(1, 16, marks=pytest.mark.full),
                                        pytest.param(2, 32, marks=pytest.mark.full),
                                        pytest.param(1, 2, marks=pytest.mark.full)])
def test_moe_matches_numpy_routing(k, capacity):
    x, router, params = _data(16)
    y, aux = fs.jit(lambda *a: fs.nn.moe(*a[:2], expert, a[2], k=k, capacity=capacity))(
        x, router, params)
    want_y, want_aux = _np_moe(x, router, params, k, capacity)
    np.testing.assert_allclose(y.asnumpy(), want_y, rtol=1e-4, atol=1e-5 * np.abs(want_y).max())
    np.testing.assert_allclose(float(aux.asnumpy()), want_aux, rtol=1e-5)
    if capacity < 16:   # some tokens were dropped: their rows are zero or one-expert
        assert np.abs(want_y).sum(1).min() < np.abs(want_y).sum(1).max()


def _ep(n, k, capacity):
    mesh = fs.Mesh((n,), ("ep",))
    tokens = mesh.layout("ep", "None")
    experts = mesh.layout("ep", "None", "None")

    def layer(x, router, params):
        return fs.nn.moe(x, router, expert, params, k=k, capacity=capacity, axis_name="ep")

    return fs.shard_map(layer, mesh=mesh, in_strategy=(tokens, None, experts),
                        out_strategy=(tokens, None))


def test_expert_parallel_layer_equals_the_unsplit_layer_per_group():
    n, k, capacity = 4, 2, 3
    x, router, params = _data(32, seed=1)
    y, aux = _ep(n, k, capacity)(x, router, params)
    groups = [fs.nn.moe(g, router, expert, params, k=k, capacity=capacity)
              for g in np.split(x, n)]
    want = np.concatenate([g[0].asnumpy() for g in groups])
    np.testing.assert_allclose(y.asnumpy(), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(float(aux.asnumpy()),
                               np.mean([float(g[1].asnumpy()) for g in groups]), rtol=1e-5)


def test_expert_parallel_gradients_equal_the_unsplit_gradients():
    n, k, capacity = 2, 2, 4
    x, router, params = _data(16, seed=2)
    ep = _ep(n, k, capacity)

    def loss(x, router, params):
        y, aux = ep(x, router, params)
        return (y * y).sum() + 0.1 * aux

    def ref(x, router, params):
        ys, auxes = zip(*(fs.nn.moe(g, router, expert, params, k=k, capacity=capacity)
                          for g in fs.ops.split(x, 8, 0)))
        y = fs.ops.concat(list(ys), 0)
        return (y * y).sum() + 0.1 * (auxes[0] + auxes[1]) / 2

    got = fs.jit(fs.grad(loss, argnums=(0, 1, 2)))(x, router, params)
    want = fs.grad(ref, argnums=(0, 1, 2))(x, router, params)
    for g, w in zip(fs.tree.leaves(got), fs.tree.leaves(want)):
        w = w.asnumpy()
        np.testing.assert_allclose(g.asnumpy(), w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


def test_expert_parallelism_is_two_all_to_alls_per_layer():
    n = 4
    x, router, params = _data(8)
    local = {name: p[:E // n] for name, p in params.items()}
    with named_axis("ep", n):
        ir = str(fs.make_ir(lambda x, r, p: fs.nn.moe(x, r, expert, p, k=2, capacity=3,
                                                      axis_name="ep"))(x, router, local))
    assert len(re.findall(r"= all_to_all\[", ir)) == 2
    assert len(re.findall(r"= pmean\[|= psum\[", ir)) == 1      # the aux loss only
    assert not re.search(r"= (all_gather|ppermute|psum_scatter)\[", ir)


def test_moe_errors_name_the_argument_and_the_fix():
    x, router, params = _data(8)
    with pytest.raises(fs.ArgumentError, match="capacity must be a positive int"):
        fs.nn.moe(x, router, expert, params, capacity=0)
    with pytest.raises(fs.ArgumentError, match="k=9 is more than the 8 experts"):
        fs.nn.moe(x, router, expert, params, k=9, capacity=2)
    with pytest.raises(fs.ArgumentError, match=r"x.reshape\(-1, hidden\)"):
        fs.nn.moe(x[None], router, expert, params, capacity=2)
    with pytest.raises(fs.ArgumentError, match="leading experts dimension of 8"):
        fs.nn.moe(x, router, expert, {"w1": params["w1"][:4], "w2": params["w2"]},
                  capacity=2)
    with pytest.raises(fs.ArgumentError, match="do not split over the 3 devices"):
        with named_axis("ep", 3):
            fs.make_ir(lambda x: fs.nn.moe(x, router, expert, params, capacity=2,
                                           axis_name="ep"))(x)
