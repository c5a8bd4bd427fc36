"""Suite-wide settings: seeded randomness and synchronous PyNative execution.

``pynative_synchronize=True`` makes MindSpore run each eager op before returning
instead of queueing it; fshard's eager checks call ``.asnumpy()`` after almost every
op, and with an asynchronous queue each of those waits ~2 ms (the suite runs many
times faster synchronously). Results are identical.
"""

from __future__ import annotations

import os

import mindspore as ms
import numpy as np
import pytest

ms.set_context(pynative_synchronize=True)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session", autouse=True)
def one_launched_job_at_a_time(tmp_path_factory):
    """Multi-process jobs of the suite run one at a time, across pytest-xdist's workers:
    two 4-process jobs at once put 10 MindSpore processes on the cores, and a rank
    that arrives late at a collective makes the others give up waiting. Every launch
    goes through ``fshard.launch.run`` (or ``launch.job_lock()`` around ``msrun``),
    which holds the lock file ``FSHARD_LAUNCH_LOCK`` names; the workers share the
    parent of their temporary directories."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get("FSHARD_LAUNCH_LOCK"):
            mp.setenv("FSHARD_LAUNCH_LOCK", str(root / "fshard-launch.lock"))
        yield


# ---------------------------------------------------------------------------
# Quick run and full matrix
# ---------------------------------------------------------------------------
# README's test command runs every public feature at least once in about five minutes
# on two cores. Tests marked ``full`` (every configuration of a matrix, the launched
# multi-process jobs, the notebooks) run only with ``--full``, which `.ci/run` passes.
# They are deselected, not skipped: the quick run reports how many it left out.


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run the full matrix: tests marked `full` too (multi-process jobs, "
                          "notebooks, every configuration)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "full: part of the full matrix only (run with --full); see README")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    kept, left = [], []
    for item in items:
        (left if item.get_closest_marker("full") else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
