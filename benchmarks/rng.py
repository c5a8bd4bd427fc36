"""Random numbers: 1M float32 normals from a key.

``fs.jit(fs.random.normal)`` (Threefry-2x32 built from fshard's bitwise primitives,
compiled into one MindSpore graph) against MindSpore's own stateful ``ops.randn``
(one kernel, not reproducible under transforms) and ``jax.jit(jax.random.normal)``.
Every timed call waits for its result.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import ops

import fshard as fs
from benchmarks.harness import Result, benchmark, row

SHAPE = (1000, 1000)


def _randn():
    return ops.randn(SHAPE)


@benchmark("random_normal", title="1M float32 normals from a key", jax="random_normal")
def random_normal(ctx):
    draw = fs.jit(lambda k: fs.random.normal(k, SHAPE))
    keys = fs.random.split(fs.random.key(0), 8)
    z = draw(keys[0]).asnumpy()
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    randn = ms.jit(_randn)
    randn().asnumpy()
    runs = ctx.runs(40, 4)
    t = ctx.compare({
        "fs": lambda: draw(keys[1]).asnumpy(),
        "ms": lambda: randn().asnumpy(),
    }, runs=runs, warmup=3, rounds=3)
    rows = [row("fshard", "fs.jit(fs.random.normal)", t["fs"]),
            row("mindspore", "mindspore.jit(ops.randn)", t["ms"], "stateful kernel"),
            *ctx.jax_rows("random_normal")]
    return Result(rows, baseline="mindspore.jit(ops.randn)",
                  target="counter-based draws within a few times MindSpore's kernel",
                  notes=[f"timed interleaved ({runs} calls each, 3 rounds)"])
