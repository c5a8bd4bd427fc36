"""Pipeline parallelism in real 2- and 4-process jobs (pp x dp = 2 x 1, 2 x 2, 4 x 1):
every configuration of tests/distributed/pipeline_checks.py (each process passing its
data-parallel slice of the batch, or with "full_batch" the whole batch) trains to the
losses and parameters of one process's unpipelined run on the whole batch, and its
stage transfers are collectives in each process's compiled program. With
tensor-parallel stages (pp=2 x tp=2) each process keeps its stage's split parameters
and optimizer state as its blocks (``fs.ShardedArray``): the bytes it keeps are its
stage's share split by the plan, ``memory_report`` says "blocks", and the split state
saves and loads back as it is."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

from fshard import launch, tree

# launched jobs: the full matrix (tests/test_launch.py has the quick run's one job)
pytestmark = pytest.mark.full

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "pipeline_checks.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

import pipeline_checks as checks  # noqa: E402
import train_pipeline as example  # noqa: E402

_COLLECTIVE = re.compile(r"\b(AllReduce|AllGather)_\d+\(")


@pytest.fixture(scope="module", params=[2, 4], ids=["2-processes", "4-processes"])
def job(request, tmp_path_factory):
    n = request.param
    out = str(tmp_path_factory.mktemp(f"pipeline{n}"))
    result = launch.run(SCRIPT, n, [out], timeout=600)
    assert result.ok, result.message + "\n" + "\n".join(
        result.output(r)[-3000:] for r in result.failed_ranks or range(n))
    ranks = []
    for r in range(n):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            ranks.append(json.load(fh))
    return n, ranks


_REFERENCES: dict = {}


def reference(model: str, chunks: int, opt: str = "momentum"):
    """One process, no pipeline, the same model: losses and final parameters."""
    key = (model, chunks, opt)
    if key not in _REFERENCES:
        losses, state, _ = example.train(checks.STEPS, model, 1, chunks=chunks, mesh=1,
                                         opt=opt)
        _REFERENCES[key] = losses, {k: v.asnumpy() for k, v in state.params.items()}
    return _REFERENCES[key]


def _close(got, want, what):
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got, want.dtype), want, rtol=1e-5,
                               atol=1e-6 * max(1.0, float(np.abs(want).max())), err_msg=what)


def test_losses_and_parameters_equal_the_unpipelined_run(job):
    n, ranks = job
    for name, model, stages, micro, sched, inter, bcast, _, *extras in checks.CONFIGS[n]:
        opt = extras[0].get("opt", "momentum") if extras else "momentum"
        ref_losses, ref_params = reference(model, stages * (2 if inter else 1), opt)
        assert ref_losses[-1] < ref_losses[0]
        owned = set()
        for r, res in enumerate(ranks):
            e = res["configs"][name]
            assert e["stage"] == r // (n // stages)
            if e["stage"] == stages - 1 or bcast:  # the last chunk is on the last stage
                _close(e["losses"], ref_losses, f"{name} rank {r} losses")
            else:  # no loss on the other stages without output_broadcast
                assert all(v is None for v in e["losses"]), (name, r)
            for k, v in e["owned"].items():
                if "block" in v:  # (a tensor-parallel stage's block of it)
                    want = ref_params[k][tuple(slice(a, b) for a, b in v["bounds"])]
                    _close(v["block"], want, f"{name} rank {r} {k} block")
                else:
                    _close(v["value"], ref_params[k], f"{name} rank {r} {k}")
                owned.add(k)
            for k, v in e["gathered"].items():
                _close(v, ref_params[k], f"{name} rank {r} gathered {k}")
            assert e["kept"] == sorted(e["owned"]), (name, r)  # its stage's alone
            for k, v in e["params"].items():  # ap.gather(state): what a save writes
                _close(v, ref_params[k], f"{name} rank {r} gathered state.params {k}")
            for a, b in zip(e["opt_state"], ranks[0]["configs"][name]["opt_state"]):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} rank {r} opt_state")
        assert owned == set(ref_params), name  # every parameter trained by some stage


def test_stage_transfers_are_collectives_in_every_process(job):
    n, ranks = job
    for name, *_ in checks.CONFIGS[n]:
        for r, res in enumerate(ranks):
            programs = res["configs"][name]["transfer_programs"]
            assert programs, (name, r)
            for key, text in programs.items():
                # the CPU emulation of a point-to-point transfer: one collective over
                # the pipeline group per round and direction
                assert len(_COLLECTIVE.findall(text)) == 1, (name, r, key, text)


def test_model_parallel_stages_communicate_inside_the_stage(job):
    """With model_parallel the stage's first chunk is one fs.shard over the stage's
    processes: its per-device program has collectives, and they are in the compiled
    program of every process."""
    n, ranks = job
    configs = [c for c in checks.CONFIGS[n] if c[8:] and c[8].get("mp")]
    assert configs or n == 2
    for name, *_ in configs:
        for r, res in enumerate(ranks):
            e = res["configs"][name]["stage_collectives"]
            assert e["collectives"], (name, r)
            assert _COLLECTIVE.findall(e["lowered"]), (name, r)


def _mp_configs(n):
    return [c for c in checks.CONFIGS[n] if c[8:] and c[8].get("mp")]


def _split_bytes(params, plan, names) -> int:
    """The bytes of the parameters ``names`` split as ``plan`` says, on one process."""
    return sum(params[k].nbytes // int(np.prod(plan.get(k, (1,)))) for k in names)


def test_tensor_parallel_stages_keep_their_state_in_blocks(job):
    """pp=2 x tp=2: each process keeps its own stage's split parameters and optimizer
    state as its blocks (fs.ShardedArray), its stage's whole ones as they are, the
    other stage's as fs.RemoteArray; it keeps its stage's share split by the plan (in
    bytes, and as memory_report says: "blocks")."""
    n, ranks = job
    configs = _mp_configs(n)
    assert configs or n == 2
    for name, model, stages, micro, sched, inter, bcast, _, extras in configs:
        opt = extras.get("opt", "momentum")
        chunks = stages * (2 if inter else 1)
        dp = n // stages
        plan = example.model_parallel_plan(model, chunks, dp)
        ap, _ = example.make(model, 1, opt=opt, mesh=1)
        params = {k: np.asarray(v) for k, v in example.MODELS[model][0](chunks).items()}
        opt_total = sum(x.asnumpy().nbytes for x in
                        tree.leaves(ap.init(example.MODELS[model][0](chunks)).opt_state))
        copies = {"momentum": 1, "clipped": 2}[opt]  # state leaves per parameter
        shared = opt_total - copies * sum(v.nbytes for v in params.values())
        stage_of = {k: int(k[len("layer"):k.index(".")]) % stages for k in params}
        own = [_split_bytes(params, plan, [k for k in params if stage_of[k] == s])
               for s in range(stages)]
        for r, res in enumerate(ranks):
            e = res["configs"][name]
            s = r // dp
            assert e["leaf_kinds"]["params"] == {
                k: ("RemoteArray" if stage_of[k] != s else
                    "ShardedArray" if k in plan else "Tensor") for k in params}, (name, r)
            kinds = e["leaf_kinds"]["opt_state"]
            assert kinds.count("ShardedArray") == copies * sum(
                1 for k in plan if stage_of[k] == s), (name, r, kinds)
            assert e["state_bytes"] == {"params": own[s],
                                        "opt_state": copies * own[s] + shared}, (name, r)
            report = e["report"]
            assert (report["update"], report["stage_state"]) == ("per_stage", "blocks")
            assert "stage_state_because" not in report
            assert [st["params"] for st in report["stages"]] == own, (name, r)
            assert [st["grads"] for st in report["stages"]] == own, (name, r)
            assert [st["optimizer_state"] for st in report["stages"]] == [
                copies * b for b in own], (name, r)
            assert (report["params"], report["optimizer_state"]) == (
                max(own), copies * max(own) + shared), (name, r)


def test_the_tensor_parallel_split_state_saves_and_loads_as_it_is(job):
    """fs.checkpoint.save writes each stage's blocks from its own processes (each block
    once, under the plan's layout, nothing gathered); loaded back into the split state
    every process gets its blocks, and a step from it equals a step from the state
    itself; read whole in one process it is ap.gather(state)."""
    import fshard as fs

    n, ranks = job
    for name, model, stages, micro, sched, inter, bcast, _, extras in _mp_configs(n):
        chunks = stages * (2 if inter else 1)
        dp = n // stages
        plan = example.model_parallel_plan(model, chunks, dp)
        e0 = ranks[0]["configs"][name]["split_checkpoint"]
        for r, res in enumerate(ranks):
            e = res["configs"][name]["split_checkpoint"]
            assert e["dir"] == e0["dir"]
            assert all(e["loaded_equal"]), (name, r, e["loaded_equal"])
            assert e["resumed_equal"] and e["resumed_state_equal"], (name, r)
        with open(os.path.join(e0["dir"], "index.json")) as fh:
            index = json.load(fh)
        for leaf in index["leaves"]:
            k = next((k for k in plan if f"'{k}'" in leaf["path"]), None)
            if k is None:  # (a leaf no stage owns: the step count)
                continue
            s = int(k[len("layer"):k.index(".")]) % stages
            assert leaf["layout"] == list(plan[k]), leaf
            assert (leaf["stage"], leaf["holders"]) == (s, list(range(s * dp, (s + 1) * dp)))
            assert [b["file"] for b in leaf["blocks"]] == [
                f"shard-{q:05d}-of-{n:05d}.safetensors" for q in range(s * dp, (s + 1) * dp)]
        ap, _ = example.make(model, 1, opt=extras.get("opt", "momentum"), mesh=1)
        like = ap.init(example.MODELS[model][0](chunks))
        split = fs.checkpoint.load(e0["dir"], like=like)
        gathered = fs.checkpoint.load(e0["gathered_dir"], like=like)
        for a, b in zip(fs.tree.leaves(split), fs.tree.leaves(gathered)):
            assert a.asnumpy().tobytes() == b.asnumpy().tobytes(), name


def test_a_stages_block_read_alone_is_refused_with_the_fix(job):
    """A tensor-parallel stage's block read as a value, or gathered over the job
    (x.gather(), fs.gather_sharded) that only the stage's processes hold: an
    fs.ProcessLocalError on every process, before any collective, saying to gather the
    state with the AutoParallel."""
    n, ranks = job
    for name, *_ in _mp_configs(n):
        for r, res in enumerate(ranks):
            e = res["configs"][name]["refused"]
            assert e["asnumpy"].startswith("ProcessLocalError: .asnumpy() needs the values")
            for what, call in (("gather", "x.gather()"), ("gather_sharded", "fs.gather_sharded")):
                assert e[what].startswith(f"ProcessLocalError: {call}: this f32["), e[what]
                assert f"is split over 2 of the job's {n} processes only (a pipeline " \
                    "stage's block" in e[what], e[what]
                assert "Fix: call ap.gather(state) / ap.gather_params(state)" in e[what]
