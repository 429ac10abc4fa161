// Autocast on the device: ``torch.autocast("neuron", dtype=...)`` casts as it does on cuda,
// with PyTorch's op lists shared by its backends (autocast_mode.h): matmuls, convolutions and
// recurrent cells in the lower precision; pointwise ops that lose range, norms, reductions,
// softmax and losses in float32; mixed inputs promoted. Every other op falls through.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace neuron {
namespace {

using at::Tensor;
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;

#define ADD_NS(RAW_OP) at::RAW_OP
#define LOWER_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(LOWER_PRECISION)
  AT_FORALL_FP32(FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(PROMOTE)
}

}  // namespace
}  // namespace neuron
