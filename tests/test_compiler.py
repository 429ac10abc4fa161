"""scheduler.compiler: the LRU cache, job sharing; scheduler.compile_thread: a compile thread
that leaves the user's random stream alone."""

import collections
import threading

import torch

from adaptive_eager.scheduler import compile_thread as T
from adaptive_eager.scheduler import compiler as C


def key(n):
    return C.GraphKey(("op",) * n, "inductor", ((), (), ()))


def test_lru_evicts_oldest_and_resizes():
    cache = C.CompileCache(2)
    cache.put(key(1), "a")
    cache.put(key(2), "b")
    assert cache.get(key(1)) == "a"  # now most recent
    cache.put(key(3), "c")
    assert cache.get(key(2)) is None and cache.get(key(1)) == "a"
    cache.resize(1)
    assert len(cache) == 1


def test_equal_keys_share_one_job():
    built = []
    gate = threading.Event()

    def build():
        gate.wait(10)
        built.append(1)
        return "graph"

    comp = C.Compiler(C.CompileCache(4))
    a, b = collections.deque(), collections.deque()
    comp.request(key(5), build, a, "ta")
    comp.request(key(5), build, b, "tb")
    gate.set()
    assert comp.wait_idle(30)
    assert built == [1]
    assert a[0][:3] == ("ta", "graph", None) and b[0][:3] == ("tb", "graph", None)
    inbox = collections.deque()
    comp.request(key(5), build, inbox, "tc")  # cached: delivered at once, not built again
    assert inbox[0] == ("tc", "graph", None, False) and built == [1]
    comp.shutdown()


def test_compile_errors_are_delivered():
    comp = C.Compiler(C.CompileCache(4))
    inbox = collections.deque()

    def fail():
        raise RuntimeError("no kernel for you")

    comp.request(key(7), fail, inbox, "t")
    assert comp.wait_idle(30)
    token, graph, error, _ = inbox[0]
    assert graph is None and isinstance(error, RuntimeError)
    comp.shutdown()


def test_compile_thread_does_not_rewind_the_generator():
    # Note [Compiles must not touch the user's generator]
    T._guard_user_rng()
    from torch._dynamo import utils

    seen = {}

    def compile_like():
        with utils.preserve_rng_state():
            seen["entered"] = True
            done.wait(10)

    done = threading.Event()
    t = threading.Thread(target=compile_like, name=T.THREAD_NAME)
    t.start()
    torch.manual_seed(3)
    torch.rand(4)  # the user's loop draws while the compile runs
    after_draw = torch.get_rng_state()
    done.set()
    t.join()
    assert torch.equal(torch.get_rng_state(), after_draw)
    # other threads keep torch's behaviour
    before = torch.get_rng_state()
    with utils.preserve_rng_state():
        torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)


def test_every_copy_of_the_rng_context_manager_is_guarded():
    """Note [Compiles must not touch the user's generator]: modules that imported
    ``preserve_rng_state`` by name (AOTAutograd's copy runs when Inductor's pattern matcher
    initializes its patterns inside a compile) get the guarded one too."""
    import sys
    import threading
    import types

    from adaptive_eager.scheduler import compile_thread as compiler

    compiler._guard_user_rng()
    probe = types.ModuleType("torch._adaptive_eager_probe")
    probe.preserve_rng_state = compiler._ORIGINAL_PRESERVE  # a copy made before the guard
    sys.modules[probe.__name__] = probe
    try:
        compiler._rebind_copies()
        preserve = probe.preserve_rng_state
    finally:
        del sys.modules[probe.__name__]
    from torch._functorch import aot_autograd

    assert aot_autograd.preserve_rng_state is preserve is compiler._GUARDED_PRESERVE
    torch.manual_seed(7)
    expect = [torch.rand(3), torch.rand(3)]
    entered, drawn = threading.Event(), threading.Event()

    def compile_like():
        with preserve():
            entered.set()
            drawn.wait(10)

    torch.manual_seed(7)
    t = threading.Thread(target=compile_like, name=compiler.THREAD_NAME)
    t.start()
    entered.wait(10)
    first = torch.rand(3)  # the training loop draws while the compile runs
    drawn.set()
    t.join(10)
    second = torch.rand(3)
    assert torch.equal(first, expect[0]) and torch.equal(second, expect[1])


def test_program_ending_during_the_first_compile_exits_quietly():
    """A short program that ends while the compiler thread still imports Inductor: the
    interpreter's shutdown refuses the import's atexit registration, which used to print a
    traceback from the compiler thread after the user's last line."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch, adaptive_eager as ae
        x = torch.randn(256)
        with ae.enabled(devices=("cpu",), backend="inductor"):
            for _ in range(4):
                y = x
                for _ in range(8):
                    y = y * 1.0001 + 0.5
                y.sum().item()
        print("done")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
