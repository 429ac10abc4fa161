"""The hot path's dispatch key (Note [Below the floor], tracer/hot_key.py): its mechanism."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_eager.neuron as neuron
from adaptive_eager.tracer import hot_key


def _program(x, w):
    y = (x * w + 1.5) - 0.25  # mul, add: kernels of ours; sub: the fallback
    return torch.tanh(y).sum()


def test_handed_back_ops_equal_eager_with_autograd():
    x = torch.randn(16, 8)
    w = torch.randn(16, 8, requires_grad=True)
    ref = _program(x, w)
    (ref_grad,) = torch.autograd.grad(ref, w)
    calls, back = hot_key.counts()
    with hot_key.switched_on("hand-back"):
        got = _program(x, w)
        (grad,) = torch.autograd.grad(got, w)
    new_calls, new_back = hot_key.counts()
    assert torch.equal(got, ref) and torch.equal(grad, ref_grad)
    assert got.grad_fn is not None  # autograd recorded the ops above the key
    # forward: mul and add reached our kernels, sub, tanh and sum the fallback; backward too
    assert new_calls - calls >= 2 and new_back - back >= 3


def test_allocate_gives_the_first_tensor_arguments_metadata_and_runs_nothing():
    x = torch.randn(4, 6).t()
    out = torch.zeros(1)
    with hot_key.switched_on("allocate"):
        y = x * 2.0
    assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == x.dtype
    with hot_key.switched_on("canned", out):
        z = x + 1.0
    assert z is out or z.data_ptr() == out.data_ptr()


def test_key_is_switched_off_after_and_on_error():
    m = hot_key.load()
    assert not m.is_on()
    with pytest.raises(RuntimeError, match="boom"):
        with hot_key.switched_on("hand-back"):
            assert m.is_on()
            raise RuntimeError("boom")
    assert not m.is_on()
    assert torch.equal(torch.ones(3) * 2, torch.full((3,), 2.0))


def test_bad_action_is_one_line_naming_the_accepted_ones():
    with pytest.raises(ValueError, match=r"'fast'.*hand-back, canned, allocate"):
        with hot_key.switched_on("fast"):
            pass


def test_below_floor_benchmark_measures_every_way():
    from benchmarks import below_floor

    res = below_floor.measure(reps=1, n=5)
    assert set(res) == {"eager", "python floor", "key canned", "key allocate", "key boxed",
                        "key hand-back", "key routed", "key direct"}
    assert all(v > 0 for v in res.values())


class _Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_engaged_key_routes_every_op_to_the_mode_as_the_user_called_it():
    # engaged, the mode's keys are excluded: ops reach the mode through our kernels, with
    # the op the user called (sub.Tensor, not the sub.out its composite kernel would call;
    # factories, before they pick a backend),
    # values and gradients as eager, and the thread's key sets as before on exit
    x = torch.randn(8)
    w = torch.randn(8, requires_grad=True)

    def program():
        z = torch.tanh((x * w) - 1).sum()
        torch.manual_seed(0)
        noise = torch.randperm(8)  # a factory consuming the generator: the mode must see it
        return z, torch.autograd.grad(z, w)[0], noise

    ref = program()
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    with _Recording() as plain:
        program()
    with _Recording() as routed:
        with hot_key.engaged():
            got = program()
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    aten = torch.ops.aten
    # autograd's saved outputs are detached only where a mode is seen as active
    assert routed.seen == [f for f in plain.seen if f is not aten.detach.default]
    assert aten.sub.Tensor in routed.seen and aten.sub.out not in routed.seen
    assert aten.randperm.default in routed.seen
    assert torch._C._dispatch_tls_local_include_set() == include
    assert torch._C._dispatch_tls_local_exclude_set() == exclude


def test_engine_under_key_learns_the_gradient_accumulation_it_replays(monkeypatch):
    # A weight used twice gets two gradient contributions, which autograd adds in place
    # (add_) when nothing else holds the first one's memory, as plain eager does when no
    # dispatch mode is seen. The engine's cold runs must not hold it (a storage's Python
    # object would: Note [Storage objects]), or the path learned cold (add) diverges from its
    # replays (add_) at every step.
    import adaptive_eager as ae

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def step():
        z = lin(lin(x))
        loss = (z * z).sum()
        loss.backward()
        lin.weight.grad = lin.bias.grad = None
        return loss.item()

    ref = [step() for _ in range(8)]
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = [step() for _ in range(8)]
        s = ae.stats()
    assert got == ref
    assert "diverged from the hot path" not in s.fallbacks and s.replays >= 5


def test_hot_segment_is_served_below_the_floor_and_handed_back_at_the_read(monkeypatch):
    # Under ``key`` a hot segment's ops are served by the key's plan (tracer/hot_plan.py,
    # csrc/hot_segment.cpp), not by the mode, its first op too (a plan from the root, taken
    # when the last segment ended); the read that ends the step hands what was served back
    # to the segment, which launches it as before.
    import adaptive_eager as ae

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    torch.manual_seed(0)
    x = torch.randn(64)
    ws = [torch.randn(64) for _ in range(4)]

    def step(i):
        y = x
        for j in range(12):  # sub, mul, add with a float that changes each step (recorded)
            y = y * ws[j % 4] + 0.5 * i if j % 2 else y - ws[j % 4]
        new = torch.randn(64)  # a new external every step: held, then handed back
        return (y * new).sum().item()

    ref = []
    for i in range(8):
        torch.manual_seed(i)
        ref.append(step(i))
    m = hot_key.load()
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = []
        for i in range(8):
            torch.manual_seed(i)
            got.append(step(i))
            if i == 3:
                served, plans = m.served()[:2]
        # the next step's plan, from the root, waits for its first op ...
        assert m.serving()
        served, plans = m.served()[0] - served, m.served()[1] - plans
        s = ae.stats()  # ... until the engine's Python reads the segment
        assert not m.serving()
    assert got == ref
    assert "diverged from the hot path" not in s.fallbacks
    # steps 4..7: every op is served below the floor by one plan a step, from the root: the
    # 18 chain ops, the random op (the generator's state kept at it, as its fast path keeps
    # it: the replay draws what eager drew), the mul and the sum
    assert plans == 1 * 4 and served == 21 * 4


def test_a_read_guarded_in_python_sees_a_segment_a_plan_started(monkeypatch):
    # A plan from the root starts the segment in C++; the segment is hot in Python only once
    # it is handed back. A read the engine guards in Python (``tolist``) must hand it back
    # before asking whether the segment is hot, or it reads the op's output before it ran.
    import adaptive_eager as ae

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    x = torch.randn(5)

    def step():
        out = (x * 2 + 1).tolist()
        torch.nonzero(x)  # a boundary op: the cold runs' segment ends here, not at tolist
        return out

    ref = step()
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = [step() for _ in range(6)]
        s = ae.stats()
    assert got == [ref] * 6 and s.replays >= 3


@pytest.mark.parametrize("hot_path", ["key", "cpp"])
def test_a_step_whose_only_read_is_tolist_goes_hot(monkeypatch, hot_path):
    # a read the engine guards in Python ends a cold segment where it will end hot, as a
    # read the mode sees does: before, the cold segment ran on past it into the next step,
    # and the path it learned never repeated
    import adaptive_eager as ae

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", hot_path)
    x = torch.randn(5)

    def step():
        return (x * 2 + 1).tolist()

    ref = step()
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = [step() for _ in range(6)]
        s = ae.stats()
    assert got == [ref] * 6
    assert s.replays >= 3 and s.boundaries.get("host read: .tolist()", 0) >= 5, s


def test_plan_gives_autograd_the_undefined_gradients_it_expects(monkeypatch):
    # layer_norm's backward with the input needing no gradient returns an undefined tensor in
    # that place: a served op must hand autograd an undefined tensor there, not None
    import adaptive_eager as ae

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    w = torch.randn(8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)

    def step():
        y = torch.nn.functional.layer_norm(x * 2, (8,), w, b)
        (y * y).sum().backward()
        out = (w.grad.sum() + b.grad.sum()).item()
        w.grad = b.grad = None
        return out

    ref = [step() for _ in range(6)]
    before = hot_key.load().served()[0]
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = [step() for _ in range(6)]
    assert got == ref
    assert hot_key.load().served()[0] > before


def test_plan_is_handed_back_before_autograd_device_thread_touches_the_segment(monkeypatch):
    # On an accelerator autograd runs the backward on a thread of its own, and the ops of one
    # segment (the step's forward on the program's thread, its backward on that one) reach
    # the key from both: a plan belongs to the segment, not to a thread, and is handed back
    # before the engine's Python handles an op of that segment on either thread.
    import torch.nn as nn
    import torch.nn.functional as F

    import adaptive_eager as ae

    if not neuron.is_emulated():
        pytest.skip("torch-neuronx is installed")
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    neuron.ensure()

    def losses(engine, served=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to("neuron")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(8, 16).to("neuron"), torch.randint(0, 4, (8,)).to("neuron")

        def step():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

        if not engine:
            return [step() for _ in range(8)]
        m = hot_key.load()
        out = []
        with ae.enabled(devices=("neuron",), backend="exact"):
            for _ in range(8):
                before = m.served()[0]
                out.append(step())
                served.append(m.served()[0] - before)
        return out

    served = []
    ref = losses(False)
    assert losses(True, served) == ref
    # a hot step's forward, its backward (on autograd's device thread, which reaches the same
    # handler and plans as the program's thread) and the optimizer's update: 27 ops served
    # in C++ a step, all but the segment's first; with plans on the program's thread only,
    # the backward went through Python (a dozen served)
    assert served[4:] == [served[4]] * 4 and served[4] >= 24


def _counters(s):
    # not the deferred ops and views: with no mode seen (the key) autograd makes no ``detach``
    # of the outputs it saves, which the mode sees otherwise (Note [Below the floor])
    return {f: getattr(s, f) for f in ("ops_eager", "ops_host", "ops_passthrough", "replays")}


def test_ops_a_plan_runs_at_once_are_counted_as_the_mode_counts_them(monkeypatch):
    # Note [Host scalars]: Adam's step counts (0-dim cpu tensors) and the profiler ranges of
    # ``optimizer.step()`` come between the segment's ops; the key runs them at once, as the
    # mode would, without handing the plan back. Every counter equals the mode's own.
    import torch.nn as nn

    import adaptive_eager as ae

    def run(hot_path):
        monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", hot_path)
        ae.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
        x = torch.randn(4, 8)
        m = hot_key.load()
        with ae.enabled(devices=("cpu",), backend="exact"):
            for i in range(8):
                if i == 4:
                    before = m.served()
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                loss.item()
            s = ae.stats()
        after = m.served()
        return [p.detach().clone() for p in model.parameters()], s, [b - a for a, b in
                                                                     zip(before, after)]

    ref, ref_stats, _ = run("cpp")
    got, stats, (served, plans, unexpected, _, _) = run("key")
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert _counters(stats) == _counters(ref_stats) and ref_stats.ops_host > 0
    # two segments a step (``optimizer.step()`` is a boundary), one plan each: the host ops
    # among the update's ops and the twin tanh's backward reads do not end one
    assert served > 0 and plans == 2 * 4 and unexpected == 2 * 4


def test_a_values_twin_is_the_value(monkeypatch):
    # Note [Memory of a value]: with no mode seen (the key engaged), ``.data`` and the
    # outputs autograd saved come back as new tensors on a value's memory with no op the
    # engine sees; deferred, that memory holds nothing yet. One that sits on it exactly as
    # the value does is the value: learned and replayed as it, the segment stays whole
    # (under ``inductor`` a fused graph once read it as an input first: NaN gradients)
    import adaptive_eager as ae

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    x, w = torch.randn(8, 16), torch.randn(16, 16)

    def step():
        y = x @ w
        return (y.data * 2 + torch.tanh(y)).sum().item()

    ref = step()
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = [step() for _ in range(6)]
        s = ae.stats()
    assert got == [ref] * 6
    assert s.fallbacks == {} and s.replays == 4  # one segment a step, hot from the third


@pytest.mark.parametrize("backend", ["exact", "inductor"])
def test_a_trained_value_read_through_autograds_twin_stays_in_the_segment(monkeypatch, backend):
    # tanh's and sigmoid's backward read their saved outputs: twins of forward values, one
    # whose tensor is alive (h), one whose tensor died (sigmoid's output). Under ``inductor`` a
    # fused graph that took a twin for a new input read it before computing it (NaN).
    import adaptive_eager as ae
    from tests.conftest import wait_compiles

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    torch.manual_seed(0)
    w1 = torch.randn(16, 16, requires_grad=True)
    w2 = torch.randn(16, 4, requires_grad=True)
    x = torch.randn(8, 16)

    def step():
        h = torch.tanh(x @ w1)
        loss = torch.sigmoid(h @ w2).sum()
        loss.backward()
        with torch.no_grad():
            for p in (w1, w2):
                p -= 0.01 * p.grad
                p.grad = None
        return loss.item()

    w0 = (w1.detach().clone(), w2.detach().clone())
    ref = [step() for _ in range(8)]
    ref_w = (w1.detach().clone(), w2.detach().clone())
    with torch.no_grad():
        w1.copy_(w0[0])
        w2.copy_(w0[1])
    with ae.enabled(devices=("cpu",), backend=backend):
        got = [step() for _ in range(3)]
        if backend == "inductor":
            wait_compiles()
        got += [step() for _ in range(5)]
        s = ae.stats()
    if backend == "exact":
        assert got == ref and torch.equal(w1, ref_w[0]) and torch.equal(w2, ref_w[1])
    else:
        assert s.graphs_compiled == 1
        assert torch.allclose(torch.tensor(got), torch.tensor(ref), rtol=1e-5)
        assert torch.allclose(w1, ref_w[0], rtol=1e-5) and torch.allclose(w2, ref_w[1], rtol=1e-5)
    assert not any("memory of a value" in r for r in s.fallbacks)
    assert s.segments == 8 and s.replays == 6  # the whole step one segment, hot from the third


def test_a_part_of_a_value_made_without_an_op_is_a_counted_boundary(monkeypatch):
    # a new tensor on a part of a value's memory is no twin of it: the segment launches first
    import adaptive_eager as ae

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    x, w = torch.randn(8, 16), torch.randn(16, 16)

    def step():
        y = x @ w
        return (y[1:].data * 2 + torch.tanh(y[1:])).sum().item()

    ref = step()
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = [step() for _ in range(6)]
        reasons = ae.stats().fallbacks
    assert got == [ref] * 6
    assert reasons.get("a new input on the memory of a value of the segment: aten.mul.Tensor") == 6


def test_a_plan_that_cannot_be_built_is_a_counted_fallback(monkeypatch):
    import adaptive_eager as ae
    from adaptive_eager.tracer import hot_plan

    def broken(*args):
        raise RuntimeError("no steps today")

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    monkeypatch.setattr(hot_plan, "_build", broken)
    x = torch.randn(32)

    def step():
        return ((x * 2 + 1).relu() * 3).sum().item()

    ref = step()
    served = hot_key.load().served()[0]
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = [step() for _ in range(6)]
        s = ae.stats()
    assert got == [ref] * 6 and s.replays >= 3  # hot, through the mode
    assert hot_key.load().served()[0] == served
    assert "no plan for the dispatch key (RuntimeError: no steps today)" in s.fallbacks


def test_threads_served_at_once_never_wait_on_each_other(monkeypatch):
    # Two threads, each with its engine's mode and plans: a plan's state is found under a
    # lock, but nothing holding that lock waits for the interpreter lock (releasing a tensor
    # may), or a thread handing back with the interpreter lock and one serving with the
    # plans' lock waited on each other forever.
    import threading

    import torch.nn as nn

    import adaptive_eager as ae

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")

    def make(seed):  # on this thread: the global generator is shared by threads
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)), torch.randn(4, 8)

    def train(model, x):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        losses = []
        for _ in range(40):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    refs = [train(*make(s)) for s in (1, 2)]
    got, errors = {}, []

    def work(k, model, x):
        try:
            with ae.enabled(devices=("cpu",), backend="exact"):
                got[k] = train(model, x)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    served = hot_key.load().served()[0]
    threads = [threading.Thread(target=work, args=(k, *make(s)), daemon=True)
               for k, s in enumerate((1, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "threads under the key deadlocked"
    assert not errors, errors
    assert [got[0], got[1]] == refs
    assert hot_key.load().served()[0] > served


def test_an_absent_optional_tensor_passed_undefined_is_served(monkeypatch):
    # autograd calls sdpa's backward with its saved ``attn_mask``: an undefined tensor where
    # the mode sees None; the plan's check took it for a mismatch, and the op went to Python
    import torch.nn.functional as F

    import adaptive_eager as ae

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, requires_grad=True) for _ in range(3))

    def step():
        out = F.scaled_dot_product_attention(q, k, v)
        (out * out).sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        return [g.sum().item() for g in grads]

    ref = step()
    m = hot_key.load()
    with ae.enabled(devices=("cpu",), backend="exact"):
        for i in range(6):
            if i == 3:
                before = m.served()
            assert step() == ref
    served, plans, unexpected, _, forks = (b - a for a, b in zip(before, m.served()))
    # per hot step each of the three segments (sdpa, its backward and the first sum; the
    # second sum; the third) is served by a plan from the root to the read that ends it
    # (unexpected: 3); the plan a read leaves follows the root's child taken last, and where
    # the next segment starts with another (twice a step) it takes that fork (Note [Forks
    # in a plan]) instead of handing the op to the mode and taking a plan after it
    assert plans == 3 * 3 and unexpected == 3 * 3 and forks == 2 * 3 and served > 0


def test_served_outputs_reuse_memory_the_program_let_go_and_never_what_it_holds(monkeypatch):
    # Note [Output pool] (csrc/output_pool.cpp): a served cpu output's memory comes back to
    # the pool when its storage is freed, and a later step's outputs take it from there;
    # memory a tensor the program keeps still uses is never handed out again
    import adaptive_eager as ae

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    x = torch.randn(256)

    def step(keep):
        y = x
        for _ in range(8):
            y = y * 1.5
            keep.append(y)  # every output stays held
            y = y + 0.25
        return y.sum().item()

    ref_kept = []
    ref = [step(ref_kept) for _ in range(6)]
    m = hot_key.load()
    with ae.enabled(devices=("cpu",), backend="exact"):
        kept = []
        got = [step(kept) for _ in range(6)]
        held = m.pool_held_bytes()
        assert held > 0  # the dropped outputs (every ``y + 0.25`` but the last) came back
        step([])  # takes its outputs from the pool, and gives them all back
        assert m.pool_held_bytes() >= held
    assert got == ref
    assert all(torch.equal(a, b) for a, b in zip(kept, ref_kept))
    assert len({t.data_ptr() for t in kept}) == len(kept)  # no two held tensors share memory


def test_arguments_lent_to_the_plan_keep_their_reference_counts(monkeypatch):
    # Note [Borrowed arguments] (csrc/hot_segment.h): our unboxed kernels lend the plan their
    # tensor arguments uncounted; in-place ops return one of them. Every tensor's count is
    # what it is in eager afterwards, and the ops were served.
    import adaptive_eager as ae

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")

    def make():
        torch.manual_seed(0)
        return [torch.randn(32), torch.randn(32), torch.rand(32)]

    def step(p, m, v):
        g = p * 0.5 + 1.0
        m.lerp_(g, 0.1)  # in place: the result is ``m`` itself
        v.mul_(0.99).addcmul_(g, g, value=0.01)
        p.addcdiv_(m, v.sqrt().add_(1e-8), value=-0.01)
        return p.sum().item()

    ref = make()
    ref_out = [step(*ref) for _ in range(6)]
    got = make()
    counts = [t._use_count() for t in got]
    m = hot_key.load()
    with ae.enabled(devices=("cpu",), backend="exact"):
        served = m.served()[0]
        got_out = [step(*got) for _ in range(6)]
        served = m.served()[0] - served
    assert got_out == ref_out and all(torch.equal(a, b) for a, b in zip(got, ref))
    assert [t._use_count() for t in got] == counts
    assert served >= 3 * 8  # the hot steps' ops, lent


def test_a_read_launches_the_fused_graph_below_the_floor(monkeypatch):
    # Note [Launched below the floor] (csrc/hot_segment.h): a step served whole by a plan from
    # the root launches its fused graph at its read in C++, counted as Python counts it; a
    # step whose variant differs (a value kept alive, a specialized float changed) goes back
    # to Python, and every result equals eager's
    import adaptive_eager as ae
    from tests.conftest import wait_compiles

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    torch.manual_seed(0)
    x = torch.randn(64)

    def step(scale=1.5, keep=False):
        y = x
        for _ in range(4):
            y = y * scale + 0.25
        total = y.sum()
        kept = y if keep else None
        del y
        if total > -1e9:  # bool(): a read of a value (is_nonzero) ends the step's segment
            out = total.item()
        return (out, kept) if keep else out

    plan = ["p"] * 3 + ["wait"] + ["p"] * 3 + ["keep", "p", "p", "scale", "p", "p"]
    ref = []
    for what in plan:
        if what != "wait":
            ref.append(step(scale=2.0 if what == "scale" else 1.5, keep=what == "keep"))
    m = hot_key.load()
    launched = []
    with ae.enabled(devices=("cpu",), backend="inductor"):
        got = []
        for what in plan:
            if what == "wait":
                wait_compiles()
                continue
            before = m.served()[3]
            got.append(step(scale=2.0 if what == "scale" else 1.5, keep=what == "keep"))
            launched.append(m.served()[3] - before)
        s = ae.stats()
    for g, r in zip(got, ref):
        if isinstance(r, tuple):
            assert g[0] == pytest.approx(r[0], rel=1e-6) and torch.allclose(g[1], r[1])
        else:
            assert g == pytest.approx(r, rel=1e-6)
    # one segment a step: three learn (the third an exact replay while the graph compiles),
    # the fourth launches in Python and gives the path its launch at a read, then each step
    # launches below the floor but the one that keeps y alive and the one whose float
    # changed (other variants: Python launches them, the second compiling its own graph)
    assert launched == [0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert s.segments == 12 and s.replays == 10
    assert s.replays == s.cache_hits + s.fallbacks["variant compiling: replayed exactly"]
    assert s.replays == s.cache_hits + s.fallbacks.get("variant compiling: replayed exactly", 0)


def test_a_fused_graph_raising_below_the_floor_names_the_op_eager_fails_at(monkeypatch):
    # the graph a read launches below the floor raises: the segment goes back to Python, which
    # finds the op eager would have failed at and its line (Note [Issuing frames]); the engine
    # goes on, launching below the floor again
    import torch.nn.functional as F

    import adaptive_eager as ae
    from tests.conftest import wait_compiles

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    table = torch.randn(10, 4)

    def step(ids):
        h = F.embedding(ids, table)  # the failing line
        return (h * 2).sum()

    line = step.__code__.co_firstlineno + 1
    m = hot_key.load()
    # made before: the engine sees a tensor's making (lift_fresh), which would start the step
    ids, bad, good = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 99]), torch.tensor([4, 5, 6])
    with ae.enabled(devices=("cpu",), backend="inductor"):
        for i in range(6):
            if i == 3:
                wait_compiles()
            step(ids).item()
        before = m.served()[3]
        assert step(ids).item() == pytest.approx((F.embedding(ids, table) * 2).sum().item())
        assert m.served()[3] == before + 1  # below the floor
        with pytest.raises(IndexError) as info:
            step(bad).item()
        assert f"test_hot_key.py:{line}" in str(info.value)
        for _ in range(2):  # the first one's first op reaches the mode, which plans the rest
            assert step(good).item() == pytest.approx((F.embedding(good, table) * 2).sum().item())
        assert m.served()[3] == before + 2


def test_a_training_step_launches_below_the_floor_at_the_optimizer_step(monkeypatch):
    # a whole training step (attention, whose dropout_p=0.0 is a recorded float of a random
    # op; values autograd saved and reads back as twins; some alive only through a view) is
    # served by one plan from the root and launched at the optimizer step's boundary in C++;
    # the losses and the parameters stay eager's
    import torch.nn.functional as F

    import adaptive_eager as ae
    from tests.conftest import wait_compiles

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")

    def run(engine):
        torch.manual_seed(0)
        w_qkv = torch.randn(16, 48, requires_grad=True)
        w_out = torch.randn(16, 16, requires_grad=True)
        x = torch.randn(2, 8, 16)
        opt = torch.optim.SGD([w_qkv, w_out], lr=0.01)
        m = hot_key.load()
        losses, launched = [], []

        def step():
            q, k, v = (x @ w_qkv).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
            h = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
            loss = torch.tanh(h.transpose(1, 2).reshape(2, 8, 16) @ w_out).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        with ae.enabled(devices=("cpu",), backend="inductor") if engine else _nothing():
            for i in range(8):
                if engine and i == 3:
                    wait_compiles()
                before = m.served()[3]
                losses.append(step().item())
                launched.append(m.served()[3] - before)
        return losses, (w_qkv.detach(), w_out.detach()), launched

    ref, ref_w, _ = run(False)
    got, got_w, launched = run(True)
    assert got == pytest.approx(ref, rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got_w, ref_w))
    assert sum(launched[5:]) == 3, launched  # each step once hot (its graph's first run: Python)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("hot_path", ["key", "cpp", "python"])
def test_a_higher_order_op_runs_as_in_eager(monkeypatch, hot_path):
    # Note [Higher-order ops and the key]: out_dtype (a higher-order op) raised under the
    # engine ("could not find kernel ... at dispatch key ???" with the key engaged, "no rule
    # registered for ... mode" without it) where eager runs it
    import adaptive_eager as ae
    from torch._higher_order_ops.out_dtype import out_dtype

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", hot_path)
    a = torch.randint(-5, 5, (4, 4), dtype=torch.int8)
    b = torch.randint(-5, 5, (4, 4), dtype=torch.int8)

    def step():
        return out_dtype(torch.ops.aten.mm.default, torch.int32, a + 1, b).sum().item()

    ref = step()
    with ae.enabled(devices=("cpu",), backend="exact"):
        got = [step() for _ in range(5)]
        s = ae.stats()
    assert got == [ref] * 5
    if hot_path != "key":  # the mode sees it: a counted boundary
        assert s.fallbacks.get("higher-order op: out_dtype", 0) == 5, s.fallbacks
    else:  # the key lets it through: its aten ops are the engine's as any op
        assert s.replays >= 2, s
