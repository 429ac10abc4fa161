"""The warm-start store: files that outlive the process, safe to share (Note [Warm start]).

Note [The warm-start store]: a directory of small files, one per cached item, under
``<root>/<environment digest>/<kind>/<name>.ae``. The environment digest (tracer.warm)
names everything that changes what an op does, so a process of another torch, package,
device or backend never reads this one's files. Each file is::

    MAGIC  sha256(environment digest + kind + name + payload) as 64 hex digits  "\\n"  payload

so a torn, truncated or edited file, or one copied from another environment or under
another name, fails its check: it is deleted, counted and reported in one line, and the
engine goes on as if it were not there. Writes go to a temporary file in the same directory
and are renamed over the name (``os.replace`` is atomic): ranks of one job and concurrent
runs writing the same item leave one whole file, and a reader sees the old file or the new
one, never a mix. The store is bounded (``NEURON_ADAPTIVE_EAGER_CACHE_MB``): after a write
the least recently used files (a read touches its file) go until it fits.

Payloads can be executable (a graph's generated code), so the store is only used in a
directory that only its user can write: created 0700; an existing root not owned by the
user, or writable by its group or others, is refused (one line, warm start off), never
read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import threading

__all__ = ["MAGIC", "Store", "StoreRefused", "default_root"]

log = logging.getLogger("adaptive_eager")
MAGIC = b"AEWARM1\n"
SUFFIX = ".ae"


class StoreRefused(RuntimeError):
    """The cache directory cannot be used safely (the message says why)."""


def default_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "adaptive_eager", "warm")


def _check_private(path: str) -> None:
    st = os.stat(path)
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise StoreRefused(f"{path} is owned by another user (uid {st.st_uid})")
    if st.st_mode & 0o022:
        raise StoreRefused(f"{path} is writable by its group or others "
                           f"(mode {st.st_mode & 0o777:o}); accepted: 0700")


class Store:
    """One environment's files under ``root``; ``limit`` bytes for the whole root."""

    def __init__(self, root: str, env: str, limit: int):
        self.root = os.path.abspath(root)
        self.env = env
        self.limit = limit
        self.dir = os.path.join(self.root, env)
        self.rejected = 0  # files that failed their check
        self.reads = 0
        self.writes = 0
        self.evicted = 0
        self._lock = threading.Lock()
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        _check_private(self.root)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)

    def _file(self, kind: str, name: str) -> str:
        return os.path.join(self.dir, kind, name + SUFFIX)

    def _digest(self, kind: str, name: str, payload: bytes) -> bytes:
        h = hashlib.sha256()
        for part in (self.env, kind, name):
            h.update(part.encode())
            h.update(b"\0")
        h.update(payload)
        return h.hexdigest().encode()

    def write(self, kind: str, name: str, payload: bytes) -> None:
        folder = os.path.join(self.dir, kind)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + self._digest(kind, name, payload) + b"\n")
                f.write(payload)
            os.replace(tmp, self._file(kind, name))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        with self._lock:
            self.writes += 1
        self.bound()

    def read(self, kind: str, name: str) -> bytes | None:
        """The payload, or None where there is none or it fails its check (reported)."""
        path = self._file(kind, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        head = len(MAGIC) + 65
        payload = data[head:]
        if (not data.startswith(MAGIC) or len(data) < head
                or data[len(MAGIC):head - 1] != self._digest(kind, name, payload)):
            self.reject(path, "its checksum does not match (torn, edited or foreign)")
            return None
        try:
            os.utime(path)  # recently used (the bound evicts the least recently used)
        except OSError:
            pass
        with self._lock:
            self.reads += 1
        return payload

    def reject(self, path: str, why: str) -> None:
        with self._lock:
            self.rejected += 1
        sys.stderr.write(f"adaptive_eager: warm-start cache entry {path} ignored: {why}\n")
        try:
            os.unlink(path)
        except OSError:
            pass

    def names(self, kind: str) -> list:
        try:
            return sorted(f[:-len(SUFFIX)] for f in os.listdir(os.path.join(self.dir, kind))
                          if f.endswith(SUFFIX))
        except OSError:
            return []

    def _files(self) -> list:
        out = []
        for folder, _, files in os.walk(self.root):
            for f in files:
                path = os.path.join(folder, f)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                out.append((st.st_mtime, st.st_size, path))
        return out

    def bound(self) -> None:
        """Remove the least recently used files of the whole root until it fits."""
        files = self._files()
        total = sum(size for _, size, _ in files)
        if total <= self.limit:
            return
        for _, size, path in sorted(files):
            try:
                os.unlink(path)
            except OSError:
                continue
            with self._lock:
                self.evicted += 1
            total -= size
            if total <= self.limit:
                break

    def info(self) -> dict:
        files = self._files()
        mine = [f for f in files if f[2].startswith(self.dir + os.sep)]
        return dict(directory=self.root, environment=self.env, files=len(files),
                    bytes=sum(size for _, size, _ in files), limit=self.limit,
                    this_environment=len(mine), reads=self.reads, writes=self.writes,
                    evicted=self.evicted, rejected=self.rejected)

    def clear(self) -> int:
        """Remove every file of the root (every environment); returns how many."""
        n = len(self._files())
        for entry in os.listdir(self.root):
            path = os.path.join(self.root, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        return n
