"""Learning: new trie nodes from cold runs, and each path's lifecycle at segment ends.

Cold runs execute the op eagerly and describe what came out (``make_node``). At a segment
end the node's ``Path`` moves through its states (scheduler.launch): after ``hot_threshold``
ends it is *warm* and its graph is requested from the background compiler; the delivery is
installed here, on the owning thread, which makes the path *hot*; a graph measured slower
than the eager segment, or a path out of variants, is *retired*.

Note [Warm paths replay exactly]: a warm path already defers. Its segments launch as one
``exact`` replay (bitwise eager, no compile needed) until the fused graph arrives, each
counted as the fallback "variant compiling: replayed exactly". A training loop therefore
reaches one launch per step after ``hot_threshold`` steps however long Inductor takes (a
cold C++ compile takes seconds on two cores), and the loop never waits for the compiler.
The exact tier is what the queue seam needs on launch-bound devices anyway: one submission
per segment.

Note [Cuts]: a hot segment *diverges* when its next op follows no hot child of the node it
reached: the deferred prefix launches and the rest runs cold. A branch that recurs soon
becomes hot itself and is followed through the slow path's key lookup; what keeps diverging
is a point where the program never repeats (a data-dependent branch, objects the signature
cannot match). After ``divergence_limit`` divergences at one node the path is *cut* there:
every segment, cold or hot, ends right after that node's op. The prefix becomes a path of
its own (deferred, launched, hot like any other), the remainder starts a new segment from
the root and goes hot on its own if it repeats, and the longer paths through the node
retire. So a path that keeps diverging costs one extra launch, counted with its reason (the
op, the node and both user lines), instead of a flush and a cold run every step; cuts are
never undone, so the trie stops growing there. A rare branch is not cut: it turns hot after
``hot_threshold`` runs and no longer diverges.

Note [Shape families]: a path's signature holds its shapes, so a decode step with a cache
that grows by one token each step is a new path at every length, each with its own compile.
Paths with the same ops in the same order whatever their shapes form a *family*; a family's
fused compiles share the variant budget (``NEURON_ADAPTIVE_EAGER_VARIANTS``). Past it a new
member goes hot as an exact replay (one launch, no compile), counted with its first line.
"""

from __future__ import annotations

import logging

import torch

from adaptive_eager.scheduler import compile_process
from adaptive_eager.scheduler.launch import COLD, HOT, RETIRED, WARM, Path
from adaptive_eager.scheduler.program import (Ext, InductorDiffers, Meta, OpFailed, OpSpec, Out,
                                              Val)

from .optable import OpClass
from .signature import Unsupported, is_plain, out_specs, resolve_new, tree_of
from .trie import Node, mark_hot, unmark_hot

__all__ = ["make_node", "after_end", "cut", "install", "request", "retire", "block"]

log = logging.getLogger("adaptive_eager")


def tensors_of(args, kwargs) -> list:
    out = []
    stack = list(args)
    if kwargs:
        stack += kwargs.values()
    for x in stack:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif type(x) in (list, tuple):
            out += [y for y in x if isinstance(y, torch.Tensor)]
    return out


def host_scalar_op(S, tensors) -> bool:
    """Note [Host scalars] in tracer.mode."""
    for t in tensors:
        if t.dim() != 0 or t.device.type != "cpu" or not is_plain(t):
            return False
    return not any(S.involves(t) for t in tensors)


def written_metas(op):
    """Metadata of the arguments an op writes through its result (``out=``), before it runs."""
    if not op.info.mutated_args:
        return None
    names = [a.name for a in op.func._schema.arguments]
    out = []
    for name in op.info.mutated_args:
        pos = names.index(name)
        x = op.args[pos] if pos < len(op.args) else op.kwargs.get(name)
        for t in x if type(x) in (list, tuple) else (x,):
            if isinstance(t, torch.Tensor):
                out.append((t, tuple(t.shape), t.stride()))
    return out


def same_outputs(spec: OpSpec, res) -> bool:
    leaves = (res,) if spec.tree == "one" else () if spec.tree == "none" else tuple(res)
    if len(leaves) != len(spec.outs):
        return False
    for o, t in zip(spec.outs, leaves):
        if o.kind == "fresh":
            m = o.meta
            if (t is None or tuple(t.shape) != m.shape or t.stride() != m.stride
                    or t.dtype is not m.dtype or t.device != m.device):
                return False
    return True


def register_outputs(S, spec: OpSpec, res) -> None:
    leaves = (res,) if spec.tree == "one" else () if spec.tree == "none" else tuple(res)
    for o, t in zip(spec.outs, leaves):
        if o.kind == "fresh":
            S.add_cold_fresh(t)
        elif o.kind == "view":
            S.add_value(t)
        elif o.kind == "ext":
            S.add_external(t)


def make_node(parent: Node, op, line: str) -> Node:
    """The trie node for ``op`` (a signature.Observed that has run) below ``parent``."""
    base = parent.n_ext
    func, info, res = op.func, op.info, op.res
    t_args = resolve_new(op.t_args, base)
    t_kwargs = resolve_new(op.t_kwargs, base)
    blocked = ""
    try:
        tree = tree_of(res)
        if op.ext_view:
            leaves = (res,) if tree == "one" else tuple(res)
            first = base + len(op.new)
            outs = tuple(Out("ext", Meta.of(t), first + j) for j, t in enumerate(leaves))
        elif info.cls is OpClass.VIEW:
            leaves = (res,) if tree == "one" else tuple(res)
            outs = tuple(Out("view") for _ in leaves)
        else:
            outs = out_specs(func, info, op.args, op.kwargs, res, tree)
        if op.written and any(tuple(t.shape) != s or t.stride() != st
                              for t, s, st in op.written):
            raise Unsupported("out= argument was resized")
    except Unsupported as u:
        blocked = f"{u.args[0]}: {func}"
        tree, outs = "none", ()
    n_vals = sum(1 for o in outs if o.kind in ("fresh", "view"))
    view_exts = tuple(o.meta for o in outs if o.kind == "ext")
    spec = OpSpec(
        func=func, args=t_args, kwargs=t_kwargs, outs=outs, tree=tree,
        val_base=parent.n_vals, n_floats=len(op.recorded),
        mutates=_mutated_leaves(parent, func, info, t_args, t_kwargs),
        random=info.random, view=info.cls is OpClass.VIEW, ext_view=op.ext_view, line=line,
        key=op.key, ext_metas=tuple(Meta.of(x) for x in op.new) + view_exts,
        default_dtype=op.factory_dtype, rec_types=tuple(type(v) for v in op.recorded),
    )
    node = Node(parent, op.key, spec, parent.n_ext + len(spec.ext_metas), parent.n_vals + n_vals)
    node.blocked = blocked
    return node


def _mutated_leaves(parent: Node, func, info, t_args, t_kwargs) -> tuple:
    """Ext/Val leaves the op writes, plus the externals those values are views of."""
    if not info.mutated_args:
        return ()
    names = [a.name for a in func._schema.arguments]
    leaves = []
    for name in info.mutated_args:
        pos = names.index(name)
        x = t_args[pos] if pos < len(t_args) else t_kwargs.get(name)
        leaves += [y for y in (x if type(x) in (list, tuple) else (x,)) if type(y) in (Ext, Val)]
    for leaf in list(leaves):
        base = _view_base(parent, leaf)
        while type(base) is Ext:
            if base is not leaf:
                leaves.append(base)
            leaf, base = base, _ext_base(parent, base)
    return tuple(leaves)


def _ext_base(node: Node, ext: Ext):
    """The external an external view was taken of, or None for a true external."""
    n = node
    while n.spec is not None and not (n.parent.n_ext <= ext.k < n.n_ext):
        n = n.parent
    if n.spec is None or not n.spec.ext_view:
        return None
    if all(o.arg != ext.k for o in n.spec.outs):
        return None  # ``ext`` is this view's input, new to the segment here: a true external
    return next((a for a in n.spec.args if type(a) is Ext), None)


def _view_base(node: Node, leaf):
    """Follow view ops back from a value to the tensor it views (an Ext, or a fresh Val)."""
    while type(leaf) is Val:
        n = node
        while n.spec is not None and not (n.spec.val_base <= leaf.i < n.n_vals):
            n = n.parent
        if n.spec is None or not n.spec.view:
            return leaf
        first = next((a for a in n.spec.args if type(a) in (Ext, Val)), None)
        if first is None:
            return leaf
        leaf, node = first, n.parent
    return leaf


def block(node: Node, reason: str, mode) -> None:
    """Never defer at ``node`` again; paths through it lose their graphs."""
    node.blocked = reason
    mode.counters.fallback(reason)
    stack = [node]
    while stack:
        n = stack.pop()
        if n.path is not None and n.path.state in (WARM, HOT):
            retire(mode, n.path, reason)
        stack += n.children.values()


def path_of(mode, node: Node) -> Path:
    path = node.path
    if path is None:
        path = node.path = Path(node.specs(), mode.config.backend_for("cpu"))
        path.end = node
        mode.engine.n_paths += 1
        path.gid = mode.engine.n_paths
    return path


def after_end(mode, node: Node, was_hot: bool, seconds: float) -> None:
    path = path_of(mode, node)
    if was_hot and path.state != COLD:
        path.replay_times.append(seconds)
        if path.state == HOT and path.last_fused:
            path.hot_times.append(seconds)
            ratio = mode.config.retire_ratio
            # Under crosscheck every replay also runs eagerly: its times say nothing.
            if not mode.config.crosscheck and not path.profitable(ratio):
                retire(mode, path, f"slower than eager (ratio > {ratio})")
        return
    # A cold path: ended by a boundary after running eagerly, or, once a longer hot path was
    # cut at its end (Note [Cuts]), after being deferred as that path's prefix.
    path.observe(mode.seg.floats)
    if not was_hot:
        path.cold_times.append(seconds)
    if path.state == COLD:
        mode.learning += 1  # on its way to hot: recorded, checked, soon replayed
    if path.state == COLD and path.backend == "inductor" and mode.config.compile_process:
        compile_process.prepare()  # Note [Compiles leave the process]
    if path.state == COLD and node.ends >= mode.config.hot_threshold:
        _warm(mode, node, path)


def cut(mode, node: Node, func, line: str) -> None:
    """Segments end after ``node`` from now on (Note [Cuts]); paths through it retire."""
    reason = (f"path cut: diverged {node.diverged} times after {node.spec.func} "
              f"({node.spec.line}), at {func} ({line})")
    node.cut = reason
    mode.counters.fallback(reason)
    if mode.debug >= 1:
        log.info("%s", reason)
    stack = list(node.children.values())
    while stack:
        n = stack.pop()
        if n.path is not None and n.path.state in (WARM, HOT):
            retire(mode, n.path, "cut short: " + reason)
        stack += n.children.values()
    node.ends_here = True


def _warm(mode, node: Node, path: Path) -> None:
    if path.backend == "exact":
        path.state = HOT
        mode.counters.graphs_compiled += 1
        mark_hot(node)
        if mode.debug >= 1:
            log.info("graph%d ready: exact replay of %d ops (%s)", path.gid, len(path.specs),
                     path.specs[0].line)
        return
    S = mode.seg
    live = tuple(i for i in path.fresh if S.alive(i))
    path.state = WARM
    mark_hot(node)  # Note [Warm paths replay exactly]
    compiled = mode.families.get(path.family, 0)
    if compiled >= mode.config.variant_budget:  # Note [Shape families]
        path.fused_off = "shape variants over budget"
        path.state = HOT
        mode.counters.fallback("shape variants of one path over the variant budget: "
                               f"replayed exactly ({path.specs[0].line})")
        return
    mode.families[path.family] = compiled + 1
    request(mode, path, path.variant(live, S.floats))


def request(mode, path: Path, variant) -> None:
    key = path.graph_key(variant)
    path.variants[variant] = key
    path.pending.add(variant)
    if mode.debug >= 1:
        log.info("compiling graph%d: %d ops, %d live outputs (%s .. %s)", path.gid,
                 len(path.specs), len(variant[0]), path.specs[0].line, path.specs[-1].line)
    mode.engine.compiler.request(key, path.builder(variant, mode.config.compile_process),
                                 mode.inbox,
                                 (mode.generation, path, variant))


def install(mode) -> None:
    """Take delivered compiles (on the owning thread) and make their paths hot."""
    inbox = mode.inbox
    c = mode.counters
    while inbox:
        (generation, path, variant), graph, error, built = inbox.popleft()
        path.pending.discard(variant)
        if generation != mode.generation or path.state == RETIRED:
            continue
        if error is not None:
            # The path stays deferred as one exact replay per segment: a graph the backend
            # cannot build must not send a hot loop back to running cold.
            where = ""
            if isinstance(error, OpFailed):  # tracing the program failed at one of its ops
                where = f" at {path.specs[error.index].describe()}"
                error = error.error
            first = (str(error).splitlines() or [""])[0][:160]
            # a graph Inductor would compute otherwise than eager is refused, not failed
            differs = isinstance(error, InductorDiffers)
            what = "not fused" if differs else "compile failed"
            reason = f"{what}{where}: {type(error).__name__}: {first}"
            path.fused_off = ("Inductor would compute it otherwise than eager" if differs
                              else "its compile failed")
            c.fallback(reason)
            if mode.debug >= 1:
                log.warning("graph%d %s; replaying exactly", path.gid, reason)
            if path.state == WARM:
                path.state = HOT
            continue
        if built:
            c.graphs_compiled += 1
            c.compile_seconds += graph.compile_seconds
        graph.gid = path.gid
        if mode.debug >= 1:
            log.info("graph%d ready: %s, %d ops, compiled in %.2fs", path.gid, graph.backend,
                     len(path.specs), graph.compile_seconds)
        if mode.debug >= 4:
            log.debug("graph%d code:\n%s", path.gid, graph.code)
        if path.state == WARM:
            path.state = HOT


def retire(mode, path: Path, reason: str) -> None:
    was_hot = path.state in (WARM, HOT)
    path.retire(reason)
    mode.counters.fallback(f"path retired: {reason}")
    if mode.debug >= 1:
        log.info("graph%d retired: %s", path.gid, reason)
    if was_hot:
        unmark_hot(path.end)
