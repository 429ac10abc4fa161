// The extension's Python entry points: the allocator's figures, and the host alias of a
// device tensor (rnn.py runs cpu's recurrent layers on them).
#include "neuron.h"

#include <torch/extension.h>

#include <map>
#include <string>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The emulated neuron device (C++ PrivateUse1 backend)";
  m.def("memory_allocated", &neuron::memory_allocated);
  m.def("max_memory_allocated", &neuron::max_memory_allocated);
  m.def("allocations", &neuron::allocations);
  m.def("reset_peak_memory_stats", &neuron::reset_peak_memory_stats);
  m.def("host_alias", &neuron::host_alias, "A CPU tensor over a neuron tensor's memory");
  m.def("to_device", &neuron::to_device, "A neuron tensor with a CPU tensor's values");
  m.def("register_cpu_kernels", &neuron::register_cpu_kernels);
  m.def("launched_us", [](double us) {
    neuron::launched(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double, std::micro>(us)),
                     "python");
  });
  m.def("synchronize", [] { neuron::wait("synchronize"); });
  m.def("set_latency_us", &neuron::set_latency_us);
  m.def("latency_us", &neuron::latency_us);
  m.def("reset_counters", &neuron::reset_counters);
  m.def("counters", [] {
    auto c = neuron::counters();
    return std::map<std::string, double>{
        {"launches", double(c.launches)}, {"bytes_to_device", double(c.bytes_to_device)},
        {"bytes_to_host", double(c.bytes_to_host)}, {"syncs", double(c.syncs)},
        {"busy_s", c.busy_s}, {"kernel_s", c.kernel_s}};
  });
}
