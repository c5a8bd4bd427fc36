"""Run several seed scripts, unchanged, one after the other in this process:
``python run_seeds.py [--virtual] seed_a.py seed_b.py ...`` (under ``msrun``, the
launcher, or alone).

Each script starts as it would alone: MindSpore's parallel context reset (a script's
``set_auto_parallel_context`` must not leak into the next) and MindSpore's global seed
set to 0 (which also seeds ``mindspore.dataset``'s shuffle), so that scripts drawing
their weights without a seed of their own give the same numbers in a job and in the
reference run. Before each script a line ``=== <script>`` is printed, so the output can
be split by script. ``--virtual``: the reference run in one process on fshard's virtual
mesh (``FSHARD_DEVICES`` devices): ``mindspore.communication``'s ``init``,
``get_rank`` and ``get_group_size`` become ``virtual_comm``'s, which the scripts'
import lines then pick up.
"""

from __future__ import annotations

import os
import runpy
import sys

import mindspore as ms


def main(argv: list) -> None:
    virtual = "--virtual" in argv
    scripts = [a for a in argv if a != "--virtual"]
    if virtual:
        import mindspore.communication as comm

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import virtual_comm

        for name in ("init", "get_rank", "get_group_size"):
            setattr(comm, name, getattr(virtual_comm, name))
    for script in scripts:
        ms.reset_auto_parallel_context()
        ms.set_seed(0)
        print(f"=== {os.path.basename(script)}", flush=True)
        runpy.run_path(script, run_name="__main__")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
