"""One thin Prefect task per compiler stage.

Each task calls one function of ``compiler`` and moves its value into or out of the workspace
(``tasks.workspace``), so what travels between tasks is a small typed ref (``tasks.refs``), not a model
or engine bytes. Every stage stores its result under a content key (the compile request and the
source's identity, kiln's code, the engine library), so a re-run with nothing changed returns every
stage from the workspace and builds no engine; a stored result whose files no longer verify is evicted
and rebuilt. Engine builds also go through the compiler's persistent ``EngineCache``, which is shared
by models, runs and workers, and hold a leased Prefect concurrency slot per device.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

import compiler
from compiler.backends import TORCH, get_backend
from compiler.backends.base import EngineIO
from compiler.cache.entry import CacheWarning
from compiler.errors import AccuracyError
from compiler.options import CompileOptions
from compiler.package.manifest import SourceRecord
from compiler.package.writing import copy_into_place
from compiler.partitioning.partition import replay
from tasks.concurrency import build_slot
from tasks.refs import (
    EngineRef,
    PackageRef,
    PlanRef,
    ProgramRef,
    StagedRef,
    ValidatedRef,
    ValidationFailedError,
    retry_condition,
)
from tasks.workspace import Workspace, code_version, compile_key, content_hash, read_json
from zoo.preflight import check_memory, spec_sizes
from zoo.request import CompileRequest
from zoo.sources.base import SourceIdentity

# compiler/ serialises its own traces (torch.export, the ONNX exporter: compiler.program.tracing). This
# coarser lock also covers running and timing torch code, so validation latencies of models compiled
# side by side in one process are not measured against each other; the Dask runner with processes is
# the way to build engines truly in parallel.
TORCH_LOCK = threading.RLock()

R = TypeVar("R")


def torch_lock() -> threading.RLock:
    # Task bodies reach the lock through this function: Dask pickles a task's function by value, and a
    # function (pickled by reference) travels where a lock cannot.
    return TORCH_LOCK


def engine_library(options: CompileOptions) -> list[str]:
    """The engine library that builds here (name, version, engine target), as the engine cache keys it:
    after a library upgrade the content alone would hand back the old engine."""
    backend = get_backend(options.backend, options.device)
    return [backend.name, backend.library_version(), backend.engine_target()]


def _stored(
    workspace: str,
    stage: str,
    key: str,
    decode: Callable[[dict], R],
    verify: Callable[[R], bool],
) -> R | None:
    """The stage's stored result if its files still verify; a damaged one is evicted (and rebuilt)."""
    ws = Workspace(workspace)
    data = ws.get_result(stage, key)
    if data is None:
        return None
    try:
        value = decode(data)
    except (KeyError, TypeError, ValueError):
        value = None
    if value is not None and verify(value):
        return value
    ws.evict_result(stage, key)
    get_run_logger().warning(
        "%s result %s was damaged in the workspace: evicted, running again", stage, key[:12]
    )
    return None


# ---------------------------------------------------------------- plan replay, once per process

_plans: dict[str, tuple[Any, Any]] = {}
_plans_lock = threading.Lock()
_plan_locks: dict[str, threading.Lock] = {}


def _load_plan(ref: PlanRef) -> tuple[Any, Any]:
    """(PartitionPlan, DedupPlan) replayed from the workspace; parallel builds of one model share it."""
    with _plans_lock:
        lock = _plan_locks.setdefault(ref.sha256, threading.Lock())
    with lock, torch_lock():
        if ref.sha256 not in _plans:
            program = compiler.load_program(ref.program.path, allowed_modules=ref.program.trusted_modules)
            plan = replay(program, read_json(ref.plan_path))
            if ref.quantized_path:
                plan.quantized, plan.quantized_graphs = unpack_quantized(
                    Path(ref.quantized_path).read_bytes()
                )
            dedup = compiler.DedupPlan.from_dict(read_json(ref.dedup_path))
            with _plans_lock:
                if len(_plans) >= 8:  # a zoo run touches a handful of models at a time
                    _plans.pop(next(iter(_plans)))
                _plans[ref.sha256] = (plan, dedup)
        return _plans[ref.sha256]


_GRAPH = "graph/"


def pack_quantized(plan: Any) -> bytes:
    """A plan's quantized tensors and graphs (as uint8 arrays under ``graph/<fp>``) as safetensors."""
    import safetensors.torch
    import torch

    graphs = {
        f"{_GRAPH}{fp}": torch.frombuffer(bytearray(g), dtype=torch.uint8)
        for fp, g in plan.quantized_graphs.items()
    }
    return safetensors.torch.save({**{k: v.cpu().contiguous() for k, v in plan.quantized.items()}, **graphs})


def unpack_quantized(data: bytes) -> tuple[dict, dict]:
    """(tensors, graphs) of :func:`pack_quantized`."""
    import safetensors.torch

    loaded = safetensors.torch.load(data)
    graphs = {k[len(_GRAPH) :]: v.numpy().tobytes() for k, v in loaded.items() if k.startswith(_GRAPH)}
    return {k: v for k, v in loaded.items() if not k.startswith(_GRAPH)}, graphs


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


def load_artifact(ref: EngineRef) -> compiler.EngineArtifact:
    """The EngineArtifact a ref points at."""
    path = Path(ref.path)
    fallback = ref.backend == TORCH
    meta = read_json(path if fallback else path.with_suffix(".json"))
    return compiler.EngineArtifact(
        ref.fingerprint,
        ref.cache_key,
        b"" if fallback else path.read_bytes(),
        EngineIO.from_dict(meta["io"]),
        ref.stripped,
        ref.cache_hit,
        ref.seconds,
        backend=ref.backend,
        build_failure=ref.build_failure,
    )


def _where() -> str:
    """The Dask worker running this task, else this process."""
    try:
        from distributed import get_worker

        return f"dask:{get_worker().address}"
    except (ImportError, ValueError):
        return f"process:{os.getpid()}"


# ---------------------------------------------------------------- the stages


def _cache(engine_cache: str | None) -> str | bool:
    """The run's engine cache as every compiler function takes it: its location, or False where the
    run's settings chose none (None would mean the default cache: ZooSettings.engine_cache_choice
    decided already)."""
    return engine_cache or False


@task(name="resolve-source", cache_policy=NO_CACHE, persist_result=False)
def resolve_source(request: CompileRequest) -> str:
    """The compile's content key from the source's identity: a hash, no model is loaded."""
    return compile_key(request)


def _export(case: Any, *, generation: bool) -> Any:
    """``compiler.export`` of a loaded case. A generation program is traced with gradients off: a
    ``torch.no_grad`` block inside the model (transformers 5.17's rotary embedding) is then inlined
    instead of kept as a ``wrap_with_set_grad_enabled`` op, which no engine takes and which split the
    H100 decode program into two partitions around it."""
    import contextlib

    import torch

    with torch.no_grad() if generation else contextlib.nullcontext():
        return compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)


@task(name="export", cache_policy=NO_CACHE, persist_result=False)
def export_program(request: CompileRequest, key: str, workspace: str) -> ProgramRef:
    """torch.export the model with its input specs captured once; the program lands in the workspace."""
    found = _stored(workspace, "export", key, ProgramRef.from_json, ProgramRef.verify)
    if found is not None:
        return found
    with torch_lock():
        case = request.load_case()
        program = _export(case, generation=request.generation is not None)
        specs = compiler.input_specs(program)
        check_memory(request.name, spec_sizes(specs))  # before anything is built for absurd ranges
        path = compiler.save_program(program, Workspace(workspace).program_path(key))
        from compiler.atomic import sha256_file

        ref = ProgramRef(
            request.name, key, str(path), sha256_file(path), tuple(specs), request.trusted_modules
        )
    Workspace(workspace).put_result("export", key, ref.to_json())
    return ref


@task(name="partition", cache_policy=NO_CACHE, persist_result=False)
def partition_program(program: ProgramRef, options: CompileOptions, workspace: str) -> PlanRef:
    """Partition (engine subgraphs vs PyTorch fallback) and dedup (structurally equal subgraphs share one
    engine); both plans are JSON in the workspace."""
    key = content_hash("partition", code_version(), program.cache_identity(), options.to_dict())
    found = _stored(workspace, "partition", key, PlanRef.from_json, PlanRef.verify)
    if found is not None:
        return found
    with torch_lock():
        loaded = compiler.load_program(program.path, allowed_modules=program.trusted_modules)
        plan = compiler.quantize(compiler.partition(loaded, options))  # int8 partitions only
        unique = compiler.dedup(plan)
        ws = Workspace(workspace)
        plan_path, plan_sha = ws.put_json("plans", plan.to_dict())
        dedup_path, dedup_sha = ws.put_json("plans", unique.to_dict())
        packed = plan.quantized or plan.quantized_graphs  # Inductor's int8 CPU programs: graphs only
        quantized_path, quantized_sha = (
            ws.put_blob("plans", pack_quantized(plan), ".safetensors") if packed else ("", "")
        )
    get_run_logger().info(
        "%s: %d engine partitions, %d unique structures, fallback %s",
        program.model,
        len(plan.partitions),
        len(unique.fingerprints),
        dict(plan.fallback_ops) or "none",
    )
    ref = PlanRef(
        program=program,
        options=options,
        plan_path=str(plan_path),
        plan_sha256=plan_sha,
        dedup_path=str(dedup_path),
        dedup_sha256=dedup_sha,
        fingerprints=tuple(unique.fingerprints),
        partitions=len(plan.partitions),
        fallback_ops=dict(plan.fallback_ops),
        quantized_path=str(quantized_path),
        quantized_sha256=quantized_sha,
    )
    ws.put_result("partition", key, ref.to_json())
    return ref


def build_key(plan: PlanRef, fingerprint: str) -> str:
    """The plan, the fingerprint and the engine library that builds here (see :func:`engine_library`)."""
    return content_hash(
        "build", code_version(), plan.cache_identity(), fingerprint, engine_library(plan.options)
    )


@task(
    name="build-engine",
    tags=["engine-build"],
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_condition,
    task_run_name="build-engine-{fingerprint:.12}",
)
def build_engine(
    plan: PlanRef,
    fingerprint: str,
    workspace: str,
    engine_cache: str | None,
    slot_timeout: float | None = None,
) -> EngineRef:
    """Build (or take from the workspace or the persistent engine cache) the engine of one unique structure.

    A failed build falls back inside ``compiler.build_engine`` as the options' ``on_build_failure``
    says, so only with ``"error"`` does an EngineBuildError reach Prefect and its retries.
    """
    key = build_key(plan, fingerprint)
    found = _stored(workspace, "build", key, EngineRef.from_json, EngineRef.verify)
    if found is not None:
        return dataclasses.replace(found, cache_hit=True)
    model, logger = plan.program.model, get_run_logger()
    with (
        build_slot(plan.options.device, slot_timeout),
        torch_lock(),
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("always", CacheWarning)  # shown in the summary, not only with -v
        partition_plan, dedup = _load_plan(plan)
        artifact = compiler.build_engine(partition_plan, dedup, fingerprint, cache=_cache(engine_cache))
        ref = store_artifact(artifact, workspace, _where())
    cache_warnings = tuple(
        dict.fromkeys(str(w.message) for w in seen if issubclass(w.category, CacheWarning))
    )
    ref = dataclasses.replace(ref, warnings=cache_warnings)
    if artifact.build_failure is not None:
        logger.warning(
            "%s engine %s: build failed at node %s, falls back to %s: %s",
            model,
            fingerprint[:12],
            artifact.build_failure["node"],
            artifact.backend,
            artifact.build_failure["error"],
        )
    else:
        Workspace(workspace).put_result("build", key, ref.to_json())  # a failed build is never kept
    logger.info(
        "%s engine %s: %s (%d bytes, %.2fs)",
        model,
        fingerprint[:12],
        "engine-cache hit" if artifact.cache_hit else "built" if artifact.is_engine else "not built",
        artifact.bytes,
        artifact.seconds,
    )
    return ref


@task(name="assemble", cache_policy=NO_CACHE, persist_result=False)
def assemble_engines(plan: PlanRef, engines: Sequence[EngineRef], workspace: str) -> StagedRef:
    """Wire every engine instance into the fallback graph (refitting shared engines with each instance's
    weights) and stage the result as an unvalidated package."""
    key = content_hash(
        "assemble", code_version(), plan.cache_identity(), [e.cache_identity() for e in engines]
    )
    found = _stored(workspace, "assemble", key, StagedRef.from_json, StagedRef.verify)
    if found is not None:
        return found
    with torch_lock():
        partition_plan, dedup = _load_plan(plan)
        compiled = compiler.assemble(
            partition_plan, dedup, {e.fingerprint: load_artifact(e) for e in engines}
        )
        info = compiler.save(compiled, Workspace(workspace).staged_path(key))
    ref = StagedRef(key, str(info.path), info.content_hash, compiled.report, plan.program.trusted_modules)
    Workspace(workspace).put_result("assemble", key, ref.to_json())
    return ref


@task(name="validate", cache_policy=NO_CACHE, persist_result=False)
def validate_package(
    request: CompileRequest, staged: StagedRef, workspace: str, engine_cache: str | None
) -> ValidatedRef:
    """Accuracy against the eager model (on the entry's recorded data, else fresh inputs inside the spec
    ranges) and latency of both; a reduced-precision compile that misses its accuracy tolerances is
    repaired when the request says so (its worst partitions rebuilt one precision up, then staged anew).

    Raises ValidationFailedError naming every tolerance still missed, so no package is published.
    """
    key = content_hash("validate", code_version(), request.cache_identity(), staged.cache_identity())
    found = _stored(workspace, "validate", key, ValidatedRef.from_json, lambda v: v.staged.verify())
    if found is not None:
        return found
    plan = request.validation
    with torch_lock():
        compiled = staged.load()
        case = request.load_case()
        try:
            checked, report = compiler.ensure_accuracy(
                case.model,
                compiled,
                request.tolerances,
                data=plan.dataset(compiled.input_specs),  # recorded (less validation.ignore_fields), or None
                samples=plan.samples,
                warmup=plan.warmup,
                runs=plan.runs,
                seed=plan.seed,
                cache=_cache(engine_cache),
            )
        except AccuracyError as exc:
            raise ValidationFailedError(f"{request.name}: " + "; ".join(exc.failures)) from None
        if checked is not compiled:  # repaired: the package to publish is the repaired one
            repaired = content_hash("repaired", staged.cache_identity(), checked.plan.options.to_dict())
            info = compiler.save(checked, Workspace(workspace).staged_path(repaired))
            staged = dataclasses.replace(
                staged,
                key=repaired,
                path=str(info.path),
                content_hash=info.content_hash,
                report=checked.report,
            )
            get_run_logger().warning("%s: %s", request.name, checked.report.summary())
    validated = ValidatedRef(staged, report)
    Workspace(workspace).put_result("validate", key, validated.to_json())
    return validated


@task(name="package", cache_policy=NO_CACHE, persist_result=False)
def package_model(
    validated: ValidatedRef, out_path: str, workspace: str, source: SourceIdentity | None = None
) -> PackageRef:
    """The validated package: one self-describing directory with its measured accuracy and latency, and
    its lineage (``source``: which model, at which version, it was compiled from).

    Written into this run's own staging directory, then copied into place whole under a lock on the
    output path, so two runs writing one path never mix; the record is made from this run's copy."""
    start = time.perf_counter()
    mine = Workspace(workspace).dir(f"runs/{uuid.uuid4().hex}") / Path(out_path).name
    target = Path(out_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with torch_lock():
        compiled = validated.staged.load()
        lineage = (
            SourceRecord(source.uri, source.kind, source.version, source.digest, source.run_id)
            if source is not None
            else None
        )
        # Published packages keep the weights as their engines take them: int8 only, fp16/bf16 at that
        # precision (staged ones keep fp32 weights for repair).
        final = {"validation": validated.report, "source": lineage, "int8_weights_only": True}
        info = compiler.save(compiled, mine, **final, engine_precision_weights=True)
        with FileLock(str(target.parent / f".{target.name}.lock")):
            copy_into_place(mine, target)  # the very bytes recorded: not saved a second time
    get_run_logger().info("package %s (%d bytes, %.2fs)", target, info.bytes, time.perf_counter() - start)
    return PackageRef(str(target), info.content_hash, info.bytes, str(mine))


# ---------------------------------------------------------------- binding to a run's settings


@dataclass(frozen=True)
class Stages:
    """The stage tasks with one run's build tag, retries and back-off applied."""

    resolve_source: Any
    export_program: Any
    partition_program: Any
    build_engine: Any
    assemble_engines: Any
    validate_package: Any
    package_model: Any


def build_tag(device: str) -> str:
    """The tag (and concurrency limit name) that keeps engine builds from oversubscribing one device."""
    return f"engine-build:{device}"


def configured(device: str, *, retries: int = 2, backoff: float = 2.0) -> Stages:
    """Stage tasks for one device: its build tag, the run's retries and back-off."""
    return Stages(
        resolve_source=resolve_source,
        export_program=export_program,
        partition_program=partition_program,
        build_engine=build_engine.with_options(
            tags={"engine-build", build_tag(device)},
            retries=retries,
            retry_delay_seconds=exponential_backoff(backoff_factor=backoff) if backoff else 0,
        ),
        assemble_engines=assemble_engines,
        validate_package=validate_package,
        package_model=package_model,
    )
