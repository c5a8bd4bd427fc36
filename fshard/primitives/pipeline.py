"""``pipeline_split``: the marker that ends one pipeline stage and starts the next.

The marker is the identity on values. ``fs.AutoParallel(...).pipeline(...)`` reads it
from the traced loss to cut the program into stages (fshard/training/parallel/pipeline.py);
everywhere else (eager, ``jit``, ``grad``, ``shard``) it is a no-op, so a model
marked for a pipeline runs unchanged on one device (as MindSpore's
``cell.pipeline_stage`` does). A marked value inside ``vmap`` cannot be a stage
boundary (a stage runs whole micro-batches), so staging a marker inside ``vmap`` is an
error.

``stage=None`` (``fs.pipeline_split``) means "the stage after the one ``x`` comes
from"; ``stage=k`` (a Cell with ``pipeline_stage = k``) names the stage.
"""

from __future__ import annotations

from fshard.core import context, tree
from fshard.errors import ArgumentError, CompositionError
from fshard.primitives.base import def_primitive, deflinear, vectorized
from fshard.core.rules import batching, sharding
from fshard.core.factors import elementwise_spec

FAMILY = "pipeline"


def _ms_identity(x, stage=None):
    return x


pipeline_split_p = def_primitive("pipeline_split", FAMILY, lambda x, stage=None: x,
                                 _ms_identity)
sharding.set(pipeline_split_p, lambda x, stage=None: elementwise_spec(x))
deflinear(pipeline_split_p, lambda ct, x, stage=None: [ct])


batching.set(pipeline_split_p, vectorized(pipeline_split_p))


def check_not_in_vmap() -> None:
    """A marker staged inside ``fs.vmap`` is an error (``shard``'s device batching of
    a staged marker is fine: it batches whole programs, not examples)."""
    if context.vmap_staging.get() > 0:
        raise CompositionError(
            "fs.pipeline_split (or a Cell with pipeline_stage) was called inside fs.vmap: "
            "a pipeline stage boundary cuts whole micro-batches, not the examples of a "
            "vmap.\nFix: mark the stage outside the vmapped function (vmap inside a stage "
            "is fine), or drop the marker.")


def pipeline_split(x, stage: int | None = None):
    """End the current pipeline stage: the next stage receives ``x`` (a tensor or a
    pytree of tensors). The identity outside ``AutoParallel.pipeline``.

    >>> import numpy as np, fshard as fs
    >>> fs.pipeline_split(np.float32(2.0)).asnumpy().item()
    2.0

    Args:
        x: the value(s) the next stage receives.
        stage: the stage the values enter (default: the one after the stage they come
            from); ``cell.pipeline_stage = k`` passes ``k`` here.

    See also: ``fs.AutoParallel.pipeline``, docs/pipeline.md.
    """
    if stage is not None and (isinstance(stage, bool) or not isinstance(stage, int)
                              or stage < 0):
        raise ArgumentError(
            f"fs.pipeline_split(x, stage=...) must be an int >= 0 or None; got {stage!r}.")
    check_not_in_vmap()
    return tree.map(lambda v: pipeline_split_p.bind(v, stage=stage), x)
