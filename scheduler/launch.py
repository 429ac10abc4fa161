"""Running a deferred segment: one launch of a path's graph, liveness, errors, crosscheck.

``run`` launches one segment along a path (tracer.lifecycle.Path) with the graph the
lifecycle chose for it (``graph_for``: a compiled fused graph, or None for the exact
replay), on the device's queue, and reports what it did; it decides nothing about the
path's life. The fused graph's *variant* (what it is specialized on beyond the path: which
fresh outputs are still live at launch, so that dead ones stay in registers, and the
values of floats that could not be lifted) is chosen from the liveness read here from
storage use counts (Note [Liveness], ``live_values``).

Note [Liveness]).

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

import contextlib
import logging
import time

import torch

from .backends import Graph, packed_floats
from .program import Ext, OpFailed, interpret
from .queues import queue_for
from .userline import traceback_at

__all__ = ["run", "live_values", "attribute", "attribute_fused", "mark", "CrosscheckError"]

log = logging.getLogger("adaptive_eager")
_expired = torch.UntypedStorage._expired
_revive = torch.UntypedStorage._new_with_weak_ptr

class CrosscheckError(AssertionError):
    """A replay differed from running the same ops eagerly (``crosscheck=True``)."""


def _target(path, seg, i: int) -> torch.Tensor:
    t = seg.outw[i]()
    return t if t is not None else path.val_meta[i].on_storage(_revive(seg.stor[i]))


def live_values(path, seg) -> tuple:
    """The path's fresh outputs still alive (Note [Liveness])."""
    stor = seg.stor
    return tuple(i for i in path.fresh if stor[i] is not None and not _expired(stor[i]))


def run(path, seg, graph: Graph | None, live: tuple, config, counters) -> bool:
    """Launch the segment: ``graph`` (a compiled fused graph), or the path's exact replay
    when None, on the device's queue. ``live``: the fresh outputs alive now.

    ``seg`` is the tracer's segment state; ``run`` reads its ``exts`` (external inputs),
    ``floats`` (one record per op), ``outw``/``stor`` (weak reference and storage of each
    value) and ``rng`` (generator state at the first deferred random op, or None).
    Returns True when the launch did one-off work (the first run of a fused graph, or the
    generation of the path's exact replay), which the step governor does not time.
    """
    n_ops = len(seg.floats)
    specs = path.specs
    if n_ops != len(specs):
        raise AssertionError(f"segment of {n_ops} ops launched on a path of {len(specs)}")
    counters.ops_deferred += n_ops
    counters.replays += 1
    path.replays += 1
    path.last_fused = graph is not None
    one_off = False
    targets = {i: _target(path, seg, i) for i in (graph.live if graph else live)}
    reference = _crosscheck_reference(path, seg, targets) if config.crosscheck else None
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
            one_off = True
        inputs = [exts[k] for k in graph.plan.ext_inputs]
        if graph.plan.lifted:
            inputs.append(packed_floats([floats[n][j] for n, j in graph.plan.lifted],
                                        graph.device))
        inputs += [run_targets[i] for i in graph.live]
        fn, args = _run_fused, (path, graph, inputs, (exts, floats, seg.rng))
    else:
        one_off = path.exact is None  # its replay is generated at this first use
        fn, args = _run_exact, (path, exts, floats, run_targets)
    if config.debug >= 2:
        start = time.perf_counter()
    with _rng_as_recorded(seg.rng), _range(path, n_ops):
        if queue.submit(fn, *args):
            counters.fallback("device queue full (NEURON_ADAPTIVE_EAGER_QUEUE_DEPTH): waited")
        if queue.asynchronous and seg.rng is not None and path.draws(floats):
            # The device draws from the CPU generator: the host waits while it does, so
            # random numbers are drawn in program order (Note [Device random numbers]).
            queue.synchronize()
            counters.fallback("random ops in a launch: waited for the device")
    if config.debug >= 2:
        log.debug("replay %s graph%d [%d ops] %.1f us", graph.backend if graph else "exact",
                  path.gid, n_ops, (time.perf_counter() - start) * 1e6)
    if reference is not None:
        _crosscheck_compare(path, seg, targets, reference, exact=graph is None)
    return one_off


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


def _range(path, n_ops: int):
    if not _profiling():
        return _NO_RANGE
    return _Range(f"adaptive_eager::graph{path.gid}[{n_ops} ops]")


def mark(reason: str) -> None:
    """An instant event in the profiler's trace (an empty range), if it is recording."""
    if _profiling():
        _exit(_enter(f"adaptive_eager::flush[{reason}]"))


def _run_exact(path, exts, floats, targets: dict) -> None:
    run = path.exact_graph().run
    with torch._C._AutoDispatchBelowADInplaceOrView():
        try:
            run(exts, floats, targets)
        except OpFailed as f:
            raise attribute(f.error, path.specs[f.index]) from None


def _run_fused(path, graph: Graph, inputs: list, recorded) -> None:
    try:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            graph.run(inputs)
    except Exception as e:
        raise attribute_fused(path, recorded, e) from None


def attribute_fused(path, recorded, error: BaseException) -> BaseException:
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
# that fails is first replayed op by op on copies of what it writes (``attribute_fused``) to
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


def _crosscheck_reference(path, seg, targets: dict):
    written = {m.k for s in path.specs for m in s.mutates if type(m) is Ext}
    exts = [t.clone() if k in written else t for k, t in enumerate(seg.exts)]
    rng = torch.get_rng_state()
    with torch._C._AutoDispatchBelowADInplaceOrView(), _rng_as_recorded(seg.rng):
        env = interpret(path.specs, seg.floats, exts, {})
    torch.set_rng_state(rng)
    return env, {k: exts[k] for k in written}


def _crosscheck_compare(path, seg, targets: dict, reference, exact: bool) -> None:
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
