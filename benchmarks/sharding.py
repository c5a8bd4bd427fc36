"""Sharding benchmarks: what ``fs.shard`` communicates, what a sharded training step
costs on 2 processes, and how long propagation and partitioning take.

1. **Communication per step**, counted in the per-device program
   (``Sharded.partitioned(*args)``) and set against the analytic minimum of each
   computation: a data-parallel training step (batch split 8 ways), a Megatron MLP
   (first weight split by columns, second by rows) forward and forward+backward, and a
   2-D (data x model) MLP step on a (2, 4) split of 8 devices. Bytes are what each
   device sends under ring algorithms (``COST``), for the collectives as written and as
   MindSpore's CPU backend runs them (emulations, docs/collectives.md).
2. **A training step on 2 processes** (one ``fshard.launch`` job): the MLP
   784-512-512-10, batch 128, generated data, as ``fs.jit(fs.shard(fs.value_and_grad(
   loss)))`` with the batch split over the ranks, and as the hand-written manual data
   parallelism ``fs.jit(fs.shard_map(fs.value_and_grad(local_loss)))`` with
   ``fs.pmean`` (examples/data_parallel_mlp.py), against the same step unsharded in
   one process. For reference, the same on a virtual 8-device mesh in one process.
3. **Propagation and partitioning time** of a 100-layer MLP (forward, and its
   ``value_and_grad``) with the batch split over 8 devices, against fshard's staging
   time of the same function (MindSpore's own propagation refuses the CPU backend).

Every timed step waits for all of its outputs (``.asnumpy()``). ``python -m
benchmarks --only sharding [--quick]``; the job's side is ``python -m
benchmarks.sharding --worker OUT_DIR`` (started by the benchmark itself).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

SIZES = (784, 512, 512, 10)   # the MLP of the training-step benchmarks
BATCH = 128
PROCS = 2
STEP_RUNS = (60, 6)           # (full, quick) timed steps per variant, after warm-up
STEP_ROUNDS = 4               # variants timed interleaved, in this many rounds

#: Bytes each device sends for one collective of ``S`` bytes (its input block) over
#: ``n`` devices, ring algorithms: AllReduce 2(n-1)/n·S, AllGather (n-1)·S,
#: ReduceScatter (n-1)/n·S.
COST = {
    "psum": lambda S, n: 2 * (n - 1) / n * S,
    "all_gather": lambda S, n: (n - 1) * S,
    "psum_scatter": lambda S, n: (n - 1) / n * S,
}


# ---------------------------------------------------------------------------
# The model (parameters as a dict: a pytree fs.shard takes one strategy prefix of)
# ---------------------------------------------------------------------------


def init(rng, sizes=SIZES, batch=BATCH):
    """``(params, x, labels)`` as NumPy: He-scaled weights, small biases, normal
    inputs and integer class labels."""
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (rng.standard_normal((m, n)) / np.sqrt(m)).astype(np.float32)
        params[f"b{i}"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
    x = rng.standard_normal((batch, sizes[0]), dtype=np.float32)
    labels = rng.integers(0, sizes[-1], batch).astype(np.int32)
    return params, x, labels


def mlp(params, x):
    import fshard as fs

    n = len(params) // 2
    for i in range(n):
        x = fs.ops.matmul(x, params[f"w{i}"]) + params[f"b{i}"]
        if i < n - 1:
            x = fs.ops.relu(x)
    return x


def loss(params, x, labels):
    """Mean softmax cross-entropy of the MLP on a batch."""
    import fshard as fs

    return fs.ops.softmax_cross_entropy(mlp(params, x), labels)


def local_loss(params, x, labels):
    """Manual data parallelism: each device's loss, averaged over ``"dp"`` (as
    examples/data_parallel_mlp.py; differentiating ``pmean`` averages the gradients)."""
    import fshard as fs

    return fs.pmean(loss(params, x, labels), "dp")


def steps(n: int):
    """``{name: jitted step}`` of the sharded training steps on a 1-D mesh of ``n``
    devices (the job's ranks inside a job, else a virtual mesh): ``shard`` (batch split
    n ways, parameters left to propagation, everything returned replicated) and
    ``shard_map`` (the manual version)."""
    import fshard as fs

    mesh = fs.Mesh((n,), ("dp",))
    dp = fs.Layout(mesh.shape, mesh.axis_names)
    shard = fs.shard(fs.value_and_grad(loss), in_strategy=(None, (n, 1), (n,)), mesh=mesh)
    manual = fs.shard_map(fs.value_and_grad(local_loss),
                          in_strategy=(None, dp("dp", "None"), dp("dp")),
                          out_strategy=((), None), mesh=mesh)
    return {"shard": fs.jit(shard), "shard_map": fs.jit(manual)}


def _sync(out) -> None:
    import fshard as fs

    for t in fs.tree.leaves(out):
        t.asnumpy()


def _tensors(params, x, labels):
    import mindspore as ms

    return {k: ms.Tensor(v) for k, v in params.items()}, ms.Tensor(x), ms.Tensor(labels)


def _check_same(got, want, what: str) -> None:
    """A sharded step's (loss, grads) equals the unsharded step's."""
    import fshard as fs

    for a, b in zip(fs.tree.leaves(got), fs.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=what)


def _time_steps(fns: dict, args, runs: int) -> dict:
    from benchmarks import timing

    return timing.compare({k: (lambda f=f: _sync(f(*args))) for k, f in fns.items()},
                          runs=runs, warmup=3, rounds=STEP_ROUNDS)


# ---------------------------------------------------------------------------
# 1. Communication: count and bytes of the per-device program vs the minimum
# ---------------------------------------------------------------------------


def traffic(part) -> list[dict]:
    """Every collective of a per-device program (``Sharded.partitioned(*args)``): its
    kind, group size ``n``, input block and the bytes each device sends, with every
    collective native (``bytes``) and as MindSpore's CPU backend runs it (``cpu_bytes``:
    a ReduceScatter is an AllReduce + slice, an AllGather over a sub-group a slot
    buffer + AllReduce), both from ``fshard.sharding.cost.step_bytes``, the planner's own.

    >>> import numpy as np, fshard as fs
    >>> f = fs.shard(lambda x, w: x @ w, in_strategy=((1, 2), (2, 1)), mesh=2)
    >>> x, w = np.ones((4, 6), np.float32), np.ones((6, 3), np.float32)
    >>> [(c["kind"], c["n"], c["type"], c["bytes"]) for c in traffic(f.partitioned(x, w))]
    [('psum', 2, 'f32[4,3]', 48.0)]
    """
    from fshard import dtypes
    from fshard.backend.mindspore import NATIVE_COLLECTIVES
    from fshard.sharding.cost import step_bytes
    from fshard.primitives.collectives import COLLECTIVES

    mesh = part.prop.mesh
    sizes = dict(zip(mesh.names, mesh.sizes))
    out = []
    for eq in part.program.equations:
        kind = eq.prim.name
        if eq.prim not in COLLECTIVES:
            continue
        assert kind in COST, f"no byte count for {kind}"
        names = eq.params["axis_name"]
        names = (names,) if isinstance(names, str) else tuple(names)
        n = math.prod(sizes[a] for a in names)
        aval = eq.inputs[0].aval
        S = math.prod(aval.shape) * dtypes.to_numpy(aval.dtype).itemsize
        world = n == mesh.size
        out.append({"kind": kind, "n": n, "type": str(aval),
                    "bytes": step_bytes(kind, S, n, world, NATIVE_COLLECTIVES["GPU"]),
                    "cpu_bytes": step_bytes(kind, S, n, world, NATIVE_COLLECTIVES["CPU"])})
    return out


_NAMES = {"psum": "AllReduce", "all_gather": "AllGather", "psum_scatter": "ReduceScatter"}


def _describe(colls: list[dict]) -> str:
    """``"2 AllReduce + 1 AllGather"``."""
    counts: dict = {}
    for c in colls:
        counts[c["kind"]] = counts.get(c["kind"], 0) + 1
    return " + ".join(f"{k} {_NAMES[kind]}" for kind, k in counts.items()) or "none"


def _detail(colls: list[dict]) -> str:
    """``"AllReduce/8 f32[128,512]; ..."``: each collective, its group size and input."""
    return "; ".join(f"{_NAMES[c['kind']]}/{c['n']} {c['type']}" for c in colls)


def _megatron_data(rng, batch=128, d=512, hidden=2048):
    import mindspore as ms

    def t(*s):
        return ms.Tensor(rng.standard_normal(s).astype(np.float32))

    return t(batch, d), t(d, hidden), t(hidden, d), t(batch, d)


def _mm_relu_mm(x, w1, w2):
    import fshard as fs

    return fs.ops.matmul(fs.ops.relu(fs.ops.matmul(x, w1)), w2)


def _mse(x, w1, w2, target):
    return ((_mm_relu_mm(x, w1, w2) - target) ** 2).mean()


def comm_cases() -> list[dict]:
    """Each case: its per-device program's collectives and the analytic minimum."""
    import fshard as fs

    AR, f32 = COST["psum"], 4
    rng = np.random.default_rng(0)
    cases = []

    # (a) data parallel: each device differentiates its batch slice; the math needs the
    # sum over slices of every gradient and of the loss, nothing else.
    params, x, labels = _tensors(*init(rng))
    n = 8
    part = fs.shard(fs.value_and_grad(loss), in_strategy=(None, (n, 1), (n,)),
                    mesh=n).partitioned(params, x, labels)
    n_params = sum(math.prod(p.shape) for p in params.values())
    cases.append(dict(
        name="data-parallel step (MLP 784-512-512-10, batch 128 split 8 ways)",
        colls=traffic(part),
        min_count=len(params) + 1, min_bytes=AR(f32 * (n_params + 1), n),
        formula=f"one AllReduce per gradient + one for the loss: 2(n-1)/n x 4 B x "
                f"({n_params} parameters + 1), n = 8; 1 collective if the gradients are "
                "fused into one buffer"))

    # (b) Megatron MLP on 8 devices: y = relu(x W1) W2 with W1 by columns, W2 by rows.
    x, w1, w2, target = _megatron_data(rng)
    y_bytes = f32 * x.shape[0] * w2.shape[1]
    x_bytes = f32 * math.prod(x.shape)
    mega = (None, (1, n), (n, 1))
    part = fs.shard(_mm_relu_mm, in_strategy=mega, mesh=n).partitioned(x, w1, w2)
    cases.append(dict(
        name="Megatron MLP forward (x 128x512, W1 512x2048 (1, 8), W2 2048x512 (8, 1))",
        colls=traffic(part), min_count=1, min_bytes=AR(y_bytes, n),
        formula="y = relu(x W1) W2 is a pending sum over the 8 devices: one AllReduce "
                "of y (128x512): 2(n-1)/n x |y|"))
    for argnums, label in (((1, 2), "weights"), ((0, 1, 2), "weights and x")):
        grads_sh = tuple({0: None, 1: (1, n), 2: (n, 1)}[i] for i in argnums)
        sh = fs.shard(fs.value_and_grad(_mse, argnums=argnums), in_strategy=mega + (None,),
                      out_strategy=(None, grads_sh), mesh=n)
        part = sh.partitioned(x, w1, w2, target)
        with_x = 0 in argnums
        cases.append(dict(
            name=f"Megatron MLP value_and_grad of mean((y - t)^2) (grads of {label})",
            colls=traffic(part), min_count=1 + with_x,
            min_bytes=AR(y_bytes, n) + with_x * AR(x_bytes, n),
            formula="the AllReduce of y (the loss is nonlinear in y); the backward needs "
                    "nothing for dW1, dW2 (dy is replicated like y)"
                    + ("; dx = dh W1^T is a pending sum: + one AllReduce of dx (128x512)"
                       if with_x else "")))

    # (c) 2-D: batch over dp = 2, W1 columns / W2 rows over mp = 4.
    mesh = fs.Mesh((2, 4), ("dp", "mp"))
    L = fs.Layout((2, 4), ("dp", "mp"))
    sh = fs.shard(fs.value_and_grad(_mse, argnums=(1, 2)),
                  in_strategy=(L("dp", "None"), L("None", "mp"), L("mp", "None"),
                               L("dp", "None")),
                  out_strategy=(None, (L("None", "mp"), L("mp", "None"))), mesh=mesh)
    part = sh.partitioned(x, w1, w2, target)
    w_block = f32 * math.prod(w1.shape) // 4
    cases.append(dict(
        name="2-D MLP step (dp 2 x mp 4: x, t (dp, -); W1 (-, mp); W2 (mp, -))",
        colls=traffic(part), min_count=4,
        min_bytes=AR(y_bytes // 2, 4) + AR(f32, 2) + 2 * AR(w_block, 2),
        formula="AllReduce over mp (n = 4) of y's dp block (64x512); the loss over dp "
                "(n = 2, a scalar); dW1 and dW2 over dp (n = 2, each a 512x512 block)"))
    for c in cases:
        c["count"] = len(c["colls"])
        c["bytes"] = sum(k["bytes"] for k in c["colls"])
        c["cpu_bytes"] = sum(k["cpu_bytes"] for k in c["colls"])
    return cases


def _mib(b: float) -> str:
    return f"{b / 2**20:.3f} MiB" if b >= 2**14 else f"{b:.0f} B"


def comm_notes(cases) -> list[str]:
    out = []
    for c in cases:
        out.append(
            f"comm | {c['name']}: fshard {c['count']} ({_describe(c['colls'])}), "
            f"{_mib(c['bytes'])}/device, {_mib(c['cpu_bytes'])} as run on CPU | minimum "
            f"{c['min_count']}, {_mib(c['min_bytes'])}: {c['formula']} | "
            f"{_detail(c['colls'])}")
    return out


# ---------------------------------------------------------------------------
# 2. A training step: 2 processes, one process, a virtual mesh
# ---------------------------------------------------------------------------


def _worker(out_dir: str, quick: bool) -> None:
    """One rank of the job: both sharded steps, checked against the unsharded step,
    then timed interleaved. Every rank passes the whole batch (full_batch) and runs
    the same calls in the same order; rank 0 writes the times."""
    import fshard as fs

    fs.distributed.init()
    rank, n = fs.distributed.rank(), fs.distributed.world_size()
    args = _tensors(*init(np.random.default_rng(0)))
    fns = steps(n)
    colls = {name: _job_collectives(f, args) for name, f in fns.items()}
    waiting = _waiting_for_last(steps(n)["shard"], args)
    if waiting is not None:
        fns["shard, waiting for the last output"] = waiting
    want = fs.jit(fs.value_and_grad(loss))(*args)
    for name, f in fns.items():
        _check_same(f(*args), want, f"{name} on {n} processes")
    load = os.getloadavg()
    t = _time_steps(fns, args, STEP_RUNS[1 if quick else 0])
    if rank == 0:
        with open(os.path.join(out_dir, "steps.json"), "w") as fh:
            json.dump({"times": t, "collectives": colls, "n": n,
                       "loadavg": [load, os.getloadavg()]}, fh)


def _job_collectives(f, args) -> dict:
    """The collective ops in a step's generated MindSpore source, by op."""
    import re

    src = f.lower(*args).source
    return {op: len(re.findall(rf"\b{op}\w*\(", src))
            for op in ("AllReduce", "AllGather", "Broadcast")}


def _waiting_for_last(jitted, args):
    """Diagnostic: ``jitted`` (a fresh ``fs.jit(fs.shard(...))``), compiled, and made to
    wait for the output its graph computes *last*, as ``fs.jit`` does for a program of
    ordinary equations (transforms/jit.py, ``Compiled``). ``fs.jit`` picks the output
    from the order of the equations that define its outputs; when the whole program is
    one ``shard_call`` they share one equation and it waits for output 0, the loss,
    which is ready first. None if fs.jit's internals no longer look like this."""
    from fshard.transforms import jit as jit_module
    from fshard.transforms.shard_call import shard_call_p

    program = jitted.lower(*args).program
    calls = [eq for eq in program.equations if eq.prim is shard_call_p]
    if len(calls) != 1 or not hasattr(jit_module, "_last_computed"):
        return None
    inner = calls[0].params["plan"].virtual_program()[0]
    if list(calls[0].outputs) != list(program.outputs):
        return None
    last = jit_module._last_computed(inner)
    _sync(jitted(*args))  # compile
    compiled = list(getattr(jitted, "_calls", {}).values())
    if last is None or len(compiled) != 1 or not hasattr(compiled[0], "_wait"):
        return None
    compiled[0]._wait = last
    return jitted


def _launch(quick: bool) -> dict:
    from fshard import launch

    out = tempfile.mkdtemp(prefix="fshard-bench-sharding-")
    args = ["--worker", out] + (["--quick"] if quick else [])
    result = launch.run("benchmarks.sharding", PROCS, args, timeout=900, module=True)
    result.check()
    with open(os.path.join(out, "steps.json")) as fh:
        data = json.load(fh)
    data["wall_s"] = result.wall_time
    return data


def _in_process(quick: bool) -> dict:
    """The unsharded step and the virtual 8-device steps, timed interleaved."""
    import fshard as fs

    args = _tensors(*init(np.random.default_rng(0)))
    plain = fs.jit(fs.value_and_grad(loss))
    fns = {"plain": plain}
    fns.update({f"virtual {k}": f for k, f in steps(8).items()})
    want = plain(*args)
    for name, f in fns.items():
        _check_same(f(*args), want, name)
    load = os.getloadavg()
    t = _time_steps(fns, args, STEP_RUNS[1 if quick else 0])
    return {"times": t, "loadavg": [load, os.getloadavg()]}


# ---------------------------------------------------------------------------
# 3. Propagation and partitioning of a 100-layer MLP
# ---------------------------------------------------------------------------

DEEP_LAYERS, DEEP_WIDTH, DEEP_BATCH = 100, 32, 8


def _deep_data():
    import mindspore as ms

    rng = np.random.default_rng(0)
    params = {}
    for i in range(DEEP_LAYERS):
        params[f"l{i:03d}"] = {
            "w": ms.Tensor((rng.standard_normal((DEEP_WIDTH, DEEP_WIDTH))
                            / np.sqrt(DEEP_WIDTH)).astype(np.float32)),
            "b": ms.Tensor((0.1 * rng.standard_normal(DEEP_WIDTH)).astype(np.float32))}
    x = ms.Tensor(rng.standard_normal((DEEP_BATCH, DEEP_WIDTH), dtype=np.float32))
    return params, x


def deep_fns():
    """Fresh ``{name: function}`` of the 100-layer MLP (forward; loss and gradients),
    so that no cache can answer."""
    import fshard as fs

    def deep(params, x):
        for k in sorted(params):
            x = fs.ops.relu(fs.ops.matmul(x, params[k]["w"]) + params[k]["b"])
        return x

    def deep_loss(params, x):
        return deep(params, x).sum()

    return {"forward": deep, "value_and_grad": fs.value_and_grad(deep_loss)}


def propagation(runs: int, which) -> dict:
    """Per function: staging, propagation and partitioning times (each on its own,
    a fresh function each run), the equation count and the collectives."""
    import gc

    import fshard as fs
    from fshard.sharding.partition import partition
    from fshard.sharding.propagation import propagate

    params, x = _deep_data()
    out = {}
    for name in which:
        times: dict = {"stage": [], "propagate": [], "partition": [], "shard_total": []}
        for _ in range(runs):
            gc.collect()
            f = deep_fns()[name]
            t0 = time.perf_counter()
            fs.make_ir(f)(params, x)
            times["stage"].append(time.perf_counter() - t0)
            sh = fs.shard(deep_fns()[name], in_strategy=(None, (8, 1)), mesh=8)
            gc.collect()
            t0 = time.perf_counter()
            plan = sh._prepare((params, x))[0]  # stage and read the strategies
            t1 = time.perf_counter()
            prop = propagate(plan.body, plan.in_shardings, plan.out_shardings, plan.mesh,
                             plan.level)
            t2 = time.perf_counter()
            part = partition(prop)
            t3 = time.perf_counter()
            times["propagate"].append(t2 - t1)
            times["partition"].append(t3 - t2)
            times["shard_total"].append(t3 - t0)
        out[name] = {"times": {k: {"median_s": float(np.median(v)), "min_s": float(min(v)),
                                   "runs": len(v)} for k, v in times.items()},
                     "equations": len(plan.body.equations),
                     "collectives": _describe([{"kind": k} for k in part.collectives()])}
    return out


# ---------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------


def sharding(ctx):
    from benchmarks.harness import Row, Result

    quick = ctx.quick
    cases = comm_cases()
    for c in cases:
        print("  " + comm_notes([c])[0], flush=True)
    local = _in_process(quick)
    job = _launch(quick)
    prop = propagation(ctx.runs(5, 1), ["forward", "value_and_grad"] if not quick
                       else ["forward"])

    def r(system, label, t, note=""):
        return Row(system, label, t["median_s"], t["min_s"], t["runs"], note)

    lt, jt = local["times"], job["times"]
    rows = [
        r("fshard", "step unsharded, 1 process: fs.jit(fs.value_and_grad(loss))",
          lt["plain"]),
        r("fshard", f"step on {PROCS} processes: fs.jit(fs.shard(fs.value_and_grad(loss)))",
          jt["shard"], _ops(job["collectives"]["shard"])),
        r("fshard", f"step on {PROCS} processes: fs.jit(fs.shard_map(value_and_grad("
          "local_loss))), pmean", jt["shard_map"],
          _ops(job["collectives"]["shard_map"])),
        r("fshard", "step on a virtual 8-device mesh: fs.jit(fs.shard(...))",
          lt["virtual shard"], "one process; a correctness tool, not a speed-up"),
        r("fshard", "step on a virtual 8-device mesh: fs.jit(fs.shard_map(...))",
          lt["virtual shard_map"], "one process; a correctness tool, not a speed-up"),
    ]
    if "shard, waiting for the last output" in jt:
        rows.insert(2, r("fshard", f"step on {PROCS} processes: fs.jit(fs.shard(...)), made to "
                         "wait for the last-computed output", jt["shard, waiting for the last "
                                                                 "output"],
                         "diagnostic: what fs.jit does for ordinary programs"))
    for name, p in prop.items():
        pt = p["times"]
        stage = pt["stage"]["median_s"]
        for k, label in (("stage", "fs.make_ir (stage only, unsharded)"),
                         ("propagate", "propagate (8 devices, batch split)"),
                         ("partition", "partition (per-device program)"),
                         ("shard_total", "stage + propagate + partition")):
            rows.append(r("fshard", f"100-layer MLP {name}: {label}", pt[k],
                          f"{pt[k]['median_s'] / stage:.1f}x staging" if k != "stage"
                          else f"{p['equations']} equations; per-device program: "
                          f"{p['collectives']}"))
    notes = comm_notes(cases) + [
        f"steps: MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, softmax cross-entropy; "
        f"loss and gradients, every output read with .asnumpy(); variants timed "
        f"interleaved in {STEP_ROUNDS} rounds after 3 warm-up steps; 2-process times "
        "are rank 0's",
        f"load average (1/5/15 min) in-process timing: {_load(local)}; 2-process job: "
        f"{_load(job)} (job wall time {job['wall_s']:.1f} s, includes the launch)",
        "propagation rows: ratio column is relative to the unsharded step, which means "
        "nothing for them; see 'x staging'. MindSpore's own sharding propagation "
        "refuses the CPU backend, so there is no MindSpore row",
    ]
    return Result(rows, baseline="step unsharded, 1 process: fs.jit(fs.value_and_grad(loss))",
                  target="sharded steps: at the analytic minimum of communication; "
                         "fs.shard as fast as hand-written shard_map",
                  notes=notes)


def _ops(counts: dict) -> str:
    """``{"AllReduce": 7, ...}`` -> ``"7 AllReduce per step"`` (from the MindSpore source)."""
    return " + ".join(f"{k} {op}" for op, k in counts.items() if k) + " per step"


def _load(d) -> str:
    before, after = d["loadavg"]
    return (f"{'/'.join(f'{v:.1f}' for v in before)} before, "
            f"{'/'.join(f'{v:.1f}' for v in after)} after")


if __name__ != "__main__":  # `python -m benchmarks.sharding` imports the module again
    from benchmarks.harness import benchmark as _register

    _register("sharding", title="fs.shard: communication vs the minimum, a 2-process "
              "training step, propagation time")(sharding)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sharding",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few runs: a smoke test")
    p.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.quick)
        return 0
    from benchmarks import __main__ as suite

    return suite.main(["--only", "sharding", "--no-jax"] + (["--quick"] if args.quick else []))


if __name__ == "__main__":
    sys.exit(main())
