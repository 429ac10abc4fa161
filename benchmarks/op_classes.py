"""Eager host cost per op class on the emulated neuron device against cpu.

    python benchmarks/op_classes.py [--iters 20000] [--repeats 5]

For each class (elementwise, view, matmul, reduction, factory) it times a loop of one small
op on ``cpu`` and on ``neuron`` (latency 0: the cost measured is the host's and the
emulator's, not the modelled device's), each loop ending with a sync, and prints the median
microseconds per op over ``--repeats`` rounds and the ratio neuron / cpu. Each round of each
device runs in a fresh process of its own, on its main thread, as a user's script would
(PyTorch's OpenMP thread teams are per calling thread and share the machine's cores: a cpu
loop in the process that also runs the device's worker measures both), and the rounds
alternate between the devices. Which emulated device runs is ``NEURON_EMULATOR_IMPL`` (``cpp``
or ``python``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import adaptive_eager.neuron as neuron  # noqa: E402

# class -> (setup(device) -> state, one op on the state)
CLASSES = {
    "elementwise": (lambda d: torch.ones(64, 64, device=d), lambda x: x.mul(1.0)),
    "view": (lambda d: torch.ones(64, 64, device=d), lambda x: x.view(4096)),
    "matmul": (lambda d: torch.ones(64, 64, device=d), lambda x: x @ x),
    "reduction": (lambda d: torch.ones(64, 64, device=d), lambda x: x.sum(0)),
    "factory": (lambda d: d, lambda d: torch.zeros(64, 64, device=d)),
}


def _sync(device: str) -> None:
    if device == "neuron":
        torch.neuron.synchronize()


def time_class(name: str, device: str, iters: int) -> tuple:
    """(wall us per op, device kernel us per launch: the worker's time running it, 0 on cpu)."""
    setup, op = CLASSES[name]
    state = setup(device)
    for _ in range(50):
        op(state)
    _sync(device)
    if device == "neuron":
        neuron.reset_counters()
    start = time.perf_counter()
    for _ in range(iters):
        op(state)
    _sync(device)
    wall = (time.perf_counter() - start) / iters * 1e6
    kernel = 0.0
    if device == "neuron":
        c = neuron.counters()
        kernel = c.kernel_s / max(c.launches, 1) * 1e6
    return wall, kernel


def _round(device: str, iters: int) -> dict:
    """One round of every class on ``device``, in a fresh process: class -> us per op."""
    import json
    import subprocess

    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
            "from benchmarks import op_classes as b; "
            "print(json.dumps(b.one_round(sys.argv[2], int(sys.argv[3]))))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, root, device, str(iters)],
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_round(device: str, iters: int) -> dict:
    if device == "neuron":
        neuron.set_launch_latency_us(0)
    return {name: time_class(name, device, iters) for name in CLASSES}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20000)  # 2,000: too short to be steady
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    impl = "cpp" if neuron.is_native() else "python"
    print(f"eager host cost per op (us, median of {args.repeats}), neuron device: {impl}, "
          f"intra-op threads: {torch.get_num_threads()}, a process per device and round")
    got = {"cpu": [], "neuron": []}
    for _ in range(args.repeats):
        for device in got:
            got[device].append(_round(device, args.iters))
    print("kernel: the device worker's time per launch of the op (a view launches nothing)")
    print(f"{'class':<12} {'cpu':>8} {'neuron':>8} {'ratio':>6}  {'spread (neuron)':<16} "
          f"{'kernel':>7}")
    for name in CLASSES:
        cpu = statistics.median(r[name][0] for r in got["cpu"])
        devs = [r[name][0] for r in got["neuron"]]
        dev = statistics.median(devs)
        kernel = statistics.median(r[name][1] for r in got["neuron"])
        spread = f"{min(devs):.2f}-{max(devs):.2f}"
        print(f"{name:<12} {cpu:8.2f} {dev:8.2f} {dev / cpu:6.2f}  {spread:<16} {kernel:7.2f}")


if __name__ == "__main__":
    main()
