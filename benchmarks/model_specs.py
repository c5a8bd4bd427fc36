"""The models both the MindSpore benchmarks and their JAX baselines build, as NumPy.

Pure NumPy (no MindSpore, no JAX) so that fshard's environment and the JAX
environment (``benchmarks/jax_baselines.py``) import the same definitions: the
parameter names and shapes, the deterministic initial values and the batches. The
MindSpore side loads these values into its network and checks its first losses
against the JAX baseline's, so the two rows are known to time the same model.

>>> shapes = resnet18_shapes()
>>> sum(int(np.prod(s)) for n, s in shapes.items() if trainable(n))
11181642
>>> sorted(llama_weights())[:3]
['attn_norm', 'mlp_norm', 'w1']
"""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------------------
# ResNet-18: mindcv's resnet18 (benchmarks/resnet.py), its parameter names
# ---------------------------------------------------------------------------

RESNET_BATCH, RESNET_SIZE, RESNET_CLASSES = 16, 32, 10
#: ``(channels, first block's stride)`` of the four stages, two BasicBlocks each
RESNET_STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))
BN_STATS = ("moving_mean", "moving_variance")


def trainable(name: str) -> bool:
    """Whether the parameter ``name`` is trained (BatchNorm's moving statistics are not)."""
    return name.rsplit(".", 1)[-1] not in BN_STATS


def resnet18_shapes(classes: int = RESNET_CLASSES) -> dict:
    """``{name: shape}`` of mindcv's ``resnet18`` in its order: convolutions without
    bias (OIHW), BatchNorm's moving mean and variance, gamma and beta, the dense head
    ``(classes, 512)`` with its bias."""
    shapes = {}

    def conv(name, out, inp, k):
        shapes[f"{name}.weight"] = (out, inp, k, k)

    def bn(name, c):
        for s in (*BN_STATS, "gamma", "beta"):
            shapes[f"{name}.{s}"] = (c,)

    conv("conv1", 64, 3, 7)
    bn("bn1", 64)
    cin = 64
    for stage, (c, stride) in enumerate(RESNET_STAGES, 1):
        for block in range(2):
            p = f"layer{stage}.{block}"
            conv(f"{p}.conv1", c, cin, 3)
            bn(f"{p}.bn1", c)
            conv(f"{p}.conv2", c, c, 3)
            bn(f"{p}.bn2", c)
            if block == 0 and (stride != 1 or cin != c):
                conv(f"{p}.down_sample.0", c, cin, 1)
                bn(f"{p}.down_sample.1", c)
            cin = c
    shapes["classifier.weight"] = (classes, 512)
    shapes["classifier.bias"] = (classes,)
    return shapes


def resnet18_weights(seed: int = 0, classes: int = RESNET_CLASSES) -> dict:
    """mindcv's initialisation scheme, drawn with NumPy: He normal (fan out, relu) for
    the convolutions, He uniform (fan in, gain 1) for the dense weight, zero bias,
    gamma 1, beta 0, moving mean 0, moving variance 1. float32."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in resnet18_shapes(classes).items():
        leaf = name.rsplit(".", 1)[-1]
        if name == "classifier.weight":
            bound = np.sqrt(3.0 / shape[1])
            w = rng.uniform(-bound, bound, shape)
        elif leaf == "weight":  # a convolution: fan out = out channels * kernel area
            w = rng.standard_normal(shape) * np.sqrt(2.0 / (shape[0] * shape[2] * shape[3]))
        elif leaf in ("gamma", "moving_variance"):
            w = np.ones(shape)
        else:  # beta, moving_mean, the dense bias
            w = np.zeros(shape)
        out[name] = w.astype(np.float32)
    return out


def resnet18_batch(seed: int = 0, batch: int = RESNET_BATCH, size: int = RESNET_SIZE,
                   classes: int = RESNET_CLASSES):
    """``(x, y)``: float32 images ``(batch, 3, size, size)``, int32 labels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 3, size, size)).astype(np.float32)
    return x, rng.integers(0, classes, batch).astype(np.int32)


# ---------------------------------------------------------------------------
# The Llama-style block of benchmarks/transformers.py (docs/models.md)
# ---------------------------------------------------------------------------

LLAMA_B, LLAMA_S, LLAMA_DIM, LLAMA_HEADS, LLAMA_FF = 4, 64, 128, 4, 352


def llama_weights(seed: int = 0, dim: int = LLAMA_DIM, ff: int = LLAMA_FF) -> dict:
    """The block's nine trained weights: ``standard_normal(shape) / sqrt(shape[0])``
    for the projections (drawn in the order wq, wk, wv, wo, w1, w3, w2), ones for the
    two RMSNorm scales. float32."""
    rng = np.random.default_rng(seed)
    shapes = {"wq": (dim, dim), "wk": (dim, dim), "wv": (dim, dim), "wo": (dim, dim),
              "w1": (dim, ff), "w3": (dim, ff), "w2": (ff, dim)}
    out = {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
           for k, s in shapes.items()}
    out["attn_norm"] = np.ones(dim, np.float32)
    out["mlp_norm"] = np.ones(dim, np.float32)
    return out


def llama_rotary(seq: int = LLAMA_S, head_dim: int = LLAMA_DIM // LLAMA_HEADS):
    """``(cos, sin)`` of the rotary embedding, ``(seq, head_dim)`` float32."""
    inv = 1.0 / (10000 ** (np.arange(0, head_dim, 2) / head_dim))
    angles = np.outer(np.arange(seq), inv)
    angles = np.concatenate([angles, angles], -1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def llama_batch(seed: int = 1):
    """``(x, y)``: inputs and MSE targets, ``(batch, seq, dim)`` float32 each."""
    rng = np.random.default_rng(seed)
    shape = (LLAMA_B, LLAMA_S, LLAMA_DIM)
    x = rng.standard_normal(shape).astype(np.float32)
    return x, rng.standard_normal(shape).astype(np.float32)
