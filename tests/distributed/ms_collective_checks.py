"""MindSpore's collective op classes, written as seed 002 writes them, in a real job.

``python -m fshard.launch -n 2 tests/distributed/ms_collective_checks.py OUT_DIR``. Each
rank runs per-rank code (its own slice of the batch, cut with its rank) under
``fs.jit`` with ``ops.AllReduce`` and the others on the job's world, and the same ops
inside ``fs.jit(fs.shard_map(...))``; it writes the results to ``OUT_DIR/rank<k>.json``
for tests/distributed/test_ms_collectives_multiprocess.py to compare with NumPy.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

X = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) / 4 - 2


def main(out_dir: str) -> None:
    import mindspore as ms
    from mindspore import ops
    from mindspore.communication import get_group_size, get_rank
    from mindspore.ops import ReduceOp

    import fshard as fs

    fs.distributed.init()
    cur_rank, device_num = get_rank(), get_group_size()
    shard_size = X.shape[0] // device_num
    all_reduce = ops.AllReduce()

    def seed_loss(x):  # seed 002's pattern: this rank's rows, the loss AllReduce'd
        x = x[cur_rank * shard_size:cur_rank * shard_size + shard_size]
        return all_reduce((x * x).mean()) / device_num

    x = ms.Tensor(X)
    out = {"seed_loss": fs.jit(seed_loss)(x).asnumpy().tolist()}
    mine = x[cur_rank * shard_size:(cur_rank + 1) * shard_size]
    for name, fn in (("all_reduce_max", ops.AllReduce(ReduceOp.MAX)),
                     ("all_gather", ops.AllGather()),
                     ("reduce_scatter", ops.ReduceScatter()),
                     ("broadcast", lambda v: ops.Broadcast(1)((v,))[0]),
                     ("all_to_all", ops.AlltoAll(device_num, 0, 1))):
        out[name] = fs.jit(fn)(mine).asnumpy().tolist()
    sm = fs.jit(fs.shard_map(lambda v: ops.AllReduce()(v), in_strategy=((device_num, 1),),
                             out_strategy=(device_num, 1), mesh=fs.Mesh((device_num,), ("d",))))
    out["shard_map_all_reduce"] = sm(x).asnumpy().tolist()

    def printed(v):  # ops.Print in a job: each rank prints its own values
        ops.Print()(f"rank {cur_rank} sees", v)
        return v + 1
    fs.block_until_ready(fs.jit(printed)(mine))
    with open(os.path.join(out_dir, f"rank{cur_rank}.json"), "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main(sys.argv[1])
