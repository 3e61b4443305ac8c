"""Shape profiles on the CPU (issue 20): Inductor's static-shape specialization per profile, served on
an exact shape match while the dynamic engine serves the rest, recorded in the report and kept by a
package; ``pad_to_profile`` padding a batch up to a profile where the compile-time check allowed it
and refused, naming the profile, where padding changes the real rows. The CUDA side (graphs captured
per profile) is tests/gpu/test_cuda_graphs_gpu.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.export import Dim

import compiler
from compiler.backends.inductor.backend import InductorBackend
from compiler.backends.inductor.format import HEADER, pack, read_engine
from compiler.errors import InputSpecError, PartitionError, UnsafeEngineError
from compiler.inputs.profiles import normalize, profile_bounds
from zoo.config import ZooEntry


class RowWise(nn.Module):
    """Every output row depends on its input row only: padding rows cannot change the real ones."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).softmax(-1)


class MixesRows(nn.Module):
    """Subtracts the batch mean: a padded row changes every real row's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x - x.mean(0, keepdim=True))


def _program(model: nn.Module) -> torch.export.ExportedProgram:
    return compiler.export(
        model, (torch.randn(4, 8),), dynamic_shapes={"x": {0: Dim("batch", min=1, max=16)}}
    )


@pytest.fixture(scope="module")
def inductor_profiled():
    """One real Inductor compile (dynamic engine plus the batch-2 specialization) shared by the tests."""
    torch.manual_seed(0)
    model = RowWise().eval()
    module = compiler.compile(
        _program(model), backend="inductor", cache=False, profiles=[{"batch": 2}], pad_to_profile="auto"
    )
    return model, module


def test_static_specialization_serves_its_profile_and_the_dynamic_engine_the_rest(
    inductor_profiled, tmp_path
):
    model, module = inductor_profiled
    (artifact,) = [a for a in module.engines.values() if a.is_engine]
    header, files = read_engine(artifact.engine)
    assert header["specializations"] == [[[2, 8]]] and "inductor_static_0.bin" in files
    for batch, served in ((2, "static"), (3, "dynamic")):
        x = torch.randn(batch, 8)
        out = module(x)
        assert set(module.last_dispatch().values()) == {served}, batch
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    (row,) = module.report.profiles
    assert row["engines"] and set(row["engines"].values()) == {"static"}
    assert row["dispatch"].startswith("static specializations in 1 of 1 engines")
    # The package keeps the specialization and the record: a load dispatches as the compile did.
    path = tmp_path / "rowwise.kiln"
    compiler.save(module, path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["report"]["profiles"][0]["engines"] == row["engines"]
    loaded = compiler.load(path)
    x = torch.randn(2, 8)
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)
    assert set(loaded.last_dispatch().values()) == {"static"}


def test_a_header_listing_a_specialization_outside_the_range_is_refused(inductor_profiled):
    """An untrusted load compiles every listed specialization: the list is checked before any compile."""
    _, module = inductor_profiled
    (artifact,) = [a for a in module.engines.values() if a.is_engine]
    header, files = read_engine(artifact.engine)
    header["specializations"] = [[[99, 8]]]  # batch 99: outside the input's 1..16
    tampered = pack({**files, HEADER: json.dumps(header).encode()})
    with pytest.raises(UnsafeEngineError, match="not one shape per activation input inside its range"):
        InductorBackend(trust_engine_code=False).load(tampered, artifact.io, None)


def test_pad_to_profile_pads_a_smaller_batch_where_the_check_allowed_it(inductor_profiled):
    model, module = inductor_profiled
    padding = module.report.profiles[0]["padding"]
    assert padding["allowed"] and padding["checked_batches"] == [1]
    x = torch.randn(1, 8)
    out = module(x)
    assert out.shape == (1, 4)
    assert set(module.last_dispatch().values()) == {"static"}  # ran padded, in the batch-2 specialization
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


def test_pad_to_profile_is_refused_naming_the_profile_where_padding_changes_outputs():
    torch.manual_seed(0)
    model = MixesRows().eval()
    with pytest.warns(UserWarning, match=r"pad_to_profile: refused for profile 0 \{'batch': 4\}"):
        module = compiler.compile(
            _program(model), cache=False, profiles=[{"batch": 4}], pad_to_profile="auto"
        )
    padding = module.report.profiles[0]["padding"]
    assert not padding["allowed"]
    assert "profile 0 {'batch': 4}" in padding["reason"] and "mixes rows" in padding["reason"]
    x = torch.randn(3, 8)  # not padded: the answer stays the model's own
    torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-5)


def test_pad_to_profile_is_checked_where_options_are_made():
    with pytest.raises(PartitionError, match="pad_to_profile 'always' is not supported"):
        compiler.CompileOptions(profiles=[{"batch": 2}], pad_to_profile="always")
    with pytest.raises(PartitionError, match="needs profiles"):
        compiler.CompileOptions(pad_to_profile="auto")
    entry = ZooEntry.model_validate(
        {
            "name": "m",
            "factory": "zoo.models:mlp_with_fallback",
            "profiles": [{"batch": 8}],
            "pad_to_profile": "auto",
        }
    )
    assert entry.requests()[0].options.pad_to_profile == "auto"
    with pytest.raises(ValidationError, match="pad_to_profile"):
        ZooEntry.model_validate(
            {"name": "m", "factory": "zoo.models:mlp_with_fallback", "pad_to_profile": "x"}
        )


def test_ranges_are_profiles_measured_at_their_opt_point_and_never_padded_to():
    assert normalize([{"batch": [2, 8]}, {"batch": (9, 12, 16)}]) == (
        {"batch": (2, 8)},
        {"batch": (9, 12, 16)},
    )
    for bad in ([8, 2], [0, 4], [1, 2, 3, 4], "4", [1.5, 3], True):
        with pytest.raises(InputSpecError, match=r"profile 0 .*'batch' must be an integer >= 1 or a range"):
            normalize([{"batch": bad}])
    program = _program(RowWise().eval())
    specs = compiler.partition(program, compiler.CompileOptions()).specs
    assert profile_bounds(specs, {"batch": (2, 8)}) == [((2, 8), (4, 8), (8, 8))]  # opt 4 lies inside
    with pytest.raises(InputSpecError, match=r"profile 1 .*batch = \(9, 40\) is outside input 'x'"):
        compiler.compile(program, cache=False, profiles=[{"batch": 2}, {"batch": (9, 40)}])
    torch.manual_seed(0)
    model = RowWise().eval()
    module = compiler.compile(
        _program(model), cache=False, profiles=[{"batch": (9, 16)}, {"batch": 4}], pad_to_profile="auto"
    )
    ranged, fixed = module.report.profiles
    assert ranged["kind"] == "range" and ranged["profile"] == {"batch": [9, 16]}
    assert ranged["shapes"] == [[9, 8]]  # the input's opt (4) clipped into the range
    assert not ranged["padding"]["allowed"] and "a range" in ranged["padding"]["reason"]
    assert fixed["kind"] == "fixed" and fixed["padding"]["allowed"]
    for batch in (3, 12):  # 3 pads to 4; 12 lies in the range and runs as it is
        x = torch.randn(batch, 8)
        torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-6)
    entry = ZooEntry.model_validate(
        {"name": "m", "factory": "zoo.models:mlp_with_fallback", "profiles": [{"batch": [2, 8]}]}
    )
    assert entry.requests()[0].options.profiles == ({"batch": (2, 8)},)


def test_the_cli_reads_sizes_and_ranges_and_names_a_malformed_profile():
    import typer

    from flows.cli.options import parse_profiles

    assert parse_profiles(["batch=8,seq=128", "batch=9:32", "batch=9:16:32"]) == [
        {"batch": 8, "seq": 128},
        {"batch": [9, 32]},
        {"batch": [9, 16, 32]},
    ]
    with pytest.raises(typer.Exit) as refused:  # the message is printed, the exit code says bad input
        parse_profiles(["batch"])
    assert refused.value.exit_code != 0
    # What the flag cannot judge (a size that is no number) the schema refuses, naming it.
    with pytest.raises(ValidationError, match="profiles"):
        ZooEntry.model_validate(
            {
                "name": "m",
                "factory": "zoo.models:mlp_with_fallback",
                "profiles": parse_profiles(["batch=x:4"]),
            }
        )
