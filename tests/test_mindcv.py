"""Models written by others: mindcv's, unchanged, under fs.jit and fs.grad.

Their convolutions, pools and norms take fshard's native rules where there are some
and the generic path otherwise (MindSpore's own inference, bprop and lowering); either
way forward values and input gradients must equal MindSpore's. Ten architectures:
ResNet, MobileNet v2 and v3, EfficientNet, ViT, SqueezeNet (concatenated branches),
ShuffleNet v2 (channel shuffle, split), RegNet (grouped convolutions), GhostNet
(cheap operations, squeeze-excitation), ConvNeXt v2 (depthwise 7 x 7, LayerNorm,
global response normalisation) and DenseNet (dense concatenation). Training:
tests/test_train_cnn.py.
"""

from __future__ import annotations

import warnings

import mindspore as ms
import numpy as np
import pytest

import fshard as fs

with warnings.catch_warnings():  # mindcv's own imports warn (deprecated names)
    warnings.simplefilter("ignore")
    mindcv = pytest.importorskip("mindcv")


def _model(name: str):
    ms.set_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = mindcv.create_model(name, pretrained=False, num_classes=10)
    net.set_train(False)
    return net


def _close(got, want, rtol):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()))


def _check(name: str, size: int, batch: int = 1, rtol: float = 1e-4):
    net = _model(name)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((batch, 3, size, size))
                  .astype(np.float32))

    def loss(x):
        return (net(x) ** 2).sum()

    _close(fs.jit(net)(x).asnumpy(), net(x).asnumpy(), rtol)
    _close(fs.jit(fs.grad(loss))(x).asnumpy(), ms.grad(loss)(x).asnumpy(), rtol)


def test_resnet18_forward_and_input_gradient():
    _check("resnet18", 32)


@pytest.mark.full
@pytest.mark.parametrize("name,size", [("mobilenet_v2_075", 32), ("efficientnet_b0", 32),
                                       ("vit_b_32_224", 224), ("squeezenet1_1", 32),
                                       ("shufflenet_v2_x0_5", 32),
                                       ("mobilenet_v3_small_075", 32),
                                       ("regnet_x_200mf", 32),
                                       ("ghostnet_050", 32),
                                       ("convnextv2_atto", 32),
                                       ("densenet121", 32)])
def test_model_forward_and_input_gradient(name, size):
    _check(name, size)
