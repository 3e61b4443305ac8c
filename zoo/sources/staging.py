"""Staging directories for downloads: owned by one process, swept once their owner is gone.

A download (a ``models:/`` source, a registry look-up's package, a package on its way up to MLflow)
goes into a fresh directory that is removed when it ends, whatever the outcome. A process killed
mid-download (SIGKILL, the OOM killer, a lost node) runs no cleanup, and its directory, often a
whole model, stayed for good. So each staging directory's name records its owner, and every new one
first sweeps its siblings:

    <parent>/<prefix><machine>-<pid>-<start>-<label>-<random>

``machine`` is a short hash of the host name, the boot and the pid namespace: only a directory made on
this machine, in this boot and pid namespace, is judged by its pid; ``start`` is the owner's start
time (``/proc/<pid>/stat``), so a pid reused by another process does not keep a dead owner's directory.
A sweep removes a directory whose owner is gone from this machine, and one of another machine (a
shared disk) or of an unknown owner only once it is older than ``STALE_AFTER_S``. A live owner's
directory is never touched, however old. Names that do not parse are not ours and are left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path

log = logging.getLogger("kiln.sources")

# Another machine's download, or one whose owner cannot be judged, is stale after a day: far longer
# than any download, short enough that a shared disk does not fill up.
STALE_AFTER_S = 24 * 3600
# The prefix of staging directories in the temporary directory (sources, uploads to the registry).
TEMP_PREFIX = "kiln-staging-"
_OWNER_RE = re.compile(r"(?P<machine>[0-9a-f]{12})-(?P<pid>[0-9]+)-(?P<start>[0-9]+|x)-")


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


@cache
def _machine() -> str:
    """This host, boot and pid namespace: where a pid means the same process."""
    parts = (socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), _pid_namespace())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot, or "x" where /proc does not say."""
    stat = _read(f"/proc/{pid}/stat")
    # The command name (field 2) may hold spaces and parentheses: count fields after the last ')'.
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else "x"


def _alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return start == "x" or _start_time(pid) in (start, "x")


def owner() -> str:
    """This process's tag in a staging directory's name."""
    pid = os.getpid()
    return f"{_machine()}-{pid}-{_start_time(pid)}"


def is_stale(path: Path, prefix: str, now: float | None = None, stale_after: float = STALE_AFTER_S) -> bool:
    """Whether staging directory ``path`` (named with ``prefix``) belongs to no live download."""
    match = _OWNER_RE.match(path.name[len(prefix) :]) if path.name.startswith(prefix) else None
    if match is None:
        return False  # not a staging directory of ours
    if match["machine"] == _machine():
        return not _alive(int(match["pid"]), match["start"])
    try:
        age = (time.time() if now is None else now) - path.lstat().st_mtime
    except OSError:
        return False
    return age > stale_after


def sweep(parent: str | os.PathLike, prefix: str, stale_after: float = STALE_AFTER_S) -> list[Path]:
    """Remove the stale staging directories named ``<prefix>...`` in ``parent``; returns them."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:  # no parent yet, or not readable: nothing of ours to sweep
        return removed
    for path in entries:
        if not path.name.startswith(prefix):  # the name first: /tmp may hold thousands of others
            continue
        if path.is_symlink() or not path.is_dir() or not is_stale(path, prefix, stale_after=stale_after):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            log.info("removed %s, left by a download that did not finish", path)
    return removed


def new_staging_dir(parent: str | os.PathLike, prefix: str, label: str = "") -> Path:
    """A fresh directory in ``parent`` owned by this process, after sweeping the stale ones there.

    The caller removes it (or moves it into place) when the download ends."""
    Path(parent).mkdir(parents=True, exist_ok=True)
    sweep(parent, prefix)
    clean = re.sub(r"[^A-Za-z0-9_.]+", "_", label)[:40]
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{owner()}-{clean}-", dir=parent))


@contextlib.contextmanager
def staging_dir(label: str = "", parent: str | os.PathLike | None = None) -> Iterator[Path]:
    """A staging directory under ``parent`` (default: the system's temporary directory), removed on exit."""
    path = new_staging_dir(tempfile.gettempdir() if parent is None else parent, TEMP_PREFIX, label)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
