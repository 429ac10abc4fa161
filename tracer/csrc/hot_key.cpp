// Stage 2 of the compiled hot path, its mechanism (Note [Below the floor]): a dispatch key
// below autograd and above every backend, included in the thread's dispatch key set, so that
// each op reaches a C++ kernel of ours instead of the Python dispatch mode.
//
// The key is ``Fake``: the one functionality key between BackendSelect and Python (reserved
// for a C++ fake-tensor mode that nothing registers in this PyTorch; loading fails loudly if
// something already did). Being above BackendSelect, it sees factory functions before they
// pick a backend; being a functionality key and no backend, it sees every op as called: no
// composite kernel decomposes it first, whatever the tensors' layout. Autograd records its
// node above it as usual.
//
// Kernels: unboxed ones for a few ops, generated from ATen's operator structs
// (at::_ops::<op>::schema is the signature, one template instantiation per op), and a boxed
// fallback for every other op. What they do is chosen per process (set_action):
//   0 HANDBACK  run the op below our key (what every op did without it)
//   1 CANNED    return a preallocated tensor (the cost of reaching the kernel)
//   2 ALLOCATE  return a fresh tensor shaped like the first tensor argument (the cost of
//               reaching the kernel and allocating its output with CPU's own allocator)
//   3 ROUTE     send the op to the dispatch mode on top of the stack, or run it below when no
//               mode is on the stack (inside the mode's own handling, which pops it)
// Engaged (set_engaged, from Python outside any op), the mode's keys are also excluded, so
// that every op reaches our kernels first, and ROUTE sends it on to the mode.
#include <ATen/core/Tensor.h>
#include <ATen/Operators.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/csrc/utils/torch_dispatch_mode.h>

#include "hot_segment.h"

#include <atomic>
#include <exception>
#include <mutex>
#include <type_traits>
#include <unordered_map>

namespace {

using ae_hot::KeyOff;
using ae_hot::kKey;
constexpr auto kPython = c10::DispatchKey::Python;
constexpr auto kSnapshot = c10::DispatchKey::PythonTLSSnapshot;

int g_action = 0;
at::Tensor g_canned;
std::atomic<int64_t> g_kernel_calls{0}, g_handed_back{0};

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

bool has_python_tensor(const torch::jit::Stack& stack, size_t n) {
  for (const auto& v : torch::jit::last(stack, n)) {
    if (v.isTensor() && v.toTensor().key_set().has(kPython)) return true;
    if (v.isTensorList()) {
      for (const auto& t : v.toTensorList()) {
        if (static_cast<at::Tensor>(t).key_set().has(kPython)) return true;
      }
    }
  }
  return false;
}

// The engaged engines' modes and their __torch_dispatch__ (held here while engaged): an op
// routed to an engine's mode, when it is on top of the stack, calls its handler directly,
// doing what the Python key's fallback would (the mode off the stack and the keys above Python
// excluded while it handles the op) without the trip through PythonTLSSnapshot, the Python
// key and PyTorch's generic __torch_dispatch__ protocol. Kept per mode, not per thread: on an
// accelerator autograd runs the backward on a thread of its own, which inherits the key sets
// and the mode stack of the thread that called ``backward()`` and must reach the same handler
// (and the same plans) as that thread.
struct Engaged {
  PyObject* handler = nullptr;
  PyObject* planner = nullptr;  // the mode's ``key_plan``, if it has one
  int threads = 0;              // threads engaged with this mode
};
std::mutex g_engaged_mu;
std::unordered_map<PyObject*, Engaged> g_engaged;
thread_local PyObject* t_mode = nullptr;  // the mode this thread engaged with
PyObject* g_no_types = nullptr;

using ae_hot::kAbovePython;

// An argument as the mode receives it from the Python key: dtypes, layouts and memory
// formats (integers in an IValue) as their Python objects.
pybind11::object to_python(const c10::Argument& arg, c10::IValue v) {
  if (v.isInt()) {
    c10::TypePtr t = arg.real_type();
    if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
    switch (t->kind()) {
      case c10::TypeKind::ScalarTypeType:
        return pybind11::reinterpret_borrow<pybind11::object>(
            (PyObject*)torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt())));
      case c10::TypeKind::LayoutType:
        return pybind11::reinterpret_borrow<pybind11::object>(
            (PyObject*)torch::getTHPLayout(static_cast<at::Layout>(v.toInt())));
      case c10::TypeKind::MemoryFormatType:
        return pybind11::reinterpret_borrow<pybind11::object>(
            torch::utils::getTHPMemoryFormat(static_cast<at::MemoryFormat>(v.toInt())));
      default:
        break;
    }
  }
  return torch::jit::toPyObject(std::move(v));
}

// (args, kwargs) as the Python key's fallback builds them: positional arguments up to the
// keyword-only ones, trailing defaults left out; keyword-only ones that differ from their
// defaults as keywords.
std::pair<pybind11::tuple, pybind11::dict> python_call(const c10::FunctionSchema& schema,
                                                       std::vector<c10::IValue>& values) {
  const auto& params = schema.arguments();
  size_t kw_start = values.size();
  while (kw_start > 0 && params[kw_start - 1].kwarg_only()) kw_start--;
  auto is_default = [&](size_t i) {
    const auto& d = params[i].default_value();
    return d.has_value() && *d == values[i];
  };
  size_t n_pos = kw_start;
  while (n_pos > 0 && is_default(n_pos - 1)) n_pos--;
  pybind11::tuple args(n_pos);
  for (size_t i = 0; i < n_pos; i++) args[i] = to_python(params[i], std::move(values[i]));
  pybind11::dict kwargs;
  for (size_t i = kw_start; i < values.size(); i++) {
    if (!is_default(i)) kwargs[params[i].name().c_str()] = to_python(params[i], std::move(values[i]));
  }
  return {std::move(args), std::move(kwargs)};
}

// The mode's result onto the stack, as the op's returns.
void push_result(const c10::FunctionSchema& schema, torch::jit::Stack* stack,
                 pybind11::handle out) {
  const auto& returns = schema.returns();
  if (returns.empty()) return;
  if (returns.size() == 1) {
    stack->push_back(torch::jit::toIValue(out, returns[0].real_type()));
    return;
  }
  pybind11::tuple items = pybind11::reinterpret_borrow<pybind11::tuple>(out);
  TORCH_CHECK(items.size() == returns.size(), "adaptive_eager hot key: ", schema.name(),
              " returned ", items.size(), " values, its schema ", returns.size());
  for (size_t i = 0; i < returns.size(); i++)
    stack->push_back(torch::jit::toIValue(items[i], returns[i].real_type()));
}

bool to_engine(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto n = c10::impl::TorchDispatchModeTLS::stack_len();
  if (n == 0) return false;
  PyObject* mode = c10::impl::TorchDispatchModeTLS::get_stack_at(n - 1)->ptr(getPyInterpreter());
  PyObject *handler = nullptr, *planner = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_engaged_mu);
    auto found = g_engaged.find(mode);
    if (found == g_engaged.end()) return false;
    handler = found->second.handler;
    planner = found->second.planner;
  }
  torch::torch_dispatch_mode::StashTorchDispatchModeGuard stash;
  c10::impl::ExcludeDispatchKeyGuard above(kAbovePython);
  pybind11::gil_scoped_acquire gil;
  pybind11::object hold_handler = pybind11::reinterpret_borrow<pybind11::object>(handler);
  pybind11::object hold_planner = pybind11::reinterpret_borrow<pybind11::object>(
      planner != nullptr ? planner : Py_None);
  const auto& schema = op.schema();
  auto values = torch::jit::pop(*stack, schema.arguments().size());
  auto [args, kwargs] = python_call(schema, values);
  pybind11::handle func = torch::detail::getTorchApiFunction(op);
  PyObject* argv[4] = {func.ptr(), g_no_types, args.ptr(), kwargs.ptr()};
  PyObject* out = PyObject_Vectorcall(handler, argv, 4, nullptr);
  if (out == nullptr) throw python_error();
  auto result = pybind11::reinterpret_steal<pybind11::object>(out);
  push_result(schema, stack, result);
  if (planner != nullptr) ae_hot::take_over(planner, mode);  // what follows, below the floor
  return true;
}

// ``route`` after the plan did not serve ``op``.
void route_unserved(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                    torch::jit::Stack* stack) {
  ae_hot::hand_back_top();
  if (to_engine(op, stack)) return;
  auto below = ks.remove(kKey);
  if (c10::impl::TorchDispatchModeTLS::stack_len() == 0) {
    // inside the mode's handling: run below, a tensor subclass's own dispatch included
    if (has_python_tensor(*stack, op.schema().arguments().size())) {
      ModeKeysOn on;
      KeyOff off;
      op.redispatchBoxed(below.add(kPython).add(kSnapshot), stack);
      return;
    }
    KeyOff off;
    op.redispatchBoxed(below, stack);
    return;
  }
  ModeKeysOn on;
  op.redispatchBoxed(below.add(kPython).add(kSnapshot), stack);
}

// After a launch below the floor (Note [Launched below the floor]): the plan for what follows.
void replan() {
  auto n = c10::impl::TorchDispatchModeTLS::stack_len();
  if (n == 0) return;
  PyObject* mode = c10::impl::TorchDispatchModeTLS::get_stack_at(n - 1)->ptr(getPyInterpreter());
  PyObject* planner = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_engaged_mu);
    auto found = g_engaged.find(mode);
    if (found == g_engaged.end()) return;
    planner = found->second.planner;
  }
  if (planner == nullptr) return;
  torch::torch_dispatch_mode::StashTorchDispatchModeGuard stash;
  c10::impl::ExcludeDispatchKeyGuard above(kAbovePython);
  pybind11::gil_scoped_acquire gil;
  pybind11::object hold = pybind11::reinterpret_borrow<pybind11::object>(planner);
  ae_hot::take_over(planner, mode);
}

void route(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (ae_hot::serve(op, ks, stack)) return;
  if (ae_hot::launch_at_read(op, ks, stack)) {
    replan();
    return;
  }
  route_unserved(op, ks, stack);
}

template <class T>
bool same_tensor(const T& x, const c10::IValue& v) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return x.defined() && v.isTensor() && v.toTensor().unsafeGetTensorImpl() == x.unsafeGetTensorImpl();
  } else {
    return false;
  }
}

template <class T>
void push_borrowed(torch::jit::Stack& stack, const T& x) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    stack.push_back(ae_hot::borrowed(x));
  } else {
    torch::jit::push(stack, x);
  }
}

// ``Op`` routed with its tensor arguments borrowed (Note [Borrowed arguments]): its results on
// ``stack``. True when the result may be a borrowed argument (served with them still lent).
template <class Op, class... A>
bool route_borrowed(c10::DispatchKeySet ks, torch::jit::Stack& stack, const A&... a) {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
  stack.reserve(sizeof...(A));
  (push_borrowed(stack, a), ...);
  bool borrowed = true;
  struct Unwinding {  // an error while they are lent: give them up uncounted, never drop them
    torch::jit::Stack& stack;
    const bool& borrowed;
    int errors = std::uncaught_exceptions();
    ~Unwinding() {
      if (std::uncaught_exceptions() > errors && borrowed && stack.size() >= sizeof...(A))
        ae_hot::unborrow(stack, sizeof...(A));
    }
  } unwinding{stack, borrowed};
  if (ae_hot::serve(handle, ks, &stack, &borrowed)) {
    if (!borrowed) return false;
    const c10::IValue& out = stack.back();  // a fresh result is no argument
    bool is_arg = false;
    ((is_arg = is_arg || same_tensor(a, out)), ...);
    return is_arg;
  }
  if (borrowed) ae_hot::own(stack, sizeof...(A));
  route_unserved(handle, ks, &stack);
  return false;
}

template <class T>
at::Tensor* written(T& x) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return &x;
  } else {
    return nullptr;
  }
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

void boxed(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

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
      torch::jit::Stack stack;
      if (!route_borrowed<Op>(ks, stack, a...)) return std::move(stack.back()).toTensor();
      at::Tensor out = stack.back().toTensor();  // one of the arguments: a reference of its own
      ae_hot::unborrow(stack, 1);
      return out;
    }
    KeyOff off;
    return Op::redispatch(ks.remove(kKey), a...);
  }
};

// An in-place op (its result is its first argument that is not const): routed borrowed.
template <class Op, class... A>
struct Hot<Op, at::Tensor&(A...)> {
  static at::Tensor& call(c10::DispatchKeySet ks, A... a) {
    g_kernel_calls.fetch_add(1, std::memory_order_relaxed);
    if (g_action != 3) {
      KeyOff off;
      return Op::redispatch(ks.remove(kKey), a...);
    }
    torch::jit::Stack stack;
    bool lent = route_borrowed<Op>(ks, stack, a...);
    at::Tensor* self = nullptr;
    ((self = self ? self : written(a)), ...);
    TORCH_CHECK(self != nullptr && stack.back().isTensor() &&
                    stack.back().toTensor().unsafeGetTensorImpl() == self->unsafeGetTensorImpl(),
                "adaptive_eager hot key: ", Op::name, " did not return its argument");
    if (lent) ae_hot::unborrow(stack, 1);
    return *self;
  }
};

void boxed(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
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
  op.redispatchBoxed(ks.remove(kKey), stack);
}

// The ops with an unboxed kernel of ours: their tensor arguments reach the plan borrowed (Note
// [Borrowed arguments]); the workloads' elementwise, matmul, reduction and optimizer ops
#define AE_HOT_OPS(X) X(add_Tensor) X(mul_Tensor) X(sub_Tensor) X(div_Tensor) \
  X(add__Tensor) X(mul__Tensor) X(sub__Tensor) X(div__Tensor) X(lerp__Scalar) X(addcmul_) \
  X(addcdiv_) X(sqrt) X(rsqrt) X(neg) X(exp) X(tanh) X(silu) X(mm) X(addmm) X(bmm) \
  X(pow_Tensor_Scalar) X(mean_dim) X(sum_dim_IntList) X(_softmax)

std::string op_name(const char* qualified, const char* overload) {
  std::string out(qualified + 6);  // past "aten::"
  if (*overload) out = out + "." + overload;
  return out;
}

#define AE_IMPL(OP) \
  m.impl(op_name(at::_ops::OP::name, at::_ops::OP::overload_name).c_str(), \
         TORCH_FN(Hot<at::_ops::OP>::call));

TORCH_LIBRARY_IMPL(aten, Fake, m) {
  AE_HOT_OPS(AE_IMPL)
}

TORCH_LIBRARY_IMPL(_, Fake, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&boxed>());
}

void set_action(int64_t action, std::optional<at::Tensor> canned) {
  TORCH_CHECK(action >= 0 && action <= 3, "adaptive_eager hot key: action ", action,
              " is not one of 0 (hand back), 1 (canned), 2 (allocate), 3 (route)");
  g_action = static_cast<int>(action);
  g_canned = canned.has_value() ? *canned : at::Tensor();
}

void set_on(bool on) { c10::impl::tls_set_dispatch_key_included(kKey, on); }

bool is_on() { return c10::impl::tls_is_dispatch_key_included(kKey); }

// Engaged: the key on and the mode's keys excluded, in this thread (call from Python, outside
// any op: a change made inside one is undone when it returns). Returns the previous state.
bool set_engaged(bool on, pybind11::object mode) {
  bool was = is_on() && c10::impl::tls_is_dispatch_key_excluded(kPython);
  if (g_no_types == nullptr) g_no_types = PyTuple_New(0);
  if (t_mode != nullptr) {
    ae_hot::forget(t_mode);
    std::lock_guard<std::mutex> lock(g_engaged_mu);
    auto found = g_engaged.find(t_mode);
    if (found != g_engaged.end() && --found->second.threads == 0) {
      Py_XDECREF(found->second.handler);
      Py_XDECREF(found->second.planner);
      g_engaged.erase(found);
    }
    t_mode = nullptr;
  }
  if (on && !mode.is_none()) {
    PyObject* handler = PyObject_GetAttrString(mode.ptr(), "__torch_dispatch__");
    if (handler == nullptr) throw python_error();
    PyObject* planner = PyObject_HasAttrString(mode.ptr(), "key_plan")
                            ? PyObject_GetAttrString(mode.ptr(), "key_plan")
                            : nullptr;
    std::lock_guard<std::mutex> lock(g_engaged_mu);
    Engaged& e = g_engaged[mode.ptr()];
    if (e.threads++ == 0) {
      e.handler = handler;
      e.planner = planner;
    } else {
      Py_DECREF(handler);
      Py_XDECREF(planner);
    }
    t_mode = mode.ptr();
  }
  c10::impl::tls_set_dispatch_key_excluded(kPython, on);
  c10::impl::tls_set_dispatch_key_excluded(kSnapshot, on);
  set_on(on);
  return was;
}

std::vector<int64_t> counts() { return {g_kernel_calls.load(), g_handed_back.load()}; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_action", &set_action);
  m.def("set_on", &set_on);
  m.def("is_on", &is_on);
  m.def("set_engaged", &set_engaged, pybind11::arg("on"), pybind11::arg("mode") = pybind11::none());
  m.def("counts", &counts);
  ae_hot::bind(m);
}
