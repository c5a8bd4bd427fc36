"""``fs.shard_map`` on virtual meshes: values and gradients equal the unsharded
function's, strategies map onto mesh axes as documented, composition with jit, grad
and vmap, and the errors. The multi-process runs are in tests/distributed/.
"""

from __future__ import annotations

import os
import sys

import mindspore as ms
import numpy as np
import pytest

import fshard as fs
from fshard.testing import assert_close

RNG = np.random.default_rng(0)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def close(a, b, tol=1e-5):
    assert_close(a, b, rtol=tol, atol=tol)


MESH = fs.Mesh((2, 4), ("dp", "mp"))
L = fs.Layout((2, 4), ("dp", "mp"))

# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------


def row_parallel_matmul(x, w):
    """x split on its columns, w on its rows over "mp": partial products, psum."""
    return fs.psum(x @ w, "mp")


def col_parallel_then_gather(x, w):
    return fs.all_gather(fs.ops.relu(x @ w), "mp", axis=1, tiled=True)


def test_row_parallel_matmul():
    x, w = f32(8, 16), f32(16, 3)
    f = fs.shard_map(row_parallel_matmul, (L("dp", "mp"), L("mp", "None")), L("dp", "None"),
                     mesh=MESH)
    close(f(x, w), x @ w)
    close(fs.jit(f)(x, w), x @ w)


def test_column_parallel_with_split_counts():
    """x's split counts (2, 1) take the first mesh axis, dp; w's columns name mp."""
    x, w = f32(8, 5), f32(5, 12)
    f = fs.shard_map(col_parallel_then_gather, ((2, 1), L("None", "mp")), (2, 1), mesh=MESH)
    close(f(x, w), np.maximum(x @ w, 0))


def test_split_counts_map_onto_mesh_axes_in_order():
    x = f32(8, 4)
    seen = {}

    def record(v):
        seen["shape"] = v.shape
        return v

    fs.shard_map(record, ((2, 4),), (2, 4), mesh=MESH)(x)          # dim0: dp, dim1: mp
    assert seen["shape"] == (4, 1)
    out = fs.shard_map(record, ((8, 1),), (8, 1), mesh=MESH)(x)    # dim0: dp+mp
    assert seen["shape"] == (1, 4)
    close(out, x)
    out = fs.shard_map(lambda v: fs.psum(v, "mp"), ((1, 2),), (1, 2), mesh=MESH)(x)
    close(out, 4 * x)  # dim 1 over dp; replicated over mp: the psum counts 4 copies
    with pytest.raises(fs.ShardingError, match="no run of consecutive unused axes of total "
                                               "size 4"):
        fs.shard_map(record, ((4, 1),), None, mesh=MESH)(x)


def test_pytree_arguments_and_outputs():
    params = {"w": f32(6, 4), "b": f32(4)}
    x = f32(8, 6)

    def f(p, v):
        y = v @ p["w"] + p["b"]
        return {"y": y, "mean": fs.pmean(y.mean(), "dp")}

    dp = fs.Layout((4,), ("dp",))
    g = fs.shard_map(f, (None, dp("dp", "None")), {"y": dp("dp", "None"), "mean": ()},
                     mesh=fs.Mesh((4,), ("dp",)))
    out = g(params, x)
    close(out["y"], x @ params["w"] + params["b"])
    close(out["mean"], (x @ params["w"] + params["b"]).mean())


def test_all_collectives_round_trip():
    """all_to_all twice, ppermute there and back, psum_scatter then all_gather."""
    x = f32(8, 8)

    def f(v):
        a = fs.all_to_all(fs.all_to_all(v, "d", 0, 1, tiled=True), "d", 1, 0, tiled=True)
        p = fs.ppermute(fs.ppermute(v, "d", [(0, 1), (1, 0)]), "d", [(0, 1), (1, 0)])
        s = fs.all_gather(fs.psum_scatter(v, "d", tiled=True), "d", tiled=True)
        return a, p, s

    mesh = fs.Mesh((2,), ("d",))
    a, p, s = fs.shard_map(f, ((2, 1),), ((2, 1), (2, 1), (2, 1)), mesh=mesh)(x)
    close(a, x)
    close(p, x)
    close(s, np.concatenate([x[:4] + x[4:]] * 2))


def test_mesh_from_the_environment(monkeypatch):
    monkeypatch.setenv("FSHARD_DEVICES", "2")
    out = fs.shard_map(lambda v: fs.psum(v, "d"), ((2,),), None)(np.arange(4, dtype=np.float32))
    close(out, [2.0, 4.0])


def test_mesh_from_layout_views():
    lay = fs.Layout((2,), ("x",))
    out = fs.shard_map(lambda v: fs.psum(v, "x"), (lay("x"),), None)(
        np.arange(4, dtype=np.float32))
    close(out, [2.0, 4.0])


def test_with_mesh_block():
    with fs.Mesh((2,), ("z",)):
        out = fs.shard_map(lambda v: fs.psum(v, "z"), ((2,),), None)(
            np.arange(4, dtype=np.float32))
    close(out, [2.0, 4.0])


# ---------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------


def _mlp_loss(params, x, y):
    h = fs.ops.tanh(x @ params["w1"])
    return ((h @ params["w2"] - y) ** 2).mean()


def _mlp_params():
    return {"w1": f32(5, 8), "w2": f32(8, 2)}


def test_value_and_grad_inside_equals_full_batch():
    """Gradients of replicated params come out averaged because pmean's transpose
    (with the replicated-input rule) does it: the seed's manual data parallelism."""
    params, x, y = _mlp_params(), f32(16, 5), f32(16, 2)
    dp = fs.Layout((4,), ("dp",))
    step = fs.shard_map(fs.value_and_grad(lambda p, a, b: fs.pmean(_mlp_loss(p, a, b), "dp")),
                        (None, dp("dp", "None"), dp("dp", "None")), ((), None),
                        mesh=fs.Mesh((4,), ("dp",)))
    v0, g0 = fs.value_and_grad(_mlp_loss)(params, x, y)
    for fn in (step, fs.jit(step)):
        v, g = fn(params, x, y)
        close(v, v0)
        for k in g0:
            close(g[k], g0[k])


@pytest.mark.parametrize("body", ["psum", "all_gather", "psum_scatter", "ppermute",
                                  "all_to_all", "broadcast", "pmax"])
def test_grad_of_shard_map_equals_grad_of_the_unsharded_function(body):
    x, w = ms.Tensor(f32(8, 6)), ms.Tensor(f32(6, 6))  # the unsharded functions run eagerly
    mesh = fs.Mesh((2,), ("d",))
    perm = [(0, 1), (1, 0)]
    bodies = {
        # (per-device body, in_strategy, out_strategy, the same function unsharded)
        "psum": (lambda v, w: fs.psum(fs.ops.tanh(v @ w), "d"), ((2, 1), None), None,
                 lambda v, w: fs.ops.tanh(v[:4] @ w) + fs.ops.tanh(v[4:] @ w)),
        "all_gather": (lambda v, w: fs.all_gather(fs.ops.sin(v) @ w, "d", tiled=True),
                       ((2, 1), None), None, lambda v, w: fs.ops.sin(v) @ w),
        "psum_scatter": (lambda v, w: fs.psum_scatter(v @ w, "d", tiled=True),
                         ((1, 2), (2, 1)), (2, 1), lambda v, w: v @ w),
        "ppermute": (lambda v, w: fs.ppermute(v @ w, "d", perm), ((2, 1), None), (2, 1),
                     lambda v, w: fs.ops.concat([v[4:] @ w, v[:4] @ w])),
        "all_to_all": (lambda v, w: fs.all_to_all(v @ w, "d", 1, 0, tiled=True),
                       ((2, 1), None), (2, 1),
                       lambda v, w: fs.ops.concat([(v @ w)[:, :3], (v @ w)[:, 3:]])),
        "broadcast": (lambda v, w: fs.broadcast(v @ w, "d", root=1), ((2, 1), None), None,
                      lambda v, w: v[4:] @ w),
        "pmax": (lambda v, w: fs.pmax(v @ w, "d"), ((2, 1), None), None,
                 lambda v, w: fs.ops.maximum(v[:4] @ w, v[4:] @ w)),
    }
    f, ins, outs, unsharded = bodies[body]
    sm = fs.shard_map(f, ins, outs, mesh=mesh)
    expected = unsharded(x, w)
    close(sm(x, w), expected)
    ct = f32(*expected.shape)

    def loss(fn):
        return lambda v, w: (fn(v, w) * ct).sum()

    g = fs.grad(loss(sm), argnums=(0, 1))(x, w)
    g0 = fs.grad(loss(unsharded), argnums=(0, 1))(x, w)
    close(g[0], g0[0])
    close(g[1], g0[1])
    gj = fs.jit(fs.grad(loss(sm), argnums=(0, 1)))(x, w)
    close(gj[1], g0[1])


def test_grad_inside_and_outside_agree_on_a_2d_mesh():
    """Tensor parallel over mp, data parallel over dp, differentiated inside."""
    params, x, y = _mlp_params(), f32(8, 5), f32(8, 2)

    def local(p, a, b):
        h = fs.ops.tanh(a @ p["w1"])                 # w1 split on columns over mp
        out = fs.psum(h @ p["w2"], "mp")             # w2 split on rows over mp
        return fs.pmean(((out - b) ** 2).mean(), "dp")

    ins = (({"w1": L("None", "mp"), "w2": L("mp", "None")}), L("dp", "None"), L("dp", "None"))
    step = fs.shard_map(fs.value_and_grad(local), ins, ((), {"w1": L("None", "mp"),
                                                            "w2": L("mp", "None")}), mesh=MESH)
    v, g = step(params, x, y)
    v0, g0 = fs.value_and_grad(_mlp_loss)(params, x, y)
    close(v, v0)
    close(g["w1"], g0["w1"])
    close(g["w2"], g0["w2"])
    outside = fs.grad(fs.shard_map(local, ins, (), mesh=MESH))(params, x, y)
    close(outside["w1"], g0["w1"])


def test_hessian_inside_shard_map():
    """Second derivatives through the replicated-value rules."""
    w, x = f32(3), f32(8, 3)

    def local(w, a):
        return fs.pmean((fs.ops.sin(a @ w) ** 2).mean(), "d")

    h = fs.shard_map(fs.hessian(local), (None, (2, 1)), None, mesh=fs.Mesh((2,), ("d",)))(w, x)
    h0 = fs.hessian(lambda w, a: (fs.ops.sin(a @ w) ** 2).mean())(w, x)
    close(h, h0, tol=1e-4)


def test_vmap_inside_and_outside():
    x, w = f32(3, 8, 4), f32(4, 2)
    mesh = fs.Mesh((2,), ("d",))
    inner = fs.shard_map(fs.vmap(lambda v, w: fs.psum(v @ w, "d"), in_axes=(0, None)),
                         ((1, 2, 1), None), None, mesh=mesh)
    expected = np.stack([b[:4] @ w + b[4:] @ w for b in x])
    close(inner(x, w), expected)
    outer = fs.vmap(fs.shard_map(lambda v, w: fs.psum(v @ w, "d"), ((2, 1), None), None,
                                 mesh=mesh), in_axes=(0, None))
    close(outer(x, w), expected)


def test_per_example_grads_inside_shard_map():
    """vmap(grad) per device; the replicated parameter's gradient sums over devices."""
    w, x = f32(3), f32(4, 3)
    g = fs.shard_map(fs.vmap(fs.grad(lambda w, a: (a @ w) ** 2), in_axes=(None, 0)),
                     (None, (2, 1)), (2, 1), mesh=fs.Mesh((2,), ("d",)))(w, x)
    per_example = 2 * (x @ w)[:, None] * x
    summed = per_example[:2] + per_example[2:]      # the same on both devices
    close(g, np.concatenate([summed, summed]))


def test_jit_traces_once():
    f = fs.jit(fs.shard_map(lambda v: fs.psum(v, "d"), ((2,),), None, mesh=fs.Mesh((2,), ("d",))))
    x = np.arange(4, dtype=np.float32)
    f(x)
    f(x + 1)
    assert f.trace_count == 1
    assert "psum" not in str(f.lower(x).program)  # batched into array ops


# ---------------------------------------------------------------------------
# Replication promises
# ---------------------------------------------------------------------------


def test_varying_output_promised_replicated_is_an_error():
    with pytest.raises(fs.ShardingError, match=r"the output varies over the mesh axis 'd'"):
        fs.shard_map(lambda v: v * 2, ((2,),), None, mesh=fs.Mesh((2,), ("d",)))(
            np.arange(4, dtype=np.float32))


def test_check_vma_false_takes_device_zero():
    out = fs.shard_map(lambda v: v * 2, ((2,),), None, mesh=fs.Mesh((2,), ("d",)),
                       check_vma=False)(np.arange(4, dtype=np.float32))
    close(out, [0.0, 2.0])


def test_replicated_output_split_repeats_it():
    out = fs.shard_map(lambda v: v, (None,), (2,), mesh=fs.Mesh((2,), ("d",)))(
        np.arange(2, dtype=np.float32))
    close(out, [0.0, 1.0, 0.0, 1.0])


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

M2 = fs.Mesh((2,), ("d",))


def test_error_in_strategy_length():
    with pytest.raises(fs.ShardingError, match="in_strategy has 1 entries but the function "
                                               "was called with 2"):
        fs.shard_map(lambda a, b: a, ((2,),), None, mesh=M2)(np.ones(2), np.ones(2))


def test_error_in_strategy_not_a_tuple():
    with pytest.raises(fs.ShardingError, match="1-tuple"):
        fs.shard_map(lambda a: a, None, None, mesh=M2)


def test_error_bare_int_entry():
    with pytest.raises(fs.ShardingError, match="A bare int is not a strategy"):
        fs.shard_map(lambda a: a, (2,), (2,), mesh=M2)(np.ones(2, np.float32))


def test_error_strategy_rank():
    with pytest.raises(fs.ShardingError, match=r"has 1 entry, but the value has rank 2"):
        fs.shard_map(lambda a: a, ((2,),), None, mesh=M2)(np.ones((2, 2), np.float32))
    with pytest.raises(fs.ShardingError, match="names 1 dimensions, but the value has rank 2"):
        fs.shard_map(lambda a: a, (fs.Layout((2,), ("d",))("d"),), None, mesh=M2)(
            np.ones((2, 2), np.float32))


def test_error_not_divisible():
    with pytest.raises(fs.ShardingError, match=r"dimension 0 of args\[0\].*f32\[3\].*3 is not "
                                               r"divisible by 2"):
        fs.shard_map(lambda a: a, ((2,),), (2,), mesh=M2)(np.ones(3, np.float32))


def test_error_unknown_axis_in_layout():
    with pytest.raises(fs.ShardingError, match="splits over the axis 'x', which the mesh"):
        fs.shard_map(lambda a: a, (fs.Layout((2,), ("x",))("x"),), None, mesh=M2)(
            np.ones(2, np.float32))


def test_error_layout_size_differs_from_mesh():
    with pytest.raises(fs.ShardingError, match="gives axis 'd' 4 devices"):
        fs.shard_map(lambda a: a, (fs.Layout((4,), ("d",))("d"),), None, mesh=M2)(
            np.ones(4, np.float32))


def test_error_unknown_axis_in_body():
    with pytest.raises(fs.AxisNameError, match="calls fs.psum over the axis 'q', which is not "
                                               "an axis of the mesh"):
        fs.shard_map(lambda a: fs.psum(a, "q"), ((2,),), None, mesh=M2)(np.ones(2, np.float32))
    with pytest.raises(fs.AxisNameError, match="fs.all_gather names the axis 'q'"):
        fs.shard_map(lambda a: fs.all_gather(a, "q"), ((2,),), None, mesh=M2)(
            np.ones(2, np.float32))


def test_error_nested_shard_map():
    inner = fs.shard_map(lambda a: a, ((2,),), (2,), mesh=M2)
    with pytest.raises(fs.CompositionError, match="inside another fs.shard_map body"):
        fs.shard_map(lambda a: inner(a), ((2,),), (2,), mesh=M2)(np.ones(4, np.float32))
    with pytest.raises(fs.CompositionError, match="already a shard_map"):
        fs.shard_map(inner, ((2,),), (2,), mesh=M2)


def test_error_out_strategy_structure():
    with pytest.raises(fs.ShardingError, match="out_strategy = .* pytree prefix of the output"):
        fs.shard_map(lambda a: (a, a), ((2,),), ((2,), (2,), (2,)), mesh=M2)(
            np.ones(2, np.float32))


def test_error_keyword_arguments():
    with pytest.raises(fs.ShardingError, match="positional arguments only"):
        fs.shard_map(lambda a: a, ((2,),), (2,), mesh=M2)(a=np.ones(2, np.float32))


# ---------------------------------------------------------------------------
# The example, on one process
# ---------------------------------------------------------------------------


def test_data_parallel_example_matches_full_batch_training():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import data_parallel_mlp as example

    reference = example.train(3)
    sharded = example.train(3, fs.Mesh((4,), ("dp",)))
    np.testing.assert_allclose(sharded, reference, rtol=1e-5)
    assert reference[-1] < reference[0]


def test_single_output_accepts_a_tuple_of_one_strategy():
    mesh = fs.Mesh((2,), ("d",))
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    for out in [((2, 1),), (2, 1)]:
        f = fs.shard_map(lambda a: a * 2, in_strategy=((2, 1),), out_strategy=out, mesh=mesh)
        close(f(x), x * 2)


@pytest.mark.parametrize("bad", [((2, 0),), ((2, 2.0),), ((3, 1),), ((16, 1),), ((2,),)])
def test_shard_and_shard_map_check_split_counts_alike(bad):
    """One check of split counts (fs.meshes.layout.check_strategy) behind both transforms: the
    same rule and fix for the same mistake."""
    x = np.ones((8, 4), np.float32)
    got = []
    for make in (lambda: fs.shard(lambda v: v * 2.0, in_strategy=bad, mesh=8),
                 lambda: fs.shard_map(lambda v: v * 2.0, bad, None,
                                      mesh=fs.Mesh((8,), ("d",)))):
        with pytest.raises(fs.ShardingError) as info:
            make()(x)
        first, *rest = str(info.value).splitlines()
        assert f"in_strategy[0] = {bad[0]!r} " in first
        got.append(rest)  # the rule and the fix
    assert got[0] == got[1]


def test_out_strategy_forms_match_shard():
    """MindSpore's tuple of strategies for a single output, ``((2, 1),)``, means what the
    bare strategy ``(2, 1)`` means, in fs.shard_map as in fs.shard."""
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    mesh = fs.Mesh((2,), ("d",))
    for out_strategy in ((2, 1), ((2, 1),)):
        y = fs.shard_map(lambda v: v * 2.0, ((2, 1),), out_strategy, mesh=mesh)(x)
        np.testing.assert_array_equal(y.asnumpy(), 2 * x)
        z = fs.shard(lambda v: v * 2.0, in_strategy=((2, 1),), out_strategy=out_strategy,
                     mesh=2)(x)
        np.testing.assert_array_equal(z.asnumpy(), 2 * x)
    with pytest.raises(fs.ShardingError, match="out_strategy"):
        fs.shard_map(lambda v: v * 2.0, ((2, 1),), ((2, 1), (2, 1)), mesh=mesh)(x)
