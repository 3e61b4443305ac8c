"""Inductor graphs compiled in this process, by library key: a build followed by a load, a stripped and
a full twin of one engine, and the instances of one fingerprint compile once.

Only the most recent ``RECENT_LIMIT`` are kept (a long zoo run must not grow without bound; engines
keep their own graph alive). Compiles take ``COMPILE_LOCK``: Inductor's cache-artifact recording is
process-wide.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

# One compile at a time. Always taken before the compiler's tracing lock (compiler.program.tracing.TRACING,
# taken inside), so exports never overlap a compile and the two locks are never taken in the other order.
COMPILE_LOCK = threading.RLock()
RECENT_LIMIT = 128
# key -> (the compiled graph, its saved artifact where this process built it: what a build stores)
_RECENT: OrderedDict[str, tuple[Callable[..., Any], bytes | None]] = OrderedDict()
# key -> the AOTInductor package built for it (or None) and its compiler (or why there is none)
_AOT: dict[str, tuple[bytes | None, str | None]] = {}


def library_key(program: bytes, header: Mapping[str, Any]) -> str:
    """One compiled graph per program, torch, device and options: what instances and rebuilds share."""
    meta = {k: header.get(k) for k in ("torch", "device", "device_index", "options")}
    return hashlib.sha256(program + json.dumps(meta, sort_keys=True).encode()).hexdigest()


def recall(key: str) -> tuple[Callable[..., Any] | None, bytes | None]:
    """(the compiled graph, its artifact) kept under ``key``; (None, None) where none is."""
    if key not in _RECENT:
        return None, None
    _RECENT.move_to_end(key)
    return _RECENT[key]


def remember(key: str, compiled: Callable[..., Any], artifact: bytes | None) -> None:
    """Keep ``compiled`` under ``key``; an artifact kept before stays where none is given."""
    _RECENT[key] = compiled, artifact if artifact is not None else _RECENT.get(key, (None, None))[1]
    _RECENT.move_to_end(key)
    while len(_RECENT) > RECENT_LIMIT:
        _RECENT.popitem(last=False)


def recall_aot(
    key: str, build: Callable[[], tuple[bytes | None, str | None]]
) -> tuple[bytes | None, str | None]:
    """The AOTInductor package of ``key`` (and its compiler, or why there is none), built once per
    process: a stripped or full twin does not compile it again. The last 16 are kept."""
    if key not in _AOT:
        _AOT[key] = build()
        while len(_AOT) > 16:
            _AOT.pop(next(iter(_AOT)))
    return _AOT[key]
