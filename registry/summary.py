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
    table = Table(title="registered kiln versions")
    columns = (
        "name",
        "version",
        "aliases",
        "backend",
        "precision",
        "target_device",
        "input_ranges",
        "status",
    )
    for col in columns:
        table.add_column(col, overflow="fold")
    for r in rows:
        status = "rejected" if r["rejected"] else ""
        table.add_row(
            r["name"],
            r["version"],
            ", ".join(r["aliases"]),
            r["backend"],
            r["precision"],
            r["target_device"],
            r["input_ranges"],
            status,
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
