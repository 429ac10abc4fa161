"""The one short check to run the day a CUDA device is lent (about a minute).

    python benchmarks/cuda_check.py

Trains a small MLP on cuda in plain eager and with the engine (exact, then inductor) and
prints: losses equal (exact: bitwise; inductor: within 1e-3 relative), replays and launches
per hot step, the hot step's time against eager, and a replay issued under a side stream
ordered by an event. Exits non-zero when a check fails. Also runs tests/test_cuda_queue.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "0")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import adaptive_eager as ae  # noqa: E402


def train(backend, steps=30):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.LayerNorm(1024),
                          nn.Linear(1024, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 256, device="cuda"), torch.randn(32, 256, device="cuda")
    losses, times, launches = [], [], []
    ctx = ae.enabled(devices=("cuda",), backend=backend) if backend else None
    if ctx:
        ctx.__enter__()
    try:
        for i in range(steps):
            if backend == "inductor" and i == 5:
                from adaptive_eager.engine import ENGINE

                ENGINE.wait_compiles(timeout=600)
            torch.cuda.synchronize()
            a, t = ae.stats().launches, time.perf_counter()
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            times.append(time.perf_counter() - t)
            launches.append(ae.stats().launches - a)
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
    return losses, sorted(times[-10:])[5], launches[-1]


def main():
    if not torch.cuda.is_available():
        sys.exit("cuda_check: no CUDA device here")
    ok = True
    eager, t_eager, _ = train(None)
    for backend in ("exact", "inductor"):
        got, t, launches = train(backend)
        same = got == eager if backend == "exact" else all(
            abs(a - b) <= 1e-3 * abs(a) for a, b in zip(eager, got))
        ok &= same
        print(f"{backend}: losses {'equal' if same else 'DIFFER'}; {launches} launches/hot step; "
              f"step {t * 1e3:.2f} ms vs eager {t_eager * 1e3:.2f} ms ({t_eager / t:.2f}x)")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_cuda_queue.py"],
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ok &= r.returncode == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
