"""Checks of the JAX user's API inside a job started by ``fshard.launch`` (see
tests/test_jax_api.py::test_the_jax_api_in_a_multi_process_job): ``fs.device_put``
keeps only this process's block of a split value, and sharded functions take it;
``fs.with_sharding_constraint`` and ``fs.jit(..., in_shardings=...)`` give the
unsharded results. Prints ``CHECK <name> ok`` per check, then ``ALL CHECKS PASSED``.
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
    from mindspore import Tensor

    import fshard as fs

    fs.distributed.init()
    n, rank = fs.distributed.world_size(), fs.distributed.rank()
    rng = np.random.default_rng(0)  # the same inputs on every rank
    x = rng.standard_normal((4 * n, 3)).astype(np.float32)
    w = rng.standard_normal((3, 2)).astype(np.float32)

    # device_put: this process's rows of x, as an fs.ShardedArray
    placed = fs.device_put(x, (n, 1))
    assert isinstance(placed, fs.ShardedArray), type(placed)
    rows = x.shape[0] // n
    check("device_put keeps this process's block", placed.block, x[rank * rows:(rank + 1) * rows])
    check("block_until_ready of a ShardedArray", fs.block_until_ready(placed).block,
          placed.block)
    check("device_put then gather", placed.gather(), x)
    whole = fs.device_put(x, (1, 1))
    assert not isinstance(whole, fs.ShardedArray)
    check("device_put of an unsplit strategy is the whole value", whole, x)

    def f(x, w):
        return (x @ w) * 2.0

    want = f(Tensor(x), Tensor(w))
    for strategy in ((n, 1), None):
        sharded = fs.shard(f, in_strategy=(strategy, None))
        check(f"shard(in_strategy={strategy}) takes the placed block", sharded(placed, w), want)
        check(f"jit(shard(in_strategy={strategy})) takes the placed block",
              fs.jit(sharded)(placed, w), want)

    # with_sharding_constraint with the job's collectives
    def g(x, w):
        h = fs.with_sharding_constraint(x @ w, (n, 1))
        return fs.ops.relu(h).sum(axis=0)

    check("with_sharding_constraint under shard",
          fs.shard(g, in_strategy=(None, None))(x, w), g(Tensor(x), Tensor(w)))
    check("jit(in_shardings, out_shardings)",
          fs.jit(f, in_shardings=((n, 1), None), out_shardings=(n, 1))(x, w), want)
    print("ALL CHECKS PASSED", flush=True)


if __name__ == "__main__":
    main()
