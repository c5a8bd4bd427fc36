"""On a virtual mesh, ``fs.shard`` runs the per-device Program batched once per mesh
axis; consecutive prime axes that the plan only ever names together, in mesh order,
run as one lane dimension (``fshard.sharding.runtime.merge_axes``). Checked here: which
axes merge, that a plan using them apart keeps them apart, that a primitive whose
parameters are per-axis keeps the mesh, and that merged programs give the unsharded
numbers."""

import numpy as np
import pytest

import fshard as fs
from fshard.core import tree
from fshard.core.ir import Equation, Program, Var
from fshard.core.tracing import ArrayType
from fshard.primitives import collectives as C
from fshard.sharding.runtime import _names, merge_axes

RNG = np.random.default_rng(3)


def _merged(part):
    mesh = part.prop.mesh
    axes = list(zip(mesh.names, mesh.sizes))
    dims = [[_names(sh, mesh) for sh in part.in_shardings],
            [_names(sh, mesh) for sh in part.out_shardings]]
    return merge_axes(part.program, axes, dims)


def _mlp_vg():
    params = {"w": RNG.standard_normal((16, 32)).astype(np.float32),
              "v": RNG.standard_normal((32, 4)).astype(np.float32)}
    x = RNG.standard_normal((32, 16)).astype(np.float32)

    def loss(p, x):
        return (fs.ops.relu(x @ p["w"]) @ p["v"]).sum()

    return fs.value_and_grad(loss), params, x


def _check_numbers(g, f, *args):
    got, want = fs.jit(g)(*args), fs.jit(f)(*args)
    for a, b in zip(tree.leaves(got), tree.leaves(want)):
        b = b.asnumpy()
        np.testing.assert_allclose(a.asnumpy(), b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_data_parallelism_over_every_device_runs_one_lane_axis():
    vg, params, x = _mlp_vg()
    g = fs.shard(vg, in_strategy=(None, (8, 1)), mesh=8)
    program, axes, (ins, _) = _merged(g.partitioned(params, x))
    assert axes == [("m0", 8)]
    assert ins[-1] == (("m0",), ())
    psums = [eq for eq in program.equations if eq.prim is C.psum_p]
    assert psums and all(eq.params["axis_name"] == ("m0",) for eq in psums)
    src = fs.jit(g).lower(params, x).source
    assert "(2, 2, 2" not in src, src   # no value carries the three prime lane axes
    _check_numbers(g, vg, params, x)


@pytest.mark.parametrize("strategy, want", [
    # batch over m0, hidden over (m1, m2): two lane axes, of 2 and 4
    (((2, 1), (1, 4), (4, 1)), [("m0", 2), ("m1", 4)]),
    # batch over (m0, m1), hidden over m2
    (((4, 1), (1, 2), (2, 1)), [("m0", 4), ("m2", 2)]),
])
def test_axes_used_apart_stay_apart(strategy, want):
    params = {"w": RNG.standard_normal((16, 32)).astype(np.float32),
              "v": RNG.standard_normal((32, 4)).astype(np.float32)}
    x = RNG.standard_normal((32, 16)).astype(np.float32)

    def loss(x, w, v):
        return (fs.ops.relu(x @ w) @ v).sum()

    vg = fs.value_and_grad(loss, argnums=(1, 2))
    g = fs.shard(vg, in_strategy=strategy, mesh=8)
    _, axes, _ = _merged(g.partitioned(x, params["w"], params["v"]))
    assert axes == want
    _check_numbers(g, vg, x, params["w"], params["v"])


def test_a_replicated_computation_needs_no_lane_axis_merge():
    # nothing split: every axis is unused, so all three merge (and nothing is batched)
    f = fs.shard(lambda a: a * 2.0, in_strategy=((1, 1),), mesh=8)
    a = RNG.standard_normal((4, 4)).astype(np.float32)
    _, axes, _ = _merged(f.partitioned(a))
    assert axes == [("m0", 8)]
    np.testing.assert_allclose(fs.jit(f)(a).asnumpy(), a * 2.0)


def test_a_primitive_with_per_axis_parameters_keeps_the_mesh():
    # ppermute's perm and broadcast's root are per-axis: a program naming them is left
    # as it is, even where every use names all the axes together
    x = Var(ArrayType((4,), np.dtype("float32")))
    y = Var(ArrayType((4,), np.dtype("float32")))
    names = ("m0", "m1", "m2")
    eq = Equation(C.ppermute_p, [x], {"axis_name": names, "axis_sizes": (2, 2, 2),
                                      "perm": ((0, 1), (1, 0))}, [y])
    program = Program([x], [eq], [y])
    axes = [("m0", 2), ("m1", 2), ("m2", 2)]
    dims = [[(names,)], [(names,)]]
    got = merge_axes(program, axes, dims)
    assert got[0] is program and got[1] == axes and got[2] == dims


def test_a_loop_body_is_renamed_with_the_program():
    # a psum inside a fori_loop body names the merged axis too
    w = RNG.standard_normal((8, 8)).astype(np.float32) / 4
    x = RNG.standard_normal((16, 8)).astype(np.float32)

    def f(x, w):
        return fs.fori_loop(0, 3, lambda i, h: fs.ops.tanh(h @ w), x).sum()

    vg = fs.value_and_grad(f, argnums=1)
    g = fs.shard(vg, in_strategy=((8, 1), None), mesh=8)
    program, axes, _ = _merged(g.partitioned(x, w))
    assert axes == [("m0", 8)]

    def every_axis_name(p):
        for eq in p.equations:
            if "axis_name" in eq.params:
                yield eq.params["axis_name"]
            for v in eq.params.values():
                for sub in (v if isinstance(v, tuple) else (v,)):
                    if isinstance(sub, Program):
                        yield from every_axis_name(sub)

    assert set(every_axis_name(program)) <= {("m0",)}
    _check_numbers(g, vg, x, w)
