"""``fs.vmap``: in_axes / out_axes as pytree prefixes, None, negative axes,
``axis_size``, nesting, keyword arguments, Cells; the golden IR of a vmapped MLP;
and the errors of vmap (golden messages).

Every numerical check compares with loop-and-stack: apply the function to each
example and stack the results (NB: JAX ``_CheckBatching``).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs
from fshard.testing import assert_close
from fshard import ops
from fshard.primitives.passes import simplify


def rng():
    return np.random.default_rng(0)


def np_(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def close(a, b, tol=1e-6):
    assert_close(a, b, rtol=tol, atol=tol)


def loop_and_stack(f, args, in_axes, size, out_axis=0):
    """Apply ``f`` example by example (``in_axes`` per positional argument, flat)."""
    outs = [f(*[a if ax is None else np.take(a, i, axis=ax) for a, ax in zip(args, in_axes)])
            for i in range(size)]
    return fs.tree.map(lambda *xs: np.stack([np_(x) for x in xs], axis=out_axis), *outs)


# ---------------------------------------------------------------------------
# Axes
# ---------------------------------------------------------------------------


def affine(x, w, b):
    return ops.tanh(ops.add(ops.matmul(x, w), b))


@pytest.mark.parametrize("in_axes", [(0, None, None), (1, None, None), (-1, None, None),
                                     (0, 0, None), (None, 2, 0), (-2, -1, 0)])
def test_in_axes_match_loop_and_stack(in_axes):
    r = rng()
    x, w, b = r.standard_normal((3, 4)), r.standard_normal((4, 2)), r.standard_normal(2)
    size = 5
    args = [x, w, b]
    batched = []
    for a, ax in zip(args, in_axes):
        if ax is None:
            batched.append(a)
        else:
            stacked = np.stack([a * (1 + 0.1 * i) for i in range(size)])
            batched.append(np.moveaxis(stacked, 0, ax))
    got = fs.vmap(affine, in_axes=in_axes)(*batched)
    close(got, loop_and_stack(affine, batched, in_axes, size))


@pytest.mark.parametrize("out_axes", [0, 1, 2, -1, -3])
def test_out_axes(out_axes):
    x = rng().standard_normal((4, 2, 3))
    got = fs.vmap(lambda v: v * 2.0, out_axes=out_axes)(x)
    close(got, np.moveaxis(2 * x, 0, out_axes))


def test_in_axes_and_out_axes_as_pytree_prefixes():
    r = rng()
    params = {"w": r.standard_normal((3, 2)), "b": r.standard_normal((2, 5))}  # b batched on 1
    xs = r.standard_normal((5, 3))

    def f(p, x):
        y = ops.matmul(x, p["w"]) + p["b"]
        return {"y": y, "norm": (y * y).sum(), "w": p["w"] * 1.0}

    out = fs.vmap(f, in_axes=({"w": None, "b": 1}, 0),
                  out_axes={"y": 1, "norm": 0, "w": None})(params, xs)
    for i in range(5):
        yi = xs[i] @ params["w"] + params["b"][:, i]
        close(out["y"][:, i], yi)
        close(out["norm"][i], (yi * yi).sum())
    close(out["w"], params["w"])  # unbatched output with out_axes=None


def test_out_axes_zero_broadcasts_unbatched_outputs():
    xs = rng().standard_normal((4, 3))
    c = np.arange(3.0)
    y, k = fs.vmap(lambda x: (x + c, c * 2.0))(xs)
    close(y, xs + c)
    close(k, np.broadcast_to(2 * c, (4, 3)))


def test_tuple_and_list_arguments_and_nested_prefixes():
    r = rng()
    pairs = [(r.standard_normal((4, 2)), r.standard_normal(2))]  # list of (batched, shared)

    def f(ps):
        (a, b), = ps
        return a * b

    got = fs.vmap(f, in_axes=([(0, None)],))(pairs)
    close(got, pairs[0][0] * pairs[0][1])


def test_axis_size_without_mapped_inputs():
    c = np.arange(3.0)
    out = fs.vmap(lambda v: v * 2.0, in_axes=None, axis_size=4)(c)
    close(out, np.broadcast_to(2 * c, (4, 3)))
    out = fs.vmap(lambda v, w: v + w, in_axes=(None, 0), axis_size=2)(c, np.ones((2, 3)))
    close(out, c + np.ones((2, 3)))


def test_keyword_arguments_are_mapped_along_axis_0():
    xs = rng().standard_normal((4, 3))
    shift = np.arange(4.0)

    def f(x, *, shift, scale=2.0):
        return x * scale + shift

    out = fs.vmap(f, in_axes=0)(xs, shift=shift)
    close(out, xs * 2 + shift[:, None])


def test_python_scalars_and_closed_over_arrays():
    xs = rng().standard_normal((3, 2))
    w = np.array([1.0, -1.0])
    close(fs.vmap(lambda x: (x * w + 1.5).sum())(xs), (xs * w + 1.5).sum(1))


# ---------------------------------------------------------------------------
# Nesting
# ---------------------------------------------------------------------------


def test_nested_vmap_is_an_outer_product():
    a, b = rng().standard_normal(3), rng().standard_normal(4)
    got = fs.vmap(fs.vmap(lambda x, y: x * y, in_axes=(None, 0)), in_axes=(0, None))(a, b)
    close(got, np.outer(a, b))


def test_nested_vmap_pairwise_distances_with_other_axes():
    r = rng()
    xs, ys = r.standard_normal((3, 5)), r.standard_normal((5, 4))  # ys: points on axis 1

    def dist(x, y):
        return ops.sqrt(((x - y) ** 2).sum())

    got = fs.vmap(fs.vmap(dist, in_axes=(None, 1)), in_axes=(0, None))(xs, ys)
    want = np.sqrt(((xs[:, None, :] - ys.T[None, :, :]) ** 2).sum(-1))
    close(got, want)


def test_vmap_of_vmap_with_out_axes():
    x = rng().standard_normal((2, 3, 4))
    got = fs.vmap(fs.vmap(lambda v: v.sum(), out_axes=0), in_axes=1, out_axes=0)(x)
    close(got, x.sum(-1).T)


def test_jit_of_nested_vmap_matches_eager():
    x = rng().standard_normal((2, 3, 4)).astype(np.float32)
    f = fs.vmap(fs.vmap(lambda v: ops.softmax(v, -1)))
    close(fs.jit(f)(x), f(x), tol=1e-6)


# ---------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(4, 3)
        self.act = nn.GELU()

    def construct(self, x):
        return self.act(self.dense(x))


def test_vmap_of_a_cell_maps_its_inputs_not_its_parameters():
    ms.set_seed(0)
    cell = Block()
    xs = ms.Tensor(rng().standard_normal((5, 2, 4)).astype(np.float32))  # 5 batches of 2 rows
    got = fs.vmap(cell)(xs)
    want = np.stack([cell(xs[i]).asnumpy() for i in range(5)])
    close(got, want, tol=1e-5)
    got1 = fs.vmap(cell, in_axes=1, out_axes=1)(xs)
    close(got1, np.stack([cell(xs[:, i]).asnumpy() for i in range(2)], axis=1), tol=1e-5)


def test_vmap_over_an_ensemble_of_cell_parameters():
    ms.set_seed(0)
    cell = Block()
    apply, params = fs.functional(cell)
    # three parameter sets: stack them and map over the stack
    ensemble = {k: ms.Tensor(np.stack([v.asnumpy() * (1 + 0.5 * i) for i in range(3)]))
                for k, v in params.items()}
    x = ms.Tensor(rng().standard_normal((2, 4)).astype(np.float32))
    got = fs.vmap(apply, in_axes=(0, None))(ensemble, x)
    one = fs.jit(apply)
    for i in range(3):
        pi = {k: ms.Tensor(v.asnumpy()[i]) for k, v in ensemble.items()}
        close(got[i], one(pi, x), tol=1e-5)


# ---------------------------------------------------------------------------
# custom rules under vmap
# ---------------------------------------------------------------------------


def test_vmap_batches_custom_jvp_and_custom_vjp_bodies():
    @fs.custom_jvp
    def f(x, w):
        return ops.sin(x) * w

    f.defjvp(lambda p, t: (f(*p), ops.cos(p[0]) * p[1] * t[0] + ops.sin(p[0]) * t[1]))

    @fs.custom_vjp
    def g(x):
        return x ** 2

    g.defvjp(lambda x: (x ** 2, x), lambda x, ct: (2.0 * x * ct,))
    xs, w = rng().standard_normal((4, 3)), rng().standard_normal(3)
    close(fs.vmap(f, in_axes=(0, None))(xs, w), np.sin(xs) * w)
    close(fs.vmap(f, in_axes=(1, 0))(xs.T, np.stack([w] * 4)), np.sin(xs) * w)
    close(fs.vmap(fs.vmap(g))(xs), xs ** 2)
    close(fs.jit(fs.vmap(g))(xs.astype(np.float32)), (xs ** 2).astype(np.float32), tol=1e-6)


def test_custom_rules_closing_over_a_mapped_value():
    def per_scale(s, x):
        @fs.custom_jvp
        def f(x):
            return ops.sin(x) * s

        f.defjvp(lambda p, t: (f(p[0]), ops.cos(p[0]) * s * t[0]))

        @fs.custom_vjp
        def g(x):
            return x * s

        g.defvjp(lambda x: (x * s, None), lambda r, ct: (ct * s,))
        return (f(x) + g(x)).sum()

    ss, x = np.array([1.0, 2.0, 3.0]), np.array([0.5, -1.0])
    close(fs.vmap(per_scale, in_axes=(0, None))(ss, x),
          [(np.sin(x) * s + x * s).sum() for s in ss])
    close(fs.vmap(fs.grad(per_scale, argnums=1), in_axes=(0, None))(ss, x),
          [np.cos(x) * s + s for s in ss])
    total = fs.grad(lambda x: fs.vmap(per_scale, in_axes=(0, None))(ss, x).sum())
    close(total(x), sum(np.cos(x) * s + s for s in ss))
    close(fs.jit(total)(x), sum(np.cos(x) * s + s for s in ss))


# ---------------------------------------------------------------------------
# Golden IR: a vmapped MLP is as small as the hand-batched one
# ---------------------------------------------------------------------------

COMPUTE = {"matmul", "add", "relu", "tanh", "mul", "reduce_sum", "exp", "log_softmax"}


def mlp(p, x):
    (w1, b1), (w2, b2) = p
    h = ops.relu(ops.matmul(x, w1) + b1)
    return ops.matmul(h, w2) + b2


def params32():
    z = np.zeros
    return [(z((4, 5), np.float32), z(5, np.float32)), (z((5, 3), np.float32), z(3, np.float32))]


def prims(ir) -> list[str]:
    """Primitive names of a printed Program, in order."""
    lines = str(ir).splitlines()[1:-1]
    return [line.split(" = ", 1)[1].split("[")[0].split(" ")[0] for line in lines]


def test_golden_ir_of_a_vmapped_mlp():
    per_example = fs.make_ir(fs.vmap(mlp, in_axes=(None, 0)))(params32(),
                                                             np.zeros((8, 4), np.float32))
    assert str(per_example) == (
        "{ lambda a:f32[4,5] b:f32[5] c:f32[5,3] d:f32[3] e:f32[8,4] .\n"
        "    f:f32[8,1,4] = reshape[shape=(8, 1, 4)] e\n"
        "    g:f32[8,4] = reshape[shape=(8, 4)] f\n"
        "    h:f32[8,5] = matmul[transpose_a=False transpose_b=False] g a\n"
        "    i:f32[8,1,5] = reshape[shape=(8, 1, 5)] h\n"
        "    j:f32[8,5] = reshape[shape=(8, 5)] i\n"
        "    k:f32[8,5] = broadcast_to[shape=(8, 5)] b\n"
        "    l:f32[8,5] = add j k\n"
        "    m:f32[8,5] = relu l\n"
        "    n:f32[8,1,5] = reshape[shape=(8, 1, 5)] m\n"
        "    o:f32[8,5] = reshape[shape=(8, 5)] n\n"
        "    p:f32[8,3] = matmul[transpose_a=False transpose_b=False] o c\n"
        "    q:f32[8,1,3] = reshape[shape=(8, 1, 3)] p\n"
        "    r:f32[8,3] = reshape[shape=(8, 3)] q\n"
        "    s:f32[8,3] = broadcast_to[shape=(8, 3)] d\n"
        "    t:f32[8,3] = add r s\n"
        "  in (t) }")
    batched = fs.make_ir(mlp)(params32(), np.zeros((8, 4), np.float32))
    # the same compute equations as the hand-batched MLP, plus only moves of axes ...
    compute = [p for p in prims(per_example) if p in COMPUTE]
    assert compute == [p for p in prims(batched) if p in COMPUTE] == [
        "matmul", "add", "relu", "matmul", "add"]
    # ... which the cleanup passes jit applies remove entirely
    assert str(simplify(per_example.program)) == str(batched)


def test_golden_ir_of_per_example_gradients():
    def loss(p, x, y):
        return ops.softmax_cross_entropy(mlp(p, x[None]), y[None])

    ir = fs.make_ir(fs.vmap(fs.grad(loss), in_axes=(None, 0, 0)))(
        params32(), np.zeros((8, 4), np.float32), np.zeros(8, np.int32))
    names = prims(simplify(ir.program))
    # one matmul per layer forward, two per layer backward (one of them a batched
    # outer product for the per-example weight gradient), no more
    assert names.count("matmul") == 2 + 3
    assert "transpose" not in names
    assert len(names) <= 40


# ---------------------------------------------------------------------------
# Errors (golden)
# ---------------------------------------------------------------------------

X3 = np.ones(3, np.float32)


def two(a, b):
    return a + b


GOLDEN = {
    "in_axes tree mismatch": (
        lambda: fs.vmap(lambda d: d["a"] + d["b"], in_axes=({"a": 0},))({"a": X3, "b": X3}),
        "vmap(<lambda>): in_axes[0]={'a': 0} is not a pytree prefix of args[0] (parameter "
        "'d'), which is {'a': f32[3], 'b': f32[3]}.\nFix: give in_axes[0] the containers of "
        "that argument with an int or None at each leaf (None for unbatched parts), or one "
        "int or None for the whole argument."),
    "in_axes length": (
        lambda: fs.vmap(two, in_axes=(0,))(X3, X3),
        "vmap(two): in_axes has 1 entry but the function was called with 2 positional "
        "arguments.\nFix: give in_axes one entry per positional argument (an int, None, or "
        "a pytree prefix of the argument), or a single int or None for all of them."),
    "in_axes a dict": (
        lambda: fs.vmap(lambda p: p["w"], in_axes={"w": 0})({"w": X3}),
        "vmap(<lambda>): in_axes must be an int, None, or a tuple with one entry per "
        "positional argument; got {'w': 0}.\nFix: wrap a pytree of axes in a tuple, e.g. "
        "in_axes=({'w': 0},) for a function of one argument."),
    "mismatched batch sizes": (
        lambda: fs.vmap(two, in_axes=(0, {"w": 1}))(
            np.ones((3, 2), np.float32), {"w": np.ones((2, 4), np.float32)}),
        "vmap(two) got inconsistent sizes for the mapped axis:\n"
        "  args[0] (parameter 'a'): size 3 along in_axes=0\n"
        "  args[1]['w'] (parameter 'b'): size 4 along in_axes=1\n"
        "Fix: every mapped argument must have the same size along its in_axes; use "
        "in_axes=None for arguments that are not batched."),
    "axis_size disagrees": (
        lambda: fs.vmap(lambda a: a, axis_size=5)(X3),
        "vmap(<lambda>) got inconsistent sizes for the mapped axis:\n"
        "  args[0] (parameter 'a'): size 3 along in_axes=0\n"
        "  axis_size=5\n"
        "Fix: every mapped argument must have the same size along its in_axes; use "
        "in_axes=None for arguments that are not batched."),
    "axis out of range": (
        lambda: fs.vmap(lambda a: a, in_axes=2)(np.ones((2, 3), np.float32)),
        "vmap(<lambda>): in_axes=2 is out of range for args[0] (parameter 'a') of type "
        "f32[2,3] (rank 2).\nFix: use an axis in [-2, 1], or None to leave this argument "
        "unbatched."),
    "mapping a scalar": (
        lambda: fs.vmap(two)(X3, np.float32(1.0)),
        "vmap(two): in_axes=0 maps args[1] (parameter 'b'), but it is a scalar (f32[]) and "
        "has no axis to map over.\nFix: pass in_axes=None for it (every example then sees "
        "the same value), or give it a leading batch axis."),
    "in_axes entry not an int": (
        lambda: fs.vmap(two, in_axes=(0, 1.5))(X3, X3),
        "vmap(two): the in_axes entry for args[1] (parameter 'b') must be an int or None, "
        "got 1.5.\nFix: use the index of the mapped axis, or None if this argument is not "
        "batched."),
    "out_axes None for a batched output": (
        lambda: fs.vmap(lambda a: {"y": a * 2.0, "c": 1.0}, out_axes={"y": None, "c": None})(X3),
        "vmap(<lambda>): output['y'] (f32[3] batched) varies along the mapped axis, but its "
        "out_axes is None, which promises a value that is the same for every example.\n"
        "Fix: give it an int out_axes, or make it independent of the mapped inputs."),
    "out_axes tree mismatch": (
        lambda: fs.vmap(lambda a: (a, a), out_axes=(0, 0, 0))(X3),
        "vmap(<lambda>): out_axes=(0, 0, 0) is not a pytree prefix of the output, which is "
        "(f32[3], f32[3]) (batched).\nFix: give out_axes the containers of the output with "
        "an int or None at each leaf, or one int for all of it."),
    "out_axes out of range": (
        lambda: fs.vmap(lambda a: a, out_axes=2)(X3),
        "vmap(<lambda>): out_axes=2 is out of range for the output, which has rank 1 with "
        "the mapped axis.\nFix: use an axis in [-1, 0]."),
    "no mapped input": (
        lambda: fs.vmap(lambda a: a, in_axes=None)(X3),
        "vmap(<lambda>): no argument is mapped (every in_axes entry is None) and axis_size "
        "was not given, so the size of the mapped axis is unknown.\nFix: pass axis_size=N, "
        "or map at least one argument."),
}


@pytest.mark.parametrize("case", list(GOLDEN))
def test_golden_error(case):
    run, want = GOLDEN[case]
    with pytest.raises(fs.BatchingError) as info:
        run()
    assert str(info.value) == want + "\nSee docs/errors.md#batchingerror"


def test_batching_error_is_a_value_error():
    with pytest.raises(ValueError):
        fs.vmap(lambda a: a, in_axes=None)(X3)


def test_vmap_rejects_a_non_callable():
    with pytest.raises(fs.BatchingError, match="vmap expects a function, got int"):
        fs.vmap(3)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("m,n", [(3, 4), (8, 2)])
def test_matmul_with_one_operand_shared(ta, tb, m, n):
    """A matmul whose one operand is not batched folds the batch into rows or columns
    where it can (no copy of the shared operand): every transpose flag, both operands
    shared in turn, the batch at each axis, values and gradients against loop-and-stack."""
    r, k = rng(), 5
    x = r.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    for axis in (0, 1, 2):
        shape = [n, k] if tb else [k, n]
        shape.insert(axis, 6)
        ys = r.standard_normal(shape).astype(np.float32)
        each = np.moveaxis(ys, axis, 0)

        def shared_left(y):
            return ops.matmul(x, y, transpose_a=ta, transpose_b=tb)

        got = fs.vmap(shared_left, in_axes=axis)(ys)
        close(got, np.stack([(x.T if ta else x) @ (e.T if tb else e) for e in each]), 1e-4)
        g = fs.jit(fs.grad(lambda y: (fs.vmap(shared_left, in_axes=axis)(y) ** 2).sum()))(ys)
        ref = np.stack([np_(fs.grad(lambda e: (shared_left(e) ** 2).sum())(e)) for e in each])
        close(g, np.moveaxis(ref, 0, axis), 1e-4)
    w = r.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    xs = r.standard_normal((6,) + ((k, m) if ta else (m, k))).astype(np.float32)

    def shared_right(a):
        return ops.matmul(a, w, transpose_a=ta, transpose_b=tb)

    close(fs.vmap(shared_right)(xs),
          np.stack([(a.T if ta else a) @ (w.T if tb else w) for a in xs]), 1e-4)
