// Random ops without a sync point.
//
// The device draws from the CPU default generator (device.cpp), which the host's own random
// ops share: the same seed gives a program the same numbers on either device, whatever the
// mix of host and device draws. So every draw must happen in program order, on the host --
// a launch drawing later on the worker would race the host's next draw. A random op that
// reads device memory (``multinomial`` of a device tensor, ``bernoulli`` of device
// probabilities) therefore waits for the queue (fallback.cpp); one that only *fills* a
// tensor does not:
//
// - a filler (``normal_``, ``uniform_``, ``bernoulli_(p)``, ``random_``, ``exponential_``,
//   ``geometric_``, ``cauchy_``, ``log_normal_``, and the ``out=`` forms of ``randperm`` and
//   ``normal``) runs cpu's kernel at once into a host tensor of the same sizes and strides
//   (the same elements drawn in the same order), and the copy into the device tensor is the
//   launch, queued behind the launches before it. Factories (``randn``, ``rand``,
//   ``randint``, ``randperm``) reach the device as ``empty`` and a filler.
// - ``native_dropout`` (the fused dropout op; ``F.dropout`` itself takes cpu's unfused path on
//   the device, choices.cpp) is composed on the device of the ops cpu's kernel runs: a
//   boolean mask filled by ``bernoulli_(1 - p)``, then two queued multiplications.
#include "neuron.h"

#include <torch/library.h>

#include <string>
#include <unordered_set>

namespace neuron {
namespace {

bool fills(const c10::FunctionSchema& schema) {
  static const auto& names = *new std::unordered_set<std::string>{
      "aten::normal_", "aten::uniform_", "aten::random_", "aten::exponential_",
      "aten::geometric_", "aten::cauchy_", "aten::log_normal_"};
  const std::string& name = schema.name();
  const std::string& overload = schema.overload_name();
  return names.count(name) > 0 || (name == "aten::bernoulli_" && overload == "float") ||
         (name == "aten::randperm" && overload == "generator_out") ||
         (name == "aten::normal" && overload == "float_float_out");
}

std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p,
                                                  std::optional<bool> train) {
  if (input.numel() == 0) {
    return {input, at::empty_like(input)};
  }
  if (train.has_value() && !*train) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  const double keep = 1. - p;
  const double scale = keep == 0 ? 0. : 1. / keep;
  at::Tensor mask = at::empty_like(input, input.options().dtype(at::kBool));
  mask.bernoulli_(keep);
  return {input.mul(mask).mul_(scale), mask};
}

}  // namespace

bool draw_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  if (!fills(schema)) {
    return false;
  }
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  torch::jit::Stack args(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 1> written;  // (host tensor, device's)
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = args[i];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_privateuseone()) {
      const auto* info = schema.arguments()[i].alias_info();
      if (!info || !info->isWrite()) {
        return false;  // it reads device memory: not a filler after all
      }
      const at::Tensor& dev = v.toTensor();
      at::Tensor host = at::empty_strided(dev.sizes(), dev.strides(),
                                          dev.options().device(c10::kCPU));
      written.emplace_back(host, dev);
      v = host;
    } else if (v.isTensorList() || v.isOptionalTensorList()) {
      return false;
    } else if (v.isGenerator() && v.toGenerator().device().is_privateuseone()) {
      v = cpu_generator(v.toGenerator());
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &args);
  }
  for (auto& [host, dev] : written) {
    if (host.sizes() != dev.sizes()) {
      dev.resize_(host.sizes());  // an out= result the kernel sized (randperm)
    }
    at::Tensor dest = host_alias(dev);
    submit([host = host, dest] { dest.copy_(host); }, launch_name(op));
  }
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  for (c10::IValue& r : args) {  // the results: the written device tensors
    if (r.isTensor()) {
      for (const auto& [host, dev] : written) {
        if (r.toTensor().is_same(host)) {
          r = dev;
          break;
        }
      }
    }
    stack->push_back(std::move(r));
  }
  return true;
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("native_dropout", native_dropout);
}

}  // namespace neuron
