// An op's ``out=`` form: the overload that takes the same arguments and writes its results into
// tensors it is given (``mm`` -> ``mm.out``, ``sum.dim_IntList`` -> ``sum.IntList_out``).
//
// A launch whose results are all fresh runs that form on the planned device memory, so cpu's
// kernel writes the results where they belong. Running the functional form instead makes the
// worker allocate each result from the CPU allocator, copy it into the device's memory and
// leave the free to the host thread: for a 64x64 matmul, half the launch's time.
//
// The two forms run the same kernel (structured kernels share it; an out form PyTorch
// generates calls the functional one and copies). Where a launch finds otherwise -- the out
// form raises where the op does not, or leaves a result other than planned (cpu's kernel
// sizes it otherwise than the meta kernel) -- the launch runs the functional form, the form is
// dropped (counted with its reason: ``torch.neuron``'s counters) and the op's launches run the
// functional form from then on.
#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <mutex>
#include <unordered_map>

namespace neuron {
namespace {

// Same arguments, then one ``out`` tensor per tensor the functional form returns.
bool is_out_form_of(const c10::FunctionSchema& out, const c10::FunctionSchema& fn) {
  const auto& args = fn.arguments();
  const auto& outs = out.arguments();
  if (outs.size() != args.size() + fn.returns().size() || out.returns().size() != fn.returns().size()) {
    return false;
  }
  for (size_t i = 0; i < args.size(); ++i) {
    if (outs[i].name() != args[i].name() || *outs[i].type() != *args[i].type() || outs[i].is_out()) {
      return false;
    }
  }
  for (size_t i = args.size(); i < outs.size(); ++i) {
    if (!outs[i].is_out() || outs[i].type()->kind() != c10::TypeKind::TensorType) {
      return false;
    }
  }
  return true;
}

// Every op's overloads, by name: built once, on first use.
const std::unordered_map<std::string, std::vector<c10::OperatorName>>& overloads() {
  static auto* by_name = [] {
    auto* m = new std::unordered_map<std::string, std::vector<c10::OperatorName>>;
    for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
      (*m)[name.name].push_back(name);
    }
    return m;
  }();
  return *by_name;
}

std::mutex lock;
std::unordered_map<const c10::FunctionSchema*, OutForm*>& known() {
  static auto* m = new std::unordered_map<const c10::FunctionSchema*, OutForm*>;  // never freed
  return *m;
}

std::map<std::string, std::string>& dropped() {
  static auto* m = new std::map<std::string, std::string>;
  return *m;
}

}  // namespace

void OutForm::drop(const char* why) {
  usable = false;
  std::lock_guard<std::mutex> guard(lock);
  dropped().emplace(of, why);
}

std::map<std::string, std::string> dropped_out_forms() {
  std::lock_guard<std::mutex> guard(lock);
  return dropped();
}

OutForm* out_form(const c10::OperatorHandle& op) {
  const c10::FunctionSchema& fn = op.schema();
  // asked on every launch: a per-thread copy of the answers, no lock (forms are never freed)
  thread_local std::unordered_map<const c10::FunctionSchema*, OutForm*> seen;
  if (auto it = seen.find(&fn); it != seen.end()) {
    return it->second;
  }
  std::lock_guard<std::mutex> guard(lock);
  if (auto it = known().find(&fn); it != known().end()) {
    return seen[&fn] = it->second;
  }
  OutForm* form = nullptr;
  bool all_tensors = !fn.returns().empty() && !fn.is_mutable();
  for (const auto& r : fn.returns()) {
    all_tensors &= r.type()->kind() == c10::TypeKind::TensorType && !r.alias_info();
  }
  if (all_tensors) {
    auto found = overloads().find(fn.name());
    if (found != overloads().end()) {
      for (const c10::OperatorName& name : found->second) {
        auto handle = c10::Dispatcher::singleton().findSchema(name);
        if (handle && is_out_form_of(handle->schema(), fn)) {
          form = new OutForm{*handle, launch_name(op)};
          break;
        }
      }
    }
  }
  return seen[&fn] = known()[&fn] = form;
}

}  // namespace neuron
