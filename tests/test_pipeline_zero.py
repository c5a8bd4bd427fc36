"""ZeRO (``hsdp``) inside pipeline stages on a virtual mesh of 8 devices = 2 stages x 4
data-parallel: every level trains to the numbers of the unpipelined run without ZeRO
(each stage updating its own state over its 4 devices), ``memory_report`` gives each
stage's state split over its 4 devices, and the combinations that stay refused say
why and the fix."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import fshard as fs
from fshard.training.parallel import pipeline as pipeline_mod

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # tests/ is not a package
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_mlp  # noqa: E402

STEPS = 3
N, S = 8, 2  # 2 stages of 4 devices


def _data():
    return pipeline_mlp.data(32, STEPS)


_loss = pipeline_mlp.loss


def _train(ap, params, batches):
    state = ap.init(params)
    losses = []
    for x, y in batches:
        state, l = ap(state, x, y)
        losses.append(float(l.asnumpy()))
    return state, np.array(losses), {k: v.asnumpy() for k, v in state.params.items()}


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(want))))


def _optimizer():
    # a global-norm clip couples every parameter of both stages: exact only if the
    # sharded update sees the whole gradient (max_norm low enough to clip)
    return fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adam(1e-2))


@pytest.fixture(scope="module")
def reference():
    params, batches = _data()
    ap = fs.AutoParallel(_loss, _optimizer(), mesh=N)
    return _train(ap, params, batches)


def _zero_ap(level, **hsdp):
    ap = fs.AutoParallel(_loss, _optimizer(), mesh=N)
    ap.hsdp(threshold=hsdp.pop("threshold", 0), optimizer_level=level, **hsdp)
    return ap.pipeline(stages=S, micro_batches=4)


@pytest.mark.parametrize("level", [pytest.param("level1", marks=pytest.mark.full), "level2",
                                   pytest.param("level3", marks=pytest.mark.full)])
def test_zero_inside_stages_trains_as_unpipelined(level, reference):
    params, batches = _data()
    ap = _zero_ap(level)
    state, losses, trained = _train(ap, params, batches)
    # each stage updates its own state over its 4 devices; the clip's norm combines
    # the stages' largest magnitudes and sums of squares
    split = next(iter(ap._pipeline._steps.values())).split
    assert isinstance(split, pipeline_mod.StageUpdate) and split.zero is not None
    assert [r.prim.name for _, r in split.reductions] == ["maximum", "add"]
    _, ref_losses, ref_params = reference
    _close(losses, ref_losses)
    for k in ref_params:
        _close(trained[k], ref_params[k])


@pytest.mark.full  # ~10-20 s: a configuration of its own compiled
def test_zero_inside_stages_run_as_pieces(monkeypatch, reference):
    """A step too large to compile whole runs its pieces, the sharded finish too."""
    monkeypatch.setattr(pipeline_mod, "FUSE_LIMIT", 0)
    params, batches = _data()
    _, losses, trained = _train(_zero_ap("level2"), params, batches)
    _close(losses, reference[1])
    for k in trained:
        _close(trained[k], reference[2][k])


def _stage_bytes(params, frac_p, frac_g, frac_o):
    """Per stage (w1, b1 in stage 0; w2, b2 in stage 1): bytes per device with each kind
    divided by its fraction; Adam's two moments copy the parameters."""
    out = []
    for names in (("w1", "b1"), ("w2", "b2")):
        b = sum(params[k].nbytes for k in names)
        out.append({"params": b // frac_p, "grads": b // frac_g,
                    "optimizer_state": 2 * b // frac_o})
    return out


@pytest.mark.parametrize("level, fracs", [(None, (1, 1, 1)), ("level1", (1, 1, 4)),
                                          ("level2", (1, 4, 4)), ("level3", (4, 4, 4))])
def test_memory_report_splits_each_stage_over_its_devices(level, fracs):
    params, batches = _data()
    if level is None:
        ap = fs.AutoParallel(_loss, fs.optim.adam(1e-2), mesh=N).pipeline(stages=S,
                                                                          micro_batches=4)
    else:
        ap = fs.AutoParallel(_loss, fs.optim.adam(1e-2), mesh=N).hsdp(
            threshold=0, optimizer_level=level).pipeline(stages=S, micro_batches=4)
    state = ap.init(params)
    report = ap.memory_report(state, *batches[0])
    assert report["stages"] == _stage_bytes(params, *fracs)
    # Adam splits by stage: a device keeps its own stage's state (stage 0's, w1 and b1,
    # the larger), split over the stage's 4 devices as the level says, and the step
    # count (an int32 scalar, whole on every device)
    assert report["update"] == "per_stage"
    own = params["w1"].nbytes + params["b1"].nbytes
    assert (report["params"], report["grads"], report["optimizer_state"]) == (
        own // fracs[0], own // fracs[1], 2 * own // fracs[2] + 4)


def test_zero_threshold_and_shard_size_inside_stages():
    params, batches = _data()
    # threshold: w1 and w2 (8 KB) split, the biases (256 B and 128 B) stay whole
    ap = fs.AutoParallel(_loss, fs.optim.adam(1e-2), mesh=N).hsdp(threshold=1)
    ap.pipeline(stages=S, micro_batches=4)
    report = ap.memory_report(ap.init(params), *batches[0])
    assert report["stages"][0]["optimizer_state"] == 2 * (params["w1"].nbytes // 4
                                                          + params["b1"].nbytes)
    # shard_size=2: groups of 2 of a stage's 4 devices
    ap = fs.AutoParallel(_loss, fs.optim.adam(1e-2), mesh=N).hsdp(shard_size=2, threshold=0)
    ap.pipeline(stages=S, micro_batches=4)
    report = ap.memory_report(ap.init(params), *batches[0])
    assert report["stages"][1]["optimizer_state"] == 2 * (params["w2"].nbytes
                                                          + params["b2"].nbytes) // 2
    ap = fs.AutoParallel(_loss, fs.optim.adam(1e-2), mesh=N).hsdp(shard_size=3, threshold=0)
    ap.pipeline(stages=S, micro_batches=4)
    with pytest.raises(fs.ShardingError, match=r"shard_size=3\) must divide the 4 devices "
                       r"of a pipeline stage \(8 devices / 2 stages\).*\nFix: shard_size "
                       r"one of \[1, 2, 4\]"):
        ap(ap.init(params), *batches[0])


@pytest.mark.full  # ~10-20 s: a configuration of its own compiled
def test_zero_with_operator_parallel_stages(reference):
    """parameter_plan splits w1 over 2 of a stage's 4 devices: ZeRO splits it over the
    other 2 (its data-parallel group), and the numbers stay the unpipelined ones."""
    params, batches = _data()
    ap = fs.AutoParallel(_loss, _optimizer(), mesh=N).hsdp(threshold=0)
    ap.parameter_plan({"w1": (1, 2)}).pipeline(stages=S, micro_batches=4)
    _, losses, trained = _train(ap, params, batches)
    _close(losses, reference[1])
    for k in trained:
        _close(trained[k], reference[2][k])
    report = ap.memory_report(ap.init(params), *batches[0])
    assert report["stages"][0]["optimizer_state"] == 2 * (params["w1"].nbytes // 4
                                                          + params["b1"].nbytes // 4)


def test_zero_inside_stages_in_a_job_is_refused_with_the_fix(monkeypatch):
    params, batches = _data()
    monkeypatch.setattr(pipeline_mod.PipelineRunner, "virtual", property(lambda self: False))
    ap = _zero_ap("level1")
    with pytest.raises(fs.ArgumentError, match=r"hsdp\(optimizer_level='level1'\) with "
                       r"pipeline\(stages=2\) in a multi-process job.*\nFix: drop hsdp"):
        ap._pipeline.step_for(ap.init(params), *batches[0])


def test_operator_strategy_file_with_data_parallel_stages_says_why_and_the_fix(tmp_path):
    params, batches = _data()
    ap = fs.AutoParallel(_loss, fs.optim.adam(1e-2), mesh=N).pipeline(stages=S,
                                                                      micro_batches=4)
    state = ap.init(params)
    msg = (r"save_operator_strategy_file: with pipeline\(stages=2\) each stage's programs "
           r"run data parallel.*no operator strategies.*\nFix: give parameter_plan")
    with pytest.raises(fs.ArgumentError, match=msg):
        ap.save_operator_strategy_file(str(tmp_path / "op.json"), state, *batches[0])
    ap.save_operator_strategy_file(str(tmp_path / "op.json"))  # MindSpore's form: at the step
    with pytest.raises(fs.ArgumentError, match=msg):
        ap(state, *batches[0])
    assert not (tmp_path / "op.json").exists()


def test_operator_strategy_file_has_a_section_per_stage(tmp_path):
    """Sharded stages (parameter_plan): each stage's chunks' forward and backward
    strategies over its 2 devices; with ZeRO also its update program's."""
    import json

    params, batches = _data()
    ap = fs.AutoParallel(_loss, fs.optim.adam(1e-2), mesh=4).hsdp(threshold=0)
    ap.parameter_plan({"w1": (1, 2), "w2": (2, 1)}).pipeline(stages=S, micro_batches=2)
    path = tmp_path / "op.json"
    ap.save_operator_strategy_file(str(path))  # written at the first step
    ap(ap.init(params), *batches[0])
    data = json.loads(path.read_text())
    assert data["format"] == "fshard-pipeline-operator-strategy" and data["devices"] == 4
    assert [(st["stage"], st["devices"], [c["chunk"] for c in st["chunks"]])
            for st in data["stages"]] == [(0, 2, [0]), (1, 2, [1])]
    for st, counts in ((0, [1, 2]), (1, [2, 1])):
        fwd = data["stages"][st]["chunks"][0]["forward"]
        # inputs: the stage's bias and weight (by name), its carry or batch rows
        assert fwd["inputs"][1]["strategy"] == counts
        assert any(e["primitive"] == "matmul" for e in fwd["equations"])
        assert data["stages"][st]["chunks"][0]["backward"]["equations"]
    # each stage's update (ZeRO level1) over its 2 devices: its gradients (bias,
    # weight) as the replicas' sums stacked, one replica per device of the sharded
    # stage; Adam's moments of the bias split 2 ways, of the weight in its
    # tensor-parallel blocks (parameter_plan's 2-way split leaves it a data-parallel
    # group of 1 device); the step count; the bias whole, the weight in its blocks
    assert "finish" not in data
    for st, w in ((0, [1, 2]), (1, [2, 1])):
        strategies = [i["strategy"] for i in data["stages"][st]["finish"]["inputs"]]
        assert strategies == [[1, 1], [1, 1, 1], [2], w, [2], w, [], [1], w]


def test_loading_an_operator_strategy_file_with_a_pipeline_is_refused(tmp_path):
    params, batches = _data()
    ap = fs.AutoParallel(_loss, fs.optim.adam(1e-2), mesh=N).pipeline(stages=S,
                                                                      micro_batches=4)
    ap.load_operator_strategy_file(str(tmp_path / "op.json"))
    with pytest.raises(fs.ArgumentError, match=r"cannot be combined with "
                       r"load_operator_strategy_file\(...\).*\nFix: drop one"):
        ap(ap.init(params), *batches[0])


def test_param_strategy_file_has_zero_level3_splits(tmp_path):
    params, batches = _data()
    ap = fs.AutoParallel(_loss, fs.optim.adam(1e-2), mesh=N).hsdp(
        threshold=0, optimizer_level="level3").pipeline(stages=S, micro_batches=4)
    data = ap.save_param_strategy_file(str(tmp_path / "p.json"), ap.init(params),
                                       *batches[0])
    assert data["params"] == {"w1": [4, 1], "b1": [4], "w2": [4, 1], "b2": [4]}
    assert data["stages"] == {"w1": 0, "b1": 0, "w2": 1, "b2": 1}


@pytest.mark.full  # ~10-20 s: a configuration of its own compiled
def test_frozen_parameter_with_zero_inside_stages():
    """A Cell's requires_grad=False parameter is kept, not trained, and has no optimizer
    state (the optimizer state is over the trained parameters) with ZeRO in the stages."""
    import mindspore as ms
    from mindspore import nn

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.d1, self.d2 = nn.Dense(8, 8), nn.Dense(8, 8)
            self.scale = ms.Parameter(ms.Tensor(np.arange(1, 9, dtype=np.float32)),
                                      name="scale", requires_grad=False)

        def construct(self, x, y):
            h = fs.pipeline_split(self.d1(x) * self.scale)
            return ((self.d2(h) - y) ** 2).mean()

    rng = np.random.default_rng(1)
    x, y = (rng.normal(size=(16, 8)).astype(np.float32) for _ in range(2))
    net = Net()
    piped = fs.AutoParallel(net, fs.optim.adam(0.1), mesh=4).hsdp(
        threshold=0, optimizer_level="level3").pipeline(stages=2, micro_batches=2)
    plain = fs.AutoParallel(net, fs.optim.adam(0.1), mesh=4)
    s1, s2 = piped.init(), plain.init()
    for _ in range(2):
        s1, l1 = piped(s1, x, y)
        s2, l2 = plain(s2, x, y)
    _close(l1.asnumpy(), l2.asnumpy())
    np.testing.assert_array_equal(s1.params["scale"].asnumpy(), np.arange(1, 9))
    for k in s2.params:
        _close(s1.params[k].asnumpy(), s2.params[k].asnumpy())
    report = piped.memory_report(s1, x, y)
    w = 8 * 8 * 4
    # stage 0: d1 (weight, bias) and the frozen scale, each split over 2 devices; Adam's
    # moments of d1 only
    assert report["stages"][0] == {"params": (w + 32 + 32) // 2, "grads": (w + 32 + 32) // 2,
                                   "optimizer_state": 2 * (w + 32) // 2}


def test_device_local_norms_follow_the_blocks_inside_each_stage(tmp_path):
    """At level2 each gradient's blocks are split over a stage's devices (2 x 2 here),
    stage-major: device r holds block r % 2, so devices 0 and 2 (index 0 of stages 0
    and 1) report the same norm, devices 0 and 1 different ones."""
    import json

    params, batches = _data()
    ap = fs.AutoParallel(_loss, fs.optim.sgd(1e-2), mesh=4).hsdp(
        threshold=0, optimizer_level="level2").pipeline(stages=S, micro_batches=2)
    ap.dump_local_norm(str(tmp_path)).enable_device_local_norm()
    ap(ap.init(params), *batches[0])
    (line,) = (tmp_path / "local_norm_rank0.jsonl").read_text().splitlines()
    record = json.loads(line)
    norms = {k: np.asarray(v) for k, v in record["norms"].items()}
    assert norms["w1"].shape == (2, 1)
    for r in range(4):
        want = np.sqrt(sum(float(v.reshape(-1)[r % 2]) ** 2 for v in norms.values()))
        np.testing.assert_allclose(record["device_norms"][str(r)], want, rtol=1e-6)
    assert record["device_norms"]["0"] != record["device_norms"]["1"]


@pytest.mark.full  # ~10-20 s: a configuration of its own compiled
def test_device_local_norms_of_a_stage_plan_without_zero(tmp_path):
    """parameter_plan's strategies describe a stage's 4 devices: w1 (1, 4) puts column
    block r % 4 on device r (before, the blocks were placed as over all 8 devices)."""
    import json

    params, batches = _data()
    ap = fs.AutoParallel(_loss, fs.optim.adam(1e-2), mesh=N)
    ap.parameter_plan({"w1": (1, 4), "w2": (4, 1)}).pipeline(stages=S, micro_batches=4)
    ap.dump_local_norm(str(tmp_path)).enable_device_local_norm()
    ap(ap.init(params), *batches[0])
    record = json.loads((tmp_path / "local_norm_rank0.jsonl").read_text())
    norms = {k: np.asarray(v) for k, v in record["norms"].items()}
    for r in range(N):
        want = np.sqrt(sum(float(v.reshape(-1)[r % 4 if v.size == 4 else 0]) ** 2
                           for v in norms.values()))
        np.testing.assert_allclose(record["device_norms"][str(r)], want, rtol=1e-6)


@pytest.mark.full  # ~15 s: 4 chunks compiled for two runs
def test_zero_with_interleaved_chunks():
    """Interleaved GPipe, 4 chunks on 2 stages (chunks 0, 2 on stage 0): each stage's
    two weights split over its 4 devices at level2, the numbers the unpipelined ones."""
    rng = np.random.default_rng(0)
    params = {f"w{i}": rng.normal(0, 0.2, (16, 16)).astype(np.float32) for i in range(4)}
    batches = [tuple(rng.normal(size=(32, 16)).astype(np.float32) for _ in range(2))
               for _ in range(STEPS)]

    def loss(p, x, y):
        h = x
        for i in range(4):
            h = fs.ops.tanh(h @ p[f"w{i}"])
            h = fs.pipeline_split(h) if i < 3 else h
        return ((h - y) ** 2).mean()

    _, ref_losses, ref = _train(fs.AutoParallel(loss, fs.optim.adam(1e-2), mesh=N), params,
                                batches)
    ap = fs.AutoParallel(loss, fs.optim.adam(1e-2), mesh=N).hsdp(
        threshold=0, optimizer_level="level2").pipeline(
        stages=S, micro_batches=4, interleave=True, scheduler="gpipe")
    state, losses, trained = _train(ap, params, batches)
    _close(losses, ref_losses)
    for k in ref:
        _close(trained[k], ref[k])
    w = 16 * 16 * 4
    assert ap.memory_report(state, *batches[0])["stages"] == [
        {"params": 2 * w, "grads": 2 * w // 4, "optimizer_state": 2 * 2 * w // 4}] * 2
