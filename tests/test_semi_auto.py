"""Strategies users write inside a step: ``Primitive.shard(...)`` on MindSpore operators
in a traced Cell, and ``fs.shard`` inside ``fs.AutoParallel``'s loss.

Under ``fs.shard`` / ``fs.AutoParallel`` the operator runs with exactly the strategy
written (checked in the per-device program and the operator strategy file), the rest
of the step is derived, and training equals one device. Outside a shard a strategy
does nothing. A strategy that cannot fit is an error naming the operator, the
strategy and the fix.
"""

from __future__ import annotations

import json
import warnings

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

import fshard as fs

B, D_IN, H, D_OUT = 16, 64, 32, 10


class Network(nn.Cell):
    """The seed's MatMul + ReLU network (with a loss), strategies optional."""

    def __init__(self, strategies=(((2, 4), (4, 1)), ((4, 1),), ((1, 8), (8, 1)), ((8, 1),))):
        super().__init__()
        rng = np.random.default_rng(0)

        def param(shape, name):
            return Parameter(Tensor((rng.standard_normal(shape) * 0.1).astype(np.float32)),
                             name=name)

        self.w1, self.w2, self.w3 = param((D_IN, H), "w1"), param((H, H), "w2"), \
            param((H, D_OUT), "w3")
        s = strategies or (None,) * 4
        self.matmul1 = ops.MatMul().shard(s[0]) if s[0] else ops.MatMul()
        self.relu1 = ops.ReLU().shard(s[1]) if s[1] else ops.ReLU()
        self.matmul2 = ops.MatMul().shard(s[2]) if s[2] else ops.MatMul()
        self.relu2 = ops.ReLU().shard(s[3]) if s[3] else ops.ReLU()
        self.matmul3 = ops.MatMul()

    def construct(self, x, y):
        h = self.relu1(self.matmul1(x, self.w1))
        h = self.relu2(self.matmul2(h, self.w2))
        return ((self.matmul3(h, self.w3) - y) ** 2).mean()


def _batch(seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, D_IN)).astype(np.float32),
            rng.standard_normal((B, D_OUT)).astype(np.float32))


def _train(ap, params=None, steps=3):
    x, y = _batch()
    state = ap.init(params) if params is not None else ap.init()
    losses = []
    for _ in range(steps):
        state, loss = ap(state, x, y)
        losses.append(float(loss.asnumpy()))
    return state, losses


@pytest.fixture(scope="module")
def one_device():
    return _train(fs.AutoParallel(Network(strategies=None), fs.optim.sgd(0.1), mesh=1))


def _equations(ap, state, prim, tmp_path):
    x, y = _batch()
    path = tmp_path / "ops.json"
    ap.save_operator_strategy_file(path, state, x, y)
    data = json.loads(path.read_text())
    return [(e["in_strategy"], e["out_strategy"]) for e in data["equations"]
            if e["primitive"] == prim], data


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
def test_primitive_shard_strategies_are_the_plan_and_train_like_one_device(
        one_device, mode, tmp_path):
    ap = fs.AutoParallel(Network(), fs.optim.sgd(0.1), parallel_mode=mode, mesh=8)
    state, losses = _train(ap)
    ref_state, ref_losses = one_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k in ("w1", "w2", "w3"):
        want = ref_state.params[k].asnumpy()
        np.testing.assert_allclose(state.params[k].asnumpy(), want, rtol=1e-5,
                                   atol=1e-6 * np.abs(want).max())
    matmuls, data = _equations(ap, state, "matmul", tmp_path)
    # The two annotated MatMuls (the first ones of the step) run exactly as written:
    # matmul1 splits rows 2 ways and the contraction 4 ways (a pending sum over 4).
    assert matmuls[0] == ([[2, 4], [4, 1]], [[2, 1]])
    assert matmuls[1] == ([[1, 8], [8, 1]], [[1, 1]])
    relus = [e for e in data["equations"] if e["primitive"] == "relu"]
    assert [r["in_strategy"] for r in relus] == [[[4, 1]], [[8, 1]]]
    assert next(e for e in data["equations"] if e["primitive"] == "matmul")[
        "partial_sum"] == [4]
    # In the per-device program matmul1 multiplies (16/2, 64/4) by (64/4, 32) blocks and
    # its pending sum is reduced over 4 devices.
    x, y = _batch()
    part = ap.partitioned(state, x, y)
    first = next(eq for eq in part.program.equations if eq.prim.name == "matmul")
    assert [tuple(a.aval.shape) for a in first.inputs] == [(B // 2, D_IN // 4), (D_IN // 4, H)]
    reduce = next(eq for eq in part.program.equations
                  if eq.prim.name == "psum" and first.outputs[0] in eq.inputs)
    assert len(reduce.params["axis_name"]) == 2  # two prime axes: 4 devices
    if mode == "semi_auto":  # parameters whole (data parallel); the operator slices them
        assert data["inputs"][1]["strategy"] == [1, 1]
    else:  # sharding_propagation derives w1's layout from matmul1's strategy
        assert ap.state_strategies(state, x, y).params["w1"] == (4, 1)


def test_recursive_programming_keeps_the_strategies_too(one_device, tmp_path):
    ap = fs.AutoParallel(Network(), fs.optim.sgd(0.1), parallel_mode="recursive_programming",
                         mesh=8)
    state, losses = _train(ap)
    np.testing.assert_allclose(losses, one_device[1], rtol=1e-5)
    matmuls, _ = _equations(ap, state, "matmul", tmp_path)
    assert matmuls[:2] == [([[2, 4], [4, 1]], [[2, 1]]), ([[1, 8], [8, 1]], [[1, 1]])]


def test_fs_shard_of_a_cell_runs_its_operator_strategies():
    net = Network()
    x, y = _batch()
    f = fs.shard(net, in_strategy=((8, 1), None), mesh=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # honoured: no OperatorStrategyWarning
        loss = f(x, y)
    ref = Network(strategies=None)(Tensor(x), Tensor(y))
    np.testing.assert_allclose(loss.asnumpy(), ref.asnumpy(), rtol=1e-5)
    eqs = f.strategies(x, y)["equations"]
    assert [e["in_strategy"] for e in eqs if e["primitive"] == "matmul"][:2] == [
        [[2, 4], [4, 1]], [[1, 8], [8, 1]]]


def test_an_out_strategy_and_a_layout_strategy_are_honoured():
    layout = ms.Layout((2, 4), ("dp", "mp"))  # MindSpore's own Layout

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
                                      / 100), name="w")
            self.matmul = ops.MatMul().shard(((2, 4), (4, 1)), out_strategy=((8, 1),))
            self.add = ops.Add().shard((layout("dp", "mp"), layout("dp", "mp")))

        def construct(self, x):
            h = self.matmul(x, self.w)
            return self.add(h, h)

    x = _batch()[0]
    f = fs.shard(Net(), in_strategy=(None,), mesh=8)
    out = f(x)
    want = 2 * x @ (np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 100)
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    eqs = f.strategies(x)["equations"]
    constraints = [e for e in eqs if e["primitive"] == "layout_constraint"]
    assert [c["in_strategy"][0] for c in constraints] == [[2, 4], [4, 1], [8, 1], [2, 4], [2, 4]]
    # the Add runs on the Layout's blocks: rows over dp (m0), columns over mp (m1 m2)
    add = next(e for e in eqs if e["primitive"] == "add")
    assert add["assignment"] == [["d0", ["m0"]], ["d1", ["m1", "m2"]]]


def test_strategies_have_no_effect_outside_a_shard():
    net = Network()
    x, y = _batch()
    ref = float(Network(strategies=None)(Tensor(x), Tensor(y)).asnumpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = fs.jit(lambda x, y: net(x, y))(x, y)
        grads = fs.grad(lambda x: net(x, y))(x)
        per_row = fs.vmap(lambda x1, y1: net(x1[None], y1[None]))(x, y)
        ir = str(fs.make_ir(lambda x, y: net(x, y))(x, y))
    np.testing.assert_allclose(float(loss.asnumpy()), ref, rtol=1e-5)
    assert grads.shape == x.shape and per_row.shape == (B,)
    assert "layout_constraint" not in ir


def test_a_strategy_inside_shard_map_is_a_warning_not_a_silent_drop():
    class Relu(nn.Cell):
        def __init__(self):
            super().__init__()
            self.relu = ops.ReLU().shard(((2, 1),))

        def construct(self, x):
            return self.relu(x)

    mesh = fs.Mesh((2,), ("dp",))
    f = fs.shard_map(Relu(), ((2, 1),), (2, 1), mesh=mesh)
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)
    with pytest.warns(fs.OperatorStrategyWarning,
                      match=r"(?s)does not apply the strategy of ReLU.shard\(\(\(2, 1\),\)\): "
                            r"inside fs.shard_map.*Fix: give layouts to fs.shard_map"):
        out = f(x)
    np.testing.assert_allclose(out.asnumpy(), np.maximum(x, 0))


def _cell(strategy):
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.ones((64, 30), np.float32)), name="w")
            self.matmul = ops.MatMul().shard(strategy)

        def construct(self, x):
            return self.matmul(x, self.w)

    return Net()


@pytest.mark.parametrize("strategy, match", [
    (((2, 4),), r"MatMul.shard\(\(\(2, 4\),\)\) at test_semi_auto.py:\d+: the strategy has 1 "
                r"entry, but MatMul was called with 2 tensor operands \(f32\[16,64\], "
                r"f32\[64,30\]\).*Fix: give 2 entries"),
    (((2, 4), (2, 1)), r"MatMul.shard\(\(\(2, 4\), \(2, 1\)\)\) at test_semi_auto.py:\d+: "
                       r"in_strategy\[0\] gives dimension 1 of operand 0 the split count 4 and "
                       r"in_strategy\[1\] gives dimension 0 of operand 1 the split count 2, "
                       r"but the operator uses these dimensions together.*Fix: give both "
                       r"dimensions the same split count"),
    (((2, 1), (4, 1)), r"MatMul.shard\(\(\(2, 1\), \(4, 1\)\)\) at test_semi_auto.py:\d+: "
                       r"in_strategy\[0\] gives dimension 1 of operand 0 the split count 1 and "
                       r"in_strategy\[1\] gives dimension 0 of operand 1 the split count 4"),
    (((4, 4), (4, 1)), r"MatMul.shard\(\(\(4, 4\), \(4, 1\)\)\) at test_semi_auto.py:\d+: "
                       r"in_strategy\[0\] = \(4, 4\) splits .* into 16 blocks"),
    (((1, 1), (1, 4)), r"MatMul.shard\(\(\(1, 1\), \(1, 4\)\)\) at test_semi_auto.py:\d+: "
                       r"in_strategy\[1\] = \(1, 4\) splits dimension 1 \(size 30\) of operand "
                       r"1 \(f32\[64,30\]\) into 4 parts.*Fix: split it into"),
    (((8,), (1, 1)), r"MatMul.shard\(\(\(8,\), \(1, 1\)\)\) at test_semi_auto.py:\d+: "
                     r"in_strategy\[0\] = \(8,\) has 1 entry, but operand 0 \(f32\[16,64\]\) has "
                     r"rank 2.*Fix: give 2 split counts"),
])
def test_an_invalid_operator_strategy_is_an_error_naming_it(strategy, match):
    x = np.ones((B, D_IN), np.float32)
    with pytest.raises(fs.ShardingError, match=f"(?s){match}"):
        fs.shard(_cell(strategy), in_strategy=(None,), mesh=8)(x)


# -- fs.shard inside AutoParallel's loss ------------------------------------------------


def _params():
    rng = np.random.default_rng(0)
    return {"w1": (rng.standard_normal((D_IN, H)) * 0.1).astype(np.float32),
            "w2": (rng.standard_normal((H, D_OUT)) * 0.1).astype(np.float32)}


def _layer(x, w):
    return fs.ops.relu(x @ w)


def _loss(inner):
    def loss(p, x, y):
        return ((inner(x, p["w1"]) @ p["w2"] - y) ** 2).mean()

    return loss


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
def test_fs_shard_inside_the_loss_fixes_layouts_and_trains_like_one_device(mode, tmp_path):
    inner = fs.shard(_layer, in_strategy=((2, 4), (4, 1)), out_strategy=((8, 1),))
    ref = _train(fs.AutoParallel(_loss(_layer), fs.optim.sgd(0.1), mesh=1), _params())
    ap = fs.AutoParallel(_loss(inner), fs.optim.sgd(0.1), parallel_mode=mode, mesh=8)
    state, losses = _train(ap, _params())
    np.testing.assert_allclose(losses, ref[1], rtol=1e-5)
    np.testing.assert_allclose(state.params["w1"].asnumpy(), ref[0].params["w1"].asnumpy(),
                               rtol=1e-5, atol=1e-7)
    _, data = _equations(ap, state, "matmul", tmp_path)
    eqs = data["equations"]
    constraints = [e["in_strategy"][0] for e in eqs if e["primitive"] == "layout_constraint"]
    assert constraints[:3] == [[2, 4], [4, 1], [8, 1]]  # x, w1 and the result
    # x @ w1 consumes both arguments where they are: its contraction is split over the
    # same 4 devices in both.
    first = next(e for e in eqs if e["primitive"] == "matmul")
    assert first["in_strategy"] == [[2, 4], [4, 1]]


def test_fs_shard_still_refuses_to_nest_outside_autoparallel():
    inner = fs.shard(_layer, in_strategy=((2, 4), (4, 1)))
    x, w = _batch()[0], _params()["w1"]
    with pytest.raises(fs.CompositionError, match=r"(?s)nested inside another fs.shard.*"
                                                  r"or train with fs.AutoParallel"):
        fs.shard(lambda x, w: inner(x, w) * 2.0, in_strategy=(None, None), mesh=8)(x, w)


@pytest.mark.parametrize("make, match", [
    (lambda: fs.shard(_layer, in_strategy=((2, 4),)),
     r"in_strategy has 1 entry but _layer was called with 2 positional arguments"),
    (lambda: fs.shard(_layer, in_strategy=((2, 4), None), mesh=4),
     r"its mesh has 4 devices but the AutoParallel step runs on 8"),
    (lambda: fs.shard(_layer, in_strategy=((2, 4), None), dataset_strategy="data_parallel"),
     r"it has dataset_strategy='data_parallel'.*Fix: give it to "
     r"AutoParallel.dataset_strategy"),
    (lambda: fs.shard(_layer, in_strategy=((16, 1), None)),
     r"in_strategy\[0\] = \(16, 1\) splits .* into 16 blocks"),
    (lambda: fs.shard(_layer, in_strategy=((2, 4), {"w": (4, 1)})),
     r"in_strategy\[1\] = \{'w': \(4, 1\)\} does not match the structure of argument 1"
     r".*Fix: give one strategy per array"),
])
def test_a_misused_fs_shard_inside_the_loss_is_an_error(make, match):
    ap = fs.AutoParallel(_loss(make()), fs.optim.sgd(0.1), mesh=8)
    state = ap.init(_params())
    with pytest.raises(fs.ShardingError, match=f"(?s){match}"):
        ap(state, *_batch())


def test_a_strategy_in_a_pipelined_step_is_a_warning_not_a_silent_drop():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Dense(D_IN, H)
            self.relu = ops.ReLU().shard(((2, 1),))
            self.layer2 = nn.Dense(H, D_OUT)

        def construct(self, x, y):
            return ((self.layer2(self.relu(self.layer1(x))) - y) ** 2).mean()

    net = Net()
    net.layer1.pipeline_stage, net.layer2.pipeline_stage = 0, 1
    ap = fs.AutoParallel(net, fs.optim.sgd(0.1), mesh=2).pipeline(stages=2, micro_batches=2)
    state = ap.init()
    with pytest.warns(fs.OperatorStrategyWarning,
                      match=r"(?s)does not apply the strategy of ReLU.shard\(\(\(2, 1\),\)\): "
                            r"with AutoParallel.pipeline\(...\) each stage here has one "
                            r"device.*Fix: give the stages several devices"):
        ap(state, *_batch())


def test_the_operator_strategy_file_of_a_run_reproduces_its_plan(one_device, tmp_path):
    ap = fs.AutoParallel(Network(), fs.optim.sgd(0.1), mesh=8)
    state = ap.init()
    x, y = _batch()
    saved = ap.save_operator_strategy_file(tmp_path / "ops.json", state, x, y)
    again = fs.AutoParallel(Network(), fs.optim.sgd(0.1), parallel_mode="sharding_propagation",
                            mesh=8).load_operator_strategy_file(tmp_path / "ops.json")
    state2, losses = _train(again)
    np.testing.assert_allclose(losses, one_device[1], rtol=1e-5)
    got = again.save_operator_strategy_file(tmp_path / "again.json", state2, x, y)
    assert got["equations"] == saved["equations"]


def test_an_interleaved_layout_is_a_warning_not_a_silent_drop():
    lay = ms.Layout((2, 4, 2), ("dp", "mp", "interleaved_parallel"))
    relu = ops.ReLU().shard((lay("dp", ("mp", "interleaved_parallel")),))
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    with pytest.warns(fs.OperatorStrategyWarning,
                      match=r"(?s)does not apply the strategy of ReLU.shard\(in_layout=.*"
                            r"interleaved_parallel \(Ascend's micro-interleaving"):
        out = fs.shard(lambda x: relu(x), in_strategy=(None,), mesh=8)(x)
    np.testing.assert_array_equal(out.asnumpy(), np.maximum(x, 0))


def test_under_vmap_inside_a_shard_the_batch_dimension_stays_whole():
    matmul = ops.MatMul().shard(((2, 4), (4, 1)))
    f = fs.shard(fs.vmap(lambda a, b: matmul(a, b), in_axes=(0, None)),
                 in_strategy=(None, None), mesh=8)
    xs = np.random.default_rng(5).random((3, 4, 8)).astype(np.float32)
    w = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    np.testing.assert_allclose(f(xs, w).asnumpy(), xs @ w, rtol=1e-5, atol=1e-6)
    eqs = f.strategies(xs, w)["equations"]
    assert [e["in_strategy"][0] for e in eqs if e["primitive"] == "layout_constraint"] == [
        [1, 2, 4], [4, 1]]
