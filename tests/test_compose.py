"""The composition matrix: a corpus of small programs under every stack of
``jit``, ``vmap`` and the ``grad`` family, each checked against the math
(NB: JAX ``core_test.test_specs``, the autodidax stress test).

A corpus entry is ``fn(p, x)``: ``p`` a pytree of float64 parameters (what is
differentiated), ``x`` one example (a pytree, possibly with integer leaves; stacked
along axis 0 for vmap), and ``ref(p, x)``, the same function in NumPy. Derivatives
are checked against central finite differences of ``ref`` in float64, vmap against
loop-and-stack. Pytree outputs are reduced to a scalar ``loss`` with fixed random
weights. Only ``jit(grad)`` and ``jit(vmap(grad))`` compile (two graphs per entry);
every other ``jit`` position is inlined by the enclosing transform.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs
from fshard import ops

F64 = np.float64
BATCH = 3


def np_(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def tensors(tree):
    """The pytree with every leaf a MindSpore Tensor (what a MindSpore user passes)."""
    return fs.tree.map(lambda a: ms.Tensor(np.asarray(a)), tree)


def tree_close(got, want, tol=1e-6, what=""):
    g_leaves, g_tree = fs.tree.flatten(got)
    w_leaves, w_tree = fs.tree.flatten(want)
    assert g_tree == w_tree, f"{what}: structure {g_tree} != {w_tree}"
    for g, w in zip(g_leaves, w_leaves):
        np.testing.assert_allclose(np_(g), np_(w), rtol=tol, atol=tol, err_msg=what)


# ---------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    name: str
    fn: Callable        # fn(p, x) -> pytree of arrays (fshard)
    ref: Callable       # ref(p, x) -> the same pytree (NumPy)
    params: Callable    # params(rng) -> pytree of float64 arrays
    example: Callable   # example(rng) -> one example (pytree)
    forward_mode: bool = True  # False: a custom_vjp inside, jvp must raise


W_CLOSED = np.random.default_rng(1).standard_normal((3, 4))
V_CLOSED = np.random.default_rng(2).standard_normal(4)


def closure_fn(p, x):  # closes over two NumPy arrays
    h = ops.tanh(ops.matmul(x * p["s"], W_CLOSED))
    return ops.matmul(h, V_CLOSED) + p["c"]


def closure_ref(p, x):
    return np.tanh((x * p["s"]) @ W_CLOSED) @ V_CLOSED + p["c"]


def fan_out_fn(p, x):  # y feeds three consumers
    y = ops.sin(x * p)
    return y * y + ops.exp(y) * y


def fan_out_ref(p, x):
    y = np.sin(x * p)
    return y * y + np.exp(y) * y


def pytree_fn(p, x):  # pytrees in and out, a list and a tuple inside
    h = ops.tanh(ops.matmul(p["w"], x["u"]) + p["b"][0])
    return {"h": h, "stats": [(h * x["k"]).sum(), h.mean()]}


def pytree_ref(p, x):
    h = np.tanh(p["w"] @ x["u"] + p["b"][0])
    return {"h": h, "stats": [(h * x["k"]).sum(), h.mean()]}


class Tiny(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(3, 2)
        self.act = nn.Tanh()

    def construct(self, x):
        return self.act(self.dense(x))


ms.set_seed(0)
_CELL = Tiny()
_APPLY, _CELL_PARAMS = fs.functional(_CELL)


def cell_fn(p, x):  # an nn.Cell used functionally
    return _APPLY(p, x[None])[0]


def cell_ref(p, x):
    return np.tanh(p["dense.weight"] @ x + p["dense.bias"])


def xent_fn(p, x):  # softmax cross-entropy with an integer label
    feat, label = x
    logits = ops.matmul(feat[None], p["w"]) + p["b"]
    return ops.softmax_cross_entropy(logits, label[None])


def xent_ref(p, x):
    feat, label = x
    z = feat @ p["w"] + p["b"]
    return -(z[label] - np.log(np.exp(z).sum()))


@fs.custom_jvp
def softplus(x):
    return ops.maximum(x, 0.0) + ops.log(1.0 + ops.exp(-ops.abs(x)))


softplus.defjvp(lambda p, t: (softplus(p[0]), t[0] * ops.sigmoid(p[0])))


@fs.custom_vjp
def tanh_vjp(x):
    return ops.tanh(x)


def _tanh_fwd(x):
    y = ops.tanh(x)
    return y, y


tanh_vjp.defvjp(_tanh_fwd, lambda y, ct: (ct * (1.0 - y * y),))


def custom_jvp_fn(p, x):
    return (softplus(x * p) * x).sum()


def custom_jvp_ref(p, x):
    return (np.logaddexp(0, x * p) * x).sum()


def custom_vjp_fn(p, x):
    return (tanh_vjp(x * p) ** 2).sum()


def custom_vjp_ref(p, x):
    return (np.tanh(x * p) ** 2).sum()


CORPUS = [
    Case("closure", closure_fn, closure_ref,
         lambda r: {"s": r.standard_normal(3), "c": np.float64(0.5)},
         lambda r: r.standard_normal(3)),
    Case("fan_out", fan_out_fn, fan_out_ref,
         lambda r: r.standard_normal(3), lambda r: r.standard_normal(3)),
    Case("pytrees", pytree_fn, pytree_ref,
         lambda r: {"w": r.standard_normal((2, 3)), "b": [r.standard_normal(2)]},
         lambda r: {"u": r.standard_normal(3), "k": r.standard_normal(2)}),
    Case("cell", cell_fn, cell_ref,
         lambda r: {k: v.asnumpy().astype(F64) for k, v in _CELL_PARAMS.items()},
         lambda r: r.standard_normal(3)),
    Case("cross_entropy", xent_fn, xent_ref,
         lambda r: {"w": r.standard_normal((3, 4)), "b": r.standard_normal(4)},
         lambda r: (r.standard_normal(3), np.int32(r.integers(0, 4)))),
    Case("custom_jvp", custom_jvp_fn, custom_jvp_ref,
         lambda r: r.standard_normal(3), lambda r: 2.0 * r.standard_normal(3)),
    Case("custom_vjp", custom_vjp_fn, custom_vjp_ref,
         lambda r: r.standard_normal(3), lambda r: r.standard_normal(3),
         forward_mode=False),
]


# ---------------------------------------------------------------------------
# References: loss, finite differences, loop-and-stack
# ---------------------------------------------------------------------------


class Setup:
    """A corpus entry's data and its NumPy reference derivatives."""

    def __init__(self, case: Case):
        r = np.random.default_rng(0)
        self.case = case
        self.p = case.params(r)
        examples = [case.example(r) for _ in range(BATCH)]
        self.x0 = examples[0]
        self.xs = fs.tree.map(lambda *ls: np.stack(ls), *examples)
        self.examples = examples
        out = case.ref(self.p, self.x0)
        self.weights = fs.tree.map(lambda o: r.standard_normal(np.shape(o)), out)
        self.leaves, self.treedef = fs.tree.flatten(self.p)
        self.sizes = [np.size(leaf) for leaf in self.leaves]

    # the scalar functions the grad stacks differentiate
    def loss(self, p, x):
        out = self.case.fn(p, x)
        terms = fs.tree.leaves(fs.tree.map(lambda o, w: (o * w).sum(), out, self.weights))
        total = terms[0]
        for t in terms[1:]:
            total = total + t
        return total

    def loss_ref(self, p, x):
        out = self.case.ref(p, x)
        return sum(float(np.sum(np.asarray(o) * w)) for o, w in zip(
            fs.tree.leaves(out), fs.tree.leaves(self.weights)))

    # flat <-> pytree parameters
    def flat(self, p) -> np.ndarray:
        return np.concatenate([np.ravel(np_(leaf)) for leaf in fs.tree.leaves(p)])

    def unflat(self, v):
        leaves, i = [], 0
        for leaf, n in zip(self.leaves, self.sizes):
            leaves.append(np.asarray(v[i:i + n]).reshape(np.shape(leaf)))
            i += n
        return fs.tree.unflatten(self.treedef, leaves)

    def num_grad(self, x, v=None, eps=1e-6) -> np.ndarray:
        v = self.flat(self.p) if v is None else v
        g = np.zeros_like(v)
        for i in range(v.size):
            e = np.zeros_like(v)
            e[i] = eps
            g[i] = (self.loss_ref(self.unflat(v + e), x)
                    - self.loss_ref(self.unflat(v - e), x)) / (2 * eps)
        return g

    def num_hessian(self, x, eps=1e-4) -> np.ndarray:
        v = self.flat(self.p)
        cols = []
        for i in range(v.size):
            e = np.zeros_like(v)
            e[i] = eps
            cols.append((self.num_grad(x, v + e, 1e-5) - self.num_grad(x, v - e, 1e-5))
                        / (2 * eps))
        return np.stack(cols, axis=1)

    def num_jvp(self, x, tp, eps=1e-6):
        """d/dt ref(p + t tp, x) (a pytree like the output)."""
        v, t = self.flat(self.p), self.flat(tp)
        plus = self.case.ref(self.unflat(v + eps * t), x)
        minus = self.case.ref(self.unflat(v - eps * t), x)
        return fs.tree.map(lambda a, b: (np.asarray(a) - np.asarray(b)) / (2 * eps), plus, minus)

    def tangent(self):
        r = np.random.default_rng(7)
        return self.unflat(r.standard_normal(self.flat(self.p).size))

    def loop(self, f):
        """Stack ``f(example)`` over the batch."""
        outs = [f(x) for x in self.examples]
        return fs.tree.map(lambda *ls: np.stack([np_(o) for o in ls]), *outs)


SETUPS = {c.name: Setup(c) for c in CORPUS}


# ---------------------------------------------------------------------------
# The stacks
# ---------------------------------------------------------------------------


def per_example_grads_ref(s):
    return np.stack([s.num_grad(x) for x in s.examples])


def flat_batched(s, grads):
    """Per-example gradient pytree (leading batch axis) -> (BATCH, n) matrix."""
    leaves = [np_(leaf).reshape(BATCH, -1) for leaf in fs.tree.leaves(grads)]
    return np.concatenate(leaves, axis=1)


def stack_vmap_grad(s):
    g = fs.vmap(fs.grad(s.loss), in_axes=(None, 0))(s.p, tensors(s.xs))
    np.testing.assert_allclose(flat_batched(s, g), per_example_grads_ref(s), rtol=1e-6,
                               atol=1e-7)


def stack_grad_vmap_summed(s):
    def total(p):
        return fs.vmap(s.loss, in_axes=(None, 0))(p, tensors(s.xs)).sum()

    g = fs.grad(total)(s.p)
    np.testing.assert_allclose(s.flat(g), per_example_grads_ref(s).sum(0), rtol=1e-6,
                               atol=1e-7)


def stack_grad_grad(s):
    # a Hessian-vector product: grad of <grad(loss), u>
    u = s.tangent()

    def directional(p):
        g = fs.grad(s.loss)(p, tensors(s.x0))
        terms = fs.tree.leaves(fs.tree.map(lambda a, b: (a * b).sum(), g, u))
        return sum(terms[1:], terms[0])

    hvp = s.flat(fs.grad(directional)(s.p))
    np.testing.assert_allclose(hvp, s.num_hessian(s.x0) @ s.flat(u), rtol=1e-5, atol=1e-5)


def stack_jacfwd_jacrev(s):
    h = fs.jacfwd(fs.jacrev(s.loss))(s.p, tensors(s.x0))
    # h[i][j]: block d2 loss / dp_i dp_j of shape p_i.shape + p_j.shape
    rows = []
    blocks = s.treedef.flatten_up_to(h)  # one p-shaped subtree of blocks per leaf of p
    for leaf_i, row in zip(s.leaves, blocks):
        parts = [np_(b).reshape(np.size(leaf_i), -1) for b in fs.tree.leaves(row)]
        rows.append(np.concatenate(parts, axis=1))
    np.testing.assert_allclose(np.concatenate(rows, axis=0), s.num_hessian(s.x0), rtol=1e-5,
                               atol=1e-6)


def _half(a):
    return a * 0.5 if np.asarray(a).dtype.kind == "f" else a


def stack_vmap_vmap(s):
    xss = fs.tree.map(lambda a: np.stack([a, _half(a)]), s.xs)  # (2, BATCH, ...)
    f = fs.vmap(fs.vmap(s.case.fn, in_axes=(None, 0)), in_axes=(None, 0))
    got = f(s.p, tensors(xss))
    want = [s.loop(lambda x: s.case.ref(s.p, x))]
    half = [fs.tree.map(_half, x) for x in s.examples]
    want.append(fs.tree.map(lambda *ls: np.stack(ls),
                            *[s.case.ref(s.p, x) for x in half]))
    tree_close(got, fs.tree.map(lambda a, b: np.stack([a, b]), *want), what="vmap(vmap)")


def stack_jit_grad(s):
    g = fs.jit(fs.grad(s.loss))(s.p, tensors(s.x0))
    np.testing.assert_allclose(s.flat(g), s.num_grad(s.x0), rtol=1e-6, atol=1e-7)


def stack_grad_jit(s):
    g = fs.grad(fs.jit(s.loss))(s.p, tensors(s.x0))
    np.testing.assert_allclose(s.flat(g), s.num_grad(s.x0), rtol=1e-6, atol=1e-7)


def stack_vmap_jit(s):
    got = fs.vmap(fs.jit(s.case.fn), in_axes=(None, 0))(s.p, tensors(s.xs))
    tree_close(got, s.loop(lambda x: s.case.ref(s.p, x)), what="vmap(jit)")


def stack_jit_vmap_grad(s):
    g = fs.jit(fs.vmap(fs.grad(s.loss), in_axes=(None, 0)))(s.p, tensors(s.xs))
    np.testing.assert_allclose(flat_batched(s, g), per_example_grads_ref(s), rtol=1e-6,
                               atol=1e-7)


def stack_jvp_vmap(s):
    tp = s.tangent()
    xs = tensors(s.xs)
    out, t_out = fs.jvp(lambda p: fs.vmap(s.case.fn, in_axes=(None, 0))(p, xs), (s.p,), (tp,))
    tree_close(out, s.loop(lambda x: s.case.ref(s.p, x)), what="jvp(vmap) primal")
    tree_close(t_out, s.loop(lambda x: s.num_jvp(x, tp)), tol=1e-5, what="jvp(vmap) tangent")


def stack_vmap_jvp(s):
    tp = s.tangent()
    t_out = fs.vmap(lambda x: fs.jvp(lambda p: s.case.fn(p, x), (s.p,), (tp,))[1])(
        tensors(s.xs))
    tree_close(t_out, s.loop(lambda x: s.num_jvp(x, tp)), tol=1e-5, what="vmap(jvp)")


STACKS = {
    "vmap(grad)": stack_vmap_grad,
    "grad(vmap summed)": stack_grad_vmap_summed,
    "grad(grad)": stack_grad_grad,
    "jacfwd(jacrev)": stack_jacfwd_jacrev,
    "vmap(vmap)": stack_vmap_vmap,
    "jit(grad)": stack_jit_grad,
    "grad(jit)": stack_grad_jit,
    "vmap(jit)": stack_vmap_jit,
    "jit(vmap(grad))": stack_jit_vmap_grad,
    "jvp(vmap)": stack_jvp_vmap,
    "vmap(jvp)": stack_vmap_jvp,
}
# forward mode proper; jacfwd(jacrev) works through a custom_vjp (it differentiates bwd)
FORWARD_MODE = {"jvp(vmap)", "vmap(jvp)"}


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("case", [c.name for c in CORPUS])
def test_composition(case, stack):
    s = SETUPS[case]
    if stack in FORWARD_MODE and not s.case.forward_mode:
        # a custom_vjp function has no forward-mode rule: a clear error, as in JAX
        with pytest.raises(fs.DifferentiationError, match="can't apply forward-mode"):
            STACKS[stack](s)
        return
    STACKS[stack](s)
