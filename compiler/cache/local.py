"""Persistent, content-addressed engine cache shared by models, runs, processes and workers.

Why it exists: an engine build is the slowest step of a compile, and structurally equal subgraphs recur across
blocks, models and runs, so a cache that outlives one compile session saves most builds. What it promises,
most important first:

- never a wrong answer: every disk read is checked against the sha256 recorded at write time; a truncated,
  tampered or half-written entry is deleted and reported as a miss, never returned;
- never a failed compile because of the cache: a read-only or full disk degrades to memory, with a warning;
- one build per key across processes: a per-key file lock (`compiler.cache.locks`; flock, which the kernel
  drops when a holder dies, so a crashed compile leaves no stale lock behind);
- inspectable keys: `<key>.json` holds the fields the key was hashed from, so `diff_keys` says why two keys
  differ (Torch-TensorRT's cache hash is opaque);
- bounded: least-recently-used entries are evicted beyond `max_bytes` (payload bytes as stored).

Layout: `<dir>/<key>.bin` (payload), `<dir>/<key>.json` (written after the payload, so a payload without
metadata is a detectable half entry), `<dir>/locks/<key>.lock` (never deleted). Only its own files: the
cache reads, lists and deletes only names it writes (`compiler.cache.paths.own_files`), reads them only as
regular files of the size their record gives (never through a link, never a FIFO or device:
`compiler.cache.files`), and uses a directory only when this user (or root) owns it and nobody else can
write it (`compiler.cache.paths.check_private`): its entries are trusted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from compiler.atomic import write_bytes_atomic
from compiler.cache.entry import (
    CODECS,
    CacheEntryInfo,
    CacheStats,
    CacheWarning,
    Unreadable,
    as_bytes,
    check_key,
    check_meta,
    check_record,
    engine_key,
    entry_info,
    flatten,
    load_record,
    make_record,
    record_bytes,
    resolve_max_bytes,
    verify,
)
from compiler.cache.files import EntryFileError, read_own_file
from compiler.cache.locks import KeyLocks
from compiler.cache.paths import (
    check_private_tree,
    choose,
    fsync_directory,
    local_dir_for,
    own_files,
    resolve_directory,
    writer_temp_files,
)
from compiler.cache.remote import RemoteEntries
from compiler.cache.store import is_url
from compiler.errors import CacheError

LOCAL_DIR_ENV = "KILN_CACHE_LOCAL_DIR"  # the worker-side layer of an object-store cache

# The disk cannot take the entry: degrade to memory. Any other OSError is unexpected and raised as CacheError.
_DEGRADE_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.ENOSPC, errno.EDQUOT, errno.EPERM, errno.EFBIG})
_STALE_TMP_SECONDS = 3600  # temp files of writers that crashed mid-put


class EngineCache:
    """Disk cache of engine bytes by content key, with an in-memory layer in front (see module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int | None = None,
        compression: str | None = None,
        lock_timeout: float | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        lease_seconds: float = 120.0,
    ) -> None:
        location = choose(directory)[0]  # None: $KILN_CACHE_DIR, else the user's cache folder
        # An object-store URL: entries are shared through it, and kept hot on this worker's disk.
        self.remote = RemoteEntries(location, lease_seconds=lease_seconds) if is_url(location) else None
        if self.remote is not None:
            location = local_dir or os.environ.get(LOCAL_DIR_ENV) or local_dir_for(self.remote.url)
        self.directory = resolve_directory(location)
        self._warned: set[str] = set()
        self.max_bytes = resolve_max_bytes(max_bytes)
        if compression not in CODECS:
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
        self.locks = KeyLocks(self.directory)
        try:
            # Private to its user: Inductor entries are code that runs when loaded (docs/security.md).
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            check_private_tree(self.directory)
            (self.directory / "locks").mkdir(exist_ok=True, mode=0o700)
        except OSError as exc:
            check_private_tree(self.directory)  # an existing directory is read: it must be private too
            self._degrade(exc, "no entry can be written")
        if (self.directory / "locks").is_symlink():  # lock files are created: only in the cache
            raise CacheError(f"engine cache {self.directory}: locks is a symbolic link; remove it")

    def __repr__(self) -> str:
        return f"EngineCache({self.location!r}, max_bytes={self.max_bytes})"

    @property
    def location(self) -> str:
        """The object-store URL of a fleet cache, else the local directory."""
        return self.remote.url if self.remote is not None else str(self.directory)

    @property
    def backend(self) -> str:
        """``local``, or the object store's protocol (``s3``, ``gs``, ``file``)."""
        return self.remote.store.protocol if self.remote is not None else "local"

    # ---- keys -------------------------------------------------------------------------------------------
    key = staticmethod(engine_key)  # EngineCache.key(fingerprint=..., ...): compiler.cache.entry

    def describe(self, key: str) -> dict[str, Any] | None:
        """The stored metadata of an entry (fields, sizes, sha256, created, format version), or None."""
        path = self._meta_path(check_key(key))
        try:
            record = load_record(lambda limit: read_own_file(path, limit))
        except OSError:
            return None
        return record if isinstance(record, dict) else None

    def diff_keys(self, a: str, b: str) -> dict[str, tuple[Any, Any]]:
        """Why two keys differ: {dotted field: (value in a, value in b)}; absent values read '<absent>'."""
        flat_a, flat_b = flatten(self._fields_of(a)), flatten(self._fields_of(b))
        absent = "<absent>"
        return {
            name: (flat_a.get(name, absent), flat_b.get(name, absent))
            for name in sorted(flat_a.keys() | flat_b.keys())
            if flat_a.get(name, absent) != flat_b.get(name, absent)
        }

    # ---- reads and writes -------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None on a miss (including a corrupt entry, which is evicted)."""
        data = self._lookup(check_key(key))
        with self._mutex:
            if data is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
        return data

    def put(self, key: str, data: bytes, meta: Mapping[str, Any] | None = None) -> None:
        """Store atomically, then evict least-recently-used entries beyond max_bytes (never this one)."""
        key = check_key(key)
        data, meta_dict = as_bytes(data, key), check_meta(meta)
        with self.locks.held(key, self.lock_timeout):
            self._store(key, data, meta_dict)

    def get_or_build(
        self, key: str, build: Callable[[], bytes], meta: Mapping[str, Any] | None = None
    ) -> tuple[bytes, bool]:
        """(bytes, hit). Across processes one key is built once: the others wait on its lock, then hit.

        With an object store, across machines too: the builder holds the key's lease there, and the
        others wait for its entry (compiler.cache.remote)."""
        key = check_key(key)
        meta_dict = check_meta(meta)
        data = self._lookup(key)
        if data is None:
            with self.locks.held(key, self.lock_timeout):
                data = self._lookup(key)  # another process may have built it while we waited
                if data is None:
                    with self._remote_lease(key) as published:
                        if published is not None:  # another machine built it while we waited
                            data = published
                            self._store(key, data, meta_dict, publish=False)
                        else:
                            with self._mutex:
                                self._stats.misses += 1
                            data = as_bytes(build(), key)
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
                st = path.lstat()  # a link's own size and time, never what it names
                infos.append(
                    entry_info(
                        path.stem, record, stored_bytes=st.st_size, last_used=st.st_mtime, backend="local"
                    )
                )
        return sorted(infos, key=lambda e: e.last_used, reverse=True)

    def total_bytes(self) -> int:
        total = 0
        for path in self._payload_files():
            with contextlib.suppress(OSError):
                total += path.lstat().st_size
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
        for path in [*own_files(self.directory, "*.json"), *writer_temp_files(self.directory)]:
            with contextlib.suppress(OSError):
                path.unlink()
        return removed

    def evict(self, key: str) -> None:
        """Delete one entry from memory and this disk (the object store keeps its copy)."""
        key = check_key(key)
        with self._mutex:
            old = self._memory.pop(key, None)
            self._memory_bytes -= len(old) if old is not None else 0
        for path in (self._meta_path(key), self._payload_path(key)):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    def verify_entry(self, key: str) -> str | None:
        """Why the entry on this disk is bad, or None (good, or absent)."""
        return self._read_verified(check_key(key))[1]

    def lock_path(self, key: str) -> Path:
        return self.locks.path(key)

    # ---- internals --------------------------------------------------------------------------------------
    def _payload_path(self, key: str) -> Path:
        return self.directory / f"{key}.bin"

    def _meta_path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _payload_files(self) -> list[Path]:
        return own_files(self.directory, "*.bin")

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
        if data is None and self.remote is not None:
            data = self._read_remote(key)
        if data is not None:
            # Last-used time for LRU; on a read-only disk the old time stays.
            with contextlib.suppress(OSError, NotImplementedError):
                os.utime(self._payload_path(key), follow_symlinks=False)
        return data

    def _read_disk(self, key: str) -> bytes | None:
        data, problem = self._read_verified(key)
        if problem is None:
            return data
        # Re-check under the key's lock: a writer mid-put holds it, and its half entry is not corruption.
        with self.locks.held(key, timeout=0) as locked:
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
        self._corrupt(key, self.directory, problem, outcome, stacklevel=5)
        return None

    def _corrupt(self, key: str, where: object, problem: str, outcome: str, *, stacklevel: int) -> None:
        """Count a corrupt entry and say what became of it (the caller's caller is warned)."""
        with self._mutex:
            self._stats.corrupt += 1
        warnings.warn(
            f"cache entry {key} in {where} is corrupt ({problem}); {outcome}, will be rebuilt",
            CacheWarning,
            stacklevel=stacklevel,
        )

    def _read_remote(self, key: str) -> bytes | None:
        remote = self.remote
        assert remote is not None
        data, problem, meta = remote.get(key)
        if problem is not None:
            self._corrupt(key, remote.url, problem, "evicted", stacklevel=6)
        self._note_remote()
        if data is None:
            return None
        with self._mutex:
            self._stats.remote_hits += 1
        self._store(key, data, meta, publish=False)  # hot on this worker's disk from now on
        return data

    @contextlib.contextmanager
    def _remote_lease(self, key: str) -> Iterator[bytes | None]:
        if self.remote is None:
            yield None
            return
        with self.remote.building(key) as published:
            self._note_remote()
            yield published

    def _note_remote(self) -> None:
        """Warn once per cause when the object store stopped being used (the compile goes on)."""
        remote = self.remote
        if remote is None:
            return
        for problem, consequence in (
            (remote.problem, f"; going on with the local cache {self.directory} only"),
            (remote.write_problem, ""),  # its message says: entries are read, none is published
        ):
            if problem and problem not in self._warned:
                self._warned.add(problem)
                with self._mutex:
                    self._stats.remote_errors += 1
                warnings.warn(f"{problem}{consequence}; the compile goes on", CacheWarning, stacklevel=5)

    def _read_verified(self, key: str) -> tuple[bytes | None, str | None]:
        """(data, None) for a good entry, (None, None) for a plain miss, (None, reason) for a bad entry.

        The record first: the payload is read only once the record is sound, and only as many bytes
        as it gives."""
        meta, payload = self._meta_path(key), self._payload_path(key)
        try:
            record = load_record(lambda limit: read_own_file(meta, limit))
        except OSError as exc:
            record = Unreadable(exc.strerror or str(exc))
        if record is None:
            half = os.path.lexists(payload)
            return None, "metadata missing (half-written entry)" if half else None
        problem = check_record(record, key)
        if problem is not None:
            return None, problem
        try:
            stored = read_own_file(payload, record["bytes"])
        except EntryFileError as exc:
            return None, f"payload {exc}"
        except OSError:
            return None, None  # unreadable here (permissions): a miss, not proof of corruption
        return verify(stored, record, key)

    def _store(self, key: str, data: bytes, meta: dict[str, Any], *, publish: bool = True) -> None:
        self._remember(key, data)
        stored, record = make_record(key, data, self.compression, meta)
        if publish and self.remote is not None:
            if self.remote.publish(key, stored, record):
                with self._mutex:
                    self._stats.remote_publishes += 1
            self._note_remote()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self._payload_path(key), stored)
            # Metadata last: a crash in between leaves a payload without metadata, which reads detect.
            write_bytes_atomic(self._meta_path(key), record_bytes(record))
            fsync_directory(self.directory)
        except OSError as exc:
            for path in (self._meta_path(key), self._payload_path(key)):
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
            self._degrade(exc, f"entry {key} kept in memory only")
            return
        self._enforce_bound(keep=key)

    def _enforce_bound(self, keep: str) -> None:
        now = time.time()
        for tmp in writer_temp_files(self.directory):
            with contextlib.suppress(OSError):
                if now - tmp.lstat().st_mtime > _STALE_TMP_SECONDS:
                    tmp.unlink()
        sized = []
        for path in self._payload_files():
            with contextlib.suppress(OSError):
                st = path.lstat()
                sized.append((st.st_mtime_ns, st.st_size, path.stem))
        total = sum(size for _, size, _ in sized)
        for _, size, key in sorted(sized):  # oldest last-use first
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            with self.locks.held(key, timeout=0) as locked:
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


def resolve_cache(cache: CacheSetting) -> EngineCache | None:
    """The engine cache a public function's ``cache`` names, as :func:`compiler.cache.paths.choose`
    reads it: ``None``/``True`` the default, ``False`` none, a path or URL a cache there, a cache
    itself."""
    if cache is False:
        return None
    return cache if isinstance(cache, EngineCache) else EngineCache(choose(cache)[0])


def resolve_setting(cache: CacheSetting) -> EngineCache | bool:
    """:func:`resolve_cache` as a setting to hand on to another public function: the cache, or False
    for none. Never None, which the function handed it reads as the default cache."""
    resolved = resolve_cache(cache)
    return False if resolved is None else resolved


# What every public function's ``cache`` takes; None means the default cache everywhere.
CacheSetting = EngineCache | str | os.PathLike | bool | None
