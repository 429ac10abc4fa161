"""The fused backend: background compiles, cached graphs, lifted floats, errors, retirement.

Graphs are kept tiny and shapes shared so the session's Inductor cache serves most compiles.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae
from conftest import Delta, wait_compiles

IND = dict(devices=("cpu",), backend="inductor")


def chain(x, a=1.5, b=1.0):
    for _ in range(3):
        x = x * a
        x = x + b
    return x


def hot(fn, runs=3):
    for _ in range(runs):
        fn()
    wait_compiles()
    fn()  # installs the delivered graph at its first boundary


def fused_and_eager(step):
    """``step``'s eager result, then its result replayed by a delivered fused graph, with the
    engine's counters of that replay."""
    ref = step()
    with ae.enabled(**IND):
        hot(step)
        d = Delta()
        got = step()
    return ref, got, d


def test_fused_replay_values_and_counts():
    x = torch.randn(64)
    ref = chain(x).sum().item()
    with ae.enabled(**IND):
        d = Delta()
        hot(lambda: chain(x).sum().item())
        assert d.graphs_compiled == 1
        assert d.fallbacks.get("variant compiling: replayed exactly", 0) >= 1  # warm: exact
        d = Delta()
        got = [chain(x).sum().item() for _ in range(3)]
        assert d.cache_hits == 3 and d.cache_misses == 0 and d.graphs_compiled == 0
        assert d.launches == 6  # per run: one fused replay + the .item() read
        assert d.ops_deferred == 3 * 7
    assert got == pytest.approx([ref] * 3, rel=1e-5)


def test_cpp_wrapper_graph_replays(monkeypatch):
    # Note [C++ wrappers]: the default outside the suite; built in the compile process
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_CPP_WRAPPER", "1")
    x = torch.randn(64)
    ref = chain(x, 1.625).sum().item()
    with ae.enabled(**IND):
        hot(lambda: chain(x, 1.625).sum().item())
        d = Delta()
        got = [chain(x, 1.625).sum().item() for _ in range(3)]
        assert d.cache_hits == 3 and d.launches == 6
    assert got == pytest.approx([ref] * 3, rel=1e-5)
    assert not [k for k in ae.stats().fallbacks if k.startswith("C++ wrapper")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_chain_keeps_eager_rounding(dtype):
    # Inductor computes fused bf16/fp16 chains in float32 and rounds once at the end; eager
    # rounds after every op. A 16-op bf16 chain differed by 0.09 until the fused backend
    # compiled with emulate_precision_casts (Note [Eager's precision] in scheduler/backends).
    x, y = torch.randn(256, dtype=dtype), torch.randn(256, dtype=dtype)

    def step():
        z = x * 1
        for _ in range(8):
            z = (z * 1.37 + y) * 0.61
        return z, z.sum().item()

    ref = step()[0]
    with ae.enabled(**IND):
        hot(step)
        d = Delta()
        got = step()[0]
        assert d.replays == 1 and not d.fallbacks  # the fused graph ran
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_fused_kernels_stay_eager(dtype):
    # log_softmax, mse_loss, addr run as one float32 kernel in eager; decomposed, Inductor
    # rounded differently, beyond the OpInfo tolerances in 16 bits (found by the OpInfo
    # sweep). In 16-bit graphs they stay eager's kernels: the fused graph is bitwise eager.
    torch.manual_seed(0)
    x, t = torch.randn(64, 64, dtype=dtype) * 4, torch.randn(64, 64, dtype=dtype) * 4

    def step():
        y = torch.log_softmax(x * 1.5, 1) + 1
        loss = F.mse_loss(y * 3, t, reduction="none")
        outer = torch.addr(t, x[0], x[1], beta=0.5, alpha=2)
        return y, loss, outer, loss.sum().item()

    ref = step()
    with ae.enabled(**IND):
        hot(step)
        d = Delta()
        got = step()
        assert d.replays == 1 and not d.fallbacks  # the fused graph ran
    assert all(torch.equal(g, r) for g, r in zip(got[:3], ref[:3]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_products_stay_eager(dtype):
    # Found by the OpInfo sweep: a vector @ batched matrix (bmm with one row), which Inductor
    # lowers to a 16-bit multiply and a sum, logspace, and prod (eager multiplies in 16 bits,
    # Inductor in float32), beyond the tolerances in 16 bits (prod's fp16 gradient). In 16-bit
    # graphs they are eager's kernels (Note [Eager's precision]).
    torch.manual_seed(0)
    v, m = torch.randn(10, dtype=dtype), torch.randn(5, 5, 10, 5, dtype=dtype)

    def step():
        p = v * 1 @ m
        s = torch.logspace(-2, 10, 50, base=2.0, dtype=dtype) + 1
        q = torch.prod(m * 0.5 + 1, 2)
        return p, s, q, p.sum().item()

    ref, got, d = fused_and_eager(step)
    assert d.replays == 1 and not d.fallbacks  # the fused graph ran
    assert all(torch.equal(g, r) for g, r in zip(got[:3], ref[:3]))


def test_low_precision_weighted_nll_loss_stays_eager():
    # Found by the OpInfo sweep: nll_loss's weighted mean, decomposed, was 2-3 fp16 ulps off
    # eager's (which sums in float32 and rounds once). It stays eager's kernel in 16 bits.
    torch.manual_seed(6)
    z = torch.randn(16, 4, 2, 3, dtype=torch.float16) * 3
    t = torch.randint(0, 4, (16, 2, 3))
    w = torch.rand(4, dtype=torch.float16) + 0.5

    def step():
        loss = F.nll_loss(torch.log_softmax(z * 1, 1), t, weight=w, ignore_index=1)
        flat = F.nll_loss(torch.log_softmax(z[:, :, 0, 0] * 1, 1), t[:, 0, 0], weight=w)
        return loss, flat, loss.item()

    ref, got, d = fused_and_eager(step)
    assert d.replays == 1 and not d.fallbacks  # the fused graph ran
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_layer_norm_of_a_constant_row_stays_eager(dtype):
    # Found by the OpInfo sweep: layer_norm over one element (no variance: 1/sqrt(eps) scales
    # every rounding) differed from eager's by 0.001 in 16 bits, and so did its weight's
    # gradient. In 16-bit graphs both stay eager's kernels.
    torch.manual_seed(0)
    x = torch.randn(5, 1, dtype=dtype)
    w = torch.randn(1, dtype=dtype, requires_grad=True)

    def step():
        y = F.layer_norm(x * 1, (1,), w)
        (gw,) = torch.autograd.grad(y, w, torch.ones_like(y))
        return y, gw, gw.sum().item()

    ref, got, d = fused_and_eager(step)
    assert d.replays >= 1 and not d.fallbacks  # the fused graph ran
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_mean_of_empty_is_nan():
    # Found by the OpInfo sweep: Inductor's var_mean gives an empty tensor's mean as 0, where
    # eager's is nan. Such a graph is not fused (counted) and replays eager's kernels.
    x = torch.randn(0, 5)

    def step():
        v, m = torch.var_mean(x * 1)
        return v, m, (x.sum(0) + 1).sum().item()

    ref = step()
    with ae.enabled(**IND):
        hot(step)
        d = Delta()
        got = step()
        assert d.fallbacks.get("no fused graph (Inductor would compute it otherwise than "
                               "eager): replayed exactly") == 1
    assert got[1].isnan() and ref[1].isnan() and got[0].isnan()
    # refused, not failed: the reason says so, and explain() does not ask for a report
    assert any(r.startswith("not fused") and "InductorDiffers" in r
               for r in ae.stats().fallbacks)
    advice = "\n".join(ae.explain().advice)
    assert "was not fused" in advice and "failed to compile" not in advice


def test_16bit_fill_value_is_rounded_as_eager_stores_it():
    # C++'s ``m - x`` (hinge_embedding_loss's margin) runs as empty_like(x).fill_(m).sub_(x):
    # eager stores m in bf16 before subtracting; the fused graph must use that value, not m,
    # both when m is a constant of the graph and when it changes (lifted to an input)
    x = torch.randn(64).mul(3).bfloat16()

    def f(m):
        out = torch.empty_like(x).fill_(m).sub_(x).clamp_min_(0).mul(3)
        out.sum().item()
        return out

    ms = (1.7, 2.3, 0.9, 1.1, 2.9, 1.3)
    ref = {m: f(m) for m in ms}
    assert not torch.equal(ref[1.7], torch.sub(1.7, x.float()).clamp_min(0).mul(3).bfloat16())
    with ae.enabled(**IND):
        hot(lambda: f(1.7))
        d = Delta()
        assert torch.equal(f(1.7), ref[1.7])
        assert d.cache_hits == 1 and not d.fallbacks
        got = {}
        for m in ms[1:4]:  # the first change recompiles with m lifted ...
            got[m] = f(m)
            wait_compiles()
        d = Delta()
        got.update({m: f(m) for m in ms[4:]})  # ... then new values reuse that graph
        assert d.cache_hits == 2 and d.graphs_compiled == 0 and not d.fallbacks
    for m in ms[1:]:
        assert torch.equal(got[m], ref[m]), m


def test_16bit_pow_is_computed_as_eager():
    # Found by the OpInfo sweep (normalize's bf16 gradient with p=0.5): eager's pow of a 16-bit
    # tensor takes the exponent in the tensor's dtype (1/3 is 0.333984375 in bf16), and
    # computes -0.5, -2 and 3 in 16-bit steps; the fused graph must do the same
    x = torch.randn(65536).mul(3).abs().add(0.01).bfloat16()
    exps = (1 / 3, -0.5, -2.0, 3, 2)
    assert not torch.equal(x.pow(1 / 3), x.float().pow(1 / 3).bfloat16())
    assert not torch.equal(x.pow(-2.0), x.float().pow(-2.0).bfloat16())
    for e in exps:
        def step():
            out = [x.mul(1).pow(e).mul(3), x.mul(2).pow_(e).add(1)]
            out[0].sum().item()
            return out

        ref = step()
        with ae.enabled(**IND):
            hot(step)
            d = Delta()
            got = step()
            assert d.replays >= 1 and not d.fallbacks, e
        assert all(torch.equal(g, r) for g, r in zip(got, ref)), e


def test_changing_float_is_lifted_not_recompiled():
    x = torch.randn(64)
    with ae.enabled(**IND):
        hot(lambda: chain(x, 1.5).sum().item())
        got = {}
        for a in (1.25, 1.75, 2.0, 0.5):  # the first change recompiles with `a` lifted ...
            got[a] = chain(x, a).sum().item()
            wait_compiles()
        d = Delta()
        for a in (3.0, 0.75):  # ... then new values reuse that graph
            got[a] = chain(x, a).sum().item()
        assert d.graphs_compiled == 0 and d.cache_hits == 2
    for a, v in got.items():
        assert v == pytest.approx(chain(x, a).sum().item(), rel=1e-5)


def test_signed_zero_float_is_exact():
    x = torch.full((8,), -1.0)

    def f(b):
        return (x * 0.0 + b).reciprocal()  # 1 / (-0.0 + b): the sign of b's zero shows

    with ae.enabled(**IND):
        for _ in range(3):
            f(0.0).sum().item()
        wait_compiles()
        for b in (0.0, -0.0, 0.0):
            assert torch.equal(f(b), 1 / (x * 0.0 + b))


def test_live_intermediate_is_materialized():
    x = torch.randn(64)
    with ae.enabled(**IND):
        def step():
            y = x * 1.5
            z = (y + 1.0).sum()
            return y, z.item()

        for _ in range(3):
            step()
        wait_compiles()
        step()
        d = Delta()
        y, z = step()
        assert d.cache_hits == 1
    assert torch.allclose(y, x * 1.5) and z == pytest.approx((x * 1.5 + 1).sum().item(), rel=1e-5)


def test_crosscheck_passes_on_correct_graphs():
    x = torch.randn(64)
    with ae.enabled(crosscheck=True, **IND):
        hot(lambda: chain(x).sum().item())
        d = Delta()
        chain(x).sum().item()
        assert d.cache_hits == 1


def test_fused_error_names_op_and_line():
    table = torch.randn(10, 4)

    def step(ids):
        h = F.embedding(ids, table)  # the failing line
        return (h * 2).sum()

    line = step.__code__.co_firstlineno + 1
    with ae.enabled(**IND):
        hot(lambda: step(torch.tensor([1, 2, 3])).item())
        with pytest.raises(IndexError) as info:
            step(torch.tensor([1, 2, 99])).item()
        assert f"test_inductor.py:{line}" in str(info.value)
        assert step(torch.tensor([4, 5, 6])).item() == pytest.approx(
            (F.embedding(torch.tensor([4, 5, 6]), table) * 2).sum().item(), rel=1e-5
        )


def test_training_within_tolerance():
    torch.manual_seed(0)

    def run(engine):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                    torch.nn.Dropout(0.1), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        xs, ys = torch.randn(12, 6, 8), torch.randint(0, 4, (12, 6))
        out = []
        with ae.enabled(**IND) if engine else contextlib.nullcontext():
            for i in range(12):
                loss = F.cross_entropy(model(xs[i]), ys[i])
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.item())
                if engine and i == 3:
                    wait_compiles()
        return out

    ref = run(False)
    d = Delta()
    got = run(True)
    assert got == pytest.approx(ref, rel=1e-4)
    assert d.cache_hits >= 5


def test_slow_graph_is_retired(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_RETIRE_RATIO", "0.000001")
    x = torch.randn(64)
    with ae.enabled(**IND):
        hot(lambda: chain(x).sum().item())
        for _ in range(8):
            chain(x).sum().item()
        assert any(r.startswith("path retired: slower than eager") for r in ae.stats().fallbacks)
        d = Delta()
        assert chain(x).sum().item() == pytest.approx(chain(x).sum().item())
        assert d.replays == 0 and d.ops_eager > 0


def test_variant_budget(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_VARIANTS", "1")
    x = torch.randn(64)
    keep = []
    with ae.enabled(**IND):
        hot(lambda: chain(x).sum().item())
        y = chain(x)  # keeping the chain's result changes the live outputs: a new variant
        keep.append(y)
        s = y.sum().item()
        assert any("variant budget exhausted" in r for r in ae.stats().fallbacks)
    assert s == pytest.approx(chain(x).sum().item(), rel=1e-5)


def test_random_ops_bitwise_under_inductor():
    def f():
        x = torch.rand(64)
        return F.dropout(x, 0.5) * 2 + torch.randn(64)

    torch.manual_seed(2)
    ref = [f() for _ in range(8)]
    ref_state = torch.get_rng_state()
    torch.manual_seed(2)
    got = []
    with ae.enabled(**IND):
        for i in range(8):
            got.append(f())
            ae.mark_step()
            if i == 2:
                wait_compiles()
        assert ae.stats().cache_hits >= 4
    assert torch.equal(torch.get_rng_state(), ref_state)
    for a, b in zip(got, ref):
        assert torch.equal(a == 0, b == 0)  # the same dropout mask
        torch.testing.assert_close(a, b)


def test_failed_compile_keeps_the_path_hot_as_an_exact_replay(monkeypatch):
    from adaptive_eager.scheduler import backends

    def broken(*args, **kwargs):
        raise RuntimeError("lowering not supported")

    monkeypatch.setitem(backends.BACKENDS, "inductor", broken)
    monkeypatch.setitem(backends.BACKENDS, "inductor-process", broken)
    x = torch.randn(64)
    ref = chain(x, 1.25).sum().item()
    with ae.enabled(**IND):
        hot(lambda: chain(x, 1.25).sum().item())
        d = Delta()
        got = [chain(x, 1.25).sum().item() for _ in range(3)]
        assert d.replays == 3 and d.launches == 6  # still one launch (+ the read) per run
        assert d.fallbacks == {"no fused graph (its compile failed): replayed exactly": 3}
    assert got == [ref] * 3  # exact replay: bitwise
    assert ae.stats().fallbacks["compile failed: RuntimeError: lowering not supported"] == 1


def test_cpu_graphs_get_the_cpp_wrapper_or_count_why_not(monkeypatch):
    # Note [C++ wrappers]: compiled here (no compile process) so the test sees the calls
    from torch._inductor import compile_fx

    real, calls = compile_fx.compile_fx_inner, []

    def no_cpp_wrapper(*args, **kwargs):
        calls.append(bool(kwargs.get("cpp_wrapper")))
        if kwargs.get("cpp_wrapper"):
            raise RuntimeError("no C++ wrapper here")
        return real(*args, **kwargs)

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_COMPILE_PROCESS", "0")
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_CPP_WRAPPER", "1")
    x = torch.randn(64)
    ref = chain(x, 1.75).sum().item()
    with ae.enabled(**IND):
        monkeypatch.setattr(compile_fx, "compile_fx_inner", no_cpp_wrapper)
        hot(lambda: chain(x, 1.75).sum().item())
        d = Delta()
        got = chain(x, 1.75).sum().item()
        assert d.cache_hits == 1  # fused all the same, by the Python wrapper
    assert calls == [True, False]
    why = [k for k in ae.stats().fallbacks if k.startswith("C++ wrapper not built")]
    assert len(why) == 1 and "RuntimeError: no C++ wrapper here" in why[0], why
    assert got == pytest.approx(ref, rel=1e-5)


def test_shape_variants_of_one_path_share_the_compile_budget(monkeypatch):
    # A decode step with a cache growing by one row per step: the same ops at a new shape
    # each step, so a new path each step. Past the variant budget the family's new members
    # replay exactly instead of compiling. The size is only an argument of an op here, in no
    # graph input, so the family gets no symbolic graph (tests/test_families.py), counted.
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_VARIANTS", "2")
    w = torch.randn(8)

    def decode(n):
        return (torch.ones(n, 8) * w + 1.0).sum().item()

    lengths = range(2, 7)
    ref = [decode(n) for n in lengths]
    with ae.enabled(**IND):
        for _ in range(3):
            got = [decode(n) for n in lengths]
        wait_compiles()
        got = [decode(n) for n in lengths]
        s = ae.stats()
    assert got == pytest.approx(ref, rel=1e-5)
    assert s.graphs_compiled == 2
    over = [r for r in s.fallbacks if r.startswith("shape variants of one path over")]
    assert len(over) == 1 and s.fallbacks[over[0]] == 3 and "test_inductor.py" in over[0]
    assert s.fallbacks["no fused graph (shape variants over budget): replayed exactly"] >= 3
    assert s.fallbacks["no symbolic graph for the family (the size is no whole dimension of an "
                       "input)"] == 1
