"""NEURON_ADAPTIVE_EAGER=1: engaged at `import torch` with no import in the script."""

import os
import subprocess
import sys
import textwrap

from conftest import child_env

SCRIPT = textwrap.dedent("""
    import sys, torch
    x = torch.randn(100)
    values = [((x * 2 + 1).relu()).sum().item() for _ in range(4)]
    ae = sys.modules.get("adaptive_eager")
    print("ENGAGED", ae is not None and ae.is_enabled() and ae.stats().ops_intercepted > 0)
    print("SAME", len(set(values)) == 1)
""")


def run(tmp_path, **env):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    full = child_env(**env)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=full,
                          timeout=300)


def test_env_engages_engine(tmp_path):
    r = run(tmp_path, NEURON_ADAPTIVE_EAGER="1", NEURON_ADAPTIVE_EAGER_DEVICES="cpu",
            NEURON_ADAPTIVE_EAGER_BACKEND="exact")
    assert r.returncode == 0, r.stderr
    assert "ENGAGED True" in r.stdout and "SAME True" in r.stdout
    assert r.stderr == ""


def test_unset_does_nothing(tmp_path):
    r = run(tmp_path)
    assert "ENGAGED False" in r.stdout


def test_bad_value_one_line_then_eager(tmp_path):
    r = run(tmp_path, NEURON_ADAPTIVE_EAGER="1", NEURON_ADAPTIVE_EAGER_DEVICES="cpu,tpu")
    assert r.returncode == 0
    assert "ENGAGED False" in r.stdout and "SAME True" in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "NEURON_ADAPTIVE_EAGER_DEVICES='cpu,tpu'" in lines[0] and "'neuron'" in lines[0]
    assert "running plain eager" in lines[0]


def test_bad_switch_value(tmp_path):
    r = run(tmp_path, NEURON_ADAPTIVE_EAGER="yes please")
    assert r.returncode == 0 and "ENGAGED False" in r.stdout
    assert len(r.stderr.strip().splitlines()) == 1 and "'yes please'" in r.stderr


def test_every_variable_given_garbage_is_one_line_and_the_program_runs(tmp_path):
    # every setting at once: one line for each naming its value and the accepted ones; the
    # program runs plain eager, on the neuron device it was written for
    from adaptive_eager.config import VARIABLES

    path = tmp_path / "device.py"
    path.write_text(textwrap.dedent("""
        import torch
        x = torch.ones(3, device="neuron")
        print("VALUE", (x * 2).sum().item())
    """))
    env = child_env("NEURON_", **{v.env: "garbage!" for v in VARIABLES})
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "VALUE 6.0" in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == len(VARIABLES), lines
    for v in VARIABLES:
        mine = [line for line in lines if f"{v.env}='garbage!'" in line]
        assert len(mine) == 1 and "accepted:" in mine[0], (v.env, lines)
