"""Recurring work stays on its hot path whatever Python objects carry it (issue: real models)."""

import pytest
import torch

import adaptive_eager as ae
from conftest import Delta, wait_compiles

CPU = dict(devices=("cpu",), backend="exact")


def test_fresh_constant_reusing_a_dead_temporarys_id_stays_hot():
    # Hugging Face's cache layers start from ``torch.tensor([])`` inside forward: a new object
    # every step, made right after a temporary died, so CPython hands it the dead temporary's
    # id. The hot path must not mistake it for that (dead) segment value.
    x = torch.randn(4)

    def step():
        t = x * 2
        y = t + 1
        del t  # frees the Python object whose id the next tensor gets
        empty = torch.tensor([])
        return torch.cat([empty, y]).sum().item()

    ref = [step() for _ in range(8)]
    with ae.enabled(**CPU):
        got = [step() for _ in range(3)]
        d = Delta()
        got += [step() for _ in range(5)]
    assert got == ref
    assert d.fallbacks.get("diverged from the hot path", 0) == 0
    assert d.replays == 5 and d.launches == 10  # one replay and the `.item()` per step


def test_a_path_that_keeps_diverging_is_cut_and_goes_hot_in_pieces():
    # Every third step takes another branch in the middle that is never the same twice (a
    # new shape each time), so the hot path diverges there again and again. After
    # ``divergence_limit`` divergences the engine cuts the path at that op: the prefix and the
    # remainder each go hot and the step costs one extra launch, never a cold run.
    x = torch.randn(16)
    state = {"i": 0}

    def step():
        state["i"] += 1
        y = x * 2
        z = y + 1
        if state["i"] % 3 == 0:
            z = z[: 1 + state["i"] % 13].sum() + z  # a new slice length: a fresh branch
        return (z * 3).sum().item()

    ref = [step() for _ in range(40)]
    state["i"] = 0
    with ae.enabled(**CPU):
        got = [step() for _ in range(25)]
        d = Delta()
        got += [step() for _ in range(15)]
    assert got == ref
    cuts = [r for r in ae.stats().fallbacks if r.startswith("path cut:")]
    assert len(cuts) == 1 and "aten.add.Tensor" in cuts[0] and "test_hot.py" in cuts[0]
    assert d.fallbacks.get("diverged from the hot path", 0) == 0
    # each common step: prefix + remainder (+ the .item()); no op runs cold.
    assert d.replays >= 2 * 10
    assert d.ops_eager <= 15 + 5 * 4  # the reads, plus the odd steps' branch ops


def test_a_cold_segment_does_not_jump_onto_a_hot_path_midway():
    # The hot path starts at a segment's first op only. A segment that began cold and later
    # meets an op looking like some hot path's first op (here ``x2 * 2.0``, like ``x * 2.0``)
    # must stay cold: found in Hugging Face's ``generate`` with a static cache.
    x, x2 = torch.randn(4), torch.randn(4)

    def hot():
        return (x * 2.0).sum().item()

    def other():
        y = x + 1
        w = x2 * 2.0
        return (y + w).sum().item()

    ref = [hot(), other(), other(), hot()]
    with ae.enabled(**CPU):
        for _ in range(3):
            hot()
        got = [hot(), other(), other(), hot()]
    assert got == ref


def test_a_deferred_output_nobody_holds_is_freed_before_the_launch():
    """Note [Liveness]: the engine holds deferred outputs weakly, storage included, so a
    hot segment's dead intermediates free their memory as they would in eager (holding
    their storages made a 64-op chain hold all 64 buffers until the launch)."""
    x = torch.randn(1000)
    freed = []

    def step():
        a = x * 2.0
        ref = a.untyped_storage()._weak_ref()
        b = a + 1.0  # a's only holder is this frame
        del a
        freed.append(torch.UntypedStorage._expired(ref))
        torch.UntypedStorage._free_weak_ref(ref)
        c = b * 3.0
        return c.sum().item()

    ref_value = step()
    with ae.enabled(devices=("cpu",), backend="exact"):
        for _ in range(3):
            step()
        freed.clear()
        d = Delta()
        got = [step() for _ in range(2)]
        assert d.replays == 2 and d.ops_deferred >= 6  # the products were deferred
    assert got == [ref_value] * 2
    assert freed == [True, True]


def test_nodes_of_one_structure_share_their_fast_path_code(monkeypatch):
    """Note [Shared fast-path code]: what differs between such nodes (the value an argument
    must be, shapes) lives in the function's globals, so one code object serves them all."""
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "python")  # the generated code
    x = torch.randn(16)

    def step():
        y = x
        for _ in range(4):
            y = y * 1.5
            y = y + 1.0
        return y.sum().item()

    want = step()
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = [step() for _ in range(4)]
        node, nodes = ae._engine().mode().root, []
        while node.hot_next is not None:
            node = node.hot_next
            nodes.append(node)
    assert got == [want] * 4
    muls = [n.fast for n in nodes if n.spec.func is torch.ops.aten.mul.Tensor]
    assert len(muls) == 4
    assert len({f.__code__ for f in muls[1:]}) == 1  # the first takes x (a new external)
    assert muls[1] is not muls[2] and muls[1].__globals__ is not muls[2].__globals__


def _peak_bytes(fn):
    """The most bytes the CPU allocator held at once during ``fn()``, above its start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = most = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        most = max(most, held)
    return most


@pytest.mark.parametrize("backend", ["exact", "inductor"])
def test_a_hot_chain_peaks_at_eagers_memory(backend):
    """A 16-op chain on 256 KB buffers: eager holds two at a time. Hot, the engine held all
    sixteen: the deferred outputs' storages until the launch (Note [Liveness]), and the
    exact replay's locals until it returned."""
    x = torch.randn(1 << 16)

    def step():
        y = x
        for _ in range(8):
            y = y * 1.5
            y = y - 0.5
        return y.sum().item()

    eager = _peak_bytes(step)
    with ae.enabled(devices=("cpu",), backend=backend):
        for _ in range(3):
            step()
        wait_compiles()
        step()
        d = Delta()
        hot = _peak_bytes(step)
        assert d.replays == 1
    assert eager <= 3 * x.nbytes
    # At most one buffer more: the placeholder of the output still live at the read
    # (``y``), which the launch writes while computing the ones it reads.
    assert hot <= eager + x.nbytes + 1024, (hot, eager)


def test_host_scalars_run_at_once_and_keep_the_segment():
    # Note [Host scalars]: an optimizer's 0-dim CPU step counts, bumped and read once per
    # parameter, run on the host at once; the segment around them goes on (one launch a step)
    params = [torch.randn(8) for _ in range(4)]
    steps = [torch.tensor(0.0) for _ in params]

    def step():
        for p, s in zip(params, steps):
            s += 1
            p.mul_(1 - 0.01 / s.item())
        return sum(p.sum() for p in params).item()

    want_params = [p.clone() for p in params]
    want_steps = [s.clone() for s in steps]
    ref = []
    for _ in range(6):
        for p, s in zip(want_params, want_steps):
            s += 1
            p.mul_(1 - 0.01 / s.item())
        ref.append(sum(p.sum() for p in want_params).item())
    with ae.enabled(**CPU):
        got = [step() for _ in range(3)]
        d = Delta()
        got += [step() for _ in range(3)]
    assert got == ref and all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert d.ops_host == 3 * 4 * 2 and d.replays == 3  # one replay a step, reads included


def test_a_host_scalar_sharing_memory_with_a_written_input_waits_for_it():
    # A 0-dim tensor over the memory of a tensor the segment writes, through another storage
    # (two views of one numpy array): reading it must launch the write first.
    np = pytest.importorskip("numpy")
    arr = np.ones(4, dtype=np.float32)
    x = torch.from_numpy(arr)
    first = torch.from_numpy(arr[:1].reshape(()))  # shares x's memory, not its storage

    def step():
        x.mul_(2)
        y = (x + 1).sum()
        return first.item(), y.item()

    with ae.enabled(**CPU):
        got = [step() for _ in range(5)]
    assert got == [(2.0 ** k, 4 * 2.0 ** k + 4) for k in range(1, 6)]
