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
  // Streams share the device's one queue (queue.cpp): each new one gets an id, and each
  // thread has a current one (the default, id 0, until set); launches count per stream.
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
  // An event is a marker in the queue: reached when the launches before it have run and the
  // device clock has passed them.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    flush("Event.record");
    auto marker = record_marker(stream.id());
    if (*event == nullptr) {
      *event = new std::shared_ptr<Marker>(std::move(marker));
    } else {
      *static_cast<std::shared_ptr<Marker>*>(*event) = std::move(marker);
    }
  }
  // One queue runs launches in issue order, so a stream waiting on an event already does;
  // on the device clock, the stream's later launches start after the event.
  void block(void* event, const c10::Stream& stream) const override {
    flush("Event.wait");
    if (event != nullptr) {
      stream_wait_marker(stream.id(), *static_cast<std::shared_ptr<Marker>*>(event));
    }
  }
  bool queryEvent(void* event) const override {
    flush("Event.query");
    return event == nullptr || marker_reached(**static_cast<std::shared_ptr<Marker>*>(event));
  }
  void synchronizeEvent(void* event) const override {
    flush("Event.synchronize");
    if (event != nullptr) {
      wait_marker(**static_cast<std::shared_ptr<Marker>*>(event));
    }
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<std::shared_ptr<Marker>*>(event);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start && end, "neuron: both events must be recorded before elapsed_time()");
    return marker_ms_between(**static_cast<std::shared_ptr<Marker>*>(start),
                             **static_cast<std::shared_ptr<Marker>*>(end));
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return 1;
  }
  void synchronizeDevice(c10::DeviceIndex) const override {
    flush("synchronize");
    wait("synchronize");
  }
  bool queryStream(const c10::Stream&) const override {
    flush("Stream.query");
    return device_query();
  }
  void synchronizeStream(const c10::Stream&) const override {
    flush("Stream.synchronize");
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
    wait("storage resize");  // queued launches may still read or write the old block
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

int64_t current_stream_id() {
  return current_stream;
}

}  // namespace neuron
