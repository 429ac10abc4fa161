"""The emulated device's model: every op a launch, the device clock, streams, events, errors."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import child_env

import adaptive_eager.neuron as neuron

pytestmark = pytest.mark.skipif(not neuron.is_emulated(), reason="torch-neuronx is installed")

DEV = "neuron"


@pytest.fixture(autouse=True)
def device_state():
    neuron.reset_counters()
    neuron.set_launch_latency_us(10)
    yield
    torch.neuron.synchronize()
    neuron.set_launch_latency_us(10)


def launches(fn):
    torch.neuron.synchronize()
    before = neuron.counters().launches
    fn()
    return neuron.counters().launches - before


def test_every_compute_op_is_one_launch_views_and_allocations_none():
    a, b = torch.ones(4, 4, device=DEV), torch.ones(4, 4, device=DEV)
    assert launches(lambda: a + b) == 1
    assert launches(lambda: torch.addmm(a, a, b)) == 1
    assert launches(lambda: (a.t(), a.view(16), a[1:], a.unsqueeze(0), a.detach())) == 0
    assert launches(lambda: (torch.empty(3, device=DEV), torch.empty_like(a))) == 0
    assert launches(lambda: a.add_(1)) == 1
    assert launches(lambda: torch._foreach_mul_([a, b], 2.0)) == 1
    assert launches(lambda: torch.ones(3).to(DEV)) == 1  # host->device copy
    assert launches(lambda: a.cpu()) == 1  # device->host copy


def test_bytes_copied_are_exact():
    torch.neuron.synchronize()
    c0 = neuron.counters()
    x = torch.ones(100, dtype=torch.float32).to(DEV)
    y = torch.ones(7, dtype=torch.float64).to(DEV)
    x.cpu()
    y[:3].cpu()
    c1 = neuron.counters()
    assert c1.bytes_to_device - c0.bytes_to_device == 400 + 56
    assert c1.bytes_to_host - c0.bytes_to_host == 400 + 24


def test_launches_per_stream():
    s = torch.neuron.Stream()
    x = torch.ones(3, device=DEV)
    torch.neuron.synchronize()
    c0 = neuron.counters()
    with torch.neuron.stream(s):
        assert torch.neuron.current_stream() == s
        x * 2
        x * 3
    x * 4
    c1 = neuron.counters()
    assert c1.launches_by_stream.get(s.stream_id, 0) - c0.launches_by_stream.get(s.stream_id, 0) == 2
    assert c1.launches_by_stream[0] - c0.launches_by_stream.get(0, 0) == 1


def test_host_returns_before_the_device_finishes():
    a = torch.randn(800, 800, device=DEV)
    torch.neuron.synchronize()
    t0 = time.perf_counter()
    c = a @ a @ a @ a  # three launches of ~10+ ms each on the worker
    issued = time.perf_counter() - t0
    assert not torch.neuron.current_stream().query()
    torch.neuron.synchronize()
    done = time.perf_counter() - t0
    assert torch.neuron.current_stream().query()
    assert issued < done
    assert c.shape == (800, 800)


@pytest.mark.parametrize("latency_us", [0, 10, 50])
def test_device_clock_models_the_latency(latency_us):
    neuron.set_launch_latency_us(latency_us)
    x = torch.ones(8, device=DEV)
    torch.neuron.synchronize()
    c0 = neuron.counters()
    n = 300
    t0 = time.perf_counter()
    for _ in range(n):
        x = x + 1
    torch.neuron.synchronize()
    wall = time.perf_counter() - t0
    c1 = neuron.counters()
    launched = c1.launches - c0.launches
    busy = c1.busy_s - c0.busy_s
    kernels = c1.kernel_s - c0.kernel_s
    assert launched == n
    # the device's busy time is exactly launches x latency plus the kernels' measured time
    assert busy == pytest.approx(n * latency_us * 1e-6 + kernels, rel=1e-9, abs=1e-9)
    # the model is honest: the program never finishes before its modelled device time
    assert wall >= n * latency_us * 1e-6
    assert x[0].item() == n + 1


def test_sync_waits_for_the_modelled_end():
    neuron.set_launch_latency_us(2000)  # 2 ms per launch: far above the kernels' time
    x = torch.ones(4, device=DEV)
    torch.neuron.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        x = x * 1
    x.sum().item()  # 6 launches before this value can exist
    assert time.perf_counter() - t0 >= 6 * 2e-3


def test_events_order_streams_and_time_on_the_device():
    neuron.set_launch_latency_us(50)
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    x = torch.zeros(1000, device=DEV)
    start, ready = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    with torch.neuron.stream(s1):
        start.record()
        for _ in range(10):
            x.add_(1)
        ready.record()
    s2.wait_event(ready)
    with torch.neuron.stream(s2):
        y = x * 2
    s2.synchronize()
    assert ready.query()
    assert y[0].item() == 20.0
    assert start.elapsed_time(ready) >= 10 * 50e-3  # ms: ten launches of 50 us
    # the Python device raises RuntimeError; the C++ device's events are torch.Event, whose
    # check (PyTorch's own, for every PrivateUse1 device) raises ValueError
    with pytest.raises((RuntimeError, ValueError), match="enable_timing=True"):
        torch.neuron.Event().elapsed_time(ready)


def test_stream_wait_stream_and_default_stream():
    s = torch.neuron.Stream()
    assert torch.neuron.default_stream() == torch.neuron.current_stream()
    x = torch.ones(10, device=DEV)
    with torch.neuron.stream(s):
        s.wait_stream(torch.neuron.default_stream())
        z = x + 1
    torch.neuron.current_stream().wait_stream(s)
    assert z.sum().item() == 20.0
    torch.neuron.set_stream(s)
    try:
        assert torch.neuron.current_stream() == s
    finally:
        torch.neuron.set_stream(torch.neuron.default_stream())


def test_queue_error_reraised_at_next_sync_then_usable():
    x = torch.ones(3, device=DEV)
    idx = torch.tensor([10], device=DEV)
    with pytest.raises(IndexError, match="out of bounds") as info:
        y = x[idx]  # shape known on the host: queued; the kernel fails on the device
        z = y + 1  # queued after the failure: skipped
        z.sum().item()  # the sync point reports it
    notes = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "index.Tensor" in notes and "skipped" in notes
    assert neuron.counters().skipped_after_error >= 1
    # eager raises the same type at the op itself
    with pytest.raises(IndexError, match="out of bounds"):
        torch.ones(3)[torch.tensor([10])]
    assert (x * 2).sum().item() == 6.0  # the device is usable again


def test_memory_accounting():
    import gc

    gc.collect()  # earlier tests' garbage (a traceback's frames hold tensors) is freed first
    torch.neuron.synchronize()
    base = torch.neuron.memory_allocated()
    torch.neuron.reset_peak_memory_stats()
    t = torch.empty(1024, dtype=torch.float32, device=DEV)
    v = t[:10]
    assert torch.neuron.memory_allocated() - base == 4096
    del t
    assert torch.neuron.memory_allocated() - base == 4096  # the view keeps the buffer
    del v
    assert torch.neuron.memory_allocated() == base
    assert torch.neuron.max_memory_allocated() >= base + 4096
    torch.neuron.empty_cache()


def test_a_buffer_stays_alive_while_a_launch_uses_it():
    neuron.set_launch_latency_us(0)
    a = torch.randn(600, 600, device=DEV)
    b = a @ a  # queued; the host drops its reference to a at once
    expected = None
    del a
    import gc
    gc.collect()
    for _ in range(20):  # new allocations that would reuse freed memory
        torch.full((600, 600), 7.0, device=DEV)
    expected = b.cpu()
    assert torch.isfinite(expected).all()


CUDA_FUNCS = ["is_available", "device_count", "current_device", "set_device",
              "get_device_properties", "synchronize", "current_stream", "default_stream",
              "set_stream", "stream", "memory_allocated", "max_memory_allocated", "empty_cache",
              "manual_seed"]


@pytest.mark.parametrize("name", CUDA_FUNCS)
def test_torch_neuron_has_torch_cuda_signatures(name):
    ours = inspect.signature(getattr(torch.neuron, name))
    theirs = inspect.signature(getattr(torch.cuda, name))
    assert list(ours.parameters) == list(theirs.parameters)


def test_torch_neuron_classes_and_context_managers():
    for cls, method in [(torch.neuron.Stream, "wait_event"), (torch.neuron.Stream, "query"),
                        (torch.neuron.Event, "record"), (torch.neuron.Event, "elapsed_time")]:
        assert callable(getattr(cls, method))
    assert "enable_timing" in inspect.signature(torch.neuron.Event).parameters
    with torch.neuron.device(0):
        assert torch.neuron.current_device() == 0
    torch.neuron.set_device("neuron:0")
    props = torch.neuron.get_device_properties(0)
    assert props.total_memory > 0 and "neuron" in props.name
    with pytest.raises(ValueError, match="device index 3 is out of range; accepted: 0..0"):
        torch.neuron.set_device(3)
    with pytest.raises(ValueError, match="'cuda:0' is not a neuron device"):
        torch.neuron.synchronize("cuda:0")


def test_bad_latency_is_refused():
    with pytest.raises(ValueError, match="latency -1 us is not valid; accepted: a number >= 0"):
        neuron.set_launch_latency_us(-1)


def _run(code, **env):
    # the device implementation under test stays; every other setting is the child's own
    e = child_env("NEURON_", keep=("NEURON_EMULATOR_IMPL",), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=e, timeout=120)


def test_latency_from_the_environment_and_bad_value():
    code = "import torch, adaptive_eager.neuron; print(torch.neuron.get_device_properties().launch_latency_us)"
    ok = _run(code, NEURON_EMULATOR_LAUNCH_US="50")
    assert ok.returncode == 0 and ok.stdout.strip() == "50.0"
    bad = _run(code, NEURON_EMULATOR_LAUNCH_US="fast")  # one line, and the program runs
    assert bad.returncode == 0 and bad.stdout.strip() == "10.0", bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "adaptive_eager: NEURON_EMULATOR_LAUNCH_US='fast' is not valid; accepted: a number "
        ">= 0.0; using 10.0"]


def test_engine_config_naming_neuron_registers_the_device():
    code = """
        import torch
        print(torch.accelerator.current_accelerator())
    """
    r = _run(code, NEURON_ADAPTIVE_EAGER="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "neuron"
    r = _run(code, NEURON_ADAPTIVE_EAGER="1", NEURON_ADAPTIVE_EAGER_DEVICES="cpu")
    assert r.stdout.strip() == "None"


FAKE_NEURONX = '''
import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

class _Module:
    FAKE = True
    def is_available(self): return True
    def device_count(self): return 1
    def current_device(self): return 0
    def _is_in_bad_fork(self): return False
    def manual_seed_all(self, seed): pass
    def is_initialized(self): return True

if not REGISTER_NOTHING:
    _setup_privateuseone_for_python_backend("neuron", backend_module=_Module())
'''


@pytest.mark.parametrize("registers", [True, False])
def test_torchneuronx_adapter_uses_the_real_device(tmp_path, registers):
    pkg = tmp_path / "torch_neuronx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"REGISTER_NOTHING = {not registers}\n" + FAKE_NEURONX)
    code = """
        import torch, adaptive_eager.neuron as n
        print("EMULATED", n.is_emulated(), "FAKE", getattr(torch.neuron, "FAKE", False))
    """
    r = _run(code, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if registers:
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["EMULATED", "False", "FAKE", "True"]
    else:
        assert r.returncode != 0
        assert "torch_neuronx" in r.stderr and "did not register the neuron device" in r.stderr


def test_an_error_never_synchronized_is_reported_at_exit():
    code = """
        import torch, adaptive_eager.neuron
        x = torch.ones(3, device="neuron")
        y = x[torch.tensor([5], device="neuron")]  # fails on the device; nothing waits for it
    """
    r = _run(code)
    assert r.returncode == 0
    assert "failed and was never synchronized: IndexError: index 5 is out of bounds" in r.stderr


def test_host_tensors_are_read_when_the_op_is_issued():
    big = torch.randn(700, 700, device=DEV)
    torch.neuron.synchronize()
    # a quarter second a launch on the device's clock: the device is still busy when the host
    # asks below, however long a loaded machine keeps the host from running (the kernels'
    # own time alone was not always enough)
    neuron.set_launch_latency_us(250_000)
    busy = big @ big @ big  # keeps the device busy while the host goes on
    host = torch.ones(1000)
    dev = torch.zeros(1000, device=DEV)
    dev.copy_(host)  # queued behind the matmuls
    scaled = dev * torch.tensor(3.0)  # a 0-dim host tensor argument, also queued
    host.fill_(5.0)  # the program changes its host tensor at once
    assert not torch.neuron.current_stream().query()  # the copy has not run yet
    assert dev.sum().item() == 1000.0
    assert scaled.sum().item() == 3000.0
    del busy


def test_streams_overlap_on_the_device_timeline():
    neuron.set_launch_latency_us(2000)  # 2 ms per launch: the kernels are negligible
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    start = torch.neuron.Event(enable_timing=True)
    ends = [torch.neuron.Event(enable_timing=True) for _ in range(2)]
    x, y = torch.ones(4, device=DEV), torch.ones(4, device=DEV)
    x + 1  # the first op of a process imports PyTorch's meta kernels: not part of the timing
    start.record()
    for s in (s1, s2):
        s.wait_event(start)
    for _ in range(5):
        with torch.neuron.stream(s1):
            x = x + 1
        with torch.neuron.stream(s2):
            y = y + 1
    for s, e in zip((s1, s2), ends):
        e.record(s)
        e.synchronize()  # as on cuda: elapsed_time needs both events completed
    spans = [start.elapsed_time(e) for e in ends]  # ms of modelled device time
    assert all(10.0 <= t for t in spans)  # five 2 ms launches on each stream
    assert max(spans) < 20.0  # ... side by side, not one after the other
    assert x.sum().item() == y.sum().item() == 24.0
