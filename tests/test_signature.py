"""tracer.signature: keys tell apart what computes differently, and nothing more."""

import torch

from adaptive_eager.scheduler.program import Ext, Rec, Val
from adaptive_eager.tracer.signature import describe, is_plain


def key_of(*args, **kwargs):
    seen = {}

    def source(t):
        return seen.get(id(t))

    ka, kk, ta, tk, new, rec = describe(args, kwargs, source, floats_by_value=False)
    return ka, ta, new, rec


def test_int_float_bool_keyed_apart():
    x = torch.ones(2)
    k_int = key_of(x, 1)[0]
    k_bool = key_of(x, True)[0]
    assert k_int != k_bool
    # floats are data: keyed by type only, recorded per call
    ka1, ta1, _, rec1 = key_of(x, 0.5)
    ka2, _, _, rec2 = key_of(x, 0.25)
    assert ka1 == ka2 and rec1 == [0.5] and rec2 == [0.25]
    assert type(ta1[1]) is Rec
    assert ka1 != key_of(x, 1)[0]


def test_new_external_keyed_by_metadata():
    a, b = torch.ones(2, 3), torch.ones(3, 2)
    assert key_of(a)[0] != key_of(b)[0]
    assert key_of(a)[0] != key_of(a.t().contiguous().t())[0]  # same shape, other strides
    assert key_of(torch.ones(2, 3))[0] == key_of(a)[0]


def test_same_tensor_twice_is_one_external():
    a = torch.ones(2)
    ka, ta, new, _ = key_of(a, a)
    assert len(new) == 1 and ka[1] == ("n", 0)
    assert key_of(a, torch.ones(2))[0] != ka


def test_sources():
    a, v = torch.ones(2), torch.ones(2)

    def source(t):
        return {id(a): Ext(0), id(v): Val(3)}.get(id(t))

    ka, _, ta, _, new, _ = describe((a, v), {}, source, False)
    assert ka == (("e", 0), ("v", 3)) and not new
    assert type(ta[0]) is Ext and type(ta[1]) is Val


def test_plain_tensors_only():
    assert is_plain(torch.ones(1)) and is_plain(torch.nn.Parameter(torch.ones(1)))
    assert not is_plain(torch.ones(2).to_sparse())
