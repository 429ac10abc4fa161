"""DESIGN §6 with the exact backend: the engine is invisible except for the launch count."""

import io
import pickle
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptive_eager as ae
from conftest import Delta

CPU = dict(devices=("cpu",), backend="exact")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.ln, self.drop = nn.LayerNorm(16), nn.Dropout(0.2)

    def forward(self, x):
        return self.fc2(self.drop(self.ln(F.gelu(self.fc1(x)))))


def train(opt_factory, steps=8, engine=None):
    torch.manual_seed(0)
    model = Net()
    opt = opt_factory(model.parameters())
    xs, ys = torch.randn(steps, 5, 8), torch.randint(0, 4, (steps, 5))
    losses = []
    ctx = ae.enabled(**engine) if engine else _Null()
    with ctx:
        for i in range(steps):
            loss = F.cross_entropy(model(xs[i]), ys[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "sgd-momentum-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, foreach=False),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_training_bitwise_and_one_launch_per_step(name):
    ref_losses, ref_params = train(OPTIMIZERS[name])
    d = Delta()
    losses, params = train(OPTIMIZERS[name], engine=CPU)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert d.replays >= 5  # hot from the third step on
    assert d.boundaries.get("optimizer step") == 8


def test_random_ops_bitwise():
    def f():
        x = torch.rand(32)
        return (F.dropout(x, 0.5) + torch.randn(32)).sum()

    torch.manual_seed(1)
    ref = [f().item() for _ in range(6)]
    torch.manual_seed(1)
    with ae.enabled(**CPU):
        got = [f().item() for _ in range(6)]
    assert got == ref
    assert ae.stats().replays >= 3


def test_manual_seed_between_defer_and_launch():
    def f():
        return torch.randn(4) * 2

    with ae.enabled(**CPU):
        for _ in range(3):
            f().sum().item()
        torch.manual_seed(5)
        y = f()  # deferred with the generator at seed 5
        torch.manual_seed(7)
        z = torch.randn(4)  # a different path start: y launches first
    torch.manual_seed(5)
    assert torch.equal(y, torch.randn(4) * 2)
    torch.manual_seed(7)
    assert torch.equal(z, torch.randn(4))


def test_inplace_and_views_of_pending():
    def f(x):
        y = x * 2
        v = y[1:3]  # view of a pending value
        v.add_(10)  # in-place through the view
        y.mul_(3)
        return y, v

    x = torch.arange(5.0)
    ref_y, ref_v = f(x)
    with ae.enabled(**CPU):
        for _ in range(4):
            y, v = f(x)
            ae.mark_step()
        assert ae.stats().replays >= 1
    assert torch.equal(y, ref_y) and torch.equal(v, ref_v)
    assert v._base is y or v.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def test_external_mutation_is_visible():
    buf = torch.zeros(4)

    def step(i):
        buf.add_(torch.full((4,), float(i)))
        return buf.sum()

    ref = [step(i).item() for i in range(5)]
    buf.zero_()
    with ae.enabled(**CPU):
        got = [step(i).item() for i in range(5)]
    assert got == ref


def test_aliasing_inputs():
    def f(a, b):
        a.add_(b)
        return a * b

    with ae.enabled(**CPU):
        for _ in range(3):
            x = torch.ones(4)
            f(x, torch.ones(4)).sum().item()
        x = torch.ones(4)
        out = f(x, x)  # the same tensor twice: a different signature, runs correctly
        assert torch.equal(out, torch.full((4,), 4.0)) and torch.equal(x, torch.full((4,), 2.0))
        x = torch.ones(8)
        out = f(x[:4], x[4:])  # disjoint views of one storage
        assert torch.equal(out, torch.full((4,), 2.0))


def _pending():
    """Under the engine, a tensor whose value is deferred."""
    x = torch.arange(6.0).reshape(2, 3)
    for _ in range(3):
        y = (x + 1) * 2
        ae.mark_step()
    return (x + 1) * 2


READS = {
    "tolist": lambda t: t.tolist(),
    "numpy": lambda t: t.numpy().tolist(),
    "array": lambda t: np.asarray(t).tolist(),
    "repr": lambda t: repr(t),
    "str": lambda t: str(t),
    "pickle": lambda t: pickle.loads(pickle.dumps(t)).tolist(),
    "torch.save": lambda t: _saved(t).tolist(),
    "item": lambda t: t[1, 2].item(),
    "float": lambda t: float(t[0, 1]),
    "bool": lambda t: bool(t[0, 0] > 1),
    "eq": lambda t: torch.equal(t, torch.tensor([[2.0, 4, 6], [8, 10, 12]])),
    "dlpack": lambda t: torch.from_dlpack(t).tolist(),
}


def _saved(t):
    f = io.BytesIO()
    torch.save(t, f)
    f.seek(0)
    return torch.load(f)


@pytest.mark.parametrize("read", READS)
def test_reads_of_pending_tensors(read):
    want = READS[read](torch.tensor([[2.0, 4, 6], [8, 10, 12]]))
    with ae.enabled(**CPU):
        t = _pending()
        d = Delta()
        got = READS[read](t)
        assert d.replays == 1, f"{read} did not flush"
    assert got == want


def test_data_ptr_flushes():
    with ae.enabled(**CPU):
        t = _pending()
        d = Delta()
        t.data_ptr()
        assert d.replays == 1
    assert t.tolist() == [[2.0, 4, 6], [8, 10, 12]]


def _resized_step(w, src, x):
    """A step that, as FSDP2 does with an unsharded parameter, allocates ``w``'s memory,
    fills it, computes with it and frees it again."""
    w.untyped_storage().resize_(w.numel() * w.element_size())
    w.copy_(src)
    y = (x @ w).relu() * 2
    w.untyped_storage().resize_(0)
    return y.sum().item()


def test_storage_resize_is_a_boundary():
    # Note [Storage resizes]: without it the deferred ``mm`` read ``w`` after its memory was
    # freed ("data is not allocated yet") where eager ran it before.
    torch.manual_seed(0)
    srcs, x = torch.randn(10, 8, 8), torch.randn(4, 8)
    w = torch.empty(8, 8)
    w.untyped_storage().resize_(0)
    want = [_resized_step(w, srcs[i], x) for i in range(10)]
    with ae.enabled(**CPU):
        d = Delta()
        got = [_resized_step(w, srcs[i], x) for i in range(10)]
        assert d.replays >= 5  # hot, and each launch before the free
        assert d.boundaries.get("storage resize", 0) >= 10
    assert got == want
    assert w.untyped_storage().nbytes() == 0


def test_autograd_gradients_match():
    def f(w, x):
        return ((x @ w).tanh() * 3).sum()

    torch.manual_seed(0)
    w0, x = torch.randn(4, 3), torch.randn(5, 4)
    w = w0.clone().requires_grad_()
    f(w, x).backward()
    ref = w.grad.clone()
    with ae.enabled(**CPU):
        for _ in range(4):
            w = w0.clone().requires_grad_()
            f(w, x).backward()
            assert torch.equal(w.grad, ref)
    assert ae.stats().replays >= 1


def test_deterministic_algorithms_turn_deferral_off():
    x = torch.randn(8)
    with ae.enabled(**CPU):
        for _ in range(3):
            (x * 2).sum().item()
        torch.use_deterministic_algorithms(True)
        d = Delta()
        assert (x * 2).sum().item() == (x * 2).sum().item()
        assert d.replays == 0 and d.ops_deferred == 0
        assert d.fallbacks.get("deterministic algorithms: deferral off", 0) >= 1
        torch.use_deterministic_algorithms(False)
        d = Delta()
        (x * 2).sum().item()
        assert d.replays == 1


def test_two_threads():
    def work(seed, out):
        torch.manual_seed(seed)
        x = torch.randn(64)
        with ae.enabled(**CPU):
            out.append([((x * 2 + 1).relu() * 3).sum().item() for _ in range(20)])

    results = []
    threads = [threading.Thread(target=work, args=(s, results)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not ae.is_enabled()  # this thread never enabled it
    refs = []
    for s in (1, 2):
        torch.manual_seed(s)
        x = torch.randn(64)
        refs.append([((x * 2 + 1).relu() * 3).sum().item()] * 20)
    assert sorted(results) == sorted(refs)
    assert ae.stats().replays >= 30


def test_error_same_type_names_line_and_engine_usable():
    emb = nn.Embedding(10, 4)

    def step(ids):
        h = emb(ids)  # the failing line
        return (h * 2).sum()

    line = step.__code__.co_firstlineno + 1
    with ae.enabled(**CPU):
        for _ in range(4):
            step(torch.tensor([1, 2, 3])).item()
        d = Delta()
        with pytest.raises(IndexError) as info:
            step(torch.tensor([1, 2, 99])).item()
        assert d.replays == 1  # the failing op was deferred and ran at the .item() sync
        assert f"test_semantics.py:{line}" in str(info.value)
        assert "aten.embedding" in str(info.value)
        assert step(torch.tensor([1, 2, 3])).item() == step(torch.tensor([1, 2, 3])).item()


def test_unsupported_op_is_a_counted_boundary():
    x = torch.tensor([0.0, 1.0, 0.0, 2.0])
    with ae.enabled(**CPU):
        for _ in range(3):
            assert torch.nonzero(x * 2).tolist() == [[1], [3]]
    assert any("data-dependent output shape" in r for r in ae.stats().fallbacks)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("make", [
    lambda y: y.to_sparse(),
    lambda y: y.to_sparse_csr(),
    lambda y: torch.quantize_per_tensor(y, 0.1, 0, torch.qint8),
], ids=["sparse_coo", "sparse_csr", "quantized"])
def test_result_that_is_not_a_plain_tensor_is_a_counted_boundary(make):
    # Found by the OpInfo sweep: learning to_sparse crashed ("Cannot access storage of
    # SparseTensorImpl") where eager works.
    x = torch.randn(4, 4)

    def step():
        s = make(x * 2)
        return s.dequantize() if s.is_quantized else s.to_dense()

    ref = step()
    with ae.enabled(**CPU):
        got = [step() for _ in range(4)]
    assert all(torch.equal(g, ref) for g in got)
    fallbacks = ae.stats().fallbacks
    assert any(r.startswith("result is not a plain tensor") for r in fallbacks)
    # a learned boundary ends the hot prefix before it: not a divergence
    assert "diverged from the hot path" not in fallbacks
    assert ae.stats().replays >= 2


def test_zero_tensor_gradient_is_a_counted_boundary():
    # Found by the OpInfo sweep: the gradient of sgn of a real tensor is an
    # _efficientzerotensor, which has no memory; learning it crashed ("Attempted to access the
    # data pointer on an invalid python storage").
    x = torch.randn(3, requires_grad=True)
    g = torch.randn(3)

    def step():
        (gx,) = torch.autograd.grad(torch.sgn(x * 1), [x], g)
        return (gx * 2 + 1).tolist()

    ref = step()
    with ae.enabled(**CPU):
        got = [step() for _ in range(4)]
    assert got == [ref] * 4
    assert any("zero tensor" in r for r in ae.stats().fallbacks)


def test_memory_with_overlapping_elements_is_the_programs():
    # Found by the OpInfo sweep: a replay wrote the hot path's empty_strided((5, 5, 5),
    # (2, 0, 1)) into the tensor the program held, and copy_ refuses overlapping memory. An
    # op that computes nothing runs outside the segment (Note [Ops that compute nothing]):
    # the tensor is an external the segment writes in place.
    def step():
        y = torch.empty_strided((5, 5, 5), (2, 0, 1))
        return y.clone().stride(), (y.fill_(1.5) * 2).sum().item()

    ref = step()
    with ae.enabled(**CPU):
        got = [step() for _ in range(4)]
    assert got == [ref] * 4
    assert ae.stats().replays >= 2 and not ae.stats().fallbacks


def test_tensor_split_reads_pending_indices():
    # Found by the OpInfo sweep: ATen's tensor_split reads a 1-D CPU tensor of indices in C++
    # (no op the engine sees), so deferred indices split at garbage (Note [Reads inside
    # composite ops] in adaptive_eager/composites.py).
    from adaptive_eager import composites

    x = torch.randn(5, 5, 5)
    idx = torch.tensor([1, 3])

    def step():
        parts = torch.tensor_split(x * 1, idx.clone(), 1)
        sections = x.tensor_split(torch.tensor(2).clone())
        y = parts[1] * 2
        return [p.shape for p in parts + sections], y, y.sum().item()

    ref = step()
    with ae.enabled(**CPU):
        got = [step() for _ in range(4)]
        with pytest.raises(RuntimeError, match="to have dtype of long, but got torch.float32"):
            torch.tensor_split(x, torch.tensor([1.0]))
    assert all(g[0] == ref[0] and torch.equal(g[1], ref[1]) for g in got)
    assert ae.stats().replays >= 2
    assert not composites._library  # ATen's own kernel is back once the engine is off


@pytest.mark.parametrize("lengths", ["lists", "tensors"])
def test_ctc_loss_reads_lengths_the_program_wrote(lengths):
    # Found by the OpInfo sweep. With lists, ATen's ctc_loss makes the target lengths a
    # tensor in C++ (``empty``, then a memcpy no op shows): replays read memory of their own
    # (Note [Ops that compute nothing] in tracer/optable.py). With tensors, it reads them through
    # ``data_ptr`` (Note [Reads inside composite ops]): deferred clones read as garbage.
    torch.manual_seed(0)
    log_probs = torch.randn(12, 3, 6).log_softmax(2)
    targets = torch.randint(1, 6, (3, 5))
    il, tl = [12, 11, 12], [5, 3, 4]
    if lengths == "tensors":
        il, tl = torch.tensor(il), torch.tensor(tl)

    def step():
        lp = log_probs.clone()
        args = (il.clone(), tl.clone()) if lengths == "tensors" else (il, tl)
        loss = F.ctc_loss(lp, targets, *args)
        out = loss * 1
        return out, out.item()

    ref = step()
    with ae.enabled(**CPU):
        got = [step() for _ in range(5)]
    assert all(torch.equal(g[0], ref[0]) for g in got)
    assert ae.stats().replays >= 2


def test_an_empty_tensor_filled_outside_any_op_is_read_as_filled():
    # ``empty`` computes nothing: its result is the program's memory, an input of the
    # segment, whatever writes it (Note [Ops that compute nothing])
    import ctypes

    src = np.arange(6, dtype=np.float32)

    def step():
        t = torch.empty(6)
        # a write no op shows, as a C++ composite's memcpy
        ctypes.memmove(t.untyped_storage().data_ptr(), src.ctypes.data, src.nbytes)
        return (t * 2).sum().item()

    ref = step()
    with ae.enabled(**CPU):
        got = [step() for _ in range(5)]
    assert got == [ref] * 5


def test_linalg_values_as_plain_eager():
    # Found by the OpInfo sweep: ATen's svdvals / eigvalsh compute the vectors too whenever a
    # dispatch mode is active, and LAPACK then rounds the values differently (Note [Kernels
    # that see the mode] in adaptive_eager/composites.py).
    from torch.utils._python_dispatch import TorchDispatchMode

    from adaptive_eager import composites

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    a = torch.randn(5, 5)
    s = a + a.mT

    def step():
        x, y = a.clone(), s.clone()
        out = [torch.linalg.svdvals(x), torch.linalg.matrix_norm(x, ord=2),
               torch.linalg.eigvalsh(y), torch.linalg.eigvals(x)]
        out[0].sum().item()  # the step ends at a host read
        return out

    ref = step()
    with PassThrough():  # what any mode does to ATen's kernels: the difference is real
        moded = step()
    assert not torch.equal(moded[0], ref[0]) and not torch.equal(moded[2], ref[2])
    with ae.enabled(**CPU):
        got = [step() for _ in range(4)]
        with PassThrough():  # another mode on the stack: ATen's choice, as in eager
            assert torch.equal(step()[0], moded[0])
        b = a.clone().requires_grad_()
        torch.linalg.svdvals(b).sum().backward()  # a gradient still gets the vectors
    assert all(torch.equal(g, r) for run in got for g, r in zip(run, ref))
    assert ae.stats().replays >= 2
    assert b.grad is not None and not composites._library


def test_device_copy_is_a_boundary():
    x = torch.randn(4)
    with ae.enabled(**CPU):
        for _ in range(3):
            m = (x * 2).to("meta")
            assert m.device.type == "meta" and m.shape == (4,)
    assert any(r.startswith("device copy") for r in ae.stats().fallbacks)


def test_crosscheck_mismatch_raises_with_op_and_line(monkeypatch):
    from adaptive_eager.scheduler import launch

    x = torch.randn(8)

    def f():
        return (x * 3).sum()  # the checked line

    line = f.__code__.co_firstlineno + 1
    with ae.enabled(crosscheck=True, **CPU):
        for _ in range(3):
            f().item()

        replay = launch._run_exact

        def corrupt(path, exts, floats, targets):
            replay(path, exts, floats, targets)
            for t in targets.values():
                t.add_(1)  # a replay that writes a wrong value

        monkeypatch.setattr(launch, "_run_exact", corrupt)
        with pytest.raises(launch.CrosscheckError, match=f"test_semantics.py:{line}"):
            f().item()


@pytest.mark.parametrize("fn", ["prod", "prod_dim", "max", "median"])
def test_backward_formulas_as_plain_eager(fn):
    # Found by the OpInfo sweep: autograd's C++ formulas for prod (and max / median over all
    # elements) take the path written for tensor subclasses whenever a dispatch mode is
    # active, and differ from plain eager in the last bits (adaptive_eager/formulas.py).
    from torch.utils._python_dispatch import TorchDispatchMode

    from adaptive_eager import formulas

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    a = torch.rand(4, 6, dtype=torch.bfloat16) + 0.5
    a[1, 2] = a[2, 3] = a.max() + 1  # max and median with ties
    a[3, :3] = a.flatten().median()
    call = {"prod": lambda x: x.prod(), "prod_dim": lambda x: torch.prod(x, 1),
            "max": lambda x: x.max(), "median": lambda x: torch.median(x)}[fn]

    def step():
        x = a.clone().requires_grad_()
        y = call(x * 1)
        (g,) = torch.autograd.grad(y, x, -torch.ones_like(y))
        g.sum().item()  # the step ends at a host read
        return g

    def same(a, b):  # bitwise: max's subclass path differs from eager in zeros' signs
        return torch.equal(a.view(torch.int16), b.view(torch.int16))

    ref = step()
    with PassThrough():  # what any mode does to the formula: the difference is real
        moded = step()
    assert not same(moded, ref)
    with ae.enabled(**CPU):
        d = Delta()
        got = [step() for _ in range(4)]
        assert d.boundaries.get(formulas.REASON, 0) == 4
        assert ae.stats().replays >= 2
    assert all(same(g, ref) for g in got)
    assert not formulas._ORIGINALS and torch.prod.__name__ == "prod"
