"""Tracking: one MLflow run per compiled package, nested under the zoo run when there is one.

A run holds:

* params: model, factory, backend + library version, target device, precision, strip, the partitioning
  settings (``min_block_size``, ``torch_executed_ops``, ``split_modules``), kiln/torch/format versions;
* metrics: accuracy per output (``rel_l2.<output>``, ``max_abs.<output>``, ``cosine.<output>``),
  eager/compiled latency median and p95 and their ratio, build seconds (total and per stage),
  partitions, unique engines, engines built, cache hits, refits, engine and package bytes;
* artifacts: ``input_specs.json``, ``manifest.json``, ``compile_report.json``, ``validation.json``, the
  pipeline's report, ``latency.png``;
* the package itself as the logged model (``python_function`` flavour, see :mod:`registry.pyfunc`),
  with the input specs as its signature (``TensorSpec``, ``-1`` for dynamic dims; the ranges are in the
  spec JSON), registered as a version of ``kiln.<model>.<target>`` (:mod:`registry.models`).

Failure handling: every call retries with back-off (:mod:`registry.config`). If the server stays away,
the run is marked ``FAILED`` where the server can still be told, the package on disk is never touched,
and :class:`RegistryUnavailableError` says so. Calling :func:`record_package` again resumes the same
run (found by the package's content hash) and completes it; a package already recorded is not
logged twice.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.metadata
import importlib.util
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.models import ModelSignature
from mlflow.models.model import Model
from mlflow.types.schema import Schema, TensorSpec

from compiler.specs import InputSpec
from registry import config
from registry.config import RetryPolicy, call_with_retry
from registry.errors import RegistryError, RegistryUnavailableError
from registry.models import (
    Registered,
    register_version,
    registered_model_name,
    version_tags,
    versions_with_hash,
)
from registry.pyfunc import PACKAGE_ARTIFACT, KilnPackageModel

log = logging.getLogger("kiln.registry")

MODEL_ARTIFACT = "model"
TAG_CONTENT_HASH = "kiln.content_hash"
TAG_MODEL = "kiln.model"
TAG_COMPLETE = "kiln.complete"
TAG_ERROR = "kiln.error"
TAG_PACKAGE_DIR = "kiln.package_dir"
TAG_VERSION = "kiln.model_version"
TAG_REGISTERED = "kiln.registered_model"
TAG_KIND = "kiln.kind"
TAG_ZOO_KEY = "kiln.zoo_key"
PARENT_ENV = "KILN_MLFLOW_PARENT_RUN_ID"

# The zoo run of the current context (thread or Prefect task); record_package nests under it.
_zoo_run: contextvars.ContextVar[str | None] = contextvars.ContextVar("kiln_zoo_run", default=None)


@dataclass(frozen=True)
class RecordResult:
    """Where a package landed: its run, logged model and registered version."""

    run_id: str
    model_uri: str
    registered_model: str
    version: str
    content_hash: str
    created: bool  # a new registry version was made (False: equal content was already registered)
    resumed: bool  # an earlier, interrupted run for this package was completed
    already_recorded: bool  # nothing to do: a complete run for this content exists

    def to_dict(self) -> dict:
        return asdict(self)


def _entry_dict(entry: Any) -> dict:
    if entry is None:
        return {}
    if hasattr(entry, "model_dump"):
        return entry.model_dump(mode="json")
    if isinstance(entry, Mapping):
        return dict(entry)
    raise RegistryError(f"zoo entry must be a ZooEntry or a mapping, got {type(entry).__name__}")


def _package_bytes(package_dir: Path) -> int:
    return sum(p.stat().st_size for p in package_dir.rglob("*") if p.is_file())


def signature_for(specs: list[InputSpec]) -> ModelSignature | None:
    """The MLflow signature of the input specs: ``-1`` on dynamic axes (ranges live in the spec JSON)."""
    inputs = []
    for spec in specs:
        try:
            dtype = np.dtype(spec.dtype)
        except TypeError:
            return None  # bfloat16 has no numpy dtype: MLflow cannot express this signature
        shape = tuple(-1 if axis in spec.dynamic_dims else size for axis, size in enumerate(spec.max_shape))
        inputs.append(TensorSpec(dtype, shape, spec.name))
    return ModelSignature(inputs=Schema(inputs))


def _params(manifest: Mapping[str, Any], model: str, entry: Mapping[str, Any]) -> dict[str, str]:
    options = (manifest.get("plan") or {}).get("options") or {}
    params = {
        "model": model,
        "factory": entry.get("factory", ""),
        "backend": manifest.get("backend", ""),
        "backend_version": manifest.get("backend_version", ""),
        "target_device": manifest.get("target_device", ""),
        "precision": manifest.get("precision", ""),
        "strip_weights": manifest.get("strip_weights", ""),
        "min_block_size": options.get("min_block_size", ""),
        "torch_executed_ops": json.dumps(list(options.get("torch_executed_ops") or [])),
        "split_modules": json.dumps(options.get("split_modules")),
        "kiln_version": manifest.get("kiln_version", ""),
        "torch_version": manifest.get("torch_version", ""),
        "format_version": manifest.get("format_version", ""),
    }
    return {k: str(v) for k, v in params.items() if str(v) != ""}


def _validation(manifest: Mapping[str, Any], report: Mapping[str, Any] | None) -> dict | None:
    if manifest.get("validation"):
        return dict(manifest["validation"])
    report = report or {}
    if isinstance(report.get("validation"), Mapping):
        return dict(report["validation"])
    return dict(report) if "outputs" in report and "eager" in report else None


def metrics_for(
    manifest: Mapping[str, Any], report: Mapping[str, Any] | None, package_bytes: int
) -> dict[str, float]:
    """Flat metrics of a package: accuracy per output, latency, build and engine counts, sizes."""
    metrics: dict[str, float] = {"package_bytes": float(package_bytes)}
    compile_report = dict(manifest.get("report") or {})
    for key, name in (
        ("num_partitions", "partitions"),
        ("unique_fingerprints", "unique_engines"),
        ("engines_built", "engines_built"),
        ("cache_hits", "cache_hits"),
        ("refits", "refits"),
        ("engine_bytes", "engine_bytes"),
        ("fallback_op_count", "fallback_ops"),
    ):
        if isinstance(compile_report.get(key), (int, float)):
            metrics[name] = float(compile_report[key])
    stages = compile_report.get("stage_seconds") or {}
    for stage, seconds in stages.items():
        metrics[f"seconds.{stage}"] = float(seconds)
    if stages:
        metrics["build_seconds"] = float(sum(stages.values()))
    validation = _validation(manifest, report)
    if validation:
        for row in validation.get("outputs", []):
            out = row.get("output", "output")
            for key in ("rel_l2", "max_abs", "cosine"):
                if row.get(key) is not None:
                    metrics[f"{key}.{out}"] = float(row[key])
        for side in ("eager", "compiled"):
            lat = validation.get(side) or {}
            for key in ("median_ms", "p95_ms"):
                if lat.get(key) is not None:
                    metrics[f"{side}_{key}"] = float(lat[key])
        for key in ("max_rel_l2", "min_cosine", "latency_ratio"):
            if validation.get(key) is not None:
                metrics[key] = float(validation[key])
    return {k: v for k, v in metrics.items() if np.isfinite(v)}


def latency_chart(validation: Mapping[str, Any] | None, title: str, path: Path) -> Path | None:
    """Eager vs compiled latency (median bars, p95 markers) as a PNG; None without validation."""
    if not validation or not validation.get("eager") or not validation.get("compiled"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = ["eager", "compiled"]
    medians = [float(validation[s]["median_ms"]) for s in sides]
    p95s = [float(validation[s]["p95_ms"]) for s in sides]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    try:
        bars = ax.bar(sides, medians, color=["#8c8c8c", "#d95f02"], label="median")
        ax.scatter(sides, p95s, color="black", marker="_", s=600, zorder=3, label="p95")
        for bar, value in zip(bars, medians, strict=True):
            ax.annotate(
                f"{value:.3f} ms", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom"
            )
        ratio = medians[1] / medians[0] if medians[0] else float("nan")
        ax.set_title(f"{title}\ncompiled/eager = {ratio:.2f}x", fontsize=9)
        ax.set_ylabel("latency (ms)")
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def _code_paths(op_modules: tuple[str, ...]) -> list[str]:
    """compiler + registry (the loader), and the top-level package of each op module (its custom ops)."""
    paths = []
    for package in ("compiler", "registry"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise RegistryError(f"cannot find the {package!r} package to ship with the logged model")
        paths.append(str(Path(next(iter(spec.submodule_search_locations)))))
    for module in op_modules:
        top = module.split(".")[0]
        spec = importlib.util.find_spec(top)
        if spec is None:
            continue
        if spec.submodule_search_locations:
            where = str(Path(next(iter(spec.submodule_search_locations))))
        elif spec.origin:
            where = spec.origin
        else:
            continue
        # Installed libraries come back through the requirements, not as copied code.
        if "site-packages" not in where and where not in paths:
            paths.append(where)
    return paths


def op_modules_for(entry: Mapping[str, Any]) -> tuple[str, ...]:
    """The factory's module: importing it registers the custom ops its model's fallback graph calls."""
    factory = str(entry.get("factory") or "")
    return (factory.split(":")[0],) if ":" in factory else ()


def _requirements(backend: str) -> list[str]:
    names = ["torch", "numpy", "safetensors", "onnx", "onnxruntime"]
    if backend.startswith("tensorrt"):
        names.append("tensorrt_rtx" if backend == "tensorrt_rtx" else "tensorrt")
    reqs = []
    for name in names:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        # Local builds (torch 2.13.0+cpu) are not on the index: pin the public release.
        reqs.append(f"{name}=={version.split('+')[0]}")
    return reqs


def _parent_run_id(explicit: str | None) -> str | None:
    return explicit or current_zoo_run()


def _find_runs(
    mlclient: MlflowClient, experiment_id: str, content_hash: str, model: str, policy: RetryPolicy | None
) -> list:
    query = f"tags.`{TAG_CONTENT_HASH}` = '{content_hash}' and tags.`{TAG_MODEL}` = '{model}'"
    return call_with_retry(
        lambda: list(
            mlclient.search_runs(
                [experiment_id], filter_string=query, max_results=50, order_by=["attributes.start_time DESC"]
            )
        ),
        f"search runs of {model}",
        policy,
    )


def record_package(
    package_dir: str | os.PathLike,
    entry: Any = None,
    report: Mapping[str, Any] | None = None,
    *,
    model: str | None = None,
    parent_run_id: str | None = None,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
) -> RecordResult:
    """Log a validated package as a run + logged model and register it; idempotent and resumable.

    ``entry`` is the zoo entry (a ``ZooEntry`` or mapping; its ``name`` names the model and its
    ``factory`` lets the release flow rebuild the original). ``report`` is the pipeline's report
    (logged as JSON; its ``validation`` is used when the package carries none).
    """
    import compiler.package as package

    package_dir = Path(package_dir).resolve()
    # Verify before touching MLflow: a corrupt package must never be registered.
    manifest = package.read_manifest(package_dir)
    entry_data = _entry_dict(entry)
    model = model or entry_data.get("name") or package_dir.name.removesuffix(".kiln")
    content_hash = manifest["content_hash"]
    policy = policy or RetryPolicy.from_env()
    mlclient = config.client(tracking_uri)
    experiment_id = config.ensure_experiment(mlclient, experiment, policy)
    registered = registered_model_name(model, manifest.get("target_device", "cpu"))

    previous = _find_runs(mlclient, experiment_id, content_hash, model, policy)
    for run in previous:
        model_uri = run.data.tags.get("kiln.model_uri", "")
        if run.data.tags.get(TAG_COMPLETE) == "true" and model_uri:
            # The registry, not the run's tag, is the authority: the version may have been deleted
            # since; then the logged model is registered again (no re-upload).
            found = versions_with_hash(mlclient, registered, content_hash, policy)
            if found:
                version, created = str(found[0].version), False
            else:
                again = register_version(
                    mlclient,
                    registered,
                    source=model_uri,
                    run_id=run.info.run_id,
                    model_id=model_uri.removeprefix("models:/"),
                    tags=version_tags(manifest, model, entry_data),
                    policy=policy,
                )
                version, created = again.version, again.created
            return RecordResult(
                run.info.run_id,
                model_uri,
                registered,
                version,
                content_hash,
                created=created,
                resumed=False,
                already_recorded=True,
            )
    resumable = [r for r in previous if r.info.status in ("RUNNING", "FAILED", "KILLED")]
    resumed = bool(resumable)
    if resumed:
        run_id = resumable[0].info.run_id
        call_with_retry(lambda: mlclient.update_run(run_id, status="RUNNING"), "resume run", policy)
        log.info("resuming interrupted run %s for %s", run_id, model)
    else:
        tags = {
            TAG_CONTENT_HASH: content_hash,
            TAG_MODEL: model,
            TAG_KIND: "package",
            TAG_PACKAGE_DIR: str(package_dir),
            "mlflow.runName": f"{model}-{manifest.get('backend', '')}-{manifest.get('target_device', '')}",
        }
        parent = _parent_run_id(parent_run_id)
        if parent:
            tags["mlflow.parentRunId"] = parent
        run_id = call_with_retry(
            lambda: mlclient.create_run(experiment_id, tags=tags).info.run_id,
            f"create run for {model}",
            policy,
        )
    try:
        result = _log_and_register(
            mlclient,
            run_id,
            experiment_id,
            package_dir,
            manifest,
            model,
            entry_data,
            report,
            registered,
            policy,
        )
    except BaseException as exc:
        _mark_failed(mlclient, run_id, exc)
        if isinstance(exc, RegistryUnavailableError):
            raise RegistryUnavailableError(
                f"recording {model} failed, run {run_id} is marked failed (or will be on the next attempt); "
                f"the package is kept at {package_dir}; re-run to complete it. Cause: {exc}",
                run_id=run_id,
                package_dir=str(package_dir),
            ) from exc
        raise
    return RecordResult(
        run_id, result[0], registered, result[1].version, content_hash, result[1].created, resumed, False
    )


def _log_and_register(
    mlclient: MlflowClient,
    run_id: str,
    experiment_id: str,
    package_dir: Path,
    manifest: dict,
    model: str,
    entry: dict,
    report: Mapping[str, Any] | None,
    registered: str,
    policy: RetryPolicy,
) -> tuple[str, Registered]:
    specs = [InputSpec.from_dict(d) for d in manifest.get("input_specs", [])]
    params = _params(manifest, model, entry)
    metrics = metrics_for(manifest, report, _package_bytes(package_dir))
    now = int(time.time() * 1000)
    call_with_retry(
        lambda: mlclient.log_batch(
            run_id,
            metrics=[Metric(k, v, now, 0) for k, v in sorted(metrics.items())],
            params=[Param(k, v) for k, v in sorted(params.items())],
            tags=[RunTag("kiln.input_ranges", version_tags(manifest, model)["input_ranges"])],
        ),
        f"log params and metrics of {model}",
        policy,
    )
    with tempfile.TemporaryDirectory(prefix="kiln-mlflow-") as tmp:
        tmp_path = Path(tmp)
        files = {
            "input_specs.json": {"inputs": [s.to_dict() for s in specs]},
            "manifest.json": manifest,
            "compile_report.json": manifest.get("report"),
            "validation.json": _validation(manifest, report),
        }
        if report is not None:
            files["pipeline_report.json"] = dict(report)
        for name, data in files.items():
            (tmp_path / name).write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
        where = ", ".join(str(manifest.get(k)) for k in ("backend", "precision", "target_device"))
        title = f"{model} ({where})"
        latency_chart(_validation(manifest, report), title, tmp_path / "latency.png")
        call_with_retry(lambda: mlclient.log_artifacts(run_id, tmp), f"log artifacts of {model}", policy)

    op_modules = op_modules_for(entry)

    def log_model() -> Any:
        logged = mlclient.create_logged_model(
            experiment_id,
            name=MODEL_ARTIFACT,
            source_run_id=run_id,
            params=params,
            tags={TAG_CONTENT_HASH: manifest["content_hash"]},
        )
        try:
            return Model.log(
                artifact_path=None,
                name=MODEL_ARTIFACT,
                flavor=mlflow.pyfunc,
                run_id=run_id,
                model_id=logged.model_id,
                python_model=KilnPackageModel(op_modules),
                artifacts={PACKAGE_ARTIFACT: str(package_dir)},
                code_paths=_code_paths(op_modules),
                signature=signature_for(specs),
                pip_requirements=_requirements(str(manifest.get("backend", ""))),
                metadata={"kiln_content_hash": manifest["content_hash"], "kiln_model": model},
            )
        except BaseException:
            with contextlib.suppress(Exception):
                mlclient.finalize_logged_model(logged.model_id, "FAILED")
            raise

    info = call_with_retry(log_model, f"log the package of {model} as an MLflow model", policy)
    tags = version_tags(manifest, model, entry)
    registered_version = register_version(
        mlclient,
        registered,
        source=info.model_uri,
        run_id=run_id,
        model_id=info.model_id,
        tags=tags,
        policy=policy,
    )

    def finish() -> None:
        mlclient.log_batch(
            run_id,
            tags=[
                RunTag(TAG_REGISTERED, registered),
                RunTag(TAG_VERSION, registered_version.version),
                RunTag("kiln.model_uri", info.model_uri),
                RunTag(TAG_COMPLETE, "true"),
            ],
        )
        mlclient.set_terminated(run_id, "FINISHED")

    call_with_retry(finish, f"finish the run of {model}", policy)
    return info.model_uri, registered_version


def _mark_failed(mlclient: MlflowClient, run_id: str, exc: BaseException) -> None:
    """Best effort: a short retry, since the server may be the thing that failed."""
    quick = RetryPolicy(attempts=2, base_delay=0.5, max_delay=1.0)

    def mark() -> None:
        mlclient.set_tag(run_id, TAG_ERROR, f"{type(exc).__name__}: {exc}"[:4900])
        mlclient.set_terminated(run_id, "FAILED")

    try:
        call_with_retry(mark, "mark the run failed", quick)
    except Exception as mark_exc:  # the next record_package call finds and resumes the run
        log.warning("could not mark run %s failed (%s); a re-run resumes it", run_id, mark_exc)


@contextlib.contextmanager
def zoo_run(
    name: str = "zoo",
    params: Mapping[str, Any] | None = None,
    *,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
) -> Iterator[str]:
    """A parent run for one zoo recompile; ``record_package`` calls inside nest under it.

    Yields the run id (pass it on explicitly as ``parent_run_id`` where work leaves this context,
    e.g. to Dask workers). The run ends ``FINISHED``, or ``FAILED`` if the block raised.
    """
    run_id = start_zoo_run(name, params, experiment=experiment, tracking_uri=tracking_uri, policy=policy)
    token = _zoo_run.set(run_id)
    status = "FAILED"
    try:
        yield run_id
        status = "FINISHED"
    finally:
        _zoo_run.reset(token)
        end_run(run_id, status, tracking_uri=tracking_uri, policy=policy)


def start_zoo_run(
    name: str = "zoo",
    params: Mapping[str, Any] | None = None,
    *,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
) -> str:
    mlclient = config.client(tracking_uri)
    experiment_id = config.ensure_experiment(mlclient, experiment, policy)

    def create() -> str:
        run = mlclient.create_run(experiment_id, tags={"mlflow.runName": name, TAG_KIND: "zoo"})
        if params:
            mlclient.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in sorted(params.items())])
        return run.info.run_id

    return call_with_retry(create, f"start zoo run {name}", policy)


def current_zoo_run() -> str | None:
    """The parent run set by :func:`zoo_run` in this context, or ``$KILN_MLFLOW_PARENT_RUN_ID``."""
    return _zoo_run.get() or os.environ.get(PARENT_ENV) or None


def zoo_run_for(
    key: str,
    name: str,
    *,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
) -> str:
    """The zoo run for an outside run id (e.g. the Prefect zoo flow run): found by tag, else created.

    Models of one zoo compile in parallel, so find-or-create runs under a lock; should two hosts
    still race, the oldest run with the key is the one every caller returns.
    """
    from registry.models import registry_lock

    mlclient = config.client(tracking_uri)
    experiment_id = config.ensure_experiment(mlclient, experiment, policy)
    query = f"tags.`{TAG_ZOO_KEY}` = '{key}'"

    def find() -> str | None:
        runs = mlclient.search_runs(
            [experiment_id], filter_string=query, max_results=10, order_by=["attributes.start_time ASC"]
        )
        return runs[0].info.run_id if runs else None

    with registry_lock(mlclient, f"zoo-run:{key}"):
        found = call_with_retry(find, f"find zoo run {key}", policy)
        if found:
            return found
        tags = {"mlflow.runName": name, TAG_KIND: "zoo", TAG_ZOO_KEY: key}
        call_with_retry(
            lambda: mlclient.create_run(experiment_id, tags=tags), f"start zoo run {name}", policy
        )
        return call_with_retry(find, f"find zoo run {key}", policy) or ""


def end_run(
    run_id: str,
    status: str = "FINISHED",
    *,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
) -> None:
    mlclient = config.client(tracking_uri)
    try:
        call_with_retry(lambda: mlclient.set_terminated(run_id, status), f"end run {run_id}", policy)
    except RegistryUnavailableError as exc:
        log.warning("could not end run %s: %s", run_id, exc)
