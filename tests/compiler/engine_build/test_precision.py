"""Precision is cast in the graph; every precision loss is measured, not hidden (seed 002)."""

import io

import onnx
import pytest
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


def test_fp16_transformer_keeps_every_float32_cast_out_of_the_engine(tmp_path):
    from zoo.models import tiny_gpt2

    case = tiny_gpt2()
    program = compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
    compiled = compiler.compile(program, cache=tmp_path, precision="fp16")
    engine = onnx.shape_inference.infer_shapes(
        onnx.load_from_string(next(iter(compiled.engines.values())).engine)
    )
    dtypes = {v.name: v.type.tensor_type.elem_type for v in engine.graph.value_info}
    produced = [(n.op_type, dtypes.get(out)) for n in engine.graph.node for out in n.output]
    assert sum(1 for _, dtype in produced if dtype == onnx.TensorProto.FLOAT16) > 20
    # float32 appears only where the engine casts its outputs back to the model's dtype
    assert {op for op, dtype in produced if dtype == onnx.TensorProto.FLOAT} <= {"Cast"}
    assert compiler.validate(case.model, compiled, runs=1, warmup=0).max_rel_l2 < 1e-2


def test_bf16_lowers_but_onnx_runtime_on_cpu_refuses_it_with_the_node(tmp_path):
    from compiler.errors import EngineBuildError

    case = mlp_with_fallback()
    program = compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
    with pytest.raises(EngineBuildError, match=r"rejected partition engine_0: .*Gemm") as failure:
        compiler.compile(program, cache=tmp_path, precision="bf16", on_build_failure="error")
    assert failure.value.partition == "engine_0" and "Gemm" in failure.value.node


class MaskedScores(torch.nn.Module):
    """What HF's eager attention does: fill masked scores with float32's lowest value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.fc(x)
        lowest = torch.finfo(torch.float32).min
        floor = torch.full_like(scores, lowest)
        scores = scores.masked_fill(scores < -1, lowest)
        return torch.maximum(scores, floor).softmax(-1) * (x / 1e5)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_float32_extremes_are_the_engine_dtypes_own(precision):
    """torch.finfo(float32).min overflows fp16 (torch raises 'cannot be converted to type c10::Half
    without overflow'; Inductor on CUDA did, for BERT-base): the lowered engine graph fills with the
    engine dtype's extreme instead, and a scalar in arithmetic (x / 1e5) keeps its value."""
    from compiler.backends.base import unpack_torch_graph
    from compiler.engine_build.lower import lower_program

    model, x = MaskedScores().eval(), torch.randn(4, 8)
    plan = compiler.partition(compiler.export(model, (x,)), compiler.CompileOptions(precision=precision))
    unique = compiler.dedup(plan)
    lowered = lower_program(plan, unique, unique.fingerprints[0])
    program = torch.export.load(io.BytesIO(unpack_torch_graph(lowered.program)[0]))
    scalars = [
        a
        for node in program.graph.nodes
        for a in torch.fx.node.map_aggregate(node.args, lambda v: v)
        if isinstance(a, float)
    ]
    largest = torch.finfo({"fp16": torch.float16, "bf16": torch.bfloat16}[precision]).max
    assert -largest in scalars and (1e5 in scalars or 1e-5 in scalars)
    assert all(abs(s) <= largest for s in scalars if s not in (1e5, 1e-5))
    module = compiler.compile(
        compiler.export(model, (x,)), backend="inductor", precision=precision, cache=False
    )
    assert not module.report.build_failures
    torch.testing.assert_close(module(x).float(), model(x), rtol=0.05, atol=1e-2)
