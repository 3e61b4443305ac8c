"""Where a cache lives on this machine: which engine cache a compile uses and why (:func:`choose`, the
one place that decides, and the one reader of ``$KILN_CACHE_DIR``), the directory of a local cache, the
local layer of an object-store cache, whether it is private enough to trust, making renames in it
durable, and listing only the files it writes there."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
from pathlib import Path

from compiler.cache.entry import KEY_RE
from compiler.errors import CacheError

# compiler.atomic's temp files for an entry: ".<key>.<random>.tmp.bin" / ".tmp.json".
_TMP_RE = re.compile(r"\.[0-9a-f]{64}\.[A-Za-z0-9_]+\.tmp\.(?:bin|json)")


CACHE_ENV = "KILN_CACHE_DIR"
# Where ONNX exports of partitions are kept across processes (compiler.engine_build.export_memo): unset, a
# process keeps its own only. For a loop that compiles the same structures again (CI, a developer's).
EXPORT_CACHE_ENV = "KILN_EXPORT_CACHE"
# Where a zoo run or `kiln compile` keeps engines by default: beside its workspace (.kiln/), so that a
# project directory carries its own warm cache. The library, which has no project, uses the user's
# cache folder (user_cache_dir() / "engines").
PROJECT_CACHE = ".kiln/engine-cache"


def choose(
    setting: str | os.PathLike[str] | bool | None, *, named: str = "cache", project: bool = False
) -> tuple[str | None, str]:
    """(the engine cache's location, why it was chosen): the one decision every entry point makes.

    ``setting`` is what the caller was given, read the same way by every public function that takes a
    cache (``compiler.compile``, ``build_engine``, ``repair``, ``ensure_accuracy``, ``load``,
    ``KilnBackend``, a zoo file's ``settings.engine_cache``): ``False`` is no cache; a directory or an
    object-store URL (``s3://``, ``gs://``, ``file://``) is that cache; ``None`` (or ``True``) is the
    default: ``$KILN_CACHE_DIR``, else the user's cache folder, or for a ``project`` (a zoo run, ``kiln
    compile``) ``.kiln/engine-cache`` under the working directory. ``named``: the setting's name, for
    the reason. A directory comes back absolute, a URL as written."""
    if setting is False:
        return None, f"disabled by {named}: false"
    if setting is not None and setting is not True:
        return _location(os.fspath(setting)), named
    if os.environ.get(CACHE_ENV):
        return _location(os.environ[CACHE_ENV]), f"${CACHE_ENV}"
    return str(Path(PROJECT_CACHE).absolute() if project else user_cache_dir() / "engines"), "default"


def export_cache_dir() -> Path | None:
    """The folder of kept ONNX exports (``$KILN_EXPORT_CACHE``, absolute), or None where unset."""
    folder = os.environ.get(EXPORT_CACHE_ENV)
    return Path(folder).expanduser().absolute() if folder else None


def _location(text: str) -> str:
    return text if "://" in text else str(Path(text).expanduser().absolute())


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


def resolve_directory(directory: str | os.PathLike[str]) -> Path:
    """A local cache's directory, absolute; a CacheError where it cannot be one."""
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


# Folders kiln keeps inside a cache directory (file locks, native-build jobs, TensorRT's timing cache):
# a pre-existing one others can write is refused as the directory itself is.
PRIVATE_FOLDERS = ("locks", "native-builds", "timing")

_CACHE_FIX = f"set {CACHE_ENV} (or KILN_CACHE_LOCAL_DIR for an object-store cache) to a directory of your own"


def check_private(
    directory: Path,
    *,
    what: str = "engine cache directory",
    why: str = "its entries are trusted (an Inductor engine runs as code when loaded)",
    other: str = _CACHE_FIX,
    error: type[Exception] = CacheError,
) -> None:
    """Refuse (``error``, naming the fix) a directory owned by another user than this one or root, or
    writable by its group or others, whether kiln made it or found it: what is in it is trusted (``why``),
    so whoever can write the directory could run code as this user. A directory that does not exist
    (not creatable here) holds nothing to trust. ``other``: the alternative to fixing its mode."""
    try:
        info = directory.stat()
    except OSError:
        return
    problems = []
    if info.st_uid not in (os.geteuid(), 0):
        problems.append(f"owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"writable by others (mode {stat.S_IMODE(info.st_mode):o})")
    if problems:
        raise error(
            f"{what} {directory} is {' and '.join(problems)}: {why}, so kiln uses it only when private to "
            f"this user. Run `chmod go-w {directory}` (and chown it to this user), or {other}"
        )


def check_private_tree(directory: Path) -> None:
    """:func:`check_private` for a cache directory and the folders kiln keeps in it."""
    check_private(directory)
    for name in PRIVATE_FOLDERS:
        check_private(directory / name, what=f"engine cache folder ({name})")


def fsync_directory(directory: Path) -> None:
    # Makes the renames durable; some filesystems refuse fsync on a directory, which is harmless here.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def own_files(directory: Path, pattern: str) -> list[Path]:
    """Entry files by the names a cache writes: ``<64 hex>.bin`` / ``.json``, nothing else."""
    try:
        return [p for p in directory.glob(pattern) if KEY_RE.fullmatch(p.stem)]
    except OSError:
        return []


def writer_temp_files(directory: Path) -> list[Path]:
    """The temp files of writers of entries (:func:`compiler.atomic.write_bytes_atomic`), nothing else."""
    try:
        return [p for p in directory.glob(".*.tmp.*") if _TMP_RE.fullmatch(p.name)]
    except OSError:
        return []
