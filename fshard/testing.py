"""Test helpers for people who add primitives or shard functions (NB: ``jax.test_util``,
``autograd.test_util``).

Sharding checks:

- ``check_sharding(fn, args, in_strategy, mesh=N)``: ``fs.shard(fn, ...)`` on a
  virtual mesh of N devices returns what ``fn`` returns unsharded.
- ``check_sharding_rule(prim, args, params, mesh=N)``: the primitive's sharding rule
  against ground truth, without the partitioner. Every layout the rule *claims*
  (each candidate of its ``FactorSpec``, and each pending sum it lets pass through
  a linear operand, fed uneven random shares per device) is run device by device on
  the local blocks and each device's result is compared with its block of the
  unsharded result (a pending sum is summed over its devices first): a mismatch is
  a **wrong** rule. Then every valid layout of the operands that the rule does not
  claim is run the same way; if the per-device results form *some* layout of the
  right answer (confirmed on fresh operands), the layout is **unclaimed**: the rule
  would force a redistribution that was not needed.
- ``all_shardings(aval, mesh)``: every way to split a value over a mesh (the layouts
  the checks enumerate); ``sharding_to_layout`` turns one into a ``Layout`` view that
  ``fs.shard`` accepts.

Use data without coincidences (random floats, not ``ones``; indices that differ):
a sum of per-device maxima must not equal the maximum by accident. The checks run
one primitive per device eagerly; ``mindspore.set_context(pynative_synchronize=True)``
makes that about ten times faster (each result conversion otherwise waits ~2 ms
for MindSpore's asynchronous queue).

>>> import numpy as np
>>> from fshard.primitives.elementwise import add_p
>>> x = np.random.default_rng(0).normal(size=(4, 2)).astype(np.float32)
>>> report = check_sharding_rule(add_p, (x, x + 1), {}, mesh=4)
>>> report.wrong, report.unclaimed
([], [])
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from fshard.core import dtypes, rules
from fshard.core.tracing import ArrayType, Primitive, typeof
from fshard.sharding.layouts import ShardMesh, Sharding, candidate_shardings, candidates

__all__ = [
    "all_shardings",
    "sharding_to_layout",
    "shard_mesh",
    "check_sharding",
    "check_sharding_rule",
    "assert_rule_ok",
    "RuleReport",
    "assert_close",
]


# ---------------------------------------------------------------------------
# Meshes and layouts
# ---------------------------------------------------------------------------


def shard_mesh(mesh) -> ShardMesh:
    """The mesh of prime-sized axes ``fs.shard`` partitions over, for a device count or
    an ``fs.Mesh``.

    >>> shard_mesh(8).sizes
    (2, 2, 2)
    """
    n = mesh if isinstance(mesh, int) else mesh.size
    return ShardMesh.for_devices(n)


def all_shardings(aval: ArrayType, mesh, *, orders: bool = True) -> list[Sharding]:
    """Every sharding of a value of type ``aval`` whose split counts divide its dims:
    each mesh axis splits one dimension or none, replicated first. With ``orders``,
    a dimension split over several axes appears once per order of those axes (major
    first), as a ``Layout`` view can request.

    >>> [s.spec(shard_mesh(4)) for s in all_shardings(ArrayType((2, 3), dtypes.float32), 4)]
    ['(-, -)', '(m0, -)', '(m1, -)']
    """
    mesh = mesh if isinstance(mesh, ShardMesh) else shard_mesh(mesh)
    out = []
    for choice in itertools.product([None] + list(range(aval.ndim)), repeat=len(mesh.sizes)):
        per_dim = [[a for a, d in enumerate(choice) if d == i] for i in range(aval.ndim)]
        if not all(isinstance(n, int) and n % mesh.count(ax) == 0
                   for n, ax in zip(aval.shape, per_dim)):
            continue
        perms = [itertools.permutations(ax) if orders else [tuple(ax)] for ax in per_dim]
        for dims in itertools.product(*perms):
            out.append(Sharding(tuple(tuple(d) for d in dims)))
    return sorted(out, key=lambda s: (len(s.used), s.dims))


def sharding_to_layout(sh: Sharding, mesh):
    """A ``Layout`` view with one alias per prime mesh axis (``m0``, ``m1``, ...) that
    ``fs.shard``'s ``in_strategy``/``out_strategy`` read as exactly ``sh``.

    >>> sharding_to_layout(Sharding(((1, 0), ())), 4)
    Layout((2, 2), ('m0', 'm1'))(('m1', 'm0'), 'None')
    """
    mesh = mesh if isinstance(mesh, ShardMesh) else shard_mesh(mesh)
    assert not sh.partial, "a pending sum cannot be requested as a layout"
    return sh.to_layout(mesh)


# ---------------------------------------------------------------------------
# Blocks: which part of a global array each device holds
# ---------------------------------------------------------------------------


def _block_slices(shape, sh: Sharding, mesh: ShardMesh, rank: int) -> tuple:
    coords = mesh.coords(rank)
    out = []
    for n, axes in zip(shape, sh.dims):
        k = mesh.count(axes)
        index = 0
        for a in axes:  # major first
            index = index * mesh.sizes[a] + coords[a]
        b = n // k
        out.append(slice(index * b, (index + 1) * b))
    return tuple(out)


def _block_key(sh: Sharding, mesh: ShardMesh, rank: int) -> tuple:
    coords = mesh.coords(rank)
    return tuple(tuple(coords[a] for a in axes) for axes in sh.dims)


def _to_np(x) -> np.ndarray:
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def assert_close(actual, desired, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """``numpy.testing.assert_allclose`` with ``atol`` scaled by the largest magnitude
    of ``desired`` (at least 1): float32 results of order 50 differ from a reference
    by more than 1e-5 on some CPUs while being as exact as float32 allows there.

    >>> assert_close(np.float32(50.00001), 50.0)
    """
    a, d = _to_np(actual), _to_np(desired)
    finite = np.abs(d[np.isfinite(d)]) if d.dtype.kind in "fc" else np.abs(d)
    scale = max(1.0, float(finite.max())) if finite.size else 1.0
    np.testing.assert_allclose(a, d, rtol=rtol, atol=atol * scale)


def _close(a, b, rtol, atol) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype.kind in "fc" or b.dtype.kind in "fc":
        return bool(np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=rtol,
                                atol=atol, equal_nan=True))
    return bool(np.array_equal(a, b))


def _matches(ref: np.ndarray, locals_: list, sh: Sharding, mesh: ShardMesh, rtol, atol) -> bool:
    """Whether per-device values ``locals_`` (indexed by rank) hold ``ref`` in layout
    ``sh``: each device its block, summed over the pending-sum axes first."""
    if sh.partial and ref.dtype == np.bool_:
        return False  # booleans do not add up: a pending sum of them is never right
    partial = sorted(sh.partial)
    others = [a for a in range(len(mesh.sizes)) if a not in partial]
    groups: dict = {}
    for r in range(mesh.size):
        c = mesh.coords(r)
        groups.setdefault(tuple(c[a] for a in others), []).append(r)
    for ranks in groups.values():
        vals = [locals_[r] for r in ranks]
        if any(v.shape != vals[0].shape for v in vals):
            return False
        total = vals[0] if len(vals) == 1 else np.sum(np.stack(vals), axis=0).astype(
            vals[0].dtype)
        if not _close(total, ref[_block_slices(ref.shape, sh, mesh, ranks[0])], rtol, atol):
            return False
    return True


def _out_layouts(shape, local_shape, mesh: ShardMesh, *, partial_ok: bool) -> list[Sharding]:
    """Every sharding of a global ``shape`` whose blocks have ``local_shape``, with
    every pending-sum set over the axes the dims leave free (if ``partial_ok``)."""
    if len(shape) != len(local_shape):
        return []
    counts = []
    for n, m in zip(shape, local_shape):
        if m == 0 or n % m:
            if n == m:
                counts.append(1)
                continue
            return []
        counts.append(n // m)
    out = []
    aval = ArrayType(tuple(shape), dtypes.float32)
    for sh in all_shardings(aval, mesh):
        if sh.strategy(mesh) != tuple(counts):
            continue
        free = [a for a in range(len(mesh.sizes)) if a not in sh.used]
        subsets = [()]
        if partial_ok:
            subsets = [c for r in range(len(free) + 1) for c in itertools.combinations(free, r)]
        out.extend(Sharding(sh.dims, frozenset(p)) for p in subsets)
    return out


# ---------------------------------------------------------------------------
# Running one primitive device by device
# ---------------------------------------------------------------------------


@dataclass
class _Slot:
    """Operand ``i`` of the equation, as a placeholder a ``partition_call`` rearranges."""

    i: int


@dataclass
class _Arranged:
    """Per-device parameters of a primitive with bodies, and its operands: slots of
    the original operands and the constants of its partitioned bodies."""

    params: dict
    operands: list

    def arrange(self, values: list) -> list:
        return [values[o.i] if isinstance(o, _Slot) else _to_np(o) for o in self.operands]


def _local_params(spec, params, in_avals, in_sh, out_avals, out_sh, mesh):
    if spec.partition_call is not None:  # a loop or cond: its bodies partitioned
        from fshard.core.ir import Program
        from fshard.sharding.partition import partition
        from fshard.sharding.propagation import propagate

        def sub(body, ins, outs):
            part = partition(propagate(body, ins, outs, mesh))
            pd = part.program
            return Program(pd.inputs, pd.equations, pd.outputs), list(part.consts)

        slots = [_Slot(i) for i in range(len(in_avals))]
        operands, p = spec.partition_call(slots, params, in_sh, out_sh, sub)
        return _Arranged(p, operands)
    if spec.local_params is None:
        return params
    local_in = [ArrayType(s.local_shape(a.shape, mesh), a.dtype) for a, s in zip(in_avals, in_sh)]
    local_out = [ArrayType(s.local_shape(a.shape, mesh), a.dtype)
                 for a, s in zip(out_avals, out_sh)]
    return spec.local_params(params, local_in, local_out)


def _local_values(args, in_sh, mesh: ShardMesh, rng):
    """Each device's operands for layouts ``in_sh``: its blocks, and for a pending sum
    over axes P a random share per device (the shares of the devices that differ only
    along P add up to the block; uneven, so that a coincidence cannot pass).

    Returns ``(per-rank operand lists, per-rank keys)``; equal keys, equal operands."""
    per_rank = [[None] * len(args) for _ in range(mesh.size)]
    keys = [[] for _ in range(mesh.size)]
    for i, (x, s) in enumerate(zip(args, in_sh)):
        for r in range(mesh.size):
            per_rank[r][i] = np.array(x[_block_slices(x.shape, s, mesh, r)])
            keys[r].append(_block_key(s, mesh, r) if not s.partial else r)
        if not s.partial:
            continue
        others = [a for a in range(len(mesh.sizes)) if a not in s.partial]
        groups: dict = {}
        for r in range(mesh.size):
            c = mesh.coords(r)
            groups.setdefault(tuple(c[a] for a in others), []).append(r)
        for ranks in groups.values():
            block = per_rank[ranks[0]][i]
            rest = block.copy()
            for r in ranks[:-1]:
                share = (rng.normal(size=block.shape) * 2.0) if x.dtype.kind in "fc" else \
                    rng.integers(-3, 4, size=block.shape)
                share = np.asarray(share, x.dtype)
                per_rank[r][i] = share
                rest = np.asarray(rest - share, x.dtype)
            per_rank[ranks[-1]][i] = rest
    return per_rank, [tuple(k) for k in keys]


def _run_per_device(prim, args, in_sh, params, mesh, rng=None):
    """Each device's outputs (rank -> list of arrays), running ``prim`` eagerly on its
    local operands; devices holding the same operands share one run."""
    impl = rules.impl.lookup(prim, transform="check_sharding_rule")
    type_rule = rules.abstract_eval.lookup(prim, transform="check_sharding_rule")
    local = [ArrayType(s.local_shape(x.shape, mesh), typeof(x).dtype)
             for x, s in zip(args, in_sh)]
    per_rank, keys = _local_values(args, in_sh, mesh, rng or np.random.default_rng(0))
    if isinstance(params, _Arranged):
        local = params.arrange(local)
        local = [a if isinstance(a, ArrayType) else typeof(a) for a in local]
        per_rank = [params.arrange(vals) for vals in per_rank]
        params = params.params
    # The type rule refuses mismatched blocks before MindSpore sees them (its eager
    # errors can surface at a later, unrelated call).
    out_types = type_rule(*local, **params)
    cache: dict = {}
    for r, key in enumerate(keys):
        if key not in cache:
            cache[key] = impl(*per_rank[r], **params)
    # Convert after launching every run: each conversion waits for MindSpore's queue.
    cache = {k: [_to_np(o) for o in outs] for k, outs in cache.items()}
    for outs in cache.values():
        assert [o.shape for o in outs] == [tuple(t.shape) for t in out_types], \
            f"{prim.name}: local outputs {[o.shape for o in outs]}, type rule {out_types}"
    return [cache[k] for k in keys]


@dataclass
class RuleReport:
    """What ``check_sharding_rule`` found for one primitive application on one mesh.

    ``wrong``: layouts the rule claims whose per-device results are not the right
    blocks. ``unclaimed``: operand layouts the rule does not claim although running
    the primitive on the local blocks gives a layout of the right result.
    ``candidates`` and ``layouts`` count what was checked.
    """

    name: str
    mesh: ShardMesh
    candidates: int = 0
    layouts: int = 0
    wrong: list = field(default_factory=list)
    unclaimed: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{self.name} on {self.mesh.size} devices: {self.candidates} claimed "
                 f"layouts, {self.layouts} unclaimed operand layouts checked"]
        lines += [f"  WRONG: {w}" for w in self.wrong]
        lines += [f"  UNCLAIMED: {u}" for u in self.unclaimed]
        return "\n".join(lines)


def _describe(shs, mesh) -> str:
    return "[" + ", ".join(s.spec(mesh) for s in shs) + "]"


def check_sharding_rule(prim: Primitive | str, args, params=None, mesh=2, *,
                        max_candidates: int | None = None, max_layouts: int | None = 64,
                        seed: int = 0, rtol: float = 1e-5, atol: float = 1e-5) -> RuleReport:
    """Check ``prim``'s sharding rule on operands ``args`` against ground truth.

    Every candidate of the rule's ``FactorSpec`` (and every pending sum it lets pass
    through a linear operand group) is run device by device on its local blocks (with
    the rule's per-device parameters) and compared with the blocks of the unsharded
    result; then the operand layouts the rule does not claim are run the same way to
    find valid layouts the rule misses. ``max_candidates`` / ``max_layouts`` bound
    both by a deterministic sample (``None``: all). Returns a ``RuleReport``: pass it
    to ``assert_rule_ok``, or read ``report.wrong`` and ``report.unclaimed``.

    >>> import numpy as np
    >>> from fshard.primitives.reductions import reduce_sum_p
    >>> x = np.random.default_rng(0).normal(size=(4, 2)).astype(np.float32)
    >>> report = check_sharding_rule(reduce_sum_p, (x,), {"axes": (0,)}, mesh=4)
    >>> print(report)
    reduce_sum on 4 devices: 16 claimed layouts, 0 unclaimed operand layouts checked
    """
    if isinstance(prim, str):
        prim = next(p for p in rules.all_primitives() if p.name == prim)
    params = dict(params or {})
    mesh = mesh if isinstance(mesh, ShardMesh) else shard_mesh(mesh)
    args = [np.asarray(_to_np(a)) for a in args]
    in_avals = [typeof(a) for a in args]
    rule = rules.sharding.lookup(prim, transform="check_sharding_rule")
    spec = rule(*in_avals, **params)
    impl = rules.impl.lookup(prim, transform="check_sharding_rule")
    refs = [_to_np(o) for o in impl(*args, **params)]
    out_avals = [ArrayType(r.shape, dtypes.from_numpy(r.dtype)) for r in refs]
    report = RuleReport(prim.name, mesh)

    # (a) every claimed layout, and every pending sum it lets pass through
    claimed = set()
    rng = np.random.default_rng(seed)
    variants = []
    for cand in candidates(spec, mesh):
        claimed.add(tuple(candidate_shardings(spec, cand)[0]))
        variants += [cand] + _carried(prim, spec, cand, mesh)
    if max_candidates is not None and len(variants) > max_candidates:
        pick = rng.choice(len(variants), size=max_candidates, replace=False)
        variants = [variants[i] for i in sorted(pick)]
    for variant in variants:
        report.candidates += 1
        ins, outs = candidate_shardings(spec, variant)
        what = f"operands {_describe(ins, mesh)} -> outputs {_describe(outs, mesh)}"
        try:
            p = _local_params(spec, params, in_avals, ins, out_avals, outs, mesh)
            per_rank = _run_per_device(prim, args, ins, p, mesh, rng)
        except Exception as e:  # a claimed layout must run
            report.wrong.append(f"{what}: the per-device primitive failed: "
                                f"{type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        for j, (ref, out) in enumerate(zip(refs, outs)):
            if not _matches(ref, [o[j] for o in per_rank], out, mesh, rtol, atol):
                report.wrong.append(f"{what}: output {j} is not the claimed blocks")
                break

    # (b) operand layouts the rule does not claim
    combos = [c for c in itertools.product(*[all_shardings(a, mesh) for a in in_avals])
              if c not in claimed]
    if max_layouts is not None and len(combos) > max_layouts:
        rng = np.random.default_rng(seed)
        pick = sorted(rng.choice(len(combos), size=max_layouts, replace=False))
        combos = [combos[i] for i in pick]
    if any(r.size == 0 for r in refs):
        combos = []  # every layout of an empty result is right: nothing to learn
    for ins in combos:
        report.layouts += 1
        found = _valid_outputs(prim, spec, params, args, list(ins), in_avals, refs,
                               out_avals, mesh, rtol, atol)
        for trial in range(12 if found is not None else 0):
            # Confirm on fresh operands, so that a coincidence of the data (a sum of
            # two block maxima equal to the maximum) is not reported.
            fresh = [_redraw(a, rng, trial % 2) for a in args]
            fresh_refs = [_to_np(o) for o in impl(*fresh, **params)]
            found = _valid_outputs(prim, spec, params, fresh, list(ins), in_avals,
                                   fresh_refs, out_avals, mesh, rtol, atol)
            if found is None:
                break
        if found is not None:
            report.unclaimed.append(
                f"operands {_describe(ins, mesh)} -> outputs {_describe(found, mesh)} is "
                "valid but not claimed")
    return report


def _carried(prim, spec, cand, mesh: ShardMesh) -> list:
    """``cand`` with every pending sum the rule lets pass through its linear operand
    groups: each group, over each set of mesh axes the candidate leaves free."""
    from fshard.sharding.layouts import carry_variants
    from fshard.core.factors import linear_groups

    n = len(spec.inputs)
    free = [a for a in range(len(mesh.sizes)) if all(a not in ax for _, ax in cand.assign)]
    out = []
    for group in linear_groups(prim.name, spec, n):
        for r in range(1, len(free) + 1):
            for axes in itertools.combinations(free, r):
                p = frozenset(axes)
                partials = [p if i in group else frozenset() for i in range(n)]
                out.extend(v for v in carry_variants(spec, cand, prim.name, partials)
                           if tuple(v.carry_ops) == tuple(group))
    return out


def _redraw(x: np.ndarray, rng, few_values: bool) -> np.ndarray:
    """Fresh operand data of the same type: floats (continuous, or from a few values so
    that comparisons go both ways) and booleans at random, integers within the range
    of the given ones (so indices stay valid)."""
    if x.dtype.kind == "f":
        if few_values:
            return rng.integers(-1, 2, size=x.shape).astype(x.dtype)
        return rng.normal(size=x.shape).astype(x.dtype)
    if x.dtype.kind == "b":
        return rng.random(x.shape) < 0.5
    if x.size == 0:
        return x
    return rng.integers(x.min(), x.max() + 1, size=x.shape).astype(x.dtype)


def _valid_outputs(prim, spec, params, args, ins, in_avals, refs, out_avals, mesh, rtol,
                   atol):
    """Output layouts the per-device results form for operand layouts ``ins``, or None."""
    def partial_ok(a):
        return a.dtype != dtypes.bool_

    if spec.local_params is None:
        trials = [(params, None)]
    else:
        # Shape-carrying parameters depend on the output blocks: try each block shape.
        options = []
        for a in out_avals:
            by_shape: dict = {}
            for s in all_shardings(a, mesh, orders=False):
                by_shape.setdefault(s.local_shape(a.shape, mesh), s)
            options.append(list(by_shape.values()))
        trials = []
        for outs in itertools.product(*options):
            try:
                trials.append((_local_params(spec, params, in_avals, ins, out_avals, outs,
                                             mesh), outs))
            except Exception:
                continue
    for p, _ in trials:
        try:
            per_rank = _run_per_device(prim, args, ins, p, mesh)
        except Exception:
            continue
        found = []
        for j, (ref, a) in enumerate(zip(refs, out_avals)):
            vals = [o[j] for o in per_rank]
            hit = next((sh for sh in _out_layouts(a.shape, vals[0].shape, mesh,
                                                  partial_ok=partial_ok(a))
                        if _matches(ref, vals, sh, mesh, rtol, atol)), None)
            if hit is None:
                break
            found.append(hit)
        else:
            return found
    return None


def assert_rule_ok(report: RuleReport) -> None:
    """Raise AssertionError listing wrong and unclaimed layouts, if any."""
    if report.wrong or report.unclaimed:
        raise AssertionError(str(report))


# ---------------------------------------------------------------------------
# End to end: fs.shard against the unsharded function
# ---------------------------------------------------------------------------


def check_sharding(fn, args, in_strategy, mesh=2, out_strategy=None, *, level: int = 0,
                   rtol: float = 1e-5, atol: float = 1e-5):
    """Assert that ``fs.shard(fn, in_strategy, out_strategy, mesh=mesh)(*args)`` equals
    ``fn(*args)`` run unsharded. Strategy entries may be split-count tuples, ``Layout``
    views, ``None``, or ``Sharding`` objects (turned into views). Returns the
    ``Partitioned`` program (print it to see the per-device program).

    >>> import numpy as np
    >>> from mindspore import ops
    >>> x = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> part = check_sharding(lambda a: ops.exp(a) * 2, (x,), ((2, 1),), mesh=4)
    >>> part.collectives()
    ['all_gather']
    """
    import fshard as fs
    from fshard.core import tree

    from fshard.backend.mindspore import as_tensor

    smesh = shard_mesh(mesh)
    # NumPy operands become Tensors: the unsharded fn may call mindspore.ops directly.
    args = tuple(tree.map(lambda a: as_tensor(a) if isinstance(a, np.ndarray) else a, a)
                 for a in args)

    def convert(s):
        return sharding_to_layout(s, smesh) if isinstance(s, Sharding) else s

    in_strategy = tuple(convert(s) for s in in_strategy)
    if isinstance(out_strategy, (list, tuple)) and any(isinstance(s, Sharding)
                                                       for s in out_strategy):
        out_strategy = tuple(convert(s) for s in out_strategy)
    elif isinstance(out_strategy, Sharding):
        out_strategy = convert(out_strategy)
    sharded = fs.shard(fn, in_strategy=in_strategy, out_strategy=out_strategy, mesh=mesh,
                       level=level)
    got = tree.leaves(sharded(*args))
    want = tree.leaves(fn(*args))
    part = sharded.partitioned(*args)
    assert len(got) == len(want), f"shard returned {len(got)} arrays, unsharded {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = _to_np(g), _to_np(w)
        if not _close(g, w, rtol, atol):
            raise AssertionError(
                f"output {i} of fs.shard differs from the unsharded function "
                f"(in_strategy={in_strategy!r}, out_strategy={out_strategy!r}, "
                f"{smesh.size} devices):\nsharded:\n{g}\nunsharded:\n{w}\n{part}")
    return part
