"""Learning: new trie nodes from cold runs.

A cold run executes the op eagerly; ``make_node`` describes what came out (the op's
``OpSpec``: its arguments as segment leaves, its outputs' metadata, what it writes), so a
deferred run of the same op needs no shape inference. What happens to the paths these nodes
form, at each segment end, is tracer.lifecycle.
"""

from __future__ import annotations

import torch

from adaptive_eager.scheduler.program import Ext, Meta, OpSpec, Out, Val

from .optable import OpClass
from .signature import Unsupported, is_plain, out_specs, resolve_new, tree_of
from .trie import Node

__all__ = ["make_node", "register_outputs", "same_outputs", "tensors_of", "written_metas"]


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
