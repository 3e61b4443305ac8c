"""Persistent, content-addressed engine cache shared by models, runs, processes and workers.

Why it exists: an engine build is the slowest step of a compile, and structurally equal subgraphs recur across
blocks, models and runs (seed 001). Seed 001 keeps its cache for one compile session and names a persistent,
shared cache as future work; this is that cache. What it promises, most important first:

- never a wrong answer: every disk read is checked against the sha256 recorded at write time; a truncated,
  tampered or half-written entry is deleted and reported as a miss, never returned;
- never a failed compile because of the cache: a read-only or full disk degrades to memory, with a warning;
- one build per key across processes: a per-key file lock (flock, which the kernel drops when a holder dies,
  so a crashed compile leaves no stale lock behind);
- inspectable keys: `<key>.json` holds the fields the key was hashed from, so `diff_keys` says why two keys
  differ (Torch-TensorRT's cache hash is opaque);
- bounded: least-recently-used entries are evicted beyond `max_bytes` (payload bytes as stored).

Layout: `<dir>/<key>.bin` (payload), `<dir>/<key>.json` (written after the payload, so a payload without
metadata is a detectable half entry), `<dir>/locks/<key>.lock` (empty files, never deleted: unlinking a lock
file that another process holds would break mutual exclusion).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import lzma
import os
import re
import threading
import time
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from compiler.atomic import write_bytes_atomic
from compiler.errors import CacheError
from compiler.input_files import parse_size

FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 10 * 1024**3
# The disk cannot take the entry: degrade to memory. Any other OSError is unexpected and raised as CacheError.
_DEGRADE_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.ENOSPC, errno.EDQUOT, errno.EPERM, errno.EFBIG})
_KEY_RE = re.compile(r"[0-9a-f]{64}")
_CODECS: dict[str | None, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {
    None: (bytes, bytes),
    "zlib": (lambda b: zlib.compress(b, 6), zlib.decompress),
    "lzma": (lzma.compress, lzma.decompress),
}
_STALE_TMP_SECONDS = 3600  # temp files of writers that crashed mid-put


class CacheWarning(UserWarning):
    """The cache degraded (not writable, corrupt entry evicted, lock wait timed out); the compile goes on."""


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

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class CacheEntryInfo:
    key: str
    bytes: int  # payload bytes as stored (compressed if the entry is)
    last_used: float  # epoch seconds
    meta: dict[str, Any]  # the caller's meta given to put()
    fields: dict[str, Any] | None  # what the key was hashed from, when known
    created: str


class EngineCache:
    """Disk cache of engine bytes by content key, with an in-memory layer in front (see module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int | None = None,
        compression: str | None = None,
        lock_timeout: float | None = None,
    ) -> None:
        self.directory = _resolve_directory(directory)
        self.max_bytes = resolve_max_bytes(max_bytes)
        if compression not in _CODECS:
            raise CacheError(
                f"unknown cache compression {compression!r}; expected one of None, 'zlib', 'lzma'"
            )
        if lock_timeout is not None and (not isinstance(lock_timeout, int | float) or lock_timeout < 0):
            raise CacheError(
                f"lock_timeout must be None (wait forever) or seconds >= 0, got {lock_timeout!r}"
            )
        self.compression = compression
        self.lock_timeout = lock_timeout
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._memory_bytes = 0
        self._stats = CacheStats()
        self._mutex = threading.RLock()
        self._locks: dict[tuple[int, str], FileLock] = {}
        try:
            # Private to its user: Inductor entries are code that runs when loaded (docs/security.md).
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            (self.directory / "locks").mkdir(exist_ok=True)
        except OSError as exc:
            self._degrade(exc, "no entry can be written")

    def __repr__(self) -> str:
        return f"EngineCache({str(self.directory)!r}, max_bytes={self.max_bytes})"

    # ---- keys -------------------------------------------------------------------------------------------
    @staticmethod
    def key(
        *,
        fingerprint: str,
        backend: str,
        library_version: str,
        target_device: str,
        settings: Mapping[str, Any],
    ) -> CacheKey:
        """sha256 of the canonical JSON (sorted keys) of every field that changes the built engine."""
        fields: dict[str, Any] = {
            "fingerprint": fingerprint,
            "backend": backend,
            "library_version": library_version,
            "target_device": target_device,
        }
        for name, value in fields.items():
            if not isinstance(value, str) or not value:
                raise CacheError(f"cache key field {name!r} must be a non-empty string, got {value!r}")
        if not isinstance(settings, Mapping):
            raise CacheError(f"cache key settings must be a mapping, got {type(settings).__name__}")
        fields["settings"] = dict(settings)
        canonical = _canonical_json(fields, "cache key settings")
        # Store the normalized form (tuples -> lists) so the stored fields are exactly what was hashed.
        return CacheKey(hashlib.sha256(canonical.encode()).hexdigest(), json.loads(canonical))

    def describe(self, key: str) -> dict[str, Any] | None:
        """The stored metadata of an entry (fields, sizes, sha256, created, format version), or None."""
        try:
            record = json.loads(self._meta_path(_check_key(key)).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def diff_keys(self, a: str, b: str) -> dict[str, tuple[Any, Any]]:
        """Why two keys differ: {dotted field: (value in a, value in b)}; absent values read '<absent>'."""
        flat_a, flat_b = _flatten(self._fields_of(a)), _flatten(self._fields_of(b))
        absent = "<absent>"
        return {
            name: (flat_a.get(name, absent), flat_b.get(name, absent))
            for name in sorted(flat_a.keys() | flat_b.keys())
            if flat_a.get(name, absent) != flat_b.get(name, absent)
        }

    # ---- reads and writes -------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None on a miss (including a corrupt entry, which is evicted)."""
        data = self._lookup(_check_key(key))
        with self._mutex:
            if data is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
        return data

    def put(self, key: str, data: bytes, meta: Mapping[str, Any] | None = None) -> None:
        """Store atomically, then evict least-recently-used entries beyond max_bytes (never this one)."""
        key = _check_key(key)
        data, meta_dict = _as_bytes(data, key), _check_meta(meta)
        with self._locked(key, self.lock_timeout):
            self._store(key, data, meta_dict)

    def get_or_build(
        self, key: str, build: Callable[[], bytes], meta: Mapping[str, Any] | None = None
    ) -> tuple[bytes, bool]:
        """(bytes, hit). Across processes one key is built once: the others wait on its lock, then hit."""
        key = _check_key(key)
        meta_dict = _check_meta(meta)
        data = self._lookup(key)
        if data is None:
            with self._locked(key, self.lock_timeout):
                data = self._lookup(key)  # another process may have built it while we waited
                if data is None:
                    with self._mutex:
                        self._stats.misses += 1
                    data = _as_bytes(build(), key)
                    with self._mutex:
                        self._stats.builds += 1
                    self._store(key, data, meta_dict)
                    return data, False
        with self._mutex:
            self._stats.hits += 1
        return data, True

    # ---- inspection and maintenance ---------------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        with self._mutex:
            return replace(self._stats)

    def entries(self) -> list[CacheEntryInfo]:
        """Entries on disk, most recently used first."""
        infos = []
        for path in self._payload_files():
            record = self.describe(path.stem)
            with contextlib.suppress(OSError):
                st = path.stat()
                record = record or {}
                infos.append(
                    CacheEntryInfo(
                        key=path.stem,
                        bytes=st.st_size,
                        last_used=st.st_mtime,
                        meta=record.get("meta") or {},
                        fields=record.get("fields"),
                        created=record.get("created", ""),
                    )
                )
        return sorted(infos, key=lambda e: e.last_used, reverse=True)

    def total_bytes(self) -> int:
        total = 0
        for path in self._payload_files():
            with contextlib.suppress(OSError):
                total += path.stat().st_size
        return total

    def clear(self) -> int:
        """Delete every entry (disk and memory); returns how many disk entries were removed."""
        with self._mutex:
            self._memory.clear()
            self._memory_bytes = 0
        removed = 0
        for path in self._payload_files():
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
            with contextlib.suppress(OSError):
                self._meta_path(path.stem).unlink(missing_ok=True)
        for path in [*self.directory.glob("*.json"), *self.directory.glob(".*.tmp")]:
            with contextlib.suppress(OSError):
                path.unlink()
        return removed

    def lock_path(self, key: str) -> Path:
        return self.directory / "locks" / f"{_check_key(key)}.lock"

    # ---- internals --------------------------------------------------------------------------------------
    def _payload_path(self, key: str) -> Path:
        return self.directory / f"{key}.bin"

    def _meta_path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _payload_files(self) -> list[Path]:
        try:
            return [p for p in self.directory.glob("*.bin") if _KEY_RE.fullmatch(p.stem)]
        except OSError:
            return []

    def _fields_of(self, key: str) -> dict[str, Any]:
        fields = getattr(key, "fields", None) or (self.describe(key) or {}).get("fields")
        if not isinstance(fields, dict):
            raise CacheError(
                f"no fields known for key {key!r}: not made by EngineCache.key() and not stored here"
            )
        return fields

    def _lookup(self, key: str) -> bytes | None:
        with self._mutex:
            data = self._memory.get(key)
            if data is not None:
                self._memory.move_to_end(key)
        if data is None:
            data = self._read_disk(key)
            if data is not None:
                self._remember(key, data)
        if data is not None:
            # Last-used time for LRU; on a read-only disk the old time stays.
            with contextlib.suppress(OSError):
                os.utime(self._payload_path(key))
        return data

    def _read_disk(self, key: str) -> bytes | None:
        data, problem = self._read_verified(key)
        if problem is None:
            return data
        # Re-check under the key's lock: a writer mid-put holds it, and its half entry is not corruption.
        with self._locked(key, timeout=0) as locked:
            if locked is False:
                return None  # busy: someone is writing this entry right now
            data, problem = self._read_verified(key)
            if problem is None:
                return data
            outcome = "evicted"
            for path in (self._meta_path(key), self._payload_path(key)):
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:  # read-only disk: still never returned, just not deleted
                    outcome = f"not deletable ({exc.strerror})"
        with self._mutex:
            self._stats.corrupt += 1
        warnings.warn(
            f"cache entry {key} in {self.directory} is corrupt ({problem}); {outcome}, will be rebuilt",
            CacheWarning,
            stacklevel=4,
        )
        return None

    def _read_verified(self, key: str) -> tuple[bytes | None, str | None]:
        """(data, None) for a good entry, (None, None) for a plain miss, (None, reason) for a bad entry."""
        try:
            stored: bytes | None = self._payload_path(key).read_bytes()
        except FileNotFoundError:
            stored = None
        except OSError:
            return None, None  # unreadable here (permissions): a miss, not proof of corruption
        try:
            record = json.loads(self._meta_path(key).read_text())
        except FileNotFoundError:
            record = None
        except (OSError, ValueError):
            record = "unreadable"
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
        if codec not in _CODECS:
            return None, f"unknown compression {codec!r}"
        try:
            data = _CODECS[codec][1](stored)
        except (zlib.error, lzma.LZMAError) as exc:
            return None, f"payload does not decompress: {exc}"
        if len(data) != record.get("raw_bytes"):
            return None, "decompressed size does not match the metadata"
        return data, None

    def _store(self, key: str, data: bytes, meta: dict[str, Any]) -> None:
        self._remember(key, data)
        stored = _CODECS[self.compression][0](data)
        record = {
            "format_version": FORMAT_VERSION,
            "key": key,
            "fields": getattr(key, "fields", None),
            "bytes": len(stored),
            "raw_bytes": len(data),
            "sha256": hashlib.sha256(stored).hexdigest(),
            "compression": self.compression,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "meta": meta,
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self._payload_path(key), stored)
            # Metadata last: a crash in between leaves a payload without metadata, which reads detect.
            write_bytes_atomic(self._meta_path(key), json.dumps(record, indent=1, sort_keys=True).encode())
            _fsync_directory(self.directory)
        except OSError as exc:
            for path in (self._meta_path(key), self._payload_path(key)):
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
            self._degrade(exc, f"entry {key} kept in memory only")
            return
        self._enforce_bound(keep=key)

    def _enforce_bound(self, keep: str) -> None:
        now = time.time()
        for tmp in self.directory.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                    tmp.unlink()
        sized = []
        for path in self._payload_files():
            with contextlib.suppress(OSError):
                st = path.stat()
                sized.append((st.st_mtime_ns, st.st_size, path.stem))
        total = sum(size for _, size, _ in sized)
        for _, size, key in sorted(sized):  # oldest last-use first
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            with self._locked(key, timeout=0) as locked:
                if locked is False:
                    continue  # in use by a writer; try the next one
                with contextlib.suppress(OSError):
                    self._meta_path(key).unlink(missing_ok=True)
                    self._payload_path(key).unlink(missing_ok=True)
                    total -= size
                    with self._mutex:
                        self._stats.evictions += 1

    def _remember(self, key: str, data: bytes) -> None:
        # The memory layer has the same bound as the disk, keeping at least the newest entry.
        with self._mutex:
            old = self._memory.pop(key, None)
            self._memory_bytes -= len(old) if old is not None else 0
            self._memory[key] = data
            self._memory_bytes += len(data)
            while self._memory_bytes > self.max_bytes and len(self._memory) > 1:
                self._memory_bytes -= len(self._memory.popitem(last=False)[1])

    @contextlib.contextmanager
    def _locked(self, key: str, timeout: float | None) -> Iterator[bool | None]:
        """Hold the key's file lock: yields True (held), False (busy past timeout), None (no lock file)."""
        with self._mutex:
            # Per pid: filelock refuses lock instances inherited across fork.
            lock = self._locks.get((os.getpid(), key))
            if lock is None:
                lock = self._locks[(os.getpid(), key)] = FileLock(str(self.lock_path(key)))
        acquired: bool | None = False
        try:
            lock.acquire(timeout=-1 if timeout is None else timeout)
            acquired = True
        except Timeout:
            if timeout:  # timeout=0 is a probe whose caller handles "busy"; a real wait that ran out is news
                warnings.warn(
                    f"engine cache {self.directory}: waited {timeout}s for lock {key}; going on unlocked",
                    CacheWarning,
                    stacklevel=4,
                )
        except OSError:
            acquired = None  # no lock file possible (read-only directory): correct, just not deduplicated
        try:
            yield acquired
        finally:
            if acquired:
                lock.release()

    def _degrade(self, exc: OSError, consequence: str) -> None:
        if exc.errno not in _DEGRADE_ERRNOS:
            raise CacheError(f"engine cache {self.directory}: unexpected I/O error: {exc}") from exc
        with self._mutex:
            self._stats.write_errors += 1
        reason = f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}"
        warnings.warn(
            f"engine cache {self.directory} is not writable ({reason}); {consequence}, the compile goes on",
            CacheWarning,
            stacklevel=4,
        )


def _user_cache_dir() -> Path:
    # platformdirs knows every OS's convention; GPU images may lack it, where XDG's default serves.
    try:
        import platformdirs
    except ImportError:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"
    return Path(platformdirs.user_cache_dir("kiln"))


def _resolve_directory(directory: str | os.PathLike[str] | None) -> Path:
    if directory is None:
        directory = os.environ.get("KILN_CACHE_DIR") or _user_cache_dir() / "engines"
    path = Path(directory).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise CacheError(f"cache directory {path} exists but is not a directory; expected a directory")
    for parent in path.parents:  # the nearest existing ancestor must be a directory too, or mkdir cannot work
        if parent.exists():
            if not parent.is_dir():
                raise CacheError(
                    f"cache directory {path} is under {parent}, which is a file, not a directory"
                )
            break
    return path


def resolve_max_bytes(max_bytes: int | None) -> int:
    if max_bytes is None:
        text = os.environ.get("KILN_CACHE_MAX_BYTES", "").strip()
        if not text:
            return DEFAULT_MAX_BYTES
        size = parse_size(text)
        if size is None:
            raise CacheError(
                f"KILN_CACHE_MAX_BYTES={text!r} is not a positive size; expected bytes like 1073741824 or 10G"
            )
        return size
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise CacheError(f"max_bytes must be a positive int (bytes), got {max_bytes!r}")
    return max_bytes


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise CacheError(f"cache key must be 64 lowercase hex characters from EngineCache.key(), got {key!r}")
    return key  # keep a CacheKey as is: its fields go into the metadata


def _check_meta(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise CacheError(f"cache entry meta must be a mapping, got {type(meta).__name__}")
    return json.loads(_canonical_json(dict(meta), "cache entry meta"))


def _as_bytes(data: Any, key: str) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CacheError(f"cache entry {key} must be bytes, got {type(data).__name__}")
    return bytes(data)


def _canonical_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CacheError(
            f"{what} must hold only JSON values (str, finite numbers, bool, None, lists, dicts): {exc}"
        ) from exc


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for name, item in value.items():
            out.update(_flatten(item, f"{prefix}{name}."))
        return out
    return {prefix.rstrip("."): value}


def _fsync_directory(directory: Path) -> None:
    # Makes the renames durable; some filesystems refuse fsync on a directory, which is harmless here.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
