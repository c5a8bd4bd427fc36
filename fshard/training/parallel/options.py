"""``fs.AutoParallel``'s configuration: one frozen options object, checked in one place.

The constructor's ``parallel_mode`` and the MindSpore-named configuration methods
(``dataset_strategy``, ``parameter_plan``, ``hsdp``, ``comm_fusion``,
``gradient_accumulation``, the fp32-communication and local-norm switches) each make a
new ``ParallelOptions`` with ``replace`` (MindSpore's ``comm_fusion`` dict is read by
``parse_comm_fusion``); ``__post_init__`` checks every field, so a
refused value leaves the previous options in place (nothing half-applied), and the
step is built from ``ap.options`` alone.

>>> from fshard.training.parallel.options import ParallelMode, ParallelOptions
>>> o = ParallelOptions(mode="sharding_propagation").replace(gradient_accumulation=4)
>>> o.mode is ParallelMode.SHARDING_PROPAGATION, o.mode == "sharding_propagation"
(True, True)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

import numpy as np

from fshard.errors import ArgumentError


class ParallelMode(str, enum.Enum):
    """How ``fs.AutoParallel`` plans what no strategy fixes (MindSpore's
    ``AutoParallel(parallel_mode=...)``; its strings are accepted and compare equal).

    - ``SEMI_AUTO`` (``"semi_auto"``): the strategies given; an operator without one
      follows its inputs' layouts (data parallel over the batch split);
    - ``SHARDING_PROPAGATION`` (``"sharding_propagation"``): propagation derives the
      rest, the parameters too;
    - ``RECURSIVE_PROGRAMMING`` (``"recursive_programming"``): fshard's search over the
      whole step.

    >>> import fshard as fs
    >>> mode = fs.parallel.ParallelMode("recursive_programming")
    >>> mode is fs.parallel.ParallelMode.RECURSIVE_PROGRAMMING, mode == "recursive_programming"
    (True, True)
    """

    SEMI_AUTO = "semi_auto"
    SHARDING_PROPAGATION = "sharding_propagation"
    RECURSIVE_PROGRAMMING = "recursive_programming"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value) -> "ParallelMode":
        """``value`` (a member or its string) as a member; anything else is an error."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        modes = tuple(m.value for m in cls)
        # MindSpore's context names its modes differently (ms.set_auto_parallel_context)
        context = {"semi_auto_parallel": "'semi_auto'",
                   "auto_parallel": "'sharding_propagation' or 'recursive_programming' (its "
                                    "search_mode)"}
        hint = (f"{value!r} is ms.set_auto_parallel_context's spelling; AutoParallel's is "
                f"{context[value]}" if isinstance(value, str) and value in context else
                "parallel_mode='semi_auto' (the strategies given, data parallel elsewhere)")
        raise ArgumentError(
            f"AutoParallel(parallel_mode=...) must be one of {modes} (or fs.parallel."
            f"ParallelMode); got {value!r}.\nFix: {hint}.")


MODES = tuple(m.value for m in ParallelMode)
LEVELS = ("level1", "level2", "level3")


class Hsdp(NamedTuple):
    """ZeRO (``AutoParallel.hsdp``): the group size (-1: each parameter's whole
    data-parallel group), the size in KB under which a tensor stays whole, the level."""

    shard_size: int
    threshold: int
    level: str

    @property
    def threshold_bytes(self) -> int:
        return self.threshold * 1024

    def reaches(self, level: str) -> bool:
        """ZeRO at this level splits what ``level`` splits (level3 includes level1)."""
        return LEVELS.index(self.level) >= LEVELS.index(level)


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    """Everything ``fs.AutoParallel`` is configured with (``ap.options``), checked on
    construction. The fields are the methods' arguments, as given.

    >>> import fshard as fs
    >>> ap = fs.AutoParallel(lambda p, x: (x @ p).sum(), fs.optim.sgd(0.1), mesh=2)
    >>> ap.gradient_accumulation(4).options.gradient_accumulation
    4
    >>> ap.options.replace(mode="sharding_propagation").mode
    <ParallelMode.SHARDING_PROPAGATION: 'sharding_propagation'>
    """

    mode: ParallelMode = ParallelMode.SEMI_AUTO
    #: ``"data_parallel"``, ``"full_batch"``, a tuple of per-input strategies, or None
    #: (not given: MindSpore's context decides, else "data_parallel")
    dataset_strategy: Any = None
    parameter_plan: Mapping = dataclasses.field(default_factory=dict)
    hsdp: Hsdp | None = None
    #: the AllReduce bucket size in bytes (``comm_fusion``; None: no fusion)
    fusion_bytes: float | None = None
    #: the AllGather bucket size in bytes (``comm_fusion``'s "allgather"; None: none)
    gather_fusion_bytes: float | None = None
    #: the reduce-scatter bucket size in bytes (``comm_fusion``'s "reducescatter";
    #: None: none)
    scatter_fusion_bytes: float | None = None
    #: the gradient indices starting a new AllReduce bucket (``comm_fusion``'s
    #: "allreduce" in mode "index"; None: buckets by ``fusion_bytes``)
    fusion_split_points: tuple | None = None
    #: ``comm_fusion`` was called: its buckets (or none) stand. Otherwise a job's
    #: AllReduces are bucketed by the measured rates (``cost.bucket_bytes``).
    fusion_given: bool = False
    fp32_communication: bool = False
    gradient_fp32_sync: bool = True  # MindSpore's default
    print_local_norm: bool = False
    dump_local_norm: str | None = None
    device_local_norm: bool = False
    gradient_accumulation: int = 1

    def __post_init__(self):
        def set_(name, value):  # (frozen: only construction sets a field)
            object.__setattr__(self, name, value)

        set_("mode", ParallelMode.parse(self.mode))
        _check_dataset(self.dataset_strategy)
        if not isinstance(self.parameter_plan, Mapping):
            raise ArgumentError(
                f"AutoParallel.parameter_plan(plan): plan must be a dict of name -> "
                f"strategy; got {type(self.parameter_plan).__name__}.\nFix: e.g. "
                "{'dense1.weight': (1, 2)}.")
        set_("parameter_plan", MappingProxyType(dict(self.parameter_plan)))
        if self.hsdp is not None:
            set_("hsdp", _check_hsdp(*self.hsdp))
        if self.fusion_split_points is not None:
            set_("fusion_split_points", _check_split_points(
                "ParallelOptions(fusion_split_points=...)", self.fusion_split_points))
        for name in ("fusion_bytes", "gather_fusion_bytes", "scatter_fusion_bytes"):
            b = getattr(self, name)
            if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float))
                                  or not (math.isfinite(b) and b > 0)):
                raise ArgumentError(
                    f"ParallelOptions({name}=...) must be None or a bucket size in bytes "
                    f"> 0; got {b!r}.\nFix: set it with AutoParallel.comm_fusion(config).")
        if self.dump_local_norm is not None:
            if not isinstance(self.dump_local_norm, (str, os.PathLike)):
                raise ArgumentError(
                    f"AutoParallel.dump_local_norm(path): path must be a directory path; "
                    f"got {type(self.dump_local_norm).__name__} {self.dump_local_norm!r}."
                    "\nFix: a str or pathlib.Path naming a directory.")
            set_("dump_local_norm", os.fspath(self.dump_local_norm))
        k = self.gradient_accumulation
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ArgumentError(
                f"AutoParallel.gradient_accumulation(k): k must be an int >= 1 (micro-batches "
                f"per update); got {type(k).__name__} {k!r}.\nFix: e.g. "
                "ap.gradient_accumulation(4).")
        set_("gradient_accumulation", int(k))
        for name in ("fp32_communication", "gradient_fp32_sync", "print_local_norm",
                     "device_local_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ArgumentError(
                    f"ParallelOptions({name}=...) must be a bool; got "
                    f"{getattr(self, name)!r}.\nFix: True or False.")

    def replace(self, **changes) -> "ParallelOptions":
        """New options with ``changes``, checked (these are unchanged on an error)."""
        return dataclasses.replace(self, **changes)

    @property
    def fuses(self) -> bool:
        """Some collectives are bucketed (``comm_fusion``)."""
        return any(v is not None for v in (
            self.fusion_bytes, self.gather_fusion_bytes, self.scatter_fusion_bytes,
            self.fusion_split_points))

    @property
    def local_norm(self) -> bool:
        """Gradient block norms are reported (printed or dumped)."""
        return self.print_local_norm or self.dump_local_norm is not None

    @property
    def fp32_reductions(self) -> bool:
        """Float16 reductions run in float32."""
        return self.fp32_communication or self.gradient_fp32_sync


def _check_dataset(config) -> None:
    if config is not None and config not in ("data_parallel", "full_batch") and \
            not isinstance(config, tuple):
        raise ArgumentError(
            "AutoParallel.dataset_strategy(config): config must be 'data_parallel', "
            f"'full_batch' or a tuple of per-input strategies; got {config!r}.\nFix: "
            "dataset_strategy('data_parallel') splits each batch input along dimension 0 "
            "over the devices; ((8, 1), (8,)) gives one strategy per batch input.")


def _check_hsdp(shard_size, threshold, level) -> Hsdp:
    if level not in LEVELS:
        raise ArgumentError(
            f"AutoParallel.hsdp(optimizer_level=...) must be one of {LEVELS}; got "
            f"{level!r}.\nFix: 'level1' splits the optimizer state, 'level2' also the "
            "gradients, 'level3' also the parameters.")
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ArgumentError(
            f"AutoParallel.hsdp(threshold=...) must be an int >= 0 (KB); got "
            f"{threshold!r}.\nFix: e.g. threshold=64 keeps tensors under 64 KB whole.")
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or (
            shard_size != -1 and shard_size < 1):
        raise ArgumentError(
            f"AutoParallel.hsdp(shard_size=...) must be -1 (each parameter's whole "
            f"data-parallel group) or a positive int; got {shard_size!r}.\nFix: "
            "shard_size=-1, or the size of the groups to split over.")
    return Hsdp(shard_size, threshold, level)


def parse_comm_fusion(config) -> dict:
    """The ``ParallelOptions`` fields MindSpore's ``comm_fusion`` ``config`` asks for
    (``fusion_bytes``, ``fusion_split_points``, ``gather_fusion_bytes``,
    ``scatter_fusion_bytes``; None: not fused), checked as MindSpore checks it."""
    where = "AutoParallel.comm_fusion(config)"
    if not isinstance(config, Mapping):
        raise ArgumentError(
            f"{where}: config must be a dict; got {type(config).__name__}.\nFix: e.g. "
            '{"allreduce": {"mode": "auto", "config": None}}.')
    unknown = set(config) - {"openstate", "allreduce", "allgather", "reducescatter"}
    if unknown:
        raise ArgumentError(
            f"{where}: unknown keys {sorted(unknown, key=repr)}; MindSpore's keys are "
            "'openstate', 'allreduce', 'allgather' and 'reducescatter'.\nFix: use "
            "'openstate' (a bool) and 'allreduce', 'allgather' or 'reducescatter' (a "
            "dict of 'mode' and 'config').")
    openstate = config.get("openstate", True)
    if not isinstance(openstate, bool):
        raise ArgumentError(
            f"{where}: 'openstate' must be a bool (True: fusion on, False: off); got "
            f"{type(openstate).__name__} {openstate!r}.\nFix: {{'openstate': False}} "
            "turns fusion off.")
    allreduce = _bucket_bytes(where, "allreduce",
                              config.get("allreduce", {"mode": "auto", "config": None}))
    fields = {"fusion_bytes": None, "fusion_split_points": None}
    fields["fusion_split_points" if isinstance(allreduce, tuple) else "fusion_bytes"] = \
        allreduce
    for kind, name in (("allgather", "gather_fusion_bytes"),
                       ("reducescatter", "scatter_fusion_bytes")):
        fields[name] = _bucket_bytes(where, kind, config[kind]) if kind in config else None
    return fields if openstate else dict.fromkeys(fields)


def _check_split_points(where: str, points) -> tuple:
    """MindSpore's ``all_reduce_fusion_config`` checks: a non-empty list of
    increasing non-negative ints."""
    ok = isinstance(points, (list, tuple)) and len(points) > 0 and all(
        isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i >= 0
        for i in points) and all(a < b for a, b in zip(points, points[1:]))
    if not ok:
        raise ArgumentError(
            f"{where}: allreduce mode 'index' needs config = a non-empty list of "
            "increasing non-negative ints (the gradient indices where a new bucket "
            f"starts); got {points!r}.\nFix: e.g. {{'mode': 'index', 'config': [20, 35]}} "
            "fuses gradients 0..19, 20..34 and 35 to the last.")
    return tuple(int(i) for i in points)


def _bucket_bytes(where: str, kind: str, cfg) -> float | tuple:
    """The bucket bytes of one ``comm_fusion`` entry (``{"mode": "auto" | "size",
    "config": MB}``; for "allreduce" also ``{"mode": "index", "config": [i, ...]}``,
    whose split points are returned as a tuple), checked as MindSpore checks it."""
    if not isinstance(cfg, Mapping):
        raise ArgumentError(
            f"{where}: '{kind}' must be a dict with keys 'mode' and 'config'; got "
            f"{type(cfg).__name__} {cfg!r}.\nFix: {{'{kind}': {{'mode': 'size', "
            "'config': 32}}.")
    if set(cfg) != {"mode", "config"}:
        missing = sorted({"mode", "config"} - set(cfg))
        extra = sorted(set(cfg) - {"mode", "config"}, key=repr)
        raise ArgumentError(
            f"{where}: '{kind}' must have exactly the keys 'mode' and 'config' (as "
            f"MindSpore asks)" + (f"; missing {missing}" if missing else "")
            + (f"; unknown {extra}" if extra else "") + ".\nFix: {'mode': 'auto', "
            "'config': None} or {'mode': 'size', 'config': <MB>}.")
    mode, size = cfg["mode"], cfg["config"]
    if mode == "auto":
        if size is not None:
            raise ArgumentError(
                f"{where}: {kind} mode 'auto' uses 64 MB buckets, so config "
                f"{size!r} would be ignored.\nFix: config None, or mode 'size' for a "
                "bucket of config MB.")
        return 64 * 2**20
    if mode == "size":
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not (
                math.isfinite(size) and size > 0):
            raise ArgumentError(
                f"{where}: {kind} mode 'size' needs config = a bucket size in MB, "
                f"a finite number > 0; got {size!r}.\nFix: e.g. {{'mode': 'size', "
                "'config': 32}.")
        return float(size) * 2**20
    if mode == "index" and kind == "allreduce":
        return _check_split_points(where, size)
    if kind == "allreduce":
        raise ArgumentError(
            f"{where}: allreduce mode must be 'auto', 'size' or 'index'; got {mode!r}."
            "\nFix: {'mode': 'auto', 'config': None}, {'mode': 'size', 'config': <MB>} "
            "or {'mode': 'index', 'config': [<gradient index>, ...]}.")
    raise ArgumentError(
        f"{where}: {kind} mode must be 'auto' or 'size' (MindSpore's 'index' mode is "
        f"for 'allreduce' only); got {mode!r}.\nFix: {{'mode': 'auto', 'config': None}} "
        "or {'mode': 'size', 'config': <MB>}.")
