// The device's timeline: what a launch costs the device, and the counters that say so.
//
// The device clock models the launch latency the emulator does not have: each launch starts
// when its stream is free and the host has issued it, and ends ``latency`` after its kernel:
//
//     start = max(end of the stream's previous launch, issued at)
//     end   = start + latency + the kernel's measured time
//
// Streams overlap on this clock (the worker still runs every kernel in queue order): an event
// is its stream's end when recorded, and a stream waiting on it starts no earlier.
//
// The queue (queue.cpp) runs each kernel as soon as it can and accounts for it here; a sync
// point waits until the worker has run everything *and* the wall clock has passed the last
// launch's modelled end, so the user never sees a result earlier than the modelled device
// could have produced it. Counters are exact.
#include "neuron.h"

#include <map>
#include <mutex>
#include <thread>

namespace neuron {
namespace {

std::mutex lock;
Clock::time_point free_at;  // when the device finishes its last launch (guarded by lock)
// per stream: when it finishes its last launch (guarded by lock)
std::map<int64_t, Clock::time_point> stream_free;
double latency_us_ = 10;    // as set (guarded by lock)
double latency_s = 10e-6;   // the same in seconds (guarded by lock)
Counters counts;            // guarded by lock

}  // namespace

void count_launch(const char* name) {
  const int64_t stream = current_stream_id();
  std::lock_guard<std::mutex> guard(lock);
  counts.launches += 1;
  counts.launches_by_stream[stream] += 1;
  counts.launches_by_name[name] += 1;
}

Clock::time_point account(Clock::time_point issued, Clock::duration kernel, int64_t stream) {
  std::lock_guard<std::mutex> guard(lock);
  auto& at = stream_free[stream];
  auto start = std::max(at, issued);
  auto latency = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(latency_s));
  at = start + latency + kernel;
  free_at = std::max(free_at, at);
  const double k = std::chrono::duration<double>(kernel).count();
  counts.busy_s += latency_s + k;
  counts.kernel_s += k;
  return at;
}

Clock::time_point stream_free_at(int64_t stream) {
  std::lock_guard<std::mutex> guard(lock);
  auto it = stream_free.find(stream);
  return it == stream_free.end() ? Clock::time_point() : it->second;
}

Clock::time_point stream_waits(int64_t stream, Clock::time_point until) {
  std::lock_guard<std::mutex> guard(lock);
  auto& at = stream_free[stream];
  at = std::max(at, until);
  return at;
}

void launched(Clock::duration kernel, const char* what) {
  count_launch(what);
  // it ran from (now - kernel) on this thread
  account(Clock::now() - kernel, kernel, current_stream_id());
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
  latency_us_ = us;
  latency_s = us * 1e-6;
}

double latency_us() {
  std::lock_guard<std::mutex> guard(lock);
  return latency_us_;
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
