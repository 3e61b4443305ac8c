"""The layout, guarded: no import cycle, no import running upward, no file over 500 lines, and the stage
table of docs/architecture.md says what each compiler stage imports, in an order where each imports only
stages above it. Measured by benchmarks/import_graph.py (the source read with ``ast``: nothing imported)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CAPPED = ("compiler", "tasks", "flows", "registry", "zoo")  # files stay at 500 lines or fewer


@pytest.fixture(scope="module")
def graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "benchmarks" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle_and_nothing_imports_upward(graph):
    numbers = graph.report(ROOT)
    assert numbers["compiler_modules"]["cycles"] == []
    assert numbers["compiler_stages"]["cycles"] == []
    assert numbers["project_packages"]["cycles"] == []
    assert numbers["project_upward_imports"] == []


def test_no_file_over_500_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for package in CAPPED
        for path in (ROOT / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert long == {}, f"split these at their seams (docs/architecture.md): {long}"


def documented_stages() -> list[tuple[str, set[str]]]:
    """(stage, the stages it imports) per row of docs/architecture.md's compiler table, in its order."""
    rows = []
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        found = re.match(r"\| `(\w+)(/|\.py)` \| .* \| ([^|]+) \|$", line)
        if found:
            rows.append((found[1], set(re.findall(r"\w+", found[3])) - {"none"}))
    return rows


def test_the_architecture_guide_lists_each_stage_and_what_it_imports(graph):
    found = graph.modules(ROOT, ("compiler",))
    stages = graph.grouped(graph.edges(found), found, "compiler")
    rows = documented_stages()
    names = [name for name, _ in rows]
    packages = {p.name for p in (ROOT / "compiler").iterdir() if (p / "__init__.py").exists()}
    assert packages | {"options"} <= set(names), "a stage package the guide does not list"
    measured = {name: {s.split(".", 1)[1] for s in stages[f"compiler.{name}"]} & set(names) for name in names}
    assert {name: deps for name, deps in rows} == measured
    for position, (name, deps) in enumerate(rows):  # the order: each imports only stages above it
        assert deps <= set(names[:position]), f"{name} imports {deps - set(names[:position])} from below"
