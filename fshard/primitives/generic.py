"""The generic path: any MindSpore primitive without a native fshard rule.

A MindSpore op called on traced values that fshard has no converter for is traced
as ONE equation ``ms_op[fn=...]``. Its parameter ``fn`` is an ``MsFunction``: the
MindSpore call (the primitive object, or a ``mint`` overload, with its non-tensor
arguments fixed) and a chain of derivatives and batchings of it. Every rule of
``ms_op`` is MindSpore's own:

- shapes and dtypes: MindSpore's inference, by running the op once eagerly on
  zeros (ones, random values, positive definite matrices, if zeros are outside its
  domain) of the operands' types, cached per signature;
- eager evaluation and lowering: one generated Python function per ``MsFunction``,
  written to a real file (MindSpore's GRAPH mode parses sources), called eagerly
  and referenced by the lowered program, so the compiled graph calls the very same
  primitive;
- reverse mode: ``("vjp", W)`` of a function is ``GradOperation(get_all=True,
  sens_param=True)`` of it (MindSpore's registered bprop), for the operands ``W``;
- forward mode: ``("jvp", W)`` is the transpose of the VJP: the VJP, taken with
  respect to the cotangent, of ``c -> vjp(x)(c)`` (MindSpore's graph-mode ``jvp``
  does not compile; its bprop of a bprop does). The two transpose into each other,
  so ``grad`` runs one VJP per op and ``grad(grad)`` a VJP of a VJP;
- batching: ``("vmap", in_axes, size)`` is ``mindspore.vmap`` of the function (its
  registered batching rule), checked once against the op run on single examples;
  where MindSpore has none (or it disagrees), a per-example loop with a
  ``GenericOpWarning``;
- sharding: an op measured to be elementwise keeps its operands' layout; any other
  runs replicated, with a ``GenericOpWarning``.

The IR prints the equation by its MindSpore name: ``Conv2D[kernel_size=(3, 3) ...]``.
"""

from __future__ import annotations

import itertools
import math
import threading
import warnings

import mindspore as ms
import numpy as np
from mindspore import ops

from fshard.core import dtypes
from fshard.backend import mindspore as backend
from fshard.core.tracing import ArrayType, Tracer, is_symbolic, typeof
from fshard.errors import GenericOpWarning, ProgramTypeError, UnsupportedOpError
from fshard.core.factors import FactorSpec
from fshard.primitives.base import (UndefinedPrimal, Zero, batch_size, def_primitive,
                                    instantiate, move_axis, reshape)
from fshard.primitives.structural import concat, slice_array
from fshard.core.rules import batching, jvp, sharding, transpose

FAMILY = "generic"

#: MindSpore ops whose output shape depends on the operands' values: a traced program
#: has static shapes, so these are refused with a fix.
DATA_DEPENDENT = frozenset({
    "NonZero", "NonZeroExt", "Unique", "Unique2", "UniqueDim", "UniqueConsecutive",
    "UniqueWithPad", "MaskedSelect", "ArgWhere", "functional.nonzero",
    "functional.unique", "functional.masked_select", "functional.unique_consecutive"})

_GRAD = ops.GradOperation(get_all=True, sens_param=True)
_lock = threading.RLock()  # generated modules and the inference cache are process-wide


class _Slot:
    """The position of operand ``i`` in an argument template."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __repr__(self) -> str:
        return f"<operand {self.i}>"


def _is_tensor_like(v) -> bool:
    return isinstance(v, Tracer) or backend.is_tensor(v)


# A concrete integer Tensor this small is kept as a fixed argument: it may set the output
# shape (MirrorPad's paddings, a size), which the generic path learns by running the op
# on zeros in place of its operands. It has no gradient and no batch axis to lose.
_FIXED_INT_SIZE = 1024


def _is_fixed_int(v) -> bool:
    return (backend.is_tensor(v) and not isinstance(v, (Tracer, ms.Parameter))
            and dtypes.is_int(dtypes.canonical(v.dtype)) and v.size <= _FIXED_INT_SIZE)


def _template(v, operands: list):
    """``v`` with every tensor (traced or concrete, but for a small concrete integer one)
    replaced by a ``_Slot``."""
    if _is_tensor_like(v) and not _is_fixed_int(v):
        operands.append(v)
        return _Slot(len(operands) - 1)
    if type(v) in (list, tuple):
        return type(v)(_template(e, operands) for e in v)
    return v


def _fill(t, xs):
    if isinstance(t, _Slot):
        return xs[t.i]
    if type(t) in (list, tuple):
        return type(t)(_fill(e, xs) for e in t)
    return t


_SIMPLE = (bool, int, float, str, type(None))


def _static_key(v):
    """A hashable stand-in for a static argument (dtypes and objects by repr)."""
    if isinstance(v, _Slot):
        return ("slot", v.i)
    if type(v) in (list, tuple):
        return (type(v).__name__,) + tuple(_static_key(e) for e in v)
    if isinstance(v, _SIMPLE):
        return (type(v).__name__, repr(v))
    if _is_fixed_int(v):
        a = v.asnumpy()
        return ("Tensor", str(a.dtype), a.shape, a.tobytes())
    return (type(v).__name__, repr(v), id(v) if not isinstance(v, ms.dtype.Type) else 0)


_HIDDEN_ATTRS = frozenset({"input_names", "output_names", "primitive_target", "side_effect_mem",
                           "side_effect_hidden", "_side_effect", "format"})


def _prim_attrs(fn) -> dict:
    attrs = getattr(fn, "attrs", None)
    if not isinstance(attrs, dict):
        return {}
    return {k: v for k, v in attrs.items() if k not in _HIDDEN_ATTRS}


class MsCall:
    """One MindSpore call with its non-tensor arguments fixed: ``fn(*args, **kwargs)``
    with the operands at the ``_Slot`` positions of ``args``/``kwargs``."""

    __slots__ = ("fn", "name", "args", "kwargs", "n_operands", "key")

    def __init__(self, fn, name: str, args: tuple, kwargs: dict, n_operands: int):
        self.fn, self.name, self.args, self.kwargs = fn, name, args, kwargs
        self.n_operands = n_operands
        attrs = tuple(sorted((k, repr(v)) for k, v in _prim_attrs(fn).items()))
        # Two primitive objects of one class with equal attributes are the same op
        # (each nn.Conv2d makes its own P.Conv2D).
        self.key = (type(fn).__module__, type(fn).__qualname__, name, attrs,
                    _static_key(args), _static_key(tuple(sorted(kwargs.items()))))

    def __call__(self, *xs):
        return self.fn(*_fill(self.args, xs), **{k: _fill(v, xs) for k, v in self.kwargs.items()})

    def describe(self) -> str:
        shown = [f"{k}={v}" for k, v in _prim_attrs(self.fn).items()]
        statics = [a for a in self.args if not isinstance(a, _Slot)
                   and not (type(a) in (list, tuple) and any(isinstance(e, _Slot) for e in a))]
        if statics:
            shown.append("args=" + ", ".join(repr(a) for a in statics))
        shown += [f"{k}={v!r}" for k, v in self.kwargs.items() if not isinstance(v, _Slot)]
        return f"{self.name}[{' '.join(shown)}]" if shown else self.name


# ---------------------------------------------------------------------------
# MsFunction: an op, or a derivative / batching of one, with its generated source
# ---------------------------------------------------------------------------


class MsFunction:
    """A MindSpore function of ``len(in_avals)`` tensors: the op ``call`` (``derivs``
    empty) or ``derivs[-1]`` applied to its parent. ``fn(*tensors)`` runs it eagerly;
    ``graph_fn`` is the generated function the lowered program calls (it returns one
    tensor for one output, else a tuple)."""

    __slots__ = ("call", "derivs", "parent", "in_avals", "out_avals", "graph_fn",
                 "is_seq", "loop_outputs", "_elementwise", "_checked")

    def __init__(self, call: MsCall, derivs: tuple, parent, in_avals: tuple, out_avals: tuple,
                 graph_fn):
        self.call, self.derivs, self.parent = call, derivs, parent
        self.in_avals, self.out_avals, self.graph_fn = in_avals, out_avals, graph_fn
        self.is_seq = len(out_avals) != 1  # the op returned a tuple (maybe of one)
        self._elementwise = None
        self._checked = False
        self.loop_outputs = ()  # of a vmap: outputs MindSpore's rule gets wrong

    def __repr__(self) -> str:
        return self.label()

    def label(self) -> str:
        """``Conv2D[...]``, ``Conv2D[...].vjp(0, 1)``, ``CumSum[...].vmap(0)``."""
        out = self.call.describe()
        for d in self.derivs:
            out += f".{d[0]}{tuple(d[1])}".replace(",)", ")")
        return out

    @property
    def has_effect(self) -> bool:
        """The op writes into an operand (MindSpore's ``side_effect_mem``: ``Assign``,
        ``BatchNorm`` in training mode): dead-code elimination keeps it."""
        attrs = getattr(self.call.fn, "attrs", None)
        # Its batched form writes too (dropped, jit(vmap(f)) lost the write); a
        # derivative does not.
        return all(k == "vmap" for k, _ in self.derivs) and isinstance(attrs, dict) and bool(
            attrs.get("side_effect_mem"))

    @property
    def float_outs(self) -> tuple:
        return tuple(i for i, a in enumerate(self.out_avals) if dtypes.is_float(a.dtype))

    def derive(self, kind: str, arg) -> MsFunction:
        """The function ``kind`` of this one: ``("vjp", W)``, ``("jvp", W)``,
        ``("vmap", (in_axes, size))``."""
        return _make(self.call, self.derivs + ((kind, arg),), self, self.in_avals)

    def retyped(self, in_avals: tuple) -> MsFunction:
        """This function for operands of other shapes (a device's blocks under shard)."""
        in_avals = tuple(in_avals)
        if in_avals == self.in_avals:
            return self
        if not self.derivs:
            return _make(self.call, (), None, in_avals)
        kind, arg = self.derivs[-1]
        n = len(self.parent.in_avals)
        if kind == "vmap":
            axes, _ = arg
            size = next(a.shape[d] for a, d in zip(in_avals, axes) if d is not None)
            inner = tuple(a if d is None else ArrayType(
                tuple(a.shape[:d]) + tuple(a.shape[d + 1:]), a.dtype)
                for a, d in zip(in_avals, axes))
            return self.parent.retyped(inner).derive(kind, (axes, size))
        return self.parent.retyped(in_avals[:n]).derive(kind, arg)

    @property
    def order(self) -> int:
        """How many MindSpore bprops deep this function differentiates (a JVP is the
        bprop of a bprop)."""
        return sum({"vjp": 1, "jvp": 2}.get(k, 0) for k, _ in self.derivs)

    def __call__(self, *xs):
        ts = list(map(backend.as_tensor, xs))
        if self.derivs:
            # Eager GradOperation gives one Tensor object in k operand slots the whole
            # gradient in each (cdist(a, a)'s gradient came out 2x): a copy per repeat.
            seen = set()
            for i, t in enumerate(ts):
                if id(t) in seen:
                    ts[i] = ops.deepcopy(t)
                seen.add(id(ts[i]))
        try:
            out = self.graph_fn(*ts)
        except Exception as e:  # noqa: BLE001
            if not self.derivs:
                raise
            raise _derivative_error(self, e) from e
        return list(out) if len(self.out_avals) != 1 else [out]

    def check_runs(self) -> None:
        """Run a derivative once eagerly (once per function), so that a missing
        higher-order bprop is an fshard error, not a failure of MindSpore's compiler."""
        if self._checked:
            return
        try:
            _run_checked(self.graph_fn, [_sample(a, 2) for a in self.in_avals])
        except Exception as e:  # noqa: BLE001
            raise _derivative_error(self, e) from e
        self._checked = True

    @property
    def elementwise(self) -> bool:
        """Whether each output element depends only on the operands' elements at its
        own index: every operand and output of one shape (or 0-d operands), and the
        op commutes with a random permutation of the elements (measured once)."""
        if self._elementwise is None:
            self._elementwise = _measure_elementwise(self)
        return self._elementwise


_functions: dict = {}  # (call key, derivs, in_avals) -> MsFunction, process-wide cache
_module_counter = itertools.count()


def _make(call: MsCall, derivs: tuple, parent, in_avals: tuple) -> MsFunction:
    key = (call.key, derivs, in_avals)
    with _lock:
        f = _functions.get(key)
        if f is not None:
            return f
        f = _build(call, derivs, parent, in_avals)
        _functions[key] = f
        return f


def _first_line(e: Exception) -> str:
    """The first line of a MindSpore error that says something (its C++ errors open
    with rules of dashes and headings)."""
    for line in str(e).splitlines():
        line = line.strip()
        if line and line[0] not in "-#" and any(c.isalpha() for c in line):
            return line
    return type(e).__name__


def _derivative_error(f: MsFunction, e: Exception) -> UnsupportedOpError:
    if f.order <= 1:
        why = ("MindSpore has no gradient for it on this backend, so neither has fshard's "
               "generic path. Fix: compute this value outside the differentiated function "
               "(fs.stop_gradient), or add a native rule for the op "
               "(docs/adding_a_primitive.md).")
    elif any(k == "jvp" for k, _ in f.derivs):
        why = ("forward mode (jvp, jacfwd, hessian) differentiates that bprop once more, and "
               "MindSpore has no derivative of it for this op. Fix: use reverse mode "
               "(fs.grad, fs.vjp, fs.jacrev) for this function, or add a native rule for the "
               "op (docs/adding_a_primitive.md).")
    else:
        why = ("a derivative of a derivative differentiates that bprop once more, and "
               "MindSpore has none for this op. Fix: differentiate once, or add a native "
               "rule for the op (docs/adding_a_primitive.md).")
    return UnsupportedOpError(
        f"the derivative {f.label()} of the MindSpore op {f.call.name} cannot be computed: "
        f"MindSpore said: {_first_line(e)}\nfshard differentiates an op without a native "
        f"rule with MindSpore's registered bprop; {why}")


def _zeros_np(a: ArrayType, fill=0.0):
    return np.full(tuple(a.shape), fill, dtypes.to_numpy(a.dtype))


#: How many kinds of sample operands shape inference tries, in order.
_N_SAMPLES = 4


def _sample(a: ArrayType, kind: int):
    """Sample operand of type ``a``: ``kind`` 0 zeros, 1 ones, 2 random values in
    (0.1, 0.9) (integers in [0, 3)), 3 the random values plus ``n`` times the identity
    on square matrices (symmetric positive definite: Cholesky's domain)."""
    if kind < 2:
        return backend.as_tensor(_zeros_np(a, float(kind)))
    rng = np.random.default_rng(0)
    shape = tuple(a.shape)
    if dtypes.is_float(a.dtype):
        v = rng.uniform(0.1, 0.9, shape)
        if kind == 3 and len(shape) >= 2 and shape[-1] == shape[-2]:
            v = (v + np.swapaxes(v, -1, -2)) / 2 + shape[-1] * np.eye(shape[-1])
    elif a.dtype == dtypes.bool_:
        v = rng.integers(0, 2, shape)
    else:
        v = rng.integers(0, 3, shape)
    return backend.as_tensor(v.astype(dtypes.to_numpy(a.dtype)))


def _run_checked(fn, args):
    """Run ``fn`` eagerly and wait for it (MindSpore runs eager ops asynchronously: a
    failing kernel raises at the next synchronisation)."""
    out = fn(*args)
    seq = out if isinstance(out, (tuple, list)) else (out,)
    for o in seq:
        if not backend.is_tensor(o):
            raise TypeError(f"it returned a {type(o).__name__}, not a Tensor")
        o.asnumpy()
    return out


def _infer(call: MsCall, in_avals: tuple) -> tuple:
    """Output types of ``call`` from MindSpore itself: the op run on sample operands
    (the first kind of sample in its domain), and whether it returned a sequence."""
    errors = []
    for kind in range(_N_SAMPLES):
        try:
            out = _run_checked(call, [_sample(a, kind) for a in in_avals])
        except Exception as e:  # noqa: BLE001  MindSpore raises RuntimeError, ValueError...
            errors.append(e)
            continue
        seq = out if isinstance(out, (tuple, list)) else (out,)
        return tuple(ArrayType(tuple(o.shape), o.dtype) for o in seq), isinstance(
            out, (tuple, list))
    first = _first_line(errors[0])
    raise UnsupportedOpError(
        f"the MindSpore op {call.name} cannot run on operands of types "
        f"({', '.join(str(a) for a in in_avals)}) on this backend: MindSpore said: {first}\n"
        "fshard learns the output types of an op without a native rule by running it "
        "once eagerly on sample operands of these types (zeros, ones, random values, "
        "positive definite matrices); it failed on each, so the op most likely fails "
        "outside fshard too.\nFix: check the op's arguments (dtypes, shapes); if it only "
        "accepts special values, compute it outside the traced function and pass the "
        "result in, or add a native rule for it (docs/adding_a_primitive.md).")


# -- generated source --------------------------------------------------------


class _Src:
    """Globals of one generated module."""

    def __init__(self):
        self.globals: dict = {}

    def ref(self, obj, hint: str) -> str:
        for k, v in self.globals.items():
            if v is obj:
                return k
        name = f"{hint}_{len(self.globals)}"
        self.globals[name] = obj
        return name

    def literal(self, v) -> str:
        if isinstance(v, _Slot):
            return f"a{v.i}"
        if type(v) in (list, tuple):
            inner = ", ".join(self.literal(e) for e in v)
            if type(v) is list:
                return f"[{inner}]"
            return f"({inner}{',' if len(v) == 1 else ''})"
        if isinstance(v, _SIMPLE) and not (isinstance(v, float) and not math.isfinite(v)):
            return repr(v)
        return self.ref(v, "c")


def _names(prefix: str, n: int) -> list:
    return [f"{prefix}{i}" for i in range(n)]


def _tuple_src(items: list) -> str:
    return items[0] if len(items) == 1 else "(" + ", ".join(items) + ")"


def _build(call: MsCall, derivs: tuple, parent, in_avals: tuple) -> MsFunction:
    src = _Src()
    if not derivs:
        out_avals, is_seq = _infer(call, in_avals)
        a = _names("a", len(in_avals))
        args = [src.literal(v) for v in call.args]
        args += [f"{k}={src.literal(v)}" for k, v in call.kwargs.items()]
        expr = f"{src.ref(call.fn, 'op')}({', '.join(args)})"
        if is_seq and len(out_avals) == 1:
            expr += "[0]"
        body = [f"def f({', '.join(a)}):", f"    return {expr}"]
        fn_in = in_avals
    else:
        kind, arg = derivs[-1]
        p = src.ref(parent.graph_fn, "parent")
        g = src.ref(_GRAD, "grad_all")
        n, pouts = len(parent.in_avals), parent.out_avals
        a = _names("a", n)
        fo = parent.float_outs
        # GRAPH mode's GradOperation(get_all=True) leaves out the gradient of an
        # argument that is a graph constant (a closed-over weight) and returns the
        # others shifted (measured: wrong numbers or an index error). So the function
        # differentiated, ``d``, takes the operands differentiated first and the rest
        # after them: a constant among the rest shifts nothing that is read.
        # An op that writes into its operands (BatchNorm's moving statistics in
        # training mode) must do so once per call: its derivatives run it again inside
        # GradOperation, so they get copies of the operands they do not differentiate.
        attrs = getattr(call.fn, "attrs", None)
        side = isinstance(attrs, dict) and bool(attrs.get("side_effect_mem"))
        copy = (lambda e: f"{src.ref(ops.deepcopy, 'deepcopy')}({e})") if side else (
            lambda e: e)
        if kind == "vjp":
            wrt = arg
            rest = [i for i in range(n) if i not in wrt]
            c = _names("c", len(fo))
            sens = []
            for j, o in enumerate(pouts):
                if j in fo:
                    sens.append(c[fo.index(j)])
                else:  # an integer output's cotangent: zeros (MindSpore wants one)
                    sens.append(f"{src.ref(ops.zeros, 'zeros')}({tuple(o.shape)!r}, "
                                f"{src.ref(o.dtype, 'dt')})")
            order = [a[i] for i in wrt] + [a[i] for i in rest]
            body = [f"def d({', '.join(order)}):",
                    f"    return {p}({', '.join(a)})",
                    "",
                    f"def f({', '.join(a + c)}):",
                    f"    r = {g}(d)({', '.join([a[i] for i in wrt] + [copy(a[i]) for i in rest])}"
                    f", {_tuple_src(sens)})",
                    f"    return {_tuple_src([f'r[{k}]' for k in range(len(wrt))])}"]
            fn_in = tuple(parent.in_avals) + tuple(pouts[j] for j in fo)
            out_avals = tuple(parent.in_avals[i] for i in wrt)
        elif kind == "jvp":
            wrt = arg
            t = _names("t", len(wrt))
            vjp_fn = parent.derive("vjp", wrt)
            v = src.ref(vjp_fn.graph_fn, "vjp")
            zl = src.ref(ops.zeros_like, "zeros_like")
            z = _names("z", len(fo))
            # The cotangent at which the (linear) VJP is differentiated: zeros_like of the
            # op's outputs, not a constant zeros (whose gradient GRAPH mode leaves out).
            body = [f"def d({', '.join(z + a)}):",
                    f"    return {v}({', '.join(a + z)})",
                    "",
                    f"def f({', '.join(a + t)}):",
                    f"    y = {p}({', '.join(copy(e) for e in a)})"]
            zs = ([f"{zl}(y)"] if len(pouts) == 1 else [f"{zl}(y[{j}])" for j in fo])
            body.append(f"    r = {g}(d)({', '.join(zs + [copy(e) for e in a])}, "
                        f"{_tuple_src(t)})")
            body.append(f"    return {_tuple_src([f'r[{k}]' for k in range(len(fo))])}")
            fn_in = tuple(parent.in_avals) + tuple(parent.in_avals[i] for i in wrt)
            out_avals = tuple(pouts[j] for j in fo)
        else:
            assert kind == "vmap", kind
            in_axes, size = arg
            vm = src.ref(ms.vmap, "vmap")
            body = [f"def f({', '.join(a)}):",
                    f"    return {vm}({p}, in_axes={tuple(in_axes)!r}, out_axes=0)"
                    f"({', '.join(a)})"]
            fn_in = tuple(ArrayType(_insert(x.shape, d, size), x.dtype) if d is not None else x
                          for x, d in zip(parent.in_avals, in_axes))
            out_avals = tuple(ArrayType((size,) + tuple(o.shape), o.dtype) for o in pouts)
        if kind != "vmap" and not out_avals:
            raise AssertionError("a derivative with no outputs")
    mod = backend.load_module("\n".join(body) + "\n", src.globals,
                              f"fshard_ms_op_{call.name}_{next(_module_counter)}")
    f = MsFunction(call, derivs, parent, fn_in, out_avals, mod.f)
    if not derivs:
        f.is_seq = is_seq
    if derivs and derivs[-1][0] == "vmap":
        _check_vmap(f)
    return f


def _insert(shape, d, size):
    shape = list(shape)
    shape.insert(d, size)
    return tuple(shape)


class _NoBatchingRule(Exception):
    pass


def _check_vmap(f: MsFunction) -> None:
    """Run ``mindspore.vmap`` of the parent once on sample operands and compare its
    first and last examples with the parent run on them alone: without a batching rule,
    or with one that gives other shapes or numbers (measured: MindSpore's ``Addcdiv``
    rule fails to broadcast), the per-example loop is used instead."""
    xs = [_sample(a, 2) for a in f.in_avals]
    try:
        out = _run_checked(f.graph_fn, xs)
    except Exception as e:  # noqa: BLE001
        raise _NoBatchingRule(_first_line(e)) from e
    seq = out if isinstance(out, (tuple, list)) else (out,)
    if tuple(ArrayType(tuple(o.shape), o.dtype) for o in seq) != f.out_avals:
        raise _NoBatchingRule("its batched output has other shapes")
    axes, size = f.derivs[-1][1]
    wrong = set()
    for i in sorted({0, size - 1}):
        one = [x if d is None else backend.as_tensor(np.take(x.asnumpy(), i, axis=d))
               for x, d in zip(xs, axes)]
        want = f.parent(*one)
        for j, (o, w) in enumerate(zip(seq, want)):
            if not np.allclose(o.asnumpy()[i], w.asnumpy(), rtol=1e-4, atol=1e-5,
                               equal_nan=True):
                wrong.add(j)
    if len(wrong) == len(seq):
        raise _NoBatchingRule("its batched results differ from a per-example loop")
    # Some outputs only (measured: the auxiliary batch-mean output of BatchNorm in
    # inference mode): those come from the loop; an unused one costs nothing compiled.
    f.loop_outputs = tuple(sorted(wrong))


def _measure_elementwise(f: MsFunction) -> bool:
    outs = f.out_avals
    if not outs or any(o.shape != outs[0].shape for o in outs):
        return False
    shape = tuple(outs[0].shape)
    if any(tuple(a.shape) not in (shape, ()) for a in f.in_avals) or not any(
            tuple(a.shape) == shape for a in f.in_avals):
        return False
    n = int(np.prod(shape, dtype=np.int64))
    if n < 2:
        return True
    xs = [_sample(a, 2).asnumpy() for a in f.in_avals]
    # distinct values per element, so a position-dependent op shows
    xs = [x if x.ndim == 0 or not np.issubdtype(x.dtype, np.floating) else
          (x + np.arange(n, dtype=x.dtype).reshape(shape) / n).astype(x.dtype) for x in xs]
    perm = np.random.default_rng(1).permutation(n)

    def permute(x):
        return x if x.ndim == 0 else x.reshape(-1)[perm].reshape(shape)

    def bump(x):
        if x.ndim == 0 or not np.issubdtype(x.dtype, np.floating):
            return x
        x = x.copy()
        x.reshape(-1)[0] = x.reshape(-1)[0] * 4 + 3
        return x

    try:
        y = [o.asnumpy() for o in f(*xs)]
        yp = [o.asnumpy() for o in f(*[permute(x) for x in xs])]
        yb = [o.asnumpy() for o in f(*[bump(x) for x in xs])]
    except Exception:  # noqa: BLE001  outside its domain: not claimed elementwise
        return False
    # Commuting with a permutation is not enough: an op that mixes all the elements
    # symmetrically (ClipByNorm's global norm, x / sum(x)) commutes too. Changing one
    # element must also leave every other output element as it was.
    return (all(np.array_equal(permute(a), b, equal_nan=True) for a, b in zip(y, yp))
            and all(np.array_equal(a.reshape(-1)[1:], b.reshape(-1)[1:], equal_nan=True)
                    for a, b in zip(y, yb)))


# ---------------------------------------------------------------------------
# The primitive and its rules
# ---------------------------------------------------------------------------


def _type_rule(*avals, fn: MsFunction):
    if tuple(avals) != tuple(fn.in_avals):
        raise ProgramTypeError(
            f"{fn.label()} was traced for operands ({', '.join(map(str, fn.in_avals))}) but "
            f"got ({', '.join(map(str, avals))})")
    return list(fn.out_avals)


def _lower(ctx, *exprs, fn: MsFunction):
    if fn.order >= 2:
        fn.check_runs()
    call = ctx.call(fn.graph_fn, *exprs)
    return call if len(fn.out_avals) != 1 else f"({call},)"


def _show(params) -> str:
    return params["fn"].label()


ms_op_p = def_primitive("ms_op", FAMILY, _type_rule, multiple_results=True,
                        eager=lambda *xs, fn: fn(*xs), lower=_lower, show=_show)


def _jvp_rule(primals, tangents, *, fn: MsFunction):
    outs = ms_op_p.bind(*primals, fn=fn)
    wrt = tuple(i for i, (a, t) in enumerate(zip(fn.in_avals, tangents))
                if not isinstance(t, Zero) and dtypes.is_float(a.dtype))
    touts = [Zero(a) for a in fn.out_avals]
    if wrt and fn.float_outs:
        jfn = fn.derive("jvp", wrt)
        ts = ms_op_p.bind(*primals, *[tangents[i] for i in wrt], fn=jfn)
        for j, t in zip(fn.float_outs, ts):
            touts[j] = t
    return outs, touts


jvp.set(ms_op_p, _jvp_rule)


def _transpose_rule(cts, *args, fn: MsFunction):
    undefined = tuple(i for i, a in enumerate(args) if isinstance(a, UndefinedPrimal))
    if fn.derivs and fn.derivs[-1][0] in ("jvp", "vjp"):
        # a JVP is linear in its tangents, a VJP in its cotangents: each transposes to
        # the other of the same parent (one MindSpore bprop, not a bprop of a bprop)
        kind, wrt = fn.derivs[-1]
        n = len(fn.parent.in_avals)
        if undefined == tuple(range(n, len(args))) and all(
                not isinstance(a, UndefinedPrimal) for a in args[:n]):
            other = fn.parent.derive("vjp" if kind == "jvp" else "jvp", wrt)
            cin = [instantiate(c) for c in cts]
            out = ms_op_p.bind(*args[:n], *cin, fn=other)
            return [None] * n + list(out)
    # any other linear use: the VJP of fn itself in its linear operands (at zeros)
    xs = [instantiate(Zero(a.aval)) if isinstance(a, UndefinedPrimal) else a for a in args]
    cin = [instantiate(cts[j]) for j in fn.float_outs]
    out = ms_op_p.bind(*xs, *cin, fn=fn.derive("vjp", undefined))
    res = [None] * len(args)
    for i, c in zip(undefined, out):
        res[i] = c
    return res


transpose.set(ms_op_p, _transpose_rule)


def _warn_once(op: str, what: str) -> None:
    key = (op, what)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(
        f"the MindSpore op {op} has no native fshard rule {what}. Add a native rule to make "
        "it fast (docs/adding_a_primitive.md); see docs/ops.md.", GenericOpWarning,
        stacklevel=2)


_warned: set = set()  # (op, what) already warned about, once per process


def _batching_rule(args, dims, *, fn: MsFunction):
    size = batch_size(args, dims)
    if fn.has_effect and any(d is None for d in dims):
        # One tensor, one write per call: vmap's examples would each write their own
        # value into it (MindSpore's Assign rule refuses too).
        raise UnsupportedOpError(
            f"the MindSpore op {fn.call.name} writes into an operand that is the same for "
            "every example of vmap (BatchNorm's moving statistics in training mode), and "
            "each example would write its own value into it.\nFix: under vmap, call the "
            "layer in inference mode (cell.set_train(False)), or call it outside vmap; "
            "fs.ops.batch_norm returns the new statistics instead of writing them.")
    try:
        vfn = fn.derive("vmap", (tuple(dims), size))
    except _NoBatchingRule:
        _warn_once(fn.call.name, "for vmap and no MindSpore batching rule: vmap runs it "
                   "once per example (a loop)")
        return _loop(args, dims, size, fn)
    outs = ms_op_p.bind(*args, fn=vfn)
    if vfn.loop_outputs:
        looped, _ = _loop(args, dims, size, fn)
        outs = [looped[j] if j in vfn.loop_outputs else o for j, o in enumerate(outs)]
    return outs, [0] * len(fn.out_avals)


def _loop(args, dims, size, fn):
    args = [move_axis(x, d, 0) if d is not None else x for x, d in zip(args, dims)]
    per_example = []
    for i in range(size):
        xs = []
        for x, d in zip(args, dims):
            if d is None:
                xs.append(x)
                continue
            shape = tuple(typeof(x).shape)
            one = slice_array(x, (i,) + (0,) * (len(shape) - 1), (i + 1,) + shape[1:])
            xs.append(reshape(one, shape[1:]))
        per_example.append(ms_op_p.bind(*xs, fn=fn))
    outs = []
    for j, a in enumerate(fn.out_avals):
        outs.append(concat([reshape(ys[j], (1,) + tuple(a.shape)) for ys in per_example], 0))
    return outs, [0] * len(outs)


batching.set(ms_op_p, _batching_rule)


def _sharding_rule(*avals, fn: MsFunction):
    if fn.elementwise:
        nd = fn.out_avals[0].ndim
        labels = tuple(f"d{i}" for i in range(nd))
        return FactorSpec([labels if a.ndim == nd else () for a in avals],
                          [labels] * len(fn.out_avals),
                          {lab: fn.out_avals[0].shape[i] for i, lab in enumerate(labels)},
                          local_params=_local_params)
    _warn_once(fn.call.name, "for shard and is not elementwise: it runs replicated (each "
               "device computes it whole)")
    return FactorSpec([(None,) * a.ndim for a in avals],
                      [(None,) * a.ndim for a in fn.out_avals], {}, flops_per_point=0.0)


def _local_params(params, local_in, local_out):
    return {"fn": params["fn"].retyped(tuple(local_in))}


sharding.set(ms_op_p, _sharding_rule)


# ---------------------------------------------------------------------------
# Tracing a call
# ---------------------------------------------------------------------------


def ms_call(name: str, fn, args: tuple, kwargs: dict):
    """Trace ``fn(*args, **kwargs)`` (a MindSpore primitive or overload named ``name``)
    as one ``ms_op`` equation; returns its output (a tuple for several)."""
    if name in DATA_DEPENDENT:
        short = name.replace("functional.", "")
        raise UnsupportedOpError(
            f"the MindSpore op {short} has an output shape that depends on its operands' "
            "values, which a traced program cannot have (its shapes are fixed when it is "
            "traced).\nFix: compute it outside the traced function and pass the result in, "
            "or use a static-size form: fs.ops.where(mask, x, fill) instead of "
            "masked_select, a padded index list of a known size (JAX's nonzero(size=...)) "
            "built from a cumsum of the mask.")
    operands: list = []
    targs = _template(tuple(args), operands)
    tkw = {k: _template(v, operands) for k, v in kwargs.items()}
    in_avals = tuple(typeof(x) for x in operands)
    for a in in_avals:
        if any(is_symbolic(d) for d in a.shape):
            raise UnsupportedOpError(
                f"the MindSpore op {name} has no native fshard rule, and the generic path "
                f"needs static shapes; it got an operand of type {a} (a symbolic dimension)."
                "\nFix: call it with static shapes (no fs.Symbol / set_inputs), or use an "
                "fshard op with a native rule (docs/ops.md).")
    call = MsCall(fn, name, targs, tkw, len(operands))
    f = _make(call, (), None, in_avals)
    outs = ms_op_p.bind(*operands, fn=f)
    return tuple(outs) if f.is_seq else outs[0]


_ASSIGN = ops.Assign()


def assign(variable, value):
    """Write ``value`` into ``variable`` (a Parameter or a tensor passed in) as MindSpore's
    ``Assign`` does, once per call of the traced function; returns the new value.

    The one effect in fshard's IR: the equation is kept although nothing reads it, and
    the write happens where the program runs (eagerly, or inside the compiled graph)."""
    return ms_call("Assign", _ASSIGN, (variable, value), {})
