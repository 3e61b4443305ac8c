"""One thin Prefect task per compiler stage.

Each task calls one function of ``compiler`` and moves its value into or out of the workspace
(``tasks.workspace``), so what travels between tasks is a small reference, not a model or engine
bytes. Cache keys are content hashes (the model's weights and source, kiln's code, the settings), so a
re-run with nothing changed returns every stage from the cache and builds no engine. Engine builds
also go through the compiler's persistent ``EngineCache``, which is shared by models, runs and workers.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.tasks import exponential_backoff

import compiler
from compiler.backends.base import EngineIO
from compiler.build import TORCH
from compiler.errors import (
    BackendUnavailableError,
    EngineCompatibilityError,
    ExportError,
    InputSpecError,
    KilnError,
    LoweringError,
    PartitionError,
    RefitError,
)
from compiler.partition import replay
from flows.zoo_config import ZooEntry
from tasks.model_case import load_case, model_key
from tasks.workspace import Workspace, code_version, content_hash, read_json

# compiler/ serialises its own traces (torch.export, the ONNX exporter: compiler.export.TRACING). This
# coarser lock also covers running and timing torch code, so validation latencies of models compiled
# side by side in one process are not measured against each other; the Dask runner with processes is
# the way to build engines truly in parallel.
TORCH_LOCK = threading.RLock()


def torch_lock() -> threading.RLock:
    # Task bodies reach the lock through this function: Dask pickles a task's function by value, and a
    # function (pickled by reference) travels where a lock cannot.
    return TORCH_LOCK


# Parameters that say where things live, not what is computed: left out of cache keys so a moved
# workspace or engine cache still hits.
_LOCATION_PARAMS = frozenset({"workspace", "engine_cache"})


class ValidationFailedError(KilnError):
    """The compiled model is less accurate (or slower) than the zoo entry's tolerances allow."""


def content_key(context: TaskRunContext, parameters: Mapping[str, Any]) -> str:
    """Task name + kiln code version + the content of every parameter (refs hash by their files' hashes)."""
    content = {k: v for k, v in parameters.items() if k not in _LOCATION_PARAMS}
    return f"{context.task.name}-{content_hash(context.task.name, code_version(), content)}"


def build_key(context: TaskRunContext, parameters: Mapping[str, Any]) -> str:
    """content_key plus the engine library that builds here (name, version, target device), as the
    engine cache key has them: after a library upgrade the content alone would hand back the old
    engine (or the PyTorch fallback of a build the new library may manage)."""
    from compiler.backends import get_backend

    backend = get_backend(parameters["plan"].options.get("backend", "onnxruntime"))
    library = [backend.name, backend.library_version(), backend.target_device()]
    return content_key(context, {**parameters, "engine_library": library})


# ---------------------------------------------------------------- references passed between tasks


@dataclass(frozen=True)
class ProgramRef:
    model: str
    key: str
    path: str
    sha256: str
    input_specs: tuple[dict, ...]
    # Modules to import before loading the program: they register its custom ops (a Dask worker
    # process has not imported the model's module).
    op_modules: tuple[str, ...] = ()

    def cache_identity(self) -> dict:
        return {"key": self.key, "sha256": self.sha256}


@dataclass(frozen=True)
class PlanRef:
    program: ProgramRef
    options: dict
    plan_path: str
    dedup_path: str
    sha256: str
    fingerprints: tuple[str, ...]
    partitions: int
    fallback_ops: dict[str, int] = field(default_factory=dict)

    def cache_identity(self) -> dict:
        return {"program": self.program.cache_identity(), "sha256": self.sha256}


@dataclass(frozen=True)
class EngineRef:
    fingerprint: str
    cache_key: str
    path: str  # the engine file; for a PyTorch fallback (no engine) its JSON record
    sha256: str
    bytes: int
    stripped: bool
    cache_hit: bool
    seconds: float
    worker: str = ""  # where it was built: "dask:<address>" or "process:<pid>"
    backend: str = ""  # what runs it: the compile's backend, "onnxruntime" or "torch" after a failed build
    build_failure: dict | None = None

    def cache_identity(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "cache_key": self.cache_key,
            "sha256": self.sha256,
            "backend": self.backend,
        }


@dataclass(frozen=True)
class StagedRef:
    key: str
    path: str
    content_hash: str
    report: dict
    op_modules: tuple[str, ...] = ()

    def cache_identity(self) -> dict:
        return {"key": self.key, "content_hash": self.content_hash}


@dataclass(frozen=True)
class PackageRef:
    path: str
    content_hash: str
    bytes: int


# ---------------------------------------------------------------- plan replay, once per process

_plans: dict[str, tuple[Any, Any]] = {}
_plans_lock = threading.Lock()
_plan_locks: dict[str, threading.Lock] = {}


def import_op_modules(modules: Sequence[str]) -> None:
    """Import the modules that register a program's custom ops (no-op when already imported)."""
    for module in modules:
        importlib.import_module(module)


def _load_plan(ref: PlanRef) -> tuple[Any, Any]:
    """(PartitionPlan, DedupPlan) replayed from the workspace; parallel builds of one model share it."""
    with _plans_lock:
        lock = _plan_locks.setdefault(ref.sha256, threading.Lock())
    with lock, torch_lock():
        if ref.sha256 not in _plans:
            import_op_modules(ref.program.op_modules)
            program = compiler.load_program(ref.program.path)
            plan = replay(program, read_json(ref.plan_path))
            dedup = compiler.DedupPlan.from_dict(read_json(ref.dedup_path))
            with _plans_lock:
                if len(_plans) >= 8:  # a zoo run touches a handful of models at a time
                    _plans.pop(next(iter(_plans)))
                _plans[ref.sha256] = (plan, dedup)
        return _plans[ref.sha256]


def store_artifact(artifact: compiler.EngineArtifact, workspace: str, worker: str = "") -> EngineRef:
    """Put a built engine (or the record of a PyTorch fallback, which has no engine) into the workspace."""
    ws = Workspace(workspace)
    if artifact.is_engine:
        path, sha = ws.put_engine(artifact.cache_key, artifact.engine, artifact.io.to_dict())
    else:
        path, sha = ws.put_fallback(artifact.cache_key, artifact.io.to_dict(), artifact.build_failure)
    return EngineRef(
        artifact.fingerprint,
        artifact.cache_key,
        str(path),
        sha,
        artifact.bytes,
        artifact.stripped,
        artifact.cache_hit,
        artifact.seconds,
        worker,
        artifact.backend,
        artifact.build_failure,
    )


def load_artifact(ref: EngineRef, default_backend: str) -> compiler.EngineArtifact:
    """The EngineArtifact a ref points at; refs persisted before refs named their backend get the plan's."""
    path = Path(ref.path)
    backend = ref.backend or default_backend
    fallback = backend == TORCH
    meta = read_json(path if fallback else path.with_suffix(".json"))
    return compiler.EngineArtifact(
        ref.fingerprint,
        ref.cache_key,
        b"" if fallback else path.read_bytes(),
        EngineIO.from_dict(meta["io"]),
        ref.stripped,
        ref.cache_hit,
        ref.seconds,
        backend=backend,
        build_failure=ref.build_failure,
    )


def _where() -> str:
    """The Dask worker running this task, else this process."""
    try:
        from distributed import get_worker

        return f"dask:{get_worker().address}"
    except (ImportError, ValueError):
        return f"process:{os.getpid()}"


def _transient(task_: Any, task_run: Any, state: Any) -> bool:
    """Retry what may pass on a second try (I/O, memory, a busy device), never a deterministic error."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            state.result(raise_on_failure=True)
        except BaseException as raised:
            exc = raised
    deterministic = (
        InputSpecError,
        ExportError,
        PartitionError,
        LoweringError,
        RefitError,
        BackendUnavailableError,
        EngineCompatibilityError,
        ValueError,
        TypeError,
        KeyError,
    )
    return not isinstance(exc, deterministic)


# ---------------------------------------------------------------- the stages


@task(name="fingerprint-model", cache_policy=NO_CACHE, persist_result=False)
def fingerprint_model(entry: ZooEntry) -> str:
    """The model's content key: its weights, factory source and settings (the root of every cache key)."""
    with torch_lock():
        return model_key(entry, load_case(entry))


@task(name="export", cache_key_fn=content_key, persist_result=True)
def export_program(entry: ZooEntry, model_key: str, workspace: str) -> ProgramRef:
    """torch.export the model with its input specs captured once; the program lands in the workspace."""
    with torch_lock():
        case = load_case(entry)
        program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        path = compiler.save_program(program, Workspace(workspace).program_path(model_key))
        from compiler.atomic import sha256_file

        specs = tuple(s.to_dict() for s in compiler.input_specs(program))
        modules = (entry.factory.partition(":")[0],)
        return ProgramRef(entry.name, model_key, str(path), sha256_file(path), specs, modules)


@task(name="partition", cache_key_fn=content_key, persist_result=True)
def partition_program(program: ProgramRef, options: dict, workspace: str) -> PlanRef:
    """Partition (engine subgraphs vs PyTorch fallback) and dedup (structurally equal subgraphs share one
    engine); both plans are JSON in the workspace."""
    with torch_lock():
        loaded = compiler.load_program(program.path)
        plan = compiler.partition(loaded, compiler.CompileOptions(**options))
        unique = compiler.dedup(plan)
        ws = Workspace(workspace)
        plan_path, plan_sha = ws.put_json("plans", plan.to_dict())
        dedup_path, dedup_sha = ws.put_json("plans", unique.to_dict())
        logger = get_run_logger()
        logger.info(
            "%s: %d engine partitions, %d unique structures, fallback %s",
            program.model,
            len(plan.partitions),
            len(unique.fingerprints),
            dict(plan.fallback_ops) or "none",
        )
        return PlanRef(
            program=program,
            options=dict(options),
            plan_path=str(plan_path),
            dedup_path=str(dedup_path),
            sha256=content_hash(plan_sha, dedup_sha),
            fingerprints=tuple(unique.fingerprints),
            partitions=len(plan.partitions),
            fallback_ops=dict(plan.fallback_ops),
        )


@task(
    name="build-engine",
    tags=["engine-build"],
    cache_key_fn=build_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
    retry_condition_fn=_transient,
    task_run_name="build-engine-{fingerprint:.12}-{target}",
)
def build_engine(
    plan: PlanRef, fingerprint: str, target: str, workspace: str, engine_cache: str | None
) -> EngineRef:
    """Build (or take from the persistent engine cache) the engine for one unique structure.

    A failed build falls back inside ``compiler.build_engine`` as the options' ``on_build_failure``
    says, so only with ``"error"`` does an EngineBuildError reach Prefect and its retries.
    """
    with torch_lock():
        partition_plan, dedup = _load_plan(plan)
        cache = compiler.EngineCache(engine_cache) if engine_cache else None
        artifact = compiler.build_engine(partition_plan, dedup, fingerprint, cache=cache)
        ref = store_artifact(artifact, workspace, _where())
        logger = get_run_logger()
        if artifact.build_failure is not None:
            logger.warning(
                "%s engine %s: build failed at node %s, falls back to %s: %s",
                plan.program.model,
                fingerprint[:12],
                artifact.build_failure["node"],
                artifact.backend,
                artifact.build_failure["error"],
            )
        logger.info(
            "%s engine %s: %s (%d bytes, %.2fs)",
            plan.program.model,
            fingerprint[:12],
            "engine-cache hit" if artifact.cache_hit else "built" if artifact.is_engine else "not built",
            artifact.bytes,
            artifact.seconds,
        )
        return ref


@task(name="assemble", cache_key_fn=content_key, persist_result=True)
def assemble_engines(plan: PlanRef, engines: Sequence[EngineRef], workspace: str) -> StagedRef:
    """Wire every engine instance into the fallback graph (refitting shared engines with each instance's
    weights) and stage the result as an unvalidated package."""
    with torch_lock():
        partition_plan, dedup = _load_plan(plan)
        backend = partition_plan.options.backend
        compiled = compiler.assemble(
            partition_plan, dedup, {e.fingerprint: load_artifact(e, backend) for e in engines}
        )
        key = content_hash(plan.cache_identity(), [e.cache_identity() for e in engines])
        info = compiler.save(compiled, Workspace(workspace).staged_path(key))
        return StagedRef(
            key, str(info.path), info.content_hash, compiled.report.to_dict(), plan.program.op_modules
        )


@task(name="validate", cache_key_fn=content_key, persist_result=True)
def validate_package(entry: ZooEntry, staged: StagedRef, settings: dict) -> dict:
    """Accuracy against the eager model on fresh inputs inside the spec ranges, and latency of both.

    Raises ValidationFailedError when the entry's tolerances are not met, so no package is published.
    """
    with torch_lock():
        import_op_modules(staged.op_modules)
        compiled = compiler.load(staged.path)
        case = load_case(entry)
        report = compiler.validate(
            case.model,
            compiled,
            samples=settings.get("samples", 3),
            warmup=settings.get("warmup", 3),
            runs=settings.get("runs", 20),
            seed=settings.get("seed", 0),
        )
        data = report.to_dict()
        data["tolerance_rel_l2"] = entry.rel_l2()
        problems = []
        if not report.passed(rel_l2=entry.rel_l2()):
            problems.append(
                f"accuracy: max relative L2 {report.max_rel_l2:.3g} > tolerance {entry.rel_l2():.3g} "
                f"(tolerances.rel_l2); check the precision or loosen the tolerance"
            )
        limit = entry.tolerances.max_latency_ratio
        if limit is not None and report.latency_ratio > limit:
            problems.append(
                f"latency: compiled/eager {report.latency_ratio:.2f} > tolerances.max_latency_ratio {limit}"
            )
        if problems:
            raise ValidationFailedError(f"{entry.name}: " + "; ".join(problems))
        return data


@task(name="package", cache_policy=NO_CACHE, persist_result=False)
def package_model(staged: StagedRef, validation: dict, out_path: str) -> PackageRef:
    """The validated package: one self-describing directory with its measured accuracy and latency."""
    with torch_lock():
        start = time.perf_counter()
        import_op_modules(staged.op_modules)
        info = compiler.save(compiler.load(staged.path), out_path, validation=validation)
        get_run_logger().info(
            "package %s (%d bytes, %.2fs)", info.path, info.bytes, time.perf_counter() - start
        )
        return PackageRef(str(info.path), info.content_hash, info.bytes)


# ---------------------------------------------------------------- binding to a run's settings


@dataclass(frozen=True)
class Stages:
    """The stage tasks with one run's result storage, build tag, retries and back-off applied."""

    fingerprint_model: Any
    export_program: Any
    partition_program: Any
    build_engine: Any
    assemble_engines: Any
    validate_package: Any
    package_model: Any


def build_tag(target: str) -> str:
    """The tag whose concurrency limit keeps engine builds from oversubscribing one device."""
    return f"engine-build:{target}"


def configured(workspace: str, target: str, *, retries: int = 2, backoff: float = 2.0) -> Stages:
    """Stage tasks that persist results (and cache records) under ``<workspace>/results``."""
    # A Path is a local result store that needs no block saved on the server (works with the ephemeral API).
    cached = {"result_storage": Workspace(workspace).results}
    return Stages(
        fingerprint_model=fingerprint_model,
        export_program=export_program.with_options(**cached),
        partition_program=partition_program.with_options(**cached),
        build_engine=build_engine.with_options(
            **cached,
            tags={"engine-build", build_tag(target)},
            retries=retries,
            retry_delay_seconds=exponential_backoff(backoff_factor=backoff) if backoff else 0,
        ),
        assemble_engines=assemble_engines.with_options(**cached),
        validate_package=validate_package.with_options(**cached),
        package_model=package_model,
    )
