"""fs.amp: policies and autocast, dynamic loss scaling, bfloat16 values and the kernels
that refuse them, and a float16 digits run against float32."""

from __future__ import annotations

import re

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

import fshard as fs

F16, BF16, F32 = ms.float16, ms.bfloat16, ms.float32


def _np(x):
    return np.asarray(x.asnumpy() if isinstance(x, Tensor) else x)


# -- policies --------------------------------------------------------------------------


def test_presets_mirror_mindspore_levels():
    assert fs.amp.policy("O0").compute_dtype == F32
    for level in ("O1", "O2", "O3"):
        p = fs.amp.policy(level)
        assert (p.param_dtype, p.compute_dtype, p.output_dtype, p.level) == (F32, F16, F32,
                                                                              level)
    assert fs.amp.policy("O2", BF16).compute_dtype == BF16


def test_policy_errors_name_the_argument():
    with pytest.raises(fs.ArgumentError, match=re.escape(
            "fs.amp.policy(level=...) must be one of O0, O1, O2, O3 (MindSpore's "
            "auto_mixed_precision levels); got 'O4'.")):
        fs.amp.policy("O4")
    with pytest.raises(fs.ArgumentError, match=r"(?s)policy\(dtype=\.\.\.\) must be "
                       r"mindspore.float16 or mindspore.bfloat16 .*got mindspore.float32.*"
                       r"level='O0'"):
        fs.amp.policy("O2", F32)
    with pytest.raises(fs.ArgumentError, match=r"Policy\(compute_dtype=\.\.\.\) must be a "
                       r"floating dtype .*got mindspore.int32"):
        fs.amp.Policy(compute_dtype=ms.int32)
    with pytest.raises(fs.ArgumentError, match=r"autocast\(fn, policy=\.\.\.\) must be an "
                       r"fs.amp.Policy or a level .*got 3"):
        fs.amp.autocast(lambda x: x, 3)


def test_policy_casts_only_floating_leaves():
    p = fs.amp.policy("O2")
    tree = {"w": np.ones(2, np.float32), "i": np.arange(2, dtype=np.int32)}
    out = p.cast_to_compute(tree)
    assert fs.typeof(out["w"]).dtype == F16 and fs.typeof(out["i"]).dtype == ms.int32
    assert fs.typeof(p.cast_to_output(out)["w"]).dtype == F32


def _mlp_loss(w, x):
    return ops.log_softmax(ops.tanh(ops.matmul(x, w)), -1).sum()


W = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)
X = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)


def _dtypes_of(level):
    """``{primitive: dtype of its first output}`` in the autocast program."""
    prog = fs.make_ir(fs.amp.autocast(_mlp_loss, level))(W, X)
    return {line.split("= ")[1].split("[")[0].split()[0]: line.split(":")[1].split("[")[0]
            for line in str(prog).splitlines()[1:-1] if "cast" not in line}


def test_levels_choose_which_ops_run_in_float16():
    assert _dtypes_of("O0") == {"matmul": "f32", "tanh": "f32", "log_softmax": "f32",
                                "reduce_sum": "f32"}
    assert _dtypes_of("O1") == {"matmul": "f16", "tanh": "f32", "log_softmax": "f32",
                                "reduce_sum": "f32"}
    assert _dtypes_of("O2") == {"matmul": "f16", "tanh": "f16", "log_softmax": "f32",
                                "reduce_sum": "f32"}
    assert _dtypes_of("O3") == {"matmul": "f16", "tanh": "f16", "log_softmax": "f16",
                                "reduce_sum": "f16"}


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_autocast_grad_is_float32_and_close_to_float32_grad(level):
    f = fs.amp.autocast(_mlp_loss, level)
    g = fs.grad(f)(W, X)
    assert g.dtype == F32
    want = _np(fs.grad(_mlp_loss)(W, X))
    # float16 keeps 11 significant bits: errors of a few 1e-3 relative to the values
    np.testing.assert_allclose(_np(g), want, atol=1e-2 * np.abs(want).max())
    np.testing.assert_allclose(_np(fs.jit(fs.grad(f))(W, X)), _np(g),
                               atol=1e-2 * np.abs(want).max())


def test_autocast_composes_with_vmap_and_keeps_pytrees():
    f = fs.amp.autocast(lambda p, x: {"y": ops.matmul(x, p["w"]), "i": x.shape[0]
                                      + ops.zeros((), ms.int32)}, "O2")
    out = fs.vmap(f, in_axes=(None, 0))({"w": W}, np.stack([X, X]))
    assert out["y"].dtype == F32 and out["y"].shape == (2, 4, 2)
    assert out["i"].dtype == ms.int32
    np.testing.assert_allclose(_np(out["y"][0]), X @ W, rtol=2e-3, atol=2e-3)


def test_autocast_leaves_a_cond_branch_in_its_traced_dtypes():
    def f(w, x):
        y = ops.matmul(x, w)
        return fs.cond(y.sum() > 0, lambda a: a * 2.0, lambda a: a - 1.0, y)

    g = fs.amp.autocast(f, "O3")
    assert " cond" in str(fs.make_ir(g)(W, X))
    out = fs.jit(g)(W, X)
    assert out.dtype == F32
    want = _np(fs.jit(f)(W, X))
    np.testing.assert_allclose(_np(out), want, atol=2e-3 * np.abs(want).max())


def test_autocast_under_shard_equals_unsharded():
    f = fs.amp.autocast(lambda w, x: ops.tanh(ops.matmul(x, w)), "O2")
    mesh = fs.Mesh((2,), ("d",))
    out = fs.shard(f, in_strategy=(None, (2, 1)), mesh=mesh)(W, X)
    np.testing.assert_array_equal(_np(out), _np(f(W, X)))


# -- loss scaling ----------------------------------------------------------------------


def test_all_finite():
    assert bool(_np(fs.amp.all_finite({"a": np.ones(3, np.float32)})))
    assert not bool(_np(fs.amp.all_finite([np.ones(2, np.float32),
                                           np.array([1, np.inf], np.float16)])))
    assert not bool(_np(fs.jit(fs.amp.all_finite)([np.array([np.nan], np.float32)])))
    assert not bool(_np(fs.amp.all_finite([np.array([-np.inf], np.float32)])))
    assert bool(_np(fs.amp.all_finite({"i": np.arange(3), "none": None})))


def test_dynamic_loss_scale_halves_grows_and_counts_skips_inside_jit():
    ls = fs.amp.DynamicLossScale(initial_scale=8.0, growth_interval=3, min_scale=2.0)
    adjust = fs.jit(ls.adjust)
    s = ls.init()
    seen = []
    for finite in [True, True, False, True, True, True, True, False, False, False]:
        s = adjust(s, np.bool_(finite))
        seen.append((float(_np(s.scale)), int(_np(s.good_steps)), int(_np(s.skipped))))
    assert seen == [(8, 1, 0), (8, 2, 0), (4, 0, 1), (4, 1, 1), (4, 2, 1), (8, 0, 1),
                    (8, 1, 1), (4, 0, 2), (2, 0, 3), (2, 0, 4)]  # never below min_scale


def test_dynamic_loss_scale_never_grows_into_float32_overflow():
    ls = fs.amp.DynamicLossScale(initial_scale=3e38, growth_interval=1)
    s = ls.adjust(ls.init(), np.bool_(True))
    assert float(_np(s.scale)) == pytest.approx(3e38)


def test_scale_and_unscale_keep_dtypes():
    ls = fs.amp.DynamicLossScale(initial_scale=4.0)
    s = ls.init()
    assert float(_np(ls.scale(s, np.float32(1.5)))) == 6.0
    g = ls.unscale(s, {"a": np.array([8.0], np.float16), "b": np.array([2.0], np.float32)})
    assert g["a"].dtype == F16 and float(_np(g["a"])[0]) == 2.0
    assert float(_np(g["b"])[0]) == 0.5


def test_dynamic_loss_scale_argument_errors():
    with pytest.raises(fs.ArgumentError, match=re.escape(
            "fs.amp.DynamicLossScale(growth_interval=...) must be an integer >= 1; got 0.")):
        fs.amp.DynamicLossScale(growth_interval=0)
    with pytest.raises(fs.ArgumentError, match=r"backoff_factor=\.\.\.\) must be a number "
                       r"in \(0, 1\)"):
        fs.amp.DynamicLossScale(backoff_factor=2.0)
    with pytest.raises(fs.ArgumentError, match=r"initial_scale=\.\.\.\) must be a finite "
                       r"number > 0.0; got nan"):
        fs.amp.DynamicLossScale(initial_scale=float("nan"))
    with pytest.raises(fs.ArgumentError, match=r"loss_scaled\(optimizer=\.\.\.\) must be an "
                       r"fs.optim optimizer"):
        fs.amp.loss_scaled(lambda g: g, fs.amp.DynamicLossScale())


def test_loss_scaled_optimizer_skips_a_non_finite_step():
    opt = fs.amp.loss_scaled(fs.optim.adam(0.1), fs.amp.DynamicLossScale(initial_scale=4.0))
    params = {"w": Tensor(np.ones(2, np.float32))}
    state = opt.init(params)
    upd = fs.jit(opt.update)
    u, s1 = upd({"w": np.array([4.0, np.inf], np.float32)}, state, params)
    np.testing.assert_array_equal(_np(u["w"]), [0.0, 0.0])
    assert int(_np(s1.loss_scale.skipped)) == 1 and float(_np(s1.loss_scale.scale)) == 2.0
    assert int(_np(s1.inner.count)) == 0 and np.all(_np(s1.inner.mu["w"]) == 0)
    u, s2 = upd({"w": np.array([2.0, -2.0], np.float32)}, s1, params)  # = [1, -1] unscaled
    want_u, _ = fs.optim.adam(0.1).update({"w": np.array([1.0, -1.0], np.float32)},
                                          fs.optim.adam(0.1).init(params), params)
    np.testing.assert_allclose(_np(u["w"]), _np(want_u["w"]), rtol=1e-6)
    assert int(_np(s2.loss_scale.skipped)) == 1 and int(_np(s2.inner.count)) == 1


# -- bfloat16 and float16 values -------------------------------------------------------


def test_bfloat16_values_trace_run_and_compile():
    x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)).astype(BF16)
    assert str(fs.typeof(x)) == "bf16[2,3]"
    f = fs.jit(lambda a: (ops.add(a, a) * a).astype(F32))
    np.testing.assert_array_equal(_np(f(x)), 2 * np.arange(6.0).reshape(2, 3) ** 2)
    # a Python scalar becomes a bfloat16 constant of the compiled program
    np.testing.assert_array_equal(_np(fs.jit(lambda a: a * 2.5 + 1.0)(x).astype(F32)),
                                  np.arange(6.0).reshape(2, 3) * 2.5 + 1.0)
    g = fs.grad(lambda a: (ops.add(a, a) * a).astype(F32).sum())(x)
    assert g.dtype == BF16
    np.testing.assert_array_equal(_np(g.astype(F32)), 4 * np.arange(6.0).reshape(2, 3))


def test_bfloat16_with_float16_promotes_to_float32_as_mindspore_does():
    assert fs.dtypes.result_type(BF16, F16) == F32
    assert fs.dtypes.result_type(BF16, F32) == F32


@pytest.mark.parametrize("wrap", [fs.jit, lambda f: f], ids=["jit", "eager"])
def test_a_kernel_that_refuses_bfloat16_is_named(wrap):
    x = Tensor(np.ones((2, 2), np.float32)).astype(BF16)
    with pytest.raises(fs.UnsupportedDtypeError, match=r"MindSpore's CPU kernel for 'Exp' "
                       r"\(in .*\) does not accept its operands' dtypes.*\nFix: compute that "
                       r"op in a dtype the kernel takes"):
        _np(wrap(lambda a: fs.ops.exp(a))(x))
    assert issubclass(fs.UnsupportedDtypeError, TypeError)


def test_float16_matmul_softmax_run_on_cpu():
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float16)
    out = fs.jit(lambda a: ops.softmax(ops.matmul(a, a), -1))(x)
    assert out.dtype == F16
    want = x.astype(np.float32) @ x.astype(np.float32)
    want = np.exp(want - want.max(-1, keepdims=True))
    np.testing.assert_allclose(_np(out), want / want.sum(-1, keepdims=True), atol=5e-3)


# -- digits: float16 with loss scaling against float32 -------------------------------


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), np.eye(10, dtype=np.float32)[y]


def _digits_loss(p, x, y):
    h = ops.tanh(ops.matmul(x, p["w1"]) + p["b1"])
    logits = ops.matmul(h, p["w2"]) + p["b2"]
    return -(ops.log_softmax(logits, -1) * y).sum() / x.shape[0]


def _train(level, steps, initial_scale=2.0 ** 15):
    """Full-batch Adam on digits; returns the float32 loss of the final parameters after
    each step and the final optimizer state."""
    rng = np.random.default_rng(0)
    params = {"w1": Tensor((rng.standard_normal((64, 64)) * 0.125).astype(np.float32)),
              "b1": Tensor(np.zeros(64, np.float32)),
              "w2": Tensor((rng.standard_normal((64, 10)) * 0.125).astype(np.float32)),
              "b2": Tensor(np.zeros(10, np.float32))}
    x, y = _digits()
    opt = fs.optim.adam(1e-2)
    if level == "O0":
        loss_fn = _digits_loss
    else:
        ls = fs.amp.DynamicLossScale(initial_scale=initial_scale)
        opt = fs.amp.loss_scaled(opt, ls)
        amp_loss = fs.amp.autocast(_digits_loss, fs.amp.policy(level))

        def loss_fn(p, x, y, s):
            return ls.scale(s.loss_scale, amp_loss(p, x, y))

    @fs.jit
    def step(p, s, x, y):
        g = fs.grad(loss_fn)(p, x, y, *([s] if level != "O0" else []))
        u, s = opt.update(g, s, p)
        p = fs.optim.apply_updates(p, u)
        return p, s, _digits_loss(p, x, y)

    state = opt.init(params)
    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state, x, y)
        losses.append(float(_np(loss)))
    return losses, state


STEPS = 30


@pytest.mark.full  # two compiled train steps: ~10 s (the quick run checks loss scaling
# against float32 in test_loss_scaling_with_auto_parallel_needs_no_hook)
def test_digits_float16_with_loss_scaling_reaches_the_float32_loss():
    losses, state = _train("O2", STEPS)
    assert int(_np(state.loss_scale.skipped)) == 0
    want = _train("O0", STEPS)[0][-1]
    assert losses[-1] == pytest.approx(want, rel=0.02)
    assert losses[-1] < 0.2 * losses[0]  # it did learn


@pytest.mark.full
def test_digits_float16_skipped_steps_are_counted_and_change_nothing():
    # 2**17 overflows float16 (the loss's cotangent is the scale, > 65504): the first two
    # steps are skipped, the scale halves to 2**15, and the run is the float32 run two
    # steps behind (a skipped step leaves the parameters and Adam's state as they were).
    losses, state = _train("O2", 2 * STEPS, initial_scale=2.0 ** 17)
    assert int(_np(state.loss_scale.skipped)) == 2
    assert float(_np(state.loss_scale.scale)) == 2.0 ** 15
    assert losses[1] == losses[0]  # two steps with the initial parameters
    assert losses[-1] == pytest.approx(_train("O0", 2 * STEPS - 2)[0][-1], rel=0.02)


def test_loss_scaling_with_auto_parallel_needs_no_hook():
    # The loss reads the scale as a batch input (a scalar: its dataset strategy is ());
    # loss_scaled(optimizer) unscales, skips and adjusts inside the compiled step.
    rng = np.random.default_rng(0)
    w0 = (rng.standard_normal((8, 4)) * 0.3).astype(np.float32)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.standard_normal((16, 4)).astype(np.float32)
    amp_loss = fs.amp.autocast(lambda p, x, y: ((ops.matmul(x, p["w"]) - y) ** 2).mean(), "O2")
    ls = fs.amp.DynamicLossScale(initial_scale=2.0 ** 17)  # two skipped steps, as digits
    ap = fs.AutoParallel(lambda p, x, y, scale: amp_loss(p, x, y) * scale,
                         fs.amp.loss_scaled(fs.optim.sgd(0.1), ls), mesh=fs.Mesh((2,), ("dp",)))
    ap.dataset_strategy(((2, 1), (2, 1), ()))
    state = ap.init({"w": Tensor(w0)})
    for _ in range(3):
        state, _ = ap(state, x, y, state.opt_state.loss_scale.scale)
    s = state.opt_state.loss_scale
    assert (int(_np(s.skipped)), float(_np(s.scale)), int(_np(s.good_steps))) == (2, 2.0 ** 15, 1)
    # two steps skipped, one taken: plain float32 SGD's one step, to float16 accuracy
    g = 2 * x.T @ (x @ w0 - y) / y.size
    want = w0 - 0.1 * g
    np.testing.assert_allclose(_np(state.params["w"]), want, atol=2e-3 * np.abs(want).max())


@pytest.mark.full
def test_float16_and_bfloat16_psum_in_a_two_process_job(tmp_path):
    # MindSpore's CPU AllReduce takes float32 and float16: bfloat16 travels in float32
    # (exact) and is rounded once at the end.
    import json
    import os

    from fshard import launch

    script = os.path.join(os.path.dirname(__file__), "distributed", "amp_checks.py")
    result = launch.run(script, 2, [str(tmp_path)], timeout=420)
    assert result.ok, result.message + "\n" + "\n".join(result.output(r)[-3000:]
                                                        for r in range(2))
    x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(8, 3) / 8 + 0.125
    for r in range(2):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        for name in ("float16", "bfloat16"):
            assert out[name]["dtype"] == {"float16": "Float16", "bfloat16": "BFloat16"}[name]
            np.testing.assert_allclose(out[name]["psum"], 3 * x, rtol=2 ** -8)
            np.testing.assert_allclose(out[name]["blocks"], x[:4] + x[4:], rtol=2 ** -8)


def test_bfloat16_leaves_checkpoint_and_restore_exactly(tmp_path):
    x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3) / 3).astype(BF16)
    fs.checkpoint.save(str(tmp_path), {"w": x}, step=1)
    back = fs.checkpoint.load(str(tmp_path), {"w": x})["w"]
    assert back.dtype == BF16
    np.testing.assert_array_equal(_np(back.astype(F32)), _np(x.astype(F32)))
