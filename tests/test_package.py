import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import compiler
from compiler.errors import PackageCorruptError, PackageVersionError

ROOT = Path(__file__).resolve().parents[1]


def _run_fresh(code: str) -> str:
    """Run code in a fresh Python process (nothing shared with this one but files)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def mlp_package(tmp_path_factory, compiled_zoo):
    case, compiled = compiled_zoo["mlp_with_fallback"]
    path = tmp_path_factory.mktemp("pkg") / "mlp.kiln"
    report = compiler.validate(case.model, compiled, runs=2, warmup=1)
    info = compiler.save(compiled, path, validation=report)
    return case, compiled, info


def test_round_trip_is_self_describing(mlp_package):
    _case, compiled, info = mlp_package
    manifest = compiler.read_manifest(info.path)
    assert manifest["format_version"] == 1 and manifest["backend"] == "onnxruntime"
    assert manifest["input_specs"] == [s.to_dict() for s in compiled.input_specs]
    assert manifest["validation"]["max_rel_l2"] < 1e-4
    assert set(manifest["files"]) >= {"program.pt2", "weights.safetensors"}
    loaded = compiler.load(info.path)
    x = torch.randn(7, 64)
    assert torch.equal(loaded(x), compiled(x))
    assert loaded.input_specs == compiled.input_specs
    assert loaded.report.to_dict()["fallback_ops"] == {"kiln_zoo.soft_sign_clip.default": 1}


def test_tampered_or_missing_files_are_refused(mlp_package, tmp_path):
    _, compiled, _ = mlp_package
    path = compiler.save(compiled, tmp_path / "p.kiln").path
    engine = next((path / "engines").iterdir())
    data = bytearray(engine.read_bytes())
    data[len(data) // 2] ^= 0xFF
    engine.write_bytes(bytes(data))
    with pytest.raises(PackageCorruptError, match=rf"file engines/{engine.name} does not match its checksum"):
        compiler.load(path)
    engine.unlink()
    with pytest.raises(PackageCorruptError, match="is missing"):
        compiler.load(path)
    (path / "manifest.json").unlink()
    with pytest.raises(PackageCorruptError, match=r"manifest\.json is missing"):
        compiler.load(path)


def test_edited_manifest_is_refused(mlp_package, tmp_path):
    _, compiled, _ = mlp_package
    path = compiler.save(compiled, tmp_path / "edited.kiln").path
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["input_specs"][0]["max_shape"] = [4096, 64]  # widen the range the engines were built for
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageCorruptError, match="edited after saving"):
        compiler.load(path)


def test_package_with_a_custom_op_loads_in_a_process_that_never_imported_it(mlp_package):
    _, _, info = mlp_package
    out = _run_fresh(f"""
        import sys, torch, compiler
        assert "zoo.models" not in sys.modules
        compiled = compiler.load({str(info.path)!r})
        assert "zoo.models" in sys.modules  # imported from the archive's list, to register the op
        print(compiled(torch.randn(3, 64)).shape)
    """)
    assert out.strip() == "torch.Size([3, 16])"


def test_newer_format_is_refused_with_the_fix(mlp_package, tmp_path):
    _, compiled, _ = mlp_package
    path = compiler.save(compiled, tmp_path / "new.kiln").path
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 7
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageVersionError, match=r"format 7.*upgrade kiln"):
        compiler.load(path)


def test_failed_save_leaves_the_previous_package_intact(mlp_package, tmp_path):
    _, compiled, _ = mlp_package
    path = compiler.save(compiled, tmp_path / "keep.kiln").path
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    with pytest.raises(TypeError):
        compiler.save(compiled, path, validation={"not json": object()})
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.kiln"]  # no temporary left behind
    compiler.load(path)


def test_content_hash_is_stable_for_equal_content(mlp_package, tmp_path):
    _, compiled, info = mlp_package
    again = compiler.save(compiled, tmp_path / "again.kiln")
    assert again.content_hash == info.content_hash


def test_seed_003_round_trip_in_fresh_processes(tmp_path):
    """export -> save -> load (fresh) -> compile -> save -> load (fresh) -> run at min/opt/max batch."""
    _run_fresh(f"""
        import compiler
        from zoo.models import tiny_bert
        case = tiny_bert()
        program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        compiler.save_program(program, {str(tmp_path / "bert.pt2")!r})
        import torch
        torch.save(case.model.state_dict(), {str(tmp_path / "eager.pt")!r})
    """)
    _run_fresh(f"""
        import compiler
        program = compiler.load_program({str(tmp_path / "bert.pt2")!r})
        compiled = compiler.compile(program)
        compiler.save(compiled, {str(tmp_path / "bert.kiln")!r})
    """)
    out = _run_fresh(f"""
        import torch, compiler
        from zoo.models import tiny_bert
        case = tiny_bert()
        case.model.load_state_dict(torch.load({str(tmp_path / "eager.pt")!r}))
        compiled = compiler.load({str(tmp_path / "bert.kiln")!r})
        spec = compiled.input_specs[0]
        for point in ("min_shape", "opt_shape", "max_shape"):
            shape = getattr(spec, point)
            ids = torch.randint(0, 500, shape)
            mask = torch.ones_like(ids)
            ref = case.model(input_ids=ids, attention_mask=mask).last_hidden_state
            got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            rel = float((ref - got).norm() / ref.norm())
            assert rel < 1e-4, (point, rel)
            print(point, shape[0], rel)
    """)
    assert [line.split()[1] for line in out.splitlines()] == ["1", "2", "8"]


def test_package_files_are_readable_by_other_users(mlp_package):
    _, _, info = mlp_package
    modes = {p.name: p.stat().st_mode & 0o777 for p in info.path.rglob("*") if p.is_file()}
    assert modes and all(mode & 0o044 == 0o044 for mode in modes.values()), modes
