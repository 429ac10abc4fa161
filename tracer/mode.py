"""The dispatch mode: every aten op on a managed device enters here.

``__torch_dispatch__`` is the hot path. When the segment is on a hot path it calls the next
node's generated function (tracer.signature.make_fast), which checks the call by identity,
allocates the outputs from cached metadata and records the op: nothing runs. Anything else
takes ``_slow``: classify the op (tracer.optable), then

* other devices        -> passed through untouched;
* host scalars         -> run now: 0-dim CPU tensors holding no pending value, the same
                          division every accelerator makes (Note [Host scalars]);
* sync (a data read)   -> flush first if it reads pending data, which ends the segment;
* boundary             -> end the segment, run eagerly, count the reason;
* view / compute       -> a step in the trie: defer if the step is on a hot path, else run
                          cold (eagerly) and learn.

Note [Host scalars]: optimizers keep ``step`` as a 0-dim CPU tensor and read it with
``.item()`` once per parameter ("item is significantly faster than a cpu tensor in eager
mode"). On an accelerator those ops never touch the device. On the cpu device the engine
treats them the same way: ops whose tensors are all 0-dim, on the CPU and not pending run at
once on the host and are counted as ``ops_host``, not as launches; deferring them would only
force a flush at the ``.item()`` that follows each one. Random ops are never host scalars:
they draw from the generator the segment's deferred random ops draw from, and must draw in
program order (the fuzzer found ``rand_like`` of a 0-dim tensor drawing ahead of a deferred
``bernoulli``: Note [The fuzzer] in tests/fidelity/fuzz.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time

import torch
import torch._subclasses.schema_check_mode  # noqa: F401 -- what ``outside`` imports at its first
# use (torch's _disable_current_modes does), ~1 ms, at import rather than inside a step
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)

from adaptive_eager.scheduler import interrupts
from adaptive_eager.scheduler import launch as _launch
from adaptive_eager.scheduler import storage
from adaptive_eager.scheduler.program import Val
from adaptive_eager.scheduler.stats import Counters
from adaptive_eager.scheduler.userline import user_line as _user_line

from . import hot_plan, learn, lifecycle, trie, warm
from .optable import OpClass, info as op_info
from .segment import Segment, release_weak
from .signature import MISS, Unsupported, describe_kind, is_plain, observe
from .trie import new_root

__all__ = ["AdaptiveEagerMode"]

log = logging.getLogger("adaptive_eager")
_EMPTY: dict = {}


def _nothing() -> None:
    pass


class AdaptiveEagerMode(TorchDispatchMode):
    """One per thread. ``engine`` is shared: config, compile cache, background compiler."""

    # Higher-order ops (FlexAttention, out_dtype, ...) reach the mode too, with the mode
    # popped: each is a counted boundary run as in eager (Note [Higher-order ops and the
    # key], tracer/hot_key.py), never "no rule registered for this mode".
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Note [Beside torch.compile] (adaptive_eager/compiled_regions.py): torch.compile
        # compiles as if the engine were not there; the ops its compiled code still
        # dispatches reach the engine
        return True

    def __init__(self, engine, config):
        super().__init__()
        self.engine = engine
        self.cache = engine.cache
        self.counters = Counters()
        self.counters.thread = self.thread = threading.get_ident()
        self.inbox = engine.new_inbox()
        self.root = new_root()
        self.seg = Segment(self, self.root)
        self.n_nodes = 0
        # one-off work done so far: cold runs of paths not yet hot, first exact replays,
        # first runs of fused graphs (the step governor does not time steps that did any:
        # Note [Stepping aside])
        self.learning = 0
        self.families: dict = {}  # Note [Shape families] (tracer.lifecycle): compiles per family
        self.paused = 0
        self.generation = 0  # bumped by reset_state: deliveries for older tries are dropped
        self.governor = None  # set by the engine (adaptive_eager.governor)
        self.warm = None  # the warm-start store (Note [Warm start], tracer.warm), or None
        self.warm_env = None  # the environment whose kept paths this trie holds
        self.warm_program = self.warm_kind = None  # where its records go (tracer.warm)
        self.configure(config)

    def configure(self, config) -> None:
        self.config = config
        self.debug = self.counters.debug = config.debug
        self.devices = frozenset(config.devices)
        self.host_scalars = "cpu" in self.devices
        # ops _slow ran as host scalars: the compiled dispatcher runs them at once when
        # every tensor is a lone host scalar the segment does not know (tracer.native)
        self.host_funcs: dict = {}
        # The compiled hot path enters through a compiled ``__torch_dispatch__`` (the same
        # steps as ``_dispatch``, below) bound to this mode: no Python frame per op.
        # The launch's bookkeeping over the segment's values, compiled alike.
        if config.hot_path in ("cpp", "key"):
            from . import native

            self.__torch_dispatch__ = native.dispatcher(self, _EMPTY)
            self.release_weak, self.live_values = native.release_weak, native.live_values
            self.pick_floats = native.pick_floats
            storage.use_compiled(native.load())
        else:
            storage.use_compiled(None)
            for name in ("__torch_dispatch__", "release_weak", "live_values", "pick_floats"):
                self.__dict__.pop(name, None)
        # With the hot path's dispatch key, hot segments may be served below the floor
        # (tracer.hot_plan): the key asks ``key_plan`` after each op the mode handled, and
        # ``settle`` hands what it served back before any of the engine's Python touches the
        # segment.
        self._keyed = None
        self.settle = _nothing
        for node in getattr(self, "fast_ends", ()):  # made under the old settings
            node.fast_end = None
        self.fast_ends: list = []  # the nodes given a launch below the floor (hot_plan)
        if config.hot_path == "key":
            from . import hot_key

            self._keyed = hot_key.load()
            self.settle = functools.partial(self._keyed.hand_back, self)
        # Note [Warm start]: what an earlier run of this program learned, into this trie
        self.warm = warm.store_for(config)
        warm.restore(self)

    def key_plan(self):
        """What the hot segment expects next, for the dispatch key to serve, or None."""
        if self._keyed is None or self.debug >= 3:
            return None
        return hot_plan.plan(self, self._keyed)

    # ------------------------------------------------------------------ slow path

    def _slow(self, func, args, kwargs):
        S = self.seg
        c = self.counters
        if self.paused:
            c.ops_passthrough += 1
            return func(*args, **kwargs)
        if isinstance(func, HigherOrderOperator):
            return self._boundary_op(func, args, kwargs, "higher-order op")
        info = op_info(func)
        if info.cls is OpClass.IGNORE:
            c.ops_passthrough += 1
            return func(*args, **kwargs)
        tensors = learn.tensors_of(args, kwargs)
        managed = False
        for t in tensors:
            if t.device.type in self.devices:
                managed = True
                if not is_plain(t):
                    return self._boundary_op(func, args, kwargs, "unsupported tensor "
                                             f"({describe_kind(t)})")
        if not tensors:
            if info.cls is OpClass.VIEW and args and type(args[0]) in _NUMBERS:
                return _view_of_number(func, args, kwargs, c)
            dev = kwargs.get("device")
            managed = (torch.device(dev).type if dev is not None else "cpu") in self.devices
        if not managed:
            c.ops_passthrough += 1
            return func(*args, **kwargs)
        if _crosses_devices(tensors, kwargs):
            return self._boundary_op(func, args, kwargs, "device copy")
        if (self.host_scalars and tensors and not info.random
                and learn.host_scalar_op(S, tensors)):
            if info.mutated_args and any(S.feeds(t) for t in tensors):
                self.end_segment("host op writes a segment input")
            c.ops_host += 1
            self.host_funcs[func] = True
            return func(*args, **kwargs)
        cls = info.cls
        if cls is OpClass.SYNC:
            if any(S.involves(t) for t in tensors):
                self.end_segment(_read_reason(func))
            c.ops_eager += 1
            return func(*args, **kwargs)
        if cls is OpClass.BOUNDARY:
            return self._boundary_op(func, args, kwargs, info.reason)
        return self._step(func, info, args, kwargs, tensors)

    def _boundary_op(self, func, args, kwargs, reason):
        self.end_segment("boundary op")
        self.counters.fallback(f"{reason}: {func}")
        self.counters.ops_eager += 1
        return func(*args, **kwargs)

    def _step(self, func, info, args, kwargs, tensors):
        S = self.seg
        node = S.node
        if node is None:  # untracked until the next boundary
            return self._run_cold(func, info, args, kwargs)
        if func in _PLAIN_ALIASES and S.source(tensors[0]) is None:
            # Note [Untracked aliases]
            self.counters.ops_passthrough += 1
            return func(*args, **kwargs)
        ext_view = info.cls is OpClass.VIEW and type(S.source(tensors[0])) is not Val
        n_same = S.n_same
        try:
            op = observe(func, info, args, kwargs, tensors, S.source, ext_view)
        except Unsupported as u:
            return self._boundary_op(func, args, kwargs, u.args[0])
        child = node.children.get(op.key)
        if child is not None and child.hot and (S.hot or node.depth == 0):
            # Plans are kept per first child (tracer.hot_plan), so another branch taken here
            # needs no new plans: one through the old branch hands back at its first
            # unexpected op. (Bumping trie.epoch here rebuilt every plan at every step of a
            # loop whose batch size changes each step: benchmarks.churn.)
            node.hot_next = child
            r = child.fast(args, kwargs, S)
            if r is MISS and S.n_same != n_same:
                # a value's twin among the arguments (Note [Memory of a value])
                r = child.fast(*S.adopt(args, kwargs), S)
            if r is not MISS:
                return r
        if child is not None and child.blocked:  # learned as a boundary: the path ends here
            was_hot = S.hot
            if was_hot:  # launch the hot prefix first: the op may read what it computes
                self.end_segment("boundary op")
            res = self._run_cold(func, info, args, kwargs) if op.res is None else op.res
            if not was_hot:
                self.end_segment("boundary op")
            self.counters.fallback(child.blocked)
            return res
        if S.hot and self._diverge(func, child):  # the path is cut here: start a new segment
            return self._step(func, info, args, kwargs, tensors)
        if S.n_ops == 0:
            S.t0 = time.perf_counter()
        if child is None:
            op.written = learn.written_metas(op)
        if op.res is None:
            op.res = self._run_cold(func, info, args, kwargs)
        else:
            self.counters.ops_views += 1
        res = op.res
        if child is None:
            child = self._learn(node, op)
            if child is None:
                S.node = S.expect = None
                return res
            if child.blocked:
                self.end_segment("boundary op")
                self.counters.fallback(child.blocked)
                return res
        elif not learn.same_outputs(child.spec, res):
            lifecycle.block(child, "output metadata varies between runs", self)
            self.end_segment("boundary op")
            return res
        for x in op.new:
            S.add_external(x)
        learn.register_outputs(S, child.spec, res)
        S.floats.append(tuple(op.recorded))
        S.node = child
        S.expect = None  # a hot path starts at a segment's first op only
        child.visits += 1
        S.n_ops += 1
        if child.cut:
            self.end_segment("path cut")
        elif S.n_ops >= self.config.max_segment_ops:
            self.end_segment("segment op cap")
        return res

    def _run_cold(self, func, info, args, kwargs):
        res = func(*args, **kwargs)
        if info.cls is OpClass.VIEW:
            self.counters.ops_views += 1
        else:
            self.counters.ops_eager += 1
        return res

    def _learn(self, node, op):
        if self.n_nodes >= self.config.max_trie_nodes:
            self.counters.fallback("trie node budget exhausted: not learning")
            return None
        self.n_nodes += 1
        child = learn.make_node(node, op, _user_line(1, self.thread))
        if not child.blocked and op.new and self.seg.on_value_memory(op.new):
            # Note [Memory of a value] (tracer.segment)
            child.blocked = f"a new input on the memory of a value of the segment: {op.func}"
        node.children[op.key] = child
        if self.debug >= 3:
            log.debug("trie: new node %s at depth %d (%s)", op.func, child.depth,
                      child.blocked or "deferrable")
        return child

    # ------------------------------------------------------------------ segment ends

    def _diverge(self, func, child) -> bool:
        """The op follows no hot child: launch the deferred prefix, continue cold.

        Returns True when the node has now diverged too often and the path is cut after it
        (Note [Cuts] in tracer.lifecycle): the segment has ended and the op starts a new one.
        A divergence into a child seen fewer than ``hot_threshold`` times is a branch on its
        way to hot and does not count toward the cut.
        """
        S = self.seg
        node = S.node
        self.counters.fallback("diverged from the hot path")
        if self.debug >= 3:
            log.debug("diverged after %s at depth %d", node.spec.func, node.depth)
        if child is None or child.visits >= self.config.hot_threshold:
            node.diverged += 1
        if not node.cut and node.diverged >= self.config.divergence_limit:
            lifecycle.cut(self, node, func, _user_line(1, self.thread))
        if node.cut:
            self.end_segment("path cut")
            return True
        with interrupts.held():  # Note [Interrupts wait for the launch]
            try:
                _launch.mark("diverged")
                self._launch(node)
            finally:
                S.drop_deferred()
            node.ends += 1
        return False

    def end_segment(self, reason: str) -> None:
        """A boundary: launch what is deferred, count the end, start a new segment (whole:
        Note [Interrupts wait for the launch], scheduler.interrupts)."""
        with interrupts.held():
            self._end_segment(reason)

    def _end_segment(self, reason: str) -> None:
        self.settle()
        S = self.seg
        node = S.node
        was_hot = S.hot
        try:
            if was_hot:
                _launch.mark(reason)
                graph, live = self._launch(node)
                if graph is not None and self._keyed is not None and node.fast_end is None:
                    hot_plan.fast_end(self, node, graph, live)
            if node is not None and node.depth:
                node.ends += 1
                lifecycle.after_end(self, node, was_hot, time.perf_counter() - S.t0)
        finally:
            S.reset()
            self.counters.segments += node is not None and node.depth > 0
            self.counters.boundary(reason, was_hot)
            if self.inbox:
                lifecycle.install(self)

    def _launch(self, node) -> tuple:
        """Launch the segment along the path ending at ``node``: (the fused graph it ran, or
        None for its exact replay, the fresh values alive)."""
        path = lifecycle.path_of(self, node)
        live = self.live_values(path, self.seg)
        graph = lifecycle.graph_for(self, path, live)
        # Paused while the launch runs: the compiled graph's own reads (Inductor checks input
        # alignment through data_ptr) must not re-enter the read guard's flush.
        self.paused += 1
        try:
            self.learning += _launch.run(path, self.seg, graph, live, self.config,
                                         self.counters)
        finally:
            self.paused -= 1
        return graph, live

    # ------------------------------------------------------------------ outside dispatch

    @contextlib.contextmanager
    def outside(self):
        """Run engine work (a flush from a hook or a read) with this mode off the stack."""
        if self in _get_current_dispatch_mode_stack():
            with _disable_current_modes():
                yield
        else:
            yield

    def boundary(self, reason: str) -> None:
        keyed = self._keyed
        if keyed is not None and keyed.launch_served(self, reason):
            # launched below the floor (tracer.hot_plan.fast_end); its plan is dropped (the
            # boundary may be the engine's disabling or stepping aside): the next op reaches
            # the mode, which takes the next one
            keyed.hand_back(self)
            return
        with self.outside():
            self.end_segment(reason)

    @contextlib.contextmanager
    def pause(self):
        """Ops pass through untouched (the segment state is kept, nothing is pending)."""
        self.settle()
        self.paused += 1
        self.seg.expect = None
        try:
            yield
        finally:
            self.paused -= 1
            S = self.seg
            S.expect = S.node.hot_next if S.node is self.root and not self.paused else None

    def reset_state(self) -> None:
        """Forget the trie and the counters (ae.reset())."""
        self.settle()
        for node in self.fast_ends:
            node.fast_end = None
        self.fast_ends = []
        self.root = new_root()
        self.seg = Segment(self, self.root)
        self.n_nodes = 0
        self.learning = 0
        self.families = {}
        self.generation += 1
        self.counters.__init__()
        self.inbox.clear()


def _dispatch(self, func, types, args=(), kwargs=None):
    S = self.seg
    e = S.expect
    if e is not None and e.spec.func is func:
        r = e.fast(args, kwargs or _EMPTY, S)
        if r is not MISS:
            return r
    return self._slow(func, args, kwargs or {})


# Assigned after class creation: TorchDispatchMode.__init_subclass__ would wrap a method
# defined in the class body with torch._disable_dynamo (~0.5 us per op, DESIGN §11). The
# wrapper keeps Dynamo from compiling the mode's frames, which only matters while a compiled
# function runs. Note [Dynamo and the mode]: Dynamo skips a frame while a dispatch mode is on
# the stack, but the mode runs popped, so a frame of its own entered inside a compiled
# function (FlexAttention's eager path calls torch.compile, and its higher-order op reaches
# the mode) was compiled: Dynamo traced the engine ("missing tp_iter" in the op table). The
# slow path, where every such op goes, therefore runs with Dynamo off (that wrapper, ~0.5 us,
# on a path that costs tens of microseconds) once Dynamo is loaded: the wrapper would import
# it (~0.8 s), and nothing compiles before it is. The hot path's frames run what the key and
# the fast paths already checked. The rest of the engine beside torch.compile: Note [Beside
# torch.compile] (adaptive_eager/compiled_regions.py).
AdaptiveEagerMode.__torch_dispatch__ = _dispatch
_slow_plain = AdaptiveEagerMode._slow
_slow_no_dynamo = None


def _slow(self, func, args, kwargs):
    global _slow_no_dynamo
    if _slow_no_dynamo is None:
        if "torch._dynamo" not in sys.modules:
            return _slow_plain(self, func, args, kwargs)
        _slow_no_dynamo = torch._disable_dynamo(_slow_plain, recursive=True)
    return _slow_no_dynamo(self, func, args, kwargs)


AdaptiveEagerMode._slow = _slow
# the Python forms of what configure() may replace by compiled ones (tracer.native)
AdaptiveEagerMode.release_weak = staticmethod(release_weak)
AdaptiveEagerMode.live_values = staticmethod(_launch.live_values)
AdaptiveEagerMode.pick_floats = staticmethod(lifecycle.pick_floats)


# Note [Dispatch rule lookup]: before calling a mode's ``__torch_dispatch__`` the dispatcher
# asks ``torch._library.simple_registry.find_torch_dispatch_rule(op, type(mode))`` whether a
# rule was registered for that (op, mode class) pair with ``torch.library.
# register_torch_dispatch``. It is a Python function (two dict lookups and a string
# attribute): ~1 us on every op, about a fifth of the whole interception floor. The C++ side
# keeps a reference to that function object, so rebinding the module attribute would not be
# seen; instead its code is replaced, once, by code that answers None for this engine's mode
# (and the benchmarks' floor mode) at once and calls the original code for every other
# class. Consequence, stated: rules registered for ``AdaptiveEagerMode`` itself are not
# consulted (the engine registers none).


def skip_rule_lookup(cls: type | None = None) -> None:
    """Install Note [Dispatch rule lookup] for ``cls`` (default: the engine's mode;
    idempotent). The benchmarks' interception floor uses it too, so that the floor is not
    charged a lookup the engine does not pay."""
    import types

    from torch._library import simple_registry as registry

    skipped = getattr(registry, "_adaptive_eager_modes", None)
    if skipped is None:
        fn = registry.find_torch_dispatch_rule
        registry._adaptive_eager_original = types.FunctionType(
            fn.__code__, registry.__dict__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        skipped = registry._adaptive_eager_modes = set()
        registry._adaptive_eager_mode = AdaptiveEagerMode
        src = (  # the engine's class by identity first: it is asked on every op
            "def find_torch_dispatch_rule(op, torch_dispatch_class):\n"
            "    if (torch_dispatch_class is _adaptive_eager_mode\n"
            "            or torch_dispatch_class in _adaptive_eager_modes):\n"
            "        return None\n"
            "    return _adaptive_eager_original(op, torch_dispatch_class)\n"
        )
        ns: dict = {}
        exec(compile(src, registry.__file__, "exec"), registry.__dict__, ns)
        fn.__code__ = ns["find_torch_dispatch_rule"].__code__
    skipped.add(cls or AdaptiveEagerMode)


# Note [Untracked aliases]: ``detach``/``alias`` of a tensor the segment has not seen (the
# output of a boundary op, a new batch) aliases data the engine does not own: recording it
# would only make the new object a segment value, held by a weak reference. It runs as it
# is; ops on the result see it as a new external, as they would its input. Not holding it
# matters: ``Module.to()`` swaps each new parameter into place (``torch.utils.swap_tensors``)
# for wrapper-subclass devices, which refuses a tensor with a weak reference, and
# ``nn.Parameter(t)`` is a ``detach`` of ``t``.
_PLAIN_ALIASES = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


# Note [Views of numbers]: PyTorch hands a dispatch mode each wrapped number (a scalar that
# an op turned into a 0-dim tensor) as a Python number. The zero-tensor kernels autograd uses
# for gradients known to be zero view one (``zeros_grad + 1`` calls ``expand(other, size)``
# with ``other`` the wrapped 1), and calling the op back with a number fails, under any
# dispatch mode ("Expected a value of type 'Tensor' for argument 'self' but instead found
# type 'int'"). The number is made a tensor again (the dtype a wrapped number has) and the
# view runs as it is: nothing the engine holds is involved.
_NUMBERS = frozenset({int, float, bool, complex})


def _view_of_number(func, args, kwargs, counters):
    counters.ops_passthrough += 1
    return func(torch.tensor(args[0]), *args[1:], **kwargs)


# How the program reads data to the host, in its own words (boundary reasons, explain()).
_READS = {"_local_scalar_dense": ".item()", "is_nonzero": "bool()", "equal": "torch.equal"}


_READ_REASONS: dict = {}


def _read_reason(func) -> str:
    reason = _READ_REASONS.get(func)
    if reason is None:
        name = func._schema.name.split("::")[-1]
        reason = _READ_REASONS[func] = f"host read: {_READS.get(name, str(func))}"
    return reason


def _crosses_devices(tensors, kwargs) -> bool:
    """Does the op move data between devices (``.to(other)``, ``copy_`` across devices)?"""
    # 0-dim CPU tensors take part in ops on any device (wrapped scalars): not a copy.
    devices = {t.device for t in tensors if t.dim() or t.device.type != "cpu"}
    dev = kwargs.get("device")
    if dev is not None:
        devices.add(torch.device(dev))
    return len(devices) > 1
