"""Reading a zoo file: YAML without aliases or runaway nesting, validated against :mod:`zoo.config`'s
schema. A whole-file problem (not YAML, no ``models``, a name used twice) is a :class:`ZooConfigError`;
an entry that fails validation is kept as an :class:`InvalidEntry`, reported as a failed model and
never compiled, while the other entries run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from zoo.config import ZooEntry
from zoo.errors import ZooConfigError
from zoo.request import CompileRequest
from zoo.settings import ZooSettings, _Strict

MAX_YAML_DEPTH = 64


class _ZooFile(_Strict):
    settings: ZooSettings = Field(default_factory=ZooSettings)
    models: list[dict[str, Any]] = Field(min_length=1)


@dataclass(frozen=True)
class InvalidEntry:
    """A model entry that failed validation: reported as a failed model, never compiled."""

    name: str
    error: str


@dataclass
class Zoo:
    settings: ZooSettings
    entries: list[ZooEntry] = field(default_factory=list)
    invalid: list[InvalidEntry] = field(default_factory=list)
    source: str | None = None
    zoo_dir: str | None = None  # the zoo file's directory: its own modules may hold factories

    def requests(self, entry: ZooEntry) -> list[CompileRequest]:
        return entry.requests(self.settings, self.zoo_dir)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries] + [i.name for i in self.invalid]


def format_errors(exc: ValidationError, prefix: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        where = f"{prefix}.{loc}" if loc else prefix
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling against deploy/zoo.yaml"
        elif err["type"] == "missing":
            msg = "required field is missing; add it"
        got = err.get("input")
        # The offending scalar helps; a whole echoed mapping (model-level checks) only adds noise.
        shown = err["type"] not in ("missing", "extra_forbidden") and not isinstance(got, dict | list)
        got_text = f" (got {got!r})" if shown and got is not None else ""
        lines.append(f"{where}: {msg}{got_text}")
    return "; ".join(lines)


def parse_zoo(data: Any, source: str = "<zoo>", zoo_dir: str | None = None) -> Zoo:
    """Validate an already-loaded zoo mapping. Whole-file problems raise; entry problems are collected."""
    if not isinstance(data, dict):
        raise ZooConfigError(
            f"{source}: expected a mapping with 'settings' and 'models', got {type(data).__name__}"
        )
    try:
        zoo_file = _ZooFile.model_validate(data)
    except ValidationError as exc:
        raise ZooConfigError(f"{source}: {format_errors(exc, 'zoo')}") from None
    zoo = Zoo(settings=zoo_file.settings, source=source, zoo_dir=zoo_dir)
    seen: set[str] = set()
    for i, raw in enumerate(zoo_file.models):
        raw_name = raw.get("name") if isinstance(raw, dict) else None
        label = str(raw_name) if isinstance(raw_name, str) and raw_name else f"models[{i}]"
        if label in seen:
            raise ZooConfigError(f"{source}: models[{i}].name: {label!r} is used twice; names must be unique")
        seen.add(label)
        try:
            zoo.entries.append(ZooEntry.model_validate(raw))
        except ValidationError as exc:
            zoo.invalid.append(InvalidEntry(label, format_errors(exc, f"models[{i}] ({label})")))
    return zoo


class _NoAliasLoader(yaml.SafeLoader):
    """safe_load without anchors and aliases: an 800-byte file cannot expand to gigabytes (alias bomb),
    and no deeper than ``MAX_YAML_DEPTH``: deep nesting cannot exhaust the stack."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ZooConfigError(
                f"YAML alias *{event.anchor} at {event.start_mark}: zoo files may not use anchors and "
                "aliases (they can expand without bound); write the values out"
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise ZooConfigError(
                f"YAML nested deeper than {MAX_YAML_DEPTH} levels at {self.peek_event().start_mark}: "
                "a zoo file needs a few levels; check for unclosed or runaway brackets"
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_zoo(path: str | Path) -> Zoo:
    """Read and validate a zoo file (see deploy/zoo.yaml for an annotated example)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ZooConfigError(f"cannot read zoo file {str(path)!r}: {exc.strerror}; check the path") from None
    except UnicodeDecodeError as exc:
        raise ZooConfigError(
            f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); save the zoo file as UTF-8"
        ) from None
    try:
        data = yaml.load(text, Loader=_NoAliasLoader)
    except yaml.YAMLError as exc:
        raise ZooConfigError(f"{path}: not valid YAML: {exc}; fix the syntax at the position shown") from None
    return parse_zoo(data, source=str(path), zoo_dir=str(path.resolve().parent))
