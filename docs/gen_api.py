"""Generate docs/api.md from the docstrings of fshard's public API.

Run: python docs/gen_api.py   (tests/test_docs.py checks the file is current)
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

SECTIONS = {
    "Transformations": ["jit", "vmap", "grad", "value_and_grad", "jvp", "vjp", "jacfwd",
                        "jacrev", "hessian", "custom_jvp", "custom_vjp", "stop_gradient",
                        "shard", "shard_map"],
    "Control flow": ["cond", "switch", "while_loop", "fori_loop", "scan"],
    "Inspection": ["make_ir", "verify", "typeof", "visualize_sharding", "functional"],
    "Meshes, layouts and collectives": ["Mesh", "Layout", "psum", "pmean", "pmax", "pmin",
                                        "all_gather", "psum_scatter", "all_to_all",
                                        "ppermute", "broadcast", "axis_index"],
    "Types": ["ArrayType", "Symbol"],
    "Training": ["AutoParallel", "TrainState", "pipeline_split", "optim.sgd", "optim.adam", "optim.adamw",
                 "optim.apply_updates", "optim.chain", "optim.clip_by_global_norm",
                 "optim.cosine_decay", "optim.linear_warmup", "optim.constant"],
    "Random numbers": ["random.key", "random.split", "random.fold_in", "random.bits",
                       "random.uniform", "random.normal", "random.truncated_normal",
                       "random.bernoulli", "random.randint", "random.gumbel",
                       "random.categorical", "random.permutation", "nn.dropout"],
    "Checkpoints": ["checkpoint.save", "checkpoint.load", "checkpoint.latest",
                    "checkpoint.clean", "checkpoint.save_mindspore",
                    "checkpoint.load_mindspore", "checkpoint.save_safetensors",
                    "checkpoint.load_safetensors", "AutoParallel.state_strategies"],
}


def _summary(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def _signature(name, obj) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name


def render() -> str:
    import fshard as fs

    out = ["# API reference", "",
           "Generated from the docstrings by `python docs/gen_api.py`; `import fshard as fs`.",
           "Each entry's docstring has a runnable example (checked by tests/test_doctests.py).",
           ""]
    for title, names in SECTIONS.items():
        out += [f"## {title}", ""]
        for name in names:
            obj = fs
            for part in name.split("."):
                obj = getattr(obj, part)
            out += [f"### `fs.{_signature(name, obj)}`", "", _summary(obj), ""]
    out += ["## Op functions (`fs.ops`)", "",
            "One per primitive, plus composites; MindSpore's dtype promotion and NumPy "
            "broadcasting. See [primitives.md](primitives.md) for their rules.", ""]
    for name in sorted(n for n in dir(fs.ops) if not n.startswith("_")):
        obj = getattr(fs.ops, name)
        if callable(obj) and not inspect.ismodule(obj):
            out.append(f"- `fs.ops.{name}`: {_summary(obj) or 'see the primitive table'}")
    out += ["", "## Errors", "", "See [errors.md](errors.md)."]
    for name in sorted(n for n in dir(fs.errors) if n.endswith("Error")):
        out.append(f"- `fs.{name}`: {_summary(getattr(fs.errors, name))}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    path = Path(__file__).with_name("api.md")
    path.write_text(render())
    print(f"wrote {path}", file=sys.stderr)
