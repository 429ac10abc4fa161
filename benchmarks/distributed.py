"""FSDP2 training of the tiny Llama on 2 ranks, the engine against eager.

    python -m benchmarks.distributed [--devices cpu,neuron] [--launch-us 10,50] [--steps 10]
                                     [--backend exact]

Each configuration (a device, and on neuron a modelled launch latency) starts 2 ranks on
loopback (``torch.multiprocessing``, a free port; gloo, over the device's memory on neuron).
Each rank builds the tiny Llama of ``benchmarks/zoo.py`` (2 layers, hidden 64), shards each
decoder layer and then the model with ``fully_shard``, and trains it with AdamW, its own batch
per rank: plainly, then under the engine (governor off: the hot path's figures), each after
warm-up. Rank 0 prints a row per configuration: the median step of each (wall time, including
``loss.item()``), their ratio, the aten ops of a step, the engine's launches per step, and on
neuron the device's launches per step in each mode; and whether the losses equal eager's
(``exact``: bitwise).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEVICES = ("cpu", "neuron")
WARMUP = 8


def _rank(rank, world, port, device, backend, steps, out):
    os.environ.setdefault("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "0")
    os.environ.setdefault("NEURON_ADAPTIVE_EAGER_RETIRE_RATIO", "0")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import adaptive_eager as ae
    from benchmarks import zoo

    counters = None
    if device == "neuron":
        import adaptive_eager.neuron as neuron

        counters = neuron.counters
    dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)

    def run(engine):
        model, batch = zoo.build("llama", "issue", seed=0)
        model = model.to(device)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        g = torch.Generator().manual_seed(100 + rank)
        ids = torch.randint(0, model.config.vocab_size, batch["input_ids"].shape, generator=g)
        batch = dict(input_ids=ids.to(device), labels=ids.to(device))
        step = zoo.train_step(model, batch)
        ctx = ae.enabled(devices=(device,), backend=backend) if engine else contextlib.nullcontext()
        losses, times, launches, ops, dev = [], [], [], [], []
        with ctx:
            for i in range(WARMUP + steps):
                if engine and i == 3 and backend == "inductor":
                    ae.wait_compiles(600)
                s0 = ae.stats() if engine else None
                c0 = counters() if counters else None
                t = time.perf_counter()
                losses.append(step())
                times.append(time.perf_counter() - t)
                if i >= WARMUP:
                    if engine:
                        s1 = ae.stats()
                        launches.append(s1.launches - s0.launches)
                        ops.append(s1.ops_intercepted - s0.ops_intercepted)
                    if counters:
                        dev.append(counters().launches - c0.launches)
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        return dict(losses=losses, step=med(times[WARMUP:]), launches=med(launches),
                    ops=med(ops), device_launches=med(dev))

    try:
        eager = run(False)
        engine = run(True)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(dict(eager=eager, engine=engine), f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _configuration(device, latency, backend, steps) -> dict:
    import torch.multiprocessing as mp

    if latency is not None:
        os.environ["NEURON_EMULATOR_LAUNCH_US"] = str(latency)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        mp.start_processes(_rank, args=(2, _free_port(), device, backend, steps, out),
                           nprocs=2, join=True, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def _numbers(text: str, what: str) -> list:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"--{what}: {text!r} is not a comma-separated list of numbers") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="cpu,neuron")
    p.add_argument("--launch-us", default="10,50")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--backend", default="exact", choices=("exact", "inductor"))
    a = p.parse_args(argv)
    devices = [d for d in a.devices.split(",") if d]
    bad = [d for d in devices if d not in DEVICES]
    if bad:
        raise SystemExit(f"--devices: {bad[0]!r} is not one of {', '.join(DEVICES)}")
    if a.steps < 1:
        raise SystemExit(f"--steps: {a.steps} is not a positive number of steps")
    lats = _numbers(a.launch_us, "launch-us")

    import torch

    print(f"FSDP2, tiny Llama, 2 ranks on loopback, backend={a.backend}, torch "
          f"{torch.__version__}; medians of {a.steps} steps after {WARMUP} of warm-up")
    print()
    print("| device | latency | eager ms | engine ms | speedup | ops/step | engine launches/step "
          "| device launches/step eager / engine | losses equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for device in devices:
        for lat in (lats if device == "neuron" else [None]):
            r = _configuration(device, None if lat is None else f"{lat:g}", a.backend, a.steps)
            e, g = r["eager"], r["engine"]
            if a.backend == "exact":
                same = e["losses"] == g["losses"]
            else:
                same = all(abs(x - y) <= 1e-3 * abs(x) for x, y in zip(e["losses"], g["losses"]))
            dev = (f"{e['device_launches']:g} / {g['device_launches']:g}"
                   if e["device_launches"] is not None else "-")
            print(f"| {device} | {'-' if lat is None else f'{lat:g} us'} | "
                  f"{e['step'] * 1e3:.2f} | {g['step'] * 1e3:.2f} | {e['step'] / g['step']:.2f}x "
                  f"| {g['ops']:g} | {g['launches']:g} | {dev} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
