"""A real model on the emulated neuron device: training and generation equal the CPU's."""

from __future__ import annotations

import pytest
import torch

import adaptive_eager.neuron as neuron

pytest.importorskip("transformers")
zoo = pytest.importorskip("benchmarks.zoo")
pytestmark = pytest.mark.skipif(not neuron.is_emulated(), reason="torch-neuronx is installed")


def _losses(device, steps=3):
    model, batch = zoo.build("llama", "issue")  # big enough for the fused CPU kernels
    model.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    step = zoo.train_step(model, batch)
    return [step() for _ in range(steps)], model, batch


def test_llama_trains_bitwise_like_cpu_one_launch_per_op():
    ref, _, _ = _losses("cpu")
    torch.neuron.synchronize()
    before = neuron.counters()
    got, model, batch = _losses("neuron")
    after = neuron.counters()
    assert got == ref
    assert all(p.device.type == "neuron" for p in model.parameters())
    per_step = (after.launches - before.launches) / 3
    assert per_step > 100  # plain eager on the device: one launch per op


def test_llama_generates_the_same_tokens_as_cpu():
    def generate(device):
        model, batch = zoo.build("llama", "tiny")
        model.eval().to(device)
        ids = batch["input_ids"][:1, :4].to(device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        return out.cpu().tolist()

    assert generate("neuron") == generate("cpu")


@pytest.mark.parametrize("name", [m for m in zoo.MODELS if m != "llama"])
def test_zoo_model_trains_bitwise_like_cpu(name):
    """Every model of the zoo: plain eager on the device gives the CPU's losses exactly."""
    def losses(device):
        model, batch = zoo.build(name, "tiny")
        model.to(device)
        batch = {k: v.to(device) for k, v in batch.items()}
        step = zoo.train_step(model, batch)
        return [step() for _ in range(2)]

    assert losses("neuron") == losses("cpu")
