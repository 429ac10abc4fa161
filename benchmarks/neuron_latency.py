"""The engine on the emulated neuron device against eager, at several launch latencies.

    python benchmarks/neuron_latency.py [--backend exact] [--size issue] [--steps 10]
                                        [--latencies 0,10,50]

Trains the tiny Hugging Face Llama of benchmarks/zoo.py (2 layers, hidden 64, 4 heads, vocab
256, batch 2 x 32) on ``neuron``: plain eager, and with the engine hot (governor off, so the
figures are the hot path's). For each modelled launch latency it prints per step (medians
over ``--steps``): launches, wall time of eager and of the engine and their ratio (measured in
this one process, one after the other), and for the engine the host's time to *issue* the
step (until the replay is queued, before ``loss.item()`` waits) beside the device's modelled
time to execute it (latency + kernel time of its launches). It also checks that the losses
of every run equal eager's.
"""

from __future__ import annotations

import os
import statistics
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "0")  # the hot path, measured

import torch  # noqa: E402

import adaptive_eager as ae  # noqa: E402
import adaptive_eager.neuron as neuron  # noqa: E402
from benchmarks import emulated  # noqa: E402


def _measure(step, steps):
    rows = []
    for _ in range(steps):
        c0 = neuron.counters()
        value, issued, wall = step()
        c1 = neuron.counters()
        rows.append((value, issued, wall, c1.launches - c0.launches, c1.busy_s - c0.busy_s))
    return rows


def main(argv=None):
    p = emulated.parser(__doc__)
    p.add_argument("--backend", default="exact", choices=("exact", "inductor"))
    a, lats = emulated.parse(p, argv)

    eager_step = emulated.timed_llama_step("neuron", a.size)
    engine_step = emulated.timed_llama_step("neuron", a.size)
    eager_warm = [eager_step()[0] for _ in range(3)]
    with ae.enabled(backend=a.backend, devices=("neuron",)):
        engine_warm = [engine_step()[0] for _ in range(3)]
        if a.backend == "inductor":
            from adaptive_eager.engine import ENGINE

            ENGINE.wait_compiles(timeout=600)
            engine_warm.append(engine_step()[0])
            eager_warm.append(eager_step()[0])
    same = engine_warm == eager_warm if a.backend == "exact" else all(
        abs(x - y) <= 1e-3 * abs(x) for x, y in zip(engine_warm, eager_warm))

    print(f"llama ({a.size}) training step on the emulated neuron device, backend={a.backend}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of "
          f"{a.steps} steps")
    print()
    print("| latency | eager launches | engine launches | eager ms | engine ms | speedup "
          "| engine: host issue ms | engine: device ms | issue / device |")
    print("|---|---|---|---|---|---|---|---|---|")
    for lat in lats:
        neuron.set_launch_latency_us(lat)
        eager = _measure(eager_step, a.steps)
        with ae.enabled(backend=a.backend, devices=("neuron",)):
            engine = _measure(engine_step, a.steps)
        med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
        e_ms, g_ms = med(eager, 2) * 1e3, med(engine, 2) * 1e3
        issue, device = med(engine, 1) * 1e3, med(engine, 4) * 1e3
        print(f"| {lat:g} us | {med(eager, 3):g} | {med(engine, 3):g} | {e_ms:.2f} | "
              f"{g_ms:.2f} | {e_ms / g_ms:.2f}x | {issue:.2f} | {device:.2f} | "
              f"{issue / device:.2f} |")
        same = same and all(
            (x[0] == y[0]) if a.backend == "exact" else abs(x[0] - y[0]) <= 1e-3 * abs(x[0])
            for x, y in zip(eager, engine))
    print()
    print(f"losses: engine {'equal to' if same else 'DIFFER from'} eager "
          f"({'bitwise' if a.backend == 'exact' else 'within 1e-3 relative'})")
    print(f"engine: {ae.stats().replays} replays, fallbacks {dict(ae.stats().fallbacks)}")


if __name__ == "__main__":
    main()
