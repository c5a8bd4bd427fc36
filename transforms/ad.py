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

from fshard.core import context, dtypes, tree
from fshard.core.tracing import typeof
from fshard.errors import DifferentiationError
from fshard.core.interpret import bind_equation, equation_note, eval_program, walk
from fshard.core.ir import Literal, Program, Var
from fshard.primitives.base import UndefinedPrimal, Zero, add_tangents, instantiate
from fshard.primitives.collectives import input_cotangents, replica_axes, seed_cotangents
from fshard.core.rules import jvp as jvp_rules
from fshard.core.rules import partial_eval as partial_eval_rules
from fshard.core.rules import transpose as transpose_rules
from fshard.core.staging import check_function, fun_name, stage, trace_fun
from fshard.transforms.vmap import arg_path, type_tree

# ---------------------------------------------------------------------------
# Forward mode
# ---------------------------------------------------------------------------


def jvp_program(program: Program, primals: list, tangents: list):
    """Evaluate ``program`` and its JVP. Returns ``(primals_out, tangents_out)``."""
    def rule(eq, pairs):
        ps, ts = zip(*pairs) if pairs else ((), ())
        if all(isinstance(t, Zero) for t in ts):
            outs = bind_equation(eq, ps)
            touts = [Zero(v.aval) for v in eq.outputs]
        else:
            jvp_rule = jvp_rules.lookup(eq.prim, transform="differentiation (jvp/grad)")
            outs, touts = jvp_rule(list(ps), list(ts), **eq.params)
        return list(zip(outs, touts, strict=True))

    res = walk(program, list(zip(primals, tangents, strict=True)), rule, "differentiating",
               literal=lambda a: (a.value, Zero(a.aval)))
    return [p for p, _ in res], [t for _, t in res]


def _check_float(fname, api, leaves, paths, fix):
    for x, p in zip(leaves, paths):
        dt = typeof(x).dtype
        if not dtypes.is_float(dt):
            raise DifferentiationError(
                f"{api}({fname}): {p} has dtype {dt} ({typeof(x)}), but only floating-point "
                f"inputs can be differentiated.\nFix: {fix}")


def jvp(fun, primals, tangents, has_aux: bool = False):
    """Forward-mode derivative: ``(fun(*primals), J·tangents)``.

    >>> import numpy as np, fshard as fs
    >>> out, t = fs.jvp(fs.ops.sin, (np.float32(0.0),), (np.float32(2.0),))
    >>> float(t.asnumpy())
    2.0

    Args:
        fun: a function of pytrees of arrays.
        primals: a tuple of the arguments at which to differentiate.
        tangents: a tuple of the same structure, shapes and dtypes as ``primals``.
        has_aux: ``fun`` returns ``(output, aux)``; aux is returned, not differentiated.

    Returns:
        ``(out, tangent_out)``, or ``(out, tangent_out, aux)`` with ``has_aux``.

    See also: ``fs.jacfwd``, ``fs.vjp``; docs/autodiff.md.
    """
    check_function("fs.jvp", fun)
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
            f"jvp({fname}): tangents must have the structure of primals; primals are "
            f"{type_tree(tuple(primals))} but tangents are {type_tree(tuple(tangents))}.\n"
            "Fix: pass one tangent per primal, in the same containers.")
    paths = [arg_path(fun, i, p) for i, a in enumerate(primals)
             for p in tree.flatten_with_path(a)[0]]
    for path, p, t in zip(paths, p_leaves, t_leaves):
        if typeof(p) != typeof(t):
            raise DifferentiationError(
                f"jvp({fname}): the tangent for {path} has type {typeof(t)}, but the primal "
                f"has type {typeof(p)}; a tangent must have its primal's shape and dtype.\n"
                "Fix: build the tangent like the primal (e.g. np.ones_like(x)), or cast it "
                "(t.astype(x.dtype)).")
    traced = trace_fun(lambda *a: fun(*a), tree.structure((tuple(primals), {})),
                       [typeof(x) for x in p_leaves])
    consts = traced.consts
    outs, touts = jvp_program(traced.program, consts + p_leaves,
                              [Zero(typeof(c)) for c in consts] + t_leaves)
    if has_aux:
        out, aux = _split_aux(fname, "jvp", traced.out_tree, outs)
        n_main = len(tree.leaves(out))
        main_tree = tree.structure(out)
        touts = [instantiate(t) for t in touts[:n_main]]
        return out, tree.unflatten(main_tree, touts), aux
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
        mask = [isinstance(a, Var) and a in unknown for a in eq.inputs]
        if not any(mask):
            known_eqs.append(eq)
            continue
        rule = partial_eval_rules.get(eq.prim)
        if rule is None:
            lin_eqs.append(eq)
            unknown.update(eq.outputs)
            continue
        # a primitive that splits itself (remat_call): its known outputs stay known
        k_eqs, u_eqs = rule(eq, mask)
        known_eqs += k_eqs
        lin_eqs += u_eqs
        unknown.update(v for e in u_eqs for v in e.outputs)
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
        cts = [Zero(v.aval) if c is None else c for v, c in zip(eq.outputs, cts)]
        args = []
        for a in eq.inputs:
            if isinstance(a, Literal):
                args.append(a.value)
            elif a in lin_vars:
                args.append(UndefinedPrimal(a.aval))
            else:
                args.append(res_env[a])
        undefined = [i for i, x in enumerate(args) if isinstance(x, UndefinedPrimal)]
        if (len(undefined) > 1 and eq.prim.name in _LINEAR_IN_ONE) or (
                eq.prim.name == "div" and 1 in undefined):
            raise DifferentiationError(
                f"reverse-mode differentiation met '{eq.prim.name}' of two values that both "
                "depend on the tangents: the linearized program is not linear. This happens "
                "when a custom_jvp rule's tangent output is not linear in the input "
                "tangents (e.g. t * t).\nFix: make the JVP rule linear in the tangents "
                "(multiply tangents only by primal values)."
                + (f" (created at {eq.source})" if eq.source else ""))
        token = context.source.set(eq.source)
        try:
            rule = transpose_rules.lookup(eq.prim, transform="reverse-mode differentiation")
            cts_in = rule(cts if eq.prim.multiple_results else cts[0], *args, **eq.params)
        except Exception as e:
            e.add_note(equation_note(eq, "transposing"))
            raise
        finally:
            context.source.reset(token)
        for a, ct in zip(eq.inputs, cts_in, strict=True):
            if isinstance(a, Var) and a in lin_vars:
                add_ct(a, ct)
    return [ct_env.get(v, Zero(v.aval)) for v in linear.inputs[n_res:]]


# Bilinear primitives: linear in each operand, so a linear program uses them with at
# most one operand depending on the tangents.
_LINEAR_IN_ONE = frozenset({"mul", "matmul", "div", "gather", "dot_general", "conv"})


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

    Args:
        fun: a function of pytrees of float arrays.
        *primals: the arguments at which to linearize.
        has_aux: ``fun`` returns ``(output, aux)``; aux is returned, not differentiated.

    Returns:
        ``(out, vjp_fn)`` or ``(out, vjp_fn, aux)``; ``vjp_fn(ct)`` takes a cotangent of
        ``out``'s structure and returns a tuple with one cotangent per primal.

    See also: ``fs.grad``, ``fs.jacrev``; docs/autodiff.md.
    """
    check_function("fs.vjp", fun)
    return _vjp(fun, primals, has_aux, "vjp")


def _vjp(fun, primals, has_aux, api):
    fname = fun_name(fun)
    leaves, in_tree = tree.flatten((primals, {}))
    paths = [arg_path(fun, i, p) for i, a in enumerate(primals)
             for p in tree.flatten_with_path(a)[0]]
    _check_float(fname, api, leaves, paths,
                 "cast it to float32 (x.astype(mindspore.float32)), or close over it instead "
                 "of passing it as a primal.")
    traced = trace_fun(fun, in_tree, [typeof(x) for x in leaves])
    out_tree = traced.out_tree
    primals_out, lin = _linearize_flat(traced.program, traced.consts, leaves)
    aux = None
    if has_aux:
        out, aux = _split_aux(fname, api, out_tree, primals_out)
        main_tree = tree.structure(out)
        n_main = len(tree.leaves(out))
    else:
        out = tree.unflatten(out_tree, primals_out)
        main_tree, n_main = out_tree, len(primals_out)
    out_avals = [typeof(x) for x in primals_out[:n_main]]
    n_all = len(primals_out)
    replicas = replica_axes()  # inside a shard_map body: see docs/collectives.md

    def vjp_fn(ct):
        ct_leaves, ct_tree = tree.flatten(ct)
        if ct_tree != main_tree:
            raise DifferentiationError(
                f"{api}({fname}): the cotangent must have the structure of the output, which "
                f"is {type_tree(out)}; got {type_tree(ct)}.\nFix: pass one cotangent per "
                "output leaf, in the output's containers.")
        for i, (c, a) in enumerate(zip(ct_leaves, out_avals)):
            t = typeof(c)
            weak = isinstance(c, (int, float)) and not isinstance(c, bool)
            if tuple(t.shape) != tuple(a.shape) or (not weak and t.dtype != a.dtype):
                raise DifferentiationError(
                    f"{api}({fname}): cotangent leaf {i} has type {t}, but the output leaf "
                    f"has type {a}; a cotangent must have its output's shape and dtype.\n"
                    f"Fix: cast it, e.g. ct.astype(mindspore.{a.dtype}).")
        ct_leaves = [_as_dtype(c, a.dtype) for c, a in zip(ct_leaves, out_avals)]
        ct_leaves = seed_cotangents(ct_leaves, primals_out[:n_main], replicas)
        cts = ct_leaves + [Zero(typeof(x)) for x in primals_out[n_main:n_all]]
        cts_in = [instantiate(c) for c in lin(cts)]
        cts_in = input_cotangents(cts_in, leaves, replicas)
        return tree.unflatten(in_tree, cts_in)[0]

    if has_aux:
        return out, vjp_fn, aux
    return out, vjp_fn


def linearize(fun, *primals, has_aux: bool = False):
    """``(fun(*primals), f_jvp)``: ``f_jvp(*tangents)`` is the JVP at ``primals``,
    evaluated without running ``fun`` again (NB: ``jax.linearize``).

    >>> import numpy as np, fshard as fs
    >>> out, f_jvp = fs.linearize(lambda x: fs.ops.sin(x) * x, np.float32(2.0))
    >>> round(float(f_jvp(np.float32(1.0)).asnumpy()), 3)  # sin(2) + 2 cos(2)
    0.077

    ``fun`` is traced once, its JVP staged and split by partial evaluation: the part
    that depends on the primals only runs now (its results are kept), and ``f_jvp``
    runs the part linear in the tangents. Use it to apply one Jacobian to many
    tangents cheaply.

    Args:
        fun: a function of pytrees of float arrays.
        *primals: the arguments at which to linearize.
        has_aux: ``fun`` returns ``(output, aux)``; aux is returned, not differentiated.

    Returns:
        ``(out, f_jvp)`` (``(out, f_jvp, aux)`` with ``has_aux``); ``f_jvp`` takes one
        tangent per primal (same structure, shapes and dtypes) and returns the output
        tangent, shaped like ``out``.

    See also: ``fs.jvp``, ``fs.vjp``; docs/autodiff.md.
    """
    check_function("fs.linearize", fun)
    fname = fun_name(fun)
    leaves, in_tree = tree.flatten((primals, {}))
    paths = [arg_path(fun, i, p) for i, a in enumerate(primals)
             for p in tree.flatten_with_path(a)[0]]
    _check_float(fname, "linearize", leaves, paths,
                 "cast it to float32 (x.astype(mindspore.float32)), or close over it instead "
                 "of passing it as a primal.")
    traced = trace_fun(fun, in_tree, [typeof(x) for x in leaves])
    program, consts = traced.program, traced.consts
    n_in, n_c = len(program.inputs), len(consts)
    in_avals = [v.aval for v in program.inputs]

    def jvp_flat(*args):
        ps, ts = list(args[:n_in]), list(args[n_in:])
        outs, touts = jvp_program(program, ps, [Zero(a) for a in in_avals[:n_c]] + ts)
        return outs + [instantiate(t) for t in touts]

    jvp_prog, jvp_consts = stage(jvp_flat, in_avals + in_avals[n_c:])
    n_jc = len(jvp_consts)
    known, linear = partial_eval(jvp_prog, [False] * (n_jc + n_in) + [True] * len(leaves))
    residuals = eval_program(known, *(jvp_consts + consts + leaves))
    res_of = dict(zip(known.outputs, residuals))
    n_out = len(program.outputs)
    primals_out = [a.value if isinstance(a, Literal) else res_of[a]
                   for a in jvp_prog.outputs[:n_out]]
    tangent_part = Program(linear.inputs, linear.equations, linear.outputs[n_out:])
    out_tree, aux = traced.out_tree, None
    if has_aux:
        out, aux = _split_aux(fname, "linearize", traced.out_tree, primals_out)
        out_tree = tree.structure(out)
        n_main = len(tree.leaves(out))
        primals_out = primals_out[:n_main]
        tangent_part = Program(tangent_part.inputs, tangent_part.equations,
                               tangent_part.outputs[:n_main])
    out_avals = [typeof(x) for x in primals_out]
    primal_tree = tree.structure(tuple(primals))

    def f_jvp(*tangents):
        t_leaves, t_tree = tree.flatten(tuple(tangents))
        if t_tree != primal_tree:
            raise DifferentiationError(
                f"linearize({fname}): f_jvp takes one tangent per primal, with the "
                f"primals' structure {type_tree(tuple(primals))}; got "
                f"{type_tree(tuple(tangents))}.\nFix: call f_jvp(*tangents), one per "
                "primal, in the same containers.")
        for path, p, t in zip(paths, leaves, t_leaves):
            if typeof(p) != typeof(t):
                raise DifferentiationError(
                    f"linearize({fname}): the tangent for {path} has type {typeof(t)}, "
                    f"but the primal has type {typeof(p)}; a tangent must have its "
                    "primal's shape and dtype.\nFix: build it like the primal (e.g. "
                    "np.ones_like(x)), or cast it (t.astype(x.dtype)).")
        touts = eval_program(tangent_part, *residuals, *t_leaves)
        touts = [t if hasattr(t, "asnumpy") or hasattr(t, "aval") else _as_dtype(t, a.dtype)
                 for t, a in zip(touts, out_avals)]  # a literal output: as an array
        return tree.unflatten(out_tree, touts)

    if has_aux:
        return tree.unflatten(out_tree, primals_out), f_jvp, aux
    return tree.unflatten(out_tree, primals_out), f_jvp


def _as_dtype(x, dtype):
    from fshard.primitives.elementwise import cast

    if isinstance(x, (int, float)) or typeof(x).dtype != dtype:
        return cast(x, dtype)
    return x


def _split_aux(fname, api, out_tree, flat):
    out = tree.unflatten(out_tree, flat)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise DifferentiationError(
            f"{api}({fname}) was called with has_aux=True, so {fname} must return a pair "
            f"(output, aux); it returned {type_tree(out)}.\nFix: return (output, aux), or "
            "drop has_aux=True.")
    return out[0], out[1]


def _normalize_argnums(fname, api, argnums, nargs):
    """``(single, nums)``: whether ``argnums`` is one int, and the non-negative indices."""
    def is_int(i):
        return isinstance(i, int) and not isinstance(i, bool)

    single = is_int(argnums)
    if not single and not (isinstance(argnums, (tuple, list)) and argnums
                           and all(is_int(i) for i in argnums)):
        raise DifferentiationError(
            f"{api}({fname}): argnums must be an int or a non-empty tuple of ints, got "
            f"{argnums!r}.")
    nums = (argnums,) if single else tuple(argnums)
    for i in nums:
        if not -nargs <= i < nargs:
            plural = "argument" if nargs == 1 else "arguments"
            raise DifferentiationError(
                f"{api}({fname}): argnums={argnums!r} refers to positional argument {i}, but "
                f"{fname} was called with {nargs} positional {plural}.\nFix: use argnums "
                f"in [{-nargs}, {nargs - 1}]; to differentiate a keyword argument, pass it "
                "positionally.")
    return single, tuple(i % nargs for i in nums)


def _tensors(x):
    """NumPy arrays as Tensors: arguments that are not differentiated reach the user's
    MindSpore code as they are, and MindSpore ops refuse NumPy arrays (jit, vmap and
    shard convert them the same way)."""
    import numpy as np

    from fshard.backend.mindspore import as_tensor

    return tree.map(lambda a: as_tensor(a) if isinstance(a, np.ndarray) else a, x)


def _distinct(nums):
    """``(unique, expand)``: differentiate each argument once, then give every listed
    position its gradient (``argnums=(0, 0)`` returns the gradient twice, as in JAX;
    substituting one input twice would leave the first substitution unused)."""
    unique = tuple(dict.fromkeys(nums))
    where = [unique.index(i) for i in nums]

    def expand(per_unique):
        per_unique = tuple(per_unique)
        return tuple(per_unique[w] for w in where)

    return unique, expand


def _partial(fun, fname, args, kwargs, nums):
    """``fun`` as a function of the arguments at ``nums`` only."""
    def partial(*diff):
        full = list(args)
        for i, d in zip(nums, diff):
            full[i] = d
        return fun(*full, **kwargs)

    partial.__name__ = fname
    return partial


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
    from fshard.adapter.cells import maybe_cell

    check_function("fs.value_and_grad", fun)
    return maybe_cell(fun, lambda f: _value_and_grad(f, argnums, has_aux, "value_and_grad"))


def _value_and_grad(fun, argnums, has_aux, api):
    fname = fun_name(fun)

    @functools.wraps(fun)
    def vg(*args, **kwargs):
        args, kwargs = _tensors((args, kwargs))
        single, listed = _normalize_argnums(fname, api, argnums, len(args))
        nums, expand = _distinct(listed)
        partial = _partial(fun, fname, args, kwargs, nums)
        diff_args = [args[i] for i in nums]
        for i, a in zip(nums, diff_args):
            paths, leaves, _ = tree.flatten_with_path(a)
            _check_float(fname, api, leaves, [arg_path(fun, i, p) for p in paths],
                         "cast it to float32 (x.astype(mindspore.float32)), or leave it out "
                         "of argnums (only the arguments in argnums are differentiated).")
        res = _vjp(partial, tuple(diff_args), has_aux, api)
        out, vjp_fn = res[0], res[1]
        aux = res[2] if has_aux else None
        o = typeof(out) if not isinstance(out, (tuple, list, dict)) else None
        if o is None or o.shape != () or not dtypes.is_float(o.dtype):
            got = o if o is not None else type_tree(out)
            raise DifferentiationError(
                f"{api}({fname}) needs a function that returns a scalar float, but it returned "
                f"{got}.\nFix: reduce the output (e.g. .sum() or .mean()); for vector outputs "
                "use fs.vjp, fs.jacrev or fs.jacfwd; with an auxiliary output use has_aux=True.")
        from fshard.primitives.structural import ones

        grads = vjp_fn(ones((), o.dtype))
        grads = grads[0] if single else expand(grads)
        return ((out, aux), grads) if has_aux else (out, grads)

    return vg


def grad(fun, argnums=0, has_aux: bool = False):
    """The gradient of a scalar-valued function (see ``value_and_grad``).

    >>> import numpy as np, fshard as fs
    >>> fs.grad(lambda x: (x * x).sum())(np.array([1., 2.], np.float32)).asnumpy()
    array([2., 4.], dtype=float32)
    """
    from fshard.adapter.cells import maybe_cell

    check_function("fs.grad", fun)

    def make(f):
        vg = _value_and_grad(f, argnums, has_aux, "grad")

        @functools.wraps(f)
        def g(*args, **kwargs):
            out, grads = vg(*args, **kwargs)
            return (grads, out[1]) if has_aux else grads

        return g

    return maybe_cell(fun, make)


# ---------------------------------------------------------------------------
# Jacobians
# ---------------------------------------------------------------------------


def _bases(leaves) -> list:
    """One basis array per leaf, ``(n,) + leaf.shape`` with ``n`` the total size of all
    leaves: row ``r`` is the ``r``-th unit vector of the leaves' concatenation."""
    import numpy as np

    from fshard.backend.mindspore import as_tensor

    avals = [typeof(x) for x in leaves]
    n = sum(a.size for a in avals)
    out, offset = [], 0
    for a in avals:
        b = np.zeros((n, a.size), dtypes.to_numpy(a.dtype))
        b[offset:offset + a.size] = np.eye(a.size, dtype=b.dtype)
        offset += a.size
        out.append(as_tensor(b.reshape((n,) + tuple(a.shape))))
    return out


def _split_leading(x, sizes, axis):
    """Split ``x`` along ``axis`` into pieces of ``sizes``."""
    from fshard.primitives.structural import split

    return [x] if len(sizes) == 1 else list(split(x, list(sizes), axis))


def _jac_setup(fun, api, argnums, args):
    fname = fun_name(fun)
    single, listed = _normalize_argnums(fname, api, argnums, len(args))
    nums, expand = _distinct(listed)
    diff_args = tuple(args[i] for i in nums)
    for i in nums:
        paths, leaves, _ = tree.flatten_with_path(args[i])
        _check_float(fname, api, leaves, [arg_path(fun, i, p) for p in paths],
                     "cast it to float32, or leave it out of argnums.")
    return fname, single, nums, diff_args, expand


def jacfwd(fun, argnums=0, has_aux: bool = False):
    """Jacobian by forward mode (one JVP per input element, vectorised with vmap).

    >>> import numpy as np, fshard as fs
    >>> fs.jacfwd(lambda x: x ** 2)(np.array([1., 2.], np.float32)).asnumpy()
    array([[2., 0.],
           [0., 4.]], dtype=float32)

    Args:
        fun: a function of pytrees of float arrays.
        argnums: int or tuple of ints: which positional arguments to differentiate.
        has_aux: ``fun`` returns ``(output, aux)``; the Jacobian is of ``output``.

    Returns:
        The output's structure with, at each leaf ``o``, the structure of the chosen
        argument(s) with, at each leaf ``x``, an array of shape ``o.shape + x.shape``
        (a tuple over arguments if ``argnums`` is a tuple). With ``has_aux``,
        ``(jacobian, aux)``.

    See also: ``fs.jacrev`` (cheaper when outputs are fewer than inputs), ``fs.hessian``.
    """
    check_function("fs.jacfwd", fun)
    from fshard.primitives.structural import reshape
    from fshard.transforms.vmap import vmap

    @functools.wraps(fun)
    def jac(*args, **kwargs):
        args, kwargs = _tensors((args, kwargs))
        fname, single, nums, diff_args, expand = _jac_setup(fun, "jacfwd", argnums, args)
        partial = _partial(fun, fname, args, kwargs, nums)
        in_leaves, in_tree = tree.flatten(diff_args)
        in_avals = [typeof(x) for x in in_leaves]
        box = []

        def pushforward(*ts):
            tangents = tree.unflatten(in_tree, list(ts))
            res = jvp(partial, diff_args, tangents, has_aux=has_aux)
            box.append(res[0])
            return (res[1], res[2]) if has_aux else res[1]

        out_axes = (0, None) if has_aux else 0
        cols = vmap(pushforward, out_axes=out_axes)(*_bases(in_leaves))
        cols, aux = cols if has_aux else (cols, None)
        col_leaves, out_tree = tree.flatten(cols)
        per_out = []
        for c in col_leaves:  # (n_in,) + out.shape
            nd = typeof(c).ndim
            c = _move_to_end(c, nd)
            out_shape = tuple(typeof(c).shape[:-1])
            pieces = _split_leading(c, [a.size for a in in_avals], nd - 1)
            blocks = [reshape(p, out_shape + tuple(a.shape)) for p, a in zip(pieces, in_avals)]
            arg_tree = tree.unflatten(in_tree, blocks)
            per_out.append(arg_tree[0] if single else expand(arg_tree))
        result = tree.unflatten(out_tree, per_out)
        return (result, aux) if has_aux else result

    return jac


def _move_to_end(x, nd):
    from fshard.primitives.base import move_axis

    return move_axis(x, 0, nd - 1)


def jacrev(fun, argnums=0, has_aux: bool = False):
    """Jacobian by reverse mode (one VJP per output element, vectorised with vmap).

    >>> import numpy as np, fshard as fs
    >>> fs.jacrev(lambda x: x ** 2)(np.array([1., 2.], np.float32)).asnumpy()
    array([[2., 0.],
           [0., 4.]], dtype=float32)

    Args and Returns are those of ``fs.jacfwd``.

    See also: ``fs.jacfwd`` (cheaper when inputs are fewer than outputs), ``fs.hessian``.
    """
    check_function("fs.jacrev", fun)
    from fshard.primitives.structural import reshape
    from fshard.transforms.vmap import vmap

    @functools.wraps(fun)
    def jac(*args, **kwargs):
        args, kwargs = _tensors((args, kwargs))
        fname, single, nums, diff_args, expand = _jac_setup(fun, "jacrev", argnums, args)
        partial = _partial(fun, fname, args, kwargs, nums)
        res = _vjp(partial, diff_args, has_aux, "jacrev")
        out, vjp_fn = res[0], res[1]
        out_leaves, out_tree = tree.flatten(out)
        out_avals = [typeof(o) for o in out_leaves]
        rows = vmap(lambda *cts: vjp_fn(tree.unflatten(out_tree, list(cts))))(
            *_bases(out_leaves))
        row_leaves, in_tree = tree.flatten(tuple(rows))  # (n_out,) + in.shape each
        sizes = [a.size for a in out_avals]
        # blocks[k][j]: d out leaf k / d in leaf j
        blocks = [[None] * len(row_leaves) for _ in out_avals]
        for j, r in enumerate(row_leaves):
            in_shape = tuple(typeof(r).shape[1:])
            for k, (p, a) in enumerate(zip(_split_leading(r, sizes, 0), out_avals)):
                blocks[k][j] = reshape(p, tuple(a.shape) + in_shape)
        per_out = []
        for k in range(len(out_avals)):
            arg_tree = tree.unflatten(in_tree, blocks[k])
            per_out.append(arg_tree[0] if single else expand(arg_tree))
        result = tree.unflatten(out_tree, per_out)
        return (result, res[2]) if has_aux else result

    return jac


def hessian(fun, argnums=0, has_aux: bool = False):
    """Second derivative of a scalar function: ``jacfwd(jacrev(fun))``.

    >>> import numpy as np, fshard as fs
    >>> fs.hessian(lambda x: (x ** 3).sum())(np.array([1., 2.], np.float32)).asnumpy()
    array([[ 6.,  0.],
           [ 0., 12.]], dtype=float32)

    See also: ``fs.jacfwd``, ``fs.jacrev``.
    """
    check_function("fs.hessian", fun)
    return jacfwd(jacrev(fun, argnums, has_aux=has_aux), argnums, has_aux=has_aux)
