"""``compile_model``: one compile request (one model, one device) -> one validated package.

preflight -> resolve the source (identity, no load) -> export -> partition + dedup -> build engines
(one per unique structure, in parallel) -> assemble + refit -> validate -> package -> record in MLflow
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import flow, get_run_logger, task, unmapped
from prefect.cache_policies import NO_CACHE

from compiler.accuracy.mixed import ended_precision, precision_warning
from compiler.validation.report import precision_summary
from flows import progress
from flows.results import ModelResult, package_path
from tasks.refs import EngineRef
from tasks.reuse import PublishedRecord, remember
from tasks.stages import configured
from zoo.preflight import preflight as check_request
from zoo.request import CompileRequest
from zoo.settings import ZooSettings

if TYPE_CHECKING:  # mlflow is imported only where tracking is on
    from registry.transfer import Progress


@task(name="preflight", cache_policy=NO_CACHE, persist_result=False)
def preflight(request: CompileRequest) -> None:
    """Everything that can be checked before any engine is built: source, device, backend."""
    check_request(request)


def _tracking_task():
    from tasks.registry import record_package

    return record_package


@flow(
    name="compile-model",
    flow_run_name="compile-{request.package_name}",
    log_prints=True,
    validate_parameters=False,  # a CompileRequest is validated once, where it is made
)
def compile_model(
    request: CompileRequest,
    out_dir: str = "out",
    settings: ZooSettings | None = None,
    parent_run_id: str | None = None,
) -> ModelResult:
    """Compile one request into ``<out_dir>/<package name>.kiln``, validated against eager.

    ``parent_run_id``: the MLflow run of the zoo run this compile belongs to (recorded runs nest there).
    """
    settings = settings or ZooSettings()
    start = time.perf_counter()
    logger = get_run_logger()
    name, device = request.name, request.device
    workspace = str(Path(settings.workspace).resolve())
    engine_cache = settings.engine_cache_dir()
    stages = configured(device, retries=settings.build_retries, backoff=settings.build_retry_backoff)
    progress.emit("model", name, device, "preflight")
    preflight(request)

    if request.generation is not None:  # two programs, checked against eager generate together
        from flows.generation import compile_generation

        done = compile_generation(request, stages, workspace, engine_cache, out_dir)
        plan, engines, validated, package = done.plan, done.engines, done.validated, done.package
        validation = validated.report
    else:
        progress.emit("model", name, device, "export")
        key = stages.resolve_source(request)
        program = stages.export_program(request, key, workspace)
        progress.emit("model", name, device, "partition")
        plan = stages.partition_program(program, request.options, workspace)

        progress.emit("model", name, device, f"build {len(plan.fingerprints)} engines")
        builds = stages.build_engine.map(
            unmapped(plan), plan.fingerprints, unmapped(workspace), unmapped(engine_cache)
        )
        engines: list[EngineRef] = [b.result() for b in builds]

        progress.emit("model", name, device, "assemble")
        staged = stages.assemble_engines(plan, engines, workspace)
        progress.emit("model", name, device, "validate")
        validated = stages.validate_package(request, staged, workspace, engine_cache)
        validation = validated.report
        progress.emit("model", name, device, "package")
        package = stages.package_model(
            validated, package_path(out_dir, request), workspace, request.identity()
        )

    tracking = None
    if settings.tracking_enabled():
        progress.emit("model", name, device, "upload")

        def uploading(p: Progress) -> None:  # the CLI's row for this model shows the bytes as they go
            progress.emit("model", name, device, f"upload {p.done / 1e6:.1f}/{p.total / 1e6:.1f} MB")

        tracking = _tracking_task()(
            package.run_copy, request, parent_run_id=parent_run_id, on_progress=uploading
        )
    shutil.rmtree(Path(package.run_copy).parent, ignore_errors=True)  # recorded (or not wanted): done

    # A model left at another precision than asked (layers or partitions raised by repair) is a
    # warning in the summary and the log, not only a number in the report.
    repaired = validated.staged.report.accuracy_repair
    ended = ended_precision(
        precision_summary(validation.precision_plan) or request.options.precision, repaired
    )
    asked = precision_warning(repaired, request.options.precision, ended)
    mixed = [asked] if asked else []
    if asked:
        logger.warning("%s: %s", name, asked)
    # Reused: from the workspace or the persistent engine cache. A build that fell back to PyTorch built
    # nothing (the compile report lists it under build_failures).
    reused = sum(1 for e in engines if e.cache_hit)
    fell_back = sum(1 for e in engines if e.backend == "torch" and not e.cache_hit)
    built = len(engines) - reused - fell_back
    if built == 0:
        logger.info("%s: nothing to build, %d engines reused", name, reused)
    result = ModelResult(
        name=name,
        device=device,
        status="ok",
        package=package.path,
        content_hash=package.content_hash,
        partitions=plan.partitions,
        unique_engines=len(engines),
        engines_built=built,
        engines_reused=reused,
        fallback_ops=dict(plan.fallback_ops),
        max_rel_l2=validation.max_rel_l2,
        latency_ratio=validation.latency_ratio,
        seconds=round(time.perf_counter() - start, 2),
        tracking=tracking if isinstance(tracking, dict) else None,
        build_workers=sorted({e.worker for e in engines}),
        engine_cache=engine_cache,
        warnings=sorted({w for e in engines for w in e.warnings}) + mixed,
        precision=ended,
    )
    remember(
        request,
        workspace,
        PublishedRecord(
            package.path,
            package.content_hash,
            plan.partitions,
            len(engines),
            dict(plan.fallback_ops),
            validation.max_rel_l2,
            validation.latency_ratio,
            result.tracking,
            result.precision,
        ),
    )
    progress.emit("done", name, device, "ok")
    return result
