import pytest
import torch

import compiler
from compiler.errors import OptionsError, PartitionError
from compiler.options import CompileOptions
from zoo.models import mlp_with_fallback, repeated_fallback, tiny_bert


def _program(case):
    return compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)


def _inputs_are_tensors(plan):
    for part in plan.partitions:
        sub = plan.submodule(part.name)
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                assert isinstance(node.meta["val"], torch.Tensor), (part.name, node.name)


def test_unsupported_op_falls_back_and_is_reported():
    plan = compiler.partition(_program(mlp_with_fallback()))
    assert plan.fallback_ops == {"kiln_zoo.soft_sign_clip.default": 1}
    assert len(plan.partitions) == 2
    assert all("kiln_zoo.soft_sign_clip.default" not in p.ops for p in plan.partitions)


def test_torch_executed_ops_forces_ops_to_pytorch():
    plan = compiler.partition(
        _program(mlp_with_fallback()), CompileOptions(torch_executed_ops=("aten.gelu",))
    )
    assert plan.fallback_ops["aten.gelu.default"] == 1
    assert all("aten.gelu.default" not in p.ops for p in plan.partitions)


def test_unknown_op_name_is_rejected():
    with pytest.raises(PartitionError, match=r"'aten\.not_an_op' is not an ATen op"):
        compiler.partition(
            _program(mlp_with_fallback()), CompileOptions(torch_executed_ops=("aten.not_an_op",))
        )


def test_min_block_size_sends_small_partitions_to_pytorch():
    program = _program(repeated_fallback(depth=3))
    assert min(sum(p.ops.values()) for p in compiler.partition(program).partitions) == 1
    plan = compiler.partition(program, CompileOptions(min_block_size=3))
    # The one-op head before the first fallback op is too small; the 3- and 4-op bodies stay engines.
    assert all(sum(p.ops.values()) >= 3 for p in plan.partitions) and len(plan.partitions) == 3
    assert plan.fallback_ops["aten.linear.default"] == 1


def test_bad_settings_are_typed_errors():
    with pytest.raises(PartitionError, match="min_block_size"):
        CompileOptions(min_block_size=0)
    with pytest.raises(PartitionError, match="precision 'int4'"):
        CompileOptions(precision="int4")


def test_a_bad_option_is_an_options_error_that_older_except_clauses_still_catch():
    """Bad options raise OptionsError, a PartitionError (what they raised before) and a ValueError."""
    for bad in ({"min_block_size": 0}, {"device": "tpu"}, {"on_build_failure": "skip"}):
        with pytest.raises(OptionsError) as caught:
            CompileOptions(**bad)
        assert isinstance(caught.value, PartitionError) and isinstance(caught.value, ValueError)
    with pytest.raises(OptionsError, match="not an ATen op"):
        compiler.partition(
            _program(mlp_with_fallback()), CompileOptions(torch_executed_ops=("aten.not_an_op",))
        )


def test_repeated_blocks_become_their_own_partitions_and_no_size_crosses_a_boundary():
    plan = compiler.partition(_program(tiny_bert(num_layers=3)), CompileOptions(split_modules="auto"))
    blocks = [p.block for p in plan.partitions]
    assert blocks.count(None) == 2 and {"encoder.layer.0", "encoder.layer.1", "encoder.layer.2"} <= set(
        blocks
    )
    _inputs_are_tensors(plan)


def test_plan_serialises_to_json_and_replays_on_the_same_program():
    from compiler.partitioning.partition import replay

    program = _program(repeated_fallback(depth=2))
    plan = compiler.partition(program, CompileOptions(split_modules=("RepeatedFallbackBlock",)))
    again = replay(plan.program, plan.to_dict())
    assert [p.to_dict() for p in again.partitions] == [p.to_dict() for p in plan.partitions]


class _SizesIntoNoGrad(torch.nn.Module):
    """transformers 5.17's rotary embedding, reduced: a ``no_grad`` block (a higher-order op under export,
    which stays in PyTorch) reading the input's sizes and a tensor computed beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 8))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            angles = (positions[:, :, None] * self.freq).reshape(x.shape[0], x.shape[1], 8)
        return self.lin(x) + angles.cos()


def test_a_size_read_by_a_fallback_op_stays_in_pytorch_and_the_model_compiles():
    """The H100 decode failure (issue 44): a size copy merged into the engine before the no_grad block
    left that engine with a SymInt output, and building it failed in engine_io."""
    from torch.export import Dim

    model = _SizesIntoNoGrad().eval()
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5)
    batch, length = Dim("batch", max=4), Dim("length", min=2, max=16)
    program = compiler.export(model, (x, mask), dynamic_shapes=({0: batch, 1: length}, {0: batch, 1: length}))
    plan = compiler.partition(program)
    assert plan.fallback_ops.get("torch.ops.higher_order.wrap_with_set_grad_enabled") == 1, plan.fallback_ops
    for part in plan.partitions:
        outputs = next(n for n in plan.submodule(part.name).graph.nodes if n.op == "output").args[0]
        assert all(isinstance(o.meta["val"], torch.Tensor) for o in outputs), part.name
    _inputs_are_tensors(plan)
    compiled = compiler.compile(program, backend="onnxruntime")
    x, mask = torch.randn(3, 7, 8), torch.ones(3, 7)
    mask[1, :2] = 0
    torch.testing.assert_close(compiled(x, mask), model(x, mask), rtol=1e-5, atol=1e-5)
