"""The engine beside torch.compile: a compiled function runs, and compiles, without it.

Note [Beside torch.compile]: a function compiled with ``torch.compile`` while the engine is
on (FlexAttention's eager path does it on every call; a user's ``model.compile()``) met the
engine three ways, each fatal: Dynamo skips every frame while a dispatch mode is on the
stack, so a ``fullgraph=True`` compile found nothing to compile; a frame of the mode's own,
entered while the mode runs popped, was traced by Dynamo (Note [Dynamo and the mode],
tracer/mode.py); and the hot path's dispatch key keeps the Python key excluded in the
thread, where Dynamo's fake tensors need it. Compiling with the key off and running with it
on is no answer either: Dynamo's guards include the thread's dispatch keys, so every call
failed its guards and compiled again. So a compiled region is the compiler's:

* what ``torch.compile`` returns (a function, a module's forward, through a decorator too)
  is called with the engine aside (``Engine.aside``): what the engine holds launches first (a
  counted boundary, "compiled function"), the mode leaves the stack and its key goes off, and
  both come back when the call returns; eager code around it is learned and replayed as ever;
* the mode says ``ignore_compile_internals()``, so Dynamo does not skip frames for it;
* a compile Dynamo starts outside such a call (a backward compiled lazily inside
  ``backward()``, ``torch._dynamo.optimize`` used directly) takes the key off while it runs
  (Dynamo's compile callbacks; boundary "torch.compile").

``torch.compile`` is wrapped when the engine is imported (``install``; the wrapper returns
what it returns, called through ``Engine.aside``, which does nothing where the engine is
off), so what is compiled after ``import adaptive_eager`` (after ``import torch`` with
NEURON_ADAPTIVE_EAGER=1) runs aside. Stated limit: a function compiled before that has no
aside; under the engine it compiles (the callbacks below take the key off) but its guards
fail at every call, so it compiles again until Dynamo's recompile limit, then runs as
eager. Dynamo's callbacks exist once ``torch._dynamo`` is imported, which importing the
engine must not cost (~0.8 s): they are registered when the engine is enabled if Dynamo is
loaded, and otherwise by the first ``torch.compile`` call. Dynamo runs the callbacks of the
first of overlapping compiles only (one count for all threads).
"""

from __future__ import annotations

import functools
import sys
import threading

import torch

__all__ = ["install", "hook"]

_lock = threading.Lock()
_hooked = False
_engine = None


def install(engine) -> None:
    """Wrap ``torch.compile`` for ``engine`` (at the engine's import; idempotent)."""
    global _engine
    _engine = engine
    with _lock:
        if not getattr(torch.compile, "_adaptive_eager", False):
            torch.compile = _compile_hooking(torch.compile)


def hook(engine) -> None:
    """The engine is enabled: Dynamo's compile callbacks too, if Dynamo is loaded (cheap)."""
    install(engine)
    if not _hooked and "torch._dynamo" in sys.modules:
        _register()


def _register() -> None:
    global _hooked
    with _lock:
        if _hooked:
            return
        from torch._dynamo import callback

        callback.on_compile_start(_started)
        callback.on_compile_end(_ended)
        _hooked = True


def _compile_hooking(original):
    @functools.wraps(original)
    def compile(*args, **kwargs):
        compiled = original(*args, **kwargs)  # imports Dynamo
        if not _hooked:
            _register()
        model = args[0] if args else kwargs.get("model")
        return _aside_in(compiled, decorator=model is None)

    compile._adaptive_eager = True
    return compile


def _aside_in(compiled, decorator: bool = False):
    """``compiled`` (what torch.compile returned) called with the engine aside."""
    if decorator:  # torch.compile(backend=...) returns what compiles the function it decorates
        @functools.wraps(compiled)
        def decorate(model):
            return _aside_in(compiled(model))

        return decorate
    if isinstance(compiled, torch.nn.Module):  # an OptimizedModule: its forward is Dynamo's
        compiled.forward = _aside_call(compiled.forward)
        return compiled
    return _aside_call(compiled)


def _aside_call(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        engine = _engine
        if engine is None:
            return fn(*args, **kwargs)
        with engine.aside("compiled function"):
            return fn(*args, **kwargs)

    return call


def _started(args) -> None:
    if _engine is not None:
        _engine.compile_started()


def _ended(args) -> None:
    if _engine is not None:
        _engine.compile_ended()
