"""MindSpore's sharding vocabulary: strategy tuples and ``Layout`` views, and which
rank holds which block of a tensor.

Two ways to say how a tensor is split over N devices, both MindSpore's:

- a *strategy* ``(4, 2)``: dim 0 in 4 parts, dim 1 in 2. When the product of the
  counts is less than N, the leftover factor N/prod ("repeated calculation") is
  appended as the LAST, fastest-varying device-matrix dimension, so neighbouring
  ranks hold the same block (``operator_info.h``: ``repeated_num_in_dev_matrix_right_``).
- a ``Layout`` view ``Layout((2, 2, 2), ("dp", "sp", "mp"))("dp", ("sp", "mp"))``:
  a device matrix with named axes and, per tensor dim, the axes that split it
  (first alias most significant), ``"None"`` for unsplit.

Ranks are row-major over the device matrix (last axis fastest), through
``rank_list`` when one is given. This module is pure Python + NumPy.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np

from fshard.errors import ShardingError

__all__ = [
    "Layout",
    "Spec",
    "check_strategy",
    "strategy_to_layout",
    "as_layout",
    "check_shape",
    "block_index",
    "shard_slices",
    "block_owners",
    "replica_groups",
    "einsum_layouts",
    "REPEAT_AXIS",
]

#: Alias of the repeated-calculation axis in layouts built from strategies.
REPEAT_AXIS = "repeat"
_INTERLEAVED = "interleaved_parallel"


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_axis_names(names, what: str, fix: str) -> tuple[str, ...]:
    """Validate axis names: unique non-empty strings, not "None" (MindSpore's "no axis")."""
    if isinstance(names, str):
        names = (names,)
    try:
        names = tuple(names)
    except TypeError:
        raise ShardingError(
            f"{what} must be a tuple of axis-name strings, e.g. ('dp', 'mp'); "
            f"got {names!r} ({type(names).__name__}). {fix}"
        ) from None
    for name in names:
        if not isinstance(name, str):
            raise ShardingError(
                f"{what} must contain only strings; got {name!r} ({type(name).__name__}) "
                f"in {names!r}. {fix}"
            )
        if not name:
            raise ShardingError(f"{what} contains an empty name in {names!r}. {fix}")
        if name == "None":
            raise ShardingError(
                f"{what} cannot contain 'None': in layouts 'None' means 'not sharded'. "
                f"Got {names!r}. {fix}"
            )
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ShardingError(
            f"{what} must be unique; {', '.join(map(repr, dups))} appears more than once "
            f"in {names!r}. {fix}"
        )
    return names


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _or_list(xs) -> str:
    xs = [str(x) for x in xs]
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " or " + xs[-1]


class Layout:
    """MindSpore's ``Layout``: a device matrix with named axes, and views of it.

    Calling a layout with one entry per tensor dimension gives a *view* that says
    how a tensor is split: an alias, ``"None"`` (not split), or a tuple of aliases
    (split over several axes, the first most significant).

    >>> layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    >>> view = layout("dp", ("sp", "mp"))
    >>> view.to_dict()["tensor_map"]          # counted from the right, -1 = unsplit
    (2, (1, 0))
    >>> view.to_strategy()
    (2, 4)
    >>> view
    Layout((2, 2, 2), ('dp', 'sp', 'mp'))('dp', ('sp', 'mp'))

    Args:
        device_matrix: devices along each axis; its product is the device count.
        alias_name: one unique, non-empty name per axis (not ``"None"``).
        rank_list: the rank ids in device-matrix order (row-major); default
            ``range(prod(device_matrix))``.

    Raises:
        ShardingError: on invalid sizes, names or rank list. fshard does not support
            MindSpore's ``"interleaved_parallel"`` (several slices on one device).

    See also: ``strategy_to_layout``, ``shard_slices``, ``fshard.Mesh.layout``.
    """

    def __init__(
        self,
        device_matrix: Sequence[int],
        alias_name: Sequence[str],
        rank_list: Sequence[int] | None = None,
    ):
        fix = "Fix: e.g. Layout((2, 4), ('dp', 'mp'))."
        if _is_int(device_matrix):
            device_matrix = (device_matrix,)
        try:
            dm = tuple(device_matrix)
        except TypeError:
            raise ShardingError(
                f"Layout device_matrix must be a tuple of positive ints; got "
                f"{device_matrix!r} ({type(device_matrix).__name__}). {fix}"
            ) from None
        for i, s in enumerate(dm):
            if not _is_int(s) or s < 1:
                raise ShardingError(
                    f"Layout device_matrix[{i}] must be a positive int; got {s!r} "
                    f"({type(s).__name__}) in {dm!r}. {fix}"
                )
        names = check_axis_names(alias_name, "Layout alias_name", fix)
        if _INTERLEAVED in names:
            raise ShardingError(
                f"Layout alias {_INTERLEAVED!r} (MindSpore's virtual split of one device "
                f"into several slices) is not supported by fshard; got alias_name {names!r}. "
                f"Fix: drop it and put its factor into a real axis."
            )
        if len(names) != len(dm):
            raise ShardingError(
                f"Layout needs one alias per device-matrix axis: device_matrix {dm!r} has "
                f"{len(dm)} axes but alias_name {names!r} has {len(names)}. {fix}"
            )
        n = math.prod(dm)
        if rank_list is None:
            ranks = list(range(n))
        else:
            if isinstance(rank_list, np.ndarray):
                rank_list = rank_list.tolist()
            ranks = list(rank_list) if isinstance(rank_list, (list, tuple)) else None
            if ranks is None or not all(_is_int(r) and r >= 0 for r in ranks):
                raise ShardingError(
                    f"Layout rank_list must be a list of non-negative int rank ids; got "
                    f"{rank_list!r}. Fix: e.g. rank_list=[0, 4, 2, 6] or leave it None."
                )
            if len(ranks) != n:
                raise ShardingError(
                    f"Layout rank_list must list one rank per device: device_matrix {dm!r} "
                    f"has {n} devices but rank_list has {len(ranks)}. Fix: give {n} ranks."
                )
            if len(set(ranks)) != n:
                raise ShardingError(
                    f"Layout rank_list must not repeat a rank; got {ranks!r}."
                )
            ranks = [int(r) for r in ranks]
        self._device_matrix = tuple(int(s) for s in dm)
        self._alias_name = names
        self._rank_list = ranks
        self._spec: tuple | None = None  # per tensor dim: "None", an alias, or a tuple

    # -- binding to a tensor ----------------------------------------------------------

    def __call__(self, *tensor_map) -> "Layout":
        """A view: ``layout("dp", ("sp", "mp"), "None")``, one entry per tensor dim."""
        used: list[str] = []
        spec = []
        for d, entry in enumerate(tensor_map):
            items = entry if isinstance(entry, tuple) else (entry,)
            norm = []
            for item in items:
                if item is None or item == "None":
                    norm.append("None")
                    continue
                if not isinstance(item, str):
                    raise ShardingError(
                        f"Layout view entry {d} must be an alias, 'None', or a tuple of "
                        f"aliases from {self._alias_name!r}; got {item!r} "
                        f"({type(item).__name__})."
                    )
                if item not in self._alias_name:
                    raise ShardingError(
                        f"Layout view entry {d} names the axis {item!r}, which is not in "
                        f"alias_name {self._alias_name!r}. Fix: use one of those aliases or "
                        f"'None'."
                    )
                if item in used:
                    raise ShardingError(
                        f"Layout view uses the axis {item!r} more than once in "
                        f"{tensor_map!r}; each axis may split at most one dimension, once."
                    )
                used.append(item)
                norm.append(item)
            spec.append(tuple(norm) if isinstance(entry, tuple) else norm[0])
        view = Layout.__new__(Layout)
        view._device_matrix = self._device_matrix
        view._alias_name = self._alias_name
        view._rank_list = list(self._rank_list)
        view._spec = tuple(spec)
        return view

    # -- properties --------------------------------------------------------------------

    @property
    def device_matrix(self) -> tuple[int, ...]:
        return self._device_matrix

    @property
    def alias_name(self) -> tuple[str, ...]:
        return self._alias_name

    @property
    def rank_list(self) -> list[int]:
        return list(self._rank_list)

    @property
    def n_devices(self) -> int:
        return math.prod(self._device_matrix)

    @property
    def is_view(self) -> bool:
        """True once called with one entry per tensor dim."""
        return self._spec is not None

    @property
    def spec(self) -> tuple | None:
        """The entries the view was called with ("None" for Python None)."""
        return self._spec

    @property
    def ndim(self) -> int:
        return len(self._require_view())

    def _require_view(self) -> tuple:
        if self._spec is None:
            raise ShardingError(
                f"{self!r} is not a view of a tensor: call it with one entry per tensor "
                f"dimension first, e.g. layout({self._alias_name[0]!r}, 'None')."
            )
        return self._spec

    def _index(self, alias: str) -> int:
        # NB: MindSpore counts tensor_map indices from the right (last axis = 0).
        return -1 if alias == "None" else len(self._alias_name) - 1 - self._alias_name.index(alias)

    @property
    def tensor_map(self) -> tuple:
        """MindSpore's tensor_map: per dim, axis indices counted from the right; -1 unsplit."""
        return tuple(
            tuple(self._index(a) for a in e) if isinstance(e, tuple) else self._index(e)
            for e in self._require_view()
        )

    @property
    def dim_axes(self) -> tuple[tuple[int, ...], ...]:
        """Per tensor dim, the device-matrix axes (left-indexed, major first) splitting it."""
        return tuple(
            tuple(self._alias_name.index(a) for a in (e if isinstance(e, tuple) else (e,))
                  if a != "None")
            for e in self._require_view()
        )

    def to_strategy(self) -> tuple[int, ...]:
        """Split counts per dim. Which rank holds which block is not kept.

        >>> Layout((2, 4), ("dp", "mp"))("mp", "None").to_strategy()
        (4, 1)
        """
        return tuple(math.prod(self._device_matrix[a] for a in axes) for axes in self.dim_axes)

    def to_dict(self) -> dict:
        """The same dict as ``mindspore.parallel.Layout(...)(...).to_dict()``."""
        return {
            "device_matrix": self._device_matrix,
            "tensor_map": self.tensor_map,
            "interleaved_parallel": False,
            "alias_name": self._alias_name,
            "rank_list": list(self._rank_list),
        }

    def to_mindspore(self):
        """The equivalent ``mindspore.parallel.Layout`` view (imports MindSpore)."""
        from mindspore.parallel import Layout as MsLayout

        ms_layout = MsLayout(self._device_matrix, self._alias_name, list(self._rank_list))
        return ms_layout(*self._require_view()) if self._spec is not None else ms_layout

    # -- value semantics ----------------------------------------------------------------

    def _key(self):
        return (self._device_matrix, self._alias_name, tuple(self._rank_list), self._spec)

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        ranks = ""
        if self._rank_list != list(range(self.n_devices)):
            ranks = f", rank_list={self._rank_list!r}"
        base = f"Layout({self._device_matrix!r}, {self._alias_name!r}{ranks})"
        if self._spec is None:
            return base
        return base + "(" + ", ".join(repr(e) for e in self._spec) + ")"


Spec = Union[Layout, Sequence[int]]


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def check_strategy(
    strategy,
    n_devices: int | None = None,
    *,
    ndim: int | None = None,
    name: str = "strategy",
    shape: Sequence[int] | None = None,
    what: str = "the tensor",
) -> tuple[int, ...]:
    """Check a tuple of split counts and return it as a tuple of ints: the one check of
    MindSpore's strategy tuples (``fs.shard``, ``fs.shard_map``, ``fs.visualize_sharding``
    and checkpoints all call it).

    >>> check_strategy([4, 2], 8)
    (4, 2)
    >>> check_strategy((4, 4), 8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fshard.errors.ShardingError: strategy = (4, 4) splits the tensor into 16 blocks, but ...

    Args:
        strategy: split counts, one per tensor dimension.
        n_devices: device count; the product of the counts must divide it.
        ndim: expected number of entries (the tensor's rank), if known.
        name: how the strategy is named in messages, e.g. ``"in_strategy[0]"``.
        shape: the tensor's shape, only to make the ``ndim`` message clearer.
        what: the value the strategy describes, in messages.

    See also: ``strategy_to_layout``, ``check_shape``.
    """
    if not isinstance(strategy, (tuple, list)):
        raise ShardingError(
            f"{name} must be a tuple of split counts, one per dimension (e.g. (4, 2): dim 0 "
            f"in 4 parts, dim 1 in 2), or a Layout view; got {strategy!r} "
            f"({type(strategy).__name__})."
        )
    strategy = tuple(strategy)
    for i, c in enumerate(strategy):
        if not _is_int(c):
            raise ShardingError(
                f"{name} = {strategy!r} has the split count {c!r} ({type(c).__name__}) for "
                f"dimension {i}.\nRule: split counts are positive ints.\nFix: use 1 for a "
                "dimension that is not split.")
        if c <= 0:
            raise ShardingError(
                f"{name} = {strategy!r} has the split count {c} for dimension {i}.\nRule: "
                "split counts are positive ints.\nFix: use 1 for a dimension that is not "
                "split.")
    strategy = tuple(int(c) for c in strategy)
    if ndim is not None and len(strategy) != ndim:
        of = f"{what} has rank {ndim}" + (f" (shape {tuple(shape)!r})" if shape else "")
        raise ShardingError(
            f"{name} = {strategy!r} has {_plural(len(strategy), 'entry', 'entries')}, but "
            f"{of}.\nRule: a strategy gives one split count per dimension.\nFix: give "
            f"{ndim} split counts, e.g. {(1,) * ndim!r} for no split.")
    if n_devices is not None:
        total = math.prod(strategy)
        if total > n_devices or n_devices % total:
            how = (f"but the mesh has only {_plural(n_devices, 'device', 'devices')}"
                   if total > n_devices else
                   f"which does not divide the {n_devices} devices of the mesh")
            raise ShardingError(
                f"{name} = {strategy!r} splits {what} into {total} blocks, {how}.\nRule: the "
                "product of the split counts must divide the device count (the remaining "
                "factor holds replicas).\nFix: use split counts whose product is "
                f"{_or_list(_divisors(n_devices))}, or another mesh (fs.Mesh, mesh=N or "
                "FSHARD_DEVICES).")
    return strategy


def strategy_to_layout(strategy: Sequence[int], n_devices: int, *, name: str = "strategy"
                       ) -> Layout:
    """The Layout view MindSpore derives from a strategy on ``n_devices`` devices.

    The device matrix is the strategy itself, plus a last ``"repeat"`` axis of size
    ``n_devices / prod(strategy)`` when the strategy uses fewer devices (MindSpore's
    repeated calculation: neighbouring ranks hold the same block).

    >>> strategy_to_layout((4, 2), 8)
    Layout((4, 2), ('s0', 's1'))('s0', 's1')
    >>> strategy_to_layout((2, 2), 8)
    Layout((2, 2, 2), ('s0', 's1', 'repeat'))('s0', 's1')

    See also: ``Layout.to_strategy``, ``shard_slices``.
    """
    if not _is_int(n_devices) or n_devices < 1:
        raise ShardingError(f"n_devices must be a positive int; got {n_devices!r}.")
    strategy = check_strategy(strategy, n_devices, name=name)
    names = tuple(f"s{i}" for i in range(len(strategy)))
    dm = strategy
    repeat = n_devices // math.prod(strategy)
    if repeat > 1 or not strategy:
        dm, names = dm + (repeat,), names + (REPEAT_AXIS,)
    return Layout(dm, names)(*names[: len(strategy)])


def as_layout(
    spec,
    n_devices: int | None = None,
    *,
    ndim: int | None = None,
    name: str = "strategy",
) -> Layout:
    """A Layout view for a Layout view, a strategy tuple, or None (replicated).

    >>> as_layout((2, 1), 8).to_strategy()
    (2, 1)
    >>> as_layout(None, 4, ndim=2)
    Layout((4,), ('repeat',))('None', 'None')

    Raises ShardingError when a Layout's device count differs from ``n_devices`` or
    its rank differs from ``ndim``.
    """
    if isinstance(spec, Layout):
        if not spec.is_view:
            spec._require_view()
        if n_devices is not None and spec.n_devices != n_devices:
            raise ShardingError(
                f"{name} = {spec!r} has a device matrix of {spec.n_devices} devices but the "
                f"mesh has {n_devices}. The product of a Layout's device_matrix must equal the "
                f"device count. Fix: use a device_matrix whose product is {n_devices}, or a "
                f"mesh of {spec.n_devices} devices."
            )
        if ndim is not None and spec.ndim != ndim:
            raise ShardingError(
                f"{name} = {spec!r} has {spec.ndim} entries but the tensor has {ndim} "
                f"dimensions. Fix: give one entry per dimension ('None' for unsplit)."
            )
        return spec
    if n_devices is None:
        raise ShardingError(
            f"{name} = {spec!r} is a strategy tuple, which needs a device count. Fix: pass "
            f"n_devices (or a mesh), or give a Layout view."
        )
    if spec is None:
        if ndim is None:
            raise ShardingError(f"{name} = None (replicated) needs the tensor's ndim.")
        return Layout((n_devices,), (REPEAT_AXIS,))(*(["None"] * ndim))
    check_strategy(spec, n_devices, ndim=ndim, name=name)
    return strategy_to_layout(spec, n_devices, name=name)


def check_shape(
    shape: Sequence[int],
    spec,
    n_devices: int | None = None,
    *,
    name: str = "strategy",
    arg: str = "the argument",
) -> Layout:
    """Check that every dim of ``shape`` divides evenly into its blocks; return the view.

    >>> check_shape((8, 6), (2, 4), 8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fshard.errors.ShardingError: strategy = (2, 4) splits dimension 1 of the argument (size 6) ...

    Args:
        shape: the tensor's global shape.
        spec: a strategy tuple, a Layout view, or None (replicated).
        n_devices: the device count (needed for strategy tuples).
        name: how ``spec`` is named in messages, e.g. ``"in_strategy[0]"``.
        arg: how the tensor is named in messages, e.g. ``"args[0] (f32[8,6])"``.
    """
    shape = tuple(shape)
    layout = as_layout(spec, n_devices, ndim=len(shape), name=name)
    shown = spec if not isinstance(spec, Layout) else layout
    for i, (size, count) in enumerate(zip(shape, layout.to_strategy(), strict=True)):
        if _is_int(size) and size % count:
            ok = [d for d in _divisors(size) if layout.n_devices % d == 0]
            raise ShardingError(
                f"{name} = {shown!r} splits dimension {i} of {arg} (size {size}) into {count} "
                f"parts, but {size} is not divisible by {count}. Each dimension must be "
                f"divisible by its split count. Fix: split dimension {i} into "
                f"{_or_list(ok)} parts, or pad it to a multiple of {count}."
            )
    return layout


def einsum_layouts(
    subscripts: str, strategies: Sequence[Sequence[int]], n_devices: int
) -> tuple[Layout, ...]:
    """Layout views of an operator's operands and result on its shared device matrix.

    MindSpore builds one device matrix per operator from its input strategies: one
    axis per iteration index, in order of first appearance (``MatMul`` "ij,jk->ik"
    gives ``[i, j, k]``), plus the repeated-calculation axis last. Every operand is a
    view of that matrix, so operands that do not use an index are replicated over it.

    >>> x, w, out = einsum_layouts("ij,jk->ik", ((2, 1), (1, 4)), 8)
    >>> x.to_dict()["device_matrix"], x.tensor_map, w.tensor_map, out.tensor_map
    ((2, 1, 4), (2, 1), (1, 0), (2, 0))
    >>> replica_groups(w)                 # W0 on ranks 0 and 4, W1 on 1 and 5, ...
    [(0, 4), (1, 5), (2, 6), (3, 7)]

    Returns:
        One view per operand, then one for the result (if ``->`` is given).

    Raises:
        ShardingError: when an index gets different split counts in two operands, or
            a strategy does not match its operand's subscripts.
    """
    if not isinstance(subscripts, str) or subscripts.count("->") > 1:
        raise ShardingError(f"subscripts must be an einsum string like 'ij,jk->ik'; "
                            f"got {subscripts!r}.")
    lhs, _, out = subscripts.replace(" ", "").partition("->")
    operands = lhs.split(",")
    if len(operands) != len(strategies):
        raise ShardingError(
            f"{subscripts!r} has {len(operands)} operands but {len(strategies)} strategies "
            f"were given: {tuple(strategies)!r}. Fix: give one strategy per operand."
        )
    counts: dict[str, int] = {}
    for k, (sub, strat) in enumerate(zip(operands, strategies, strict=True)):
        strat = check_strategy(strat, n_devices, ndim=len(sub), name=f"strategies[{k}]")
        for letter, c in zip(sub, strat, strict=True):
            if counts.setdefault(letter, c) != c:
                raise ShardingError(
                    f"index {letter!r} of {subscripts!r} is split {counts[letter]} ways in one "
                    f"operand and {c} ways in strategies[{k}] = {strat!r}. An index shared by "
                    f"operands must have the same split count everywhere."
                )
    letters = tuple(counts)
    check_strategy(tuple(counts.values()), n_devices, name=f"the device matrix of {subscripts!r}")
    dm, names = tuple(counts.values()), letters
    repeat = n_devices // math.prod(dm)
    if repeat > 1 or not dm:
        dm, names = dm + (repeat,), names + (REPEAT_AXIS,)
    base = Layout(dm, names)
    views = [base(*sub) for sub in operands]
    if out or "->" in subscripts:
        views.append(base(*out))
    return tuple(views)


# ---------------------------------------------------------------------------
# Which rank holds which block
# ---------------------------------------------------------------------------


def _position(layout: Layout, rank: int) -> int:
    if not _is_int(rank) or rank not in layout._rank_list:
        raise ShardingError(
            f"rank {rank!r} is not one of the devices of {layout!r} "
            f"(ranks {layout._rank_list!r})."
        )
    return layout._rank_list.index(int(rank))


def block_index(spec, rank: int, n_devices: int | None = None) -> tuple[int, ...]:
    """Per dim, the index of the block that ``rank`` holds.

    >>> block_index((2, 2), 5, 8)     # device matrix (2, 2, 2): rank 5 = (1, 0, 1)
    (1, 0)
    """
    layout = as_layout(spec, n_devices)
    coords = np.unravel_index(_position(layout, rank), layout.device_matrix)
    dm = layout.device_matrix
    out = []
    for axes in layout.dim_axes:
        # First alias most significant (hyper-parallel's _infer_slice_area_by_rank, JAX).
        idx = 0
        for a in axes:
            idx = idx * dm[a] + int(coords[a])
        out.append(idx)
    return tuple(out)


def shard_slices(
    shape: Sequence[int], spec, rank: int, n_devices: int | None = None
) -> tuple[tuple[int, int], ...]:
    """The ``(start, stop)`` per dim of the block of a ``shape`` tensor held by ``rank``.

    A strategy alone uses the tensor's own device matrix, with repeated calculation
    on the last axis; ``(2,)`` on 4 devices puts rows 0:2 on ranks 0 and 1:

    >>> [shard_slices((4,), (2,), r, 4) for r in range(4)]
    [((0, 2),), ((0, 2),), ((2, 4),), ((2, 4),)]

    Operands of one operator share the operator's device matrix instead (see
    ``einsum_layouts``): MindSpore's ``MatMul.shard(((2, 1), (1, 4)))`` on 8 devices
    gives W's column block 0 to ranks 0 and 4:

    >>> x, w, out = einsum_layouts("ij,jk->ik", ((2, 1), (1, 4)), 8)
    >>> [shard_slices((8, 8), w, r) for r in (0, 1, 4)]
    [((0, 8), (0, 2)), ((0, 8), (2, 4)), ((0, 8), (0, 2))]

    See also: ``block_owners``, ``replica_groups``.
    """
    layout = check_shape(shape, spec, n_devices)
    idx = block_index(layout, rank)
    out = []
    for size, count, i in zip(tuple(shape), layout.to_strategy(), idx, strict=True):
        step = size // count
        out.append((i * step, (i + 1) * step))
    return tuple(out)


def block_owners(spec, n_devices: int | None = None) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Every block index -> the ranks holding it, blocks in row-major order.

    >>> block_owners((2,), 4)
    {(0,): (0, 1), (1,): (2, 3)}
    """
    layout = as_layout(spec, n_devices)
    owners: dict[tuple[int, ...], list[int]] = {
        idx: [] for idx in np.ndindex(*layout.to_strategy())
    }
    for r in layout._rank_list:
        owners[block_index(layout, r)].append(r)
    return {tuple(int(i) for i in k): tuple(v) for k, v in owners.items()}


def replica_groups(spec, n_devices: int | None = None) -> list[tuple[int, ...]]:
    """Groups of ranks that hold the same block (one group per block).

    >>> replica_groups((2, 2), 8)     # repeat axis is the fastest: neighbours replicate
    [(0, 1), (2, 3), (4, 5), (6, 7)]
    """
    return list(block_owners(spec, n_devices).values())
