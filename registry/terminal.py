"""What kiln's commands print through: consoles and log lines that show control characters as escapes.

Tables and lines show values read from disk (cache records, the native-build log, registry tags, a
model folder's ``kiln.json``). :func:`compiler.printable.printable` is the one sanitizer; here it is
wired into every way the CLI writes to a terminal: :class:`SafeConsole` renders each string through it
(newlines kept), :func:`shown` makes one value a single safe cell (newlines escaped too, rich markup
escaped), and :func:`sanitize_logs` makes every log record and warning message pass through it.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from compiler.printable import printable


class SafeConsole(Console):
    """A rich console that shows control characters in every string it renders as escapes (newlines
    and tabs kept): a value read from disk that reaches a table or a line still cannot drive the
    terminal (clear it, retitle it, add a link or a fake line)."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(printable(text, lines=True), **kwargs)


def shown(value: object, limit: int | None = None) -> str:
    """A value read from disk as one table cell or part of one line: control characters, newlines
    included, shown as escapes, rich markup escaped, cut to ``limit`` characters."""
    return escape(printable(value, limit))


class _SafeRecord(logging.LogRecord):
    def getMessage(self) -> str:
        return printable(super().getMessage(), lines=True)


def sanitize_logs() -> None:
    """Every log record's message, and every warning's, with control characters shown as escapes
    (newlines kept): what a command logs about a file cannot drive the terminal either."""
    if logging.getLogRecordFactory() is not _SafeRecord:
        logging.setLogRecordFactory(_SafeRecord)
    plain = warnings.formatwarning
    if getattr(plain, "kiln_sanitized", False):
        return

    def formatwarning(message: Any, *args: Any, **kwargs: Any) -> str:
        return plain(printable(message, lines=True), *args, **kwargs)

    formatwarning.kiln_sanitized = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning
