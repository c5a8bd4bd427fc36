"""Training at scale on fshard's transforms: ``AutoParallel`` (MindSpore's interface
over a sharded, compiled train step) and ``Model`` (MindSpore's ``Model`` driving it)."""

from fshard.training.parallel.auto_parallel import AutoParallel, TrainState
from fshard.training.parallel.ms_train import Model

__all__ = ["AutoParallel", "Model", "TrainState"]
