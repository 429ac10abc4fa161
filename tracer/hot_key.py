"""Stage 2 of the compiled hot path, its mechanism: ops below autograd reach C++ kernels of ours.

Note [Below the floor]: a Python dispatch mode costs ~3.5 µs per op before the engine does
any work (the Python floor), which on cpu is most of an eager op's cost. A dispatch key of
ours (PrivateUse3), included in the thread's dispatch key set while a path is hot, takes each
op after autograd recorded it, in C++ (``csrc/hot_key.cpp``): unboxed kernels, one per op,
generated from ATen's operator structs, and a boxed fallback that hands every other op back
(runs it below the key, counted). This module loads it and switches it on and off; what its
kernels do is an ``action`` chosen for measuring the mechanism (benchmarks/below_floor.py).
The engine's hot segments do not use it yet.

What the mechanism taught, for wiring it into hot segments (each tried here, torch 2.13):

* The key sits below the mode: the Python key has priority over every backend's dense key,
  so while the engine's mode is pushed, ops reach our kernels only if Python (and
  PythonTLSSnapshot, above autograd) are excluded in the thread.
* A change to the thread's key sets made inside a dispatcher call does not outlive the call:
  ``ExcludeDispatchKeyGuard`` and ``IncludeDispatchKeyGuard`` save the whole set and restore
  it, and autograd's kernels hold one above every op. A kernel (or the mode) that excludes
  Python to engage the key, or un-excludes it to hand a diverged op back, finds the change
  undone when the op returns; only the engine's own Python, outside any op (``ae.enabled``,
  a boundary it runs), can switch the sets reliably. So divergence must be a flag the kernels
  read (run below, or call the mode themselves) rather than a switch of the key sets.
* Ops with a ``CompositeExplicitAutograd`` kernel never meet the boxed fallback: that kernel
  serves every backend, ours included, and decomposes the op (``sub.Tensor`` arrives as
  ``sub.out``). Handing an op back to the mode as the op the user called needs a kernel of
  ours registered for it, not the fallback.
* Another route with none of these problems: kernels of ours on the Python key itself, for
  the hot ops only (an op's kernel takes precedence over the Python key's fallback), doing
  what the fallback does (call the mode) whenever the thread is not replaying a hot path.
  Its cost is PythonTLSSnapshot's boxed fallback above autograd, which stays.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from adaptive_eager import cpp_build

__all__ = ["ACTIONS", "counts", "load", "switched_on"]

ACTIONS = {"hand-back": 0, "canned": 1, "allocate": 2}
_CSRC = Path(__file__).with_name("csrc")
_module = None


def load():
    """The built extension (built first if needed)."""
    global _module
    if _module is None:
        _module = cpp_build.build("hot_key", [_CSRC / "hot_key.cpp"], who="adaptive_eager",
                                  what="the hot path's dispatch key",
                                  instead="leave the hot path's dispatch key off")
    return _module


@contextlib.contextmanager
def switched_on(action: str = "hand-back", canned: torch.Tensor | None = None):
    """The key included in this thread's dispatch key set, its kernels doing ``action``."""
    if action not in ACTIONS:
        raise ValueError(f"hot key action {action!r}: expected one of {', '.join(ACTIONS)}")
    m = load()
    m.set_action(ACTIONS[action], canned if canned is not None else torch.empty(0))
    was = m.is_on()
    m.set_on(True)
    try:
        yield m
    finally:
        m.set_on(was)


def counts() -> tuple[int, int]:
    """(calls of our unboxed kernels, ops handed back by the fallback) in this process."""
    return tuple(load().counts())
