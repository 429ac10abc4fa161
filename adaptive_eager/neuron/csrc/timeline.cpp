// The device's timeline: what a launch costs the device, and where the host waits for it.
//
// Kernels run at once on the calling thread (no queue yet); the modelled launch latency is
// paid on the device's clock instead: each launch starts when the device is free and the host
// has issued it, and ends ``latency`` after its kernel. The host only waits at sync points
// (a read of a value, a copy to the host, synchronize), until the device's clock has passed.
// So a program that issues many small launches between syncs pays the latency per launch, as
// on the real device, and host work overlaps it. Counters are exact.
#include "neuron.h"

#include <chrono>
#include <mutex>
#include <thread>

namespace neuron {
namespace {

using Clock = std::chrono::steady_clock;

std::mutex lock;
Clock::time_point free_at;  // when the device finishes its last launch (guarded by lock)
double latency_s = 10e-6;   // guarded by lock
Counters counts;            // guarded by lock

}  // namespace

void launched(Clock::duration kernel, const char* /*what*/) {
  std::lock_guard<std::mutex> guard(lock);
  auto now = Clock::now();
  auto start = std::max(free_at, now - kernel);  // the kernel ran from (now - kernel)
  auto cost = kernel + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(latency_s));
  free_at = start + cost;
  counts.launches += 1;
  counts.busy_s += std::chrono::duration<double>(cost).count();
  counts.kernel_s += std::chrono::duration<double>(kernel).count();
}

void copied(int64_t nbytes, bool to_host) {
  std::lock_guard<std::mutex> guard(lock);
  (to_host ? counts.bytes_to_host : counts.bytes_to_device) += nbytes;
}

void wait(const char* /*reason*/) {
  Clock::time_point until;
  {
    std::lock_guard<std::mutex> guard(lock);
    counts.syncs += 1;
    until = free_at;
  }
  // sleep the bulk, spin the last 200 us (sleep overshoots by tens of microseconds)
  auto remaining = until - Clock::now();
  if (remaining > std::chrono::microseconds(500)) {
    std::this_thread::sleep_for(remaining - std::chrono::microseconds(200));
  }
  while (Clock::now() < until) {
  }
}

void set_latency_us(double us) {
  wait("latency change");
  std::lock_guard<std::mutex> guard(lock);
  latency_s = us * 1e-6;
}

double latency_us() {
  std::lock_guard<std::mutex> guard(lock);
  return latency_s * 1e6;
}

Counters counters() {
  std::lock_guard<std::mutex> guard(lock);
  return counts;
}

void reset_counters() {
  wait("reset counters");
  std::lock_guard<std::mutex> guard(lock);
  counts = Counters();
}

}  // namespace neuron
