"""adaptive_eager: an adaptive eager-mode execution engine for PyTorch.

The engine watches the aten ops a program runs on a managed device, learns the sequences it
repeats (a training step, a decode step), fuses each into a cached micro-graph compiled in
the background, and replays it as one launch. Nothing else changes: same values, same
errors, same random numbers as eager.

This module stays light: ``import torch`` imports it through the ``torch.backends`` entry
point, so the engine itself is imported only when it is enabled.

.. warning::
    Engine state is per thread: ``enable()`` / ``enabled()`` act on the calling thread.
    ``torch.utils.dlpack.to_dlpack`` reads memory invisibly to the engine; call
    ``synchronize()`` first.
"""

from __future__ import annotations

__all__ = [
    "enable", "disable", "enabled", "paused", "is_enabled", "mark_step", "synchronize",
    "wait_compiles", "stats", "explain", "reset", "cache_info", "cache_clear",
]

__version__ = "0.1.0"


def _engine():
    from .engine import ENGINE

    return ENGINE


def enable(*, devices=None, backend=None, hot_threshold=None, cache_size=None, crosscheck=None):
    """Enable the engine on this thread.

    Keywords left as None take their value from the ``NEURON_ADAPTIVE_EAGER_*`` environment
    variables, else the defaults. A bad value raises ``ValueError`` naming it and the
    accepted values. Enabling again reconfigures (pending work is flushed first).
    """
    from .config import resolve

    config = resolve(devices=devices, backend=backend, hot_threshold=hot_threshold,
                     cache_size=cache_size, crosscheck=crosscheck)
    _engine().enable(config)


def disable() -> None:
    """Flush all pending work, then stop intercepting ops on this thread."""
    if is_enabled():
        _engine().disable()


class enabled:
    """``with ae.enabled(...):`` -- the engine on for the block, the previous state after.

    Takes the same keywords as ``enable()``. On exit pending work is flushed.
    """

    def __init__(self, *, devices=None, backend=None, hot_threshold=None, cache_size=None,
                 crosscheck=None):
        from .config import resolve

        self._config = resolve(devices=devices, backend=backend, hot_threshold=hot_threshold,
                               cache_size=cache_size, crosscheck=crosscheck)
        self._previous = []

    def __enter__(self):
        eng = _engine()
        self._previous.append(eng.config())
        eng.enable(self._config)
        return self

    def __exit__(self, *exc):
        eng = _engine()
        previous = self._previous.pop()
        if previous is None:
            eng.disable()
        else:
            eng.enable(previous)
        return False


class paused:
    """``with ae.paused():`` -- the block runs in plain eager, the engine's state kept.

    On entry the work the engine holds is launched (a debugger stepping through the block
    sees every value computed); inside, ops run as they are, unlearned (counted as passed
    through); after it, the engine goes on with what it had learned. Nothing to do where the
    engine is off.
    """

    def __enter__(self):
        self._mode = _engine().mode() if is_enabled() else None
        if self._mode is not None:
            self._mode.boundary("pause")
            self._pause = self._mode.pause()
            self._pause.__enter__()
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            self._pause.__exit__(*exc)
        return False


def is_enabled() -> bool:
    """Is the engine intercepting ops on this thread?"""
    import sys

    if "adaptive_eager.engine" not in sys.modules:
        return False
    return _engine().mode() is not None


def mark_step() -> None:
    """An explicit segment boundary. Never required: boundaries are found automatically."""
    if is_enabled():
        _engine().mark_step()


def synchronize() -> None:
    """Run all deferred work and wait for every device queue."""
    if is_enabled():
        _engine().synchronize()


def wait_compiles(timeout: float | None = None) -> bool:
    """Block until the graphs compiling in the background are ready, and put them in use on
    this thread. True if they all were within ``timeout`` seconds (None: no limit).

    A program never needs this: while a graph compiles, its path replays the recorded ops
    exactly (still one launch), and the loop does not wait. It is for a notebook or a
    short script that wants to see the fused graphs (``explain()``, ``report.code(gid)``),
    and for measuring the steady state. Putting graphs in use launches pending work first
    (a boundary ``install compiles`` in ``explain()``).
    """
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"wait_compiles: timeout={timeout!r}; accepted: None or a "
                             f"number of seconds >= 0")
    import sys

    if "adaptive_eager.engine" not in sys.modules:
        return True  # never enabled: nothing compiles
    return _engine().wait_compiles(timeout)


def stats():
    """Counters of the engine (all threads): a ``Stats`` snapshot with a readable repr."""
    return _engine().stats()


def explain():
    """The engine's account of the program (all threads): hot paths with the lines they span
    and the time they save, what stayed cold and why, every fallback and boundary with the
    user line that caused it, and advice. A ``Report``: text in a terminal, HTML in Jupyter,
    ``plot()``, ``to_records()``, ``to_csv(path)``."""
    from .report import collect

    engine = _engine()
    engine.settle_here()
    return collect(engine)


def reset() -> None:
    """Flush, then clear the trie, the compile cache and all counters."""
    _engine().reset()


def _warm_config():
    from .config import resolve

    return _engine().config() if is_enabled() else resolve()


def cache_info() -> dict:
    """The warm-start cache (README, Warm start): ``enabled``, its ``directory``, ``files``
    and ``bytes`` (every environment), ``limit`` (bytes), this program's kept ``paths``, the
    kept ``graphs``, and this process's ``reads``, ``writes``, ``evicted`` and ``rejected``
    (corrupted or foreign entries ignored). ``ae.stats()`` counts the paths restored and the
    graphs loaded."""
    from adaptive_eager.tracer import warm

    return warm.info(_warm_config())


def cache_clear() -> int:
    """Empty the warm-start cache (every program and environment); returns the files
    removed. What this process has already restored stays in use."""
    from adaptive_eager.tracer import warm

    return warm.clear(_warm_config())
