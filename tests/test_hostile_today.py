"""Hostile checks of the native conv/pool and norm families, ring attention, MindSpore's
collective op classes and optimizers, and cell.shard / set_inputs: each one a case that
was wrong (or a raw Python error) before its fix."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

import fshard as fs


class _Outer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.inner = nn.Dense(4, 6)
        self.inner.shard(in_strategy=((2, 1),))

    def construct(self, x):
        return ops.relu(self.inner(x)).sum()


def test_cell_shard_on_a_sub_cell_never_called_eagerly():
    # the sub-Cell's first-call checks ran on tracers (a raw AttributeError) when the
    # network was traced before any eager call
    ms.set_seed(0)
    net = _Outer()
    x = Tensor(np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32))
    with fs.Mesh((2,), ("d",)):
        got = fs.jit(net)(x).asnumpy()
    want = net(x).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, abs(float(want))))


def test_set_inputs_with_a_dynamic_rank_takes_each_calls_shape():
    # Tensor(shape=None) is MindSpore's dynamic rank (shape [-2]); it was read as a
    # rank-1 declaration and every call was refused
    class Net(nn.Cell):
        def construct(self, x, y):
            return x.sum() + y.sum()

    net = Net()
    net.set_inputs(Tensor(shape=None, dtype=ms.float32), Tensor(shape=[None], dtype=ms.float32))
    f = fs.jit(net)
    y = Tensor(np.ones(2, np.float32))
    for shape in ((3, 4), (5,), (2, 1, 3)):
        x = Tensor(np.ones(shape, np.float32))
        assert float(f(x, y).asnumpy()) == float(net(x, y).asnumpy())


def _cond_with_callbacks(seen, with_operands):
    def pos(y):
        if with_operands:
            fs.debug.callback(lambda v: seen.append("pos"), y)
        else:
            fs.debug.callback(lambda: seen.append("pos"))
        return y

    def neg(y):
        if with_operands:
            fs.debug.callback(lambda v: seen.append("neg"), y)
        else:
            fs.debug.callback(lambda: seen.append("neg"))
        return -y

    return fs.jit(lambda x: fs.cond(x.sum() > 0, pos, neg, x))


def test_a_callback_in_a_cond_branch_runs_only_when_that_branch_is_taken():
    # cheap branches were all evaluated and selected (both callbacks ran), and a branch
    # ending in a callback made the cond itself an effect (its output undefined)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for with_operands in (False, True):
        seen = []
        f = _cond_with_callbacks(seen, with_operands)
        for sign, want in ((1, "pos"), (-1, "neg"), (1, "pos")):
            out = f(sign * x).asnumpy()
            np.testing.assert_array_equal(out, x)
            assert seen == [want], (with_operands, sign, seen)
            seen.clear()


def test_a_loop_body_ending_in_a_callback():
    seen = []

    def body(c):
        c = c + 1
        fs.debug.callback(lambda v: seen.append(int(v)), c)
        return c

    out = fs.jit(lambda c: fs.while_loop(lambda c: c < 3, body, c))(np.int32(0))
    assert int(out.asnumpy()) == 3 and seen == [1, 2, 3]


def test_momentum_with_nesterov_takes_nesterov_steps():
    # MindSpore 2.10's CPU ApplyMomentum ignores use_nesterov; fshard's nn.Momentum
    # translation takes the Nesterov steps MindSpore's nn.SGD(nesterov=True) takes
    from fshard.training.parallel.ms_optimizers import from_mindspore

    def nets():
        ms.set_seed(0)
        a, b = nn.Dense(4, 3), nn.Dense(4, 3)
        for pa, pb in zip(a.trainable_params(), b.trainable_params()):
            pb.set_data(Tensor(pa.asnumpy()))
        return a, b

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(6, 4)).astype(np.float32),
                rng.normal(size=(6, 3)).astype(np.float32)) for _ in range(3)]
    a, b = nets()
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        step = nn.TrainOneStepCell(nn.WithLossCell(a, nn.MSELoss()), nn.SGD(
            a.trainable_params(), 0.1, momentum=0.9, nesterov=True))
        step.set_train()
        want_losses = [float(step(Tensor(x), Tensor(y)).asnumpy()) for x, y in batches]
    finally:
        ms.set_context(mode=mode)
    want = {p.name: p.asnumpy() for p in a.trainable_params()}

    apply, params = fs.functional(nn.WithLossCell(b, nn.MSELoss()))
    tx = from_mindspore(nn.Momentum(b.trainable_params(), 0.1, 0.9, use_nesterov=True),
                        params)
    values = {k: Tensor(v.asnumpy()) for k, v in params.items()}
    state = tx.init(values)

    @fs.jit
    def train(values, state, x, y):
        loss, grads = fs.value_and_grad(apply)(values, x, y)
        updates, state = tx.update(grads, state, values)
        return fs.optim.apply_updates(values, updates), state, loss

    got_losses = []
    for x, y in batches:
        values, state, loss = train(values, state, x, y)
        got_losses.append(float(loss.asnumpy()))
    got = {k.removeprefix("_backbone."): v.asnumpy() for k, v in values.items()}
    np.testing.assert_allclose(got_losses, want_losses, rtol=2e-5, atol=1e-6)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5,
                                   atol=2e-6 * max(1.0, float(np.abs(want[k]).max())))


def test_ops_print_of_numbers_tuples_and_lists_prints_as_mindspore(capfd):
    # a tuple was refused (ArgumentError) and a number printed as a 0-d Tensor
    x = Tensor(np.arange(2, dtype=np.float32))

    def f(x):
        ops.Print()("n", 3, (x, "a"), [2.5, x * 2])
        return x + 1

    f(x)  # MindSpore's own Print
    want = [ln for ln in capfd.readouterr().out.splitlines() if ln.strip()]
    fs.block_until_ready(fs.jit(f)(x))
    got = [ln for ln in capfd.readouterr().out.splitlines() if ln.strip()]
    assert got == want and want[1] == "3" and want[2].endswith("'a')")


def test_debug_print_checks_its_format_fields_when_tracing():
    # a field without its argument was a raw IndexError/KeyError raised in the running
    # program
    import pytest

    x = np.arange(3, dtype=np.float32)
    for fmt, kwargs, what in (("{} {}", {}, "field 2"), ("{s}", {}, "keyword 's'"),
                              ("{1}", {}, "positional argument 1"), ("{", {}, "malformed"),
                              ("{} {0}", {}, "mixes")):
        with pytest.raises(fs.ArgumentError, match=what):
            fs.jit(lambda x: (fs.debug.print(fmt, x, **kwargs), x)[1])(x)
    out = fs.jit(lambda x: (fs.debug.print("{} {s[0]} {{}}", x, s=x), x)[1])(x)
    np.testing.assert_array_equal(out.asnumpy(), x)


def test_bicubic_interpolate_has_its_output_type_and_gradient():
    # ops.interpolate(mode="bicubic") passes its size as a Tensor; shape inference ran
    # the op on a sampled size of ones, so the output was typed 1x1 and the gradient
    # (whose cotangent had that type) was wrong, silently
    rng = np.random.default_rng(0)
    x = Tensor(rng.normal(size=(1, 1, 5, 6)).astype(np.float32))
    c = Tensor(rng.normal(size=(1, 1, 8, 11)).astype(np.float32))

    def loss(x):
        return (ops.interpolate(x, size=(8, 11), mode="bicubic") * c).sum()

    assert fs.eval_shape(lambda x: ops.interpolate(x, size=(8, 11), mode="bicubic"),
                         x).shape == (1, 1, 8, 11)
    want = ms.grad(loss)(x).asnumpy()
    got = fs.jit(fs.grad(loss))(x).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_reshape_to_a_concrete_tensor_shape_as_mindspore():
    # MindSpore's ops.reshape takes a Tensor shape; fshard refused it
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for shape in (Tensor(np.array([6, 4]), ms.int64), Tensor(np.array([4, -1]), ms.int32),
                  (Tensor(2, ms.int32), 12)):
        want = ops.reshape(Tensor(x), shape).asnumpy()
        got = fs.jit(lambda x, shape=shape: ops.reshape(x, shape))(x).asnumpy()
        np.testing.assert_array_equal(got, want)
