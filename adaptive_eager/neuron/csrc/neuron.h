// The emulated neuron device as a C++ PrivateUse1 backend: what its files share.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>

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
// A tensor of ``like``'s dtype, sizes, strides, offset and conj/neg bits over ``storage``,
// with the key ``key`` (CPU: a host alias; Meta: a plan's twin; PrivateUse1: the device's)
at::Tensor over(const c10::Storage& storage, c10::DispatchKey key, const at::Tensor& like);

std::optional<at::Tensor> host_or_none(const std::optional<at::Tensor>& t);  // undefined: none
at::Tensor to_device(const at::Tensor& host);
// ``aten::name.overload``, with static storage (launches are counted and named by it)
const char* launch_name(const c10::OperatorHandle& op);
// the boxed kernel every op without one of the device's own runs: cpu's on host aliases
void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack);

using Clock = std::chrono::steady_clock;

// plan.cpp: what an op returns, from its meta kernel, cached by what that depends on
struct Plan {
  struct Out {
    enum Kind : uint8_t { kUndefined, kWritten, kFresh } kind = kUndefined;
    int32_t written = -1;  // kWritten: which written argument (tensors, lists flattened)
    std::vector<int64_t> sizes, strides;  // kFresh
    at::ScalarType dtype = at::kFloat;
  };
  struct Ret {
    bool list = false;
    std::vector<Out> outs;  // one, or the list's elements
  };
  bool ok = false;  // false: not plannable, the op runs at once
  std::vector<Ret> returns;
  // Empty out= arguments the op sizes (a factory's ``arange(..., out=empty)``): the host
  // resizes them before queuing. Their sizes follow Scalar values, so such a plan is cached by
  // those values too (plan.cpp).
  struct Resize {
    int32_t written;
    std::vector<int64_t> sizes;
  };
  std::vector<Resize> resizes;
};
std::shared_ptr<const Plan> plan_for(const c10::OperatorHandle& op,
                                     const torch::jit::Stack& stack, size_t first);
// A launch found cpu's kernel returning other than the plan: the op is not planned again.
void learn_disagreement(const c10::OperatorHandle& op);

// out_form.cpp: the overload writing an op's results into given tensors (null: none)
struct OutForm {
  c10::OperatorHandle op;
  const char* of;  // the op's name (launch_name)
  std::atomic<bool> usable{true};  // false once a launch found it differs from the op
  void drop(const char* why);      // the op's launches run its functional form from now on
};
OutForm* out_form(const c10::OperatorHandle& op);
std::map<std::string, std::string> dropped_out_forms();  // op -> why (for the process)

// timeline.cpp: the launch model (latency on the device's clock) and the exact counters
struct Counters {
  int64_t launches = 0;
  std::map<int64_t, int64_t> launches_by_stream;
  std::map<const char*, int64_t> launches_by_name;  // names have static storage
  int64_t bytes_to_device = 0;
  int64_t bytes_to_host = 0;
  int64_t syncs = 0;
  std::map<std::string, int64_t> syncs_by_reason;
  int64_t skipped_after_error = 0;  // launches not run because one before them failed
  double busy_s = 0;    // modelled device time: latency + kernel, over launches
  double kernel_s = 0;  // measured time of the kernels alone
};
// one launch of ``name`` (static storage) issued on the calling thread's current stream
void count_launch(const char* name);
// a kernel issued at ``issued`` on ``stream`` that ran for ``kernel``: its modelled end
Clock::time_point account(Clock::time_point issued, Clock::duration kernel, int64_t stream);
// when ``stream`` finishes its last launch on the device clock
Clock::time_point stream_free_at(int64_t stream);
// ``stream``'s later launches start no earlier than ``until`` (an event wait); its new end
Clock::time_point stream_waits(int64_t stream, Clock::time_point until);
// a kernel that just ran on the calling thread: counted and accounted
void launched(Clock::duration kernel, const char* what);
Clock::time_point device_free_at();  // when every stream has finished
void wait_until(Clock::time_point until);
void copied(int64_t nbytes, bool to_host);
void count_sync(const std::string& reason);
void count_skipped();
void set_latency_us(double us);
double latency_us();
Counters counters();
void reset_counters();

// queue.cpp: the device's queue, one worker thread running launches in issue order
// Queue one launch (counted on the current stream); returns at once unless the queue is full.
// Its kernel time is wall time, or the worker's CPU time with ``cpu_time`` (Python code,
// which may wait for the interpreter lock).
void submit(std::function<void()> fn, const char* name, bool cpu_time = false);
// A sync point: wait until every launch has run and the device clock has passed; re-raise
// the first error a launch raised since the last sync (with a note naming it).
void wait(const std::string& reason);
bool idle();  // nothing queued or running
// Run ``fn`` once every launch queued so far has run (at once if none): how the allocator
// frees a block that queued launches may still touch.
void after_queued(std::function<void()> fn);
// Wait while ``depth`` or more launches are unfinished on the device clock; true if it waited.
bool wait_below(int64_t depth);
// A point in the queue (an event): recorded now on ``stream``, reached when the launches
// before it ran; its time is that stream's end on the device clock.
struct Marker;
std::shared_ptr<Marker> record_marker(int64_t stream);
// ``stream`` waits for the marker on the device clock (launches run in queue order anyway)
void stream_wait_marker(int64_t stream, std::shared_ptr<Marker> marker);
bool marker_reached(const Marker& m);  // ran, and the device clock has passed it
void wait_marker(const Marker& m);
double marker_ms_between(const Marker& a, const Marker& b);
bool device_query();  // everything ran and the device clock has passed

// module.cpp: before an event or a stream orders or waits on the queue, whoever holds work
// back on the host (the engine's deferred ops) launches it (a Python hook; none: nothing)
void flush(const char* reason);

// device.cpp: the calling thread's current stream
int64_t current_stream_id();

// choices.cpp: cpu's kernel for every op that has one and a composite (returns how many)
int64_t register_cpu_kernels();

// generator.cpp: ``torch.Generator("neuron")``, and the CPU generator it draws from
at::Generator new_generator();
at::Generator cpu_generator(const at::Generator& g);

// random.cpp: a random op that only fills device tensors, drawn now on the host and copied
// in order (false: not such an op, nothing done)
bool draw_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace neuron
