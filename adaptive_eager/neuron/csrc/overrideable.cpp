// Entry points ATen keeps for devices it does not know: where cpu runs its own kernel, ATen
// calls an ``*_overrideable`` op on PrivateUse1. The device answers with what cpu computes:
// cpu's op on host aliases of its tensors, so the result is cpu's, bit for bit, queued as one
// launch like every other op.
#include "neuron.h"

#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty_strided.h>
#include <torch/library.h>

namespace neuron {
namespace {

at::Tensor device_or_undefined(const at::Tensor& host) {
  return host.defined() ? to_device(host) : at::Tensor();
}

at::Tensor meta_like(const at::Tensor& t) {
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}

at::Tensor meta_or_none(const std::optional<at::Tensor>& t) {
  return t && t->defined() ? meta_like(*t) : at::Tensor();
}

bool on_device(const at::Tensor& t) {
  return !t.defined() || t.is_privateuseone();
}

// A planned result: a device tensor shaped as the meta kernel's, and its host alias for the
// launch to write (undefined where the result is not asked for).
std::pair<at::Tensor, at::Tensor> planned(const at::Tensor& meta) {
  if (!meta.defined()) {
    return {};
  }
  at::Tensor dev = at::empty_strided(meta.sizes(), meta.strides(),
                                     meta.options().device(c10::DeviceType::PrivateUse1));
  return {dev, host_alias(dev)};
}

void write(const at::Tensor& dest, const at::Tensor& got) {
  if (dest.defined()) {
    dest.copy_(got);
  }
}

// cpu: convolution -> _convolution picks its kernel; a PrivateUse1 input reaches here. The
// result is planned with the meta kernel and the convolution queued as one launch; where the
// meta kernel refuses the call (cpu would raise), it runs at once, so cpu raises at the line.
at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                       c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
                       c10::IntArrayRef output_padding, int64_t groups) {
  at::Tensor meta;
  if (on_device(input) && on_device(weight) && on_device(bias.value_or(at::Tensor()))) {
    try {
      meta = at::convolution(meta_like(input), meta_like(weight), meta_or_none(bias), stride,
                             padding, dilation, transposed, output_padding, groups);
    } catch (const std::exception&) {
      meta = at::Tensor();
    }
  }
  if (meta.defined()) {
    auto [out, dest] = planned(meta);
    at::Tensor x = host_alias(input), w = host_alias(weight);
    at::Tensor b = bias && bias->defined() ? host_alias(*bias) : at::Tensor();
    submit([=, stride = stride.vec(), padding = padding.vec(), dilation = dilation.vec(),
            output_padding = output_padding.vec()] {
      write(dest, at::convolution(x, w, b, stride, padding, dilation, transposed,
                                  output_padding, groups));
    }, "aten::convolution_overrideable");
    return out;
  }
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
  std::tuple<at::Tensor, at::Tensor, at::Tensor> meta;
  bool plannable = on_device(grad_output) && on_device(input) && on_device(weight);
  if (plannable) {
    try {
      meta = at::convolution_backward(meta_like(grad_output), meta_like(input),
                                      meta_like(weight), bias_sizes, stride, padding, dilation,
                                      transposed, output_padding, groups, output_mask);
    } catch (const std::exception&) {
      plannable = false;
    }
  }
  if (plannable) {
    auto [gi, gi_dest] = planned(std::get<0>(meta));
    auto [gw, gw_dest] = planned(std::get<1>(meta));
    auto [gb, gb_dest] = planned(std::get<2>(meta));
    at::Tensor g = host_alias(grad_output), x = host_alias(input), w = host_alias(weight);
    submit([=, stride = stride.vec(), padding = padding.vec(), dilation = dilation.vec(),
            output_padding = output_padding.vec()] {
      std::optional<at::IntArrayRef> bias_at;
      if (output_mask[2]) {
        bias_at = sizes;
      }
      auto [a, b, c] = at::convolution_backward(g, x, w, bias_at, stride, padding, dilation,
                                                transposed, output_padding, groups, output_mask);
      write(gi_dest, a);
      write(gw_dest, b);
      write(gb_dest, c);
    }, "aten::convolution_backward_overrideable");
    return {gi, gw, gb};
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
