"""Launch-overhead benchmark: a 64-op elementwise chain followed by ``.item()``, repeated.

    python benchmarks/chain.py [--sizes 256,1048576] [--backend inductor] [--repeat 10]

For each size it times plain eager, then the same loop under the engine once its graph is hot
(background compile waited for, outside the timing), and prints both and their ratio. Both
are measured in this one process, interleaved, best of several rounds: timings on a shared
machine vary by tens of percent, ratios measured together much less.

On the CPU device each eager op is a kernel launch of a few microseconds, so a tiny tensor
shows the engine's per-op host cost (its floor is the dispatcher's own cost of reaching a
Python mode, DESIGN §11: no dispatch mode beats eager there) and a large one shows what fusing
64 memory-bound kernels into one saves.
"""

from __future__ import annotations

import argparse
import time

import torch

import adaptive_eager as ae
from adaptive_eager.engine import ENGINE


def chain(x):
    for _ in range(32):
        x = x * 1.0001
        x = x + 0.5
    return x


def step(x):
    return chain(x).sum().item()


def best_ms(x, n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            step(x)
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e3


def measure(size: int, backend: str, n: int, rounds: int) -> dict:
    x = torch.randn(size)
    for _ in range(3):
        step(x)  # warm the allocator and the kernels
    ae.reset()
    with ae.enabled(devices=("cpu",), backend=backend):
        for _ in range(3):
            step(x)
        ENGINE.wait_compiles(timeout=300)
        for _ in range(3):
            step(x)
        before = ae.stats()
        eager = adaptive = float("inf")
        for _ in range(rounds):  # interleaved: both see the same machine state
            ae.disable()
            eager = min(eager, best_ms(x, n, 1))
            ae.enable(devices=("cpu",), backend=backend)
            adaptive = min(adaptive, best_ms(x, n, 1))
        after = ae.stats()
    runs = n * rounds
    return dict(
        size=size, eager=eager, adaptive=adaptive, speedup=eager / adaptive,
        launches=(after.launches - before.launches) / runs,
        hits=after.cache_hits - before.cache_hits, runs=runs,
        fallbacks={k: v - before.fallbacks.get(k, 0) for k, v in after.fallbacks.items()
                   if v != before.fallbacks.get(k, 0)},
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256,1048576", help="comma list of tensor sizes")
    p.add_argument("--backend", default="inductor", choices=("inductor", "exact"))
    p.add_argument("--repeat", type=int, default=10, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (best is kept)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"64-op chain + .item(), backend={args.backend}, torch {torch.__version__}, "
          f"{args.threads} threads")
    print(f"{'size':>9}  {'eager ms':>9}  {'adaptive ms':>11}  {'speedup':>7}  "
          f"{'launches/step':>13}  fused hits")
    for size in (int(s) for s in args.sizes.split(",")):
        r = measure(size, args.backend, args.repeat, args.rounds)
        print(f"{r['size']:>9}  {r['eager']:>9.3f}  {r['adaptive']:>11.3f}  "
              f"{r['speedup']:>6.2f}x  {r['launches']:>13.1f}  {r['hits']}/{r['runs']}"
              + (f"  fallbacks: {r['fallbacks']}" if r["fallbacks"] else ""))


if __name__ == "__main__":
    main()
