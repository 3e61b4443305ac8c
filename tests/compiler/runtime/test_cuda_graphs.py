"""CUDA graphs (issue 20): the options, the policy and the manifest, on any machine.

``cuda_graphs`` is validated where options are made (CompileOptions, the zoo file, ``compiler.load``),
``"on"`` is a typed error where graphs cannot run, ``"auto"`` is off on the CPU with the reason, and the
mode travels in the manifest to every load path. What graphs do on a GPU: tests/gpu/test_cuda_graphs_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import compiler
from compiler.errors import CudaGraphError, InputSpecError
from compiler.runtime.cudagraph_policy import CaptureCheck, decide
from zoo.config import ZooEntry

CUDA = torch.device("cuda:0")


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    torch.manual_seed(0)
    model, x = Small().eval(), torch.randn(2, 8)
    module = compiler.compile(compiler.export(model, (x,)), cache=False, cuda_graphs="off")
    path = tmp_path_factory.mktemp("pkg") / "small.kiln"
    compiler.save(module, path)
    return model, x, module, path


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"cuda_graphs": "sometimes"}, r"cuda_graphs 'sometimes' is not supported; expected one of"),
        ({"cuda_graphs": "on"}, r"cuda_graphs 'on' needs a CUDA device; this model runs on 'cpu'"),
        (
            {"cuda_graphs": "on", "device": "cuda", "backend": "onnxruntime"},
            r"with backend 'onnxruntime': ONNX Runtime runs its engines on its own streams",
        ),
        (
            {"cuda_graphs": "on", "device": "cuda", "backend": "inductor", "on_build_failure": "onnxruntime"},
            r"with on_build_failure 'onnxruntime'",
        ),
    ],
)
def test_options_refuse_what_cannot_be_graphed(settings, message):
    with pytest.raises(CudaGraphError, match=message):
        compiler.CompileOptions(**settings)


def test_options_round_trip_and_default():
    options = compiler.CompileOptions(backend="inductor", device="cuda", cuda_graphs="on")
    assert compiler.CompileOptions.from_dict(options.to_dict()) == options
    older = {k: v for k, v in compiler.CompileOptions().to_dict().items() if k != "cuda_graphs"}
    assert compiler.CompileOptions.from_dict(older).cuda_graphs == "auto"  # packages from before


def test_the_policy_says_why_graphs_are_off():
    assert decide("auto", CUDA, ["inductor"], None).enabled
    assert decide("auto", torch.device("cpu"), ["inductor"], None).reason == "the model runs on cpu"
    assert decide("off", CUDA, ["inductor"], None).reason == "cuda_graphs is 'off'"
    outside = decide("auto", CUDA, ["inductor", "onnxruntime"], None)
    assert not outside.enabled and "['onnxruntime'] run outside PyTorch's CUDA stream" in outside.reason
    refused = CaptureCheck.from_dict(CaptureCheck(False, "a host sync", ((2, 8),), 0.1).to_dict())
    assert refused.shapes == ((2, 8),)
    failed = decide("auto", CUDA, ["inductor"], refused)
    assert not failed.enabled and failed.reason.endswith("check failed: a host sync")
    with pytest.raises(CudaGraphError, match="cannot be graphed: the compile-time capture check failed"):
        decide("on", CUDA, ["inductor"], refused)
    with pytest.raises(CudaGraphError, match="cannot be graphed: the model runs on cpu"):
        decide("on", torch.device("cpu"), ["inductor"], None)


def test_zoo_entries_carry_and_check_the_mode():
    base = {"name": "m", "factory": "zoo.models:mlp_with_fallback", "backend": "inductor"}
    entry = ZooEntry.model_validate({**base, "devices": ["cuda"], "cuda_graphs": "on"})
    assert entry.requests()[0].options.cuda_graphs == "on"
    assert ZooEntry.model_validate(base).requests()[0].options.cuda_graphs == "auto"
    with pytest.raises(ValidationError, match="cuda_graphs 'on' needs a CUDA device"):
        ZooEntry.model_validate({**base, "devices": ["cpu", "cuda"], "cuda_graphs": "on"})
    with pytest.raises(ValidationError, match="cuda_graphs"):
        ZooEntry.model_validate({**base, "cuda_graphs": "always"})


def test_auto_is_off_on_the_cpu_with_the_reason(package):
    model, x, _, path = package
    module = compiler.load(path, cuda_graphs="auto")
    graphs = module.cuda_graphs
    assert graphs.mode == "auto" and not graphs.enabled and graphs.reason == "the model runs on cpu"
    torch.testing.assert_close(module(x), model(x))
    assert graphs.to_dict()["captured_shapes"] == 0 and graphs.pool_bytes == 0
    assert module.report.cuda_graphs is None  # no capture check ran on the CPU


def test_the_mode_travels_in_the_manifest_to_every_load(package):
    _, _, module, path = package
    assert compiler.read_manifest(path).plan["options"]["cuda_graphs"] == "off"
    assert compiler.load(path).cuda_graphs.mode == "off"
    with pytest.raises(CudaGraphError, match="needs a CUDA device"):
        compiler.load(path, cuda_graphs="on")
    assert module.refit(module.weights).cuda_graphs.mode == "off"
    pytest.importorskip("mlflow", reason="kiln lookup's loader lives in the registry (MLflow)")
    from registry.lookup import load_package  # what kiln lookup and the MLflow pyfunc call

    assert load_package(path).cuda_graphs.mode == "off"


@pytest.fixture(scope="module")
def dynamic_program():
    from zoo.models import mlp_with_fallback

    case = mlp_with_fallback()  # batch 1..32
    return case, compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)


@pytest.mark.parametrize(
    ("profiles", "message"),
    [
        (
            [{"batch": 64}],
            r"profile 0 \{'batch': 64\}: batch = 64 is outside input 'x''s declared range \[1, 32\]",
        ),
        (
            [{"seq": 3}],
            r"names dimensions \['seq'\] that no input has; the dynamic dimensions are \['batch'\]",
        ),
        ([{"batch": 0}], r"dimension 'batch' must be an integer >= 1"),
        ([{"batch": 2}, {"batch": 2}], r"repeat a profile"),
    ],
)
def test_bad_profiles_are_refused_before_any_build(dynamic_program, profiles, message):
    _, program = dynamic_program
    with pytest.raises(InputSpecError, match=message):
        compiler.compile(program, cache=False, profiles=profiles)


def test_profiles_are_measured_and_travel_in_the_manifest(dynamic_program, tmp_path):
    case, program = dynamic_program
    module = compiler.compile(program, cache=False, profiles=[{"batch": 1}, {"batch": 16}])
    rows = module.report.profiles
    assert [r["profile"] for r in rows] == [{"batch": 1}, {"batch": 16}]
    assert rows[1]["shapes"] == [[16, 64]] and all(r["latency_ms"] > 0 for r in rows)
    assert rows[0]["dispatch"] == "dynamic engines, uncaptured (the model runs on cpu)"
    compiler.save(module, tmp_path / "p.kiln")
    manifest = compiler.read_manifest(tmp_path / "p.kiln")
    assert manifest.plan["options"]["profiles"] == [{"batch": 1}, {"batch": 16}]
    assert manifest.report.profiles == rows
    loaded = compiler.load(tmp_path / "p.kiln")
    assert loaded.plan.options.profiles == ({"batch": 1}, {"batch": 16})
    x = torch.randn(16, 64)
    torch.testing.assert_close(loaded(x), case.model(x), rtol=1e-4, atol=1e-4)
    entry = ZooEntry.model_validate(
        {"name": "m", "factory": "zoo.models:mlp_with_fallback", "profiles": [{"batch": 8}]}
    )
    assert entry.requests()[0].options.profiles == ({"batch": 8},)
