"""The step governor: the engine stays on a training loop only while it is not slower.

Note [Stepping aside]: every intercepted op pays the dispatcher's trip into Python (DESIGN
§11), whatever the engine then saves. Where launches are cheap -- small models on the CPU --
that trip alone can cost more than the op it replaces, and a hot path replayed in one launch
still makes the step slower than eager. The engine cannot see this from inside: its own cold
runs are slower than eager too. So it measures what the user would feel, per optimizer step:

    measure   the engine on, the trie settled (no new node, nothing diverged, no path
              still on its way to hot, no fused graph run for the first time, no compiled
              graph waiting to be installed; a compile still running does not count, Note
              [Measured while compiling]): time ``window`` steps;
    probe     the mode off the dispatch stack and the hot path's dispatch key off --
              plain eager, nothing intercepted -- for ``window`` steps, timed the same way;
    decide    engine median > ``suspend_ratio`` x eager median: *suspended* (plain eager)
              for ``backoff`` steps, counted with both figures as a fallback, the back-off
              growing x4 each time up to 4096 steps; else *kept* and probed again after
              1,000 steps, as the program may change.

What is a step: the interval between two optimizer steps on this thread (the optimizer-step
hook, called with or without the mode on the stack) once one has been seen; before that, and
in loops without an optimizer (``generate``, inference), every ``READS_PER_STEP`` host reads
(``.item()``, ``bool(t)``: a decode loop reads once per token), counted by wrappers on those
``torch.Tensor`` methods while the engine is enabled on some thread: they run before
dispatch, so they see reads with the mode on or aside, and can step it aside
(adaptive_eager.readguard.count_reads). A read-clocked step is
measured even while the trie still grows: a program that never settles runs cold, and cold
is never faster than eager.

While suspended the engine keeps its trie and caches and intercepts nothing: ``stats()``
counts those steps in ``steps_suspended``, not their ops. It only steps aside when its mode
is the innermost dispatch mode (another mode pushed above it cannot be slipped out from
under). Cost: one ``perf_counter`` and a few comparisons per step; a read costs one
thread-local lookup and a counter more.
"""

from __future__ import annotations

import logging
import statistics
import time

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["Governor"]

log = logging.getLogger("adaptive_eager")

MEASURE, PROBE, SUSPENDED, KEPT = "measure", "probe", "suspended", "kept"
WINDOW = 5  # steps timed per side
READS_PER_STEP = 8  # host reads that make one step when no optimizer steps
# A step longer than this is not a loop iteration (a pause at a notebook prompt, a long
# first compile): the window being measured starts again.
MAX_STEP = 1.0  # seconds
FIRST_BACKOFF, MAX_BACKOFF, RECHECK = 16, 4096, 1000


class Governor:
    """One per thread's mode: ``optimizer_step`` (the optimizer-step hook) and ``read`` (the
    host-read wrappers, adaptive_eager.readguard) drive it."""

    def __init__(self):
        self.state = MEASURE
        self.last = None  # perf_counter at the previous step
        self.nodes = -1  # trie size at the previous step
        self.learning = -1  # the mode's one-off work count at the previous step
        self.diverged = 0
        self.engine_times: list = []
        self.eager_times: list = []
        self.left = 0  # steps left in SUSPENDED / KEPT
        self.backoff = FIRST_BACKOFF
        self.off = False  # is the mode stepped aside (popped) right now
        self.depth = 0  # dispatch stack depth when it stepped aside
        self.by_optimizer = False  # steps are optimizer steps (else groups of host reads)
        self.reads = 0

    def optimizer_step(self, mode) -> None:
        self.by_optimizer = True
        mode.counters.tick()
        self._step(mode)

    def read(self, mode) -> None:
        """A host read on this thread (``item``, ``__bool__``): the clock of loops without an
        optimizer."""
        if self.by_optimizer or mode.paused:
            return
        self.reads += 1
        if self.reads >= READS_PER_STEP:
            self.reads = 0
            mode.counters.tick()
            self._step(mode)

    def _step(self, mode) -> None:
        ratio = mode.config.suspend_ratio
        if ratio <= 0:
            return
        now = time.perf_counter()
        dt = None if self.last is None else now - self.last
        self.last = now
        if self.state == MEASURE:
            c = mode.counters
            diverged = c.fallbacks.get("diverged from the hot path", 0)
            # A compile still running does not count (Note [Measured while compiling]).
            settled = not mode.inbox and (not self.by_optimizer or (
                mode.n_nodes == self.nodes and diverged == self.diverged
                and mode.learning == self.learning))
            self.nodes, self.diverged, self.learning = mode.n_nodes, diverged, mode.learning
            if not settled or dt is None or dt > MAX_STEP:
                self.engine_times.clear()
                return
            self.engine_times.append(dt)
            if len(self.engine_times) >= WINDOW and self._aside(mode):
                self.state, self.eager_times = PROBE, []
                self.last = time.perf_counter()  # the probe starts now, without the mode
        elif self.state == PROBE:
            if dt > MAX_STEP:
                self.eager_times.clear()
                return
            self.eager_times.append(dt)
            if len(self.eager_times) >= WINDOW:
                self._decide(mode, ratio)
        elif self.state == SUSPENDED:
            mode.counters.steps_suspended += 1
            self.left -= 1
            if self.left <= 0 or mode.inbox:  # a graph arrived: measure with it
                self._remeasure(mode)
        elif self.state == KEPT:
            self.left -= 1
            if self.left <= 0:
                self._remeasure(mode)

    def _decide(self, mode, ratio: float) -> None:
        engine = statistics.median(self.engine_times)
        eager = statistics.median(self.eager_times)
        if engine > ratio * eager:
            step = "optimizer step" if self.by_optimizer else f"{READS_PER_STEP} host reads"
            reason = (f"engine slower than eager on this loop ({engine * 1e3:.2f} ms vs "
                      f"{eager * 1e3:.2f} ms per {step}, limit {ratio}x): "
                      f"stepped aside for {self.backoff} steps")
            if mode.engine.compiler.busy():  # measured on exact replays: back with the graphs
                reason += ", graphs still compiling"
            mode.counters.fallback(reason)
            if mode.debug >= 1:
                log.info("%s", reason)
            self.state, self.left = SUSPENDED, self.backoff
            self.backoff = min(self.backoff * 4, MAX_BACKOFF)
            return  # still aside
        if self._back(mode):
            self.state, self.left = KEPT, RECHECK
            self.backoff = FIRST_BACKOFF
        else:  # cannot return yet: treat as a short suspension
            self.state, self.left = SUSPENDED, 1

    # Note [Measured while compiling]: a path replays exactly while its fused graph compiles
    # (Note [Warm paths replay exactly]). On a CPU loop of small ops the exact replay can be
    # slower than eager (a tiny Llama training step: 14 ms against 5.7 ms), and a fused
    # compile of a whole training step can take minutes at low priority. Waiting for the
    # compile before measuring kept such a loop 2.5x slower for all that time. So the loop
    # is measured as it runs, compiling or not, and a graph delivered while the engine is
    # aside ends the suspension at the next step (however long the back-off has grown), so
    # the engine is measured again with it.

    def _remeasure(self, mode) -> None:
        if self._back(mode):
            self.state = MEASURE
            self.engine_times, self.nodes = [], -1

    def _aside(self, mode) -> bool:
        stack = _get_current_dispatch_mode_stack()
        if not stack or stack[-1] is not mode:
            self.engine_times.clear()
            return False
        mode.boundary("engine steps aside")
        mode.engine.engage_key(mode, False)  # aside means plain eager: no key either
        mode.__exit__(None, None, None)
        self.off = True
        self.depth = len(stack) - 1
        return True

    def _back(self, mode) -> bool:
        """Push the mode again if it is aside; only onto the stack it left (another mode
        pushed meanwhile would otherwise pop the engine's mode at its own exit)."""
        if not self.off:
            return True
        if len(_get_current_dispatch_mode_stack()) != self.depth:
            return False
        mode.__enter__()
        mode.engine.engage_key(mode, True)
        self.off = False
        return True

    def release(self, mode) -> bool:
        """Disabling or reconfiguring: forget the measurements; True if the mode is on the
        dispatch stack again (False: it stays aside, the stack having changed meanwhile)."""
        back = self._back(mode)
        self.__init__()
        return back
