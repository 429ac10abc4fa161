"""tracer.optable: op classes come from schemas and tags, with small tables for the gaps."""

import torch

from adaptive_eager.tracer.optable import OpClass, info

aten = torch.ops.aten


def test_classes():
    assert info(aten.add.Tensor).cls is OpClass.COMPUTE
    assert info(aten.view.default).cls is OpClass.VIEW
    assert info(aten.t.default).cls is OpClass.VIEW
    assert info(aten._unsafe_view.default).cls is OpClass.VIEW
    assert info(aten._local_scalar_dense.default).cls is OpClass.SYNC
    assert info(aten.equal.default).cls is OpClass.SYNC
    assert info(aten.nonzero.default).cls is OpClass.BOUNDARY
    assert info(aten.native_batch_norm.default).cls is OpClass.BOUNDARY
    assert info(aten.resize_.default).cls is OpClass.BOUNDARY
    assert info(torch.ops.profiler._record_function_enter_new.default).cls is OpClass.IGNORE


def test_mutation_and_randomness():
    add_ = info(aten.add_.Tensor)
    assert add_.mutated_args == ("self",) and add_.out_alias == ("self",)
    assert info(aten.native_dropout.default).random
    assert not info(aten.mul.Tensor).random
    assert info(aten.arange.start_step).float_values_matter


def test_boundary_reason_is_recorded():
    assert info(aten.nonzero.default).reason == "data-dependent output shape"
