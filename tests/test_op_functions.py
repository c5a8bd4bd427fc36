"""The op functions of ``fs.ops``: what they add on top of the primitives.

Primitives take operands of one shape and dtype; op functions promote dtypes the way
MindSpore does and broadcast the way NumPy does, accept Python scalars, and reject
bad shapes with an fshard error that names the operands and a fix. The structural
op functions (concat, stack, split, slice_array, pad, gather, scatter_add, one_hot,
getitem) are checked against NumPy, eagerly and under ``fs.jit``, and their errors
here.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

import fshard as fs
from fshard.errors import ArgumentError, ShapeError

RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return np.asarray(RNG.uniform(0.5, 2.0, shape), dtype)


def to_np(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


# ---------------------------------------------------------------------------
# Broadcasting
# ---------------------------------------------------------------------------

BROADCAST_PAIRS = [((3, 2), (1, 2)), ((4, 1, 3), (2, 1)), ((), (2, 3)), ((2, 3), ()),
                   ((1,), (5,)), ((2, 1), (1, 3)), ((3, 1, 1), (1, 4, 2))]
BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "pow": np.power, "maximum": np.maximum, "minimum": np.minimum,
          "less": np.less, "greater_equal": np.greater_equal, "equal": np.equal}


@pytest.mark.parametrize("xs,ys", BROADCAST_PAIRS, ids=[f"{a}&{b}" for a, b in BROADCAST_PAIRS])
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_op_functions_broadcast_like_numpy(name, xs, ys):
    x, y = rand(*xs), rand(*ys)
    out = getattr(fs.ops, name)(x, y)
    want = BINARY[name](x, y)
    assert tuple(out.shape) == want.shape
    np.testing.assert_allclose(to_np(out), want, rtol=1e-6)


@pytest.mark.parametrize("xs,ys", BROADCAST_PAIRS[:3],
                         ids=[f"{a}&{b}" for a, b in BROADCAST_PAIRS[:3]])
def test_broadcasting_shows_in_the_ir_and_compiles(xs, ys):
    x, y = rand(*xs), rand(*ys)
    program = fs.make_ir(fs.ops.mul)(x, y).program
    assert "broadcast_to" in str(program)  # the primitive itself never broadcasts
    np.testing.assert_allclose(to_np(fs.jit(fs.ops.mul)(x, y)), x * y, rtol=1e-6)


def test_where_broadcasts_all_three_operands():
    c = np.array([True, False, True])
    out = fs.ops.where(c.reshape(3, 1), rand(1, 4), 0.0)
    assert tuple(out.shape) == (3, 4)
    np.testing.assert_array_equal(to_np(out)[1], np.zeros(4, np.float32))


# ---------------------------------------------------------------------------
# Promotion (MindSpore's rules: int + float -> the float; Python scalars are weak)
# ---------------------------------------------------------------------------

T = {"bool": np.array([True, False]), "i8": np.array([1, 2], np.int8),
     "u8": np.array([1, 2], np.uint8), "i32": np.array([1, 2], np.int32),
     "i64": np.array([1, 2], np.int64), "f16": np.array([1, 2], np.float16),
     "f32": np.array([1, 2], np.float32), "f64": np.array([1, 2], np.float64)}

PROMOTIONS = [
    # tensor with tensor
    ("i32", "f32", ms.float32), ("i64", "f16", ms.float16), ("i32", "i64", ms.int64),
    ("u8", "i8", ms.int16), ("bool", "i32", ms.int32), ("f16", "f32", ms.float32),
    ("f32", "f64", ms.float64),
    # tensor with Python scalar: the scalar adopts the tensor's dtype within its kind
    ("i32", 2, ms.int32), ("i32", 2.5, ms.float32), ("f16", 2, ms.float16),
    ("f16", 2.0, ms.float16), ("f32", 3, ms.float32), ("bool", 1, ms.int64),
    ("bool", 1.5, ms.float32), ("i64", True, ms.int64),
    # Python scalars alone
    (2, 3, ms.int64), (2, 3.0, ms.float32), (True, 1, ms.int64),
]


def _operand(v):
    return T[v] if isinstance(v, str) else v


@pytest.mark.parametrize("a,b,dtype", PROMOTIONS, ids=[f"{a}+{b}" for a, b, _ in PROMOTIONS])
def test_add_promotes_like_mindspore(a, b, dtype):
    out = fs.ops.add(_operand(a), _operand(b))
    assert out.dtype == dtype
    np.testing.assert_allclose(to_np(out).astype(np.float64),
                               np.add(_operand(a), _operand(b)).astype(np.float64))
    if isinstance(a, str):  # MindSpore's own answer, where MindSpore accepts the operands
        ms_b = ms.Tensor(T[b]) if isinstance(b, str) else b
        assert ms.ops.add(ms.Tensor(T[a]), ms_b).dtype == dtype


def test_promotion_is_symmetric_and_traced_the_same():
    x = T["i32"]
    assert fs.ops.mul(2.5, x).dtype == fs.ops.mul(x, 2.5).dtype == ms.float32
    out = fs.jit(lambda v: v * 2.5 + 1)(x)
    assert out.dtype == ms.float32
    np.testing.assert_allclose(to_np(out), x * 2.5 + 1)


def test_integer_division_is_true_division_in_float32():
    out = fs.ops.div(np.array([1, 3], np.int32), np.array([2, 2], np.int32))
    assert out.dtype == ms.float32
    np.testing.assert_allclose(to_np(out), [0.5, 1.5])


def test_math_functions_compute_integers_in_float32():
    out = fs.ops.exp(np.array([0, 1], np.int32))
    assert out.dtype == ms.float32
    np.testing.assert_allclose(to_np(out), np.exp([0.0, 1.0]), rtol=1e-6)


def test_concat_promotes_its_operands():
    out = fs.ops.concat([T["i32"], T["f16"]])
    assert out.dtype == ms.float16
    np.testing.assert_array_equal(to_np(out), [1, 2, 1, 2])


# ---------------------------------------------------------------------------
# Error messages of bad shapes
# ---------------------------------------------------------------------------


def test_incompatible_broadcast_names_both_shapes_and_a_fix():
    with pytest.raises(ShapeError, match=r"\(3, 2\) and \(4, 2\) cannot be broadcast") as e:
        fs.ops.add(rand(3, 2), rand(4, 2))
    assert "Fix:" in str(e.value) and "docs/errors.md" in str(e.value)


def test_bool_addition_is_an_fshard_error_not_a_mindspore_one():
    with pytest.raises(fs.ProgramTypeError, match=r"(?s)add of bool operands.*Fix: use ops.logical_or.*cast"):
        fs.ops.add(T["bool"], T["bool"])


def test_matmul_contraction_mismatch_names_operands():
    with pytest.raises(ShapeError, match=r"contraction sizes differ.*f32\[2,3\].*f32\[4,5\]"):
        fs.ops.matmul(rand(2, 3), rand(4, 5))


def test_reshape_size_mismatch():
    with pytest.raises(ShapeError, match=r"cannot reshape f32\[2,3\] to \(4,\)"):
        fs.ops.reshape(rand(2, 3), (4,))


@pytest.mark.parametrize("call,error,pattern", [
    (lambda: fs.ops.concat([rand(2, 3), rand(3, 3)], 1), ShapeError,
     r"operand 1 has shape \(3, 3\) but operand 0 has shape \(2, 3\); all dimensions "
     r"except axis 1 must be equal"),
    (lambda: fs.ops.concat([rand(2), np.float32(1)]), ShapeError,
     r"(?s)operand 1 is a scalar.*Fix: use fs.ops.stack"),
    (lambda: fs.ops.concat([]), ArgumentError, r"non-empty list or tuple"),
    (lambda: fs.ops.stack([rand(2), rand(3)]), ShapeError, r"operand 1 has shape \(3,\)"),
    (lambda: fs.ops.split(rand(5, 2), (2, 2)), ShapeError,
     r"sizes must be >= 0 and sum to 5, the size of dimension 0"),
    (lambda: fs.ops.split(rand(5), 0), ArgumentError, r"piece size must be >= 1"),
    (lambda: fs.ops.split(rand(5), 2, axis=1), ArgumentError, r"axis=...\)=1 is out of range"),
    (lambda: fs.ops.slice_array(rand(4, 3), (0, 0), (5, 3)), ShapeError,
     r"dimension 0 of x f32\[4,3\] has size 4, but got start=0, limit=5"),
    (lambda: fs.ops.slice_array(rand(4), (0, 0), (1, 1)), ArgumentError,
     r"one entry per dimension"),
    (lambda: fs.ops.pad(rand(3), (-1,), (0,)), ArgumentError, r"widths must be >= 0"),
    (lambda: fs.ops.gather(rand(3), np.array([0.5])), ArgumentError,
     r"indices=...\) must be an integer array, got f64\[1\]"),
    (lambda: fs.ops.gather(rand(3), np.array([True])), ArgumentError, r"boolean array"),
    (lambda: fs.ops.gather(np.float32(1), np.array([0])), ShapeError, r"x is a scalar"),
    (lambda: fs.ops.scatter_add(rand(2, 3), np.array([0, 1]), (4, 2)), ShapeError,
     r"updates has shape \(2, 3\), but indices of shape \(2,\) need updates of shape "
     r"\(2, 2\)"),
    (lambda: fs.ops.one_hot(np.array([1]), 0), ArgumentError, r"depth=...\) must be a "
     r"Python int >= 1"),
    (lambda: fs.ops.getitem(rand(2, 3), (0, 0, 0)), ArgumentError, r"too many indices"),
    (lambda: fs.ops.getitem(rand(2, 3), (5,)), ArgumentError,
     r"index 5 is out of bounds for dimension 0 of f32\[2,3\]"),
    (lambda: fs.ops.getitem(rand(2, 3), ([0], [5])), ArgumentError,
     r"index 5 is out of bounds for dimension 1 of f32\[2,3\]"),
    (lambda: fs.ops.getitem(rand(2, 3), np.array([[True, False, True]] * 2)), ArgumentError,
     r"boolean masks select a data-dependent number"),
    (lambda: fs.ops.getitem(rand(2, 3), [0, 2]), ArgumentError,
     r"index 2 is out of bounds for dimension 0"),
], ids=["concat-shapes", "concat-scalar", "concat-empty", "stack-shapes", "split-sizes",
        "split-zero", "split-axis", "slice-bounds", "slice-rank", "pad-negative",
        "gather-float", "gather-bool", "gather-scalar", "scatter-shape", "one_hot-depth",
        "getitem-rank", "getitem-int", "getitem-two-arrays", "getitem-mask",
        "getitem-array-bounds"])
def test_structural_errors_name_the_argument(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_traced_sizes_are_rejected_with_the_reason():
    with pytest.raises(ArgumentError, match=r"static Python ints, got a traced value"):
        fs.jit(lambda x: fs.ops.slice_array(x, (x.sum(),), (2,)))(rand(3))


# ---------------------------------------------------------------------------
# Structural op functions against NumPy, eager and jitted
# ---------------------------------------------------------------------------

X = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
INDEXES = [
    1, -1, (slice(None), 2), (Ellipsis, 0), (None, 1), (slice(1, None, 2),),
    (slice(None, None, -1),), (slice(3, 0, -2), None, slice(None, None, 3)),
    ([2, 0, 2],), (slice(None), [[1], [3]]), (0, [3, -1]), (Ellipsis, [0, 1]),
    (slice(None), [1, 2], 0), (1, slice(None), [1, 2]), ([0, 1], None, 0),
    (0, None, [1, 2]), (None, [1], 2), (np.array(2),), (slice(5, 1),),
    (Ellipsis,), (),
]


def _id(idx) -> str:
    return repr(idx).replace("slice(None, None, None)", ":").replace(" ", "")


@pytest.mark.parametrize("idx", INDEXES, ids=[_id(i) for i in INDEXES])
def test_getitem_matches_numpy(idx):
    want = X[idx]
    out = fs.ops.getitem(X, idx)
    assert tuple(out.shape) == want.shape
    np.testing.assert_array_equal(to_np(out), want)


@pytest.mark.parametrize("idx", INDEXES[::4], ids=[_id(i) for i in INDEXES[::4]])
def test_getitem_on_tracers_compiles_and_differentiates(idx):
    x = X.astype(np.float64)
    np.testing.assert_array_equal(to_np(fs.jit(lambda v: v[idx])(x)), x[idx])
    # d/dx sum(x[idx]) counts how often each element is selected.
    want = np.zeros_like(x)
    np.add.at(want, idx, 1.0)
    np.testing.assert_array_equal(to_np(fs.grad(lambda v: v[idx].sum())(x)), want)


def test_getitem_with_a_traced_index_array_wraps_negative_indices():
    ids = np.array([[0, -1], [-3, 2]], np.int32)
    out = fs.jit(lambda x, i: x[:, i])(X, ids)
    np.testing.assert_array_equal(to_np(out), X[:, ids])


def test_embedding_lookup_and_its_gradient():
    table, ids = rand(5, 3).astype(np.float64), np.array([[4, 0], [4, 4]], np.int32)
    np.testing.assert_array_equal(to_np(fs.ops.gather(table, ids)), table[ids])
    g = fs.grad(lambda t: (fs.ops.gather(t, ids) ** 2).sum())(table)
    want = np.zeros_like(table)
    np.add.at(want, ids, 2 * table[ids])
    np.testing.assert_allclose(to_np(g), want)


def test_per_example_embedding_gradients_under_vmap():
    table, ids = rand(5, 3).astype(np.float64), np.array([[4, 0], [1, 1], [2, 4]], np.int32)
    per_example = fs.vmap(fs.grad(lambda t, i: fs.ops.gather(t, i).sum()), in_axes=(None, 0))
    out = to_np(per_example(table, ids))
    for b in range(3):
        want = np.zeros_like(table)
        np.add.at(want, ids[b], 1.0)
        np.testing.assert_array_equal(out[b], want)


def test_concat_stack_split_round_trip():
    a, b = rand(2, 3), rand(2, 1)
    joined = fs.ops.concat([a, b], axis=-1)
    np.testing.assert_array_equal(to_np(joined), np.concatenate([a, b], -1))
    pieces = fs.ops.split(joined, (3, 1), axis=1)
    np.testing.assert_array_equal(to_np(pieces[1]), b)
    np.testing.assert_array_equal(to_np(fs.ops.stack([a, a], axis=-1)), np.stack([a, a], -1))
    chunks = fs.ops.split(rand(7), 3)
    assert [tuple(c.shape) for c in chunks] == [(3,), (3,), (1,)]


def test_split_pieces_of_a_traced_value():
    x = rand(6, 2)
    out = fs.jit(lambda v: [p.sum() for p in fs.ops.split(v, (1, 5))])(x)
    np.testing.assert_allclose([to_np(o) for o in out], [x[:1].sum(), x[1:].sum()], rtol=1e-6)


def test_pad_and_slice_are_each_others_transpose():
    x = rand(3, 2).astype(np.float64)
    padded = fs.ops.pad(x, (1, 0), (2, 1), (1, 0))
    assert tuple(padded.shape) == (8, 3)
    np.testing.assert_array_equal(to_np(padded)[1:6:2, 0:2], x)
    g = fs.grad(lambda v: (fs.ops.pad(v, (1, 0), (2, 1), (1, 0)) * 3.0).sum())(x)
    np.testing.assert_array_equal(to_np(g), np.full_like(x, 3.0))
    g = fs.grad(lambda v: fs.ops.slice_array(v, (0, 1), (3, 2), (2, 1)).sum())(x)
    np.testing.assert_array_equal(to_np(g), [[0, 1], [0, 0], [0, 1]])


def test_one_hot_dtypes_and_out_of_range_rows():
    out = fs.ops.one_hot(np.array([0, 2, 3]), 3, dtype=np.int32)
    assert out.dtype == ms.int32
    np.testing.assert_array_equal(to_np(out), [[1, 0, 0], [0, 0, 1], [0, 0, 0]])


def test_scatter_add_accumulates_repeated_indices():
    out = fs.ops.scatter_add(np.ones((2, 3), np.float32), np.array([1, 1, 0]), (2, 2), axis=1)
    np.testing.assert_array_equal(to_np(out), [[1, 2], [1, 2]])


# ---------------------------------------------------------------------------
# Native-op functions: floor division, remainder, scans, sorts, masks, index arithmetic
# ---------------------------------------------------------------------------

INTS = np.array([[-7, -6, 5, 7], [0, 3, -1, 9]], np.int32)


@pytest.mark.parametrize("name,ref", [("floor_divide", np.floor_divide),
                                      ("remainder", np.mod)])
@pytest.mark.parametrize("y", [3, -4, np.array([2, -3, 5, -2], np.int32)],
                         ids=["3", "-4", "array"])
def test_floor_division_of_negative_integers_is_pythons(name, ref, y):
    out = getattr(fs.ops, name)(INTS, y)
    assert out.dtype == ms.int32
    np.testing.assert_array_equal(to_np(out), ref(INTS, y))
    np.testing.assert_array_equal(to_np(fs.jit(getattr(fs.ops, name))(INTS, y)), ref(INTS, y))


def test_floor_division_with_a_python_float_is_float32():
    out = fs.ops.floor_divide(INTS, 2.0)
    assert out.dtype == ms.float32
    np.testing.assert_array_equal(to_np(out), np.floor_divide(INTS, 2.0).astype(np.float32))


def test_scans_and_sorts_match_numpy():
    x = rand(3, 5)
    np.testing.assert_allclose(to_np(fs.ops.cumsum(x, 1)), np.cumsum(x, 1), rtol=1e-6)
    np.testing.assert_allclose(to_np(fs.ops.cumprod(x, -2, reverse=True)),
                               np.cumprod(x[::-1], 0)[::-1], rtol=1e-6)
    values, idx = fs.ops.sort(x, 0, descending=True)
    np.testing.assert_array_equal(to_np(idx), np.argsort(-x, 0, kind="stable"))
    np.testing.assert_allclose(to_np(values), -np.sort(-x, 0))
    v, i = fs.ops.topk(x, 2)
    np.testing.assert_array_equal(to_np(i), np.argsort(-x, 1, kind="stable")[:, :2])


def test_prod_gradient_is_exact_at_zeros():
    x = np.array([2.0, 0.0, 3.0, 0.5])
    g = fs.grad(lambda a: fs.ops.prod(a))(x)
    np.testing.assert_allclose(to_np(g), [0.0, 3.0, 0.0, 0.0])


def test_index_arithmetic_matches_numpy():
    x = rand(3, 4)
    idx = np.array([[0, 1], [2, 3], [2, 0]], np.int32)
    np.testing.assert_allclose(to_np(fs.ops.gather_nd(x, idx)), x[idx[:, 0], idx[:, 1]])
    rows = np.array([0, 2, 0], np.int32)
    want = x.copy()
    np.add.at(want, rows, x)
    np.testing.assert_allclose(to_np(fs.ops.index_add(x, rows, x, 0)), want, rtol=1e-6)
    want = np.zeros((3, 4), np.float32)
    np.add.at(want, (rows, [1, 1, 1]), 1.0)
    np.testing.assert_allclose(
        to_np(fs.ops.scatter_nd(np.stack([rows, [1, 1, 1]], 1), np.ones(3, np.float32), (3, 4))),
        want)


@pytest.mark.parametrize("call,error,pattern", [
    (lambda: fs.ops.floor_divide(np.array([True]), np.array([False])), ArgumentError,
     "bool operands are not supported"),
    (lambda: fs.ops.topk(rand(2, 3), 4), ArgumentError, r"k must be a Python int in \[0, 3\]"),
    (lambda: fs.ops.sort(np.array([True, False])), ArgumentError, "cast it to int32"),
    (lambda: fs.ops.cumsum(rand(2, 3), 2), ArgumentError, "out of range"),
    (lambda: fs.ops.cumsum(np.float32(1), 0), ArgumentError, "rank >= 1"),
    (lambda: fs.ops.pad_nd(rand(2, 3), (3, 3), "reflect"), ArgumentError,
     "must be smaller than dimension 1"),
    (lambda: fs.ops.pad_nd(rand(2, 3), (1,)), ArgumentError, r"\(before, after\) pairs"),
    (lambda: fs.ops.narrow(rand(2, 3), 1, 2, 2), ArgumentError, "outside dimension 1"),
    (lambda: fs.ops.prelu(rand(2, 3), rand(4)), ShapeError, "3 channels"),
    (lambda: fs.ops.masked_fill(rand(2), rand(2), 0.0), ArgumentError, "must be a bool array"),
    (lambda: fs.ops.clamp(rand(2)), ArgumentError, "at least one bound"),
    (lambda: fs.ops.repeat_interleave(rand(3), [1, 2]), ShapeError, "2 counts for 3 entries"),
    (lambda: fs.ops.index_update(rand(2, 3), 0, rand(2)), ShapeError,
     r"cannot be broadcast to the indexed shape \(3,\)"),
])
def test_native_op_errors_name_the_argument(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_getitem_with_a_concrete_one_dimensional_mask_matches_numpy():
    x, mask = rand(3, 4), np.array([True, False, True, True])
    np.testing.assert_array_equal(to_np(fs.ops.getitem(x, (slice(None), mask))), x[:, mask])
    np.testing.assert_array_equal(to_np(fs.jit(lambda a: a[mask[:3]])(x)), x[mask[:3]])
