"""``fs.sharding.calibrate()`` inside a job started by ``fshard.launch`` (see
tests/distributed/test_calibrate_multiprocess.py): every rank measures the job, keeps
rank 0's numbers and caches them; a plan of the job is then priced with them. Writes
``rank<r>.json`` into the directory given."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def main(out_dir: str) -> None:
    os.environ["FSHARD_CACHE_DIR"] = os.path.join(out_dir, "cache")
    from mindspore import Tensor

    import fshard as fs
    from fshard.errors import ShardingError
    from fshard.sharding import rates

    fs.distributed.init()
    n, r = fs.distributed.world_size(), fs.distributed.rank()
    try:
        fs.sharding.calibrate(devices=n + 1)
        refused = ""
    except ShardingError as e:
        refused = str(e)
    default = fs.shard(lambda x: x.sum(), in_strategy=((n, 1),)).explain(
        Tensor(np.ones((8, 4), np.float32)))
    table = fs.sharding.calibrate(runs=2)
    rng = np.random.default_rng(0)  # the same inputs on every rank
    p = {"w0": Tensor(rng.standard_normal((32, 64)).astype(np.float32) / 6),
         "w1": Tensor(rng.standard_normal((64, 10)).astype(np.float32) / 8)}
    x = Tensor(rng.standard_normal((64, 32)).astype(np.float32))

    def loss(p, x):
        return (fs.ops.relu(x @ p["w0"]) @ p["w1"]).square().mean()

    f = fs.shard(fs.value_and_grad(loss), in_strategy=({"w0": (1, 1), "w1": (1, 1)},
                                                       (n, 1)))
    e = f.explain(p, x)
    step = fs.jit(f)
    fs.block_until_ready(step(p, x))
    # fs.shard in a job buckets the AllReduces it inserts (the loss's, both gradients')
    value, grads = step(p, x)
    want_v, want_g = fs.value_and_grad(loss)(p, x)
    shard_fusion = {"collectives": f.partitioned(p, x).collectives(), "fused": e.fused,
                    "value": [float(value.asnumpy()), float(want_v.asnumpy())],
                    "grads_close": all(np.allclose(grads[k].asnumpy(), want_g[k].asnumpy(),
                                                   rtol=1e-5, atol=1e-7) for k in p)}
    # ... and its AllGathers: a batch's float rows and int labels (int32 beyond 2**24,
    # int64 near 2**63) gathered whole, in one bucket (the integers carried as chunks of
    # the float32 AllGather), to the bit
    labels = rng.integers(-2**31, 2**31 - 1, (64,), dtype=np.int64).astype(np.int32)
    big = np.resize(np.array([2**63 - 1, -2**63, -2**63 + 1, 5], np.int64), (64,))
    g = fs.shard(lambda x, y, z: (x * 2.0, y + 1, z - 1),
                 in_strategy=((n, 1), (n,), (n,)), out_strategy=((1, 1), (1,), (1,)))
    args = (x, Tensor(labels), Tensor(big))
    got = [o.asnumpy() for o in fs.jit(g)(*args)]
    gather_fusion = {"collectives": g.partitioned(*args).collectives(),
                     "fused": g.explain(*args).fused,
                     "exact": bool(np.array_equal(got[0], x.asnumpy() * 2.0)
                                   and np.array_equal(got[1], labels + 1)
                                   and got[2].dtype == np.int64
                                   and np.array_equal(got[2], big - 1))}
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        fs.block_until_ready(step(p, x))
        times.append(time.perf_counter() - t0)
    # AutoParallel's searching mode in the job: the plan computing everything whole is
    # one of its paths here; the step trains as one device does on the global batch.
    from fshard.sharding import search
    from fshard.sharding.partition import partition
    from fshard.sharding.propagation import propagate

    ys = rng.standard_normal((64, 10)).astype(np.float32)
    mse = (lambda p, x, y: ((fs.ops.relu(x @ p["w0"]) @ p["w1"] - y) ** 2).mean())
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1), "sharding_propagation")
    ap.dataset_strategy("data_parallel")
    state = ap.init(p)
    b = 64 // n
    rows, own = x.asnumpy()[r * b:(r + 1) * b], ys[r * b:(r + 1) * b]
    s, _ = ap._sharded(state, ap._global_batch((rows, own)))
    plan = s._prepare((state.params, state.opt_state, state.step,
                       x.asnumpy(), ys))[0]
    prop = propagate(plan.body, plan.in_shardings, plan.out_shardings, plan.mesh, 2)
    problem = search.Problem.from_propagated(prop)
    whole = search.whole_path(problem)
    lazy = problem.evaluate(*problem.assignment(problem.lazy_decisions()))
    paths = [problem.evaluate(prop.in_shardings, prop.choice).score(2, problem.model),
             lazy.score(2, problem.model), whole[2]]
    picked = search.cheaper_path(prop, problem)
    chosen = problem.evaluate(picked.in_shardings, picked.choice).score(2, problem.model)
    picked_collectives = partition(picked).collectives()
    planned = ap.partitioned(state, rows, own).collectives()
    checks_s = ap.explain(state, rows, own).checks_s
    losses, want = [], []
    for _ in range(3):
        state, loss = ap(state, rows, own)
        losses.append(float(loss.asnumpy()))
    q = dict(p)
    for _ in range(3):
        v, g = fs.value_and_grad(mse)(q, x, Tensor(ys))
        q = {k: q[k] - 0.1 * g[k] for k in q}
        want.append(float(v.asnumpy()))
    # semi_auto's data-parallel step: in a job its AllReduces (the loss's and the two
    # gradients') are one bucket by default, priced so by explain; with comm_fusion
    # turned off, one each, and the same numbers to the bit
    fusion = {}
    for name, config in (("default", None), ("off", {"openstate": False})):
        dp = fs.AutoParallel(mse, fs.optim.sgd(0.1), "semi_auto")
        dp.dataset_strategy("data_parallel")
        if config is not None:
            dp.comm_fusion(config)
        st = dp.init(p)
        ex = dp.explain(st, rows, own)
        got = {"collectives": dp.partitioned(st, rows, own).collectives(),
               "fused": ex.fused, "fusion_s": ex.fusion_s,
               "explained_collectives": ex.collectives, "losses": [], "w0": None}
        for _ in range(3):
            st, v = dp(st, rows, own)
            got["losses"].append(float(v.asnumpy()))
        got["w0"] = np.asarray(st.params["w0"].asnumpy() if hasattr(
            st.params["w0"], "asnumpy") else st.params["w0"]).tobytes().hex()
        fusion[name] = got
    # recursive_programming on the global batch, whole on every process (the MLP
    # 64-512-512-10 on 256 rows): the state it carries is planned whole on both sides
    # too, so the plan computing everything whole (semi_auto's here, no collective)
    # stays open and the plan taken is never priced above it; it trains as one device
    # does. (Whether the plan for one call split the state depends on the job's rates:
    # tests/sharding/test_planning.py holds the change to the default rates.)
    whole_batch = {}
    mp = {f"w{i}": Tensor(rng.standard_normal((a, b)).astype(np.float32) / np.sqrt(a))
          for i, (a, b) in enumerate(((64, 512), (512, 512), (512, 10)))}
    mx = Tensor(rng.standard_normal((256, 64)).astype(np.float32))
    my = Tensor(rng.standard_normal((256, 10)).astype(np.float32))

    def mlp(p, x, y):
        h = fs.ops.relu(fs.ops.relu(x @ p["w0"]) @ p["w1"])
        return ((h @ p["w2"] - y) ** 2).mean()

    for mode in ("semi_auto", "recursive_programming"):
        wb = fs.AutoParallel(mlp, fs.optim.adam(0.01), mode)
        wb.dataset_strategy("full_batch")
        st = wb.init(mp)
        got = {"price": wb.explain(st, mx, my).total_s,
               "collectives": wb.partitioned(st, mx, my).collectives(), "losses": []}
        for _ in range(3):
            st, v = wb(st, mx, my)
            got["losses"].append(float(v.asnumpy()))
        whole_batch[mode] = got
    q, adam = dict(mp), fs.optim.adam(0.01)
    o, whole_batch["one_device"] = adam.init(q), []
    for _ in range(3):
        v, g = fs.value_and_grad(mlp)(q, mx, my)
        u, o = adam.update(g, o, q)
        q = fs.optim.apply_updates(q, u)
        whole_batch["one_device"].append(float(v.asnumpy()))
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as fh:
        json.dump({"whole_batch": whole_batch,
                   "job_model": problem.model.job, "paths": [list(t) for t in paths],
                   "chosen": list(chosen),
                   "collectives": planned, "picked_collectives": picked_collectives,
                   "checks_s": checks_s,
                   "losses": losses, "one_device": want, "fusion": fusion,
                   "shard_fusion": shard_fusion, "gather_fusion": gather_fusion,
                   "refused": refused, "table": table,
                   "saved": rates.cache_path(n, job=True).name,
                   "exists": rates.cache_path(n, job=True).exists(),
                   "default_call_s": default.call_s, "call_s": e.call_s,
                   "predicted_s": e.total_s, "measured_s": float(np.median(times))}, fh)


if __name__ == "__main__":
    main(sys.argv[1])
