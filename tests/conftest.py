"""Suite-wide settings: seeded randomness and synchronous PyNative execution.

``pynative_synchronize=True`` makes MindSpore run each eager op before returning
instead of queueing it; fshard's eager checks call ``.asnumpy()`` after almost every
op, and with an asynchronous queue each of those waits ~2 ms (the suite runs many
times faster synchronously). Results are identical.
"""

from __future__ import annotations

import os
from pathlib import Path

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


@pytest.fixture(scope="session", autouse=True)
def no_user_calibration(tmp_path_factory):
    """Plans in tests price with the default rates: a table that ``fs.sharding.calibrate``
    cached for this machine (in the user's cache directory) would change them. Tests
    that calibrate write into this empty directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FSHARD_CACHE_DIR", str(tmp_path_factory.mktemp("fshard-cache")))
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


#: Slow checks the quick run leaves to the full matrix, by test id, each because a
#: quicker test of the same feature stays in the quick run (named after the id).
FULL_ONLY = {
    "sharding/test_sharding_rules.py::test_known_unclaimed_layouts_still_exist":
        "a check of the rule table itself; every rule's own cases run quick",
    "test_random.py::test_keys_used_once_are_not_warned_about":
        "test_a_key_consumed_twice_in_a_traced_function_is_a_warning",
    "test_random.py::test_jit_and_vmap_give_the_eager_numbers[truncated_normal]":
        "the other draws' cases; test_truncated_normal_is_the_exact_inverse_cdf...",
    "test_random.py::test_jit_and_vmap_give_the_eager_numbers[split]":
        "the other draws' cases",
    "test_random.py::test_jit_and_vmap_give_the_eager_numbers[randint]":
        "the other draws' cases",
    "test_random.py::test_jit_and_vmap_give_the_eager_numbers[uniform64]":
        "the [uniform] case",
    "test_random.py::test_jit_and_vmap_give_the_eager_numbers[categorical]":
        "the other draws' cases; test_bernoulli_randint_categorical_frequencies",
    "test_random.py::test_jit_and_vmap_give_the_eager_numbers[permutation]":
        "the other draws' cases",
    "test_random.py::test_jit_and_vmap_give_the_eager_numbers[bernoulli]":
        "the other draws' cases; test_bernoulli_randint_categorical_frequencies",
    "test_random.py::test_jit_and_vmap_give_the_eager_numbers[gumbel]":
        "the other draws' cases; test_truncated_normal_and_gumbel_kolmogorov_smirnov",
    "test_gpt.py::test_gpt_pipeline_float16_equals_one_device":
        "test_seed_knobs.py::test_pipeline_float16_gradient_sums_run_in_float32",
    "test_pipeline_stage_update.py::test_global_norm_clip_that_does_not_clip":
        "test_global_norm_clip_sums_the_stages_norms",
    "test_auto_parallel.py::test_hsdp_shards_each_parameter_over_its_data_parallel_group"
    "[-1-level1]": "test_every_configuration_trains_like_one_device[zero1/zero2]",
    "test_pipeline.py::test_unbalanced_stages_warn_with_their_estimated_costs":
        "test_mlp_trains_like_the_unpipelined_run",
    "test_pipeline.py::test_a_cells_parameter_plan_shards_its_stages":
        "test_operator_strategies_in_the_loss_apply_inside_each_stage",
    "test_pipeline.py::test_operator_parallelism_inside_each_stage[2-4-1f1b-False-4]":
        "test_operator_strategies_in_the_loss_apply_inside_each_stage",
    "test_pipeline.py::test_data_parallel_inside_each_stage":
        "test_mlp_trains_like_the_unpipelined_run",
    "test_control_flow.py::test_fori_loop_and_while_loop_inside_shard_map_stay_loops":
        "test_a_sharded_loop_is_one_loop_of_the_per_device_program[fori_loop-8]",
    "test_control_flow.py::test_a_reverse_loop_accumulates_weight_gradients_as_a_pending_"
    "sum[accumulated]": "test_scan_graph_loop_equals_the_unrolled_scan_and_a_python_loop",
    "test_control_flow.py::test_scan_graph_loop_equals_the_unrolled_scan_and_a_python_loop"
    "[True-False]": "its [True-True] case",
    "test_control_flow.py::test_a_sharded_loop_is_one_loop_of_the_per_device_program"
    "[scan-8]": "its [fori_loop-8] case",
    "test_control_flow.py::test_a_sharded_loop_is_one_loop_of_the_per_device_program"
    "[fori_loop-2x4]": "its [fori_loop-8] case",
    "test_dynamic_shapes.py::test_the_seeds_network_trains_on_varying_batches_compiled_once":
        "test_twenty_batch_sizes_compile_once_with_set_inputs_and_mindspore_placeholders",
}


#: The files that take longest in the quick run (15-45 s each on two cores, measured),
#: longest first. pytest-xdist hands whole files to its workers in collection order, so
#: these go first: the run does not end on one worker finishing a long file while the
#: other has nothing left.
LONG_FILES = ("test_random.py", "test_primitive_rules.py", "test_control_flow.py",
              "test_interop.py", "test_pipeline_stage_update.py", "test_launch.py",
              "test_docs_run.py", "test_dynamic_shapes.py", "test_auto_parallel.py",
              "test_gpt.py", "test_ms_oracle.py", "test_hostile_seeds.py",
              "sharding/test_search.py")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    first = {name: k for k, name in enumerate(LONG_FILES)}
    # (a stable sort: the other files, and the tests within a file, keep their order)
    items.sort(key=lambda item: first.get(
        Path(str(item.path)).relative_to(here).as_posix(), len(first)))
    if config.getoption("--full"):
        return
    kept, left = [], []
    for item in items:
        rel = Path(str(item.path)).relative_to(here).as_posix() + "::" + item.name
        (left if item.get_closest_marker("full") or rel in FULL_ONLY else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
