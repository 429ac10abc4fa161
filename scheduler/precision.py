"""Where Inductor would compute otherwise than eager: the ops a fused graph leaves to eager.

Note [Eager's precision], continued (the codegen settings are in scheduler.backends): some ops
eager runs as one CPU kernel that computes in float32 and rounds once, where Inductor's
decomposition or lowering computes the same in another order and rounds differently. In
bfloat16 and float16 the OpInfo sweep (tests/fidelity/RESULTS.md) found these beyond the
OpInfo's tolerances: log_softmax by a bf16 ulp where the value is small, mse_loss by two fp16
ulps, addr and cross by a bf16 ulp, floor_divide by 1 where the quotient is near an integer,
linspace by a bf16 ulp, logspace by its base's power of a rounded exponent, the weighted mean
of nll_loss by two fp16 ulps (its gradient: a fp16 ulp at two of 48 elements of
linear_cross_entropy's), soft_margin_loss (which eager overflows to inf in fp16, and the
decomposition does not), linear interpolation by a bf16 ulp, layer_norm on a row with no
variance (where 1/sqrt(eps) scales the rounding of its mean), batch_norm by a 16-bit ulp,
binary_cross_entropy_with_logits by a few fp16 ulps, a transposed convolution in fp16 by
0.05, logsumexp (eager's kernel keeps its intermediates in float32: a bf16 ulp apart),
rsqrt (eager's fp16 kernel on small tensors is not correctly rounded, Inductor's is: a ulp
apart in a quarter of the elements of a 20-element tensor, none of a 4096-element one;
acos's and asin's gradients), ldexp (eager rounds ``2 ** other`` to 16 bits before it
multiplies, Inductor multiplies in float32: a 16-bit ulp apart, more in its gradients), the
backwards of reflection padding, of unfold (col2im; Tensor.unfold's unfold_backward) and of
max pooling, which sum overlapping gradients in another order (bf16 and fp16 gradients beyond tolerance; max_pool2d:
a bf16 ulp at one element of 7 of 1,440 samples), the gradients of glu, binary_cross_entropy
and dist in fp16 and of polygamma in bf16 (a 16-bit ulp or a few, at some elements), the
backward of embedding (repeated indices' gradients summed in another order: a bf16 ulp at 4
of 50 elements), xlogy (eager's kernel multiplies by the logarithm in float32 and rounds
once; the decomposition rounds the logarithm first: its gradient a few fp16 ulps apart), prod
(eager's kernel multiplies in the 16-bit dtype, rounding at each step, where Inductor
accumulates in float32: a few 16-bit ulps apart, and its gradient, ``grad * result / input``,
beyond the fp16 tolerance), and the matrix products, which Inductor turns into a
16-bit multiply and a sum when a dimension is small, where eager accumulates in float32 and
rounds once.

In graphs holding a 16-bit value these ops are traced as an *opaque op of ours* with the same
schema, whose kernel is eager's (``_eager_kernel``): Inductor cannot look into it (no decomposition,
no lowering: it calls it as an extern kernel, bitwise eager's) and fuses around it. Leaving
the op out of Inductor's decompositions is not enough: functionalization runs the C++ body of
a ``CompositeExplicitAutograd`` op (binary_cross_entropy_with_logits) and hands its pieces to
Inductor, and some ops (bmm, convolution) are lowered, not decomposed. An op that mutates
(batch_norm's running statistics) becomes an op of ours that returns the new values, and
copies into the mutated arguments. (Not the op's own functional variant: its fake kernel
gives float32 running statistics where eager's are 16-bit, and the graph then reads 16-bit
memory as float32.)
"""

from __future__ import annotations

import re

import torch

__all__ = ["EAGER_16BIT", "EAGER_ALWAYS", "NOT_FUSED_16BIT", "MEAN_OF_EMPTY", "as_eager_16bit",
           "eager_kernels", "low_precision", "stored_as_eager"]

aten = torch.ops.aten
_LOW = (torch.bfloat16, torch.float16)

# Registered at import: a compiled graph calls these ops in every process that loads it (the
# compile process and the user's).
_LIB = torch.library.Library("adaptive_eager", "FRAGMENT")


def _eager_kernel(op):
    """What the trace calls for ``op``: an op ``adaptive_eager::eager_<name>`` with ``op``'s
    schema, whose kernel is eager's. For an op that writes some of its arguments, our op
    takes them read-only and returns their new values after ``op``'s own results; the trace
    copies them back, which functionalization handles as any copy."""
    schema = op._schema
    base, overload = schema.name.split("::")[1], op._overloadname
    name = "eager_" + base + ("" if overload == "default" else "_" + overload)
    written = [i for i, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    text = str(schema)
    signature = text[text.index("("):]
    if written:
        assert all(r.alias_info is None for r in schema.returns), op
        args, returns = signature.split(" -> ")
        returns = returns.strip("()")
        extra = ", ".join(["Tensor"] * len(written))
        signature = re.sub(r"\([a-z]!\)", "", args) + f" -> ({returns}, {extra})"
    _LIB.define(name + signature)

    def kernel(*args, **kwargs):
        if not written:
            return op(*args, **kwargs)
        args = list(args)
        for i in written:
            args[i] = args[i].clone()
        res = op(*args, **kwargs)
        res = res if isinstance(res, tuple) else (res,)
        return (*res, *(args[i] for i in written))

    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    # Traced with fake tensors, it is ``op`` on the fake tensors: the fake mode's answer for the
    # device (a batch_norm's 16-bit statistics on cpu), not the Meta kernel's (float32 ones)
    torch.library.register_fake(f"adaptive_eager::{name}", kernel, lib=_LIB)
    ours = getattr(torch.ops.adaptive_eager, name).default
    if not written:
        return ours

    def call(*args, **kwargs):
        res = ours(*args, **kwargs)
        for i, new in zip(written, res[len(res) - len(written):]):
            args[i].copy_(new)
        out = res[:len(res) - len(written)]
        return out[0] if len(schema.returns) == 1 else tuple(out)

    return call


_OPS_16BIT = (
    aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default, aten.mse_loss.default,
    aten.mse_loss_backward.default, aten.addr.default, aten.linalg_cross.default,
    aten.floor_divide.default, aten.linspace.default, aten.linspace.Tensor_Tensor,
    aten.linspace.Tensor_Scalar, aten.linspace.Scalar_Tensor, aten.logspace.default,
    aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Scalar_Tensor,
    aten.mm.default, aten.bmm.default, aten.addmm.default, aten.mv.default, aten.addmv.default,
    aten.dot.default, aten.vdot.default, aten.nll_loss_forward.default,
    aten.nll_loss2d_forward.default, aten.nll_loss_backward.default,
    aten.nll_loss2d_backward.default, aten.native_layer_norm.default,
    aten.native_layer_norm_backward.default, aten.soft_margin_loss.default,
    aten.soft_margin_loss_backward.default, aten.upsample_linear1d.default,
    aten.upsample_linear1d.vec, aten.binary_cross_entropy_with_logits.default,
    aten.convolution.default, aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats, aten._batch_norm_with_update.default,
    aten._native_batch_norm_legit_no_training.default, aten._batch_norm_no_update.default,
    aten.native_batch_norm_backward.default, aten.batch_norm_backward.default,
    aten.lerp.Scalar, aten.lerp.Tensor,
    aten.index_reduce.default, aten.grid_sampler_2d.default, aten.logit.default,
    aten.logsumexp.default, aten.rsqrt.default, aten.ldexp.Tensor,
    aten.reflection_pad1d_backward.default, aten.reflection_pad2d_backward.default,
    aten.reflection_pad3d_backward.default, aten.col2im.default,
    aten.max_pool2d_with_indices_backward.default, aten.max_pool3d_with_indices_backward.default,
    aten.glu.default, aten.glu_backward.default, aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_backward.default, aten.dist.default, aten.polygamma.default,
    aten.unfold_backward.default, aten.embedding_dense_backward.default,
    aten.xlogy.Tensor, aten.prod.default, aten.prod.dim_int,
)
# In graphs holding a 16-bit value: op -> what the trace calls for it (eager's kernel)
EAGER_16BIT = {op: _eager_kernel(op) for op in _OPS_16BIT}

# Found by the OpInfo sweep, in every dtype (every fused graph calls eager's kernel for them):
# - Inductor's lowering of fractional_max_pool3d places some pooling windows otherwise than
#   eager (an output size from ``output_ratio``: values off by 2.1);
# - its lowering of the average pools' backward divides a window that ``ceil_mode`` lets
#   overhang the padded input by another count than eager (avg_pool1d's gradient in float32
#   off by 0.07; ``torch.compile`` of the backward alone gives the same);
# - its lowering of nearest upsampling's backward, with a scale factor that is not an integer
#   (1.7), sends some gradients to other input elements than eager (off by 2.7 in float32;
#   ``torch.compile`` of upsample_nearest2d_backward alone: by 4.4);
# - the orthogonal polynomials (hermite_polynomial_he in float32: 4e-4 apart at values in the
#   hundreds). Their recurrences ``x * p - k * q`` cancel, and eager's kernels are built with
#   floating-point contraction (each ``a * b + c`` one fused multiply-add) where Inductor's C++
#   is built without it; so the roundings differ and the cancellation magnifies them.
_POLYNOMIALS = ("chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
                "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t",
                "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
                "shifted_chebyshev_polynomial_w", "hermite_polynomial_h",
                "hermite_polynomial_he", "laguerre_polynomial_l", "legendre_polynomial_p")
EAGER_ALWAYS = {op: _eager_kernel(op) for op in (
    aten.fractional_max_pool3d.default,
    aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default,
    aten.upsample_nearest1d_backward.default, aten.upsample_nearest2d_backward.default,
    aten.upsample_nearest3d_backward.default, aten._upsample_nearest_exact1d_backward.default,
    aten._upsample_nearest_exact2d_backward.default,
    aten._upsample_nearest_exact3d_backward.default,
    *(getattr(getattr(aten, "special_" + name), overload)
      for name in _POLYNOMIALS for overload in ("default", "x_scalar", "n_scalar")))}

# Ops that store a Scalar argument, as it is, in a result of the op's dtype. Eager rounds the
# value to a 16-bit dtype when it stores it; Inductor folds the op into its consumers as a
# float32 constant and never rounds it (``empty_like(x).fill_(1.7).sub_(x)``, which is how
# C++'s ``1.7 - x`` runs, inside hinge_embedding_loss: 1.7 where eager has 1.703125, results a
# bf16 ulp apart at a third of the elements). So does pow with its exponent: eager's kernel
# takes a 16-bit tensor's exponent in the tensor's dtype (``x ** (1/3)`` in bf16 is
# ``x ** 0.333984375``: a bf16 ulp apart from Inductor's at a tenth of the elements). The
# trace gives these ops the value eager uses. op -> the position of the value, and of the
# tensor whose dtype the result takes (None: the ``dtype`` keyword, or the default dtype).
_STORES_SCALAR = {aten.fill.Scalar: (1, 0), aten.fill_.Scalar: (1, 0),
                  aten.full.default: (1, None), aten.full_like.default: (1, 0),
                  aten.new_full.default: (2, 0), aten.scalar_tensor.default: (0, None),
                  aten.pow.Tensor_Scalar: (1, 0), aten.pow_.Scalar: (1, 0)}

# Eager's pow of a 16-bit tensor by -2, -0.5 or 3 is ``1 / (x * x)``, ``1 / sqrt(x)`` or
# ``x * x * x``, rounded to 16 bits at each step; Inductor rounds once (a bf16 ulp apart at up
# to a quarter of the elements; normalize's gradient with p=0.5, which cancels, beyond the
# OpInfo's tolerance). In graphs holding a 16-bit value, pow by these exponents is eager's
# kernel; pow by any other (``x ** 2`` in an RMS norm) stays fused.
_POW_IN_STEPS = frozenset({-2.0, -0.5, 3.0})
_eager_pow = _eager_kernel(aten.pow.Tensor_Scalar)
_EAGER_POW = {aten.pow.Tensor_Scalar: _eager_pow,
              aten.pow_.Scalar: lambda x, exponent: x.copy_(_eager_pow(x, exponent))}

# Ops whose 16-bit results Inductor computes otherwise than eager beyond the tolerances and
# that cannot be left to eager's kernel inside a graph: a 16-bit graph holding one is not
# compiled, and its path replays exactly (counted: "no fused graph (Inductor would compute it
# otherwise than eager)").
NOT_FUSED_16BIT = frozenset({aten.div.Tensor_mode, aten.div.Scalar_mode})

# Found by the OpInfo sweep: Inductor's Welford reduction gives the mean of an empty tensor
# as 0 (``torch.compile`` does the same), where eager's is nan. A graph holding one is not
# fused.
MEAN_OF_EMPTY = frozenset(getattr(getattr(aten, op), overload)
                          for op in ("var_mean", "std_mean")
                          for overload in ("default", "dim", "correction"))


def low_precision(specs, ext_metas) -> bool:
    """Does the program hold a 16-bit floating value (an input, or an op's result)?"""
    return (any(m.dtype in _LOW for m in ext_metas)
            or any(o.meta is not None and o.meta.dtype in _LOW for s in specs for o in s.outs))


def eager_kernels(low: bool, device_kernels=None) -> dict:
    """op -> what a fused graph's trace calls for it: eager's kernels where Inductor would
    differ (16-bit ones when ``low``), then the device's own kernels, which take precedence."""
    return {**EAGER_ALWAYS, **(EAGER_16BIT if low else {}), **(device_kernels or {})}


def stored_as_eager(func, args: list, kwargs: dict) -> list:
    """``args`` with the Scalar that ``func`` stores rounded to the result's 16-bit dtype, as
    eager stores it (``_STORES_SCALAR``); ``args`` itself when there is nothing to round."""
    where = _STORES_SCALAR.get(func)
    if where is None:
        return args
    value_at, like = where
    # A float the graph takes as an input (scheduler.scalars) reaches the op as a tensor, which
    # the op converts to its dtype as eager does: only constants need rounding.
    value = args[value_at] if len(args) > value_at else None
    if type(value) is not float:
        return args
    dtype = kwargs.get("dtype")
    if dtype is None:
        dtype = args[like].dtype if like is not None else torch.get_default_dtype()
    if dtype not in _LOW:
        return args
    args = list(args)
    args[value_at] = torch.tensor(value, dtype=dtype).item()
    return args


def as_eager_16bit(spec_func, func, args: list, kwargs: dict):
    """(function, args) of one op in a graph holding a 16-bit value, as eager computes it:
    the Scalar it stores rounded (``stored_as_eager``), eager's kernel for pow by an exponent
    eager computes in steps (``_POW_IN_STEPS``). ``func`` is what the trace calls so far."""
    args = stored_as_eager(spec_func, args, kwargs)
    if (func is spec_func and spec_func in _EAGER_POW and len(args) > 1
            and type(args[1]) in (int, float) and float(args[1]) in _POW_IN_STEPS
            and args[0].dtype in _LOW):
        func = _EAGER_POW[spec_func]
    return func, args
