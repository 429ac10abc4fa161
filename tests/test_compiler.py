"""scheduler.compiler: the LRU cache, job sharing, and a compile thread that leaves RNG alone."""

import collections
import threading

import torch

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
    C._guard_user_rng()
    from torch._dynamo import utils

    seen = {}

    def compile_like():
        with utils.preserve_rng_state():
            seen["entered"] = True
            done.wait(10)

    done = threading.Event()
    t = threading.Thread(target=compile_like, name=C._THREAD_NAME)
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
