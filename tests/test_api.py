"""The public API: enable/disable/enabled, stats, reset, mark_step, synchronize."""

import torch

import adaptive_eager as ae
from conftest import Delta


def chain(x):
    for _ in range(4):
        x = x * 1.5
        x = x + 1.0
    return x


def test_all_names():
    assert set(ae.__all__) == {
        "enable", "disable", "enabled", "paused", "is_enabled", "mark_step", "synchronize",
        "wait_compiles", "stats", "explain", "reset", "cache_info", "cache_clear",
    }
    s = ae.stats()
    for name in ("ops_intercepted", "ops_deferred", "ops_eager", "launches", "graphs_compiled",
                 "cache_hits", "cache_misses", "paths_restored", "graphs_loaded"):
        assert isinstance(getattr(s, name), int)
    assert isinstance(s.fallbacks, dict)
    assert "adaptive_eager stats" in repr(s) and "launches" in repr(s)


def test_enable_disable():
    assert not ae.is_enabled()
    ae.enable(devices=("cpu",), backend="exact")
    assert ae.is_enabled()
    ae.disable()
    assert not ae.is_enabled()
    ae.disable()  # disabling twice is harmless


def test_nested_enabled_restores_previous():
    with ae.enabled(devices=("cpu",), backend="exact"):
        with ae.enabled(devices=("cpu",), backend="inductor", hot_threshold=5):
            assert ae.is_enabled()
        assert ae.is_enabled()
        from adaptive_eager.engine import ENGINE

        assert ENGINE.config().backend == "exact"
    assert not ae.is_enabled()


def test_other_devices_are_untouched():
    d = Delta()
    with ae.enabled(devices=("neuron",), backend="exact"):
        chain(torch.ones(4))
    assert d.ops_eager == 0 and d.ops_deferred == 0 and d.launches == 0
    assert d.ops_passthrough > 0


def test_hot_path_defers_and_launches_once():
    x = torch.randn(16)
    ref = chain(x).sum().item()
    with ae.enabled(devices=("cpu",), backend="exact"):
        for _ in range(3):  # cold, cold (-> warm), hot
            chain(x).sum().item()
        d = Delta()
        got = chain(x).sum().item()
    assert got == ref
    assert d.launches == 2  # one replay + the .item() read
    assert d.ops_deferred == 9 and d.replays == 1
    assert d.ops_intercepted == 10


def test_mark_step_is_a_boundary_and_never_required():
    x = torch.randn(8)
    with ae.enabled(devices=("cpu",), backend="exact"):
        for _ in range(4):
            y = chain(x)
            ae.mark_step()
        assert torch.equal(y, chain(x))  # read flushes without a mark_step too
    assert ae.stats().boundaries.get("mark_step") == 4


def test_disable_flushes_pending_work():
    x = torch.randn(8)
    ref = chain(x)
    ae.enable(devices=("cpu",), backend="exact")
    for _ in range(3):
        chain(x)
        ae.mark_step()
    y = chain(x)  # deferred: nothing has run yet
    d = Delta()
    ae.disable()
    assert d.replays == 1
    assert torch.equal(y, ref)


def test_synchronize_flushes():
    x = torch.randn(8)
    with ae.enabled(devices=("cpu",), backend="exact"):
        for _ in range(3):
            chain(x)
            ae.mark_step()
        y = chain(x)
        d = Delta()
        ae.synchronize()
        assert d.replays == 1
    assert torch.equal(y, chain(x))


def test_reset_clears_counters_and_trie():
    x = torch.randn(8)
    with ae.enabled(devices=("cpu",), backend="exact"):
        for _ in range(3):
            chain(x).sum().item()
        assert ae.stats().replays == 1
        ae.reset()
        assert ae.stats().ops_intercepted == 0
        d = Delta()
        chain(x).sum().item()  # learned again from scratch: cold
        assert d.replays == 0 and d.ops_eager == 10


def test_stats_render_as_text_and_as_an_html_table():
    x = torch.randn(8)
    with ae.enabled(devices=("cpu",), backend="exact"):
        for _ in range(4):
            (x * 2 + 1).sum().item()
        ae.mark_step()
    s = ae.stats()
    assert s.launches_saved == s.ops_deferred - s.replays > 0
    text, html = repr(s), s._repr_html_()
    assert "launches saved" in text and f"  {s.launches_saved}" in text
    assert html.startswith("<table>") and html.endswith("</table>")
    assert html.count("<tr>") == len(s._rows()) + 2 + len(s.fallbacks) + len(s.boundaries)
    assert f">{s.ops_deferred}<" in html and "launches saved" in html
    for reason in s.boundaries:
        assert html.count(reason) == 1


def test_stats_html_escapes_reasons():
    from adaptive_eager.scheduler.stats import Stats

    html = Stats(fallbacks={"op <lambda> & co": 2})._repr_html_()
    assert "op &lt;lambda&gt; &amp; co" in html and "<lambda>" not in html


def test_paused_runs_the_block_in_eager_and_keeps_what_was_learned():
    x = torch.randn(16)

    def step():
        return (x * 3 - 1).sum()

    want = step().item()
    with ae.enabled(devices=("cpu",), backend="exact"):
        for _ in range(3):
            step().item()
        pending = step()  # deferred: nothing computed yet
        d = Delta()
        with ae.paused():
            assert d.replays == 1  # entering launched what the engine held
            assert pending.item() == want
            inside = Delta()
            (x * 5).sum().item()
            assert inside.ops_deferred == 0 and inside.replays == 0
            assert inside.ops_passthrough >= 2
        d = Delta()
        assert step().item() == want  # the hot path is still known: replayed, not learned
        assert d.replays == 1 and d.ops_deferred >= 3
    with ae.paused():  # engine off: nothing to do
        assert (x * 3 - 1).sum().item() == want


def test_wait_compiles_puts_the_fused_graphs_in_use():
    import pytest

    for bad in (-1, "soon", True):
        with pytest.raises(ValueError, match=f"timeout={bad!r}; accepted: None or a number"):
            ae.wait_compiles(bad)
    x = torch.randn(64)
    with ae.enabled(devices=("cpu",), backend="inductor"):
        for _ in range(3):
            chain(x).sum().item()
        assert ae.wait_compiles(timeout=300)
        assert ae.stats().graphs_compiled == 1
        d = Delta()
        got = chain(x).sum().item()
        assert d.replays == 1 and d.cache_hits == 1  # the fused graph ran
    assert got == pytest.approx(chain(x).sum().item(), rel=1e-5)
