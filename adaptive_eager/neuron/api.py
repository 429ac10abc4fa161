"""``torch.neuron`` for the emulated device: the surface of ``torch.cuda``, same signatures.

Registered as the device module (``torch._register_device_module``), so PyTorch's own
device-generic code (``torch.manual_seed``, autocast, ``torch.accelerator``) finds it too.
Device arguments take what ``torch.cuda`` takes: an index, ``"neuron"``, ``"neuron:0"``, a
``torch.device``, or None for the current device.

Known gaps (PyTorch needs C++ hooks for them): ``torch.Generator("neuron")`` (the device
draws from the CPU generator, Note [Device random numbers]) and
``torch.accelerator.synchronize()`` (use ``torch.neuron.synchronize()``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

import torch

from . import hardware

__all__ = [
    "is_available", "is_initialized", "device_count", "current_device", "set_device", "device",
    "get_device_name", "get_device_properties", "synchronize", "Stream", "Event",
    "current_stream", "default_stream", "set_stream", "stream", "memory_allocated",
    "max_memory_allocated", "reset_peak_memory_stats", "empty_cache", "manual_seed",
    "manual_seed_all", "seed", "initial_seed", "get_rng_state", "set_rng_state",
]

_tls = threading.local()


def is_available() -> bool:
    return hardware.count() > 0


def is_initialized() -> bool:
    return hardware.count() > 0


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return hardware.count()


def current_device() -> int:
    return getattr(_tls, "index", 0)


def device_index(device, current: int, count: int) -> int:
    """The device index ``device`` names (None or -1: ``current``) among ``count`` devices;
    a one-line error naming the bad value and the accepted ones for anything else."""
    if device is None:
        return current
    if isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        try:
            d = torch.device(device)
        except (RuntimeError, TypeError):
            d = None
        if d is None or d.type != "neuron":
            raise ValueError(f"torch.neuron: device={device!r} is not a neuron device; "
                             f"accepted: an index, 'neuron', 'neuron:N' or torch.device('neuron')")
        index = current if d.index is None else d.index
    if index == -1:
        index = current
    if not 0 <= index < count:
        raise ValueError(f"torch.neuron: device index {index} is out of range; "
                         f"accepted: 0..{count - 1}")
    return index


def _index(device) -> int:
    return device_index(device, current_device(), device_count())


def set_device(device) -> None:
    _tls.index = _index(device)


class device:
    """Context manager that makes ``device`` current for the block."""

    def __init__(self, device):
        self.idx = _index(device)
        self.prev_idx = -1

    def __enter__(self):
        self.prev_idx = current_device()
        _tls.index = self.idx

    def __exit__(self, *exc):
        _tls.index = self.prev_idx
        return False


@dataclasses.dataclass(frozen=True)
class NeuronDeviceProperties:
    name: str
    total_memory: int
    launch_latency_us: float
    emulated: bool = True


def get_device_properties(device=None) -> NeuronDeviceProperties:
    d = hardware.get(_index(device))
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    return NeuronDeviceProperties("neuron (emulated on cpu)", total, d.launch_us)


def get_device_name(device=None) -> str:
    return get_device_properties(device).name


def synchronize(device=None) -> None:
    """Wait for every launch queued on ``device``; re-raises a kernel's error."""
    hardware.flush("torch.neuron.synchronize")
    hardware.get(_index(device)).synchronize("torch.neuron.synchronize")


# -- streams and events ----------------------------------------------------------------


class Stream:
    """A hardware queue of the device (``torch.cuda.Stream``'s interface)."""

    def __init__(self, device=None, priority: int = 0, *, _hw=None):
        self._hw = _hw if _hw is not None else hardware.get(_index(device)).new_stream(priority)

    @property
    def device(self) -> torch.device:
        return torch.device("neuron", self._hw.device.index)

    @property
    def stream_id(self) -> int:
        return self._hw.stream_id

    @property
    def priority(self) -> int:
        return self._hw.priority

    def wait_event(self, event: "Event") -> None:
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        hardware.flush("Stream.query")
        return self._hw.device.query(self._hw.last)

    def synchronize(self) -> None:
        hardware.flush("Stream.synchronize")
        self._hw.device.wait_for(self._hw.last, "Stream.synchronize")

    def __eq__(self, other):
        return isinstance(other, Stream) and other._hw is self._hw

    def __hash__(self):
        return hash(self._hw)

    def __enter__(self):
        self._ctx = stream(self)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    def __repr__(self):
        return f"<torch.neuron.Stream device={self.device} stream_id={self.stream_id}>"


class Event:
    """A marker on a stream (``torch.cuda.Event``'s interface); times are the device's."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.enable_timing = enable_timing
        self.blocking = blocking
        self._hw = hardware.HwEvent()
        self._device = None

    def record(self, stream: Stream | None = None) -> None:
        s = current_stream() if stream is None else stream
        hardware.flush("Event.record")
        self._device = s._hw.device
        self._device.record(s._hw, self._hw)

    def wait(self, stream: Stream | None = None) -> None:
        s = current_stream() if stream is None else stream
        hardware.flush("Event.wait")
        s._hw.device.wait_event(s._hw, self._hw)

    def query(self) -> bool:
        return self._device is None or self._device.query(self._hw.launch)

    def synchronize(self) -> None:
        if self._device is not None:
            self._device.wait_for(self._hw.launch, "Event.synchronize")

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds of modelled device time from this event to ``end_event``."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("torch.neuron.Event.elapsed_time: both events must be created "
                               "with enable_timing=True")
        for e in (self, end_event):
            if e._device is None:
                raise RuntimeError("torch.neuron.Event.elapsed_time: both events must be "
                                   "recorded before calling elapsed_time()")
            e.synchronize()
        return (end_event._hw.time - self._hw.time) * 1e3

    def __repr__(self):
        return f"<torch.neuron.Event recorded={self._device is not None}>"


def current_stream(device=None) -> Stream:
    return Stream(_hw=hardware.current_stream(_index(device)))


def default_stream(device=None) -> Stream:
    return Stream(_hw=hardware.get(_index(device)).default_stream)


def set_stream(stream: Stream) -> None:
    if stream is not None:
        hardware.flush("stream change")
        hardware.set_current_stream(stream._hw)


@contextlib.contextmanager
def stream(stream: Stream | None):
    """Run the block with ``stream`` as the current stream of its device (None: no change)."""
    if stream is None:
        yield
        return
    previous = hardware.current_stream(stream._hw.device.index)
    hardware.flush("stream change")
    hardware.set_current_stream(stream._hw)
    try:
        yield
    finally:
        hardware.flush("stream change")
        hardware.set_current_stream(previous)


# -- memory ----------------------------------------------------------------------------


def memory_allocated(device=None) -> int:
    """Bytes held by live device tensors (their backing storage)."""
    return hardware.get(_index(device)).allocated


def max_memory_allocated(device=None) -> int:
    return hardware.get(_index(device)).peak_allocated


def reset_peak_memory_stats(device=None) -> None:
    d = hardware.get(_index(device))
    d.peak_allocated = d.allocated


def empty_cache() -> None:
    """Nothing is cached: freed buffers return to the host allocator at once."""


# -- random numbers (Note [Device random numbers]) --------------------------------------


def manual_seed(seed: int) -> None:
    """Seeds the generator the device draws from: the CPU default generator."""
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device="neuron") -> torch.Tensor:
    return torch.default_generator.get_state()


def set_rng_state(new_state: torch.Tensor, device="neuron") -> None:
    torch.default_generator.set_state(new_state)


def get_amp_supported_dtype():
    return [torch.float16, torch.bfloat16, torch.float32]
