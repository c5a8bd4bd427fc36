"""Meshes, MindSpore's Layout and strategy semantics, rank -> block mapping, and
visualize_sharding. All in one process: no launcher is needed."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from mindspore.parallel import Layout as MsLayout

import fshard as fs
from fshard.meshes.layout import (
    Layout,
    as_layout,
    block_index,
    block_owners,
    check_shape,
    check_strategy,
    einsum_layouts,
    replica_groups,
    shard_slices,
    strategy_to_layout,
)
from fshard.meshes.mesh import Mesh, current_mesh, resolve_mesh
from fshard.meshes.visualize import visualize_sharding


def _golden(fn, cls, message):
    with pytest.raises(cls) as info:
        fn()
    assert str(info.value) == message + f"\nSee docs/errors.md#{cls.__name__.lower()}"


# ---------------------------------------------------------------------------
# Mesh
# ---------------------------------------------------------------------------


def test_mesh_basics():
    mesh = Mesh((2, 4), ("dp", "mp"))
    assert mesh.shape == (2, 4) and mesh.axis_names == ("dp", "mp") and mesh.ndim == 2
    assert mesh.size == 8 and mesh.axis_size("dp") == 2 and mesh.axis_size("mp") == 4
    assert mesh.devices.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [mesh.coords(r) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert all(mesh.rank_at(mesh.coords(r)) == r for r in range(8))
    assert mesh.is_virtual
    assert repr(mesh) == "Mesh((2, 4), ('dp', 'mp'))"
    assert mesh == Mesh([2, 4], ["dp", "mp"]) and hash(mesh) == hash(Mesh((2, 4), ("dp", "mp")))
    assert mesh != Mesh((4, 2), ("dp", "mp"))
    assert Mesh(4, "x").shape == (4,)


def test_mesh_axis_groups():
    mesh = Mesh((2, 4), ("dp", "mp"))
    assert mesh.axis_groups("mp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert mesh.axis_groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert mesh.axis_groups(("dp", "mp")) == [tuple(range(8))]
    # first listed axis most significant: the order of axis_index over both axes
    assert mesh.axis_groups(("mp", "dp")) == [(0, 4, 1, 5, 2, 6, 3, 7)]
    assert mesh.axis_groups(()) == [(r,) for r in range(8)]
    assert mesh.axis_group("dp", 6) == (2, 6)
    # groups partition the ranks, for every subset of axes of a 3-D mesh
    m3 = Mesh((2, 3, 2), ("a", "b", "c"))
    for k in range(4):
        for axes in itertools.combinations(m3.axis_names, k):
            groups = m3.axis_groups(axes)
            assert sorted(r for g in groups for r in g) == list(range(12))
            size = int(np.prod([m3.axis_size(a) for a in axes]))
            assert all(len(g) == size for g in groups)
            for g in groups:  # members differ only along the named axes
                fixed = [i for i, n in enumerate(m3.axis_names) if n not in axes]
                assert len({tuple(m3.coords(r)[i] for i in fixed) for r in g}) == 1


def test_mesh_context_nesting_and_resolution(monkeypatch):
    monkeypatch.delenv("FSHARD_DEVICES", raising=False)
    assert current_mesh() is None
    assert resolve_mesh() == Mesh((1,), ("d",))
    outer, inner = Mesh((2, 4), ("dp", "mp")), Mesh((8,), ("x",))
    with outer:
        assert resolve_mesh() is outer
        with inner as m:
            assert m is inner and resolve_mesh() is inner
            explicit = Mesh((4,), ("y",))
            assert resolve_mesh(explicit) is explicit
        assert resolve_mesh() is outer
    assert current_mesh() is None
    monkeypatch.setenv("FSHARD_DEVICES", "8")
    assert resolve_mesh() == Mesh((8,), ("d",)) and resolve_mesh().is_virtual


def test_mesh_context_is_restored_after_an_exception():
    with pytest.raises(RuntimeError):
        with Mesh((2,), ("x",)):
            raise RuntimeError("inside")
    assert current_mesh() is None


def test_mesh_layout_shortcut():
    view = Mesh((2, 4), ("dp", "mp")).layout("dp", "None")
    assert view == Layout((2, 4), ("dp", "mp"))("dp", "None")


def test_mesh_errors(monkeypatch):
    fix = " Fix: pass e.g. fs.Mesh((2, 4), ('dp', 'mp'))."
    _golden(lambda: Mesh((2, 0), ("a", "b")), fs.ShardingError,
            "Mesh shape[1] must be a positive int (a number of devices); got 0 (int) in (2, 0)."
            + fix)
    _golden(lambda: Mesh((2, 2.0), ("a", "b")), fs.ShardingError,
            "Mesh shape[1] must be a positive int (a number of devices); got 2.0 (float) in "
            "(2, 2.0)." + fix)
    _golden(lambda: Mesh((2, 2), ("a",)), fs.ShardingError,
            "Mesh needs one axis name per axis: shape (2, 2) has 2 axes but axis_names ('a',) "
            "has 1." + fix)
    _golden(lambda: Mesh((2, 2), ("a", "a")), fs.ShardingError,
            "Mesh axis_names must be unique; 'a' appears more than once in ('a', 'a')." + fix)
    _golden(lambda: Mesh((2, 2), ("a", "None")), fs.ShardingError,
            "Mesh axis_names cannot contain 'None': in layouts 'None' means 'not sharded'. "
            "Got ('a', 'None')." + fix)
    _golden(lambda: Mesh((2, 2), ("a", "b")).axis_size("c"), fs.ShardingError,
            "Mesh((2, 2), ('a', 'b')) has no axis named 'c'; its axes are ('a', 'b'). "
            "Fix: use one of those names.")
    _golden(lambda: Mesh((2, 2), ("a", "b"), virtual=False), fs.ShardingError,
            "Mesh((2, 2), ('a', 'b'), virtual=False) was created with virtual=False but this "
            "process is not a rank of an initialised job. Fix: start the script with "
            "`python -m fshard.launch -n 4 script.py` and call fs.distributed.init() first, "
            "or drop virtual=False.")
    _golden(lambda: resolve_mesh((2, 4)), fs.ShardingError,
            "mesh must be an fs.Mesh or None; got (2, 4) (tuple). "
            "Fix: pass mesh=fs.Mesh((2, 4), ('dp', 'mp')).")
    monkeypatch.setenv("FSHARD_DEVICES", "zero")
    _golden(resolve_mesh, fs.ShardingError,
            "FSHARD_DEVICES must be a positive int (the number of virtual devices); got 'zero'. "
            "Fix: export FSHARD_DEVICES=8, or pass mesh=fs.Mesh((8,), ('d',)).")
    with pytest.raises(fs.ShardingError, match=r"rank must be an int in \[0, 4\)"):
        Mesh((2, 2), ("a", "b")).coords(4)


# ---------------------------------------------------------------------------
# Layout: MindSpore parity and validation
# ---------------------------------------------------------------------------

PARITY_CASES = [
    ((2, 2, 2), ("dp", "sp", "mp"), None, ("dp", "mp")),
    ((2, 2, 2), ("dp", "sp", "mp"), None, ("mp", ("sp", "dp"))),
    ((2, 2, 2), ("dp", "sp", "mp"), None, ("dp", ("sp", "mp"), "None")),
    ((2, 2, 2), ("dp", "sp", "mp"), None, (("None", "dp"), "mp")),
    ((2, 2, 2), ("dp", "sp", "mp"), None, ()),
    ((8,), ("d",), None, ("None", "d")),
    ((4, 2), ("a", "b"), [7, 6, 5, 4, 3, 2, 1, 0], ("a", "b")),
    ((2, 2), ("x", "y"), [0, 4, 2, 6], ("y", "None")),
]


@pytest.mark.parametrize("dm, names, ranks, view", PARITY_CASES,
                         ids=[str(c[3]) for c in PARITY_CASES])
def test_layout_to_dict_matches_mindspore(dm, names, ranks, view):
    ours = Layout(dm, names, ranks)(*view).to_dict()
    theirs = MsLayout(dm, names, ranks)(*view).to_dict()
    assert ours == theirs
    assert list(ours) == list(theirs)  # same key order too
    assert Layout(dm, names, ranks)(*view).to_mindspore().to_dict() == theirs


def test_layout_documented_example():
    view = Layout((2, 2, 2), ("dp", "sp", "mp"))("dp", "mp")
    assert view.to_dict() == {
        "device_matrix": (2, 2, 2), "tensor_map": (2, 0), "interleaved_parallel": False,
        "alias_name": ("dp", "sp", "mp"), "rank_list": [0, 1, 2, 3, 4, 5, 6, 7],
    }
    assert view.to_strategy() == (2, 2)
    assert view.dim_axes == ((0,), (2,))
    assert Layout((2, 2, 2), ("dp", "sp", "mp"))("mp", ("sp", "dp")).tensor_map == (0, (1, 2))


def test_layout_view_does_not_change_the_base():
    base = Layout((2, 4), ("dp", "mp"))
    a, b = base("dp", "mp"), base("mp", "None")
    assert not base.is_view and a.tensor_map == (1, 0) and b.tensor_map == (0, -1)
    assert base(None, "mp") == base("None", "mp")  # Python None means "None"
    assert repr(b) == "Layout((2, 4), ('dp', 'mp'))('mp', 'None')"


def test_layout_errors():
    fix = " Fix: e.g. Layout((2, 4), ('dp', 'mp'))."
    _golden(lambda: Layout((2, 2), ("a", "a")), fs.ShardingError,
            "Layout alias_name must be unique; 'a' appears more than once in ('a', 'a')." + fix)
    _golden(lambda: Layout((2, 2), ("a", "None")), fs.ShardingError,
            "Layout alias_name cannot contain 'None': in layouts 'None' means 'not sharded'. "
            "Got ('a', 'None')." + fix)
    _golden(lambda: Layout((2, 2), ("a", "")), fs.ShardingError,
            "Layout alias_name contains an empty name in ('a', '')." + fix)
    _golden(lambda: Layout((2, 2), ("a", "interleaved_parallel")), fs.ShardingError,
            "Layout alias 'interleaved_parallel' (MindSpore's virtual split of one device into "
            "several slices) is not supported by fshard; got alias_name "
            "('a', 'interleaved_parallel'). Fix: drop it and put its factor into a real axis.")
    _golden(lambda: Layout((2, 2), ("a",)), fs.ShardingError,
            "Layout needs one alias per device-matrix axis: device_matrix (2, 2) has 2 axes but "
            "alias_name ('a',) has 1." + fix)
    _golden(lambda: Layout((2, 0), ("a", "b")), fs.ShardingError,
            "Layout device_matrix[1] must be a positive int; got 0 (int) in (2, 0)." + fix)
    _golden(lambda: Layout((2, 2), ("a", "b"), rank_list=[0, 1, 2]), fs.ShardingError,
            "Layout rank_list must list one rank per device: device_matrix (2, 2) has 4 devices "
            "but rank_list has 3. Fix: give 4 ranks.")
    _golden(lambda: Layout((2, 2), ("a", "b"))("c"), fs.ShardingError,
            "Layout view entry 0 names the axis 'c', which is not in alias_name ('a', 'b'). "
            "Fix: use one of those aliases or 'None'.")
    _golden(lambda: Layout((2, 2), ("a", "b"))("a", ("b", "a")), fs.ShardingError,
            "Layout view uses the axis 'a' more than once in ('a', ('b', 'a')); each axis may "
            "split at most one dimension, once.")
    _golden(lambda: Layout((2, 2), ("a", "b")).to_dict(), fs.ShardingError,
            "Layout((2, 2), ('a', 'b')) is not a view of a tensor: call it with one entry per "
            "tensor dimension first, e.g. layout('a', 'None').")
    # MindSpore rejects the same inputs (its errors are ValueErrors; ours are too)
    for bad in [(("a", "a"),), (("a", "None"),), (("a", ""),)]:
        with pytest.raises(ValueError):
            MsLayout((2, 2), *bad)
    assert issubclass(fs.ShardingError, ValueError)


# ---------------------------------------------------------------------------
# Strategies <-> layouts, repeated calculation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, n", [((4, 2), 8), ((2, 2), 8), ((1, 1), 4), ((8,), 8),
                                         ((2, 1, 2), 8), ((), 4), ((3,), 6)])
def test_strategy_layout_round_trip(strategy, n):
    layout = strategy_to_layout(strategy, n)
    assert layout.to_strategy() == strategy
    assert layout.n_devices == n
    # the repeated-calculation factor is the last device-matrix axis
    repeat = n // int(np.prod(strategy))
    assert layout.device_matrix == (strategy + (repeat,) if repeat > 1 or not strategy
                                    else strategy)


def test_repeated_calculation_2x2_on_8_devices():
    layout = strategy_to_layout((2, 2), 8)
    assert layout.to_dict() == {
        "device_matrix": (2, 2, 2), "tensor_map": (2, 1), "interleaved_parallel": False,
        "alias_name": ("s0", "s1", "repeat"), "rank_list": list(range(8)),
    }
    # neighbouring ranks hold the same block (MindSpore's answer to mindspore#332)
    assert replica_groups((2, 2), 8) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    slices = [shard_slices((4, 6), (2, 2), r, 8) for r in range(8)]
    assert slices == [((0, 2), (0, 3))] * 2 + [((0, 2), (3, 6))] * 2 + \
                     [((2, 4), (0, 3))] * 2 + [((2, 4), (3, 6))] * 2


def test_seed_example_matmul_2x1_1x4_on_8_devices():
    # MindSpore docs: ((2, 1), (1, 4)) on 8 devices. Devices 0-3 get X0 and 4-7 get X1;
    # devices 0 and 4 get W0, 1 and 5 get W1, and so on.
    x, w, out = einsum_layouts("ij,jk->ik", ((2, 1), (1, 4)), 8)
    assert x.device_matrix == (2, 1, 4) and x.tensor_map == (2, 1) and w.tensor_map == (1, 0)
    assert out.tensor_map == (2, 0) and out.to_strategy() == (2, 4)
    xs = [shard_slices((16, 12), x, r) for r in range(8)]
    assert xs == [((0, 8), (0, 12))] * 4 + [((8, 16), (0, 12))] * 4
    ws = [shard_slices((12, 8), w, r) for r in range(8)]
    assert ws == [((0, 12), (2 * k, 2 * k + 2)) for k in (0, 1, 2, 3, 0, 1, 2, 3)]
    assert replica_groups(x) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert replica_groups(w) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert replica_groups(out) == [(r,) for r in range(8)]
    # the same views written by hand with MindSpore's Layout vocabulary
    base = Layout((2, 1, 4), ("i", "j", "k"))
    assert (x, w, out) == (base("i", "j"), base("j", "k"), base("i", "k"))
    assert base("j", "k").to_dict() == MsLayout((2, 1, 4), ("i", "j", "k"))("j", "k").to_dict()


def test_tuple_mapping_first_alias_is_most_significant():
    view = Layout((2, 2), ("a", "b"))(("a", "b"),)
    assert [shard_slices((8,), view, r) for r in range(4)] == [((0, 2),), ((2, 4),),
                                                               ((4, 6),), ((6, 8),)]
    swapped = Layout((2, 2), ("a", "b"))(("b", "a"),)
    assert [block_index(swapped, r) for r in range(4)] == [(0,), (2,), (1,), (3,)]


def test_rank_list_places_blocks_on_listed_ranks():
    view = Layout((4,), ("x",), rank_list=[0, 4, 2, 6])("x", "None")
    assert block_owners(view) == {(0, 0): (0,), (1, 0): (4,), (2, 0): (2,), (3, 0): (6,)}
    assert shard_slices((8, 2), view, 4) == ((2, 4), (0, 2))
    with pytest.raises(fs.ShardingError, match="rank 1 is not one of the devices"):
        shard_slices((8, 2), view, 1)


@pytest.mark.parametrize("seed", range(5))
def test_blocks_tile_the_tensor(seed):
    # one rank per replica group reassembles the global array exactly
    rng = np.random.default_rng(seed)
    names = ("a", "b", "c")
    base = Layout((2, 2, 2), names)
    for _ in range(20):
        perm = rng.permutation(3)
        cut = rng.integers(0, 4, size=2)
        used = [names[i] for i in perm[: max(cut)]]
        lo = min(cut)
        entries = [tuple(used[:lo]) or "None", tuple(used[lo:]) or "None"]
        view = base(*entries)
        shape = (8, 8)
        full = rng.standard_normal(shape)
        rebuilt = np.full(shape, np.nan)
        for group in replica_groups(view):
            (r0, r1), (c0, c1) = shard_slices(shape, view, group[0])
            assert np.isnan(rebuilt[r0:r1, c0:c1]).all()  # no block is covered twice
            rebuilt[r0:r1, c0:c1] = full[r0:r1, c0:c1]
            assert all(shard_slices(shape, view, r) == ((r0, r1), (c0, c1)) for r in group)
        np.testing.assert_array_equal(rebuilt, full)


def test_as_layout_accepts_layouts_strategies_and_none():
    view = Layout((2, 4), ("dp", "mp"))("dp", "None")
    assert as_layout(view, 8) is view
    assert as_layout((2, 1), 8).to_strategy() == (2, 1)
    assert as_layout(None, 4, ndim=2).to_strategy() == (1, 1)
    assert replica_groups(as_layout(None, 4, ndim=2)) == [(0, 1, 2, 3)]


def test_strategy_errors():
    rule = ("Rule: the product of the split counts must divide the device count (the "
            "remaining factor holds replicas).\nFix: use split counts whose product is 1, 2, "
            "4 or 8, or another mesh (fs.Mesh, mesh=N or FSHARD_DEVICES).")
    _golden(lambda: check_strategy((4, 4), 8, name="in_strategy[0]"), fs.ShardingError,
            "in_strategy[0] = (4, 4) splits the tensor into 16 blocks, but the mesh has only "
            "8 devices.\n" + rule)
    _golden(lambda: check_strategy((3, 1), 8, name="in_strategy[0]"), fs.ShardingError,
            "in_strategy[0] = (3, 1) splits the tensor into 3 blocks, which does not divide "
            "the 8 devices of the mesh.\n" + rule)
    positive = ("Rule: split counts are positive ints.\nFix: use 1 for a dimension that is "
                "not split.")
    _golden(lambda: check_strategy((2, 0), 8, name="in_strategy[1]"), fs.ShardingError,
            "in_strategy[1] = (2, 0) has the split count 0 for dimension 1.\n" + positive)
    _golden(lambda: check_strategy((2, 2.0), 8), fs.ShardingError,
            "strategy = (2, 2.0) has the split count 2.0 (float) for dimension 1.\n" + positive)
    _golden(lambda: check_strategy("ab", 8), fs.ShardingError,
            "strategy must be a tuple of split counts, one per dimension (e.g. (4, 2): dim 0 "
            "in 4 parts, dim 1 in 2), or a Layout view; got 'ab' (str).")
    _golden(lambda: check_strategy((2, 2), 8, ndim=3, shape=(4, 4, 4)), fs.ShardingError,
            "strategy = (2, 2) has 2 entries, but the tensor has rank 3 (shape (4, 4, 4)).\n"
            "Rule: a strategy gives one split count per dimension.\nFix: give 3 split "
            "counts, e.g. (1, 1, 1) for no split.")
    _golden(lambda: check_strategy((True, 2), 8), fs.ShardingError,
            "strategy = (True, 2) has the split count True (bool) for dimension 0.\n" + positive)
    _golden(lambda: einsum_layouts("ij,jk->ik", ((2, 2), (4, 1)), 8), fs.ShardingError,
            "index 'j' of 'ij,jk->ik' is split 2 ways in one operand and 4 ways in "
            "strategies[1] = (4, 1). An index shared by operands must have the same split "
            "count everywhere.")


def test_divisibility_errors():
    _golden(lambda: check_shape((8, 6), (2, 4), 8, name="in_strategy[0]",
                                arg="args[0] f32[8,6]"), fs.ShardingError,
            "in_strategy[0] = (2, 4) splits dimension 1 of args[0] f32[8,6] (size 6) into 4 "
            "parts, but 6 is not divisible by 4. Each dimension must be divisible by its split "
            "count. Fix: split dimension 1 into 1 or 2 parts, or pad it to a multiple of 4.")
    view = Layout((2, 4), ("dp", "mp"))("dp", "mp")
    _golden(lambda: check_shape((8, 6), view, 8, name="in_strategy[0]", arg="x"),
            fs.ShardingError,
            "in_strategy[0] = Layout((2, 4), ('dp', 'mp'))('dp', 'mp') splits dimension 1 of x "
            "(size 6) into 4 parts, but 6 is not divisible by 4. Each dimension must be "
            "divisible by its split count. Fix: split dimension 1 into 1 or 2 parts, or pad it "
            "to a multiple of 4.")
    _golden(lambda: as_layout(view, 4), fs.ShardingError,
            "strategy = Layout((2, 4), ('dp', 'mp'))('dp', 'mp') has a device matrix of 8 "
            "devices but the mesh has 4. The product of a Layout's device_matrix must equal the "
            "device count. Fix: use a device_matrix whose product is 4, or a mesh of 8 devices.")
    assert check_shape((8, 6), (2, 3), 6).to_strategy() == (2, 3)


# ---------------------------------------------------------------------------
# visualize_sharding
# ---------------------------------------------------------------------------


def test_visualize_2d_with_replicas():
    vis = visualize_sharding((8, 4), (2, 2), mesh=Mesh((8,), ("d",)))
    assert vis.cells == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    assert (vis.row_labels, vis.col_labels) == (["0:4", "4:8"], ["0:2", "2:4"])
    text = str(vis)
    assert text.splitlines()[0] == "shape (8, 4), strategy (2, 2), 8 devices"
    assert re.search(r"│ 0:4 │\s+0,1\s+│\s+2,3\s+│", text)
    html = vis._repr_html_()
    assert html.startswith("<table") and "0,1" in html and "6,7" in html


def test_visualize_layout_1d_and_3d():
    view = Layout((2, 4), ("dp", "mp"))("mp")
    vis = visualize_sharding((8,), view)
    assert vis.cells == [[(0, 4), (1, 5), (2, 6), (3, 7)]]
    assert vis.col_labels == ["0:2", "2:4", "4:6", "6:8"] and vis.note is None
    vis3 = visualize_sharding((4, 6, 8), (2, 1, 2), mesh=Mesh((8,), ("d",)))
    assert vis3.row_labels == ["0:2, 0:6", "2:4, 0:6"]
    assert vis3.cells == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    assert "flattened into the rows" in vis3.note and vis3.note in str(vis3)
    assert "flattened" in vis3._repr_html_()
    assert visualize_sharding((), None, mesh=Mesh((2,), ("d",))).cells == [[(0, 1)]]


def test_visualize_uses_the_current_mesh_and_checks_shapes():
    with Mesh((4,), ("d",)):
        assert visualize_sharding((4,), (2,)).cells == [[(0, 1), (2, 3)]]
        with pytest.raises(fs.ShardingError, match="splits dimension 0 of shape \\(6,\\)"):
            visualize_sharding((6,), (4,))
    with pytest.raises(fs.ShardingError, match="device matrix of 8 devices but the mesh has 4"):
        visualize_sharding((8,), Layout((8,), ("d",))("d"), mesh=Mesh((4,), ("d",)))
