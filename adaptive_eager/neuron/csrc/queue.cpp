// The device's queue: one FIFO and one worker thread that runs its launches in issue order.
//
// The host returns from a launch as soon as it is queued; the worker runs the CPU kernels
// behind it over the device's memory. Streams share the one FIFO: running launches in
// submission order is a valid schedule for any program that orders its streams with events,
// so an event wait costs nothing. A launch keeps what it reads and writes alive (the device
// storages it holds), so a buffer is never freed, and so never reused, while a queued launch
// can touch it.
//
// Errors: an exception a launch raises is kept with the launch's name and re-raised at the
// next sync point (the host's next read, copy to the host or synchronize), with a note naming
// it; the launches queued after it are skipped (their outputs are never written, as after a
// device fault) and counted. The device is usable again once the error has been reported.
//
// The interpreter lock: a launch from Python (the engine's replays) takes it on the worker,
// so the host never waits for the worker while holding it (``NoGil``).
#include "neuron.h"

#include <Python.h>
#include <time.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

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
  bool chore = false;  // runs after what is queued, but is no launch (a deferred free)
};

// A real device's queue is bounded too: past this many queued launches the host waits.
constexpr size_t kMaxQueued = 4096;

// Never destroyed (the worker outlives static destruction at exit, waiting on them).
std::mutex& lock = *new std::mutex;
std::condition_variable& work = *new std::condition_variable;  // the worker waits for launches
std::condition_variable& done = *new std::condition_variable;  // the host waits for the worker
std::deque<Launch>& fifo = *new std::deque<Launch>;            // guarded by lock
int64_t issued = 0;            // launches queued, ever (guarded by lock)
int64_t finished = 0;          // launches the worker is done with (guarded by lock)
// modelled ends of finished launches not yet passed (guarded by lock)
std::deque<Clock::time_point>& ends = *new std::deque<Clock::time_point>;
std::exception_ptr failure;    // the first error since the last sync (guarded by lock)
thread_local bool is_worker = false;
const char* failed_name = nullptr;
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

// The kernel's own time: the worker's CPU time, which leaves out waits for the interpreter
// lock that a device does not have.
Clock::duration thread_time() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

void run() {
  is_worker = true;
  for (;;) {
    Launch launch;
    bool skip;
    {
      std::unique_lock<std::mutex> guard(lock);
      work.wait(guard, [] { return !fifo.empty(); });
      launch = std::move(fifo.front());
      fifo.pop_front();
      skip = failure != nullptr;
    }
    Clock::time_point end;
    if (launch.chore) {
      launch.fn();
      end = device_free_at();
    } else if (launch.marker) {
      end = device_free_at();
    } else if (skip) {
      count_skipped();
      end = device_free_at();
    } else {
      const auto start = thread_time();
      try {
        launch.fn();
      } catch (...) {
        std::lock_guard<std::mutex> guard(lock);
        if (!failure) {
          failure = std::current_exception();
          failed_name = launch.name;
        }
      }
      end = account(launch.issued, thread_time() - start);
    }
    launch.fn = nullptr;  // what it held (device memory, a Python callable) goes now
    {
      std::lock_guard<std::mutex> guard(lock);
      if (launch.marker) {
        launch.marker->end = end;
        launch.marker->reached = true;
      } else {
        ends.push_back(end);
      }
      ++finished;
    }
    done.notify_all();
  }
}

// Under ``guard``: wait (without the interpreter lock) until ``ready``.
template <typename Ready>
void block(std::unique_lock<std::mutex>& guard, Ready ready) {
  if (ready()) {
    return;
  }
  guard.unlock();
  NoGil nogil;
  guard.lock();
  done.wait(guard, ready);
}

void enqueue(Launch launch) {
  std::unique_lock<std::mutex> guard(lock);
  if (!started) {
    std::thread(run).detach();  // lives as long as the process
    started = true;
  }
  block(guard, [] { return fifo.size() < kMaxQueued; });
  fifo.push_back(std::move(launch));
  ++issued;
  guard.unlock();
  work.notify_one();
}

}  // namespace

void submit(std::function<void()> fn, const char* name) {
  count_launch(name);
  enqueue(Launch{std::move(fn), name, Clock::now(), nullptr});
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
  {
    std::unique_lock<std::mutex> guard(lock);
    block(guard, [] { return finished == issued; });
    std::swap(error, failure);
    name = failed_name;
    ends.clear();
  }
  {
    NoGil nogil;
    wait_until(device_free_at());
  }
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (c10::Error& e) {
      e.add_context(std::string("neuron: raised on the device by ") + name +
                    ", queued before this sync (" + reason + ")");
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
      block(guard, [target] { return finished >= target; });
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

std::shared_ptr<Marker> record_marker() {
  auto marker = std::make_shared<Marker>();
  enqueue(Launch{nullptr, "event", Clock::now(), marker});
  return marker;
}

bool marker_reached(const Marker& m) {
  std::lock_guard<std::mutex> guard(lock);
  return m.reached && Clock::now() >= m.end;
}

void wait_marker(const Marker& m) {
  Clock::time_point end;
  {
    std::unique_lock<std::mutex> guard(lock);
    block(guard, [&m] { return m.reached; });
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
