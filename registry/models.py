"""The model registry: one registered model per (model, engine target), idempotent versions, aliases.

Name scheme: ``kiln.<model>.<target>``, both parts lower-cased with every character outside
``[a-z0-9_-]`` replaced by ``_`` (``kiln.tiny_bert.cpu``, ``kiln.tiny_bert.cuda_sm_90``). The target
is the package's ``engine_target`` (engines are built for it); backend and precision are version
tags, so one registered model can hold ONNX Runtime and TensorRT builds of the same model side by side.
What a person types (``--target cuda``) becomes a registered target in ``registry.targets``.

Every version carries these tags (strings; all of them data, none ever imported or executed):

=========================  =========================================================================
``kiln.content_hash``      the package manifest's ``content_hash``: registering equal content returns
                           the existing version, never a second one (versions registered before this
                           name carry ``content_hash``; look-ups read both)
``kiln.meaning_hash``      the package's meaning (``compiler.package.digest.meaning_hash``: the
                           manifest without what the compile measured): makes registration idempotent across
                           workers, whose equal packages differ only in measured latencies
``model``                  the model's name (the compile request's)
``backend``                ``onnxruntime``, ``tensorrt``, ...; ``backend_version`` its library version
``engine_target``          ``cpu``, ``cuda:sm_90``, ... (older versions: ``target_device``)
``precision``              ``fp32`` / ``fp16`` / ``bf16``; ``strip_weights`` ``true`` / ``false``
``input_ranges``           human-readable ranges, e.g. ``x: float32 [1..32, 64] (batch=axis 0)``
``input_specs``            InputSpec JSON (``compiler.inputs.specs.specs_to_json``) look-ups match against
``op_modules``             JSON list of the modules the package needs imported (its manifest's list)
``kiln.source.*``          lineage, when the package records a source (``manifest.source``):
                           ``kiln.source.uri`` (as written: ``models:/fraud@production``),
                           ``.kind`` (``mlflow``, ``hf``, ...), ``.version`` (the resolved version or
                           revision), ``.identity`` (the source digest), ``.run_id`` (the source's MLflow
                           run). The run carries the same tags; versions registered between the typed
                           manifest and these names carry ``source_uri``, ...: look-ups read both
``kiln.validation.data``   what accuracy was measured on: ``random`` or ``<path> sha256:<hex>``
``kiln.accuracy_repair``   the repair decisions in one line each (``; ``-joined), when a repair ran
``request``                the compile request as JSON (``CompileRequest.to_dict()``), when it fits
``kiln_version``           the kiln that wrote the package; ``format_version`` its package format
=========================  =========================================================================

Release adds ``release_report`` (JSON of the measured gates) and, for a failed candidate,
``rejected`` (JSON list of reasons); a release forced past a broken champion tags the new champion
``replaced_broken_champion`` and the old one ``broken``; ``kiln rollback`` tags the demoted champion
``rolled_back``. Look-ups skip rejected and rolled-back versions. Aliases: ``champion`` (what look-ups
serve first) and ``previous`` (where ``kiln rollback`` goes without ``--to``).

A version with a recorded source gets a description (markdown, shown by the MLflow UI) naming the
source; for an MLflow source it links to the source model version (``#/models/NAME/versions/N``) and
its run (``#/runs/RUN_ID``): see :func:`registry.payload.description_for`.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from compiler import json_reader
from compiler.validation.report import precision_summary
from registry.config import RetryPolicy, call_with_retry

if TYPE_CHECKING:  # the manifest's module imports torch; a registry listing never needs it
    from compiler.inputs.specs import InputSpec
    from compiler.package.manifest import Manifest

PREFIX = "kiln"
CHAMPION = "champion"
PREVIOUS = "previous"

# One content-hash tag on runs, logged models and versions; versions registered before carry the old.
TAG_CONTENT_HASH = "kiln.content_hash"
LEGACY_TAG_CONTENT_HASH = "content_hash"
TAG_MEANING = "kiln.meaning_hash"
TAG_REJECTED = "rejected"
TAG_RELEASE_REPORT = "release_report"
TAG_ROLLED_BACK = "rolled_back"
TAG_INPUT_SPECS = "input_specs"
TAG_BROKEN = "broken"
TAG_REPLACED_BROKEN = "replaced_broken_champion"
# Lineage: kiln.source.uri, .kind, .version, .identity, .run_id (SourceRecord's fields).
TAG_SOURCE = "kiln.source."
LEGACY_SOURCE = "source_"
SOURCE_FIELDS = ("uri", "kind", "version", "identity", "run_id")
TAG_VALIDATION_DATA = "kiln.validation.data"
TAG_ACCURACY_REPAIR = "kiln.accuracy_repair"
# On the registered model, while a release or rollback moves aliases: {"op": ..., "aliases": {alias:
# version or null}}. Written before the first move, removed after the last; found by any later reader of
# the aliases (get_aliases), who finishes the moves: a kill between two moves never leaves half of them.
TAG_ALIAS_INTENT = "kiln.alias_intent"
ALIASES = (CHAMPION, PREVIOUS)
_VERSION_RE = re.compile(r"[0-9]{1,12}")
TAG_PRECISION_PLAN = "kiln.precision_plan"  # int8 compiles: the precision each partition got
TAG_CALIBRATION_DATA = "kiln.calibration_data"

_UNSAFE = re.compile(r"[^a-z0-9_-]+")
_TAG_LIMIT = 5000  # conservative: older servers cap registry tag values at 5000 characters


def _part(text: str, what: str) -> str:
    cleaned = _UNSAFE.sub("_", str(text).strip().lower()).strip("_")
    if not cleaned:
        raise ValueError(f"{what} {text!r} has no usable characters for a registered model name")
    return cleaned


def registered_model_name(model: str, target: str) -> str:
    """``kiln.<model>.<target>`` (see the module docstring for the character rules)."""
    return f"{PREFIX}.{_part(model, 'model name')}.{_part(target, 'target')}"


def ranges_text(specs: list[InputSpec] | tuple[InputSpec, ...]) -> str:
    """``x: float32 [1..32, 64] (batch=axis 0); mask: ...``: what a person reads in the registry UI."""
    parts = []
    for spec in specs:
        dims = ", ".join(
            f"{lo}..{hi}" if lo != hi else str(lo)
            for lo, hi in zip(spec.min_shape, spec.max_shape, strict=True)
        )
        named = ", ".join(f"{name}=axis {axis}" for axis, name in sorted(spec.dynamic_dims.items()))
        parts.append(f"{spec.name}: {spec.dtype} [{dims}]" + (f" ({named})" if named else ""))
    return "; ".join(parts)


def content_hash_of(tags: Mapping[str, str]) -> str:
    """A version's content hash, under the current tag name or the one versions had before."""
    return tags.get(TAG_CONTENT_HASH) or tags.get(LEGACY_TAG_CONTENT_HASH) or ""


def engine_target_of(tags: Mapping[str, str]) -> str:
    return tags.get("engine_target") or tags.get("target_device") or ""


def version_tags(manifest: Manifest, model: str, request: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The tags a version of this package carries (all strings, all data). ``request``: the compile
    request as plain data (``registry.payload.request_data``)."""
    from compiler.inputs.specs import specs_to_json
    from compiler.package.digest import meaning_hash

    specs = list(manifest.input_specs)
    tags = {
        TAG_CONTENT_HASH: manifest.content_hash,
        TAG_MEANING: meaning_hash(manifest.to_json()),
        "model": model,
        "backend": manifest.backend,
        "backend_version": manifest.backend_version,
        "engine_target": manifest.engine_target,
        "precision": manifest.precision,
        "strip_weights": str(manifest.strip_weights).lower(),
        "input_ranges": ranges_text(specs),
        TAG_INPUT_SPECS: specs_to_json(specs),
        "op_modules": json.dumps(list(manifest.op_modules)),
        "kiln_version": manifest.kiln_version,
        "format_version": str(manifest.format_version),
    }
    tags.update(lineage_tags(manifest))
    if request:
        text = json.dumps(request, sort_keys=True, default=str)
        if len(text) <= _TAG_LIMIT:
            tags["request"] = text
    return {k: v for k, v in tags.items() if v != ""}


def lineage_tags(manifest: Manifest) -> dict[str, str]:
    """Source lineage, validation data and repair decisions: tags of the version and of its run."""
    tags: dict[str, str] = {}
    source = manifest.source
    if source is not None:
        for field_name in SOURCE_FIELDS:
            tags[TAG_SOURCE + field_name] = str(getattr(source, field_name) or "")
    validation = manifest.validation
    if validation is not None:
        tags[TAG_VALIDATION_DATA] = _clip(validation.data_source)
    repair = manifest.report.accuracy_repair
    if repair:
        lines = repair.get("lines") or [
            f"{s.get('partition')}: {s.get('precision_before')} -> {s.get('precision_after')}"
            for s in repair.get("steps", [])
        ]
        tags[TAG_ACCURACY_REPAIR] = _clip("; ".join(str(line) for line in lines) or "no partition raised")
    quantization = manifest.report.quantization
    if quantization:
        tags[TAG_CALIBRATION_DATA] = _clip(str(quantization.get("data_source") or quantization.get("mode")))
    if validation is not None and validation.precision_plan:
        tags[TAG_PRECISION_PLAN] = _clip(precision_summary(validation.precision_plan))
    return {k: v for k, v in tags.items() if v != ""}


def source_of(tags: Mapping[str, str]) -> dict[str, str] | None:
    """A version's recorded source (uri, kind, version, identity, run_id) from its tags, or None.

    Reads ``kiln.source.*`` and the ``source_*`` names versions carried before."""
    found = {f: tags.get(TAG_SOURCE + f) or tags.get(LEGACY_SOURCE + f) or "" for f in SOURCE_FIELDS}
    return found if found["uri"] else None


# The model-source rule of zoo.sources.mlflow_registry (models:/NAME/VERSION or models:/NAME@ALIAS),
# imported only when a look-up matches by source: listings import no source kind.
def models_uri_parts(uri: str) -> tuple[str, str | None, str | None] | None:
    """(name, version, alias) of ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``; None otherwise.

    The one parser is the ``models:/`` source's (``zoo.sources.mlflow_registry``): a look-up by source
    reads the URI exactly as a compile did."""
    from zoo.sources.mlflow_registry import parse_models_uri

    try:
        return parse_models_uri(uri or "")
    except ValueError:
        return None


def _clip(text: str) -> str:
    # A tag that does not fit would fail the whole registration; the full text is in the artifacts.
    return text if len(text) <= _TAG_LIMIT else text[: _TAG_LIMIT - 3] + "..."


def dims_text(specs_json: str) -> str:
    """``batch 1..8, seq 4..64``: the named dynamic dims of a version, short enough for an 80-column table."""
    from compiler.inputs.specs import specs_from_json

    try:
        specs = specs_from_json(specs_json) if specs_json else ()
    except Exception:  # an unreadable tag is shown as such, never fatal for a listing
        return "?"
    ranges: dict[str, tuple[int, int]] = {}
    for spec in specs:
        for axis, name in sorted(spec.dynamic_dims.items()):
            ranges.setdefault(name, spec.dim_range(axis))
    return ", ".join(f"{n} {lo}..{hi}" for n, (lo, hi) in ranges.items()) or "static"


@dataclass(frozen=True)
class Registered:
    """The outcome of a registration: the version, and whether this call created it."""

    name: str
    version: str
    created: bool
    content_hash: str


def registry_lock(mlclient: MlflowClient, name: str) -> FileLock:
    # Serialises registrations of one registered model between processes of this host; the
    # converge step in register_version covers writers on other hosts.
    key = hashlib.sha256(f"{mlclient.tracking_uri}|{name}".encode()).hexdigest()[:24]
    root = Path(tempfile.gettempdir()) / "kiln-registry-locks"
    root.mkdir(parents=True, exist_ok=True)
    return FileLock(str(root / f"{key}.lock"), timeout=300)


def ensure_registered_model(mlclient: MlflowClient, name: str, policy: RetryPolicy | None = None) -> None:
    def create() -> None:
        try:
            mlclient.create_registered_model(
                name, description="kiln compiled packages; tags and aliases: see registry/models.py"
            )
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise

    call_with_retry(create, f"create registered model {name}", policy)


def all_versions(mlclient: MlflowClient, name: str, policy: RetryPolicy | None = None) -> list[ModelVersion]:
    """Every version of ``name``, newest (highest number) first."""

    def search() -> list[ModelVersion]:
        found: list[ModelVersion] = []
        token = None
        while True:
            page = mlclient.search_model_versions(f"name = '{name}'", max_results=1000, page_token=token)
            found.extend(page)
            token = page.token
            if not token:
                return found

    versions = call_with_retry(search, f"list versions of {name}", policy)
    return sorted(versions, key=lambda v: int(v.version), reverse=True)


def versions_with_hash(
    mlclient: MlflowClient, name: str, content_hash: str, policy: RetryPolicy | None = None
) -> list[ModelVersion]:
    """Versions of ``name`` tagged with ``content_hash``, lowest number first (the canonical one)."""
    hits = [v for v in all_versions(mlclient, name, policy) if content_hash_of(v.tags) == content_hash]
    return sorted(hits, key=lambda v: int(v.version))


def versions_with_meaning(
    mlclient: MlflowClient, name: str, meaning: str, policy: RetryPolicy | None = None
) -> list[ModelVersion]:
    """Versions of ``name`` tagged with this meaning hash, lowest number first (the canonical one)."""
    hits = [v for v in all_versions(mlclient, name, policy) if v.tags.get(TAG_MEANING) == meaning]
    return sorted(hits, key=lambda v: int(v.version))


def _same_package(
    mlclient: MlflowClient, name: str, tags: Mapping[str, str], policy: RetryPolicy | None
) -> list[ModelVersion]:
    """Versions that hold this package: by meaning when the tags carry it, else by content hash."""
    meaning = tags.get(TAG_MEANING)
    if meaning:
        return versions_with_meaning(mlclient, name, meaning, policy)
    return versions_with_hash(mlclient, name, tags[TAG_CONTENT_HASH], policy)


def get_aliases(mlclient: MlflowClient, name: str, policy: RetryPolicy | None = None) -> dict[str, str]:
    """alias -> version number for a registered model ({} when it does not exist).

    An alias move left half done by a killed release or rollback (``TAG_ALIAS_INTENT``) is finished
    first, so every reader sees the aliases all moved or none.
    """

    def read() -> tuple[dict[str, str], str | None]:
        try:
            model = mlclient.get_registered_model(name)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return {}, None
            raise
        aliases = {alias: str(version) for alias, version in (model.aliases or {}).items()}
        return aliases, (model.tags or {}).get(TAG_ALIAS_INTENT)

    aliases, intent = call_with_retry(read, f"read aliases of {name}", policy)
    if intent is None:
        return aliases
    call_with_retry(
        lambda: finish_alias_intent(mlclient, name, intent), f"finish alias moves of {name}", policy
    )
    return call_with_retry(read, f"read aliases of {name}", policy)[0]


def alias_intent(op: str, moves: Mapping[str, str | None]) -> str:
    """The ``TAG_ALIAS_INTENT`` value for moving each alias to its version (None: remove it)."""
    return json.dumps({"op": op, "aliases": dict(moves)}, sort_keys=True)


def set_alias(mlclient: MlflowClient, name: str, alias: str, version: str | None) -> None:
    """Point ``alias`` at ``version``; None removes it (already absent is fine)."""
    if version is not None:
        mlclient.set_registered_model_alias(name, alias, version)
        return
    try:
        mlclient.delete_registered_model_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise


def clear_alias_intent(mlclient: MlflowClient, name: str) -> None:
    try:
        mlclient.delete_registered_model_tag(name, TAG_ALIAS_INTENT)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise


def finish_alias_intent(mlclient: MlflowClient, name: str, intent: str) -> None:
    """Make the recorded alias moves (idempotent), then drop the record. A record that is not one kiln
    writes (only ``champion``/``previous`` to a version number or null) is dropped and nothing moves."""
    import logging

    log = logging.getLogger("kiln.registry")
    try:
        data = json_reader.loads(intent, f"{name}'s kiln.alias_intent tag")
        moves = data["aliases"]
        valid = isinstance(moves, dict) and all(
            alias in ALIASES and (v is None or (isinstance(v, str) and _VERSION_RE.fullmatch(v)))
            for alias, v in moves.items()
        )
    except (ValueError, TypeError, KeyError):
        valid = False
    if not valid:
        log.warning("%s: ignoring a malformed %s tag: %.200s", name, TAG_ALIAS_INTENT, intent)
    else:
        log.warning("%s: finishing the alias moves of an interrupted %s: %s", name, data.get("op"), moves)
        for alias in ALIASES:
            if alias in moves:
                set_alias(mlclient, name, alias, moves[alias])
    clear_alias_intent(mlclient, name)


def register_version(
    mlclient: MlflowClient,
    name: str,
    *,
    source: str,
    run_id: str | None,
    model_id: str | None,
    tags: Mapping[str, str],
    policy: RetryPolicy | None = None,
    description: str | None = None,
) -> Registered:
    """Create a version unless one of the same package exists (same ``kiln.meaning_hash``: equal but for
    measured latencies; versions without it: same ``content_hash``); return the canonical one.

    ``description``: the new version's description (markdown; an existing version keeps its own).

    On one host a file lock makes check-then-create atomic. Across hosts (or when a retried create
    went through twice) every writer converges afterwards: the lowest version number with the hash
    wins and the others are deleted, so the registry never keeps a duplicate.
    """
    content_hash = tags[TAG_CONTENT_HASH]
    ensure_registered_model(mlclient, name, policy)
    created = None
    with registry_lock(mlclient, name):
        if not _same_package(mlclient, name, tags, policy):
            created = call_with_retry(
                lambda: mlclient.create_model_version(
                    name,
                    source,
                    run_id=run_id,
                    tags=dict(tags),
                    model_id=model_id,
                    description=description,
                    await_creation_for=60,
                ),
                f"create a version of {name}",
                policy,
            )
    # Converge (also when nothing was created here: a writer elsewhere may have left a duplicate).
    same = _same_package(mlclient, name, tags, policy)
    canonical = same[0] if same else created
    if len(same) > 1:
        aliased = set(get_aliases(mlclient, name, policy).values())
        for duplicate in same[1:]:
            if str(duplicate.version) not in aliased:
                _delete_version(mlclient, name, str(duplicate.version), policy)
    is_new = created is not None and str(canonical.version) == str(created.version)
    return Registered(name, str(canonical.version), is_new, content_hash_of(canonical.tags) or content_hash)


def _delete_version(mlclient: MlflowClient, name: str, version: str, policy: RetryPolicy | None) -> None:
    def delete() -> None:
        try:
            mlclient.delete_model_version(name, version)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":  # the other writer deleted it first
                raise

    call_with_retry(delete, f"delete duplicate version {name}/{version}", policy)


def registered_versions(
    mlclient: MlflowClient, policy: RetryPolicy | None = None, prefix: str = PREFIX + "."
) -> list[dict[str, Any]]:
    """Every kiln version as a flat dict (name, version, aliases, key tags), for tables and the CLI."""

    def search_models() -> list:
        found, token = [], None
        while True:
            page = mlclient.search_registered_models(max_results=1000, page_token=token)
            found.extend(page)
            token = page.token
            if not token:
                return found

    rows = []
    for model in call_with_retry(search_models, "list registered models", policy):
        if not model.name.startswith(prefix):
            continue
        by_version: dict[str, list[str]] = {}
        for alias, version in (model.aliases or {}).items():
            by_version.setdefault(str(version), []).append(alias)
        for version in all_versions(mlclient, model.name, policy):
            tags = version.tags
            rows.append(
                {
                    "name": model.name,
                    "version": str(version.version),
                    "aliases": sorted(by_version.get(str(version.version), [])),
                    "backend": tags.get("backend", ""),
                    "backend_version": tags.get("backend_version", ""),
                    "engine_target": engine_target_of(tags),
                    "precision": tags.get("precision", ""),
                    "input_ranges": tags.get("input_ranges", ""),
                    "dims": dims_text(tags.get(TAG_INPUT_SPECS, "")),
                    "content_hash": content_hash_of(tags),
                    "rejected": TAG_REJECTED in tags,
                    "run_id": version.run_id,
                }
            )
    rows.sort(key=lambda r: (r["name"], -int(r["version"])))
    return rows
