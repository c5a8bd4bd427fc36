"""Hostile inputs to jobs, the launcher and their values, in one process: an
``fs.ShardedArray`` used eagerly, ``AutoParallel``'s mesh and ``comm_fusion``, and the
launcher's checks that need no launch (its reports are built from what the ranks told
it, so they are tested on recorded progress). Launched faults are in
tests/distributed/launch_checks.py and tests/test_launch.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

import fshard as fs
from fshard import launch
from fshard.sharding.layouts import ShardMesh


def _loss(p, x):
    return ((x @ p["w"]) ** 2).mean()


# -- fs.ShardedArray: eager use names the fix ------------------------------------------


@pytest.fixture(scope="module")
def block():
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    return fs.ShardedArray.cut(x, (2, 1), ShardMesh((2,)), rank=1)


@pytest.mark.parametrize("use, what", [
    (lambda y: y + 1, "the eager operator '+'"),
    (lambda y: 1 - y, "the eager operator '-'"),
    (lambda y: y @ y, "the eager operator '@'"),
    (lambda y: -y, "the eager operator 'unary -'"),
    (lambda y: y < 0, "the eager operator '<'"),
    (lambda y: y.sum(), "the Tensor method .sum"),
    (lambda y: y.mean(0), "the Tensor method .mean"),
    (lambda y: y.reshape(8), "the Tensor method .reshape"),
    (lambda y: y[0], r"indexing x\[...\]"),
    (lambda y: len(y), r"len\(\)"),
    (lambda y: list(y), "iteration"),
], ids=["add", "rsub", "matmul", "neg", "lt", "sum", "mean", "reshape", "index", "len",
        "iter"])
def test_eager_ops_on_a_sharded_array_name_the_fix(block, use, what):
    with pytest.raises(fs.ProcessLocalError) as info:
        use(block)
    msg = str(info.value)
    assert msg.startswith(f"{what.replace(chr(92), '')} needs the values of a f32[4,2] "
                          "array, but this process holds only its block [(2, 4), (0, 2)]")
    assert "x.gather()" in msg and "fs.gather_sharded" in msg and "fs.jit / fs.shard" in msg
    # still the classes a caller would catch
    assert isinstance(info.value, (fs.ShardingError, TypeError, AttributeError))


def test_a_sharded_array_keeps_its_own_attributes_and_hasattr_probes(block):
    assert block.shape == (4, 2) and block.size == 8 and block.ndim == 2
    assert not hasattr(block, "sum")  # a probe is False, not an error
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'") as info:
        block.no_such_thing  # noqa: B018
    assert not isinstance(info.value, fs.FshardError)
    assert block == block and block is not None  # identity, for containers and caches


# -- AutoParallel's mesh and comm_fusion -------------------------------------------------


@pytest.mark.parametrize("mesh", [0, -2])
def test_autoparallel_mesh_of_no_devices_is_an_argument_error(mesh):
    with pytest.raises(fs.ArgumentError) as info:
        fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=mesh)
    assert str(info.value).startswith(
        f"AutoParallel(mesh=...): a device count must be >= 1; got {mesh}.\nFix: mesh=2")


@pytest.mark.parametrize("config, match", [
    ({"openstate": "no"}, r"'openstate' must be a bool .*got str 'no'"),
    ({"openstate": 1}, r"'openstate' must be a bool .*got int 1"),
    ({"openstate": None}, r"'openstate' must be a bool"),
    ({"allreduce": [1]}, r"'allreduce' must be a dict with keys 'mode' and 'config'; got list"),
    ({"allreduce": {"mode": "auto"}}, r"exactly the keys 'mode' and 'config' .*missing "
                                      r"\['config'\]"),
    ({"allreduce": {"config": 4}}, r"missing \['mode'\]"),
    ({"allreduce": {"mode": "size", "config": 4, "group": 1}}, r"unknown \['group'\]"),
    ({"allreduce": {"mode": "auto", "config": 32}}, "config 32 would be ignored"),
    ({"allreduce": {"mode": "size", "config": 0}}, "a finite number > 0; got 0"),
    ({"allreduce": {"mode": "size", "config": math.inf}}, "a finite number > 0; got inf"),
    ({"allreduce": {"mode": "size", "config": math.nan}}, "a finite number > 0; got nan"),
    ({"allreduce": {"mode": "size", "config": True}}, "a finite number > 0; got True"),
    ({"allreduce": {"mode": "size", "config": "32"}}, "a finite number > 0; got '32'"),
    ({"allreduce": {"mode": "AUTO", "config": None}}, "mode must be 'auto', 'size' or 'index'"),
    ({"openstate": False, "allreduce": {"mode": "nope", "config": None}},
     "mode must be 'auto', 'size' or 'index'"),
    ({"open_state": False}, r"unknown keys \['open_state'\]"),
    ({1: True}, r"unknown keys \[1\]"),
], ids=lambda v: repr(v)[:40] if not isinstance(v, str) else None)
def test_comm_fusion_checks_every_key_and_value(config, match):
    ap = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=2)
    with pytest.raises(fs.ArgumentError, match=match) as info:
        ap.comm_fusion(config)
    assert str(info.value).startswith("AutoParallel.comm_fusion(config): ")
    assert ap.options.fusion_bytes is None  # nothing half-applied


@pytest.mark.parametrize("config, bucket", [
    ({"openstate": True}, 64 * 2**20),
    ({"allreduce": {"mode": "auto", "config": None}}, 64 * 2**20),
    ({"allreduce": {"mode": "size", "config": 0.5}}, 0.5 * 2**20),
    ({"openstate": False, "allreduce": {"mode": "size", "config": 8}}, None),
    ({"openstate": False}, None),
])
def test_comm_fusion_accepts_mindspores_spellings(config, bucket):
    ap = fs.AutoParallel(_loss, fs.optim.sgd(0.1), mesh=2)
    assert ap.comm_fusion(config) is ap
    assert ap.options.fusion_bytes == bucket


# -- the launcher's checks that need no launch -------------------------------------------

SCRIPT = str(__import__("pathlib").Path(__file__).resolve().parent / "distributed"
             / "launch_checks.py")


def test_more_processes_than_memory_holds_are_refused_before_anything_starts(capsys):
    n = 100_000  # more than any machine's memory holds (-n 1000 on a 24 GiB machine too)
    with pytest.raises(fs.ArgumentError) as info:
        launch.run(SCRIPT, n, ["ok"])
    msg = str(info.value)
    assert msg.startswith(f"n={n}: {n} processes need about 41016 GiB (each MindSpore "
                          "process takes ~420 MiB), more than this machine's "), msg
    assert "Fix: fewer processes" in msg
    with pytest.raises(SystemExit) as e:
        launch.main(["-n", str(n), SCRIPT, "ok"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and f"-n {n}: {n} processes need about" in err


def test_processes_far_beyond_the_cores_are_warned_about(monkeypatch):
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 2)
    assert launch._check_size(4) == (None, None)  # two per core: no warning
    refused, warning = launch._check_size(8)
    assert refused is None
    assert warning.startswith("fshard.launch: warning: 8 processes on 2 cores: each rank "
                              "gets 0.25 of a core"), warning


@pytest.mark.parametrize("n, load, cores, want", [
    (2, 0.0, 2, 30), (2, 0.0, 8, 30), (4, 0.0, 2, 60), (4, 6.0, 2, 150), (8, 100.0, 2, 600)])
def test_the_collective_timeout_is_scaled_to_the_load(monkeypatch, n, load, cores, want):
    monkeypatch.setattr(launch.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(launch.os, "getloadavg", lambda: (load, load, load))
    assert launch.collective_timeout(n) == want


def test_job_lock_runs_jobs_one_at_a_time_and_nests(tmp_path, monkeypatch):
    import fcntl
    import threading

    path = str(tmp_path / "jobs.lock")
    monkeypatch.setenv("FSHARD_LAUNCH_LOCK", path)
    with launch.job_lock() as waited:
        assert waited >= 0.0
        with launch.job_lock() as again:  # nested in one thread: no deadlock
            assert again == 0.0
        with open(path) as other:  # another holder is refused while it is held
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        got = []
        t = threading.Thread(target=lambda: got.append(launch.job_lock().__enter__()))
        t.start()
        t.join(0.5)
        assert t.is_alive() and not got  # another thread waits for it
    t.join(30)
    assert got and not t.is_alive()
    monkeypatch.delenv("FSHARD_LAUNCH_LOCK")
    with launch.job_lock() as waited:  # unset: no lock at all
        assert waited == 0.0
