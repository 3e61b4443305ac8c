"""Unchanged models cost a hash: the record of what a request last published, and the check against it.

After a compile publishes a package, its ``PublishedRecord`` is stored in the workspace under the
request's compile key (the source's identity, the request, kiln's code: ``tasks.workspace.compile_key``,
computed without loading the model). On the next run, a request whose key has a record, and whose
package at the output path still verifies with the same content hash, is reused as it is: no model is
loaded, nothing is exported, no flow runs for it. Plain functions, no Prefect: the CLI checks before it
starts any server, and the zoo flow before it starts any per-model flow.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.errors import PackageError
from tasks.workspace import Workspace, compile_key
from zoo.request import CompileRequest

STAGE = "published"


@dataclass(frozen=True)
class PublishedRecord:
    """What one compile of a request published: enough to report it again without running anything."""

    package: str
    content_hash: str
    partitions: int
    unique_engines: int
    fallback_ops: dict[str, int] = field(default_factory=dict)
    max_rel_l2: float | None = None
    latency_ratio: float | None = None
    tracking: dict[str, Any] | None = None  # the registry version it was recorded as, if it was
    precision: str = ""  # compiler.validation.report.precision_summary of its partitions (int8 compiles)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PublishedRecord:
        return cls(**data)


def remember(request: CompileRequest, workspace: str, record: PublishedRecord) -> None:
    Workspace(workspace).put_result(STAGE, compile_key(request), record.to_json())


def unchanged(
    request: CompileRequest, package_path: str, workspace: str, *, tracking: bool
) -> PublishedRecord | None:
    """The last record of this request if nothing changed: same key, the package in place and intact, and
    (with tracking) recorded in the registry. Else None: compile it."""
    import compiler

    try:
        key = compile_key(request)
    except Exception:  # the source cannot be resolved: the compile reports why, not this check
        return None
    data = Workspace(workspace).get_result(STAGE, key)
    if data is None:
        return None
    try:
        record = PublishedRecord.from_json(data)
    except TypeError:
        return None
    if Path(record.package) != Path(package_path).resolve() or (tracking and not record.tracking):
        return None
    try:
        if compiler.read_manifest(record.package).content_hash != record.content_hash:
            return None
    except PackageError:
        return None  # damaged or replaced since: compile (the stages' own results make it quick)
    return record
