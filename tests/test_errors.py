"""Golden messages of fshard's errors, and docs/errors.md documents every class."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest

import fshard as fs
from fshard import errors
from fshard import ops as F
from fshard.core.tracing import Primitive
from fshard.rules import abstract_eval, impl

DOCS = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
x = np.ones((4, 3), np.float32)


def _message(fn, cls):
    with pytest.raises(cls) as info:
        fn()
    return str(info.value)


def test_every_error_class_is_documented():
    text = DOCS.read_text()
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.FshardError)]
    for cls in classes:
        assert f"## {cls.__name__}" in text, f"docs/errors.md has no section for {cls.__name__}"
        assert cls.__doc__, f"{cls.__name__} has no docstring"


def test_error_classes_subclass_the_expected_builtins():
    assert issubclass(fs.TracerConversionError, TypeError)
    assert issubclass(fs.ShapeError, ValueError)
    assert issubclass(fs.BatchingError, ValueError)
    assert issubclass(fs.ShardingError, ValueError)
    assert issubclass(fs.MissingRuleError, NotImplementedError)
    assert issubclass(fs.UnsupportedOpError, NotImplementedError)


def test_tracer_conversion_error():
    msg = _message(lambda: fs.jit(lambda x: x if x.sum() > 0 else -x)(x),
                   fs.TracerConversionError)
    assert msg == (
        "bool() (an `if`, `while`, `and`/`or` or `assert`) was called on a traced value of "
        "type bool[]. Inside fshard transforms (jit, vmap, grad, shard) values are abstract: "
        "their contents are not known while the function is traced, so Python control flow "
        "cannot depend on them.\nFix: express the choice as data with fs.ops.where(cond, x, "
        "y) (or fs.ops.maximum/minimum), or pass the value as a static argument "
        "(fs.jit(f, static_argnums=...)) so it is concrete.\n"
        "See docs/errors.md#tracerconversionerror")


@pytest.mark.parametrize("call", ["float", "int", "item", "asnumpy"])
def test_concrete_conversions_are_refused(call):
    fns = {"float": float, "int": int, "item": lambda t: t.item(),
           "asnumpy": lambda t: t.asnumpy()}
    with pytest.raises(fs.TracerConversionError, match="traced value of type f32"):
        fs.make_ir(lambda v: fns[call](v.sum()))(x)


def test_shape_error():
    msg = _message(lambda: F.add(np.ones((3, 2), np.float32), np.ones((4, 2), np.float32)),
                   fs.ShapeError)
    assert msg == (
        "shapes (3, 2) and (4, 2) cannot be broadcast together (dimension 0 from the "
        "right-aligned end: 3 vs 4).\nFix: reshape or expand_dims one operand so each "
        "dimension is equal or 1.\nSee docs/errors.md#shapeerror")


def test_program_type_error_in_eager_mode_is_ours_not_mindsporess():
    msg = _message(lambda: F.select(x, x, x), fs.ProgramTypeError)
    assert msg == ("select needs a bool condition, got f32[4,3]\n"
                   "See docs/errors.md#programtypeerror")


def test_bool_amax_is_refused_as_mindspore_does_with_the_fix():
    import mindspore as ms
    from mindspore import ops
    x = ms.Tensor(np.array([True, False]))
    with pytest.raises(errors.ProgramTypeError, match=r"ops\.amin got a bool.*ops\.all\(x\)"):
        fs.jit(lambda v: ops.amin(v))(x)
    with pytest.raises(errors.ProgramTypeError, match=r"ops\.amax got a bool.*ops\.any\(x\)"):
        fs.jit(lambda v: ops.amax(v, 0))(x)
    assert bool(fs.jit(lambda v: ops.any(v))(x).asnumpy())  # the named fix works


def test_argument_error_symbol():
    assert _message(lambda: fs.Symbol(divisor=0), fs.ArgumentError) == (
        "Symbol(divisor=...) must be >= 1, got 0.\nSee docs/errors.md#argumenterror")
    assert "remainder" in _message(lambda: fs.Symbol(divisor=4, remainder=4), fs.ArgumentError)
    assert "min" in _message(lambda: fs.Symbol(min=0), fs.ArgumentError)


def test_batching_error_names_key_paths():
    msg = _message(lambda: fs.vmap(lambda a, b: a + b)(np.ones((3, 2), np.float32),
                                                       np.ones((4, 2), np.float32)),
                   fs.BatchingError)
    assert msg == (
        "vmap(<lambda>) got inconsistent sizes for the mapped axis:\n"
        "  args[0] (parameter 'a'): size 3 along in_axes=0\n"
        "  args[1] (parameter 'b'): size 4 along in_axes=0\n"
        "Fix: every mapped argument must have the same size along its in_axes; use "
        "in_axes=None for arguments that are not batched.\nSee docs/errors.md#batchingerror")


def test_differentiation_error_non_scalar():
    msg = _message(lambda: fs.grad(lambda v: v * 2.0)(x), fs.DifferentiationError)
    assert msg.startswith("grad(<lambda>) needs a function that returns a scalar float, but "
                          "it returned f32[4,3].")


def test_differentiation_error_integer_input():
    msg = _message(lambda: fs.grad(lambda v: v.sum())(np.ones(3, np.int32)),
                   fs.DifferentiationError)
    assert "args[0] (parameter 'v') has dtype Int32 (i32[3]), but only floating-point inputs" in msg


def test_missing_rule_error():
    toy = Primitive("toy_identity")
    abstract_eval.set(toy, lambda a: [a])
    impl.set(toy, lambda v: [v])
    msg = _message(lambda: fs.vmap(lambda v: toy.bind(v))(x), fs.MissingRuleError)
    assert msg.startswith("vmap needs the batching rule of primitive 'toy_identity', which "
                          "has none.\nFix: register one with fshard.rules.batching.set"
                          "(toy_identity, rule) in the module that declares it")


def test_missing_rule_error_names_the_declaring_module():
    from fshard.primitives.base import broadcast_to_p
    from fshard.rules import RuleTable

    table = RuleTable("batching", "batching rule")  # an empty table: every rule missing
    msg = _message(lambda: table.lookup(broadcast_to_p, transform="vmap"), fs.MissingRuleError)
    assert ("register one with fshard.rules.batching.set(broadcast_to, rule) in "
            "fshard/primitives/base.py, after its def_primitive") in msg


def test_tracer_leak_error():
    leaked = []
    fs.jit(lambda v: leaked.append(v) or v)(x)
    msg = _message(lambda: F.exp(leaked[0]), fs.TracerLeakError)
    assert re.match(r"a traced value Traced<f32\[4,3\]> reached 'exp' outside the transform",
                    msg)


def test_sharding_error():
    msg = _message(lambda: fs.shard(lambda v: v, in_strategy=((3, 1),), mesh=8)(x),
                   fs.ShardingError)
    assert msg == (
        "shard(<lambda>): in_strategy[0] = (3, 1) splits argument 'v' (f32[4,3]) into 3 "
        "blocks, which does not divide the 8 devices of the mesh.\nRule: the product of the "
        "split counts must divide the device count (the remaining factor holds replicas).\n"
        "Fix: use split counts whose product is 1, 2, 4 or 8, or another mesh (fs.Mesh, "
        "mesh=N or FSHARD_DEVICES).\nSee docs/errors.md#shardingerror")


def test_composition_error():
    msg = _message(lambda: fs.vmap(fs.shard(lambda v: v, in_strategy=((1,),), mesh=2))(x),
                   fs.CompositionError)
    assert msg == (
        "shard(<lambda>) is applied inside vmap, which fshard does not allow.\nRule: shard "
        "must sit outside vmap (as in MindSpore).\nAllowed form: "
        "fs.shard(fs.vmap(<lambda>), in_strategy=...); refused: "
        "fs.vmap(fs.shard(<lambda>, ...)).\nSee docs/errors.md#compositionerror")


class _Boom(Exception):
    pass


def _eval_staged(f, v):
    from fshard.core.tracing import typeof
    from fshard.core.interpret import eval_program
    from fshard.core.staging import stage

    program, consts = stage(lambda x: [f(x)], [typeof(v)])
    return eval_program(program, *consts, v)


def _boom(*args, **kwargs):
    raise _Boom("boom")


@pytest.mark.parametrize("kind, run, what", [
    ("impl", lambda f, v: _eval_staged(f, v), "evaluating"),
    ("batching", lambda f, v: fs.vmap(f)(np.ones((2, 3), np.float32)), "batching"),
    ("jvp", lambda f, v: fs.jvp(f, (v,), (v,)), "differentiating"),
    ("lowering", lambda f, v: fs.jit(f)(v), "lowering"),
    ("sharding", lambda f, v: fs.shard(f, in_strategy=((2,),), mesh=2)(v), "partitioning"),
])
def test_every_program_walker_notes_the_equation(monkeypatch, kind, run, what):
    """The one forward interpreter (fshard.core.interpret.walk) under evaluation, batching,
    differentiation, lowering and partitioning adds the failing equation to the error."""
    from fshard import rules
    from fshard.core.factors import elementwise_spec
    from fshard.primitives.elementwise import sin_p

    rule = _boom
    if kind == "sharding":  # the rule itself runs in propagation; fail in partitioning
        def rule(*avals, **params):
            spec = elementwise_spec(*avals)
            spec.local_params = _boom
            return spec
    monkeypatch.setitem(getattr(rules, kind)._rules, sin_p, rule)

    def f(v):
        return F.sin(v) * 2.0

    with pytest.raises(_Boom) as info:
        run(f, np.ones(4, np.float32))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"while {what} equation 'sin' on (f32[" in notes, notes


def test_unsupported_dtype_error_names_the_kernel():
    import mindspore

    x = mindspore.Tensor(np.ones((2, 2), np.float32)).astype(mindspore.bfloat16)
    with pytest.raises(fs.UnsupportedDtypeError) as info:
        F.exp(x)
    assert str(info.value) == (
        "MindSpore's CPU kernel for 'Exp' (in the eager 'exp' of bf16[2,2]) does not accept "
        "its operands' dtypes.\nFix: compute that op in a dtype the kernel takes: cast its "
        "operands (x.astype(mindspore.float32)), or use an fs.amp policy whose compute "
        "dtype is float16 or float32; docs/amp.md lists which ops run in which dtype.\n"
        "See docs/errors.md#unsupporteddtypeerror")
    assert isinstance(info.value, TypeError)


def test_a_jitted_cells_errors_name_the_callers_arguments():
    """fs.jit(cell): the caller passes construct's arguments (fshard supplies the
    parameters first), so an error names them as the caller counts and calls them."""
    import mindspore as ms
    from mindspore import nn

    class Two(nn.Cell):
        def __init__(self):
            super().__init__()
            self.d = nn.Dense(4, 3)

        def construct(self, x, y):
            return self.d(x) + y

    s = fs.Symbol()
    f = fs.jit(Two(), in_shapes=(fs.ArrayType((s, 4), ms.float32),
                                 fs.ArrayType((s, 3), ms.float32)))
    f(np.ones((2, 4), np.float32), np.ones((2, 3), np.float32))
    with pytest.raises(fs.ShapeError, match=r"args\[0\] \(parameter 'x'\) has shape \(2, 5\)"):
        f(np.ones((2, 5), np.float32), np.ones((2, 3), np.float32))
    with pytest.raises(fs.ShapeError, match=r"args\[1\] \(parameter 'y'\) has size 3 .* "
                       r"in args\[0\] \(parameter 'x'\)"):
        f(np.ones((2, 4), np.float32), np.ones((3, 3), np.float32))
    with pytest.raises(fs.ArgumentError, match=r"set_inputs: argument 1\[0\]: expected"):
        fs.jit(Two(), in_shapes=(None, (s, 3)))
