"""Fused compiles run in a child process (Note [Compiles leave the process])."""

import os
import pathlib
import threading

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.scheduler import compile_process
from conftest import Delta, wait_compiles

IND = dict(devices=("cpu",), backend="inductor")


def chain(x, a=1.5):
    for _ in range(3):
        x = x * a
        x = x - 0.25
    return x


def hot(fn, runs=3):
    for _ in range(runs):
        fn()
    wait_compiles()
    fn()


def test_the_graph_is_compiled_in_the_child_and_replays_here():
    x = torch.randn(48)
    ref = chain(x).sum().item()
    with ae.enabled(**IND):
        d = Delta()
        hot(lambda: chain(x).sum().item())
        assert d.graphs_compiled == 1
        child = compile_process.shared()
        assert child.pid is not None and child.pid != os.getpid()
        d = Delta()
        got = [chain(x).sum().item() for _ in range(3)]
        assert d.cache_hits == 3 and d.launches == 6
    assert got == pytest.approx([ref] * 3, rel=1e-5)


def test_ops_travel_by_name():
    ops = [torch.ops.aten.add.Tensor, torch.ops.aten.sum.default, torch.ops.prims.iota.default]
    assert compile_process.loads(compile_process.dumps(ops)) == ops


_SPAWNED_DUMPS = """
import sys, torch
from adaptive_eager.scheduler import compile_process

def child(rank, path):
    with open(path, "wb") as f:
        f.write(compile_process.dumps([torch.preserve_format, torch.channels_last,
                                       torch.strided, torch.bfloat16]))

if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(child, args=(sys.argv[1],), nprocs=1)
"""


def test_dtypes_layouts_and_memory_formats_travel_by_name(tmp_path):
    # A memory format pickled as a global of whichever loaded module reached it first: in a
    # process started by torch.multiprocessing.spawn, the program's own ``__mp_main__``,
    # which the compile child does not have (every compile of an op taking memory_format
    # failed there).
    import subprocess
    import sys

    script, out = tmp_path / "spawned.py", tmp_path / "request.bin"
    script.write_text(_SPAWNED_DUMPS)
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, str(script), str(out)], env=env, check=True, timeout=120)
    data = out.read_bytes()
    assert b"__main__" not in data and b"__mp_main__" not in data
    got = compile_process.loads(data)
    assert got == [torch.preserve_format, torch.channels_last, torch.strided, torch.bfloat16]


def test_a_compile_in_the_child_leaves_this_process_tracing_state_alone():
    """make_fx sets torch.fx's process-wide tracing flag: while it was set on the compiler
    thread, a torch.compile'd function on any other thread raised."""
    compiled = torch.compile(lambda t: t * 2 + 1, backend="eager")
    y = torch.randn(8)
    compiled(y)
    engine_compiler = ae._engine().compiler
    calls, errors = [], []

    def user_thread():  # another thread of the user's program, not under the engine
        while engine_compiler.pending():
            try:
                assert not torch.fx._symbolic_trace.is_fx_tracing()
                torch.testing.assert_close(compiled(y), y * 2 + 1)
                calls.append(1)
            except Exception as e:
                errors.append(e)
                return

    x = torch.randn(40)
    with ae.enabled(**IND):
        for _ in range(3):
            chain(x, 1.75).sum().item()
        assert engine_compiler.pending()
        other = threading.Thread(target=user_thread)
        other.start()
        wait_compiles()
        other.join()
    assert not errors and calls


def test_a_child_that_dies_fails_that_compile_and_the_next_one_starts_a_new_child():
    x = torch.randn(56)
    ref = chain(x, 1.125).sum().item()
    child = compile_process.shared()
    stop = threading.Event()

    def kill_the_child_once_it_compiles():
        while not stop.is_set():
            pid = child.pid
            if pid is not None and ae._engine().compiler.pending():
                child.close()
                return
            stop.wait(0.001)

    killer = threading.Thread(target=kill_the_child_once_it_compiles)
    killer.start()
    try:
        with ae.enabled(**IND):
            got = [chain(x, 1.125).sum().item() for _ in range(3)]
            wait_compiles()
            got += [chain(x, 1.125).sum().item() for _ in range(2)]
            fallbacks = ae.stats().fallbacks
    finally:
        stop.set()
        killer.join()
    assert got == [ref] * 5  # the path kept its exact replay: bitwise
    died = [r for r in fallbacks if r.startswith("compile failed: CompileProcessError")]
    assert died and "the compile process died" in died[0]
    assert fallbacks["no fused graph (its compile failed): replayed exactly"] >= 1
    # A later compile is served by a new child.
    started = child.started
    z = torch.randn(72)  # another path (this one's failed compile is not retried)
    with ae.enabled(**IND):
        d = Delta()
        hot(lambda: chain(z, 0.875).sum().item())
        assert d.graphs_compiled == 1, d.fallbacks
    assert child.started == started + 1


def test_a_request_the_child_cannot_serve_raises_its_error_here_and_the_child_lives_on():
    """Errors travel back with their type and message (here: an op only this process has;
    paths hold aten and prims ops only, ops of other libraries being segment boundaries)."""
    lib = torch.library.Library("ae_only_here", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    op = torch.ops.ae_only_here.twice.default
    child = compile_process.shared()
    with pytest.raises(AttributeError, match="ae_only_here"):
        child.request(compile_process.pack((op,)))
    pid = child.pid
    with pytest.raises(TypeError):  # a malformed request: the child answers and lives on
        child.request(compile_process.pack((1, 2)))
    assert child.pid == pid is not None


def test_inductors_fx_graph_cache_serves_the_engines_graphs(monkeypatch):
    """A graph the engine compiles goes through Inductor's FX graph cache (looked up, stored
    on a miss), so that a later process compiling it again is served from the cache; without
    a shape environment in the trace Inductor bypassed its cache (scheduler.backends.trace)."""
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_COMPILE_PROCESS", "0")
    from torch._dynamo.utils import counters

    fx = counters["inductor"]
    before = dict(fx)
    x = torch.randn(24)
    ae.reset()
    with ae.enabled(**IND):
        hot(lambda: chain(x, 0.375).sum().item())
        assert ae.stats().graphs_compiled == 1
    looked_up = sum(fx[k] - before.get(k, 0)
                    for k in ("fxgraph_cache_hit", "fxgraph_cache_miss"))
    assert fx["fxgraph_cache_bypass"] == before.get("fxgraph_cache_bypass", 0), dict(fx)
    assert looked_up >= 1, dict(fx)


def test_compile_process_off_compiles_on_the_thread(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_COMPILE_PROCESS", "0")
    from adaptive_eager.scheduler import backends

    calls = []
    monkeypatch.setitem(backends.BACKENDS, "inductor-process",
                        lambda *a: calls.append(a) or pytest.fail("compiled in the child"))
    x = torch.randn(40)
    ref = chain(x, 0.625).sum().item()
    with ae.enabled(**IND):
        hot(lambda: chain(x, 0.625).sum().item())
        assert ae.stats().graphs_compiled == 1
        got = chain(x, 0.625).sum().item()
    assert not calls and got == pytest.approx(ref, rel=1e-5)


def test_a_forked_process_starts_its_own_child():
    """A fork (a DataLoader worker) inherits the parent's pipes: sharing them would mix two
    processes' requests. The forked copy starts a child of its own."""
    child = compile_process.shared()
    with pytest.raises(TypeError):
        child.request(compile_process.pack((1, 2)))  # make sure the parent has a child
    parent_child = child.pid
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forked process
        code = 1
        try:
            try:
                child.request(compile_process.pack((1, 2)))
            except TypeError:
                code = 0 if child.pid not in (None, parent_child) else 2
            os.write(write, bytes([code]))
        finally:
            child.close()
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"\x00"
    assert child.pid == parent_child  # the parent's child is untouched ...
    with pytest.raises(TypeError):
        child.request(compile_process.pack((1, 2)))  # ... and still serves the parent


def test_the_child_starts_when_a_path_is_first_learned_before_any_compile(monkeypatch):
    """Its start-up (importing torch) overlaps with the steps before the first compile,
    instead of landing on the step that requests it."""
    child = compile_process.shared()
    child.close()
    monkeypatch.setattr(compile_process, "_PREPARED", False)
    x = torch.randn(32)
    with ae.enabled(devices=("cpu",), backend="exact"):
        chain(x, 1.5).sum().item()
    assert child.pid is None  # the exact backend compiles nothing
    with ae.enabled(**IND):
        chain(x, 1.5).sum().item()  # seen once: learned, nothing to compile yet
        assert ae._engine().compiler.pending() == 0
        assert child.pid is not None


@pytest.mark.parametrize("can_raise", [True, False])
def test_a_starved_child_is_raised_to_this_process_priority(monkeypatch, can_raise):
    """Note [Starved compiles]: a child that gets under STARVED_SHARE of a core while a
    request waits is raised (setpriority) or, where the system refuses, replaced by a child
    at this process's priority; either way it goes back to nice 19 once it has answered."""
    monkeypatch.setattr(compile_process, "STARVED_S", 0.05)
    monkeypatch.setattr(compile_process, "_cpu_seconds", lambda pid: 0.0)  # never progresses
    renice = compile_process._renice
    raised = []

    def fake_renice(pid, nice):  # raising a priority needs privileges: simulated both ways
        if nice < compile_process.LOW:
            raised.append(pid)
            return can_raise
        return renice(pid, nice)  # lowering it is always allowed

    monkeypatch.setattr(compile_process, "_renice", fake_renice)
    child = compile_process.CompileProcess()
    try:
        # A request the child answers with an error at once (inductor_artifact's arguments
        # missing): the wait before it is the child's start-up, at nice 19.
        with pytest.raises(TypeError):
            child.request(compile_process.pack(()))
        assert child.escalated == 1
        assert len(raised) == 1 and child.started == (1 if can_raise else 2)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == compile_process.LOW
        if hasattr(os, "SCHED_IDLE"):  # and back in the idle class
            assert os.sched_getscheduler(child.pid) == os.SCHED_IDLE
    finally:
        child.close()


def test_a_request_right_after_a_starved_one_starts_raised(monkeypatch):
    """Note [Starved compiles]: the compiles of a step's paths queue one behind the other;
    once one starved, the next is sent at this process's priority instead of starving for
    STARVED_S again; long after, a request starts low again."""
    monkeypatch.setattr(compile_process, "STARVED_S", 0.05)
    monkeypatch.setattr(compile_process, "_cpu_seconds", lambda pid: 0.0)  # never progresses
    renice = compile_process._renice
    raised = []

    def fake_renice(pid, nice):
        if nice < compile_process.LOW:
            raised.append(pid)
        return renice(pid, nice) if nice >= compile_process.LOW else True

    monkeypatch.setattr(compile_process, "_renice", fake_renice)
    child = compile_process.CompileProcess()
    try:
        with pytest.raises(TypeError):  # answered with an error at once, after starving
            child.request(compile_process.pack(()))
        assert child.escalated == 1 and child.raised_at_once == 0
        monkeypatch.setattr(compile_process, "STARVED_S", 60.0)  # it would not be found now
        with pytest.raises(TypeError):
            child.request(compile_process.pack(()))
        assert child.escalated == 2 and child.raised_at_once == 1 and len(raised) == 2
        monkeypatch.setattr(compile_process, "STARVED_RECENT_S", 0.0)  # long after
        with pytest.raises(TypeError):
            child.request(compile_process.pack(()))
        assert child.escalated == 2 and len(raised) == 2
    finally:
        child.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no idle scheduling class here")
def test_the_child_idles_in_the_idle_class_and_leaves_it_when_raised():
    child = compile_process.CompileProcess()
    proc = child._start()
    try:
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == compile_process.LOW
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        if compile_process._renice(proc.pid, mine):  # where the system lets it be raised
            assert os.sched_getscheduler(proc.pid) == os.SCHED_OTHER
            assert os.getpriority(os.PRIO_PROCESS, proc.pid) == mine
        assert compile_process._renice(proc.pid, compile_process.LOW)
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no idle scheduling class here")
def test_a_child_raised_before_its_first_line_stays_raised():
    """Note [A child born low]: on busy cores a starved child can be raised before it has run
    a line; born low, it has no lines of its own that lower it again (it did, and starved)."""
    child = compile_process.CompileProcess()
    proc = child._start()
    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        if not compile_process._renice(proc.pid, mine):  # as a starved request raises it
            pytest.skip("this system does not let a process raise its child's priority")
        child._proc = proc
        with pytest.raises(TypeError):  # answered: its program has run its first lines
            child.request(compile_process.pack(()))
        assert os.sched_getscheduler(proc.pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == mine
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no idle scheduling class here")
def test_the_child_is_born_low_and_this_thread_keeps_its_priority():
    """Note [A child born low]: the child's first instruction already runs at the lowest
    priority (the parent lowering it after the start, or its own first line, come late)."""
    import subprocess
    import sys

    mine = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    argv = [sys.executable, "-S", "-c",
            "import os; print(os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))"]
    proc = compile_process._born_low(argv, dict(os.environ))
    out, _ = proc.communicate(timeout=60)
    assert out.decode().split() == [str(os.SCHED_IDLE), str(compile_process.LOW)]
    assert (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)) == mine


@pytest.mark.skipif(not (hasattr(os, "SCHED_IDLE") and os.path.exists("/proc/self/task")),
                    reason="no idle scheduling class or /proc here")
def test_the_processes_the_child_started_count_and_are_raised_with_it():
    """Note [Starved compiles]: a compiler the child runs inherits its idle class; its CPU
    time is the compile's, and raising the child raises it too."""
    import subprocess
    import sys
    import time

    # a child at low priority whose own child burns CPU (as a C++ compiler would)
    burn = "import time\nt = time.time()\nwhile time.time() - t < 30: pass"
    code = ("import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', {burn!r}])\n"
            "time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert compile_process._renice(proc.pid, compile_process.LOW)
        deadline = time.monotonic() + 20
        while len(compile_process._tree(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = compile_process._tree(proc.pid)
        assert len(tree) == 2 and tree[0] == proc.pid
        grandchild = tree[1]
        assert os.sched_getscheduler(grandchild) == os.SCHED_IDLE  # inherited
        own = compile_process._cpu_seconds(proc.pid)
        time.sleep(1.0)
        with open(f"/proc/{grandchild}/stat", "rb") as f:  # the burner's own time alone
            burned = sum(int(x) for x in f.read().rsplit(b")", 1)[1].split()[11:13])
        if burned:  # it has run (an idle class may leave it no core on a busy machine)
            assert compile_process._cpu_seconds(proc.pid) > own
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        if compile_process._renice(proc.pid, mine):  # where the system lets it be raised
            assert os.sched_getscheduler(grandchild) == os.SCHED_OTHER
            assert os.getpriority(os.PRIO_PROCESS, grandchild) == mine
    finally:
        for p in reversed(compile_process._tree(proc.pid)):
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
        proc.wait()


def test_a_child_that_progresses_is_left_at_low_priority(monkeypatch):
    monkeypatch.setattr(compile_process, "STARVED_S", 0.05)
    ticks = iter(range(10**6))
    monkeypatch.setattr(compile_process, "_cpu_seconds", lambda pid: float(next(ticks)))
    child = compile_process.CompileProcess()
    try:
        with pytest.raises(TypeError):
            child.request(compile_process.pack(()))
        assert child.escalated == 0 and child.started == 1
    finally:
        child.close()


@pytest.mark.parametrize("device, where", [("cpu", "inductor-process"),
                                           ("cuda", "inductor-process"),
                                           ("meta", "inductor")])
def test_which_graphs_compile_in_the_child(monkeypatch, device, where):
    from adaptive_eager.scheduler import backends
    from adaptive_eager.scheduler.program import Meta

    went = []
    for name in ("inductor", "inductor-process"):
        monkeypatch.setitem(backends.BACKENDS, name, lambda *a, _n=name: went.append(_n))
    meta = Meta((4,), (1,), 0, torch.float32, torch.device(device), 4)
    backends.compile_graph("inductor", [], [meta], {}, None, (), process=True)
    backends.compile_graph("inductor", [], [meta], {}, None, (), process=False)
    assert went == [where, "inductor"]
