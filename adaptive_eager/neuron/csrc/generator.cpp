// ``torch.Generator("neuron")``: a device generator that draws what cpu's draws. It keeps a
// CPU generator and answers every seed and state call from it; the fallback hands that CPU
// generator to cpu's kernels (``cpu_generator``), so the same seed gives cpu's numbers. The
// device's default generator is cpu's own: ``torch.manual_seed`` seeds both alike.
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GeneratorImpl.h>

namespace neuron {
namespace {

struct Generator final : c10::GeneratorImpl {
  Generator()
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, 0),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu(at::detail::createCPUGenerator()) {}

  explicit Generator(at::Generator cpu)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, 0),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu(std::move(cpu)) {}

  void set_current_seed(uint64_t seed) override {
    cpu.set_current_seed(seed);
  }
  void set_offset(uint64_t offset) override {
    cpu.set_offset(offset);
  }
  uint64_t get_offset() const override {
    return cpu.get_offset();
  }
  uint64_t current_seed() const override {
    return cpu.current_seed();
  }
  uint64_t seed() override {
    return cpu.seed();
  }
  void set_state(const c10::TensorImpl& state) override {
    cpu.unsafeGetGeneratorImpl()->set_state(state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return cpu.unsafeGetGeneratorImpl()->get_state();
  }
  Generator* clone_impl() const override {
    return new Generator(cpu.clone());
  }

  at::Generator cpu;
};

}  // namespace

at::Generator new_generator() {
  return at::make_generator<Generator>();
}

at::Generator cpu_generator(const at::Generator& g) {
  auto* impl = dynamic_cast<Generator*>(g.unsafeGetGeneratorImpl());
  TORCH_CHECK(impl, "neuron: a generator of device ", g.device(), " is not the device's");
  return impl->cpu;
}

}  // namespace neuron
