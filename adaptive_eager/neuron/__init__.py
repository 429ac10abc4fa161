"""The ``neuron`` device: TorchNeuron's when it is installed, else an emulated one.

``import adaptive_eager.neuron`` makes ``neuron`` a PyTorch device: ``.to("neuron")``,
``torch.neuron`` (the ``torch.cuda`` surface) and ``torch.accelerator`` work unchanged.
With ``torch_neuronx`` importable its device is used as it is; otherwise an emulated device
is registered: by default the C++ PrivateUse1 backend (``native``, built once with the
machine's compiler: plain tensors over the device's own memory, every op a launch on a queue
run by a C++ worker thread), or with ``NEURON_EMULATOR_IMPL=python`` the earlier Python
device (``emulator``). Either pays a modelled launch latency (``NEURON_EMULATOR_LAUNCH_US``)
on the device's clock.

Exact counters of the emulated device (launches per stream, bytes copied, modelled busy
time) are read with ``counters()``; ``set_launch_latency_us()`` changes the modelled latency.
"""

from __future__ import annotations

import sys

from .. import config
from ..cpp_build import BuildError
from . import _torchneuronx

__all__ = ["is_emulated", "is_native", "counters", "reset_counters", "set_launch_latency_us", "ensure"]

_EMULATED: bool | None = None
_NATIVE = False  # the emulated device is the C++ backend (NEURON_EMULATOR_IMPL=cpp)


def ensure(lenient: bool = False) -> bool:
    """Register the device if it is not yet; returns True when it is the emulated one.

    A bad ``NEURON_EMULATOR_*`` value raises ConfigError, and a C++ device that cannot be
    built raises BuildError; with ``lenient`` (as at import: a program run with no code change
    must not stop there) the setting takes its default and the Python device stands in, each
    said in one line."""
    global _EMULATED, _NATIVE
    if _EMULATED is None:
        impl = config.setting("emulator_impl", lenient=lenient)
        launch_us = config.setting("emulator_launch_us", lenient=lenient)
        if _torchneuronx.available():
            _torchneuronx.adopt()
            _EMULATED = False
        else:
            if impl == "cpp":
                from . import native

                try:
                    native.register(launch_us)
                    _EMULATED = _NATIVE = True
                except BuildError as e:  # no compiler, an unwritable or full disk, ...
                    if not lenient:
                        raise
                    sys.stderr.write(f"{e}; using the Python device\n")
            if not _NATIVE:
                from . import emulator

                emulator.register(launch_us)
                _EMULATED = True
        if _EMULATED:
            from . import collectives

            collectives.register()
    return _EMULATED


def is_emulated() -> bool:
    return ensure()


def is_native() -> bool:
    """Is the emulated device the C++ backend (plain tensors, a C++ queue and worker)?"""
    ensure()
    return _NATIVE


def _device(index: int = 0):
    if not ensure():
        raise RuntimeError("adaptive_eager.neuron: counters exist on the emulated device only "
                           "(torch-neuronx is installed)")
    from . import hardware

    return hardware.get(index)


def counters(index: int = 0):
    """A snapshot of the emulated device's exact counters (waits for its queue first)."""
    import copy

    if is_native():
        from . import native
        from .hardware import Counters

        ext = native.load()
        ext.wait("counters")
        c = ext.counters()
        return Counters(launches=int(c["launches"]),
                        launches_by_stream=ext.launches_by_stream(),
                        launches_by_name=ext.launches_by_name(),
                        bytes_to_device=int(c["bytes_to_device"]),
                        bytes_to_host=int(c["bytes_to_host"]), syncs=int(c["syncs"]),
                        syncs_by_reason=ext.syncs_by_reason(), busy_s=c["busy_s"],
                        kernel_s=c["kernel_s"],
                        skipped_after_error=int(c["skipped_after_error"]),
                        dropped_out_forms=ext.dropped_out_forms())
    d = _device(index)
    d.synchronize("counters")
    return copy.deepcopy(d.counters)


def reset_counters(index: int = 0) -> None:
    if is_native():
        from . import native

        return native.load().reset_counters()
    _device(index).reset_counters()


def set_launch_latency_us(us: float, index: int = 0) -> None:
    """Change the modelled launch latency (microseconds, >= 0) of later launches."""
    if isinstance(us, bool) or not isinstance(us, (int, float)) or us < 0:
        raise ValueError(f"adaptive_eager.neuron: launch latency {us!r} us is not valid; "
                         "accepted: a number >= 0")
    if is_native():
        from . import native

        return native.load().set_latency_us(float(us))
    _device(index).set_latency(float(us))


ensure(lenient=True)
