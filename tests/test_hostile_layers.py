"""The folders of the layers: what moving modules between folders must not change."""

from __future__ import annotations

import os

import numpy as np
from mindspore import ops

import fshard as fs

HERE = os.path.basename(__file__)


def test_equations_name_the_user_line_whatever_folder_emits_them():
    # ops.sin goes through the adapter (fshard/adapter/), fs.ops.cos through fshard/ops.py
    # and the primitive families (fshard/primitives/); every equation must still name
    # this file, not a line of fshard.
    def f(x):
        return fs.ops.cos(ops.sin(x) * 2.0) + x.sum()

    prog = fs.make_ir(f)(np.ones(3, np.float32)).program
    sources = {eqn.source for eqn in prog.equations}
    assert sources and all(s is not None and s.startswith(HERE + ":") for s in sources), sources
