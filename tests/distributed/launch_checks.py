"""Checks that run inside a job started by ``fshard.launch`` (see tests/test_launch.py).

``python -m fshard.launch -n 2 tests/distributed/launch_checks.py MODE``, where MODE is

- ``ok``: every rank joins the job and prints ``CHECK <name> ok`` per check (rank and
  world size, default mesh, idempotent init, an ``ms.jit`` AllReduce over the world and
  over groups made by ``group_for``), then ``ALL CHECKS PASSED``;
- ``fail``: rank 1 raises before joining while the other ranks block in ``init()``;
- ``noinit``: rank 1 finishes (exit 0) without joining while rank 0 waits in ``init()``;
- ``hang``: rank 0 finishes at once, the others sleep (for the launcher's timeout);
- ``child``: every rank starts a ``sleep`` process it never stops, prints its pid, and
  finishes (the launcher must stop the children with the job).

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
    from fshard.mesh import resolve_mesh

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
    print("ALL CHECKS PASSED", flush=True)


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


def run_child() -> None:
    import subprocess

    child = subprocess.Popen(["sleep", "120"])
    print(f"child {child.pid}", flush=True)


if __name__ == "__main__":
    {"ok": run_ok, "fail": run_fail, "hang": run_hang, "child": run_child,
     "noinit": run_noinit}[sys.argv[1]]()
