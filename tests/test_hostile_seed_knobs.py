"""Every MindSpore setting the four seeds call, not covered elsewhere, as a hostile user
calls it: each acts as in MindSpore or raises an fshard error naming it.

(``tests/test_seed_knobs.py`` covers the strategy and group files and the local norms;
``tests/test_hostile_seeds.py`` and ``tests/test_auto_parallel_options.py`` the
auto-parallel context.)
"""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs


def _data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((8, 4)).astype(np.float32),
            rng.standard_normal((8, 2)).astype(np.float32))


def mse(p, x, y):
    return ((x @ p["w"] - y) ** 2).mean()


def _train(ap, params, steps=2):
    x, y = _data()
    state = ap.init(params)
    losses = []
    for _ in range(steps):
        state, loss = ap(state, x, y)
        losses.append(float(loss.asnumpy()))
    return state, losses


W = {"w": np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)}


@pytest.fixture(scope="module")
def reference():
    return _train(fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2), W)[1]


def test_file_methods_take_mindspores_keyword_file_path(tmp_path, reference):
    # seed 001: parallel_net.load_param_strategy_file(file_path="./train_strategy.ckpt")
    x, y = _data()
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2).parameter_plan({"w": (2, 1)})
    ap.save_param_strategy_file(file_path=str(tmp_path / "p.json"))
    ap.save_operator_strategy_file(file_path=str(tmp_path / "op.json"))
    ap.set_group_ckpt_save_file(file_path=str(tmp_path / "g.json"))
    _train(ap, W, steps=1)
    norms = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)
    _train(norms.dump_local_norm(file_path=str(tmp_path / "norms")), W, steps=1)
    assert (tmp_path / "norms" / "local_norm_rank0.jsonl").exists()
    assert json.loads((tmp_path / "g.json").read_text())["devices"] == 2
    again = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)
    again.load_param_strategy_file(file_path=str(tmp_path / "p.json"))
    again.load_operator_strategy_file(file_path=str(tmp_path / "op.json"))
    state, losses = _train(again, W)
    assert again.state_strategies(state, x, y).params == {"w": (2, 1)}
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


def test_no_init_parameters_in_compile_trains_as_without_it():
    from mindspore.nn.utils import no_init_parameters

    x, y = _data()

    def make():
        ms.set_seed(3)
        with no_init_parameters():  # seed 001's lazily initialised network
            net = nn.Dense(4, 2)
        return nn.WithLossCell(net, nn.MSELoss())

    losses = []
    for knob in (False, True):
        ap = fs.AutoParallel(make(), fs.optim.sgd(0.1), mesh=2)
        if knob:
            assert ap.no_init_parameters_in_compile() is ap
        state = ap.init()
        for _ in range(2):
            state, loss = ap(state, x, y)
        losses.append(float(loss.asnumpy()))
    assert losses[0] == losses[1]


@pytest.mark.parametrize("config, match", [
    ({"grad_matmul_communication_overlap": True, "enable_communication_fusion": False},
     r"turns on \['grad_matmul_communication_overlap'\], which fshard does not implement"),
    ({"computation_communication_fusion_level": 2},
     r"turns on \['computation_communication_fusion_level'\]"),
    ({"grad_overlap": True}, r"names unknown options \['grad_overlap'\]"),
    ([1, 2], "holds a JSON list, not an object"),
])
def test_transformer_opt_with_options_on_is_refused_by_name(tmp_path, config, match):
    path = tmp_path / "parallel_speed_up.json"
    path.write_text(json.dumps(config))
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)
    with pytest.raises(fs.ArgumentError, match=r"transformer_opt\(file_path\): .*" + match):
        ap.transformer_opt(str(path))


def test_transformer_opt_off_is_accepted(tmp_path, reference):
    path = tmp_path / "parallel_speed_up.json"
    path.write_text(json.dumps({"grad_matmul_communication_overlap": False,
                                "dataset_broadcast_opt_level": 0}))
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)
    assert ap.transformer_opt(None) is ap and ap.transformer_opt("") is ap
    assert ap.transformer_opt(str(path)) is ap
    np.testing.assert_allclose(_train(ap, W)[1], reference, rtol=1e-5)
    with pytest.raises(fs.ArgumentError, match=r"cannot read '.*missing.json' as JSON"):
        ap.transformer_opt(str(tmp_path / "missing.json"))
    with pytest.raises(fs.ArgumentError, match=r"file_path must be the path of a JSON "
                                               r"file \(str\), None or ''; got int 3"):
        ap.transformer_opt(3)


@pytest.mark.parametrize("config, match", [
    ({"allreduce": {"mode": "index", "config": [20, 20]}}, r"allreduce mode 'index' needs "
                                                            r"config = a non-empty list of "
                                                            r"increasing"),
    ({"allgather": {"mode": "index", "config": [1]}}, r"allgather mode .* got 'index'"),
    ({"reducescatter": {"mode": "index", "config": [1]}}, r"reducescatter mode .* got "
                                                           r"'index'"),
    ({"openstate": "yes"}, "'openstate' must be a bool"),
])
def test_comm_fusion_modes_mindspore_refuses_are_refused_by_name(config, match):
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)
    with pytest.raises(fs.ArgumentError, match=r"comm_fusion\(config\): .*" + match):
        ap.comm_fusion(config)


def test_gradients_mean_and_loss_repeated_mean_give_the_batch_mean_gradient(reference):
    # seed 001's two calls: MindSpore's averaged per-device gradients of a mean loss are
    # the whole batch's mean gradient, fshard's gradients in any case
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)
    assert ap.enable_gradients_mean() is ap and ap.disable_loss_repeated_mean() is ap
    np.testing.assert_allclose(_train(ap, W)[1], reference, rtol=1e-5)
    x, y = _data()  # and the reference is the unsharded mean gradient's step
    loss, grads = fs.value_and_grad(mse)(W, x, y)
    w1 = W["w"] - 0.1 * grads["w"].asnumpy()
    np.testing.assert_allclose(reference[1], float(mse({"w": w1}, x, y)), rtol=1e-5)


def test_set_context_save_graphs_dumps_fshards_compiled_programs(tmp_path):
    # seed 001: ms.set_context(save_graphs=2) acts on the graphs MindSpore compiles,
    # fshard's programs among them
    ms.set_context(save_graphs=2, save_graphs_path=str(tmp_path))
    try:
        fs.jit(lambda v: v * 3.0 + 1.0)(np.ones(3, np.float32))
    finally:
        ms.set_context(save_graphs=0)
    assert list(tmp_path.rglob("*.ir"))
