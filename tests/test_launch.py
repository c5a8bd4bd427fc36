"""fshard.launch and fshard.distributed: real multi-process jobs, kept few.

Each real launch costs 10-20 s on 2 cores, so the success checks are batched into one
job (tests/distributed/launch_checks.py), the one launch of the quick run; the faults
are in the full matrix. Every launch has a free port, its own log directory and a
timeout, so nothing can hang the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import fshard as fs
from fshard import launch

SCRIPT = str(Path(__file__).resolve().parent / "distributed" / "launch_checks.py")


def test_two_rank_job_runs_collectives(tmp_path):
    result = launch.run(SCRIPT, 2, ["ok"], timeout=240, log_dir=str(tmp_path))
    assert result.ok, result.message
    assert result.message.startswith("fshard.launch: 2 ranks finished in ")
    for rank in range(2):
        out = result.output(rank)
        assert "ALL CHECKS PASSED" in out, out
        assert out.splitlines().count("before init") == 1
        assert "[WARNING]" not in out  # MindSpore's log lines stay in the log file
        assert result.ranks[rank].status == "ok" and result.ranks[rank].returncode == 0
        log = (tmp_path / f"rank_{rank}.log").read_text()
        assert "ALL CHECKS PASSED" in log
        for check in ("AutoParallel: a global batch of 2N+1 rows refused on every rank",
                      "shard: slices of different row counts refused on every rank",
                      "and keep the parameters one process gets",
                      "AutoParallel: slices of different row counts train as one process",
                      "fs.shard with equal slices returns this process's rows",
                      "pipelined job: each process keeps its own stage's weight only",
                      "pipelined job: and gathers the clipped weights of one process"):
            assert f"CHECK {check} ok" in out, out
    # every communicating graph a rank entered was reported, the same number on each
    assert result.ranks[0].collectives == result.ranks[1].collectives >= 9
    # the scheduler runs a stub, not the script: nothing of the script's output twice
    assert "before init" not in result.scheduler_log.splitlines()
    assert (tmp_path / "scheduler.log").exists()


@pytest.mark.full
def test_failing_rank_stops_the_job_and_is_named(tmp_path):
    result = launch.run(SCRIPT, 2, ["fail"], timeout=120, log_dir=str(tmp_path))
    assert not result.timed_out, result.message
    assert result.returncode == 1 and result.failed_ranks == [1]
    assert [r.status for r in result.ranks] == ["stopped", "failed"]
    assert result.message.startswith("fshard.launch: rank 1 failed (exit code 1) after ")
    assert "; stopped rank 0." in result.message
    assert "ValueError: rank 1 fails on purpose" in result.message
    assert 'File "' in result.output(1) and "launch.py" not in result.output(1)
    with pytest.raises(fs.DistributedError, match="rank 1 failed"):
        result.check()


@pytest.mark.full
def test_a_rank_behind_in_the_collectives_is_named_as_hung(tmp_path):
    """Rank 1 sleeps while rank 0 waits for it in a collective: MindSpore gives up
    after MS_NODE_TIMEOUT (logging a kernel error, and carrying on): the launcher ends
    the job then, long before --timeout, naming rank 1 (which entered fewer
    communicating graphs) as hung."""
    result = launch.run(SCRIPT, 2, ["collective_hang"], timeout=240, log_dir=str(tmp_path),
                        env={"MS_NODE_TIMEOUT": "5"})
    assert not result.timed_out, result.message
    assert result.returncode == launch.EXIT_TIMEOUT and result.failed_ranks == [1]
    assert [r.status for r in result.ranks] == ["failed", "hung"]
    assert [r.collectives for r in result.ranks] == [2, 1]
    assert result.message.startswith(
        "fshard.launch: rank 1 stopped making progress (hung?): rank 0 timed out in a "
        "collective after "), result.message
    assert ("waiting 5 s (MS_NODE_TIMEOUT) for it in collective #2 (collectives entered: "
            "rank 0 2, rank 1 1); stopped rank 1. Fix: look at what rank 1 does before "
            "its collective #2") in result.message
    # the hung rank's last lines, not the waiting rank's kernel error
    assert "sleeping before the second collective" in result.message
    assert "KernelMod" not in result.message and "wait receiving" not in result.message
    assert "wait receiving" in (tmp_path / "rank_0.log").read_text()


# The launcher's option errors and faults (a hung rank, a rank that exits before init(),
# processes a rank leaves behind) are cases of tests/test_hostile.py.


def test_run_argument_errors(tmp_path):
    with pytest.raises(fs.ArgumentError, match="n must be a positive int"):
        launch.run(SCRIPT, 0)
    with pytest.raises(fs.ArgumentError, match="does not exist"):
        launch.run(str(tmp_path / "missing.py"), 2)
    with pytest.raises(SystemExit):
        launch.main(["-n", "2", str(tmp_path / "missing.py")])


def test_init_outside_a_launcher_is_a_clear_error(monkeypatch):
    for var in ("MS_ROLE", "RANK_TABLE_FILE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(fs.DistributedError) as info:
        fs.distributed.init()
    assert str(info.value) == (
        "fs.distributed.init() was called in a process that no launcher started (MS_ROLE and "
        "RANK_TABLE_FILE are unset), so there is no job to join. Fix: start the script with "
        "`python -m fshard.launch -n 2 script.py` (or msrun); to run in one process, skip "
        "init() and use a virtual mesh: fs.Mesh((8,), ('d',)) or FSHARD_DEVICES=8."
        "\nSee docs/errors.md#distributederror"
    )
    assert not fs.distributed.is_initialized()
    assert fs.distributed.rank() == 0 and fs.distributed.world_size() == 1
    with pytest.raises(fs.DistributedError, match="needs a joined job"):
        fs.distributed.group_for([0])
