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

``torch.utils.dlpack.to_dlpack(t)`` reads memory without either a method or an op: the engine
cannot see it; call ``ae.synchronize()`` before it (the README says so).
"""

from __future__ import annotations

import functools
import threading

import torch

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
    to the host)."""
    for name in GUARDED:
        if (cls, name) in _ORIGINAL or (cls is not torch.Tensor and name not in vars(cls)):
            continue
        original = getattr(cls, name)
        _ORIGINAL[(cls, name)] = original
        setattr(cls, name, _guard(engine, name, original))


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
            _composite_reads(True)
        elif _counting[0] == 0 and originals:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            originals.clear()
            _composite_reads(False)


def _count(engine, original):
    @functools.wraps(original)
    def counted(self, *args, **kwargs):
        m = engine.mode()
        if m is not None:
            m.governor.read(m)
        return original(self, *args, **kwargs)

    return counted


def _guard(engine, name, original):
    reason = f"host read: {_READS[name]}"

    @functools.wraps(original)
    def guarded(self, *args, **kwargs):
        m = engine.mode()
        if m is None or m.paused:
            return original(self, *args, **kwargs)
        if m.seg.hot:
            m.boundary(reason)
        with m.pause():
            return original(self, *args, **kwargs)

    guarded.__adaptive_eager_guard__ = True
    return guarded


# Note [Reads inside composite ops]: a few of ATen's composite ops read a tensor argument's
# data in C++ (``data_ptr``), above the dispatch mode and without an op it could see, then
# issue ops whose arguments depend on what they read. ``tensor_split(x, indices)`` with a
# 1-D CPU tensor of indices does: with that tensor deferred it read memory no op had written
# yet and split at garbage (found by the OpInfo sweep, tests/fidelity). While the engine is
# enabled on some thread, each such op's composite kernel is replaced by a Python one that
# reads through ``item()`` / ``tolist()`` (which the engine sees: a pending tensor is
# launched first) and otherwise does what ATen's does, with its checks and messages; when
# the last thread disables the engine ATen's kernel is back. Cost: a Python call on these
# ops only, and only while the engine is enabled.


def _tensor_split(self, indices, dim=0):
    if indices.device.type != "cpu":
        raise RuntimeError("tensor_split expected tensor_indices_or_sections to be on cpu, "
                           f"but it's on {indices.device}")
    if indices.dtype != torch.long:
        raise RuntimeError("tensor_split expected tensor_indices_or_sections to have dtype "
                           f"of long, but got {indices.dtype}")
    if indices.dim() not in (0, 1):
        raise RuntimeError("tensor_split expected tensor_indices_or_sections to be a "
                           "zero-dimensional or one-dimensional tensor, but got a tensor "
                           f"with {indices.dim()} dims")
    if indices.dim() == 0:
        return torch.ops.aten.tensor_split.sections(self, indices.item(), dim)
    return torch.ops.aten.tensor_split.indices(self, indices.tolist(), dim)


COMPOSITE_READS = {"tensor_split.tensor_indices_or_sections": _tensor_split}
_library: list = []


def _composite_reads(on: bool) -> None:
    """Install (``on``) or remove Note [Reads inside composite ops] (under ``_lock``)."""
    import warnings

    if on and not _library:
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel"
            warnings.simplefilter("ignore")
            for name, fn in COMPOSITE_READS.items():
                lib.impl(name, fn, "CompositeImplicitAutograd")
        _library.append(lib)
    elif not on and _library:
        _library.pop()._destroy()
