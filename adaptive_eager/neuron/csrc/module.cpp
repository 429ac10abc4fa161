// The extension's Python entry points: the allocator's figures, and the host alias of a
// device tensor (rnn.py runs cpu's recurrent layers on them).
#include "neuron.h"

#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The emulated neuron device (C++ PrivateUse1 backend)";
  m.def("memory_allocated", &neuron::memory_allocated);
  m.def("max_memory_allocated", &neuron::max_memory_allocated);
  m.def("allocations", &neuron::allocations);
  m.def("reset_peak_memory_stats", &neuron::reset_peak_memory_stats);
  m.def("host_alias", &neuron::host_alias, "A CPU tensor over a neuron tensor's memory");
  m.def("to_device", &neuron::to_device, "A neuron tensor with a CPU tensor's values");
  m.def("register_cpu_kernels", &neuron::register_cpu_kernels);
}
