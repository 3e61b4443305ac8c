"""What a cache entry is, wherever it is stored: the key, the metadata record, and the check of a read.

Shared by the local disk layer (:mod:`compiler.cache.local`) and the object-store layer
(:mod:`compiler.cache.remote`), so an entry means the same bytes and is verified by the same rule in
both: the payload's sha256 and size must match the record written with it, and it must decompress to
the recorded raw size. Kinds of entry other than engines (other payloads under other keys) use the
same record; nothing here knows what the bytes are.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from compiler import input_files
from compiler.errors import CacheError

FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 10 * 1024**3
KEY_RE = re.compile(r"[0-9a-f]{64}")
CODECS: dict[str | None, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {
    None: (bytes, bytes),
    "zlib": (lambda b: zlib.compress(b, 6), zlib.decompress),
    "lzma": (lzma.compress, lzma.decompress),
}


class CacheWarning(UserWarning):
    """The cache degraded (not writable, corrupt entry evicted, lock wait timed out, object store
    unreachable); the compile goes on."""


class CacheKey(str):
    """A cache key (sha256 hex) that remembers the fields it was hashed from, to store and diff them."""

    fields: dict[str, Any]

    def __new__(cls, digest: str, fields: dict[str, Any]) -> CacheKey:
        obj = super().__new__(cls, digest)
        obj.fields = fields
        return obj

    def __reduce__(self) -> tuple[Any, ...]:  # keep the fields when a key is sent to a worker process
        return (CacheKey, (str(self), self.fields))


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    builds: int = 0
    corrupt: int = 0
    evictions: int = 0
    write_errors: int = 0
    remote_hits: int = 0  # entries read from the object store (then kept on the local disk)
    remote_publishes: int = 0  # entries this process published to the object store
    remote_errors: int = 0  # object-store calls that failed (the cache went on without it)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class CacheEntryInfo:
    key: str
    bytes: int  # payload bytes as stored (compressed if the entry is)
    last_used: float  # epoch seconds (local: file mtime; object store: the object's last write)
    meta: dict[str, Any]  # the caller's meta given to put()
    fields: dict[str, Any] | None  # what the key was hashed from, when known
    created: str
    backend: str = "local"  # "local", or the object store's protocol ("s3", "gs", "file", ...)


def make_key(fields: dict[str, Any]) -> CacheKey:
    """sha256 of the canonical JSON (sorted keys) of ``fields``."""
    canonical = canonical_json(fields, "cache key settings")
    # Store the normalized form (tuples -> lists) so the stored fields are exactly what was hashed.
    return CacheKey(hashlib.sha256(canonical.encode()).hexdigest(), json.loads(canonical))


def make_record(key: str, data: bytes, compression: str | None, meta: dict[str, Any]) -> tuple[bytes, dict]:
    """(bytes as stored, the metadata record that verifies them)."""
    stored = CODECS[compression][0](data)
    record = {
        "format_version": FORMAT_VERSION,
        "key": str(key),
        "fields": getattr(key, "fields", None),
        "bytes": len(stored),
        "raw_bytes": len(data),
        "sha256": hashlib.sha256(stored).hexdigest(),
        "compression": compression,
        # Informational only: no decision reads it (workers' clocks may disagree).
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "meta": meta,
    }
    return stored, record


def record_bytes(record: dict) -> bytes:
    return json.dumps(record, indent=1, sort_keys=True).encode()


def verify(stored: bytes | None, record: Any) -> tuple[bytes | None, str | None]:
    """(data, None) for a good entry, (None, None) for a plain miss, (None, reason) for a bad entry.

    ``record`` is the parsed metadata, None when absent, or the string ``"unreadable"``."""
    if stored is None and record is None:
        return None, None
    if stored is None:
        return None, "payload missing"
    if record is None:
        return None, "metadata missing (half-written entry)"
    if not isinstance(record, dict) or record.get("format_version") != FORMAT_VERSION:
        return None, f"metadata unreadable or not format version {FORMAT_VERSION}"
    if len(stored) != record.get("bytes"):
        return None, f"payload is {len(stored)} bytes, metadata says {record.get('bytes')}"
    if hashlib.sha256(stored).hexdigest() != record.get("sha256"):
        return None, "payload sha256 does not match the metadata"
    codec = record.get("compression")
    if codec not in CODECS:
        return None, f"unknown compression {codec!r}"
    try:
        data = CODECS[codec][1](stored)
    except (zlib.error, lzma.LZMAError) as exc:
        return None, f"payload does not decompress: {exc}"
    if len(data) != record.get("raw_bytes"):
        return None, "decompressed size does not match the metadata"
    return data, None


def parse_record(text: bytes | str | None) -> Any:
    """The metadata record, None when there is none, ``"unreadable"`` when it does not parse."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return "unreadable"


def resolve_max_bytes(max_bytes: int | None) -> int:
    if max_bytes is None:
        text = os.environ.get("KILN_CACHE_MAX_BYTES", "").strip()
        if not text:
            return DEFAULT_MAX_BYTES
        return parse_size(text, "KILN_CACHE_MAX_BYTES")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise CacheError(f"max_bytes must be a positive int (bytes), got {max_bytes!r}")
    return max_bytes


def parse_size(text: str, what: str) -> int:
    """``1073741824``, ``10G``, ``512MiB`` -> bytes; anything else is a CacheError naming ``what``."""
    size = input_files.parse_size(text)
    if size is None:
        raise CacheError(f"{what}={text!r} is not a positive size; expected bytes like 1073741824 or 10G")
    return size


def check_key(key: str) -> str:
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise CacheError(f"cache key must be 64 lowercase hex characters from EngineCache.key(), got {key!r}")
    return key  # keep a CacheKey as is: its fields go into the metadata


def check_meta(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise CacheError(f"cache entry meta must be a mapping, got {type(meta).__name__}")
    return json.loads(canonical_json(dict(meta), "cache entry meta"))


def as_bytes(data: Any, key: str) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CacheError(f"cache entry {key} must be bytes, got {type(data).__name__}")
    return bytes(data)


def canonical_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CacheError(
            f"{what} must hold only JSON values (str, finite numbers, bool, None, lists, dicts): {exc}"
        ) from exc


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for name, item in value.items():
            out.update(flatten(item, f"{prefix}{name}."))
        return out
    return {prefix.rstrip("."): value}
