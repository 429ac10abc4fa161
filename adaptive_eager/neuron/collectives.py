"""Collectives on the emulated ``neuron`` device: gloo over the device's memory.

With the emulated device registered, gloo takes neuron tensors and is the device's default
backend, as it is for ``mps``: ``init_process_group()``, ``init_process_group("gloo")`` or
``"cpu:gloo,neuron:gloo"`` give a group whose collectives take neuron tensors (and cpu ones),
so DDP, FSDP2 and DTensor run on the device unchanged. TorchNeuron's own backend is used
where torch-neuronx is installed.

Note [Collectives over device memory]: every collective reaches the dispatcher as a
``c10d::`` op (``dist.all_reduce``, DDP's reducer, FSDP2, DTensor's functional collectives
alike), whose kernel for the device's key asks the group for the device's backend. The
device's kernel here instead waits for the device's queue (what the program queued before it
has run: a collective is a sync point of the device, as a copy to the host is), runs the same
op on host tensors over the same memory (the device's memory is host memory: no copy either
way), which gloo serves as a cpu collective, and waits for gloo before it returns, so that
what the program queues next reads what the collective wrote (``async_op=True`` too: the
returned ``Work`` is done). A dispatch mode sees the ``c10d::`` op before this kernel runs:
the engine's mode makes it a boundary (``tracer.optable``), launching what it deferred first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["register"]

# the c10d ops that move tensors (c10d's own names)
OPS = ("allreduce_", "allreduce_coalesced_", "_allgather_base_", "allgather_",
       "allgather_coalesced_", "allgather_into_tensor_coalesced_", "reduce_scatter_",
       "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "broadcast_", "barrier",
       "alltoall_base_", "alltoall_", "reduce_", "gather_", "scatter_", "send", "recv_",
       "recv_any_source_", "monitored_barrier_")

_LIB: list = []  # the library holding the kernels, alive for the process


def register() -> None:
    """gloo for the emulated device: its capability, its default backend, and the device's
    kernels of the ``c10d::`` ops (once)."""
    if _LIB or not dist.is_available() or not dist.is_gloo_available():
        return
    if "neuron" not in dist.Backend.backend_capability["gloo"]:
        dist.Backend.backend_capability["gloo"].append("neuron")
    dist.Backend.default_device_backend_map.setdefault("neuron", "gloo")
    import warnings

    lib = torch.library.Library("c10d", "IMPL")
    with warnings.catch_warnings():  # c10d's own kernel for the key is replaced on purpose
        warnings.simplefilter("ignore")
        for name in OPS:
            op = getattr(torch.ops.c10d, name).default
            lib.impl(name, _over_host(op), "PrivateUse1")
    _LIB.append(lib)


def _host_view(reason: str):
    """Wait for the device's queue; the function that views a device tensor on the host
    (its memory, no copy)."""
    from . import is_native

    if is_native():
        from . import native

        ext = native.load()
        ext.wait(reason)
        return ext.host_alias
    from . import hardware

    hardware.get().synchronize(reason)
    return lambda t: t._b


def _serve_cpu(group) -> None:
    """A group made for the device alone (``init_process_group()`` on a machine whose
    accelerator is the device) has no cpu backend: its gloo serves the host tensors too."""
    try:
        group._get_backend(torch.device("cpu"))
    except RuntimeError:
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                                group._get_backend(torch.device("neuron")))


def _over_host(op):
    reason = f"collective: {op._schema.name}"
    work_type = torch._C._distributed_c10d.Work

    def kernel(*args, **kwargs):
        view, device_of = None, {}

        def host(x):
            nonlocal view
            if isinstance(x, torch.Tensor) and x.device.type == "neuron":
                if view is None:
                    view = _host_view(reason)
                h = view(x)
                device_of[id(h)] = x
                return h
            if isinstance(x, (list, tuple)):
                return [host(y) for y in x]
            return x

        for a in args:
            if isinstance(a, torch.ScriptObject) and a._type().name() == "ProcessGroup":
                _serve_cpu(dist.ProcessGroup.unbox(a))
        out = op(*[host(a) for a in args], **{k: host(v) for k, v in kwargs.items()})

        def back(x):
            if isinstance(x, work_type):
                x.wait()  # done before the device's next launch reads what it wrote
                return x
            if isinstance(x, torch.Tensor):
                return device_of.get(id(x), x)
            if isinstance(x, (list, tuple)):
                return type(x)(back(y) for y in x)
            return x

        return back(out)

    return kernel
