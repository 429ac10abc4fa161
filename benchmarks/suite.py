"""``python -m benchmarks``: the launch-overhead suite, every mode side by side.

    python -m benchmarks [--device neuron|cpu|cuda] [--workloads a,b] [--modes a,b]
                         [--launch-us 0,10,50] [--repeat N] [--full] [--json PATH]
                         [--plot PATH.png]

How each figure is computed, and why each mode runs in a process of its own:
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings

WORKLOAD_NAMES = ("chain-small", "chain-large", "mlp-train", "llama-train", "llama-train-m",
                  "llama-decode", "adam-many")
FULL_ONLY = ("llama-train-m",)  # the quick suite's five minutes leave it to --full
MODE_NAMES = ("eager", "adaptive", "adaptive-exact", "torch.compile", "torch._lazy", "floor")
DEVICES = ("neuron", "cpu", "cuda")
WARM_STEPS = 20  # the warm-up figures look at the first 20 steps
STEADY_WITHIN = 1.5  # a step is steady when within this factor of the timed median


def _list(p, flag, value, accepted, pattern=None, shown=()):
    """``value`` as a list of accepted names (or names ``pattern`` matches, shown as
    ``shown`` in the error)."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in accepted and not (pattern and pattern.fullmatch(v))]
    if bad or not items:
        p.error(f"{flag} {value!r}: {', '.join(bad) or 'empty'} is not accepted; "
                f"accepted: {', '.join((*accepted, *shown))}")
    return items


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="neuron", help=f"one of {', '.join(DEVICES)} "
                   "(default: neuron, the emulated device when torch-neuronx is absent)")
    p.add_argument("--workloads", default=None,
                   help=f"comma list of {', '.join(WORKLOAD_NAMES)} (default: all; the quick "
                        f"suite leaves out {', '.join(FULL_ONLY)}), or llama-train@<hidden>x"
                        "<layers> (llama-train scaled, hidden divisible by 4)")
    p.add_argument("--modes", default=",".join(MODE_NAMES))
    p.add_argument("--launch-us", default=None,
                   help="emulated launch latencies to sweep, microseconds (neuron only; "
                        "default: 10, and 0,10,50 with --full)")
    p.add_argument("--repeat", type=str, default=None,
                   help="timed rounds per mode and latency (default 5, 10 with --full)")
    p.add_argument("--full", action="store_true",
                   help="more rounds, the 0/10/50 us sweep, and up to 10 minutes of warm-up "
                        "per engine mode for its background compiles (quick: 180 s)")
    p.add_argument("--runs", default="1",
                   help="2: warm start, each workload in two fresh processes sharing one "
                        "warm-start cache (benchmarks.warm_start; cpu and neuron unless "
                        "--device names one)")
    p.add_argument("--json", metavar="PATH", help="write every raw figure and machine info")
    p.add_argument("--plot", metavar="PATH.png",
                   help="draw speedup vs launch latency and warm-up curves (needs matplotlib)")
    p.add_argument("--size", default="issue", choices=("issue", "tiny"),
                   help=argparse.SUPPRESS)  # tiny: the test that keeps the suite from rotting
    p.add_argument("--warmup-s", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--warm-steps", type=int, default=WARM_STEPS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.runs not in ("1", "2"):
        p.error(f"--runs {a.runs!r} is not accepted; accepted: 1, 2")
    a.runs = int(a.runs)
    if a.device not in DEVICES:
        p.error(f"--device {a.device!r} is not accepted; accepted: {', '.join(DEVICES)}")
    from benchmarks.workloads import SIZED, workload

    a.workloads = _list(p, "--workloads", a.workloads or ",".join(
        w for w in WORKLOAD_NAMES if a.full or w not in FULL_ONLY), WORKLOAD_NAMES, SIZED,
        ("llama-train@<hidden>x<layers> (llama-train scaled: llama-train@256x8)",))
    for name in a.workloads:
        try:
            workload(name)
        except ValueError as e:
            p.error(f"--workloads: {e}")
    a.modes = _list(p, "--modes", a.modes, MODE_NAMES)
    if a.launch_us is not None and a.device != "neuron":
        p.error(f"--launch-us {a.launch_us!r} applies to --device neuron only, not {a.device!r}")
    lat = a.launch_us or ("0,10,50" if a.full else "10")
    try:
        a.launch_us = [float(x) for x in lat.split(",")]
        if not a.launch_us or any(x < 0 for x in a.launch_us):
            raise ValueError
    except ValueError:
        p.error(f"--launch-us {lat!r} is not accepted; accepted: a comma list of numbers >= 0 "
                "(microseconds)")
    rep = a.repeat or ("10" if a.full else "5")
    if not rep.isdigit() or int(rep) < 1:
        p.error(f"--repeat {rep!r} is not accepted; accepted: an integer >= 1")
    a.repeat = int(rep)
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install 'adaptive_eager[plot]'")
    if a.warmup_s is None:
        # A fresh machine compiles every graph cold: llama-train's two graphs on neuron took
        # 40-53 s on an idle 2-core machine (one run each wrapper), longer beside other work;
        # a 45 s cap reported that workload with its graphs still compiling.
        a.warmup_s = 600.0 if a.full else 180.0
    return a


# ------------------------------------------------------------------------------ counters

class _OpCounter:
    """Counts the aten ops of one step (all of them, and those that are not views)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args, kwargs=None):
                counter.ops += 1
                counter.kernels += not func.is_view
                return func(*args, **(kwargs or {}))

        self.ops = self.kernels = 0
        self.mode = Count()


def _launches(device, run):
    """A function returning the launch counter this run's launches are read from, or None
    where the suite has none (torch.compile and torch._lazy off the emulated device)."""
    if device == "neuron":
        import adaptive_eager.neuron as neuron

        return lambda: neuron.counters().launches
    import adaptive_eager as ae

    if run.engine:
        return lambda: ae.stats().launches
    if run.floor is not None:
        return lambda: run.floor.misses
    return None


# -------------------------------------------------------------------------------- running

def _progress(msg):
    if sys.stderr.isatty():  # one line, rewritten
        print(f"\r\033[K{msg}", end="", file=sys.stderr, flush=True)
    elif msg.endswith("warm-up") or not msg:
        print(msg, file=sys.stderr, flush=True)


def _warm(run, steps, cap_s):
    """Steps until warm: ``steps`` steps, and for the engine until its background
    compiles are done and installed (at most ``cap_s`` seconds). Returns step times and
    whether compiles were still running at the cap."""
    from adaptive_eager.engine import ENGINE

    times, start, extra = [], time.perf_counter(), None
    with run.active():
        while True:
            t0 = time.perf_counter()
            run.step()
            times.append(time.perf_counter() - t0)
            if len(times) < steps:
                continue
            if not run.compiles:
                return times, False
            if ENGINE.compiler.pending() == 0:
                extra = 3 if extra is None else extra - 1  # let installed graphs run
                if extra == 0:
                    return times, False
            elif time.perf_counter() - start > cap_s:
                return times, True


def _timed(run, n, launches):
    """One timed round of ``n`` steps (torch.utils.benchmark's Timer, which adds its own
    warm-up calls): its Measurement and the launches per step over every call it made.

    The timer is the plain clock: every step ends at its own sync point, and the Timer's
    default would call ``torch.accelerator.synchronize()``, which a device registered from
    Python cannot serve (its device guard has no synchronize hook)."""
    from torch.utils.benchmark import Timer

    calls = [0]

    def step():
        calls[0] += 1
        return run.step()

    with run.active():
        c0 = launches() if launches else None
        m = Timer("step()", globals={"step": step}, timer=time.perf_counter,
                  num_threads=torch_threads()).timeit(n)
        c1 = launches() if launches else None
    return m, (None if c0 is None else (c1 - c0) / calls[0])


def torch_threads():
    import torch

    return torch.get_num_threads()


class ModeFailed(Exception):
    """A call in a mode's process raised: its one line, and the traceback it printed there."""

    def __init__(self, line: str, remote_traceback: str):
        super().__init__(line)
        self.remote_traceback = remote_traceback


class _OwnProcess:
    """One mode's process: it builds the mode's run and serves the suite's calls on it, on
    its main thread, as a user's script runs (PyTorch's intra-op thread team belongs to the
    calling thread: on any other thread eager ran about 2x slower on cpu). One mode per
    process also keeps the engines of ``adaptive`` and ``adaptive-exact`` apart. The process
    starts fresh (spawn), and lives for every workload of the run."""

    def __init__(self, mode: str, device: str):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, mode, device), daemon=True,
                                 name=f"benchmarks-{mode}")
        self._proc.start()
        child.close()

    def __call__(self, call: str, *args):
        from benchmarks.modes import NotApplicable

        try:
            self._conn.send((call, args))
            ok, got = self._conn.recv()
        except (EOFError, OSError) as e:
            raise ModeFailed(f"the mode's process died (exit code {self._proc.exitcode})",
                             "") from e
        if ok:
            return got
        kind, line, tb = got
        if kind == "NotApplicable":
            raise NotApplicable(line)
        raise ModeFailed(f"{kind}: {line}", tb)

    def close(self):
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()


def _serve(conn, mode: str, device: str) -> None:
    """A mode process's main loop: (call name, args) in, (ok, result) out, until None."""
    warnings.filterwarnings("ignore")
    import adaptive_eager as ae
    from benchmarks.modes import MODES
    from benchmarks.workloads import workload

    if device == "neuron":
        import adaptive_eager.neuron as neuron

        neuron.ensure()  # before any workload names the device
    state = {}

    def build(name, size):
        ae.reset()  # the previous workload's paths and graphs are not this one's
        state.pop("run", None)
        run = state["run"] = MODES[mode].build(workload(name), device, size)
        import threading

        return dict(compiles=run.compiles, note=run.note, pid=os.getpid(),
                    main_thread=threading.current_thread() is threading.main_thread())

    calls = {
        "build": build,
        "count_ops": lambda: _count_ops(state["run"]),
        "warm": lambda steps, cap_s: _warm(state["run"], steps, cap_s),
        "timed": lambda n: _timed_mean(state["run"], n, device),
        "floor_misses": lambda: state["run"].floor.misses if state["run"].floor else None,
        "peak": lambda: peak_step_bytes(state["run"], device),
        "settle": lambda: _settle(state["run"], device),
        "latency": lambda us: _latency_setter(device)(us),
    }
    while True:
        msg = conn.recv()
        if msg is None:
            return
        call, args = msg
        try:
            conn.send((True, calls[call](*args)))
        except BaseException as e:  # noqa: BLE001 -- reported in the parent's table
            conn.send((False, (type(e).__name__, str(e).splitlines()[0] if str(e) else "",
                               "".join(traceback.format_exception(e)))))


def _timed_mean(run, n, device):
    m, per = _timed(run, n, _launches(device, run))
    return m.mean, per


def run_workload(name, a, results, log, procs):
    from benchmarks.modes import NotApplicable

    runs, rows = {}, []

    def failed(mode, e):
        tb = e.remote_traceback if isinstance(e, ModeFailed) else "".join(
            traceback.format_exception(e))
        results["failed"].append(dict(workload=name, mode=mode, error=_one_line(e),
                                      traceback=tb))
        runs.pop(mode, None)

    for mode in a.modes:
        if mode in results["not_applicable"]:
            continue
        try:
            runs[mode] = procs[mode]("build", name, a.size)
        except NotApplicable as e:
            results["not_applicable"].setdefault(mode, str(e))
        except Exception as e:  # noqa: BLE001 -- reported in the table, the suite goes on
            failed(mode, e)
    ops = kernels = None
    if "eager" in runs:  # the program's ops per step, counted once in eager
        try:
            ops, kernels = procs["eager"]("count_ops")
        except Exception as e:  # noqa: BLE001
            failed("eager", e)

    def set_latency(us):
        for mode in runs:
            procs[mode]("latency", us)

    set_latency(a.launch_us[0])
    warm, capped = {}, {}
    # Modes that compile in the background warm up last: their compiles would slow the other
    # modes' warm-up steps, and the timed rounds start once they are done (or capped).
    for mode, run in sorted(runs.items(), key=lambda kv: kv[1]["compiles"]):
        log(f"{name}: {mode} warm-up")
        try:
            warm[mode], capped[mode] = procs[mode]("warm", a.warm_steps, a.warmup_s)
        except Exception as e:  # noqa: BLE001
            failed(mode, e)
    # Steps per timed round: about 0.2 s of eager (at least 1).
    ref = statistics.median(warm.get("eager", next(iter(warm.values()), [0.01]))[-5:])
    n = 1 if a.size == "tiny" else max(1, min(200, int(0.2 / max(ref, 1e-6))))
    for lat in (a.launch_us if a.device == "neuron" else [None]):
        if lat is not None:
            set_latency(lat)
        samples = {m: [] for m in runs}
        launch = {m: [] for m in runs}
        for r in range(a.repeat):  # interleaved: every mode sees the same machine state
            for mode in list(runs):
                log(f"{name}: timing round {r + 1}/{a.repeat}"
                    + ("" if lat is None else f" at {lat:g} us"))
                try:
                    mean, per = procs[mode]("timed", n)
                except Exception as e:  # noqa: BLE001
                    failed(mode, e)
                    continue
                samples[mode].append(mean)
                launch[mode].append(per)
        for mode, run in runs.items():
            t = samples[mode]
            med = statistics.median(t)
            q = statistics.quantiles(t, n=4) if len(t) > 1 else [med, med, med]
            per = launch[mode]
            if mode == "eager" and a.device != "neuron":
                launches = float(kernels)  # on cpu/cuda each eager kernel op is a launch
            elif per and per[0] is not None:
                launches = statistics.median(per)
            else:
                launches = None
            rows.append(dict(
                workload=name, mode=mode, device=a.device, launch_us=lat, step_s=med,
                iqr_s=q[2] - q[0], rounds_s=t, steps_per_round=n, launches=launches,
                ops=ops, warm_s=warm[mode], compiles_capped=capped[mode],
                floor_misses=procs[mode]("floor_misses"), note=run["note"], pid=run["pid"],
                main_thread=run["main_thread"]))
    peak = {}
    for mode in runs:  # one more hot step each, under the memory probe
        try:
            peak[mode] = procs[mode]("peak")
        except Exception as e:  # noqa: BLE001
            failed(mode, e)
    for row in rows:
        row["peak_bytes"] = peak.get(row["mode"])
    for mode in runs:  # leave nothing queued or deferred behind
        procs[mode]("settle")
    return rows


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for the block (C++ prints bypass ``sys.stderr``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_step_bytes(run, device):
    """Peak memory of one step: the most bytes held at once during the step beyond what was
    held when it started (parameters, optimizer state and the inputs are not counted; what the
    step allocates, its graphs' buffers included, is).

    cuda and the C++ neuron device: the device allocator's peak statistic. cpu and the Python
    neuron emulator (whose memory is CPU memory): every allocation and free the CPU allocator reports to
    ``torch.profiler`` with ``profile_memory=True``, summed in time order."""
    import torch
    from benchmarks.workloads import sync

    with run.active():
        sync(device)
        if device == "cuda" or (device == "neuron" and _native_neuron()):
            acc = torch.accelerator
            base = acc.memory_allocated()
            acc.reset_peak_memory_stats()
            run.step()
            sync(device)
            return acc.max_memory_allocated() - base
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():  # the profiler's C++ side prints on start and stop
            prof.start()
        try:
            run.step()
            sync(device)
        finally:
            with _quiet_stderr():
                prof.stop()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = most = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        most = max(most, held)
    return most


def _native_neuron():
    import adaptive_eager.neuron as neuron

    return neuron.is_native()


def _count_ops(run):
    run.step()
    c = _OpCounter()
    with c.mode:
        run.step()
    return c.ops, c.kernels


def _settle(run, device):
    from benchmarks.workloads import sync

    with run.active():
        sync(device)


def _latency_setter(device):
    if device != "neuron":
        return lambda us: None
    import adaptive_eager.neuron as neuron

    neuron.ensure()
    return neuron.set_launch_latency_us


def _one_line(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def derive(rows):
    """Speedup vs eager, ratio to the floor and the warm-up figures, per row."""
    key = lambda r: (r["workload"], r["launch_us"])  # noqa: E731
    eager = {key(r): r for r in rows if r["mode"] == "eager"}
    floor = {key(r): r for r in rows if r["mode"] == "floor"}
    for r in rows:
        e, f = eager.get(key(r)), floor.get(key(r))
        r["speedup"] = e["step_s"] / r["step_s"] if e else None
        r["x_floor"] = r["step_s"] / f["step_s"] if f else None
        first = r["warm_s"][:WARM_STEPS]
        r["first_step_s"] = first[0]
        pe, pr = e and e.get("peak_bytes"), r.get("peak_bytes")
        r["peak_x_eager"] = pr / pe if pe and pr is not None else None
        r["worst_first20_x_eager"] = max(first) / e["step_s"] if e else None
        steady = None
        for k in range(len(r["warm_s"])):
            if all(t <= STEADY_WITHIN * r["step_s"] for t in r["warm_s"][k:]):
                steady = k
                break
        r["steady_after_steps"] = steady
        r["steady_after_s"] = None if steady is None else sum(r["warm_s"][:steady])
    return rows


# ---------------------------------------------------------------------------------- output

def _fmt(v, spec, none="–"):
    return none if v is None else format(v, spec)


def table(rows, results) -> str:
    out = ["| workload | mode | launch µs | ms/step | spread | launches/step | ops/step "
           "| vs eager | ÷ floor | first step ms | worst of first 20 ÷ eager | steady after "
           "| step peak MB (÷ eager) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = r["speedup"]
        verdict = _fmt(speed, ".2f") + ("×" if speed is not None else "")
        if speed is not None and r["mode"] not in ("eager", "floor") and speed < 0.95:
            verdict += " **slower**"
        steady = ("not within warm-up" if r["steady_after_steps"] is None else
                  f"{r['steady_after_steps']} steps, {r['steady_after_s']:.1f} s")
        if r["compiles_capped"]:
            steady += " (compiles still running)"
        out.append(
            f"| {r['workload']} | {r['mode']} | {_fmt(r['launch_us'], 'g')} "
            f"| {r['step_s'] * 1e3:.3f} | ±{100 * r['iqr_s'] / (2 * r['step_s']):.0f}% "
            f"| {_fmt(r['launches'], '.1f')} | {_fmt(r['ops'], 'd')} | {verdict} "
            f"| {_fmt(r['x_floor'], '.2f')} | {r['first_step_s'] * 1e3:.1f} "
            f"| {_fmt(r['worst_first20_x_eager'], '.2f')} | {steady} | {_peak(r)} |")
    for mode, why in results["not_applicable"].items():
        out.append(f"\n{mode}: not run ({why})")
    for f in results["failed"]:
        out.append(f"\n{f['workload']} / {f['mode']}: FAILED ({f['error']})")
    notes = sorted({f"{r['workload']}: {r['note']}" for r in rows if r["note"]})
    if notes:
        out.append("\nmodels: " + "; ".join(notes))
    return "\n".join(out)


def _peak(r) -> str:
    if r.get("peak_bytes") is None:
        return "–"
    mb = f"{r['peak_bytes'] / 2**20:.2f}"
    return mb if r["peak_x_eager"] is None else f"{mb} ({r['peak_x_eager']:.2f}×)"


def headline(rows) -> str:
    """The figures the suite exists for, from whatever rows this run has."""
    by = {(r["workload"], r["mode"], r["launch_us"]): r for r in rows}
    lats = sorted({r["launch_us"] for r in rows if r["launch_us"] is not None})
    out = []
    engine = [m for m in ("adaptive", "adaptive-exact") if any(r["mode"] == m for r in rows)]
    if len(lats) > 1:
        out += ["speedup vs eager by launch latency (µs):", "",
                "| workload | mode | " + " | ".join(f"{x:g} µs" for x in lats) + " |",
                "|---|---|" + "---|" * len(lats)]
        for wl in dict.fromkeys(r["workload"] for r in rows):
            for m in engine:
                cells = [by.get((wl, m, x)) for x in lats]
                out.append(f"| {wl} | {m} | " + " | ".join(
                    _fmt(c and c["speedup"], ".2f") + "×" for c in cells) + " |")
        out.append("")

    def ratio(wl, a, b, lat):
        ra, rb = by.get((wl, a, lat)), by.get((wl, b, lat))
        return None if not (ra and rb) else rb["step_s"] / ra["step_s"]

    lat0 = lats[0] if lats else None
    for m in engine:
        f = ratio("chain-small", "floor", m, lat0)
        if f is not None:
            out.append(f"hot path ÷ floor, chain-small, {m}: {f:.2f}× the floor's time per "
                       "step (its host cost per op against the lowest possible)")
    for wl, others in (("chain-small", ("torch._lazy",)),
                       ("chain-large", ("eager", "torch.compile", "torch._lazy"))):
        for other in others:
            x = ratio(wl, "adaptive", other, lat0)  # other's time / adaptive's
            if x is not None:
                out.append(f"{wl}: adaptive is {x:.2f}× faster than {other}" if x >= 1 else
                           f"{wl}: adaptive takes {1 / x:.2f}× {other}'s time")
    for r in rows:
        if r["launch_us"] == lat0 and r["mode"] == "adaptive" and r["peak_x_eager"]:
            out.append(f"peak memory of a hot step, {r['workload']}: adaptive "
                       f"{r['peak_bytes'] / 2**20:.2f} MB, {r['peak_x_eager']:.2f}× eager's")
    for r in rows:
        if r["launch_us"] == lat0 and r["mode"] == "torch.compile":
            out.append(f"torch.compile first step, {r['workload']}: {r['first_step_s']:.1f} s")
    return "\n".join(out)


def machine_info(argv) -> dict:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python -m benchmarks " + " ".join(argv), torch=torch.__version__,
        python=platform.python_version(), cpu=cpu, cores=os.cpu_count(),
        threads=torch.get_num_threads(), platform=platform.platform(),
        env={k: v for k, v in os.environ.items()
             if k.startswith(("NEURON_", "TORCH", "OMP_", "MKL_"))})


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    colour = {w: f"C{i}" for i, w in enumerate(workloads)}
    style = {"adaptive": "-", "adaptive-exact": "--", "torch.compile": ":", "torch._lazy": "-."}
    for (wl, mode) in dict.fromkeys((r["workload"], r["mode"]) for r in rows):
        if mode not in style:
            continue
        kw = dict(color=colour[wl], ls=style[mode], label=f"{wl} / {mode}")
        pts = sorted((r["launch_us"], r["speedup"]) for r in rows
                     if r["workload"] == wl and r["mode"] == mode
                     and r["launch_us"] is not None and r["speedup"])
        if len(pts) > 1:
            ax1.plot(*zip(*pts), marker="o", **kw)
        first = next(r for r in rows if r["workload"] == wl and r["mode"] == mode)
        eager = next((r for r in rows if r["workload"] == wl and r["mode"] == "eager"), None)
        if eager:  # step time against the wall time since the first step
            t = list(itertools.accumulate(first["warm_s"]))
            ax2.plot(t, [x / eager["step_s"] for x in first["warm_s"]], **kw)
    ax1.set(xlabel="launch latency (µs)", ylabel="speedup vs eager",
            title="speedup vs launch latency (neuron)")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax2.set(xlabel="seconds since the first step", ylabel="step time ÷ eager median",
            xscale="symlog", yscale="log", title="warm-up")
    ax2.axhline(1.0, color="grey", lw=0.8)
    for ax in (ax1, ax2):
        if ax.lines[1:]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _warm_start(a, argv) -> int:
    """``--runs 2``: the warm-start table (benchmarks.warm_start) for the workloads asked."""
    from benchmarks import warm_start

    if a.device not in ("cpu", "neuron"):
        print(f"python -m benchmarks: --runs 2 measures cpu and neuron, not {a.device!r}",
              file=sys.stderr)
        return 2
    explicit = any(x == "--device" or x.startswith("--device=") for x in argv)
    workloads = [w for w in warm_start.WORKLOADS if w in a.workloads]
    if not workloads:
        print(f"python -m benchmarks: --runs 2 measures {', '.join(warm_start.WORKLOADS)}",
              file=sys.stderr)
        return 2
    return warm_start.main(["--workloads", ",".join(workloads),
                            "--devices", a.device if explicit else "cpu,neuron",
                            "--launch-us", f"{a.launch_us[0]:g}"])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.runs == 2:
        return _warm_start(a, argv)
    warnings.filterwarnings("ignore")
    # The engine's hot path is what is measured: its step governor (which steps aside where
    # it measures itself slower than eager) is off, so where it loses, the table shows it.
    os.environ.setdefault("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "0")
    # Likewise the retirement of fused graphs timed slower than the eager segments they
    # replace: its eager timings come from the warm-up, at the first launch latency, and a
    # sweep to a higher latency made it retire a faster graph (mlp-train at 50 us, once).
    os.environ.setdefault("NEURON_ADAPTIVE_EAGER_RETIRE_RATIO", "0")
    # A fresh Inductor cache: compile and warm-up times are a new user's, not a rerun's.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="ae_bench_"))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("python -m benchmarks: --device cuda but no CUDA device is available",
              file=sys.stderr)
        return 2
    if a.device == "neuron":
        import adaptive_eager.neuron as neuron

        neuron.ensure()  # before any workload names the device
    info = machine_info(argv)
    print(f"adaptive_eager benchmark suite: device {a.device}, torch {info['torch']}, "
          f"{info['threads']} threads, {info['cpu']}", flush=True)
    results = dict(machine=info, rows=[], not_applicable={}, failed=[])
    t0 = time.perf_counter()
    procs = {mode: _OwnProcess(mode, a.device) for mode in a.modes}  # they start side by side
    try:
        for i, wl in enumerate(a.workloads):
            def log(msg, i=i):
                _progress(f"[{i + 1}/{len(a.workloads)} {time.perf_counter() - t0:5.0f} s] "
                          f"{msg}")

            results["rows"] += run_workload(wl, a, results, log, procs)
    finally:
        for p in procs.values():
            p.close()
    _progress("")
    derive(results["rows"])
    print(table(results["rows"], results))
    lines = headline(results["rows"])
    if lines:
        print("\n" + lines)
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"raw figures: {a.json}")
    if a.plot:
        plot(results["rows"], a.plot)
        print(f"plot: {a.plot}")
    return 1 if results["failed"] else 0
