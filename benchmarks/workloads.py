"""The suite's workloads: programs users run, each built fresh on a device.

A workload is built by ``WORKLOADS[name](device, size)`` and returns a :class:`Workload`:
``body()`` issues one step's work and returns what the step reads on the host, ``finish(r)``
reads it (the step's sync point: ``.item()``, or a device synchronize when the step reads
nothing). ``size`` is ``"issue"`` (the sizes the suite reports, fixed by its issue) or
``"tiny"`` (the same program, small enough for the test that keeps the suite from rotting).

Every builder seeds the generator, so each mode gets the same weights and data.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["WORKLOADS", "Workload", "sync"]


@dataclasses.dataclass
class Workload:
    body: Callable[[], Any]
    finish: Callable[[Any], Any]
    # How torch.compile is applied, as its docs advise for this kind of program: by default
    # the whole step body; ``compile(torch_compile)`` returns the body to run instead.
    compile: Callable[[Callable], Callable[[], Any]] | None = None
    note: str = ""

    def step(self):
        return self.finish(self.body())


def sync(device: str) -> None:
    """Wait until ``device`` has run everything issued so far (the engine's deferred work
    included when it is on)."""
    import adaptive_eager as ae

    if ae.is_enabled():
        ae.synchronize()
    if device == "lazy":
        import torch._lazy as lazy

        lazy.mark_step()
        lazy.wait_device_ops()
    elif device != "cpu":
        torch.get_device_module(device).synchronize()


def _item(device: str):
    def finish(t):
        if device == "lazy":
            import torch._lazy as lazy

            lazy.mark_step()
        return t.item()

    return finish


# ------------------------------------------------------------------------------- chains

def _chain(n: int):
    def build(device: str, size: str) -> Workload:
        torch.manual_seed(0)
        x = torch.randn(n if size == "issue" else 256, device=device)

        def body():
            y = x
            for _ in range(32):  # 64 elementwise ops
                y = y * 1.0001
                y = y + 0.5
            return y.sum()

        return Workload(body, _item(device))

    return build


# ------------------------------------------------------------------------------ mlp-train

def _train(device: str, model: nn.Module, batch: dict, loss_of, foreach=None) -> Workload:
    model.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)

    def body():
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return Workload(body, _item(device))


def mlp_train(device: str, size: str) -> Workload:
    d, h, b = (512, 2048, 32) if size == "issue" else (16, 32, 4)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Dropout(0.1), nn.Linear(h, d),
                          nn.LayerNorm(d))
    batch = dict(x=torch.randn(b, d), y=torch.randn(b, d))
    return _train(device, model, batch,
                  lambda m, bt: nn.functional.mse_loss(m(bt["x"]), bt["y"]))


# ---------------------------------------------------------------------------- llama-*

def _llama(device: str, zoo_size):
    """(model, batch, source): Hugging Face's Llama when transformers is installed, else the
    in-repo equivalent below. ``zoo_size``: a name of benchmarks.zoo.SIZES, or a size dict."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        from benchmarks.zoo import SIZES

        torch.manual_seed(0)
        s = SIZES[zoo_size] if isinstance(zoo_size, str) else zoo_size
        model = TinyLlama(s)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
        return model, dict(input_ids=ids, labels=ids), "in-repo Llama (transformers absent)"
    from benchmarks.zoo import build

    model, batch = build("llama", zoo_size)
    return model, batch, "transformers.LlamaForCausalLM"


def _llama_train(zoo_size):
    def build(device: str, size: str) -> Workload:
        model, batch, source = _llama(device, zoo_size if size == "issue" else "tiny")
        w = _train(device, model, batch, lambda m, bt: m(**bt).loss)
        w.note = source
        return w

    return build


NEW_TOKENS = 16


def llama_decode(device: str, size: str) -> Workload:
    """Greedy decoding, batch 1, a static KV cache: one step is 16 new tokens after an
    8-token prompt, each token read on the host as it is produced (a streaming generator)."""
    model, batch, source = _llama(device, "issue" if size == "issue" else "tiny")
    model.to(device).eval()
    prompt = batch["input_ids"][:1, :8].to(device)
    if isinstance(model, TinyLlama):
        def body():
            with torch.no_grad():
                return model.greedy(prompt, NEW_TOKENS)
    else:
        def body():
            # The stopping criteria read every new token on the host: one sync per token.
            # disable_compile: generate would otherwise torch.compile the forward itself off
            # cpu with a static cache; here that is the torch.compile mode's business.
            return model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, cache_implementation="static",
                                  pad_token_id=0, disable_compile=True)

    def finish(out):
        if device == "lazy":
            import torch._lazy as lazy

            lazy.mark_step()
        return int(out[0, -1])

    def compile(torch_compile):
        model.forward = torch_compile(model.forward)  # what Hugging Face advises
        return body

    return Workload(body, finish, compile, note=source)


# ------------------------------------------------------------------------------ adam-many

def adam_many(device: str, size: str) -> Workload:
    """A single-tensor (``foreach=False``) AdamW step over 200 small parameters."""
    torch.manual_seed(0)
    n, shape = (200, (64,)) if size == "issue" else (8, (4,))
    params = [torch.randn(shape, device=device, requires_grad=True) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(shape, device=device)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)

    def compile(torch_compile):
        return torch_compile(opt.step)

    return Workload(opt.step, lambda _: sync(device), compile)


# ------------------------------------------------------------- the in-repo Llama fallback

class _RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6))


def _rotate(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class _Block(nn.Module):
    def __init__(self, s):
        super().__init__()
        d, self.h, self.kv = s["hidden"], s["heads"], s["kv"]
        self.hd = d // self.h
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, self.kv * self.hd, bias=False)
        self.v = nn.Linear(d, self.kv * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, s["inter"], bias=False)
        self.up = nn.Linear(d, s["inter"], bias=False)
        self.down = nn.Linear(s["inter"], d, bias=False)
        self.n1, self.n2 = _RMSNorm(d), _RMSNorm(d)

    def forward(self, x, cos, sin, cache=None, pos=None):
        b, t, _ = x.shape
        y = self.n1(x)
        q = self.q(y).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k(y).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v(y).view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is None:
            mask, causal = None, True
        else:  # a static cache: write at ``pos``, attend to the filled prefix by a mask
            cache[0].index_copy_(2, pos, k)
            cache[1].index_copy_(2, pos, v)
            k, v = cache
            mask = torch.arange(k.shape[2], device=x.device)[None, :] <= pos[:, None]
            causal = False
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                       is_causal=causal)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        y = self.n2(x)
        return x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))


class TinyLlama(nn.Module):
    """A Llama-shaped decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU),
    used when transformers is not installed."""

    def __init__(self, s):
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s["vocab"], s["hidden"])
        self.blocks = nn.ModuleList(_Block(s) for _ in range(s["layers"]))
        self.norm = _RMSNorm(s["hidden"])
        self.head = nn.Linear(s["hidden"], s["vocab"], bias=False)
        hd = s["hidden"] // s["heads"]
        inv = 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)
        ang = torch.outer(torch.arange(4 * s["seq"] + 64).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, input_ids, labels=None, caches=None, pos=None):
        t = input_ids.shape[1]
        cos, sin = (self.cos[:t], self.sin[:t]) if pos is None else (self.cos[pos], self.sin[pos])
        x = self.embed(input_ids)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, None if caches is None else caches[i], pos)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                               labels[:, 1:].flatten())
        return _Out(loss, logits)

    def greedy(self, prompt, new_tokens: int):
        s, dev = self.s, prompt.device
        hd = s["hidden"] // s["heads"]
        n = prompt.shape[1] + new_tokens
        caches = [(torch.zeros(1, s["kv"], n, hd, device=dev),
                   torch.zeros(1, s["kv"], n, hd, device=dev)) for _ in self.blocks]
        pos = torch.arange(prompt.shape[1], device=dev)
        logits = self(prompt, caches=caches, pos=pos).logits
        out = [prompt]
        for i in range(new_tokens):
            tok = logits[:, -1:].argmax(-1)
            int(tok)  # read each token as it is produced
            out.append(tok)
            pos = pos[-1:] + 1
            if i + 1 < new_tokens:
                logits = self(tok, caches=caches, pos=pos).logits
        return torch.cat(out, dim=1)


@dataclasses.dataclass
class _Out:
    loss: Any
    logits: Any


WORKLOADS: dict[str, Callable[[str, str], Workload]] = {
    "chain-small": _chain(256),
    "chain-large": _chain(1 << 20),
    "mlp-train": mlp_train,
    "llama-train": _llama_train("issue"),
    "llama-train-m": _llama_train("m"),
    "llama-decode": llama_decode,
    "adam-many": adam_many,
}

# ``llama-train@<hidden>x<layers>``: llama-train scaled (benchmarks.zoo.sized), for the table
# of how the engine's lead grows with the work (benchmarks/RESULTS.md).
SIZED = re.compile(r"llama-train@([1-9][0-9]*)x([1-9][0-9]*)")


def workload(name: str) -> Callable[[str, str], Workload]:
    """The builder of a workload: a name of WORKLOADS, or ``llama-train@<hidden>x<layers>``."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    m = SIZED.fullmatch(name)
    if m is None:
        raise KeyError(name)
    from benchmarks.zoo import sized

    hidden, layers = int(m.group(1)), int(m.group(2))
    if hidden % 4:
        raise ValueError(f"{name}: hidden {hidden} is not divisible by the 4 attention heads")
    return _llama_train(sized(hidden, layers))

