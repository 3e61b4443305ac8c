import pytest
import torch
from torch.export import Dim

import compiler
from compiler.errors import ExportError, InputSpecError
from zoo.models import tiny_bert


class TwoInputs(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * 2 + y


def test_specs_are_captured_once_with_names_ranges_and_opt():
    case = tiny_bert()
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    ids, mask = compiler.input_specs(program)
    assert (ids.name, ids.dtype) == ("input_ids", "int64")
    assert ids.min_shape == (1, 4) and ids.opt_shape == (2, 16) and ids.max_shape == (8, 64)
    assert ids.dynamic_dims == {0: "batch", 1: "seq"} == mask.dynamic_dims
    assert ids.value_range[1] < 512  # token ids seen at export stay inside the vocabulary


def test_specs_survive_save_and_load_of_the_program(tmp_path):
    batch = Dim("batch", min=2, max=9)
    program = compiler.export(
        TwoInputs(), (torch.randn(3, 5), torch.randn(3, 5)), dynamic_shapes=({0: batch}, {0: batch})
    )
    path = compiler.save_program(program, tmp_path / "two.pt2")
    loaded = compiler.load_program(path)
    assert compiler.input_specs(loaded) == compiler.input_specs(program)
    assert compiler.input_specs(loaded)[1].dynamic_dims == {0: "batch"}


def test_plain_torch_export_programs_get_specs_from_their_constraints(tmp_path):
    program = torch.export.export(
        TwoInputs(),
        (torch.randn(3, 5), torch.randn(3, 5)),
        dynamic_shapes=({0: Dim("b", min=2, max=9)}, {0: Dim("b", min=2, max=9)}),
    )
    torch.export.save(program, tmp_path / "plain.pt2")
    specs = compiler.input_specs(torch.export.load(tmp_path / "plain.pt2"))
    assert [(s.min_shape, s.opt_shape, s.max_shape) for s in specs] == [((2, 5), (3, 5), (9, 5))] * 2
    assert specs[0].dynamic_dims[0] == specs[1].dynamic_dims[0]


def test_unbounded_range_is_a_clear_error():
    program = torch.export.export(
        TwoInputs(), (torch.randn(3, 5), torch.randn(3, 5)), dynamic_shapes=({0: Dim("b")}, {0: Dim("b")})
    )
    with pytest.raises(InputSpecError, match=r"unbounded range.*Dim"):
        compiler.input_specs(program)


class DataDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on values: torch.export cannot trace this
            return x
        return -x


def test_untraceable_model_raises_export_error_naming_the_model():
    with pytest.raises(ExportError, match="DataDependent"):
        compiler.export(DataDependent(), (torch.randn(3),))


def test_the_deserializer_gets_typing_answers_once_per_schema_class(tmp_path):
    import dataclasses
    import typing

    from torch._export.serde import schema, serialize

    from compiler.program.export import _SchemaTyping

    program = compiler.export(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
    loaded = compiler.load_program(compiler.save_program(program, tmp_path / "p.pt2"))
    assert isinstance(serialize.typing, _SchemaTyping)  # installed by the load
    x = torch.randn(3, 4)
    torch.testing.assert_close(loaded.module()(x), program.module()(x))
    classes = [c for c in vars(schema).values() if isinstance(c, type) and dataclasses.is_dataclass(c)]
    assert len(classes) > 20
    for cls in classes:  # the same answers as typing's own, twice (the second from the cache)
        for _ in range(2):
            assert serialize.typing.get_type_hints(cls, globalns=vars(schema)) == typing.get_type_hints(
                cls, globalns=vars(schema)
            )
