"""fshard.launch and fshard.distributed: real multi-process jobs, kept few.

Each real launch costs 10-20 s on 2 cores, so the success checks are batched into one
job (tests/distributed/launch_checks.py). Every launch has a free port, its own log
directory and a timeout, so nothing can hang the suite.
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
    # the scheduler runs a stub, not the script: nothing of the script's output twice
    assert "before init" not in result.scheduler_log.splitlines()
    assert (tmp_path / "scheduler.log").exists()


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


def test_a_rank_that_finishes_without_joining_is_reported_at_once(tmp_path):
    result = launch.run(SCRIPT, 2, ["noinit"], timeout=240, log_dir=str(tmp_path))
    assert not result.timed_out and result.wall_time < 60, result.message
    assert result.returncode == 1 and result.failed_ranks == [1]
    assert [r.status for r in result.ranks] == ["stopped", "failed"]
    assert result.message.startswith(
        "fshard.launch: rank 1 finished (exit code 0) after "), result.message
    assert ("without joining the job, while rank 0 waited for it in "
            "fs.distributed.init(); stopped rank 0. Fix: call fs.distributed.init() on "
            "every rank") in result.message


def test_cli_timeout_names_the_hung_rank_and_the_finished_one(tmp_path, capsys):
    code = launch.main(["-n", "2", "--timeout", "8", "--log-dir", str(tmp_path), SCRIPT, "hang"])
    assert code == launch.EXIT_TIMEOUT == 124
    captured = capsys.readouterr()
    assert "[rank 0] done early" in captured.out and "[rank 1] hanging" in captured.out
    assert ("fshard.launch: timed out after 8 s: rank 1 still running (hung?) and stopped; "
            "rank 0 had finished.") in captured.err


def test_a_successful_job_leaves_no_processes_and_no_logs_behind(tmp_path):
    import glob
    import os
    import tempfile

    pattern = os.path.join(tempfile.gettempdir(), "fshard-launch-*")
    before = set(glob.glob(pattern))
    result = launch.run(SCRIPT, 2, ["child"], timeout=120)
    assert result.ok, result.message
    assert set(glob.glob(pattern)) == before
    assert "logs removed; keep them with --log-dir" in result.message
    for rank in range(2):
        pid = int(result.output(rank).split("child ")[1].split()[0])
        # stopped with its rank's process group: gone, or a zombie nobody reaped yet
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "gone"
        assert state in ("gone", "Z", "X"), f"rank {rank}'s child {pid} is {state}"


@pytest.mark.parametrize("args, match", [
    (["--timeout", "nan"], "--timeout must be a positive, finite"),
    (["--timeout", "inf"], "--timeout must be a positive, finite"),
    (["--timeout", "0"], "--timeout must be a positive, finite"),
    (["--port", "70000"], r"--port must be an int in \[1, 65535\]"),
])
def test_cli_option_errors_are_usage_lines(args, match, capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(["-n", "2", *args, SCRIPT, "ok"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    import re

    assert re.search(match, err), err


def test_cli_log_dir_naming_a_file_is_a_usage_line(tmp_path, capsys):
    f = tmp_path / "f.txt"
    f.write_text("x")
    with pytest.raises(SystemExit):
        launch.main(["-n", "2", "--log-dir", str(f), SCRIPT, "ok"])
    assert "--log-dir" in capsys.readouterr().err


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
