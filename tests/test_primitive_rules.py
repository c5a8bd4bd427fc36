"""Registry-driven checks of every primitive's rules (see docs/adding_a_primitive.md).

Parametrized over ``fshard.rules.all_primitives()`` and each primitive's samples in
``tests/primitive_specs.py``. Rule-level checks call one rule directly on concrete
values (its ``bind`` calls run eagerly), so a failure names the broken rule:

- impl vs the NumPy reference (NB: JAX ``testOpAgainstNumpy``);
- the type rule vs the type of the real output;
- ``fs.jit(op)`` vs eager, for a few samples per primitive (each compiles a graph);
- the batching rule vs loop-and-stack, for every batch-dim placement of every
  operand, unbatched operands included (NB: JAX ``_CheckBatching``);
- the JVP rule vs central finite differences in float64;
- the transpose rule by the dot-product test ``<ct, L t> == <L^T ct, t>``.

Transform-level checks run the same specs through ``fs.vmap`` (every ``in_axes``
placement, None included), ``fs.jvp`` (finite differences) and ``fs.vjp`` /
``fs.grad`` (``<ct, J t> == <J^T ct, t>`` with J t from ``fs.jvp``).

Completeness: every primitive has a spec, and every rule kind is present or recorded
as unsupported with a reason.
"""

from __future__ import annotations

import itertools
import os
import sys

import mindspore as ms
import numpy as np
import pytest

import fshard as fs
from fshard import rules
from fshard.core.tracing import typeof
from fshard.errors import DifferentiationError
from fshard.primitives.base import UndefinedPrimal, Zero
from fshard.core.interpret import AxisData
from fshard.core.interpret import batching_axis as vmap_axis

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # tests/ is not a package
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from primitive_specs import F64, SPECS, out_types, quick_first  # noqa: E402

# Rule kinds the completeness test does not require yet: sharding rules arrive with
# the SPMD partitioner, primitive by primitive. Remove a kind to require it everywhere.

PRIMS = rules.all_primitives()
BATCH = 3  # examples per batched call in the batching checks
TRANSFORM_SAMPLES = 2  # samples per primitive (and dtype) for the transform-level checks



@pytest.fixture(autouse=True, scope="module")
def _synchronous_pynative():
    """Run eager ops synchronously: every check converts its results at once, and
    MindSpore's asynchronous queue costs ~2 ms per conversion."""
    old = ms.get_context("pynative_synchronize")
    ms.set_context(pynative_synchronize=True)
    yield
    ms.set_context(pynative_synchronize=old)


# ---------------------------------------------------------------------------
# Parametrization
# ---------------------------------------------------------------------------


def cases(*, dtypes=None, first_dtype_only=False, which=None, limit_jit=False,
          rule_samples=False, limit=None, needs_args=False):
    """``(name, spec, sample)`` params for every primitive that has a spec (one
    without fails ``test_every_primitive_has_a_spec``). ``dtypes(spec)`` chooses the
    dtypes, ``which(spec)`` whether the spec takes part, ``limit`` caps the samples
    per dtype."""
    out = []
    for prim in PRIMS:
        spec = SPECS.get(prim.name)
        if spec is None or (which is not None and not which(spec)):
            continue
        dts = dtypes(spec) if dtypes else spec.dtypes
        for dt in dts[:1] if first_dtype_only else dts:
            samples = spec.rule_check_samples(dt) if rule_samples else spec.all_samples(dt)
            if limit_jit and spec.jit_samples is not None:
                samples = samples[:spec.jit_samples]
            if limit is not None:  # the samples with the most dimensions come first
                samples = sorted(samples, key=lambda s: -sum(np.ndim(a) for a in s.args))
                samples = samples[:limit]
            for s in samples:
                if needs_args and not s.args and "batching" not in spec.custom_checks:
                    continue
                out.append(pytest.param(prim.name, spec, s, id=f"{prim.name}[{s.id}]"))
    return quick_first(out)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def to_np(x) -> np.ndarray:
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def tolerance(spec, dtype) -> dict:
    if dtype == np.float32:
        rtol, atol = spec.tol
        return dict(rtol=rtol, atol=atol)
    if dtype == np.float64:
        return dict(rtol=1e-9, atol=1e-12)
    return dict(rtol=0, atol=0)


def assert_outputs_close(actual, expected, spec, what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} outputs, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"{what}: output {i} has shape {a.shape}, expected {e.shape}"
        assert a.dtype.kind == e.dtype.kind, (
            f"{what}: output {i} has dtype {a.dtype}, expected a {e.dtype} kind")
        np.testing.assert_allclose(a, e, err_msg=f"{what}: output {i}",
                                   **tolerance(spec, a.dtype))


def vdot(a, b) -> float:
    return float(np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64)))


def is_float(a) -> bool:
    return np.asarray(a).dtype.kind == "f"


def with_operands(args, which, values) -> list:
    """``args`` with the operands at positions ``which`` replaced by ``values``."""
    full = list(args)
    for k, v in zip(which, values, strict=True):
        full[k] = v
    return full


# ---------------------------------------------------------------------------
# impl, type rule, lowering
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,spec,sample", cases())
def test_impl_matches_reference(name, spec, sample):
    if spec.eager_error is not None:
        with pytest.raises(spec.eager_error):
            rules.impl.lookup(spec.prim, transform="test")(*sample.args, **sample.params)
        return
    expected = [np.asarray(e) for e in as_list(spec.reference(*sample.args, **sample.params))]
    assert_outputs_close(spec.evaluate(*sample.args, **sample.params), expected, spec,
                         f"{name} impl vs NumPy")


@pytest.mark.parametrize("name,spec,sample", cases())
def test_type_rule_matches_impl(name, spec, sample):
    predicted = out_types(spec.prim, sample.args, sample.params)
    if spec.eager_error is not None:
        outs = spec.evaluate(*sample.args, **sample.params)
    else:
        outs = rules.impl.lookup(spec.prim, transform="test")(*sample.args, **sample.params)
    actual = [typeof(o) for o in outs]
    assert [str(t) for t in predicted] == [str(t) for t in actual]
    assert predicted == actual


@pytest.mark.parametrize("name,spec,sample", cases(first_dtype_only=True, limit_jit=True))
def test_jit_matches_eager(name, spec, sample):
    if "jit" in spec.custom_checks:
        spec.custom_checks["jit"](spec, sample)
        return
    params = sample.params
    jitted = fs.jit(lambda *xs: spec.apply(*xs, **params))
    if spec.eager_error is not None:
        # Outside its transform the primitive has no meaning: a clear fshard error.
        with pytest.raises(fs.FshardError):
            jitted(*sample.args)
        return
    actual = [to_np(o) for o in as_list(jitted(*sample.args))]
    assert_outputs_close(actual, spec.evaluate(*sample.args, **params), spec, f"fs.jit({name})")


# ---------------------------------------------------------------------------
# Batching: every placement of the batch dim, unbatched operands included
# ---------------------------------------------------------------------------


def batch_dim_cases(ndims, rng, limit: int = 8) -> list[tuple]:
    """``in_axes`` tuples: all of them when few, else a set in which every operand
    takes every placement (None included) at least once."""
    options = [[None] + list(range(nd + 1)) for nd in ndims]
    every = [c for c in itertools.product(*options) if any(d is not None for d in c)]
    if len(every) <= limit:
        return every
    chosen = {tuple(0 for _ in ndims)}
    for k, opts in enumerate(options):
        for o in opts:
            c = [other[rng.integers(len(other))] for other in options]
            c[k] = o
            if all(d is None for d in c):
                c[(k + 1) % len(c)] = 0
            chosen.add(tuple(c))
    return sorted(chosen, key=str)


def example_variants(args, rng, size=BATCH) -> list[tuple]:
    """``size`` valid operand tuples: the sample, then shuffles of it (floats also
    rescaled). Shuffling keeps every value in its domain (positive, valid index)."""
    out = [tuple(args)]
    for b in range(1, size):
        variant = []
        for a in args:
            v = rng.permutation(a.ravel()).reshape(a.shape)
            if a.dtype.kind == "f":
                v = v * (1.0 + 0.25 * b)
            variant.append(np.asarray(v, a.dtype))
        out.append(tuple(variant))
    return out


def check_batching(spec, sample, run_batched, rng, limit: int = 8) -> None:
    """Compare ``run_batched(batched_args, in_axes) -> outputs with the batch at
    axis 0`` with applying the primitive to each example and stacking."""
    variants = example_variants(sample.args, rng)
    expected_by_mask = {}  # the examples depend only on which operands are batched
    for dims in batch_dim_cases([np.ndim(a) for a in sample.args], rng, limit):
        mask = tuple(d is not None for d in dims)
        examples = [tuple(v[k] if batched else sample.args[k] for k, batched in enumerate(mask))
                    for v in variants]
        if mask not in expected_by_mask:
            per_example = [spec.evaluate(*ex, **sample.params) for ex in examples]
            expected_by_mask[mask] = [np.stack(outs) for outs in zip(*per_example)]
        batched = [np.stack([ex[k] for ex in examples], axis=d) if d is not None else a
                   for k, (a, d) in enumerate(zip(sample.args, dims))]
        actual = run_batched(batched, dims)
        assert_outputs_close(actual, expected_by_mask[mask], spec,
                             f"{spec.name} batched with in_axes={dims}")


def _rule_batched(spec, params):
    rule = rules.batching.lookup(spec.prim, transform="test")

    def run(batched, dims):
        # Rules of collectives and call primitives read the axis being mapped.
        with vmap_axis(AxisData(None, BATCH)):
            outs, out_dims = rule(list(batched), list(dims), **params)
        result = []
        for o, d in zip(outs, out_dims, strict=True):
            o = to_np(o)
            result.append(np.broadcast_to(o, (BATCH,) + o.shape) if d is None
                          else np.moveaxis(o, d, 0))
        return result

    return run


def _vmapped(spec, params):
    def run(batched, dims):
        f = fs.vmap(lambda *xs: spec.apply(*xs, **params), in_axes=tuple(dims))
        return [to_np(o) for o in as_list(f(*batched))]

    return run


@pytest.mark.parametrize("name,spec,sample", cases(first_dtype_only=True, rule_samples=True,
                                                  needs_args=True))
def test_batching_rule_matches_loop(name, spec, sample):
    if "batching" in spec.custom_checks:
        spec.custom_checks["batching"](spec, sample)
        return
    check_batching(spec, sample, _rule_batched(spec, sample.params), np.random.default_rng(0))


@pytest.mark.parametrize("name,spec,sample",
                         cases(first_dtype_only=True, limit=TRANSFORM_SAMPLES, needs_args=True,
                               which=lambda s: "batching" not in s.custom_checks))
def test_vmap_matches_loop(name, spec, sample):
    check_batching(spec, sample, _vmapped(spec, sample.params), np.random.default_rng(1),
                   limit=6)


# ---------------------------------------------------------------------------
# JVP: central finite differences in float64
# ---------------------------------------------------------------------------


def tangent_subsets(spec, sample) -> list[tuple]:
    """Which operands get a nonzero tangent: all differentiable ones, and each alone."""
    diff = spec.diff(sample)
    if not diff:
        return []
    return [diff] + ([(k,) for k in diff] if len(diff) > 1 else [])


def random_tangents(args, subset, rng) -> list:
    return [rng.standard_normal(np.shape(a)).astype(np.asarray(a).dtype) if k in subset
            else Zero(typeof(a)) for k, a in enumerate(args)]


def numerical_jvp(spec, args, tangents, params) -> tuple[list, float]:
    """Central differences of the primitive along ``tangents`` (a float32 output, from
    a cast, needs a larger step), and the step used."""
    outs = spec.evaluate(*args, **params)
    eps = 1e-6 if all(o.dtype != np.float32 for o in outs) else 1e-3

    def shifted(sign):
        return spec.evaluate(*[a if isinstance(t, Zero) else a + sign * eps * t
                               for a, t in zip(args, tangents)], **params)

    plus, minus = shifted(1.0), shifted(-1.0)
    return [(p.astype(np.float64) - m.astype(np.float64)) / (2 * eps)
            for p, m in zip(plus, minus)], eps


def check_jvp(spec, sample, run_jvp, rng) -> None:
    """``run_jvp(primals, tangents) -> (outs, tangents_out)``; a Zero tangent in
    ``tangents`` marks an operand held fixed."""
    for subset in tangent_subsets(spec, sample):
        tangents = random_tangents(sample.args, subset, rng)
        outs, t_outs = run_jvp(list(sample.args), tangents)
        what = f"{spec.name} JVP with tangents on operands {subset}"
        assert_outputs_close([to_np(o) for o in outs],
                             spec.evaluate(*sample.args, **sample.params), spec,
                             f"{what}: primal output")
        expected, eps = numerical_jvp(spec, sample.args, tangents, sample.params)
        for i, (t, e, o) in enumerate(zip(t_outs, expected, outs, strict=True)):
            zero_expected = spec.zero_derivative or not is_float(to_np(o))
            if isinstance(t, Zero):
                assert zero_expected, f"{what}: output {i} has a symbolic Zero tangent"
                continue
            t = to_np(t)
            assert t.shape == e.shape, f"{what}: tangent {i} has shape {t.shape}, not {e.shape}"
            if zero_expected:
                np.testing.assert_array_equal(t, np.zeros_like(t), err_msg=what)
            else:
                tol = 1e-6 if eps < 1e-5 else 1e-3
                np.testing.assert_allclose(t, e, rtol=tol, atol=tol,
                                           err_msg=f"{what}: tangent {i} vs finite differences")


def _rule_jvp(spec, params):
    rule = rules.jvp.lookup(spec.prim, transform="test")
    return lambda primals, tangents: rule(primals, tangents, **params)


def _transform_jvp(spec, params):
    def run(primals, tangents):
        diff = [k for k, t in enumerate(tangents) if not isinstance(t, Zero)]
        out, t_out = fs.jvp(lambda *d: spec.apply(*with_operands(primals, diff, d), **params),
                            tuple(primals[k] for k in diff), tuple(tangents[k] for k in diff))
        return as_list(out), as_list(t_out)

    return run


def _differentiable(spec) -> bool:
    return bool(spec.diff_argnums) or "jvp" in spec.custom_checks


@pytest.mark.parametrize("name,spec,sample",
                         cases(dtypes=lambda s: (F64,), rule_samples=True, which=_differentiable))
def test_jvp_rule_matches_finite_differences(name, spec, sample):
    if "jvp" in spec.custom_checks:
        spec.custom_checks["jvp"](spec, sample)
        return
    if not spec.forward_mode:
        tangents = random_tangents(sample.args, spec.diff(sample), np.random.default_rng(0))
        with pytest.raises(DifferentiationError, match="forward-mode"):
            _rule_jvp(spec, sample.params)(list(sample.args), tangents)
        return
    check_jvp(spec, sample, _rule_jvp(spec, sample.params), np.random.default_rng(0))


@pytest.mark.parametrize("name,spec,sample",
                         cases(dtypes=lambda s: (F64,), limit=TRANSFORM_SAMPLES,
                               which=lambda s: bool(s.diff_argnums) and "jvp" not in
                               s.custom_checks))
def test_jvp_matches_finite_differences(name, spec, sample):
    if not spec.forward_mode:
        tangents = random_tangents(sample.args, spec.diff(sample), np.random.default_rng(0))
        with pytest.raises(DifferentiationError, match="forward-mode"):
            _transform_jvp(spec, sample.params)(list(sample.args), tangents)
        return
    check_jvp(spec, sample, _transform_jvp(spec, sample.params), np.random.default_rng(1))


# ---------------------------------------------------------------------------
# Transpose: the dot-product test <ct, L t> == <L^T ct, t>
# ---------------------------------------------------------------------------


def check_transpose(spec, sample, group, run_transpose, rng) -> None:
    """``run_transpose(cts, undefined_args) -> cts_in`` for the linear map
    ``L(t) = prim(args with operands in group replaced by t)``."""
    args = list(sample.args)
    ts = {k: rng.standard_normal(np.shape(args[k])).astype(args[k].dtype) for k in group}
    l_t = spec.evaluate(*with_operands(args, group, [ts[k] for k in group]), **sample.params)
    cts = [rng.standard_normal(o.shape).astype(o.dtype) for o in l_t]
    undefined = [UndefinedPrimal(typeof(a)) if k in group else a for k, a in enumerate(args)]
    cts_in = run_transpose(cts, undefined)
    assert len(cts_in) == len(args), f"{spec.name} transpose returned {len(cts_in)} cotangents"
    lhs = sum(vdot(c, o) for c, o in zip(cts, l_t))
    rhs = 0.0
    for k in group:
        ct = cts_in[k]
        assert ct is not None and not isinstance(ct, Zero), (
            f"{spec.name} transpose gave no cotangent for linear operand {k}")
        assert typeof(ct) == typeof(args[k]), (
            f"{spec.name} transpose: cotangent {k} is {typeof(ct)}, operand is {typeof(args[k])}")
        rhs += vdot(to_np(ct), ts[k])
    # A float32 output (cast) rounds L t, so the identity holds to float32 precision.
    tol = 1e-9 if all(o.dtype == np.float64 for o in l_t) else 1e-5
    np.testing.assert_allclose(lhs, rhs, rtol=tol, atol=tol,
                               err_msg=f"{spec.name} transpose in operands {group}")


def _rule_transpose(spec, params):
    rule = rules.transpose.lookup(spec.prim, transform="test")

    def run(cts, undefined):
        return rule(cts if spec.prim.multiple_results else cts[0], *undefined, **params)

    return run


def transpose_cases():
    out = []
    for prim in PRIMS:
        spec = SPECS.get(prim.name)
        if spec is None:
            continue
        if "transpose" in spec.custom_checks:
            out += [pytest.param(prim.name, spec, s, None, id=f"{prim.name}[{s.id}]")
                    for s in spec.all_samples(F64)]
            continue
        for sample in spec.all_samples(F64) if spec.linear_groups else []:
            outs = out_types(spec.prim, sample.args, sample.params)
            for group in spec.groups(sample):
                # L is linear only where the group's operands and the outputs are float.
                if all(is_float(sample.args[k]) for k in group) and all(
                        fs.dtypes.is_float(o.dtype) for o in outs):
                    out.append(pytest.param(prim.name, spec, sample, group,
                                            id=f"{prim.name}[{sample.id}]-linear_in={group}"))
    return quick_first(out)


@pytest.mark.parametrize("name,spec,sample,group", transpose_cases())
def test_transpose_rule_dot_product(name, spec, sample, group):
    if "transpose" in spec.custom_checks:
        spec.custom_checks["transpose"](spec, sample)
        return
    check_transpose(spec, sample, group, _rule_transpose(spec, sample.params),
                    np.random.default_rng(0))


def _vjp_cases():
    def which(spec):
        if "vjp" in spec.custom_checks:
            return True
        return bool(spec.diff_argnums) and not spec.zero_derivative and (
            spec.eager_error is None)

    out = []
    for p in cases(dtypes=lambda s: (F64,), limit=TRANSFORM_SAMPLES, which=which):
        name, spec, sample = p.values
        if "vjp" in spec.custom_checks or all(
                fs.dtypes.is_float(o.dtype)
                for o in out_types(spec.prim, sample.args, sample.params)):
            out.append(p)
    return out


@pytest.mark.parametrize("name,spec,sample", _vjp_cases())
def test_vjp_and_grad_consistent_with_jvp(name, spec, sample):
    """``<ct, J t> == <vjp(ct), t>`` with ``J t`` from fs.jvp (from finite differences
    for reverse-mode-only primitives), and fs.grad of ``<ct, f>`` equals vjp(ct)."""
    if "vjp" in spec.custom_checks:
        spec.custom_checks["vjp"](spec, sample)
        return
    rng = np.random.default_rng(2)
    args, params = list(sample.args), sample.params
    diff = spec.diff(sample)

    def f(*d):
        return spec.apply(*with_operands(args, diff, d), **params)

    primals = tuple(args[k] for k in diff)
    ts = tuple(rng.standard_normal(np.shape(p)).astype(p.dtype) for p in primals)
    outs = spec.evaluate(*args, **params)
    cts = [rng.standard_normal(o.shape).astype(o.dtype) for o in outs]
    _, vjp_fn = fs.vjp(f, *primals)
    cts_in = vjp_fn(cts if spec.prim.multiple_results else cts[0])
    rhs = sum(vdot(to_np(c), t) for c, t in zip(cts_in, ts, strict=True))
    if spec.forward_mode:
        _, j_t = fs.jvp(f, primals, ts)
        lhs = sum(vdot(c, to_np(j)) for c, j in zip(cts, as_list(j_t)))
        # A float32 output (cast) rounds J t, so the identity holds to float32 precision.
        tol = 1e-9 if all(o.dtype == np.float64 for o in outs) else 1e-5
    else:
        j_t, _ = numerical_jvp(spec, args, with_operands([Zero(None)] * len(args), diff, ts),
                               params)
        lhs, tol = sum(vdot(c, j) for c, j in zip(cts, j_t)), 1e-6
    np.testing.assert_allclose(lhs, rhs, rtol=tol, atol=tol, err_msg=f"{name}: vjp vs jvp")

    def scalar(*d):
        return sum(fs.ops.reduce_sum(fs.ops.mul(o, c)) for o, c in zip(as_list(f(*d)), cts))

    grads = fs.grad(scalar, argnums=tuple(range(len(diff))))(*primals)
    for k, (g, c) in enumerate(zip(grads, cts_in, strict=True)):
        np.testing.assert_allclose(to_np(g), to_np(c), rtol=1e-9, atol=1e-12,
                                   err_msg=f"{name}: grad vs vjp for operand {diff[k]}")


# ---------------------------------------------------------------------------
# Completeness
# ---------------------------------------------------------------------------

REQUIRED_KINDS = list(rules.TABLES)


@pytest.mark.parametrize("prim", PRIMS, ids=lambda p: p.name)
def test_every_primitive_has_a_spec(prim):
    assert prim.name in SPECS, (
        f"primitive '{prim.name}' ({rules.family_of(prim)}) has no PrimitiveSpec: add one to "
        "tests/primitive_specs.py and a NumPy reference to tests/references.py "
        "(see docs/adding_a_primitive.md)")


def test_every_spec_names_a_registered_primitive():
    registered = {p.name for p in PRIMS}
    stale = sorted(set(SPECS) - registered)
    assert not stale, f"specs for primitives that are not registered: {stale}"


@pytest.mark.parametrize(
    "prim,kind", [(p, k) for p in PRIMS for k in REQUIRED_KINDS],
    ids=[f"{p.name}-{k}" for p in PRIMS for k in REQUIRED_KINDS])
def test_every_rule_kind_is_present_or_unsupported(prim, kind):
    status = rules.rule_status(prim)[kind]
    assert status != "missing", (
        f"primitive '{prim.name}' has no {kind} rule and none is recorded as unsupported. "
        f"Register one in fshard/primitives/{rules.family_of(prim)}.py, or call "
        f"rules.unsupported({prim.name}_p, '{kind}', reason=...).")


@pytest.mark.parametrize("prim", PRIMS, ids=lambda p: p.name)
def test_unsupported_rules_give_a_reason(prim):
    for kind, status in rules.rule_status(prim).items():
        if status.startswith("unsupported"):
            assert len(status) > len("unsupported: ") + 3, f"{prim.name} {kind}: empty reason"


@pytest.mark.parametrize("spec", SPECS.values(), ids=list(SPECS))
def test_linear_groups_match_transpose_rules(spec):
    prim = spec.prim
    has_rule = prim in rules.transpose
    assert bool(spec.linear_groups) == has_rule, (
        f"{prim.name}: the spec's linear_groups={spec.linear_groups} but the registry "
        f"{'has' if has_rule else 'has no'} transpose rule")
