"""Transformers and recurrent nets under every transform, against MindSpore.

- A Llama-style decoder block written with plain ``mindspore.ops`` (RMSNorm, SiLU-gated
  MLP, rotary embedding with ``ops.cat``, causal mask with ``ops.triu`` +
  ``masked_fill``, multi-head attention by matmul and softmax): trained with
  ``fs.jit(fs.value_and_grad(...))`` and ``fs.optim.adam`` against MindSpore's own
  GRAPH-mode ``nn.TrainOneStepCell`` with ``nn.Adam``; per-example gradients under
  ``fs.vmap(fs.grad(...))`` against a loop; Megatron sharding (heads and MLP columns
  split over the mesh) with its collectives counted against the minimum.
- MindSpore's ``nn.TransformerEncoderLayer``: jit, grad against ``mindspore.grad``,
  per-example gradients, sharded.
- An ``nn.LSTM`` (and ``nn.GRU``) language model trained under ``fs.jit(fs.grad(...))``
  against GRAPH-mode MindSpore.
"""

from __future__ import annotations

import contextlib

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

import fshard as fs

B, S, DIM, HEADS, FF = 2, 8, 32, 4, 64
HEAD_DIM = DIM // HEADS


def _np(x):
    return x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x)


def close(got, want, rtol=1e-4):
    """float32 agreement scaled to the values' magnitude."""
    got, want = _np(got), _np(want)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


@contextlib.contextmanager
def graph_mode():
    """MindSpore's own GRAPH mode for the reference, PyNative again afterwards."""
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        yield
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


# ---------------------------------------------------------------------------
# A Llama-style decoder block in plain mindspore.ops
# ---------------------------------------------------------------------------


def rope_tables(seq, head_dim):
    inv = 1.0 / (10000 ** (np.arange(0, head_dim, 2) / head_dim))
    angles = np.outer(np.arange(seq), inv)
    angles = np.concatenate([angles, angles], -1)
    return (Tensor(np.cos(angles).astype(np.float32)),
            Tensor(np.sin(angles).astype(np.float32)))


def rms_norm(x, weight, eps=1e-6):
    return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + eps) * weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), axis=-1)


class LlamaBlock(nn.Cell):
    def __init__(self, heads=HEADS, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)

        def weight(*shape):
            w = rng.standard_normal(shape) / np.sqrt(shape[0])
            return Parameter(Tensor(w.astype(np.float32)))

        self.heads, self.head_dim = heads, DIM // heads
        self.scale = float(1.0 / np.sqrt(self.head_dim))
        self.wq, self.wk, self.wv, self.wo = (weight(DIM, DIM) for _ in range(4))
        self.w1, self.w3, self.w2 = weight(DIM, FF), weight(DIM, FF), weight(FF, DIM)
        self.attn_norm = Parameter(Tensor(np.ones(DIM, np.float32)))
        self.mlp_norm = Parameter(Tensor(np.ones(DIM, np.float32)))
        self.cos, self.sin = rope_tables(S, self.head_dim)
        self.mask = ops.triu(ops.ones((S, S), ms.float32), diagonal=1).astype(ms.bool_)

    def split_heads(self, t, b, s):
        return t.reshape(b, s, self.heads, self.head_dim).transpose(0, 2, 1, 3)

    def construct(self, x):
        b, s, d = x.shape
        h = rms_norm(x, self.attn_norm)
        q = self.split_heads(ops.matmul(h, self.wq), b, s)
        k = self.split_heads(ops.matmul(h, self.wk), b, s)
        v = self.split_heads(ops.matmul(h, self.wv), b, s)
        q = q * self.cos + rotate_half(q) * self.sin
        k = k * self.cos + rotate_half(k) * self.sin
        scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) * self.scale
        scores = scores.masked_fill(self.mask, -1e9)
        att = ops.matmul(ops.softmax(scores, axis=-1), v)
        x = x + ops.matmul(att.transpose(0, 2, 1, 3).reshape(b, s, d), self.wo)
        h = rms_norm(x, self.mlp_norm)
        return x + ops.matmul(ops.silu(ops.matmul(h, self.w1)) * ops.matmul(h, self.w3),
                              self.w2)


class MSELoss(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x, y):
        return ((self.net(x) - y) ** 2).mean()


def batch(seed=1, n=B):
    rng = np.random.default_rng(seed)
    return (Tensor(rng.standard_normal((n, S, DIM)).astype(np.float32)),
            Tensor(rng.standard_normal((n, S, DIM)).astype(np.float32)))


#: Megatron tensor parallelism over 4 devices: the q/k/v projections and the MLP's
#: gate and up projections split by columns (whole heads, whole hidden units per
#: device), the output projections by rows.
MEGATRON = {"wq": (1, 4), "wk": (1, 4), "wv": (1, 4), "wo": (4, 1),
            "w1": (1, 4), "w3": (1, 4), "w2": (4, 1)}


def test_llama_block_traces_natively():
    text = str(fs.make_ir(LlamaBlock())(batch()[0]))
    for name in ("concat", "select", "softmax", "sigmoid", "rsqrt", "matmul"):
        assert name in text
    # every operation has a native rule: no generic MindSpore primitive in the program
    assert not any(line.split("= ")[1][:1].isupper() for line in text.splitlines()
                   if "= " in line)


@pytest.mark.full
def test_llama_block_trains_as_mindspore_graph_mode():
    steps, lr = 10, 1e-2
    x, y = batch()
    net = MSELoss(LlamaBlock())
    with graph_mode():
        train = nn.TrainOneStepCell(net, nn.Adam(net.trainable_params(), lr))
        train.set_train()
        want = [float(train(x, y).asnumpy()) for _ in range(steps)]
    want_params = {k: p.asnumpy() for k, p in net.parameters_and_names()}

    apply, params = fs.functional(MSELoss(LlamaBlock()))
    opt = fs.optim.adam(lr)

    @fs.jit
    def step(params, state, x, y):
        loss, grads = fs.value_and_grad(apply)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return fs.optim.apply_updates(params, updates), state, loss

    state, got = opt.init(params), []
    for _ in range(steps):
        params, state, loss = step(params, state, x, y)
        got.append(float(loss.asnumpy()))
    assert want[-1] < 0.8 * want[0]  # it learns
    # float32 over 10 Adam steps: a few ulps of the loss per step, amplified by Adam's
    # normalisation of tiny gradients; MindSpore's eps sits inside the bias correction.
    close(np.array(got), np.array(want), rtol=1e-4)
    for k, v in want_params.items():
        close(params[k.removeprefix("net.") if k not in params else k], v, rtol=1e-3)


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.full)])
def test_llama_block_per_example_grads_equal_a_loop(jit):
    apply, params = fs.functional(MSELoss(LlamaBlock()))
    x, y = batch(n=2)

    def example_loss(p, xi, yi):
        return apply(p, xi[None], yi[None])

    wrap = fs.jit if jit else (lambda f: f)
    per_example = wrap(fs.vmap(fs.grad(example_loss), in_axes=(None, 0, 0)))(params, x, y)
    one = wrap(fs.grad(example_loss))
    for i in range(2):
        g = one(params, x[i], y[i])
        for k in params:
            close(per_example[k][i], g[k])


@pytest.fixture(scope="module")
def megatron():
    block = LlamaBlock()
    x = batch()[0]
    return block, x, fs.shard(block, in_strategy=(None,), parameter_plan=MEGATRON, mesh=4)


def test_llama_block_megatron_forward_one_allreduce_per_sub_block(megatron):
    # The minimum: attention's output projection and the MLP's down projection each
    # give a pending sum over the 4 devices; RMSNorm needs the whole row before the
    # MLP, so each sub-block reduces once (Megatron's two AllReduces per layer).
    block, x, sharded = megatron
    part = sharded.partitioned(x)
    assert part.collectives() == ["psum", "psum"]
    # each device holds one head: q is (B, 1, S, HEAD_DIM) there
    assert f"f32[{B},1,{S},{HEAD_DIM}] = transpose" in str(part.program)
    close(sharded(x), block(x))


def test_llama_block_megatron_training_step():
    # value_and_grad of the loss, sharded: the weight gradients stay in their weights'
    # blocks. The minimum is four AllReduces, all on the block's (B, S, DIM)
    # activations: the forward's two and one input gradient through each sub-block
    # (the q, k and v projections' input gradients summed first). The loss and the two
    # RMSNorm weights' gradients are computed whole on every device from replicated
    # values: no AllReduce of their own (nine before, the three of those and two more
    # for q, k and v reduced one by one; ten before the gate and up projections' input
    # gradients were summed first, twenty with gathers before an operand's producers
    # were decided first).
    block = LlamaBlock()
    x, y = batch()
    apply, params = fs.functional(MSELoss(block))
    plan = {f"net.{k}": v for k, v in MEGATRON.items()}
    strategy = {k: plan.get(k) for k in params}
    sharded = fs.shard(fs.value_and_grad(apply), in_strategy=(strategy, None, None),
                       out_strategy=(None, strategy), mesh=4)
    part = sharded.partitioned(params, x, y)
    assert part.collectives() == ["psum"] * 4, part.collectives()
    reduced = [tuple(eq.inputs[0].aval.shape) for eq in part.program.equations
               if eq.prim.name == "psum"]
    assert reduced == [(B, S, DIM)] * 4, reduced
    (value, grads), (want_value, want_grads) = (sharded(params, x, y),
                                                fs.value_and_grad(apply)(params, x, y))
    close(value, want_value)
    for k in params:
        close(grads[k], want_grads[k])


@pytest.mark.full
def test_llama_block_megatron_on_8_devices_with_8_heads():
    block = LlamaBlock(heads=8)
    x = batch()[0]
    plan = {k: tuple(8 if s == 4 else 1 for s in v) for k, v in MEGATRON.items()}
    sharded = fs.shard(block, in_strategy=(None,), parameter_plan=plan, mesh=8)
    assert sharded.partitioned(x).collectives() == ["psum", "psum"]
    close(sharded(x), block(x))


# ---------------------------------------------------------------------------
# MindSpore's nn.TransformerEncoderLayer
# ---------------------------------------------------------------------------


def encoder_layer():
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.0,
                                       batch_first=True)
    layer.set_train(False)
    return layer


def encoder_batch(n=2, seed=3):
    rng = np.random.default_rng(seed)
    return Tensor(rng.standard_normal((n, 5, 16)).astype(np.float32))


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.full)])
def test_transformer_encoder_layer_grad_as_mindspore(jit):
    layer, x = encoder_layer(), encoder_batch()
    apply, params = fs.functional(layer)

    def loss(p, x):
        return (apply(p, x) ** 2).mean()

    wrap = fs.jit if jit else (lambda f: f)
    close(wrap(loss)(params, x), (layer(x) ** 2).mean())
    got = wrap(fs.grad(loss))(params, x)
    want = ms.grad(lambda x: (layer(x) ** 2).mean(), None, layer.trainable_params())(x)
    names = [name for name, p in layer.parameters_and_names() if p.requires_grad]
    assert len(names) == len(want)
    for name, w in zip(names, want):
        close(got[name], w)


@pytest.mark.full
def test_transformer_encoder_layer_per_example_grads_equal_a_loop():
    layer, x = encoder_layer(), encoder_batch(n=3)
    apply, params = fs.functional(layer)

    def example_loss(p, xi):
        return (apply(p, xi[None]) ** 2).mean()

    per_example = fs.jit(fs.vmap(fs.grad(example_loss), in_axes=(None, 0)))(params, x)
    one = fs.jit(fs.grad(example_loss))
    for i in range(3):
        g = one(params, x[i])
        for k in params:
            close(per_example[k][i], g[k])


def test_transformer_encoder_layer_batch_split():
    layer, x = encoder_layer(), encoder_batch(n=4)
    sharded = fs.shard(layer, in_strategy=((4, 1, 1),), out_strategy=((4, 1, 1),), mesh=4)
    # Data parallelism needs no communication, but MultiheadAttention flattens
    # (seq, batch) with the batch as the inner factor: a batch block is not a block of
    # the flattened rows, so the packed in-projection gathers the batch and the layer
    # runs replicated from there (docs/models.md). The result is the unsharded one.
    assert sharded.partitioned(x).collectives() in ([], ["all_gather"])
    close(sharded(x), layer(x))


def test_transformer_encoder_layer_packed_projection_split_by_heads():
    # The packed in-projection (3*d, d) is split by rows: each device holds its heads'
    # rows of q, k and v only if the split lines up with the three blocks; a
    # propagation that cannot keep heads whole regathers. Whatever it picks, the
    # result is the unsharded one.
    layer, x = encoder_layer(), encoder_batch()
    plan = {"self_attn.out_proj.weight": (1, 4), "dense1.weight": (4, 1),
            "dense2.weight": (1, 4)}
    sharded = fs.shard(layer, in_strategy=(None,), parameter_plan=plan, mesh=4)
    close(sharded(x), layer(x))


def test_tensor_split_methods_trace():
    x = Tensor(np.arange(20, dtype=np.float32).reshape(2, 10))
    for method, args in (("tensor_split", (3,)), ("tensor_split", ((2, 5),)),
                         ("split", (3,)), ("chunk", (3,))):
        got = fs.vmap(lambda x, m=method, a=args: getattr(x, m)(*a, axis=0))(x)
        want = getattr(x, method)(*args, axis=1)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(_np(g), _np(w))


# ---------------------------------------------------------------------------
# Recurrent language models
# ---------------------------------------------------------------------------

VOCAB, SEQ = 20, 6


class RecurrentLM(nn.Cell):
    def __init__(self, rnn=nn.LSTM):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.rnn = rnn(8, 16, batch_first=True)
        self.head = nn.Dense(16, VOCAB)
        self.loss = nn.CrossEntropyLoss()

    def construct(self, tokens, labels):
        h, _ = self.rnn(self.embed(tokens))
        return self.loss(self.head(h).reshape(-1, VOCAB), labels.reshape(-1))


def tokens(seed=5):
    rng = np.random.default_rng(seed)
    return (Tensor(rng.integers(0, VOCAB, (3, SEQ)).astype(np.int32)),
            Tensor(rng.integers(0, VOCAB, (3, SEQ)).astype(np.int32)))


def train_recurrent_as_mindspore(rnn, steps=4, lr=0.5):
    ms.set_seed(0)
    net = RecurrentLM(rnn)
    init = {k: Tensor(p.asnumpy()) for k, p in net.parameters_and_names()}
    tok, lab = tokens()
    with graph_mode():
        train = nn.TrainOneStepCell(net, nn.SGD(net.trainable_params(), lr))
        train.set_train()
        want = [float(train(tok, lab).asnumpy()) for _ in range(steps)]

    ours = RecurrentLM(rnn)
    for k, p in ours.parameters_and_names():
        p.set_data(init[k])
    apply, params = fs.functional(ours)
    opt = fs.optim.sgd(lr)
    grad = fs.jit(fs.value_and_grad(apply))
    state, got = opt.init(params), []
    for _ in range(steps):
        loss, g = grad(params, tok, lab)
        updates, state = opt.update(g, state, params)
        params = fs.optim.apply_updates(params, updates)
        got.append(float(loss.asnumpy()))
    return got, want


@pytest.mark.full
def test_lstm_language_model_trains_as_mindspore_graph_mode():
    got, want = train_recurrent_as_mindspore(nn.LSTM)
    assert want[-1] < want[0]
    close(np.array(got), np.array(want))


@pytest.mark.full
def test_gru_language_model_trains_as_mindspore_graph_mode():
    got, want = train_recurrent_as_mindspore(nn.GRU)
    assert want[-1] < want[0]
    close(np.array(got), np.array(want))


# ---------------------------------------------------------------------------
# Parameters a Cell holds in a ParameterTuple (nn.LSTM, nn.GRU, nn.RNN)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU])
def test_recurrent_weights_get_their_gradient_as_mindspore(rnn):
    # nn.LSTM's construct reads its weights from ParameterTuple attributes
    # (w_ih_list, ...), which hold the same Parameters a second time: fs.functional
    # swaps those too (it used to swap only the Parameters' own slots, so the traced
    # function read the old Parameters as constants: zero gradients, no training).
    net, (tok, lab) = RecurrentLM(rnn), tokens()
    apply, params = fs.functional(net)
    got = fs.grad(apply)(params, tok, lab)
    want = ms.grad(net, None, net.trainable_params())(tok, lab)
    names = [n for n, p in net.parameters_and_names() if p.requires_grad]
    for name, w in zip(names, want):
        assert np.abs(_np(w)).max() > 0
        close(got[name], w)
    # the ParameterTuples are MindSpore's own again afterwards
    assert type(net.rnn.w_ih_list) is ms.ParameterTuple
    assert net.rnn.w_ih_list[0] is dict(net.parameters_and_names())["rnn.weight_ih_l0"]


def test_recurrent_weights_traced_by_nested_transforms():
    net, (tok, lab) = RecurrentLM(nn.LSTM), tokens()
    apply, params = fs.functional(net)
    got = fs.grad(lambda p: fs.jit(apply)(p, tok, lab))(params)
    want = ms.grad(net, None, net.trainable_params())(tok, lab)
    names = [n for n, p in net.parameters_and_names() if p.requires_grad]
    for name, w in zip(names, want):
        close(got[name], w)
