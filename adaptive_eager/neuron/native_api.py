"""``torch.neuron`` for the C++ emulated device (NEURON_EMULATOR_IMPL=cpp): the surface of
``torch.cuda`` and of ``api.py`` (the Python device's), over ``torch.accelerator`` and the
extension. One device, index 0. The device draws random numbers from the CPU default
generator (same seed, same numbers as cpu), so the seeding functions seed that generator.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from . import native
from .hardware import flush  # the engine launches what it defers before the queue is ordered
from .api import device_index
from .api import (  # noqa: F401 -- the same on both devices: the CPU default generator
    get_amp_supported_dtype, get_rng_state, initial_seed, manual_seed, manual_seed_all, seed,
    set_rng_state)

__all__ = [
    "is_available", "is_initialized", "device_count", "current_device", "set_device", "device",
    "get_device_name", "get_device_properties", "synchronize", "Stream", "Event",
    "current_stream", "default_stream", "set_stream", "stream", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "reset_peak_memory_stats", "memory_stats", "empty_cache",
    "manual_seed", "manual_seed_all", "seed", "initial_seed", "get_rng_state", "set_rng_state",
    "get_amp_supported_dtype",
]


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def _check(device) -> None:
    """``device`` names the device (index 0), or a one-line error naming what is accepted."""
    device_index(device, current=0, count=1)


def set_device(device) -> None:
    _check(device)


class device:  # noqa: N801 -- torch.cuda.device's name
    """``with torch.neuron.device(i):`` -- one device, index 0."""

    def __init__(self, device):
        _check(device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@dataclasses.dataclass(frozen=True)
class NeuronDeviceProperties:
    name: str
    total_memory: int
    launch_latency_us: float
    emulated: bool = True


def get_device_properties(device=None) -> NeuronDeviceProperties:
    _check(device)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    return NeuronDeviceProperties("neuron (emulated on cpu, C++)", total,
                                  native.load().latency_us())


def get_device_name(device=None) -> str:
    return get_device_properties(device).name


def synchronize(device=None) -> None:
    """Wait until the device's clock has passed its last launch."""
    _check(device)
    flush("torch.neuron.synchronize")
    native.load().wait("torch.neuron.synchronize")


# Streams and events are torch's own; the device's guard calls the engine's flush hook
# before an event or a stream orders or waits on the queue (module.cpp ``set_flush_hook``).
class _Torch(type):
    """Makes ``torch.neuron.Stream``/``Event`` make PyTorch's own ``torch.Stream``/``Event``
    (PyTorch's methods accept only those exact types: ``elapsed_time`` refuses a subclass),
    while the names read like classes: methods, ``isinstance``, ``issubclass``."""

    def __getattr__(cls, name):
        return getattr(cls._torch, name)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls._torch)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, cls._torch)


class Stream(metaclass=_Torch):
    """A stream of the device's queue (``torch.cuda.Stream``'s signature): a ``torch.Stream``."""

    _torch = torch.Stream

    def __new__(cls, device=None, priority=0):
        _check(device)
        return torch.Stream(device=torch.device("neuron", 0), priority=priority)


class Event(metaclass=_Torch):
    """A point in the device's queue (``torch.cuda.Event``'s signature): a ``torch.Event``."""

    _torch = torch.Event

    def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
        return torch.Event(device=torch.device("neuron", 0), enable_timing=enable_timing,
                           blocking=blocking, interprocess=interprocess)


def current_stream(device=None):
    _check(device)
    return torch.accelerator.current_stream()


def default_stream(device=None):
    _check(device)
    return torch.Stream(stream_id=0, device_index=0,
                        device_type=torch.accelerator.current_stream(0).device_type)


def set_stream(stream) -> None:
    flush("stream change")
    torch.accelerator.set_stream(stream)


class stream:  # noqa: N801 -- torch.cuda.stream's name
    """``with torch.neuron.stream(s):`` -- ``s`` is the current stream inside."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        self.previous = torch.accelerator.current_stream()
        if self.stream is not None:
            flush("stream change")
            torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc):
        flush("stream change")
        torch.accelerator.set_stream(self.previous)
        return False


def memory_allocated(device=None) -> int:
    return torch.accelerator.memory_allocated(0)


def max_memory_allocated(device=None) -> int:
    return torch.accelerator.max_memory_allocated(0)


def reset_peak_memory_stats(device=None) -> None:
    torch.accelerator.reset_peak_memory_stats(0)


def memory_stats(device=None) -> dict:
    return torch.accelerator.memory_stats(0)


def memory_reserved(device=None) -> int:
    return torch.accelerator.memory_reserved(0)


def empty_cache() -> None:
    """Return the allocator's cached free blocks to the system (after the queued launches that
    may still touch them have run)."""
    torch.accelerator.empty_cache()
