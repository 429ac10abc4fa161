"""The Python neuron device (NEURON_EMULATOR_IMPL=python) still passes the device's model
tests. A process holds one PrivateUse1 backend and this session's is the default (the C++
device), so they run in a child pytest with the Python device selected."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from adaptive_eager.neuron import _torchneuronx

pytestmark = pytest.mark.skipif(_torchneuronx.available(), reason="torch-neuronx is installed")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_python_device_passes_the_device_model_tests():
    env = dict(os.environ, NEURON_EMULATOR_IMPL="python")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_neuron_hardware.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
