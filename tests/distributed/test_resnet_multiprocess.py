"""mindcv's ResNet-18 trained data parallel in a 2-process job (examples/train_resnet.py
under ``fshard.launch -n 2``, each process feeding its own half of every batch) gives
one process's losses on every rank: BatchNorm normalises with the statistics of the
global batch, as in one process (see tests/test_train_cnn.py)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from fshard import launch

# launched jobs: the full matrix
pytestmark = [pytest.mark.full,
              pytest.mark.filterwarnings("ignore::fshard.errors.GenericOpWarning")]

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.abspath(os.path.join(HERE, "..", "..", "examples", "train_resnet.py"))
sys.path.insert(0, os.path.dirname(EXAMPLE))

import train_resnet as example  # noqa: E402

# 2 steps: training ResNet-18 from random weights amplifies rounding differences from
# step 3 on, at every input size, batch and learning rate tried (tests/test_train_cnn.py
# has the measurements)
STEPS, BATCH, SIZE = 2, 8, 32


def test_resnet18_in_a_2_process_job_equals_one_process(tmp_path):
    out = tmp_path / "losses"
    result = launch.run(EXAMPLE, 2, ["--steps", str(STEPS), "--batch", str(BATCH),
                                     "--size", str(SIZE), "--log-every", "2",
                                     "--out", str(out)], timeout=900)
    assert result.ok, result.message + "\n" + "\n".join(result.output(r)[-3000:]
                                                          for r in range(2))
    assert f"epoch: 1 step: {STEPS}, loss is" in result.output(0)
    reference, _ = example.train(STEPS, BATCH, SIZE)
    for rank in range(2):
        with open(f"{out}.rank{rank}.json") as fh:
            np.testing.assert_allclose(json.load(fh), reference, rtol=1e-4,
                                       err_msg=f"rank {rank}")
