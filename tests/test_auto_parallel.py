"""``fs.AutoParallel``: a sharded, compiled train step.

Every configuration trains to the same losses and parameters as one device; the plan
has the collectives data parallelism and ZeRO need (counted in the per-device
program); ``memory_report`` matches the ZeRO formulas; misuse is an fshard error.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import fshard as fs
from fshard import tree
from fshard.sharding import search

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import training as bench  # noqa: E402


class Momentum:
    """SGD with momentum, in the optimizer protocol AutoParallel takes."""

    def __init__(self, lr=0.1, momentum=0.9):
        self.lr, self.m = lr, momentum

    def init(self, params):
        return tree.map(lambda p: ms.Tensor(np.zeros(p.shape, np.float32)), params)

    def update(self, grads, state, params=None):
        state = tree.map(lambda v, g: v * self.m + g, state, grads)
        return tree.map(lambda v: v * (-self.lr), state), state


def _data(batch=32, d_in=64, hidden=32, d_out=10, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w1": (rng.standard_normal((d_in, hidden)) * 0.1).astype(np.float32),
              "b1": np.zeros((hidden,), np.float32),
              "w2": (rng.standard_normal((hidden, d_out)) * 0.1).astype(np.float32),
              "b2": np.zeros((d_out,), np.float32)}
    x = rng.standard_normal((batch, d_in)).astype(np.float32)
    y = rng.standard_normal((batch, d_out)).astype(np.float32)
    return params, x, y


def mse(p, x, y):
    h = fs.ops.relu(x @ p["w1"] + p["b1"])
    return ((h @ p["w2"] + p["b2"] - y) ** 2).mean()


def ce(p, x, labels):
    h = fs.ops.relu(x @ p["w1"] + p["b1"])
    return fs.ops.softmax_cross_entropy(h @ p["w2"] + p["b2"], labels)


def _ce_data(batch=128, d_in=784, hidden=512, d_out=10, seed=0):
    """A classifier large enough that data parallelism is the fastest plan on a few
    devices (its compute outweighs one AllReduce per gradient)."""
    rng = np.random.default_rng(seed)
    params = {"w1": (rng.standard_normal((d_in, hidden)) * 0.05).astype(np.float32),
              "b1": np.zeros((hidden,), np.float32),
              "w2": (rng.standard_normal((hidden, d_out)) * 0.05).astype(np.float32),
              "b2": np.zeros((d_out,), np.float32)}
    x = rng.standard_normal((batch, d_in)).astype(np.float32)
    return params, x, rng.integers(0, d_out, batch).astype(np.int32)


def _train(ap, params, x, y, steps=4):
    state = ap.init(params)
    losses = []
    for _ in range(steps):
        state, loss = ap(state, x, y)
        losses.append(float(loss.asnumpy()))
    return state, losses


@pytest.fixture(scope="module")
def reference():
    params, x, y = _data()
    return _train(fs.AutoParallel(mse, Momentum(), mesh=1), params, x, y)


CONFIGS = {
    "data_parallel": lambda ap: ap,
    "zero1": lambda ap: ap.hsdp(threshold=0, optimizer_level="level1"),
    "zero2": lambda ap: ap.hsdp(threshold=0, optimizer_level="level2"),
    "zero3": lambda ap: ap.hsdp(threshold=0, optimizer_level="level3"),
    "fused": lambda ap: ap.comm_fusion({"allreduce": {"mode": "auto", "config": None}}),
    "propagation": lambda ap: ap,
    "recursive": lambda ap: ap,
}
MODE_OF = {"propagation": "sharding_propagation", "recursive": "recursive_programming"}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_configuration_trains_like_one_device(reference, name):
    params, x, y = _data()
    mode = MODE_OF.get(name, "semi_auto")
    ap = CONFIGS[name](fs.AutoParallel(mse, Momentum(), parallel_mode=mode, mesh=4))
    state, losses = _train(ap, params, x, y)
    ref_state, ref_losses = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k in params:
        want = ref_state.params[k].asnumpy()
        np.testing.assert_allclose(state.params[k].asnumpy(), want, rtol=1e-5,
                                   atol=1e-6 * max(1.0, np.abs(want).max()))
    assert int(state.step.asnumpy()) == 4
    if name.startswith("zero"):
        # A device's block of a broadcast (a hyperparameter broadcast to a parameter's
        # shape, split by ZeRO) is the broadcast at the block's shape, not a slice
        # (each slice is a gather on a virtual mesh: minutes of compile for a GPT).
        program = ap.partitioned(state, x, y).program
        made = {v: eq.prim.name for eq in program.equations for v in eq.outputs}
        sliced = [made.get(eq.inputs[0]) for eq in program.equations
                  if eq.prim.name == "block_slice"]
        assert sliced and "broadcast_to" not in sliced, sliced


@pytest.mark.full  # slow; the quick run covers it elsewhere
def test_adam_state_trains_like_one_device_at_zero_level1():
    params, x, y = _data()
    ref = _train(fs.AutoParallel(mse, fs.optim.adam(1e-2), mesh=1), params, x, y)
    ap = fs.AutoParallel(mse, fs.optim.adam(1e-2), mesh=4).hsdp(threshold=0)
    state, losses = _train(ap, params, x, y)
    np.testing.assert_allclose(losses, ref[1], rtol=1e-5)
    # Adam's two moments of every splittable tensor live split over the 4 devices
    report = ap.memory_report(state, x, y)
    split = sum(_split_bytes(p, 4) for p in params.values())
    assert report["optimizer_state"] == 2 * split + 4  # + the int32 step count


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_step_is_one_allreduce_per_gradient_and_one_for_the_loss(n):
    # The MLP of benchmarks/training.py (784-512-512-10, Adam, batch 128): every
    # device computes its rows, each gradient is reduced once, no activation is
    # gathered; this is the fastest plan by the backend's measured rates.
    params, x, labels = bench.init(np.random.default_rng(0))
    ap = fs.AutoParallel(bench.loss, fs.optim.adam(1e-3), mesh=n)
    state = ap.init(params)
    got = _comms(ap, state, x, labels)
    assert sorted(got) == sorted([("psum", p.shape) for p in params.values()] + [("psum", ())])


def test_a_step_too_small_for_data_parallelism_gathers_the_batch_instead():
    # 64-32-10 on 4 devices: the compute is a fraction of one collective's fixed cost,
    # so two gathers of the batch beat five AllReduces; the objective says so, and
    # prices the data-parallel plan (``lazy_decisions``) higher. (The search plans
    # freely in "recursive_programming" mode; "semi_auto" runs data parallel as told.)
    params, x, y = _data(batch=128)
    ap = fs.AutoParallel(mse, Momentum(), "recursive_programming", mesh=4)
    state = ap.init(params)
    part = ap.partitioned(state, x, y)
    assert [c[0] for c in _comms(ap, state, x, y)] == ["all_gather", "all_gather"]
    problem = search.Problem.from_propagated(part.prop)
    ins, choice = problem.assignment(problem.lazy_decisions())
    dp = problem.evaluate(ins, choice)
    found = search.cost(part.prop)
    assert dp.collectives == len(params) + 1
    assert found.seconds() < dp.seconds()


def test_comm_fusion_buckets_the_allreduces():
    params, x, y = _ce_data()
    ap = fs.AutoParallel(ce, Momentum(), mesh=4)
    ap.comm_fusion({"allreduce": {"mode": "auto", "config": None}})
    state = ap.init(params)
    assert ap.partitioned(state, x, y).collectives() == ["psum"]  # all in one bucket
    # the explanation prices the bucket: one collective, len(params) fixed costs fewer
    e = ap.explain(state, x, y)
    assert (e.fused, e.collectives) == (len(params), 1) and e.fusion_s < 0
    assert "(comm_fusion)" in str(e)
    ap.comm_fusion({"openstate": False})
    assert ap.explain(state, x, y).fused == 0
    assert ap.partitioned(state, x, y).collectives() == ["psum"] * (len(params) + 1)
    # 32 KiB buckets, filled in program order: w1 (1.5 MiB) alone, the rest in buckets
    # of at most 32 KiB; every element reduced once
    ap.comm_fusion({"allreduce": {"mode": "size", "config": 32 / 1024}})
    psums = [eq for eq in ap.partitioned(state, x, y).program.equations
             if eq.prim.name == "psum"]
    sizes = sorted(int(np.prod(eq.inputs[0].aval.shape)) * 4 for eq in psums)
    assert 2 <= len(psums) < len(params) + 1
    assert sizes[-1] == params["w1"].nbytes and all(b <= 32768 for b in sizes[:-1])
    assert sum(sizes) == sum(p.nbytes for p in params.values()) + 4  # + the loss


def _split_bytes(x, n, threshold=0):
    x = np.asarray(x)
    if x.ndim and x.shape[0] % n == 0 and x.nbytes >= threshold:
        return x.nbytes // n
    return x.nbytes


@pytest.mark.parametrize("level", [None, "level1", "level2", "level3"])
def test_memory_report_follows_the_zero_formulas(level):
    params, x, y = _data()
    n = 4
    ap = fs.AutoParallel(mse, Momentum(), mesh=n)
    if level:
        ap.hsdp(threshold=0, optimizer_level=level)
    state = ap.init(params)
    report = ap.memory_report(state, x, y)
    whole = sum(np.asarray(p).nbytes for p in params.values())
    split = sum(_split_bytes(p, n) for p in params.values())  # b2 (10,) stays whole
    assert report["params"] == (split if level == "level3" else whole)
    assert report["optimizer_state"] == (whole if level is None else split)
    # each gradient as held once reduced: whole (AllReduce) up to level1, whose update
    # slices it; split like the optimizer state from level2 (reduce-scattered)
    assert report["grads"] == (split if level in ("level2", "level3") else whole)


MP_PLAN = {"w1": (1, 4), "b1": (4,), "w2": (4, 1)}  # b2 whole: a 2-D plan, dp 2 x mp 4


def _zero_local_bytes(params, n, shard_size):
    """Per parameter, the bytes of one device's block under hsdp: the parameter's own
    split ``P`` (MP_PLAN), its first dimension further split over its data-parallel
    group, ``n / P`` devices (``gcd(shard_size, n / P)`` with a shard_size)."""
    out = {}
    for k, p in params.items():
        base = MP_PLAN.get(k, (1,) * p.ndim)
        whole = int(np.prod(base))
        replicas = n // whole
        group = replicas if shard_size == -1 else math.gcd(shard_size, replicas)
        split = p.shape[0] % (base[0] * group) == 0
        out[k] = p.nbytes // (whole * (group if split else 1))
    return out


@pytest.mark.parametrize("shard_size,level", [(-1, "level1"),
                                              pytest.param(4, "level3", marks=pytest.mark.full)])
def test_hsdp_shards_each_parameter_over_its_data_parallel_group(shard_size, level):
    params, x, y = _data(batch=32, d_in=64, hidden=32, d_out=16)
    n = 8
    ap = fs.AutoParallel(mse, fs.optim.adam(1e-2), mesh=n).parameter_plan(MP_PLAN)
    ap.hsdp(shard_size=shard_size, threshold=0, optimizer_level=level)
    state = ap.init(params)
    local = _zero_local_bytes(params, n, shard_size)
    strategies = ap.state_strategies(state, x, y)
    own = {k: p.nbytes // int(np.prod(MP_PLAN.get(k, (1,)))) for k, p in params.items()}
    for k, p in params.items():  # per parameter: its block, and each Adam moment's
        for moments in (strategies.opt_state.mu, strategies.opt_state.nu):
            assert p.nbytes // int(np.prod(moments[k])) == local[k], k
        held = p.nbytes // int(np.prod(strategies.params[k]))
        assert held == (local[k] if level == "level3" else own[k]), k
    report = ap.memory_report(state, x, y)
    assert report["optimizer_state"] == 2 * sum(local.values()) + 4  # + the step count
    assert report["params"] == sum((local if level == "level3" else own).values())
    # w1 (1, 4) is held by 2 devices per block: its moments split over those 2
    mu = strategies.opt_state.mu
    assert mu["w1"] == (2, 4) and mu["w2"] == (8, 1) and mu["b1"] == (8,)
    assert mu["b2"] == ((8,) if shard_size == -1 else (math.gcd(shard_size, n),))
    # and trains like one device
    _, losses = _train(ap, params, x, y, steps=3)
    _, ref = _train(fs.AutoParallel(mse, fs.optim.adam(1e-2), mesh=1), params, x, y, steps=3)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


def test_threshold_keeps_small_tensors_whole():
    params, x, y = _data()
    ap = fs.AutoParallel(mse, Momentum(), mesh=4).hsdp(threshold=4, optimizer_level="level1")
    state = ap.init(params)
    report = ap.memory_report(state, x, y)
    # only w1 (8 KiB) is at least 4 KiB
    want = sum(np.asarray(p).nbytes for p in params.values()) - params["w1"].nbytes * 3 // 4
    assert report["optimizer_state"] == want


def test_a_cell_with_a_loss_trains_and_keeps_its_parameter_names():
    from mindspore import nn

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(8, 4)

        def construct(self, x, y):
            return ((self.dense(x) - y) ** 2).mean()

    net = Net()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    y = rng.standard_normal((8, 4)).astype(np.float32)
    ap = fs.AutoParallel(net, Momentum(), mesh=2)
    state = ap.init()
    assert sorted(state.params) == ["dense.bias", "dense.weight"]
    state, l1 = ap(state, x, y)
    state, l2 = ap(state, x, y)
    assert float(l2.asnumpy()) < float(l1.asnumpy())


def test_param_strategy_file_round_trip(tmp_path):
    params, x, y = _data()
    ap = fs.AutoParallel(mse, Momentum(), mesh=4).parameter_plan({"w1": (1, 4)})
    state = ap.init(params)
    data = ap.save_param_strategy_file(tmp_path / "p.json", state, x, y)
    assert data["params"]["w1"] == [1, 4] and data["params"]["b2"] == [1]
    ap2 = fs.AutoParallel(mse, Momentum(), mesh=4).load_param_strategy_file(tmp_path / "p.json")
    part = ap2.partitioned(ap2.init(params), x, y)
    assert part.in_shardings[0] == ap.partitioned(state, x, y).in_shardings[0]
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(fs.ArgumentError, match="not a readable JSON strategy file"):
        fs.AutoParallel(mse, Momentum(), mesh=4).load_param_strategy_file(tmp_path / "bad.json")


@pytest.mark.parametrize("call, match", [
    (lambda ap: ap.dump_local_norm(3), "directory path"),
    (lambda ap: ap.hsdp(optimizer_level="level4"), "optimizer_level"),
    (lambda ap: ap.hsdp(threshold=-1), "threshold"),
    (lambda ap: ap.comm_fusion({"allreduce": {"mode": "index", "config": [2, 1]}}),
     "increasing"),
    (lambda ap: ap.comm_fusion({"allgather": {"mode": "auto"}}), "allgather"),
    (lambda ap: ap.comm_fusion({"reducescatter": {"mode": "size", "config": -1}}),
     r"reducescatter mode 'size' needs config"),
    (lambda ap: ap.comm_fusion({"allgather": {"mode": "index", "config": [2]}}),
     "allgather mode must be 'auto' or 'size'"),
    (lambda ap: ap.comm_fusion(3), "must be a dict"),
    (lambda ap: ap.dataset_strategy("model_parallel"), "data_parallel"),
    (lambda ap: ap.pipeline(stages=3), "must divide the 4 devices"),
    (lambda ap: ap.init(), "params is required"),
])
def test_misuse_is_an_fshard_error(call, match):
    ap = fs.AutoParallel(mse, Momentum(), mesh=4)
    with pytest.raises(fs.ArgumentError, match=match):
        call(ap)


def test_constructor_checks_its_arguments():
    with pytest.raises(fs.ArgumentError, match="optimizer"):
        fs.AutoParallel(mse, object())
    with pytest.raises(fs.ArgumentError, match="parallel_mode"):
        fs.AutoParallel(mse, Momentum(), parallel_mode="auto")
    with pytest.raises(fs.ArgumentError, match="network"):
        fs.AutoParallel(3, Momentum())
    params, x, y = _data(batch=30)
    ap = fs.AutoParallel(mse, Momentum(), mesh=4)
    with pytest.raises(fs.ShardingError, match="batch size divisible by 4"):
        ap(ap.init(params), x, y)


# --- the seed's remaining knobs -----------------------------------------------------


def _reduction_dtypes(ap, state, x, y):
    from fshard.primitives.collectives import psum_p

    prog = ap.partitioned(state, x, y).program
    return {str(a.aval.dtype) for eq in prog.equations if eq.prim is psum_p
            for a in eq.inputs}


def test_float16_reductions_run_in_float32_unless_gradient_fp32_sync_is_disabled():
    params, x, y = _data(batch=256, d_in=256, hidden=256)  # a plan with AllReduces
    half = {k: v.astype(np.float16) for k, v in params.items()}
    x16, y16 = x.astype(np.float16), y.astype(np.float16)
    default = fs.AutoParallel(mse, Momentum(lr=0.01), mesh=4)
    state = default.init(half)
    assert "Float16" not in _reduction_dtypes(default, state, x16, y16)
    off = fs.AutoParallel(mse, Momentum(lr=0.01), mesh=4).disable_gradient_fp32_sync()
    assert "Float16" in _reduction_dtypes(off, state, x16, y16)
    forced = fs.AutoParallel(mse, Momentum(lr=0.01), mesh=4).disable_gradient_fp32_sync()
    forced.enable_fp32_communication()
    assert "Float16" not in _reduction_dtypes(forced, state, x16, y16)
    # the float16 step still trains like one device (float16 tolerance)
    _, ref = _train(fs.AutoParallel(mse, Momentum(lr=0.01), mesh=1), half, x16, y16)
    _, got = _train(forced, half, x16, y16)
    np.testing.assert_allclose(got, ref, rtol=2e-2)


def _block_norms(g, counts):
    split = [v for d, c in zip(g.shape, counts) for v in (c, d // c)]
    return np.sqrt((g.astype(np.float64) ** 2).reshape(split).sum(
        axis=tuple(range(1, len(split), 2))))


def test_local_norms_are_the_norms_of_each_gradient_block(tmp_path, capsys):
    params, x, y = _data()
    _, grads = fs.value_and_grad(mse)(params, x, y)
    ap = fs.AutoParallel(mse, Momentum(), mesh=4).hsdp(threshold=0, optimizer_level="level2")
    ap.print_local_norm().dump_local_norm(tmp_path / "norms")
    state = ap.init(params)
    state, _ = ap(state, x, y)
    state, _ = ap(state, x, y)
    lines = [json.loads(t) for t in (tmp_path / "norms" / "local_norm_rank0.jsonl")
             .read_text().splitlines()]
    assert [d["step"] for d in lines] == [1, 2]
    first = lines[0]["norms"]
    # level2: each gradient cut along dim 0 into 4 blocks, like the optimizer state
    # (b2, of 10 rows, stays whole)
    for k, g in grads.items():
        want = _block_norms(g.asnumpy(), (4 if g.shape[0] % 4 == 0 else 1,) +
                            (1,) * (g.ndim - 1))
        np.testing.assert_allclose(np.asarray(first[k]), want, rtol=1e-5)
    printed = capsys.readouterr().out
    w = _block_norms(grads["w1"].asnumpy(), (4, 1))
    assert f"local_norm: step 1 w1 block (2, 0): {w[2, 0]:.6g}" in printed
    # data parallel (whole gradients): one norm per tensor; training is unchanged
    dp = fs.AutoParallel(mse, Momentum(), mesh=4).dump_local_norm(tmp_path / "dp")
    s2, l2 = _train(dp, params, x, y, steps=2)
    s1, l1 = _train(fs.AutoParallel(mse, Momentum(), mesh=4), params, x, y, steps=2)
    assert l1 == l2
    one = json.loads((tmp_path / "dp" / "local_norm_rank0.jsonl").read_text().splitlines()[0])
    np.testing.assert_allclose(np.asarray(one["norms"]["b2"]).reshape(()),
                               np.linalg.norm(grads["b2"].asnumpy()), rtol=1e-5)


# --- strategy files reproduce a plan in a new process ---------------------------------

_NEW_PROCESS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import fshard as fs
from test_auto_parallel import _data, mse
params, x, y = _data()
ap = fs.AutoParallel(mse, fs.optim.adam(1e-2), parallel_mode=sys.argv[3], mesh=4)
ap.hsdp(threshold=0).load_operator_strategy_file(sys.argv[2] + "/op.json")
ap.load_param_strategy_file(sys.argv[2] + "/param.json")
state = ap.init(params)
part = ap.partitioned(state, x, y)
state, loss = ap(state, x, y)
print(json.dumps({"strategies": part.strategies(), "collectives": part.collectives(),
                  "loss": float(loss.asnumpy())}))
"""


@pytest.mark.full  # slow: the full matrix (the quick run covers the feature elsewhere)
def test_strategy_files_reproduce_the_plan_in_a_new_process(tmp_path):
    import os
    import subprocess
    import sys

    # a run in semi_auto mode with a model-parallel w1; the new process plans in
    # sharding_propagation mode without that plan, so only the files can give it
    mode = "sharding_propagation"
    params, x, y = _data()
    ap = fs.AutoParallel(mse, fs.optim.adam(1e-2), mesh=4).parameter_plan({"w1": (1, 4)})
    ap.hsdp(threshold=0)
    state = ap.init(params)
    unplanned = fs.AutoParallel(mse, fs.optim.adam(1e-2), parallel_mode=mode, mesh=4)
    unplanned.hsdp(threshold=0)
    assert unplanned.partitioned(state, x, y).strategies() != \
        ap.partitioned(state, x, y).strategies()
    ap.save_operator_strategy_file(tmp_path / "op.json", state, x, y)
    ap.save_param_strategy_file(tmp_path / "param.json", state, x, y)
    part = ap.partitioned(state, x, y)
    _, loss = ap(state, x, y)
    out = subprocess.run([sys.executable, "-c", _NEW_PROCESS, os.path.dirname(__file__),
                          str(tmp_path), mode], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, GLOG_v="3"))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["strategies"] == json.loads(json.dumps(part.strategies()))
    assert got["collectives"] == part.collectives()
    assert got["loss"] == float(loss.asnumpy())


def test_a_parameter_strategy_file_of_other_parameters_is_refused(tmp_path):
    params, x, y = _data()
    ap = fs.AutoParallel(mse, Momentum(), mesh=4)
    ap.save_param_strategy_file(tmp_path / "p.json", ap.init(params), x, y)
    other = {"v" + k: v for k, v in params.items()}

    def loss(p, x, y):
        return mse({k[1:]: v for k, v in p.items()}, x, y)

    ap2 = fs.AutoParallel(loss, Momentum(), mesh=4).load_param_strategy_file(tmp_path / "p.json")
    with pytest.raises(fs.ShardingError, match=r"(?s)p\.json.*other parameters.*'vb1'"):
        ap2(ap2.init(other), x, y)
    with pytest.raises(fs.ShardingError, match="written for 4 devices"):
        fs.AutoParallel(mse, Momentum(), mesh=2).load_param_strategy_file(tmp_path / "p.json")


def _comms(ap, state, x, y):
    return [(eq.prim.name, tuple(eq.inputs[0].aval.shape))
            for eq in ap.partitioned(state, x, y).program.equations
            if eq.prim.name in ("psum", "all_gather", "psum_scatter", "all_to_all")]


def test_each_zero_level_communicates_what_zero_needs():
    # batch 128 on 4 devices; w1 (784, 512), b1 (512,), w2 (512, 10) split 4 ways along
    # dim 0, b2 (10,) stays whole
    params, x, y = _ce_data()
    slices = {("all_gather", (196, 512)), ("all_gather", (128,)), ("all_gather", (128, 10))}
    grads = [("psum", tuple(np.shape(params[k]))) for k in ("b1", "b2", "w1", "w2")]
    got = {}
    for level in (None, "level1", "level2", "level3"):
        ap = fs.AutoParallel(ce, Momentum(), mesh=4)
        if level:
            ap.hsdp(threshold=0, optimizer_level=level)
        got[level] = _comms(ap, ap.init(params), x, y)
    # data parallel: one AllReduce per gradient and one for the loss
    assert sorted(got[None]) == sorted(grads + [("psum", ())])
    whole = {("psum", tuple(np.shape(params[k]))) for k in ("b1", "w1", "w2")}
    for level in ("level1", "level2"):
        # the update runs on slices and the new parameters' slices are gathered; each
        # split gradient reaches its slice either reduced whole and sliced (on CPU, which
        # has no ReduceScatter) or computed as a slice from gathered rows of the batch,
        # whichever the backend runs faster; the loss is reduced once
        gathers = {c for c in got[level] if c[0] == "all_gather"}
        assert slices <= gathers
        assert got[level].count(("psum", ())) == 1
        assert got[level] != got[None]
    # the same collectives (on CPU a reduce-scatter is an AllReduce and a slice), but
    # level1 reduces the gradients after the backward and keeps them whole until the
    # update, level2 reduce-scatters each one in the backward where it is complete:
    # the last layer's first
    assert sorted(got["level1"]) == sorted(got["level2"])
    order = [c for c in got["level2"] if c in whole]
    assert order.index(("psum", (512, 10))) < order.index(("psum", (784, 512)))
    # level3: the parameters stay split (their new slices are not gathered) and no
    # gradient of a split parameter is reduced whole
    assert not whole & set(got["level3"])
    ap = fs.AutoParallel(ce, Momentum(), mesh=4).hsdp(threshold=0, optimizer_level="level3")
    state = ap.init(params)
    assert ap.state_strategies(state, x, y).params == {
        "w1": (4, 1), "b1": (4,), "w2": (4, 1), "b2": (1,)}


def test_carried_state_keeps_its_mesh_axes_from_step_to_step():
    """A tuple strategy says how many ways, not over which devices; a train step's
    state leaves go out on the devices they came in on (else a job gathers and cuts
    them again at every step). The 2 x 2 Adam MLP with ZeRO level1: b1 and w2 once
    came back on the other mesh axis of size 2."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_autoparallel as example

    ap = example.make(mp=2, zero="level1", mesh=4)
    state = ap.init(example.init_params())
    x, y = next(iter(example.batches(1)))
    part = ap.partitioned(state, x, y)
    n = len(tree.leaves((state.params, state.opt_state, state.step)))
    assert part.in_shardings[:n] == part.out_shardings[:n]
    split = [s for s in part.in_shardings[:n] if any(s.dims)]
    assert len(split) >= 9, split  # w1, b1, w2 and Adam's moments of them (ZeRO)


def test_comm_fusion_buckets_the_zero_all_gathers():
    # ZeRO level1 gathers the updated blocks of w1, b1 and w2 (b2 does not split): one
    # AllGather with "allgather" fusion, one per tensor with 1-byte buckets, the same
    # training either way
    params, x, y = _data()

    def make(config=None):
        ap = fs.AutoParallel(mse, Momentum(), mesh=4).hsdp(threshold=0)
        return ap if config is None else ap.comm_fusion(config)

    def gathers(ap):
        return sum(c[0] == "all_gather" for c in _comms(ap, ap.init(params), x, y))

    fused = make({"allgather": {"mode": "auto", "config": None}})
    assert gathers(make()) == 3 and gathers(fused) == 1
    assert gathers(make({"allgather": {"mode": "size", "config": 1e-6}})) == 3
    assert gathers(make({"openstate": False, "allgather": {"mode": "auto",
                                                           "config": None}})) == 3
    _, want = _train(make(), params, x, y, steps=3)
    state, got = _train(fused, params, x, y, steps=3)
    assert got == want


@pytest.mark.parametrize("mode", ["sharding_propagation",
                                  pytest.param("recursive_programming",
                                               marks=pytest.mark.full)])
def test_a_derived_parameter_keeps_its_planned_layout_from_step_to_step(mode):
    # Megatron's MLP (w1 by columns, w2 by rows) on a whole batch: the one collective
    # the step needs is the forward's AllReduce. b1 has no strategy: the plan splits it
    # like w1's columns, and the new b1 and its Adam moments leave the step in that
    # layout (the next step's), not gathered whole at the end of every step.
    params, x, y = _data(d_out=16)
    ap = fs.AutoParallel(mse, fs.optim.adam(1e-2), mode, mesh=4)
    ap.parameter_plan({"w1": (1, 4), "w2": (4, 1)}).dataset_strategy("full_batch")
    state = ap.init(params)
    part = ap.partitioned(state, x, y)
    assert sorted(part.collectives()) == ["psum"]
    n_state = len(tree.leaves((state.params, state.opt_state, state.step)))
    ins = part.in_shardings[len(part.in_shardings) - n_state - 2:][:n_state]
    assert list(part.out_shardings[:n_state]) == list(ins)
    strategies = ap.state_strategies(state, x, y)
    assert strategies.params["b1"] == (4,)
    assert strategies.opt_state.mu["b1"] == strategies.opt_state.nu["b1"] == (4,)
    _, losses = _train(ap, params, x, y, steps=2)
    ref_ap = fs.AutoParallel(mse, fs.optim.adam(1e-2), mesh=1)
    _, ref = _train(ref_ap, params, x, y, steps=2)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


def _prims(ap, state, x, y) -> list:
    return [eq.prim.name for eq in ap.partitioned(state, x, y).program.equations]


def test_a_whole_update_concatenates_small_leaves_with_the_same_bits(monkeypatch):
    # semi_auto, data parallel: every parameter and momentum is whole on every device,
    # so fs.optim's elementwise updates (SGD's momentum here) take the small leaves
    # together (one concatenation, as under fs.jit); the same parameters, bit for bit,
    # as leaf by leaf
    params, x, y = _data()

    def make():
        return fs.AutoParallel(mse, fs.optim.sgd(1e-2, momentum=0.9), mesh=4
                               ).dataset_strategy("data_parallel")

    fused = make()
    state = fused.init(params)
    prims = _prims(fused, state, x, y)
    assert prims.count("concat") == 2 and prims.count("split") == 2  # momenta, gradients
    assert prims.count("psum") == 5  # the AllReduces: one per gradient and the loss
    got, got_losses = _train(fused, params, x, y, steps=3)
    monkeypatch.setattr(fs.AutoParallel, "_all_whole", lambda *a: False)
    leafwise = make()
    assert "concat" not in _prims(leafwise, leafwise.init(params), x, y)
    want, want_losses = _train(leafwise, params, x, y, steps=3)
    assert got_losses == want_losses
    for k in params:
        np.testing.assert_array_equal(got.params[k].asnumpy(), want.params[k].asnumpy())
        np.testing.assert_array_equal(got.opt_state.momentum[k].asnumpy(),
                                      want.opt_state.momentum[k].asnumpy())


@pytest.mark.parametrize("mode,devices", [("semi_auto", 1), ("semi_auto", 4),
                                          ("sharding_propagation", 4)])
def test_adam_runs_the_fused_kernel_per_leaf_as_fs_jit(mode, devices):
    # AutoParallel's Adam runs MindSpore's fused kernel, one adam_update per leaf
    # (every plan: each leaf keeps its own layout), as fs.jit's Adam does: on one
    # device the same parameters to the bit; data parallel on 4, the AllReduce adds
    # the devices' gradients in another order (Adam's m / sqrt(v) enlarges that where a
    # gradient is tiny: one element in 2048 was 1.8e-6 off after 3 steps of lr 1e-2)
    params, x, y = _data()
    ap = fs.AutoParallel(mse, fs.optim.adam(1e-2), mode, mesh=devices).dataset_strategy(
        "data_parallel")
    prims = _prims(ap, ap.init(params), x, y)
    assert prims.count("adam_update") == len(params) and "concat" not in prims
    got, got_losses = _train(ap, params, x, y, steps=3)
    opt = fs.optim.adam(1e-2)

    @fs.jit
    def step(p, o):
        loss, g = fs.value_and_grad(mse)(p, x, y)
        u, o = opt.update(g, o, p)
        return fs.optim.apply_updates(p, u), o, loss

    p = {k: ms.Tensor(v) for k, v in params.items()}
    o, want_losses = opt.init(p), []
    for _ in range(3):
        p, o, loss = step(p, o)
        want_losses.append(float(loss.asnumpy()))
    for k in params:
        if devices == 1:
            np.testing.assert_array_equal(got.params[k].asnumpy(), p[k].asnumpy())
            np.testing.assert_array_equal(got.opt_state.nu[k].asnumpy(),
                                          o.nu[k].asnumpy())
        else:
            np.testing.assert_allclose(got.params[k].asnumpy(), p[k].asnumpy(), rtol=1e-5,
                                       atol=1e-2 * 1e-3)  # a thousandth of a step
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6 if devices > 1 else 0)


@pytest.mark.parametrize("setup", ["zero", "plan", "propagation"])
def test_an_update_of_leaves_laid_out_differently_goes_leaf_by_leaf(setup):
    # ZeRO splits the moments, a parameter plan splits w1, and the other modes plan the
    # parameters' layouts after the update is traced: no concatenation of the leaves
    params, x, y = _data()
    mode = "sharding_propagation" if setup == "propagation" else "semi_auto"
    ap = fs.AutoParallel(mse, fs.optim.adam(1e-2), mode, mesh=4)
    if setup == "zero":
        ap.hsdp(threshold=0)
    elif setup == "plan":
        ap.parameter_plan({"w1": (1, 4)})
    state = ap.init(params)
    assert "concat" not in _prims(ap, state, x, y)
    _, losses = _train(ap, params, x, y, steps=2)
    _, ref = _train(fs.AutoParallel(mse, fs.optim.adam(1e-2), mesh=1), params, x, y, steps=2)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
