"""Per-key file locks of a local engine cache: ``<dir>/locks/<key>.lock``.

Two processes (or threads) asking for one key build it once: the first holds the key's lock while it
builds, the others wait on it and then read the entry. Lock files are empty and never deleted
(unlinking a lock another process holds would let a third take a new one); a lock left by a killed
process is released by the operating system. Where no lock file can be made (a read-only cache) the
cache stays correct, only not deduplicated.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from compiler.cache.entry import CacheWarning, check_key


class KeyLocks:
    """The file locks of the cache at ``directory``, one :class:`FileLock` per (process, key)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._mutex = threading.Lock()
        self._locks: dict[tuple[int, str], FileLock] = {}

    def path(self, key: str) -> Path:
        return self.directory / "locks" / f"{check_key(key)}.lock"

    @contextlib.contextmanager
    def held(self, key: str, timeout: float | None) -> Iterator[bool | None]:
        """Hold the key's file lock: yields True (held), False (busy past timeout), None (no lock file)."""
        with self._mutex:
            # Per pid: filelock refuses lock instances inherited across fork.
            lock = self._locks.get((os.getpid(), key))
            if lock is None:
                lock = self._locks[(os.getpid(), key)] = FileLock(str(self.path(key)))
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
