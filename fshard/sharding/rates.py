"""Where this machine's measured rates live and how they are read: the tables
``fs.sharding.calibrate()`` (fshard/sharding/calibration.py) writes, one file per backend,
MindSpore version and virtual device count. The cost model (fshard/sharding/cost.py)
reads them through ``calibrated``; nothing here measures.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np

from fshard.backend.mindspore import device_target, ms_version
from fshard.errors import ShardingError

#: Version of the table's format: a file of another version is refused (measure again).
FORMAT = 1


def cache_dir() -> Path:
    """Where calibration tables live: ``$FSHARD_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/fshard``, else ``~/.cache/fshard``."""
    d = os.environ.get("FSHARD_CACHE_DIR")
    if d:
        return Path(d)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fshard"


def cache_path(devices: int, job: bool = False) -> Path:
    """The file of the table for ``devices`` virtual devices on this backend, or with
    ``job`` for a multi-process job of ``devices`` processes."""
    version = ms_version()
    kind = "job" if job else ""
    return cache_dir() / f"calibration-{device_target()}-ms{version}-{kind}{devices}.json"


def check_devices(devices) -> int:
    if isinstance(devices, bool) or not isinstance(devices, (int, np.integer)) or devices < 1:
        raise ShardingError(
            f"fs.sharding.calibrate: devices must be a positive int (the virtual mesh's "
            f"device count the table is for); got {devices!r}.\nFix: pass e.g. devices=8, "
            f"or leave it out to use FSHARD_DEVICES (default 8).")
    return int(devices)


def default_devices() -> int:
    try:
        n = int(os.environ.get("FSHARD_DEVICES", "8"))
    except ValueError:
        n = 8
    return max(n, 1)


def calibrated(devices: int, job: bool = False) -> dict | None:
    """The cached table for ``devices`` virtual devices on this backend (with ``job``:
    for a job of ``devices`` processes), or None when this machine has not been
    calibrated for them."""
    path = cache_path(devices, job)
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    return _load(str(path), mtime)


_NUMBERS = ("call_s", "op_s", "flops_per_s", "point_s")
#: Measured by later fshard versions; a table without them prices as before them.
_LATER_NUMBERS = ("arg_s", "matmul_c", "matmul_p", "matmul_elem_s")  # (and "matmul_points")


@functools.lru_cache(maxsize=16)  # one read per file version: planning asks often
def _load(path: str, mtime: int) -> dict | None:
    try:
        table = json.loads(Path(path).read_text())
        ok = (isinstance(table, dict) and table.get("format") == FORMAT
              and all(isinstance(table.get(k), (int, float)) and table[k] >= 0
                      for k in _NUMBERS)
              and all(isinstance(table.get(k, 0.0), (int, float)) and table.get(k, 0.0) >= 0
                      for k in _LATER_NUMBERS)
              and table["flops_per_s"] > 0
              and isinstance(table.get("devices"), int) and table["devices"] >= 1
              and all(isinstance(table.get(k), dict) and all(
                  isinstance(n, str) and n.isdigit() and isinstance(v, list) and len(v) == 2
                  and all(isinstance(t, (int, float)) for t in v) and min(v) >= 0
                  for n, v in table[k].items())
                  for k in ("all_reduce", "all_gather") + (("slice",) if "slice" in table else ()))
              and _points_ok(table.get("matmul_points", []))
              and _points_ok(table.get("adam_points", [])))
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise ShardingError(
            f"fshard's calibration table {path!r} is not one fs.sharding.calibrate() "
            f"wrote (unreadable, edited, or of another fshard version).\nFix: run "
            f"fs.sharding.calibrate() to measure again, or delete the file to plan with "
            f"the default rates.")
    return table


def _points_ok(points) -> bool:
    """``matmul_points`` (``[flops, seconds]``) or ``adam_points`` (``[elements,
    seconds per element]``): pairs, the first rising, all positive."""
    return (isinstance(points, list)
            and all(isinstance(pt, list) and len(pt) == 2
                    and all(isinstance(v, (int, float)) and v > 0 for v in pt)
                    for pt in points)
            and all(a[0] < b[0] for a, b in zip(points, points[1:])))


def load_cache_clear() -> None:
    """Forget the tables read (after ``calibrate`` rewrote one)."""
    _load.cache_clear()
