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

import math

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


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
          enable_gqa=False):
    # Note [Attention kernel choice]: ``scaled_dot_product_attention`` asks a per-device
    # C++ stub which kernel to use; a Python device has no entry there and gets the unfused
    # math decomposition, whose rounding differs from the CPU's fused kernel. So the device
    # makes the CPU's choice itself (from shapes and flags: no data is read) and, where the
    # CPU fuses, issues the CPU's fused op with the mask prepared as the CPU prepares it.
    aten = torch.ops.aten

    def host_like(t):
        return None if t is None else t._b.detach().requires_grad_(t.requires_grad)

    choice = aten._fused_sdp_choice.default(
        host_like(query), host_like(key), host_like(value), host_like(attn_mask), dropout_p,
        is_causal, scale=scale, enable_gqa=enable_gqa)
    if choice != _FLASH:
        return aten.scaled_dot_product_attention.default.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
            enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, torch.scalar_tensor(0.0, dtype=query.dtype),
                                torch.scalar_tensor(-math.inf, dtype=query.dtype))
    return aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


_FLASH = int(torch._C._SDPBackend.FLASH_ATTENTION)


def _dropout(input, p, train, *, inplace=False):
    # The composite ``dropout`` takes the fused ``native_dropout`` kernel on any accelerator
    # and the unfused form on the CPU: the same mask, a different rounding. The device
    # computes what the CPU computes (the ops of ATen's CPU path, through autograd as there).
    if p == 0 or not train or input.numel() == 0:
        return input
    if p == 1:
        zero = torch.zeros((), dtype=input.dtype, device=input.device)
        return input.mul_(zero) if inplace else input.mul(zero)
    noise = torch.empty_like(input).bernoulli_(1 - p)
    torch.ops.aten.div_.Scalar(noise, 1 - p)
    return input.mul_(noise) if inplace else input.mul(noise)


def _dropout_(input, p, train):
    return _dropout(input, p, train, inplace=True)


def _cpu_overrides():
    """aten ops with a CPU kernel *and* a decomposition that other devices get instead.

    The device must run what the CPU runs (same rounding), so each gets a PrivateUse1
    kernel: its presence stops the decomposition, and the tensor's ``__torch_dispatch__``
    (the Python key, ahead of PrivateUse1) then receives the op whole.
    """
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return [n for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and has(n, "CompositeImplicitAutograd") and has(n, "CPU")]


def _unreachable(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"adaptive_eager.neuron: {name} reached the PrivateUse1 kernel "
                                  "without a device tensor")

    return kernel


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
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    lib.impl("dropout", _dropout, "AutogradPrivateUse1")
    lib.impl("dropout_", _dropout_, "AutogradPrivateUse1")
    for name in _cpu_overrides():
        lib.impl(name[len("aten::"):], _unreachable(name), "PrivateUse1")
    _LIB = lib
