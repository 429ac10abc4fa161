"""The emulated device's hardware: queues, a device clock, events, counters.

Every launch is a closure over backing CPU tensors, put on one FIFO per device and run by
one worker thread: the host returns from a launch at once and the worker runs the CPU
kernels behind it (torch releases the GIL inside kernels, so issuing and running overlap on
two cores). Streams are queues on that FIFO: the worker runs launches in submission order
(a valid schedule for any program that orders its streams with events), while the modelled
timeline below lets launches on different streams overlap.

Note [Device clock]
~~~~~~~~~~~~~~~~~~~
A real device pays a launch latency per kernel on its own timeline; the host does not wait
for it. ``time.sleep`` cannot model that (a 10 us sleep takes ~95 us here), and making the
worker spin would steal the host's core. So the worker runs each kernel as soon as it can
and *accounts* for it on a modelled clock instead:

    start = max(submitted at, end of the stream's previous launch, events it waits on)
    end   = start + launch latency + the kernel's measured time

A sync point (``synchronize()``, ``.item()``, ``.cpu()``, ``Event.synchronize()``) waits
until the worker has run the launch *and* the wall clock has passed its modelled ``end``.
The user therefore never observes a result earlier than the modelled device could have
produced it: the wall time of a program is never below launches x latency.

Errors: an exception raised by a kernel is kept with the launch that raised it and re-raised
at the next sync point; the launches queued after it on the device are skipped (their
outputs are never written, as after a device fault) and counted. The device is usable again
once the error has been reported.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import sys
import threading
import time

__all__ = ["Device", "HwStream", "HwEvent", "Counters", "DeviceError", "get", "current_stream",
           "set_current_stream"]

_clock = time.perf_counter
# A kernel's time is the worker thread's CPU time: the wall time would also count the waits
# for the interpreter lock while the host issues ops, which a device does not have.
_kernel_clock = time.thread_time


class DeviceError(RuntimeError):
    """Raised at a sync point for a failure whose original exception cannot be re-raised."""


@dataclasses.dataclass
class Counters:
    """Exact counts since the last reset (a snapshot; see ``Device.counters``)."""

    launches: int = 0
    launches_by_stream: dict = dataclasses.field(default_factory=dict)
    launches_by_name: dict = dataclasses.field(default_factory=dict)  # the C++ device's
    bytes_to_device: int = 0
    bytes_to_host: int = 0
    syncs: int = 0
    syncs_by_reason: dict = dataclasses.field(default_factory=dict)
    busy_s: float = 0.0  # modelled device time: sum of (latency + kernel) over launches
    kernel_s: float = 0.0  # measured time of the kernels alone
    skipped_after_error: int = 0
    # the C++ device's: ops whose out= form it stopped using, and why (for the process)
    dropped_out_forms: dict = dataclasses.field(default_factory=dict)


class _Launch:
    __slots__ = ("fn", "stream", "name", "submitted", "end", "done", "error", "kind", "event")

    def __init__(self, fn, stream, name, kind, event=None):
        self.fn = fn
        self.stream = stream
        self.name = name
        self.kind = kind  # "kernel" | "record" | "wait"
        self.event = event
        self.submitted = _clock()
        self.end = 0.0
        self.done = False
        self.error = None


class HwStream:
    """One hardware queue of a device."""

    def __init__(self, device: "Device", stream_id: int, priority: int = 0):
        self.device = device
        self.stream_id = stream_id
        self.priority = priority
        self.clock = 0.0  # modelled end of the last launch run on this stream
        self.last: _Launch | None = None  # last launch submitted here

    def __repr__(self):
        return f"<neuron stream {self.stream_id} on neuron:{self.device.index}>"


class HwEvent:
    """A point on a stream's modelled timeline (the device side of ``torch.neuron.Event``)."""

    def __init__(self):
        self.launch: _Launch | None = None
        self.time: float | None = None  # modelled time at which the event completes


class Device:
    """One emulated device: its streams, its worker, its clock and counters."""

    def __init__(self, index: int, launch_us: float):
        self.index = index
        self.launch_us = launch_us
        self.launch_s = launch_us * 1e-6
        self._cv = threading.Condition(threading.Lock())
        self._fifo: collections.deque = collections.deque()
        self._inflight: collections.deque = collections.deque()  # kernel launches, oldest first
        self._worker: threading.Thread | None = None
        self._failed: _Launch | None = None  # first failed launch not yet reported
        self._skipped = 0  # launches skipped since that failure
        self._streams: list[HwStream] = []
        self.default_stream = self.new_stream()
        self.counters = Counters()
        self.allocated = 0  # bytes of live device buffers
        self.peak_allocated = 0

    # -- streams ----------------------------------------------------------------------

    def new_stream(self, priority: int = 0) -> HwStream:
        s = HwStream(self, len(self._streams), priority)
        self._streams.append(s)
        return s

    def stream_by_id(self, stream_id: int) -> HwStream:
        return self._streams[stream_id]

    # -- submission (host side) -----------------------------------------------------

    def launch(self, stream: HwStream, fn, name) -> None:
        """Queue one kernel launch; returns at once. ``name`` (an op, or a string) says what
        it runs; it is formatted only when the launch fails (``str(op)`` costs ~3 us)."""
        c = self.counters
        c.launches += 1
        c.launches_by_stream[stream.stream_id] = c.launches_by_stream.get(stream.stream_id, 0) + 1
        launch = _Launch(fn, stream, name, "kernel")
        self._inflight.append(launch)
        if len(self._inflight) > 4096:  # nobody asks for the depth: keep the record short
            self._inflight.popleft()
        self._put(launch)

    def record(self, stream: HwStream, event: HwEvent) -> None:
        launch = _Launch(None, stream, "record", "record", event)
        event.launch, event.time = launch, None
        self._put(launch)

    def wait_event(self, stream: HwStream, event: HwEvent) -> None:
        if event.launch is not None:
            self._put(_Launch(None, stream, "wait", "wait", event))

    def _put(self, launch: _Launch) -> None:
        launch.stream.last = launch
        with self._cv:
            self._fifo.append(launch)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name=f"neuron:{self.index} worker", daemon=True)
                self._worker.start()
            self._cv.notify()

    def wait_below(self, depth: int) -> bool:
        """Block while ``depth`` or more kernel launches are unfinished on the device clock
        (queued, running, or run but not yet at their modelled end); True if it waited."""
        inflight = self._inflight
        now = _clock()
        while inflight and inflight[0].done and inflight[0].end <= now:
            inflight.popleft()
        if len(inflight) < depth:
            return False
        while len(inflight) >= depth:
            self._wait_end(inflight[0])
            inflight.popleft()
        return True

    def _wait_end(self, launch: _Launch) -> None:
        """Block until ``launch`` has run and its modelled end has passed."""
        if not launch.done:
            with self._cv:
                while not launch.done:
                    self._cv.wait()
        _wait_until(launch.end)

    # -- the worker (device side) ---------------------------------------------------

    def _run(self) -> None:
        fifo, cv = self._fifo, self._cv
        while True:
            with cv:
                while not fifo:
                    cv.wait()
                launch = fifo[0]
            self._execute(launch)
            with cv:
                fifo.popleft()
                launch.done = True
                cv.notify_all()

    def _execute(self, launch: _Launch) -> None:
        stream = launch.stream
        if launch.kind == "record":
            launch.end = launch.event.time = max(stream.clock, launch.submitted)
            return
        if launch.kind == "wait":
            src = launch.event.launch
            stream.clock = max(stream.clock, src.end if src is not None else 0.0)
            launch.end = stream.clock
            return
        start = max(launch.submitted, stream.clock)
        kernel = 0.0
        if self._failed is not None:
            self._skipped += 1
            self.counters.skipped_after_error += 1
        else:
            t0 = _kernel_clock()
            try:
                launch.fn()
            except BaseException as e:  # kept for the next sync point
                launch.error = e
                self._failed, self._skipped = launch, 0
            kernel = _kernel_clock() - t0
        launch.fn = None  # drop the closure: its buffers may be freed now
        launch.end = stream.clock = start + self.launch_s + kernel
        self.counters.busy_s += self.launch_s + kernel
        self.counters.kernel_s += kernel

    # -- sync points (host side) ----------------------------------------------------

    def wait_for(self, launch: _Launch | None, reason: str) -> None:
        """Block until ``launch`` has run and its modelled end has passed; re-raise errors."""
        c = self.counters
        c.syncs += 1
        c.syncs_by_reason[reason] = c.syncs_by_reason.get(reason, 0) + 1
        if launch is not None:
            self._wait_end(launch)
        self.raise_pending()

    def synchronize(self, reason: str = "synchronize") -> None:
        """Wait for every stream of the device."""
        with self._cv:
            last = self._fifo[-1] if self._fifo else None
        self.wait_for(last, reason)
        # the FIFO runs in order, so every stream's last launch has run; wait for the latest end
        _wait_until(max((s.clock for s in self._streams), default=0.0))

    def query(self, launch: _Launch | None) -> bool:
        return launch is None or (launch.done and _clock() >= launch.end)

    def raise_pending(self) -> None:
        failed = self._failed
        if failed is None:
            return
        with self._cv:  # everything queued behind the failure is skipped: drain it first
            while self._fifo:
                self._cv.wait()
        self._failed = None
        error = failed.error
        skipped = self._skipped
        note = (f"adaptive_eager.neuron: raised by {failed.name} on "
                f"neuron:{self.index} stream {failed.stream.stream_id} "
                f"(reported at this sync point; {skipped} later launch(es) skipped)")
        if hasattr(error, "add_note"):
            error.add_note(note)
            raise error
        raise DeviceError(f"{note}: {error!r}") from error

    # -- memory -----------------------------------------------------------------------

    def on_alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated

    def on_free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def set_latency(self, launch_us: float) -> None:
        """Model ``launch_us`` per launch from the next launch on (waits for the queue)."""
        self.synchronize("latency change")
        self.launch_us, self.launch_s = launch_us, launch_us * 1e-6

    def reset_counters(self) -> None:
        self.synchronize("reset counters")
        self.counters = Counters()


def _wait_until(deadline: float) -> None:
    """Wait for the wall clock to pass ``deadline`` (sleep the bulk, spin the last 200 us)."""
    remaining = deadline - _clock()
    if remaining > 0.0005:
        time.sleep(remaining - 0.0002)
    while _clock() < deadline:
        pass


# -- work held back on the host -------------------------------------------------------

# Called before anything that orders or waits on the queues from the program's side
# (synchronize, events, stream changes): whoever holds ops back before launching them (the
# engine's deferred segment) launches them first, so they take their place in the queue.
_flush_hooks: list = []


def add_flush_hook(fn) -> None:
    if fn not in _flush_hooks:
        _flush_hooks.append(fn)


def flush(reason: str) -> None:
    for fn in _flush_hooks:
        fn(reason)


# -- the process's devices and each thread's current stream ----------------------------

_DEVICES: list[Device] = []
_tls = threading.local()


def create(count: int, launch_us: float) -> None:
    if not _DEVICES:
        _DEVICES.extend(Device(i, launch_us) for i in range(count))
        atexit.register(_drain)


def _drain() -> None:
    """At exit: let queued launches finish, and say so if one failed unreported."""
    for d in _DEVICES:
        try:
            d.synchronize("exit")
        except BaseException as e:
            sys.stderr.write(f"adaptive_eager.neuron: a launch on neuron:{d.index} failed and "
                             f"was never synchronized: {type(e).__name__}: {e}\n")


def get(index: int | None = 0) -> Device:
    return _DEVICES[index or 0]


def count() -> int:
    return len(_DEVICES)


def current_stream(index: int | None = 0) -> HwStream:
    """This thread's current stream on device ``index`` (its default stream unless set)."""
    streams = getattr(_tls, "streams", None)
    if streams is not None:
        s = streams.get(index or 0)
        if s is not None:
            return s
    return _DEVICES[index or 0].default_stream


def set_current_stream(stream: HwStream) -> None:
    streams = getattr(_tls, "streams", None)
    if streams is None:
        streams = _tls.streams = {}
    streams[stream.device.index] = stream
