// The device allocator: host memory, counted. Every neuron tensor's storage comes from here
// (factories, resize_, the fallback's outputs), so its figures are the device's real ones.
#include "neuron.h"

#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace neuron {
namespace {

std::atomic<int64_t> allocated{0};
std::atomic<int64_t> peak{0};
std::atomic<int64_t> count{0};

// The deleter's context: the block and its size (the stats need the size at free time).
struct Block {
  void* ptr;
  size_t nbytes;
};

void release(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  c10::free_cpu(block->ptr);
  allocated -= static_cast<int64_t>(block->nbytes);
  delete block;
}

struct Allocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::Device device(c10::DeviceType::PrivateUse1, 0);
    if (nbytes == 0) {
      return {nullptr, nullptr, &c10::detail::deleteNothing, device};
    }
    void* ptr = c10::alloc_cpu(nbytes);
    int64_t now = allocated += static_cast<int64_t>(nbytes);
    int64_t before = peak.load();
    while (now > before && !peak.compare_exchange_weak(before, now)) {
    }
    ++count;
    return {ptr, new Block{ptr, nbytes}, &release, device};
  }

  // No raw deleter: the context is not the pointer (it carries the size).
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

Allocator the_allocator;

}  // namespace

c10::Allocator* allocator() {
  return &the_allocator;
}

int64_t memory_allocated() {
  return allocated.load();
}

int64_t max_memory_allocated() {
  return peak.load();
}

int64_t allocations() {
  return count.load();
}

void reset_peak_memory_stats() {
  peak = allocated.load();
}

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &the_allocator);

}  // namespace neuron
