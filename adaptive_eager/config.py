"""Every setting of the engine, declared once, read from the environment once.

This module is a leaf: it imports nothing from the package and nothing heavy, because
``import torch`` runs it through the ``torch.backends`` autoload entry point
(``adaptive_eager._autoload``). Each variable is declared in ``VARIABLES`` with its type,
default and a one-line doc; the README's table is written from the same declarations.

Values are validated in one place (``_parse``) so that a bad environment variable and a bad
keyword to ``ae.enable()`` produce the same one-line message naming the value and the
accepted ones. The hot path never reads this module: the engine copies what it needs into
its own objects when it is enabled.
"""

from __future__ import annotations

import dataclasses
import os
import sys

__all__ = ["Config", "ConfigError", "VARIABLES", "from_env", "resolve", "setting"]

BACKENDS = ("exact", "inductor")
DEVICES = ("cpu", "cuda", "neuron")


class ConfigError(ValueError):
    """A setting has a value outside its accepted set; the message says which and what is accepted."""


@dataclasses.dataclass(frozen=True)
class Var:
    env: str  # environment variable name
    field: str  # Config field (and ae.enable keyword, where one exists)
    kind: str  # "bool" | "int" | "float" | "choice" | "devices" | "path"
    default: object
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple = ()
    engine: bool = True  # False: read by the emulated device, not part of the engine's Config


VARIABLES: tuple[Var, ...] = (
    Var("NEURON_ADAPTIVE_EAGER", "autoload", "bool", False,
        "1 enables the engine at `import torch` (no code change); unset or 0 does nothing."),
    Var("NEURON_ADAPTIVE_EAGER_DEVICES", "devices", "devices", ("neuron",),
        "Comma list of devices whose ops the engine manages: cpu, cuda, neuron."),
    Var("NEURON_ADAPTIVE_EAGER_BACKEND", "backend", "choice", None,
        "Micro-graph backend: `exact` (bitwise-eager replay) or `inductor` (fused). "
        "Default: inductor.", choices=BACKENDS),
    Var("NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD", "hot_threshold", "int", 2,
        "Times a path must recur before it is deferred and its micro-graph compiled "
        "(it replays exactly until the graph is ready).", minimum=1),
    Var("NEURON_ADAPTIVE_EAGER_CACHE_SIZE", "cache_size", "int", 256,
        "Compiled micro-graphs kept (LRU).", minimum=1),
    Var("NEURON_ADAPTIVE_EAGER_CROSSCHECK", "crosscheck", "bool", False,
        "1: every replay also runs its ops eagerly and compares; a mismatch raises."),
    Var("NEURON_ADAPTIVE_EAGER_DEBUG", "debug", "int", 0,
        "Log ladder on logger `adaptive_eager`: 1 compiles/fallbacks, 2 each replay, "
        "3 trie and cache decisions, 4 generated graph code.", minimum=0, maximum=4),
    Var("NEURON_ADAPTIVE_EAGER_VARIANTS", "variant_budget", "int", 8,
        "Compiled variants allowed per path (recompile-storm guard); past it the path "
        "runs eagerly.", minimum=1),
    Var("NEURON_ADAPTIVE_EAGER_MAX_SEGMENT_OPS", "max_segment_ops", "int", 20000,
        "Ops after which a segment is cut even without a boundary.", minimum=1),
    Var("NEURON_ADAPTIVE_EAGER_MAX_TRIE_NODES", "max_trie_nodes", "int", 200000,
        "Trie size budget per thread; past it new paths are not learned.", minimum=1),
    Var("NEURON_ADAPTIVE_EAGER_DIVERGENCE_LIMIT", "divergence_limit", "int", 3,
        "Divergences from a hot path at one op after which segments always end there "
        "(the path is cut: one extra launch instead of a cold run each time).", minimum=1),
    Var("NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO", "suspend_ratio", "float", 1.05,
        "The engine times optimizer steps with and without itself; when its steps take "
        "more than this multiple of eager's it steps aside (plain eager) for a while, "
        "counted; 0 disables the check.", minimum=0.0),
    Var("NEURON_ADAPTIVE_EAGER_RETIRE_RATIO", "retire_ratio", "float", 1.10,
        "A fused graph whose measured step time exceeds this multiple of the eager "
        "step it replaces is retired; 0 disables the check.", minimum=0.0),
    Var("NEURON_ADAPTIVE_EAGER_QUEUE_DEPTH", "queue_depth", "int", 8,
        "Launches the engine lets wait on an asynchronous device queue; a replay submitted "
        "beyond it waits for the device first (bounds how far the host runs ahead and the "
        "memory queued launches hold), counted.", minimum=1),
    Var("NEURON_ADAPTIVE_EAGER_COMPILE_PROCESS", "compile_process", "bool", True,
        "1: fused graphs whose kernels run on the CPU or on CUDA compile in a separate "
        "process, so the loop never waits for the interpreter lock while they compile; 0: "
        "on a thread of this process."),
    Var("NEURON_ADAPTIVE_EAGER_CPP_WRAPPER", "cpp_wrapper", "bool", True,
        "1: fused graphs whose kernels run on the CPU (cpu, the emulated neuron device) are "
        "built with Inductor's C++ wrapper, which calls their kernels without Python (a "
        "faster hot step; a longer compile in the background); 0: Inductor's Python "
        "wrapper."),
    Var("NEURON_ADAPTIVE_EAGER_HOT_PATH", "hot_path", "choice", "key",
        "How a hot path checks and records each op: `key` (ops reach the engine through a "
        "dispatch key of its own below autograd, and a hot segment's ops are served there in "
        "C++ without Python), `cpp` (through a Python dispatch mode, each op checked and "
        "recorded by compiled code; ops it cannot serve use Python, counted) or `python` "
        "(generated Python, needing no compiler). `key` and `cpp` are built once with the "
        "machine's compiler.", choices=("key", "cpp", "python")),
    Var("NEURON_ADAPTIVE_EAGER_WARM_START", "warm_start", "bool", True,
        "1: the paths the engine learns and the graphs it compiles are kept on disk, and a "
        "later run of the same program starts from them (its known steps replay at once); "
        "0: every run learns anew."),
    Var("NEURON_ADAPTIVE_EAGER_CACHE_DIR", "cache_dir", "path", None,
        "Directory of the warm-start cache (created 0700; one not private to the user is "
        "refused). Default: `$XDG_CACHE_HOME/adaptive_eager/warm`, else "
        "`~/.cache/adaptive_eager/warm`."),
    Var("NEURON_ADAPTIVE_EAGER_CACHE_MB", "cache_mb", "int", 1024,
        "Size bound of the warm-start cache in MiB; past it the least recently used "
        "entries are removed.", minimum=1),
    Var("NEURON_ADAPTIVE_EAGER_CACHE_EXIT_S", "cache_exit_s", "float", 60.0,
        "With warm start on, seconds the program's exit waits at most for graphs still "
        "compiling, so that the cache keeps them for the next run (said in one line; Ctrl-C "
        "skips the wait); 0: no wait.", minimum=0.0),
    Var("NEURON_EMULATOR_LAUNCH_US", "emulator_launch_us", "float", 10.0,
        "Modelled launch latency of the emulated `neuron` device, in microseconds, paid per "
        "launch on the device's timeline (not by the host); see README, The neuron device.",
        minimum=0.0, engine=False),
    Var("NEURON_EMULATOR_IMPL", "emulator_impl", "choice", "cpp",
        "Implementation of the emulated `neuron` device: `cpp` (a C++ PrivateUse1 backend, "
        "built once with the machine's compiler; the default) or `python` (the earlier "
        "tensor-subclass device, needing no compiler).", choices=("cpp", "python"),
        engine=False),
)

_BY_FIELD = {v.field: v for v in VARIABLES}

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


@dataclasses.dataclass(frozen=True)
class Config:
    """The effective settings of one enabled engine."""

    devices: tuple[str, ...] = ("neuron",)
    backend: str | None = None
    hot_threshold: int = 2
    cache_size: int = 256
    crosscheck: bool = False
    debug: int = 0
    variant_budget: int = 8
    max_segment_ops: int = 20000
    max_trie_nodes: int = 200000
    retire_ratio: float = 1.10
    divergence_limit: int = 3
    suspend_ratio: float = 1.05
    queue_depth: int = 8
    compile_process: bool = True
    cpp_wrapper: bool = True
    hot_path: str = "key"
    warm_start: bool = True
    cache_dir: str | None = None
    cache_mb: int = 1024
    cache_exit_s: float = 60.0

    def backend_for(self, device_type: str) -> str:
        """Backend used for segments on ``device_type``."""
        return self.backend or "inductor"


def _accepted(var: Var) -> str:
    if var.kind == "bool":
        return "0 or 1"
    if var.kind == "choice":
        return ", ".join(repr(c) for c in var.choices)
    if var.kind == "devices":
        return "a comma list of " + ", ".join(repr(c) for c in DEVICES)
    if var.kind == "path":
        return "an absolute directory path (~ allowed)"
    lo = "" if var.minimum is None else f">= {var.minimum}"
    hi = "" if var.maximum is None else f"<= {var.maximum}"
    what = "an integer" if var.kind == "int" else "a number"
    return " and ".join(x for x in (f"{what} {lo}".strip(), hi) if x)


def _bad(name: str, value: object, var: Var) -> ConfigError:
    return ConfigError(f"adaptive_eager: {name}={value!r} is not valid; accepted: {_accepted(var)}")


def _parse(var: Var, value: object, name: str):
    """Turn ``value`` (an env string or a keyword value) into the field's type, or raise."""
    kind = var.kind
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
            return value.strip().lower() in TRUE
        raise _bad(name, value, var)
    if kind == "path":  # absolute: a relative one would name another directory in each cwd
        if isinstance(value, (str, os.PathLike)):
            path = os.path.expanduser(str(os.fspath(value)).strip())
            if os.path.isabs(path):
                return path
        raise _bad(name, value, var)
    if kind == "choice":
        if isinstance(value, str) and value.strip().lower() in var.choices:
            return value.strip().lower()
        raise _bad(name, value, var)
    if kind == "devices":
        items = value.split(",") if isinstance(value, str) else value
        try:
            out = tuple(str(d).strip().lower() for d in items)
        except TypeError:
            raise _bad(name, value, var) from None
        if not out or any(d not in DEVICES for d in out):
            raise _bad(name, value, var)
        return tuple(dict.fromkeys(out))
    # numbers
    if isinstance(value, bool):
        raise _bad(name, value, var)
    try:
        num = int(value) if kind == "int" else float(value)
        if kind == "int" and isinstance(value, float) and value != num:
            raise ValueError
    except (TypeError, ValueError):
        raise _bad(name, value, var) from None
    if (var.minimum is not None and num < var.minimum) or (
        var.maximum is not None and num > var.maximum
    ):
        raise _bad(name, value, var)
    return num


def from_env(environ=None, engine_only: bool = False) -> tuple[dict, list[str]]:
    """Read every declared variable once (``engine_only``: the engine's, not the emulated
    device's). Returns (field -> value for the set ones, errors)."""
    environ = os.environ if environ is None else environ
    values, errors = {}, []
    for var in VARIABLES:
        if engine_only and not var.engine:
            continue
        raw = environ.get(var.env)
        if raw is None or (raw == "" and var.kind != "bool"):
            continue
        try:
            values[var.field] = _parse(var, raw, var.env)
        except ConfigError as e:
            errors.append(str(e))
    return values, errors


def setting(field: str, lenient: bool = False):
    """One setting's value from the environment, else its default; ConfigError if bad (with
    ``lenient``, the default, and the error as one line on stderr)."""
    var = _BY_FIELD[field]
    raw = os.environ.get(var.env)
    if raw is None or raw == "":
        return var.default
    try:
        return _parse(var, raw, var.env)
    except ConfigError as e:
        if not lenient:
            raise
        sys.stderr.write(f"{e}; using {var.default!r}\n")
        return var.default


def resolve(**keywords) -> Config:
    """The Config for ``ae.enable(**keywords)``: keywords, else the environment, else defaults.

    Raises ConfigError (a ValueError) for a bad keyword or a bad environment value.
    """
    env_values, errors = from_env(engine_only=True)  # the device reads its own settings
    if errors:
        raise ConfigError(errors[0])
    fields = {k: v for k, v in env_values.items() if k != "autoload" and _BY_FIELD[k].engine}
    for name, value in keywords.items():
        if value is None:
            continue
        var = _BY_FIELD.get(name)
        if var is None or name == "autoload" or not var.engine:
            raise TypeError(f"adaptive_eager: unknown setting {name!r}")
        fields[name] = _parse(var, value, name)
    return Config(**fields)
