"""Shared by the emulated-device benchmarks (neuron_*.py): arguments and the timed step."""

from __future__ import annotations

import argparse
import time

import torch

import adaptive_eager.neuron as neuron
from benchmarks.zoo import build


def timed_llama_step(device, size):
    """The zoo's Llama on ``device`` with AdamW; ``step()`` returns (loss, host seconds to
    issue the step, i.e. until ``loss.item()`` waits, and its wall seconds)."""
    model, batch = build("llama", size)
    model.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        issued = time.perf_counter() - t0
        value = loss.item()
        return value, issued, time.perf_counter() - t0

    return step


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--size", default="issue", choices=("issue", "m", "tiny"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--latencies", default="0,10,50")
    return p


def parse(p: argparse.ArgumentParser, argv=None):
    """(arguments, latencies in microseconds); a clear error for a bad value or device."""
    a = p.parse_args(argv)
    try:
        lats = [float(x) for x in a.latencies.split(",")]
        if any(x < 0 for x in lats):
            raise ValueError
    except ValueError:
        p.error(f"--latencies {a.latencies!r} is not valid; accepted: a comma list of "
                "numbers >= 0 (microseconds)")
    if a.steps < 1:
        p.error(f"--steps {a.steps} is not valid; accepted: an integer >= 1")
    if not neuron.is_emulated():
        p.error("torch-neuronx is installed: this benchmark models the emulated device")
    return a, lats
