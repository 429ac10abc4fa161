"""The engine's CUDA queue: replays on the current stream (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.scheduler import queues

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_has_its_own_queue():
    q = queues.queue_for("cuda")
    assert isinstance(q, queues.CudaQueue) and not q.asynchronous


@cuda
def test_replay_is_one_launch_on_the_current_stream_with_eager_values():
    x = torch.randn(1024, device="cuda")

    def f():
        return ((x * 2).sin() + 1).sum()

    expect = f().item()
    s = torch.cuda.Stream()
    with ae.enabled(devices=("cuda",), backend="exact"):
        for _ in range(3):
            f().item()
        before = ae.stats().replays
        with torch.cuda.stream(s):
            y = f()
        s.synchronize()
        assert ae.stats().replays - before == 1
        assert y.item() == expect
