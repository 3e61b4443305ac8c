"""A package holds each weight once (issue 45): its engines are stored weight-stripped wherever its load
passes them the package's own weights (ONNX Runtime, Inductor), whatever ``strip_weights`` built; the
compiled module and the engine cache keep the engines as built, and packages written before, whose
engines carry their weights, still load (and a save of them strips them)."""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import compiler
from compiler.backends.base import is_weight_name
from compiler.backends.inductor.format import ENGINE_WEIGHTS, HEADER
from compiler.engine_build.weights import engine_weights
from compiler.errors import PackageCorruptError, PackageError
from compiler.package.manifest import MANIFEST_FILE
from zoo.models import repeated_fallback


def _onnx_weights(engine: bytes) -> dict[str, bool]:
    """Canonical weight initializer -> whether the engine holds its bytes."""
    model = onnx.load_from_string(engine)
    return {
        init.name: init.data_location != onnx.TensorProto.EXTERNAL
        and bool(init.raw_data or init.float_data or init.int32_data or init.int64_data or init.double_data)
        for init in model.graph.initializer
        if is_weight_name(init.name)
    }


def _members(engine: bytes) -> tuple[set[str], dict]:
    """An Inductor engine's zip member names and its header, read as the zip it is."""
    archive = zipfile.ZipFile(io.BytesIO(engine))
    return set(archive.namelist()), json.loads(archive.read(HEADER))


def _engine_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((path / "engines").iterdir())}


def _as_written_before(path: Path, module: compiler.CompiledModule, reseal) -> None:
    """The package as kiln wrote it before engines were stripped for packages: each engine file the
    full engine as built, its record not stripped, the checksums and content hash sealed again."""

    def edit(data: dict) -> None:
        for fp, record in data["engines"].items():
            built = module.engines[fp].engine
            (path / record["file"]).write_bytes(built)
            record.update(stripped=False, bytes=len(built))

    reseal(path, edit)


@pytest.fixture(scope="module")
def ort_models(tmp_path_factory):
    """The default backend, compiled full (strip_weights=False, the default) and stripped."""
    case = repeated_fallback(depth=3, width=32)
    program = compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
    cache = compiler.EngineCache(tmp_path_factory.mktemp("ort-cache"))
    full = compiler.compile(program, cache=cache)
    stripped = compiler.compile(program, cache=cache, strip_weights=True)
    return case, full, stripped, cache


@pytest.fixture(scope="module")
def inductor_models(tmp_path_factory):
    """Inductor on the CPU (static shapes: one compile per structure), full and stripped."""
    case = repeated_fallback(depth=2, width=16)
    program = compiler.export(case.model, case.args)
    cache = compiler.EngineCache(tmp_path_factory.mktemp("inductor-cache"))
    full = compiler.compile(program, backend="inductor", cache=cache)
    stripped = compiler.compile(program, backend="inductor", cache=cache, strip_weights=True)
    return case, full, stripped, cache


def test_default_backend_packages_hold_no_weights_in_their_engines(ort_models, tmp_path):
    case, full, stripped, cache = ort_models
    info = compiler.save(full, tmp_path / "full.kiln")
    files = _engine_files(info.path)
    assert files and all(r.stripped for r in info.manifest.engines.values())
    for data in files.values():
        weights = _onnx_weights(data)
        assert weights and not any(weights.values()), weights
    # The module and the engine cache keep what strip_weights=False built: full engines.
    for artifact in full.engines.values():
        assert not artifact.stripped and all(_onnx_weights(artifact.engine).values())
        assert cache.get(artifact.cache_key) == artifact.engine
    # A stripped compile's package stores the very same engines (under fingerprints of its own settings).
    assert sorted(_engine_files(compiler.save(stripped, tmp_path / "stripped.kiln").path).values()) == sorted(
        files.values()
    )
    x = torch.randn(5, 32)
    loaded = compiler.load(info.path)
    assert torch.equal(loaded(x), full(x))
    torch.testing.assert_close(loaded(x), case.model(x), rtol=1e-5, atol=1e-5)
    # The package holds the weights once: its engines are a few bytes of markers per weight.
    weight_bytes = info.manifest.files["weights.safetensors"].bytes
    assert sum(len(d) for d in files.values()) < 0.05 * weight_bytes


def test_inductor_packages_hold_no_weights_in_their_engines(inductor_models, tmp_path):
    case, full, stripped, cache = inductor_models
    info = compiler.save(full, tmp_path / "full.kiln")
    files = _engine_files(info.path)
    assert files and all(r.stripped for r in info.manifest.engines.values())
    for data in files.values():
        members, header = _members(data)
        assert ENGINE_WEIGHTS not in members and header["stripped"] is True, members
        assert header["weights"], "the engine still names the weights it takes"
    for artifact in full.engines.values():  # the module and cache keep the full engines
        assert ENGINE_WEIGHTS in _members(artifact.engine)[0]
        assert cache.get(artifact.cache_key) == artifact.engine
    # A stripped compile's package stores the same engines (its programs are exported again, with an
    # archive id of their own: compare members and headers).
    other = _engine_files(compiler.save(stripped, tmp_path / "stripped.kiln").path).values()
    shown = sorted((sorted(m), json.dumps(h, sort_keys=True)) for m, h in map(_members, other))
    assert shown == sorted(
        (sorted(m), json.dumps(h, sort_keys=True)) for m, h in map(_members, files.values())
    )
    x = case.args[0]
    loaded = compiler.load(info.path, trust_engine_code=True)
    assert torch.equal(loaded(x), full(x))


@pytest.mark.parametrize("backend", ["onnxruntime", "inductor"])
def test_packages_written_before_with_full_engines_still_load(
    backend, ort_models, inductor_models, tmp_path, reseal
):
    case, full, _, _ = ort_models if backend == "onnxruntime" else inductor_models
    path = compiler.save(full, tmp_path / "old.kiln").path
    _as_written_before(path, full, reseal)
    manifest = compiler.read_manifest(path)
    assert not any(r.stripped for r in manifest.engines.values())
    x = case.args[0]
    loaded = compiler.load(path, trust_engine_code=True)
    assert torch.equal(loaded(x), full(x))
    # Saved again (a refit_package, a re-release), the engines lose their copy of the weights.
    again = compiler.save(loaded, tmp_path / "again.kiln")
    assert all(r.stripped for r in again.manifest.engines.values())
    assert sum(r.bytes for r in again.manifest.engines.values()) < sum(
        r.bytes for r in manifest.engines.values()
    )
    assert torch.equal(compiler.load(again.path, trust_engine_code=True)(x), full(x))
    assert json.loads((again.path / MANIFEST_FILE).read_text())["strip_weights"] is False


def test_refit_package_of_a_full_compile_rewrites_only_the_weights(ort_models, tmp_path):
    """Engines stored stripped take new weights from the weights file alone: nothing to refit in them."""
    _, full, _, _ = ort_models
    path = compiler.save(full, tmp_path / "m.kiln").path
    before = _engine_files(path)
    tuned = repeated_fallback(depth=3, width=32, seed=7).model
    compiler.refit_package(path, tuned.state_dict())
    assert _engine_files(path) == before
    x = torch.randn(3, 32)
    torch.testing.assert_close(compiler.load(path)(x), tuned(x), rtol=1e-5, atol=1e-5)


def test_a_backend_without_package_strip_keeps_its_engines_as_built(ort_models):
    from compiler.backends.capabilities import capabilities
    from compiler.package.writing import packaged_engine

    _, full, _, _ = ort_models
    artifact = next(a for a in full.engines.values() if a.is_engine)
    assert capabilities("tensorrt").package_strip is None
    kept = dataclasses.replace(artifact, backend="tensorrt")
    assert packaged_engine(kept) is kept  # TensorRT: its plan is stripped only by TensorRT on its GPU
    assert packaged_engine(artifact).stripped and len(packaged_engine(artifact).engine) < artifact.bytes


def test_quantized_packages_hold_their_int8_tensors_once(tmp_path):
    """int8 engines (ONNX Runtime) read their quantized weights and scales from the package's own
    ``kiln.int8/...`` tensors: stored stripped of them, the package (int8 float weights left out too)
    answers exactly as the full compile did."""
    from benchmarks.quantization import sensitive_case

    _, program, data = sensitive_case(width=32, blocks=2, hot=0, batch=4, samples=8)
    recorded = tmp_path / "recorded.npz"
    np.savez(recorded, x=data["x"].numpy())
    options = compiler.CompileOptions(
        precision="int8", split_modules=("OutlierBlock",), calibration={"samples": 8, "data": str(recorded)}
    )
    compiled = compiler.compile(program, options, cache=False)
    assert not any(a.stripped for a in compiled.engines.values())
    info = compiler.save(compiled, tmp_path / "int8.kiln", int8_weights_only=True)
    for data_bytes in _engine_files(info.path).values():
        weights = _onnx_weights(data_bytes)
        assert weights and not any(weights.values()), weights
    x = data["x"][0]
    assert torch.equal(compiler.load(info.path)(x), compiled(x))


class _NormInFallback(torch.nn.Module):
    """Two linears fp16 engines run, around a layer norm kept in PyTorch (its weights a fallback op reads)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x)))


@pytest.fixture(scope="module")
def fp16_compiled() -> tuple[compiler.CompiledModule, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    program = compiler.export(
        _NormInFallback().eval(), (x,), dynamic_shapes=({0: torch.export.Dim("b", max=16)},)
    )
    options = compiler.CompileOptions(precision="fp16", torch_executed_ops=("aten.layer_norm.default",))
    return compiler.compile(program, options, cache=False), x


def _stored(package: Path) -> dict[str, torch.dtype]:
    from safetensors import safe_open

    with safe_open(package / "weights.safetensors", "pt") as file:
        return {key: file.get_tensor(key).dtype for key in file.keys()}  # noqa: SIM118 - not a dict


def test_weights_only_fp16_engines_read_are_stored_at_fp16_and_load_back_to_the_same_answers(
    fp16_compiled, tmp_path
):
    compiled, x = fp16_compiled
    assert {n.target for n in compiled.plan.graph_module.graph.nodes if n.op == "call_module"} >= {
        "engine_0",
        "engine_1",
    }
    full = compiler.save(compiled, tmp_path / "fp32.kiln")
    small = compiler.save(compiled, tmp_path / "fp16.kiln", engine_precision_weights=True)
    stored = _stored(small.path)
    # The linears' weights only engines read: fp16. The norm's, read by the fallback op: fp32, as before.
    assert stored == {
        "fc1.weight": torch.float16, "fc1.bias": torch.float16, "fc2.weight": torch.float16,
        "fc2.bias": torch.float16, "norm.weight": torch.float32, "norm.bias": torch.float32,
    }  # fmt: skip
    assert small.manifest.plan["reduced_weights"] == {
        k: "float16" for k, d in stored.items() if d == torch.float16
    }
    assert "reduced_weights" not in full.manifest.plan and set(_stored(full.path).values()) == {torch.float32}
    weights = [
        small.manifest.files["weights.safetensors"].bytes,
        full.manifest.files["weights.safetensors"].bytes,
    ]
    assert weights[0] < 0.6 * weights[1], weights
    loaded = compiler.load(small.path)
    assert torch.equal(loaded(x), compiled(x)) and torch.equal(loaded(x), compiler.load(full.path)(x))
    # Held at fp16, the values the engines took, and given to them as they are: no fp32 copy beside.
    assert loaded.plan.reduced_weights == {k: torch.float16 for k, d in stored.items() if d == torch.float16}
    assert torch.equal(loaded.weights["fc1.weight"], compiled.weights["fc1.weight"].half())
    held = {t.untyped_storage().data_ptr() for t in loaded.weights.values()}
    for instance in loaded.dedup.instances:
        taken = engine_weights(loaded.plan, instance)
        assert all(t.untyped_storage().data_ptr() in held for t in taken.values()), instance.partition


def test_a_package_read_back_keeps_its_fp16_weights_through_a_refit_and_cannot_be_raised(
    fp16_compiled, tmp_path
):
    from compiler.accuracy.repair import rebuild

    compiled, x = fp16_compiled
    loaded = compiler.load(compiler.save(compiled, tmp_path / "a.kiln", engine_precision_weights=True).path)
    state = {k: v * 0.5 for k, v in compiled.weights.items()}
    refitted = compiler.save(loaded.refit(state), tmp_path / "b.kiln")  # no option: the package's own form
    assert _stored(refitted.path)["fc2.weight"] == torch.float16
    assert torch.equal(compiler.load(refitted.path)(x), compiled.refit(state)(x))
    table = compiler.compare_partitions(loaded, [(x,)], runs=0)  # the fp32 reference on the stored values
    assert {row.partition for row in table.rows} >= {"engine_0", "engine_1"}
    with pytest.raises(PackageError, match=r"engine_0.*stored at fp16/bf16.*recompile from the model"):
        rebuild(loaded, {"engine_0": "fp32"})
    # Run in PyTorch instead (a debugging view of the engine): its graph gets the stored values at fp32.
    torch_run, _ = rebuild(loaded, {"engine_0": "torch"})
    assert torch.allclose(torch_run(x), compiled(x), rtol=1e-2, atol=1e-2)
    assert (
        torch_run.weights["fc1.weight"].dtype == torch.float32
        and "fc1.weight" not in torch_run.plan.reduced_weights
    )
    resaved = compiler.save(torch_run, tmp_path / "c.kiln")
    assert (
        _stored(resaved.path)["fc1.weight"] == torch.float32
        and _stored(resaved.path)["fc2.weight"] == torch.float16
    )
    assert torch.equal(compiler.load(resaved.path)(x), torch_run(x))


def _fp16_norm(package: Path) -> None:
    """The weights file with the fallback op's norm weight at fp16 (an attacker's rewrite)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(package / "weights.safetensors")
    tensors["norm.weight"] = tensors["norm.weight"].half()
    save_file(tensors, package / "weights.safetensors")


@pytest.mark.parametrize(
    ("edit", "rewrite", "error"),
    [
        (
            {"norm.weight": "float16"},
            None,
            r"'norm.weight' at 'float16', but weights.safetensors holds it as float32",
        ),
        ({"gone": "float16"}, None, r"'gone' at 'float16', but weights.safetensors lacks it"),
        ({"fc1.weight": "float64"}, None, r"reduced_weights"),
        (
            {"norm.weight": "float16"},
            _fp16_norm,
            r"\['norm.weight'\] are stored at fp16/bf16, but not only engines",
        ),
    ],
)
def test_a_reduced_weights_record_that_does_not_fit_the_package_is_refused(
    fp16_compiled, tmp_path, reseal, edit, rewrite, error
):
    compiled, _ = fp16_compiled
    package = compiler.save(compiled, tmp_path / "p.kiln", engine_precision_weights=True).path
    if rewrite is not None:
        rewrite(package)
    # An attacker who can write the package, and recomputes its hashes.
    reseal(package, lambda data: data["plan"]["reduced_weights"].update(edit))
    with pytest.raises(PackageCorruptError, match=error):
        compiler.load(package)
