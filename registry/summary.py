"""What the main job prints at its end: how to open the MLflow UI, and every registered version."""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from rich.console import Console
from rich.table import Table

# registry.config and registry.models import MLflow: they are imported where used, so the CLI's tables
# can share ``name_width`` without paying for MLflow.


def ui_command(tracking_uri: str | None = None) -> str:
    """The ``mlflow ui`` command that shows this store (embedded sqlite, or the server's address)."""
    from registry import config

    uri = tracking_uri or config.resolve_tracking_uri()
    if uri.startswith("http://") or uri.startswith("https://"):
        return f"open {uri} (the tracking server's own UI)"
    parts = ["mlflow", "ui", "--backend-store-uri", uri]
    if uri.startswith("sqlite:"):
        parts += ["--default-artifact-root", str(config.embedded_artifact_root())]
    return " ".join(shlex.quote(p) for p in parts)


def versions_table(rows: list[dict]) -> Table:
    """One line per version that fits 80 columns: the full input ranges are in the version's tags.

    Names are never folded mid-word: the name column is as wide as the longest name up to
    ``NAME_WIDTH``, and a longer name ends in an ellipsis; other cells wrap at spaces. No cell is blank:
    a version with no alias says 'no alias', one without recorded specs 'unknown'.
    """
    table = Table(title="registered kiln versions")
    table.add_column("name", no_wrap=True, overflow="ellipsis", width=name_width(r["name"] for r in rows))
    table.add_column("v", justify="right", no_wrap=True)
    table.add_column("aliases", overflow="ellipsis", min_width=8)
    table.add_column("engine", overflow="ellipsis", min_width=len("onnxruntime"))
    table.add_column("dims", overflow="ellipsis")
    for r in rows:
        state = [*r["aliases"], *(["rejected"] if r["rejected"] else [])]
        table.add_row(
            r["name"],
            r["version"],
            ", ".join(state) or "no alias",
            f"{r['backend'] or '?'} {r['precision'] or '?'}",
            r["dims"] or "unknown",
        )
    return table


NAME_WIDTH = 26  # wider, and the other columns fall below one word each at 80 columns


def name_width(names: Iterable[str]) -> int:
    """The width a table gives its name column: the longest name, at most ``NAME_WIDTH``."""
    return min(max((len(n) for n in names), default=4), NAME_WIDTH)


def print_registry_summary(tracking_uri: str | None = None, console: Console | None = None) -> list[dict]:
    """Print the ``mlflow ui`` command and a table of every registered kiln version; return the rows."""
    from registry import config
    from registry.models import registered_versions
    from registry.terminal import SafeConsole

    console = console or SafeConsole()
    uri = config.configure(tracking_uri)
    rows = registered_versions(config.client(uri))
    console.print(versions_table(rows))
    console.print(f"MLflow tracking store: {uri}")
    console.print(f"See runs, metrics and models with: [bold]{ui_command(uri)}[/bold]", soft_wrap=True)
    return rows
