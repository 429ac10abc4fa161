"""Running a deferred segment: the captured ``Path``, liveness, variants, one launch, errors.

A ``Path`` is the artifact captured for one trie path (root to a node where segments end):
its ops, its lifecycle state and its compiled variants. Lifecycle (DESIGN §3)::

    cold --(ends >= hot_threshold)--> warm --(graph ready)--> hot --(slower / budget)--> retired

A warm path defers already and replays exactly while its graph compiles (Note [Warm paths
replay exactly] in tracer.learn); a hot one launches the fused graph.

``run`` launches one segment along a path. A *variant* is what a compiled fused graph is
specialized on beyond the path itself: which fresh outputs are still live at launch (dead ones
are not materialized, so Inductor keeps them in registers) and the values of floats that
could not be lifted. Liveness is read from storage use counts (Note [Liveness]).

Note [Liveness]: the engine holds each deferred fresh output only through weak references,
to the tensor and to its storage. It must not hold the tensor: autograd steals a gradient
buffer only when its Python object is uniquely referenced (``is_tensor_stealable``), so an
extra strong reference would change the ops autograd issues between cold and hot runs. Nor
the storage: a deferred output's buffer is allocated when the op is deferred, and holding it
until the launch made a hot 64-op chain on 1M floats hold all 64 buffers at once (256 MB
where eager peaks at 8 MB, measured by the suite). The storage tells liveness completely: a
user reference, a view, or a tensor autograd saved (saved outputs are shallow copies sharing
the storage) each keeps it alive; an expired one is dead, and its memory was freed as soon as
the last of them went, as in eager.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import statistics
import time

import torch

from .backends import Graph, compile_graph, exact_graph, packed_floats, plan
from .compiler import GraphKey
from .program import Ext, OpFailed, Rec, alias_groups, host_call, interpret
from .queues import queue_for
from .userline import traceback_at

__all__ = ["Path", "run", "attribute", "mark", "CrosscheckError"]

log = logging.getLogger("adaptive_eager")
_expired = torch.UntypedStorage._expired
_revive = torch.UntypedStorage._new_with_weak_ptr

COLD, WARM, HOT, RETIRED = "cold", "warm", "hot", "retired"


class CrosscheckError(AssertionError):
    """A replay differed from running the same ops eagerly (``crosscheck=True``)."""


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
        # its compiles share the variant budget (Note [Shape families] in tracer.learn).
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

    def __repr__(self):
        return f"Path({len(self.specs)} ops, {self.state}, {self.backend})"

    @property
    def lines(self) -> tuple:
        return tuple(dict.fromkeys(s.line for s in self.specs))

    def draws(self, floats) -> bool:
        """Do this run's random ops draw numbers? Dropout-like ops with p == 0 do not."""
        randoms = self._randoms
        if randoms is None:
            randoms = self._randoms = [(n, s, _probability_arg(s.func)) for n, s in
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

    def variant(self, live: tuple, floats) -> tuple:
        """(live outputs, lifted positions, specialized values): what one graph serves."""
        the_plan = self.plan
        return live, the_plan.lifted, tuple(floats[n][j] for n, j in the_plan.specialized)

    def builder(self, variant, process: bool = False):
        live, _, spec_values = variant  # computed from the current plan just before
        specs, ext_metas, the_plan, backend = self.specs, self.ext_metas, self.plan, self.backend
        live_metas = {i: self.val_meta[i] for i in live}
        device_map, kernels = self.device_map, self.kernels
        return lambda: compile_graph(backend, specs, ext_metas, live_metas, the_plan,
                                     spec_values, device_map, kernels, process)

    def graph_key(self, variant) -> GraphKey:
        return GraphKey(self.key, self.backend, variant)

    def retire(self, reason: str) -> None:
        self.state = RETIRED
        self.reason = reason

    def profitable(self, ratio: float) -> bool:
        """False once the fused replays are measured slower than the eager segments."""
        if ratio <= 0 or len(self.hot_times) < 4 or len(self.cold_times) < 2:
            return True
        hot = statistics.median(list(self.hot_times)[1:])
        return hot <= ratio * statistics.median(self.cold_times)


def _probability_arg(func):
    """(position, name, default) of a dropout-like op's probability argument, else None.

    The default matters: PyTorch leaves out an argument passed at its default value
    (``bernoulli_(0.5)`` is recorded as ``bernoulli_(t)``), and such an op draws."""
    for i, a in enumerate(func._schema.arguments):
        if a.name in ("p", "dropout_p"):
            return i, a.name, a.default_value or 0.0
    return None


def _target(path: Path, seg, i: int) -> torch.Tensor:
    t = seg.outw[i]()
    return t if t is not None else path.val_meta[i].on_storage(_revive(seg.stor[i]))


def live_values(path: Path, seg) -> tuple:
    stor = seg.stor
    return tuple(i for i in path.fresh if stor[i] is not None and not _expired(stor[i]))


def run(path: Path, seg, ctx, counters) -> None:
    """Launch the segment: one compiled graph (or one exact replay) on the device's queue.

    ``seg`` is the tracer's segment state; ``run`` reads its ``exts`` (external inputs),
    ``floats`` (one record per op), ``outw``/``stor`` (weak reference and storage of each
    value) and ``rng`` (generator state at the first deferred random op, or None).
    ``ctx`` is the tracer: ``config``, ``debug``, ``cache``, ``request()`` and ``retire()``.
    """
    n_ops = len(seg.floats)
    specs = path.specs
    if n_ops != len(specs):
        raise AssertionError(f"segment of {n_ops} ops launched on a path of {len(specs)}")
    counters.ops_deferred += n_ops
    counters.replays += 1
    path.replays += 1
    live = live_values(path, seg)
    graph = None
    if path.backend != "exact" and path.state in (WARM, HOT):
        graph = _fused_graph(path, seg, live, ctx, counters)
    path.last_fused = graph is not None
    targets = {i: _target(path, seg, i) for i in (graph.live if graph else live)}
    reference = _crosscheck_reference(path, seg, targets) if ctx.config.crosscheck else None
    queue = queue_for(path.device_type)
    # What the launch reads, fixed now: an asynchronous queue runs it after the segment's
    # bookkeeping has been reset and while the program goes on (module docstring of queues).
    if queue.asynchronous or queue.host_views:
        prep = queue.prepare
        exts = [prep(x) for x in seg.exts]
        floats = list(seg.floats)
        run_targets = {i: prep(t) for i, t in targets.items()}
    else:
        exts, floats, run_targets = seg.exts, seg.floats, targets
    if graph is not None:
        if not graph.ran:
            graph.ran = True
            ctx.learning += 1
        inputs = [exts[k] for k in graph.plan.ext_inputs]
        if graph.plan.lifted:
            inputs.append(packed_floats([floats[n][j] for n, j in graph.plan.lifted],
                                        graph.device))
        inputs += [run_targets[i] for i in graph.live]
        fn, args = _run_fused, (path, graph, inputs, (exts, floats, seg.rng))
    else:
        if path.exact is None:  # its replay is generated at this first use: one-off work
            ctx.learning += 1
        fn, args = _run_exact, (path, exts, floats, run_targets)
    if ctx.debug >= 2:
        start = time.perf_counter()
    with _rng_as_recorded(seg.rng), _range(path, n_ops):
        if queue.submit(fn, *args):
            counters.fallback("device queue full (NEURON_ADAPTIVE_EAGER_QUEUE_DEPTH): waited")
        if queue.asynchronous and seg.rng is not None and path.draws(floats):
            # The device draws from the CPU generator: the host waits while it does, so
            # random numbers are drawn in program order (Note [Device random numbers]).
            queue.synchronize()
            counters.fallback("random ops in a launch: waited for the device")
    if ctx.debug >= 2:
        log.debug("replay %s graph%d [%d ops] %.1f us", graph.backend if graph else "exact",
                  path.gid, n_ops, (time.perf_counter() - start) * 1e6)
    if reference is not None:
        _crosscheck_compare(path, seg, targets, reference, exact=graph is None)


# Note [Profiler ranges]: while ``torch.profiler`` records, each launch is submitted inside
# a ``record_function`` range named ``adaptive_eager::graph<id>[<n> ops]`` on the thread
# that launches. On a synchronous queue (cpu) the replay runs inside it, so its kernels nest
# under it and ``key_averages()`` totals each graph. On an asynchronous queue (neuron, cuda)
# the range is the submission: the work runs later on the device (the profiler records a
# thread only from the thread that started it, so the emulated device's worker is not
# seen, as in eager). Each segment end that launches deferred work adds an empty range
# ``adaptive_eager::flush[<reason>]`` where the program forced it (``mark``). When not
# profiling this costs one C call per launch.
# The ranges are opened with the profiler's C entry points, not ``record_function``, whose
# enter and exit are aten ops that would pass through this engine's own dispatch mode.
_profiling = torch._C._autograd._profiler_enabled
_enter = torch._C._autograd._record_function_with_args_enter
_exit = torch._C._autograd._record_function_with_args_exit
_NO_RANGE = contextlib.nullcontext()


class _Range:
    __slots__ = ("name", "handle")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.handle = _enter(self.name)

    def __exit__(self, *exc):
        _exit(self.handle)


def _range(path: Path, n_ops: int):
    if not _profiling():
        return _NO_RANGE
    return _Range(f"adaptive_eager::graph{path.gid}[{n_ops} ops]")


def mark(reason: str) -> None:
    """An instant event in the profiler's trace (an empty range), if it is recording."""
    if _profiling():
        _exit(_enter(f"adaptive_eager::flush[{reason}]"))


def _fused_graph(path: Path, seg, live: tuple, ctx, counters):
    if path.fused_off:
        counters.fallback(f"no fused graph ({path.fused_off}): replayed exactly")
        return None
    variant = path.variant(live, seg.floats)
    key = path.variants.get(variant)
    if key is None and path.observe(seg.floats):  # a specialized float changed: lift it
        variant = path.variant(live, seg.floats)
        key = path.variants.get(variant)
    graph = ctx.cache.get(key) if key is not None else None
    if graph is not None:
        counters.cache_hits += 1
        if ctx.debug >= 3:
            log.debug("cache hit graph%d %r", path.gid, key)
        if graph.mutates_external and _written_input_aliased(graph.plan, seg.exts):
            counters.fallback("a written input aliases another input: replayed exactly")
            return None
        if 0.0 in variant[2] and not _same_zero_signs(graph.spec_values, variant[2]):
            counters.fallback("a specialized float changed its sign of zero: replayed exactly")
            return None
        return graph
    counters.cache_misses += 1
    if ctx.debug >= 3:
        log.debug("cache MISS graph%d %r: live outputs %d, specialized floats %s", path.gid,
                  key or path.graph_key(variant), len(live), variant[2])
    if key is None and len(path.variants) >= ctx.config.variant_budget:
        ctx.retire(path, "variant budget exhausted")
        return None
    if variant not in path.pending:  # new, or evicted from the cache since
        ctx.request(path, variant, counters)
    counters.fallback("variant compiling: replayed exactly")
    return None


def _same_zero_signs(compiled, values) -> bool:
    return all(math.copysign(1.0, a) == math.copysign(1.0, b)
               for a, b in zip(compiled, values) if type(a) is float and a == 0.0)


def _written_input_aliased(the_plan, exts) -> bool:
    inputs = [exts[k] for k in the_plan.ext_inputs]
    groups = alias_groups(inputs)
    shared = {g for g in groups if g >= 0}
    if not shared:
        return False
    for i in the_plan.mutated_inputs:
        if groups[i] >= 0 or i in shared:
            return True
    return False


def _run_exact(path: Path, exts, floats, targets: dict) -> None:
    run = path.exact_graph().run
    with torch._C._AutoDispatchBelowADInplaceOrView():
        try:
            run(exts, floats, targets)
        except OpFailed as f:
            raise attribute(f.error, path.specs[f.index]) from None


def _run_fused(path: Path, graph: Graph, inputs: list, recorded) -> None:
    try:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            graph.run(inputs)
    except Exception as e:
        raise _attribute_fused(path, recorded, e) from None


def _attribute_fused(path: Path, recorded, error: BaseException) -> BaseException:
    """Find the op eager would have failed at: replay the ops on copies of what they write.

    ``recorded`` is the launch's (externals, floats, generator state).
    """
    seg_exts, floats, rng = recorded
    written = {m.k for s in path.specs for m in s.mutates if type(m) is Ext}
    exts = [t.clone() if k in written else t for k, t in enumerate(seg_exts)]
    try:
        with torch._C._AutoDispatchBelowADInplaceOrView(), _rng_as_recorded(rng):
            interpret(path.specs, floats, exts, {}, call=path.host_call)
    except OpFailed as f:
        return attribute(f.error, path.specs[f.index])
    return RuntimeError(
        f"adaptive_eager: fused graph{path.gid} for {len(path.specs)} ops "
        f"({path.specs[0].line} .. {path.specs[-1].line}) raised {type(error).__name__}: "
        f"{error}; the same ops run eagerly did not"
    )


# Note [Issuing frames]: a deferred op that fails raises where its segment launches -- the
# next sync, often lines later than the op. The error keeps its type (the program's
# ``except`` clauses work as in eager); its message gains the aten op and the user line that
# issued it; and its traceback ends with a frame at that line, in the function that issued
# it, after the frames of the sync point. So the last user frame a traceback, a debugger's
# post-mortem (``%debug``) or an IDE shows is the line that issued the op, as in eager. The
# frame is a stand-in: it has the line's file, number and function name (recorded when the
# op was learned), not its local variables, which no longer exist at the sync. A fused graph
# that fails is first replayed op by op on copies of what it writes (``_attribute_fused``) to
# find the op eager would have failed at.


def attribute(error: BaseException, spec) -> BaseException:
    """Name the op and the user's source line in ``error``, keeping its type, and end its
    traceback at that line (Note [Issuing frames])."""
    note = f"[adaptive_eager] raised by {spec.func} issued at {spec.line} (deferred, run at sync)"
    if (type(error).__str__ is BaseException.__str__ and error.args
            and isinstance(error.args[0], str)):
        error.args = (f"{error.args[0]}\n{note}",) + error.args[1:]
    else:
        error.add_note(note)
    tb = traceback_at(spec.line, error)
    return error.with_traceback(tb) if tb is not None else error


class _rng_as_recorded:
    """Replay random ops from the generator state they were deferred at.

    Normally nothing touched the generator between deferral and launch and this is a
    comparison. If something did (``torch.manual_seed`` in between), the deferred ops get the
    state eager would have given them, and the later state is put back afterwards.
    """

    __slots__ = ("state", "saved")

    def __init__(self, state):
        self.state = state
        self.saved = None

    def __enter__(self):
        if self.state is not None:
            now = torch.get_rng_state()
            if not torch.equal(now, self.state):
                self.saved = now
                torch.set_rng_state(self.state)

    def __exit__(self, *exc):
        if self.saved is not None:
            torch.set_rng_state(self.saved)


def _crosscheck_reference(path: Path, seg, targets: dict):
    written = {m.k for s in path.specs for m in s.mutates if type(m) is Ext}
    exts = [t.clone() if k in written else t for k, t in enumerate(seg.exts)]
    rng = torch.get_rng_state()
    with torch._C._AutoDispatchBelowADInplaceOrView(), _rng_as_recorded(seg.rng):
        env = interpret(path.specs, seg.floats, exts, {})
    torch.set_rng_state(rng)
    return env, {k: exts[k] for k in written}


def _crosscheck_compare(path: Path, seg, targets: dict, reference, exact: bool) -> None:
    env, written = reference
    pairs = [(targets[i], env[i], path.specs[path.val_op[i]]) for i in targets]
    last_writer = {}
    for s in path.specs:
        for m in s.mutates:
            if type(m) is Ext:
                last_writer[m.k] = s
    pairs += [(seg.exts[k], ref, last_writer[k]) for k, ref in written.items()]
    for got, want, spec in pairs:
        try:
            # The reference ran on copies of the inputs the segment writes; BLAS kernels may
            # pick another code path for another alignment, so even the exact replay is only
            # held to torch's default (dtype-based) tolerances here.
            if exact:
                torch.testing.assert_close(got, want, equal_nan=True)
            else:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)
        except AssertionError as e:
            raise CrosscheckError(
                f"adaptive_eager crosscheck: {spec.func} issued at {spec.line}: the "
                f"{'exact' if exact else 'fused'} replay differs from eager: {e}"
            ) from None
