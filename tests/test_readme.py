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
