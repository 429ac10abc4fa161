"""Greedy generation with a real model (HF Llama, tiny config): same tokens as eager."""

import pathlib
import sys

import pytest
import torch

import adaptive_eager as ae
from conftest import Delta

pytest.importorskip("transformers")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks.zoo import build  # noqa: E402

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llama():
    model, batch = build("llama")
    model.eval()
    return model, batch["input_ids"][:1, :8]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("backend", ["exact", "inductor"])
def test_generate_same_tokens_as_eager(llama, cache, backend):
    model, ids = llama
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    if cache == "static":
        kw["cache_implementation"] = "static"
    ref = model.generate(ids, **kw)
    assert ref.shape[1] == ids.shape[1] + NEW_TOKENS
    with ae.enabled(devices=("cpu",), backend=backend):
        outs = [model.generate(ids, **kw) for _ in range(5)]
        d = Delta()
        outs.append(model.generate(ids, **kw))
    for out in outs:
        assert torch.equal(out, ref)
    # Decode steps replay: each step's ops run as a few launches, not one per op.
    assert d.replays >= NEW_TOKENS
    assert d.launches <= 8 * NEW_TOKENS < d.ops_intercepted // 10
