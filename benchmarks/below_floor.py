"""What a dispatch key below autograd costs per op, against eager and the Python floor.

Note [Below the floor] (tracer/hot_key.py): stage 2 of the compiled hot path takes hot ops in
C++ kernels on a dispatch key of ours instead of the Python dispatch mode. Before building on
it, this measures the mechanism on ``chain-small``'s ops (64 elementwise ops on 256 floats,
timed without a sync: the ops only), per op, best of repeats:

    eager          the ops run
    python floor   a Python dispatch mode returns a preallocated tensor, runs nothing
    key canned     our unboxed kernel returns a preallocated tensor
    key allocate   our unboxed kernel allocates a fresh output (CPU's empty_strided)
    key boxed      the boxed fallback returns a preallocated tensor (ops with no kernel)
    key hand-back  our kernel runs the op below the key (a diverged op's cost)
    key routed     engaged under the floor's mode: our kernel sends the op to the mode (what
                   the key adds to an op the mode serves)
    key direct     the same, our kernel calling the mode's handler itself, not through the
                   Python key (what the engine does with NEURON_ADAPTIVE_EAGER_HOT_PATH=key)

    python -m benchmarks.below_floor [--grad]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_eager.tracer import hot_key

OPS = 64


def _chain(x):  # ops with a kernel of ours
    for _ in range(OPS // 2):
        x = x * 1.0001
        x = x + 0.5
    return x


def _chain_boxed(x):  # ops without one: the boxed fallback takes them
    for _ in range(OPS // 2):
        x = x - 1.0001
        x = x / 0.5
    return x


class _Floor(TorchDispatchMode):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.out


def _per_op(fn, reps=7, n=200) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best / OPS * 1e6


def measure(grad: bool = False, reps: int = 7, n: int = 200) -> dict[str, float]:
    """Microseconds per op for each way (module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(256, requires_grad=grad)
        out = torch.randn(256)
        ctx = torch.enable_grad() if grad else torch.no_grad()
        res = {}
        with ctx:
            res["eager"] = _per_op(lambda: _chain(x), reps, n)

            def floor():
                with _Floor(out):
                    _chain(x)
            res["python floor"] = _per_op(floor, reps, n)
            for name, action, chain in (("key canned", "canned", _chain),
                                        ("key allocate", "allocate", _chain),
                                        ("key boxed", "canned", _chain_boxed),
                                        ("key hand-back", "hand-back", _chain)):
                def keyed(action=action, chain=chain):
                    with hot_key.switched_on(action, out):
                        chain(x)
                res[name] = _per_op(keyed, reps, n)

            def routed():
                with _Floor(out), hot_key.engaged("route"):
                    _chain(x)
            res["key routed"] = _per_op(routed, reps, n)

            def direct():
                with _Floor(out) as floor, hot_key.engaged("route", floor):
                    _chain(x)
            res["key direct"] = _per_op(direct, reps, n)
    finally:
        torch.set_num_threads(threads)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.below_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grad", action="store_true", help="inputs require grad (autograd records "
                   "each op above the key)")
    a = p.parse_args(argv)
    res = measure(a.grad)
    floor = res["python floor"]
    print(f"chain-small ops{' with autograd' if a.grad else ''}, µs per op (÷ python floor):")
    for name, us in res.items():
        print(f"  {name:14s} {us:6.2f}  ({us / floor:.2f})")


if __name__ == "__main__":
    main()
