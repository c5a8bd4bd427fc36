"""``fs.AutoParallel`` with a declared batch and ``dataset_strategy('data_parallel')``
in a real multi-process job: each process passes its own slice, a new size every few
steps, the processes' slices of different row counts in some (an uneven last batch).
One program serves every slice size; every step's loss and the parameters equal one
process's static-shape step on the global batch (the processes' rows in rank order).

The script of tests/distributed/test_dynamic_slices_multiprocess.py: it prints
``CHECK <name> ok`` per check, then ``ALL CHECKS PASSED``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dynamic_checks import check, digits, init_params, seed_loss  # noqa: E402

# every process's rows per step (2 processes; with more, the last ones take the
# first's): equal slices of 8, 16 and 24 rows, uneven ones whose global batch is 2
# times a size the Symbol accepts (24 + 8: one program serves them too)
STEPS = ((8, 8), (16, 16), (24, 24), (24, 8), (8, 8), (24, 8), (16, 16))
# uneven slices whose global batch of 24 rows is not 2 times a multiple of 8: planned
# and compiled for its own size, once
OTHER = ((16, 8), (8, 16))


def rows_of(counts, n):
    return tuple(counts[r] if r < len(counts) else counts[0] for r in range(n))


def compiled(ap) -> str:
    """How many step programs ``ap`` planned and how often they compiled, in all."""
    programs = [jitted for _, jitted in ap._steps.values()]
    return (f"{len(programs)} programs traced {sum(j.trace_count for j in programs)} "
            f"compiled {sum(j.compile_count for j in programs)}")


def main() -> None:
    import mindspore as ms
    from mindspore import Tensor

    import fshard as fs

    fs.distributed.init()
    n, rank = fs.distributed.world_size(), fs.distributed.rank()
    opt = fs.optim.sgd(0.5)
    s0 = ms.Symbol(divisor=8)
    ap = fs.AutoParallel(seed_loss, opt).set_inputs(
        ms.Tensor(shape=[s0, 1, 8, 8], dtype=ms.float32), ms.Tensor(shape=[s0], dtype=ms.int32))

    def static_step(params, state, x, y):
        loss, grads = fs.value_and_grad(seed_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return fs.optim.apply_updates(params, updates), state, loss

    static = fs.jit(static_step)
    images, labels = digits()
    params = {k: Tensor(v) for k, v in init_params().items()}
    state = ap.init(params)
    p_static, s_static = params, opt.init(params)
    start = 0

    def step(i, counts):
        nonlocal state, p_static, s_static, start
        counts = rows_of(counts, n)
        total = sum(counts)
        x, y = images[start:start + total], labels[start:start + total]
        mine = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
        start += total
        state, loss = ap(state, Tensor(x[mine]), Tensor(y[mine]))
        p_static, s_static, ref = static(p_static, s_static, Tensor(x), Tensor(y))
        check(f"step {i} rows {counts} loss", float(loss.asnumpy()), float(ref.asnumpy()))
        got = fs.gather_sharded(state.params)
        for k in sorted(got):
            check(f"step {i} rows {counts} parameter {k}", got[k].asnumpy(),
                  p_static[k].asnumpy())
        return Tensor(x[mine]), Tensor(y[mine])

    for i, counts in enumerate(STEPS):
        x, y = step(i, counts)
        if i == 2:  # equal slices of 3 sizes
            print(f"CHECK equal slices of 3 sizes: {compiled(ap)} ok", flush=True)
    _, jitted = ap.sharded(state, x, y)
    print(f"CHECK {len(set(STEPS))} slice sizes: {compiled(ap)}, the step traced "
          f"{jitted.trace_count} compiled {jitted.compile_count} ok", flush=True)
    for i, counts in enumerate(OTHER, len(STEPS)):
        step(i, counts)
    print(f"CHECK uneven global batch of another size: {compiled(ap)} ok", flush=True)
    # a slice the declaration refuses, on one process only: every process raises
    bad = 5 if rank == n - 1 else 8
    try:
        ap(state, Tensor(images[:bad]), Tensor(labels[:bad]))
        check("a refused slice on one process raises", 0.0, 1.0)
    except fs.errors.ShapeError as e:
        msg = str(e)
        assert f"(rank {n - 1})" in msg and "size 5 in dimension 0" in msg, msg
        print("CHECK a refused slice on one process raises on every process ok", flush=True)
    print("ALL CHECKS PASSED", flush=True)


if __name__ == "__main__":
    main()
