"""Eager host cost per op class on the emulated neuron device against cpu.

    python benchmarks/op_classes.py [--iters 2000] [--repeats 5]

For each class (elementwise, view, matmul, reduction, factory) it times a loop of one small
op on ``cpu`` and on ``neuron`` (latency 0: the cost measured is the host's and the
emulator's, not the modelled device's), each loop ending with a sync, and prints the median
microseconds per op over ``--repeats`` rounds (rounds interleaved across devices) and the
ratio neuron / cpu. Which emulated device runs is ``NEURON_EMULATOR_IMPL`` (``python`` or
``cpp``).
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


def time_class(name: str, device: str, iters: int) -> float:
    setup, op = CLASSES[name]
    state = setup(device)
    for _ in range(50):
        op(state)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        op(state)
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    neuron.set_launch_latency_us(0)
    impl = "cpp" if neuron.is_native() else "python"
    print(f"eager host cost per op (us, median of {args.repeats}), neuron device: {impl}, "
          f"intra-op threads: {torch.get_num_threads()}")
    print(f"{'class':<12} {'cpu':>8} {'neuron':>8} {'ratio':>6}  spread (neuron, min-max)")
    for name in CLASSES:
        got = {"cpu": [], "neuron": []}
        for _ in range(args.repeats):
            for device in got:
                got[device].append(time_class(name, device, args.iters))
        cpu, dev = statistics.median(got["cpu"]), statistics.median(got["neuron"])
        print(f"{name:<12} {cpu:8.2f} {dev:8.2f} {dev / cpu:6.2f}  "
              f"{min(got['neuron']):.2f}-{max(got['neuron']):.2f}")


if __name__ == "__main__":
    main()
