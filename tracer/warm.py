"""Warm start: what a run learned, kept on disk, and restored into the next run's trie.

Note [Warm start]: every run used to learn its program again (recordings, fast paths, a
compile per path; the first steps cost several times eager's). The engine now keeps what it
learned in a private on-disk cache (scheduler.disk_cache, Note [The warm-start store]):

* a *path record* per path that went hot: its ops (each ``OpSpec`` with its signature key,
  so the trie's nodes are rebuilt exactly as learning built them), the floats it saw
  (reference and dynamic positions: they decide its variants), the variants it compiled with
  the digest of each graph, whether it replays exactly (and why), its end's cut, and the
  size and modification time of each source file its ops came from;
* a *graph file* per compiled graph: the compile process's reply (Inductor's serialized
  output, whose kernels sit in Inductor's own cache directory) and what loading it needs.

Both are keyed by the *environment* (torch and this package, down to a digest of the
package's sources; Python, the machine and its vector ISA; the backend, the C++ wrapper
setting, the managed devices and the neuron device's implementation; Inductor's
``TORCHINDUCTOR_*`` settings), and path records by the *program* too (the ``__main__``
module or script, or ``<interactive>``) and the thread that learned them. When this thread's
mode is enabled, the records of its program are grafted onto its trie (``restore``): their
nodes are marked hot and each graph is loaded there and then, on the enabling thread (on the
compiler thread its import of torch._dynamo raced the program's own), with what a path's
first hot run would otherwise build inside a step: the exact replay's code, the dispatch
key's compiled steps and plans, the graph-input plan. So the program's first occurrence of a
known step replays at once, fused where its graph was kept, exactly otherwise. Paths that
ended without recurring are kept at exit too (a training loop's first step, where the
optimizer creates its state), and the first ``SEEN_COMPILED`` of them are compiled then, for
the fresh values alive at their latest end (recorded at each cold end, ``Path.cold_live``),
within the exit's bounded wait. Restored, such a path replays fused where its kept graph
serves the launch and exactly otherwise, and nothing is compiled for it until it has ended
``hot_threshold`` times in this run; then it warms like any path (``tentative``). So a
second run's first step, which a first run sees once, is one fused launch (the warm-start
check's loop: its exact replay was ~3 ms of a 5-6 ms first step). Each loaded cpu graph
also runs once at restore on zeros (``_rehearse``): its first run cost 2-5 ms where later
ones cost 0.5. A restored path is still checked op
by op like any learned path: a program that changed diverges there and learns anew, and a
record whose source files changed (size or time) is not restored at all, counted, so no op
reports a line that moved. A restored graph file that is missing or fails to load is
compiled as before, counted; a path that retires removes its record.

Records are read with an unpickler that builds only the engine's own value types and
torch's devices, sizes and ops by name (``_Restricted``), never arbitrary objects. Graph files
hold generated code; they are only ever read from a directory only this user can write (the
store refuses any other) and after their checksum holds.
"""

from __future__ import annotations

import collections
import hashlib
import io
import os
import pickle
import platform
import sys
import threading

import torch

from adaptive_eager.scheduler import compile_process, disk_cache
from adaptive_eager.scheduler.compiler import GraphKey

from . import trie
from .trie import Node

__all__ = ["store_for", "restore", "keep", "forget", "persisting", "info", "clear"]

FORMAT = 1
_state = {"store": None, "refused": None}
_lock = threading.Lock()
_source = None


# ---------------------------------------------------------------- keys

def _source_digest() -> str:
    """A digest of the package's sources: an edited engine never reads an older one's cache."""
    global _source
    if _source is None:
        import adaptive_eager
        from adaptive_eager import scheduler, tracer

        h = hashlib.sha256()
        for pkg in (adaptive_eager, scheduler, tracer):
            for folder, dirs, files in os.walk(os.path.dirname(pkg.__file__)):
                dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "build"))
                for f in sorted(files):
                    if f.endswith((".py", ".cpp", ".h")):
                        with open(os.path.join(folder, f), "rb") as fh:
                            h.update(f.encode() + b"\0" + fh.read())
        _source = h.hexdigest()
    return _source


def environment(config) -> tuple:
    """What changes what the engine's ops and graphs compute, for the cache's key."""
    from adaptive_eager import __version__

    neuron = ""
    if "neuron" in config.devices:
        from adaptive_eager import neuron as device

        neuron = ("native" if device.is_native() else "emulated-python"
                  if device.is_emulated() else "torch-neuronx")
    inductor_env = tuple(sorted(
        (k, v) for k, v in os.environ.items()
        if k.startswith("TORCHINDUCTOR_") and k != "TORCHINDUCTOR_CACHE_DIR"))
    return ("adaptive_eager", __version__, _source_digest(), "torch", torch.__version__,
            torch.version.git_version, sys.version, platform.machine(),
            torch.backends.cpu.get_cpu_capability(), config.backend_for("cpu"),
            config.cpp_wrapper, tuple(config.devices), neuron, inductor_env, FORMAT)


def _digest(obj) -> str:
    return hashlib.sha256(compile_process.dumps(obj)).hexdigest()[:40]


def program() -> str:
    """The running program, as the cache knows it: ``python -m`` module, script, or
    ``<interactive>`` (a notebook, the REPL)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None):
        return "module:" + spec.name
    f = getattr(main, "__file__", None)
    return os.path.abspath(f) if f else "<interactive>"


def _role() -> str:
    t = threading.current_thread()
    return "main" if t is threading.main_thread() else "thread:" + t.name


def graph_digest(key: GraphKey) -> str:
    if type(key.path) is tuple and len(key.path) == 2 and key.path[0] == "warm":
        return key.path[1]  # a restored key names its file
    if key.digest is None:
        key.digest = _digest((key.path, key.backend, key.variant))
    return key.digest


# ---------------------------------------------------------------- the store

def store_for(config):
    """The store for ``config``'s environment, or None (warm start off, or the directory
    refused: said once in one line)."""
    if not config.warm_start:
        return None
    env = _digest(environment(config))
    with _lock:
        st = _state["store"]
        root = os.path.abspath(config.cache_dir or disk_cache.default_root())
        if st is not None and st.env == env and st.root == root:
            st.limit = config.cache_mb << 20
            return st
        if _state["refused"] == root:
            return None
        try:
            st = disk_cache.Store(root, env, config.cache_mb << 20)
        except (OSError, disk_cache.StoreRefused) as e:
            _state["refused"] = root
            sys.stderr.write(f"adaptive_eager: warm-start cache {root} not used: {e}\n")
            return None
        _state["store"] = st
        return st


def info(config) -> dict:
    st = store_for(config)
    if st is None:
        return dict(enabled=False, directory=os.path.abspath(
            config.cache_dir or disk_cache.default_root()), refused=_state["refused"])
    out = st.info()
    out.update(enabled=True, program=program(),
               paths=len(st.names(_paths_kind())), graphs=len(st.names("graphs")))
    return out


def clear(config) -> int:
    st = store_for(config)
    return st.clear() if st is not None else 0


def _paths_kind() -> str:
    return "paths-" + _digest((program(), _role()))[:16]


# ---------------------------------------------------------------- records

_ALLOWED = {
    ("adaptive_eager.scheduler.program", name) for name in ("Ext", "Val", "Rec", "Meta", "Out",
                                                             "OpSpec")
} | {("builtins", name) for name in ("int", "float", "bool", "str", "complex", "tuple",
                                      "list", "dict", "set", "frozenset", "slice", "type",
                                      "NoneType", "Ellipsis", "bytes")
} | {("torch", name) for name in ("device", "Size", "dtype", "layout", "memory_format")}


class _Restricted(compile_process._Unpickler):
    """Builds the engine's value types and torch's devices/sizes/ops by name, nothing else."""

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a value a path record holds")


def _loads_record(data: bytes):
    return _Restricted(io.BytesIO(data)).load()


def _sources(specs) -> dict:
    out = {}
    for s in specs:
        f = s.line.rsplit(":", 1)[0]
        if f not in out:
            try:
                st = os.stat(f)
                out[f] = (st.st_size, st.st_mtime_ns)
            except OSError:
                out[f] = None
    return out


SEEN = "seen in an earlier run, not yet recurring in this one"
SEEN_KEPT = 64  # paths seen but not hot kept per thread at exit (the most frequent first)
SEEN_COMPILED = 4  # of those, compiled at exit (the most frequent, then the first learned)


def keep(mode, path, seen: bool = False) -> None:
    """Write ``path``'s record (it went warm or hot; at exit, if it gained a variant since;
    ``seen``: it ended in this run without recurring enough to go hot)."""
    st = mode.warm
    if st is None or path.unkept:
        return
    path.rekeep = False
    exact = seen or path.backend == "exact" or bool(path.fused_off)
    if path.fused_off == "its compile failed":
        return  # maybe a passing cause (the compile process died): learned again next time
    try:
        record = dict(
            format=FORMAT, program=mode.warm_program, specs=path.specs, seen=seen,
            backend=path.backend, exact=exact, fused_off=SEEN if seen else path.fused_off,
            reference=path.reference, dynamic=path.dynamic,
            variants=[(v, graph_digest(k)) for v, k in path.variants.items()],
            cut=path.end.cut if path.end is not None else "", sources=_sources(path.specs))
        st.write(mode.warm_kind, _digest(path.key), compile_process.dumps(record))
    except Exception as e:  # an op or value the record cannot hold: this path is not kept
        path.unkept = True
        mode.counters.fallback(f"warm start: path not kept ({type(e).__name__}: "
                               f"{(str(e).splitlines() or [''])[0][:120]})")


def keep_seen(mode) -> None:
    """At exit: keep the paths that ended in this run without going hot (a training loop's
    first step, whose optimizer creates its state, is one), so that a later run replays
    them too; at most ``SEEN_KEPT``, the most often ended first. And write again the record
    of each warm or hot path that requested a variant since it was written."""
    from .lifecycle import COLD, HOT, WARM

    if mode.warm is None:
        return
    seen, stack = [], list(mode.root.children.values())
    while stack:
        n = stack.pop()
        stack += n.children.values()
        p = n.path
        if p is not None and p.state == COLD and n.ends and not n.blocked:
            seen.append((n.ends, p.gid, p))
        elif p is not None and p.rekeep and p.state in (WARM, HOT) and p.end is n:
            keep(mode, p)
    compiles = SEEN_COMPILED if mode.config.cache_exit_s > 0 else 0
    for _, _, p in sorted(seen, key=lambda x: (-x[0], x[1]))[:SEEN_KEPT]:
        if compiles and _compile_seen(mode, p):
            compiles -= 1
        keep(mode, p, seen=True)


def _compile_seen(mode, path) -> bool:
    """Request the fused graph of a path seen in this run, for the next (its variant: the
    fresh values alive at its latest end). True if requested. The exit waits for it, bounded
    (``NEURON_ADAPTIVE_EAGER_CACHE_EXIT_S``), and writes it as any kept graph; the next run
    replays the path fused from its first occurrence where that variant serves it."""
    # only the compile process's graphs are kept; cold_live is recorded for those paths only
    if path.fused_off or path.cold_live is None or path.variants or path.reference is None:
        return False
    from adaptive_eager.scheduler.backends import (PROCESS_DEVICES, graph_device,
                                                   remote_inductor_artifact)

    try:
        variant = path.variant(path.cold_live, path.reference)
        args = path.compile_args(variant)
    except Exception:  # a path whose graph cannot be planned: kept as an exact replay
        return False
    _, ext_metas, live_metas, _, _, device_map, _ = args
    if graph_device(ext_metas, live_metas, device_map).type not in PROCESS_DEVICES:
        return False
    key = path.graph_key(variant)
    st, cpp_wrapper = mode.warm, mode.config.cpp_wrapper

    def job():  # the reply is written, not loaded (remote_inductor_artifact)
        artifact = remote_inductor_artifact(*args, cpp_wrapper)
        st.write("graphs", graph_digest(key), compile_process.dumps(artifact))

    path.variants[variant] = key
    mode.engine.compiler.request(key, job, collections.deque(), None)
    return True


def forget(mode, path) -> None:
    """The path retired: a later run does not restore it."""
    st = mode.warm
    if st is None:
        return
    try:
        os.unlink(st._file(mode.warm_kind, _digest(path.key)))
    except OSError:
        pass


def persisting(build, key: GraphKey, st):
    """``build`` (a compile job) that also writes its graph's file (on the compiler thread)."""
    def job():
        graph = build()
        if graph.artifact is not None:
            try:
                st.write("graphs", graph_digest(key), compile_process.dumps(graph.artifact))
            except Exception:  # a graph not kept is compiled again next run
                pass
        return graph
    return job


# ---------------------------------------------------------------- restoring

def restore(mode) -> None:
    """Graft this program's kept paths onto ``mode``'s trie (once per environment)."""
    st = mode.warm
    if st is None or mode.warm_env == st.env:
        return
    mode.warm_env = st.env
    # the program and thread the records are kept under, fixed for the mode's life (at exit
    # ``__main__`` may no longer be the program's module)
    mode.warm_program = program()
    kind = mode.warm_kind = _paths_kind()
    for name in st.names(kind):
        payload = st.read(kind, name)
        if payload is None:
            continue
        try:
            record = _loads_record(payload)
            why = _graft(mode, record)
        except Exception as e:
            why = f"unreadable ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"
            st.reject(st._file(kind, name), why)
        if why:
            mode.counters.fallback(f"warm start: a kept path not restored: {why}")
    if mode.counters.paths_restored and mode._keyed is not None:
        from . import hot_plan

        hot_plan.prebuild(mode, mode._keyed)  # after every graft: each one changes the trie


def _graft(mode, record) -> str:
    from . import lifecycle

    if record.get("format") != FORMAT or record.get("program") != mode.warm_program:
        return "foreign record"
    for f, stat in record["sources"].items():
        try:
            st = os.stat(f)
            now = (st.st_size, st.st_mtime_ns)
        except OSError:
            now = None
        if now != (tuple(stat) if stat is not None else None):
            return f"its source changed ({f})"
    node = mode.root
    threshold = mode.config.hot_threshold
    for spec in record["specs"]:
        child = node.children.get(spec.key)
        if child is None:
            n_vals = sum(1 for o in spec.outs if o.kind in ("fresh", "view"))
            child = Node(node, spec.key, spec, node.n_ext + len(spec.ext_metas),
                         node.n_vals + n_vals)
            child.visits = threshold
            node.children[spec.key] = child
            mode.n_nodes += 1
        elif child.blocked:
            return f"an op the engine no longer defers ({child.blocked})"
        node = child
    if node.path is not None and node.path.state != lifecycle.COLD:
        return ""  # restored already (or learned in this run)
    path = lifecycle.path_of(mode, node)
    if path.backend != record["backend"]:
        return f"made for backend {record['backend']}, not {path.backend}"
    path.reference, path.dynamic = record["reference"], record["dynamic"]
    path.from_disk = True
    node.ends = max(node.ends, threshold)
    if record["cut"] and not node.cut:
        node.cut = record["cut"]
    mode.counters.paths_restored += 1
    if record["seen"] and record["variants"] and _load_seen(mode, path, node, record):
        return ""
    if record["exact"]:
        path.fused_off = record["fused_off"]
        path.tentative = 1 if record["seen"] else 0
        path.state = lifecycle.HOT
        lifecycle.mark_hot(mode, node)
        path.exact_graph()  # its replay's code, generated now rather than in a step
        _prebuild(mode, node)
        return ""
    path.state = lifecycle.WARM
    lifecycle.mark_hot(mode, node)
    path.plan  # noqa: B018 -- how its inputs reach its graphs, computed now, not in a step
    for variant, digest in record["variants"]:
        key = GraphKey(("warm", digest), path.backend, variant)
        path.variants[variant] = key
        graph = _load_graph(mode, digest)
        if graph is not None:
            _install(mode, path, key, graph)
            continue
        path.pending.add(variant)  # not kept (or unloadable): compiled as in a first run
        build = path.builder(variant, mode.config.compile_process, mode.config.cpp_wrapper)
        mode.engine.compiler.request(key, persisting(build, key, mode.warm), mode.inbox,
                                     (mode.generation, path, variant))
    if not path.pending:
        path.state = lifecycle.HOT
    else:
        path.exact_graph()  # replayed exactly until its graph compiles: generated now
    _prebuild(mode, node)
    trie.changed()
    return ""


def _load_seen(mode, path, node: Node, record) -> bool:
    """A path seen in an earlier run whose graph was compiled at its exit (keep_seen): hot
    with that graph, still tentative (nothing is compiled for it before it recurs here).
    False where a graph does not load: it is restored as an exact replay instead."""
    from . import lifecycle

    loaded = []
    for variant, digest in record["variants"]:
        graph = _load_graph(mode, digest)
        if graph is None:
            return False
        loaded.append((GraphKey(("warm", digest), path.backend, variant), graph))
    for key, graph in loaded:
        path.variants[key.variant] = key
        _install(mode, path, key, graph)
    path.tentative, path.state = 1, lifecycle.HOT
    lifecycle.mark_hot(mode, node)
    path.plan  # noqa: B018 -- computed now, not in a step
    path.exact_graph()  # a launch its graph does not serve replays exactly
    _prebuild(mode, node)
    trie.changed()
    return True


def _install(mode, path, key: GraphKey, graph) -> None:
    """A loaded graph of ``path``, served from the graph cache under ``key``."""
    mode.cache.put(key, graph)
    graph.gid = path.gid
    mode.counters.graphs_loaded += 1
    _rehearse(mode, path, graph)


REHEARSAL_BYTES = 256 << 20  # the most scratch memory a rehearsal allocates


def _rehearse(mode, path, graph) -> None:
    """Run a loaded cpu graph once now, on zeros of its inputs' metadata, its results
    dropped: its first run (its kernels' code and the memory they touch, first used) cost
    2-5 ms where later runs cost 0.5 in the warm-start check's loop, and would otherwise be
    paid inside the program's first step. Only where nothing can be observed: a graph whose
    kernels run on the CPU (cpu, or an emulated device's backing tensors, which the
    rehearsal hands it directly: no device is involved, whose errors would surface at a
    later sync), no dispatch mode or key active, the generator's state restored after (a
    graph's random ops draw from it), bounded scratch memory. A graph that raises on zeros
    is not rehearsed, counted."""
    if graph.device.type != "cpu" or graph.plan is None:
        return
    if torch._C._len_torch_dispatch_stack() or (mode._keyed is not None
                                                and mode._keyed.is_on()):
        return
    from adaptive_eager.scheduler.backends import packed_floats
    from adaptive_eager.scheduler.program import meta_on

    metas = [meta_on(m, path.device_map) if m is not None else None
             for m in [path.ext_metas[k] for k in graph.plan.ext_inputs]
             + [path.val_meta[i] for i in graph.live]]
    if any(m is None or m.device.type != "cpu" for m in metas):
        return
    if sum(m.numel_storage * m.dtype.itemsize for m in metas) > REHEARSAL_BYTES:
        return
    rng = torch.get_rng_state()
    try:
        inputs = [torch.zeros(m.numel_storage, dtype=m.dtype).as_strided(m.shape, m.stride,
                                                                           m.offset)
                  for m in metas]
        if graph.plan.lifted:
            values = [path.reference[n][j] for n, j in graph.plan.lifted]
            inputs.insert(len(graph.plan.ext_inputs), packed_floats(values, graph.device))
        with torch._C._AutoDispatchBelowADInplaceOrView():
            graph.run(inputs)
    except Exception as e:
        mode.counters.fallback(f"warm start: a kept graph not rehearsed ({type(e).__name__})")
    finally:
        torch.set_rng_state(rng)


def _prebuild(mode, end: Node) -> None:
    """Build now what the first hot run of a restored path would build inside a step: the
    dispatch key's compiled step of each of its nodes (tracer.hot_plan)."""
    if mode._keyed is None:
        return
    from . import hot_plan

    for n in end.chain():
        hot_plan.step_of(n, mode._keyed)


def _load_graph(mode, digest: str):
    """The kept graph ``digest``, loaded here and now (before the program's first step: a
    load on the compiler thread would hold the interpreter lock inside one), or None."""
    from adaptive_eager.scheduler.backends import load_artifact

    st = mode.warm
    payload = st.read("graphs", digest)
    if payload is None:
        return None
    _import_for_loading()
    try:
        artifact = compile_process.loads(payload)
        graph = load_artifact(artifact)
    except Exception as e:  # compiled instead, counted
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
        st.reject(st._file("graphs", digest), f"it did not load ({why})")
        mode.counters.fallback("warm start: a kept graph did not load: compiled")
        return None
    return graph


def _import_for_loading() -> None:
    """What loading a graph imports, once (~1.5 s, before the program's first step). Never
    on the compiler thread: importing torch._dynamo there while the program imported it too
    (an optimizer's constructor does) left the program a half-initialized module ("cannot
    import name 'IndentedBuffer'", measured)."""
    import torch._dynamo  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.output_code  # noqa: F401
