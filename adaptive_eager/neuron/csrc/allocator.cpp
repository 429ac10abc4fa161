// The device allocator: host memory, counted. Every neuron tensor's storage comes from here
// (factories, resize_, the fallback's outputs), so its figures are the device's real ones:
// ``torch.accelerator.memory_allocated()`` and friends read them through the
// ``DeviceAllocator`` interface. Nothing is cached: a freed block goes back to the system at
// once, so reserved equals allocated and ``empty_cache()`` has nothing to release.
#include "neuron.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

namespace neuron {
namespace {

using c10::CachingDeviceAllocator::DeviceStats;

std::mutex lock;
DeviceStats stats;  // guarded by lock

// The aggregate entry of every stat this allocator keeps (the caller holds lock).
template <typename Fn>
void each_stat(Fn fn) {
  for (auto* array : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                      &stats.requested_bytes, &stats.allocation, &stats.segment,
                      &stats.active}) {
    fn((*array)[0]);  // StatType::AGGREGATE
  }
}

void count(size_t nbytes, bool allocated) {
  std::lock_guard<std::mutex> guard(lock);
  for (auto* array : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                      &stats.requested_bytes}) {
    auto& stat = (*array)[0];  // StatType::AGGREGATE
    allocated ? stat.increase(nbytes) : stat.decrease(nbytes);
  }
  for (auto* array : {&stats.allocation, &stats.segment, &stats.active}) {
    allocated ? (*array)[0].increase(1) : (*array)[0].decrease(1);
  }
  ++(allocated ? stats.num_device_alloc : stats.num_device_free);
}

// The deleter's context: the block and its size (the stats need the size at free time).
struct Block {
  void* ptr;
  size_t nbytes;
};

// Freeing waits for the launches queued before it (queue.cpp): they may still read or write
// the block, and nothing queued later can (the storage that held it is gone).
void release(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  after_queued([block] {
    c10::free_cpu(block->ptr);
    count(block->nbytes, false);
    delete block;
  });
}

// Blocks a CPU kernel allocated that became device memory (``adopt``): pointer -> size.
std::unordered_map<void*, size_t> adopted;  // guarded by lock

void release_adopted_now(void* ptr) {
  size_t nbytes = 0;
  {
    std::lock_guard<std::mutex> guard(lock);
    auto it = adopted.find(ptr);
    nbytes = it->second;
    adopted.erase(it);
  }
  count(nbytes, false);
  c10::free_cpu(ptr);
}

void release_adopted(void* ptr) {
  after_queued([ptr] { release_adopted_now(ptr); });
}

struct Allocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::Device device(c10::DeviceType::PrivateUse1, 0);
    if (nbytes == 0) {
      return {nullptr, nullptr, &c10::detail::deleteNothing, device};
    }
    void* ptr = c10::alloc_cpu(nbytes);
    count(nbytes, true);
    return {ptr, new Block{ptr, nbytes}, &release, device};
  }

  // No raw deleter: the context is not the pointer (it carries the size).
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t n) const override {
    std::memcpy(dest, src, n);
  }

  bool initialized() override {
    return true;
  }

  void emptyCache(c10::MempoolId_t) override {}

  // One queue runs every stream's launches in order, and a launch holds the storages it uses:
  // a freed block is free of every stream at once.
  void recordStream(const c10::DataPtr&, c10::Stream) override {}

  // Memory a queued launch holds is freed when it has run: the figures wait for the queue,
  // so that they say what a program that synchronized would see.
  DeviceStats getDeviceStats(c10::DeviceIndex) override {
    wait("memory stats");
    std::lock_guard<std::mutex> guard(lock);
    return stats;
  }

  void resetAccumulatedStats(c10::DeviceIndex) override {
    std::lock_guard<std::mutex> guard(lock);
    each_stat([](auto& stat) { stat.reset_accumulated(); });
    stats.num_device_alloc = stats.num_device_free = 0;
  }

  void resetPeakStats(c10::DeviceIndex) override {
    std::lock_guard<std::mutex> guard(lock);
    each_stat([](auto& stat) { stat.reset_peak(); });
  }
};

Allocator the_allocator;

}  // namespace

c10::Allocator* allocator() {
  return &the_allocator;
}

int64_t memory_allocated() {
  wait("memory stats");
  std::lock_guard<std::mutex> guard(lock);
  return stats.allocated_bytes[0].current;
}

int64_t max_memory_allocated() {
  wait("memory stats");
  std::lock_guard<std::mutex> guard(lock);
  return stats.allocated_bytes[0].peak;
}

int64_t allocations() {
  std::lock_guard<std::mutex> guard(lock);
  return stats.num_device_alloc;
}

void reset_peak_memory_stats() {
  the_allocator.resetPeakStats(0);
}

bool adopt(const c10::Storage& storage) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  at::DataPtr& data = impl->_mutable_data_ptr_no_checks();
  static const c10::DeleterFnPtr cpu_deleter = c10::GetCPUAllocator()->raw_deleter();
  // only a block of the CPU allocator's own, whose context is the block itself
  if (data.get() == nullptr || data.get_context() != data.get() || cpu_deleter == nullptr ||
      !data.compare_exchange_deleter(cpu_deleter, &release_adopted)) {
    return false;
  }
  {
    std::lock_guard<std::mutex> guard(lock);
    adopted[data.get()] = impl->nbytes();
  }
  count(impl->nbytes(), true);
  data.unsafe_set_device(c10::Device(c10::DeviceType::PrivateUse1, 0));
  impl->set_allocator(&the_allocator);
  return true;
}

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &the_allocator);

}  // namespace neuron
