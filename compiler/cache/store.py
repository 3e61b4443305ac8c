"""The object store under a fleet cache: an fsspec URL as a flat store of whole objects.

:class:`ObjectStore` reads, writes, creates-if-absent (a conditional PUT, or a hard link on ``file://``),
deletes and lists objects under one URL, with bounded reads and only plain relative names; it knows
nothing of cache entries (:mod:`compiler.cache.remote` builds the entries, leases and their checks on
it). Errors are :class:`CacheStoreError`, naming the environment the store's driver reads.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from typing import Any

from compiler.cache.entry import (
    RECORD_MAX_BYTES,
)
from compiler.cache.files import EntryFileError, read_own_file
from compiler.errors import CacheError

# What to set when the store refuses us, per protocol (named in every error and warning).
_ENVIRONMENT = {
    "s3": (
        "AWS_ENDPOINT_URL (endpoint), AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
        "or AWS_PROFILE (credentials)"
    ),
    "gs": "GOOGLE_APPLICATION_CREDENTIALS (credentials), STORAGE_EMULATOR_HOST (endpoint of an emulator)",
    "az": "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY",
}


# The package fsspec needs for a protocol, when its own registry does not say.
_DRIVERS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


# Fail in seconds, not minutes, when the endpoint is away: the cache then goes on locally.
_S3_OPTIONS = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}},
}


class CacheStoreError(CacheError):
    """The object store of a cache URL cannot be used (driver missing, unreachable, refused, no bucket)."""

    def __init__(self, message: str, *, url: str, reason: str) -> None:
        super().__init__(message)
        self.url = url
        self.reason = reason  # "driver", "unreachable", "credentials", "no-bucket", "read-only"


def is_url(location: object) -> bool:
    """Whether a cache location is an object-store URL (``scheme://...``) rather than a directory."""
    return isinstance(location, str) and "://" in location


@dataclass(frozen=True)
class StoredObject:
    name: str  # relative to the store's root, e.g. "entries/<key>.json"
    bytes: int
    modified: float  # epoch seconds, the store's own clock (0.0 when it does not say)


class ObjectStore:
    """An fsspec URL as a flat store of whole objects: read, write, create-if-absent, delete, list."""

    def __init__(self, url: str) -> None:
        import fsspec
        from fsspec.core import split_protocol

        protocol, _ = split_protocol(url)
        self.url = url.rstrip("/")
        self.protocol = (protocol or "file").lower()
        try:
            cls = fsspec.get_filesystem_class(self.protocol)
        except ImportError as exc:
            package = _DRIVERS.get(self.protocol) or _registered_driver(self.protocol)
            raise CacheStoreError(
                f"engine cache {self.url}: no fsspec driver for {self.protocol}:// is installed; "
                f"install the package {package!r} (pip install {package}) ({exc})",
                url=self.url,
                reason="driver",
            ) from None
        except ValueError:
            raise CacheStoreError(
                f"engine cache {self.url}: {self.protocol}:// is not a protocol fsspec knows; expected "
                "s3://bucket/prefix, gs://bucket/prefix, file:///shared/dir or a directory",
                url=self.url,
                reason="driver",
            ) from None
        options: dict[str, Any] = dict(_S3_OPTIONS) if self.protocol in ("s3", "s3a") else {}
        # A fresh instance: fsspec's instance cache keys on arguments, not on the environment that
        # holds the endpoint and credentials, so a cached one could talk to the wrong store.
        self.fs = fsspec.filesystem(self.protocol, skip_instance_cache=True, **options)
        self.root = cls._strip_protocol(self.url).rstrip("/")
        self.is_local = "file" in (cls.protocol if isinstance(cls.protocol, tuple) else (cls.protocol,))
        if not self.root:
            raise CacheStoreError(
                f"engine cache {self.url}: no bucket named; expected {self.protocol}://bucket/prefix",
                url=self.url,
                reason="no-bucket",
            )

    def environment_hint(self) -> str:
        return _ENVIRONMENT.get(self.protocol, "the credentials and endpoint variables of its fsspec driver")

    def path(self, name: str, *, folder: bool = False) -> str:
        """The full path of ``name``, a plain relative name inside the store. On ``file://`` its folder
        (or itself, for a ``folder``) must resolve inside the store: a link out of it is refused, so
        nothing outside is read, listed or deleted."""
        parts = name.split("/")
        if "\\" in name or any(part in ("", ".", "..") for part in parts):
            raise CacheError(f"engine cache {self.url}: {name!r} is not a plain name inside the store")
        full = f"{self.root}/{name}"
        if self.is_local:
            root = os.path.realpath(self.root)
            where = os.path.realpath(full if folder else os.path.dirname(full))
            if where != root and not where.startswith(root.rstrip("/") + "/"):
                raise CacheStoreError(
                    f"engine cache {self.url}: {name if folder else os.path.dirname(name)} leads out of "
                    f"the store (to {where}); kiln reads and deletes only inside it: remove the link",
                    url=self.url,
                    reason="layout",
                )
        return full

    def read(self, name: str, limit: int = RECORD_MAX_BYTES) -> bytes | None:
        """The object's bytes (None when absent), if at most ``limit``; else EntryFileError."""
        path = self.path(name)
        if self.is_local:
            return read_own_file(path, limit)
        try:
            # One ranged GET: s3fs's concurrent read would HEAD first, and list the prefix after a 404.
            data = self.fs.cat_file(path, start=0, end=limit + 1, max_concurrency=1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if "not satisfiable" in str(exc).lower():
                return b""  # an empty object: S3 answers any range with 416
            raise
        if len(data) > limit:
            raise EntryFileError(f"{name} is over the {limit} bytes expected")
        return data

    def write(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data``; readers see the old object or the new one, never a part."""
        if self.is_local:
            from compiler.atomic import write_bytes_atomic

            os.makedirs(os.path.dirname(self.path(name)), exist_ok=True)
            write_bytes_atomic(self.path(name), data)
        else:
            self.fs.pipe_file(self.path(name), data)

    def create(self, name: str, data: bytes) -> bool:
        """Write ``name`` only if it does not exist: True if this call created it."""
        path = self.path(name)
        if self.is_local:
            directory = os.path.dirname(path)
            os.makedirs(directory, exist_ok=True)
            tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(tmp, path)  # atomic, and refuses an existing name
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        try:
            self.fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            return False

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(name))

    def now(self) -> float:
        """The store's own clock (epoch seconds): the time it stamps on a probe object written now.

        Ages of objects are measured against this, never against this machine's clock, which may be
        skewed from the store's (and from the other workers')."""
        probe = f"probes/{uuid.uuid4().hex}"
        self.write(probe, b"kiln cache clock probe")
        try:
            self.fs.invalidate_cache(self.path(probe))
            stamped = _modified(self.fs.info(self.path(probe)))
        finally:
            self.delete(probe)
        if not stamped:
            raise OSError(f"{self.url}: the store gives no modification time for {probe}")
        return stamped

    def list(self, folder: str) -> list[StoredObject]:
        try:
            found = self.fs.ls(self.path(folder, folder=True), detail=True, refresh=True)
        except FileNotFoundError:
            return []
        objects = []
        for info in found:
            if info.get("type") == "directory":
                continue
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("."):
                continue  # a writer's temp file on file://
            objects.append(StoredObject(f"{folder}/{name}", int(info.get("size") or 0), _modified(info)))
        return objects


def _modified(info: dict[str, Any]) -> float:
    value = info.get("LastModified") or info.get("mtime") or info.get("updated") or info.get("created")
    if value is None:
        return 0.0
    if isinstance(value, int | float):
        return float(value)
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    with contextlib.suppress(ValueError):
        from datetime import datetime

        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    return 0.0


def _registered_driver(protocol: str) -> str:
    from fsspec.registry import known_implementations

    known = known_implementations.get(protocol, {})
    return str(known.get("class", protocol)).split(".", 1)[0] or protocol
