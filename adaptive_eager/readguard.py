"""Reads the dispatch mode cannot see: flush before them.

``tolist()``, ``numpy()`` / ``__array__``, ``data_ptr()``, ``repr`` / ``print``, pickling and
``torch.save`` (``__reduce_ex__``) and ``__dlpack__`` read a tensor's memory without an aten
op. Each of these ``torch.Tensor`` methods is wrapped: when this thread's engine has deferred
work, the wrapper flushes it first, then runs the original method with the engine paused (so
printing a tensor does not trace, learn or compile the ops ``repr`` uses internally).

Why wrappers and not a ``TorchFunctionMode``: a function mode is called for *every* torch
API call while active. Measured on this machine (64-op chain, 256 floats): +1.5 us per op,
about 40 % of an eager op and more than the engine's whole hot-path budget. The wrappers cost
nothing on ops and one thread-local lookup per guarded read.

A storage's ``resize_`` (``t.untyped_storage().resize_(n)``; FSDP2 frees and re-allocates its
unsharded parameters this way) changes memory without an aten op on cpu: Note [Storage
resizes].

``torch.utils.dlpack.to_dlpack(t)`` reads memory without either a method or an op: the engine
cannot see it; call ``ae.synchronize()`` before it (the README says so).
"""

from __future__ import annotations

import functools
import threading

import torch

from . import composites, formulas

__all__ = ["install", "GUARDED"]

# The guarded methods, and the boundary reason of each in the program's words (explain()
# groups host reads by them).
_READS = {"tolist": ".tolist()", "numpy": ".numpy()", "__array__": "numpy.asarray()",
          "data_ptr": ".data_ptr()", "__repr__": "print() / repr()",
          "__reduce_ex__": "pickle / torch.save", "__dlpack__": "__dlpack__"}
GUARDED = tuple(_READS)

_ORIGINAL: dict = {}
_lock = threading.Lock()


def install(engine, cls=torch.Tensor) -> None:
    """Wrap the guarded methods of ``cls`` (once per process and class): ``torch.Tensor``, or
    a tensor subclass that defines its own (the emulated neuron device's ``__repr__`` copies
    to the host). With ``torch.Tensor``, a storage's ``resize_`` too."""
    if cls is torch.Tensor and (torch.UntypedStorage, "resize_") not in _ORIGINAL:
        original = torch.UntypedStorage.resize_
        _ORIGINAL[(torch.UntypedStorage, "resize_")] = original
        torch.UntypedStorage.resize_ = _resize_guard(engine, original)
    for name in GUARDED:
        if (cls, name) in _ORIGINAL or (cls is not torch.Tensor and name not in vars(cls)):
            continue
        original = getattr(cls, name)
        _ORIGINAL[(cls, name)] = original
        setattr(cls, name, _guard(engine, name, original))


# Note [Storage resizes]: ``UntypedStorage.resize_`` reallocates a storage's memory in place
# (to zero bytes: frees it) without an aten op on cpu, so the mode never sees it. A deferred
# op that reads or writes that memory would run after it: FSDP2 frees each unsharded
# parameter after its layer's forward, and a deferred ``mm`` of the forward then read freed
# memory ("The tensor has a non-zero number of elements, but its data is not allocated
# yet") where eager had run it before the free. So a resize is a boundary, counted as
# "storage resize": whatever the segment has deferred launches first. It ends a cold segment
# as well (one that has ops), so the paths learned cold end where the hot ones will: a
# resize inside a hot path would cut it short at every step. A resize with no op since the
# last boundary costs nothing. The resize itself then runs with the engine paused.


def _resize_guard(engine, original):
    # a cold segment ends at any resize once it has ops (Note [Storage resizes])
    return _flush_first(engine, original, "storage resize",
                        lambda S, storage: S.node is not None and S.node.depth)


# Host reads, the step governor's clock in loops without an optimizer
# (adaptive_eager.governor). The wrappers run before dispatch, so they hear reads whether the
# mode is on the stack or stepped aside, and can step it aside (which cannot happen inside
# ``__torch_dispatch__``, where the dispatcher has popped the mode for the call). They are in
# place only while the engine is enabled on some thread (reference counted): plain programs,
# and Dynamo tracing them, see the original methods.
COUNTED = ("item", "__bool__", "__float__", "__int__")
_counting = [0, {}]  # threads with the engine enabled, originals


def count_reads(engine, on: bool) -> None:
    """A thread enables (``on``) or disables the engine: wrap or restore the read methods."""
    with _lock:
        _counting[0] += 1 if on else -1
        originals = _counting[1]
        if _counting[0] == 1 and not originals:
            for name in COUNTED:
                originals[name] = getattr(torch.Tensor, name)
                setattr(torch.Tensor, name, _count(engine, originals[name]))
            composites.install(True)
            formulas.install(engine, True)
        elif _counting[0] == 0 and originals:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            originals.clear()
            composites.install(False)
            formulas.install(engine, False)


def _count(engine, original):
    @functools.wraps(original)
    def counted(self, *args, **kwargs):
        m = engine.mode()
        if m is not None:
            m.governor.read(m)
        return original(self, *args, **kwargs)

    return counted


def _guard(engine, name, original):
    # a hot segment launches first; a cold one ends where it will end hot, at a read of what
    # it computed or wrote (Segment.involves), as a read the mode sees (``item``): else the
    # path it learns runs on past the read, and a step whose only read is one of these never
    # repeats a path
    return _flush_first(engine, original, f"host read: {_READS[name]}",
                        lambda S, t: S.involves(t))


def _flush_first(engine, original, reason, ends_cold):
    """``original`` behind a boundary ``reason``: when this thread's engine (or the engine
    whose mode this thread runs under) has a hot segment, or a cold one that
    ``ends_cold(segment, self)``, it launches first; the method then runs paused."""

    @functools.wraps(original)
    def guarded(self, *args, **kwargs):
        m = engine.mode_here()
        if m is None or m.paused:
            return original(self, *args, **kwargs)
        m.settle()  # a plan may have started the segment hot (tracer.hot_plan)
        S = m.seg
        if S.hot or ends_cold(S, self):
            m.boundary(reason)
        with m.pause():
            return original(self, *args, **kwargs)

    guarded.__adaptive_eager_guard__ = True
    return guarded
