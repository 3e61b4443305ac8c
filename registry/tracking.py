"""Tracking: one MLflow run per compiled package, nested under the zoo run when there is one.

What a run holds (params, metrics, artifacts, signature, requirements) is computed from the package's
typed manifest by :mod:`registry.payload`; this module handles the runs: create or resume, log,
register the package as a version of ``kiln.<model>.<engine target>`` (:mod:`registry.models`), finish.
The package itself is the logged model (``python_function`` flavour, see :mod:`registry.pyfunc`).

Signing: with ``$KILN_SIGNING_PRIVATE_KEY`` set, the package that is uploaded (the copy inside the logged
model, never the caller's directory) is signed in model-signing's format (``model.sig``,
:mod:`compiler.package.signing`) after it is verified, so every version recorded this way is one that
look-ups with the matching public key accept and trust.

Failure handling: every call retries with back-off (:mod:`registry.config`). If the server stays away,
the run is marked ``FAILED`` where the server can still be told, the package on disk is never touched,
and :class:`RegistryUnavailableError` says so. Calling :func:`record_package` again resumes the same
run (found by the package's content hash) and completes it; a package already recorded is not
logged twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric, Param, RunTag
from mlflow.models.model import Model
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NOTE

from compiler.package.check import read_manifest
from compiler.package.manifest import SIGNATURE, Manifest
from compiler.package.report_map import SplitGraph, read_split_graph
from compiler.package.report_page import render_report
from compiler.package.signing import Signer, sign_package
from registry import config, payload
from registry.config import RetryPolicy, call_with_retry, log_inputs
from registry.errors import RegistryUnavailableError
from registry.generation import generation_metrics
from registry.lookup import package_in
from registry.models import (
    TAG_CONTENT_HASH,
    Registered,
    content_hash_of,
    lineage_tags,
    register_version,
    registered_model_name,
    version_tags,
    versions_with_hash,
    versions_with_meaning,
)
from registry.pyfunc import PACKAGE_ARTIFACT, KilnPackageModel
from registry.transfer import ProgressCallback, upload_model_dir
from registry.zoo_runs import TAG_ERROR, TAG_KIND, current_zoo_run
from zoo.sources.staging import staging_dir

log = logging.getLogger("kiln.registry")

MODEL_ARTIFACT = "model"
TAG_MODEL = "kiln.model"
TAG_COMPLETE = "kiln.complete"
TAG_PACKAGE_DIR = "kiln.package_dir"
TAG_VERSION = "kiln.model_version"
TAG_REGISTERED = "kiln.registered_model"
# Which process holds a zoo run open: a later zoo run on the same host ends the runs of dead processes.


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


def _package_bytes(package_dir: Path) -> int:
    return sum(p.stat().st_size for p in package_dir.rglob("*") if p.is_file())


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
    model: str,
    request: Any = None,
    report: Mapping[str, Any] | None = None,
    *,
    parent_run_id: str | None = None,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
    on_progress: ProgressCallback | None = None,
) -> RecordResult:
    """Log a validated package as a run + logged model and register it; idempotent and resumable.

    ``model`` names the registered model (``kiln.<model>.<engine target>``). ``request``: the compile
    request (``zoo.request.CompileRequest``, or anything with ``to_dict()``, or a mapping), recorded as
    data (a tag and ``request.json``), never imported or called. ``report``: the pipeline's report,
    logged as ``pipeline_report.json``. ``on_progress``: called after each uploaded file with the bytes
    done and total (:class:`registry.transfer.Progress`); without it a terminal shows a progress bar.
    Either way ``kiln.registry`` logs the progress every 10 % or 5 s.
    """
    package_dir = Path(package_dir).resolve()
    signer = Signer.from_env()  # a bad signing configuration fails before anything is recorded
    # Verify before touching MLflow: a corrupt package must never be registered. One this process is
    # about to sign need not be signed yet (its copy is verified again once signed). Its split graph
    # too (the report's map reads it): a malformed one is refused here, not in the middle of a run.
    manifest = read_manifest(package_dir, signature=signer is None)
    split = read_split_graph(package_dir, manifest)
    request_json = payload.request_data(request)
    content_hash = manifest.content_hash
    policy = policy or RetryPolicy.from_env()
    mlclient = config.client(tracking_uri)
    experiment_id = config.ensure_experiment(mlclient, experiment, policy)
    registered = registered_model_name(model, manifest.engine_target)

    previous = _find_runs(mlclient, experiment_id, content_hash, model, policy)
    done = _recorded_already(
        mlclient, experiment_id, previous, registered, manifest, model, request_json, policy
    )
    if done is not None:
        return done
    run_id, resumed = _run_to_fill(
        mlclient, experiment_id, previous, package_dir, manifest, model, parent_run_id, policy
    )
    try:
        recording = _Recording(
            mlclient, run_id, experiment_id, package_dir, manifest, model, request_json, report, registered
        )
        model_uri, version = _log_and_register(recording, policy, on_progress, signer, split)
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
        run_id, model_uri, registered, version.version, content_hash, version.created, resumed, False
    )


def _recorded_already(
    mlclient: MlflowClient,
    experiment_id: str,
    previous: list[Any],
    registered: str,
    manifest: Any,
    model: str,
    request_json: Any,
    policy: RetryPolicy,
) -> RecordResult | None:
    """The record of this package where a complete run of it exists (its version registered again if
    it was deleted since), or where another worker registered an equal package; else None."""
    from compiler.package.digest import meaning_hash

    content_hash = manifest.content_hash
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
                    tags=version_tags(manifest, model, request_json),
                    policy=policy,
                    description=payload.description_for(
                        manifest, payload.report_link(experiment_id, run.info.run_id)
                    ),
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
    # The same package from another worker (equal but for its measured latencies) is registered
    # already: that version is this package's, and nothing is uploaded again.
    same = versions_with_meaning(mlclient, registered, meaning_hash(manifest.to_json()), policy)
    if same:
        version = same[0]
        return RecordResult(
            version.run_id or "",
            version.source,
            registered,
            str(version.version),
            content_hash_of(version.tags),
            created=False,
            resumed=False,
            already_recorded=True,
        )
    return None


def _run_to_fill(
    mlclient: MlflowClient,
    experiment_id: str,
    previous: list[Any],
    package_dir: Path,
    manifest: Any,
    model: str,
    parent_run_id: str | None,
    policy: RetryPolicy,
) -> tuple[str, bool]:
    """(the run to log into, whether it is resumed): an interrupted run of this package, else a new one."""
    content_hash = manifest.content_hash
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
            "mlflow.runName": f"{model}-{manifest.backend}-{manifest.engine_target}",
        }
        parent = _parent_run_id(parent_run_id)
        if parent:
            tags["mlflow.parentRunId"] = parent
        run_id = call_with_retry(
            lambda: mlclient.create_run(experiment_id, tags=tags).info.run_id,
            f"create run for {model}",
            policy,
        )
    return run_id, resumed


@dataclass(frozen=True)
class _Recording:
    """One package being recorded into one run: what each step of recording it reads."""

    mlclient: MlflowClient
    run_id: str
    experiment_id: str
    package_dir: Path
    manifest: Manifest
    model: str
    request: dict[str, Any] | None
    report: Mapping[str, Any] | None
    registered: str


def _log_and_register(
    recording: _Recording,
    policy: RetryPolicy,
    on_progress: ProgressCallback | None = None,
    signer: Signer | None = None,
    split: SplitGraph | None = None,
) -> tuple[str, Registered]:
    mlclient, run_id, experiment_id = recording.mlclient, recording.run_id, recording.experiment_id
    package_dir, manifest, model = recording.package_dir, recording.manifest, recording.model
    request, registered = recording.request, recording.registered
    params = payload.params_for(manifest, model)
    metrics = payload.metrics_for(manifest, _package_bytes(package_dir))
    metrics.update(generation_metrics(package_dir, manifest))  # TTFT, tokens/s, token agreement
    tags = version_tags(manifest, model, request)
    description = payload.description_for(manifest, payload.report_link(experiment_id, run_id))
    # The run carries the version's lineage too (source, validation data, repair), and the same
    # description (MLflow's run note), so either page leads to the source.
    run_tags = {"kiln.input_ranges": tags["input_ranges"], **lineage_tags(manifest)}
    if description:
        run_tags[MLFLOW_RUN_NOTE] = description
    _log_run_data(recording, params, metrics, run_tags, policy)
    _log_run_artifacts(recording, signer, split, policy)

    def create_logged_model() -> Any:
        return mlclient.create_logged_model(
            experiment_id,
            name=MODEL_ARTIFACT,
            source_run_id=run_id,
            params=params,
            tags={TAG_CONTENT_HASH: manifest.content_hash},
        )

    logged = call_with_retry(create_logged_model, f"create the logged model of {model}", policy)
    size, seconds = _upload_logged_model(recording, logged, signer, on_progress, policy)
    log.info("uploaded %s: %.1f MB in %.1fs (%.1f MB/s)", model, size / 1e6, seconds, size / 1e6 / seconds)
    model_uri = f"models:/{logged.model_id}"
    registered_version = register_version(
        mlclient,
        registered,
        source=model_uri,
        run_id=run_id,
        model_id=logged.model_id,
        tags=tags,
        policy=policy,
        description=description,
    )

    def finish() -> None:
        mlclient.log_batch(
            run_id,
            tags=[
                RunTag(TAG_REGISTERED, registered),
                RunTag(TAG_VERSION, registered_version.version),
                RunTag("kiln.model_uri", model_uri),
                RunTag(TAG_COMPLETE, "true"),
            ],
        )
        mlclient.set_terminated(run_id, "FINISHED")

    call_with_retry(finish, f"finish the run of {model}", policy)
    return model_uri, registered_version


def _log_run_data(
    recording: _Recording,
    params: dict[str, str],
    metrics: dict[str, float],
    run_tags: dict[str, str],
    policy: RetryPolicy,
) -> None:
    """The run's params, metrics and tags, and its validation and calibration data as inputs."""
    mlclient, run_id, manifest, model = (
        recording.mlclient,
        recording.run_id,
        recording.manifest,
        recording.model,
    )
    now = int(time.time() * 1000)
    call_with_retry(
        lambda: mlclient.log_batch(
            run_id,
            metrics=[Metric(k, v, now, 0) for k, v in sorted(metrics.items())],
            params=[Param(k, v) for k, v in sorted(params.items())],
            tags=[RunTag(k, v) for k, v in sorted(run_tags.items())],
        ),
        f"log params and metrics of {model}",
        policy,
    )
    datasets = [
        d for d in (payload.dataset_input_for(manifest), payload.calibration_input_for(manifest)) if d
    ]
    if datasets:
        # Idempotent on the server (one input per dataset name + digest and run): safe on resume.
        call_with_retry(
            lambda: log_inputs(mlclient, run_id, datasets),
            f"log the validation and calibration data of {model}",
            policy,
        )


def _log_run_artifacts(
    recording: _Recording, signer: Signer | None, split: SplitGraph | None, policy: RetryPolicy
) -> None:
    """The run's JSON artifacts (request, report, ...), latency chart and report page."""
    mlclient, run_id, package_dir = recording.mlclient, recording.run_id, recording.package_dir
    manifest, model, registered = recording.manifest, recording.model, recording.registered
    request, report = recording.request, recording.report
    with staging_dir("record") as tmp_path:
        tmp = str(tmp_path)
        for name, data in payload.artifacts_for(manifest, request, report).items():
            (tmp_path / name).write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
        title = f"{model} ({manifest.backend}, {manifest.precision}, {manifest.engine_target})"
        payload.latency_chart(manifest.validation, title, tmp_path / "latency.png")
        # What the compile decided, as one page (kiln report): linked from the description.
        signed = signer is not None or (package_dir / SIGNATURE).is_file()
        page = render_report(manifest, f"{registered}: {model}", split, signed=signed)
        (tmp_path / payload.REPORT_ARTIFACT).write_text(page, encoding="utf-8")
        call_with_retry(lambda: mlclient.log_artifacts(run_id, tmp), f"log artifacts of {model}", policy)


def _upload_logged_model(
    recording: _Recording,
    logged: Any,
    signer: Signer | None,
    on_progress: ProgressCallback | None,
    policy: RetryPolicy,
) -> tuple[int, float]:
    """Save the package as a pyfunc model (signed where a signer is set), upload it file by file, link
    it to the run and mark it READY (FAILED on any error); (bytes uploaded, seconds)."""
    mlclient, run_id, package_dir = recording.mlclient, recording.run_id, recording.package_dir
    manifest, model = recording.manifest, recording.model
    # What MLflow's Model.log does, with the upload done file by file so that it reports progress:
    # save the pyfunc model locally, upload it (MLmodel last), link it to the run, mark it READY.
    before = set(sys.path)
    try:
        with staging_dir("model") as tmp:  # a copy of the package: swept if this process is killed
            local = tmp / MODEL_ARTIFACT
            mlflow.pyfunc.save_model(
                path=str(local),
                mlflow_model=Model(
                    artifact_path=logged.artifact_location,
                    model_uuid=logged.model_id,
                    run_id=run_id,
                    model_id=logged.model_id,
                ),
                # The loader may import the modules the verified manifest records, and only those.
                python_model=KilnPackageModel(allowed_modules=manifest.op_modules),
                artifacts={PACKAGE_ARTIFACT: str(package_dir)},
                code_paths=payload.code_paths(manifest.op_modules),
                signature=payload.model_signature(package_dir, manifest),  # generate's, for generation
                input_example=payload.model_input_example(package_dir, manifest),
                pip_requirements=payload.requirements_for(manifest),
                metadata={"kiln_content_hash": manifest.content_hash, "kiln_model": model},
            )
            if signer is not None:
                copy = package_in(local)
                sign_package(copy, signer)
                # As a look-up will check it (where this process has a verification key: a key that
                # does not match the signing one is found here, not by every later look-up).
                read_manifest(copy)
            started = time.monotonic()
            size = upload_model_dir(
                mlclient, logged.model_id, local, model, on_progress=on_progress, policy=policy
            )
            seconds = max(time.monotonic() - started, 1e-6)
        call_with_retry(
            lambda: mlclient.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)]),
            f"link the model of {model} to its run",
            policy,
        )
        call_with_retry(
            lambda: mlclient.finalize_logged_model(logged.model_id, LoggedModelStatus.READY),
            f"finalize the model of {model}",
            policy,
        )
    except BaseException:
        with contextlib.suppress(Exception):
            mlclient.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    finally:
        # Loading the model's input example may put the saved copy's code folder (a temporary
        # directory, gone now) first on sys.path: drop what it left.
        for gone in {p for p in sys.path if p not in before and not os.path.exists(p)}:
            sys.path.remove(gone)
    return size, seconds


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
