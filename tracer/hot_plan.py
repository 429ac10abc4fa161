"""Plans: what a hot segment expects next, compiled for the dispatch key (csrc/hot_segment.cpp).

With ``NEURON_ADAPTIVE_EAGER_HOT_PATH=key`` (the default; Note [Below the floor]), after the
mode handled an op of a hot segment, or ended a segment, the key asks ``plan(mode)`` for the
ops the segment expects next (a plan from the trie's root starts the next segment hot at its
first op, as ``Segment.start``: a step's first op needs no Python either): the trie nodes along ``hot_next`` from the segment's node, each compiled once
into a ``Step`` (its checks per schema argument and its results, what the node's fast path
checks and makes; a value's twin taken for the value, Note [Memory of a value]; a view op
runs at once, as there, a view of an external checked by what it produces; a random op keeps
the generator's state at the segment's first, as there), up to the first
node that needs Python: an output ``empty_strided`` cannot make or on a device
with an allocator in Python (the Python emulator), an argument of a kind not compiled, a
node where the segment launches early (``ends_here``) or is cut. The key then serves those
ops in C++, runs at once the ops the mode would run outside the segment (host scalars, cpu
ops beside a device's segment, profiler ranges), and hands what it served back to the
segment (``hand_back``) at the first other op the plan does not expect, or whenever the
engine's Python touches the segment.
"""

from __future__ import annotations

import functools

import torch

from adaptive_eager.scheduler.program import Ext, Rec, Val

from adaptive_eager.scheduler import launch as _launch
from adaptive_eager.scheduler.queues import queue_for

from . import lifecycle, native, trie

__all__ = ["plan", "step_of", "fast_end"]

_REC_KIND = {float: 0, int: 1, bool: 2}
_LONGEST = 4096  # steps in one plan: the key asks again where one ends
_FORKS = 64  # forks in one plan and its forks, all told (Note [Forks in a plan])
_HOST_SCALARS, _HOST_CPU = 1, 2  # csrc/hot_segment.cpp: Host
_VALUES = (type(None), bool, int, float, str, torch.dtype, torch.layout, torch.memory_format,
           torch.device)


_Python = native._Python  # the node needs Python (the reason)


def _leaf(t, param, n_ext_before: int, spec, seen_new: dict, node=None):
    tt = type(t)
    if tt is Val:
        meta = node.parent.value_meta(t.i) if node is not None else None
        if meta is None:
            return ("val", t.i)
        # a twin of a fresh value is the value (Note [Memory of a value]): what it must be
        return ("val", t.i, meta.dtype, list(meta.shape), list(meta.stride), meta.offset)
    if tt is Ext:
        if t.k < n_ext_before:
            return ("ext", t.k)
        j = t.k - n_ext_before
        if j in seen_new:
            return ("same", j)
        seen_new[j] = True
        m = spec.ext_metas[j]
        return ("new", j, m.dtype, list(m.shape), list(m.stride), m.device)
    if tt is Rec:
        kind = _REC_KIND.get(spec.rec_types[t.j])
        if kind is None:
            raise _Python(f"a recorded {spec.rec_types[t.j].__name__}")
        return ("rec", t.j, kind)
    if tt is list or tt is tuple:
        if not any(type(y) in (Val, Ext, Rec, list, tuple) for y in t):
            return ("value", t)
        if str(param.type) == "List[int]":  # sizes an external's view records per call
            return ("ints", [_leaf(y, param, n_ext_before, spec, seen_new, node) for y in t])
        if str(param.type) != "List[Tensor]":
            raise _Python(f"a list of {param.type}")
        return ("tensors", [_leaf(y, param, n_ext_before, spec, seen_new, node) for y in t])
    if isinstance(t, _VALUES):
        return ("value", t)
    raise _Python(f"an argument of type {tt.__name__}")


def _describe(node):
    spec = node.spec
    if node.blocked:
        raise _Python("a blocked node")
    params = spec.func._schema.arguments
    if len(spec.args) > len(params):
        raise _Python("more arguments than the schema")
    n_ext_before = node.parent.n_ext
    seen: dict = {}
    checks = []
    for i, p in enumerate(params):
        if i < len(spec.args):
            checks.append(_leaf(spec.args[i], p, n_ext_before, spec, seen, node))
        elif p.name in spec.kwargs:
            checks.append(_leaf(spec.kwargs[p.name], p, n_ext_before, spec, seen, node))
        elif p.has_default_value():
            checks.append(("default",))
        else:
            raise _Python(f"argument {p.name} missing")
    if set(spec.kwargs) - {p.name for p in params}:
        raise _Python("a keyword the schema does not have")
    names = [p.name for p in params]
    outs = []
    for o in () if spec.view and not spec.ext_view else spec.outs:  # a view's: its op's
        if o.kind == "ext":  # a view of an external, itself one: what it must look like
            outs.append(("ext", list(o.meta.shape), list(o.meta.stride)))
        elif o.kind == "fresh":
            outs.append(native.fresh_out(o.meta))
        elif o.kind == "alias":
            outs.append(("alias", o.arg if type(o.arg) is int else names.index(o.arg)))
        elif o.kind == "none":
            outs.append(("none",))
        else:
            raise _Python(f"a result of kind {o.kind}")
    returns = spec.func._schema.returns
    as_list = len(returns) == 1 and str(returns[0].type) == "List[Tensor]"
    if not spec.view and not as_list and len(outs) != len(returns):
        raise _Python("results that are not the schema's")
    return checks, outs, len(seen)


def step_of(node, module):
    """The node's compiled step, or None where it needs Python (built once, kept on it)."""
    step = node.step
    if step is None:
        try:
            checks, outs, n_new = _describe(node)
            schema = node.spec.func._schema
            step = module.make_step(schema.name, schema.overload_name, checks, outs,
                                    node.spec.n_floats, n_new, node.spec.default_dtype,
                                    node.spec.view, node.spec.random)
        except (_Python, RuntimeError, TypeError, ValueError):
            step = False
        node.step = step
    return step or None


def plan(mode, module):
    """(the plan for what the mode's hot segment expects next, the segment), or None."""
    S = mode.seg
    start = S.node
    # a segment not begun yet is planned from the root: its first op starts it hot
    starts = start is S.root and not S.hot and S.expect is not None
    if (not S.hot and not starts) or mode.paused or start is None or len(S.exts) != len(S.extw):
        return None
    # A plan is kept on its first node until the trie's hot marking changes (trie.epoch). The
    # root's ``hot_next`` changes without that: a step of several segments takes another of
    # the root's children at each, so the root keeps a plan per child it starts.
    first = start.hot_next
    plans = _plans(start)
    built = plans.get(first, False)
    if built is False:
        built = _plan_from(mode, module, start, first, starts, plans)
    return None if built is None else (built, S)


def _plans(start) -> dict:
    """The plans kept on ``start`` for this trie epoch, by the first node they expect."""
    cached = start.plan
    if cached is None or cached[0] != trie.epoch:
        cached = start.plan = (trie.epoch, {})
    return cached[1]


def _plan_from(mode, module, start, first, starts, plans):
    """Build (and keep in ``plans``) the plan from ``start`` through ``first``, or None."""
    try:
        built = _build(start, first, module, mode.devices, starts)
    except Exception as e:  # the program goes on through the mode, the reason counted
        mode.counters.fallback(f"no plan for the dispatch key ({type(e).__name__}: {e})")
        built = None
    plans[first] = built
    return built


def prebuild(mode, module) -> None:
    """Build now the plans ``plan`` would build at a segment's first ops: from the root for
    each of its hot children, and from each of those (a segment's first op reaches the mode,
    which hands the rest to the plan at that node). A warm start (Note [Warm start],
    tracer.warm) restores hot paths before the program's first step, whose ops would
    otherwise wait for their plans."""
    firsts = [c for c in mode.root.children.values() if c.hot]
    for start, first, starts in ([(mode.root, c, True) for c in firsts]
                                 + [(c, c.hot_next, False) for c in firsts]):
        plans = _plans(start)
        if first is not None and first not in plans:
            _plan_from(mode, module, start, first, starts, plans)


def _build(start, first, module, devices, starts=False):
    # what the plan runs at once when it does not expect it (Note [Host scalars], tracer.mode)
    host, counter = (_HOST_SCALARS, "ops_host") if "cpu" in devices else (_HOST_CPU,
                                                                          "ops_passthrough")
    forks_left = [_FORKS]

    def build(steps, nodes, parent, n):
        """The plan of ``steps`` (at ``nodes``) followed by the chain from ``n``, a child of
        ``parent``, with a fork at each other hot child on the way (Note [Forks in a plan],
        csrc/hot_segment.cpp)."""
        forks, prefix = [], len(steps)
        while n is not None and n.hot and not n.ends_here and not n.cut and len(steps) < _LONGEST:
            step = step_of(n, module)
            if step is None:
                break
            if len(steps) > prefix or not prefix:  # a fork's siblings are its plan's forks
                forks += [(len(steps), parent, c) for c in parent.children.values()
                          if c is not n and c.hot]
            steps.append(step)
            nodes.append(n)
            parent, n = n, n.hot_next
        if len(steps) == prefix:
            return None
        made = []
        for pos, at, child in forks:
            if forks_left[0] <= 0:
                break
            forks_left[0] -= 1
            fork = build(steps[:pos], nodes[:pos], at, child)
            if fork is not None:
                made.append((pos, fork))
        return module.make_plan(steps, tuple(nodes), host, counter, starts, made)

    return build([], [], start, first)


# ---------------------------------------------------------------- launches at a read

# The host reads the key launches at (csrc/hot_segment.cpp: launch_at_read), by its number.
_READ_OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)


def fast_end(mode, node, graph, live: tuple) -> None:
    """Give the path ending at ``node`` a launch at a read below the floor (Note [Launched
    below the floor], csrc/hot_segment.h), for the variant Python just launched: ``graph``
    with the fresh values ``live`` alive. Only where the launch needs nothing Python does
    around it: a synchronous queue on the host, no crosscheck, debugging or random op that
    may draw."""
    path = node.path
    config = mode.config
    if (path is None or path.end is not node or config.crosscheck or mode.debug
            or graph.device.type != "cpu" or graph.plan is None):
        return
    queue = queue_for(path.device_type)
    if queue.asynchronous or queue.host_views:
        return
    if path.zero_draws is None:  # the path's ops do not change: asked once
        path.zero_draws = (_zero_draws(path),)
    zeros = path.zero_draws[0]
    if zeros is None:
        return
    the_plan = graph.plan
    node.fast_end = mode._keyed.make_fast_end(
        list(path.fresh), list(live), [tuple(x) for x in the_plan.specialized],
        tuple(graph.spec_values), [tuple(x) for x in the_plan.lifted],
        list(the_plan.ext_inputs),
        list(the_plan.mutated_inputs) if graph.mutates_external else [],
        list(graph.live), zeros,
        [(m.dtype, list(m.shape), list(m.stride), m.offset)
         for m in (path.val_meta[i] for i in graph.live)], len(path.specs), graph.run,
        functools.partial(_ended, mode, node, graph))
    mode.fast_ends.append(node)


def _zero_draws(path):
    """Where a launch of the path draws no random numbers: the recorded probabilities, as
    (op, slot), that must be zero for it (attention's ``dropout_p=0.0`` is a recorded float),
    or None where it always may draw (a random op other than a dropout-like one, or one whose
    probability was learned nonzero). A launch that draws none needs no generator state."""
    zeros = []
    for n, spec in enumerate(path.specs):
        if not spec.random:
            continue
        at = lifecycle.probability_arg(spec.func)
        if at is None:
            return None
        i, name, default = at
        p = spec.args[i] if i < len(spec.args) else spec.kwargs.get(name, default)
        if type(p) is Rec:
            zeros.append((n, p.j))
        elif p:
            return None
    return zeros


def _ended(mode, node, graph, seconds, why, extra):
    """The bookkeeping of a launch below the floor: what ``end_segment``, ``graph_for`` and
    ``launch.run`` count for the same launch in Python, and the read that ended it (``why`` a
    number of ``_READ_OPS``; else the boundary's reason). When the graph raised (``seconds``
    None, ``extra`` the error), the segment was handed back first: returns the error to raise,
    attributed to the op eager would have failed at."""
    c = mode.counters
    path = node.path
    read = type(why) is int
    reason = _read_reason(_READ_OPS[why]) if read else why
    c.cache_hits += 1
    c.ops_deferred += len(path.specs)
    c.replays += 1
    path.replays += 1
    path.last_fused = True
    node.ends += 1
    c.segments += 1
    if seconds is None:
        S = mode.seg
        try:
            return _launch.attribute_fused(path, (S.exts, S.floats, S.rng), extra)
        finally:
            S.reset()
            c.boundary(reason, True)
    host, passed, counter = extra
    if host:
        setattr(c, counter, getattr(c, counter) + host)
    c.ops_passthrough += passed
    lifecycle.after_end(mode, node, True, seconds)
    c.boundary(reason, True)
    c.ops_eager += read  # the read
    if mode.inbox:
        lifecycle.install(mode)
    return None


def _read_reason(func):
    from .mode import _read_reason as reason  # the mode imports this module

    return reason(func)
