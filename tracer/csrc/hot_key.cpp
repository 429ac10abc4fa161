// Stage 2 of the compiled hot path, its mechanism (Note [Below the floor]): a dispatch key
// below autograd that the engine switches on in thread-local state while a path is hot, so
// that each op reaches an unboxed C++ kernel of ours instead of the Python dispatch mode.
//
// The key is PrivateUse3. Included in the thread's dispatch key set, its backend bit is the
// highest one of every call, so autograd (AutogradPrivateUse3: autograd's kernels serve every
// backend) records its node as usual and redispatches to our kernel for the dense key. The
// kernels are generated at compile time from ATen's operator structs (at::_ops::<op>::schema
// is the unboxed signature), one template instantiation per op; an op without a kernel of
// ours meets the boxed fallback, which hands it back: it runs below our key, as if the key
// were off, and is counted.
//
// Engaged (set_engaged, from Python outside any op: Note [Below the floor]), the mode's keys are
// excluded from the thread's dispatch and the key included: every op below autograd reaches
// a kernel of ours, and goes to the dispatch mode on top of the stack from there (ROUTE), or
// runs below when no mode is on the stack (inside the mode's own handling, which pops it).
// Ops with a composite kernel for every backend would reach us decomposed, so the boxed
// routing is registered for each of them by name (register_composites).
//
// What a kernel does is chosen per process (set_action), for measuring the mechanism itself:
//   0 HANDBACK  run the op below our key (what every op did without it)
//   1 CANNED    return a preallocated tensor (the cost of reaching the kernel; in the boxed
//               fallback, the cost of reaching a boxed kernel)
//   2 ALLOCATE  return a fresh tensor shaped like the first tensor argument (the cost of
//               reaching the kernel and allocating its output with CPU's own allocator)
//   3 ROUTE     send the op to the dispatch mode (what engaging costs an op the mode serves)
#include <torch/extension.h>
#include <ATen/Operators.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <atomic>
#include <type_traits>

namespace {

constexpr auto kKey = c10::DispatchKey::PrivateUse3;

int g_action = 0;
at::Tensor g_canned;
std::atomic<int64_t> g_kernel_calls{0}, g_handed_back{0};

// An op handed back runs below our key, and so does every op it calls: the key is off in the
// thread while it runs. (Only the backend bit is taken out of the call's key set: the key's
// functionality is Dense, which the op's own backend needs.)
struct KeyOff {
  bool was = c10::impl::tls_is_dispatch_key_included(kKey);
  KeyOff() { c10::impl::tls_set_dispatch_key_included(kKey, false); }
  ~KeyOff() { c10::impl::tls_set_dispatch_key_included(kKey, was); }
};

c10::DispatchKeySet below(c10::DispatchKeySet ks) {
  return ks.remove_backend(c10::BackendComponent::PrivateUse3Bit);
}

constexpr auto kPython = c10::DispatchKey::Python;
constexpr auto kSnapshot = c10::DispatchKey::PythonTLSSnapshot;

// The mode's keys un-excluded while an op goes to the mode: PythonTLSSnapshot records the
// thread's key sets for the mode's handling, and the mode counts as active only where
// Python is not excluded in them.
struct ModeKeysOn {
  bool python = c10::impl::tls_is_dispatch_key_excluded(kPython);
  bool snapshot = c10::impl::tls_is_dispatch_key_excluded(kSnapshot);
  ModeKeysOn() {
    c10::impl::tls_set_dispatch_key_excluded(kPython, false);
    c10::impl::tls_set_dispatch_key_excluded(kSnapshot, false);
  }
  ~ModeKeysOn() {
    c10::impl::tls_set_dispatch_key_excluded(kPython, python);
    c10::impl::tls_set_dispatch_key_excluded(kSnapshot, snapshot);
  }
};

void route(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() == 0) {  // inside the mode's handling
    KeyOff off;
    op.redispatchBoxed(below(ks), stack);
    return;
  }
  ModeKeysOn on;
  op.redispatchBoxed(below(ks).add(kPython).add(kSnapshot), stack);
}

template <class T>
const at::Tensor* tensor_of(const T& x) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return &x;
  } else {
    return nullptr;
  }
}

template <class... A>
const at::Tensor& first_tensor(const A&... a) {
  const at::Tensor* found = nullptr;
  ((found = found ? found : tensor_of(a)), ...);
  TORCH_CHECK(found != nullptr, "adaptive_eager hot key: an op without a tensor argument");
  return *found;
}

template <class Op, class Sig = typename Op::schema>
struct Hot;

template <class Op, class... A>
struct Hot<Op, at::Tensor(A...)> {
  static at::Tensor call(c10::DispatchKeySet ks, A... a) {
    g_kernel_calls.fetch_add(1, std::memory_order_relaxed);
    if (g_action == 1) return g_canned;
    if (g_action == 2) {
      const at::Tensor& t = first_tensor(a...);
      return at::detail::empty_strided_cpu(t.sizes(), t.strides(), t.scalar_type());
    }
    if (g_action == 3) {
      if (c10::impl::TorchDispatchModeTLS::stack_len() == 0) {
        KeyOff off;
        return Op::redispatch(below(ks), a...);
      }
      ModeKeysOn on;
      return Op::redispatch(below(ks).add(kPython).add(kSnapshot), a...);
    }
    KeyOff off;
    return Op::redispatch(below(ks), a...);
  }
};

void hand_back(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (g_action == 3) {
    route(op, ks, stack);
    return;
  }
  if (g_action == 1) {  // canned, boxed: what a boxed kernel costs (every op of one result)
    torch::jit::drop(*stack, op.schema().arguments().size());
    stack->emplace_back(g_canned);
    return;
  }
  g_handed_back.fetch_add(1, std::memory_order_relaxed);
  KeyOff off;
  op.redispatchBoxed(below(ks), stack);
}

// The ops with a kernel of ours (the prototype's: the chain benchmarks' elementwise ops)
#define AE_HOT_OPS(X) X(add_Tensor) X(mul_Tensor)

std::string op_name(const char* qualified, const char* overload) {
  std::string out(qualified + 6);  // past "aten::"
  if (*overload) out = out + "." + overload;
  return out;
}

#define AE_IMPL(OP) \
  m.impl(op_name(at::_ops::OP::name, at::_ops::OP::overload_name).c_str(), \
         TORCH_FN(Hot<at::_ops::OP>::call));

TORCH_LIBRARY_IMPL(aten, PrivateUse3, m) {
  AE_HOT_OPS(AE_IMPL)
}

TORCH_LIBRARY_IMPL(_, PrivateUse3, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&hand_back>());
}

std::unique_ptr<torch::Library> g_composites;

// The boxed fallback registered by name for every aten op that has a composite kernel for
// all backends and no implicit one (whose autograd would then be lost), and no kernel of ours.
int64_t register_composites() {
  if (g_composites) return 0;
  g_composites = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", kKey, __FILE__,
                                                  __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  int64_t n = 0;
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op || op->hasKernelForDispatchKey(kKey) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
      continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    g_composites->impl(op_name(name.name.c_str(), name.overload_name.c_str()).c_str(),
                       torch::CppFunction::makeFromBoxedFunction<&hand_back>());
    ++n;
  }
  return n;
}

void set_action(int64_t action, std::optional<at::Tensor> canned) {
  TORCH_CHECK(action >= 0 && action <= 3, "adaptive_eager hot key: action ", action,
              " is not one of 0 (hand back), 1 (canned), 2 (allocate), 3 (route)");
  g_action = static_cast<int>(action);
  g_canned = canned.has_value() ? *canned : at::Tensor();
}

void set_on(bool on) { c10::impl::tls_set_dispatch_key_included(kKey, on); }

// Engaged: the key on and the mode's keys excluded, in this thread (call from Python, outside
// any op: a change made inside one is undone when it returns). Returns the previous state.
bool set_engaged(bool on) {
  bool was = c10::impl::tls_is_dispatch_key_included(kKey) &&
             c10::impl::tls_is_dispatch_key_excluded(kPython);
  c10::impl::tls_set_dispatch_key_excluded(kPython, on);
  c10::impl::tls_set_dispatch_key_excluded(kSnapshot, on);
  c10::impl::tls_set_dispatch_key_included(kKey, on);
  return was;
}

bool is_on() { return c10::impl::tls_is_dispatch_key_included(kKey); }

std::vector<int64_t> counts() { return {g_kernel_calls.load(), g_handed_back.load()}; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_action", &set_action);
  m.def("set_on", &set_on);
  m.def("set_engaged", &set_engaged);
  m.def("register_composites", &register_composites);
  m.def("is_on", &is_on);
  m.def("counts", &counts);
}
