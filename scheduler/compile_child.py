"""The compile process's own side: what the child started by scheduler.compile_process runs.

It reads each request (``compile_process.pack``: the device the request's metadata names and
the arguments of ``backends.inductor_artifact``), compiles, and answers with Inductor's
serialized output (Note [Compiles leave the process] in scheduler.compile_process). Kept
apart from the client so that the client does not import the backends that import it.
"""

from __future__ import annotations

from . import compile_process
from .backends import inductor_artifact


def _compile(data: bytes):
    device, args = compile_process.loads(data)
    if device == "neuron":  # the request's metadata names the device: register it
        from adaptive_eager import neuron

        neuron.ensure()
    return inductor_artifact(*compile_process.loads(args))


if __name__ == "__main__":
    compile_process.serve(_compile)
