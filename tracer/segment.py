"""Per-thread segment state: what has run since the last boundary, and what is pending.

Numbering (DESIGN §4): every tensor output of the segment (fresh or view) is a *value*
``Val(i)``, every tensor that entered from outside is an *external* ``Ext(k)``, numbered by
first appearance. ``ids`` maps ``id(tensor)`` to ``i >= 0`` (a value) or ``~k`` (an external);
an entry is trusted only after checking the weak reference it points at, because ids are
reused once an object dies.

What the engine holds (Note [Liveness] in scheduler.launch): values only weakly, and a weak
reference to the storage of each fresh value (``stor`` while deferred, ``cold_storage`` while
cold); externals weakly while cold, strongly while hot (a deferred op must still find its
inputs at launch).

Note [Memory of a value]: a tensor can reach an op without having come out of one: autograd
unpacks an output it saved as a new tensor on the output's memory (with no dispatch mode
seen, as under the hot path's dispatch key; with one it is a ``detach`` the mode sees), and
``.data`` makes one too. Such a tensor is new to the segment, yet it sits on the memory of
one of its fresh values, which while deferred holds nothing yet: as a new input, a fused
graph would read it before computing the value. Where it sits on the value's memory exactly
as the value does (offset, sizes, strides, dtype), it *is* the value under another tensor, and
``source`` says so (``_same_value``): the op is learned reading the value, and a hot run
takes the twin for the value (``adopt``: the fast paths know values by identity), so a
training step's backward stays in its segment. Any other new input on a value's memory (a
view made with no op the engine sees, ``nn.Parameter`` of a part of a value) is learned as a
boundary (``on_value_memory``, checked when the node is learned): the segment launches
before it, every time. Results of ops that compute nothing (``empty`` and its kin) are no
values at all (Note [Ops that compute nothing] in tracer.optable).
"""

from __future__ import annotations

import time
import weakref

import torch

from adaptive_eager.scheduler import storage
from adaptive_eager.scheduler.program import Ext, Val

__all__ = ["Segment", "release_weak"]

_wref = weakref.ref
# A weak reference to a storage (an int handle): tells whether anything still uses the
# memory -- a gradient autograd moved into ``.grad`` after our Python object died -- without
# keeping it alive.
_expired = torch.UntypedStorage._expired
_free_weak = torch.UntypedStorage._free_weak_ref


def release_weak(stor) -> None:
    """Free the weak storage references of deferred values (Note [Liveness]); the owner's
    ``release_weak`` is this or its compiled twin (tracer.native)."""
    for ref in stor:
        if ref is not None:
            _free_weak(ref)


class Segment:
    __slots__ = (
        "owner", "root", "node", "expect", "hot", "ids", "outw", "stor", "exts", "extw",
        "floats", "rng", "t0", "n_ops", "_written", "_written_at", "_by_storage", "_n_indexed",
        "cold_storage", "cold_idents", "serial", "_hot_idents", "_n_hot_indexed", "n_same",
        "rebound",
    )

    def __init__(self, owner, root):
        self.owner = owner
        self.root = root
        self.reset()

    def reset(self) -> None:
        cold = getattr(self, "cold_storage", None)
        if cold:
            for ref in cold.values():
                _free_weak(ref)
        self.owner.release_weak(getattr(self, "stor", ()))
        # bumped whenever the values and externals are renumbered or dropped: what the
        # dispatch key's plans imported from them is stale (csrc/hot_segment.cpp)
        self.serial = getattr(self, "serial", 0) + 1
        self.cold_storage: dict = {}  # value index -> weak storage ref (cold fresh outputs)
        # those references (specified ones) -> value index (Note [Memory of a value])
        self.cold_idents: dict = {}
        self._hot_idents: dict = {}  # the same of deferred values, indexed from ``stor``
        self._n_hot_indexed = 0
        self.n_same = 0  # tensors taken for the value they sit on exactly (``_same_value``)
        self.rebound: list = []  # values whose tensor was rebound to such a twin (``adopt``)
        self.node = self.root
        self.expect = self.root.hot_next
        self.hot = False
        self.ids: dict = {}
        self.outw: list = []
        self.stor: list = []
        self.exts: list = []
        self.extw: list = []
        self.floats: list = []
        self.rng = None
        self.t0 = 0.0
        self.n_ops = 0
        self._written: set = set()  # mutated_externals(), as of node ``_written_at``
        self._written_at = self.root
        self._by_storage: dict = {}  # storage address -> externals on it (see _aliases)
        self._n_indexed = 0  # externals entered in _by_storage

    # -- called from generated hot-path code --------------------------------------------

    def start(self) -> bool:
        """The first op of a segment matched a hot path: begin deferring (or refuse)."""
        if torch.are_deterministic_algorithms_enabled():
            self.owner.counters.fallback("deterministic algorithms: deferral off")
            self.expect = None
            return False
        self.hot = True
        self.t0 = time.perf_counter()
        return True

    def finish(self) -> None:
        """The hot path ends at this op: launch now rather than at the next boundary."""
        self.owner.end_segment("path cut" if self.node.cut else "path end")

    # -- sources and pending state (cold path) --------------------------------------------

    def source(self, t):
        """The Val/Ext leaf of a tensor already seen in this segment (or of a twin of a
        value: Note [Memory of a value]), else None."""
        idx = self.ids.get(id(t))
        if idx is not None:
            if idx >= 0:
                if self.outw[idx]() is t:
                    return Val(idx)
            elif self.extw[~idx]() is t:
                return Ext(~idx)
        return self._same_value(t) if self.cold_idents or self.stor else None

    def _same_value(self, t):
        """Val(i) when ``t`` sits on fresh value i's memory exactly as the value does (same
        offset, sizes, strides, dtype): the value itself, under another tensor. Only values
        whose storage the segment holds a weak reference to are asked, so the storage's
        address cannot have been reused."""
        ident = storage.ident(t)
        i = self.cold_idents.get(ident)
        if i is None:
            stor = self.stor
            index = self._hot_idents
            for j in range(self._n_hot_indexed, len(stor)):
                ref = stor[j]
                if ref is not None:
                    index[ref] = j
            self._n_hot_indexed = len(stor)
            i = index.get(ident)
            if i is None:
                return None
        v = self.outw[i]()
        if v is not None:
            want = (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype)
        else:
            meta = self.node.value_meta(i) if self.node is not None else None
            if meta is None:
                return None
            want = meta[:4]
        if (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) != want:
            return None
        self.n_same += 1
        return Val(i)

    def adopt(self, args, kwargs):
        """The call with every twin of a value (``_same_value``) made the value's own tensor,
        so the fast paths, which know values by identity, take it: a value whose tensor died
        is rebound to its twin; a living one's tensor replaces the twin in the arguments
        (both are the same memory, seen alike, and the op runs below autograd)."""
        outw, ids = self.outw, self.ids

        def fix(x):
            if isinstance(x, torch.Tensor):
                idx = ids.get(id(x))
                if idx is not None and (outw[idx]() if idx >= 0 else self.extw[~idx]()) is x:
                    return x
                src = self._same_value(x)
                if src is None:
                    return x
                v = outw[src.i]()
                if v is None:
                    outw[src.i] = _wref(x)
                    ids[id(x)] = src.i
                    self.rebound.append(src.i)
                    return x
                return v
            if type(x) is list or type(x) is tuple:
                return type(x)(fix(y) for y in x)
            return x

        args = tuple(fix(a) for a in args)
        kwargs = {k: fix(v) for k, v in kwargs.items()}
        return args, kwargs

    def add_external(self, t) -> None:
        self.ids[id(t)] = ~len(self.extw)
        self.extw.append(_wref(t))
        if self.hot:
            self.exts.append(t)

    def add_value(self, t, storage=None) -> None:
        self.ids[id(t)] = len(self.outw)
        self.outw.append(_wref(t))
        self.stor.append(storage)

    def add_cold_fresh(self, t) -> None:
        """A fresh output of a cold op: tracked by a weak reference to its storage."""
        self.cold_storage[len(self.outw)] = ref = storage.weak(t)
        self.cold_idents[ref] = len(self.outw)
        self.add_value(t)

    def alive(self, i: int) -> bool:
        """Is value i still reachable (Note [Liveness]): its storage, else its object."""
        ref = self.cold_storage.get(i)
        if ref is not None:
            return not _expired(ref)
        return self.outw[i]() is not None

    def mutated_externals(self) -> set:
        """Indices of externals written by the segment's ops so far.

        Kept incrementally: each call walks only the trie nodes added since the last one
        (the segment's node only ever moves down the trie), so host-scalar ops and reads,
        which ask once or twice per optimizer parameter, cost O(1) each rather than a walk of
        the whole segment (quadratic in its length).
        """
        node = self.node
        if node is None or node is self._written_at:
            return self._written
        stop = self._written_at.depth
        written = self._written
        n = node
        while n.depth > stop:
            for m in n.spec.mutates:
                if type(m) is Ext:
                    written.add(m.k)
            n = n.parent
        self._written_at = node
        return written

    def involves(self, t) -> bool:
        """Is ``t`` a value of this segment, or written by one of its ops?

        Structural, so cold and hot runs cut segments at the same places: a read of such a
        tensor is a sync that ends the segment (and, when hot, needs the deferred ops).
        """
        src = self.source(t)
        if type(src) is Val:
            return True
        if src is None and storage.alone(t):  # an optimizer's step count, every parameter
            return False
        written = self.mutated_externals()
        if type(src) is Ext and src.k in written:
            return True
        if not written:
            return False
        # An external the segment does not write may still be a view of one it does (a view
        # made by a deferred view op of a written external is an external of its own).
        return self._aliases(t, written)

    def on_value_memory(self, tensors) -> bool:
        """Does one of ``tensors``, new to the segment, sit on a fresh value's memory? Note
        [Memory of a value]. Asked when a node is learned, in a cold segment (a hot one that
        meets an op it does not expect launches and goes on cold first), whose fresh values
        are the cold ones."""
        idents = self.cold_idents
        return bool(idents) and any(storage.nbytes(t) and storage.ident(t) in idents
                                    for t in tensors)

    def feeds(self, t) -> bool:
        """Is ``t`` (or its storage) an input of this segment, so writing it must wait?"""
        if self.source(t) is not None:
            return True
        return not storage.alone(t) and self._aliases(t, None)

    def _aliases(self, t, ks) -> bool:
        """Does ``t`` share storage with an external in ``ks`` (None: any external)?

        A dict from storage address to externals, extended with the externals added since
        the last call, makes this a lookup; each hit is confirmed on the live tensor (an
        external may have died and its memory been reused).
        """
        ptr = storage.ptr(t)
        if ptr is None:
            return False
        index = self._by_storage
        extw = self.extw
        for k in range(self._n_indexed, len(extw)):
            x = extw[k]()
            at = storage.ptr(x) if x is not None else None
            if at is not None:
                index.setdefault(at, []).append(k)
        self._n_indexed = len(extw)
        for k in index.get(ptr, ()):
            if ks is None or k in ks:
                x = extw[k]()
                if x is not None and storage.ptr(x) == ptr:
                    return True
        return False

    def drop_deferred(self) -> None:
        """After a flush mid-segment: nothing is pending any more; keep the numbering."""
        self.hot = False
        self.expect = None
        self.owner.release_weak(self.stor)
        self.stor = [None] * len(self.stor)
        self._hot_idents = {}
        self._n_hot_indexed = len(self.stor)
        self.exts = []
        self.serial += 1
        self.rng = None
