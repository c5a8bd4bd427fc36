"""The transformations: jit, vmap, the grad family, shard_map and shard.

This directory is installed as the package ``fshard.transforms``.
"""

if __name__ != "fshard.transforms":
    raise ImportError(
        "the transforms/ directory is the package fshard.transforms; import it under "
        "that name (install fshard with `pip install -e .`), not as 'transforms'")
