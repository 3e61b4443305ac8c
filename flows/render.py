"""What the ``kiln`` CLI shows: live progress per model, the summary table, packages and failures.

Kept apart from the commands (``flows.cli``) so the commands read as input -> flow -> report.
Tables fit 80 columns (CI logs, pipes); with ``--json`` stdout carries only the summary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich import box
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from registry.summary import name_width
from registry.terminal import SafeConsole, shown  # noqa: F401 (shown: the CLI's one cell sanitizer)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


console = SafeConsole(stderr=True)
out_console = SafeConsole()


class ProgressView:
    """One line per (model, device) with its current stage, and an overall bar."""

    def __init__(self, progress: Progress, total: int):
        self.progress = progress
        self.overall = progress.add_task("models", total=total)
        self.rows: dict[tuple[str, str], Any] = {}

    def __call__(self, event: str, model: str, device: str, detail: str) -> None:
        key = (model, device)
        if key not in self.rows:
            self.rows[key] = self.progress.add_task(f"{model} [dim]{device}[/dim]", total=None)
        row = self.rows[key]
        if event == "model":
            self.progress.update(row, description=f"{model} [dim]{device}[/dim]: {detail}")
        else:
            mark = "[green]ok[/green]" if event == "done" else "[red]failed[/red]"
            self.progress.update(
                row, description=f"{model} [dim]{device}[/dim]: {mark}", total=1, completed=1
            )
            self.progress.advance(self.overall)


def progress_bar() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


NOT_MEASURED = "-"
LAYERS_MARK = "*"  # a precision cell's mark: repair kept some layers of its partitions in float


def _summary_table(summary: dict[str, Any]) -> Table:
    unmeasured = any(m.get("max_rel_l2") is None or m.get("latency_ratio") is None for m in summary["models"])
    layered = any("layer" in (m.get("precision") or "").split(";")[0] for m in summary["models"])
    notes = [f"{NOT_MEASURED}: not measured (failed, or not validated)"] if unmeasured else []
    notes += [f"{LAYERS_MARK}: some layers kept in fp32 (see the warnings)"] if layered else []
    table = Table(
        title=f"kiln: {summary['ok']} ok, {summary['failed']} failed, {summary['seconds']}s",
        # Columns apart by one space, no rules: nine columns and a whole model name fit 80 columns.
        box=box.SIMPLE_HEAD,
        padding=0,
        caption="; ".join(notes) or None,
    )
    # Short headers: the table must fit 80 columns (CI logs, pipes).
    table.add_column(
        "model", no_wrap=True, overflow="ellipsis", width=name_width(m["name"] for m in summary["models"])
    )
    table.add_column("device", no_wrap=True, overflow="ellipsis")
    table.add_column("status", no_wrap=True)
    # Only when some model is not plain fp32 (int8 plans, fp16): the table must fit 80 columns.
    mixed = any((m.get("precision") or "fp32") != "fp32" for m in summary["models"])
    if mixed:
        table.add_column("prec", no_wrap=True)
    for column in ("parts", "built", "reused", "rel L2", "lat x", "s"):
        table.add_column(column, justify="right", no_wrap=True)
    for m in summary["models"]:
        # An invalid entry has no request, so no precision: "-" (a row that compiled and recorded none
        # predates the field: fp32)
        asked = m.get("precision") or ("fp32" if m["status"] == "ok" else NOT_MEASURED)
        precision = [_precision_cell(asked)] if mixed else []
        table.add_row(
            escape(m["name"]),
            escape(m["device"]),
            "[green]ok[/green]" if m["status"] == "ok" else "[red]failed[/red]",
            *precision,
            str(m["partitions"]),
            str(m["engines_built"]),
            str(m["engines_reused"]),
            f"{m['max_rel_l2']:.1e}" if m.get("max_rel_l2") is not None else NOT_MEASURED,
            f"{m['latency_ratio']:.2f}" if m.get("latency_ratio") is not None else NOT_MEASURED,
            f"{m['seconds']:.1f}",
        )
    return table


def _precision_cell(summary: str) -> str:
    """``int8 x11; fp32: engine_2`` -> ``int8+1`` (partitions at another precision): fits 80 columns."""
    common, _, rest = summary.partition(";")
    others = sum(len(part.split(":", 1)[1].split(",")) for part in rest.split(";") if ":" in part)
    level = common.split(" x")[0].strip() or "-"
    layers = LAYERS_MARK if "layer" in common else ""  # "int8 x1 (56 layers fp32, ...)": layers raised
    return f"{level}+{others}{layers}" if others else f"{level}{layers}"


def _first_line(text: str | None, limit: int = 400) -> str:
    line = (text or "").strip().splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def report(summary: dict[str, Any], as_json: bool) -> int:
    """Print the summary (table, or JSON on stdout), packages, failures and warnings; the exit code."""
    if as_json:
        out_console.print_json(json.dumps(summary))
    else:
        console.print(_summary_table(summary))
    # Packages and failures go to stderr either way: with --json, stdout stays machine-readable.
    for m in summary["models"]:
        if m["status"] == "ok":
            console.print(f"  [green]{escape(m['name'])}[/green] -> {escape(m['package'])}", soft_wrap=True)
    for m in summary["models"]:
        if m["status"] != "ok":
            line = escape(_first_line(m["error"]))
            console.print(f"  [red]{escape(m['name'])}[/red] failed: {line}", soft_wrap=True)
    for warning in summary.get("warnings", []):
        console.print(f"  [yellow]warning:[/yellow] {escape(warning)}", soft_wrap=True)
    # Builds that fell back to PyTorch are neither built nor reused: then something did happen.
    every_engine_reused = summary["engines_reused"] == sum(m["unique_engines"] for m in summary["models"])
    if summary["engines_built"] == 0 and not summary["failed"] and every_engine_reused:
        console.print("nothing changed: 0 engines built, every engine came from the cache")
    cache = summary.get("engine_cache") or {}
    if cache:
        console.print(
            f"engine cache: {cache.get('path') or 'none'} ({cache.get('chosen_by')})", soft_wrap=True
        )
    console.print(f"packages: {summary['out_dir']}   summary: {Path(summary['out_dir']) / 'summary.json'}")
    return EXIT_FAILED if summary["failed"] else EXIT_OK
