"""Values read from disk, made safe to show on a terminal: the one sanitizer every CLI table and log
line uses.

A cache record, a native-build log line, a registry tag or a ``kiln.json`` field is data whoever can
write it chose. Printed raw, its control characters drive the terminal: ``ESC [2J`` clears the screen,
``ESC ]0;...`` sets the window title, ``ESC ]8;;URL`` makes a link, ``\\r`` or a newline writes a fake
line over or under the real one, and Unicode's bidirectional overrides reorder what is read.
:func:`printable` shows each such character as its escape (``\\x1b``, ``\\u202e``) instead: visible,
inert, and still telling what the file holds. Plain data, no torch.
"""

from __future__ import annotations

import re

# C0 and C1 controls and DEL (Unicode's category Cc), the line and paragraph separators, and the
# bidirectional controls (embeddings, overrides, isolates, marks) that reorder a line as displayed.
_OTHERS = "\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\x00-\x1f\x7f-\x9f{_OTHERS}]")
_CONTROL_BUT_LINES = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_OTHERS}]")  # keeps \t and \n


def printable(value: object, limit: int | None = None, *, lines: bool = False) -> str:
    """``str(value)`` with every control character (newlines and tabs too, unless ``lines``) shown as
    its escape; cut to ``limit`` characters (with ``...``) where given."""
    text = str(value)
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    pattern = _CONTROL_BUT_LINES if lines else _CONTROL
    return pattern.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
