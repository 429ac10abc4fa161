"""Compiled hot paths: a trie node's fast path as one call into C++ (``csrc/fast_path.cpp``).

``make_fast(node, n_ext_before)`` returns the compiled equivalent of what
tracer.signature.make_fast generates, or None and the reason where the node needs what only
the generated Python does, which then serves it (each such node counted once as the fallback ``hot path in
Python (<why>)``). Compiled: nodes whose arguments are tensors (segment values, externals
seen before, new externals of fixed metadata), recorded floats and ints, constants, and
lists or tuples of these; whose results are fresh tensors of minimal layout, arguments
returned as they are, or None; and view ops (run at once, as in the generated code). Left to
Python: views of externals (identified by what they produce), random ops (they save the
generator's state), fresh results that need more than ``empty_strided``, and devices with an
allocator of their own (the Python device).

Both forms accept exactly the same calls and leave the segment in the same state: the
compiled one is the generated function's statement order, in C. Built with the machine's
compiler once (adaptive_eager.cpp_build); selected by ``NEURON_ADAPTIVE_EAGER_HOT_PATH``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from adaptive_eager import cpp_build
from adaptive_eager.scheduler.program import Ext, Rec, Val, _minimal

from . import signature

__all__ = ["alias_groups", "dispatcher", "live_values", "load", "make_fast", "pick_floats",
           "release_weak", "written_input_aliased"]

_CSRC = Path(__file__).with_name("csrc")
_module = None


def load():
    """The built extension (built first if needed)."""
    global _module
    if _module is None:
        _module = cpp_build.build(
            "fast_path", [_CSRC / "fast_path.cpp"], who="adaptive_eager",
            what="the compiled hot path",
            instead="set NEURON_ADAPTIVE_EAGER_HOT_PATH=python")
    return _module


_CONST_IS = (torch.dtype, torch.layout, torch.memory_format)


def _check(t, n_ext_before: int, spec, seen_new: dict):
    """The C description of one argument's check (tracer.signature.make_fast's ``leaf``)."""
    tt = type(t)
    if tt is Val:
        return ("val", t.i, None, None, None)
    if tt is Ext:
        if t.k < n_ext_before:
            return ("ext", t.k, None, None, None)
        j = t.k - n_ext_before
        if j in seen_new:
            return ("same_new", j, None, None, None)
        seen_new[j] = True
        m = spec.ext_metas[j]
        return ("new", j, None, None, (m.dtype, m.shape, m.stride, m.device))
    if tt is Rec:
        return ("rec", t.j, spec.rec_types[t.j], None, None)
    if tt is list or tt is tuple:
        if any(type(y) in (Val, Ext, Rec, list, tuple) for y in t):
            return ("seq", 0, tt, [_check(y, n_ext_before, spec, seen_new) for y in t], None)
        return ("const", 0, tt, t, None)
    if t is None or tt is bool or isinstance(t, _CONST_IS):
        return ("is", 0, None, t, None)
    return ("const", 0, tt, t, None)


class _Python(Exception):
    """The node needs the generated Python fast path (the reason)."""


def fresh_out(m) -> tuple:
    """A fresh result's allocation, ``("fresh", dtype, shape, stride, device)``, or _Python
    where ``empty_strided`` cannot make it or the device allocates from Python."""
    if not (m.offset == 0 and _minimal(m)):
        raise _Python("a result that empty_strided cannot allocate")
    if signature.ALLOCATORS.get(m.device.type) is not None:
        raise _Python("a device with its own allocator")
    return ("fresh", m.dtype, m.shape, m.stride, m.device)


def _describe(node, n_ext_before: int):
    spec = node.spec
    if spec.ext_view:
        raise _Python("a view of an external")
    if spec.random:
        raise _Python("a random op")
    seen: dict = {}
    args = [(None, _check(t, n_ext_before, spec, seen)) for t in spec.args]
    args += [(name, _check(t, n_ext_before, spec, seen)) for name, t in spec.kwargs.items()]
    outs = []
    for o in () if spec.view else spec.outs:  # a view's results are its op's
        if o.kind == "fresh":
            outs.append(fresh_out(o.meta))
        elif o.kind == "alias":
            outs.append(("alias", o.arg))
        elif o.kind == "none":
            outs.append(("none",))
        else:
            raise _Python(f"a result of kind {o.kind}")
    return args, outs, len(seen)


def make_fast(node, n_ext_before: int) -> tuple:
    """(the node's compiled fast path, "") or (None, why the generated Python one serves it)."""
    try:
        args, outs, n_new = _describe(node, n_ext_before)
    except _Python as e:
        return None, e.args[0]
    spec = node.spec
    fast = load().make(node, signature.PLAIN, signature.MISS, signature.EMPTY, args, outs,
                       spec.tree, node.depth == 1, spec.n_floats, n_new, spec.default_dtype,
                       spec.func._op if spec.view else None, spec.func)
    return fast, ""


def dispatcher(mode, empty: dict):
    """``mode``'s ``__torch_dispatch__`` in C, bound to it (tracer.mode._dispatch: the op the
    segment expects next goes to its node's fast path, compiled or not, with ``empty`` for
    no keyword arguments; an op in ``mode.host_funcs`` whose every tensor is a host scalar
    alone on its memory and unknown to the segment runs at once, counted as a host op;
    anything else, or a miss, goes to ``mode._slow``)."""
    return load().dispatcher(mode, signature.MISS, empty, signature.PLAIN, mode.host_funcs)


def alias_groups(tensors) -> tuple:
    """scheduler.program.alias_groups, compiled."""
    return load().alias_groups(tensors)


def written_input_aliased(the_plan, exts, groups_of=None) -> bool:
    """tracer.lifecycle.written_input_aliased, compiled."""
    return load().written_input_aliased(exts, the_plan.ext_inputs, the_plan.mutated_inputs)


def live_values(path, seg) -> tuple:
    """scheduler.launch.live_values, compiled."""
    return load().live_values(path.fresh, seg.stor)


def release_weak(stor) -> None:
    """tracer.segment.release_weak, compiled."""
    load().release_weak(stor)


def pick_floats(floats, at) -> tuple:
    """tracer.lifecycle.pick_floats, compiled."""
    return load().pick_floats(floats, at)
