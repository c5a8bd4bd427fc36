"""Run inside a 2-process job (by training_checks.py, see test_training_multiprocess.py):
a sharded save where each process writes its own blocks, then a save during which
process 1 dies.

``python -m fshard.launch -n 2 tests/distributed/checkpoint_checks.py OUT_DIR``
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import fshard as fs
from fshard import checkpoint as ckpt


def state():
    return {"w": np.arange(64, dtype=np.float32).reshape(16, 4),
            "b": np.arange(8, dtype=np.float32) - 4, "step": np.int32(3)}


def main(out: str) -> None:
    fs.distributed.init()
    rank = fs.distributed.rank()
    root = os.path.join(out, "ckpt")
    layouts = {"w": (2, 1), "b": (2,), "step": None}
    d = ckpt.save(root, state(), step=1, layouts=layouts)
    with open(os.path.join(d, "index.json")) as fh:
        index = json.load(fh)
    from safetensors import safe_open

    mine = f"shard-{rank:05d}-of-00002.safetensors"
    with safe_open(os.path.join(d, mine), framework="np") as f:
        keys = sorted(f.keys())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"dir": d, "latest": ckpt.latest(root), "keys": keys,
                   "files": sorted(index["files"]), "processes": index["processes"]}, fh)

    if rank == 1:  # die after writing this process's part of step 2, before reporting it
        def die(*args):
            os._exit(7)

        ckpt._mark_done = die
    try:
        ckpt.save(root, {k: v + 1 for k, v in state().items()}, step=2, layouts=layouts,
                  timeout=30)
    except fs.CheckpointError as e:
        with open(os.path.join(out, f"rank{rank}_step2.txt"), "w") as fh:
            fh.write(str(e))
        raise


if __name__ == "__main__":
    main(sys.argv[1])
