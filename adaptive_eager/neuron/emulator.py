"""Registers the emulated ``neuron`` device with PyTorch (PrivateUse1, from Python).

What a C++ backend would register, done from Python (DESIGN §9): the PrivateUse1 key is
renamed ``neuron``; ``torch.neuron`` is registered as its device module; the ``.neuron()``
methods are generated; the hooks and device guard go into ``torch._C._acc`` (without the
guard ``.to("neuron")`` fails and ``backward()`` aborts the process); and the two factory
kernels every other factory reaches (``empty.memory_format``, ``empty_strided``) are
PrivateUse1 kernels returning ``NeuronTensor``. Every other op reaches the tensor's
``__torch_dispatch__``.
"""

from __future__ import annotations

import torch

from . import api, hardware

__all__ = ["register"]

_LIB = None


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    from .tensor import wrap

    _check_device(device)
    fmt = torch.contiguous_format if memory_format is None else memory_format
    return wrap(torch.empty(size, dtype=dtype, memory_format=fmt))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    from .tensor import empty_strided

    _check_device(device)
    return empty_strided(size, stride, dtype)


def _copy_from(src, dst, non_blocking=False):
    # PyTorch's generic ``copy_`` calls this for a device destination when the tensors'
    # Python key is excluded (``torch.tensor(..., device="neuron")`` does that).
    from .tensor import copy_into

    return copy_into(dst, src)


def _tag_storage(obj):
    return None  # device tensors are saved as CPU copies (NeuronTensor.__reduce_ex__)


def _restore_storage(obj, location):
    # ``torch.load(map_location="neuron")`` maps every storage of the file here, including the
    # CPU copy a device tensor is saved as; it stays on the host and the tensor is rebuilt on
    # the device from it (``_rebuild_device_tensor_from_cpu_tensor``).
    if location.startswith("neuron"):
        return obj
    return None


def _check_device(device) -> None:
    if device is not None and device.index not in (None, *range(hardware.count())):
        raise RuntimeError(f"neuron: device {device} does not exist; this process has "
                           f"{hardware.count()} neuron device(s)")


def register(launch_us: float) -> None:
    """Make ``neuron`` a PyTorch device backed by the emulator (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", "neuron"):
        raise RuntimeError(f"adaptive_eager.neuron: PrivateUse1 is already the {name!r} device; "
                           "the emulated neuron device cannot be registered in this process")
    hardware.create(1, launch_us)
    if name != "neuron":  # before anything names the device (``tensor`` does at import)
        torch.utils.rename_privateuse1_backend("neuron")
    torch.utils.generate_methods_for_privateuse1_backend()
    torch._register_device_module("neuron", api)
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    torch.serialization.register_package(5, _tag_storage, _restore_storage)
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", _empty, "PrivateUse1")
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    _LIB = lib
