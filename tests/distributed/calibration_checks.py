"""``fs.sharding.calibrate()`` inside a job started by ``fshard.launch`` (see
tests/distributed/test_calibrate_multiprocess.py): every rank measures the job, keeps
rank 0's numbers and caches them; a plan of the job is then priced with them. Writes
``rank<r>.json`` into the directory given."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def main(out_dir: str) -> None:
    os.environ["FSHARD_CACHE_DIR"] = os.path.join(out_dir, "cache")
    from mindspore import Tensor

    import fshard as fs
    from fshard.errors import ShardingError
    from fshard.sharding import rates

    fs.distributed.init()
    n, r = fs.distributed.world_size(), fs.distributed.rank()
    try:
        fs.sharding.calibrate(devices=n + 1)
        refused = ""
    except ShardingError as e:
        refused = str(e)
    default = fs.shard(lambda x: x.sum(), in_strategy=((n, 1),)).explain(
        Tensor(np.ones((8, 4), np.float32)))
    table = fs.sharding.calibrate(runs=2)
    rng = np.random.default_rng(0)  # the same inputs on every rank
    p = {"w0": Tensor(rng.standard_normal((32, 64)).astype(np.float32) / 6),
         "w1": Tensor(rng.standard_normal((64, 10)).astype(np.float32) / 8)}
    x = Tensor(rng.standard_normal((64, 32)).astype(np.float32))

    def loss(p, x):
        return (fs.ops.relu(x @ p["w0"]) @ p["w1"]).square().mean()

    f = fs.shard(fs.value_and_grad(loss), in_strategy=({"w0": (1, 1), "w1": (1, 1)},
                                                       (n, 1)))
    e = f.explain(p, x)
    step = fs.jit(f)
    fs.block_until_ready(step(p, x))
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        fs.block_until_ready(step(p, x))
        times.append(time.perf_counter() - t0)
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as fh:
        json.dump({"refused": refused, "table": table,
                   "saved": rates.cache_path(n, job=True).name,
                   "exists": rates.cache_path(n, job=True).exists(),
                   "default_call_s": default.call_s, "call_s": e.call_s,
                   "predicted_s": e.total_s, "measured_s": float(np.median(times))}, fh)


if __name__ == "__main__":
    main(sys.argv[1])
