"""Shared fixtures: one Inductor cache for the session, a clean engine per test, count helpers."""

from __future__ import annotations

import atexit
import faulthandler
import os
import shutil
import tempfile
import threading

# Before torch._inductor is imported anywhere: compiled kernels are shared by every test.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "adaptive_eager_test_inductor")
)
for _name in [n for n in os.environ if n.startswith("NEURON_ADAPTIVE_EAGER")]:
    del os.environ[_name]  # tests configure the engine explicitly
# ... except the hot path's form, which the whole suite can be run under:
# ADAPTIVE_EAGER_TEST_HOT_PATH=cpp python -m pytest tests (stage 1; Note [Below the floor])
if os.environ.get("ADAPTIVE_EAGER_TEST_HOT_PATH"):
    os.environ["NEURON_ADAPTIVE_EAGER_HOT_PATH"] = os.environ["ADAPTIVE_EAGER_TEST_HOT_PATH"]
# Two decisions are taken from wall-clock timings: the step governor (Note [Stepping aside])
# and the retirement of fused graphs measured slower than eager. Both are off in tests that
# count launches and cache hits (a loaded CI machine made a fused graph look slow); the tests
# of those decisions turn them on with ratios that fix the outcome.
# Inductor's Python wrapper: the C++ one costs a libtorch compile per graph, too slow for the
# suite's hundreds of cold graphs (Note [C++ wrappers]); its tests turn it on themselves
os.environ["NEURON_ADAPTIVE_EAGER_CPP_WRAPPER"] = "0"
os.environ["NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO"] = "0"
os.environ["NEURON_ADAPTIVE_EAGER_RETIRE_RATIO"] = "0"
# Every test learns from nothing: what one run kept (Note [Warm start]) must not make another
# run's counts differ. The warm-start tests turn it on with a directory of their own.
os.environ["NEURON_ADAPTIVE_EAGER_WARM_START"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402

import adaptive_eager as ae  # noqa: E402


# Note [A test that hangs]: a test that never returns (a deadlock between the host and the
# device's queue, a wait on a child that never answers) would hold the suite until CI's own
# limit ends it, leaving no word of where it hung. Each test runs under faulthandler's
# watchdog: past TEST_LIMIT_S it writes every thread's Python stack to the real stderr and
# ends the run (exit 1), so the log's tail names the test and the line it waited on. The
# watchdog is a C thread: it fires even when the hung thread holds the interpreter lock.
TEST_LIMIT_S = float(os.environ.get("ADAPTIVE_EAGER_TEST_LIMIT_S", "900"))


_STDERR = pytest.StashKey[int]()


def pytest_configure(config):
    # fd 2 before pytest redirects it around each test (a dump there would be captured, lost)
    config.stash[_STDERR] = os.dup(2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if TEST_LIMIT_S <= 0:
        yield
        return
    fd = item.config.stash[_STDERR]
    said = f"\ntests: {item.nodeid} ran past {TEST_LIMIT_S:.0f} s: every thread's stack\n"
    # the test's name, from Python (a hung thread holding the interpreter lock silences this
    # line, never the dump)
    header = threading.Timer(max(TEST_LIMIT_S - 1, 0), os.write, (fd, said.encode()))
    header.daemon = True
    header.start()
    faulthandler.dump_traceback_later(TEST_LIMIT_S, exit=True, file=fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        header.cancel()


@pytest.fixture(autouse=True)
def clean_engine():
    """Every test starts and ends with the engine off and its state cleared."""
    torch.manual_seed(0)
    ae.reset()
    yield
    while ae.is_enabled():
        ae.disable()
    torch.use_deterministic_algorithms(False)
    ae.reset()


class Delta:
    """Counters accumulated since construction: ``d = Delta(); ...; d.launches``."""

    def __init__(self):
        self.start = ae.stats()

    def __getattr__(self, name):
        now = getattr(ae.stats(), name)
        before = getattr(self.start, name)
        if isinstance(now, dict):
            return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}
        return now - before


# A child process (a script the test runs as a user would) starts from this environment less
# the engine's settings. Warm start stays off there too, in a directory of the session's own
# where a test turns it on: children that kept what they learned in the user's cache made a
# later child (`python -c` programs are all one program to the cache) load a graph it
# expected to compile. (XDG_CACHE_HOME stays: the C++ extensions are built under it.)
_CHILD_CACHE = tempfile.mkdtemp(prefix="adaptive_eager_test_cache_")
atexit.register(shutil.rmtree, _CHILD_CACHE, ignore_errors=True)


def child_env(drop: str = "NEURON_ADAPTIVE_EAGER", keep=(), **settings) -> dict:
    """The environment for a child process: this one's without the variables whose names
    start with ``drop`` (except those in ``keep``), warm start off, then ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) or k in keep}
    env.update(NEURON_ADAPTIVE_EAGER_WARM_START="0", NEURON_ADAPTIVE_EAGER_CACHE_DIR=_CHILD_CACHE)
    env.update(settings)
    return env


def wait_compiles():
    from adaptive_eager.engine import ENGINE

    assert ENGINE.wait_compiles(timeout=300), "background compiles did not finish"


def warm(fn, n=3, backend="exact"):
    """Run ``fn`` under the engine until its path is hot; returns the results of each run."""
    out = []
    for _ in range(n):
        out.append(fn())
    if backend != "exact":
        wait_compiles()
    return out


@pytest.fixture
def delta():
    return Delta
