"""float16 and bfloat16 collectives in a real multi-process job.

``python -m fshard.launch -n 2 tests/distributed/amp_checks.py OUT_DIR``. Every rank runs
``psum`` of float16 and bfloat16 values (replicated, and split over the ranks) under
``fs.jit(fs.shard_map(...))`` on the world mesh and writes the results, as float32, to
``OUT_DIR/rank<k>.json``; tests/test_amp.py compares them with NumPy.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def main(out_dir: str) -> None:
    import mindspore as ms

    import fshard as fs

    fs.distributed.init()
    rank, n = fs.distributed.rank(), fs.distributed.world_size()
    x = np.arange(n * 4 * 3, dtype=np.float32).reshape(n * 4, 3) / 8 + 0.125
    out = {}
    for name, dt in (("float16", ms.float16), ("bfloat16", ms.bfloat16)):
        f = fs.jit(fs.shard_map(lambda v: fs.psum(v * (fs.axis_index("d") + 1).astype(v.dtype),
                                                  "d"),
                                (None,), None, mesh=fs.Mesh((n,), ("d",))))
        s = f(ms.Tensor(x).astype(dt))
        # an input split over the ranks: each takes its rows (a Slice kernel, which
        # CPU runs for bfloat16 where StridedSlice has no bfloat16 kernel)
        g = fs.jit(fs.shard_map(lambda v: fs.psum(v, "d"), ((n, 1),), None,
                                mesh=fs.Mesh((n,), ("d",))))
        b = g(ms.Tensor(x).astype(dt))
        out[name] = {"psum": s.astype(ms.float32).asnumpy().tolist(), "dtype": str(s.dtype),
                     "blocks": b.astype(ms.float32).asnumpy().tolist()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main(sys.argv[1])
