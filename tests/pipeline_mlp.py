"""The two-layer MLP the pipeline tests split into two stages: its parameters, batches
and loss (``fs.pipeline_split`` between the layers)."""

import numpy as np

import fshard as fs


def data(width: int, steps: int):
    """``(params, batches)``: a ``width -> 2 width -> width`` MLP and ``steps`` batches of
    ``width`` rows with labels below ``width``."""
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(0, 0.1, (width, 2 * width)).astype(np.float32),
              "b1": np.zeros(2 * width, np.float32),
              "w2": rng.normal(0, 0.1, (2 * width, width)).astype(np.float32),
              "b2": np.zeros(width, np.float32)}
    batches = [(rng.normal(size=(width, width)).astype(np.float32),
                rng.integers(0, width, width)) for _ in range(steps)]
    return params, batches


def loss(p, x, y):
    h = fs.ops.relu(x @ p["w1"] + p["b1"])
    h = fs.pipeline_split(h)
    return fs.ops.softmax_cross_entropy(h @ p["w2"] + p["b2"], y)


def mixing_optimizer():
    """Momentum whose update of stage 1's weights (``w2``, ``b2``) reads a sum of stage
    0's gradient (``w1``): an update that does not split by stage."""
    def init(params):
        return {k: np.zeros_like(v) for k, v in params.items()}

    def update(grads, state, params=None):
        pull = fs.ops.reduce_sum(grads["w1"]) * 0.01
        mom = {k: state[k] * 0.5 + g for k, g in grads.items()}
        return {k: m * -0.1 - (pull if k.endswith("2") else 0.0)
                for k, m in mom.items()}, mom

    return fs.optim.Optimizer(init, update)
