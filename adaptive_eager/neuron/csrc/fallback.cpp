// Every op without a kernel of the device's own runs ATen's CPU kernel on the device's memory.
//
// Each neuron tensor argument is replaced by a host alias: a CPU tensor over the same bytes
// (one CPU storage per device storage, so two arguments sharing memory still share it, and
// ATen's overlap checks see what they see on cpu). In-place and ``out=`` results are then
// written straight into device memory; a fresh result is allocated on the device with the
// CPU result's sizes and strides and filled from it. View results never come here (a view
// op without a kernel in kernels.cpp is an error naming it, never a silent copy).
#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <unordered_map>

namespace neuron {
namespace {

c10::Storage host_storage(const c10::Storage& storage) {
  void* data = storage.mutable_data();
  return c10::Storage(c10::Storage::use_byte_size_t(), storage.nbytes(),
                      at::DataPtr(data, data, &c10::detail::deleteNothing, c10::kCPU),
                      // an out= argument the kernel resizes moves to fresh CPU memory; the
                      // result is then moved back into the device tensor (run_on_host)
                      c10::GetCPUAllocator(), /*resizable=*/true);
}

// Device storage -> its host alias, for the arguments of one call.
using Aliases = std::unordered_map<const c10::StorageImpl*, c10::Storage>;

at::Tensor over(const c10::Storage& storage, c10::DispatchKey key, const at::Tensor& like);

at::Tensor alias_in(const at::Tensor& t, Aliases& aliases) {
  const auto* key = t.storage().unsafeGetStorageImpl();
  auto it = aliases.find(key);
  if (it == aliases.end()) {
    it = aliases.emplace(key, host_storage(t.storage())).first;
  }
  // built directly (no dispatch): this runs for every tensor argument of every op
  return over(it->second, c10::DispatchKey::CPU, t);
}

// A tensor of ``like``'s dtype, sizes, strides and offset over ``storage``.
at::Tensor over(const c10::Storage& storage, c10::DispatchKey key, const at::Tensor& like) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(key), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                 like.storage_offset());
  return t;
}



bool on_device(const c10::IValue& v) {
  return v.isTensor() && v.toTensor().defined() && v.toTensor().is_privateuseone();
}

// cpu's kernels would take a cpu tensor beside the host aliases without complaint; on a
// device, ATen refuses it (0-dim cpu tensors are scalars and welcome; indexing takes cpu
// indices, as on cuda).
void check_one_device(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                      size_t first) {
  if (schema.name().rfind("aten::index", 0) == 0 || schema.name() == "aten::_index_put_impl_") {
    return;
  }
  bool device = false, cpu = false;
  auto see = [&](const at::Tensor& t) {
    if (t.defined()) {
      device |= t.is_privateuseone();
      cpu |= t.is_cpu() && t.dim() > 0;
    }
  };
  for (size_t i = first; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      see(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        see(t);
      }
    }
  }
  TORCH_CHECK(!(device && cpu), "Expected all tensors to be on the same device, but found at "
              "least two devices, neuron:0 and cpu! (", schema.name(), ")");
}

}  // namespace

void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  for (const auto& r : schema.returns()) {
    TORCH_CHECK(!r.alias_info() || r.alias_info()->isWrite(), "neuron: ", schema.name(),
                " returns a view and has no device kernel");
  }
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  Aliases aliases;
  // device tensors written by the op (in-place, out=): host alias -> the device tensor
  std::vector<std::pair<at::Tensor, at::Tensor>> written;
  check_one_device(schema, *stack, first);
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = (*stack)[first + i];
    const auto* info = schema.arguments()[i].alias_info();
    const bool writes = info && info->isWrite();
    if (on_device(v)) {
      at::Tensor dev = v.toTensor();
      at::Tensor host = alias_in(dev, aliases);
      if (writes) {
        written.emplace_back(host, dev);
      }
      v = host;
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        at::Tensor t = list[j];
        if (t.defined() && t.is_privateuseone()) {
          at::Tensor host = alias_in(t, aliases);
          if (writes) {
            written.emplace_back(host, t);
          }
          list[j] = host;
        }
      }
    } else if (v.isOptionalTensorList()) {
      auto list = v.toOptionalTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> t = list[j];
        if (t && t->defined() && t->is_privateuseone()) {
          list[j] = alias_in(*t, aliases);
        }
      }
    } else if (v.isGenerator() && v.toGenerator().device().is_privateuseone()) {
      v = cpu_generator(v.toGenerator());
    } else if (v.isDevice() && v.toDevice().is_privateuseone()) {
      v = c10::IValue(c10::Device(c10::kCPU));
    }
  }
  // an op that returns a value that is not a tensor reads device memory: the host waits
  bool reads = false;
  for (const auto& r : schema.returns()) {
    auto kind = r.type()->kind();
    reads |= kind != c10::TypeKind::TensorType && kind != c10::TypeKind::ListType;
  }
  if (reads) {
    wait(schema.name().c_str());
  }
  // a factory's device lives in its TensorOptions: run it on cpu, return it on the device
  const auto start = std::chrono::steady_clock::now();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }
  launched(std::chrono::steady_clock::now() - start, schema.name().c_str());
  // results: a written argument's alias is the device tensor it aliases; fresh ones move
  const size_t m = schema.returns().size();
  const size_t out0 = stack->size() - m;
  auto back = [&](const at::Tensor& host) -> at::Tensor {
    for (auto& [alias, dev] : written) {
      if (host.is_same(alias)) {
        if (alias.data_ptr() != dev.data_ptr() || alias.sizes() != dev.sizes()) {
          // an out= argument the kernel resized: the device tensor takes the new shape
          dev.resize_(alias.sizes());
          host_alias(dev).copy_(alias);
        }
        return dev;
      }
    }
    return to_device(host);
  };
  for (size_t i = out0; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().is_cpu()) {
      v = back(v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        at::Tensor t = list[j];
        if (t.defined() && t.device().is_cpu()) {
          list[j] = back(t);
        }
      }
    }
  }
}

at::Tensor host_alias(const at::Tensor& t) {
  Aliases aliases;
  return alias_in(t, aliases);
}

// A fresh result of a CPU kernel as a device tensor: its memory adopted by the device when
// it is the CPU allocator's own and nothing else holds it (no copy), else copied.
std::optional<at::Tensor> host_or_none(const std::optional<at::Tensor>& t) {
  if (!t || !t->defined()) {
    return std::nullopt;
  }
  return host_alias(*t);
}

at::Tensor to_device(const at::Tensor& host) {
  if (host.storage().use_count() == 1 && adopt(host.storage())) {
    return over(host.storage(), c10::DispatchKey::PrivateUse1, host);
  }
  at::Tensor out = at::empty_strided(host.sizes(), host.strides(),
                                     host.options().device(c10::DeviceType::PrivateUse1));
  host_alias(out).copy_(host);
  return out;
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
}

}  // namespace neuron
