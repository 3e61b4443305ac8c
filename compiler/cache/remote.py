"""The fleet layer of the engine cache: entries on an object store (``s3://``, ``gs://``, ``file://``).

Reached through fsspec (s3fs for ``s3://``, gcsfs for ``gs://``), with the store's own credential and
endpoint environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or
``AWS_PROFILE``; ``GOOGLE_APPLICATION_CREDENTIALS``): a zoo file names the URL, never a credential.

Layout under the URL::

    blobs/<sha256>          a payload, named by the sha256 of its stored bytes
    entries/<key>.json      the entry's metadata record (compiler.cache.entry), naming its blob's sha256
    leases/<key>            who is building the entry now (a random id and a heartbeat count)

Why this shape (what the store really offers): an object store has no rename and no lock, but a PUT
is atomic (readers see the old object or the whole new one, never a part), and S3, MinIO and moto
honour a conditional PUT (``If-None-Match: *``: create only if absent; s3fs ``mode="create"``,
botocore >= 1.35.20). So:

- a blob is written first, under its own content hash: two workers writing the same bytes write the
  same object, and different bytes go to different objects, so a blob write never harms a reader;
- the entry is published by a conditional PUT of ``entries/<key>.json``: the first publisher wins and
  every worker then reads the winner's entry (a loser's blob is left for ``kiln cache gc``: another
  key may name the same bytes);
- a build is announced by a conditional PUT of ``leases/<key>``: other workers wait for the entry
  instead of building it too, so a fleet builds each key once. The holder rewrites the lease every
  few seconds while it builds; a waiter that sees the same lease content for ``lease_seconds`` of its
  own monotonic clock takes over. No decision compares two machines' clocks; a wrong guess (a slow
  holder taken over) costs one duplicate build, never a wrong entry;
- every read is verified (size, sha256 of the blob, decompressed size); a bad entry is deleted and
  reported as a miss, so it is rebuilt and published again;
- only the store's own objects are read or deleted: a blob's name comes from a record only through
  ``compiler.cache.entry.blob_name`` (64 hex characters), listings keep only names kiln writes, every
  name is a plain relative one, and on ``file://`` a folder that leads out of the store (a link) is
  refused and entries are read as regular files only (``compiler.cache.files``). Reads are bounded:
  a record by ``RECORD_MAX_BYTES``, a blob by the size its record gives (one ranged GET).

A store without conditional PUT (fsspec's generic ``exists`` then ``put``) keeps every read correct:
the race only lets two workers build and publish the same key, and both publish verified entries. On
``file://`` the exclusive create is a hard link of a finished temp file (atomic on POSIX).

Who can write the store can make every worker that reads it run code (Inductor entries are compiled
code): docs/security.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from compiler.cache.entry import (
    KEY_RE,
    RECORD_MAX_BYTES,
    blob_name,
    check_meta,
    check_record,
    load_record,
    record_bytes,
    verify,
)
from compiler.cache.files import EntryFileError
from compiler.cache.store import CacheStoreError, ObjectStore, StoredObject
from compiler.errors import CacheError


class RemoteEntries:
    """Engine-cache entries on an :class:`ObjectStore`; every call is verified and never raises for
    the store's sake: a failure sets ``problem`` (the cache then goes on locally) and returns a miss."""

    def __init__(self, url: str, *, lease_seconds: float = 120.0, poll_seconds: float = 0.5) -> None:
        self.store = ObjectStore(url)
        self.url = self.store.url
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self.read_only = False
        self.problem: str | None = None  # why the store is not used any more in this process
        self.write_problem: str | None = None  # why nothing is published (read-only use)
        self._lock = threading.Lock()

    @property
    def usable(self) -> bool:
        return self.problem is None

    # ---- checks ---------------------------------------------------------------------------------------
    def check(self, write: bool = True) -> str:
        """Probe the store now: ``"read-write"`` or ``"read-only"``; CacheStoreError naming the URL and
        the variables to set when it cannot be read at all."""
        try:
            self.store.read(f"entries/{'0' * 64}.json", RECORD_MAX_BYTES)
        except EntryFileError:
            pass  # the store answered: that probe's name is not ours to judge
        except Exception as exc:
            raise self._error(exc, "read") from None
        if not write:
            return "read-only"
        probe = f"probes/{uuid.uuid4().hex}"
        try:
            self.store.write(probe, b"kiln cache write probe")
        except Exception as exc:
            error = self._error(exc, "write")
            if error.reason in ("credentials", "read-only"):
                self.read_only = True
                self.write_problem = str(error)
                return "read-only"
            raise error from None
        with contextlib.suppress(Exception):
            self.store.delete(probe)
        return "read-write"

    def _error(self, exc: BaseException, doing: str) -> CacheStoreError:
        text = f"{type(exc).__name__}: {exc}"
        lowered = text.lower()
        hint = self.store.environment_hint()
        if any(
            word in lowered
            for word in (
                "invalidaccesskeyid",
                "signaturedoesnotmatch",
                "nocredentials",
                "unable to locate credentials",
                "access key id you provided does not exist",
                "signature we calculated does not match",
            )
        ):
            return CacheStoreError(
                f"engine cache {self.url}: the credentials were refused ({text}); set {hint}",
                url=self.url,
                reason="credentials",
            )
        # 403 as a status code only: the text also holds the endpoint URL, whose port may contain "403".
        if isinstance(exc, PermissionError) or (
            any(word in lowered for word in ("accessdenied", "access denied", "forbidden"))
            or re.search(r"(?<![\w:.])403(?!\w)", lowered)
        ):
            if doing == "write":
                return CacheStoreError(
                    f"engine cache {self.url} is read-only for these credentials ({text}); its entries are "
                    f"read, none is published. To publish, grant write access or set {hint}",
                    url=self.url,
                    reason="read-only",
                )
            return CacheStoreError(
                f"engine cache {self.url}: access refused ({text}); set {hint}",
                url=self.url,
                reason="credentials",
            )
        if (
            isinstance(exc, FileNotFoundError)
            or "nosuchbucket" in lowered
            or "bucket does not exist" in lowered
        ):
            return CacheStoreError(
                f"engine cache {self.url}: the bucket does not exist ({text}); create it or fix the URL",
                url=self.url,
                reason="no-bucket",
            )
        return CacheStoreError(
            f"engine cache {self.url} is unreachable ({text}); set {hint}",
            url=self.url,
            reason="unreachable",
        )

    def _failed(self, exc: BaseException, doing: str) -> None:
        """A store call failed: reads stop on any failure, writes stop (read-only use) on a refusal."""
        error = self._error(exc, doing)
        with self._lock:
            if doing == "write" and error.reason in ("read-only", "credentials"):
                self.read_only = True
                self.write_problem = str(error)
            elif self.problem is None:
                self.problem = str(error)

    # ---- entries --------------------------------------------------------------------------------------
    def get(self, key: str) -> tuple[bytes | None, str | None, dict[str, Any]]:
        """(data, None, meta) verified, (None, None, {}) a miss, (None, reason, {}) a bad entry (evicted)."""
        if not self.usable:
            return None, None, {}
        try:
            record = self.record(key)
            if record is None:
                return None, None, {}
            data, problem, bad_blob = self.read_checked(key, record)
        except Exception as exc:
            self._failed(exc, "read")
            return None, None, {}
        if problem is not None:
            self.evict(key, bad_blob)
            return None, problem, {}
        try:
            meta = check_meta(record.get("meta"))
        except CacheError:
            meta = {}  # informational only: the entry is good without it
        return data, None, meta

    def record(self, key: str) -> Any:
        """The parsed record of ``key`` (None, a dict, or any JSON / Unreadable to be checked)."""
        return load_record(lambda limit: self.store.read(f"entries/{key}.json", limit))

    def read_checked(self, key: str, record: Any) -> tuple[bytes | None, str | None, str | None]:
        """(data, problem, a blob to delete with the entry) for ``record`` as read. The blob is read
        only once the record is sound, by the name :func:`blob_name` gives, at most its ``bytes``. It
        is named for deletion only when its bytes do not hash to its name: bad for every entry naming
        it. Otherwise (a record lying about sizes, a special file) it stays for ``gc``, which removes
        blobs no entry names. A store failure raises."""
        problem = check_record(record, key)
        if problem is not None:
            return None, problem, None
        blob = blob_name(record)
        try:
            stored = self.store.read(f"blobs/{blob}", record["bytes"])
        except EntryFileError as exc:
            return None, f"blob {exc}", None
        data, problem = verify(stored, record, key)
        corrupt = problem is not None and stored is not None and hashlib.sha256(stored).hexdigest() != blob
        return data, problem, blob if corrupt else None

    def publish(self, key: str, stored: bytes, record: dict) -> bool:
        """Blob first, then the entry by a conditional PUT; True if this call's entry is the one published."""
        if not self.usable or self.read_only:
            return False
        blob = record["sha256"]
        try:
            self.store.create(f"blobs/{blob}", stored)  # already there: the same bytes, by its name
            if self.store.create(f"entries/{key}.json", record_bytes(record)):
                return True
            # Ours lost. Its blob stays: another key's entry may name the same bytes (blobs are shared
            # by content), and ``kiln cache gc`` removes blobs that no entry names.
        except Exception as exc:
            self._failed(exc, "write")
        return False

    def evict(self, key: str, blob: str | None = None) -> None:
        for name in (key, blob):  # names of kiln's own objects only (a record's come via blob_name)
            if name is not None and not KEY_RE.fullmatch(name):
                raise CacheError(f"engine cache {self.url}: {name!r} is not a cache key or blob name")
        if self.read_only:
            return
        try:
            self.store.delete(f"entries/{key}.json")
            if blob:
                self.store.delete(f"blobs/{blob}")
        except Exception as exc:
            self._failed(exc, "write")

    @contextlib.contextmanager
    def building(self, key: str) -> Iterator[bytes | None]:
        """Hold the fleet-wide build lease of ``key`` while the block builds; yields the entry's data
        instead (and builds nothing) when another worker published it meanwhile."""
        holder = uuid.uuid4().hex
        lease = f"leases/{key}"
        published, held = self._acquire(key, lease, holder)
        if not held:
            yield published
            return
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(lease, holder, stop), daemon=True)
        beat.start()
        try:
            yield None
        finally:
            stop.set()
            beat.join()
            with contextlib.suppress(Exception):
                self.store.delete(lease)

    def _acquire(self, key: str, lease: str, holder: str) -> tuple[bytes | None, bool]:
        """(published data, False) when the entry appeared; (None, True) when this worker holds the lease;
        (None, False) when the store cannot coordinate (down, read-only): build without it."""
        seen, since = None, time.monotonic()
        while self.usable and not self.read_only:
            try:
                if self.store.create(lease, json.dumps({"holder": holder, "beat": 0}).encode()):
                    data, _, _ = self.get(key)  # the previous holder may have published as it left
                    if data is None:
                        return None, True
                    self.store.delete(lease)
                    return data, False
                data, _, _ = self.get(key)
                if data is not None:
                    return data, False
                try:
                    current = self.store.read(lease, RECORD_MAX_BYTES)
                except EntryFileError:  # not a lease kiln wrote: taken over like a silent holder
                    current = b"not a lease"
            except Exception as exc:
                self._failed(exc, "write")
                return None, False
            if current != seen:  # the holder is alive (or the lease changed hands): wait afresh
                seen, since = current, time.monotonic()
            elif time.monotonic() - since > self.lease_seconds:
                with contextlib.suppress(Exception):
                    self.store.delete(lease)  # a holder that stopped beating: take over
                continue
            time.sleep(self.poll_seconds)
        return None, False

    def _heartbeat(self, lease: str, holder: str, stop: threading.Event) -> None:
        count = 0
        while not stop.wait(max(self.lease_seconds / 4, 0.05)):
            count += 1
            with contextlib.suppress(Exception):
                self.store.write(lease, json.dumps({"holder": holder, "beat": count}).encode())

    # ---- inspection and maintenance -------------------------------------------------------------------
    def records(self) -> list[tuple[str, StoredObject, Any]]:
        """(key, entry object, parsed record) for every entry named as kiln names them
        (``entries/<key>.json``; other names are not the cache's and are left alone); raises
        CacheStoreError when the store cannot be read."""
        try:
            objects = self.store.list("entries")
            return [
                (key, o, self.record(key))
                for o in objects
                if KEY_RE.fullmatch(key := o.name.rsplit("/", 1)[-1].removesuffix(".json"))
                and o.name.endswith(".json")
            ]
        except CacheError:
            raise
        except Exception as exc:
            raise self._error(exc, "read") from None

    def blobs(self) -> list[StoredObject]:
        """Blobs named as kiln names them (a sha256); other names are left alone."""
        try:
            return [o for o in self.store.list("blobs") if KEY_RE.fullmatch(o.name.rsplit("/", 1)[-1])]
        except CacheError:
            raise
        except Exception as exc:
            raise self._error(exc, "read") from None
