"""``recompile_zoo``: every model of a zoo file, in parallel; one model's failure never stops the others.

load + validate the zoo file -> one compile request per (model, device) -> preflight every request
before any build -> set the build concurrency limits -> compile_model per request, in parallel
-> summary artifact + JSON
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import allow_failure, flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from compiler import json_reader
from compiler.errors import KilnError
from flows import progress
from flows.compile_model import compile_model, preflight
from flows.results import SUMMARY_FILE, ModelResult, reuse_unchanged, write_summary
from flows.runners import (
    PromptThreadPoolTaskRunner,
    ensure_build_limits,
    shared_dask_cluster,
    task_runner_for,
)
from zoo.preflight import check_workspace
from zoo.request import CompileRequest
from zoo.settings import ZooSettings
from zoo.zoo_file import load_zoo

SUMMARY_ARTIFACT = "zoo-summary"


class ZooRunError(KilnError):
    """At least one model of the zoo failed; the summary names each failure and its message."""


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@task(name="compile-one", cache_policy=NO_CACHE, persist_result=False, task_run_name="{request.package_name}")
def compile_one(
    request: CompileRequest,
    out_dir: str,
    settings: ZooSettings,
    dask_address: str | None,
    parent_run_id: str | None = None,
) -> ModelResult:
    """One model as its own flow run; its failure becomes a failed row, not a failed zoo run."""
    start = time.perf_counter()
    try:
        runner = task_runner_for(settings, dask_address)
        return compile_model.with_options(task_runner=runner)(
            request=request, out_dir=out_dir, settings=settings, parent_run_id=parent_run_id
        )
    except Exception as exc:
        get_run_logger().error("%s on %s failed: %s", request.name, request.device, _error_text(exc))
        progress.emit("failed", request.name, request.device, _error_text(exc))
        return ModelResult(
            request.name,
            request.device,
            "failed",
            error=_error_text(exc),
            seconds=round(time.perf_counter() - start, 2),
            precision=request.options.precision,  # what was asked: the row says fp16 failed, not fp32
        )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_rows(results: list[ModelResult]) -> list[dict[str, Any]]:
    return [
        {
            "model": r.name,
            "device": r.device,
            "status": r.status,
            "partitions": r.partitions,
            "engines": r.unique_engines,
            "built": r.engines_built,
            "reused": r.engines_reused,
            "rel_l2": _fmt(r.max_rel_l2, ".2e"),
            "latency_ratio": _fmt(r.latency_ratio, ".2f"),
            "seconds": r.seconds,
            "package_or_error": r.package if r.status == "ok" else r.error,
        }
        for r in results
    ]


def summary_markdown(results: list[ModelResult], seconds: float) -> str:
    ok = [r for r in results if r.status == "ok"]
    lines = [
        f"# Zoo recompile: {len(ok)} of {len(results)} ok, "
        f"{sum(r.engines_built for r in results)} engines built, "
        f"{sum(r.engines_reused for r in results)} reused, {seconds:.1f}s",
        "",
        "| model | device | status | partitions | engines built / reused | rel L2 | latency ratio | s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.device} | {r.status} | {r.partitions} | {r.engines_built} / {r.engines_reused} "
            f"| {_fmt(r.max_rel_l2, '.2e')} | {_fmt(r.latency_ratio, '.2f')} | {r.seconds} |"
        )
    failed = [r for r in results if r.status != "ok"]
    if failed:
        lines += ["", "## Failures", ""] + [f"- **{r.name}** ({r.device}): {r.error}" for r in failed]
    if ok:
        lines += ["", "## Packages", ""] + [f"- {r.name}: `{r.package}`" for r in ok]
    return "\n".join(lines)


def _open_zoo_run(settings: ZooSettings, zoo_path: str) -> str | None:
    if not settings.tracking_enabled():
        return None
    from prefect.runtime import flow_run

    from registry.zoo_runs import start_zoo_run

    return start_zoo_run(f"zoo-{str(flow_run.id)[:8]}", {"zoo": str(zoo_path)})


@flow(name="recompile-zoo", log_prints=True, task_runner=PromptThreadPoolTaskRunner())
def recompile_zoo(
    zoo_path: str = "deploy/zoo.yaml",
    out_dir: str | None = None,
    models: list[str] | None = None,
    devices: list[str] | None = None,
    settings_overrides: dict[str, Any] | None = None,
    fail_on_error: bool = True,
) -> dict[str, Any]:
    """Compile every model of ``zoo_path`` (or only ``models``, only on ``devices``) into ``out_dir``.

    Writes ``<out_dir>/summary.json`` and a ``zoo-summary`` table artifact. Fails (after writing both)
    when any model failed, unless ``fail_on_error`` is false.
    """
    start = time.perf_counter()
    logger = get_run_logger()
    zoo = load_zoo(zoo_path)
    settings = zoo.settings.with_overrides(settings_overrides)
    out = str(Path(out_dir or settings.out_dir).resolve())
    check_workspace(settings.workspace)  # every model writes there: one clear failure, before any model
    if models:
        unknown = sorted(set(models) - set(zoo.names))
        if unknown:
            raise ZooRunError(f"models {unknown} are not in {zoo_path}; it has {zoo.names}")

    def selected(name: str) -> bool:
        return not models or name in models

    results: list[ModelResult] = [
        ModelResult(bad.name, "-", "failed", error=f"ZooConfigError: {bad.error}")
        for bad in zoo.invalid
        if selected(bad.name)
    ]
    jobs = [
        request
        for entry in zoo.entries
        if selected(entry.name)
        for request in entry.requests(settings, zoo.zoo_dir)
        if not devices or request.device in devices
    ]
    # Unchanged models (same source identity, request and kiln; package in place) cost a hash.
    jobs, results = reuse_unchanged(jobs, out, settings, results)
    # Every check that needs no build runs for every model first, so bad input fails in seconds.
    checks = [preflight.submit(request) for request in jobs]
    runnable = []
    for request, check in zip(jobs, checks, strict=True):
        state = check.wait() or check.state
        if state.is_completed():
            runnable.append(request)
        else:
            exc = state.result(raise_on_failure=False)
            failed = ModelResult(request.name, request.device, "failed", error=_error_text(exc))
            failed.precision = request.options.precision
            results.append(failed)
            progress.emit("failed", request.name, request.device, _error_text(exc))

    if runnable:
        limits = ensure_build_limits(settings, {r.device for r in runnable})
        logger.info("engine build limits: %s", limits)
    # The MLflow parent run of this zoo run, opened once: every model's run nests under it.
    zoo_run = _open_zoo_run(settings, zoo_path) if runnable else None
    zoo_run_status = "FAILED"  # unless every model ends ok; a kill leaves it for the next run to end
    try:
        with shared_dask_cluster(settings) as address:
            # At most parallel_models at once: model i starts when model i - parallel_models has ended.
            futures: list[Any] = []
            for i, request in enumerate(runnable):
                after = (
                    [allow_failure(futures[i - settings.parallel_models])]
                    if i >= settings.parallel_models
                    else []
                )
                futures.append(compile_one.submit(request, out, settings, address, zoo_run, wait_for=after))
            results += [f.result() for f in futures]
        if all(r.status == "ok" for r in results):
            zoo_run_status = "FINISHED"
    finally:
        if zoo_run is not None:
            from registry.zoo_runs import end_run

            end_run(zoo_run, zoo_run_status)

    order = {name: i for i, name in enumerate(zoo.names)}
    results.sort(key=lambda r: (order.get(r.name, len(order)), r.device))
    seconds = time.perf_counter() - start
    summary = write_summary(results, out, settings, seconds, zoo=str(zoo_path))
    create_table_artifact(
        key=SUMMARY_ARTIFACT, table=summary_rows(results), description=f"zoo recompile of {zoo_path}"
    )
    create_markdown_artifact(key=f"{SUMMARY_ARTIFACT}-report", markdown=summary_markdown(results, seconds))
    every_engine_reused = summary["engines_reused"] == sum(r.unique_engines for r in results)
    if summary["engines_built"] == 0 and summary["failed"] == 0 and every_engine_reused:
        logger.info("nothing changed: every engine came from the cache, 0 built")
    if fail_on_error and summary["failed"]:
        names = ", ".join(f"{r.name} ({r.error})" for r in results if r.status != "ok")
        raise ZooRunError(f"{summary['failed']} of {len(results)} models failed: {names}")
    return summary


def run_zoo(
    zoo_path: str,
    out_dir: str | None = None,
    *,
    models: list[str] | None = None,
    devices: list[str] | None = None,
    settings_overrides: dict[str, Any] | None = None,
) -> tuple[dict[str, Any] | None, BaseException | None]:
    """Run the flow in this process with the zoo's parallelism; returns (summary or None, error or None).

    The summary comes from ``summary.json`` so it is there even when the flow ends failed.
    """
    zoo = load_zoo(zoo_path)  # a broken file fails here, before Prefect starts
    settings = zoo.settings.with_overrides(settings_overrides)
    out = str(Path(out_dir or settings.out_dir).resolve())
    summary_file = Path(out) / SUMMARY_FILE
    summary_file.unlink(missing_ok=True)
    state = recompile_zoo(
        zoo_path=zoo_path,
        out_dir=out,
        models=models,
        devices=devices,
        settings_overrides=settings_overrides,
        return_state=True,
    )
    error = None
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        if not isinstance(error, BaseException):
            error = ZooRunError(state.message or "the zoo run failed")
    summary = json_reader.read_file(summary_file) if summary_file.exists() else None
    return summary, error
