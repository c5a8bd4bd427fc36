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
# # Where a training step spends its time, layer by layer
#
# `fs.profile(f)(*args)` traces `f` into its program, runs every equation on its own
# and times it. Each equation remembers the line of your code that created it, and the
# equations of the derivative (the backward pass of `fs.grad`) remember the line of
# the operation they differentiate. So with a model written one layer per line,
# `profile.by_line()` is the time of each layer, forward plus backward.
#
# The times are those of one MindSpore operation at a time (eager, with its dispatch
# cost and no fusion), so their sum is larger than the compiled step: they show where
# the work is, not the compiled graph's exact breakdown (docs/performance.md).

# %%
import inspect
import os
import warnings

import matplotlib.pyplot as plt
import mindspore as ms
import numpy as np
from mindspore import nn, ops

import fshard as fs

warnings.simplefilter("ignore", fs.errors.GenericOpWarning)

# %% [markdown]
# ## A small CNN, one layer per line
#
# Two convolution blocks with BatchNorm (training mode: its moving statistics are
# updated by every step), max pooling and a dense head, on 16x16 single-channel
# images.


# %%
class CNN(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, pad_mode="pad", padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, pad_mode="pad", padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc = nn.Dense(32 * 4 * 4, 10)

    def construct(self, x):
        x = self.conv1(x)
        x = ops.relu(self.bn1(x))
        x = self.pool(x)
        x = self.conv2(x)
        x = ops.relu(self.bn2(x))
        x = self.pool(x)
        return self.fc(x.reshape(x.shape[0], -1))


ms.set_seed(0)
net = CNN()
net.set_train(True)
loss_net = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True,
                                                                 reduction="mean"))
apply, params = fs.functional(loss_net)
train = {k: v for k, v in params.items() if v.requires_grad}

rng = np.random.default_rng(0)
x = ms.Tensor(rng.random((64, 1, 16, 16)).astype(np.float32))
y = ms.Tensor(rng.integers(0, 10, 64).astype(np.int32))

# %% [markdown]
# ## Profile one step: the loss and the gradient of every weight

# %%
step = fs.value_and_grad(apply)
profile = fs.profile(step, repeat=3, top=8)(train, x, y)
print(profile)

# %% [markdown]
# ## Group by layer
#
# `by_line()` maps `"file:line"` to seconds. The lines of `construct` name the layers
# (numbered from its `def`); what is left (the loss, the seed of the gradient) is
# shown as "loss and rest".

# %%
code, first = inspect.getsourcelines(CNN.construct)
here = os.path.basename(inspect.getsourcefile(CNN.construct))
layers = {}
for where, seconds in profile.by_line().items():
    label = "loss and rest"
    if where is not None and where.rsplit(":", 1)[0] == here:
        n = int(where.rsplit(":", 1)[1])
        if first < n < first + len(code):
            label = f"{n - first}: {code[n - first].strip()}"
    layers[label] = layers.get(label, 0.0) + seconds

order = sorted((k for k in layers if k != "loss and rest"), key=lambda k: int(k.split(":")[0]))
order.append("loss and rest")
ms_per_layer = [1e3 * layers.get(k, 0.0) for k in order]
for k, t in zip(order, ms_per_layer):
    print(f"{t:8.2f} ms  {k}")
print(f"{1e3 * profile.eager_seconds:8.2f} ms  all equations, one at a time")
print(f"{1e3 * profile.compiled_seconds:8.2f} ms  the step compiled with fs.jit")

# %%
fig, ax = plt.subplots(figsize=(8, 3.6))
ax.barh(order[::-1], ms_per_layer[::-1], color="#4c72b0")
ax.set_xlabel("milliseconds per step (forward + backward, eager, one op at a time)")
ax.set_title(f"Per-layer step time; the compiled step: "
             f"{1e3 * profile.compiled_seconds:.1f} ms")
fig.tight_layout()
plt.show()

# %% [markdown]
# The convolutions, and BatchNorm in training mode (its statistics, the normalisation
# and their derivatives: a dozen element-wise operations each way), carry most of the
# step; the pools and the dense head are cheap. `profile.chart()` draws the slowest
# single equations instead, and `print(profile)` lists them with their lines.
