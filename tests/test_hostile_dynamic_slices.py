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
