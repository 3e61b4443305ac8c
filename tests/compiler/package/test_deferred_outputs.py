"""A package whose outputs are a transformers ModelOutput: a load imports ``transformers`` only when a
caller asks for that type (``forward``), never for ``run_flat``, a serving backend's path (issue 45:
the import is 1.4-2 s of a 2-2.5 s load). The op-module rule still decides at load, and again when the
import happens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.export import Dim
from transformers.modeling_outputs import BaseModelOutputWithPooling

import compiler

ROOT = Path(__file__).resolve().parents[3]


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> BaseModelOutputWithPooling:
        hidden = torch.tanh(self.proj(x))
        return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=hidden.mean(1))


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = _Encoder().eval()
    x = torch.randn(2, 5, 8)
    program = compiler.export(model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=8)},))
    module = compiler.compile(program, backend="onnxruntime", cache=False)
    path = tmp_path_factory.mktemp("deferred") / "encoder.kiln"
    compiler.save(module, path)
    with torch.no_grad():
        out = model(x)
    torch.save({"x": x, "hidden": out.last_hidden_state, "pooled": out.pooler_output}, path.parent / "io.pt")
    return path


def _fresh(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "KILN_ALLOWED_OP_MODULES"}
    full.update({"PYTHONPATH": str(ROOT), **(env or {})})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full, timeout=300
    )


def test_run_flat_leaves_transformers_unimported_and_forward_returns_the_model_output(package):
    done = _fresh(f"""
        import json, sys, torch, compiler
        data = torch.load({str(package.parent / "io.pt")!r})
        module = compiler.load({str(package)!r}, defer_output_types=True)
        after_load = "transformers" in sys.modules
        flat = module.run_flat([data["x"]])
        after_flat = "transformers" in sys.modules
        out = module(data["x"])
        print(json.dumps({{
            "after_load": after_load, "after_flat": after_flat,
            "after_forward": "transformers" in sys.modules,
            "flat_close": [
                torch.allclose(a, b, atol=1e-5) for a, b in zip(flat, [data["hidden"], data["pooled"]])
            ],
            "type": f"{{type(out).__module__}}.{{type(out).__name__}}",
            "forward_close": torch.allclose(out.last_hidden_state, data["hidden"], atol=1e-5)
            and torch.allclose(out.pooler_output, data["pooled"], atol=1e-5),
        }}))
        """)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["after_load"] is False and result["after_flat"] is False, result
    assert result["flat_close"] == [True, True], result
    assert result["after_forward"] is True, result
    assert result["type"] == "transformers.modeling_outputs.BaseModelOutputWithPooling", result
    assert result["forward_close"] is True, result


def test_a_module_the_rule_refuses_is_refused_at_load_not_at_first_forward(package):
    # Strict mode: nothing imported on the package's word, so the output type's module is refused by
    # the load itself, before anything runs; allowed by the caller, the load succeeds and defers it.
    done = _fresh(
        f"""
        import sys, torch, compiler
        from compiler.errors import OpModuleNotAllowedError
        try:
            compiler.load({str(package)!r}, defer_output_types=True)
        except OpModuleNotAllowedError as exc:
            print("REFUSED", exc.needed)
        module = compiler.load({str(package)!r}, allowed_modules=["transformers.modeling_outputs"])
        print("LOADED", type(module(torch.randn(2, 5, 8))).__name__)  # by default imported beside the load
        """,
        {"KILN_ALLOWED_OP_MODULES": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    expected = ["REFUSED ['transformers.modeling_outputs']", "LOADED BaseModelOutputWithPooling"]
    assert lines == expected, done.stdout


def test_by_default_the_output_types_are_imported_beside_the_load_not_on_its_thread(package):
    # The load returns without waiting for transformers (checked by the rule, imported on a thread of
    # its own while the rest of the load runs); a caller of run_flat alone still sees it imported, and
    # the first forward answers with the model's own output type.
    done = _fresh(f"""
        import json, sys, threading, torch, compiler
        data = torch.load({str(package.parent / "io.pt")!r})
        module = compiler.load({str(package)!r})
        flat = module.run_flat([data["x"]])
        for thread in threading.enumerate():
            if thread.name == "kiln-import":
                thread.join()
        imported = "transformers.modeling_outputs" in sys.modules
        out = module(data["x"])
        print(json.dumps({{
            "imported": imported, "stages": sorted(module.load_seconds),
            "type": type(out).__name__,
            "close": torch.allclose(out.last_hidden_state, data["hidden"], atol=1e-5),
        }}))
        """)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] is True, result
    assert result["type"] == "BaseModelOutputWithPooling" and result["close"] is True, result
    assert {"modules", "weights", "runtime_graph", "engines", "total"} <= set(result["stages"]), result


def test_the_import_on_first_forward_is_held_to_the_rule_then(package):
    # Allowed at load (the default list), then the process's rule turns strict before the first forward:
    # the deferred import is checked again when it happens, and refused.
    done = _fresh(f"""
        import os, sys, torch, compiler
        from compiler.errors import OpModuleNotAllowedError
        data = torch.load({str(package.parent / "io.pt")!r})
        module = compiler.load({str(package)!r}, defer_output_types=True)
        os.environ["KILN_ALLOWED_OP_MODULES"] = ""
        try:
            module(data["x"])
        except OpModuleNotAllowedError as exc:
            print("REFUSED", exc.needed, "transformers" in sys.modules)
        """)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last == "REFUSED ['transformers.modeling_outputs'] False", done.stdout


def test_a_rewritten_output_spec_is_refused_at_load_or_at_first_forward(
    package, tmp_path, copy_package, reseal
):
    # An attacker's runtime graph, checksums and content hash recomputed: a malformed spec is refused by
    # the load itself, and so is a type no module registered (nothing is imported for it).
    def rewrite(name: str, edit) -> Path:
        path = copy_package(package, tmp_path / name)
        graph = json.loads((path / "runtime_graph.json").read_text())
        protocol, schema = json.loads(graph["out_spec"])
        edit(schema)
        graph["out_spec"] = json.dumps([protocol, schema])
        (path / "runtime_graph.json").write_text(json.dumps(graph))
        reseal(path)
        return path

    malformed = rewrite("malformed", lambda schema: schema.update(children_spec="not a list"))
    foreign = rewrite("foreign", lambda schema: schema.update(type="os.system"))
    done = _fresh(f"""
        import torch, compiler
        from compiler.errors import PackageCorruptError
        data = torch.load({str(package.parent / "io.pt")!r})
        try:
            compiler.load({str(malformed)!r}, defer_output_types=True)
            print("MALFORMED LOADED")
        except PackageCorruptError:
            print("MALFORMED REFUSED AT LOAD")
        try:  # a type no recorded module names: nothing is deferred, the load decodes and refuses it
            compiler.load({str(foreign)!r}, defer_output_types=True)(data["x"])
            print("FOREIGN RAN")
        except PackageCorruptError as exc:
            print("FOREIGN REFUSED", "os.system" in str(exc))
        """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-2:] == ["MALFORMED REFUSED AT LOAD", "FOREIGN REFUSED True"], (
        done.stdout
    )


def test_kiln_lookup_verifies_and_loads_without_importing_the_output_types(package, tmp_path):
    # `kiln lookup` never calls the module: transformers (the ModelOutput's module, seconds to import)
    # is checked against the op-module rule, not imported.
    from registry.tracking import record_package

    store = f"sqlite:///{tmp_path}/mlflow.db"
    recorded = record_package(package, "encoder", {"name": "encoder"}, tracking_uri=store)
    done = _fresh(f"""
        import json, sys
        from flows.cli import main
        sys.argv = ["kiln", "lookup", "encoder", "--tracking-uri", {store!r}, "--json"]
        try:
            main()
        except SystemExit as exc:
            assert not exc.code, exc.code
        print("TRANSFORMERS", sorted(m for m in sys.modules if m.split(".")[0] == "transformers")[:3])
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TRANSFORMERS []" in done.stdout, done.stdout[-2000:]
    summary = json.loads(done.stdout[: done.stdout.rindex("TRANSFORMERS")])
    assert summary["version"] == recorded.version
