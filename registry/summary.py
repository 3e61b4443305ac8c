"""What the main job prints at its end: how to open the MLflow UI, and every registered version."""

from __future__ import annotations

import shlex

from rich.console import Console
from rich.table import Table

from registry import config
from registry.models import registered_versions


def ui_command(tracking_uri: str | None = None) -> str:
    """The ``mlflow ui`` command that shows this store (embedded sqlite, or the server's address)."""
    uri = tracking_uri or config.resolve_tracking_uri()
    if uri.startswith("http://") or uri.startswith("https://"):
        return f"open {uri} (the tracking server's own UI)"
    parts = ["mlflow", "ui", "--backend-store-uri", uri]
    if uri.startswith("sqlite:"):
        parts += ["--default-artifact-root", str(config.embedded_artifact_root())]
    return " ".join(shlex.quote(p) for p in parts)


def versions_table(rows: list[dict]) -> Table:
    """One line per version that fits 80 columns: the full input ranges are in the version's tags."""
    table = Table(title="registered kiln versions")
    table.add_column("name", overflow="fold", min_width=8)
    table.add_column("v", justify="right")
    table.add_column("aliases", overflow="fold")
    table.add_column("engine", overflow="fold")
    table.add_column("dims", overflow="fold")
    table.add_column("status")
    for r in rows:
        table.add_row(
            r["name"],
            r["version"],
            ", ".join(r["aliases"]),
            f"{r['backend']} {r['precision']}",
            r["dims"],
            "rejected" if r["rejected"] else "",
        )
    return table


def print_registry_summary(tracking_uri: str | None = None, console: Console | None = None) -> list[dict]:
    """Print the ``mlflow ui`` command and a table of every registered kiln version; return the rows."""
    console = console or Console()
    uri = config.configure(tracking_uri)
    rows = registered_versions(config.client(uri))
    console.print(versions_table(rows))
    console.print(f"MLflow tracking store: {uri}")
    console.print(f"See runs, metrics and models with: [bold]{ui_command(uri)}[/bold]", soft_wrap=True)
    return rows
