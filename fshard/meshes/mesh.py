"""Device meshes: named axes over a set of ranks, and which mesh is in effect.

A ``Mesh`` arranges ``size`` devices (rank ids ``0..size-1``, row-major: the last
axis varies fastest, as in MindSpore's device matrix) into a grid with named axes.
It is *virtual* (simulated in one process) unless this process is one rank of a
multi-process job started with ``python -m fshard.launch`` or ``msrun``, in which
case the mesh is the job's world and each rank is one process.

``resolve_mesh`` answers "which mesh applies here": an explicit argument, the
innermost ``with mesh:`` block, the world of an initialised job, or a virtual
1-D mesh of ``FSHARD_DEVICES`` devices. This module runs no MindSpore code; it
asks ``fshard.meshes.distributed`` whether a job is initialised.
"""

from __future__ import annotations

import math
import os
from typing import Iterable, Sequence

import numpy as np

from fshard.core import context
from fshard.errors import ShardingError
from fshard.meshes.layout import Layout, check_axis_names

__all__ = ["Mesh", "resolve_mesh", "current_mesh", "DEFAULT_AXIS", "ENV_DEVICES"]

#: Axis name of the default 1-D mesh (the world of a job, or FSHARD_DEVICES devices).
DEFAULT_AXIS = "d"
#: Environment variable giving the size of the default virtual mesh.
ENV_DEVICES = "FSHARD_DEVICES"


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


class Mesh:
    """A grid of devices with named axes.

    >>> mesh = Mesh((2, 4), ("dp", "mp"))
    >>> mesh.size, mesh.axis_size("mp")
    (8, 4)
    >>> mesh.coords(6)
    (1, 2)
    >>> mesh.axis_groups("mp")
    [(0, 1, 2, 3), (4, 5, 6, 7)]
    >>> with mesh:
    ...     resolve_mesh() is mesh
    True

    Args:
        shape: number of devices along each axis, e.g. ``(2, 4)``; an int means 1-D.
        axis_names: one unique name per axis, e.g. ``("dp", "mp")``.
        virtual: ``None`` (default) means "the job's world if this process is a rank of
            an initialised multi-process job, else simulated in this process";
            ``True`` forces an in-process virtual mesh even inside a job.

    Raises:
        ShardingError: for a non-positive or non-int axis size, a name count that does
            not match the shape, repeated or invalid names, or (inside a job) a mesh
            whose size differs from the world size.

    See also: ``resolve_mesh``, ``fshard.Layout``, docs/meshes_and_layouts.md.
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        axis_names: str | Sequence[str],
        *,
        virtual: bool | None = None,
    ):
        fix = "Fix: pass e.g. fs.Mesh((2, 4), ('dp', 'mp'))."
        if _is_int(shape):
            shape = (shape,)
        try:
            shape = tuple(shape)
        except TypeError:
            raise ShardingError(
                f"Mesh shape must be a tuple of positive ints, e.g. (2, 4); got {shape!r} "
                f"({type(shape).__name__}). {fix}"
            ) from None
        if not shape:
            raise ShardingError(f"Mesh shape must have at least one axis; got (). {fix}")
        for i, s in enumerate(shape):
            if not _is_int(s) or s < 1:
                raise ShardingError(
                    f"Mesh shape[{i}] must be a positive int (a number of devices); got "
                    f"{s!r} ({type(s).__name__}) in {shape!r}. {fix}"
                )
        names = check_axis_names(axis_names, "Mesh axis_names", fix)
        if len(names) != len(shape):
            raise ShardingError(
                f"Mesh needs one axis name per axis: shape {shape!r} has {len(shape)} axes "
                f"but axis_names {names!r} has {len(names)}. {fix}"
            )
        if virtual not in (None, True, False):
            raise ShardingError(f"Mesh virtual must be None, True or False; got {virtual!r}.")
        self._shape = tuple(int(s) for s in shape)
        self._names = names
        self._virtual = virtual
        if virtual is False:
            self._check_world()

    # -- basic properties ------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """Number of devices along each axis."""
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        """Total number of devices."""
        return math.prod(self._shape)

    @property
    def is_virtual(self) -> bool:
        """True when the mesh is simulated in this process (not one rank per process)."""
        if self._virtual is not None:
            return self._virtual
        from fshard.meshes import distributed

        return not distributed.is_initialized()

    @property
    def devices(self) -> np.ndarray:
        """Rank ids laid out on the mesh (row-major: last axis fastest).

        >>> Mesh((2, 2), ("x", "y")).devices.tolist()
        [[0, 1], [2, 3]]
        """
        return np.arange(self.size).reshape(self._shape)

    def axis_index(self, name: str) -> int:
        """Position of the axis called ``name``."""
        if name not in self._names:
            raise ShardingError(
                f"{self!r} has no axis named {name!r}; its axes are {self._names!r}. "
                f"Fix: use one of those names."
            )
        return self._names.index(name)

    def axis_size(self, name: str) -> int:
        """Number of devices along the axis called ``name``.

        >>> Mesh((2, 4), ("dp", "mp")).axis_size("dp")
        2
        """
        return self._shape[self.axis_index(name)]

    def _check_rank(self, rank) -> int:
        if not _is_int(rank) or not 0 <= rank < self.size:
            raise ShardingError(
                f"rank must be an int in [0, {self.size}) for {self!r}; got {rank!r}."
            )
        return int(rank)

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank`` on the mesh (row-major unravel).

        >>> Mesh((2, 4), ("dp", "mp")).coords(5)
        (1, 1)
        """
        rank = self._check_rank(rank)
        return tuple(int(c) for c in np.unravel_index(rank, self._shape))

    def rank_at(self, coords: Sequence[int]) -> int:
        """The rank at ``coords`` (inverse of ``coords``)."""
        coords = tuple(coords)
        if len(coords) != self.ndim or not all(
            _is_int(c) and 0 <= c < s for c, s in zip(coords, self._shape, strict=False)
        ):
            raise ShardingError(
                f"coords must be {self.ndim} ints within {self._shape!r}; got {coords!r}."
            )
        return int(np.ravel_multi_index(coords, self._shape))

    # -- communication groups --------------------------------------------------------

    def _axes(self, axis_names) -> tuple[int, ...]:
        if isinstance(axis_names, str):
            axis_names = (axis_names,)
        names = tuple(axis_names)
        for n in names:
            self.axis_index(n)
        if len(set(names)) != len(names):
            raise ShardingError(f"axis_names {names!r} repeats an axis; name each axis once.")
        return tuple(self._names.index(n) for n in names)

    def axis_groups(self, axis_names: str | Iterable[str]) -> list[tuple[int, ...]]:
        """The groups of ranks that communicate over ``axis_names``.

        Each group holds the ranks that differ only in their coordinates along the
        named axes; within a group, ranks are ordered by those coordinates with the
        first listed axis most significant (JAX's order for a tuple of axis names, and
        the order of a group's ``axis_index``). Groups are listed row-major over the
        remaining axes. These are the rank lists to pass to ``create_group``.

        >>> m = Mesh((2, 2, 2), ("a", "b", "c"))
        >>> m.axis_groups("a")
        [(0, 4), (1, 5), (2, 6), (3, 7)]
        >>> m.axis_groups(("c", "a"))
        [(0, 4, 1, 5), (2, 6, 3, 7)]
        >>> m.axis_groups(())
        [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)]
        """
        axes = self._axes(axis_names)
        rest = [i for i in range(self.ndim) if i not in axes]
        # Move the rest axes first, then the named axes in the order given.
        grid = self.devices.transpose(rest + list(axes))
        flat = grid.reshape(math.prod(self._shape[i] for i in rest), -1)
        return [tuple(int(r) for r in row) for row in flat]

    def axis_group(self, axis_names: str | Iterable[str], rank: int) -> tuple[int, ...]:
        """The one group of ``axis_groups(axis_names)`` that contains ``rank``.

        >>> Mesh((2, 4), ("dp", "mp")).axis_group("dp", 6)
        (2, 6)
        """
        rank = self._check_rank(rank)
        for group in self.axis_groups(axis_names):
            if rank in group:
                return group
        raise AssertionError("every rank is in exactly one group")

    def layout(self, *tensor_map):
        """A Layout view of this mesh: ``mesh.layout("dp", "None")``.

        >>> Mesh((2, 4), ("dp", "mp")).layout("dp", "mp").to_strategy()
        (2, 4)
        """
        return Layout(self._shape, self._names)(*tensor_map)

    # -- world / context --------------------------------------------------------------

    def _check_world(self) -> None:
        from fshard.meshes import distributed

        if not distributed.is_initialized():
            raise ShardingError(
                f"{self!r} was created with virtual=False but this process is not a rank of "
                f"an initialised job. Fix: start the script with "
                f"`python -m fshard.launch -n {self.size} script.py` and call "
                f"fs.distributed.init() first, or drop virtual=False."
            )
        world = distributed.world_size()
        if world != self.size:
            raise ShardingError(
                f"{self!r} has {self.size} devices but this job has {world} ranks (one device "
                f"per process). Fix: choose a mesh shape whose product is {world}, or launch "
                f"with -n {self.size}."
            )

    def __enter__(self) -> "Mesh":
        if not self.is_virtual:
            self._check_world()
        context.meshes.set(context.meshes.get() + (self,))
        return self

    def __exit__(self, *exc) -> None:
        stack = context.meshes.get()
        assert stack and stack[-1] is self, "Mesh contexts must be exited in LIFO order"
        context.meshes.set(stack[:-1])

    # -- value semantics --------------------------------------------------------------

    def _key(self):
        return (self._shape, self._names, self._virtual)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        extra = "" if self._virtual is None else f", virtual={self._virtual}"
        return f"Mesh({self._shape!r}, {self._names!r}{extra})"


# ---------------------------------------------------------------------------
# Which mesh is in effect
# ---------------------------------------------------------------------------

def current_mesh() -> Mesh | None:
    """The innermost ``with mesh:`` mesh of this thread, or None."""
    return context.innermost(context.meshes)


def context_key() -> tuple:
    """A cheap summary of what the default mesh depends on (part of ``fs.jit``'s cache
    key, so a graph compiled for one mesh is never reused under another)."""
    stack = context.meshes.get()
    if stack:
        return (stack[-1].shape, stack[-1].axis_names)
    from fshard.backend.mindspore import comm_loaded

    return (os.environ.get(ENV_DEVICES), comm_loaded())


def _env_devices() -> int:
    raw = os.environ.get(ENV_DEVICES, "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ShardingError(
            f"{ENV_DEVICES} must be a positive int (the number of virtual devices); got "
            f"{raw!r}. Fix: export {ENV_DEVICES}=8, or pass mesh=fs.Mesh((8,), ('d',))."
        )
    return n


def resolve_mesh(mesh: Mesh | None = None) -> Mesh:
    """The mesh that applies: explicit, else ``with``, else the job's world, else virtual.

    1. ``mesh`` if given;
    2. the innermost ``with fs.Mesh(...):`` block;
    3. inside a job after ``fs.distributed.init()``: a 1-D mesh of the world size with
       axis name ``"d"`` (one device per process);
    4. a virtual 1-D mesh of ``FSHARD_DEVICES`` devices (default 1), axis ``"d"``.

    >>> resolve_mesh(Mesh((4,), ("x",)))
    Mesh((4,), ('x',))
    >>> with Mesh((2, 4), ("dp", "mp")):
    ...     resolve_mesh()
    Mesh((2, 4), ('dp', 'mp'))

    See also: ``Mesh``.
    """
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise ShardingError(
                f"mesh must be an fs.Mesh or None; got {mesh!r} ({type(mesh).__name__}). "
                f"Fix: pass mesh=fs.Mesh((2, 4), ('dp', 'mp'))."
            )
        if not mesh.is_virtual:
            mesh._check_world()
        return mesh
    inner = current_mesh()
    if inner is not None:
        return inner
    from fshard.meshes import distributed

    if distributed.is_initialized():
        return Mesh((distributed.world_size(),), (DEFAULT_AXIS,))
    return Mesh((_env_devices(),), (DEFAULT_AXIS,))
