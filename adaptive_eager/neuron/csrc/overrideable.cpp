// Entry points ATen keeps for devices it does not know: where cpu runs its own kernel, ATen
// calls an ``*_overrideable`` op on PrivateUse1. The device answers with what cpu computes:
// cpu's op on host aliases of its tensors, so the result is cpu's, bit for bit.
#include "neuron.h"

#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <torch/library.h>

namespace neuron {
namespace {

at::Tensor device_or_undefined(const at::Tensor& host) {
  return host.defined() ? to_device(host) : at::Tensor();
}

// cpu: convolution -> _convolution picks its kernel; a PrivateUse1 input reaches here
at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                       c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
                       c10::IntArrayRef output_padding, int64_t groups) {
  wait("convolution");
  const auto start = std::chrono::steady_clock::now();
  auto out = at::convolution(host_alias(input), host_alias(weight), host_or_none(bias), stride,
                             padding, dilation, transposed, output_padding, groups);
  launched(std::chrono::steady_clock::now() - start, "convolution");
  return to_device(out);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
    bool transposed, c10::IntArrayRef output_padding, int64_t groups,
    std::array<bool, 3> output_mask) {
  // cpu's backward is told the bias's size when it has one; its gradient is asked for here
  std::optional<at::IntArrayRef> bias_sizes;
  std::vector<int64_t> sizes;
  if (output_mask[2]) {
    sizes = {weight.size(transposed ? 1 : 0) * (transposed ? groups : 1)};
    bias_sizes = sizes;
  }
  wait("convolution backward");
  const auto start = std::chrono::steady_clock::now();
  auto [gi, gw, gb] = at::convolution_backward(
      host_alias(grad_output), host_alias(input), host_alias(weight), bias_sizes, stride,
      padding, dilation, transposed, output_padding, groups, output_mask);
  launched(std::chrono::steady_clock::now() - start, "convolution_backward");
  return {device_or_undefined(gi), device_or_undefined(gw), device_or_undefined(gb)};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution_overrideable", convolution);
  m.impl("convolution_backward_overrideable", convolution_backward);
}

}  // namespace neuron
