// The memory of the hot path's fresh cpu outputs (Note [Output pool]).
//
// Note [Output pool]: a hot step allocates every fresh output when its op is served, and the
// program drops most of them before the launch writes the live ones: a 64-op chain of 256
// floats makes 64 blocks of 1 KiB a step, all alive together until the step ends, then all
// freed together. glibc serves that pattern slowly (aligned allocations skip its per-thread
// cache, and freeing a run of neighbours merges them and consolidates its bins: ~7 % of the
// hot step, measured with perf). The pool keeps the blocks the program let go, by size, and
// hands them out again. A block returns only when its storage is freed, that is when nothing
// can read or write it any more (the storage's deleter runs then), so reuse is as safe as
// the allocator's own. Blocks are aligned as the cpu allocator aligns (64 bytes); the pool
// keeps at most ``kMaxHeld`` bytes and frees the rest. Only the served outputs come from it:
// what the program allocates itself, and every op run below the key, uses PyTorch's
// allocator as in eager.
#include "hot_segment.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>

#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace ae_hot {
namespace {

constexpr size_t kAlign = 64;               // c10's cpu alignment
constexpr size_t kHeader = kAlign;          // a block's size, before its data
constexpr size_t kMaxHeld = size_t(64) << 20;

class Pool final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return c10::GetCPUAllocator()->allocate(0);
    void* base = take(n);
    if (base == nullptr) {
      if (posix_memalign(&base, kAlign, kHeader + n) != 0) throw std::bad_alloc();
      *static_cast<size_t*>(base) = n;
    }
    return {static_cast<char*>(base) + kHeader, base, &give_back, c10::Device(c10::kCPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }

  size_t held() {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }

 private:
  void* take(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = free_.find(n);
    if (found == free_.end() || found->second.empty()) return nullptr;
    void* base = found->second.back();
    found->second.pop_back();
    held_ -= n;
    return base;
  }

  static void give_back(void* base);

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // by size: blocks nobody uses
  size_t held_ = 0;
};

Pool* pool() {
  static Pool* the = new Pool();  // never destroyed: storages freed at exit still return
  return the;
}

void Pool::give_back(void* base) {
  size_t n = *static_cast<size_t*>(base);
  Pool* p = pool();
  {
    std::lock_guard<std::mutex> lock(p->mu_);
    if (p->held_ + n <= kMaxHeld) {
      p->free_[n].push_back(base);
      p->held_ += n;
      return;
    }
  }
  std::free(base);
}

}  // namespace

at::Tensor pooled_empty_strided(c10::IntArrayRef sizes, c10::IntArrayRef strides,
                                at::ScalarType dtype) {
  return at::detail::empty_strided_generic(sizes, strides, pool(),
                                           c10::DispatchKeySet(c10::DispatchKey::CPU), dtype);
}

int64_t pool_held_bytes() { return static_cast<int64_t>(pool()->held()); }

}  // namespace ae_hot
