"""The fast call path of ``fs.jit``: after the first call of a signature, calls go
straight to MindSpore's graph executor (``backend.GraphFunction``). These tests
check that it gives the same values as the ``mindspore.jit`` route in every shape
of call, and that it steps aside whenever its assumptions do not hold.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

import fshard as fs
from fshard.backend.mindspore import GraphFunction

RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def T(a):
    return ms.Tensor(a)


def graph_fn(jitted, *args, **kwargs) -> GraphFunction:
    """The GraphFunction that ``jitted(*args, **kwargs)`` calls."""
    return jitted.lower(*args, **kwargs).compile().fn


def tiny(a, b, c):
    return fs.ops.add(fs.ops.relu(fs.ops.matmul(a, b)), c)


def tiny_np(a, b, c):
    return np.maximum(a @ b, 0) + c


def test_results_equal_and_fast_path_engages():
    f = fs.jit(tiny)
    a, b, c = rand(2, 2), rand(2, 2), rand(2, 2)
    first = f(T(a), T(b), T(c)).asnumpy()
    g = graph_fn(f, T(a), T(b), T(c))
    assert g.fast
    # later calls do not go through mindspore.jit at all
    slow_calls = []
    jitted = g.jitted
    g.jitted = lambda *args: slow_calls.append(args) or jitted(*args)
    second = f(T(a), T(b), T(c)).asnumpy()
    assert slow_calls == []
    np.testing.assert_allclose(first, tiny_np(a, b, c), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(second, first)
    assert f.trace_count == 1


def test_same_values_as_mindspore_jit():
    def body(a, b, c):
        return ops.add(ops.relu(ops.matmul(a, b)), c)

    ref = ms.jit(body, fullgraph=True)
    f = fs.jit(tiny)
    for _ in range(5):
        args = [T(rand(3, 3)) for _ in range(3)]
        np.testing.assert_array_equal(f(*args).asnumpy(), ref(*args).asnumpy())


def test_many_calls_use_fresh_inputs():
    f = fs.jit(tiny)
    for i in range(200):
        a, b, c = rand(4, 3), rand(3, 5), rand(4, 5)
        np.testing.assert_allclose(f(T(a), T(b), T(c)).asnumpy(), tiny_np(a, b, c),
                                   rtol=1e-5, atol=1e-5, err_msg=f"call {i}")
    assert f.trace_count == 1
    assert graph_fn(f, T(a), T(b), T(c)).fast


def test_multiple_outputs_and_output_pytrees():
    def f(x, y):
        return x + y, {"prod": x * y, "pair": (x - y, fs.ops.exp(x))}

    jf = fs.jit(f)
    for _ in range(3):
        x, y = rand(2, 3), rand(2, 3)
        out = jf(T(x), T(y))
        assert isinstance(out, tuple) and isinstance(out[1], dict)
        np.testing.assert_allclose(out[0].asnumpy(), x + y, rtol=1e-6)
        np.testing.assert_allclose(out[1]["prod"].asnumpy(), x * y, rtol=1e-6)
        np.testing.assert_allclose(out[1]["pair"][0].asnumpy(), x - y, rtol=1e-6)
        np.testing.assert_allclose(out[1]["pair"][1].asnumpy(), np.exp(x), rtol=1e-5)
    assert graph_fn(jf, T(x), T(y)).fast


def test_single_output_in_a_container():
    jf = fs.jit(lambda x: [x * 2.0])
    for _ in range(3):
        x = rand(3)
        out = jf(T(x))
        assert isinstance(out, list) and len(out) == 1
        np.testing.assert_allclose(out[0].asnumpy(), 2 * x)


def test_input_pytrees_and_kwargs():
    def mlp(params, x, *, scale):
        for w, b in params["layers"]:
            x = fs.ops.relu(fs.ops.add(fs.ops.matmul(x, w), b))
        return fs.ops.mul(x, scale)

    def mlp_np(params, x, scale):
        for w, b in params["layers"]:
            x = np.maximum(x @ w + b, 0)
        return x * scale

    jf = fs.jit(mlp)
    for _ in range(4):
        p = {"layers": [(rand(5, 4), rand(4)), (rand(4, 3), rand(3))]}
        x, s = rand(2, 5), rand(2, 3)
        pt = fs.tree.map(T, p)
        np.testing.assert_allclose(jf(pt, T(x), scale=T(s)).asnumpy(), mlp_np(p, x, s),
                                   rtol=1e-5, atol=1e-5)
    assert jf.trace_count == 1
    assert graph_fn(jf, pt, T(x), scale=T(s)).fast


def test_scalars_and_numpy_inputs():
    jf = fs.jit(lambda x, s, n: x * s + n)
    for i in range(5):
        x = rand(3)
        out = jf(x, float(i) + 0.5, np.float32(i))      # NumPy array, Python float, NumPy scalar
        np.testing.assert_allclose(out.asnumpy(), x * (i + 0.5) + i, rtol=1e-6)
    assert jf.trace_count == 1


def test_different_signatures():
    jf = fs.jit(tiny)
    shapes = [((2, 2), (2, 2), (2, 2)), ((3, 4), (4, 2), (3, 2)), ((2, 2), (2, 2), (2, 2))]
    for sa, sb, sc in shapes * 3:
        a, b, c = rand(*sa), rand(*sb), rand(*sc)
        np.testing.assert_allclose(jf(T(a), T(b), T(c)).asnumpy(), tiny_np(a, b, c),
                                   rtol=1e-5, atol=1e-5)
    # float64 is a different signature too
    a, b, c = rand(2, 2, dtype=np.float64), rand(2, 2, dtype=np.float64), rand(2, 2, dtype=np.float64)
    for _ in range(2):
        out = jf(T(a), T(b), T(c))
        assert out.dtype == ms.float64
        np.testing.assert_allclose(out.asnumpy(), tiny_np(a, b, c), rtol=1e-12)
    assert jf.trace_count == 3


def test_static_arguments():
    jf = fs.jit(lambda x, k: x * float(k), static_argnums=1)
    for k in (1, 2, 1, 3):
        x = rand(3)
        np.testing.assert_allclose(jf(T(x), k).asnumpy(), x * k, rtol=1e-6)
    assert jf.trace_count == 3


def test_identity_constant_and_no_outputs():
    c = rand(2)
    ident = fs.jit(lambda x: x)
    const = fs.jit(lambda x: (x, T(c)))
    empty = fs.jit(lambda x: ())
    for _ in range(3):
        x = rand(2)
        np.testing.assert_array_equal(ident(T(x)).asnumpy(), x)
        out = const(T(x))
        np.testing.assert_array_equal(out[0].asnumpy(), x)
        np.testing.assert_array_equal(out[1].asnumpy(), c)
        assert empty(T(x)) == ()


def test_async_producers_and_consumers():
    """Inputs still being computed by PyNative ops, outputs used by PyNative ops."""
    jf = fs.jit(lambda x: fs.ops.mul(x, 2.0))
    big = rand(300, 300) / 20
    bt = T(big)
    ref = big.astype(np.float64)
    expect = 2 * (ref @ ref @ ref)
    for _ in range(10):
        y = ops.matmul(ops.matmul(bt, bt), bt)      # dispatched asynchronously
        z = jf(y)
        w = ops.add(z, z)
        np.testing.assert_allclose(w.asnumpy(), 2 * expect, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(z.asnumpy(), expect, rtol=1e-3, atol=1e-3)
    assert graph_fn(jf, y).fast


def test_parameters_are_passed_as_the_tensors_they_hold():
    # A Parameter argument goes in as its current value, on the fast path too: a
    # set_data between calls is seen, and plain tensors afterwards reuse the graph.
    jf = fs.jit(lambda w, x: fs.ops.matmul(x, w))
    w = ms.Parameter(T(rand(3, 2)), name="w")
    for _ in range(3):
        x = rand(4, 3)
        np.testing.assert_allclose(jf(w, T(x)).asnumpy(), x @ w.asnumpy(), rtol=1e-5)
    g = graph_fn(jf, w, T(x))
    assert g.fast
    w.set_data(T(rand(3, 2)))
    x = rand(4, 3)
    np.testing.assert_allclose(jf(w, T(x)).asnumpy(), x @ w.asnumpy(), rtol=1e-5)
    for _ in range(3):
        wt, x = rand(3, 2), rand(4, 3)
        np.testing.assert_allclose(jf(T(wt), T(x)).asnumpy(), x @ wt, rtol=1e-5)
    assert g.fast and g.compiles == 1


def test_constant_tensors_take_the_mindspore_jit_route():
    """A ``const_arg`` tensor is compiled in by value; the fast path must not reuse
    a graph compiled for another value."""
    jf = fs.jit(lambda x: fs.ops.mul(x, 3.0))
    for v in (1.0, 2.0, 5.0):
        x = ms.Tensor(np.full(3, v, np.float32), const_arg=True)
        np.testing.assert_allclose(jf(x).asnumpy(), np.full(3, 3 * v))
    for _ in range(2):
        x = rand(3)
        np.testing.assert_allclose(jf(T(x)).asnumpy(), 3 * x, rtol=1e-6)
    assert graph_fn(jf, T(x)).fast
    # and once the fast path is on, constant tensors still go the mindspore.jit way
    for v in (7.0, 9.0):
        x = ms.Tensor(np.full(3, v, np.float32), const_arg=True)
        np.testing.assert_allclose(jf(x).asnumpy(), np.full(3, 3 * v))


def test_pynative_grad_through_a_jitted_function():
    """Under MindSpore's PyNative autodiff, calls go through mindspore.jit so the
    graph is recorded for the gradient."""
    jf = fs.jit(lambda x: fs.ops.mul(x, x))
    x = T(rand(3))
    jf(x), jf(x)  # the fast path is on for this signature
    assert graph_fn(jf, x).fast

    def loss(x):
        return ops.reduce_sum(jf(x))

    grad = ms.grad(loss)(x)
    np.testing.assert_allclose(grad.asnumpy(), 2 * x.asnumpy(), rtol=1e-6)
    np.testing.assert_allclose(jf(x).asnumpy(), x.asnumpy() ** 2, rtol=1e-6)


def test_a_failing_direct_call_falls_back():
    jf = fs.jit(tiny)
    args = [T(rand(2, 2)) for _ in range(3)]
    expect = jf(*args).asnumpy()
    g = graph_fn(jf, *args)
    assert g.fast
    g._phase = "no.such.phase"  # as if MindSpore had dropped the graph
    np.testing.assert_array_equal(jf(*args).asnumpy(), expect)
    assert not g.fast  # it stops trying the direct route
    np.testing.assert_array_equal(jf(*args).asnumpy(), expect)


def test_runtime_errors_still_surface():
    """An input of the right signature but wrong content type still reaches
    MindSpore's own checks through the fallback (and raises, not hangs)."""
    jf = fs.jit(lambda x: fs.ops.add(x, 1.0))
    x = T(rand(2))
    jf(x), jf(x)
    with pytest.raises(Exception):
        graph_fn(jf, x)(T(rand(2)), T(rand(2)))  # wrong arity: both routes refuse


def test_cache_key_includes_the_default_mesh():
    # A graph compiled under one default mesh must not be reused under another.
    import fshard as fs

    f = fs.jit(lambda x: x * 2.0)
    x = np.ones(4, np.float32)
    f(x)
    with fs.Mesh((2,), ("d",)):
        f(x)
        f(x)
    f(x)
    assert f.trace_count == 2
    f.lower(x)
    assert f.trace_count == 2  # lower() and a call share one cache entry


def test_a_failing_fast_path_call_is_not_run_again():
    """A graph that fails at run time raises; it is never re-run through mindspore.jit
    (in a job that would repeat this rank's collectives alone)."""
    import mindspore as ms
    import numpy as np
    import pytest

    import fshard as fs

    g = fs.jit(lambda x: x * 2.0).lower(ms.Tensor(np.ones(2, np.float32))).compile().fn
    x = ms.Tensor(np.ones(2, np.float32))
    g(x), g(x)
    assert g.fast

    class Failing:
        def __init__(self, compiled):
            self.compiled = compiled

        def set_jit_config(self, config):
            pass

        def __call__(self, args, phase):
            raise RuntimeError("the kernel failed")

        def has_compiled(self, phase):
            return self.compiled

    calls = []
    real = g.jitted
    g.jitted = lambda *a: calls.append(a) or real(*a)
    g._executor = Failing(compiled=True)
    with pytest.raises(RuntimeError, match="the kernel failed"):
        g(x)
    assert calls == [] and g.fast  # not run again, and the route stays
    g._executor = Failing(compiled=False)  # the graph is gone: mindspore.jit again
    assert g(x).asnumpy().tolist() == [2.0, 2.0] and len(calls) == 1 and not g.fast


def test_parameters_then_their_updates_compile_once():
    # A training loop's first step passes a Cell's Parameters, the next ones the
    # updated Tensors: one graph serves both (MindSpore compiles per argument kind).
    a, b, c = rand(3, 4), rand(4, 2), rand(3, 2)
    params = [ms.Parameter(T(v), name=f"p{i}") for i, v in enumerate((a, b, c))]
    jitted = fs.jit(tiny)
    fn = graph_fn(jitted, *params)
    first = jitted(*params).asnumpy()
    second = jitted(T(a), T(b), T(c)).asnumpy()
    np.testing.assert_allclose(first, tiny_np(a, b, c), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(second, first)
    assert fn.compiles == 1


def test_the_call_waits_for_the_output_at_the_end_of_the_longest_chain():
    # MindSpore's CPU runtime waits slowly for an output of a running graph once
    # another is ready, so a call waits for the output the graph finishes last: the
    # end of the longest chain (a training step's first-layer update, ready after the
    # whole backward pass), not the output defined last in program order (a cheap
    # value ready at once: waiting on it made AutoParallel's GPT step 2-7x slower).
    def f(x):
        h = x
        for _ in range(6):
            h = fs.ops.tanh(h @ x)
        return h, x * 2.0

    x = rand(4, 4)
    compiled = fs.jit(f).lower(T(x)).compile()
    assert compiled._wait == 0
    h, d = fs.jit(f)(T(x))
    np.testing.assert_allclose(d.asnumpy(), x * 2.0)


def test_the_longest_chain_counts_the_order_the_lowering_gives_collectives():
    # In a job the lowering chains collectives in program order (every rank issues
    # them in one order): a psum of an input ready at once still ends after the psum
    # before it. AutoParallel's data-parallel Adam step waited on the first layer's
    # update (deepest by its operands) while the last layer's AllReduce, issued last,
    # still ran: the step took 1.25x as long.
    from fshard.core import dtypes
    from fshard.core.ir import Equation, Program, Var
    from fshard.core.tracing import ArrayType
    from fshard.primitives.collectives import psum_p
    from fshard.primitives.elementwise import tanh_p
    from fshard.transforms.jit import _last_output

    def var():
        return Var(ArrayType((4,), dtypes.float32))

    a, b = var(), var()
    h, eqs = a, []
    for _ in range(3):  # a long chain before the first collective
        out = var()
        eqs.append(Equation(tanh_p, [h], {}, [out]))
        h = out
    first, second = var(), var()
    eqs.append(Equation(psum_p, [h], {"axis_name": ("d",)}, [first]))
    eqs.append(Equation(psum_p, [b], {"axis_name": ("d",)}, [second]))
    assert _last_output(Program([a, b], eqs, [first, second])) == 1
    # without collectives, the deeper chain is the one waited for
    plain = eqs[:3] + [Equation(tanh_p, [b], {}, [second])]
    assert _last_output(Program([a, b], plain, [h, second])) == 0


def test_a_virtual_meshs_collectives_are_not_chained_in_program_order():
    # On a virtual mesh the per-device program's AllReduces are sums of the devices'
    # lanes, run when their operands are ready. The data-parallel value_and_grad of an
    # MLP has them at its outputs, in output order: the last (the last layer's weight
    # gradient) is computed first by backpropagation; the first layer's is last.
    rng = np.random.default_rng(0)
    sizes = (16, 32, 32, 4)
    p = {f"w{i}": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
         for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
    x = rng.standard_normal((32, 16)).astype(np.float32)

    def loss(p, x):
        h = x
        for i in range(3):
            h = fs.ops.tanh(h @ p[f"w{i}"])
        return (h ** 2).mean()

    rep = {k: (1, 1) for k in p}
    f = fs.shard(fs.value_and_grad(loss), in_strategy=(rep, (8, 1)), mesh=8)
    compiled = fs.jit(f).lower(p, x).compile()
    # outputs: the value, then the gradients of w0, w1, w2
    assert compiled._wait == 1
