"""Robustness: threads training at once, long runs that must not grow, shapes that churn,
interrupts and faults, bad settings. Counts are asserted, never times."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptive_eager as ae
import adaptive_eager.neuron  # noqa: F401 -- registers the device before any backward()
from conftest import Delta


def _model(seed: int, device: str):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 4))
    m = m.to(device)
    x, y = torch.randn(8, 16).to(device), torch.randn(8, 4).to(device)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2), x, y


def _train(m, opt, x, y, steps: int) -> list:
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_four_threads_train_independent_models_as_eager(device):
    steps, seeds = 15, (1, 2, 3, 4)
    want = {}
    for s in seeds:
        m, opt, x, y = _model(s, device)
        want[s] = (_train(m, opt, x, y, steps), [p.detach().cpu() for p in m.parameters()])
    models = {s: _model(s, device) for s in seeds}
    got, errors, replays = {}, [], []
    start = threading.Barrier(len(seeds))

    def work(s):
        try:
            m, opt, x, y = models[s]
            with ae.enabled(devices=(device,), backend="exact"):
                start.wait()  # all four at once
                losses = _train(m, opt, x, y, steps)
                replays.append(ae.stats().replays)
            got[s] = (losses, [p.detach().cpu() for p in m.parameters()])
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for s in seeds:
        assert got[s][0] == want[s][0], s  # every loss bitwise
        for a, b in zip(got[s][1], want[s][1]):
            assert torch.equal(a, b), s
    assert min(replays) > 0, replays  # each thread went hot


def test_a_long_run_keeps_its_counts_flat():
    # live tensors, trie nodes, cached graphs and retained segments stay flat once hot: a
    # loop of 400 steps holds the same numbers at step 100 as at step 400
    from adaptive_eager.engine import ENGINE

    m, opt, x, y = _model(0, "cpu")

    def counts():
        gc.collect()
        mode = ENGINE.mode()
        live = sum(1 for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter))
        return live, mode.n_nodes, len(ENGINE.cache), len(mode.seg.outw)

    with ae.enabled(devices=("cpu",), backend="exact"):
        _train(m, opt, x, y, 100)
        at_100 = counts()
        d = Delta()
        _train(m, opt, x, y, 300)
        at_400 = counts()
        assert d.replays >= 300
    assert at_400 == at_100, (at_100, at_400)


def _chain_step(n: int, w):
    x = torch.arange(n * 8, dtype=torch.float32).reshape(n, 8) / 100
    return ((x * w).tanh() + 1).sum().item()


def test_fifty_shapes_compile_within_the_variant_budget(monkeypatch):
    # Note [Shape families]: a loop whose batch size takes 50 values compiles at most the
    # variant budget's graphs, the last of them for every size (Note [Family graphs]): sizes 1
    # and 2 get graphs of their own, and every later size runs the third, with eager's values
    from adaptive_eager.engine import ENGINE

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_VARIANTS", "3")
    w = torch.randn(8)
    sizes = list(range(1, 51))
    want = [_chain_step(n, w) for n in sizes]
    with ae.enabled(devices=("cpu",), backend="inductor"):
        d = Delta()
        for _ in range(3):  # each size twice to go hot, a third time replayed
            got = [_chain_step(n, w) for n in sizes]
            assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, want))
        ENGINE.wait_compiles(timeout=300)
        hits = d.cache_hits
        for n in sizes:
            _chain_step(n, w)
        over = sum(v for k, v in d.fallbacks.items() if "over the variant budget" in k)
        assert d.graphs_compiled == 3, d.graphs_compiled
        assert over == 0, d.fallbacks
        assert d.cache_hits - hits == 50  # every size ran a fused graph
        assert d.replays >= 2 * 50, d.replays  # every size replays, fused or exactly
        nodes = ENGINE.mode().n_nodes
        for n in sizes:  # the same sizes again: nothing new is learned
            _chain_step(n, w)
        assert ENGINE.mode().n_nodes == nodes


def test_a_bucketed_loop_is_hot_on_every_bucket():
    w = torch.randn(8)
    buckets = [8, 16, 24, 32, 40, 48, 56, 64]
    want = [_chain_step(n, w) for n in buckets]
    with ae.enabled(devices=("cpu",), backend="exact"):
        for _ in range(2):
            for n in buckets:
                _chain_step(n, w)
        d = Delta()
        for _ in range(5):
            assert [_chain_step(n, w) for n in buckets] == want
        assert d.replays == 5 * len(buckets), d.replays
        assert d.segments == d.replays  # each step one replayed segment, none cold


def test_the_step_log_is_bounded_and_compact(monkeypatch):
    from adaptive_eager.scheduler import stats

    monkeypatch.setattr(stats, "_MAX_STEPS", 8)
    log = stats.StepLog()
    for i in range(20):
        log.append((i, 2 * i, 0, 0, 0, 1))
    rows = list(log)
    assert 6 <= len(log) == len(rows) <= 8  # the oldest dropped, a quarter at a time
    assert rows[-1] == (19, 38, 0, 0, 0, 1) and rows[0][0] == 20 - len(rows)
    assert log._a.itemsize * len(log._a) == 8 * 6 * len(log)  # 48 bytes a step


def test_a_bucketed_training_loop_is_not_cut_while_its_buckets_warm_up():
    # Note [Cuts]: every bucket's step shares its first op (the weight's transpose), and
    # each diverged there on its way to hot; the third divergence cut every path after that
    # op, and the steps then ran as a launch of one op and a cold rest
    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    buckets = [4, 8, 12, 16, 20, 24, 28, 32]
    data = {n: (torch.randn(n, 16), torch.randn(n, 4)) for n in buckets}

    def rounds(m, opt, k):
        return [_train(m, opt, *data[n], 1)[0] for _ in range(k) for n in buckets]

    want = rounds(*make(), 5)
    m, opt = make()
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = rounds(m, opt, 2)
        d = Delta()
        got += rounds(m, opt, 3)
        assert not [k for k in ae.stats().fallbacks if k.startswith("path cut")]
        assert d.replays == 3 * len(buckets), (d.replays, d.fallbacks)
    assert got == want


@pytest.mark.parametrize("hot_path", ["key", "cpp", "python"])
def test_an_interrupt_during_a_replay_waits_for_it(monkeypatch, hot_path):
    # Note [Interrupts wait for the launch]: a SIGINT arriving while a step's ops replay at
    # loss.item() raises KeyboardInterrupt there once the whole step has run, so training
    # goes on from eager's state; before, the replay stopped midway and every later loss
    # and the parameters differed from eager's
    import os
    import signal
    import sys

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", hot_path)
    m, opt, x, y = _model(0, "cpu")
    want = _train(m, opt, x, y, 8)
    want_params = [p.detach().clone() for p in m.parameters()]
    m, opt, x, y = _model(0, "cpu")
    lines = [0]

    def in_replay(frame, event, arg):  # the interrupt lands at the 3rd line of the replay
        if event == "line":
            lines[0] += 1
            if lines[0] == 3:
                os.kill(os.getpid(), signal.SIGINT)
        return in_replay

    def tracer(frame, event, arg):
        return in_replay if "replay" in frame.f_code.co_filename else None

    got = []
    with ae.enabled(devices=("cpu",), backend="exact"):
        for i in range(8):
            if i == 4:
                sys.settrace(tracer)
            try:
                got += _train(m, opt, x, y, 1)
            except KeyboardInterrupt:
                got.append("interrupted")
            finally:
                sys.settrace(None)
    assert lines[0] >= 3  # the step replayed, and the signal came in the middle of it
    assert got == want[:4] + ["interrupted"] + want[5:]
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), want_params))


def test_the_compile_child_ignores_ctrl_c():
    # Ctrl-C signals the whole process group: the compile child lives on
    import os
    import signal
    import time

    from adaptive_eager.scheduler import compile_process

    child = compile_process.CompileProcess()
    proc = child._start()
    try:
        time.sleep(2)  # its first line has run
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(1)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_an_unwritable_cache_is_said_and_the_program_trains_as_eager(tmp_path):
    # the build directory cannot be written (a full disk, a read-only home): the C++ device
    # and the compiled hot path cannot be built; each is said in one line, and the program
    # trains as eager with the engine on (the Python device, the Python hot path). (An
    # unwritable Inductor cache fails plain PyTorch itself: importing torch._dynamo makes
    # its directory.)
    import os
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.nn as nn, torch.nn.functional as F
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 4))
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        for _ in range(8):
            loss = F.mse_loss(m(x), y)
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            print("LOSS", loss.item().hex())
        print("NEURON", (torch.ones(4, device="neuron") * 2).sum().item())
        s = sys.modules["adaptive_eager"].stats()
        print("REPLAYS", s.replays)
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_", "XDG_CACHE"))}
    env.update(NEURON_ADAPTIVE_EAGER="1", NEURON_ADAPTIVE_EAGER_DEVICES="cpu,neuron",
               NEURON_ADAPTIVE_EAGER_BACKEND="exact", NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO="0",
               XDG_CACHE_HOME="/dev/null/cache")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert out["NEURON"] == "8.0" and int(out["REPLAYS"]) > 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert any("the C++ device could not be built" in line for line in lines), lines
    assert any("the compiled hot path could not be built" in line for line in lines), lines
    torch.manual_seed(0)  # plain eager, the same loop
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    want = []
    for _ in range(8):
        loss = F.mse_loss(m(x), y)
        loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        want.append(loss.item().hex())
    got = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("LOSS")]
    assert got == want
