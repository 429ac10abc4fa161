"""A shape family's one symbolic graph (Note [Family graphs], scheduler/symbolic.py), and the
plan forks that let a loop switch between sizes below the floor (Note [Forks in a plan])."""

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.scheduler import symbolic
from adaptive_eager.scheduler.symbolic import NotFamily, Sym
from conftest import wait_compiles

IND = dict(devices=("cpu",), backend="inductor")


def test_a_template_makes_what_differs_a_multiple_of_one_size():
    first = ((4, 16), (16, 1), 64, "f32")
    member = ((8, 16), (16, 1), 128, "f32")
    template, size = symbolic.template(first, member)
    assert template == ((Sym(1), 16), (16, 1), Sym(16), "f32") and size == 8
    assert symbolic.match(template, ((6, 16), (16, 1), 96, "f32")) == 6
    assert symbolic.resolve(template, 5) == ((5, 16), (16, 1), 80, "f32")


@pytest.mark.parametrize("other, why", [
    (((6, 16), (16, 1), 97, "f32"), "97 where the template has 16*s"),
    (((6, 16), (16, 1), 112, "f32"), "sizes 6 and 7"),
    (((6, 17), (16, 1), 96, "f32"), "17 where the template has"),
    (((6, 16), (16, 1), 96, "f16"), "'f32' against 'f16'"),
    (((6, 16, 1), (16, 1), 96, "f32"), "2 items against 3"),
])
def test_a_member_that_is_not_the_template_at_one_size_is_refused(other, why):
    template, _ = symbolic.template(((4, 16), (16, 1), 64, "f32"),
                                    ((8, 16), (16, 1), 128, "f32"))
    with pytest.raises(NotFamily, match=why.replace("*", r"\*")):
        symbolic.match(template, other)


def test_sizes_that_are_not_multiples_of_one_size_make_no_template():
    # a decode step's cache length beside the length plus one
    with pytest.raises(NotFamily):
        symbolic.template(((5, 6),), ((7, 8),))
    with pytest.raises(NotFamily, match="the same sizes"):
        symbolic.template(((5, 6),), ((5, 6),))


def _step(w):
    def step(x):
        return ((x * w + 1.0).relu().sum(0) * 2.0).sum().item()
    return step


def test_past_the_budget_a_family_joins_its_symbolic_graph(monkeypatch):
    # budget 2: the first size gets a graph of its own, the second the family's symbolic
    # graph, and every later size runs that graph: two compiles for nine sizes. Size 1 is
    # not admitted (a symbolic size is at least 2): it replays exactly, counted.
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_VARIANTS", "2")
    torch.manual_seed(0)
    step = _step(torch.randn(8))
    sizes = [3, 5, 2, 4, 6, 7, 9, 8, 1]
    xs = {n: torch.randn(n, 8) for n in sizes}
    ref = [step(xs[n]) for n in sizes]
    with ae.enabled(**IND):
        for _ in range(3):
            [step(xs[n]) for n in sizes]
        wait_compiles()
        [step(xs[n]) for n in sizes]
        before = ae.stats()
        got = [step(xs[n]) for n in sizes]
        s = ae.stats()
        family = [p for p in ae.explain().paths if "every size of its family" in p.backend]
    assert got == pytest.approx(ref, rel=1e-5)
    assert len(family) == len(sizes) - 2  # all but size 1 and the size compiled alone
    assert s.graphs_compiled == 2
    assert not [r for r in s.fallbacks if "over the variant budget" in r]
    assert s.cache_hits - before.cache_hits == len(sizes) - 1
    refused = [r for r in s.fallbacks if r.startswith("the family graph does not admit size 1")]
    assert len(refused) == 1 and s.fallbacks[refused[0]] == 1


def test_a_training_loop_over_batch_sizes_switches_plans_below_the_floor(monkeypatch):
    # Eight batch sizes in turn: each step's first op (the weight's transpose) is shared and
    # the paths part at the first op that reads the batch. After warm-up every step is
    # served by the dispatch key's plan, through a fork at that op, and its fused graph is
    # launched below the floor: no op and no launch reaches the mode.
    import torch.nn as nn
    import torch.nn.functional as F

    from adaptive_eager.tracer import hot_key

    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", "key")
    sizes = [2, 3, 4, 5]

    def run(engine):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        data = {n: (torch.randn(n, 8), torch.randint(0, 4, (n,))) for n in sizes}
        losses, counts = [], None
        ctx = ae.enabled(**IND) if engine else None
        if ctx:
            ctx.__enter__()
        try:
            for r in range(6):
                if r == 3 and engine:
                    wait_compiles()
                if r == 4 and engine:
                    before = hot_key.load().served()
                for n in sizes:
                    x, y = data[n]
                    loss = F.cross_entropy(m(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
            if engine:
                counts = [b - a for a, b in zip(before, hot_key.load().served())]
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
        return losses, [p.detach() for p in m.parameters()], counts

    ref, ref_params, _ = run(False)
    got, params, (served, plans, unexpected, launched, forks) = run(True)
    assert got == pytest.approx(ref, rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(params, ref_params))
    # two rounds: the plan follows the size it was built at, the other three take a fork
    rounds = 2
    assert forks == rounds * (len(sizes) - 1) and unexpected == 0 and served > 0
    assert launched == rounds * len(sizes) and plans == rounds * len(sizes)
