"""Pipeline-parallel training in a real multi-process job.

``python -m fshard.launch -n N tests/distributed/pipeline_checks.py OUT_DIR`` (N = 2 or
4). Every rank trains the pipelined models of ``CONFIGS[N]`` (examples/train_pipeline.py)
for ``STEPS`` steps on the job's world, and writes ``OUT_DIR/rank<k>.json``: per
configuration the losses, its stage, the parameters it owns after the last step (the
only ones its state keeps), the parameters and optimizer state gathered on every rank,
and the lowered source of one transfer program; with tensor-parallel stages ("mp")
also what each leaf it keeps is (its own stage's split leaves are its blocks), the
bytes it keeps, ``memory_report`` and a checkpoint saved from the split state
(``split_checkpoint``); tests/distributed/test_pipeline_multiprocess.py compares them
with one process's unpipelined training. All configurations share one launch (~15 s
of start-up).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

STEPS = 20

# (name, model, stages, micro_batches, scheduler, interleave, output_broadcast,
#  dataset_strategy[, extras]): with "data_parallel" each process passes its
#  data-parallel slice of every batch (the processes of dp index j: block j of dp), with
#  "full_batch" the whole batch; extras: "mp" splits the stages' weights over their
#  devices (examples/train_pipeline.py's model_parallel_plan), "opt" names the optimizer
#  (default "momentum"; "clipped" clips by the global norm of every stage's gradients)
CONFIGS = {
    2: [("mlp_1f1b", "mlp", 2, 4, "1f1b", False, False, "data_parallel"),
        ("mlp_gpipe_broadcast_clipped", "mlp", 2, 2, "gpipe", False, True, "data_parallel",
         {"opt": "clipped"}),
        ("mlp_1f1b_interleave", "mlp", 2, 4, "1f1b", True, True, "data_parallel"),
        ("transformer_1f1b", "transformer", 2, 2, "1f1b", False, False, "data_parallel")],
    4: [("mlp_2x2_1f1b", "mlp", 2, 4, "1f1b", False, True, "data_parallel"),
        ("mlp_2x2_gpipe_full_batch", "mlp", 2, 2, "gpipe", False, False, "full_batch"),
        ("mlp_2x2_gpipe_clipped", "mlp", 2, 2, "gpipe", False, False, "data_parallel",
         {"opt": "clipped"}),
        ("mlp_4_1f1b", "mlp", 4, 4, "1f1b", False, True, "data_parallel"),
        ("mlp_4_gpipe_interleave", "mlp", 4, 4, "gpipe", True, True, "data_parallel"),
        ("transformer_2x2_1f1b", "transformer", 2, 2, "1f1b", False, True,
         "data_parallel"),
        ("mlp_2x2_model_parallel", "mlp", 2, 4, "1f1b", False, True, "data_parallel",
         {"mp": True}),
        ("mlp_2x2_model_parallel_full_batch", "mlp", 2, 2, "gpipe", True, False,
         "full_batch", {"mp": True, "opt": "clipped"})],
}


def main(out_dir: str) -> None:
    import fshard as fs
    import train_pipeline as ex

    fs.distributed.init()
    rank, world = fs.distributed.rank(), fs.distributed.world_size()
    results: dict = {"rank": rank, "world": world, "configs": {}}
    for name, model, stages, micro, sched, inter, bcast, dataset, *extras in CONFIGS[world]:
        extras = extras[0] if extras else {}
        mp = extras.get("mp", False)
        dp = world // stages
        chunks = stages * (2 if inter else 1)
        plan = ex.model_parallel_plan(model, chunks, dp) if mp else None
        losses, state, ap = ex.train(STEPS, model, stages, micro, sched, inter, bcast,
                                     opt=extras.get("opt", "momentum"), dataset=dataset,
                                     part=(rank % dp, dp) if dataset == "data_parallel"
                                     else None, plan=plan)
        runner = ap._pipeline
        step = next(iter(runner._steps.values()))
        owned = sorted({k for c in range(step.plan.n_chunks) if c % stages == step.rank //
                        step.dp for k in _names(state.params, step.plan.chunk_params[c])})
        gathered = ap.gather_params(state)
        whole = ap.gather(state)  # (every stage's leaves, the optimizer's included)
        entry = {
            "stage": rank // (world // stages),
            "losses": [None if np.isnan(v) else v for v in losses],
            # (a split leaf: this process's block of it, and where it lies)
            "owned": {k: _kept_value(state.params[k]) for k in owned},
            # each process keeps its own stage's parameters only
            "kept": sorted(k for k, v in state.params.items()
                           if not isinstance(v, fs.RemoteArray)),
            "params": {k: np.asarray(v.asnumpy()).tolist() for k, v in whole.params.items()},
            "opt_state": [np.asarray(x.asnumpy(), np.float64).ravel().tolist()
                          for x in fs.tree.leaves(whole.opt_state)],
            "gathered": {k: np.asarray(v.asnumpy()).tolist() for k, v in gathered.items()},
            "rounds": len(step.schedule.timeline().rounds()),
            "leaf_kinds": {"params": {k: type(v).__name__ for k, v in state.params.items()},
                           "opt_state": [type(x).__name__
                                         for x in fs.tree.leaves(state.opt_state)]}
            if mp else None,
            "state_bytes": {"params": _kept_bytes(state.params),
                            "opt_state": _kept_bytes(state.opt_state)} if mp else None,
            "report": step.memory_report(state) if mp else None,
            "refused": _refused(fs, state) if mp else None,
            "split_checkpoint": _split_checkpoint(ap, state, whole, out_dir, name, rank)
            if mp else None,
            "stage_collectives": _stage_collectives(step, state) if mp else None,
            "transfer_programs": {f"{k[0]}:{k[1]}:{k[2]}": fn.lower(*_transfer_args(step, k))
                                  .as_text() for k, fn in step._transfers.items()},
        }
        results["configs"][name] = entry
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


def _kept_value(x) -> dict:
    """What this process keeps of a parameter: its value, or (an fs.ShardedArray) its
    block and the block's bounds."""
    import fshard as fs

    if isinstance(x, fs.ShardedArray):
        return {"block": np.asarray(x.block.asnumpy()).tolist(),
                "bounds": [list(b) for b in x.bounds]}
    return {"value": np.asarray(x.asnumpy()).tolist()}


def _refused(fs, state) -> dict:
    """The messages of reading a stage's block alone (no collective runs: every process
    refuses alike)."""
    block = next(x for x in fs.tree.leaves(state.params) if isinstance(x, fs.ShardedArray))
    out = {}
    for what, call in (("asnumpy", block.asnumpy), ("gather", block.gather),
                       ("gather_sharded", lambda: fs.gather_sharded(
                           {"x": block, "whole": np.zeros(2, np.float32)}))):
        try:
            call()
            out[what] = None
        except fs.FshardError as e:
            out[what] = f"{type(e).__name__}: {e}"
    return out


def _kept_bytes(t) -> int:
    """The bytes of ``t``'s leaves this process holds (a block's, none of a
    RemoteArray's)."""
    import fshard as fs

    total = 0
    for x in fs.tree.leaves(t):
        if isinstance(x, fs.RemoteArray):
            continue
        a = x.block if isinstance(x, fs.ShardedArray) else x
        total += int(np.asarray(a.asnumpy()).nbytes)
    return total


def _split_checkpoint(ap, state, whole, out_dir, name, rank) -> dict:
    """The split state saved as it is (each tensor-parallel stage's blocks written by
    its processes) and ap.gather(state) saved beside it; the split one loaded back into
    the split state (each process reading its blocks) and one step from each."""
    import fshard as fs
    import train_pipeline as ex

    root = os.path.join(out_dir, f"checkpoints_{name}")
    split_dir = fs.checkpoint.save(os.path.join(root, "split"), state)
    fs.checkpoint.save(os.path.join(root, "gathered"), whole)
    back = fs.checkpoint.load(split_dir, like=state)
    same = []
    for a, b in zip(fs.tree.leaves(back), fs.tree.leaves(state)):
        if isinstance(b, fs.ShardedArray):
            same.append(isinstance(a, fs.ShardedArray) and a.bounds == b.bounds and
                        a.block.asnumpy().tobytes() == b.block.asnumpy().tobytes())
        elif isinstance(b, fs.RemoteArray):
            same.append(isinstance(a, fs.RemoteArray))
        else:
            same.append(a.asnumpy().tobytes() == b.asnumpy().tobytes())
    x, y = next(iter(ex.batches(1, ex.BATCH)))
    if ap._dataset == "data_parallel":  # (this process's slice)
        dp = ap.n_devices // ap._pipeline.cfg.stages
        b, j = len(x) // dp, rank % dp
        x, y = x[j * b:(j + 1) * b], y[j * b:(j + 1) * b]
    s1, l1 = ap(state, x, y)
    s2, l2 = ap(back, x, y)
    g1, g2 = ap.gather(s1), ap.gather(s2)
    return {"dir": split_dir, "gathered_dir": os.path.join(root, "gathered"),
            "loaded_equal": same,
            "resumed_equal": bool(float(l1.asnumpy()) == float(l2.asnumpy()) or (
                np.isnan(float(l1.asnumpy())) and np.isnan(float(l2.asnumpy())))),
            "resumed_state_equal": all(
                a.asnumpy().tobytes() == c.asnumpy().tobytes()
                for a, c in zip(fs.tree.leaves(g1), fs.tree.leaves(g2)))}


def _names(params, leaf_indices) -> list:
    from fshard import tree

    keys = [str(p[-1]) for p in tree.flatten_with_path(params)[0]]  # flat dict: its keys
    return [keys[i] for i in leaf_indices]


def _stage_collectives(step, state) -> dict:
    """The collectives of this stage's first chunk's forward program (sharded over the
    stage's devices) and the lowered text of its compiled program."""
    import fshard as fs

    plan, c = step.plan, step.rank // step.dp
    leaves = fs.tree.leaves(state.params)
    args = ([leaves[i] for i in plan.chunk_params[c]],
            [np.zeros(a.shape, fs.dtypes.to_numpy(a.dtype)) for a in plan.carry_avals(c - 1)]
            if c else [],
            [np.zeros(v.aval.shape, fs.dtypes.to_numpy(v.aval.dtype)) for v in plan.batch_vars])
    if c == plan.n_chunks - 1:
        args += (np.zeros((), np.float32),)
    fn = plan.forward_fn(c, step.sharding)
    return {"collectives": fn.fun.partitioned(*args).collectives(),
            "lowered": fn.lower(*args).as_text()}


def _transfer_args(step, key):
    """Example inputs of a compiled transfer program (what its stage sends)."""
    kind, send_b, _ = key
    if send_b is None:
        return ([],)
    return ([np.zeros(a.shape, np.float32) for a in step.plan.carry_avals(send_b)],)


if __name__ == "__main__":
    main(sys.argv[1])
