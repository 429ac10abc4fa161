"""The compile process: Inductor compiles away from the user's interpreter.

Note [Compiles leave the process]: a compile on a thread of the user's process shares the
interpreter lock with the loop. Every aten op releases the lock while its kernel runs, and
while the compiler thread is runnable each op's return then waits up to a switch interval
(5 ms) for the lock to come back: a 66-op step took 5-27 ms instead of 0.23 ms for as long as
a compile ran (measured), and tracing and lowering hold the lock for seconds on their own.

So fused compiles run in one long-lived child process (``python -m
adaptive_eager.scheduler.compile_child``, its side of the pipes), started when the engine
first learns a path and shared by every engine of the process. The compiler thread sends it the request (the
path's ops, metadata, plan and specialized floats: everything ``backends.trace`` reads),
blocks on the pipe without the lock, and gets back Inductor's serialized output (the
``CompiledFxGraph`` that Inductor's own FX graph cache stores). Loading it here executes the
generated wrapper, whose kernels the child already built into the shared Inductor cache
directory: milliseconds, not seconds. Graphs on CUDA compile there too: the child makes its
own CUDA context, and its Triton kernels land in the same cache directory (measured on an
H200: the slowest early step of a Llama training loop went from 477x eager's median to 40x).

The child also keeps Inductor's tracing state out of this process: ``make_fx`` sets
``torch.fx``'s process-wide tracing flag, which made a ``torch.compile``'d function on any
other thread of the user's program raise while a compile ran.

Frames on the pipes are an 8-byte little-endian length and a pickle. Ops are sent by name
(``OpOverload`` objects do not pickle). A request the child cannot receive (an op from a
library only this process has loaded) or a child that dies fails that compile with the
reason; the engine counts it and the path keeps its exact replay.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time

import torch

__all__ = ["CompileProcess", "CompileProcessError", "dumps", "loads", "shared", "serve"]

log = logging.getLogger("adaptive_eager")
_HEADER = struct.Struct("<Q")
# Settings of the user's environment the child must not inherit: it would enable the engine
# in the child (autoload) or try to read the user's program's own configuration.
_DROP_ENV_PREFIX = ("NEURON_ADAPTIVE_EAGER",)


class CompileProcessError(RuntimeError):
    """The compile process could not serve a request (it died, or could not be started)."""


# torch's dtype, layout and memory-format objects go by name: a layout does not pickle at
# all, and a memory format pickles as a global that ``pickle`` looks up in whichever loaded
# module reaches it first; in a process started by ``torch.multiprocessing.spawn`` that was
# the program's own ``__mp_main__`` (it imports torch), which the child does not have, and
# every compile of an op taking ``memory_format`` failed there (DDP's on neuron did).
_BY_NAME = (torch.dtype, torch.layout, torch.memory_format)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj.namespace, obj._schema.name.split("::", 1)[1],
                    obj._overloadname)
        if isinstance(obj, _BY_NAME):
            return ("torch", str(obj).split(".", 1)[1])
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        if pid[0] == "torch":
            return getattr(torch, pid[1])
        kind, namespace, name, overload = pid
        if kind != "op":
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, overload or "default")


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()


def _write(stream, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def _read(stream) -> bytes | None:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    data = stream.read(n)
    return data if len(data) == n else None


# The child runs at the lowest CPU priority from before it imports anything (born low, Note [A
# child born low], or by its own first lines where it could not be): on a machine with
# few cores, a compile at normal priority preempts the loop's intra-op threads, whose barrier
# then waits a whole scheduler slice (a 0.4 ms step measured at 2-6 ms; at nice 19, 0.5 ms).
# Where the system has it, the child is also in the idle scheduling class (SCHED_IDLE: it
# runs only on a core nothing else wants, and yields it at once): at nice 19 alone, the
# child's start-up (importing torch and Inductor, ~2 CPU-seconds, during the loop's second
# step) still slowed llama-train's second step from ~28 ms to 110-215 ms on 2 cores with 2
# intra-op threads; in the idle class 26-136 ms (cpu, 3 runs each).
# Ctrl-C in a terminal signals the whole process group: the child ignores it, so a program
# that catches the KeyboardInterrupt (a notebook's interrupt button) keeps its compiles
# (Note [Interrupts wait for the launch], scheduler.interrupts); it ends with its parent.
_CHILD_NORMAL = ("import runpy, signal\n"
                 "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                 "runpy.run_module('adaptive_eager.scheduler.compile_child', "
                 "run_name='__main__')\n")
_CHILD = ("import os\n"
          "try:\n    os.nice(19)\nexcept (AttributeError, OSError):\n    pass\n"
          "try:\n    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
          "except (AttributeError, OSError):\n    pass\n"
          + _CHILD_NORMAL)


# Note [Starved compiles]: nice 19 gives the child what the loop leaves. A loop that keeps
# every core busy (large tensors on the CPU, intra-op threads on all cores) leaves it about
# 1.5 % of a core: a compile of a few CPU-seconds then took longer than 90 s of training
# (measured: a 1M-float chain's graph never arrived), and the path stayed an exact replay.
# So while a request waits, the child's CPU time is checked every ``STARVED_S`` seconds;
# under ``STARVED_SHARE`` of one core it is *starved*: it is raised to this process's
# priority for the rest of that compile (``setpriority``, where the system allows it), else
# a new child is started at this process's priority and the request sent to it (an
# unprivileged process can lower its children's priority, never raise it). The loop then
# shares its cores with the compile for as long as it takes, and the child goes back to
# nice 19 when it answers. Counted in ``escalated``; logged at NEURON_ADAPTIVE_EAGER_DEBUG=1.
# The child's processes count as the child: a C++ compiler it runs (Inductor's kernels, or a
# first build of the project's extensions) inherits its idle class, so the child's CPU time
# includes theirs, and raising the child raises them too; a compiler left in the idle class
# behind a raised child hardly ran while the loop kept the cores busy (measured: neuron
# llama-train, the loop's thread and the device's worker on both cores, the child raised
# while its build of the device's extension stayed idle: 6.5 minutes, and no fused graph in
# 300 s of training).
STARVED_S = 5.0
STARVED_SHARE = 0.25
# A request that follows a starved one within this long starts at this process's priority:
# the paths of a step become hot together and their compiles queue one behind the other,
# each of which would otherwise starve STARVED_S again first (measured: neuron llama-train's
# second graph arrived 12 s after its first, 5 s of it starved).
STARVED_RECENT_S = 30.0
LOW = 19  # the child's niceness


class CompileProcess:
    """One child process serving compile requests, one at a time (thread safe)."""

    def __init__(self):
        self._proc = None
        self._owner = os.getpid()  # a forked copy of this object must not use the pipes
        self._lock = threading.Lock()
        self.started = 0  # children started (a dead one is replaced at the next request)
        self.escalated = 0  # requests raised to this process's priority (Note [Starved
        # compiles])
        self.raised_at_once = 0  # of them, requests raised as sent (STARVED_RECENT_S)
        self._starved_at = None  # when a request last starved

    def _start(self, low: bool = True) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP_ENV_PREFIX)}
        # The kernels the child builds must be found here: one cache directory for both.
        # Where this process has not imported Inductor yet, the child derives the same
        # directory from the same environment; importing Inductor just to ask would hold
        # the interpreter lock for about a second of the user's loop (measured: 0.9 s).
        dirs = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
        if dirs is not None:
            env["TORCHINDUCTOR_CACHE_DIR"] = dirs.cache_dir()
        # No pool of compile workers: the child's one thread leaves the user's loop its cores.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        # Inductor writes the thread count of its parallel loops into the kernels it
        # generates (torch.get_num_threads() in the compiling process): the child must have
        # this process's, or every kernel runs on one core (a 1M-float chain took 2.19x
        # torch.compile's time with one thread in the child, 1.70x with two).
        env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, env.get("PYTHONPATH")) if p)
        self.started += 1
        argv = [sys.executable, "-c", _CHILD_NORMAL]
        if not low:
            return _popen(argv, env)
        proc = _born_low(argv, env, lowering_argv=[sys.executable, "-c", _CHILD])
        _renice(proc.pid, LOW)  # where it could not be born low: from here on
        return proc

    def _after_fork(self) -> None:
        """In a forked copy of this process (a DataLoader worker) the child is the parent's:
        forget it (its pipes would mix two processes' requests) and the lock's state."""
        if self._owner != os.getpid():
            self._proc, self._owner = None, os.getpid()
            self._lock = threading.Lock()

    def start(self) -> None:
        """Start the child now if none runs (ahead of a request: its start-up, importing
        torch, then overlaps with the steps before the first compile)."""
        self._after_fork()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                try:
                    self._proc = self._start()
                except OSError:
                    pass  # the request will say why

    def request(self, payload: bytes):
        """Send one pickled request; return the child's result or raise its error."""
        self._after_fork()
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                try:
                    proc = self._proc = self._start()
                except OSError as e:
                    raise CompileProcessError(f"could not start the compile process: {e}") from e
            try:
                _write(proc.stdin, payload)
                proc, reply = self._answer(proc, payload)
            except (BrokenPipeError, OSError):
                reply = None
            if reply is None:
                code = proc.wait()
                self._proc = None
                raise CompileProcessError(f"the compile process died (exit code {code})")
        status, value = loads(reply)
        if status == "ok":
            return value
        raise value

    def _answer(self, proc, payload: bytes):
        """Wait for the child's reply, raising its priority if it starves (Note [Starved
        compiles]); returns the child that answered and the reply (None: it died)."""
        raised = False
        starved = self._starved_at
        if starved is not None and time.monotonic() - starved < STARVED_RECENT_S:
            # the one before starved: this one would too
            raised = _renice(proc.pid, os.getpriority(os.PRIO_PROCESS, 0))
            if raised:
                self.escalated += 1
                self.raised_at_once += 1
        cpu, since = _cpu_seconds(proc.pid), time.monotonic()
        while not raised and cpu is not None:
            if select.select([proc.stdout], [], [], STARVED_S)[0]:
                break
            now_cpu, now = _cpu_seconds(proc.pid), time.monotonic()
            if now_cpu is None:
                break  # it has ended: the read below says so
            if now_cpu - cpu >= STARVED_SHARE * (now - since):
                cpu, since = now_cpu, now
                continue
            raised = True
            self.escalated += 1
            self._starved_at = now
            log.info("the compile process had %.0f%% of a core for %.0f s: "
                     "raised to this process's priority", 100 * (now_cpu - cpu) / (now - since),
                     now - since)
            if not _renice(proc.pid, os.getpriority(os.PRIO_PROCESS, 0)):
                proc.kill()
                proc.wait()
                proc = self._proc = self._start(low=False)
                _write(proc.stdin, payload)
        reply = _read(proc.stdout)
        if raised and reply is not None:
            _renice(proc.pid, LOW)
        return proc, reply

    def close(self) -> None:
        """End the child now; a compile it is running fails ("died") to its requester."""
        proc = self._proc  # not under the lock: a request may hold it, waiting on the child
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None or proc.poll() is not None else proc.pid


def _popen(argv, env) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, close_fds=True)


# Note [A child born low]: a process inherits its scheduling class and niceness from the
# thread that starts it. Started from the loop's thread, the child ran at the loop's priority
# from its birth until it was lowered (by its parent right after the start, and by its own
# first line): those first milliseconds of a new interpreter at normal priority on 2 cores
# stretched a step of an eager MLP loop (2 intra-op threads, median 8-11 ms) to 71-161 ms,
# in each of 5 runs; a child born in the idle class left it alone (slowest step 20-27 ms,
# as with no child at all: 22 ms).
# So the child is started by a short-lived thread that lowers itself first (on Linux the
# class and niceness belong to a thread); the loop's thread never changes its own priority
# (an unprivileged thread may not raise it back).
# A child born low runs no lowering lines of its own: on a machine whose cores were busy it
# ran its first line only after its parent had found it starved and raised it (Note [Starved
# compiles]), and that line put it back in the idle class, where it starved on for good (a
# compile under two busy processes on 2 cores: still not done after 90 s, the child at 0 %).
# Only where its parent could not lower the starting thread does the child lower itself
# (``lowering_argv``).
def _born_low(argv, env, lowering_argv=None) -> subprocess.Popen:
    box = []

    def start():
        chosen = argv
        try:
            os.setpriority(os.PRIO_PROCESS, 0, LOW)  # this thread (Linux: per thread)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            chosen = lowering_argv or argv  # it lowers itself first, and _renice lowers it
        try:
            box.append(_popen(chosen, env))
        except OSError as e:
            box.append(e)

    starter = threading.Thread(target=start, name="adaptive_eager-compile-start", daemon=True)
    starter.start()
    starter.join()
    if isinstance(box[0], OSError):
        raise box[0]
    return box[0]


def _renice(pid: int, nice: int) -> bool:
    """Set the child's priority: ``LOW`` is nice 19 in the idle scheduling class (where the
    system has one); a higher priority leaves the idle class first, for the processes the
    child started too (its C++ compiler: Note [Starved compiles]). False where the system
    refuses (raising a priority may need privileges)."""
    try:
        if nice < LOW:
            for p in _tree(pid):
                try:
                    if (hasattr(os, "sched_setscheduler")
                            and os.sched_getscheduler(p) == os.SCHED_IDLE):
                        os.sched_setscheduler(p, os.SCHED_OTHER, os.sched_param(0))
                    if p != pid:
                        os.setpriority(os.PRIO_PROCESS, p, nice)
                except ProcessLookupError:
                    pass  # it ended meanwhile
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except (AttributeError, OSError):
        return False
    if nice >= LOW:
        try:
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass  # nice 19 alone
    return True


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _tree(pid: int) -> list[int]:
    """``pid`` and the processes it started, theirs and so on (Linux ``/proc``; elsewhere
    ``pid`` alone)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _cpu_seconds(pid: int) -> float | None:
    """CPU time the process has used, with the processes it started (a C++ compiler's time
    is the compile's), from Linux ``/proc``; None if unknown or ended."""
    total = 0.0
    for p in _tree(pid):  # ``pid`` first
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            if p == pid:
                return None
            continue
        if fields[0] in (b"Z", b"X"):  # ended, not yet reaped
            if p == pid:
                return None
            continue
        # utime + stime, and those of the children it has reaped
        total += sum(int(x) for x in fields[11:15]) / _TICKS
    return total


_SHARED = None
_SHARED_LOCK = threading.Lock()


def shared() -> CompileProcess:
    """The process-wide compile process (started by ``prepare()`` or its first request)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = CompileProcess()
        return _SHARED


def pack(args: tuple) -> bytes:
    """A compile request: the arguments of ``backends.inductor_artifact``, and the name of a
    device registered from Python (the emulated ``neuron``), which the child registers too
    before it reads them."""
    return dumps((torch._C._get_privateuse1_backend_name(), dumps(args)))


_PREPARED = False


def prepare() -> None:
    """A fused compile is coming (a path recurs): start the shared child, once per process.

    Started at the first request instead, the child's start-up cost the loop that step
    (15-170 ms measured on an MLP training step of 10 ms)."""
    global _PREPARED
    if not _PREPARED:
        _PREPARED = True
        shared().start()


def stop_shared() -> None:
    """End the shared child if one runs (engine shutdown)."""
    if _SHARED is not None:
        _SHARED.close()


# The child ends with the program. Registered when this module is imported, before the
# engine's own exit handler (registered at its first enable): handlers run last registered
# first, so the engine's exit, which may wait for compiles (Note [Warm start]), comes first.
atexit.register(stop_shared)


def _portable(error: BaseException) -> BaseException:
    """The error as the parent can receive it: itself if it pickles, else a RuntimeError
    with its type and message."""
    try:
        loads(dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def serve(handle) -> None:
    """The child's loop: read a request, answer ``handle(request)`` (or the error it
    raised); end at end of input. Whatever the compilers print goes to stderr: it must not
    corrupt the frames."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    while True:
        data = _read(inp)
        if data is None:
            return
        try:
            reply = ("ok", handle(data))
        except Exception as e:  # sent to the parent, which counts it as the compile's failure
            reply = ("error", _portable(e))
        _write(out, dumps(reply))
