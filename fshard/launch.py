"""``python -m fshard.launch -n N script.py [args]``: run a script as an N-process job.

The launcher speaks MindSpore's cluster protocol directly, as ``msrun`` does: one
scheduler process (``MS_ROLE=MS_SCHED``) and N workers (``MS_ROLE=MS_WORKER``,
``MS_NODE_ID=RANK_ID=k``) that find it through ``MS_SCHED_HOST``/``MS_SCHED_PORT``.
Differences from msrun, each for a measured reason (docs/launch.md):

- the scheduler runs a two-line stub, not the user's script, so nothing the script
  prints before ``init()`` appears twice;
- each rank's output is streamed live with a ``[rank k]`` prefix (MindSpore's own
  INFO/WARNING log lines go only to the per-rank log files);
- when one rank fails, the others are killed at once, and the exit status names the
  failed rank; an overall ``--timeout`` bounds every job;
- after its script succeeds, a worker waits until every rank has succeeded, then
  exits without MindSpore's slow C++ teardown (it cost 4-6 s per job);
- each rank reports every communicating graph it enters (``fshard.backend``), so when
  a rank dies waiting in a collective the launcher names the ranks that had fallen
  behind as hung, instead of the waiting rank's kernel error;
- MindSpore's wait in a collective (``MS_NODE_TIMEOUT``, 30 s) is scaled to how
  oversubscribed the cores are, and ``FSHARD_LAUNCH_LOCK`` runs jobs one at a time.

This module imports only the standard library at top level: workers load it as a
standalone file to run ``_worker_main`` (no ``import fshard`` in the worker).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Sequence, TextIO

__all__ = ["run", "main", "LaunchResult", "RankResult", "free_port", "job_lock",
           "collective_timeout"]

#: MindSpore's own log lines ("[WARNING] DISTRIBUTED(123,7f..,python):..."); kept in
#: the log files, left out of the streamed output. ERROR lines are always shown.
_MS_LOG_LINE = re.compile(r"^\[(?:DEBUG|INFO|WARNING)\] [A-Z_]+\(\d+[,:]")

# Loads this file as a standalone module in a fresh interpreter and calls one entry.
_BOOT = (
    "import importlib.util as u, sys; s = u.spec_from_file_location('_fshard_launch', {path!r}); "
    "m = sys.modules['_fshard_launch'] = u.module_from_spec(s); s.loader.exec_module(m); "
    "m.{entry}()"
)

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130

#: What a rank logs (an ``[ERROR]`` line) when MindSpore gives up waiting in a
#: collective (CPU: its ring algorithms' "wait receiving ... failed", then the kernel's
#: "launch failed").
_COLLECTIVE_WAIT_FAILED = re.compile(
    r"wait (?:receiving|sending)|CollectiveWait|receive timeout|"
    r"(?:AllReduce|AllGather|Broadcast|ReduceScatter|AlltoAll)\w*KernelMod launch failed")

#: MindSpore's default wait in a collective (``MS_NODE_TIMEOUT``), seconds.
_MS_COLLECTIVE_TIMEOUT = 30
#: Memory of one MindSpore process on CPU (measured: ~420 MiB), for the size check.
_PROCESS_BYTES = 420 * 2**20


@dataclass
class RankResult:
    """One rank of a finished job.

    ``status`` is ``"ok"``, ``"failed"`` (non-zero exit of its own), ``"hung"``
    (stopped by the launcher: it had stopped making progress, so the other ranks timed
    out waiting for it in a collective, or the job timed out), ``"stopped"`` (killed
    by the launcher because another rank failed or hung). ``collectives`` counts the
    communicating graphs it entered.
    ``output`` is what the rank printed (stdout and stderr), without MindSpore's
    INFO/WARNING log lines; ``log_path`` has everything.
    """

    rank: int
    returncode: int | None
    status: str
    output: str
    log_path: str
    collectives: int = 0


@dataclass
class LaunchResult:
    """The outcome of ``run``: exit code, per-rank results, and a summary message."""

    returncode: int
    ranks: list[RankResult]
    failed_ranks: list[int]
    timed_out: bool
    wall_time: float
    log_dir: str
    message: str
    scheduler_log: str = ""
    waited: float = 0.0  # seconds spent waiting for FSHARD_LAUNCH_LOCK before starting

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def output(self, rank: int) -> str:
        """What ``rank`` printed (MindSpore's INFO/WARNING lines removed)."""
        return self.ranks[rank].output

    def check(self) -> "LaunchResult":
        """Return self if every rank succeeded, else raise DistributedError(message)."""
        if not self.ok:
            from fshard.errors import DistributedError

            raise DistributedError(self.message)
        return self


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_held_locks: set = set()  # (path, thread): job_lock held here (so it nests)


@contextlib.contextmanager
def job_lock(path: str | None = None, out: TextIO | None = None):
    """Hold the lock file ``path`` (default: ``$FSHARD_LAUNCH_LOCK``; nothing when
    neither is set) for the duration of the block: jobs that share it run one at a
    time, so their processes never compete for the cores (``run`` takes it for each
    job; take it yourself around jobs started another way, e.g. by ``msrun``). Yields
    the seconds spent waiting; nests within one thread.

    >>> with job_lock() as waited:  # FSHARD_LAUNCH_LOCK unset: no lock
    ...     waited
    0.0
    """
    path = path or os.environ.get("FSHARD_LAUNCH_LOCK")
    key = (path, threading.get_ident())
    if not path or key in _held_locks:
        yield 0.0
        return
    import fcntl

    start = time.monotonic()
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if out is not None:
                print(f"fshard.launch: waiting for {path} (another job holds it)", file=out,
                      flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        _held_locks.add(key)
        try:
            yield time.monotonic() - start
        finally:
            _held_locks.discard(key)
            fcntl.flock(fh, fcntl.LOCK_UN)


def collective_timeout(n: int) -> int:
    """Seconds a rank of an ``n``-process job started now should wait in a collective
    before MindSpore gives up (``MS_NODE_TIMEOUT``, by default 30 s): 30 s times how
    oversubscribed the cores are (this job's processes plus the load already
    running, over the cores), at most 600 s. A loaded machine makes a healthy rank
    arrive late at a collective; a hung one is still found, later."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available here
        load = 0.0
    factor = max(1.0, (n + load) / cores)
    return int(min(600, math.ceil(_MS_COLLECTIVE_TIMEOUT * factor)))


def _check_size(n: int) -> tuple[str | None, str | None]:
    """(why ``n`` processes cannot run here, or None; a warning, or None)."""
    try:
        with open("/proc/meminfo") as fh:
            total = int(fh.readline().split()[1]) * 1024  # "MemTotal: <kB> kB"
    except (OSError, ValueError, IndexError):
        total = None
    need = (n + 1) * _PROCESS_BYTES  # the ranks and the scheduler
    if total is not None and need > total:
        return (f"{n} processes need about {need / 2**30:.0f} GiB (each MindSpore process "
                f"takes ~420 MiB), more than this machine's {total / 2**30:.1f} GiB. Fix: "
                "fewer processes (one per device; a virtual mesh, fs.Mesh or "
                "FSHARD_DEVICES, tries many devices in one process)."), None
    cores = os.cpu_count() or 1
    if n > 2 * cores:
        return None, (
            f"fshard.launch: warning: {n} processes on {cores} cores: each rank gets "
            f"{cores / n:.2g} of a core, so the job will be slow and ranks arrive late at "
            "collectives (MindSpore's wait in a collective is scaled to the load). Fix: "
            "fewer processes, or a virtual mesh (fs.Mesh, FSHARD_DEVICES) to try many "
            "devices in one process.")
    return None, None


# ---------------------------------------------------------------------------
# Child side (runs in the scheduler and worker processes)
# ---------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the launcher dies (no orphans)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the release pipe's EOF still ends a waiting worker
        return
    if str(os.getppid()) != os.environ.get("FSHARD_LAUNCH_PARENT"):
        os._exit(1)  # the launcher died before prctl took effect


def _scheduler_main() -> None:
    """MindSpore's scheduler: ``init()`` under MS_ROLE=MS_SCHED serves the cluster and
    ends the process inside init; it never returns to the caller."""
    _die_with_parent()
    from mindspore.communication import init

    init()


def _record_exit_funcs() -> list:
    """Record the Python exit handlers the script registers (they still register too)."""
    import atexit

    funcs: list = []
    register = atexit.register

    def recording_register(func, *args, **kwargs):
        funcs.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    atexit.register = recording_register
    return funcs


def _run_exit_funcs(funcs: list) -> None:
    """Run the recorded exit handlers, last first, then flush logging.

    Handlers bound through pybind11 (MindSpore's C++ runtime and cluster teardown,
    1-4 s per rank) are skipped: the process ends with ``os._exit`` right after.
    """
    import traceback

    for func, args, kwargs in reversed(funcs):
        if type(getattr(func, "__self__", None)).__name__ == "PyCapsule":
            continue
        try:
            func(*args, **kwargs)
        except Exception:
            traceback.print_exc()
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()


def _worker_main() -> None:
    """Run the user's script as ``__main__``, report, wait for the others, exit."""
    import runpy
    import traceback

    _die_with_parent()
    status_fd = int(os.environ.pop("FSHARD_LAUNCH_STATUS_FD"))
    release_fd = int(os.environ.pop("FSHARD_LAUNCH_RELEASE_FD"))
    module = os.environ.pop("FSHARD_LAUNCH_MODULE") == "1"
    target, args = sys.argv[1], sys.argv[2:]
    # fs.distributed.init() reports "entering init" ("i") and fshard.backend each
    # communicating graph the rank enters ("c") through this (only in this process).
    os.environ["FSHARD_LAUNCH_REPORT_FD"] = f"{status_fd}:{os.getpid()}"
    exit_funcs = _record_exit_funcs()
    code = 0
    try:
        sys.argv = [target, *args]
        if module:
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        # Show the user's frames only, as `python script.py` would.
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        code = 1
    if "mindspore" in sys.modules:
        try:  # let queued PyNative work (and its collectives) finish first
            from fshard.backend.mindspore import sync_pynative

            sync_pynative()
        except Exception:
            pass
    _run_exit_funcs(exit_funcs)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        # NB: exiting now would let MindSpore's scheduler time this node out (~30 s
        # later) and kill ranks still working; so wait until all ranks are done.
        # "d": done; "n": done without ever joining the job, which ranks waiting for
        # this one in init() would otherwise only learn at the timeout.
        joined = False
        if "mindspore" in sys.modules:
            from fshard.backend.mindspore import comm_initialized

            joined = comm_initialized()
        os.write(status_fd, b"d" if joined else b"n")
        os.read(release_fd, 1)  # b"g" from the launcher, or b"" if it died
    os._exit(code)


# ---------------------------------------------------------------------------
# Launcher side
# ---------------------------------------------------------------------------


class _Worker:
    def __init__(self, rank: int, proc: subprocess.Popen, status_r: int, release_w: int,
                 log_path: str):
        self.rank = rank
        self.proc = proc
        self.status_r = status_r
        self.release_w = release_w
        self.log_path = log_path
        self.lines: list[str] = []
        self.done = False
        self.eof = False
        self.entered_init = False  # called fs.distributed.init()
        self.left_unjoined = False  # finished without joining the job
        self.collectives = 0  # communicating graphs entered
        self.wait_failed = False  # MindSpore gave up waiting in a collective here
        self.reader: threading.Thread | None = None


def _kill(proc: subprocess.Popen, grace: float = 1.0) -> None:
    """Stop a child and everything it started (its own process group), also when the
    child itself has exited: processes it started (``subprocess.Popen``) must not
    outlive the job. Returns once none of them runs (a SIGKILL takes effect when the
    kernel next schedules its process: on a loaded machine, milliseconds later)."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its group
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + 5.0
    while _group_runs(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _group_runs(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie, waiting to be reaped,
    does not). Read from /proc; elsewhere, False."""
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state, _, group = fh.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state not in ("Z", "X"):
            return True
    return False


def _pump(worker: _Worker, log: TextIO, out: TextIO | None, lock: threading.Lock,
          show_ms_logs: bool) -> None:
    """Copy a worker's output to its log file, its buffer, and (prefixed) to ``out``."""
    prefix = f"[rank {worker.rank}] "
    for raw in iter(worker.proc.stdout.readline, b""):
        line = raw.decode("utf-8", "replace")
        log.write(line)
        log.flush()
        if line.startswith("[ERROR]") and _COLLECTIVE_WAIT_FAILED.search(line):
            # MindSpore logs it and may carry on (the error reaches Python only when
            # the result is read): the job is over either way.
            worker.wait_failed = True
        if _MS_LOG_LINE.match(line) and not show_ms_logs:
            continue
        worker.lines.append(line)
        if out is not None:
            with lock:
                out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                out.flush()
    worker.proc.stdout.close()


def _tail(text: str, n: int = 15) -> str:
    lines = text.rstrip("\n").splitlines()
    return "\n".join(lines[-n:])


def _ranks(xs) -> str:
    xs = list(xs)
    return ("rank " if len(xs) == 1 else "ranks ") + ", ".join(map(str, xs))


def run(
    script_or_module: str,
    n: int,
    args: Sequence[str] = (),
    timeout: float = 300.0,
    *,
    module: bool = False,
    log_dir: str | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
    stream: bool = False,
    out: TextIO | None = None,
    show_mindspore_logs: bool = False,
) -> LaunchResult:
    """Run ``script_or_module`` as an ``n``-process job and wait for it.

    >>> result = run("train.py", 2, ["--steps", "10"], timeout=120)  # doctest: +SKIP
    >>> result.check().output(0)  # doctest: +SKIP
    'rank 0 of 2: loss 0.12\\n'

    Args:
        script_or_module: path of a Python script, or a module name with ``module=True``.
        n: number of processes (ranks); each is one device.
        args: command-line arguments for the script.
        timeout: seconds for the whole job; then every rank is killed.
        module: run ``python -m script_or_module`` instead of a script path.
        log_dir: where ``rank_<k>.log`` and ``scheduler.log`` go (default: a new
            temporary directory, named in the result's message).
        port: the scheduler's port on 127.0.0.1 (default: a free one).
        env: extra environment variables for every rank.
        stream: also print each rank's output live, prefixed ``[rank k]``, to ``out``
            (default ``sys.stdout``).
        show_mindspore_logs: keep MindSpore's INFO/WARNING lines in the output.

    Returns:
        A ``LaunchResult``; ``returncode`` is 0, the failed rank's exit code (1 when it
        was killed by a signal), 124 on timeout or 130 when interrupted.

    See also: ``python -m fshard.launch --help``, docs/launch.md.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        from fshard.errors import ArgumentError

        raise ArgumentError(f"n must be a positive int (the number of ranks); got {n!r}.")
    problem = _check_options(timeout, port, log_dir)
    if problem:
        from fshard.errors import ArgumentError

        raise ArgumentError(problem)
    if not module and not os.path.isfile(script_or_module):
        from fshard.errors import ArgumentError

        raise ArgumentError(
            f"script {script_or_module!r} does not exist (cwd {os.getcwd()}). Fix: give the "
            f"path of a Python file, or module=True (-m) for a module name."
        )
    too_many, warning = _check_size(n)
    if too_many:
        from fshard.errors import ArgumentError

        raise ArgumentError(f"n={n}: {too_many}")
    out = (out or sys.stdout) if stream else None
    if warning:
        print(warning, file=sys.stderr, flush=True)
    with job_lock(out=out) as waited:
        result = _run(script_or_module, n, args, timeout, module, log_dir, port, env, out,
                      show_mindspore_logs)
    result.waited = waited
    return result


class _Job:
    """One job on its way: what ``run`` was asked, the processes it started and what
    it observed. ``_run`` passes it through the steps below, in order."""

    def __init__(self, n, timeout, module, log_dir, port, env, out, show_mindspore_logs):
        self.n, self.timeout, self.module = n, timeout, module
        self.out, self.show_mindspore_logs = out, show_mindspore_logs
        self.keep_logs = log_dir is not None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="fshard-launch-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.port = port or free_port()
        self.env = _job_env(n, timeout, self.port, env)
        self.start = time.monotonic()
        self.sched: subprocess.Popen | None = None
        self.sched_log_path = os.path.join(self.log_dir, "scheduler.log")
        self.workers: list[_Worker] = []
        self.logs: list[TextIO] = []
        self.failed: list[int] = []
        self.waited_out: list[int] = []  # ranks where MindSpore gave up in a collective
        self.running: list[int] = []     # ranks still running when the job was stopped
        self.timed_out = self.interrupted = False
        self.sched_failed: int | None = None
        self.wall = 0.0

    @property
    def unjoined(self) -> list[int]:   # finished without joining the job
        return [w.rank for w in self.workers if w.left_unjoined]

    @property
    def waiting(self) -> list[int]:    # in fs.distributed.init() and not done
        return [w.rank for w in self.workers if w.entered_init and not w.done]


def _job_env(n: int, timeout: float, port: int, env: dict | None) -> dict:
    """The environment every process of the job starts from."""
    base = dict(os.environ)
    base.update(env or {})
    # MindSpore's wait in a collective, scaled to the load (unless the caller set it)
    base.setdefault("MS_NODE_TIMEOUT", str(collective_timeout(n)))
    base.update(
        MS_SCHED_HOST="127.0.0.1",
        MS_SCHED_PORT=str(port),
        MS_WORKER_NUM=str(n),
        MS_TOPO_TIMEOUT=str(max(30, int(timeout))),
        RANK_SIZE=str(n),
        PYTHONUNBUFFERED="1",
        FSHARD_LAUNCH_PARENT=str(os.getpid()),
    )
    return base


def _start_scheduler(job: _Job) -> None:
    job.sched_log = open(job.sched_log_path, "w")
    job.sched = subprocess.Popen(
        [sys.executable, "-c", _BOOT.format(path=os.path.abspath(__file__),
                                            entry="_scheduler_main")],
        env=dict(job.env, MS_ROLE="MS_SCHED", MS_NODE_ID="sched", RANK_ID="0"),
        stdin=subprocess.DEVNULL, stdout=job.sched_log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _start_workers(job: _Job, script_or_module: str, args) -> None:
    lock = threading.Lock()
    for k in range(job.n):
        status_r, status_w = os.pipe()
        release_r, release_w = os.pipe()
        wenv = dict(
            job.env,
            MS_ROLE="MS_WORKER", MS_NODE_ID=str(k), RANK_ID=str(k), DEVICE_ID=str(k),
            FSHARD_LAUNCH_STATUS_FD=str(status_w), FSHARD_LAUNCH_RELEASE_FD=str(release_r),
            FSHARD_LAUNCH_MODULE="1" if job.module else "0",
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT.format(path=os.path.abspath(__file__),
                                                entry="_worker_main"),
             script_or_module, *map(str, args)],
            env=wenv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, pass_fds=(status_w, release_r),
            start_new_session=True,
        )
        os.close(status_w)
        os.close(release_r)
        log_path = os.path.join(job.log_dir, f"rank_{k}.log")
        w = _Worker(k, proc, status_r, release_w, log_path)
        log = open(log_path, "w")
        job.logs.append(log)
        w.reader = threading.Thread(
            target=_pump, args=(w, log, job.out, lock, job.show_mindspore_logs), daemon=True
        )
        w.reader.start()
        job.workers.append(w)


def _read_status(workers: list[_Worker]) -> None:
    """Read what the workers reported (one letter per event) without blocking long."""
    import select

    pending = [w.status_r for w in workers if not (w.done or w.eof)]
    ready = select.select(pending, [], [], 0.05)[0] if pending else []
    if not pending:
        time.sleep(0.05)
    for w in workers:
        if w.status_r in ready:
            data = os.read(w.status_r, 4096)
            if not data:  # the worker exited without reporting; poll() tells how
                w.eof = True
            w.collectives += data.count(b"c")
            w.entered_init |= b"i" in data
            w.left_unjoined |= b"n" in data
            w.done |= b"d" in data or b"n" in data


def _watch(job: _Job) -> None:
    """Wait until the job succeeds, a rank fails or gives up in a collective, ranks
    wait in init() for a rank that left, the scheduler dies, or time runs out. Once
    every rank's script has succeeded, release them (they exit without MindSpore's
    slow teardown)."""
    workers = job.workers
    released = False
    deadline = job.start + job.timeout
    while True:
        _read_status(workers)
        codes = [w.proc.poll() for w in workers]
        job.failed = [w.rank for w, c in zip(workers, codes, strict=True)
                      if c not in (None, 0)]
        job.waited_out = [w.rank for w in workers if w.wait_failed]
        if job.failed or job.waited_out:
            return
        if job.unjoined and job.waiting:  # they wait in init() for ranks that never come
            return
        if all(c == 0 for c in codes):
            return
        if not released and all(w.done or c == 0 for w, c in zip(workers, codes,
                                                                   strict=True)):
            for w in workers:
                try:
                    os.write(w.release_w, b"g")
                except OSError:  # that worker already exited
                    pass
            released = True
        sc = job.sched.poll()
        if sc not in (None, 0) and not released:
            job.sched_failed = sc
            return
        if time.monotonic() > deadline:
            job.timed_out = True
            return


def _stop(job: _Job) -> None:
    """Kill what is left of the job and close its pipes and logs."""
    job.running = [w.rank for w in job.workers if w.proc.poll() is None]
    for w in job.workers:
        _kill(w.proc)
    if job.sched is not None:
        _kill(job.sched, grace=0.2)
    for w in job.workers:
        if w.reader is not None:
            w.reader.join(5.0)
        for fd in (w.status_r, w.release_w):
            try:
                os.close(fd)
            except OSError:
                pass
    for log in job.logs:
        log.close()
    if job.sched is not None:
        job.sched_log.close()
    job.wall = time.monotonic() - job.start


def _run(script_or_module, n, args, timeout, module, log_dir, port, env, out,
         show_mindspore_logs) -> LaunchResult:
    job = _Job(n, timeout, module, log_dir, port, env, out, show_mindspore_logs)
    try:
        _start_scheduler(job)
        _start_workers(job, script_or_module, args)
        _watch(job)
    except KeyboardInterrupt:
        job.interrupted = True
    finally:
        _stop(job)
    return _report(job)


def _report(job: _Job) -> LaunchResult:
    """The job's outcome: each rank's result, the exit code, and a message that names
    the rank to look at and the fix."""
    results = []
    for w in job.workers:
        rc = w.proc.returncode
        status = "failed" if w.rank in job.failed else "ok" if rc == 0 else "stopped"
        results.append(RankResult(w.rank, rc, status, "".join(w.lines), w.log_path,
                                  w.collectives))
    with open(job.sched_log_path, errors="replace") as f:
        sched_text = f.read()
    problem = (job.interrupted or job.timed_out or job.failed or job.waited_out
               or job.sched_failed is not None)
    where = f"Logs: {job.log_dir}"
    if not job.keep_logs and not problem:
        # A successful job leaves nothing behind unless logs were asked for (--log-dir).
        import shutil

        shutil.rmtree(job.log_dir, ignore_errors=True)
        where = "(logs removed; keep them with --log-dir)"
    unjoined, waiting = job.unjoined, job.waiting
    if unjoined and waiting and not (job.interrupted or job.timed_out or job.failed
                                     or job.waited_out):
        job.failed = unjoined
        for r in results:
            if r.rank in unjoined:
                r.status = "failed"
    if job.interrupted:
        code = EXIT_INTERRUPTED
        msg = (f"fshard.launch: interrupted after {job.wall:.1f} s; stopped "
               f"{_ranks(job.running)}. {where}")
    elif job.timed_out:
        code, msg = EXIT_TIMEOUT, _timed_out(job, results, where)
    elif job.failed and job.failed == unjoined:
        code = 1
        msg = (
            f"fshard.launch: {_ranks(unjoined)} finished (exit code 0) after {job.wall:.1f} "
            f"s without joining the job, while {_ranks(waiting)} waited for "
            f"{'it' if len(unjoined) == 1 else 'them'} in fs.distributed.init(); stopped "
            f"{_ranks(waiting)}. Fix: call fs.distributed.init() on every rank (before "
            f"any rank-dependent early exit). {where}"
        )
    elif job.waited_out or job.failed and any(w.wait_failed for w in job.workers):
        code, msg = EXIT_TIMEOUT, _waited_in_collective(job, results, where)
    elif job.failed:
        first = results[job.failed[0]]
        rc = first.returncode
        code = rc if rc and rc > 0 else 1
        how = (f"exit code {rc}" if rc and rc > 0
               else f"signal {signal.Signals(-rc).name}" if rc else "an error")
        stopped = [r.rank for r in results if r.status == "stopped"]
        msg = f"fshard.launch: {_ranks(job.failed)} failed ({how}) after {job.wall:.1f} s"
        msg += f"; stopped {_ranks(stopped)}." if stopped else "."
        tail = _tail(first.output) or "(no output)"
        msg += f"\n--- last lines of rank {first.rank} ---\n{tail}\n--- {where}"
    elif job.sched_failed is not None:
        code = 1
        msg = (
            f"fshard.launch: the MindSpore scheduler exited with code {job.sched_failed} "
            f"before the ranks finished (port {job.port} busy?); stopped "
            f"{_ranks(job.running)}.\n--- last lines of scheduler.log ---\n"
            f"{_tail(sched_text)}\n--- {where}"
        )
    else:
        code = 0
        msg = f"fshard.launch: {job.n} ranks finished in {job.wall:.1f} s. {where}"
    return LaunchResult(code, results, job.failed, job.timed_out, job.wall, job.log_dir, msg,
                        sched_text)


def _timed_out(job: _Job, results: list[RankResult], where: str) -> str:
    """The whole job ran out of time: name the ranks that were behind as hung."""
    workers = job.workers
    hung = [w.rank for w in workers if w.rank in job.running and not w.done]
    finished = [w.rank for w in workers if w.rank not in hung]
    counts = [w.collectives for w in workers]
    if hung and any(counts) and min(counts[r] for r in hung) < max(counts):
        # the ranks that are behind are the hung ones; the rest wait for them
        top = max(counts)
        behind = [r for r in hung if counts[r] < top]
        finished += [r for r in hung if r not in behind]
        hung = behind
    for r in results:
        if r.rank in hung:
            r.status = "hung"
    job.failed = job.running = hung
    return (
        f"fshard.launch: timed out after {job.timeout:g} s: {_ranks(hung)} still running "
        f"(hung?) and stopped"
        + (f"; {_ranks(sorted(finished))} had finished or waited for "
           f"{'it' if len(hung) == 1 else 'them'}" if finished and any(counts)
           else f"; {_ranks(finished)} had finished" if finished else "")
        + (f" ({_progress(workers)})" if any(counts) else "")
        + ". Fix: raise --timeout, or look for a rank stuck in a collective or in "
        "init (every rank must run the same collectives in the same order, and call "
        f"fs.distributed.init()). {where}"
    )


def _waited_in_collective(job: _Job, results: list[RankResult], where: str) -> str:
    """A rank gave up waiting in a collective: the ranks it waited for are the story."""
    workers = job.workers
    waiting = [w.rank for w in workers if w.wait_failed]
    for r in results:
        if r.rank in waiting:
            r.status = "failed"
    counts = [w.collectives for w in workers]
    top = max(counts[r] for r in waiting)
    behind = [w.rank for w in workers if w.rank not in waiting and counts[w.rank] < top]
    wait = job.env["MS_NODE_TIMEOUT"]
    job.failed = waiting
    if not behind:
        stopped = [r.rank for r in results if r.status == "stopped"]
        return (
            f"fshard.launch: {_ranks(waiting)} timed out in a collective after "
            f"{job.wall:.1f} s, waiting {wait} s (MS_NODE_TIMEOUT); no rank was behind "
            f"({_progress(workers)}), so a rank was slow inside the same collective's "
            "graph (compiling it, or computing on a loaded machine) or the ranks' "
            "graphs communicate differently; stopped "
            f"{_ranks(stopped)}. Fix: set MS_NODE_TIMEOUT higher for slow steps, and "
            "check that every rank runs the same program (the same shapes, the same "
            f"collectives in the same order). {where}")
    job.failed = behind
    for r in results:
        if r.rank in behind:
            r.status = "hung"
    late = results[behind[0]]
    stopped = [r.rank for r in results if r.status != "ok" and r.rank not in waiting]
    return (
        f"fshard.launch: {_ranks(behind)} stopped making progress (hung?): "
        f"{_ranks(waiting)} timed out in a collective after {job.wall:.1f} s, waiting "
        f"{wait} s (MS_NODE_TIMEOUT) for {'it' if len(behind) == 1 else 'them'} in "
        f"collective #{top} ({_progress(workers)}); stopped {_ranks(stopped)}. "
        f"Fix: look at what {_ranks(behind)} does before its collective "
        f"#{counts[behind[0]] + 1} (a rank-dependent branch, a long computation, "
        "waiting for input): every rank must run the same collectives in the same "
        "order. A slow but healthy rank needs a longer wait: set MS_NODE_TIMEOUT "
        f"(seconds).\n--- last lines of rank {late.rank} ---\n"
        f"{_tail(late.output) or '(no output)'}\n--- {where}")


def _progress(workers) -> str:
    return "collectives entered: " + ", ".join(
        f"rank {w.rank} {w.collectives}" for w in workers)


def _check_options(timeout, port, log_dir) -> str | None:
    """What is wrong with the job options, or None."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            math.isfinite(timeout) and timeout > 0):
        return f"timeout must be a positive, finite number of seconds; got {timeout!r}."
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 1 <= port <= 65535):
        return f"port must be an int in [1, 65535] (or None for a free one); got {port!r}."
    if log_dir is not None and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        return f"log_dir {log_dir!r} is a file, not a directory."
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry: ``fshard-launch -n N [options] script.py [args...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m fshard.launch",
        description="Run a script as an N-process MindSpore job (one device per process).",
    )
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds for the whole job (default 300)")
    parser.add_argument("--log-dir", default=None,
                        help="directory for rank_<k>.log and scheduler.log (default: a new "
                             "temporary directory)")
    parser.add_argument("--port", type=int, default=None,
                        help="scheduler port on 127.0.0.1 (default: a free port)")
    parser.add_argument("--quiet", action="store_true", help="do not stream rank output")
    parser.add_argument("--show-mindspore-logs", action="store_true",
                        help="also stream MindSpore's INFO/WARNING log lines")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="run the target as a module (python -m target)")
    parser.add_argument("target", help="the script (or module with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.nproc < 1:
        parser.error(f"-n must be a positive number of ranks; got {ns.nproc}")
    too_many, _ = _check_size(ns.nproc)
    if too_many:
        parser.error(f"-n {ns.nproc}: {too_many}")
    problem = _check_options(ns.timeout, ns.port, ns.log_dir)
    if problem:
        parser.error(problem.replace("timeout", "--timeout", 1).replace("port must", "--port "
                     "must", 1).replace("log_dir", "--log-dir", 1))
    if not ns.module and not os.path.isfile(ns.target):
        parser.error(f"script {ns.target!r} not found (use -m for a module)")
    result = run(
        ns.target, ns.nproc, ns.args, ns.timeout, module=ns.module, log_dir=ns.log_dir,
        port=ns.port, stream=not ns.quiet, show_mindspore_logs=ns.show_mindspore_logs,
    )
    print(result.message, file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
