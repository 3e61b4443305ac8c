"""Helpers the file- and registry-backed sources share: file hashes and example sizes inside ranges."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from compiler.errors import SpecialFileError
from compiler.inputs.files import regular_file
from zoo.errors import ZooConfigError

_HASH_CHUNK = 1 << 20
# One compile resolves a source's identity several times (preflight, the compile key, the manifest):
# a weight file is hashed once per process unless it changes (size, mtime or inode).
_hashes: dict[tuple[str, int, int, int], str] = {}
_hashes_lock = threading.Lock()


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, remembered per process while the file's stat is unchanged.

    Only a regular file (symlinks resolved) is read: a FIFO or ``/dev/zero`` would never end."""
    try:
        path = regular_file(path, "source: file")
        stat = path.stat()
    except SpecialFileError as exc:
        raise ZooConfigError(str(exc)) from None
    except OSError as exc:
        raise ZooConfigError(f"source: cannot read {str(path)!r}: {exc.strerror}") from None
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    with _hashes_lock:
        if key in _hashes:
            return _hashes[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    with _hashes_lock:
        if len(_hashes) > 4096:
            _hashes.clear()
        _hashes[key] = digest.hexdigest()
    return _hashes[key]


def resolve_path(text: str, base_dir: str | None) -> Path:
    """A path from a source string: ``~`` expanded; relative ones against the zoo file's directory
    (``base_dir``), else the working directory (``kiln compile``)."""
    path = Path(os.path.expanduser(text))
    if not path.is_absolute() and base_dir:
        path = Path(base_dir) / path
    return path


def example_size(default: int, lo: int, hi: int) -> int:
    """An example size inside [lo, hi], near ``default``; at least 2 where the range allows, because
    torch.export specializes a dimension whose example size is 0 or 1 to that constant."""
    size = min(max(default, lo), hi)
    return 2 if size < 2 <= hi else size


def override_dims(inputs: Mapping[str, Any] | None, name: str) -> list[Any] | None:
    """The ``inputs:`` dims given for input ``name`` (each with axis, name, min, max), else None."""
    override = (inputs or {}).get(name)
    return None if override is None else list(getattr(override, "dims", []) or [])


def fit_example_shape(shape: list[int], dims: list[Any] | None) -> list[int]:
    """``shape`` with each overridden axis moved inside its ``inputs:`` range (an example outside the
    range would be refused when the ranges are applied)."""
    shape = list(shape)
    for d in dims or []:
        if 0 <= d.axis < len(shape):
            shape[d.axis] = example_size(shape[d.axis], d.min, d.max)
    return shape
