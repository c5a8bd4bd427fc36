"""The JAX user's everyday API: fs.device_put, fs.block_until_ready, fs.eval_shape,
fs.jit(donate_argnums=, in_shardings=, out_shardings=), fs.with_sharding_constraint,
fs.linearize, fs.disable_jit, fs.profile, optax's building blocks and schedules in
fs.optim, and fs.checkpoint.CheckpointManager."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import mindspore
import numpy as np
import pytest

import fshard as fs
from fshard.errors import ArgumentError, CheckpointError, DifferentiationError, ShardingError

ROOT = Path(__file__).resolve().parents[1]


def n(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


# ---------------------------------------------------------------------------
# fs.optim: optax's blocks and schedules, against optax's own numbers
# ---------------------------------------------------------------------------

# What OPTAX_SCRIPT printed (optax 0.2.8, jax 0.10.2); rerun live when a JAX
# environment is at hand (FSHARD_JAX_PYTHON or .jaxenv).
OPTAX = json.loads('{"schedules": {"constant": [0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3], "linear": [1.0, 1.0, 1.0, 0.88749999, 0.77499998, 0.66250002, 0.55000001, 0.43749997, 0.32499999, 0.21250001, 0.1, 0.1, 0.1], "polynomial": [1.0, 1.0, 0.7890625, 0.60624999, 0.45156249, 0.32499999, 0.2265625, 0.15625, 0.1140625, 0.1, 0.1, 0.1, 0.1], "cosine": [2.0, 1.9129796, 1.672644, 1.3344779, 0.97108638, 0.64999992, 0.41485584, 0.2764644, 0.21641351, 0.20107797, 0.2, 0.2, 0.2], "warmup_cosine": [0.0, 0.33333337, 0.66666669, 1.0, 0.96384275, 0.86087573, 0.70677459, 0.52499998, 0.34322533, 0.18912429, 0.08615718, 0.050000001, 0.050000001], "exponential": [1.0, 1.0, 1.0, 0.79370052, 0.62996054, 0.5, 0.39685026, 0.31498027, 0.25, 0.2, 0.2, 0.2, 0.2], "exponential_stair": [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125, 0.125, 0.125, 0.0625], "piecewise": [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.050000001, 0.050000001, 0.050000001, 0.050000001, 0.050000001, 0.050000001], "join": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0]}, "transforms": {"adamw_chain": [{"b": [-9.9934638e-05, -0.099800184], "w": [[0.89900029, -1.898001], [0.39950001, 2.997]]}, {"b": [-0.092165381, -0.0076349527], "w": [[0.80046767, -1.7984698], [0.3014667, 2.9940031]]}, {"b": [-0.17705983, 0.077359155], "w": [[0.70168352, -1.6986879], [0.2031814, 2.991009]]}, {"b": [-0.25555634, 0.15595526], "w": [[0.60175627, -1.5977639], [0.10375252, 2.988018]]}], "adam_nesterov": [{"b": [0.026316285, -0.12631628], "w": [[0.92631626, -1.9263163], [0.42631629, 3.0]]}, {"b": [-0.019739412, -0.080260582], "w": [[0.86258346, -1.8625834], [0.36258349, 3.0]]}, {"b": [-0.059835706, -0.040164288], "w": [[0.80299711, -1.802997], [0.30299711, 3.0]]}, {"b": [-0.096966095, -0.0030338988], "w": [[0.7454766, -1.7454765], [0.2454766, 3.0]]}], "masked_decay": [{"b": [1.1, -0.69999999], "w": [[1.4, -2.3], [2.55, 3.3]]}, {"b": [1.5166667, -0.9083333], "w": [[2.0166667, -2.6583333], [6.0958333, 3.575]]}, {"b": [1.7388889, -1.0194445], "w": [[2.751111, -3.0355556], [10.502222, 3.8133333]]}, {"b": [1.8638889, -1.0819445], "w": [[3.4886665, -3.3873334], [15.027333, 4.0039997]]}], "masked_adam": [{"b": [1.0999933, -1.1999934], "w": [[1.3, -2.0999999], [2.5, 3.0]]}, {"b": [2.0321636, -2.1321635], "w": [[1.9, -2.3], [6.5, 3.0]]}, {"b": [2.905319, -3.0053189], "w": [[2.8, -2.5999999], [12.5, 3.0]]}, {"b": [3.7265499, -3.8265498], "w": [[4.0, -3.0], [20.5, 3.0]]}], "trace": [{"b": [2.0, -1.15], "w": [[1.5700001, -2.1900001], [4.3000002, 3.0]]}, {"b": [3.76, -2.03], "w": [[2.9530001, -2.651], [13.52, 3.0]]}, {"b": [5.5273333, -2.9136667], "w": [[5.3677001, -3.4559], [29.618, 3.0]]}, {"b": [7.2929335, -3.7964668], "w": [[9.0109301, -4.67031], [53.906197, 3.0]]}], "inject_sgd": [{"b": [-0.40000001, 0.049999997], "w": [[0.85000002, -1.95], [-0.5, 3.0]]}, {"b": [-0.52499998, 0.1125], "w": [[0.70000005, -1.9000001], [-1.5, 3.0]]}, {"b": [-0.56666666, 0.13333333], "w": [[0.58750004, -1.8625001], [-2.25, 3.0]]}, {"b": [-0.58229166, 0.14114583], "w": [[0.51250005, -1.8375001], [-2.75, 3.0]]}], "inject_scale": [{"b": [-0.15000001, -0.075000003], "w": [[0.92500001, -1.975], [0.0, 3.0]]}, {"b": [-0.27500001, -0.012500003], "w": [[0.77499998, -1.9250001], [-1.0, 3.0]]}, {"b": [-0.35833335, 0.029166665], "w": [[0.54999995, -1.85], [-2.5, 3.0]]}, {"b": [-0.42083335, 0.060416665], "w": [[0.24999994, -1.75], [-4.5, 3.0]]}]}}')

OPTAX_SCRIPT = 'import json, numpy as np, optax, jax.numpy as jnp\nsteps = list(range(13))\nS = {\n "constant": optax.constant_schedule(0.3),\n "linear": optax.linear_schedule(1.0, 0.1, 8, transition_begin=2),\n "polynomial": optax.polynomial_schedule(1.0, 0.1, 2.0, 8, transition_begin=1),\n "cosine": optax.cosine_decay_schedule(2.0, 10, alpha=0.1, exponent=2.0),\n "warmup_cosine": optax.warmup_cosine_decay_schedule(0.0, 1.0, 3, 11, end_value=0.05),\n "exponential": optax.exponential_decay(1.0, 3, 0.5, transition_begin=2, end_value=0.2),\n "exponential_stair": optax.exponential_decay(1.0, 3, 0.5, staircase=True),\n "piecewise": optax.piecewise_constant_schedule(1.0, {3: 0.5, 7: 0.1}),\n "join": optax.join_schedules([optax.constant_schedule(1.0), optax.linear_schedule(1.0, 0.0, 4)], [5]),\n}\nout = {"schedules": {k: [float(s(t)) for t in steps] for k, s in S.items()}}\nparams = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]], jnp.float32), "b": jnp.array([0.1, -0.2], jnp.float32)}\ngrads = [{"w": jnp.array([[0.3, -0.1], [2.0, 0.0]], jnp.float32) * (i + 1), "b": jnp.array([1.0, -0.5], jnp.float32) / (i + 1)} for i in range(4)]\nT = {\n "adamw_chain": optax.chain(optax.scale_by_adam(b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-9), optax.add_decayed_weights(0.01), optax.scale_by_learning_rate(0.1)),\n "adam_nesterov": optax.chain(optax.scale_by_adam(nesterov=True), optax.scale(-0.05)),\n "masked_decay": optax.chain(optax.add_decayed_weights(0.1, mask={"w": True, "b": False}), optax.scale_by_schedule(optax.linear_schedule(1.0, 0.5, 3))),\n "masked_adam": optax.masked(optax.scale_by_adam(), {"w": False, "b": True}),\n "trace": optax.trace(0.9, nesterov=True),\n "inject_sgd": optax.inject_hyperparams(optax.sgd)(learning_rate=optax.exponential_decay(0.5, 1, 0.5)),\n "inject_scale": optax.inject_hyperparams(optax.scale)(step_size=-0.25),\n}\nres = {}\nfor name, t in T.items():\n    p = params\n    st = t.init(p)\n    seq = []\n    for g in grads:\n        u, st = t.update(g, st, p)\n        p = optax.apply_updates(p, u)\n        seq.append({k: np.asarray(v).tolist() for k, v in p.items()})\n    res[name] = seq\nout["transforms"] = res\nprint(json.dumps(out))\n'

STEPS = list(range(13))
O = fs.optim
SCHEDULES = {
    "constant": O.constant_schedule(0.3),
    "linear": O.linear_schedule(1.0, 0.1, 8, transition_begin=2),
    "polynomial": O.polynomial_schedule(1.0, 0.1, 2.0, 8, transition_begin=1),
    "cosine": O.cosine_decay_schedule(2.0, 10, alpha=0.1, exponent=2.0),
    "warmup_cosine": O.warmup_cosine_decay_schedule(0.0, 1.0, 3, 11, end_value=0.05),
    "exponential": O.exponential_decay(1.0, 3, 0.5, transition_begin=2, end_value=0.2),
    "exponential_stair": O.exponential_decay(1.0, 3, 0.5, staircase=True),
    "piecewise": O.piecewise_constant_schedule(1.0, {3: 0.5, 7: 0.1}),
    "join": O.join_schedules([O.constant_schedule(1.0), O.linear_schedule(1.0, 0.0, 4)], [5]),
}


def _transforms():
    return {
        "adamw_chain": O.chain(O.scale_by_adam(b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-9),
                               O.add_decayed_weights(0.01), O.scale_by_learning_rate(0.1)),
        "adam_nesterov": O.chain(O.scale_by_adam(nesterov=True), O.scale(-0.05)),
        "masked_decay": O.chain(O.add_decayed_weights(0.1, mask={"w": True, "b": False}),
                                O.scale_by_schedule(O.linear_schedule(1.0, 0.5, 3))),
        "masked_adam": O.masked(O.scale_by_adam(), {"w": False, "b": True}),
        "trace": O.trace(0.9, nesterov=True),
        "inject_sgd": O.inject_hyperparams(O.sgd)(learning_rate=O.exponential_decay(0.5, 1, 0.5)),
        "inject_scale": O.inject_hyperparams(O.scale)(step_size=-0.25),
    }


PARAMS = {"w": np.array([[1.0, -2.0], [0.5, 3.0]], np.float32),
          "b": np.array([0.1, -0.2], np.float32)}
GRADS = [{"w": np.array([[0.3, -0.1], [2.0, 0.0]], np.float32) * (i + 1),
          "b": np.array([1.0, -0.5], np.float32) / (i + 1)} for i in range(4)]


def _run(t, step=None):
    p = PARAMS
    state = t.init(p)
    seq = []
    for g in GRADS:
        u, state = (step or t.update)(g, state, p)
        p = O.apply_updates(p, u)
        seq.append({k: n(v).tolist() for k, v in p.items()})
    return seq


def _close(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedules_equal_optax(name):
    _close([float(n(SCHEDULES[name](t))) for t in STEPS], OPTAX["schedules"][name])


@pytest.mark.parametrize("name", sorted(OPTAX["transforms"]))
def test_blocks_equal_optax_eagerly(name):
    for got, want in zip(_run(_transforms()[name]), OPTAX["transforms"][name]):
        for k in want:
            _close(got[k], want[k])


def test_blocks_equal_optax_compiled():
    """The whole chain inside one compiled step (the count and hyperparameters are
    arrays of the state)."""
    for name in ("adamw_chain", "masked_decay", "inject_sgd"):
        t = _transforms()[name]
        step = fs.jit(lambda g, s, p, t=t: t.update(g, s, p))
        for got, want in zip(_run(t, step), OPTAX["transforms"][name]):
            for k in want:
                _close(got[k], want[k])


def _jax_python():
    exe = os.environ.get("FSHARD_JAX_PYTHON") or str(ROOT / ".jaxenv" / "bin" / "python")
    return exe if os.path.exists(exe) else None


@pytest.mark.skipif(_jax_python() is None, reason="no JAX environment (.jaxenv); the "
                    "recorded optax outputs above are checked instead")
def test_recorded_optax_numbers_are_current():
    res = subprocess.run([_jax_python(), "-c", OPTAX_SCRIPT], capture_output=True, text=True,
                         timeout=300)
    if res.returncode != 0 and "No module named 'optax'" in res.stderr:
        pytest.skip("optax is not installed in the JAX environment")
    assert res.returncode == 0, res.stderr
    live = json.loads(res.stdout)
    for name, values in live["schedules"].items():
        _close(OPTAX["schedules"][name], values)
    for name, seq in live["transforms"].items():
        for got, want in zip(OPTAX["transforms"][name], seq):
            for k in want:
                _close(got[k], want[k])


def test_inject_hyperparams_state_can_be_changed():
    opt = O.inject_hyperparams(O.sgd)(learning_rate=0.5)
    state = opt.init(PARAMS)
    state = state._replace(hyperparams={"learning_rate": mindspore.Tensor(np.float32(0.1))})
    u, state = opt.update(GRADS[0], state, PARAMS)
    np.testing.assert_allclose(n(u["b"]), -0.1 * GRADS[0]["b"], rtol=1e-6)
    assert float(n(state.hyperparams["learning_rate"])) == pytest.approx(0.1)


def test_existing_optim_names_still_work():
    for name in ("sgd", "adam", "adamw", "chain", "clip_by_global_norm", "apply_updates",
                 "cosine_decay", "linear_warmup", "constant", "Optimizer"):
        assert hasattr(O, name)
    assert set(O.__all__) >= {"scale_by_adam", "masked", "inject_hyperparams",
                              "warmup_cosine_decay_schedule", "sgd", "adam"}


@pytest.mark.parametrize("make, message", [
    (lambda: O.linear_schedule(1.0, 0.0, 0), "transition_steps=...) must be >= 1"),
    (lambda: O.scale_by_adam(b1=1.0), "b1=...) must be < 1.0"),
    (lambda: O.warmup_cosine_decay_schedule(0.0, 1.0, 5, 5), "must exceed warmup_steps"),
    (lambda: O.join_schedules([O.constant_schedule(1.0)], [3]), "n + 1 schedules"),
    (lambda: O.inject_hyperparams(O.sgd)(0.1), "takes the hyperparameters by name"),
    (lambda: O.scale_by_schedule(0.1), "must be a schedule"),
])
def test_block_arguments_are_checked(make, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        make()


def test_masked_and_decay_refuse_bad_use():
    t = O.masked(O.scale(2.0), {"w": 1, "b": False})
    with pytest.raises(ArgumentError, match="mask leaves must be Python bools"):
        t.init(PARAMS)
    d = O.add_decayed_weights(0.1)
    with pytest.raises(ArgumentError, match="needs the parameters"):
        d.update(GRADS[0], d.init(PARAMS))
