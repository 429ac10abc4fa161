"""Builds and loads the C++ neuron device (``csrc/``) with the machine's compiler.

The extension is compiled once per torch version and source revision (adaptive_eager.cpp_build:
``~/.cache/adaptive_eager/neuron-<torch version>-<source hash>``); a later process loads the
built library in well under a second. The first build takes a minute or two and says so in one
line on stderr. Without a C++ compiler or ninja the error is one line naming what to install.

Loading registers the device with PyTorch: PrivateUse1 kernels, its allocator, guard and
hooks. A process can hold one PrivateUse1 backend, so this cannot be loaded beside the Python
emulator (``emulator.py``); ``register`` chooses.
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path

import torch

from adaptive_eager import cpp_build

__all__ = ["load", "register", "build_dir", "SOURCES"]

_CSRC = Path(__file__).with_name("csrc")
SOURCES = ("allocator.cpp", "device.cpp", "kernels.cpp", "fallback.cpp", "overrideable.cpp",
           "generator.cpp", "choices.cpp", "plan.cpp", "timeline.cpp", "queue.cpp", "module.cpp",
           "autocast.cpp", "out_form.cpp", "random.cpp")
_module = None
_LIB = None  # the Python kernels' registrations (kept alive)


def build_dir() -> Path:
    """Where the extension is built: keyed by torch's version and the sources' contents."""
    return cpp_build.build_dir("neuron", _files())


def _files() -> list:
    return [_CSRC / name for name in (*SOURCES, "neuron.h")]


def load():
    """The loaded extension (built first if needed); the device is registered from then on."""
    global _module
    if _module is not None:
        return _module
    _module = cpp_build.build("neuron", [_CSRC / s for s in SOURCES], [_CSRC / "neuron.h"],
                              who="adaptive_eager.neuron", what="the C++ device",
                              instead="set NEURON_EMULATOR_IMPL=python for the Python device")
    atexit.register(_drain_at_exit)
    return _module


def _drain_at_exit() -> None:
    # queued launches of Python code need the interpreter: they run before it goes
    try:
        _module.wait("exit")
    except Exception as e:  # an error nobody synchronized for: said, not raised at exit
        print(f"adaptive_eager.neuron: a launch failed and was never synchronized: "
              f"{type(e).__name__}: {e}", file=sys.stderr)


def register(launch_us: float) -> None:
    """Load the extension and make it the ``neuron`` device, with ``launch_us`` of modelled
    latency per launch: PrivateUse1 renamed, the ``.neuron()`` methods generated,
    ``torch.neuron`` registered."""
    ext = load()
    ext.register_cpu_kernels()
    ext.set_latency_us(launch_us)
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", "neuron"):
        raise RuntimeError(f"adaptive_eager.neuron: PrivateUse1 is already the {name!r} device; "
                           "the emulated neuron device cannot be registered")
    if name != "neuron":
        torch.utils.rename_privateuse1_backend("neuron")
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_storage=True)
    from . import native_api as api
    from .hardware import flush

    torch._register_device_module("neuron", api)
    ext.set_flush_hook(flush)  # events and streams order the queue: the engine launches first
    from . import rnn

    global _LIB
    _LIB = torch.library.Library("aten", "IMPL")
    rnn.register(ext, _LIB)

