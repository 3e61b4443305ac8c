"""``compile_model``: one model, one target device -> one validated package.

preflight -> fingerprint -> export -> partition + dedup -> build engines (one per unique structure,
in parallel) -> assemble + refit -> validate -> package -> record in MLflow (when tracking is on)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger, task, unmapped
from prefect.cache_policies import NO_CACHE

from flows import progress
from flows.zoo_config import ZooEntry, ZooSettings, check_backend_available, check_target, resolve_factory
from tasks.stages import EngineRef, configured


@dataclass
class ModelResult:
    """One row of a zoo summary: what happened to one model on one target."""

    name: str
    target: str
    status: str  # "ok" | "failed"
    error: str | None = None
    package: str | None = None
    content_hash: str | None = None
    partitions: int = 0
    unique_engines: int = 0
    engines_built: int = 0
    engines_reused: int = 0
    fallback_ops: dict[str, int] = field(default_factory=dict)
    max_rel_l2: float | None = None
    latency_ratio: float | None = None
    seconds: float = 0.0
    tracking: dict | None = None
    build_workers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def package_path(out_dir: str, entry: ZooEntry, target: str) -> str:
    """``<out>/<name>.kiln``; with several targets ``<out>/<name>-<device>.kiln`` (engines are per device)."""
    suffix = "" if len(entry.targets) == 1 else "-" + target.replace(":", "")
    return str(Path(out_dir) / f"{entry.name}{suffix}.kiln")


@task(name="preflight", cache_policy=NO_CACHE, persist_result=False)
def preflight(entry: ZooEntry, target: str) -> None:
    """Everything that can be checked before any engine is built: factory, backend, device."""
    resolve_factory(entry.factory, f"models[{entry.name}].factory")
    check_target(target)
    check_backend_available(entry.backend, target)


def _tracking_task():
    from tasks.registry import record_package

    return record_package


@flow(name="compile-model", flow_run_name="compile-{entry.name}-{target}", log_prints=True)
def compile_model(
    entry: ZooEntry,
    target: str = "cpu",
    out_dir: str = "out",
    settings: ZooSettings | None = None,
) -> ModelResult:
    """Compile one zoo entry for one target into ``<out_dir>/<name>.kiln``, validated against eager."""
    settings = settings or ZooSettings()
    start = time.perf_counter()
    logger = get_run_logger()
    workspace = str(Path(settings.workspace).resolve())
    engine_cache = str(Path(settings.engine_cache).resolve()) if settings.engine_cache else None
    stages = configured(
        workspace, target, retries=settings.build_retries, backoff=settings.build_retry_backoff
    )
    progress.emit("model", entry.name, target, "preflight")
    preflight(entry, target)

    progress.emit("model", entry.name, target, "export")
    key = stages.fingerprint_model(entry)
    program = stages.export_program(entry, key, workspace)
    progress.emit("model", entry.name, target, "partition")
    plan = stages.partition_program(program, entry.compile_options(), workspace)

    progress.emit("model", entry.name, target, f"build {len(plan.fingerprints)} engines")
    builds = stages.build_engine.map(
        unmapped(plan), plan.fingerprints, unmapped(target), unmapped(workspace), unmapped(engine_cache)
    )
    engines: list[EngineRef] = [b.result() for b in builds]
    # Reused: returned from Prefect's task cache (nothing ran) or from the persistent engine cache.
    reused = sum(1 for b, e in zip(builds, engines, strict=True) if b.state.name == "Cached" or e.cache_hit)

    progress.emit("model", entry.name, target, "assemble")
    staged = stages.assemble_engines(plan, engines, workspace)
    progress.emit("model", entry.name, target, "validate")
    validation = stages.validate_package(entry, staged, settings.validation.model_dump())
    progress.emit("model", entry.name, target, "package")
    package = stages.package_model(staged, validation, package_path(out_dir, entry, target))

    tracking = None
    if settings.tracking_enabled():
        tracking = _tracking_task()(package.path, entry, validation)

    # A build that fell back to PyTorch built nothing (the compile report lists it under build_failures).
    fell_back = sum(
        1 for b, e in zip(builds, engines, strict=True) if e.backend == "torch" and b.state.name != "Cached"
    )
    built = len(engines) - reused - fell_back
    if built == 0:
        logger.info("%s: nothing to build, %d engines reused", entry.name, reused)
    result = ModelResult(
        name=entry.name,
        target=target,
        status="ok",
        package=package.path,
        content_hash=package.content_hash,
        partitions=plan.partitions,
        unique_engines=len(engines),
        engines_built=built,
        engines_reused=reused,
        fallback_ops=dict(plan.fallback_ops),
        max_rel_l2=validation.get("max_rel_l2"),
        latency_ratio=validation.get("latency_ratio"),
        seconds=round(time.perf_counter() - start, 2),
        tracking=tracking if isinstance(tracking, dict) else None,
        build_workers=sorted({e.worker for e in engines}),
    )
    progress.emit("done", entry.name, target, "ok")
    return result
