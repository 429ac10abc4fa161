"""Fidelity at scale: PyTorch's OpInfo database run under the engine and compared with eager.

``python -m tests.fidelity.opinfo --full`` runs the whole sweep and writes ``RESULTS.md``;
``test_opinfo_slice.py`` runs a fixed slice of it in the test suite.
"""
