"""The device's ops where they mean otherwise than cpu's kernel, run on host tensors.

Both emulated devices run them (the Python one on its backing tensors, the C++ one through
``csrc/choices.cpp``), and so do the engine's replays on either (``Queue.kernels``).
"""

from __future__ import annotations

import torch

__all__ = ["KERNELS"]

aten = torch.ops.aten


def histc(self, bins=100, min=0, max=0):
    # Accelerators count integer inputs too (Hugging Face MoE layers rely on it off the CPU);
    # the CPU kernel has floating types only. Counting in float64 is exact for them.
    if self.is_floating_point():
        return aten.histc.default(self, bins, min, max)
    return aten.histc.default(self.double(), bins, min, max).to(self.dtype)


# op -> the device's kernel on host tensors
KERNELS = {aten.histc.default: histc}
