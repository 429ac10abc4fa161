"""How a result under the engine is compared with eager's.

``exact``: bitwise -- the same bytes, dtype, shape and strides (NaN payloads and the sign of
zero included). Fused backends: the tolerances PyTorch's own OpInfo tests use for the dtype
(``torch.testing``'s defaults, widened by the OpInfo's ``toleranceOverride`` decorators),
and still the same dtype, shape and strides. Ops whose values are unspecified (``empty``)
compare metadata only, as OpInfo's own tests do.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["Mismatch", "compare", "tolerance", "to_host"]


class Mismatch(AssertionError):
    """A result differs from eager's; the message says where and how."""


def tolerance(op, dtype) -> tuple[float, float]:
    """(rtol, atol) for ``op`` in ``dtype``: the larger of torch.testing's default and any
    ``toleranceOverride`` the OpInfo declares for that dtype."""
    from torch.testing._comparison import default_tolerances
    from torch.testing._internal.common_device_type import toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo

    rtol, atol = default_tolerances(dtype)
    for info in getattr(op, "decorators", ()):
        decorators = info.decorators if isinstance(info, DecorateInfo) else (info,)
        for dec in decorators:
            if isinstance(dec, toleranceOverride) and dtype in dec.d:
                tol = dec.d[dtype]
                atol, rtol = max(atol, tol.atol), max(rtol, tol.rtol)
    return rtol, atol


def to_host(x):
    """A tensor's value on the CPU, dense (sparse and other layouts compared densely)."""
    if x.layout != torch.strided:
        x = x.to_dense()
    x = x.detach().resolve_conj().resolve_neg()
    return x.cpu() if x.device.type != "cpu" else x


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as bytes, in row-major order (NaN payloads and -0.0 kept)."""
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    flat = torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


def compare(got, want, *, exact: bool, rtol: float = 0.0, atol: float = 0.0,
            values: bool = True, strides: bool = True, where: str = "result") -> None:
    """Raise ``Mismatch`` naming the first leaf of ``got`` that differs from ``want``."""
    g_leaves, g_spec = tree_flatten(got)
    w_leaves, w_spec = tree_flatten(want)
    if g_spec != w_spec:
        raise Mismatch(f"{where}: structure {g_spec} != eager's {w_spec}")
    for i, (g, w) in enumerate(zip(g_leaves, w_leaves)):
        at = f"{where}[{i}]"
        if not isinstance(w, torch.Tensor):
            if isinstance(g, torch.Tensor) or not _same_scalar(g, w, 0.0 if exact else rtol,
                                                               0.0 if exact else atol):
                raise Mismatch(f"{at}: {g!r} != eager's {w!r}")
            continue
        if not isinstance(g, torch.Tensor):
            raise Mismatch(f"{at}: {type(g).__name__} where eager returned a tensor")
        if (g.dtype, g.shape, g.layout) != (w.dtype, w.shape, w.layout):
            raise Mismatch(f"{at}: {g.dtype} {tuple(g.shape)} {g.layout} != eager's "
                           f"{w.dtype} {tuple(w.shape)} {w.layout}")
        if strides and w.layout == torch.strided and g.numel() > 1 and g.stride() != w.stride():
            raise Mismatch(f"{at}: strides {g.stride()} != eager's {w.stride()}")
        if g.requires_grad != w.requires_grad:
            raise Mismatch(f"{at}: requires_grad {g.requires_grad} != eager's {w.requires_grad}")
        if not values:
            continue
        gh, wh = to_host(g), to_host(w)
        if exact:
            if not torch.equal(_bytes(gh), _bytes(wh)):
                diff = (gh.double() - wh.double()).abs().max() if gh.numel() and not (
                    gh.dtype.is_complex or gh.dtype == torch.bool) else "?"
                raise Mismatch(f"{at}: not bitwise equal to eager's (max abs diff {diff})")
        else:
            try:
                torch.testing.assert_close(gh, wh, rtol=rtol, atol=atol, equal_nan=True,
                                           check_stride=False)
            except AssertionError as e:
                first = str(e).strip().splitlines()
                raise Mismatch(f"{at}: beyond rtol={rtol:g} atol={atol:g}: "
                               f"{' '.join(first[:4])}") from None


def _same_scalar(a, b, rtol: float = 0.0, atol: float = 0.0) -> bool:
    """Equal Python numbers; floats within the tolerances where there are any (a fused
    graph's sum read by ``item()`` is the tensor's value, within the tensor's tolerances)."""
    if isinstance(a, float) and isinstance(b, float):
        if a != a and b != b:
            return True
        if rtol or atol:
            return abs(a - b) <= atol + rtol * abs(b)
    return type(a) is type(b) and a == b
