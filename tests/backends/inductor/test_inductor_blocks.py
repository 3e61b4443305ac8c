"""Cutting an engine's program at its repeated block's boundaries (compiler.backends.inductor.blocks):
what an untrusted first load compiles, once per distinct piece. The load itself, through
``compiler.load`` in a fresh process, is tests/compiler/package/test_cold_start.py's."""

from __future__ import annotations

import torch
from torch.export import Dim

from compiler.backends.inductor.blocks import compile_cut, cut_by_block
from tests.fixtures.block_stack import BlockStack


def _program(model: torch.nn.Module) -> torch.export.ExportedProgram:
    x = torch.randn(4, 12)
    return torch.export.export(model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=16)},))


def _flat_args(program: torch.export.ExportedProgram, x: torch.Tensor) -> list[torch.Tensor]:
    """The flat graph's inputs in order: its lifted weights, then the activation."""
    state = program.state_dict
    return [x if spec.target is None else state[spec.target] for spec in program.graph_signature.input_specs]


def test_a_stack_of_one_block_is_cut_into_its_instances_and_runs_as_the_program_did():
    torch.manual_seed(0)
    model = BlockStack((32,) * 6).eval()
    program = _program(model)
    cut = cut_by_block(program.graph_module)
    assert cut is not None
    # The input layer, six blocks and the projection after each: 13 pieces of four structures (the
    # input layer, the block, a 32->32 projection, the 32->4 output projection).
    assert len(cut.keys) == 13 and len(set(cut.keys.values())) == 4, cut.keys
    compiled: list[torch.fx.GraphModule] = []
    runner = compile_cut(cut, lambda piece: compiled.append(piece) or piece)
    assert len(compiled) == 4  # each structure "compiled" once, its instances calling it with their weights
    x = torch.randn(5, 12)  # another batch than the export's: the pieces are symbolic in it
    with torch.no_grad():
        torch.testing.assert_close(runner(*_flat_args(program, x))[0], model(x))


def test_blocks_of_different_widths_share_nothing_and_leave_the_program_whole():
    # Every instance of the repeated class has its own shapes: cutting would compile as much, in more
    # graphs, so the program is compiled whole.
    assert cut_by_block(_program(BlockStack((16, 24, 32, 40)).eval()).graph_module) is None
    mlp = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    assert cut_by_block(_program(mlp.eval()).graph_module) is None
