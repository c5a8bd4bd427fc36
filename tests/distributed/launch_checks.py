"""Checks that run inside a job started by ``fshard.launch`` (see tests/test_launch.py).

``python -m fshard.launch -n 2 tests/distributed/launch_checks.py MODE``, where MODE is

- ``ok``: every rank joins the job and prints ``CHECK <name> ok`` per check (rank and
  world size, default mesh, idempotent init, an ``ms.jit`` AllReduce over the world and
  over groups made by ``group_for``), then ``ALL CHECKS PASSED``;
- ``fail``: rank 1 raises before joining while the other ranks block in ``init()``;
- ``noinit``: rank 1 finishes (exit 0) without joining while rank 0 waits in ``init()``;
- ``hang``: rank 0 finishes at once, the others sleep (for the launcher's timeout);
- ``child``: every rank starts a ``sleep`` process it never stops, prints its pid, and
  finishes (the launcher must stop the children with the job);
- ``collective_hang``: both ranks run one fshard collective, then the last rank sleeps
  while the others wait for it in a second one (until MindSpore's collective timeout).

``ok`` also checks ``dataset_strategy("data_parallel")``: slices of 2 rows on rank 0
and 3 on the last rank are an ``ArgumentError`` on every rank naming the counts (for
``fs.AutoParallel`` and ``fs.shard``), after which the job is still in step: equal
slices train as one process would.

Launches cost ~10-20 s each on 2 cores, so checks are batched into one job.
"""

from __future__ import annotations

import os
import sys
import time


def check(name: str, cond: bool, detail: object = "") -> None:
    if not cond:
        raise AssertionError(f"CHECK {name} failed: {detail}")
    print(f"CHECK {name} ok", flush=True)


def run_ok() -> None:
    print("before init", flush=True)  # must appear once per rank, never from the scheduler
    import mindspore as ms
    from mindspore import ops

    import fshard as fs
    from fshard.meshes.mesh import resolve_mesh

    dist = fs.distributed
    check("not initialized before init", not dist.is_initialized())
    dist.init()
    dist.init()  # idempotent
    r, n = dist.rank(), dist.world_size()
    check("rank matches RANK_ID", r == int(os.environ["RANK_ID"]), (r, os.environ["RANK_ID"]))
    check("world size", n == int(os.environ["MS_WORKER_NUM"]), n)

    mesh = resolve_mesh()
    check("default mesh is the world", mesh == fs.Mesh((n,), ("d",)) and not mesh.is_virtual,
          mesh)
    with fs.Mesh((n,), ("x",)) as m:
        check("with-mesh wins", resolve_mesh() is m and not m.is_virtual)

    world = ops.AllReduce()

    @ms.jit
    def allreduce(x):
        return world(x)

    got = allreduce(ms.Tensor([float(r + 1), 1.0])).asnumpy().tolist()
    check("jit AllReduce over the world", got == [n * (n + 1) / 2, float(n)], got)

    check("group_for(world) is the world group", dist.group_for(list(range(n))) ==
          dist.world_group())
    # A group per rank (size 1) and the world in reverse order: both valid MCCL groups.
    own = ops.AllReduce(group=dist.group_for([r]))
    rev = ops.AllReduce(group=dist.group_for(list(reversed(range(n)))))

    @ms.jit
    def grouped(x):
        return own(x), rev(x)

    a, b = grouped(ms.Tensor([float(r + 1)]))
    check("jit AllReduce over group_for groups",
          a.asnumpy().tolist() == [r + 1.0] and b.asnumpy().tolist() == [n * (n + 1) / 2],
          (a, b))
    check("group_for is cached", dist.group_for([r]) == dist.group_for([r]))
    try:
        dist.group_for([(r + 1) % n])
    except fs.DistributedError as e:
        check("group_for refuses a group without this rank", "not in the group" in str(e))
    check_slices_of_different_shapes(fs, r, n)
    if n == 2:
        check_pipelined_state(fs, r)
    print("ALL CHECKS PASSED", flush=True)


def check_pipelined_state(fs, r: int) -> None:
    """A 2-stage pipeline, one process per stage, clipped by the global norm: each
    process keeps its own stage's weight (the other's is an fs.RemoteArray), and the
    losses and gathered weights are those of the unpipelined clipped SGD (NumPy)."""
    import numpy as np

    def loss(p, x, y):
        return ((fs.pipeline_split(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    rng = np.random.default_rng(0)
    w1, w2 = rng.normal(0, 0.5, (3, 4)), rng.normal(0, 0.5, (4, 1))
    x, y = rng.normal(size=(4, 3)), rng.normal(size=(4, 1))
    f32 = np.float32
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.1), fs.optim.sgd(0.1))
    ap = fs.AutoParallel(loss, opt).pipeline(stages=2, micro_batches=2,
                                             output_broadcast=True)
    state = ap.init({"w1": w1.astype(f32), "w2": w2.astype(f32)})
    for _ in range(2):
        state, got = ap(state, x.astype(f32), y.astype(f32))
        h = x @ w1
        e = h @ w2 - y
        want = float((e ** 2).mean())
        g1, g2 = x.T @ (2 * e @ w2.T / len(x)), h.T @ (2 * e / len(x))
        clip = 0.1 / max(np.sqrt((g1 ** 2).sum() + (g2 ** 2).sum()), 0.1)
        w1, w2 = w1 - 0.1 * clip * g1, w2 - 0.1 * clip * g2
        check("pipelined job: the clipped loss of one process",
              np.isclose(float(got.asnumpy()), want, rtol=1e-5), (got, want))
    mine, other = ("w1", "w2") if r == 0 else ("w2", "w1")
    check("pipelined job: each process keeps its own stage's weight only",
          not isinstance(state.params[mine], fs.RemoteArray)
          and isinstance(state.params[other], fs.RemoteArray), state.params)
    params = ap.gather_params(state)
    check("pipelined job: and gathers the clipped weights of one process",
          np.allclose(params["w1"].asnumpy(), w1, rtol=1e-5, atol=1e-6)
          and np.allclose(params["w2"].asnumpy(), w2, rtol=1e-5, atol=1e-6), params)


def check_slices_of_different_shapes(fs, r: int, n: int) -> None:
    import numpy as np

    def loss(p, x, y):
        return ((x @ p["w"] - y) ** 2).mean()

    ap = fs.AutoParallel(loss, fs.optim.sgd(0.1))
    w0 = np.linspace(-1, 1, 3, dtype=np.float32).reshape(3, 1)
    state = ap.init({"w": w0})
    x_all = np.arange(3 * n * 3, dtype=np.float32).reshape(3 * n, 3) / 10
    y_all = np.ones((3 * n, 1), np.float32)
    rows = 3 if r == n - 1 else 2  # the last rank passes one row more
    counts = ", ".join(f"{3 if k == n - 1 else 2} rows (rank {k})" for k in range(n))
    try:  # fs.shard returns each process its rows of the output: equal slices only
        fs.shard(lambda x: x * 2.0, in_strategy=(None,),
                 dataset_strategy="data_parallel")(x_all[:rows])
        check("shard: slices of different row counts refused", False, "accepted")
    except fs.ArgumentError as e:
        msg = str(e)
        check("shard: slices of different row counts refused on every rank",
              f"the first batch input has {counts}" in msg and "data_parallel" in msg
              and "Fix: give every process the same number of rows" in msg, msg)
    try:  # AutoParallel: rows that make a global batch the devices cannot split evenly
        ap(state, x_all[:rows], y_all[:rows])
        check("AutoParallel: a global batch of 2N+1 rows refused", False, "accepted")
    except fs.ArgumentError as e:
        msg = str(e)
        check("AutoParallel: a global batch of 2N+1 rows refused on every rank",
              f"batch input 0 has {counts}: {2 * n + 1} rows, not divisible by {n}" in msg
              and "Fix: give the processes rows that add up to a multiple" in msg, msg)
    # still in step: 3 equal steps train as one process on the whole batch would
    b = 2
    mine = slice(r * b, (r + 1) * b)
    w, want = w0.astype(np.float64), []
    for _ in range(3):
        state, got = ap(state, x_all[mine], y_all[mine])
        xs, ys = x_all[:n * b].astype(np.float64), y_all[:n * b]
        err = xs @ w - ys
        want.append(float((err ** 2).mean()))
        w = w - 0.1 * 2 * xs.T @ err / (n * b)
        check("equal slices after the refusal train as one process",
              np.isclose(float(got.asnumpy()), want[-1], rtol=1e-5), (got, want))
    params = fs.gather_sharded(state.params)["w"]
    check("and keep the parameters one process gets",
          np.allclose(params.asnumpy(), w, rtol=1e-5, atol=1e-6), (params, w))
    # slices of different row counts (an uneven last batch: 1 row, the last rank
    # n + 1): the step of one process on their rows in rank order, the mean over every row
    uneven = slice(r, r + 1) if r < n - 1 else slice(n - 1, 2 * n)
    state, got = ap(state, x_all[uneven], y_all[uneven])
    xs, ys = x_all[:2 * n].astype(np.float64), y_all[:2 * n]
    err = xs @ w - ys
    want = float((err ** 2).mean())
    w = w - 0.1 * 2 * xs.T @ err / (2 * n)
    params = fs.gather_sharded(state.params)["w"]
    check("AutoParallel: slices of different row counts train as one process",
          np.isclose(float(got.asnumpy()), want, rtol=1e-5)
          and np.allclose(params.asnumpy(), w, rtol=1e-5, atol=1e-6), (got, want, params, w))
    twice = fs.shard(lambda x: x * 2.0, in_strategy=(None,),
                     dataset_strategy="data_parallel")(x_all[mine])
    check("fs.shard with equal slices returns this process's rows",
          np.array_equal(twice.asnumpy(), 2 * x_all[mine]), twice)


def run_fail() -> None:
    import fshard as fs

    if os.environ["RANK_ID"] == "1":
        raise ValueError("rank 1 fails on purpose")
    fs.distributed.init()  # blocks: rank 1 never joins
    time.sleep(600)


def run_noinit() -> None:
    import fshard as fs

    if os.environ["RANK_ID"] == "1":
        print("leaving without init", flush=True)
        return  # exits 0, never joins
    fs.distributed.init()  # blocks: rank 1 never joins
    time.sleep(600)


def run_hang() -> None:
    if os.environ["RANK_ID"] == "0":
        print("done early", flush=True)
        return
    print("hanging", flush=True)
    time.sleep(600)


def run_collective_hang() -> None:
    import numpy as np

    import fshard as fs

    fs.distributed.init()
    r, n = fs.distributed.rank(), fs.distributed.world_size()
    total = fs.jit(fs.shard_map(lambda v: fs.psum(v.sum(), "d"), in_strategy=((n,),),
                                out_strategy=(), mesh=fs.Mesh((n,), ("d",))))
    print("first", float(total(np.ones(n, np.float32)).asnumpy()), flush=True)
    if r == n - 1:
        print("sleeping before the second collective", flush=True)
        time.sleep(600)
    total(np.ones(n, np.float32))  # waits for the last rank until MindSpore gives up


def run_child() -> None:
    import subprocess

    child = subprocess.Popen(["sleep", "120"])
    print(f"child {child.pid}", flush=True)


if __name__ == "__main__":
    {"ok": run_ok, "fail": run_fail, "hang": run_hang, "child": run_child,
     "noinit": run_noinit, "collective_hang": run_collective_hang}[sys.argv[1]]()
