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
  PythonTLSSnapshot, above autograd) are excluded in the thread: ``engaged()``. Our kernels
  then route each op to the mode (a boxed redispatch to PythonTLSSnapshot and Python, with
  those keys un-excluded for the call so that the mode counts as active in it), or run it
  below when no mode is on the stack (inside the mode's handling, which pops it): the mode
  sees the ops it saw without the key, except autograd's ``detach`` of saved outputs, which
  autograd issues only where a mode is seen as active.
* A change to the thread's key sets made inside a dispatcher call does not outlive the call:
  ``ExcludeDispatchKeyGuard`` and ``IncludeDispatchKeyGuard`` save the whole set and restore
  it, and autograd's kernels hold one above every op. A kernel (or the mode) that engaged or
  disengaged the key would find the change undone when the op returns; only the engine's own
  Python, outside any op (``ae.enabled``), can switch the sets reliably. So divergence must be
  a flag the kernels read (route to the mode), not a switch of the key sets.
* Ops with a composite kernel for every backend (``CompositeExplicitAutograd``) would reach
  the key decomposed (``sub.Tensor`` as ``sub.out``, ``detach`` not at all): the boxed kernel
  is registered by name for each of them (``register_composites``: ~1,500 aten ops), so the
  mode sees the op the user called.
* Boxing is cheap: a boxed kernel of ours costs what an unboxed one does (0.64 against 0.61 µs
  an op returning a preallocated tensor), so hot ops may be served by one boxed kernel.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from adaptive_eager import cpp_build

__all__ = ["ACTIONS", "counts", "engaged", "load", "switched_on"]

ACTIONS = {"hand-back": 0, "canned": 1, "allocate": 2, "route": 3}
_CSRC = Path(__file__).with_name("csrc")
_module = None


def load():
    """The built extension (built first if needed), its routing registered for the ops with a
    composite kernel for every backend."""
    global _module
    if _module is None:
        m = cpp_build.build("hot_key", [_CSRC / "hot_key.cpp"], who="adaptive_eager",
                            what="the hot path's dispatch key",
                            instead="leave the hot path's dispatch key off")
        m.register_composites()
        _module = m
    return _module


@contextlib.contextmanager
def switched_on(action: str = "hand-back", canned: torch.Tensor | None = None):
    """The key included in this thread's dispatch key set, its kernels doing ``action``."""
    if action not in ACTIONS:
        raise ValueError(f"hot key action {action!r}: expected one of {', '.join(ACTIONS)}")
    m = load()
    m.set_action(ACTIONS[action], canned)
    was = m.is_on()
    m.set_on(True)
    try:
        yield m
    finally:
        m.set_on(was)


@contextlib.contextmanager
def engaged(action: str = "route"):
    """Under a dispatch mode: the key engaged in this thread (the mode's keys excluded), its
    kernels doing ``action``. Enter and exit from Python, outside any op."""
    if action not in ACTIONS:
        raise ValueError(f"hot key action {action!r}: expected one of {', '.join(ACTIONS)}")
    m = load()
    m.set_action(ACTIONS[action], None)
    was = m.set_engaged(True)
    try:
        yield m
    finally:
        m.set_engaged(was)


def counts() -> tuple[int, int]:
    """(calls of our unboxed kernels, ops handed back by the fallback) in this process."""
    return tuple(load().counts())
