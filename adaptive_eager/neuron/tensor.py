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
  random ops (Autograd runs ``backward()`` for this device on its own thread, whose current stream is the
default stream: backward launches go there whatever stream the forward used (the queue runs
in order, so values are right; only the stream attribution differs from CUDA's).

Note [Device random numbers]);
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

from . import device_kernels, hardware

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

    # A wrapper over one inner tensor, declared so: ``Module.to("neuron")`` then swaps each
    # parameter in place (``torch.utils.swap_tensors``) instead of making a new Parameter, so
    # parameters shared between modules (tied embeddings) stay one object, as on CUDA.

    def __tensor_flatten__(self):
        return ["_b"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return wrap(inner["_b"])

    # Storage: the backing's. What the engine reads to track aliasing and liveness
    # (Note [Liveness] in scheduler.launch) is then the same as for a CPU tensor.

    def untyped_storage(self):
        return self._b.untyped_storage()

    def data_ptr(self):
        return self._b.data_ptr()

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
    if func.is_view or func in _ALIASES_ON_CPU:
        return _view
    schema = func._schema
    if schema.returns and not any("Tensor" in str(r.type) for r in schema.returns):
        return _synced("it returns no tensor")
    if torch.Tag.nondeterministic_seeded in func.tags:
        names = [a.name for a in schema.arguments]
        for p in ("p", "dropout_p"):  # dropout-like: random only when p > 0 (and training)
            if p in names:
                return functools.partial(_dropout_like, at=names.index(p),
                                         train_at=names.index("train") if "train" in names else None)
        return _synced("random op")
    if func.namespace not in _KERNEL_NAMESPACES:
        # Note [Ops outside aten]: a library's own op (``torch_nn._linear_cross_entropy_*``)
        # runs Python that can share host objects with the program (a context object its
        # forward fills and its backward reads through a ``cached_property``, which takes
        # a lock). Run on the worker while the host goes on, it deadlocked with a host
        # thread holding that lock and waiting for the device. A real device runs such a
        # body on the host; here the host waits while the worker runs it.
        return _synced("op outside aten")
    return _launch


_KERNEL_NAMESPACES = frozenset({"aten", "prims"})


# The device's kernels where they differ from the CPU's: the op's meaning on an accelerator,
# run on the backing tensors. The engine's replays of this device use them too.
DEVICE_KERNELS = device_kernels.KERNELS


# Not views by their schema, but the CPU kernel returns an alias of the input (the engine's
# op table treats them as views too): metadata only, no launch.
_ALIASES_ON_CPU = frozenset({aten._unsafe_view.default})


def _view(func, args, kwargs):
    base = args[0] if isinstance(args[0], NeuronTensor) else _first_device_tensor(args, kwargs)
    out = func(*_map(_backing, args), **{k: _map(_backing, v) for k, v in kwargs.items()})
    buf = base._buf
    if isinstance(out, torch.Tensor):
        return NeuronTensor(out, buf)
    return _map(lambda b: NeuronTensor(b, buf) if isinstance(b, torch.Tensor) else b, out)


class _Plan:
    """What a compute op does to metadata, learnt once per input signature (Note [Op plans]).

    ``outs`` has one entry per leaf of the op's result: ``("fresh", meta)`` a new buffer
    shaped like ``meta``, ``("alias", i)`` the i-th device tensor argument itself,
    ``("resized", i, meta)`` that argument with new storage (an ``out=`` the op resizes),
    ``("value", v)`` a non-tensor leaf. ``template`` is the meta result, for its structure.
    """

    __slots__ = ("outs", "template", "fresh", "single", "synced")

    def __init__(self, outs=(), template=None, synced=None):
        self.outs = outs
        self.template = template
        self.fresh = [i for i, o in enumerate(outs) if o[0] == "fresh"]
        self.single = isinstance(template, torch.Tensor)
        self.synced = synced  # a reason: run as a sync op instead


# Note [Op plans]
# ~~~~~~~~~~~~~~~
# Working out an op's output metadata on meta tensors costs tens of microseconds (several of
# the meta kernels are Python); a training step repeats the same ops on the same shapes, so
# the plan is cached by everything the metadata can depend on: the op, and per argument its
# device, shape, strides and dtype, or its type and value (1 and 1.0 hash alike, and type
# promotion tells them apart). An argument that cannot be hashed skips the cache.
_PLANS: dict = {}
_PLANS_MAX = 65536


def _launch(func, args, kwargs):
    """A compute op: outputs' metadata from its plan, then one queued launch."""
    inputs = []  # the device tensors among the arguments, in order
    key = _signature(func, args, kwargs, inputs)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _make_plan(func, args, kwargs)
        if key is not None and len(_PLANS) < _PLANS_MAX:
            _PLANS[key] = plan
    if plan.synced is not None:
        if plan.synced == "device mismatch":
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two "
                f"devices, {_DEVICE} and cpu! (when calling {func})")
        return _run_synced(func, args, kwargs, plan.synced)
    if key is None:
        _leaves((args, tuple(kwargs.values())), inputs, NeuronTensor)

    outs, fresh, resized = [], [], {}
    for o in plan.outs:
        kind = o[0]
        if kind == "fresh":
            m = o[1]
            t = empty_strided(m.size(), m.stride(), m.dtype)
            fresh.append(t._b)
            outs.append(t)
        elif kind == "alias":
            outs.append(inputs[o[1]])
        elif kind == "resized":
            t = inputs[o[1]]
            resized[id(t)] = _rebind(t, o[2])
            outs.append(t)
        else:
            outs.append(o[1])

    if resized:
        def snap(x):
            return resized.get(id(x), x._b) if isinstance(x, NeuronTensor) else _snapshot(x)
    else:
        snap = _snapshot
    bargs = _map(snap, args)
    bkwargs = {k: _map(snap, v) for k, v in kwargs.items()}
    positions = plan.fresh
    impl = DEVICE_KERNELS.get(func, func)

    def kernel():
        res = impl(*bargs, **bkwargs)
        if fresh:
            if plan.single:
                fresh[0].copy_(res)
            else:
                leaves = []
                _leaves(res, leaves)
                for b, i in zip(fresh, positions):
                    b.copy_(leaves[i])

    hardware.get().launch(hardware.current_stream(), kernel, func)
    if plan.single:
        return outs[0]
    return _rebuild(plan.template, iter(outs))


def _make_plan(func, args, kwargs) -> _Plan:
    metas = {}  # id(meta argument) -> index among the device tensor arguments
    inputs = []

    def to_meta(x):
        if isinstance(x, NeuronTensor):
            m = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=_META)
            metas[id(m)] = len(metas)
            inputs.append(x)
            return m
        if isinstance(x, torch.device):
            return _META
        return x

    margs = _map(to_meta, args)
    mkwargs = {k: _map(to_meta, v) for k, v in kwargs.items()}
    try:
        mout = func(*margs, **mkwargs)
    except (NotImplementedError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and " device" in str(e) and "meta" in str(e):
            return _Plan(synced="device mismatch")
        return _Plan(synced=f"no meta result ({type(e).__name__})")
    leaves = []
    _leaves(mout, leaves)
    outs = []
    for m in leaves:
        if not isinstance(m, torch.Tensor):
            outs.append(("value", m))
            continue
        i = metas.get(id(m))
        if i is None:
            outs.append(("fresh", m))
            continue
        # the op returns an argument; one whose metadata changed was resized by the op
        t = inputs[i]
        if t.size() != m.size() or t.stride() != m.stride():
            outs.append(("resized", i, m))
        else:
            outs.append(("alias", i))
    return _Plan(outs, mout)


def _signature(func, args, kwargs, inputs):
    """The plan cache key (Note [Op plans]); collects the device tensors into ``inputs``."""
    try:
        key = [func]
        for a in args:
            key.append(_describe(a, inputs))
        for k, v in kwargs.items():
            key.append(k)
            key.append(_describe(v, inputs))
        key = tuple(key)
        hash(key)
        return key
    except TypeError:
        inputs.clear()
        return None


def _describe(a, inputs):
    if isinstance(a, torch.Tensor):
        if isinstance(a, NeuronTensor):
            inputs.append(a)
            return (a.size(), a.stride(), a.dtype)
        return ("host", a.size(), a.stride(), a.dtype, a.device)
    if isinstance(a, (list, tuple)):
        return tuple(_describe(x, inputs) for x in a)
    return (type(a), a)


def _leaves(x, out, kind=None):
    """Depth-first leaves of nested lists/tuples (of ``kind`` only, when given)."""
    if isinstance(x, (list, tuple)):
        for e in x:
            _leaves(e, out, kind)
    elif kind is None or isinstance(x, kind):
        out.append(x)


def _iter_tensors(x):
    leaves = []
    _leaves(x, leaves, torch.Tensor)
    return leaves


def _rebuild(template, it):
    if isinstance(template, list):
        return [_rebuild(e, it) for e in template]
    if isinstance(template, tuple):
        return tuple(_rebuild(e, it) for e in template)
    return next(it)


def _map(fn, x):
    if isinstance(x, (list, tuple)):
        return type(x)(_map(fn, e) for e in x)
    return fn(x)


def _first_device_tensor(args, kwargs):
    return next(t for t in _iter_tensors((args, tuple(kwargs.values())))
                if isinstance(t, NeuronTensor))


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
    bargs = _map(_snapshot, args)
    bkwargs = {k: _map(_snapshot, v) for k, v in kwargs.items()}
    box = []
    dev = hardware.get()
    stream = hardware.current_stream()
    impl = DEVICE_KERNELS.get(func, func)
    dev.launch(stream, lambda: box.append(impl(*bargs, **bkwargs)), func)
    dev.wait_for(stream.last, reason)
    res = box[0]
    owners = {id(a._b): a for a in _iter_tensors((args, tuple(kwargs.values())))
              if isinstance(a, NeuronTensor)}

    def rewrap(b):
        if not isinstance(b, torch.Tensor):
            return b
        owner = owners.get(id(b))
        return wrap(b) if owner is None else owner

    return _map(rewrap, res)


def _dropout_like(func, args, kwargs, at, train_at):
    arg = func._schema.arguments[at]
    # PyTorch leaves out arguments passed at their default (``bernoulli_(0.5)`` arrives as
    # ``bernoulli_(t)``): an absent ``p`` is the schema's default, not 0 (the device launched
    # such draws without waiting, and they raced the host's next ``manual_seed``)
    p = args[at] if len(args) > at else kwargs.get(arg.name, arg.default_value or 0.0)
    train = True
    if train_at is not None:
        train = args[train_at] if len(args) > train_at else kwargs.get("train", True)
    if p and train:
        return _run_synced(func, args, kwargs, "random op")
    return _launch(func, args, kwargs)


def _synced(reason):
    return functools.partial(_run_synced, reason=reason)


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
    out = func(*_map(_backing, args), **{k: _map(_backing, v) for k, v in kwargs.items()})
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
        if dst.numel() == 0:
            return dst  # nothing to copy: no launch (``torch.tensor([], device=...)``)
        staged = src.detach().clone()  # the host may change src as soon as we return
        dev.counters.bytes_to_device += staged.numel() * staged.element_size()
        d = dst._b
        dev.launch(hardware.current_stream(), lambda: d.copy_(staged), "copy host->device")
        return dst
    if not isinstance(dst, NeuronTensor):
        host = _download(src)
        return dst.copy_(host)
    return _launch(aten.copy_.default, (dst, src), {})


def _resize_(func, args, kwargs):
    t, size = args[0], args[1]
    if tuple(t.shape) == tuple(size):
        return t
    raise NotImplementedError(
        f"adaptive_eager.neuron: {func} cannot resize a device tensor in place "
        f"({tuple(t.shape)} -> {tuple(size)}); allocate a new tensor instead")


def _set_storage(func, args, kwargs):
    """``t.set_(storage, offset, size, stride)`` with a backing (CPU) storage: a view of it."""
    t, storage = args[0], args[1]
    if isinstance(storage, torch.Tensor) or storage.device.type != "cpu":
        return _unsupported(func, args, kwargs)
    backing = torch.empty(0, dtype=t.dtype).set_(storage, *args[2:], **kwargs)
    buf = _Buffer(0, hardware.get())  # the storage's bytes are counted by its first owner
    t.data = NeuronTensor(backing, buf)
    t._b, t._buf = backing, buf
    return t


def _same_impl_type(func, args, kwargs):
    # Metadata only (autograd asks it when accumulating a gradient): no launch, no wait.
    return type(args[0]) is type(args[1])


def _same_size(func, args, kwargs):
    return args[0].size() == args[1].size()


def _unsupported(func, args, kwargs):
    raise NotImplementedError(f"adaptive_eager.neuron: the emulated device cannot run {func}")


_SPECIAL = {
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _synced("value read (item)"),
    aten.resize_.default: _resize_,
    aten.set_.source_Storage: _unsupported,
    aten.set_.source_Storage_storage_offset: _set_storage,
    aten.set_.source_Tensor: _unsupported,
    aten.set_.default: _unsupported,
    aten._has_compatible_shallow_copy_type.default: _same_impl_type,
    aten.is_same_size.default: _same_size,
    aten.empty_like.default: _allocate,
    aten.new_empty.default: _allocate,
    aten.new_empty_strided.default: _allocate,
}
