"""The compile cache and the background compiler.

``CompileCache`` is a ``cachetools`` LRU of compiled ``Graph`` objects keyed by ``GraphKey``
(the path's signature, the backend and the variant). Keys carry a precomputed hash: a path
signature is a tuple of thousands of entries and tuples do not cache their hash. Threads that
run the same program share compiled graphs through it.

``Compiler`` runs compile jobs on one daemon thread so the user's loop never waits for a
compile. A finished job is *delivered* to the inbox of the engine state that asked for it;
that state installs it at its next segment boundary, on its own thread, so trie and path
state are only ever mutated by their owner. Two requests for the same key share one job.
A delivery is ``(token, graph or None, error or None, built_now)``.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import cachetools

from .compile_thread import THREAD_NAME

__all__ = ["GraphKey", "CompileCache", "Compiler", "Job"]

log = logging.getLogger("adaptive_eager")


class GraphKey:
    __slots__ = ("path", "backend", "variant", "_hash", "digest")

    def __init__(self, path: tuple, backend: str, variant: tuple):
        self.path = path
        self.backend = backend
        self.variant = variant
        self._hash = hash((path, backend, variant))
        self.digest = None  # its graph file's name in the warm-start cache (tracer.warm)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (
            self is other
            or isinstance(other, GraphKey)
            and self._hash == other._hash
            and self.backend == other.backend
            and self.variant == other.variant
            and (self.path is other.path or self.path == other.path)
        )

    def __repr__(self):
        return f"GraphKey({len(self.path)} ops, {self.backend}, hash={self._hash & 0xFFFFFF:06x})"


class CompileCache:
    """LRU of compiled graphs (thread safe). Hits and misses are counted by the callers."""

    def __init__(self, maxsize: int):
        self._lru = cachetools.LRUCache(maxsize=maxsize)
        self._lock = threading.Lock()

    def get(self, key: GraphKey):
        with self._lock:
            return self._lru.get(key)

    def peek(self, key: GraphKey):
        """The graph for ``key`` without making it recently used (explain())."""
        with self._lock:
            return cachetools.Cache.get(self._lru, key)

    def put(self, key: GraphKey, graph) -> None:
        with self._lock:
            self._lru[key] = graph

    def resize(self, maxsize: int) -> None:
        with self._lock:
            old = self._lru
            self._lru = cachetools.LRUCache(maxsize=maxsize)
            for k in list(old.keys())[-maxsize:]:
                self._lru[k] = old[k]

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()

    def __len__(self):
        return len(self._lru)


class Job:
    __slots__ = ("key", "build", "waiters", "submitted")

    def __init__(self, key: GraphKey, build):
        self.key = key
        self.build = build  # () -> Graph
        self.waiters = []  # (inbox deque, token)
        self.submitted = time.perf_counter()


class Compiler:
    def __init__(self, cache: CompileCache):
        self.cache = cache
        self._jobs: dict = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._thread = None
        self.generation = 0  # bumped by reset(): results of older jobs are dropped

    def request(self, key: GraphKey, build, inbox: collections.deque, token) -> None:
        """Compile ``build()`` under ``key`` in the background; deliver (token, graph|error)."""
        done = self.cache.get(key)
        if done is not None:
            inbox.append((token, done, None, False))
            return
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = Job(key, build)
                self._queue.put((self.generation, job))
                self._ensure_thread()
            job.waiters.append((inbox, token))

    def _ensure_thread(self):
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._loop, name=THREAD_NAME, daemon=True
            )
            self._thread.start()

    def _loop(self):
        while True:
            generation, job = self._queue.get()
            if job is None:
                return
            graph = error = None
            if generation == self.generation:
                try:
                    graph = job.build()
                except Exception as e:  # delivered to the requester, who records the reason
                    # (also at the program's exit, where a failed job must still leave the
                    # queue: the exit's bounded wait for the warm-start cache waits on it)
                    error = e
            with self._lock:
                self._jobs.pop(job.key, None)
                waiters, job.waiters = job.waiters, []
                current = generation == self.generation
                if graph is not None and current:
                    self.cache.put(job.key, graph)
                for inbox, token in waiters if current else ():
                    inbox.append((token, graph, error, True))
                self._idle.notify_all()

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def busy(self) -> bool:
        """Is a job queued or running?"""
        return bool(self._jobs)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or running (tests and benchmarks use this)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def shutdown(self, timeout: float = 30.0) -> None:
        """Drop queued jobs and wait (bounded) for the running one: a daemon thread killed
        inside a compiler's C++ code aborts the interpreter at exit. (A compile waiting on the
        compile process ends when that process is stopped first: the engine's shutdown.)"""
        with self._lock:
            self.generation += 1
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._queue.put((-1, None))
            thread.join(timeout)

    def reset(self) -> None:
        with self._lock:
            self.generation += 1
            self._jobs.clear()
            self._idle.notify_all()
