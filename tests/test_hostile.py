"""Hostile inputs: every misuse is an fshard error that names what was wrong (never a
raw Python or MindSpore error, never silently accepted). One case per line: transform
arguments, differentiation, fs.ops called with bad values, methods of traced values,
strategy files, the launcher's options and faults, generated-source directories. The
messages themselves are in docs/errors.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

import fshard as fs
from fshard import launch

X = np.ones((3,), np.float32)


def _bad_custom_jvp():
    f = fs.custom_jvp(lambda a: a * a)
    f.defjvp(lambda p, t: (p[0] * p[0], t[0] * t[0]))  # not linear in the tangents
    return fs.grad(lambda a: f(a).sum())(ms.Tensor(X))


CASES = {
    # transform arguments, checked when the transform is applied
    "jit(None)": (lambda: fs.jit(None), fs.ArgumentError, "fs.jit expects a function"),
    "jit(3)": (lambda: fs.jit(3), fs.ArgumentError, "got int 3"),
    "make_ir(None)": (lambda: fs.make_ir(None), fs.ArgumentError, "fs.make_ir expects"),
    "grad(None)": (lambda: fs.grad(None), fs.ArgumentError, "fs.grad expects"),
    "value_and_grad(None)": (lambda: fs.value_and_grad(None), fs.ArgumentError, "expects"),
    "jvp(None)": (lambda: fs.jvp(None, (X,), (X,)), fs.ArgumentError, "fs.jvp expects"),
    "vjp(None)": (lambda: fs.vjp(None, X), fs.ArgumentError, "fs.vjp expects"),
    "jacrev(None)": (lambda: fs.jacrev(None), fs.ArgumentError, "fs.jacrev expects"),
    "jacfwd(None)": (lambda: fs.jacfwd(None), fs.ArgumentError, "fs.jacfwd expects"),
    "hessian(None)": (lambda: fs.hessian(None), fs.ArgumentError, "fs.hessian expects"),
    "static_argnums='n'": (lambda: fs.jit(lambda a: a, static_argnums="n"), fs.ArgumentError,
                           "static_argnums"),
    "static_argnames=5": (lambda: fs.jit(lambda a: a, static_argnames=5), fs.ArgumentError,
                          "static_argnames"),
    "static_argnames naming nothing": (lambda: fs.jit(lambda a: a, static_argnames="b"),
                                       fs.ArgumentError, "no parameter named 'b'"),
    "vmap(axis_size=-1)": (lambda: fs.vmap(lambda a: a, in_axes=None, axis_size=-1),
                           fs.BatchingError, "axis_size"),
    "vmap(axis_size='3')": (lambda: fs.vmap(lambda a: a, in_axes=None, axis_size="3"),
                            fs.BatchingError, "axis_size"),
    "defvjp(3, 4)": (lambda: fs.custom_vjp(lambda a: a).defvjp(3, 4),
                     fs.DifferentiationError, "must be a function"),
    "custom_vjp(5)": (lambda: fs.custom_vjp(5), fs.DifferentiationError, "decorates a function"),
    "nondiff_argnums=(5,)": (lambda: fs.custom_jvp(lambda a: a, nondiff_argnums=(5,)),
                             fs.DifferentiationError, "out of range"),
    "Python int 2**70": (lambda: fs.jit(lambda a, b: a * b)(X, 2**70), fs.ArgumentError,
                         "does not fit in int64"),
    "shard(search='yes')": (lambda: fs.shard(lambda a: a, ((1,),), mesh=2, search="yes"),
                            fs.ShardingError, "search must be True"),
    "shard(level=1.0)": (lambda: fs.shard(lambda a: a, ((1,),), mesh=2, level=1.0),
                         fs.ShardingError, "level must be"),
    # differentiation
    "vjp cotangent of another dtype": (
        lambda: fs.vjp(lambda a: a * 2, ms.Tensor(X))[1](ms.Tensor(np.ones(3))),
        fs.DifferentiationError, "cotangent must have its output's shape and dtype"),
    "custom_jvp rule not linear": (_bad_custom_jvp, fs.DifferentiationError,
                                   "make the JVP rule linear"),
    # fs.ops called eagerly with bad values
    "cast(x, None)": (lambda: fs.ops.cast(X, None), fs.ArgumentError, "dtype is None"),
    "sum(axis=(1, 1))": (lambda: fs.ops.reduce_sum(np.ones((2, 3)), (1, 1)), fs.ArgumentError,
                         "more than once"),
    "reshape(x, 'a')": (lambda: fs.ops.reshape(X, "a"), fs.ArgumentError, "tuple of ints"),
    "reshape(x, (1.5, 2))": (lambda: fs.ops.reshape(X, (1.5, 2)), fs.ArgumentError,
                             "is a float"),
    "full((-1, 2))": (lambda: fs.ops.full((-1, 2), 0.0), fs.ShapeError, "negative"),
    "bool matmul": (lambda: fs.ops.matmul(np.ones((2, 2), bool), np.ones((2, 2), bool)),
                    fs.ProgramTypeError, "bool operands"),
    "gather index out of range": (lambda: fs.ops.gather(X, np.array([5]), 0), fs.ArgumentError,
                                  r"outside \[0, 3\)"),
    "scatter_add index out of range": (
        lambda: fs.ops.scatter_add(np.ones(2, np.float32), np.array([0, 7]), (3,)),
        fs.ArgumentError, r"outside \[0, 3\)"),
    "Symbol(max=1, min=5)": (lambda: fs.Symbol(max=1, min=5), fs.ArgumentError, "max is below"),
    "visualize_sharding negative shape": (
        lambda: fs.visualize_sharding((-4, 2), (2, 1), mesh=fs.Mesh((2,), ("d",))),
        fs.ArgumentError, r"tuple of non-negative ints .* got \(-4, 2\)"),
    "visualize_sharding float shape": (
        lambda: fs.visualize_sharding((4.0, 2), None, mesh=fs.Mesh((2,), ("d",))),
        fs.ArgumentError, "tuple of non-negative ints"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_misuse_is_an_fshard_error(name):
    call, error, match = CASES[name]
    with pytest.raises(error, match=match):
        call()


def test_numpy_arguments_that_are_not_differentiated_are_converted():
    w = ms.Tensor(np.full(3, 2.0, np.float32))
    g = fs.grad(lambda w, x: (ops.exp(x) * w).sum())(w, X)
    np.testing.assert_allclose(g.asnumpy(), np.exp(X), rtol=1e-6)
    net = nn.SequentialCell([nn.Dense(3, 1)])
    grads = fs.grad(lambda x: net(x).sum())(np.ones((2, 3), np.float32))
    assert grads.shape == (2, 3)


@pytest.mark.parametrize("mean", [
    lambda a: fs.jit(lambda a: a.mean(axis=0))(a),
    lambda a: fs.jit(lambda a: ops.mean(a, 0))(a),
    lambda a: fs.ops.mean(a, 0),
    lambda a: fs.vmap(lambda r: r.mean(axis=0))(a[None])[0],
], ids=["jit Tensor.mean", "jit ops.mean", "fs.ops.mean", "vmap"])
def test_the_mean_of_an_empty_axis_is_nan(mean):
    got = mean(np.ones((0, 3), np.float32)).asnumpy()
    assert got.shape == (3,) and np.isnan(got).all(), got


# -- strategy files ----------------------------------------------------------------------


@pytest.fixture
def sharded():
    return fs.shard(lambda a: a * 2, in_strategy=((2,),), mesh=2)


@pytest.mark.parametrize("content, match", [
    (b"{", "not valid JSON"), (b"", "not valid JSON"), (b"[1, 2]", "holds a JSON list"),
    (b"null", "holds a JSON NoneType"), (b"\x00\xff\xfe", "not text"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply|not valid JSON"),
    (b'{"device_num": 2, "inputs": [], "equations": [{"primitive": "mul"}]}',
     "no 'assignment' list"),
    (b'{"device_num": 2, "inputs": [{"layout": [["x9"]]}], "equations": []}',
     "mesh axis names"),
])
def test_bad_strategy_files_are_refused_naming_the_file(tmp_path, sharded, content, match):
    path = tmp_path / "s.json"
    path.write_bytes(content)
    with pytest.raises(fs.ShardingError, match=match) as e:
        sharded.load_strategies(path)
    assert str(path) in str(e.value)


def test_missing_or_directory_strategy_files(tmp_path, sharded):
    with pytest.raises(fs.ShardingError, match="no such file"):
        sharded.load_strategies(tmp_path / "nope.json")
    with pytest.raises(fs.ShardingError, match="is a directory"):
        sharded.load_strategies(tmp_path)
    with pytest.raises(fs.ShardingError, match="does not exist"):
        sharded.save_strategies(tmp_path / "no" / "s.json", np.ones(4, np.float32))


def test_a_strategy_file_for_another_mesh_is_refused_when_used(tmp_path, sharded):
    path = tmp_path / "s.json"
    sharded.save_strategies(path, np.ones(4, np.float32))
    data = json.loads(path.read_text())
    data["inputs"][0]["layout"] = [["m7"]]
    path.write_text(json.dumps(data))
    with pytest.raises(fs.ShardingError, match="prime axes"):
        sharded.load_strategies(path)(np.ones(4, np.float32))


def test_save_strategies_is_atomic(tmp_path, sharded, monkeypatch):
    path = tmp_path / "s.json"
    sharded.save_strategies(path, np.ones(4, np.float32))
    before = path.read_text()

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", full_disk)
    with pytest.raises(fs.ShardingError, match="No space left on device.*unchanged"):
        sharded.save_strategies(path, np.ones(4, np.float32))
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temporary file left


# -- methods of traced values --------------------------------------------------------------

TRACED = np.arange(6, dtype=np.float32).reshape(2, 3)


# Every method a hostile user tried: the common ones trace and compute what NumPy does
# (MindSpore's CPU kernel for a float any(axis) answers wrongly, so NumPy is the
# reference); the rest are fshard errors naming the method.
METHOD_CALLS = {
    "clip": (lambda a: a.clip(1.0, 4.0), lambda a: a.clip(1.0, 4.0)),
    "clamp": (lambda a: a.clamp(1.0, 4.0), lambda a: a.clip(1.0, 4.0)),
    "any": (lambda a: a.any(), None), "all": (lambda a: a.all(), None),
    "any(axis)": (lambda a: a.any(1), None), "all(axis)": (lambda a: a.all(0), None),
    "std": (lambda a: a.std(), None), "var": (lambda a: a.var(), None),
    "var(axis)": (lambda a: a.var(0), None),
    "norm": (lambda a: a.norm(), lambda a: np.linalg.norm(a)),
    "copy": (lambda a: a.copy(), None),
    "np.sum": (lambda a: np.sum(a), None), "np.mean": (lambda a: np.mean(a, axis=0), None),
    "np.max": (lambda a: np.max(a), None), "np.min": (lambda a: np.min(a, axis=1), None),
    "np.argmax": (lambda a: np.argmax(a), None), "np.std": (lambda a: np.std(a), None),
    "np.var": (lambda a: np.var(a, axis=1), None), "np.any": (lambda a: np.any(a), None),
    "np.all": (lambda a: np.all(a), None),
    "np.transpose": (lambda a: np.transpose(a), None),
    "floor": (lambda a: (a * 0.7).floor(), lambda a: np.floor(a * 0.7)),
    "round": (lambda a: (a * 0.7).round(), lambda a: np.round(a * 0.7)),
    "np.round": (lambda a: np.round(a * 0.7), None),
    "tile": (lambda a: a.tile((2, 1, 3)), lambda a: np.tile(a, (2, 1, 3))),
}


@pytest.mark.parametrize("name", list(METHOD_CALLS))
def test_common_methods_of_traced_values_trace_and_compute_what_numpy_does(name):
    call, ref = METHOD_CALLS[name]
    x = TRACED - 2.0  # a zero among the values: any() and all() differ
    want = np.asarray((ref or call)(x))
    for got in (fs.jit(call)(x), fs.vmap(call)(x[None])[0]):
        got = got.asnumpy()
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("call, error, match", [
    (lambda a: a.round(2), fs.UnsupportedOpError, r"round\(decimals=2\)"),
    (lambda a: a.repeat(2), fs.UnsupportedOpError, "Tensor method 'repeat'"),
    (lambda a: a.fill(1.0), fs.TracerConversionError, "updated in place"),
    (lambda a: np.cumsum(a), fs.TracerConversionError, "numpy.asarray"),
    (lambda a: np.max(a, out=np.empty(())), fs.TracerConversionError, "out="),
    (lambda a: a.fill_(1.0), fs.TracerConversionError, "updated in place"),
    (lambda a: a.tolist(), fs.TracerConversionError, "tolist"),
    (lambda a: a.norm(ord=1), fs.UnsupportedOpError, "norm"),
])
def test_traced_value_methods_fshard_lacks_are_fshard_errors(call, error, match):
    with pytest.raises(error, match=match):
        fs.jit(call)(TRACED)


def test_numpy_reductions_of_a_traced_value_trace():
    assert float(fs.jit(lambda a: np.sum(a))(TRACED).asnumpy()) == 15.0
    assert float(fs.jit(lambda a: np.mean(a))(TRACED).asnumpy()) == 2.5


@pytest.mark.parametrize("op", ["//", "%"])
def test_floor_division_and_remainder_follow_python(op):
    f = eval(f"lambda a, b: a {op} b")  # noqa: S307  (a fixed operator from the list above)
    a = np.array([-7, -1, 0, 5, 7], np.int32)
    b = np.array([2, 3, -4, -3, 2], np.int32)
    np.testing.assert_array_equal(fs.jit(f)(a, b).asnumpy(), f(a, b))


def test_invert_of_a_number_is_refused_naming_both_meanings():
    # MindSpore's ~ is a logical not, NumPy's a bitwise not: fshard does not guess
    with pytest.raises(fs.UnsupportedOpError, match=r"(?s)the operator ~ on a traced "
                       r"i32\[4\].*logical not.*bitwise not.*Fix: .*logical_not.*"
                       r"bitwise_xor\(x, -1\)"):
        fs.jit(lambda a: ~a)(np.arange(4, dtype=np.int32))


def test_invert_of_a_mask_is_its_logical_not():
    x = Tensor(np.array([-1.0, 0.0, 2.0], np.float32))
    got = fs.jit(lambda a: ~(a > 0))(x).asnumpy()
    np.testing.assert_array_equal(got, (~(x > 0)).asnumpy())
    np.testing.assert_array_equal(got, [True, True, False])
    # and through vmap
    xs = Tensor(np.array([[1.0, -1.0], [0.0, 3.0]], np.float32))
    np.testing.assert_array_equal(fs.vmap(lambda a: ~(a > 0))(xs).asnumpy(),
                                  [[False, True], [True, False]])


@pytest.mark.parametrize("op", ["&", "|", "^", "<<", ">>"])
def test_bitwise_operators_trace(op):
    f = eval(f"lambda a, b: a {op} b")  # noqa: S307  (a fixed operator from the list above)
    a = np.array([5, 12, 2**31 - 1], np.uint32)
    b = np.array([3, 1, 7], np.uint32)
    np.testing.assert_array_equal(fs.jit(f)(a, b).asnumpy(), f(a, b))


@pytest.mark.parametrize("make", [
    lambda: fs.jit(lambda a: a.astype(ms.complex64))(X),
    lambda: fs.grad(lambda a: a.astype(ms.float32).sum())(ms.Tensor(X).astype(ms.complex64)),
])
def test_unsupported_dtypes_are_argument_errors_listing_the_supported_ones(make):
    # bfloat16 is supported (docs/amp.md lists the kernels the CPU backend runs for it)
    with pytest.raises(fs.ArgumentError, match=r"not supported by fshard; use one of BFloat16, "
                                                r"Bool, Float16, Float32"):
        make()


def test_a_primitive_shard_strategy_is_not_dropped_silently():
    from mindspore import Parameter, Tensor, nn, ops

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.ones((8, 4), np.float32)))
            self.matmul = ops.MatMul().shard(((2, 4), (4, 1)))

        def construct(self, x):
            return self.matmul(x, self.w)

    x = np.ones((8, 8), np.float32)
    f = fs.shard(Net(), in_strategy=((8, 1),), mesh=8)
    out = f(x)  # the strategy is the operator's plan (tests/test_semi_auto.py)
    assert out.asnumpy().tolist() == [[8.0] * 4] * 8
    matmul = next(e for e in f.strategies(x)["equations"] if e["primitive"] == "matmul")
    assert matmul["in_strategy"] == [[2, 4], [4, 1]]


# -- the launcher: misuse and faults -------------------------------------------------------
# Each fault is a real job (10-20 s on 2 cores): one launch per line of the list, each with
# its own log directory and a timeout.

LAUNCH_SCRIPT = str(Path(__file__).resolve().parent / "distributed" / "launch_checks.py")


@pytest.mark.parametrize("args, match", [
    (["--timeout", "nan"], "--timeout must be a positive, finite"),
    (["--timeout", "inf"], "--timeout must be a positive, finite"),
    (["--timeout", "0"], "--timeout must be a positive, finite"),
    (["--port", "70000"], r"--port must be an int in \[1, 65535\]"),
    (["--log-dir", "{file}"], r"--log-dir .* is a file, not a directory"),
], ids=["timeout nan", "timeout inf", "timeout 0", "port 70000", "log-dir a file"])
def test_launcher_option_errors_are_usage_lines(args, match, tmp_path, capsys):
    (tmp_path / "f.txt").write_text("x")
    args = [a.replace("{file}", str(tmp_path / "f.txt")) for a in args]
    with pytest.raises(SystemExit) as e:
        launch.main(["-n", "2", *args, LAUNCH_SCRIPT, "ok"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    assert re.search(match, err), err


def _a_rank_hangs_while_the_other_finishes(tmp_path, capsys):
    code = launch.main(["-n", "2", "--timeout", "8", "--log-dir", str(tmp_path),
                        LAUNCH_SCRIPT, "hang"])
    assert code == launch.EXIT_TIMEOUT == 124
    captured = capsys.readouterr()
    assert "[rank 0] done early" in captured.out and "[rank 1] hanging" in captured.out
    assert ("fshard.launch: timed out after 8 s: rank 1 still running (hung?) and stopped; "
            "rank 0 had finished.") in captured.err


def _a_rank_exits_0_before_init(tmp_path, capsys):
    result = launch.run(LAUNCH_SCRIPT, 2, ["noinit"], timeout=240, log_dir=str(tmp_path))
    assert not result.timed_out and result.wall_time < 60, result.message
    assert result.returncode == 1 and result.failed_ranks == [1]
    assert [r.status for r in result.ranks] == ["stopped", "failed"]
    assert result.message.startswith(
        "fshard.launch: rank 1 finished (exit code 0) after "), result.message
    assert ("without joining the job, while rank 0 waited for it in "
            "fs.distributed.init(); stopped rank 0. Fix: call fs.distributed.init() on "
            "every rank") in result.message


def _processes_a_rank_started_outlive_a_successful_job(tmp_path, capsys):
    import glob
    import tempfile

    pattern = os.path.join(tempfile.gettempdir(), "fshard-launch-*")
    before = set(glob.glob(pattern))
    result = launch.run(LAUNCH_SCRIPT, 2, ["child"], timeout=120)
    assert result.ok, result.message
    assert set(glob.glob(pattern)) == before
    assert "logs removed; keep them with --log-dir" in result.message
    for rank in range(2):
        pid = int(result.output(rank).split("child ")[1].split()[0])
        # stopped with its rank's process group: gone, or a zombie nobody reaped yet
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "gone"
        assert state in ("gone", "Z", "X"), f"rank {rank}'s child {pid} is {state}"


LAUNCH_FAULTS = {
    "a rank hangs while the other finishes": _a_rank_hangs_while_the_other_finishes,
    "a rank exits 0 before init()": _a_rank_exits_0_before_init,
    "processes a rank started outlive a successful job":
        _processes_a_rank_started_outlive_a_successful_job,
}


@pytest.mark.full  # three launched jobs: the full matrix
@pytest.mark.parametrize("fault", list(LAUNCH_FAULTS))
def test_the_launcher_under_faults(fault, tmp_path, capsys):
    LAUNCH_FAULTS[fault](tmp_path, capsys)


# -- generated sources ---------------------------------------------------------------------


def test_generated_sources_share_one_directory_per_process_removed_at_exit(tmp_path):
    """``fshard_gen_*`` directories do not pile up in the temp folder: one per process,
    removed at exit; those of processes that died without exiting cleanly (a stopped
    rank) are removed by the next process that needs one."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"fshard_gen_{dead.pid}_x1"
    stale.mkdir()
    (stale / "fshard_generated_1.py").write_text("")
    recent = tmp_path / f"fshard_gen_{dead.pid}_x3"  # touched within the hour: kept
    recent.mkdir()
    os.utime(stale, (1e9, 1e9))  # 2001: long stale
    live = tmp_path / f"fshard_gen_{os.getpid()}_x2"  # this process is alive: kept
    live.mkdir()
    os.utime(live, (1e9, 1e9))
    code = ("import numpy as np, fshard as fs\n"
            "from fshard.backend import mindspore as b\n"
            "fs.jit(lambda a: a * 2)(np.ones(3, np.float32))\n"
            "first = b._gen_dir\n"
            "fs.jit(lambda a: a + 1)(np.ones(4, np.float32))\n"
            "fs.jit(lambda a: a - 1)(np.ones(5, np.float32))\n"
            "print(first == b._gen_dir, first)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, GLOG_v="3", TMPDIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr
    same, gen_dir = out.stdout.strip().splitlines()[-1].split()
    assert same == "True" and gen_dir.startswith(str(tmp_path / "fshard_gen_"))
    assert not os.path.exists(gen_dir)  # removed at exit
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("fshard_gen_")) \
        == sorted([live.name, recent.name])
