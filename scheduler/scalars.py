"""Lifting Python floats into fused graphs.

Floats are data: an optimizer's step size and bias corrections change every step, an LR
schedule changes the learning rate. Baking them into a compiled graph would recompile every
step, so the fused backends receive them as graph *inputs* (one packed float64 tensor) and
each op that took a float is rewritten into an equivalent op taking a 0-dim tensor:

* a float in a ``Tensor`` slot (``mul.Tensor(x, 0.5)``) is passed as the 0-dim tensor;
* a float in a ``Scalar`` slot uses the overload of the same op whose slot is a ``Tensor``
  (``add.Scalar`` -> ``add.Tensor``, ``clamp`` -> ``clamp.Tensor``, ``lerp.Scalar`` -> ...);
* ``alpha`` / ``value`` keywords (``add``, ``sub``, ``addcdiv``, ``addcmul``) become a
  multiplication, which is how Inductor decomposes them anyway;
* ``_foreach_*`` ops are unrolled into their per-tensor op, then lifted as above.

Note [Lifted scalar dtype]: eager casts a Python float to the op's computation dtype
(float32 for float16/bfloat16 tensors) before using it; a lifted scalar is cast the same way,
so a float32 graph sees the same float32 constant eager does. The cast dtype is the computation dtype of
``result_type(tensor, float)``, so an integer tensor promotes to the default float dtype as it
does with a wrapped Python float.

Floats that cannot be lifted are *specialized*: their values become part of the compiled
variant's key (see scheduler.backends). So is pow's exponent: eager computes a 16-bit
tensor's power with the exponent rounded to the tensor's dtype, and by some exponents in
16-bit steps (scheduler.precision), which the trace reproduces for a constant exponent only.
"""

from __future__ import annotations

import torch
from torch._prims_common import get_computation_dtype

from .program import Rec

__all__ = ["Lifted", "liftable", "lift_call"]

aten = torch.ops.aten


class Lifted:
    """A float delivered to the graph as a 0-dim float64 tensor (during FX tracing)."""

    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


def _is_scalar_type(t) -> bool:
    # Scalar prints as "number" in schema types.
    return str(t) in ("number", "float", "Optional[number]", "Optional[float]")


def _is_tensor_type(t) -> bool:
    return str(t) in ("Tensor", "Optional[Tensor]")


_MUL_SLOTS = {  # packet name -> (keyword, what it multiplies)
    "add": "alpha", "add_": "alpha", "sub": "alpha", "sub_": "alpha",
    "addcdiv": "value", "addcdiv_": "value", "addcmul": "value", "addcmul_": "value",
}

_ALT_CACHE: dict = {}


def _tensor_overload(func, names: frozenset, absent: frozenset = frozenset()):
    """The overload of ``func``'s op taking Tensors for arguments ``names``, same names otherwise.

    Arguments in ``absent`` are passed as None, so an Optional[Tensor] there is fine too
    (``clamp(x, min=f)`` -> ``clamp.Tensor(x, min=t, max=None)``).
    """
    key = (func, names, absent)
    if key in _ALT_CACHE:
        return _ALT_CACHE[key]
    packet = func.overloadpacket
    mine = func._schema.arguments
    found = None
    for name in packet.overloads():
        cand = getattr(packet, name)
        args = cand._schema.arguments
        if [a.name for a in args] != [a.name for a in mine]:
            continue
        if all(
            _is_tensor_type(a.type) if a.name in names
            else str(a.type) == str(b.type) or (a.name in absent and _is_tensor_type(a.type))
            for a, b in zip(args, mine)
        ):
            found = cand
            break
    _ALT_CACHE[key] = found
    return found


def _foreach_element_op(func):
    """Per-tensor op for a ``_foreach_*`` overload, matched by positional argument kinds."""
    key = ("foreach", func)
    if key in _ALT_CACHE:
        return _ALT_CACHE[key]
    base = func._schema.name.split("::")[-1][len("_foreach_"):]
    packet = getattr(aten, base, None)
    want = []
    for a in func._schema.arguments:
        s = str(a.type)
        want.append("Tensor" if s.startswith("List[Tensor") else "Scalar" if s.startswith(
            "List[number") or _is_scalar_type(a.type) else s)
    found = None
    if packet is not None:
        for name in packet.overloads():
            cand = getattr(packet, name)
            cargs = cand._schema.arguments
            kinds = ["Scalar" if _is_scalar_type(a.type) else str(a.type) for a in cargs]
            if kinds[: len(want)] == want and all(
                a.has_default_value() for a in cargs[len(want):]
            ):
                found = cand
                break
    _ALT_CACHE[key] = found
    return found


def _arg_types(func, args, kwargs):
    """(schema argument, template value) for every argument given."""
    schema_args = func._schema.arguments
    out = [(schema_args[i], v) for i, v in enumerate(args)]
    by_name = {a.name: a for a in schema_args}
    out += [(by_name[k], v) for k, v in kwargs.items()]
    return out


def _has_flt(x) -> bool:
    if type(x) is Rec:
        return True
    if type(x) in (list, tuple):
        return any(_has_flt(y) for y in x)
    return False


_SPECIALIZED = frozenset({aten.pow.Tensor_Scalar, aten.pow_.Scalar})


def liftable(func, args, kwargs) -> bool:
    """Can every float leaf of this op (template form) be lifted into a graph input?"""
    if func in _SPECIALIZED:
        return False
    name = func._schema.name.split("::")[-1]
    if name.startswith("_foreach_"):
        elem = _foreach_element_op(func)
        if elem is None:
            return False
        return _liftable_slots(elem, [(a, v) for (a, v) in zip(
            elem._schema.arguments, list(args) + list(kwargs.values()))])
    return _liftable_slots(func, _arg_types(func, args, kwargs))


def _liftable_slots(func, pairs) -> bool:
    name = func._schema.name.split("::")[-1]
    tensor_ref = any(_is_tensor_type(a.type) and not _has_flt(v) for a, v in pairs)
    if not tensor_ref:
        return False
    scalar_slots = set()
    given = {a.name for a, v in pairs if v is not None}
    absent = frozenset(a.name for a in func._schema.arguments if a.name not in given)
    for a, v in pairs:
        if not _has_flt(v):
            continue
        if _is_tensor_type(a.type) or str(a.type).startswith("List[number"):
            continue
        if _is_scalar_type(a.type):
            if _MUL_SLOTS.get(name) == a.name:
                continue
            scalar_slots.add(a.name)
            continue
        return False
    return not scalar_slots or _tensor_overload(func, frozenset(scalar_slots), absent) is not None


def _cast(lifted: Lifted, ref: torch.Tensor):
    dtype = get_computation_dtype(torch.result_type(ref, 1.0))
    return lifted.t.to(dtype)


def lift_call(func, args, kwargs):
    """Run ``func`` with Lifted values standing in for floats (see module docstring)."""
    name = func._schema.name.split("::")[-1]
    if name.startswith("_foreach_"):
        return _foreach_call(func, args, kwargs)
    schema_args = func._schema.arguments
    args = list(args)
    kwargs = dict(kwargs)
    ref = next(
        (v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)), None
    )
    mul_by = None
    scalar_slots = []
    for i, v in enumerate(args):
        if isinstance(v, Lifted):
            a = schema_args[i]
            if _is_tensor_type(a.type):
                args[i] = _cast(v, ref)
            else:
                scalar_slots.append(a.name)
    for k, v in list(kwargs.items()):
        if isinstance(v, Lifted):
            if _MUL_SLOTS.get(name) == k:
                mul_by = _cast(kwargs.pop(k), ref)
            else:
                scalar_slots.append(k)
    if scalar_slots:
        given = {a.name for a, v in zip(schema_args, args) if v is not None}
        given |= {k for k, v in kwargs.items() if v is not None}
        absent = frozenset(a.name for a in schema_args if a.name not in given)
        alt = _tensor_overload(func, frozenset(scalar_slots), absent)
        for i, v in enumerate(args):
            if isinstance(v, Lifted):
                args[i] = _cast(v, ref)
        for k, v in kwargs.items():
            if isinstance(v, Lifted):
                kwargs[k] = _cast(v, ref)
        func = alt
    if mul_by is None:
        return func(*args, **kwargs)
    return _with_multiplier(name, func, args, kwargs, mul_by)


def _with_multiplier(name, func, args, kwargs, m):
    """``add/sub(self, other, alpha=m)`` and ``addcdiv/addcmul(self, t1, t2, value=m)``."""
    base = name.rstrip("_")
    add = aten.add_.Tensor if name.endswith("_") else aten.add.Tensor
    if base in ("add", "sub"):
        return getattr(aten, name).Tensor(args[0], aten.mul.Tensor(args[1], m))
    t1, t2 = args[1], args[2]
    inner = aten.div.Tensor(t1, t2) if base == "addcdiv" else aten.mul.Tensor(t1, t2)
    return add(args[0], aten.mul.Tensor(inner, m))


def _foreach_call(func, args, kwargs):
    elem = _foreach_element_op(func)
    schema_args = func._schema.arguments
    values = list(args) + list(kwargs.values())
    names = [a.name for a in schema_args[: len(args)]] + list(kwargs)
    is_list = {a.name: str(a.type).startswith("List[") for a in schema_args}
    n = next(len(v) for v, nm in zip(values, names) if is_list[nm])
    elem_args = elem._schema.arguments
    results = []
    for i in range(n):
        per = [v[i] if is_list[nm] else v for v, nm in zip(values, names)]
        pos = [p for p, a in zip(per, elem_args) if not a.kwarg_only]
        kw = {a.name: p for p, a in zip(per, elem_args) if a.kwarg_only}
        results.append(lift_call(elem, pos, kw))
    if not func._schema.returns:
        return None
    return results
