// The device's queue: one FIFO and one worker thread that runs its launches in issue order.
//
// The host returns from a launch as soon as it is queued; the worker runs the CPU kernels
// behind it over the device's memory. Streams share the one FIFO: running launches in
// submission order is a valid schedule for any program that orders its streams with events,
// so an event wait costs the worker nothing (on the device clock, streams still overlap:
// timeline.cpp). A launch does not own the device memory it touches; the allocator reuses a
// freed block only for launches queued after the free, and gives it back to the system only
// once the launches before have run (allocator.cpp).
//
// Host cost: a launch is one push under the queue's lock. The worker polls for the next
// launch a short while before it sleeps, so a host issuing ops back to back wakes nobody
// (a wake-up is a system call on each side); and what a finished launch held is let go of on
// the host, at its next launch or sync, where that memory came from.
//
// Errors: an exception a launch raises is kept with the launch's name and re-raised at the
// next sync point (the host's next read, copy to the host or synchronize), with a note naming
// it; the launches queued after it are skipped (their outputs are never written, as after a
// device fault) and counted. The device is usable again once the error has been reported.
//
// The interpreter lock: a launch from Python (the engine's replays) takes it on the worker,
// so the host never waits for the worker while holding it (``NoGil``).
#include "neuron.h"

#include <ATen/Parallel.h>

#include <Python.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace neuron {

struct Marker {
  bool reached = false;        // guarded by the queue's lock
  Clock::time_point end;       // the device clock when the launches before it ended
};

namespace {

struct Launch {
  std::function<void()> fn;  // empty for a marker
  const char* name;          // static: an op's schema name or a literal
  Clock::time_point issued;
  std::shared_ptr<Marker> marker;
  bool chore = false;     // runs after what is queued, but is no launch (a deferred free)
  bool cpu_time = false;  // its kernel time is the worker's CPU time (see thread_time)
  int64_t stream = 0;     // the stream it was issued on (the device clock is per stream)
  bool waits = false;     // with a marker: the stream waits for it (an event wait), no record
};

// A real device's queue is bounded too: past this many queued launches the host waits.
constexpr size_t kMaxQueued = 4096;

// Never destroyed (the worker outlives static destruction at exit, waiting on them).
std::mutex& lock = *new std::mutex;
std::condition_variable& work = *new std::condition_variable;  // the worker waits for launches
std::condition_variable& done = *new std::condition_variable;  // the host waits for the worker
std::deque<Launch>& fifo = *new std::deque<Launch>;            // guarded by lock
// launches queued, ever (written under lock; the idle worker polls it without the lock)
std::atomic<int64_t> issued{0};
int64_t finished = 0;          // launches the worker is done with (guarded by lock)
// modelled ends of finished launches not yet passed (guarded by lock)
std::deque<Clock::time_point>& ends = *new std::deque<Clock::time_point>;
std::exception_ptr failure;    // the first error since the last sync (guarded by lock)
thread_local bool is_worker = false;
bool sleeping = false;         // the worker waits on ``work`` (guarded by lock)
// The worker wakes waiting host threads once this many launches have finished, not after
// every launch: a host woken for nothing takes a core from the kernels (guarded by lock).
int64_t wake_at = INT64_MAX;
// What finished launches held, let go of by the host (guarded by lock): their memory was
// allocated on the host thread, and a free from another thread costs both threads the
// allocator's lock and its per-thread caches.
std::vector<std::function<void()>>& spent = *new std::vector<std::function<void()>>;
// Before sleeping, the worker polls this long for the next launch: a host issuing ops back to
// back then queues them without a wake-up call (a system call on each side).
constexpr auto kSpin = std::chrono::microseconds(30);
const char* failed_name = nullptr;
int64_t skipped = 0;  // launches skipped since that error (guarded by lock)
bool started = false;

// Releases the interpreter lock, if this thread holds it, for as long as it lives.
struct NoGil {
  PyThreadState* state = nullptr;
  NoGil() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      state = PyEval_SaveThread();
    }
  }
  ~NoGil() {
    if (state) {
      PyEval_RestoreThread(state);
    }
  }
};

// A Python launch's kernel time: the worker's CPU time, which leaves out waits for the
// interpreter lock that a device does not have. (A C++ kernel's is wall time: this clock is
// a system call, the wall clock is not.)
Clock::duration thread_time() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

void run() {
  is_worker = true;
  // as PyTorch's own threads do (the autograd engine's device threads): the thread's OpenMP
  // team sized as the process's, matching MKL's, so kernels here run as on the main thread
  at::init_num_threads();
  std::unique_lock<std::mutex> guard(lock);
  for (;;) {
    if (fifo.empty()) {
      const int64_t seen = issued;
      guard.unlock();
      const auto until = Clock::now() + kSpin;
      for (int i = 1; issued.load(std::memory_order_acquire) == seen; ++i) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        if (i % 32 == 0 && Clock::now() >= until) {
          break;
        }
      }
      guard.lock();
      sleeping = true;
      work.wait(guard, [] { return !fifo.empty(); });
      sleeping = false;
    }
    Launch launch = std::move(fifo.front());
    fifo.pop_front();
    const bool skip = failure != nullptr;
    guard.unlock();
    Clock::time_point end;
    if (launch.chore) {
      launch.fn();
      end = device_free_at();
    } else if (launch.marker && launch.waits) {
      end = stream_waits(launch.stream, launch.marker->end);
    } else if (launch.marker) {  // the device passes it when the stream is done and it's issued
      end = std::max(stream_free_at(launch.stream), launch.issued);
    } else if (skip) {
      count_skipped();
      end = stream_free_at(launch.stream);
    } else {
      const auto start = launch.cpu_time ? thread_time() : Clock::now().time_since_epoch();
      std::exception_ptr error;
      try {
        launch.fn();
      } catch (...) {
        error = std::current_exception();
      }
      const auto stop = launch.cpu_time ? thread_time() : Clock::now().time_since_epoch();
      end = account(launch.issued, stop - start, launch.stream);
      if (error) {
        guard.lock();
        if (!failure) {
          failure = error;
          failed_name = launch.name;
        }
        guard.unlock();
      }
    }
    guard.lock();
    if (launch.marker && !launch.waits) {
      launch.marker->end = end;
      launch.marker->reached = true;
    } else if (!launch.marker) {
      ends.push_back(end);
    }
    ++finished;
    skipped += skip && !launch.chore && !launch.marker;
    if (launch.fn) {
      spent.push_back(std::move(launch.fn));
    }
    if (finished >= wake_at) {
      wake_at = INT64_MAX;  // whoever still waits says again when to wake it
      done.notify_all();
    }
  }
}

// Under ``guard``: wait (without the interpreter lock) until ``ready``, which can only turn
// true once ``finished`` reaches ``target()``.
template <typename Ready, typename Target>
void block(std::unique_lock<std::mutex>& guard, Ready ready, Target target) {
  if (ready()) {
    return;
  }
  guard.unlock();
  NoGil nogil;
  guard.lock();
  while (!ready()) {
    wake_at = std::min(wake_at, target());
    done.wait(guard);
  }
}

// Under ``guard``: takes what finished launches held, for the caller to let go of unlocked.
std::vector<std::function<void()>> take_spent() {
  std::vector<std::function<void()>> out;
  out.swap(spent);
  return out;
}

void enqueue(Launch launch) {
  std::unique_lock<std::mutex> guard(lock);
  if (!started) {
    std::thread(run).detach();  // lives as long as the process
    started = true;
  }
  if (fifo.size() >= kMaxQueued) {
    // full: the host waits until half has drained, not for each slot (one wake-up per
    // kMaxQueued / 2 launches instead of one per launch, which would take a core from them)
    block(guard, [] { return fifo.size() <= kMaxQueued / 2; },
          [] { return finished + static_cast<int64_t>(kMaxQueued / 2); });
  }
  fifo.push_back(std::move(launch));
  ++issued;
  const bool wake = sleeping;
  auto gone = take_spent();
  guard.unlock();
  if (wake) {
    work.notify_one();
  }
  gone.clear();  // here, on the host, after the worker has its launch
}

}  // namespace

void submit(std::function<void()> fn, const char* name, bool cpu_time) {
  count_launch(name);
  Launch launch{std::move(fn), name, Clock::now(), nullptr};
  launch.cpu_time = cpu_time;
  launch.stream = current_stream_id();
  enqueue(std::move(launch));
}

void after_queued(std::function<void()> fn) {
  if (is_worker || idle()) {
    fn();
    return;
  }
  Launch chore{std::move(fn), "free", Clock::now(), nullptr};
  chore.chore = true;
  enqueue(std::move(chore));
}

bool idle() {
  std::lock_guard<std::mutex> guard(lock);
  return finished == issued;
}

void wait(const std::string& reason) {
  count_sync(reason);
  std::exception_ptr error;
  const char* name = nullptr;
  int64_t later = 0;
  std::vector<std::function<void()>> gone;
  {
    std::unique_lock<std::mutex> guard(lock);
    block(guard, [] { return finished == issued; }, [] { return issued.load(); });
    std::swap(error, failure);
    name = failed_name;
    std::swap(later, skipped);
    ends.clear();
    gone = take_spent();
  }
  gone.clear();
  {
    NoGil nogil;
    wait_until(device_free_at());
  }
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (c10::Error& e) {
      e.add_context(std::string("neuron: raised on the device by ") + name +
                    ", queued before this sync (" + reason + "); " + std::to_string(later) +
                    " later launch(es) skipped");
      throw;
    }
  }
}

bool wait_below(int64_t depth) {
  std::unique_lock<std::mutex> guard(lock);
  auto inflight = [] {
    const auto now = Clock::now();
    while (!ends.empty() && ends.front() <= now) {
      ends.pop_front();
    }
    return (issued - finished) + static_cast<int64_t>(ends.size());
  };
  if (inflight() < depth) {
    return false;
  }
  while (inflight() >= depth) {
    if (issued > finished) {
      const int64_t target = finished + 1;
      block(guard, [target] { return finished >= target; }, [target] { return target; });
    } else {
      const auto until = ends.front();
      guard.unlock();
      {
        NoGil nogil;
        wait_until(until);
      }
      guard.lock();
    }
  }
  return true;
}

std::shared_ptr<Marker> record_marker(int64_t stream) {
  auto marker = std::make_shared<Marker>();
  Launch launch{nullptr, "event", Clock::now(), marker};
  launch.stream = stream;
  enqueue(std::move(launch));
  return marker;
}

void stream_wait_marker(int64_t stream, std::shared_ptr<Marker> marker) {
  Launch launch{nullptr, "event wait", Clock::now(), std::move(marker)};
  launch.stream = stream;
  launch.waits = true;
  enqueue(std::move(launch));
}

bool marker_reached(const Marker& m) {
  std::lock_guard<std::mutex> guard(lock);
  return m.reached && Clock::now() >= m.end;
}

void wait_marker(const Marker& m) {
  Clock::time_point end;
  {
    std::unique_lock<std::mutex> guard(lock);
    block(guard, [&m] { return m.reached; }, [] { return finished + 1; });
    end = m.end;
  }
  NoGil nogil;
  wait_until(end);
}

double marker_ms_between(const Marker& a, const Marker& b) {
  wait_marker(a);
  wait_marker(b);
  return std::chrono::duration<double, std::milli>(b.end - a.end).count();
}

bool device_query() {
  {
    std::lock_guard<std::mutex> guard(lock);
    if (finished != issued) {
      return false;
    }
  }
  return Clock::now() >= device_free_at();
}

}  // namespace neuron
