"""``fs.shard`` from the user's side: the seeds' examples as written, strategies as
tuples and Layout views, Cells and parameter plans, dataset strategies, composition
with vmap / grad / jit, and inspection (per-device program, strategy files).

Every sharded result is compared with the unsharded function on the same inputs.
"""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

import fshard as fs
from fshard.testing import assert_close
from fshard.transforms.shard import Sharded
from fshard.transforms.shard_call import shard_call_p


def _np(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def close(a, b, rtol=1e-5, atol=1e-5):
    assert_close(a, b, rtol=rtol, atol=atol)


def tensors(rng, *shapes, low=None):
    if low is None:
        return [Tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    return [Tensor(rng.uniform(low, 1, s).astype(np.float32)) for s in shapes]


def dense_relu(x, weight, bias):
    x = ops.matmul(x, weight)
    x = ops.bias_add(x, bias)
    return ops.relu(x)


@pytest.fixture
def seed_inputs():
    rng = np.random.default_rng(0)
    return tensors(rng, (32, 128), (128, 10), (10,), low=0)


def plans(fun, *args):
    """The ShardPlans of every shard_call a transformed function stages."""
    traced = fs.make_ir(fun)(*args)
    return [eq.params["plan"] for eq in traced.program.equations if eq.prim is shard_call_p]


# ---------------------------------------------------------------------------
# seeds/000: the functional example, three ways to give 8 devices
# ---------------------------------------------------------------------------


def test_seed_example_with_a_mesh_block(seed_inputs):
    x, weight, bias = seed_inputs
    with fs.Mesh((8,), ("d",)):
        result = fs.shard(dense_relu, in_strategy=((4, 2), None, None))(x, weight, bias)
    assert result.shape == (32, 10)
    close(result, dense_relu(x, weight, bias))


def test_seed_example_with_fshard_devices(seed_inputs, monkeypatch):
    monkeypatch.setenv("FSHARD_DEVICES", "8")
    x, weight, bias = seed_inputs
    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None))
    close(sharded(x, weight, bias), dense_relu(x, weight, bias))
    assert sharded.partitioned(x, weight, bias).prop.mesh.size == 8


def test_seed_example_with_mesh_argument(seed_inputs):
    x, weight, bias = seed_inputs
    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8)
    close(sharded(x, weight, bias), dense_relu(x, weight, bias))
    part = sharded.partitioned(x, weight, bias)
    # x is split (4, 2); propagation derives weight (2, 1) so the matmul needs no
    # communication on its inputs, and the output is replicated (full_batch).
    assert [s.strategy(part.prop.mesh) for s in part.in_shardings] == [(4, 2), (2, 1), (1,)]
    assert part.out_shardings[0].strategy(part.prop.mesh) == (1, 1)


def test_numpy_inputs_and_a_cached_second_call(seed_inputs):
    x, weight, bias = [_np(t) for t in seed_inputs]
    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8)
    first = sharded(x, weight, bias)
    second = sharded(x, weight, bias)
    close(first, second)
    assert len(sharded._cache) == 1


# ---------------------------------------------------------------------------
# Strategies: tuples, Layout views, repeated calculation, out_strategy
# ---------------------------------------------------------------------------


def test_layout_views_equal_their_tuples(seed_inputs):
    x, weight, bias = seed_inputs
    layout = fs.Layout((4, 2), ("dp", "mp"))
    by_layout = fs.shard(dense_relu, in_strategy=(layout("dp", "mp"), None, None), mesh=8)
    by_tuple = fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8)
    close(by_layout(x, weight, bias), dense_relu(x, weight, bias))
    assert (by_layout.partitioned(x, weight, bias).in_shardings
            == by_tuple.partitioned(x, weight, bias).in_shardings)


def test_layout_with_axes_in_non_row_major_order(seed_inputs):
    x, weight, bias = seed_inputs
    layout = fs.Layout((2, 2, 2), ("a", "b", "c"))
    sharded = fs.shard(dense_relu, in_strategy=(layout(("c", "a"), "b"), None, None), mesh=8)
    close(sharded(x, weight, bias), dense_relu(x, weight, bias))
    assert sharded.partitioned(x, weight, bias).in_shardings[0].dims == ((2, 0), (1,))


def test_layout_rank_list_that_permutes_axes(seed_inputs):
    x, weight, bias = seed_inputs
    # Device-matrix position p holds rank [0, 4, 2, 6, 1, 5, 3, 7][p]: the layout's
    # axes are the mesh's prime axes in reverse order.
    layout = fs.Layout((2, 2, 2), ("a", "b", "c"), rank_list=[0, 4, 2, 6, 1, 5, 3, 7])
    sharded = fs.shard(dense_relu, in_strategy=(layout("a", "None"), None, None), mesh=8)
    close(sharded(x, weight, bias), dense_relu(x, weight, bias))
    assert sharded.partitioned(x, weight, bias).in_shardings[0].dims == ((2,), ())


def test_repeated_calculation_keeps_replicas_on_neighbouring_ranks(seed_inputs):
    x, weight, bias = seed_inputs
    sharded = fs.shard(dense_relu, in_strategy=((2, 1), None, None), mesh=8)
    close(sharded(x, weight, bias), dense_relu(x, weight, bias))
    # (2, 1) on 8 devices: the split uses the major mesh axis, the 4 replicas of each
    # block are neighbours (MindSpore appends the repeat factor on the right).
    assert sharded.partitioned(x, weight, bias).in_shardings[0].dims == ((0,), ())


def test_out_strategy_is_honoured(seed_inputs):
    x, weight, bias = seed_inputs
    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None), out_strategy=((8, 1),),
                       mesh=8)
    close(sharded(x, weight, bias), dense_relu(x, weight, bias))
    part = sharded.partitioned(x, weight, bias)
    assert part.out_shardings[0].strategy(part.prop.mesh) == (8, 1)
    # The (8, 1) output is the relu's own layout: no all_gather at the end. (On CPU,
    # which has no ReduceScatter, the reduction is an AllReduce and a local slice.)
    assert part.collectives() == ["psum"]
    # A bare strategy for a function with one output means the same.
    bare = fs.shard(dense_relu, in_strategy=((4, 2), None, None), out_strategy=(8, 1), mesh=8)
    assert bare.partitioned(x, weight, bias).out_shardings == part.out_shardings


def test_out_strategy_for_several_outputs_is_a_pytree_prefix():
    rng = np.random.default_rng(1)
    a, b = tensors(rng, (8, 4), (8, 4))

    def f(a, b):
        return {"sum": a + b, "prod": a * b}

    sharded = fs.shard(f, in_strategy=((8, 1), (8, 1)),
                       out_strategy={"sum": (8, 1), "prod": None}, mesh=8)
    out = sharded(a, b)
    close(out["sum"], _np(a) + _np(b))
    close(out["prod"], _np(a) * _np(b))
    part = sharded.partitioned(a, b)
    strategies = [s.strategy(part.prop.mesh) for s in part.out_shardings]
    assert sorted(strategies) == [(1, 1), (8, 1)]


def test_pytree_arguments_take_a_pytree_of_strategies():
    rng = np.random.default_rng(2)
    x, w1, w2 = tensors(rng, (4, 16), (16, 32), (32, 16))

    def mlp(params, x):
        return ops.matmul(ops.relu(ops.matmul(x, params["w1"])), params["w2"])

    params = {"w1": w1, "w2": w2}
    sharded = fs.shard(mlp, in_strategy=({"w1": (1, 8), "w2": (8, 1)}, None), mesh=8)
    close(sharded(params, x), mlp(params, x), rtol=1e-4, atol=1e-4)
    assert sharded.partitioned(params, x).collectives() == ["psum"]


def test_device_is_checked_against_where_mindspore_runs(seed_inputs):
    x, weight, bias = seed_inputs
    target = ms.get_context("device_target")
    for device in (target, target.lower()):
        sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None), device=device, mesh=8)
        assert sharded.device == target
        close(sharded(x, weight, bias), dense_relu(x, weight, bias))


@pytest.mark.parametrize("level", [0, 1, 2])
def test_every_level_gives_the_unsharded_result(seed_inputs, level):
    x, weight, bias = seed_inputs
    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None), level=level, mesh=8)
    close(sharded(x, weight, bias), dense_relu(x, weight, bias))


# ---------------------------------------------------------------------------
# dataset_strategy
# ---------------------------------------------------------------------------


def test_full_batch_outputs_are_replicated(seed_inputs):
    x, weight, bias = seed_inputs
    sharded = fs.shard(dense_relu, in_strategy=((8, 1), None, None), mesh=8,
                       dataset_strategy="full_batch")
    part = sharded.partitioned(x, weight, bias)
    assert part.out_shardings[0].strategy(part.prop.mesh) == (1, 1)
    close(sharded(x, weight, bias), dense_relu(x, weight, bias))


def test_data_parallel_splits_unannotated_inputs_and_outputs_along_the_batch(seed_inputs):
    x, weight, bias = seed_inputs
    sharded = fs.shard(dense_relu, in_strategy=(None, (1, 1), (1,)), mesh=8,
                       dataset_strategy="data_parallel")
    part = sharded.partitioned(x, weight, bias)
    mesh = part.prop.mesh
    assert [s.strategy(mesh) for s in part.in_shardings] == [(8, 1), (1, 1), (1,)]
    assert part.out_shardings[0].strategy(mesh) == (8, 1)
    assert part.collectives() == []  # pure data parallelism: no communication
    close(sharded(x, weight, bias), dense_relu(x, weight, bias))


# ---------------------------------------------------------------------------
# seeds/000: shard of a Cell with a parameter plan
# ---------------------------------------------------------------------------


class BasicBlock(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1 = nn.Dense(32, 32)
        self.gelu = nn.GELU()
        self.dense2 = nn.Dense(32, 32)

    def construct(self, x):
        return self.dense2(self.gelu(self.dense1(x)))


class Net(nn.Cell):
    def __init__(self, key="self.block1.dense2.weight"):
        super().__init__()
        self.block1 = BasicBlock()
        self.block2 = BasicBlock()
        self.block3 = BasicBlock()
        self.block1_sharded = fs.shard(self.block1, in_strategy=((8, 1),),
                                       parameter_plan={key: (8, 1)}, mesh=8)

    def construct(self, x):
        x = self.block1_sharded(x)
        x = self.block2(x)
        return self.block3(x)


def _param_strategy(part, leaf_index):
    return part.in_shardings[leaf_index].strategy(part.prop.mesh)


@pytest.mark.parametrize("key", ["self.block1.dense2.weight", "block1.dense2.weight",
                                 "dense2.weight", "self.dense2.weight"])
def test_cell_example_with_parameter_plan(key):
    ms.set_seed(0)
    net = Net(key)
    x = Tensor(np.random.default_rng(3).standard_normal((16, 32)).astype(np.float32))
    out = net(x)
    assert out.shape == (16, 32)
    close(out, net.block3(net.block2(net.block1(x))), rtol=1e-4, atol=1e-5)
    part = net.block1_sharded.partitioned(x)
    names = sorted(n for n, _ in net.block1.parameters_and_names())
    assert names == ["dense1.bias", "dense1.weight", "dense2.bias", "dense2.weight"]
    assert _param_strategy(part, names.index("dense2.weight")) == (8, 1)


def test_cell_sees_parameter_updates():
    ms.set_seed(0)
    block = BasicBlock()
    sharded = fs.shard(block, in_strategy=((8, 1),), mesh=8)
    x = Tensor(np.ones((8, 32), np.float32))
    before = _np(sharded(x))
    block.dense2.bias.set_data(block.dense2.bias + 1.0)
    close(sharded(x), before + 1.0, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Composition: vmap inside, grad and jit around or inside
# ---------------------------------------------------------------------------


def test_shard_of_vmap(seed_inputs):
    _, weight, bias = seed_inputs
    xs = Tensor(np.random.default_rng(4).uniform(0, 1, (8, 4, 128)).astype(np.float32))
    per_example = fs.vmap(dense_relu, in_axes=(0, None, None))
    out = fs.shard(per_example, in_strategy=((8, 1, 1), None, None), mesh=8)(xs, weight, bias)
    assert out.shape == (8, 4, 10)
    close(out, per_example(xs, weight, bias))


def mlp(x, w1, w2):
    return ops.matmul(ops.relu(ops.matmul(x, w1)), w2)


def mlp_loss(x, w1, w2):
    return (mlp(x, w1, w2) ** 2).mean()


@pytest.fixture
def mlp_inputs():
    rng = np.random.default_rng(5)
    return tensors(rng, (16, 32), (32, 64), (64, 32))


MEGATRON = (None, (1, 8), (8, 1))


def test_grad_of_shard_gives_the_unsharded_gradients(mlp_inputs):
    want = fs.grad(mlp_loss, argnums=(0, 1, 2))(*mlp_inputs)
    sharded = fs.shard(mlp_loss, in_strategy=MEGATRON, mesh=8)
    got = fs.grad(sharded, argnums=(0, 1, 2))(*mlp_inputs)
    for g, w in zip(got, want):
        close(g, w, rtol=1e-4, atol=1e-6)


def test_shard_of_value_and_grad_gives_the_unsharded_gradients(mlp_inputs):
    vg = fs.value_and_grad(mlp_loss, argnums=(0, 1, 2))
    (value, grads), (want_value, want_grads) = (
        fs.shard(vg, in_strategy=MEGATRON, mesh=8)(*mlp_inputs), vg(*mlp_inputs))
    close(value, want_value, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        close(g, w, rtol=1e-4, atol=1e-6)


def test_jit_of_each_composition_is_one_graph_and_agrees(mlp_inputs):
    want = fs.grad(mlp_loss, argnums=(0, 1, 2))(*mlp_inputs)
    sharded = fs.shard(mlp_loss, in_strategy=MEGATRON, mesh=8)
    variants = {
        "jit(shard)": fs.jit(sharded),
        "jit(grad(shard))": fs.jit(fs.grad(sharded, argnums=(0, 1, 2))),
        "jit(shard(value_and_grad))": fs.jit(fs.shard(
            fs.value_and_grad(mlp_loss, argnums=(0, 1, 2)), in_strategy=MEGATRON, mesh=8)),
        "grad(jit(shard))": fs.grad(fs.jit(sharded), argnums=(0, 1, 2)),
    }
    close(variants["jit(shard)"](*mlp_inputs), mlp_loss(*mlp_inputs), rtol=1e-5)
    for name in ("jit(grad(shard))", "grad(jit(shard))"):
        for g, w in zip(variants[name](*mlp_inputs), want):
            close(g, w, rtol=1e-4, atol=1e-6)
    _, grads = variants["jit(shard(value_and_grad))"](*mlp_inputs)
    for g, w in zip(grads, want):
        close(g, w, rtol=1e-4, atol=1e-6)
    text = variants["jit(grad(shard))"].lower(*mlp_inputs).as_text()
    # One generated module: the entry function calls the forward and the transposed
    # sharded computations, each a helper of the same MindSpore program.
    assert text.count("def fshard_shard_") == 2
    assert variants["jit(grad(shard))"].trace_count == 1


def test_forward_mode_through_shard(mlp_inputs):
    x, w1, w2 = mlp_inputs
    t = Tensor(np.random.default_rng(6).standard_normal((16, 32)).astype(np.float32))
    sharded = fs.shard(mlp, in_strategy=MEGATRON, mesh=8)
    out, tangent = fs.jvp(lambda x: sharded(x, w1, w2), (x,), (t,))
    want_out, want_tangent = fs.jvp(lambda x: mlp(x, w1, w2), (x,), (t,))
    close(out, want_out, rtol=1e-4, atol=1e-5)
    close(tangent, want_tangent, rtol=1e-4, atol=1e-5)


def test_jacrev_of_shard_batches_the_sharded_program():
    rng = np.random.default_rng(7)
    x, w = tensors(rng, (4, 8), (8, 2))

    def f(x, w):
        return ops.tanh(ops.matmul(x, w)).sum(axis=1)

    sharded = fs.shard(f, in_strategy=((2, 1), None), mesh=2)
    close(fs.jacrev(lambda x: sharded(x, w))(x), fs.jacrev(lambda x: f(x, w))(x),
          rtol=1e-4, atol=1e-6)


def test_grad_of_shard_of_a_cell():
    ms.set_seed(0)
    block = BasicBlock()
    x = Tensor(np.random.default_rng(8).standard_normal((8, 32)).astype(np.float32))
    sharded = fs.shard(block, in_strategy=((8, 1),), mesh=8)
    got = fs.grad(lambda x: sharded(x).sum())(x)
    want = fs.grad(lambda x: block(x).sum())(x)
    close(got, want, rtol=1e-4, atol=1e-5)


def test_constants_closed_over_are_replicated_inputs():
    scale = Tensor(np.arange(4, dtype=np.float32))

    def f(x):
        return x * scale

    x = np.ones((8, 4), np.float32)
    close(fs.shard(f, in_strategy=((8, 1),), mesh=8)(x), x * np.arange(4))


# ---------------------------------------------------------------------------
# Inspection: make_ir, strategies, strategy files, pictures
# ---------------------------------------------------------------------------


def test_make_ir_of_a_sharded_function_is_the_per_device_program(seed_inputs):
    x, weight, bias = seed_inputs
    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8)
    text = str(fs.make_ir(sharded)(x, weight, bias))
    assert text == (
        "# per-device program of dense_relu on 8 devices (prime mesh axes m0=2, m1=2, m2=2)\n"
        "# {split counts per dimension} after each value, as MindSpore writes strategies\n"
        "# collectives: psum, all_gather\n"
        "{ lambda a:f32[8,64]{(4, 2)} b:f32[64,10]{(2, 1)} c:f32[10]{(1,)} .\n"
        "    d:f32[8,10]{(4, 1) partial-sum over 2} = matmul[transpose_a=False "
        "transpose_b=False] a b\n"
        "    e:f32[8,10]{(4, 1)} = psum[axis_name=('m2',)] d\n"
        "    f:f32[4,10]{(8, 1)} = block_slice[axis_name=('m2',) dim=0 sizes=(2,)] e\n"
        "    g:f32[4,10]{(8, 1)} = bias_add f c\n"
        "    h:f32[4,10]{(8, 1)} = relu g\n"
        "    i:f32[32,10]{(1, 1)} = all_gather[axis_name=('m0', 'm1', 'm2') "
        "axis_sizes=(2, 2, 2) axis=0] h\n"
        "  in (i) }")


def test_strategies_read_back_as_a_dict(seed_inputs):
    x, weight, bias = seed_inputs
    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8)
    s = sharded.strategies(x, weight, bias)
    assert s["function"] == "dense_relu" and s["device_num"] == 8
    assert [i["strategy"] for i in s["inputs"]] == [[4, 2], [2, 1], [1]]
    assert [(e["primitive"], e["in_strategy"], e["out_strategy"]) for e in s["equations"]] == [
        ("matmul", [[4, 2], [2, 1]], [[4, 1]]),
        ("bias_add", [[8, 1], [1]], [[8, 1]]),
        ("relu", [[8, 1]], [[8, 1]]),
    ]
    assert s["equations"][0]["partial_sum"] == [2]
    assert [o["strategy"] for o in s["outputs"]] == [[1, 1]]


def test_strategy_file_round_trip(seed_inputs, tmp_path):
    x, weight, bias = seed_inputs
    path = tmp_path / "strategies.json"
    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8)
    saved = sharded.save_strategies(path, x, weight, bias)
    assert json.loads(path.read_text()) == saved
    # Load a hand-edited file: the relu now runs (4, 2)-split instead.
    edited = json.loads(path.read_text())
    edited["equations"][2]["assignment"] = [["d0", ["m0", "m1"]], ["d1", ["m2"]]]
    path.write_text(json.dumps(edited))
    loaded = fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8)
    loaded.load_strategies(path)
    close(loaded(x, weight, bias), dense_relu(x, weight, bias))
    assert loaded.strategies(x, weight, bias)["equations"][2]["out_strategy"] == [[4, 2]]


def test_visualize_the_layouts_propagation_chose(seed_inputs):
    x, weight, bias = seed_inputs
    part = fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8).partitioned(
        x, weight, bias)
    vis = fs.visualize_sharding((128, 10), part.input_layouts()[1])
    # weight (2, 1): rows split by the last mesh axis, so even and odd ranks differ.
    assert vis.cells == [[(0, 2, 4, 6)], [(1, 3, 5, 7)]]


def test_sharded_is_a_callable_with_the_function_name(seed_inputs):
    sharded = fs.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=8)
    assert isinstance(sharded, Sharded)
    assert sharded.__name__ == "dense_relu"
    assert repr(sharded) == "fs.shard(dense_relu)"


# ---------------------------------------------------------------------------
# A multi-process job: one device per process, real collectives
# ---------------------------------------------------------------------------


@pytest.mark.full
@pytest.mark.parametrize("processes", [2, 4])
def test_shard_in_a_multi_process_job(tmp_path, processes):
    """2 and 4 processes (one launch each, ~15-30 s): each runs its block of the
    per-device program with MindSpore's collectives (sub-groups included) and returns
    the global result; the seed's examples (a function and a Cell with a parameter
    plan), forward, grad(shard), jit(grad(shard)), shard(value_and_grad), three
    steps of a sharded training loop, and a sharded scan and while_loop (their split
    carries kept, collectives inside the loops) all match one process."""
    from pathlib import Path

    from fshard import launch

    script = str(Path(__file__).resolve().parents[1] / "distributed" / "shard_checks.py")
    result = launch.run(script, processes, [], timeout=300, log_dir=str(tmp_path))
    assert result.ok, result.message
    for rank in range(processes):
        out = result.output(rank)
        assert "ALL CHECKS PASSED" in out, out
        assert "CHECK seed Cell with parameter_plan ok" in out
        assert "CHECK training step 2 loss ok" in out
        assert "CHECK mindspore.value_and_grad(shard) gradient 1 ok" in out
        # a split carry through a scan and a while_loop, collectives inside the loops
        assert "CHECK sharded loops: jit(shard) scan ys ok" in out
        assert "CHECK sharded loops: jit(shard) while_loop ok" in out
        # the reverse loop's weight gradient: a pending-sum carry, reduced after it
        assert "CHECK sharded loops: jit(shard)(grad) scan weight gradient ok" in out
        if processes == 4:
            assert "CHECK sub-group collectives ['psum', 'all_gather'] ok" in out
            # relu's bool mask crosses devices: carried in float32 by fshard on CPU
            assert "CHECK (2, 2) Layout relu MLP gradient w1 ok" in out


def test_pytree_argument_of_tuples_with_no_strategy():
    # A list of (w, b) pairs is a pytree of arrays, not a strategy.
    import numpy as np

    import fshard as fs

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((4, 4)).astype(np.float32),
               rng.standard_normal(4).astype(np.float32)) for _ in range(2)]
    x = rng.standard_normal((8, 4)).astype(np.float32)

    def mlp(params, x):
        for w, b in params:
            x = fs.ops.relu(x @ w + b)
        return x

    out = fs.shard(mlp, in_strategy=(None, (8, 1)), mesh=8)(params, x)
    np.testing.assert_allclose(out.asnumpy(), fs.jit(mlp)(params, x).asnumpy(), rtol=1e-5,
                               atol=1e-6)


def test_jit_waits_for_the_last_computed_output_inside_a_shard_call():
    import numpy as np

    import fshard as fs
    from fshard.transforms.jit import _last_computed

    def loss(w, x):
        return ((x @ w) ** 2).mean()

    step = fs.jit(fs.shard(fs.value_and_grad(loss), in_strategy=(None, (8, 1)), mesh=8))
    w, x = np.ones((4, 2), np.float32), np.ones((16, 4), np.float32)
    program = step.lower(w, x).program
    assert _last_computed(program) == 1  # the gradient, not the loss computed first


# ---------------------------------------------------------------------------
# A pending sum meets a cast: reduced first unless the cast widens
# ---------------------------------------------------------------------------


def test_narrowing_cast_of_a_pending_sum_reduces_first():
    a = Tensor(np.array([[1024.5, -1024.0]], np.float32))
    b = Tensor(np.ones((2, 1), np.float32))
    f = lambda a, b: ops.matmul(a, b).astype(ms.float16)  # noqa: E731
    got = fs.shard(f, in_strategy=((1, 2), (2, 1)), mesh=2)(a, b)
    assert got.dtype == ms.float16 and float(got.asnumpy()[0, 0]) == 0.5

    v = Tensor(np.array([1e8 + 1, -1e8], np.float64))
    g = lambda v: v.sum().astype(ms.float32)  # noqa: E731
    assert float(fs.shard(g, in_strategy=((2,),), mesh=2)(v).asnumpy()) == 1.0


def test_widening_cast_lets_a_pending_sum_pass():
    from fshard.core.tracing import ArrayType
    from fshard.primitives.elementwise import cast_p
    from fshard.rules import sharding

    def linear(src, dst):
        return sharding.get(cast_p)(ArrayType((4,), src), dtype=dst).linear

    assert linear(ms.float16, ms.float32) == linear(ms.float32, ms.float64) == ((0,),)
    for src, dst in [(ms.float32, ms.float16), (ms.float64, ms.float32),
                     (ms.float16, ms.bfloat16), (ms.float32, ms.int32)]:
        assert linear(src, dst) == ()
    rng = np.random.default_rng(3)
    a, b = tensors(rng, (4, 8), (8, 4))
    f = lambda a, b: ops.matmul(a, b).astype(ms.float64) * 2.0  # noqa: E731
    close(fs.shard(f, in_strategy=((1, 2), (2, 1)), mesh=2)(a, b), f(a, b))


def test_mindspore_autodiff_over_a_sharded_function_on_a_virtual_mesh():
    import mindspore as ms
    import numpy as np
    from mindspore import ops

    def f(x, w):
        return (ops.relu(ops.matmul(x, w)) ** 2).sum()

    sf = fs.shard(f, in_strategy=((2, 1), None), mesh=2)
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.standard_normal((8, 4)).astype(np.float32))
    w = ms.Tensor(rng.standard_normal((4, 3)).astype(np.float32))
    v, g = ms.value_and_grad(lambda x, w: sf(x, w) * 2.0, grad_position=(0, 1))(x, w)
    v0, g0 = fs.value_and_grad(lambda x, w: f(x, w) * 2.0, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(v.asnumpy(), v0.asnumpy(), rtol=1e-6)
    for a, b in zip(g, g0):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)


def test_an_in_strategy_of_another_structure_than_its_argument_is_an_error():
    x = Tensor(np.ones((8, 4), np.float32))
    f = fs.shard(lambda p: p["a"] * 2.0, in_strategy=(((8, 1), (8, 1)),), mesh=8)
    with pytest.raises(fs.ShardingError, match=r"(?s)in_strategy\[0\] = \(\(8, 1\), \(8, 1\)\) "
                       r"does not match the structure of argument 0.*Fix: give one strategy "
                       r"per array \(a pytree prefix of the argument\), or None"):
        f({"a": x})
