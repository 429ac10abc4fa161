"""Recurring work stays on its hot path whatever Python objects carry it (issue: real models)."""

import torch

import adaptive_eager as ae
from conftest import Delta

CPU = dict(devices=("cpu",), backend="exact")


def test_fresh_constant_reusing_a_dead_temporarys_id_stays_hot():
    # Hugging Face's cache layers start from ``torch.tensor([])`` inside forward: a new object
    # every step, made right after a temporary died, so CPython hands it the dead temporary's
    # id. The hot path must not mistake it for that (dead) segment value.
    x = torch.randn(4)

    def step():
        t = x * 2
        y = t + 1
        del t  # frees the Python object whose id the next tensor gets
        empty = torch.tensor([])
        return torch.cat([empty, y]).sum().item()

    ref = [step() for _ in range(8)]
    with ae.enabled(**CPU):
        got = [step() for _ in range(3)]
        d = Delta()
        got += [step() for _ in range(5)]
    assert got == ref
    assert d.fallbacks.get("diverged from the hot path", 0) == 0
    assert d.replays == 5 and d.launches == 10  # one replay and the `.item()` per step
