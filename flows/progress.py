"""In-process progress events from the flows, for the CLI's rich progress display.

The flows call ``emit``; the CLI subscribes. Listeners only see events of flows running in their own
process (the CLI runs flows in-process), and a failing listener never breaks a compile.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

Listener = Callable[[str, str, str, str], None]
_listeners: list[Listener] = []
_lock = threading.Lock()


def emit(event: str, model: str, device: str, detail: str) -> None:
    """``event`` is ``model`` (a stage starts), ``done`` (status in ``detail``) or ``failed``."""
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        with contextlib.suppress(Exception):
            listener(event, model, device, detail)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)
