"""Draw fshard's layer map (docs/layers.svg) from the table the layering test enforces.

Run ``python docs/gen_layers.py`` after changing ``LAYERS`` in tests/test_layering.py;
``tests/test_layering.py::test_the_layer_picture_is_current`` fails while the picture
is stale. Each row is one layer (lowest at the bottom); a module imports only from its
own row or the rows below it. No graph library needed: the picture is plain SVG.
"""

from __future__ import annotations

import importlib.util
import math
import os
from html import escape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "layers.svg")

# Bands of consecutive layers, by the first module prefix of their lowest layer.
BANDS = [
    ("fshard.errors", "core/", "#dde7f3"),
    ("fshard.backend", "backend/", "#f3e3dd"),
    ("fshard.meshes", "meshes/", "#e6e6e6"),
    ("fshard.backend.collectives", "backend/", "#f3e3dd"),
    ("fshard.primitives.base", "primitives/", "#e1f0dc"),
    ("fshard.sharding", "sharding/", "#f6edd0"),
    ("fshard.ops", "ops, adapter/", "#ece0f2"),
    ("fshard.random", "nn/, random", "#eef2dc"),
    ("fshard.transforms", "transforms/", "#d9eeee"),
    ("fshard.training", "training/", "#f2dfe6"),
    ("fshard.launch", "tools", "#e6e6e6"),
]

ROW_H, GAP, LEFT, WIDTH, CHAR_W = 30, 6, 250, 1000, 7.8


def _test_module():
    path = os.path.join(ROOT, "tests", "test_layering.py")
    spec = importlib.util.spec_from_file_location("_fshard_layering", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _label(prefix: str, modules: list[str], paths: dict) -> str:
    """``fshard.sharding`` -> ``sharding/ (cost, layouts, ...)`` for a package."""
    short = prefix.removeprefix("fshard.").replace(".", "/")
    subs = sorted({m[len(prefix) + 1:].split(".")[0] for m in modules
                   if m.startswith(prefix + ".")})
    if not subs:
        is_init = os.path.basename(str(paths.get(prefix, ""))) == "__init__.py"
        return short + ("/__init__" if is_init else "")
    return f"{short}/ ({', '.join(subs)})"


def render() -> str:
    t = _test_module()
    paths = t._modules()
    modules = sorted(paths)
    layers = t.LAYERS
    rows = []  # (band, [box labels]) lowest first
    band_i = -1
    for layer in layers:
        while band_i + 1 < len(BANDS) and BANDS[band_i + 1][0] in layer:
            band_i += 1
        # a module belongs to the row of its longest matching prefix
        own = [m for m in modules if t._layer(m) == layers.index(layer)]
        labels = []
        for prefix in layer:
            # each module goes in the box of its longest matching prefix in the row
            mine = [m for m in own if max((q for q in layer if m == q or m.startswith(q + ".")),
                                          key=len) == prefix]
            if mine:
                labels.append(_label(prefix, mine, paths))
        rows.append((band_i, labels))
    rows.append((None, ["fshard (the public API: fshard/__init__.py re-exports)"]))
    height = len(rows) * (ROW_H + GAP) + 70
    # as wide as the widest row needs
    width = max([WIDTH] + [LEFT + sum(len(t) * CHAR_W + 24 for t in labels) + 20
                           for _, labels in rows])
    width = int(math.ceil(width / 10) * 10)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans Mono, monospace" '
           'font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15" '
           'font-weight="bold">fshard: layers (a module imports only from its row or '
           'below)</text>']
    y0 = 40
    n = len(rows)
    spans: dict = {}
    for k, (band, labels) in enumerate(rows):
        y = y0 + (n - 1 - k) * (ROW_H + GAP)
        color = BANDS[band][2] if band is not None else "#fff6c8"
        spans.setdefault(band, [y, y])
        spans[band] = [min(spans[band][0], y), max(spans[band][1], y)]
        x = LEFT
        for text in labels:
            w = len(text) * CHAR_W + 16
            out.append(f'<rect x="{x:.0f}" y="{y}" width="{w:.0f}" height="{ROW_H}" rx="5" '
                       f'fill="{color}" stroke="#555"/>')
            out.append(f'<text x="{x + 8:.0f}" y="{y + 19}">{escape(text)}</text>')
            x += w + 8
    for band, (top, bottom) in spans.items():
        name = BANDS[band][1] if band is not None else "public API"
        mid = (top + bottom + ROW_H) / 2
        out.append(f'<line x1="{LEFT - 12}" y1="{top + 2}" x2="{LEFT - 12}" '
                   f'y2="{bottom + ROW_H - 2}" stroke="#333" stroke-width="2"/>')
        out.append(f'<text x="{LEFT - 20}" y="{mid + 4:.0f}" text-anchor="end" '
                   f'font-weight="bold">{escape(name)}</text>')
    ay = y0 + n * (ROW_H + GAP)
    out.append(f'<text x="{LEFT}" y="{ay + 12}" fill="#333">imports point down: core '
               '-&gt; primitives -&gt; sharding -&gt; transforms -&gt; API</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    with open(OUT, "w") as fh:
        fh.write(render())
    print(f"wrote {OUT}")
