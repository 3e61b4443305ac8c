"""Ops kept in fp32 inside an fp16 partition (compiler.engine_build.float_ops, issue 46) as the ONNX graph
every ONNX backend is handed: the graph TensorRT and TensorRT-RTX parse into a strongly typed network
(their only precision control), run here by ONNX Runtime, which takes the same graph.

Kept ops read fp32 (Cast nodes in front of them, their weights stored fp32), pass fp32 to each other,
and the rest of the graph stays fp16; the engine's fingerprint changes with the set; the outputs come
closer to fp32.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import onnx
import pytest
import torch

import compiler
from compiler.engine_build.float_ops import candidates, op_name
from compiler.engine_build.lower import lower_float
from zoo.models import tiny_bert


@pytest.fixture(scope="module")
def compiled():
    case = tiny_bert(num_layers=1, hidden=64, seq_len=16)
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    options = compiler.CompileOptions(precision="fp16", backend="onnxruntime")
    half = compiler.compile(program, options, cache=False)
    [partition] = half.plan.partitions
    sub = half.plan.submodule(partition.name)
    norms = tuple(name for name, node in candidates(sub) if op_name(node) == "layer_norm")
    kept = dataclasses.replace(options, float_layers={partition.name: norms})
    mixed = compiler.compile(program, kept, cache=False)
    return {"case": case, "half": half, "mixed": mixed, "norms": norms, "partition": partition.name}


def _typed(graph: bytes) -> tuple[onnx.ModelProto, dict[str, int]]:
    model = onnx.shape_inference.infer_shapes(onnx.load_from_string(graph))
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    types.update({i.name: i.type.tensor_type.elem_type for i in model.graph.input})
    return model, types


def test_kept_ops_read_fp32_in_the_onnx_graph_and_the_rest_stays_fp16(compiled):
    assert len(compiled["norms"]) >= 2  # the embeddings' LayerNorm and the layer's two
    plan = compiled["mixed"].plan
    [partition] = plan.partitions
    model, types = _typed(lower_float(plan, partition, "fp16").onnx)
    norms = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert len(norms) == len(compiled["norms"]), [n.op_type for n in model.graph.node]
    for node in norms:  # input, scale and bias: fp32 (the scale and bias stored so, not cast up)
        assert [types.get(i) for i in node.input] == [onnx.TensorProto.FLOAT] * 3, node
    gemms = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm")]
    assert gemms and all(types.get(n.input[0]) == onnx.TensorProto.FLOAT16 for n in gemms)
    casts = {a.i for n in model.graph.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"}
    assert {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16} <= casts
    # The all-fp16 graph of the same partition has no fp32 LayerNormalization.
    half_plan = compiled["half"].plan
    half_model, half_types = _typed(lower_float(half_plan, half_plan.partitions[0], "fp16").onnx)
    half_norms = [n for n in half_model.graph.node if n.op_type == "LayerNormalization"]
    assert half_norms and all(half_types.get(n.input[0]) == onnx.TensorProto.FLOAT16 for n in half_norms)


def test_the_set_changes_the_engine_and_brings_the_outputs_closer_to_fp32(compiled):
    half, mixed = compiled["half"], compiled["mixed"]
    assert set(half.engines).isdisjoint(mixed.engines)  # another engine, another cache key
    [fp] = mixed.engines
    assert mixed.engines[fp].backend == "onnxruntime"  # built, not fallen back to PyTorch
    case = compiled["case"]
    torch.manual_seed(1)
    errors = {"half": [], "mixed": []}
    for _ in range(4):
        ids = torch.randint(0, 512, (2, 16))
        with torch.no_grad():
            want = case.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        for name, module in (("half", half), ("mixed", mixed)):
            got = module(input_ids=ids, attention_mask=torch.ones_like(ids))
            got = got.last_hidden_state if hasattr(got, "last_hidden_state") else got[0]
            errors[name].append(float((got.float() - want).norm() / want.norm()))
    assert np.mean(errors["mixed"]) < 0.8 * np.mean(errors["half"]), errors


class _StepLike(torch.nn.Module):
    """What a generation step's graph holds that a BERT's does not: a size (``sym_size``) feeding
    ``new_zeros``, and the model's own positional cast (``to(x, torch.float16)``) into a product."""

    def forward(self, x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = x.new_zeros(x.shape[0], 4)
        weights = torch.softmax(x, dim=-1).to(torch.float16)
        return weights @ v, cache


def test_every_op_kept_in_fp32_runs_on_a_graph_with_sizes_and_positional_casts():
    from compiler.engine_build.float_ops import raised

    x, v = torch.randn(3, 8, dtype=torch.float16), torch.randn(8, 5, dtype=torch.float16)
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(_StepLike(), (x, v), dynamic_shapes=({0: batch}, None))
    sub = program.graph_module
    names = [name for name, _ in candidates(sub)]
    assert any(op_name(node) in ("softmax", "_softmax") for _, node in candidates(sub))
    sizes = [n for n in sub.graph.nodes if op_name(n) == "sym_size"]
    assert sizes, sub.code  # the batch is a size the graph reads
    wide = raised(copy.deepcopy(sub), names, torch.float16)
    out, cache = wide(x, v)  # before: the size was cast to a float tensor, the cast read as a move
    want = torch.softmax(x.float(), dim=-1).half() @ v
    assert cache.shape == (3, 4) and not cache.any()  # an output a kept op wrote stays fp32 (the
    assert torch.allclose(out.float(), want.float(), atol=1e-2)  # engine module casts outputs)
