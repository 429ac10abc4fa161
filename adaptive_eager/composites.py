"""ATen composite kernels the engine replaces while it is enabled.

A composite kernel (``CompositeImplicitAutograd``) runs above the dispatch mode: the engine
sees only the ops it issues. A few of them would make the engine change what the program
computes, for one of two reasons, each with its Note below:

- Note [Reads inside composite ops]: the kernel reads a tensor's memory in C++, where the
  engine cannot see it, and a deferred tensor has not been written yet;
- Note [Kernels that see the mode]: the kernel asks whether any dispatch mode is active
  (``isTensorSubclassLike``) and, because the engine is one, takes the path written for
  tensor subclasses, which rounds differently from the one plain eager takes.

While the engine is enabled on some thread (reference counted by ``readguard.count_reads``),
each such kernel is replaced by a Python one that issues the ops plain eager issues, with
ATen's checks and messages; when the last thread disables the engine ATen's kernel is back.
Cost: a Python call on these ops only, and only while the engine is enabled.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["install", "KERNELS"]


# Note [Reads inside composite ops]: ``tensor_split(x, indices)`` with a 1-D CPU tensor of
# indices reads it through ``data_ptr`` and issues ops whose arguments depend on what it
# read: with that tensor deferred it read memory no op had written yet and split at garbage
# (found by the OpInfo sweep, tests/fidelity). The replacement reads through ``item()`` /
# ``tolist()``, which the engine sees (a pending tensor is launched first).


def _tensor_split(self, indices, dim=0):
    if indices.device.type != "cpu":
        raise RuntimeError("tensor_split expected tensor_indices_or_sections to be on cpu, "
                           f"but it's on {indices.device}")
    if indices.dtype != torch.long:
        raise RuntimeError("tensor_split expected tensor_indices_or_sections to have dtype "
                           f"of long, but got {indices.dtype}")
    if indices.dim() not in (0, 1):
        raise RuntimeError("tensor_split expected tensor_indices_or_sections to be a "
                           "zero-dimensional or one-dimensional tensor, but got a tensor "
                           f"with {indices.dim()} dims")
    if indices.dim() == 0:
        return torch.ops.aten.tensor_split.sections(self, indices.item(), dim)
    return torch.ops.aten.tensor_split.indices(self, indices.tolist(), dim)


def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1,
              zero_infinity=False):
    # ``ctc_loss`` with tensor lengths reads them through ``data_ptr`` (Note [Reads inside
    # composite ops]; found by the OpInfo sweep: garbage lengths under the hot path's key)
    lengths = (input_lengths, target_lengths)
    if any(_subclass_like(t) for t in (log_probs, targets, *lengths)):
        return _ctc_loss_tensors(log_probs, targets, input_lengths, target_lengths, blank,
                                 reduction, zero_infinity)
    for t, name in zip(lengths, ("input_lengths", "target_lengths")):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise RuntimeError(f"{name} must be integral")
    il, tl = (t.to("cpu", torch.long).reshape(-1).tolist() for t in lengths)
    return torch.ops.aten.ctc_loss.IntList(log_probs, targets, il, tl, blank, reduction,
                                           zero_infinity)


def _ctc_loss_tensors(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                      zero_infinity):
    """ATen's path for tensor subclasses, where no length is read on the host."""
    batched = log_probs.dim() == 3
    lp = log_probs if batched else log_probs.unsqueeze(1)
    res = torch.ops.aten._ctc_loss.Tensor(lp, targets.to(lp.device, torch.long), input_lengths,
                                          target_lengths, blank, zero_infinity)[0]
    if zero_infinity:
        res = torch.where(res == float("inf"), res.new_zeros(()), res)
    if reduction == 1:
        return (res / target_lengths.clamp_min(1)).mean()
    if reduction == 2:
        return res.sum()
    return res if batched else res.squeeze(0)


# Note [Kernels that see the mode]: ATen's ``isTensorSubclassLike(t)`` is true for every
# tensor while any dispatch mode is on the stack. ``linalg_svdvals``, ``linalg_eigvalsh`` and
# ``linalg_eigvals`` use it to decide whether to compute the singular vectors or
# eigenvectors too (needed for a gradient, and always computed for a subclass); LAPACK
# computes the values differently when it computes the vectors, so under the engine
# ``svdvals``, ``matrix_norm(ord=2)``, ``cond`` and ``eigvalsh`` differed from plain eager
# in the last bits (found by the OpInfo sweep). The replacements decide as ATen does, with
# the engine's own mode left out of "any dispatch mode". Autograd's backward formulas that
# branch the same way (``prod``, ``median``, ``max`` with no dim) are C++ nodes, not kernels:
# formulas.py runs them as plain eager.

# ATen's kTensorSubclassLike, less ``Batched`` (the legacy vmap's key, which no Python API
# creates any more)
_SUBCLASS_KEYS = tuple(getattr(torch._C.DispatchKey, k) for k in (
    "Python", "FuncTorchGradWrapper", "FuncTorchBatched", "Functionalize", "Sparse",
    "SparseCsr"))


def _subclass_like(t: torch.Tensor) -> bool:
    """ATen's ``isTensorSubclassLike``, with the engine's mode not counted as a mode."""
    from adaptive_eager.tracer.mode import AdaptiveEagerMode

    if any(not isinstance(m, AdaptiveEagerMode) for m in _get_current_dispatch_mode_stack()):
        return True
    keys = torch._C._dispatch_keys(t)
    return t.is_meta or any(keys.has(k) for k in _SUBCLASS_KEYS)


def _may_need_grad(t: torch.Tensor) -> bool:
    """ATen's ``_may_require_fw_or_bw_grad``: would a gradient need the vectors?"""
    if torch.is_grad_enabled() and t.requires_grad:
        return True
    from torch.autograd import forward_ad

    if forward_ad._current_level >= 0 and forward_ad.unpack_dual(t, level=0).tangent is not None:
        return True
    return _subclass_like(t)


def _linalg_svdvals(A, *, driver=None):
    return torch.ops.aten._linalg_svd(A, full_matrices=False, compute_uv=_may_need_grad(A),
                                      driver=driver)[1]


def _linalg_eigvalsh(A, UPLO="L"):
    return torch.ops.aten._linalg_eigh(A, UPLO, compute_v=_may_need_grad(A))[0]


def _linalg_eigvals(A):
    if _may_need_grad(A):
        return torch.ops.aten.linalg_eig(A)[0]
    return torch.ops.aten._linalg_eigvals(A)


KERNELS = {
    "tensor_split.tensor_indices_or_sections": _tensor_split,
    "ctc_loss.Tensor": _ctc_loss,
    "linalg_svdvals": _linalg_svdvals,
    "linalg_eigvalsh": _linalg_eigvalsh,
    "linalg_eigvals": _linalg_eigvals,
}
_library: list = []


def install(on: bool) -> None:
    """Replace (``on``) ATen's kernels by ``KERNELS``, or give them back (the caller holds
    readguard's lock)."""
    if on and not _library:
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel"
            warnings.simplefilter("ignore")
            for name, fn in KERNELS.items():
                lib.impl(name, fn, "CompositeImplicitAutograd")
        _library.append(lib)
    elif not on and _library:
        _library.pop()._destroy()
