import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import compiler
from compiler.errors import (
    OpModuleNotAllowedError,
    PackageCorruptError,
    PackageVersionError,
    UnsafeProgramError,
)
from compiler.package.manifest import Manifest, SourceRecord
from compiler.validation.report import ValidationReport
from zoo.models import mlp_with_fallback

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "packages"
FORMAT1 = FIXTURES / "mlp-format1-2026-11.kiln"  # saved by the format-1 code, 2026-11
BEFORE_FALLBACK = FIXTURES / "mlp-before-build-fallback.kiln"


def _run_fresh(code: str, env: dict | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    """Run code in a fresh Python process (nothing shared with this one but files)."""
    full = {k: v for k, v in os.environ.items() if k != "KILN_ALLOWED_OP_MODULES"}
    full.update({"PYTHONPATH": str(ROOT), **(env or {})})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full, timeout=600
    )
    if ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def mlp_package(tmp_path_factory, compiled_zoo):
    case, compiled = compiled_zoo["mlp_with_fallback"]
    path = tmp_path_factory.mktemp("pkg") / "mlp.kiln"
    report = compiler.validate(case.model, compiled, runs=2, warmup=1)
    source = SourceRecord("factory:zoo.models:mlp_with_fallback", "factory", "", "d" * 64)
    info = compiler.save(compiled, path, validation=report, source=source)
    return case, compiled, info


def _edit(path: Path, edit) -> None:
    data = json.loads((path / "manifest.json").read_text())
    edit(data)
    (path / "manifest.json").write_text(json.dumps(data))


# ---------------------------------------------------------------- the typed manifest


def test_round_trip_is_self_describing(mlp_package):
    _case, compiled, info = mlp_package
    manifest = compiler.read_manifest(info.path)
    assert isinstance(manifest, Manifest) and manifest == info.manifest
    assert manifest.format_version == 3 and manifest.backend == "onnxruntime"
    assert manifest.engine_target == "cpu" and manifest.precision == "fp32"
    assert manifest.input_specs == compiled.input_specs
    # what a server is told the outputs are: recorded at compile, from the program (nothing run)
    (output,) = manifest.output_specs
    assert (output.name, output.dtype, output.dynamic_dims) == ("output_0", "float32", {0: "batch"})
    assert output.min_shape[0] == manifest.input_specs[0].min_shape[0]
    assert output.max_shape[0] == manifest.input_specs[0].max_shape[0]
    assert isinstance(manifest.validation, ValidationReport) and manifest.validation.max_rel_l2 < 1e-4
    assert set(manifest.files) >= {"program.pt2", "weights.safetensors"}
    assert manifest.op_modules == ("zoo.models",)  # registers kiln_zoo::soft_sign_clip
    assert manifest.source.uri == "factory:zoo.models:mlp_with_fallback"
    assert manifest.report.fallback_ops == {"kiln_zoo.soft_sign_clip.default": 1}
    assert manifest.options == compiled.plan.options
    for fp, record in manifest.engines.items():
        assert record.file == f"engines/{fp}.engine" and record.io == compiled.engines[fp].io
    loaded = compiler.load(info.path)
    x = torch.randn(7, 64)
    assert torch.equal(loaded(x), compiled(x))
    assert loaded.input_specs == compiled.input_specs
    assert loaded.report.to_dict()["fallback_ops"] == {"kiln_zoo.soft_sign_clip.default": 1}
    assert isinstance(loaded.validation, ValidationReport)


def test_manifest_json_codec_round_trips_exactly(mlp_package):
    _, _, info = mlp_package
    on_disk = json.loads((info.path / "manifest.json").read_text())
    manifest = Manifest.from_json(on_disk)
    assert json.loads(json.dumps(manifest.to_json())) == on_disk
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert "created" not in on_disk and "target_device" not in on_disk


def test_malformed_manifest_names_the_field(mlp_package, tmp_path, copy_package, reseal):
    path = copy_package(mlp_package[2].path, tmp_path / "m.kiln")
    reseal(path, lambda d: d.pop("engines"))
    with pytest.raises(PackageCorruptError, match=r"malformed.*engines"):
        compiler.read_manifest(path)


@pytest.mark.parametrize("fixture", [FORMAT1, BEFORE_FALLBACK], ids=["format1-2026-11", "before-fallback"])
def test_format1_packages_still_load(fixture, tmp_path, copy_package):
    path = copy_package(fixture, tmp_path / "old.kiln")
    manifest = compiler.read_manifest(path)
    assert manifest.format_version == 1 and manifest.engine_target == "cpu"
    assert manifest.op_modules == ("zoo.models",)  # read from the program archive, as data
    assert all(r.backend == "onnxruntime" for r in manifest.engines.values())
    loaded = compiler.load(path, allowed_modules=["zoo.models"])
    width = manifest.input_specs[0].max_shape[1]
    case = mlp_with_fallback(width=width)
    x = torch.randn(3, width)
    if fixture == FORMAT1:
        assert isinstance(manifest.validation, ValidationReport) and manifest.validation.max_rel_l2 < 1e-4
        torch.testing.assert_close(loaded(x), case.model(x))
    assert loaded(x).shape == (3, 16)
    # Loading and saving again gives a format-3 package of the same model, its outputs recorded.
    again = compiler.save(loaded, tmp_path / "new.kiln", validation=manifest.validation)
    assert again.manifest.format_version == 3 and again.manifest.op_modules == ("zoo.models",)
    assert [o.name for o in again.manifest.output_specs] == ["output_0"]
    assert torch.equal(compiler.load(again.path)(x), loaded(x))


# ---------------------------------------------------------------- checksums and the content hash


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


def _other_engine(data: dict) -> None:
    first, second = sorted(data["engines"])
    data["engines"][first]["file"] = data["engines"][second]["file"]


def _io(data: dict) -> None:
    fp = sorted(data["engines"])[0]
    data["engines"][fp]["io"]["inputs"][0]["max_shape"][0] = 4096


def _stripped(data: dict) -> None:
    fp = sorted(data["engines"])[0]
    data["engines"][fp]["stripped"] = not data["engines"][fp]["stripped"]


def _validation(data: dict) -> None:
    data["validation"]["outputs"][0]["rel_l2"] = 0.0


EDITS = {
    "engine file -> another engine": _other_engine,
    "engine io": _io,
    "engine stripped": _stripped,
    "input_weights": lambda d: d["input_weights"].append("fc.weight"),
    "program checksum": lambda d: d["files"]["program.pt2"].update(sha256="0" * 64),
    "validation": _validation,
    "report": lambda d: d["report"].update(engines_built=99),
    "op_modules": lambda d: d["op_modules"].append("json"),
    "source": lambda d: d["source"].update(uri="hf:someone/else"),
}


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_every_manifest_field_is_covered_by_the_content_hash(mlp_package, tmp_path, edit, copy_package):
    """Defect 14.2: engine files, io, stripped and input_weights were outside the hash."""
    path = copy_package(mlp_package[2].path, tmp_path / "p.kiln")
    _edit(path, EDITS[edit])
    with pytest.raises(PackageCorruptError, match="edited after saving"):
        compiler.load(path)


def test_content_hash_is_stable_for_equal_content(mlp_package, tmp_path):
    _, compiled, info = mlp_package
    manifest = info.manifest
    again = compiler.save(
        compiled, tmp_path / "again.kiln", validation=manifest.validation, source=manifest.source
    )
    assert again.content_hash == info.content_hash
    assert (again.path / "program.pt2").read_bytes() == (info.path / "program.pt2").read_bytes()
    # Loaded and saved again (what the zoo flow's package step does): still the same content.
    resaved = compiler.save(
        compiler.load(info.path), tmp_path / "re.kiln", validation=manifest.validation, source=manifest.source
    )
    assert resaved.content_hash == info.content_hash
    assert compiler.save(compiled, tmp_path / "novalidation.kiln").content_hash != info.content_hash


# ---------------------------------------------------------------- paths


@pytest.mark.parametrize(
    "bad",
    ["other-engine", "../outside.engine", "/tmp/abs.engine", "engines/../../x.engine", "engines//x.engine"],
)
def test_engine_paths_outside_the_package_are_refused_even_when_resealed(
    mlp_package, tmp_path, bad, copy_package, reseal
):
    path = copy_package(mlp_package[2].path, tmp_path / "p.kiln")

    def edit(data: dict) -> None:
        first, second = sorted(data["engines"])
        old = data["engines"][first]["file"]
        new = data["engines"][second]["file"] if bad == "other-engine" else bad
        data["engines"][first]["file"] = new
        if bad != "other-engine":
            data["files"][new] = data["files"].pop(old)

    reseal(path, edit)
    with pytest.raises(PackageCorruptError, match=r"outside the package|its file must be"):
        compiler.load(path)


def test_a_format1_engine_pointing_at_another_engine_is_refused(tmp_path, copy_package):
    """Format 1's hash never covered engines[fp].file: the structural check must catch it."""
    path = copy_package(FORMAT1, tmp_path / "old.kiln")
    _edit(path, _other_engine)
    compiler.read_manifest(path, verify=False)  # still readable for inspection
    with pytest.raises(PackageCorruptError, match="its file must be"):
        compiler.load(path, allowed_modules=["zoo"])


def test_symlinks_are_refused(mlp_package, tmp_path, copy_package):
    """A symlink to a byte-identical copy passes every checksum; it is still refused."""
    path = copy_package(mlp_package[2].path, tmp_path / "p.kiln")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(path / "weights.safetensors", outside)
    (path / "weights.safetensors").unlink()
    (path / "weights.safetensors").symlink_to(outside)
    with pytest.raises(PackageCorruptError, match="symlink"):
        compiler.load(path)
    with pytest.raises(PackageCorruptError, match="symlink"):
        compiler.read_manifest(path)


# ---------------------------------------------------------------- nothing is unpickled


class _Payload:
    """Unpickling this creates ``marker``: proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _rewrite_archive(data: bytes, edits: dict[str, bytes]) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for name in src.namelist():
            rel = name.split("/", 1)[1]
            dst.writestr(name, edits.get(rel, src.read(name)))
    return out.getvalue()


def _evil_program(program: bytes, where: str, marker: Path) -> bytes:
    payload = io.BytesIO()
    torch.save(_Payload(str(marker)), payload)
    if where == "sample_inputs":  # torch falls back to a full unpickle when weights-only fails
        return _rewrite_archive(program, {"data/sample_inputs/model.pt": payload.getvalue()})
    root = zipfile.ZipFile(io.BytesIO(program)).namelist()[0].split("/")[0]
    config = json.loads(
        zipfile.ZipFile(io.BytesIO(program)).read(f"{root}/data/weights/model_weights_config.json")
    )
    fqn = next(iter(config["config"]))
    config["config"][fqn]["use_pickle"] = True  # torch.load(weights_only=False) for this weight
    return _rewrite_archive(
        program,
        {
            "data/weights/model_weights_config.json": json.dumps(config).encode(),
            f"data/weights/{config['config'][fqn]['path_name']}": payload.getvalue(),
        },
    )


@pytest.mark.parametrize("where", ["sample_inputs", "use_pickle"])
@pytest.mark.parametrize("fixture", ["format2", "format1"])
def test_a_program_with_a_pickled_payload_is_refused_and_never_runs(
    mlp_package, tmp_path, where, fixture, copy_package, reseal
):
    """Defect 14.1: program.pt2 swapped (checksums resealed) for one that unpickles a payload."""
    source = mlp_package[2].path if fixture == "format2" else FORMAT1
    path = copy_package(source, tmp_path / "p.kiln")
    marker = tmp_path / "marker"
    (path / "program.pt2").write_bytes(_evil_program((path / "program.pt2").read_bytes(), where, marker))
    reseal(path)
    with pytest.raises(UnsafeProgramError, match=r"pickled|not plain tensors") as refused:
        compiler.load(path, allowed_modules=["zoo"])
    assert isinstance(refused.value, PackageCorruptError)
    assert not marker.exists()
    with pytest.raises(UnsafeProgramError):
        compiler.load_program(path / "program.pt2", allowed_modules=["zoo"])
    assert not marker.exists()


def test_saved_programs_carry_no_pickled_sample_inputs(mlp_package, tmp_path):
    _, compiled, info = mlp_package
    for archive in (
        info.path / "program.pt2",
        compiler.save_program(compiled.plan.program, tmp_path / "p.pt2"),
    ):
        with zipfile.ZipFile(archive) as z:
            samples = [n for n in z.namelist() if "sample_inputs" in n]
            assert [z.read(n) for n in samples] == [b""] * len(samples)


# ---------------------------------------------------------------- which modules a load imports


def test_custom_op_package_loads_in_a_fresh_process_only_where_allowed(mlp_package):
    _, _, info = mlp_package
    refused = _run_fresh(
        f"""
        import sys, compiler
        from compiler.errors import OpModuleNotAllowedError
        try:
            compiler.load({str(info.path)!r})
        except OpModuleNotAllowedError as exc:
            assert exc.needed == ["zoo.models"] and exc.recorded == ["zoo.models"], exc
            print(exc)
        assert "zoo.models" not in sys.modules
        """
    )
    assert "KILN_ALLOWED_OP_MODULES=zoo.models" in refused.stdout
    for how, env in (
        ("env", {"KILN_ALLOWED_OP_MODULES": "numpy, zoo"}),
        ("arg", {}),
    ):
        allowed = "None" if how == "env" else "['zoo.models']"
        out = _run_fresh(
            f"""
            import sys, torch, compiler
            assert "zoo.models" not in sys.modules
            compiled = compiler.load({str(info.path)!r}, allowed_modules={allowed})
            assert "zoo.models" in sys.modules  # imported because allowed, to register the op
            print(compiled(torch.randn(3, 64)).shape)
            """,
            env,
        )
        assert out.stdout.strip() == "torch.Size([3, 16])", how


def test_a_module_named_by_a_package_is_never_imported_unless_allowed(tmp_path, copy_package, reseal):
    """Defect 14.4 (package part): the archive's module list was imported, whatever it named."""
    modules = tmp_path / "site"
    modules.mkdir()
    marker = tmp_path / "imported"
    (modules / "kiln_evil_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    path = copy_package(FORMAT1, tmp_path / "old.kiln")
    program = (path / "program.pt2").read_bytes()
    listed = json.dumps(["kiln_evil_mod", "zoo.models"]).encode()
    (path / "program.pt2").write_bytes(_rewrite_archive(program, {"extra/kiln_import_modules.json": listed}))
    reseal(path)  # format 1 hashes no program bytes: only the file checksum needs updating
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{modules}", "KILN_ALLOWED_OP_MODULES": "zoo"}
    out = _run_fresh(
        f"""
        import compiler
        from compiler.errors import OpModuleNotAllowedError
        try:
            compiler.load({str(path)!r})
        except OpModuleNotAllowedError as exc:
            print("REFUSED", exc.needed)
        """,
        env,
    )
    assert "REFUSED ['kiln_evil_mod']" in out.stdout and not marker.exists()


def test_in_process_modules_already_imported_need_no_allowance(mlp_package, monkeypatch):
    monkeypatch.delenv("KILN_ALLOWED_OP_MODULES", raising=False)
    assert "zoo.models" in sys.modules  # this test module imported it
    compiler.load(mlp_package[2].path)
    path = mlp_package[2].path
    with pytest.raises(OpModuleNotAllowedError):
        from compiler.program.export import import_allowed_modules

        import_allowed_modules(["kiln_no_such_module"], str(path))


# ---------------------------------------------------------------- the rest of the contract


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
        compiler.save(compiled, path, validation=object())
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.kiln"]  # no temporary left behind
    compiler.load(path)


def test_seed_003_round_trip_in_fresh_processes(tmp_path):
    """export -> save -> load (fresh) -> compile -> save -> load (fresh) -> run at min/opt/max batch."""
    allow = {"KILN_ALLOWED_OP_MODULES": "transformers.modeling_outputs"}
    _run_fresh(f"""
        import compiler
        from zoo.models import tiny_bert
        case = tiny_bert()
        program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        compiler.save_program(program, {str(tmp_path / "bert.pt2")!r})
        import torch
        torch.save(case.model.state_dict(), {str(tmp_path / "eager.pt")!r})
    """)
    _run_fresh(
        f"""
        import compiler
        program = compiler.load_program({str(tmp_path / "bert.pt2")!r})
        compiled = compiler.compile(program)
        compiler.save(compiled, {str(tmp_path / "bert.kiln")!r})
    """,
        allow,
    )
    out = _run_fresh(
        f"""
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
    """
    ).stdout
    assert [line.split()[1] for line in out.splitlines()] == ["1", "2", "8"]


def test_package_files_are_readable_by_other_users(mlp_package):
    _, _, info = mlp_package
    modes = {p.name: p.stat().st_mode & 0o777 for p in info.path.rglob("*") if p.is_file()}
    assert modes and all(mode & 0o044 == 0o044 for mode in modes.values()), modes


# ---------------------------------------------------------------- the runtime graph (cold start)


def _drop_runtime_graph(path: Path, reseal) -> None:
    (path / "runtime_graph.json").unlink()
    reseal(path, lambda data: data["files"].pop("runtime_graph.json"))


def test_a_load_runs_from_the_runtime_graph_and_reads_the_program_only_when_asked(mlp_package, tmp_path):
    _, compiled, info = mlp_package
    assert "runtime_graph.json" in info.manifest.files
    x = torch.randn(5, 64)
    torch.save({"x": x, "y": compiled(x)}, tmp_path / "io.pt")
    out = _run_fresh(
        f"""
        import sys, torch, compiler
        io = torch.load({str(tmp_path / "io.pt")!r})
        loaded = compiler.load({str(info.path)!r}, allowed_modules=["zoo.models"])
        # torch.export's deserializer (and torch._dynamo, which it imports) never ran
        assert "torch._export.serde.serialize" not in sys.modules and "torch._dynamo" not in sys.modules
        assert "sympy" not in sys.modules  # nothing of a load parses shapes (~0.3 s of imports)
        assert loaded.plan._program is None
        # The Python code of a partition an engine runs is never generated (torch's lazy graph module)
        gm = loaded.plan.graph_module
        run_by_engines = [
            p.name for p in loaded.plan.partitions
            if loaded.engines[loaded.dedup.instance(p.name).fingerprint].is_engine
        ]
        assert run_by_engines and all(type(getattr(gm, n))._needs_recompile() for n in run_by_engines)
        assert torch.equal(loaded(io["x"]), io["y"])
        assert all(type(getattr(gm, n))._needs_recompile() for n in run_by_engines)  # the engines ran
        loaded.refit(loaded.weights)  # a refit into a new module needs no program either
        assert loaded.plan._program is None
        again = compiler.save(loaded, {str(tmp_path / "again.kiln")!r})  # a re-save reads it
        assert loaded.plan._program is not None
        import json
        print(json.dumps({{rel: f.sha256 for rel, f in again.manifest.files.items()}}))
        """
    )
    # the same bytes as the package it was loaded from, the runtime graph included
    assert json.loads(out.stdout) == {rel: f.sha256 for rel, f in info.manifest.files.items()}


# tiny_gpt2: transformers' mask code calls aten.diff, which the op table once lacked (its packages then
# loaded from the program: 3.8 s of a 4.7 s GPT-2 load on the H200)
@pytest.mark.parametrize("model", ["mlp_with_fallback", "tiny_bert", "tiny_gpt2", "tiny_vit"])
def test_runtime_graph_and_program_loads_give_the_same_outputs(
    compiled_zoo, tmp_path, model, copy_package, reseal
):
    case, compiled = compiled_zoo[model]
    info = compiler.save(compiled, tmp_path / "light.kiln")
    old = copy_package(info.path, tmp_path / "program.kiln")
    _drop_runtime_graph(old, reseal)  # as a package saved before the runtime graph existed
    light, program = compiler.load(info.path), compiler.load(old)
    assert light.plan._program is None and program.plan._program is not None
    assert light.plan.signature == program.plan.signature
    assert [p.to_dict() for p in light.plan.partitions] == [p.to_dict() for p in program.plan.partitions]
    for a, b in zip(
        torch.utils._pytree.tree_leaves(light(*case.args, **case.kwargs)),
        torch.utils._pytree.tree_leaves(program(*case.args, **case.kwargs)),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_a_sequential_model_whose_input_fx_renames_gets_a_runtime_graph(tmp_path):
    """nn.Sequential's forward takes `input`, a builtin's name, which fx renames `input_1`: its package
    still loads from its runtime graph (it once loaded from the program: torch._dynamo imported)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    program = compiler.export(model, (torch.randn(2, 8),), dynamic_shapes=({0: batch},))
    info = compiler.save(compiler.compile(program, cache=False), tmp_path / "seq.kiln")
    assert "runtime_graph.json" in info.manifest.files
    loaded = compiler.load(info.path)
    x = torch.randn(5, 8)
    assert loaded.plan._program is None  # ran from the runtime graph
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loaded(input=x), model(x), rtol=1e-5, atol=1e-5)


def _node(data: dict, name: str) -> dict:
    return next(n for n in data["graph"]["nodes"] if n["name"] == name)


def _target(data: dict, value: str) -> None:
    _node(data, "getitem")["target"] = value


def _aten(data: dict) -> dict:
    """The first ATen call of the graph or its submodules (the partitions' linear layers)."""
    graphs = [data["graph"], *data["graph"]["submodules"].values()]
    return next(n for g in graphs for n in g["nodes"] if str(n.get("target", "")).startswith("aten::"))


def _from_file(data: dict) -> None:
    _aten(data).update(
        target="aten::from_file.default",
        args={"tuple": ["/etc/passwd", False, 8]},
        kwargs={"dtype": {"dtype": "uint8"}},
    )


def _rename_placeholder(data: dict, name: str) -> None:
    node = next(n for n in data["graph"]["nodes"] if n["op"] == "placeholder")
    node["name"] = name


def _swap_inputs(data: dict) -> None:
    call = next(n for n in data["graph"]["nodes"] if n["op"] == "call_module")
    call["args"]["tuple"][:2] = call["args"]["tuple"][1::-1]


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (lambda d: _target(d, "operator.attrgetter"), PackageCorruptError, "call target"),
        (lambda d: _target(d, "builtins::eval.default"), PackageCorruptError, "not registered"),
        (lambda d: _target(d, "aten::add"), PackageCorruptError, "call target"),
        (
            lambda d: _node(d, "getitem").update(name="x=__import__('os')"),
            PackageCorruptError,
            "plain identifier",
        ),
        (lambda d: _node(d, "getitem")["args"]["tuple"].append({"eval": "1"}), PackageCorruptError, "kind"),
        (lambda d: d["graph"]["nodes"].insert(0, {"op": "get_attr", "name": "w"}), PackageCorruptError, "op"),
        (lambda d: d["inputs"].pop(), PackageCorruptError, "signature names"),
        (_swap_inputs, compiler.errors.PartitionError, "not called in the saved graph"),
        # N2: any registered overload was a call target: a file read into the output, a file written
        (lambda d: _from_file(d), PackageCorruptError, "operator table"),
        (lambda d: _aten(d).update(target="aten::fill_.Scalar"), PackageCorruptError, "operator table"),
        (lambda d: _aten(d).update(target="aten::add.out"), PackageCorruptError, "writes into"),
        (
            lambda d: _aten(d).update(target="profiler::_record_function_enter.default"),
            PackageCorruptError,
            "namespace",
        ),
        (lambda d: _aten(d)["kwargs"].update(bogus=1), PackageCorruptError, "no argument 'bogus'"),
        (
            lambda d: _aten(d)["args"]["tuple"].__setitem__(0, {"dtype": "float32"}),
            PackageCorruptError,
            "cannot be",
        ),
        # fx pastes placeholder targets into forward's signature: keywords and its own names are refused
        (lambda d: _rename_placeholder(d, "lambda"), PackageCorruptError, "keyword"),
        (lambda d: _rename_placeholder(d, "self"), PackageCorruptError, "fx's generated code"),
        (lambda d: _rename_placeholder(d, "torch"), PackageCorruptError, "fx's generated code"),
        (lambda d: d["user_outputs"].append(99), PackageCorruptError, "user outputs"),
        (lambda d: _aten(d)["args"]["tuple"].insert(0, {"node": 10**6}), PackageCorruptError, "earlier node"),
    ],
    ids=[
        *("py-operator", "unregistered", "not-overload", "name", "value", "get_attr", "inputs", "swap"),
        *("from_file", "in-place", "out", "torch-namespace", "kwarg-name", "kwarg-type"),
        *("placeholder-keyword", "placeholder-self", "placeholder-torch", "user-outputs", "later-node"),
    ],
)
def test_a_tampered_runtime_graph_is_refused_with_a_typed_error(
    mlp_package, tmp_path, edit, error, match, copy_package, reseal
):
    path = copy_package(mlp_package[2].path, tmp_path / "p.kiln")
    data = json.loads((path / "runtime_graph.json").read_text())
    edit(data)
    (path / "runtime_graph.json").write_text(json.dumps(data))
    reseal(path)
    with pytest.raises(error, match=match):
        compiler.load(path, allowed_modules=["zoo.models"])


def test_a_runtime_graph_keyword_runs_no_code(mlp_package, tmp_path, copy_package, reseal):
    """N1: fx pastes a call's keyword names into the forward it generates; a key that is Python ran it
    at the first call, and the model still answered correctly."""
    path = copy_package(mlp_package[2].path, tmp_path / "p.kiln")
    marker = tmp_path / "ran"
    data = json.loads((path / "runtime_graph.json").read_text())
    key = f"*[__import__('os').system('touch {marker}')][:0]) if 1 else dict(zz"
    _aten(data)["kwargs"][key] = {"node": 0}
    (path / "runtime_graph.json").write_text(json.dumps(data))
    reseal(path)
    with pytest.raises(PackageCorruptError, match="has no argument"):
        compiler.load(path, allowed_modules=["zoo.models"])
    assert not marker.exists()


def test_runtime_graph_pytree_specs_import_nothing_and_take_only_builtin_factories(
    mlp_package, tmp_path, copy_package, reseal
):
    """N3: torch's treespec_loads imports the module a defaultdict factory names (``this`` was imported
    in strict mode); N4: a factory already imported (``os.abort``) passed the module rule and killed
    the process on a missing key. kiln decodes the specs itself: neither is taken."""
    from compiler.errors import UnsafeProgramError
    from compiler.program.text import check_program_text

    def factory(module: str, name: str) -> str:
        context = {"default_factory_module": module, "default_factory_name": name, "dict_context": []}
        return json.dumps([1, {"type": "collections.defaultdict", "context": context, "children_spec": []}])

    for module, name, match in [("this", "x", "defaultdict factory this.x"), ("os", "abort", "os.abort")]:
        path = copy_package(mlp_package[2].path, tmp_path / f"{module}.kiln")
        data = json.loads((path / "runtime_graph.json").read_text())
        data["out_spec"] = factory(module, name)
        (path / "runtime_graph.json").write_text(json.dumps(data))
        reseal(path)
        with pytest.raises(PackageCorruptError, match=match):
            compiler.load(path, allowed_modules=["zoo.models"])
        # ... and in a program's text, which torch's own reader decodes: refused before it reads.
        with pytest.raises(UnsafeProgramError, match=match):
            check_program_text(json.dumps({"out_spec": factory(module, name)}).encode(), "p.pt2")
    assert "this" not in sys.modules
    # What kiln still takes: a defaultdict of a builtin container, decoded without torch's reader.
    from compiler.partitioning.treespec import loads

    assert loads(factory("builtins", "list"), "p").context[0] is list


def test_a_graph_the_runtime_form_cannot_hold_is_not_written():
    from compiler.partitioning import runtime_graph

    class Attr(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def forward(self, x):
            return x * self.w  # a get_attr node, and a call of operator.mul on tensors

    gm = torch.fx.symbolic_trace(Attr())
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    with pytest.raises(runtime_graph.NotData, match="get_attr node w"):  # what save's warning says
        runtime_graph.encode(gm, runtime_graph.CallSignature.of(program), {})


def test_a_package_saved_without_its_runtime_graph_says_why_and_still_loads(tmp_path):
    """A higher-order op left to PyTorch (a no_grad block: transformers' rotary embedding) is something
    the runtime graph does not hold: save warns, naming it, and loads read the program."""
    from tests.compiler.partitioning.test_partition import _SizesIntoNoGrad

    model = _SizesIntoNoGrad().eval()
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5)
    compiled = compiler.compile(compiler.export(model, (x, mask)), backend="onnxruntime")
    with pytest.warns(UserWarning, match=r"saved without runtime_graph.json \(.*wrap_with_set_grad_enabled"):
        info = compiler.save(compiled, tmp_path / "nograd.kiln")
    assert "runtime_graph.json" not in info.manifest.files
    loaded = compiler.load(info.path)
    assert "program" in loaded.load_seconds  # the program read, in place of the runtime graph
    torch.testing.assert_close(loaded(x, mask), model(x, mask), rtol=1e-5, atol=1e-5)
