"""torch.compile on the emulated neuron device (Note [The neuron compile backend])."""

from __future__ import annotations

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import neuron

neuron.ensure()
if not neuron.is_native():  # pragma: no cover -- the suite runs the C++ device
    pytest.skip("the neuron compile backend runs on the C++ device", allow_module_level=True)

from adaptive_eager.neuron import native  # noqa: E402
from adaptive_eager.neuron.compile_backend import LAUNCH_NAME  # noqa: E402

EXT = native.load()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch.compiler.set_default_backend(None)
    torch._dynamo.reset()


def launches() -> dict:
    EXT.synchronize()
    return dict(EXT.launches_by_name())


def compiled_launches(before: dict) -> int:
    return launches().get(LAUNCH_NAME, 0) - before.get(LAUNCH_NAME, 0)


def test_the_backend_is_registered_by_name():
    assert "neuron" in torch.compiler.list_backends()


def test_a_compiled_function_is_one_launch_per_graph_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(4, 8, device="neuron", requires_grad=True)
    w = torch.randn(8, 3, device="neuron", requires_grad=True)

    def f(x, w):
        return (x @ w).relu().sum()

    f(x, w).backward()
    want = (x.grad.cpu(), w.grad.cpu())
    x.grad = w.grad = None
    c = torch.compile(f, backend="neuron")
    c(x, w).backward()  # compiles
    x.grad = w.grad = None
    before = launches()
    loss = c(x, w)
    loss.backward()
    assert compiled_launches(before) == 2  # the forward graph and the backward graph
    assert loss.device.type == "neuron"
    torch.testing.assert_close(loss.cpu(), f(x, w).cpu())
    torch.testing.assert_close((x.grad.cpu(), w.grad.cpu()), want)


class Net(torch.nn.Module):
    # a module of the program's own (Dynamo leaves frames of torch.nn's own modules to eager,
    # so a bare nn.Sequential's model.compile() captures nothing)
    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = (torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                         torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.down(self.norm(torch.nn.functional.gelu(self.up(x))))


def test_set_default_backend_then_model_compile_trains_as_eager():
    def run(compile_it):
        torch.manual_seed(0)
        model = Net().to("neuron")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if compile_it:
            model.compile()
        x = torch.randn(8, 16).to("neuron")
        y = torch.randint(0, 4, (8,)).to("neuron")
        losses = []
        for _ in range(4):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    want = run(False)
    torch.compiler.set_default_backend("neuron")
    before = launches()
    got = run(True)
    assert compiled_launches(before) >= 8  # a forward and a backward graph per step
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_graph_break_runs_the_code_between_graphs_on_the_device():
    def f(x):
        y = x.sin() * 2
        if y.sum().item() > -1e9:  # a host read: Dynamo breaks the graph here
            y = y + 1
        return y.cos()

    x = torch.randn(5, 7, device="neuron")
    before = launches()
    got = torch.compile(f, backend="neuron")(x)
    assert compiled_launches(before) == 2
    torch.testing.assert_close(got.cpu(), f(x).cpu())


def test_dynamic_sizes_compile_once_and_size_their_outputs_per_call():
    def f(x, w):
        return (x @ w).softmax(-1), x.t()

    w = torch.randn(6, 5, device="neuron")
    c = torch.compile(f, backend="neuron", dynamic=True)
    for n in (3, 7, 11):
        x = torch.randn(n, 6, device="neuron")
        before = launches()
        got, view = c(x, w)
        assert compiled_launches(before) == 1
        want, _ = f(x, w)
        assert got.shape == (n, 5)
        torch.testing.assert_close(got.cpu(), want.cpu())
        # the view of an input is that view of the input, not a copy
        assert view.shape == (6, n) and view.untyped_storage().data_ptr() == \
            x.untyped_storage().data_ptr()


def test_an_input_written_by_a_graph_is_written_on_the_device():
    def f(x, y):
        x.add_(y)
        return x * 2

    x, y = torch.randn(4, 4, device="neuron"), torch.randn(4, 4, device="neuron")
    want_x = x.cpu() + y.cpu()
    out = torch.compile(f, backend="neuron")(x, y)
    torch.testing.assert_close(x.cpu(), want_x)
    torch.testing.assert_close(out.cpu(), want_x * 2)


def test_the_engine_learns_the_eager_code_around_a_compiled_model():
    """Under the engine, the compiled model runs as torch.compile's launches and the eager
    code around it is learned and replayed as the engine's; counters tell them apart."""
    torch.manual_seed(0)
    model = Net().to("neuron")
    compiled = torch.compile(model, backend="neuron")
    x = torch.randn(4, 16, device="neuron")

    def step():
        h = compiled(x)
        out = ((h * 3).exp() - 1).sum()  # eager code: the engine's
        return out.item()

    want = [step() for _ in range(2)]
    with ae.enabled(devices=("neuron",)):
        for _ in range(4):
            step()
        before, s = launches(), ae.stats()
        got = step()
        after = launches()
        assert ae.stats().replays > s.replays  # the eager part replays
    assert after.get(LAUNCH_NAME, 0) - before.get(LAUNCH_NAME, 0) == 1
    assert after.get("adaptive_eager graph", 0) > before.get("adaptive_eager graph", 0)
    assert got == pytest.approx(want[-1], rel=1e-6)


def test_an_error_in_a_compiled_graph_is_raised_at_the_next_sync():
    def f(x, i):
        return x[i] * 2

    x = torch.randn(5, device="neuron")
    bad = torch.tensor([1, 9], device="neuron")
    with pytest.raises(Exception) as eager_error:
        f(x, bad).cpu()
    with pytest.raises(type(eager_error.value), match="torch.compile graph|out of bounds"):
        torch.compile(f, backend="neuron")(x, bad).cpu()
    torch.testing.assert_close(torch.compile(f, backend="neuron")(x, bad[:1]).cpu(),
                               f(x, bad[:1]).cpu())  # the device is usable again


def test_attention_compiles_to_the_kernel_eager_chose():
    """The device picks scaled_dot_product_attention's kernel from the inputs' shapes; traced,
    it picks it from their metadata (no memory to read), so the graph runs eager's kernel."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, device="neuron") for _ in range(3))

    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    before = launches()
    got = torch.compile(f, backend="neuron")(q, k, v)
    assert compiled_launches(before) == 1
    torch.testing.assert_close(got.cpu(), f(q, k, v).cpu(), rtol=1e-5, atol=1e-6)


def test_random_ops_draw_from_the_seeded_generator_in_program_order():
    """A graph with random ops draws (eager's kernels, fallback_random) from the generator
    the device's ops draw from, the host waiting for it: a seed reproduces its numbers, and
    a draw after it on the host sees the generator advanced."""
    def f(x):
        return torch.nn.functional.dropout(x, 0.5, training=True) * 2

    c = torch.compile(f, backend="neuron")
    x = torch.ones(64, 64, device="neuron")
    torch.manual_seed(3)
    a, after_a = c(x).cpu(), torch.rand(3)
    torch.manual_seed(3)
    b, after_b = c(x).cpu(), torch.rand(3)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(after_a, after_b)
    torch.manual_seed(3)
    assert not torch.equal(torch.rand(3), after_a)  # the graph drew before it
    assert 0.3 < (a == 0).float().mean().item() < 0.7


def test_a_compiled_model_trains_under_the_engine_as_without_it():
    """Forward and backward compiled, the loss, clipping and optimizer eager: under the engine
    the eager part replays, and a backward graph called by autograd launches what the engine
    holds first (its inputs; before, it read them unwritten from step 5 on)."""
    def train():
        torch.manual_seed(0)
        model = Net().to("neuron")
        compiled = torch.compile(model, backend="neuron")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(8, 16).to("neuron"), torch.randn(8, 4).to("neuron")
        losses = []
        for _ in range(8):
            loss = torch.nn.functional.mse_loss(compiled(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    want = train()
    torch._dynamo.reset()
    with ae.enabled(devices=("neuron",)):
        got = train()
        assert ae.stats().replays > 0
    assert got == want


def test_a_compiled_optimizer_step_updates_as_eager():
    def run(compile_step):
        torch.manual_seed(0)
        params = [torch.randn(6, 5, device="neuron", requires_grad=True) for _ in range(3)]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        step = torch.compile(opt.step, backend="neuron") if compile_step else opt.step
        for _ in range(3):
            for p in params:
                p.grad = p.detach() * 0.5 + 1
            step()
        return [p.detach().cpu() for p in params]

    want = run(False)
    before = launches()
    got = run(True)
    assert compiled_launches(before) >= 2  # the steps after the first (which sets momentum)
    torch.testing.assert_close(got, want)


def test_flex_attention_refuses_the_device_compiled_as_in_eager():
    """PyTorch's FlexAttention runs on cpu, cuda, hpu and mps only: on neuron it raises its
    own error, compiled or not."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 16, 8, device="neuron")
    with pytest.raises(ValueError, match="neuron") as eager:
        flex_attention(q, q, q)
    with pytest.raises(type(eager.value), match="neuron"):
        torch.compile(flex_attention, backend="neuron")(q, q, q)
