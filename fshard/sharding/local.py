"""``ShardedArray``: a global array split across the processes of a job, of which this
process holds only its own block (NB: a ``jax.Array`` with one addressable shard).

In a multi-process job (``python -m fshard.launch`` or ``msrun``, one device per
process) ``fs.shard(..., gather_outputs=False)`` and ``fs.AutoParallel``'s train state
return their split outputs as ``ShardedArray``s instead of all-gathering them onto
every process; given back to a sharded function whose plan lays the input out the
same way, the block goes straight in (no cut, no communication). ``fs.checkpoint``
saves and loads the blocks of each process.

A ``ShardedArray`` has the *global* shape and dtype (``fs.typeof`` gives its global
``ArrayType``), so ``fs.jit`` and ``fs.shard`` trace it like any array. Its values are
not all here: converting it to NumPy is an error; ``gather()`` assembles the global
value (a collective: every process of the job must call it).

On a virtual mesh (one process) nothing is a ``ShardedArray``: every value is global.
"""

from __future__ import annotations

import functools

import numpy as np

from fshard.core.tracing import ArrayType, ProcessLocalValue, typeof
from fshard.errors import ProcessLocalError
from fshard.primitives import collectives as C
from fshard.sharding.layouts import ShardMesh, Sharding
from fshard.sharding.runtime import world_mesh
from fshard.sharding.strategy import parse_strategy
from fshard.core.staging import stage


def block_bounds(sharding: Sharding, mesh: ShardMesh, rank: int, shape) -> tuple:
    """Per dimension, ``(start, stop)`` of process ``rank``'s block of a value of global
    ``shape`` laid out as ``sharding`` on the prime-axis mesh ``mesh`` (whose ranks are
    row-major, like the job's)."""
    coords = mesh.coords(rank)
    out = []
    for n, axes in zip(shape, sharding.dims):
        index = 0
        for a in axes:  # major first
            index = index * mesh.sizes[a] + coords[a]
        size = n // mesh.count(axes)
        out.append((index * size, (index + 1) * size))
    return tuple(out)


class _ValuesElsewhere(ProcessLocalValue):
    """What ``fs.ShardedArray`` and ``fs.RemoteArray`` refuse alike: every way of reading
    or computing with their values eagerly (``refuse`` says what this process holds and
    the fix)."""

    __slots__ = ()

    # (a subclass has ``shape`` and ``dtype``)
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def aval(self) -> ArrayType:
        return ArrayType(self.shape, self.dtype)

    def asnumpy(self):
        self.refuse(".asnumpy()")

    def __array__(self, *args, **kwargs):
        self.refuse("numpy.asarray()")

    def item(self):
        self.refuse(".item()")

    def tolist(self):
        self.refuse(".tolist()")

    def __float__(self):
        self.refuse("float()")

    def __int__(self):
        self.refuse("int()")

    def __bool__(self):
        self.refuse("bool()")

    def __index__(self):
        self.refuse("operator.index()")

    def __len__(self):
        self.refuse("len()")

    def __iter__(self):
        self.refuse("iteration")

    def __getitem__(self, index):
        self.refuse("indexing x[...]")

    def __setitem__(self, index, value):
        self.refuse("assigning x[...] = v")

    # Eager operators and Tensor methods would compute on the block as if it were the
    # whole array (or fail inside MindSpore; a RemoteArray has no values at all):
    # refused with the fix. `==` and `!=` stay
    # identity (containers and caches compare values with them).
    def __getattr__(self, name: str):
        if not name.startswith("_") and hasattr(_tensor_class(), name):
            self.refuse(f"the Tensor method .{name}")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")


class ShardedArray(_ValuesElsewhere):
    """A global array laid out over the processes of a job; this process holds its
    block (``block``, a MindSpore Tensor).

    Attributes:
        shape, dtype: the global array's (``fs.typeof(x)`` is its global type).
        block: this process's block, a MindSpore Tensor of shape ``local_shape``.
        sharding: the mesh axes splitting each dimension
            (``fshard.sharding.layouts.Sharding`` over ``mesh``'s prime axes).
        mesh: the job's devices as prime-sized axes (``ShardMesh``); for a pipeline
            stage's block (``fs.AutoParallel`` with ``pipeline`` and tensor-parallel
            stages in a job), the stage's processes, one of the job's equal groups
            of consecutive ranks (a rank's coordinates are taken modulo the mesh).
        rank: the process whose block this is.

    ``strategy`` gives the split counts (MindSpore's view), ``bounds`` the block's
    ``(start, stop)`` per dimension, ``gather()`` the global value (a collective).

    Process 1's block of a 4 x 2 array split in 2 row blocks over 2 processes (as
    ``fs.shard(..., gather_outputs=False)`` returns it in a job):

    >>> import numpy as np, fshard as fs
    >>> from fshard.sharding.layouts import ShardMesh
    >>> x = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> y = fs.ShardedArray.cut(x, (2, 1), ShardMesh((2,)), rank=1)
    >>> str(fs.typeof(y)), y.bounds, y.block.asnumpy().tolist()
    ('f32[4,2]', ((2, 4), (0, 2)), [[4.0, 5.0], [6.0, 7.0]])
    >>> y.asnumpy()
    Traceback (most recent call last):
    ...
    fshard.errors.ProcessLocalError: .asnumpy() needs the values of a f32[4,2] array, ...
    """

    __slots__ = ("block", "shape", "dtype", "sharding", "mesh", "rank")

    def __init__(self, block, shape, dtype, sharding: Sharding, mesh: ShardMesh, rank: int):
        self.block, self.shape, self.dtype = block, tuple(shape), dtype
        self.sharding, self.mesh, self.rank = sharding, mesh, rank
        want = sharding.local_shape(self.shape, mesh)
        got = tuple(typeof(block).shape)
        assert got == want, f"block {got} of a {self.shape} array split as {want}"

    # -- what it is ------------------------------------------------------------------
    @property
    def local_shape(self) -> tuple:
        return self.sharding.local_shape(self.shape, self.mesh)

    @property
    def strategy(self) -> tuple:
        """Split counts per dimension, e.g. ``(2, 1)``."""
        return self.sharding.strategy(self.mesh)

    @property
    def bounds(self) -> tuple:
        """``(start, stop)`` per dimension of this process's block."""
        return block_bounds(self.sharding, self.mesh, self.rank, self.shape)

    def __repr__(self) -> str:
        return (f"ShardedArray({self.aval}, strategy={self.strategy}, process {self.rank} "
                f"holds {list(self.bounds)})")

    # -- getting the values ------------------------------------------------------------
    def gather(self):
        """The global value as a MindSpore Tensor: an AllGather over the job, so every
        process must call it (in the same order)."""
        self._check_job_wide("x.gather()")
        return _gather_fn(self.sharding, self.mesh, typeof(self.block))(self.block)

    def _check_job_wide(self, what: str) -> None:
        """A pipeline stage's block (over the stage's processes only) is refused: the
        other stages' processes hold none of it, so no collective over the job can
        assemble it alone."""
        from fshard.meshes import distributed

        world = distributed.world_size() if distributed.is_initialized() else 1
        if self.mesh.size < world:
            raise ProcessLocalError(
                f"{what}: this {self.aval} array is split over {self.mesh.size} of the "
                f"job's {world} processes only (a pipeline stage's block: the other "
                "stages' processes hold none of it), so a collective over the job cannot "
                "assemble it.\nFix: call ap.gather(state) / ap.gather_params(state) of the "
                "fs.AutoParallel whose step returned it, in every process (a collective "
                "that brings every stage's leaves to every process).")

    def refuse(self, what: str):
        raise ProcessLocalError(
            f"{what} needs the values of a {self.aval} array, but this process holds only "
            f"its block {list(self.bounds)} of it (an fs.ShardedArray, split "
            f"{self.strategy} over the job's processes).\nFix: call x.gather() (or "
            "ap.gather(state) / ap.gather_params(state) for an fs.AutoParallel train "
            "state, fs.gather_sharded(tree) for any pytree) in every process first: it is "
            "a collective; or compute inside fs.jit / fs.shard, which take the array as "
            "it is; x.block is this process's block.")

    # -- making one ---------------------------------------------------------------------
    @staticmethod
    def cut(x, strategy, mesh: ShardMesh, rank: int) -> "ShardedArray":
        """Process ``rank``'s block of the global value ``x`` (a Tensor or NumPy array
        every process holds) under ``strategy`` (split counts, an ``fs.Layout`` view or
        a ``Sharding``): no communication."""
        from fshard.backend.mindspore import as_tensor

        a = typeof(x)
        sh = strategy if isinstance(strategy, Sharding) else parse_strategy(
            strategy, a, mesh, "ShardedArray.cut(strategy)", f"a {a} array")
        bounds = block_bounds(sh, mesh, rank, a.shape)
        host = x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)
        block = np.ascontiguousarray(host[tuple(slice(s, e) for s, e in bounds)])
        return ShardedArray(as_tensor(block), a.shape, a.dtype, sh, mesh, rank)


class RemoteArray(_ValuesElsewhere):
    """A leaf of a pipelined train state that other processes of the job keep: in a
    multi-process job with ``ap.pipeline(stages=S)`` each process keeps and updates only
    its own stage's parameters and optimizer state; the other stages' leaves of the state
    it gets back are ``RemoteArray`` leaves, which hold no values (only the global type).

    Attributes:
        shape, dtype: the leaf's (``fs.typeof(x)`` is its ``ArrayType``).
        stage: the pipeline stage that keeps it.
        holders: the ranks of that stage's processes (each keeps the whole leaf, or
            on a tensor-parallel stage its block of it).
        rank: this process.

    Reading its values is an ``fs.ProcessLocalError`` with the fix:
    ``ap.gather_params(state)`` / ``ap.gather(state)`` (a collective every process
    calls) bring every stage's leaves to every process. The step takes it back as it is.
    """

    __slots__ = ("shape", "dtype", "stage", "holders", "rank")

    def __init__(self, shape, dtype, stage: int, holders, rank: int):
        self.shape, self.dtype = tuple(shape), dtype
        self.stage, self.holders, self.rank = stage, tuple(holders), rank

    def __repr__(self) -> str:
        return (f"RemoteArray({self.aval}, kept by pipeline stage {self.stage}: processes "
                f"{list(self.holders)}; process {self.rank} holds none of it)")

    def refuse(self, what: str):
        raise ProcessLocalError(
            f"{what} needs the values of a {self.aval} array, but process {self.rank} "
            f"holds none of it: it is pipeline stage {self.stage}'s parameter or "
            "optimizer state, which only that stage's processes "
            f"{list(self.holders)} keep (an fs.RemoteArray).\nFix: call "
            "ap.gather_params(state) (the parameters) or ap.gather(state) (the whole "
            "state) in every process first: a collective that brings every stage's "
            f"leaves to every process; or read it on processes {list(self.holders)}.")


_OPERATORS = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
    "pow": "**", "matmul": "@", "and": "&", "or": "|", "xor": "^", "lshift": "<<",
    "rshift": ">>"}


def _refusing(what: str):
    def op(self, *args):
        self.refuse(what)
    return op


for _name, _sym in _OPERATORS.items():
    for _dunder in (f"__{_name}__", f"__r{_name}__", f"__i{_name}__"):
        setattr(_ValuesElsewhere, _dunder, _refusing(f"the eager operator {_sym!r}"))
for _name, _sym in {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "neg": "unary -",
                    "pos": "unary +", "abs": "abs()", "invert": "~", "round": "round()"
                    }.items():
    setattr(_ValuesElsewhere, f"__{_name}__", _refusing(f"the eager operator {_sym!r}"))


def _tensor_class():
    from fshard.backend.mindspore import Tensor

    return Tensor


@functools.lru_cache(maxsize=None)
def _gather_fn(sharding: Sharding, mesh: ShardMesh, block_type: ArrayType):
    """The compiled AllGather of a block laid out as ``sharding`` (collectives of a job
    only run in graphs)."""
    from fshard.backend import mindspore as backend

    dims = tuple(mesh.name(ax) for ax in sharding.dims)
    world = world_mesh(mesh)
    program, consts = stage(lambda b: [C.shard_out_p.bind(b, dims=dims, mesh=world)],
                            [block_type])
    src, globals_, _ = backend.lower_program(program, consts, "gather_blocks")
    return backend.compile_source(src, globals_, "gather_blocks")


def gather_sharded(tree_):
    """``tree_`` with every ``ShardedArray`` leaf replaced by its global value (one
    AllGather per such leaf: every process of the job must call it), e.g. to print a
    train state in a job::

        params = fs.gather_sharded(state.params)  # on every process
        if fs.distributed.rank() == 0:
            print({k: v.asnumpy().sum() for k, v in params.items()})
    """
    from fshard.core import tree

    # (refused before any collective, so that every process stops alike)
    for x in tree.leaves(tree_):
        if isinstance(x, RemoteArray):  # (only its stage's processes can give it)
            x.refuse("fs.gather_sharded")
    for x in tree.leaves(tree_):
        if isinstance(x, ShardedArray):
            x._check_job_wide("fs.gather_sharded")
    return tree.map(lambda x: x.gather() if isinstance(x, ShardedArray) else x, tree_)
