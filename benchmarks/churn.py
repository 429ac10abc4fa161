"""Shape churn: a training loop whose batch size takes 50 values, and a bucketed one.

    python -m benchmarks.churn [--device cpu] [--backend inductor] [--rounds 6]

``churn``: an MLP training step (AdamW) whose batch size cycles through 50 values in a fixed
shuffled order, ``--rounds`` times over. ``buckets``: the same with 8 sizes; ``one size``:
the step with one size, the engine's cost with no churn. Eager runs the same steps first.
After warm-up (the first three rounds, and the engine's background compiles done), each
size's median step under the engine is set against eager's: the table gives the
worst and the median of those ratios, the fused graphs compiled (at most the variant budget,
NEURON_ADAPTIVE_EAGER_VARIANTS, per family: its last is one graph for every batch size,
Note [Family graphs]), the sizes past the budget that replay exactly, and the trie's nodes
after warm-up and at the end (the same: nothing is relearned). The governor is off: the
engine's own figures. ``--verbose`` adds each size's ratio and the engine's fallbacks.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time


# Rounds of warm-up: the first step differs (AdamW makes its state), the next two make each
# size's path hot and request its compile, which is waited for before the third.
WARM = 3


def _loop(sizes, rounds, device, engine_cfg):
    import contextlib

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import adaptive_eager as ae
    from adaptive_eager.engine import ENGINE

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 16)).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    data = {n: (torch.randn(n, 128).to(device), torch.randint(0, 16, (n,)).to(device))
            for n in sizes}
    times = {n: [] for n in sizes}
    nodes = []
    ctx = ae.enabled(**engine_cfg) if engine_cfg else contextlib.nullcontext()
    with ctx:
        for r in range(rounds):
            if r == WARM and engine_cfg:
                ENGINE.wait_compiles(timeout=600)
                nodes.append(ENGINE.mode().n_nodes)
            for n in sizes:
                x, y = data[n]
                t = time.perf_counter()
                loss = F.cross_entropy(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                loss.item()
                if r >= WARM:
                    times[n].append(time.perf_counter() - t)
        s = ae.stats() if engine_cfg else None
        if engine_cfg:
            nodes.append(ENGINE.mode().n_nodes)
    return {n: statistics.median(v) for n, v in times.items()}, s, nodes


def main(argv=None) -> int:
    os.environ.setdefault("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "0")
    os.environ.setdefault("NEURON_ADAPTIVE_EAGER_RETIRE_RATIO", "0")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "neuron"))
    p.add_argument("--backend", default="inductor", choices=("exact", "inductor"))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--verbose", action="store_true",
                   help="also print each size's ratio and the engine's fallbacks")
    a = p.parse_args(argv)
    import torch

    if a.device == "neuron":
        import adaptive_eager.neuron  # noqa: F401
    torch.set_num_threads(2)
    rng = random.Random(0)
    churn = list(range(8, 8 + 50 * 3, 3))
    rng.shuffle(churn)
    loops = {"churn (50 sizes)": churn, "buckets (8 sizes)": [16, 32, 48, 64, 80, 96, 112, 128],
             "one size": [64] * 8}
    print(f"{a.device}, {a.backend}, {a.rounds} rounds, torch {torch.__version__}")
    print("| loop | eager median step ms | worst size: engine / eager | median size: engine / "
          "eager | graphs compiled | sizes past the budget | trie nodes after warm-up / end |")
    print("|---|---|---|---|---|---|---|")
    for name, sizes in loops.items():
        from adaptive_eager.engine import ENGINE

        eager, _, _ = _loop(sizes, a.rounds, a.device, None)
        ENGINE.reset()
        engine, s, nodes = _loop(sizes, a.rounds, a.device,
                                 dict(devices=(a.device,), backend=a.backend))
        ratios = [engine[n] / eager[n] for n in sizes]
        past = sum(v for k, v in s.fallbacks.items() if "over the variant budget" in k)
        print(f"| {name} | {statistics.median(eager.values()) * 1e3:.2f} | {max(ratios):.2f} | "
              f"{statistics.median(ratios):.2f} | {s.graphs_compiled} | {past} | "
              f"{nodes[0]} / {nodes[-1]} |", flush=True)
        if a.verbose:
            print("  ", " ".join(f"{n}:{r:.2f}" for n, r in zip(sizes, ratios)))
            for k, v in sorted(s.fallbacks.items(), key=lambda kv: -kv[1])[:8]:
                print(f"   {v:6d}  {k}")
        ENGINE.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
