"""A path's life, in one place: its states, every transition, and what each does to the trie.

A ``Path`` is the artifact captured for one trie path (the root to a node where segments
end): its ops, its state and its compiled variants. Its states::

    cold --(ends >= hot_threshold)--> warm --(graph delivered)--> hot --(slower)--> retired
                                       warm --(compile refused or failed)--> hot, exact

* cold: segments along it run eagerly and end there (``after_end`` counts them);
* warm: it defers (the trie's nodes on it are marked hot, ``mark_hot``) and each segment
  launches as one exact replay while its fused graph compiles (Note [Warm paths replay
  exactly]); the ``exact`` backend goes straight to hot;
* hot: its segments launch the fused graph of their variant (``graph_for``), or, where the
  path has none (``fused_off``), the exact replay;
* retired: measured slower than eager, out of variants, cut short or blocked; its nodes
  are unmarked (``_unmark_hot``) and its segments run cold again.

Everything here runs on the thread that owns the trie (the engine's per-thread mode, passed
as ``mode``): compiles are requested from the background compiler and their deliveries
installed at the next segment end (``install``). The launch itself (scheduler.launch) is
handed the graph chosen here and reports back only what it did; it decides nothing.

Note [Warm paths replay exactly]: a warm path already defers. Its segments launch as one
``exact`` replay (bitwise eager, no compile needed) until the fused graph arrives, each
counted as the fallback "variant compiling: replayed exactly". A training loop therefore
reaches one launch per step after ``hot_threshold`` steps however long Inductor takes (a
cold C++ compile takes seconds on two cores), and the loop never waits for the compiler.
The exact tier is what the queue seam needs on launch-bound devices anyway: one submission
per segment.

Note [Cuts]: a hot segment *diverges* when its next op follows no hot child of the node it
reached: the deferred prefix launches and the rest runs cold. A branch that recurs soon
becomes hot itself and is followed through the slow path's key lookup; what keeps diverging
is a point where the program never repeats (a data-dependent branch, objects the signature
cannot match). After ``divergence_limit`` divergences at one node the path is *cut* there:
every segment, cold or hot, ends right after that node's op. The prefix becomes a path of
its own (deferred, launched, hot like any other), the remainder starts a new segment from
the root and goes hot on its own if it repeats, and the longer paths through the node
retire. So a path that keeps diverging costs one extra launch, counted with its reason (the
op, the node and both user lines), instead of a flush and a cold run every step; cuts are
never undone, so the trie stops growing there. A rare branch is not cut: it turns hot after
``hot_threshold`` runs and no longer diverges. Nor are many branches warming up in turn: a
divergence into a child seen fewer than ``hot_threshold`` times does not count (a loop over
8 batch sizes, whose first op, the weight's transpose, is shared: each size diverged there
on its way to hot, and the third cut every path after that first op, the step then ran as
a launch of one op and a cold rest, 5x eager).

Note [Shape families]: a path's signature holds its shapes, so a decode step with a cache
that grows by one token each step is a new path at every length, each with its own compile.
Paths with the same ops in the same order whatever their shapes form a *family*; a family's
fused compiles share the variant budget (``NEURON_ADAPTIVE_EAGER_VARIANTS``). The budget's
last compile is, where the family allows it, one graph for all its sizes (Note [Family
graphs], scheduler.symbolic; tracer.families decides), which later members join. A member
that cannot join, past the budget, goes hot as an exact replay (one launch, no compile),
counted with its first line.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics

from adaptive_eager.scheduler import compile_process
from adaptive_eager.scheduler.backends import Graph, compile_graph, exact_graph, plan
from adaptive_eager.scheduler.compiler import GraphKey
from adaptive_eager.scheduler.program import (InductorDiffers, OpFailed, Rec, alias_groups,
                                              host_call)
from adaptive_eager.scheduler.queues import queue_for

from . import families, native, trie, warm
from .signature import make_fast
from .trie import Node

__all__ = ["COLD", "WARM", "HOT", "RETIRED", "Path", "path_of", "after_end", "graph_for",
           "install", "retire", "block", "cut", "mark_hot"]

log = logging.getLogger("adaptive_eager")

COLD, WARM, HOT, RETIRED = "cold", "warm", "hot", "retired"


class Path:
    """The captured artifact of one path: its ops, state and compiled variants."""

    def __init__(self, specs, backend: str):
        self.specs = tuple(specs)
        self.backend = backend
        self.key = tuple(s.key for s in self.specs)
        self.ext_metas = tuple(m for s in self.specs for m in s.ext_metas)
        self.val_meta: list = []
        self.val_op: list = []
        for n, s in enumerate(self.specs):
            for o in s.outs:
                if o.kind in ("fresh", "view"):
                    self.val_meta.append(o.meta if o.kind == "fresh" else None)
                    self.val_op.append(n)
        self.fresh = tuple(i for i, m in enumerate(self.val_meta) if m is not None)
        metas = [m for m in self.ext_metas + tuple(self.val_meta) if m is not None]
        self.device_type = metas[0].device.type if metas else "cpu"
        queue = queue_for(self.device_type)
        if backend != "exact" and queue.compile_backend is not None:
            self.backend = backend = queue.compile_backend
        self.launch_early = queue.launch_early
        # Where the kernels run, when not on the recorded device (an emulated device's
        # backing CPU tensors): factory ops and compiled graphs are mapped there.
        compute = queue.compute_device
        self.device_map = ({self.device_type: compute}
                           if compute is not None and compute.type != self.device_type else None)
        self.kernels = queue.kernels or None
        self.host_call = host_call(self.device_map, self.kernels)
        self.end = None  # the trie node this path ends at (set by the tracer)
        self.state = COLD
        self.reason = ""
        self.variants: dict = {}  # variant -> GraphKey (requested or compiled)
        self.pending: set = set()  # variants requested and not delivered yet
        self.last_fused = False  # did the latest launch run the fused graph?
        self.fused_off = ""  # why this path has no fused graph (replays stay exact), else ""
        # Paths that differ only in shapes (a decode step at each length) form a family;
        # its compiles share the variant budget (Note [Shape families]).
        self.family = hash(tuple(s.func for s in self.specs))
        self.plans: dict = {}  # frozenset of dynamic float positions -> Plan
        self.reference = None  # floats of the first recorded run (Note [Float variants])
        self.dynamic: frozenset = frozenset()  # float positions seen to change
        self.exact = None
        self.cold_times = collections.deque(maxlen=8)
        self.hot_times = collections.deque(maxlen=8)  # fused replays (graph retirement)
        self.replay_times = collections.deque(maxlen=8)  # every deferred run (explain())
        self.replays = 0
        self.gid = 0
        self._randoms = None  # (op index, spec, probability argument) of its random ops
        self.zero_draws = None  # (tracer.hot_plan._zero_draws's answer,), once
        self.from_disk = False  # restored from the warm-start cache (Note [Warm start])
        # restored from a run that saw it end but not recur: replayed exactly, and warmed
        # like any path once it has ended hot_threshold times in this run (1 + its ends)
        self.tentative = 0
        self.unkept = False  # its record could not be written (counted once)
        self.rekeep = False  # variants requested since its record was written (warm.keep)
        # with warm start, the fresh values alive at its latest cold end: what a graph of it
        # compiled at exit returns (Note [Warm start], warm.keep_seen)
        self.cold_live = None

    def __repr__(self):
        return f"Path({len(self.specs)} ops, {self.state}, {self.backend})"

    @property
    def lines(self) -> tuple:
        return tuple(dict.fromkeys(s.line for s in self.specs))

    def draws(self, floats) -> bool:
        """Do this run's random ops draw numbers? Dropout-like ops with p == 0 do not."""
        randoms = self._randoms
        if randoms is None:
            randoms = self._randoms = [(n, s, probability_arg(s.func)) for n, s in
                                       enumerate(self.specs) if s.random]
        for n, spec, at in randoms:
            if at is None:
                return True
            i, name, default = at
            p = spec.args[i] if i < len(spec.args) else spec.kwargs.get(name, default)
            if type(p) is Rec:
                p = floats[n][p.j]
            if p:
                return True
        return False

    def exact_graph(self) -> Graph:
        if self.exact is None:
            self.exact = exact_graph(self.specs, len(self.ext_metas), self.device_map,
                                     self.kernels)
        return self.exact

    @property
    def plan(self):
        the_plan = self.plans.get(self.dynamic)
        if the_plan is None:
            the_plan = self.plans[self.dynamic] = plan(self.specs, self.dynamic, self.reference)
        return the_plan

    def observe(self, floats) -> bool:
        """Record one run's floats; True if a float seen before has changed (now dynamic)."""
        ref = self.reference
        if ref is None:
            self.reference = list(floats)
            return False
        changed = set()
        for n, (a, b) in enumerate(zip(ref, floats)):
            if a != b:
                changed.update((n, j) for j, (x, y) in enumerate(zip(a, b)) if x != y)
        changed -= self.dynamic
        if changed:
            self.dynamic = self.dynamic | changed
        return bool(changed)

    def variant(self, live: tuple, floats, pick=None) -> tuple:
        """(live outputs, lifted positions, specialized values): what one graph serves."""
        the_plan = self.plan
        return live, the_plan.lifted, (pick or pick_floats)(floats, the_plan.specialized)

    def builder(self, variant, process: bool = False, cpp_wrapper: bool = False,
                template=None, size=None):
        """The compile of ``variant``; of the family's symbolic graph given its ``template``
        (specs, ext metas, live metas) and this member's ``size`` (Note [Family graphs])."""
        args = self.compile_args(variant, template)
        backend = self.backend
        return lambda: compile_graph(backend, *args, process, cpp_wrapper, size)

    def compile_args(self, variant, template=None) -> tuple:
        """What a compile of ``variant`` takes: (specs, ext metas, live metas, plan, the
        specialized floats, device map, kernels)."""
        live, _, spec_values = variant  # computed from the current plan just before
        specs, ext_metas = self.specs, self.ext_metas
        live_metas = {i: self.val_meta[i] for i in live}
        if template is not None:
            specs, ext_metas, live_metas = template
        return (specs, ext_metas, live_metas, self.plan, spec_values, self.device_map,
                self.kernels)

    def graph_key(self, variant, symbolic: bool = False) -> GraphKey:
        return GraphKey(self.key + (("symbolic",) if symbolic else ()), self.backend, variant)

    def retire(self, reason: str) -> None:
        self.state = RETIRED
        self.reason = reason

    def profitable(self, ratio: float) -> bool:
        """False once the fused replays are measured slower than the eager segments."""
        if ratio <= 0 or len(self.hot_times) < 4 or len(self.cold_times) < 2:
            return True
        hot = statistics.median(list(self.hot_times)[1:])
        return hot <= ratio * statistics.median(self.cold_times)


def probability_arg(func):
    """(position, name, default) of a dropout-like op's probability argument, else None.

    The default matters: PyTorch leaves out an argument passed at its default value
    (``bernoulli_(0.5)`` is recorded as ``bernoulli_(t)``), and such an op draws."""
    for i, a in enumerate(func._schema.arguments):
        if a.name in ("p", "dropout_p"):
            return i, a.name, a.default_value or 0.0
    return None


# ---------------------------------------------------------------- transitions

def block(node: Node, reason: str, mode) -> None:
    """Never defer at ``node`` again; paths through it lose their graphs."""
    node.blocked = reason
    trie.changed()
    mode.counters.fallback(reason)
    stack = [node]
    while stack:
        n = stack.pop()
        if n.path is not None and n.path.state in (WARM, HOT):
            retire(mode, n.path, reason)
        stack += n.children.values()


def path_of(mode, node: Node) -> Path:
    path = node.path
    if path is None:
        path = node.path = Path(node.specs(), mode.config.backend_for("cpu"))
        path.end = node
        mode.engine.n_paths += 1
        path.gid = mode.engine.n_paths
    return path


def after_end(mode, node: Node, was_hot: bool, seconds: float) -> None:
    path = path_of(mode, node)
    if was_hot and path.state != COLD:
        path.replay_times.append(seconds)
        if path.tentative:  # Note [Warm start]: an earlier run saw it; this one sees it recur
            path.tentative += 1
            if path.tentative > mode.config.hot_threshold:
                path.tentative = 0
                if path.fused_off:  # replayed exactly so far: its graph is requested now
                    path.fused_off = ""
                    _warm(mode, node, path, marked=True)
                else:  # its graph was kept: hot like any path, and kept as one
                    warm.keep(mode, path)
            return
        if path.state == HOT and path.last_fused:
            path.hot_times.append(seconds)
            ratio = mode.config.retire_ratio
            # Under crosscheck every replay also runs eagerly: its times say nothing.
            if not mode.config.crosscheck and not path.profitable(ratio):
                retire(mode, path, f"slower than eager (ratio > {ratio})")
        return
    # A cold path: ended by a boundary after running eagerly, or, once a longer hot path was
    # cut at its end (Note [Cuts]), after being deferred as that path's prefix.
    path.observe(mode.seg.floats)
    if not was_hot:
        path.cold_times.append(seconds)
    if (mode.warm is not None and path.state == COLD and path.backend == "inductor"
            and mode.config.compile_process and not node.blocked):
        S = mode.seg  # what warm.keep_seen may compile at exit (Note [Warm start])
        path.cold_live = tuple(i for i in path.fresh if S.alive(i))
    if path.state == COLD:
        mode.learning += 1  # on its way to hot: recorded, checked, soon replayed
    if (path.state == COLD and path.backend == "inductor" and mode.config.compile_process
            and not mode.counters.paths_restored):
        # Note [Compiles leave the process]; a run that restored its paths (Note [Warm
        # start]) may need no compile at all: its child starts at a first request
        compile_process.prepare()
    if path.state == COLD and node.ends >= mode.config.hot_threshold:
        _warm(mode, node, path)


def cut(mode, node: Node, func, line: str) -> None:
    """Segments end after ``node`` from now on (Note [Cuts]); paths through it retire."""
    reason = (f"path cut: diverged {node.diverged} times after {node.spec.func} "
              f"({node.spec.line}), at {func} ({line})")
    node.cut = reason
    trie.changed()
    mode.counters.fallback(reason)
    if mode.debug >= 1:
        log.info("%s", reason)
    stack = list(node.children.values())
    while stack:
        n = stack.pop()
        if n.path is not None and n.path.state in (WARM, HOT):
            retire(mode, n.path, "cut short: " + reason)
        stack += n.children.values()
    node.ends_here = True
    trie.changed()


def _warm(mode, node: Node, path: Path, marked: bool = False) -> None:
    """The path recurred: deferred from now on (its nodes marked hot, unless ``marked``
    already), and its fused graph requested."""
    if path.backend == "exact":
        path.state = HOT
        mode.counters.graphs_compiled += 1
        if not marked:
            mark_hot(mode, node)
        warm.keep(mode, path)  # Note [Warm start]
        if mode.debug >= 1:
            log.info("graph%d ready: exact replay of %d ops (%s)", path.gid, len(path.specs),
                     path.specs[0].line)
        return
    S = mode.seg
    live = tuple(i for i in path.fresh if S.alive(i))
    path.state = WARM
    if not marked:
        mark_hot(mode, node)  # Note [Warm paths replay exactly]
    variant = path.variant(live, S.floats)
    fam = mode.families.get(path.family)
    if fam is None:
        fam = mode.families[path.family] = families.Family()
    # Note [Shape families], Note [Family graphs] (scheduler.symbolic)
    d = families.decide(fam, path, live, variant, mode.config.variant_budget)
    if d.why:
        mode.counters.fallback(f"{d.why}: replayed exactly ({path.specs[0].line})"
                               if d.kind == families.OVER else d.why)
    if d.kind == families.OVER:
        path.fused_off = "shape variants over budget"
        path.state = HOT
    elif d.kind == families.JOIN:
        path.variants[variant] = fam.key
        if fam.guards is None:  # still compiling: installed with the family's graph
            path.pending.add(variant)
            fam.waiting.append((path, variant, d.size))
        else:
            path.state = HOT
    elif d.kind == families.SYMBOLIC:
        fam.key = path.graph_key(variant, symbolic=True)
        request(mode, path, variant, d.template, d.size, fam.key)
    else:
        request(mode, path, variant)
    warm.keep(mode, path)  # Note [Warm start]: deferred from now on, so worth keeping


def request(mode, path: Path, variant, template=None, size=None, key=None) -> None:
    key = key or path.graph_key(variant)
    path.variants[variant] = key
    path.pending.add(variant)
    if mode.debug >= 1:
        log.info("compiling graph%d: %d ops, %d live outputs (%s .. %s)%s", path.gid,
                 len(path.specs), len(variant[0]), path.specs[0].line, path.specs[-1].line,
                 " for every size of its family" if template is not None else "")
    build = path.builder(variant, mode.config.compile_process, mode.config.cpp_wrapper,
                         template, size)
    if mode.warm is not None:  # the graph's file is written when it is built
        build = warm.persisting(build, key, mode.warm)
    mode.engine.compiler.request(key, build, mode.inbox, (mode.generation, path, variant))
    # its record names every variant, rewritten at exit (not here: pickling a record inside a
    # step cost a 65-op path 6 ms): a variant first launched while the path was warm is kept
    path.rekeep = path.state != COLD


def install(mode) -> None:
    """Take delivered compiles (on the owning thread) and make their paths hot."""
    inbox = mode.inbox
    c = mode.counters
    while inbox:
        (generation, path, variant), graph, error, built = inbox.popleft()
        path.pending.discard(variant)
        if generation != mode.generation:
            continue
        _install_family(mode, path, variant, graph, error)
        if path.state == RETIRED:
            continue
        if error is not None:
            # The path stays deferred as one exact replay per segment: a graph the backend
            # cannot build must not send a hot loop back to running cold.
            where = ""
            if isinstance(error, OpFailed):  # tracing the program failed at one of its ops
                where = f" at {path.specs[error.index].describe()}"
                error = error.error
            first = (str(error).splitlines() or [""])[0][:160]
            # a graph Inductor would compute otherwise than eager is refused, not failed
            differs = isinstance(error, InductorDiffers)
            what = "not fused" if differs else "compile failed"
            reason = f"{what}{where}: {type(error).__name__}: {first}"
            path.fused_off = ("Inductor would compute it otherwise than eager" if differs
                              else "its compile failed")
            if differs:  # a later run replays it exactly without asking again
                warm.keep(mode, path)
            c.fallback(reason)
            if mode.debug >= 1:
                log.warning("graph%d %s; replaying exactly", path.gid, reason)
            if path.state == WARM:
                path.state = HOT
            continue
        if built:
            c.graphs_compiled += 1
            c.compile_seconds += graph.compile_seconds
            if graph.wrapper_failed:  # Note [C++ wrappers] (scheduler/backends.py)
                c.fallback(f"C++ wrapper not built ({path.specs[0].line}): "
                           f"{graph.wrapper_failed}; Inductor's Python wrapper runs the graph")
        graph.gid = path.gid
        if mode.debug >= 1:
            log.info("graph%d ready: %s, %d ops, compiled in %.2fs", path.gid, graph.backend,
                     len(path.specs), graph.compile_seconds)
        if mode.debug >= 4:
            log.debug("graph%d code:\n%s", path.gid, graph.code)
        if path.state == WARM:
            path.state = HOT


def _install_family(mode, path: Path, variant, graph, error) -> None:
    """The family's symbolic graph arrived (or failed): its waiting members go hot with it,
    or replay exactly, counted (Note [Family graphs])."""
    fam = mode.families.get(path.family)
    if fam is None or fam.key is None or path.variants.get(variant) != fam.key:
        return
    waiting, fam.waiting = fam.waiting, []
    if error is not None:
        fam.failed = "the family's symbolic graph failed"
    else:
        fam.guards = graph.size_guards
    for member, v, size in waiting:
        member.pending.discard(v)
        if member.state == RETIRED:
            continue
        if error is None and fam.guards.admit(size):
            member.state = HOT
            continue
        member.fused_off = fam.failed or f"the family graph does not admit size {size}"
        mode.counters.fallback(f"{member.fused_off}: replayed exactly ({member.specs[0].line})")
        if member.state == WARM:
            member.state = HOT


def retire(mode, path: Path, reason: str) -> None:
    was_hot = path.state in (WARM, HOT)
    path.retire(reason)
    mode.counters.fallback(f"path retired: {reason}")
    if mode.debug >= 1:
        log.info("graph%d retired: %s", path.gid, reason)
    if path.end is not None:
        path.end.fast_end = None
    if was_hot:
        _unmark_hot(path.end)
    warm.forget(mode, path)


def graph_for(mode, path: Path, live: tuple):
    """The fused graph this launch of a warm or hot path runs, or None for its exact replay.

    A variant not compiled yet is requested (the launch replays exactly meanwhile); a path
    out of variants retires; a graph whose inputs break its assumptions is passed over. Each
    exact replay of a fused path is counted with its reason."""
    if path.backend == "exact" or path.state not in (WARM, HOT):
        return None
    seg, counters, debug = mode.seg, mode.counters, mode.debug
    if path.fused_off:
        counters.fallback(f"no fused graph ({path.fused_off}): replayed exactly")
        return None
    variant = path.variant(live, seg.floats, mode.pick_floats)
    key = path.variants.get(variant)
    if key is None and path.observe(seg.floats):  # a specialized float changed: lift it
        variant = path.variant(live, seg.floats, mode.pick_floats)
        key = path.variants.get(variant)
    graph = mode.cache.get(key) if key is not None else None
    if graph is None and path.tentative:
        # Note [Warm start]: seen in an earlier run, whose graph of it does not serve this
        # launch: nothing is compiled for it before it recurs in this run
        counters.fallback(f"no fused graph ({warm.SEEN}): replayed exactly")
        return None
    if graph is not None:
        counters.cache_hits += 1
        if debug >= 3:
            log.debug("cache hit graph%d %r", path.gid, key)
        if graph.mutates_external and (
                native.written_input_aliased(graph.plan, seg.exts)
                if mode.config.hot_path != "python" else
                written_input_aliased(graph.plan, seg.exts, alias_groups)):
            counters.fallback("a written input aliases another input: replayed exactly")
            return None
        if 0.0 in variant[2] and not same_zero_signs(graph.spec_values, variant[2]):
            counters.fallback("a specialized float changed its sign of zero: replayed exactly")
            return None
        return graph
    counters.cache_misses += 1
    if debug >= 3:
        log.debug("cache MISS graph%d %r: live outputs %d, specialized floats %s", path.gid,
                  key or path.graph_key(variant), len(live), variant[2])
    if key is None and len(path.variants) >= mode.config.variant_budget:
        retire(mode, path, "variant budget exhausted")
        return None
    if variant not in path.pending:  # new, or evicted from the cache since
        request(mode, path, variant)
    counters.fallback("variant compiling: replayed exactly")
    return None


def pick_floats(floats, at) -> tuple:
    """``floats[n][j]`` for each ``(n, j)`` of ``at`` (its compiled twin: tracer.native)."""
    return tuple(floats[n][j] for n, j in at)


def same_zero_signs(compiled, values) -> bool:
    return all(math.copysign(1.0, a) == math.copysign(1.0, b)
               for a, b in zip(compiled, values) if type(a) is float and a == 0.0)


def written_input_aliased(the_plan, exts, groups_of=alias_groups) -> bool:
    inputs = [exts[k] for k in the_plan.ext_inputs]
    groups = groups_of(inputs)
    shared = {g for g in groups if g >= 0}
    if not shared:
        return False
    for i in the_plan.mutated_inputs:
        if groups[i] >= 0 or i in shared:
            return True
    return False


# ---------------------------------------------------------------- marking the trie

def mark_hot(mode, end: Node) -> None:
    """A graph for the path ending at ``end`` is ready: make the path deferrable."""
    nodes = end.chain()
    compiled = mode.config.hot_path != "python"
    for n in nodes:
        if n.fast is None:
            n.fast, why = native.make_fast(n, n.parent.n_ext) if compiled else (None, "")
            if n.fast is None:
                n.fast = make_fast(n, n.parent.n_ext)
                if compiled:
                    mode.counters.fallback(f"hot path in Python ({why}) for {n.spec.func}")
    for n in nodes:
        n.hot_ends += 1
        n.parent.hot_next = n
    _refresh_ends(nodes)


def _unmark_hot(end: Node) -> None:
    """The path ending at ``end`` no longer has a graph."""
    nodes = end.chain()
    for n in nodes:
        n.hot_ends -= 1
    for n in nodes:
        p = n.parent
        if p.hot_next is n and not n.hot:
            p.hot_next = next((c for c in p.children.values() if c.hot), None)
    _refresh_ends(nodes)


def _ends_here(n) -> bool:
    if n.cut:
        return True
    p = n.path
    return p is not None and p.state in (WARM, HOT) and p.launch_early and n.hot_next is None


def _refresh_ends(nodes) -> None:
    trie.changed()
    for n in nodes:
        n.ends_here = _ends_here(n)
        if n.parent is not None:
            n.parent.ends_here = _ends_here(n.parent)
