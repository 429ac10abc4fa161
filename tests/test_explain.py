"""ae.explain(): hot paths with their lines, fallbacks and boundaries with the user line that
caused them, cold paths and why, advice, per-step records, CSV and the plot."""

import csv
import os
import sys

import pytest
import torch
from conftest import child_env

import adaptive_eager as ae
import adaptive_eager.neuron  # noqa: F401 - registered before autograd starts its device threads

HERE = __file__


def line_of(marker: str) -> str:
    """``file:line`` of the line in this file that contains ``marker``."""
    with open(HERE) as f:
        for n, text in enumerate(f, 1):
            if marker in text and "line_of(" not in text:
                return f"{HERE}:{n}"
    raise AssertionError(marker)


def shown(marker: str) -> str:
    """The same line as reports display it: relative to the working directory if under it."""
    line = line_of(marker)
    cwd = os.getcwd() + os.sep
    return line[len(cwd):] if line.startswith(cwd) else line


def train(steps, read_every=0, nonzero=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for i in range(steps):
        loss = ((model(x) - y) ** 2).mean()  # [forward]
        loss.backward()
        if read_every and i % read_every == 0:
            loss.item()  # [item]
        if nonzero:
            torch.nonzero(x > 0)  # [nonzero]
        opt.step()  # [step]
        opt.zero_grad()
    return model


def test_hot_paths_name_their_lines_replays_and_time_saved():
    with ae.enabled(devices=("cpu",), backend="exact"):
        train(8)
    r = ae.explain()
    assert r.hot, r
    main = max(r.hot, key=lambda p: p.n_ops)
    assert main.state == "hot" and main.backend == "exact replay"
    assert main.replays >= 8 - 3 and main.n_ops > 10
    assert line_of("[forward]") in main.lines
    assert main.cold_us is not None and main.replay_us is not None
    assert main.saved_us == pytest.approx(main.cold_us - main.replay_us)
    assert ("mm", 1) in main.ops or any(op.startswith("mm") or op == "addmm"
                                        for op, _ in main.ops)
    text = repr(r)
    assert f"graph{main.gid}: {main.n_ops} ops, replayed {main.replays}x" in text
    assert shown("[forward]") in text
    assert r.advice == []  # nothing in this loop costs a launch that could be saved
    step = next(e for e in r.events_of("boundary") if e.reason == "optimizer step")
    assert step.count == 8 and step.lines[0][0] == line_of("[step]")


def test_fallback_and_boundary_name_the_user_line_and_advise():
    with ae.enabled(devices=("cpu",), backend="exact"):
        train(8, read_every=1, nonzero=True)
    r = ae.explain()
    nz = next(e for e in r.events_of("fallback") if "nonzero" in e.reason)
    assert nz.reason == "data-dependent output shape: aten.nonzero.default"
    assert nz.count == 8 and [line for line, _ in nz.lines] == [line_of("[nonzero]")]
    item = next(e for e in r.events_of("boundary") if e.reason == "host read: .item()")
    assert item.count >= 5 and item.lines[0][0] == line_of("[item]")
    advice = "\n".join(r.advice)
    assert item.launched >= 5  # each split a deferred segment
    assert f".item() at {shown('[item]')}" in advice
    assert f"aten.nonzero.default at {shown('[nonzero]')}" in advice
    assert f"{shown('[nonzero]')}" in repr(r)


def test_cold_paths_say_why():
    def once(k):
        return (torch.ones(k) * 2).sum()  # a new shape each time: never repeats

    with ae.enabled(devices=("cpu",), backend="exact"):
        for k in range(1, 4):
            once(k + 1)
            ae.mark_step()
    r = ae.explain()
    assert not r.hot and len(r.cold) == 3
    threshold = ae.engine.ENGINE.mode() is None and r.hot_threshold
    assert {p.why for p in r.cold} == {f"seen 1 time, hot after {threshold}"}
    assert "Not hot:" in repr(r) and f"seen 1 time, hot after {threshold}" in repr(r)


def test_graph_code_is_reported_for_fused_paths():
    def chain(x):
        return (x * 2 + 1).relu()

    x = torch.randn(8)
    with ae.enabled(devices=("cpu",), backend="inductor"):
        for _ in range(4):
            chain(x)
            ae.mark_step()
        from conftest import wait_compiles

        wait_compiles()
        chain(x)
        ae.mark_step()
    r = ae.explain()
    (p,) = r.hot
    assert p.backend == "fused inductor graph"
    assert "torch.ops.aten.mul.Tensor" in r.code(p.gid)  # the micro-graph compiled
    assert "<details><summary>code</summary>" in r._repr_html_()
    with pytest.raises(KeyError, match="no graph999"):
        r.code(999)


def test_html_escapes_and_lists_every_section():
    with ae.enabled(devices=("cpu",), backend="exact"):
        train(4, nonzero=True)
    html = ae.explain()._repr_html_()
    for title in ("Hot paths", "Not hot", "Fallbacks", "Boundaries", "Advice"):
        assert f"<b>{title}</b>" in html
    assert "<script" not in html and "aten.nonzero.default" in html


def test_records_csv_and_steps(tmp_path):
    with ae.enabled(devices=("cpu",), backend="exact"):
        train(6)
    r = ae.explain()
    records = r.to_records()
    kinds = {rec["kind"] for rec in records}
    assert {"path", "boundary", "step"} <= kinds
    from adaptive_eager.report import RECORD_FIELDS

    assert all(tuple(rec) == RECORD_FIELDS for rec in records)
    steps = [rec for rec in records if rec["kind"] == "step"]
    assert len(steps) == 6  # one per optimizer step
    assert steps[0]["ops_deferred"] == 0 and steps[0]["ops_eager"] > 0  # cold
    assert steps[-1]["ops_deferred"] > 0 and steps[-1]["launches"] < steps[0]["launches"]
    assert sum(s["launches"] for s in steps) <= ae.stats().launches
    out = tmp_path / "explain.csv"
    r.to_csv(out)
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records) and rows[0].keys() == set(RECORD_FIELDS)


def test_plot_draws_per_step_bars_and_marks(monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    with ae.enabled(devices=("cpu",), backend="exact"):
        train(5)
    fig = ae.explain().plot()
    ax = fig.axes[0]
    assert len(ax.patches) == 2 * 5  # deferred and eager bars per step
    labels = ax.get_legend_handles_labels()[1]
    assert "ops deferred" in labels and "ops run eagerly" in labels
    # without matplotlib: one clear line
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"plot\(\) needs matplotlib: pip install matplotlib"):
        ae.explain().plot()


def test_parquet_without_pandas_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match="needs pandas"):
        ae.explain().to_parquet(tmp_path / "x.parquet")


def test_readme_shows_what_the_example_prints():
    """The README's explain() output is the example's: same events at the same lines, same
    advice (counts and timings may differ from run to run)."""
    import pathlib
    import re
    import subprocess

    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    block = readme.split("`python examples/debugging.py`", 1)[1].split("```text\n", 1)[1]
    block = block.split("```", 1)[0]
    # as in the tests: no timing decisions
    env = child_env(NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO="0")
    fresh = subprocess.run([sys.executable, "examples/debugging.py"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr

    def events(text):
        return {re.sub(r"^\s*[\d\s]+", "", line) for line in text.splitlines() if "[at " in line}

    def advice(text):
        return {re.sub(r"\(\d+ times\)", "", line) for line in text.splitlines()
                if line.startswith("  - ")}

    assert events(block) and events(block) <= events(fresh.stdout)
    assert advice(block) == advice(fresh.stdout)


def test_advice_on_a_device_copy_and_other_eager_ops():
    x = torch.randn(8)

    def step():
        y = (x * 2).to("neuron")  # [copy]
        z = (y + 1).cpu()
        return z.sum().item()

    with ae.enabled(devices=("cpu", "neuron"), backend="exact"):
        for _ in range(4):
            step()
    advice = "\n".join(ae.explain().advice)
    assert f"A copy between devices at {shown('[copy]')}" in advice


def test_advice_names_ops_outside_aten():
    lib = torch.library.Library("ae_explain_test", "DEF")
    lib.define("scale(Tensor x) -> Tensor")
    lib.impl("scale", lambda x: x * 3, "CompositeExplicitAutograd")
    x = torch.randn(8)
    with ae.enabled(devices=("cpu",), backend="exact"):
        for _ in range(3):
            torch.ops.ae_explain_test.scale(x + 1).sum().item()  # [custom]
    advice = "\n".join(ae.explain().advice)
    assert (f"ae_explain_test.scale.default at {shown('[custom]')} always runs eagerly and ends "
            "the segment (op outside aten (ae_explain_test)), 3 times") in advice


def test_advice_when_nothing_is_managed():
    assert "The engine has intercepted no op" in "\n".join(ae.explain().advice)
    x = torch.randn(16)
    with ae.enabled(devices=("neuron",), backend="exact"):
        for _ in range(3):
            (x * 2 + 1).sum().item()  # cpu tensors: not managed
    advice = "\n".join(ae.explain().advice)
    assert "ran on devices the engine does not manage" in advice


def test_long_sections_are_cut_with_a_pointer_to_the_rest():
    from adaptive_eager import report as rp

    events = tuple(rp.Event("fallback", f"reason {i}", 30 - i, ()) for i in range(25))
    r = rp.Report(ae.stats(), [], list(events), [], [], 2)
    text = repr(r)
    assert "reason 19" in text and "reason 20" not in text
    assert "... and 5 more fallback reasons (Report.events has them all)" in text
    html = rp._details("code", "x" * (rp.CODE_SHOWN + 7), pre=True)
    assert "... 7 more characters (Report.code(gid) has it all)" in html


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_a_real_model_is_explained_with_its_own_lines(device):
    """A Hugging Face Llama training step: the hot path's lines are in the model's code and
    the training loop, none unknown -- on neuron autograd runs backward on a device worker
    thread, whose ops take their lines from the thread that called backward()."""
    pytest.importorskip("transformers")
    zoo = pytest.importorskip("benchmarks.zoo")
    model, batch = zoo.build("llama", "tiny")
    model.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    step = zoo.train_step(model, batch)
    with ae.enabled(devices=(device,), backend="exact"):
        for _ in range(6):
            step()
    r = ae.explain()
    main = max(r.hot, key=lambda p: p.n_ops)
    assert main.n_ops > 100 and main.replays >= 2
    assert "<unknown>" not in main.lines
    assert any("modeling_llama.py" in line for line in main.lines)
    assert any(line.startswith(zoo.__file__) for line in main.lines)  # loss.backward()
    assert all("<unknown>" not in line for e in r.events for line, _ in e.lines)


@pytest.mark.parametrize("compiling", [False, True])
def test_advice_when_the_engine_stepped_aside(monkeypatch, compiling):
    """Measured slower while graphs compile, the engine comes back with them: the advice
    says which case it was."""
    from adaptive_eager.scheduler.compiler import Compiler

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "1e-9")  # always slower
    monkeypatch.setattr(Compiler, "busy", lambda self: compiling)
    with ae.enabled(devices=("cpu",), backend="exact"):
        train(30)
    advice = "\n".join(ae.explain().advice)
    assert "measured slower than eager" in advice and "stepped aside for" not in advice
    assert ("while its graphs were still compiling" in advice) == compiling
    assert ("the engine's cost per op is more than the launches it saves" in advice) == (
        not compiling)
