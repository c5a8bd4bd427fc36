"""Training at scale on fshard's transforms: ``AutoParallel`` (MindSpore's interface
over a sharded, compiled train step, configured by ``ParallelOptions`` with a
``ParallelMode``) and ``Model`` (MindSpore's ``Model`` driving it)."""

from fshard.training.parallel.auto_parallel import AutoParallel, TrainState
from fshard.training.parallel.ms_train import Model
from fshard.training.parallel.options import ParallelMode, ParallelOptions

__all__ = ["AutoParallel", "Model", "ParallelMode", "ParallelOptions", "TrainState"]
