"""fs.random and fs.nn.dropout: known answers (Threefry's and jax.random's), invariance
under jit / vmap / shard, statistics, errors."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from scipy import stats

import fshard as fs
from fshard import random as R
from fshard.random import _threefry2x32

ROOT = Path(__file__).resolve().parents[1]
U32 = fs.dtypes.uint32


def n(x):
    return x.asnumpy()


def u32(*v):
    return ms.Tensor(np.array(v, np.uint32))


# --- known answers ----------------------------------------------------------------

# Random123's known-answer vectors for Threefry-2x32 with 20 rounds:
# (key, counter) -> output.
THREEFRY_KAT = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("key,count,expected", THREEFRY_KAT)
def test_threefry_known_answers(key, count, expected):
    out = _threefry2x32(u32(key[0]), u32(key[1]), u32(count[0]), u32(count[1]))
    assert [int(n(o)[0]) for o in out] == list(expected)


# Outputs of jax 0.10.2 (default threefry, partitionable) for the same calls.
JAX = {
    "key(42)": [0, 42],
    "key(-7)": [0, 4294967289],
    "bits(key(0), (2, 3))": [[4070199207, 4202968722, 1427181096],
                             [2012915765, 2447653815, 710830403]],
    "split(key(1), 3)": [[507451445, 1853169794], [1948878966, 4237131848],
                         [2441914641, 3819641963]],
    "fold_in(key(1), 7)": [954670714, 4016809582],
    "uniform(key(3), (5,))": [0.07405257225036621, 0.938144326210022, 0.6489570140838623,
                              0.9756209850311279, 0.2783777713775635],
    "uniform(key(3), (5,), float16)": [0.1142578125, 0.2294921875, 0.0498046875, 0.296875,
                                       0.771484375],
    "normal(key(3), (6,))": [-1.4462569952011108, 1.5393810272216797, 0.38250625133514404,
                             1.970701813697815, -0.5876674056053162, 0.20941562950611115],
    "truncated_normal(key(3), -1, 2, (4,))": [-0.774646520614624, 1.4510362148284912,
                                              0.4955328106880188, 1.7201045751571655],
    "gumbel(key(3), (4,))": [-0.9566569328308105, 2.7511956691741943, 0.8384301662445068,
                             3.7017173767089844],
}


def test_bits_keys_split_fold_in_equal_jax():
    assert n(R.key(42)).tolist() == JAX["key(42)"]
    assert n(R.key(-7)).tolist() == JAX["key(-7)"]
    assert n(R.bits(R.key(0), (2, 3))).tolist() == JAX["bits(key(0), (2, 3))"]
    assert n(R.split(R.key(1), 3)).tolist() == JAX["split(key(1), 3)"]
    assert n(R.fold_in(R.key(1), 7)).tolist() == JAX["fold_in(key(1), 7)"]
    assert n(R.PRNGKey(42)).tolist() == JAX["key(42)"]


def test_uniform_equals_jax_exactly():
    np.testing.assert_array_equal(n(R.uniform(R.key(3), (5,))),
                                  np.float32(JAX["uniform(key(3), (5,))"]))
    np.testing.assert_array_equal(n(R.uniform(R.key(3), (5,), fs.dtypes.float16)),
                                  np.float16(JAX["uniform(key(3), (5,), float16)"]))


def test_normal_truncated_gumbel_equal_jax_to_a_few_ulp():
    # erfinv and log round differently in MindSpore and XLA: a few float32 ulp.
    for got, key in ((R.normal(R.key(3), (6,)), "normal(key(3), (6,))"),
                     (R.truncated_normal(R.key(3), -1.0, 2.0, (4,)),
                      "truncated_normal(key(3), -1, 2, (4,))"),
                     (R.gumbel(R.key(3), (4,)), "gumbel(key(3), (4,))")):
        np.testing.assert_allclose(n(got), np.float32(JAX[key]), rtol=4e-6, atol=1e-6)


# Outputs of jax 0.10.2 (bits of the floats; keys in the default mode, 64-bit values
# disabled; "x64": with jax_enable_x64 and the key data [0, 7]).
JAX_BITS = {
    "uniform(key(0), (6,), minval=-3, maxval=2)": [
        1071546819, 1072843399, 3215676765, 3207076536, 3189386104, 3221948926],
    "uniform(key(7), (6,), minval=-3, maxval=2)": [
        1052617616, 1072677179, 3216911900, 3209149356, 1059555562, 1042177032],
    "uniform(key(5), (6,), float16, minval=-3, maxval=2)": [
        13800, 15669, 49509, 48841, 16344, 13740],
    "x64 uniform(key(7), (5,), float64, minval=-1e-3, maxval=123.456)": [
        4637033537513182157, 4617997252068793206, 4628511164594062502,
        4620634506114885117, 4609312379779651238],
}
JAX_KEYS = {-1: [0, 4294967295], 2**40 + 5: [0, 5], 2**63 - 1: [0, 4294967295],
            -2**63: [0, 0], -2**31 - 1: [0, 2147483647]}
JAX_TRUNCATED = {
    "truncated_normal(key(3), 1, 5, (6,))": [
        1.0497937202453613, 2.3333842754364014, 1.591976523399353, 2.6633682250976562,
        1.2029945850372314, 1.504944086074829],
    "x64 truncated_normal(key(7), -6, 1, (5,), float64)": [
        0.5539250905300644, -1.7718751656622596, -0.8805170606585496, -1.6056948061165166,
        -2.324671368077566],
}


def test_uniform_with_bounds_and_every_key_equal_recorded_jax_bits():
    # XLA computes u * (maxval - minval) + minval with one rounding (float32, float64;
    # float16 in float32, rounded once): the bounds must not cost a last bit.
    for s in (0, 7):
        got = n(R.uniform(R.key(s), (6,), minval=-3, maxval=2)).view(np.uint32)
        assert got.tolist() == JAX_BITS[f"uniform(key({s}), (6,), minval=-3, maxval=2)"]
    got = n(R.uniform(R.key(5), (6,), fs.dtypes.float16, minval=-3, maxval=2))
    assert got.view(np.uint16).tolist() == JAX_BITS[
        "uniform(key(5), (6,), float16, minval=-3, maxval=2)"]
    for draw in (R.uniform, fs.jit(R.uniform, static_argnums=(1, 2, 3, 4))):
        got = n(draw(u32(0, 7), (5,), fs.dtypes.float64, -1e-3, 123.456)).view(np.uint64)
        assert got.tolist() == JAX_BITS[
            "x64 uniform(key(7), (5,), float64, minval=-1e-3, maxval=123.456)"]
    # keys follow JAX's default mode for every seed: the seed's low 32 bits
    for seed, want in JAX_KEYS.items():
        assert n(R.key(seed)).tolist() == want, seed
        assert n(R.key(np.int64(seed) if seed < 2**63 else seed)).tolist() == want
    assert n(fs.jit(R.key)(ms.Tensor(np.int64(2**40 + 5)))).tolist() == [0, 5]
    assert n(fs.jit(R.key)(ms.Tensor(np.int8(-1)))).tolist() == [0, 4294967295]


def _exact_truncated(u, lower, upper, npd):
    from scipy.special import erfinv

    z = (np.sqrt(2) * erfinv(u.astype(np.float64))).astype(npd)
    return np.clip(z, np.nextafter(npd(lower), npd(np.inf)),
                   np.nextafter(npd(upper), npd(-np.inf)))


def _ulps(a, b):
    def ordered(x):
        i = x.astype(np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(ordered(a) - ordered(b))


@pytest.mark.parametrize("lower,upper", [(-1.0, 2.0), (1.0, 5.0), (3.0, 4.0), (-6.0, 1.0),
                                         (-10.0, 10.0)])
def test_truncated_normal_is_the_exact_inverse_cdf_of_its_uniform_draw(lower, upper):
    # u is JAX's uniform draw on [erf(lower/sqrt2), erf(upper/sqrt2)); the draw is
    # sqrt(2) * erfinv(u) rounded once: 0 ulp in float32, a few 1e-16 in float64.
    from scipy.special import erf

    key = R.key(3)
    s2 = np.float32(np.sqrt(2))
    a, b = (fs.ops.erf(np.float32(v) / s2) for v in (lower, upper))
    u = n(R.uniform(key, (2000,), fs.dtypes.float32, a, b))
    got = n(R.truncated_normal(key, lower, upper, (2000,)))
    assert _ulps(got, _exact_truncated(u, lower, upper, np.float32)).max() == 0
    u64 = n(R.uniform(key, (2000,), fs.dtypes.float64, erf(lower / np.sqrt(2)),
                      erf(upper / np.sqrt(2))))
    got64 = n(R.truncated_normal(key, lower, upper, (2000,), fs.dtypes.float64))
    want64 = _exact_truncated(u64, lower, upper, np.float64)
    assert np.abs(got64 - want64).max() <= 4e-16 * np.abs(want64).max()


def test_truncated_normal_is_near_recorded_jax_values():
    # XLA's float32 erf(5/sqrt2) is one ulp off; near that bound, close to 1, the inverse
    # CDF magnifies it (10 ulp here), so the comparison is in ulp (float64: in 1e-11).
    got = n(R.truncated_normal(R.key(3), 1.0, 5.0, (6,)))
    want = np.float32(JAX_TRUNCATED["truncated_normal(key(3), 1, 5, (6,))"])
    assert _ulps(got, want).max() <= 32
    got = n(R.truncated_normal(u32(0, 7), -6.0, 1.0, (5,), fs.dtypes.float64))
    np.testing.assert_allclose(
        got, JAX_TRUNCATED["x64 truncated_normal(key(7), -6, 1, (5,), float64)"],
        rtol=0, atol=1e-11)


def test_float64_erfinv_is_accurate_to_the_tails():
    from scipy.special import erfinv

    x = np.concatenate([np.linspace(-1, 1, 4001)[1:-1], 1 - 10.0 ** -np.arange(1, 16.5, 0.5),
                        -(1 - 2.0 ** -np.arange(1, 54)), [0.0, 1e-300, 0.5]])
    got = n(R._erfinv64(ms.Tensor(x)))
    want = erfinv(x)
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite])
    rel = np.abs(got[finite] - want[finite]) / np.maximum(np.abs(want[finite]), 1e-300)
    assert rel.max() < 1e-15


def _jax_python():
    exe = os.environ.get("FSHARD_JAX_PYTHON") or str(ROOT / ".jaxenv" / "bin" / "python")
    return exe if os.path.exists(exe) else None


@pytest.mark.skipif(_jax_python() is None, reason="no JAX environment (.jaxenv); the "
                    "recorded JAX outputs above are checked instead")
def test_equal_jax_live_for_many_seeds_and_shapes():
    cases = [(s, shape) for s in (0, 1, 123456, -5, 2**31 - 1) for shape in
             ((), (7,), (3, 5), (2, 3, 4))]
    script = (
        "import json, sys, jax, numpy as np\n"
        "out = []\n"
        "for s, shape in json.loads(sys.argv[1]):\n"
        "    k = jax.random.key(s)\n"
        "    a, b = jax.random.split(k)\n"
        "    out.append([np.asarray(jax.random.bits(a, tuple(shape))).tolist(),\n"
        "                np.asarray(jax.random.uniform(b, tuple(shape))).tolist(),\n"
        "                np.asarray(jax.random.key_data(jax.random.fold_in(k, s & 0xff))).tolist()])\n"
        "print(json.dumps(out))\n")
    res = subprocess.run([_jax_python(), "-c", script, json.dumps(cases)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    for (s, shape), (bits, uni, fold) in zip(cases, json.loads(res.stdout)):
        k = R.key(s)
        a, b = R.split(k)
        assert n(R.bits(a, shape)).tolist() == bits
        np.testing.assert_array_equal(n(R.uniform(b, shape)), np.float32(uni))
        assert n(R.fold_in(k, s & 0xFF)).tolist() == fold


_BOUNDS = [(-3, 2), (0.1, 0.7), (-1e-3, 123.456), (1000.5, 1001.25), (-2.5, -1e-5),
           (1e-30, 1.0000001), (-1e-30, 3.0000002), (-3e4, 3e4), (5.0, 5.0)]


@pytest.mark.skipif(_jax_python() is None, reason="no JAX environment (.jaxenv, or "
                    "FSHARD_JAX_PYTHON); the recorded JAX outputs above are checked instead")
def test_uniform_keys_and_truncated_normal_equal_jax_live():
    seeds = [0, 1, -1, -5, 2**31 - 1, 2**31, 2**32 + 3, 2**40 + 5, -2**31 - 1, 2**63 - 1, -2**63]
    script = (
        "import json, sys, jax, numpy as np, jax.numpy as jnp\n"
        "seeds, bounds = json.loads(sys.argv[1])\n"
        "keys = [np.asarray(jax.random.key_data(jax.random.key(s))).tolist() for s in seeds]\n"
        "def draws():\n"
        "    out = []\n"
        "    for i, (lo, hi) in enumerate(bounds):\n"
        "        k = jax.random.wrap_key_data(jnp.array([0, i + 7], jnp.uint32))\n"
        "        row = {}\n"
        "        for name, dt, view in (('f16', jnp.float16, np.uint16), ('f32', jnp.float32,"
        " np.uint32), ('f64', jnp.float64, np.uint64)):\n"
        "            if dt == jnp.float64 and not jax.config.jax_enable_x64:\n"
        "                continue\n"
        "            v = np.asarray(jax.random.uniform(k, (2000,), dt, lo, hi)).view(view)\n"
        "            row[name] = [str(x) for x in v.tolist()]\n"
        "        out.append(row)\n"
        "    return out\n"
        "r32 = draws()\n"
        "tn32 = np.asarray(jax.random.truncated_normal(jax.random.key(3), -1.0, 2.0, (2000,)))\n"
        "jax.config.update('jax_enable_x64', True)\n"
        "r64 = draws()\n"
        "tn64 = np.asarray(jax.random.truncated_normal(jax.random.key(3), -6.0, 1.0, (2000,),"
        " jnp.float64))\n"
        "print(json.dumps([keys, r32, r64, tn32.tolist(), tn64.tolist()]))\n")
    res = subprocess.run([_jax_python(), "-c", script, json.dumps([seeds, _BOUNDS])],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    keys, r32, r64, tn32, tn64 = json.loads(res.stdout)
    for seed, want in zip(seeds, keys):
        assert n(R.key(seed)).tolist() == want, seed
    views = {"f16": (fs.dtypes.float16, np.uint16), "f32": (fs.dtypes.float32, np.uint32),
             "f64": (fs.dtypes.float64, np.uint64)}
    for i, (lo, hi) in enumerate(_BOUNDS):
        for name, want in {**r32[i], **r64[i]}.items():
            dtype, view = views[name]
            got = n(R.uniform(u32(0, i + 7), (2000,), dtype, lo, hi)).view(view)
            assert got.tolist() == [int(v) for v in want], (lo, hi, name)
    got = n(R.truncated_normal(R.key(3), -1.0, 2.0, (2000,)))
    assert _ulps(got, np.float32(tn32)).max() <= 4
    got = n(R.truncated_normal(R.key(3), -6.0, 1.0, (2000,), fs.dtypes.float64))
    # JAX's float64 erfinv is the less accurate one here (~5e-12 near -1)
    assert np.abs(got - np.float64(tn64)).max() < 1e-11


# --- the same numbers under every transform ------------------------------------------

DRAWS = {
    "bits": lambda k: R.bits(k, (3, 4)),
    "uniform": lambda k: R.uniform(k, (3, 4), minval=-2.0, maxval=5.0),
    "uniform64": lambda k: R.uniform(k, (5,), fs.dtypes.float64),
    "normal": lambda k: R.normal(k, (3, 4)),
    "truncated_normal": lambda k: R.truncated_normal(k, -0.5, 1.5, (6,)),
    "bernoulli": lambda k: R.bernoulli(k, 0.3, (10,)),
    "randint": lambda k: R.randint(k, (10,), -3, 9),
    "gumbel": lambda k: R.gumbel(k, (4,)),
    "categorical": lambda k: R.categorical(k, np.log(np.float32([[0.2, 0.3, 0.5]] * 4))),
    "permutation": lambda k: R.permutation(k, 9),
    "split": lambda k: R.split(k, 4),
    "fold_in": lambda k: R.fold_in(k, 3),
    "dropout": lambda k: fs.nn.dropout(k, np.ones((4, 5), np.float32), 0.5),
}


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_jit_and_vmap_give_the_eager_numbers(name):
    draw = DRAWS[name]
    key = R.key(11)
    np.testing.assert_array_equal(n(fs.jit(draw)(key)), n(draw(key)))
    keys = R.split(key, 3)
    looped = np.stack([n(draw(keys[i])) for i in range(3)])
    np.testing.assert_array_equal(n(fs.vmap(draw)(keys)), looped)
    lanes = [n(draw(keys[i])) for i in range(3)]
    assert not all(np.array_equal(lanes[0], lane) for lane in lanes[1:]) or name == "dropout"


def test_vmap_over_seeds_and_fold_in_data():
    seeds = ms.Tensor(np.array([0, 1, -7], np.int32))
    keys = fs.vmap(R.key)(seeds)
    assert n(keys).tolist() == [n(R.key(s)).tolist() for s in (0, 1, -7)]
    steps = ms.Tensor(np.arange(4, dtype=np.int32))
    folded = fs.vmap(lambda i: R.fold_in(R.key(5), i))(steps)
    assert n(folded).tolist() == [n(R.fold_in(R.key(5), i)).tolist() for i in range(4)]


def test_jit_compiles_once_for_every_key():
    f = fs.jit(lambda k, x: x + R.normal(k, x.shape))
    x = np.zeros((4,), np.float32)
    outs = [n(f(k, x)) for k in R.split(R.key(0), 5)]
    assert f.trace_count == 1
    assert len({o.tobytes() for o in outs}) == 5


@pytest.mark.parametrize("strategy", [((4, 2),), ((8, 1),), ((1, 8),), ((2, 1),)])
def test_a_sharded_draw_equals_the_unsharded_draw(strategy):
    def draw(k):
        return R.uniform(k, (8, 8)) + R.normal(R.fold_in(k, 1), (8, 8))

    key = R.key(7)
    sharded = fs.shard(draw, in_strategy=(None,), out_strategy=strategy, mesh=8)
    np.testing.assert_array_equal(n(sharded(key)), n(draw(key)))


def test_sharded_dropout_of_a_sharded_batch():
    x = np.arange(64, dtype=np.float32).reshape(8, 8) + 1

    def f(k, x):
        return fs.nn.dropout(k, x, 0.25) * 2.0

    key = R.key(3)
    sharded = fs.shard(f, in_strategy=(None, (4, 2)), mesh=8)
    np.testing.assert_array_equal(n(sharded(key, x)), n(f(key, x)))


def test_grad_through_dropout_is_the_scaled_mask():
    x = np.linspace(1, 2, 12, dtype=np.float32).reshape(3, 4)
    key = R.key(0)
    g = fs.grad(lambda x: fs.nn.dropout(key, x, 0.25).sum())(x)
    keep = n(R.bernoulli(key, 0.75, (3, 4)))
    np.testing.assert_allclose(n(g), keep / np.float32(0.75), rtol=1e-6)


def test_dropout_edges():
    x = np.ones((3,), np.float32)
    assert fs.nn.dropout(R.key(0), x, 0.0) is x
    assert n(fs.nn.dropout(R.key(0), x, 1.0)).tolist() == [0.0, 0.0, 0.0]
    y = n(fs.nn.dropout(R.key(1), np.ones((100000,), np.float32), 0.1))
    assert set(np.unique(y).tolist()) <= {0.0, np.float32(1 / 0.9).item()}
    assert abs(y.mean() - 1.0) < 0.01


# --- statistics ------------------------------------------------------------------------

N = 200_000


def test_uniform_and_float64_uniform_pass_kolmogorov_smirnov():
    for dtype in (fs.dtypes.float32, fs.dtypes.float64):
        u = n(R.uniform(R.key(1), (N,), dtype)).astype(np.float64)
        assert u.min() >= 0.0 and u.max() < 1.0
        assert stats.kstest(u, "uniform").pvalue > 1e-3
    v = n(R.uniform(R.key(2), (N,), minval=-3.0, maxval=2.0)).astype(np.float64)
    assert v.min() >= -3.0 and v.max() < 2.0
    assert stats.kstest(v, stats.uniform(-3, 5).cdf).pvalue > 1e-3


def test_normal_moments_and_kolmogorov_smirnov():
    for dtype in (fs.dtypes.float32, fs.dtypes.float64):
        z = n(R.normal(R.key(4), (N,), dtype)).astype(np.float64)
        assert abs(z.mean()) < 5 / np.sqrt(N) and abs(z.var() - 1) < 0.02
        assert abs(stats.skew(z)) < 0.03 and abs(stats.kurtosis(z)) < 0.06
        assert stats.kstest(z, "norm").pvalue > 1e-3


def test_float64_normal_inverts_the_cdf_to_float64_precision():
    # normal = sqrt(2) * erfinv(u) with u the float64 uniform draw on (-1, 1).
    from scipy.special import erfinv

    u = n(R.uniform(R.key(4), (1000,), fs.dtypes.float64,
                    np.nextafter(-1.0, 0.0), 1.0))
    z = n(R.normal(R.key(4), (1000,), fs.dtypes.float64))
    np.testing.assert_allclose(z, np.sqrt(2) * erfinv(u), rtol=1e-12, atol=1e-13)


def test_truncated_normal_and_gumbel_kolmogorov_smirnov():
    t = n(R.truncated_normal(R.key(5), -0.5, 1.5, (N,))).astype(np.float64)
    assert t.min() > -0.5 and t.max() < 1.5
    assert stats.kstest(t, stats.truncnorm(-0.5, 1.5).cdf).pvalue > 1e-3
    g = n(R.gumbel(R.key(6), (N,))).astype(np.float64)
    assert stats.kstest(g, "gumbel_r").pvalue > 1e-3
    assert np.isfinite(n(R.truncated_normal(R.key(5), -np.inf, 0.0, (1000,)))).all()


def test_bernoulli_randint_categorical_frequencies():
    b = n(R.bernoulli(R.key(7), 0.3, (N,)))
    assert b.dtype == np.bool_ and abs(b.mean() - 0.3) < 5 * np.sqrt(0.21 / N)
    r = n(R.randint(R.key(8), (N,), -3, 7))
    assert r.dtype == np.int32 and r.min() == -3 and r.max() == 6
    assert stats.chisquare(np.bincount(r + 3, minlength=10)).pvalue > 1e-3
    big = n(R.randint(R.key(8), (1000,), -2**31, 2**31 - 1))
    assert big.min() < -2**30 and big.max() > 2**30
    assert n(R.randint(R.key(8), (5,), 4, 4)).tolist() == [4] * 5  # empty range: minval
    p = np.float32([0.1, 0.2, 0.3, 0.4])
    c = n(R.categorical(R.key(9), np.log(p), shape=(N,)))
    assert stats.chisquare(np.bincount(c, minlength=4), N * p / p.sum(dtype=np.float64)).pvalue > 1e-3
    batched = n(R.categorical(R.key(9), np.float32([[0.0, 0.0, -np.inf]] * 3), axis=1))
    assert batched.shape == (3,) and set(batched.tolist()) <= {0, 1}


def test_permutation_is_uniform_over_positions():
    perms = fs.vmap(lambda k: R.permutation(k, 6))(R.split(R.key(10), 3000))
    perms = n(perms)
    assert (np.sort(perms, axis=1) == np.arange(6)).all()
    counts = np.stack([np.bincount(perms[:, j], minlength=6) for j in range(6)])
    assert stats.chisquare(counts.ravel()).pvalue > 1e-3
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    px = n(R.permutation(R.key(1), x, axis=1))
    assert sorted(px[0].tolist()) == [0, 1, 2, 3] and (px - px[:1] == 4 * np.arange(3)[:, None]).all()


def test_split_keys_are_distinct_and_independent():
    keys = n(R.split(R.key(0), 1000))
    assert len({tuple(k) for k in keys.tolist()}) == 1000
    a = n(R.uniform(R.split(R.key(0))[0], (N,))).astype(np.float64)
    b = n(R.uniform(R.split(R.key(0))[1], (N,))).astype(np.float64)
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(N)


# --- errors ---------------------------------------------------------------------------


def test_errors_name_the_argument_and_the_fix():
    key = R.key(0)
    with pytest.raises(fs.ArgumentError, match=r"(?s)key must be one key.*vmap"):
        R.normal(R.split(key, 4), (3,))
    with pytest.raises(fs.ArgumentError, match="key must be one key"):
        R.uniform(np.zeros((2,), np.float32), (3,))
    with pytest.raises(fs.ArgumentError, match="seed must be an integer"):
        R.key(1.5)
    with pytest.raises(fs.ArgumentError, match="seed must fit in int64"):
        R.key(2**70)
    with pytest.raises(fs.ArgumentError, match="shape must be a tuple of non-negative"):
        R.normal(key, (3, -1))
    with pytest.raises(fs.ArgumentError, match="float16, float32 or float64"):
        R.uniform(key, (3,), fs.dtypes.int32)
    with pytest.raises(fs.ArgumentError, match="signed integer dtype"):
        R.randint(key, (3,), 0, 5, fs.dtypes.float32)
    with pytest.raises(fs.ArgumentError, match="num must be a non-negative int"):
        R.split(key, -1)
    with pytest.raises(fs.ArgumentError, match=r"n must be in \[0, 16384\]"):
        R.permutation(key, 20000)
    with pytest.raises(fs.ArgumentError, match="must end with the logits' batch shape"):
        R.categorical(key, np.zeros((2, 3), np.float32), shape=(4,))
    with pytest.raises(fs.ArgumentError, match=r"rate must be a float in \[0, 1\]"):
        fs.nn.dropout(key, np.ones(3, np.float32), 1.5)
    with pytest.raises(fs.ArgumentError, match="x must be a float array"):
        fs.nn.dropout(key, np.ones(3, np.int32), 0.5)


def test_a_key_consumed_twice_in_a_traced_function_is_a_warning():
    k, x = R.key(0), np.ones(4, np.float32)
    with pytest.warns(fs.KeyReuseWarning, match=r"(?s)fs\.random\.uniform: this key was "
                      r"already consumed by fs\.random\.normal.*Fix: split it"):
        fs.jit(lambda k: R.normal(k, (2,)) + R.uniform(k, (2,)))(k)
    with pytest.warns(fs.KeyReuseWarning, match="consumed by fs.random.split"):
        fs.jit(lambda k: (R.split(k), R.normal(k, (2,))))(k)
    with pytest.warns(fs.KeyReuseWarning, match="fs.nn.dropout: .* by fs.nn.dropout"):
        fs.vmap(lambda k: fs.nn.dropout(k, x, 0.5) * fs.nn.dropout(k, x, 0.5))(R.split(k, 3))
    with pytest.warns(fs.KeyReuseWarning, match="consumed by fs.random.normal"):
        # consumed in one branch of a cond, then drawn from again after it
        fs.jit(lambda p, k: fs.cond(p, lambda k: R.normal(k, (2,)), lambda k: R.uniform(
            R.fold_in(k, 1), (2,)), k) + R.normal(k, (2,)))(np.bool_(True), k)


def test_keys_used_once_are_not_warned_about():
    import warnings

    k = R.key(0)

    def step(c, _):
        c, sub = R.split(c)
        return c, R.normal(sub, (2,))

    with warnings.catch_warnings():
        warnings.simplefilter("error", fs.KeyReuseWarning)
        fs.jit(lambda k: [R.normal(s, (2,)) for s in R.split(k, 3)])(k)  # one key each
        fs.jit(lambda k: R.normal(R.fold_in(k, 1), (2,)) + R.normal(R.fold_in(k, 2), (2,)))(k)
        fs.jit(lambda p, k: fs.cond(p, lambda k: R.normal(k, (2,)),
                                    lambda k: R.uniform(k, (2,)), k))(np.bool_(True), k)
        fs.jit(lambda k: fs.scan(step, k, None, length=3))(k)
        # categorical and permutation draw from their key inside one call: one use
        fs.jit(lambda k: R.categorical(k, np.zeros((2, 3), np.float32)))(k)
        fs.jit(lambda k: R.permutation(k, 5))(k)
        R.normal(k, (2,)), R.normal(k, (2,))  # eager: deliberate repeats are not checked


def test_stateful_mindspore_random_points_to_fs_random():
    with pytest.raises(fs.UnsupportedOpError, match=r"fs\.random\.split"):
        fs.jit(lambda a: a + ms.ops.randn((3,)))(np.zeros(3, np.float32))
