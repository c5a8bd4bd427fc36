"""The seed's dynamic-shape network, sharded: batches of a new size every step through
one program declared with ``fs.Symbol(divisor=8)``, traced and compiled once.

Used in one process on a virtual mesh (tests/test_dynamic_shapes.py) and as the
script of real 2- and 4-process jobs (tests/distributed/test_dynamic_multiprocess.py).
As a script it prints ``CHECK <name> ok`` per check, then ``ALL CHECKS PASSED``.
"""

from __future__ import annotations

import numpy as np

SIZES = (8, 16, 24, 32, 48, 40)  # every size a multiple of 8, in a varying order
STEPS = 12


def check(name: str, got, want, rtol: float = 1e-5) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = rtol * max(1.0, float(np.abs(want).max(initial=0.0)))
    err = float(np.abs(got - want).max(initial=0.0))
    if got.shape != want.shape or not err <= tol:
        raise AssertionError(f"CHECK {name} failed: shape {got.shape} vs {want.shape}, "
                             f"max error {err} > {tol}")
    print(f"CHECK {name} ok", flush=True)


def digits():
    """The digits data as the seed's (N, 1, H, W) images and int32 labels."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    return (images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), labels.astype(np.int32)


def seed_net(params, x):
    """The seed's network: reshape, MatMul, ReLU, MatMul, ReLU, MatMul."""
    from mindspore import ops

    h = ops.reshape(x, (-1, 64))
    h = ops.relu(ops.matmul(h, params["fc1"]))
    h = ops.relu(ops.matmul(h, params["fc2"]))
    return ops.matmul(h, params["fc3"])


def seed_loss(params, x, labels):
    from mindspore import ops

    logits = seed_net(params, x)
    return ops.mean(-ops.gather_elements(ops.log_softmax(logits, 1), 1,
                                         ops.expand_dims(labels, 1)))


def seed_strategies(n: int) -> tuple:
    """The seed's split counts on ``n`` devices: MatMul ((2, 4), (4, 1)) and
    MatMul ((1, 8), (8, 1)) on 8 (the input's feature split is the image rows' split
    before the reshape), scaled down for fewer devices."""
    a = min(2, n)
    b = n // a
    params = {"fc1": (b, 1), "fc2": (n, 1), "fc3": None}
    return params, (a, 1, b, 1), None


def init_params():
    rng = np.random.default_rng(0)
    return {name: (rng.normal(size=shape) * 0.1).astype(np.float32)
            for name, shape in (("fc1", (64, 64)), ("fc2", (64, 64)), ("fc3", (64, 10)))}


def train_seed(n: int, mesh=None, steps: int = STEPS, lr: float = 0.5):
    """SGD on the digits with the seed's strategies on ``n`` devices and a
    ``Symbol(divisor=8)`` batch, a new batch size every step, against the unsharded
    static-shape step. Returns (sharded losses, static losses, the sharded function)."""
    import mindspore as ms
    from mindspore import Tensor

    import fshard as fs

    def step(params, x, y):
        loss, grads = fs.value_and_grad(seed_loss)(params, x, y)
        return {k: params[k] - lr * grads[k] for k in params}, loss

    p_strategy, x_strategy, y_strategy = seed_strategies(n)
    s0 = ms.Symbol(divisor=8, unique=True)  # the seed's declaration, MindSpore's way
    sharded = fs.shard(step, in_strategy=(p_strategy, x_strategy, y_strategy),
                       out_strategy=(p_strategy, None), mesh=mesh)
    sharded.set_inputs(None, ms.Tensor(shape=[s0, 1, 8, 8], dtype=ms.float32),
                       ms.Tensor(shape=[s0], dtype=ms.int32))
    static = fs.jit(step)
    images, labels = digits()
    p_dyn = p_static = {k: Tensor(v) for k, v in init_params().items()}
    got, want, start = [], [], 0
    for i in range(steps):
        b = SIZES[i % len(SIZES)]
        x, y = Tensor(images[start:start + b]), Tensor(labels[start:start + b])
        start += b
        p_dyn, loss = sharded(p_dyn, x, y)
        p_static, ref = static(p_static, x, y)
        got.append(float(loss.asnumpy()))
        want.append(float(ref.asnumpy()))
    return got, want, sharded


def autoparallel_seed(n: int, mesh=None, steps: int = 6):
    """``fs.AutoParallel`` with a declared batch: data parallel over the ``n`` devices
    (every process holds the global batch), batch sizes varying, one compile; returns
    (losses, static losses, the step)."""
    import mindspore as ms
    from mindspore import Tensor

    import fshard as fs

    opt = fs.optim.sgd(0.5)
    s0 = fs.Symbol(divisor=8)
    ap = fs.AutoParallel(seed_loss, opt, mesh=mesh, in_shapes=(
        fs.ArrayType((s0, 1, 8, 8), ms.float32), fs.ArrayType((s0,), ms.int32)))
    ap.dataset_strategy(((n, 1, 1, 1), (n,)))

    def static_step(params, state, x, y):
        loss, grads = fs.value_and_grad(seed_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return fs.optim.apply_updates(params, updates), state, loss

    static = fs.jit(static_step)
    images, labels = digits()
    params = {k: Tensor(v) for k, v in init_params().items()}
    state = ap.init(params)
    p_static, s_static = params, opt.init(params)
    got, want, start = [], [], 0
    for i in range(steps):
        b = SIZES[(i + 2) % len(SIZES)]
        x, y = Tensor(images[start:start + b]), Tensor(labels[start:start + b])
        start += b
        state, loss = ap(state, x, y)
        p_static, s_static, ref = static(p_static, s_static, x, y)
        got.append(float(loss.asnumpy()))
        want.append(float(ref.asnumpy()))
    _, jitted = ap.sharded(state, x, y)
    return got, want, jitted


def data_parallel_declared(n: int, steps: int = 3):
    """``fs.AutoParallel`` in a job with ``dataset_strategy('data_parallel')``: each
    process passes its own rows, which ``set_inputs`` declares (as MindSpore's does
    there), a new slice size every step; a slice the declaration refuses is a
    ShapeError on every process. Returns (losses, static losses on the global batch)."""
    import mindspore as ms
    from mindspore import Tensor

    import fshard as fs

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
    rank = fs.distributed.rank()
    got, want, start = [], [], 0
    for i in range(steps):
        b = 8 * (i % 2 + 1)  # this process's rows: 8, 16, 8
        x, y = images[start:start + n * b], labels[start:start + n * b]
        start += n * b
        state, loss = ap(state, Tensor(x[rank * b:(rank + 1) * b]),
                         Tensor(y[rank * b:(rank + 1) * b]))
        p_static, s_static, ref = static(p_static, s_static, Tensor(x), Tensor(y))
        got.append(float(loss.asnumpy()))
        want.append(float(ref.asnumpy()))
    try:
        ap(state, Tensor(images[:5]), Tensor(labels[:5]))
    except fs.errors.ShapeError as e:
        assert "size 5 in dimension 0" in str(e) and "each process's slice" in str(e), e
        print("CHECK declared slices refuse a size the Symbol does not accept ok",
              flush=True)
    return got, want


def main() -> None:
    import mindspore as ms
    from mindspore import Tensor

    import fshard as fs

    fs.distributed.init()
    n = fs.distributed.world_size()
    got, want, sharded = train_seed(n)
    for i, (g, w) in enumerate(zip(got, want)):
        check(f"seed step {i} loss", g, w)
    print(f"CHECK seed compiled {sharded.trace_count} {sharded.compile_count} ok", flush=True)
    got, want, jitted = autoparallel_seed(n)
    for i, (g, w) in enumerate(zip(got, want)):
        check(f"AutoParallel step {i} loss", g, w)
    print(f"CHECK AutoParallel compiled {jitted.trace_count} {jitted.compile_count} ok",
          flush=True)
    # data_parallel (the default in a job): set_inputs declares each process's slice
    got, want = data_parallel_declared(n)
    for i, (g, w) in enumerate(zip(got, want)):
        check(f"declared slices step {i} loss", g, w)
    print("ALL CHECKS PASSED", flush=True)


if __name__ == "__main__":
    main()
