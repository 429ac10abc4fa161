// The kernels the device must own: factories allocate from its allocator, copies cross
// between host and device memory, and view ops make native views (a view is metadata over
// the same storage, whatever the device). Every other op goes through fallback.cpp.
#include "neuron.h"

#include <ATen/EmptyTensor.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/is_set_to_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

namespace neuron {
namespace {

const c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);

at::Tensor empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                 std::optional<at::Layout> layout, std::optional<at::Device> device,
                 std::optional<bool> pin_memory, std::optional<at::MemoryFormat> format) {
  TORCH_CHECK(!pin_memory.value_or(false), "neuron: pin_memory applies to host tensors");
  return at::detail::empty_generic(size, allocator(), kKeys,
                                   c10::dtype_or_default(dtype), format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                         std::optional<at::Device> device, std::optional<bool> pin_memory) {
  return at::detail::empty_strided_generic(size, stride, allocator(), kKeys,
                                           c10::dtype_or_default(dtype));
}

// ``copy_`` between devices lands here (ATen's copy_ calls it for a non-CPU side): both
// sides are host memory, so it is a CPU copy between aliases, one launch with its bytes
// counted. A copy to the host is a sync point (the host reads what the device wrote). A copy
// from the host reads the host tensor now, as eager does: at once when the queue is idle,
// else from a snapshot queued behind the launches before it; a copy within the device queues.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool to_host = !dst.is_privateuseone();
  const bool from_host = !self.is_privateuseone();
  if (dst.numel() == 0) {
    return dst;  // nothing moves: no launch (cpu's copy_ returns early too)
  }
  if (to_host) {
    wait("copy to host");
  }
  if (to_host || (from_host && idle())) {
    at::Tensor src = from_host ? self : host_alias(self);
    at::Tensor out = to_host ? dst : host_alias(dst);
    const auto start = Clock::now();
    out.copy_(src);
    launched(Clock::now() - start, to_host ? "copy to host" : "copy from host");
    if (to_host) {
      wait_until(device_free_at());  // the host reads it: the copy's launch has ended
    }
  } else {
    at::Tensor src = from_host ? self.clone() : host_alias(self);
    at::Tensor out = host_alias(dst);
    submit([src, out] { out.copy_(src); }, from_host ? "copy from host" : "copy");
  }
  if (to_host || from_host) {
    copied(static_cast<int64_t>(dst.nbytes()), to_host);
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes());
  return copy_from(self, dst, false);
}

// set_ and its forms point a tensor at a storage: metadata only, the same on every device
// (cpu's kernels would be handed host aliases and point those instead).
at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

at::Tensor& set_whole_storage(at::Tensor& self, c10::Storage source) {
  return at::native::set_(self, std::move(source));
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, allocator(), /*resizable=*/true);
  return set_storage(self, std::move(empty), 0, {0}, {});
}

// ``module.to("neuron")`` moves each parameter in place (``param.data = moved``, which keeps
// tied parameters one object) only when ATen calls the two tensors' types compatible for a
// shallow copy; its list of dense backends leaves PrivateUse1 out. Dense cpu and neuron
// tensors are compatible here, as cpu and cuda ones are.
bool compatible(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == at::kStrided && (t.is_cpu() || t.is_privateuseone());
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) ||
         (dense(self) && dense(from));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", compatible);
  m.impl("empty.memory_format", empty);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("resize_", at::native::resize_);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_whole_storage);
  m.impl("set_.source_Tensor", at::native::set_tensor_);
  m.impl("set_", set_empty);
  m.impl("is_set_to", at::native::is_set_to);
  m.impl("view", at::native::view);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
}

// A copy to or from a lazily conjugated or negated view: the bits travel with the host
// aliases and cpu's copy_ resolves them. Without this, the math-bit fallback would resolve
// them by a clone whose copy comes back here, forever.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

}  // namespace neuron
