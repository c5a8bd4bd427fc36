"""MindSpore's AutoParallel file knobs as seed 001 writes them: the strategy and group
files set by path alone before training (written when the step is first compiled),
the non-trainable parameters in the strategy file, and the files with a pipeline."""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs


def mse(p, x, y):
    return ((x @ p["w"] - y) ** 2).mean()


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.standard_normal((8, 2)).astype(np.float32)
    return {"w": np.zeros((4, 2), np.float32)}, x, y


class Net(nn.Cell):
    """A Dense layer and a frozen scale (requires_grad=False)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(4, 2)
        self.scale = ms.Parameter(ms.Tensor(np.ones((2,), np.float32)), name="scale",
                                  requires_grad=False)

    def construct(self, x, y):
        return (((self.dense(x) * self.scale) - y) ** 2).mean()


def test_files_set_by_path_alone_are_written_at_the_first_step(tmp_path):
    params, x, y = _data()
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=4).parameter_plan({"w": (1, 2)})
    got = (ap.save_param_strategy_file(str(tmp_path / "p.json"))
           .save_operator_strategy_file(tmp_path / "op.json")
           .set_group_ckpt_save_file(str(tmp_path / "g.ckpt")))
    assert got is ap and not list(tmp_path.iterdir())  # nothing before the step
    state = ap.init(params)
    state, _ = ap(state, x, y)
    # the same contents as the explicit form, written now
    deferred = json.loads((tmp_path / "p.json").read_text())
    assert deferred == ap.save_param_strategy_file(tmp_path / "now.json", state, x, y)
    assert deferred["params"] == {"w": [1, 2]}
    ops = json.loads((tmp_path / "op.json").read_text())
    assert ops == json.loads(json.dumps(
        ap.save_operator_strategy_file(tmp_path / "op2.json", state, x, y)))
    groups = json.loads((tmp_path / "g.ckpt").read_text())
    assert groups["format"] == "fshard-comm-groups" and groups["devices"] == 4
    assert groups["rank"] == 0
    # rank 0's groups, each a list of ranks holding 0, over the program's mesh axes
    assert groups["groups"] and all(0 in r and len(r) > 1 for r in groups["groups"].values())
    assert max(len(r) for r in groups["groups"].values()) == 4  # the loss's AllReduce
    # written once: a later step does not rewrite them
    (tmp_path / "p.json").unlink()
    ap(state, x, y)
    assert not (tmp_path / "p.json").exists()


def test_group_file_lists_each_collectives_group_of_this_rank(tmp_path):
    params, x, y = _data()
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=fs.Mesh((2, 2), ("dp", "mp")))
    ap.dataset_strategy(((2, 1), (2, 1))).parameter_plan({"w": (1, 2)})
    state = ap.init(params)
    data = ap.save_group_file(tmp_path / "g.json", state, x, y)
    assert data == json.loads((tmp_path / "g.json").read_text())
    # the plan's mesh axes m0 (dp: ranks 0 and 2 differ) and m1 (mp: 0 and 1 differ);
    # the loss's sum over both, the column-split output gathered over mp
    assert data["groups"] == {"m0-m1": [0, 1, 2, 3], "m1": [0, 1]}


@pytest.mark.parametrize("call, match", [
    (lambda ap: ap.save_param_strategy_file(3), "file path"),
    (lambda ap: ap.set_group_ckpt_save_file(None), "file path"),
    (lambda ap: ap.save_param_strategy_file("p.json", None, np.ones(2)), "needs the state"),
])
def test_file_knob_misuse_is_refused(call, match):
    with pytest.raises(fs.ArgumentError, match=match):
        call(fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2))


def test_strategy_file_lists_trainable_parameters_unless_disabled(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.standard_normal((8, 2)).astype(np.float32)
    ap = fs.AutoParallel(Net(), fs.optim.sgd(0.1), mesh=2)
    state = ap.init()
    only = ap.save_param_strategy_file(tmp_path / "t.json", state, x, y)
    assert sorted(only["params"]) == ["dense.bias", "dense.weight"]  # MindSpore's default
    ap.disable_strategy_file_only_for_trainable_params()
    every = ap.save_param_strategy_file(tmp_path / "a.json", state, x, y)
    assert sorted(every["params"]) == ["dense.bias", "dense.weight", "scale"]
    assert every["params"]["scale"] == [1]
    # both files load back into the same model and train
    for name in ("t.json", "a.json"):
        again = fs.AutoParallel(Net(), fs.optim.sgd(0.1), mesh=2)
        again.load_param_strategy_file(tmp_path / name)
        again(again.init(), x, y)


def test_files_set_by_path_alone_with_a_pipeline(tmp_path):
    def loss(p, x, y):
        h = fs.pipeline_split(x @ p["w1"])
        return ((h @ p["w2"] - y) ** 2).mean()

    rng = np.random.default_rng(2)
    params = {"w1": rng.standard_normal((4, 4)).astype(np.float32),
              "w2": rng.standard_normal((4, 2)).astype(np.float32)}
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.standard_normal((8, 2)).astype(np.float32)
    import json

    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=2).pipeline(stages=2)
    ap.set_group_ckpt_save_file(str(tmp_path / "g.ckpt"))
    ap(ap.init(params), x, y)  # the pipeline group of 2 stages x 1 device
    assert json.loads((tmp_path / "g.ckpt").read_text())["groups"] == {"pp": [0, 1]}
    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=2).pipeline(stages=2)
    ap.save_operator_strategy_file(str(tmp_path / "op.json"))
    with pytest.raises(fs.ArgumentError, match=r"save_operator_strategy_file: with "
                       r"pipeline\(stages=2\) each stage's programs run data parallel"
                       r"(.|\n)*no operator strategies(.|\n)*Fix: give parameter_plan"):
        ap(ap.init(params), x, y)


def biased(p, x, y):
    return ((x @ p["w"] + p["b"] - y) ** 2).mean()


def test_device_local_norm_is_the_norm_of_the_blocks_each_device_holds(tmp_path, capsys):
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((4, 2)).astype(np.float32),
              "b": rng.standard_normal((2,)).astype(np.float32)}
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.standard_normal((8, 2)).astype(np.float32)
    _, grads = fs.value_and_grad(biased)(params, x, y)
    grads = {k: g.asnumpy().astype(np.float64) for k, g in grads.items()}
    ap = fs.AutoParallel(biased, fs.optim.sgd(0.1), mesh=4).parameter_plan({"w": (2, 1)})
    ap.print_local_norm().dump_local_norm(tmp_path / "n").enable_device_local_norm()
    ap(ap.init(params), x, y)
    line = json.loads((tmp_path / "n" / "local_norm_rank0.jsonl").read_text())
    want = {}
    for r in range(4):  # each device's block of w (its rows) and the whole b
        rows = slice(*fs.meshes.layout.shard_slices((4, 2), (2, 1), r, 4)[0])
        want[str(r)] = np.sqrt((grads["w"][rows] ** 2).sum() + (grads["b"] ** 2).sum())
    assert sorted(line["device_norms"]) == ["0", "1", "2", "3"]
    for r, v in want.items():
        np.testing.assert_allclose(line["device_norms"][r], v, rtol=1e-5)
    assert len({round(v, 6) for v in want.values()}) == 2  # two different row blocks
    assert f"device_local_norm: step 1 device 3: {line['device_norms']['3']:.6g}" in \
        capsys.readouterr().out
    # alone it has nothing to add to: refused at the step
    alone = fs.AutoParallel(biased, fs.optim.sgd(0.1), mesh=4).enable_device_local_norm()
    with pytest.raises(fs.ArgumentError, match="neither print_local_norm"):
        alone(alone.init(params), x, y)


def test_a_file_set_by_path_survives_a_step_that_fails(tmp_path):
    params, x, y = _data()
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), mesh=2)
    ap.save_param_strategy_file(tmp_path / "p.json")
    state = ap.init(params)
    with pytest.raises(fs.errors.ShapeError, match="contraction sizes differ"):
        ap(state, x[:, :3], y)  # the wrong width: the step does not compile
    assert not (tmp_path / "p.json").exists()
    ap(state, x, y)
    assert json.loads((tmp_path / "p.json").read_text())["params"] == {"w": [1, 1]}


def _scaled(p, x):
    h = fs.pipeline_split(x * p["a"])
    return (h * p["b"]).mean()


def _pipeline_b_gradient(setup) -> float:
    """b's gradient summed over the 4 data-parallel replicas of the last stage (mesh 8,
    2 stages, 2 micro-batches: replica j runs rows 2j and 2j + 1, each contributing
    x / 8): replica sums 2047, 1, 1, 1 exactly in float16. Summed in float16 they round
    to 2048 at every partial sum; in float32 to 2050, the exact sum. SGD with lr 1 from
    b = 2 makes the new b 2 minus the gradient (exact in float16)."""
    params = {"a": np.ones((1,), np.float16), "b": np.full((1,), 2, np.float16)}
    x = (8 * np.array([2046, 1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])).astype(np.float16)
    ap = setup(fs.AutoParallel(_scaled, fs.optim.sgd(1.0), mesh=8).pipeline(stages=2))
    state, _ = ap(ap.init(params), x.reshape(8, 1))
    return 2 - float(state.params["b"].asnumpy()[0])


def test_pipeline_float16_gradient_sums_run_in_float32():
    # MindSpore's default (gradient fp32 sync), as in a step without a pipeline
    assert _pipeline_b_gradient(lambda ap: ap) == 2050.0
    assert _pipeline_b_gradient(lambda ap: ap.disable_gradient_fp32_sync()) == 2048.0
    assert _pipeline_b_gradient(
        lambda ap: ap.disable_gradient_fp32_sync().enable_fp32_communication()) == 2050.0


def test_pipeline_grad_reducer_passes_complete_gradients_through():
    # MindSpore's functional pipeline loop: grads = pp_grad_reducer(grads); fshard's
    # gradients are the whole batch's already, so it gives them back as they are
    from mindspore import nn
    from mindspore.parallel.nn import PipelineGradReducer

    net = nn.Dense(4, 2)
    opt = nn.SGD(net.trainable_params(), 1e-2)
    reducer = PipelineGradReducer(opt.parameters, opt_shard=False)
    rng = np.random.default_rng(5)
    grads = (rng.standard_normal((2, 4)).astype(np.float32),
             rng.standard_normal((2,)).astype(np.float32))
    out = fs.jit(lambda g: reducer(g))(grads)
    for a, b in zip(out, grads):
        np.testing.assert_array_equal(a.asnumpy(), b)
    with pytest.raises(fs.ArgumentError, match=r"PipelineGradReducer\(grads\).*alone"):
        fs.jit(lambda g: reducer(g, g))(grads)
