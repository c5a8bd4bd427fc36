"""Collectives (fshard/primitives/collectives.py) on virtual meshes, against NumPy.

Every collective runs under nested ``fs.vmap``s with axis names (one per mesh axis,
the way a virtual mesh runs them), eagerly and under ``fs.jit``, on 1-D and 2-D
meshes with the axis names in both orders, and is compared with a NumPy reference
that sees every device's value. Derivatives: JVPs against finite differences and
every linear collective's transpose by the dot-product test, both taken per device
(inside the vmap). Lowering: the collectives one rank emits, checked on the
generated source for every rank of a 2x2 mesh (same sequence on every rank), and
the per-backend choice of native ops. Multi-process runs are in
tests/distributed/test_collectives_multiprocess.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import fshard as fs
from fshard.primitives import collectives as C

RNG = np.random.default_rng(0)

# ---------------------------------------------------------------------------
# NumPy references: X holds every device's value, stacked along the mapped axis
# ---------------------------------------------------------------------------


def _np_all_to_all(X, s, c, tiled):
    n = X.shape[0]
    if tiled:
        return np.stack([np.concatenate([np.split(X[j], n, axis=s)[i] for j in range(n)],
                                        axis=c) for i in range(n)])
    return np.stack([np.stack([np.take(X[j], i, axis=s) for j in range(n)], axis=c)
                     for i in range(n)])


def _np_ppermute(X, perm):
    Y = np.zeros_like(X)
    for s, t in perm:
        Y[t] = X[s]
    return Y


def _np_psum_scatter(X, k, tiled):
    n, total = X.shape[0], X.sum(0)
    if tiled:
        return np.stack(np.split(total, n, axis=k))
    return np.stack([np.take(total, i, axis=k) for i in range(n)])


def _np_all_gather(X, k, tiled):
    n = X.shape[0]
    g = np.concatenate(list(X), axis=k) if tiled else np.stack(list(X), axis=k)
    return np.stack([g] * n)


def _bcast(v, n):
    return np.stack([v] * n)


# name -> (fshard function of one device's value, reference over stacked values,
#          local input shape). `names` is the tuple of axis names it communicates over.
def cases(names):
    return {
        "psum": (lambda x: fs.psum(x, names), lambda X: _bcast(X.sum(0), len(X)), (4, 6)),
        "pmean": (lambda x: fs.pmean(x, names), lambda X: _bcast(X.mean(0), len(X)), (4, 6)),
        "pmax": (lambda x: fs.pmax(x, names), lambda X: _bcast(X.max(0), len(X)), (4, 6)),
        "pmin": (lambda x: fs.pmin(x, names), lambda X: _bcast(X.min(0), len(X)), (4, 6)),
        "all_gather": (lambda x: fs.all_gather(x, names, axis=1),
                       lambda X: _np_all_gather(X, 1, False), (4, 6)),
        "all_gather_tiled": (lambda x: fs.all_gather(x, names, axis=1, tiled=True),
                             lambda X: _np_all_gather(X, 1, True), (4, 6)),
        "psum_scatter_tiled": (lambda x: fs.psum_scatter(x, names, scatter_dimension=1,
                                                         tiled=True),
                               lambda X: _np_psum_scatter(X, 1, True), (2, 12)),
        "psum_scatter": (lambda x: fs.psum_scatter(x, names, scatter_dimension=0),
                         lambda X: _np_psum_scatter(X, 0, False), None),
        "all_to_all_tiled": (lambda x: fs.all_to_all(x, names, 1, 0, tiled=True),
                             lambda X: _np_all_to_all(X, 1, 0, True), (2, 12)),
        "all_to_all": (lambda x: fs.all_to_all(x, names, 0, 1),
                       lambda X: _np_all_to_all(X, 0, 1, False), None),
        "ppermute_shift": (lambda x: fs.ppermute(x, names, _shift(names)),
                           lambda X: _np_ppermute(X, _shift(names)), (4, 6)),
        "ppermute_partial": (lambda x: fs.ppermute(x, names, [(0, 1)]),
                             lambda X: _np_ppermute(X, [(0, 1)]), (4, 6)),
        "broadcast": (lambda x: fs.broadcast(x, names, root=1),
                      lambda X: _bcast(X[1], len(X)), (4, 6)),
        "axis_index": (lambda x: x * fs.axis_index(names).astype(x.dtype),
                       lambda X: X * np.arange(len(X)).reshape((-1,) + (1,) * (X.ndim - 1)),
                       (4, 6)),
    }


MESHES = {"1d": ((3,), ("i",)), "2d": ((2, 3), ("a", "b"))}
_sizes: dict = {}


def _shift(names):
    n = int(np.prod([_sizes[k] for k in names]))
    return [(i, (i + 1) % n) for i in range(n)]


def run_mesh(f, X, mesh_names, jit=False):
    """``f`` on every device of a virtual mesh: one fs.vmap per axis (outer first)."""
    for name in reversed(mesh_names):
        f = fs.vmap(f, axis_name=name)
    if jit:
        f = fs.jit(f)
    return f(X).asnumpy()


def reference(ref, X, mesh_shape, mesh_names, names):
    """``ref`` applied per group of devices that communicate over ``names``."""
    nd = len(mesh_shape)
    axes = [mesh_names.index(n) for n in names]
    rest = [i for i in range(nd) if i not in axes]
    Xp = np.transpose(X, rest + axes + list(range(nd, X.ndim)))
    n_rest = int(np.prod([mesh_shape[i] for i in rest]))
    n = int(np.prod([mesh_shape[i] for i in axes]))
    flat = Xp.reshape((n_rest, n) + X.shape[nd:])
    out = np.stack([ref(g) for g in flat])
    out = out.reshape([mesh_shape[i] for i in rest] + [mesh_shape[i] for i in axes]
                      + list(out.shape[2:]))
    return np.transpose(out, list(np.argsort(rest + axes)) + list(range(nd, out.ndim)))


def collective_cases():
    out = []
    for mesh, (shape, mesh_names) in MESHES.items():
        name_sets = [(mesh_names[0],)] if len(mesh_names) == 1 else [
            ("a",), ("b",), ("a", "b"), ("b", "a")]
        for names in name_sets:
            # compiled too where the lowering differs: one axis, and two in reverse order
            modes = [False, True] if names in (("i",), ("b", "a")) else [False]
            for case in cases(names):
                for jit in modes:
                    out.append(pytest.param(mesh, names, case, jit, id=f"{mesh}-{'+'.join(names)}"
                                            f"-{case}-{'jit' if jit else 'eager'}"))
    return out


@pytest.mark.parametrize("mesh,names,case,jit", collective_cases())
def test_collective_matches_numpy(mesh, names, case, jit):
    shape, mesh_names = MESHES[mesh]
    _sizes.clear()
    _sizes.update(zip(mesh_names, shape))
    f, ref, local = cases(names)[case]
    n = int(np.prod([_sizes[k] for k in names]))
    if local is None:  # the untiled forms need one entry per device
        local = (n, 5) if case == "psum_scatter" else (n, 4)
    X = RNG.standard_normal(tuple(shape) + tuple(local)).astype(np.float32)
    expected = reference(ref, X, shape, mesh_names, names)
    actual = run_mesh(f, X, mesh_names, jit=jit)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_unbatched_operands():
    """A value that is the same on every device (in_axes=None) takes the short paths."""
    x = RNG.standard_normal((3, 2)).astype(np.float32)
    f = fs.vmap(lambda v: (fs.psum(v, "i"), fs.all_gather(v, "i"), fs.pmax(v, "i"),
                           fs.ppermute(v, "i", [(0, 1), (1, 2), (2, 0)]),
                           fs.psum_scatter(v, "i", tiled=True)),
                in_axes=None, axis_size=3, axis_name="i")
    s, g, m, p, ps = (o.asnumpy() for o in f(x))
    np.testing.assert_allclose(s, np.stack([3 * x] * 3), rtol=1e-6)
    np.testing.assert_allclose(g, np.stack([np.stack([x] * 3)] * 3))
    np.testing.assert_allclose(m, np.stack([x] * 3))
    np.testing.assert_allclose(p, np.stack([x] * 3))
    np.testing.assert_allclose(ps, 3 * x.reshape(3, 1, 2), rtol=1e-6)


def test_pytrees_and_python_scalars():
    x = np.arange(3, dtype=np.float32)
    out = fs.vmap(lambda v: fs.psum({"a": v, "b": (v * 2,)}, "i"), axis_name="i")(x)
    assert out["a"].asnumpy().tolist() == [3.0] * 3
    assert out["b"][0].asnumpy().tolist() == [6.0] * 3
    size = fs.vmap(lambda v: v * 0 + fs.psum(1, "i"), axis_name="i")(x)
    assert size.asnumpy().tolist() == [3.0] * 3


def test_collective_over_an_outer_vmap_axis_inside_an_inner_one():
    """Inside vmap 'b', a gather over 'a' passes through to the outer interpreter."""
    X = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    out = run_mesh(lambda v: fs.all_gather(v, "a"), X, ("a", "b"))
    expected = np.stack([np.stack([X[:, j] for j in range(3)])] * 2)   # out[a, b] = X[:, b]
    np.testing.assert_allclose(out, expected)


# ---------------------------------------------------------------------------
# Derivatives, per device
# ---------------------------------------------------------------------------

LINEAR = ["psum", "pmean", "all_gather", "all_gather_tiled", "psum_scatter_tiled",
          "psum_scatter", "all_to_all_tiled", "all_to_all", "ppermute_shift",
          "ppermute_partial", "broadcast"]


def _local_shape(case, n):
    local = cases(("i",))[case][2]
    if local is None:
        local = (n, 5) if case == "psum_scatter" else (n, 4)
    return local


@pytest.mark.parametrize("names", [("i",), ("a", "b"), ("b", "a")], ids="+".join)
@pytest.mark.parametrize("case", LINEAR)
def test_transpose_dot_product(case, names):
    """<ct, L t> == <L^T ct, t> summed over all devices, L^T from fs.vjp per device."""
    mesh_names = ("i",) if names == ("i",) else ("a", "b")
    shape = (3,) if names == ("i",) else (2, 3)
    _sizes.clear()
    _sizes.update(zip(mesh_names, shape))
    f = cases(names)[case][0]
    n = int(np.prod(shape))
    T = RNG.standard_normal(shape + _local_shape(case, n))
    L_t = run_mesh(f, T, mesh_names)
    CT = RNG.standard_normal(L_t.shape)

    def transposed(t, ct):
        return fs.vjp(f, t)[1](ct)[0]

    g = transposed
    for name in reversed(mesh_names):
        g = fs.vmap(g, axis_name=name)
    Lt_ct = g(T, CT).asnumpy()
    np.testing.assert_allclose(np.vdot(CT, L_t), np.vdot(Lt_ct, T), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", ["psum", "all_gather_tiled", "psum_scatter_tiled",
                                  "all_to_all_tiled", "ppermute_partial", "broadcast", "pmax",
                                  "pmin"])
def test_jvp_matches_finite_differences(case):
    _sizes.clear()
    _sizes.update(i=3)
    if case in ("pmax", "pmin"):
        f = fs.pmax if case == "pmax" else fs.pmin
        fn = lambda v: f(v, "i")  # noqa: E731
        local = (4, 6)
    else:
        fn = cases(("i",))[case][0]
        local = _local_shape(case, 3)
    X = RNG.standard_normal((3,) + local)
    T = RNG.standard_normal(X.shape)
    jvp = fs.vmap(lambda x, t: fs.jvp(fn, (x,), (t,)), axis_name="i")
    out, tangent = (o.asnumpy() for o in jvp(X, T))
    plain = fs.vmap(fn, axis_name="i")
    eps = 1e-6
    numeric = (plain(X + eps * T).asnumpy() - plain(X - eps * T).asnumpy()) / (2 * eps)
    np.testing.assert_allclose(out, plain(X).asnumpy())
    np.testing.assert_allclose(tangent, numeric, rtol=1e-6, atol=1e-6)


def test_grad_of_psum_inside_vmap_is_the_true_transpose():
    """As in JAX: jax.vmap(jax.grad(lambda x: psum(x, 'i')), axis_name='i') gives n."""
    g = fs.vmap(fs.grad(lambda x: fs.psum(x, "i")), axis_name="i")(np.ones(3, np.float32))
    assert g.asnumpy().tolist() == [3.0, 3.0, 3.0]


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_unbound_axis_eagerly():
    with pytest.raises(fs.AxisNameError) as e:
        fs.psum(np.ones(3, np.float32), "dp")
    msg = str(e.value)
    assert "fs.psum names the axis 'dp'" in msg and "bound axes: none" in msg
    assert "fs.shard_map" in msg and "axis_name='dp'" in msg


def test_unbound_axis_lists_the_bound_ones():
    with pytest.raises(fs.AxisNameError, match=r"bound axes: 'i' \(size 2\)"):
        fs.vmap(lambda x: fs.pmax(x, "j"), axis_name="i")(np.ones(2, np.float32))
    with pytest.raises(fs.AxisNameError, match=r"fs.all_gather names the axis 'j'"):
        fs.vmap(lambda x: fs.all_gather(x, "j"), axis_name="i")(np.ones(2, np.float32))


def test_unbound_axis_under_jit():
    with pytest.raises(fs.AxisNameError, match="outside any fs.shard_map"):
        fs.jit(lambda x: fs.psum(x, "dp"))(np.ones(3, np.float32))


@pytest.mark.parametrize("bad", [None, (), ("a", "a"), ["a", ["b"]]])
def test_bad_axis_name(bad):
    with pytest.raises(fs.ArgumentError, match="axis_name must be a mesh axis name"):
        fs.vmap(lambda x: fs.psum(x, bad), axis_name="a")(np.ones(2, np.float32))


@pytest.mark.parametrize("perm,match", [([(0, 3)], "outside"), ([(0, 1), (0, 2)], "more than once"),
                                        (["ab"], "pairs")])
def test_bad_perm(perm, match):
    with pytest.raises(fs.ArgumentError, match=match):
        fs.vmap(lambda x: fs.ppermute(x, "i", perm), axis_name="i")(np.ones(3, np.float32))


def test_shape_errors():
    x = np.ones((3, 4), np.float32)
    with pytest.raises(fs.ShapeError, match="divisible by 3"):
        fs.vmap(lambda v: fs.psum_scatter(v, "i", tiled=True), axis_name="i")(
            np.ones((3, 4), np.float32))
    with pytest.raises(fs.ShapeError, match="to have size 3, got 4"):
        fs.vmap(lambda v: fs.psum_scatter(v, "i"), axis_name="i")(np.ones((3, 4), np.float32))
    with pytest.raises(fs.ShapeError, match="split_axis 0 .* to have size 3"):
        fs.vmap(lambda v: fs.all_to_all(v, "i", 0, 0), axis_name="i")(np.ones((3, 4), np.float32))
    with pytest.raises(fs.ArgumentError, match="axis=2 is not an axis"):
        fs.vmap(lambda v: fs.all_gather(v, "i", axis=2, tiled=True), axis_name="i")(x)
    with pytest.raises(fs.ArgumentError, match="floating-point"):
        fs.vmap(lambda v: fs.pmean(v, "i"), axis_name="i")(np.ones(3, np.int32))
    with pytest.raises(fs.ArgumentError, match="root=3"):
        fs.vmap(lambda v: fs.broadcast(v, "i", root=3), axis_name="i")(np.ones(3, np.float32))


def test_every_collective_has_all_rules():
    for prim in C.NAMED_AXIS_PRIMITIVES + (C.replica_sum_p, C.replica_split_p, C.shard_in_p,
                                 C.shard_out_p):
        status = fs.rules.rule_status(prim)
        missing = [k for k, v in status.items() if v == "missing"]
        assert not missing, f"{prim}: {missing}"


# ---------------------------------------------------------------------------
# Lowering: one rank's graph
# ---------------------------------------------------------------------------

_COLLECTIVE_CALL = re.compile(r"\b(AllReduce|AllGather|Broadcast|ReduceScatter)_\d+\(")


@pytest.fixture
def fake_job(monkeypatch):
    """This process poses as rank ``job.rank`` of a 4-process job (lowering only:
    groups are named, not created)."""
    from fshard import distributed

    class Job:
        rank = 0

    monkeypatch.setattr(distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed, "world_size", lambda: 4)
    monkeypatch.setattr(distributed, "rank", lambda: Job.rank)
    monkeypatch.setattr(distributed, "group_for", distributed.group_name)
    return Job


def _lowered_by_rank(job, f, in_strategy, out_strategy, x, mesh_shape=(2, 2),
                     names=("a", "b")):
    sources = []
    for r in range(4):
        job.rank = r
        mesh = fs.Mesh(mesh_shape, names)
        assert not mesh.is_virtual
        sm = fs.shard_map(f, in_strategy, out_strategy, mesh=mesh, check_vma=False)
        sources.append(fs.jit(sm).lower(x).source)
    return sources


def _many(v):
    """Independent collectives of a value that varies over both axes: only the
    lowering orders them."""
    return (fs.psum(v, "a"), fs.all_gather(v, "b", axis=1, tiled=True), fs.pmax(v, ("a", "b")),
            fs.ppermute(v, "a", [(0, 1)]), fs.broadcast(v, "b", root=1),
            fs.all_to_all(v, ("b", "a"), 1, 0, tiled=True),
            fs.psum_scatter(v, "b", scatter_dimension=1, tiled=True))


def test_every_rank_issues_the_same_collectives(fake_job):
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    both = fs.Layout((2, 2), ("a", "b"))("a", "b")
    sources = _lowered_by_rank(fake_job, _many, (both,), None, x)
    sequences = [_COLLECTIVE_CALL.findall(s) for s in sources]
    assert len(sequences[0]) == 7
    assert all(seq == sequences[0] for seq in sequences), sequences
    # ranks differ only in baked-in constants: the same code once numbers are masked
    masked = [re.sub(r"\d+|True|False", "#", s) for s in sources]
    assert all(m == masked[0] for m in masked)
    # each collective waits for the previous one (a fixed order on every rank)
    assert sources[0].count("ms_after") >= len(sequences[0]) - 1


def test_emulations_and_groups_on_cpu(fake_job):
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    f = lambda v: fs.all_gather(fs.psum_scatter(v, "b", tiled=True), "b", tiled=True)  # noqa
    src = _lowered_by_rank(fake_job, f, (None,), None, x)[3]
    # reduce-scatter = AllReduce + this rank's slice; sub-group gather = slot + AllReduce
    assert "ReduceScatter" not in src and "AllGather" not in src
    assert src.count("AllReduce_") == 2 and "ms_slot" in src and "ms_slice" in src
    text = [fs.jit(fs.shard_map(f, (None,), None, mesh=fs.Mesh((2, 2), ("a", "b")),
                                check_vma=False)).lower(x).as_text()]
    assert "group=fshard_2_3" in text[0]      # rank 3's row of the 2x2 mesh


def test_replicated_operands_need_no_communication(fake_job):
    """In a job, the VMA pass keeps reductions of replicated values local."""
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    f = lambda v: (fs.psum(v, "a"), fs.pmean(v, ("a", "b")), fs.pmax(v, "b"))  # noqa: E731
    src = _lowered_by_rank(fake_job, f, (None,), None, x)[0]
    assert not _COLLECTIVE_CALL.findall(src)


def test_native_ops_where_the_backend_has_them(fake_job, monkeypatch):
    from fshard.backend import collectives as backend_collectives

    monkeypatch.setattr(backend_collectives, "device_target", lambda: "GPU")
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    f = lambda v: fs.pmax(fs.psum_scatter(v, ("a", "b"), tiled=True), "b")  # noqa: E731
    src = _lowered_by_rank(fake_job, f, (None,), None, x)[0]
    assert "ReduceScatter_" in src and "AllReduce_" in src and "ms_reduce_max0" not in src
    text = fs.jit(fs.shard_map(f, (None,), None, mesh=fs.Mesh((2, 2), ("a", "b")),
                               check_vma=False)).lower(x).as_text()
    assert "op=max" in text
