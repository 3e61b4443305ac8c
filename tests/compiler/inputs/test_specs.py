import pytest
import torch

from compiler.errors import InputSpecError
from compiler.inputs.specs import InputSpec, check_inputs, specs_from_json, specs_to_json


def spec(**overrides):
    fields = dict(
        name="x",
        dtype="float32",
        min_shape=(1, 8),
        opt_shape=(4, 8),
        max_shape=(16, 8),
        dynamic_dims={0: "batch"},
    )
    fields.update(overrides)
    return InputSpec(**fields)


def test_json_round_trip_keeps_every_field():
    specs = (spec(), spec(name="ids", dtype="int64", value_range=(0, 99)))
    assert specs_from_json(specs_to_json(specs)) == specs


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(min_shape=(8, 8), opt_shape=(8, 8), max_shape=(2, 8)), "min <= opt <= max"),
        (dict(dynamic_dims={}), "not named as dynamic"),
        (dict(dtype="complex32"), "unknown dtype"),
        (dict(max_shape=(16, 8, 1)), "one rank"),
    ],
)
def test_malformed_specs_name_the_problem(overrides, message):
    with pytest.raises(InputSpecError, match=message):
        spec(**overrides)


def test_newer_spec_format_is_refused():
    text = specs_to_json([spec()]).replace('"format_version": 1', '"format_version": 99')
    with pytest.raises(InputSpecError, match="format version 99"):
        specs_from_json(text)


def test_check_inputs_names_shape_dtype_and_shared_dims():
    a, b = spec(name="a"), spec(name="b")
    check_inputs([a, b], [torch.zeros(3, 8), torch.zeros(3, 8)])
    with pytest.raises(InputSpecError, match=r"input 'a': shape \(17, 8\) is outside"):
        check_inputs([a, b], [torch.zeros(17, 8), torch.zeros(17, 8)])
    with pytest.raises(InputSpecError, match="expected dtype float32, got int64"):
        check_inputs([a, b], [torch.zeros(3, 8, dtype=torch.int64), torch.zeros(3, 8)])
    with pytest.raises(InputSpecError, match="'batch' is 3 in input 'a' but 5"):
        check_inputs([a, b], [torch.zeros(3, 8), torch.zeros(5, 8)])
