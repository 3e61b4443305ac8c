"""What a cache entry is, wherever it is stored: the key, the metadata record, and the check of a read.

Shared by the local disk layer (:mod:`compiler.cache.local`) and the object-store layer
(:mod:`compiler.cache.remote`), so an entry means the same bytes and is verified by the same rule in
both: the payload's sha256 and size must match the record written with it, and it must decompress to
the recorded raw size. Kinds of entry other than engines (other payloads under other keys) use the
same record; nothing here knows what the bytes are.

A record is read as untrusted data (docs/security.md lists each field): :func:`check_record` types
every field a read acts on before any payload is read, :func:`blob_name` is the one place a blob's
name (a path in an object store) comes from, for reads and deletes alike, and a payload is inflated
only up to the size its record declares, which may be at most :func:`expansion_limit` of its stored
size, so a small entry cannot become gigabytes in memory.
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

from compiler import json_reader
from compiler.cache.files import EntryFileError
from compiler.errors import CacheError
from compiler.inputs import files as input_files

ENTRY_FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 10 * 1024**3
KEY_RE = re.compile(r"[0-9a-f]{64}")
CODECS: dict[str | None, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {
    None: (bytes, bytes),
    "zlib": (lambda b: zlib.compress(b, 6), zlib.decompress),
    "lzma": (lzma.compress, lzma.decompress),
}
# A record is a few KB (the key's fields and the caller's meta); anything larger is not one of ours.
RECORD_MAX_BYTES = 4 << 20
META_MAX_BYTES = 1 << 20
# An entry may inflate to this many times its stored size, or to _MIN_INFLATE, whichever is more (the
# rule TensorRT plans follow); kiln stores an entry that would inflate further uncompressed.
_MAX_EXPANSION, _MIN_INFLATE = 256, 64 << 20
_LZMA_MEMLIMIT = 128 << 20  # decoder memory; kiln's lzma.compress (preset 6) needs about 9 MiB


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


def entry_info(key: str, record: Any, *, stored_bytes: int, last_used: float, backend: str) -> CacheEntryInfo:
    """A listing row from a record as read (any JSON): fields of the wrong type are left out."""
    record = record if isinstance(record, dict) else {}
    meta, fields, created = record.get("meta"), record.get("fields"), record.get("created")
    return CacheEntryInfo(
        key=key,
        bytes=stored_bytes,
        last_used=last_used,
        meta=meta if isinstance(meta, dict) else {},
        fields=fields if isinstance(fields, dict) else None,
        created=created if isinstance(created, str) else "",
        backend=backend,
    )


def record_size(record: Any) -> int:
    """The stored size a record declares, 0 when it declares none."""
    size = record.get("bytes") if isinstance(record, dict) else None
    return size if _is_size(size) else 0


def engine_key(
    *,
    fingerprint: str,
    backend: str,
    library_version: str,
    engine_target: str,
    settings: Mapping[str, Any],
) -> CacheKey:
    """An engine's key: sha256 of the canonical JSON (sorted keys) of every field that changes the built
    engine. The engine target is hashed under its first name, ``target_device``: keys (and so warm
    caches) stay what they were."""
    fields: dict[str, Any] = {
        "fingerprint": fingerprint,
        "backend": backend,
        "library_version": library_version,
        "target_device": engine_target,
    }
    for name, value in fields.items():
        if not isinstance(value, str) or not value:
            raise CacheError(f"cache key field {name!r} must be a non-empty string, got {value!r}")
    if not isinstance(settings, Mapping):
        raise CacheError(f"cache key settings must be a mapping, got {type(settings).__name__}")
    fields["settings"] = dict(settings)
    return make_key(fields)


def make_key(fields: dict[str, Any]) -> CacheKey:
    """sha256 of the canonical JSON (sorted keys) of ``fields``."""
    canonical = canonical_json(fields, "cache key settings")
    # Store the normalized form (tuples -> lists) so the stored fields are exactly what was hashed.
    return CacheKey(hashlib.sha256(canonical.encode()).hexdigest(), json.loads(canonical))


def make_record(key: str, data: bytes, compression: str | None, meta: dict[str, Any]) -> tuple[bytes, dict]:
    """(bytes as stored, the metadata record that verifies them)."""
    stored = CODECS[compression][0](data)
    if compression is not None and len(data) > expansion_limit(len(stored)):
        stored, compression = data, None  # reads refuse such a ratio: store what they take back
    record = {
        "format_version": ENTRY_FORMAT_VERSION,
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
    if len(record_bytes(record)) > RECORD_MAX_BYTES:
        raise CacheError(
            f"cache entry {key}: its metadata (key fields and meta) is over {RECORD_MAX_BYTES} bytes, "
            "which reads refuse; keep the key's settings and the entry's meta small"
        )
    return stored, record


def record_bytes(record: dict) -> bytes:
    return json.dumps(record, indent=1, sort_keys=True).encode()


@dataclass(frozen=True)
class Unreadable:
    """A record file that could not be read as a record, and why (shown as the entry's problem)."""

    reason: str


def expansion_limit(stored_bytes: int) -> int:
    """The most bytes an entry of ``stored_bytes`` may inflate to."""
    return max(_MAX_EXPANSION * stored_bytes, _MIN_INFLATE)


def blob_name(record: Any) -> str | None:
    """The object-store blob a record names: its ``sha256`` if that is 64 lowercase hex, else None.
    Every read and every delete of a blob takes the name from here, so a record cannot name a path."""
    value = record.get("sha256") if isinstance(record, dict) else None
    return value if isinstance(value, str) and KEY_RE.fullmatch(value) else None


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_record(record: Any, key: str | None = None) -> str | None:
    """Why ``record`` cannot describe the entry ``key``, or None. Run before any payload is read: the
    payload is read only as large as ``bytes`` and inflated only to ``raw_bytes``, both checked here."""
    if isinstance(record, Unreadable):
        return f"metadata unreadable: {record.reason}"
    version = record.get("format_version") if isinstance(record, dict) else None
    if type(version) is not int or version != ENTRY_FORMAT_VERSION:
        return f"metadata unreadable or not format version {ENTRY_FORMAT_VERSION}"
    if key is not None and record.get("key") != key:
        return f"entry names key {_shown(record.get('key'))}"
    size, raw = record.get("bytes"), record.get("raw_bytes")
    for name, value in (("bytes", size), ("raw_bytes", raw)):
        if not _is_size(value):
            return f"metadata {name} is {_shown(value)}, not a size in bytes"
    if blob_name(record) is None:
        return f"metadata sha256 is {_shown(record.get('sha256'))}, not 64 lowercase hex characters"
    if "compression" not in record:  # kiln always writes it; absent is not "uncompressed"
        return "metadata has no compression field"
    codec = record["compression"]
    if not (codec is None or isinstance(codec, str)) or codec not in CODECS:
        return f"unknown compression {_shown(codec)}"
    if codec is None and raw != size:
        return f"an uncompressed entry of {size} bytes cannot hold {raw}"
    if raw > expansion_limit(size):
        return (
            f"metadata says a {size}-byte entry expands to {raw} bytes, over the {expansion_limit(size)} "
            "allowed; refused before inflating it"
        )
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_record(read: Callable[[int], bytes | None]) -> Any:
    """The record ``read(limit)`` returns, parsed: None when there is none, :class:`Unreadable` when its
    file is not a record (a link, a FIFO, too large, not JSON)."""
    try:
        return parse_record(read(RECORD_MAX_BYTES))
    except EntryFileError as exc:
        return Unreadable(str(exc))


def verify(stored: bytes | None, record: Any, key: str | None = None) -> tuple[bytes | None, str | None]:
    """(data, None) for a good entry, (None, None) for a plain miss, (None, reason) for a bad entry.

    ``record`` is the parsed metadata, None when absent, or :class:`Unreadable`; ``key``, when given,
    must be the one the record names."""
    if stored is None and record is None:
        return None, None
    if record is None:
        return None, "metadata missing (half-written entry)"
    problem = check_record(record, key)
    if problem is not None:
        return None, problem
    if stored is None:
        return None, "payload missing"
    if len(stored) != record["bytes"]:
        return None, f"payload is {len(stored)} bytes, metadata says {record['bytes']}"
    if hashlib.sha256(stored).hexdigest() != record["sha256"]:
        return None, "payload sha256 does not match the metadata"
    return inflate(stored, record["compression"], record["raw_bytes"])


def inflate(stored: bytes, codec: str | None, raw_bytes: int) -> tuple[bytes | None, str | None]:
    """(data, None), or (None, reason): inflated as a stream that stops one byte past ``raw_bytes``."""
    try:
        if codec is None:
            data, complete, rest = stored, True, b""
        elif codec == "zlib":
            unpacker = zlib.decompressobj()
            data = unpacker.decompress(stored, raw_bytes + 1)
            complete, rest = unpacker.eof, unpacker.unused_data
        else:
            unpacker = lzma.LZMADecompressor(memlimit=_LZMA_MEMLIMIT)
            data = unpacker.decompress(stored, max_length=raw_bytes + 1)
            complete, rest = unpacker.eof, unpacker.unused_data
    except (zlib.error, lzma.LZMAError) as exc:
        return None, f"payload does not decompress: {exc}"
    if len(data) > raw_bytes:
        return None, f"payload inflates past the {raw_bytes} bytes its metadata records; stopped there"
    if not complete or rest:
        return None, "payload does not decompress: the compressed stream is incomplete or has trailing data"
    if len(data) != raw_bytes:
        return None, "decompressed size does not match the metadata"
    return data, None


def parse_record(text: bytes | str | None) -> Any:
    """The metadata record, None when there is none, :class:`Unreadable` when it does not parse."""
    if text is None:
        return None
    try:
        return json_reader.loads(text, "the cache record", max_bytes=RECORD_MAX_BYTES)
    except ValueError as exc:
        return Unreadable(str(exc).removeprefix("the cache record "))


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
    text = canonical_json(dict(meta), "cache entry meta")
    if len(text) > META_MAX_BYTES:
        raise CacheError(
            f"cache entry meta is {len(text)} bytes of JSON, over the {META_MAX_BYTES} allowed; shrink it"
        )
    return json.loads(text)


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
