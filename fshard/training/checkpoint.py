"""Checkpoints: save and restore any pytree of arrays (a train state), sharded across
the processes of a job, atomically, in safetensors files with a JSON index.

>>> import os, tempfile, numpy as np, fshard as fs
>>> root = tempfile.mkdtemp()
>>> state = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "step": np.int32(7)}
>>> d = fs.checkpoint.save(root, state, step=7)
>>> fs.checkpoint.latest(root) == d
True
>>> back = fs.checkpoint.load(d, like=state)
>>> back["w"].asnumpy().tolist(), int(back["step"].asnumpy())
([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], 7)

A checkpoint is a directory: ``shard-<p>-of-<P>.safetensors`` per process ``p`` (the
blocks of the leaves that process owns under ``layouts``, of its ``fs.ShardedArray``
leaves, and of the pipeline stage leaves it holds in a job whose state is split by
stage) and ``index.json`` (each
leaf's key path, global shape, dtype, strategy, and which file holds which block, with
every file's size and SHA-256). It is written under a temporary name and renamed when
complete, index last, so a save that dies leaves the previous checkpoints intact and
``latest`` never sees it. No pickle: safetensors and JSON only.

``save_mindspore`` / ``load_mindspore`` and ``save_safetensors`` / ``load_safetensors``
exchange a flat dict of named parameters (``fs.functional(cell)``'s) with MindSpore's
``.ckpt`` files and single safetensors files.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import threading
import time
import uuid
from typing import Any

import numpy as np

from fshard.meshes import distributed
from fshard.core import dtypes, tree
from fshard.core.tracing import typeof
from fshard.errors import ArgumentError, CheckpointError, FshardError
from fshard.meshes.layout import as_layout, block_owners, shard_slices
from fshard.sharding.layouts import ShardMesh
from fshard.sharding.local import RemoteArray, ShardedArray, block_bounds
from fshard.sharding.placement import device_put, placed_strategy
from fshard.sharding.strategy import parse_strategy

__all__ = ["save", "SaveHandle", "load", "latest", "clean", "save_mindspore", "load_mindspore",
           "save_safetensors", "load_safetensors"]

FORMAT = "fshard-checkpoint"
# Version 2: SHA-256 per block (and of each file's header) instead of per file, so a
# process reading only its blocks checks all it reads. Version 1 is still read.
VERSION = 2
READS = (1, 2)
INDEX = "index.json"
_STEP_DIR = re.compile(r"^\d+$")
_TMP_PREFIX = ".tmp-"


# ---------------------------------------------------------------------------
# Small helpers: names, NumPy values, files
# ---------------------------------------------------------------------------


def _name(path) -> str:
    """A leaf's parameter-style name: ``['params']['dense.weight']`` -> ``params.dense.weight``."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, float) and not isinstance(x, np.generic):
        # A Python float is float32 wherever fshard holds it (fs.typeof, a like of
        # load): saved so, {"lr": 0.1} loads back into a like of {"lr": 0.1}.
        return np.asarray(x, np.float32)
    if isinstance(x, (np.generic, bool, int)):
        return np.asarray(x)
    asnumpy = getattr(x, "asnumpy", None)
    if asnumpy is None:
        raise CheckpointError(
            f"fs.checkpoint: cannot save a leaf of type {type(x).__name__}; leaves must be "
            "MindSpore Tensors, NumPy arrays or Python scalars.\nFix: save concrete "
            "values (not traced ones: call save outside jit/vmap/grad).")
    return asnumpy()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _safetensors_bytes(arrays: dict[str, np.ndarray], metadata=None) -> bytes:
    from safetensors.numpy import save

    # (np.ascontiguousarray would turn a 0-d array into a 1-d one)
    return save({k: v if v.flags.c_contiguous else v.copy() for k, v in arrays.items()},
                metadata=metadata)


_SAFETENSORS_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64", "int8": "I8",
                       "int16": "I16", "int32": "I32", "int64": "I64", "uint8": "U8",
                       "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}


def _write_safetensors_durably(path: str, arrays: dict[str, np.ndarray],
                               metadata=None) -> tuple[int, str, dict[str, str]]:
    """Write ``arrays`` as a safetensors file (8-byte header length, JSON header, the
    tensors' bytes in header order), streaming each array's buffer to the file and to
    its own SHA-256 at once, then fsync; return ``(bytes, SHA-256 of the header part,
    {key: SHA-256 of that tensor's bytes})``: a reader checks the blocks it reads and
    nothing else. The same file ``safetensors.numpy.save`` writes, without first
    building it as one bytes object (a second copy of the whole state)."""
    header: dict[str, Any] = {}
    offset = 0
    for k in sorted(arrays):
        v = arrays[k]
        header[k] = {"dtype": _SAFETENSORS_DTYPES[v.dtype.name], "shape": list(v.shape),
                     "data_offsets": [offset, offset + v.nbytes]}
        offset += v.nbytes
    if metadata:
        header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the tensors start 8-byte aligned
    head = struct.pack("<Q", len(head)) + head
    blocks = {}
    with open(path, "wb") as fh:
        fh.write(head)
        for k in sorted(arrays):
            buf = memoryview(np.ascontiguousarray(arrays[k]).reshape(-1).view(np.uint8))
            fh.write(buf)
            blocks[k] = hashlib.sha256(buf).hexdigest()
        fh.flush()
        os.fsync(fh.fileno())
    return len(head) + offset, hashlib.sha256(head).hexdigest(), blocks


def _world() -> tuple[int, int]:
    """``(this process, processes)`` of the job (``(0, 1)`` outside one)."""
    if distributed.is_initialized():
        return distributed.rank(), distributed.world_size()
    return 0, 1


def _job_token(nproc: int) -> str:
    """A name every process of this job agrees on, and no other job uses."""
    if nproc == 1:
        return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    parent = os.environ.get("FSHARD_LAUNCH_PARENT", str(os.getppid()))
    return f"{parent}-{os.environ.get('MS_SCHED_PORT', '0')}"


# ---------------------------------------------------------------------------
# Layouts: which process writes which block
# ---------------------------------------------------------------------------


def _leaf_strategies(state, layouts, n_leaves: int) -> list:
    if layouts is None:
        return [None] * n_leaves
    try:
        out = tree.broadcast_prefix(layouts, state, is_leaf=lambda s: s is None or isinstance(
            s, tuple) and all(isinstance(d, int) for d in s) or hasattr(s, "to_strategy"))
    except ValueError as e:
        raise CheckpointError(
            f"fs.checkpoint.save(..., layouts): layouts must have the structure of state "
            f"(or a prefix of it), with a strategy tuple, an fs.Layout view or None per "
            f"leaf: {e}") from None
    return out


def _blocks(shape, spec, n_devices: int):
    """``[(block index, (start, stop) per dim, owning device)]`` of a leaf."""
    if spec is None or n_devices == 1 or len(shape) == 0:
        return [((0,) * len(shape), tuple((0, d) for d in shape), 0)]
    layout = as_layout(spec, n_devices)
    out = []
    for idx, owners in block_owners(layout, n_devices).items():
        owner = min(owners)
        out.append((idx, shard_slices(shape, layout, owner, n_devices), owner))
    return out


def _spec_json(spec):
    if spec is None:
        return None
    if hasattr(spec, "to_dict"):
        return spec.to_dict() | {"strategy": list(spec.to_strategy())}
    return list(spec)


# ---------------------------------------------------------------------------
# save / latest / load
# ---------------------------------------------------------------------------


class SaveHandle:
    """A checkpoint being written in the background (``save(..., wait=False)``).

    ``wait()`` blocks until it is complete and returns its directory (or raises the
    save's ``CheckpointError``); ``done()`` says whether it has finished. The values
    were copied when ``save`` returned: training may go on (and change them) meanwhile.
    """

    def __init__(self, path: str, write):
        self.path = path
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(write,),
                                        name="fshard-checkpoint-save")
        self._thread.start()

    def _run(self, write) -> None:
        try:
            write()
        except FshardError as e:
            self._error = e
        except Exception as e:  # noqa: BLE001  (re-raised by wait(), as an fshard error)
            self._error = CheckpointError(
                f"fs.checkpoint.save(wait=False): writing {self.path!r} failed: "
                f"{type(e).__name__}: {e}")
            self._error.__cause__ = e
        except BaseException as e:  # noqa: BLE001  (KeyboardInterrupt, SystemExit)
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> str:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CheckpointError(
                f"fs.checkpoint.save(wait=False): the save of {self.path!r} is still "
                f"running after {timeout} s.\nFix: wait longer (wait() with no timeout).")
        if self._error is not None:
            raise self._error
        return self.path

    def __repr__(self) -> str:
        return f"SaveHandle({self.path!r}, {'done' if self.done() else 'writing'})"


def _check_step(step) -> int | None:
    """``step`` as a Python int (None stays None): a non-negative integer, given as a
    Python int, a NumPy integer or a 0-d integer array (or Tensor, e.g. a TrainState's
    step). Anything else is refused before anything is written."""
    if step is None:
        return None
    value = step
    if hasattr(value, "asnumpy") and not isinstance(value, np.ndarray):
        try:
            value = value.asnumpy()
        except Exception:  # noqa: BLE001  (a traced step: refused below)
            pass
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not ok or value < 0:
        what = f"{step!r} ({type(step).__name__})" if not ok else repr(int(value))
        raise ArgumentError(
            f"fs.checkpoint.save(step=...) must be a non-negative integer (a Python int, "
            f"a NumPy integer or a 0-d integer array): it names the directory "
            f"<path>/<step>; got {what}.\nFix: pass the training step as an int, e.g. "
            "step=int(state.step.asnumpy()).")
    return int(value)


def _new_checkpoint_dir(path, step) -> str:
    """The directory a save writes: ``path/step`` (or ``path``), which must not exist."""
    final = os.path.join(os.fspath(path), str(step)) if step is not None else \
        os.fspath(path)
    if os.path.exists(final):
        raise CheckpointError(
            f"fs.checkpoint.save: {final!r} exists already; a checkpoint is never "
            "overwritten.\nFix: save under a new step (or remove the old one first).")
    return final


def save(path, state, *, step: int | None = None, layouts=None, mesh=None,
         timeout: float = 600.0, wait: bool = True):
    """Write ``state`` (any pytree of arrays) as a checkpoint; return its directory
    (with ``wait=False``, a ``SaveHandle`` whose ``wait()`` returns it).

    Args:
        path: with ``step``, the root directory of a run's checkpoints (the checkpoint
            is ``path/<step>``); without, the checkpoint's own directory. It must not
            exist yet.
        state: a pytree of MindSpore Tensors, NumPy arrays or scalars (the params,
            the optimizer state and the step of a ``fs.TrainState``).
        step: the training step, recorded in the index.
        layouts: how each leaf is sharded (a pytree prefix of ``state`` holding
            strategy tuples, ``fs.Layout`` views or None; e.g.
            ``ap.state_strategies(state, *batch)`` of an ``fs.AutoParallel``): each
            block is written once, by the process owning it, so the processes of a job
            write in parallel and nothing is written twice. Default: whole leaves,
            written by process 0. (An ``fs.ShardedArray`` leaf is written under its own
            layout; a leaf only some processes hold, a pipeline stage's in a job whose
            state is split by stage, by those processes: see below.)
        mesh: the devices the layouts refer to (a count or ``fs.Mesh``; default: the
            job's processes, or 1).
        timeout: seconds to wait for the other processes of a job to finish writing.
        wait: False to copy the values to host memory and write them in a background
            thread: training continues while the files are written (each process must
            still call ``save`` in the same order; a second save may start before the
            first completes).

    Every process of a job calls ``save`` with the same arguments; it returns when the
    checkpoint is complete. A pipelined job's state split by stage (each process holding
    its stage's leaves, ``fs.RemoteArray`` for the others) is saved as it is: each
    stage's leaves are written by the stage's processes (in row blocks dealt out between
    a stage's data-parallel processes), nothing is gathered; the processes first tell
    each other which leaves they hold. A leaf no process holds, or processes saving
    different states, is a ``CheckpointError`` on every process.
    """
    step = _check_step(step)
    if not wait:
        final = _new_checkpoint_dir(path, step)
        # A host copy now (the caller's arrays may change while the thread writes).
        snapshot = tree.map(_host_copy, state)
        attempt = _next_attempt(final)  # (taken in call order, as in the other processes)
        return SaveHandle(final, lambda: _save(path, snapshot, step, layouts, mesh, timeout,
                                               attempt))
    return _save(path, state, step, layouts, mesh, timeout, None)


def _save(path, state, step, layouts, mesh, timeout, attempt):
    leaves_paths, leaves, _ = tree.flatten_with_path(state)
    rank, nproc = _world()
    n_devices = _mesh_size(mesh, nproc)
    if nproc > 1 and n_devices != nproc:
        raise CheckpointError(
            f"fs.checkpoint.save(..., mesh): in a job of {nproc} processes the layouts "
            f"must refer to its {nproc} devices, got a mesh of {n_devices}.")
    specs = _leaf_strategies(state, layouts, len(leaves))
    final = _new_checkpoint_dir(path, step)
    if attempt is None:
        attempt = _next_attempt(final)
    parent = os.path.dirname(os.path.abspath(final))

    # Everything this process can refuse alone is checked (and its ShardedArray blocks
    # taken) before anything is written; what needs the other processes' leaves (who
    # holds a pipeline stage's leaf) is settled before any array is written.
    process_of = (lambda device: device) if nproc > 1 else (lambda device: 0)
    fname = f"shard-{rank:05d}-of-{nproc:05d}.safetensors"
    mine: dict[str, np.ndarray] = {}
    entries: list = [None] * len(leaves)
    arrays: dict[int, np.ndarray] = {}  # leaf -> its whole value, here
    # per leaf, what this process holds: [kind, shape, dtype, stage, holders] (the stage
    # and its processes of an fs.RemoteArray)
    kinds = []
    for i, (p, x) in enumerate(zip(leaves_paths, leaves)):
        if isinstance(x, RemoteArray):
            dt = np.dtype(dtypes.to_numpy(x.dtype)).name
            kinds.append(["remote", [int(d) for d in x.shape], dt, int(x.stage),
                          [int(h) for h in x.holders]])
            continue
        if isinstance(x, ShardedArray) and x.mesh.size < nproc and nproc % x.mesh.size == 0:
            # a block over a pipeline stage's processes (a tensor-parallel stage's
            # leaf): the other stages' processes hold none of it (fs.RemoteArray), so
            # the writers are settled with the other processes' answers
            dt = np.dtype(dtypes.to_numpy(x.dtype)).name
            kinds.append(["block", [int(d) for d in x.shape], dt, rank // x.mesh.size,
                          [[int(a), int(b)] for a, b in x.bounds],
                          [int(c) for c in x.strategy]])
            continue
        if isinstance(x, ShardedArray):  # this process's block: its own layout
            entries[i] = _local_entry(i, p, x, nproc, rank, mine)
            kinds.append(["sharded", entries[i]["shape"], entries[i]["dtype"], None, None])
            continue
        a = _numpy(x)
        try:
            dt = dtypes.to_numpy(dtypes.from_numpy(a.dtype))
        except Exception:  # noqa: BLE001
            dt = None
        if dt is None or a.dtype != dt:
            raise CheckpointError(
                f"fs.checkpoint.save: leaf {tree.keystr(p)} has dtype {a.dtype}, which "
                "fshard does not hold.")
        arrays[i] = a
        kinds.append(["value", [int(d) for d in a.shape], a.dtype.name, None, None])
    if nproc == 1:
        _holders_of(leaves_paths, [[k] for k in kinds], 1)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"fs.checkpoint.save: cannot create {parent!r}: {e}.\nFix: pass a path "
            "this process can write.") from e
    tmp = os.path.join(parent, f"{_TMP_PREFIX}{os.path.basename(final)}-{_job_token(nproc)}")
    lock = _lock_tmp(tmp)
    mine_written = False
    try:
        # Who holds each leaf's values: every process of the job, or (a pipelined job's
        # state split by stage) only its stage's processes, which no single process can
        # tell from its own state: each process says what it holds (a small file in the
        # shared directory) and all derive the same writers from the same answers.
        views = [[k] for k in kinds] if nproc == 1 else _exchange(
            tmp, rank, nproc, attempt, kinds, str(tree.structure(state)), timeout, final)
        held = _holders_of(leaves_paths, views, nproc)
        for i, (p, spec) in enumerate(zip(leaves_paths, specs)):
            if entries[i] is not None:  # a ShardedArray's, under its own layout
                continue
            shape, dt = kinds[i][1], kinds[i][2]
            if isinstance(held[i], dict):  # a tensor-parallel stage's blocks
                if spec is not None:
                    raise CheckpointError(
                        f"fs.checkpoint.save(..., layouts): layouts splits leaf "
                        f"{tree.keystr(p)} as {_spec_json(spec)}, but it is a pipeline "
                        f"stage's leaf kept in blocks by processes {held[i]['holders']} "
                        "(an fs.ShardedArray there, an fs.RemoteArray on the others): it "
                        "is written in its own blocks.\nFix: give None for the leaves of a "
                        "pipelined state split by stage (or leave layouts out).")
                entries[i] = _stage_blocks_entry(i, p, leaves[i], held[i], nproc, rank, mine)
                continue
            if len(held[i]) == nproc:  # every process holds it: layouts, or process 0
                where = [(idx, bounds, process_of(owner))
                         for idx, bounds, owner in _blocks(shape, spec, n_devices)]
            else:  # a pipeline stage's leaf: dealt out between its processes
                if spec is not None:
                    raise CheckpointError(
                        f"fs.checkpoint.save(..., layouts): layouts splits leaf "
                        f"{tree.keystr(p)} as {_spec_json(spec)}, but only processes "
                        f"{held[i]} of this job hold it (a pipeline stage's leaf, an "
                        "fs.RemoteArray on the others): a stage's leaf is written by its "
                        "own processes, in row blocks dealt out between them.\nFix: give "
                        "None for the leaves of a pipelined state split by stage (or leave "
                        "layouts out).")
                where = _dealt(shape, held[i])
            blocks = []
            for idx, bounds, proc in where:
                key = f"{i}:{','.join(map(str, idx))}"
                if proc == rank:
                    mine[key] = arrays[i][tuple(slice(s, e) for s, e in bounds)]  # a view
                blocks.append({"key": key, "file": f"shard-{proc:05d}-of-{nproc:05d}"
                               ".safetensors", "start": [s for s, _ in bounds],
                               "stop": [e for _, e in bounds]})
            entries[i] = {"path": tree.keystr(p), "name": _name(p), "shape": list(shape),
                          "dtype": dt, "layout": _spec_json(spec), "blocks": blocks}
            if len(held[i]) < nproc:
                stage = next((v[3] for v in views[i] if v[0] == "remote"), None)
                entries[i] |= {"stage": stage, "holders": held[i]}
        nbytes, head_sha256, block_sha256 = _write_safetensors_durably(
            os.path.join(tmp, fname), mine, {"format": FORMAT})
        mine_written = True
        _mark_done(tmp, attempt, rank, {"file": fname, "bytes": nbytes,
                                        "header_sha256": head_sha256,
                                        "blocks": block_sha256})
        if rank != 0:
            _wait_for(lambda: os.path.exists(os.path.join(final, INDEX)), timeout,
                      f"process 0 to complete the checkpoint {final!r}")
            return final
        done = _wait_for_done(tmp, attempt, nproc, timeout, final)
        digests = {d["file"]: d["blocks"] for d in done}
        for e in entries:
            for b in e["blocks"]:
                b["sha256"] = digests[b["file"]][b["key"]]
        index = {"format": FORMAT, "version": VERSION, "step": step, "processes": nproc,
                 "devices": n_devices, "treedef": str(tree.structure(state)),
                 "files": {d["file"]: {"bytes": d["bytes"],
                                       "header_sha256": d["header_sha256"]} for d in done},
                 "leaves": entries}
        _write_bytes_durably(os.path.join(tmp, INDEX),
                             json.dumps(index, indent=1).encode())
        for f in os.listdir(tmp):  # (every process has read them: it wrote its part;
            # an earlier attempt's are stale)
            if f.startswith((_HOLDS, _DONE)):
                _remove_quietly(os.path.join(tmp, f))
        _fsync_dir(tmp)
        _publish(tmp, final)
        _fsync_dir(parent)
        return final
    except BaseException as e:
        if nproc == 1:
            shutil.rmtree(tmp, ignore_errors=True)
        elif not mine_written or not isinstance(e, CheckpointError):
            # In a job the directory is shared: this process removes its own part only
            # (a timed-out job's parts stay for clean(), as the message says).
            done = _attempt_file(_DONE, attempt, rank)
            for f in (fname, done, done + ".part"):
                _remove_quietly(os.path.join(tmp, f))
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            raise CheckpointError(
                f"fs.checkpoint.save: writing {final!r} failed: {e}\nFix: check the "
                "path and free space; earlier checkpoints are intact.") from e
        raise
    finally:
        os.close(lock)


# The processes of a job say what they hold in ``<tmp>/holds-<attempt>-<rank>.json``.
# ``attempt`` counts this process's saves of the same checkpoint (every process makes
# the same calls): the files of a failed attempt, which stay in the directory (another
# process may still be reading them), are never taken for a later attempt's.
# Each process also says it has written its part, in ``<tmp>/done-<attempt>-<rank>.json``
# (its file's size and digests): a part written by an earlier, timed-out attempt (its
# file rewritten since, or being rewritten) is never taken for this attempt's.
_HOLDS, _DONE = "holds-", "done-"
_ATTEMPTS: dict[str, int] = {}
_ATTEMPTS_LOCK = threading.Lock()


def _next_attempt(final: str) -> int:
    key = os.path.abspath(final)
    with _ATTEMPTS_LOCK:
        _ATTEMPTS[key] = _ATTEMPTS.get(key, 0) + 1
        return _ATTEMPTS[key]


def _exchange(tmp: str, rank: int, nproc: int, attempt: int, kinds: list, treedef: str,
              timeout: float, final: str) -> list[list]:
    """Write what this process holds of each leaf, wait for every process's, and return
    per leaf the list over processes of ``[kind, shape, dtype, stage, holders]``."""
    def file(r):
        return os.path.join(tmp, _attempt_file(_HOLDS, attempt, r))

    with open(file(rank) + ".part", "w") as fh:
        json.dump({"treedef": treedef, "leaves": kinds}, fh)
    os.rename(file(rank) + ".part", file(rank))
    deadline = time.monotonic() + timeout
    while missing := [r for r in range(nproc) if not os.path.exists(file(r))]:
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"fs.checkpoint.save: process(es) {missing} did not start saving "
                f"{final!r} within {timeout:.0f} s; nothing was written, earlier "
                "checkpoints are intact.\nFix: call fs.checkpoint.save in every process "
                "of the job, with the same path and step.")
        time.sleep(0.005)
    said = []
    for r in range(nproc):
        with open(file(r)) as fh:
            said.append(json.load(fh))
    for r, got in enumerate(said):
        if got["treedef"] != treedef or len(got["leaves"]) != len(kinds):
            raise CheckpointError(
                f"fs.checkpoint.save: the processes of this job save states of different "
                f"structures: process {rank}'s has {len(kinds)} leaves ({treedef[:160]}), "
                f"process {r}'s {len(got['leaves'])} ({got['treedef'][:160]}).\nFix: call "
                "save in every process with the same state (each process's own step's "
                "result).")
    return [[got["leaves"][i] for got in said] for i in range(len(kinds))]


def _what(kind: list) -> str:
    return {"value": "an array", "sharded": "an fs.ShardedArray",
            "block": "an fs.ShardedArray (a pipeline stage's block)",
            "remote": "an fs.RemoteArray"}[kind[0]] + f" {kind[2]}{kind[1]}"


def _stage_blocks_entry(i: int, p, x, held: dict, nproc: int, rank: int,
                        mine: dict) -> dict:
    """The index entry of a pipeline stage's leaf kept in tensor-parallel blocks by the
    stage's processes (``held``: each one's block bounds, from every process's answer):
    each block written once, by the lowest process holding it; this process's goes
    into ``mine``."""
    owners: dict = {}
    for r, bounds in held["bounds"]:
        owners.setdefault(tuple(tuple(b) for b in bounds), r)
    blocks = []
    for bounds, owner in owners.items():
        idx = tuple(s // max(e - s, 1) for s, e in bounds)
        key = f"{i}:{','.join(map(str, idx))}"
        if owner == rank:
            mine[key] = _numpy(x.block)
        blocks.append({"key": key, "file": f"shard-{owner:05d}-of-{nproc:05d}.safetensors",
                       "start": [s for s, _ in bounds], "stop": [e for _, e in bounds]})
    return {"path": tree.keystr(p), "name": _name(p), "shape": list(held["shape"]),
            "dtype": held["dtype"], "layout": held["layout"], "blocks": blocks,
            "stage": held["stage"], "holders": held["holders"]}


def _holders_of(paths, views: list, nproc: int) -> list:
    """Per leaf, the processes holding its whole value (None for a ShardedArray leaf,
    whose blocks its own layout places), from every process's ``views``; a leaf no
    process holds, or that processes see differently, is refused."""
    held = []
    for p, per in zip(paths, views):
        for r, k in enumerate(per):
            if k[1:3] != per[0][1:3] or (k[0] == "sharded") != (per[0][0] == "sharded"):
                raise CheckpointError(
                    f"fs.checkpoint.save: the processes of this job save different "
                    f"states: leaf {tree.keystr(p)} is {_what(per[0])} on process 0 and "
                    f"{_what(k)} on process {r}.\nFix: call save in every process with "
                    "the same state (each process's own step's result).")
        if per[0][0] == "sharded":
            held.append(None)
            continue
        kept = [(r, k) for r, k in enumerate(per) if k[0] == "block"]
        if kept:  # a pipeline stage's blocks: its processes', fs.RemoteArray elsewhere
            other = next(((r, k) for r, k in enumerate(per)
                          if k[0] not in ("block", "remote")), None)
            if other is not None:
                raise CheckpointError(
                    f"fs.checkpoint.save: the processes of this job save different "
                    f"states: leaf {tree.keystr(p)} is {_what(kept[0][1])} on process "
                    f"{kept[0][0]} and {_what(other[1])} on process {other[0]}.\nFix: call "
                    "save in every process with the same state (each process's own step's "
                    "result).")
            first = kept[0][1]
            held.append({"shape": first[1], "dtype": first[2], "stage": first[3],
                         "layout": first[5], "holders": [r for r, _ in kept],
                         "bounds": [(r, k[4]) for r, k in kept]})
            continue
        h = [r for r, k in enumerate(per) if k[0] == "value"]
        if not h:
            _, _, _, stage, holders = per[0]
            where = ("every process of this job" if nproc > 1 else
                     "this process, which is not in a job with those processes")
            raise CheckpointError(
                f"fs.checkpoint.save: no process holds the values of leaf "
                f"{tree.keystr(p)}: it is an fs.RemoteArray (pipeline stage {stage}'s, "
                f"kept by processes {holders}) on {where}, so none can write it.\nFix: "
                "call save in every process of the pipelined job, each with the state its "
                f"own step returned (stage {stage}'s processes hold that leaf), or save "
                "ap.gather(state) there (a collective).")
        held.append(h)
    return held


def _dealt(shape, holders: list) -> list:
    """``[(block index, (start, stop) per dim, process)]`` of a leaf that only
    ``holders`` hold (a pipeline stage's, on each of its data-parallel processes): its
    rows split into one block per holder, so that they write in parallel and each row
    once (a 0-d leaf, or one with fewer rows than holders: whole, by the first)."""
    k = len(holders)
    rest = tuple((0, d) for d in shape[1:])
    if k == 1 or not shape or shape[0] < k:
        return [((0,) * len(shape), tuple((0, d) for d in shape), holders[0])]
    n = shape[0]
    return [((j,) + (0,) * len(rest), ((j * n // k, (j + 1) * n // k),) + rest, h)
            for j, h in enumerate(holders)]


def _remove_quietly(file: str) -> None:
    try:
        os.remove(file)
    except OSError:
        pass


def _publish(tmp: str, final: str) -> None:
    """Rename the complete ``tmp`` to ``final``; then drop the lock file."""
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        # Another save (another program, or another thread) of the same step won the
        # race: its checkpoint stands, this one is not written over it. (Every process
        # of this job has written its part by now: the directory is this save's alone.)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"fs.checkpoint.save: {final!r} was completed by another save while this one "
            "was writing; a checkpoint is never overwritten, so this save's files were "
            "removed and the other's checkpoint stands.\nFix: give each run its own "
            "root, or save under a new step.") from None
    _remove_quietly(os.path.join(final, _LOCK))


# ``clean`` must not remove the temporary directory of a save that is still writing
# (in this process, a save(wait=False) thread; or another process). Each saving
# process holds a shared flock on ``<tmp>/.lock`` until it has written its part;
# ``clean`` removes a directory only when it can take the lock exclusively (no saver
# holds it, or the one that did has died). flock locks belong to open file
# descriptions, so this works between threads of one process too.
_LOCK = ".lock"


def _lock_tmp(tmp: str) -> int:
    """Create ``tmp`` (shared by the processes of a job) and hold its lock; return the
    lock's file descriptor."""
    for _ in range(20):
        try:
            os.makedirs(tmp, exist_ok=True)
            fd = os.open(os.path.join(tmp, _LOCK), os.O_CREAT | os.O_RDWR, 0o644)
        except FileNotFoundError:  # a clean() removed the new directory: again
            continue
        except OSError as e:
            raise CheckpointError(
                f"fs.checkpoint.save: cannot create {tmp!r}: {e}.\nFix: pass a path "
                "this process can write.") from e
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:  # still the file in the directory (not one a clean() just removed)?
            if os.path.samestat(os.fstat(fd), os.stat(os.path.join(tmp, _LOCK))):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise CheckpointError(
        f"fs.checkpoint.save: could not create {tmp!r}: something removes it as soon as it "
        "is made.\nFix: do not run fs.checkpoint.clean in a loop on this root.")


def _host_copy(x):
    """A copy in host memory of a leaf (of a ShardedArray: of its block)."""
    if isinstance(x, RemoteArray):  # (no values here: its stage's processes write it)
        return x
    if isinstance(x, ShardedArray):
        return ShardedArray(np.array(_numpy(x.block), copy=True), x.shape, x.dtype,
                            x.sharding, x.mesh, x.rank)
    return np.array(_numpy(x), copy=True)


def _local_entry(i: int, p, x: ShardedArray, nproc: int, rank: int, mine: dict) -> dict:
    """The index entry of a ShardedArray leaf: its blocks under its own layout, each
    written by the lowest process holding it; this process's goes into ``mine``."""
    if x.mesh.size != nproc:
        raise CheckpointError(
            f"fs.checkpoint.save: leaf {tree.keystr(p)} is an fs.ShardedArray of a job of "
            f"{x.mesh.size} processes, this job has {nproc}.")
    owners: dict = {}
    for r in range(x.mesh.size):
        owners.setdefault(block_bounds(x.sharding, x.mesh, r, x.shape), r)
    mine_bounds = x.bounds
    blocks = []
    for bounds, owner in owners.items():
        idx = tuple(s // max(e - s, 1) for s, e in bounds)
        key = f"{i}:{','.join(map(str, idx))}"
        if owner == rank:
            assert bounds == mine_bounds
            mine[key] = _numpy(x.block)
        blocks.append({"key": key, "file": f"shard-{owner:05d}-of-{nproc:05d}.safetensors",
                       "start": [s for s, _ in bounds], "stop": [e for _, e in bounds]})
    dt = np.dtype(dtypes.to_numpy(x.dtype))
    return {"path": tree.keystr(p), "name": _name(p), "shape": list(x.shape),
            "dtype": dt.name, "layout": list(x.strategy), "blocks": blocks}


def _mesh_size(mesh, nproc: int) -> int:
    if mesh is None:
        return nproc
    if isinstance(mesh, (int, np.integer)) and not isinstance(mesh, bool):
        return int(mesh)
    size = getattr(mesh, "size", None)
    if not isinstance(size, int):
        raise CheckpointError(
            f"fs.checkpoint: mesh must be a device count or an fs.Mesh, got "
            f"{type(mesh).__name__}.")
    return size


def _attempt_file(kind: str, attempt: int, rank: int) -> str:
    """The name of a process's ``holds-`` or ``done-`` file of one attempt."""
    return f"{kind}{attempt}-{rank}.json"


def _mark_done(tmp: str, attempt: int, rank: int, info: dict) -> None:
    final = os.path.join(tmp, _attempt_file(_DONE, attempt, rank))
    part = final + ".part"
    _write_bytes_durably(part, json.dumps(info).encode())
    os.rename(part, final)


def _wait_for(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"fs.checkpoint.save: timed out after {timeout:.0f} s waiting for {what}.")
        time.sleep(0.05)


def _wait_for_done(tmp: str, attempt: int, nproc: int, timeout: float, final: str
                   ) -> list[dict]:
    def file(r):
        return os.path.join(tmp, _attempt_file(_DONE, attempt, r))

    def missing():
        return [r for r in range(nproc) if not os.path.exists(file(r))]

    deadline = time.monotonic() + timeout
    while missing():
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"fs.checkpoint.save: process(es) {missing()} did not finish writing "
                f"their part of {final!r} within {timeout:.0f} s; the checkpoint was not "
                f"completed (its parts stay in {tmp!r}), earlier checkpoints are intact.")
        time.sleep(0.05)
    out = []
    for r in range(nproc):
        with open(file(r)) as fh:
            out.append(json.load(fh))
    return out


def latest(path) -> str | None:
    """The newest complete checkpoint under ``path`` (the highest step whose directory
    has an index), or None. Unfinished saves (temporary directories) are ignored."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    steps = [int(d) for d in os.listdir(path) if _STEP_DIR.match(d)
             and os.path.exists(os.path.join(path, d, INDEX))]
    return os.path.join(path, str(max(steps))) if steps else None


def _read_index(path: str) -> dict:
    file = os.path.join(path, INDEX)
    if not os.path.exists(file):
        newest = latest(path)
        if newest is None:
            raise CheckpointError(
                f"fs.checkpoint.load: {path!r} holds no checkpoint (no {INDEX}, and no "
                "complete step directory).\nFix: pass the directory save() returned, or "
                "the root given to save(..., step=...).")
        file = os.path.join(newest, INDEX)
    try:
        with open(file) as fh:
            index = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"fs.checkpoint.load: cannot read {file!r}: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(
            f"fs.checkpoint.load: {file!r} is not an fshard checkpoint index.")
    if index.get("version") not in READS:
        raise CheckpointError(
            f"fs.checkpoint.load: {file!r} has version {index.get('version')}; this "
            f"fshard reads versions {', '.join(map(str, READS))}.")
    index["_dir"] = os.path.dirname(file)
    return index


def load(path, like, *, layouts=None, mesh=None, verify: bool = True):
    """Read a checkpoint into ``like``'s structure; return the restored pytree.

    ``path`` is a checkpoint directory, or a root of step directories (its ``latest``
    is read). ``like`` is a pytree with the structure of the saved state whose leaves
    give the expected shapes and dtypes (arrays, ``fs.ArrayType``s, e.g. a fresh
    ``ap.init(params)``). Values are bit for bit the saved ones, whatever mesh, layouts
    and number of processes wrote them.

    A leaf of ``like`` that is an ``fs.ShardedArray`` (in a multi-process job, e.g. the
    state of an ``fs.AutoParallel`` step) comes back as one with the same layout, and
    this process reads only the saved blocks overlapping its own block. ``layouts``
    (in a job: a pytree prefix of ``like`` holding split counts, ``fs.Layout`` views or
    None, e.g. ``ap.state_strategies(like, *batch)``) asks the same for the leaves it
    splits. A leaf of ``like`` that is an ``fs.RemoteArray`` (another pipeline stage's,
    in a job whose update is split by stage) comes back as it is: that stage's processes
    load it. Every other leaf comes back whole, as a MindSpore Tensor.

    ``mesh`` (an ``fs.Mesh`` or a device count) is the mesh ``layouts`` refer to, as
    the script that trains on it writes it: in a job it must be the job's world (one
    device per process); in one process (a virtual mesh, which holds every device's
    block) the leaves come back whole, so the same script runs in both.

    Raises ``CheckpointError`` naming the file and the leaf when a file is missing,
    truncated or altered (sizes and SHA-256 of every block read checked when
    ``verify``), when the checkpoint holds other leaves than ``like``, or a leaf's
    shape or dtype differs.
    """
    import mindspore

    _check_load_mesh(mesh)
    index = _read_index(os.fspath(path))
    root = index["_dir"]
    paths, likes, spec = tree.flatten_with_path(like)
    saved = {e["path"]: e for e in index["leaves"]}
    wanted = [tree.keystr(p) for p in paths]
    missing = [w for w in wanted if w not in saved]
    extra = [s for s in saved if s not in set(wanted)]
    if missing or extra:
        raise CheckpointError(
            f"fs.checkpoint.load: the checkpoint in {root!r} was written for another "
            f"structure: like has leaves it lacks {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} and it has leaves like lacks "
            f"{extra[:5]}{' ...' if len(extra) > 5 else ''}.\nFix: pass a like with the "
            "saved state's structure (e.g. the same model and optimizer's init).")
    targets = _local_targets(like, likes, layouts)
    files = index["files"]
    if verify and index["version"] == 1:  # one SHA-256 per file: read them all
        _verify_files(root, files, index["leaves"])
    reader = _BlockReader(root, files, index["leaves"], verify and index["version"] > 1)
    out = []
    try:
        for w, x, target in zip(wanted, likes, targets):
            e = saved[w]
            a = typeof(x)
            if isinstance(x, RemoteArray):  # another stage's processes load it
                _check_saved_type(e, w, a)
                out.append(x)
                continue
            _check_saved_type(e, w, a)
            # the region of the leaf this process needs: its block, or all of it
            want = target.bounds if target is not None else tuple((0, d) for d in e["shape"])
            value = np.empty([t - s for s, t in want], np.dtype(e["dtype"]))
            for b in e["blocks"]:
                lo = [max(s, ws) for s, (ws, _) in zip(b["start"], want)]
                hi = [min(t, wt) for t, (_, wt) in zip(b["stop"], want)]
                if any(l >= h for l, h in zip(lo, hi)):
                    continue  # no overlap: not read
                block = reader.block(b, w, value.dtype)
                src = tuple(slice(l - s, h - s) for l, h, s in zip(lo, hi, b["start"]))
                dst = tuple(slice(l - ws, h - ws) for l, h, (ws, _) in zip(lo, hi, want))
                value[dst] = block[src]
            if target is None:
                out.append(mindspore.Tensor(value))
            else:
                out.append(ShardedArray(mindspore.Tensor(value), target.shape, target.dtype,
                                        target.sharding, target.mesh, target.rank))
    finally:
        reader.close()
    if mesh is not None and _virtual(mesh):
        out = _place_on(mesh, out, like, likes, layouts, [saved[w] for w in wanted], wanted)
    return tree.unflatten(spec, out)


def _check_saved_type(e: dict, w: str, a) -> None:
    expect = np.dtype(dtypes.to_numpy(a.dtype))
    if tuple(e["shape"]) != tuple(a.shape) or np.dtype(e["dtype"]) != expect:
        raise CheckpointError(
            f"fs.checkpoint.load: leaf {w} was saved as {e['dtype']}{e['shape']}, "
            f"like has {expect.name}{list(a.shape)}.\nFix: load into a like "
            "built as the saved state was (same shapes and dtypes), or convert "
            "after loading.")


def _virtual(mesh) -> bool:
    """Whether ``load``'s ``mesh`` is a virtual mesh (one process holds every device)."""
    _, nproc = _world()
    return getattr(mesh, "is_virtual", nproc == 1)


def _place_on(mesh, values: list, like, likes: list, layouts, entries: list,
              names: list) -> list:
    """The loaded leaves placed on the virtual ``mesh`` (``fs.device_put``: whole
    values that carry their strategy, which an ``fs.shard`` leaving that argument to
    propagation follows): each with its entry of ``layouts`` (None: whole) if given;
    else the strategy its ``like`` leaf was placed with on this mesh, else the strategy
    it was saved with if that fits this mesh (the split counts divide its device count
    and the leaf's dimensions), else whole."""
    n = getattr(mesh, "size", mesh)
    specs = [None] * len(likes)
    if layouts is not None:
        try:
            specs = tree.broadcast_prefix(layouts, like, is_leaf=_is_layout_leaf)
        except ValueError as e:
            raise CheckpointError(
                f"fs.checkpoint.load(..., layouts): layouts must have the structure of "
                f"like (or a prefix of it), with a strategy tuple, an fs.Layout view or "
                f"None per leaf: {e}") from None
    smesh = ShardMesh.for_devices(n)
    out = []
    for v, x, given, e, name in zip(values, likes, specs, entries, names):
        if layouts is None:
            given = placed_strategy(x, n)
        if given is None and layouts is None:
            saved = e.get("layout")
            counts = saved.get("strategy") if isinstance(saved, dict) else saved
            if counts and any(c != 1 for c in counts):
                try:
                    parse_strategy(tuple(counts), typeof(v), smesh, "saved layout", "leaf")
                    given = tuple(counts)
                except FshardError:  # saved for a mesh this one cannot split it on
                    given = None
        if given is None:
            out.append(v)
            continue
        a = typeof(v)
        parse_strategy(given, a, smesh, f"fs.checkpoint.load(..., mesh={n}, layouts) leaf "
                       f"{name}", f"a {a} leaf")  # a ShardingError naming the leaf
        out.append(device_put(v, given, mesh=n))
    return out


def _is_layout_leaf(s) -> bool:
    return s is None or (isinstance(s, tuple) and all(isinstance(d, int) for d in s)) \
        or hasattr(s, "to_strategy")


def _check_load_mesh(mesh) -> None:
    """``load``'s ``mesh``: None, a device count or an ``fs.Mesh``; in a job, the world."""
    if mesh is None:
        return
    size = getattr(mesh, "size", mesh)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise CheckpointError(
            f"fs.checkpoint.load(..., mesh={mesh!r}): mesh must be an fs.Mesh or a number "
            f"of devices.\nFix: pass the mesh the training step runs on, e.g. "
            "mesh=fs.Mesh((4,), ('dp',)).")
    _, nproc = _world()
    virtual = getattr(mesh, "is_virtual", nproc == 1)
    if nproc > 1 and not virtual and size != nproc:
        raise CheckpointError(
            f"fs.checkpoint.load(..., mesh={mesh!r}): the mesh has {size} devices but this "
            f"job has {nproc} processes (one device each).\nFix: pass the job's mesh "
            f"(a mesh of {nproc} devices), or leave mesh out.")


class _Target:
    """Where a ShardedArray leaf is loaded: this process's block of its layout."""

    def __init__(self, shape, dtype, sharding, mesh, rank):
        self.shape, self.dtype, self.sharding, self.mesh, self.rank = (
            tuple(shape), dtype, sharding, mesh, rank)
        self.bounds = block_bounds(sharding, mesh, rank, self.shape)


def _local_targets(like, likes: list, layouts) -> list:
    """Per leaf of ``like``: a ``_Target`` for a ShardedArray leaf or a leaf ``layouts``
    splits (in a job), else None (the whole leaf)."""
    rank, nproc = _world()
    specs = [None] * len(likes)
    if layouts is not None and nproc > 1:
        try:
            specs = tree.broadcast_prefix(layouts, like, is_leaf=lambda s: s is None or (
                isinstance(s, tuple) and all(isinstance(d, int) for d in s))
                or hasattr(s, "to_strategy"))
        except ValueError as e:
            raise CheckpointError(
                f"fs.checkpoint.load(..., layouts): layouts must have the structure of "
                f"like (or a prefix of it), with a strategy tuple, an fs.Layout view or "
                f"None per leaf: {e}") from None
    mesh = ShardMesh.for_devices(nproc)
    out = []
    for k, (x, spec) in enumerate(zip(likes, specs)):
        if isinstance(x, ShardedArray):
            # (a pipeline stage's block: over the stage's processes, one group of the
            # job's equal consecutive groups)
            if x.mesh.size > nproc or nproc % x.mesh.size:
                raise CheckpointError(
                    f"fs.checkpoint.load: like leaf {k} is an fs.ShardedArray of a job of "
                    f"{x.mesh.size} processes, this job has {nproc}.\nFix: load into a "
                    "like made in this job (or pass whole arrays and layouts).")
            out.append(_Target(x.shape, x.dtype, x.sharding, x.mesh, rank))
            continue
        a = typeof(x)
        sh = None if spec is None else parse_strategy(
            spec, a, mesh, f"fs.checkpoint.load(..., layouts) leaf {k}", f"a {a} leaf")
        out.append(None if sh is None or not any(sh.dims) else
                   _Target(a.shape, a.dtype, sh, mesh, rank))
    return out


def _read(fd: int, offset: int, nbytes: int) -> bytes:
    """``nbytes`` of an open file from ``offset``: every byte a load reads goes through
    here."""
    return os.pread(fd, nbytes, offset)


class _BlockReader:
    """Reads saved blocks by their byte ranges (each file opened once, its safetensors
    header parsed once), checking sizes and, when ``verify``, the SHA-256 of each
    file's header and of each block read."""

    def __init__(self, root: str, files: dict, leaves: list, verify: bool):
        self.root, self.files, self.leaves, self.verify = root, files, leaves, verify
        self.open: dict = {}  # file -> (fd, header dict, data start)

    def _holders(self, file) -> str:
        names = sorted({e["path"] for e in self.leaves for b in e["blocks"]
                        if b["file"] == file})
        return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")

    def _file(self, file: str):
        hit = self.open.get(file)
        if hit is not None:
            return hit
        full = os.path.join(self.root, file)
        try:
            fd = os.open(full, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(
                f"fs.checkpoint.load: {full!r} is missing; it holds leaves "
                f"{self._holders(file)}.") from None
        self.open[file] = (fd, None, 0)  # closed by close() whatever happens next
        info = self.files.get(file, {})
        size = os.fstat(fd).st_size
        if "bytes" in info and size != info["bytes"]:
            raise CheckpointError(
                f"fs.checkpoint.load: {full!r} has {size} bytes, the index says "
                f"{info['bytes']} (truncated or replaced); it holds leaves "
                f"{self._holders(file)}.")
        try:
            n = struct.unpack("<Q", _read(fd, 0, 8))[0]
            head = _read(fd, 8, n) if 8 + n <= size else b""
            header = json.loads(head)
        except (struct.error, ValueError) as e:
            raise CheckpointError(
                f"fs.checkpoint.load: {full!r} (holding leaves {self._holders(file)}) is "
                f"not a readable safetensors file: {e}") from None
        if self.verify and hashlib.sha256(struct.pack("<Q", n) + head).hexdigest() != \
                info.get("header_sha256"):
            raise CheckpointError(
                f"fs.checkpoint.load: {full!r} does not match the SHA-256 of its header in "
                f"the index (the file was altered or corrupted); it holds leaves "
                f"{self._holders(file)}.")
        hit = self.open[file] = (fd, header, 8 + n)
        return hit

    def block(self, b: dict, leaf: str, dtype) -> np.ndarray:
        """Block ``b`` (an index entry) of ``leaf``, as an array."""
        fd, header, start = self._file(b["file"])
        full = os.path.join(self.root, b["file"])
        h = header.get(b["key"])
        shape = [t - s for s, t in zip(b["start"], b["stop"])]
        if h is None:
            raise CheckpointError(
                f"fs.checkpoint.load: {b['file']} lacks block {b['key']} of leaf {leaf}.")
        if h.get("shape") != shape or h.get("dtype") != _SAFETENSORS_DTYPES.get(dtype.name):
            raise CheckpointError(
                f"fs.checkpoint.load: block {b['key']} of leaf {leaf} in {b['file']} is "
                f"{h.get('dtype')}{h.get('shape')}, the index says {dtype}{shape}.")
        lo, hi = h["data_offsets"]
        data = _read(fd, start + lo, hi - lo)
        if len(data) != hi - lo:
            raise CheckpointError(
                f"fs.checkpoint.load: {full!r} ends inside block {b['key']} of leaf {leaf} "
                "(truncated).")
        if self.verify and hashlib.sha256(data).hexdigest() != b.get("sha256"):
            raise CheckpointError(
                f"fs.checkpoint.load: {full!r} does not match the SHA-256 of block "
                f"{b['key']} in the index (the file was altered or corrupted); the block "
                f"belongs to leaf {leaf}, the file holds leaves {self._holders(b['file'])}.")
        return np.frombuffer(data, dtype).reshape(shape)

    def close(self) -> None:
        for fd, _, _ in self.open.values():
            os.close(fd)
        self.open.clear()


def _verify_files(root: str, files: dict, leaves: list) -> None:
    """Version 1 checkpoints: every file's size and SHA-256."""
    def holders(file):
        names = sorted({e["path"] for e in leaves for b in e["blocks"] if b["file"] == file})
        return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")

    for file, info in files.items():
        full = os.path.join(root, file)
        if not os.path.exists(full):
            raise CheckpointError(
                f"fs.checkpoint.load: {full!r} is missing; it holds leaves {holders(file)}.")
        size = os.path.getsize(full)
        if size != info["bytes"]:
            raise CheckpointError(
                f"fs.checkpoint.load: {full!r} has {size} bytes, the index says "
                f"{info['bytes']} (truncated or replaced); it holds leaves {holders(file)}.")
        if _sha256(full) != info["sha256"]:
            raise CheckpointError(
                f"fs.checkpoint.load: {full!r} does not match its SHA-256 in the index "
                f"(the file was altered or corrupted); it holds leaves {holders(file)}.")


def clean(path) -> list[str]:
    """Remove the temporary directories of unfinished saves under ``path`` (saves that
    died or timed out); return what was removed. The directory of a save still writing
    (a ``save(wait=False)`` in this process, or a save in another process) is left
    alone."""
    path = os.fspath(path)
    gone = []
    if os.path.isdir(path):
        for d in sorted(os.listdir(path)):
            full = os.path.join(path, d)
            if d.startswith(_TMP_PREFIX) and os.path.isdir(full) and _remove_if_dead(full):
                gone.append(full)
    return gone


def _remove_if_dead(tmp: str) -> bool:
    try:
        fd = os.open(os.path.join(tmp, _LOCK), os.O_RDONLY)
    except FileNotFoundError:
        # no lock: a save that has not taken it yet retries (see _lock_tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live save holds it
        shutil.rmtree(tmp, ignore_errors=True)
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# MindSpore .ckpt and single safetensors files: flat dicts of named parameters
# ---------------------------------------------------------------------------


def _named(params, fn: str) -> dict[str, Any]:
    paths, leaves, _ = tree.flatten_with_path(params)
    out: dict[str, Any] = {}
    for p, x in zip(paths, leaves):
        n = _name(p)
        if n in out:
            raise CheckpointError(
                f"fs.checkpoint.{fn}: two leaves are both named {n!r}.\nFix: use a flat "
                "dict of parameter names (fs.functional(cell)'s params).")
        out[n] = x
    return out


def _restore_named(like, values: dict[str, np.ndarray], source: str, fn: str, strict: bool):
    import mindspore

    paths, likes, spec = tree.flatten_with_path(like)
    names = [_name(p) for p in paths]
    missing = [n for n in names if n not in values]
    if missing:
        raise CheckpointError(
            f"fs.checkpoint.{fn}: {source!r} has no parameter(s) {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} (it has {sorted(values)[:8]}"
            f"{' ...' if len(values) > 8 else ''}).\nFix: match like's names to the "
            "file's (the names of the Cell's parameters).")
    extra = sorted(set(values) - set(names))
    if strict and extra:
        raise CheckpointError(
            f"fs.checkpoint.{fn}: {source!r} has parameter(s) like lacks: {extra[:8]}."
            "\nFix: pass strict=False to ignore them.")
    out = []
    for n, x in zip(names, likes):
        v = values[n]
        a = typeof(x)
        expect = np.dtype(dtypes.to_numpy(a.dtype))
        if tuple(v.shape) != tuple(a.shape) or v.dtype != expect:
            raise CheckpointError(
                f"fs.checkpoint.{fn}: parameter {n!r} in {source!r} is "
                f"{v.dtype}{list(v.shape)}, like has {expect.name}{list(a.shape)}.")
        out.append(mindspore.Tensor(v))
    return tree.unflatten(spec, out)


def save_mindspore(path, params) -> None:
    """Write ``params`` (e.g. ``fs.functional(cell)[1]``, or a nested dict: names are the
    key paths joined by dots) as a MindSpore ``.ckpt`` that ``mindspore.load_checkpoint``
    and ``mindspore.load_param_into_net`` read."""
    import mindspore

    named = _named(params, "save_mindspore")
    items = [{"name": n, "data": mindspore.Tensor(_numpy(x))} for n, x in named.items()]
    tmp = f"{os.fspath(path)}.{uuid.uuid4().hex[:8]}.part.ckpt"
    try:
        mindspore.save_checkpoint(items, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, os.fspath(path))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_mindspore(path, like, *, strict: bool = True):
    """Read a MindSpore ``.ckpt`` (written by ``mindspore.save_checkpoint``) into
    ``like`` (matched by parameter name). ``strict``: the file may hold no other
    parameters."""
    import mindspore

    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"fs.checkpoint.load_mindspore: {path!r} does not exist.")
    try:
        loaded = mindspore.load_checkpoint(path)
    except Exception as e:  # noqa: BLE001  (MindSpore raises ValueError/RuntimeError)
        raise CheckpointError(
            f"fs.checkpoint.load_mindspore: {path!r} is not a readable MindSpore "
            f"checkpoint: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    values = {n: p.asnumpy() for n, p in loaded.items()}
    return _restore_named(like, values, path, "load_mindspore", strict)


def save_safetensors(path, params) -> None:
    """Write ``params`` (named as for ``save_mindspore``) as one safetensors file."""
    named = {n: _numpy(x) for n, x in _named(params, "save_safetensors").items()}
    tmp = f"{os.fspath(path)}.{uuid.uuid4().hex[:8]}.part"
    try:
        _write_bytes_durably(tmp, _safetensors_bytes(named))
        os.replace(tmp, os.fspath(path))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_safetensors(path, like, *, strict: bool = True):
    """Read one safetensors file into ``like`` (matched by name)."""
    from safetensors.numpy import load_file

    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"fs.checkpoint.load_safetensors: {path!r} does not exist.")
    try:
        values = load_file(path)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"fs.checkpoint.load_safetensors: {path!r} is not a readable safetensors "
            f"file: {e}") from None
    return _restore_named(like, values, path, "load_safetensors", strict)


# A run's checkpoints, managed (orbax's CheckpointManager): fshard/training/checkpoint_manager.py
# holds the policy; its files are this module's.
from fshard.training.checkpoint_manager import CheckpointManager as _Manager  # noqa: E402


class CheckpointManager(_Manager):
    __doc__ = _Manager.__doc__
    _save, _load, _index = staticmethod(save), staticmethod(load), INDEX


__all__ += ["CheckpointManager"]
