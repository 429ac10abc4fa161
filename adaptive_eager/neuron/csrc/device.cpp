// The device as PyTorch sees it: one device, index 0, a default stream, and hooks saying it
// is available. Without a guard, ``.to("neuron")`` fails and ``backward()`` aborts.
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <chrono>
#include <cstring>

namespace neuron {
namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
using Clock = std::chrono::steady_clock;

thread_local c10::StreamId current_stream = 0;
std::atomic<c10::StreamId> last_stream{0};

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kType;
  }
  c10::Device exchangeDevice(c10::Device) const override {
    return c10::Device(kType, 0);
  }
  c10::Device getDevice() const override {
    return c10::Device(kType, 0);
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() <= 0, "neuron: device index ", int(d.index()),
                " does not exist (the emulated device has one, index 0)");
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  // Streams are labels while kernels run synchronously: each new one gets an id, and each
  // thread has a current one (the default, id 0, until set).
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, 0), current_stream);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    c10::Stream previous = getStream(s.device());
    current_stream = s.id();
    return previous;
  }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, 0), ++last_stream);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    return getNewStream(d, 0);
  }
  // An event completes when it is recorded (the work before it has run); it keeps the time.
  void record(void** event, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    if (*event == nullptr) {
      *event = new Clock::time_point();
    }
    *static_cast<Clock::time_point*>(*event) = Clock::now();
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override {
    return true;
  }
  void synchronizeEvent(void*) const override {
    wait("event synchronize");
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<Clock::time_point*>(event);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start && end, "neuron: both events must be recorded before elapsed_time()");
    auto d = *static_cast<Clock::time_point*>(end) - *static_cast<Clock::time_point*>(start);
    return std::chrono::duration<double, std::milli>(d).count();
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return 1;
  }
  // Kernels run on the calling thread; the host waits for the device's clock (timeline.cpp).
  void synchronizeDevice(c10::DeviceIndex) const override {
    wait("synchronize");
  }
  bool queryStream(const c10::Stream&) const override {
    return true;
  }
  void synchronizeStream(const c10::Stream&) const override {
    wait("stream synchronize");
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  // The device draws from the CPU generator: same seed, same numbers as cpu.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    return new_generator();
  }
  at::Device getDeviceFromPtr(void*) const override {
    return c10::Device(kType, 0);
  }
  // resize_ of a neuron storage (ATen's generic resize asks the backend): a new block from
  // the device allocator, the old bytes copied.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    at::DataPtr fresh = allocator()->allocate(nbytes);
    size_t keep = std::min(nbytes, impl->nbytes());
    if (keep > 0) {
      std::memcpy(fresh.get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(nbytes);
  }
};

// registered once, when the extension loads
const bool registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

}  // namespace
}  // namespace neuron
