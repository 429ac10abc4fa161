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

import torch

__all__ = ["install", "GUARDED"]

GUARDED = ("tolist", "numpy", "__array__", "data_ptr", "__repr__", "__reduce_ex__",
           "__dlpack__")

_ORIGINAL: dict = {}


# Reads the dispatch mode does see (``_local_scalar_dense``), wrapped only to tell the step
# governor (adaptive_eager.governor) a host read happened, which it must hear even while the
# mode is off the stack.
COUNTED = ("item", "__bool__")


def install(engine) -> None:
    """Wrap the guarded and counted methods of ``torch.Tensor`` (once per process)."""
    for name in GUARDED + COUNTED:
        if name in _ORIGINAL:
            continue
        original = getattr(torch.Tensor, name)
        _ORIGINAL[name] = original
        wrap = _guard if name in GUARDED else _count
        setattr(torch.Tensor, name, wrap(engine, name, original))


def _count(engine, name, original):
    @functools.wraps(original)
    def counted(self, *args, **kwargs):
        m = engine.mode()
        if m is not None:
            m.governor.read(m)
        return original(self, *args, **kwargs)

    counted.__adaptive_eager_guard__ = True
    return counted


def original(name: str):
    return _ORIGINAL.get(name) or getattr(torch.Tensor, name)


def _guard(engine, name, original):
    reason = f"read: {name}"

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
