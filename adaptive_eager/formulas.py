"""Autograd formulas that see the engine's mode: their gradient is plain eager's.

Note [Kernels that see the mode] (composites.py), for backward formulas: ATen's
``isTensorSubclassLike`` is true for every tensor while any dispatch mode is on the stack, and
a few of autograd's C++ formulas branch on it. ``prod``'s backward then takes the path written
for subclasses (a product of exclusive cumulative products) instead of ``grad * result /
input``; ``max``/``min``/``median``/``nanmedian`` over all elements spread the gradient with a
mask multiply instead of ``index_put``. The values differ from plain eager in the last bits
(found by the OpInfo sweep, tests/fidelity). Those formulas live in C++ nodes
(``ProdBackward0`` ...), not in kernels that can be replaced.

So while the engine is enabled, the Python functions that create those nodes are wrapped: on
a result whose ``grad_fn`` is one of ``NODES``, the wrapper registers a pre-hook that, when
backward reaches the node, ends the engine's segment (the node's inputs are then written),
calls the node itself with the engine's mode off the stack (plain eager: ATen takes the plain
path), and keeps the gradients it gives; a post-hook hands those on instead of what the node
computed under the mode. The node's inputs are as eager's, so its gradients are eager's; the
segment boundary is counted ("autograd formula that sees the mode: run as plain eager").
When another dispatch mode is on the stack too, ATen takes the subclass path in eager as
well, and nothing is changed. Cost: one Python call on these functions while the engine is
enabled; the node runs twice (once deferred, unused), on these formulas only.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["install", "current", "NODES", "REASON"]

# grad_fn names whose C++ formula branches on isTensorSubclassLike
NODES = frozenset({"ProdBackward0", "ProdBackward1", "MaxBackward1", "MinBackward1",
                   "MedianBackward0", "NanmedianBackward0", "LinalgEigBackward0"})
# the functions that create them: (namespace, name)
_WRAPPED = [(ns, name) for ns in (torch, torch.Tensor)
            for name in ("prod", "max", "min", "median", "nanmedian")]
_WRAPPED += [(torch.linalg, "eig")]
REASON = "autograd formula that sees the mode: run as plain eager"
_ORIGINALS: dict = {}  # (namespace, name) -> the original function
_WRAPPERS: dict = {}  # the original function -> its wrapper, while installed


def current(fn):
    """What a program calling ``fn`` by its name gets now (the wrapper while installed)."""
    return _WRAPPERS.get(fn, fn)


def install(engine, on: bool) -> None:
    """Wrap (``on``) or restore the functions (the caller holds readguard's lock)."""
    if on and not _ORIGINALS:
        for ns, name in _WRAPPED:
            original = getattr(ns, name)
            _ORIGINALS[(ns, name)] = original
            _WRAPPERS[original] = _wrap(engine, original)
            setattr(ns, name, _WRAPPERS[original])
    elif not on and _ORIGINALS:
        for (ns, name), original in _ORIGINALS.items():
            setattr(ns, name, original)
        _ORIGINALS.clear()
        _WRAPPERS.clear()


def _wrap(engine, original):
    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        res = original(*args, **kwargs)
        if torch.is_grad_enabled() and engine.mode() is not None:
            for t in res if isinstance(res, tuple) else (res,):
                node = getattr(t, "grad_fn", None)
                if node is not None and node.name() in NODES:
                    _plain_backward(engine, node)
        return res

    return wrapped


_PYTHON_KEY = torch._C.DispatchKey.Python


def _plain_backward(engine, node) -> None:
    plain = []

    def pre(grad_outputs):
        m = engine.mode()
        if m is None or _get_current_dispatch_mode_stack() != [m]:
            return None
        if any(g is None or torch._C._dispatch_keys(g).has(_PYTHON_KEY)
               for g in grad_outputs):
            return None  # a tensor subclass: ATen takes its path in eager too
        m.boundary(REASON)
        with m.outside():
            plain.append(node(*grad_outputs))
        return None

    def post(grad_inputs, grad_outputs):
        if not plain:
            return None
        res = plain.pop()
        res = res if isinstance(res, tuple) else (res,)
        if len(res) != len(grad_inputs) or any(
                (a is None) != (b is None) or (a is not None and a.shape != b.shape)
                for a, b in zip(res, grad_inputs)):
            return None  # not the node's own answer: keep the one computed under the mode
        return res

    node.register_prehook(pre)
    node.register_hook(post)
