// Every op without a kernel of the device's own runs ATen's CPU kernel on the device's memory,
// as one launch on the device's queue (queue.cpp).
//
// Issuing (host): the op's plan (plan.cpp: its meta kernel's answer, cached) says what it
// returns without reading a value. Fresh results are allocated on the device from the plan,
// written arguments are returned as themselves, and the launch is queued.
// Running (worker): each neuron tensor argument is replaced by a host alias, a CPU tensor
// over the same bytes (one CPU storage per device storage, so two arguments sharing memory
// still share it, and ATen's overlap checks see what they see on cpu). In-place and ``out=``
// results are written straight into device memory; fresh ones are copied into the planned
// outputs.
//
// Where the plan cannot be made without the values, the op runs at once instead, after the
// queue has drained (a sync point, counted with its reason): ops that are not plannable
// (plan.cpp), ops returning a value that is not a tensor, and random ops that read device
// memory (the device draws from the CPU generator, which the host shares, so draws happen
// in program order on the host; random.cpp draws a filler's numbers without waiting).
// View results never come here (a view op without a kernel in kernels.cpp is an error naming
// it, never a silent copy).
#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

namespace neuron {

at::Tensor over(const c10::Storage& storage, c10::DispatchKey key, const at::Tensor& like) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(key), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                 like.storage_offset());
  // a lazily conjugated or negated view stays one (kernels that take them read the bits)
  t.unsafeGetTensorImpl()->_set_conj(like.is_conj());
  t.unsafeGetTensorImpl()->_set_neg(like.is_neg());
  return t;
}

namespace {

// ``resizable``: an out= argument the kernel resizes moves to fresh CPU memory (its result is
// then moved back into the device tensor: run_now). A launch's planned results are not: a
// kernel that would resize one raises instead (HostCall::run_out_form).
c10::Storage host_storage(const c10::Storage& storage, bool resizable = true) {
  void* data = storage.mutable_data();
  return c10::Storage(c10::Storage::use_byte_size_t(), storage.nbytes(),
                      at::DataPtr(data, data, &c10::detail::deleteNothing, c10::kCPU),
                      resizable ? c10::GetCPUAllocator() : nullptr, resizable);
}

// Device storage -> its host alias, for the arguments of one call (a few: searched in order).
using Aliases = c10::SmallVector<std::pair<const c10::StorageImpl*, c10::Storage>, 4>;

at::Tensor alias_in(const at::Tensor& t, Aliases& aliases) {
  const auto* key = t.storage().unsafeGetStorageImpl();
  for (const auto& [storage, host] : aliases) {
    if (storage == key) {
      return over(host, c10::DispatchKey::CPU, t);
    }
  }
  aliases.emplace_back(key, host_storage(t.storage()));
  // built directly (no dispatch): this runs for every tensor argument of every op
  return over(aliases.back().second, c10::DispatchKey::CPU, t);
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

// An out= argument cpu's kernel resized or restrided (``alias``, its host alias after the
// call): the device tensor takes what the kernel left, geometry included (lstsq's solution is
// a column-major view into a larger buffer). Memory the kernel moved to the CPU allocator is
// copied into device memory whole. The queue has drained: nothing else touches it.
void adopt_geometry(at::Tensor& dev, const at::Tensor& alias) {
  if (alias.storage().data() != dev.storage().data()) {
    const size_t nbytes = alias.storage().nbytes();
    c10::Storage moved(c10::Storage::use_byte_size_t(), nbytes, allocator(), /*resizable=*/true);
    if (nbytes > 0) {
      std::memcpy(moved.mutable_data(), alias.storage().data(), nbytes);
    }
    dev.set_(moved, alias.storage_offset(), alias.sizes(), alias.strides());
  } else if (alias.sizes() != dev.sizes() || alias.strides() != dev.strides() ||
             alias.storage_offset() != dev.storage_offset()) {
    dev.set_(dev.storage(), alias.storage_offset(), alias.sizes(), alias.strides());
  }
}

}  // namespace

// The op at once, on the calling thread, once the queue has drained.
void run_now(const c10::OperatorHandle& op, torch::jit::Stack* stack, const char* reason) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  Aliases aliases;
  // device tensors written by the op (in-place, out=): host alias -> the device tensor
  std::vector<std::pair<at::Tensor, at::Tensor>> written;
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
  wait(std::string(reason) + ": " + schema.name());
  // a factory's device lives in its TensorOptions: run it on cpu, return it on the device
  const auto start = std::chrono::steady_clock::now();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }
  launched(std::chrono::steady_clock::now() - start, launch_name(op));
  wait_until(device_free_at());  // its results are the host's now: the launch has ended
  // results: a written argument's alias is the device tensor it aliases; fresh ones move
  const size_t m = schema.returns().size();
  const size_t out0 = stack->size() - m;
  auto back = [&](const at::Tensor& host) -> at::Tensor {
    for (auto& [alias, dev] : written) {
      if (host.is_same(alias)) {
        adopt_geometry(dev, alias);
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

namespace {

// What the fallback needs to know of an op, from its schema, once per op.
struct Traits {
  bool view = false;    // returns a view of an argument
  bool reads = false;   // returns a value that is not a tensor: the host reads device memory
  bool random = false;  // takes a generator
};

const Traits& traits_of(const c10::FunctionSchema& schema) {
  thread_local std::unordered_map<const c10::FunctionSchema*, Traits> known;
  auto it = known.find(&schema);
  if (it != known.end()) {
    return it->second;
  }
  Traits t;
  for (const auto& r : schema.returns()) {
    t.view |= r.alias_info() && !r.alias_info()->isWrite();
    auto kind = r.type()->kind();
    t.reads |= kind != c10::TypeKind::TensorType && kind != c10::TypeKind::ListType;
  }
  for (const auto& a : schema.arguments()) {
    auto type = a.type();
    if (auto opt = type->castRaw<c10::OptionalType>()) {
      type = opt->getElementType();
    }
    t.random |= type->kind() == c10::TypeKind::GeneratorType;
  }
  return known.emplace(&schema, t).first->second;
}

// Where the launch puts a fresh result: return ``index`` (element ``element`` of a list).
struct Fresh {
  size_t index;
  int64_t element;  // -1: the return is a tensor
  at::Tensor dest;  // a host alias of the planned device tensor (not owning it: see HostCall)
  // the plan, for an out= form that changed dest (HostCall::run_out_form)
  c10::Storage storage;
  c10::impl::SizesAndStrides sizes;
};

// Same strides wherever they matter (a dimension of size 1 or 0 may have any stride).
bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) {
      return false;
    }
  }
  return true;
}

// Holds back the warnings raised while it lives; ``pass_on`` gives them to the handler that
// was in place.
class HeldWarnings : public c10::WarningHandler {
 public:
  HeldWarnings() : outer_(c10::WarningUtils::get_warning_handler()), guard_(this) {}
  void process(const c10::Warning& warning) override {
    held_.push_back(warning);
  }
  void pass_on() {
    for (const c10::Warning& w : held_) {
      outer_->process(w);
    }
    held_.clear();
  }

 private:
  c10::WarningHandler* outer_;
  c10::WarningUtils::WarningHandlerGuard guard_;
  std::vector<c10::Warning> held_;
};

// The launch, on the worker: cpu's kernel on host aliases, fresh results into the plan.
struct HostCall {
  c10::OperatorHandle op;
  // Host aliases, cpu values snapshotted. A launch does not own the device's storages: the
  // program's tensors die when the program drops them, as in eager (the engine reads their
  // liveness), and the allocator defers freeing their memory until the launches queued before
  // the free have run (allocator.cpp).
  torch::jit::Stack args;
  std::vector<Fresh> fresh;
  OutForm* out = nullptr;  // every result is fresh and the op has an out= form (out_form.cpp)

  void operator()() {
    const bool tried = out && out->usable.load(std::memory_order_relaxed);
    bool raised = false;
    if (tried && run_out_form(raised)) {
      return;
    }
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &args);
    }
    if (tried) {
      out->drop(raised ? "its out= form raised where the op does not"
                       : "its out= form sized a result otherwise than the plan");
    }
    const size_t out0 = args.size() - op.schema().returns().size();
    for (const Fresh& f : fresh) {
      const c10::IValue& v = args[out0 + f.index];
      at::Tensor got = f.element < 0 ? v.toTensor() : v.toTensorList().get(f.element);
      if (got._is_zerotensor()) {  // a ZeroTensor (autograd's zeros) has no memory to copy
        f.dest.zero_();
        continue;
      }
      got = got.resolve_conj().resolve_neg();  // a lazy view's values (dot returns one)
      if (got.sizes() != f.dest.sizes() || got.scalar_type() != f.dest.scalar_type() ||
          !same_layout(got, f.dest)) {
        learn_disagreement(op);  // its later calls run at once, as cpu returns them
      }
      TORCH_CHECK(got.sizes() == f.dest.sizes() && got.scalar_type() == f.dest.scalar_type(),
                  "neuron: ", op.schema().name(), ": cpu's kernel returned ", got.sizes(), " ",
                  got.scalar_type(), " where its meta kernel planned ", f.dest.sizes(), " ",
                  f.dest.scalar_type());
      if (got.strides() == f.dest.strides() && got.is_contiguous()) {
        std::memcpy(f.dest.data_ptr(), got.const_data_ptr(), got.nbytes());
      } else {
        f.dest.copy_(got);
      }
    }
    // the arguments go with the launch, on the host that made them (queue.cpp)
  }

  // cpu's out= kernel writes the results into the planned memory. False where the form
  // raised or left a result other than planned (another shape: cpu's kernel disagrees with
  // the meta kernel); the results are then as planned again, for the functional form, and
  // the warnings the form gave are dropped (the functional form gives its own).
  bool run_out_form(bool& raised) {
    torch::jit::Stack stack(args);
    for (const Fresh& f : fresh) {
      stack.emplace_back(f.dest);
    }
    HeldWarnings warnings;
    try {
      at::AutoDispatchBelowADInplaceOrView guard;
      out->op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &stack);
    } catch (const c10::Error&) {
      raised = true;
    }
    bool ok = !raised;
    for (const Fresh& f : fresh) {
      at::TensorImpl* impl = f.dest.unsafeGetTensorImpl();
      if (!impl->storage().is_alias_of(f.storage) || f.dest.sizes() != f.sizes.sizes_arrayref() ||
          f.dest.strides() != f.sizes.strides_arrayref()) {
        impl->set_storage_keep_dtype(f.storage);
        impl->set_sizes_and_strides(f.sizes.sizes_arrayref(), f.sizes.strides_arrayref(), 0);
        ok = false;
      }
    }
    if (ok) {
      warnings.pass_on();
    }
    return ok;
  }
};

// A host tensor argument as it is now (the host may change it before the launch runs). A
// wrapped number (a Python number's tensor, which type promotion treats apart) is passed as it
// is: it is the binding's own, nothing else holds it, so nothing can change it.
at::Tensor snapshot(const at::Tensor& t) {
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
    return t;
  }
  return t.clone();
}

// Queue the op as one launch; false (nothing done) where its results cannot be planned.
bool launch_planned(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  std::shared_ptr<const Plan> plan = plan_for(op, *stack, first);
  if (!plan->ok) {
    return false;
  }
  // the written arguments, in the plan's order (tensors, lists flattened)
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < n; ++i) {
    const auto* info = schema.arguments()[i].alias_info();
    if (!info || !info->isWrite()) {
      continue;
    }
    const c10::IValue& v = (*stack)[first + i];
    if (v.isTensor()) {
      if (on_device(v)) {
        written.push_back(v.toTensor());
      }
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        if (t.defined() && t.is_privateuseone()) {
          written.push_back(t);
        }
      }
    }
  }
  for (const Plan::Resize& r : plan->resizes) {
    written.at(r.written).resize_(r.sizes);  // an empty out= argument, sized as cpu would
  }
  std::vector<Fresh> fresh;
  std::vector<c10::IValue> results;
  auto result = [&](const Plan::Out& out, size_t j, int64_t e) -> at::Tensor {
    switch (out.kind) {
      case Plan::Out::kUndefined:
        return at::Tensor();
      case Plan::Out::kWritten:
        return written.at(out.written);
      case Plan::Out::kFresh:
        break;
    }
    at::Tensor dest = at::detail::empty_strided_generic(
        out.sizes, out.strides, allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
        out.dtype);
    fresh.push_back({j, e, dest});
    return dest;
  };
  for (size_t j = 0; j < plan->returns.size(); ++j) {
    const Plan::Ret& ret = plan->returns[j];
    if (ret.list) {
      c10::List<at::Tensor> list;
      for (size_t e = 0; e < ret.outs.size(); ++e) {
        list.push_back(result(ret.outs[e], j, static_cast<int64_t>(e)));
      }
      results.emplace_back(std::move(list));
    } else {
      results.emplace_back(result(ret.outs[0], j, -1));
    }
  }
  // the launch's arguments: host aliases now (a later resize_ waits for the queue), values
  // the host may change before the launch runs copied
  OutForm* out = nullptr;
  if (!fresh.empty() && fresh.size() == plan->returns.size() && fresh[0].element < 0) {
    out = out_form(op);  // every result a fresh tensor (no list: out_form checks)
  }
  for (Fresh& f : fresh) {
    const at::Tensor& dev = f.dest;
    f.dest = over(host_storage(dev.storage(), /*resizable=*/false), c10::DispatchKey::CPU, dev);
    if (out) {
      f.storage = f.dest.storage();
      f.sizes.set_sizes(dev.sizes());
      f.sizes.set_strides(dev.strides());
    }
  }
  HostCall call{op, {}, std::move(fresh), out};
  call.args.reserve(n);
  Aliases aliases;
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = (*stack)[first + i];
    if (on_device(v)) {
      call.args.emplace_back(alias_in(v.toTensor(), aliases));
    } else if (v.isTensor() && v.toTensor().defined()) {
      call.args.emplace_back(snapshot(v.toTensor()));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) {
        list.push_back(!t.defined()            ? t
                       : t.is_privateuseone() ? alias_in(t, aliases)
                                              : snapshot(t));
      }
      call.args.emplace_back(std::move(list));
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> list;
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
        list.push_back(!t || !t->defined()      ? t
                       : t->is_privateuseone() ? std::optional<at::Tensor>(alias_in(*t, aliases))
                                               : std::optional<at::Tensor>(snapshot(*t)));
      }
      call.args.emplace_back(std::move(list));
    } else if (v.isDevice() && v.toDevice().is_privateuseone()) {
      call.args.emplace_back(c10::Device(c10::kCPU));
    } else {
      call.args.push_back(std::move(v));
    }
  }
  // queued while the arguments are still held here: a storage freed first would have its
  // memory freed at once if the queue were idle
  submit(std::move(call), launch_name(op));
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  for (auto& r : results) {
    stack->push_back(std::move(r));
  }
  return true;
}

}  // namespace

const char* launch_name(const c10::OperatorHandle& op) {
  const auto* schema = &op.schema();
  thread_local std::unordered_map<const c10::FunctionSchema*, const char*> known;  // no lock
  if (auto it = known.find(schema); it != known.end()) {
    return it->second;
  }
  // never erased: the names have static storage, as counters and error notes need
  static auto& names = *new std::unordered_map<const c10::FunctionSchema*, std::string>;
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  auto it = names.find(schema);
  if (it == names.end()) {
    std::string name = schema->name();
    if (!schema->overload_name().empty()) {
      name += "." + schema->overload_name();
    }
    it = names.emplace(schema, std::move(name)).first;
  }
  return known[schema] = it->second.c_str();
}

void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const Traits& t = traits_of(schema);
  TORCH_CHECK(!t.view, "neuron: ", schema.name(), " returns a view and has no device kernel");
  check_one_device(schema, *stack, stack->size() - schema.arguments().size());
  if (t.reads) {
    run_now(op, stack, "reads a value");
  } else if (t.random) {
    if (!draw_on_host(op, stack)) {
      run_now(op, stack, "random op");
    }
  } else if (!launch_planned(op, stack)) {
    run_now(op, stack, "not planned");
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
