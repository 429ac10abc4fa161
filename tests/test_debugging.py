"""Seeing into the engine: the debug ladder (and its zero cost when off), errors that point
at the line that issued the op, torch.profiler ranges, and inspecting pending tensors."""

import logging
import traceback

import pytest
import torch

import adaptive_eager as ae
from conftest import Delta

CPU = dict(devices=("cpu",), backend="exact")


def chain(x):
    y = (x * 2 + 1).relu()
    return y, y.sum()


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def records():
    logger = logging.getLogger("adaptive_eager")
    handler, level = _Count(), logger.level
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_debug_ladder_off_logs_nothing_and_makes_no_logging_calls(monkeypatch, records):
    calls = []
    for name in ("debug", "info", "warning", "isEnabledFor", "log"):
        original = getattr(logging.Logger, name)

        def counted(self, *a, _original=original, **k):
            if self.name.startswith("adaptive_eager"):
                calls.append(a[:1])
            return _original(self, *a, **k)

        monkeypatch.setattr(logging.Logger, name, counted)
    x = torch.randn(16)
    with ae.enabled(**CPU):
        for _ in range(12):
            chain(x)
            ae.mark_step()
        torch.nonzero(x)  # a fallback
    assert ae.stats().replays >= 9
    assert calls == [] and records == []  # no logging call at all with the ladder at 0


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_debug_ladder_levels(monkeypatch, records, level):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_DEBUG", str(level))
    x = torch.randn(16)
    backend = "inductor" if level == 4 else "exact"
    with ae.enabled(devices=("cpu",), backend=backend):
        for _ in range(5):
            chain(x)
            ae.mark_step()
        torch.nonzero(x)
        if level == 4:
            from conftest import wait_compiles

            wait_compiles()
            for _ in range(2):
                chain(x)
                ae.mark_step()
    text = [r.getMessage() for r in records]
    replays = [t for t in text if t.startswith("replay ")]
    first = [t for t in text if t.startswith("fallback: data-dependent output shape")]
    ready = [t for t in text if t.startswith("graph1 ready")]
    assert len(ready) == 1 and len(first) == 1  # level 1: compiles, each fallback once
    assert "test_debugging.py" in first[0]  # ... with the line that caused it
    assert (len(replays) == ae.stats().replays) is (level >= 2)  # level 2: each replay, timed
    if level >= 2:
        assert all(t.endswith(" us") for t in replays)
    trie = [t for t in text if t.startswith("trie: new node")]
    assert bool(trie) is (level >= 3)  # level 3: trie and cache decisions
    if level == 4:
        assert any("cache hit graph1 GraphKey(" in t for t in text)
        assert any(t.startswith("graph1 code:") and "torch.ops.aten.mul" in t for t in text)
    else:
        assert not any("code:" in t for t in text)


def test_error_is_eager_type_names_op_and_ends_traceback_at_issuing_line():
    emb = torch.nn.Embedding(10, 4)

    def step(ids):
        h = emb(ids)  # the issuing line
        return (h * 2).sum()

    line = step.__code__.co_firstlineno + 1
    with ae.enabled(**CPU):
        for _ in range(3):
            step(torch.tensor([1, 2, 3])).item()
        pending = step(torch.tensor([1, 2, 99]))
        with pytest.raises(IndexError) as info:  # eager raises IndexError too
            pending.item()  # the sync point
    error = info.value
    assert "aten.embedding.default" in str(error) and f"test_debugging.py:{line}" in str(error)
    frames = traceback.extract_tb(error.__traceback__)
    last = frames[-1]
    assert (last.filename, last.lineno, last.name) == (__file__, line, "step")
    assert last.line == "h = emb(ids)  # the issuing line"
    assert any(f.line == "pending.item()  # the sync point" for f in frames)
    text = "".join(traceback.format_exception(error))
    assert "^^^" not in text.split("the issuing line")[1]  # no markers under a stand-in


def test_profiler_ranges_per_replay_and_flush_instants(tmp_path):
    x = torch.randn(32)

    def step():
        return chain(x)[1].item()

    with ae.enabled(**CPU):
        for _ in range(3):
            step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(4):
                step()
    names = {e.key: e.count for e in prof.key_averages()}
    graph = [k for k in names if k.startswith("adaptive_eager::graph")]
    (p,) = ae.explain().hot
    assert graph == [f"adaptive_eager::graph{p.gid}[{p.n_ops} ops]"]
    assert names[graph[0]] == 4
    assert names.get("adaptive_eager::flush[host read: .item()]") == 4
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    assert graph[0] in path.read_text()
    table = prof.key_averages().table(row_limit=50)
    assert graph[0] in table


def test_ranges_cost_nothing_when_not_profiling(monkeypatch):
    from adaptive_eager.scheduler import launch

    made = []
    real = launch._enter
    monkeypatch.setattr(launch, "_enter", lambda *a: made.append(a) or real(*a))
    x = torch.randn(8)
    with ae.enabled(**CPU):
        for _ in range(6):
            chain(x)[1].item()
    assert ae.stats().replays >= 3 and made == []


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_inspecting_a_pending_tensor(device):
    if device == "neuron":
        import adaptive_eager.neuron  # noqa: F401
    x = torch.randn(4, 4, device=device)

    def f():
        y = (x @ x).relu() * 2
        return y, y.sum()

    with ae.enabled(devices=(device,), backend="exact"):
        for _ in range(3):
            f()
            ae.mark_step()
        d = Delta()
        y = (x @ x).relu() * 2  # a prefix of the hot path: deferred, pending
        assert d.ops_deferred == 0 and d.replays == 0
        meta = (y.shape, y.dtype, y.device, y.stride(), y.size(0), y.dim(), y.numel(),
                y.requires_grad, y.is_contiguous(), y.ndim, y.layout, y.storage_offset())
        assert meta[0] == (4, 4) and meta[2].type == device
        assert d.replays == 0 and d.boundaries == {} and d.ops_intercepted == 0  # no flush
        text = repr(y)  # a data read: flushes once
        assert d.replays == 1 and d.boundaries == {"host read: print() / repr()": 1}
        assert str(y) == text and y[0].tolist() == y.tolist()[0]  # later reads: no flush
        assert d.replays == 1 and sum(d.boundaries.values()) == 1
    want = ((x @ x).relu() * 2)
    assert torch.equal(y.cpu(), want.cpu())
    assert text == repr(want)
