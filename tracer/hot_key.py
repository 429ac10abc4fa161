"""Stage 2 of the compiled hot path, its mechanism: ops below autograd reach C++ kernels of ours.

Note [Below the floor]: a Python dispatch mode costs ~3.5 µs per op before the engine does
any work (the Python floor), which on cpu is most of an eager op's cost. A dispatch key of
ours, included in the thread's dispatch key set, takes each op after autograd recorded it, in
C++ (``csrc/hot_key.cpp``): unboxed kernels, one per op, generated from ATen's operator
structs, and a boxed fallback for every other op. The key is ``Fake``, the one functionality
key between BackendSelect and Python. This module loads it and switches it on and off; what
its kernels do is an ``action``, chosen for measuring the mechanism
(benchmarks/below_floor.py) or ``route`` for the engine (``NEURON_ADAPTIVE_EAGER_HOT_PATH=
key``), where every op reaches the mode through the key, except the ops of a hot segment
that the key's plan expects: after each op the mode handled, the key asks it for a plan of
what follows (tracer/hot_plan.py) and serves those ops in C++ without the interpreter lock
(csrc/hot_segment.cpp), handing them to the segment at the first op the plan does not
expect or when the engine's Python touches the segment (``settle``).

What the mechanism taught (each tried here, torch 2.13):

* The key sits below the mode: the Python key has priority, so while the engine's mode is
  pushed, ops reach our kernels only if Python (and PythonTLSSnapshot, above autograd) are
  excluded in the thread: ``engage()``. Our kernels then route each op to the mode (a boxed
  redispatch to PythonTLSSnapshot and Python, those keys un-excluded for the call so that the
  mode counts as active in it), or run it below when no mode is on the stack (inside the
  mode's handling, which pops it). The mode sees the ops it saw without the key.
* PyTorch asks "is a dispatch mode active?" (Python not excluded, a mode on the stack) in
  places and takes another path when one is: engaged, it sees none, so autograd no longer
  detaches saved outputs for the mode, and composite ops take plain eager's path, not the
  subclass path (Note [Any dispatch mode], tests/fidelity/harness.py).
* A change to the thread's key sets made inside a dispatcher call does not outlive the call:
  ``ExcludeDispatchKeyGuard`` and ``IncludeDispatchKeyGuard`` save the whole set and restore
  it, and autograd's kernels hold one above every op. Only the engine's own Python, outside
  any op (``ae.enable``/``disable``), can engage or disengage the key; a divergence must be a
  flag the kernels read, not a switch of the key sets.
* Why not a backend key (PrivateUse3, tried first): its backend bit joins every call, so
  factory functions, whose BackendSelect kernel picks the backend from their options, never
  reach it (``randperm`` would consume the generator behind the engine's back); ops with a
  composite kernel for every backend reach it decomposed (``sub.Tensor`` as ``sub.out``);
  and sparse, quantized and nested tensors' ops land on its per-backend keys.
* Boxing is cheap: a boxed kernel of ours costs about what an unboxed one does, so hot ops
  may be served by one boxed kernel.
* Calling the engine's handler from our kernel, not through the Python key, gains the engine
  nothing (chain-small 6.57 against 6.31 µs an op): its compiled handler already skips what
  that skips. The cost is the Python objects each op makes; only a hot path served without
  Python (segment state in C++, no interpreter lock) goes below the floor: the plans.
* Autograd unpacks a saved output as a new tensor on the output's memory without an op when
  no mode is seen (with a mode it is a ``detach`` the mode sees), and ``.data`` likewise. In
  a hot segment that output is still pending: a fused graph read the new tensor before
  computing the value (NaN in gradients: tanh's backward, llama under inductor). Such a
  tensor, on the value's memory exactly as the value, is taken for the value itself (Note
  [Memory of a value], tracer/segment.py), by the mode and by the plans alike, so a training
  step stays one segment; any other new tensor on a value's memory is a boundary.
* On an accelerator autograd runs the backward on a device thread of its own, which inherits
  the key sets and the mode stack of the thread that called ``backward()``: the engine's
  handler and planner belong to the engaged mode, not to the thread that engaged it, or the
  backward reaches the mode through the Python key, unplanned (llama on neuron: 109 of 564
  ops a step served, 272 once the device thread found the mode's handler).
* Between a segment's ops come ops the mode runs at once outside it (an optimizer's step
  counts, profiler ranges, cpu ops beside a device's segment): a plan runs those itself and
  counts them as the mode does, instead of handing back (Note [Host scalars], tracer/mode.py).
* Autograd accumulates a gradient in place (``add_``) when nothing else holds the buffer's
  memory, out of place otherwise; with no mode seen as active it asks, as plain eager does.
  The engine's cold runs made the buffer's Python storage object, which holds the memory,
  so they learned ``add`` where the replays met ``add_``: storages are read without their
  objects (Note [Storage objects], scheduler/storage.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from adaptive_eager import cpp_build

__all__ = ["ACTIONS", "counts", "disengage", "engage", "engaged", "load", "switched_on"]

ACTIONS = {"hand-back": 0, "canned": 1, "allocate": 2, "route": 3}
_CSRC = Path(__file__).with_name("csrc")
_module = None


def load():
    """The built extension (built first if needed)."""
    global _module
    if _module is None:
        sources = [_CSRC / "hot_key.cpp", _CSRC / "hot_segment.cpp", _CSRC / "output_pool.cpp"]
        _module = cpp_build.build("hot_key", sources,
                                  headers=[_CSRC / "hot_segment.h"], who="adaptive_eager",
                                  what="the hot path's dispatch key",
                                  instead="set NEURON_ADAPTIVE_EAGER_HOT_PATH=python")
    return _module


def _acting(action: str, canned: torch.Tensor | None = None):
    """The extension, its kernels set to do ``action``."""
    if action not in ACTIONS:
        raise ValueError(f"hot key action {action!r}: expected one of {', '.join(ACTIONS)}")
    m = load()
    m.set_action(ACTIONS[action], canned)
    return m


@contextlib.contextmanager
def switched_on(action: str = "hand-back", canned: torch.Tensor | None = None):
    """The key included in this thread's dispatch key set, its kernels doing ``action``."""
    m = _acting(action, canned)
    was = m.is_on()
    m.set_on(True)
    try:
        yield m
    finally:
        m.set_on(was)


def engage(mode=None, action: str = "route"):
    """Engage the key in this thread (the mode's keys excluded), its kernels doing ``action``
    (``route``: every op to the dispatch mode, the engine's ``hot_path`` key); ``mode``, if
    given, is called directly while it is on top of the stack. Call from Python, outside any
    op. Returns what ``disengage`` restores."""
    m = _acting(action)
    _let_higher_order_ops_through(m)
    return m.set_engaged(True, mode)


# Note [Higher-order ops and the key]: a higher-order op (FlexAttention, ``cond``, ...) picks
# its kernel in Python, from the thread's included keys and its tensors' keys, among the
# kernels it has. Engaged, the thread includes our key and excludes Python, so it found only
# our key, for which it has no kernel: ``flex_attention`` under the engine raised "could not
# find kernel for HigherOrderOperator flex_attention at dispatch key ???" where eager runs
# (found by the nn zoo, tests/fidelity/zoo.py). Every higher-order op lets our key fall
# through, as it does the keys PyTorch makes each one skip: it then runs as in eager, and the
# aten ops it runs reach our key like any other op. Ops made after the engine first engaged
# (their modules imported later) get the same at their construction. Where a higher-order op
# reaches the mode instead (the Python key, the other hot paths), it is a counted boundary
# run as in eager (tracer/mode.py). FlexAttention's eager path also calls torch.compile,
# which needs the engine aside while it compiles (Note [Beside torch.compile]).
_OUR_KEYS = None


def _let_higher_order_ops_through(m) -> None:
    global _OUR_KEYS
    if _OUR_KEYS is not None:
        return
    from torch._ops import HigherOrderOperator, _higher_order_ops

    was = m.is_on()
    m.set_on(False)
    off = torch._C._dispatch_tls_local_include_set()
    m.set_on(True)
    ours = torch._C._dispatch_tls_local_include_set() - off
    m.set_on(was)
    _OUR_KEYS = ours
    for op in list(_higher_order_ops.values()):
        op.non_fallthrough_keys = op.non_fallthrough_keys - ours
    init = HigherOrderOperator.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.non_fallthrough_keys = self.non_fallthrough_keys - ours

    HigherOrderOperator.__init__ = __init__


def disengage(was) -> None:
    load().set_engaged(was)


@contextlib.contextmanager
def engaged(action: str = "route", mode=None):
    """``engage`` for the duration of a block."""
    was = engage(mode, action)
    try:
        yield load()
    finally:
        disengage(was)


def counts() -> tuple[int, int]:
    """(calls of our unboxed kernels, ops handed back by the fallback) in this process."""
    return tuple(load().counts())
