"""Pipeline parallelism for ``fs.AutoParallel``: stages, micro-batches, schedules.

``ap.pipeline(stages=S, micro_batches=M, scheduler=..., interleave=...)`` turns the
train step into a pipelined one:

1. **Stages.** The loss is traced once on one micro-batch's shapes. Each equation
   belongs to a model stage ("chunk"): a ``pipeline_split`` marker (``fs.pipeline_split``
   or a Cell's ``pipeline_stage``) starts a later chunk and every other equation runs
   in the latest chunk of its inputs (values that depend on no marked value, such as a
   transposed weight, run in the first chunk that uses them). Values used by later
   chunks are carried across each boundary; a parameter belongs to the one chunk that
   uses it.
2. **Devices.** The devices form a ``(pp, dp) = (S, n / S)`` grid, stage-major (stage
   ``s`` holds ranks ``s * dp ... s * dp + dp - 1``, as MindSpore's stages do); chunk
   ``c`` runs on stage ``c % S``; inside a stage the micro-batch is split over ``dp``
   (data parallelism), or, when ``parameter_plan`` or the loss gives operator
   strategies, each chunk's programs are ``fs.shard``-ed over the stage's devices
   (``StageSharding``: operator parallelism inside the stage).
3. **One step** follows the schedule's program order (fshard/training/parallel/schedule.py):
   each forward is the chunk's ``fs.vjp`` on its micro-batch (activations kept until
   the backward), each backward pulls the cotangent through; a transfer round moves
   activations one stage on and cotangents one stage back. Gradients are summed over
   micro-batches and the ``dp`` replicas (MindSpore's ``PipelineGradReducer``), the
   last chunk seeding ``1 / (M * dp)`` for a loss that is a mean over the examples and
   ``1`` for a sum over them divided by a constant (``loss_combination`` tells them
   apart on the first step and refuses any other loss), and the optimizer runs once:
   exactly the gradient of the full batch's loss. The update is split by stage when
   it can be (``StageUpdate``): each stage's devices update only their own parameters
   and optimizer state (with ZeRO, split over the stage's devices; on sharded stages,
   in their ``parameter_plan`` blocks), a sum or maximum over several stages' values
   (a global norm) combining the stages' partial results.

Where it runs:

- **Virtual mesh** (one process): the per-device programs of all ``S * dp`` devices are
  traced into one program, in the schedule's order; a transfer hands the value over.
  One compiled program per configuration.
- **Multi-process job** (the mesh is the world): each process traces only its own
  stage's actions (its rank is known when it traces). Every transfer round is an
  ``fs.ppermute`` over the ``pp`` axis (MindSpore's CPU backend has no Send/Receive in
  graphs: the verified emulation is a one-hot slot buffer summed over the pipeline
  group), the carried values flattened into one float32 buffer padded to the largest
  boundary; every rank of a pipeline group runs the same rounds. With the update split
  by stage, each process sums its stage's gradients over the stage's processes, combines
  the cross-stage reductions' partial results with one collective over ``pp`` each, and
  updates its stage's leaves alone: the state it returns holds the other stages' leaves
  as ``fs.RemoteArray`` leaves (``PipelineRunner.gather`` brings them back); on a
  sharded stage, its split leaves as this process's blocks (``fs.ShardedArray`` over
  the stage's processes), the stage's update programs ``fs.shard``-ed over them (each
  chunk's backward keeping its gradient sums in the blocks). An update that
  does not split has the gradients summed over the whole job with one ``fs.psum`` each
  (a process holds zeros for the other stages' parameters), so every process runs the
  whole optimizer and keeps the whole state.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from typing import NamedTuple

import numpy as np

from fshard.core import context, dtypes, tree
from fshard.meshes import distributed
from fshard.core.tracing import ArrayType, Tracer, bind, typeof
from fshard.core.dims import planning_size
from fshard.errors import ArgumentError, FshardError, PipelineBalanceWarning
from fshard.adapter.interop import check_context_mode
from fshard.backend.mindspore import as_tensor, device_target
from fshard.core.interpret import bind_equation, eval_program, walk_equations
from fshard.core.ir import Program, Var
from fshard.meshes.layout import Layout
from fshard.meshes.mesh import Mesh, resolve_mesh
from fshard.training.optim import apply_updates
from fshard.sharding.cost import local_bytes
from fshard.sharding.local import RemoteArray, ShardedArray, block_bounds
from fshard.sharding.layouts import ShardMesh, Sharding
from fshard.sharding.strategy import parse_strategy
from fshard.sharding.user_layouts import with_sharding_constraint
from fshard.primitives.passes import reduce_in_float32
from fshard.training.parallel.options import ParallelMode
from fshard.training.parallel.schedule import Event, Schedule, check_config
from fshard.primitives import collectives as C
from fshard.primitives.base import add_p
from fshard.primitives.elementwise import cast, maximum_p, minimum_p
from fshard.primitives.pipeline import pipeline_split_p
from fshard.primitives.spmd import layout_constraint_p
from fshard.primitives.structural import concat, reshape
from fshard.core.rules import sharding as sharding_rules
from fshard.core.staging import trace_fun
from fshard.transforms.ad import vjp
from fshard.transforms.jit import jit
from fshard.transforms.shard import shard


class PipelineConfig(NamedTuple):
    stages: int
    micro_batches: int
    scheduler: str
    interleave: bool
    output_broadcast: bool
    max_imbalance: float | None = None


def check_pipeline_args(stages, micro_batches, scheduler, interleave, output_broadcast,
                        n_devices: int, max_imbalance=None) -> PipelineConfig:
    for name, v in (("interleave", interleave), ("output_broadcast", output_broadcast)):
        if not isinstance(v, bool):
            raise ArgumentError(
                f"AutoParallel.pipeline({name}=...) must be True or False; got {v!r}.")
    if max_imbalance is not None and (
            isinstance(max_imbalance, bool) or not isinstance(max_imbalance, (int, float))
            or not max_imbalance >= 1):
        raise ArgumentError(
            f"AutoParallel.pipeline(max_imbalance=...) is the largest ratio of two stages' "
            f"estimated costs accepted without a warning: a number >= 1, or None for no "
            f"check; got {max_imbalance!r}.\nFix: e.g. max_imbalance=2.0, or None.")
    # (interleave's own check, M a multiple of S, needs only v > 1)
    check_config(stages, micro_batches, scheduler, 2 if interleave else 1)
    if n_devices % stages:
        raise ArgumentError(
            f"AutoParallel.pipeline(stages={stages}) must divide the {n_devices} devices "
            f"into equal stage groups; {n_devices} is not a multiple of {stages}.\nFix: "
            f"stages one of {[d for d in range(1, n_devices + 1) if n_devices % d == 0]}, "
            "or a mesh whose device count is a multiple of stages.")
    return PipelineConfig(stages, micro_batches, scheduler, interleave, output_broadcast,
                          None if max_imbalance is None else float(max_imbalance))


# ---------------------------------------------------------------------------
# The loss cut into chunks
# ---------------------------------------------------------------------------


class Stages:
    """The loss program cut into ``n`` chunks (see the module docstring)."""

    def __init__(self, loss_fn, name: str, params, batch, local_rows: int,
                 devices: int = 1):
        p_leaves, _ = tree.flatten(params)
        b_leaves, _ = tree.flatten(list(batch))
        in_tree = tree.structure(((params, *batch), {}))
        avals = [typeof(x) for x in p_leaves]
        for x in b_leaves:
            a = typeof(x)
            avals.append(ArrayType((local_rows,) + tuple(a.shape[1:]), a.dtype))
        # A stage of ``devices`` devices may run operator parallelism: Primitive.shard
        # strategies and fs.shard calls in the loss become layout constraints (as in
        # AutoParallel's step), which each stage's fs.shard honours. One device: they warn.
        with context.counted(context.shard_annotations):
            if devices > 1:
                with context.counted(context.shard_depth), \
                        context.pushed(context.shard_devices, devices):
                    traced = trace_fun(lambda p, *b: loss_fn(p, *b), in_tree, avals)
            else:
                traced = trace_fun(lambda p, *b: loss_fn(p, *b), in_tree, avals)
        #: The loss fixes layouts of its own (operator strategies, fs.shard calls).
        self.constrained = _has_constraints(traced.program)
        prog = self.program = traced.program
        self.consts = list(traced.consts)
        self.name = name
        self._compiled: dict = {}  # (kind, chunk) -> programs of a chunk's own
        self._keys: dict = {}      # chunk -> its chunk_key
        n_c, n_p = prog.n_consts, len(p_leaves)
        self.const_vars = prog.inputs[:n_c]
        self.param_vars = prog.inputs[n_c:n_c + n_p]
        self.batch_vars = prog.inputs[n_c + n_p:]
        out = prog.outputs
        if len(out) != 1 or not isinstance(out[0], Var) or out[0].aval.ndim != 0 or \
                not dtypes.is_float(out[0].aval.dtype):
            raise ArgumentError(
                f"AutoParallel({name}).pipeline: the loss must return one float scalar (the "
                f"mean loss of the batch); got {[str(getattr(o, 'aval', o)) for o in out]}."
                "\nFix: return the loss alone (has_aux is not supported with a pipeline).")
        self._assign()

    def _fail(self, msg):
        raise ArgumentError(f"AutoParallel({self.name}).pipeline: {msg}")

    def _assign(self):
        prog = self.program
        st: dict = {}   # Var -> chunk (None: not yet known)
        eq_st = []
        for eq in prog.equations:
            known = [st[v] for v in eq.inputs if isinstance(v, Var) and st.get(v) is not None]
            base = max(known) if known else None
            if eq.prim is pipeline_split_p:
                k = eq.params.get("stage")
                if k is None:
                    k = (base if base is not None else 0) + 1
                elif base is not None and k < base:
                    self._fail(
                        f"a value computed in stage {base} enters stage {k}: values may only "
                        "flow to the same or a later stage.\nFix: give the Cell that "
                        f"consumes it pipeline_stage >= {base}, or the Cell that computes it "
                        f"a stage <= {k}." + (f" (at {eq.source})" if eq.source else ""))
                s = k
            else:
                s = base
            eq_st.append(s)
            for v in eq.outputs:
                st[v] = s
        # equations of unmarked values (weights, batch preprocessing) run in the first
        # chunk that uses them
        users: dict = {}
        for i, eq in enumerate(prog.equations):
            for v in eq.inputs:
                if isinstance(v, Var):
                    users.setdefault(v, []).append(i)
        found = max([s for s in eq_st if s is not None], default=0) + 1
        for i in range(len(prog.equations) - 1, -1, -1):
            if eq_st[i] is None:
                outs = prog.equations[i].outputs
                # a value entering a stage through an fs.pipeline_split marker is made
                # in the stage before it
                cands = [eq_st[j] - (prog.equations[j].prim is pipeline_split_p
                                     and prog.equations[j].params.get("stage") is None)
                         for v in outs for j in users.get(v, ()) if eq_st[j] is not None]
                if any(v in prog.outputs for v in outs):
                    cands.append(found - 1)
                eq_st[i] = min(cands) if cands else 0
        self.n_chunks = found
        chunk_eqs = [[] for _ in range(found)]
        for eq, s in zip(prog.equations, eq_st):
            chunk_eqs[s].append(eq)
        for c, eqs in enumerate(chunk_eqs):
            if not any(eq.prim is not pipeline_split_p for eq in eqs):
                self._fail(
                    f"stage {c} of {found} is empty (it computes nothing).\nFix: move a "
                    "pipeline_split marker (or a Cell's pipeline_stage) so that every stage "
                    "holds part of the model.")
        if eq_st[[i for i, eq in enumerate(prog.equations)
                  if prog.outputs[0] in eq.outputs][0]] != found - 1:
            self._fail(f"the loss is not computed in the last stage ({found - 1}).")
        self.chunk_eqs = chunk_eqs
        # parameters: one chunk each
        owner = {}

        def reads_in(eq, s):
            # an fs.pipeline_split marker reads its operands in the stage before it: a
            # parameter handed to it is sent on (a tied weight: Megatron's embedding
            # and output head), owned by the stage that uses it before the marker
            return s - 1 if _is_split_marker(eq) else s

        for v_i, v in enumerate(self.param_vars):
            chunks = sorted({reads_in(eq, s) for eq, s in zip(prog.equations, eq_st)
                             if v in eq.inputs})
            if len(chunks) > 1:
                self._fail(
                    f"parameter #{v_i} ({v.aval}) is used in stages {chunks}; a parameter "
                    "must live in one stage (shared weights across stages are not "
                    "supported).\nFix: use the parameter in one stage only and hand it "
                    "to the later stage through the marker, `h, w = fs.pipeline_split((h, "
                    "w))` (a tied embedding), or pass a value computed from it.")
            owner[v_i] = chunks[0] if chunks else 0
        self.param_owner = owner  # leaf index -> chunk
        self.chunk_params = [[i for i in range(len(self.param_vars)) if owner[i] == c]
                             for c in range(found)]
        # carries: values made in chunks <= b and used in chunks > b
        made = {v: owner[i] for i, v in enumerate(self.param_vars)}
        for eq, s in zip(prog.equations, eq_st):
            for v in eq.outputs:
                made[v] = s
        last_use: dict = {}
        for eq, s in zip(prog.equations, eq_st):
            for v in eq.inputs:
                if isinstance(v, Var) and v in made:
                    last_use[v] = max(last_use.get(v, -1), s)
        order = list(self.param_vars) + [v for eq in prog.equations for v in eq.outputs]
        self.carries = [[v for v in order if made[v] <= b < last_use.get(v, -1)]
                        for b in range(found - 1)]
        for b, vs in enumerate(self.carries):
            for v in vs:
                if not dtypes.is_float(v.aval.dtype):
                    self._fail(
                        f"a {v.aval} value crosses the boundary between stages {b} and "
                        f"{b + 1}; only float values can (their cotangents flow back).\nFix: "
                        "compute it in the stage that uses it, or pass it as a batch input.")

    def check(self, stages: int, interleave: bool) -> int:
        """The number of chunks per stage (``v``), or an error if the markers do not cut
        the loss into ``stages`` (times ``v`` with interleave) stages."""
        found = self.n_chunks
        if interleave:
            if found % stages or found == stages:
                self._fail(
                    f"interleave=True gives each of the {stages} stages several chunks, so "
                    f"the model needs a multiple of {stages} chunks, more than {stages}; the "
                    f"loss has {found} (stage markers + 1).\nFix: {2 * stages} chunks "
                    f"(={2 * stages - 1} fs.pipeline_split markers) for 2 chunks per stage, "
                    "or interleave=False.")
        elif found != stages:
            why = "more markers than stages" if found > stages else "too few markers"
            self._fail(
                f"pipeline(stages={stages}) needs the loss cut into {stages} stages, but its "
                f"markers cut it into {found} ({why})."
                f"\nFix: {stages - 1} fs.pipeline_split calls (or Cells with pipeline_stage "
                f"0..{stages - 1}) for {stages} stages, or pipeline(stages={found}).")
        return found // stages

    def chunk_costs(self) -> list:
        """Each chunk's estimated forward cost on one micro-batch of one device: the
        flops of its equations as the sharding cost model counts them (iteration
        points times flops per point; an equation without a sharding rule counts one
        flop per output element)."""
        return [sum(_eq_flops(eq) for eq in eqs) for eqs in self.chunk_eqs]

    def stage_costs(self, stages: int) -> list:
        """The estimated forward cost of each stage (the sum of its chunks')."""
        out = [0.0] * stages
        for c, cost in enumerate(self.chunk_costs()):
            out[c % stages] += cost
        return out

    def check_balance(self, stages: int, max_imbalance: float | None) -> None:
        """A ``PipelineBalanceWarning`` when the costliest stage costs more than
        ``max_imbalance`` times the cheapest."""
        if max_imbalance is None:
            return
        costs = self.stage_costs(stages)
        hi, lo = max(costs), min(costs)
        if hi <= max_imbalance * lo:
            return
        idle = 1 - sum(costs) / len(costs) / hi
        ratio = f"{hi / lo:.1f}x" if lo else "infinitely more than"
        warnings.warn(PipelineBalanceWarning(
            f"AutoParallel({self.name}).pipeline: the stages' estimated costs are "
            f"unbalanced: {', '.join(f'stage {s} {c:.3g}' for s, c in enumerate(costs))} "
            f"flops per micro-batch (forward); stage {costs.index(hi)} costs {ratio} stage "
            f"{costs.index(lo)} (max_imbalance={max_imbalance:g}). A step runs at the pace "
            f"of the slowest stage: the stages idle {idle:.0%} of it on average, besides "
            "the schedule's bubble.\nFix: move the fs.pipeline_split markers (or the Cells' "
            "pipeline_stage) so the stages do similar work; ap.pipeline_stage_costs() "
            "shows the estimates; pipeline(..., max_imbalance=None) turns the check "
            "off."), stacklevel=5)

    def run_chunk(self, c: int, param_vals, carry_in, batch_vals):
        """The outputs of chunk ``c``: its carry to the next chunk, or ``[loss]``."""
        env = dict(zip(self.const_vars, self.consts))
        env.update(zip(self.batch_vars, batch_vals))
        env.update(zip([self.param_vars[i] for i in self.chunk_params[c]], param_vals))
        if c:
            env.update(zip(self.carries[c - 1], carry_in))
        read = walk_equations(self.chunk_eqs[c], env, bind_equation,
                              f"running pipeline stage {c}:")
        if c == self.n_chunks - 1:
            return [read(self.program.outputs[0])]
        return [env[v] for v in self.carries[c]]

    def carry_avals(self, b: int) -> list:
        return [v.aval for v in self.carries[b]]



    # -- the compiled pieces: one forward and one backward program per chunk --------
    def chunk_key(self, c: int):
        """A key equal for two chunks exactly when they compute the same function of
        the same input types (equations, parameters, literals and constants compared by
        value, variables by position), so that they can share compiled programs: the
        middle blocks of a stack, and the same chunk in every configuration with the same
        micro-batch shapes. ``None`` when an equation holds a value not compared exactly
        (such a chunk gets programs of its own)."""
        names: dict = {}
        consts = dict(zip(self.const_vars, self.consts))
        last = c == self.n_chunks - 1
        ins = ([self.param_vars[i] for i in self.chunk_params[c]]
               + (self.carries[c - 1] if c else []) + list(self.batch_vars))
        parts: list = [last, tuple(_aval_key(v.aval) for v in ins)]
        for v in ins:
            names[v] = len(names)
        for eq in self.chunk_eqs[c]:
            args = []
            for a in eq.inputs:
                if not isinstance(a, Var):
                    lit = _exact(a.value)
                    if lit is None:
                        return None
                    args.append(("lit", lit, _aval_key(a.aval)))
                    continue
                if a not in names:
                    const = _exact(consts[a]) if a in consts else None
                    if const is None:
                        return None
                    names[a] = len(names)
                    parts.append(("const", names[a], const))
                args.append(names[a])
            params = _exact(eq.params)
            if params is None:
                return None
            for v in eq.outputs:
                names[v] = len(names)
            parts.append((eq.prim, params, tuple(args),
                          tuple(_aval_key(v.aval) for v in eq.outputs)))
        outs = [self.program.outputs[0]] if last else self.carries[c]
        parts.append(tuple(names[v] for v in outs))
        return tuple(parts)

    def _shared(self, kind: str, c: int, build, sharding: "StageSharding | None"):
        if c not in self._keys:
            self._keys[c] = self.chunk_key(c)
        key = self._keys[c]
        layout = None if sharding is None else sharding.key(self.chunk_params[c])
        if key is None or layout is None and sharding is not None:
            # programs of this chunk's own (kept with the sharding they were made for,
            # so that its id is not reused while they live)
            hit = self._compiled.get((kind, c, id(sharding)))
            if hit is None:
                hit = self._compiled[(kind, c, id(sharding))] = (sharding, build())
            return hit[1]
        fn = _CHUNK_PROGRAMS.get((kind, key, layout))
        if fn is None:
            fn = _CHUNK_PROGRAMS[(kind, key, layout)] = build()
            while len(_CHUNK_PROGRAMS) > MAX_SHARED_PROGRAMS:  # the oldest go first
                del _CHUNK_PROGRAMS[next(iter(_CHUNK_PROGRAMS))]
        return fn

    def forward_fn(self, c: int, sharding: "StageSharding | None" = None):
        """``(params, carry_in, batch) -> carry_out`` of chunk ``c``, compiled; the last
        chunk takes and returns the running loss sum: ``(..., loss_sum) -> loss_sum``.
        With a ``sharding``, the program runs on the stage's devices through
        ``fs.shard`` (operator parallelism inside the stage)."""
        def build():
            if c == self.n_chunks - 1:
                def fwd(pv, ci, bv, loss_sum):
                    return loss_sum + self.run_chunk(c, pv, ci, bv)[0]
            else:
                def fwd(pv, ci, bv):
                    return self.run_chunk(c, pv, ci, bv)
            fwd.__name__ = f"{self.name}_stage{c}_forward"
            if sharding is None:
                return jit(fwd)
            extra = (None,) if c == self.n_chunks - 1 else ()
            return sharding.compile(fwd, self._param_strategies(c, sharding), extra)

        return self._shared("F", c, build, sharding)

    def backward_fn(self, c: int, sharding: "StageSharding | None" = None,
                    blocks: bool = False):
        """``(params, carry_in, batch, ct, grad_sums) -> (grad_sums + grads, ct_in)`` of
        chunk ``c``, compiled. It recomputes the chunk's forward from its input (the
        one activation kept per micro-batch between a forward and its backward).
        ``blocks``: in a job whose stages keep their state in tensor-parallel blocks,
        the gradient sums are this process's blocks (``fs.ShardedArray``)."""
        def build():
            def bwd(pv, ci, bv, ct, sums):
                _, pull = vjp(lambda p, i: self.run_chunk(c, p, i, bv), pv, ci)
                g_p, g_c = pull(ct)
                return [s + g for s, g in zip(sums, g_p)], g_c

            bwd.__name__ = f"{self.name}_stage{c}_backward"
            if sharding is None:
                return jit(bwd)
            strategies = self._param_strategies(c, sharding)
            # the gradient sums stay in the parameters' blocks from one micro-batch to
            # the next (the update takes them so): on a virtual mesh, and in a job
            # whose stages keep their state in blocks (each process its own block);
            # otherwise each process of a stage keeps them whole, as its state
            split = (sharding.groups is None or blocks) and self.split_counts(c, sharding)
            return sharding.compile(bwd, strategies, (None, strategies),
                                    (strategies, None) if split else None,
                                    gather_outputs=not blocks)

        return self._shared("B" if not blocks else "B blocks", c, build, sharding)

    def split_counts(self, c: int, sharding: "StageSharding") -> bool:
        """Whether every parameter of chunk ``c`` has split counts as its strategy (the
        gradient sums can then be kept in its blocks)."""
        return all(isinstance(s, tuple) and all(isinstance(k, int) for k in s)
                   for s in self._param_strategies(c, sharding))

    def _param_strategies(self, c: int, sharding: "StageSharding") -> list:
        return [sharding.params[i] for i in self.chunk_params[c]]


class StageSharding(NamedTuple):
    """Operator parallelism inside each stage: every chunk's programs run through
    ``fs.shard`` on the ``devices`` devices of a stage, with the parameters' strategies
    (``parameter_plan``) and the micro-batch split along its rows; propagation (or the
    search) lays out the rest and inserts the stage's collectives. The programs take
    and return whole values, so stages hand each other whole activations."""

    devices: int
    params: tuple          # per parameter leaf: its strategy (None: derived)
    batch: tuple           # per batch leaf: its strategy
    groups: tuple | None   # ("pp", S) in a job: the stage is one of S groups of ranks
    search: bool | str     # True: fshard's search; False: propagation; "follow_inputs"
    fp32: bool = False     # float16 reductions run in float32 (reduce_in_float32)

    def key(self, chunk_params) -> tuple | None:
        """A key of what chunk programs compiled with this sharding depend on (None
        when a strategy cannot be compared exactly)."""
        parts = [_exact(self.params[i]) for i in chunk_params] + [
            _exact(b) for b in self.batch]
        if any(p is None for p in parts):
            return None
        return (self.devices, self.groups, self.search, self.fp32, tuple(parts))

    def compile(self, fn, param_strategies: list, extra: tuple, out=None,
                gather_outputs: bool = True):
        """``fn(params, carry, batch, *extra)`` compiled as ``fs.shard`` on the stage's
        devices; ``extra``: the strategies of the further arguments; ``out``: of the
        outputs (None: whole); ``gather_outputs=False``: in a job, a split output is
        this process's block (``fs.ShardedArray``)."""
        mesh = (self.devices if self.groups is not None
                else Mesh(self.devices, "stage", virtual=True))
        s = shard(fn, in_strategy=(param_strategies, None, list(self.batch)) + extra,
                  out_strategy=out, mesh=mesh, level=2, search=self.search is True,
                  dataset_strategy="full_batch")
        s.search = self.search  # (semi_auto: "follow_inputs")
        s.process_groups = self.groups
        s.gather_outputs = gather_outputs
        if self.fp32:
            s.passes = (reduce_in_float32,)
        fn = jit(s)
        fn.sharded = s  # (its operator strategies: PipelinedStep.operator_strategies)
        return fn


def _is_split_marker(eq) -> bool:
    """An ``fs.pipeline_split`` marker (not a Cell's ``pipeline_stage`` entry)."""
    return eq.prim is pipeline_split_p and eq.params.get("stage") is None


def _has_constraints(program) -> bool:
    """Whether ``program`` (or a loop body or branch in it) fixes a layout."""
    for eq in program.equations:
        if eq.prim is layout_constraint_p:
            return True
        for v in eq.params.values():
            if any(_has_constraints(p) for p in (v if isinstance(v, tuple) else (v,))
                   if isinstance(p, Program)):
                return True
    return False


def _eq_flops(eq) -> float:
    try:
        spec = sharding_rules.lookup(eq.prim, transform="pipeline")(
            *[a.aval for a in eq.inputs], **eq.params)
    except FshardError:  # no sharding rule (or none for these operands)
        return float(sum(math.prod(planning_size(d) for d in v.aval.shape)
                         for v in eq.outputs))
    return spec.flops_per_point * math.prod(planning_size(d) for d in spec.sizes.values())


def _aval_key(a) -> tuple:
    return (tuple(a.shape), str(a.dtype))


def _exact(v):
    """``v`` as a hashable value equal only to exact copies of it (``None`` when it
    holds something that cannot be compared exactly): numbers by type and repr (so
    ``-0.0`` is not ``0.0``), arrays by dtype, shape and bytes."""
    if v is None or isinstance(v, (bool, str)):
        return (type(v).__name__, v)
    if isinstance(v, (int, float, np.generic)):
        return (type(v).__name__, repr(v))
    if isinstance(v, np.ndarray):
        return ("array", str(v.dtype), v.shape, v.tobytes()) if v.size <= 4096 else None
    if isinstance(v, (tuple, list)):
        items = [_exact(x) for x in v]
        return None if any(x is None for x in items) else (type(v).__name__, tuple(items))
    if isinstance(v, dict):
        items = [(k, _exact(x)) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))]
        return None if any(x is None for _, x in items) else ("dict", tuple(items))
    try:  # a dtype
        return ("dtype", str(dtypes.to_numpy(v)))
    except (KeyError, TypeError):
        return None


#: Compiled chunk programs shared by every cut whose chunks compute the same function
#: (see ``Stages.chunk_key``), the newest MAX_SHARED_PROGRAMS of them.
_CHUNK_PROGRAMS: dict = {}
MAX_SHARED_PROGRAMS = 256


#: Cut losses, by loss function and signature: the chunks' compiled programs are
#: reused by every pipeline configuration with the same cut and micro-batch shapes.
_CUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def cut(loss_fn, name: str, params, batch, rows: int, devices: int = 1) -> Stages:
    sig = (tree.structure((params, batch)), rows, devices, tuple(
        (tuple(typeof(x).shape[1:]), typeof(x).dtype) for x in tree.leaves(list(batch))),
        tuple((tuple(typeof(x).shape), typeof(x).dtype) for x in tree.leaves(params)))
    try:
        per_fn = _CUTS.setdefault(loss_fn, {})
    except TypeError:  # not weak-referenceable: no reuse
        per_fn = {}
    hit = per_fn.get(sig)
    if hit is None:
        hit = per_fn[sig] = Stages(loss_fn, name, params, batch, rows, devices)
    return hit


# ---------------------------------------------------------------------------
# The pipelined step
# ---------------------------------------------------------------------------


def batch_rows(name: str, batch, micro_batches: int, dp: int, sliced: bool = False) -> int:
    """Rows of one micro-batch on one device (checks the batch splits evenly). ``sliced``:
    the batch is this process's slice (``dataset_strategy("data_parallel")`` in a job),
    split into micro-batches only."""
    leaves = tree.leaves(list(batch))
    if not leaves:
        raise ArgumentError(f"AutoParallel({name}) with a pipeline needs batch inputs.")
    rows = {typeof(x).shape[0] if typeof(x).ndim else None for x in leaves}
    if None in rows or len(rows) != 1:
        raise ArgumentError(
            f"AutoParallel({name}).pipeline: every batch input must have the same first "
            f"dimension (the batch) to split into micro-batches; got first dims "
            f"{[typeof(x).shape[:1] for x in leaves]}.")
    (B,) = rows
    if sliced and B % micro_batches:
        raise ArgumentError(
            f"AutoParallel({name}).pipeline(micro_batches={micro_batches}): this process's "
            f"slice of the batch has {B} rows, which do not split into {micro_batches} "
            f"equal micro-batches.\nFix: a per-process batch that is a multiple of "
            f"{micro_batches}.")
    if sliced:
        return B // micro_batches
    if B % (micro_batches * dp):
        raise ArgumentError(
            f"AutoParallel({name}).pipeline(micro_batches={micro_batches}): the batch of "
            f"{B} does not split into {micro_batches} micro-batches of {dp} equal "
            f"data-parallel parts ({micro_batches} x {dp} = {micro_batches * dp} must divide "
            f"{B}).\nFix: a batch size that is a multiple of {micro_batches * dp}, or "
            "micro_batches dividing the batch.")
    return B // (micro_batches * dp)


def loss_combination(loss_fn, name: str, params, batch, rows: int, devices: int = 1) -> str:
    """How a pipeline combines its micro-batch losses into the batch's: ``"mean"`` or
    ``"sum"``, found by evaluating the loss (once per step signature, on this process's
    first rows): on two blocks ``a`` and ``b`` of ``rows`` rows and on the ``2 * rows``
    rows ``a; b`` (``a; a`` when there are fewer rows). A loss that is a mean over the
    examples gives ``L(a; b) = (L(a) + L(b)) / 2``; a sum over the examples divided by a
    constant (``sum / global_batch``) gives ``L(a; b) = L(a) + L(b)``. Any other loss
    has no split into micro-batches that reproduces the unpipelined loss: an
    ``ArgumentError``. (A loss that couples the examples, such as one normalising by
    batch statistics, may pass this test and is never exact when pipelined.)"""
    p_leaves = tree.leaves(params)
    b_leaves = tree.leaves(list(batch))
    if any(isinstance(x, Tracer) for x in p_leaves + b_leaves):
        raise ArgumentError(
            f"AutoParallel({name}).pipeline: the first step of a pipeline runs its loss on "
            "concrete values to learn how micro-batch losses combine; it was called on "
            "traced values (inside fs.jit or a transform).\nFix: call the AutoParallel "
            "step directly (it is compiled already).")
    remote = [x for x in p_leaves if isinstance(x, RemoteArray)]
    if remote:
        raise ArgumentError(
            f"AutoParallel({name}).pipeline: the first step of a pipeline evaluates the "
            "loss once on the whole parameters, to learn how "
            f"micro-batch losses combine; this process holds only its stage's ("
            f"{remote[0]!r}).\nFix: pass the whole state to the first step: "
            "ap.init(params), fs.checkpoint.load(path, like=ap.init(params)), or "
            "ap.gather(state) (a collective).")
    B = typeof(b_leaves[0]).shape[0]
    first = [x[:rows] for x in b_leaves]
    second = [x[rows:2 * rows] for x in b_leaves] if B >= 2 * rows else first
    in_tree = tree.structure(((params, *batch), {}))

    programs: dict = {}  # rows -> the loss traced on that many rows

    def loss_on(blocks, n):
        traced = programs.get(n)
        if traced is None:
            avals = [typeof(x) for x in p_leaves] + [
                ArrayType((n,) + tuple(typeof(x).shape[1:]), typeof(x).dtype)
                for x in b_leaves]
            with context.counted(context.shard_annotations):
                if devices > 1:
                    with context.counted(context.shard_depth), \
                            context.pushed(context.shard_devices, devices):
                        traced = trace_fun(lambda p, *b: loss_fn(p, *b), in_tree, avals)
                else:
                    traced = trace_fun(lambda p, *b: loss_fn(p, *b), in_tree, avals)
            programs[n] = traced
        out = eval_program(traced.program, *traced.consts, *p_leaves, *blocks)[0]
        return float(np.asarray(out.asnumpy() if hasattr(out, "asnumpy") else out))

    la, lb = loss_on(first, rows), loss_on(second, rows)
    both = loss_on([concat([a, b], 0) for a, b in zip(first, second)], 2 * rows)
    mean, total = (la + lb) / 2, la + lb
    scale = max(abs(la), abs(lb), abs(both))
    tol = 1e-4 * scale + 1e-30
    is_mean, is_sum = abs(both - mean) <= tol, abs(both - total) <= tol
    if is_mean != is_sum:
        return "mean" if is_mean else "sum"
    why = ("the loss is zero on these rows, so they cannot tell" if is_mean else
           f"it is neither: L(a) = {la:.6g}, L(b) = {lb:.6g}, L(a; b) = {both:.6g}")
    raise ArgumentError(
        f"AutoParallel({name}).pipeline: a pipeline computes the loss per micro-batch of "
        f"{rows} rows and combines the micro-batch losses by their mean (a loss that is a "
        "mean over the examples) or their sum (a sum over the examples divided by a "
        f"constant); on two blocks a, b of the batch {why}, so no combination gives the "
        "unpipelined loss.\nFix: write the loss as a mean over the batch (or a sum "
        "divided by a constant), or train without pipeline(...).")


#: The largest step (in equations, estimated) compiled as one program on a virtual mesh.
FUSE_LIMIT = 1000


class _Device:
    """What one device holds during a step."""

    def __init__(self, rank: int, stage: int, j: int):
        self.rank, self.stage, self.j = rank, stage, j
        self.saved: dict = {}      # (chunk, m) -> the chunk's input, kept until B
        self.inbox: dict = {}      # ("F"|"B", chunk, m) -> values
        self.outbox: dict = {}     # "F"|"B" -> (chunk, m, values)
        self.sums: dict = {}       # chunk -> its parameters' gradient sums
        self.loss = None           # the last chunk's running loss sum
        self.peak_saved = 0        # most chunk inputs kept at once (activation memory)
        self.peak_saved_bytes = 0
        self.busy = 0.0            # seconds computing (measured with profile=True)


class PipelinedStep:
    """One configuration's step: the schedule's program order run over the compiled
    chunk programs, then one compiled ``finish`` (reduce, optimizer update)."""

    def __init__(self, runner, plan: Stages, schedule: Schedule, rank: int | None,
                 sharding: StageSharding | None = None, combine: str = "mean",
                 zero=None, state=None):
        self.runner, self.plan, self.schedule = runner, plan, schedule
        cfg = runner.cfg
        self.S, self.M = cfg.stages, cfg.micro_batches
        self.dp = runner.ap.n_devices // self.S  # devices per stage
        self.rank = rank  # None: a virtual mesh (every device here)
        self.sliced = runner.sliced
        #: Operator parallelism inside the stages (None: data parallelism, each device
        #: of a stage running whole chunks on its rows).
        self.sharding = sharding
        #: The data-parallel replicas the pipeline runs itself: a stage's devices, or
        #: one when each stage's programs are sharded over its devices.
        self.groups = 1 if sharding is not None else self.dp
        #: How the micro-batch losses make the batch's (``loss_combination``): their
        #: mean (a loss that is a mean over the examples) or their sum (a sum over the
        #: examples divided by a constant); the last chunk's seed and the loss scale.
        self.combine = combine
        #: Float16 reductions (the replicas' gradient and loss sums) run in float32:
        #: ``enable_fp32_communication()`` or MindSpore's default gradient fp32 sync,
        #: as in a step without a pipeline.
        self.fp32 = runner.fp32
        self.loss_scale = 1.0 / (self.M * self.groups) if combine == "mean" else 1.0
        self.order = schedule.timeline().program_order()
        self.pad = max([sum(a.size for a in plan.carry_avals(b))
                        for b in range(plan.n_chunks - 1)], default=0)
        self.mesh = None if rank is None else Mesh((self.S, self.dp), ("pp", "dp"))
        self._transfers: dict = {}
        self._gather = None  # the batch from the processes' slices (sharded stages)
        self._gather_all = None  # (types, program): gather's (a job's split state)
        self._whole = None
        #: The split counts of the state inside the stages
        #: (``AutoParallel._pipeline_zero``): ZeRO's, and a sharded stage's
        #: tensor-parallel blocks; or None (every leaf whole). The update's programs
        #: are then sharded over the stage's devices, each leaf split as its counts say
        #: (``StageUpdate``; ``_make_zero_finish`` for an update that runs whole).
        self.zero = zero
        self._grad_vars: list = []
        #: The optimizer update split by stage (``StageUpdate``: each stage's devices
        #: update only their own parameters and state), or why it runs whole on every
        #: device (a string).
        self.split = self._split(state)
        if not isinstance(self.split, StageUpdate) and runner.ap.options.hsdp is None:
            # an update that runs whole runs on whole leaves (one program per optimizer
            # shared by every pipeline): a sharded stage's blocks are kept by the
            # stage-by-stage update only
            self.zero = None
        self.finish = (None if isinstance(self.split, StageUpdate) else
                       self._make_finish() if self.zero is None
                       else self._make_zero_finish(state))
        #: In a job whose stages keep their state in tensor-parallel blocks: each split
        #: parameter, gradient sum and optimizer-state leaf of this process's stage is
        #: its block (an ``fs.ShardedArray`` over the stage's processes), which the
        #: stage's programs take and return as it is.
        self.blocks = (rank is not None and self.zero is not None
                       and isinstance(self.split, StageUpdate))
        #: With ``profile = True`` (pieces only) each computation is waited for and
        #: timed; ``stats`` then holds, per device of this process, the busy seconds
        #: and the peak number and bytes of kept stage inputs of the last step.
        self.profile = False
        self.stats: list = []
        #: On CPU, wait for each running loss sum (the last chunk's forward, a program
        #: with one output, which ``fs.jit`` does not wait for): MindSpore 2.10's CPU
        #: runtime runs the next program slowly while an input of it is still being
        #: computed. Measured on the GPT decoder's 2-stage step (docs/performance.md,
        #: "Where a pipelined step's time goes"): 2x faster at the median. The wait
        #: reads one scalar.
        self._wait_loss = device_target() == "CPU"

    # -- one step ------------------------------------------------------------------
    @property
    def fused(self) -> bool:
        """On a virtual mesh a small step is compiled whole (one program: the per-call
        cost of many small programs would dominate); a large one runs as its compiled
        pieces (compiling thousands of equations at once costs more than it saves)."""
        if self.rank is not None:
            return False
        size = sum(len(eqs) for eqs in self.plan.chunk_eqs) * 4 * self.M * self.groups
        return size <= FUSE_LIMIT

    def __call__(self, state, *batch):
        if not self.fused or self.profile:
            return self._run(state, *batch)
        if self._whole is None:
            def whole(params, opt_state, step, *b):
                return self._run(self.runner.state_cls(params, opt_state, step), *b)

            whole.__name__ = f"pipelined_step_{self.plan.name}"
            self._whole = jit(whole)
        return self._whole(state.params, state.opt_state, state.step, *batch)

    def _run(self, state, *batch):
        plan, S, M, dp, groups = self.plan, self.S, self.M, self.dp, self.groups
        if self.rank is not None and isinstance(self.split, StageUpdate):
            self._check_kept(state)
        if self.blocks:  # (a whole leaf, as ap.init gives it: cut, no communication)
            state = self._place_blocks(state)
        p_leaves, p_tree = tree.flatten(state.params)
        b_leaves = tree.leaves(list(batch))
        sliced = self.sliced
        if sliced and self.sharding is not None:
            # a stage's sharded programs take the whole micro-batch: gather the slices
            b_leaves = self._gather_slices(b_leaves)
            sliced = False
        B = typeof(b_leaves[0]).shape[0]
        # device j's part of the batch: its process's slice, or block j of dp of the
        # whole batch (as a job's slices lay it out); micro-batch m is block m of M of it
        part = B if sliced else B // groups
        rows = part // M
        # (with sharded stages, one "device" per stage runs the stage's programs)
        ranks = range(0, S * dp, dp // groups) if self.rank is None else [self.rank]
        devices = [_Device(r, r // dp, (r % dp) % groups) for r in ranks]
        loss_dtype = dtypes.to_numpy(plan.program.outputs[0].aval.dtype)
        seed = [np.asarray(self.loss_scale, loss_dtype)]
        slices: dict = {}

        def micro(m, j):
            key = (m, j)
            if key not in slices:
                lo = (0 if sliced else j * part) + m * rows
                slices[key] = [x[lo:lo + rows] for x in b_leaves]
            return slices[key]

        for item in self.order:
            if isinstance(item, Event):
                for d in devices:
                    if d.stage == item.stage:
                        t0 = time.perf_counter() if self.profile else 0.0
                        made = self._compute(d, item.action, p_leaves, micro, seed,
                                             loss_dtype)
                        if self.profile:
                            _wait(made)
                            d.busy += time.perf_counter() - t0
            else:
                self._transfer(item, devices)
        self.stats = [{"rank": d.rank, "stage": d.stage, "busy_s": d.busy,
                       "peak_saved": d.peak_saved, "peak_saved_bytes": d.peak_saved_bytes}
                      for d in devices]
        return self._finish(devices, state, p_leaves, p_tree, loss_dtype)

    def _compute(self, d: _Device, a, p_leaves, micro, seed, loss_dtype):
        plan, S = self.plan, self.S
        c, m = a.chunk, a.micro_batch
        pv = [p_leaves[i] for i in plan.chunk_params[c]]
        last = c == plan.n_chunks - 1
        if a.kind == "F":
            carry = d.inbox.pop(("F", c, m)) if c else []
            d.saved[(c, m)] = carry
            d.peak_saved = max(d.peak_saved, len(d.saved))
            d.peak_saved_bytes = max(d.peak_saved_bytes, _saved_bytes(d.saved, micro, d.j))
            if last:
                if d.loss is None:
                    d.loss = np.zeros((), loss_dtype)
                d.loss = plan.forward_fn(c, self.sharding)(pv, carry, micro(m, d.j), d.loss)
                if self._wait_loss and not isinstance(d.loss, Tracer):  # (run as pieces)
                    _wait([d.loss])
                return [d.loss]
            out = list(plan.forward_fn(c, self.sharding)(pv, carry, micro(m, d.j)))
            self._send(d, "F", c + 1, m, out)
            return out
        ct = seed if last else d.inbox.pop(("B", c, m))
        sums = d.sums.get(c)
        if sums is None:
            # (in blocks: each process's block of zeros, the layout the backward keeps)
            split = self.blocks and plan.split_counts(c, self.sharding)
            sums = [self._zeros(typeof(x), self.sharding.params[i] if split else None)
                    for i, x in zip(plan.chunk_params[c], pv)]
        sums, g_carry = plan.backward_fn(c, self.sharding, self.blocks)(
            pv, d.saved.pop((c, m)), micro(m, d.j), ct, sums)
        d.sums[c] = list(sums)
        if c:
            self._send(d, "B", c - 1, m, list(g_carry))
        return d.sums[c]

    def _send(self, d: _Device, kind: str, chunk: int, m: int, values):
        if chunk % self.S == d.stage:  # the chunk is on this device too
            d.inbox[(kind, chunk, m)] = values
        else:
            d.outbox[kind] = (chunk, m, values)

    # -- transfers -----------------------------------------------------------------
    def _transfer(self, rnd, devices):
        """One round: activations one stage on, cotangents one stage back."""
        S, dp = self.S, self.dp
        for kind, moves in (("F", rnd.forward), ("B", rnd.backward)):
            if not moves:
                continue
            if self.rank is None:  # a virtual mesh: hand the values over
                by_rank = {d.rank: d for d in devices}
                step = dp // self.groups
                for src, dst, _, _ in moves:
                    for j in range(0, dp, step):
                        chunk, m, vals = by_rank[src * dp + j].outbox.pop(kind)
                        by_rank[dst * dp + j].inbox[(kind, chunk, m)] = vals
                continue
            (d,) = devices
            # (an action still running at this round may have filled the outbox already:
            # its value goes in the round at its end)
            sending = (d.outbox.pop(kind)
                       if any(src == d.stage for src, _, _, _ in moves) else None)
            recv = [(chunk, m) for src, dst, chunk, m in moves if dst == d.stage]
            boundary = None
            if recv:
                boundary = recv[0][0] - 1 if kind == "F" else recv[0][0]
            send_b = None
            if sending is not None:
                send_b = sending[0] - 1 if kind == "F" else sending[0]
            fn = self._transfer_fn(kind, send_b, boundary)
            got = fn(list(sending[2]) if sending is not None else [])
            if recv:
                d.inbox[(kind,) + recv[0]] = list(got[1:])

    def _transfer_fn(self, kind: str, send_b, recv_b):
        """Compiled: pack what this stage sends (the carry of boundary ``send_b``) into
        one float32 buffer, ``ppermute`` it over ``pp``, unpack what it receives."""
        key = (kind, send_b, recv_b)
        fn = self._transfers.get(key)
        if fn is not None:
            return fn
        S, pad, mesh, plan = self.S, self.pad, self.mesh, self.plan
        shift = 1 if kind == "F" else -1
        perm = tuple((s, (s + shift) % S) for s in range(S))

        def transfer(values):
            with C.named_axis("pp", S), C.named_axis("dp", self.dp):
                buf = _pack(values, pad) if values else np.zeros((pad,), np.float32)
                got = C.ppermute_p.bind(buf, axis_name=("pp",), axis_sizes=(S,), perm=perm,
                                        mesh=mesh)
                # the buffer is an output even where nothing is received: a dropped
                # collective on one rank would pair the next one with the wrong round
                return [got] + ([] if recv_b is None else _unpack(got, plan.carry_avals(recv_b)))

        transfer.__name__ = f"pipeline_{'activations' if kind == 'F' else 'cotangents'}"
        fn = self._transfers[key] = jit(transfer)
        return fn

    def _gather_slices(self, b_leaves) -> list:
        """The whole batch from each process's slice (in a job with sharded stages):
        one AllGather per batch input over the stage's processes, in rank order."""
        if self._gather is None:
            S, dp, mesh = self.S, self.dp, self.mesh

            def gather(xs):
                with C.named_axis("pp", S), C.named_axis("dp", dp):
                    return [C.all_gather_p.bind(x, axis_name=("dp",), axis_sizes=(dp,),
                                                axis=0, mesh=mesh) for x in xs]

            gather.__name__ = f"pipeline_batch_{self.plan.name}"
            self._gather = jit(gather)
        return list(self._gather(list(b_leaves)))

    # -- reduce and update -----------------------------------------------------------
    def _finish(self, devices, state, p_leaves, p_tree, loss_dtype):
        plan = self.plan
        n_p = len(p_leaves)
        grads: list = [None] * n_p
        loss = None
        # (in a job one device: nothing to sum, and a block is not widened eagerly)
        fp32 = self.fp32 and self.rank is None
        wide = _widen if fp32 else (lambda x: x)
        if self.zero is not None and self.rank is None:
            return self._finish_zero(devices, state, p_leaves, loss_dtype)
        for d in devices:  # (a virtual mesh: the data-parallel replicas summed here)
            for c, sums in d.sums.items():
                for i, g in zip(plan.chunk_params[c], sums):
                    grads[i] = wide(g) if grads[i] is None else grads[i] + wide(g)
            if d.loss is not None:
                loss = wide(d.loss) if loss is None else loss + wide(d.loss)
        if fp32:  # (summed in float32, rounded once)
            grads = [g if g is None else cast(g, typeof(x).dtype)
                     for g, x in zip(grads, p_leaves)]
            loss = None if loss is None else cast(loss, loss_dtype)
        job_split = self.rank is not None and isinstance(self.split, StageUpdate)
        # (in a job, the parameters of other stages get their gradients from them; with
        # the update split by stage this process needs its own stage's alone)
        own = set(self.split.p_idx[self.rank // self.dp]) if job_split else None
        for i, x in enumerate(p_leaves):
            if grads[i] is None and (own is None or i in own):
                grads[i] = np.zeros(typeof(x).shape, dtypes.to_numpy(typeof(x).dtype))
        if loss is None:
            loss = np.zeros((), loss_dtype)
        scale = np.asarray(self.loss_scale, loss_dtype)
        if job_split:  # this process updates its own stage's leaves only
            return self._finish_job(state, grads, loss, scale)
        if isinstance(self.split, StageUpdate):  # each stage updates its own leaves
            o_leaves, o_tree = tree.flatten(state.opt_state)
            new_p, new_o, step, out = self.split(p_leaves, grads, o_leaves, state.step,
                                                 loss, scale)
            return (self.runner.state_cls(tree.unflatten(p_tree, new_p),
                                          tree.unflatten(o_tree, new_o), step), out)
        new_p, new_o, step, out, *norms = self.finish(
            state.params, state.opt_state, state.step, tree.unflatten(p_tree, grads), loss,
            scale)
        return (self.runner.state_cls(new_p, new_o, step), out, *norms)

    def gather(self, state, params_only: bool = False):
        """``state`` (of this step's structure) with every stage's leaves (or its
        parameters) on every process: ``PipelineRunner.gather``."""
        up, dp = self.split, self.dp
        stage = self.rank // dp
        p_leaves, p_tree = tree.flatten(state.params)
        o_leaves, o_tree = tree.flatten(state.opt_state)
        owner = {("p", i): s for s, idx in up.p_idx.items() for i in idx}
        if not params_only:
            owner.update({("o", k): s for s, idx in up.o_idx.items() if s is not None
                          for k in idx})
        keys = sorted(owner)  # (the same order on every process)
        leaves = {("p", i): x for i, x in enumerate(p_leaves)}
        leaves.update({("o", k): x for k, x in enumerate(o_leaves)})
        avals = [typeof(leaves[k]) for k in keys]
        if self._gather_all is None or self._gather_all[0] != avals:
            mesh = Mesh((self.S, dp), ("pp", "dp"))

            def gather_state(values):
                return [C.psum_p.bind(v, axis_name=("pp", "dp"), mesh=mesh) for v in values]

            gather_state.__name__ = f"pipeline_gather_{self.plan.name}"
            self._gather_all = (avals, jit(gather_state))
        values = []
        for k, a in zip(keys, avals):
            x = leaves[k]
            if owner[k] == stage and isinstance(x, ShardedArray):
                # a tensor-parallel stage's block: each block given once (by the lowest
                # of the stage's processes holding it), in place in zeros
                values.append(self._block_in_zeros(x))
                continue
            give = owner[k] == stage and self.rank == stage * dp
            if give and isinstance(x, RemoteArray):
                x.refuse(f"AutoParallel({self.runner.ap.name}).gather(state)")
            values.append(x if give else np.zeros(a.shape, dtypes.to_numpy(a.dtype)))
        got = self._gather_all[1](values) if values else []
        for k, x in zip(keys, got):
            leaves[k] = x
        return self.runner.state_cls(
            tree.unflatten(p_tree, [leaves[("p", i)] for i in range(len(p_leaves))]),
            tree.unflatten(o_tree, [leaves[("o", k)] for k in range(len(o_leaves))]),
            state.step)

    def _block_in_zeros(self, x: ShardedArray):
        """``x``'s global shape, zeros but for this process's block, if it is the
        lowest of its stage's processes holding that block (all zeros otherwise): the
        sum over the job of every process's is the global value."""
        base = self.rank - self.rank % self.dp
        first = next(r for r in range(base, base + self.dp)
                     if block_bounds(x.sharding, x.mesh, r, x.shape) == x.bounds)
        out = np.zeros(x.shape, dtypes.to_numpy(x.dtype))
        if first == self.rank:
            out[tuple(slice(s, e) for s, e in x.bounds)] = x.block.asnumpy()
        return out

    def _check_kept(self, state) -> None:
        """In a job whose update is split by stage: this process's stage's leaves and
        the unowned ones must be here (not ``fs.RemoteArray``). Checked before the
        step's first computation, so that processes given such a state all stop there
        instead of some waiting in a collective."""
        up = self.split
        stage = self.rank // self.dp
        p_paths, p_leaves, _ = tree.flatten_with_path(state.params)
        o_paths, o_leaves, _ = tree.flatten_with_path(state.opt_state)
        for what, paths, leaves, idx in (
                ("params", p_paths, p_leaves, up.p_idx[stage]),
                ("opt_state", o_paths, o_leaves, up.o_idx[stage] + up.o_idx[None])):
            for i in idx:
                x = leaves[i]
                if isinstance(x, RemoteArray):
                    raise ArgumentError(
                        f"AutoParallel({self.runner.ap.name})(state, *batch): "
                        f"state.{what}{tree.keystr(paths[i])} is an fs.RemoteArray (kept "
                        f"by stage {x.stage}'s processes {list(x.holders)}), but this "
                        f"process (rank {self.rank}) is stage {stage}'s, which keeps and "
                        "updates that leaf.\nFix: pass each process the state its own "
                        "previous step returned (or the whole state: ap.init(params), "
                        "ap.gather(state)).")

    def _finish_job(self, state, grads, loss, scale):
        """The update split by stage in a multi-process job: this process's program
        (``StageUpdate.job_program``) takes its stage's gradients, parameters and
        optimizer state and the leaves no stage owns, and returns their new values; the
        other stages' leaves of the new state are ``fs.RemoteArray`` leaves (their
        processes keep them)."""
        up, dp, cfg = self.split, self.dp, self.runner.cfg
        stage = self.rank // dp
        p_leaves, p_tree = tree.flatten(state.params)
        o_leaves, o_tree = tree.flatten(state.opt_state)
        mine_p, mine_o, shared = up.p_idx[stage], up.o_idx[stage], up.o_idx[None]
        last = (self.plan.n_chunks - 1) % self.S
        if self.blocks:  # (the stage's update on this process's blocks)
            fn = up.job_blocks_program(stage, dp, last, cfg.output_broadcast, self.plan.name)
        else:
            fn = up.job_program(stage, dp, last, cfg.output_broadcast, self.groups > 1,
                                self.fp32, self.plan.name)
        new_p, new_o, new_shared, step, out = fn(
            [grads[i] for i in mine_p], [o_leaves[k] for k in mine_o],
            [o_leaves[k] for k in shared], [p_leaves[i] for i in mine_p], state.step,
            loss, scale)

        def remote(x, s):  # (a leaf of stage s: its processes keep it)
            if isinstance(x, RemoteArray) and x.stage == s:
                return x
            a = typeof(x)
            return RemoteArray(a.shape, a.dtype, s, range(s * dp, (s + 1) * dp), self.rank)

        p_out = [None] * len(p_leaves)
        o_out = [None] * len(o_leaves)
        for s, idx in up.p_idx.items():
            for i in idx:
                p_out[i] = remote(p_leaves[i], s)
        for s, idx in up.o_idx.items():
            for k in idx:
                o_out[k] = o_leaves[k] if s is None else remote(o_leaves[k], s)
        for i, x in zip(mine_p, new_p):
            p_out[i] = x
        for k, x in zip(mine_o, new_o):
            o_out[k] = x
        for k, x in zip(shared, new_shared):
            o_out[k] = x
        return (self.runner.state_cls(tree.unflatten(p_tree, p_out),
                                      tree.unflatten(o_tree, o_out), step), out)

    def _place_blocks(self, state):
        """``state`` with each whole leaf of this process's stage that its counts split
        cut to this process's block (``fs.ShardedArray.cut``: no communication), as the
        steps return it, so the first step runs the programs of every later one."""
        p_counts, _, o_counts = self.zero
        stage = self.rank // self.dp
        p_leaves, p_tree = tree.flatten(state.params)
        o_leaves, o_tree = tree.flatten(state.opt_state)
        p_leaves, o_leaves = list(p_leaves), list(o_leaves)
        for i in self.split.p_idx[stage]:
            p_leaves[i] = self._block(p_leaves[i], p_counts[i])
        for k in self.split.o_idx[stage]:
            o_leaves[k] = self._block(o_leaves[k], o_counts[k])
        return self.runner.state_cls(tree.unflatten(p_tree, p_leaves),
                                     tree.unflatten(o_tree, o_leaves), state.step)

    def _block(self, x, counts):
        if counts is None or math.prod(counts) == 1 or isinstance(
                x, (ShardedArray, RemoteArray, Tracer)):
            return x
        return ShardedArray.cut(x, tuple(counts), ShardMesh.for_devices(self.dp), self.rank)

    def _zeros(self, aval, counts):
        """Zeros of type ``aval``: whole, or with split ``counts`` this process's block
        of them (an ``fs.ShardedArray`` over its stage's processes)."""
        dt = dtypes.to_numpy(aval.dtype)
        if counts is None or math.prod(counts) == 1:
            return np.zeros(aval.shape, dt)
        mesh = ShardMesh.for_devices(self.dp)
        sh = parse_strategy(tuple(counts), aval, mesh, "the gradient sums' strategy")
        return ShardedArray(as_tensor(np.zeros(sh.local_shape(aval.shape, mesh), dt)),
                            aval.shape, aval.dtype, sh, mesh, self.rank)

    def _split(self, state):
        """The optimizer update split by stage (``split_update``, shared by every
        pipeline with the same optimizer, state and stages), or why each device runs
        the whole update."""
        ap = self.runner.ap
        if ap.options.local_norm:
            return "device-local norms are taken over the whole gradient"
        stage_of = {i: c % self.S for c, owned in enumerate(self.plan.chunk_params)
                    for i in owned}
        opt_update = ap.step_optimizer().update
        frozen = ap._frozen()
        zero = None if self.zero is None else (self.dp, self.groups, *self.zero, self.fp32)
        key = ("stages", self.S, tuple(sorted(stage_of.items())), tuple(sorted(frozen)),
               tree.structure((state.params, state.opt_state)),
               tuple((tuple(typeof(x).shape), typeof(x).dtype)
                     for x in tree.leaves((state.params, state.opt_state))),
               None if zero is None else _exact(zero))
        try:
            per_opt = _FINISHES.setdefault(opt_update, {})
        except TypeError:  # not weak-referenceable: split for this step alone
            per_opt = {}
        hit = per_opt.get(key)
        if hit is None:
            hit = per_opt[key] = split_update(opt_update, state, stage_of, self.S, frozen,
                                              self.plan.name, zero)
        return hit

    def _finish_zero(self, devices, state, p_leaves, loss_dtype):
        """The finish with ZeRO (a virtual mesh): each parameter's gradient goes in as
        its stage's replicas' sums stacked, ``(replicas, *shape)``, each replica's on its
        own device, so the sharded finish reduces them over the stage's devices as
        ZeRO's level says (an AllReduce, or a reduce-scatter to the state's blocks)."""
        plan = self.plan
        parts: list = [[] for _ in p_leaves]
        loss = None
        for d in devices:  # stage-major, replica j ascending
            for c, sums in d.sums.items():
                for i, g in zip(plan.chunk_params[c], sums):
                    parts[i].append(reshape(g, (1,) + tuple(typeof(g).shape)))
            if d.loss is not None:  # (float16 summed in float32 with fp32 reductions)
                mine = _widen(d.loss) if self.fp32 else d.loss
                loss = mine if loss is None else loss + mine
        parts = [p[0] if len(p) == 1 else concat(p, 0) for p in parts]
        if loss is None:
            loss = np.zeros((), loss_dtype)
        elif self.fp32:
            loss = cast(loss, loss_dtype)
        scale = np.asarray(self.loss_scale, loss_dtype)
        if isinstance(self.split, StageUpdate):  # each stage updates its own leaves
            p_leaves, p_tree = tree.flatten(state.params)
            o_leaves, o_tree = tree.flatten(state.opt_state)
            new_p, new_o, step, out = self.split(p_leaves, parts, o_leaves, state.step,
                                                 loss, scale)
            return (self.runner.state_cls(tree.unflatten(p_tree, new_p),
                                          tree.unflatten(o_tree, new_o), step), out)
        new_p, new_o, step, out, *norms = self.finish(
            state.params, state.opt_state, state.step, parts, loss, scale)
        return (self.runner.state_cls(new_p, new_o, step), out, *norms)

    def _zero_views(self, state):
        """The finish's layouts: per parameter, optimizer-state and gradient leaf, a
        layout over the ``(pp, dp)`` devices splitting it over its stage's devices as
        ZeRO's counts say (whole where they are None), and per stacked gradient the
        split of its replicas over the stage's devices."""
        S, dp, groups = self.S, self.dp, self.groups
        p_counts, g_counts, o_counts = self.zero
        p_leaves, p_tree = tree.flatten(state.params)
        o_leaves, o_tree = tree.flatten(state.opt_state)

        def views(counts, leaves):
            return [_stage_view(c if c is not None else (1,) * typeof(x).ndim, S, dp)
                    for c, x in zip(counts, leaves)]

        stacked = [_stage_view((groups,) + (1,) * typeof(x).ndim, S, dp) for x in p_leaves]
        return (tree.unflatten(p_tree, views(p_counts, p_leaves)),
                tree.unflatten(o_tree, views(o_counts, o_leaves)),
                views(g_counts, p_leaves), stacked)

    def _make_zero_finish(self, state):
        """The finish as one program sharded over the ``S * dp`` devices (a virtual
        mesh): the parameters (level3), their gradients (level2) and the optimizer
        state (level1) split over each stage's devices, the optimizer traced whole (so
        an optimizer that couples the parameters, a global-norm clip, stays exact: the
        plan adds the collectives)."""
        ap, plan = self.runner.ap, self.plan
        p_views, o_views, g_views, stacked = self._zero_views(state)
        opt_update = ap.step_optimizer().update
        norms = ap._local_norms if ap.options.local_norm else None
        g_tree = tree.structure(state.params)
        grad_vars = self._grad_vars

        def finish(params, opt_state, step, parts, loss_sum, scale):
            # each gradient: its replicas' sum, laid out as ZeRO's level says (whole at
            # level1: an AllReduce, the update slicing it; split from level2: each
            # device reduces only its block)
            g_leaves = [with_sharding_constraint(p.sum(axis=0), v)
                        for p, v in zip(parts, g_views)]
            grad_vars[:] = [getattr(g, "ir_var", None) for g in g_leaves]
            grads = tree.unflatten(g_tree, g_leaves)
            updates, new_opt = opt_update(grads, opt_state, params)
            out = (apply_updates(params, updates), new_opt, step + 1, loss_sum * scale)
            return out + _local_norms(norms, ap._frozen(), params, grads)

        finish.__name__ = f"pipeline_finish_{plan.name}"
        s = shard(finish, in_strategy=(p_views, o_views, (), stacked, (), ()),
                  out_strategy=(p_views, o_views, (), ()) + ((None,) if norms else ()),
                  mesh=Mesh((self.S, self.dp), ("pp", "dp"), virtual=True), level=2,
                  search=False, dataset_strategy="full_batch")
        s.search = "follow_inputs"  # (the layouts are given: no search)
        if self.fp32:
            s.passes = (reduce_in_float32,)
        self.finish_sharded = s
        return jit(s)

    def finish_args(self, state) -> tuple:
        """The finish's arguments as types (for its per-device program)."""
        loss = ArrayType((), self.plan.program.outputs[0].aval.dtype)
        parts = [ArrayType((self.groups,) + tuple(typeof(x).shape), typeof(x).dtype)
                 for x in tree.leaves(state.params)]
        return (state.params, state.opt_state, state.step, parts, loss, loss)

    def operator_strategies(self, state) -> dict:
        """The operator strategies of the step's sharded programs: per stage, each of its
        chunks' forward and backward (``fs.shard``'s strategies, over the stage's
        devices), and, with ZeRO, its update program's (``"finish"``; one ``"finish"``
        over all the devices when the update runs whole). Refused
        when the stages are data parallel (their programs have no strategies)."""
        ap, plan = self.runner.ap, self.plan
        if self.sharding is None:
            raise ArgumentError(
                f"AutoParallel({ap.name}).save_operator_strategy_file: with "
                f"pipeline(stages={self.S}) each stage's programs run data parallel over "
                "its devices (no parameter_plan and no operator strategy in the loss), so "
                "they have no operator strategies to write.\nFix: give parameter_plan(...) "
                "(or Primitive.shard strategies in the loss) for strategies inside the "
                "stages, save_param_strategy_file(path) for each parameter's stage, or "
                "save the operator strategies without the pipeline (pipeline(stages=1)).")
        p_leaves = tree.leaves(state.params)
        batch = [v.aval for v in plan.batch_vars]
        loss = ArrayType((), plan.program.outputs[0].aval.dtype)
        stages = [{"stage": s, "devices": self.dp, "chunks": []} for s in range(self.S)]
        for c in range(plan.n_chunks):
            last = c == plan.n_chunks - 1
            pv = [typeof(p_leaves[i]) for i in plan.chunk_params[c]]
            carry = plan.carry_avals(c - 1) if c else []
            ct = [loss] if last else plan.carry_avals(c)
            fwd = plan.forward_fn(c, self.sharding).sharded
            bwd = plan.backward_fn(c, self.sharding).sharded
            stages[c % self.S]["chunks"].append({
                "chunk": c,
                "forward": fwd.strategies(pv, carry, batch, *((loss,) if last else ())),
                "backward": bwd.strategies(pv, carry, batch, ct, pv)})
        out = {"format": "fshard-pipeline-operator-strategy", "devices": ap.n_devices,
               "stages": stages}
        if isinstance(self.split, StageUpdate) and self.zero is not None:
            # each stage's own update program (over its devices)
            for s, st in enumerate(stages):
                fn = self.split.fns.get(s)
                if fn is not None:
                    st["finish"] = fn.sharded.strategies(fn.in_avals)
        elif self.zero is not None:
            out["finish"] = self.finish_sharded.strategies(*self.finish_args(state))
        return out

    def memory_report(self, state) -> dict:
        """Bytes per device of the trained state as the finish lays it out, and, in
        ``"stages"``, of each stage's own parameters (and the optimizer-state leaves
        that copy them). With the update split by stage (``"update": "per_stage"``) a
        device keeps its own stage's state and the leaves no stage owns (Adam's step
        count): the totals are the most any device keeps of each. Otherwise
        (``"update": "whole"``, ``"whole_because"`` says why) every device keeps every
        stage's state, whole, or with ZeRO split over its stage's devices. With sharded
        stages, ``"stage_state"``: ``"blocks"`` (a stage's devices keep its leaves in
        their strategies' blocks) or ``"whole"`` (``"stage_state_because"`` says why)."""
        p_leaves = tree.leaves(state.params)
        o_leaves = tree.leaves(state.opt_state)
        stage_of = {i: c % self.S for c, owned in enumerate(self.plan.chunk_params)
                    for i in owned}

        def nbytes(x):
            a = typeof(x)
            return int(a.size * np.dtype(dtypes.to_numpy(a.dtype)).itemsize)

        if self.zero is None:
            p_b = [nbytes(x) for x in p_leaves]
            g_b = list(p_b)
            o_b = [nbytes(x) for x in o_leaves]
        elif isinstance(self.split, StageUpdate):
            # each stage's programs take their leaves split by ZeRO's counts over the
            # stage's devices (fs.shard's in_strategy), a gradient as its level says
            def split(x, counts):
                return nbytes(x) // (math.prod(counts) if counts else 1)

            p_counts, g_counts, o_counts = self.zero
            p_b = [split(x, c) for x, c in zip(p_leaves, p_counts)]
            g_b = [split(x, c) for x, c in zip(p_leaves, g_counts)]
            o_b = [split(x, c) for x, c in zip(o_leaves, o_counts)]
        else:
            args = self.finish_args(state)
            part = self.finish_sharded.partitioned(*args)
            prop, mesh = part.prop, part.prop.mesh
            # (the program's first inputs may be constants its tracing captured)
            n_args = len(tree.leaves(args))
            ins = prop.program.inputs[len(prop.program.inputs) - n_args:]
            shs = list(part.in_shardings)[len(part.in_shardings) - n_args:]
            n_p, n_o = len(p_leaves), len(o_leaves)
            p_b = [local_bytes(sh, v.aval, mesh) for v, sh in zip(ins[:n_p], shs[:n_p])]
            o_b = [local_bytes(sh, v.aval, mesh) for v, sh in
                   zip(ins[n_p:n_p + n_o], shs[n_p:n_p + n_o])]
            g_b = [local_bytes(prop.shardings.get(g, Sharding.replicated(g.aval.ndim)),
                               g.aval, mesh) for g in self._grad_vars]
        o_stage = _copies_stage(state, stage_of, self.runner.ap._frozen())
        stages = [{"params": sum(b for i, b in enumerate(p_b) if stage_of.get(i, 0) == s),
                   "grads": sum(b for i, b in enumerate(g_b) if stage_of.get(i, 0) == s),
                   "optimizer_state": sum(b for k, b in enumerate(o_b) if o_stage[k] == s)}
                  for s in range(self.S)]
        blocks = {}
        if self.sharding is not None:
            # a sharded stage's state: in tensor-parallel blocks, or whole and why
            why = self._whole_blocks_because(state)
            blocks = ({"stage_state": "blocks"} if why is None else
                      {"stage_state": "whole", "stage_state_because": why})
        if isinstance(self.split, StageUpdate):
            shared = sum(o_b[k] for k in self.split.o_idx[None])
            return {"params": max(st["params"] for st in stages),
                    "grads": max(st["grads"] for st in stages),
                    "optimizer_state": max(st["optimizer_state"] for st in stages) + shared,
                    "stages": stages, "update": "per_stage", **blocks}
        return {"params": sum(p_b), "grads": sum(g_b), "optimizer_state": sum(o_b),
                "stages": stages, "update": "whole", "whole_because": self.split, **blocks}

    def _whole_blocks_because(self, state) -> str | None:
        """Why a sharded stage's parameters and optimizer state are whole on each of its
        devices between steps, or None when they are kept in tensor-parallel blocks
        (some leaf split by its strategy)."""
        if not isinstance(self.split, StageUpdate) and self.zero is None:
            return f"the optimizer update runs whole on whole leaves: {self.split}"
        counts = [] if self.zero is None else [c for cs in self.zero for c in cs]
        if not any(c is not None and any(k > 1 for k in c) for c in counts):
            return ("no parameter has split counts in parameter_plan (strategies derived "
                    "inside the stage, or given as fs.Layout views, keep it whole)")
        return None

    def _make_finish(self):
        ap, cfg = self.runner.ap, self.runner.cfg
        S, M, dp, mesh, plan = self.S, self.M, self.dp, self.mesh, self.plan
        last = (plan.n_chunks - 1) % S  # the stage of the last chunk
        stage = None if self.rank is None else self.rank // dp
        # one program per optimizer and configuration (on a virtual mesh: one per
        # optimizer), shared by every pipeline using them; the loss scale
        # 1 / (M * replicas) is an input. Sharded stages sum over their devices inside
        # their programs already.
        reduce_dp = mesh is not None and self.groups > 1
        fp32 = self.fp32
        key = None if mesh is None else (S, dp, last, stage, cfg.output_broadcast, reduce_dp,
                                         fp32)
        opt_update = ap.step_optimizer().update
        # print_local_norm / dump_local_norm: the program also returns the norms of the
        # gradients' blocks (``AutoParallel._local_norms``: this AutoParallel's, so
        # such a program is not shared)
        norms = ap._local_norms if ap.options.local_norm else None
        try:
            per_opt = _FINISHES.setdefault(opt_update, {}) if norms is None else {}
            update = weakref.ref(opt_update)  # (the cache must not keep its key alive)
        except TypeError:  # not weak-referenceable: a program of its own
            per_opt = {}

            def update():
                return opt_update
        if key in per_opt:
            return per_opt[key]
        broadcast = cfg.output_broadcast

        def finish(params, opt_state, step, grads, loss_sum, scale):
            g_leaves, g_tree = tree.flatten(grads)
            with C.named_axis("pp", S), C.named_axis("dp", dp):
                if mesh is not None:
                    # (an update that does not split by stage, in a job) Every process
                    # gets every gradient: its stage's replicas' sums (each process
                    # holds zeros for the other stages' parameters) summed over the
                    # job. Every process then runs the whole optimizer, exact for any
                    # coupling of the parameters, and keeps the whole trained state.
                    axes = ("pp", "dp") if reduce_dp else ("pp",)
                    g_leaves = [_reduce(g, axes, mesh, fp32) for g in g_leaves]
                    if reduce_dp and stage == last:
                        loss_sum = _reduce(loss_sum, ("dp",), mesh, fp32)
                loss = loss_sum * scale
                if mesh is not None and stage != last:
                    loss = loss * np.float32(np.nan)  # there is no loss on this stage
                if mesh is not None and broadcast:
                    mine = loss if stage == last else np.zeros((), np.float32)
                    loss = C.psum_p.bind(mine, axis_name=("pp",), mesh=mesh)
            grads = tree.unflatten(g_tree, g_leaves)
            updates, new_opt = update()(grads, opt_state, params)
            out = (apply_updates(params, updates), new_opt, step + 1, loss)
            return out + _local_norms(norms, ap._frozen(), params, grads)

        finish.__name__ = f"pipeline_finish_{plan.name}"
        fn = per_opt[key] = jit(finish)
        return fn


# ---------------------------------------------------------------------------
# The optimizer update split by stage
# ---------------------------------------------------------------------------


#: Operations whose operands may come from several stages: associative and
#: commutative, so each stage can reduce its own terms and the stages' partial results
#: combine (a psum or pmax over the pipeline: a global norm's sum of squares and the
#: largest magnitude it scales by).
_REDUCIBLE = (add_p, maximum_p, minimum_p)


class _Reduction:
    """A reduction over several stages' values, pending until something else reads it:
    its operation and, per stage, the terms that stage holds; ``rep`` the terms every
    stage holds (counted once)."""

    def __init__(self, prim, params):
        self.prim, self.params = prim, params
        self.terms: dict = {}   # stage -> [its terms, in program order]
        self.rep: list = []

    def absorb(self, label, atom):
        if isinstance(label, _Reduction):
            for s, ts in label.terms.items():
                self.terms.setdefault(s, []).extend(ts)
            self.rep.extend(label.rep)
        elif label is None:
            self.rep.append(atom)
        else:
            self.terms.setdefault(label, []).append(atom)


def _fold(prim, params, values):
    out = values[0]
    for v in values[1:]:
        out = bind(prim, out, v, **params)
    return out


def _partial_post(red: "_Reduction"):
    """A stage's partial result of ``red``: its terms folded."""
    def partial(got):
        return [_fold(red.prim, red.params, got)]
    return partial


def _combine_post(red: "_Reduction"):
    """``red``'s result: the stages' partial results (the last ones given, in stage
    order) and the terms every stage holds, folded."""
    n = len(red.terms)

    def combine(got):  # (got: rep terms, then the partials)
        return [_fold(red.prim, red.params, list(got[-n:]) + got[:-n])]
    return combine


class StageUpdate:
    """The optimizer update cut into programs per stage, each reading and writing only
    its stage's parameters, gradients and optimizer state (and the state leaves no
    parameter owns, such as Adam's step count, which every stage holds), plus
    ``shared`` programs for those unowned leaves, the step count and the loss: what
    MindSpore's and Megatron-LM's stages each run on their own state.

    Found by tracing the update once leaf by leaf (``context.split_updates``) and
    labelling every value with the stage whose inputs it reads (``None``: no stage's,
    every stage computes it). A sum, maximum or minimum of several stages' values (a
    global norm's sum of squares, the largest magnitude it scales by) is a cross-stage
    reduction: each stage reduces its own terms, the partial results combine (what a
    psum or pmax over the pipeline does), and every stage holds the result. So the
    update runs in phases: per reduction, each stage's partial and their combination;
    then each stage's outputs. Every program is made of the update's own operations;
    a reduction's terms are regrouped by stage, so a float sum may round differently.
    Any other operation reading several stages' values does not split: ``split_update``
    says which."""

    def __init__(self, traced, owner_in: list, owner_out: list, roots: list, n_p: int,
                 n_o: int, S: int, name: str, zero=None):
        prog = traced.program
        self.S, self.n_p, self.n_o = S, n_p, n_o
        self._prog, self._consts = prog, list(traced.consts)
        ins = prog.inputs[prog.n_consts:]   # grads (n_p), opt state (n_o), params (n_p)
        #: ZeRO inside the stages: ``(dp, replicas, param, grad, state counts, fp32)``;
        #: each program then runs through ``fs.shard`` on its stage's ``dp`` devices,
        #: its gradients coming in as the replicas' sums stacked (``_finish_zero``).
        self.zero = zero
        self._layout: dict = {}   # input Var -> its split counts (ZeRO)
        if zero is not None:
            dp, groups, p_counts, g_counts, o_counts, _ = zero
            for i in range(n_p):
                nd = ins[i].aval.ndim
                self._layout[ins[i]] = (groups,) + (1,) * nd   # (stacked)
                self._layout[ins[n_p + n_o + i]] = p_counts[i] or (1,) * nd
            for k in range(n_o):
                self._layout[ins[n_p + k]] = o_counts[k] or (1,) * ins[n_p + k].aval.ndim
            self._grads = {ins[i]: g_counts[i] or (1,) * ins[i].aval.ndim
                           for i in range(n_p)}
        self._producer = {v: i for i, eq in enumerate(prog.equations) for v in eq.outputs}
        self._jobs: dict = {}     # a job's programs, by stage and configuration
        self.out_idx = {s: [j for j, o in enumerate(owner_out) if o == s]
                        for s in list(range(S)) + [None]}
        self.p_idx = {s: [i for i in range(n_p) if owner_in[i] == s] for s in range(S)}
        self.o_idx = {s: [k for k in range(n_o) if owner_in[n_p + k] == s]
                      for s in list(range(S)) + [None]}
        #: The cross-stage reductions, in the order they are needed: (the value, its
        #: ``_Reduction``).
        self.reductions = roots
        self._ins = ins
        self._shared_in = [ins[n_p + k] for k in self.o_idx[None]]
        self._root_vars = [v for v, _ in roots]
        shared_in, root_vars = self._shared_in, self._root_vars

        # per reduction: each stage's partial, then their combination
        self.partials, self.combines = [], []
        for k, (root, red) in enumerate(roots):
            whole = (1,) * root.aval.ndim
            self.partials.append({s: self._compile(
                self._own_in(s) + root_vars[:k], ts, _partial_post(red),
                f"{name}_stage{s}_partial{k}", out=[whole])
                for s, ts in sorted(red.terms.items())})
            self.combines.append(self._compile(
                shared_in + root_vars[:k], red.rep, _combine_post(red), f"{name}_combine{k}",
                extra=[whole] * len(red.terms), out=[whole]))
        self.fns = {}
        for s in range(S):
            fn = self._stage_program(s, name)
            if fn is not None:  # (a stage without trained parameters has nothing to update)
                self.fns[s] = fn
        self.fns[None] = self._shared_program(name)

    def _own_in(self, s: int) -> list:
        """The inputs of stage ``s``'s programs: its gradients, its optimizer state,
        the state no stage owns, its parameters."""
        ins, n_p, n_o = self._ins, self.n_p, self.n_o
        p, o = self.p_idx[s], self.o_idx[s]
        return ([ins[i] for i in p] + [ins[n_p + k] for k in o] + self._shared_in
                + [ins[n_p + n_o + i] for i in p])

    def _stage_program(self, s: int, name: str, job=None):
        """Stage ``s``'s update (its new parameters and optimizer state), or None when
        it has no trained parameters."""
        prog, ins, n_p, n_o = self._prog, self._ins, self.n_p, self.n_o
        outs = [prog.outputs[j] for j in self.out_idx[s]]
        if not outs:
            return None
        n_up, n_out = sum(1 for j in self.out_idx[s] if j < n_p), len(outs)

        def finish(got):  # (got: outputs, then parameters)
            return apply_updates(got[n_out:], got[:n_up]), got[n_up:n_out]

        params = [ins[n_p + n_o + i] for i in self.p_idx[s]]
        out = ([self._layout.get(v) for v in params],
               [self._layout.get(ins[n_p + k]) for k in self.o_idx[s]])
        return self._compile(self._own_in(s) + self._root_vars, outs + params, finish,
                             f"{name}_stage{s}", out=out, job=job)

    def _shared_program(self, name: str, job=None):
        """The update of the leaves no stage owns, the step count and the loss."""
        prog, ins, n_p = self._prog, self._ins, self.n_p
        shared_outs = [prog.outputs[j] for j in self.out_idx[None]]
        n = len(shared_outs)

        def shared(got):  # (got: outputs, then step, loss sum, scale)
            step, loss_sum, scale = got[n:]
            return got[:n], step + 1, loss_sum * scale

        out = ([self._layout.get(ins[n_p + k]) for k in self.o_idx[None]], (), ())
        return self._compile(self._shared_in + self._root_vars, shared_outs, shared,
                             f"{name}_shared", extra=[(), (), ()], out=out, job=job)

    def _compile(self, in_vars: list, targets: list, post, name: str, extra=(), out=None,
                 job=None):
        """A compiled ``values -> post([targets])``: the update's equations that the
        ``targets`` need, given ``in_vars`` (the constants the trace captured are
        bound too); the ``len(extra)`` values after those of ``in_vars`` are appended
        to what ``post`` gets. With ZeRO the program runs through ``fs.shard`` on a
        stage's devices: the inputs laid out by their split counts (``extra`` and
        values computed by other programs whole: the counts ``extra`` holds), each
        stacked gradient summed into its own layout, the outputs as ``out`` says.
        ``job = (S, dp)``: in a multi-process job, on the ``dp`` processes of this
        process's stage (one of ``S`` groups), each gradient coming in as its stage's
        sum in its own layout and each split input and output this process's block
        (``fs.ShardedArray``); ``job = "whole"``: whole values, one process's program."""
        prog = self._prog
        eqs = self._needed(targets, set(in_vars))
        const_vars, consts = prog.inputs[:prog.n_consts], self._consts
        n_in, n_extra, zero = len(in_vars), len(extra), self.zero is not None
        # (the replicas' stacked gradients: a virtual mesh's; a job's come summed)
        stacked = self._grads if zero and job is None else {}

        def run(values):
            env = dict(zip(const_vars, consts))
            for v, x in zip(in_vars, values[:n_in]):
                # (ZeRO: a gradient's replicas summed, laid out as the level says: whole
                # at level1, an AllReduce; split from level2, a reduce-scatter)
                env[v] = (with_sharding_constraint(x.sum(axis=0), stacked[v])
                          if v in stacked else x)
            read = walk_equations(eqs, env, bind_equation, f"the optimizer update ({name}):")
            return post([read(t) for t in targets] + list(values[n_in:n_in + n_extra]))

        run.__name__ = f"pipeline_finish_{name}"
        if not zero or job == "whole":
            return jit(run)
        if job is not None:
            layouts = {**self._layout, **self._grads}
            strategies = [layouts.get(v, (1,) * v.aval.ndim) for v in in_vars] + list(extra)
            S, dp = job
            s = shard(run, in_strategy=(strategies,), out_strategy=out, mesh=dp, level=2,
                      search=False, dataset_strategy="full_batch")
            s.search = "follow_inputs"  # (the layouts are given: no search)
            s.process_groups = ("pp", S)  # (the stage's processes, one group of S)
            s.gather_outputs = False  # (split outputs stay this process's blocks)
            if self.zero[-1]:
                s.passes = (reduce_in_float32,)
            return jit(s)
        strategies = [self._layout.get(v, (1,) * v.aval.ndim) for v in in_vars] + list(extra)
        s = shard(run, in_strategy=(strategies,), out_strategy=out,
                  mesh=Mesh(self.zero[0], "stage", virtual=True), level=2, search=False,
                  dataset_strategy="full_batch")
        s.search = "follow_inputs"  # (the layouts are given: no search)
        if self.zero[-1]:
            s.passes = (reduce_in_float32,)
        fn = jit(s)
        # (its operator strategies, on these input types: operator_strategies)
        fn.sharded = s
        fn.in_avals = [ArrayType((self.zero[1],) + tuple(v.aval.shape), v.aval.dtype)
                       if v in stacked else v.aval for v in in_vars]
        return fn

    def _walk(self, env: dict, targets: list, name: str) -> list:
        """The values of ``targets`` (variables or literals): the update's equations
        they need beyond what ``env`` binds, run under the current trace (``env`` keeps
        what they compute)."""
        eqs = self._needed(targets, env)
        read = walk_equations(eqs, env, bind_equation, f"the optimizer update ({name}):")
        return [read(t) for t in targets]

    def _needed(self, targets: list, known) -> list:
        """The update's equations, in order, that ``targets`` need beyond the values in
        ``known``."""
        prog, producer = self._prog, self._producer
        need, todo = set(), [t for t in targets if isinstance(t, Var)]
        while todo:
            v = todo.pop()
            i = None if v in known else producer.get(v)
            if i is None or i in need:
                continue
            need.add(i)
            todo.extend(a for a in prog.equations[i].inputs if isinstance(a, Var))
        return [eq for i, eq in enumerate(prog.equations) if i in need]

    def job_program(self, stage: int, dp: int, last: int, broadcast: bool,
                    reduce_dp: bool, fp32: bool, name: str):
        """The update of a multi-process job's process of ``stage`` (one compiled
        program): ``(grads, own state, shared state, params, step, loss sum, scale) ->
        (new params, new own state, new shared state, step + 1, loss)``, over its
        stage's leaves (``p_idx[stage]``, ``o_idx[stage]``) and the unowned ones
        (``o_idx[None]``). Its gradients are summed over the stage's processes
        (``reduce_dp``); each cross-stage reduction's partial results are combined by
        one collective over the pipeline group (a one-hot slot per stage summed, so
        every process folds the same partials, in stage order, as the virtual mesh
        does); the loss is the last stage's (NaN elsewhere, or summed over the
        pipeline with ``broadcast``)."""
        key = (stage, dp, last, broadcast, reduce_dp, fp32)
        hit = self._jobs.get(key)
        if hit is not None:
            return hit
        prog, S, n_p, n_o = self._prog, self.S, self.n_p, self.n_o
        ins = prog.inputs[prog.n_consts:]
        mesh = Mesh((S, dp), ("pp", "dp"))
        p, o, sh = self.p_idx[stage], self.o_idx[stage], self.o_idx[None]
        in_vars = ([ins[i] for i in p] + [ins[n_p + k] for k in o]
                   + [ins[n_p + k] for k in sh] + [ins[n_p + n_o + i] for i in p])
        own_outs = [prog.outputs[j] for j in self.out_idx[stage]]
        shared_outs = [prog.outputs[j] for j in self.out_idx[None]]
        n_up = sum(1 for j in self.out_idx[stage] if j < n_p)
        const_vars, consts = prog.inputs[:prog.n_consts], self._consts
        what = f"{name}_stage{stage}"

        def finish(grads, own_opt, shared_opt, params, step, loss_sum, scale):
            with C.named_axis("pp", S), C.named_axis("dp", dp):
                if reduce_dp:  # (the stage's data-parallel replicas' gradients)
                    grads = [_reduce(g, ("dp",), mesh, fp32) for g in grads]
                    if stage == last:
                        loss_sum = _reduce(loss_sum, ("dp",), mesh, fp32)
                env = dict(zip(const_vars, consts))
                env.update(zip(in_vars, list(grads) + list(own_opt) + list(shared_opt)
                               + list(params)))
                for root, red in self.reductions:
                    mine = red.terms.get(stage)
                    part = (_fold(red.prim, red.params, self._walk(env, mine, what))
                            if mine else np.zeros(root.aval.shape,
                                                  dtypes.to_numpy(root.aval.dtype)))
                    every = _from_every_stage(part, stage, S, mesh)
                    env[root] = _fold(red.prim, red.params,
                                      [every[t] for t in sorted(red.terms)]
                                      + self._walk(env, red.rep, what))
                got = self._walk(env, own_outs + shared_outs, what)
                loss = loss_sum * scale
                if stage != last:
                    loss = loss * np.float32(np.nan)  # there is no loss on this stage
                if broadcast:
                    given = loss if stage == last else np.zeros((), np.float32)
                    loss = C.psum_p.bind(given, axis_name=("pp",), mesh=mesh)
            n_own = len(own_outs)
            return (apply_updates(list(params), got[:n_up]), got[n_up:n_own], got[n_own:],
                    step + 1, loss)

        finish.__name__ = f"pipeline_finish_{what}"
        fn = self._jobs[key] = jit(finish)
        return fn

    def job_blocks_program(self, stage: int, dp: int, last: int, broadcast: bool,
                           name: str):
        """``job_program`` for a job whose stages keep their state in tensor-parallel
        blocks (``zero``'s counts): the same inputs and outputs, each split leaf this
        process's block (``fs.ShardedArray``). The update of the stage runs as the
        virtual mesh's programs do, each ``fs.shard``-ed over the stage's ``dp``
        processes (the blocks go in and come out as they are: no gather), and the
        stage's partial result of each cross-stage reduction (whole on the stage's
        processes: the plan sums over their blocks) is combined with the other stages'
        by one collective over the pipeline group, as ``job_program`` does."""
        key = ("blocks", stage, dp, last, broadcast)
        hit = self._jobs.get(key)
        if hit is not None:
            return hit
        S = self.S
        mesh = Mesh((S, dp), ("pp", "dp"))
        job = (S, dp)
        own_in, shared_in, root_vars = self._own_in(stage), self._shared_in, self._root_vars
        what = f"{name}_stage{stage}"
        partials, combines = [], []
        for k, (root, red) in enumerate(self.reductions):
            mine = red.terms.get(stage)
            partials.append(None if not mine else self._compile(
                own_in + root_vars[:k], mine, _partial_post(red), f"{what}_partial{k}",
                out=[(1,) * root.aval.ndim], job=job))
            combines.append(self._compile(shared_in + root_vars[:k], red.rep,
                                          _combine_post(red), f"{name}_combine{k}",
                                          extra=[()] * len(red.terms), job="whole"))
        own = self._stage_program(stage, name, job=job)
        shared = self._shared_program(name, job="whole")

        def exchange(part):
            with C.named_axis("pp", S), C.named_axis("dp", dp):
                return _from_every_stage(part, stage, S, mesh)

        def last_loss(loss):
            with C.named_axis("pp", S), C.named_axis("dp", dp):
                if stage != last:
                    loss = loss * np.float32(np.nan)  # there is no loss on this stage
                if broadcast:
                    given = loss if stage == last else np.zeros((), np.float32)
                    loss = C.psum_p.bind(given, axis_name=("pp",), mesh=mesh)
            return loss

        exchange.__name__ = f"pipeline_finish_{what}_exchange"
        last_loss.__name__ = f"pipeline_finish_{what}_loss"
        exchange, last_loss = jit(exchange), jit(last_loss)

        def run(grads, own_opt, shared_opt, params, step, loss_sum, scale):
            values = list(grads) + list(own_opt) + list(shared_opt) + list(params)
            roots: list = []
            for (root, red), part_fn, combine in zip(self.reductions, partials, combines):
                part = (part_fn(values + roots)[0] if part_fn is not None else
                        np.zeros(root.aval.shape, dtypes.to_numpy(root.aval.dtype)))
                every = exchange(part)
                roots.append(combine(list(shared_opt) + roots
                                     + [every[t] for t in sorted(red.terms)])[0])
            new_p, new_o = (list(params), list(own_opt)) if own is None else own(
                values + roots)
            new_shared, step, loss = shared(list(shared_opt) + roots + [step, loss_sum, scale])
            return list(new_p), list(new_o), list(new_shared), step, last_loss(loss)

        self._jobs[key] = run
        return run

    def __call__(self, params: list, grads: list, opt: list, step, loss_sum, scale):
        """The new parameter and optimizer-state leaves, step and loss: the
        reductions' partials and combinations, then each stage's program on its own
        leaves, the shared one once."""
        n_p = self.n_p
        shared = [opt[k] for k in self.o_idx[None]]

        def own(s):
            p, o = self.p_idx[s], self.o_idx[s]
            return ([grads[i] for i in p] + [opt[k] for k in o] + shared
                    + [params[i] for i in p])

        roots: list = []
        for partials, combine in zip(self.partials, self.combines):
            got = [fn(own(s) + roots)[0] for s, fn in partials.items()]
            roots.append(combine(shared + roots + got)[0])
        new_p, new_o = list(params), list(opt)
        for s in range(self.S):
            if s not in self.fns:
                continue
            got_p, got_o = self.fns[s](own(s) + roots)
            for i, u in zip(self.p_idx[s], got_p):
                new_p[i] = u
            for k, x in zip(self.o_idx[s], got_o):
                new_o[k] = x
        got, step, loss = self.fns[None](shared + roots + [step, loss_sum, scale])
        for j, x in zip(self.out_idx[None], got):
            new_o[j - n_p] = x
        return new_p, new_o, step, loss


def split_update(opt_update, state, stage_of: dict, S: int, frozen: set, name: str,
                 zero=None):
    """``opt_update`` (``(grads, opt_state, params) -> (updates, new_state)``) split by
    stage (a ``StageUpdate``), or the reason it does not split (a string): the first
    operation that reads several stages' values other than by a cross-stage sum,
    maximum or minimum, or an output that reads a stage other than its own."""
    p_leaves = tree.leaves(state.params)
    o_leaves = tree.leaves(state.opt_state)
    n_p, n_o = len(p_leaves), len(o_leaves)
    in_tree = tree.structure(((state.params, state.opt_state, state.params), {}))
    avals = [typeof(x) for x in p_leaves + o_leaves + p_leaves]
    with context.setting(context.split_updates, True):
        traced = trace_fun(lambda g, o, p: opt_update(g, o, p), in_tree, avals)
    if traced.out_tree != tree.structure((state.params, state.opt_state)):
        return ("its updates and new state do not have the structure of the parameters "
                "and the optimizer state")
    o_stage = _copies_stage(state, stage_of, frozen)
    p_stage = [stage_of.get(i, 0) for i in range(n_p)]
    owner_in = p_stage + o_stage + p_stage
    owner_out = p_stage + o_stage
    prog = traced.program
    # each value's label: the stage whose inputs it reads, None (no stage's: every
    # stage computes it) or a pending cross-stage _Reduction
    label: dict = dict(zip(prog.inputs[prog.n_consts:], owner_in))
    roots: list = []   # the reductions read by something else, in that order

    def read(a):
        got = label.get(a) if isinstance(a, Var) else None
        if isinstance(got, _Reduction):  # combined here: every stage holds the result
            roots.append((a, got))
            label[a] = got = None
        return got

    for eq in prog.equations:
        ls = [label.get(a) if isinstance(a, Var) else None for a in eq.inputs]
        staged = {x for x in ls if isinstance(x, int)}
        pending = [x for x in ls if isinstance(x, _Reduction)]
        out = eq.outputs[0].aval if len(eq.outputs) == 1 else None
        if eq.prim in _REDUCIBLE and out is not None and (len(staged) > 1 or pending) \
                and all(tuple(a.aval.shape) == tuple(out.shape) and a.aval.dtype == out.dtype
                        for a in eq.inputs) \
                and all(r.prim is eq.prim and _exact(eq.params) is not None
                        and _exact(r.params) == _exact(eq.params) for r in pending):
            red = _Reduction(eq.prim, eq.params)
            for a, x in zip(eq.inputs, ls):
                red.absorb(x, a)
            label[eq.outputs[0]] = red
            continue
        staged = {x for x in (read(a) for a in eq.inputs) if x is not None}
        if len(staged) > 1:
            at = f" (at {eq.source})" if eq.source else ""
            return (f"an operation ({eq.prim.name}{at}) reads the gradients, parameters "
                    f"or state of stages {sorted(staged)}, other than by a sum, maximum "
                    "or minimum over them")
        for v in eq.outputs:
            label[v] = staged.pop() if staged else None
    o_paths = [tree.keystr(p) for p in tree.flatten_with_path(state.opt_state)[0]]
    p_paths = [tree.keystr(p) for p in tree.flatten_with_path(state.params)[0]]
    for j, (v, o) in enumerate(zip(prog.outputs, owner_out)):
        got = read(v)
        if got is None or got == o:
            continue
        what = (f"the update of parameter {p_paths[j] or '0'}" if j < n_p else
                f"the optimizer-state leaf {o_paths[j - n_p] or '0'}")
        where = "no stage's own" if o is None else f"stage {o}'s"
        return f"{what} ({where}) reads the gradients, parameters or state of stage {got}"
    return StageUpdate(traced, owner_in, owner_out, roots, n_p, n_o, S, name, zero)


def _local_norms(norms, fixed, params: dict, grads: dict) -> tuple:
    """``(norms of the trainable gradients,)`` for a finishing program's outputs when
    device-local norms are on (``norms``), else ``()``; ``fixed``: the frozen names."""
    if norms is None:
        return ()
    if not fixed:
        return (norms(params, grads),)
    trainable = {k: v for k, v in params.items() if k not in fixed}
    return (norms(trainable, {k: grads[k] for k in trainable}),)


#: The finishing programs, by optimizer (its ``update``) and configuration.
_FINISHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _stage_view(counts, S: int, dp: int):
    """Split counts over one stage's ``dp`` devices as a layout of all ``S * dp``
    (stage-major: stage ``s`` holds ranks ``s * dp ... s * dp + dp - 1``): every stage's
    devices hold every block (the ``pp`` axis repeats), inside a stage the blocks are
    spread as the counts say, any remaining factor repeating last. Whole: the counts."""
    counts = tuple(counts)
    k = math.prod(counts)
    if k == 1:
        return counts
    dm, names, view = [S], ["pp"], []
    for i, c in enumerate(counts):
        if c > 1:
            dm.append(c)
            names.append(f"z{i}")
            view.append(f"z{i}")
        else:
            view.append("None")
    if dp // k > 1:
        dm.append(dp // k)
        names.append("rep")
    return Layout(tuple(dm), tuple(names))(*view)


def _copies_stage(state, stage_of: dict, frozen: set) -> list:
    """Per optimizer-state leaf, the stage of the parameter it copies (a subtree with
    the trained parameters' structure and shapes: Adam's moments), or None."""
    paths, _, _ = tree.flatten_with_path(state.params)
    index = {tree.keystr(p): i for i, p in enumerate(paths)}
    params = state.params
    if frozen:  # (the optimizer state is over the trained parameters)
        params = {k: v for k, v in params.items() if k not in frozen}
    t_paths, p_leaves, p_spec = tree.flatten_with_path(params)
    owners = [stage_of.get(index[tree.keystr(p)], 0) for p in t_paths]
    shapes = [tuple(typeof(x).shape) for x in p_leaves]
    n = len(p_leaves)

    def is_copy(t) -> bool:
        leaves, spec = tree.flatten(t)
        return len(leaves) == n and [tuple(typeof(x).shape) for x in leaves] == shapes \
            and spec == p_spec

    out: list = []
    for item in tree.flatten(state.opt_state, is_leaf=is_copy)[0]:
        out.extend(owners if is_copy(item) else [None])
    return out


def _widen(x):
    """A float16 value as float32 (a sum of several then rounds once)."""
    return cast(x, dtypes.float32) if typeof(x).dtype == dtypes.float16 else x


def _reduce(x, axes, mesh, fp32: bool):
    """The psum of ``x`` over ``axes``; a float16 one in float32 with ``fp32``."""
    if not (fp32 and typeof(x).dtype == dtypes.float16):
        return C.psum_p.bind(x, axis_name=axes, mesh=mesh)
    return cast(C.psum_p.bind(cast(x, dtypes.float32), axis_name=axes, mesh=mesh),
                dtypes.float16)


def _from_every_stage(x, stage: int, S: int, mesh):
    """Every stage's ``x`` (this process's is ``stage``'s), on every process of the
    pipeline group: a slot per stage, this one's holding ``x`` and the others zeros,
    summed over ``pp`` (one AllReduce). Adding zeros leaves each value as it is (a
    NaN or an infinity included); a bool goes as float32 and comes back."""
    a = typeof(x)
    is_bool = a.dtype == dtypes.bool_
    if is_bool:
        x = cast(x, dtypes.float32)
    dt = dtypes.to_numpy(dtypes.float32 if is_bool else a.dtype)
    slots = [reshape(x, (1,) + tuple(a.shape)) if t == stage else
             np.zeros((1,) + tuple(a.shape), dt) for t in range(S)]
    total = C.psum_p.bind(concat(slots, 0), axis_name=("pp",), mesh=mesh)
    out = [reshape(total[t:t + 1], tuple(a.shape)) for t in range(S)]
    return [cast(v, dtypes.bool_) for v in out] if is_bool else out


def _saved_bytes(saved: dict, micro, j) -> int:
    """Bytes a device keeps between forwards and backwards: each chunk input (for the
    first chunk, its micro-batch rows)."""
    total = 0
    for (c, m), carry in saved.items():
        for x in (carry if c else micro(m, j)):
            a = typeof(x)
            total += a.size * np.dtype(dtypes.to_numpy(a.dtype)).itemsize
    return total


def _wait(values) -> None:
    """Wait for a computation (MindSpore runs compiled programs asynchronously)."""
    for x in values:
        if hasattr(x, "asnumpy"):
            x.asnumpy()


def _pack(values, pad: int):
    flat = [reshape(cast(v, dtypes.float32), (typeof(v).size,)) for v in values]
    used = sum(typeof(f).shape[0] for f in flat)
    if used < pad:
        flat.append(np.zeros((pad - used,), np.float32))
    return flat[0] if len(flat) == 1 else concat(flat, 0)


def _unpack(buf, avals):
    out, at = [], 0
    for a in avals:
        out.append(cast(reshape(buf[at:at + a.size], a.shape), a.dtype))
        at += a.size
    return out


# ---------------------------------------------------------------------------
# AutoParallel's side
# ---------------------------------------------------------------------------


#: How a stage of several devices plans what no strategy fixes, per AutoParallel mode
#: (the ``search`` of the stage's ``fs.shard``).
_STAGE_SEARCH = {ParallelMode.SEMI_AUTO: "follow_inputs",
                 ParallelMode.SHARDING_PROPAGATION: False,
                 ParallelMode.RECURSIVE_PROGRAMMING: True}


class PipelineRunner:
    """The pipelined steps of one ``AutoParallel`` (one per input signature), its
    schedule and its parameter gathering."""

    def __init__(self, ap, cfg: PipelineConfig, state_cls):
        self.ap, self.cfg, self.state_cls = ap, cfg, state_cls
        self._steps: dict = {}
        self.plan: Stages | None = None
        #: How the micro-batch losses combine (``loss_combination``), once found.
        self.combine: str | None = None

    @property
    def sliced(self) -> bool:
        """Each process passes its slice of the batch: ``dataset_strategy(
        "data_parallel")`` in a multi-process job (the processes of data-parallel index
        ``j``, one per stage, pass slice ``j`` of ``dp``)."""
        return not self.virtual and self.ap._dataset == "data_parallel"

    @property
    def virtual(self) -> bool:
        if isinstance(self.ap.mesh, int):
            return not distributed.is_initialized()
        return resolve_mesh(self.ap.mesh).is_virtual

    @property
    def fp32(self) -> bool:
        """Float16 reductions run in float32 (as ``AutoParallel``'s step decides)."""
        return self.ap.options.fp32_reductions

    def check_combination(self):
        ap = self.ap
        for what, on in (("comm_fusion(...)", ap.options.fuses),
                         ("a dataset_strategy(...) tuple",
                          ap._dataset not in ("data_parallel", "full_batch")),
                         ("has_aux=True", ap.has_aux),
                         ("load_operator_strategy_file(...)",
                          getattr(ap, "_operator_file", None) is not None),
                         ("set_inputs(...)", ap._batch_specs is not None)):
            if on:
                raise ArgumentError(
                    f"AutoParallel({ap.name}): pipeline(...) cannot be combined with {what} "
                    "yet: inside a stage fshard runs data parallelism or the operator "
                    "strategies of parameter_plan(...) and the loss.\nFix: drop one of the "
                    "two settings.")

    def step_for(self, state, *batch) -> PipelinedStep:
        check_context_mode(self.ap.parallel_mode.value, f"AutoParallel({self.ap.name})")
        self.check_combination()
        cfg = self.cfg
        dp = self.ap.n_devices // cfg.stages
        key = (tree.structure(state), tuple(
            (tuple(typeof(x).shape), typeof(x).dtype) for x in tree.leaves((state, batch))),
            self.fp32)
        hit = self._steps.get(key)
        if hit is not None:
            return hit
        ap = self.ap
        rows = batch_rows(ap.name, batch, cfg.micro_batches, dp, self.sliced)
        plan = None
        if dp > 1:  # a stage of several devices: sharded if the loss or the plan says so
            plan = cut(ap.loss_fn, ap.name, state.params, batch, rows * dp, dp)
            if not (plan.constrained or ap._given_plan()):
                plan = None
        sharding = self._stage_sharding(state.params, batch, dp, plan is not None)
        if plan is None:
            plan = cut(ap.loss_fn, ap.name, state.params, batch, rows)
        v = plan.check(cfg.stages, cfg.interleave)
        plan.check_balance(cfg.stages, cfg.max_imbalance)
        self.plan = plan
        sched = Schedule(cfg.stages, cfg.micro_batches, cfg.scheduler, v)
        if self.combine is not None and any(
                isinstance(x, (RemoteArray, ShardedArray)) for x in tree.leaves(state.params)):
            # a job's split state on a new batch shape: the loss cannot be evaluated
            # here, and how its micro-batch losses combine is the loss's own
            combine = self.combine
        else:
            combine = loss_combination(ap.loss_fn, ap.name, state.params, batch,
                                       plan.batch_vars[0].aval.shape[0],
                                       dp if sharding is not None else 1)
        self.combine = combine
        # (a sharded stage keeps its state in tensor-parallel blocks: on a virtual mesh,
        # and in a job each process its own block)
        zero = ap._pipeline_zero(state, blocks=sharding is not None)
        if not self.virtual and ap._pipeline_zero(state) is not None:
            hsdp = ap.options.hsdp
            raise ArgumentError(
                f"AutoParallel({ap.name}).hsdp(optimizer_level={hsdp.level!r}) with "
                f"pipeline(stages={cfg.stages}) in a multi-process job: ZeRO inside the "
                f"stages (each stage's {dp} devices splitting its state) runs on a virtual "
                "mesh only; in a job a stage's processes each keep the whole of its "
                "state.\nFix: "
                "drop hsdp(...), or give each stage one process "
                f"(pipeline(stages={ap.n_devices})), or raise hsdp's threshold above the "
                "parameters' size (nothing split).")
        step = PipelinedStep(self, plan, sched, None if self.virtual else distributed.rank(),
                             sharding, combine, zero, state)
        self._steps[key] = step
        return step

    def __call__(self, state, *batch):
        return self.step_for(state, *batch)(state, *batch)

    def param_strategies(self, state, *batch) -> dict:
        """Per parameter name: its strategy inside its stage (``"params"``: the
        ``parameter_plan`` strategy over the stage's devices, split further by ZeRO
        level3, else whole) and its pipeline stage (``"stages"``), for the parameter
        strategy file."""
        step = self.step_for(state, *batch)
        zero = step.zero[0] if step.zero is not None else None
        plan, S = step.plan, step.S
        paths, leaves, _ = tree.flatten_with_path(state.params)
        stage_of = {i: c % S for c, owned in enumerate(plan.chunk_params) for i in owned}
        params, stages = {}, {}
        for i, (p, x) in enumerate(zip(paths, leaves)):
            name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p)
            given = self.ap._param_strategy(p, x)
            counts = tuple(given) if isinstance(given, (tuple, list)) else (
                tuple(given.to_strategy()) if isinstance(given, Layout) else None)
            if zero is not None and zero[i] is not None:
                counts = tuple(zero[i])
            params[name] = list(counts or (1,) * typeof(x).ndim)
            stages[name] = stage_of.get(i, 0)
        return {"params": params, "stages": stages}

    def groups(self, rank: int) -> dict:
        """The communication groups of ``rank`` (devices stage-major, ``dp`` per
        stage): ``"pp"`` its pipeline group, ``"dp"`` its stage's devices (if more
        than one)."""
        S = self.cfg.stages
        dp = self.ap.n_devices // S
        stage, j = divmod(rank, dp)
        out = {"pp": [s * dp + j for s in range(S)]}
        if dp > 1:
            out["dp"] = [stage * dp + k for k in range(dp)]
        return out

    def _stage_sharding(self, params, batch, dp: int, sharded: bool):
        """Operator parallelism inside the stages (``parameter_plan`` or strategies in
        the loss), or None. The parameters' strategies are checked against a stage's
        ``dp`` devices."""
        ap, S = self.ap, self.cfg.stages
        ap._check_param_plan(params)
        paths, leaves, _ = tree.flatten_with_path(params)
        strategies = []
        for path, x in zip(paths, leaves):
            given = ap._param_strategy(path, x)
            what = f"parameter {tree.keystr(path) or '0'} ({typeof(x)})"
            if isinstance(given, Layout) and math.prod(given.device_matrix) != dp:
                raise ArgumentError(
                    f"AutoParallel({ap.name}).pipeline(stages={S}): the Layout {given!r} "
                    f"of {what} has a device matrix of {math.prod(given.device_matrix)} "
                    f"devices, but each stage has {dp} ({ap.n_devices} devices / {S} "
                    "stages): a stage's strategies describe its own devices.\nFix: a "
                    f"Layout whose device matrix has {dp} devices.")
            counts = given if isinstance(given, tuple) and all(
                isinstance(k, int) for k in given) else None
            if counts is not None and dp % math.prod(counts):
                raise ArgumentError(
                    f"AutoParallel({ap.name}).pipeline(stages={S}): the strategy "
                    f"{given} of {what} splits it over {math.prod(counts)} devices, but "
                    f"each stage has {dp} ({ap.n_devices} devices / {S} stages): a stage's "
                    f"strategies run on its own devices.\nFix: split counts whose product "
                    f"divides {dp}, or fewer stages.")
            if given is None and ap.parallel_mode is ParallelMode.SEMI_AUTO:
                given = (1,) * typeof(x).ndim
            strategies.append(given)
        if not sharded:
            return None
        batch_strategies = tuple((dp,) + (1,) * (typeof(x).ndim - 1)
                                 for x in tree.leaves(list(batch)))
        return StageSharding(dp, tuple(strategies), batch_strategies,
                             None if self.virtual else ("pp", S),
                             _STAGE_SEARCH[ap.parallel_mode], self.fp32)

    def stage_costs(self) -> list:
        if self.plan is None:
            raise ArgumentError(
                f"AutoParallel({self.ap.name}).pipeline_stage_costs(): run a step first "
                "(the stages are found by tracing the loss on a batch).")
        return self.plan.stage_costs(self.cfg.stages)

    def schedule(self, virtual_stages: int | None = None) -> Schedule:
        cfg = self.cfg
        if virtual_stages is None:
            if not cfg.interleave:
                virtual_stages = 1
            elif self.plan is not None:
                virtual_stages = self.plan.n_chunks // cfg.stages
            else:
                raise ArgumentError(
                    f"AutoParallel({self.ap.name}).pipeline_schedule(): with interleave=True "
                    "the number of chunks per stage comes from the model's markers, known "
                    "after the first step.\nFix: run a step first, or pass "
                    "virtual_stages=v.")
        return Schedule(cfg.stages, cfg.micro_batches, cfg.scheduler, virtual_stages)

    def gather(self, state, params_only: bool = False):
        """``state`` with every stage's leaves (``params_only``: its parameters) on
        every process. On a virtual mesh, and in a job whose update runs whole on every
        process, the state is whole already. In a job whose update is split by stage
        each process keeps its own stage's leaves (the others are
        ``fs.RemoteArray`` leaves): one compiled program sums each stage-owned leaf over
        the job, the lowest process of its stage giving its value and every other
        process zeros (a collective: every process calls it, in the same order). The
        step that made ``state`` says which leaves are whose."""
        if self.virtual:
            return state
        steps = [st for key, st in self._steps.items()
                 if key[0] == tree.structure(state) and key[1][:len(tree.leaves(state))]
                 == tuple((tuple(typeof(x).shape), typeof(x).dtype)
                          for x in tree.leaves(state))]
        split = [st for st in steps if isinstance(st.split, StageUpdate)]
        if not split:
            remote = [x for x in tree.leaves(state) if isinstance(x, RemoteArray)]
            if remote:  # (a state from another AutoParallel or configuration)
                raise ArgumentError(
                    f"AutoParallel({self.ap.name}).gather(state): state holds "
                    f"fs.RemoteArray leaves ({remote[0]!r}) but no step of this "
                    "AutoParallel made a state of its structure and types, so which "
                    "process keeps which leaf is not known here.\nFix: gather with the "
                    "AutoParallel whose steps returned this state.")
            return state
        return split[0].gather(state, params_only)

    def gather_params(self, state):
        """``state.params`` with every stage's parameters on every process
        (``gather``; a collective in a job whose update is split by stage)."""
        return self.gather(state, params_only=True).params
