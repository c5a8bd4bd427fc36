"""MindSpore optimizers as ``fs.optim`` optimizers.

A MindSpore script builds its optimizer as an ``nn.Optimizer`` over a Cell's
Parameters (``nn.SGD(net.trainable_params(), 1e-2)``), with parameter groups,
learning-rate schedules, weight decay and a loss scale. ``from_mindspore(optimizer,
params)`` reads those settings and returns the ``fs.optim`` optimizer that makes the
same updates, step for step, over the ``{name: value}`` dict of the Cell's parameters
(``fs.functional(cell)``'s names), so the step stays one pure, compiled, shardable
function. Parameters of the Cell that the optimizer does not hold get no update and no
state, as in MindSpore (``TrainOneStepCell`` differentiates the optimizer's parameters
only).

What is read, per parameter (MindSpore's ``nn.Optimizer`` has already resolved the
groups: ``parameters``, ``learning_rate`` per group, ``group_weight_decay``,
``decay_flags``):

- the learning rate: a number, a list or 1-D Tensor of per-step values
  (``nn.piecewise_constant_lr`` and the other ``*_lr`` functions return such lists),
  or a ``LearningRateSchedule`` Cell (``nn.ExponentialDecayLR``, ``nn.CosineDecayLR``,
  ...), which is traced as fshard traces any Cell;
- the weight decay (coupled: added to the gradient, except ``AdamWeightDecay``'s
  decoupled one), on the parameters MindSpore decays: without groups those whose name
  has neither ``beta`` nor ``gamma``, with groups every parameter of a group whose
  ``weight_decay`` is > 0;
- ``loss_scale``: the gradients are divided by it (MindSpore's ``scale_grad``); the
  weight decay is not (MindSpore multiplies it by the loss scale first).

Anything else that changes the numbers (``dampening``, AMSGrad, Nesterov Adam, lazy or
offloaded Adam, a weight decay given as a Cell, gradient centralization, an optimizer
that has already taken steps, another optimizer class) is refused with an
``ArgumentError`` that names it.
"""

from __future__ import annotations

import numpy as np

from fshard.training import optim
from fshard.backend import mindspore as backend
from fshard.errors import ArgumentError

__all__ = ["from_mindspore", "is_mindspore_optimizer", "lr_steps"]

# The MindSpore optimizer classes translated (mindspore.nn.optim's), by name.
SUPPORTED = ("SGD", "Momentum", "Adam", "AdamWeightDecay")


def is_mindspore_optimizer(obj) -> bool:
    from mindspore import nn

    return isinstance(obj, nn.Optimizer)


def _refuse(opt, what: str, fix: str):
    raise ArgumentError(
        f"MindSpore optimizer nn.{type(opt).__name__}: {what}, which fshard does not "
        f"translate into an fs.optim optimizer.\nFix: {fix}")


def _scalar(x) -> float:
    return float(np.asarray(x.asnumpy() if hasattr(x, "asnumpy") else x).reshape(()))


def _lr_schedule(opt, lr):
    """A MindSpore learning rate (as ``nn.Optimizer`` stores it) as an ``fs.optim``
    learning rate: a float, or a schedule of the step count (MindSpore's
    ``global_step``, 0 for the first update)."""
    from mindspore import Parameter, Tensor
    from mindspore.nn.learning_rate_schedule import LearningRateSchedule
    _ConvertToCell, _IteratorLearningRate = backend.optimizer_lr_classes()

    if isinstance(lr, _ConvertToCell):  # a number in a group of dynamic learning rates
        lr = lr.learning_rate
    if isinstance(lr, _IteratorLearningRate):  # a list of per-step values
        return _table(np.asarray(lr.learning_rate.asnumpy(), np.float32))
    if isinstance(lr, (Parameter, Tensor)):
        return _scalar(lr)
    if isinstance(lr, LearningRateSchedule):
        return _cell_schedule(lr)
    _refuse(opt, f"a learning rate of type {type(lr).__name__}",
            "give a number, a list of per-step values or a LearningRateSchedule Cell.")


def _table(values: np.ndarray):
    """The per-step learning rates of a list: ``values[step]``. Past the end of the
    list MindSpore's step raises (its Gather's index is out of range); a compiled
    fshard step cannot raise, so the rate is NaN there: the update makes the parameters
    NaN, visible, rather than training on with a rate nobody gave (``fs.Model`` raises
    before that step, as MindSpore does: ``lr_steps``)."""
    import mindspore as ms
    from mindspore import ops

    table = ms.Tensor(np.append(values, np.float32(np.nan)))
    end = len(values)

    def schedule(step, dtype):
        i = ops.minimum(ops.cast(step, ms.int32), end)
        return ops.cast(ops.gather(table, i, 0), dtype)

    return optim.Schedule(schedule, f"MindSpore learning-rate list of {len(values)} steps")


def _cell_schedule(cell):
    """A ``LearningRateSchedule`` Cell, called (and traced) with the step as MindSpore
    calls it: an int32 Tensor."""
    import mindspore as ms
    from mindspore import ops

    def schedule(step, dtype):
        return ops.cast(cell(ops.cast(step, ms.int32)), dtype).reshape(())

    return optim.Schedule(schedule, f"MindSpore {type(cell).__name__}")


def lr_steps(opt) -> int | None:
    """How many steps the MindSpore optimizer's learning-rate lists cover (the
    shortest), or None when its learning rates are numbers or schedules."""
    _, _IteratorLearningRate = backend.optimizer_lr_classes()

    lrs = list(opt.learning_rate) if opt.is_group_lr else [opt.learning_rate]
    sizes = [int(lr.learning_rate.shape[0]) for lr in lrs
             if isinstance(lr, _IteratorLearningRate)]
    return min(sizes) if sizes else None


def _per_parameter(opt) -> list:
    """``[(Parameter, lr, weight_decay, decayed)]`` in the optimizer's order, with the
    user's weight decay (MindSpore stores it multiplied by the loss scale)."""
    from mindspore import nn

    scale = float(opt.loss_scale)
    params = list(opt.parameters)
    if opt.is_group_lr:
        lrs = list(opt.learning_rate)
    else:
        lrs = [opt.learning_rate] * len(params)
    if opt.is_group:
        wds = list(opt.group_weight_decay)
        if any(isinstance(w, nn.Cell) for w in wds):
            _refuse(opt, "a weight_decay given as a Cell (a weight-decay schedule)",
                    "give each group's weight_decay as a number.")
        if any(getattr(opt, "grad_centralization_flags", ())):
            _refuse(opt, "'grad_centralization': True in a parameter group",
                    "remove 'grad_centralization' from the groups.")
        wds = [float(w) / scale for w in wds]
    else:
        if opt.dynamic_weight_decay:
            _refuse(opt, "a weight_decay given as a Cell (a weight-decay schedule)",
                    "give weight_decay as a number.")
        wds = [_scalar(opt.weight_decay) / scale] * len(params)
    flags = [bool(f) for f in opt.decay_flags]
    return list(zip(params, lrs, wds, flags, strict=True))


def _rule(opt, lr, wd: float, mask: dict):
    """The ``fs.optim`` optimizer of one group of parameters (same learning rate and
    weight decay)."""
    kind = type(opt).__name__
    decays = wd > 0 and any(mask.values())
    if kind == "SGD":
        if _scalar(opt.dampening) != 0:
            _refuse(opt, f"dampening={_scalar(opt.dampening)}", "use dampening=0.0 (the "
                    "default), or write the rule with fs.optim's blocks (trace, scale).")
        return optim.sgd(lr, momentum=_scalar(opt.momentum), nesterov=bool(opt.nesterov),
                         weight_decay=wd if decays else 0.0, mask=mask)
    if kind == "Momentum":
        return optim.sgd(lr, momentum=_scalar(opt.momentum),
                         nesterov=bool(opt.use_nesterov), weight_decay=wd if decays else 0.0,
                         mask=mask)
    b1, b2, eps = _scalar(opt.beta1), _scalar(opt.beta2), _scalar(opt.eps)
    if kind == "Adam":
        for flag, fix in (("use_amsgrad", "AMSGrad"), ("use_nesterov", "Nesterov momentum"),
                          ("use_lazy", "lazy (sparse) updates"),
                          ("use_offload", "host offload")):
            if getattr(opt, flag, False):
                _refuse(opt, f"{flag}=True ({fix})", f"drop {flag}; nn.Adam's plain rule is "
                        "fs.optim.adam.")
        adam = optim.adam(lr, b1, b2, eps)
        if not decays:
            return adam
        # nn.Adam's weight decay is added to the gradient before the moments
        return optim.chain(optim.add_decayed_weights(wd, mask=mask), adam)
    if kind == "AdamWeightDecay":
        return optim.adamw(lr, b1, b2, eps, weight_decay=wd if decays else 0.0, mask=mask)
    raise AssertionError(kind)


def from_mindspore(opt, params: dict, loss_scale: float = 1.0):
    """The ``fs.optim`` optimizer equal to the MindSpore optimizer ``opt`` over
    ``params``, a dict ``{name: Parameter}`` holding (by identity) every Parameter the
    optimizer updates (``fs.functional(cell)[1]`` of the network); its ``init`` and
    ``update`` take dicts with those names (the trainable ones). ``loss_scale``: the
    factor the gradients were scaled by (MindSpore's ``FixedLossScaleManager`` in
    ``Model``), which the optimizer's own ``loss_scale`` divides out.

    >>> import numpy as np, fshard as fs
    >>> from mindspore import nn
    >>> from fshard.training.parallel.ms_optimizers import from_mindspore
    >>> net = nn.Dense(3, 2)
    >>> _, params = fs.functional(net)
    >>> opt = from_mindspore(nn.Momentum(net.trainable_params(), 0.1, 0.9), params)
    >>> state = opt.init({k: v.asnumpy() for k, v in params.items()})
    """
    kind = type(opt).__name__
    if not is_mindspore_optimizer(opt):
        raise ArgumentError(
            f"from_mindspore(optimizer=...) must be a MindSpore nn.Optimizer; got "
            f"{kind}.")
    if kind not in SUPPORTED or type(opt).__module__.split(".")[:3] != ["mindspore", "nn",
                                                                       "optim"]:
        raise ArgumentError(
            f"MindSpore optimizer {type(opt).__module__}.{kind} is not one fshard "
            f"translates (nn.{', nn.'.join(SUPPORTED)}).\nFix: use one of those, or the "
            "equivalent fs.optim optimizer (docs/optim.md), e.g. "
            "fs.AutoParallel(net, fs.optim.adam(1e-3)).")
    done = int(np.asarray(opt.global_step.asnumpy()).reshape(-1)[0])
    if done:
        _refuse(opt, f"it has already taken {done} steps (its step count and moments are "
                "MindSpore's state, not carried over)", "create the optimizer afresh for "
                "the fshard training.")
    by_id = {id(p): n for n, p in params.items()}
    entries = _per_parameter(opt)
    missing = [p.name for p, *_ in entries if id(p) not in by_id]
    if missing:
        raise ArgumentError(
            f"MindSpore optimizer nn.{kind} updates Parameters that are not the network's: "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}.\nFix: build the optimizer "
            "over this network's parameters (net.trainable_params()).")
    # One fs.optim optimizer per group of parameters sharing a learning rate and a
    # weight decay (the same lr object: a group's schedule is evaluated once per step).
    groups: dict = {}
    for p, lr, wd, flag in entries:
        g = groups.setdefault((id(lr), wd), {"lr": lr, "wd": wd, "names": [], "mask": {}})
        g["names"].append(by_id[id(p)])
        g["mask"][by_id[id(p)]] = flag
    rules = [(g["names"], _rule(opt, _lr_schedule(opt, g["lr"]), g["wd"], g["mask"]))
             for g in groups.values()]
    scale = float(loss_scale) / float(opt.loss_scale)
    if scale != 1.0:  # MindSpore's scale_grad (the weight decay is not scaled)
        rules = [(names, optim.chain(optim.scale(scale), r)) for names, r in rules]
    held = {n for names, _ in rules for n in names}

    def pick(d, names):
        return None if d is None else {n: d[n] for n in names}

    def init(values):
        _check_names(opt, values, held)
        return tuple(r.init(pick(values, names)) for names, r in rules)

    def update(grads, state, values=None):
        _check_names(opt, grads, held)
        new, updates = [], {}
        for (names, r), s in zip(rules, state, strict=True):
            u, s = r.update(pick(grads, names), s, pick(values, names))
            updates.update(u)
            new.append(s)
        # a parameter the optimizer does not hold is not trained
        out = {n: updates[n] if n in updates else g * 0 for n, g in grads.items()}
        return out, tuple(new)

    return optim.Optimizer(init, update)


def _check_names(opt, values, held: set) -> None:
    if not isinstance(values, dict) or not held <= set(values):
        got = sorted(values) if isinstance(values, dict) else type(values).__name__
        raise ArgumentError(
            f"MindSpore optimizer nn.{type(opt).__name__} (as an fs.optim optimizer) takes "
            f"a dict holding its parameters {sorted(held)[:5]}...; got {got}.\nFix: pass the "
            "network's parameters by name (fs.functional(cell)[1]).")

