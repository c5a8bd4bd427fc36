"""Declared per-process slices of ``fs.AutoParallel`` with
``dataset_strategy('data_parallel')`` in a job: the global batch they declare
(``local_batch.global_declared``) and a program whose inputs hold only a block of a
symbolic dimension. The job itself: tests/distributed/test_dynamic_slices_multiprocess.py
(full matrix) and the quick run's job (tests/test_launch.py)."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

import fshard as fs
from fshard.backend import mindspore as backend
from fshard.core.dims import dim_div, dim_multiple_of
from fshard.core.staging import stage
from fshard.sharding.local_batch import global_declared
from fshard.transforms.jit import declared_types


def test_a_declared_slice_declares_n_times_its_sizes():
    s = fs.Symbol(divisor=8, max=64)
    x = fs.ArrayType((s, 1, 8, 8), ms.float32)
    y = fs.ArrayType((s,), ms.int32)
    gx, gy = global_declared((x, y), 2)
    g = gx.shape[0]
    assert g is gy.shape[0]  # one Symbol for one Symbol: x's and y's batches stay equal
    assert gx.shape[1:] == (1, 8, 8) and gx.dtype == ms.float32
    assert [n for n in range(1, 200) if g.accepts(n)] == [16, 32, 48, 64, 80, 96, 112, 128]
    assert dim_multiple_of(g, 2) and dim_div(g, 2) != s  # split 2 ways: g/2, not s


def test_a_remainder_and_a_static_first_dimension_scale_too():
    s = fs.Symbol(divisor=8, remainder=4)
    gx, gm, none = global_declared((fs.ArrayType((s, 3), ms.float32),
                                    {"m": fs.ArrayType((5, 3), ms.float32)}, None), 4)
    assert [n for n in range(1, 120) if gx.shape[0].accepts(n)] == [16, 48, 80, 112]
    assert dim_multiple_of(gx.shape[0], 4)
    assert gm["m"].shape == (20, 3) and none is None


def test_mindsporess_symbols_declare_the_global_batch_the_same_way():
    s0 = ms.Symbol(divisor=8)
    specs = declared_types((ms.Tensor(shape=[s0, 4], dtype=ms.float32),
                            ms.Tensor(shape=[s0], dtype=ms.int32)), "t")
    gx, gy = global_declared(specs, 2)
    assert gx.shape[0] is gy.shape[0] and gx.shape[0].accepts(32)
    assert not gx.shape[0].accepts(24)


def test_a_batch_symbol_that_is_also_another_dimension_is_not_scaled():
    s = fs.Symbol(divisor=8)
    # the global batch would be 2 * s in dimension 0 and s in dimension 1: no one
    # Symbol; the step is then planned for each slice size, as without a declaration
    assert global_declared((fs.ArrayType((s, 4), ms.float32),
                            fs.ArrayType((4, s), ms.float32)), 2) is None
    assert global_declared((fs.ArrayType((), ms.float32),), 2) is None


def test_a_program_whose_input_is_a_block_of_a_symbolic_dimension_reads_its_size():
    # a process's rows (s/2) of a global batch s that the program reshapes whole
    s = fs.Symbol(divisor=2)
    a = fs.ArrayType((s // 2, 8), ms.float32)
    program, consts = stage(lambda x: [ops.reshape(x, (s, 4))], [a])
    src, globals_, _ = backend.lower_program(program, consts, "rows")
    assert "v0.shape[0] * 2" in src, src
    f = backend.compile_source(src, globals_, "rows", dynamic=[a])
    for k in (3, 5):
        x = np.arange(k * 8, dtype=np.float32).reshape(k, 8)
        out = f(ms.Tensor(x))
        out = out[0] if isinstance(out, (tuple, list)) else out
        np.testing.assert_array_equal(out.asnumpy(), x.reshape(2 * k, 4))


def _mlp_loss(params, x, y):
    h = ops.relu(ops.matmul(ops.reshape(x, (-1, 16)), params["w1"]))
    return ops.mean((ops.matmul(h, params["w2"]) - y) ** 2)


def test_a_declared_batch_accumulates_gradients_in_one_program():
    # what a job's declared slices make of the global batch: gradient_accumulation
    # splits a symbolic batch into micro-batches when the split is provable
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(0, 0.3, (16, 8)).astype(np.float32),
              "w2": rng.normal(0, 0.3, (8, 2)).astype(np.float32)}
    x = rng.normal(size=(48, 16)).astype(np.float32)
    y = rng.normal(size=(48, 2)).astype(np.float32)
    g = fs.Symbol(divisor=16, min=2)
    ap = fs.AutoParallel(_mlp_loss, fs.optim.sgd(0.1), mesh=2, in_shapes=(
        fs.ArrayType((g, 16), ms.float32), fs.ArrayType((g, 2), ms.float32)))
    ap.gradient_accumulation(4)
    ref = fs.AutoParallel(_mlp_loss, fs.optim.sgd(0.1), mesh=2).gradient_accumulation(4)
    state, want_state = ap.init(params), ref.init(params)
    for b in (16, 48, 32):
        state, loss = ap(state, x[:b], y[:b])
        want_state, want = ref(want_state, x[:b], y[:b])
        np.testing.assert_allclose(loss.asnumpy(), want.asnumpy(), rtol=1e-5)
    for k in params:
        got, w = state.params[k].asnumpy(), want_state.params[k].asnumpy()
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6 * np.abs(w).max())
    _, jitted = ap.sharded(state, x[:16], y[:16])
    assert (jitted.trace_count, jitted.compile_count) == (1, 1)
    bad = fs.AutoParallel(_mlp_loss, fs.optim.sgd(0.1), mesh=2, in_shapes=(
        fs.ArrayType((fs.Symbol(divisor=4), 16), ms.float32), None)).gradient_accumulation(4)
    with np.testing.assert_raises_regex(fs.ArgumentError, r"(?s)gradient_accumulation\(4\): "
                                        r"a batch input is f32\[s\d+,16\].*multiple of 8"):
        bad(bad.init(params), x[:16], y[:16])
