"""Building the project's C++ extensions with the machine's compiler, once per source revision.

An extension is compiled by ``torch.utils.cpp_extension`` (ninja, the installed torch's
headers) into ``~/.cache/adaptive_eager/<name>-<torch version>-<source hash>``
(``NEURON_EMULATOR_BUILD_DIR`` overrides the parent directory); a later process loads the built
library in well under a second. The first build says so in one line on stderr. Without a C++
compiler or ninja the error is one line naming what to install, and what to set instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows: torch's own lock file alone
    fcntl = None

__all__ = ["build", "build_dir"]

# Note [One build directory per checkout]: ninja rebuilds an object whose command line
# changed, and the command names the sources' and torch's headers' absolute paths. Two
# checkouts of the same sources (a clone in a temporary directory running the test suite, a
# second virtual environment with the same torch) that shared one build directory rebuilt
# each other's library in turn, each replacing the file the other had loaded; a compile
# process starting in between waited minutes for the build at its low priority and no fused
# graph arrived (measured: neuron llama-train replayed exactly for 300 s while a test
# suite ran from another checkout). So the directory is keyed by those paths too.
_lock = threading.Lock()
_loaded: dict = {}  # build directory -> the loaded extension


def build_dir(name: str, files) -> Path:
    """Where ``name`` is built: keyed by torch's version, its files' contents and where they
    and torch are (Note [One build directory per checkout])."""
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda p: Path(p).name):
        digest.update(Path(f).read_bytes())
        digest.update(str(Path(f).resolve()).encode())
    digest.update(str(Path(torch.__file__).resolve().parent).encode())
    root = os.environ.get("NEURON_EMULATOR_BUILD_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "adaptive_eager")
    return Path(root) / f"{name}-{torch.__version__}-{digest.hexdigest()[:12]}"


class BuildError(RuntimeError):
    """An extension could not be built or loaded; the message is one line and says why."""


def build(name: str, sources, headers=(), *, who: str, what: str, instead: str):
    """Build (if needed) and load the extension ``adaptive_eager_<name>``.

    ``who`` prefixes messages (``adaptive_eager.neuron``), ``what`` names the extension in
    them (``the C++ device``), ``instead`` says what to set without a toolchain. Raises
    ``BuildError`` (one line) when it cannot: no compiler or ninja, a build directory that
    cannot be written (a full disk, a read-only home), a failed compile.
    """
    try:
        return _build(name, sources, headers, who=who, what=what, instead=instead)
    except BuildError:
        raise
    except Exception as e:  # noqa: BLE001 -- said in one line, with what to do instead
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise BuildError(f"{who}: {what} could not be built ({type(e).__name__}: {first}); "
                         f"{instead}") from e


def _build(name: str, sources, headers=(), *, who: str, what: str, instead: str):
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise BuildError(f"{who}: {what} needs a C++ compiler and {compiler!r} is not on "
                         f"PATH; install g++ (e.g. apt install g++), or {instead}")
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        try:  # the ninja package (a dependency) carries the binary, off PATH in an inactive venv
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    if not cpp_extension.is_ninja_available():
        raise BuildError(f"{who}: {what} is built with ninja, which is not on PATH; install "
                         f"it (pip install ninja, or apt install ninja-build), or {instead}")
    sources = [str(s) for s in sources]
    where = build_dir(name, [*sources, *headers])
    # One build and load per process: threads enabling the engine at once (each thread has
    # its own mode) would otherwise build and import the same extension side by side.
    with _lock:
        module = _loaded.get(where)
        if module is None:
            built = any(where.glob("*.so")) if where.exists() else False
            where.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not built:
                print(f"{who}: building {what} once into {where} (a minute or two)",
                      file=sys.stderr, flush=True)
            with _held(where):
                module = _loaded[where] = cpp_extension.load(
                    name=f"adaptive_eager_{name}", sources=sources, build_directory=str(where),
                    extra_cflags=["-O2", "-std=c++17"], verbose=False)
        return module


# Note [A build killed midway]: torch's extension builder marks a build in progress with a
# ``lock`` file in the build directory and every other process waits, polling, until the file
# is gone; a process killed while building (Ctrl-C during the first build, a compile process
# the engine ends) leaves the file behind, and every later process then waited forever
# (measured: a test suite hung 20 minutes at its first compile). So builds also take an OS
# lock on ``build.lock`` beside it, which the system releases when its holder dies; whoever
# holds that lock knows no build is running and removes a ``lock`` file left behind.
@contextlib.contextmanager
def _held(where: Path):
    with open(where / "build.lock", "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = where / "lock"
            if fcntl is not None and stale.exists():
                stale.unlink(missing_ok=True)
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)
