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
"""

from __future__ import annotations

import os
import sys

import mindspore as ms
from mindspore import nn

import fshard as fs
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


def _first_call(make, x, y):
    """``build() -> call``: a step on a freshly built network, untimed; its first call."""
    def build():
        step = make(example.make_model())
        return lambda: step(x, y).asnumpy()

    return build


@benchmark("resnet18_train_step",
           title="mindcv ResNet-18 training step against TrainOneStepCell (batch 16, 3x32x32)")
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
        ours, theirs = fshard_step(example.make_model()), mindspore_step(example.make_model())
        t = ctx.compare({"fshard": lambda: ours(x, y).asnumpy(),
                         "mindspore": lambda: theirs(x, y).asnumpy()},
                        runs=ctx.runs(20, 2), warmup=2, rounds=ctx.runs(5, 1))
    finally:
        ms.set_context(mode=mode)
    rows = [row("fshard", "step: fs.jit(value_and_grad) + fs.optim.sgd", t["fshard"]),
            row("mindspore", "step: GRAPH-mode TrainOneStepCell + nn.Momentum",
                t["mindspore"]),
            row("fshard", "first call: trace + compile + step", first["fshard"]),
            row("mindspore", "first call: compile + step (GRAPH mode)", first["mindspore"])]
    return Result(rows, baseline="step: GRAPH-mode TrainOneStepCell + nn.Momentum",
                  target="step <= 1.05x MindSpore's step; first call <= 1.5x MindSpore's "
                         "first call")
