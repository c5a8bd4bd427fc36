"""``visualize_sharding``: which device holds which block of a tensor.

Like ``jax.debug.visualize_array_sharding``: a grid with one cell per block, each
cell listing the ranks that hold it ("0,4" for a block with a replica). It renders as
a ``rich`` table in a terminal (``print(vis)``, ``vis.print()`` for colour, or the
REPL's repr) and as an HTML table in a notebook (``_repr_html_``). 1-D tensors are
one row of blocks; for 3-D and higher, the blocks of the leading dimensions are
flattened into the rows, and the table says so.
"""

from __future__ import annotations

import html
import io
import itertools
import operator
from typing import Sequence

from fshard.errors import ArgumentError
from fshard.meshes.layout import Layout, as_layout, block_owners, check_shape

__all__ = ["visualize_sharding", "ShardingVisualization"]

# Soft backgrounds that keep black text readable; cycled over blocks.
_PALETTE = (
    "#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
    "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f",
)


def _fmt_slice(lo: int, hi: int) -> str:
    return f"{lo}:{hi}"


class ShardingVisualization:
    """A grid of blocks of one tensor and the ranks holding each block.

    Attributes:
        shape: the tensor's global shape.
        layout: the Layout view used.
        row_labels / col_labels: index ranges of each row / column of blocks.
        cells: ``cells[r][c]`` is the tuple of ranks holding that block.
        note: a sentence about flattened leading dimensions, or None.
    """

    def __init__(self, shape, layout: Layout, row_labels, col_labels, cells, note, title):
        self.shape = shape
        self.layout = layout
        self.row_labels = row_labels
        self.col_labels = col_labels
        self.cells = cells
        self.note = note
        self.title = title

    @staticmethod
    def _ranks(ranks: Sequence[int]) -> str:
        return ",".join(map(str, ranks))

    def _color(self, r: int, c: int) -> str:
        return _PALETTE[(r * len(self.col_labels) + c) % len(_PALETTE)]

    # -- rich -------------------------------------------------------------------------

    def __rich__(self):
        from rich import box
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        # Title and note sit outside the table so they do not wrap to its width.
        table = Table(box=box.SQUARE, show_lines=True)
        table.add_column("", style="dim", no_wrap=True)
        for label in self.col_labels:
            table.add_column(label, justify="center", no_wrap=True)
        for r, (label, row) in enumerate(zip(self.row_labels, self.cells, strict=True)):
            table.add_row(
                label,
                *[f"[black on {self._color(r, c)}] {self._ranks(ranks)} [/]"
                  for c, ranks in enumerate(row)],
            )
        parts = [Text(self.title, style="bold"), table]
        if self.note:
            parts.append(Text(self.note, style="italic"))
        return Group(*parts)

    def to_text(self, width: int = 120) -> str:
        """The table as plain text (no colour)."""
        from rich.console import Console

        buf = io.StringIO()
        # force_jupyter=False: inside a notebook rich would otherwise display the table
        # itself instead of writing it to ``buf``.
        Console(file=buf, width=width, color_system=None, force_terminal=False,
                force_jupyter=False, legacy_windows=False).print(self)
        return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())

    def print(self) -> None:
        """Print with colours to the terminal (through rich)."""
        from rich.console import Console

        Console().print(self)

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return self.to_text()

    # -- notebook ---------------------------------------------------------------------

    def _repr_html_(self) -> str:
        esc = html.escape
        cell = "border:1px solid #555;padding:4px 10px;text-align:center;font-family:monospace"
        head = "".join(f'<th style="{cell}">{esc(c)}</th>' for c in self.col_labels)
        rows = []
        for r, (label, row) in enumerate(zip(self.row_labels, self.cells, strict=True)):
            tds = "".join(
                f'<td style="{cell};background:{self._color(r, c)};color:black">'
                f"{esc(self._ranks(ranks))}</td>"
                for c, ranks in enumerate(row)
            )
            rows.append(f'<tr><th style="{cell};color:#666">{esc(label)}</th>{tds}</tr>')
        note = f"<br><i>{esc(self.note)}</i>" if self.note else ""
        return (
            '<table style="border-collapse:collapse">'
            f'<caption style="caption-side:top"><b>{esc(self.title)}</b></caption>'
            f'<tr><th style="{cell}"></th>{head}</tr>{"".join(rows)}</table>'
            f'<div style="font-size:smaller">ranks holding each block{note}</div>'
        )


def _check_shape_arg(shape) -> tuple:
    """The tensor's shape as a tuple of ints >= 0 (a negative size has no blocks)."""
    try:
        dims = tuple(operator.index(s) for s in shape)
    except TypeError:
        dims = None
    if dims is None or any(d < 0 for d in dims):
        raise ArgumentError(
            f"visualize_sharding(shape=...) must be a tuple of non-negative ints (the "
            f"tensor's global shape); got {shape!r}.\nFix: pass the tensor's shape, e.g. "
            "visualize_sharding(x.shape, (2, 1)).")
    return dims


def visualize_sharding(shape: Sequence[int], layout_or_strategy, mesh=None
                       ) -> ShardingVisualization:
    """Show which device holds which block of a ``shape`` tensor.

    >>> from fshard.meshes.mesh import Mesh
    >>> vis = visualize_sharding((8, 4), (2, 2), mesh=Mesh((8,), ("d",)))
    >>> vis.cells          # repeated calculation: neighbouring ranks share a block
    [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    >>> vis.row_labels, vis.col_labels
    (['0:4', '4:8'], ['0:2', '2:4'])

    Args:
        shape: the tensor's global shape.
        layout_or_strategy: a strategy tuple such as ``(4, 2)``, a Layout view, or
            None (replicated).
        mesh: gives the device count for a strategy (default: ``resolve_mesh()``).

    Returns:
        A ``ShardingVisualization``: prints as a table, renders as HTML in notebooks.

    See also: ``fshard.meshes.layout.block_owners``, docs/meshes_and_layouts.md.
    """
    from fshard.meshes.mesh import resolve_mesh

    shape = _check_shape_arg(shape)
    if isinstance(layout_or_strategy, Layout):
        n = layout_or_strategy.n_devices
        if mesh is not None:
            n = resolve_mesh(mesh).size
    else:
        n = resolve_mesh(mesh).size
    layout = as_layout(layout_or_strategy, n, ndim=len(shape), name="layout_or_strategy")
    check_shape(shape, layout, name="layout_or_strategy", arg=f"shape {shape!r}")
    splits = layout.to_strategy()
    owners = block_owners(layout)
    ranges = [
        [(i * (s // c), (i + 1) * (s // c)) for i in range(c)]
        for s, c in zip(shape, splits, strict=True)
    ]
    note = None
    if len(shape) == 0:
        row_idx, col_idx = [()], [()]
        row_labels, col_labels = ["[]"], ["scalar"]
    elif len(shape) == 1:
        row_idx = [()]
        col_idx = [(i,) for i in range(splits[0])]
        row_labels = ["dim 0"]
        col_labels = [_fmt_slice(*ranges[0][i]) for i in range(splits[0])]
    else:
        lead = len(shape) - 1
        row_idx = list(itertools.product(*[range(c) for c in splits[:lead]]))
        col_idx = [(i,) for i in range(splits[-1])]
        row_labels = [", ".join(_fmt_slice(*ranges[d][i]) for d, i in enumerate(idx))
                      for idx in row_idx]
        col_labels = [_fmt_slice(*ranges[-1][i]) for (i,) in col_idx]
        if lead > 1:
            note = (f"{len(shape)}-D tensor: the blocks of dims 0-{lead - 1} are flattened "
                    f"into the rows; the columns are dim {lead}.")
    cells = [[owners[r + c] for c in col_idx] for r in row_idx]
    if isinstance(layout_or_strategy, Layout):
        desc = repr(layout_or_strategy)
    elif layout_or_strategy is None:
        desc = "replicated"
    else:
        desc = f"strategy {tuple(splits)!r}"
    title = f"shape {shape!r}, {desc}, {n} devices"
    return ShardingVisualization(shape, layout, row_labels, col_labels, cells, note, title)
