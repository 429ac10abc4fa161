"""The recorded program of a segment and its interpreter.

A segment is a sequence of ``OpSpec`` (one per trie node on its path) plus, per op, the
floats it was called with. Arguments are templates whose tensor leaves name their *source*:

* ``Ext(k)`` -- external input ``k``, numbered by first appearance in the segment;
* ``Val(i)`` -- segment value ``i``: the i-th tensor output (fresh or view) of the segment;
* ``Rec(j)`` -- the j-th recorded argument of this op's call: floats (data, not signature)
  and the ints of views of external inputs (``xs[i]``'s index, see tracer.signature);

everything else is a constant.

A view of an external input is itself an external (Note [External views]): its outputs are
``Out("ext", arg=k)`` and the launch passes the actual view tensors in ``exts``. ``interpret`` runs such a program: with real tensors it is the
``exact`` backend (bitwise eager, op by op); under ``make_fx`` it produces the FX graph the
fused backends compile. Both therefore share one definition of what a segment computes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch

from . import storage

__all__ = ["Ext", "Val", "Rec", "Meta", "Out", "OpSpec", "OpFailed", "InductorDiffers", "interpret", "straight_line",
           "alias_groups"]


class Ext:
    __slots__ = ("k",)

    def __init__(self, k):
        self.k = k

    def __repr__(self):
        return f"ext{self.k}"


class Val:
    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i

    def __repr__(self):
        return f"v{self.i}"


class Rec:
    __slots__ = ("j",)

    def __init__(self, j):
        self.j = j

    def __repr__(self):
        return f"f{self.j}"


class Meta(NamedTuple):
    """What a deferred output looks like: enough to allocate it without running the op."""

    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    device: torch.device
    numel_storage: int  # elements of the backing storage

    @staticmethod
    def of(t: torch.Tensor) -> "Meta":
        return Meta(
            tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device,
            storage.nbytes(t) // t.element_size() if t.element_size() else 0,
        )

    def on_storage(self, storage) -> torch.Tensor:
        """A tensor with this metadata over an existing storage."""
        t = torch.empty(0, dtype=self.dtype, device=self.device)
        return t.set_(storage, self.offset, self.shape, self.stride)

    def allocate(self) -> torch.Tensor:
        if self.offset == 0 and _minimal(self):
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        base = torch.empty(self.numel_storage, dtype=self.dtype, device=self.device)
        return base.as_strided(self.shape, self.stride, self.offset)


def _minimal(m: Meta) -> bool:
    """True when empty_strided(shape, stride) yields exactly this storage size."""
    if not all(m.shape):
        return m.numel_storage == 0
    extent = 1 + sum((s - 1) * st for s, st in zip(m.shape, m.stride))
    return extent == m.numel_storage


class Out(NamedTuple):
    """One tensor leaf of an op's result."""

    kind: str  # "fresh" new buffer | "view" of a value | "ext" a view of an external, itself
    # external ``arg`` | "alias" a written argument | "none"
    meta: Meta | None = None  # fresh and ext
    arg: object = None  # alias: positional index (int) or keyword name (str); ext: index k


@dataclasses.dataclass(eq=False)
class OpSpec:
    """One op of a path: everything needed to defer it, replay it, and explain it."""

    func: object
    args: tuple
    kwargs: dict
    outs: tuple  # of Out, in result order
    tree: str  # result structure: "one" | "tuple" | "list" | "none"
    val_base: int  # segment value index of this op's first fresh/view output
    n_floats: int  # recorded arguments (Rec leaves)
    mutates: tuple  # Ext / Val leaves this op writes
    random: bool
    view: bool  # a view op: runs at once, even when deferred
    ext_view: bool  # a view of an external input (its outputs are externals)
    ext_metas: tuple  # Meta of each external input that first appears in this op
    line: str  # user source line that issued it when the path was learned
    key: tuple  # the signature this node is stored under
    default_dtype: object = None  # factories (no tensor input) depend on torch's default dtype
    rec_types: tuple = ()  # type (float or int) of each recorded argument

    @property
    def n_vals(self) -> int:
        return sum(1 for o in self.outs if o.kind in ("fresh", "view"))

    def describe(self) -> str:
        return f"{self.func} at {self.line}"


class OpFailed(Exception):
    """Raised by ``interpret`` when op ``index`` of the program raised ``error``."""

    def __init__(self, index: int, error: BaseException):
        super().__init__(index, error)
        self.index = index
        self.error = error


class InductorDiffers(RuntimeError):
    """Inductor would compute a graph otherwise than eager (scheduler.backends raises it while
    tracing): the graph is not fused, and its path replays exactly (counted: "no fused graph
    (Inductor would compute it otherwise than eager)", this reason logged)."""


def _leaves(spec: OpSpec, res) -> tuple:
    if spec.tree == "one":
        return (res,)
    if spec.tree == "none":
        return ()
    return tuple(res)


def interpret(
    specs,
    floats,
    exts,
    targets: dict,
    call: Callable | None = None,
    float_of: Callable | None = None,
) -> list:
    """Run the program. Returns the list of segment values (index = ``Val.i``).

    ``floats[n]`` is op n's record, ``exts`` the external inputs, ``targets`` maps a fresh
    value index to the live tensor it must be written into. ``call(n, spec, args, kwargs)``
    runs op n (default: ``spec.func(*args, **kwargs)``); ``float_of(n, j)`` resolves a
    float leaf (default: ``floats[n][j]``). A failing op raises ``OpFailed``.

    Views of externals are skipped where ``exts`` already holds their outputs (every
    external at a launch); a fused graph that computes them in-graph passes None there.
    """
    env: list = []

    def build(x, n):
        t = type(x)
        if t is Val:
            return env[x.i]
        if t is Ext:
            return exts[x.k]
        if t is Rec:
            return floats[n][x.j] if float_of is None else float_of(n, x.j)
        if t is tuple or t is list:
            return t(build(y, n) for y in x)
        return x

    for n, spec in enumerate(specs):
        if spec.ext_view and exts[spec.outs[0].arg] is not None:
            continue
        args = tuple(build(a, n) for a in spec.args)
        kwargs = {k: build(v, n) for k, v in spec.kwargs.items()} if spec.kwargs else {}
        try:
            res = spec.func(*args, **kwargs) if call is None else call(n, spec, args, kwargs)
        except Exception as e:
            raise OpFailed(n, e) from e
        for o, leaf in zip(spec.outs, _leaves(spec, res)):
            if o.kind == "fresh":
                target = targets.get(len(env))
                if target is not None:
                    target.copy_(leaf)
                    leaf = target
                env.append(leaf)
            elif o.kind == "view":
                env.append(leaf)
            elif o.kind == "ext":
                exts[o.arg] = leaf
    return env


def on_device(x, device_map):
    """``x`` with a ``torch.device`` named in ``device_map`` replaced (one level of nesting).

    A path recorded on an emulated device runs its kernels on the backing CPU tensors: its
    factory ops' ``device=`` arguments must name the CPU there.
    """
    if type(x) is torch.device:
        return device_map.get(x.type, x)
    if type(x) in (list, tuple):
        return type(x)(on_device(y, device_map) for y in x)
    return x


def on_compute(spec, args, kwargs, device_map, kernels):
    """(function, args, kwargs) of one recorded op as the compute device runs it: devices
    mapped, the device's own kernel where it has one. Either map may be None."""
    func = kernels.get(spec.func, spec.func) if kernels else spec.func
    if device_map:
        args = [on_device(a, device_map) for a in args]
        kwargs = {k: on_device(v, device_map) for k, v in kwargs.items()}
    return func, args, kwargs


def meta_on(meta: "Meta", device_map) -> "Meta":
    """``meta`` on the compute device named in ``device_map`` for its device, if any."""
    if not device_map:
        return meta
    device = device_map.get(meta.device.type)
    return meta if device is None else meta._replace(device=device)


def host_call(device_map, kernels=None):
    """An ``interpret`` ``call`` that runs each op as the compute device runs it (None:
    nothing to map)."""
    if not device_map and not kernels:
        return None

    def call(n, spec, args, kwargs):
        func, args, kwargs = on_compute(spec, args, kwargs, device_map, kernels)
        return func(*args, **kwargs)

    return call


def straight_line(specs, device_map=None, kernels=None) -> Callable:
    """``interpret`` specialized to one program, for launches that pass every external.

    Returns ``run(exts, floats, targets)`` with ``interpret``'s meaning (ops of views of
    externals are skipped: ``exts`` holds their outputs), generated as one Python function
    with a line per op: no template walk, no per-argument dispatch on leaf types, and each op
    called through its C++ entry point (``OpOverload._op``, what ``OpOverload.__call__``
    calls). Measured on a tiny Llama training step (672 ops): the replay's host cost falls
    by about a third. A failing op raises ``OpFailed`` with its index, found from the
    traceback's line, so the happy path carries no bookkeeping.
    """
    consts: dict = {}
    lines = ["def run(exts, floats, targets):", "    get = targets.get"]
    line_op: dict = {}  # generated line number -> op index
    n_val = 0

    def const(value) -> str:
        name = f"K{len(consts)}"
        consts[name] = value
        return name

    def expr(x, n) -> str:
        t = type(x)
        if t is Val:
            return f"v{x.i}"
        if t is Ext:
            return f"exts[{x.k}]"
        if t is Rec:
            return f"r{n}[{x.j}]"
        if t is tuple:
            return "(" + "".join(expr(y, n) + ", " for y in x) + ")"
        if t is list:
            return "[" + ", ".join(expr(y, n) for y in x) + "]"
        if x is None or t is bool or t is int or t is float and x == x and abs(x) != float("inf"):
            return repr(x)
        if t is torch.device and device_map:
            x = device_map.get(x.type, x)
        return const(x)

    # Each value's local is deleted after the op that reads it last, so an intermediate's
    # memory goes when eager would free it: a 64-op chain on 1M floats held all 64 buffers
    # (512 MB against eager's 8 MB peak, measured by the suite) while every one stayed bound.
    last_use: dict = {}
    for n, spec in enumerate(specs):
        for i in _vals_read(spec):
            last_use[i] = n
    dead_after: dict = {}
    for i, n in last_use.items():
        dead_after.setdefault(n, []).append(i)

    for n, spec in enumerate(specs):
        if spec.ext_view:
            continue
        call = ", ".join([expr(a, n) for a in spec.args]
                         + [f"{k}={expr(v, n)}" for k, v in spec.kwargs.items()])
        if spec.n_floats:
            lines.append(f"    r{n} = floats[{n}]")
        impl = kernels.get(spec.func) if kernels else None
        lines.append(f"    res = {const(impl or spec.func._op)}({call})")
        line_op[len(lines)] = n
        leaves = ["res"] if spec.tree == "one" else [f"res[{j}]" for j in range(len(spec.outs))]
        for o, leaf in zip(spec.outs, leaves):
            if o.kind == "fresh":
                lines.append(f"    v{n_val} = {leaf}; t = get({n_val})")
                lines.append(f"    if t is not None: t.copy_(v{n_val}); v{n_val} = t")
                n_val += 1
            elif o.kind == "view":
                lines.append(f"    v{n_val} = {leaf}")
                n_val += 1
        for i in range(n_val - spec.n_vals, n_val):
            if i not in last_use:  # read by no later op: only its target (if live) keeps it
                lines.append(f"    del v{i}")
        for i in dead_after.get(n, ()):
            lines.append(f"    del v{i}")
        lines.append("    res = None")
    src = "\n".join(lines) + "\n"
    filename = f"<adaptive_eager replay of {len(specs)} ops>"
    ns = dict(consts)
    exec(compile(src, filename, "exec"), ns)
    body = ns["run"]

    def run(exts, floats, targets):
        try:
            body(exts, floats, targets)
        except Exception as e:
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != filename:
                tb = tb.tb_next
            if tb is None or tb.tb_lineno not in line_op:
                raise
            raise OpFailed(line_op[tb.tb_lineno], e) from e

    run.source = src
    return run


def _vals_read(spec: OpSpec):
    stack = list(spec.args) + list(spec.kwargs.values())
    while stack:
        x = stack.pop()
        t = type(x)
        if t is Val:
            yield x.i
        elif t is tuple or t is list:
            stack.extend(x)


def alias_groups(tensors) -> tuple:
    """For each tensor, the index of the first earlier tensor sharing its storage, else -1."""
    seen: dict = {}
    out = []
    for i, t in enumerate(tensors):
        ptr = storage.ptr(t)
        if ptr is None:
            out.append(-1)
            continue
        first = seen.setdefault((t.device, ptr), i)
        out.append(-1 if first == i else first)
    return tuple(out)
