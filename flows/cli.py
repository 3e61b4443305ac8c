"""The ``kiln`` command line: compile one model or a whole zoo, then look up and release what was built.

Exit codes, for scripts: 0 every model compiled and validated; 1 at least one model failed (the
summary names each failure); 2 the input was unusable (a broken zoo file, a bad option).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

app = typer.Typer(
    name="kiln",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    help=(
        "Compile PyTorch models into validated inference-engine packages (ONNX Runtime by default, "
        "TensorRT optionally).\n\n"
        "Start here:  [bold]kiln zoo deploy/zoo.yaml --out out/[/bold]  compiles the example zoo and "
        "prints where the packages are.\n\n"
        "Exit codes: 0 all models ok, 1 a model failed, 2 unusable input."
    ),
)
console = Console(stderr=True)
out_console = Console()

ZooFile = Annotated[
    Path,
    typer.Argument(
        help="zoo file (YAML): models, input ranges, precision, backend, targets", show_default=True
    ),
]
OutDir = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="where packages go (default: the zoo's settings.out_dir, 'out')"),
]
Targets = Annotated[
    list[str] | None,
    typer.Option("--target", "-t", help="only these target devices (repeatable): cpu, cuda:0, ..."),
]
TaskRunner = Annotated[
    str | None,
    typer.Option(
        "--task-runner", help="thread (default) or dask: where engine builds run", show_default=False
    ),
]
DaskAddress = Annotated[
    str | None,
    typer.Option(
        "--dask-address", help="Dask scheduler, e.g. tcp://10.0.0.5:8786 (implies --task-runner dask)"
    ),
]
Workspace = Annotated[
    Path | None, typer.Option("--workspace", help="stage outputs and Prefect's task cache (.kiln/workspace)")
]
EngineCacheDir = Annotated[
    Path | None, typer.Option("--engine-cache", help="persistent engine cache (.kiln/engine-cache)")
]
Tracking = Annotated[
    bool | None,
    typer.Option(
        "--tracking/--no-tracking",
        help="record packages in MLflow (default: the zoo's setting; on when the registry is installed)",
        show_default=False,
    ),
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="show Prefect's task logs")]
JsonOut = Annotated[bool, typer.Option("--json", help="print the summary as JSON on stdout (for scripts)")]


def _quiet_prefect(verbose: bool) -> None:
    # Must run before Prefect is imported: its logging settings are read at import.
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
        warnings.filterwarnings("ignore")
        os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
        logging.getLogger("mlflow").setLevel(logging.ERROR)  # tracking chatter; failures still show
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The temporary API server migrates a fresh database first: 20 s is not enough on a busy 2-core box.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")


def _bad_input(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, highlight=False)
    return typer.Exit(EXIT_BAD_INPUT)


def _overrides(
    task_runner: str | None,
    dask_address: str | None,
    workspace: Path | None,
    engine_cache: Path | None,
    tracking: bool | None,
) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if dask_address:
        task_runner = task_runner or "dask"
        overrides["dask"] = {"address": dask_address}
    if task_runner:
        if task_runner not in ("thread", "dask"):
            raise _bad_input(f"--task-runner {task_runner!r}: use 'thread' or 'dask'")
        overrides["task_runner"] = task_runner
    if workspace:
        overrides["workspace"] = str(workspace)
    if engine_cache:
        overrides["engine_cache"] = str(engine_cache)
    if tracking is not None:
        overrides["tracking"] = tracking
    return overrides


class _ProgressView:
    """One line per (model, target) with its current stage, and an overall bar."""

    def __init__(self, progress: Progress, total: int):
        self.progress = progress
        self.overall = progress.add_task("models", total=total)
        self.rows: dict[tuple[str, str], Any] = {}

    def __call__(self, event: str, model: str, target: str, detail: str) -> None:
        key = (model, target)
        if key not in self.rows:
            self.rows[key] = self.progress.add_task(f"{model} [dim]{target}[/dim]", total=None)
        row = self.rows[key]
        if event == "model":
            self.progress.update(row, description=f"{model} [dim]{target}[/dim]: {detail}")
        else:
            mark = "[green]ok[/green]" if event == "done" else "[red]failed[/red]"
            self.progress.update(
                row, description=f"{model} [dim]{target}[/dim]: {mark}", total=1, completed=1
            )
            self.progress.advance(self.overall)


def _progress() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title=f"kiln: {summary['ok']} ok, {summary['failed']} failed, {summary['seconds']}s")
    # Short headers: the table must fit 80 columns (CI logs, pipes).
    table.add_column("model", overflow="fold", min_width=6)
    table.add_column("target")
    table.add_column("status")
    for column in ("parts", "built", "reused", "rel L2", "lat x", "s"):
        table.add_column(column, justify="right")
    for m in summary["models"]:
        table.add_row(
            escape(m["name"]),
            escape(m["target"]),
            "[green]ok[/green]" if m["status"] == "ok" else "[red]failed[/red]",
            str(m["partitions"]),
            str(m["engines_built"]),
            str(m["engines_reused"]),
            f"{m['max_rel_l2']:.1e}" if m.get("max_rel_l2") is not None else "-",
            f"{m['latency_ratio']:.2f}" if m.get("latency_ratio") is not None else "-",
            f"{m['seconds']:.1f}",
        )
    return table


def _first_line(text: str | None, limit: int = 400) -> str:
    line = (text or "").strip().splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _report(summary: dict[str, Any], as_json: bool) -> int:
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
    # Builds that fell back to PyTorch are neither built nor reused: then something did happen.
    every_engine_reused = summary["engines_reused"] == sum(m["unique_engines"] for m in summary["models"])
    if summary["engines_built"] == 0 and not summary["failed"] and every_engine_reused:
        console.print("nothing changed: 0 engines built, every engine came from the cache")
    console.print(f"packages: {summary['out_dir']}   summary: {Path(summary['out_dir']) / 'summary.json'}")
    return EXIT_FAILED if summary["failed"] else EXIT_OK


ZOO_HELP = (
    "Recompile every model of a zoo file, in parallel, then print a summary table.\n\n"
    "Runs the [bold]recompile-zoo[/bold] Prefect flow in this process; Prefect starts a temporary API "
    "server unless PREFECT_API_URL points at one.\n\n"
    "A re-run with nothing changed builds no engine. One failing model does not stop the others; "
    "the exit code is 1 if any failed, 2 if the zoo file is unusable.\n\n"
    "Example:  [bold]kiln zoo deploy/zoo.yaml --out out/ --model bert --model gpt2[/bold]"
)
COMPILE_HELP = (
    "Compile one model for one target into <out>/<name>.kiln, validated against the eager model. "
    "Options override the zoo entry.\n\n"
    "Examples:  [bold]kiln compile bert --out out/[/bold]    "
    "[bold]kiln compile zoo.models:tiny_gpt2 --precision fp16 --name gpt2-fp16[/bold]"
)


@app.command("zoo", help=ZOO_HELP)
def zoo_cmd(
    zoo_file: ZooFile = Path("deploy/zoo.yaml"),
    out: OutDir = None,
    model: Annotated[
        list[str] | None, typer.Option("--model", "-m", help="only these models (repeatable), by name")
    ] = None,
    target: Targets = None,
    task_runner: TaskRunner = None,
    dask_address: DaskAddress = None,
    workspace: Workspace = None,
    engine_cache: EngineCacheDir = None,
    tracking: Tracking = None,
    check: Annotated[
        bool,
        typer.Option("--check", help="only validate the zoo file and preflight each model; build nothing"),
    ] = False,
    as_json: JsonOut = False,
    verbose: Verbose = False,
) -> None:
    _quiet_prefect(verbose)
    from flows.zoo_config import ZooConfigError, load_zoo

    try:
        zoo = load_zoo(zoo_file)
    except ZooConfigError as exc:
        raise _bad_input(str(exc)) from None
    if check:
        raise typer.Exit(_check(zoo, model, target))
    overrides = _overrides(task_runner, dask_address, workspace, engine_cache, tracking)
    selected = [n for n in zoo.names if not model or n in model]
    if model and (missing := sorted(set(model) - set(zoo.names))):
        raise _bad_input(f"--model {missing}: not in {zoo_file}; it has {zoo.names}")
    jobs = sum(
        len([t for t in e.targets if not target or t in target]) for e in zoo.entries if e.name in selected
    ) + len([i for i in zoo.invalid if i.name in selected])

    from flows import progress as events
    from flows.recompile_zoo import run_zoo

    with _progress() as bar, events.listening(_ProgressView(bar, jobs)):
        summary, error = run_zoo(
            str(zoo_file),
            str(out) if out else None,
            models=model or None,
            targets=target or None,
            settings_overrides=overrides or None,
        )
    if summary is None:
        raise _bad_input(f"the zoo run stopped before any model ran: {error}")
    code = _report(summary, as_json)
    settings = zoo.settings.model_copy(update={"tracking": overrides.get("tracking", zoo.settings.tracking)})
    if settings.tracking_enabled() and not as_json:
        # The main job ends where a user goes next: the MLflow UI and what is now registered.
        from registry.summary import print_registry_summary

        print_registry_summary(console=console)
    raise typer.Exit(code)


def _check(zoo: Any, models: list[str] | None, targets: list[str] | None) -> int:
    from flows.zoo_config import ZooConfigError, check_backend_available, check_target, resolve_factory

    problems = [(bad.name, bad.error) for bad in zoo.invalid if not models or bad.name in models]
    for entry in zoo.entries:
        if models and entry.name not in models:
            continue
        try:
            resolve_factory(entry.factory, f"models[{entry.name}].factory")
            for t in entry.targets:
                if not targets or t in targets:
                    check_target(t)
                    check_backend_available(entry.backend, t)
        except ZooConfigError as exc:
            problems.append((entry.name, str(exc)))
    for name, message in problems:
        console.print(f"[red]{escape(name)}[/red]: {escape(message)}", soft_wrap=True, highlight=False)
    ok = len([e for e in zoo.entries if not models or e.name in models]) - len(
        [p for p in problems if p[0] in {e.name for e in zoo.entries}]
    )
    console.print(f"{zoo.source}: {ok} models ready, {len(problems)} with problems")
    return EXIT_FAILED if problems else EXIT_OK


@app.command("compile", help=COMPILE_HELP)
def compile_cmd(
    model: Annotated[
        str,
        typer.Argument(
            help="a model name from the zoo file (e.g. bert) or a factory 'module:function' "
            "returning zoo.models.ModelCase (e.g. zoo.models:tiny_gpt2)"
        ),
    ],
    zoo_file: Annotated[
        Path, typer.Option("--zoo", help="zoo file to take the model and settings from")
    ] = Path("deploy/zoo.yaml"),
    out: OutDir = None,
    target: Annotated[str | None, typer.Option("--target", "-t", help="device: cpu, cuda, cuda:N")] = None,
    backend: Annotated[
        str | None, typer.Option("--backend", "-b", help="onnxruntime, tensorrt, tensorrt-rtx, auto")
    ] = None,
    precision: Annotated[str | None, typer.Option("--precision", "-p", help="fp32, fp16 or bf16")] = None,
    strip_weights: Annotated[
        bool | None,
        typer.Option("--strip-weights/--keep-weights", help="weight-stripped engines, refitted at load"),
    ] = None,
    min_block_size: Annotated[
        int | None, typer.Option("--min-block-size", help="smallest engine (ops)")
    ] = None,
    torch_executed_op: Annotated[
        list[str] | None,
        typer.Option(
            "--torch-executed-op", help="keep this op in PyTorch, e.g. aten.gelu.default (repeatable)"
        ),
    ] = None,
    on_build_failure: Annotated[
        str | None,
        typer.Option("--on-build-failure", help="a failed engine build: torch, onnxruntime or error"),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="package name (for a factory)")] = None,
    task_runner: TaskRunner = None,
    dask_address: DaskAddress = None,
    workspace: Workspace = None,
    engine_cache: EngineCacheDir = None,
    tracking: Tracking = None,
    as_json: JsonOut = False,
    verbose: Verbose = False,
) -> None:
    _quiet_prefect(verbose)
    from pydantic import ValidationError

    from flows.zoo_config import ZooConfigError, ZooEntry, ZooSettings, load_zoo

    settings, entry_data = ZooSettings(), None
    if zoo_file.exists() or ":" not in model:
        try:
            zoo = load_zoo(zoo_file)
        except ZooConfigError as exc:
            raise _bad_input(str(exc)) from None
        settings = zoo.settings
        found = [e for e in zoo.entries if e.name == model]
        invalid = [i for i in zoo.invalid if i.name == model]
        if invalid:
            raise _bad_input(invalid[0].error)
        if found:
            entry_data = found[0].model_dump()
        elif ":" not in model:
            raise _bad_input(
                f"{model!r} is not a model of {zoo_file} (it has {zoo.names}) nor a 'module:function'"
            )
    if entry_data is None:
        entry_data = {"name": name or model.rsplit(":", 1)[-1].replace("_", "-").lower(), "factory": model}
    updates = {
        "backend": backend,
        "precision": precision,
        "strip_weights": strip_weights,
        "on_build_failure": on_build_failure,
        "name": name,
    }
    entry_data.update({k: v for k, v in updates.items() if v is not None})
    if min_block_size is not None or torch_executed_op:
        part = dict(entry_data.get("partition") or {})
        if min_block_size is not None:
            part["min_block_size"] = min_block_size
        if torch_executed_op:
            part["torch_executed_ops"] = list(torch_executed_op)
        entry_data["partition"] = part
    if target:
        entry_data["targets"] = [target]
    try:
        entry = ZooEntry.model_validate(entry_data)
        settings = ZooSettings.model_validate(
            {
                **settings.model_dump(),
                **_overrides(task_runner, dask_address, workspace, engine_cache, tracking),
            }
        )
    except ValidationError as exc:
        from flows.zoo_config import _format_errors

        raise _bad_input(_format_errors(exc, "options")) from None
    out_dir = str((out or Path(settings.out_dir)).resolve())

    from flows import progress as events
    from flows.compile_model import ModelResult, compile_model
    from flows.runners import task_runner_for

    chosen = entry.targets[0]
    start_summary: dict[str, Any]
    with _progress() as bar, events.listening(_ProgressView(bar, 1)):
        state = compile_model.with_options(task_runner=task_runner_for(settings))(
            entry=entry, target=chosen, out_dir=out_dir, settings=settings, return_state=True
        )
        if state.is_completed():
            result = state.result()
        else:
            exc = state.result(raise_on_failure=False)
            message = f"{type(exc).__name__}: {exc}" if isinstance(exc, BaseException) else str(state.message)
            result = ModelResult(entry.name, chosen, "failed", error=message)
            events.emit("failed", entry.name, chosen, message)
    start_summary = {
        "out_dir": out_dir,
        "ok": int(result.status == "ok"),
        "failed": int(result.status != "ok"),
        "engines_built": result.engines_built,
        "engines_reused": result.engines_reused,
        "seconds": result.seconds,
        "models": [result.to_dict()],
    }
    if result.status != "ok":
        console.print(f"[red]{entry.name} failed:[/red] {escape(result.error or '')}", soft_wrap=True)
    raise typer.Exit(_report(start_summary, as_json))


DEPLOY_HELP = (
    "Register the deployments of a prefect.yaml (default deploy/prefect.yaml: the nightly zoo recompile "
    "per device) on the Prefect server at PREFECT_API_URL; re-running updates them.\n\n"
    "Then start a worker for each pool:  [bold]prefect worker start --pool kiln-cpu[/bold]"
)


@app.command("deploy", help=DEPLOY_HELP)
def deploy_cmd(
    prefect_file: Annotated[Path, typer.Argument(help="the prefect.yaml to register")] = Path(
        "deploy/prefect.yaml"
    ),
    name: Annotated[
        list[str] | None, typer.Option("--name", "-n", help="only these deployments (repeatable)")
    ] = None,
    repo: Annotated[
        Path | None,
        typer.Option("--repo", help="checkout the workers run from (sets $KILN_REPO; default: current dir)"),
    ] = None,
    verbose: Verbose = False,
) -> None:
    _quiet_prefect(verbose)
    from prefect.settings import PREFECT_API_URL

    from flows.deployments import register
    from flows.zoo_config import ZooConfigError

    if not PREFECT_API_URL.value():
        raise _bad_input(
            "PREFECT_API_URL is not set: deployments need a running server. Start one "
            "(prefect server start) and export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    os.environ["KILN_REPO"] = str((repo or Path(os.environ.get("KILN_REPO") or Path.cwd())).resolve())
    try:
        registered = register(prefect_file, name or None)
    except ZooConfigError as exc:
        raise _bad_input(str(exc)) from None
    for full_name, deployment_id in registered.items():
        console.print(f"registered [bold]{escape(full_name)}[/bold] ({deployment_id})")
    console.print(f"run one now:  prefect deployment run {next(iter(registered), 'recompile-zoo/<name>')}")


try:
    from flows.registry_cli import register_commands
except ModuleNotFoundError as _exc:  # only while the registry half does not exist yet
    if _exc.name != "flows.registry_cli":
        raise
else:
    register_commands(app)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
