"""fs.sharding.calibrate: the measured rates, their cache on disk, and the planner and
explain pricing with them (conftest points FSHARD_CACHE_DIR at an empty directory)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mindspore import Tensor, ops

import fshard as fs
from fshard.errors import ShardingError
from fshard.core.factors import FactorSpec
from fshard.sharding import rates
from fshard.sharding.cost import (BACKEND_RATES, CostModel, bucket_bytes,
                                  backend_rates, compute_seconds, fusion_seconds,
                                  contracts, matmul_seconds, rates_from_table,
                                  redistribution_seconds, step_seconds)
from fshard.sharding.layouts import Candidate, ShardMesh, Sharding


def _table(n, **kw):
    t = {"format": rates.FORMAT, "backend": "CPU", "mindspore": "x", "devices": n,
         "lanes": True, "call_s": 3e-4, "op_s": 5e-6, "flops_per_s": 2e10, "point_s": 1e-9,
         "matmul_elem_s": 1e-12,
         "all_reduce": {"2": [1e-5, 1e-9], "8": [4e-5, 2e-9]},
         "all_gather": {"2": [1e-5, 3e-9], "8": [4e-5, 5e-9]}}
    t.update(kw)
    return t


def _write(devices, table):
    path = rates.cache_path(devices)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FSHARD_CACHE_DIR", str(tmp_path))
    yield tmp_path
    rates.load_cache_clear()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One real calibration (2 virtual devices, one call per measurement: a smoke run)."""
    d = tmp_path_factory.mktemp("calibration")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FSHARD_CACHE_DIR", str(d))
        table = fs.sharding.calibrate(devices=2, runs=1)
        saved = json.loads(rates.cache_path(2).read_text())
    rates.load_cache_clear()
    return table, saved


def test_calibrate_measures_and_caches_the_table(measured):
    table, saved = measured
    assert saved == table
    assert table["devices"] == 2 and table["lanes"] is True
    assert table["flops_per_s"] > 0 and table["point_s"] > 0
    assert table["op_s"] >= 0 and table["arg_s"] >= 0
    assert table["matmul_c"] > 0 and 0.5 <= table["matmul_p"] <= 1.0
    assert table["matmul_elem_s"] > 0
    adam = table["adam_points"]
    assert [n for n, _ in adam] == [2.0 ** 18, 2.0 ** 22] and all(t > 0 for _, t in adam)
    points = table["matmul_points"]
    assert len(points) >= 2 and all(t > 0 for _, t in points)
    assert [f for f, _ in points] == sorted({f for f, _ in points})
    assert set(table["all_reduce"]) == set(table["all_gather"]) == set(table["slice"]) == {"2"}
    for op in ("all_reduce", "all_gather", "slice"):
        a, b = table[op]["2"]
        assert a >= 0 and b > 0
    row = rates_from_table(table)
    assert row["groups"]["all_reduce"][2] == tuple(table["all_reduce"]["2"])
    assert row["groups"]["slice"][2] == tuple(table["slice"]["2"])


def test_cache_path_is_per_backend_version_and_devices(cache, monkeypatch):
    p8, p2 = rates.cache_path(8), rates.cache_path(2)
    assert p8.parent == cache and p8 != p2
    assert "CPU" in p8.name and "2.10" in p8.name and p8.name.endswith("-8.json")
    monkeypatch.delenv("FSHARD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache / "xdg"))
    assert rates.cache_dir() == cache / "xdg" / "fshard"


def test_without_a_table_the_default_rates_price(cache):
    assert rates.calibrated(8) is None
    assert backend_rates(8) is BACKEND_RATES["CPU"]
    assert CostModel(level=2, rates=backend_rates(8)).call_s == 0.0


def test_a_table_is_read_and_used(cache):
    _write(8, _table(8))
    row = backend_rates(8)
    assert row["groups"]["all_gather"][8] == (4e-5, 5e-9)
    assert backend_rates(4) is BACKEND_RATES["CPU"]  # no table for 4 devices
    # a rewritten table is read again (the cache is keyed by the file's mtime)
    path = _write(8, _table(8, flops_per_s=4e10))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert backend_rates(8)["flops_per_s"] == 4e10


def test_collective_seconds_per_group_size_from_the_table():
    row = rates_from_table(_table(8))
    native = {"all_reduce_sum": "any", "all_gather": "world"}
    assert step_seconds("psum", 1e6, 2, False, native, row) == pytest.approx(1e-5 + 1e-3)
    assert step_seconds("psum", 1e6, 8, True, native, row) == pytest.approx(4e-5 + 2e-3)
    assert step_seconds("all_gather", 1e6, 8, True, native, row) == pytest.approx(
        4e-5 + 5e-3)
    # a group size not measured takes the nearest one measured
    assert step_seconds("psum", 1e6, 4, False, native, row) == pytest.approx(1e-5 + 1e-3)
    assert step_seconds("slice", 1e6, 8, True, native, row) == 0.0  # (not measured)


def test_a_virtual_slice_is_priced_per_byte_of_the_value_the_process_holds():
    """A relayout's local slice sends nothing, but a virtual mesh runs it as a
    transpose of the value as the process holds it: one block per device it differs on
    (a job's rank slices its own block, a kernel of its own: no step cost)."""
    row = rates_from_table(_table(8, slice={"2": [2e-6, 1e-10], "8": [3e-6, 2e-10]}))
    native = {"all_reduce_sum": "any", "all_gather": "world"}
    # replicated (one block held) or differing on a quarter of the 8 devices (2 held)
    assert step_seconds("slice", 1e6, 2, False, native, row, share=1 / 8) == \
        pytest.approx(2e-6 + 1e-10 * 1e6)
    assert step_seconds("slice", 1e6, 8, True, native, row, share=2 / 8) == \
        pytest.approx(3e-6 + 2e-10 * 1e6 * 2)
    mesh = ShardMesh.for_devices(8)
    split = redistribution_seconds(Sharding.replicated(2), Sharding(((0,), ())), (64, 1000),
                                   4, mesh, native, row)
    assert split == pytest.approx(2e-6 + 1e-10 * 64 * 1000 * 4)
    job = dict(BACKEND_RATES["CPU"])
    assert step_seconds("slice", 1e6, 2, True, native, job) == 0.0


def test_a_virtual_collective_moves_only_the_blocks_that_differ():
    """The table's per-byte rates were measured with a different block on every device
    of the mesh; a value split over one axis of a 2 x 2 x 2 mesh differs over 2 of the 8
    devices, and the virtual mesh gathers only those: a quarter of the bytes. A job
    (one device per process) is unchanged."""
    row = rates_from_table(_table(8))
    mesh = ShardMesh.for_devices(8)
    native = {"all_reduce_sum": "any", "all_gather": "world"}
    one_axis = Sharding(((0,), ()))
    every_axis = Sharding(((0, 1, 2), ()))
    shape, itemsize = (64, 1000), 4
    gather_one = redistribution_seconds(one_axis, Sharding.replicated(2), shape, itemsize,
                                        mesh, native, row)
    block = 32 * 1000 * 4
    assert gather_one == pytest.approx(1e-5 + 3e-9 * block * 2 / 8)
    gather_every = redistribution_seconds(every_axis, Sharding.replicated(2), shape,
                                          itemsize, mesh, native, row)
    assert gather_every == pytest.approx(4e-5 + 5e-9 * 8 * 1000 * 4)
    # a pending sum over one axis of a value split over another: both axes differ
    summed = Sharding(((1,), ()), partial=frozenset({0}))
    psum = redistribution_seconds(summed, Sharding(((1,), ())), shape, itemsize, mesh,
                                  native, row)
    assert psum == pytest.approx(1e-5 + 1e-9 * 32 * 1000 * 4 * 4 / 8)
    job = dict(BACKEND_RATES["CPU"])
    assert step_seconds("all_gather", 1e6, 2, True, native, job, share=0.25) == \
        step_seconds("all_gather", 1e6, 2, True, native, job)


def test_compute_seconds_matmul_per_flop_elementwise_per_element_times_lanes():
    row = rates_from_table(_table(8))
    mesh = ShardMesh.for_devices(8)
    mm = FactorSpec([("m", "k"), ("k", "n")], [("m", "n")], {"m": 64, "k": 32, "n": 16},
                    reduce=frozenset({"k"}), flops_per_point=2.0)
    ew = FactorSpec([("a",), ("a",)], [("a",)], {"a": 4096})
    assert contracts(mm) and not contracts(ew)
    whole = Candidate(())
    # A replicated equation is not batched over the virtual devices: computed once.
    assert compute_seconds(mm, whole, mesh, row) == pytest.approx(
        5e-6 + 2.0 * 64 * 32 * 16 / 2e10)
    assert compute_seconds(ew, whole, mesh, row) == pytest.approx(5e-6 + 4096 * 1e-9)
    # Split over 8 devices: each computes an eighth, and the virtual mesh runs all 8.
    every = (0, 1, 2)  # the mesh's prime axes, 2 x 2 x 2
    split = Candidate((("a", every),))
    assert compute_seconds(ew, split, mesh, row) == pytest.approx(5e-6 + 4096 * 1e-9)
    # A pending sum carried through varies over its axes: batched over them.
    carried = Candidate((), carry=frozenset(every), carry_ops=(0,))
    assert compute_seconds(ew, carried, mesh, row) == pytest.approx(
        5e-6 + 8 * 4096 * 1e-9)
    model = CostModel(level=2, rates=row)
    assert model.compute(ew, whole, mesh) / model.flops_per_s == pytest.approx(
        compute_seconds(ew, whole, mesh, row))
    # levels 0 and 1 keep MindSpore's flop counts
    assert CostModel(level=0, rates=row).compute(ew, whole, mesh) == 4096.0


def test_a_split_pays_one_kernel_per_piece():
    # MindSpore's CPU backend cuts a split into a slice per piece: an Adam step that
    # concatenates four leaves and splits them back runs four kernels, not one.
    from fshard.core import dtypes
    from fshard.core.rules import sharding
    from fshard.core.tracing import ArrayType
    from fshard.primitives.structural import split_p

    row = rates_from_table(_table(8))
    mesh = ShardMesh.for_devices(8)
    aval = ArrayType((12, 3), dtypes.float32)
    for pieces in ((12,), (4, 8), (3, 3, 3, 3)):
        spec = sharding.get(split_p)(aval, sizes=pieces, axis=0)
        assert spec.kernels == len(pieces)
        assert compute_seconds(spec, Candidate(()), mesh, row) == pytest.approx(
            5e-6 * len(pieces))


def test_a_matmul_is_priced_by_the_power_law_of_its_whole_batched_size():
    row = rates_from_table(_table(8, matmul_c=1e-10, matmul_p=0.8))
    mesh = ShardMesh.for_devices(8)
    mm = FactorSpec([("m", "k"), ("k", "n")], [("m", "n")], {"m": 64, "k": 32, "n": 16},
                    reduce=frozenset({"k"}), flops_per_point=2.0)
    flops = 2.0 * 64 * 32 * 16
    assert compute_seconds(mm, Candidate(()), mesh, row) == pytest.approx(
        5e-6 + 1e-10 * flops ** 0.8)
    # split rows over the 8 devices: one batched kernel of the same total flops
    split = Candidate((("m", (0, 1, 2)),))
    assert compute_seconds(mm, split, mesh, row) == pytest.approx(
        5e-6 + 1e-10 * flops ** 0.8)


def test_a_replicated_left_operand_of_a_split_matmul_is_copied_to_every_device():
    """On a virtual mesh a matmul whose columns are split over the devices runs as one
    BatchMatMul of the replicated left operand copied out to every device: that copy
    is priced; split rows (the left operand batched itself) copy nothing."""
    row = rates_from_table(_table(8, matmul_c=1e-10, matmul_p=0.8))
    mesh = ShardMesh.for_devices(8)
    mm = FactorSpec([("m", "k"), ("k", "n")], [("m", "n")], {"m": 64, "k": 32, "n": 16},
                    reduce=frozenset({"k"}), flops_per_point=2.0)
    flops = 2.0 * 64 * 32 * 16
    kernel = 5e-6 + 1e-10 * flops ** 0.8
    columns = Candidate((("n", (0, 1, 2)),))
    assert compute_seconds(mm, columns, mesh, row) == pytest.approx(
        kernel + 8 * 64 * 32 * 1e-9)
    rows = Candidate((("m", (0, 1, 2)),))
    assert compute_seconds(mm, rows, mesh, row) == pytest.approx(kernel)


def test_a_matmul_takes_at_least_the_time_of_the_elements_it_moves():
    """A weight gradient of 2 rows per device, split over 8 virtual devices, writes a
    whole 2048 x 2048 block per device (a pending sum) for few flops: it is priced at
    its elements, each operand's blocks counted once per device it differs on. A table
    without the rate (an earlier fshard's) takes the elementwise one."""
    mesh = ShardMesh.for_devices(8)
    grad = FactorSpec([("i", "r"), ("r", "j")], [("i", "j")], {"i": 2048, "r": 16, "j": 2048},
                      reduce=frozenset({"r"}), flops_per_point=2.0)
    rows = Candidate((("r", (0, 1, 2)),))
    elements = 2048 * 16 + 16 * 2048 + 8 * 2048 * 2048
    for elem_s in (1e-10, 3e-10):
        row = rates_from_table(_table(8, matmul_c=1e-12, matmul_p=1.0, matmul_elem_s=elem_s))
        assert compute_seconds(grad, rows, mesh, row) == pytest.approx(
            5e-6 + elements * elem_s)
    older = _table(8, matmul_c=1e-12, matmul_p=1.0)
    del older["matmul_elem_s"]
    assert compute_seconds(grad, rows, mesh, rates_from_table(older)) == pytest.approx(
        5e-6 + elements * 1e-9)
    # a replicated weight under split rows is read once, the rows and output per device
    fwd = FactorSpec([("m", "k"), ("k", "n")], [("m", "n")], {"m": 16, "k": 2048, "n": 2048},
                     reduce=frozenset({"k"}), flops_per_point=2.0)
    row = rates_from_table(_table(8, matmul_c=1e-15, matmul_p=1.0, matmul_elem_s=1e-10))
    assert compute_seconds(fwd, Candidate((("m", (0, 1, 2)),)), mesh, row) == \
        pytest.approx(5e-6 + (16 * 2048 + 2048 * 2048 + 16 * 2048) * 1e-10)
    # a job's process computes its own block only
    job = rates_from_table(dict(_table(8, matmul_c=1e-15, matmul_p=1.0,
                                       matmul_elem_s=1e-10), lanes=False))
    assert compute_seconds(grad, rows, mesh, job) == pytest.approx(
        5e-6 + (2048 * 2 + 2 * 2048 + 2048 * 2048) * 1e-10)


def test_adam_s_fused_update_is_priced_per_element_as_measured_at_its_size():
    """With ``adam_points`` an ``adam_update`` costs its kernels plus its elements at
    the price measured nearest its size (between two sizes, on the line in logarithms
    of the size; outside, the nearest); without them (an earlier table) seven passes at
    the elementwise rate."""
    from fshard.core import dtypes
    from fshard.core.rules import sharding
    from fshard.core.tracing import ArrayType
    from fshard.primitives.optimizers import adam_update_p

    mesh = ShardMesh.for_devices(8)
    points = [[2.0 ** 18, 2e-9], [2.0 ** 22, 4e-9]]
    row = rates_from_table(_table(8, adam_points=points))
    old = rates_from_table(_table(8))
    for n, per in ((1 << 10, 2e-9), (1 << 20, 3e-9), (1 << 24, 4e-9)):
        leaf = ArrayType((n,), dtypes.float32)
        spec = sharding.get(adam_update_p)(leaf, leaf, leaf, ArrayType((), dtypes.float32),
                                           b1=0.9, b2=0.999, eps=1e-8)
        assert spec.priced_as == "adam" and spec.kernels == 5
        whole = Candidate(())
        assert compute_seconds(spec, whole, mesh, row) == pytest.approx(5 * 5e-6 + n * per)
        assert compute_seconds(spec, whole, mesh, old) == pytest.approx(
            5 * 5e-6 + 7 * n * 1e-9)
    # split over the 8 devices: one kernel over the 8 blocks, priced at their whole size
    leaf = ArrayType((1 << 20,), dtypes.float32)
    spec = sharding.get(adam_update_p)(leaf, leaf, leaf, ArrayType((), dtypes.float32),
                                       b1=0.9, b2=0.999, eps=1e-8)
    label = spec.inputs[0][0]
    split = Candidate(((label, (0, 1, 2)),))
    assert compute_seconds(spec, split, mesh, row) == pytest.approx(5 * 5e-6 + (1 << 20) * 3e-9)


def test_a_split_argument_and_result_of_a_virtual_mesh_are_priced_as_copies(cache):
    """A virtual mesh's process holds arguments and results whole: a split one is copied
    into the devices' blocks and back, at the elementwise rate; a replicated one is
    not, and a job's process, which holds its own block, copies nothing."""
    w = Tensor(np.ones((64, 32), np.float32))

    def f(w):
        return w * 2.0

    for strategy, copies in (((8, 1), 2), ((1, 1), 0)):
        _write(8, _table(8))
        e = fs.shard(f, in_strategy=(strategy,), out_strategy=(strategy,), mesh=8,
                     level=2).explain(w)
        assert e.inputs_s == pytest.approx(5e-6 + 64 * 32 * 1e-9 if copies else 0.0)
        assert e.output_comm_s == pytest.approx(5e-6 + 64 * 32 * 1e-9 if copies else 0.0)
        _write(8, dict(_table(8), lanes=False))
        rates.load_cache_clear()
        e = fs.shard(f, in_strategy=(strategy,), out_strategy=(strategy,), mesh=8,
                     level=2).explain(w)
        assert e.inputs_s == 0.0 and e.output_comm_s == 0.0
        rates.load_cache_clear()


def test_a_bucket_is_one_fixed_cost_of_copies():
    # a job's row: 0.5 ms per AllReduce, 1 ns per float32 element of elementwise work
    rates = {"flops_per_s": 1e9, "point_s": 1e-9, "all_reduce": (5e-4, 2.5e8)}
    native = {"all_reduce_sum": "any"}
    bucket = bucket_bytes(2, rates, native)
    assert bucket == pytest.approx(5e-4 / (2 * 1e-9 / 4))  # 1 MB
    # a full bucket of 5 AllReduces saves 4 fixed costs and copies one's worth in and out
    assert fusion_seconds([(5, bucket)], 2, rates, native) == pytest.approx(-3 * 5e-4)
    assert fusion_seconds([], 2, rates, native) == 0.0
    # an AllGather bucket by the AllGather's own fixed cost (0.3 ms: 0.6 MB)
    rates["all_gather"] = (3e-4, 2.5e8)
    native["all_gather"] = "world"
    gathers = bucket_bytes(2, rates, native, "all_gather")
    assert gathers == pytest.approx(3e-4 / (2 * 1e-9 / 4))
    assert fusion_seconds([(3, gathers)], 2, rates, native, "all_gather") == pytest.approx(
        -1 * 3e-4)
    # the default rows have no elementwise rate: one flop per element
    assert bucket_bytes(2, BACKEND_RATES["CPU"], native) == pytest.approx(
        BACKEND_RATES["CPU"]["all_reduce"][0] * 2 * BACKEND_RATES["CPU"]["flops_per_s"])


def test_calling_costs_each_value_passed_in_or_out():
    model = CostModel(level=2, rates=rates_from_table(_table(8, arg_s=2e-6)))
    assert model.call_seconds(2) == pytest.approx(3e-4)
    assert model.call_seconds(12) == pytest.approx(3e-4 + 10 * 2e-6)
    # a table of an earlier version (no arg_s) prices the call alone
    assert CostModel(level=2, rates=rates_from_table(_table(8))).call_seconds(12) == 3e-4


def _mlp_loss(w, v, x):
    return ops.relu(ops.matmul(ops.relu(ops.matmul(x, w)), v)).mean()


def test_plans_priced_with_a_table_give_the_unsharded_values(cache):
    _write(8, _table(8))
    rng = np.random.default_rng(0)
    w = Tensor(rng.standard_normal((16, 32)).astype(np.float32))
    v = Tensor(rng.standard_normal((32, 8)).astype(np.float32))
    x = Tensor(rng.standard_normal((64, 16)).astype(np.float32))
    f = fs.shard(fs.value_and_grad(_mlp_loss, argnums=(0, 1)), in_strategy=(None, None, (8, 1)),
                 mesh=8, level=2, search=True)
    (val, (gw, gv)) = f(w, v, x)
    (rv, (rw, rvv)) = fs.value_and_grad(_mlp_loss, argnums=(0, 1))(w, v, x)
    scale = max(abs(float(rv.asnumpy())), 1.0)
    np.testing.assert_allclose(val.asnumpy(), rv.asnumpy(), rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(gw.asnumpy(), rw.asnumpy(), rtol=1e-4,
                               atol=1e-5 * np.abs(rw.asnumpy()).max())
    np.testing.assert_allclose(gv.asnumpy(), rvv.asnumpy(), rtol=1e-4,
                               atol=1e-5 * np.abs(rvv.asnumpy()).max())
    e = f.explain(w, v, x)
    assert e.call_s == 3e-4
    # x, given split by rows, is copied into the devices' blocks on the way in
    assert e.inputs_s == pytest.approx(5e-6 + 64 * 16 * 1e-9)
    assert e.total_s == pytest.approx(e.call_s + e.inputs_s + e.compute_s + e.comm_s)
    assert "(call)" in str(e) and "(inputs)" in str(e)


@pytest.mark.parametrize("devices", [0, -2, True, "8", 2.0])
def test_calibrate_refuses_bad_devices(devices):
    with pytest.raises(ShardingError, match="devices must be a positive int") as e:
        fs.sharding.calibrate(devices=devices)
    assert isinstance(e.value, ValueError) and "Fix:" in str(e.value)


@pytest.mark.parametrize("runs", [0, 1.5, True])
def test_calibrate_refuses_bad_runs(runs):
    with pytest.raises(ShardingError, match="runs must be a positive int"):
        fs.sharding.calibrate(devices=2, runs=runs)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 1}),
                                     json.dumps(_table(8, flops_per_s=-1.0)),
                                     json.dumps(_table(8, format=99)),
                                     json.dumps(_table(8, all_reduce={"2": [1.0]})),
                                     json.dumps(_table(8, all_gather={"two": [1.0, 1.0]})),
                                     json.dumps(_table(8, all_gather={"2": ["a", 1.0]})),
                                     json.dumps(_table(8, slice={"2": [1.0, -1.0]})),
                                     json.dumps(_table(8, devices="8")), "[]"])
def test_a_corrupt_table_is_an_error_naming_the_file_and_the_fix(cache, content):
    path = rates.cache_path(8)
    path.write_text(content)
    with pytest.raises(ShardingError) as e:
        backend_rates(8)
    msg = str(e.value)
    assert str(path) in msg and "fs.sharding.calibrate()" in msg and "delete the file" in msg


def test_an_unwritable_cache_dir_is_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FSHARD_CACHE_DIR", str(blocker / "sub"))
    from fshard.sharding import calibration as cal

    monkeypatch.setattr(cal, "measure", lambda devices, runs: _table(devices))
    with pytest.raises(ShardingError, match="FSHARD_CACHE_DIR") as e:
        fs.sharding.calibrate(devices=2)
    assert "cannot write" in str(e.value)


# Rates under which updating a replicated weight costs more than updating a block per
# device and gathering it: a job's table (each device computes alone, ``lanes`` False;
# a virtual mesh runs a replicated update once, so there splitting it saves nothing)
# with slow elementwise work and cheap gathers.
GATHERING_RATES = {"lanes": False, "call_s": 1.0e-3, "op_s": 1.57e-5, "flops_per_s": 3.86e10,
              "point_s": 2e-8,
              "all_reduce": {"2": [0.0, 8.9e-10], "4": [0.0, 2.44e-9], "8": [0.0, 2.2e-9]},
              "all_gather": {"2": [0.0, 1e-10], "4": [0.0, 1e-10], "8": [0.0, 1e-10]}}


def _adam_mlp_loss(p, x, y):
    h = fs.ops.relu(x @ p["w0"] + p["b0"])
    return fs.ops.softmax_cross_entropy(h @ p["w1"] + p["b1"], y)


@pytest.mark.full  # two AutoParallel steps compiled (~9 s on 2 loaded cores); the quick
# run prices a plan with a table in test_plans_priced_with_a_table_give_the_unsharded_values
def test_a_calibrated_plan_that_gathers_updated_blocks_trains_like_one_device(cache):
    _write(8, _table(8, **GATHERING_RATES))
    rng = np.random.default_rng(0)
    params = {"w0": (rng.standard_normal((64, 256)) / 8).astype(np.float32),
              "b0": np.zeros(256, np.float32),
              "w1": (rng.standard_normal((256, 10)) / 16).astype(np.float32),
              "b1": np.zeros(10, np.float32)}
    x = rng.standard_normal((64, 64)).astype(np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)
    ap = fs.AutoParallel(_adam_mlp_loss, fs.optim.adam(1e-2), "sharding_propagation", mesh=8)
    ap.dataset_strategy("data_parallel")
    one = fs.AutoParallel(_adam_mlp_loss, fs.optim.adam(1e-2), "semi_auto", mesh=1)
    s, r = ap.init(params), one.init(params)
    assert "all_gather" in ap.partitioned(s, x, y).collectives()  # the measured rates' plan
    for _ in range(2):
        (s, loss), (r, want) = ap(s, x, y), one(r, x, y)
        np.testing.assert_allclose(loss.asnumpy(), want.asnumpy(), rtol=1e-5)
    for k in params:
        w = r.params[k].asnumpy()
        np.testing.assert_allclose(s.params[k].asnumpy(), w, rtol=1e-4,
                                   atol=1e-5 * max(np.abs(w).max(), 1.0))


def test_a_matmul_between_measured_sizes_is_priced_from_its_nearest_two():
    """Inside the sizes the table measured, a matmul's kernel is on the line between the
    two nearest in logarithms (a measured size exactly as measured); outside them, the
    power law through them all."""
    points = [[1e6, 2e-4], [1e7, 5e-4], [1e8, 4e-3]]
    row = rates_from_table(_table(8, matmul_c=1e-10, matmul_p=0.8, matmul_points=points))
    for f, t in points:
        assert matmul_seconds(f, row) == pytest.approx(t)
    assert matmul_seconds(np.sqrt(1e7 * 1e8), row) == pytest.approx(np.sqrt(5e-4 * 4e-3))
    assert 5e-4 < matmul_seconds(3e7, row) < 4e-3
    for f in (1e5, 1e9):
        assert matmul_seconds(f, row) == pytest.approx(1e-10 * f ** 0.8)
    mesh = ShardMesh.for_devices(8)
    mm = FactorSpec([("m", "k"), ("k", "n")], [("m", "n")], {"m": 256, "k": 128, "n": 64},
                    reduce=frozenset({"k"}), flops_per_point=2.0)
    flops = 2.0 * 256 * 128 * 64
    assert compute_seconds(mm, Candidate((("m", (0, 1, 2)),)), mesh, row) == \
        pytest.approx(5e-6 + matmul_seconds(flops, row))
    # a table without the points (an earlier fshard's) prices by the power law alone
    old = rates_from_table(_table(8, matmul_c=1e-10, matmul_p=0.8))
    assert matmul_seconds(3e7, old) == pytest.approx(1e-10 * 3e7 ** 0.8)


@pytest.mark.parametrize("key", ["matmul_points", "adam_points"])
@pytest.mark.parametrize("points", [[[1e6, 1e-4], [1e6, 2e-4]], [[1e7, 1e-4], [1e6, 1e-3]],
                                    [[1e6, -1.0]], [[1e6]], "1e6", [["1e6", 1e-4]]])
def test_a_table_with_broken_points_is_refused(cache, points, key):
    _write(8, _table(8, **{key: points}))
    with pytest.raises(ShardingError, match="not one fs.sharding.calibrate"):
        backend_rates(8)


def test_each_program_runs_past_mindspores_choice_of_threads_before_it_is_timed(
        monkeypatch):
    # MindSpore's runtime settles how it runs a small graph (one thread or several) at
    # its 50th call: the calibration times the way a step keeps, after WARMUP_CALLS.
    from fshard.sharding import calibration

    calls = []
    monkeypatch.setattr(calibration, "_call", lambda compiled, args: calls.append(compiled))
    ts = calibration._times([("a", []), ("b", [])], runs=3, rounds=2)
    assert len(ts) == 2 and calibration.WARMUP_CALLS >= 50
    warm = 2 * calibration.WARMUP_CALLS
    assert calls[:warm] == ["a"] * calibration.WARMUP_CALLS + ["b"] * calibration.WARMUP_CALLS
    assert calls[warm:] == (["a"] * 3 + ["b"] * 3) * 2


@pytest.mark.parametrize("both", [False, True])
def test_a_small_matmul_is_timed_in_a_chain_that_computes_what_it_says(both):
    # The calibration prices a small matmul by the extra time of more pairs in a chain
    # relu(relu(x @ w1) @ w2): the program must run exactly that, batched over the
    # devices, the weights per device (a gradient's) or shared.
    from fshard.backend import mindspore as backend
    from fshard.sharding import calibration

    devices, (m, k, n) = 2, (4, 8, 16)
    compiled, args = calibration._batched_matmul(m, k, n, devices, both, pairs=2)
    x, w1, w2 = (backend.to_numpy(a) for a in args)
    assert x.shape == (devices, m, k)
    assert w1.shape == ((devices,) if both else ()) + (k, n)
    assert w2.shape == ((devices,) if both else ()) + (n, k)
    want = []
    for d in range(devices):
        a, b = (w1[d], w2[d]) if both else (w1, w2)
        h = x[d]
        for _ in range(2):
            h = np.maximum(np.maximum(h @ a, 0) @ b, 0)
        want.append(h)
    got = compiled(*args)
    got = backend.to_numpy(got[0] if isinstance(got, (tuple, list)) else got)
    scale = float(np.abs(np.stack(want)).max())
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-4, atol=1e-5 * scale)


def test_a_chained_matmul_s_price_takes_the_relus_and_fixed_costs_out():
    from fshard.sharding import calibration

    more = calibration.PAIRS[1] - calibration.PAIRS[0]
    kernel, op_s, point_s, elements = 30e-6, 4e-6, 2e-10, 50_000
    short = 1e-3
    long = short + more * (2 * kernel + 4 * op_s + point_s * elements)
    assert calibration._chained_kernel_s(short, long, elements, op_s, point_s) == \
        pytest.approx(kernel, rel=1e-9)
    # a slower long chain than short one never prices a kernel at zero or less
    assert calibration._chained_kernel_s(short, short * 0.9, elements, op_s, point_s) > 0


def test_semi_auto_keeps_a_whole_batch_whole_where_a_block_is_priced_above_the_whole(
        cache):
    # A measured table can price a small matmul above a larger one (this machine's:
    # 1.4e-5 s for 2.6e5 flops, 1.2e-5 s for 1.0e6). Ranked by compute, semi_auto then
    # sliced its whole-batch step's matmuls locally and reduced them again (16
    # collectives on 8 devices); what is whole stays whole: no collective at all.
    points = [[262144.0, 1.43e-5], [1048576.0, 1.23e-5], [2097152.0, 1.58e-5],
              [16777216.0, 1.63e-4], [67108864.0, 4.05e-4]]
    _write(8, _table(8, matmul_c=7.6e-11, matmul_p=0.877, matmul_points=points,
                     adam_points=[[262144.0, 1.26e-9], [4194304.0, 2.2e-9]]))
    rng = np.random.default_rng(0)
    params = {"w0": rng.standard_normal((64, 512)).astype(np.float32) / 8,
              "w1": rng.standard_normal((512, 10)).astype(np.float32) / 20}
    x = rng.standard_normal((256, 64)).astype(np.float32)
    y = rng.integers(0, 10, 256).astype(np.int32)

    def loss(p, x, y):
        return fs.ops.softmax_cross_entropy(fs.ops.relu(x @ p["w0"]) @ p["w1"], y)

    ap = fs.AutoParallel(loss, fs.optim.adam(1e-3), "semi_auto", mesh=8)
    ap.dataset_strategy("full_batch")
    assert ap.partitioned(ap.init(params), x, y).collectives() == []
