"""A seed script run as its MindSpore user wrote it: the training layer's wrong answers.

- a loss Cell that captures constants while traced (``nn.CrossEntropyLoss`` in
  ``nn.WithLossCell``) gets the right parameter strategies, state strategies and
  memory report;
- MindSpore's auto-parallel context (``ms.set_auto_parallel_context``) takes effect
  or is refused by name;
- MindSpore's ``Pipeline`` wrapper is honoured or refused, never 4x;
- ``semi_auto`` runs unannotated operators data parallel over the batch split;
- a frozen Parameter (``requires_grad=False``) is not trained;
- a pipelined loss written as ``sum / global_batch`` gives the unpipelined numbers.
"""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import fshard as fs


def close(got, want, rtol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


class MLP(nn.Cell):
    def __init__(self, d_in=64, hidden=16, d_out=10):
        super().__init__()
        self.layer1 = nn.Dense(d_in, hidden)
        self.layer2 = nn.Dense(hidden, d_out)

    def construct(self, x):
        return self.layer2(ms.ops.relu(self.layer1(x)))


class XentLoss(nn.Cell):
    """The same loss as ``nn.CrossEntropyLoss`` written with fs.ops (no constants)."""

    def __init__(self, net):
        super().__init__()
        self._backbone = net

    def construct(self, x, y):
        return fs.ops.softmax_cross_entropy(self._backbone(x), y).mean()


def digits_batch(rows=16, d_in=64, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, d_in)).astype(np.float32),
            rng.integers(0, 10, rows).astype(np.int32))


# ---------------------------------------------------------------------------
# A loss whose tracing captures constants
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def xent_pair():
    """The same MLP under nn.CrossEntropyLoss (which captures constants when traced)
    and under fs.ops.softmax_cross_entropy, on a mesh of 2 with ZeRO level1."""
    ms.set_seed(0)
    net = MLP()
    with_consts = fs.AutoParallel(nn.WithLossCell(net, nn.CrossEntropyLoss()),
                                  fs.optim.adam(1e-2), mesh=2).hsdp(threshold=0)
    plain = fs.AutoParallel(XentLoss(net), fs.optim.adam(1e-2), mesh=2).hsdp(threshold=0)
    return with_consts, plain, digits_batch()


def test_loss_cell_with_constants_reports_true_parameter_strategies(xent_pair, tmp_path):
    with_consts, plain, (x, y) = xent_pair
    s1, s2 = with_consts.init(), plain.init()
    got = with_consts.save_param_strategy_file(tmp_path / "a.json", s1, x, y)["params"]
    want = plain.save_param_strategy_file(tmp_path / "b.json", s2, x, y)["params"]
    assert got == want
    assert got["_backbone.layer1.weight"] == [1, 1]
    assert json.loads((tmp_path / "a.json").read_text())["params"] == want


def test_loss_cell_with_constants_reports_true_state_strategies_and_memory(xent_pair):
    with_consts, plain, (x, y) = xent_pair
    s1, s2 = with_consts.init(), plain.init()
    assert with_consts.state_strategies(s1, x, y) == plain.state_strategies(s2, x, y)
    assert with_consts.state_strategies(s1, x, y).params["_backbone.layer1.weight"] == (1, 1)
    got, want = with_consts.memory_report(s1, x, y), plain.memory_report(s2, x, y)
    assert got == want
    n_params = 64 * 16 + 16 + 16 * 10 + 10
    assert got["params"] == 4 * n_params
