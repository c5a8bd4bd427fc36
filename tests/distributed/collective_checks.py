"""Collectives and shard_map in a real multi-process job, against a virtual mesh.

``python -m fshard.launch -n N tests/distributed/collective_checks.py OUT_DIR`` (N = 2
or 4). Every rank joins the job and, for each check, runs a function under
``fs.jit(fs.shard_map(...))`` on the world mesh (real MindSpore collectives) and the
same function on a virtual mesh of the same shape in this process, and records the
largest difference. It also differentiates through shard_map (outside and inside),
trains the data-parallel example for a few steps, and writes the lowered source of
one many-collective program. Each rank writes ``OUT_DIR/rank<k>.json`` and
``OUT_DIR/lowered_rank<k>.py``; tests/distributed/test_collectives_multiprocess.py
reads them. Launches cost ~15 s each, so all checks share one job.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

EXAMPLE_STEPS = 5


def main(out_dir: str) -> None:
    import fshard as fs

    fs.distributed.init()
    rank, world = fs.distributed.rank(), fs.distributed.world_size()
    rng = np.random.default_rng(0)  # the same data on every rank
    results: dict = {"rank": rank, "world": world, "checks": {}, "grads": {}, "checksums": {}}
    t0 = time.perf_counter()

    def progress(what: str) -> None:
        if os.environ.get("FSHARD_CHECKS_VERBOSE"):
            print(f"{time.perf_counter() - t0:6.1f} s  {what}", flush=True)

    def compare(cases: dict, x, shape, names, grads: tuple) -> None:
        """All ``cases`` (name -> (f, in_strategy entry, out_strategy entry)) as one
        shard_map of one input per case: one graph for the values, one for the
        gradients of the ``grads`` cases (each case's input gets only its own
        gradient, so the results stay per collective)."""
        names_ = list(cases)
        fns = [cases[k][0] for k in names_]
        ins = tuple(cases[k][1] for k in names_)
        outs = tuple(cases[k][2] for k in names_)

        def many(*xs):
            return tuple(f(v) for f, v in zip(fns, xs))

        real = fs.Mesh(shape, names)
        virtual = fs.Mesh(shape, names, virtual=True)
        assert not real.is_virtual and virtual.is_virtual
        fr = fs.shard_map(many, ins, outs, mesh=real)
        fv = fs.shard_map(many, ins, outs, mesh=virtual)
        args = [x] * len(names_)
        # Every rank runs the real collectives; rank 0 alone also runs the virtual mesh
        # (the ranks share two cores) and records the differences. Every rank records a
        # checksum of its (replicated) results, so the test sees that the ranks agree.
        real_out = [o.asnumpy() for o in fs.jit(fr)(*args)]
        progress(f"real {shape}")
        virt_out = [o.asnumpy() for o in fv(*args)] if rank == 0 else real_out
        progress(f"virtual {shape}")
        for k, a, b in zip(names_, real_out, virt_out):
            assert a.shape == b.shape and a.dtype == b.dtype, (k, a.shape, b.shape)
            a, b = a.astype(np.float64), b.astype(np.float64)
            results["checks"][k] = float(np.abs(a - b).max())
            results["checksums"][f"checks/{k}"] = float(np.abs(a).sum())
        # d/dx of a weighted sum of the outputs, through the shard_map
        if not grads:
            return
        which = [names_.index(k) for k in grads]
        ws = [rng.standard_normal(real_out[i].shape).astype(np.float32) for i in which]

        def weighted(f):
            def loss(*xs):
                out = f(*xs)
                return sum((out[i] * w).sum() for i, w in zip(which, ws))
            return loss

        argnums = tuple(which)
        gr = fs.jit(fs.grad(weighted(fr), argnums=argnums))(*args)
        progress(f"real grads {shape}")
        gv = fs.grad(weighted(fv), argnums=argnums)(*args) if rank == 0 else gr
        progress(f"virtual grads {shape}")
        for k, a, b in zip(grads, gr, gv):
            a, b = a.asnumpy(), b.asnumpy()
            results["grads"][k] = float(np.abs(a - b).max())
            results["checksums"][f"grads/{k}"] = float(np.abs(a).sum())

    n = world
    x = rng.standard_normal((n * 4, 3)).astype(np.float32)
    split, rep = (n, 1), None
    ring = [(i, (i + 1) % n) for i in range(n)]
    cases = {
        "psum": (lambda v: fs.psum(v, "d"), split, None),
        "pmean": (lambda v: fs.pmean(v, "d"), split, None),
        "pmax": (lambda v: fs.pmax(v, "d"), split, None),
        "pmin": (lambda v: fs.pmin(v, "d"), split, None),
        "all_gather": (lambda v: fs.all_gather(v, "d"), split, None),
        "all_gather_tiled": (lambda v: fs.all_gather(v, "d", axis=1, tiled=True), split, None),
        "psum_scatter": (lambda v: fs.psum_scatter(v, "d", tiled=True), rep, (n, 1)),
        "all_to_all": (lambda v: fs.all_to_all(v, "d", 0, 1, tiled=True), split, (n, 1)),
        "ppermute_ring": (lambda v: fs.ppermute(v, "d", ring), split, (n, 1)),
        "ppermute_partial": (lambda v: fs.ppermute(v, "d", [(0, n - 1)]), split, (n, 1)),
        "broadcast": (lambda v: fs.broadcast(v, "d", root=n - 1), split, None),
        "axis_index": (lambda v: v * fs.axis_index("d").astype(v.dtype), split, (n, 1)),
        # context parallelism: the sequence (n * 4 rows) split over d, k/v round the ring
        "ring_attention": (lambda v: fs.nn.ring_attention(v, v, v, "d"), split, (n, 1)),
        "ring_attention_causal_zigzag": (
            lambda v: fs.nn.ring_attention(v, v, v, "d", causal=True, layout="zigzag"),
            split, (n, 1)),
    }
    compare(cases, x, (n,), ("d",), grads=("psum", "all_gather_tiled", "psum_scatter",
                                             "all_to_all", "ppermute_partial", "broadcast",
                                             "pmax", "ring_attention_causal_zigzag"))

    # Integer and bool values: MindSpore's CPU collectives take float32 and float16
    # only, so fshard carries them exactly (ints as 16-bit chunks: values beyond 2**24).
    xi = ((rng.integers(-2**31, 2**31 - 1, (n * 4, 3), dtype=np.int64) // n)
          .astype(np.int32))
    int_cases = {
        "int_psum": (lambda v: fs.psum(v, "d"), split, None),
        "int_pmax": (lambda v: fs.pmax(v, "d"), split, None),
        "int_pmin": (lambda v: fs.pmin(v, "d"), split, None),
        "int_all_gather": (lambda v: fs.all_gather(v, "d", axis=1, tiled=True), split, None),
        "int_ppermute_ring": (lambda v: fs.ppermute(v, "d", ring), split, (n, 1)),
        "int_broadcast": (lambda v: fs.broadcast(v, "d", root=n - 1), split, None),
        "int_all_to_all": (lambda v: fs.all_to_all(v, "d", 0, 1, tiled=True), split, (n, 1)),
    }
    compare(int_cases, xi, (n,), ("d",), grads=())
    # Integers gathered along the rows: float32 chunks through one native AllGather (not
    # an AllReduce of a slot buffer), exact for every width at its extremes.
    mesh_d = fs.Mesh((n,), ("d",))
    rows = fs.jit(fs.shard_map(lambda v: fs.all_gather(v, "d", tiled=True), (split,), None,
                               mesh=mesh_d))
    stacked = fs.jit(fs.shard_map(lambda v: fs.all_gather(v, "d"), (split,), None,
                                  mesh=mesh_d))
    for dt in (np.int8, np.uint8, np.int16, np.int32, np.int64):
        info = np.iinfo(dt)
        vals = np.array([info.min, info.max, 0, 1, -1 if info.min < 0 else 7, 12345 % info.max],
                        dt)
        v = np.resize(vals, (n * 4, 3)).astype(dt)
        got = rows(v).asnumpy()
        results["checks"][f"int_rows_all_gather_{dt.__name__}"] = float(
            not (got.dtype == dt and np.array_equal(got, v)))
        got = stacked(v).asnumpy()
        results["checks"][f"int_stacked_all_gather_{dt.__name__}"] = float(
            not np.array_equal(got, v.reshape(n, 4, 3)))
        body = rows.lower(v).as_text().split("\ndef ", 1)[1]
        results["checks"][f"int_rows_all_gather_{dt.__name__}_lowered"] = float(
            body.count("AllReduce") != 0 or body.count("AllGather") != 1)
    xb = rng.standard_normal((n * 4, 3)) > 0
    bool_cases = {
        "bool_all_gather": (lambda v: fs.all_gather(v, "d"), split, None),
        "bool_pmax": (lambda v: fs.pmax(v, "d"), split, None),
        "bool_pmin": (lambda v: fs.pmin(v, "d"), split, None),
        "bool_ppermute_ring": (lambda v: fs.ppermute(v, "d", ring), split, (n, 1)),
        "bool_broadcast": (lambda v: fs.broadcast(v, "d", root=0), split, None),
    }
    compare(bool_cases, xb, (n,), ("d",), grads=())
    if n == 4:  # sub-groups: the gathers are emulated through AllReduce
        ab = fs.Layout((2, 2), ("a", "b"))
        sub_cases = {
            "int_2d_all_gather_b": (lambda v: fs.all_gather(v, "b", axis=1, tiled=True),
                                    ab("a", "b"), ab("a", "None")),
            "int_2d_psum_a": (lambda v: fs.psum(v, "a"), ab("a", "b"), ab("None", "b")),
        }
        compare(sub_cases, xi[:, :2].copy(), (2, 2), ("a", "b"), grads=())
        compare({"bool_2d_all_gather_b": (lambda v: fs.all_gather(v, "b", axis=1, tiled=True),
                                          ab("a", "b"), ab("a", "None"))},
                xb[:, :2].copy(), (2, 2), ("a", "b"), grads=())

    # Without fs.jit: a multi-process shard_map compiles itself.
    f = fs.shard_map(lambda v: fs.psum(v * v, "d"), (split,), None, mesh=fs.Mesh((n,), ("d",)))
    eager = f(x).asnumpy()
    expected = (x * x).reshape(n, 4, 3).sum(0)
    results["checks"]["eager_shard_map"] = float(np.abs(eager - expected).max())
    # ... and its gradient without fs.jit: each collective runs as its own small graph.
    g = fs.grad(lambda v: f(v).sum())(x).asnumpy()
    results["checks"]["eager_grad_shard_map"] = float(np.abs(g - 2 * x).max())

    # value_and_grad inside shard_map: gradients averaged by pmean's transpose.
    w = rng.standard_normal((3, 2)).astype(np.float32)

    def loss(w, v):
        return (fs.ops.tanh(v @ w) ** 2).mean()

    dp = fs.Layout((n,), ("d",))
    step = fs.jit(fs.shard_map(fs.value_and_grad(lambda w, v: fs.pmean(loss(w, v), "d")),
                               (None, dp("d", "None")), ((), None), mesh=fs.Mesh((n,), ("d",))))
    val, g = step(w, x)
    val0, g0 = fs.value_and_grad(loss)(w, x)
    results["checks"]["grad_inside_value"] = float(abs(val.asnumpy() - val0.asnumpy()))
    results["checks"]["grad_inside_grads"] = float(np.abs(g.asnumpy() - g0.asnumpy()).max())
    # ... of a loss of the all-gathered rows: every device computes the same gradient,
    # its shares are summed on the device (n times its own), and only the AllGather
    # communicates
    def gathered(w, v):
        return fs.value_and_grad(loss)(w, fs.all_gather(v, "d", tiled=True))

    step = fs.jit(fs.shard_map(gathered, (None, dp("d", "None")), ((), None),
                               mesh=fs.Mesh((n,), ("d",))))
    val, g = step(w, x)
    results["checks"]["grad_of_gathered_value"] = float(abs(val.asnumpy() - val0.asnumpy()))
    results["checks"]["grad_of_gathered_grads"] = float(np.abs(g.asnumpy() - g0.asnumpy()).max())
    body = step.lower(w, x).as_text().split("\ndef ", 1)[1]
    results["checks"]["grad_of_gathered_allreduces"] = float(body.count("AllReduce"))

    # A scan with a psum in its body stays one loop on each rank (the VMA pass walks
    # the body to a fixed point); values, the gradient through it and the gradient
    # inside it, a carry made varying by the body and a while loop whose condition
    # reads a psum, a cond with a collective in a branch, relative to the virtual mesh's.
    def rnn(w, h, xs):
        def step(c, x):
            c = fs.ops.tanh(c @ w + x + 0.01 * fs.psum(c.sum(0), "d"))
            return c, fs.psum(c.sum(), "d")
        return fs.scan(step, h, xs, unroll=False)

    def rnn_loss(w, h, xs):
        c, ys = rnn(w, h, xs)
        return fs.pmean((c ** 2).mean(), "d") + ys.mean()

    ws = (rng.standard_normal((3, 3)) * 0.4).astype(np.float32)
    hs = (rng.standard_normal((2 * n, 3)) * 0.3).astype(np.float32)
    xss = (rng.standard_normal((20, 2 * n, 3)) * 0.3).astype(np.float32)
    rows = fs.Layout((n,), ("d",))
    sm_in = (None, rows("d", "None"), rows("None", "d", "None"))
    sm_out = ((rows("d", "None"), None), (None, None), (rows("d"), None), (None, rows("d", "None")),
              rows("d", "None"))

    def grow(xs):  # a carry replicated at entry that the body makes varying
        def step(a, x):
            a = a + x.sum(0)
            return a, fs.psum(a, "d")
        return fs.scan(step, np.zeros(3, np.float32), xs, unroll=False)

    def shrink(h):  # a while loop whose condition reads a psum
        return fs.while_loop(lambda c: fs.psum((c[1] ** 2).sum(), "d") > 0.05,
                             lambda c: (c[0] + 1, c[1] * 0.9), (np.int32(0), h))

    def branch(h):  # a cond on a replicated predicate, a collective in one branch
        return fs.cond(fs.psum(h.sum(), "d") > 0, lambda h: h - fs.pmean(h, "d"),
                       lambda h: h * 2, h)

    def scan_both(w, h, xs):
        return (rnn(w, h, xs), fs.value_and_grad(rnn_loss)(w, h, xs), grow(xs), shrink(h),
                branch(h))

    got = {}
    for mesh_ in (fs.Mesh((n,), ("d",)), fs.Mesh((n,), ("d",), virtual=True)):
        run = fs.jit(fs.shard_map(scan_both, sm_in, sm_out, mesh=mesh_))
        (c, ys), (val, gw), (a, a_ys), (k, hk), hb = run(ws, hs, xss)
        outer = fs.grad(lambda w: (run(w, hs, xss)[0][0] ** 2).sum())(ws)
        got[mesh_.is_virtual] = [o.asnumpy()
                                 for o in (c, ys, val, gw, a, a_ys, k, hk, hb, outer)]
        if not mesh_.is_virtual:
            results["checks"]["scan_psum_is_a_loop"] = float(
                "while i < 20" not in run.lower(ws, hs, xss).as_text())
    results["checks"]["scan_psum_in_shard_map"] = max(
        float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))
        for a, b in zip(got[False], got[True]))
    progress("scan with a psum inside shard_map")

    if n == 4:  # a 2x2 mesh: sub-group collectives and both axis orders
        y = rng.standard_normal((4, 6)).astype(np.float32)
        ab = fs.Layout((2, 2), ("a", "b"))
        both = ab("a", "b")
        cases2 = {
            "2d_psum_a": (lambda v: fs.psum(v, "a"), both, ab("None", "b")),
            "2d_psum_b": (lambda v: fs.psum(v, "b"), both, ab("a", "None")),
            "2d_psum_ab": (lambda v: fs.psum(v, ("a", "b")), both, None),
            "2d_pmax_b": (lambda v: fs.pmax(v, "b"), both, ab("a", "None")),
            "2d_all_gather_b": (lambda v: fs.all_gather(v, "b", axis=1, tiled=True), both,
                                ab("a", "None")),
            "2d_all_gather_ba": (lambda v: fs.all_gather(v, ("b", "a")), both, None),
            "2d_psum_scatter_a": (lambda v: fs.psum_scatter(v, "a", tiled=True), both,
                                  ab("a", "b")),
            "2d_all_to_all_b": (lambda v: fs.all_to_all(v, "b", 0, 1, tiled=True), both,
                                ab(("a", "b"), "None")),
            "2d_ppermute_a": (lambda v: fs.ppermute(v, "a", [(0, 1), (1, 0)]), both, ab("a", "b")),
            "2d_broadcast_b": (lambda v: fs.broadcast(v, "b", root=1), both, ab("a", "None")),
            "2d_axis_index_ba": (lambda v: v * fs.axis_index(("b", "a")).astype(v.dtype), both,
                                 ab("a", "b")),
        }
        compare(cases2, y, (2, 2), ("a", "b"), grads=("2d_psum_a", "2d_all_gather_b",
                                                         "2d_psum_scatter_a", "2d_broadcast_b"))

    # The same program lowered on every rank: the test compares the collective calls.
    mesh = fs.Mesh((2, n // 2), ("a", "b")) if n >= 4 else fs.Mesh((n,), ("a",))
    axes = mesh.axis_names

    def many(v):  # independent collectives of a value that varies over every axis
        return (fs.psum(v, axes[0]), fs.all_gather(v, axes[-1], axis=1, tiled=True),
                fs.pmax(v, axes), fs.ppermute(v, axes[0], [(0, 1)]),
                fs.psum_scatter(v, axes[-1], scatter_dimension=1, tiled=True))

    split_all = (fs.Layout(mesh.shape, axes)(*(axes if len(axes) == 2 else (axes[0], "None"))),)
    lowered = fs.jit(fs.shard_map(many, split_all, None, mesh=mesh, check_vma=False)).lower(
        rng.standard_normal((4, 8)).astype(np.float32))
    with open(os.path.join(out_dir, f"lowered_rank{rank}.py"), "w") as fh:
        fh.write(lowered.as_text())

    # The example: data-parallel training losses over the world.
    progress("lowered")
    import data_parallel_mlp as example

    results["losses"] = example.train(EXAMPLE_STEPS, fs.Mesh((n,), ("dp",)))
    results["seconds"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    print(f"rank {rank}: {len(results['checks'])} checks, {len(results['grads'])} grads, "
          f"{results['seconds']} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
