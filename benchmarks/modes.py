"""The suite's modes: the ways a user can run a workload, and the interception floor.

``MODES[name].build(builder, device, size)`` returns a :class:`Run` (its ``step()`` and the
context the mode is active in), or raises :class:`NotApplicable` naming why the mode does not
run on that device. Every mode gets its own freshly built workload (same seed, same data).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_eager as ae
from adaptive_eager.tracer.mode import skip_rule_lookup
from benchmarks.workloads import Workload

__all__ = ["MODES", "NotApplicable", "Run", "FloorMode"]


class NotApplicable(Exception):
    """The mode does not run on this device (the table says why)."""


@dataclasses.dataclass
class Run:
    step: Callable[[], object]
    active: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    engine: bool = False  # the engine's counters describe this run
    compiles: bool = False  # warm once its background compiles are done
    floor: "FloorMode | None" = None
    note: str = ""


@dataclasses.dataclass
class Mode:
    name: str
    build: Callable[[Callable[[str, str], Workload], str, str], Run]
    about: str


def _eager(builder, device, size):
    w = builder(device, size)
    return Run(w.step, note=w.note)


def _adaptive(backend):
    def build(builder, device, size):
        w = builder(device, size)
        return Run(w.step, lambda: ae.enabled(devices=(device,), backend=backend), engine=True,
                   compiles=backend != "exact", note=w.note)

    return build


def _compile(builder, device, size):
    if device == "neuron":
        import adaptive_eager.neuron as neuron

        if neuron.is_emulated() and not neuron.is_native():
            raise NotApplicable("torch.compile's neuron backend runs on the C++ emulated "
                                "device, not the Python emulator")
    w = builder(device, size)
    kw = {"backend": "neuron"} if device == "neuron" else {}
    if device == "cuda":
        kw["mode"] = "reduce-overhead"
    compiled = torch.compile(**kw)
    body = w.compile(compiled) if w.compile else compiled(w.body)
    return Run(lambda: w.finish(body()), note=w.note)


def _lazy(builder, device, size):
    if device != "cpu":
        raise NotApplicable(f"torch._lazy's TorchScript backend runs on cpu only, not {device}")
    import torch._lazy
    import torch._lazy.ts_backend

    if not getattr(_lazy, "initialized", False):
        torch._lazy.ts_backend.init()
        _lazy.initialized = True
    w = builder("lazy", size)
    return Run(w.step, note=w.note)


class FloorMode(TorchDispatchMode):
    """The lowest per-op cost any dispatch mode can have: it records one step's outputs and
    from then on returns them by position and runs nothing.

    The recorded step is the third: first steps differ from later ones (an optimizer creates
    its state on its first step, libraries initialise lazily).

    View ops still run (autograd must attach a fresh view to its base; they compute nothing).
    Where the program's op sequence differs from the recording (autograd steals or copies a
    gradient depending on reference counts, so a step can differ by a few ops), the mode looks
    a few ops ahead to realign, else runs the op: ``misses`` counts those, so the figure says
    how close it is to a pure floor. Values are stale: only time is meaningful.
    """

    LOOKAHEAD = 8
    RECORD_STEP = 2  # zero-based

    def __init__(self):
        super().__init__()
        self.recorded: list | None = None
        self.recording: list = []
        self.steps = 0
        self.i = 0
        self.misses = 0

    def begin_step(self) -> None:
        if self.recorded is None and self.steps > self.RECORD_STEP:
            self.recorded, self.recording = self.recording, []
        self.steps += 1
        self.i = 0

    def _dispatch(self, func, types, args, kwargs=None):
        rec = self.recorded
        if rec is None:
            out = func(*args, **(kwargs or {}))
            if self.steps > self.RECORD_STEP:
                self.recording.append((func, func.is_view, out))
            return out
        i = self.i
        if i < len(rec) and rec[i][0] is func:
            self.i = i + 1
            entry = rec[i]
        else:
            for j in range(i, min(i + self.LOOKAHEAD, len(rec))):
                if rec[j][0] is func:
                    self.i = j + 1
                    entry = rec[j]
                    break
            else:
                self.misses += 1
                return func(*args, **(kwargs or {}))
        if entry[1]:
            return func(*args, **(kwargs or {}))
        return entry[2]


# As for the engine's own mode: assigned after class creation (a method defined in the class
# body would be wrapped in torch._disable_dynamo, ~0.5 us per op), and the dispatcher's
# per-op rule lookup skipped (Note [Dispatch rule lookup], ~1 us per op). Neither is work a
# mode must do, so neither belongs in the floor.
FloorMode.__torch_dispatch__ = FloorMode._dispatch
skip_rule_lookup(FloorMode)


def _floor(builder, device, size):
    w = builder(device, size)
    mode = FloorMode()

    def step():
        mode.begin_step()
        return w.step()

    return Run(step, lambda: mode, floor=mode, note=w.note)


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("eager", _eager, "plain PyTorch, op by op"),
    Mode("adaptive", _adaptive("inductor"), "the engine, fused Inductor graphs"),
    Mode("adaptive-exact", _adaptive("exact"), "the engine, recorded ops replayed (bitwise)"),
    Mode("torch.compile", _compile,
         "torch.compile of the step (default mode; reduce-overhead on cuda)"),
    Mode("torch._lazy", _lazy, "LazyTensor with its TorchScript backend (cpu)"),
    Mode("floor", _floor, "a dispatch mode that returns recorded outputs and runs nothing"),
)}
