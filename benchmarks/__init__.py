"""The project's benchmarks: ``python -m benchmarks`` runs the suite (see README.md here)."""
