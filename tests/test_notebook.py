"""examples/debugging.ipynb runs top to bottom in a fresh Jupyter kernel and shows what it
says it shows (nbclient + ipykernel, test extras)."""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = pathlib.Path(__file__).parent.parent / "examples" / "debugging.ipynb"


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text", ""))
        data = o.get("data", {})
        out += [data.get("text/html", ""), data.get("text/plain", "")]
    return "\n".join(out)


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:  # run it as saved minus its outputs: a fresh "Restart & Run All"
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path_factory.mktemp("notebook"))}})
    client.execute()  # raises CellExecutionError if any cell fails
    return [c for c in nb.cells if c.cell_type == "code"]


def find(cells, source_part: str):
    return next(c for c in cells if source_part in c.source)


def test_notebook_runs_and_shows_stats_and_explain(cells):
    stats = next(c for c in cells if c.source.strip() == "ae.stats()")
    html = _text(stats)
    assert "<caption>adaptive_eager stats</caption>" in html and "launches saved" in html
    explain = next(c for c in cells if c.source.strip() == "ae.explain()")
    text = _text(explain)
    assert "<b>Hot paths</b>" in text and "graph1" in text


def test_notebook_explains_the_fallback_with_its_line(cells):
    text = _text(find(cells, "def train_step_logged"))
    assert "data-dependent output shape: aten.nonzero.default" in text
    assert "aten.nonzero.default at /" in text and ".item() at /" in text  # advice, with lines


def test_notebook_draws_the_plot(cells):
    outputs = find(cells, "report.plot()").outputs
    assert any("image/png" in o.get("data", {}) for o in outputs)


def test_notebook_pause_and_pending_tensor(cells):
    text = _text(find(cells, "with ae.paused()"))
    assert "ops deferred while paused: 0" in text
    assert "ops run untouched while paused: 0" not in text
    text = _text(find(cells, "pred = model(x)"))
    assert "launches after metadata: 0" in text
    assert "launches after printing: 1" in text and "launches after printing again: 1" in text


def test_notebook_error_points_at_the_issuing_line(cells):
    text = _text(find(cells, "def lookup"))
    assert "IndexError at line 7 of lookup(): h = emb(ids)  # the op that fails" in text
    assert "raised by aten.embedding.default issued at" in text


def test_notebook_profiler_and_export(cells):
    text = _text(find(cells, "from torch.profiler import"))
    assert "adaptive_eager::graph" in text and "adaptive_eager::flush[" in text
    text = _text(find(cells, "report.to_csv"))
    assert "CSV rows; kinds: ['advice', 'boundary', 'fallback', 'path', 'step']" in text


def test_saved_notebook_is_executed_and_clean():
    """The committed notebook shows its outputs (readable on GitHub) and no errors."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)
    assert os.path.getsize(NOTEBOOK) < 200_000
