"""The process-wide engine: shared caches, per-thread modes, and the hooks into torch.

The dispatch mode is per thread (the mode stack is thread-local): ``enable()`` pushes this
thread's ``AdaptiveEagerMode``; autograd's device threads receive the mode with the rest of
the thread-local state when it is active at ``backward()``. Shared by all threads: the
compile cache, the background compiler, the read guard and the optimizer step hook.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import logging
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from adaptive_eager.scheduler import compile_process
from adaptive_eager.scheduler.compiler import CompileCache, Compiler
from adaptive_eager.scheduler.queues import set_depth, synchronize_all
from adaptive_eager.scheduler.stats import snapshot
from adaptive_eager.tracer.mode import AdaptiveEagerMode, skip_rule_lookup

from . import compiled_regions, cudaguard, readguard
from .config import Config
from .governor import Governor

__all__ = ["ENGINE"]

log = logging.getLogger("adaptive_eager")


class Engine:
    def __init__(self):
        self.cache = CompileCache(256)
        self.compiler = Compiler(self.cache)
        self.local = threading.local()
        self.counters: list = []  # every mode's counters, kept for stats after threads end
        self.modes: weakref.WeakSet = weakref.WeakSet()
        self.n_paths = 0
        self._hooked = False
        self._lock = threading.Lock()
        self._build_failed = None  # why the compiled hot path could not be built, once said

    # ---------------------------------------------------------------- per-thread mode

    def new_inbox(self) -> collections.deque:
        return collections.deque()

    def mode(self) -> AdaptiveEagerMode | None:
        """This thread's mode if the engine is enabled on this thread."""
        m = getattr(self.local, "mode", None)
        return m if m is not None and getattr(self.local, "active", False) else None

    def mode_here(self) -> AdaptiveEagerMode | None:
        """This thread's mode, or the engine's mode this thread runs under without having
        enabled it: autograd runs an accelerator's backward on a thread of its own, which
        inherits the caller's dispatch mode stack (hooks there, DDP's among them)."""
        m = self.mode()
        if m is not None:
            return m
        for mode in reversed(_get_current_dispatch_mode_stack()):
            if isinstance(mode, AdaptiveEagerMode):
                return mode
        return None

    def enable(self, config: Config) -> None:
        _set_debug(config.debug)
        wanted, config = config.hot_path, self._buildable(config)
        set_depth(config.queue_depth)
        if "neuron" in config.devices:  # the device must exist before the program names it
            from . import neuron

            if neuron.ensure() and not neuron.is_native():
                # the Python emulator: its tensors are managed like plain ones
                from adaptive_eager.neuron.tensor import NeuronTensor, empty_strided
                from adaptive_eager.tracer.signature import ALLOCATORS, PLAIN

                PLAIN.add(NeuronTensor)
                ALLOCATORS["neuron"] = empty_strided
                from adaptive_eager.neuron import hardware

                hardware.add_flush_hook(self._flush_for_device)
                readguard.install(self, NeuronTensor)  # its own __repr__, tolist, ...
            elif neuron.is_native():
                # the C++ emulator: torch.neuron flushes through the same hooks
                from adaptive_eager.neuron import hardware

                hardware.add_flush_hook(self._flush_for_device)
                cudaguard.install(self._flush_for_device, cudaguard.ACCELERATOR_POINTS)
        if "cuda" in config.devices:
            cudaguard.install(self._flush_for_device)
        self._install_hooks()
        compiled_regions.hook(self)  # Note [Beside torch.compile]
        if self.cache._lru.maxsize != config.cache_size:
            self.cache.resize(config.cache_size)
        m = getattr(self.local, "mode", None)
        if m is None:
            m = self.local.mode = AdaptiveEagerMode(self, config)
            m.governor = Governor()
            with self._lock:
                self.counters.append(m.counters)
                self.modes.add(m)
        if config.hot_path != wanted:
            m.counters.fallback(f"hot path in Python: {self._build_failed}")
        if getattr(self.local, "active", False):
            if not m.governor.release(m):  # aside on a changed stack: enter afresh
                m.__enter__()
            m.boundary("enable")
            if (config.backend, config.devices) != (m.config.backend, m.config.devices):
                m.reset_state()
            m.configure(config)
            self._engage(config.hot_path == "key")
            return
        if (config.backend, config.devices) != (m.config.backend, m.config.devices):
            m.reset_state()
        m.configure(config)
        m.__enter__()
        self.local.active = True
        self._engage(config.hot_path == "key")
        readguard.count_reads(self, True)

    def _buildable(self, config: Config) -> Config:
        """``config``, or where the compiled hot path cannot be built here (no compiler, an
        unwritable or full disk) the same with the Python hot path: said in one line once,
        counted at each enable."""
        if config.hot_path == "python":
            return config
        from adaptive_eager.cpp_build import BuildError
        from adaptive_eager.tracer import hot_key, native

        try:
            native.load()
            if config.hot_path == "key":
                hot_key.load()
            return config
        except BuildError as e:
            if self._build_failed is None:
                sys.stderr.write(f"{e}; the engine's hot path runs in Python\n")
            self._build_failed = str(e)
        return dataclasses.replace(config, hot_path="python")

    def engage_key(self, mode, on: bool) -> None:
        """The governor's: the key off while ``mode`` (this thread's) steps aside, back on
        with it (Note [Stepping aside])."""
        self._engage(on and mode.config.hot_path == "key")

    @contextlib.contextmanager
    def aside(self, reason: str):
        """This thread's engine off the dispatch stack, its key off, for a block: what it held
        launched first (a counted boundary, ``reason``). Nothing where it is not on top of the
        stack (off, aside already, another mode above it). Note [Beside torch.compile]."""
        m = self.mode()
        stack = _get_current_dispatch_mode_stack()
        if (m is None or not getattr(self.local, "active", False) or not stack
                or stack[-1] is not m):
            yield
            return
        m.boundary(reason)
        self._engage(False)
        m.__exit__(None, None, None)
        self.local.aside = True
        try:
            yield
        finally:
            self.local.aside = False
            m.__enter__()
            self._engage(m.config.hot_path == "key")

    def compile_started(self) -> None:
        """Dynamo begins a compile on this thread outside ``aside`` (a backward compiled
        lazily, ``torch._dynamo.optimize``): the engine launches what it holds and takes its
        dispatch key off (Note [Beside torch.compile], adaptive_eager/compiled_regions)."""
        m = self.mode()
        if (m is None or not getattr(self.local, "active", False) or m.paused
                or getattr(self.local, "aside", False)):
            return
        m.boundary("torch.compile")
        self.local.aside_for_compile = getattr(self.local, "engaged", None) is not None
        self._engage(False)

    def compile_ended(self) -> None:
        if getattr(self.local, "aside_for_compile", False):
            self.local.aside_for_compile = False
            m = self.mode()
            self._engage(m is not None and getattr(self.local, "active", False)
                         and m.config.hot_path == "key")

    def _engage(self, on: bool) -> None:
        """Ops reach this thread's mode through the hot path's dispatch key (``hot_path`` key),
        or not. Switched here, in the engine's Python, outside any op: Note [Below the
        floor]."""
        engaged = getattr(self.local, "engaged", None)
        if on == (engaged is not None):
            return
        from adaptive_eager.tracer import hot_key

        if on:
            self.local.engaged = hot_key.engage(self.local.mode)
        else:
            hot_key.disengage(engaged)
            self.local.engaged = None

    def disable(self) -> None:
        m = self.mode()
        if m is None:
            return
        if not m.governor.release(m):  # stepped aside (Note [Stepping aside]): not on the stack
            m.boundary("disable")
            self.local.active = False
            self._engage(False)
            readguard.count_reads(self, False)
            return
        stack = _get_current_dispatch_mode_stack()
        if stack and stack[-1] is not m:
            raise RuntimeError(
                "adaptive_eager: disable() while another dispatch mode "
                f"({type(stack[-1]).__name__}) is active above the engine; exit it first"
            )
        try:
            m.boundary("disable")
        finally:
            self._engage(False)
            m.__exit__(None, None, None)
            self.local.active = False
            readguard.count_reads(self, False)

    def config(self) -> Config | None:
        m = self.mode()
        return m.config if m is not None else None

    # ---------------------------------------------------------------- whole-engine ops

    def mark_step(self) -> None:
        m = self.mode()
        if m is not None:
            m.boundary("mark_step")
            if not m.governor.by_optimizer:  # else optimizer steps are the steps
                m.counters.tick()

    def _flush_for_device(self, reason: str) -> None:
        """The program orders or waits on a device queue: launch what this thread defers
        (on autograd's device thread, what the mode it runs under defers)."""
        m = self.mode_here()
        if m is not None and not m.paused:
            m.boundary(reason)

    def synchronize(self) -> None:
        m = self.mode()
        if m is not None:
            m.boundary("synchronize")
        synchronize_all()

    def settle_here(self) -> None:
        """What this thread's plan served or ran at once, into its segment and counters
        (tracer.hot_plan): a plan from the root may run ops at once before a segment starts."""
        m = self.mode()
        if m is not None:
            m.settle()

    def stats(self):
        self.settle_here()
        with self._lock:
            return snapshot(list(self.counters))

    def reset(self) -> None:
        m = self.mode()
        if m is not None:
            m.boundary("reset")
        self.compiler.reset()
        self.cache.clear()
        with self._lock:
            for other in list(self.modes):
                if other is m or not other.seg.hot:
                    other.reset_state()
            for c in self.counters:
                c.__init__()
        self.n_paths = 0

    def wait_compiles(self, timeout: float | None = None) -> bool:
        """Block until background compiles are done and installed on this thread."""
        done = self.compiler.wait_idle(timeout)
        m = self.mode()
        if m is not None and m.inbox:
            m.boundary("install compiles")
        return done

    # ---------------------------------------------------------------- hooks

    def _install_hooks(self) -> None:
        if self._hooked:
            return
        with self._lock:
            if self._hooked:
                return
            from torch.optim.optimizer import register_optimizer_step_post_hook

            register_optimizer_step_post_hook(self._optimizer_step)
            skip_rule_lookup()
            readguard.install(self)
            atexit.register(self._at_exit)
            self._hooked = True

    def _optimizer_step(self, optimizer, args, kwargs) -> None:
        m = self.mode()
        if m is not None and not m.paused:
            if not m.governor.off:
                m.boundary("optimizer step")
            m.governor.optimizer_step(m)

    def _at_exit(self) -> None:
        try:
            self.disable()
        except Exception as e:  # interpreter shutdown: report, never raise
            log.warning("adaptive_eager: flushing at exit failed: %s", e)
        self._keep_compiles()
        compile_process.stop_shared()  # a compile in the child ends now, not when done
        self.compiler.shutdown()


    def _keep_compiles(self) -> None:
        """Note [Warm start]: a short run ends before its graphs compiled; the next run would
        compile them again. With warm start on, the exit waits for them (bounded). And the
        paths that ended without going hot are kept too (tracer.warm.keep_seen)."""
        from adaptive_eager.tracer import warm

        for m in list(self.modes):
            if m.thread != threading.get_ident():
                continue  # another thread's trie, which may still be in use
            try:
                warm.keep_seen(m)
            except Exception as e:  # interpreter shutdown: report, never raise
                log.warning("adaptive_eager: keeping paths at exit failed: %s", e)
        waits = [m.config.cache_exit_s for m in list(self.modes) if m.warm is not None]
        n = self.compiler.pending()
        if not waits or not n or max(waits) <= 0:
            return
        sys.stderr.write(f"adaptive_eager: finishing {n} graph compile{'s' * (n > 1)} for "
                         f"the warm-start cache (at most {max(waits):g} s; Ctrl-C skips)\n")
        try:
            self.compiler.wait_idle(max(waits))
        except KeyboardInterrupt:
            pass


def _set_debug(level: int) -> None:
    logger = logging.getLogger("adaptive_eager")
    if level <= 0:
        return
    logger.setLevel(logging.DEBUG if level >= 2 else logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[adaptive_eager] %(message)s"))
        logger.addHandler(handler)


ENGINE = Engine()
compiled_regions.install(ENGINE)  # Note [Beside torch.compile]
