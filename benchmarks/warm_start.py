"""Warm start (README, Warm start): the same workload in two fresh processes sharing one
warm-start cache; the second run's first 20 steps against eager's median and the engine's
own steady step. Beside it, torch.compile's second run on cpu (its caches filled by the
first): its first step.

    python -m benchmarks.warm_start                       # every workload, cpu and neuron
    python -m benchmarks.warm_start --workloads mlp-train --devices cpu

Each (workload, device) gets a fresh cache directory and a fresh Inductor cache: the first
run is a new user's, the second is that user's next run. The step governor and graph
retirement are off (as in the suite), so the engine's figures are its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

FIRST = 20  # the first steps looked at
STEADY = 40  # steps after them; the steady step is the median of the last 20
WORKLOADS = ("chain-small", "mlp-train", "llama-train", "adam-many", "llama-decode")


def child(workload: str, device: str, mode: str) -> dict:
    warnings.filterwarnings("ignore")
    import torch

    from benchmarks.modes import MODES
    from benchmarks.suite import torch_threads
    from benchmarks.workloads import workload as build

    torch.set_num_threads(torch_threads())
    if device == "neuron":
        import adaptive_eager.neuron as neuron

        neuron.ensure()
    out = {}
    if mode == "adaptive":  # eager first, in the same process (its median is the bar)
        run = MODES["eager"].build(build(workload), device, "issue")
        times = _steps(run, 30)
        out["eager_median_s"] = statistics.median(times[5:])
    t0 = time.perf_counter()
    run = MODES[mode].build(build(workload), device, "issue")  # enables: restores the cache
    out["build_s"] = time.perf_counter() - t0
    times = _steps(run, FIRST + STEADY)
    out.update(first_s=times[:FIRST], steady_s=statistics.median(times[-20:]))
    if mode == "adaptive":
        import adaptive_eager as ae

        s = ae.stats()
        out.update(restored=s.paths_restored, loaded=s.graphs_loaded,
                   compiled=s.graphs_compiled, launches=s.launches)
    return out


def _steps(run, n) -> list:
    times = []
    with run.active():
        for _ in range(n):
            t = time.perf_counter()
            run.step()
            times.append(time.perf_counter() - t)
    return times


def _run(workload, device, mode, env) -> dict:
    p = subprocess.run([sys.executable, "-m", "benchmarks.warm_start", "--child",
                        workload, device, mode], env=env, capture_output=True, text=True,
                       timeout=1200)
    line = next((x for x in p.stdout.splitlines() if x.startswith("{")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"{workload} {device} {mode}: "
                           f"{(p.stderr.strip().splitlines() or ['?'])[-1][:200]}")
    return json.loads(line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.warm_start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--devices", default="cpu,neuron")
    p.add_argument("--launch-us", type=float, default=10.0)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(*a.child)), flush=True)
        return 0
    for d in a.devices.split(","):
        if d not in ("cpu", "neuron"):
            p.error(f"--devices: {d!r} not accepted; accepted: cpu, neuron")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print("| workload | device | run | eager median ms | engine steady ms | slowest of first "
          "20 ms | ÷ max(eager, steady) | step of it | restored / loaded / compiled |")
    print("|---|---|---|---|---|---|---|---|---|")
    for device in a.devices.split(","):
        for wl in a.workloads.split(","):
            tmp = tempfile.mkdtemp(prefix="ae_warm_")
            env = dict(os.environ, NEURON_ADAPTIVE_EAGER_WARM_START="1",
                       NEURON_ADAPTIVE_EAGER_CACHE_DIR=os.path.join(tmp, "warm"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                       NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO="0",
                       NEURON_ADAPTIVE_EAGER_RETIRE_RATIO="0",
                       NEURON_EMULATOR_LAUNCH_US=str(a.launch_us),
                       PYTHONPATH=os.pathsep.join(x for x in (root, os.environ.get(
                           "PYTHONPATH")) if x))
            for run in (1, 2):
                r = _run(wl, device, "adaptive", env)
                bar = max(r["eager_median_s"], r["steady_s"])
                worst = max(r["first_s"])
                print(f"| {wl} | {device} | {run} | {r['eager_median_s'] * 1e3:.2f} "
                      f"| {r['steady_s'] * 1e3:.2f} | {worst * 1e3:.1f} | {worst / bar:.2f} "
                      f"| {r['first_s'].index(worst)} | {r['restored']} / {r['loaded']} / "
                      f"{r['compiled']} |", flush=True)
            if device == "cpu":
                for run in (1, 2):
                    r = _run(wl, device, "torch.compile", env)
                    print(f"| {wl} | cpu | torch.compile {run} | | {r['steady_s'] * 1e3:.2f} "
                          f"| first step {r['first_s'][0] * 1e3:.0f} | | | |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
