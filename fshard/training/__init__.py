"""The training layer, built on the transforms: optimizers (``optim``, ``optim_blocks``,
``optim_accumulate``), checkpoints (``checkpoint``, ``checkpoint_manager``), mixed
precision (``amp``) and ``parallel`` (AutoParallel, pipelines, MindSpore's training
spellings). The public names are ``fs.optim``, ``fs.checkpoint``, ``fs.amp`` and
``fs.AutoParallel``."""
