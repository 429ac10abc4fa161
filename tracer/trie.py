"""The trace trie: every path the program has run from a segment boundary, op by op.

A node is one op at one position of a segment; its edge key is the op's signature
(tracer.signature). It counts ``visits`` (cold runs through it) and ``ends`` (segments that
ended or were flushed there), caches the op's output metadata in its ``OpSpec`` -- so a
deferred op needs no shape inference -- and, where segments end, holds the ``Path`` artifact
whose life (cold/warm/hot/retired) is tracer.lifecycle.

Hot marking (done by tracer.lifecycle): every node on a warm or hot path counts one more hot
end below it (``hot_ends``), and each parent's ``hot_next`` points at the child the hot path
takes: that pointer is all the hot path follows. ``ends_here`` marks a node where a hot path
ends with nothing hot below it, on a device whose queue wants early launches, or a cut
(Note [Cuts] in tracer.lifecycle): the segment launches right after the node's op instead of
at the next boundary.
"""

from __future__ import annotations

__all__ = ["Node", "changed", "new_root"]

# Bumped whenever the nodes a hot path takes or where it ends may have changed (hot marking,
# cuts, blocks): plans built from the trie for the dispatch key (tracer.hot_plan) are stale.
epoch = 0


def changed() -> None:
    global epoch
    epoch += 1


class Node:
    __slots__ = (
        "parent", "depth", "key", "spec", "children", "visits", "ends", "hot_ends",
        "hot_next", "ends_here", "fast", "step", "plan", "fast_end", "path", "n_ext", "n_vals", "blocked", "diverged",
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
        self.step = None  # its step for the dispatch key's plans (tracer.hot_plan): False if none
        self.plan = None  # (trie epoch, the plan of what follows it, or None)
        self.fast_end = None  # its path's launch at a read, below the floor (tracer.hot_plan)
        self.path = None  # tracer.lifecycle.Path once segments end here
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

    def value_meta(self, i: int):
        """The Meta of segment value i as the node on this path that made it learned it: a
        fresh output's; None for a view's, or for a value this path has not made."""
        n = self
        while n.spec is not None and n.parent.n_vals > i:
            n = n.parent
        if n.spec is None or i >= n.n_vals:
            return None
        j = n.parent.n_vals
        for o in n.spec.outs:
            if o.kind in ("fresh", "view"):
                if j == i:
                    return o.meta if o.kind == "fresh" else None
                j += 1
        return None


def new_root() -> Node:
    return Node(None, None, None, 0, 0)
