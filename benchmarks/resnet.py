"""A model written by others: a training step of mindcv's ResNet-18.

examples/train_resnet.py's model (``mindcv.create_model("resnet18", num_classes=10)``
in training mode, inside ``nn.WithLossCell`` with the mean sparse softmax
cross-entropy) on a batch of 16 digits upsampled to 3 x 32 x 32, SGD with momentum
0.9. Two rows per measurement, run side by side in one process:

* ``fs.jit`` of ``value_and_grad`` of ``fs.functional``'s apply plus the
  ``fs.optim.sgd`` update (the BatchNorm moving statistics are updated in place);
* MindSpore's own GRAPH-mode ``nn.TrainOneStepCell(nn.WithLossCell(net, loss),
  nn.Momentum(...))``.

``step``: the steady time of one training step (interleaved, reading the loss);
``first call``: a fresh step's first call (fshard: trace + lower + MindSpore's compile
+ the step; MindSpore: its compile + the step), each on a freshly built network, the
two taking turns after one untimed compile of a tiny graph (``warm_up_compiler``).
Targets: step <= 1.05x, first call <= 1.5x MindSpore's.

The JAX rows (``jax_baselines.py``) time the same network in plain JAX. To know it
is the same, the timed networks start from ``model_specs.py``'s initial values (the
names and shapes of mindcv's parameters are checked equal to the spec's first) and
take three steps on its batch before timing: fshard's and MindSpore's losses must
agree, and JAX's first (its forward pass; see ``_same_model`` for the later ones).
"""

from __future__ import annotations

import os
import sys

import mindspore as ms
import numpy as np
from mindspore import nn

import fshard as fs
from benchmarks import model_specs
from benchmarks.harness import Result, benchmark, row, warm_up_compiler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import train_resnet as example  # noqa: E402

LR = 0.01
BATCH, SIZE = 16, 32


def fshard_step(net):
    """``step(x, y) -> loss`` training ``net`` with fs.jit; the state lives in a closure."""
    apply, params = fs.functional(example.loss_cell(net))
    train = {k: v for k, v in params.items() if v.requires_grad}
    opt = fs.optim.sgd(LR, momentum=0.9)

    @fs.jit
    def step(train, opt_state, x, y):
        loss, grads = fs.value_and_grad(apply)(train, x, y)
        updates, opt_state = opt.update(grads, opt_state, train)
        return fs.optim.apply_updates(train, updates), opt_state, loss

    box = [train, opt.init(train)]

    def call(x, y):
        box[0], box[1], loss = step(box[0], box[1], x, y)
        return loss

    return call


def mindspore_step(net):
    step = nn.TrainOneStepCell(example.loss_cell(net),
                               nn.Momentum(net.trainable_params(), LR, 0.9))
    step.set_train(True)
    return step


def load_spec_weights(net, seed: int = 0) -> None:
    """Set mindcv's resnet18 ``net`` to ``model_specs.resnet18_weights(seed)``, after
    checking that its parameters are the spec's, name for name and shape for shape."""
    spec = model_specs.resnet18_weights(seed)
    got = {p.name: (tuple(p.shape), p.requires_grad) for p in net.get_parameters()}
    want = {k: (v.shape, model_specs.trainable(k)) for k, v in spec.items()}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:6]
        raise ValueError(f"mindcv's resnet18 is not model_specs.resnet18_shapes(): "
                         f"(name, (shape, trained)) differing: {diff}")
    for p in net.get_parameters():
        p.set_data(ms.Tensor(spec[p.name]))


def _same_model(ctx, ours, theirs, net) -> list:
    """Three steps of each from the spec's values on the spec's batch: the losses must
    agree, JAX's first one too (when it ran), and the parameter counts. The notes that
    say so."""
    x, y = (ms.Tensor(a) for a in model_specs.resnet18_batch())
    got = [float(ours(x, y).asnumpy()) for _ in range(3)]
    want = [float(theirs(x, y).asnumpy()) for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    trained = sum(int(np.prod(p.shape)) for p in net.trainable_params())
    stats = sum(int(np.prod(p.shape)) for p in net.get_parameters()) - trained
    notes = [(f"from model_specs' weights and batch, first three losses: fshard "
              f"{np.round(got, 6).tolist()}, TrainOneStepCell {np.round(want, 6).tolist()}"),
             f"mindcv's resnet18: {trained} trained parameters + {stats} moving statistics"]
    check = ctx.jax_check("resnet18_train_step")
    if check:
        # The first loss only: from the second on, float32 rounding decides which side
        # of a ReLU's kink a pre-activation within ~1e-6 of zero falls (this batch has
        # some), and JAX's convolutions round differently from MindSpore's (which
        # fshard and TrainOneStepCell share), so the trajectories part at ~1e-3.
        np.testing.assert_allclose(check["losses"][0], got[0], rtol=1e-4)
        if (check["trainable"], check["moving_stats"]) != (trained, stats):
            raise ValueError(f"the JAX ResNet-18 has {check['trainable']} + "
                             f"{check['moving_stats']} parameters, mindcv's {trained} + {stats}")
        notes.append(f"JAX: losses {np.round(check['losses'], 6).tolist()}, "
                     f"{check['trainable']} + {check['moving_stats']} parameters")
    return notes


def _first_call(make, x, y):
    """``build() -> call``: a step on a freshly built network, untimed; its first call."""
    def build():
        step = make(example.make_model())
        return lambda: step(x, y).asnumpy()

    return build


@benchmark("resnet18_train_step",
           title="mindcv ResNet-18 training step against TrainOneStepCell (batch 16, 3x32x32)",
           jax="resnet18_train_step")
def resnet18_train_step(ctx):
    x, y = next(example.batches(1, BATCH, SIZE))
    x, y = ms.Tensor(x), ms.Tensor(y)
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)  # TrainOneStepCell compiles its graph
    try:
        warm_up_compiler()
        first = ctx.measure_each_interleaved(
            {name: _first_call(make, x, y)
             for name, make in (("fshard", fshard_step), ("mindspore", mindspore_step))},
            runs=ctx.runs(2, 1))
        ours_net, theirs_net = example.make_model(), example.make_model()
        load_spec_weights(ours_net)
        load_spec_weights(theirs_net)
        ours, theirs = fshard_step(ours_net), mindspore_step(theirs_net)
        notes = _same_model(ctx, ours, theirs, ours_net)
        t = ctx.compare({"fshard": lambda: ours(x, y).asnumpy(),
                         "mindspore": lambda: theirs(x, y).asnumpy()},
                        runs=ctx.runs(20, 2), warmup=2, rounds=ctx.runs(5, 1))
    finally:
        ms.set_context(mode=mode)
    rows = [row("fshard", "step: fs.jit(value_and_grad) + fs.optim.sgd", t["fshard"]),
            row("mindspore", "step: GRAPH-mode TrainOneStepCell + nn.Momentum",
                t["mindspore"]),
            row("fshard", "first call: trace + compile + step", first["fshard"]),
            row("mindspore", "first call: compile + step (GRAPH mode)", first["mindspore"]),
            *ctx.jax_rows("resnet18_train_step")]
    return Result(rows, baseline="step: GRAPH-mode TrainOneStepCell + nn.Momentum",
                  target="step <= 1.05x MindSpore's step; first call <= 1.5x MindSpore's "
                         "first call", notes=notes)
