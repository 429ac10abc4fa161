"""Hardware queues: where a launch runs.

One call is the whole seam between the engine and a device: ``queue_for(device).submit(fn,
*args)`` runs one launch (a micro-graph replay) on that device's current queue and returns;
``synchronize()`` waits for everything submitted. Before submitting, the engine passes the
launch's tensors through ``prepare``: what a kernel on that device reads (the backing
storage of an emulated device tensor; a snapshot of a host tensor, which the program may
change as soon as the launch is issued).

* cpu: ``ImmediateQueue`` runs the launch at once on the calling thread. The kernels are the
  host's own: a worker thread would only add a hand-off, and Inductor's CPU kernels hold the
  interpreter lock (DESIGN §11), so it would not overlap with tracing either.
* neuron (emulated): ``NeuronQueue`` puts the launch on the device's current stream as one
  launch (adaptive_eager.neuron.hardware); the host returns at once.
* neuron (torch-neuronx): ``TorchNeuronxQueue``, as cuda, with graphs compiled by its
  ``torch.compile`` backend.
* cuda: ``CudaQueue`` runs the launch on the host at once; its kernels are queued on the
  current CUDA stream by the ops themselves, so the device already runs behind the host.

An asynchronous queue sets ``asynchronous``; the engine then never lets a launch read state
the host may change before it runs (segment bookkeeping is copied, host tensors are
snapshotted) and waits for the launch where the host must observe its effect in order
(random ops drawing from the shared CPU generator, crosscheck).
"""

from __future__ import annotations

import time

import torch

__all__ = ["Queue", "ImmediateQueue", "NeuronQueue", "NativeNeuronQueue", "CudaQueue",
           "TorchNeuronxQueue", "queue_for", "register_queue", "set_depth", "synchronize_all"]


class Queue:
    depth = 8
    # Launch a hot path as soon as its last op is deferred, rather than at the boundary that
    # follows. Only worth it when the launch runs asynchronously: it also observes liveness
    # earlier, while the caller's temporaries are still alive, so more outputs materialize.
    launch_early = False
    asynchronous = False
    # The launch reads and writes the device's tensors through ``prepare`` (host views of
    # device memory) even though it runs at once (the C++ emulated device).
    host_views = False
    # The device the launch's kernels run on, for compiling its micro-graphs (None: the
    # device itself).
    compute_device: torch.device | None = None
    # The compiler that fuses micro-graphs for this device when the engine's backend asks
    # for fusion (None: the requested backend, Inductor).
    compile_backend: str | None = None
    # op -> the device's kernel, where the compute device's own kernel means something else
    # (an emulated device running on CPU kernels); replays and compiled graphs use it.
    kernels: dict = {}

    def prepare(self, x):
        return x

    def submit(self, fn, *args) -> bool | None:
        """Run or queue one launch; True when it first had to wait for a full queue."""
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError


class ImmediateQueue(Queue):
    """Runs each launch as it is submitted; errors surface from ``submit``."""

    def submit(self, fn, *args) -> None:
        fn(*args)

    def synchronize(self) -> None:
        pass


class NeuronQueue(Queue):
    """The emulated neuron device: one launch on the current stream per submission.

    The launch runs on the device's worker over the backing CPU tensors; an error it raises
    is kept by the device and re-raised at the next sync point (Note [Device clock]).
    """

    launch_early = True
    asynchronous = True
    compute_device = torch.device("cpu")

    def __init__(self):
        from adaptive_eager.neuron import hardware
        from adaptive_eager.neuron.tensor import DEVICE_KERNELS, NeuronTensor

        self.kernels = DEVICE_KERNELS
        self._hw = hardware
        self._tensor_type = NeuronTensor

    def prepare(self, x):
        if isinstance(x, self._tensor_type):
            return x._b
        if isinstance(x, torch.Tensor):
            return x.detach().clone()  # a host tensor: read now, as eager would have
        return x

    def submit(self, fn, *args) -> bool:
        hw = self._hw
        device = hw.get()
        waited = device.wait_below(self.depth)
        device.launch(hw.current_stream(), lambda: fn(*args), "adaptive_eager graph")
        return waited

    def synchronize(self) -> None:
        self._hw.get().synchronize("adaptive_eager.synchronize")


class NativeNeuronQueue(Queue):
    """The emulated neuron device as a C++ backend (NEURON_EMULATOR_IMPL=cpp): one launch on
    the device's queue per submission, run by its worker over host aliases of the device's
    memory (no copy), as the device's own ops are; an error it raises is re-raised at the next
    sync point."""

    launch_early = True
    asynchronous = True
    host_views = True
    compute_device = torch.device("cpu")

    def __init__(self):
        from adaptive_eager.neuron import device_kernels, native

        self.kernels = device_kernels.KERNELS
        self._ext = native.load()
        self._alias = self._ext.host_alias

    def prepare(self, x):
        if isinstance(x, torch.Tensor):
            if x.device.type == "neuron":
                return self._alias(x)
            return x.detach().clone()  # a host tensor: read now, as eager would have
        return x

    def submit(self, fn, *args) -> bool:
        ext = self._ext
        waited = ext.wait_below(self.depth)
        ext.launch(lambda: fn(*args), "adaptive_eager graph")
        return waited

    def synchronize(self) -> None:
        self._ext.wait("adaptive_eager.synchronize")


class CudaQueue(Queue):
    """CUDA: the launch's kernels go on the current stream; the host does not wait.

    Submission runs on the host at once (the kernels read their arguments when they are
    enqueued, and CUDA's generator advances at enqueue time), so the engine needs none of
    the precautions of ``asynchronous`` queues.
    """

    def submit(self, fn, *args) -> None:
        fn(*args)  # kernels are queued on torch.cuda.current_stream() by the ops themselves

    def synchronize(self) -> None:
        # Nothing can be queued where CUDA never started (a build or machine without it).
        # The unguarded call: the engine waits here after launching (adaptive_eager.cudaguard).
        if torch.cuda.is_initialized():
            torch._C._cuda_synchronize()


class TorchNeuronxQueue(Queue):
    """TorchNeuron's device (torch-neuronx installed): like CUDA, the launch runs on the host
    and its kernels queue on ``torch.neuron.current_stream()``; graphs compile through
    ``torch.compile(backend="neuron")``."""

    compile_backend = "neuron"

    def submit(self, fn, *args) -> None:
        fn(*args)

    def synchronize(self) -> None:
        torch.neuron.synchronize()


_QUEUES: dict = {}
_IMMEDIATE = ImmediateQueue()


def queue_for(device_type: str) -> Queue:
    q = _QUEUES.get(device_type)
    if q is None:
        q = _QUEUES[device_type] = _make(device_type)
    return q


def _make(device_type: str) -> Queue:
    if device_type == "neuron":
        from adaptive_eager import neuron

        if not neuron.is_emulated():
            return TorchNeuronxQueue()
        return NativeNeuronQueue() if neuron.is_native() else NeuronQueue()
    if device_type == "cuda":
        return CudaQueue()
    return _IMMEDIATE


def set_depth(depth: int) -> None:
    """The most launches the engine lets wait on an asynchronous queue (Note [Queue depth])."""
    Queue.depth = depth


# Note [Queue depth]: the engine captures a recurring step whole and launches it the moment
# its last op is deferred, so it never holds work back while the device idles; what the
# depth of the queue decides is how far the host may run ahead. Past ``depth`` queued
# launches a new replay waits for the device: the buffers the queued launches keep alive are
# bounded, and a host far ahead gains nothing (the device is the bottleneck then).


def register_queue(device_type: str, queue: Queue) -> None:
    _QUEUES[device_type] = queue


def synchronize_all() -> None:
    for q in list(_QUEUES.values()):
        q.synchronize()
