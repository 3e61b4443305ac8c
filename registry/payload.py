"""What MLflow records about a package, computed from its typed :class:`compiler.package.manifest.Manifest`.

Pure: no MLflow server is contacted here (:mod:`registry.tracking` does that). A run holds:

* params: model, backend + library version, engine target, precision, strip, the partitioning
  settings (``min_block_size``, ``torch_executed_ops``, ``split_modules``), the source URI,
  kiln/torch/format versions;
* metrics: accuracy per output (``rel_l2.<output>``, ``max_abs.<output>``, ``cosine.<output>``,
  ``top1_agreement.<output>`` where the output has a class axis) and over the model, the samples
  compared and the recorded samples skipped (``validation_samples``, ``validation_skipped``),
  eager/compiled latency median and p95 and their ratio, build seconds (total and per stage),
  partitions, unique engines, engines built, cache hits, refits, engine and package bytes, and what
  an accuracy repair did (``repair.steps``, ``repair.rounds``, ``repair.engines_built``, ...);
* artifacts: ``input_specs.json``, ``manifest.json``, ``compile_report.json``, ``validation.json``,
  ``request.json`` (the compile request, as data), ``accuracy_repair.json`` (every repair decision,
  when a repair ran), ``latency.png``;
* the validation data as a run input (MLflow dataset tracking, :func:`dataset_input_for`) when
  accuracy was measured on recorded data;
* a description (markdown) naming the source, with links to an MLflow source's version and run
  (:func:`description_for`);
* the logged model's signature (``TensorSpec``, ``-1`` for dynamic dims; the ranges are in the spec
  JSON), an input example at the smallest shapes the specs allow, its pip requirements (pinned; the
  engine library at the version that built the engines) and its code paths (the loader, and the
  packages of the package's recorded op modules).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePath
from typing import Any
from urllib.parse import quote

import numpy as np
from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.models import ModelSignature
from mlflow.types.schema import Schema, TensorSpec
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from compiler.inputs.specs import InputSpec
from compiler.package.manifest import Manifest
from compiler.validation.report import ValidationReport
from registry.errors import RegistryError
from registry.models import models_uri_parts

# The pip distribution each engine backend needs at serving time (none: runs on torch / onnxruntime,
# which every package requires anyway). Backend names are the compiler's ("tensorrt-rtx").
ENGINE_LIBRARIES: dict[str, str] = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt-rtx"}
BASE_REQUIREMENTS = ("torch", "numpy", "safetensors", "onnx", "onnxruntime")


def request_data(request: Any) -> dict[str, Any] | None:
    """The compile request as plain data (``to_dict()`` or a mapping); tags and artifacts hold it as
    data only: nothing in it is ever imported or called."""
    if request is None:
        return None
    if hasattr(request, "to_dict"):
        data = request.to_dict()
    elif isinstance(request, Mapping):
        data = dict(request)
    else:
        raise RegistryError(f"request must have to_dict() or be a mapping, got {type(request).__name__}")
    return json.loads(json.dumps(data, sort_keys=True, default=str))


def params_for(manifest: Manifest, model: str) -> dict[str, str]:
    options = manifest.options
    params = {
        "model": model,
        "backend": manifest.backend,
        "backend_version": manifest.backend_version,
        "engine_target": manifest.engine_target,
        "precision": manifest.precision,
        "strip_weights": manifest.strip_weights,
        "min_block_size": options.min_block_size,
        "torch_executed_ops": json.dumps(list(options.torch_executed_ops)),
        "split_modules": json.dumps(
            options.split_modules
            if isinstance(options.split_modules, str | None)
            else list(options.split_modules)
        ),
        "device": options.device,
        "cuda_graphs": options.cuda_graphs,
        "profiles": json.dumps([dict(p) for p in options.profiles]) if options.profiles else "",
        "source": manifest.source.uri if manifest.source else "",
        "kiln_version": manifest.kiln_version,
        "torch_version": manifest.torch_version,
        "format_version": manifest.format_version,
    }
    return {k: str(v) for k, v in params.items() if str(v) != ""}


def metrics_for(manifest: Manifest, package_bytes: int) -> dict[str, float]:
    """Flat metrics of a package: accuracy per output, latency, build and engine counts, sizes."""
    report = manifest.report
    metrics: dict[str, float] = {
        "package_bytes": float(package_bytes),
        "partitions": float(len(report.partitions)),
        "unique_engines": float(report.unique_fingerprints),
        "engines_built": float(report.engines_built),
        "cache_hits": float(report.cache_hits),
        "refits": float(report.refits),
        "engine_bytes": float(report.engine_bytes),
        "fallback_ops": float(sum(report.fallback_ops.values())),
    }
    for stage, seconds in report.stage_seconds.items():
        metrics[f"seconds.{stage}"] = float(seconds)
    for row in report.profiles or []:  # shape profiles: "profile_ms.batch_8.seq_128"
        name = ".".join(f"{dim}_{size}" for dim, size in sorted(row["profile"].items()))
        metrics[f"profile_ms.{name}"] = float(row["latency_ms"])
    if report.stage_seconds:
        metrics["build_seconds"] = float(sum(report.stage_seconds.values()))
    validation = manifest.validation
    if validation is not None:
        for row in validation.outputs:
            for key in ("rel_l2", "max_abs", "cosine"):
                metrics[f"{key}.{row.output}"] = float(getattr(row, key))
            if row.top1_agreement is not None:
                metrics[f"top1_agreement.{row.output}"] = float(row.top1_agreement)
        if validation.min_top1_agreement is not None:
            metrics["min_top1_agreement"] = float(validation.min_top1_agreement)
        metrics["max_abs"] = float(validation.max_abs)
        metrics["validation_samples"] = float(validation.samples)
        metrics["validation_skipped"] = float(len(validation.skipped))
        for side, latency in (("eager", validation.eager), ("compiled", validation.compiled)):
            metrics[f"{side}_median_ms"] = float(latency.median_ms)
            metrics[f"{side}_p95_ms"] = float(latency.p95_ms)
        metrics["max_rel_l2"] = float(validation.max_rel_l2)
        metrics["min_cosine"] = float(validation.min_cosine)
        metrics["latency_ratio"] = float(validation.latency_ratio)
    repair = report.accuracy_repair
    if repair:
        metrics["repair.steps"] = float(len(repair.get("steps", ())))
        for key in ("rounds", "engines_built", "engines_from_cache", "build_seconds", "seconds"):
            if key in repair:
                metrics[f"repair.{key}"] = _number(repair[key])
        searches = repair.get("searches") or ()
        metrics["repair.layers_raised"] = float(
            sum(len(s.get("raised", ())) for s in searches if s.get("passed"))
        )
        for key in ("weights", "flops"):
            value = (repair.get("kept") or {}).get(key)
            if value is not None:
                metrics[f"repair.kept.{key}"] = _number(value)
        if repair.get("budget_seconds") is not None:
            metrics["repair.budget_seconds"] = _number(repair["budget_seconds"])
        for point in ("before", "after"):
            for key in ("max_rel_l2", "min_cosine", "min_top1_agreement"):
                value = (repair.get(point) or {}).get(key)
                if value is not None:
                    metrics[f"repair.{point}.{key}"] = _number(value)
    quantization = report.quantization
    if quantization:
        metrics["quantization.calibration_samples"] = float(quantization.get("samples", 0))
        metrics["quantization.partitions"] = float(len(quantization.get("partitions", ())))
        metrics["quantization.fallbacks"] = float(len(quantization.get("fallbacks", {})))
        metrics["quantization.seconds"] = _number(quantization.get("seconds", 0.0))
    if validation is not None:
        # The plan the gate chose: each partition's precision, its own error and its time.
        for row in validation.precision_plan:
            metrics[f"partition.{row['partition']}.rel_l2"] = _number(row["rel_l2"])
            metrics[f"partition.{row['partition']}.latency_ms"] = _number(row["latency_ms"])
    return {k: v for k, v in metrics.items() if np.isfinite(v)}


def _number(value: Any) -> float:
    # RepairRecord.to_dict writes non-finite values as strings ("inf"); those are dropped as metrics.
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def artifacts_for(
    manifest: Manifest, request: dict[str, Any] | None, report: Mapping[str, Any] | None
) -> dict[str, Any]:
    """JSON artifacts of a run: file name -> data."""
    files: dict[str, Any] = {
        "input_specs.json": {"inputs": [s.to_dict() for s in manifest.input_specs]},
        "manifest.json": manifest.to_json(),
        "compile_report.json": manifest.report.to_dict(),
        "validation.json": manifest.validation.to_dict() if manifest.validation else None,
    }
    if request is not None:
        files["request.json"] = request
    if manifest.report.accuracy_repair:
        files["accuracy_repair.json"] = manifest.report.accuracy_repair
    if manifest.validation is not None and manifest.validation.precision_plan:
        files["precision_plan.json"] = {"partitions": manifest.validation.precision_plan}
    if manifest.report.quantization:
        files["quantization.json"] = manifest.report.quantization
    if report is not None:
        files["pipeline_report.json"] = dict(report)
    return files


REPORT_ARTIFACT = "report.html"


def report_link(experiment_id: str, run_id: str) -> str:
    """Markdown linking the run's compile report (``kiln report``'s page, logged as an artifact)."""
    route = f"#/experiments/{quote(experiment_id, safe='')}/runs/{quote(run_id, safe='')}"
    return (
        f"Compile report (HTML, opens offline): [{REPORT_ARTIFACT}]({route}/artifactPath/{REPORT_ARTIFACT})."
    )


def description_for(manifest: Manifest, report: str | None = None) -> str | None:
    """Markdown for the version's (and run's) description: where the compiled model came from, and
    ``report`` (:func:`report_link`) where the run has its compile report.

    For an MLflow source (``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``) it links to the
    resolved source version (``#/models/NAME/versions/N``) and the source run (``#/runs/RUN_ID``),
    routes of the MLflow UI relative to the page that shows them. None without a recorded source and
    report. Everything in it is data from the manifest, shown as code: nothing in it is ever run.
    """
    source = manifest.source
    if source is None:
        return report
    uri = _code(source.uri)
    parts = models_uri_parts(source.uri) if source.kind == "mlflow" else None
    if parts is not None and source.version:
        name = parts[0]
        link = f"#/models/{quote(name, safe='')}/versions/{quote(source.version, safe='')}"
        text = f"Compiled by kiln from {uri}: [{_code(f'{name} version {source.version}')}]({link})"
    else:
        what = f" (version {_code(source.version)})" if source.version else ""
        text = f"Compiled by kiln from {uri}{what}"
    lines = [text + "."]
    if source.run_id:
        lines.append(f"Source run: [{_code(source.run_id)}](#/runs/{quote(source.run_id, safe='')}).")
    if source.identity:
        lines.append(f"Source identity: {_code(source.identity)}.")
    if report:
        lines.append(report)
    return "\n\n".join(lines)


def _code(text: str) -> str:
    # Inline code: markdown in a tag value is shown, never interpreted (no links or HTML of its own).
    return "`" + str(text).replace("`", "'").replace("\n", " ") + "`"


# MLflow stores a dataset digest in 36 characters (MAX_DATASET_DIGEST_SIZE); the full sha256 is in
# the dataset's profile and in the input's tag.
DATASET_DIGEST_CHARS = 36
TAG_DATASET_SHA256 = "kiln.sha256"
_RECORDED = re.compile(r"^(?P<label>.+) sha256:(?P<sha256>[0-9a-f]{64})$")
_COLUMN = re.compile(r"^(?P<path>.+)\[(?P<column>[^\[\]/]+)\]$")  # a datasets folder + its column


def recorded_data(validation: ValidationReport | None) -> dict[str, str] | None:
    """The recorded validation data a report names (path, sha256, name, column), or None when the
    report used random inputs or an in-memory mapping (no path to point at)."""
    if validation is None:
        return None
    return _recorded_source(validation.data_source)


def _recorded_source(text: str | None) -> dict[str, str] | None:
    match = _RECORDED.match(text or "")
    if match is None or match["label"] == "<mapping>":
        return None
    label, column = match["label"], ""
    folder = _COLUMN.match(label)
    if folder is not None:  # compiler.inputs.hf_data: "<folder>[<column>] sha256:<hex>"
        label, column = folder["path"], folder["column"]
    name = PurePath(label).name or label
    return {
        "path": label,
        "sha256": match["sha256"],
        "name": f"{name}[{column}]" if column else name,
        "column": column,
    }


def dataset_input_for(manifest: Manifest) -> DatasetInput | None:
    """The validation data as an MLflow run input (context ``validation``): name, digest (the sha256,
    cut to MLflow's 36 characters), source (the path, a local dataset source), schema (the input
    specs as a tensor schema), profile (full sha256, samples compared, samples skipped). None when
    validation did not use recorded data. Only metadata is logged, never the data."""

    validation = manifest.validation
    data = recorded_data(validation)
    if data is None or validation is None:
        return None
    profile = {"sha256": data["sha256"], "samples": validation.samples, "skipped": len(validation.skipped)}
    return _dataset_input(manifest, data, profile, "validation")


def calibration_input_for(manifest: Manifest) -> DatasetInput | None:
    """The calibration data of an int8 compile as an MLflow run input (context ``calibration``), like
    :func:`dataset_input_for`; the profile counts the samples calibrated on. None without recorded
    calibration data (dynamic quantization, random or in-memory inputs)."""
    record = manifest.report.quantization or {}
    data = _recorded_source(record.get("data_source"))
    if data is None:
        return None
    profile = {"sha256": data["sha256"], "samples": int(record.get("samples", 0)), "skipped": 0}
    return _dataset_input(manifest, data, profile, "calibration")


def _dataset_input(
    manifest: Manifest, data: dict[str, str], profile: dict[str, Any], context: str
) -> DatasetInput:
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.schema import TensorDatasetSchema

    with warnings.catch_warnings():  # a local path matches MLflow's "" and "file" sources alike
        warnings.simplefilter("ignore", UserWarning)
        source = resolve_dataset_source(data["path"])
    meta = MetaDataset(source, name=data["name"], digest=data["sha256"][:DATASET_DIGEST_CHARS]).to_dict()
    signature = signature_for(manifest.input_specs)
    schema = None
    if signature is not None:
        schema = json.dumps(TensorDatasetSchema(features=signature.inputs).to_dict())
    if data["column"]:
        profile["column"] = data["column"]
    dataset = Dataset(
        name=meta["name"],
        digest=meta["digest"],
        source_type=meta["source_type"],
        source=meta["source"],
        schema=schema,
        profile=json.dumps(profile, sort_keys=True),
    )
    return DatasetInput(
        dataset,
        tags=[InputTag(MLFLOW_DATASET_CONTEXT, context), InputTag(TAG_DATASET_SHA256, data["sha256"])],
    )


def latency_chart(validation: ValidationReport | None, title: str, path: Path) -> Path | None:
    """Eager vs compiled latency (median bars, p95 markers) as a PNG; None without validation."""
    if validation is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = ["eager", "compiled"]
    medians = [float(validation.eager.median_ms), float(validation.compiled.median_ms)]
    p95s = [float(validation.eager.p95_ms), float(validation.compiled.p95_ms)]
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


def model_signature(package_dir: Path, manifest: Manifest) -> ModelSignature | None:
    """The logged model's signature: :func:`signature_for` its input specs, or for a generation package
    how ``generate`` is called (:func:`registry.generation.generation_signature`)."""
    from registry.generation import generation_signature, read_spec

    spec = read_spec(Path(package_dir), manifest)
    return signature_for(manifest.input_specs) if spec is None else generation_signature(spec)


def model_input_example(package_dir: Path, manifest: Manifest) -> Any:
    """The logged model's input example, matching :func:`model_signature`."""
    from registry.generation import generation_example, read_spec

    spec = read_spec(Path(package_dir), manifest)
    return input_example_for(manifest.input_specs) if spec is None else generation_example(spec)


def signature_for(specs: Iterable[InputSpec]) -> ModelSignature | None:
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


def input_example_for(specs: Iterable[InputSpec]) -> dict[str, np.ndarray] | None:
    """The logged model's ``input_example``, one valid array per input: the smallest shape the ranges
    allow (at least 1 on a dynamic axis), filled with the low end of an integer input's recorded value
    range (token ids stay inside the vocabulary, masks keep their value), else zeros.

    MLflow checks it against :func:`signature_for` and serves it once when the model is logged (load +
    predict: the logged model is known to answer); without one it warns on every log. None where there
    is no signature (bfloat16)."""
    example = {}
    for spec in specs:
        try:
            dtype = np.dtype(spec.dtype)
        except TypeError:
            return None
        shape = tuple(
            lo if lo >= 1 else min(1, hi) for lo, hi in zip(spec.min_shape, spec.max_shape, strict=True)
        )
        fill = spec.value_range[0] if spec.value_range is not None else 0
        example[spec.name] = np.full(shape, fill, dtype=dtype)
    return example


def requirement_names(backends: Iterable[str]) -> list[str]:
    """The pip distributions a package whose engines run on ``backends`` needs (unpinned)."""
    names = list(BASE_REQUIREMENTS)
    for backend in sorted(set(backends)):
        library = ENGINE_LIBRARIES.get(backend)
        if library is not None and library not in names:
            names.append(library)
    return names


def requirements_for(manifest: Manifest) -> list[str]:
    """Pinned requirements: the engine library at the version that built the engines (they only load
    there), the rest at this machine's versions (public releases: ``2.13.0+cpu`` -> ``2.13.0``)."""
    backends = {manifest.backend, *manifest.engine_backends().values()}
    engine_library = ENGINE_LIBRARIES.get(manifest.backend)
    reqs = []
    for name in requirement_names(backends):
        if name == engine_library and manifest.backend_version:
            reqs.append(f"{name}=={manifest.backend_version}")
            continue
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            reqs.append(name)  # built elsewhere (a GPU host): still needed where the model is served
            continue
        reqs.append(f"{name}=={version.split('+')[0]}")
    return reqs


def code_paths(op_modules: Iterable[str]) -> list[str]:
    """compiler + registry (the loader), and the top-level package of each op module (its custom ops).

    The op modules are the package's own recorded list (its manifest), never a registry tag.
    """
    paths = []
    for package in ("compiler", "registry"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise RegistryError(f"cannot find the {package!r} package to ship with the logged model")
        paths.append(str(Path(next(iter(spec.submodule_search_locations)))))
    for module in op_modules:
        spec = importlib.util.find_spec(module.split(".")[0])
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
