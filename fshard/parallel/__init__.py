"""Training at scale on fshard's transforms: ``AutoParallel`` (MindSpore's interface
over a sharded, compiled train step)."""

from fshard.parallel.auto_parallel import AutoParallel, TrainState

__all__ = ["AutoParallel", "TrainState"]
