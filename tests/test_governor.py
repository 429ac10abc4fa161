"""adaptive_eager.governor: the engine steps aside on loops it makes slower (Note [Stepping aside])."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_eager as ae
from adaptive_eager.governor import FIRST_BACKOFF, WINDOW
from adaptive_eager.tracer import hot_key
from conftest import Delta

CPU = dict(devices=("cpu",), backend="exact")


def loop(steps, engine=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    losses = []

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())

    if engine is None:
        for _ in range(steps):
            step()
    else:
        with ae.enabled(**engine):
            for _ in range(steps):
                step()
    return losses


def test_steps_aside_when_slower_and_comes_back(monkeypatch):
    # A ratio no engine can meet: the governor measures, probes eager, and steps aside.
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "1e-9")
    n = 4 + 2 * WINDOW + FIRST_BACKOFF + 6
    ref = loop(n)
    got = loop(n, CPU)
    assert got == ref  # the user cannot tell, but for speed
    s = ae.stats()
    aside = [r for r in s.fallbacks if r.startswith("engine slower than eager on this loop")]
    assert len(aside) == 1 and f"stepped aside for {FIRST_BACKOFF} steps" in aside[0]
    assert s.steps_suspended == FIRST_BACKOFF
    # back after the back-off: measured again (5 settled steps), then aside for a new probe
    assert s.boundaries.get("engine steps aside") == 2
    assert not ae.is_enabled()


def test_ops_are_not_intercepted_while_aside(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "1e-9")
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 8)
    with ae.enabled(**CPU):
        for _ in range(4 + 2 * WINDOW + 1):
            model(x).sum().backward()
            opt.step()
        d = Delta()
        model(x).sum().backward()
        opt.step()
        assert d.ops_intercepted == 0 and d.steps_suspended == 1
        assert not hot_key.load().is_on()  # the hot path's dispatch key is off too
        assert ae.is_enabled()
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()


def test_kept_when_not_slower(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "1e9")
    n = 4 + 2 * WINDOW + 10
    got = loop(n, CPU)
    assert got == loop(n)
    s = ae.stats()
    assert s.steps_suspended == 0 and s.boundaries.get("engine steps aside") == 1  # the probe
    assert not [r for r in s.fallbacks if r.startswith("engine slower")]


def test_never_slips_out_from_under_another_mode(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "1e-9")

    class Outer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 8)
    with ae.enabled(**CPU):
        with Outer():
            for _ in range(4 + 3 * WINDOW):
                model(x).sum().backward()
                opt.step()
        assert ae.stats().boundaries.get("engine steps aside") is None
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()


def test_disable_while_aside_leaves_a_clean_stack(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "1e-9")
    loop(4 + 2 * WINDOW + 2, CPU)  # exits the ``enabled`` block while stepped aside
    assert ae.stats().steps_suspended >= 1
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    assert loop(3, CPU) == loop(3)  # and the engine works again


def test_loops_without_an_optimizer_are_clocked_by_host_reads(monkeypatch):
    # A decode-like loop: no optimizer, one ``.item()`` per iteration. Every READS_PER_STEP
    # reads make a step; the governor measures, probes and steps aside as for training.
    from adaptive_eager.governor import READS_PER_STEP

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "1e-9")
    w = torch.randn(16, 16)

    def token(h):
        h = torch.tanh(h @ w)
        return h, h.sum().item()

    def decode(n, engine=None):
        h, out = torch.ones(1, 16), []
        for _ in range(n):
            h, v = token(h)
            out.append(v)
        return out

    n = READS_PER_STEP * (2 * WINDOW + 2 + FIRST_BACKOFF // 2)
    ref = decode(n)
    with ae.enabled(**CPU):
        got = decode(n)
        s = ae.stats()
    assert got == ref
    assert [r for r in s.fallbacks if r.startswith("engine slower than eager on this loop")]
    assert s.steps_suspended >= FIRST_BACKOFF // 2 - 1


def test_long_pauses_are_not_steps(monkeypatch):
    # Intervals longer than MAX_STEP (a notebook waiting on its user) never enter a window.
    from adaptive_eager import governor

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "1e-9")
    monkeypatch.setattr(governor, "MAX_STEP", 0.0)
    n = 4 + 3 * WINDOW
    assert loop(n, CPU) == loop(n)
    s = ae.stats()
    assert s.steps_suspended == 0 and "engine steps aside" not in s.boundaries


def test_read_methods_are_wrapped_only_while_the_engine_is_enabled():
    item, as_bool = torch.Tensor.item, torch.Tensor.__bool__
    with ae.enabled(**CPU):
        assert torch.Tensor.item is not item  # the governor's clock (host reads)
        with ae.enabled(**CPU):  # re-entering does not wrap twice
            pass
        assert torch.Tensor.item is not item
    assert torch.Tensor.item is item and torch.Tensor.__bool__ is as_bool


def test_measured_while_compiling_and_back_when_the_graph_arrives(monkeypatch):
    """Note [Measured while compiling]: a compile that has not finished does not keep a
    slower loop on the engine; the graph's arrival ends the suspension at the next step."""
    import threading

    from adaptive_eager.engine import ENGINE
    from adaptive_eager.tracer import lifecycle

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "1e-9")  # always "slower"
    release = threading.Event()
    compile_graph = lifecycle.compile_graph

    def held(*args, **kwargs):  # the compile finishes only when the test says so
        release.wait(60)
        return compile_graph(*args, **kwargs)

    monkeypatch.setattr(lifecycle, "compile_graph", held)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 8)

    def step():
        model(x).sum().backward()
        opt.step()

    try:
        with ae.enabled(devices=("cpu",), backend="inductor"):
            for _ in range(4 + 2 * WINDOW + 1):
                step()
            assert ENGINE.compiler.pending() > 0  # still compiling ...
            aside = ae.stats().steps_suspended
            assert 1 <= aside < FIRST_BACKOFF - 2  # ... and aside all the same
            release.set()
            assert ENGINE.compiler.wait_idle(120)  # delivered, not yet installed
            step()  # still aside; the arrival ends the suspension
            d = Delta()
            step()
            assert ae.stats().steps_suspended == aside + 1  # not the whole back-off
            assert d.ops_intercepted > 0 and ae.stats().graphs_compiled == 1
    finally:
        release.set()


def test_steps_doing_one_off_work_are_not_timed(monkeypatch):
    """Learning steps (recording, a path's cold runs, the first replay of a path or of a
    fused graph) cost many times a hot step: timed, they made a loop the engine speeds up
    look slower than eager."""
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "1e-9")
    from adaptive_eager import governor

    seen = []  # (state before, state after, the mode's one-off work count) per step
    real = governor.Governor._step

    def spy(self, mode):
        before = self.state
        real(self, mode)
        seen.append((before, self.state, mode.learning))

    monkeypatch.setattr(governor.Governor, "_step", spy)
    loop(4 + 2 * WINDOW, CPU)
    i = next(k for k, (a, b, _) in enumerate(seen) if a == "measure" and b == "probe")
    learning = [n for _, _, n in seen]
    assert learning[0] < learning[i]  # one-off work was done while measuring...
    assert len(set(learning[i - WINDOW:i + 1])) == 1  # ...and none in the steps timed
