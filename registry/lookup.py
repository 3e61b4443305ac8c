"""Look-ups: the registered version that serves a concrete input shape, downloaded, verified, loaded.

Order of preference inside ``kiln.<model>.<target>``: the ``champion`` alias, then every other version
newest first. A version is skipped (with the reason recorded) when it was rejected by a release, has
another backend or precision, was compiled from another source than the one requested
(``source=``, see :mod:`registry.lineage`), or its input spec ranges do not cover the requested
shapes. The first
that fits is downloaded, every checksum in its manifest is verified and its content hash compared
with the registry's tag; only then is it loaded. A version that fails there (a corrupt champion) is
skipped for the next that fits, and the result says so (``fell_back_from``). No fit ->
:class:`NoMatchingVersionError` listing every candidate and why it did not fit. Nothing named in a
tag is ever imported: registry tags are data.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from compiler.errors import PackageError
from compiler.inputs.specs import InputSpec, specs_from_json
from compiler.package.signing import trust_note
from registry import config
from registry.config import RetryPolicy, call_with_retry, is_transient
from registry.errors import ArtifactMissingError, ArtifactVerificationError, NoMatchingVersionError
from registry.lineage import SourceQuery, resolve_source
from registry.models import (
    CHAMPION,
    TAG_INPUT_SPECS,
    TAG_REJECTED,
    TAG_ROLLED_BACK,
    all_versions,
    content_hash_of,
    engine_target_of,
    get_aliases,
    registered_model_name,
    source_of,
)
from registry.pyfunc import PACKAGE_ARTIFACT
from registry.targets import resolved_model_name
from registry.transfer import ProgressCallback, download_model_dir
from zoo.sources.staging import new_staging_dir

if TYPE_CHECKING:  # the manifest's module imports torch: a look-up that loads nothing never needs it
    from compiler.package.manifest import Manifest

log = logging.getLogger("kiln.registry")

STAGING_PREFIX = ".kiln-staging-"

Shapes = Sequence[int] | Sequence[Sequence[int]] | Mapping[str, Sequence[int]]


@dataclass
class LookupResult:
    """The chosen version, where its verified package lies, and (unless ``load=False``) the module."""

    name: str
    version: str
    aliases: list[str]
    package_dir: Path
    manifest: Manifest
    tags: dict[str, str]
    module: Any = None
    skipped: list[dict] = field(default_factory=list)
    # Versions preferred over this one that failed verification or loading (the champion, first).
    fell_back_from: list[str] = field(default_factory=list)
    # With source=: how this version matched it (registry.lineage): how ("uri", "alias", "version"),
    # requested, recorded_uri, recorded_version, alias_version (what the alias names now), note.
    source_match: dict[str, Any] | None = None

    @property
    def fell_back(self) -> bool:
        return bool(self.fell_back_from)


def normalize_shapes(shapes: Shapes, specs: Sequence[InputSpec]) -> list[tuple[int, ...]]:
    """Shapes in the specs' input order, from one shape, a list per input, or ``{name: shape}``.

    Raises ValueError naming the mismatch (the caller turns it into a candidate's reason).
    """
    names = [s.name for s in specs]
    if isinstance(shapes, Mapping):
        unknown = sorted(set(shapes) - set(names))
        if unknown:
            raise ValueError(f"has no input(s) {unknown}; its inputs are {names}")
        missing = [n for n in names if n not in shapes]
        if missing:
            raise ValueError(f"needs a shape for input(s) {missing} as well")
        return [tuple(int(d) for d in shapes[n]) for n in names]
    items = list(shapes)
    if not items or isinstance(items[0], (int,)) or hasattr(items[0], "__index__"):
        per_input = [tuple(int(d) for d in items)]
    else:
        per_input = [tuple(int(d) for d in shape) for shape in items]
    if len(per_input) != len(specs):
        raise ValueError(f"has {len(specs)} inputs {names}, but {len(per_input)} shape(s) were given")
    return per_input


def spec_misfit(specs: Sequence[InputSpec], shapes: Shapes) -> str | None:
    """Why ``shapes`` fall outside ``specs`` (None when they fit), naming the input and its range."""
    try:
        ordered = normalize_shapes(shapes, specs)
    except ValueError as exc:
        return f"the model {exc}"
    sizes: dict[str, tuple[str, int]] = {}
    for spec, shape in zip(specs, ordered, strict=True):
        if not spec.covers(shape):
            ranges = ", ".join(
                f"{lo}..{hi}" if lo != hi else str(lo)
                for lo, hi in zip(spec.min_shape, spec.max_shape, strict=True)
            )
            return f"input {spec.name!r} shape {list(shape)} is outside its range [{ranges}]"
        for axis, dim in spec.dynamic_dims.items():
            if dim in sizes and sizes[dim][1] != shape[axis]:
                return (
                    f"dimension {dim!r} is {sizes[dim][1]} in input {sizes[dim][0]!r} but {shape[axis]} in "
                    f"input {spec.name!r}; inputs sharing a dimension must agree"
                )
            sizes[dim] = (spec.name, shape[axis])
    return None


def _registered_for(mlclient: MlflowClient, model: str, policy: RetryPolicy | None) -> list[str]:
    prefix = registered_model_name(model, "x")[: -len(".x")] + "."
    found = call_with_retry(
        lambda: list(mlclient.search_registered_models(max_results=1000)), "list registered models", policy
    )
    return sorted(m.name for m in found if m.name.startswith(prefix))


def candidates(
    mlclient: MlflowClient,
    name: str,
    *,
    backend: str | None,
    precision: str | None,
    shapes: Shapes | None,
    policy: RetryPolicy | None = None,
    source: SourceQuery | None = None,
) -> tuple[list[dict], list[dict]]:
    """(fitting, skipped): versions in preference order, each a dict with version, aliases, tags, reason
    (and, with ``source``, ``source_match``: how a fitting version matched it)."""
    versions = all_versions(mlclient, name, policy)
    aliases = get_aliases(mlclient, name, policy)
    by_version: dict[str, list[str]] = {}
    for alias, version in aliases.items():
        by_version.setdefault(version, []).append(alias)
    champion = aliases.get(CHAMPION)
    ordered = sorted(versions, key=lambda v: (str(v.version) != champion, -int(v.version)))
    seen_hash: dict[str, str] = {}
    fitting, skipped = [], []
    for v in ordered:
        tags = dict(v.tags)
        row = {"version": str(v.version), "aliases": sorted(by_version.get(str(v.version), [])), "tags": tags}
        reason = None
        content_hash = content_hash_of(tags)
        if content_hash and content_hash in seen_hash:
            reason = f"same content as version {seen_hash[content_hash]}"
        elif TAG_REJECTED in tags:
            reason = f"rejected by a release: {tags[TAG_REJECTED]}"
        elif TAG_ROLLED_BACK in tags and str(v.version) != champion:
            reason = f"rolled back from champion ({tags[TAG_ROLLED_BACK]})"
        elif source is not None and (matched := source.match(tags))[1] is not None:
            reason = matched[1]
        elif backend and tags.get("backend") != backend:
            reason = f"backend is {tags.get('backend')!r}, not {backend!r}"
        elif precision and tags.get("precision") != precision:
            reason = f"precision is {tags.get('precision')!r}, not {precision!r}"
        elif shapes is not None:
            try:
                specs = specs_from_json(tags.get(TAG_INPUT_SPECS, ""))
            except Exception as exc:  # a version without readable specs cannot be matched by shape
                reason = f"its input_specs tag is unreadable ({exc})"
            else:
                reason = spec_misfit(specs, shapes)
        if content_hash:
            seen_hash.setdefault(content_hash, str(v.version))
        if source is not None and reason is None:
            row["source_match"] = source.match(tags)[0]
        row["reason"] = reason
        (skipped if reason else fitting).append(row)
    return fitting, skipped


def _describe(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        alias = f" [{', '.join(row['aliases'])}]" if row["aliases"] else ""
        tags = row["tags"]
        what = f"{tags.get('backend', '?')}/{tags.get('precision', '?')} {tags.get('input_ranges', '')}"
        lines.append(f"  version {row['version']}{alias} ({what}): {row['reason']}")
    return "\n".join(lines)


def package_path(model_dir: Path) -> str:
    """The package's path inside a pyfunc model, as its ``MLmodel`` (in ``model_dir``) names it."""
    from mlflow.models import Model

    try:
        meta = Model.load(str(model_dir))
        rel = meta.flavors["python_function"]["artifacts"][PACKAGE_ARTIFACT]["path"]
    except (OSError, KeyError, TypeError, MlflowException) as exc:
        raise ArtifactMissingError(
            f"{model_dir} is not a kiln pyfunc model (no package artifact): {exc}"
        ) from exc
    # Outside bytes: the folder that is downloaded and read must be inside the model.
    parts = PurePosixPath(rel).parts if isinstance(rel, str) else ()
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise ArtifactMissingError(f"{model_dir}: its MLmodel names the package artifact as {rel!r}")
    return rel


def package_in(model_dir: Path) -> Path:
    """The package directory inside a downloaded pyfunc model (its MLmodel names the artifact path)."""
    rel = package_path(model_dir)
    path = model_dir / rel
    if not path.is_dir():
        raise ArtifactMissingError(f"the package artifact {rel} is missing from {model_dir}")
    return path


def default_download_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("KILN_REGISTRY_CACHE") or user_cache_dir("kiln")) / "registry"


def fetch_version(
    mlclient: MlflowClient,
    name: str,
    version: str,
    *,
    dst: str | os.PathLike | None = None,
    policy: RetryPolicy | None = None,
    on_progress: ProgressCallback | None = None,
) -> tuple[Path, Manifest, dict[str, str]]:
    """Download version ``version`` of ``name`` and verify it: (package dir, manifest, version tags).

    The download always goes to a fresh directory (then replaces ``dst``), so a tampered or stale
    earlier copy is never reused. Raises ArtifactMissingError when the artifact is gone and
    ArtifactVerificationError when it does not match its manifest or its registry entry.
    The download goes file by file and reports each to ``on_progress`` (see
    :func:`registry.transfer.download_model_dir`); verification follows the last file.
    """
    import compiler.package.check as package  # torch-free: a release that loads nothing needs no torch

    mv = call_with_retry(lambda: mlclient.get_model_version(name, version), f"read {name}/{version}", policy)
    tags = dict(mv.tags)
    root = Path(dst) if dst else default_download_root() / name / f"v{version}"
    # Owned by this process: a download killed midway is swept by the next look-up of the model.
    staging = new_staging_dir(root.parent, STAGING_PREFIX, root.name)

    try:
        uri = call_with_retry(
            lambda: mlclient.get_model_version_download_uri(name, version), f"locate {name}/{version}", policy
        )
        # Only MLmodel and the package: the pyfunc model's code files are for mlflow.pyfunc.load_model.
        local = download_model_dir(
            uri,
            staging,
            f"{name} v{version}",
            select=package_path,
            on_progress=on_progress,
            policy=policy,
        )
        package_dir = package_in(local)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, ArtifactMissingError) or not (isinstance(exc, (MlflowException, OSError))):
            raise
        if is_transient(exc):
            raise
        raise ArtifactMissingError(
            f"version {version} of {name} is registered, but its artifact cannot be downloaded from "
            f"{mv.source} ({type(exc).__name__}: {exc}); "
            "re-record the package (kiln zoo) or delete the version"
        ) from exc
    try:
        manifest = package.read_manifest(package_dir)
        _check_content_hash(manifest, tags, name, version)
    except PackageError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, ArtifactVerificationError):
            raise
        raise ArtifactVerificationError(
            f"version {version} of {name} failed verification and is refused: {exc}"
        ) from exc
    if root.exists():
        shutil.rmtree(root)
    os.replace(staging, root)
    return root / package_dir.relative_to(staging), manifest, tags


def _check_content_hash(manifest: Manifest, tags: Mapping[str, str], name: str, version: str) -> None:
    """The verified package must be the content the registry recorded (read_manifest has already
    checked the manifest against its own hash and every file against the manifest)."""
    expected = content_hash_of(tags)
    if expected and expected != manifest.content_hash:
        raise ArtifactVerificationError(
            f"version {version} of {name}: the artifact holds content {manifest.content_hash[:16]}..., "
            f"but the registry recorded {expected[:16]}...; the artifact was replaced, refused"
        )


def lookup(
    model: str,
    shapes: Shapes | None = None,
    *,
    backend: str | None = None,
    engine_target: str | None = None,
    precision: str | None = None,
    version: str | None = None,
    source: str | None = None,
    load: bool = True,
    dst: str | os.PathLike | None = None,
    allowed_modules: Sequence[str] | None = None,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
    on_progress: ProgressCallback | None = None,
    defer_output_types: bool = False,
) -> LookupResult:
    """The ``champion`` (else newest) version of ``kiln.<model>.<engine_target>`` that fits; verified and
    loaded. ``engine_target`` None: the model's one registered target, else this host's
    (:func:`registry.targets.resolve_target`).

    ``shapes``: one shape for a single-input model (``(4, 64)``), a list in input order, or
    ``{"input_ids": (2, 16), ...}``. ``version`` pins a version (still checked against the filters).
    A version that fails verification or loading is skipped for the next one that fits (logged, and
    listed in ``result.skipped`` and ``result.fell_back_from``); only when every fitting version is
    broken does the error reach the caller. ``allowed_modules``, ``defer_output_types``: see
    :func:`load_package`.

    ``source``: only versions compiled from that source (``models:/fraud-bert@production``,
    ``hf:...``): the exact URI, or for ``models:/NAME@ALIAS`` the version compiled from the model
    version the alias points at now (resolved here). ``result.source_match`` says which.
    ``on_progress``: see :func:`fetch_version`.
    """
    mlclient = config.client(tracking_uri)
    name = resolved_model_name(mlclient, model, engine_target, policy)  # --target cuda: this host's GPU's
    query = resolve_source(mlclient, source, policy) if source else None
    if query is not None and query.note:
        log.warning("%s", query.note)
    fitting, skipped = candidates(
        mlclient, name, backend=backend, precision=precision, shapes=shapes, policy=policy, source=query
    )
    if version is not None:
        pinned = [r for r in fitting if r["version"] == str(version)]
        skipped += [
            dict(r, reason=f"not the requested version {version}") for r in fitting if r not in pinned
        ]
        fitting = pinned
    if not fitting:
        filters = {"backend": backend, "precision": precision, "shapes": shapes, "version": version}
        raise _no_match(mlclient, model, name, skipped, filters, query, policy)
    failed: list[dict] = []
    for chosen in fitting:
        try:
            package_dir, manifest, tags = fetch_version(
                mlclient, name, chosen["version"], dst=dst, policy=policy, on_progress=on_progress
            )
            module = None
            if load:
                module = load_package(
                    package_dir, allowed_modules=allowed_modules, defer_output_types=defer_output_types
                )
        except (ArtifactVerificationError, ArtifactMissingError) as exc:
            # A broken version (the champion, say) must not strand the caller: try the next that fits.
            failed.append({**chosen, "reason": f"failed verification: {exc}", "error": exc})
            log.warning(
                "%s version %s is broken, trying the next version that fits: %s", name, chosen["version"], exc
            )
            continue
        if failed:
            log.warning(
                "%s: serving version %s instead of broken version(s) %s",
                name,
                chosen["version"],
                ", ".join(r["version"] for r in failed),
            )
        skipped += [{k: v for k, v in r.items() if k != "error"} for r in failed]
        return LookupResult(
            name,
            chosen["version"],
            chosen["aliases"],
            package_dir,
            manifest,
            tags,
            module,
            skipped,
            fell_back_from=[r["version"] for r in failed],
            source_match=_with_note(chosen.get("source_match"), query),
        )
    first = failed[0]["error"]
    if len(failed) == 1:
        raise first
    listing = "\n".join(f"  version {r['version']}: {r['reason']}" for r in failed)
    raise type(first)(f"every version of {name} that fits is broken:\n{listing}") from first


def _no_match(
    mlclient: Any,
    model: str,
    name: str,
    skipped: list[dict],
    filters: dict[str, Any],
    query: SourceQuery | None,
    policy: RetryPolicy | None,
) -> NoMatchingVersionError:
    """Why no version fits: nothing registered under ``name`` (and what is registered for ``model``), or
    each candidate with the reason it was skipped."""
    wanted = ", ".join(
        f"{k}={v}"
        for k, v in (*filters.items(), ("source", query.describe() if query else None))
        if v is not None
    )
    if not skipped:
        others = _registered_for(mlclient, model, policy)
        where = (
            f"; registered for {model!r}: {', '.join(others)}"
            if others
            else f"; nothing is registered for {model!r}"
        )
        return NoMatchingVersionError(f"no version of {name} is registered{where}", candidates=[])
    return NoMatchingVersionError(
        f"no registered version of {name} fits ({wanted or 'no filters'}); candidates:\n{_describe(skipped)}",
        candidates=[{k: r[k] for k in ("version", "aliases", "reason")} for r in skipped],
    )


def _with_note(match: dict[str, Any] | None, query: SourceQuery | None) -> dict[str, Any] | None:
    if match is None or query is None or not query.note:
        return match
    return {**match, "note": query.note}


def load_package(
    package_dir: str | os.PathLike,
    *,
    allowed_modules: Sequence[str] | None = None,
    defer_output_types: bool = False,
) -> Any:
    """``compiler.load`` of a verified package. The modules it may import are the package's recorded
    ``op_modules`` that this process allows (``allowed_modules``, ``$KILN_ALLOWED_OP_MODULES``, or
    already imported): never a module named in a registry tag. ``defer_output_types``: as
    ``compiler.load``'s (its output types' modules checked now, imported at the first ``forward``):
    for a caller that only verifies and loads (``kiln lookup``)."""
    import compiler

    try:
        return compiler.load(
            package_dir, allowed_modules=allowed_modules, defer_output_types=defer_output_types
        )
    except PackageError as exc:
        raise ArtifactVerificationError(
            f"{package_dir} failed verification at load and is refused: {exc}"
        ) from exc


def describe_result(result: LookupResult) -> dict:
    """A JSON-friendly summary for the CLI."""
    return {
        "registered_model": result.name,
        "version": result.version,
        "aliases": result.aliases,
        "package_dir": str(result.package_dir),
        "backend": result.tags.get("backend"),
        "precision": result.tags.get("precision"),
        "engine_target": engine_target_of(result.tags),
        "input_ranges": result.tags.get("input_ranges"),
        "content_hash": content_hash_of(result.tags),
        "fell_back_from": result.fell_back_from,
        "source": source_of(result.tags),
        "source_match": result.source_match,
        "skipped": [{k: r[k] for k in ("version", "reason")} for r in result.skipped],
        # Whether the load ran the engines as built (a signature verified) or compiled them, and why.
        "engine_code": (
            trust_note(result.package_dir, getattr(result.module, "trust_engine_code", None))
            if result.module is not None
            else None
        ),
    }
