"""Looking after a cache: list its entries, verify every checksum, collect garbage (``kiln cache``).

Works on both layers of an :class:`EngineCache`: the local disk, and the object store when the cache's
location is a URL. Ages come from each store's own clock: a local file's mtime against this machine's
clock, an object's LastModified against the store's clock (read from a probe object it stamps now), so
a worker whose clock is skewed does not see fresh objects as old. A wrong age only makes ``gc`` keep or
drop an entry early, which costs a rebuild, never a wrong answer.

Only the cache's own files: entries are found by the names kiln writes (``<key>.bin``/``.json``,
``entries/<key>.json``, ``blobs/<sha256>``), a blob to delete is named by a record only through
:func:`compiler.cache.entry.blob_name`, the same function reads use, and every file is read as the
reads of :mod:`compiler.cache.local` and :mod:`compiler.cache.remote` read it (regular files, bounded).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from compiler.cache.entry import KEY_RE, CacheEntryInfo, blob_name, entry_info, record_size
from compiler.cache.local import EngineCache
from compiler.errors import CacheError

_DURATION = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# A blob no entry names is a publisher that stopped between its two writes (or lost a race); it may
# still be published by a live writer, so it goes only when older than this (or --older-than).
ORPHAN_GRACE_SECONDS = 86400


@dataclass(frozen=True)
class BadEntry:
    key: str
    backend: str  # "local" or the store's protocol
    problem: str


@dataclass
class GcResult:
    removed: dict[str, int] = field(default_factory=dict)  # backend -> entries removed
    freed_bytes: dict[str, int] = field(default_factory=dict)  # backend -> payload bytes freed
    orphan_blobs: int = 0


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``7d``, ``2w`` -> seconds; a CacheError naming the text otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text or "")
    if not match:
        raise CacheError(f"--older-than {text!r} is not a duration; expected e.g. 90s, 30m, 12h, 7d, 2w")
    return float(match[1]) * _DURATION[match[2] or "s"]


def entries(cache: EngineCache) -> list[CacheEntryInfo]:
    """Every entry of both layers, most recently used first."""
    found = list(cache.entries())
    if cache.remote is not None:
        protocol = cache.remote.store.protocol
        for key, obj, record in cache.remote.records():
            found.append(
                entry_info(
                    key, record, stored_bytes=record_size(record), last_used=obj.modified, backend=protocol
                )
            )
    return sorted(found, key=lambda e: e.last_used, reverse=True)


def verify_all(cache: EngineCache, *, evict: bool = False) -> tuple[int, list[BadEntry]]:
    """(entries checked, bad entries) over both layers; ``evict`` deletes the bad ones."""
    checked, bad = 0, []
    for info in cache.entries():
        checked += 1
        problem = cache.verify_entry(info.key)
        if problem is not None:
            bad.append(BadEntry(info.key, "local", problem))
            if evict:
                cache.evict(info.key)
    remote = cache.remote
    if remote is not None:
        for key, _, record in remote.records():
            checked += 1
            try:
                _, problem, bad_blob = remote.read_checked(key, record)
            except CacheError:
                raise
            except Exception as exc:
                raise remote._error(exc, "read") from None
            if problem is not None:
                bad.append(BadEntry(key, remote.store.protocol, problem))
                if evict:
                    remote.evict(key, bad_blob)
    return checked, bad


def collect_garbage(
    cache: EngineCache, *, max_bytes: int | None = None, older_than: float | None = None
) -> GcResult:
    """Remove entries last used ``older_than`` seconds ago or earlier, then the least recently used
    beyond ``max_bytes`` (per layer), and blobs on the store that no entry names. At least, not more
    than: S3 stamps whole seconds, so an entry written in the probe's second is 0 s old, and
    ``--older-than 0s`` must still remove it."""
    result = GcResult()
    now = time.time()
    local = sorted(cache.entries(), key=lambda e: e.last_used)  # oldest first
    _collect(local, "local", max_bytes, older_than, now, cache.evict, result)
    remote = cache.remote
    if remote is not None:
        protocol = remote.store.protocol
        try:
            now = remote.store.now()  # the store's clock, which stamped its objects' ages
        except Exception as exc:
            raise remote._error(exc, "write") from None
        records = remote.records()
        listed = [
            CacheEntryInfo(k, record_size(r), o.modified, {}, None, "", protocol) for k, o, r in records
        ]
        blobs = {k: blob_name(r) for k, _, r in records}  # key -> the blob its record names, if any

        def evict(key: str) -> None:
            remote.evict(key)
            blob = blobs.pop(key, None)
            if blob is not None and blob not in blobs.values():  # no other entry names it
                remote.store.delete(f"blobs/{blob}")

        _collect(
            sorted(listed, key=lambda e: e.last_used), protocol, max_bytes, older_than, now, evict, result
        )
        named = set(blobs.values())
        grace = older_than if older_than is not None else ORPHAN_GRACE_SECONDS
        for obj in remote.blobs():  # sha256 names only
            name = obj.name.rsplit("/", 1)[-1]
            if KEY_RE.fullmatch(name) and name not in named and obj.modified and now - obj.modified >= grace:
                remote.store.delete(obj.name)
                result.orphan_blobs += 1
        if remote.problem or remote.write_problem:
            raise CacheError(remote.problem or remote.write_problem or "")
    return result


def _collect(ordered, backend, max_bytes, older_than, now, evict, result: GcResult) -> None:
    total = sum(e.bytes for e in ordered)
    for info in ordered:
        too_old = older_than is not None and now - info.last_used >= older_than
        too_big = max_bytes is not None and total > max_bytes
        if not (too_old or too_big):
            continue
        evict(info.key)
        total -= info.bytes
        result.removed[backend] = result.removed.get(backend, 0) + 1
        result.freed_bytes[backend] = result.freed_bytes.get(backend, 0) + info.bytes
