"""Op signatures (DESIGN §4) and the per-node hot-path function generated from them.

``describe`` computes, on the cold path, an op's *key* -- the hashable signature a trie edge
is stored under -- and its *template* (arguments with tensor leaves replaced by their source,
see scheduler.program). What the key holds, and why:

* the ``OpOverload`` (identity);
* per tensor argument its source: ``("v", i)`` segment value i, ``("e", k)`` an external
  input seen before in this segment, or ``("E", shape, stride, offset, dtype, device)`` a new
  external -- internal values need no metadata, the path determines it;
* floats by *type only* (``("f",)``): they are data (step sizes, learning rates) and are
  recorded per call; ops whose output shape depends on a float value (``arange``,
  ``interpolate`` by scale) key them by value;
* for a view of an external input, its ints by type only, and its outputs' shapes and
  strides instead (Note [External views]);
* every other non-tensor argument by ``(type, value)``: 1, 1.0 and True hash alike but
  promote differently, and ints are shapes, so they are never lifted.

Ambient state that changes what an op computes is not in the key; it turns deferral off
instead (deterministic algorithms, checked at segment start).

Note [External views]: ``xs[i]`` selects a new offset of the same external each step, and
``weight.t()`` views a parameter. A view whose base is an external input is an external
too: it is identified by what it produces (its outputs' metadata), its int arguments are
recorded per call like floats, and its outputs enter the segment as new externals. So the
loop index does not make every step a new path. Fused graphs take such views as inputs,
unless the segment writes the viewed external: then the view is computed inside the graph
from its base (scheduler.backends), so the write and the reads stay ordered.

``make_fast`` turns a node's template into a Python function -- the hot path -- that checks an
incoming call against it with identity tests (``args[0] is outw[3]()``) and the few metadata
compares a new external needs, allocates outputs from cached metadata and records the
floats. It accepts exactly the calls whose key ``describe`` would compute as the node's key.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from adaptive_eager.scheduler import storage
from adaptive_eager.scheduler.program import Ext, Rec, Meta, Out, Val, _minimal

__all__ = ["Observed", "Unsupported", "observe", "describe", "make_fast", "MISS", "PLAIN",
           "is_plain"]

MISS = object()
EMPTY: tuple = ()
PLAIN: set = {torch.Tensor, torch.nn.Parameter}
# device type -> allocate(shape, stride, dtype): a device's own allocator for the hot path's
# fresh outputs, where going through the dispatcher costs more (a Python device's factory).
ALLOCATORS: dict = {}
_NOT_PLAIN: set = set()


def is_plain(t) -> bool:
    """A dense strided tensor of a type without its own ``__torch_dispatch__``, not quantized
    (a quantized tensor is strided, but its data is not its dtype's values) and not a zero
    tensor (``_efficientzerotensor``, which autograd makes for gradients known to be zero:
    it has no memory)."""
    tp = type(t)
    if tp not in PLAIN:
        if tp in _NOT_PLAIN:
            return False
        if getattr(tp, "__torch_dispatch__", None) is torch.Tensor.__torch_dispatch__:
            PLAIN.add(tp)
        else:
            _NOT_PLAIN.add(tp)
            return False
    return t.layout is torch.strided and not t.is_quantized and not t._is_zerotensor()


class Unsupported(Exception):
    """The op cannot be keyed (its reason is counted as a boundary)."""


def ext_key(t) -> tuple:
    # No storage offset: no op's output metadata depends on it, and fused graphs take any
    # (misaligned inputs are copied by Inductor's own input check).
    return ("E", tuple(t.shape), t.stride(), t.dtype, t.device)


def out_key(res) -> tuple:
    leaves = (res,) if isinstance(res, torch.Tensor) else tuple(res)
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in leaves)


@dataclasses.dataclass(slots=True, eq=False)
class Observed:
    """One call as the cold path observed it: what it is, its signature and what it gave.

    Made once per cold op by ``observe`` and carried through the tracer (the trie lookup,
    the eager run, ``learn.make_node``) rather than a dozen loose values.
    """

    func: object  # the OpOverload
    info: object  # its tracer.optable.OpInfo
    args: tuple
    kwargs: dict
    tensors: list  # tensor arguments, flattened
    ext_view: bool  # a view of an external input (Note [External views])
    key: tuple  # the trie edge: (func, key args, key kwargs, output or dtype key)
    t_args: tuple  # template: tensor leaves replaced by their source, Rec for recorded values
    t_kwargs: dict
    new: list  # tensors new to the segment, in order of first appearance
    recorded: list  # values of the Rec leaves
    res: object = None  # the eager result, once run
    written: list | None = None  # (tensor, shape, stride) of out= arguments before the run

    @property
    def factory_dtype(self):
        """The default dtype a factory (no tensor argument) was created under, else None."""
        return None if self.ext_view else self.key[3]


def observe(func, info, args, kwargs, tensors, source, ext_view: bool) -> Observed:
    """Describe a call (raises ``Unsupported``). A view of an external input is keyed by what
    it produces, so it runs here (views read no data: running one early changes nothing)."""
    ka, kk, ta, tk, new, recorded = describe(
        args, kwargs, source, info.float_values_matter, record_ints=ext_view
    )
    op = Observed(func, info, args, kwargs, tensors, ext_view, (), ta, tk, new, recorded)
    if ext_view:
        op.res = func(*args, **kwargs)
        op.key = (func, ka, kk, out_key(op.res))
    else:
        op.key = (func, ka, kk, torch.get_default_dtype() if not tensors else None)
    return op


def describe(args, kwargs, source, floats_by_value: bool, record_ints: bool = False):
    """Key and template of a call.

    ``source(t)`` returns a tensor's Val/Ext leaf or None when it is new to the segment.
    Returns (key_args, key_kwargs, t_args, t_kwargs, new_tensors, recorded) where
    ``recorded`` holds the values of the call's Rec leaves (floats; ints too when
    ``record_ints``).
    """
    new: list = []
    new_ids: dict = {}
    floats: list = []

    def leaf(x):
        if isinstance(x, torch.Tensor):
            src = source(x)
            if src is None:
                k = new_ids.get(id(x))
                if k is None:
                    k = new_ids[id(x)] = len(new)
                    new.append(x)
                    return ext_key(x), ("new", k)
                return ("n", k), ("new", k)
            if type(src) is Val:
                return ("v", src.i), src
            return ("e", src.k), src
        tx = type(x)
        if tx is float and not floats_by_value or tx is int and record_ints:
            floats.append(x)
            return ("f" if tx is float else "i",), Rec(len(floats) - 1)
        if tx is list or tx is tuple or tx is torch.Size:
            pairs = [leaf(y) for y in x]
            return (tx, tuple(p[0] for p in pairs)), (list if tx is list else tuple)(
                p[1] for p in pairs
            )
        if x is None:
            return None, None
        if isinstance(x, torch.Generator):
            raise Unsupported("explicit generator argument")
        try:
            hash(x)
        except TypeError:
            raise Unsupported(f"unhashable argument of type {tx.__name__}") from None
        return (tx, x), x

    ka, ta = [], []
    for a in args:
        k, t = leaf(a)
        ka.append(k)
        ta.append(t)
    kk, tk = [], {}
    for name, v in kwargs.items():
        k, t = leaf(v)
        kk.append((name, k))
        tk[name] = t
    return tuple(ka), tuple(kk), tuple(ta), tk, new, floats


def resolve_new(template, base: int):
    """Replace ("new", k) placeholders by Ext(base + k)."""
    if type(template) is tuple and len(template) == 2 and template[0] == "new":
        return Ext(base + template[1])
    if type(template) in (list, tuple):
        return type(template)(resolve_new(t, base) for t in template)
    if type(template) is dict:
        return {k: resolve_new(v, base) for k, v in template.items()}
    return template


# --------------------------------------------------------------------------- codegen


class _Gen:
    def __init__(self):
        self.lines: list = []
        self.consts: dict = {}
        self.n = 0

    def const(self, value) -> str:
        name = f"C{len(self.consts)}"
        self.consts[name] = value
        return name

    def var(self) -> str:
        self.n += 1
        return f"x{self.n}"

    def emit(self, line: str, indent: int = 1) -> None:
        self.lines.append("    " * indent + line)


# Note [Shared fast-path code]: every value a node's fast path compares against (shapes,
# dtypes, the index of the value or external an argument must be) is a name in the
# function's globals, never a literal of its source. Nodes of the same structure therefore
# have the same source and share one code object: compiling a few hundred functions cost
# ~0.2 ms each, the slowest step of a Llama training loop's warm-up (measured).
_CODE: dict = {}
_CODE_MAX = 4096


def make_fast(node, n_ext_before: int):
    """Generate the hot-path function of ``node`` (see module docstring)."""
    spec = node.spec
    g = _Gen()
    checks: list = []  # conditions that, if true, mean MISS
    new_exts: list = []  # (var, meta) in order of first appearance

    def leaf(expr: str, t):
        tt = type(t)
        if tt is Val:
            checks.append(f"{expr} is not outw[{g.const(t.i)}]()")
        elif tt is Ext:
            if t.k < n_ext_before:
                checks.append(f"{expr} is not exts[{g.const(t.k)}]")
            else:
                meta = spec.ext_metas[t.k - n_ext_before]
                v = g.var()
                g.emit(f"{v} = {expr}")
                if t.k - n_ext_before < len(new_exts):
                    checks.append(f"{v} is not {new_exts[t.k - n_ext_before][0]}")
                    return
                distinct = "".join(f" or {v} is {w}" for w, _ in new_exts)
                new_exts.append((v, meta))
                checks.append(
                    f"type({v}) not in PLAIN or {v}.layout is not STRIDED or "
                    f"{v}.dtype is not {g.const(meta.dtype)} or {v}.shape != "
                    f"{g.const(meta.shape)} or {v}.stride() != {g.const(meta.stride)} or "
                    f"{v}.device != {g.const(meta.device)} or "
                    f"S.source({v}) is not None{distinct}"
                )
        elif tt is Rec:
            v = f"f{t.j}"
            g.emit(f"{v} = {expr}")
            checks.append(f"type({v}) is not {spec.rec_types[t.j].__name__}")
        elif tt is list or tt is tuple:
            v = g.var()
            g.emit(f"{v} = {expr}")
            if any(type(y) in (Val, Ext, Rec, list, tuple) for y in t):
                checks.append(f"type({v}) is not {tt.__name__} or len({v}) != {len(t)}")
                _flush_checks()
                for i, y in enumerate(t):
                    leaf(f"{v}[{i}]", y)
            else:
                checks.append(f"type({v}) is not {tt.__name__} or {v} != {g.const(t)}")
        elif t is None or tt is bool:
            checks.append(f"{expr} is not {t!r}")
        elif isinstance(t, (torch.dtype, torch.layout, torch.memory_format)):
            checks.append(f"{expr} is not {g.const(t)}")
        else:
            v = g.var()
            g.emit(f"{v} = {expr}")
            checks.append(f"type({v}) is not {g.const(tt)} or {v} != {g.const(t)}")

    def _flush_checks():
        # Emit pending checks now: later element accesses rely on them (type, length).
        for c in checks:
            g.emit(f"if {c}: return MISS")
        checks.clear()

    g.emit(f"if len(a) != {len(spec.args)}: return MISS")
    if spec.kwargs:
        g.emit(f"if len(k) != {len(spec.kwargs)}: return MISS")
    else:
        g.emit("if k: return MISS")
    g.emit("outw = S.outw; exts = S.exts; ids = S.ids")
    if spec.default_dtype is not None:
        g.emit(f"if get_default_dtype() is not {g.const(spec.default_dtype)}: return MISS")
    for i, t in enumerate(spec.args):
        leaf(f"a[{i}]", t)
    for name, t in spec.kwargs.items():
        leaf(f"k.get({name!r}, MISS)", t)
    _flush_checks()
    if spec.ext_view:
        g.emit(f"r = {g.const(spec.func._op)}(*a, **k)")  # OpOverload.__call__'s own call
        outs = [o for o in spec.outs if o.kind == "ext"]
        if spec.tree == "one":
            g.emit("leaves = (r,)")
        else:
            g.emit("leaves = r")
            g.emit(f"if len(leaves) != {len(outs)}: return MISS")
        for j, o in enumerate(outs):
            g.emit(f"t = leaves[{j}]")
            g.emit(f"if t.shape != {g.const(o.meta.shape)} or t.stride() != "
                   f"{g.const(o.meta.stride)}: return MISS")
    if node.depth == 1:
        g.emit("if not S.hot and not S.start(): return MISS")
    for v, _ in new_exts:
        g.emit(f"ids[id({v})] = ~len(exts); exts.append({v}); S.extw.append(wref({v}))")
    if spec.n_floats:
        g.emit(f"S.floats.append(({', '.join(f'f{j}' for j in range(spec.n_floats))},))")
    else:
        g.emit("S.floats.append(EMPTY)")
    if spec.random:
        g.emit("if S.rng is None: S.rng = get_rng_state()")
    # outputs
    results = []
    if spec.ext_view:
        g.emit("for t in leaves:")
        g.emit("ids[id(t)] = ~len(exts); exts.append(t); S.extw.append(wref(t))", 2)
        result = "r"
    elif spec.view:
        g.emit(f"r = {g.const(spec.func._op)}(*a, **k)")
        if spec.tree == "one":
            g.emit("ids[id(r)] = len(outw); outw.append(wref(r)); S.stor.append(None)")
        else:
            g.emit("for t in r:")
            g.emit("ids[id(t)] = len(outw); outw.append(wref(t)); S.stor.append(None)", 2)
        result = "r"
    else:
        for o in spec.outs:
            if o.kind == "fresh":
                m = o.meta
                v = g.var()
                alloc = ALLOCATORS.get(m.device.type)
                if m.offset == 0 and _minimal(m) and alloc is not None:
                    g.emit(f"{v} = {g.const(alloc)}({g.const(m.shape)}, {g.const(m.stride)}, "
                           f"{g.const(m.dtype)})")
                elif m.offset == 0 and _minimal(m):
                    g.emit(f"{v} = empty_strided({g.const(m.shape)}, {g.const(m.stride)}, "
                           f"dtype={g.const(m.dtype)}, device={g.const(m.device)})")
                else:
                    g.emit(f"{v} = {g.const(m)}.allocate()")
                g.emit(f"ids[id({v})] = len(outw); outw.append(wref({v})); "
                       f"S.stor.append({g.const(storage)}.weak({v}))")
                results.append(v)
            elif o.kind == "alias":
                results.append(f"a[{o.arg}]" if type(o.arg) is int else f"k[{o.arg!r}]")
            else:
                results.append("None")
        if spec.tree == "one":
            result = results[0]
        elif spec.tree == "none":
            result = "None"
        elif spec.tree == "tuple":
            result = "(" + ", ".join(results) + ",)"
        else:
            result = "[" + ", ".join(results) + "]"
    g.emit("S.node = N; S.expect = N.hot_next")
    g.emit("if N.ends_here: S.finish()")
    g.emit(f"return {result}")
    src = "def fast(a, k, S):\n" + "\n".join(g.lines) + "\n"
    ns = dict(
        g.consts, MISS=MISS, EMPTY=EMPTY, PLAIN=PLAIN, STRIDED=torch.strided, N=node,
        wref=weakref.ref, empty_strided=torch.empty_strided,
        get_rng_state=torch.get_rng_state,
        get_default_dtype=torch.get_default_dtype,
    )
    code = _CODE.get(src)
    if code is None:
        if len(_CODE) >= _CODE_MAX:
            _CODE.clear()
        code = _CODE[src] = compile(src, "<adaptive_eager fast path>", "exec")
    exec(code, ns)
    fast = ns["fast"]
    fast.source = src
    return fast


def out_specs(func, info, args, kwargs, res, tree: str):
    """Describe each tensor leaf of an eagerly computed result (learn time)."""
    leaves = (res,) if tree == "one" else () if tree == "none" else tuple(res)
    outs = []
    in_storages = None
    fresh_storages: set = set()
    for j, t in enumerate(leaves):
        if t is None:
            outs.append(Out("none"))
            continue
        alias = info.out_alias[j] if j < len(info.out_alias) else None
        if alias is not None:
            names = [a.name for a in func._schema.arguments]
            pos = names.index(alias)
            arg = pos if pos < len(args) else alias
            outs.append(Out("alias", arg=arg))
            continue
        if in_storages is None:
            in_storages = {storage.ptr(x) for x in _tensors(args, kwargs)} - {None}
        ptr = storage.ptr(t)
        if ptr is not None and (ptr in in_storages or ptr in fresh_storages):
            raise Unsupported("output shares storage with an input or another output")
        if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            # a replay writes each fresh output into the tensor the program holds, and a
            # tensor whose elements share memory (empty_strided with a 0 stride) cannot be
            # written. Read from the metadata: an op here (torch._debug_has_internal_overlap)
            # would be a sync on an asynchronous device.
            raise Unsupported("result has elements that share memory")
        fresh_storages.add(ptr)
        outs.append(Out("fresh", Meta.of(t)))
    return tuple(outs)


def describe_kind(t) -> str:
    """What kind of tensor ``t`` is, for a reason's text: type, layout and dtype."""
    zero = ", zero tensor" if t._is_zerotensor() else ""
    return f"{type(t).__name__}, {t.layout}, {t.dtype}{zero}"


def tree_of(res) -> str:
    """How a result is shaped: "none", "one" tensor, a "tuple" or a "list" of them.

    A result that is not plain strided tensors (``to_sparse``, ``quantize_per_tensor``, a
    nested tensor) is Unsupported: the op is a counted boundary, its result left as it is.
    """
    if res is None:
        return "none"
    if isinstance(res, torch.Tensor):
        tree, leaves = "one", (res,)
    elif type(res) is tuple:
        tree, leaves = "tuple", res
    elif type(res) is list:
        tree, leaves = "list", res
    else:
        raise Unsupported(f"result of type {type(res).__name__}")
    for t in leaves:
        if isinstance(t, torch.Tensor) and not is_plain(t):
            raise Unsupported(f"result is not a plain tensor ({describe_kind(t)})")
    return tree


def _tensors(args, kwargs):
    stack = list(args) + list(kwargs.values())
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif type(x) in (list, tuple):
            stack.extend(x)
