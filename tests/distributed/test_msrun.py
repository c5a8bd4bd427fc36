"""Beyond one machine: the training example runs unchanged under MindSpore's own
``msrun``, 2 nodes x 2 processes simulated on this machine by two ``msrun``
invocations (``--node_rank 0`` / ``1``, ``--master_addr 127.0.0.1``, ``--worker_num 4
--local_worker_num 2``), and every rank's losses equal one process's.

On one machine both invocations would find 127.0.0.1 among their own addresses and
each start the scheduler (the second one fails on the taken port); on a second
machine msrun would find it is not the master. So node 1 runs msrun's own entry point
told exactly that (its address check answers "not this machine"), everything else
being msrun as installed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from fshard import launch

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.abspath(os.path.join(HERE, "..", "..", "examples", "train_autoparallel.py"))
sys.path.insert(0, os.path.dirname(EXAMPLE))

import train_autoparallel as example  # noqa: E402

STEPS = 10
BIN = os.path.dirname(sys.executable)
MSRUN = os.path.join(BIN, "msrun")
NOT_MASTER = (
    "import sys\n"
    "import mindspore.parallel.cluster.process_entity._api as api\n"
    "api._is_local_ip = lambda address: False  # the master is another machine\n"
    "from mindspore.parallel.cluster.run import main\n"
    "sys.argv[0] = 'msrun'\n"
    "sys.exit(main())\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_nodes(port, out, env, tmp_path):
    procs = []
    for node in (0, 1):
        args = ["--worker_num", "4", "--local_worker_num", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(port),
                "--node_rank", str(node), "--log_dir", str(tmp_path / f"node{node}"),
                "--join", "True", "--cluster_time_out", "120",
                EXAMPLE, "--steps", str(STEPS), "--log-every", "5", "--out", str(out)]
        cmd = [MSRUN] + args if node == 0 else [sys.executable, "-c", NOT_MASTER] + args
        procs.append(subprocess.Popen(cmd, env=env, cwd=str(tmp_path),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return outputs, procs


@pytest.mark.full
def test_two_nodes_of_two_processes_under_msrun_match_one_process(tmp_path):
    assert os.path.exists(MSRUN), f"msrun (installed with mindspore) is missing: {MSRUN}"
    port = _free_port()
    out = tmp_path / "losses"
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    env.setdefault("MS_NODE_TIMEOUT", str(launch.collective_timeout(4)))
    with launch.job_lock():  # one job at a time, as fshard.launch's jobs
        outputs, procs = _run_two_nodes(port, out, env, tmp_path)
    logs = {f.name: f.read_text(errors="replace")
            for node in (0, 1) for f in (tmp_path / f"node{node}").glob("*.log")}
    detail = "\n".join(o[-2000:] for o in outputs) + "\n".join(
        f"--- {k}\n{v[-2000:]}" for k, v in logs.items())
    assert [p.returncode for p in procs] == [0, 0], detail
    # node 0 ran the scheduler and ranks 0, 1; node 1 ranks 2, 3 and no scheduler
    assert sorted(logs) == ["scheduler.log", "worker_0.log", "worker_1.log",
                            "worker_2.log", "worker_3.log"], sorted(logs)
    assert not (tmp_path / "node1" / "scheduler.log").exists()
    assert f"epoch: 1 step: {STEPS}, loss is" in logs["worker_0.log"]
    reference = example.train(STEPS)
    for rank in range(4):
        with open(f"{out}.rank{rank}.json") as fh:
            np.testing.assert_allclose(json.load(fh), reference, rtol=1e-5,
                                       err_msg=f"rank {rank}")
