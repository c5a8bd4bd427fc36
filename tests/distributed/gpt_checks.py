"""The GPT decoder of examples/train_gpt.py trained in a real 4-process job.

``python -m fshard.launch -n 4 tests/distributed/gpt_checks.py OUT_DIR``: every rank
trains each configuration of ``CONFIGS`` (2 x 2 over the job's four processes, float16
with loss scaling and recomputation) for ``STEPS`` steps, every process passing the
whole batch, and writes ``OUT_DIR/rank<k>.json`` with the losses and skipped steps;
tests/test_gpt.py compares them with one process's float32 run. All configurations
share one launch (start-up is the slow part).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

STEPS, LAYERS = 3, 2

# name -> build() arguments
CONFIGS = {
    "dp2_tp2_sp": dict(dp=2, tp=2, sp=True, amp=True, remat=True),
    "pp2_tp2_sp": dict(pp=2, tp=2, sp=True, amp=True, remat=True),
    "pp2_dp2": dict(pp=2, dp=2, amp=True, remat=True),
}


def main(out_dir: str) -> None:
    import fshard as fs
    import train_gpt as gpt

    fs.distributed.init()
    rank = fs.distributed.rank()
    results = {"rank": rank, "world": fs.distributed.world_size(), "configs": {}}
    for name, config in CONFIGS.items():
        losses, skipped = gpt.train(STEPS, layers=LAYERS, **config)
        results["configs"][name] = {"losses": losses, "skipped": skipped}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main(sys.argv[1])
