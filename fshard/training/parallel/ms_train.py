"""``fs.Model``: MindSpore's ``Model`` whose training step is an ``fs.AutoParallel`` step.

MindSpore's ``mindspore.train.Model`` wraps its network in ``WithLossCell`` and
``TrainOneStepCell`` and compiles that with MindSpore's own graph executor and
partitioner, so it cannot run fshard's step. ``fs.Model`` is that class with the
train network replaced: everything else (the dataset loop, epochs, callbacks such as
``LossMonitor`` and their output, ``eval``, ``predict``) is MindSpore's. So a script
changes its import line only:

    from fshard import Model            # was: from mindspore.train import Model

- ``Model(network=ap, loss_fn=..., optimizer=...)`` with ``ap = fs.AutoParallel(net,
  parallel_mode=...)``: the step trains ``WithLossCell(net, loss_fn)`` with
  ``optimizer`` (a MindSpore ``nn.Optimizer``, translated by
  ``fshard.training.parallel.ms_optimizers``, or an ``fs.optim`` one), planned as ``ap`` is
  configured (``hsdp``, ``dataset_strategy``, ``pipeline``, ...). Without ``loss_fn``
  the network returns the loss; without ``optimizer``, ``ap``'s own.
- ``Model(net, loss_fn, optimizer)`` with a plain ``nn.Cell``: the step is
  ``fs.AutoParallel(WithLossCell(net, loss_fn), parallel_mode="semi_auto")``
  (operators follow their ``shard`` strategies, the rest runs data parallel); the
  Cell's ``set_inputs`` (and the loss's) declare the step's batch shapes, as
  MindSpore's ``Model`` merges them.

A loss that is not a scalar (``reduction="none"``) is trained as MindSpore's
``TrainOneStepCell`` trains it, on the gradient of its sum (``sens`` of ones); the step
returns its mean, the number ``LossMonitor`` prints of MindSpore's per-example values.

The trained values are written back into the Cell's Parameters when ``train``
returns, so ``save_checkpoint(net)`` and MindSpore's own ``eval`` / ``predict`` after
it see them; the optimizer state lives on in the Model between ``train`` calls.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn
from mindspore.train import Model as _MindSporeModel

from fshard.adapter.cells import is_cell
from fshard.core.tracing import typeof
from fshard.errors import ArgumentError
from fshard.training.parallel.auto_parallel import AutoParallel
from fshard.training.parallel.ms_optimizers import lr_steps
from fshard.primitives.structural import stop_gradient

__all__ = ["Model"]


class _StepCell(nn.Cell):
    """The train network ``Model`` calls: ``cell(*batch) -> loss``, one
    ``AutoParallel`` step on a state kept here (MindSpore's ``Model`` reads it as a
    Cell: ``set_train``, ``phase``, its parameters for checkpoint callbacks)."""

    def __init__(self, ap: AutoParallel, network, optimizer=None):
        super().__init__(auto_prefix=False)
        self.network = network
        self._fs_ap = ap
        self._fs_state = None
        self._fs_steps = 0
        self._fs_optimizer = optimizer  # MindSpore's, if given: its lr lists' length
        self._fs_lr_steps = lr_steps(optimizer) if optimizer is not None else None

    def __call__(self, *batch):
        ap = self._fs_ap
        if self._fs_lr_steps is not None and self._fs_steps >= self._fs_lr_steps:
            raise ArgumentError(
                f"fs.Model: step {self._fs_steps + 1} is past the end of the learning-rate "
                f"list of nn.{type(self._fs_optimizer).__name__}, which covers "
                f"{self._fs_lr_steps} steps (MindSpore's step raises there too).\nFix: give "
                "a learning-rate list as long as the training (epochs x steps per epoch), "
                "or a LearningRateSchedule.")
        self._fs_steps += 1
        if self._fs_state is None:
            self._fs_state = ap.init()
            runner = ap._pipeline
            if runner is not None and not runner.cfg.output_broadcast:
                # In a job only the last stage has the loss (the others' is NaN, which
                # LossMonitor stops on): every process gets it (one scalar AllReduce).
                runner.cfg = runner.cfg._replace(output_broadcast=True)
        self._fs_state, loss = ap(self._fs_state, *batch)
        return loss

    def construct(self, *batch):  # never compiled: __call__ runs the fshard step
        raise AssertionError("fs.Model's step is run by __call__")

    def write_back(self) -> None:
        """The trained values into the network's Parameters (a collective in a job:
        split parameters are gathered)."""
        if self._fs_state is None:
            return
        values = self._fs_ap.gather_params(self._fs_state)
        params = dict(self._fs_ap.cell.parameters_and_names())
        for name, v in values.items():
            params[name].set_data(ms.Tensor(v.asnumpy() if hasattr(v, "asnumpy") else v))


def _summed(loss):
    """The step's loss for a network's output: a scalar as it is; a loss with
    ``reduction="none"`` differentiated as MindSpore's ``TrainOneStepCell`` does
    (``sens`` of ones: the gradient of the sum) while its value is the mean, the number
    ``LossMonitor`` prints of MindSpore's per-example losses."""
    if isinstance(loss, (tuple, list)):
        raise ArgumentError(
            f"fs.Model: the network returns a {type(loss).__name__} of {len(loss)} values; "
            "the train step needs the loss alone (a Tensor), as MindSpore's "
            "TrainOneStepCell does.\nFix: return the loss only, or pass loss_fn to Model.")
    if typeof(loss).ndim == 0:
        return loss
    total = loss.sum()
    return stop_gradient(loss.mean()) + (total - stop_gradient(total))


def _declared_inputs(net, loss_fn) -> tuple | None:
    """The batch shapes declared with ``set_inputs`` on the network and the loss, as
    MindSpore's ``Model`` merges them (the network's inputs, then the loss's after its
    first, the logits)."""
    net_inputs = net.get_inputs() if is_cell(net) else None
    if not net_inputs:
        return None
    loss_inputs = loss_fn.get_inputs() if is_cell(loss_fn) else None
    return tuple(net_inputs) + (tuple(loss_inputs[1:]) if loss_inputs else ())


class Model(_MindSporeModel):
    """MindSpore's ``mindspore.train.Model`` training with an ``fs.AutoParallel`` step:
    MindSpore's dataset loop, epochs and callbacks (``LossMonitor`` prints its own
    lines), fshard's step (docs/migrating_from_mindspore.md#mindspores-model).

    >>> import numpy as np, mindspore.dataset as ds, fshard as fs
    >>> from mindspore import nn
    >>> from mindspore.train import LossMonitor
    >>> net = nn.Dense(4, 2)
    >>> ap = fs.AutoParallel(net, parallel_mode="semi_auto", mesh=2)
    >>> model = fs.Model(network=ap, loss_fn=nn.MSELoss(),
    ...                  optimizer=nn.Momentum(net.trainable_params(), 0.1, 0.9))
    >>> x, y = np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32)
    >>> data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(4)
    >>> model.train(1, data, callbacks=[LossMonitor()])  # doctest: +ELLIPSIS
    epoch: 1 step: 1, loss is ...
    epoch: 1 step: 2, loss is ...

    Args (MindSpore's):
        network: an ``fs.AutoParallel`` (made with or without an optimizer), or an
            ``nn.Cell``.
        loss_fn: a loss Cell (``network``'s output and the label in, the loss out), or
            None when the network returns the loss.
        optimizer: a MindSpore ``nn.Optimizer`` over the network's parameters
            (``nn.SGD``, ``nn.Momentum``, ``nn.Adam``, ``nn.AdamWeightDecay``), an
            ``fs.optim`` optimizer, or None (``ap``'s own).
        metrics, eval_network, eval_indexes: MindSpore's, for ``eval`` (run by
            MindSpore on the trained Parameters).
        amp_level, boost_level: ``"O0"`` only (use ``fs.amp`` for mixed precision).
        loss_scale_manager: ``FixedLossScaleManager(s, drop_overflow_update=False)``
            (the gradients scaled by ``s``, divided by the optimizer's ``loss_scale``).
    """

    def __init__(self, network, loss_fn=None, optimizer=None, metrics=None,
                 eval_network=None, eval_indexes=None, amp_level="O0", boost_level="O0",
                 **kwargs):
        for name, value in (("amp_level", amp_level), ("boost_level", boost_level)):
            if value != "O0":
                raise ArgumentError(
                    f"fs.Model({name}={value!r}): MindSpore's automatic mixed precision "
                    "and boost rewrite MindSpore's own train network, which fs.Model "
                    f"replaces by an fshard step.\nFix: {name}='O0'; for mixed precision "
                    "use an fs.amp policy in the network (docs/amp.md).")
        if isinstance(network, AutoParallel):
            ap = network
            if ap.cell is None:
                raise ArgumentError(
                    f"fs.Model(network=AutoParallel({ap.name})): the AutoParallel trains a "
                    "function; Model needs a Cell network (it calls it with each batch "
                    "of the dataset).\nFix: make the AutoParallel of the nn.Cell.")
            # A second Model on the same AutoParallel starts from the Cell it was made of.
            backbone = ap.__dict__.setdefault("_model_network", ap.cell)
        elif is_cell(network):
            backbone = network
            ap = AutoParallel(network, parallel_mode="semi_auto")
        else:
            raise ArgumentError(
                f"fs.Model(network=...) must be an fs.AutoParallel or an nn.Cell; got "
                f"{type(network).__name__}.")
        scale = 1.0
        manager = kwargs.get("loss_scale_manager")
        if manager is not None:
            if manager.get_update_cell() is not None or manager.get_drop_overflow_update():
                raise ArgumentError(
                    f"fs.Model(loss_scale_manager={type(manager).__name__}): only "
                    "FixedLossScaleManager(..., drop_overflow_update=False) is supported "
                    "(as MindSpore on CPU).\nFix: use it, or fs.amp's dynamic loss scaling "
                    "in an fshard step (docs/amp.md).")
            scale = float(manager.get_loss_scale())
        if scale != 1.0 and not isinstance(optimizer, nn.Optimizer):
            raise ArgumentError(
                "fs.Model(loss_scale_manager=...) needs a MindSpore optimizer given to "
                f"Model (whose loss_scale divides the scale out); got {optimizer!r}.\nFix: "
                "pass optimizer=nn.SGD(...) (or another MindSpore optimizer), or use "
                "fs.amp's loss scaling with an fs.optim optimizer.")
        loss_net = nn.WithLossCell(backbone, loss_fn) if loss_fn is not None else backbone
        # ap's own MindSpore optimizer is translated again: the loss renames the
        # parameters (WithLossCell's '_backbone.' prefix)
        given = optimizer if optimizer is not None else ap._ms_optimizer
        ap._set_network(loss_net, has_aux=False, output=_summed)
        if given is not None:
            ap._set_optimizer(given, loss_scale=scale)
        ap._need_optimizer()
        declared = _declared_inputs(backbone, loss_fn)
        if declared is not None and ap._batch_specs is None:
            ap.set_inputs(*declared)
        self._fs_ap = ap
        self._fs_backbone = backbone
        super().__init__(backbone, loss_fn=loss_fn,
                         optimizer=optimizer if isinstance(optimizer, nn.Optimizer) else None,
                         metrics=metrics, eval_network=eval_network,
                         eval_indexes=eval_indexes, **{k: v for k, v in kwargs.items()
                                                       if k != "loss_scale_manager"})

    def _build_train_network(self):
        return _StepCell(self._fs_ap, self._fs_backbone, self._fs_ap._ms_optimizer)

    def _write_back(self) -> None:
        self._train_network.write_back()

    def train(self, epoch, train_dataset, callbacks=None, dataset_sink_mode=False,
              sink_size=-1, initial_epoch=0):
        """MindSpore's ``Model.train``, each step fshard's; the trained values are in
        the network's Parameters when it returns. (On CPU MindSpore runs
        ``dataset_sink_mode=True`` without sinking; so does this.)"""
        try:
            super().train(epoch, train_dataset, callbacks=callbacks,
                          dataset_sink_mode=dataset_sink_mode, sink_size=sink_size,
                          initial_epoch=initial_epoch)
        finally:
            self._write_back()

    def fit(self, *args, **kwargs):
        raise ArgumentError(
            "fs.Model.fit: not supported (its evaluation between epochs would run on "
            "Parameters the fshard step has not written back).\nFix: call model.train(...) "
            "and model.eval(...) in turn.")
