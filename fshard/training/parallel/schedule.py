"""Pipeline schedules as data: per-stage ordered actions, and their simulated timeline.

A schedule says, for every pipeline stage (a group of devices), in which order it runs
the forward (``F``) and backward (``B``) pass of each micro-batch on each of its model
chunks, and where activations (forward) and cotangents (backward) cross to the
neighbouring stage. It is pure data: the timeline simulator reads it to measure the
bubble and the activation memory, and the pipeline executor (fshard/training/parallel/pipeline.py)
runs its actions in the same order.

- ``gpipe``: every forward, then every backward; a stage keeps the activations of all
  ``M`` micro-batches alive.
- ``1f1b``: after ``S - s - 1`` warm-up forwards, stage ``s`` alternates one forward
  and one backward, so at most ``S - s`` micro-batches' activations are alive.
- ``interleave``: the model is cut into ``S * v`` chunks, chunk ``c`` on stage
  ``c % S`` (Megatron-LM's interleaved schedule); micro-batches go through in groups of
  ``S`` (``M`` must be a multiple of ``S``). The bubble shrinks by ``v``.

With equal stage costs (a forward ``f``, a backward ``b`` per stage, ``f / v`` and
``b / v`` per chunk) both schedules take ``(M + S - 1)(f + b)``: the bubble fraction
is ``(S - 1) / (M + S - 1)``; interleaving divides the bubble time by ``v``, giving
``(S - 1) / (v M + S - 1)``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

from fshard.errors import ArgumentError

SCHEDULERS = ("1f1b", "gpipe")


class Action(NamedTuple):
    """One step of a stage: ``kind`` is ``"F"``/``"B"`` (compute), ``"send_F"``/
    ``"recv_F"`` (activations) or ``"send_B"``/``"recv_B"`` (cotangents);
    ``micro_batch``; ``chunk`` the model stage it belongs to; ``peer`` the stage a
    transfer goes to or comes from. ``action[:2] == ("F", 0)`` reads as the issue of
    a schedule usually does."""

    kind: str
    micro_batch: int
    chunk: int
    peer: int | None = None

    def __repr__(self) -> str:
        tail = "" if self.peer is None else f", peer={self.peer}"
        return f"({self.kind!r}, {self.micro_batch}, chunk={self.chunk}{tail})"


class Event(NamedTuple):
    """A compute action placed in time on its stage."""

    stage: int
    action: Action
    start: Fraction
    end: Fraction


class Round(NamedTuple):
    """The transfers that happen at ``time`` (when the actions that produce them end):
    ``forward`` and ``backward`` are lists of ``(src_stage, dst_stage, chunk, m)``
    with ``chunk`` the receiving chunk."""

    time: Fraction
    forward: list
    backward: list


def check_config(stages, micro_batches, scheduler, virtual_stages=1) -> None:
    """The schedule errors, named after ``AutoParallel.pipeline``'s arguments."""
    for name, v in (("stages", stages), ("micro_batches", micro_batches),
                    ("virtual_stages", virtual_stages)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArgumentError(
                f"AutoParallel.pipeline({name}=...) must be an int >= 1; got {v!r}.")
    if scheduler not in SCHEDULERS:
        raise ArgumentError(
            f"AutoParallel.pipeline(scheduler=...) must be one of {SCHEDULERS}; got "
            f"{scheduler!r}.")
    if scheduler == "1f1b" and micro_batches < stages:
        raise ArgumentError(
            f"AutoParallel.pipeline(scheduler='1f1b') needs at least as many micro-batches "
            f"as stages: got micro_batches={micro_batches} < stages={stages} (the "
            f"pipeline would never reach its steady one-forward-one-backward state).\nFix: "
            f"micro_batches >= {stages}, or scheduler='gpipe'.")
    if virtual_stages > 1 and micro_batches % stages:
        raise ArgumentError(
            f"AutoParallel.pipeline(interleave=True) sends micro-batches through in groups "
            f"of `stages`: micro_batches={micro_batches} is not a multiple of "
            f"stages={stages}.\nFix: micro_batches a multiple of {stages}.")


def compute_order(stage: int, stages: int, micro_batches: int, scheduler: str,
                  virtual_stages: int = 1) -> list[Action]:
    """The F/B actions of ``stage`` in the order it runs them."""
    S, M, v = stages, micro_batches, virtual_stages
    if v == 1:
        fwd = [Action("F", m, stage) for m in range(M)]
        bwd = [Action("B", m, stage) for m in range(M)]
        warm = M if scheduler == "gpipe" else min(S - stage - 1, M)
    else:
        # micro-step i: micro-batch (i // (S v)) S + i % S on local chunk (i // S) % v
        def seq(kind, reverse):
            out = []
            for i in range(M * v):
                k = (i // S) % v
                k = v - 1 - k if reverse else k
                out.append(Action(kind, (i // (S * v)) * S + i % S, k * S + stage))
            return out

        fwd, bwd = seq("F", False), seq("B", True)
        warm = M * v if scheduler == "gpipe" else min((S - stage - 1) * 2 + (v - 1) * S,
                                                       M * v)
    order = fwd[:warm]
    for i in range(len(fwd) - warm):
        order += [fwd[warm + i], bwd[i]]
    return order + bwd[len(fwd) - warm:]


class Schedule:
    """The schedule of one pipeline configuration (see the module docstring).

    >>> s = Schedule(stages=2, micro_batches=4, scheduler="1f1b")
    >>> [a[:2] for a in s.compute(1)][:4]
    [('F', 0), ('B', 0), ('F', 1), ('B', 1)]
    >>> float(s.timeline().bubble_fraction)  # (S - 1) / (M + S - 1)
    0.2
    """

    def __init__(self, stages: int, micro_batches: int, scheduler: str = "1f1b",
                 virtual_stages: int = 1):
        check_config(stages, micro_batches, scheduler, virtual_stages)
        self.stages, self.micro_batches = stages, micro_batches
        self.scheduler, self.virtual_stages = scheduler, virtual_stages
        self.n_chunks = stages * virtual_stages
        self._compute = [compute_order(s, stages, micro_batches, scheduler, virtual_stages)
                         for s in range(stages)]

    def stage_of(self, chunk: int) -> int:
        return chunk % self.stages

    def compute(self, stage: int) -> list[Action]:
        """The F/B actions of ``stage``, in order."""
        return list(self._compute[stage])

    def timeline(self, forward=1, backward=2) -> "Timeline":
        """Simulate the schedule: a forward of one stage's layers costs ``forward``, a
        backward ``backward`` (each chunk ``1 / v`` of that); transfers are free."""
        return Timeline(self, Fraction(forward), Fraction(backward))

    def actions(self, stage: int) -> list[Action]:
        """The ordered actions of ``stage``: its computations with each receive right
        before the computation that needs it and each send right after the
        computation that produces it."""
        return self.timeline().actions(stage)

    def __repr__(self) -> str:
        v = f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"Schedule(stages={self.stages}, micro_batches={self.micro_batches}, "
                f"scheduler={self.scheduler!r}{v})")


class Timeline:
    """Start and end of every computation of a schedule (exact fractions)."""

    def __init__(self, schedule: Schedule, forward: Fraction, backward: Fraction):
        self.schedule = schedule
        S, C, v = schedule.stages, schedule.n_chunks, schedule.virtual_stages
        cost = {"F": forward / v, "B": backward / v}
        end: dict = {}
        free = [Fraction(0)] * S
        pos = [0] * S
        orders = [schedule.compute(s) for s in range(S)]
        self.events: list[Event] = []
        while any(pos[s] < len(orders[s]) for s in range(S)):
            progressed = False
            for s in range(S):
                while pos[s] < len(orders[s]):
                    a = orders[s][pos[s]]
                    if a.kind == "F":
                        dep = ("F", a.chunk - 1, a.micro_batch) if a.chunk else None
                    elif a.chunk < C - 1:
                        dep = ("B", a.chunk + 1, a.micro_batch)
                    else:
                        dep = ("F", a.chunk, a.micro_batch)
                    if dep is not None and dep not in end:
                        break
                    start = max(free[s], end[dep]) if dep is not None else free[s]
                    free[s] = start + cost[a.kind]
                    end[(a.kind, a.chunk, a.micro_batch)] = free[s]
                    self.events.append(Event(s, a, start, free[s]))
                    pos[s] += 1
                    progressed = True
            assert progressed, f"{schedule!r} deadlocks"  # a bug in compute_order
        self.total = max(e.end for e in self.events)
        self.busy = [sum((e.end - e.start for e in self.events if e.stage == s), Fraction(0))
                     for s in range(S)]
        self._rounds = self._make_rounds()

    @property
    def bubble(self) -> Fraction:
        """Idle time of a stage, averaged over the stages."""
        return self.total - sum(self.busy) / len(self.busy)

    @property
    def bubble_fraction(self) -> Fraction:
        """The fraction of the step the stages sit idle."""
        return self.bubble / self.total

    def peak_activations(self) -> list[int]:
        """Per stage: the most (chunk, micro-batch) activations alive at once (from a
        chunk's forward until its backward)."""
        out = []
        for s in range(self.schedule.stages):
            live = peak = 0
            for a in self.schedule.compute(s):
                live += 1 if a.kind == "F" else -1
                peak = max(peak, live)
            out.append(peak)
        return out

    # -- transfers ---------------------------------------------------------------------
    def _make_rounds(self) -> list[Round]:
        sched = self.schedule
        C = sched.n_chunks
        by_time: dict = {}
        for e in self.events:
            a = e.action
            if a.kind == "F" and a.chunk < C - 1:
                dst = sched.stage_of(a.chunk + 1)
                if dst != e.stage:
                    by_time.setdefault(e.end, ([], []))[0].append(
                        (e.stage, dst, a.chunk + 1, a.micro_batch))
            elif a.kind == "B" and a.chunk > 0:
                dst = sched.stage_of(a.chunk - 1)
                if dst != e.stage:
                    by_time.setdefault(e.end, ([], []))[1].append(
                        (e.stage, dst, a.chunk - 1, a.micro_batch))
        return [Round(t, f, b) for t, (f, b) in sorted(by_time.items())]

    def rounds(self) -> list[Round]:
        """The transfer rounds, in time order."""
        return list(self._rounds)

    def program_order(self) -> list:
        """Every computation (an ``Event``) and transfer round (a ``Round``) in one
        order that respects each stage's order and every dependency: a round at time
        ``t`` comes after the computations that start before ``t`` and before those
        that start at ``t`` or later. Each stage runs its restriction of it."""
        keyed = [((e.start, 1, e.stage), e) for e in self.events]
        keyed += [((r.time, 0, -1), r) for r in self._rounds]
        return [x for _, x in sorted(keyed, key=lambda kx: kx[0])]

    def actions(self, stage: int) -> list[Action]:
        out = []
        for item in self.program_order():
            if isinstance(item, Round):
                for src, dst, chunk, m in item.forward:
                    if src == stage:
                        out.append(Action("send_F", m, chunk - 1, dst))
                    if dst == stage:
                        out.append(Action("recv_F", m, chunk, src))
                for src, dst, chunk, m in item.backward:
                    if src == stage:
                        out.append(Action("send_B", m, chunk + 1, dst))
                    if dst == stage:
                        out.append(Action("recv_B", m, chunk, src))
            elif item.stage == stage:
                out.append(item.action)
        return out

    # -- pictures ----------------------------------------------------------------------
    def render(self, width: int | None = None):
        """A rich ``Text``: one row per stage, one cell per time unit of the smallest
        action; ``F``/``B`` cells show the micro-batch, ``.`` is idle."""
        from rich.text import Text

        unit = min(e.end - e.start for e in self.events)
        n = int(self.total / unit)
        text = Text()
        sched = self.schedule
        title = (f"{sched.scheduler}{' interleaved' if sched.virtual_stages > 1 else ''}: "
                 f"S={sched.stages} M={sched.micro_batches}"
                 f"{f' v={sched.virtual_stages}' if sched.virtual_stages > 1 else ''}  "
                 f"bubble {float(self.bubble_fraction):.1%}\n")
        text.append(title, style="bold")
        palette = ["red", "green", "blue", "magenta", "cyan", "yellow"]
        for s in range(sched.stages):
            cells = [(".", "dim")] * n
            for e in self.events:
                if e.stage != s:
                    continue
                a = e.action
                colour = palette[a.micro_batch % len(palette)]
                style = f"bold white on {colour}" if a.kind == "F" else f"black on {colour}"
                label = f"{a.kind}{a.micro_batch}"
                i0, i1 = int(e.start / unit), int(e.end / unit)
                for i in range(i0, i1):
                    cells[i] = ((label + " " * 3)[:3] if i == i0 else "   ", style)
            text.append(f"stage {s} ", style="bold")
            for c, style in cells:
                text.append(c if len(c) == 3 else " . ", style=style)
            text.append("\n")
        return text

    def plot(self, path=None, ax=None):
        """A matplotlib picture of the timeline (saved to ``path`` if given)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        sched = self.schedule
        own = ax is None
        if own:
            fig, ax = plt.subplots(figsize=(max(6, float(self.total) * 0.35),
                                            0.6 * sched.stages + 1.2))
        cmap = plt.get_cmap("tab10")
        for e in self.events:
            a = e.action
            colour = cmap(a.micro_batch % 10)
            ax.broken_barh([(float(e.start), float(e.end - e.start))], (e.stage - 0.4, 0.8),
                           facecolors=colour, edgecolors="black",
                           alpha=1.0 if a.kind == "F" else 0.55,
                           hatch=None if a.kind == "F" else "//")
            ax.text(float(e.start + e.end) / 2, e.stage, f"{a.kind}{a.micro_batch}",
                    ha="center", va="center", fontsize=7)
        ax.set_yticks(range(sched.stages))
        ax.set_yticklabels([f"stage {s}" for s in range(sched.stages)])
        ax.invert_yaxis()
        ax.set_xlabel("time (one stage's forward = 1)")
        ax.set_title(f"{sched!r}: bubble {float(self.bubble_fraction):.1%}")
        if own:
            fig.tight_layout()
            if path is not None:
                fig.savefig(path, dpi=110)
            plt.close(fig)
        return ax
