"""``torch.compile``'s ``neuron`` backend on the emulated device (Note [The neuron compile
backend]).

``torch.compile(fn, backend="neuron")``, or ``torch.compiler.set_default_backend("neuron")``
then ``model.compile()``: Dynamo captures the program, AOTAutograd splits it into a forward
and a backward graph of ATen ops, and each graph is compiled by Inductor for the CPU (the
device's memory is host memory) and run as **one launch** on the device's queue, behind the
host like the engine's replays. Registered with Dynamo through the package's
``torch_dynamo_backends`` entry point; where torch-neuronx registers its own ``neuron``
backend, Dynamo finds that one first.

Note [The neuron compile backend]: a graph's outputs must exist on the host when the call
returns, before the launch has run, so the graph is traced again for the CPU with one more
input per output it computes, which it writes (Inductor fuses the write into the kernel that
computes the value). At the call the host allocates those outputs on the device from their
sizes (under ``dynamic=True`` read from the inputs' sizes), gives the graph host views of
every device tensor (``host_alias``: no copy), and queues it. Random ops call eager's kernels
(Inductor's ``fallback_random``), which draw from the generator the device's eager ops draw
from, and the host waits for a graph that draws, so numbers are drawn in program order as
the engine's replays draw them. An output that is a view of an
input or of another output is made on the host as that view. A CPU tensor passed in is read
at the call, as eager would read it. An error in a graph's kernels is raised at the next sync
point as eager raises it (the graph's ATen ops are run one by one to find it).
Beside the engine: the forward graph is called inside the compiled function, where the engine
stands aside (Note [Beside torch.compile]); a backward graph is called by autograd, where the
engine runs, so the call is a boundary of the engine's (what it holds computes the graph's
inputs: without it the graph read them unwritten) and runs outside it; and graphs are
compiled on a thread of their own, whose dispatch state is clean.
"""

from __future__ import annotations

import sys
import threading

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _mode_stack

__all__ = ["neuron_backend", "LAUNCH_NAME"]

# The launches' name in the device's counters (``launches_by_name``): beside the engine's
# ("adaptive_eager graph") and the device's own kernels (an op's name).
LAUNCH_NAME = "torch.compile graph"


def neuron_backend(gm, example_inputs, **options):
    """Dynamo backend: AOTAutograd, then each graph compiled for the device (Note [The neuron
    compile backend])."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    if options:
        raise ValueError(f"the neuron backend takes no options; got {sorted(options)}")
    _device_extension()
    return aot_autograd(fw_compiler=_compile, bw_compiler=_compile,
                        decompositions=select_decomp_table(),
                        keep_inference_input_mutations=True)(gm, example_inputs)


def _device_extension():
    from adaptive_eager import neuron

    neuron.ensure()
    if not neuron.is_native():
        raise RuntimeError("torch.compile(backend='neuron') runs on the C++ emulated device; "
                           "this process uses the Python emulator (NEURON_EMULATOR_IMPL=python)")
    from adaptive_eager.neuron import native

    return native.load()


class _Out:
    """How the call makes one output: ``kind`` "fresh" (allocated, the graph writes it),
    "input"/"output" (a view of input or output ``of``), "value" (a number or None)."""

    __slots__ = ("kind", "of", "size", "stride", "offset", "dtype", "value")

    def __init__(self, kind, of=None, size=(), stride=(), offset=0, dtype=None, value=None):
        self.kind, self.of, self.value = kind, of, value
        self.size, self.stride, self.offset, self.dtype = size, stride, offset, dtype


def _storage(t):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def _plan_outputs(in_vals, out_vals) -> list:
    inputs = {_storage(v): i for i, v in enumerate(in_vals)
              if isinstance(v, torch.Tensor)}
    fresh: dict = {}
    plan = []
    for k, v in enumerate(out_vals):
        if not isinstance(v, torch.Tensor):
            plan.append(_Out("value", value=v))
            continue
        meta = dict(size=tuple(v.size()), stride=tuple(v.stride()),
                    offset=v.storage_offset(), dtype=v.dtype)
        s = _storage(v)
        if s in inputs:
            plan.append(_Out("input", of=inputs[s], **meta))
        elif s in fresh:  # a view of an output computed here (or the same one again)
            plan.append(_Out("output", of=fresh[s], **meta))
        else:
            fresh[s] = k
            plan.append(_Out("fresh", **meta))
    return plan


def _on_cpu(x):
    """``x`` (an argument of a graph node) with every neuron device made the CPU."""
    if isinstance(x, torch.device) and x.type == "neuron":
        return torch.device("cpu")
    if isinstance(x, (list, tuple)):
        return type(x)(_on_cpu(y) for y in x)
    if isinstance(x, dict):
        return {k: _on_cpu(y) for k, y in x.items()}
    return x


def _cpu_like(v):
    if not isinstance(v, torch.Tensor):
        return v
    base = torch.empty(v.untyped_storage().nbytes() // v.element_size(), dtype=v.dtype,
                       device="cpu")
    return base.as_strided(v.size(), v.stride(), v.storage_offset())


def _compile(gm, example_inputs):
    """One AOT graph (forward, backward or inference) for the device: a boxed callable.

    Compiled on a thread of its own: a backward graph is compiled at the first
    ``backward()``, outside the compiled call, where the engine's mode and dispatch key may be
    on (the thread's dispatch state, which autograd's threads inherit); a new thread starts
    with none, so the compile's tracing never reaches the engine (it is no program op)."""
    box: dict = {}
    grad = torch.is_grad_enabled()

    def work():
        try:
            with torch.set_grad_enabled(grad):
                box["run"] = _compile_graph(gm, example_inputs)
        except BaseException as e:  # noqa: BLE001 -- raised on the calling thread
            box["error"] = e

    thread = threading.Thread(target=work, name="adaptive_eager-neuron-compile", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["run"]


def _compile_graph(gm, example_inputs):
    from torch._guards import detect_fake_mode, tracing, TracingContext
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    ext = _device_extension()
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    in_vals = [n.meta.get("val") for n in places]
    out_nodes = gm.graph.output_node().args[0]
    out_vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else n for n in out_nodes]
    plan = _plan_outputs(in_vals, out_vals)
    fresh = [k for k, o in enumerate(plan) if o.kind == "fresh"]
    for node in gm.graph.nodes:  # the kernels run on the device's memory: the CPU's
        node.args, node.kwargs = _on_cpu(node.args), _on_cpu(node.kwargs)
    gm.recompile()
    n_in = len(places)

    def program(*args):
        res = gm(*args[:n_in])
        for buf, k in zip(args[n_in:], fresh):
            buf.copy_(res[k])
        return ()

    fake_mode = detect_fake_mode(example_inputs)
    with fake_mode:
        ins = [_cpu_like(v) for v in in_vals]
        bufs = [torch.empty_strided(plan[k].size, plan[k].stride, dtype=plan[k].dtype,
                                    device="cpu") for k in fresh]
    traced = make_fx(torch.func.functionalize(program, remove="mutations"),
                     decomposition_table=select_decomp_table(),
                     tracing_mode="fake")(*ins, *bufs)
    # random ops call eager's kernels, which draw from the generator eager's draw from
    with inductor_config.patch(size_asserts=False, fallback_random=True), \
            tracing(TracingContext(fake_mode)):
        compiled = compile_fx_inner(traced, [*ins, *bufs], is_inference=True)
    draws = any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
                for n in gm.graph.nodes if n.op == "call_function")
    kernel = getattr(compiled, "current_callable", None) or compiled
    sizes = _SizeReader(in_vals)
    alias = ext.host_alias
    launch = ext.launch

    def run(args):
        mode = _engine_mode()
        if mode is None:
            return call(args)
        # a backward graph, called by autograd under the engine: what the engine holds is
        # launched first (it computes this graph's inputs), and the call runs outside it
        mode.boundary("torch.compile graph")
        with mode.outside():
            return call(args)

    def call(args):
        env = sizes.bind(args)
        outs = []
        written = []
        for o in plan:
            if o.kind == "fresh":
                t = torch.empty_strided(env(o.size), env(o.stride), dtype=o.dtype,
                                        device=_device_of(args))
                written.append(t)
            elif o.kind == "input":
                t = args[o.of].as_strided(env(o.size), env(o.stride), env(o.offset))
            elif o.kind == "output":
                t = outs[o.of].as_strided(env(o.size), env(o.stride), env(o.offset))
            else:
                t = env(o.value)
            outs.append(t)
        host = [_host(a, alias) for a in args]
        host += [alias(t) for t in written]
        args.clear()
        launch(lambda: _run(kernel, gm, host, n_in), LAUNCH_NAME)
        if draws:  # the host waits while the device draws: numbers drawn in program order
            ext.wait("random ops in a torch.compile graph")
        return outs

    run._boxed_call = True
    return run


def _engine_mode():
    """The engine's mode on this thread's dispatch stack (autograd's threads inherit it), or
    None."""
    mode = sys.modules.get("adaptive_eager.tracer.mode")
    if mode is None:
        return None
    for m in reversed(_mode_stack()):
        if isinstance(m, mode.AdaptiveEagerMode):
            return m
    return None


def _run(kernel, gm, host: list, n_in: int) -> None:
    """The launch: the compiled graph; where it fails, the graph's ATen ops run one by one
    on the same inputs, so the error raised is the one eager raises (its type and message),
    not the generated kernel's own check."""
    inputs = host[:n_in]
    try:
        kernel(host)
    except Exception as error:
        try:
            with torch._C._AutoDispatchBelowADInplaceOrView():
                gm(*inputs)
        except Exception as eager:  # noqa: BLE001 -- eager's own error, raised instead
            raise eager from None
        raise error


def _host(a, alias):
    if isinstance(a, torch.Tensor):
        if a.device.type == "neuron":
            return alias(a)
        return a.detach().clone()  # a host tensor: read now, as eager would have
    return a


def _device_of(args) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type == "neuron":
            return a.device
    return torch.device("neuron")


class _SizeReader:
    """Reads the symbolic sizes of a graph compiled with ``dynamic=True`` from the call's
    arguments: each size symbol is an input's size (or an integer input)."""

    def __init__(self, in_vals):
        self.where = []  # (symbol, input index, dim or None)
        for i, v in enumerate(in_vals):
            if isinstance(v, torch.SymInt):
                self._note(v, i, None)
            elif isinstance(v, torch.Tensor):
                for d, s in enumerate(v.size()):
                    self._note(s, i, d)
        self.static = not self.where

    def _note(self, s, i, d):
        import sympy

        if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
            if all(sym != s.node.expr for sym, _, _ in self.where):
                self.where.append((s.node.expr, i, d))

    def bind(self, args):
        if self.static:
            return _static
        values = {sym: (args[i] if d is None else args[i].shape[d]) for sym, i, d in self.where}

        def env(x):
            if isinstance(x, (tuple, list)):
                return tuple(env(y) for y in x)
            if isinstance(x, torch.SymInt):
                return int(x.node.expr.xreplace(values))
            return x

        return env


def _static(x):
    if isinstance(x, (tuple, list)):
        return tuple(_static(y) for y in x)
    if isinstance(x, torch.SymInt):
        return int(x)
    return x
