"""The Inductor backend on the CPU: build, dedup, strip, refit, engine cache, package round trip in a fresh
process, engine compatibility and build failures. Every Inductor compile here is real (g++ on the CPU),
so the models are tiny and static-shaped, and one compiled model serves most tests; the GPU path is
tests/gpu/test_inductor_gpu.py.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import compiler
from compiler.backends import get_backend
from compiler.backends.inductor import HEADER, WEIGHTS, InductorBackend, read_engine
from compiler.errors import (
    BackendUnavailableError,
    BuildSettingsError,
    EngineBuildError,
    EngineCompatibilityError,
    RefitError,
)
from zoo.models import repeated_fallback, soft_sign_clip

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def blocks():
    """Three blocks around a custom op (which stays in PyTorch): four partitions (each block's tail joins
    the next block's head), three unique structures (the two middle ones are equal)."""
    case = repeated_fallback(depth=3, width=16)
    program = compiler.export(case.model, case.args)  # static shapes: one Inductor compile per structure
    return case, program


@pytest.fixture(scope="module")
def compiled(blocks, tmp_path_factory):
    _, program = blocks
    cache = compiler.EngineCache(tmp_path_factory.mktemp("inductor-cache"))
    return compiler.compile(program, backend="inductor", cache=cache), cache


def _failing_compiler(tmp_path: Path) -> str:
    """A C++ compiler that answers Inductor's version probe and then refuses every compile: a real
    toolchain failure, with no mock in kiln."""
    script = tmp_path / "failing-g++"
    script.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = "--version" ] && exec g++ --version; done\nexit 1\n'
    )
    script.chmod(0o755)
    return str(script)


def test_inductor_engines_match_eager_with_one_build_per_structure(blocks, compiled):
    case, _ = blocks
    module, _ = compiled
    x = case.args[0]
    torch.testing.assert_close(module(x), case.model(x), rtol=1e-5, atol=1e-5)
    report = module.report
    assert report.backend == "inductor" and report.engine_target == "cpu"
    assert len(report.partitions) == 4 and report.unique_fingerprints == 3
    assert report.engines_built == 3 and report.refits == 1
    assert report.fallback_ops == {"kiln_zoo.soft_sign_clip.default": 3}
    header, files = read_engine(next(iter(module.engines.values())).engine)
    assert header["torch"] == torch.__version__ and header["device"] == "cpu" and header["compiler"]
    assert set(files) == {HEADER, "program.pt2", WEIGHTS, "inductor_cache.bin"}
    assert files["inductor_cache.bin"], "the build's Inductor cache artifacts travel with the engine"


def test_engine_calls_skip_the_exported_modules_eager_input_checks(compiled):
    """The unlifted module's shape re-check runs eagerly on every call (measured: 160 -> 53 us per engine
    call on this CPU); the compiled module checks the model's inputs once, so engines drop it."""
    module, _ = compiled
    for call in (m for m in module.graph.children() if hasattr(m, "engine")):
        assert not call.engine.compiled._orig_mod._forward_pre_hooks


def test_op_table_keeps_custom_ops_and_forced_ops_in_pytorch(blocks):
    backend = get_backend("inductor")
    assert backend.supports(torch.ops.aten.addmm.default)
    assert not backend.supports(soft_sign_clip._opoverload)
    _, program = blocks
    plan = compiler.partition(
        program, compiler.CompileOptions(backend="inductor", torch_executed_ops=("aten.relu",))
    )
    assert all("aten.relu" not in str(p.ops) for p in plan.partitions)


def test_cache_hit_and_stripped_engines(blocks, compiled, tmp_path):
    case, program = blocks
    module, cache = compiled
    again = compiler.compile(program, backend="inductor", cache=cache)
    assert again.report.cache_hits == 3 and again.report.engines_built == 0
    stripped = compiler.compile(program, backend="inductor", cache=cache, strip_weights=True)
    for artifact in stripped.engines.values():
        assert WEIGHTS not in read_engine(artifact.engine)[1]
    assert stripped.report.engine_bytes < module.report.engine_bytes
    x = case.args[0]
    torch.testing.assert_close(stripped(x), case.model(x), rtol=1e-5, atol=1e-5)
    artifact = next(iter(stripped.engines.values()))
    with pytest.raises(RefitError, match="weight-stripped"):
        get_backend("inductor").load(artifact.engine, artifact.io, None)


def test_refit_puts_new_weights_in_without_a_build(blocks, compiled):
    case, _ = blocks
    module, _ = compiled
    tuned = {k: v + 0.01 * torch.randn_like(v) for k, v in case.model.state_dict().items()}
    refitted = module.refit(tuned)
    reference = repeated_fallback(depth=3, width=16).model
    reference.load_state_dict(tuned)
    x = case.args[0]
    torch.testing.assert_close(refitted(x), reference(x), rtol=1e-5, atol=1e-5)
    artifact = next(iter(module.engines.values()))
    bad = {name: torch.zeros(1) for name in read_engine(artifact.engine)[0]["weights"]}
    with pytest.raises(RefitError, match="expected shape"):
        get_backend("inductor").load(artifact.engine, artifact.io, bad)


def test_package_round_trip_in_a_fresh_process(blocks, compiled, tmp_path):
    case, _ = blocks
    module, _ = compiled
    compiler.save(module, tmp_path / "blocks.kiln")
    torch.save(case.args[0], tmp_path / "x.pt")
    expected = module(case.args[0])
    code = textwrap.dedent(
        f"""
        import torch, compiler
        import zoo.models  # registers the custom op the package's program calls
        m = compiler.load({str(tmp_path / "blocks.kiln")!r})
        torch.save(m(torch.load({str(tmp_path / "x.pt")!r})), {str(tmp_path / "y.pt")!r})
        print(m.report.backend, m.device)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["inductor", "cpu"]
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), expected, rtol=0, atol=0)


def _with_header(engine: bytes, **changes: object) -> bytes:
    """The engine with header fields changed: what an engine from another machine or torch looks like."""
    _, files = read_engine(engine)
    header = {**json.loads(files[HEADER]), **changes}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(HEADER, json.dumps(header))
        for name, data in files.items():
            if name != HEADER:
                archive.writestr(name, data)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"torch": "2.0.0"}, "built with torch 2.0.0"),
        ({"device": "cuda:sm_90"}, "built for cuda:sm_90"),
        ({"format": 99}, "newer than this kiln reads"),
    ],
)
def test_engines_for_another_torch_or_device_are_refused(compiled, changes, message):
    module, _ = compiled
    artifact = next(iter(module.engines.values()))
    with pytest.raises(EngineCompatibilityError, match=message):
        get_backend("inductor").load(_with_header(artifact.engine, **changes), artifact.io, None)


def test_a_failed_inductor_build_falls_back_and_caches_nothing(blocks, tmp_path):
    case, program = blocks
    cache = compiler.EngineCache(tmp_path / "cache")
    broken = {"compile_options": {"cpp.cxx": (_failing_compiler(tmp_path),)}}
    module = compiler.compile(program, backend="inductor", cache=cache, backend_options=broken)
    failures = module.report.build_failures
    failed = {f["fingerprint"] for f in failures}
    # Partitions that need a C++ kernel fail; one whose only op is a matmul (an extern call) needs none.
    assert failed and {f["fell_back_to"] for f in failures} == {"torch"}
    assert all("Inductor could not compile partition" in f["error"] for f in failures)
    assert {fp: a.backend for fp, a in module.engines.items()} == {
        fp: "torch" if fp in failed else "inductor" for fp in module.engines
    }
    assert len(list((tmp_path / "cache").glob("*.bin"))) == len(module.engines) - len(failed), (
        "a failed build is never cached"
    )
    torch.testing.assert_close(module(case.args[0]), case.model(case.args[0]), rtol=1e-5, atol=1e-5)
    ort = compiler.compile(
        program, backend="inductor", cache=cache, backend_options=broken, on_build_failure="onnxruntime"
    )
    assert {ort.engines[fp].backend for fp in failed} == {"onnxruntime"}
    torch.testing.assert_close(ort(case.args[0]), case.model(case.args[0]), rtol=1e-4, atol=1e-4)
    with pytest.raises(EngineBuildError, match="Inductor could not compile"):
        compiler.compile(
            program, backend="inductor", cache=cache, backend_options=broken, on_build_failure="error"
        )


def test_missing_host_compiler_and_bad_settings_are_typed_errors(blocks):
    _, program = blocks
    with pytest.raises(BackendUnavailableError, match=r"needs a C\+\+ compiler.*kiln-no-such-cxx"):
        compiler.compile(
            program,
            backend="inductor",
            cache=False,
            backend_options={"compile_options": {"cpp.cxx": ("kiln-no-such-cxx",)}},
        )
    with pytest.raises(BuildSettingsError, match=r"unknown backend_options .* for Inductor"):
        compiler.compile(program, backend="inductor", cache=False, backend_options={"refit": "all"})
    with pytest.raises(BuildSettingsError, match="mode"):
        compiler.compile(program, backend="inductor", cache=False, backend_options={"mode": "fastest"})


def test_inductor_backend_on_cuda_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tests/gpu covers CUDA")
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        get_backend("inductor", device="cuda")
    assert InductorBackend("cpu").target_device() == "cpu"
