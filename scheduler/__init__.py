"""Scheduler: programs, backends, the compile cache, queues and launches."""
