"""SPMD partitioning: from a global Program and the layouts users ask for to the
per-device Program and its run. Above the primitives, below the transforms.

Read in this order:

- ``layouts``: ``ShardMesh`` (prime-sized axes), ``Sharding`` (mesh axes per dimension,
  pending sums), the candidates of an equation (from its primitive's ``FactorSpec``,
  fshard/core/factors.py), and the steps that move a value between layouts;
- ``strategy``: the one parser of user strategies (split counts, ``fs.Layout`` views,
  None) for ``fs.shard``, ``fs.shard_map`` and ``AutoParallel``;
- ``rates``, ``calibration``: this machine's measured rates (``fs.sharding.calibrate()``),
  cached on disk, which the cost model prices with when present;
- ``cost``: the one cost model (computation, and each move as the backend runs it);
- ``propagation``: a layout for every value (MindSpore's algorithm);
- ``search``: the cost of a whole assignment, exhaustive and dynamic-programming
  search, and the joint choice of mesh axes for tuple strategies;
- ``partition``: the per-device Program, with the collectives inserted;
- ``runtime``: running it on a virtual mesh (batched over the mesh axes) or on this
  rank of a multi-process job (shared by ``fs.shard`` and ``fs.shard_map``);
- ``plan``: ``ShardPlan``, one sharded computation end to end, and strategy files.

The transforms (``fs.shard``, ``fs.shard_map``, the ``shard_call`` primitive) are the
user API over these; nothing here imports them.
"""

from fshard.sharding.calibration import calibrate as calibrate  # noqa: E402
