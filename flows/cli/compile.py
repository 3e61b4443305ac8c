"""``kiln zoo`` and ``kiln compile``: compile a whole zoo, or one model, into validated packages.

Exit codes, for scripts: 0 every model compiled and validated; 1 at least one model failed (the
summary names each failure); 2 the input was unusable (a broken zoo file, a bad option).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from flows.cli.options import (
    Backend,
    BackendOption,
    CalibrationData,
    CalibrationMethod,
    CalibrationSamples,
    Check,
    CompileModel,
    CompileZooFile,
    CudaGraphs,
    DaskAddress,
    Device,
    DeviceAsTarget,
    Devices,
    DevicesAsTarget,
    EngineCacheDir,
    JsonOut,
    MinBlockSize,
    Model,
    Name,
    OnAccuracyFailure,
    OnBuildFailure,
    OptimizationLevel,
    OutDir,
    PadToProfile,
    Precision,
    Profile,
    Quantization,
    Revision,
    SplitModule,
    StripWeights,
    Task,
    TaskRunner,
    TorchExecutedOp,
    Tracking,
    TrustRemoteCode,
    ValidationData,
    Verbose,
    Workspace,
    WorkspaceBytes,
    ZooFile,
    bad_input,
    devices_with_deprecated_target,
    parse_backend_options,
    parse_profiles,
    quiet_prefect,
)
from flows.render import (
    EXIT_FAILED,
    EXIT_OK,
    ProgressView,
    console,
    progress_bar,
    report,
)

if TYPE_CHECKING:
    from zoo.settings import ZooSettings

# Only typer and rich at the top: `kiln --help` answers without torch, Prefect or MLflow (issue 21);
# each command imports what it uses.


def _check_environment() -> None:
    """Settings read from the environment, checked before anything runs (a typo is exit code 2)."""
    from compiler.cache.entry import resolve_max_bytes
    from compiler.errors import CacheError, ValidationDataError
    from compiler.inputs.files import data_max_bytes
    from zoo.errors import ZooConfigError

    try:
        resolve_max_bytes(None)
        data_max_bytes()
    except (CacheError, ValidationDataError) as exc:
        raise ZooConfigError(str(exc)) from None


def _check_writable(out_dir: str, workspace: str) -> None:
    """Where packages and stage outputs go must be writable: else exit 2 before any model is read."""
    from zoo.errors import ZooConfigError
    from zoo.preflight import check_out_dir, check_workspace

    try:
        check_out_dir(out_dir)
        check_workspace(workspace)
    except ZooConfigError as exc:
        raise bad_input(str(exc)) from None


def _overrides(
    task_runner: str | None,
    dask_address: str | None,
    workspace: Path | None,
    engine_cache: str | None,
    tracking: bool | None,
) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if dask_address:
        task_runner = task_runner or "dask"
        overrides["dask"] = {"address": dask_address}
    if task_runner:
        if task_runner not in ("thread", "dask"):
            raise bad_input(f"--task-runner {task_runner!r}: use 'thread' or 'dask'")
        overrides["task_runner"] = task_runner
    if workspace:
        overrides["workspace"] = str(workspace)
    if engine_cache:
        overrides["engine_cache"] = str(engine_cache)
    if tracking is not None:
        overrides["tracking"] = tracking
    return overrides


ZOO_HELP = (
    "Recompile every model of a zoo file, in parallel, then print a summary table.\n\n"
    "Runs the [bold]recompile-zoo[/bold] Prefect flow in this process; Prefect starts a temporary API "
    "server unless PREFECT_API_URL points at one.\n\n"
    "A re-run with nothing changed builds no engine. One failing model does not stop the others; "
    "the exit code is 1 if any failed, 2 if the zoo file is unusable.\n\n"
    "Example:  [bold]kiln zoo deploy/zoo.yaml --out out/ --model bert --model gpt2[/bold]"
)
COMPILE_HELP = (
    "Compile one model for one device into <out>/<name>.kiln, validated against the eager model. "
    "Options override the zoo entry.\n\n"
    "Examples:  [bold]kiln compile bert --out out/[/bold]    "
    "[bold]kiln compile zoo.models:tiny_gpt2 --precision fp16 --name gpt2-fp16[/bold]"
)


def _selected_requests(zoo: Any, models: list[str] | None, devices: list[str] | None) -> list[Any]:
    return [
        request
        for entry in zoo.entries
        if not models or entry.name in models
        for request in zoo.requests(entry)
        if not devices or request.device in devices
    ]


def _run_with_progress(jobs: int, run: Any) -> tuple[dict[str, Any] | None, BaseException | None]:
    from flows import progress as events
    from flows.server import prefect_api

    with prefect_api(), progress_bar() as bar, events.listening(ProgressView(bar, jobs)):
        return run()


def _unchanged_summary(requests: list[Any], out_dir: str, settings: ZooSettings, zoo: str) -> dict | None:
    """The summary of a run in which every request is unchanged (see tasks.reuse), else None.

    Checked before any Prefect server starts: an unchanged zoo costs a hash per model.
    """
    import time

    from flows.results import reuse_unchanged, write_summary

    start = time.perf_counter()
    fresh, results = reuse_unchanged(requests, out_dir, settings, [])
    if fresh or not results:
        return None
    return write_summary(results, out_dir, settings, time.perf_counter() - start, zoo=zoo)


def _finish(summary: dict[str, Any], as_json: bool, tracking: bool) -> None:
    code = report(summary, as_json)
    if tracking and not as_json:
        # The main job ends where a user goes next: the MLflow UI and what is now registered.
        from registry.summary import print_registry_summary

        print_registry_summary(console=console)
    raise typer.Exit(code)


def zoo_cmd(
    zoo_file: ZooFile = Path("deploy/zoo.yaml"),
    out: OutDir = None,
    model: Model = None,
    device: Devices = None,
    device_as_target: DevicesAsTarget = None,
    task_runner: TaskRunner = None,
    dask_address: DaskAddress = None,
    workspace: Workspace = None,
    engine_cache: EngineCacheDir = None,
    tracking: Tracking = None,
    check: Check = False,
    as_json: JsonOut = False,
    verbose: Verbose = False,
) -> None:
    quiet_prefect(verbose)
    device = devices_with_deprecated_target("zoo", device, device_as_target)
    from pydantic import ValidationError

    from zoo.errors import ZooConfigError
    from zoo.last_run import record_zoo_file
    from zoo.zoo_file import format_errors as _format_errors
    from zoo.zoo_file import load_zoo

    try:
        _check_environment()
        zoo = load_zoo(zoo_file)
    except ZooConfigError as exc:
        raise bad_input(str(exc)) from None
    if model and (missing := sorted(set(model) - set(zoo.names))):
        raise bad_input(f"--model {missing}: not in {zoo_file}; it has {zoo.names}")
    overrides = _overrides(task_runner, dask_address, workspace, engine_cache, tracking)
    try:
        settings = zoo.settings.with_overrides(overrides)
        _engine_cache_usable(settings.engine_cache_dir())
    except ValidationError as exc:
        raise bad_input(_format_errors(exc, "options")) from None
    except ZooConfigError as exc:
        raise bad_input(str(exc)) from None
    if check:
        raise typer.Exit(_check(zoo, model, device, settings.engine_cache_dir(), settings.workspace))
    requests = _selected_requests(zoo, model, device)
    invalid = [i for i in zoo.invalid if not model or i.name in model]
    out_dir = str(Path(out or settings.out_dir).resolve())
    _check_writable(out_dir, settings.workspace)
    # kiln release MODEL, later in this directory, rebuilds the original from this file's entry.
    try:
        record_zoo_file(zoo_file)
    except OSError as exc:  # the run goes on; kiln release then needs --zoo
        console.print(f"[yellow]warning:[/yellow] {escape(str(exc))}: release with --zoo", soft_wrap=True)
    if not invalid:
        summary = _unchanged_summary(requests, out_dir, settings, str(zoo_file))
        if summary is not None:
            _finish(summary, as_json, settings.tracking_enabled())

    from flows.recompile_zoo import run_zoo

    summary, error = _run_with_progress(
        len(requests) + len(invalid),
        lambda: run_zoo(
            str(zoo_file),
            str(out) if out else None,
            models=model or None,
            devices=device or None,
            settings_overrides=overrides or None,
        ),
    )
    if summary is None:
        # Named by type too: some errors carry no message (one CI run printed only the colon).
        reason = f"{type(error).__name__}: {error}" if error is not None else "no reason given"
        raise bad_input(f"the zoo run stopped before any model ran: {reason}")
    _finish(summary, as_json, settings.tracking_enabled())


def _engine_cache_usable(location: str | None) -> None:
    """An object-store URL whose fsspec driver is missing (or a bad location) is unusable input."""
    from compiler.cache.local import EngineCache
    from compiler.errors import CacheError
    from zoo.errors import ZooConfigError

    if location and "://" in location:
        try:
            EngineCache(location)
        except CacheError as exc:
            raise ZooConfigError(str(exc)) from None


def _check(
    zoo: Any,
    models: list[str] | None,
    devices: list[str] | None,
    cache: str | None = None,
    workspace: str | None = None,
) -> int:
    """The flows' own preflight for every selected request, sizing the largest inputs, a probe of
    an object-store engine cache (reachable, credentials accepted, writable) and of the workspace."""
    from zoo.errors import ZooConfigError
    from zoo.preflight import check_workspace, preflight

    problems = [(bad.name, bad.error) for bad in zoo.invalid if not models or bad.name in models]
    if workspace is not None:
        try:
            check_workspace(workspace)
        except ZooConfigError as exc:
            problems.append(("workspace", str(exc)))
    if cache and "://" in cache:
        from compiler.cache.local import EngineCache
        from compiler.errors import CacheError

        try:
            remote = EngineCache(cache).remote
            access = remote.check() if remote is not None else "local"
        except CacheError as exc:
            problems.append(("engine cache", str(exc)))
        else:
            note = f" ({remote.write_problem})" if remote is not None and remote.write_problem else ""
            console.print(
                f"engine cache {escape(cache)}: {access}{escape(note)}", soft_wrap=True, highlight=False
            )
    requests = _selected_requests(zoo, models, devices)
    for request in requests:
        try:
            preflight(request, load=True)
        except ZooConfigError as exc:
            problems.append((request.package_name, str(exc)))
    for name, message in problems:
        console.print(f"[red]{escape(name)}[/red]: {escape(message)}", soft_wrap=True, highlight=False)
    bad = {name for name, _ in problems}
    ok = len([r for r in requests if r.package_name not in bad])
    console.print(f"{zoo.source}: {ok} models ready, {len(problems)} with problems")
    return EXIT_FAILED if problems else EXIT_OK


def _entry_for_source(text: str) -> dict[str, Any]:
    """A new entry for a source string (hf:..., pt2:..., models:/..., factory:...) or a bare factory."""
    from zoo.sources import default_name, source_kind

    try:
        source_kind(text)
    except ValueError:  # not a source string: the older 'module:function' factory form
        return {"name": text.rsplit(":", 1)[-1].replace("_", "-").lower(), "factory": text}
    return {"name": default_name(text), "source": text}


def _entry_from_flags(zoo_file: Path, model: str, flags: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
    """(entry data, settings, zoo dir): the zoo file's entry named ``model`` (or a new one for a factory)
    with the flags written over it, so flags and zoo fields go through one schema."""
    from zoo.errors import ZooConfigError
    from zoo.settings import ZooSettings
    from zoo.zoo_file import load_zoo

    settings, entry_data, zoo_dir = ZooSettings(), None, None
    if zoo_file.exists() or ":" not in model:
        try:
            zoo = load_zoo(zoo_file)
        except ZooConfigError as exc:
            raise bad_input(str(exc)) from None
        settings, zoo_dir = zoo.settings, zoo.zoo_dir
        invalid = [i for i in zoo.invalid if i.name == model]
        if invalid:
            raise bad_input(invalid[0].error)
        found = [e for e in zoo.entries if e.name == model]
        if found:
            entry_data = found[0].model_dump(exclude_unset=True)
        elif ":" not in model:
            raise bad_input(
                f"{model!r} is not a model of {zoo_file} (it has {zoo.names}) nor a 'module:function'"
            )
    if entry_data is None:
        entry_data = _entry_for_source(model)
    partition = {
        k: flags.pop(k) for k in ("min_block_size", "torch_executed_ops", "split_modules") if k in flags
    }
    if partition:
        entry_data["partition"] = {**(entry_data.get("partition") or {}), **partition}
    if "devices" in flags:
        entry_data.pop("targets", None)
    entry_data.update(flags)
    return entry_data, settings, zoo_dir


def compile_cmd(
    model: CompileModel,
    zoo_file: CompileZooFile = Path("deploy/zoo.yaml"),
    out: OutDir = None,
    device: Device = None,
    device_as_target: DeviceAsTarget = None,
    backend: Backend = None,
    precision: Precision = None,
    quantization: Quantization = None,
    calibration_data: CalibrationData = None,
    calibration_samples: CalibrationSamples = None,
    calibration_method: CalibrationMethod = None,
    strip_weights: StripWeights = None,
    min_block_size: MinBlockSize = None,
    torch_executed_op: TorchExecutedOp = None,
    split_module: SplitModule = None,
    workspace_bytes: WorkspaceBytes = None,
    optimization_level: OptimizationLevel = None,
    backend_option: BackendOption = None,
    on_build_failure: OnBuildFailure = None,
    name: Name = None,
    task: Task = None,
    revision: Revision = None,
    trust_remote_code: TrustRemoteCode = None,
    on_accuracy_failure: OnAccuracyFailure = None,
    cuda_graphs: CudaGraphs = None,
    profile: Profile = None,
    pad_to_profile: PadToProfile = None,
    validation_data: ValidationData = None,
    task_runner: TaskRunner = None,
    dask_address: DaskAddress = None,
    workspace: Workspace = None,
    engine_cache: EngineCacheDir = None,
    tracking: Tracking = None,
    as_json: JsonOut = False,
    verbose: Verbose = False,
) -> None:
    quiet_prefect(verbose)
    device = devices_with_deprecated_target("compile", device, device_as_target)
    from pydantic import ValidationError

    from zoo.config import ZooEntry
    from zoo.errors import ZooConfigError
    from zoo.zoo_file import format_errors as _format_errors

    flags = {
        "backend": backend,
        "precision": precision,
        "strip_weights": strip_weights,
        "on_build_failure": on_build_failure,
        "name": name,
        "min_block_size": min_block_size,
        "torch_executed_ops": list(torch_executed_op) if torch_executed_op else None,
        "split_modules": list(split_module) if split_module else None,  # ["auto"]: the zoo schema's rule
        "workspace_bytes": workspace_bytes,
        "optimization_level": optimization_level,
        "backend_options": parse_backend_options(backend_option),
        "devices": [device] if device else None,
        "task": task,
        "revision": revision,
        "trust_remote_code": trust_remote_code,
        "on_accuracy_failure": on_accuracy_failure,
        "cuda_graphs": cuda_graphs,
        "profiles": parse_profiles(profile),
        "pad_to_profile": pad_to_profile,
        "validation": {"data": str(validation_data.resolve())} if validation_data else None,
        "quantization": quantization,
        "calibration": {
            k: v
            for k, v in {
                "data": str(calibration_data.resolve()) if calibration_data else None,
                "samples": calibration_samples,
                "method": calibration_method,
            }.items()
            if v is not None
        }
        or None,
    }
    try:
        _check_environment()
        entry_data, settings, zoo_dir = _entry_from_flags(
            zoo_file, model, {k: v for k, v in flags.items() if v is not None}
        )
        entry = ZooEntry.model_validate(entry_data)
        settings = settings.with_overrides(
            _overrides(task_runner, dask_address, workspace, engine_cache, tracking)
        )
        request = entry.requests(settings, zoo_dir)[0]
    except ValidationError as exc:
        raise bad_input(_format_errors(exc, "options")) from None
    except ZooConfigError as exc:
        raise bad_input(str(exc)) from None
    out_dir = str((out or Path(settings.out_dir)).resolve())
    _check_writable(out_dir, settings.workspace)
    summary = _unchanged_summary([request], out_dir, settings, str(zoo_file))
    if summary is not None:
        _finish(summary, as_json, settings.tracking_enabled())

    from flows.compile_model import compile_model
    from flows.results import ModelResult, write_summary
    from flows.runners import task_runner_for

    def run() -> tuple[dict[str, Any], None]:
        from flows import progress as events

        state = compile_model.with_options(task_runner=task_runner_for(settings))(
            request=request, out_dir=out_dir, settings=settings, return_state=True
        )
        if state.is_completed():
            result = state.result()
        else:
            exc = state.result(raise_on_failure=False)
            message = f"{type(exc).__name__}: {exc}" if isinstance(exc, BaseException) else str(state.message)
            result = ModelResult(request.name, request.device, "failed", error=message)
            result.precision = request.options.precision  # what was asked (the prec column)
            events.emit("failed", request.name, request.device, message)
        return write_summary([result], out_dir, settings, 0.0, zoo=str(zoo_file)), None

    summary, _ = _run_with_progress(1, run)
    _finish(summary, as_json, settings.tracking_enabled())


def register_commands(app: typer.Typer) -> None:
    """Add ``zoo`` and ``compile`` to the ``kiln`` CLI."""
    app.command("zoo", help=ZOO_HELP)(zoo_cmd)
    app.command("compile", help=COMPILE_HELP)(compile_cmd)
