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

        # the engine's settings; the device names its own bad ones when it registers
        values, errors = from_env(engine_only=True)
        if errors:  # one line per bad variable; the program runs plain eager
            for line in errors:
                sys.stderr.write(f"{line}; running plain eager\n")
            _device_only(values)
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


def _device_only(values: dict) -> None:
    """The engine stays off, but a program written for the neuron device must still find it:
    the emulated device registers, as it would have with the engine on."""
    from .config import _BY_FIELD

    if "neuron" not in values.get("devices", _BY_FIELD["devices"].default):
        return
    try:
        from . import neuron

        neuron.ensure()
    except Exception as e:  # never break `import torch`
        sys.stderr.write(f"adaptive_eager: the emulated neuron device did not register "
                         f"({type(e).__name__}: {e})\n")
