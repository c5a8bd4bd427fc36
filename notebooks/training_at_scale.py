# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Training at scale with `fs.AutoParallel`
#
# MindSpore's `AutoParallel` (seed 001) over a functional train step: a loss function,
# an `fs.optim` optimizer, and a mesh. We train the digits MLP of
# `examples/train_autoparallel.py` on a **virtual mesh of 4 devices** (the same code
# runs in a 4-process job under `python -m fshard.launch -n 4`), and look at three
# things:
#
# 1. the three parallel modes give the same losses (the numbers never depend on the
#    plan);
# 2. what ZeRO (`hsdp`) saves per device, against the textbook formulas;
# 3. which collectives one step issues, plan by plan.

# %%
import os
import sys

os.environ.setdefault("GLOG_v", "3")
sys.path.insert(0, os.path.join(os.getcwd(), "..", "examples"))

import matplotlib.pyplot as plt
import numpy as np

import fshard as fs
import train_autoparallel as example

MESH = fs.Mesh((4,), ("d",), virtual=True)
STEPS = 30

# %% [markdown]
# ## 1. The parallel modes: different plans, the same numbers
#
# `semi_auto` uses the strategies we give (the batch split 2 ways, the hidden layer 2
# ways: `--mp 2`) and plans the rest with fshard's search; `sharding_propagation`
# derives the layouts greedily from the given ones; `recursive_programming` plans the
# whole step. fshard differentiates the global loss, so every plan trains the same
# model.

# %%
curves = {}
for mode in ("semi_auto", "sharding_propagation", "recursive_programming"):
    curves[mode] = example.train(STEPS, mode=mode, mp=2, mesh=MESH)
single = example.train(STEPS)  # one device, the whole batch
for mode, losses in curves.items():
    np.testing.assert_allclose(losses, single, rtol=1e-5)
    print(f"{mode:24s} loss {losses[0]:.4f} -> {losses[-1]:.4f}")

fig, ax = plt.subplots(figsize=(6, 3))
for mode, losses in curves.items():
    ax.plot(losses, label=mode)
ax.plot(single, "k:", label="one device")
ax.set_xlabel("step")
ax.set_ylabel("loss")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 2. ZeRO: memory per device
#
# `hsdp(optimizer_level=...)` splits, over the data-parallel group, the optimizer
# state (level1), also the gradients (level2), also the parameters (level3).
# `ap.memory_report(state, *batch)` reads the bytes per device off the plan; for Adam's
# two moments of `P` float32 parameters on `N` devices, level1 holds `8P/N` bytes of
# optimizer state instead of `8P` (plus Adam's step count); we check the formulas.
# `grads` counts each gradient as the optimizer update reads it: from level1 on, the
# update of a split optimizer state reads only its slice of the gradient, so level1
# and level2 coincide here. What level2 changes is how the gradient is reduced (a
# ReduceScatter instead of an AllReduce), and on the CPU backend, which has no native
# ReduceScatter, that is the same AllReduce followed by a slice.

# %%
x, y = next(example.batches(1))
P = sum(v.size for v in example.init_params().values())
reports = {}
for level in (None, "level1", "level2", "level3"):
    ap = example.make(zero=level, mesh=MESH)
    state = ap.init(example.init_params())
    reports[level or "none"] = ap.memory_report(state, x, y)
for level, r in reports.items():
    print(f"{level:7s} params {r['params']:7.0f}  grads {r['grads']:7.0f}  "
          f"optimizer state {r['optimizer_state']:7.0f} bytes per device")
# A tensor splits when its first dimension divides by the 4 devices (b2, of 10, does
# not): the ZeRO formula per tensor is its bytes / 4, or all of them.
split = sum(v.nbytes // 4 if v.shape[0] % 4 == 0 else v.nbytes
            for v in example.init_params().values())
assert reports["none"]["params"] == 4 * P
assert reports["none"]["optimizer_state"] == 2 * 4 * P + 4  # two moments + the count
assert reports["level1"]["optimizer_state"] == 2 * split + 4
assert reports["level3"]["params"] == split

fig, ax = plt.subplots(figsize=(6, 3))
levels = list(reports)
width = 0.25
for k, part in enumerate(("params", "grads", "optimizer_state")):
    ax.bar(np.arange(len(levels)) + (k - 1) * width, [reports[lv][part] / 1024 for lv in levels],
           width, label=part)
ax.set_xticks(range(len(levels)), levels)
ax.set_ylabel("KiB per device")
ax.set_title(f"ZeRO levels on {MESH.size} devices, Adam, {P} parameters")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Collectives per step
#
# The per-device program of a step lists its communication. Data parallelism reduces
# each gradient (one AllReduce each, fewer with `comm_fusion`); the model-parallel
# split adds the collectives of the Megatron pattern; ZeRO-3 gathers parameters where
# they are used.

# %%
configs = {"data parallel": dict(), "data parallel, fused": dict(fused=True),
           "2 x 2 (dp x mp)": dict(mp=2), "ZeRO-3": dict(zero="level3")}
for name, cfg in configs.items():
    ap = example.make(mp=cfg.get("mp", 1), zero=cfg.get("zero"), mesh=MESH)
    if cfg.get("fused"):
        ap.comm_fusion({"allreduce": {"mode": "auto", "config": None}})
    state = ap.init(example.init_params())
    colls = ap.partitioned(state, x, y).collectives()
    counts = {c: colls.count(c) for c in sorted(set(colls))}
    print(f"{name:22s} {len(colls):2d} collectives  {counts}")

# %% [markdown]
# ## 4. Save, kill, resume on another mesh
#
# A training process on 4 devices (2 x 2, dp x mp) saves a checkpoint every 5 steps
# with `fs.checkpoint.save(..., wait=False)` (the files are written while it trains
# on) and is killed (`SIGKILL`) once its step-10 checkpoint is complete. We resume
# from `fs.checkpoint.latest` on **8 devices with ZeRO-3**, another layout of every
# parameter and moment: the loss curve continues where it stopped, equal to an
# uninterrupted run.

# %%
import json
import signal
import subprocess
import tempfile
import time

root = tempfile.mkdtemp()
trainer = r'''
import json, os, sys
sys.path.insert(0, sys.argv[2])
import fshard as fs
import train_autoparallel as example
root = sys.argv[1]
ap = example.make(mp=2, mesh=fs.Mesh((4,), ("d",), virtual=True))
state, losses, saves = ap.init(example.init_params()), [], []
for i, (x, y) in enumerate(example.batches(10_000)):
    state, loss = ap(state, x, y)
    losses.append(float(loss.asnumpy()))
    with open(os.path.join(root, "losses.tmp"), "w") as fh:
        json.dump(losses, fh)
    os.replace(os.path.join(root, "losses.tmp"), os.path.join(root, "losses.json"))
    if (i + 1) % 5 == 0:
        saves.append(fs.checkpoint.save(
            os.path.join(root, "ckpt"), state, step=i + 1, mesh=4, wait=False,
            layouts=ap.state_strategies(state, x, y)))
'''
examples_dir = os.path.abspath(os.path.join(os.getcwd(), "..", "examples"))
proc = subprocess.Popen([sys.executable, "-c", trainer, root, examples_dir],
                        env=dict(os.environ, GLOG_v="3"))
deadline = time.time() + 600
while (fs.checkpoint.latest(os.path.join(root, "ckpt")) or "/0").endswith(("/0", "/5")):
    assert proc.poll() is None and time.time() < deadline, "the trainer stopped early"
    time.sleep(0.2)
proc.send_signal(signal.SIGKILL)
proc.wait()
with open(os.path.join(root, "losses.json")) as fh:
    before = json.load(fh)
latest = fs.checkpoint.latest(os.path.join(root, "ckpt"))
print(f"killed after {len(before)} steps; the newest complete checkpoint: {latest}")

# %%
ap8 = example.make(zero="level3", mesh=fs.Mesh((8,), ("d",), virtual=True))
state = fs.checkpoint.load(latest, ap8.init(example.init_params()))
start = int(state.step.asnumpy())
after = []
for x, y in list(example.batches(start + 15))[start:]:
    state, loss = ap8(state, x, y)
    after.append(float(loss.asnumpy()))
uninterrupted = example.train(start + 15)  # one device, never stopped
np.testing.assert_allclose(before[:start], uninterrupted[:start], rtol=1e-5)
np.testing.assert_allclose(after, uninterrupted[start:], rtol=1e-5)
print(f"resumed at step {start} on 8 devices with ZeRO-3: loss {after[0]:.4f} -> "
      f"{after[-1]:.4f}, equal to the uninterrupted run")

fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(range(1, len(before) + 1), before, label="4 devices (2 x 2), killed")
ax.plot(range(start + 1, start + 1 + len(after)), after, label="resumed: 8 devices, ZeRO-3")
ax.plot(range(1, len(uninterrupted) + 1), uninterrupted, "k:", label="uninterrupted")
ax.axvline(start, color="grey", lw=0.5)
ax.set_xlabel("step")
ax.set_ylabel("loss")
ax.legend()
fig.tight_layout()
plt.show()
