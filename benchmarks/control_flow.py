"""Loops: ``fs.fori_loop`` unrolled (the default up to ``MAX_UNROLL`` iterations) against
the same loop as one MindSpore graph ``while`` (``unroll=False``, what ``fs.while_loop``
lowers to), a hand-written ``mindspore.jit`` while loop, and ``jax.lax.fori_loop``.

The body is ``x * 1.01 + 1`` on 1,000 float32 values, for 10, 100 and 1,000 iterations;
each row reports the steady call time, and the notes the first call (trace + compile).
"""

from __future__ import annotations

import time

import mindspore as ms
import numpy as np

import fshard as fs
from benchmarks.harness import Result, benchmark, row

SIZES = (10, 100, 1000)


def _body(i, x):
    return x * 1.01 + 1.0


def _ms_loop(n, x):
    i = n * 0
    while i < n:
        x = x * 1.01 + 1.0
        i = i + 1
    return x


@benchmark("loops", title="fori_loop: unrolled vs one graph while loop", jax="loops")
def loops(ctx):
    x = ms.Tensor(np.ones(1000, np.float32))
    ms_loop = ms.jit(_ms_loop)
    fns, notes = {}, []
    for steps in SIZES:
        variants = {
            f"fs_unrolled_{steps}": fs.jit(lambda x, s=steps: fs.fori_loop(0, s, _body, x,
                                                                           unroll=True)),
            f"fs_while_{steps}": fs.jit(lambda x, s=steps: fs.fori_loop(0, s, _body, x,
                                                                        unroll=False)),
        }
        nt = ms.Tensor(np.int32(steps))
        variants[f"ms_while_{steps}"] = lambda nt=nt: ms_loop(nt, x)
        firsts = []
        for name, f in variants.items():
            t0 = time.perf_counter()
            out = f() if name.startswith("ms_") else f(x)
            out.asnumpy()
            firsts.append(f"{name} {time.perf_counter() - t0:.2f} s")
            fns[name] = (lambda f=f, name=name: (f() if name.startswith("ms_") else f(x))
                         .asnumpy())
        ref = fns[f"ms_while_{steps}"]()
        np.testing.assert_allclose(fns[f"fs_unrolled_{steps}"](), ref, rtol=1e-5)
        np.testing.assert_allclose(fns[f"fs_while_{steps}"](), ref, rtol=1e-5)
        notes.append("first call: " + ", ".join(firsts))
    t = ctx.compare(fns, runs=ctx.runs(30, 3), warmup=2, rounds=2)
    rows = []
    for steps in SIZES:
        rows += [row("fshard", f"fs.fori_loop unrolled, {steps} steps", t[f"fs_unrolled_{steps}"]),
                 row("fshard", f"fs.fori_loop unroll=False (graph while), {steps} steps",
                     t[f"fs_while_{steps}"]),
                 row("mindspore", f"mindspore.jit while loop, {steps} steps",
                     t[f"ms_while_{steps}"])]
    rows += ctx.jax_rows("loops")
    return Result(rows, baseline="mindspore.jit while loop, 100 steps",
                  target="choose the faster form per trip count", notes=notes)
