"""Run inside a 4- then a 2-process job (see test_training_multiprocess.py).

``python -m fshard.launch -n N tests/distributed/training_checks.py OUT_DIR``

Every job:
- data parallelism with each process feeding its own slice of the batch
  (``dataset_strategy("data_parallel")``): 50 Adam steps of the digits MLP, losses and
  final parameters written for the test to compare with one process;
- ``fs.shard(..., dataset_strategy="data_parallel")`` with per-process slices, eager
  and under ``fs.jit``, its outputs this process's blocks;
- the same with the dataset strategy set by MindSpore's context
  (``ms.set_auto_parallel_context(dataset_strategy="data_parallel")``), and seed 001's
  loss (``nn.CrossEntropyLoss`` in ``nn.WithLossCell``, whose tracing captures
  constants) trained by ``fs.AutoParallel`` with per-process slices
  (``seed_context``);
- ZeRO level3 steps through the step's hot path, then the whole state of ``ap.init``
  again and an uneven batch (``hot_path``).

The 4-process job also trains the 2 x 2 (dp x mp) Adam MLP with ZeRO level1 for 10
steps (its split state leaves are fs.ShardedArrays: each process holds its blocks, no
step gathers them), saves a checkpoint (each process its blocks), loads it back (each
process reading only the saved blocks it holds, counted), trains 10 more from the
loaded state, and writes every loss and the saved values. The 2-process job loads
that checkpoint into a data-parallel ZeRO level3 step (as process-local blocks of the
step's layouts) and trains the same 10 steps, then checks fs.checkpoint's own sharded
save and a process killed during a save (checkpoint_checks.py).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

import fshard as fs  # noqa: E402
from fshard import checkpoint as ckpt  # noqa: E402

import train_autoparallel as example  # noqa: E402

DP_STEPS = 50
RESUME_STEPS = 10


def n(x):
    return np.asarray(x.asnumpy() if hasattr(x, "asnumpy") else x)


STRATEGY_STEPS = 5


def strategy_net(strategy=((2, 2), (2, 1))):
    """A ReLU MLP with a loss whose first MatMul carries ``strategy`` (None: none)."""
    from mindspore import Parameter, Tensor, nn, ops

    class StrategyNet(nn.Cell):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(3)
            self.w1 = Parameter(Tensor((rng.standard_normal((16, 8)) * 0.3)
                                       .astype(np.float32)), name="w1")
            self.w2 = Parameter(Tensor((rng.standard_normal((8, 4)) * 0.3)
                                       .astype(np.float32)), name="w2")
            self.matmul1 = ops.MatMul().shard(strategy) if strategy else ops.MatMul()
            self.relu = ops.ReLU()

        def construct(self, x, y):
            return ((ops.matmul(self.relu(self.matmul1(x, self.w1)), self.w2) - y) ** 2).mean()

    return StrategyNet()


def strategy_batch():
    rng = np.random.default_rng(4)
    return (rng.standard_normal((8, 16)).astype(np.float32),
            rng.standard_normal((8, 4)).astype(np.float32))


def train_strategy_net(rank: int, size: int) -> dict:
    """(4-process job) ``STRATEGY_STEPS`` SGD steps of ``strategy_net()``, a Cell whose
    MatMul carries a 2 x 2 ``Primitive.shard`` strategy, each process passing its rows;
    the losses and the strategy of the first MatMul in the plan."""
    ap = fs.AutoParallel(strategy_net(), fs.optim.sgd(0.1))
    state = ap.init()
    x, y = strategy_batch()
    b = x.shape[0] // size
    xs, ys = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
    losses = []
    for _ in range(STRATEGY_STEPS):
        state, loss = ap(state, xs, ys)
        losses.append(float(n(loss)))
    eqs = ap.partitioned(state, xs, ys).strategies()["equations"]
    return {"losses": losses,
            "matmul": next(e["in_strategy"] for e in eqs if e["primitive"] == "matmul")}


def data_parallel(rank: int, size: int) -> dict:
    """50 Adam steps, each process passing rows [r * b, (r + 1) * b) of the batch."""
    ap = example.make()
    state = ap.init(example.init_params())
    b = example.BATCH // size
    losses = []
    for x, y in example.batches(DP_STEPS):
        state, loss = ap(state, x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
        losses.append(float(n(loss)))
    return {"losses": losses, "params": {k: n(v).tolist() for k, v in state.params.items()},
            "step": int(n(state.step))}


def shard_data_parallel(rank: int, size: int) -> dict:
    """fs.shard with per-process slices: unannotated arguments are this process's rows,
    unannotated outputs come back as this process's rows; an annotated (whole)
    argument is the global value."""
    b = 3
    x_all = np.arange(size * b * 4, dtype=np.float32).reshape(size * b, 4)
    pos = np.arange(size * b, dtype=np.float32) * 100
    w = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)
    mine = x_all[rank * b:(rank + 1) * b]

    def f(x, p, w):
        y = x @ w
        return y + p[:, None], y.sum()

    g = fs.shard(f, in_strategy=(None, (1,), (1, 1)), out_strategy=None,
                 dataset_strategy="data_parallel")
    out = {}
    for name, fn in (("eager", g), ("jit", fs.jit(g))):
        y, total = fn(mine, pos, w)
        want = x_all @ w
        out[name] = {
            "rows": bool(np.allclose(n(y), (want + pos[:, None])[rank * b:(rank + 1) * b])),
            "shape": list(n(y).shape),
            "total": bool(np.isclose(float(n(total)), float(want.sum()), rtol=1e-6)),
        }
    return out


SEED_STEPS = 3
SEED_ROWS = 16


def seed_cell():
    """Seed 001's loss around a small MLP (nn.CrossEntropyLoss captures constants
    when traced), with fixed parameters."""
    import mindspore as ms
    from mindspore import nn

    net = nn.SequentialCell([nn.Dense(64, 16), nn.ReLU(), nn.Dense(16, 10)])
    rng = np.random.default_rng(7)
    for _, prm in sorted(net.parameters_and_names()):
        prm.set_data(ms.Tensor((rng.standard_normal(prm.shape) / 8).astype(np.float32)))
    return nn.WithLossCell(net, nn.CrossEntropyLoss())


def seed_batch():
    rng = np.random.default_rng(8)
    return (rng.standard_normal((SEED_ROWS, 64)).astype(np.float32),
            rng.integers(0, 10, SEED_ROWS).astype(np.int32))


def seed_train(ap, rows):
    """SEED_STEPS SGD steps of ``seed_cell`` on ``rows`` of ``seed_batch``."""
    x, y = seed_batch()
    state = ap.init()
    losses = []
    for _ in range(SEED_STEPS):
        state, loss = ap(state, x[rows], y[rows])
        losses.append(float(n(loss)))
    return losses, {k: n(v).tolist() for k, v in ap.gather_params(state).items()}


def seed_context(rank: int, size: int) -> dict:
    """MindSpore's context sets the dataset strategy, as seed 000 recommends: fs.shard
    then takes and returns each process's rows; and seed 001's loss trains under
    fs.AutoParallel with each process passing its own rows."""
    import mindspore as ms

    ms.set_auto_parallel_context(dataset_strategy="data_parallel")
    try:
        b = 3
        x_all = np.arange(size * b * 4, dtype=np.float32).reshape(size * b, 4)
        w = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)
        y = fs.shard(lambda x, w: x @ w, in_strategy=(None, (1, 1)))(
            x_all[rank * b:(rank + 1) * b], w)
        rows = bool(np.allclose(n(y), (x_all @ w)[rank * b:(rank + 1) * b]))
        per = SEED_ROWS // size
        ap = fs.AutoParallel(seed_cell(), fs.optim.sgd(0.1))
        losses, params = seed_train(ap, slice(rank * per, (rank + 1) * per))
        return {"shard_rows": rows, "shard_shape": list(n(y).shape), "losses": losses,
                "params": params}
    finally:
        ms.reset_auto_parallel_context()


class CountedReads:
    """Counts the bytes fs.checkpoint.load reads (every read goes through
    ``checkpoint._read``)."""

    def __enter__(self):
        self.bytes, self._read = 0, ckpt._read

        def read(fd, offset, nbytes):
            data = self._read(fd, offset, nbytes)
            self.bytes += len(data)
            return data

        ckpt._read = read
        return self

    def __exit__(self, *exc):
        ckpt._read = self._read


def _header_bytes(path: str) -> int:
    with open(path, "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def _expected_reads(d: str, like) -> tuple[int, int]:
    """``(bytes this process must read, bytes of the whole checkpoint)`` loading ``d``
    into ``like``: the saved blocks overlapping its block of each ShardedArray leaf,
    every block of a whole leaf, and the header of each file holding one of those."""
    with open(os.path.join(d, "index.json")) as fh:
        index = json.load(fh)
    entries = {e["path"]: e for e in index["leaves"]}
    paths, leaves, _ = fs.tree.flatten_with_path(like)
    need, files = 0, set()
    for p, x in zip(paths, leaves):
        e = entries[fs.tree.keystr(p)]
        size = np.dtype(e["dtype"]).itemsize
        for b in e["blocks"]:
            if isinstance(x, fs.ShardedArray) and any(
                    max(s, ws) >= min(t, wt) for s, t, (ws, wt)
                    in zip(b["start"], b["stop"], x.bounds)):
                continue
            need += size * int(np.prod([t - s for s, t in zip(b["start"], b["stop"])]))
            files.add(b["file"])
    need += sum(_header_bytes(os.path.join(d, f)) for f in files)
    return need, sum(info["bytes"] for info in index["files"].values())


def _boundary_gathers(ap) -> int:
    """AllGathers of split values at the boundary of the compiled steps taking
    ShardedArrays (the state gathered onto every process would be one per leaf)."""
    from fshard.primitives.collectives import shard_out_p

    count = 0
    for _, jitted in ap._steps.values():
        for lowered in jitted._cache.values():
            if lowered.local is None:
                continue
            program = lowered.local[0]
            for eq in program.equations:
                count += eq.prim is shard_out_p
                if eq.prim.name == "shard_call":
                    body, _ = eq.params["plan"].virtual_program(
                        frozenset(eq.params["local_in"]), frozenset(eq.params["local_out"]))
                    count += sum(e.prim is shard_out_p and any(e.params["dims"])
                                 for e in body.equations)
    return count


def shard_process_local(rank: int, size: int) -> dict:
    """fs.shard(..., gather_outputs=False): split outputs come back as fs.ShardedArrays
    (this process's block); a sharded function taking one with the same layout uses
    the block, another layout or an operation outside a shard gathers it first; eager
    operations and NumPy conversion refuse it."""
    x = np.arange(size * 2 * 3, dtype=np.float32).reshape(size * 2, 3)
    w = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
    rows = (size, 1)
    make = fs.shard(lambda x, w: x @ w, in_strategy=(rows, None), out_strategy=(rows,),
                    gather_outputs=False)
    double = fs.shard(lambda y: y * 2.0, in_strategy=(rows,), out_strategy=(rows,))
    by_cols = fs.shard(lambda y: y + 1.0, in_strategy=((1, 2),), out_strategy=((1, 2),))
    want = x @ w
    out = {}
    # MindSpore's CPU matmul and NumPy's round differently on some CPUs (last bit):
    # values are compared to a float32 tolerance. Every check runs on every process,
    # whatever an earlier one gave: each is a collective, and a process skipping one
    # would leave the others waiting.
    tol = dict(rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))
    for how, wrap in (("eager", lambda f: f), ("jit", fs.jit)):
        y = wrap(make)(x, w)
        ok = [isinstance(y, fs.ShardedArray) and fs.typeof(y) == fs.ArrayType(
            want.shape, fs.dtypes.float32)]
        ok.append(np.allclose(n(y.block), want[rank * 2:(rank + 1) * 2], **tol))
        ok.append(np.allclose(n(wrap(double)(y)), 2 * want, **tol))
        ok.append(np.allclose(n(wrap(by_cols)(y)), want + 1, **tol))  # gathered, then cut
        ok.append(np.allclose(n(fs.jit(lambda v: v - 1.0)(y)), want - 1, **tol))  # gathered
        # the gathered blocks are the blocks, bit for bit
        ok.append(np.array_equal(n(y.gather())[rank * 2:(rank + 1) * 2], n(y.block)))
        ok.append(np.allclose(n(y.gather()), want, **tol))
        out[how] = bool(all(ok))
    errors = []
    for attempt in (lambda: np.asarray(y), lambda: y.asnumpy(), lambda: fs.ops.relu(y),
                    lambda: y + 1, lambda: y.sum()):
        try:
            attempt()
            errors.append("no error")
        except fs.ShardingError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


def train_2x2_and_save(out: str) -> dict:
    """10 steps of the 2 x 2 Adam step with ZeRO level1, a checkpoint, loaded back
    (counting the bytes read), 10 more steps from the loaded state."""
    ap = example.make(mp=2, zero="level1")
    state = ap.init(example.init_params())
    batches = list(example.batches(2 * RESUME_STEPS))
    losses = []
    for x, y in batches[:RESUME_STEPS]:
        state, loss = ap(state, x, y)
        losses.append(float(n(loss)))
    local = [fs.tree.keystr(p) for p, v in zip(*fs.tree.flatten_with_path(state)[:2])
             if isinstance(v, fs.ShardedArray)]
    try:
        n(state.params["w1"])
        refused = ""
    except fs.ShardingError as e:
        refused = str(e)
    layouts = ap.state_strategies(state, *batches[0])
    d = ckpt.save(os.path.join(out, "ckpt4"), state, step=RESUME_STEPS, layouts=layouts)
    whole = ap.gather(state)  # a collective: every process
    if fs.distributed.rank() == 0:
        np.savez(os.path.join(out, "saved4.npz"),
                 **{f"leaf{i}": n(v) for i, v in enumerate(fs.tree.leaves(whole))})
    with CountedReads() as reads:
        back = ckpt.load(d, state)
    need, total = _expected_reads(d, state)
    same = all(
        type(a) is type(b) and (n(a.block if isinstance(a, fs.ShardedArray) else a).tobytes()
                                == n(b.block if isinstance(b, fs.ShardedArray) else b).tobytes())
        and (not isinstance(a, fs.ShardedArray) or a.bounds == b.bounds)
        for a, b in zip(fs.tree.leaves(state), fs.tree.leaves(back)))
    state = back
    for x, y in batches[RESUME_STEPS:]:
        state, loss = ap(state, x, y)
        losses.append(float(n(loss)))
    return {"losses": losses, "dir": d, "local_leaves": local, "refused": refused,
            "boundary_gathers": _boundary_gathers(ap),
            "read": {"bytes": reads.bytes, "own_blocks": need, "checkpoint": total},
            "loaded_blocks_identical": same,
            "param_layouts": {k: list(v) for k, v in layouts.params.items()}}


def resume_with_zero3(out: str, rank: int, size: int) -> dict:
    """The 4-process checkpoint onto 2 processes: data parallel (own slices), ZeRO
    level3; the next 10 steps."""
    ap = example.make(zero="level3")
    b = example.BATCH // size
    batches = list(example.batches(2 * RESUME_STEPS))[RESUME_STEPS:]
    like = ap.init(example.init_params())
    mine = [v[rank * b:(rank + 1) * b] for v in batches[0]]
    with CountedReads() as reads:
        state = ckpt.load(os.path.join(out, "ckpt4"), like,
                          layouts=ap.state_strategies(like, *mine))
    latest = ckpt.latest(os.path.join(out, "ckpt4"))
    need, total = _expected_reads(latest, state)
    local = sum(isinstance(v, fs.ShardedArray) for v in fs.tree.leaves(state))
    losses = []
    for x, y in batches:
        state, loss = ap(state, x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
        losses.append(float(n(loss)))
    return {"losses": losses, "step": int(n(state.step)), "loaded_local_leaves": local,
            "read": {"bytes": reads.bytes, "own_blocks": need, "checkpoint": total},
            "boundary_gathers": _boundary_gathers(ap), "dir": latest}


def hot_path(rank: int, size: int) -> dict:
    """ZeRO level3 Adam steps on one batch, each process passing its rows, through the
    step's hot path: 4 steps from the whole state of ``ap.init`` (then the blocks the
    steps return); the first step again from the whole state (another program than the
    blocks'); an uneven batch (process 0 N rows short) and one more even step. The
    losses and the final parameters."""
    ap = example.make(zero="level3")
    b = example.BATCH // size
    x, y = next(example.batches(1))
    mine = slice(rank * b, (rank + 1) * b)
    whole = ap.init(example.init_params())
    first_calls = []  # the calls that placed, planned or looked up their step
    first_call = ap._first_call
    ap._first_call = lambda *a, **k: first_calls.append(1) or first_call(*a, **k)
    state, losses = whole, []
    for _ in range(4):
        state, loss = ap(state, x[mine], y[mine])
        losses.append(float(n(loss)))
    _, loss = ap(whole, x[mine], y[mine])
    losses.append(float(n(loss)))
    short = slice(mine.start, mine.stop - size) if rank == 0 else mine
    for rows in (short, mine):
        state, loss = ap(state, x[rows], y[rows])
        losses.append(float(n(loss)))
    return {"losses": losses, "first_calls": len(first_calls),
            "params": {k: n(v).tolist() for k, v in fs.gather_sharded(state.params).items()}}


def main(out: str) -> None:
    fs.distributed.init()
    rank, size = fs.distributed.rank(), fs.distributed.world_size()
    report = {"data_parallel": data_parallel(rank, size),
              "shard": shard_data_parallel(rank, size),
              "process_local": shard_process_local(rank, size),
              "seed_context": seed_context(rank, size),
              "hot_path": hot_path(rank, size)}
    if size == 4:
        report["strategy_net"] = train_strategy_net(rank, size)
        report["resume"] = train_2x2_and_save(out)
    else:
        report["resume"] = resume_with_zero3(out, rank, size)
    with open(os.path.join(out, f"training{size}_rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    if size == 2:
        import checkpoint_checks

        checkpoint_checks.main(out)


if __name__ == "__main__":
    main(sys.argv[1])
