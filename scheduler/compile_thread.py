"""A thread that compiles in this process: what it must not disturb.

The background compiler (scheduler.compiler) runs fused compiles on one daemon thread named
``THREAD_NAME``; when a compile runs in this process rather than the compile process
(backends on this thread, or the compile process off), ``prepare_thread`` readies that
thread: the user's random stream untouched, the failures it expects kept out of the log.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading

__all__ = ["THREAD_NAME", "prepare_thread"]

THREAD_NAME = "adaptive_eager-compiler"


# Note [Compiles must not touch the user's generator]: Inductor's codegen runs inside
# ``torch._dynamo.utils.preserve_rng_state()``, which saves the global CPU generator and sets
# it back afterwards. From a background thread that *rewinds the user's random stream*: every
# dropout mask drawn by the training loop while the compile ran is drawn again (found as a
# 1e-2 loss drift from the first fused step of an MLP whose graph compiled during 20 steps).
# The compiler thread therefore runs with that context manager disabled; other threads keep
# the original behaviour.
_RNG_GUARDED = False


def _guard_user_rng() -> None:
    global _RNG_GUARDED, _ORIGINAL_PRESERVE, _GUARDED_PRESERVE
    if _RNG_GUARDED:
        return
    from torch._dynamo import utils

    original = utils.preserve_rng_state

    @contextlib.contextmanager
    def preserve_rng_state():
        if threading.current_thread().name == THREAD_NAME:
            yield
            return
        with original():
            yield

    _ORIGINAL_PRESERVE, _GUARDED_PRESERVE = original, preserve_rng_state
    # Modules that imported the name itself hold the original: AOTAutograd's, which
    # Inductor's pattern matcher runs when it first initializes its patterns (lazily, inside
    # a compile: found as a rewound dropout stream in CI), and autotuning's. Import them now
    # and rebind the name wherever it was copied (torch._dynamo.utils included).
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.select_algorithm  # noqa: F401

    _rebind_copies()
    _RNG_GUARDED = True


_ORIGINAL_PRESERVE = _GUARDED_PRESERVE = None


def _rebind_copies() -> None:
    for name, module in list(sys.modules.items()):
        held = getattr(module, "preserve_rng_state", None) if name.startswith("torch") else None
        if held is not None and held is _ORIGINAL_PRESERVE:
            module.preserve_rng_state = _GUARDED_PRESERVE


class _FromCompilerThread(logging.Filter):
    """Note [Quiet failed traces]: when an op has no meta kernel for the dtypes it ran with
    (``_grouped_mm`` in float32 on the CPU), ``FakeTensorMode`` logs the whole traceback at
    ERROR before raising. On the compiler thread that failure is expected and handled: the
    path keeps its exact replay and the reason is counted (``compile failed: ...``), so the
    log record is dropped there; other threads' records pass untouched."""

    def filter(self, record) -> bool:
        return threading.current_thread().name != THREAD_NAME


def prepare_thread() -> None:
    """Ready this thread to compile in process (the first call imports Inductor: seconds).

    Raises RuntimeError when the program ends during that import: the interpreter's shutdown
    refuses what the import registers ("can't register atexit after shutdown").
    """
    _guard_user_rng()
    _quiet_failed_traces()


def _quiet_failed_traces() -> None:
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    if not any(isinstance(f, _FromCompilerThread) for f in logger.filters):
        logger.addFilter(_FromCompilerThread())
