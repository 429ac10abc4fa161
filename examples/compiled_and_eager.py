"""A compiled model with eager code around it, on the neuron device, under the engine.

    NEURON_ADAPTIVE_EAGER=1 python examples/compiled_and_eager.py

The model's forward is compiled (``set_default_backend("neuron")`` then ``model.compile()``:
one launch a graph); the loss, backward's eager parts, gradient clipping and the optimizer are
eager code, which the engine learns and replays. The script trains the same model from the
same weights with the engine off in a process of its own, compares the losses, and prints
where each step's launches came from.
"""

import os
import subprocess
import sys

import torch

import adaptive_eager as ae
import adaptive_eager.neuron as neuron

STEPS = 12


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def train() -> list:
    torch.manual_seed(0)
    model = Block().to("neuron")
    torch.compiler.set_default_backend("neuron")
    model.compile()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 32).to("neuron"), torch.randn(16, 8).to("neuron")
    ext = neuron.native.load()
    losses = []
    for step in range(STEPS):
        ext.synchronize()
        before = dict(ext.launches_by_name())
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ext.synchronize()
        after = dict(ext.launches_by_name())
        spent = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        if step in (0, 1, STEPS - 1):
            compiled = spent.pop("torch.compile graph", 0)
            engine = spent.pop("adaptive_eager graph", 0)
            print(f"step {step}: loss {losses[-1]:.6f}; launches: {compiled} compiled graphs, "
                  f"{engine} engine graphs, {sum(spent.values())} device kernels")
    return losses


if __name__ == "__main__":
    if sys.argv[1:] == ["--losses"]:  # the reference run, engine off
        print(" ".join(repr(v) for v in train()))
        sys.exit()
    env = {k: v for k, v in os.environ.items() if k != "NEURON_ADAPTIVE_EAGER"}
    ref = subprocess.run([sys.executable, __file__, "--losses"], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    want = [float(v) for v in ref[-STEPS:]]
    print(f"engine on: {ae.is_enabled()}")
    got = train()
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    print(f"losses against eager's (engine off): largest relative difference {worst:.1e}")
    s = ae.stats()
    print(f"engine: {s.replays} replays, {s.launches} launches, {s.graphs_compiled} graphs "
          "compiled")
