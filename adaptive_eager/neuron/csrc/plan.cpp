// Plans: what an op returns, known before it runs, so that it can be queued.
//
// An op's results (which are its written arguments, and the dtype, sizes and strides of each
// fresh one) come from its meta kernel, run on meta twins of its arguments: the arguments are
// checked as cpu checks them and no value is read. Many of ATen's meta kernels are Python
// (torch._meta_registrations), tens of microseconds each, so plans are cached by everything a
// meta kernel's answer depends on (the key below): a loop pays it once per distinct call.
//
// The key: the op; per tensor argument its device, dtype, sizes, strides, offset, whether it
// is a wrapped number, and which earlier argument shares its storage (aliasing changes what
// an in-place op may do); ints, bools, strings, floats and lists of them by value (they are
// dimensions, sizes, modes and flags); a ``Scalar`` by its type only (its value is data: a
// learning rate changes every step and must not miss; it changes no result's shape or dtype).
// A host tensor argument (a 0-dim scalar tensor, cpu indices) is planned with a meta twin, as
// the launch runs cpu's kernel on it beside the host aliases (it is snapshotted when the op
// is issued, fallback.cpp). Not plannable: a tensor of another device. An op the meta kernel
// refuses (no meta kernel, a data-dependent shape, or an error cpu's kernel will raise) is
// cached as not plannable: it runs at once (fallback.cpp), where cpu's kernel raises eager's
// own error at the line. Where a meta kernel would refuse a ``Scalar``
// value it accepted for another (``int_tensor.pow(-1)`` after ``pow(2)``), cpu's kernel raises
// on the device instead, and the error is re-raised at the next sync naming the op.
#include "neuron.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace neuron {
namespace {

// Device storage -> its meta twin, for the arguments of one call.
using Twins = std::unordered_map<const c10::StorageImpl*, c10::Storage>;

at::Tensor meta_twin(const at::Tensor& t, Twins& twins) {
  const auto* key = t.storage().unsafeGetStorageImpl();
  auto it = twins.find(key);
  if (it == twins.end()) {
    // not resizable unless empty: an out= argument the op would resize is not plannable,
    // but for an empty one (make_plan)
    const bool empty = t.storage().nbytes() == 0;
    it = twins.emplace(key, c10::Storage(c10::Storage::use_byte_size_t(), t.storage().nbytes(),
                                         at::DataPtr(nullptr, c10::Device(c10::kMeta)),
                                         empty ? c10::GetAllocator(c10::kMeta) : nullptr,
                                         /*resizable=*/empty)).first;
  }
  return over(it->second, c10::DispatchKey::Meta, t);
}

bool on_device(const at::Tensor& t) {
  return t.defined() && t.is_privateuseone();
}

// The cache key of one call (see the file's comment).
struct Key {
  std::string bytes;
  std::vector<const c10::StorageImpl*> storages;  // of the tensors so far, in order
  bool scalar_values = false;  // Scalars by value too (a plan that resizes out= arguments)

  template <typename T>
  void put(T v) {
    bytes.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void put_ints(c10::IntArrayRef v) {
    put<int64_t>(static_cast<int64_t>(v.size()));
    bytes.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
  }
  void tensor(const at::Tensor& t) {
    if (!t.defined()) {
      put<char>('N');
      return;
    }
    put<char>('T');
    put<int8_t>(static_cast<int8_t>(t.device().type()));
    put<int8_t>(static_cast<int8_t>(t.scalar_type()));
    put<bool>(t.unsafeGetTensorImpl()->is_wrapped_number());
    put_ints(t.sizes());
    put_ints(t.strides());
    put<int64_t>(t.storage_offset());
    const auto* s = t.storage().unsafeGetStorageImpl();
    int32_t shared = -1;
    for (size_t i = 0; i < storages.size(); ++i) {
      if (storages[i] == s) {
        shared = static_cast<int32_t>(i);
        break;
      }
    }
    put<int32_t>(shared);
    storages.push_back(s);
  }
  // false: a value the key cannot hold (the call is planned uncached)
  bool value(const c10::IValue& v, const c10::Argument& arg) {
    if (v.isTensor()) {
      tensor(v.toTensor());
    } else if (v.isNone()) {
      put<char>('n');
    } else if (v.isTensorList()) {
      put<char>('L');
      put<int64_t>(static_cast<int64_t>(v.toTensorList().size()));
      for (const at::Tensor& t : v.toTensorList()) {
        tensor(t);
      }
    } else if (v.isOptionalTensorList()) {
      put<char>('O');
      auto list = v.toOptionalTensorList();
      put<int64_t>(static_cast<int64_t>(list.size()));
      for (const std::optional<at::Tensor>& t : list) {
        tensor(t ? *t : at::Tensor());
      }
    } else if (arg.type()->kind() == c10::TypeKind::NumberType ||
               (arg.type()->castRaw<c10::OptionalType>() &&
                arg.type()->castRaw<c10::OptionalType>()->getElementType()->kind() ==
                    c10::TypeKind::NumberType)) {
      put<char>(v.isDouble() ? 'd' : v.isInt() ? 'i' : v.isBool() ? 'b' : 'c');  // a Scalar
      if (scalar_values && v.isDouble()) {
        put<double>(v.toDouble());
      } else if (scalar_values && (v.isInt() || v.isBool())) {
        put<int64_t>(v.isInt() ? v.toInt() : v.toBool());
      } else if (scalar_values && !v.isNone()) {
        return false;  // a complex or symbolic value: planned uncached
      }
    } else if (v.isInt()) {
      put<char>('i');
      put<int64_t>(v.toInt());
    } else if (v.isDouble()) {
      put<char>('d');
      put<double>(v.toDouble());
    } else if (v.isBool()) {
      put<char>(v.toBool() ? 'B' : 'b');
    } else if (v.isString()) {
      put<char>('s');
      const auto& s = v.toStringRef();
      put<int64_t>(static_cast<int64_t>(s.size()));
      bytes.append(s);
    } else if (v.isIntList()) {
      put<char>('l');
      put_ints(v.toIntList().vec());
    } else if (v.isDoubleList()) {
      put<char>('f');
      for (double d : v.toDoubleList()) {
        put<double>(d);
      }
    } else if (v.isBoolList()) {
      put<char>('k');
      for (bool b : v.toBoolList()) {
        put<bool>(b);
      }
    } else if (v.isDevice()) {
      put<char>('D');
      put<int8_t>(static_cast<int8_t>(v.toDevice().type()));
      put<int8_t>(v.toDevice().index());
    } else if (v.isList()) {  // a list of Scalars (``Scalar[]``): their types
      put<char>('S');
      for (const c10::IValue& e : v.toListRef()) {
        put<char>(e.isDouble() ? 'd' : e.isInt() ? 'i' : e.isBool() ? 'b' : 'c');
      }
    } else {
      return false;
    }
    return true;
  }
};

// Ops whose cpu kernel returns other sizes, dtypes or strides than their meta kernel plans
// (found by the OpInfo sweep on the device, tests/fidelity): never planned, they run at once.
// A launch that finds another such op adds it (``learn_disagreement``, fallback.cpp).
std::mutex disagreeing_lock;
std::unordered_set<std::string>& disagreeing = *new std::unordered_set<std::string>{
    // in eval mode cpu returns empty saved statistics, the meta kernel full-size ones
    "aten::native_batch_norm", "aten::_native_batch_norm_legit",
    "aten::_native_batch_norm_legit_no_training",
    // cpu's offset2bag, bag_size and max_indices take other sizes than the meta kernel's
    "aten::_embedding_bag", "aten::_embedding_bag_forward_only",
    // cpu returns other strides
    "aten::max_unpool2d", "aten::max_unpool3d", "aten::_linalg_svd", "aten::linalg_lstsq"};

bool disagrees(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first) {
  const auto& schema = op.schema();
  if (schema.name() == "aten::native_layer_norm") {
    // cpu returns the mean and rstd in a 16-bit input's dtype, the meta kernel in float
    const at::ScalarType t = stack[first].toTensor().scalar_type();
    return t == at::kBFloat16 || t == at::kHalf;
  }
  std::lock_guard<std::mutex> guard(disagreeing_lock);
  return disagreeing.count(schema.name()) > 0;
}

std::shared_ptr<const Plan> make_plan(const c10::OperatorHandle& op,
                                      const torch::jit::Stack& stack, size_t first) {
  auto plan = std::make_shared<Plan>();
  const auto& schema = op.schema();
  if (disagrees(op, stack, first)) {
    return plan;
  }
  const size_t n = schema.arguments().size();
  Twins twins;
  torch::jit::Stack meta;
  meta.reserve(n);
  std::vector<std::pair<at::Tensor, at::Tensor>> written;  // meta twin, device tensor
  bool cpu_tensor = false;
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = stack[first + i];
    const auto* info = schema.arguments()[i].alias_info();
    const bool writes = info && info->isWrite();
    auto twin = [&](const at::Tensor& t) {
      if (!on_device(t)) {
        if (t.defined() && t.is_cpu() && !t.unsafeGetTensorImpl()->is_wrapped_number()) {
          // a host tensor (a 0-dim scalar, cpu indices): the launch runs cpu's kernel on it
          // beside the host aliases, so its twin is a meta tensor like theirs
          return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
        }
        cpu_tensor |= t.defined() && !t.is_cpu();  // another device's: runs at once
        return t;
      }
      at::Tensor m = meta_twin(t, twins);
      if (writes) {
        written.emplace_back(m, t);
      }
      return m;
    };
    if (v.isTensor()) {
      meta.emplace_back(twin(v.toTensor()));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) {
        list.push_back(twin(t));
      }
      meta.emplace_back(std::move(list));
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> list;
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
        list.push_back(t ? std::optional<at::Tensor>(twin(*t)) : t);
      }
      meta.emplace_back(std::move(list));
    } else if (v.isDevice() && v.toDevice().is_privateuseone()) {
      meta.emplace_back(c10::Device(c10::kMeta));
    } else {
      meta.push_back(v);
    }
  }
  if (cpu_tensor) {
    return plan;
  }
  try {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &meta);
  } catch (const std::exception&) {
    return plan;  // not plannable
  }
  for (size_t w = 0; w < written.size(); ++w) {
    const auto& [m, dev] = written[w];
    if (m.sizes() != dev.sizes() || m.strides() != dev.strides() ||
        m.storage_offset() != dev.storage_offset()) {
      // an empty out= argument the op sizes contiguously: the host resizes it (as cpu's
      // kernel would, without a warning); any other restriding: not plannable
      if (dev.numel() != 0 || dev.storage_offset() != 0 || m.storage_offset() != 0 ||
          !m.is_contiguous()) {
        return plan;
      }
      plan->resizes.push_back({static_cast<int32_t>(w), m.sizes().vec()});
    }
  }
  auto out_of = [&](const at::Tensor& m) -> std::optional<Plan::Out> {
    Plan::Out out;
    if (!m.defined()) {
      out.kind = Plan::Out::kUndefined;
      return out;
    }
    for (size_t w = 0; w < written.size(); ++w) {
      if (m.is_same(written[w].first)) {
        out.kind = Plan::Out::kWritten;
        out.written = static_cast<int32_t>(w);
        return out;
      }
    }
    if (!m.is_meta() || m.storage_offset() != 0) {
      return std::nullopt;
    }
    out.kind = Plan::Out::kFresh;
    out.sizes = m.sizes().vec();
    out.strides = m.strides().vec();
    out.dtype = m.scalar_type();
    return out;
  };
  for (const c10::IValue& r : meta) {
    Plan::Ret ret;
    if (r.isTensor()) {
      auto out = out_of(r.toTensor());
      if (!out) {
        return plan;
      }
      ret.outs.push_back(std::move(*out));
    } else if (r.isTensorList()) {
      ret.list = true;
      for (const at::Tensor& m : r.toTensorList()) {
        auto out = out_of(m);
        if (!out) {
          return plan;
        }
        ret.outs.push_back(std::move(*out));
      }
    } else {
      return plan;
    }
    plan->returns.push_back(std::move(ret));
  }
  plan->ok = true;
  return plan;
}

}  // namespace

namespace {
std::atomic<int> disagreements{0};  // bumped by each one learned: cached plans are dropped
}  // namespace

void learn_disagreement(const c10::OperatorHandle& op) {
  std::lock_guard<std::mutex> guard(disagreeing_lock);
  if (disagreeing.insert(op.schema().name()).second) {
    disagreements.fetch_add(1);
  }
}

std::shared_ptr<const Plan> plan_for(const c10::OperatorHandle& op,
                                     const torch::jit::Stack& stack, size_t first) {
  // per thread (the host's and autograd's), so no lock; bounded: a program whose calls never
  // repeat starts over
  thread_local std::unordered_map<std::string, std::shared_ptr<const Plan>> cache;
  thread_local Key key;  // reused: its buffers keep their capacity from call to call
  thread_local int known_disagreements = 0;
  if (const int n = disagreements.load(std::memory_order_relaxed); n != known_disagreements) {
    cache.clear();
    known_disagreements = n;
  }
  key.bytes.clear();
  key.storages.clear();
  const auto& schema = op.schema();
  key.put<const void*>(&schema);
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    if (!key.value(stack[first + i], schema.arguments()[i])) {
      return make_plan(op, stack, first);
    }
  }
  auto it = cache.find(key.bytes);
  if (it != cache.end() && it->second->resizes.empty()) {
    return it->second;
  }
  if (cache.size() >= 65536) {
    cache.clear();
    it = cache.end();
  }
  if (it == cache.end()) {
    auto plan = make_plan(op, stack, first);
    cache.emplace(key.bytes, plan);
    if (plan->resizes.empty()) {
      return plan;
    }
  }
  // a plan that resizes out= arguments: its sizes follow the Scalars' values, so it is
  // cached under a key holding them (the entry above only says so)
  key.bytes.clear();
  key.storages.clear();
  key.scalar_values = true;
  key.put<const void*>(&schema);
  key.put<char>('v');
  bool keyed = true;
  for (size_t i = 0; keyed && i < schema.arguments().size(); ++i) {
    keyed = key.value(stack[first + i], schema.arguments()[i]);
  }
  key.scalar_values = false;
  if (!keyed) {
    return make_plan(op, stack, first);
  }
  auto by_value = cache.find(key.bytes);
  if (by_value != cache.end()) {
    return by_value->second;
  }
  auto plan = make_plan(op, stack, first);
  cache.emplace(key.bytes, plan);
  return plan;
}

}  // namespace neuron
