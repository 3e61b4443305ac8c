"""The one reader of JSON kiln did not just write itself: bounded in size, depth and integers, typed.

Every JSON file or string kiln reads from something another process (or person) could have written
goes through :func:`loads` or :func:`read_file`: a package's manifest, runtime graph and weights
header, an engine-cache record, a Triton model folder's ``kiln.json`` and ``kiln-serving.json``, the
webhook's delivery state, a zoo run's summary, workspace refs. ``json.loads`` alone has no bound: a
file as large as the disk is read whole, ``[[[[...`` 100,000 levels deep ends in an untyped
``RecursionError`` (before a package's signature is checked, where the manifest is the file), and an
integer of a million digits is a number every later step computes with.

The bounds (docs/security.md lists them):

* **size**: at most ``max_bytes`` (default :data:`MAX_BYTES`, 64 MiB; callers with smaller files
  pass less), checked from the file's ``fstat`` before a byte is read;
* **depth**: arrays and objects nest at most ``max_depth`` levels (default :data:`MAX_DEPTH`, 64),
  counted by a scan of the bytes with strings removed, without recursion, before the parser runs;
* **integers**: every integer literal within ``|x| <= 2**63`` (:data:`INT_BOUND`): what a shape, a
  size or an offset can need;
* **schema** (optional): the decoded value held to a :mod:`compiler.typed_json` schema.

Any violation, and any text that is not UTF-8 JSON, is one :class:`~compiler.errors.UntrustedJsonError`
(for package files :class:`~compiler.errors.PackageJsonError`, a ``PackageCorruptError`` too) naming
the file and the field or bound. ``tests/test_json_callers.py`` lists the modules allowed to call
``json.loads`` directly (on bytes they wrote themselves): a new caller fails it.

Plain data, no torch.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compiler import typed_json
from compiler.errors import PackageCorruptError, UntrustedJsonError

MAX_BYTES = 64 * 2**20
MAX_DEPTH = 64
INT_BOUND = 2**63
_INT_DIGITS = len(str(INT_BOUND)) + 1  # with a sign: longer literals are refused before int() runs

# A JSON string, or an unterminated one running to the end: every quote starts a match that succeeds,
# so the scan is linear (a pattern that can fail re-scans the rest of the text from each quote).
_STRING_BYTES = re.compile(rb'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
_STRING_TEXT = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def loads(
    data: bytes | bytearray | memoryview | str,
    where: str,
    *,
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
    schema: Any = None,
    error: type[UntrustedJsonError] = UntrustedJsonError,
    object_hook: Callable[[dict], Any] | None = None,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """``data`` decoded as JSON within the bounds; ``error`` (an :class:`UntrustedJsonError`) naming
    ``where`` (the file, or the file and field the JSON came from) otherwise. ``schema``: a
    :mod:`compiler.typed_json` schema the value must have (its field names start at ``where``)."""
    if isinstance(data, memoryview | bytearray):
        data = bytes(data)
    size = len(data.encode("utf-8", "surrogatepass")) if isinstance(data, str) else len(data)
    if size > max_bytes:
        raise error(f"{where} is {size} bytes of JSON, more than the {max_bytes} it may have; refused")
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{where} is not UTF-8 JSON (byte {exc.start}); refused") from None
    else:
        text = data
    depth = nesting_depth(text)
    if depth > max_depth:
        raise error(
            f"{where} nests arrays and objects {depth} levels deep, more than the {max_depth} it may; refused"
        )
    try:
        value = json.loads(
            text, parse_int=_bounded_int, object_hook=object_hook, object_pairs_hook=object_pairs_hook
        )
    except _IntegerOutOfBounds as exc:
        raise error(
            f"{where} holds the integer {exc}, beyond +-2**63 (the bound on any count); refused"
        ) from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, a hook's own refusal
        if isinstance(exc, UntrustedJsonError):
            raise
        refusal = error(f"{where} is not JSON: {exc}")
        refusal.syntax = True  # within every bound, just not JSON (a caller may read it as text)
        raise refusal from None
    if schema is not None:
        try:
            typed_json.check(value, schema, where)
        except PackageCorruptError as exc:
            if isinstance(exc, error):
                raise
            raise error(str(exc)) from None
    return value


def read_file(
    path: str | os.PathLike,
    where: str | None = None,
    *,
    max_bytes: int = MAX_BYTES,
    follow_symlinks: bool = True,
    error: type[UntrustedJsonError] = UntrustedJsonError,
    **options: Any,
) -> Any:
    """The JSON file at ``path`` (a regular file: a FIFO or device is refused without blocking), its size
    checked by ``fstat`` before it is read; then :func:`loads` with ``options``. A missing file raises
    ``FileNotFoundError`` (callers decide what absence means); other failures ``error``."""
    path = Path(path)
    where = where or str(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"{where} cannot be opened as a plain file ({exc.strerror}); refused") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{where} is not a regular file; refused")
        if info.st_size > max_bytes:
            raise error(
                f"{where} is {info.st_size} bytes, more than the {max_bytes} a JSON file here may have; "
                "refused before reading it"
            )
        data = file.read(max_bytes + 1)  # a file that grew since fstat is refused by loads
    return loads(data, where, max_bytes=max_bytes, error=error, **options)


def nesting_depth(text: str | bytes) -> int:
    """How deep arrays and objects nest in ``text`` (strings skipped), without recursion: an upper bound
    on how deep any JSON parser recurses into it."""
    if isinstance(text, str):
        text = _STRING_TEXT.sub("", text).encode("utf-8", "surrogatepass")
    else:
        text = _STRING_BYTES.sub(b"", text)
    brackets = text.translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(_STEP[b] for b in brackets), default=0)


class _IntegerOutOfBounds(ValueError):
    pass


def _bounded_int(literal: str) -> int:
    if len(literal) > _INT_DIGITS:
        raise _IntegerOutOfBounds(f"of {len(literal)} digits")
    value = int(literal)
    if abs(value) > INT_BOUND:
        raise _IntegerOutOfBounds(literal)
    return value
