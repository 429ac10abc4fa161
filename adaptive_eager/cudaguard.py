"""CUDA's sync points and stream changes launch what the engine defers first.

Deferred ops have not reached a CUDA stream yet. ``torch.cuda.synchronize()``,
``Stream.synchronize()``, ``Event.record()`` and a change of the current stream call no
aten op, so the dispatch mode does not see them. In eager, the ops issued before such a
call are on their stream when it runs: a ``synchronize()`` waits for them, an event
recorded after them completes after them, and a stream change leaves them on the stream
they were issued on. Without a flush, the program would time an empty queue, an event
would fire before the work it marks, and the held ops would later run on whichever
stream is current at the flush.

So, as the emulated neuron device's own API does (``neuron.hardware.flush``), each of
these ``torch.cuda`` entry points is wrapped. When this thread's engine holds deferred
work, the wrapper launches it (a boundary named for the call: ``Stream.synchronize``,
``stream change``, ...), then runs the original. They are wrapped once per process, the
first time the engine manages ``cuda``. Each costs one thread-local lookup when the
engine holds nothing.
"""

from __future__ import annotations

import functools
import threading

import torch

__all__ = ["install", "POINTS"]

# (owner, attribute, boundary reason). ``torch.cuda.stream(s)`` and ``StreamContext``
# change streams through ``torch.cuda.set_stream``, looked up on the module at each call.
POINTS = (
    ("torch.cuda", "synchronize", "torch.cuda.synchronize"),
    ("torch.cuda", "set_stream", "stream change"),
    ("torch.accelerator", "synchronize", "torch.accelerator.synchronize"),
    ("torch.accelerator", "set_stream", "stream change"),
    ("torch.cuda.Stream", "synchronize", "Stream.synchronize"),
    ("torch.cuda.Stream", "query", "Stream.query"),
    ("torch.cuda.Stream", "wait_event", "Stream.wait_event"),
    ("torch.cuda.Stream", "wait_stream", "Stream.wait_stream"),
    ("torch.cuda.Stream", "record_event", "Stream.record_event"),
    ("torch.cuda.Event", "record", "Event.record"),
    ("torch.cuda.Event", "wait", "Event.wait"),
    ("torch.cuda.Event", "synchronize", "Event.synchronize"),
    ("torch.cuda.Event", "query", "Event.query"),
)

_ORIGINAL: dict = {}
_lock = threading.Lock()


def _owner(name: str):
    obj = torch
    for part in name.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


# ``torch.accelerator``'s own, for a device whose API module flushes itself (the C++
# emulated neuron device, native_api.py).
ACCELERATOR_POINTS = tuple(p for p in POINTS if p[0] == "torch.accelerator")


def install(flush, points=POINTS) -> None:
    """Wrap the entry points (each once per process). ``flush(reason)`` launches what the
    calling thread's engine defers."""
    with _lock:
        for owner_name, attr, reason in points:
            if (owner_name, attr) in _ORIGINAL:
                continue
            owner = _owner(owner_name)
            original = getattr(owner, attr, None)
            if original is None:  # an older torch without it
                continue
            _ORIGINAL[(owner_name, attr)] = original
            setattr(owner, attr, _wrap(original, flush, reason))


def _wrap(original, flush, reason: str):
    @functools.wraps(original)
    def guarded(*args, **kwargs):
        flush(reason)
        return original(*args, **kwargs)

    guarded.__wrapped_by_adaptive_eager__ = True
    return guarded

