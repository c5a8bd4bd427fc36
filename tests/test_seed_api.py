"""The seeds' own API: MindSpore's in-place ``cell.shard(...)`` (seed 000's Net1) shards
that Cell when a transform later traces it; ``net.set_inputs(...)`` and MindSpore's
declarations (a static Tensor, a unique=False Symbol in two inputs: seed 003);
``fs.checkpoint.load(..., mesh=)``; ``fs.make_ir`` of an ``fs.AutoParallel`` step."""

from __future__ import annotations

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

import fshard as fs


class BasicBlock(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1 = nn.Dense(32, 32)
        self.gelu = nn.GELU()
        self.dense2 = nn.Dense(32, 32)

    def construct(self, x):
        return self.dense2(self.gelu(self.dense1(x)))


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.block1 = BasicBlock()
        self.block2 = BasicBlock()
        self.block3 = BasicBlock()

    def construct(self, x):
        return self.block3(self.block2(self.block1(x)))


class Net1(Net):  # seed 000, as written
    def __init__(self):
        super(Net1, self).__init__()
        self.block1.shard(in_strategy=((1, 8),),
                          parameter_plan={'self.block1.dense2.weight': (8, 1)})


@pytest.fixture(scope="module")
def net_and_x():
    ms.set_seed(0)
    return Net1(), Tensor(np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32))


def test_cell_shard_shards_the_cell_when_traced(net_and_x):
    net, x = net_and_x
    want = net(x).asnumpy()  # eagerly: MindSpore's PyNative run (its shard is ignored)
    with fs.Mesh((8,), ("d",)):
        ir = str(fs.make_ir(net)(x))
        got = fs.jit(net)(x).asnumpy()
    assert ir.count("shard_call") == 1 and "BasicBlock on 8 devices" in ir
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()))


def test_inside_an_fs_shard_the_cells_strategies_fix_its_layouts(net_and_x):
    net, x = net_and_x
    want = net(x).asnumpy()
    outer = fs.shard(net, in_strategy=((8, 1),), mesh=8)
    ir = str(fs.make_ir(outer)(x))
    assert "shard_call" not in ir  # one plan for the whole network, no nesting
    got = outer(x).asnumpy()
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()))
    # block1's input is split as its cell.shard says: (1, 8), the columns
    first = outer.strategies(x)["equations"][0]
    assert first["primitive"] == "layout_constraint" and first["in_strategy"] == [[1, 8]]


def test_a_wrong_parameter_name_is_an_error_at_once():
    block = BasicBlock()
    with pytest.raises(fs.errors.ShardingError, match="dense9"):
        block.shard(in_strategy=((8, 1),), parameter_plan={"self.dense9.weight": (8, 1)})


# -- cell.shard's parameter_plan inside fs.AutoParallel -----------------------------

def _copy(src, dst):
    """``dst`` with ``src``'s parameter values (the same structure)."""
    for (_, p), (_, q) in zip(src.parameters_and_names(), dst.parameters_and_names(),
                              strict=True):
        q.set_data(Tensor(p.asnumpy()))
    return dst


@pytest.fixture(scope="module")
def trained_net1():
    """Seed 000's Net1 in an AutoParallel step of 8 devices (semi_auto): 3 SGD steps."""
    ms.set_seed(0)
    net = Net1()
    ref = _copy(net, Net())
    rng = np.random.default_rng(2)
    x = Tensor(rng.normal(size=(16, 32)).astype(np.float32))
    y = Tensor(rng.normal(size=(16, 32)).astype(np.float32))
    ap = fs.AutoParallel(nn.WithLossCell(net, nn.MSELoss()), fs.optim.sgd(0.1), mesh=8)
    state = ap.init()
    losses = []
    for _ in range(3):
        state, loss = ap(state, x, y)
        losses.append(float(loss.asnumpy()))
    return ap, state, losses, ref, x, y


def test_cell_shard_parameter_plan_is_part_of_the_autoparallel_plan(trained_net1):
    """As in MindSpore, block1.shard(parameter_plan={'self.block1.dense2.weight':
    (8, 1)}) lays that weight out (8, 1) in the step's plan; the numbers are the
    unsharded ones."""
    ap, state, losses, ref, x, y = trained_net1
    layouts = ap.state_strategies(state, x, y).params
    assert layouts["_backbone.block1.dense2.weight"] == (8, 1)
    assert {v for k, v in layouts.items() if k != "_backbone.block1.dense2.weight"} \
        <= {(1, 1), (1,)}  # semi_auto: the others whole
    apply, params = fs.functional(nn.WithLossCell(ref, nn.MSELoss()))
    step = fs.jit(fs.value_and_grad(apply))
    want = []
    for _ in range(3):
        loss, grads = step(params, x, y)
        want.append(float(loss.asnumpy()))
        params = {k: params[k] - 0.1 * grads[k] for k in params}
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    for k, v in params.items():
        np.testing.assert_allclose(state.params[k].asnumpy(), v.asnumpy(),
                                   rtol=1e-4, atol=1e-6 * max(1.0, np.abs(v.asnumpy()).max()))


def test_cell_shard_and_step_parameter_plans_must_agree(net_and_x):
    net, _ = net_and_x
    rng = np.random.default_rng(3)
    x = Tensor(rng.normal(size=(16, 32)).astype(np.float32))
    y = Tensor(rng.normal(size=(16, 32)).astype(np.float32))
    name = "_backbone.block1.dense2.weight"
    ap = fs.AutoParallel(nn.WithLossCell(net, nn.MSELoss()), fs.optim.sgd(0.1), mesh=8)
    ap.parameter_plan({name: (1, 8)})
    with pytest.raises(fs.ArgumentError, match=(
            r"(?s)'_backbone.block1.dense2.weight' has two strategies: parameter_plan\("
            r"\{'_backbone.block1.dense2.weight': \(1, 8\)\}\) and _backbone.block1.shard"
            r"\(parameter_plan=\{'self.block1.dense2.weight': \(8, 1\)\}\).*Fix: give")):
        ap(ap.init(), x, y)
    ap.parameter_plan({name: [8, 1]})  # the same strategy given twice: one plan
    state, _ = ap(ap.init(), x, y)
    assert ap.state_strategies(state, x, y).params[name] == (8, 1)


# -- set_inputs: MindSpore's declarations -------------------------------------------

F32 = ms.float32


def _t(*shape):
    return Tensor(np.random.default_rng(1).normal(size=shape).astype(np.float32))


def test_net_set_inputs_makes_fs_jit_of_the_net_compile_once():
    net = nn.SequentialCell(nn.Dense(6, 4), nn.ReLU(), nn.Dense(4, 2))
    net.set_inputs(Tensor(shape=[ms.Symbol(divisor=2), 6], dtype=F32))  # MindSpore's call
    f = fs.jit(net)
    for b in (2, 6, 10):
        x = _t(b, 6)
        np.testing.assert_allclose(f(x).asnumpy(), net(x).asnumpy(), rtol=1e-5, atol=1e-6)
    assert (f.inner.trace_count, f.inner.compile_count) == (1, 1)


def test_a_static_tensor_declares_its_shape_and_dtype():
    f = fs.jit(lambda x: x * 2.0).set_inputs(Tensor(shape=[4, 3], dtype=F32))
    np.testing.assert_allclose(f(_t(4, 3)).asnumpy(), _t(4, 3).asnumpy() * 2, rtol=1e-6)
    with pytest.raises(fs.ShapeError, match=r"shape \(5, 3\)"):
        f(_t(5, 3))


def test_seed_003_symbol_without_unique_in_input_and_label():
    def loss(w, x, y):
        return fs.ops.softmax_cross_entropy(x @ w, y)

    s0 = ms.Symbol(divisor=8)  # unique=False, MindSpore's default, as seed 003 writes it
    step = fs.jit(fs.value_and_grad(loss)).set_inputs(
        None, Tensor(shape=[s0, 4], dtype=F32), Tensor(shape=[s0], dtype=ms.int32))
    w = _t(4, 3)
    for b in (8, 24):
        x, y = _t(b, 4), Tensor(np.arange(b, dtype=np.int32) % 3)
        got, want = step(w, x, y), fs.value_and_grad(loss)(w, x, y)
        np.testing.assert_allclose(got[0].asnumpy(), want[0].asnumpy(), rtol=1e-5)
        np.testing.assert_allclose(got[1].asnumpy(), want[1].asnumpy(), rtol=1e-5, atol=1e-6)
    assert (step.trace_count, step.compile_count) == (1, 1)
    with pytest.raises(fs.ShapeError, match=r"(?s)parameter 'y'\) has size 16 in dimension "
                                            r"0, but the same .* has size 8.*Fix"):
        step(w, _t(8, 4), Tensor(np.zeros(16, np.int32)))


def test_checkpoint_load_takes_the_mesh(tmp_path):
    state = {"w": _t(8, 4), "b": _t(4)}
    fs.checkpoint.save(str(tmp_path), state, step=1, layouts={"w": (8, 1), "b": None},
                       mesh=fs.Mesh((8,), ("d",)))
    back = fs.checkpoint.load(str(tmp_path), state, layouts={"w": (8, 1), "b": None},
                              mesh=fs.Mesh((8,), ("d",)))
    np.testing.assert_array_equal(back["w"].asnumpy(), state["w"].asnumpy())
    with pytest.raises(fs.errors.CheckpointError, match=r"(?s)mesh='eight'.*Fix"):
        fs.checkpoint.load(str(tmp_path), state, mesh="eight")


def test_make_ir_of_an_auto_parallel_step_is_its_per_device_program():
    def loss(p, x, y):
        return fs.ops.softmax_cross_entropy(x @ p["w"], y)

    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(16, 10)).astype(np.float32)}
    x = rng.normal(size=(32, 16)).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int32)
    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=4).dataset_strategy("data_parallel")
    state = ap.init(params)
    text = str(fs.make_ir(ap)(state, x, y))
    assert text == str(ap.partitioned(state, x, y))
    assert "shard_call" not in text
    assert "f32[8,16]{(4, 1)}" in text  # this device's rows of the batch, with its layout
    assert text.count("= psum[") == 2   # the loss's and the gradient's AllReduce
