"""HTML for ``kiln report``, escaped by construction.

A package's values are untrusted text: any of them may hold markup. The report's pages are built
only with :func:`h`, which fills a literal template and escapes every value it is given (element text
and double-quoted attribute values alike), whatever its type: a count, a name, an error. The one
exception is :class:`Markup`, which only :func:`h` and :func:`join` make, so a fragment is never
escaped twice and nothing reaches the page unescaped: there is no other way to put a value into it.
"""

from __future__ import annotations

import html
import string
from collections.abc import Iterable
from typing import Any


class Markup(str):
    """HTML built by :func:`h` (its values already escaped): interpolated as it is."""

    __slots__ = ()


class _Escaping(string.Formatter):
    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, Markup):
            return value
        return html.escape(format(value, format_spec), quote=True)


_FORMATTER = _Escaping()


def h(template: str, /, *args: Any, **kwargs: Any) -> Markup:
    """``template`` (a literal, with ``str.format`` fields) filled with every value escaped, except
    :class:`Markup`."""
    return Markup(_FORMATTER.format(template, *args, **kwargs))


def join(parts: Iterable[Markup], separator: str = "") -> Markup:
    """Fragments made by :func:`h`, joined; anything else is escaped first."""
    return Markup(
        separator.join(p if isinstance(p, Markup) else html.escape(str(p), quote=True) for p in parts)
    )
