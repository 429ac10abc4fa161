"""One OpInfo case under the engine: the program it runs, and how its outcome is judged.

A *case* is an op, a dtype, a device and some of the op's samples. Each sample runs inside a
short recurring step, so that the engine really defers and replays it::

    inputs = clone(sample tensors)         # produced by a deferred op
    out    = op(inputs...)                 # the op under test
    used   = clone(out)                    # consumed by a later deferred op
    grads  = autograd.grad(out, leaves)    # with gradients: backward under the engine too
    used[0].reshape(-1)[0].item()          # the step ends at a host read (a sync)

The step runs ``ITERATIONS[backend]`` times under the engine with ``hot_threshold=2``: two
cold runs learn the path, the third replays it (exactly, while a fused graph compiles), and
with ``inductor`` the run waits for the graph once so that the last runs use it. Every run
is seeded alike and starts from its own copy of the sample, so each must equal the one
eager run: bitwise with ``exact``, within the OpInfo's tolerances with ``inductor``.

The last run is also *classified* from the engine's counters: ``identical`` needs its ops
deferred and replayed with no fallback; a run that took a fallback or a boundary is
``fallback`` with the reasons the engine counted (a run with neither is ``silent``: the
engine ran the ops eagerly and said nothing, which the contract forbids).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_eager as ae

from .compare import Mismatch, compare, tolerance

__all__ = ["Case", "Outcome", "run_case", "run_error_input", "device_differs", "copy_sample",
           "ITERATIONS", "SEED"]

SEED = 1234
ITERATIONS = {"exact": 4, "inductor": 5}
_WAIT_BEFORE = 3  # inductor: the run before which the fused graph is awaited
_COMPILE_TIMEOUT = 600.0
_EAGER_REPEATS = 90  # before a mismatch is judged: eager again, up to this many times

# Ops whose values are unspecified: OpInfo's own tests compare only their metadata.
UNSPECIFIED = frozenset({
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
    "empty_permuted", "torch.empty_permuted",
})


@dataclasses.dataclass
class Case:
    op: object  # an OpInfo
    dtype: torch.dtype
    device: str  # "cpu" | "neuron"
    samples: list  # SampleInputs on ``device``
    grad: bool = False
    autocast: torch.dtype | None = None  # run under torch.autocast(device, this dtype)
    # the same samples on cpu, for a device other than cpu: a sample the engine gets wrong is
    # first checked against plain eager there (device_differs) before it is diagnosed
    cpu_samples: list | None = None


@dataclasses.dataclass
class Outcome:
    """What happened to one sample (or one error input)."""

    # identical | fallback | host | no-op | eager-error | skipped | dispatch-mode |
    # eager-nondeterministic | device-bug | mismatch | crash | silent
    status: str
    reasons: tuple = ()  # the fallback / boundary reasons the engine counted in the last run
    detail: str = ""
    device_diff: str | None = None  # what plain eager on the device does otherwise than cpu

    @property
    def failed(self) -> bool:
        return self.status in ("mismatch", "crash", "silent")


# ---------------------------------------------------------------------------- samples


def _dense(t: torch.Tensor) -> bool:
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return is_non_overlapping_and_dense_or_false(t)


def _map(fn, x):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, list):
        return [_map(fn, v) for v in x]
    if isinstance(x, tuple):
        return tuple(_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return x


def _copy_tensor(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor with ``t``'s value, layout and requires_grad (a leaf when ``t`` is)."""
    with torch.no_grad():
        if t.layout != torch.strided:
            c = t.clone()
        elif _dense(t):
            c = t.clone(memory_format=torch.preserve_format)
        elif t._base is not None:
            base = t._base.clone(memory_format=torch.preserve_format)
            c = base.as_strided(t.size(), t.stride(), t.storage_offset())
        else:
            c = t.clone()
    return c.requires_grad_(t.requires_grad) if t.is_leaf or not t.requires_grad else c


def copy_sample(sample):
    """(input, args, kwargs) of a fresh copy of ``sample``."""
    return (_map(_copy_tensor, sample.input), _map(_copy_tensor, list(sample.args)),
            _map(_copy_tensor, dict(sample.kwargs)))


def leaves_of(copied) -> list:
    out = []
    _map(lambda t: out.append(t) if t.requires_grad and t.is_leaf else None, copied)
    return out


# ---------------------------------------------------------------------------- the step


def _produce(t: torch.Tensor) -> torch.Tensor:
    """The input as the output of an op (deferred under the engine) where its layout allows;
    other layouts (views that are not dense, sparse) stay external inputs."""
    if t.layout == torch.strided and _dense(t):
        return t.clone(memory_format=torch.preserve_format)
    return t


def _tensors(x) -> list:
    out = []
    _map(out.append, x)
    return out


def _call(op, copied):
    inp, args, kwargs = _map(_produce, copied)
    fn = getattr(op, "op", None)  # an OpInfo calls its ``op``
    return (op if fn is None else _as_called_now(fn))(inp, *args, **kwargs)


def _as_called_now(fn):
    """What a program calling ``fn`` by its name gets now: the engine wraps a few functions
    while it is enabled (adaptive_eager/formulas.py), and the OpInfo holds the function it
    found when op_db was imported."""
    from adaptive_eager import formulas

    return formulas.current(fn)


def _sample_step(op, copied, grad_outs):
    """One sample's part of the step: (op output, consumer, grads or None)."""
    out = _call(op, copied)
    used = [t.clone() if t.layout == torch.strided else t for t in _tensors(out)]
    grads = None
    if grad_outs is not None:
        diff = [t for t in _tensors(out) if t.requires_grad]
        grads = torch.autograd.grad(diff, leaves_of(copied), grad_outs, allow_unused=True)
        used += [g.clone() for g in grads if g is not None]
    return out, used, grads


def _host_read(used) -> None:
    """End the step at a read of a tensor the engine manages (a 0-dim CPU tensor is a host
    scalar, Note [Host scalars]: reading it would not end the step's segment)."""
    for t in used:
        if t.layout == torch.strided and t.numel() and (t.dim() or t.device.type != "cpu"):
            t.reshape(-1)[0].item()
            return
    ae.synchronize()


def _ambient(case: Case, on: bool):
    if case.autocast is None or not on:
        return contextlib.nullcontext()
    return torch.autocast(case.device, dtype=case.autocast)


def _step(case: Case, copies, grad_outs, autocast_on=True, marks=None):
    """One run of the step; with ``marks``, the engine's counters are appended to it after
    each sample (reading them issues no op: the step's path is unchanged)."""
    results = []
    torch.manual_seed(SEED)
    with _ambient(case, autocast_on):
        used_all = []
        for copied, gouts in zip(copies, grad_outs):
            out, used, grads = _sample_step(case.op, copied, gouts)
            results.append((out, grads))
            used_all += used
            if marks is not None:
                marks.append(_mark())
        _host_read(used_all)
    return results


def _grad_outs(case: Case, copies, autocast_on=True):
    """Fixed output gradients, one list per sample (None without gradients)."""
    if not case.grad:
        return [None] * len(copies)
    from torch.testing import make_tensor

    out = []
    torch.manual_seed(SEED + 1)
    for copied in copies:
        with _ambient(case, autocast_on):
            res = _call(case.op, copied)
        diff = [t for t in _tensors(res) if t.requires_grad]
        out.append([make_tensor(t.shape, dtype=t.dtype, device=t.device, low=-1, high=1)
                    for t in diff] if diff else None)
    return out


# ---------------------------------------------------------------------------- running


def _schedule(case: Case, backend: str) -> list[bool]:
    """Per run: is autocast on? Autocast cases leave it once before the last run and enter
    it again, so that a path learned under autocast must not replay without it."""
    n = ITERATIONS[backend]
    if case.autocast is None:
        return [True] * n
    return [True] * (n - 1) + [False, True]


def run_case(case: Case, backend: str) -> list[Outcome]:
    """Run ``case`` in eager and under the engine; one Outcome per sample of the case.

    The samples run together in one step (one segment, one graph: with ``inductor`` one
    compile for the case). Each sample's outcome is read from the engine's counters between
    samples (``_attribute``); a sample whose outcome that cannot tell, or that differs from
    eager, runs again alone, to be judged (and diagnosed) by itself.
    """
    out = _run(case, backend)
    if len(case.samples) == 1:
        return [out[0] or Outcome("crash", detail="unattributed")]
    return [o if o is not None and not o.failed else _alone(case, k, backend)
            for k, o in enumerate(out)]


def _alone(case: Case, k: int, backend: str) -> Outcome:
    """Sample ``k`` of ``case`` run and judged by itself."""
    cpu = None if case.cpu_samples is None else [case.cpu_samples[k]]
    one = dataclasses.replace(case, samples=[case.samples[k]], cpu_samples=cpu)
    return _run(one, backend)[0] or Outcome("crash", detail="unattributed")


def _run(case: Case, backend: str) -> list[Outcome]:
    n = len(case.samples)
    schedule = _schedule(case, backend)
    # eager, once per autocast state the schedule uses
    reference = {}
    try:
        for on in sorted(set(schedule)):
            copies = [copy_sample(s) for s in case.samples]
            gouts = _grad_outs(case, copies, on)
            reference[on] = (_step(case, copies, gouts, on), gouts)
    except Exception as e:  # noqa: BLE001 -- the engine must raise the same (run_error_input)
        if n > 1:
            return _split(case, backend)
        return [_same_error(case, backend, e)]
    exact = backend == "exact"
    rtol, atol = tolerance(case.op, case.dtype)
    unspecified = case.op.name in UNSPECIFIED
    runs = []
    try:
        with ae.enabled(devices=(case.device,), backend=backend, hot_threshold=2):
            for i, on in enumerate(schedule):
                if backend != "exact" and i == _WAIT_BEFORE:
                    ae.wait_compiles(_COMPILE_TIMEOUT)
                copies = [copy_sample(s) for s in case.samples]
                gouts = [_map(_copy_tensor, g) for g in reference[on][1]]
                marks = [_mark()]
                runs.append((on, _step(case, copies, gouts, on, marks)))
                after = ae.stats()
    except Exception as e:  # noqa: BLE001
        return [Outcome("crash", detail=_summary(e))] * n
    finally:
        ae.reset()
    outcomes = []
    for k in range(n):
        try:
            for i, (on, results) in enumerate(runs):
                got, want = results[k], reference[on][0][k]
                compare(got[0], want[0], exact=exact, rtol=rtol, atol=atol,
                        values=not unspecified, where=f"run {i} output")
                if want[1] is not None:
                    compare(got[1], want[1], exact=exact, rtol=rtol, atol=atol,
                            values=not unspecified, strides=False, where=f"run {i} grad")
        except Mismatch as e:
            outcomes.append(_diagnose(case, backend, runs, reference, k, e) if n == 1
                            else Outcome("mismatch", detail=str(e)))
            continue
        outcomes.append(_classify(marks[0][0], after) if n == 1 else
                        _attribute(marks, after, k))
    return outcomes


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that runs every op as it comes (what any dispatch mode changes)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _diagnose(case, backend, runs, reference, k, mismatch) -> Outcome:
    """A single sample's result differs from eager's: is it the engine?

    Note [Any dispatch mode]: ATen's composite ops ask ``isTensorSubclassLike``, which is
    true for every tensor while a dispatch mode is active, and then take the path written
    for subclasses (``linalg_svdvals`` computes the singular vectors too, reductions'
    backward scatter instead of index): eager under a mode that runs every op unchanged
    differs from plain eager in the last bits. The engine intercepts through a mode, so it
    inherits that; the sweep reports it in its own column (``dispatch-mode``) when the
    engine equals eager-under-a-pass-through-mode, not as an engine failure. Eager that
    differs from itself (``eager-nondeterministic``) is compared within tolerance.
    """
    if case.cpu_samples is not None:
        # plain eager on the device already differs from cpu: the engine cannot be judged
        # (and the device's eager is slow to diagnose)
        diff = device_differs(case, case.cpu_samples)
        if diff:
            return Outcome("device-bug", detail=f"plain eager on {case.device} differs from "
                           f"cpu ({diff})", device_diff=diff)
    exact = backend == "exact"
    rtol, atol = tolerance(case.op, case.dtype)
    schedule = [on for on, _ in runs]
    try:
        # eager again, a few times, each after another allocation history (Note [Eager reads
        # uninitialised memory]): the emulated device's random draws vary run to run too
        for repeat in range(_EAGER_REPEATS):
            _perturb_allocator(case.device, repeat)
            for on in sorted(set(schedule)):
                copies = [copy_sample(s) for s in case.samples]
                again = _step(case, copies, _map(_copy_tensor, reference[on][1]), on)
                _compare_sample(again[k], reference[on][0][k], True, 0, 0, case)
    except Mismatch:
        try:
            for i, (on, results) in enumerate(runs):
                _compare_sample(results[k], reference[on][0][k], False, rtol, atol, case)
        except Mismatch as e:
            if case.device != "cpu":  # plain eager on the device is not reproducible
                return Outcome("device-bug", detail=f"plain eager on {case.device} differs "
                               f"from itself: {e}")
            return Outcome("mismatch", detail=f"eager is not deterministic, and beyond its "
                           f"tolerance: {e}")
        return Outcome("eager-nondeterministic", detail=str(mismatch))
    try:
        with _PassThrough():
            moded = {}
            for on in sorted(set(schedule)):
                copies = [copy_sample(s) for s in case.samples]
                moded[on] = _step(case, copies, _map(_copy_tensor, reference[on][1]), on)
        for i, (on, results) in enumerate(runs):
            _compare_sample(results[k], moded[on][k], exact, rtol, atol, case)
    except Exception:  # noqa: BLE001 -- not explained by the mode: the engine's difference
        return Outcome("mismatch", detail=str(mismatch))
    return Outcome("dispatch-mode", detail=str(mismatch))


def _perturb_allocator(device, repeat) -> None:
    """Leave other garbage where the next allocations land: a few large NaN-filled buffers
    and many small ones filled with 0, 1, -1 or NaN, of sizes that differ per ``repeat``.

    Note [Eager reads uninitialised memory]: some of PyTorch's own kernels read memory they
    never wrote, so plain eager varies with whatever the allocator hands back. On cpu,
    ``linalg.lstsq``'s default driver ``gelsy`` gets its pivot array from ``at::empty`` and
    LAPACK reads it on entry (a nonzero entry pins that column first), so the solution's last
    bits follow the garbage of a freed 4-byte-per-column block (6 of its 36 float32 samples,
    over 30 perturbed runs). The engine allocates in another order than eager, so it lands on
    other garbage: such a sample is judged ``eager-nondeterministic`` (within tolerance) only
    once eager itself is seen to vary here. Small buffers matter: the pivot array is a few
    bytes, and only a freed block of its size class reaches it.
    """
    pick = random.Random(repeat)
    fill = (0, 1, -1, float("nan"))[repeat % 4]
    junk = [torch.full((pick.randint(1, 5000),), float("nan"), device=device)
            for _ in range(repeat % 7)]
    junk += [torch.full((pick.randint(1, 64),), fill, device=device)
             for _ in range(pick.randint(0, 40))]
    del junk


def _compare_sample(got, want, exact, rtol, atol, case) -> None:
    values = case.op.name not in UNSPECIFIED
    compare(got[0], want[0], exact=exact, rtol=rtol, atol=atol, values=values, where="output")
    if want[1] is not None:
        compare(got[1], want[1], exact=exact, rtol=rtol, atol=atol, values=values,
                strides=False, where="grad")


def _split(case, backend):
    return [_alone(case, k, backend) for k in range(len(case.samples))]


def _classify(before, after) -> Outcome:
    reasons = {r: c - before.fallbacks.get(r, 0) for r, c in after.fallbacks.items()
               if c != before.fallbacks.get(r, 0)}
    if reasons:
        return Outcome("fallback", tuple(sorted(reasons)))
    if after.ops_deferred > before.ops_deferred:
        return Outcome("identical")
    if (after.ops_intercepted - before.ops_intercepted
            == after.ops_passthrough - before.ops_passthrough):
        # nothing the engine manages: shape functions, or a factory that builds its result
        # on another device (a sample without a device argument)
        return Outcome("no-op", detail="the sample issues no op on the device")
    if after.ops_host > before.ops_host:
        return Outcome("host", ("0-dim cpu tensors run on the host (Note [Host scalars])",))
    return Outcome("silent", detail="the last run deferred nothing and counted no fallback")


def _mark():
    """The engine's counters, and how many ops wait in this thread's segment (the hot path
    counts nothing as it goes: deferred ops are counted when their segment launches)."""
    m = ae._engine().mode()
    if m is not None:
        m.settle()  # the ops the dispatch key served, into the segment (tracer/hot_key.py)
    return ae.stats(), (len(m.seg.floats) if m is not None else 0)


def _attribute(marks, after, k) -> Outcome | None:
    """Sample ``k``'s outcome in a step of several, from the counters around its ops
    (``marks[k]`` to ``marks[k + 1]``, see ``_mark``); None where they cannot tell it.

    Fallbacks, boundaries, host scalars and ops run cold are counted as each op comes; an op
    the engine defers either launched within the window or still waits in the segment. So a
    sample whose window counts a reason took a fallback; one that ran ops cold with no reason
    is left to a run of its own (a silent fallback, or a reason its launch counted); one
    that deferred nothing is host-only or a no-op; the rest are identical when the step's
    last launch (after the last sample) deferred ops and counted no reason of its own.
    """
    (w0, p0), (w1, p1), (last, _) = marks[k], marks[k + 1], marks[-1]
    reasons = {r: c - w0.fallbacks.get(r, 0) for r, c in w1.fallbacks.items()
               if c != w0.fallbacks.get(r, 0)}
    if reasons:
        return Outcome("fallback", tuple(sorted(reasons)))
    if w1.ops_eager != w0.ops_eager:
        return None
    entered = w1.ops_deferred - w0.ops_deferred + p1 - p0
    if not entered and w1.ops_host != w0.ops_host:
        return Outcome("host", ("0-dim cpu tensors run on the host (Note [Host scalars])",))
    if not entered and w1.ops_views == w0.ops_views:
        return Outcome("no-op", detail="the sample issues no op on the device")
    step_reasons = any(c != last.fallbacks.get(r, 0) for r, c in after.fallbacks.items())
    if step_reasons or after.ops_deferred == marks[0][0].ops_deferred:
        return None
    return Outcome("identical")


def _same_error(case: Case, backend: str, eager_error: BaseException) -> Outcome:
    """The sample raises in eager: under the engine it must raise the same type."""
    sample = case.samples[0]
    got = _engine_error(case, backend, lambda: _step(
        case, [copy_sample(sample)], _grad_outs(case, [copy_sample(sample)])))
    if got is not None and type(got) is type(eager_error):
        return Outcome("eager-error", detail=_summary(eager_error))
    what = (f"eager raised {type(eager_error).__name__}, the engine did not: "
            f"{_summary(eager_error)}" if got is None else
            f"engine raised {type(got).__name__} where eager raised "
            f"{type(eager_error).__name__}: {_summary(got)}")
    try:  # Note [Any dispatch mode]: a check ATen skips for subclasses, say
        with _PassThrough():
            _step(case, [copy_sample(sample)], _grad_outs(case, [copy_sample(sample)]))
        moded = None
    except Exception as e:  # noqa: BLE001
        moded = e
    if type(moded) is type(got):
        return Outcome("dispatch-mode", detail=what)
    return Outcome("crash", detail=what)


def _engine_error(case, backend, fn, runs: int = 3):
    """The error ``fn`` raises under the engine on every one of ``runs`` runs (the first of
    another type than the first run's, if any); None when a run raised nothing."""
    got = None
    try:
        with ae.enabled(devices=(case.device,), backend=backend, hot_threshold=2):
            for _ in range(runs):
                try:
                    fn()
                except Exception as e:  # noqa: BLE001
                    if got is None or type(e) is not type(got):
                        got = e
                else:
                    return None
    finally:
        ae.reset()
    return got


def run_error_input(op, device: str, error_input, backend: str) -> Outcome:
    """An OpInfo error input: the engine raises eager's exception type on every run, and its
    traceback (or message) names the line of the op call wherever eager's does (an error a
    device reports later, at a sync, names the line of the sync in eager too)."""
    sample = error_input.sample_input
    try:
        copy_sample(sample)
    except Exception as e:  # noqa: BLE001 -- the sample cannot even be copied
        return Outcome("skipped", detail=f"copying the error input raised {_summary(e)}")
    line = []

    def call():
        inp, args, kwargs = _map(_produce, copy_sample(sample))
        line.append(_here())
        op(inp, *args, **kwargs)  # the line an error must name
        _sync(device)  # an asynchronous device raises at a sync: this sample's, not the next

    try:
        call()
    except Exception as e:  # noqa: BLE001
        eager = e
    else:
        return Outcome("eager-error", detail="eager did not raise: not an error input here")
    eager_names = _names_line(eager, line[0] + 1)
    errors = []
    try:
        with ae.enabled(devices=(device,), backend=backend, hot_threshold=2):
            for _ in range(3):
                try:
                    call()
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
                else:
                    errors.append(None)
    except Exception as e:  # noqa: BLE001
        return Outcome("crash", detail=f"leaving the engine raised: {_summary(e)}")
    finally:
        ae.reset()
    for e in errors:
        if e is None:
            return Outcome("crash", detail=f"eager raised {type(eager).__name__}, the engine "
                           "did not")
        if type(e) is not type(eager):
            return Outcome("crash", detail=f"engine raised {type(e).__name__} where eager "
                           f"raised {type(eager).__name__}: {_summary(e)}")
        if eager_names and not _names_line(e, line[-1] + 1):
            return Outcome("crash", detail=f"{type(e).__name__} does not name the op's line: "
                           f"{_summary(e)}")
    return Outcome("identical", detail=type(eager).__name__)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.get_device_module(device).synchronize()


def _here() -> int:
    import sys

    return sys._getframe(1).f_lineno


def _names_line(e: BaseException, lineno: int) -> bool:
    tail = f"{__file__.rsplit('/', 1)[-1]}:{lineno}"
    if tail in str(e):
        return True
    return any(f.filename == __file__ and f.lineno == lineno
               for f in traceback.extract_tb(e.__traceback__))


def _summary(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def device_differs(case: Case, cpu_samples) -> str | None:
    """Plain eager on ``case.device`` against plain eager on cpu for the same samples, and
    their gradients when the case has them (bitwise: the emulated device promises the CPU's
    values). None when they agree; else
    what differs (a bug of the device, reported in its own column)."""
    def run(c):
        copies = [copy_sample(s) for s in c.samples]
        return _step(c, copies, _grad_outs(c, [copy_sample(s) for s in c.samples]))

    try:
        got = run(case)
    except Exception as e:  # noqa: BLE001
        got = e
    cpu_case = dataclasses.replace(case, device="cpu", samples=cpu_samples)
    try:
        want = run(cpu_case)
    except Exception as e:  # noqa: BLE001
        want = e
    if isinstance(got, Exception) or isinstance(want, Exception):
        if type(got) is type(want):
            return None
        return f"device: {_summary(got) if isinstance(got, Exception) else 'ran'}; cpu: " \
               f"{_summary(want) if isinstance(want, Exception) else 'ran'}"
    try:
        compare([r[0] for r in got], [r[0] for r in want], exact=True,
                strides=True, values=case.op.name not in UNSPECIFIED, where="device")
        if case.grad:
            compare([r[1] for r in got], [r[1] for r in want], exact=True, strides=False,
                    values=case.op.name not in UNSPECIFIED, where="device grad")
    except Mismatch as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 -- e.g. device tensors compared on the host
        return _summary(e)
    return None

