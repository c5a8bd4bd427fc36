"""Hostile inputs: every misuse is an fshard error that names what was wrong (never a
raw Python or MindSpore error, never silently accepted). One case per line; the
messages themselves are in docs/errors.md."""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

import fshard as fs

X = np.ones((3,), np.float32)


def _bad_custom_jvp():
    f = fs.custom_jvp(lambda a: a * a)
    f.defjvp(lambda p, t: (p[0] * p[0], t[0] * t[0]))  # not linear in the tangents
    return fs.grad(lambda a: f(a).sum())(ms.Tensor(X))


CASES = {
    # transform arguments, checked when the transform is applied
    "jit(None)": (lambda: fs.jit(None), fs.ArgumentError, "fs.jit expects a function"),
    "jit(3)": (lambda: fs.jit(3), fs.ArgumentError, "got int 3"),
    "make_ir(None)": (lambda: fs.make_ir(None), fs.ArgumentError, "fs.make_ir expects"),
    "grad(None)": (lambda: fs.grad(None), fs.ArgumentError, "fs.grad expects"),
    "value_and_grad(None)": (lambda: fs.value_and_grad(None), fs.ArgumentError, "expects"),
    "jvp(None)": (lambda: fs.jvp(None, (X,), (X,)), fs.ArgumentError, "fs.jvp expects"),
    "vjp(None)": (lambda: fs.vjp(None, X), fs.ArgumentError, "fs.vjp expects"),
    "jacrev(None)": (lambda: fs.jacrev(None), fs.ArgumentError, "fs.jacrev expects"),
    "jacfwd(None)": (lambda: fs.jacfwd(None), fs.ArgumentError, "fs.jacfwd expects"),
    "hessian(None)": (lambda: fs.hessian(None), fs.ArgumentError, "fs.hessian expects"),
    "static_argnums='n'": (lambda: fs.jit(lambda a: a, static_argnums="n"), fs.ArgumentError,
                           "static_argnums"),
    "static_argnames=5": (lambda: fs.jit(lambda a: a, static_argnames=5), fs.ArgumentError,
                          "static_argnames"),
    "static_argnames naming nothing": (lambda: fs.jit(lambda a: a, static_argnames="b"),
                                       fs.ArgumentError, "no parameter named 'b'"),
    "vmap(axis_size=-1)": (lambda: fs.vmap(lambda a: a, in_axes=None, axis_size=-1),
                           fs.BatchingError, "axis_size"),
    "vmap(axis_size='3')": (lambda: fs.vmap(lambda a: a, in_axes=None, axis_size="3"),
                            fs.BatchingError, "axis_size"),
    "defvjp(3, 4)": (lambda: fs.custom_vjp(lambda a: a).defvjp(3, 4),
                     fs.DifferentiationError, "must be a function"),
    "custom_vjp(5)": (lambda: fs.custom_vjp(5), fs.DifferentiationError, "decorates a function"),
    "nondiff_argnums=(5,)": (lambda: fs.custom_jvp(lambda a: a, nondiff_argnums=(5,)),
                             fs.DifferentiationError, "out of range"),
    "Python int 2**70": (lambda: fs.jit(lambda a, b: a * b)(X, 2**70), fs.ArgumentError,
                         "does not fit in int64"),
    "shard(search='yes')": (lambda: fs.shard(lambda a: a, ((1,),), mesh=2, search="yes"),
                            fs.ShardingError, "search must be True"),
    "shard(level=1.0)": (lambda: fs.shard(lambda a: a, ((1,),), mesh=2, level=1.0),
                         fs.ShardingError, "level must be"),
    # differentiation
    "vjp cotangent of another dtype": (
        lambda: fs.vjp(lambda a: a * 2, ms.Tensor(X))[1](ms.Tensor(np.ones(3))),
        fs.DifferentiationError, "cotangent must have its output's shape and dtype"),
    "custom_jvp rule not linear": (_bad_custom_jvp, fs.DifferentiationError,
                                   "make the JVP rule linear"),
    # fs.ops called eagerly with bad values
    "cast(x, None)": (lambda: fs.ops.cast(X, None), fs.ArgumentError, "dtype is None"),
    "sum(axis=(1, 1))": (lambda: fs.ops.reduce_sum(np.ones((2, 3)), (1, 1)), fs.ArgumentError,
                         "more than once"),
    "reshape(x, 'a')": (lambda: fs.ops.reshape(X, "a"), fs.ArgumentError, "tuple of ints"),
    "reshape(x, (1.5, 2))": (lambda: fs.ops.reshape(X, (1.5, 2)), fs.ArgumentError,
                             "is a float"),
    "full((-1, 2))": (lambda: fs.ops.full((-1, 2), 0.0), fs.ShapeError, "negative"),
    "bool matmul": (lambda: fs.ops.matmul(np.ones((2, 2), bool), np.ones((2, 2), bool)),
                    fs.ProgramTypeError, "bool operands"),
    "gather index out of range": (lambda: fs.ops.gather(X, np.array([5]), 0), fs.ArgumentError,
                                  r"outside \[0, 3\)"),
    "scatter_add index out of range": (
        lambda: fs.ops.scatter_add(np.ones(2, np.float32), np.array([0, 7]), (3,)),
        fs.ArgumentError, r"outside \[0, 3\)"),
    "Symbol(max=1, min=5)": (lambda: fs.Symbol(max=1, min=5), fs.ArgumentError, "max is below"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_misuse_is_an_fshard_error(name):
    call, error, match = CASES[name]
    with pytest.raises(error, match=match):
        call()


def test_numpy_arguments_that_are_not_differentiated_are_converted():
    w = ms.Tensor(np.full(3, 2.0, np.float32))
    g = fs.grad(lambda w, x: (ops.exp(x) * w).sum())(w, X)
    np.testing.assert_allclose(g.asnumpy(), np.exp(X), rtol=1e-6)
    net = nn.SequentialCell([nn.Dense(3, 1)])
    grads = fs.grad(lambda x: net(x).sum())(np.ones((2, 3), np.float32))
    assert grads.shape == (2, 3)


# -- strategy files ----------------------------------------------------------------------


@pytest.fixture
def sharded():
    return fs.shard(lambda a: a * 2, in_strategy=((2,),), mesh=2)


@pytest.mark.parametrize("content, match", [
    (b"{", "not valid JSON"), (b"", "not valid JSON"), (b"[1, 2]", "holds a JSON list"),
    (b"null", "holds a JSON NoneType"), (b"\x00\xff\xfe", "not text"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply|not valid JSON"),
    (b'{"device_num": 2, "inputs": [], "equations": [{"primitive": "mul"}]}',
     "no 'assignment' list"),
    (b'{"device_num": 2, "inputs": [{"layout": [["x9"]]}], "equations": []}',
     "mesh axis names"),
])
def test_bad_strategy_files_are_refused_naming_the_file(tmp_path, sharded, content, match):
    path = tmp_path / "s.json"
    path.write_bytes(content)
    with pytest.raises(fs.ShardingError, match=match) as e:
        sharded.load_strategies(path)
    assert str(path) in str(e.value)


def test_missing_or_directory_strategy_files(tmp_path, sharded):
    with pytest.raises(fs.ShardingError, match="no such file"):
        sharded.load_strategies(tmp_path / "nope.json")
    with pytest.raises(fs.ShardingError, match="is a directory"):
        sharded.load_strategies(tmp_path)
    with pytest.raises(fs.ShardingError, match="does not exist"):
        sharded.save_strategies(tmp_path / "no" / "s.json", np.ones(4, np.float32))


def test_a_strategy_file_for_another_mesh_is_refused_when_used(tmp_path, sharded):
    path = tmp_path / "s.json"
    sharded.save_strategies(path, np.ones(4, np.float32))
    data = json.loads(path.read_text())
    data["inputs"][0]["layout"] = [["m7"]]
    path.write_text(json.dumps(data))
    with pytest.raises(fs.ShardingError, match="prime axes"):
        sharded.load_strategies(path)(np.ones(4, np.float32))


def test_save_strategies_is_atomic(tmp_path, sharded, monkeypatch):
    path = tmp_path / "s.json"
    sharded.save_strategies(path, np.ones(4, np.float32))
    before = path.read_text()

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", full_disk)
    with pytest.raises(fs.ShardingError, match="No space left on device.*unchanged"):
        sharded.save_strategies(path, np.ones(4, np.float32))
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temporary file left


# -- methods of traced values --------------------------------------------------------------

TRACED = np.arange(6, dtype=np.float32).reshape(2, 3)


@pytest.mark.parametrize("call, error, match", [
    (lambda a: a.prod(), fs.UnsupportedOpError, "Tensor method 'prod'"),
    (lambda a: a.cumsum(0), fs.UnsupportedOpError, "Tensor method 'cumsum'"),
    (lambda a: a.__setitem__(0, 1.0), fs.TracerConversionError, "updated in place"),
    (lambda a: a.fill_(1.0), fs.TracerConversionError, "updated in place"),
    (lambda a: a.tolist(), fs.TracerConversionError, "tolist"),
    (lambda a: a.norm(ord=1), fs.UnsupportedOpError, "norm"),
])
def test_traced_value_methods_fshard_lacks_are_fshard_errors(call, error, match):
    with pytest.raises(error, match=match):
        fs.jit(call)(TRACED)


def test_numpy_reductions_of_a_traced_value_trace():
    assert float(fs.jit(lambda a: np.sum(a))(TRACED).asnumpy()) == 15.0
    assert float(fs.jit(lambda a: np.mean(a))(TRACED).asnumpy()) == 2.5


@pytest.mark.parametrize("op", ["//", "%"])
def test_operators_without_a_primitive_are_fshard_errors(op):
    f = eval(f"lambda a: a {op} a")  # noqa: S307  (a fixed operator from the list above)
    with pytest.raises(fs.UnsupportedOpError, match=f"the operator {__import__('re').escape(op)}"):
        fs.jit(f)(np.arange(4, dtype=np.int32) + 1)
    with pytest.raises(fs.UnsupportedOpError, match="the operator ~"):
        fs.jit(lambda a: ~a)(np.arange(4, dtype=np.int32))


@pytest.mark.parametrize("op", ["&", "|", "^", "<<", ">>"])
def test_bitwise_operators_trace(op):
    f = eval(f"lambda a, b: a {op} b")  # noqa: S307  (a fixed operator from the list above)
    a = np.array([5, 12, 2**31 - 1], np.uint32)
    b = np.array([3, 1, 7], np.uint32)
    np.testing.assert_array_equal(fs.jit(f)(a, b).asnumpy(), f(a, b))


@pytest.mark.parametrize("make", [
    lambda: fs.jit(lambda a: a * 2)(ms.Tensor(X).astype(ms.bfloat16)),
    lambda: fs.jit(lambda a: a.astype(ms.bfloat16))(X),
    lambda: fs.jit(lambda a: a.astype(ms.complex64))(X),
    lambda: fs.grad(lambda a: a.astype(ms.float32).sum())(ms.Tensor(X).astype(ms.bfloat16)),
])
def test_unsupported_dtypes_are_argument_errors_listing_the_supported_ones(make):
    with pytest.raises(fs.ArgumentError, match=r"not supported by fshard; use one of Bool, "
                                                r"Float16, Float32"):
        make()


def test_a_primitive_shard_strategy_is_not_dropped_silently():
    from mindspore import Parameter, Tensor, nn, ops

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.ones((8, 4), np.float32)))
            self.matmul = ops.MatMul().shard(((2, 4), (4, 1)))

        def construct(self, x):
            return self.matmul(x, self.w)

    x = np.ones((8, 8), np.float32)
    with pytest.warns(fs.OperatorStrategyWarning,
                      match=r"(?s)does not apply the strategy of MatMul.shard\(\(\(2, 4\), "
                            r"\(4, 1\)\)\).*Fix: give the layouts"):
        out = fs.shard(Net(), in_strategy=((8, 1),), mesh=8)(x)
    assert out.asnumpy().tolist() == [[8.0] * 4] * 8
