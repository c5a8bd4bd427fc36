"""``fs.profile``: where a function's time goes, equation by equation.

``fs.profile(f)(*args)`` traces ``f`` into its Program (the one ``fs.make_ir``
prints), runs each equation on its own, eagerly (MindSpore's PyNative mode), waiting
for it to finish before the next, and records the wall time of each. It also times
the whole function compiled with ``fs.jit`` (after a warm-up call), for comparison.

What the per-equation times measure, honestly: one eager MindSpore operation each,
including its dispatch cost (tens of microseconds per operation on CPU), with no
fusion or overlap between operations. A compiled graph runs the same operations with
less overhead, so the sum of the equations is larger than the compiled time; the
table shows where the work is (the big matmuls, the collectives of a ``shard_call``),
not the compiled program's exact breakdown. An equation that holds a whole
sub-program (``shard_call``, ``scan``, ``cond``, a ``custom_vjp`` call) is timed as
one row.
"""

from __future__ import annotations

import io
import time

from fshard.core import tree
from fshard.backend import mindspore as backend
from fshard.core.tracing import typeof
from fshard.errors import ArgumentError
from fshard.core.interpret import bind_equation, walk
from fshard.core.staging import check_function, fun_name, trace_fun
from fshard.transforms.jit import jit


class Profile:
    """The result of ``fs.profile(f)(*args)``: one row per equation.

    Attributes:
        rows: ``(index, equation, output types, seconds, source line)`` per equation,
            in program order (``seconds``: the fastest of the repeats).
        eager_seconds: the sum of the rows.
        compiled_seconds: one call of ``fs.jit(f)`` (the fastest of the repeats), or
            None when not measured.
        outputs: what ``f`` returned.

    ``print(p)`` shows the table (the slowest ``top`` rows, by time), ``p.chart()``
    draws it with matplotlib.

    >>> import numpy as np, fshard as fs
    >>> p = fs.profile(lambda x: fs.ops.exp(x).sum(), repeat=1)(np.ones(8, np.float32))
    >>> len(p.rows), [row[1] for row in p.slowest(1)][0] in ("exp", "reduce_sum[axes=(0,)]")
    (2, True)
    >>> "fs.profile(<lambda>): 2 equations" in p.to_text()
    True
    """

    def __init__(self, name, rows, compiled_seconds, outputs, top):
        self.name, self.rows, self.outputs = name, rows, outputs
        self.compiled_seconds, self.top = compiled_seconds, top
        self.eager_seconds = sum(r[3] for r in rows)

    def slowest(self, n: int | None = None) -> list:
        """The ``n`` slowest rows (all by default), slowest first."""
        rows = sorted(self.rows, key=lambda r: -r[3])
        return rows if n is None else rows[:n]

    def by_line(self) -> dict:
        """Seconds per line of the profiled code (``{"file:line": seconds}``, in program
        order): every equation counts for the line that created it (lines 2 and 3 of
        ``loss`` below; the seed of the gradient, the line of the call), the equations of
        the derivative (the backward pass of ``fs.grad``) and of ``fs.vmap`` for the
        line of the operation they differentiate or batch, so a model written one layer
        per line gives each layer's forward-plus-backward time. Equations with no line
        fall under ``None``.

        >>> import numpy as np, fshard as fs
        >>> def loss(w, x):
        ...     h = fs.ops.tanh(x @ w)
        ...     return (h * h).sum()
        >>> p = fs.profile(fs.grad(loss), repeat=1, compiled=False)(
        ...     np.ones((4, 4), np.float32), np.ones((2, 4), np.float32))
        >>> sorted(int(k.rsplit(":")[-1]) for k in p.by_line() if "by_line[1]" in k)
        [2, 3]
        """
        out: dict = {}
        for _, _, _, t, src in self.rows:
            out[src] = out.get(src, 0.0) + t
        return out

    def __rich__(self):
        from rich.markup import escape
        from rich.table import Table

        shown = self.slowest(self.top)
        table = Table(title=f"fs.profile({self.name}): {len(self.rows)} equations, "
                            f"{_ms(self.eager_seconds)} eager"
                      + (f", {_ms(self.compiled_seconds)} compiled (fs.jit)"
                         if self.compiled_seconds is not None else ""))
        for col, justify in (("#", "right"), ("equation", "left"), ("output", "left"),
                             ("time", "right"), ("share", "right"), ("line", "left")):
            table.add_column(col, justify=justify)
        total = self.eager_seconds or 1.0
        for i, eq, out, t, src in shown:
            table.add_row(str(i), escape(eq), out, _ms(t), f"{100 * t / total:.1f}%",
                          escape(src or ""))
        if len(shown) < len(self.rows):
            rest = sum(r[3] for r in self.rows) - sum(r[3] for r in shown)
            table.add_row("", f"... {len(self.rows) - len(shown)} more", "", _ms(rest),
                          f"{100 * rest / total:.1f}%", "")
        return table

    def to_text(self, width: int = 120) -> str:
        """The table as plain text."""
        from rich.console import Console

        buf = io.StringIO()
        Console(file=buf, width=width, color_system=None, force_terminal=False,
                force_jupyter=False).print(self)
        return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())

    def __str__(self) -> str:
        return self.to_text()

    __repr__ = __str__

    def chart(self, n: int = 15, ax=None):
        """A horizontal bar chart of the ``n`` slowest equations (matplotlib); returns
        the Axes."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ArgumentError(
                "fs.profile(...).chart() draws with matplotlib, which is not installed.\n"
                "Fix: pip install matplotlib (or fshard[examples]); print(profile) shows "
                "the same numbers as a table.") from None
        rows = self.slowest(n)[::-1]
        if ax is None:
            _, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.2))
        ax.barh([f"#{r[0]} {r[1][:40]}" for r in rows], [r[3] * 1e3 for r in rows],
                color="#4c72b0")
        ax.set_xlabel("milliseconds (eager, one equation at a time)")
        ax.set_title(f"fs.profile({self.name})")
        ax.figure.tight_layout()
        return ax


def _wait(values) -> None:
    """Wait until every Tensor of ``values`` is computed (MindSpore runs asynchronously)."""
    backend.synchronize([v for v in values if backend.is_tensor(v)])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _describe(eq) -> str:
    params = ", ".join(f"{k}={v}" for k, v in eq.params.items()
                       if isinstance(v, (int, float, str, tuple)) and len(repr(v)) < 24)
    return eq.prim.name + (f"[{params}]" if params else "")


def profile(fun, *, repeat: int = 3, top: int | None = 20, compiled: bool = True):
    """Time ``fun`` equation by equation: ``fs.profile(f)(*args)`` returns a
    ``Profile`` (print it for the table; ``.chart()`` draws it).

    >>> import numpy as np, fshard as fs
    >>> def mlp(x, w1, w2):
    ...     return fs.ops.relu(x @ w1) @ w2
    >>> p = fs.profile(mlp)(np.ones((64, 32), np.float32), np.ones((32, 16), np.float32),
    ...                     np.ones((16, 4), np.float32))
    >>> [row[1].split("[")[0] for row in p.rows]
    ['matmul', 'relu', 'matmul']
    >>> p.outputs.shape, p.eager_seconds > 0
    ((64, 4), True)

    Each equation of the traced program runs eagerly on its own and is timed until
    its result is ready (the fastest of ``repeat`` runs); the whole function is also
    timed compiled with ``fs.jit``. The per-equation times include MindSpore's eager
    dispatch cost and no fusion: they show where the work is, not the compiled
    program's exact breakdown (docs/performance.md).

    Args:
        fun: a function of pytrees of arrays.
        repeat: runs per equation (and of the compiled function); the fastest counts.
        top: how many of the slowest equations the table shows (None: all).
        compiled: also time ``fs.jit(fun)`` (compiling it first).

    Returns:
        a function of ``fun``'s arguments returning a ``Profile``.
    """
    check_function("fs.profile", fun)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ArgumentError(f"fs.profile(repeat=...) must be an int >= 1; got {repeat!r}.")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise ArgumentError(f"fs.profile(top=...) must be an int >= 1 or None; got {top!r}.")

    def run(*args, **kwargs) -> Profile:
        leaves, in_tree = tree.flatten((args, kwargs))
        traced = trace_fun(fun, in_tree, [typeof(x) for x in leaves])
        rows = []
        counter = iter(range(len(traced.program.equations)))

        def timed(eq, values):
            outs = None
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                outs = bind_equation(eq, values)
                _wait(outs)
                best = min(best, time.perf_counter() - t0)
            rows.append((next(counter), _describe(eq),
                         ", ".join(str(v.aval) for v in eq.outputs), best, eq.source))
            return outs

        tensors = [backend.as_tensor(x) if not backend.is_tensor(x) else x for x in leaves]
        outs = walk(traced.program, list(traced.consts) + tensors, timed, "profiling")
        compiled_seconds = None
        if compiled:
            jitted = jit(fun)
            _wait(tree.leaves(jitted(*args, **kwargs)))  # compile
            compiled_seconds = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                _wait(tree.leaves(jitted(*args, **kwargs)))
                compiled_seconds = min(compiled_seconds, time.perf_counter() - t0)
        return Profile(fun_name(fun), rows, compiled_seconds,
                       tree.unflatten(traced.out_tree, outs), top)

    return run
