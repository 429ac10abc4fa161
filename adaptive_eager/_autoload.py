"""``NEURON_ADAPTIVE_EAGER=1 python train.py``: the engine with no code change.

``pyproject.toml`` registers ``autoload`` as a ``torch.backends`` entry point, which
``import torch`` runs (``torch._import_device_backends``, the way out-of-tree devices such as
TorchNeuron load). An exception there would make ``import torch`` itself fail, so this
function never raises: any problem becomes one line on stderr and the program runs plain
eager. With the variable unset or 0 it returns after one environment lookup.
"""

from __future__ import annotations

import os
import sys


def autoload() -> None:
    raw = os.environ.get("NEURON_ADAPTIVE_EAGER")
    if raw is None or raw.strip().lower() in ("", "0", "false", "no", "off"):
        return
    try:
        from .config import from_env

        values, errors = from_env()
        if errors:
            sys.stderr.write(f"{errors[0]}; running plain eager\n")
            return
        if not values.get("autoload"):
            return
        from . import enable

        enable()
    except Exception as e:  # never break `import torch`
        sys.stderr.write(
            f"adaptive_eager: could not enable the engine ({type(e).__name__}: {e}); "
            "running plain eager\n"
        )
