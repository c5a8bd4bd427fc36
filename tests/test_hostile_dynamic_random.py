"""Hostile checks of symbolic dimensions and random numbers: every count of a symbolic
dimension is read at run time (never a placeholder), indexing within a Symbol's smallest
size, fshard errors (not raw ones) for what cannot work, every dtype spelling in
fs.random, and keys that no loop iteration changes."""

from __future__ import annotations

import warnings

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import fshard as fs
from fshard import random as R

F32 = ms.float32
DATA = np.arange(1, 16, dtype=np.int32).reshape(5, 3)  # rows [1 2 3] ... [13 14 15]


def _counts(x, xf):
    """Everything that divides by a number of elements, on an int and a float value."""
    return {
        "int mean(0)": x.mean(0), "int ops.mean": ops.mean(x, 0), "int mean()": x.mean(),
        "var(0)": xf.var(0), "var(1) (a static axis)": xf.var(1), "var(ddof=1)": xf.var(
            0, ddof=1), "std()": xf.std(), "numel()": xf.numel(), "size": xf.size,
        "mint.mean": mint.mean(xf), "ops.mse_loss": ops.mse_loss(xf, xf * 2.0),
        "nn.MSELoss": nn.MSELoss()(xf, xf * 2.0), "nn.L1Loss": nn.L1Loss()(xf, xf * 0.5),
        "ops.cross_entropy": ops.cross_entropy(xf, ops.softmax(xf * 0.1, -1)),
        "softmax_cross_entropy": fs.ops.softmax_cross_entropy(
            xf * 0.1, ops.cast(x[:, 0] > 5, ms.int32)),
    }


@pytest.fixture(scope="module")
def counted():
    s = fs.Symbol()
    return fs.jit(lambda x: _counts(x, ops.cast(x, F32)),
                  in_shapes=(fs.ArrayType((s, 3), ms.int32),))


@pytest.mark.parametrize("rows", [1, 2, 4, 5])
def test_every_count_of_a_symbolic_batch_is_the_run_time_size(counted, rows):
    x = Tensor(DATA[:rows])
    got = counted(x)
    want = _counts(x, ops.cast(x, F32))  # eager MindSpore: the static numbers
    for name in want:
        g, w = np.asarray(got[name].asnumpy() if hasattr(got[name], "asnumpy") else got[name]
                          ), np.asarray(want[name].asnumpy() if hasattr(want[name], "asnumpy")
                                        else want[name])
        if name == "var(ddof=1)" and rows == 1:
            assert np.isnan(g).all(), name  # n - ddof = 0: nan, as the static program
            continue
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-6, err_msg=name)
    assert counted.compile_count <= 2  # one program for every size (plus a static copy)


def test_int_mean_and_var_of_a_symbolic_batch_are_not_placeholders():
    s = fs.Symbol()
    x = Tensor(np.arange(1, 13, dtype=np.int32).reshape(4, 3))
    f = fs.jit(lambda x: (x.mean(0), x.astype(F32).var(0), x.astype(F32).std(),
                          x.numel(), x.size), in_shapes=(fs.ArrayType((s, 3), ms.int32),))
    mean, var, std, numel, size = f(x)
    assert mean.asnumpy().tolist() == [5, 6, 7]
    np.testing.assert_allclose(var.asnumpy(), [11.25] * 3, rtol=1e-6)
    np.testing.assert_allclose(std.asnumpy(), np.arange(1, 13).std(), rtol=1e-6)
    assert int(numel.asnumpy()) == 12 and int(size.asnumpy()) == 12


def test_gradients_through_run_time_counts_equal_the_static_ones():
    def loss(w, x):
        h = x @ w
        return h.var(0).sum() + ops.mse_loss(h, h * 0.5) + ops.mean(h)

    s = fs.Symbol()
    w = Tensor(np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2))
    g = fs.jit(fs.grad(loss), in_shapes=(None, fs.ArrayType((s, 3), F32)))
    for rows in (2, 5):
        x = Tensor(DATA[:rows].astype(np.float32) / 10)
        np.testing.assert_allclose(g(w, x).asnumpy(), fs.grad(loss)(w, x).asnumpy(),
                                   rtol=1e-5, atol=1e-6)


def test_an_autoparallel_loss_using_var_with_declared_shapes():
    def loss(params, x):
        return (x @ params["w"]).var()

    x = Tensor(np.arange(40, dtype=np.float32).reshape(10, 4))
    params = {"w": Tensor(np.ones((4, 1), np.float32))}
    ap = fs.AutoParallel(loss, fs.optim.sgd(0.0), mesh=1,
                         in_shapes=(fs.ArrayType((fs.Symbol(), 4), F32),))
    state = ap.init(params)
    for rows in (10, 6):
        state, value = ap(state, x[:rows])
        want = (np.arange(40, dtype=np.float64).reshape(10, 4)[:rows].sum(1)).var()
        np.testing.assert_allclose(float(value.asnumpy()), want, rtol=1e-6)


def test_int_indices_into_a_symbolic_dimension_within_its_smallest_size():
    x = Tensor(DATA.astype(np.float32))
    for sym, index in ((fs.Symbol(), lambda x: x[0]), (fs.Symbol(), lambda x: x[-1]),
                       (fs.Symbol(min=2), lambda x: x[-2, 1]),
                       (fs.Symbol(min=2), lambda x: x[None, 1, None])):
        f = fs.jit(index, in_shapes=(fs.ArrayType((sym, 3), F32),))
        for rows in (2, 5):
            np.testing.assert_array_equal(f(x[:rows]).asnumpy(), index(x[:rows]).asnumpy())
    g = fs.jit(fs.grad(lambda x: (x[-1] * 2.0).sum()),
               in_shapes=(fs.ArrayType((fs.Symbol(), 3), F32),))
    assert g(x[:3]).asnumpy().tolist() == [[0, 0, 0], [0, 0, 0], [2, 2, 2]]
    with pytest.raises(fs.ArgumentError, match=r"index 2 may be out of bounds for dimension 0 "
                       r"of f32\[s\d+,3\]: its size s\d+ can be as small as 2 .*\n"
                       r"Fix: declare the Symbol with min > 2, e.g. fs.Symbol\(min=3\)"):
        fs.jit(lambda x: x[2], in_shapes=(fs.ArrayType((fs.Symbol(min=2), 3), F32),))(x)


def test_len_of_a_symbolic_dimension_is_an_fshard_error():
    f = fs.jit(lambda x: x * len(x), in_shapes=(fs.ArrayType((fs.Symbol(), 3), F32),))
    with pytest.raises(fs.TracerConversionError, match=r"(?s)len\(\) of a traced value "
                       r"f32\[s\d+,3\]: its first dimension s\d+ .* is symbolic.*Fix: pass "
                       r"x.shape\[0\].*fs.ops.count\(x, 0\)"):
        f(Tensor(DATA.astype(np.float32)))
    with pytest.raises(fs.TracerConversionError, match=r"len\(\) of a 0-d traced value"):
        fs.jit(lambda x: len(x.sum()))(Tensor(DATA))


def test_random_draws_of_a_symbolic_shape_are_errors_with_the_fix():
    k = R.key(0)
    spec = (fs.ArrayType((fs.Symbol(), 3), F32),)
    x = Tensor(np.ones((4, 3), np.float32))
    fix = r"has a symbolic dimension.*Fix: draw the numbers outside the function"
    with pytest.raises(fs.ArgumentError, match=r"(?s)fs.nn.dropout\(key, x, rate\): x's "
                       r"shape \(s\d+, 3\) " + fix):
        fs.jit(lambda x: fs.nn.dropout(k, x, 0.5), in_shapes=spec)(x)
    for draw in (R.uniform, R.normal, R.bits):
        with pytest.raises(fs.ArgumentError, match=rf"(?s)fs.random.{draw.__name__}\(\.\.\., "
                           r"shape\): shape \(s\d+, 3\) " + fix):
            fs.jit(lambda x, draw=draw: draw(k, x.shape), in_shapes=spec)(x)


def test_every_dtype_spelling_is_accepted_by_fs_random():
    k = R.key(0)
    want = R.uniform(k, (3,)).asnumpy()
    for spelling in (np.float32, "float32", np.dtype("float32"), F32, "f4", None):
        assert np.array_equal(R.uniform(k, (3,), dtype=spelling).asnumpy(), want)
    assert R.normal(k, (2,), "float64").dtype == ms.float64
    assert R.truncated_normal(k, -1.0, 1.0, (2,), np.float16).dtype == ms.float16
    assert R.gumbel(k, (2,), "float64").dtype == ms.float64
    assert R.randint(k, (2,), 0, 5, "int64").dtype == ms.int64
    assert R.randint(k, (2,), 0, 5, np.int32).dtype == ms.int32
    assert R.bits(k, (2,), "uint32").dtype == ms.uint32
    with pytest.raises(fs.ArgumentError, match=r"dtype must be float16, float32 or float64, "
                       r"got Int32\.\nFix: pass one of them"):
        R.uniform(k, (3,), dtype="int32")
    with pytest.raises(fs.ArgumentError, match=r"'nope' is not a dtype fshard knows.\nFix"):
        R.normal(k, (3,), "nope")
    with pytest.raises(fs.ArgumentError, match=r"signed integer dtype, got UInt32"):
        R.randint(k, (3,), 0, 5, np.uint32)


def _rows_differ(rows) -> bool:
    rows = np.asarray(rows.asnumpy())
    return not all(np.array_equal(rows[0], r) for r in rows[1:])


@pytest.mark.full  # slow; the quick run covers it elsewhere
def test_a_loop_body_drawing_from_a_key_no_iteration_changes_is_a_warning():
    k = R.key(0)
    xs = np.ones((3, 4), np.float32)
    same = r"(?s)inside the body of {}: its key is the same in every iteration.*fold_in"
    cases = {
        "fs.scan": [
            lambda: fs.scan(lambda c, x: (c, R.normal(k, (2,))), 0.0, None, length=3),
            lambda: fs.jit(lambda k: fs.scan(lambda c, x: (c, R.normal(R.fold_in(k, 3), (2,))),
                                             0.0, xs))(k),
            lambda: fs.scan(lambda c, x: (c, fs.nn.dropout(k, x, 0.5)), 0.0, xs),
            lambda: fs.scan(lambda c, x: (c, fs.cond(x.sum() > 0, lambda: R.normal(k, ()),
                                                     lambda: R.uniform(k, ()))), 0.0, xs),
        ],
        "fs.fori_loop": [
            lambda: fs.fori_loop(0, 3, lambda i, c: c + R.normal(k, ()), np.float32(0)),
            lambda: fs.fori_loop(0, 300, lambda i, c: c + R.normal(k, ()), np.float32(0)),
            lambda: fs.jit(lambda n: fs.fori_loop(0, n, lambda i, c: c + R.normal(k, ()),
                                                  np.float32(0)))(Tensor(np.int32(3))),
        ],
        "fs.while_loop": [
            lambda: fs.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + R.uniform(
                k, ())), (np.int32(0), np.float32(0))),
        ],
    }
    for api, calls in cases.items():
        for call in calls:
            with pytest.warns(fs.KeyReuseWarning, match=same.format(api)):
                call()


@pytest.mark.full  # slow: the full matrix (the quick run covers the feature elsewhere)
def test_loop_keys_that_change_every_iteration_are_not_warned_about():
    k = R.key(0)

    def carried(c, x):
        c, sub = R.split(c)
        return c, R.normal(sub, (2,))

    with warnings.catch_warnings():
        warnings.simplefilter("error", fs.KeyReuseWarning)
        rows = fs.scan(lambda c, i: (c, R.normal(R.fold_in(k, i), (2,))), 0.0,
                       np.arange(3, dtype=np.int32))[1]
        assert _rows_differ(rows)
        assert _rows_differ(fs.jit(lambda k: fs.scan(carried, k, None, length=3))(k)[1])
        fs.fori_loop(0, 3, lambda i, c: c + R.normal(R.fold_in(k, i), ()), np.float32(0))
        fs.fori_loop(0, 300, lambda i, c: c + R.normal(R.fold_in(k, i), ()), np.float32(0))
        fs.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, R.split(c[1])[0], c[2]),
                      (np.int32(0), k, np.float32(0)))
