"""Where in the user's program: the innermost frame that is not torch, the engine or the
standard library, as ``file:line``.

Used on slow paths only (a new trie node, a boundary, a fallback): a frame walk costs a few
microseconds. The function name of each line is remembered (bounded), so an error raised at
a sync point can show the frame that issued the op (Note [Issuing frames] in
scheduler.launch).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading

import torch

__all__ = ["user_line", "function_at"]

_SKIP: tuple = ()
_STDLIB: tuple = ()
_NAMES: dict = {}  # "file:line" -> function name
_MAX_NAMES = 65536


def _init() -> None:
    global _SKIP, _STDLIB
    import adaptive_eager
    from adaptive_eager import tracer

    paths = sysconfig.get_paths()
    _SKIP = (
        os.path.dirname(torch.__file__),
        os.path.dirname(adaptive_eager.__file__),
        os.path.dirname(tracer.__file__),
        os.path.dirname(__file__),  # scheduler
        "<adaptive_eager",
    )
    _STDLIB = (paths["stdlib"], (paths["purelib"], paths["platlib"]))


def user_line(depth: int = 1, thread: int | None = None) -> str:
    """``file:line`` of the innermost user frame above the caller, else ``<unknown>``.

    ``thread``: where this thread has no user frame (autograd runs a device's backward on
    a worker thread, called from C++), the frames of that thread (the one that called
    ``backward()`` and waits in it) are searched instead.
    """
    if not _SKIP:
        _init()
    line = _walk(sys._getframe(depth + 1))
    if line is None and thread is not None and thread != threading.get_ident():
        line = _walk(sys._current_frames().get(thread))
    return line or "<unknown>"


def _walk(f) -> str | None:
    stdlib, site = _STDLIB
    while f is not None:
        code = f.f_code
        name = code.co_filename
        if not name.startswith(_SKIP) and (not name.startswith(stdlib) or name.startswith(site)):
            line = f"{name}:{f.f_lineno}"
            if line not in _NAMES and len(_NAMES) < _MAX_NAMES:
                _NAMES[line] = code.co_name
            return line
        f = f.f_back
    return None


def function_at(line: str) -> str:
    """The function a line recorded by ``user_line`` is in (``<module>`` if unknown)."""
    return _NAMES.get(line, "<module>")


def traceback_at(line: str, error: BaseException):
    """A one-entry traceback at ``line`` (``file:line`` from ``user_line``), in the function
    the line belongs to; None if the line is unknown. Note [Issuing frames] in
    scheduler.launch says what it is for.

    The entry comes from running ``raise <error>`` compiled under the user's file name at that
    line number, so tracebacks print the user's source line from ``linecache``. The raising
    expression is made as wide as that line (an identifier of underscores), so no
    ``^^^^`` markers point into the middle of it.
    """
    import linecache

    path, _, number = line.rpartition(":")
    if not path or not number.isdigit() or int(number) < 2 or path == "<unknown":
        return None
    n = int(number)
    text = linecache.getline(path, n)
    stripped = text.strip()
    indent = len(text) - len(text.lstrip())
    name = "_" * max(1, len(stripped) - len("raise "))
    source = "\n" * (n - 2) + "if 1:\n" + " " * max(1, indent) + f"raise {name}\n"
    try:
        code = compile(source, path, "exec").replace(co_name=function_at(line))
    except (SyntaxError, ValueError):  # pragma: no cover - a line we cannot stand in for
        return None
    context, cause = error.__context__, error.__cause__
    suppress = error.__suppress_context__
    error.__traceback__ = None  # the stand-in frame is the last one (the op's own are gone)
    try:
        exec(code, {name: error, "__name__": "__adaptive_eager_issuing_frame__"})
    except BaseException as e:  # noqa: BLE001 - it is ``error``
        tb = e.__traceback__.tb_next  # the entry of the compiled line itself
    finally:
        error.__context__, error.__cause__ = context, cause
        error.__suppress_context__ = suppress
    return tb
