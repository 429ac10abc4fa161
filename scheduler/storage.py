"""A tensor's storage as the engine sees it: its bytes, address, a weak reference, "alone".

Note [Storage objects]: ``t.untyped_storage()`` makes the storage's Python object, and that
object then lives as long as the memory does and holds a reference to it (PyTorch keeps a
tensor's or a storage's Python object alive while C++ holds the object). Autograd accumulates
a gradient in place (``add_``) only when nothing but its buffer holds the memory
(``storage().use_count() == 1``), else out of place (``add``). So an engine that asked a
tensor for its storage object changed which op autograd issues next, and the memory it uses:
with the hot path's dispatch key, where PyTorch sees no dispatch mode, a cold run (which asked)
saw ``add`` and the replay (which did not) ``add_``, and the path diverged there. The engine
reads storages through these functions: compiled (``tracer/csrc/fast_path.cpp``), they make
no storage object; ``NEURON_ADAPTIVE_EAGER_HOT_PATH=python`` (no compiler) reads them from
Python, making one, as it always did.
"""

from __future__ import annotations

import torch

__all__ = ["alone", "ident", "nbytes", "ptr", "use_compiled", "weak"]

_use_count = torch._C._storage_Use_Count


def _nbytes(t) -> int:
    return t.untyped_storage().nbytes()


def _ptr(t):
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


def _weak(t) -> int:
    return t.untyped_storage()._weak_ref()


def _ident(t) -> int:
    return t.untyped_storage()._cdata


def _alone(t) -> bool:
    # held by ``t`` and by the Python storage object asked here; memory PyTorch allocated
    # (``resizable``) belongs to that one storage, where two storages can share borrowed
    # memory (``from_numpy`` twice)
    storage = t.untyped_storage()
    return storage.resizable() and _use_count(storage._cdata) == 2


nbytes, ptr, weak, ident, alone = _nbytes, _ptr, _weak, _ident, _alone
"""The storage's size in bytes; its address (None when it has no bytes); a weak reference
(an integer handle, as ``UntypedStorage._weak_ref`` gives, freed with ``_free_weak_ref``);
its identity (the integer its weak handles are); whether nothing but ``t`` holds its memory
(then no other live tensor can alias it)."""


def use_compiled(module) -> None:
    """Read storages with ``module``'s compiled functions (tracer.native), or from Python
    when None."""
    global nbytes, ptr, weak, ident, alone
    if module is None:
        nbytes, ptr, weak, ident, alone = _nbytes, _ptr, _weak, _ident, _alone
    else:
        nbytes, ptr = module.storage_nbytes, module.storage_ptr
        weak, ident, alone = module.storage_weak, module.storage_id, module.storage_alone
