"""Reading the cache's own files on a disk (the local layer, a ``file://`` store): what kiln wrote there
is a regular file, so that is all it reads.

Anyone who can write the cache folder can put something else under an entry's name: a link to
``/dev/zero`` (a read that never ends), a FIFO (an open that blocks until someone writes), a device, a
folder, or a file larger than its record says. :func:`read_own_file` opens without following a link
and without blocking, checks what it opened (``fstat``) and its size before reading a byte, and reads
at most the size it was given; anything else is an :class:`EntryFileError`, which the cache treats as
a bad entry (reported, evicted, rebuilt). Deleting such an entry removes the name in the cache, never
what a link points at.
"""

from __future__ import annotations

import errno
import os
import stat

from compiler.errors import CacheError
from compiler.inputs.files import file_kind

# No link followed (the last component), no wait on a FIFO's writer; fstat then says what was opened.
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class EntryFileError(CacheError):
    """A cache file is not what kiln writes there (a link, FIFO, device or folder), or is larger than
    its record allows. Nothing was read from it; the entry is bad."""


def read_own_file(path: str | os.PathLike[str], limit: int) -> bytes | None:
    """The bytes of the regular file ``path`` (None when there is none), if it holds at most ``limit``
    bytes; else :class:`EntryFileError` naming what the file is. Other OSErrors (permissions) pass."""
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link as the last component
            raise EntryFileError(f"{os.fspath(path)} is a symbolic link, not a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise EntryFileError(f"{os.fspath(path)} is {file_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise EntryFileError(f"{os.fspath(path)} is {info.st_size} bytes, over the {limit} expected")
        size = info.st_size
        data = os.read(fd, size) if size else b""  # one allocation of the size fstat gave
        while len(data) < size and (more := os.read(fd, size - len(data))):  # reads stop at 2 GiB
            data += more
        if os.read(fd, 1):  # it grew since fstat: what was read is not the whole file
            raise EntryFileError(f"{os.fspath(path)} grew while it was read")
        return data
    finally:
        os.close(fd)
