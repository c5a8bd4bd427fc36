"""Collectives, shard_map and the data-parallel example in real 2- and 4-process jobs.

Each job runs tests/distributed/collective_checks.py once (a launch costs ~15 s of
start-up, so every check shares it): every collective and its gradient through
``fs.jit(fs.shard_map(...))`` against the same function on a virtual mesh, the
example's training losses, and the lowered source of one program on every rank.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

import numpy as np
import pytest

from fshard import launch

# launched jobs: the full matrix (tests/test_launch.py has the quick run's one job)
pytestmark = pytest.mark.full

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "collective_checks.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

_COLLECTIVE_CALL = re.compile(r"\b(AllReduce|AllGather|Broadcast|ReduceScatter)_\d+\(")


def _run(n: int, tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp(f"collectives{n}"))
    result = launch.run(SCRIPT, n, [out], timeout=420)
    assert result.ok, result.message + "\n" + "\n".join(
        result.output(r)[-3000:] for r in result.failed_ranks or range(n))
    ranks = []
    for r in range(n):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            ranks.append(json.load(fh))
        with open(os.path.join(out, f"lowered_rank{r}.py")) as fh:
            ranks[-1]["lowered"] = fh.read()
    assert len(glob.glob(os.path.join(out, "rank*.json"))) == n
    return ranks


@pytest.fixture(scope="module", params=[2, 4], ids=["2-processes", "4-processes"])
def job(request, tmp_path_factory):
    return request.param, _run(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def reference_losses():
    import collective_checks
    import data_parallel_mlp as example

    return example.train(collective_checks.EXAMPLE_STEPS)


def test_every_collective_matches_the_virtual_mesh(job):
    n, ranks = job
    checks = ranks[0]["checks"]
    expected = {"psum", "pmean", "pmax", "pmin", "all_gather", "all_gather_tiled",
                "psum_scatter", "all_to_all", "ppermute_ring", "ppermute_partial", "broadcast",
                "axis_index", "ring_attention", "ring_attention_causal_zigzag", "eager_shard_map", "eager_grad_shard_map", "grad_inside_value",
                "grad_inside_grads", "scan_psum_in_shard_map", "scan_psum_is_a_loop"}
    expected |= {"int_psum", "int_pmax", "int_pmin", "int_all_gather", "int_ppermute_ring",
                 "int_broadcast", "int_all_to_all", "bool_all_gather", "bool_pmax",
                 "bool_pmin", "bool_ppermute_ring", "bool_broadcast"}
    expected |= {f"int_{kind}_all_gather_{dt}" for kind in ("rows", "stacked")
                 for dt in ("int8", "uint8", "int16", "int32", "int64")}
    expected |= {f"int_rows_all_gather_{dt}_lowered"
                 for dt in ("int8", "uint8", "int16", "int32", "int64")}
    if n == 4:
        expected |= {k for k in checks if k.startswith("2d_")}
        expected |= {"int_2d_all_gather_b", "int_2d_psum_a", "bool_2d_all_gather_b"}
        assert len([k for k in checks if k.startswith("2d_")]) == 11
    assert expected <= set(checks)
    bad = {k: v for k, v in checks.items() if v > 1e-5}
    assert not bad, f"real collectives differ from the virtual mesh: {bad}"


def test_gradients_through_real_collectives(job):
    n, ranks = job
    grads = ranks[0]["grads"]
    assert len(grads) == (8 if n == 2 else 12)
    bad = {k: v for k, v in grads.items() if v > 1e-5}
    assert not bad, f"gradients differ from the virtual mesh: {bad}"


def test_every_rank_got_the_same_results(job):
    n, ranks = job
    for r in ranks[1:]:
        assert r["checksums"].keys() == ranks[0]["checksums"].keys()
        for k, v in r["checksums"].items():
            np.testing.assert_allclose(v, ranks[0]["checksums"][k], rtol=1e-6, err_msg=k)


def test_every_rank_issued_the_same_collectives(job):
    n, ranks = job
    sequences = [_COLLECTIVE_CALL.findall(r["lowered"]) for r in ranks]
    assert len(sequences[0]) >= 5
    assert all(s == sequences[0] for s in sequences)
    masked = [re.sub(r"\d+|True|False", "#", r["lowered"].split("def ", 1)[1]) for r in ranks]
    assert all(m == masked[0] for m in masked)


def test_example_losses_match_single_process_training(job, reference_losses):
    n, ranks = job
    for r in ranks:
        np.testing.assert_allclose(r["losses"], reference_losses, rtol=1e-5)
