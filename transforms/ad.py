"""Automatic differentiation: ``jvp``, ``vjp``, ``grad``, ``value_and_grad``,
``jacfwd``, ``jacrev``, ``hessian`` (NB: JAX's ad.py, autodidax's linearize).

One rule set serves both modes. Each primitive has a JVP rule (nonlinear ones,
written with linear primitives in the tangents) or is linear with a transpose rule.

- ``jvp_program`` walks a staged Program carrying ``(primal, tangent)`` pairs; a
  tangent may be a symbolic ``Zero``.
- ``vjp`` = linearize + transpose: stage the JVP of the Program into one Program,
  split it with ``partial_eval`` into the *known* part (depends on primals only:
  evaluated now) and the *linear* part (depends on tangents), then walk the linear
  part backwards with transpose rules (``backward_pass``).

Everything is emitted through ``bind``, so derivatives of derivatives, and
derivatives under ``vmap`` or ``jit``, compose.
"""

from __future__ import annotations

import functools

from fshard import dtypes, tree
from fshard.core import ArrayType, bind, typeof
from fshard.errors import DifferentiationError
from fshard.interpret import equation_note, eval_program
from fshard.ir import Literal, Program, Var
from fshard.primitives._define import UndefinedPrimal, Zero, instantiate
from fshard.primitives.elementwise import add_tangents
from fshard.rules import jvp as jvp_rules
from fshard.rules import transpose as transpose_rules
from fshard.staging import fun_name, stage, trace_fun

# ---------------------------------------------------------------------------
# Forward mode
# ---------------------------------------------------------------------------


def jvp_program(program: Program, primals: list, tangents: list):
    """Evaluate ``program`` and its JVP. Returns ``(primals_out, tangents_out)``."""
    env = {v: (p, t) for v, p, t in zip(program.inputs, primals, tangents, strict=True)}

    def read(a):
        if isinstance(a, Literal):
            return a.value, Zero(a.aval)
        return env[a]

    for eq in program.equations:
        ps, ts = zip(*[read(a) for a in eq.inputs]) if eq.inputs else ((), ())
        try:
            if all(isinstance(t, Zero) for t in ts):
                outs = bind(eq.prim, *ps, **eq.params)
                outs = outs if eq.prim.multiple_results else [outs]
                touts = [Zero(v.aval) for v in eq.outputs]
            else:
                rule = jvp_rules.lookup(eq.prim, transform="differentiation (jvp/grad)")
                outs, touts = rule(list(ps), list(ts), **eq.params)
        except Exception as e:
            e.add_note(equation_note(eq, "differentiating"))
            raise
        for v, o, t in zip(eq.outputs, outs, touts, strict=True):
            env[v] = (o, t)
    res = [read(a) for a in program.outputs]
    return [p for p, _ in res], [t for _, t in res]


def _check_float(fname, api, leaves, paths):
    for x, p in zip(leaves, paths):
        dt = typeof(x).dtype
        if not dtypes.is_float(dt):
            raise DifferentiationError(
                f"{api}({fname}): {p} has dtype {dt}, but only floating-point inputs can be "
                f"differentiated.\nFix: cast it to float32 (x.astype(mindspore.float32)), or "
                "exclude it with argnums.")


def jvp(fun, primals, tangents):
    """Forward-mode derivative: ``(fun(*primals), J·tangents)``.

    >>> import numpy as np, fshard as fs
    >>> out, t = fs.jvp(fs.ops.sin, (np.float32(0.0),), (np.float32(2.0),))
    >>> float(t.asnumpy())
    2.0
    """
    fname = fun_name(fun)
    if not isinstance(primals, (tuple, list)) or not isinstance(tangents, (tuple, list)):
        raise DifferentiationError(
            f"jvp({fname}): primals and tangents must be tuples of arguments, got "
            f"{type(primals).__name__} and {type(tangents).__name__}.\nFix: "
            "fs.jvp(f, (x,), (t,)).")
    p_leaves, p_tree = tree.flatten(tuple(primals))
    t_leaves, t_tree = tree.flatten(tuple(tangents))
    if p_tree != t_tree:
        raise DifferentiationError(
            f"jvp({fname}): tangents must have the structure of primals; got {t_tree} "
            f"for primals {p_tree}.")
    for i, (p, t) in enumerate(zip(p_leaves, t_leaves)):
        if typeof(p) != typeof(t):
            raise DifferentiationError(
                f"jvp({fname}): tangent {i} has type {typeof(t)} but its primal has type "
                f"{typeof(p)}; they must match.")
    traced = trace_fun(lambda *a: fun(*a), tree.structure((tuple(primals), {})),
                       [typeof(x) for x in p_leaves])
    consts = traced.consts
    outs, touts = jvp_program(traced.program, consts + p_leaves,
                              [Zero(typeof(c)) for c in consts] + t_leaves)
    touts = [instantiate(t) for t in touts]
    return tree.unflatten(traced.out_tree, outs), tree.unflatten(traced.out_tree, touts)


# ---------------------------------------------------------------------------
# Reverse mode: linearize (partial evaluation) + transpose
# ---------------------------------------------------------------------------


def partial_eval(program: Program, unknown_inputs: list[bool]):
    """Split ``program`` by a forward taint from the unknown inputs.

    Returns ``(known, linear, n_known_outs, residual_vars)``: ``known`` computes the
    known outputs followed by the residuals from the known inputs; ``linear`` takes
    ``residuals + unknown inputs`` and computes the outputs that are unknown (the
    known outputs of ``linear`` are read from residuals).
    """
    unknown = {v for v, u in zip(program.inputs, unknown_inputs) if u}
    known_eqs, lin_eqs = [], []
    for eq in program.equations:
        if any(isinstance(a, Var) and a in unknown for a in eq.inputs):
            lin_eqs.append(eq)
            unknown.update(eq.outputs)
        else:
            known_eqs.append(eq)
    # Residuals: known values the linear part reads.
    lin_defined = set(v for v, u in zip(program.inputs, unknown_inputs) if u)
    for eq in lin_eqs:
        lin_defined.update(eq.outputs)
    residuals, seen = [], set()
    for a in [a for eq in lin_eqs for a in eq.inputs] + list(program.outputs):
        if isinstance(a, Var) and a not in lin_defined and a not in seen:
            seen.add(a)
            residuals.append(a)
    known_inputs = [v for v, u in zip(program.inputs, unknown_inputs) if not u]
    known = Program(known_inputs, known_eqs, residuals)
    linear = Program(residuals + [v for v, u in zip(program.inputs, unknown_inputs) if u],
                     lin_eqs, list(program.outputs))
    return known, linear


def backward_pass(linear: Program, n_res: int, residuals: list, cts_out: list) -> list:
    """Transpose ``linear`` (NB: JAX's backward_pass): cotangents of its unknown inputs.

    ``cts_out`` has one cotangent (or Zero) per output of ``linear``.
    """
    res_env = dict(zip(linear.inputs[:n_res], residuals, strict=True))
    lin_vars = set(linear.inputs[n_res:])
    for eq in linear.equations:
        lin_vars.update(eq.outputs)
    ct_env: dict = {}

    def add_ct(v, ct):
        if isinstance(ct, Zero) or ct is None:
            return
        ct_env[v] = add_tangents(ct_env[v], ct) if v in ct_env else ct

    for v, ct in zip(linear.outputs, cts_out, strict=True):
        if isinstance(v, Var) and v in lin_vars:
            add_ct(v, ct)

    for eq in reversed(linear.equations):
        cts = [ct_env.pop(v, None) for v in eq.outputs]
        if all(c is None for c in cts):
            continue
        cts = [Zero(v.aval) if c is None else c for c in cts]
        args = []
        for a in eq.inputs:
            if isinstance(a, Literal):
                args.append(a.value)
            elif a in lin_vars:
                args.append(UndefinedPrimal(a.aval))
            else:
                args.append(res_env[a])
        try:
            rule = transpose_rules.lookup(eq.prim, transform="reverse-mode differentiation")
            cts_in = rule(cts if eq.prim.multiple_results else cts[0], *args, **eq.params)
        except Exception as e:
            e.add_note(equation_note(eq, "transposing"))
            raise
        for a, ct in zip(eq.inputs, cts_in, strict=True):
            if isinstance(a, Var) and a in lin_vars:
                add_ct(a, ct)
    return [ct_env.get(v, Zero(v.aval)) for v in linear.inputs[n_res:]]


def _linearize_flat(program: Program, consts: list, primals: list):
    """Linearize a staged Program at ``consts + primals``.

    Returns ``(primals_out, lin)`` where ``lin(cts_out) -> cts of primals``.
    """
    n_in = len(program.inputs)
    n_consts = len(consts)
    in_avals = [v.aval for v in program.inputs]
    diff_avals = in_avals[n_consts:]

    def jvp_flat(*args):
        ps, ts = list(args[:n_in]), list(args[n_in:])
        outs, touts = jvp_program(program, ps, [Zero(a) for a in in_avals[:n_consts]] + ts)
        return outs + [instantiate(t) for t in touts]

    jvp_prog, jvp_consts = stage(jvp_flat, in_avals + diff_avals)
    n_jc = len(jvp_consts)
    unknown = [False] * (n_jc + n_in) + [True] * len(diff_avals)
    known, linear = partial_eval(jvp_prog, unknown)
    residuals = eval_program(known, *(jvp_consts + consts + primals))
    n_out = len(program.outputs)
    # The primal outputs are known: read them from the residuals.
    res_of = dict(zip(known.outputs, residuals))

    def value_of(a):
        return a.value if isinstance(a, Literal) else res_of[a]

    primals_out = [value_of(a) for a in jvp_prog.outputs[:n_out]]
    n_res = len(known.outputs)
    linear_t = Program(linear.inputs, linear.equations, linear.outputs[n_out:])

    def lin(cts_out):
        return backward_pass(linear_t, n_res, residuals, list(cts_out))

    return primals_out, lin


def vjp(fun, *primals, has_aux: bool = False):
    """Reverse-mode: ``(fun(*primals), vjp_fn)`` with ``vjp_fn(ct) -> cts of primals``.

    >>> import numpy as np, fshard as fs
    >>> out, f_vjp = fs.vjp(lambda x: (x * x).sum(), np.ones(3, np.float32))
    >>> f_vjp(np.float32(1.0))[0].asnumpy()
    array([2., 2., 2.], dtype=float32)
    """
    fname = fun_name(fun)
    leaves, in_tree = tree.flatten((primals, {}))
    paths, _, _ = tree.flatten_with_path(primals)
    _check_float(fname, "vjp", leaves, [f"args{tree.keystr(p)}" for p in paths])
    traced = trace_fun(fun, in_tree, [typeof(x) for x in leaves])
    out_tree = traced.out_tree
    primals_out, lin = _linearize_flat(traced.program, traced.consts, leaves)
    aux = None
    if has_aux:
        out, aux = _split_aux(fname, out_tree, primals_out)
        main_tree = tree.structure(out)
        n_main = len(tree.leaves(out))
    else:
        out = tree.unflatten(out_tree, primals_out)
        main_tree, n_main = out_tree, len(primals_out)
    out_avals = [typeof(x) for x in primals_out[:n_main]]
    n_all = len(primals_out)

    def vjp_fn(ct):
        ct_leaves, ct_tree = tree.flatten(ct)
        if ct_tree != main_tree:
            raise DifferentiationError(
                f"vjp({fname}): the cotangent must have the structure of the output, "
                f"{main_tree}; got {ct_tree}.")
        for i, (c, a) in enumerate(zip(ct_leaves, out_avals)):
            if tuple(typeof(c).shape) != tuple(a.shape):
                raise DifferentiationError(
                    f"vjp({fname}): cotangent {i} has shape {typeof(c).shape}, the output "
                    f"has shape {a.shape}.")
        ct_leaves = [_as_dtype(c, a.dtype) for c, a in zip(ct_leaves, out_avals)]
        cts = ct_leaves + [Zero(typeof(x)) for x in primals_out[n_main:n_all]]
        cts_in = [instantiate(c) for c in lin(cts)]
        return tree.unflatten(in_tree, cts_in)[0]

    if has_aux:
        return out, vjp_fn, aux
    return out, vjp_fn


def _as_dtype(x, dtype):
    from fshard.primitives.elementwise import cast

    if isinstance(x, (int, float)) or typeof(x).dtype != dtype:
        return cast(x, dtype)
    return x


def _split_aux(fname, out_tree, flat):
    out = tree.unflatten(out_tree, flat)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise DifferentiationError(
            f"{fname} was differentiated with has_aux=True, so it must return a pair "
            f"(output, aux); it returned {out_tree}.")
    return out[0], out[1]


def _normalize_argnums(fname, argnums, nargs):
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)
    for i in nums:
        if not isinstance(i, int) or not -nargs <= i < nargs:
            raise DifferentiationError(
                f"grad({fname}): argnums={argnums!r} refers to argument {i}, but the "
                f"function was called with {nargs} positional arguments.")
    return single, tuple(i % nargs for i in nums)


def value_and_grad(fun, argnums=0, has_aux: bool = False):
    """``(fun(*args), gradient)`` of a scalar-valued function.

    >>> import numpy as np, fshard as fs
    >>> v, g = fs.value_and_grad(lambda x: (x ** 2).sum())(np.array([1., 2.], np.float32))
    >>> g.asnumpy()
    array([2., 4.], dtype=float32)

    Args:
        fun: returns a scalar float (or ``(scalar, aux)`` with ``has_aux``).
        argnums: int or tuple of ints: which positional arguments to differentiate;
            each may be a pytree (e.g. a dict of parameters).
        has_aux: ``fun`` returns ``(output, aux)``; aux is returned, not differentiated.

    Returns:
        ``(value, grads)`` or ``((value, aux), grads)``; grads mirror the structure of
        the chosen arguments (a tuple of them if ``argnums`` is a tuple).
    """
    from fshard.cells import maybe_cell

    return maybe_cell(fun, lambda f: _value_and_grad(f, argnums, has_aux))


def _value_and_grad(fun, argnums, has_aux):
    fname = fun_name(fun)

    @functools.wraps(fun)
    def vg(*args, **kwargs):
        single, nums = _normalize_argnums(fname, argnums, len(args))

        def partial(*diff):
            full = list(args)
            for i, d in zip(nums, diff):
                full[i] = d
            return fun(*full, **kwargs)

        diff_args = [args[i] for i in nums]
        for i, a in zip(nums, diff_args):
            paths, leaves, _ = tree.flatten_with_path(a)
            _check_float(fname, "grad", leaves, [f"args[{i}]{tree.keystr(p)}" for p in paths])
        if has_aux:
            out, vjp_fn, aux = vjp(partial, *diff_args, has_aux=True)
        else:
            out, vjp_fn = vjp(partial, *diff_args)
        o = typeof(out) if not isinstance(out, (tuple, list, dict)) else None
        if o is None or o.shape != () or not dtypes.is_float(o.dtype):
            got = o if o is not None else type(out).__name__
            raise DifferentiationError(
                f"grad({fname}) needs a function that returns a scalar float, but it returned "
                f"{got}.\nFix: reduce the output (e.g. .sum() or .mean()); for vector outputs "
                "use fs.vjp, fs.jacrev or fs.jacfwd; with an auxiliary output use has_aux=True.")
        from fshard.primitives.structural import ones

        grads = vjp_fn(ones((), o.dtype))
        grads = grads[0] if single else tuple(grads)
        return ((out, aux), grads) if has_aux else (out, grads)

    return vg


def grad(fun, argnums=0, has_aux: bool = False):
    """The gradient of a scalar-valued function (see ``value_and_grad``).

    >>> import numpy as np, fshard as fs
    >>> fs.grad(lambda x: (x * x).sum())(np.array([1., 2.], np.float32)).asnumpy()
    array([2., 4.], dtype=float32)
    """
    from fshard.cells import maybe_cell

    def make(f):
        vg = _value_and_grad(f, argnums, has_aux)

        @functools.wraps(f)
        def g(*args, **kwargs):
            out, grads = vg(*args, **kwargs)
            return (grads, out[1]) if has_aux else grads

        return g

    return maybe_cell(fun, make)


# ---------------------------------------------------------------------------
# Jacobians
# ---------------------------------------------------------------------------


def _basis(aval: ArrayType):
    """An identity "matrix" of shape ``(size,) + shape`` (one basis vector per row)."""
    import numpy as np

    from fshard.backend.mindspore import as_tensor

    n = aval.size
    eye = np.eye(n, dtype=dtypes.to_numpy(aval.dtype)).reshape((n,) + tuple(aval.shape))
    return as_tensor(eye)


def jacfwd(fun, argnums=0):
    """Jacobian by forward mode: output shape ``out.shape + in.shape``."""
    from fshard.transforms.vmap import vmap

    @functools.wraps(fun)
    def jac(*args):
        _, nums = _normalize_argnums(fun_name(fun), argnums, len(args))
        i = nums[0]
        x = args[i]
        a = typeof(x)

        def pushforward(t):
            def f_i(xi):
                full = list(args)
                full[i] = xi
                return fun(*full)

            return jvp(f_i, (x,), (t,))[1]

        from fshard.primitives.structural import reshape
        from fshard.primitives.structural import transpose as tr

        cols = vmap(pushforward)(_basis(a))  # (n_in,) + out.shape
        nd_out = typeof(cols).ndim - 1
        cols = tr(cols, tuple(range(1, nd_out + 1)) + (0,))
        return reshape(cols, tuple(typeof(cols).shape[:-1]) + tuple(a.shape))

    return jac


def jacrev(fun, argnums=0):
    """Jacobian by reverse mode: output shape ``out.shape + in.shape``."""
    from fshard.transforms.vmap import vmap

    @functools.wraps(fun)
    def jac(*args):
        _, nums = _normalize_argnums(fun_name(fun), argnums, len(args))
        i = nums[0]

        def f_i(xi):
            full = list(args)
            full[i] = xi
            return fun(*full)

        out, vjp_fn = vjp(f_i, args[i])
        o = typeof(out)
        rows = vmap(lambda ct: vjp_fn(ct)[0])(_basis(o))  # (n_out,) + in.shape
        from fshard.primitives.structural import reshape

        return reshape(rows, tuple(o.shape) + tuple(typeof(args[i]).shape))

    return jac


def hessian(fun, argnums=0):
    """Second derivative: ``jacfwd(jacrev(fun))``."""
    return jacfwd(jacrev(fun, argnums), argnums)
