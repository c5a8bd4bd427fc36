"""Wrong answers and raw MindSpore errors the op coverage sweep (tests/op_coverage.py)
found, each checked against eager MindSpore."""

from __future__ import annotations

import mindspore
import numpy as np
import pytest
from mindspore import Tensor, mint, ops

import fshard as fs
from fshard.core.tracing import kernel_dtype_errors
from fshard.errors import ArgumentError, GenericOpWarning, UnsupportedOpError

RNG = np.random.default_rng(0)
X = Tensor(RNG.uniform(0.2, 0.8, (4, 6)).astype(np.float32))
IMG = Tensor(RNG.uniform(0.2, 0.8, (2, 4, 8, 8)).astype(np.float32))


@pytest.mark.parametrize("fn", [lambda x: ops.dropout2d(x), lambda x: ops.dropout1d(x[0]),
                                lambda x: ops.dropout3d(x[None])], ids=["2d", "1d", "3d"])
def test_channel_dropout_is_refused_not_frozen(fn):
    # Dropout2D/Dropout3D draw a random mask: traced once, the same mask would be used
    # at every call of the jitted function and in every vmap lane.
    with pytest.raises(UnsupportedOpError, match="stateful MindSpore random op 'Dropout[23]D'"):
        fs.jit(fn)(IMG)


def test_expand_as_compiles():
    # No CPU kernel for ExpandAs in a graph: a raw "Kernel select failed" before.
    y = Tensor(np.zeros((3, 4, 6), np.float32))
    f = lambda a, b: ops.expand_as(a, b)  # noqa: E731
    got = fs.jit(f)(X, y)
    np.testing.assert_array_equal(got.asnumpy(), f(X, y).asnumpy())
    g = fs.grad(lambda a: (f(a, y) * ops.arange(6.0)).sum())(X)
    np.testing.assert_allclose(g.asnumpy(), np.broadcast_to(3 * np.arange(6.0), (4, 6)))


def test_shard_of_a_complex_valued_generic_op_is_an_fshard_error():
    # fshard computes with real dtypes only; the cost model had no size for complex64 and
    # raised a raw KeyError.
    f = lambda a: ops.abs(ops.fft(a))  # noqa: E731
    with pytest.warns(GenericOpWarning, match="FFT .* runs replicated"), \
            pytest.raises(ArgumentError, match="complex dtypes are not supported"):
        fs.shard(f, in_strategy=((2, 1),), mesh=fs.Mesh((2,), ("d",)))(X)
    np.testing.assert_allclose(fs.jit(f)(X).asnumpy(), f(X).asnumpy(), rtol=1e-5, atol=1e-5)


def test_missing_graph_kernel_names_the_op():
    msg = ("----\n- Kernel select failed:\n----\nUnsupported op [Frobnicate] on CPU, Please "
           "confirm whether the device target setting is correct")
    with pytest.raises(UnsupportedOpError, match=r"no CPU kernel for the op 'Frobnicate' in "
                       r"a compiled graph \(in a compiled program\).*\nFix: call it outside"):
        with kernel_dtype_errors("a compiled program", compiled=True):
            raise RuntimeError(msg)


@pytest.mark.filterwarnings("ignore::fshard.errors.GenericOpWarning")  # Diag: a vmap loop
@pytest.mark.parametrize("fn", [lambda a: ops.diagflat(a[0]), lambda a: a.ravel() * 2.0,
                                lambda a: ops.diagonal_scatter(a, a[:, 0] * 3.0)],
                         ids=["diagflat", "ravel", "diagonal_scatter"])
def test_tensor_methods_written_in_python_trace(fn):
    # MindSpore writes these Tensor methods (and ops that call them) in Python: a raw
    # "AttributeError: a traced value has no attribute 'ravel'" before.
    np.testing.assert_array_equal(fs.jit(fn)(X).asnumpy(), fn(X).asnumpy())
    got = fs.vmap(fn)(ops.stack([X, X * 2.0]))
    np.testing.assert_allclose(got[1].asnumpy(), fn(X * 2.0).asnumpy(), rtol=1e-6)


def test_shard_of_a_global_norm_is_not_taken_for_elementwise():
    # ClipByNorm commutes with any permutation of the elements, which is how the generic
    # path recognised elementwise ops; split along rows, each device clipped its own
    # rows by their own norm (a wrong value, no error).
    from mindspore import nn

    cell, c = nn.ClipByNorm(), Tensor(np.float32(1.0))
    f = lambda a: cell(a, c)  # noqa: E731
    with pytest.warns(GenericOpWarning, match="ClipByNorm .* runs replicated"):
        got = fs.shard(f, in_strategy=((2, 1),), mesh=fs.Mesh((2,), ("d",)))(X)
    np.testing.assert_allclose(got.asnumpy(), f(X).asnumpy(), rtol=1e-6, atol=1e-7)


def test_shard_keeps_an_elementwise_generic_op_split():
    f = lambda a: ops.erfc(a) * 2.0  # noqa: E731
    text = str(fs.make_ir(fs.shard(f, in_strategy=((2, 1),), mesh=fs.Mesh((2,), ("d",))))(X))
    assert "f32[2,6]{(2, 1)} = Erfc" in text, text  # each device computes its rows
    got = fs.shard(f, in_strategy=((2, 1),), mesh=fs.Mesh((2,), ("d",)))(X)
    np.testing.assert_allclose(got.asnumpy(), f(X).asnumpy(), rtol=1e-6)


@pytest.mark.parametrize("fn", [lambda a: mint.squeeze(a, 2), lambda a: mint.squeeze(a, (0, 1)),
                                lambda a: ops.squeeze(a, (1, 2)), lambda a: a.squeeze(-1),
                                lambda a: a.squeeze((1, 2))])
def test_squeeze_of_a_dimension_not_of_size_one_keeps_it(fn):
    # MindSpore (as PyTorch) leaves it in place; fshard raised a ShapeError.
    x = Tensor(RNG.uniform(size=(4, 1, 6)).astype(np.float32))
    np.testing.assert_array_equal(fs.jit(fn)(x).asnumpy(), fn(x).asnumpy())


# Each case: (tensor dtype, NumPy scalar), the dtype eager MindSpore's Tensor operators give.
_NP_SCALARS = [(np.float32, np.float64(2.0)), (np.float16, np.float64(2.0)),
               (np.float16, np.float32(2.0)), (np.int32, np.float64(2.0)),
               (np.int32, np.int64(2)), (np.int8, np.int64(2)), (np.bool_, np.float64(2.0)),
               (np.bool_, np.int64(2)), (np.int32, np.bool_(True))]


@pytest.mark.parametrize("dt,s", _NP_SCALARS, ids=[f"{np.dtype(d).name}-{type(s).__name__}"
                                                    for d, s in _NP_SCALARS])
def test_numpy_scalars_are_weakly_typed_as_in_mindspore(dt, s):
    # MindSpore treats a NumPy scalar as the Python scalar of its kind: f32 + np.float64(2)
    # is float32. fshard kept the NumPy dtype (float64), silently changing nn.LGamma's.
    t = Tensor(np.ones((2, 3), dt))
    for f in (lambda a: a + s, lambda a: ops.mul(s, a), lambda a: ops.sub(a, s)):
        want = f(t)
        got = fs.jit(f)(t)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


def test_numpy_scalars_alone_keep_their_dtype():
    # Between NumPy scalars (no array operand) their own dtypes still decide.
    assert fs.ops.add(np.float64(1.0), np.float64(2.0)).dtype == mindspore.float64


def test_lgamma_keeps_float32():
    f = lambda a: ops.lgamma(a + np.float64(1.0))  # noqa: E731
    assert fs.jit(f)(X).dtype == f(X).dtype


@pytest.mark.filterwarnings("ignore::fshard.errors.GenericOpWarning")
def test_generic_op_shape_set_by_a_concrete_integer_tensor():
    # The generic path learned MirrorPad's output shape by running it on zeros in place
    # of every tensor, the paddings too: f32[4,6] in the program for a (6, 10) result.
    pads = Tensor(np.array([[1, 1], [2, 2]], np.int32))
    f = lambda a: ops.mirror_pad(a, pads, "REFLECT")  # noqa: E731
    want = f(X)
    np.testing.assert_array_equal(fs.jit(f)(X).asnumpy(), want.asnumpy())
    w = Tensor(RNG.uniform(size=(6, 10)).astype(np.float32))
    g = fs.grad(lambda a: (f(a) * w).sum())(X)
    gw = ops.grad(lambda a: (f(a) * w).sum())(X)
    np.testing.assert_allclose(g.asnumpy(), gw.asnumpy(), rtol=1e-5, atol=1e-5)
    v = fs.vmap(f)(ops.stack([X, 2 * X]))
    np.testing.assert_array_equal(v.asnumpy()[1], f(2 * X).asnumpy())


V3 = Tensor(np.arange(3, dtype=np.float32))
V4 = Tensor(np.arange(4, dtype=np.float32) + 1)


@pytest.mark.parametrize("fn", [lambda a: ops.meshgrid(a), lambda a: mint.meshgrid(a),
                                lambda a: ops.cartesian_prod(a),
                                lambda a: ops.meshgrid(a, V4, V3 * 2),
                                lambda a: ops.meshgrid(a, V4, indexing="ij"),
                                lambda a: mint.meshgrid(a, V4, indexing="xy"),
                                lambda a: ops.cartesian_prod(a, V4)],
                         ids=["one", "mint-one", "cartesian-one", "xy-3", "ij-2", "mint-xy",
                              "cartesian-2"])
def test_meshgrid_traces(fn):
    # MindSpore's graph kernel refuses one input (eager returns it): a raw ValueError.
    want = fn(V3)
    got = fs.jit(fn)(V3)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())


@pytest.mark.parametrize("fn", [lambda a: ops.diff(a), lambda a: ops.diff(a, 1, 0),
                                lambda a: ops.nansum(a), lambda a: ops.nansum(a, 1),
                                lambda a: ops.nanmean(a, 0)],
                         ids=["diff", "diff-axis0", "nansum", "nansum-1", "nanmean"])
def test_tensor_methods_mindspore_functions_use_trace(fn):
    # ops.diff calls x.gather and ops.nansum x.is_complex(): a raw AttributeError before.
    x = ops.where(X > 0.7, Tensor(np.float32("nan")), X)
    np.testing.assert_allclose(fs.jit(fn)(x).asnumpy(), fn(x).asnumpy(), rtol=1e-6)


def _ones_twos():
    return Tensor(np.ones((2, 3), np.float32)), Tensor(np.full((2, 3), 2.0, np.float32))


@pytest.mark.parametrize("transform", [fs.jit, fs.vmap, lambda f: fs.jit(fs.vmap(f))],
                         ids=["jit", "vmap", "jit-vmap"])
@pytest.mark.parametrize("op,want", [(ops.assign_add, 3.0), (ops.assign_sub, -1.0),
                                     (ops.assign, 2.0)], ids=["add", "sub", "assign"])
def test_assign_ops_write_under_vmap(transform, op, want):
    # AssignAdd/AssignSub refused the views vmap's loop hands them (a raw "Check view and
    # inplace failed"); under jit(vmap(f)) the write of an unused result was dropped.
    x, y = _ones_twos()
    out = transform(lambda a, b: (op(a, b), b * 1)[1])(x, y)
    np.testing.assert_array_equal(out.asnumpy(), y.asnumpy())
    np.testing.assert_array_equal(x.asnumpy(), np.full((2, 3), want, np.float32))


def test_assign_add_under_shard_and_its_gradient():
    x, y = _ones_twos()
    f = lambda a, b: ops.assign_add(a, b) * 1  # noqa: E731
    out = fs.shard(f, in_strategy=((2, 1), (2, 1)), mesh=fs.Mesh((2,), ("d",)))(x, y)
    np.testing.assert_array_equal(out.asnumpy(), np.full((2, 3), 3.0, np.float32))
    np.testing.assert_array_equal(x.asnumpy(), np.full((2, 3), 3.0, np.float32))
    # MindSpore's AssignAdd differentiates into the value too (Assign's does not).
    w = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    loss = lambda a, b: (ops.assign_sub(a * 1, b) * w).sum()  # noqa: E731
    want = ops.grad(loss, grad_position=(0, 1))(*_ones_twos())
    got = fs.grad(loss, argnums=(0, 1))(*_ones_twos())
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(g.asnumpy(), w_.asnumpy())


def test_assign_add_of_another_dtype_is_refused_as_mindspore_does():
    x = Tensor(np.ones(3, np.int32))
    with pytest.raises(UnsupportedOpError, match="AssignAdd.*Data type conversion"):
        fs.jit(lambda a, b: ops.assign_add(a, b))(x, Tensor(np.full(3, 2.5, np.float32)))
    np.testing.assert_array_equal(x.asnumpy(), np.ones(3, np.int32))


@pytest.mark.parametrize("dt", [np.float32, np.int32, np.bool_])
def test_mint_nansum_compiles(dt):
    # No CPU graph kernel for Nansum: an UnsupportedOpError under fs.jit before.
    x = X.asnumpy() * 10
    x = Tensor(np.where(x > 7, np.nan, x).astype(dt) if dt == np.float32 else x.astype(dt))
    for f in (lambda a: mint.nansum(a), lambda a: mint.nansum(a, 1),
              lambda a: mint.nansum(a, (0, 1), True)):
        want, got = f(x), fs.jit(f)(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-6)


def test_mint_imag_of_a_real_input_compiles():
    # MindSpore's graph mode cannot infer the view's type: a raw RuntimeError before.
    f = lambda a: mint.imag(a) + a  # noqa: E731
    got = fs.jit(f)(X)
    assert got.dtype == f(X).dtype
    np.testing.assert_array_equal(got.asnumpy(), f(X).asnumpy())
