// The device's timeline: what a launch costs the device, and the counters that say so.
//
// The device clock models the launch latency the emulator does not have: each launch starts
// when the device is free and the host has issued it, and ends ``latency`` after its kernel:
//
//     start = max(end of the previous launch, issued at)
//     end   = start + latency + the kernel's measured time
//
// The queue (queue.cpp) runs each kernel as soon as it can and accounts for it here; a sync
// point waits until the worker has run everything *and* the wall clock has passed the last
// launch's modelled end, so the user never sees a result earlier than the modelled device
// could have produced it. Counters are exact.
#include "neuron.h"

#include <mutex>
#include <thread>

namespace neuron {
namespace {

std::mutex lock;
Clock::time_point free_at;  // when the device finishes its last launch (guarded by lock)
double latency_s = 10e-6;   // guarded by lock
Counters counts;            // guarded by lock

}  // namespace

void count_launch(const char* name) {
  const int64_t stream = current_stream_id();
  std::lock_guard<std::mutex> guard(lock);
  counts.launches += 1;
  counts.launches_by_stream[stream] += 1;
  counts.launches_by_name[name] += 1;
}

Clock::time_point account(Clock::time_point issued, Clock::duration kernel) {
  std::lock_guard<std::mutex> guard(lock);
  auto start = std::max(free_at, issued);
  auto cost = kernel + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(latency_s));
  free_at = start + cost;
  counts.busy_s += std::chrono::duration<double>(cost).count();
  counts.kernel_s += std::chrono::duration<double>(kernel).count();
  return free_at;
}

void launched(Clock::duration kernel, const char* what) {
  count_launch(what);
  account(Clock::now() - kernel, kernel);  // it ran from (now - kernel) on this thread
}

Clock::time_point device_free_at() {
  std::lock_guard<std::mutex> guard(lock);
  return free_at;
}

void copied(int64_t nbytes, bool to_host) {
  std::lock_guard<std::mutex> guard(lock);
  (to_host ? counts.bytes_to_host : counts.bytes_to_device) += nbytes;
}

void count_sync(const std::string& reason) {
  std::lock_guard<std::mutex> guard(lock);
  counts.syncs += 1;
  counts.syncs_by_reason[reason] += 1;
}

void count_skipped() {
  std::lock_guard<std::mutex> guard(lock);
  counts.skipped_after_error += 1;
}

void wait_until(Clock::time_point until) {
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
