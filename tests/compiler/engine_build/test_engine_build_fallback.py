"""A partition whose engine build fails falls back (to PyTorch by default) and the report says so.

The failure is real: ONNX Runtime's CPU provider has no bfloat16 Gemm kernel, so every partition with
a linear layer fails to build in bf16, while a partition that only moves data (Transpose) builds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.export import Dim

import compiler
from compiler.errors import EngineBuildError, PackageCorruptError, PartitionError
from compiler.runtime.module import EngineCall
from tasks.stages import load_artifact, store_artifact
from tasks.workspace import Workspace
from zoo.config import ZooEntry
from zoo.models import mlp_with_fallback, soft_sign_clip

ROOT = Path(__file__).resolve().parents[3]
OLD_PACKAGE = ROOT / "tests" / "fixtures" / "packages" / "mlp-before-build-fallback.kiln"


@pytest.fixture(scope="module")
def mlp():
    case = mlp_with_fallback()
    return case, compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)


@pytest.fixture(scope="module")
def bf16_compiled(mlp, tmp_path_factory):
    """The bf16 MLP compiled with the default on_build_failure, through a cache of its own."""
    case, program = mlp
    cache = compiler.EngineCache(tmp_path_factory.mktemp("cache"))
    return case, compiler.compile(program, cache=cache, precision="bf16"), cache


class TransposeThenLinear(nn.Module):
    """Two partitions around a fallback op: a Transpose (builds in bf16) and a Linear (does not)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.fc = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(soft_sign_clip(x.transpose(0, 1)).transpose(0, 1))


def _bf16_exact(*shape: int) -> torch.Tensor:
    # Values a bf16 engine carries exactly, so an engine that only moves data changes nothing.
    return torch.randn(*shape).to(torch.bfloat16).float()


def test_default_falls_back_to_pytorch_and_reports_each_failure(bf16_compiled):
    case, compiled, cache = bf16_compiled
    report = compiled.report
    names = [p.name for p in compiled.plan.partitions]
    assert names == ["engine_0", "engine_1"]
    assert sorted(p for f in report.build_failures for p in f["partitions"]) == names
    for failure in report.build_failures:
        (name,) = failure["partitions"]
        assert failure["fell_back_to"] == "torch" and failure["backend"] == "onnxruntime"
        assert failure["error"].startswith(f"ONNX Runtime rejected partition {name}: ")
        assert "Gemm" in failure["error"] and failure["node"] == "n1 (Gemm)"
        assert compiled.engines[failure["fingerprint"]].backend == "torch"
        assert compiled.engines[failure["fingerprint"]].engine == b""
    assert report.engines_built == 0 and report.cache_hits == 0 and report.engine_bytes == 0
    assert "2 partitions fell back after build failures: engine_0 -> torch (node 'n1 (Gemm)')" in (
        report.summary()
    )
    assert [row["backend"] for row in report.to_dict()["partitions"]] == ["torch", "torch"]
    # The partitions' own fp32 submodules run: outputs are eager's at fp32 tolerances, not bf16's.
    assert not any(isinstance(getattr(compiled.graph, n), EngineCall) for n in names)
    for batch in (1, 7, 32):
        x = torch.randn(batch, 64)
        torch.testing.assert_close(compiled(x), case.model(x))
    assert cache.entries() == []  # failed builds are never cached


def test_fallback_package_round_trips_without_engine_files(bf16_compiled, tmp_path):
    case, compiled, _ = bf16_compiled
    info = compiler.save(compiled, tmp_path / "mlp.kiln")
    assert list((info.path / "engines").iterdir()) == []
    manifest = compiler.read_manifest(info.path)
    for fp, record in manifest.engines.items():
        assert record.backend == "torch" and record.file is None and record.bytes == 0
        assert record.build_failure == compiled.engines[fp].build_failure
    assert manifest.options.on_build_failure == "torch"
    loaded = compiler.load(info.path)
    x = torch.randn(5, 64)
    torch.testing.assert_close(loaded(x), case.model(x))
    assert loaded.report.build_failures == compiled.report.build_failures
    assert "fell back after build failures" in loaded.report.summary()
    # Which backend runs a fingerprint is part of the content hash: an edit is refused.
    data = json.loads((info.path / "manifest.json").read_text())
    data["engines"][next(iter(data["engines"]))]["backend"] = "onnxruntime"
    (info.path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackageCorruptError, match="edited after saving"):
        compiler.load(info.path)


def test_error_mode_raises_with_partition_and_node_and_caches_nothing(mlp, tmp_path):
    _, program = mlp
    cache = compiler.EngineCache(tmp_path / "cache")
    with pytest.raises(EngineBuildError, match=r"rejected partition engine_0: .*Gemm") as failure:
        compiler.compile(program, cache=cache, precision="bf16", on_build_failure="error")
    assert failure.value.partition == "engine_0" and failure.value.node == "n1 (Gemm)"
    assert cache.entries() == [] and not list((tmp_path / "cache").glob("*.bin"))


def test_some_partitions_build_and_the_others_fall_back(tmp_path):
    torch.manual_seed(0)
    model = TransposeThenLinear().eval()
    batch = Dim("batch", min=1, max=32)
    program = compiler.export(model, (_bf16_exact(4, 16),), dynamic_shapes=({0: batch},))
    cache = compiler.EngineCache(tmp_path / "cache")
    compiled = compiler.compile(program, cache=cache, precision="bf16")
    report = compiled.report
    assert [p["backend"] for p in report.partitions] == ["onnxruntime", "torch"]
    assert [f["partitions"] for f in report.build_failures] == [["engine_1"]]
    assert "Gemm" in report.build_failures[0]["node"]
    assert report.engines_built == 1 and report.engine_bytes > 0
    assert isinstance(compiled.graph.engine_0, EngineCall)
    assert [e.meta["partition"] for e in cache.entries()] == ["engine_0"]  # only the engine that built
    x = _bf16_exact(9, 16)
    torch.testing.assert_close(compiled(x), model(x))
    again = compiler.compile(program, cache=cache, precision="bf16")  # the good engine is a cache hit
    assert again.report.cache_hits == 1 and again.report.engines_built == 0
    assert len(again.report.build_failures) == 1  # the failed one is tried again, and fails again

    info = compiler.save(compiled, tmp_path / "mixed.kiln")
    assert [p.stem for p in (info.path / "engines").iterdir()] == [
        compiled.dedup.instance("engine_0").fingerprint
    ]
    loaded = compiler.load(info.path)
    torch.testing.assert_close(loaded(x), model(x))
    assert loaded.report.build_failures == report.build_failures


def test_refit_with_a_pytorch_fallback_partition_uses_the_new_weights(bf16_compiled):
    case, compiled, _ = bf16_compiled
    other = mlp_with_fallback(seed=1).model
    refitted = compiled.refit(other.state_dict())
    x = torch.randn(6, 64)
    torch.testing.assert_close(refitted(x), other(x))
    assert not torch.allclose(refitted(x), case.model(x))
    assert refitted.report.build_failures == compiled.report.build_failures


def test_fallback_artifacts_travel_through_the_prefect_workspace(mlp, tmp_path):
    case, program = mlp
    plan = compiler.partition(program, compiler.CompileOptions(precision="bf16"))
    unique = compiler.dedup(plan)
    refs = [
        store_artifact(compiler.build_engine(plan, unique, fp, cache=False), str(tmp_path))
        for fp in unique.fingerprints
    ]
    assert {r.backend for r in refs} == {"torch"} and all(r.build_failure["node"] for r in refs)
    files = sorted(p.name for p in Workspace(tmp_path).dir("engines").iterdir())
    assert files == sorted(f"{r.cache_key}.torch.json" for r in refs)  # records, no engine files
    artifacts = {r.fingerprint: load_artifact(r) for r in refs}
    assert all(a.backend == "torch" and a.build_failure for a in artifacts.values())
    compiled = compiler.assemble(plan, unique, artifacts)
    assert len(compiled.report.build_failures) == 2
    x = torch.randn(3, 64)
    torch.testing.assert_close(compiled(x), case.model(x))


def test_bad_values_are_refused_naming_the_field(mlp):
    _, program = mlp
    with pytest.raises(PartitionError, match=r"on_build_failure 'skip'.*'torch', 'onnxruntime', 'error'"):
        compiler.compile(program, cache=False, on_build_failure="skip")
    with pytest.raises(PartitionError, match=r"on_build_failure 'onnxruntime'.*cannot fall back to itself"):
        compiler.CompileOptions(backend="onnxruntime", on_build_failure="onnxruntime")
    with pytest.raises(ValidationError, match="on_build_failure"):
        ZooEntry(name="a", factory="zoo.models:tiny_vit", on_build_failure="skip")
    with pytest.raises(ValidationError, match="cannot fall back to itself"):
        ZooEntry(name="a", factory="zoo.models:tiny_vit", on_build_failure="onnxruntime")
    entry = ZooEntry(name="a", factory="zoo.models:tiny_vit", on_build_failure="error")
    assert entry.compile_options("cpu").on_build_failure == "error"


def test_the_option_travels_in_dicts_but_not_in_engine_cache_keys(mlp):
    _, program = mlp
    strict = compiler.CompileOptions(on_build_failure="error")
    assert strict.to_dict()["on_build_failure"] == "error"
    assert compiler.CompileOptions.from_dict(strict.to_dict()) == strict
    old = {k: v for k, v in strict.to_dict().items() if k != "on_build_failure"}
    assert compiler.CompileOptions.from_dict(old).on_build_failure == "torch"  # dicts from before it
    assert strict.build_settings() == compiler.CompileOptions().build_settings()
    fingerprints = [
        compiler.dedup(compiler.partition(program, options)).fingerprints
        for options in (strict, compiler.CompileOptions())
    ]
    assert fingerprints[0] == fingerprints[1]


def test_packages_saved_before_per_engine_backends_still_load(tmp_path):
    """The fixture was saved by kiln before this feature: no per-engine backend, no build_failures."""
    path = shutil.copytree(OLD_PACKAGE, tmp_path / "old.kiln")
    data = json.loads((path / "manifest.json").read_text())
    assert all("backend" not in e for e in data["engines"].values())
    assert "on_build_failure" not in data["plan"]["options"]
    manifest = compiler.read_manifest(path)
    assert manifest.format_version == 1 and {r.backend for r in manifest.engines.values()} == {"onnxruntime"}
    loaded = compiler.load(path)
    assert {a.backend for a in loaded.engines.values()} == {"onnxruntime"}
    assert loaded.report.build_failures == [] and loaded.plan.options.on_build_failure == "torch"
    case = mlp_with_fallback(width=8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(loaded(x), case.model(x))
