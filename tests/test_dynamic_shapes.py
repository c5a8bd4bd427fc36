"""Dynamic shapes: a function declared with ``fs.Symbol`` dimensions is traced and
compiled once, runs every size its Symbols accept with the numbers of the static
program for that size, and refuses (with an fshard error) any size they do not."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

import fshard as fs
from fshard.core.tracing import dim_div, dim_multiple_of, dim_prod
from fshard.transforms.jit import HOT_CALLS, MAX_SPECIALIZED

F32 = ms.float32
RNG = np.random.default_rng(0)


def _t(*shape, dtype=np.float32):
    return Tensor(RNG.normal(size=shape).astype(dtype))


def _close(got, want):
    for g, w in zip(fs.tree.leaves(got), fs.tree.leaves(want), strict=True):
        g, w = np.asarray(g.asnumpy()), np.asarray(w.asnumpy())
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(w).max()))


# -- the dimension algebra ---------------------------------------------------


def test_symbol_products_and_exact_division():
    s, t = fs.Symbol(divisor=8), fs.Symbol()
    assert str(s * 784) == "784*s" + s.name[1:] and dim_div(s * 784, 784) is s
    assert dim_div(dim_prod((s, 1, 28, 28)), 784) is s
    assert str(s // 8) == f"{s.name}/8" and (s // 8) * 8 is s
    assert dim_multiple_of(s, 8) and dim_multiple_of(s * 3, 24) and not dim_multiple_of(s, 16)
    assert dim_multiple_of(s // 2, 4) and not dim_multiple_of(t, 2)
    with pytest.raises(fs.ArgumentError, match="multiple of 8"):
        t // 8
    with pytest.raises(fs.ArgumentError, match="does not divide"):
        dim_div(s, t)


# -- one program for every size -----------------------------------------------

S = fs.Symbol(divisor=8)


def mlp_loss(w, x, y):  # the seed's reshape(x, (-1, 784)) on a symbolic batch
    h = ops.reshape(x, (-1, 784))
    o = ops.relu(h @ w)
    return ops.mean((o - y) ** 2)


def cross_entropy(w, x, labels):
    logits = x @ w
    return ops.mean(-ops.gather_elements(ops.log_softmax(logits, 1), 1,
                                         ops.expand_dims(labels, 1)))


CASES = {
    # name: (function, declarations, argument maker for batch b)
    "value_and_grad of the seed's reshape MLP": (
        fs.value_and_grad(mlp_loss),
        (None, fs.ArrayType((S, 1, 28, 28), F32), fs.ArrayType((S, 10), F32)),
        lambda b: (_t(784, 10) * 0.01, _t(b, 1, 28, 28), _t(b, 10))),
    "elementwise, broadcasting, sums with keepdims": (
        lambda x, v: (x * v + 1.0, ops.sum(x, 1, keepdim=True) - x, ops.sum(x, 0)),
        (fs.ArrayType((S, 5), F32), None),
        lambda b: (_t(b, 5), _t(5))),
    "concat, slicing, transpose, max": (
        lambda x: (ops.concat([x, x * 2.0], 1), x[:, 1:3], x.T @ x, ops.amax(x, 0)),
        (fs.ArrayType((S, 4), F32),),
        lambda b: (_t(b, 4),)),
    "softmax, log_softmax, mean over the symbolic dim": (
        lambda x: (ops.softmax(x, 0), ops.log_softmax(x, 1), ops.mean(x, 0), x.mean()),
        (fs.ArrayType((S, 6), F32),),
        lambda b: (_t(b, 6),)),
    "grad of a gather cross-entropy": (
        fs.grad(cross_entropy),
        (None, fs.ArrayType((S, 12), F32), fs.ArrayType((S,), ms.int32)),
        lambda b: (_t(12, 10), _t(b, 12),
                   Tensor(RNG.integers(0, 10, b).astype(np.int32)))),
    "ops.ones/zeros of a symbolic shape, cross_entropy, argmax": (
        lambda x: (ops.zeros_like(x) + ops.ones((x.shape[0], 1)), ops.argmax(x, 0),
                   ops.cross_entropy(x, ops.zeros((x.shape[0],), ms.int32))),
        (fs.ArrayType((S, 3), F32),),
        lambda b: (_t(b, 3),)),
    "vmap over examples of a symbolic batch": (
        fs.vmap(lambda w, x: ops.tanh(x @ w).sum(), in_axes=(None, 0)),
        (None, fs.ArrayType((S, 3, 4), F32)),
        lambda b: (_t(4, 2), _t(b, 3, 4))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_trace_one_compile_and_the_static_numbers(name):
    fn, specs, make = CASES[name]
    dyn = fs.jit(fn, in_shapes=specs)
    for b in (8, 24, 16, 40):
        args = make(b)
        _close(dyn(*args), fs.jit(fn)(*args))
    assert (dyn.trace_count, dyn.compile_count) == (1, 1)


def test_twenty_batch_sizes_compile_once_with_set_inputs_and_mindspore_placeholders():
    s0 = ms.Symbol(divisor=8, unique=True)
    step = fs.jit(fs.value_and_grad(mlp_loss)).set_inputs(
        None, Tensor(shape=[s0, 1, 28, 28], dtype=F32), Tensor(shape=[s0, 10], dtype=F32))
    w = _t(784, 10) * 0.01
    for b in range(8, 168, 8):
        x, y = _t(b, 1, 28, 28), _t(b, 10)
        _close(step(w, x, y), fs.jit(fs.value_and_grad(mlp_loss))(w, x, y))
    assert (step.trace_count, step.compile_count) == (1, 1)


def test_a_cell_with_set_inputs():
    net = nn.SequentialCell(nn.Dense(6, 4), nn.ReLU(), nn.Dense(4, 2))
    f = fs.jit(net).set_inputs(Tensor(shape=[None, 6], dtype=F32))
    for b in (3, 5, 11):
        x = _t(b, 6)
        np.testing.assert_allclose(f(x).asnumpy(), net(x).asnumpy(), rtol=1e-5, atol=1e-6)
    assert (f.inner.trace_count, f.inner.compile_count) == (1, 1)


def test_a_size_called_often_gets_a_static_copy_with_the_same_numbers():
    f = fs.jit(fs.value_and_grad(mlp_loss), in_shapes=(
        None, fs.ArrayType((S, 1, 28, 28), F32), fs.ArrayType((S, 10), F32)))
    w, x, y = _t(784, 10) * 0.01, _t(16, 1, 28, 28), _t(16, 10)
    outs = [f(w, x, y) for _ in range(HOT_CALLS + 2)]
    for out in outs[1:]:
        _close(out, outs[0])  # the dynamic graph and the static copy agree
    assert (f.trace_count, f.compile_count) == (1, 2)
    compiled = next(iter(f._cache.values()))._compiled
    assert list(compiled.static) == [(16,)]
    for b in range(8, 8 * (MAX_SPECIALIZED + 3), 8):  # at most MAX_SPECIALIZED copies
        xb, yb = _t(b, 1, 28, 28), _t(b, 10)
        for _ in range(HOT_CALLS):
            f(w, xb, yb)
    assert len(compiled.static) == MAX_SPECIALIZED
    assert f.compile_count == 1 + MAX_SPECIALIZED


# -- never a wrong shape ------------------------------------------------------


def test_sizes_the_symbols_refuse_are_errors_naming_the_input_and_constraint():
    s = fs.Symbol(divisor=8, min=8, max=64)
    f = fs.jit(lambda x, y: x * 2.0 + y, in_shapes=(fs.ArrayType((s, 3), F32),
                                                    fs.ArrayType((s, 3), F32)))
    f(_t(16, 3), _t(16, 3))
    sym = r"s\d+ = Symbol\(max=64, min=8, divisor=8\)"
    for bad, what in [
            ((12, 12), rf"args\[0\] \(parameter .x.\) has size 12 in dimension 0, which {sym}"),
            ((72, 72), "size 72 in dimension 0"),
            ((8, 16), rf"args\[1\] \(parameter .y.\) has size 16 in dimension 0, but the same "
                      rf"{sym} has size 8 in args\[0\]"),
            ((8, 8, 4), "dimension 1 must be 3")]:
        args = (_t(bad[0], 3), _t(bad[1], 3 if len(bad) == 2 else bad[2]))
        with pytest.raises(fs.ShapeError, match=what):
            f(*args)
    with pytest.raises(fs.ShapeError,
                       match=r"has type f16\[8,3\], but the program was compiled for f32"):
        f(_t(8, 3).astype(ms.float16), _t(8, 3))


def test_min_remainder_unique_and_lowered_programs_are_checked():
    def refused(sym, size):
        return rf"has size {size} in dimension 0, which s\d+ = {sym} does not accept"

    below = fs.jit(lambda x: x * 2.0, in_shapes=(fs.ArrayType((fs.Symbol(min=8), 3), F32),))
    with pytest.raises(fs.ShapeError, match=refused(r"Symbol\(min=8\)", 4)):
        below(_t(4, 3))
    odd = fs.jit(lambda x: x * 2.0, in_shapes=(
        fs.ArrayType((fs.Symbol(divisor=4, remainder=1), 3), F32),))
    assert odd(_t(9, 3)).shape == (9, 3)
    with pytest.raises(fs.ShapeError, match=refused(r"Symbol\(divisor=4, remainder=1\)", 8)):
        odd(_t(8, 3))
    u = ms.Symbol(unique=True)  # one MindSpore object with unique=True: one size
    pair = fs.jit(lambda x, y: (x * 2.0, y * 2.0)).set_inputs(
        Tensor(shape=[u, 3], dtype=F32), Tensor(shape=[u], dtype=F32))
    with pytest.raises(fs.ShapeError, match=r"args\[1\] \(parameter 'y'\) has size 5 in "
                                            r"dimension 0, but the same s\d+ = "
                                            r"Symbol\(unique=True\) has size 4"):
        pair(_t(4, 3), _t(5))
    # a program lowered for a Symbol batch serves every batch with the right shape; one
    # lowered for batch 8 refuses batch 16 (never an (8, 10) result)
    dense = fs.jit(lambda x, w: x @ w)
    w = _t(784, 10)
    anyb = dense.lower(fs.ArrayType((fs.Symbol(), 784), F32), w).compile()
    for b in (16, 3):
        x = _t(b, 784)
        _close(anyb(x, w), dense(x, w))
    eight = dense.lower(_t(8, 784), w).compile()
    with pytest.raises(fs.ShapeError, match=r"input 0 has shape \(16, 784\), but the program "
                                            r"was compiled for f32\[8,784\]"):
        eight(_t(16, 784), w)


def test_unproven_equal_symbols_are_an_error_saying_what_would_have_to_hold():
    a, b = fs.Symbol(), fs.Symbol()
    f = fs.jit(lambda x, y: x + y, in_shapes=(fs.ArrayType((a,), F32), fs.ArrayType((b,), F32)))
    with pytest.raises(fs.ShapeError, match=rf"it would have to hold that {a.name} == {b.name}"):
        f(_t(4), _t(4))
    g = fs.jit(lambda x: ops.reshape(x, (-1, 3)), in_shapes=(fs.ArrayType((a, 2), F32),))
    with pytest.raises(fs.ShapeError, match="cannot reshape"):
        g(_t(3, 2))


def test_bad_declarations_are_argument_errors():
    with pytest.raises(fs.ArgumentError, match="expected an fs.ArrayType, a MindSpore placeholder"):
        fs.jit(lambda x: x, in_shapes=((8, 3),))
    with pytest.raises(fs.ArgumentError, match="must be a tuple with one entry per positional"):
        fs.jit(lambda x: x, in_shapes=fs.ArrayType((8,), F32))
    f = fs.jit(lambda x: x, in_shapes=(None, fs.ArrayType((8,), F32)))
    with pytest.raises(fs.ArgumentError, match="declares 2 inputs with set_inputs"):
        f(_t(8))
    with pytest.raises(fs.ArgumentError, match=r"argument 0: a declared dimension must be an "
                                               r"int, an fs.Symbol or None, got 'b' in"):
        fs.jit(lambda x: x, in_shapes=(fs.ArrayType(("b", 3), F32),))


def test_none_in_an_array_type_declaration_is_a_dimension_of_any_size():
    f = fs.jit(lambda x: x * 2.0, in_shapes=(fs.ArrayType((None, 3), F32),))
    for b in (1, 5, 12):
        x = _t(b, 3)
        _close(f(x), fs.jit(lambda x: x * 2.0)(x))
    assert (f.trace_count, f.compile_count) == (1, 1)


@pytest.mark.parametrize("dtype", [np.float32, np.dtype("float32"), float])
def test_an_array_type_declared_with_a_numpy_dtype_is_that_mindspore_dtype(dtype):
    # as a JAX user writes it: the declaration is of float32 arrays, not of a NumPy
    # type that no passed array would match
    def g(x, n):
        return x * 2.0 + ops.cast(n.sum(), ms.float32)

    f = fs.jit(g, in_shapes=(fs.ArrayType((None, 3), dtype),
                             fs.ArrayType((None,), np.int32)))
    for b in (2, 7):
        x, n = _t(b, 3), Tensor(np.arange(b, dtype=np.int32))
        _close(f(x, n), fs.jit(g)(x, n))
    assert (f.trace_count, f.compile_count) == (1, 1)


def _dense_relu(x, w):
    return ops.relu(x @ w)


def test_a_split_symbolic_dim_is_its_own_size_in_the_per_device_program():
    s = fs.Symbol(divisor=8)
    g = fs.shard(_dense_relu, in_strategy=((8, 1), None), mesh=8,
                 in_shapes=(fs.ArrayType((s, 16), F32), None))
    w = _t(16, 4)
    for b in (16, 8, 40, 24, 16):
        x = _t(b, 16)
        _close(g(x, w), fs.jit(_dense_relu)(x, w))
    assert (g.trace_count, g.compile_count) == (1, 1)
    part = g.partitioned(fs.ArrayType((s, 16), F32), fs.ArrayType((16, 4), F32))
    assert f"f32[{s.name}/8,16]{{(8, 1)}}" in str(part)  # each device: a block of s0/8 rows
    assert f"f32[{s.name}/8,4]" in str(part) and part.collectives() == ["all_gather"]
    with pytest.raises(fs.ShapeError, match=r"size 12 in dimension 0, which s\d+ = "
                                            r"Symbol\(divisor=8\) does not accept"):
        g(_t(12, 16), w)


@pytest.mark.parametrize("declared", [fs.Symbol(divisor=4), fs.Symbol(), fs.Symbol(
    divisor=8, remainder=4)])
def test_a_split_symbolic_dim_not_provably_divisible_is_an_error_naming_the_strategy(declared):
    g = fs.shard(_dense_relu, in_strategy=((8, 1), None), mesh=8).set_inputs(
        fs.ArrayType((declared, 16), F32), None)
    with pytest.raises(fs.ShardingError, match=(
            r"(?s)in_strategy\[0\] = \(8, 1\) splits dimension 0 \(size s\d+\) of argument "
            r"'x' \(f32\[s\d+,16\]\) into 8 parts, but s\d+ is not divisible by 8.*Fix: s\d+ is "
            r"declared Symbol\(.*\); declare it with fs.Symbol\(divisor=8\)")):
        g(_t(16, 16), _t(16, 4))


def test_shard_declarations_are_checked():
    with pytest.raises(fs.ShardingError, match=r"fs.shard\(in_shapes=...\) must be a tuple"):
        fs.shard(_dense_relu, in_strategy=((8, 1), None), mesh=8, in_shapes="annotations")
    with pytest.raises(fs.ArgumentError, match=r"fs.shard\(_dense_relu\).set_inputs: "
                                               r"argument 0\[0\]: expected an fs.ArrayType"):
        fs.shard(_dense_relu, in_strategy=((8, 1), None), mesh=8).set_inputs((8, 16))


# -- jaxtyping annotations as declarations ----------------------------------------

from jaxtyping import Float, Int  # noqa: E402


def dense(x: Float[Tensor, "b 784"], w: Float[Tensor, "784 10"]) -> Float[Tensor, "b 10"]:
    return ops.relu(x @ w)


def test_annotations_declare_a_shared_symbol_and_compile_once():
    f = fs.jit(dense, in_shapes="annotations")
    w = _t(784, 10)
    for b in (3, 5, 9):
        x = _t(b, 784)
        _close(f(x, w), fs.jit(dense)(x, w))
    assert (f.trace_count, f.compile_count) == (1, 1)


def test_annotation_mismatches_are_errors_naming_the_argument_and_dim():
    def transposed(x: Float[Tensor, "b 784"], w: Float[Tensor, "784 10"]) -> Float[Tensor, "b 10"]:
        return (x @ w).T

    def pair(x: Float[Tensor, "*batch n"], y: Float[Tensor, "*batch n"]) -> Float[Tensor, "*batch"]:
        return (x * y).sum(-1)

    def labels(y: Int[Tensor, " b"]) -> Int[Tensor, " b"]:
        return y + 1

    w = _t(784, 10)
    with pytest.raises(fs.ShapeError, match=r"the return value has type f32\[10,s\d+\]; "
                                            r"dimension 0 is 10, but the return annotation "
                                            r"'b 10' says b"):
        fs.jit(transposed, in_shapes="annotations")(_t(4, 784), w)
    with pytest.raises(fs.ShapeError, match=r"args\[0\] \(parameter 'x'\) has size 783 in "
                                            r"dimension 1, but its annotation 'b 784' fixes "
                                            "it to 784"):
        fs.jit(dense, in_shapes="annotations")(_t(4, 783), w)
    with pytest.raises(fs.ShapeError, match=r"args\[0\] \(parameter 'y'\) has dtype float32, "
                                            "but its annotation Int"):
        fs.jit(labels, in_shapes="annotations")(_t(4))
    g = fs.jit(pair, in_shapes="annotations")
    assert g(_t(2, 3, 4), _t(2, 3, 4)).shape == (2, 3)
    with pytest.raises(fs.ShapeError, match=r"args\[1\] \(parameter 'y'\) has \*batch = "
                                            r"\(3,\), but args\[0\] \(parameter 'x'\) has "
                                            r"\*batch = \(2, 3\)"):
        g(_t(2, 3, 4), _t(3, 4))
    b = fs.jit(dense, in_shapes="annotations")
    with pytest.raises(fs.ShapeError, match=r"args\[1\] \(parameter 'w'\) has size 7"):
        b(_t(4, 784), _t(784, 7))
    with pytest.raises(fs.ArgumentError, match="no parameter of <lambda> has a jaxtyping"):
        fs.jit(lambda x: x, in_shapes="annotations")


def _op_functions() -> list:
    import inspect

    return [getattr(fs.ops, n) for n in dir(fs.ops) if not n.startswith("_")
            and callable(getattr(fs.ops, n)) and not inspect.ismodule(getattr(fs.ops, n))]


def test_fshards_public_array_functions_carry_jaxtyping_annotations():
    import typing

    from fshard.core.array_types import Array

    for fn in (fs.psum, fs.pmean, fs.pmax, fs.pmin, fs.all_gather, fs.psum_scatter,
               fs.all_to_all, fs.ppermute, fs.broadcast, fs.axis_index, fs.random.key,
               fs.random.split, fs.random.fold_in, fs.random.bits, fs.random.uniform,
               fs.random.normal, fs.random.truncated_normal, fs.random.bernoulli,
               fs.random.randint, fs.random.gumbel, fs.random.categorical,
               fs.random.permutation, fs.nn.dropout, *_op_functions()):
        hints = typing.get_type_hints(fn)
        assert "return" in hints, fn.__name__
        assert hints["return"] is tuple or "jaxtyping" in repr(hints["return"]), fn.__name__
        arrays = [h for h in hints.values() if "jaxtyping" in repr(h)]
        assert arrays, f"{fn.__name__} has no jaxtyping annotation: {hints}"
    x = typing.get_type_hints(fs.pmax)["x"]
    assert typing.get_args(x)[0].dim_str == "*shape"  # Shaped[Array, "*shape"]
    assert "Int32[Tensor, '']" in repr(typing.get_type_hints(fs.axis_index)["return"])
    assert typing.get_args(Array) == (Tensor, np.ndarray)
    split = typing.get_type_hints(fs.random.split)
    assert typing.get_args(split["key"])[0].dim_str == "2"
    assert typing.get_args(split["return"])[0].dim_str == "num 2"


# -- the seed's network: batches of varying size, one compile -------------------------


def _seed_net(params, x):
    """The seed's MatMul-ReLU-MatMul-ReLU-MatMul network (on 8x8 digits)."""
    h = ops.reshape(x, (-1, 64))
    h = ops.relu(ops.matmul(h, params["fc1"]))
    h = ops.relu(ops.matmul(h, params["fc2"]))
    return ops.matmul(h, params["fc3"])


def _seed_loss(params, x, labels):
    logits = _seed_net(params, x)
    return ops.mean(-ops.gather_elements(ops.log_softmax(logits, 1), 1,
                                         ops.expand_dims(labels, 1)))


def test_the_seeds_network_trains_on_varying_batches_compiled_once():
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    labels = labels.astype(np.int32)
    rng = np.random.default_rng(1)
    init = {"fc1": _t(64, 64) * 0.1, "fc2": _t(64, 64) * 0.1, "fc3": _t(64, 10) * 0.1}
    opt = fs.optim.sgd(0.5)

    def train_step(params, state, x, y):
        loss, grads = fs.value_and_grad(_seed_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return fs.optim.apply_updates(params, updates), state, loss

    s0 = fs.Symbol(divisor=8)
    dynamic = fs.jit(train_step, in_shapes=(None, None, fs.ArrayType((s0, 1, 8, 8), F32),
                                            fs.ArrayType((s0,), ms.int32)))
    static = fs.jit(train_step)
    p_dyn = p_static = init
    s_dyn = s_static = opt.init(init)
    start, losses, seen = 0, [], {}
    for step in range(30):
        b = int(rng.choice([8, 16, 24, 32, 48]))  # a new batch size every step
        seen[b] = seen.get(b, 0) + 1
        x, y = Tensor(images[start:start + b]), Tensor(labels[start:start + b])
        start += b
        p_dyn, s_dyn, l_dyn = dynamic(p_dyn, s_dyn, x, y)
        p_static, s_static, l_static = static(p_static, s_static, x, y)
        np.testing.assert_allclose(l_dyn.asnumpy(), l_static.asnumpy(), rtol=1e-5)
        losses.append(float(l_dyn.asnumpy()))
    _close(p_dyn, p_static)
    # one compile for every size, and a static copy for each size called HOT_CALLS times
    hot = sum(n >= HOT_CALLS for n in seen.values())
    assert (dynamic.trace_count, dynamic.compile_count) == (1, 1 + hot)
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses  # it learns


def _dynamic_checks():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "distributed" / "dynamic_checks.py"
    spec = importlib.util.spec_from_file_location("dynamic_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.full  # slow: the full matrix (the quick run covers the feature elsewhere)
def test_the_seeds_network_sharded_on_8_devices_trains_on_varying_batches_compiled_once():
    """The seed's split counts (MatMul ((2, 4), (4, 1)), MatMul ((1, 8), (8, 1))) on a
    virtual mesh of 8, a Symbol(divisor=8) batch of a new size every step: every loss
    equals the unsharded static-shape step's (the same run in 2- and 4-process jobs:
    tests/distributed/test_dynamic_multiprocess.py)."""
    checks = _dynamic_checks()
    got, want, sharded = checks.train_seed(8, mesh=8)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert (sharded.trace_count, sharded.compile_count) == (1, 1)
    assert np.mean(got[-3:]) < 0.9 * np.mean(got[:3]), got  # it learns


def test_an_autoparallel_step_with_declared_batch_shapes_compiles_once():
    checks = _dynamic_checks()
    got, want, step = checks.autoparallel_seed(8, mesh=8)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert (step.trace_count, step.compile_count) == (1, 1)
    ap = fs.AutoParallel(checks.seed_loss, fs.optim.sgd(0.1), mesh=8).set_inputs(
        fs.ArrayType((fs.Symbol(divisor=4), 1, 8, 8), F32), None)
    x = Tensor(np.zeros((8, 1, 8, 8), np.float32))
    with pytest.raises(fs.ShardingError, match=r"dataset_strategy\('data_parallel'\) splits "
                                               r"every batch input along dimension 0 over "
                                               r"the 8 devices, but a batch input is "
                                               r"f32\[s\d+,1,8,8\]"):
        ap(ap.init({k: Tensor(v) for k, v in checks.init_params().items()}), x,
           Tensor(np.zeros(8, np.int32)))
