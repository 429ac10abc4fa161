"""Thin adapter over the real TorchNeuron package (``torch_neuronx``), when it is installed.

Its device is used as it is: nothing is registered over it. Importing ``torch_neuronx``
registers the PrivateUse1 ``neuron`` device and ``torch.neuron``; this module only checks
that it did and reports what the engine needs from it.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

__all__ = ["available", "adopt"]

MODULE = "torch_neuronx"


def available() -> bool:
    return importlib.util.find_spec(MODULE) is not None


def adopt():
    """Import torch-neuronx and return its ``torch.neuron`` module."""
    module = importlib.import_module(MODULE)
    name = torch._C._get_privateuse1_backend_name()
    device_module = getattr(torch, "neuron", None)
    if name != "neuron" or device_module is None:
        raise RuntimeError(
            f"adaptive_eager.neuron: {MODULE} ({getattr(module, '__file__', '?')}) was imported "
            f"but did not register the neuron device (PrivateUse1 is {name!r})")
    return device_module
