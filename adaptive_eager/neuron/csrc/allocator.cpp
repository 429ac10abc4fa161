// The device allocator: host memory, counted, and cached the way a device's allocator caches.
// Every neuron tensor's storage comes from here (factories, resize_, the fallback's outputs),
// so its figures are the device's real ones: ``torch.accelerator.memory_allocated()`` and
// friends read them through the ``DeviceAllocator`` interface.
//
// Reuse: a freed block goes to a pool of its size class and the next allocation of that class
// takes it at once, without waiting for the queue. That is safe because the queue runs every
// launch in issue order (queue.cpp): the launches that may still touch the block were queued
// before the free, and any launch that writes its new tenant is queued after it. The host
// itself touches device memory only when the queue is idle or after waiting for it. A block
// leaves the pool for the system only once the launches queued before that have run
// (``empty_cache()``, or a pool over its bound).
#include "neuron.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace neuron {
namespace {

using c10::CachingDeviceAllocator::DeviceStats;

// Sizes are rounded up to a multiple of this: blocks of one class serve any request in it.
constexpr size_t kGranule = 512;
// The pool holds at most this many bytes; a block freed beyond it goes back to the system.
constexpr size_t kMaxCached = size_t(1) << 30;

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

// A block in use (``allocated``) or not; reserved blocks are those the system gave us.
// The caller holds lock.
void count_use(size_t nbytes, bool allocated) {
  for (auto* array : {&stats.allocated_bytes, &stats.active_bytes, &stats.requested_bytes}) {
    auto& stat = (*array)[0];  // StatType::AGGREGATE
    allocated ? stat.increase(nbytes) : stat.decrease(nbytes);
  }
  for (auto* array : {&stats.allocation, &stats.active}) {
    allocated ? (*array)[0].increase(1) : (*array)[0].decrease(1);
  }
  ++(allocated ? stats.num_device_alloc : stats.num_device_free);
}

void count_reserved(size_t nbytes, bool reserved) {
  reserved ? stats.reserved_bytes[0].increase(nbytes) : stats.reserved_bytes[0].decrease(nbytes);
  reserved ? stats.segment[0].increase(1) : stats.segment[0].decrease(1);
}

// The deleter's context: the block and its size class (kept with the block in the pool).
struct Block {
  void* ptr;
  size_t nbytes;
};

std::unordered_map<size_t, std::vector<Block*>> pool;  // size class -> free blocks (lock)
size_t cached = 0;                                     // bytes in the pool (lock)

// Back to the system once the launches queued before now have run (they may still touch it).
void give_back_later(Block* block) {
  after_queued([block] {
    c10::free_cpu(block->ptr);
    {
      std::lock_guard<std::mutex> guard(lock);
      count_reserved(block->nbytes, false);
    }
    delete block;
  });
}

void release(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  {
    std::lock_guard<std::mutex> guard(lock);
    count_use(block->nbytes, false);
    if (cached + block->nbytes <= kMaxCached) {
      pool[block->nbytes].push_back(block);
      cached += block->nbytes;
      return;
    }
  }
  give_back_later(block);
}

// Every pooled block back to the system, after the queue has run what may touch them.
void empty_pool() {
  wait("empty_cache");
  std::vector<Block*> blocks;
  {
    std::lock_guard<std::mutex> guard(lock);
    for (auto& [size, list] : pool) {
      blocks.insert(blocks.end(), list.begin(), list.end());
      for (Block* b : list) {
        count_reserved(b->nbytes, false);
      }
    }
    pool.clear();
    cached = 0;
  }
  for (Block* b : blocks) {
    c10::free_cpu(b->ptr);
    delete b;
  }
}

// Blocks a CPU kernel allocated that became device memory (``adopt``): pointer -> size.
std::unordered_map<void*, size_t> adopted;  // guarded by lock

// Counted free at once; the memory goes back to the system once the queue has run past it.
void release_adopted(void* ptr) {
  size_t nbytes = 0;
  {
    std::lock_guard<std::mutex> guard(lock);
    auto it = adopted.find(ptr);
    nbytes = it->second;
    adopted.erase(it);
    count_use(nbytes, false);
  }
  after_queued([ptr, nbytes] {
    c10::free_cpu(ptr);
    std::lock_guard<std::mutex> guard(lock);
    count_reserved(nbytes, false);
  });
}

struct Allocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::Device device(c10::DeviceType::PrivateUse1, 0);
    if (nbytes == 0) {
      return {nullptr, nullptr, &c10::detail::deleteNothing, device};
    }
    const size_t size = (nbytes + kGranule - 1) / kGranule * kGranule;
    Block* block = nullptr;
    {
      std::lock_guard<std::mutex> guard(lock);
      auto it = pool.find(size);
      if (it != pool.end() && !it->second.empty()) {
        block = it->second.back();
        it->second.pop_back();
        cached -= size;
      }
      count_use(size, true);
    }
    if (block == nullptr) {
      block = new Block{c10::alloc_cpu(size), size};
      std::lock_guard<std::mutex> guard(lock);
      count_reserved(size, true);
    }
    return {block->ptr, block, &release, device};
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

  void emptyCache(c10::MempoolId_t) override {
    empty_pool();
  }

  // One queue runs every stream's launches in order, and a launch holds the storages it uses:
  // a freed block is free of every stream at once.
  void recordStream(const c10::DataPtr&, c10::Stream) override {}

  // Allocated figures change when the host allocates and frees, as on a device with a
  // caching allocator; reserved ones drop when a block goes back to the system.
  DeviceStats getDeviceStats(c10::DeviceIndex) override {
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
  std::lock_guard<std::mutex> guard(lock);
  return stats.allocated_bytes[0].current;
}

int64_t max_memory_allocated() {
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
    count_use(impl->nbytes(), true);
    count_reserved(impl->nbytes(), true);
  }
  data.unsafe_set_device(c10::Device(c10::DeviceType::PrivateUse1, 0));
  impl->set_allocator(&the_allocator);
  return true;
}

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &the_allocator);

}  // namespace neuron
