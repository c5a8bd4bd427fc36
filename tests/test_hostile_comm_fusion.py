"""``fs.AutoParallel.comm_fusion``'s "index" mode and "reducescatter" key, as a hostile
user tries them: each bucket is one collective in the per-device program, the training
is bit for bit the unfused one (fusing concatenates, it does not reorder any sum), and
every misuse names the argument, what was expected, what was got and the fix.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import fshard as fs
from fshard import tree


def mse(p, x, y):
    h = fs.ops.relu(x @ p["w1"] + p["b1"])
    return ((h @ p["w2"] + p["b2"] - y) ** 2).mean()


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    params = {"w1": (rng.standard_normal((64, 32)) * 0.1).astype(np.float32),
              "b1": np.zeros((32,), np.float32),
              "w2": (rng.standard_normal((32, 10)) * 0.1).astype(np.float32),
              "b2": np.zeros((10,), np.float32)}
    x = rng.standard_normal((32, 64)).astype(np.float32)
    y = rng.standard_normal((32, 10)).astype(np.float32)
    return params, x, y


def _make(config=None, level=None):
    ap = fs.AutoParallel(mse, fs.optim.sgd(0.1, momentum=0.9), mesh=4)
    if level:
        ap.hsdp(threshold=0, optimizer_level=level)
    return ap if config is None else ap.comm_fusion(config)


def _psums(ap, data) -> list:
    params, x, y = data
    return [tuple(eq.inputs[0].aval.shape)
            for eq in ap.partitioned(ap.init(params), x, y).program.equations
            if eq.prim.name == "psum"]


def _train(ap, data, steps=2):
    params, x, y = data
    state = ap.init(params)
    losses = []
    for _ in range(steps):
        state, loss = ap(state, x, y)
        losses.append(float(loss.asnumpy()))
    return losses, [np.asarray(v.asnumpy()) for v in tree.leaves(state.params)]


def _same(got, want):
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def unfused(data):
    return {level: _train(_make(level=level), data) for level in (None, "level2")}


# The gradients in the train state's order (tree.leaves: b1, b2, w1, w2) and the
# AllReduces "index" makes of them; the loss's own AllReduce is no gradient's and
# stays alone.
@pytest.mark.parametrize("points, buckets", [
    ([1, 3], [(32,), (10 + 64 * 32,), (32, 10)]),
    ([0], [(32 + 10 + 64 * 32 + 32 * 10,)]),
    ([2], [(32 + 10,), (64 * 32 + 32 * 10,)]),
    ([1, 2, 3], [(32,), (10,), (64, 32), (32, 10)]),
])
def test_index_mode_makes_one_allreduce_per_index_range(data, unfused, points, buckets):
    ap = _make({"allreduce": {"mode": "index", "config": points}})
    assert sorted(_psums(ap, data)) == sorted(buckets + [()])
    _same(_train(ap, data), unfused[None])


def test_reducescatter_buckets_zero_level2s_reduce_scatters_by_their_own_size(
        data, unfused):
    # level2 reduce-scatters the split gradients (w1, b1, w2; on CPU an AllReduce of
    # which each device keeps its block); b2 (10 elements, not divisible by 4) and the
    # loss are plain AllReduces
    plain = {(10,), ()}
    scatters = {(64, 32), (32,), (32, 10)}
    assert set(_psums(_make(level="level2"), data)) == plain | scatters
    tiny = _make({"openstate": True, "reducescatter": {"mode": "size", "config": 1e-6},
                  "allreduce": {"mode": "size", "config": 1e-6}}, "level2")
    assert set(_psums(tiny, data)) == plain | scatters
    one = _make({"reducescatter": {"mode": "auto", "config": None},
                 "allreduce": {"mode": "size", "config": 1e-6}}, "level2")
    assert sorted(_psums(one, data)) == [(), (10,), (64 * 32 + 32 + 32 * 10,)]
    _same(_train(one, data), unfused["level2"])
    # each key controls its own collectives: "allreduce" alone leaves the
    # reduce-scatters one per gradient, and "index" numbers only plain AllReduces
    only_allreduce = _make({"allreduce": {"mode": "auto", "config": None}}, "level2")
    assert sorted(_psums(only_allreduce, data)) == sorted(scatters | {(11,)})
    _same(_train(only_allreduce, data), unfused["level2"])
    index = _make({"allreduce": {"mode": "index", "config": [1]},
                   "reducescatter": {"mode": "size", "config": 1}}, "level2")
    assert sorted(_psums(index, data)) == [(), (10,), (64 * 32 + 32 + 32 * 10,)]
    off = _make({"openstate": False, "reducescatter": {"mode": "auto", "config": None}},
                "level2")
    assert set(_psums(off, data)) == plain | scatters


def test_the_options_record_each_key():
    ap = _make({"allreduce": {"mode": "index", "config": (3, 7)},
                "reducescatter": {"mode": "size", "config": 2}})
    assert ap.options.fusion_split_points == (3, 7) and ap.options.fusion_bytes is None
    assert ap.options.scatter_fusion_bytes == 2 * 2**20
    ap.comm_fusion({"allreduce": {"mode": "size", "config": 1}})
    assert ap.options.fusion_split_points is None and ap.options.scatter_fusion_bytes is None
    assert ap.options.fusion_bytes == 2**20


@pytest.mark.parametrize("points, got", [
    ([], r"got \[\]"), (None, "got None"), (3, "got 3"), ([2, 1], r"got \[2, 1\]"),
    ([1, 1], r"got \[1, 1\]"), ([-1, 2], r"got \[-1, 2\]"), ([True], r"got \[True\]"),
    ([1.0], r"got \[1.0\]"), ("12", "got '12'"),
])
def test_index_split_points_are_checked_as_mindspore_checks_them(points, got):
    ap = _make()
    with pytest.raises(fs.ArgumentError) as info:
        ap.comm_fusion({"allreduce": {"mode": "index", "config": points}})
    msg = str(info.value)
    assert msg.startswith("AutoParallel.comm_fusion(config): allreduce mode 'index' needs "
                          "config = a non-empty list of increasing non-negative ints")
    assert re.search(got, msg) and "\nFix: e.g." in msg
    assert ap.options.fusion_split_points is None  # nothing half-applied


def test_a_split_point_past_the_last_gradient_is_an_error(data):
    params, x, y = data
    ap = _make({"allreduce": {"mode": "index", "config": [1, 4]}})
    with pytest.raises(fs.ArgumentError, match=r"split point 4 is past the last gradient "
                                               r"\(this step has 4 gradients, indices "
                                               r"0\.\.3\)\.\nFix: split points below 4"):
        ap(ap.init(params), x, y)


def test_index_mode_with_gradient_accumulation_is_refused(data):
    params, x, y = data
    ap = _make({"allreduce": {"mode": "index", "config": [2]}}).gradient_accumulation(2)
    with pytest.raises(fs.ArgumentError, match=r"mode 'index' cannot be combined with "
                                               r"gradient_accumulation"):
        ap(ap.init(params), x, y)


def test_zero_level1s_gradients_are_reduce_scatters_too(data):
    # level1 reduces each split gradient whole and the update reads this device's
    # block of it: on CPU the same AllReduce-and-slice as level2's reduce-scatter
    scatters = {(64, 32), (32,), (32, 10)}
    only_allreduce = _make({"allreduce": {"mode": "auto", "config": None}}, "level1")
    assert set(_psums(only_allreduce, data)) == scatters | {(11,)}
    both = _make({"reducescatter": {"mode": "auto", "config": None}}, "level1")
    assert sorted(_psums(both, data)) == [(11,), (64 * 32 + 32 + 32 * 10,)]
