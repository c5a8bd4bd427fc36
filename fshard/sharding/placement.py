"""``fs.device_put`` and ``fs.block_until_ready``: placing a value with a layout, and
waiting for MindSpore's asynchronous work (NB: ``jax.device_put``,
``jax.block_until_ready``).

A placed value keeps its layout where fshard can use it:

- on a virtual mesh (one process) every value is global: ``device_put`` returns a
  MindSpore Tensor holding the whole value and remembers its strategy; an
  ``fs.shard`` (or ``fs.jit(..., in_shardings=...)``) whose ``in_strategy`` leaves
  that argument to propagation (None) lays it out that way;
- in a multi-process job (one device per process) a split value is an
  ``fs.ShardedArray``: this process keeps only its block, and a sharded function
  whose plan lays the argument out the same way takes the block as it is (no
  communication); a value the strategy leaves whole is a Tensor on every process.
"""

from __future__ import annotations

import numpy as np

from fshard.meshes import distributed
from fshard.core import tree
from fshard.backend import mindspore as backend
from fshard.core.tracing import Tracer, typeof
from fshard.errors import ArgumentError, ShardingError
from fshard.meshes.layout import Layout
from fshard.meshes.mesh import Mesh, resolve_mesh
from fshard.sharding.layouts import ShardMesh
from fshard.sharding.local import ShardedArray
from fshard.sharding.strategy import is_count, is_strategy_leaf, parse_strategy

#: The attribute of a Tensor ``device_put`` made on a virtual mesh: ``(strategy as the
#: user wrote it, device count)``.
PLACEMENT = "_fshard_placement"


def placed_strategy(x, n_devices: int):
    """The strategy ``device_put`` gave ``x`` for a mesh of ``n_devices``, or None (not
    placed, or placed for another device count: propagation chooses)."""
    placed = getattr(x, PLACEMENT, None)
    if placed is None or placed[1] != n_devices:
        return None
    return placed[0]


def _devices(placement, mesh, leaves_entries) -> tuple[int, bool]:
    """(device count, whether they are this job's processes)."""
    if mesh is not None and not isinstance(mesh, Mesh) and not (is_count(mesh) and mesh >= 1):
        raise ShardingError(
            f"fs.device_put(mesh=...) must be an fs.Mesh, a positive device count or None; "
            f"got {type(mesh).__name__} {mesh!r}.\nFix: mesh=8 or mesh=fs.Mesh((2, 4), "
            "('dp', 'mp')).")
    if isinstance(placement, Mesh):
        mesh = placement
    layouts = {e.n_devices for e in leaves_entries if isinstance(e, Layout)}
    if mesh is None and layouts:
        n = layouts.pop()
        if layouts:
            raise ShardingError(
                "fs.device_put: the fs.Layout views of the placement are for different "
                "device counts.\nFix: build them from one Layout (one device matrix).")
        in_job = distributed.is_initialized() and n == distributed.world_size()
        return n, in_job
    m = mesh if isinstance(mesh, Mesh) else resolve_mesh(None) if mesh is None else None
    if m is None:  # a count
        return int(mesh), distributed.is_initialized() and int(mesh) == distributed.world_size()
    return m.size, not m.is_virtual


def device_put(x, placement=None, *, mesh=None):
    """``x`` (a pytree of arrays) as MindSpore Tensors, laid out as ``placement`` says
    (NB: ``jax.device_put``).

    >>> import numpy as np, fshard as fs
    >>> fs.device_put(np.ones(2, np.float32))
    Tensor(shape=[2], dtype=Float32, value= [ 1.00000000e+00,  1.00000000e+00])

    With a placement, a sharded function that leaves the argument to propagation lays
    it out that way:

    >>> with fs.Mesh(4, "d"):
    ...     x = fs.device_put(np.ones((8, 2), np.float32), (4, 1))
    ...     f = fs.shard(lambda x: x * 2.0, in_strategy=(None,))
    >>> f.strategies(x)["inputs"][0]["strategy"]
    [4, 1]

    Args:
        x: a pytree of arrays (NumPy arrays, MindSpore Tensors, Python scalars).
        placement: None (Tensors, no layout), a strategy (split counts per dimension,
            e.g. ``(4, 1)``, or an ``fs.Layout`` view) or a pytree prefix of ``x``
            holding strategies, or an ``fs.Mesh`` (replicated over it).
        mesh: the devices the strategies refer to (an ``fs.Mesh`` or a count); default:
            an ``fs.Layout``'s own devices, else the mesh in effect (``with fs.Mesh``,
            the job's world, or ``FSHARD_DEVICES``).

    Returns:
        ``x`` with every array leaf a MindSpore Tensor (on a virtual mesh, carrying its
        strategy); in a multi-process job, a leaf the strategy splits is an
        ``fs.ShardedArray`` holding this process's block.

    Raises:
        ShardingError: a strategy that does not fit the value or the devices.
        ArgumentError: a leaf that is not an array, or a traced value (``device_put``
            places concrete values; inside a sharded function use
            ``fs.with_sharding_constraint``).
    """
    paths, leaves, structure = tree.flatten_with_path(x)
    for p, leaf in zip(paths, leaves):
        if isinstance(leaf, Tracer):
            raise ArgumentError(
                f"fs.device_put: x{tree.keystr(p)} is a traced value ({leaf.aval}); "
                "device_put places concrete values.\nFix: inside fs.shard, use "
                "fs.with_sharding_constraint(x, strategy) to fix a traced value's layout.")
    if placement is None or isinstance(placement, Mesh):
        entries = [None] * len(leaves)
    else:
        try:
            entries = tree.broadcast_prefix(placement, x, is_leaf=is_strategy_leaf)
        except ValueError as e:
            raise ShardingError(
                f"fs.device_put: the placement {placement!r} does not match x's structure "
                f"{tree.structure(x)}: {e}\nFix: give one strategy, or a pytree prefix of x "
                "holding strategies.") from None
    if placement is None and mesh is None:
        return tree.unflatten(structure, [_tensor(p, v) for p, v in zip(paths, leaves)])
    n, in_job = _devices(placement, mesh, entries)
    smesh = ShardMesh.for_devices(n)
    out = []
    for p, leaf, entry in zip(paths, leaves, entries):
        value = _tensor(p, leaf)
        sh = parse_strategy(entry, typeof(value), smesh, f"fs.device_put: placement"
                            f"{tree.keystr(p)}", f"x{tree.keystr(p)} ({typeof(value)})")
        if sh is None or not any(sh.dims):
            out.append(value)  # whole on every device
        elif in_job:
            out.append(ShardedArray.cut(value, sh, smesh, distributed.rank()))
        else:
            placed = backend.as_tensor(backend.to_numpy(value).copy())  # the caller's
            setattr(placed, PLACEMENT,                                  # Tensor unmarked
                    (tuple(entry) if isinstance(entry, list) else entry, n))
            out.append(placed)
    return tree.unflatten(structure, out)


def _tensor(path, leaf):
    if isinstance(leaf, ShardedArray) or backend.is_tensor(leaf):
        return leaf
    if isinstance(leaf, (np.ndarray, np.generic, bool, int, float)):
        return backend.as_tensor(leaf)
    raise ArgumentError(
        f"fs.device_put: x{tree.keystr(path)} is a {type(leaf).__name__}, not an array.\n"
        "Fix: pass NumPy arrays, MindSpore Tensors or Python numbers.")


def block_until_ready(x):
    """Wait until every array of ``x`` (a pytree) has been computed; return ``x``
    (NB: ``jax.block_until_ready``).

    MindSpore runs operations and compiled graphs asynchronously: a call returns
    before its results exist. Time a computation with this around it:

    >>> import numpy as np, fshard as fs
    >>> y = fs.jit(lambda a: a @ a)(np.ones((4, 4), np.float32))
    >>> fs.block_until_ready(y) is y
    True
    """
    leaves = tree.leaves(x)
    if any(isinstance(leaf, Tracer) for leaf in leaves):
        return x  # traced: nothing runs yet
    backend.synchronize([leaf.block if isinstance(leaf, ShardedArray) else leaf
                         for leaf in leaves if isinstance(leaf, ShardedArray)
                         or backend.is_tensor(leaf)])
    return x
