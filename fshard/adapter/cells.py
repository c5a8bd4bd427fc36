"""Using ``nn.Cell``s functionally: parameters become an explicit pytree input.

``fs.functional(cell)`` returns ``(apply, params)`` where ``params`` is a dict keyed
by parameter name (``'dense1.weight'``) and ``apply(params, *args)`` runs the Cell
with those values in place of its Parameters (NB: ``torch.func.functional_call``).
Transforms given a Cell call ``apply`` with the Cell's current parameters at every
call, so updates to the Cell are always seen.
"""

from __future__ import annotations

import contextlib
import inspect

from fshard.backend.mindspore import (
    cell_first_call_checks,
    cell_param_tuple,
    cell_param_tuples,
    cell_params,
    set_cell_param_tuple,
)
from fshard.core.tracing import Tracer
from fshard.primitives.structural import stop_gradient


def is_cell(obj) -> bool:
    from mindspore import nn

    return isinstance(obj, nn.Cell)


def pipeline_wrapper(cell):
    """``(network, micro_size)`` for MindSpore's pipeline wrappers (``nn.PipelineCell``,
    ``mindspore.parallel.nn.Pipeline``), whose ``stage_config`` has set the sub-cells'
    ``pipeline_stage`` already; None for any other Cell. (Their ``construct`` adds
    the micro-batch losses; a pipeline of ``fs.AutoParallel`` runs the wrapped network
    instead, so the loss is the batch's.)"""
    from mindspore import nn
    from mindspore.parallel import nn as parallel_nn

    if isinstance(cell, (nn.PipelineCell, parallel_nn.PipelineCell)):
        return cell.network, cell.micro_size
    return None


def segmented(cell) -> list:
    """Names of the sub-cells given a ``pipeline_segment`` (``segment_config``)."""
    return [n for n, c in cell.cells_and_names()
            if c.__dict__.get("_pipeline_segment") is not None]


def parameters(cell) -> dict:
    """The Cell's parameters as ``{name: Parameter}`` in definition order (MindSpore's
    ``parameters_and_names``, which also holds while a transform has swapped traced
    values in for them: a Cell annotated by ``cell.shard`` inside a traced network)."""
    out, seen = {}, set()
    for prefix, c in cell.cells_and_names():
        for leaf, p in cell_params(c).items():
            inited = getattr(p, "inited_param", None) if not isinstance(p, Tracer) else None
            p = p if inited is None else inited
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out[f"{prefix}.{leaf}" if prefix else leaf] = p
    return out


def _locations(cell) -> dict:
    """``{name: [(owner, slot), ...]}``: every place each parameter is stored; a slot
    is a leaf name, or ``(tuple name, index)`` inside a ``ParameterTuple``.

    ``parameters_and_names`` lists a Parameter shared by several sub-cells (tied
    weights) once, under its first name; swapping it there alone would leave the
    other uses reading the old Parameter, so every slot holding it is found. A
    ``ParameterTuple`` attribute (``nn.LSTM``'s ``w_ih_list``) holds its Parameters a
    second time, and ``construct`` reads them there."""
    slots: dict[int, list] = {}
    for _, c in [("", cell)] + list(cell.cells_and_names()):
        held = list(cell_params(c).items()) + [
            ((group, k), p) for group, members in cell_param_tuples(c).items()
            for k, p in enumerate(members)]
        for slot, p in held:
            if p is not None and (c, slot) not in slots.setdefault(id(p), []):
                slots[id(p)].append((c, slot))
    return {name: slots[id(p)] for name, p in parameters(cell).items()}


def _swap(owner, slot, value):
    """Put ``value`` in ``slot`` of ``owner``; returns what was there."""
    if isinstance(slot, str):
        old, cell_params(owner)[slot] = cell_params(owner)[slot], value
        return old
    group, k = slot  # a ParameterTuple: swapped whole, as a plain tuple
    members = list(cell_param_tuple(owner, group))
    old, members[k] = members[k], value
    set_cell_param_tuple(owner, group, tuple(members))
    return old


@contextlib.contextmanager
def swapped(cell, values: dict):
    """Temporarily replace the Cell's parameters by ``values`` (restored on exit)."""
    _first_call_checks(cell)
    where = _locations(cell)
    saved = []
    originals = {(id(owner), group): (owner, group, members)
                 for owner in {id(o): o for slots in where.values() for o, _ in slots}.values()
                 for group, members in cell_param_tuples(owner).items()}
    try:
        for name, v in values.items():
            for owner, slot in where[name]:
                saved.append((owner, slot, _swap(owner, slot, v)))
        yield
    finally:
        for owner, slot, old in reversed(saved):
            if isinstance(slot, str):
                _swap(owner, slot, old)
        for owner, group, members in originals.values():  # the ParameterTuples themselves
            set_cell_param_tuple(owner, group, members)


def _first_call_checks(cell) -> None:
    """Run MindSpore's once-per-Cell checks (parameter names, lazy initialisation) on
    the real Parameters, before any are swapped for plain Tensors or tracers: the
    checks read ``Parameter.name``, which a Tensor lacks."""
    cell_first_call_checks(cell)


def frozen(cell) -> set:
    """Names of the Cell's Parameters with ``requires_grad=False`` (MindSpore trains
    only ``trainable_params()``)."""
    # (a traced value swapped in by an enclosing transform was frozen there, if at all)
    return {n for n, p in parameters(cell).items() if getattr(p, "requires_grad", True) is False}


def functional(cell):
    """``(apply, params)`` for a Cell.

    >>> import fshard as fs
    >>> from mindspore import nn
    >>> apply, params = fs.functional(nn.Dense(3, 2))
    >>> sorted(params)
    ['bias', 'weight']

    A Parameter with ``requires_grad=False`` is frozen, as in MindSpore: ``apply``
    reads it through ``fs.stop_gradient`` (its gradient is zero and never computed),
    and ``params`` may leave it out (``apply`` then uses the Cell's own value), so
    ``{k: v for k, v in params.items() if v.requires_grad}`` is MindSpore's
    ``trainable_params()``.
    """
    names = list(parameters(cell))

    def apply(params, *args, **kwargs):
        fixed = frozen(cell)
        missing = [n for n in names if n not in params and n not in fixed]
        if missing:
            from fshard.errors import ArgumentError

            raise ArgumentError(
                f"apply(params, ...) for {type(cell).__name__}: params is missing "
                f"{missing}; expected the keys {names} (those with requires_grad=False "
                "may be left out).")
        values = {n: stop_gradient(params[n]) if n in fixed else params[n]
                  for n in names if n in params}
        with swapped(cell, values):
            return cell(*args, **kwargs)

    apply.__name__ = type(cell).__name__
    try:  # errors name an input by construct's parameter names
        sig = inspect.signature(cell.construct)
        apply.__signature__ = sig.replace(parameters=[inspect.Parameter(
            "params", inspect.Parameter.POSITIONAL_OR_KEYWORD), *sig.parameters.values()])
    except (TypeError, ValueError):
        pass
    return apply, {n: p for n, p in parameters(cell).items()}


def maybe_cell(fun, transform):
    """Apply ``transform`` to ``fun``; for a Cell, to its functional form, calling it
    with the Cell's current parameters."""
    if not is_cell(fun):
        return transform(fun)
    cell = fun
    apply, _ = functional(cell)
    # The caller passes construct's arguments; fshard supplies the first (the Cell's
    # parameters), so errors count the caller's arguments from 0.
    apply.supplied_args = 1
    inner = transform(apply)

    def call(*args, **kwargs):
        return inner(parameters(cell), *args, **kwargs)

    call.__name__ = type(cell).__name__
    call.inner = inner
    if hasattr(inner, "lower"):
        call.lower = lambda *a, **k: inner.lower(parameters(cell), *a, **k)
    if hasattr(inner, "set_inputs"):  # the parameters (argument 0) keep their shapes
        def set_inputs(*specs):
            inner.set_inputs(None, *specs)
            return call

        call.set_inputs = set_inputs
    return call
