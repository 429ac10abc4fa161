"""tracer.native: a hot node's fast path compiled, equal in every observable to the generated
Python one (NEURON_ADAPTIVE_EAGER_HOT_PATH=cpp|python)."""

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import cpp_build
from adaptive_eager.tracer import native

CPU = dict(devices=("cpu",), backend="exact")


def program():
    """One step touching each kind of check the compiled path makes: segment values, old and
    new externals (a fresh batch each step), recorded floats and ints, constants, keyword
    arguments, in-place results (aliases), several results, a factory under the default
    dtype, and an optimizer's in-place updates."""
    torch.manual_seed(1)
    w = torch.randn(8, 4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    out = []

    def step(i):
        x = torch.randn(3, 8)  # a new external every step
        y = (x @ w).relu() * 0.5 + i * 0.25  # a float that changes: recorded
        y = torch.add(y, torch.ones(3, 4), alpha=2.0)  # a keyword argument, a factory
        top, idx = y.max(dim=1, keepdim=True)  # two results
        loss = (y - top).pow(2).mean() + idx.sum() * 0
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append((loss.item(), y.detach().clone()))

    return step, out, w


def run(hot_path, monkeypatch, steps=8):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", hot_path)
    ae.reset()
    step, out, w = program()
    with ae.enabled(**CPU):
        for i in range(steps):
            step(i)
        s = ae.stats()
        kinds = {"entry": type(ae._engine().mode().__torch_dispatch__).__name__}
        stack = [ae._engine().mode().root]
        while stack:
            n = stack.pop()
            stack += n.children.values()
            if n.fast is not None:
                name = type(n.fast).__name__
                kinds[name] = kinds.get(name, 0) + 1
    return out, w.detach().clone(), s, kinds


def counts(s):
    fallbacks = {k: v for k, v in s.fallbacks.items() if not k.startswith("hot path in Python")}
    return (s.launches, s.replays, s.ops_deferred, s.ops_eager, s.ops_views, fallbacks,
            dict(s.boundaries))


def test_compiled_and_generated_fast_paths_agree(monkeypatch):
    step, want, w_eager = program()
    for i in range(8):
        step(i)
    got_py, w_py, s_py, kinds_py = run("python", monkeypatch)
    got_c, w_c, s_c, kinds_c = run("cpp", monkeypatch)
    assert kinds_py.pop("entry") == "method" and kinds_c.pop("entry") == "Dispatch"
    assert set(kinds_py) == {"function"} and kinds_c["FastPath"] > kinds_c["function"]
    for got in (got_py, got_c):
        assert [g[0] for g in got] == [x[0] for x in want]
        assert all(torch.equal(g[1], x[1]) for g, x in zip(got, want))
    assert torch.equal(w_py, w_eager) and torch.equal(w_c, w_eager)
    assert s_c.replays > 0 and counts(s_c) == counts(s_py)
    # each node the compiled path leaves to Python is counted once, with the reason
    left = {k: v for k, v in s_c.fallbacks.items() if k.startswith("hot path in Python")}
    assert sum(left.values()) == kinds_c["function"] and all("(" in k for k in left)


def test_ops_through_the_dispatch_key_equal_eager(monkeypatch):
    # NEURON_ADAPTIVE_EAGER_HOT_PATH=key (Note [Below the floor]): every op reaches the mode
    # through the hot path's dispatch key, and the program's values are eager's, replayed
    got, w, s, _ = run("key", monkeypatch)
    step, want, w_eager = program()
    for i in range(8):
        step(i)
    assert [g[0] for g in got] == [x[0] for x in want]
    assert all(torch.equal(g[1], x[1]) for g, x in zip(got, want))
    assert torch.equal(w, w_eager) and s.replays > 0


@pytest.mark.parametrize("hot_path", ["cpp", "python"])
def test_a_call_that_differs_misses_and_changes_nothing(hot_path, monkeypatch):
    # A hot path whose op gets another tensor than the one it expects (the program switched
    # inputs), or runs under another default dtype: the call misses before anything is
    # recorded, the prefix launches, and the values are eager's.
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", hot_path)
    a, b = torch.randn(16), torch.randn(16)

    def step(x, y):
        z = x * 2 + y
        return (z * torch.ones(16)).sum().item()

    with ae.enabled(**CPU):
        for _ in range(4):
            step(a, b)
        d = ae.stats().fallbacks.get("diverged from the hot path", 0)
        assert step(b, a) == pytest.approx((b * 2 + a).sum().item())
        torch.set_default_dtype(torch.float64)
        try:
            got = step(a, b)
        finally:
            torch.set_default_dtype(torch.float32)
        assert ae.stats().fallbacks.get("diverged from the hot path", 0) > d
    assert step(a, b) == (a * 2 + b).mul(torch.ones(16)).sum().item()
    assert got == (a * 2 + b).double().mul(torch.ones(16, dtype=torch.float64)).sum().item()


def test_only_nodes_it_can_serve_are_compiled():
    # views of segment values and lists of tensors are compiled; views of externals and
    # random ops stay in the generated Python, each with its reason
    x = torch.randn(4, 4)
    with ae.enabled(**CPU):
        for _ in range(4):
            y = (x * 2).t()  # a view of a segment value
            z = torch.cat([y, x + 1]).sum() + x.t().sum()  # a list; a view of an external
            (z + torch.nn.functional.dropout(x, 0.5).sum()).item()
        node, compiled = ae._engine().mode().root, {}
        while node.hot_next is not None:
            node = node.hot_next
            compiled.setdefault(str(node.spec.func), []).append(type(node.fast).__name__)
    reasons = {k.split(" for ")[0] for k in ae.stats().fallbacks if k.startswith("hot path")}
    assert reasons == {"hot path in Python (a view of an external)",
                       "hot path in Python (a random op)"}
    assert compiled["aten.cat.default"] == ["FastPath"]
    assert compiled["aten.t.default"] == ["FastPath", "function"]  # (x * 2).t(), x.t()
    assert set(compiled["aten.mul.Tensor"]) == {"FastPath"}


def test_without_a_compiler_the_error_names_the_setting(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match="NEURON_ADAPTIVE_EAGER_HOT_PATH=python") as e:
        cpp_build.build("fast_path_probe", [native._CSRC / "fast_path.cpp"],
                        who="adaptive_eager", what="the compiled hot path",
                        instead="set NEURON_ADAPTIVE_EAGER_HOT_PATH=python")
    assert "\n" not in str(e.value) and "/nonexistent/c++" in str(e.value)


def test_two_checkouts_of_the_same_sources_build_apart(tmp_path):
    """Note [One build directory per checkout]: the same sources at two paths (a second clone,
    a test suite's temporary checkout) would rebuild each other's library in one directory."""
    a, b = tmp_path / "a" / "x.cpp", tmp_path / "b" / "x.cpp"
    for f in (a, b):
        f.parent.mkdir()
        f.write_text("int x;\n")
    assert cpp_build.build_dir("probe", [a]) != cpp_build.build_dir("probe", [b])
    before = cpp_build.build_dir("probe", [a])
    assert cpp_build.build_dir("probe", [a]) == before
    a.write_text("int y;\n")  # and, as before, keyed by the contents
    assert cpp_build.build_dir("probe", [a]) != before


def test_a_build_killed_midway_does_not_hang_the_next_process(tmp_path):
    """Note [A build killed midway]: the marker file of a build whose process died (here
    planted in a copy of the built extension's directory) no longer makes the next process
    wait for it forever."""
    import os
    import shutil
    import subprocess
    import sys

    built = native.load() and cpp_build.build_dir("fast_path", [native._CSRC / "fast_path.cpp"])
    root = tmp_path / "builds"
    copy = root / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "build.lock"))
    (copy / "lock").touch()  # left by a build that was killed
    env = dict(os.environ, NEURON_EMULATOR_BUILD_DIR=str(root))
    code = "from adaptive_eager.tracer import native; native.load(); print('loaded')"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0 and "loaded" in p.stdout, p.stderr[-2000:]
    assert not (copy / "lock").exists()


def adam_program():
    """A single-tensor Adam step (its step counts are host scalars, Note [Host scalars]) and
    a 0-dim segment value written in place (which must not be run on the host)."""
    torch.manual_seed(2)
    ps = [torch.randn(4, requires_grad=True) for _ in range(3)]
    opt = torch.optim.Adam(ps, lr=0.1, foreach=False)
    out = []

    def step(i):
        loss = sum((p * p).sum() for p in ps)
        s = (ps[0] * 2).sum()  # a 0-dim cpu value of the segment ...
        s.add_(1)  # ... written in place: deferred with the rest, not a host op
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append((loss.item(), s.item()))

    return step, out, ps


def test_host_scalar_ops_run_at_once_in_the_compiled_dispatcher(monkeypatch):
    # Note [Host scalars]: an op the slow path ran on the host, whose tensors are lone host
    # scalars unknown to the segment, is run by the compiled dispatcher without a Python
    # frame; values and every count are the Python path's
    from adaptive_eager.tracer import mode as mode_module

    step, want, ps_eager = adam_program()
    for i in range(6):
        step(i)
    slow = mode_module.AdaptiveEagerMode._slow
    results = {}
    for hot_path in ("python", "cpp"):
        calls = [0]

        def counting(self, *args, _slow=slow, _calls=calls):
            _calls[0] += 1
            return _slow(self, *args)

        monkeypatch.setattr(mode_module.AdaptiveEagerMode, "_slow", counting)
        monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_PATH", hot_path)
        ae.reset()
        step, out, ps = adam_program()
        with ae.enabled(**CPU):
            for i in range(6):
                step(i)
            s = ae.stats()
        results[hot_path] = (out, ps, s, calls[0])
    for out, ps, s, _ in results.values():
        assert out == want
        assert all(torch.equal(p, q) for p, q in zip(ps, ps_eager))
    (_, _, s_py, slow_py), (_, _, s_c, slow_c) = results["python"], results["cpp"]
    assert s_c.ops_host == s_py.ops_host > 0 and s_c.replays > 0
    assert counts(s_c) == counts(s_py) and s_c.ops_passthrough == s_py.ops_passthrough
    assert slow_c <= slow_py - s_py.ops_host // 2  # most host ops never reached _slow


def test_compiled_alias_groups_agree():
    from adaptive_eager.scheduler import program

    a, b = torch.randn(8), torch.randn(3, 3)
    tensors = [a, a[2:], b, torch.empty(0), a.view(2, 4), b.t(), torch.randn(2), a.clone(),
               torch.empty(0)]
    assert native.alias_groups(tensors) == program.alias_groups(tensors) == (
        -1, 0, -1, -1, 0, 2, -1, -1, -1)


def test_compiled_written_input_aliased_agrees():
    # a fused graph that writes an input is passed over when that input shares memory with
    # another input: the compiled check answers as lifecycle's Python one for every choice
    # of written inputs
    import itertools
    import types

    from adaptive_eager.scheduler import program
    from adaptive_eager.tracer import lifecycle

    a, b = torch.randn(8), torch.randn(3, 3)
    exts = [a, b, a[2:], torch.empty(0), torch.randn(2), b.t(), torch.empty(0), a.clone()]
    for ext_inputs in [(0, 1, 3, 4, 6, 7), (0, 1, 2, 3, 4, 5, 6, 7), (1, 5), (2, 4)]:
        for r in range(3):
            for mutated in itertools.combinations(range(len(ext_inputs)), r):
                plan = types.SimpleNamespace(ext_inputs=ext_inputs, mutated_inputs=mutated)
                want = lifecycle.written_input_aliased(plan, exts, program.alias_groups)
                assert native.written_input_aliased(plan, exts) == want, (ext_inputs, mutated)
    plan = types.SimpleNamespace(ext_inputs=(0, 2), mutated_inputs=(1,))
    assert native.written_input_aliased(plan, exts)  # a[2:] written, a read: aliased


def test_compiled_storage_reads_make_no_storage_object():
    # Note [Storage objects] (scheduler/storage.py): a storage's Python object, once made,
    # holds its memory, so autograd would stop accumulating into that buffer in place
    from adaptive_eager.scheduler import storage

    m = native.load()
    t = torch.randn(4) * 2
    v = t[1:]
    assert m.storage_ptr(v) == m.storage_ptr(t) == t.data_ptr()
    assert m.storage_nbytes(v) == 16 and m.storage_ptr(torch.empty(0)) is None
    assert not m.storage_alone(t)  # v holds the memory too
    del v
    handle = m.storage_weak(t)
    assert torch._C._storage_Use_Count(handle) == 1  # no storage object was made
    assert m.storage_alone(t)
    t.untyped_storage()  # Python makes one, and it stays while the memory lives
    assert torch._C._storage_Use_Count(handle) == 2
    assert m.storage_alone(t) and storage._alone(t)  # the storage's own object does not count
    del t
    assert torch.UntypedStorage._expired(handle)
    torch.UntypedStorage._free_weak_ref(handle)


def test_compiled_launch_bookkeeping_agrees():
    # the launch's loops over a segment's values, compiled (tracer.native) and in Python
    from types import SimpleNamespace

    from adaptive_eager.scheduler import launch
    from adaptive_eager.tracer import lifecycle, segment

    floats = [(), (1.5, 2.0), (0.25,), [3.0]]
    at = ((1, 1), (2, 0), (1, 0), (3, 0))
    assert native.pick_floats(floats, at) == lifecycle.pick_floats(floats, at) == (
        2.0, 0.25, 1.5, 3.0)
    with pytest.raises(IndexError):
        native.pick_floats(floats, ((2, 1),))
    for release in (native.release_weak, segment.release_weak):
        ts = [torch.randn(2) for _ in range(4)]
        stor = [t.untyped_storage()._weak_ref() for t in ts]
        ts[1] = None  # value 1 dies; value 2 has no storage reference (a view)
        stor[2], ref = None, stor[2]
        torch.UntypedStorage._free_weak_ref(ref)
        path, seg = SimpleNamespace(fresh=(0, 1, 2, 3)), SimpleNamespace(stor=stor)
        assert native.live_values(path, seg) == launch.live_values(path, seg) == (0, 3)
        release(stor)
