"""`python -m benchmarks` cannot rot: every workload x mode runs a step in tiny sizes, the JSON
holds every figure, and bad flags get a one-line error naming the value and the accepted ones.
"""

import json
import os
import pathlib
import subprocess
import math
import sys

import pytest
import torch

import adaptive_eager as ae
from conftest import Delta

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import suite  # noqa: E402
from benchmarks.workloads import WORKLOADS  # noqa: E402


def _suite(*args, timeout=900):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# Each mode runs in a process of its own, so the engine's background compiles cannot race a
# torch.compile'd function (make_fx's process-wide tracing flag was the hazard when modes
# shared a process). The test checks that every workload and mode runs, not how fast: the
# warm-up stops after 20 s even where compiles are still pending (cold caches on CI).
TINY = ("--size", "tiny", "--repeat", "1", "--warm-steps", "2", "--warmup-s", "20",
        "--workloads", ",".join(suite.WORKLOAD_NAMES))


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_every_workload_and_mode_runs_a_step(device, tmp_path):
    out = tmp_path / "r.json"
    # torch.compile: test_torch_compile_runs (its cold compiles cost ~50 s over all workloads)
    modes = ("--modes", ",".join(m for m in suite.MODE_NAMES if m != "torch.compile"))
    r = _suite(*TINY, "--device", device, "--json", str(out), *modes)
    failed = [ln for ln in r.stdout.splitlines() if "FAILED" in ln]
    assert r.returncode == 0, (failed, r.stdout[-2000:], r.stderr[-3000:])
    res = json.loads(out.read_text())
    ran = {(row["workload"], row["mode"]) for row in res["rows"]}
    skipped = set(res["not_applicable"])
    if device == "cpu":
        assert not skipped
    else:  # lazy is cpu only
        assert skipped == {"torch._lazy"}
    modes = [m for m in suite.MODE_NAMES if m not in skipped and m != "torch.compile"]
    assert ran == {(w, m) for w in suite.WORKLOAD_NAMES for m in modes}
    assert res["failed"] == []
    # each mode ran on the main thread of a process of its own
    pids = {row["mode"]: row["pid"] for row in res["rows"]}
    assert len(set(pids.values())) == len(modes) and os.getpid() not in pids.values()
    assert all(row["main_thread"] for row in res["rows"])
    for row in res["rows"]:
        assert row["step_s"] > 0 and row["ops"] > 0 and len(row["warm_s"]) >= 2
        assert row["speedup"] is not None and row["x_floor"] is not None
        if row["mode"].startswith("adaptive"):  # deferred: fewer launches than ops
            assert row["launches"] < row["ops"], row
    # the table is printed, with a row per workload x mode
    assert r.stdout.count("\n| ") == 1 + len(ran)
    assert res["machine"]["torch"] == torch.__version__


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_torch_compile_runs(device, tmp_path):
    """The suite's torch.compile mode, on a forward and a training workload; on the emulated
    device its neuron backend (Note [The neuron compile backend]), a few launches a step
    where eager has one an op."""
    out = tmp_path / "r.json"
    r = _suite("--size", "tiny", "--repeat", "1", "--warm-steps", "2", "--warmup-s", "20",
               "--workloads", "chain-small,mlp-train", "--modes", "eager,torch.compile",
               "--device", device, "--json", str(out))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    res = json.loads(out.read_text())
    assert res["failed"] == [] and not res["not_applicable"]
    rows = {(row["workload"], row["mode"]): row for row in res["rows"]}
    assert set(rows) == {(w, m) for w in ("chain-small", "mlp-train")
                         for m in ("eager", "torch.compile")}
    for w in ("chain-small", "mlp-train"):
        compiled, eager = rows[(w, "torch.compile")], rows[(w, "eager")]
        assert compiled["step_s"] > 0 and compiled["speedup"] is not None
        if device == "neuron":
            assert compiled["launches"] < eager["launches"], (compiled, eager)
    assert "torch.compile first step, mlp-train" in r.stdout


@pytest.mark.parametrize("args, bad, accepted", [
    (["--device", "tpu"], "'tpu'", "neuron, cpu, cuda"),
    (["--workloads", "chain-small,resnet"], "resnet", "chain-small, chain-large"),
    (["--modes", "eager,xla"], "xla", "eager, adaptive, adaptive-exact"),
    (["--launch-us", "10,fast"], "'10,fast'", "a comma list of numbers >= 0"),
    (["--repeat", "0"], "'0'", "an integer >= 1"),
    (["--device", "cpu", "--launch-us", "5"], "'5'", "--device neuron only"),
    (["--runs", "3"], "'3'", "accepted: 1, 2"),
])
def test_bad_flags_name_the_value_and_the_accepted_ones(args, bad, accepted, capsys):
    with pytest.raises(SystemExit) as e:
        suite.parse(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert bad in err and accepted in err


def test_two_runs_measure_the_warm_start(monkeypatch):
    # --runs 2 is the warm-start table (benchmarks.warm_start): every device it measures
    # unless --device names one, the workloads asked that it knows
    from benchmarks import warm_start

    calls = []
    monkeypatch.setattr(warm_start, "main", lambda argv: calls.append(argv) or 0)
    assert suite.main(["--runs", "2"]) == 0
    assert suite.main(["--runs", "2", "--device", "cpu", "--workloads",
                       "mlp-train,chain-large"]) == 0
    assert calls[0][calls[0].index("--devices") + 1] == "cpu,neuron"
    assert calls[0][calls[0].index("--workloads") + 1].split(",") == [
        w for w in warm_start.WORKLOADS if w in suite.parse([]).workloads]
    assert calls[1][calls[1].index("--devices") + 1] == "cpu"
    assert calls[1][calls[1].index("--workloads") + 1] == "mlp-train"


def test_floor_mode_returns_recorded_outputs_and_runs_nothing():
    from benchmarks.modes import FloorMode

    x = torch.randn(8)
    calls = []

    def step():
        calls.append(1)
        return (x * 2 + 1).sum()

    m = FloorMode()
    outs = []
    with m:
        for _ in range(5):
            m.begin_step()
            outs.append(step())
    assert len({id(o) for o in outs[:3]}) == 3  # run for real until the recorded step
    assert outs[4] is outs[3] is outs[2]  # then the recorded object, nothing computed
    assert m.misses == 0 and len(m.recorded) == 3


def test_in_repo_llama_when_transformers_is_absent(monkeypatch):
    """Without transformers the llama workloads use the in-repo model: it trains, decodes,
    and replays bitwise under the engine."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    w = WORKLOADS["llama-train"]("cpu", "tiny")
    assert "in-repo" in w.note
    ref = [w.step() for _ in range(4)]
    w = WORKLOADS["llama-train"]("cpu", "tiny")
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = [w.step() for _ in range(3)]
        d = Delta()
        got.append(w.step())
    assert got == ref
    assert d.replays >= 1 and d.launches < d.ops_intercepted // 10
    dec = WORKLOADS["llama-decode"]("cpu", "tiny")
    eager = dec.body()
    assert eager.shape == (1, 8 + 16)
    with ae.enabled(devices=("cpu",), backend="exact"):
        for _ in range(3):
            assert torch.equal(dec.body(), eager)


def test_floor_and_engine_skip_the_rule_lookup_other_modes_keep_it():
    """Note [Dispatch rule lookup]: neither the engine's mode nor the floor pays the per-op
    rule lookup; a rule registered for any other mode class is still found."""
    from torch._library import simple_registry as registry
    from torch.utils._python_dispatch import TorchDispatchMode

    from adaptive_eager.tracer.mode import AdaptiveEagerMode, skip_rule_lookup
    from benchmarks.modes import FloorMode

    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args, kwargs=None):
            return func(*args, **(kwargs or {}))

    skip_rule_lookup()
    lib = torch.library.Library("aten", "FRAGMENT")  # noqa: TOR901
    rule = lambda mode, func, types, args, kwargs: "rule"  # noqa: E731
    op = torch.ops.aten.sin.default
    for cls in (Other, FloorMode, AdaptiveEagerMode):
        torch.library.register_torch_dispatch(op, cls, rule, lib=lib)
    try:
        assert registry.find_torch_dispatch_rule(op, Other) is rule
        assert registry.find_torch_dispatch_rule(op, FloorMode) is None
        assert registry.find_torch_dispatch_rule(op, AdaptiveEagerMode) is None
    finally:
        lib._destroy()


def test_plot_needs_matplotlib_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit):
        suite.parse(["--plot", "x.png"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "matplotlib" in err and "pip install" in err


def test_plot_draws_speedup_and_warm_up(tmp_path):
    pytest.importorskip("matplotlib")
    rows = []
    for lat in (0.0, 10.0, 50.0):
        for mode, t in (("eager", 2.0), ("adaptive", 1.0), ("floor", 0.5)):
            rows.append(dict(workload="w", mode=mode, launch_us=lat, step_s=t * (1 + lat / 50),
                             warm_s=[5.0, 3.0, 1.0], speedup=None))
    for r in rows:
        r["speedup"] = 2.0 if r["mode"] == "adaptive" else 1.0
    suite.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_sized_llama_workloads(monkeypatch):
    # llama-train@<hidden>x<layers>: the scaling table's workloads (benchmarks/RESULTS.md)
    from benchmarks import zoo
    from benchmarks.workloads import workload

    model, batch = zoo.build("llama", zoo.sized(8, 3))
    assert model.config.hidden_size == 8 and model.config.num_hidden_layers == 3
    assert model.config.intermediate_size == 8 * 172 // 64
    assert batch["input_ids"].shape == (2, 32)
    loss = workload("llama-train@8x3")("cpu", "issue").step()
    assert math.isfinite(float(loss))
    monkeypatch.setitem(sys.modules, "transformers", None)  # the in-repo model, sized alike
    w = workload("llama-train@8x1")("cpu", "issue")
    assert "in-repo" in w.note and math.isfinite(float(w.step()))
    with pytest.raises(ValueError, match="not divisible by the 4 attention heads"):
        workload("llama-train@6x2")
    with pytest.raises(KeyError):
        workload("llama-train@8")


def _distributed(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "benchmarks.distributed", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_the_distributed_benchmark_runs_a_row():
    pytest.importorskip("transformers")
    r = _distributed("--devices", "cpu", "--steps", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| cpu |")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("| True |"), r.stdout  # losses equal


@pytest.mark.parametrize("args,message", [
    (("--devices", "tpu"), "--devices: 'tpu' is not one of cpu, neuron"),
    (("--launch-us", "ten"), "--launch-us: 'ten' is not a comma-separated list of numbers"),
    (("--steps", "0"), "--steps: 0 is not a positive number of steps"),
])
def test_the_distributed_benchmark_names_a_bad_flag(args, message):
    r = _distributed(*args, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1] == message
