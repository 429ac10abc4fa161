"""One graph for a shape family: a path's sizes as multiples of one symbolic size.

Note [Family graphs]: the paths of a shape family (Note [Shape families], tracer.lifecycle)
run the same ops in the same order and differ only in sizes: a training step over 50 batch
sizes is 50 paths. Each fused compile serves one of them, and past the variant budget the
rest replay exactly (~1.6x eager for a small step). So the budget's last compile of a family
that has already compiled a member is *symbolic*: the new member and the family's first are
compared position by position (every int of every op's arguments, and the shape, strides,
offset and storage size of every tensor); where they differ, both values must be multiples
``k * s`` of one size ``s`` (the batch, say: ``n``, ``n * 128``, ``n * 256``), and that
position becomes ``Sym(k)`` in a *template* of the member's program. ``backends.trace``
traces the template with ``s`` a symbolic size (its hint the member's value), Inductor
compiles it for any ``s`` its guards admit, and it hands back those guards (``SizeGuards``).
A later member of the family uses that graph when it matches the template: the same ops
and literals everywhere the template has one, and ``k * s`` for one ``s`` wherever it has
``Sym(k)``, with the guards holding for that ``s``; else it replays exactly, counted.

What is not a multiple of one size (a decode step's cache length ``L`` beside ``L + 1``, or
two independent sizes) stays one graph per member within the budget, counted.
``s`` must also be a whole dimension of some input, where the compiled wrapper reads it.
"""

from __future__ import annotations

import dataclasses
import math

from .program import Ext, Meta, OpSpec, Out, Rec, Val

__all__ = ["Sym", "NotFamily", "template", "match", "resolve", "SizeGuards"]


class Sym:
    """``k`` times the family's symbolic size, in a template."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k

    def __repr__(self):
        return f"{self.k}*s"

    def __eq__(self, other):
        return type(other) is Sym and other.k == self.k

    def __hash__(self):
        return hash(("Sym", self.k))

    def __getstate__(self):
        return self.k

    def __setstate__(self, k):
        self.k = k


class NotFamily(Exception):
    """Two programs are not one program at two sizes; the message says where."""


_SAME_FIELDS = ("func", "tree", "n_floats", "random", "view", "ext_view", "default_dtype",
                "rec_types")


def _walk(a, b, on_int):
    """``b`` rebuilt, ``on_int(a, b)`` deciding each int position where ``a`` is a ``Sym`` or
    differs from ``b``; raises NotFamily where the two differ otherwise."""
    ta = type(a)
    if ta is Sym:
        if type(b) is not int:
            raise NotFamily(f"{a!r} against {b!r}")
        return on_int(a, b)
    if ta is not type(b):
        raise NotFamily(f"{ta.__name__} against {type(b).__name__}")
    if ta is int:
        return b if a == b else on_int(a, b)
    if ta is tuple or ta is list:
        if len(a) != len(b):
            raise NotFamily(f"{len(a)} items against {len(b)}")
        return ta(_walk(x, y, on_int) for x, y in zip(a, b))
    if ta is dict:
        if a.keys() != b.keys():
            raise NotFamily("keyword arguments differ")
        return {k: _walk(a[k], b[k], on_int) for k in a}
    if ta is Meta:
        if a.dtype != b.dtype or a.device != b.device:
            raise NotFamily(f"{a.dtype} on {a.device} against {b.dtype} on {b.device}")
        return Meta(_walk(a.shape, b.shape, on_int), _walk(a.stride, b.stride, on_int),
                    _walk(a.offset, b.offset, on_int), b.dtype, b.device,
                    _walk(a.numel_storage, b.numel_storage, on_int))
    if ta is Out:
        if a.kind != b.kind or a.arg != b.arg:
            raise NotFamily(f"output {a.kind} against {b.kind}")
        return b._replace(meta=_walk(a.meta, b.meta, on_int))
    if ta is OpSpec:
        for f in _SAME_FIELDS:
            if getattr(a, f) != getattr(b, f):
                raise NotFamily(f"{f} of {b.func} differs")
        if (_indices(a.mutates) != _indices(b.mutates)) or a.val_base != b.val_base:
            raise NotFamily(f"what {b.func} writes differs")
        return dataclasses.replace(
            b, args=_walk(a.args, b.args, on_int), kwargs=_walk(a.kwargs, b.kwargs, on_int),
            outs=_walk(a.outs, b.outs, on_int), ext_metas=_walk(a.ext_metas, b.ext_metas, on_int))
    if ta in (Ext, Val, Rec):
        if _index(a) != _index(b):
            raise NotFamily(f"{a!r} against {b!r}")
        return b
    if a != b:
        raise NotFamily(f"{a!r} against {b!r}")
    return b


def _index(x):
    return x.k if type(x) is Ext else x.i if type(x) is Val else x.j


def _indices(leaves):
    return tuple((type(x).__name__, _index(x)) for x in leaves)


def template(first, member):
    """``member`` (specs, ext metas, live metas) with every size in which it differs from
    ``first`` (a smaller or larger member of its family) made ``Sym(k)``; and ``s``, the
    member's value of the symbolic size. Raises NotFamily."""
    pairs = []

    def collect(a, b):
        pairs.append((a, b))
        return b

    _walk(first, member, collect)
    if not pairs:
        raise NotFamily("the two members have the same sizes")
    g = 0
    for a, _ in pairs:
        if a <= 0:
            raise NotFamily(f"a size {a} where the other member has another")
        g = math.gcd(g, a)
    a0, b0 = pairs[0]
    k0 = a0 // g
    if b0 % k0:
        raise NotFamily(f"{b0} is no multiple of {k0}")
    s = b0 // k0
    if g < 2 or s < 2 or s == g:
        raise NotFamily(f"sizes {g} and {s}")

    def make(a, b):
        k = a // g
        if b != k * s:
            raise NotFamily(f"{a} and {b} are not {k} times {g} and {s}")
        return Sym(k)

    return _walk(first, member, make), s


def match(the_template, member) -> int:
    """The symbolic size at which ``member`` is ``the_template``; raises NotFamily."""
    found = []

    def check(a, b):
        if type(a) is not Sym or b % a.k or b <= 0:
            raise NotFamily(f"{b} where the template has {a!r}")
        s = b // a.k
        if found and found[0] != s:
            raise NotFamily(f"sizes {found[0]} and {s}")
        found.append(s)
        return b

    _walk(the_template, member, check)
    if not found:
        raise NotFamily("the template has no symbolic size")
    return found[0]


def resolve(x, s):
    """``x`` (a template or part of one) with each ``Sym(k)`` made ``k * s``."""
    t = type(x)
    if t is Sym:
        return x.k * s
    if t is tuple or t is list:
        return t(resolve(y, s) for y in x)
    if t is dict:
        return {k: resolve(v, s) for k, v in x.items()}
    if t is Meta:
        return Meta(resolve(x.shape, s), resolve(x.stride, s), resolve(x.offset, s), x.dtype,
                    x.device, resolve(x.numel_storage, s))
    if t is Out:
        return x._replace(meta=resolve(x.meta, s))
    if t is OpSpec:
        return dataclasses.replace(x, args=resolve(x.args, s), kwargs=resolve(x.kwargs, s),
                                   outs=resolve(x.outs, s), ext_metas=resolve(x.ext_metas, s))
    return x


@dataclasses.dataclass(frozen=True)
class SizeGuards:
    """What a symbolic graph assumed of its size: Inductor's guards over ``symbol`` (sympy
    expressions) and the range the shape environment gave it."""

    symbol: object
    exprs: tuple
    low: int
    high: float

    def admit(self, s: int) -> bool:
        if not self.low <= s <= self.high:
            return False
        import sympy

        value = {self.symbol: sympy.Integer(s)}
        return all(e.xreplace(value) is sympy.true for e in self.exprs)


def size_in(shape_env, hint: int):
    """A new symbolic size in ``shape_env``, traced at ``hint``."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    sym = shape_env.create_symbol(hint, ConstantSource("family_size"),
                                  dynamic_dim=DimDynamic.DYNAMIC)
    return shape_env.create_symintnode(sym, hint=hint)


def guards_of(shape_env) -> SizeGuards | None:
    """The guards a trace and its compile put on the one symbolic size of ``shape_env``."""
    symbols = list(shape_env.backed_var_to_val)
    if len(symbols) != 1:
        return None
    sym = symbols[0]
    exprs = [g.expr for g in shape_env.guards]
    replaced = shape_env.replacements.get(sym)
    if replaced is not None:
        import sympy

        exprs.append(sympy.Eq(sym, replaced))
    r = shape_env.var_to_range.get(sym)
    # a bound is an integer or one of sympy's and torch's infinities
    low = int(r.lower) if r is not None and r.lower.is_Integer else 0
    high = int(r.upper) if r is not None and r.upper.is_Integer else math.inf
    return SizeGuards(sym, tuple(exprs), low, high)


def whole_dimension(metas, n_ext: int, packed: bool) -> tuple | None:
    """(graph input position, dimension) of a dimension of size ``s`` among a graph's input
    ``metas``: ``n_ext`` externals, then the live outputs (the packed floats, if any, sit
    between them: Note [Graph inputs]); None where no input has one."""
    for i, m in enumerate(metas):
        for d, size in enumerate(m.shape):
            if size == Sym(1):
                return (i + (packed and i >= n_ext), d)
    return None
