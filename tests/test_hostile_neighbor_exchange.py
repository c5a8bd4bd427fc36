"""The pieces that let a rank receiving nothing from a NeighborExchange(V2) take part in
its AllGather (``after``, ``keep`` in fshard/primitives/collectives.py), and a compiled
program with no outputs that still runs for its effects. The exchanges themselves run
in a real job: tests/distributed/test_neighbor_exchange_multiprocess.py."""

from __future__ import annotations

import numpy as np
import pytest

import fshard as fs
from fshard.primitives import collectives as C


def test_after_is_its_first_operand_and_hands_its_second_an_instantiated_zero():
    x = np.arange(3, dtype=np.float32)
    dep = np.ones((2, 2), np.float32)
    f = fs.jit(lambda a, d: C.after_p.bind(a, d) * 2)
    np.testing.assert_array_equal(f(x, dep).asnumpy(), 2 * x)
    da, dd = fs.jit(fs.grad(lambda a, d: (C.after_p.bind(a, d) * a).sum(), argnums=(0, 1)))(
        x, dep)
    np.testing.assert_array_equal(da.asnumpy(), 2 * x)
    np.testing.assert_array_equal(dd.asnumpy(), np.zeros((2, 2), np.float32))
    # the zero cotangent is a value of the program (a collective transposed from it is
    # staged with the rest), not a symbolic zero dropped from the backward pass
    ir = str(fs.make_ir(fs.grad(lambda a, d: C.after_p.bind(a, d).sum(), argnums=1))(x, dep))
    assert ir.count("after") == 2, ir


def test_keep_refuses_differentiation_with_its_message():
    f = lambda v: (C.keep_p.bind(v * 2, refusal="no gradient here.\nFix: x."), v.sum())[1]
    np.testing.assert_array_equal(fs.jit(f)(np.ones(3, np.float32)).asnumpy(), 3.0)
    with pytest.raises(fs.errors.UnsupportedOpError, match="no gradient here"):
        fs.grad(f)(np.ones(3, np.float32))


def test_a_compiled_function_with_no_outputs_runs_for_its_effects():
    # (its program was never run: a debug callback in it was silently skipped)
    seen = []
    f = fs.jit(lambda v: fs.debug.callback(lambda a: seen.append(a.copy()), v * 2))
    assert f(np.arange(3, dtype=np.float32)) is None
    assert f(np.ones(3, np.float32)) is None  # returns once the callback ran
    assert [s.tolist() for s in seen] == [[0.0, 2.0, 4.0], [2.0, 2.0, 2.0]]
