"""fs.checkpoint in a real 2-process job: each process writes only its own blocks, and
a process killed during a save leaves the previous checkpoint complete and loadable."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from fshard import checkpoint as ckpt
from fshard import launch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import checkpoint_checks  # noqa: E402


def test_two_processes_save_their_blocks_and_survive_a_killed_save(tmp_path):
    result = launch.run(os.path.join(HERE, "checkpoint_checks.py"), 2, [str(tmp_path)],
                        timeout=300)
    # Process 1 dies (exit 7) in the middle of the second save.
    assert not result.ok and 1 in result.failed_ranks, result.message
    assert result.ranks[1].returncode == 7, result.message
    ranks = []
    for r in range(2):
        with open(tmp_path / f"rank{r}.json") as fh:
            ranks.append(json.load(fh))
    root = tmp_path / "ckpt"
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
