"""Memory over a long run: a small MLP training loop, plain eager against the engine.

    python -m benchmarks.memory [--steps 10000] [--devices cpu,neuron] [--backend exact]

Each row is one fresh process per mode (so that peaks are each its own): the resident set
(RSS, from ``/proc/self/statm``) after ``--from`` steps and after the last, its growth
between them, the peak RSS (``ru_maxrss``), the live tensors at both points, and for the
engine the trie's nodes and the graphs it made (exact replays included) at both. The
engine's own figures must stay flat once it is hot; its peak is set against eager's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(device: str, backend: str | None, steps: int, frm: int) -> dict:
    os.environ.setdefault("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "0")
    os.environ.setdefault("NEURON_ADAPTIVE_EAGER_RETIRE_RATIO", "0")
    import contextlib
    import gc
    import resource

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import adaptive_eager as ae

    if device == "neuron":
        import adaptive_eager.neuron  # noqa: F401
    from adaptive_eager.engine import ENGINE

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(32, 64).to(device)
    y = torch.randint(0, 10, (32,)).to(device)

    def mark():
        gc.collect()
        mode = ENGINE.mode()
        return dict(rss=_rss(),
                    tensors=sum(1 for o in gc.get_objects() if type(o) in (torch.Tensor,
                                                                          nn.Parameter)),
                    nodes=mode.n_nodes if mode else None,
                    graphs=ae.stats().graphs_compiled if mode else None)

    marks = {}
    engine = (ae.enabled(devices=(device,), backend=backend) if backend
              else contextlib.nullcontext())
    with engine:
        for i in range(1, steps + 1):
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()
            if i in (frm, steps):
                marks[i] = mark()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(marks=marks, peak=peak)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--from", dest="frm", type=int, default=500,
                   help="growth is measured from this step on")
    p.add_argument("--devices", default="cpu,neuron")
    p.add_argument("--backend", default="exact", choices=("exact", "inductor"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        device, backend = a.child.split(":")
        print(json.dumps(_child(device, None if backend == "eager" else backend, a.steps,
                                a.frm)))
        return 0
    print(f"| device | mode | RSS at step {a.frm} MiB | RSS at step {a.steps} MiB | growth | "
          "peak MiB | peak / eager's | live tensors | trie nodes | graphs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for device in a.devices.split(","):
        peaks = {}
        for mode in ("eager", a.backend):
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.memory", "--child", f"{device}:{mode}",
                 "--steps", str(a.steps), "--from", str(a.frm)],
                capture_output=True, text=True, cwd=ROOT, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            first, last = r["marks"][str(a.frm)], r["marks"][str(a.steps)]
            peaks[mode] = r["peak"]
            growth = 100 * (last["rss"] - first["rss"]) / first["rss"]
            ratio = r["peak"] / peaks["eager"]

            def both(k):
                return "-" if first[k] is None else f"{first[k]} / {last[k]}"
            print(f"| {device} | {mode} | {first['rss'] / 2**20:.1f} | {last['rss'] / 2**20:.1f}"
                  f" | {growth:+.2f} % | {r['peak'] / 2**20:.1f} | {ratio:.2f} | "
                  f"{both('tensors')} | {both('nodes') if mode != 'eager' else '-'} | "
                  f"{both('graphs') if mode != 'eager' else '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
