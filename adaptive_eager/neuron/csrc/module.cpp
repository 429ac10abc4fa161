// The extension's Python entry points: the allocator's figures, and the host alias of a
// device tensor (rnn.py runs cpu's recurrent layers on them).
#include "neuron.h"

#include <torch/csrc/utils/pybind.h>

#include <map>
#include <unordered_map>
#include <string>

namespace neuron {
namespace {
py::object* flush_hook = nullptr;  // never freed: it may be called until exit
}  // namespace

void flush(const char* reason) {
  if (flush_hook == nullptr || !Py_IsInitialized()) {
    return;
  }
  py::gil_scoped_acquire gil;
  (*flush_hook)(reason);
}
}  // namespace neuron

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
  m.def("wait", [](const std::string& reason) { neuron::wait(reason); },
        "A sync point: the host waits for the device (the reason is counted)");
  m.def("wait_below", &neuron::wait_below);
  m.def("idle", &neuron::idle);
  // One launch of Python code (the engine's replays) on the device's queue; it takes the
  // interpreter lock on the worker, and lets go of the callable there too.
  m.def("launch", [](py::function fn, const char* name) {
    std::shared_ptr<py::function> held(new py::function(std::move(fn)), [](py::function* f) {
      if (Py_IsInitialized()) {
        py::gil_scoped_acquire gil;
        delete f;
      }
    });
    static std::unordered_map<std::string, std::string> names;  // static storage for names
    const char* static_name = names.emplace(name, name).first->second.c_str();
    neuron::submit([held] {
      py::gil_scoped_acquire gil;
      (*held)();
    }, static_name, /*cpu_time=*/true);
  });
  m.def("set_latency_us", &neuron::set_latency_us);
  m.def("latency_us", &neuron::latency_us);
  m.def("reset_counters", &neuron::reset_counters);
  m.def("counters", [] {
    auto c = neuron::counters();
    return std::map<std::string, double>{
        {"launches", double(c.launches)}, {"bytes_to_device", double(c.bytes_to_device)},
        {"bytes_to_host", double(c.bytes_to_host)}, {"syncs", double(c.syncs)},
        {"busy_s", c.busy_s}, {"kernel_s", c.kernel_s},
        {"skipped_after_error", double(c.skipped_after_error)}};
  });
  m.def("set_flush_hook", [](py::function fn) {
    neuron::flush_hook = new py::object(std::move(fn));
  }, "fn(reason): called before an event or stream orders or waits on the queue");
  m.def("launches_by_stream", [] { return neuron::counters().launches_by_stream; });
  m.def("launches_by_name", [] {
    std::map<std::string, int64_t> out;
    for (const auto& [name, n] : neuron::counters().launches_by_name) {
      out[name] += n;
    }
    return out;
  });
  m.def("syncs_by_reason", [] { return neuron::counters().syncs_by_reason; });
  m.def("dropped_out_forms", &neuron::dropped_out_forms);
}
