// Where ATen's composite code picks a kernel by device, the device makes cpu's pick, so that
// it computes what cpu computes (registered at the autograd key: the ops issued here carry
// autograd as they do on cpu). See Note [Attention kernel choice] in ../emulator.py.
#include "neuron.h"

#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/histc.h>
#include <ATen/ops/_scaled_dot_product_attention_math.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/where.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <limits>

namespace neuron {
namespace {

// scaled_dot_product_attention: ATen asks a per-device stub which kernel to use. cpu's
// choice depends on shapes, dtypes and flags only (no data is read), so it is asked on host
// aliases; where cpu fuses, the device issues cpu's fused op with the mask as cpu prepares it.
// Traced (torch.compile's fake and functional tensors: no memory to alias), the choice is
// asked on CPU tensors of the same sizes, strides and dtype that own no memory, so the traced
// graph holds the kernel eager runs; with symbolic sizes, the unfused form.
bool traced(const at::Tensor& t) {
  const auto keys = t.key_set();
  return keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::Functionalize);
}

at::Tensor shape_only(const at::Tensor& t) {
  auto out = at::empty({0}, t.options().device(c10::kCPU));
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides());
  return out;
}

int64_t sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                   std::optional<double> scale, bool enable_gqa) {
  at::AutoDispatchBelowAutograd below;  // the choice is not part of the graph
  const bool has_mask = mask && mask->defined();
  if (!(traced(q) || traced(k) || traced(v) || (has_mask && traced(*mask)))) {
    return at::_fused_sdp_choice(host_alias(q), host_alias(k), host_alias(v),
                                 host_or_none(mask), dropout_p, is_causal, scale, enable_gqa);
  }
  for (const at::Tensor* t : {&q, &k, &v}) {
    if (t->unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
      return static_cast<int64_t>(sdp::SDPBackend::math);
    }
  }
  if (has_mask && mask->unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return static_cast<int64_t>(sdp::SDPBackend::math);
  }
  std::optional<at::Tensor> m;
  if (has_mask) {
    m = shape_only(*mask);
  }
  return at::_fused_sdp_choice(shape_only(q), shape_only(k), shape_only(v), m, dropout_p,
                               is_causal, scale, enable_gqa);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                     std::optional<double> scale, bool enable_gqa) {
  const int64_t choice = sdp_choice(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
  std::optional<at::Tensor> m = mask;
  if (m && m->defined() && m->dtype() == at::kBool) {
    auto zero = at::scalar_tensor(0.0, q.options().device(c10::kCPU));
    auto ninf = at::scalar_tensor(-std::numeric_limits<double>::infinity(),
                                  q.options().device(c10::kCPU));
    m = at::where(*m, zero, ninf);
  }
  if (choice == static_cast<int64_t>(sdp::SDPBackend::flash_attention)) {
    return std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p,
                                                                       is_causal, m, scale));
  }
  return std::get<0>(at::_scaled_dot_product_attention_math(q, k, v, m, dropout_p, is_causal,
                                                            std::nullopt, scale, enable_gqa));
}

// dropout: ATen takes the fused ``native_dropout`` on any accelerator and its unfused form on
// cpu (the same mask, another rounding); the device takes cpu's.
at::Tensor dropout_impl(const at::Tensor& input, double p, bool train, bool inplace) {
  if (p == 0 || !train || input.sym_numel() == 0) {
    return input;
  }
  at::Tensor self = input;
  if (p == 1) {
    auto zero = at::zeros({}, input.options());
    return inplace ? self.mul_(zero) : input.mul(zero);
  }
  at::Tensor noise = at::empty_like(input).bernoulli_(1 - p);
  noise.div_(1 - p);
  return inplace ? self.mul_(noise) : input.mul(noise);
}

at::Tensor dropout(const at::Tensor& input, double p, bool train) {
  return dropout_impl(input, p, train, false);
}

at::Tensor& dropout_(at::Tensor& input, double p, bool train) {
  dropout_impl(input, p, train, true);
  return input;
}

// histc: accelerators count integer inputs too (Hugging Face MoE layers rely on it off the
// cpu); cpu's kernel has floating types only. Counting in float64 is exact for them (the
// same as device_kernels.py, which the engine's replays use).
at::Tensor histc(const at::Tensor& self, int64_t bins, const at::Scalar& min,
                 const at::Scalar& max) {
  wait("histc");
  at::Tensor host = host_alias(self);
  const auto start = std::chrono::steady_clock::now();
  at::Tensor out = self.is_floating_point()
                       ? at::histc(host, bins, min, max)
                       : at::histc(host.to(at::kDouble), bins, min, max).to(self.scalar_type());
  launched(std::chrono::steady_clock::now() - start, "histc");
  return to_device(out);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("histc", histc);
  // linalg_lstsq's composite picks the LAPACK driver by device when none is given (gelsy on
  // cpu, gels elsewhere: other values, and other strides for the solution): the device runs
  // the composite on host aliases, as cpu does (fallback.cpp)
  m.impl("linalg_lstsq", torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
}

// Ops with a CPU kernel *and* a composite one (CompositeImplicitAutograd, or
// CompositeExplicitAutograd[NonFunctional]): every device but cpu gets the composite. Some
// composites compute otherwise than cpu's kernel (native_layer_norm's math version,
// silu_backward's decomposition: other roundings), the rest (structured ops' functional and
// in-place forms) compute the same through one more dispatch. So the device runs cpu's kernel
// for all of them, found by name when the device is registered (after every static
// registration: an op the device has its own kernel for keeps it). Foreach ops, too (below).
// Views and ops on storages never qualify.
int64_t register_cpu_kernels() {
  static auto* lib = new torch::Library(torch::Library::IMPL, "aten",
                                        c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  int64_t n = 0;
  for (const auto& name : dispatcher.getAllOpNames()) {
    auto op = dispatcher.findOp(name);
    if (!op || name.name.rfind("aten::", 0) != 0 ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      continue;
    }
    const bool cpu = op->hasKernelForDispatchKey(c10::DispatchKey::CPU);
    const bool explicit_composite =
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd);
    const bool composite =
        explicit_composite ||
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
    // A foreach op is one launch, as on a device with foreach kernels, whether cpu runs it
    // with a kernel of its own or with the composite loop over its tensors.
    const bool foreach =
        name.name.rfind("aten::_foreach_", 0) == 0 && (cpu || explicit_composite);
    if (!foreach && !(cpu && composite)) {
      continue;
    }
    const auto& schema = op->schema();
    bool plain = true;
    for (const auto& r : schema.returns()) {
      plain &= !r.alias_info() || r.alias_info()->isWrite();
    }
    for (const auto& a : schema.arguments()) {
      plain &= a.type()->kind() != c10::TypeKind::StorageType;
    }
    if (!plain) {
      continue;
    }
    std::string op_name = name.name.substr(6);  // without "aten::"
    if (!name.overload_name.empty()) {
      op_name += "." + name.overload_name;
    }
    lib->impl(op_name.c_str(), torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
    ++n;
  }
  return n;
}

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("scaled_dot_product_attention", attention);
  m.impl("dropout", dropout);
  m.impl("dropout_", dropout_);
}

}  // namespace neuron
