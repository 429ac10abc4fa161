"""The notebook's example as a script: train a small model on the neuron device with a step
that logs its loss and counts active weights, then print what the engine did and why.

    python examples/debugging.py

The README's "Debugging" section shows its output.
"""

import torch

import adaptive_eager as ae
import adaptive_eager.neuron  # noqa: F401 - the neuron device: TorchNeuron's, else the emulator

torch.manual_seed(0)
dev = "neuron"
model = torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(8, 16, device=dev), torch.randn(8, 1, device=dev)


def train_step():
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    if loss.item() > 100:  # a host read of a pending value
        print("diverging")
    active = torch.nonzero(model[0].weight.grad.abs() > 0.01)  # a data-dependent shape
    opt.step()
    opt.zero_grad()
    return loss, active


with ae.enabled(devices=[dev]):
    for step in range(30):
        train_step()
        if step == 9:
            # Graphs compile in the background; until one is ready its path replays the
            # recorded ops exactly. A program never waits for them: this short one does, to
            # show them.
            ae.wait_compiles()

print(ae.explain())
