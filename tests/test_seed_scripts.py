"""The seeds' training scripts (tests/seed_scripts/), run as their users wrote them:
on the virtual mesh (``mindspore.communication``'s ``init`` imported from
``virtual_comm``: the only line changed), under ``fshard.launch`` and under MindSpore's
``msrun`` (unchanged; seed 000 with ``import fshard`` added).

MNIST does not ship offline: ``DATA_PATH`` points at MNIST-format files of
scikit-learn's digits (``seed_scripts/mnist.py``), so the seeds' own loader runs.

Seed lines that another part of fshard has yet to support are listed in
``PENDING`` with the reason; the scripts that contain them are strict xfails (they
start to pass, and must be un-marked, when those lines run), and the same scripts
without exactly those lines must train.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fshard import launch

pytestmark = pytest.mark.full  # each script is a fresh process: ~20-40 s

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seed_scripts")
sys.path.insert(0, HERE)

from mnist import write_mnist  # noqa: E402

LOSS_LINE = re.compile(r"epoch: (\d+) step: (\d+), loss is ([-0-9.e]+)")

# Seed lines that do not run yet, with why (each is another part of the seed's API).
PENDING: dict = {}


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return write_mnist(str(tmp_path_factory.mktemp("mnist")))


def _script(name: str, tmp_path, *, virtual: bool, without_pending: bool) -> str:
    text = Path(HERE, name).read_text()
    if virtual:
        text = re.sub(r"^from mindspore\.communication import (init.*)$",
                      r"from virtual_comm import \1", text, flags=re.M)
    if without_pending:
        for line in PENDING.get(name, {}):
            assert line in text, line
            text = text.replace(line, "pass  # " + line)
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _run_virtual(script: str, devices: int, data_path: str) -> str:
    env = dict(os.environ, FSHARD_DEVICES=str(devices), DATA_PATH=data_path,
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                         timeout=900, cwd=os.path.dirname(script))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout


def _losses(text: str) -> list:
    return [(int(e), int(s), float(v)) for e, s, v in LOSS_LINE.findall(text)]


def test_seed_000_net1_runs_on_the_virtual_mesh(tmp_path):
    out = _run_virtual(_script("seed_000_net1.py", tmp_path, virtual=True,
                               without_pending=False), 8, "")
    diff = float(re.search(r"Net1 max difference: (\S+)", out).group(1))
    assert diff <= 1e-5


def test_seed_001_model_train_on_the_virtual_mesh(tmp_path, data_path):
    """Seed 001 as written: AutoParallel(Pipeline(WithLossCell(net, loss), 4,
    stage_config), "semi_auto") without an optimizer, hsdp() (ZeRO level1 inside the 2
    stages of 2 devices: layer1's 1.6 MB weight and its state split), pipeline(stages=2),
    data parallel, Model(network=..., optimizer=nn.SGD(...)).train(2, MnistDataset,
    [LossMonitor(1)]): MindSpore's lines, a falling loss (equal to the run without
    hsdp(): 2.29108, 2.26714, 2.24742, 2.23291)."""
    out = _run_virtual(_script("seed_001_model_train.py", tmp_path, virtual=True,
                               without_pending=False), 4, data_path)
    losses = _losses(out)
    assert [(e, s) for e, s, _ in losses] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert losses[-1][2] < losses[0][2]


def test_seed_003_model_train_on_the_virtual_mesh(tmp_path, data_path):
    """Seed 003 as written: its set_inputs with the Symbol s0 shared by the input and
    the label (unique=False), the Primitive strategies on 8 devices,
    SoftmaxCrossEntropyWithLogits(True) (reduction "none") and nn.SGD, trained by
    Model for 5 epochs."""
    out = _run_virtual(_script("seed_003_dynamic_shape.py", tmp_path, virtual=True,
                               without_pending=False), 8, data_path)
    losses = _losses(out)
    assert [e for e, _, _ in losses] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert losses[-1][2] < losses[0][2]


def _launch(script: str, n: int, data_path: str):
    result = launch.run(script, n, [], timeout=600, env={"DATA_PATH": data_path})
    assert result.ok, result.message + "\n" + "\n".join(
        result.output(r)[-3000:] for r in (result.failed_ranks or range(n)))
    return [result.output(r) for r in range(n)]


def test_seed_002_as_written_under_the_launcher(tmp_path, data_path):
    """Seed 002 unchanged (MindSpore's Model, ops.AllReduce) in a 2-process job: every
    rank prints the same averaged loss."""
    outs = _launch(_script("seed_002_manual_parallel.py", tmp_path, virtual=False,
                           without_pending=False), 2, data_path)
    losses = [_losses(o) for o in outs]
    assert [(e, s) for e, s, _ in losses[0]] == [(10, 2)]
    assert losses[0] == losses[1]


def test_seed_001_model_train_under_the_launcher(tmp_path, data_path):
    """Seed 001 as written in a 2-process job: the two pipeline stages are the two
    processes (one device per stage: hsdp() has nothing to split); each prints
    MindSpore's loss lines."""
    outs = _launch(_script("seed_001_model_train.py", tmp_path, virtual=False,
                           without_pending=True), 2, data_path)
    for o in outs:
        assert [(e, s) for e, s, _ in _losses(o)] == [(1, 1), (1, 2), (2, 1), (2, 2)]


# -- under MindSpore's msrun --------------------------------------------------------
# ``seed_scripts/run_seeds.py`` runs several seeds, unchanged, one after the other in
# one job (MindSpore's parallel context reset and its seed set to 0 before each, so
# that seeds drawing their weights without a seed of their own are reproducible): two
# msrun launches cover the four seeds. A seed's reference is the same driver in one
# process on the virtual mesh (``--virtual``).

DRIVER = os.path.join(HERE, "run_seeds.py")
BIN = os.path.dirname(sys.executable)
MSRUN = os.path.join(BIN, "msrun")


def _by_script(text: str) -> dict:
    """A driver's output split at its ``=== <script>`` lines."""
    parts = re.split(r"^=== (\S+)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _msrun(scripts: list, workers: int, data_path: str, tmp_path) -> list:
    """``msrun --worker_num N --local_worker_num N`` of the driver on ``scripts``, as
    a seed's user runs it on one machine; each rank's output, split by script."""
    assert os.path.exists(MSRUN), f"msrun (installed with mindspore) is missing: {MSRUN}"
    logs = tmp_path / f"msrun{workers}"
    env = dict(os.environ, DATA_PATH=data_path,
               PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    env.setdefault("MS_NODE_TIMEOUT", str(launch.collective_timeout(workers)))
    cmd = [MSRUN, "--worker_num", str(workers), "--local_worker_num", str(workers),
           "--master_port", str(_free_port()), "--log_dir", str(logs), "--join", "True",
           "--cluster_time_out", "300", DRIVER, *scripts]
    with launch.job_lock():  # one job at a time, as fshard.launch's jobs
        proc = subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            stdout = proc.communicate(timeout=900)[0]
        except subprocess.TimeoutExpired:
            stdout = "msrun timed out"
        finally:
            if proc.poll() is None:  # msrun, its scheduler and workers: one group
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    texts = [(logs / f"worker_{r}.log").read_text(errors="replace")
             if (logs / f"worker_{r}.log").exists() else "" for r in range(workers)]
    assert proc.returncode == 0, stdout[-2000:] + "\n".join(
        f"--- worker {r}\n" + "\n".join(line for line in t.splitlines()
                                         if not line.startswith("["))[-3000:]
        for r, t in enumerate(texts))
    return [_by_script(t) for t in texts]


@pytest.fixture(scope="module")
def virtual_reference(data_path, tmp_path_factory):
    """Seeds 001 and 003 through the driver in one process on 8 virtual devices. In a
    job, each of seed 003's processes reads the whole dataset (its loader has no
    num_shards) and passes it as its slice (MindSpore's data_parallel): the global
    batch is 8 copies of each batch, whose summed loss (reduction "none") has 8 times
    the gradient of one copy's; its reference is seed 003 with the learning rate
    times 8 (nothing else changed)."""
    tmp = tmp_path_factory.mktemp("reference")
    text = Path(HERE, "seed_003_dynamic_shape.py").read_text()
    line = "optimizer = nn.SGD(net.trainable_params(), 1e-3)"
    assert line in text
    lr8 = tmp / "seed_003_dynamic_shape.py"
    lr8.write_text(text.replace(line, line.replace("1e-3", "8e-3")))
    out = _run_virtual_driver([os.path.join(HERE, "seed_001_model_train.py"), str(lr8)],
                              8, data_path, str(tmp))
    return {k: _losses(v) for k, v in _by_script(out).items()}


def _run_virtual_driver(scripts: list, devices: int, data_path: str, cwd: str) -> str:
    env = dict(os.environ, FSHARD_DEVICES=str(devices), DATA_PATH=data_path)
    out = subprocess.run([sys.executable, DRIVER, "--virtual", *scripts], env=env,
                         capture_output=True, text=True, timeout=900, cwd=cwd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout


def _assert_losses_equal(got: list, want: list, what: str) -> None:
    assert [(e, s) for e, s, _ in got] == [(e, s) for e, s, _ in want], (what, got, want)
    for (e, s, g), (_, _, w) in zip(got, want):
        assert abs(g - w) <= 1e-5 * max(1.0, abs(w)), (what, e, s, g, w)


def test_seeds_002_and_001_under_msrun(tmp_path, data_path, virtual_reference):
    """``msrun --worker_num 2 --local_worker_num 2`` of seeds 002 and 001, unchanged:
    seed 002 (MindSpore's own Model and ops.AllReduce, each rank its half of every
    batch) prints the same averaged loss on both ranks, equal to the same driver
    under fshard.launch; seed 001 (its two pipeline stages the two processes) prints
    on every rank the losses of the virtual mesh of 8."""
    seeds = [os.path.join(HERE, "seed_002_manual_parallel.py"),
             os.path.join(HERE, "seed_001_model_train.py")]
    ranks = _msrun(seeds, 2, data_path, tmp_path)
    s002 = [_losses(r["seed_002_manual_parallel.py"]) for r in ranks]
    assert [(e, s) for e, s, _ in s002[0]] == [(10, 2)] and s002[0] == s002[1], s002
    result = launch.run(DRIVER, 2, [seeds[0]], timeout=600, env={"DATA_PATH": data_path},
                        log_dir=str(tmp_path / "launch"))
    assert result.ok, result.message
    for r in range(2):
        assert _losses(_by_script(result.output(r))["seed_002_manual_parallel.py"]) \
            == s002[0]
    want = virtual_reference["seed_001_model_train.py"]
    assert [(e, s) for e, s, _ in want] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r, out in enumerate(ranks):
        _assert_losses_equal(_losses(out["seed_001_model_train.py"]), want,
                             f"seed 001, rank {r}")


def test_seeds_000_and_003_under_msrun_with_8_processes(tmp_path, data_path,
                                                        virtual_reference):
    """``msrun --worker_num 8`` (the seeds' 8 devices) of seeds 000 and 003: seed 000's
    Net1 runs its block1 as fs.shard in the job (MindSpore's own Cell.shard would
    compile it with its partitioner, which refuses the CPU; its two calls agree, and
    ``cell_shard_in_job.py`` checks such a call against NumPy); seed 003 (its
    set_inputs declaring each process's slice, data_parallel) prints on every rank the
    losses of its reference."""
    seeds = [os.path.join(HERE, "seed_000_net1.py"),
             os.path.join(HERE, "cell_shard_in_job.py"),
             os.path.join(HERE, "seed_003_dynamic_shape.py")]
    ranks = _msrun(seeds, 8, data_path, tmp_path)
    want = virtual_reference["seed_003_dynamic_shape.py"]
    assert [e for e, _, _ in want] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    for r, out in enumerate(ranks):
        diff = float(re.search(r"Net1 max difference: (\S+)",
                               out["seed_000_net1.py"]).group(1))
        assert diff <= 1e-5, (r, diff)
        check = out["cell_shard_in_job.py"]
        diff = float(re.search(r"cell.shard eager max difference: (\S+)", check).group(1))
        assert diff <= 1e-5 and "runs in: fshard." in check, (r, check)
        _assert_losses_equal(_losses(out["seed_003_dynamic_shape.py"]), want,
                             f"seed 003, rank {r}")


def test_seeds_000_and_003_under_the_launcher_with_8_processes(tmp_path, data_path,
                                                               virtual_reference):
    """The same job as above under ``python -m fshard.launch -n 8``."""
    seeds = [os.path.join(HERE, "seed_000_net1.py"),
             os.path.join(HERE, "seed_003_dynamic_shape.py")]
    result = launch.run(DRIVER, 8, seeds, timeout=900, env={"DATA_PATH": data_path},
                        log_dir=str(tmp_path))
    assert result.ok, result.message
    want = virtual_reference["seed_003_dynamic_shape.py"]
    for r in range(8):
        out = _by_script(result.output(r))
        diff = float(re.search(r"Net1 max difference: (\S+)",
                               out["seed_000_net1.py"]).group(1))
        assert diff <= 1e-5, (r, diff)
        _assert_losses_equal(_losses(out["seed_003_dynamic_shape.py"]), want,
                             f"seed 003, rank {r}")
