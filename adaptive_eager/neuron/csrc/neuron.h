// The emulated neuron device as a C++ PrivateUse1 backend: what its files share.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>

namespace neuron {

// allocator.cpp: host memory the device owns, with the figures torch.accelerator reports
c10::Allocator* allocator();
int64_t memory_allocated();
int64_t max_memory_allocated();
int64_t allocations();
void reset_peak_memory_stats();

// fallback.cpp: a CPU tensor over the same memory as a neuron tensor (no copy), and a
// neuron tensor with a CPU tensor's sizes, strides and values (one copy)
at::Tensor host_alias(const at::Tensor& t);
at::Tensor to_device(const at::Tensor& host);

}  // namespace neuron
