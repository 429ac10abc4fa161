// A hot segment served below the floor (Note [Below the floor]): hot_segment.cpp, called by
// the hot path's dispatch key (hot_key.cpp).
#pragma once
// Only what this header names: torch/extension.h (the whole C++ frontend) cost each file that
// included it ~20 s more to compile, paid on every fresh checkout (a CI run).
#include <torch/csrc/python_headers.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <pybind11/pybind11.h>

namespace ae_hot {

// A fresh cpu tensor on memory from the output pool (output_pool.cpp), and the bytes the
// pool holds for reuse.
at::Tensor pooled_empty_strided(c10::IntArrayRef sizes, c10::IntArrayRef strides,
                                at::ScalarType dtype);
int64_t pool_held_bytes();

// The hot path's dispatch key (``Fake``: Note [Below the floor]).
constexpr auto kKey = c10::DispatchKey::Fake;

// The keys above Python, excluded while the engine handles an op as the Python key's fallback
// would (autograd and the rest already done above).
constexpr c10::DispatchKeySet kAbovePython =
    (c10::DispatchKeySet(c10::DispatchKeySet::FULL) ^
     (c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Python) |
      c10::DispatchKeySet(c10::DispatchKey::Python)))
        .remove(c10::DispatchKey::ZeroTensor)
        .remove(c10::DispatchKey::Conjugate)
        .remove(c10::DispatchKey::Negative);

// An op run below the key, and every op it calls, with the key off in the thread.
struct KeyOff {
  bool was = c10::impl::tls_is_dispatch_key_included(kKey);
  KeyOff() { c10::impl::tls_set_dispatch_key_included(kKey, false); }
  ~KeyOff() { c10::impl::tls_set_dispatch_key_included(kKey, was); }
};

// Note [Borrowed arguments]: a tensor the program holds only from Python has one reference,
// its Python object's; a second one (a boxed stack's copy) makes PyTorch take the
// interpreter lock to keep that object alive, and dropping it takes the lock again: two
// lock round trips per tensor argument, ~15 % of a hot step of tiny ops (perf). Our unboxed
// kernels push their tensor arguments *borrowed* instead (the caller holds them for the
// call) and ``serve`` never lets a borrowed entry go through anything that would drop it:
// it gives them up uncounted (``unborrow``) or makes them owning first (``own``).
inline c10::IValue borrowed(const at::Tensor& t) {
  if (!t.defined()) return c10::IValue(t);
  return c10::IValue(at::Tensor(
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(
          t.unsafeGetTensorImpl())));
}

// The last ``n`` entries of ``stack``, borrowed ones, made owning.
inline void own(torch::jit::Stack& stack, size_t n) {
  for (size_t i = stack.size() - n; i < stack.size(); i++) {
    c10::IValue& v = stack[i];
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    at::Tensor owned = v.toTensor();
    std::move(v).toTensor().unsafeReleaseTensorImpl();
    v = std::move(owned);
  }
}

// The last ``n`` entries of ``stack``, borrowed ones, dropped without a count.
inline void unborrow(torch::jit::Stack& stack, size_t n) {
  for (size_t i = stack.size() - n; i < stack.size(); i++) {
    c10::IValue& v = stack[i];
    if (v.isTensor() && v.toTensor().defined()) std::move(v).toTensor().unsafeReleaseTensorImpl();
  }
  torch::jit::drop(stack, n);
}

// Served with its arguments borrowed, a result that is one of them (an in-place op's) is
// borrowed too.
// Serve ``op`` (its arguments on ``stack``) as the next op of this thread's plan, without
// Python: true when it did (results on the stack), false when the op is not the plan's next
// (nothing changed).
// ``ks`` is the key set the op reached the key with (a view op runs below it). With
// ``borrowed`` true the arguments' tensors are borrowed (Note [Borrowed arguments]); ``serve``
// sets it false where it made them owning.
bool serve(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack,
           bool* borrowed = nullptr);

// Hand what the plan of ``mode``'s segment served to the tracer's Python segment and drop
// the plan (no-op without one); ``hand_back_top``: of the mode on top of this thread's stack.
// Takes the interpreter lock when there is something to hand back.
void hand_back(PyObject* mode);
void hand_back_top();

// Note [Launched below the floor]: ``op`` is a host read (``item()``, ``bool()``) of a value of
// a segment the plan served whole from the trie's root to the end of a path whose fused graph
// the segment's last Python launch ran (its ``fast_end``): launch that graph here, if the
// segment's variant is the same (the same fresh outputs alive, the same specialized floats, no
// written input aliased), then run the read, without handing the segment to Python. True when
// it did (the read's result on ``stack``); false, with nothing changed, when anything differs.
bool launch_at_read(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                    torch::jit::Stack* stack);

// The same launch at any other boundary the engine's Python meets outside an op
// (``ae.synchronize()``, say): ``launch_served(mode, reason)`` in tracer/hot_key.py's module,
// after which the caller drops the plan (``hand_back``).

// Hand back and drop what is kept for ``mode`` (it is disengaged).
void forget(PyObject* mode);

// After the engine's mode handled an op (the interpreter lock held): take its segment over if
// the mode offers a plan for what follows (``planner`` is its ``key_plan``).
void take_over(PyObject* planner, PyObject* mode);

void bind(pybind11::module_& m);

}  // namespace ae_hot
