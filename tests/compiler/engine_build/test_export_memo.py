"""One ONNX export per partition structure and process (compiler.engine_build.export_memo): quantizing,
the layer search and repair lower an int8 partition in fp32 again and again; what they get must be
byte for byte what a fresh export gives, with each plan's own weights."""

import onnx
import pytest

import compiler
from compiler.engine_build import export_memo
from compiler.engine_build.lower import lower_float
from zoo.models import mlp_with_fallback


def _plan(seed: int):
    case = mlp_with_fallback(seed=seed)
    program = compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
    plan = compiler.partition(program)
    return plan, plan.partitions[0]


@pytest.fixture(autouse=True)
def _fresh_memo():
    export_memo.clear()
    yield
    export_memo.clear()


def test_a_kept_export_gives_the_bytes_of_a_fresh_one_with_each_plans_own_weights():
    plan, part = _plan(seed=0)
    first = lower_float(plan, part, "fp32").onnx
    again = lower_float(plan, part, "fp32").onnx
    kept = list(export_memo._graphs)
    assert again == first and len(kept) == 1
    export_memo.clear()
    assert lower_float(plan, part, "fp32").onnx == first  # the kept copy is what exporting gives

    # Same structure, other weights: the same kept graph, this plan's own initializers in it.
    other, other_part = _plan(seed=1)
    shared = lower_float(other, other_part, "fp32").onnx
    assert list(export_memo._graphs) == kept and shared != first
    export_memo.clear()
    assert lower_float(other, other_part, "fp32").onnx == shared


def test_another_precision_is_another_export():
    plan, part = _plan(seed=0)
    lower_float(plan, part, "fp32")
    half = onnx.load_from_string(lower_float(plan, part, "fp16").onnx)
    assert len(export_memo._graphs) == 2
    weights = [i for i in half.graph.initializer if i.name.startswith("w")]
    assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)
