"""Shared fixtures: one Inductor cache for the session, a clean engine per test, count helpers."""

from __future__ import annotations

import os
import tempfile

# Before torch._inductor is imported anywhere: compiled kernels are shared by every test.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "adaptive_eager_test_inductor")
)
for _name in [n for n in os.environ if n.startswith("NEURON_ADAPTIVE_EAGER")]:
    del os.environ[_name]  # tests configure the engine explicitly
# ... except the hot path's form, which the whole suite can be run under:
# ADAPTIVE_EAGER_TEST_HOT_PATH=cpp python -m pytest tests (stage 1; Note [Below the floor])
if os.environ.get("ADAPTIVE_EAGER_TEST_HOT_PATH"):
    os.environ["NEURON_ADAPTIVE_EAGER_HOT_PATH"] = os.environ["ADAPTIVE_EAGER_TEST_HOT_PATH"]
# Two decisions are taken from wall-clock timings: the step governor (Note [Stepping aside])
# and the retirement of fused graphs measured slower than eager. Both are off in tests that
# count launches and cache hits (a loaded CI machine made a fused graph look slow); the tests
# of those decisions turn them on with ratios that fix the outcome.
# Inductor's Python wrapper: the C++ one costs a libtorch compile per graph, too slow for the
# suite's hundreds of cold graphs (Note [C++ wrappers]); its tests turn it on themselves
os.environ["NEURON_ADAPTIVE_EAGER_CPP_WRAPPER"] = "0"
os.environ["NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO"] = "0"
os.environ["NEURON_ADAPTIVE_EAGER_RETIRE_RATIO"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402

import adaptive_eager as ae  # noqa: E402


@pytest.fixture(autouse=True)
def clean_engine():
    """Every test starts and ends with the engine off and its state cleared."""
    torch.manual_seed(0)
    ae.reset()
    yield
    while ae.is_enabled():
        ae.disable()
    torch.use_deterministic_algorithms(False)
    ae.reset()


class Delta:
    """Counters accumulated since construction: ``d = Delta(); ...; d.launches``."""

    def __init__(self):
        self.start = ae.stats()

    def __getattr__(self, name):
        now = getattr(ae.stats(), name)
        before = getattr(self.start, name)
        if isinstance(now, dict):
            return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}
        return now - before


def wait_compiles():
    from adaptive_eager.engine import ENGINE

    assert ENGINE.wait_compiles(timeout=300), "background compiles did not finish"


def warm(fn, n=3, backend="exact"):
    """Run ``fn`` under the engine until its path is hot; returns the results of each run."""
    out = []
    for _ in range(n):
        out.append(fn())
    if backend != "exact":
        wait_compiles()
    return out


@pytest.fixture
def delta():
    return Delta
