"""Shapes declared by jaxtyping annotations: ``fs.jit(f, in_shapes="annotations")``.

For ``def f(x: Float[Tensor, "b 784"], w: Float[Tensor, "784 10"]) -> Float[Tensor,
"b 10"]`` a named dimension (``b``) is one ``fs.Symbol`` shared by every argument that
names it (jaxtyping's meaning: one name, one size), a number is a static dimension, and
the variadic ``*batch`` / ``...`` dimensions are taken from the call (static, so a new
rank or size traces again; one ``*name`` must be the same dims in every argument). The
return annotation is checked against the traced output type.
"""

from __future__ import annotations

import inspect
import typing

from fshard.core import dtypes, tree
from fshard.core.tracing import ArrayType, Symbol, dims_equal, typeof
from fshard.errors import ArgumentError, ShapeError

try:  # jaxtyping is a dependency; its dimension classes are private, so match by name
    import jaxtyping as _jaxtyping  # noqa: F401
except ImportError:  # pragma: no cover
    _jaxtyping = None


def _is_array_annotation(ann) -> bool:
    return hasattr(ann, "dims") and hasattr(ann, "dim_str") and hasattr(ann, "dtypes")


def _hints(fun) -> tuple[list, dict, object]:
    """``(parameter names, {name: annotation}, return annotation)`` of ``fun``."""
    try:
        hints = typing.get_type_hints(fun, include_extras=True)
    except Exception:  # noqa: BLE001  unresolvable forward references: the raw ones
        hints = dict(getattr(fun, "__annotations__", {}))
    params = list(inspect.signature(fun).parameters)
    return params, {k: v for k, v in hints.items() if _is_array_annotation(v)}, \
        hints.get("return")


class AnnotatedShapes:
    """Declarations read from one function's jaxtyping annotations."""

    def __init__(self, fun, name: str):
        self.name = name
        self.params, self.annotations, self.ret = _hints(fun)
        if not self.annotations:
            raise ArgumentError(
                f"fs.jit({name}, in_shapes='annotations'): no parameter of {name} has a "
                "jaxtyping array annotation such as Float[Tensor, 'b 784'].\nFix: annotate "
                "the array parameters, or declare in_shapes explicitly.")
        self._memo: dict = {}

    def declare(self, args) -> tuple:
        """One declaration per positional argument for this call (None: not annotated)."""
        key = []
        for i, a in enumerate(args):
            ann = self.annotations.get(self.params[i]) if i < len(self.params) else None
            key.append(tuple(typeof(a).shape) if ann is not None and _variadic(ann) else
                       (typeof(a).ndim if ann is not None else None))
        key = tuple(key)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = self._declare(args)
        return out

    def _declare(self, args) -> tuple:
        self.symbols: dict = {}
        variadic: dict = {}
        out = []
        for i, a in enumerate(args):
            pname = self.params[i] if i < len(self.params) else None
            ann = self.annotations.get(pname)
            if ann is None:
                out.append(None)
                continue
            where = f"args[{i}] (parameter '{pname}')"
            got = typeof(a)
            _check_dtype(self.name, where, ann, got.dtype)
            out.append(ArrayType(self._dims(ann, got.shape, where, variadic), got.dtype))
        return tuple(out)

    def _dims(self, ann, shape, where: str, variadic: dict) -> tuple:
        dims = list(ann.dims)
        n_var = sum(_is_variadic(d) for d in dims)
        n_fixed = len(dims) - n_var
        if len(shape) < n_fixed or (not n_var and len(shape) != n_fixed):
            raise ShapeError(
                f"{self.name}: {where} has shape {tuple(shape)}, but its annotation "
                f"'{ann.dim_str}' has {n_fixed} dimensions{' and more' if n_var else ''}.\n"
                "Fix: pass an array of that rank, or correct the annotation.")
        out, k = [], 0
        for d in dims:
            kind = type(d).__name__
            if _is_variadic(d):
                m = len(shape) - n_fixed
                taken = tuple(shape[k:k + m])
                vname = getattr(d, "name", None)
                if vname is not None:
                    seen = variadic.setdefault(vname, (taken, where))
                    if seen[0] != taken:
                        raise ShapeError(
                            f"{self.name}: {where} has *{vname} = {taken}, but {seen[1]} has "
                            f"*{vname} = {seen[0]}; one name is the same dimensions "
                            "everywhere.\nFix: make them equal, or use different names.")
                out += taken
                k += m
            elif kind == "_FixedDim":
                if shape[k] != d.size:
                    raise ShapeError(
                        f"{self.name}: {where} has size {shape[k]} in dimension {k}, but its "
                        f"annotation '{ann.dim_str}' fixes it to {d.size}.\nFix: pass that "
                        "size, or name the dimension to let it vary.")
                out.append(d.size)
                k += 1
            elif kind == "_NamedDim":
                out.append(self.symbols.setdefault(d.name, Symbol()))
                k += 1
            else:
                raise ArgumentError(
                    f"{self.name}: the annotation '{ann.dim_str}' of {where} has a dimension "
                    f"fshard cannot declare ({d!r}: expressions and broadcastable '#' dims "
                    "are not supported).\nFix: use names, numbers, *name or '...'.")
        return tuple(out)

    def check_return(self, out_avals, out_tree) -> None:
        """The traced output type against the return annotation (one array)."""
        if not _is_array_annotation(self.ret) or len(out_avals) != 1 or \
                not tree.structure(0) == out_tree:
            return
        got = out_avals[0]
        where = "the return value"
        _check_dtype(self.name, where, self.ret, got.dtype)
        dims = [d for d in self.ret.dims if not _is_variadic(d)]
        if any(_is_variadic(d) for d in self.ret.dims):
            return  # the variadic part is not declared: only the dtype is checked
        if len(dims) != got.ndim:
            raise ShapeError(
                f"{self.name}: {where} has type {got}, but the return annotation "
                f"'{self.ret.dim_str}' has {len(dims)} dimensions.\nFix: correct the "
                "function or its annotation.")
        for k, (d, size) in enumerate(zip(dims, got.shape)):
            kind = type(d).__name__
            want = d.size if kind == "_FixedDim" else self.symbols.get(
                getattr(d, "name", None))
            if want is None:
                continue  # a name no argument declares: any size
            if not dims_equal(want, size):
                raise ShapeError(
                    f"{self.name}: {where} has type {got}; dimension {k} is {size}, but the "
                    f"return annotation '{self.ret.dim_str}' says {getattr(d, 'name', want)}"
                    f" ({want}).\nFix: correct the function or its annotation.")


def _is_variadic(d) -> bool:
    return "Variadic" in type(d).__name__


def _variadic(ann) -> bool:
    return any(_is_variadic(d) for d in ann.dims)


def _check_dtype(name: str, where: str, ann, dtype) -> None:
    names = set(ann.dtypes)
    try:
        got = dtypes.to_numpy(dtype).name
    except KeyError:  # a dtype NumPy lacks (bfloat16): MindSpore's name
        got = str(dtype).lower()
    if got not in names:
        raise ShapeError(
            f"{name}: {where} has dtype {got}, but its annotation {ann.__name__} "
            f"accepts {', '.join(sorted(names)[:6])}{', ...' if len(names) > 6 else ''}.\n"
            "Fix: cast it, "
            "or widen the annotation (e.g. Shaped[...] for any dtype).")
