"""MNIST-format files for the seeds' ``ds.MnistDataset(DATA_PATH)`` (no MNIST ships
offline): scikit-learn's digits, scaled to 28 x 28, written as MNIST's idx files."""

from __future__ import annotations

import os

import numpy as np


def write_mnist(directory: str, n: int = 64) -> str:
    """``directory`` with ``train-images-idx3-ubyte`` / ``train-labels-idx1-ubyte`` of
    ``n`` digits; returns it."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images[:n] * (255.0 / 16.0)  # 8 x 8 in [0, 16]
    big = np.kron(images, np.ones((3, 3)))  # 24 x 24
    big = np.pad(big, ((0, 0), (2, 2), (2, 2))).astype(np.uint8)
    labels = digits.target[:n].astype(np.uint8)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "train-images-idx3-ubyte"), "wb") as fh:
        fh.write(np.array([2051, n, 28, 28], ">i4").tobytes() + big.tobytes())
    with open(os.path.join(directory, "train-labels-idx1-ubyte"), "wb") as fh:
        fh.write(np.array([2049, n], ">i4").tobytes() + labels.tobytes())
    return directory
