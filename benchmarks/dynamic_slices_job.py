"""``fs.AutoParallel`` with a declared batch and ``dataset_strategy('data_parallel')`` in
a multi-process job: how many programs compile, and the step time at a new slice size
against a repeated one (docs/dynamic_shapes.md). Run as a job:

    python -m fshard.launch -n 2 benchmarks/dynamic_slices_job.py

Rank 0 prints the numbers and the load average. The network is the seed's
(tests/distributed/dynamic_checks.py) on the digits, SGD, slices declared
``mindspore.Symbol(divisor=8)``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "distributed"))
from dynamic_checks import digits, init_params, seed_loss  # noqa: E402

SIZES = (8, 16, 24, 32, 40, 48, 56, 64)  # each process's rows: 8 sizes, each new once
REPEATS = 5  # then each size again, REPEATS times (below HOT_CALLS: the dynamic program)
# then uneven slices of each size but the first (the last rank 8 rows fewer): run by
# the same program after an AllGather of the slices


def main() -> None:
    import mindspore as ms
    from mindspore import Tensor

    import fshard as fs

    fs.distributed.init()
    n, rank = fs.distributed.world_size(), fs.distributed.rank()
    s0 = ms.Symbol(divisor=8)
    ap = fs.AutoParallel(seed_loss, fs.optim.sgd(0.1)).set_inputs(
        ms.Tensor(shape=[s0, 1, 8, 8], dtype=ms.float32), ms.Tensor(shape=[s0], dtype=ms.int32))
    images, labels = digits()
    state = ap.init({k: Tensor(v) for k, v in init_params().items()})

    def step(b, shift=0):
        nonlocal state
        # shift: rank 0 passes b + shift rows, the last rank b - shift (an uneven batch)
        lo = rank * b + (shift if rank else 0)
        hi = (rank + 1) * b + (shift if rank < n - 1 else 0)
        x, y = Tensor(images[lo:hi]), Tensor(labels[lo:hi])
        t = time.perf_counter()
        state, loss = ap(state, x, y)
        loss.asnumpy()
        return time.perf_counter() - t

    first = step(SIZES[0])
    new = [step(b) for b in SIZES[1:]]
    repeated = [step(b) for _ in range(REPEATS) for b in SIZES]
    try:
        uneven = [step(b, 8) for b in SIZES[1:]]
    except fs.ArgumentError:  # (slices of different row counts, refused before)
        uneven = [float("nan")]
    programs = [jitted for _, jitted in ap._steps.values()]
    compiled = sum(j.compile_count for j in programs)
    # one size past HOT_CALLS (8): its static copy (one more compilation)
    hot = [step(SIZES[-1]) for _ in range(8)][-4:]
    programs = [jitted for _, jitted in ap._steps.values()]
    if rank == 0:
        print(f"processes {n}; {len(SIZES)} slice sizes, {len(SIZES) * (REPEATS + 1)} steps")
        print(f"programs {len(programs)}, compiled {compiled}")
        print(f"first step (plan + compile): {first * 1e3:.0f} ms")
        print(f"a new slice size: median {statistics.median(new) * 1e3:.1f} ms "
              f"(min {min(new) * 1e3:.1f}, max {max(new) * 1e3:.1f})")
        print(f"a repeated slice size: median {statistics.median(repeated) * 1e3:.1f} ms "
              f"(min {min(repeated) * 1e3:.1f})")
        print(f"uneven slices (b + 8 and b - 8 rows): median "
              f"{statistics.median(uneven) * 1e3:.1f} ms (min {min(uneven) * 1e3:.1f})")
        print(f"{SIZES[-1]} rows past 8 calls: compiled "
              f"{sum(j.compile_count for j in programs)} in all, median "
              f"{statistics.median(hot) * 1e3:.1f} ms (min {min(hot) * 1e3:.1f})")
        print("load average", open("/proc/loadavg").read().split()[:3], flush=True)


if __name__ == "__main__":
    main()
