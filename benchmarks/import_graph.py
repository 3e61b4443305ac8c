"""The import graph of kiln's packages, computed from the source with ``ast`` (nothing is imported).

For ``compiler/`` it counts modules, import edges between them, layers of imports (the longest chain
of imports below a module, after each cycle is taken as one node), cycles and the largest file, both
per module (file) and per stage (a subpackage of ``compiler`` counts as one node, a root module as
one). Every ``import`` counts, at module level or inside a function (a lazy import is still a
dependency), except those under ``if TYPE_CHECKING:``.

For the whole project (compiler, tasks, flows, registry, zoo, serving) it lists each import that runs
upward: an import between two stages (the same grouping one level below each top-level package) that
closes a cycle.

    python3 benchmarks/import_graph.py            # a table
    python3 benchmarks/import_graph.py --json     # the same numbers as JSON
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("compiler", "tasks", "flows", "registry", "zoo", "serving")


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``packages``."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST) -> list[tuple[str, tuple[str, ...], int]]:
    """(module, names, level) of every import outside ``if TYPE_CHECKING:`` blocks."""
    found: list[tuple[str, tuple[str, ...], int]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.extend((alias.name, (), 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", tuple(a.name for a in node.names), node.level))
        stack.extend(ast.iter_child_nodes(node))
    return found


def edges(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from a import b`` names ``a.b`` when that is a module)."""
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for module, names, level in _imports(ast.parse(path.read_text(), str(path))):
            if level:
                base = package.split(".")
                base = base[: len(base) - (level - 1)]
                module = ".".join([*base, module] if module else base)
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in found]
            if len(targets) < len(names) or not names:
                # a name that is not a submodule comes from the module itself
                while module and module not in found:
                    module = module.rpartition(".")[0]
                targets.append(module)
            graph[name].update(t for t in targets if t and t != name and t in found)
    return graph


def group(name: str, found: dict[str, Path]) -> str:
    """The stage a module belongs to: its package one level below the top, or itself at the root."""
    parts = name.split(".")
    if len(parts) >= 2 and ".".join(parts[:2]) in found and found[".".join(parts[:2])].name == "__init__.py":
        return ".".join(parts[:2])
    return name if len(parts) <= 2 else ".".join(parts[:2])


def condense(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def measure(graph: dict[str, set[str]]) -> dict:
    """Nodes, edges, layers (longest import chain + 1 over the condensed graph) and cycles."""
    components = condense(graph)
    where = {member: i for i, component in enumerate(components) for member in component}
    depth: dict[int, int] = {}
    for i, component in enumerate(components):  # Tarjan emits a component after everything it imports
        below = {where[t] for m in component for t in graph[m]} - {i}
        depth[i] = 1 + max((depth[j] for j in below), default=-1)
    return {
        "nodes": len(graph),
        "edges": sum(len(targets) for targets in graph.values()),
        "layers": 1 + max(depth.values(), default=-1),
        "cycles": [c for c in components if len(c) > 1],
    }


def grouped(graph: dict[str, set[str]], found: dict[str, Path], keep: str) -> dict[str, set[str]]:
    """The graph with each module replaced by its stage, keeping modules under ``keep`` only."""
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        if not (name == keep or name.startswith(keep + ".")):
            continue
        source = group(name, found)
        out.setdefault(source, set())
        for target in targets:
            inside = target == keep or target.startswith(keep + ".")
            if inside and (stage := group(target, found)) != source:
                out[source].add(stage)
    return out


def upward(graph: dict[str, set[str]], found: dict[str, Path]) -> list[str]:
    """Imports ``module -> module`` whose stages sit in one cycle of the project's stage graph."""
    stages: dict[str, set[str]] = {}
    for name, targets in graph.items():
        stages.setdefault(group(name, found), set()).update(
            group(t, found) for t in targets if group(t, found) != group(name, found)
        )
    cyclic = {m: tuple(c) for c in condense(stages) if len(c) > 1 for m in c}
    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if group(name, found) in cyclic
        and cyclic[group(name, found)] == cyclic.get(group(target, found))
        and group(name, found) != group(target, found)
    )


def report(root: Path = ROOT) -> dict:
    found = modules(root, PROJECT)
    graph = edges(found)
    compiler = {n: {t for t in ts if t.split(".")[0] == "compiler"} for n, ts in graph.items()}
    compiler = {n: ts for n, ts in compiler.items() if n.split(".")[0] == "compiler"}
    sizes = {
        str(p.relative_to(root)): len(p.read_text().splitlines())
        for n, p in found.items()
        if n.split(".")[0] == "compiler"
    }
    largest = max(sizes, key=sizes.__getitem__)
    return {
        "compiler_modules": measure(compiler),
        "compiler_stages": measure(grouped(compiler, found, "compiler")),
        "largest_file": {"path": largest, "lines": sizes[largest]},
        "files_over_500_lines": sorted(p for p, n in sizes.items() if n > 500),
        "project_packages": {
            k: v
            for k, v in measure(
                {
                    top: {t.split(".")[0] for n, ts in graph.items() if n.split(".")[0] == top for t in ts}
                    - {top}
                    for top in PROJECT
                }
            ).items()
            if k != "nodes"
        },
        "project_upward_imports": upward(graph, found),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure")
    args = parser.parse_args(argv)
    numbers = report(args.root)
    if args.json:
        print(json.dumps(numbers, indent=1))
        return 0
    for label in ("compiler_modules", "compiler_stages"):
        m = numbers[label]
        cycles = "; ".join(" <-> ".join(c) for c in m["cycles"]) or "none"
        print(
            f"{label:17} {m['nodes']:3} nodes  {m['edges']:3} edges  {m['layers']:2} layers  cycles: {cycles}"
        )
    print(f"largest file      {numbers['largest_file']['path']} ({numbers['largest_file']['lines']} lines)")
    print(f"over 500 lines    {', '.join(numbers['files_over_500_lines']) or 'none'}")
    top = numbers["project_packages"]
    cycles = "; ".join(" <-> ".join(c) for c in top["cycles"]) or "none"
    print(f"project packages  {top['edges']} edges  {top['layers']} layers  cycles: {cycles}")
    up = numbers["project_upward_imports"]
    print(f"upward imports    {len(up)}" + "".join(f"\n  {edge}" for edge in up))
    return 0


if __name__ == "__main__":
    sys.exit(main())
