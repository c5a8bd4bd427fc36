"""The models the benchmarks share with their JAX baselines (benchmarks/model_specs.py)
are the models the benchmarks time: mindcv's resnet18 has the spec's parameters, name
for name and shape for shape, and the Llama block is built from the spec's values.
The JAX side's agreement (first losses, parameter counts) is checked by the benchmarks
themselves when they run with the JAX environment."""

from __future__ import annotations

import doctest
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import model_specs  # noqa: E402


def test_model_specs_doctests():
    result = doctest.testmod(model_specs)
    assert result.attempted and result.failed == 0


def test_resnet18_spec_is_mindcvs_resnet18():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("mindcv")
        from benchmarks import resnet
    net = resnet.example.make_model()
    resnet.load_spec_weights(net)  # raises unless every name, shape and trained flag match
    spec = model_specs.resnet18_weights()
    for p in net.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), spec[p.name])
    trained = sum(int(np.prod(p.shape)) for p in net.trainable_params())
    assert trained == 11181642


def test_resnet18_spec_mismatch_is_an_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("mindcv")
        from benchmarks import resnet
    net = resnet.example.make_model(num_classes=7)
    with pytest.raises(ValueError, match="classifier"):
        resnet.load_spec_weights(net)


def test_llama_block_uses_the_spec_values():
    from benchmarks import transformers

    block = transformers.LlamaBlock()
    spec = model_specs.llama_weights()
    got = {p.name: p.asnumpy() for p in block.trainable_params()}
    assert list(got) == list(spec)
    for k, v in spec.items():
        np.testing.assert_array_equal(got[k], v)
    cos, _ = model_specs.llama_rotary()
    np.testing.assert_array_equal(block.cos.asnumpy(), cos)
