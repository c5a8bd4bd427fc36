"""``fs.checkpoint.CheckpointManager``: a run's checkpoints, managed (NB: orbax's
``CheckpointManager``): save every N steps, keep the newest K (or the best K by a
metric), restore the latest or the best.

This module holds the policy only; the files are ``fs.checkpoint.save``/``load``'s
(``fshard/training/checkpoint.py`` binds them: ``fs.checkpoint.CheckpointManager``). Each
checkpoint is the step directory ``directory/<step>`` that ``save(directory, state,
step=step)`` writes, atomically; a step's metrics are ``directory/<step>/metrics.json``,
written after the checkpoint is complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Callable

from fshard.meshes import distributed
from fshard.errors import ArgumentError, CheckpointError

METRICS = "metrics.json"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class CheckpointManager:
    """Save a run's state every ``save_interval_steps`` steps, keep ``max_to_keep``
    checkpoints (the newest, or the best by ``best_fn``), restore the latest or the best.

    >>> import tempfile, numpy as np, fshard as fs
    >>> mngr = fs.checkpoint.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2,
    ...                                        save_interval_steps=10)
    >>> state = {"w": np.zeros(3, np.float32)}
    >>> for step in range(35):
    ...     state = {"w": state["w"] + 1}
    ...     saved = mngr.save(step, state)           # True at steps 0, 10, 20, 30
    >>> mngr.all_steps(), mngr.latest_step()
    ([20, 30], 30)
    >>> mngr.restore(like=state)["w"].asnumpy().tolist()   # the latest (step 30)
    [31.0, 31.0, 31.0]

    Keep the best by a metric instead (``best_mode="min"`` for a loss):

    >>> best = fs.checkpoint.CheckpointManager(
    ...     tempfile.mkdtemp(), max_to_keep=1, best_fn=lambda m: m["loss"], best_mode="min")
    >>> for step, loss in enumerate([3.0, 1.0, 2.0]):
    ...     _ = best.save(step, state, metrics={"loss": loss})
    >>> best.all_steps(), best.best_step(), best.metrics(1)
    ([1], 1, {'loss': 1.0})

    Args:
        directory: the run's root directory (created if missing).
        max_to_keep: how many checkpoints to keep (None: all). Without ``best_fn`` the
            newest; with it, the best by ``best_fn`` (those saved without metrics are
            kept as well, as orbax's ``keep_checkpoints_without_metrics``).
        save_interval_steps: ``save(step, ...)`` writes only when ``step`` is a
            multiple of it (``force=True`` writes anyway).
        best_fn: ``metrics -> number`` ranking the checkpoints saved with ``metrics``.
        best_mode: "max" (default) or "min": which end of ``best_fn`` is best.

    In a multi-process job every process makes the manager and calls ``save`` with the
    same arguments (as ``fs.checkpoint.save``); process 0 writes the metrics and
    removes the checkpoints no longer kept.
    """

    #: ``fs.checkpoint.save`` / ``load`` and the index file name (set by
    #: fshard/training/checkpoint.py, which this module cannot import: it re-exports the class).
    _save: Callable | None = None
    _load: Callable | None = None
    _index = "index.json"

    def __init__(self, directory, *, max_to_keep: int | None = None,
                 save_interval_steps: int = 1, best_fn: Callable | None = None,
                 best_mode: str = "max"):
        where = "fs.checkpoint.CheckpointManager"
        try:
            self.directory = os.fspath(directory)
        except TypeError:
            raise ArgumentError(
                f"{where}(directory=...) must be a path (str or os.PathLike); got "
                f"{type(directory).__name__} {directory!r}.") from None
        if max_to_keep is not None and (not _is_int(max_to_keep) or max_to_keep < 1):
            raise ArgumentError(
                f"{where}(max_to_keep=...) must be an int >= 1 or None (keep all); got "
                f"{max_to_keep!r}.")
        if not _is_int(save_interval_steps) or save_interval_steps < 1:
            raise ArgumentError(
                f"{where}(save_interval_steps=...) must be an int >= 1; got "
                f"{save_interval_steps!r}.")
        if best_fn is not None and not callable(best_fn):
            raise ArgumentError(
                f"{where}(best_fn=...) must be a function metrics -> number; got "
                f"{best_fn!r}.\nFix: e.g. best_fn=lambda m: m['accuracy'].")
        if best_mode not in ("max", "min"):
            raise ArgumentError(
                f"{where}(best_mode=...) must be 'max' or 'min'; got {best_mode!r}.")
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"{where}: {self.directory!r} exists and is not a "
                                  "directory.\nFix: choose a directory for the run.")
        os.makedirs(self.directory, exist_ok=True)
        self.max_to_keep, self.save_interval_steps = max_to_keep, save_interval_steps
        self.best_fn, self.best_mode = best_fn, best_mode
        self._pending: list = []  # (step, SaveHandle, metrics) of saves with wait=False

    # -- the steps on disk ---------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints, in increasing order."""
        return sorted(int(d) for d in os.listdir(self.directory) if d.isdigit() and
                      os.path.exists(os.path.join(self.directory, d, self._index)))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict | None:
        """The metrics saved with ``step`` (None: saved without)."""
        file = os.path.join(self._step_dir(step), METRICS)
        if not os.path.exists(file):
            return None
        with open(file) as fh:
            return json.load(fh)

    def best_step(self) -> int | None:
        """The step whose metrics ``best_fn`` ranks best (None without ``best_fn`` or
        metrics; ties: the newest)."""
        ranked = self._ranked()
        return ranked[-1][1] if ranked else None

    def _ranked(self) -> list:
        """``(score, step)`` of the checkpoints with metrics, worst first."""
        if self.best_fn is None:
            return []
        out = []
        for step in self.all_steps():
            m = self.metrics(step)
            if m is None:
                continue
            score = self.best_fn(m)
            if isinstance(score, bool) or not isinstance(score, (int, float)) or (
                    isinstance(score, float) and math.isnan(score)):
                raise ArgumentError(
                    f"fs.checkpoint.CheckpointManager: best_fn returned {score!r} for the "
                    f"metrics of step {step} ({m}); it must return a number (not NaN).")
            out.append((score if self.best_mode == "max" else -score, step))
        return sorted(out)

    def _step_dir(self, step) -> str:
        return os.path.join(self.directory, str(int(step)))

    # -- saving ----------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` writes: a multiple of ``save_interval_steps``
        newer than the latest checkpoint."""
        self._check_step("should_save", step)
        latest = self.latest_step()
        pending = [s for s, _, _ in self._pending]
        newest = max([latest if latest is not None else -1] + pending)
        return step % self.save_interval_steps == 0 and step > newest

    def save(self, step: int, state, *, metrics: dict | None = None, force: bool = False,
             layouts=None, mesh=None, wait: bool = True) -> bool:
        """Write ``state`` as checkpoint ``step`` if ``should_save(step)`` (or
        ``force``), then drop the checkpoints no longer kept; return whether it wrote.

        ``metrics`` (a JSON-able dict, e.g. ``{"loss": 0.3}``) is stored with the step
        for ``best_fn``. ``layouts``, ``mesh`` and ``wait`` are
        ``fs.checkpoint.save``'s; with ``wait=False`` the files are written in the
        background (``wait_until_finished()`` waits, and applies ``max_to_keep``).
        """
        self._check_step("save", step)
        if metrics is not None:
            try:
                text = json.dumps(metrics, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ArgumentError(
                    f"fs.checkpoint.CheckpointManager.save(metrics=...) must be a JSON-able "
                    f"dict of numbers; got {metrics!r} ({e}).\nFix: convert arrays with "
                    "float(x.asnumpy()).") from None
            if not isinstance(metrics, dict):
                raise ArgumentError(
                    f"fs.checkpoint.CheckpointManager.save(metrics=...) must be a dict; got "
                    f"{type(metrics).__name__} {text}.")
        if self.best_fn is not None and metrics is not None:
            self.best_fn(metrics)  # a best_fn that fails on these metrics fails now
        if not force and not self.should_save(step):
            return False
        if os.path.exists(self._step_dir(step)):
            raise CheckpointError(
                f"fs.checkpoint.CheckpointManager.save: step {step} is saved already in "
                f"{self.directory!r}; a checkpoint is never overwritten.\nFix: save a new "
                "step (or delete(step) first).")
        if type(self)._save is None:
            raise CheckpointError("make the manager as fs.checkpoint.CheckpointManager(...)")
        out = type(self)._save(self.directory, state, step=step, layouts=layouts, mesh=mesh,
                               wait=wait)
        if wait:
            self._finish(step, metrics)
        else:
            self._pending.append((step, out, metrics))
        return True

    def _finish(self, step, metrics) -> None:
        if distributed.rank() != 0:
            return
        if metrics is not None:
            tmp = os.path.join(self._step_dir(step), f".{METRICS}.tmp")
            with open(tmp, "w") as fh:
                json.dump(metrics, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, os.path.join(self._step_dir(step), METRICS))
        self._remove_old()

    def _remove_old(self) -> None:
        if self.max_to_keep is None:
            return
        steps = self.all_steps()
        if self.best_fn is None:
            drop = steps[:-self.max_to_keep]
        else:
            ranked = self._ranked()
            drop = [s for _, s in ranked[:-self.max_to_keep]]
        for s in drop:
            shutil.rmtree(self._step_dir(s), ignore_errors=True)

    def wait_until_finished(self) -> None:
        """Wait for the background saves (``save(..., wait=False)``), then store their
        metrics and apply ``max_to_keep``."""
        pending, self._pending = self._pending, []
        for step, handle, metrics in pending:
            handle.wait()
            self._finish(step, metrics)

    def delete(self, step: int) -> None:
        """Remove checkpoint ``step`` (process 0 removes it; every process may call)."""
        self._check_step("delete", step)
        if step not in self.all_steps():
            raise CheckpointError(
                f"fs.checkpoint.CheckpointManager.delete: no checkpoint of step {step} in "
                f"{self.directory!r} (it has {self.all_steps()}).")
        if distributed.rank() == 0:
            shutil.rmtree(self._step_dir(step))

    # -- restoring -----------------------------------------------------------------------
    def restore(self, step: int | None = None, *, like, layouts=None, verify: bool = True):
        """The state saved at ``step`` (default: the latest), read into ``like``'s
        structure (``fs.checkpoint.load``'s ``like``, ``layouts`` and ``verify``)."""
        self.wait_until_finished()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(
                    f"fs.checkpoint.CheckpointManager.restore: {self.directory!r} holds no "
                    "checkpoint yet.\nFix: check latest_step() is not None before restoring.")
        self._check_step("restore", step)
        if step not in self.all_steps():
            raise CheckpointError(
                f"fs.checkpoint.CheckpointManager.restore: no checkpoint of step {step} in "
                f"{self.directory!r} (it has {self.all_steps()}).")
        return type(self)._load(self._step_dir(step), like, layouts=layouts, verify=verify)

    def _check_step(self, what: str, step) -> None:
        if not _is_int(step) or step < 0:
            raise ArgumentError(
                f"fs.checkpoint.CheckpointManager.{what}(step=...) must be an int >= 0; got "
                f"{type(step).__name__} {step!r}.\nFix: pass the training step as an int, "
                "e.g. int(state.step.asnumpy()).")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.wait_until_finished()

    def close(self) -> None:
        """Wait for the background saves (as leaving a ``with`` block does)."""
        self.wait_until_finished()

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, max_to_keep={self.max_to_keep}, "
                f"save_interval_steps={self.save_interval_steps}, steps={self.all_steps()})")
