"""The world of a multi-process job: init, rank, world size, communication groups.

A thin layer over ``mindspore.communication`` for scripts started by
``python -m fshard.launch`` or ``msrun`` (one process per device). Outside such a
job fshard runs on a virtual mesh in one process and none of this is needed:
``rank()`` is 0 and ``world_size()`` is 1 until ``init()`` has run.

MindSpore is imported only inside these functions. On CPU, only AllReduce works on
groups made by ``group_for``; AllGather and Broadcast work on the world group only.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Sequence

from fshard.errors import DistributedError

__all__ = ["init", "is_initialized", "rank", "world_size", "group_for", "world_group",
           "in_launcher", "create_group", "group_ranks"]

# Variables a launcher sets; any one of them means "started by a launcher".
_LAUNCHER_VARS = ("MS_ROLE", "RANK_TABLE_FILE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")

_groups: dict[tuple[int, ...], str] = {}
# Groups named by the user (``create_group``): name -> rank ids, as given. Like
# MindSpore's own group table, it belongs to the process, not to one trace.
_named_groups: dict[str, tuple[int, ...]] = {}


def in_launcher() -> bool:
    """True when this process was started by fshard.launch, msrun or mpirun."""
    return any(os.environ.get(v) for v in _LAUNCHER_VARS)


def is_initialized() -> bool:
    """True after ``init()`` (or MindSpore's ``init()``) has run in this process.

    >>> is_initialized()
    False
    """
    if "mindspore" not in sys.modules:  # nothing can have initialised it
        return False
    from fshard.backend.mindspore import comm_initialized

    return comm_initialized()


def _tell_launcher(status: bytes) -> None:
    """Tell fshard.launch (when it started this process) what this rank is doing: it
    then stops a job at once when a rank finished without joining while others wait."""
    fd_pid = os.environ.get("FSHARD_LAUNCH_REPORT_FD", "")
    fd, _, pid = fd_pid.partition(":")
    if fd.isdigit() and pid == str(os.getpid()):  # not in a child process
        try:
            os.write(int(fd), status)
        except OSError:
            pass


def init() -> None:
    """Join the job this process belongs to (idempotent).

    Wraps ``mindspore.communication.init()``; call it once at the top of a script
    started with ``python -m fshard.launch -n N script.py`` (or ``msrun``). Afterwards
    the default mesh is the job's world: one device per process.

    >>> init()  # doctest: +SKIP
    >>> rank(), world_size()  # doctest: +SKIP
    (0, 2)

    Raises:
        DistributedError: outside a launcher, or when MindSpore fails to initialise.

    See also: ``fshard.launch``, docs/launch.md.
    """
    if is_initialized():
        return
    if not in_launcher():
        raise DistributedError(
            "fs.distributed.init() was called in a process that no launcher started "
            "(MS_ROLE and RANK_TABLE_FILE are unset), so there is no job to join. "
            "Fix: start the script with `python -m fshard.launch -n 2 "
            "script.py` (or msrun); to run in one process, skip init() and use a virtual "
            "mesh: fs.Mesh((8,), ('d',)) or FSHARD_DEVICES=8."
        )
    from mindspore.communication import init as ms_init

    _tell_launcher(b"i")
    try:
        ms_init()
    except RuntimeError as e:
        raise DistributedError(
            f"MindSpore failed to join the job (rank {os.environ.get('RANK_ID', '?')} of "
            f"{os.environ.get('MS_WORKER_NUM', '?')}): {str(e).splitlines()[0] if str(e) else e}"
            f"\nFix: check that every rank started and that MS_SCHED_HOST/MS_SCHED_PORT "
            f"point at the scheduler; the launcher's per-rank logs have the details."
        ) from e


def rank() -> int:
    """This process's rank in the job; 0 before ``init()``.

    >>> rank()
    0
    """
    if not is_initialized():
        return 0
    from mindspore.communication import get_rank

    return int(get_rank())


def world_size() -> int:
    """Number of processes (devices) in the job; 1 before ``init()``.

    >>> world_size()
    1
    """
    if not is_initialized():
        return 1
    from mindspore.communication import get_group_size

    return int(get_group_size())


def world_group() -> str:
    """Name of MindSpore's world communication group (after ``init()``)."""
    _require_init("world_group()")
    from mindspore.communication import GlobalComm

    return GlobalComm.WORLD_COMM_GROUP


def _require_init(what: str) -> None:
    if not is_initialized():
        raise DistributedError(
            f"fs.distributed.{what} needs a joined job. Fix: call fs.distributed.init() "
            f"first, in a script started with `python -m fshard.launch -n N script.py`."
        )


def group_name(ranks: Sequence[int]) -> str:
    """The deterministic group name fshard uses for ``ranks`` (same on every rank).

    >>> group_name([0, 2])
    'fshard_0_2'
    """
    ranks = tuple(int(r) for r in ranks)
    if len(ranks) <= 8:
        return "fshard_" + "_".join(map(str, ranks))
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    return f"fshard_{len(ranks)}r_{digest}"


def group_for(ranks: Sequence[int]) -> str:
    """Create (once) and name a communication group of ``ranks``; return its name.

    Every rank in ``ranks`` must call this with the same list (in the same order),
    and only those ranks. The whole world returns the world group's name. Pass the
    name as ``group=`` to ``ops.AllReduce``. On CPU only AllReduce accepts such a group.

    >>> group_for(mesh.axis_group("mp", rank()))  # doctest: +SKIP
    'fshard_0_1'

    Raises:
        DistributedError: before ``init()``, for invalid or repeated ranks, or when this
            process's rank is not in ``ranks``.
    """
    _require_init("group_for(ranks)")
    try:
        key = tuple(ranks)
    except TypeError:
        key = None
    n, me = world_size(), rank()
    if (
        not key
        or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < n for r in key)
        or len(set(key)) != len(key)
    ):
        raise DistributedError(
            f"group_for(ranks) needs a non-empty list of distinct rank ids in [0, {n}); "
            f"got {ranks!r}. Fix: use a group from mesh.axis_groups(...)."
        )
    if me not in key:
        raise DistributedError(
            f"group_for({list(key)!r}) was called on rank {me}, which is not in the group. "
            f"Only members create a group. Fix: pass mesh.axis_group(axis_names, rank())."
        )
    if key == tuple(range(n)):
        return world_group()
    name = _groups.get(key)
    if name is None:
        from mindspore.communication import create_group

        name = group_name(key)
        try:
            create_group(name, list(key))
        except (RuntimeError, ValueError) as e:
            raise DistributedError(
                f"MindSpore could not create the communication group {name!r} of ranks "
                f"{list(key)!r}: {e}"
            ) from e
        _groups[key] = name
    return name


def create_group(group: str, rank_ids: Sequence[int]) -> None:
    """Name a communication group of ``rank_ids`` for MindSpore's collective op classes
    (``ops.AllReduce(group=group)`` and the others) traced by fshard (NB:
    ``mindspore.communication.create_group``, which needs a joined job).

    On a virtual mesh the name is only recorded: the function is traced once for every
    device, so a group means "the devices that differ from each other only along some
    mesh axes", and ``rank_ids`` must be one such group (in increasing order), e.g.
    ``[0, 1]`` on a ``(2, 2)`` mesh is the second axis; every device then talks to the
    group of that axis it belongs to. Inside a job (after ``init()``) MindSpore's
    ``create_group`` is called too, as every member rank must do.

    >>> create_group("pair", [0, 1])
    >>> group_ranks("pair")
    (0, 1)

    Raises:
        DistributedError: for an empty or repeated rank list, or a name already used
            for other ranks.
    """
    try:
        key = tuple(int(r) for r in rank_ids)
    except (TypeError, ValueError):
        key = ()
    if not isinstance(group, str) or not group or not key or len(set(key)) != len(key) \
            or min(key) < 0:
        raise DistributedError(
            f"create_group(group, rank_ids) needs a group name (a non-empty str) and a "
            f"non-empty list of distinct rank ids >= 0; got group={group!r}, "
            f"rank_ids={rank_ids!r}.\nFix: e.g. create_group('dp_group', [0, 1]).")
    old = _named_groups.get(group)
    if old is not None and old != key:
        raise DistributedError(
            f"create_group: the group name {group!r} already names ranks {list(old)}; got "
            f"{list(key)}.\nFix: give each group its own name.")
    if is_initialized() and old is None and rank() in key and key != tuple(range(world_size())):
        from mindspore.communication import create_group as ms_create_group

        try:
            ms_create_group(group, list(key))
        except (RuntimeError, ValueError) as e:
            raise DistributedError(
                f"MindSpore could not create the communication group {group!r} of ranks "
                f"{list(key)!r}: {e}") from e
    _named_groups[group] = key


def group_ranks(group: str) -> tuple[int, ...] | None:
    """The rank ids of a group named by ``create_group`` (or, inside a job, by
    MindSpore's own ``create_group``); None for a name fshard does not know."""
    if group in _named_groups:
        return _named_groups[group]
    if is_initialized():
        from mindspore.communication import get_process_group_ranks

        try:
            return tuple(int(r) for r in get_process_group_ranks(group))
        except (RuntimeError, ValueError, TypeError):
            return None
    return None
