"""Micro-graph backends: one interface, ``exact`` and ``inductor`` behind it.

A backend turns a path (``OpSpec`` list) plus a *variant* -- which fresh outputs are live,
and the values of floats that are specialized -- into a ``Graph`` whose ``run(inputs)`` does
the whole segment in one call.

Note [Graph inputs]: a compiled graph is called as::

    inputs = externals + [packed lifted floats (float64, 1-D)]? + live output tensors

The graph writes each live output into the tensor the user already holds (a ``copy_``
epilogue that Inductor turns into in-place stores, no extra copy) and applies the segment's
mutations of external inputs in place.

A graph is launched only on inputs its path's guards matched (dtype, sizes, strides, offset:
the signature and the plans check them, op by op), so Inductor's own per-input
``assert_size_stride`` in the generated wrapper is compiled out (``size_asserts=False``): it
checked again what was checked, ~0.2 µs an input, which a step over 200 parameters' AdamW
paid 800 times per launch.

``exact`` needs no compilation: it replays the ops one by one with their recorded values, so
it is bitwise equal to eager; it serves every variant. ``inductor`` traces the program with
``make_fx`` + functionalization and Inductor's decompositions, then ``compile_fx_inner`` with
``fallback_random=True`` (random ops call eager's kernels in program order, so they consume
the generator exactly as eager) and ``emulate_precision_casts=True`` (Note [Eager's
precision]). We call the compiled module's ``current_callable`` directly: the ``compile_fx``
wrapper costs microseconds per launch that buy nothing here.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time

import torch

from . import compile_process, precision, symbolic
from .compile_thread import prepare_thread
from .program import Ext, InductorDiffers, Meta, interpret, meta_on, on_compute, straight_line
from .scalars import Lifted, lift_call, liftable

__all__ = ["Graph", "Plan", "plan", "compile_graph", "BACKENDS"]

log = logging.getLogger("adaptive_eager")
aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a path's externals and floats reach a fused graph; fixed per path (specs only)."""

    ext_inputs: tuple  # external indices passed as graph inputs, in input order
    mutated_inputs: tuple  # positions (in ext_inputs) of inputs the graph writes
    lifted: tuple  # (op index, rec index) in packed order
    specialized: tuple  # (op index, rec index) whose values are part of the variant key
    lifted_ops: frozenset  # op indices whose call goes through lift_call


def plan(specs, dynamic=frozenset(), reference=None) -> Plan:
    """How a path's inputs reach its fused graph.

    Note [Float variants]: a float is *specialized* (a constant of the compiled graph, its
    value part of the variant key) unless it has been seen to change (``dynamic``), like an
    optimizer's bias-corrected step size, or is a zero or NaN (their values do not compare
    reliably); those are *lifted* into the packed input where the op allows it. Constants
    let the C++ compiler fold them: a 64-op chain on 1M floats runs ~8x faster than with
    every float loaded from the packed input. ``reference`` is one recorded run (floats per
    op) that tells zeros and NaNs. A specialized slot that cannot be lifted may still see a
    zero: 0.0 == -0.0 in the variant key, so a launch with a zero there compares signs with
    the values the graph was compiled with.
    """
    # Note [External views] (tracer.signature): a view of an external is a graph input
    # unless the segment writes what it views; then it is computed in-graph from its base.
    base_of = {}
    n_ext = 0
    for spec in specs:
        if spec.ext_view:
            base = next((a.k for a in spec.args if type(a) is Ext), None)
            for o in spec.outs:
                base_of[o.arg] = base
        n_ext += len(spec.ext_metas)

    def root(k):
        while k in base_of and base_of[k] is not None:
            k = base_of[k]
        return k

    written_roots = {root(m.k) for s in specs for m in s.mutates if type(m) is Ext}
    in_graph = {k for k in base_of if root(k) in written_roots}
    ext_inputs = tuple(k for k in range(n_ext) if k not in in_graph)
    written = {m.k for s in specs for m in s.mutates if type(m) is Ext}
    mutated_inputs = tuple(i for i, k in enumerate(ext_inputs) if k in written)
    lifted, special, lifted_ops = [], [], set()
    for n, spec in enumerate(specs):
        if not spec.n_floats:
            continue
        if spec.ext_view:
            if spec.outs[0].arg in in_graph:
                special += [(n, j) for j in range(spec.n_floats)]
        elif spec.view or not liftable(spec.func, spec.args, spec.kwargs):
            special += [(n, j) for j in range(spec.n_floats)]
        else:
            for j in range(spec.n_floats):
                value = reference[n][j] if reference is not None else 1.0
                if (n, j) in dynamic or not value or value != value:
                    lifted.append((n, j))
                    lifted_ops.add(n)
                else:
                    special.append((n, j))
    return Plan(ext_inputs, mutated_inputs, tuple(lifted), tuple(special), frozenset(lifted_ops))


@dataclasses.dataclass(eq=False)
class Graph:
    """A compiled micro-graph for one (path, variant)."""

    backend: str
    run: object  # callable(inputs list)
    live: tuple  # fresh value indices written, in input order
    plan: Plan | None
    n_ext: int
    n_ops: int
    compile_seconds: float = 0.0
    code: str = ""
    mutates_external: bool = False
    gid: int = 0
    spec_values: tuple = ()  # the specialized floats compiled in (Note [Float variants])
    device: torch.device = torch.device("cpu")  # where its kernels run: the packed floats go
    ran: bool = False  # its first run (loading, GPU autotuning) is one-off work
    # Note [C++ wrappers]: why its C++ wrapper was not built (it runs Inductor's Python one)
    wrapper_failed: str | None = None
    # Note [Family graphs] (scheduler.symbolic): the sizes a family's symbolic graph admits
    size_guards: object = None
    # What the warm-start cache keeps of it (Note [Warm start], tracer.warm): the compile
    # process's reply and what ``_compiled_graph`` needs, for ``load_artifact``; None for a
    # graph this process compiled itself (a later run compiles it again)
    artifact: tuple | None = None


def graph_device(ext_metas, live_metas: dict, device_map=None) -> torch.device:
    """The device a traced graph's kernels run on: its tensors' (after ``device_map``)."""
    for m in (*ext_metas, *live_metas.values()):
        return torch.device(meta_on(m, device_map).device)
    return torch.device("cpu")


def packed_floats(values: list, device: torch.device) -> torch.Tensor:
    """The lifted floats as a graph's packed input (Note [Graph inputs]), on its device.

    A GPU graph's kernels read them from device memory: they are staged in pinned host
    memory and copied on the current stream without the host waiting (the host allocator
    keeps the staging block until the copy has run). A copy from pageable memory would make
    the host wait for everything queued before it.
    """
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.float64)
    if device.type != "cuda":  # another accelerator (torch-neuronx): its own copy
        return torch.tensor(values, dtype=torch.float64, device=device)
    staged = torch.tensor(values, dtype=torch.float64, pin_memory=True)
    return staged.to(device, non_blocking=True)


def exact_graph(specs, n_ext: int, device_map=None, kernels=None) -> Graph:
    """The exact backend: a replay of the recorded ops (serves every variant).

    ``run(exts, floats, targets)`` runs them as one generated function (program.straight_line).
    """
    return Graph("exact", straight_line(specs, device_map, kernels), (), None, n_ext, len(specs),
                 mutates_external=any(_writes_ext(s) for s in specs))


def _writes_ext(spec) -> bool:
    return any(type(m) is Ext for m in spec.mutates)


def _fake_like(meta: Meta):
    if meta.offset == 0:
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=meta.device)
    base = torch.empty(meta.numel_storage, dtype=meta.dtype, device=meta.device)
    return base.as_strided(meta.shape, meta.stride, meta.offset)


def trace(specs, ext_metas, live_metas: dict, the_plan: Plan, spec_values: tuple,
          device_map=None, kernels=None, size=None):
    """The functional FX graph of the program for one variant, and its fake example inputs.

    ``device_map`` (device type -> device) names where the kernels run when that is not the
    recorded device (an emulated device's backing CPU tensors). ``size``: the program is a
    template (Note [Family graphs], scheduler.symbolic) traced with a symbolic size whose
    hint is ``size``.
    """
    # A shape environment (with static sizes only) lets Inductor's FX graph cache serve the
    # graph: without one it bypasses the cache and lowers the graph again in every process
    # (measured: neuron llama-train's two graphs, 7.2 s and 5.4 s each time with every kernel
    # already built; from the cache 2.3 s and 0.8 s).
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    template, where = specs, None
    if size is not None:  # the inputs' sizes are symbolic; the ops' ints are read from them
        s = symbolic.size_in(fake_mode.shape_env, size)
        metas = [ext_metas[k] for k in the_plan.ext_inputs] + list(live_metas.values())
        where = symbolic.whole_dimension(metas, len(the_plan.ext_inputs), bool(the_plan.lifted))
        if where is None:
            raise InductorDiffers("the family's size is no whole dimension of an input")
        ext_metas = symbolic.resolve(list(ext_metas), s)
        live_metas = symbolic.resolve(dict(live_metas), s)
    ext_metas = [meta_on(m, device_map) for m in ext_metas]
    live_metas = {i: meta_on(m, device_map) for i, m in live_metas.items()}
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    n_ext = len(ext_metas)
    ext_inputs = the_plan.ext_inputs
    n_in = len(ext_inputs)
    live = tuple(live_metas)
    lift_index = {pos: i for i, pos in enumerate(the_plan.lifted)}
    special = dict(zip(the_plan.specialized, spec_values))
    has_packed = bool(the_plan.lifted)
    device = graph_device(ext_metas, live_metas)

    def program(*inputs):
        specs = template
        if where is not None:  # a size traced from an input (Note [Family graphs])
            s = inputs[where[0]].shape[where[1]]
            specs = [symbolic.resolve(spec, s) for spec in template]
        exts = [None] * n_ext
        for k, x in zip(ext_inputs, inputs):
            exts[k] = x
        packed = inputs[n_in] if has_packed else None
        targets = dict(zip(live, inputs[n_in + has_packed:]))

        def float_of(n, j):
            p = lift_index.get((n, j))
            if p is None:
                return special[(n, j)]
            return Lifted(aten.select.int(packed, 0, p))

        def call(n, spec, args, kwargs):
            func, args, kwargs = on_compute(spec, args, kwargs, device_map, kernels)
            if spec.func in precision.MEAN_OF_EMPTY and args[0].numel() == 0:
                raise InductorDiffers(f"{spec.func} of an empty tensor: Inductor's mean is 0 "
                                      "where eager's is nan")
            if low:
                func, args = precision.as_eager_16bit(spec.func, func, args, kwargs)
            if n in the_plan.lifted_ops:
                res = lift_call(func, args, kwargs)
            else:
                res = func(*args, **kwargs)
            return _as_recorded(spec, res, device_map)

        interpret(specs, None, exts, targets, call=call, float_of=float_of)
        return ()

    low = precision.low_precision(specs, ext_metas)  # Note [Eager's precision]
    kernels = precision.eager_kernels(low, kernels)
    if any(s.func is aten.bernoulli.default and s.outs[0].meta.dtype != torch.float32
           for s in specs):  # Note [Random ops stay eager's]
        raise InductorDiffers("bernoulli of non-float32 probabilities: Inductor draws float32 "
                              "numbers where eager's kernel draws others")
    if low:
        unsafe = sorted({str(s.func) for s in specs if s.func in precision.NOT_FUSED_16BIT})
        if unsafe:
            raise PrecisionUnsafe(f"16-bit {', '.join(unsafe)}: Inductor rounds it otherwise "
                                  "than eager")
    with fake_mode:
        inputs = [_fake_like(ext_metas[k]._replace(offset=0)) for k in ext_inputs]
        if has_packed:
            inputs.append(torch.empty(len(the_plan.lifted), dtype=torch.float64, device=device))
        inputs += [_fake_like(m) for m in live_metas.values()]
    gm = make_fx(
        torch.func.functionalize(program, remove="mutations"),
        decomposition_table=select_decomp_table(),
        tracing_mode="fake",
    )(*inputs)
    return gm, inputs, fake_mode


# Note [Random ops stay eager's]: ``fallback_random`` makes Inductor call eager's kernel for
# the random ops it lowers, but the decomposition table it hands to tracing rewrites
# ``bernoulli(p)`` as ``rand(float32) < p``: the numbers eager's kernel draws for float32
# probabilities (one float per element, compared), other numbers for float64 ones (eager's
# cpu kernel draws a double per element). Found by the fuzzer on neuron (a float64
# ``bernoulli``: 11 of 24 elements differed once the fused graph ran). Traced as itself, the
# op is refused by Inductor ("both a fallback and a decomp"); traced as ATen computes it (an
# ``empty_like`` filled by ``bernoulli_(p)``), Inductor's code for it did not import (its
# in-place fallback printed an unrealized input). So a graph with ``bernoulli(p)`` of other
# than float32 probabilities is not fused: its path replays exactly, counted.


class PrecisionUnsafe(InductorDiffers):
    """The graph cannot be fused with eager's 16-bit rounding (Note [Eager's precision])."""


def _as_recorded(spec, res, device_map=None):
    """Give each fresh output the strides eager gave it (Note [Traced strides])."""
    leaves = [res] if spec.tree == "one" else [] if spec.tree == "none" else list(res)
    changed = False
    for j, (o, t) in enumerate(zip(spec.outs, leaves)):
        if o.kind == "fresh" and t is not None and t.stride() != o.meta.stride:
            leaves[j] = _fake_like(meta_on(o.meta, device_map)).copy_(t)
            changed = True
    if not changed:
        return res
    return leaves[0] if spec.tree == "one" else type(res)(leaves)


# Note [Traced strides]: the fused graph is traced with fake tensors through Inductor's
# decompositions, and a decomposition may lay out its output differently from the eager
# kernel it replaces (a GPT-2 attention ``clone`` came out transposed). Views recorded
# against eager's strides then fail in the trace ("Cannot view a tensor with shape ...").
# Each fresh output whose traced strides differ from the recorded ones is copied into a
# buffer with the recorded layout: the program's later views see what eager saw, and
# Inductor fuses the copy into the producer.


def _inductor_compile(specs, ext_metas, live_metas, the_plan, spec_values, device_map,
                      kernels, cpp_wrapper=False, size=None):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner

    start = time.perf_counter()
    # Note [Eager's precision]: Inductor computes fused bf16/fp16 pointwise chains in float32
    # and rounds once, at the store; eager rounds every op's result to its dtype. That is a
    # precision eager does not have (a 16-op bf16 chain: 0.09 apart). With
    # emulate_precision_casts Inductor rounds each intermediate as eager does (the fused
    # chain is then bitwise eager's); float32 code is unchanged. The ops for which that is
    # not enough stay eager's kernels in the graph (scheduler.precision).
    # Note [Graph inputs]: no size asserts in the generated wrapper.
    failed = None
    with inductor_config.patch(fallback_random=True, emulate_precision_casts=True,
                               size_asserts=False):
        gm, inputs, fake_mode = trace(specs, ext_metas, live_metas, the_plan, spec_values,
                                      device_map, kernels, size)
        code = gm.code
        if cpp_wrapper and graph_device(ext_metas, live_metas, device_map).type == "cpu":
            try:
                with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
                    compiled = compile_fx_inner(gm, inputs, is_inference=True, cpp_wrapper=True)
                return (compiled, code, time.perf_counter() - start, None,
                        _size_guards(fake_mode, size))
            except Exception as e:  # counted where the graph is installed
                failed = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            # Inductor's passes rewrote the graph in place: trace it again
            gm, inputs, fake_mode = trace(specs, ext_metas, live_metas, the_plan, spec_values,
                                          device_map, kernels, size)
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            compiled = compile_fx_inner(gm, inputs, is_inference=True)
    return compiled, code, time.perf_counter() - start, failed, _size_guards(fake_mode, size)


def _size_guards(fake_mode, size):
    """A symbolic graph's guards (Note [Family graphs]); None for a graph of fixed sizes."""
    if size is None:
        return None
    guards = symbolic.guards_of(fake_mode.shape_env)
    if guards is None or not guards.admit(size):
        raise InductorDiffers("the family's graph could not be kept symbolic in its size")
    return guards


# Note [C++ wrappers]: Inductor calls a graph's kernels from a wrapper, Python by default: per
# kernel a Python call through a binding, per buffer an allocation and a ``del``. The
# engine's graphs are many small kernels (llama-train's step: ~270 ops), so on the CPU
# that wrapper was a tenth of the hot step (measured on llama-train, cpu, 2 threads: 3.48
# and 3.65 ms a step with the Python wrapper, 3.33 and 3.27 with the C++ one; eager 3.8-4.1).
# Graphs whose kernels run on the CPU (cpu, and the emulated neuron device's memory) are
# therefore built with Inductor's C++ wrapper (``cpp_wrapper``; the setting
# NEURON_ADAPTIVE_EAGER_CPP_WRAPPER, on by default), which also runs with the interpreter lock
# released, so the neuron device's worker does not hold it while its kernels run. Its cost
# is the compile, in the background: a first 8-op graph in a new process took 14.4 s either
# way (one run each), but each C++ wrapper is compiled with libtorch's headers: a clean CI
# run of the test suite, whose hundreds of small graphs compile cold, had done 29 % of its
# tests after 15 minutes (other work on the machine too), where the whole suite took 12
# before. The suite runs the Python wrapper (tests/conftest.py) except where a test asks for
# the C++ one. Where Inductor cannot build the C++ wrapper, the graph is
# traced again and built with the Python one, counted with the reason when it is installed.


def _compiled_graph(run, code, seconds, ext_metas, live_metas, the_plan, spec_values, n_ops,
                    device_map, backend="inductor", wrapper_failed=None, size_guards=None):
    return Graph(backend, run, tuple(live_metas), the_plan, len(ext_metas), n_ops,
                 compile_seconds=seconds, code=code, wrapper_failed=wrapper_failed,
                 size_guards=size_guards,
                 mutates_external=bool(the_plan.mutated_inputs), spec_values=tuple(spec_values),
                 device=graph_device(ext_metas, live_metas, device_map))


def inductor_graph(specs, ext_metas, live_metas: dict, the_plan: Plan, spec_values,
                   device_map=None, kernels=None, cpp_wrapper=False, size=None) -> Graph:
    """Inductor in this process (on the compiler thread)."""
    prepare_thread()
    compiled, code, seconds, failed, guards = _inductor_compile(
        specs, ext_metas, live_metas, the_plan, spec_values, device_map, kernels, cpp_wrapper,
        size)
    run = getattr(compiled, "current_callable", None) or compiled
    return _compiled_graph(run, code, seconds, ext_metas, live_metas, the_plan, spec_values,
                           len(specs), device_map, wrapper_failed=failed, size_guards=guards)


def inductor_artifact(specs, ext_metas, live_metas, the_plan, spec_values, device_map=None,
                      kernels=None, cpp_wrapper=False, size=None):
    """Inductor in the compile process: its output serialized for the requesting process
    (Note [Compiles leave the process])."""
    compiled, code, seconds, failed, guards = _inductor_compile(
        specs, ext_metas, live_metas, the_plan, spec_values, device_map, kernels, cpp_wrapper,
        size)
    if not hasattr(compiled, "prepare_for_serialization"):
        # a graph of views only: Inductor hands back a plain function, nothing to send
        raise InductorDiffers("nothing for Inductor to compile (views only)")
    compiled.prepare_for_serialization()
    return pickle.dumps(compiled), code, seconds, failed, guards


def remote_inductor_artifact(specs, ext_metas, live_metas: dict, the_plan: Plan, spec_values,
                             device_map=None, kernels=None, cpp_wrapper=False,
                             size=None) -> tuple:
    """Inductor in the compile process; its reply as ``load_artifact`` takes it, not loaded
    (a graph compiled at the program's exit for the warm-start cache: loading imports
    Inductor's modules, which cannot register their exit handlers then)."""
    # The child needs what ``trace`` reads; the signature key and source line stay here.
    sent = [dataclasses.replace(s, key=None) for s in specs]
    request = compile_process.pack((sent, ext_metas, live_metas, the_plan, spec_values,
                                     device_map, kernels, cpp_wrapper, size))
    blob, code, seconds, failed, guards = compile_process.shared().request(request)
    return (blob, code, seconds, failed, guards, tuple(ext_metas), dict(live_metas),
            the_plan, tuple(spec_values), len(specs), device_map)


def remote_inductor_graph(specs, ext_metas, live_metas: dict, the_plan: Plan, spec_values,
                          device_map=None, kernels=None, cpp_wrapper=False, size=None) -> Graph:
    """Inductor in the compile process; this thread only waits and loads the result."""
    artifact = remote_inductor_artifact(specs, ext_metas, live_metas, the_plan, spec_values,
                                        device_map, kernels, cpp_wrapper, size)
    graph = load_artifact(artifact)
    graph.artifact = artifact
    return graph


def load_artifact(artifact) -> Graph:
    """The graph of a compile process's reply (``remote_inductor_graph``), or of one the
    warm-start cache kept: loading runs the generated wrapper, whose kernels are in
    Inductor's cache directory (milliseconds; built again there if they are gone)."""
    (blob, code, seconds, failed, guards, ext_metas, live_metas, the_plan, spec_values,
     n_ops, device_map) = artifact
    compiled = pickle.loads(blob)
    from torch._inductor.output_code import CompiledFxGraphConstants

    compiled.after_deserialization(CompiledFxGraphConstants())
    return _compiled_graph(compiled.current_callable, code, seconds, ext_metas, live_metas,
                           the_plan, spec_values, n_ops, device_map, wrapper_failed=failed,
                           size_guards=guards)


def neuron_graph(specs, ext_metas, live_metas: dict, the_plan: Plan, spec_values,
                 device_map=None, kernels=None, cpp_wrapper=False, size=None) -> Graph:
    """TorchNeuron's compiler: the same functional graph, through ``torch.compile``'s
    ``neuron`` backend (registered by torch-neuronx; used as it is)."""
    from torch._dynamo.backends.registry import lookup_backend

    prepare_thread()

    start = time.perf_counter()
    if size is not None:
        raise InductorDiffers("TorchNeuron's backend compiles fixed sizes")
    gm, inputs, fake_mode = trace(specs, ext_metas, live_metas, the_plan, spec_values,
                                  device_map, kernels)
    compiled = lookup_backend("neuron")(gm, inputs)

    def run(args):
        compiled(*args)
        args.clear()  # as Inductor's boxed calling convention does: drop the references

    return _compiled_graph(run, gm.code, time.perf_counter() - start, ext_metas, live_metas,
                           the_plan, spec_values, len(specs), device_map, backend="neuron")


BACKENDS = {"inductor": inductor_graph, "neuron": neuron_graph,
            "inductor-process": remote_inductor_graph}


def compile_graph(backend: str, specs, ext_metas, live_metas, the_plan, spec_values,
                  device_map=None, kernels=None, process: bool = False,
                  cpp_wrapper: bool = False, size=None) -> Graph:
    """Compile one variant. ``process``: Inductor runs in the compile process for graphs on
    the CPU or CUDA (Note [Compiles leave the process]); other backends and devices compile
    on this thread."""
    if (process and backend == "inductor"
            and graph_device(ext_metas, live_metas, device_map).type in PROCESS_DEVICES):
        backend = "inductor-process"
    return BACKENDS[backend](specs, ext_metas, live_metas, the_plan, spec_values, device_map,
                             kernels, cpp_wrapper, size)


# Where the compile process compiles: the CPU, and CUDA (the child makes its own CUDA
# context; the Triton kernels it builds land in the shared cache directory, where loading
# the graph here finds them).
PROCESS_DEVICES = ("cpu", "cuda")
