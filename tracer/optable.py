"""Op classification: one table lookup per OpOverload, computed once from its schema and tags.

Every aten op the mode sees falls in one class:

* ``VIEW``     returns views of its inputs: metadata only, so it runs at once even on the hot
               path (running it on a pending tensor reads no data) and is recorded.
* ``COMPUTE``  fresh outputs, possibly mutating some arguments (in-place, ``out=``): deferrable.
* ``SYNC``     returns a host value computed from data (``.item()``, ``equal``): a read.
* ``BOUNDARY`` cannot be deferred or replayed safely: the segment is cut, the op runs eagerly,
               and the reason is counted.
* ``IGNORE``   touches no tensor data (profiler ranges, and ops that compute nothing: Note
               [Ops that compute nothing]): runs as is, outside any segment.

The tables below hold the cases the schema does not tell (Note [Schema gaps]).
"""

from __future__ import annotations

import dataclasses
import enum

import torch

__all__ = ["OpClass", "OpInfo", "info"]

aten = torch.ops.aten


class OpClass(enum.Enum):
    VIEW = "view"
    COMPUTE = "compute"
    SYNC = "sync"
    BOUNDARY = "boundary"
    IGNORE = "ignore"


@dataclasses.dataclass(frozen=True)
class OpInfo:
    cls: OpClass
    reason: str = ""  # why, for BOUNDARY
    mutated_args: tuple[str, ...] = ()  # schema argument names written by the op
    random: bool = False  # consumes the default generator
    # Output j of the schema that is an alias of a written argument: name of that argument.
    out_alias: tuple[str | None, ...] = ()
    float_values_matter: bool = False  # float arguments change output metadata


# Note [Schema gaps]
# Ops whose schema understates what they do. native_batch_norm writes running_mean and
# running_var without annotating them, so functionalization would drop the update; the
# metadata-mutating ops change sizes/strides of a tensor in place, which a cached output
# metadata cannot follow.
_BOUNDARY_BY_NAME = {
    "native_batch_norm": "mutates running stats without schema annotation",
    "resize_": "mutates tensor metadata",
    "resize_as_": "mutates tensor metadata",
    "set_": "mutates tensor metadata",
    "record_stream": "stream bookkeeping",
    "_assert_async": "host-visible assertion",
    "_assert_scalar": "host-visible assertion",
    "_print": "host side effect",
}

# Ops whose schema says "fresh output" but whose result shares the input's storage.
_VIEW_BY_NAME = {"_unsafe_view"}

# Float arguments of these ops change the output's shape (arange(0, 1.0, 0.25), interpolate by
# scale factor): their floats are part of the signature by value, never lifted.
_FLOAT_SHAPE_OPS = {
    "arange", "linspace", "logspace", "range", "histc",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
    "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
}

# Note [Ops that compute nothing]: ``empty`` and its kin make memory for the program to fill,
# and it does not always fill it with an op: ``at::tensor(list)`` in a C++ composite
# (``ctc_loss``'s target lengths) is ``empty`` and then a ``memcpy``. As a deferred value, the
# replay read memory of its own that nothing had written (found by the OpInfo sweep:
# ``ctc_loss`` divided by garbage). They run at once, outside any segment, and the tensor
# enters as an external where an op first reads or writes it. Nothing may hold the result
# when it returns: PyTorch's factories detach a result anyone else holds (``make_variable``),
# so the program would get another tensor than the one the segment knows.
# (tracer/csrc/hot_segment.cpp runs them at once too: ``runs_at_once``.)
_IGNORE_BY_NAME = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
                   "empty_permuted"}

_NAMESPACES_DEFERRABLE = ("aten", "prims")
_NAMESPACES_IGNORED = ("profiler",)

_TABLE: dict[object, OpInfo] = {}


def info(func) -> OpInfo:
    """Classification of ``func`` (an OpOverload); computed on first sight, then a dict hit."""
    got = _TABLE.get(func)
    if got is None:
        got = _TABLE[func] = _classify(func)
    return got


# Note [Collectives are boundaries]: a collective (``c10d::`` and ``_c10d_functional::`` ops:
# DDP's bucket all-reduces, FSDP2's all-gathers and reduce-scatters, DTensor's) is not
# deferred into a replay: what it reads is launched first, it runs at once, and the ops after
# it start a new segment. A collective is a rendezvous with the other ranks: deferred into a
# launch, a rank would reach it only when the launch runs, in an order the engine chose, while
# the other ranks may have diverged from their paths and run theirs eagerly elsewhere; a
# mismatch hangs every rank, and nothing in a replay can detect it. As a boundary it keeps
# eager's order on every rank by construction; FSDP2's storage frees and re-allocations are
# boundaries too (Note [Storage resizes]). The cost is launches, measured by
# ``../shared/acceptance/distributed.py`` (30 steps of a 2-layer MLP, 2 ranks, exact, per
# step, two runs an hour apart): DDP on cpu 28 and 77 ops intercepted in 6.6 and 8.2
# launches, FSDP2 on cpu 143 and 52 ops in 53 and 19.5 launches; on neuron DDP 22 ops in 5.3
# launches, FSDP2 47 ops in 12.2 launches (both runs). ``benchmarks.distributed`` times it.


def _classify(func) -> OpInfo:
    schema = func._schema
    tags = set(func.tags)
    ns = getattr(func, "namespace", "")
    name = schema.name.split("::")[-1]
    random = torch.Tag.nondeterministic_seeded in tags
    if ns in _NAMESPACES_IGNORED:
        return OpInfo(OpClass.IGNORE)
    if ns == "aten" and name in _IGNORE_BY_NAME:
        return OpInfo(OpClass.IGNORE)
    if ns not in _NAMESPACES_DEFERRABLE:
        # Note [Collectives are boundaries]
        reason = "collective" if "c10d" in ns else f"op outside aten ({ns})"
        return OpInfo(OpClass.BOUNDARY, reason)
    returns = schema.returns
    if torch.Tag.data_dependent_output in tags or any(
        not _is_tensor_type(r.type) for r in returns
    ):
        return OpInfo(OpClass.SYNC, "reads data to the host")
    if torch.Tag.dynamic_output_shape in tags:
        return OpInfo(OpClass.BOUNDARY, "data-dependent output shape")
    if torch.Tag.inplace_view in tags:
        return OpInfo(OpClass.BOUNDARY, "mutates tensor metadata")
    if name in _BOUNDARY_BY_NAME:
        return OpInfo(OpClass.BOUNDARY, _BOUNDARY_BY_NAME[name])
    if name in _VIEW_BY_NAME:
        return OpInfo(OpClass.VIEW)
    written = {}
    for a in schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            written[a.name] = set(a.alias_info.before_set)
    out_alias = []
    n_view = n_fresh = 0
    for r in returns:
        ai = r.alias_info
        if ai is None:
            out_alias.append(None)
            n_fresh += 1
        elif ai.is_write:
            match = [n for n, sets in written.items() if sets & set(ai.before_set)]
            if not match:
                return OpInfo(OpClass.BOUNDARY, "unrecognised output aliasing")
            out_alias.append(match[0])
        else:
            out_alias.append(None)
            n_view += 1
    if n_view:
        if n_fresh or written:
            return OpInfo(OpClass.BOUNDARY, "mixes views with other outputs")
        return OpInfo(OpClass.VIEW)
    return OpInfo(
        OpClass.COMPUTE,
        mutated_args=tuple(written),
        random=random,
        out_alias=tuple(out_alias),
        float_values_matter=name in _FLOAT_SHAPE_OPS,
    )


def _is_tensor_type(t) -> bool:
    s = str(t)
    return s.startswith("Tensor") or s.startswith("List[Tensor") or s.startswith(
        "Optional[Tensor"
    )
