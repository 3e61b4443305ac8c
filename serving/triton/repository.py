"""A Triton model repository written from the registry (``kiln serve triton export``).

Layout, one folder per kiln model (the Triton model name is the kiln model name: the registered name
``kiln.<model>.<target>`` without ``kiln.`` and the target)::

    <repository>/<model>/config.pbtxt          serves exactly the champion (version_policy specific)
    <repository>/<model>/kiln-serving.json     what kiln needs to rewrite it: registered name, settings
    <repository>/<model>/<N>/model.py          kiln's Python backend (serving/triton/backend/model.py)
    <repository>/<model>/<N>/kiln.json         the version as served (config.ServedModel)
    <repository>/<model>/<N>/package/          the verified package of registry version N

``N`` is the registry version: the champion's folder and, when there is one, ``previous``'s, so a
rollback needs no download. Every folder is built beside its final place (``.kiln-staging-*``, which
Triton skips: not a number) from a download that ``registry.lookup.fetch_version`` verified (every
checksum, and the content hash the registry recorded), and renamed into place; ``config.pbtxt`` is
replaced atomically.

All or nothing per model: a model that fails to export leaves its folder exactly as it was (a model
new to the repository leaves no folder at all), so a server on the repository still loads every
other model. A multi-model export tries every model and reports each outcome (:class:`ExportFailure`).

A version's signature is read from its verified manifest (``config.served_model``: input specs and
the output specs recorded at compile), so nothing is loaded or run here and any host exports any
engine target. Packages written before output specs were recorded (format 2) are run once on the CPU
to learn their outputs, unless a staged version of the same :func:`signature_key` (program, split
graph, engine inputs and outputs, input specs, target and precision: everything but the weights)
already says them; a CUDA one is refused by name (compile it again with this kiln).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from compiler import json_reader
from compiler.atomic import write_bytes_atomic
from compiler.package.manifest import GENERATION
from serving.triton.config import (
    BACKEND_FILE,
    DEFAULT_INSTANCES,
    DEFAULT_QUEUE_DELAY_US,
    DEFAULT_THREADS,
    PACKAGE_DIR,
    SERVED_FILE,
    ServedModel,
    checked_int,
    checked_name,
    checked_target,
    render_config,
    served_model,
)
from serving.triton.errors import NoChampionError, RepositoryBusyError, RepositoryError, TritonConfigError

SETTINGS_FILE = "kiln-serving.json"
CONFIG_FILE = "config.pbtxt"
STAGING_PREFIX = ".kiln-staging-"


def backend_bytes() -> bytes:
    """kiln's ``model.py``: the same bytes in every version folder."""
    import serving.triton.backend as backend

    return (Path(backend.__file__).parent / BACKEND_FILE).read_bytes()


def triton_model_name(model: str) -> str:
    """``tiny_mlp`` for kiln model ``tiny_mlp`` (registered as ``kiln.tiny_mlp.cpu``)."""
    from registry.models import PREFIX, registered_model_name

    return registered_model_name(model, "x").removeprefix(PREFIX + ".").removesuffix(".x")


def check_repository(repository: str | os.PathLike, *, write: bool, create: bool = False) -> Path:
    """The repository as an absolute path; RepositoryError naming it unless usable. A URL other than
    ``file://`` (``s3://``, ``gs://``, ``http://``) is refused before anything is created: kiln writes
    and serves a local directory, synced to an object store for KServe (deploy/kserve)."""
    text = os.fspath(repository)
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", text)
    if scheme and scheme.group(1).lower() != "file":
        raise RepositoryError(
            f"the model repository {text} is a {scheme.group(1)} URL; kiln writes and serves a local "
            "directory: export to one and sync it to the object store (as deploy/kserve/kiln-triton.yaml "
            "shows), and run the server or release on the local copy"
        )
    if scheme:
        text = text[len("file://") :]
    path = Path(text).expanduser().absolute()
    if create and not path.exists():
        try:
            path.mkdir(parents=True)
        except OSError as exc:
            raise RepositoryError(f"cannot create the model repository {path}: {exc}") from exc
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise RepositoryError(
            f"the model repository {path} {what}; write one with `kiln serve triton export MODEL "
            f"--repository {path}`"
        )
    if not os.access(path, os.R_OK | os.X_OK) or (write and not os.access(path, os.W_OK)):
        need = "read and write" if write else "read"
        raise RepositoryError(
            f"the model repository {path} is not readable{' and writable' * write} here "
            f"(this process must {need} it); fix its permissions or name another"
        )
    return path


@contextlib.contextmanager
def repository_lock(repository: Path, model: str) -> Iterator[None]:
    """One writer per model of a repository, across processes; a second is refused, not queued (it
    would act on a champion that has moved)."""
    key = hashlib.sha256(f"{repository.resolve()}|{model}".encode()).hexdigest()[:24]
    root = Path(tempfile.gettempdir()) / "kiln-triton-locks"
    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(root / f"{key}.lock"), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise RepositoryBusyError(
            f"another release or rollback is updating {model} in {repository}; nothing was changed, "
            "run again once it has finished"
        ) from None
    try:
        yield
    finally:
        lock.release()


@dataclass(frozen=True)
class ServingSettings:
    """``kiln-serving.json``: what a release needs to rewrite a model's config as export wrote it."""

    registered_model: str
    model: str
    target: str
    queue_delay_us: int = DEFAULT_QUEUE_DELAY_US
    instances: int = DEFAULT_INSTANCES
    threads: int = DEFAULT_THREADS
    stream: bool = False  # a generation version streams its tokens (decoupled; export --stream-tokens)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)

    def __post_init__(self) -> None:
        checked_name(self.registered_model, f"{SETTINGS_FILE}: registered_model")
        checked_name(self.model, f"{SETTINGS_FILE}: model")
        checked_target(self.target, f"{SETTINGS_FILE}: target")
        checked_int(self.queue_delay_us, f"{SETTINGS_FILE}: queue_delay_us", minimum=0)
        checked_int(self.instances, f"{SETTINGS_FILE}: instances", minimum=0)
        checked_int(self.threads, f"{SETTINGS_FILE}: threads", minimum=0)
        if not isinstance(self.stream, bool):
            raise TritonConfigError(f"{SETTINGS_FILE}: stream is {self.stream!r:.40}; expected true or false")

    @classmethod
    def read(cls, model_dir: Path) -> ServingSettings:
        """Read ``kiln-serving.json`` back, every field typed as written (no coercion)."""
        path = model_dir / SETTINGS_FILE
        try:
            data = json_reader.read_file(path)
            if not isinstance(data, dict):
                raise TypeError(f"expected an object, got {type(data).__name__}")
            fields = ("registered_model", "model", "target", "queue_delay_us", "instances")
            return cls(
                **{k: data[k] for k in fields},
                threads=data.get("threads", DEFAULT_THREADS),
                stream=data.get("stream", False),  # written before streaming: not streamed
            )
        except FileNotFoundError:
            raise RepositoryError(
                f"{model_dir} has no {SETTINGS_FILE}: kiln did not write this model folder; export it "
                f"with `kiln serve triton export {model_dir.name} --repository {model_dir.parent}`"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:  # TritonConfigError is a ValueError
            raise RepositoryError(f"{path} is unreadable ({exc}); export the model again") from exc


def read_config(model_dir: Path) -> str | None:
    try:
        return (model_dir / CONFIG_FILE).read_text()
    except FileNotFoundError:
        return None


def served_version(config_text: str | None) -> str | None:
    """The version a kiln ``config.pbtxt`` serves (its ``version_policy``), or None."""
    found = re.search(r"versions: \[ ([0-9]+) \]", config_text or "")
    return found.group(1) if found else None


def write_config(model_dir: Path, text: str | None) -> None:
    """Replace ``config.pbtxt`` atomically; None removes it (undo of a first export)."""
    if text is None:
        with contextlib.suppress(FileNotFoundError):
            (model_dir / CONFIG_FILE).unlink()
        return
    write_bytes_atomic(model_dir / CONFIG_FILE, text.encode())


def config_for(model_dir: Path, version: str) -> str:
    """The ``config.pbtxt`` that serves staged version ``version``."""
    settings = ServingSettings.read(model_dir)
    served = staged(model_dir, version)
    if served is None:
        raise RepositoryError(
            f"version {version} of {settings.registered_model} is not staged in {model_dir}"
        )
    return render_config(
        served,
        queue_delay_us=settings.queue_delay_us,
        instances=settings.instances,
        threads=settings.threads,
        stream=settings.stream,
    )


def staged(model_dir: Path, version: str) -> ServedModel | None:
    """The staged version's record when its folder is complete and its ``model.py`` is this kiln's."""
    folder = model_dir / str(version)
    try:
        served = ServedModel.from_json((folder / SERVED_FILE).read_text(), str(folder / SERVED_FILE))
        backend = (folder / BACKEND_FILE).read_bytes()
    except (OSError, TritonConfigError):
        return None
    if backend != backend_bytes() or not (folder / PACKAGE_DIR / "manifest.json").is_file():
        return None
    return served if served.version == str(version) else None


def signature_key(manifest: Any) -> str:
    """A digest of what a version's served signature depends on besides its weights: the program and
    split graph files (their checksums), every engine's inputs and outputs, the input specs, the
    engine target, backend and precision. Torch-free: read from the verified manifest."""
    from compiler.package.manifest import PROGRAM, RUNTIME_GRAPH

    files = manifest.files
    data = {
        "files": {rel: files[rel].sha256 for rel in (PROGRAM, RUNTIME_GRAPH) if rel in files},
        "engines": sorted(json.dumps(e.io.to_dict(), sort_keys=True) for e in manifest.engines.values()),
        "inputs": [spec.to_dict() for spec in manifest.input_specs],
        "target": [manifest.engine_target, manifest.backend, manifest.precision],
        "op_modules": list(manifest.op_modules),
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def same_signature(model_dir: Path, key: str) -> ServedModel | None:
    """A staged version of this folder whose signature key is ``key``, if any."""
    if not model_dir.is_dir():
        return None
    for child in sorted(model_dir.iterdir(), key=lambda c: c.name):
        if child.name.isdigit():
            served = staged(model_dir, child.name)
            if served is not None and served.signature_key == key:
                return served
    return None


def stage_version(
    mlclient: Any,
    model_dir: Path,
    model: str,
    registered: str,
    version: str,
    *,
    allowed_modules: Sequence[str] | None = None,
    policy: Any = None,
) -> tuple[ServedModel, bool]:
    """Make ``<model_dir>/<version>`` hold the verified package of that registry version, kiln's
    ``model.py`` and its ``kiln.json``. (record, created): a complete folder with the registry's content
    hash is kept as is. The signature comes from the manifest (:func:`described`)."""
    from registry.lookup import fetch_version
    from registry.models import content_hash_of

    version = str(version)
    folder = model_dir / version
    present = staged(model_dir, version)
    if present is not None:
        expected = content_hash_of(mlclient.get_model_version(registered, version).tags)
        if present.content_hash == expected:
            return present, False
    model_dir.mkdir(parents=True, exist_ok=True)
    staging = model_dir / f"{STAGING_PREFIX}{uuid.uuid4().hex[:8]}"
    try:
        package_dir, manifest, _ = fetch_version(
            mlclient, registered, version, dst=staging / "download", policy=policy
        )
        os.replace(package_dir, staging / PACKAGE_DIR)
        shutil.rmtree(staging / "download")
        served = described(
            staging / PACKAGE_DIR, manifest, model_dir, model, registered, version, allowed_modules
        )
        (staging / BACKEND_FILE).write_bytes(backend_bytes())
        (staging / SERVED_FILE).write_text(served.to_json())
        if folder.exists():  # an incomplete or stale folder: out of the way, then removed
            old = model_dir / f"{STAGING_PREFIX}old-{uuid.uuid4().hex[:8]}"
            os.replace(folder, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return served, True


def described(
    package_dir: Path,
    manifest: Any,
    model_dir: Path,
    model: str,
    registered: str,
    version: str,
    allowed_modules: Sequence[str] | None = None,
) -> ServedModel:
    """The :class:`ServedModel` of a verified package: from its manifest's input and output specs; for
    a package that predates output specs, from a staged version with the same signature key, else by
    running it once on the CPU (:func:`runtime.probe_output_specs`)."""
    key = signature_key(manifest)
    if GENERATION in manifest.files:  # served by its generate: token ids in, token ids out
        from serving.triton.generation import generation_served

        served = generation_served(
            package_dir, manifest, name=triton_model_name(model), registered=registered, version=version
        )
        return dataclasses.replace(served, signature_key=key)
    outputs = manifest.output_specs
    if outputs is None:
        known = same_signature(model_dir, key)
        if known is not None:
            return dataclasses.replace(known, version=version, content_hash=manifest.content_hash)
        outputs = _probed_outputs(package_dir, manifest, registered, version, allowed_modules)
    served = served_model(
        name=triton_model_name(model),
        registered=registered,
        version=version,
        content_hash=manifest.content_hash,
        engine_target=manifest.engine_target,
        inputs=manifest.input_specs,
        outputs=outputs,
        profiles=manifest.options.profiles,
    )
    return dataclasses.replace(served, signature_key=key)


def _probed_outputs(
    package_dir: Path, manifest: Any, registered: str, version: str, allowed_modules: Sequence[str] | None
) -> tuple[Any, ...]:
    if manifest.engine_target != "cpu":
        raise TritonConfigError(
            f"{registered} version {version} was recorded by a kiln that did not record output specs "
            f"(package format {manifest.format_version}), and its engines are for {manifest.engine_target}, "
            "which cannot run here to learn them: compile it again with this kiln (its package then says "
            "its outputs), or export it on a host with that device"
        )
    from registry.lookup import load_package
    from serving.triton.runtime import probe_output_specs

    module = load_package(package_dir, allowed_modules=allowed_modules)
    return probe_output_specs(module, manifest.input_specs)


def prune(model_dir: Path, keep: Sequence[str]) -> list[str]:
    """Remove version folders (and left-over staging folders) other than ``keep``; the removed versions."""
    removed = []
    for child in model_dir.iterdir():
        if child.is_dir() and (
            child.name.startswith(STAGING_PREFIX) or (child.name.isdigit() and child.name not in keep)
        ):
            shutil.rmtree(child, ignore_errors=True)
            if child.name.isdigit():
                removed.append(child.name)
    return sorted(removed, key=int)


@dataclass(frozen=True)
class ExportResult:
    model: str  # the Triton model name
    registered_model: str
    champion: str
    previous: str | None
    model_dir: Path
    staged: tuple[str, ...]  # versions downloaded by this export (the others were already in place)
    removed: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "ok": True,
            "model_dir": str(self.model_dir),
            "staged": list(self.staged),
            "removed": list(self.removed),
        }


@dataclass(frozen=True)
class ExportFailure:
    """A model that did not export: its folder was left as it was (none, for a model new to it)."""

    model: str  # the kiln model name asked for
    error: str  # the typed error's class
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "ok": False, "error": self.error, "message": self.message}


def champion_of(mlclient: Any, registered: str, policy: Any = None) -> tuple[str, str | None]:
    """(champion, previous) of a registered model; NoChampionError naming the aliases it has."""
    from registry.models import CHAMPION, PREVIOUS, all_versions, get_aliases

    aliases = get_aliases(mlclient, registered, policy)
    champion = aliases.get(CHAMPION)
    if champion is None:
        versions = [str(v.version) for v in all_versions(mlclient, registered, policy)]
        has = ", ".join(f"{a} -> {v}" for a, v in sorted(aliases.items())) or "none"
        where = f"versions {versions}" if versions else "no versions (nothing is registered under that name)"
        raise NoChampionError(
            f"{registered} has no 'champion' alias (aliases: {has}; {where}); nothing to serve. Release a "
            f"version first: kiln release {registered.split('.')[1]} --version N",
            registered_model=registered,
            aliases=aliases,
        )
    previous = aliases.get(PREVIOUS)
    return champion, previous if previous != champion else None


def export(
    models: Sequence[str],
    repository: str | os.PathLike,
    *,
    engine_target: str | None = None,
    tracking_uri: str | None = None,
    queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
    instances: int = DEFAULT_INSTANCES,
    threads: int = DEFAULT_THREADS,
    stream: bool = False,
    allowed_modules: Sequence[str] | None = None,
) -> list[ExportResult | ExportFailure]:
    """Write (or bring up to date) each model's folder in ``repository`` from its champion and previous.
    ``stream``: generation versions stream their tokens (``render_config``); a model that is not one
    fails to export, by name.

    Each model is all or nothing (:func:`export_model`); every model is tried, and the result lists
    each one's outcome in order. ``engine_target`` None: each model's one registered target, else this
    host's (:func:`registry.targets.resolve_target`). Bad options or an unusable repository raise
    before anything is written."""
    from compiler.errors import KilnError
    from registry import config

    checked_int(instances, "instances (0: automatic)", minimum=0)
    checked_int(queue_delay_us, "the queue delay in microseconds", minimum=0)
    checked_int(threads, "threads (0: automatic)", minimum=0)
    repo = check_repository(repository, write=True, create=True)
    mlclient = config.client(tracking_uri)
    settings = {
        "queue_delay_us": queue_delay_us,
        "instances": instances,
        "threads": threads,
        "stream": stream,
    }
    results: list[ExportResult | ExportFailure] = []
    for model in models:
        try:
            results.append(
                export_model(mlclient, repo, model, engine_target, settings, allowed_modules=allowed_modules)
            )
        except KilnError as exc:
            results.append(ExportFailure(model, type(exc).__name__, str(exc)))
    return results


def export_model(
    mlclient: Any,
    repo: Path,
    model: str,
    engine_target: str | None,
    settings: dict[str, Any],
    *,
    allowed_modules: Sequence[str] | None = None,
) -> ExportResult:
    """One model's folder from its champion (and previous): all or nothing. On any failure the
    versions this call staged are removed and ``kiln-serving.json`` and ``config.pbtxt`` are put back
    as they were; a folder this call created is removed whole."""
    from registry.models import registered_model_name
    from registry.targets import resolve_engine_target, typed_target

    target = resolve_engine_target(mlclient, model, engine_target)  # --target cuda: registry.targets
    registered = registered_model_name(model, target)
    champion, previous = champion_of(mlclient, registered)
    name = triton_model_name(model)
    model_dir = repo / name
    keep = [champion] + ([previous] if previous else [])
    with repository_lock(repo, name):
        existed = model_dir.exists()
        before = {f: _read_bytes(model_dir / f) for f in (SETTINGS_FILE, CONFIG_FILE)}
        created: list[str] = []
        try:
            for version in keep:
                _, new = stage_version(
                    mlclient, model_dir, model, registered, version, allowed_modules=allowed_modules
                )
                if new:
                    created.append(version)
            serving = ServingSettings(registered, model, engine_target or typed_target(target), **settings)
            write_bytes_atomic(model_dir / SETTINGS_FILE, serving.to_json().encode())
            write_config(model_dir, config_for(model_dir, champion))
        except BaseException:
            if not existed:
                shutil.rmtree(model_dir, ignore_errors=True)
            else:
                for version in created:
                    shutil.rmtree(model_dir / version, ignore_errors=True)
                for file, data in before.items():
                    _restore(model_dir / file, data)
            raise
        removed = prune(model_dir, keep)
    return ExportResult(name, registered, champion, previous, model_dir, tuple(created), tuple(removed))


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _restore(path: Path, data: bytes | None) -> None:
    if data is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        write_bytes_atomic(path, data)
