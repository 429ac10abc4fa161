"""A real model on the emulated neuron device, plain eager: equal to the CPU, and the launch model.

    python benchmarks/neuron_device.py [--size issue] [--steps 10] [--latencies 0,10,50]

Trains the tiny Hugging Face Llama of benchmarks/zoo.py on ``neuron`` and on ``cpu`` from the
same weights and batch and checks that the losses and the greedy tokens of ``generate`` are
equal. Then, for each modelled launch latency, it times ``--steps`` training steps on the
device and prints per step: launches, the wall time, launches x latency (the floor the
device model must respect), the device's modelled busy time (latency + kernel time per
launch, from ``adaptive_eager.neuron.counters()``), its kernels' time alone (what the
worker spent running them), and the host's time to issue the step (forward, backward and
optimizer, before ``loss.item()`` waits for the device); then the same step on cpu, timed in
a process of its own.
"""

from __future__ import annotations

import os
import statistics
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import adaptive_eager.neuron as neuron  # noqa: E402
from benchmarks import emulated  # noqa: E402
from benchmarks.zoo import build  # noqa: E402


def _generate(device, size):
    model, batch = build("llama", size)
    model.eval().to(device)
    with torch.no_grad():
        out = model.generate(batch["input_ids"][:1, :8].to(device), max_new_tokens=16,
                             do_sample=False, pad_token_id=0)
    return out.cpu().tolist()


def main(argv=None):
    p = emulated.parser(__doc__)
    a, lats = emulated.parse(p, argv)

    cpu = emulated.timed_llama_step("cpu", a.size)
    dev = emulated.timed_llama_step("neuron", a.size)
    ref = [cpu()[0] for _ in range(3)]
    got = [dev()[0] for _ in range(3)]
    tokens_equal = _generate("neuron", a.size) == _generate("cpu", a.size)
    print(f"llama ({a.size}) on neuron vs cpu: losses {'equal' if got == ref else 'DIFFER'} "
          f"over 3 steps ({got[-1]:.6f}); generate(16 tokens) "
          f"{'equal' if tokens_equal else 'DIFFERS'}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.steps} steps per "
          "row, medians per step")
    print()
    print("| latency | launches/step | wall ms | launches x latency ms | device busy ms "
          "| device kernels ms | host issue ms |")
    print("|---|---|---|---|---|---|---|")
    for lat in lats:
        neuron.set_launch_latency_us(lat)
        dev()
        walls, issues, launches, busy, kernels = [], [], [], [], []
        for _ in range(a.steps):
            c0 = neuron.counters()
            _, issued, wall = dev()
            c1 = neuron.counters()
            walls.append(wall)
            issues.append(issued)
            launches.append(c1.launches - c0.launches)
            busy.append(c1.busy_s - c0.busy_s)
            kernels.append(c1.kernel_s - c0.kernel_s)
        n = statistics.median(launches)
        floor = n * lat * 1e-3
        wall = statistics.median(walls) * 1e3
        honest = all(w * 1e3 >= k * lat * 1e-3 for w, k in zip(walls, launches))
        print(f"| {lat:g} us | {n:g} | {wall:.2f} | {floor:.2f} | "
              f"{statistics.median(busy) * 1e3:.2f} | {statistics.median(kernels) * 1e3:.2f} | "
              f"{statistics.median(issues) * 1e3:.2f} |"
              + ("" if honest else "  WALL BELOW FLOOR"))
    print()
    print(f"the same step on cpu, plain eager, on the main thread of a process of its own: "
          f"{_cpu_step_ms(a.size, a.steps):.2f} ms")


def _cpu_step_ms(size: str, steps: int) -> float:
    """The cpu step's median wall time, timed in a fresh process (PyTorch's OpenMP team
    belongs to the calling thread, and the device's worker would share the cores with it)."""
    import json
    import subprocess

    code = ("import json, statistics, sys; sys.path.insert(0, sys.argv[1]); "
            "from benchmarks import emulated; "
            "step = emulated.timed_llama_step('cpu', sys.argv[2]); "
            "[step() for _ in range(3)]; "
            "print(json.dumps(statistics.median(step()[2] for _ in range(int(sys.argv[3])))))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, root, size, str(steps)],
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1]) * 1e3


if __name__ == "__main__":
    main()
