"""Hardware queues: where a launch runs.

One call is the whole seam between the engine and a device: ``queue_for(device).submit(fn)``
runs a segment's launch on that device's queue, ``synchronize()`` waits for everything
submitted. On the CPU a launch runs at once on the calling thread (``ImmediateQueue``): the
kernels are the host's own, and Inductor's CPU kernels hold the GIL (DESIGN §11), so a worker
thread would not overlap with tracing. Asynchronous queues (CUDA streams, the neuron
device's queues) implement the same interface.
"""

from __future__ import annotations

__all__ = ["Queue", "ImmediateQueue", "queue_for", "synchronize_all"]


class Queue:
    # Launch a hot path as soon as its last op is deferred, rather than at the boundary that
    # follows. Only worth it when the launch runs asynchronously: it also observes liveness
    # earlier, while the caller's temporaries are still alive, so more outputs materialize.
    launch_early = False

    def submit(self, fn, *args) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError


class ImmediateQueue(Queue):
    """Runs each launch as it is submitted; errors surface from ``submit``."""

    def submit(self, fn, *args) -> None:
        fn(*args)

    def synchronize(self) -> None:
        pass


_QUEUES: dict = {}
_IMMEDIATE = ImmediateQueue()


def queue_for(device_type: str) -> Queue:
    return _QUEUES.get(device_type, _IMMEDIATE)


def register_queue(device_type: str, queue: Queue) -> None:
    _QUEUES[device_type] = queue


def synchronize_all() -> None:
    for q in list(_QUEUES.values()):
        q.synchronize()
