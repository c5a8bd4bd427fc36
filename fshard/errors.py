"""The FshardError hierarchy.

Every user-facing failure raises one of these classes. Each also subclasses the
builtin a user would expect (``TypeError``, ``ValueError``, ...), and each message
ends with a pointer to its entry in ``docs/errors.md``. Internal invariants use
``assert``: an ``AssertionError`` is a bug in fshard, never a user error.
"""

from __future__ import annotations

DOCS = "docs/errors.md"


class FshardError(Exception):
    """Base class of every error fshard raises on purpose."""

    def __init__(self, message: str):
        name = type(self).__name__
        super().__init__(f"{message}\nSee {DOCS}#{name.lower()}")


class TracerConversionError(FshardError, TypeError):
    """A traced value was used where a concrete Python value is needed.

    Example: ``fs.jit(lambda x: 1 if x.sum() > 0 else 0)`` calls ``bool()`` on a
    traced value. Fix: use ``fs.ops.where`` or mark the argument static.
    """


class UnsupportedOpError(FshardError, NotImplementedError):
    """A MindSpore op or Cell was called on a traced value and fshard has no primitive for it."""


class UnsupportedDtypeError(FshardError, TypeError):
    """MindSpore's kernel for an op does not accept the operands' dtype on this backend
    (on CPU most kernels refuse bfloat16: ``MatMul``, ``Exp``, ``Softmax``, ...).

    Fix: compute that op in a dtype its kernel takes (``x.astype(mindspore.float32)``, or
    an ``fs.amp`` policy whose compute dtype is float16 or float32).
    """


class MissingRuleError(FshardError, NotImplementedError):
    """A transform needs a rule that a primitive does not have."""


class ProgramTypeError(FshardError, TypeError):
    """A Program failed type checking, or a primitive got operands of the wrong type."""


class ShapeError(FshardError, ValueError):
    """Operand shapes are incompatible for an operation (broadcasting, matmul, reshape...)."""


class ArgumentError(FshardError, ValueError):
    """A transform or op was called with an invalid argument (wrong value or structure)."""


class BatchingError(FshardError, ValueError):
    """``vmap`` was given inconsistent axes or batch sizes."""


class DifferentiationError(FshardError, TypeError):
    """``grad`` and friends were applied to something that cannot be differentiated."""


class AxisNameError(FshardError, NameError):
    """A collective named an axis that no enclosing ``vmap``/``shard_map``/mesh binds."""


class ShardingError(FshardError, ValueError):
    """A sharding strategy, layout, mesh or device is invalid."""


class ProcessLocalError(ShardingError, TypeError, AttributeError):
    """An ``fs.ShardedArray`` (of which this process holds only its block) or an
    ``fs.RemoteArray`` (another pipeline stage's leaf, of which it holds nothing) was
    read or computed with eagerly: ``.asnumpy()``, ``x + 1``, ``x.sum()``. Also a
    ``TypeError`` (an unsupported operand) and an ``AttributeError`` (a Tensor method it
    lacks), so ``hasattr`` probes stay False."""


class CompositionError(FshardError, ValueError):
    """Transforms were nested in an order fshard does not allow (e.g. ``vmap(shard(f))``)."""


class TracerLeakError(FshardError, RuntimeError):
    """A traced value escaped the transform that created it and was used later."""


class DistributedError(FshardError, RuntimeError):
    """A multi-process job failed: launch, init, or a rank exited with an error."""


class CheckpointError(FshardError, OSError):
    """A checkpoint could not be written or read: a missing, truncated or altered file,
    another program's index, a leaf whose shape or dtype differs, a save that timed out."""


class OperatorStrategyWarning(UserWarning):
    """A MindSpore ``Primitive.shard`` strategy (``ops.MatMul().shard(...)``) fshard
    cannot honour (inside an ``fs.shard_map`` body, or an ``interleaved_parallel``
    Layout); under ``fs.shard`` every other strategy is the operator's plan."""


class PipelineBalanceWarning(UserWarning):
    """A pipeline whose stages' estimated costs differ more than ``pipeline(...,
    max_imbalance=)`` allows: each step runs at the pace of the slowest stage."""


class GenericOpWarning(UserWarning):
    """A MindSpore op without a native fshard rule ran in a slower form than a native
    rule would give: under ``vmap`` once per example (MindSpore has no batching rule
    for it), or under ``shard`` replicated (it is not elementwise). Once per op."""


class KeyReuseWarning(UserWarning):
    """An ``fs.random`` key consumed twice in one traced function (two draws, or a
    draw and a ``split`` of the same key): both see the same random bits."""
