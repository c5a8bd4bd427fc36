"""``ShardPlan``: one sharded computation, from its global Program and boundary layouts
to the per-device Program and the whole run (propagated, searched, partitioned and
compiled once, on first use); and the strategy files that save and reload a plan's
choices.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

from fshard.backend.collectives import carries
from fshard.core import dtypes
from fshard.core.gcpause import paused_gc
from fshard.core.tracing import ArrayType
from fshard.errors import ShardingError
from fshard.core.ir import Program, Var
from fshard.primitives import passes
from fshard.primitives.nn import decompose_batch_norm
from fshard.sharding.cost import CostModel, backend_rates, bucket_bytes
from fshard.sharding.layouts import Sharding, ShardMesh
from fshard.sharding.partition import Partitioned, apply_fixed, partition
from fshard.sharding.propagation import propagate, undecided
from fshard.sharding.runtime import run_on_rank, run_virtual
from fshard.sharding.search import (cheaper_path, choose_split_axes, follow_inputs, refine,
                                     score)
from fshard.core.staging import stage


def bucket_collectives(part: Partitioned) -> Program:
    """The per-device program of a plan run in a job with its AllReduces and its
    AllGathers bucketed by the job's measured rates: buckets of at most
    ``cost.bucket_bytes`` (one collective's fixed cost worth of copying in
    and out), as MindSpore's data-parallel gradient reducer and XLA's all-reduce and
    all-gather combiners bucket by default. Each collective between processes costs
    about half a millisecond on this CPU whatever its size; the values are the same to
    the bit. Integer gathers share the float32 gathers' buckets, carried as chunks,
    where the backend's collectives take floats only (a batch's rows and its labels:
    one AllGather). ``part.fused`` and ``part.fused_gathers`` record the buckets
    (``explain`` prices them)."""
    n = part.prop.mesh.size
    model = CostModel(level=2, rates=backend_rates(n))
    reduces: list = []
    program = passes.fuse_allreduces(
        part.program, bucket_bytes(n, model.rates, model.native), report=reduces)
    gathers: list = []
    carrier = None if carries(dtypes.int32) or not carries(dtypes.float32) else dtypes.float32
    program = passes.fuse_allgathers(
        program, bucket_bytes(n, model.rates, model.native, "all_gather"),
        carrier=carrier, report=gathers)
    part.fused, part.fused_gathers = tuple(reduces), tuple(gathers)
    return program


class ShardPlan:
    """What one ``shard_call`` runs. Propagated and partitioned once, on first use."""

    def __init__(self, body: Program, in_shardings, out_shardings, mesh: ShardMesh,
                 level: int = 0, name: str = "f", search: bool = False, fixed=None,
                 world=None, flexible=(), fusion=None, tied=(), copies=()):
        assert body.n_consts == 0, "a shard_call body takes its constants as inputs"
        # BatchNorm's fused kernels compute the statistics of the block they get; as
        # reductions and elementwise ops, a split batch all-reduces them (SyncBatchNorm)
        body = decompose_batch_norm(body)
        self.body, self.mesh, self.level, self.name = body, mesh, level, name
        self.in_shardings, self.out_shardings = list(in_shardings), list(out_shardings)
        self.search, self.fixed = search, fixed
        # Inputs given as tuple strategies: their mesh axes are chosen with the plan.
        self.flexible = tuple(flexible)
        # Pairs (an input, the output it becomes at the next call): flexible layouts
        # given to both take the same mesh axes, and an output left to the plan (None)
        # leaves in its input's layout.
        self.tied = tuple(tied)
        # Pairs (an input, the input it is a copy of): left to the plan, the copy takes
        # the layout of the original (an optimizer moment, its parameter's).
        self.copies = tuple(copies)
        # The rewrite bucketing the per-device AllReduces, ``fusion(Partitioned) ->
        # Program`` (fs.AutoParallel's comm_fusion); None: in a job, buckets by the
        # job's rates (``bucket_collectives``), on a virtual mesh none; False: none.
        if fusion is None and world is not None:
            fusion = bucket_collectives
        self.fusion = fusion
        # Rewrites of the per-device program, in order (fs.AutoParallel's).
        self.passes = ()
        # The fs.Mesh of prime axes of a multi-process job (one device per process), or
        # None on a virtual mesh.
        self.world = world
        # In a job: return split outputs as this rank's blocks (fs.ShardedArray)
        # instead of gathering them (``fs.shard(..., gather_outputs=False)``).
        self.local_outputs = False
        self._part = None
        self._virtual: dict = {}  # (local inputs, local outputs) -> (Program, consts)
        self._local_calls: dict = {}  # eager calls with blocks (transforms/shard_call.py)
        self._compiled = None

    def derive(self, body: Program, in_shardings, out_shardings, what: str) -> "ShardPlan":
        """A plan for a program derived from this one (its JVP, transpose, batching):
        same mesh, objective, search and place of execution."""
        return ShardPlan(body, in_shardings, out_shardings, self.mesh, self.level,
                         f"{self.name}:{what}", self.search, world=self.world,
                         fusion=self.fusion)

    @property
    def executed(self) -> Program:
        """The Program whose equations actually run: the per-device program (its
        outputs correspond one to one with the body's)."""
        return self.partitioned().program

    def partitioned(self) -> Partitioned:
        if self._part is None:
            with paused_gc():
                self._partition()
        return self._part

    def _partition(self) -> None:
        """Plan (propagate, search) and partition, once: ``self._part``."""
        if self.flexible and self.fixed is None:
            self.in_shardings, self.out_shardings = choose_split_axes(
                self.body, self.in_shardings, self.out_shardings, self.mesh, self.level,
                self.flexible, self.tied)
            self.flexible = ()
        prop = self._carry_layouts(*self._propagated())
        self._part = partition(prop)
        self._part.name = self.name
        self._part.program = passes.slice_broadcasts(self._part.program)
        if self.fusion:
            self._part.program = self.fusion(self._part)
        for rewrite in self.passes:  # rewrites of the per-device program
            self._part.program = rewrite(self._part.program)

    def _propagated(self) -> tuple:
        """``(plan, greedy propagation's plan or None)`` for the boundary layouts as
        they stand."""
        if self.fixed is None and self.search == "follow_inputs":
            # fs.AutoParallel's semi_auto: every equation decided in one pass, no
            # propagation (its choices would all be replaced).
            prop = follow_inputs(undecided(self.body, self.in_shardings,
                                           self.out_shardings, self.mesh, self.level))
            if prop is not None:
                return prop, None
        greedy = propagate(self.body, self.in_shardings, self.out_shardings, self.mesh,
                           self.level)
        if self.fixed is not None:
            return apply_fixed(greedy, self.fixed), greedy
        if self.search == "cheaper_path":  # fs.AutoParallel's propagation mode
            return cheaper_path(greedy), greedy
        if self.search and self.search != "follow_inputs":
            return refine(greedy), greedy
        return greedy, greedy

    def _carry_layouts(self, prop, greedy):
        """``prop`` with each carried output left to the plan (None) given its input's
        layout, so the next call takes the value as it is: no call gathers a split
        parameter or optimizer state at its end (to slice it again at the next). When
        the plan already leaves each such output in its input's layout, and each copy
        of an input (``copies``: an optimizer moment) in the layout of the input it
        copies, that is all. Otherwise an input left to the plan takes the layout
        greedy propagation gives it (the one its consumers need, as MindSpore's
        propagation gives a parameter), a copy its original's, and the plan is made
        again with those layouts fixed on both sides, so its cost counts the moves.

        A searching plan also weighs the carried values whole on both sides, and keeps
        whichever steady state is priced lower (the first on a tie). Planned for one
        call, the search may split the state where that call is cheapest, and every
        later call then runs from that split: the 64-512-512-10 MLP's Adam step from a
        whole batch on 8 devices was priced 36.1 ms so, 32.4 ms with the state whole,
        and in a job only a whole state leaves the plan computing everything whole
        (``search.whole_path``) open. The state whole is planned with its layouts fixed
        even where the search already chose them: from free inputs the search may not
        find what it finds from fixed ones (the wide MLP 256-2048-2048-10 on a batch of
        16: 97.4 ms free, 51.7 ms fixed, the state whole in both)."""
        follows = [(i, o) for (_, i), (_, o) in self.tied if self.out_shardings[o] is None]
        if not follows:
            return prop
        start = (list(self.in_shardings), list(self.out_shardings))
        plan = self._carried(prop, greedy, follows)
        free = [i for i, _ in follows if start[0][i] is None]
        if not free or not self.search or self.search == "follow_inputs":
            return plan
        whole = list(start[0])
        for i in free:
            whole[i] = Sharding.replicated(self.body.inputs[i].aval.ndim)
        if all(self.in_shardings[i] == whole[i] for i in free):
            return plan  # (made from these layouts fixed already)
        chosen = (self.in_shardings, self.out_shardings)
        self.in_shardings, self.out_shardings = start
        other = self._replanned(follows, whole)
        if score(other) < score(plan):
            return other
        self.in_shardings, self.out_shardings = chosen
        return plan

    def _carried(self, prop, greedy, follows):
        """``prop`` if it leaves each carried output in its input's layout (the outputs'
        layouts then fixed so), else the plan with greedy propagation's layouts for the
        carried inputs left to the plan (``_carry_layouts``)."""
        ins, outputs = prop.in_shardings, self.body.outputs
        if all(isinstance(outputs[o], Var) and prop.shardings.get(outputs[o]) == ins[i]
               for i, o in follows) and all(ins[c] == ins[i] for c, i in self.copies):
            follow = {o: i for i, o in follows}
            self.out_shardings = [ins[follow[o]] if o in follow else s
                                  for o, s in enumerate(self.out_shardings)]
            return replace(prop, out_shardings=list(self.out_shardings))
        if greedy is None:
            greedy = propagate(self.body, self.in_shardings, self.out_shardings, self.mesh,
                               self.level)
        decided = list(greedy.in_shardings)
        for c, i in self.copies:
            if self.in_shardings[c] is None:
                decided[c] = decided[i]
        return self._replanned(follows, decided)

    def _replanned(self, follows, decided):
        """The plan with each carried input left to the plan taking its layout in
        ``decided``, and its output the same: fixed on both sides."""
        for i, o in follows:
            if self.in_shardings[i] is None:
                self.in_shardings[i] = decided[i]
            self.out_shardings[o] = self.in_shardings[i]
        return self._propagated()[0]

    def virtual_program(self, local_in=frozenset(), local_out=frozenset()
                        ) -> tuple[Program, list]:
        """The whole run as one Program, for lowering: on a virtual mesh, split the
        inputs, run the per-device Program batched over the devices, reassemble; in a
        multi-process job, this rank's blocks in, its per-device Program with the
        job's collectives, the global outputs out. In a job, inputs in ``local_in``
        are taken as this rank's blocks and outputs in ``local_out`` returned as
        blocks (``fs.ShardedArray``s, see ``local_types``)."""
        key = (frozenset(local_in), frozenset(local_out))
        hit = self._virtual.get(key)
        if hit is None:
            part = self.partitioned()
            run = run_virtual if self.world is None else functools.partial(
                run_on_rank, mesh=self.world, local_in=key[0], local_out=key[1])
            avals = [v.aval for v in self.body.inputs]
            for i in key[0]:
                avals[i] = self.local_type(avals[i], part.in_shardings[i])
            program, consts = stage(lambda *xs: run(part, list(xs)), avals)
            # The block shuffles around the batched program fold into few operations;
            # the per-leaf updates of a planned step run as one.
            hit = self._virtual[key] = (
                passes.fuse_adam_updates(passes.simplify(program)), consts)
        return hit

    def local_type(self, aval: ArrayType, sharding) -> ArrayType:
        """The type of one device's block of a value of type ``aval``."""
        return ArrayType(sharding.local_shape(aval.shape, self.mesh), aval.dtype)

    def compiled(self):
        """The whole run compiled (collectives of a job only run in graphs)."""
        if self._compiled is None:
            from fshard.backend import mindspore as backend

            program, consts = self.virtual_program()
            src, globals_, _ = backend.lower_program(program, consts, f"shard_{self.name}")
            self._compiled = backend.compile_source(src, globals_, f"shard_{self.name}")
        return self._compiled

    def __str__(self) -> str:
        return f"<{self.name} on {self.mesh.size} devices>"

    __repr__ = __str__


def write_json_atomic(path, data, what: str) -> None:
    """Write ``data`` as JSON to ``path``: to a temporary file in the same directory,
    flushed to disk, then renamed over ``path`` (so ``path`` is always a whole file)."""
    import os
    import tempfile

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ShardingError(
            f"cannot write the {what} {path!r}: the directory {folder!r} does not exist.\n"
            "Fix: create it first (os.makedirs).")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".fshard-", suffix=".json.tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise ShardingError(
            f"cannot write the {what} {path!r}: {e.strerror or e}. The previous file, if any, "
            "is unchanged.\nFix: free disk space or choose another path.") from e
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def read_strategy_file(path) -> dict:
    """The content of a strategy file written by ``save_strategies``, checked for form
    (every problem an error naming the file)."""
    def bad(why, fix="save it again with save_strategies"):
        raise ShardingError(f"strategy file {path!r}: {why}.\nFix: {fix}.")

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        bad("no such file", "give the path save_strategies wrote")
    except IsADirectoryError:
        bad("is a directory, not a file", "give the path of the .json file")
    except UnicodeDecodeError:
        bad("is not text (not a JSON strategy file)")
    except json.JSONDecodeError as e:
        bad(f"is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); it may be "
            "truncated")
    except RecursionError:
        bad("is nested too deeply to be a strategy file")
    except OSError as e:
        bad(f"cannot be read ({e.strerror or e})", "check the path and its permissions")
    if not isinstance(data, dict):
        bad(f"holds a JSON {type(data).__name__}, not the object save_strategies writes")
    if not isinstance(data.get("device_num"), int):
        bad("has no integer 'device_num'")
    for key in ("inputs", "equations"):
        if not isinstance(data.get(key), list):
            bad(f"has no list '{key}'")
    for k, entry in enumerate(data["inputs"]):
        if not (isinstance(entry, dict) and isinstance(entry.get("layout"), list)):
            bad(f"inputs[{k}] has no 'layout' list")
        for d in entry["layout"]:
            _check_axis_list(bad, f"inputs[{k}].layout", d)
    for k, entry in enumerate(data["equations"]):
        if not (isinstance(entry, dict) and isinstance(entry.get("primitive"), str)):
            bad(f"equations[{k}] has no 'primitive' name")
        if not isinstance(entry.get("assignment"), list):
            bad(f"equations[{k}] ('{entry['primitive']}') has no 'assignment' list (the "
                "mesh axes of each factor)")
        for pair in entry["assignment"]:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                bad(f"equations[{k}].assignment has the entry {pair!r}, not [factor, axes]")
            _check_axis_list(bad, f"equations[{k}].assignment", pair[1])
        for key in ("carry",):
            if key in entry:
                _check_axis_list(bad, f"equations[{k}].{key}", entry[key])
    return data


def _check_axis_list(bad, where, axes) -> None:
    if not (isinstance(axes, list) and all(
            isinstance(a, str) and len(a) > 1 and a[0] == "m" and a[1:].isdigit()
            for a in axes)):
        bad(f"{where} has {axes!r} where a list of mesh axis names like ['m0', 'm1'] "
            "belongs")
