"""Files a user names (weights, programs, validation and calibration data): what kiln agrees to read.

Two checks, one place, for every reader of a user-named path:

- :func:`regular_file`: the path, symlinks resolved, must be a regular file. A FIFO blocks its
  reader forever and ``/dev/zero`` never ends; both hung ``--check`` and the run. Refused with a
  :class:`SpecialFileError` before anything opens them (a hub cache's symlinks to blobs are fine).
- :func:`check_data_bounds`: what an ``.npz`` or ``.safetensors`` file expands to in memory, read
  from its headers alone (zip central directory sizes, each member's npy header, the safetensors
  JSON header), at most ``KILN_DATA_MAX_BYTES`` (default 1 GiB). A 4 MB deflated npz can claim 4 GiB;
  it is refused before one byte is decompressed. Python's zipfile stops a member at the size its
  header declares, so the checked sizes bound what reading can allocate.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import zipfile
from pathlib import Path

from compiler import json_reader
from compiler.errors import SpecialFileError, ValidationDataError

DATA_MAX_BYTES_ENV = "KILN_DATA_MAX_BYTES"
DEFAULT_DATA_MAX_BYTES = 1 << 30
SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"(\d+)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
# safetensors itself refuses headers over 100 MB; a sane one is a few KB per tensor.
_SAFETENSORS_MAX_HEADER = 100 << 20
_SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip

_KINDS = {
    stat.S_ISFIFO: "a FIFO (named pipe)",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISSOCK: "a socket",
    stat.S_ISDIR: "a directory",
}


def parse_size(text: str) -> int | None:
    """Bytes from ``1073741824``, ``512M``, ``10GiB``; None when ``text`` is not a positive size."""
    match = _SIZE_RE.fullmatch(text.strip())
    if not match or int(match[1]) <= 0:
        return None
    return int(match[1]) * SIZE_SUFFIXES[match[2].upper()]


def data_max_bytes() -> int:
    """The most bytes validation or calibration data may expand to: ``$KILN_DATA_MAX_BYTES`` or 1 GiB."""
    text = os.environ.get(DATA_MAX_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_DATA_MAX_BYTES
    size = parse_size(text)
    if size is None:
        raise ValidationDataError(
            f"{DATA_MAX_BYTES_ENV}={text!r} is not a positive size; expected bytes like 1073741824 or 2G"
        )
    return size


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for messages: ``a FIFO (named pipe)``, ``a directory``."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return next((name for test, name in _KINDS.items() if test(mode)), "not a regular file")


def regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` resolved, if it is a regular file; else :class:`SpecialFileError` (missing: OSError)."""
    resolved = Path(path).resolve()
    mode = os.stat(resolved).st_mode
    if not stat.S_ISREG(mode):
        kind = file_kind(mode)
        via = f" (it resolves to {str(resolved)!r})" if str(resolved) != str(Path(path).absolute()) else ""
        raise SpecialFileError(
            f"{what} {str(path)!r} is {kind}{via}; kiln reads only regular files (a FIFO or device "
            "would block or never end): point at a file"
        )
    return resolved


def check_data_bounds(path: str | os.PathLike, limit: int | None = None) -> Path:
    """``path`` resolved, once its headers say that its arrays (``.npz`` or ``.safetensors``) fit in
    ``limit`` bytes (default :func:`data_max_bytes`); else :class:`ValidationDataError` (also for
    unreadable headers), or :class:`SpecialFileError` for a path that is not a regular file."""
    path = Path(path)
    limit = data_max_bytes() if limit is None else limit
    resolved = regular_file(path, "data file")
    if path.suffix == ".npz":
        size = _npz_bytes(resolved, path, limit)
    elif path.suffix == ".safetensors":
        size = _safetensors_bytes(resolved, path)
    else:
        size = resolved.stat().st_size
    if size > limit:
        raise ValidationDataError(
            f"{path}: its arrays take {size / 2**20:.1f} MiB in memory, over the {limit / 2**20:.1f} MiB "
            f"allowed for validation and calibration data; use fewer samples, or raise "
            f"{DATA_MAX_BYTES_ENV} if the data is trusted and the machine has the memory"
        )
    return resolved


def _npz_bytes(resolved: Path, path: Path, limit: int) -> int:
    try:
        with zipfile.ZipFile(resolved) as archive:
            members = archive.infolist()
            declared = sum(m.file_size for m in members)
            if declared > limit:
                return declared  # refused on the zip headers: nothing is decompressed
            total = 0
            for member in members:
                with archive.open(member) as handle:
                    total += max(_npy_bytes(handle, path, member.filename), 0)
            return max(total, declared)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ValidationDataError(f"{path}: cannot read an .npz archive: {exc}") from None


def _npy_bytes(handle: object, path: Path, name: str) -> int:
    """The array size an npy member's header declares (only the header is read)."""
    import numpy as np  # here: the CLI checks this module's limits before any data is read
    from numpy.lib import format as npy

    try:
        version = npy.read_magic(handle)
        read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, _, dtype = read_header(handle)
    except ValueError as exc:
        raise ValidationDataError(f"{path}: cannot read member {name!r}: not an .npy array: {exc}") from None
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * np.dtype(dtype).itemsize


def _safetensors_bytes(resolved: Path, path: Path) -> int:
    size = resolved.stat().st_size
    with resolved.open("rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ValidationDataError(
                f"{path}: cannot read a safetensors header: the file is shorter than 8 bytes"
            )
        (length,) = struct.unpack("<Q", head)
        if length > min(_SAFETENSORS_MAX_HEADER, size - 8):
            raise ValidationDataError(
                f"{path}: cannot read a safetensors header: its length {length} exceeds the file"
            )
        try:
            header = json_reader.loads(
                handle.read(length), f"{path}: its safetensors header", max_bytes=_SAFETENSORS_MAX_HEADER
            )
        except ValueError as exc:
            raise ValidationDataError(f"{path}: cannot read a safetensors header: not JSON: {exc}") from None
    total = 0
    for name, info in header.items() if isinstance(header, dict) else ():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        count = 1
        for dim in info.get("shape") or []:
            count *= int(dim)
        total += count * _SAFETENSORS_ITEMSIZE.get(str(info.get("dtype")), 8)
    return max(total, size)
