"""A pipelined job whose processes each keep and update only their own stage's state.

``python -m fshard.launch -n N tests/distributed/pipeline_state_checks.py OUT_DIR``
(N = 2: 2 stages x 1 process; N = 4: 2 stages x 2). Every rank trains the MLP of
``CONFIGS`` with 2 stages, each process passing its data-parallel slice, and writes
``OUT_DIR/rank<k>.json``: per configuration the losses, the gathered parameters and
optimizer state, which leaves it keeps, the bytes it keeps, ``memory_report`` and the
messages of the refused calls; tests/distributed/test_pipeline_state_multiprocess.py
compares them with one process's unpipelined run (``reference``) and the formula.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

# The launcher runs this file as a script: the pipeline tests' shared MLP module
# (tests/pipeline_mlp.py) is one folder up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 4
BATCH = 16


def data():
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(0, 0.1, (32, 64)).astype(np.float32),
              "b1": np.zeros(64, np.float32),
              "w2": rng.normal(0, 0.1, (64, 32)).astype(np.float32),
              "b2": np.zeros(32, np.float32)}
    batches = [(rng.normal(size=(BATCH, 32)).astype(np.float32),
                rng.integers(0, 32, BATCH)) for _ in range(STEPS + 1)]
    return params, batches


def loss(p, x, y):
    import fshard as fs

    h = fs.ops.relu(x @ p["w1"] + p["b1"])
    h = fs.pipeline_split(h)
    return fs.ops.softmax_cross_entropy(h @ p["w2"] + p["b2"], y)


def nan_loss(p, x, y):
    """sqrt(b2 - b2) is 0, its gradient 0 / 0: a NaN gradient in stage 1 only."""
    import fshard as fs

    return loss(p, x, y) + fs.ops.sqrt(p["b2"] - p["b2"]).mean()


def optimizer(name: str):
    import fshard as fs

    if name == "adam":
        return fs.optim.adam(1e-2)
    if name == "clipped":  # a clip that clips: the norm of every stage's gradients
        return fs.optim.chain(fs.optim.clip_by_global_norm(0.05), fs.optim.adam(1e-2))
    if name == "loss_scaled":
        return fs.amp.loss_scaled(fs.optim.adam(1e-2), fs.amp.DynamicLossScale(2.0 ** 4))
    if name == "summarising":  # a state scalar no stage owns, summed over every stage
        def init(params):
            return (np.zeros((), np.float32),)

        def update(grads, state, params=None):
            sq = sum(fs.ops.reduce_sum(g * g) for g in fs.tree.leaves(grads))
            return {k: g * -0.1 for k, g in grads.items()}, (state[0] * 0.5 + sq,)

        return fs.optim.Optimizer(init, update)
    if name == "mixing":  # stage 1's update reads stage 0's gradient: not split
        from pipeline_mlp import mixing_optimizer

        return mixing_optimizer()
    raise ValueError(name)


# (name, optimizer, loss, micro_batches, scheduler, output_broadcast); every process
# passes its data-parallel slice of each batch
CONFIGS = [("adam", "adam", "loss", 4, "1f1b", False),
           ("clipped", "clipped", "loss", 2, "gpipe", True),
           ("loss_scaled_nan", "loss_scaled", "nan_loss", 2, "1f1b", True),
           ("summarising", "summarising", "loss", 2, "1f1b", True),
           ("mixing", "mixing", "loss", 2, "1f1b", True)]
LOSSES = {"loss": loss, "nan_loss": nan_loss}


def _bytes(x) -> int:
    import fshard as fs

    if isinstance(x, fs.RemoteArray):
        return 0
    a = fs.typeof(x)
    return int(a.size * np.dtype(fs.dtypes.to_numpy(a.dtype)).itemsize)


def _leaves(t) -> list:
    import fshard as fs

    return [np.asarray(x.asnumpy(), np.float64).ravel().tolist() for x in fs.tree.leaves(t)]


def _slice(batch, rank, dp):
    x, y = batch
    b = len(x) // dp
    j = rank % dp
    return x[j * b:(j + 1) * b], y[j * b:(j + 1) * b]


def train(name, opt, loss_name, micro, sched, bcast, rank, world):
    import fshard as fs

    dp = world // 2
    params, batches = data()
    ap = fs.AutoParallel(LOSSES[loss_name], optimizer(opt))
    ap.pipeline(stages=2, micro_batches=micro, scheduler=sched, output_broadcast=bcast)
    state = ap.init(params)
    losses = []
    for batch in batches[:STEPS]:
        state, l = ap(state, *_slice(batch, rank, dp))
        v = float(l.asnumpy())
        losses.append(None if np.isnan(v) else v)
    return ap, state, losses, batches


def main(out_dir: str) -> None:
    import fshard as fs

    fs.distributed.init()
    rank, world = fs.distributed.rank(), fs.distributed.world_size()
    dp = world // 2
    results: dict = {"rank": rank, "world": world, "configs": {}, "errors": {}}
    for name, opt, loss_name, micro, sched, bcast in CONFIGS:
        ap, state, losses, batches = train(name, opt, loss_name, micro, sched,
                                                  bcast, rank, world)
        batch = _slice(batches[0], rank, dp)
        report = ap.memory_report(state, *batch)
        gathered = ap.gather(state)
        results["configs"][name] = {
            "losses": losses,
            "params": {k: np.asarray(v.asnumpy()).ravel().tolist()
                       for k, v in ap.gather_params(state).items()},
            "gathered_params": {k: np.asarray(v.asnumpy()).ravel().tolist()
                                for k, v in gathered.params.items()},
            "opt_state": _leaves(gathered.opt_state),
            "step": int(state.step.asnumpy()),
            "kept": {k: not isinstance(v, fs.RemoteArray) for k, v in state.params.items()},
            "remote_opt": [isinstance(x, fs.RemoteArray)
                           for x in fs.tree.leaves(state.opt_state)],
            "state_bytes": {"params": sum(map(_bytes, fs.tree.leaves(state.params))),
                            "opt_state": sum(map(_bytes, fs.tree.leaves(state.opt_state)))},
            "report": report,
        }
        if name == "adam":
            results["errors"] = _misuse(ap, state, batches, rank, dp, out_dir)
            results["split_checkpoint"] = _split_checkpoint(ap, state, batches, rank, dp,
                                                            out_dir)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


def _misuse(ap, state, batches, rank, dp, out_dir) -> dict:
    """What each refused call says, and a checkpoint of the gathered state loaded into
    this process's split state and into the whole one."""
    import fshard as fs

    out: dict = {}
    mine = "w1" if rank // dp == 0 else "w2"
    other = "w2" if mine == "w1" else "w1"
    for what, call in (("asnumpy", lambda: state.params[other].asnumpy()),
                       ("eager", lambda: state.params[other] + 1),
                       ("gather_sharded", lambda: fs.gather_sharded(state.params)),
                       ("fresh_ap", lambda: _fresh(state, batches, rank, dp)),
                       ("own_remote", lambda: ap(_without_own(state, mine, rank, dp),
                                                 *_slice(batches[0], rank, dp)))):
        try:
            call()
            out[what] = None
        except fs.FshardError as e:
            out[what] = f"{type(e).__name__}: {e}"
    out["repr"] = repr(state.params[other])
    # a checkpoint: the gathered state, written by process 0 (whole leaves)
    root = os.path.join(out_dir, "ckpt")
    fs.checkpoint.save(root, ap.gather(state), step=STEPS)
    split = fs.checkpoint.load(root, like=state)
    out["load_split_kept"] = {k: not isinstance(v, fs.RemoteArray)
                              for k, v in split.params.items()}
    out["load_split_equal"] = bool(np.array_equal(split.params[mine].asnumpy(),
                                                  state.params[mine].asnumpy()))
    params, _ = data()
    whole = fs.checkpoint.load(root, like=ap.init(params))
    gathered = ap.gather_params(state)
    out["load_whole_equal"] = all(np.array_equal(whole.params[k].asnumpy(),
                                                 gathered[k].asnumpy()) for k in params)
    # one more step from the loaded split state, from the loaded whole one and from the
    # state itself: the same loss and parameters
    nxt = _slice(batches[STEPS], rank, dp)
    s1, l1 = ap(state, *nxt)
    s2, l2 = ap(split, *nxt)
    s3, l3 = ap(whole, *nxt)
    out["resume_losses"] = [float(v.asnumpy()) for v in (l1, l2, l3)]
    # a batch of another shape (half the rows) on the split state: the combination of
    # the micro-batch losses found at the first step holds; the same as from the whole
    half = [v[:len(v) // 2] for v in nxt]
    s4, l4 = ap(s1, *half)
    s5, l5 = ap(ap.gather(s1), *half)
    out["half_losses"] = [float(v.asnumpy()) for v in (l4, l5)]
    g4, g5 = ap.gather_params(s4), ap.gather_params(s5)
    out["half_equal"] = all(np.array_equal(g4[k].asnumpy(), g5[k].asnumpy()) for k in params)
    out["half_kept"] = {k: not isinstance(v, fs.RemoteArray) for k, v in s4.params.items()}
    g1, g2, g3 = (ap.gather_params(s) for s in (s1, s2, s3))
    out["resume_equal"] = all(np.array_equal(g1[k].asnumpy(), g[k].asnumpy())
                              for g in (g2, g3) for k in params)
    return out


def _split_checkpoint(ap, state, batches, rank, dp, out_dir) -> dict:
    """The split state saved as it is (each process writes its own stage's leaves; the
    calls that would gather other stages' leaves refuse to run meanwhile), loaded back
    into it (recording the blocks each process reads) and into a fresh AutoParallel's
    whole state; two more steps from each, and from the state itself; the refused
    saves' messages; the time of the save and of gather-then-save."""
    import time

    import fshard as fs
    from fshard.training import checkpoint as ckpt
    from fshard.training.parallel.pipeline import PipelinedStep, PipelineRunner

    out: dict = {}
    mine = "w1" if rank // dp == 0 else "w2"

    def refuse(*args, **kwargs):
        raise AssertionError("a gather ran during fs.checkpoint.save")

    patched = [(cls, name, getattr(cls, name)) for cls, name in (
        (PipelinedStep, "gather"), (PipelineRunner, "gather"),
        (PipelineRunner, "gather_params"), (fs.ShardedArray, "gather"))]
    for cls, name, _ in patched:
        setattr(cls, name, refuse)
    try:
        t0 = time.perf_counter()
        d = fs.checkpoint.save(os.path.join(out_dir, "split"), state, step=STEPS)
        out["save_s"] = time.perf_counter() - t0
    finally:
        for cls, name, f in patched:
            setattr(cls, name, f)
    out["dir"] = d
    # The same split state saved in the background while a step runs on it: the step
    # returns a new state, the handle's files hold the values of its call.
    handle = fs.checkpoint.save(os.path.join(out_dir, "split_async"), state, step=STEPS,
                                wait=False)
    ap(state, *_slice(batches[STEPS], rank, dp))
    out["async_dir"] = handle.wait(timeout=120)
    t0 = time.perf_counter()
    fs.checkpoint.save(os.path.join(out_dir, "gathered"), ap.gather(state), step=STEPS)
    out["gather_save_s"] = time.perf_counter() - t0

    def load_recording(like):
        reads = []
        block = ckpt._BlockReader.block

        def recorded(self, b, leaf, dtype):
            reads.append([b["file"], b["key"], leaf])
            return block(self, b, leaf, dtype)

        ckpt._BlockReader.block = recorded
        try:
            return fs.checkpoint.load(d, like=like), reads
        finally:
            ckpt._BlockReader.block = block

    back, out["split_reads"] = load_recording(state)
    out["split_kept"] = [not isinstance(x, fs.RemoteArray) for x in fs.tree.leaves(back)]
    out["state_kept"] = [not isinstance(x, fs.RemoteArray) for x in fs.tree.leaves(state)]
    out["split_equal"] = all(
        (a is b) if isinstance(b, fs.RemoteArray) else
        np.asarray(a.asnumpy()).tobytes() == np.asarray(b.asnumpy()).tobytes()
        for a, b in zip(fs.tree.leaves(back), fs.tree.leaves(state)))
    # Resuming: two more steps from the loaded split state, from a fresh AutoParallel's
    # whole state loaded from the same checkpoint, and from the state itself.
    nxt, after = _slice(batches[STEPS], rank, dp), _slice(batches[0], rank, dp)
    params, _ = data()
    fresh = fs.AutoParallel(loss, optimizer("adam"))
    fresh.pipeline(stages=2, micro_batches=4, scheduler="1f1b", output_broadcast=False)
    whole, out["whole_reads"] = load_recording(fresh.init(params))
    runs = []
    for step, s in ((ap, state), (ap, back), (fresh, whole)):
        s, l1 = step(s, *nxt)
        s, l2 = step(s, *after)
        runs.append((step.gather(s), [float(l.asnumpy()) for l in (l1, l2)]))
    out["resume_losses"] = [[None if np.isnan(v) else v for v in ls] for _, ls in runs]
    out["resume_equal"] = all(
        np.asarray(a.asnumpy()).tobytes() == np.asarray(b.asnumpy()).tobytes()
        for g, _ in runs[1:] for a, b in zip(fs.tree.leaves(g), fs.tree.leaves(runs[0][0])))
    # refused: a state no process holds a leaf of, processes saving different states,
    # layouts for a stage's leaf
    split_w1 = state._replace(params={k: (2, 1) if k == "w1" else None
                                      for k in state.params}, opt_state=None, step=None)
    for what, call in (
            ("no_holder", lambda: fs.checkpoint.save(
                os.path.join(out_dir, "refused"), _without_own(state, mine, rank, dp))),
            ("mismatch", lambda: fs.checkpoint.save(
                os.path.join(out_dir, "mismatch"),
                {"x": np.zeros(4 if rank == 0 else 8, np.float32)})),
            ("layouts", lambda: fs.checkpoint.save(
                os.path.join(out_dir, "layouts"), state, layouts=split_w1))):
        try:
            call()
            out[what] = None
        except fs.FshardError as e:
            out[what] = f"{type(e).__name__}: {e}"
    # the refused checkpoint saved again (its directory holds the refused attempt's files)
    out["retry"] = fs.checkpoint.save(os.path.join(out_dir, "refused"), state)
    return out


def _without_own(state, mine, rank, dp):
    """``state`` with this process's own weight ``mine`` as an fs.RemoteArray (as if
    another process's state), on every process alike."""
    import fshard as fs

    s = rank // dp
    x = state.params[mine]
    lost = fs.RemoteArray(x.shape, fs.typeof(x).dtype, s, range(s * dp, (s + 1) * dp), rank)
    return state._replace(params={**state.params, mine: lost})


def _fresh(state, batches, rank, dp):
    """A new AutoParallel's first step on a split state: it cannot learn how the
    micro-batch losses combine."""
    import fshard as fs

    ap = fs.AutoParallel(loss, fs.optim.adam(1e-2)).pipeline(stages=2, micro_batches=4)
    return ap(state, *_slice(batches[0], rank, dp))


if __name__ == "__main__":
    main(sys.argv[1])
