"""Interrupts wait for the launch: Ctrl-C never leaves a step half replayed.

Note [Interrupts wait for the launch]: in eager, each op has run by the time the next line
starts, so a ``KeyboardInterrupt`` (Ctrl-C, a notebook's interrupt button) lands between ops
and leaves the program's tensors as they were after the last op that ran. Under the engine
the ops of a segment run later, together, when the segment ends (a read, an optimizer step);
an interrupt arriving while a segment launches stopped it midway: part of the step's ops had
run, the rest never did, and the training went on from a state eager never reaches (found:
an MLP interrupted while its step's exact replay ran at ``loss.item()``; every later loss
and the parameters differed from eager's, silently). So while the engine ends a segment, on
the main thread, a SIGINT is held: the segment launches whole and its bookkeeping completes,
then the ``KeyboardInterrupt`` is raised there, at the user's read, with the state eager
would have at that line. A program that installed its own SIGINT handler keeps it: the
engine then holds nothing. A launch below the floor (C++) runs without the interpreter
between its ops and needs no holding.
"""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["held"]

_depth = 0  # nested holds on the main thread
_pending = False  # a SIGINT arrived while held


def _hold(signum, frame) -> None:
    global _pending
    _pending = True


@contextlib.contextmanager
def held():
    """Run the block with SIGINT held (main thread, default handler only); raise the
    ``KeyboardInterrupt`` after it if one arrived."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are delivered to the main thread only
        return
    if _depth == 0:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield  # the program's own handler (or none): left as it is
            return
        signal.signal(signal.SIGINT, _hold)
    _depth += 1
    failed = True
    try:
        yield
        failed = False
    finally:
        _depth -= 1
        if _depth == 0:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            interrupted, _pending = _pending, False
            if interrupted and not failed:  # an error from the block goes first
                raise KeyboardInterrupt
