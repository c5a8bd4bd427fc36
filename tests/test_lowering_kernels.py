"""What MindSpore's graph compiler is given: the generated module calls Primitive
instances built once at lowering time, never Python that builds one or that the
compiler must interpret at each call site (``ops.split``'s loop, ``ops.pad``'s checks,
``ops.zeros``), and the numbers are those of the eager kernels, bit for bit."""

import inspect
import re
import types

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops
from mindspore.ops import Primitive

import fshard as fs
from fshard.primitives import conv, nn, structural

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 9, 9)).astype(np.float32)
W = (RNG.standard_normal((3, 3, 3, 3)) * 0.3).astype(np.float32)
SCALE = (1.0 + 0.1 * RNG.standard_normal(3)).astype(np.float32)
BIAS = (0.1 * RNG.standard_normal(3)).astype(np.float32)
DENSE = (RNG.standard_normal((27, 5)) * 0.1).astype(np.float32)
LABELS = np.array([1, 4], np.int32)

#: Python that MindSpore's compiler interprets at every call site of the generated code
#: (measured 15 ms to 2.4 s each) or that builds a Primitive there.
_INTERPRETED = re.compile(r"ops\.(split|pad|zeros|ones|arange|softmax)\(|"
                          r"ops\.[A-Z]\w*\(|\b(Conv2DBackpropFilter|_BatchNormGrad)\(")


def _loss(params, x, labels):
    w, scale, bias, dense = params
    h = conv.conv2d_p.bind(x, w, stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1),
                           groups=1)
    h, _, _ = nn.batch_norm_train_p.bind(h, scale, bias, eps=1e-5)
    h = ops.relu(h)
    # a second convolution of the same parameters: the same kernel instance
    h = conv.conv2d_p.bind(h, w, stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1),
                           groups=1)
    h = ops.max_pool2d(h, 3, 2, 1)                      # padded: -inf fill
    h = ops.avg_pool2d(structural.pad(h, (0, 0, 1, 0), (0, 0, 0, 1)), 2, 2)
    logits = ops.matmul(ops.reshape(h, (2, -1)), dense)
    onehot = structural.one_hot(labels, 5, logits.dtype)
    return -(onehot * ops.log(ops.softmax(logits, -1))).sum(1).mean()


@pytest.fixture(scope="module")
def step():
    opt = fs.optim.sgd(0.1, momentum=0.9)  # a multi-tensor update: concat, then split

    def run(params, state, x, labels):
        loss, grads = fs.value_and_grad(_loss)(params, x, labels)
        updates, state = opt.update(grads, state, params)
        return fs.optim.apply_updates(params, updates), state, loss

    params = (W, SCALE, BIAS, DENSE)
    return fs.jit(run), params, opt.init(params)


@pytest.fixture(scope="module")
def lowered(step):
    f, params, state = step
    return f.lower(params, state, X, LABELS)


def test_the_generated_module_builds_no_primitive_and_calls_no_interpreted_op(lowered):
    functions = {k: v for k, v in lowered.globals.items() if isinstance(v, types.FunctionType)}
    for name, fn in functions.items():
        src = inspect.getsource(fn)
        assert not _INTERPRETED.search(src), (name, src)
    assert not _INTERPRETED.search(lowered.source)
    # the program has every kind of equation above, and calls few Python functions
    prims = {type(v).__name__ for v in lowered.globals.values() if isinstance(v, Primitive)}
    assert {"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "BatchNorm",
            "BatchNormGrad", "MaxPoolWithArgmaxV2", "AvgPool", "PadV3", "MatMul",
            "ReduceSum"} <= prims, prims
    assert len(functions) <= 30, sorted(functions)


def test_a_kernel_is_built_once_per_distinct_attributes(lowered):
    convs = [k for k, v in lowered.globals.items()
             if isinstance(v, Primitive) and type(v).__name__ == "Conv2D"]
    assert len(convs) == 1, convs  # both convolutions have the same attributes
    assert lowered.source.count(f"{convs[0]}(") == 2
    splits = [k for k, v in lowered.globals.items() if type(v).__name__ == "SplitWithSize"]
    assert len(splits) <= 1, splits


def test_the_step_gives_the_eager_numbers(step):
    f, params, state = step
    got = f(params, state, X, LABELS)
    with fs.disable_jit():
        want = f(params, state, X, LABELS)
    for g, w in zip(fs.tree.leaves(got), fs.tree.leaves(want)):
        g, w = np.asarray(g.asnumpy()), np.asarray(w.asnumpy() if hasattr(w, "asnumpy") else w)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(w).max()))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.bool_])
def test_split_and_pad_lowered_equal_the_eager_ops(dtype):
    x = (np.arange(24).reshape(4, 6) % 5).astype(dtype)

    def f(a):
        # an empty piece off axis 0 takes ops.split (SplitWithSize fails on it compiled)
        # one padded dimension (low, high or both) is concatenated zeros for floats
        return (structural.split(a, [2, 4], 1) + structural.split(a, [2, 0, 4], 1)
                + (structural.pad(a, (1, 0), (2, 1)), structural.pad(a, (0, 2), (0, 1)),
                   structural.pad(a, (3, 0), (0, 0)), structural.pad(a, (0, 0), (0, 2))))

    got, want = fs.jit(f)(x), f(Tensor(x))
    assert [p.shape for p in got] == [(4, 2), (4, 4), (4, 2), (4, 0), (4, 4), (7, 7),
                                      (4, 9), (7, 6), (4, 8)]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())


def test_one_hot_and_middle_axis_sum_lowered_equal_the_eager_ops():
    idx = np.array([[0, 3], [2, 2]], np.int64)
    x = RNG.standard_normal((3, 4, 5)).astype(np.float32)

    def f(i, a):
        return structural.one_hot(i, 4, fs.float32 if hasattr(fs, "float32") else
                                  Tensor(x).dtype), fs.ops.reduce_sum(a, (1,))

    got = fs.jit(f)(idx, x)
    with fs.disable_jit():
        want = fs.jit(f)(idx, x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.asnumpy(), np.asarray(w.asnumpy()))


def test_splits_into_different_numbers_of_pieces_compile_in_one_program():
    # through ops.split both went through one wrapper, and MindSpore's compiler refused
    # the second ("The elements size should be equal")
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    got = fs.jit(lambda a: structural.split(a, [2, 4], 1) + structural.split(a, [1, 2, 3], 1))(x)
    want = np.split(x, [2], 1) + np.split(x, [1, 3], 1)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.asnumpy(), w)


@pytest.mark.parametrize("index", [
    (slice(1, 3), slice(None)),            # unit strides: a Slice kernel
    (slice(None), slice(2, 7)),
    (slice(0, 4, 2), slice(1, 8, 3)),      # strided: StridedSlice
    (slice(2, 2), slice(None)),            # an empty piece: StridedSlice
])
def test_a_static_slice_lowers_to_slice_where_it_can_and_gives_the_eager_numbers(index):
    # On CPU a StridedSlice kernel stalls 2-4 ms a call in spells in some graphs, where
    # Slice does not (docs/performance.md): unit-stride, non-empty slices use Slice.
    from fshard.backend import mindspore as backend
    from fshard.core import dtypes
    from fshard.core.staging import stage
    from fshard.core.tracing import ArrayType

    x = RNG.standard_normal((5, 9)).astype(np.float32)
    start = tuple(s.start or 0 for s in index)
    limit = tuple(x.shape[i] if s.stop is None else s.stop for i, s in enumerate(index))
    strides = tuple(s.step or 1 for s in index)

    def fn(v):
        return [structural.slice_array(ops.mul(v, 2.0), start, limit, strides)]

    program, consts = stage(fn, [ArrayType(x.shape, dtypes.float32)])
    src, globals_, _ = backend.lower_program(program, consts, "sliced")
    unit = strides == (1, 1) and all(hi > lo for lo, hi in zip(start, limit))
    assert bool(re.search(r"ms_slice_\d+\(", src)) == unit, src
    assert bool(re.search(r"ms_strided_slice_\d+\(", src)) == (not unit), src
    out = backend.compile_source(src, globals_, "sliced")(Tensor(x))
    out = out[0] if isinstance(out, (tuple, list)) else out
    np.testing.assert_array_equal(out.asnumpy(), (2.0 * x)[index])
    # eagerly on the same kernel, bfloat16 included where it is a Slice
    eager = structural.slice_array(Tensor(2.0 * x), start, limit, strides)
    np.testing.assert_array_equal(eager.asnumpy(), (2.0 * x)[index])
    if unit:
        rounded = Tensor(2.0 * x).astype(ms.bfloat16)
        half = structural.slice_array(rounded, start, limit, strides)
        np.testing.assert_array_equal(half.astype(ms.float32).asnumpy(),
                                      rounded.astype(ms.float32).asnumpy()[index])


@pytest.mark.parametrize("rows, swapped", [(8, False), (16, True), (48, True), (64, False)])
def test_a_few_rows_times_a_transposed_weight_lower_as_the_transposed_product(rows, swapped):
    """MindSpore's CPU MatMul runs ``x @ W^T`` 1-7x slower with transpose_b at 16 to 48
    rows than ``(W @ x^T)^T``: those rows lower as the latter (a Dense layer's forward,
    ``g @ W^T`` in a backward pass); the numbers stay the product's, within float32
    rounding of a 512-term sum."""
    x = RNG.standard_normal((rows, 512)).astype(np.float32)
    w = RNG.standard_normal((256, 512)).astype(np.float32)
    dense = ops.MatMul(transpose_b=True)

    def f(x, w):
        return dense(x, w)

    src = fs.jit(f).lower(x, w).as_text()
    assert ("Transpose" in src) == swapped, src
    got = fs.jit(f)(x, w).asnumpy()
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    # a backward pass's g @ W^T: the input gradient of x @ v
    v = np.ascontiguousarray(w.T)

    def loss(x, v):
        return (ops.matmul(x, v) ** 2).sum()

    grad = fs.jit(fs.grad(loss))
    assert ("Transpose" in grad.lower(x, v).as_text()) == swapped
    want_g = 2 * (x.astype(np.float64) @ v) @ v.T.astype(np.float64)
    np.testing.assert_allclose(grad(x, v).asnumpy(), want_g, rtol=1e-4,
                               atol=1e-5 * np.abs(want_g).max())
