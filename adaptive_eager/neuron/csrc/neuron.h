// The emulated neuron device as a C++ PrivateUse1 backend: what its files share.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>

#include <chrono>

namespace neuron {

// allocator.cpp: host memory the device owns, with the figures torch.accelerator reports
c10::Allocator* allocator();
int64_t memory_allocated();
int64_t max_memory_allocated();
int64_t allocations();
void reset_peak_memory_stats();
// A storage a CPU kernel allocated becomes device memory, counted, without a copy (false
// when the block is not the CPU allocator's own: then the caller copies).
bool adopt(const c10::Storage& storage);

// fallback.cpp: a CPU tensor over the same memory as a neuron tensor (no copy), and a
// neuron tensor with a fresh CPU tensor's sizes, strides and values (its memory adopted, or
// one copy)
at::Tensor host_alias(const at::Tensor& t);
std::optional<at::Tensor> host_or_none(const std::optional<at::Tensor>& t);  // undefined: none
at::Tensor to_device(const at::Tensor& host);
// the boxed kernel every op without one of the device's own runs: cpu's on host aliases
void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// timeline.cpp: the launch model (latency on the device's clock, the host waits at syncs)
struct Counters {
  int64_t launches = 0;
  int64_t bytes_to_device = 0;
  int64_t bytes_to_host = 0;
  int64_t syncs = 0;
  double busy_s = 0;    // modelled device time: latency + kernel, over launches
  double kernel_s = 0;  // measured time of the kernels alone
};
void launched(std::chrono::steady_clock::duration kernel, const char* what);
void copied(int64_t nbytes, bool to_host);
void wait(const char* reason);
void set_latency_us(double us);
double latency_us();
Counters counters();
void reset_counters();

// choices.cpp: cpu's kernel for every op that has one and a composite (returns how many)
int64_t register_cpu_kernels();

// generator.cpp: ``torch.Generator("neuron")``, and the CPU generator it draws from
at::Generator new_generator();
at::Generator cpu_generator(const at::Generator& g);

}  // namespace neuron
