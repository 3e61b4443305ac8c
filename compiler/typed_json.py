"""Typed reads of decoded JSON: each value is checked against the type its field declares.

A package's manifest is untrusted data, and Python's conversions coerce instead of checking
(``int("3")`` is 3, ``bool("false")`` is True, ``str([...])`` is a list's repr), so a reader that
converts lets a string through where a number goes, to fail later as a raw ``ValueError`` (recording
it in MLflow) or to reach an HTML page as markup (``kiln report``). The decoders of
:mod:`compiler.package.manifest`, :mod:`compiler.runtime.compile_report` and
:mod:`compiler.validation.report` describe each
record as a schema and :func:`check` it before they build anything: a value of the wrong type is a
:class:`~compiler.errors.PackageCorruptError` naming its path (``manifest.report.engines_built``) and
the type expected.

A schema is ``str``, ``int`` (never a bool), ``float`` (an int or float, never a bool), ``bool``,
``ANY``, one of :class:`Opt`, :class:`ListOf`, :class:`MapOf`, :class:`Record`, :class:`OneOf`,
:class:`Match`, or a tuple of schemas (any one of them).
Plain data, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compiler.errors import PackageCorruptError

ANY = object()  # a value the schema leaves to its reader (decoded and checked elsewhere)


@dataclass(frozen=True)
class Opt:
    """The schema, or null."""

    of: Any


@dataclass(frozen=True)
class ListOf:
    """A JSON array whose every item has the schema."""

    of: Any


@dataclass(frozen=True)
class MapOf:
    """A JSON object with string keys (matching ``keys`` where given) whose every value has the schema."""

    of: Any
    keys: Any = str


@dataclass(frozen=True)
class OneOf:
    """A string among ``values``."""

    values: tuple[str, ...]


@dataclass(frozen=True)
class Match:
    """A string matching ``pattern`` (``what`` says what it is in an error)."""

    pattern: str
    what: str


@dataclass(frozen=True)
class Record:
    """A JSON object: each named field that is present has its schema; ``required`` ones must be
    present. Fields the schema does not name are left alone (no reader takes them)."""

    fields: Mapping[str, Any]
    required: frozenset[str] = frozenset()


NUMBER_TEXT = OneOf(("inf", "-inf", "nan"))  # how compiler.repair writes a non-finite float
DIGITS = Match(r"[0-9]{1,9}", "a decimal integer")  # object keys standing for integers (axes)


def check(value: Any, schema: Any, where: str) -> Any:
    """``value`` unchanged once it has ``schema``; else PackageCorruptError naming ``where``."""
    if schema is ANY:
        return value
    if schema is str or schema is bool:
        if not isinstance(value, schema):
            _refuse(where, "a string" if schema is str else "true or false", value)
    elif schema is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _refuse(where, "an integer", value)
    elif schema is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            _refuse(where, "a number", value)
    elif isinstance(schema, Opt):
        if value is not None:
            check(value, schema.of, where)
    elif isinstance(schema, OneOf):
        if value not in schema.values or not isinstance(value, str):
            _refuse(where, f"one of {list(schema.values)}", value)
    elif isinstance(schema, Match):
        if not isinstance(value, str) or re.fullmatch(schema.pattern, value) is None:
            _refuse(where, schema.what, value)
    elif isinstance(schema, tuple):  # any of several schemas
        for option in schema:
            try:
                return check(value, option, where)
            except PackageCorruptError:
                continue
        _refuse(where, " or ".join(describe(s) for s in schema), value)
    elif isinstance(schema, ListOf):
        if not isinstance(value, list):
            _refuse(where, f"a list of {describe(schema.of)}", value)
        for i, item in enumerate(value):
            check(item, schema.of, f"{where}[{i}]")
    elif isinstance(schema, MapOf):
        if not isinstance(value, dict):
            _refuse(where, f"an object of {describe(schema.of)}", value)
        for key, item in value.items():
            check(key, schema.keys, f"{where} key {key!r:.60}")
            check(item, schema.of, f"{where}[{key!r:.60}]")
    elif isinstance(schema, Record):
        if not isinstance(value, dict):
            _refuse(where, "an object", value)
        missing = sorted(schema.required - set(value))
        if missing:
            raise PackageCorruptError(f"{where} is malformed: it lacks the field {missing[0]!r}")
        for name, field_schema in schema.fields.items():
            if name in value:
                check(value[name], field_schema, f"{where}.{name}")
    else:
        raise TypeError(f"not a schema: {schema!r}")  # a kiln bug, not the data's
    return value


def describe(schema: Any) -> str:
    if schema is ANY:
        return "anything"
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    if schema in names:
        return names[schema]
    if isinstance(schema, Opt):
        return f"{describe(schema.of)} or null"
    if isinstance(schema, OneOf):
        return f"one of {list(schema.values)}"
    if isinstance(schema, Match):
        return schema.what
    if isinstance(schema, tuple):
        return " or ".join(describe(s) for s in schema)
    if isinstance(schema, ListOf):
        return f"a list of {describe(schema.of)}"
    if isinstance(schema, MapOf):
        return f"an object of {describe(schema.of)}"
    return "an object"


def _refuse(where: str, expected: str, value: Any) -> None:
    raise PackageCorruptError(f"{where} must be {expected}, got {type(value).__name__} {value!r:.80}")
