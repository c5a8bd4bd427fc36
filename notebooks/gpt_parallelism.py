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
# # A GPT decoder under every parallelism
#
# The decoder of `examples/train_gpt.py` (Llama blocks, a token embedding tied to the
# output head) trained with `fs.AutoParallel` on a **virtual mesh of 8 devices**:
# data (dp), tensor (tp), pipeline (pp) and Megatron sequence parallelism (sp, over the
# tp devices), with recomputation and float16 loss scaling. We look at
#
# 1. the losses of the biggest combination against one float32 device;
# 2. the memory each device holds, combination by combination;
# 3. the pipeline's timeline.

# %%
import os
import sys

os.environ.setdefault("GLOG_v", "3")
sys.path.insert(0, os.path.join(os.getcwd(), "..", "examples"))
sys.path.insert(0, os.path.join(os.getcwd(), ".."))

import matplotlib.pyplot as plt
import numpy as np

import train_gpt as gpt
from benchmarks import gpt as bench

# %% [markdown]
# ## 1. dp x tp x pp x sp = 2 x 2 x 2, float16, recomputed, against one device
#
# Two layers, three steps. The float16 run rounds every operation to 11 bits, so the
# losses agree to a few parts in ten thousand, not to the last bit.

# %%
reference, _ = gpt.train(3, layers=2)
mixed, skipped = gpt.train(3, layers=2, dp=2, tp=2, pp=2, sp=True, amp=True, remat=True)
print("one device, float32:   ", np.round(reference, 5))
print("2x2x2 + sp, float16:   ", np.round(mixed, 5), f"({skipped} skipped steps)")
print("largest relative difference:",
      f"{np.max(np.abs(np.subtract(mixed, reference)) / np.abs(reference)):.1e}")

# %% [markdown]
# ## 2. Memory per device
#
# For each combination on 8 devices (and one device), the bytes device 0 holds, measured
# as `benchmarks/gpt.py` measures them (its docstring): parameters, gradients and Adam's
# state from the step's plan, activations as the forward values the backward pass
# reads. In a pipeline each device keeps its own stage's train state, so the first
# three bars shrink with pp, and with a tensor-parallel split inside a stage too (its
# devices keep and update their blocks); its activations are the stage inputs kept
# between a micro-batch's forward and backward, plus one stage's recomputation.

# %%
combos = [c for c in bench.COMBOS if c[1] in (1, 8)]
residuals, memory = {}, {}
for label, n, cfg in combos:
    if cfg.get("pp", 1) == 1:
        memory[label] = bench.measure_memory(label, cfg)
        key = (cfg.get("dp", 1), cfg.get("tp", 1), cfg.get("sp", False))
        residuals[key] = memory[label]["activations"] * cfg.get("dp", 1)
for label, n, cfg in combos:
    if cfg.get("pp", 1) > 1:
        memory[label] = bench.measure_memory(label, cfg, tp_residuals=residuals)

kinds = ["params", "grads", "optimizer_state", "activations"]
labels = [c[0] for c in combos]
fig, ax = plt.subplots(figsize=(9, 3.8))
width = 0.2
for i, kind in enumerate(kinds):
    ax.bar(np.arange(len(labels)) + (i - 1.5) * width,
           [memory[lb][kind] / 1024 for lb in labels], width, label=kind)
ax.set_xticks(np.arange(len(labels)))
ax.set_xticklabels(labels, rotation=20, ha="right")
ax.set_ylabel("KiB per device")
ax.set_yscale("log")
ax.set_title("GPT decoder (4 layers, batch 16, seq 16), float32: memory of device 0")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

for lb in labels:
    print(f"{lb:26s}", "  ".join(f"{k} {memory[lb][k] / 1024:7.1f} KiB" for k in kinds))

# %% [markdown]
# ## 3. The pipeline's timeline
#
# `dp=2 x tp=2 x pp=2` with 4 micro-batches, 1F1B: the schedule as data
# (`ap.pipeline_schedule()`), simulated with a backward twice a forward. The bubble,
# `(S - 1) / (M + S - 1)`, is the share of the step a stage sits idle.

# %%
ap = gpt.build(dp=2, tp=2, pp=2, micro_batches=4)
state = ap.init(gpt.init_params())
tokens, targets = next(gpt.corpus(1))
state, loss = ap(state, tokens, targets, np.ones(len(tokens), np.float32))
timeline = ap.pipeline_schedule().timeline()
print(f"bubble: {float(timeline.bubble_fraction):.1%}; kept activations per stage:",
      timeline.peak_activations())

fig, ax = plt.subplots(figsize=(9, 2.2))
colours = plt.get_cmap("tab10")
for e in timeline.events:
    a = e.action
    ax.broken_barh([(float(e.start), float(e.end - e.start))], (e.stage - 0.4, 0.8),
                   facecolors=colours(a.micro_batch), edgecolors="black",
                   alpha=1.0 if a.kind == "F" else 0.55, hatch=None if a.kind == "F" else "//")
    ax.text(float(e.start + e.end) / 2, e.stage, f"{a.kind}{a.micro_batch}", ha="center",
            va="center", fontsize=8)
ax.set_yticks([0, 1])
ax.set_yticklabels(["stage 0", "stage 1"])
ax.invert_yaxis()
ax.set_xlabel("time (one stage's forward = 1)")
ax.set_title("1F1B, 2 stages, 4 micro-batches")
fig.tight_layout()
plt.show()
