"""Every JSON kiln reads from something it did not just write goes through compiler.json_reader (bounded
in size, depth and integers; one typed error). This lists every direct ``json.loads``/``json.load``
call in kiln's packages and fails on one that is not approved below, with the reason it is safe."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("compiler", "tasks", "flows", "zoo", "registry", "serving")

# (file, enclosing function) -> why its bytes need no bound: kiln wrote them itself, just now.
APPROVED = {
    ("compiler/json_reader.py", "loads"): "the reader itself, after its bounds",
    ("compiler/cache/entry.py", "make_key"): "its own canonical JSON of the key fields, back to data",
    ("compiler/cache/entry.py", "check_meta"): "its own canonical JSON of the caller's meta, size-checked",
    ("compiler/package/save_load.py", "save"): "the manifest it is writing, through JSON to hash it",
    ("registry/payload.py", "request_data"): "its own json.dumps of a value, back to plain data",
    ("registry/release.py", "_compact_json"): "its own json.dumps of the report, to shrink it",
    ("serving/triton/runtime.py", "model_config_dict"): "Triton's own JSON of the config.pbtxt kiln wrote",
}


def _json_calls(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every call of json.load/json.loads (or those names imported from
    json) in the file."""
    tree = ast.parse(path.read_text(), str(path))
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "json"
        for alias in node.names
        if alias.name in ("load", "loads", "JSONDecoder")
    }
    modules = {"json"} | {
        alias.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name == "json" and alias.asname
    }
    found = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else scope
            if isinstance(child, ast.Call):
                func = child.func
                direct = isinstance(func, ast.Name) and func.id in imported
                attribute = (
                    isinstance(func, ast.Attribute)
                    and func.attr in ("load", "loads", "JSONDecoder")
                    and isinstance(func.value, ast.Name)
                    and func.value.id in modules
                )
                if direct or attribute:
                    found.append((scope, child.lineno))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def _all_calls() -> dict[tuple[str, str], list[int]]:
    calls: dict[tuple[str, str], list[int]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for scope, line in _json_calls(path):
                calls.setdefault((str(path.relative_to(ROOT)), scope), []).append(line)
    return calls


def test_every_json_parse_of_outside_bytes_goes_through_the_bounded_reader():
    calls = _all_calls()
    new = {
        f"{file}:{lines[0]} ({scope})"
        for (file, scope), lines in calls.items()
        if (file, scope) not in APPROVED
    }
    assert not new, (
        "json.loads/json.load called directly; read outside bytes with compiler.json_reader.loads or "
        f"read_file, or approve the call in {Path(__file__).name} with the reason its bytes are kiln's own: "
        f"{sorted(new)}"
    )
    stale = set(APPROVED) - set(calls)
    assert not stale, f"approved callers that no longer call json directly (drop them): {sorted(stale)}"


def test_the_scan_finds_each_way_of_calling_json(tmp_path):
    """The positive control: a call by attribute, by an aliased module and by an imported name."""
    source = tmp_path / "sample.py"
    source.write_text(
        "import json\nimport json as j\nfrom json import loads as parse\n"
        "def a(x):\n    return json.loads(x)\n"
        "def b(x):\n    return j.load(x)\n"
        "def c(x):\n    return parse(x)\n"
        "def d(x):\n    return json.dumps(x)\n"
    )
    assert [scope for scope, _ in _json_calls(source)] == ["a", "b", "c"]
