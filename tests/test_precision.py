"""Precision is cast in the graph; every precision loss is measured, not hidden (seed 002)."""

import onnx
import torch

import compiler
from zoo.models import mlp_with_fallback


def test_fp16_engines_are_strongly_typed_and_their_error_is_reported(tmp_path):
    case = mlp_with_fallback()
    program = compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
    compiled = compiler.compile(program, cache=tmp_path, precision="fp16")
    engine = onnx.load_from_string(next(iter(compiled.engines.values())).engine)
    weights = [i for i in engine.graph.initializer if i.name.startswith("w")]
    assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)
    assert engine.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # casts are inside
    report = compiler.validate(case.model, compiled, runs=2, warmup=1)
    assert report.precision == "fp16"
    assert 1e-6 < report.max_rel_l2 < 1e-2  # a real, measured, bounded fp16 error
    assert compiled(torch.randn(3, 64)).dtype == torch.float32
