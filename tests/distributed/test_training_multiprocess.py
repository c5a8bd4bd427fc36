"""Training and checkpoints in real jobs: one 4-process and one 2-process launch of
tests/distributed/training_checks.py (a launch costs ~15 s of start-up, so every check
shares it).

- data parallelism with each process feeding its own slice (``dataset_strategy
  ("data_parallel")``): 50 Adam steps of the digits MLP on 2 and 4 processes (and on a
  virtual mesh of 8) give the losses and parameters of one process (rtol 1e-5);
- ``fs.shard(..., dataset_strategy="data_parallel")`` with per-process slices;
- the dataset strategy set by ``ms.set_auto_parallel_context``, for fs.shard and for
  seed 001's ``nn.CrossEntropyLoss`` trained by fs.AutoParallel (equal to one process);
- a Cell whose MatMul carries ``ops.MatMul().shard(((2, 2), (2, 1)))`` trains under
  ``fs.AutoParallel`` on 4 processes with that strategy, equal to one process;
- the 2 x 2 (dp x mp) Adam training with ZeRO level1 on 4 processes equals one process
  at every step; its checkpoint, saved by 4 processes, resumes on 2 processes with
  ZeRO level3, on 1 process and on a virtual mesh of 8 with another strategy, the
  losses continuing those of the uninterrupted run;
- fs.checkpoint's sharded save in a 2-process job, and a process killed during a save
  leaving the previous checkpoint complete and loadable.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import fshard as fs
from fshard import checkpoint as ckpt
from fshard import launch

# launched jobs: the full matrix (tests/test_launch.py has the quick run's one job)
pytestmark = pytest.mark.full

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "training_checks.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

import checkpoint_checks  # noqa: E402
import train_autoparallel as example  # noqa: E402
import training_checks  # noqa: E402


def _detail(result, n):
    return result.message + "\n" + "\n".join(
        result.output(r)[-3000:] for r in (result.failed_ranks or range(n)))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("training")
    four = launch.run(SCRIPT, 4, [str(out)], timeout=600)
    assert four.ok, _detail(four, 4)
    two = launch.run(SCRIPT, 2, [str(out)], timeout=600)
    # the last check kills process 1 (exit 7) in the middle of a save
    assert not two.ok and two.failed_ranks == [1], _detail(two, 2)
    assert two.ranks[1].returncode == 7, _detail(two, 2)
    reports = {}
    for size in (4, 2):
        reports[size] = []
        for r in range(size):
            with open(out / f"training{size}_rank{r}.json") as fh:
                reports[size].append(json.load(fh))
    return out, reports


def _data_parallel(mesh, steps=training_checks.DP_STEPS):
    ap = example.make(mesh=mesh)
    state = ap.init(example.init_params())
    losses = []
    for x, y in example.batches(steps):
        state, loss = ap(state, x, y)
        losses.append(float(loss.asnumpy()))
    return losses, {k: v.asnumpy() for k, v in state.params.items()}


@pytest.fixture(scope="module")
def one_process():
    return _data_parallel(1)


def _close(got, want, rtol):
    np.testing.assert_allclose(got, want, rtol=rtol,
                               atol=rtol * max(1.0, float(np.abs(want).max())))


def test_a_primitive_shard_strategy_trains_in_4_processes_like_one_process(jobs):
    _, reports = jobs
    ap = fs.AutoParallel(training_checks.strategy_net(None), fs.optim.sgd(0.1), mesh=1)
    state = ap.init()
    want = []
    for _ in range(training_checks.STRATEGY_STEPS):
        state, loss = ap(state, *training_checks.strategy_batch())
        want.append(float(loss.asnumpy()))
    assert want[-1] < want[0]
    for r, rep in enumerate(reports[4]):
        assert rep["strategy_net"]["matmul"] == [[2, 2], [2, 1]], r
        np.testing.assert_allclose(rep["strategy_net"]["losses"], want, rtol=1e-5,
                                   err_msg=f"rank {r}")


@pytest.mark.parametrize("size", [2, 4])
def test_data_parallel_with_per_process_slices_equals_one_process(jobs, one_process, size):
    _, reports = jobs
    ref_losses, ref_params = one_process
    assert ref_losses[-1] < 0.5 * ref_losses[0]
    for r, rep in enumerate(reports[size]):
        dp = rep["data_parallel"]
        assert dp["step"] == training_checks.DP_STEPS
        np.testing.assert_allclose(dp["losses"], ref_losses, rtol=1e-5, err_msg=f"rank {r}")
        for k, want in ref_params.items():
            _close(np.asarray(dp["params"][k], np.float32), want, 1e-5)


@pytest.mark.parametrize("size", [2, 4])
def test_a_jobs_repeated_step_runs_only_the_program_of_what_it_is_passed(jobs, size):
    # A job's repeated call skips placing the state and the slices: the whole state of
    # ap.init after the steps' blocks, and an uneven batch after even ones, must still
    # run their own programs (training_checks.hot_path).
    _, reports = jobs
    ap = example.make(mesh=1)
    x, y = next(example.batches(1))
    state, want = ap.init(example.init_params()), []
    for _ in range(4):
        state, loss = ap(state, x, y)
        want.append(float(loss.asnumpy()))
    want.append(want[0])
    b = example.BATCH // size
    short = np.r_[0:b - size, b:example.BATCH]  # process 0 `size` rows short
    for rows in (short, slice(None)):
        state, loss = ap(state, x[rows], y[rows])
        want.append(float(loss.asnumpy()))
    assert want[3] < want[0]
    for r, rep in enumerate(reports[size]):
        got = rep["hot_path"]
        np.testing.assert_allclose(got["losses"], want, rtol=1e-5, err_msg=f"rank {r}")
        # the hot path ran the 3rd, 4th and last steps (the first two place the state)
        assert got["first_calls"] == 4, (r, got["first_calls"])
        for k, v in state.params.items():
            _close(np.asarray(got["params"][k], np.float32), v.asnumpy(), 1e-5)


def test_data_parallel_on_a_virtual_mesh_of_8_equals_one_process(one_process):
    losses, params = _data_parallel(8)
    np.testing.assert_allclose(losses, one_process[0], rtol=1e-5)
    for k, want in one_process[1].items():
        _close(params[k], want, 1e-5)


@pytest.mark.parametrize("size", [2, 4])
def test_shard_data_parallel_takes_and_returns_each_process_rows(jobs, size):
    _, reports = jobs
    for rep in reports[size]:
        for how in ("eager", "jit"):
            got = rep["shard"][how]
            assert got == {"rows": True, "shape": [3, 2], "total": True}, (how, got)


@pytest.mark.parametrize("size", [2, 4])
def test_shard_can_return_process_local_blocks(jobs, size):
    _, reports = jobs
    for rep in reports[size]:
        got = rep["process_local"]
        assert got["eager"] and got["jit"], got
        assert len(got["errors"]) == 5, got["errors"]
        for msg in got["errors"]:
            assert "holds only its block" in msg and "x.gather()" in msg, msg
        # eager operators and Tensor methods too (not a raw TypeError / AttributeError)
        assert got["errors"][3].startswith("the eager operator '+' needs"), got["errors"]
        assert got["errors"][4].startswith("the Tensor method .sum needs"), got["errors"]


@pytest.fixture(scope="module")
def uninterrupted():
    return example.train(2 * training_checks.RESUME_STEPS)


def test_2x2_adam_training_in_4_processes_matches_one_process(jobs, uninterrupted):
    _, reports = jobs
    for r, rep in enumerate(reports[4]):
        np.testing.assert_allclose(rep["resume"]["losses"], uninterrupted, rtol=1e-5,
                                   err_msg=f"rank {r}")
    # the checkpoint's layouts are the plan's: w1 split by columns over mp
    assert reports[4][0]["resume"]["param_layouts"] == {
        "w1": [1, 2], "b1": [2], "w2": [2, 1], "b2": [1]}


def test_split_state_stays_process_local_across_steps(jobs):
    """In a job the split leaves of the train state are fs.ShardedArrays (each process
    holds its blocks): the steps take and return them with no AllGather of the state,
    and reading one as NumPy is an error naming the fix."""
    _, reports = jobs
    for size in (4, 2):
        for r, rep in enumerate(reports[size]):
            assert rep["resume"]["boundary_gathers"] == 0, (size, r)
    res = reports[4][0]["resume"]
    for leaf in ("[0]['w1']", "[0]['b1']", "[0]['w2']"):  # split over mp
        assert leaf in res["local_leaves"], res["local_leaves"]
    # ZeRO level1: the optimizer state too (Adam's moments of w1, split over dp and mp)
    assert sum(p.startswith("[1]") for p in res["local_leaves"]) >= 6, res["local_leaves"]
    assert "holds only its block" in res["refused"] and "gather()" in res["refused"]
    assert all(rep["resume"]["loaded_local_leaves"] > 0 for rep in reports[2])


def test_each_process_reads_only_the_blocks_it_needs(jobs):
    """Loading into process-local values reads the saved blocks overlapping this
    process's blocks (and their files' headers), nothing else; the values are the
    saved bits."""
    _, reports = jobs
    for size in (4, 2):
        for r, rep in enumerate(reports[size]):
            read = rep["resume"]["read"]
            assert read["bytes"] == read["own_blocks"], (size, r, read)
            # 4 processes hold a quarter to a half of every split leaf; on 2, ZeRO-3's
            # rows overlap both column blocks of w1 saved by the 2 x 2 run
            assert read["bytes"] < (0.6 if size == 4 else 0.95) * read["checkpoint"], (
                size, r, read)
    for rep in reports[4]:
        assert rep["resume"]["loaded_blocks_identical"]


def test_a_4_process_checkpoint_is_bit_identical_on_1_process(jobs):
    out, _ = jobs
    ap = example.make()
    state = ckpt.load(out / "ckpt4", ap.init(example.init_params()))
    saved = np.load(out / "saved4.npz")
    leaves = __import__("fshard").tree.leaves(state)
    assert len(leaves) == len(saved.files)
    for i, v in enumerate(leaves):
        assert v.asnumpy().tobytes() == saved[f"leaf{i}"].tobytes(), i


def _resume(out, ap):
    state = ckpt.load(out / "ckpt4", ap.init(example.init_params()))
    losses = []
    for x, y in list(example.batches(2 * training_checks.RESUME_STEPS))[
            training_checks.RESUME_STEPS:]:
        state, loss = ap(state, x, y)
        losses.append(float(loss.asnumpy()))
    return losses


@pytest.mark.parametrize("where", ["2 processes, ZeRO level3", "1 process",
                                   "virtual mesh of 8, dp 4 x mp 2"])
def test_the_4_process_checkpoint_resumes_elsewhere(jobs, where):
    out, reports = jobs
    tail = reports[4][0]["resume"]["losses"][training_checks.RESUME_STEPS:]
    if where.startswith("2 processes"):
        for rep in reports[2]:
            assert rep["resume"]["step"] == 2 * training_checks.RESUME_STEPS
            np.testing.assert_allclose(rep["resume"]["losses"], tail, rtol=1e-6)
        return
    ap = example.make() if where == "1 process" else example.make(mp=2, mesh=8)
    np.testing.assert_allclose(_resume(out, ap), tail, rtol=1e-6)


def test_two_processes_save_their_blocks_and_survive_a_killed_save(jobs):
    out, _ = jobs
    ranks = []
    for r in range(2):
        with open(out / f"rank{r}.json") as fh:
            ranks.append(json.load(fh))
    root = out / "ckpt"
    assert ranks[0]["dir"] == ranks[1]["dir"] == str(root / "1")
    assert ranks[0]["processes"] == 2
    assert ranks[0]["files"] == ["shard-00000-of-00002.safetensors",
                                 "shard-00001-of-00002.safetensors"]
    # w is split (2, 1), b (2,), step whole: process 0 holds block 0 of each and the
    # step, process 1 block 1 of w and b. Leaves are numbered in key order: b, step, w.
    assert ranks[0]["keys"] == ["0:0", "1:", "2:0,0"]
    assert ranks[1]["keys"] == ["0:1", "2:1,0"]
    # The killed save: no step 2, the step 1 checkpoint intact and the newest.
    assert not (root / "2").exists()
    assert any(d.startswith(".tmp-2-") for d in os.listdir(root))
    assert ckpt.latest(root) == str(root / "1")
    back = ckpt.load(root, checkpoint_checks.state())
    for k, v in checkpoint_checks.state().items():
        assert back[k].asnumpy().tobytes() == np.asarray(v).tobytes()


@pytest.mark.full
@pytest.mark.parametrize("size", [2, 4])
def test_context_dataset_strategy_and_seed_loss_in_a_job(jobs, size):
    """ms.set_auto_parallel_context(dataset_strategy="data_parallel") is honoured in a
    job: fs.shard takes and returns each process's rows; seed 001's loss (which
    captures constants) trains with per-process slices to one process's numbers."""
    _, reports = jobs
    want_losses, want_params = training_checks.seed_train(
        fs.AutoParallel(training_checks.seed_cell(), fs.optim.sgd(0.1), mesh=1),
        slice(None))
    for r in range(size):
        got = reports[size][r]["seed_context"]
        assert got["shard_rows"] and got["shard_shape"] == [3, 2], got
        _close(got["losses"], want_losses, 1e-5)
        for k, v in want_params.items():
            _close(got["params"][k], v, 1e-5)
