"""An nn zoo beyond transformers: training loops under the engine against eager.

    python -m tests.fidelity.zoo --devices cpu,neuron --backends exact,inductor

Note [The zoo]: each entry is a small training loop written as a user writes one, using a
part of PyTorch the transformer tests do not: BatchNorm's running statistics (in-place
buffer updates) with ``train()``/``eval()`` switched inside the loop, recurrent layers,
``EmbeddingBag``, ``scaled_dot_product_attention`` with a mask and dropout, FlexAttention,
gradient clipping, gradient accumulation over micro-batches, activation checkpointing,
hooks that read values, ``GradScaler`` with float16 autocast (its inf checks are host reads),
``torch.func.grad``/``vmap`` inside a step, and parameters replaced mid-run
(``load_state_dict``, ``torch.utils.swap_tensors``). A loop runs ``STEPS`` steps in plain
eager and again under the engine from the same seed; every step's observed values (losses,
what hooks read) and the final parameters, buffers and optimizer state are compared:
``exact`` bitwise, a fused backend within 1e-3 relative. Where an entry cannot run on a
device in plain eager, it says so (``Unsupported``) and is skipped there, not judged.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

os.environ["NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO"] = "0"
os.environ["NEURON_ADAPTIVE_EAGER_RETIRE_RATIO"] = "0"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from adaptive_eager.engine import ENGINE  # noqa: E402

from .compare import compare  # noqa: E402

__all__ = ["ENTRIES", "run", "check", "Unsupported", "STEPS"]

STEPS = 20


class Unsupported(Exception):
    """Plain eager cannot run this entry on this device."""


def _data(device, *shape, kind="randn", high=None):
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    x = (torch.randint(0, high, shape, generator=g) if kind == "int"
         else torch.randn(shape, generator=g))
    return x.to(device)


# ------------------------------------------------------------------------- entries
# Each builds its loop on a device: (what to compare at the end, modules and optimizers;
# step(i), which runs step i and returns the values it observed).

def convbn(device):
    """Conv + BatchNorm, switching to eval() for a validation forward every 5th step."""
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    x, y = _data(device, 4, 3, 8, 8), _data(device, 4, kind="int", high=4)

    def step(i):
        if i % 5 == 4:
            m.eval()
            with torch.no_grad():
                v = F.cross_entropy(m(x), y).item()
            m.train()
            return [v]
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [loss.item()]
    return (m, opt), step


def _recurrent(kind, device):
    rnn = getattr(nn, kind)(6, 12, batch_first=True).to(device)
    head = nn.Linear(12, 3).to(device)
    params = list(rnn.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    x, y = _data(device, 2, 5, 6), _data(device, 2, 3)

    def step(i):
        out, _ = rnn(x)
        loss = F.mse_loss(head(out[:, -1]), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [loss.item()]
    return (rnn, head, opt), step


def lstm(device):
    """nn.LSTM + a linear head."""
    return _recurrent("LSTM", device)


def gru(device):
    """nn.GRU + a linear head."""
    return _recurrent("GRU", device)


def embedding_bag(device):
    """EmbeddingBag (mean over bags given by offsets) + a linear head."""
    bag = nn.EmbeddingBag(40, 8, mode="mean").to(device)
    head = nn.Linear(8, 2).to(device)
    opt = torch.optim.AdamW(list(bag.parameters()) + list(head.parameters()), lr=1e-2)
    ids = _data(device, 12, kind="int", high=40)
    offsets = torch.tensor([0, 3, 7, 9], device=device)
    y = _data(device, 4, kind="int", high=2)

    def step(i):
        loss = F.cross_entropy(head(bag(ids, offsets)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [loss.item()]
    return (bag, head, opt), step


def sdpa(device):
    """scaled_dot_product_attention with a boolean mask and dropout."""
    qkv = nn.Linear(16, 48).to(device)
    # SGD: the keys' bias has a gradient of exactly zero in exact arithmetic (softmax does not
    # change when every key moves alike), so in float32 it is rounding noise, which Adam
    # scales up to full-size steps: with AdamW a fused backend's noise differed from eager's
    # by 2.6e-3 there after 20 steps
    opt = torch.optim.SGD(qkv.parameters(), lr=0.1)
    x = _data(device, 2, 6, 16)
    mask = torch.ones(6, 6, dtype=torch.bool).tril().to(device)

    def step(i):
        q, k, v = qkv(x).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
        loss = out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [loss.item()]
    return (qkv, opt), step


def flex_attention(device):
    """FlexAttention (its eager implementation) with a causal score_mod, forward only (it
    has no backward on the CPU): an inference loop whose input moves each step."""
    try:
        from torch.nn.attention.flex_attention import flex_attention as flex
    except ImportError as e:
        raise Unsupported(str(e)) from e
    qkv = nn.Linear(16, 48).to(device)
    x = _data(device, 1, 8, 16)

    def causal(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, -float("inf"))

    probe = torch.zeros(1, 1, 8, 8, device=device)
    try:  # plain eager refuses some devices (the neuron device among them)
        flex(probe, probe, probe)
    except ValueError as e:
        raise Unsupported(f"{type(e).__name__}: {str(e).splitlines()[0]}") from e

    @torch.no_grad()
    def step(i):
        q, k, v = qkv(x).view(1, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = flex(q, k, v, score_mod=causal)
        x.add_(out.transpose(1, 2).reshape(1, 8, 16) * 0.1)
        return [out.sum().item()]
    return (qkv,), step


def _mlp(device):
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)).to(device)


def clip(device):
    """Gradient clipping by total norm before each step."""
    m = _mlp(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    x, y = _data(device, 16, 8), _data(device, 16, 4)

    def step(i):
        loss = F.mse_loss(m(x), y)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
        opt.step()
        return [loss.item(), norm.item()]
    return (m, opt), step


def accumulate(device):
    """Gradient accumulation: four micro-batches per optimizer step."""
    m = _mlp(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x, y = _data(device, 16, 8), _data(device, 16, 4)

    def step(i):
        out = []
        for j in range(4):
            loss = F.mse_loss(m(x[4 * j:4 * j + 4]), y[4 * j:4 * j + 4]) / 4
            loss.backward()
            out.append(loss.item())
        opt.step()
        opt.zero_grad()
        return out
    return (m, opt), step


def checkpoint(device):
    """Activation checkpointing (non-reentrant) of the hidden block."""
    from torch.utils.checkpoint import checkpoint as ckpt

    a, b = nn.Linear(8, 32).to(device), nn.Linear(32, 32).to(device)
    c = nn.Linear(32, 4).to(device)
    params = [p for mod in (a, b, c) for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    x, y = _data(device, 16, 8), _data(device, 16, 4)

    def block(h):
        return F.gelu(b(F.gelu(h)))

    def step(i):
        loss = F.mse_loss(c(ckpt(block, a(x), use_reentrant=False)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [loss.item()]
    return (a, b, c, opt), step


def hooks(device):
    """A forward hook that reads the activation's norm, a backward hook that scales grads."""
    m = _mlp(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = _data(device, 16, 8), _data(device, 16, 4)
    read = []
    m[1].register_forward_hook(lambda mod, inp, out: read.append(out.norm().item()))
    m[0].register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 0.5,))
    m[2].weight.register_hook(lambda g: g.clamp(-0.05, 0.05))
    x.requires_grad_(True)

    def step(i):
        loss = F.mse_loss(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out = [loss.item(), read[-1]]
        return out
    return (m, opt), step


def grad_scaler(device):
    """GradScaler with float16 autocast; the scale grows and, after an inf, backs off."""
    try:
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=3)
        with torch.autocast(device, dtype=torch.float16):
            pass
    except (RuntimeError, ValueError) as e:
        raise Unsupported(f"{type(e).__name__}: {str(e).splitlines()[0]}") from e
    m = _mlp(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = _data(device, 16, 8), _data(device, 16, 4)

    def step(i):
        with torch.autocast(device, dtype=torch.float16):
            loss = F.mse_loss(m(x * (1e4 if i == 7 else 1.0)).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return [loss.item(), scaler.get_scale()]
    return (m, opt), step


def func_transforms(device):
    """Per-sample gradient norms with torch.func.vmap(grad(...)) inside each step."""
    from torch.func import functional_call, grad, vmap

    m = _mlp(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = _data(device, 8, 8), _data(device, 8, 4)

    def one(params, xi, yi):
        return F.mse_loss(functional_call(m, params, (xi[None],)), yi[None])

    def step(i):
        params = {k: v.detach() for k, v in m.named_parameters()}
        per = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in per.values()]).sum(0)
        loss = F.mse_loss(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [loss.item(), *norms.tolist()]
    return (m, opt), step


def replaced_parameters(device):
    """Parameters replaced mid-run: load_state_dict at step 8, swap_tensors at step 14."""
    m, other = _mlp(device), _mlp(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(device, 16, 8), _data(device, 16, 4)

    def step(i):
        if i == 8:
            m.load_state_dict(other.state_dict())
        if i == 14:
            fresh = torch.nn.Parameter(m[2].bias.detach() * 2)
            torch.utils.swap_tensors(m[2].bias, fresh)
        loss = F.mse_loss(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [loss.item()]
    return (m, opt), step


ENTRIES = {f.__name__: f for f in (
    convbn, lstm, gru, embedding_bag, sdpa, flex_attention, clip, accumulate, checkpoint,
    hooks, grad_scaler, func_transforms, replaced_parameters)}


# ------------------------------------------------------------------------- running

def _state(objs) -> list:
    out = []
    for o in objs:
        if isinstance(o, torch.optim.Optimizer):
            for st in o.state.values():
                out += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
        else:
            out += [t.detach() for t in o.state_dict().values()]
    return out


def run(name: str, device: str, backend: str | None, steps: int = STEPS):
    """The entry's per-step values and final state, in plain eager (``backend`` None) or
    under the engine; a fused backend's compiles are waited for once the loop's paths are
    learned (after its third step), so that the later steps run fused."""
    torch.manual_seed(0)
    engine = (ae.enabled(devices=(device,), backend=backend) if backend
              else contextlib.nullcontext())
    seen = []
    with engine:
        objs, step = ENTRIES[name](device)
        for i in range(steps):
            seen += step(i)
            if backend not in (None, "exact") and i == 2:
                ENGINE.wait_compiles(timeout=300)
        stats = ae.stats() if backend else None
    return seen, _state(objs), stats


def check(name: str, device: str, backend: str = "exact"):
    """Raise Mismatch where the engine's run differs from eager's; Unsupported where plain
    eager cannot run the entry here. Returns the engine's counters."""
    want_seen, want_state, _ = run(name, device, None)
    ae.reset()
    try:
        got_seen, got_state, stats = run(name, device, backend)
    finally:
        ae.reset()
    exact = backend == "exact"
    tol = dict(rtol=1e-3, atol=1e-5)
    if exact:
        compare(got_seen, want_seen, exact=True, where=f"{name} values")
    else:
        compare(torch.tensor(got_seen, dtype=torch.float64),
                torch.tensor(want_seen, dtype=torch.float64), exact=False,
                where=f"{name} values", **tol)
    compare(got_state, want_state, exact=exact, where=f"{name} state", **({} if exact else tol))
    return stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", default=",".join(ENTRIES))
    p.add_argument("--devices", default="cpu,neuron")
    p.add_argument("--backends", default="exact,inductor")
    a = p.parse_args(argv)
    if "neuron" in a.devices:
        import adaptive_eager.neuron  # noqa: F401
    bad = 0
    for backend in a.backends.split(","):
        for device in a.devices.split(","):
            for name in a.entries.split(","):
                start = time.time()
                try:
                    s = check(name, device, backend)
                    what = (f"same as eager ({s.replays} replays, {s.graphs_compiled} graphs, "
                            f"{sum(s.fallbacks.values())} fallbacks)")
                except Unsupported as e:
                    what = f"not run: plain eager cannot ({e})"
                except AssertionError as e:
                    bad += 1
                    what = f"DIFFERS: {e}"
                print(f"{backend:8} {device:6} {name:20} {what} [{time.time() - start:.1f} s]",
                      flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
