"""Saving a pipelined job's state split by stage (docs/pipeline.md, "In a multi-process
job"): ``fs.checkpoint.save(path, state)`` of the split state, each process writing its
own stage's leaves, against ``fs.checkpoint.save(path, ap.gather(state))`` (every
stage's leaves gathered onto every process, process 0 writing them all); and loading it
back split (``like=state``) against whole (``like=ap.init(params)``).

The MLP ``MD -> MH -> MD`` (default 1024 -> 4096 -> 1024: 32 MiB of float32 parameters,
96 MiB with Adam's moments) cut into 2 stages, one Adam step of batch 64 first.

    python -m fshard.launch -n 2 benchmarks/pipeline_job_checkpoint.py OUT_DIR   # 2 x 1
    python -m fshard.launch -n 4 benchmarks/pipeline_job_checkpoint.py OUT_DIR   # 2 x 2

``REPS`` (default 5) saves of each kind, alternating, each into a new step directory
of ``OUT_DIR`` (removed after it is timed). Each rank writes ``OUT_DIR/c<rank>.json``:
per kind the median and minimum seconds of the save (for "gathered", ``ap.gather`` plus
``save``, and the gather's median alone; process 0's save includes waiting for every
process and writing the index, the others' wait for the index), the median seconds of
loading it split and whole, the bytes of its own shard file, and the load average.
"""
import json
import os
import shutil
import sys
import time

import numpy as np

import fshard as fs

fs.distributed.init()
rank, world = fs.distributed.rank(), fs.distributed.world_size()
dp = world // 2
out_dir = sys.argv[1]
D, H = int(os.environ.get("MD", "1024")), int(os.environ.get("MH", "4096"))
REPS = int(os.environ.get("REPS", "5"))
rng = np.random.default_rng(0)
params = {"w1": rng.normal(0, 0.05, (D, H)).astype(np.float32), "b1": np.zeros(H, np.float32),
          "w2": rng.normal(0, 0.05, (H, D)).astype(np.float32), "b2": np.zeros(D, np.float32)}
B = 64
x = rng.normal(size=(B, D)).astype(np.float32)
y = rng.integers(0, D, B)


def loss(p, x, y):
    h = fs.ops.relu(x @ p["w1"] + p["b1"])
    h = fs.pipeline_split(h)
    return fs.ops.softmax_cross_entropy(h @ p["w2"] + p["b2"], y)


ap = fs.AutoParallel(loss, fs.optim.adam(1e-3)).pipeline(stages=2, micro_batches=4,
                                                         output_broadcast=True)
b = B // dp
j = rank % dp
state, _ = ap(ap.init(params), x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
whole_like = ap.init({k: np.zeros_like(v) for k, v in params.items()})  # (a like only)
del params

root = os.path.join(out_dir, "ckpt")
kinds = {"split": lambda: state, "gathered": lambda: ap.gather(state)}
times: dict = {k: [] for k in kinds}
sizes: dict = {}
loads: dict = {"split": [], "whole": []}
gathers: list = []  # of the "gathered" saves: the ap.gather(state) part
step = 0
for rep in range(REPS):
    for kind, what in kinds.items():
        step += 1
        t0 = time.perf_counter()
        value = what()
        t1 = time.perf_counter()
        d = fs.checkpoint.save(root, value, step=step)
        times[kind].append(time.perf_counter() - t0)
        if kind == "gathered":
            gathers.append(t1 - t0)
        del value
        sizes[kind] = os.path.getsize(
            os.path.join(d, f"shard-{rank:05d}-of-{world:05d}.safetensors"))
        if kind == "split":
            t0 = time.perf_counter()
            fs.checkpoint.load(d, like=state)
            loads["split"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fs.checkpoint.load(d, like=whole_like)
            loads["whole"].append(time.perf_counter() - t0)
        ap.gather_params(state)  # (a collective: a barrier before process 0 removes d)
        if rank == 0:
            shutil.rmtree(d)

out = {"rank": rank, "world": world, "state_mib": sum(
    int(np.prod(fs.typeof(v).shape)) * 4 for v in fs.tree.leaves(ap.gather(state))) / 2**20,
       "save_median_s": {k: float(np.median(v)) for k, v in times.items()},
       "save_min_s": {k: float(np.min(v)) for k, v in times.items()},
       "gather_median_s": float(np.median(gathers)),
       "load_median_s": {k: float(np.median(v)) for k, v in loads.items()},
       "own_file_bytes": sizes, "loadavg": os.getloadavg()}
with open(os.path.join(out_dir, f"c{rank}.json"), "w") as fh:
    json.dump(out, fh)
