"""Per-process train state and step time of a pipelined job (docs/pipeline.md, "In a
multi-process job"): the MLP ``MD -> MH -> MD`` (default 256 -> 1024 -> 256) cut into 2
stages, Adam (``CLIP=1``: a global-norm clip before it), batch 64 (each process passing
its data-parallel slice), ``M = 4``, 1F1B, ``output_broadcast``; ``STEPS`` steps
(default 40), each waiting for its loss. ``TP=1``: tensor-parallel stages
(``parameter_plan``: ``w1`` in column blocks, ``w2`` in row blocks over a stage's
processes), whose state each process keeps in its blocks (``fs.ShardedArray``).

    python -m fshard.launch -n 2 benchmarks/pipeline_job_state.py OUT_DIR   # 2 x 1
    python -m fshard.launch -n 4 benchmarks/pipeline_job_state.py OUT_DIR   # 2 x 2
    TP=1 python -m fshard.launch -n 4 benchmarks/pipeline_job_state.py OUT_DIR   # tp=2

Each rank writes ``OUT_DIR/m<rank>.json``: the bytes of the parameters and optimizer
state its state keeps (an ``fs.RemoteArray`` keeps none, an ``fs.ShardedArray`` its block), the median and minimum step
time after 5 warm-up steps, the load average, the last loss and ``memory_report``.
"""
import json
import os
import sys
import time

import numpy as np

import fshard as fs

fs.distributed.init()
rank, world = fs.distributed.rank(), fs.distributed.world_size()
dp = world // 2
D, H = int(os.environ.get("MD", "256")), int(os.environ.get("MH", "1024"))
rng = np.random.default_rng(0)
params = {"w1": rng.normal(0, 0.05, (D, H)).astype(np.float32), "b1": np.zeros(H, np.float32),
          "w2": rng.normal(0, 0.05, (H, D)).astype(np.float32), "b2": np.zeros(D, np.float32)}
B = 64
batches = [(rng.normal(size=(B, D)).astype(np.float32), rng.integers(0, D, B)) for _ in range(4)]

def loss(p, x, y):
    h = fs.ops.relu(x @ p["w1"] + p["b1"])
    h = fs.pipeline_split(h)
    return fs.ops.softmax_cross_entropy(h @ p["w2"] + p["b2"], y)

opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adam(1e-3)) \
    if os.environ.get("CLIP") else fs.optim.adam(1e-3)
ap = fs.AutoParallel(loss, opt).pipeline(stages=2, micro_batches=4, output_broadcast=True)
if os.environ.get("TP"):
    ap.parameter_plan({"w1": (1, dp), "w2": (dp, 1)})
state = ap.init(params)
j = rank % dp
times = []
for i in range(int(os.environ.get("STEPS", "40"))):
    x, y = batches[i % 4]
    b = B // dp
    t0 = time.perf_counter()
    state, l = ap(state, x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
    l.asnumpy()
    times.append(time.perf_counter() - t0)

def nb(x):
    if type(x).__name__ == "RemoteArray":
        return 0
    if isinstance(x, fs.ShardedArray):  # (this process's block)
        x = x.block
    a = fs.typeof(x)
    return int(a.size * np.dtype(fs.dtypes.to_numpy(a.dtype)).itemsize)

out = {"rank": rank, "params": sum(map(nb, fs.tree.leaves(state.params))),
       "opt_state": sum(map(nb, fs.tree.leaves(state.opt_state))),
       "median_ms": 1e3 * float(np.median(times[5:])), "min_ms": 1e3 * float(np.min(times[5:])),
       "load": os.getloadavg()[0], "loss": float(l.asnumpy()),
       "report": ap.memory_report(state, x[:b], y[:b])}
with open(os.path.join(sys.argv[1], f"m{rank}.json"), "w") as fh:
    json.dump(out, fh)
