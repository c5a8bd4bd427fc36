"""IR cleanup passes: named ``Program -> Program`` rewrites that ``jit`` applies before
lowering (NB: tinygrad's named ``graph_rewrite`` passes).

Transforms emit locally sensible IR that is globally redundant: ``vmap`` of a
per-example ``matmul`` reshapes ``(B, 1, k) -> (B, k)`` right after a reshape the
other way, batching rules broadcast operands that were already broadcast, and the
transpose of a ``mean`` re-broadcasts the same cotangent in several places. These
passes remove that, without changing any value (but the order of an AllReduce's
additions on a virtual mesh):

- ``fold_structural``: reshape/broadcast/transpose chains collapse into one
  operation; reshapes, broadcasts, transposes and casts that change nothing vanish.
- ``fold_view_chains``: reshapes and transposes in turn collapse into at most one
  transpose between two reshapes.
- ``cse``: an equation equal to an earlier one (same primitive, operands and
  parameters) reuses its outputs.
- ``sink_neg``: a negation moves past a sum or into a subtraction (exact).
- ``merge_lane_sums``: the lane sums of one psum over several axes of a virtual mesh
  become one sum (the order of the devices' additions is the collective's own).
- ``dce``: equations whose outputs nothing reads are dropped.

``simplify`` runs them to a fixed point. Every pass is observable: with
``FSHARD_DUMP_IR=1`` each pass that changes the Program prints it before and after.
The passes never remove or reorder a Program's inputs, so a lowered function keeps
its signature. This module imports primitives, never transforms.
"""

from __future__ import annotations

import functools
import heapq
import os
import sys
from typing import Callable

import numpy as np

from fshard.core import dtypes
from fshard.core.tracing import ArrayType, EvalTrace, current_trace
from fshard.core.interpret import bind_equation
from fshard.core.ir import Equation, Literal, Program, Var
from fshard.core.rules import family_of
from fshard.primitives.base import add_p, is_kernel, lane_sum_p, reduce_sum_p
from fshard.primitives.collectives import all_gather_p, pmean_p, psum_p, psum_scatter_p
from fshard.primitives.elementwise import (cast_p, div_p, equal_p, floor_div_p,
                                           greater_equal_p, greater_p, less_equal_p, less_p,
                                           maximum_p, minimum_p, mul_p, neg_p, not_equal_p,
                                           pow_p, sub_p)
from fshard.primitives.optimizers import adam_update_p
from fshard.primitives.spmd import block_slice_p
from fshard.primitives.structural import (broadcast_to_p, concat_p, reshape_p, split_p,
                                          transpose_p)

PassFn = Callable[[Program], Program]


def _dump(name: str, before: Program, after: Program) -> None:
    if os.environ.get("FSHARD_DUMP_IR"):
        print(f"--- before {name} ---\n{before}\n--- after {name} ---\n{after}",
              file=sys.stderr)


def _rebuild(program: Program, equations: list, alias: dict) -> Program:
    """``program`` with new equations and outputs read through ``alias``."""
    outputs = [alias.get(a, a) if isinstance(a, Var) else a for a in program.outputs]
    return Program(program.inputs, equations, outputs, program.n_consts, program.meta)


# ---------------------------------------------------------------------------
# fold_structural: peephole rules on shape operations
# ---------------------------------------------------------------------------


def _identity(eq: Equation) -> bool:
    """The equation returns its operand unchanged."""
    (x,) = eq.inputs
    if eq.prim in (reshape_p, broadcast_to_p):
        return tuple(x.aval.shape) == tuple(eq.outputs[0].aval.shape)
    if eq.prim is transpose_p:
        return tuple(eq.params["perm"]) == tuple(range(len(eq.params["perm"])))
    if eq.prim is cast_p:
        return x.aval.dtype == eq.params["dtype"]
    return False


def _fold(eq: Equation, producer: dict) -> Equation:
    """Collapse ``eq`` with the shape operation that produced its operand, if any."""
    (x,) = eq.inputs
    src = producer.get(x) if isinstance(x, Var) else None
    if src is None or src.prim is not eq.prim:
        return eq
    (y,) = src.inputs
    if eq.prim is reshape_p or eq.prim is broadcast_to_p:
        # reshape(reshape(y)) == reshape(y); broadcasting is transitive too
        return Equation(eq.prim, [y], eq.params, eq.outputs, eq.source)
    if eq.prim is transpose_p:
        inner, outer = src.params["perm"], eq.params["perm"]
        perm = tuple(inner[p] for p in outer)
        return Equation(eq.prim, [y], {"perm": perm}, eq.outputs, eq.source)
    return eq


_STRUCTURAL = (reshape_p, broadcast_to_p, transpose_p, cast_p)


def fold_structural(program: Program) -> Program:
    """Collapse chains of reshape / broadcast_to / transpose and drop identities."""
    alias: dict = {}
    producer: dict = {}
    out = []
    for eq in program.equations:
        ins = [alias.get(a, a) if isinstance(a, Var) else a for a in eq.inputs]
        eq = Equation(eq.prim, ins, eq.params, eq.outputs, eq.source)
        if eq.prim in _STRUCTURAL and isinstance(ins[0], Var):
            eq = _fold(eq, producer)
            if _identity(eq):
                alias[eq.outputs[0]] = eq.inputs[0]
                continue
        out.append(eq)
        for v in eq.outputs:
            producer[v] = eq
    return _rebuild(program, out, alias)


# ---------------------------------------------------------------------------
# fold_view_chains: reshapes and transposes in turn become one transpose
# ---------------------------------------------------------------------------

#: The most dimensions a folded transpose may have (MindSpore's Transpose takes 8).
_MAX_VIEW_RANK = 8


def compose_views(shape: tuple, ops: list) -> tuple | None:
    """What a chain of ``("reshape", shape)`` / ``("transpose", perm)`` does to an array
    of ``shape``, as at most one transpose between two reshapes: ``(view, perm, out)``,
    ``view`` the input's shape split into the pieces the chain moves, ``perm`` their
    new order and ``out`` the result's shape; None when a reshape mixes pieces that
    no such split separates (then the chain stays as it is).

    Each input dimension is cut into "atoms" (its row-major factors) as finely as a
    reshape along the chain needs; a transpose reorders dimensions, each a run of
    atoms; the atoms' order at the end against their order in the input is the perm.

    >>> compose_views((4, 6), [("reshape", (2, 2, 6)), ("transpose", (1, 0, 2)),
    ...                        ("reshape", (2, 12))])
    ((2, 2, 6), (1, 0, 2), (2, 12))
    """
    if 0 in shape:
        return None
    sizes, order, dims = {}, [], []
    for n in shape:
        if n != 1:
            sizes[len(sizes)] = n
            order.append(len(sizes) - 1)
        dims.append([len(sizes) - 1] if n != 1 else [])
    fresh = [len(sizes)]

    def split(a: int, hi: int) -> tuple[int, int]:
        h, lo = fresh[0], fresh[0] + 1
        fresh[0] += 2
        sizes[h], sizes[lo] = hi, sizes.pop(a) // hi
        i = order.index(a)
        order[i:i + 1] = [h, lo]
        for d in dims:
            if a in d:
                j = d.index(a)
                d[j:j + 1] = [h, lo]
        return h, lo

    for kind, arg in ops:
        if kind == "transpose":
            dims = [dims[p] for p in arg]
            continue
        flat = [a for d in dims for a in d]
        new, k = [], 0
        for t in arg:
            cur, acc = [], 1
            while acc < t:
                if k >= len(flat):
                    return None
                a = flat[k]
                if acc * sizes[a] <= t:
                    if t % (acc * sizes[a]):
                        return None
                    cur.append(a)
                    acc *= sizes[a]
                    k += 1
                elif t % acc == 0 and sizes[a] % (t // acc) == 0:
                    h, lo = split(a, t // acc)
                    flat[k] = lo
                    cur.append(h)
                    acc = t
                else:
                    return None
            new.append(cur)
        if k != len(flat):
            return None
        dims = new
    final = [a for d in dims for a in d]
    # Merge atoms that stay neighbours in the same order: the fewest dimensions.
    groups = []
    for a in final:
        if groups and order.index(a) == order.index(groups[-1][-1]) + 1:
            groups[-1].append(a)
        else:
            groups.append([a])
    by_input = sorted(groups, key=lambda g: order.index(g[0]))
    view = tuple(int(np.prod([sizes[a] for a in g])) for g in by_input)
    perm = tuple(by_input.index(g) for g in groups)
    out = tuple(int(np.prod([sizes[a] for a in d])) if d else 1 for d in dims)
    return view, perm, out


def _view_op(eq: Equation) -> tuple | None:
    if eq.prim is reshape_p:
        return ("reshape", tuple(eq.params["shape"]))
    if eq.prim is transpose_p:
        return ("transpose", tuple(eq.params["perm"]))
    return None


def _views(x: Var, ops: list, out: Var, source) -> list | None:
    """The equations of ``compose_views`` from ``x`` to ``out`` (None: not foldable)."""
    folded = compose_views(tuple(x.aval.shape), ops)
    if folded is None:
        return None
    view, perm, shape = folded
    if len(view) > _MAX_VIEW_RANK:
        return None
    eqs, cur = [], x
    if perm != tuple(range(len(perm))):
        if view != tuple(x.aval.shape):
            v = Var(ArrayType(view, x.aval.dtype))
            eqs.append(Equation(reshape_p, [cur], {"shape": view}, [v], source))
            cur = v
        moved = tuple(view[p] for p in perm)
        v = Var(ArrayType(moved, x.aval.dtype))
        eqs.append(Equation(transpose_p, [cur], {"perm": perm}, [v], source))
        cur = v
    if tuple(cur.aval.shape) != shape or not eqs:
        eqs.append(Equation(reshape_p, [cur], {"shape": shape}, [out], source))
    else:
        eqs[-1] = Equation(eqs[-1].prim, eqs[-1].inputs, eqs[-1].params, [out], source)
    return eqs


def fold_view_chains(program: Program) -> Program:
    """A chain of reshapes and transposes (each link read by the next alone) becomes at
    most one transpose between two reshapes, when that has fewer transposes or fewer
    equations: a virtual mesh's batching moves device axes back and forth this way,
    each move a copy of the whole value."""
    uses = _uses(program)
    chains: dict = {}   # output of a view equation -> (chain's input, its ops, transposes)
    out = []
    for eq in program.equations:
        op = _view_op(eq)
        x = eq.inputs[0] if op is not None else None
        if op is None or not isinstance(x, Var) or not _static(x.aval.shape) \
                or not _static(eq.outputs[0].aval.shape) \
                or (op[0] == "reshape" and not _static(op[1])):
            out.append(eq)
            continue
        src, ops, moves = x, [], 0
        if x in chains and uses.get(x, 0) == 1:
            src, ops, moves = chains[x]
        ops = ops + [op]
        moves += op[0] == "transpose"
        chains[eq.outputs[0]] = (src, ops, moves)
        folded = _views(src, ops, eq.outputs[0], eq.source) if len(ops) > 1 else None
        if folded is not None and (
                sum(e.prim is transpose_p for e in folded), len(folded)) < (moves, len(ops)):
            out.extend(folded)
        else:
            out.append(eq)
    return Program(program.inputs, out, program.outputs, program.n_consts, program.meta)


# ---------------------------------------------------------------------------
# cse: common subexpressions
# ---------------------------------------------------------------------------


def _key(v):
    """A hashable stand-in for a parameter value (identity for objects like Programs)."""
    if isinstance(v, (list, tuple)):
        return tuple(_key(e) for e in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _key(e)) for k, e in v.items()))
    if isinstance(v, (Program, np.ndarray)):
        return ("id", id(v))
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return v


def _atom_key(a):
    if isinstance(a, Literal):
        return ("lit", a.value.item() if hasattr(a.value, "item") else a.value, str(a.aval))
    return ("var", id(a))


_COMMUTATIVE = (add_p, mul_p, maximum_p, minimum_p, equal_p, not_equal_p)


def cse(program: Program) -> Program:
    """Reuse the outputs of an earlier identical equation."""
    alias: dict = {}
    seen: dict = {}
    out = []
    for eq in program.equations:
        ins = [alias.get(a, a) if isinstance(a, Var) else a for a in eq.inputs]
        eq = Equation(eq.prim, ins, eq.params, eq.outputs, eq.source)
        atoms = tuple(_atom_key(a) for a in ins)
        if eq.prim in _COMMUTATIVE:  # x * y and y * x: the same, bit for bit
            atoms = tuple(sorted(atoms, key=repr))
        key = (eq.prim, atoms, _key(eq.params))
        prev = None if eq.prim.effect else seen.get(key)  # two prints print twice
        if prev is not None:
            alias.update(zip(eq.outputs, prev.outputs))
            continue
        seen[key] = eq
        out.append(eq)
    return _rebuild(program, out, alias)


# ---------------------------------------------------------------------------
# sink_neg: a negation read once moves to the smaller side, or into a subtraction
# ---------------------------------------------------------------------------


def _uses(program: Program) -> dict:
    n: dict = {}
    for eq in program.equations:
        for a in eq.inputs:
            if isinstance(a, Var):
                n[a] = n.get(a, 0) + 1
    for a in program.outputs:
        if isinstance(a, Var):
            n[a] = n.get(a, 0) + 2  # an output is always read
    return n


def sink_neg(program: Program) -> Program:
    """``reduce_sum(neg(x))`` becomes ``neg(reduce_sum(x))`` and ``add(a, neg(b))``
    becomes ``sub(a, b)`` when nothing else reads the ``neg``: one full-size kernel
    less each (reverse mode makes many: the transposes of ``sub``, of a mean's
    centring, of an optimizer's ``p - lr * u``). Exact: negation changes no bit but
    the sign, and ``a - b`` is ``a + (-b)`` in IEEE arithmetic."""
    uses = _uses(program)
    negs = {eq.outputs[0]: eq for eq in program.equations
            if eq.prim is neg_p and uses.get(eq.outputs[0]) == 1}
    if not negs:
        return program
    out, done = [], set()
    for eq in program.equations:
        if eq.prim in (reduce_sum_p, lane_sum_p) and eq.inputs[0] in negs:
            (x,) = negs[eq.inputs[0]].inputs
            mid = Var(eq.outputs[0].aval)
            out.append(Equation(eq.prim, [x], eq.params, [mid], eq.source))
            out.append(Equation(neg_p, [mid], {}, eq.outputs, eq.source))
            done.add(eq.inputs[0])
            continue
        if eq.prim is add_p and any(a in negs for a in eq.inputs):
            a, b = eq.inputs
            if a in negs and b not in negs:
                a, b = b, a
            if b in negs:
                out.append(Equation(sub_p, [a, negs[b].inputs[0]], {}, eq.outputs, eq.source))
                done.add(b)
                continue
        out.append(eq)
    if not done:
        return program
    out = [eq for eq in out if not (eq.prim is neg_p and eq.outputs[0] in done)]
    return Program(program.inputs, out, program.outputs, program.n_consts, program.meta)


# ---------------------------------------------------------------------------
# merge_lane_sums: a psum over several mesh axes of a virtual mesh is one sum
# ---------------------------------------------------------------------------


def merge_lane_sums(program: Program) -> Program:
    """``lane_sum(lane_sum(x, A), B)`` becomes one ``lane_sum`` of ``x`` over both
    sets of lanes when nothing else reads the inner sum. A virtual mesh runs a psum
    over several mesh axes as one lane sum per axis (each batching interpreter sums
    its own lanes); one sum over all of them is one kernel instead of several, and
    the fastest on MindSpore's CPU backend (see ``_ms_lane_sum``). Only lane sums
    merge: a device's own ``reduce_sum`` (a bias gradient's row sum) stays apart, so
    a value is summed over the devices the same way whether or not the AllReduces are
    fused into buckets. The additions' order changes (as an AllReduce's order is the
    collective's own), not the value summed."""
    uses = _uses(program)
    producer: dict = {}
    out, merged = [], False
    for eq in program.equations:
        src = producer.get(eq.inputs[0]) if eq.prim is lane_sum_p else None
        if src is not None and uses.get(eq.inputs[0]) == 1:
            (x,) = src.inputs
            inner = set(src.params["axes"])
            kept = [i for i in range(x.aval.ndim) if i not in inner]
            axes = tuple(sorted(inner | {kept[b] for b in eq.params["axes"]}))
            eq = Equation(lane_sum_p, [x], {"axes": axes}, eq.outputs, eq.source)
            merged = True
        out.append(eq)
        if eq.prim is lane_sum_p:
            producer[eq.outputs[0]] = eq
    if not merged:
        return program
    return dce(Program(program.inputs, out, program.outputs, program.n_consts, program.meta))


# ---------------------------------------------------------------------------
# slice_broadcasts: for per-device programs
# ---------------------------------------------------------------------------


def slice_broadcasts(program: Program) -> Program:
    """A device's block of a broadcast along the split dimension is the broadcast at
    the block's shape: ``block_slice(broadcast_to(x))`` becomes ``broadcast_to(x)``
    (an optimizer's scalar hyperparameters broadcast to a parameter's shape, then
    split by ZeRO, are otherwise sliced per device: on a virtual mesh each slice is a
    gather). The broadcast it read is left to ``dce``."""
    producer: dict = {}
    out = []
    for eq in program.equations:
        src = producer.get(eq.inputs[0]) if eq.prim is block_slice_p else None
        if src is not None and src.prim is broadcast_to_p:
            (x,) = src.inputs
            shape = tuple(eq.outputs[0].aval.shape)
            d = eq.params["dim"] - (len(shape) - len(x.aval.shape))  # x's dim, if any
            if d < 0 or x.aval.shape[d] == 1:
                eq = Equation(broadcast_to_p, [x], {"shape": shape}, eq.outputs, eq.source)
        out.append(eq)
        for v in eq.outputs:
            producer[v] = eq
    return dce(Program(program.inputs, out, program.outputs, program.n_consts, program.meta))


# ---------------------------------------------------------------------------
# dce: dead equations
# ---------------------------------------------------------------------------


def dce(program: Program) -> Program:
    """Drop equations none of whose outputs is read, except those with an effect: a
    primitive's (``Primitive.effect``: a debug callback, which has no outputs), or a
    generic MindSpore op that writes into an operand (``Assign``, which writes
    BatchNorm's moving statistics: ``params["fn"].has_effect``)."""
    live = {a for a in program.outputs if isinstance(a, Var)}
    kept = []
    for eq in reversed(program.equations):
        if eq.prim.effect or any(v in live for v in eq.outputs) \
                or getattr(eq.params.get("fn"), "has_effect", False):
            kept.append(eq)
            live.update(a for a in eq.inputs if isinstance(a, Var))
    kept.reverse()
    return Program(program.inputs, kept, program.outputs, program.n_consts, program.meta)


# ---------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------

PASSES: list[tuple[str, PassFn]] = [
    ("fold_structural", fold_structural),
    ("fold_view_chains", fold_view_chains),
    ("cse", cse),
    ("sink_neg", sink_neg),
    ("merge_lane_sums", merge_lane_sums),
    ("dce", dce),
]


def run_pass(name: str, fn: PassFn, program: Program) -> Program:
    """Apply one named pass (dumping the IR around it with ``FSHARD_DUMP_IR=1``)."""
    after = fn(program)
    if len(after.equations) != len(program.equations) or any(
            a is not b for a, b in zip(after.equations, program.equations)):
        _dump(name, program, after)
    return after


def simplify(program: Program, max_rounds: int = 4) -> Program:
    """Run every pass until the Program stops shrinking.

    >>> import numpy as np, fshard as fs
    >>> w = np.ones((4, 2), np.float32)
    >>> ir = fs.make_ir(fs.vmap(lambda x: fs.ops.matmul(x, w)))(np.ones((8, 4), np.float32))
    >>> print(simplify(ir.program))   # vmap's reshapes (8,4)->(8,1,4)->(8,4) cancel out
    { lambda b:f32[4,2]; a:f32[8,4] .
        c:f32[8,2] = matmul[transpose_a=False transpose_b=False] a b
      in (c) }
    >>> len(ir.program.equations)
    5
    """
    for _ in range(max_rounds):
        n = len(program.equations)
        for name, fn in PASSES:
            program = run_pass(name, fn, program)
        if len(program.equations) == n:
            break
    return program


# ---------------------------------------------------------------------------
# fold_constants: for lowering only
# ---------------------------------------------------------------------------

#: The most elements an output folded into a constant may have, unless a constant it
#: is computed from is as large (folding never multiplies a program's constant memory).
FOLD_ELEMENTS = 1 << 16


def _foldable(eq: Equation) -> bool:
    # one MindSpore function of the operands alone: not a collective, a sharded or a
    # pipelined call (a psum of constants still sums over the devices)
    if not is_kernel(eq.prim) or family_of(eq.prim) in ("collectives", "spmd", "pipeline"):
        return False
    if eq.prim.effect or getattr(eq.params.get("fn"), "has_effect", False):
        return False
    for v in eq.params.values():  # a loop, a cond, a shard call: left to the compiler
        if isinstance(v, Program) or (isinstance(v, tuple) and any(
                isinstance(b, Program) for b in v)):
            return False
    return all(_static(v.aval.shape) for v in eq.outputs)


def _elements(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def fold_constants(program: Program, consts: list, frozen=lambda c: True
                   ) -> tuple[Program, list]:
    """``(program, consts)`` with every equation that reads only constants (and
    literals) computed now, its outputs new constants: MindSpore's graph compiler can
    take unbounded time and memory folding some constant chains itself (the gradient
    of a linear ``ops.interpolate`` times a constant does not depend on the input: its
    chain of constants ending in an UnsortedSegmentSum never finished compiling). Only
    constants ``frozen(value)`` accepts are read (not a MindSpore Parameter, which
    changes between calls); an equation whose output would be larger than
    ``FOLD_ELEMENTS`` and than every constant it reads stays, as does one that fails
    to run eagerly (its error is the compiled program's to raise). The new constants
    go after the old ones; the other inputs keep their order.

    >>> import numpy as np, fshard as fs
    >>> c = np.arange(3, dtype=np.float32)
    >>> ir = fs.make_ir(lambda x: x + fs.ops.exp(c) * 2)(np.ones(3, np.float32))
    >>> program, consts = fold_constants(ir.program, list(ir.consts))
    >>> print(program)
    { lambda b:f32[3] c:f32[3]; a:f32[3] .
        d:f32[3] = add a c
      in (d) }
    """
    if type(current_trace()) is not EvalTrace:  # bind would stage, not compute
        return program, consts
    n = program.n_consts
    known = {v: c for v, c in zip(program.inputs[:n], consts) if frozen(c)}
    folded_vars, folded_values, kept = [], [], []
    for eq in program.equations:
        ins = [a for a in eq.inputs if not isinstance(a, Literal)]
        if all(a in known for a in ins) and _foldable(eq):
            limit = max([FOLD_ELEMENTS] + [_elements(a.aval) for a in ins])
            if all(_elements(v.aval) <= limit for v in eq.outputs):
                try:
                    outs = bind_equation(eq, [a.value if isinstance(a, Literal) else known[a]
                                              for a in eq.inputs])
                except Exception:  # noqa: BLE001 - left for the compiled program to raise
                    outs = None
                if outs is not None:
                    known.update(zip(eq.outputs, outs))
                    folded_vars.extend(eq.outputs)
                    folded_values.extend(outs)
                    continue
        kept.append(eq)
    if not folded_vars:
        return program, consts
    # (of a folded chain, only the values something left reads)
    read = {a for eq in kept for a in eq.inputs} | set(program.outputs)
    new = [(v, c) for v, c in zip(folded_vars, folded_values) if v in read]
    inputs = list(program.inputs[:n]) + [v for v, _ in new] + list(program.inputs[n:])
    return (Program(inputs, kept, program.outputs, n + len(new), program.meta),
            list(consts) + [c for _, c in new])


# ---------------------------------------------------------------------------
# implicit_broadcasts: for lowering only
# ---------------------------------------------------------------------------

# Binary primitives whose MindSpore kernels broadcast their operands as NumPy does
# (the comparisons too: relu's derivative compares with a broadcast 0).
_BROADCASTING = (add_p, sub_p, mul_p, div_p, pow_p, maximum_p, minimum_p, equal_p, not_equal_p,
                 less_p, less_equal_p, greater_p, greater_equal_p)


def _static(shape) -> bool:
    return all(type(d) is int for d in shape)


def implicit_broadcasts(program: Program) -> Program:
    """``program`` with the ``broadcast_to`` operands of arithmetic equations replaced
    by what they broadcast, where MindSpore's kernel broadcasts it to the same result
    (``mul(x, broadcast_to(0.9, x.shape))`` becomes ``mul(x, 0.9)``), and the broadcasts
    nothing else reads dropped.

    fshard's primitives take operands of one shape, so tracing materialises every
    broadcast (an optimizer's ``m * b1``, a normalisation's ``x * scale`` per channel);
    lowered one to one, each is a kernel writing a full-size tensor that the next
    kernel reads back. The result is NOT a valid fshard Program (its operands' shapes
    differ): it is only for ``backend.lower_program``, after every other pass.
    """
    producer = {v: eq for eq in program.equations if eq.prim is broadcast_to_p
                for v in eq.outputs}
    out = []
    for eq in program.equations:
        if eq.prim in _BROADCASTING and producer and _static(eq.outputs[0].aval.shape):
            want = tuple(eq.outputs[0].aval.shape)
            ins = list(eq.inputs)
            for i, a in enumerate(ins):
                src = producer.get(a) if isinstance(a, Var) else None
                if src is None or not _static(src.inputs[0].aval.shape):
                    continue
                trial = ins[:i] + [src.inputs[0]] + ins[i + 1:]
                if np.broadcast_shapes(*(tuple(t.aval.shape) for t in trial)) == want:
                    ins = trial
            if ins != list(eq.inputs):
                eq = Equation(eq.prim, ins, eq.params, eq.outputs, eq.source)
        out.append(eq)
    if len(out) == len(program.equations) and all(
            a is b for a, b in zip(out, program.equations)):
        return program
    return dce(Program(program.inputs, out, program.outputs, program.n_consts, program.meta))


def lowered_away(program: Program) -> frozenset:
    """The indices of ``program``'s equations that lowering runs no kernel for: those
    ``fold_constants`` computes before compiling because they read only literals
    (and the values of others such), and the ``broadcast_to`` equations
    ``implicit_broadcasts`` drops. The cost model prices them at nothing: an Adam
    step's ``m * 0.9`` broadcasts its scalar in the kernel, not as a kernel of its own.

    >>> import numpy as np, fshard as fs
    >>> ir = fs.make_ir(lambda x: x * 0.9 + fs.ops.exp(fs.ops.zeros((3,))))(
    ...     np.ones(3, np.float32))
    >>> sorted(lowered_away(ir.program)), len(ir.program.equations)
    ([0, 2, 3], 5)
    """
    folded: set = set()
    away = set()
    for i, eq in enumerate(program.equations):
        if all(isinstance(a, Literal) or a in folded for a in eq.inputs) and _foldable(
                eq) and all(_elements(v.aval) <= FOLD_ELEMENTS for v in eq.outputs):
            folded.update(eq.outputs)
            away.add(i)
    lowered = implicit_broadcasts(program)
    if lowered is not program:
        computed = {v for eq in lowered.equations for v in eq.outputs}
        away.update(i for i, eq in enumerate(program.equations)
                    if eq.prim is broadcast_to_p and eq.outputs[0] not in computed)
    return frozenset(away)


# ---------------------------------------------------------------------------
# fuse_allreduces: bucket independent AllReduces into few large ones
# ---------------------------------------------------------------------------


def fuse_allreduces(program: Program, bucket_bytes: float | None,
                    scatter_bytes: float | None = None,
                    group_of: Callable | None = None,
                    report: list | None = None) -> Program:
    """``program`` with its ``psum`` equations over the same mesh axes and of the same
    dtype merged into buckets of at most ``bucket_bytes`` (one flattened, concatenated
    AllReduce per bucket, split back after): a data-parallel step's gradients then
    cost a few collectives instead of one per tensor (NB: PyTorch DDP's gradient
    buckets, MindSpore's ``comm_fusion``/``all_reduce_fusion_config``).

    A reduce-scatter, which the CPU backend runs as an AllReduce whose result only
    this device's block is read of (a ``psum`` all of whose readers are
    ``block_slice``), is bucketed apart, by ``scatter_bytes`` (MindSpore's
    ``"reducescatter"`` key); None leaves those (or the others, for ``bucket_bytes``)
    one per value. ``group_of(equation)``, if given, replaces ``bucket_bytes``: the
    other psums with the same label (not None) form one bucket (MindSpore's
    ``"index"`` mode: gradients by index ranges), a None label leaves a psum alone.

    Buckets fill in program order; a psum whose operand depends on a psum of the open
    bucket starts a new one (one AllReduce cannot wait for its own result), and one
    larger than the bucket alone stays alone without closing the open bucket. The
    equations are then re-ordered (stably, dependencies first) so that each bucket's
    AllReduce runs once all its operands are ready and before any reader of its
    results. Every element is still reduced once: the sums are the same. ``report``,
    if given, receives ``(AllReduces merged, bytes)`` for each bucket of several.
    """
    readers: dict = {}
    for eq in program.equations:
        for a in eq.inputs:
            if isinstance(a, Var):
                readers.setdefault(a, []).append(eq.prim)
    outputs = {v for v in program.outputs if isinstance(v, Var)}

    def scatters(eq) -> bool:
        out = eq.outputs[0]
        return out not in outputs and bool(readers.get(out)) and all(
            r is block_slice_p for r in readers[out])

    def key_of(eq):
        key = _psum_key(eq)
        if key is None:
            return None
        if scatters(eq):
            return None if scatter_bytes is None else key + ("reducescatter",)
        if group_of is None:
            return None if bucket_bytes is None else key + ("allreduce",)
        label = group_of(eq)
        return None if label is None else key + ("index", label)

    def limit(key) -> float:
        return {"reducescatter": scatter_bytes, "allreduce": bucket_bytes}.get(
            key[2], float("inf"))

    return _fuse(program, limit, key_of, _fused_psum, report)


def fuse_allgathers(program: Program, bucket_bytes: float, carrier=None,
                    report: list | None = None) -> Program:
    """``program`` with its ``all_gather`` equations along dimension 0 over the same
    mesh axes and of the same dtype merged into buckets of at most ``bucket_bytes``
    of gathered output (one flattened, concatenated AllGather per bucket, cut back
    after): ZeRO's gathers of the updated parameters' blocks then cost a few
    collectives instead of one per tensor (MindSpore's ``comm_fusion`` for
    ``"allgather"``). Buckets fill as ``fuse_allreduces``'s do; the values are the
    same.

    ``carrier`` (a float dtype, or None): integer gathers join the buckets of
    ``carrier`` values too, carried as 16-bit chunks in ``carrier`` (a gather copies
    them, so they come back exact): a batch's float rows and integer labels then
    cost one AllGather (a backend whose collectives take floats only). ``report``: as
    ``fuse_allreduces``'."""
    def key_of(eq):
        key = _gather_key(eq)
        if key is not None and carrier is not None and dtypes.is_int(key[1]):
            return key[0], carrier
        return key

    return _fuse(program, lambda key: bucket_bytes, key_of,
                 functools.partial(_fused_all_gather, carrier=carrier), report)


def _psum_key(eq):
    if not (eq.prim is psum_p and len(eq.inputs) == 1 and isinstance(eq.inputs[0], Var)
            and eq.inputs[0].aval.is_static):
        return None
    return (tuple(eq.params["axis_name"]), eq.inputs[0].aval.dtype)


def _gather_key(eq):
    if not (eq.prim is all_gather_p and len(eq.inputs) == 1 and isinstance(eq.inputs[0], Var)
            and eq.inputs[0].aval.is_static and eq.params.get("axis") == 0
            and eq.outputs[0].aval.is_static):
        return None
    return (tuple(sorted((k, repr(v)) for k, v in eq.params.items())),
            eq.inputs[0].aval.dtype)


def _fuse(program: Program, limit, key_of, build, report: list | None = None) -> Program:
    """The bucketing of ``fuse_allreduces``: equations with the same ``key_of``
    (None: not fusable) merged by ``build(equations) -> equations`` into buckets of at
    most ``limit(key)`` bytes (``report``: as ``fuse_allreduces``')."""
    eqs = program.equations
    producer = {v: i for i, eq in enumerate(eqs) for v in eq.outputs}
    # deps[i]: bit set of the equations equation i depends on, transitively
    deps = [0] * len(eqs)
    for i, eq in enumerate(eqs):
        d = 0
        for a in eq.inputs:
            j = producer.get(a) if isinstance(a, Var) else None
            if j is not None:
                d |= deps[j] | (1 << j)
        deps[i] = d

    def nbytes(v) -> float:
        return float(np.prod(v.aval.shape, dtype=np.int64)) * np.dtype(
            dtypes.to_numpy(v.aval.dtype)).itemsize

    buckets: list = []   # lists of equation indices
    open_: dict = {}     # key -> (bucket index, bytes, member bit set)
    for i, eq in enumerate(eqs):
        key = key_of(eq)
        if key is None:
            continue
        b = nbytes(eq.outputs[0])
        if b > limit(key):  # alone in any bucket: the open one stays open
            continue
        cur = open_.get(key)
        if cur is None or cur[1] + b > limit(key) or deps[i] & cur[2]:
            buckets.append([i])
            open_[key] = (len(buckets) - 1, b, 1 << i)
        else:
            k, size, members = cur
            buckets[k].append(i)
            open_[key] = (k, size + b, members | (1 << i))
    fused = [bk for bk in buckets if len(bk) > 1]
    if report is not None:
        report.extend((len(bk), sum(nbytes(eqs[i].outputs[0]) for i in bk)) for bk in fused)
    if not fused:
        return program
    # Nodes: each equation, except that a bucket's members are one node (its first).
    node_of = list(range(len(eqs)))
    for bk in fused:
        for i in bk:
            node_of[i] = bk[0]
    members = {bk[0]: bk for bk in fused}
    preds: dict = {n: set() for n in set(node_of)}
    for i, eq in enumerate(eqs):
        for a in eq.inputs:
            j = producer.get(a) if isinstance(a, Var) else None
            if j is not None and node_of[j] != node_of[i]:
                preds[node_of[i]].add(node_of[j])
    succs: dict = {n: [] for n in preds}
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)
    # A bucket is ready when its last member would have been: order by that index.
    order_key = {n: max(members.get(n, [n])) for n in preds}
    waiting = {n: len(ps) for n, ps in preds.items()}

    ready = [(order_key[n], n) for n, w in waiting.items() if w == 0]
    heapq.heapify(ready)
    out: list = []
    while ready:
        _, n = heapq.heappop(ready)
        if n in members:
            out.extend(build([eqs[i] for i in members[n]]))
        else:
            out.append(eqs[n])
        for m in succs[n]:
            waiting[m] -= 1
            if waiting[m] == 0:
                heapq.heappush(ready, (order_key[m], m))
    assert len(out) >= len(eqs), "fusing collectives lost equations (a cycle)"
    return Program(program.inputs, out, program.outputs, program.n_consts, program.meta)


def _flatten_concat(eqs: list, xs: list | None = None) -> tuple[list, Var, tuple]:
    """The equations flattening each collective's input (or ``xs``, one per collective)
    and concatenating them, the concatenation, and each input's length in it."""
    out, flat = [], []
    for eq, x in zip(eqs, xs or [eq.inputs[0] for eq in eqs]):
        v = Var(ArrayType((int(np.prod(x.aval.shape, dtype=np.int64)),), x.aval.dtype))
        out.append(Equation(reshape_p, [x], {"shape": v.aval.shape}, [v], eq.source))
        flat.append(v)
    lengths = tuple(v.aval.shape[0] for v in flat)
    total = Var(ArrayType((sum(lengths),), flat[0].aval.dtype))
    out.append(Equation(concat_p, flat, {"axis": 0}, [total]))
    return out, total, lengths


def _reshape_back(eqs: list, pieces: list) -> list:
    """Each piece of a fused result reshaped into the output of its collective."""
    return [Equation(reshape_p, [piece], {"shape": tuple(eq.outputs[0].aval.shape)},
                     [eq.outputs[0]], eq.source) for eq, piece in zip(eqs, pieces)]


def _fused_psum(eqs: list) -> list:
    """One AllReduce for several: flatten, concatenate, reduce, split, reshape back."""
    out, total, lengths = _flatten_concat(eqs)
    reduced = Var(total.aval)
    out.append(Equation(psum_p, [total], dict(eqs[0].params), [reduced]))
    pieces = [Var(ArrayType((k,), total.aval.dtype)) for k in lengths]
    out.append(Equation(split_p, [reduced], {"sizes": lengths, "axis": 0}, pieces))
    return out + _reshape_back(eqs, pieces)


def _fused_all_gather(eqs: list, carrier=None) -> list:
    """One AllGather (along dimension 0) for several: flatten each block, concatenate,
    gather (device-major: ``n`` runs of the concatenation), then per value its
    columns of the ``(n, total)`` result, reshaped to ``(n * rows, ...)``. Integers
    in a bucket of floats (``fuse_allgathers``' ``carrier``) travel as chunks."""
    out, carried = [], []
    same = all(eq.inputs[0].aval.dtype == eqs[0].inputs[0].aval.dtype for eq in eqs)
    for eq in eqs:
        x = eq.inputs[0]
        if same or x.aval.dtype == carrier:
            carried.append((x, 0))
        else:
            carried.append(_int_chunks(x, carrier, out))
    flat, total, lengths = _flatten_concat(eqs, [c for c, _ in carried])
    out += flat
    n = eqs[0].outputs[0].aval.shape[0] // eqs[0].inputs[0].aval.shape[0]
    gathered = Var(ArrayType((n * sum(lengths),), total.aval.dtype))
    out.append(Equation(all_gather_p, [total], dict(eqs[0].params), [gathered]))
    rows = Var(ArrayType((n, sum(lengths)), total.aval.dtype))
    out.append(Equation(reshape_p, [gathered], {"shape": rows.aval.shape}, [rows]))
    pieces = [Var(ArrayType((n, k), total.aval.dtype)) for k in lengths]
    out.append(Equation(split_p, [rows], {"sizes": lengths, "axis": 1}, list(pieces)))
    for j, (eq, (_, n_chunks)) in enumerate(zip(eqs, carried)):
        if n_chunks:
            pieces[j] = _int_unchunk(pieces[j], n_chunks, eq.inputs[0].aval.dtype, out)
    return out + _reshape_back(eqs, pieces)


def _int_constant(v: int, shape: tuple, out: list) -> Var:
    """An int64 array of ``shape`` holding ``v`` (primitives take operands of one
    shape)."""
    return _emit(out, broadcast_to_p, [Literal(np.int64(v), ArrayType((), dtypes.int64))],
                 {"shape": shape}, ArrayType(shape, dtypes.int64))


def _emit(out: list, prim, inputs: list, params: dict, aval: ArrayType) -> Var:
    v = Var(aval)
    out.append(Equation(prim, inputs, params, [v]))
    return v


def _int_chunks(x: Var, carrier, out: list) -> tuple[Var, int]:
    """``x``'s integers as 16-bit chunks in ``carrier`` (``(..., n_chunks)``, the low
    chunks in [0, 65535] (within 65536 of it where a division rounds), the top one
    signed: x = sum of chunk_k * 65536**k), each
    exact in a float of 24 mantissa bits; the equations appended to ``out`` (as
    ``fshard.backend.collectives``' chunks of an integer collective)."""
    shape, dt = tuple(x.aval.shape), x.aval.dtype
    n_chunks = max(1, np.dtype(dtypes.to_numpy(dt)).itemsize // 2)
    if n_chunks == 1:  # 8 and 16 bits: exact as they are
        v = _emit(out, cast_p, [x], {"dtype": carrier}, ArrayType(shape, carrier))
        return _emit(out, reshape_p, [v], {"shape": shape + (1,)},
                     ArrayType(shape + (1,), carrier)), 1
    wide = ArrayType(shape, dtypes.int64)
    # q_0 = x, q_k+1 = q_k // 65536, chunk_k = q_k - 65536 * q_k+1, the top chunk q_last:
    # x = sum of chunk_k * 65536**k holds in int64 whatever the divisions round to
    # (MindSpore's CPU FloorDiv of an int64 near 2**63 is off by one: (2**63 - 1) //
    # 65536 gives 2**47), and every chunk stays exact in a float of 24 mantissa bits
    q = _emit(out, cast_p, [x], {"dtype": dtypes.int64}, wide)
    base = _int_constant(65536, shape, out)
    parts = []
    for k in range(n_chunks):
        if k < n_chunks - 1:
            nxt = _emit(out, floor_div_p, [q, base], {}, wide)
            chunk = _emit(out, sub_p, [q, _emit(out, mul_p, [nxt, base], {}, wide)], {}, wide)
        else:
            chunk = q
        f = _emit(out, cast_p, [chunk], {"dtype": carrier}, ArrayType(shape, carrier))
        parts.append(_emit(out, reshape_p, [f], {"shape": shape + (1,)},
                           ArrayType(shape + (1,), carrier)))
        if k < n_chunks - 1:
            q = nxt
    return _emit(out, concat_p, parts, {"axis": len(shape)},
                 ArrayType(shape + (n_chunks,), carrier)), n_chunks


def _int_unchunk(piece: Var, n_chunks: int, dtype, out: list) -> Var:
    """``_int_chunks`` undone on a gathered ``(n, k * n_chunks)`` piece: ``(n, k)`` of
    ``dtype``."""
    n, width = piece.aval.shape
    k = width // n_chunks
    chunked = _emit(out, reshape_p, [piece], {"shape": (n, k, n_chunks)},
                    ArrayType((n, k, n_chunks), piece.aval.dtype))
    parts = [Var(ArrayType((n, k, 1), piece.aval.dtype)) for _ in range(n_chunks)]
    out.append(Equation(split_p, [chunked], {"sizes": (1,) * n_chunks, "axis": 2}, parts))
    wide = ArrayType((n, k, 1), dtypes.int64)
    total = None
    for j, part in enumerate(parts):
        v = _emit(out, cast_p, [part], {"dtype": dtypes.int64}, wide)
        if j:
            v = _emit(out, mul_p, [v, _int_constant(65536 ** j, (n, k, 1), out)], {}, wide)
        total = v if total is None else _emit(out, add_p, [total, v], {}, wide)
    total = _emit(out, cast_p, [total], {"dtype": dtype}, ArrayType((n, k, 1), dtype))
    return _emit(out, reshape_p, [total], {"shape": (n, k)}, ArrayType((n, k), dtype))


def reduce_in_float32(program: Program) -> Program:
    """``program`` with every reduction collective (``psum``, ``pmean``,
    ``psum_scatter``) of float16 values done in float32: cast up, reduce, cast back
    (MindSpore's ``enable_fp32_communication`` / gradient fp32 sync). A float16 sum over
    many devices then rounds once, at the end, instead of at every partial sum, at
    twice the bytes on the wire."""
    reductions = (psum_p, pmean_p, psum_scatter_p)
    out: list = []
    for eq in program.equations:
        if not (eq.prim in reductions and eq.inputs and all(
                isinstance(a, Var) and a.aval.dtype == dtypes.float16 for a in eq.inputs)):
            out.append(eq)
            continue
        wide = []
        for a in eq.inputs:
            w = Var(ArrayType(a.aval.shape, dtypes.float32))
            out.append(Equation(cast_p, [a], {"dtype": dtypes.float32}, [w], eq.source))
            wide.append(w)
        reduced = [Var(ArrayType(y.aval.shape, dtypes.float32)) for y in eq.outputs]
        out.append(Equation(eq.prim, wide, dict(eq.params), reduced, eq.source))
        for r, y in zip(reduced, eq.outputs):
            out.append(Equation(cast_p, [r], {"dtype": dtypes.float16}, [y], eq.source))
    if len(out) == len(program.equations):
        return program
    return Program(program.inputs, out, program.outputs, program.n_consts, program.meta)


# ---------------------------------------------------------------------------
# fuse_adam_updates: one update equation for a planned step's per-leaf ones
# ---------------------------------------------------------------------------


def fuse_adam_updates(program: Program) -> Program:
    """The ``adam_update`` equations of one learning rate and hyperparameters as one
    equation of all their leaves, where none reads another's outputs. A planned step
    (``fs.AutoParallel``) updates each leaf by its own equation, so that each leaf can
    take its own layout; once partitioned, the per-device program runs one kernel per
    leaf either way, and the lowering makes one helper per equation: the 100-layer
    MLP's data-parallel step ran 1.16x slower with a helper per leaf than with one (a
    hand-written step, each way, interleaved). The fused equation sits where the last
    of them was; what reads an earlier one's outputs in between moves after it, in its
    order (it cannot feed a later update: those were not fused)."""
    eqs = program.equations
    groups: dict = {}
    for i, eq in enumerate(eqs):
        if eq.prim is adam_update_p:
            key = (_key(eq.params), _atom_key(eq.inputs[-1]))
            groups.setdefault(key, []).append(i)
    groups = {k: g for k, g in groups.items() if len(g) > 1}
    if not groups:
        return program
    # per Var, the bit set of the updates (by index) it depends on
    member = {i: bit for bit, i in enumerate(i for g in groups.values() for i in g)}
    deps: dict = {}

    def reads(eq) -> int:
        d = 0
        for a in eq.inputs:
            if isinstance(a, Var):
                d |= deps.get(a, 0)
        return d

    reads_member: set = set()
    for i, eq in enumerate(eqs):
        d = reads(eq)
        if i in member:
            if d:
                reads_member.add(i)
            d |= 1 << member[i]
        if d:
            for y in eq.outputs:
                deps[y] = d
    fused: dict = {}   # index of a group's last equation -> the fused equation
    dropped: set = set()
    pending = 0        # the fused updates not emitted yet, as a bit set
    for g in groups.values():
        if any(i in reads_member for i in g):
            continue  # an update reads another's result: leave the group as it is
        parts = [eqs[i] for i in g]
        n = [(len(e.inputs) - 1) // 3 for e in parts]
        ins, outs = [], []
        for k in range(3):  # moments, second moments, gradients (updates), leaf by leaf
            for e, m in zip(parts, n):
                ins += e.inputs[k * m:(k + 1) * m]
                outs += e.outputs[k * m:(k + 1) * m]
        fused[g[-1]] = (Equation(adam_update_p, ins + [parts[0].inputs[-1]],
                                 dict(parts[0].params), outs, parts[0].source),
                        sum(1 << member[i] for i in g))
        dropped.update(g[:-1])
        pending |= fused[g[-1]][1]
    if not fused:
        return program
    out: list = []
    waiting: list = []  # (in program order) equations reading a fused update not emitted
    for i, eq in enumerate(eqs):
        if i in dropped:
            continue
        if i in fused:
            eq, bits = fused[i]
            out.append(eq)
            pending &= ~bits
            # (what a waiting equation reads is waiting before it, or emitted)
            out += [w for w in waiting if not reads(w) & pending]
            waiting = [w for w in waiting if reads(w) & pending]
        elif reads(eq) & pending:
            waiting.append(eq)
        else:
            out.append(eq)
    return Program(program.inputs, out + waiting, program.outputs, program.n_consts,
                   program.meta)
