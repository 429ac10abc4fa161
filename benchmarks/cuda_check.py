"""The one short check to run the day a CUDA device is lent (a few minutes).

    python benchmarks/cuda_check.py

Trains a small MLP and, when transformers is installed, a tiny Hugging Face Llama (the
``issue`` size of ``benchmarks/zoo.py``) on cuda in plain eager and with the engine (exact,
then inductor). For each it prints: losses equal (exact: bitwise; inductor: within 1e-3
relative), replays and launches per hot step, CUDA kernels per hot step (from
``torch.profiler``), and the hot step's time against eager. Then runs
tests/test_cuda_queue.py (a replay under a side stream, ordered as eager). Exits non-zero
when a check fails.
"""

from __future__ import annotations

import importlib.util
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


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.LayerNorm(1024),
                          nn.Linear(1024, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 256, device="cuda"), torch.randn(32, 256, device="cuda")

    def step():
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def llama():
    from benchmarks import zoo

    model, batch = zoo.build("llama", "issue")
    model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    return zoo.train_step(model, batch)


def kernels(step) -> int:
    """CUDA kernels one call of ``step`` runs, as the profiler sees them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def train(make, backend, steps=30):
    step = make()
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
            losses.append(step())
            times.append(time.perf_counter() - t)
            launches.append(ae.stats().launches - a)
        n_kernels = kernels(step)
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
    return losses, sorted(times[-10:])[5], launches[-1], n_kernels


def check(name, make) -> bool:
    ok = True
    eager, t_eager, _, k_eager = train(make, None)
    print(f"{name} eager: {k_eager} CUDA kernels/step; step {t_eager * 1e3:.2f} ms", flush=True)
    for backend in ("exact", "inductor"):
        try:
            got, t, launches, k = train(make, backend)
        except Exception as e:  # report and go on to the next check
            print(f"{name} {backend}: FAILED {type(e).__name__}: {e}", flush=True)
            ok = False
            continue
        same = got == eager if backend == "exact" else all(
            abs(a - b) <= 1e-3 * abs(a) for a, b in zip(eager, got))
        ok &= same
        worst = max(abs(a - b) for a, b in zip(eager, got))
        print(f"{name} {backend}: losses {'equal' if same else 'DIFFER'} (largest difference "
              f"{worst:.3g}); {launches} launches/hot step; {k} CUDA kernels/step; "
              f"step {t * 1e3:.2f} ms vs eager {t_eager * 1e3:.2f} ms ({t_eager / t:.2f}x)",
              flush=True)
    return ok


def main():
    if not torch.cuda.is_available():
        sys.exit("cuda_check: no CUDA device here")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    ok = check("mlp", mlp)
    if importlib.util.find_spec("transformers") is None:
        print("llama: skipped (transformers is not installed)")
    else:
        ok &= check("llama", llama)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_cuda_queue.py"],
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ok &= r.returncode == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
