"""Checks of ``fs.shard`` inside a job started by ``fshard.launch`` (see
tests/sharding/test_shard.py::test_shard_in_a_multi_process_job).

Every rank holds the same global inputs (``full_batch``); each runs its block of the
per-device program with the job's real collectives and gets the global result, which
must equal the unsharded function's. Prints ``CHECK <name> ok`` per check, then
``ALL CHECKS PASSED``. Launches are slow (10-20 s), so the checks share one job.
"""

from __future__ import annotations

import numpy as np


def check(name: str, got, want, tol: float = 1e-4) -> None:
    got = got.asnumpy() if hasattr(got, "asnumpy") else np.asarray(got)
    want = want.asnumpy() if hasattr(want, "asnumpy") else np.asarray(want)
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    if got.shape != want.shape or not err <= tol:
        raise AssertionError(f"CHECK {name} failed: shape {got.shape} vs {want.shape}, "
                             f"max error {err}")
    print(f"CHECK {name} ok", flush=True)


def main() -> None:
    from mindspore import Tensor, ops

    import fshard as fs

    fs.distributed.init()
    n = fs.distributed.world_size()
    rng = np.random.default_rng(0)  # the same inputs on every rank

    def t(*shape):
        return Tensor(rng.standard_normal(shape).astype(np.float32))

    def dense_relu(x, weight, bias):
        return ops.relu(ops.bias_add(ops.matmul(x, weight), bias))

    x, w, b = t(16, 32), t(32, 8), t(8)
    sharded = fs.shard(dense_relu, in_strategy=((n, 1), None, None))
    check("row-split dense_relu", sharded(x, w, b), dense_relu(x, w, b))
    sharded = fs.shard(dense_relu, in_strategy=((1, n), None, None))
    check("contraction-split dense_relu", sharded(x, w, b), dense_relu(x, w, b))
    if n % 4 == 0:  # collectives over sub-groups of the world: half the ranks each
        sharded = fs.shard(dense_relu, in_strategy=((n // 2, 2), None, None))
        colls = sharded.partitioned(x, w, b).collectives()
        check("2-D dense_relu", sharded(x, w, b), dense_relu(x, w, b))
        print(f"CHECK sub-group collectives {colls} ok", flush=True)

    def mlp_sum(x, w1, w2):
        return ops.matmul(ops.relu(ops.matmul(x, w1)), w2).sum()

    x, w1, w2 = t(8, 16), t(16, 32), t(32, 16)
    megatron = fs.shard(mlp_sum, in_strategy=(None, (1, n), (n, 1)))
    check("megatron forward", megatron(x, w1, w2), mlp_sum(x, w1, w2))
    want = fs.grad(mlp_sum, argnums=(0, 1, 2))(x, w1, w2)
    for name, fn in (("grad(shard)", fs.grad(megatron, argnums=(0, 1, 2))),
                     ("jit(grad(shard))", fs.jit(fs.grad(megatron, argnums=(0, 1, 2))))):
        for i, (g, wg) in enumerate(zip(fn(x, w1, w2), want)):
            check(f"{name} gradient {i}", g, wg)
    vg = fs.shard(fs.value_and_grad(mlp_sum, argnums=(0, 1, 2)), in_strategy=(None, (1, n),
                                                                              (n, 1)))
    value, grads = vg(x, w1, w2)
    check("shard(value_and_grad) value", value, mlp_sum(x, w1, w2))
    for i, (g, wg) in enumerate(zip(grads, want)):
        check(f"shard(value_and_grad) gradient {i}", g, wg)

    # The seed's Cell example: a block sharded with a parameter plan.
    from mindspore import nn

    class BasicBlock(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense1 = nn.Dense(32, 32)
            self.gelu = nn.GELU()
            self.dense2 = nn.Dense(32, 32)

        def construct(self, x):
            return self.dense2(self.gelu(self.dense1(x)))

    ms_seed = __import__("mindspore")
    ms_seed.set_seed(0)
    block = BasicBlock()
    xb = t(16, 32)
    sharded_block = fs.shard(block, in_strategy=((n, 1),),
                             parameter_plan={"self.dense2.weight": (n, 1)})
    check("seed Cell with parameter_plan", sharded_block(xb), block(xb))

    # A sharded MLP training step (data parallel), three SGD steps, against one process.
    def loss(params, x, y):
        h = ops.relu(ops.matmul(x, params["w1"]) + params["b1"])
        logp = ops.log_softmax(ops.matmul(h, params["w2"]), -1)
        return -(logp * y).sum() / x.shape[0]

    params = {"w1": t(16, 32) * 0.1, "b1": t(32) * 0.0, "w2": t(32, 4) * 0.1}
    xs = t(8 * n, 16)
    ys = Tensor(np.eye(4, dtype=np.float32)[rng.integers(0, 4, 8 * n)])
    step = fs.jit(fs.shard(fs.value_and_grad(loss), in_strategy=(None, (n, 1), (n, 1))))
    ref_step = fs.jit(fs.value_and_grad(loss))
    p_sharded, p_ref = dict(params), dict(params)
    for i in range(3):
        v, g = step(p_sharded, xs, ys)
        v_ref, g_ref = ref_step(p_ref, xs, ys)
        check(f"training step {i} loss", v, v_ref, tol=1e-5)
        p_sharded = {k: p_sharded[k] - 0.1 * g[k] for k in p_sharded}
        p_ref = {k: p_ref[k] - 0.1 * g_ref[k] for k in p_ref}
    for k in params:
        check(f"trained parameter {k}", p_sharded[k], p_ref[k], tol=1e-5)
    # MindSpore's own autodiff over an fs.shard function: fshard supplies the derivative.
    import mindspore as ms

    def dense_loss(x, w):
        return (ops.relu(ops.matmul(x, w)) ** 2).sum()

    sharded_loss = fs.shard(dense_loss, in_strategy=((n, 1), None))

    def through_ms(x, w):
        return sharded_loss(x, w) * 2.0

    xd, wd = t(8, 4), t(4, 3)
    v, g = ms.value_and_grad(through_ms, grad_position=(0, 1))(xd, wd)
    v_ref, g_ref = fs.value_and_grad(lambda x, w: dense_loss(x, w) * 2.0, argnums=(0, 1))(xd, wd)
    check("mindspore.value_and_grad(shard) value", v, v_ref, tol=1e-4)
    for i, (a, b) in enumerate(zip(g, g_ref)):
        check(f"mindspore.value_and_grad(shard) gradient {i}", a, b, tol=1e-4)
    if n == 4:  # data x model (2, 2) with Layouts: relu's mask crosses devices as bool
        layout = fs.Layout((2, 2), ("dp", "mp"))

        def relu_mlp(p, x):
            h = ops.relu(ops.matmul(x, p["w1"]))
            return (ops.matmul(h, p["w2"]) ** 2).mean()

        p2 = {"w1": t(16, 32) * 0.3, "w2": t(32, 8) * 0.3}
        x2 = t(8, 16)
        vg = fs.shard(fs.value_and_grad(relu_mlp), in_strategy=(
            {"w1": layout("None", "mp"), "w2": layout("mp", "None")}, layout("dp", "None")))
        v, g = vg(p2, x2)
        v_ref, g_ref = fs.value_and_grad(relu_mlp)(p2, x2)
        check("(2, 2) Layout relu MLP value", v, v_ref, tol=1e-5)
        for k in p2:
            check(f"(2, 2) Layout relu MLP gradient {k}", g[k], g_ref[k], tol=1e-5)
    # Loops keep a split carry: the body runs per device inside one graph loop, with
    # the job's collectives inside it (the while condition's sum, each step's y).
    def rnn(h, w, xs):
        def step(h, x):
            h = ops.tanh(ops.matmul(h, w) + x)
            return h, (h * h).sum()
        return fs.scan(step, h, xs, unroll=1)

    def shrink(h):
        return fs.while_loop(lambda c: (c * c).sum() > 1.0, lambda c: c * 0.9, h)

    h0, wr, xr = t(2 * n, 4), t(4, 4) * 0.5, t(200, 2 * n, 4)
    loop_rnn = fs.shard(rnn, in_strategy=((n, 1), None, (1, n, 1)), out_strategy=((n, 1), None))
    loop_shrink = fs.shard(shrink, in_strategy=((n, 1),), out_strategy=(n, 1))
    want_c, want_y = rnn(h0, wr, xr)
    for name, wrap in (("shard", lambda f: f), ("jit(shard)", fs.jit)):
        c, y = wrap(loop_rnn)(h0, wr, xr)
        check(f"sharded loops: {name} scan carry", c, want_c)
        check(f"sharded loops: {name} scan ys", y, want_y, tol=1e-3)
        check(f"sharded loops: {name} while_loop", wrap(loop_shrink)(h0), shrink(h0))

    # The reverse loop sums each rank's share of dL/dw in its carry (a pending sum
    # started on one rank), one AllReduce after the loop.
    def rnn_loss(w, h, xs):
        c, ys = rnn(h, w, xs)
        return (c * c).sum() + ys.sum()

    grad_w = fs.grad(rnn_loss)
    sharded_grad = fs.shard(grad_w, in_strategy=(None, (n, 1), (1, n, 1)))
    want_gw = grad_w(wr, h0, xr)
    tol_gw = 1e-4 * max(1.0, float(np.abs(want_gw.asnumpy()).max()))
    for name, wrap in (("shard", lambda f: f), ("jit(shard)", fs.jit)):
        check(f"sharded loops: {name}(grad) scan weight gradient",
              wrap(sharded_grad)(wr, h0, xr), want_gw, tol=tol_gw)
    print("ALL CHECKS PASSED", flush=True)


if __name__ == "__main__":
    main()
