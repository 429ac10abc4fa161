"""The engine on CUDA: replays on the current stream, CUDA's sync points and stream changes
launch deferred work first, fused graphs with lifted floats (CUDA tests skip without it)."""

from __future__ import annotations

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import cudaguard
from adaptive_eager.scheduler import queues
from conftest import Delta, wait_compiles

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_has_its_own_queue():
    q = queues.queue_for("cuda")
    assert isinstance(q, queues.CudaQueue) and not q.asynchronous
    queues.synchronize_all()  # with CUDA never started (or absent): nothing to wait for


def test_managing_cuda_guards_its_sync_points_and_launches_before_them():
    x = torch.randn(64)

    def f():
        return ((x * 2).sin() + 1).sum()

    with ae.enabled(devices=("cpu", "cuda"), backend="exact"):
        for owner, attr, _ in cudaguard.POINTS:
            got = getattr(cudaguard._owner(owner), attr, None)
            assert got is None or getattr(got, "__wrapped_by_adaptive_eager__", False), attr
        for _ in range(3):
            f()
            ae.mark_step()
        d = Delta()
        y = f()  # hot, deferred: nothing launched yet
        assert d.replays == 0
        torch.cuda.set_stream(None)  # a stream change (a no-op here, with no stream)
        assert d.replays == 1 and d.boundaries == {"stream change": 1}
        assert d.flushes == {"stream change": 1}
        torch.cuda.set_stream(None)  # nothing held: launches nothing
        assert d.replays == 1 and d.flushes == {"stream change": 1}
    assert torch.equal(y, f())


def test_lifted_floats_are_packed_on_the_graphs_device():
    from adaptive_eager.scheduler.backends import packed_floats

    cpu = packed_floats([0.5, -0.0], torch.device("cpu"))
    assert cpu.dtype == torch.float64 and cpu.tolist() == [0.5, -0.0] and cpu.device.type == "cpu"
    other = packed_floats([0.5, 1.0], torch.device("meta"))  # an accelerator other than cuda
    assert other.device.type == "meta" and other.shape == (2,)


@cuda
def test_lifted_floats_reach_cuda_without_the_host_waiting():
    from adaptive_eager.scheduler.backends import packed_floats

    t = packed_floats([0.5, 2.0], torch.device("cuda"))
    assert t.device.type == "cuda" and t.tolist() == [0.5, 2.0]


def _f(x):
    return ((x * 2).sin() + 1).sum()


@cuda
def test_replay_is_one_launch_on_the_current_stream_with_eager_values():
    x = torch.randn(1024, device="cuda")
    expect = _f(x).item()
    s = torch.cuda.Stream()
    with ae.enabled(devices=("cuda",), backend="exact"):
        for _ in range(3):
            _f(x).item()
        d = Delta()
        with torch.cuda.stream(s):
            y = _f(x)
        # leaving the stream context launched it, on s
        assert d.replays == 1 and d.flushes == {"stream change": 1}
        s.synchronize()
        assert y.item() == expect


@cuda
@pytest.mark.parametrize("point", ["torch.cuda.synchronize", "Event.record",
                                   "Stream.synchronize", "Stream.query"])
def test_sync_points_launch_what_is_deferred(point):
    x = torch.randn(1 << 16, device="cuda")
    expect = _f(x).item()
    with ae.enabled(devices=("cuda",), backend="exact"):
        for _ in range(3):
            _f(x).item()
        d = Delta()
        y = _f(x)
        assert d.replays == 0
        if point == "torch.cuda.synchronize":
            torch.cuda.synchronize()
        elif point == "Event.record":
            e = torch.cuda.Event()
            e.record()
            e.synchronize()  # completes after the work it marks
        elif point == "Stream.synchronize":
            torch.cuda.current_stream().synchronize()
        else:
            torch.cuda.current_stream().query()
        assert d.replays == 1 and d.flushes == {point: 1}
        assert y.item() == expect


@cuda
def test_fused_adamw_step_with_lifted_floats():
    """AdamW's bias corrections change every step: they reach the fused graph as lifted
    floats, which must be on the graph's device."""

    def run(engine: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 32)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(8, 32, device="cuda")
        losses = []
        ctx = ae.enabled(devices=("cuda",), backend="inductor") if engine else None
        if ctx:
            ctx.__enter__()
        try:
            for i in range(10):
                if engine and i == 4:
                    wait_compiles()
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            stats = ae.stats()
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
        return losses, stats

    eager, _ = run(False)
    got, stats = run(True)
    assert stats.graphs_compiled >= 1
    assert all(abs(a - b) <= 1e-3 * abs(a) for a, b in zip(eager, got)), (eager, got)
