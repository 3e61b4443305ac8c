"""Where a cache lives on this machine: the directory of a local cache, the local layer of an
object-store cache, and making renames in them durable."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

from compiler.errors import CacheError


def user_cache_dir() -> Path:
    # platformdirs knows every OS's convention; GPU images may lack it, where XDG's default serves.
    try:
        import platformdirs
    except ImportError:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"
    return Path(platformdirs.user_cache_dir("kiln"))


def local_dir_for(url: str) -> Path:
    """The worker-side layer of an object-store cache: one folder per URL in the user's cache."""
    return user_cache_dir() / "remote" / hashlib.sha256(url.encode()).hexdigest()[:16]


def resolve_directory(directory: str | os.PathLike[str] | None) -> Path:
    if directory is None:
        directory = os.environ.get("KILN_CACHE_DIR") or user_cache_dir() / "engines"
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


def fsync_directory(directory: Path) -> None:
    # Makes the renames durable; some filesystems refuse fsync on a directory, which is harmless here.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
