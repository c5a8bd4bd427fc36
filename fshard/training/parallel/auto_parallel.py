"""``fs.AutoParallel``: MindSpore's interface over a training step, on fshard's ``shard``.

One train step (loss, gradients, optimizer update) is one sharded, compiled program:

    step(params, opt_state, step, *batch) -> (TrainState(params', opt_state', step + 1), loss)

``AutoParallel`` writes the strategies of that step from its configuration and hands
it to ``fs.jit(fs.shard(step, ...))``:

- the batch: ``dataset_strategy("data_parallel")`` splits every batch input along its
  first dimension over all devices (in a multi-process job each process passes its
  own slice), ``"full_batch"`` keeps it whole, or one strategy per batch input;
- the parameters: whole (data parallel) unless ``parameter_plan`` gives a strategy,
  or, in ``"sharding_propagation"`` and ``"recursive_programming"`` modes, left to
  the plan;
- the rest of the step: in ``"semi_auto"`` mode, as MindSpore's semi-auto parallel,
  an operator without a strategy follows the layouts of its inputs (from the batch
  split, the parameters' and the operators' strategies, each equation communicating
  as late as it can: ``fshard.sharding.search.follow_inputs``, no search), so a
  data-parallel step is one AllReduce per gradient and one for the loss and the batch
  is never gathered; ``"sharding_propagation"`` mode plans the parameters too, by
  greedy propagation; ``"recursive_programming"`` mode by ``fs.shard``'s
  whole-program search (``search=True``); both price a plan by its time
  (``level=2``: the flops each device computes at the backend's measured rate plus
  each collective as the backend runs it);
- ZeRO (``hsdp``): the optimizer state (level1), also the gradients (level2: the
  backward reduce-scatters each to the state's layout where it is complete) and the
  parameters (level3: gathered where used) are split along their first dimension over
  the data-parallel group, except tensors smaller than ``threshold`` KB or not
  divisible;
- ``comm_fusion``: the per-device program's AllReduces are bucketed by size or, in
  mode ``"index"``, by gradient index ranges, and with ``"reducescatter"`` its
  reduce-scatters by their own size (``fshard.primitives.passes.fuse_allreduces``);
  with ``"allgather"`` its AllGathers (``fshard.primitives.passes.fuse_allgathers``).

fshard differentiates the global loss, so gradients are exact whatever the layouts:
there is no per-device loss to average (``enable_gradients_mean`` and
``disable_loss_repeated_mean`` are accepted: MindSpore's results with them are fshard's
gradients). The seed's knobs that only configure Ascend's graph compiler raise an
error that says so; none is accepted and ignored.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
from typing import Any, NamedTuple

import numpy as np

from fshard.core import context, tree
from fshard.meshes import distributed
from fshard.backend.mindspore import Tensor, as_tensor, auto_parallel_settings
from fshard.adapter.cells import frozen, functional, is_cell, pipeline_wrapper, segmented
from fshard.core.tracing import (ArrayType, EvalTrace, Symbol, Tracer, current_trace,
                                 typeof)
from fshard.core.dims import dim_div, dim_multiple_of
from fshard.errors import ArgumentError, ShapeError, ShardingError
from fshard.adapter.interop import check_context_mode, context_dataset_strategy, context_mesh
from fshard.core.ir import Program
from fshard.meshes.layout import block_index as strategy_block
from fshard.meshes.mesh import Mesh, context_key, resolve_mesh
from fshard.training.optim import Optimizer, apply_updates
from fshard.training.parallel.ms_optimizers import from_mindspore, is_mindspore_optimizer
from fshard.training.parallel.options import (Hsdp, ParallelMode, ParallelOptions,
                                              parse_comm_fusion)
from fshard.training.parallel.pipeline import PipelineRunner, check_pipeline_args
from fshard.training.parallel.schedule import Schedule
from fshard.primitives.passes import fuse_allgathers, fuse_allreduces, reduce_in_float32
from fshard.primitives import collectives as C
from fshard.primitives.control import custom_vjp
from fshard.primitives.spmd import layout_constraint_p
from fshard.sharding.cost import local_bytes
from fshard.sharding.explain import explain as explain_plan
from fshard.sharding.layouts import Sharding
from fshard.sharding.local import ShardedArray, gather_sharded
from fshard.sharding.plan import write_json_atomic
from fshard.core.staging import fun_name
from fshard.transforms.ad import value_and_grad
from fshard.transforms.control_flow import scan
from fshard.transforms.jit import ParameterChanged, bind_declared, declared_types, jit
from fshard.sharding.local_batch import (block_index, global_declared, global_type,
                                         rebalance, rows_differ_error,
                                         slice_check_seconds, slice_rows, to_global)
from fshard.transforms.shard import cell_parameter_plans, cells_with_parameter_plans, shard
from fshard.sharding.user_layouts import with_sharding_constraint

#: How each mode plans what no strategy fixes (``fs.shard``'s ``search``):
_SEARCH = {
    # MindSpore's semi-auto parallel: an operator without a strategy follows its
    # inputs (data parallel over the batch split), planned by no search.
    ParallelMode.SEMI_AUTO: "follow_inputs",
    # Greedy propagation, or the plan that follows the inputs where the objective
    # prices it lower (it can gather activations data parallelism never needs).
    ParallelMode.SHARDING_PROPAGATION: "cheaper_path",
    # fshard's search over the whole step.
    ParallelMode.RECURSIVE_PROGRAMMING: True,
}


class TrainState(NamedTuple):
    """What a train step carries: ``params``, ``opt_state`` and ``step`` (an int32
    scalar), each a pytree (as laid out on the devices by the plan)."""

    params: Any
    opt_state: Any
    step: Any


def _refuse(knob: str, why: str):
    raise ArgumentError(f"AutoParallel.{knob}(): {why}")


def _signature(x) -> tuple:
    """``(shape, dtype)`` of a step argument's leaf, on every step's path: a Tensor (the
    state's leaves) reads its own, in a fraction of ``typeof``'s time."""
    if type(x) is Tensor:
        return x.shape, x.dtype
    a = typeof(x)
    return tuple(a.shape), a.dtype


def _call_signature(x) -> tuple:
    """A leaf's part of ``__call__``'s key: a process's block of a split leaf (an
    ``fs.ShardedArray``, as a job's step returns it) runs another program than the
    whole leaf of the same global type."""
    if type(x) is ShardedArray:
        return x.shape, x.dtype, x.sharding, x.mesh
    return _signature(x)


@functools.lru_cache(maxsize=None)
def _planned(update):
    """``update`` run with ``context.plan_updates`` set (one function per ``update``:
    the pipelines share their update programs by it)."""
    def planned(*args, **kwargs):
        with context.setting(context.plan_updates, True):
            return update(*args, **kwargs)

    planned.__name__ = getattr(update, "__name__", "update")
    return planned


class _JobStep(NamedTuple):
    """A job's step on the hot path: its compiled program, and whether each call first
    checks that every process passes slices of the same shapes."""
    compiled: Any
    slices: bool


class AutoParallel:
    """A training step, sharded and compiled (MindSpore's ``AutoParallel``).

    >>> import numpy as np, fshard as fs
    >>> def loss(p, x, y):
    ...     return ((x @ p["w"] - y) ** 2).mean()
    >>> ap = fs.AutoParallel(loss, fs.optim.sgd(0.1), mesh=2)
    >>> state = ap.init({"w": np.zeros((3, 1), np.float32)})
    >>> x, y = np.ones((4, 3), np.float32), np.ones((4, 1), np.float32)
    >>> state, l = ap(state, x, y)
    >>> float(l.asnumpy()), int(state.step.asnumpy())
    (1.0, 1)

    Args:
        network: ``loss_fn(params, *batch) -> loss`` (a float scalar; ``(loss, aux)``
            with ``has_aux=True``), or an ``nn.Cell`` whose ``construct(*batch)``
            returns the loss (its Parameters are the params, as ``fs.functional``;
            those with ``requires_grad=False`` are frozen: never differentiated or
            updated), or MindSpore's ``Pipeline(cell, micro_size, stage_config)``
            wrapper (the stages and micro-batch count of ``pipeline(stages=S)``).
        optimizer: an ``fs.optim`` optimizer (``init(params)``, ``update(grads, state,
            params)``), a MindSpore ``nn.Optimizer`` over the Cell's Parameters
            (``nn.SGD``, ``nn.Momentum``, ``nn.Adam``, ``nn.AdamWeightDecay``: translated
            into the equal ``fs.optim`` rule), or None (MindSpore's
            ``AutoParallel(network, parallel_mode=...)``: the optimizer comes with
            ``fs.Model(network=ap, optimizer=...)``). A string here is the
            ``parallel_mode``, as in MindSpore's signature.
        parallel_mode: ``"semi_auto"`` (the strategies given; an operator without one
            follows its inputs' layouts: data parallel over the batch split),
            ``"sharding_propagation"`` (propagation derives the rest, the parameters
            too), or ``"recursive_programming"`` (the whole step planned by fshard's
            search); or the ``fs.parallel.ParallelMode`` member of that name.
        mesh: an ``fs.Mesh``, a device count, or None (the default mesh).
        has_aux: ``network`` returns ``(loss, aux)``.
        in_shapes: declared shapes of the batch inputs (``set_inputs``), for batches
            of varying size run by one compiled step.
    """

    def __init__(self, network, optimizer=None,
                 parallel_mode: ParallelMode | str = ParallelMode.SEMI_AUTO, *,
                 mesh=None, has_aux: bool = False, in_shapes=None):
        if not callable(network):
            raise ArgumentError(
                f"AutoParallel(network=...) must be a loss function or an nn.Cell; got "
                f"{type(network).__name__} {network!r}.")
        if isinstance(optimizer, str) and \
                ParallelMode.parse(parallel_mode) is ParallelMode.SEMI_AUTO:
            # MindSpore's signature: AutoParallel(network, parallel_mode="semi_auto")
            optimizer, parallel_mode = None, optimizer
        options = ParallelOptions(mode=parallel_mode)
        if isinstance(mesh, bool) or not (mesh is None or isinstance(mesh, (int, Mesh))):
            raise ArgumentError(
                f"AutoParallel(mesh=...) must be an fs.Mesh, a device count or None; got "
                f"{mesh!r}.")
        if isinstance(mesh, int) and mesh < 1:
            raise ArgumentError(
                f"AutoParallel(mesh=...): a device count must be >= 1; got {mesh}.\nFix: "
                "mesh=2 for two devices, an fs.Mesh, or None for the default mesh (the "
                "job's processes, or FSHARD_DEVICES virtual devices).")
        # MindSpore's Pipeline(net, micro_size, stage_config): its stage_config marked
        # the stages on the sub-cells; the step runs the wrapped network (the wrapper's
        # construct would add the micro-batch losses), micro_size micro-batches.
        self._micro_size = None
        wrapped = pipeline_wrapper(network) if is_cell(network) else None
        if wrapped is not None:
            network, self._micro_size = wrapped
            if segmented(network):
                raise ArgumentError(
                    f"AutoParallel(network=Pipeline(...)): segment_config (pipeline_segment "
                    f"on {segmented(network)}) names MindSpore's interleaved segments, "
                    "which fshard derives itself.\nFix: drop segment_config and use "
                    "ap.pipeline(stages=S, interleave=True) with stage_config giving "
                    "each cell its chunk.")
        self._steps: dict = {}
        # a repeated call's fast key -> its jitted step (__call__): emptied with _steps
        self._calls: dict = {}
        self._frozen_opt = None  # (frozen names, optimizer, step_optimizer()) cache
        self._set_network(network, has_aux)
        self._set_optimizer(optimizer)
        self._options = options
        self._mesh = mesh
        self._fixed_params = None  # loaded parameter strategies
        self._fixed_only_trainable = False  # the loaded file lists trainable ones only
        self._pipeline = None  # a PipelineRunner once pipeline(stages > 1) is set
        self._batch_specs = None  # declared batch input shapes (set_inputs)
        # Files MindSpore writes when the step is first compiled: kind ("param",
        # "operator", "groups") -> path, each written once after it is set.
        self._files: dict = {}
        self._only_trainable = True  # MindSpore's default for the parameter strategy file
        if in_shapes is not None:
            if not isinstance(in_shapes, (tuple, list)):
                raise ArgumentError(
                    f"AutoParallel(in_shapes=...) must be a tuple with one entry per batch "
                    f"input, got {type(in_shapes).__name__} {in_shapes!r}.\nFix: in_shapes="
                    "(fs.ArrayType((fs.Symbol(divisor=8), 784), mindspore.float32), ...).")
            self.set_inputs(*in_shapes)

    def _set_network(self, network, has_aux: bool, output=None) -> None:
        """Train ``network`` (MindSpore's ``Model`` adds its ``loss_fn`` to the Cell
        given: fshard's ``Model`` sets the network with the loss here); ``output``, if
        given, maps the network's output to the step's loss (``fs.Model``: a loss with
        ``reduction="none"`` is differentiated by its sum, as MindSpore's
        ``TrainOneStepCell`` does)."""
        self.cell = network if is_cell(network) else None
        self.loss_fn = functional(network)[0] if self.cell is not None else network
        self.name = fun_name(self.loss_fn)
        if self.cell is not None:
            # the parameter_plan of a cell.shard(...) on one of its Cells is part of
            # the step's plan (_given_plan): there the Cell applies only its layouts
            self.loss_fn = _planning_cells(self.loss_fn, self.cell)
        if output is not None:
            apply = self.loss_fn
            self.loss_fn = lambda params, *batch: output(apply(params, *batch))
            self.loss_fn.__name__ = self.name
        self.has_aux = has_aux
        self._frozen_opt = None
        self._forget_steps()

    def _set_optimizer(self, optimizer, loss_scale: float = 1.0) -> None:
        """An ``fs.optim`` optimizer, a MindSpore ``nn.Optimizer`` over the Cell's
        Parameters (translated: ``fshard.training.parallel.ms_optimizers``; ``loss_scale``: the
        gradients' scale, MindSpore's ``Model(loss_scale_manager=...)``), or None (given
        later by ``Model(network=ap, optimizer=...)``)."""
        # kept to translate again if fs.Model gives the network another loss (names)
        self._ms_optimizer = optimizer if is_mindspore_optimizer(optimizer) else None
        if is_mindspore_optimizer(optimizer):
            if self.cell is None:
                raise ArgumentError(
                    f"AutoParallel(optimizer=nn.{type(optimizer).__name__}(...)): a "
                    "MindSpore optimizer updates a Cell's Parameters, but the network is "
                    f"a function ({self.name}).\nFix: pass the nn.Cell, or an fs.optim "
                    "optimizer (e.g. fs.optim.sgd(1e-2)).")
            optimizer = from_mindspore(optimizer, functional(self.cell)[1], loss_scale)
        elif optimizer is not None and not (hasattr(optimizer, "init") and
                                            hasattr(optimizer, "update")):
            raise ArgumentError(
                f"AutoParallel(optimizer=...) must have init(params) and update(grads, "
                f"state, params), as fs.optim optimizers do, or be a MindSpore "
                f"nn.Optimizer; got {type(optimizer).__name__}."
                "\nFix: pass e.g. fs.optim.adam(1e-3) or nn.Adam(net.trainable_params()).")
        self.optimizer = optimizer
        self._frozen_opt = None
        self._forget_steps()

    def _forget_steps(self) -> None:
        """Drop the compiled steps (the configuration they were planned for changed)."""
        self._steps.clear()
        self._calls.clear()

    def _need_optimizer(self) -> None:
        if self.optimizer is None:
            raise ArgumentError(
                f"AutoParallel({self.name}) has no optimizer: it was made without one "
                "(MindSpore's form, where the optimizer comes with Model).\nFix: "
                "fs.AutoParallel(network, optimizer, ...), or train with fshard's "
                "Model(network=ap, optimizer=...) (fs.Model).")

    # -- the options -----------------------------------------------------------------
    @property
    def options(self) -> ParallelOptions:
        """The configuration, checked (``fs.parallel.ParallelOptions``, frozen): the
        constructor's ``parallel_mode`` and what the methods below set."""
        return self._options

    def _configure(self, **changes) -> "AutoParallel":
        """New options with ``changes`` (checked: on an error nothing changes); the
        compiled steps are made again."""
        self._options = self._options.replace(**changes)
        self._forget_steps()
        return self

    @property
    def parallel_mode(self) -> ParallelMode:
        """The ``ParallelMode`` (equal to its string: ``ap.parallel_mode ==
        "semi_auto"``)."""
        return self._options.mode

    @parallel_mode.setter
    def parallel_mode(self, mode) -> None:
        self._configure(mode=mode)

    # -- the mesh and MindSpore's context ------------------------------------------
    @property
    def mesh(self):
        """The mesh given (None: the default mesh), or ``device_num`` devices when
        ``ms.set_auto_parallel_context(device_num=...)`` set it (checked against a
        given mesh)."""
        return context_mesh(self._mesh, f"AutoParallel({self.name})")

    @property
    def _dataset(self):
        """The dataset strategy: ``dataset_strategy(config)``'s, else the one
        ``ms.set_auto_parallel_context(dataset_strategy=... / full_batch=...)`` set,
        else "data_parallel" (MindSpore's default)."""
        if self._options.dataset_strategy is not None:
            return self._options.dataset_strategy
        return context_dataset_strategy(f"AutoParallel({self.name})",
                                        allow_tuple=True) or "data_parallel"

    @property
    def n_devices(self) -> int:
        if isinstance(self.mesh, int):
            return self.mesh
        return resolve_mesh(self.mesh).size

    # -- configuration (seed 001's names) -----------------------------------------
    def dataset_strategy(self, config) -> "AutoParallel":
        """``"data_parallel"`` (default: each batch input split along dim 0 over all
        devices), ``"full_batch"`` (whole), or a tuple with one strategy per batch
        input (tuples of split counts or ``fs.Layout`` views)."""
        if config is None:  # (None in the options means "not given")
            raise ArgumentError(
                "AutoParallel.dataset_strategy(config): config must be 'data_parallel', "
                "'full_batch' or a tuple of per-input strategies; got None.\nFix: "
                "dataset_strategy('data_parallel'), MindSpore's default.")
        return self._configure(dataset_strategy=config)

    def parameter_plan(self, plan: dict) -> "AutoParallel":
        """Strategies for parameters, by name (``'dense1.weight'`` for a Cell, the key
        path such as ``"['w1']"`` or ``'w1'`` for a dict of parameters)."""
        return self._configure(parameter_plan=plan)

    def hsdp(self, shard_size: int = -1, threshold: int = 64,
             optimizer_level: str = "level1") -> "AutoParallel":
        """ZeRO over each parameter's data-parallel group (MindSpore's meaning: the
        devices that hold the same copy of that parameter; for a parameter split ``P``
        ways on ``N`` devices, ``N / P`` of them): ``level1`` splits the optimizer
        state, ``level2`` also the gradients, ``level3`` also the parameters, along
        their first dimension (on top of the parameter's own split), over that group
        or, with ``shard_size=k``, over groups of ``gcd(k, N / P)`` devices; tensors
        under ``threshold`` KB or whose first dimension does not divide stay as they
        are. Example: dp x mp = 2 x 4 and a weight split ``(1, 4)``: its Adam moments
        are ``(2, 4)``, an eighth per device."""
        return self._configure(hsdp=Hsdp(shard_size, threshold, optimizer_level))

    def comm_fusion(self, config: dict) -> "AutoParallel":
        """Bucket the per-device program's collectives: ``{"allreduce": {"mode": "auto"
        | "size", "config": MB}}`` ("auto": 64 MB buckets, ``config`` None; "size":
        ``config`` MB) for the AllReduces, ``{"allreduce": {"mode": "index", "config":
        [i, j]}}`` for one AllReduce of gradients ``0..i-1``, one of ``i..j-1`` and one
        of ``j..`` (the gradients in the order of ``tree.leaves(state.params)``), the
        same "auto"/"size" entries under ``"allgather"`` for ZeRO's AllGathers and
        ``"reducescatter"`` for its reduce-scatters (on CPU an AllReduce whose result
        only this device's block is read of), or ``{"openstate": False}`` to turn
        fusion off. The keys and values are MindSpore's (``AutoParallel.comm_fusion``),
        checked as MindSpore checks them."""
        return self._configure(fusion_given=True, **parse_comm_fusion(config))

    def enable_gradients_mean(self) -> "AutoParallel":
        """Accepted: MindSpore then averages the per-device gradients, which gives the
        gradients of the whole batch's mean loss; fshard differentiates the global loss,
        so its gradients are those already (a mean if the loss is a mean)."""
        return self

    def disable_loss_repeated_mean(self) -> "AutoParallel":
        """Accepted: MindSpore then stops dividing the gradients of a loss computed
        repeatedly (on several devices of a model-parallel group) by the repeat count;
        fshard computes the global loss once, so its gradients are the whole batch's
        either way."""
        return self

    def no_init_parameters_in_compile(self) -> "AutoParallel":
        """Accepted: MindSpore then leaves the weights uninitialised while it compiles.
        fshard's compilation never initialises them either (it traces types, not
        values): Parameters made under ``no_init_parameters()`` are initialised by
        ``init()`` (``fs.Model``: before its first step), which the step needs."""
        return self

    def transformer_opt(self, file_path) -> "AutoParallel":
        """MindSpore's parallel speed-up JSON (``parallel_speed_up.json``): None or
        ``""`` turns it off, as in MindSpore. A file whose options are all off
        (``false`` / ``0``) is accepted; an option turned on is an ArgumentError naming
        it: each reorders, overlaps or fuses communication in MindSpore's Ascend graph
        compiler, which fshard's programs do not go through (its speed options are
        ``comm_fusion`` and the plan itself)."""
        where = f"AutoParallel({self.name}).transformer_opt(file_path)"
        if file_path is None or file_path == "":
            return self
        if not isinstance(file_path, (str, os.PathLike)):
            raise ArgumentError(
                f"{where}: file_path must be the path of a JSON file (str), None or ''; "
                f"got {type(file_path).__name__} {file_path!r}.\nFix: pass the path of "
                "parallel_speed_up.json, or None.")
        try:
            with open(file_path) as fh:
                config = json.load(fh)
        except (OSError, ValueError) as e:
            raise ArgumentError(
                f"{where}: cannot read {os.fspath(file_path)!r} as JSON ({e}).\nFix: pass "
                "the path of a JSON object of MindSpore's speed-up options.") from e
        if not isinstance(config, dict):
            raise ArgumentError(
                f"{where}: {os.fspath(file_path)!r} holds a JSON "
                f"{type(config).__name__}, not an object of options.\nFix: "
                '{"grad_matmul_communication_overlap": false, ...}.')
        unknown = sorted(set(config) - set(SPEEDUP_OPTIONS))
        on = sorted(k for k, v in config.items() if k in SPEEDUP_OPTIONS and v)
        if unknown or on:
            raise ArgumentError(
                f"{where}: {os.fspath(file_path)!r} "
                + (f"names unknown options {unknown} (MindSpore's are "
                   f"{list(SPEEDUP_OPTIONS)})" if unknown else "")
                + ("; it " if unknown and on else "")
                + (f"turns on {on}, which fshard does not implement: each reorders, "
                   "overlaps or fuses communication in MindSpore's Ascend graph compiler, "
                   "which fshard's programs do not go through" if on else "")
                + ".\nFix: drop transformer_opt (or set those options false); fshard's "
                "own speed options are comm_fusion and the parallel plan.")
        return self

    def enable_fp32_communication(self) -> "AutoParallel":
        """Reduce collectives (AllReduce, ReduceScatter) of float16 values run in
        float32: cast up, reduce, cast back (``fshard.primitives.passes.reduce_in_float32``), so a
        sum over many devices rounds once instead of at every partial sum."""
        return self._configure(fp32_communication=True)

    def disable_gradient_fp32_sync(self) -> "AutoParallel":
        """Reduce float16 values in float16. By default (MindSpore's gradient fp32
        sync) a step's float16 reductions run in float32; fshard's step is one program
        in which a gradient's reduction is not told apart from another, so this applies
        to every reduction of the step, unless ``enable_fp32_communication()`` asks for
        float32 communication everywhere."""
        return self._configure(gradient_fp32_sync=False)

    def print_local_norm(self) -> "AutoParallel":
        """At every step print the L2 norm of each block of each gradient, the blocks
        being the parameter's layout (at ZeRO level2 and above, the optimizer state's),
        as ``local_norm: step 3 w1 block (0, 1): 0.0123`` (process 0 of a job)."""
        return self._configure(print_local_norm=True)

    def dump_local_norm(self, file_path) -> "AutoParallel":
        """As ``print_local_norm``, written to ``file_path/local_norm_rank<r>.jsonl`` (one
        JSON line per step: ``{"step": 3, "norms": {"w1": [[...], ...]}}``, each value an
        array of block norms shaped like the split counts) instead of printed."""
        if file_path is None:  # (None in the options means "not dumped")
            raise ArgumentError(
                "AutoParallel.dump_local_norm(file_path): file_path must be a directory "
                "path; got NoneType None.\nFix: a str or pathlib.Path naming a directory.")
        return self._configure(dump_local_norm=file_path)

    def enable_device_local_norm(self) -> "AutoParallel":
        """With ``print_local_norm()`` or ``dump_local_norm(path)``, also report each
        device's local norm: the L2 norm of all the gradient blocks that device holds
        (the blocks of the local norms), as ``device_local_norm: step 3 device 1:
        0.0456`` and as ``"device_norms": {"0": ..., "1": ...}`` in the dumped line
        (every device of a virtual mesh; a job's process its own)."""
        return self._configure(device_local_norm=True)

    def pipeline(self, stages: int = 1, output_broadcast: bool = False, interleave: bool = False,
                 scheduler: str = "1f1b", *, micro_batches: int | None = None,
                 max_imbalance: float | None = 8.0) -> "AutoParallel":
        """Pipeline parallelism (docs/pipeline.md): the devices split into ``stages``
        groups, each batch into ``micro_batches`` (default: ``stages``) whose gradients
        are summed before one optimizer update, run in the ``scheduler``'s order
        (``"1f1b"`` or ``"gpipe"``); ``interleave`` gives each stage several model
        chunks; ``output_broadcast`` sends the loss to every stage. ``stages=1`` turns
        it off. The loss marks its stages with ``fs.pipeline_split`` (or Cells'
        ``pipeline_stage``). A ``PipelineBalanceWarning`` tells when one stage's
        estimated cost exceeds ``max_imbalance`` times another's (None: no check)."""
        if self._micro_size is not None and micro_batches is not None and \
                micro_batches != self._micro_size and stages != 1:
            raise ArgumentError(
                f"AutoParallel.pipeline(micro_batches={micro_batches}): the network is "
                f"MindSpore's Pipeline(..., micro_size={self._micro_size}), which sets the "
                "micro-batch count.\nFix: drop micro_batches, or make the two agree.")
        if micro_batches is None and isinstance(stages, int):
            micro_batches = stages if self._micro_size is None or stages == 1 \
                else self._micro_size
        cfg = check_pipeline_args(stages, micro_batches, scheduler, interleave,
                                  output_broadcast, self.n_devices, max_imbalance)
        if stages == 1 and micro_batches != 1:
            raise ArgumentError(
                f"AutoParallel.pipeline(stages=1) turns the pipeline off, so "
                f"micro_batches={micro_batches} would be ignored.\nFix: stages >= 2 for a "
                "pipeline, or drop micro_batches.")
        k = self._options.gradient_accumulation
        if stages != 1 and k > 1:
            raise ArgumentError(
                f"AutoParallel({self.name}).pipeline(stages={stages}): "
                f"gradient_accumulation({k}) is set, and a pipeline accumulates the "
                "gradients of its own micro-batches.\nFix: drop gradient_accumulation "
                f"(ap.gradient_accumulation(1)) and use ap.pipeline(stages, "
                f"micro_batches={k * (micro_batches or 1)}) alone.")
        self._pipeline = None if stages == 1 else PipelineRunner(self, cfg, TrainState)
        return self

    def gather_params(self, state: TrainState):
        """The trained parameters, whole, on every process (a collective: every process
        calls it): in a multi-process job a split parameter is each process's block
        (``fs.ShardedArray``); this collects them. With a pipeline whose update is split
        by stage each process keeps its own stage's (the others are ``fs.RemoteArray``):
        this brings every stage's to every process."""
        if self._pipeline is None:
            return gather_sharded(state.params)
        return self._pipeline.gather_params(state)

    def pipeline_schedule(self, virtual_stages: int | None = None) -> Schedule:
        """The pipeline's schedule: ``.actions(stage)`` the ordered actions of a stage,
        ``.timeline()`` their simulated timing (bubble, peak activations, pictures)."""
        if self._pipeline is None:
            raise ArgumentError(
                f"AutoParallel({self.name}).pipeline_schedule(): no pipeline is configured."
                "\nFix: call ap.pipeline(stages=S, micro_batches=M) first.")
        return self._pipeline.schedule(virtual_stages)

    def pipeline_stage_costs(self) -> list:
        """Each pipeline stage's estimated forward cost (flops on one micro-batch of one
        device, from the sharding cost model), known after the first step."""
        if self._pipeline is None:
            raise ArgumentError(
                f"AutoParallel({self.name}).pipeline_stage_costs(): no pipeline is "
                "configured.\nFix: call ap.pipeline(stages=S, micro_batches=M) first.")
        return self._pipeline.stage_costs()

    # -- gradient accumulation ------------------------------------------------------
    def gradient_accumulation(self, k: int) -> "AutoParallel":
        """Each step splits its batch into ``k`` micro-batches (along dimension 0),
        sums their gradients in a loop and makes one optimizer update with their mean
        (MindSpore's ``GradAccumulation``; optax's ``MultiSteps`` over one call). The
        loss is the mean of the micro-batches' losses: for a mean loss, the step equals
        the step on the whole batch, with the activations of one micro-batch alive at a
        time. Under data parallelism each device's micro-batch is a slice of its own
        rows, and the gradients stay per-device sums through the loop: reduced once
        per update, not per micro-step. With ``has_aux`` the aux is stacked over the
        micro-batches. ``k=1`` turns it off. Returns ``self``."""
        options = self._options.replace(gradient_accumulation=k)  # checks k
        if self._pipeline is not None and k > 1:
            raise ArgumentError(
                f"AutoParallel({self.name}).gradient_accumulation({k}): a pipeline already "
                "accumulates the gradients of its micro-batches.\nFix: use "
                "ap.pipeline(stages, micro_batches=...) alone.")
        self._options = options
        self._forget_steps()
        return self

    def _value_and_grad(self, loss_fn, params, batch):
        """``(loss, grads)`` of ``loss_fn(params, *batch)`` for one step: of the whole
        batch, or with ``gradient_accumulation(k)`` the mean over ``k`` micro-batches
        (a loop)."""
        vg = value_and_grad(loss_fn, has_aux=self.has_aux)
        k = self._options.gradient_accumulation
        if k == 1:
            return vg(params, *batch)
        dp = self.n_devices if self._dataset == "data_parallel" else 1
        micro = tuple(tree.map(lambda x, n=(st[0] if _is_counts(st) and st else dp):
                               self._micro_batches(x, n, k), b)
                      for b, st in zip(batch, self._batch_strategies(batch)))
        box = {}

        def body(carry, mb):
            acc, loss_sum = carry
            out, grads = vg(params, *mb)
            loss, aux = (out[0], out[1]) if self.has_aux else (out, ())
            box["dtype"] = typeof(loss).dtype
            acc = tree.map(lambda a, g: a + g, acc, grads)
            if typeof(loss).dtype != typeof(loss_sum).dtype:
                loss = loss.astype(np.float32)
            return (acc, loss_sum + loss), aux

        zeros = tree.map(lambda p: np.zeros(typeof(p).shape, _np_dtype(typeof(p).dtype)),
                         params)
        (acc, loss_sum), auxs = scan(body, (zeros, np.float32(0.0)), micro)
        grads = tree.map(lambda a: a / float(k), acc)
        if self._splits_gradients():
            paths, leaves, spec = tree.flatten_with_path(params)
            strategies = [self._base(p, x) for p, x in zip(paths, leaves)]
            strategies = [None if b is None else self._zero(x, "level2", b)
                          for b, x in zip(strategies, leaves)]
            grads = with_sharding_constraint(grads, tree.unflatten(spec, strategies))
        loss = (loss_sum / float(k)).astype(box["dtype"])
        return ((loss, auxs) if self.has_aux else loss), grads

    def _micro_batches(self, x, n: int, k: int):
        """``x`` (batch first) as ``(k, batch / k, ...)``: micro-batch ``j`` takes the
        ``j``-th slice of each of the ``n`` row blocks the batch strategy splits
        dimension 0 into, so each device keeps its own rows (no communication)."""
        a = typeof(x)
        b = a.shape[0] if a.ndim else None
        if b is None or not dim_multiple_of(b, n * k):  # (a declared Symbol: provably)
            raise ArgumentError(
                f"AutoParallel({self.name}).gradient_accumulation({k}): a batch input is "
                f"{a}, but its dimension 0 must split into {k} micro-batches"
                + (f" on each of the {n} row blocks of its strategy" if n > 1 else "")
                + f" (a multiple of {n * k}).\nFix: use a batch size divisible by {n * k}, "
                "or another k.")
        rest = tuple(a.shape[1:])
        x = x.reshape((n, k, dim_div(b, n * k)) + rest)
        x = x.transpose((1, 0, 2) + tuple(range(3, 3 + len(rest))))
        return x.reshape((k, dim_div(b, k)) + rest)

    # -- the train state -----------------------------------------------------------
    def init(self, params=None) -> TrainState:
        """The train state for ``params`` (for a Cell: its current parameters)."""
        if params is None:
            if self.cell is None:
                raise ArgumentError(
                    f"AutoParallel({self.name}).init(params): params is required for a "
                    "loss function (only a Cell has its own).")
            _initialise(self.cell)
            params = {k: v for k, v in functional(self.cell)[1].items()}
        import mindspore as ms

        from fshard.backend.mindspore import as_tensor

        params = tree.map(lambda x: x if isinstance(x, ms.Tensor) else as_tensor(x), params)
        # Parameters become plain Tensors: the state is values, not the Cell's objects.
        params = tree.map(lambda x: ms.Tensor(x.asnumpy()) if isinstance(x, ms.Parameter)
                          else x, params)
        self._need_optimizer()
        opt_state = self.optimizer.init(_without(params, self._frozen()))
        return TrainState(params, opt_state, ms.Tensor(np.int32(0)))

    def _frozen(self) -> set:
        """Names of the Cell's parameters with ``requires_grad=False``: kept in the
        state, never differentiated or updated, without optimizer state."""
        return frozen(self.cell) if self.cell is not None else set()

    def step_optimizer(self):
        """The optimizer over the whole ``params`` of the state: the given one, or, if
        the Cell has frozen parameters, one that applies it to the others and leaves
        the frozen ones unchanged (the pipeline's update uses it)."""
        fixed = self._frozen()
        if not fixed:
            return Optimizer(self.optimizer.init, _planned(self.optimizer.update))
        hit = self._frozen_opt
        if hit is not None and hit[0] == fixed and hit[1] is self.optimizer:
            return hit[2]
        inner = self.optimizer

        def init(params):
            return inner.init(_without(params, fixed))

        def update(grads, state, params=None):
            updates, state = inner.update(_without(grads, fixed), state,
                                          None if params is None else _without(params, fixed))
            zero = {k: g * 0 for k, g in grads.items() if k in fixed}
            return {k: updates[k] if k in updates else zero[k] for k in grads}, state

        opt = Optimizer(init, _planned(update))
        self._frozen_opt = (fixed, inner, opt)
        return opt

    # -- strategies ----------------------------------------------------------------
    def _group(self, base: tuple) -> int:
        """The ZeRO group of a tensor split ``base`` ways: its data-parallel group, the
        devices holding the same copy of it (``n / prod(base)``, ``n`` the devices
        that hold it: all of them, or with a pipeline its stage's), limited to
        ``shard_size`` (the largest group dividing both)."""
        n = self.n_devices
        stages = 1 if self._pipeline is None else self._pipeline.cfg.stages
        n //= stages
        if self._options.hsdp is None:
            return 1
        size = self._options.hsdp.shard_size
        if size != -1 and n % size:
            where = f"the {n} devices" if stages == 1 else (
                f"the {n} devices of a pipeline stage ({self.n_devices} devices / "
                f"{stages} stages)")
            raise ShardingError(
                f"AutoParallel.hsdp(shard_size={size}) must divide {where}.\nFix: "
                f"shard_size one of {[d for d in range(1, n + 1) if n % d == 0]}, or -1 "
                "(each parameter's whole data-parallel group).")
        replicas = n // int(np.prod(base, dtype=np.int64)) if len(base) else n
        return replicas if size == -1 else math.gcd(size, replicas)

    def _zero(self, x, level_needed: str, base=None):
        """The ZeRO strategy of a leaf at ``level_needed`` (None: not at this level):
        ``base`` (the leaf's split counts without ZeRO; default whole) with its first
        dimension further split over the leaf's data-parallel group."""
        hsdp = self._options.hsdp
        if hsdp is None or not hsdp.reaches(level_needed):
            return None
        a = typeof(x)
        if a.ndim == 0:
            return None
        base = tuple(base) if base is not None else self._whole(x)
        g = self._group(base)
        nbytes = a.size * np.dtype(_np_dtype(a.dtype)).itemsize
        if g == 1 or a.shape[0] % (base[0] * g) or nbytes < hsdp.threshold_bytes:
            return None
        return (base[0] * g,) + base[1:]

    def _pipeline_zero(self, state: TrainState, blocks: bool = False):
        """ZeRO's split counts for a pipelined step (each over its stage's devices, see
        ``_group``), or None if nothing is split: per parameter leaf its own (level3)
        and its gradient's (level2), per optimizer-state leaf its own (level1); None
        for a leaf kept whole. ``blocks``: the stages are sharded (``parameter_plan``),
        so a leaf ZeRO leaves alone keeps its tensor-parallel block, the split counts
        of its parameter's strategy, as without a pipeline (a parameter, its gradient
        and the state that copies it: Adam's moments)."""
        if self._options.hsdp is None and not blocks:
            return None

        def counts(x, level, base):
            split = self._zero(x, level, base)
            if split is None and blocks and base and any(c > 1 for c in base):
                return tuple(base)
            return split

        paths, leaves, _ = tree.flatten_with_path(state.params)
        bases = [self._base(p, x) for p, x in zip(paths, leaves)]
        params = [None if b is None else counts(x, "level3", b)
                  for b, x in zip(bases, leaves)]
        grads = [None if b is None else counts(x, "level2", b)
                 for b, x in zip(bases, leaves)]
        fixed = self._frozen()
        trainable = _without(state.params, fixed)
        bases = self._state_bases(state.opt_state, trainable)
        opt = [None if base is False else counts(x, "level1", base)
               for x, (base, _) in zip(tree.leaves(state.opt_state), bases, strict=True)]
        if not any(c is not None for c in params + grads + opt):
            return None
        return params, grads, opt

    def _base(self, path, x):
        """A parameter's split counts without ZeRO: its given strategy, or whole; None
        for a strategy given as an ``fs.Layout`` view (ZeRO leaves it as given)."""
        given = self._param_strategy(path, x)
        if given is None:
            return self._whole(x)
        return tuple(given) if _is_counts(given) else None

    def _whole(self, x):
        return (1,) * typeof(x).ndim

    def _all_whole(self, state: TrainState, p_sh, o_sh) -> bool:
        """Every parameter, and every optimizer-state leaf that copies one (Adam's
        moments), has the strategy whole (semi_auto without a parameter plan, ZeRO or a
        strategy file): the update's leaves all have one layout."""
        def whole(s, x):
            return isinstance(s, tuple) and len(s) == typeof(x).ndim and all(
                c == 1 for c in s)

        # (a strategy is a tuple: read the strategy trees down to the state's leaves)
        params = tree.leaves(state.params)
        p_leaves = tree.structure(state.params).flatten_up_to(p_sh)
        if not all(map(whole, p_leaves, params)):
            return False
        trainable = _without(state.params, self._frozen())
        bases = self._state_bases(state.opt_state, trainable)
        o_leaves = tree.structure(state.opt_state).flatten_up_to(o_sh)
        return all(base is False or whole(s, x) for s, x, (base, _) in
                   zip(o_leaves, tree.leaves(state.opt_state), bases, strict=True))

    def _param_strategies(self, params):
        paths, leaves, spec = tree.flatten_with_path(params)
        if self._fixed_params is not None:
            names = {_name(p) for p in paths}
            if self._fixed_only_trainable:  # the file lists the trainable ones
                names -= self._frozen()
            if set(self._fixed_params) != names:
                raise ShardingError(
                    f"AutoParallel({self.name}): the parameter strategy file "
                    f"{self._param_file!r} was written for other parameters: it has "
                    f"{sorted(set(self._fixed_params) - names)[:5]} that the params lack "
                    f"and lacks {sorted(names - set(self._fixed_params))[:5]}.\nFix: load "
                    "the file saved by a run of the same model.")
        out = []
        for p, x in zip(paths, leaves):
            given = self._param_strategy(p, x)
            base = self._base(p, x)
            if base is not None:
                given = self._zero(x, "level3", base) or given
            if given is None:
                given = self._whole(x) if self.parallel_mode is ParallelMode.SEMI_AUTO \
                    else None
            out.append(given)
        return tree.unflatten(spec, out)

    def _check_param_plan(self, params) -> None:
        """Every name in ``parameter_plan`` names a parameter of ``params`` (a typo
        would otherwise leave that parameter unsplit without a word)."""
        paths = tree.flatten_with_path(params)[0]
        names = {_name(p) for p in paths} | {tree.keystr(p) for p in paths}
        self._given_plan()  # (a conflict with a cell.shard's parameter_plan: an error)
        unknown = [k for k in self._options.parameter_plan if k not in names]
        if unknown:
            known = sorted(_name(p) for p in paths)
            raise ArgumentError(
                f"AutoParallel({self.name}).parameter_plan names {unknown}, which "
                f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} of "
                f"the model; its parameters are {known[:12]}"
                f"{' ...' if len(known) > 12 else ''}.\nFix: use those names (a Cell's "
                "'dense1.weight', a dict's key 'w1' or key path \"['w1']\").")

    def _given_plan(self) -> dict:
        """``parameter_plan(...)``'s strategies and those of every
        ``cell.shard(..., parameter_plan=...)`` on a Cell of the network (as in
        MindSpore, one plan), by parameter name. A parameter given different
        strategies by the two is an ArgumentError naming both."""
        plan = dict(self._options.parameter_plan)
        if self.cell is None:
            return plan
        for name, (where, strategy) in cell_parameter_plans(self.cell).items():
            keys = [k for k in (name, tree.keystr((name,))) if k in plan]
            for k in keys:
                if _strategy_key(plan[k]) != _strategy_key(strategy):
                    raise ArgumentError(
                        f"AutoParallel({self.name}): the parameter {name!r} has two "
                        f"strategies: parameter_plan({{{k!r}: {plan[k]!r}}}) and "
                        f"{where} on a Cell of the network.\nFix: give it one strategy, "
                        "in one of the two places.")
            if not keys:
                plan[name] = strategy
        return plan

    def _param_strategy(self, path, x):
        """The strategy given for a parameter (parameter_plan, a loaded file), or None."""
        name = _name(path)
        plan = self._given_plan()
        given = plan.get(name, plan.get(tree.keystr(path)))
        if self._fixed_params is not None and name in self._fixed_params:
            given = tuple(self._fixed_params[name])
        return given

    def _state_strategies(self, opt_state, params):
        """Each optimizer-state leaf that is a copy of a parameter (Adam's moments, a
        momentum) is laid out like that parameter, split further by ZeRO over its
        data-parallel group; the others (a step count) whole or by ZeRO alone. In the
        modes that plan parameters, a copy of a parameter without a strategy is left to
        the plan too."""
        leaves, spec = tree.flatten(opt_state)
        bases = self._state_bases(opt_state, params)
        out = []
        for x, (base, given) in zip(leaves, bases, strict=True):
            s = None if base is False else self._zero(x, "level1", base)
            if s is None and base is not False and (
                    given or self.parallel_mode is ParallelMode.SEMI_AUTO):
                s = base or self._whole(x)
            out.append(s)
        return tree.unflatten(spec, out)

    def _state_copies(self, state: TrainState) -> list:
        """``(state leaf, parameter leaf)`` per optimizer-state leaf that copies a
        parameter (Adam's moments, a momentum), as indices into the leaves of
        ``(params, opt_state)``: left to the plan, a copy takes its parameter's layout."""
        paths = tree.flatten_with_path(state.params)[0]
        index = {tree.keystr(p): k for k, p in enumerate(paths)}
        trainable = _without(state.params, self._frozen())
        own = [index[tree.keystr(p)] for p in tree.flatten_with_path(trainable)[0]]
        p_spec = tree.flatten(trainable)[1]
        shapes = [tuple(typeof(x).shape) for x in tree.leaves(trainable)]

        def is_copy(t) -> bool:
            leaves, spec = tree.flatten(t)
            return spec == p_spec and [tuple(typeof(x).shape) for x in leaves] == shapes

        out, k = [], len(paths)
        for item in tree.flatten(state.opt_state, is_leaf=is_copy)[0]:
            if is_copy(item):
                out += [(k + j, p) for j, p in enumerate(own)]
                k += len(own)
            else:
                k += 1
        return out

    def _state_bases(self, opt_state, params) -> list:
        """Per optimizer-state leaf, ``(base, given)``: the split counts of the
        parameter it copies (False if that parameter's strategy is an ``fs.Layout``
        view; None if it copies none) and whether that strategy was given. A copy is a
        subtree with the structure and shapes of ``params``."""
        paths, p_leaves, p_spec = tree.flatten_with_path(params)
        shapes = [tuple(typeof(x).shape) for x in p_leaves]
        bases = [(False if self._base(p, x) is None else self._base(p, x),
                  self._param_strategy(p, x) is not None) for p, x in zip(paths, p_leaves)]

        def is_copy(t) -> bool:
            leaves, spec = tree.flatten(t)
            return spec == p_spec and [tuple(typeof(x).shape) for x in leaves] == shapes

        out: list = []
        for item in tree.flatten(opt_state, is_leaf=is_copy)[0]:
            out.extend(bases if is_copy(item) else [(None, False)])
        return out

    def _batch_strategies(self, batch):
        if isinstance(self._dataset, tuple):
            if len(self._dataset) != len(batch):
                raise ArgumentError(
                    f"AutoParallel({self.name}).dataset_strategy has "
                    f"{len(self._dataset)} entries but the step got {len(batch)} batch "
                    "inputs.\nFix: one strategy per batch input.")
            return list(self._dataset)
        if self._dataset == "full_batch":
            return [tree.map(self._whole, b) if self.parallel_mode is ParallelMode.SEMI_AUTO
                    else None for b in batch]
        n = self.n_devices

        def split(x):
            a = typeof(x)
            if a.ndim == 0 or not dim_multiple_of(a.shape[0], n):
                raise ShardingError(
                    f"AutoParallel({self.name}): dataset_strategy('data_parallel') splits "
                    f"every batch input along dimension 0 over the {n} devices, but a batch "
                    f"input is {a}.\nFix: use a batch size divisible by {n}, or "
                    "dataset_strategy('full_batch') / per-input strategies.")
            return (n,) + (1,) * (a.ndim - 1)

        return [tree.map(split, b) for b in batch]

    def set_inputs(self, *batch_specs) -> "AutoParallel":
        """Declare the batch inputs' shapes (MindSpore's ``set_inputs``): one entry per
        batch input, an ``fs.ArrayType`` or a placeholder ``Tensor(shape=[s0, ...],
        dtype=...)`` with ``fs.Symbol`` dimensions, or None. Every batch the Symbols
        accept then runs one step, partitioned and compiled once; a batch dimension the
        dataset strategy splits must be provably divisible by its split count
        (``Symbol(divisor=8)`` on 8 devices). Returns ``self``."""
        self._batch_specs = declared_types(batch_specs, f"AutoParallel({self.name}).set_inputs")
        self._forget_steps()
        return self

    # -- the step ------------------------------------------------------------------
    def _step_fn(self, grad_vars: list, whole: bool = False):
        """The step; while ``fs.shard`` stages it, the Vars of the gradients are noted
        in ``grad_vars`` (for ``memory_report``). ``whole``: the strategies keep every
        parameter and optimizer-state copy of one whole on every device, so the update
        may concatenate small leaves (``context.whole_updates``)."""
        loss_fn, opt, has_aux = self.loss_fn, self.optimizer, self.has_aux
        fixed = self._frozen()

        norms = self._local_norms if self._options.local_norm else None

        def train_step(params, opt_state, step, *batch):
            # Frozen parameters (requires_grad=False) are read, not differentiated, and
            # the optimizer never sees them (MindSpore's trainable_params()).
            trainable = _without(params, fixed)

            def loss_of(t, *b):
                t = self._reduce_scatter_points(t)
                return loss_fn({**params, **t} if fixed else t, *b)

            # An fs.shard called in the loss fixes layouts there (semi-auto parallel).
            with context.counted(context.shard_annotations):
                out, grads = self._value_and_grad(loss_of, trainable, batch)
            grad_vars[:] = [getattr(g, "ir_var", None) for g in tree.leaves(grads)]
            with context.setting(context.whole_updates, whole), \
                    context.setting(context.plan_updates, True):
                updates, new_opt_state = opt.update(grads, opt_state, trainable)
            new_t = apply_updates(trainable, updates)
            new_p = {k: new_t.get(k, v) for k, v in params.items()} if fixed else new_t
            new = TrainState(new_p, new_opt_state, step + 1)
            if norms is None:
                return new, out
            return new, out, norms(trainable, grads)

        train_step.__name__ = f"train_step_{self.name}"
        return train_step

    def _fuse_allreduces(self, grad_vars: list, part) -> Program:
        """The per-device program of ``part`` with its AllReduces and reduce-scatters
        bucketed as ``comm_fusion`` says. In mode "index" a gradient's AllReduce is the
        one moving its Var (or the value a layout constraint turns into it, ZeRO's
        reduce-scatter point), found through ``part.origins``."""
        opts = self._options
        points = opts.fusion_split_points
        report: list = []
        if points is None:
            program = fuse_allreduces(part.program, opts.fusion_bytes,
                                      opts.scatter_fusion_bytes, report=report)
            part.fused = tuple(report)
            return program
        if opts.gradient_accumulation > 1:
            raise ArgumentError(
                f"AutoParallel({self.name}).comm_fusion(config): allreduce mode 'index' "
                "cannot be combined with gradient_accumulation(k) yet (the accumulated "
                "gradients' AllReduces are not matched to gradient indices).\nFix: mode "
                "'auto' or 'size', or gradient_accumulation(1).")
        n = sum(g is not None for g in grad_vars)
        if points[-1] >= n:
            raise ArgumentError(
                f"AutoParallel({self.name}).comm_fusion(config): allreduce mode 'index' "
                f"split point {points[-1]} is past the last gradient (this step has {n} "
                f"gradients, indices 0..{n - 1}).\nFix: split points below {n}, in the "
                "order of tree.leaves(state.params).")
        producer = {v: eq for eq in part.prop.program.equations for v in eq.outputs}
        index_of = {}
        for i, g in enumerate(grad_vars):
            while g is not None and g not in index_of:
                index_of[g] = i
                eq = producer.get(g)
                g = eq.inputs[0] if eq is not None and eq.prim is layout_constraint_p \
                    else None

        def group_of(eq):
            i = index_of.get(part.origins.get(eq.outputs[0]))
            return None if i is None else bisect.bisect_right(points, i)

        program = fuse_allreduces(part.program, None, opts.scatter_fusion_bytes, group_of,
                                  report)
        part.fused = tuple(report)
        return program

    def _splits_gradients(self) -> bool:
        hsdp = self._options.hsdp
        return hsdp is not None and hsdp.reaches("level2")

    def _reduce_scatter_points(self, params):
        """From ZeRO level2, ``params`` with each parameter that ZeRO splits passed
        through an identity whose derivative lays its gradient out as the optimizer
        state (``fs.with_sharding_constraint`` in a ``custom_vjp``): the backward
        reduce-scatters each gradient right where it is complete (on CPU, which has
        no ReduceScatter, an AllReduce whose whole result dies at once in this
        device's slice), so a device keeps only its block of every reduced gradient,
        where level1 keeps the whole gradients until the update. With
        ``gradient_accumulation`` the micro-batches' sums are reduced once, after the
        loop (``_value_and_grad``)."""
        if not self._splits_gradients() or self._options.gradient_accumulation > 1:
            return params
        paths, leaves, spec = tree.flatten_with_path(params)
        out = []
        for p, x in zip(paths, leaves):
            base = self._base(p, x)
            s = None if base is None else self._zero(x, "level2", base)
            out.append(x if s is None else _scatter_gradient(s)(x))
        return tree.unflatten(spec, out)

    def _norm_counts(self, path, x) -> tuple:
        """The split counts cutting a parameter's gradient into the blocks whose norms
        are reported: the parameter's strategy (at ZeRO level2 and above, the
        optimizer state's), or whole."""
        base = self._base(path, x)
        return (base is not None and self._zero(x, "level2", base)) or (
            base or self._whole(x))

    def _local_norms(self, params, grads) -> dict:
        """Per parameter name, the L2 norms of its gradient's blocks: the gradient cut
        by ``_norm_counts``, an array shaped like the split counts."""
        paths, leaves, _ = tree.flatten_with_path(params)
        out = {}
        for p, x, g in zip(paths, leaves, tree.leaves(grads), strict=True):
            counts = self._norm_counts(p, x)
            shape = typeof(g).shape
            split = [v for d, c in zip(shape, counts) for v in (c, d // c)]
            squares = (g * g).reshape(tuple(split)) if shape else g * g
            out[_name(p)] = squares.sum(axis=tuple(range(1, len(split), 2))) ** 0.5 \
                if shape else squares ** 0.5
        return out

    def _device_norms(self, params, values: dict) -> list:
        """Per device (every device of a virtual mesh; this process's in a job), the
        L2 norm of all the gradient blocks it holds: each parameter's block of that
        device under its split counts (MindSpore's device matrix for a strategy). With a
        pipeline the counts describe a stage's ``n / S`` devices (stage-major ranks):
        device ``r`` holds the block of its index ``r % (n / S)`` in its stage."""
        n = self.n_devices
        group = n if self._pipeline is None else n // self._pipeline.cfg.stages
        counts = {_name(p): self._norm_counts(p, x)
                  for p, x in zip(*tree.flatten_with_path(params)[:2])}
        ranks = [distributed.rank()] if self._in_job() else range(n)
        out = []
        for r in ranks:
            total = 0.0
            for k, v in values.items():
                a = np.asarray(v, np.float64)
                block = strategy_block(counts[k], r % group, group) if a.ndim else ()
                total += float(a[block]) ** 2
            out.append(math.sqrt(total))
        return out

    def _report_norms(self, state, norms: dict) -> None:
        shown, path = self._options.print_local_norm, self._options.dump_local_norm
        step = int(state.step.asnumpy())
        values = {k: np.asarray(v.asnumpy()).tolist() for k, v in norms.items()}
        record = {"step": step, "norms": values}
        if self._options.device_local_norm:
            devices = self._device_norms(_without(state.params, self._frozen()), values)
            first = distributed.rank() if self._in_job() else 0
            record["device_norms"] = {str(first + i): v for i, v in enumerate(devices)}
        if path is not None:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, f"local_norm_rank{distributed.rank()}.jsonl"),
                      "a") as fh:
                fh.write(json.dumps(record) + "\n")
        if shown and distributed.rank() == 0:
            for k, v in values.items():
                a = np.asarray(v)
                for idx in np.ndindex(a.shape):
                    print(f"local_norm: step {step} {k} block {idx}: {a[idx]:.6g}", flush=True)
            for d, v in record.get("device_norms", {}).items():
                print(f"device_local_norm: step {step} device {d}: {v:.6g}", flush=True)

    def _feeds_slices(self) -> bool:
        """Each process passes its own slice of the batch: ``data_parallel`` in a
        multi-process job."""
        return self._dataset == "data_parallel" and self._in_job()

    def _in_job(self) -> bool:
        """The devices are the processes of a multi-process job."""
        if isinstance(self.mesh, int):
            return distributed.is_initialized()
        return not resolve_mesh(self.mesh).is_virtual

    def _plan_batch(self, batch) -> tuple:
        """The batch as the plan sees it: global types when each process passes its
        slice (``N`` slices of ``b`` rows make a global batch of ``N * b``)."""
        if not self._feeds_slices():
            # declared: planned by its declaration
            return batch if self._batch_specs is None else self._declared_batch(batch)
        if self._batch_specs is not None:
            self._check_declared_slices(batch)
        return self._global_batch(batch)

    def _global_batch(self, batch) -> tuple:
        """The global batch that equal slices ``batch`` make: its declared types when
        the slices are declared (one plan and one program for every slice size), unless
        the global batch is not one the declaration accepts (the even blocks of an uneven
        last batch: 16 + 8 rows on 2 processes declared ``Symbol(divisor=8)`` make 24,
        which the global ``Symbol(divisor=16)`` refuses: planned for its size); else
        the global types of these slices."""
        n = self.n_devices
        glob = tuple(tree.map(lambda x: global_type(x, n), b) for b in batch)
        specs = self._global_specs()
        if specs is not None and len(specs) <= len(batch):
            avals, values = [], []
            for spec, g in zip(specs, glob):
                if spec is not None:
                    avals += tree.leaves(spec)
                    values += tree.leaves(g)
            try:
                bind_declared(f"AutoParallel({self.name})", "global batch array", avals,
                              values)
            except ShapeError:
                return glob
            return self._declared_batch(glob, specs)
        return glob

    def _global_specs(self) -> tuple | None:
        """The declared types of the global batch when each process passes its declared
        slice (None: no declaration, or one whose first dimension's Symbol is also
        another dimension; ``local_batch.global_declared``), made once per device count
        so that its Symbols are the same objects at every call."""
        if self._batch_specs is None or not self._feeds_slices():
            return None
        n = self.n_devices
        cached = getattr(self, "_global_specs_for", None)
        if cached is None or cached[0] is not self._batch_specs or cached[1] != n:
            cached = self._global_specs_for = (
                self._batch_specs, n, global_declared(self._batch_specs, n))
        return cached[2]

    def sharded(self, state: TrainState, *batch):
        """The ``fs.shard``-ed step for these arguments (``partitioned(...)`` shows the
        per-device program)."""
        self._check_state(state, ".sharded(state, *batch)")
        return self._sharded(state, self._plan_batch(batch))

    def _check_state(self, state, call: str) -> None:
        if not isinstance(state, TrainState):
            raise ArgumentError(
                f"AutoParallel({self.name}){call}: state must be the TrainState from "
                f"ap.init(params); got {type(state).__name__}.\nFix: pass the state that "
                "ap.init(...) or the previous step returned.")

    def _sharded(self, state: TrainState, batch):
        if self._pipeline is not None:
            raise ArgumentError(
                f"AutoParallel({self.name}): with a pipeline the step is not one sharded "
                "program, so partitioned(), explain(), sharded() and state_strategies() "
                "are not available.\nFix: inspect the pipeline with pipeline_schedule(), "
                "memory_report(state, *batch) and save_operator_strategy_file(path, state, "
                "*batch); call pipeline(stages=1) to turn it off.")
        check_context_mode(self.parallel_mode.value, f"AutoParallel({self.name})")
        # (the dataset strategy and the mesh may come from MindSpore's context)
        key = (tree.structure(state), tuple(map(_signature, tree.leaves((state, batch)))),
               repr(self._dataset), self.n_devices)
        hit = self._steps.get(key)
        if hit is not None:
            return hit
        self._check_param_plan(state.params)
        p_sh = self._param_strategies(state.params)
        o_sh = self._state_strategies(state.opt_state, _without(state.params, self._frozen()))
        b_sh = self._batch_strategies(batch)
        in_strategy = (p_sh, o_sh, ()) + tuple(b_sh)
        out_strategy = (TrainState(p_sh, o_sh, ()), None) + (
            (None,) if self._options.local_norm else ())
        grad_vars: list = []
        # level 2: the plan that takes the least time (compute at the backend's flops
        # rate plus each collective as the backend runs it), not the fewest bytes.
        whole = self._all_whole(state, p_sh, o_sh)
        s = shard(self._step_fn(grad_vars, whole), in_strategy=in_strategy,
                  out_strategy=out_strategy,
                  mesh=self.mesh, level=2, dataset_strategy="full_batch",
                  search=False)
        s.search = _SEARCH[self.parallel_mode]  # (fs.shard's own argument takes a bool)
        # (comm_fusion not called: None, in a job buckets by the job's rates; turned off:
        # False, none)
        s.comm_fusion = functools.partial(self._fuse_allreduces, grad_vars) if any(
            v is not None for v in (self._options.fusion_bytes,
                                    self._options.fusion_split_points,
                                    self._options.scatter_fusion_bytes)) else (
            False if self._options.fusion_given else None)
        # The new state is the next step's state: its leaves keep their devices.
        s.carried = len(tree.leaves((state.params, state.opt_state, state.step)))
        s.copies = self._state_copies(state)
        # In a job the split leaves of the new state stay each process's blocks
        # (fs.ShardedArray): the next step takes them as they are, so ZeRO's and model
        # parallelism's memory saving is real and no step gathers the state.
        s.gather_outputs = not self._in_job()
        if self._options.fp32_reductions:
            s.passes = (reduce_in_float32,)
        gathers = self._options.gather_fusion_bytes
        if gathers is not None:  # comm_fusion({"allgather": ...})
            s.passes += (functools.partial(fuse_allgathers, bucket_bytes=gathers),)
        s.grad_vars = grad_vars
        s.batch_places = {}  # batch signature -> this process's blocks (_place_slices)
        s.state_splits = {}  # state signature -> its split leaves (_place_state)
        operator_file = getattr(self, "_operator_file", None)
        if operator_file is not None:
            s.load_strategies(operator_file)
        # a declared batch: one program for every size its Symbols accept (with slices,
        # the global batch's declaration, unless this batch is not one it accepts)
        specs = self._global_specs() if self._feeds_slices() else self._batch_specs
        if specs is not None and self._feeds_slices() and not any(
                isinstance(d, Symbol) for a in tree.leaves(batch) for d in a.shape):
            specs = None
        entry = (s, jit(s) if specs is None else
                 jit(s, in_shapes=(None, None, None) + tuple(specs)))
        self._steps[key] = entry
        return entry

    def __call__(self, state: TrainState, *batch):
        """One train step: ``(new state, loss)`` (``(new state, (loss, aux))`` with
        ``has_aux``). In a multi-process job with ``dataset_strategy("data_parallel")``
        each process passes its own slice of the batch (process ``r`` of ``N``: rows
        ``[r * b, (r + 1) * b)`` of the global batch)."""
        self._check_state(state, "(state, *batch)")
        self._need_optimizer()
        if self._options.device_local_norm and not self._options.local_norm:
            raise ArgumentError(
                f"AutoParallel({self.name}): enable_device_local_norm() adds each "
                "device's gradient norm to the local norms, but neither print_local_norm() "
                "nor dump_local_norm(path) is set.\nFix: call one of them too.")
        if self._files:
            self._write_files(state, batch)
        if self._pipeline is not None:
            result = self._pipeline(state, *batch)
            if len(result) == 3:  # print_local_norm / dump_local_norm
                self._report_norms(result[0], result[2])
            return result[0], result[1]
        # The hot path: a call with the structure, shapes and dtypes of an earlier one,
        # under the same MindSpore context (parallel mode, dataset strategy, device_num)
        # and the same mesh, runs the step the checks below chose for that call: one
        # flatten and one dict lookup instead of re-reading the context four times and
        # keying _steps. In a job it is taken where that call had nothing to place (the
        # state the previous step returned, slices of the planned size), after the
        # check that every process passes slices of the same shapes.
        leaves, spec = tree.flatten((state, batch))
        key = (spec, tuple([(x.shape, x.dtype) if type(x) is Tensor else _call_signature(x)
                            for x in leaves]),
               tuple(auto_parallel_settings().values()), context_key(),
               distributed.is_initialized())
        try:
            compiled = self._calls.get(key)
        except TypeError:  # a context dataset strategy of MindSpore Layouts: unhashable
            compiled, key = None, None
        if compiled is not None and type(current_trace()) is EvalTrace:
            # the step's compiled program, on the leaves flattened above (a TrainState
            # flattens as (params, opt_state, step): the leaves of the step's arguments);
            # traced (a loop of steps under fs.jit), the step's fs.jit inlines it instead
            checked = batch
            if type(compiled) is _JobStep:
                if compiled.slices:  # (every process enters it: one AllGather)
                    checked = self._even_slices(batch)
                compiled = compiled.compiled
            if checked is not batch:  # uneven slices: this call's even blocks
                result = self._first_call(None, state, checked, checked=True)
            else:
                try:
                    result = compiled.call_leaves(leaves)
                except ParameterChanged:  # a Parameter the loss reads changed: trace again
                    del self._calls[key]
                    result = self._first_call(key, state, batch, checked=True)
        else:
            result = self._first_call(key, state, batch)
        if len(result) == 3:  # print_local_norm / dump_local_norm
            self._report_norms(result[0], result[2])
        return result[0], result[1]

    def _first_call(self, key, state: TrainState, batch, checked: bool = False) -> tuple:
        """A call of a new signature (or in a job, one with something to place): the
        checks, the plan and the step; the step's compiled program is kept under ``key``
        (None: not kept). ``checked``: the slices were checked (``_even_slices``)."""
        in_job = self._in_job()
        slices = self._feeds_slices()
        given = batch
        if slices:
            if not checked:
                batch = self._even_slices(batch)
            plan_batch = self._global_batch(batch)
        else:
            plan_batch = batch if self._batch_specs is None else \
                self._declared_batch(batch)
        s, step = self._sharded(state, plan_batch)
        placed = state
        if in_job:
            placed = self._place_state(state, s, plan_batch)
        args = (placed.params, placed.opt_state, placed.step,
                *(self._place_slices(placed, batch, s, plan_batch) if slices else batch))
        result = step(*args)
        # In a job the hot path passes the state and the slices as they come: kept only
        # when this call's were already what the step takes (the state as a step
        # returns it, each slice this process's block as it is)
        if key is not None and (not in_job or (placed is state and batch is given and (
                not slices or all(type(x) is ShardedArray for x in tree.leaves(args[3:]))))):
            compiled = step.compiled_for(*args)
            if compiled is not None:
                self._calls[key] = _JobStep(compiled, slices) if in_job else compiled
        return result

    def gather(self, state):
        """``state`` with every ``fs.ShardedArray`` leaf (in a multi-process job, a
        process's block of a split parameter or optimizer state) replaced by its global
        value: a collective, so every process must call it. On a virtual mesh the state
        is global already and comes back as it is. With a pipeline in a job whose update
        is split by stage, every stage's leaves (``fs.RemoteArray`` on the processes of
        other stages) come to every process."""
        if self._pipeline is not None:
            return self._pipeline.gather(state)
        return gather_sharded(state)

    def _declared_batch(self, batch, specs=None) -> tuple:
        """The batch with each declared input replaced by its declared type (``specs``:
        the declaration, ``set_inputs``'s unless given)."""
        specs = self._batch_specs if specs is None else specs
        if len(specs) > len(batch):
            raise ArgumentError(
                f"AutoParallel({self.name}) declares {len(specs)} batch inputs "
                f"with set_inputs, but the step got {len(batch)}.\nFix: pass every "
                "declared batch input.")
        specs = list(specs) + [None] * (len(batch) - len(specs))
        return tuple(b if sp is None else sp for b, sp in zip(batch, specs))

    def _check_declared_slices(self, batch, rank: str = "") -> None:
        """With ``dataset_strategy('data_parallel')`` in a multi-process job the
        declaration is of what each process passes, its slice (MindSpore's
        ``set_inputs`` declares the dataset's per-device batch there): each call's
        slices are checked against it. The step is planned for the global batch of
        each slice size it meets (its Symbols scaled by the process count would not
        be the declared ones)."""
        avals, values = [], []
        for k, (spec, b) in enumerate(zip(self._batch_specs, batch)):
            if spec is None:
                continue
            a_leaves, b_leaves = tree.leaves(spec), tree.leaves(b)
            if len(a_leaves) != len(b_leaves):
                raise ArgumentError(
                    f"AutoParallel({self.name}): batch input {k} has {len(b_leaves)} "
                    f"arrays, but set_inputs declared {len(a_leaves)}.\nFix: pass the "
                    "structure that was declared.")
            avals += a_leaves
            values += b_leaves
        bind_declared(f"AutoParallel({self.name}) (set_inputs: each process's slice{rank})",
                      "batch input array", avals, values)

    def _even_slices(self, batch) -> tuple:
        """This process's slices, checked against the declaration and against the other
        processes' (an AllGather of their shapes, every call); slices of different row
        counts (an uneven last batch) become this process's even block of the global
        batch they make (``local_batch.rebalance``): the step then trains as one
        process would on the processes' rows in rank order, the mean loss over every
        row."""
        leaves, spec = tree.flatten(tuple(batch))
        what = f"AutoParallel({self.name})"
        rows = slice_rows([typeof(x).shape for x in leaves], what,
                          [typeof(x).dtype for x in leaves])
        if self._batch_specs is not None:
            if rows is None:
                self._check_declared_slices(batch)
            else:  # every process checks every process's slices: all raise together
                for r, counts in enumerate(rows):
                    self._check_declared_slices(tree.unflatten(spec, [
                        ArrayType((c,) + tuple(typeof(x).shape[1:]), typeof(x).dtype)
                        for c, x in zip(counts, leaves)]), f" (rank {r})")
        if rows is None or any(typeof(x).ndim == 0 for x in leaves):
            return batch  # (a batch input without rows: the plan refuses it, naming it)
        if any(isinstance(x, Tracer) for x in leaves):  # traced: no values to move
            raise rows_differ_error(what, rows, distributed.world_size())
        return tree.unflatten(spec, [as_tensor(x) for x in rebalance(leaves, rows, what)])

    def _place_state(self, state: TrainState, s, gbatch) -> TrainState:
        """In a job, ``state`` with each whole leaf that the plan splits (the state of
        ``ap.init``, or a loaded one) cut to this process's block (an
        ``fs.ShardedArray``: no communication), as the steps return it: the first step
        then runs the program of every later step, instead of compiling a second one
        for whole inputs whose memory the process would keep. ``s``: the sharded step
        of ``state`` and the batch as planned, ``gbatch``."""
        leaves, spec = tree.flatten(state)
        key = (spec, tuple((tuple(typeof(x).shape), typeof(x).dtype) for x in leaves))
        split = s.state_splits.get(key)
        if split is None:  # once per plan: which leaves it splits, and how
            part = s.partitioned(state.params, state.opt_state, state.step, *gbatch)
            shs = _arg_shardings(part, (state, gbatch))[:len(leaves)]
            split = {i: (Sharding(sh.dims), part.prop.mesh) for i, sh in enumerate(shs)
                     if any(sh.dims)}
            s.state_splits[key] = split
        if all(isinstance(leaves[i], (ShardedArray, Tracer)) for i in split):
            return state
        rank = distributed.rank()
        leaves = [ShardedArray.cut(x, *split[i], rank) if i in split and not isinstance(
            x, (ShardedArray, Tracer)) else x for i, x in enumerate(leaves)]
        return tree.unflatten(spec, leaves)

    def _place_slices(self, state: TrainState, batch, s, gbatch) -> tuple:
        """Each process's slice as what the plan reads: a concrete slice is this
        process's block of the global batch (an ``fs.ShardedArray``, taken by the step
        as it is: nothing padded or communicated); a traced one is placed at its block
        of a global-shaped value. ``s``: the sharded step, ``gbatch`` the global batch
        of these slices."""
        leaves, spec = tree.flatten(tuple(batch))
        key = (spec, tuple((tuple(typeof(x).shape), typeof(x).dtype) for x in leaves))
        places = s.batch_places.get(key)
        if places is None:  # once per plan: this process's block of each batch input
            part = s.partitioned(state.params, state.opt_state, state.step, *gbatch)
            shs = _arg_shardings(part, (state, gbatch))[len(tree.leaves(state)):]
            rank = distributed.rank()
            places = []
            for x, sh in zip(leaves, shs, strict=True):
                where = block_index(sh, part.prop.mesh, rank)
                # the global type of this slice (a declared batch's is symbolic)
                g = ArrayType(tuple(d * k for d, (_, k) in zip(typeof(x).shape, where)),
                              typeof(x).dtype)
                places.append((where, Sharding(sh.dims), part.prop.mesh, g))
            s.batch_places[key] = places
        rank = distributed.rank()
        out = []
        for x, (where, sh, mesh, g) in zip(leaves, places, strict=True):
            if isinstance(x, Tracer) or sh.local_shape(g.shape, mesh) != typeof(x).shape:
                out.append(to_global(x, where))
            else:
                out.append(ShardedArray(as_tensor(x), g.shape, g.dtype, sh, mesh, rank))
        return tree.unflatten(spec, out)

    def partitioned(self, state: TrainState, *batch):
        """The per-device program of the step (print it; ``.collectives()``)."""
        self._check_state(state, ".partitioned(state, *batch)")
        return self._partitioned(state, self._plan_batch(batch))

    @property
    def __fshard_make_ir__(self):
        """What ``fs.make_ir(ap)(state, *batch)`` shows: the step's per-device program,
        with its layouts and collectives (as for ``fs.make_ir(fs.shard(f))``)."""
        return self.partitioned

    def _partitioned(self, state: TrainState, batch):
        s, _ = self._sharded(state, batch)
        return s.partitioned(state.params, state.opt_state, state.step, *batch)

    # -- reports and files -----------------------------------------------------------
    def explain(self, state: TrainState, *batch):
        """The step's plan, per equation: the layouts chosen, the predicted compute and
        communication time, and the runner-up (print it; ``fshard.sharding.explain``)."""
        self._check_state(state, ".explain(state, *batch)")
        part = self.partitioned(state, *batch)
        e = explain_plan(part.prop, f"{self.name} ({self.parallel_mode})",
                         fused=part.fused, fused_gathers=part.fused_gathers)
        if self._feeds_slices():
            # in a job every call first checks the processes' slices: its own AllGather
            e.checks_s = slice_check_seconds(self.n_devices)
        return e

    def memory_report(self, state: TrainState, *batch) -> dict:
        """Bytes per device of ``params``, ``grads`` and ``optimizer_state`` as the plan
        lays them out: parameters and optimizer state as the step receives them, each
        gradient as the step holds it once complete and reduced (whole up to ZeRO
        level1, whose update slices it; split like the optimizer state from level2).

        With a pipeline: the state as the step's final program (the optimizer update)
        lays it out, and ``"stages"``, one entry per stage: the bytes per device of
        that stage's own parameters, their gradients and the optimizer state that
        copies them. ``"update"`` says how the update runs: ``"per_stage"`` (each
        device, in a multi-process job each process, keeps and updates its own stage's
        state and the leaves no stage owns; the totals are the most any device keeps)
        or ``"whole"`` (every device keeps
        every stage's state, ZeRO splitting each leaf over its stage's devices;
        ``"whole_because"`` says why). With operator parallelism inside the stages,
        ``"stage_state"`` says whether a stage's devices keep its state in the
        ``parameter_plan`` blocks (``"blocks"``) or whole (``"whole"``,
        ``"stage_state_because"`` says why)."""
        self._check_state(state, ".memory_report(state, *batch)")
        if self._pipeline is not None:
            return self._pipeline.step_for(state, *batch).memory_report(state)
        part = self.partitioned(state, *batch)
        prop, mesh = part.prop, part.prop.mesh
        n_p = len(tree.leaves(state.params))
        n_o = len(tree.leaves(state.opt_state))
        program = prop.program
        n_args = len(tree.leaves((state, batch)))
        ins = program.inputs[len(program.inputs) - n_args:]
        shs = _arg_shardings(part, (state, batch))
        report = {
            "params": sum(local_bytes(sh, v.aval, mesh) for v, sh in
                          zip(ins[:n_p], shs[:n_p])),
            "optimizer_state": sum(local_bytes(sh, v.aval, mesh) for v, sh in zip(
                ins[n_p:n_p + n_o], shs[n_p:n_p + n_o])),
        }
        # Each gradient as the step holds it once complete: whole (its pending sum
        # reduced by an AllReduce) unless the plan splits it, as ZeRO level2 does (a
        # reduce-scatter in the backward) and level3 (its parameter's gather
        # transposed). A slice the update takes of a whole gradient (level1) does not
        # free the whole one.
        s, _ = self.sharded(state, *batch)
        grads = 0.0
        for g in s.grad_vars:
            if g is not None:
                grads += local_bytes(prop.shardings.get(g, Sharding.replicated(g.aval.ndim)),
                                     g.aval, mesh)
        report["grads"] = grads
        return report

    def state_strategies(self, state: TrainState, *batch) -> TrainState:
        """The strategy (split counts) of every leaf of ``state`` in the step's plan,
        as a ``TrainState`` of tuples: the ``layouts`` of ``fs.checkpoint.save``."""
        self._check_state(state, ".state_strategies(state, *batch)")
        part = self.partitioned(state, *batch)
        mesh = part.prop.mesh
        leaves, spec = tree.flatten(TrainState(state.params, state.opt_state, state.step))
        shs = _arg_shardings(part, (state, batch))[:len(leaves)]
        return tree.unflatten(spec, [tuple(sh.strategy(mesh)) for sh in shs])

    def save_param_strategy_file(self, file_path, state: TrainState | None = None,
                                 *batch) -> dict | "AutoParallel":
        """Write each parameter's strategy (split counts), keyed by parameter name, to
        ``file_path`` as JSON, atomically. Only the trainable parameters are listed (as in
        MindSpore) unless ``disable_strategy_file_only_for_trainable_params()`` was
        called. With ``file_path`` alone (MindSpore's form) the file is written when the
        step is first compiled (its first call) and the AutoParallel is returned."""
        if state is None:
            return self._defer("param", "save_param_strategy_file", file_path, batch)
        fixed = self._frozen() if self._only_trainable else set()
        if self._pipeline is not None:
            data = self._pipeline.param_strategies(state, *batch)
            data["params"] = {k: v for k, v in data["params"].items() if k not in fixed}
            data["stages"] = {k: v for k, v in data["stages"].items() if k not in fixed}
            data = {"format": "fshard-param-strategy", "devices": self.n_devices,
                    "only_trainable": self._only_trainable, **data}
            _write_json(file_path, data)
            return data
        part = self.partitioned(state, *batch)
        mesh = part.prop.mesh
        paths, _, _ = tree.flatten_with_path(state.params)
        shs = _arg_shardings(part, (state, batch))[:len(paths)]
        data = {"format": "fshard-param-strategy", "devices": mesh.size,
                "only_trainable": self._only_trainable,
                "params": {_name(p): list(sh.strategy(mesh)) for p, sh in zip(paths, shs)
                           if _name(p) not in fixed}}
        _write_json(file_path, data)
        return data

    def disable_strategy_file_only_for_trainable_params(self) -> "AutoParallel":
        """The parameter strategy file (``save_param_strategy_file``) also lists the
        non-trainable parameters (``requires_grad=False``), and a loaded file must
        list them too; by default, as in MindSpore, only the trainable ones."""
        self._only_trainable = False
        return self

    def set_group_ckpt_save_file(self, file_path) -> "AutoParallel":
        """When the step is first compiled, write the communication groups its
        per-device program uses to ``file_path`` as JSON, atomically: for this process's
        rank (0 on a virtual mesh), each group's name (its mesh axes, joined by
        ``-``) -> the ranks of the group that contains it, ``{"format":
        "fshard-comm-groups", "devices": N, "rank": r, "groups": {"m0-m1": [0, 1, 2,
        3]}}`` (MindSpore's ``set_group_ckpt_save_file``)."""
        return self._defer("groups", "set_group_ckpt_save_file", file_path, ())

    def save_group_file(self, path, state: TrainState, *batch) -> dict:
        """Write the file of ``set_group_ckpt_save_file`` now, for this step (with a
        pipeline: the groups ``"pp"``, this process's pipeline group, one device per
        stage, and ``"dp"``, its stage's devices, when a stage has several)."""
        if self._pipeline is not None:
            rank = distributed.rank()
            data = {"format": "fshard-comm-groups", "devices": self.n_devices,
                    "rank": rank, "groups": self._pipeline.groups(rank)}
            write_json_atomic(path, data, "communication group file")
            return data
        part = self.partitioned(state, *batch)
        mesh, rank = part.prop.mesh, distributed.rank()
        groups = {}
        for axes in _collective_axes(part.program):
            idx = [mesh.names.index(a) for a in axes]
            group = next(g for g in mesh.groups(idx) if rank in g)
            groups["-".join(axes)] = [int(r) for r in group]
        data = {"format": "fshard-comm-groups", "devices": mesh.size, "rank": rank,
                "groups": groups}
        write_json_atomic(path, data, "communication group file")
        return data

    def _defer(self, kind: str, method: str, file_path, batch) -> "AutoParallel":
        """Remember a file to write when the step is first compiled."""
        if batch:
            raise ArgumentError(
                f"AutoParallel({self.name}).{method}(file_path, state, *batch) needs the "
                f"state first; got {len(batch)} more arguments with state None.\nFix: "
                f"{method}(file_path) alone (written at the first step) or "
                f"{method}(file_path, state, *batch) (written now).")
        if not isinstance(file_path, (str, os.PathLike)):
            raise ArgumentError(
                f"AutoParallel({self.name}).{method}(file_path): file_path must be a file "
                f"path (str or os.PathLike); got {type(file_path).__name__} {file_path!r}.")
        self._files[kind] = os.fspath(file_path)
        return self

    def _write_files(self, state: TrainState, batch) -> None:
        """Write the files set by path alone, at the first step that compiles."""
        write = {"param": self.save_param_strategy_file,
                 "operator": self.save_operator_strategy_file,
                 "groups": self.save_group_file}
        for kind, path in list(self._files.items()):
            write[kind](path, state, *batch)
            del self._files[kind]  # (kept if the step fails to compile: written later)

    def load_param_strategy_file(self, file_path) -> "AutoParallel":
        """Use the parameter strategies of a file written by
        ``save_param_strategy_file`` (checked against the parameters when stepping)."""
        data = _read_json(file_path, "fshard-param-strategy")
        if data.get("devices") != self.n_devices:
            raise ShardingError(
                f"load_param_strategy_file({file_path!r}): the file was written for "
                f"{data.get('devices')} devices, this AutoParallel has {self.n_devices}.")
        self._fixed_params = data["params"]
        # (files written before the flag existed list every parameter)
        self._fixed_only_trainable = bool(data.get("only_trainable", False))
        self._param_file = str(file_path)
        self._forget_steps()
        return self

    def save_operator_strategy_file(self, file_path, state: TrainState | None = None,
                                    *batch) -> dict | "AutoParallel":
        """Write the strategy of every equation of the step (``fs.shard``'s strategy
        file) to ``file_path``; with ``file_path`` alone (MindSpore's form), when the step is
        first compiled. With a pipeline whose stages are sharded (``parameter_plan`` or
        strategies in the loss): one section per stage, each chunk's forward and
        backward programs' strategies (``"stages"``), and with ZeRO each stage's update
        program's (its ``"finish"``; one ``"finish"`` over every device when the
        update runs whole)."""
        if state is None:
            return self._defer("operator", "save_operator_strategy_file", file_path, batch)
        self._check_state(state, ".save_operator_strategy_file(file_path, state, *batch)")
        if self._pipeline is not None:
            data = self._pipeline.step_for(state, *batch).operator_strategies(state)
            write_json_atomic(file_path, data, "operator strategy file")
            return data
        batch = self._plan_batch(batch)
        s, _ = self._sharded(state, batch)
        return s.save_strategies(file_path, state.params, state.opt_state, state.step, *batch)

    def load_operator_strategy_file(self, file_path) -> "AutoParallel":
        """Reuse a plan saved by ``save_operator_strategy_file`` (checked on use)."""
        self._operator_file = file_path
        for s, _ in self._steps.values():
            s.load_strategies(file_path)
        return self

    def __repr__(self) -> str:
        return f"fs.AutoParallel({self.name}, parallel_mode={self.parallel_mode.value!r})"


#: The options of MindSpore's parallel speed-up JSON (``AutoParallel.transformer_opt``).
SPEEDUP_OPTIONS = (
    "recomputation_communication_overlap", "grad_matmul_communication_overlap",
    "grad_fa_allgather_overlap", "enable_communication_fusion",
    "grad_computation_allreduce_overlap", "computation_allgather_overlap",
    "computation_communication_fusion_level", "dataset_broadcast_opt_level",
    "allreduce_and_biasadd_swap", "enable_allreduce_slice_to_reducescatter",
    "enable_interleave_split_concat_branch", "enable_interleave_parallel_branch")


def _initialise(cell) -> None:
    """Initialise, in place, the Parameters made under MindSpore's
    ``no_init_parameters()`` (as MindSpore's AutoParallel does when it compiles). An
    optimizer built over them (``nn.SGD(net.trainable_params())``) has cleared their
    pending initial value but kept the initializer (``Parameter.init``), which is used
    then."""
    from mindspore.common.initializer import initializer

    for _, p in cell.parameters_and_names():
        if p.has_init:
            if getattr(p.init_mode, "init", None) is None and p.init is not None:
                p.init_mode = initializer(p.init, p.shape, p.dtype)
            p.init_data()


def _scatter_gradient(strategy):
    """The identity, whose derivative gives its cotangent the layout ``strategy``."""

    @custom_vjp
    def point(x):
        return x

    point.defvjp(lambda x: (x, None),
                 lambda _, ct: (with_sharding_constraint(ct, strategy),))
    return point


def _without(params, names: set):
    """``params`` (a Cell's dict) without the entries ``names``."""
    if not names:
        return params
    return {k: v for k, v in params.items() if k not in names}


def _arg_shardings(part, args) -> list:
    """The layouts of the step's arguments (``(state, batch)`` leaves, in order) in its
    per-device program. The program's first inputs are the constants its tracing
    captured (a MindSpore loss Cell's class weights, a table): they come before the
    arguments, and the program's ``n_consts`` does not count them (to the plan they
    are ordinary inputs), so the arguments are its last inputs."""
    n = len(tree.leaves(args))
    return list(part.in_shardings[len(part.in_shardings) - n:])


def _is_counts(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(c, int) for c in x)


def _np_dtype(dtype):
    from fshard.core import dtypes

    return dtypes.to_numpy(dtype)


def _planning_cells(apply, cell):
    """``apply`` (the Cell's functional form) run with ``context.planned_cells`` naming
    the Cells whose ``cell.shard`` parameter_plan the step's plan has taken."""
    @functools.wraps(apply)
    def loss_fn(params, *batch):
        with context.setting(context.planned_cells, cells_with_parameter_plans(cell)):
            return apply(params, *batch)

    return loss_fn


def _strategy_key(strategy):
    """A strategy compared by value (split counts as a tuple, whatever the sequence)."""
    if isinstance(strategy, (tuple, list)):
        return tuple(_strategy_key(s) for s in strategy)
    return strategy


def _name(path) -> str:
    """A parameter's name from its key path: ``'dense1.weight'`` for a Cell's dict
    key, ``'w1'`` for ``{'w1': ...}``, ``'0.w'`` for ``[{'w': ...}]``."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _collective_axes(program) -> list:
    """The mesh axes (a tuple of names) of each distinct collective of a per-device
    program, in order of first use, inside loops' bodies and conds' branches too."""
    out: list = []
    for eq in program.equations:
        if eq.prim in C.COLLECTIVES:
            axes = eq.params.get("axis_name")
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            if axes and axes not in out:
                out.append(axes)
        for v in eq.params.values():
            for sub in (v if isinstance(v, tuple) else (v,)):
                if isinstance(sub, Program):
                    out += [a for a in _collective_axes(sub) if a not in out]
    return out


def _write_json(path, data) -> None:
    write_json_atomic(path, data, "parameter strategy file")


def _read_json(path, fmt: str) -> dict:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ArgumentError(f"strategy file {path!r} does not exist.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ArgumentError(
            f"strategy file {path!r} is not a readable JSON strategy file ({e}).") from None
    if not isinstance(data, dict) or data.get("format") != fmt or not isinstance(
            data.get("params"), dict):
        raise ArgumentError(
            f"strategy file {path!r} is not an fshard {fmt} file (written by "
            "save_param_strategy_file).")
    return data

