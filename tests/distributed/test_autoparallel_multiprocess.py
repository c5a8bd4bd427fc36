"""fs.AutoParallel in a real 4-process job: the digits MLP with Adam, data x model
parallel 2 x 2 (sub-group collectives) and ZeRO level1, every step's loss equal to
one process training on the whole batch (examples/train_autoparallel.py)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from fshard import launch

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "train_autoparallel.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))

import train_autoparallel as example  # noqa: E402

STEPS = 20


def test_2x2_adam_training_in_4_processes_matches_one_process(tmp_path):
    out = str(tmp_path / "losses")
    result = launch.run(EXAMPLE, 4, ["--steps", str(STEPS), "--mp", "2", "--zero", "level1",
                                     "--out", out], timeout=420)
    assert result.ok, result.message
    assert f"epoch: 1 step: {STEPS}, loss is" in result.output(0)
    reference = example.train(STEPS)
    for rank in range(4):
        with open(f"{out}.rank{rank}.json") as fh:
            losses = json.load(fh)
        np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg=f"rank {rank}")
    assert reference[-1] < 0.5 * reference[0]
