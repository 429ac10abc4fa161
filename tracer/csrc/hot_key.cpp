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
// What a kernel does is chosen per process (set_action), for measuring the mechanism itself:
//   0 HANDBACK  run the op below our key (what every op did without it)
//   1 CANNED    return a preallocated tensor (the cost of reaching the kernel; in the boxed
//               fallback, the cost of reaching a boxed kernel)
//   2 ALLOCATE  return a fresh tensor shaped like the first tensor argument (the cost of
//               reaching the kernel and allocating its output with CPU's own allocator)
#include <torch/extension.h>
#include <ATen/Operators.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

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
    KeyOff off;
    return Op::redispatch(below(ks), a...);
  }
};

void hand_back(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
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

void set_action(int64_t action, const at::Tensor& canned) {
  TORCH_CHECK(action >= 0 && action <= 2, "adaptive_eager hot key: action ", action,
              " is not one of 0 (hand back), 1 (canned), 2 (allocate)");
  g_action = static_cast<int>(action);
  g_canned = canned;
}

void set_on(bool on) { c10::impl::tls_set_dispatch_key_included(kKey, on); }

bool is_on() { return c10::impl::tls_is_dispatch_key_included(kKey); }

std::vector<int64_t> counts() { return {g_kernel_calls.load(), g_handed_back.load()}; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_action", &set_action);
  m.def("set_on", &set_on);
  m.def("is_on", &is_on);
  m.def("counts", &counts);
}
