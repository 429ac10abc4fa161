"""``ae.explain()``: what the engine did with the program and why, in the program's terms.

A ``Report`` is a snapshot taken from the engine's own records, nothing is measured for it:

* paths: every trie path segments ended at (tracer.lifecycle.Path): its ops, state, the
  user lines it spans, its replays, and the host time per segment measured cold and
  replayed (``cold_times`` / ``replay_times``);
* events: every fallback and boundary reason with its count and the user lines it happened
  at (Note [Where events happen] in scheduler.stats);
* steps: the counters at each step of the governor's clock (optimizer steps, else groups of
  host reads, else ``mark_step``), for ``plot()`` and ``to_records()``;
* advice: rules over the above that name a line and what to do about it.

Renders as text (``print``, the REPL) and as HTML in Jupyter; ``to_records()``,
``to_csv(path)`` and ``to_parquet(path)`` export it for tools.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import os
import re
import statistics
from html import escape

from adaptive_eager.tracer.lifecycle import HOT, RETIRED, WARM
from adaptive_eager.scheduler.stats import STEP_FIELDS

__all__ = ["Report", "PathInfo", "Event", "collect"]

SHOWN = 8  # paths and lines listed per section in the text and HTML views
EVENTS_SHOWN = 20  # fallback and boundary reasons listed per section in the text view
CODE_SHOWN = 20_000  # characters of a graph's code in the HTML view
RECORD_FIELDS = ("kind", "id", "state", "backend", "ops", "count", "launched", "reason",
                 "where", "saved_us", "ops_deferred", "ops_eager", "launches", "compiles",
                 "divergences", "suspended")


@dataclasses.dataclass(frozen=True)
class PathInfo:
    """One captured path (``graph<gid>``)."""

    gid: int
    state: str  # "hot" (replayed as one launch), "cold" or "retired"
    backend: str  # how a replay runs: a fused micro-graph, or the exact replay
    n_ops: int
    replays: int
    seen: int  # segments that ended on this path
    # user lines its ops were issued at when first learned (paths share their prefixes: a
    # prefix learned in one function keeps that function's lines), in order
    lines: tuple
    ops: tuple  # (aten op, count), most frequent first
    why: str  # why it is not hot (cold, retired), or why it replays exactly
    # Host time of one segment, microseconds: the fastest run eagerly (the engine learning
    # alongside; later cold runs only walk the trie), and the median replayed. On a device
    # with an asynchronous queue a replay's time is the host's: the submission.
    cold_us: float | None
    replay_us: float | None
    code: str = ""  # the compiled micro-graph's code, where one exists

    @property
    def saved_us(self) -> float | None:
        if self.cold_us is None or self.replay_us is None:
            return None
        return self.cold_us - self.replay_us

    def span(self) -> str:
        if not self.lines:
            return "<unknown>"
        if len(self.lines) == 1:
            return _rel(self.lines[0])
        return f"{_rel(self.lines[0])} .. {_rel(self.lines[-1])} ({len(self.lines)} lines)"

    def op_summary(self, n: int = 6) -> str:
        head = ", ".join(f"{op} x{k}" if k > 1 else op for op, k in self.ops[:n])
        return head + (f", +{len(self.ops) - n} more kinds" if len(self.ops) > n else "")


@dataclasses.dataclass(frozen=True)
class Event:
    """A fallback or boundary reason: how often, and where (sampled user lines)."""

    kind: str  # "fallback" | "boundary"
    reason: str
    count: int
    lines: tuple  # ((file:line, sampled count), ...), most frequent first
    launched: int = 0  # boundaries only: how many ended a deferred segment (launched it)

    def where(self, n: int = 3) -> str:
        if not self.lines:
            return ""
        shown = ", ".join(_rel(line) for line, _ in self.lines[:n])
        more = len(self.lines) - n
        return shown + (f" and {more} more" if more > 0 else "")


class Report:
    """The engine's account of the program (``ae.explain()``)."""

    def __init__(self, stats, paths, events, steps, advice, hot_threshold):
        self.stats = stats
        self.paths = paths
        self.events = events
        self.steps = steps  # per-step dicts (see ``to_records``)
        self.advice = advice
        self.hot_threshold = hot_threshold

    @property
    def hot(self) -> list:
        return [p for p in self.paths if p.state == "hot"]

    @property
    def cold(self) -> list:
        return [p for p in self.paths if p.state != "hot"]

    def events_of(self, kind: str) -> list:
        return [e for e in self.events if e.kind == kind]

    def code(self, gid: int) -> str:
        """The generated code of ``graph<gid>`` (empty if it has no compiled graph)."""
        for p in self.paths:
            if p.gid == gid:
                return p.code
        raise KeyError(f"no graph{gid}; graphs: {', '.join(str(p.gid) for p in self.paths)}")

    # ------------------------------------------------------------------ text

    def __repr__(self) -> str:
        s = self.stats
        out = [f"adaptive_eager explain: {_n(len(self.hot), 'hot path')}, "
               f"{len(self.cold)} not hot, "
               f"{_n(len(self.events_of('fallback')), 'fallback reason')}, "
               f"{_n(len(self.events_of('boundary')), 'boundary reason')}",
               f"  {s.ops_intercepted} ops intercepted, {s.ops_deferred} deferred; "
               f"{s.launches} launches, {s.launches_saved} saved; {s.graphs_compiled} graphs "
               f"compiled ({s.compile_seconds:.2f} s in the background)"]
        out.append("")
        out.append("Hot paths (each segment replayed as one launch):"
                   + ("" if self.hot else " none"))
        for p in self.hot[:SHOWN]:
            saved = ("" if p.saved_us is None else
                     f", saves {_us(p.saved_us)}/replay ({_us(p.cold_us)} cold -> "
                     f"{_us(p.replay_us)})")
            how = f"{p.backend} ({p.why})" if p.why else p.backend
            out.append(f"  graph{p.gid}: {_n(p.n_ops, 'op')}, replayed {p.replays}x, {how}{saved}")
            out.append(f"    lines {p.span()}")
            out.append(f"    ops   {p.op_summary()}")
        _more(out, self.hot, "hot paths")
        out.append("Not hot:" + ("" if self.cold else " none"))
        for p in self.cold[:SHOWN]:
            out.append(f"  graph{p.gid}: {_n(p.n_ops, 'op')} at {p.span()}: {p.state}, {p.why}")
        _more(out, self.cold, "paths")
        events = self.events_of("fallback")
        out.append("Fallbacks (fast path not taken), count:" + ("" if events else " none"))
        for e in events[:EVENTS_SHOWN]:
            where = e.where()
            out.append(f"  {e.count:>7}  {e.reason}" + (f"  [at {where}]" if where else ""))
        _more(out, events, "fallback reasons", EVENTS_SHOWN, "Report.events")
        events = self.events_of("boundary")
        out.append("Boundaries (where segments end), count / launching deferred work:"
                   + ("" if events else " none"))
        for e in events[:EVENTS_SHOWN]:
            where = e.where()
            out.append(f"  {e.count:>7} {e.launched:>7}  {e.reason}"
                       + (f"  [at {where}]" if where else ""))
        _more(out, events, "boundary reasons", EVENTS_SHOWN, "Report.events")
        out.append("Advice:" + ("" if self.advice else " none"))
        out += [f"  - {a}" for a in self.advice]
        return "\n".join(out)

    __str__ = __repr__

    # ------------------------------------------------------------------ HTML

    def _repr_html_(self) -> str:
        s = self.stats
        h = ['<div class="adaptive-eager-explain">',
             "<h4>adaptive_eager explain</h4>",
             f"<p>{s.ops_intercepted} ops intercepted, {s.ops_deferred} deferred; "
             f"{s.launches} launches, {s.launches_saved} saved; {s.graphs_compiled} graphs "
             f"compiled ({s.compile_seconds:.2f} s in the background)</p>"]
        h.append("<b>Hot paths</b>")
        rows = [(f"graph{p.gid}", p.n_ops, p.replays,
                 f"{p.backend} ({p.why})" if p.why else p.backend,
                 "" if p.saved_us is None else _us(p.saved_us), p.span(),
                 _details("ops", p.op_summary(100)) + _details("code", p.code, pre=True))
                for p in self.hot]
        h.append(_table(("graph", "ops", "replays", "runs as", "saved/replay", "lines", ""),
                        rows))
        h.append("<b>Not hot</b>")
        rows = [(f"graph{p.gid}", p.n_ops, p.state, p.why, p.span()) for p in self.cold]
        h.append(_table(("graph", "ops", "state", "why", "lines"), rows))
        h.append("<b>Fallbacks</b>")
        rows = [(e.count, e.reason, e.where(SHOWN)) for e in self.events_of("fallback")]
        h.append(_table(("count", "reason", "at"), rows))
        h.append("<b>Boundaries</b>")
        rows = [(e.count, e.launched, e.reason, e.where(SHOWN))
                for e in self.events_of("boundary")]
        h.append(_table(("count", "launched work", "reason", "at"), rows))
        h.append("<b>Advice</b>")
        h.append("<ul>" + "".join(f"<li>{escape(a)}</li>" for a in self.advice) + "</ul>"
                 if self.advice else "<p>none</p>")
        h.append("</div>")
        return "\n".join(h)

    # ------------------------------------------------------------------ export

    def to_records(self) -> list:
        """One dict per path, event, step and piece of advice, all with the keys
        ``RECORD_FIELDS`` (None where a key does not apply to the kind)."""
        out = []
        for p in self.paths:
            out.append(_record(kind="path", id=p.gid, state=p.state, backend=p.backend,
                               ops=p.n_ops, count=p.replays, reason=p.why,
                               where="; ".join(p.lines), saved_us=p.saved_us))
        for e in self.events:
            out.append(_record(kind=e.kind, reason=e.reason, count=e.count,
                               launched=e.launched if e.kind == "boundary" else None,
                               where="; ".join(line for line, _ in e.lines)))
        for i, step in enumerate(self.steps):
            out.append(_record(kind="step", id=i, **step))
        for a in self.advice:
            out.append(_record(kind="advice", reason=a))
        return out

    def to_csv(self, path) -> None:
        """Write ``to_records()`` as CSV (one header row of ``RECORD_FIELDS``)."""
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=RECORD_FIELDS)
            writer.writeheader()
            writer.writerows(self.to_records())

    def to_parquet(self, path) -> None:
        """Write ``to_records()`` as Parquet (needs pandas with pyarrow or fastparquet)."""
        try:
            import pandas
        except ImportError:
            raise ImportError("Report.to_parquet needs pandas (and pyarrow): "
                              "pip install pandas pyarrow; to_csv needs nothing") from None
        pandas.DataFrame.from_records(self.to_records(), columns=RECORD_FIELDS).to_parquet(path)

    # ------------------------------------------------------------------ picture

    def plot(self, ax=None):
        """Per step: ops deferred vs run eagerly (bars) and launches (line), with compiles
        and divergences marked. Returns the matplotlib Figure. Needs matplotlib."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("explain().plot() needs matplotlib: pip install matplotlib "
                              "(to_records() and to_csv() need nothing)") from None
        steps = self.steps
        if ax is None:
            fig, ax = plt.subplots(figsize=(8, 3.5))
        else:
            fig = ax.figure
        x = list(range(len(steps)))
        deferred = [s["ops_deferred"] for s in steps]
        eager = [s["ops_eager"] for s in steps]
        ax.bar(x, deferred, color="tab:blue", label="ops deferred")
        ax.bar(x, eager, bottom=deferred, color="tab:gray", label="ops run eagerly")
        ax.set_xlabel("step")
        ax.set_ylabel("ops")
        right = ax.twinx()
        right.plot(x, [s["launches"] for s in steps], color="tab:orange", marker=".",
                   label="launches")
        right.set_ylabel("launches")
        right.set_ylim(bottom=0)
        first = True
        for i, s in enumerate(steps):
            if s["compiles"]:
                ax.axvline(i, color="tab:green", linestyle="--", linewidth=1,
                           label="graph compiled" if first else None)
                first = False
        div = [i for i, s in enumerate(steps) if s["divergences"]]
        if div:
            ax.plot(div, [0] * len(div), "rx", markersize=8, clip_on=False,
                    label="diverged")
        handles, labels = ax.get_legend_handles_labels()
        h2, l2 = right.get_legend_handles_labels()
        ax.legend(handles + h2, labels + l2, loc="upper center", bbox_to_anchor=(0.5, -0.2),
                  ncol=4, fontsize="small", frameon=False)
        ax.set_title("adaptive_eager: per step")
        if not steps:
            ax.text(0.5, 0.5, "no steps recorded yet (optimizer steps, host reads or "
                    "mark_step)", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        return fig


# ---------------------------------------------------------------------- collecting


def collect(engine) -> Report:
    """Take the report from ``engine`` (all threads)."""
    stats = engine.stats()
    with engine._lock:
        modes = list(engine.modes)
        counters = list(engine.counters)
    threshold = 0
    paths = []
    for mode in modes:
        threshold = mode.config.hot_threshold
        stack = [mode.root]
        while stack:
            node = stack.pop()
            stack += node.children.values()
            if node.path is not None and node.path.specs:
                paths.append(_path_info(engine, mode, node))
    order = {"hot": 0, "retired": 1, "cold": 2}
    paths.sort(key=lambda p: (order[p.state], -p.replays, -p.seen, p.gid))
    where: dict = collections.defaultdict(collections.Counter)
    for c in counters:
        for key, lines in list(c.where.items()):  # copies: the owner thread may be adding
            where[key].update(dict(lines))
    events = [Event(kind, reason, n, tuple(where[(kind, reason)].most_common()),
                    stats.flushes.get(reason, 0) if kind == "boundary" else 0)
              for kind, table in (("fallback", stats.fallbacks), ("boundary", stats.boundaries))
              for reason, n in table.items()]
    events.sort(key=lambda e: (e.kind != "fallback", -e.count, e.reason))
    steps = _steps(max(counters, key=lambda c: len(c.steps), default=None))
    report = Report(stats, paths, events, steps, [], threshold)
    report.advice = advise(report)
    return report


def _path_info(engine, mode, node) -> PathInfo:
    path = node.path
    ops = collections.Counter(_short(s.func) for s in path.specs)
    code = ""
    graphs = [engine.cache.peek(k) for k in list(path.variants.values())]
    graphs = [g for g in graphs if g is not None]
    if graphs:
        code = graphs[0].code
    threshold = mode.config.hot_threshold
    if path.state in (HOT, WARM):
        state = "hot"
        if path.backend == "exact":
            backend, why = "exact replay", ""
        elif path.fused_off:
            backend, why = "exact replay", path.fused_off
        elif graphs:
            backend, why = f"fused {graphs[0].backend} graph", ""
            if graphs[0].size_guards is not None:  # Note [Family graphs]
                backend += " for every size of its family"
        else:
            backend, why = "exact replay", "its graph is compiling"
        if path.from_disk:  # Note [Warm start]
            why = "from the warm-start cache" + (f"; {why}" if why else "")
    elif path.state == RETIRED:
        state, backend, why = "retired", "eager", path.reason
    else:
        state, backend = "cold", "eager"
        if node.ends < threshold:
            why = (f"seen {node.ends} time{'s' if node.ends != 1 else ''}, hot after "
                   f"{threshold}")
        else:
            why = "ended only where the program ran with the engine aside or paused"
    return PathInfo(
        gid=path.gid, state=state, backend=backend, n_ops=len(path.specs),
        replays=path.replays, seen=node.ends, lines=path.lines,
        ops=tuple(ops.most_common()), why=why,
        cold_us=_us_of(min, path.cold_times), replay_us=_us_of(statistics.median,
                                                                path.replay_times),
        code=code,
    )


def _steps(counters) -> list:
    if counters is None:
        return []
    out = []
    prev = (0,) * len(STEP_FIELDS)
    for row in list(counters.steps):
        d = dict(zip(STEP_FIELDS, (a - b for a, b in zip(row, prev))))
        out.append({"ops_deferred": d["ops_deferred"], "ops_eager": d["ops_eager"],
                    "launches": d["ops_eager"] + d["replays"], "compiles": d["graphs_compiled"],
                    "divergences": d["diverged"], "suspended": d["steps_suspended"]})
        prev = row
    return out


# ---------------------------------------------------------------------- advice


def advise(report: Report) -> list:
    """Concrete advice, each naming the line it is about."""
    out = []
    # fallbacks counted by an op that always runs eagerly: "<why>: <namespace>.<op>.<overload>"
    boundary_ops = {e.reason for e in report.events if e.kind == "fallback"
                    and re.fullmatch(r"[^:]+: \w+\.\w+\.\w+", e.reason)}
    for e in report.events:
        at = e.where(2)
        if e.kind == "boundary" and e.reason.startswith("host read: ") and e.launched >= 2:
            what = e.reason[len("host read: "):]
            out.append(f"{what} at {at} read a value the engine had not computed yet, so the "
                       f"deferred work was launched there ({e.launched} times): the step splits "
                       "into separate graphs at that line. Read it less often (every N "
                       "steps), or after the optimizer step.")
        elif e.kind == "fallback" and e.reason.startswith("data-dependent output shape"):
            op = e.reason.split(": ", 1)[-1]
            out.append(f"{op} at {at} returns a shape that depends on the data, so every "
                       "segment ends there and it runs eagerly: a fixed-shape form (a mask "
                       "with torch.where, or a padded result) keeps the step in one graph.")
        elif e.kind == "fallback" and e.reason.startswith("device copy: ") and e.count >= 2:
            out.append(f"A copy between devices at {at} runs eagerly and ends the segment "
                       f"({e.count} times): move the data once, before the loop, or keep the "
                       "step on one device.")
        elif (e.kind == "fallback" and e.count >= 2 and e.reason in boundary_ops
              and not e.reason.startswith("data-dependent output shape")):
            what, op = e.reason.rsplit(": ", 1)
            out.append(f"{op} at {at} always runs eagerly and ends the segment ({what}), "
                       f"{e.count} times: the step splits into separate graphs there.")
        elif e.kind == "fallback" and e.reason.startswith("path cut: "):
            out.append(f"The program takes different ops from step to step ({e.reason[10:]}):"
                       " the path is cut there, one extra launch per step. Make the branch "
                       "depend on no tensor data if it can.")
        elif e.kind == "fallback" and e.reason.endswith("graphs still compiling"):
            out.append("On this loop the engine was measured slower than eager while its "
                       "graphs were still compiling (its paths replayed their recorded ops "
                       f"one by one) and stepped aside ({e.reason.split(': ')[0]}): it is "
                       "measured again as soon as a graph arrives.")
        elif e.kind == "fallback" and e.reason.startswith("engine slower than eager"):
            out.append("On this loop the engine was measured slower than eager and stepped "
                       f"aside ({e.reason.split(': ')[0]}): here the engine's cost per op is "
                       "more than the launches it saves. It pays off where launches cost "
                       "(neuron, cuda) or where ops fuse.")
        elif e.kind == "fallback" and e.reason.startswith("shape variants of one path"):
            out.append(f"Shapes change between runs of one path at {at}: each shape is a new "
                       "graph, and past NEURON_ADAPTIVE_EAGER_VARIANTS they replay without "
                       "fusing. Pad or bucket the changing dimension.")
        elif e.kind == "fallback" and e.reason.startswith("not fused"):
            out.append(f"A graph was not fused ({e.reason}): Inductor would compute it "
                       "otherwise than eager, so its path replays as one exact launch with "
                       "eager's values. Nothing to report.")
        elif e.kind == "fallback" and e.reason.startswith("compile failed"):
            out.append(f"A graph failed to compile ({e.reason}); its path still replays as "
                       "one exact launch. Please report it with NEURON_ADAPTIVE_EAGER_DEBUG=4.")
        elif e.kind == "fallback" and e.reason.startswith("trie node budget exhausted"):
            out.append("The engine stopped learning (NEURON_ADAPTIVE_EAGER_MAX_TRIE_NODES): "
                       "the program rarely repeats an op sequence. Look for shapes or Python "
                       "numbers that change every step.")
        elif e.kind == "fallback" and e.reason.startswith("deterministic algorithms"):
            out.append("torch.use_deterministic_algorithms(True) is on: the engine does not "
                       "defer under it.")
    s = report.stats
    if s.ops_intercepted == 0:
        out.append("The engine has intercepted no op: enable it on the thread that runs the "
                   "program (ae.enable(), or NEURON_ADAPTIVE_EAGER=1 before Python starts).")
    elif s.ops_passthrough > (s.ops_intercepted - s.ops_passthrough):
        out.append(f"{s.ops_passthrough} of {s.ops_intercepted} ops ran on devices the engine "
                   "does not manage: put the model and data on a managed device, or list "
                   "theirs in devices= (NEURON_ADAPTIVE_EAGER_DEVICES).")
    once = sum(1 for p in report.cold if p.state == "cold" and p.seen <= 1)
    if once >= 16 and once > 2 * len(report.hot):
        out.append(f"{once} paths were seen only once: the program rarely repeats the same "
                   "ops on the same shapes (changing shapes, or Python numbers that change "
                   "every step).")
    return out


# ---------------------------------------------------------------------- helpers


def _rel(line: str) -> str:
    """A user line for display: relative to the working directory when under it."""
    cwd = os.getcwd() + os.sep
    return line[len(cwd):] if line.startswith(cwd) else line


def _record(**fields) -> dict:
    out = dict.fromkeys(RECORD_FIELDS)
    out.update(fields)
    return out


def _short(func) -> str:
    name = str(func)
    name = name[len("aten."):] if name.startswith("aten.") else name
    return name[:-len(".default")] if name.endswith(".default") else name


def _us_of(summary, times) -> float | None:
    times = list(times)
    return summary(times) * 1e6 if times else None


def _n(k: int, what: str) -> str:
    return f"{k} {what}{'' if k == 1 else 's'}"


def _us(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if abs(us) >= 1000 else f"{us:.0f} us"


def _more(out: list, items: list, what: str, shown: int = SHOWN,
          where: str = "Report.paths") -> None:
    if len(items) > shown:
        out.append(f"  ... and {len(items) - shown} more {what} ({where} has them all)")


def _details(title: str, text: str, pre: bool = False) -> str:
    if not text:
        return ""
    if len(text) > CODE_SHOWN:  # a whole training step's graph is long: Report.code(gid)
        text = (text[:CODE_SHOWN] + f"\n... {len(text) - CODE_SHOWN} more characters "
                "(Report.code(gid) has it all)")
    body = f"<pre>{escape(text)}</pre>" if pre else escape(text)
    return f"<details><summary>{title}</summary>{body}</details>"


def _table(header, rows) -> str:
    if not rows:
        return "<p>none</p>"
    h = ["<table>", "<tr>" + "".join(f"<th>{escape(str(c))}</th>" for c in header) + "</tr>"]
    for r in rows:
        cells = []
        for c in r:
            s = str(c)
            cells.append(f"<td>{s if s.startswith('<details>') else escape(s)}</td>")
        h.append("<tr>" + "".join(cells) + "</tr>")
    h.append("</table>")
    return "\n".join(h)
