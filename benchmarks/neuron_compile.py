"""Compiled mode on the emulated neuron device: the tiny Llama trained with
``torch.compiler.set_default_backend("neuron")`` and ``model.compile()``, beside eager and the
engine.

    python -m benchmarks.neuron_compile [--steps 8] [--launch-us 10]

Trains Hugging Face's Llama (benchmarks/zoo.py, the ``issue`` size: hidden 64, 2 layers) with
AdamW from the same weights and batch three ways on ``neuron``: plain eager, compiled
(``set_default_backend("neuron")`` then ``model.compile()``; the optimizer step stays eager),
and eager under the engine (``NEURON_ADAPTIVE_EAGER``'s default backend). It prints each
way's losses against eager's (largest relative difference) and, per step once warm, the
device's launches (compiled graphs, the engine's graphs and the device's own kernels) and the
median step time, after three steps of warm-up (and, for the engine, its background compiles);
with it the first step's time (the compile, for the compiled way).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

warnings.filterwarnings("ignore")
# the engine's own step is measured, never quietly replaced by eager (as the suite sets it)
os.environ.setdefault("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "0")
os.environ.setdefault("NEURON_ADAPTIVE_EAGER_RETIRE_RATIO", "0")

import torch  # noqa: E402

import adaptive_eager as ae  # noqa: E402
import adaptive_eager.neuron as neuron  # noqa: E402
from adaptive_eager.neuron.compile_backend import LAUNCH_NAME  # noqa: E402
from benchmarks.zoo import build  # noqa: E402


def _train(way: str, steps: int):
    model, batch = build("llama", "issue")
    model.to("neuron")
    batch = {k: v.to("neuron") for k, v in batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if way == "compiled":
        torch.compiler.set_default_backend("neuron")
        model.compile()
    ctx = ae.enabled(devices=("neuron",)) if way == "engine" else _Null()
    losses: list = []
    ext = neuron.native.load()
    first = None

    def step():
        t = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        return time.perf_counter() - t

    with ctx:
        first = step()
        for _ in range(WARM - 1):
            step()
        if way == "engine":  # until its fused graph, compiled in the background, replays
            deadline = time.time() + 600
            while ae.stats().graphs_compiled == 0 and time.time() < deadline:
                step()
            for _ in range(WARM):
                step()
        ext.synchronize()
        before = dict(ext.launches_by_name())
        times = [step() for _ in range(steps)]
        ext.synchronize()
        after = dict(ext.launches_by_name())
        launches = {k: (after.get(k, 0) - before.get(k, 0)) / steps for k in after
                    if after.get(k, 0) != before.get(k, 0)}
    torch.compiler.set_default_backend(None)
    return losses, first, times, launches


WAYS = ("eager", "compiled", "engine")
WARM = 3  # steps before the timed ones (and, for the engine, its compile's)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--launch-us", type=float, default=10.0)
    p.add_argument("--ways", default="eager,compiled,engine",
                   help="comma list of eager, compiled, engine (each in this process, in order)")
    a = p.parse_args(argv)
    ways = a.ways.split(",")
    bad = [w for w in ways if w not in WAYS]
    if bad or "eager" not in ways:
        p.error(f"--ways {a.ways!r}: a comma list of {', '.join(WAYS)} with eager among them")
    if a.steps < 1:
        p.error(f"--steps {a.steps}: at least 1 timed step")
    neuron.ensure()
    neuron.set_launch_latency_us(a.launch_us)
    ways = {w: _train(w, a.steps) for w in ways}
    eager = ways["eager"][0]
    print(f"tiny Llama (hidden 64, 2 layers) on neuron, {a.launch_us:g} us a launch, "
          f"{WARM} + {a.steps} steps, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print()
    print("| way | losses vs eager (max rel) | launches/step (warm) | of them | first step s "
          "| step ms (median, warm) |")
    print("|---|---|---|---|---|---|")
    for way, (losses, first, times, launches) in ways.items():
        rel = max(abs(g - w) / abs(w) for g, w in zip(losses, eager))
        warm = launches
        parts = {LAUNCH_NAME: "compiled graphs", "adaptive_eager graph": "engine graphs"}
        of = ", ".join(f"{n:g} {parts.get(k, 'device kernels')}" for k, n in
                       _grouped(warm, parts).items())
        print(f"| {way} | {rel:.1e} | {sum(warm.values()):g} | {of} | {first:.2f} "
              f"| {statistics.median(times) * 1e3:.2f} |")


def _grouped(launches: dict, named: dict) -> dict:
    out: dict = {}
    for k, n in launches.items():
        key = k if k in named else "kernels"
        out[key] = out.get(key, 0) + n
    return out


if __name__ == "__main__":
    main()
