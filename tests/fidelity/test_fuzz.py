"""The fuzzer of random op programs (tests/fidelity/fuzz.py, Note [The fuzzer]) in the suite.

A bounded number of programs per device (derandomized: CI draws the same programs every
run), and every program a fuzzing run found failing, in its shrunk form, as a regression.
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="the fuzzer needs hypothesis (the test extra)")

import adaptive_eager.neuron  # noqa: E402,F401 -- before any backward(): autograd sizes its
# device threads at the first one, and a device registered later has none
from hypothesis import HealthCheck, given, settings  # noqa: E402

from .fuzz import Op, Program, check, programs  # noqa: E402

DEVICES = ("cpu", "neuron")
PROGRAMS = 150  # per device; the long run is `python -m tests.fidelity.fuzz`

# Found by fuzzing runs, shrunk by hypothesis; each failed before its fix.
REGRESSIONS = {
    # A random op on a 0-dim CPU tensor ran at once as a host scalar and drew from the
    # generator ahead of a deferred bernoulli (Note [Host scalars] in tracer.mode).
    "host scalar drew ahead": Program(
        inputs=(((4, 6), "float32", False), ((), "int32", False)),
        ops=(Op("bernoulli", (0,)), Op("rand_like", (1,)))),
    # Backward of a copy into a view of a 0-dim value: a deferred copy_ wrote a fresh
    # external, a deferred as_strided viewed it (an external of its own), and clone of that
    # view ran at once as a host scalar, reading the memory before the copy (Segment.involves
    # in tracer/segment.py).
    "host scalar read a view of a written external": Program(
        inputs=(((), "float32", True),),
        ops=(Op("abs", (0,)), Op("reshape", (1,)), Op("setitem", (2, 0)))),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regression(name, device):
    assert check(REGRESSIONS[name], device).replays > 0  # the engine replayed it


# Found by fuzzing runs under inductor, shrunk by hypothesis; each failed before its fix.
FUSED_REGRESSIONS = {
    # bernoulli of float64 probabilities: the fused graph's trace decomposed it into
    # rand(float32) < p, other numbers than eager's kernel draws (Note [Random ops stay
    # eager's], scheduler/backends.py; found on neuron): such a graph is not fused, counted
    "a float64 bernoulli drew other numbers": Program(
        inputs=(((4, 6), "float64", False), ("alias", 0, "row")),
        ops=(Op("bernoulli", (0,)),)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(FUSED_REGRESSIONS))
def test_fused_regression(name, device):
    s = check(FUSED_REGRESSIONS[name], device, "inductor")
    assert s.replays > 0 and any("bernoulli of non-float32" in r for r in s.fallbacks), s


@pytest.mark.parametrize("device", DEVICES)
def test_random_programs_run_as_in_eager(device):
    replayed = []

    @settings(max_examples=PROGRAMS, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(programs())
    def fuzz(program):
        replayed.append(check(program, device).replays > 0)

    fuzz()
    assert len(replayed) >= PROGRAMS
    # the engine must have replayed most of them, or they tested nothing of it
    assert sum(replayed) >= 0.7 * len(replayed), (sum(replayed), len(replayed))


def test_random_programs_under_inductor():
    """A few programs with fused graphs (each compiles: seconds)."""
    fused = []

    @settings(max_examples=4, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(programs(max_ops=6))
    def fuzz(program):
        fused.append(check(program, "cpu", "inductor").graphs_compiled > 0)

    fuzz()
    assert sum(fused) >= 2, fused
