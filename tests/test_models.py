"""The model zoo: real Hugging Face models (tiny configs, no downloads) go hot and stay hot.

Each model trains under the engine on cpu with both backends: hot within 10 steps, a bounded
number of launches per step, no divergence in steady state, losses bitwise equal to eager
under ``exact`` and within 1e-3 under ``inductor``.
"""

import pathlib
import sys

import pytest
import torch

import adaptive_eager as ae
from conftest import Delta, wait_compiles

pytest.importorskip("transformers")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks.zoo import DECODERS, MODELS, build, train_step  # noqa: E402

WARM_STEPS, STEADY_STEPS = 10, 4
DIVERGED = "diverged from the hot path"
DATA_DEPENDENT = "data-dependent output shape"


def eager_losses(name, n):
    step = train_step(*build(name))
    return [step() for _ in range(n)]


@pytest.mark.parametrize("backend", ["exact", "inductor"])
@pytest.mark.parametrize("name", MODELS)
def test_model_goes_hot_and_stays_hot(name, backend):
    ref = eager_losses(name, WARM_STEPS + STEADY_STEPS)
    step = train_step(*build(name))
    with ae.enabled(devices=("cpu",), backend=backend):
        got = [step() for _ in range(WARM_STEPS)]
        if backend == "inductor":
            wait_compiles()
            got.append(step())  # installs the fused graph at its first boundary
        d = Delta()
        while len(got) < len(ref):
            got.append(step())
        steps = len(ref) - (WARM_STEPS + (backend == "inductor"))
    if backend == "exact":
        assert got == ref
    else:
        assert got == pytest.approx(ref, rel=1e-3)
    assert d.fallbacks.get(DIVERGED, 0) == 0
    assert d.replays + d.ops_eager == d.launches
    boundaries = sum(n for r, n in d.fallbacks.items() if r.startswith(DATA_DEPENDENT))
    assert boundaries % steps == 0
    per_step = boundaries // steps
    if name in DECODERS:
        assert per_step == 0 and d.launches <= 3 * steps
    elif name == "qwen2moe":  # routing: each data-dependent op cuts a segment and runs eagerly
        assert per_step > 0
        assert d.replays <= (per_step + 1) * steps
        assert d.ops_eager <= (per_step + 1) * steps  # those ops, plus the loss read
    else:
        assert per_step == 0 and d.launches <= 5 * steps
    if backend == "inductor" and name != "qwen2moe":
        assert d.cache_hits >= steps and not [r for r in d.fallbacks if "compile" in r]


def test_a_fresh_model_of_the_same_shapes_reuses_what_was_learned():
    with ae.enabled(devices=("cpu",), backend="exact"):
        first = train_step(*build("llama", seed=0))
        for _ in range(5):
            first()
        second = train_step(*build("llama", seed=1))  # new parameters, data and optimizer
        second()  # its first step differs (optimizer state is created): runs cold
        d = Delta()
        got = [second() for _ in range(3)]
        assert d.launches == 3 and d.replays == 3  # hot at once: nothing learned again
        assert d.graphs_compiled == 0
    ref = train_step(*build("llama", seed=1))
    assert got == [ref() for _ in range(4)][1:]
