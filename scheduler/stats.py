"""Counters. Each thread's engine state owns one ``Counters`` (no locks on the hot path; the
hot path itself increments nothing -- deferred ops are counted when their segment launches);
``snapshot`` sums them into the public ``Stats``."""

from __future__ import annotations

import array
import collections
import dataclasses
import logging

from .userline import user_line

__all__ = ["Counters", "Stats", "snapshot"]

log = logging.getLogger("adaptive_eager")

_FIELDS = (
    "ops_deferred", "ops_eager", "ops_views", "ops_host", "ops_passthrough",
    "replays", "graphs_compiled", "cache_hits", "cache_misses", "segments", "steps_suspended",
    "paths_restored", "graphs_loaded",
)


# Note [Where events happen]: each fallback and boundary is counted with the user's source
# line that caused it (scheduler.userline), for ``ae.explain()``. A frame walk costs a few
# microseconds, and a boundary ends every hot segment, so lines are sampled: every one of
# the first ``_ALL_LINES`` events of a reason, then one in ``_EVERY``. A line that occurs at
# all in a repeating program is found; the per-line counts are of the sampled events.
_ALL_LINES = 64
_EVERY = 256
_MAX_STEPS = 100_000  # per-step records kept for explain().plot()

# The cumulative counters recorded at each step (Counters.tick)
STEP_FIELDS = ("ops_deferred", "ops_eager", "replays", "graphs_compiled", "diverged",
               "steps_suspended")


class StepLog:
    """The per-step records (``Counters.tick``), newest last, at most ``_MAX_STEPS``.

    Kept as machine integers in one array, 48 bytes a step: as a deque of tuples of Python
    ints each step cost ~160 bytes, which a long run saw as its memory growing (a small MLP
    under ``exact``: +1.16 % RSS between steps 500 and 10,000, eager +0.31 %;
    ``python -m benchmarks.memory``)."""

    __slots__ = ("_a",)
    _W = len(STEP_FIELDS)

    def __init__(self):
        self._a = array.array("q")

    def append(self, row: tuple) -> None:
        a = self._a
        a.extend(row)
        if len(a) > self._W * _MAX_STEPS:  # drop the oldest quarter at once
            del a[:self._W * (_MAX_STEPS // 4)]

    def __len__(self) -> int:
        return len(self._a) // self._W

    def __iter__(self):
        a, w = self._a, self._W
        return (tuple(a[i:i + w]) for i in range(0, len(a), w))


class Counters:
    """Mutable per-thread counters. Attribute names match ``Stats`` fields."""

    __slots__ = _FIELDS + ("fallbacks", "boundaries", "flushes", "compile_seconds", "where",
                           "steps", "thread", "debug")

    def __init__(self):
        for f in _FIELDS:
            setattr(self, f, 0)
        self.fallbacks = collections.Counter()
        self.boundaries = collections.Counter()
        self.flushes = collections.Counter()  # boundaries that launched deferred work
        self.compile_seconds = 0.0
        # ("fallback" | "boundary", reason) -> Counter of user lines (Note [Where events happen])
        self.where: dict = {}
        self.steps = StepLog()
        # the owning thread: user lines of ops autograd runs on its worker threads are found
        # there (kept across resets)
        self.thread = getattr(self, "thread", None)
        self.debug = getattr(self, "debug", 0)  # NEURON_ADAPTIVE_EAGER_DEBUG (the mode's)

    def fallback(self, reason: str, n: int = 1) -> None:
        k = self.fallbacks[reason] + n
        self.fallbacks[reason] = k
        if k <= _ALL_LINES or not k % _EVERY:
            line = self._locate("fallback", reason)
            if k == n and self.debug >= 1:  # the ladder's level 1: each reason once
                log.info("fallback: %s (first at %s)", reason, line)

    def boundary(self, reason: str, launched: bool = False) -> None:
        if launched:
            self.flushes[reason] += 1
        k = self.boundaries[reason] + 1
        self.boundaries[reason] = k
        if k <= _ALL_LINES or not k % _EVERY:
            self._locate("boundary", reason)

    def _locate(self, kind: str, reason: str) -> str:
        lines = self.where.get((kind, reason))
        if lines is None:
            lines = self.where[(kind, reason)] = collections.Counter()
        line = user_line(3, self.thread)
        lines[line] += 1
        return line

    def tick(self) -> None:
        """One step of the program ended (the governor's clock): record where it stands."""
        self.steps.append((self.ops_deferred, self.ops_eager, self.replays,
                           self.graphs_compiled, self.fallbacks["diverged from the hot path"],
                           self.steps_suspended))


@dataclasses.dataclass(frozen=True)
class Stats:
    """A snapshot of the engine's counters (``ae.stats()``).

    ``launches`` counts what reaches a device queue: eager kernel ops plus micro-graph
    replays. View ops (metadata only) and host-scalar ops (0-dim CPU tensors the engine
    leaves on the host) are intercepted but are not launches.
    """

    ops_intercepted: int = 0
    ops_deferred: int = 0
    ops_eager: int = 0
    ops_views: int = 0
    ops_host: int = 0
    ops_passthrough: int = 0
    launches: int = 0
    replays: int = 0
    graphs_compiled: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    segments: int = 0
    steps_suspended: int = 0  # governor steps run in plain eager, the engine aside
    paths_restored: int = 0  # paths a run before this one learned (Note [Warm start])
    graphs_loaded: int = 0  # their graphs, loaded from the warm-start cache, not compiled
    compile_seconds: float = 0.0
    fallbacks: dict = dataclasses.field(default_factory=dict)
    boundaries: dict = dataclasses.field(default_factory=dict)
    flushes: dict = dataclasses.field(default_factory=dict)  # boundaries that launched work

    @property
    def launches_saved(self) -> int:
        """Launches eager would have made that the engine did not: each deferred op would
        have been one, each replay is one."""
        return max(0, self.ops_deferred - self.replays)

    def _rows(self) -> list:
        return [
            ("ops intercepted", self.ops_intercepted),
            ("  deferred (in micro-graphs)", self.ops_deferred),
            ("  eager", self.ops_eager),
            ("  views (metadata only)", self.ops_views),
            ("  host scalars", self.ops_host),
            ("  other devices (passed through)", self.ops_passthrough),
            ("launches", self.launches),
            ("  micro-graph replays", self.replays),
            ("  launches saved", self.launches_saved),
            ("graphs compiled", self.graphs_compiled),
            ("  compile time in background (s)", f"{self.compile_seconds:.2f}"),
            ("cache hits / misses", f"{self.cache_hits} / {self.cache_misses}"),
            ("paths restored from the warm-start cache", self.paths_restored),
            ("  graphs loaded from it", self.graphs_loaded),
            ("segments", self.segments),
            ("steps with the engine aside (slower)", self.steps_suspended),
        ]

    def _tables(self):
        return (("fallbacks", self.fallbacks), ("boundaries", self.boundaries))

    def __repr__(self) -> str:
        rows = self._rows()
        width = max(len(r[0]) for r in rows)
        lines = ["adaptive_eager stats"] + [f"  {k:<{width}}  {v}" for k, v in rows]
        for title, table in self._tables():
            lines.append(f"  {title}:" + ("" if table else " none"))
            for reason, n in sorted(table.items(), key=lambda kv: -kv[1]):
                lines.append(f"    {n:>8}  {reason}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The same table for Jupyter: counters, then fallbacks and boundaries by count."""
        from html import escape

        def row(name, value, indent=False):
            pad = ' style="padding-left:1.5em"' if indent else ""
            return (f"<tr><td{pad}>{escape(name.strip())}</td>"
                    f"<td style=\"text-align:right\">{escape(str(value))}</td></tr>")

        out = ["<table>", "<caption>adaptive_eager stats</caption>"]
        out += [row(k, v, k.startswith(" ")) for k, v in self._rows()]
        for title, table in self._tables():
            out.append(f"<tr><th colspan=\"2\" style=\"text-align:left\">{title}"
                       f"{'' if table else ': none'}</th></tr>")
            out += [row(reason, n, True)
                    for reason, n in sorted(table.items(), key=lambda kv: -kv[1])]
        out.append("</table>")
        return "\n".join(out)


def snapshot(counters) -> Stats:
    total = {f: 0 for f in _FIELDS}
    fallbacks, boundaries, flushes = (collections.Counter(), collections.Counter(),
                                      collections.Counter())
    seconds = 0.0
    for c in counters:
        for f in _FIELDS:
            total[f] += getattr(c, f)
        fallbacks.update(c.fallbacks)
        boundaries.update(c.boundaries)
        flushes.update(c.flushes)
        seconds += c.compile_seconds
    intercepted = (
        total["ops_deferred"] + total["ops_eager"] + total["ops_views"] + total["ops_host"]
        + total["ops_passthrough"]
    )
    return Stats(
        ops_intercepted=intercepted,
        launches=total["ops_eager"] + total["replays"],
        compile_seconds=seconds,
        fallbacks=dict(fallbacks),
        boundaries=dict(boundaries),
        flushes=dict(flushes),
        **total,
    )
