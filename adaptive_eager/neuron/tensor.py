"""Tensors on the emulated device: a wrapper on ``neuron:0`` over a backing CPU tensor.

``NeuronTensor`` carries the device's metadata (sizes, strides, dtype, ``device='neuron:0'``)
and holds the CPU tensor that stands for its device memory (``_b``). Views share their
base's backing storage, so aliasing and in-place semantics are the CPU's own.

Every aten op reaching a ``NeuronTensor`` is routed by one table lookup (``_route``):

- view ops run on the host at once (metadata only, no launch, no wait), on the backing;
- compute ops are one **launch**: the host works out the outputs' metadata by running the op
  on meta tensors, allocates their backing, and queues a closure that runs the CPU kernel;
  the host returns at once (Note [Device clock] in ``hardware``);
- sync ops wait for the device first: reads of values (``.item()``, ``.cpu()``, printing),
  ops whose output shape depends on data (``nonzero``), ops without a meta kernel, and
  random ops (Note [Device random numbers]);
- allocations (``empty``, ``empty_like``...) allocate on the host and launch nothing.

An op is never run on wrong data: a launch reads its inputs when it runs, after every
launch queued before it; CPU tensors passed into a launch are snapshotted at issue time,
as a device copies pageable host memory before the call returns.

Note [Device random numbers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The device draws from the CPU default generator, so ``torch.manual_seed(s)`` gives the same
numbers on ``neuron`` as the same program on ``cpu``. The generator is shared with the
host's own CPU ops, so a random op must consume it in program order: it runs as a sync op
(the host waits while the device draws). ``torch.Generator("neuron")`` needs C++ hooks and
is not available; pass a CPU generator to an op to use your own.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from . import hardware

__all__ = ["NeuronTensor", "wrap", "empty_strided", "copy_into"]

aten = torch.ops.aten
_DEVICE = torch.device("neuron", 0)
_META = torch.device("meta")
_CPU = torch.device("cpu")


class _Buffer:
    """One device allocation; views share it. Frees its bytes from the device's count."""

    __slots__ = ("nbytes", "device", "__weakref__")

    def __init__(self, nbytes, device):
        self.nbytes = nbytes
        self.device = device
        device.on_alloc(nbytes)

    def __del__(self):
        self.device.on_free(self.nbytes)


class NeuronTensor(torch.Tensor):
    """A tensor on the emulated ``neuron`` device (see the module docstring)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, backing: torch.Tensor, buf: _Buffer):
        t = torch.Tensor._make_wrapper_subclass(
            cls, backing.size(), strides=backing.stride(),
            storage_offset=backing.storage_offset(), dtype=backing.dtype, device=_DEVICE)
        t._b = backing
        t._buf = buf
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _route(func)(func, args, kwargs or {})

    # Host-side conveniences that PyTorch refuses for tensor subclasses.

    def tolist(self):
        return _to_host(self).tolist()

    def numpy(self, *, force=False):
        if not force:
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use "
                            "Tensor.cpu() to copy the tensor to host memory first.")
        return _to_host(self.detach()).numpy()

    def __format__(self, spec):
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def __repr__(self, *, tensor_contents=None):
        host = _to_host(self.detach())
        contents = tensor_contents or torch._tensor_str._tensor_str(host, len("tensor("))
        text = torch._tensor_str._str_intern(self, tensor_contents=contents)
        # PyTorch names a subclass in the prefix ("NeuronTensor(", "Parameter(NeuronTensor(");
        # print what a device tensor prints instead.
        head = type(self).__name__ + "("
        at = text.index(head)
        text = "tensor(" + text[at + len(head):(-1 if at else None)]
        if getattr(self, "_is_param", False):
            text = "Parameter containing:\n" + text
        return text

    def __reduce_ex__(self, proto):
        # Saved as PyTorch saves any storage-less device tensor: a CPU copy plus the device
        # name, restored through ``map_location`` (and allowed by ``weights_only`` loads).
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (_to_host(self.detach()), self.dtype, str(self.device), self.requires_grad))


def wrap(backing: torch.Tensor, buf: _Buffer | None = None) -> NeuronTensor:
    """A device tensor over ``backing``; a new allocation unless ``buf`` (a view's base) is given."""
    if buf is None:
        buf = _Buffer(backing.untyped_storage().nbytes(), hardware.get())
    return NeuronTensor(backing, buf)


def empty_strided(size, stride, dtype=None) -> NeuronTensor:
    return wrap(torch.empty_strided(size, stride, dtype=dtype))


def _to_host(t: NeuronTensor) -> torch.Tensor:
    """The values of a device tensor, as a CPU tensor (waits for the device)."""
    return t.to(_CPU)


# -- routing ---------------------------------------------------------------------------


@functools.cache
def _route(func):
    special = _SPECIAL.get(func)
    if special is not None:
        return special
    if func.is_view:
        return _view
    schema = func._schema
    if not any(_is_tensor_type(r.type) for r in schema.returns) and schema.returns:
        return _synced("it returns no tensor")
    if torch.Tag.nondeterministic_seeded in func.tags:
        names = [a.name for a in schema.arguments]
        for p in ("p", "dropout_p"):  # dropout-like: random only when p > 0 (and training)
            if p in names:
                return functools.partial(_dropout_like, at=names.index(p),
                                         train_at=names.index("train") if "train" in names else None)
        return _synced("random op")
    return _launch


def _is_tensor_type(t) -> bool:
    text = str(t)
    return "Tensor" in text


def _view(func, args, kwargs):
    base = next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, NeuronTensor))
    out = func(*tree_map(_backing, args), **tree_map(_backing, kwargs))
    return tree_map(lambda b: NeuronTensor(b, base._buf) if isinstance(b, torch.Tensor) else b, out)


def _launch(func, args, kwargs):
    """A compute op: outputs' metadata from meta tensors, then one queued launch."""
    metas = {}  # id(meta input) -> the NeuronTensor it stands for

    def to_meta(x):
        if isinstance(x, NeuronTensor):
            m = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=_META)
            metas[id(m)] = x
            return m
        if isinstance(x, torch.device):
            return _META
        return x

    try:
        margs, mkwargs = tree_map(to_meta, args), tree_map(to_meta, kwargs)
        mout = func(*margs, **mkwargs)
    except (NotImplementedError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and " device" in str(e) and "meta" in str(e):
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two "
                f"devices, {_DEVICE} and cpu! (when calling {func})") from None
        return _run_synced(func, args, kwargs, f"no meta result ({type(e).__name__})")

    flat, spec = tree_flatten(mout)
    outs, fresh, resized = [], [], {}
    for i, m in enumerate(flat):
        if isinstance(m, torch.Tensor):
            aliased = metas.get(id(m))
            if aliased is None:
                aliased = empty_strided(m.size(), m.stride(), m.dtype)
                fresh.append((i, aliased._b))
            elif aliased.size() != m.size() or aliased.stride() != m.stride():
                resized[id(aliased)] = _rebind(aliased, m)
            outs.append(aliased)
        else:
            outs.append(m)

    def snapshot(x):
        if isinstance(x, NeuronTensor):
            return resized.get(id(x), x._b)
        return _snapshot(x)

    bargs, bkwargs = tree_map(snapshot, args), tree_map(snapshot, kwargs)

    def kernel():
        res = func(*bargs, **bkwargs)
        if fresh:
            rflat = tree_flatten(res)[0]
            for i, b in fresh:
                b.copy_(rflat[i])

    dev = hardware.get()
    dev.launch(hardware.current_stream(), kernel, str(func))
    return tree_unflatten(outs, spec)


def _rebind(t: NeuronTensor, meta: torch.Tensor) -> torch.Tensor:
    """Give ``t`` new storage with ``meta``'s shape (an ``out=`` tensor the op resizes).

    The op then writes the new backing at its full size; ``t`` (the same Python object the
    user holds) takes the new metadata, as a resized CPU tensor would.
    """
    fresh = empty_strided(meta.size(), meta.stride(), meta.dtype)
    t.data = fresh  # metadata: sizes and strides follow the new tensor
    t._b, t._buf = fresh._b, fresh._buf
    return fresh._b


def _run_synced(func, args, kwargs, reason):
    """Run an op on the device and wait for it: its result is needed on the host."""
    bargs, bkwargs = tree_map(_snapshot, args), tree_map(_snapshot, kwargs)
    box = []
    dev = hardware.get()
    stream = hardware.current_stream()
    dev.launch(stream, lambda: box.append(func(*bargs, **bkwargs)), str(func))
    dev.wait_for(stream.last, reason)
    res = box[0]
    owners = {id(a._b): a for a in tree_flatten((args, kwargs))[0] if isinstance(a, NeuronTensor)}

    def rewrap(b):
        if not isinstance(b, torch.Tensor):
            return b
        owner = owners.get(id(b))
        return wrap(b) if owner is None else owner

    return tree_map(rewrap, res)


def _dropout_like(func, args, kwargs, at, train_at):
    name = func._schema.arguments[at].name
    p = args[at] if len(args) > at else kwargs.get(name, 0.0)
    train = True
    if train_at is not None:
        train = args[train_at] if len(args) > train_at else kwargs.get("train", True)
    if p and train:
        return _run_synced(func, args, kwargs, "random op")
    return _launch(func, args, kwargs)


def _synced(reason):
    return functools.partial(_synced_op, reason=reason)


def _synced_op(func, args, kwargs, reason):
    return _run_synced(func, args, kwargs, reason)


def _backing(x):
    if isinstance(x, NeuronTensor):
        return x._b
    if isinstance(x, torch.device):
        return _CPU
    return x


def _snapshot(x):
    """A launch's view of an argument: backing tensors as they are, host tensors copied."""
    if isinstance(x, NeuronTensor):
        return x._b
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, torch.device):
        return _CPU
    return x


# -- ops with their own rule -------------------------------------------------------------


def _allocate(func, args, kwargs):
    """``empty_like`` and friends: an allocation on the host, no launch."""
    out = func(*tree_map(_backing, args), **tree_map(_backing, kwargs))
    return wrap(out)


def _to_copy(func, args, kwargs):
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        return _download(args[0], **{k: v for k, v in kwargs.items() if k != "device"})
    return _launch(func, args, kwargs)


def _download(src: NeuronTensor, **kwargs) -> torch.Tensor:
    dev = hardware.get()
    box = []
    stream = hardware.current_stream()
    b = src._b
    dev.launch(stream, lambda: box.append(aten._to_copy.default(b, **kwargs)), "copy device->host")
    dev.wait_for(stream.last, "copy to host")
    out = box[0]
    dev.counters.bytes_to_host += out.numel() * out.element_size()
    return out


def _copy_(func, args, kwargs):
    return copy_into(args[0], args[1])


def copy_into(dst, src):
    """``dst.copy_(src)`` where either side is on the device."""
    dev = hardware.get()
    if isinstance(dst, NeuronTensor) and not isinstance(src, NeuronTensor):
        staged = src.detach().clone()  # the host may change src as soon as we return
        dev.counters.bytes_to_device += staged.numel() * staged.element_size()
        d = dst._b
        dev.launch(hardware.current_stream(), lambda: d.copy_(staged), "copy host->device")
        return dst
    if not isinstance(dst, NeuronTensor):
        host = _download(src)
        return dst.copy_(host)
    return _launch(aten.copy_.default, (dst, src), {})


def _local_scalar(func, args, kwargs):
    return _run_synced(func, args, kwargs, "value read (item)")


def _resize_(func, args, kwargs):
    t, size = args[0], args[1]
    if tuple(t.shape) == tuple(size):
        return t
    raise NotImplementedError(
        f"adaptive_eager.neuron: {func} cannot resize a device tensor in place "
        f"({tuple(t.shape)} -> {tuple(size)}); allocate a new tensor instead")


def _unsupported(func, args, kwargs):
    raise NotImplementedError(f"adaptive_eager.neuron: the emulated device cannot run {func}")


_SPECIAL = {
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _local_scalar,
    aten.resize_.default: _resize_,
    aten.set_.source_Storage: _unsupported,
    aten.set_.source_Storage_storage_offset: _unsupported,
    aten.set_.source_Tensor: _unsupported,
    aten.set_.default: _unsupported,
    aten.empty_like.default: _allocate,
    aten.new_empty.default: _allocate,
    aten.new_empty_strided.default: _allocate,
}
