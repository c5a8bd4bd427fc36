"""MindSpore's collective op classes and ops.Print in a real 2-process job (seed 002's per-rank code
under fs.jit, and inside fs.jit(fs.shard_map)), against NumPy; the virtual-mesh
checks are in tests/test_ms_collectives.py."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from fshard import launch

pytestmark = pytest.mark.full  # a launched job

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def test_collective_op_classes_in_a_two_process_job(tmp_path):
    from ms_collective_checks import X

    result = launch.run(os.path.join(HERE, "ms_collective_checks.py"), 2, [str(tmp_path)],
                        timeout=420)
    assert result.ok, result.message + "\n" + "\n".join(result.output(r)[-3000:]
                                                        for r in range(2))
    blocks = np.split(X, 2)
    for r in range(2):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        np.testing.assert_allclose(out["seed_loss"], (X * X).mean(), rtol=1e-6)
        np.testing.assert_allclose(out["all_reduce_max"], np.maximum(*blocks))
        np.testing.assert_allclose(out["all_gather"], X)
        np.testing.assert_allclose(out["reduce_scatter"], np.split(blocks[0] + blocks[1], 2)[r])
        np.testing.assert_allclose(out["broadcast"], blocks[1])
        # AlltoAll(2, split 0, concat 1): rank r gets row-block r of each rank's block
        want = np.concatenate([np.split(b, 2)[r] for b in blocks], axis=1)
        np.testing.assert_allclose(out["all_to_all"], want)
        np.testing.assert_allclose(out["shard_map_all_reduce"],
                                   np.tile(blocks[0] + blocks[1], (2, 1)))
        # ops.Print at run time, per rank, with the rank's own block
        text = result.output(r)
        assert f"rank {r} sees" in text
        assert f"{blocks[r][0][0]:.8e}" in text, text[-2000:]
