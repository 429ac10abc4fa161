"""Random op programs under the engine, against eager: a property-based fuzzer (hypothesis).

    python -m tests.fidelity.fuzz --programs 10000 --seed 1 --devices cpu,neuron

Note [The fuzzer]: a *program* is a short list of instructions over a growing list of
values: its inputs (floats and ints, some requiring grad), then each instruction's result.
Instructions are pointwise ops with broadcasting and dtype promotion, views and in-place ops
on views (which write their base, an input included), reductions, matmul, concatenation,
random ops, ops whose output shape depends on the data, host reads in the middle whose
value flows back into the program, and a branch on a read value. A run repeats the program
``ITERATIONS`` times on the same inputs (in-place writes accumulate, as a training step's
do), with one seed set before the first iteration and, where the inputs require grad, a
backward through every value that requires it at the end of each iteration. So the engine
records it, replays it, and diverges where the data says so (a branch) or on purpose: a
program may name one iteration at which one op runs another of the same result type.

After each iteration every value, every input and every gradient is compared with eager's
run of the same program on the same device: ``exact`` bitwise (bytes, dtype, shape, strides,
``requires_grad``), a fused backend within tolerance. An error must be eager's type, at the
same iteration and instruction. Programs are drawn by running each candidate instruction
eagerly on the CPU and keeping those that run, so programs are valid where they are drawn;
hypothesis shrinks a failing program to a small one, which becomes a regression test
(tests/fidelity/test_fuzz.py) in that form.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

# A measurement of the engine must never pass because the engine stepped aside.
os.environ["NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO"] = "0"
os.environ["NEURON_ADAPTIVE_EAGER_RETIRE_RATIO"] = "0"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from adaptive_eager.engine import ENGINE  # noqa: E402

from .compare import Mismatch, compare, to_host  # noqa: E402

__all__ = ["Op", "Program", "programs", "check", "ITERATIONS"]

ITERATIONS = 5  # recorded twice (the hot threshold), then replayed
SEED = 1234
SHAPES = ((4, 6), (6,), (4, 1), (1, 6), (2, 3, 4), ())
DTYPES = ("float32", "float32", "float64", "int32")


@dataclasses.dataclass(frozen=True)
class Op:
    """One instruction: ``name`` applied to values ``args`` (indices) and constants."""

    name: str
    args: tuple
    consts: tuple = ()


@dataclasses.dataclass(frozen=True)
class Program:
    inputs: tuple  # (shape, dtype name, requires grad) or ("alias", input, ALIASES key)
    ops: tuple
    swap: tuple | None = None  # (iteration, op index): there the op runs ALT[its name]


def _to(a, dtype):
    if dtype == "int32" and a.is_floating_point():  # a cast of NaN or inf is undefined
        a = a.nan_to_num(0.0).clamp(-1e4, 1e4)
    return a.to(getattr(torch, dtype))


def _index_select(a, idx):
    return a.index_select(0, torch.tensor(idx, device=a.device))


def _no_grad_mul(a, c):
    with torch.no_grad():
        return a * c


def _setitem(a, b):
    a[0] = b
    return a


def _branch(a, b):
    return b.neg() if a.sum().item() > 0 else b.abs()


C = st.sampled_from((0.5, -1.5, 2.0, 3.0))
DIM = st.integers(-2, 1)
# name: (argument kinds: t a tensor value, f a read value; constants; the op)
OPS = {
    # pointwise, broadcasting, promotion
    "neg": ("t", None, torch.neg),
    "abs": ("t", None, torch.abs),
    "relu": ("t", None, torch.relu),
    "tanh": ("t", None, torch.tanh),
    "sigmoid": ("t", None, torch.sigmoid),
    "sin": ("t", None, torch.sin),
    "exp": ("t", None, torch.exp),
    "mul_c": ("t", st.tuples(C), lambda a, c: a * c),
    "add_c": ("t", st.tuples(C), lambda a, c: a + c),
    "to": ("t", st.tuples(st.sampled_from(("float32", "float64", "int32"))), _to),
    "add": ("tt", None, torch.add),
    "sub": ("tt", None, torch.sub),
    "mul": ("tt", None, torch.mul),
    "div": ("tt", None, torch.div),
    "maximum": ("tt", None, torch.maximum),
    "where": ("tt", None, lambda a, b: torch.where(a > 0, a, b)),
    "matmul": ("tt", None, torch.matmul),
    "cat": ("tt", st.tuples(DIM), lambda a, b, d: torch.cat([a, b], d)),
    "pow": ("t", None, lambda a: a.pow(2)),
    "clone": ("t", None, torch.clone),
    # autograd through part of the program
    "detach": ("t", None, lambda a: a.detach()),
    "no_grad_mul": ("t", st.tuples(C), _no_grad_mul),
    "contiguous": ("t", None, lambda a: a.contiguous()),
    # views
    "t": ("t", None, lambda a: a.t()),
    "transpose": ("t", st.tuples(DIM, DIM), lambda a, d0, d1: a.transpose(d0, d1)),
    "reshape": ("t", None, lambda a: a.reshape(-1)),
    "unsqueeze": ("t", st.tuples(DIM), lambda a, d: a.unsqueeze(d)),
    "narrow": ("t", st.tuples(DIM, st.integers(0, 2), st.integers(1, 3)),
               lambda a, d, s, n: a.narrow(d, s, n)),
    "select": ("t", st.tuples(DIM, st.integers(0, 2)), lambda a, d, i: a.select(d, i)),
    "step2": ("t", None, lambda a: a[::2]),
    "expand": ("t", st.tuples(st.integers(2, 3)), lambda a, n: a.expand(n, *a.shape)),
    "diagonal": ("t", None, lambda a: a.diagonal()),
    "split": ("t", None, lambda a: a.split(2)[-1]),
    "unbind": ("t", None, lambda a: a.unbind(0)[0]),
    # in place, on the first argument (a view writes its base)
    "add_": ("tt", None, lambda a, b: a.add_(b)),
    "mul_": ("t", st.tuples(C), lambda a, c: a.mul_(c)),
    "clamp_": ("t", st.tuples(C), lambda a, c: a.clamp_(-abs(c), abs(c))),
    "zero_": ("t", None, lambda a: a.zero_()),
    "copy_": ("tt", None, lambda a, b: a.copy_(b)),
    "masked_fill_": ("tt", st.tuples(C), lambda a, b, c: a.masked_fill_(b > 0, c)),
    "normal_": ("t", None, lambda a: a.normal_()),
    "setitem": ("tt", None, _setitem),
    # reductions and scans
    "sum": ("t", st.tuples(DIM), lambda a, d: a.sum(d)),
    "sum_all": ("t", None, lambda a: a.sum()),
    "mean": ("t", st.tuples(DIM), lambda a, d: a.mean(d, keepdim=True)),
    "amax": ("t", st.tuples(DIM), lambda a, d: a.amax(d)),
    "cumsum": ("t", st.tuples(DIM), lambda a, d: a.cumsum(d)),
    "softmax": ("t", st.tuples(DIM), lambda a, d: a.softmax(d)),
    "argmax": ("t", st.tuples(DIM), lambda a, d: a.argmax(d)),
    "sort": ("t", st.tuples(DIM), lambda a, d: a.sort(d).values),
    "topk": ("t", st.tuples(DIM), lambda a, d: a.topk(2, d).indices),
    # random
    "rand_like": ("t", None, lambda a: torch.rand_like(a, dtype=torch.float32)),
    "dropout": ("t", None, lambda a: F.dropout(a, 0.5, training=True)),
    "bernoulli": ("t", None, lambda a: torch.bernoulli(torch.sigmoid(a))),
    # output shapes that depend on the data, indices made by the program
    "masked_select": ("t", None, lambda a: a[a > 0]),
    "index_select": ("t", st.lists(st.integers(0, 3), min_size=1, max_size=4).map(
        lambda i: (tuple(i),)), _index_select),
    # host reads in the middle; a read value flows back in
    "item": ("t", None, lambda a: a.sum().item()),
    "branch": ("tt", None, _branch),
    "scale": ("tf", None, lambda a, f: a * f),
}
# What an op becomes at a program's swap: another op of the same result dtype and shape.
ALT = {"neg": "abs", "abs": "neg", "relu": "neg", "tanh": "sigmoid", "sigmoid": "tanh",
       "sin": "tanh", "exp": "sigmoid"}


class At(Exception):
    """The program raised at instruction ``where`` (an index, or "backward")."""

    def __init__(self, where, error: BaseException):
        super().__init__(where, error)
        self.where, self.error = where, error


ALIASES = {"same": lambda x: x, "t": lambda x: x.t(), "row": lambda x: x[0],
           "tail": lambda x: x.reshape(-1)[1:]}


def make_inputs(program: Program, device: str) -> list:
    """The program's inputs: drawn values, or ("alias", j, how): a view of input j (two
    arguments sharing memory, as a tied weight or an optimizer's views of a flat buffer)."""
    g = torch.Generator().manual_seed(len(program.ops))
    out = []
    for shape, dtype, grad in program.inputs:
        if shape == "alias":
            out.append(ALIASES[grad](out[dtype]))
            continue
        if dtype == "int32":
            x = torch.randint(-5, 6, shape, generator=g, dtype=torch.int32)
        else:
            x = (torch.randn(shape, generator=g) * 2).to(getattr(torch, dtype))
        out.append(x.to(device).requires_grad_(grad))
    return out


def interpret(program: Program, inputs: list, iteration: int) -> list:
    """Run the program once; values in order (inputs first). Raises ``At``."""
    vals = list(inputs)
    for k, op in enumerate(program.ops):
        name = ALT[op.name] if program.swap == (iteration, k) else op.name
        try:
            vals.append(OPS[name][2](*(vals[i] for i in op.args), *op.consts))
        except Exception as e:  # noqa: BLE001 -- compared with eager's
            raise At(k, e) from e
    grads = [v for v in vals if isinstance(v, torch.Tensor) and v.requires_grad]
    if grads and any(x.requires_grad for x in inputs):
        try:
            sum(v.sum() for v in grads).backward()
        except Exception as e:  # noqa: BLE001
            raise At("backward", e) from e
    return vals


def _snapshot(x):
    """A value as the program could read it: a host read (``numpy()``), as a loop's end
    reads its loss, so each iteration ends at a sync on every device."""
    if not isinstance(x, torch.Tensor):
        return x
    return (tuple(x.stride()), x.requires_grad, torch.from_numpy(to_host(x).numpy().copy()))


def run(program: Program, device: str, backend: str | None) -> list:
    """Each iteration's snapshot: (values, inputs, grads) or ("error", where, type)."""
    inputs = make_inputs(program, device)
    records = []
    torch.manual_seed(SEED)
    engine = (ae.enabled(devices=(device,), backend=backend) if backend
              else contextlib.nullcontext())
    with engine:
        for it in range(ITERATIONS):
            try:
                vals = interpret(program, inputs, it)
            except At as e:
                records.append(("error", e.where, type(e.error).__name__))
                break
            records.append(([_snapshot(v) for v in vals], [_snapshot(x) for x in inputs],
                            [_snapshot(x.grad) if x.is_leaf and x.grad is not None else None
                             for x in inputs]))
            for x in inputs:
                if x.is_leaf:
                    x.grad = None
            if backend not in (None, "exact"):  # later iterations run the fused graphs
                ENGINE.wait_compiles(timeout=300)
    return records


def check(program: Program, device: str, backend: str = "exact"):
    """Raise ``Mismatch`` where the engine's run differs from eager's; else the engine's
    counters for the run (``ae.stats()``)."""
    want = run(program, device, None)
    ae.reset()
    try:
        got = run(program, device, backend)
        stats = ae.stats()
    finally:
        ae.reset()
    exact = backend == "exact"
    for it, (g, w) in enumerate(zip(got, want)):
        where = f"iteration {it}"
        if w[0] == "error" or g[0] == "error":
            if g == w:
                continue
            got_what = f"raised {g[1:]}" if g[0] == "error" else "ran"
            want_what = f"raised {w[1:]}" if w[0] == "error" else "ran"
            raise Mismatch(f"{where}: {got_what} where eager {want_what}")
        for part, gs, ws in zip(("value", "input", "grad"), g, w):
            for k, (a, b) in enumerate(zip(gs, ws)):
                at = f"{where}, {part} {k}"
                if not isinstance(b, tuple):  # a host number (a read): a tensor's value
                    compare(a, b, exact=exact, rtol=1e-4, atol=1e-5, where=at)
                    continue
                if a is None or a[:2] != b[:2]:
                    raise Mismatch(f"{at}: strides, requires_grad {a and a[:2]} != eager's "
                                   f"{b[:2]}")
                compare(a[2], b[2], exact=exact, rtol=1.3e-6 if exact else 1e-4,
                        atol=1e-5, where=at)
    if len(got) != len(want):
        raise Mismatch(f"{len(got)} iterations ran where eager ran {len(want)}")
    return stats


# ------------------------------------------------------------------------- drawing

def _arg_kinds(vals, kinds):
    tensors = [i for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]
    floats = [i for i, v in enumerate(vals) if not isinstance(v, torch.Tensor)]
    return [tensors if k == "t" else floats for k in kinds]


@st.composite
def programs(draw, max_ops: int = 10):
    """Valid programs: each instruction is kept only if it runs eagerly where drawn."""
    inputs = []
    for _ in range(draw(st.integers(1, 3))):
        plain = [j for j, x in enumerate(inputs) if x[0] != "alias" and not x[2]]
        if plain and draw(st.integers(0, 3)) == 0:
            j = draw(st.sampled_from(plain))
            how = draw(st.sampled_from(sorted(ALIASES)))
            if how == "same" or len(inputs[j][0]) == 2:  # t() and [0] of a matrix
                inputs.append(("alias", j, how))
                continue
        dtype = draw(st.sampled_from(DTYPES))
        grad = dtype != "int32" and draw(st.booleans())
        inputs.append((draw(st.sampled_from(SHAPES)), dtype, grad))
    ops = []
    n = draw(st.integers(1, max_ops))
    with torch.random.fork_rng(devices=()):
        torch.manual_seed(SEED)
        vals = make_inputs(Program(tuple(inputs), tuple([None] * n)), "cpu")
        while len(ops) < n:
            name = draw(st.sampled_from(sorted(OPS)))
            kinds, consts, fn = OPS[name]
            pools = _arg_kinds(vals, kinds)
            if not all(pools):
                continue
            args = tuple(draw(st.sampled_from(p)) for p in pools)
            c = draw(consts) if consts is not None else ()
            try:
                vals.append(fn(*(vals[i] for i in args), *c))
            except Exception:  # noqa: BLE001 -- not a valid instruction here: draw again
                continue
            ops.append(Op(name, args, c))
    swappable = [k for k, op in enumerate(ops) if op.name in ALT]
    swap = None
    if swappable and draw(st.booleans()):
        swap = (draw(st.integers(2, ITERATIONS - 1)), draw(st.sampled_from(swappable)))
    return Program(tuple(inputs), tuple(ops), swap)


# ------------------------------------------------------------------------- the long run

def main(argv=None) -> int:
    from hypothesis import HealthCheck, given, seed, settings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", type=int, default=1000, help="programs per device")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--devices", default="cpu,neuron")
    p.add_argument("--backend", default="exact", choices=("exact", "inductor"))
    p.add_argument("--progress", type=int, default=0, metavar="N",
                   help="print a line every N programs (a long run's progress)")
    a = p.parse_args(argv)
    devices = a.devices.split(",")
    if "neuron" in devices:
        import adaptive_eager.neuron  # noqa: F401
    counts = {d: 0 for d in devices}
    replayed = {d: 0 for d in devices}
    start = time.time()
    for device in devices:
        @seed(a.seed)
        @settings(max_examples=a.programs, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(programs())
        def fuzz(program):
            counts[device] += 1
            replayed[device] += check(program, device, a.backend).replays > 0
            if a.progress and counts[device] % a.progress == 0:
                print(f"{device}: {counts[device]} programs so far, 0 mismatches, "
                      f"{replayed[device]} replayed ({time.time() - start:.0f} s)", flush=True)

        fuzz()
        print(f"{device}: {counts[device]} programs, 0 mismatches, {replayed[device]} of them "
              f"replayed by the engine ({time.time() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
