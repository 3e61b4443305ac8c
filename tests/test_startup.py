"""What the CLI and ``import compiler`` pay for before they are used (issue 21). Times are the
benchmark's job (benchmarks/startup.py); these check which heavy libraries a fresh process imports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_cli_and_compiler_import_no_heavy_library_until_used():
    out = _fresh(
        """
        import sys, types
        import compiler, flows.cli, registry.summary
        heavy = ("torch", "prefect", "mlflow", "onnx", "onnxruntime", "transformers", "sympy")
        print(sorted(m for m in heavy if m in sys.modules))
        import compiler.program.export, compiler.validation.validate  # stage modules keep the functions
        print(callable(compiler.export), isinstance(compiler.validate, types.FunctionType))
        print("torch._dynamo" in sys.modules, sorted(set(compiler.__all__) - set(dir(compiler))))
        """
    )
    assert out.splitlines() == ["[]", "True True", "False []"]


def test_registry_listings_need_no_torch_and_the_no_op_path_no_prefect():
    out = _fresh(
        """
        import sys
        import registry.lookup, registry.models
        print("torch" in sys.modules)
        import flows.results, tasks.reuse  # an unchanged zoo's summary, without any flow
        print("prefect" in sys.modules)
        """
    )
    assert out.split() == ["False", "False"]


def test_an_unchanged_model_is_reused_without_importing_torch(tmp_path):
    """The CLI's no-op path end to end (issue 21): the zoo file, the request's compile key, the published
    record and the package's checks (content hash, every listed file's checksum) decide "reuse" with
    torch, the compile stages and MLflow left unimported. A pt2: source's identity is a file hash; a
    factory's imports the factory's own module, whose torch is then the user's import, not kiln's."""
    package = tmp_path / "out" / "mlp.kiln"
    shutil.copytree(ROOT / "tests" / "fixtures" / "packages" / "mlp-cuda-inductor.kiln", package)
    shutil.copy(package / "program.pt2", tmp_path / "mlp.pt2")
    zoo_file = tmp_path / "zoo.yaml"
    settings = {"workspace": str(tmp_path / "ws"), "engine_cache": False, "tracking": False}
    zoo = {"settings": settings, "models": [{"name": "mlp", "source": "pt2:mlp.pt2", "devices": ["cuda"]}]}
    zoo_file.write_text(json.dumps(zoo))  # JSON is YAML
    out = _fresh(
        f"""
        import sys
        from compiler.package.check import read_manifest
        from tasks.reuse import PublishedRecord, remember, unchanged
        from zoo.zoo_file import load_zoo

        # What the compile that published this package recorded.
        zoo = load_zoo({str(zoo_file)!r})
        request = zoo.requests(zoo.entries[0])[0]
        package = {str(package)!r}
        record = PublishedRecord(package, read_manifest(package).content_hash, 2, 2)
        remember(request, zoo.settings.workspace, record)

        from flows.cli import main
        sys.argv = ["kiln", "zoo", {str(zoo_file)!r}, "--out", {str(package.parent)!r}, "--json"]
        try:
            main()
        except SystemExit as exc:
            print("exit", exc.code)
        heavy = ("torch", "sympy", "onnx", "onnxruntime", "mlflow", "prefect", "compiler.program.export")
        print("imported", [m for m in heavy if m in sys.modules])
        # The same check refuses a package changed on disk, still without torch.
        with open(package + "/weights.safetensors", "r+b") as f:
            f.write(b"x")
        print("tampered", unchanged(request, package, zoo.settings.workspace, tracking=False))
        print("imported", [m for m in heavy if m in sys.modules])
        """
    )
    lines = out.splitlines()
    summary = json.loads("\n".join(lines[: lines.index("exit 0")]))
    assert [(m["name"], m["status"], m["engines_built"]) for m in summary["models"]] == [("mlp", "ok", 0)]
    assert lines[lines.index("exit 0") + 1 :] == ["imported []", "tampered None", "imported []"]


def test_source_identities_name_the_torch_version_torch_reports():
    """Identities read torch's version from its metadata (no import): the string must be torch's own, or
    every compile key would silently change meaning."""
    import torch

    from zoo.sources.base import torch_version

    assert torch_version() == torch.__version__


def test_loading_a_transformers_model_leaves_torchao_to_the_recipes_that_need_it():
    """transformers' modeling code imports torchao wherever it is installed (its quantizers), which logs
    warnings on every run (issue 32): loading a model for kiln must not, and the Inductor int8 recipe
    must still import it afterwards in the same process."""
    out = _fresh(
        """
        import sys
        from zoo.config import ZooEntry

        kwargs = {"num_layers": 1, "hidden": 32}
        entry = {"name": "b", "factory": "zoo.models:tiny_bert", "factory_kwargs": kwargs}
        ZooEntry.model_validate(entry).requests()[0].load_case()
        print("transformers.modeling_utils" in sys.modules, "torchao" in sys.modules)
        from compiler.quantization.pt2e import pt2e_available
        print(pt2e_available(), "torchao" in sys.modules)
        """
    )
    assert out.split() == ["True", "False", "None", "True"]


def test_source_identities_name_torch_version_not_its_metadata(tmp_path):
    """PyPI's CUDA build of torch 2.13.0 has the version 2.13.0 in its metadata and 2.13.0+cu130 as
    torch.__version__, which packages record: identities name the latter, still without importing torch.
    A torch laid out as that wheel is, whose import would fail, stands first on the path."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.13.0+cu130'\ncuda = '13.0'\n")
    (tmp_path / "torch-2.13.0.dist-info").mkdir()
    (tmp_path / "torch-2.13.0.dist-info" / "METADATA").write_text("Name: torch\nVersion: 2.13.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    code = "import importlib.metadata, sys; from zoo.sources.base import torch_version; "
    code += "print(torch_version(), importlib.metadata.version('torch'), 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["2.13.0+cu130", "2.13.0", "False"]
