"""The engine beside torch.compile (Note [Beside torch.compile], adaptive_eager/
compiled_regions.py)."""

import subprocess
import sys

import pytest
import torch

import adaptive_eager as ae
from conftest import Delta


def test_a_compiled_function_inside_a_loop_runs_and_the_eager_code_goes_hot():
    # fullgraph=True: before, Dynamo skipped every frame under the engine's mode ("found no
    # compiled frames"), and compiling under the engine's dispatch key failed outright
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(x):
        return x.sin() * 2 + x.cos()

    w = torch.randn(16)

    def step(x):
        return (f(x * w) + 1.0).tanh().sum().item()

    xs = [torch.randn(16) for _ in range(6)]
    torch._dynamo.utils.counters.clear()
    want = [step(x) for x in xs]
    with ae.enabled(devices=("cpu",), backend="exact"):
        d = Delta()
        got = [step(x) for x in xs]
        # each call a boundary, the engine aside; what Dynamo compiled in eager serves the
        # calls under the engine (its guards hold: the engine is not there)
        assert d.boundaries["compiled function"] == len(xs)
        assert d.replays > 0  # the code around the compiled function went hot
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert got == want


def test_flex_attention_runs_under_the_engine():
    # its eager path compiles a wrapper with fullgraph=True on every call
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))

    def causal(score, b, h, qi, ki):
        return torch.where(qi >= ki, score, -float("inf"))

    want = flex_attention(q, k, v, score_mod=causal)
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = [flex_attention(q * 1.0, k, v, score_mod=causal) for _ in range(4)]
    assert all(torch.equal(g, want) for g in got)


def test_the_engine_does_not_import_dynamo_and_torch_compile_returns_what_it_did():
    code = (
        "import sys, torch, adaptive_eager as ae\n"
        "with ae.enabled(devices=('cpu',)):\n"
        "    (torch.ones(3) * 2).sum().item()\n"
        "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n"
        "m = torch.nn.Linear(2, 2)\n"
        "with ae.enabled(devices=('cpu',)):\n"
        "    c = torch.compile(m)\n"
        "assert type(c).__name__ == 'OptimizedModule', type(c)\n"
        "from adaptive_eager import compiled_regions\n"
        "assert compiled_regions._hooked\n"
        "with ae.enabled(devices=('cpu',)):\n"
        "    y = c(torch.ones(2, 2))\n"
        "assert torch.equal(y, m(torch.ones(2, 2)))\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
