"""A seed script run as its MindSpore user wrote it: the training layer's wrong answers.

- a loss Cell that captures constants while traced (``nn.CrossEntropyLoss`` in
  ``nn.WithLossCell``) gets the right parameter strategies, state strategies and
  memory report;
- MindSpore's auto-parallel context (``ms.set_auto_parallel_context``) takes effect
  or is refused by name;
- MindSpore's ``Pipeline`` wrapper is honoured or refused, never 4x;
- ``semi_auto`` runs unannotated operators data parallel over the batch split;
- a frozen Parameter (``requires_grad=False``) is not trained;
- a pipelined loss written as ``sum / global_batch`` gives the unpipelined numbers.
"""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs


def close(got, want, rtol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


class MLP(nn.Cell):
    def __init__(self, d_in=64, hidden=16, d_out=10):
        super().__init__()
        self.layer1 = nn.Dense(d_in, hidden)
        self.layer2 = nn.Dense(hidden, d_out)

    def construct(self, x):
        return self.layer2(ms.ops.relu(self.layer1(x)))


class XentLoss(nn.Cell):
    """The same loss as ``nn.CrossEntropyLoss`` written with fs.ops (no constants)."""

    def __init__(self, net):
        super().__init__()
        self._backbone = net

    def construct(self, x, y):
        return fs.ops.softmax_cross_entropy(self._backbone(x), y).mean()


def digits_batch(rows=16, d_in=64, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, d_in)).astype(np.float32),
            rng.integers(0, 10, rows).astype(np.int32))


# ---------------------------------------------------------------------------
# A loss whose tracing captures constants
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def xent_pair():
    """The same MLP under nn.CrossEntropyLoss (which captures constants when traced)
    and under fs.ops.softmax_cross_entropy, on a mesh of 2 with ZeRO level1."""
    ms.set_seed(0)
    net = MLP()
    with_consts = fs.AutoParallel(nn.WithLossCell(net, nn.CrossEntropyLoss()),
                                  fs.optim.adam(1e-2), mesh=2).hsdp(threshold=0)
    plain = fs.AutoParallel(XentLoss(net), fs.optim.adam(1e-2), mesh=2).hsdp(threshold=0)
    return with_consts, plain, digits_batch()


def test_loss_cell_with_constants_reports_true_parameter_strategies(xent_pair, tmp_path):
    with_consts, plain, (x, y) = xent_pair
    s1, s2 = with_consts.init(), plain.init()
    got = with_consts.save_param_strategy_file(tmp_path / "a.json", s1, x, y)["params"]
    want = plain.save_param_strategy_file(tmp_path / "b.json", s2, x, y)["params"]
    assert got == want
    assert got["_backbone.layer1.weight"] == [1, 1]
    assert json.loads((tmp_path / "a.json").read_text())["params"] == want


def test_loss_cell_with_constants_reports_true_state_strategies_and_memory(xent_pair):
    with_consts, plain, (x, y) = xent_pair
    s1, s2 = with_consts.init(), plain.init()
    assert with_consts.state_strategies(s1, x, y) == plain.state_strategies(s2, x, y)
    assert with_consts.state_strategies(s1, x, y).params["_backbone.layer1.weight"] == (1, 1)
    got, want = with_consts.memory_report(s1, x, y), plain.memory_report(s2, x, y)
    assert got == want
    n_params = 64 * 16 + 16 + 16 * 10 + 10
    assert got["params"] == 4 * n_params


# ---------------------------------------------------------------------------
# Frozen parameters (requires_grad=False)
# ---------------------------------------------------------------------------


class Scaled(nn.Cell):
    """A Dense layer times a frozen per-feature scale."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(4, 4)
        self.dense.weight.set_data(ms.Tensor(
            np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)))
        self.dense.bias.set_data(ms.Tensor(np.zeros(4, np.float32)))
        self.scale = ms.Parameter(ms.Tensor(np.array([1, 2, 3, 4], np.float32)),
                                  name="scale", requires_grad=False)

    def construct(self, x, y):
        return ((self.dense(x) * self.scale - y) ** 2).mean()


def frozen_batch():
    rng = np.random.default_rng(1)
    return (rng.standard_normal((8, 4)).astype(np.float32),
            rng.standard_normal((8, 4)).astype(np.float32))


def mindspore_trained(steps=3):
    """MindSpore's own training: TrainOneStepCell + nn.SGD(trainable_params())."""
    net = Scaled()
    step = nn.TrainOneStepCell(net, nn.SGD(net.trainable_params(), 0.1))
    x, y = frozen_batch()
    for _ in range(steps):
        step(ms.Tensor(x), ms.Tensor(y))
    return {k: p.asnumpy() for k, p in net.parameters_and_names()}


def test_frozen_parameter_is_not_trained_by_autoparallel_as_mindspore():
    want = mindspore_trained()
    ap = fs.AutoParallel(Scaled(), fs.optim.sgd(0.1), mesh=2)
    state = ap.init()
    x, y = frozen_batch()
    for _ in range(3):
        state, _ = ap(state, x, y)
    assert set(state.params) == set(want)
    np.testing.assert_array_equal(state.params["scale"].asnumpy(), [1, 2, 3, 4])
    for k in want:
        close(state.params[k].asnumpy(), want[k])


def test_frozen_parameter_has_no_gradient_and_no_optimizer_state():
    ap = fs.AutoParallel(Scaled(), fs.optim.adam(0.1), mesh=2)
    state = ap.init()
    assert set(state.opt_state.mu) == {"dense.weight", "dense.bias"}
    x, y = frozen_batch()
    s, _ = ap.sharded(state, x, y)
    s.partitioned(state.params, state.opt_state, state.step, x, y)
    assert len(s.grad_vars) == 2  # the two trainable parameters only
    for _ in range(2):
        state, _ = ap(state, x, y)
    np.testing.assert_array_equal(state.params["scale"].asnumpy(), [1, 2, 3, 4])


def test_frozen_parameter_with_functional_and_optim_as_mindspore():
    want = mindspore_trained()
    net = Scaled()
    apply, params = fs.functional(net)
    grads = fs.grad(apply)(params, *frozen_batch())
    np.testing.assert_array_equal(grads["scale"].asnumpy(), 0)  # as MindSpore: no gradient
    # MindSpore's trainable_params(): the frozen ones may be left out of params.
    trainable = {k: v for k, v in params.items() if v.requires_grad}
    assert set(trainable) == {"dense.weight", "dense.bias"}
    opt = fs.optim.sgd(0.1)
    state = opt.init(trainable)
    for _ in range(3):
        g = fs.grad(apply)(trainable, *frozen_batch())
        updates, state = opt.update(g, state, trainable)
        trainable = fs.optim.apply_updates(trainable, updates)
    for k in trainable:
        close(trainable[k].asnumpy(), want[k])
    np.testing.assert_array_equal(net.scale.asnumpy(), [1, 2, 3, 4])


def test_functional_still_names_missing_trainable_parameters():
    apply, params = fs.functional(Scaled())
    with pytest.raises(fs.FshardError, match=r"missing \['dense.bias'\].*requires_grad=False"):
        apply({"dense.weight": params["dense.weight"]}, *frozen_batch())


class ScaledTwoStages(nn.Cell):
    def __init__(self):
        super().__init__()
        self.d1, self.d2 = nn.Dense(4, 4), nn.Dense(4, 4)
        self.scale = ms.Parameter(ms.Tensor(np.array([1, 2, 3, 4], np.float32)),
                                  name="scale", requires_grad=False)

    def construct(self, x, y):
        h = fs.pipeline_split(self.d1(x) * self.scale)
        return ((self.d2(h) - y) ** 2).mean()


def test_frozen_parameter_is_not_trained_by_a_pipeline():
    net = ScaledTwoStages()
    x, y = frozen_batch()
    piped = fs.AutoParallel(net, fs.optim.adam(0.1), mesh=2).pipeline(stages=2)
    plain = fs.AutoParallel(net, fs.optim.adam(0.1), mesh=2)
    s1, s2 = piped.init(), plain.init()
    for _ in range(2):
        s1, l1 = piped(s1, x, y)
        s2, l2 = plain(s2, x, y)
    close(l1.asnumpy(), l2.asnumpy())
    np.testing.assert_array_equal(s1.params["scale"].asnumpy(), [1, 2, 3, 4])
    for k in s2.params:
        close(s1.params[k].asnumpy(), s2.params[k].asnumpy())


# ---------------------------------------------------------------------------
# How a pipeline combines its micro-batch losses
# ---------------------------------------------------------------------------


def two_stage_params():
    rng = np.random.default_rng(3)
    return {"w0": rng.standard_normal((4, 8)).astype(np.float32),
            "w1": rng.standard_normal((8, 1)).astype(np.float32)}


def regression_batch():
    rng = np.random.default_rng(4)
    return (rng.standard_normal((8, 4)).astype(np.float32),
            rng.standard_normal((8, 1)).astype(np.float32))


def residual(p, x, y):
    h = fs.pipeline_split(x @ p["w0"])
    return h @ p["w1"] - y


def loss_sum_over_global_batch(p, x, y):
    return (residual(p, x, y) ** 2).sum() / 8  # 8: the global batch, a constant


def loss_mean(p, x, y):
    return (residual(p, x, y) ** 2).mean()


@pytest.mark.parametrize("loss", [loss_sum_over_global_batch, loss_mean])
@pytest.mark.parametrize("mesh", [2, 4])
def test_pipelined_loss_equals_unpipelined_for_mean_and_sum_over_constant(loss, mesh):
    x, y = regression_batch()
    piped = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=mesh).pipeline(
        stages=2, micro_batches=2)
    plain = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=mesh)
    s1, s2 = piped.init(two_stage_params()), plain.init(two_stage_params())
    for _ in range(2):
        s1, l1 = piped(s1, x, y)
        s2, l2 = plain(s2, x, y)
        close(l1.asnumpy(), l2.asnumpy())
    for k in s2.params:
        close(s1.params[k].asnumpy(), s2.params[k].asnumpy())


def test_pipeline_refuses_a_loss_that_is_neither_mean_nor_sum():
    def loss(p, x, y):  # divides by the square of the batch size
        return (residual(p, x, y) ** 2).sum() / x.shape[0] ** 2

    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=2).pipeline(stages=2, micro_batches=2)
    with pytest.raises(fs.FshardError, match=r"(?s)combines the micro-batch losses by their "
                       r"mean.*or their sum.*it is neither.*Fix: write the loss as a mean"):
        ap(ap.init(two_stage_params()), *regression_batch())


def test_pipeline_refuses_a_loss_it_cannot_classify_when_zero():
    def loss(p, x, y):
        return (residual(p, x, y) * 0).sum()

    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=2).pipeline(stages=2, micro_batches=2)
    with pytest.raises(fs.FshardError, match="the loss is zero on these rows"):
        ap(ap.init(two_stage_params()), *regression_batch())


# ---------------------------------------------------------------------------
# MindSpore's auto-parallel context
# ---------------------------------------------------------------------------


@pytest.fixture
def ms_context():
    """MindSpore's global auto-parallel context, reset after the test."""
    ms.reset_auto_parallel_context()
    yield ms
    ms.reset_auto_parallel_context()


def dense(x, w):
    return x @ w


def dense_args():
    return np.arange(24, dtype=np.float32).reshape(8, 3), np.ones((3, 2), np.float32)


def strategies(sharded):
    st = sharded.strategies(*dense_args())
    return st["device_num"], st["inputs"][0]["strategy"], st["outputs"][0]["strategy"]


@pytest.mark.parametrize("setting, want", [
    ({"dataset_strategy": "data_parallel"}, [2, 1]),
    ({"full_batch": False}, [2, 1]),
    ({"dataset_strategy": "full_batch"}, [1, 1]),
    ({"full_batch": True}, [1, 1]),
    ({}, [1, 1]),  # never set: fs.shard's default, full_batch
])
def test_shard_follows_the_context_dataset_strategy(ms_context, setting, want):
    ms_context.set_auto_parallel_context(**setting)
    g = fs.shard(dense, in_strategy=(None, (1, 1)), mesh=2)
    assert strategies(g) == (2, want, want)
    x, w = dense_args()
    np.testing.assert_array_equal(g(x, w).asnumpy(), x @ w)


def test_shard_argument_wins_over_the_context(ms_context):
    ms_context.set_auto_parallel_context(dataset_strategy="data_parallel")
    g = fs.shard(dense, in_strategy=(None, (1, 1)), mesh=2, dataset_strategy="full_batch")
    assert strategies(g) == (2, [1, 1], [1, 1])


def test_shard_uses_the_context_device_num(ms_context):
    ms_context.set_auto_parallel_context(device_num=4, dataset_strategy="data_parallel")
    assert strategies(fs.shard(dense, in_strategy=(None, (1, 1)))) == (4, [4, 1], [4, 1])
    with pytest.raises(fs.ShardingError, match=r"(?s)device_num=4\) but the mesh has 2 devices"
                       r".*Fix: make them agree"):
        fs.shard(dense, in_strategy=(None, (1, 1)), mesh=2)


def test_shard_refuses_a_context_tuple_dataset_strategy(ms_context):
    ms_context.set_auto_parallel_context(dataset_strategy=((2, 1), (1, 1)))
    with pytest.raises(fs.ShardingError, match=r"(?s)dataset_strategy=\(\(2, 1\), \(1, 1\)\)\) "
                       r"gives the dataset's per-input strategies.*Fix: give the strategies "
                       "as fs.shard's in_strategy"):
        fs.shard(dense, in_strategy=(None, (1, 1)), mesh=2)


def test_shard_follows_the_context_search_mode(ms_context):
    ms_context.set_auto_parallel_context(parallel_mode="auto_parallel",
                                         search_mode="sharding_propagation")
    g = fs.shard(dense, in_strategy=((2, 1), None), mesh=2)
    assert g.search is False
    # MindSpore's partitioner (which refuses the CPU) never runs on fshard's programs
    x, w = dense_args()
    np.testing.assert_array_equal(fs.jit(g)(x, w).asnumpy(), x @ w)
    ms_context.set_auto_parallel_context(search_mode="recursive_programming")
    assert fs.shard(dense, in_strategy=(None, None), mesh=2).search is True
    ms_context.set_auto_parallel_context(search_mode="dynamic_programming")
    with pytest.raises(fs.ShardingError, match="(?s)search_mode='dynamic_programming'.*Fix"):
        fs.shard(dense, in_strategy=(None, None), mesh=2)


def mse(p, x, y):
    return ((x @ p["w"] - y) ** 2).mean()


def mse_data():
    rng = np.random.default_rng(5)
    return ({"w": rng.standard_normal((3, 1)).astype(np.float32)},
            rng.standard_normal((8, 3)).astype(np.float32),
            rng.standard_normal((8, 1)).astype(np.float32))


def batch_strategy(ap):
    p, x, y = mse_data()
    state = ap.init(p)
    part = ap.partitioned(state, x, y)
    mesh = part.prop.mesh
    return [tuple(sh.strategy(mesh)) for sh in part.in_shardings[-2:]]


def test_autoparallel_follows_the_context_dataset_strategy(ms_context):
    assert batch_strategy(fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)) == [(2, 1)] * 2
    ms_context.set_auto_parallel_context(full_batch=True)
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)
    assert batch_strategy(ap) == [(1, 1)] * 2
    ap.dataset_strategy("data_parallel")  # its own setting wins
    assert batch_strategy(ap) == [(2, 1)] * 2
    ms_context.set_auto_parallel_context(dataset_strategy=((2, 1), (1, 1)))
    assert batch_strategy(fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)) == [
        (2, 1), (1, 1)]


def test_autoparallel_uses_the_context_device_num(ms_context):
    ms_context.set_auto_parallel_context(device_num=4)
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1))
    assert ap.n_devices == 4 and batch_strategy(ap) == [(4, 1)] * 2
    with pytest.raises(fs.ShardingError, match=r"device_num=4\) but the mesh has 2"):
        fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2).n_devices


@pytest.mark.parametrize("setting, mode, ok", [
    ({"parallel_mode": "semi_auto_parallel"}, "semi_auto", True),
    ({"parallel_mode": "semi_auto_parallel"}, "sharding_propagation", False),
    ({"parallel_mode": "auto_parallel", "search_mode": "sharding_propagation"},
     "sharding_propagation", True),
    ({"parallel_mode": "auto_parallel", "search_mode": "recursive_programming"},
     "recursive_programming", True),
    ({"parallel_mode": "auto_parallel", "search_mode": "sharding_propagation"},
     "semi_auto", False),
    ({"parallel_mode": "data_parallel"}, "semi_auto", True),
    ({"parallel_mode": "data_parallel"}, "recursive_programming", False),
    ({"parallel_mode": "hybrid_parallel"}, "semi_auto", False),
])
def test_autoparallel_checks_the_context_parallel_mode(ms_context, setting, mode, ok):
    ms_context.set_auto_parallel_context(**setting)
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), mode, mesh=2)
    p, x, y = mse_data()
    if ok:
        ap(ap.init(p), x, y)
    else:
        with pytest.raises(fs.ArgumentError, match=r"(?s)ms.set_auto_parallel_context\(parallel_"
                           r"mode='[a-z_]+'.*Fix"):
            ap(ap.init(p), x, y)


def test_autoparallel_accepts_context_gradients_mean(ms_context):
    # MindSpore's gradients_mean=True gives the full batch's mean gradient: fshard's
    p, x, y = mse_data()
    plain = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)
    s1, l1 = plain(plain.init(p), x, y)
    ms_context.set_auto_parallel_context(gradients_mean=True)
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)
    s2, l2 = ap(ap.init(p), x, y)
    close(s2.params["w"].asnumpy(), s1.params["w"].asnumpy())


# ---------------------------------------------------------------------------
# MindSpore's Pipeline wrapper
# ---------------------------------------------------------------------------


class SeedNetwork(nn.Cell):
    """Seed 001's pipeline network, smaller."""

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.layer1 = nn.Dense(64, 32)
        self.relu1 = nn.ReLU()
        self.layer2 = nn.Dense(32, 32)
        self.relu2 = nn.ReLU()
        self.layer3 = nn.Dense(32, 10)

    def construct(self, x):
        x = self.relu1(self.layer1(self.flatten(x)))
        return self.layer3(self.relu2(self.layer2(x)))


STAGE_CONFIG = {"_backbone.flatten": 0, "_backbone.layer1": 0, "_backbone.relu1": 0,
                "_backbone.layer2": 1, "_backbone.relu2": 1, "_backbone.layer3": 1}


def test_mindspore_pipeline_wrapper_trains_like_the_unpipelined_network():
    from mindspore.parallel.nn import Pipeline

    ms.set_seed(2)
    net = SeedNetwork()
    x, y = digits_batch(rows=16)
    plain = fs.AutoParallel(nn.WithLossCell(net, nn.CrossEntropyLoss()), fs.optim.sgd(0.1),
                            mesh=2)
    s2 = plain.init()
    piped = fs.AutoParallel(
        Pipeline(nn.WithLossCell(net, nn.CrossEntropyLoss()), 4, stage_config=STAGE_CONFIG),
        fs.optim.sgd(0.1), "semi_auto", mesh=2)
    piped.pipeline(stages=2)
    assert piped._pipeline.cfg.micro_batches == 4  # micro_size
    s1 = piped.init()
    assert set(s1.params) == set(s2.params)
    for _ in range(2):
        s1, l1 = piped(s1, x, y)
        s2, l2 = plain(s2, x, y)
        close(l1.asnumpy(), l2.asnumpy())
    for k in s2.params:
        close(s1.params[k].asnumpy(), s2.params[k].asnumpy())
    # the stages are the stage_config's
    assert len(piped.pipeline_stage_costs()) == 2


def test_mindspore_pipeline_wrapper_micro_size_conflicts_and_segments_are_refused():
    from mindspore.parallel.nn import Pipeline

    net = nn.WithLossCell(SeedNetwork(), nn.CrossEntropyLoss())
    ap = fs.AutoParallel(Pipeline(net, 4, stage_config=STAGE_CONFIG), fs.optim.sgd(0.1),
                         mesh=2)
    with pytest.raises(fs.ArgumentError, match=r"(?s)micro_batches=2\).*micro_size=4.*Fix"):
        ap.pipeline(stages=2, micro_batches=2)
    net = nn.WithLossCell(SeedNetwork(), nn.CrossEntropyLoss())
    with pytest.raises(fs.ArgumentError, match=r"(?s)segment_config.*Fix: drop segment_config"):
        fs.AutoParallel(Pipeline(net, 4, stage_config=STAGE_CONFIG,
                                 segment_config={"_backbone.layer1": 1}), fs.optim.sgd(0.1))


# ---------------------------------------------------------------------------
# semi_auto: operators without a strategy run data parallel over the batch split
# ---------------------------------------------------------------------------


def mlp_params():
    rng = np.random.default_rng(6)
    return {"w1": rng.standard_normal((64, 32)).astype(np.float32) / 8,
            "b1": np.zeros(32, np.float32),
            "w2": rng.standard_normal((32, 10)).astype(np.float32) / 8,
            "b2": np.zeros(10, np.float32)}


def mlp_loss(p, x, y):
    h = fs.ops.relu(x @ p["w1"] + p["b1"])
    return fs.ops.softmax_cross_entropy(h @ p["w2"] + p["b2"], y).mean()


@pytest.fixture(scope="module")
def one_device_step():
    x, y = digits_batch(rows=64)
    ap = fs.AutoParallel(mlp_loss, fs.optim.sgd(0.1), mesh=1)
    state, loss = ap(ap.init(mlp_params()), x, y)
    return state, loss


@pytest.mark.parametrize("fused", [False, True])
def test_semi_auto_runs_unannotated_operators_data_parallel(one_device_step, fused):
    x, y = digits_batch(rows=64)
    ap = fs.AutoParallel(mlp_loss, fs.optim.sgd(0.1), "semi_auto", mesh=8)
    ap.dataset_strategy("data_parallel")
    if fused:
        ap.comm_fusion({"openstate": True, "allreduce": {"mode": "auto", "config": None}})
    state = ap.init(mlp_params())
    got = ap.partitioned(state, x, y).collectives()
    # one AllReduce per gradient and one for the loss (fused: one bucket); the batch is
    # never gathered
    assert "all_gather" not in got
    assert set(got) == {"psum"}
    assert len(got) == (1 if fused else len(mlp_params()) + 1)
    new, loss = ap(state, x, y)
    want_state, want_loss = one_device_step
    close(loss.asnumpy(), want_loss.asnumpy())
    for k in new.params:
        close(new.params[k].asnumpy(), want_state.params[k].asnumpy())


def test_context_dataset_strategy_is_the_steps_not_an_inner_shards(ms_context):
    # seed 000's context with an fs.shard inside an AutoParallel loss (MindSpore's
    # functional shard in a network): the context's dataset strategy is the step's
    ms_context.set_auto_parallel_context(dataset_strategy="data_parallel")
    inner = fs.shard(dense, in_strategy=((2, 1), (1, 1)))
    p, x, y = mse_data()

    def loss(p, x, y):
        return ((inner(x, p["w"]) - y) ** 2).mean()

    got = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=2)
    s1, l1 = got(got.init(p), x, y)
    want = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=1)
    s2, l2 = want(want.init(p), x, y)
    close(l1.asnumpy(), l2.asnumpy())
    close(s1.params["w"].asnumpy(), s2.params["w"].asnumpy())
