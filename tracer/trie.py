"""The trace trie: every path the program has run from a segment boundary, op by op.

A node is one op at one position of a segment; its edge key is the op's signature
(tracer.signature). It counts ``visits`` (cold runs through it) and ``ends`` (segments that
ended or were flushed there), caches the op's output metadata in its ``OpSpec`` -- so a
deferred op needs no shape inference -- and, where segments end, holds the ``Path`` artifact
whose state machine (cold/warm/hot/retired) lives in scheduler.launch.

Hot marking: when a path's graph becomes ready every node on it counts one more hot end
below it (``hot_ends``), and each parent's ``hot_next`` points at the child the hot path
takes: that pointer is all the hot path follows. ``ends_here`` marks a node where a hot path
ends with nothing hot below it, on a device whose queue wants early launches, or a cut
(Note [Cuts] in tracer.learn): the segment launches right after the node's op instead of at
the next boundary.
"""

from __future__ import annotations

from .signature import make_fast

__all__ = ["Node", "new_root"]


class Node:
    __slots__ = (
        "parent", "depth", "key", "spec", "children", "visits", "ends", "hot_ends",
        "hot_next", "ends_here", "fast", "path", "n_ext", "n_vals", "blocked", "diverged",
        "cut", "__weakref__",
    )

    def __init__(self, parent, key, spec, n_ext: int, n_vals: int):
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.key = key
        self.spec = spec
        self.children: dict = {}
        self.visits = 0
        self.ends = 0
        self.hot_ends = 0
        self.hot_next = None
        self.ends_here = False
        self.fast = None
        self.path = None  # scheduler.launch.Path once segments end here
        self.n_ext = n_ext  # external inputs seen from the root through this op
        self.n_vals = n_vals  # segment values produced from the root through this op
        self.blocked = ""  # why this node never defers (unstable metadata), else ""
        self.diverged = 0  # hot segments that did not follow any hot child of this node
        self.cut = ""  # why segments always end after this node (Note [Cuts]), else ""

    @property
    def hot(self) -> bool:
        return self.hot_ends > 0

    def __repr__(self):
        what = "root" if self.spec is None else str(self.spec.func)
        return f"Node({what}, depth={self.depth}, visits={self.visits}, ends={self.ends})"

    def chain(self) -> list:
        """Nodes from the root's child down to this node."""
        out = []
        n = self
        while n.parent is not None:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def specs(self) -> list:
        return [n.spec for n in self.chain()]


def new_root() -> Node:
    return Node(None, None, None, 0, 0)


def mark_hot(end: Node) -> None:
    """A graph for the path ending at ``end`` is ready: make the path deferrable."""
    nodes = end.chain()
    for n in nodes:
        if n.fast is None:
            n.fast = make_fast(n, n.parent.n_ext)
    for n in nodes:
        n.hot_ends += 1
        n.parent.hot_next = n
    _refresh_ends(nodes)


def unmark_hot(end: Node) -> None:
    """The path ending at ``end`` no longer has a graph."""
    nodes = end.chain()
    for n in nodes:
        n.hot_ends -= 1
    for n in nodes:
        p = n.parent
        if p.hot_next is n and not n.hot:
            p.hot_next = next((c for c in p.children.values() if c.hot), None)
    _refresh_ends(nodes)


def _ends_here(n) -> bool:
    if n.cut:
        return True
    p = n.path
    return p is not None and p.state in ("warm", "hot") and p.launch_early and n.hot_next is None


def _refresh_ends(nodes) -> None:
    for n in nodes:
        n.ends_here = _ends_here(n)
        if n.parent is not None:
            n.parent.ends_here = _ends_here(n.parent)
