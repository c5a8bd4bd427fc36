"""``shard_call``: one sharded computation as one equation, and its rules.

``fs.shard`` binds ``shard_call`` with a ShardPlan: the *global* body Program, the
layouts at its boundary (None: left to propagation), the mesh and the objective.
Keeping the global body is what makes the derivative of a sharded function sharded
as well as the function itself (NB: JAX's pjit_p keeps its jaxpr the same way):

- JVP: the body's JVP is split (partial evaluation) into a *known* shard_call
  (primal outputs + residuals) and a *linear* shard_call (residuals + tangents),
  both with the layouts the primal call's propagation chose;
- transpose: the linear body is transposed as a global Program, then propagated and
  partitioned like any other, so ``grad(shard(f))`` pays the collectives the
  backward math needs (one AllReduce for a Megatron MLP), never a per-device
  transpose of the forward collectives;
- lowering: on a virtual mesh, the per-device Program batched over the devices
  becomes one helper function of the generated MindSpore module.
"""

from __future__ import annotations

from fshard.core import dtypes
from fshard.core.tracing import ArrayType, typeof
from fshard.core.interpret import batch_program, current_axis, eval_program
from fshard.core.ir import Equation, Literal, Program, Var
from fshard.primitives import collectives as C
from fshard.primitives import passes
from fshard.primitives.base import (Zero, batch_to_front, def_primitive, instantiate, is_undefined,
                                    move_axis)
from fshard.core.rules import batching, jvp, takes_process_local, transpose, unsupported
from fshard.sharding.layouts import Sharding
from fshard.sharding.local import ShardedArray
from fshard.sharding.runtime import run_virtual, world_mesh
from fshard.core.staging import stage
from fshard.transforms.ad import backward_pass, jvp_program, partial_eval, vjp


def _shard_call_type(*avals, plan, local_in=(), local_out=()):
    """The body's types; in a job, an operand in ``local_in`` (an output in
    ``local_out``) is this rank's block of it (see ``localize``)."""
    want = [v.aval for v in plan.body.inputs]
    outs = list(plan.body.out_avals)
    if local_in or local_out:
        part = plan.partitioned()
        want = [plan.local_type(a, part.in_shardings[i]) if i in local_in else a
                for i, a in enumerate(want)]
        outs = [plan.local_type(a, part.out_shardings[j]) if j in local_out else a
                for j, a in enumerate(outs)]
    assert [tuple(a.shape) for a in avals] == [tuple(a.shape) for a in want], \
        f"shard_call operands {avals} do not match its body"
    return outs


def _shard_call_impl(*args, plan, local_in=(), local_out=()):
    assert not (local_in or local_out), "a localized shard_call is only lowered"
    if plan.world is not None:
        if plan.local_outputs or any(isinstance(x, ShardedArray) for x in args):
            return _local_call(plan, args)
        from fshard.backend.mindspore import as_tensor

        out = _differentiable_call(plan)(*[as_tensor(x) for x in args])
        return [out] if len(plan.body.outputs) == 1 else list(out)
    return run_virtual(plan.partitioned(), list(args))


def _differentiable_call(plan):
    """The compiled per-device program of a multi-process job as an ``nn.Cell`` whose
    ``bprop`` is fshard's own derivative of the sharded function: MindSpore's autodiff
    (``mindspore.grad`` over a function calling an ``fs.shard`` function) must not
    differentiate the per-device graph itself, whose collectives' MindSpore gradients
    do not match their meaning here (wrong numbers, or ReduceScatter on CPU)."""
    cell = getattr(plan, "_ms_cell", None)
    if cell is None:
        from mindspore import nn, ops


        class ShardCall(nn.Cell):
            def construct(self, *args):
                return plan.compiled()(*args)

            def bprop(self, *args_out_dout):
                args, dout = args_out_dout[:-2], args_out_dout[-1]
                diff = [i for i, a in enumerate(args) if dtypes.is_float(typeof(a).dtype)]

                def f(*d):
                    full = list(args)
                    for i, x in zip(diff, d):
                        full[i] = x
                    return tuple(shard_call_p.bind(*full, plan=plan))

                _, vjp_fn = vjp(f, *[args[i] for i in diff])
                cts = tuple(dout) if isinstance(dout, (tuple, list)) else (dout,)
                grads = vjp_fn(cts)
                out = [ops.zeros_like(a) for a in args]
                for i, g in zip(diff, grads):
                    out[i] = g
                return tuple(out)

        cell = plan._ms_cell = ShardCall()
    return cell


def _shard_call_lowering(ctx, *exprs, plan, local_in=(), local_out=()):
    from fshard.backend.mindspore import Parameter, as_tensor

    program, consts = plan.virtual_program(frozenset(local_in), frozenset(local_out))
    # What reads only constants computed now, as fs.jit does for its own program (the
    # loss's cotangent seed broadcast to the batch, an optimizer's rate): the cost
    # model prices those equations at nothing (passes.lowered_away)
    program, consts = passes.fold_constants(program, consts,
                                            lambda c: not isinstance(c, Parameter))
    # MindSpore's arithmetic kernels broadcast: no full-size copy of a bias or a
    # hyperparameter per device block (as fs.jit lowers its own program).
    closed = passes.implicit_broadcasts(
        Program(program.inputs, program.equations, program.outputs))
    args = [ctx.ref(as_tensor(c), "const") for c in consts] + list(exprs)
    return f"{ctx.function(closed, 'shard')}({', '.join(args)})"


def _closed(program: Program) -> Program:
    return Program(program.inputs, program.equations, program.outputs)


def _shard_call_jvp(primals, tangents, *, plan):
    """Known shard_call (primal outputs + residuals), then linear shard_call."""
    body, part = plan.body, plan.partitioned()
    ins, outs = part.in_shardings, part.out_shardings
    nz = [i for i, t in enumerate(tangents) if not isinstance(t, Zero)]
    in_avals = [v.aval for v in body.inputs]
    n_in, n_out = len(in_avals), len(body.outputs)

    def jvp_flat(*xs):
        ts = [Zero(a) for a in in_avals]
        for i, t in zip(nz, xs[n_in:]):
            ts[i] = t
        o, to = jvp_program(body, list(xs[:n_in]), ts)
        return list(o) + [instantiate(t) for t in to]

    jprog, jconsts = stage(jvp_flat, in_avals + [in_avals[i] for i in nz])
    n_jc = len(jconsts)
    known, linear = partial_eval(jprog, [False] * (n_jc + n_in) + [True] * len(nz))
    primal_out = {}
    for j, a in enumerate(jprog.outputs[:n_out]):
        if isinstance(a, Var):
            primal_out.setdefault(a, outs[j])
    const_sh = [Sharding.replicated(v.aval.ndim) for v in jprog.inputs[:n_jc]]
    known_plan = plan.derive(_closed(known), const_sh + list(ins),
                             [primal_out.get(r) for r in known.outputs], "primal")
    res = shard_call_p.bind(*jconsts, *primals, plan=known_plan)
    value = dict(zip(known.outputs, res))
    primals_out = [a.value if isinstance(a, Literal) else value[a]
                   for a in jprog.outputs[:n_out]]
    res_sh = known_plan.partitioned().out_shardings
    lin = Program(linear.inputs, linear.equations, linear.outputs[n_out:])
    lin_plan = plan.derive(lin, list(res_sh) + [ins[i] for i in nz], list(outs), "tangent")
    tangents_out = shard_call_p.bind(*res, *[tangents[i] for i in nz], plan=lin_plan)
    return primals_out, list(tangents_out)


def _shard_call_transpose(cts, *args, plan):
    """Transpose the global body, then shard it like any Program."""
    body, part = plan.body, plan.partitioned()
    ins, outs = part.in_shardings, part.out_shardings
    lin = [i for i, a in enumerate(args) if is_undefined(a)]
    res = [i for i, a in enumerate(args) if not is_undefined(a)]
    nzc = [j for j, c in enumerate(cts) if not isinstance(c, Zero)]
    if not nzc:
        return [Zero(args[i].aval) if i in lin else None for i in range(len(args))]
    reordered = Program([body.inputs[i] for i in res] + [body.inputs[i] for i in lin],
                        body.equations, body.outputs)
    known, linear = partial_eval(reordered, [False] * len(res) + [True] * len(lin))

    def transposed(*xs):
        residuals = eval_program(known, *xs[:len(res)])
        cs = [Zero(a.aval) for a in body.outputs]
        for j, c in zip(nzc, xs[len(res):]):
            cs[j] = c
        cts_in = backward_pass(linear, len(known.outputs), residuals, cs)
        return [instantiate(c) for c in cts_in]

    t_prog, t_consts = stage(transposed, [body.inputs[i].aval for i in res]
                             + [body.outputs[j].aval for j in nzc])
    t_plan = plan.derive(
        _closed(t_prog),
        [Sharding.replicated(v.aval.ndim) for v in t_prog.inputs[:len(t_consts)]]
        + [ins[i] for i in res] + [outs[j] for j in nzc],
        [ins[i] for i in lin], "transpose")
    cts_in = shard_call_p.bind(*t_consts, *[args[i] for i in res],
                               *[cts[j] for j in nzc], plan=t_plan)
    it = iter(cts_in)
    return [next(it) if i in lin else None for i in range(len(args))]


def _shard_call_batching(args, dims, *, plan):
    """A batched shard_call shards the batched body; the batch dimension is replicated
    (this serves ``jacrev``/``hessian`` of a sharded function; ``vmap(shard(f))`` itself
    is refused before it gets here, see ``Sharded.__call__``)."""
    axis = current_axis()
    args = [x if d is None else move_axis(x, d, 0) for x, d in zip(args, dims)]
    dims = [None if d is None else 0 for d in dims]
    body = plan.body
    in_avals = [v.aval if d is None else ArrayType((axis.size,) + tuple(v.aval.shape),
                                                   v.aval.dtype)
                for v, d in zip(body.inputs, dims)]

    def batched(*xs):
        o, od = batch_program(body, list(xs), list(dims), axis)
        return [batch_to_front(y, d, axis.size) for y, d in zip(o, od)]

    b_prog, b_consts = stage(batched, in_avals)

    def lift(sh):
        return None if sh is None else Sharding(((),) + tuple(sh.dims), sh.partial)

    b_plan = plan.derive(
        _closed(b_prog),
        [Sharding.replicated(v.aval.ndim) for v in b_prog.inputs[:len(b_consts)]]
        + [sh if d is None else lift(sh) for sh, d in zip(plan.in_shardings, dims)],
        [lift(sh) for sh in plan.out_shardings], "batched")
    outs = shard_call_p.bind(*b_consts, *args, plan=b_plan)
    return list(outs), [0] * len(outs)


# ---------------------------------------------------------------------------
# Process-local values (fs.ShardedArray) in a multi-process job
# ---------------------------------------------------------------------------


def localize(program: Program, local_inputs: dict) -> tuple[Program, list]:
    """``program`` (global types, as traced) rewritten for a job where the inputs in
    ``local_inputs`` (input position -> ``(Sharding, ShardMesh)``) are this process's
    blocks (``fs.ShardedArray``s), and where every ``shard_call`` whose plan has
    ``local_outputs`` returns its split outputs as blocks. Returns the program, whose
    inputs and outputs of those values have block types, and per output its
    ``(Sharding, ShardMesh)`` if it is a block (None if global).

    A block goes straight into a ``shard_call`` whose plan lays that operand out the
    same way (no cut, no communication). Anywhere else the global value is needed:
    an AllGather (``shard_out``) assembles it once, and a ``shard_call`` that wants
    another layout then cuts its own block from it; gathering then cutting moves more
    bytes than a direct redistribution would, but it is correct for any pair of
    layouts and happens only when layouts disagree."""
    if not local_inputs and not any(
            eq.prim is shard_call_p and eq.params["plan"].world is not None
            and eq.params["plan"].local_outputs for eq in program.equations):
        return program, [None] * len(program.outputs)
    info: dict = {}       # block Var -> (Sharding, ShardMesh)
    env: dict = {}        # Var of the traced program -> Var of the new one
    whole: dict = {}      # block Var -> its gathered global Var
    equations: list = []

    def new_block(aval, sharding, mesh):
        v = Var(ArrayType(sharding.local_shape(aval.shape, mesh), aval.dtype))
        info[v] = (sharding, mesh)
        return v

    inputs = []
    for k, v in enumerate(program.inputs):
        if k in local_inputs:
            sharding, mesh = local_inputs[k]
            env[v] = new_block(v.aval, sharding, mesh)
        else:
            env[v] = Var(v.aval)
        inputs.append(env[v])

    def get(a):
        return env.get(a, a) if isinstance(a, Var) else a

    def global_of(a, aval):
        """The global value of atom ``a`` (gathered once if it is a block)."""
        a = get(a)
        if not isinstance(a, Var) or a not in info:
            return a
        g = whole.get(a)
        if g is None:
            sharding, mesh = info[a]
            g = whole[a] = Var(aval)
            equations.append(Equation(C.shard_out_p, [a], {
                "dims": tuple(mesh.name(ax) for ax in sharding.dims),
                "mesh": world_mesh(mesh)}, [g]))
        return g

    for eq in program.equations:
        plan = eq.params.get("plan") if eq.prim is shard_call_p else None
        if plan is None or plan.world is None:
            ins = [global_of(a, a.aval) for a in eq.inputs]
            outs = [Var(o.aval) for o in eq.outputs]
            equations.append(Equation(eq.prim, ins, eq.params, outs, eq.source))
            env.update(zip(eq.outputs, outs))
            continue
        part = plan.partitioned()
        pmesh = part.prop.mesh
        ins, local_in = [], []
        for i, (a, sh) in enumerate(zip(eq.inputs, part.in_shardings)):
            b = get(a)
            if isinstance(b, Var) and b in info and info[b] == (Sharding(sh.dims), pmesh) \
                    and not sh.partial:
                ins.append(b)
                local_in.append(i)
            else:
                ins.append(global_of(a, a.aval))
        local_out = [j for j, sh in enumerate(part.out_shardings)
                     if plan.local_outputs and not sh.partial and any(sh.dims)]
        outs = [new_block(o.aval, Sharding(part.out_shardings[j].dims), pmesh)
                if j in local_out else Var(o.aval) for j, o in enumerate(eq.outputs)]
        params = dict(eq.params, local_in=tuple(local_in), local_out=tuple(local_out))
        equations.append(Equation(eq.prim, ins, params, outs, eq.source))
        env.update(zip(eq.outputs, outs))
    outputs = [get(a) for a in program.outputs]
    out_info = [info.get(a) if isinstance(a, Var) else None for a in outputs]
    return Program(inputs, equations, outputs, program.n_consts, dict(program.meta)), out_info


def wrap_outputs(outs, out_info, out_avals) -> list:
    """Compiled outputs as values: a block output becomes an ``fs.ShardedArray``."""
    from fshard.meshes import distributed

    rank = distributed.rank()
    return [y if i is None else ShardedArray(y, a.shape, a.dtype, i[0], i[1], rank)
            for y, i, a in zip(outs, out_info, out_avals)]


def block_of(x):
    """What a compiled program takes for argument ``x``: its block if it is an
    ``fs.ShardedArray``."""
    return x.block if isinstance(x, ShardedArray) else x


def local_signature(leaves) -> dict:
    """Position -> ``(Sharding, ShardMesh)`` of each ``fs.ShardedArray`` in ``leaves``."""
    return {k: (x.sharding, x.mesh) for k, x in enumerate(leaves)
            if isinstance(x, ShardedArray)}


def _local_call(plan, args):
    """An eager ``shard_call`` in a job with blocks in or out: the one-equation program,
    localized and compiled (once per layout of the arguments)."""
    from fshard.backend import mindspore as backend

    sig = local_signature(args)
    key = tuple(sorted(sig.items(), key=lambda kv: kv[0]))
    calls = plan._local_calls
    hit = calls.get(key)
    if hit is None:
        avals = [typeof(x) for x in args]
        program, consts = stage(lambda *xs: list(shard_call_p.bind(*xs, plan=plan)), avals)
        program, out_info = localize(program, {program.n_consts + k: v
                                               for k, v in sig.items()})
        src, globals_, n_out = backend.lower_program(program, consts, f"shard_{plan.name}")
        fn = backend.compile_source(src, globals_, f"shard_{plan.name}")
        hit = calls[key] = (fn, out_info, list(plan.body.out_avals), n_out)
    fn, out_info, out_avals, n_out = hit
    out = fn(*[backend.as_tensor(block_of(x)) for x in args])
    out = [out] if n_out == 1 else list(out)
    return wrap_outputs(out, out_info, out_avals)


shard_call_p = def_primitive("shard_call", "spmd", _shard_call_type, multiple_results=True,
                             eager=_shard_call_impl, lower=_shard_call_lowering)
jvp.set(shard_call_p, _shard_call_jvp)
transpose.set(shard_call_p, _shard_call_transpose)
batching.set(shard_call_p, _shard_call_batching)
unsupported(shard_call_p, "sharding", "fs.shard cannot nest: a shard_call is never re-sharded")
takes_process_local.add(shard_call_p)  # it takes this process's blocks (fs.ShardedArray)
