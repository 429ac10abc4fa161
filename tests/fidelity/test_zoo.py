"""The nn zoo (tests/fidelity/zoo.py, Note [The zoo]) in the suite: every entry on cpu and
neuron under ``exact`` (bitwise), two under ``inductor`` (their fused graphs compile)."""

from __future__ import annotations

import pytest

import adaptive_eager.neuron  # noqa: F401 -- before any backward(): autograd sizes its
# device threads at the first one, and a device registered later has none

from .zoo import ENTRIES, Unsupported, check

def _check(name, device, backend):
    try:
        return check(name, device, backend)
    except Unsupported as e:
        pytest.skip(f"plain eager cannot run it on {device}: {e}")


@pytest.mark.parametrize("device", ["cpu", "neuron"])
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_trains_as_eager(name, device):
    s = _check(name, device, "exact")
    assert s.replays > 0, s  # it went hot: the comparison judged replays


@pytest.mark.parametrize("name", ["convbn", "clip", "flex_attention"])
def test_trains_as_eager_fused(name):
    s = _check(name, "cpu", "inductor")
    assert s.graphs_compiled > 0 and s.cache_hits > 0, s
