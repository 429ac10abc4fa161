"""Recurrent layers on the C++ neuron device: cpu's implementation, on the device's memory.

ATen's LSTM and GRU cells take a fused kernel (``_thnn_fused_lstm_cell``) on any device but
cpu, one cpu does not have and whose rounding differs from cpu's unfused cell. So the device
runs the whole layer as cpu does: the op (``lstm``, ``gru``, their cells) runs on host aliases
of the device tensors with autograd recording on the host, its results are copied to the
device, and the backward pass asks the host's graph for the gradients (one autograd node on the
device stands for the layer). Values and gradients are cpu's, bit for bit. Python is on this
path, once per layer call, not per op.
"""

from __future__ import annotations

import time

import torch

from .hardware import flush

__all__ = ["register"]

# op (overload) -> how many of its leading arguments hold tensors or lists of tensors
_OPS = {"lstm.input": 3, "lstm.data": 4, "gru.input": 3, "gru.data": 4,
        "lstm_cell": 6, "gru_cell": 6}


class _OnHost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ext, call, *tensors):
        # It runs here, on the host: what is queued runs first, and what the engine defers
        # is queued first (its hidden state may be a deferred ``zeros``: found by the nn zoo,
        # tests/fidelity/zoo.py, an LSTM on neuron read it before it was written).
        flush("recurrent layer")
        ext.wait("recurrent layer")
        hosts = [ext.host_alias(t).detach().requires_grad_(t.requires_grad) for t in tensors]
        start = time.perf_counter()
        with torch.enable_grad():
            outs = call(*hosts)
        ext.launched_us((time.perf_counter() - start) * 1e6)  # the layer: one launch
        outs = outs if isinstance(outs, tuple) else (outs,)
        # the host aliases do not own the device's memory: the device tensors stay alive as
        # long as the host graph that saved their aliases
        ctx.ext, ctx.hosts, ctx.outs, ctx.owners = ext, hosts, outs, tensors
        return tuple(ext.to_device(o.detach()) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        ext = ctx.ext
        flush("recurrent layer backward")  # the incoming gradients may be deferred too
        ext.wait("recurrent layer backward")
        pairs = [(o, ext.host_alias(g)) for o, g in zip(ctx.outs, grads)
                 if g is not None and o.requires_grad]
        wanted = [h for h in ctx.hosts if h.requires_grad]
        start = time.perf_counter()
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                       allow_unused=True) if pairs and wanted else [])
        ext.launched_us((time.perf_counter() - start) * 1e6)
        out = [None, None]
        for h in ctx.hosts:
            g = next(got) if h.requires_grad else None
            out.append(None if g is None else ext.to_device(g))
        return tuple(out)


def _kernel(ext, op, n_tensor_args):
    def kernel(*args):
        head, rest = args[:n_tensor_args], args[n_tensor_args:]
        flat, shape = [], []
        for a in head:  # tensors, lists of tensors, optional tensors
            if isinstance(a, (list, tuple)):
                shape.append(len(a))
                flat.extend(a)
            else:
                shape.append(None)
                flat.append(a)
        present = [t for t in flat if t is not None]

        def call(*hosts):
            it = iter(hosts)
            flat_hosts = [None if t is None else next(it) for t in flat]
            rebuilt, k = [], 0
            for n in shape:
                if n is None:
                    rebuilt.append(flat_hosts[k])
                    k += 1
                else:
                    rebuilt.append(flat_hosts[k:k + n])
                    k += n
            return op(*rebuilt, *rest)

        res = _OnHost.apply(ext, call, *present)
        return res if len(res) > 1 else res[0]

    return kernel


def register(ext, lib: torch.library.Library) -> None:
    """Register the layers' kernels at the device's autograd key, on ``lib``."""
    for name, n in _OPS.items():
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        lib.impl(name, _kernel(ext, op, n), "AutogradPrivateUse1")
