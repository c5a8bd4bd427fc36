"""fs.debug.print / fs.debug.callback and MindSpore's ops.Print: called with the values
every time a program runs (eagerly and in fs.jit), per example under vmap, per device
on a virtual mesh, in the forward pass only under grad; never pruned, merged or
reordered by the IR passes or by MindSpore."""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor, ops

import fshard as fs

X = np.arange(3, dtype=np.float32)


def _lines(capfd) -> list[str]:
    return [ln for ln in capfd.readouterr().out.splitlines() if ln.strip()]


def _f(x):
    fs.debug.print("x = {}", x)
    y = x * 2
    fs.debug.print("sum = {s}", s=y.sum())
    return y + 1


def test_print_eagerly_and_at_every_run_of_a_jitted_function(capfd):
    _f(Tensor(X))
    assert _lines(capfd) == ["x = [0. 1. 2.]", "sum = 6.0"]
    f = fs.jit(_f)
    for k in range(2):  # the second call reuses the compiled graph and prints again
        fs.block_until_ready(f(Tensor(X + k)))
        assert _lines(capfd) == [f"x = {X + k}", f"sum = {float(2 * (X + k).sum())}"]


def test_a_callback_whose_result_nothing_reads_is_kept_and_in_order(capfd):
    def f(x):
        fs.debug.print("first {}", x)
        fs.debug.print("first {}", x)  # equal equations: both print
        fs.debug.print("last {}", x[0])
        return x
    fs.block_until_ready(fs.jit(f)(Tensor(X)))
    assert _lines(capfd) == ["first [0. 1. 2.]", "first [0. 1. 2.]", "last 0.0"]
    assert str(fs.make_ir(f)(Tensor(X))).count("debug_callback") == 3


def test_vmap_calls_once_per_example_in_order():
    seen = []
    xs = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = fs.jit(fs.vmap(lambda x, w: (fs.debug.callback(lambda a, b: seen.append((a, b)),
                                                         x, w), x * w)[1],
                         in_axes=(0, None)))(Tensor(xs), Tensor(X))
    fs.block_until_ready(out)   # programs run asynchronously: wait for this run
    assert len(seen) == 2
    for (a, b), row in zip(seen, xs):
        np.testing.assert_array_equal(a, row)
        np.testing.assert_array_equal(b, X)  # unbatched: whole, to every example


def test_grad_calls_in_the_forward_pass_only():
    seen = []

    def loss(w):
        fs.debug.callback(seen.append, w)
        return (w * w).sum()
    g = fs.jit(fs.grad(loss))(Tensor(X))
    np.testing.assert_allclose(g.asnumpy(), 2 * X)
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0], X)


def test_virtual_mesh_calls_once_per_device_with_its_block():
    seen = []
    f = fs.shard_map(lambda x: (fs.debug.callback(seen.append, x), x + 1)[1],
                     in_strategy=((2,),), out_strategy=(2,), mesh=fs.Mesh((2,), ("d",)))
    fs.block_until_ready(f(Tensor(np.arange(4, dtype=np.float32))))
    assert [s.tolist() for s in seen] == [[0.0, 1.0], [2.0, 3.0]]


def test_a_callback_may_keep_the_arrays_it_is_given():
    """MindSpore hands a callback buffers it reuses at the next call: fshard copies them,
    so arrays kept from earlier runs keep their values."""
    seen = []

    @fs.jit
    def f(x):
        fs.debug.callback(seen.append, x * 2.0)
        return x + 1.0

    for i in range(3):
        fs.block_until_ready(f(np.full(4, float(i), np.float32)))
    assert [s.tolist() for s in seen] == [[0.0] * 4, [2.0] * 4, [4.0] * 4]
    kept = []
    g = fs.jit(fs.shard_map(lambda x: (fs.debug.callback(kept.append, x), x + 1)[1],
                            in_strategy=((2,),), out_strategy=(2,),
                            mesh=fs.Mesh((2,), ("d",))))
    for i in range(2):
        fs.block_until_ready(g(Tensor(np.arange(4, dtype=np.float32) + 10 * i)))
    assert [s.tolist() for s in kept] == [[0.0, 1.0], [2.0, 3.0], [10.0, 11.0], [12.0, 13.0]]


def test_inside_a_loop_body_every_iteration():
    seen = []

    def body(i, c):
        fs.debug.callback(seen.append, c)
        return c + 1
    out = fs.jit(lambda c: fs.fori_loop(0, 3, body, c))(Tensor(np.float32(0)))
    assert float(out.asnumpy()) == 3.0
    assert [float(s) for s in seen] == [0.0, 1.0, 2.0]


def test_mindspore_print_prints_at_run_time_as_mindspore_shows_tensors(capfd):
    def f(x):
        ops.Print()("y:", x * 2)
        return x + 1
    fs.block_until_ready(fs.jit(f)(Tensor(X)))
    want = ["y:", ("Tensor(shape=[3], dtype=Float32, value= [ 0.00000000e+00,  "
                   "2.00000000e+00,  4.00000000e+00])")]
    assert _lines(capfd) == want
    ops.Print()("y:", Tensor(X * 2))  # MindSpore's own (PyNative) print: the same text
    assert _lines(capfd) == want


def test_errors():
    with pytest.raises(fs.errors.ArgumentError, match=r"(?s)fn must be callable.*Fix"):
        fs.debug.callback(3, Tensor(X))
    with pytest.raises(fs.errors.ArgumentError, match=r"(?s)fmt must be a format string.*Fix"):
        fs.debug.print(Tensor(X))
