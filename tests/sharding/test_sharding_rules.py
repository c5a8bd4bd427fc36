"""Every primitive's sharding rule against ground truth ("sharding vs unsharded").

Parametrized over ``fshard.rules.all_primitives()`` with a sharding rule, each
primitive's samples from ``tests/primitive_specs.py`` (plus the sharding samples
below, whose dims divide by 2, 4 and 8) and virtual meshes of 2, 4 and 8 devices:

- ``test_rule_matches_ground_truth``: ``fshard.testing.check_sharding_rule`` runs
  every layout the rule claims (every candidate of its ``FactorSpec``, and every
  pending sum it lets pass through a linear operand) device by device on the local
  blocks and compares each device's result with its block of the unsharded result:
  a mismatch is a WRONG rule. It then runs every operand layout the rule does not
  claim (a deterministic sample when there are many) the same way; a layout whose
  per-device results form a layout of the right answer is UNCLAIMED: the rule would
  force a redistribution that was not needed. Both must be empty, except the
  unclaimed layouts listed in ``KNOWN_UNCLAIMED`` with the reason a factor rule
  cannot express them.
- ``test_shard_matches_unsharded``: ``fs.shard(op, in_strategy=...)`` end to end
  (propagation, partitioning with collectives, execution on the virtual mesh) for a
  deterministic sample of operand layouts, given as ``Layout`` views, against the
  unsharded primitive.
- The unsupported list is exactly the expected one, each with its reason.

Operands are random floats (not ``ones``), and pending sums are uneven random shares
per device, so that coincidences do not pass. Primitives run eagerly, with
MindSpore's PyNative queue synchronous (a sync per op costs ~2 ms otherwise).
"""

from __future__ import annotations

import os
import sys
import zlib

import mindspore as ms
import numpy as np
import pytest

import fshard as fs
from fshard import rules
from fshard.sharding.layouts import Sharding, candidate_shardings, candidates
from fshard.testing import (all_shardings, check_sharding, check_sharding_rule, shard_mesh)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: not a package
from primitive_specs import (SPECS, Sample, indices, loop_sharding_samples, quick_first,  # noqa: E402
                             values)

MESHES = (2, 4, 8)
PRIMS = rules.all_primitives()
SHARDED = [p for p in PRIMS if p in rules.sharding]

# Primitives without a sharding rule, on purpose (each records its reason).
EXPECTED_UNSUPPORTED = {
    # Collectives and the partitioner's own primitives exist only in per-device programs.
    "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "axis_index",
    "all_to_all", "ppermute", "broadcast", "replica_sum", "replica_split", "shard_in",
    "shard_out", "block_slice", "shard_call",
    # They keep a job's per-rank collective (MindSpore's NeighborExchange) on a rank
    # whose result does not read it: per-rank programs, never partitioned.
    "after", "keep",
}

# Valid operand layouts that a factor rule cannot claim, by primitive, with the reason.
# The test fails if one of these starts being claimed (then remove it) or if any other
# primitive has unclaimed layouts.
# float32 primitives that sum tens of products per output: a pending sum's uneven random
# shares (one per device) lose a few more float32 digits than the unsharded order
SUM_TOL = {"conv2d": 5e-5, "conv2d_input_grad": 5e-5, "conv2d_filter_grad": 5e-5}
_GROUPS = ("with groups > 1 a channel dim is (groups, channels per group): a split of "
           "whole groups on one mesh axis and of each group's channels on another is "
           "valid, but FactorSpec gives a dim one factor (a compound factor would "
           "express it)")
_WINDOWS = ("a split inside the windows of a dim the windows tile leaves partial window "
            "sums: the dim is (windows, positions in a window), a compound factor")
KNOWN_UNCLAIMED = {
    "debug_callback": "the callback is called with the global values (as fs.shard's "
                      "contract says), so its rule gathers split operands; a split "
                      "operand is valid for an effect with no outputs, but not what the "
                      "callback is promised",
    "avg_pool2d": _WINDOWS,
    "conv2d": _GROUPS,
    "conv2d_input_grad": _GROUPS,
    "conv2d_filter_grad": _GROUPS,
    "reshape": "a split of a merged dim that spans several source dims, e.g. (2, 4) "
               "-> (8,) with dim 0 split fully and dim 1 split too: the output dim's "
               "split is the product of two factors, and FactorSpec gives a dim one "
               "factor (Shardy's compound factors would express it)",
    "dim_size": "a split of a dimension the size does not count leaves the output "
                "(replicated) unchanged, but in FactorSpec a factor that appears in no "
                "output can only be a pending sum; the rule gathers such inputs instead",
    "remat_barrier": "the dependency's values are never read, so it may have any layout, "
                     "but a factor rule splits a mesh axis over one factor: a dependency "
                     "shaped like no x gets factors of its own, so a layout splitting it "
                     "and an x over the same axis is valid but not claimed",
    "while": "with a trip count of 0 the body never runs, so any layout of the body's "
             "constants gives the right (initial) carry; a factor rule claims layouts "
             "that hold for every trip count",
}

# Samples whose dims divide by the mesh sizes, so that every rule gets split (the
# generic specs favour odd and size-1 dims).
F32 = np.float32


def _sharding_samples() -> dict:
    rng = np.random.default_rng(7)

    def v(*shape, dt=F32):
        return values(rng, shape, dt)

    def idx(shape, n, dt=np.int32):
        return indices(rng, shape, n, dt)

    un = lambda *shapes: [Sample((v(*s),)) for s in shapes]  # noqa: E731
    bi = lambda *shapes: [Sample((v(*s), v(*s))) for s in shapes]  # noqa: E731
    conv = {"stride": (1, 1), "padding": ((0, 0), (0, 0)), "dilation": (1, 1), "groups": 1}
    pool = {"kernel": (2, 2), "stride": (1, 1), "padding": ((1, 0), (0, 1))}
    tiled = {**conv, "stride": (2, 2)}
    tiled_pool = {"kernel": (2, 2), "stride": (2, 2), "padding": ((0, 0), (0, 0))}
    out = {
        "exp": un((4, 2), (2, 2, 2)),
        "add": bi((4, 2), (8,)),
        "mul": bi((2, 4)),
        "maximum": bi((4, 2)),
        "less": bi((4, 2)),
        "select": [Sample((v(4, 2, dt=np.bool_), v(4, 2), v(4, 2)))],
        "cast": [Sample((v(4, 2),), {"dtype": fs.dtypes.float64}),
                 Sample((v(4, 2),), {"dtype": fs.dtypes.int32})],
        "gelu": [Sample((v(2, 4),), {"approximate": "tanh"})],
        "matmul": [Sample((v(4, 4), v(4, 2)), {"transpose_a": False, "transpose_b": False}),
                   Sample((v(2, 4), v(2, 4)), {"transpose_a": True, "transpose_b": False}),
                   Sample((v(2, 2, 4), v(2, 2, 4)), {"transpose_a": False,
                                                      "transpose_b": True})],
        "broadcast_to": [Sample((v(1, 4),), {"shape": (2, 4)}),
                         Sample((v(4),), {"shape": (2, 2, 4)})],
        "reshape": [Sample((v(8),), {"shape": (2, 4)}), Sample((v(2, 4),), {"shape": (8,)}),
                    Sample((v(4, 2),), {"shape": (2, 2, 2)}),
                    Sample((v(2, 2, 2),), {"shape": (4, 2)})],
        "transpose": [Sample((v(2, 4),), {"perm": (1, 0)}),
                      Sample((v(2, 2, 4),), {"perm": (2, 0, 1)})],
        "full": [Sample((), {"shape": (4, 2), "value": 1.5, "dtype": fs.dtypes.float32})],
        "stop_gradient": un((4, 2)),
        "concat": [Sample((v(4, 2), v(4, 1)), {"axis": 1}),
                   Sample((v(2, 4), v(2, 4)), {"axis": 0})],
        "split": [Sample((v(4, 4),), {"sizes": (1, 3), "axis": 0}),
                  Sample((v(2, 4),), {"sizes": (2, 2), "axis": 1})],
        "slice": [Sample((v(8, 4),), {"start": (1, 0), "limit": (8, 4), "strides": (2, 1)}),
                  Sample((v(4, 4),), {"start": (0, 1), "limit": (4, 3), "strides": (1, 1)}),
                  Sample((v(8,),), {"start": (0,), "limit": (8,), "strides": (4,)}),
                  Sample((v(8,),), {"start": (3,), "limit": (8,), "strides": (4,)})],
        "pad": [Sample((v(4, 2),), {"low": (0, 1), "high": (0, 0), "interior": (0, 1)})],
        "gather": [Sample((v(4, 2), idx((2, 4), 4)), {"axis": 0}),
                   Sample((v(2, 4), idx((4,), 4)), {"axis": 1})],
        "scatter_add": [Sample((v(4, 2), np.array([1, 3, 0, 1], np.int32)),
                               {"shape": (4, 2), "axis": 0}),
                        Sample((v(2, 2, 4), np.array([[2, 0, 1, 1], [0, 2, 2, 1]], np.int32)),
                               {"shape": (2, 3), "axis": 1})],
        "one_hot": [Sample((idx((4, 2), 3),), {"depth": 3, "dtype": fs.dtypes.float32})],
        "reduce_sum": [Sample((v(4, 2, 2),), {"axes": (1,)}),
                       Sample((v(4, 2),), {"axes": (0, 1)})],
        "reduce_max": [Sample((v(4, 2),), {"axes": (0,)})],
        "argmax": [Sample((v(4, 2),), {"axis": 1}), Sample((v(4, 2),), {"axis": 0})],
        "argmin": [Sample((v(2, 4),), {"axis": 1})],
        "bias_add": [Sample((v(4, 2, 2), v(2)))],
        "softmax": [Sample((v(4, 2),), {"axis": 1})],
        "log_softmax": [Sample((v(2, 4),), {"axis": 0})],
        # batch, output and (summed) input channels divide by 2, 4 and 8; groups by 4;
        # few terms per output, so that float32 pending sums stay within tolerance. The
        # last of each: kernel == stride, so the spatial dims split too.
        "conv2d": [Sample((v(8, 4, 3, 3), v(8, 4, 2, 2)), conv),
                   Sample((v(4, 8, 3, 3), v(8, 2, 2, 2)), {**conv, "groups": 4}),
                   Sample((v(2, 2, 4, 8), v(4, 2, 2, 2)), tiled)],
        "conv2d_input_grad": [
            Sample((v(8, 4, 2, 2), v(4, 4, 2, 2)), {**conv, "input_shape": (8, 4, 3, 3)}),
            Sample((v(4, 8, 2, 2), v(8, 2, 2, 2)),
                   {**conv, "groups": 4, "input_shape": (4, 8, 3, 3)}),
            Sample((v(2, 4, 2, 4), v(4, 2, 2, 2)), {**tiled, "input_shape": (2, 2, 4, 8)})],
        "conv2d_filter_grad": [
            Sample((v(8, 4, 3, 3), v(8, 8, 2, 2)), {**conv, "kernel_shape": (8, 4, 2, 2)}),
            Sample((v(4, 8, 3, 3), v(4, 8, 2, 2)),
                   {**conv, "groups": 4, "kernel_shape": (8, 2, 2, 2)}),
            Sample((v(2, 2, 4, 8), v(2, 4, 2, 4)), {**tiled, "kernel_shape": (4, 2, 2, 2)})],
        "max_pool2d": [Sample((v(8, 8, 4, 4),), pool), Sample((v(2, 4, 4, 8),), tiled_pool)],
        "max_pool2d_argmax": [Sample((v(8, 8, 4, 4),), pool)],
        "avg_pool2d": [Sample((v(8, 8, 4, 4),), pool), Sample((v(2, 4, 4, 8),), tiled_pool)],
    }
    out.update(loop_sharding_samples(rng))
    return out


SHARDING_SAMPLES = _sharding_samples()


def _samples(prim) -> list:
    spec = SPECS.get(prim.name)
    out = []
    if spec is not None:
        dt = F32 if F32 in spec.dtypes else spec.dtypes[0]
        out += [s for s in spec.all_samples(dt)]
    return out + SHARDING_SAMPLES.get(prim.name, [])


# Primitives with a sharding rule but no eager meaning, so no device-by-device run:
# checked through a transform that gives them one.
CHECKED_ELSEWHERE = {
    "custom_lin": "forward mode through a custom_vjp function is an error; "
                  "test_call_primitive_under_shard_keeps_its_rule partitions it under "
                  "grad(shard(f))",
}


def _rule_cases():
    out = []
    for prim in SHARDED:
        if prim.name in CHECKED_ELSEWHERE:
            continue
        samples = _samples(prim)
        if not samples:
            out.append(pytest.param(prim, None, 2, id=f"{prim.name}-NO-SAMPLES"))
        for s in samples:
            for n in MESHES:
                out.append(pytest.param(prim, s, n, id=f"{prim.name}[{s.id}]-mesh{n}"))
    return quick_first(out)


@pytest.fixture(autouse=True, scope="module")
def _synchronous_pynative():
    """Eager ops run synchronously here: each check converts its results at once, and
    MindSpore's asynchronous queue costs ~2 ms per conversion."""
    old = ms.get_context("pynative_synchronize")
    ms.set_context(pynative_synchronize=True)
    yield
    ms.set_context(pynative_synchronize=old)


# ---------------------------------------------------------------------------
# The rules against ground truth
# ---------------------------------------------------------------------------


# A generic op's rule warns that it runs replicated (tests/test_generic_ops.py checks it).
@pytest.mark.filterwarnings("ignore::fshard.errors.GenericOpWarning")
@pytest.mark.parametrize("prim,sample,n", _rule_cases())
def test_rule_matches_ground_truth(prim, sample, n):
    if sample is None:
        pytest.fail(f"primitive '{prim.name}' has a sharding rule but no samples: add a "
                    "PrimitiveSpec in tests/primitive_specs.py")
    tol = SUM_TOL.get(prim.name, 1e-5)
    report = check_sharding_rule(prim, sample.args, sample.params, mesh=n, max_candidates=16,
                                 max_layouts=12, rtol=tol, atol=tol)
    assert not report.wrong, str(report)
    if prim.name not in KNOWN_UNCLAIMED:
        assert not report.unclaimed, str(report)


def test_known_unclaimed_layouts_still_exist():
    """Each KNOWN_UNCLAIMED entry is real (remove it once the rule claims it)."""
    found = set()
    for name in KNOWN_UNCLAIMED:
        prim = next(p for p in PRIMS if p.name == name)
        for s in _samples(prim):
            if check_sharding_rule(prim, s.args, s.params, mesh=8, max_layouts=None).unclaimed:
                found.add(name)
                break
    assert found == set(KNOWN_UNCLAIMED)


def test_checked_elsewhere_are_the_primitives_without_eager_meaning():
    no_eager = {p.name for p in SHARDED if SPECS.get(p.name) is not None
                and SPECS[p.name].eager_error is not None}
    assert no_eager == set(CHECKED_ELSEWHERE)


def test_unsupported_sharding_is_exactly_the_expected_set():
    unsupported = {}
    for p in PRIMS:
        status = rules.rule_status(p)["sharding"]
        assert status != "missing", (
            f"primitive '{p.name}' has no sharding rule and no recorded reason: register "
            "one next to its other rules (see docs/adding_a_primitive.md)")
        if status.startswith("unsupported: "):
            unsupported[p.name] = status[len("unsupported: "):]
    assert set(unsupported) == EXPECTED_UNSUPPORTED, (
        f"unexpected: {sorted(set(unsupported) - EXPECTED_UNSUPPORTED)}, "
        f"no longer unsupported: {sorted(EXPECTED_UNSUPPORTED - set(unsupported))}")
    for name, reason in unsupported.items():
        assert len(reason) > 20, f"{name}: the reason {reason!r} does not explain"


# ---------------------------------------------------------------------------
# End to end: fs.shard of one primitive against the unsharded primitive
# ---------------------------------------------------------------------------

LAYOUTS_PER_CASE = 2


def _e2e_cases():
    """Each sample on one mesh (cycling through 2, 4, 8) and a few operand layouts:
    the rule check above covers every layout; this covers the pipeline."""
    out = []
    for prim in SHARDED:
        if prim.name in CHECKED_ELSEWHERE:
            continue
        for k, s in enumerate(_samples(prim)):
            n = MESHES[k % len(MESHES)]
            out.append(pytest.param(prim, s, n, id=f"{prim.name}[{s.id}]-mesh{n}"))
    return quick_first(out)


def _layouts(prim, sample, n, rng) -> list:
    """Operand layouts: one the rule claims with the most splitting, then random ones."""
    mesh = shard_mesh(n)
    avals = [fs.typeof(a) for a in sample.args]
    spec = rules.sharding.lookup(prim, transform="test")(*avals, **sample.params)
    claimed = [candidate_shardings(spec, c)[0] for c in candidates(spec, mesh)]
    best = max(claimed, key=lambda ins: sum(len(s.used) for s in ins))
    out = [best]
    per_operand = [all_shardings(a, mesh) for a in avals]
    for _ in range(LAYOUTS_PER_CASE - 1):
        out.append([ss[rng.integers(len(ss))] for ss in per_operand])
    return out


@pytest.mark.parametrize("prim,sample,n", _e2e_cases())
def test_shard_matches_unsharded(prim, sample, n):
    rng = np.random.default_rng(zlib.crc32(f"{prim.name}{sample.id}".encode()))
    params = sample.params

    def op(*xs):
        out = prim.bind(*xs, **params)
        return tuple(out) if prim.multiple_results else out

    out_avals = rules.abstract_eval.lookup(prim, transform="test")(
        *[fs.typeof(a) for a in sample.args], **params)
    mesh = shard_mesh(n)
    for k, ins in enumerate(_layouts(prim, sample, n, rng)):
        out_strategy = None
        if k % 2:  # also move the result into a random layout of its own
            outs = [all_shardings(a, mesh) for a in out_avals]
            out_strategy = tuple(o[rng.integers(len(o))] for o in outs)
            if not prim.multiple_results:
                out_strategy = out_strategy[0]
        check_sharding(op, sample.args, tuple(ins), mesh=n, out_strategy=out_strategy)


# ---------------------------------------------------------------------------
# Call primitives keep their custom derivative under shard
# ---------------------------------------------------------------------------


@fs.custom_vjp
def _clip_gradient(x):
    return x


_clip_gradient.defvjp(lambda x: (x, None),
                      lambda _, g: (fs.ops.maximum(fs.ops.minimum(g, 0.5), -0.5),))


@fs.custom_jvp
def _softplus(x):
    return fs.ops.log(1.0 + fs.ops.exp(x))


@_softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _softplus(x), t * fs.ops.sigmoid(x) * 2.0  # deliberately not the true derivative


@pytest.mark.parametrize("fn", [_clip_gradient, _softplus], ids=["custom_vjp", "custom_jvp"])
def test_call_primitive_under_shard_keeps_its_rule(fn):
    x = np.random.default_rng(0).normal(size=(4, 2)).astype(np.float32)

    def loss(x):
        return (fn(x * 3.0) * x).sum()

    check_sharding(lambda a: fn(a * 3.0), (x,), ((2, 1),), mesh=4)
    want = fs.grad(loss)(x).asnumpy()
    sharded = fs.shard(loss, in_strategy=((4, 1),), mesh=4)
    np.testing.assert_allclose(fs.grad(sharded)(x).asnumpy(), want, rtol=1e-5, atol=1e-6)
    got = fs.shard(fs.grad(loss), in_strategy=((2, 1),), mesh=4)(x).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_non_row_major_layout_needs_no_communication():
    """A Layout view splitting a dim over mesh axes in non-row-major order is claimed
    by elementwise rules as it is: no all_gather/block_slice round trip."""
    x = np.random.default_rng(0).normal(size=(8, 2)).astype(np.float32)
    sh = Sharding(((1, 0), ()))
    part = check_sharding(lambda a: fs.ops.exp(a) * 2.0, (x,), (sh,), mesh=4, out_strategy=sh)
    assert part.collectives() == []


def test_redistribution_keeps_booleans_and_infinities():
    """Splitting a replicated value (block_slice on the virtual mesh) selects each
    device's block exactly: booleans stay booleans, an inf elsewhere is no NaN here."""
    x = np.array([[1.0, np.inf], [-np.inf, 2.0], [3.0, 4.0], [np.nan, 5.0]], np.float32)
    c = np.array([[True, False], [False, True], [True, True], [False, False]])
    for n in MESHES[:2]:
        check_sharding(lambda a: a, (x,), (None,), mesh=n,
                       out_strategy=Sharding((tuple(range(n.bit_length() - 1)), ())))
        check_sharding(lambda m: m, (c,), (None,), mesh=n,
                       out_strategy=Sharding(((), (0,))))
