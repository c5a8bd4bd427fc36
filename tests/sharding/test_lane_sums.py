"""On a virtual mesh a psum over several mesh axes is one sum of the devices' lanes
(``lane_sum``, merged by ``passes.merge_lane_sums``), never merged with a device's own
sums, and it adds the lanes in device order whatever the value's shape (so a value is
summed alike alone or in a fused bucket of gradients)."""

import re

import numpy as np
import pytest

import fshard as fs
from fshard.primitives.base import _REDUCE_SUM, lane_sum

RNG = np.random.default_rng(0)


def _calls(source: str, name: str) -> int:
    return len(re.findall(rf"= ms_{name}_\d+\(", source))


def test_a_psum_over_three_mesh_axes_is_one_lane_sum():
    # (1, 8) x (8, 1) on 8 devices (mesh axes 2 x 2 x 2): the contraction is split over
    # all three axes, and its pending sum is one AllReduce over them
    x = RNG.standard_normal((4, 16)).astype(np.float32)
    w = RNG.standard_normal((16, 4)).astype(np.float32)
    g = fs.shard(lambda x, w: x @ w, in_strategy=((1, 8), (8, 1)), mesh=8)
    assert g.partitioned(x, w).collectives() == ["psum"]
    lowered = fs.jit(g).lower(x, w)
    src = lowered.source
    assert _calls(src, "lane_sum") == 1, src
    assert not any(v is _REDUCE_SUM for v in lowered.globals.values()), src  # no row sum
    np.testing.assert_allclose(fs.jit(g)(x, w).asnumpy(), x @ w, rtol=1e-5,
                               atol=1e-5 * np.abs(x @ w).max())


def test_a_devices_own_row_sum_stays_apart_from_the_lane_sums():
    # data parallel value_and_grad: the bias gradient is each device's row sum, then the
    # AllReduce of the rows' sums; only the AllReduces' lane sums merge
    params = {"w": RNG.standard_normal((8, 3)).astype(np.float32),
              "b": RNG.standard_normal(3).astype(np.float32)}
    x = RNG.standard_normal((32, 8)).astype(np.float32)
    y = RNG.standard_normal((32, 3)).astype(np.float32)

    def loss(p, x, y):
        return ((x @ p["w"] + p["b"] - y) ** 2).sum()

    g = fs.shard(fs.value_and_grad(loss), in_strategy=(None, (8, 1), (8, 1)), mesh=8)
    assert sorted(g.partitioned(params, x, y).collectives()) == ["psum"] * 3
    lowered = fs.jit(g).lower(params, x, y)
    src = lowered.source
    # one lane sum per AllReduce (loss, w's and b's gradients), each over the 3 mesh
    # axes, which run as one lane dimension of 8 (runtime.merge_axes)
    assert _calls(src, "lane_sum") == 3, src
    assert src.count("axes=(0,)") >= 3, src
    # the loss's and b's own row sums: calls of the one ReduceSum kernel the module binds
    kernel = [k for k, v in lowered.globals.items() if v is _REDUCE_SUM]
    assert len(kernel) == 1, src
    assert len(re.findall(rf"= {kernel[0]}\(", src)) >= 2, src
    value, grads = fs.jit(g)(params, x, y)
    want_v, want_g = fs.jit(fs.value_and_grad(loss))(params, x, y)
    np.testing.assert_allclose(value.asnumpy(), want_v.asnumpy(), rtol=1e-5)
    for k in params:
        want = want_g[k].asnumpy()
        np.testing.assert_allclose(grads[k].asnumpy(), want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())


def test_a_shard_map_psum_over_two_axes_is_one_lane_sum():
    mesh = fs.Mesh((2, 4), ("a", "b"))
    x = RNG.standard_normal((8, 6)).astype(np.float32)

    def f(x):
        return fs.psum(x.sum(0, keepdims=True), ("a", "b"))

    g = fs.shard_map(f, in_strategy=(fs.Layout(mesh.shape, mesh.axis_names)(("a", "b"),
                                                                              "None"),),
                     out_strategy=fs.Layout(mesh.shape, mesh.axis_names)("None", "None"),
                     mesh=mesh)
    src = fs.jit(g).lower(x).source
    assert _calls(src, "lane_sum") == 1, src
    np.testing.assert_allclose(fs.jit(g)(x).asnumpy(), x.sum(0, keepdims=True), rtol=1e-5,
                               atol=1e-5 * np.abs(x).sum())


@pytest.mark.parametrize("lanes", [(2, 2), (2, 2, 2), (4, 2)])
def test_lanes_add_in_device_order_whatever_the_shape(lanes):
    # A scalar per device and the same scalars as a column of a larger value (as in a
    # fused bucket of gradients): the same bits, each the lanes added one after another
    n = int(np.prod(lanes))
    scale = RNG.uniform(0.1, 1000, (n, 64))
    vals = (RNG.standard_normal((n, 64)) * scale).astype(np.float32)
    axes = tuple(range(len(lanes)))
    alone = fs.jit(lambda v: lane_sum(v, axes))
    bucket = alone(vals.reshape(lanes + (64,))).asnumpy()
    want = vals[0].copy()
    for i in range(1, n):
        want = (want + vals[i]).astype(np.float32)
    np.testing.assert_array_equal(bucket, want)
    for j in range(8):
        got = alone(np.ascontiguousarray(vals[:, j].reshape(lanes))).asnumpy()
        assert got == want[j], (j, got, want[j])
