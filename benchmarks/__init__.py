"""The project's benchmarks: ``python -m benchmarks`` runs the suite (see README.md here)."""

import os as _os

# A benchmark measures a new user's run: what an earlier run kept (the warm-start cache,
# README: Warm start) must not make its first steps a second run's, nor its processes wait at
# exit for compiles to keep. Warm start is off unless the caller turns it on
# (benchmarks/warm_start.py does, for the runs it measures).
_os.environ.setdefault("NEURON_ADAPTIVE_EAGER_WARM_START", "0")
