"""The README documents every setting and the CI runs its test command."""

import pathlib
import subprocess

from adaptive_eager.config import VARIABLES

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_variable_in_readme_table():
    readme = (ROOT / "README.md").read_text()
    for v in VARIABLES:
        assert f"| `{v.env}` |" in readme, v.env


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    cmd = subprocess.run(
        ["bash", "-c", script.split("cmd=$(", 1)[1].split(")\nif", 1)[0]],
        cwd=ROOT, capture_output=True, text=True,
    ).stdout.strip()
    assert "pytest" in cmd and "torch==2.13.0" in cmd
    assert cmd in (ROOT / "README.md").read_text()


def _note_definitions() -> dict:
    """Note name -> files that define it (``Note [Name]:``, or the name alone on its line)."""
    import re

    files = [p for d in ("adaptive_eager", "tracer", "scheduler") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".cpp", ".h")]
    files += [p for p in (ROOT / "tests" / "fidelity").glob("*.py")
              if not p.name.startswith("test_")]
    files.append(ROOT / "tests" / "conftest.py")
    defined: dict = {}
    for p in files:
        for line in p.read_text().splitlines():
            text = line.strip().lstrip("#/ ").strip()
            for name in re.findall(r"Note \[([^\]]+)\]:", line):
                defined.setdefault(name, set()).add(str(p.relative_to(ROOT)))
            alone = re.fullmatch(r"Note \[([^\]]+)\]", text)
            if alone:
                defined.setdefault(alone.group(1), set()).add(str(p.relative_to(ROOT)))
    return defined


def test_design_doc_is_in_the_repository_and_indexes_every_note():
    design = (ROOT / "DESIGN.md").read_text()
    rows = {}
    for line in design.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 2 and cells[0] not in ("Note", "---"):
            rows[cells[0]] = {f.strip() for f in cells[1].split(",")}
    defined = _note_definitions()
    assert set(rows) == set(defined), (set(defined) - set(rows), set(rows) - set(defined))
    for name, where in rows.items():
        assert where & defined[name], (name, where, defined[name])
        assert all((ROOT / f).is_file() for f in where), (name, where)
    # every "DESIGN §n" in the code names a section this document has
    import re

    sections = set(re.findall(r"^## (\d+)\.", design, re.M))
    for p in [*ROOT.glob("*.md"), *(q for d in ("adaptive_eager", "tracer", "scheduler",
                                                 "benchmarks", "tests")
                                     for q in (ROOT / d).rglob("*.py"))]:
        for n in re.findall(r"DESIGN\s+§(\d+)", p.read_text()):
            assert n in sections, (p, n)
