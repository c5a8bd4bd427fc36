"""fshard.core.context: tracing state is per thread.

Transforms keep their state (current trace, bound axes, mesh, nesting depths) in
``contextvars``; MindSpore's patched entry points are shared by every thread under a
lock. Several threads transforming at once must each get their own right answers and
leave the process healthy.
"""

from __future__ import annotations

import threading

import mindspore as ms
import numpy as np
from mindspore import ops

import fshard as fs
from fshard.core import context


def _run_threads(work, n=4):
    errors: list = []

    def guarded(k):
        try:
            work(k)
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(f"thread {k}: {e!r}")

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors


def test_threads_transforming_at_once_get_their_own_answers_and_leave_fshard_healthy():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    add_before = ms.Tensor.__add__

    def work(k):
        for i in range(8):
            c = float(k * 100 + i)
            out = fs.vmap(lambda a: ops.sin(a) * c)(x)
            assert isinstance(out, ms.Tensor), type(out)
            np.testing.assert_allclose(out.asnumpy(), np.sin(x) * c, rtol=1e-5, atol=1e-5 * c)
            g = fs.grad(lambda a: (a * a * c).sum())(x)
            np.testing.assert_allclose(g.asnumpy(), 2 * x * c, rtol=1e-5)
            j = fs.jit(lambda a: a.sum(axis=0) * c)(x)
            np.testing.assert_allclose(j.asnumpy(), x.sum(0) * c, rtol=1e-5)
            if i % 4 == 0:
                s = fs.shard(lambda a: a.sum(axis=0) * c, in_strategy=((2, 1),), mesh=2)(x)
                np.testing.assert_allclose(s.asnumpy(), x.sum(0) * c, rtol=1e-5)

    _run_threads(work)
    assert ms.Tensor.__add__ is add_before  # the patches are undone
    assert context.trace.get() is None and context.batch_axes.get() == ()
    out = fs.jit(lambda a: a * 3)(x)
    assert isinstance(out, ms.Tensor)
    assert isinstance(fs.vmap(lambda a: a * 2)(x), ms.Tensor)


def test_a_mesh_entered_in_one_thread_is_not_seen_in_another():
    seen = {}
    entered, release = threading.Event(), threading.Event()

    def holder():
        with fs.Mesh((2,), ("dp",), virtual=True):
            entered.set()
            release.wait(timeout=60)

    t = threading.Thread(target=holder)
    t.start()
    entered.wait(timeout=60)
    from fshard.meshes.mesh import current_mesh

    seen["other"] = current_mesh()
    release.set()
    t.join(timeout=60)
    assert seen["other"] is None


def test_context_helpers_restore_on_exceptions():
    try:
        with context.pushed(context.named_axes, "i"), context.counted(context.shard_depth):
            assert context.named_axes.get() == ("i",) and context.shard_depth.get() == 1
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert context.named_axes.get() == () and context.shard_depth.get() == 0
