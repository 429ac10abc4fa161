"""Collectives on the emulated ``neuron`` device: a ``torch.distributed`` backend named
``neuron``, gloo over the device's memory.

``init_process_group("neuron")`` (or ``init_process_group()``, whose default for the device
this is, or ``"cpu:gloo,neuron:neuron"``) gives a process group whose collectives take
neuron tensors, and cpu tensors as gloo does, so DDP, FSDP2 and DTensor run on the device
unchanged. TorchNeuron's own backend is used where torch-neuronx is installed.

Note [Collectives over device memory]: a collective is a sync point of the device, as a copy
to the host is. It waits for the device's queue (what the program queued before it has run),
then runs gloo's collective on host tensors over the same memory (the device's memory is host
memory: no copy either way), and returns once gloo is done, with a finished ``Work``
(``async_op=True`` too: ``wait()`` returns at once). What the program queues after it reads
what the collective wrote. The collectives reach this class from Python and from C++ (DDP's
reducer) without an aten op, so a dispatch mode does not see them: this engine's deferred
work is launched first (a boundary, counted as "collective"), and the engine is paused while
gloo runs.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

__all__ = ["register", "NeuronProcessGroup"]

NAME = "neuron"


def register() -> None:
    """Make ``neuron`` a ``torch.distributed`` backend for the emulated device (once)."""
    if not dist.is_available() or NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, devices=["neuron"])


def _create(store, rank: int, world_size: int, timeout: datetime.timedelta):
    if not dist.is_gloo_available():
        raise RuntimeError("the neuron collective backend runs over gloo, which this torch "
                           "build lacks")
    return NeuronProcessGroup(store, rank, world_size, timeout)


def _device_wait(reason: str):
    """Wait for the device's queue; returns the function that views a device tensor on the
    host (its memory, no copy)."""
    from . import is_native

    if is_native():
        from . import native

        ext = native.load()
        ext.wait(reason)
        return ext.host_alias
    from . import hardware

    hardware.get().synchronize(reason)
    return lambda t: t._b


@contextlib.contextmanager
def _outside_engine():
    """Launch this thread's deferred work first, and keep the engine out while gloo runs."""
    try:
        from adaptive_eager.engine import ENGINE
    except ImportError:  # the engine is not imported: nothing is deferred
        yield
        return
    m = ENGINE.mode_here()
    if m is None or m.paused:
        yield
        return
    m.boundary("collective")
    with m.pause():
        yield


class NeuronProcessGroup(dist.ProcessGroup):
    """gloo's collectives over neuron (and cpu) tensors: Note [Collectives over device
    memory]."""

    def __init__(self, store, rank: int, world_size: int, timeout: datetime.timedelta):
        super().__init__(rank, world_size)
        self._gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        # the group's name and description live on its backends
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               self._gloo)

    def getBackendName(self) -> str:
        return NAME

    def __repr__(self) -> str:
        return f"NeuronProcessGroup(rank={self.rank()}, size={self.size()})"

    def _run(self, name: str, result, *args):
        """gloo's ``name`` over host views of ``args`` (tensors, lists of them, options);
        a finished Work whose value is ``result``."""
        with _outside_engine():
            view = None

            def host(x):
                nonlocal view
                if isinstance(x, torch.Tensor):
                    if x.device.type != "neuron":
                        return x
                    if view is None:
                        view = _device_wait(f"collective: {name}")
                    return view(x)
                if isinstance(x, (list, tuple)):
                    return [host(y) for y in x]
                return x

            getattr(self._gloo, name)(*[host(a) for a in args]).wait()
        return self._done(result)

    @staticmethod
    def _done(result):
        fut = torch.futures.Future()
        fut.set_result(result)
        return _create_work_from_future(fut)

    # The names the process group is called by (torch.distributed's functions, and C++ callers
    # such as DDP's reducer), each mapped to gloo's.

    def allreduce(self, tensors, opts=None):
        return self._run("allreduce", tensors, tensors, opts or dist.AllreduceOptions())

    def allreduce_coalesced(self, tensors, opts=None):
        return self._run("allreduce_coalesced", tensors, tensors,
                         opts or dist.AllreduceCoalescedOptions())

    def broadcast(self, tensors, opts=None):
        return self._run("broadcast", tensors, tensors, opts or dist.BroadcastOptions())

    def reduce(self, tensors, opts=None):
        return self._run("reduce", tensors, tensors, opts or dist.ReduceOptions())

    def allgather(self, output_lists, inputs, opts=None):
        return self._run("allgather", output_lists, output_lists, inputs,
                         opts or dist.AllgatherOptions())

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self._run("allgather_coalesced", output_lists, output_lists, inputs,
                         opts or dist.AllgatherOptions())

    def all_gather_single(self, output, input, opts=None):
        return self._run("_allgather_base", [output], output, input,
                         opts or dist.AllgatherOptions())

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs, strict=True):
            self.all_gather_single(out, inp, opts)
        return self._done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._run("reduce_scatter", outputs, outputs, input_lists,
                         opts or dist.ReduceScatterOptions())

    def reduce_scatter_single(self, output, input, opts=None):
        return self._run("_reduce_scatter_base", [output], output, input,
                         opts or dist.ReduceScatterOptions())

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs, strict=True):
            self.reduce_scatter_single(out, inp, opts)
        return self._done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        return self._run("alltoall_base", [output], output, input, output_split_sizes,
                         input_split_sizes, opts or dist.AllToAllOptions())

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        return self._run("alltoall", outputs, outputs, inputs, opts or dist.AllToAllOptions())

    def gather(self, output_lists, inputs, opts=None):
        return self._run("gather", output_lists, output_lists, inputs,
                         opts or dist.GatherOptions())

    def scatter(self, outputs, input_lists, opts=None):
        return self._run("scatter", outputs, outputs, input_lists,
                         opts or dist.ScatterOptions())

    def barrier(self, opts=None):
        return self._run("barrier", [], opts or dist.BarrierOptions())
