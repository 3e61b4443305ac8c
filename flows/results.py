"""What a run reports, without Prefect: one ``ModelResult`` per (model, device), the summary file, and
the rows of unchanged models (``tasks.reuse``).

Apart from the flows so that the CLI's no-op path (every model unchanged) imports neither Prefect nor
the compile stages: it costs the zoo file, a hash and a manifest read per model (issue 21).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler.atomic import write_bytes_atomic
from flows import progress

if TYPE_CHECKING:
    from tasks.reuse import PublishedRecord
    from zoo.request import CompileRequest
    from zoo.settings import ZooSettings

SUMMARY_FILE = "summary.json"


@dataclass
class ModelResult:
    """One row of a zoo summary: what happened to one model on one device."""

    name: str
    device: str
    status: str  # "ok" | "failed"
    error: str | None = None
    package: str | None = None
    content_hash: str | None = None
    partitions: int = 0
    unique_engines: int = 0
    engines_built: int = 0
    engines_reused: int = 0
    fallback_ops: dict[str, int] = field(default_factory=dict)
    max_rel_l2: float | None = None
    latency_ratio: float | None = None
    seconds: float = 0.0
    tracking: dict | None = None
    build_workers: list[str] = field(default_factory=list)
    engine_cache: str | None = None  # the engine cache this compile used (None: none)
    warnings: list[str] = field(default_factory=list)  # the engine cache degraded (corrupt, read-only)
    unchanged: bool = False  # nothing ran: the request's last package is in place (tasks.reuse)
    # Its partitions' precision: "fp32", or the plan the gate chose for int8 ("int8 x11; fp32: engine_2")
    precision: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, request: CompileRequest, record: PublishedRecord) -> ModelResult:
        """The row of a request whose package is unchanged: every engine reused, nothing run."""
        return cls(
            name=request.name,
            device=request.device,
            status="ok",
            package=record.package,
            content_hash=record.content_hash,
            partitions=record.partitions,
            unique_engines=record.unique_engines,
            engines_reused=record.unique_engines,
            fallback_ops=dict(record.fallback_ops),
            max_rel_l2=record.max_rel_l2,
            latency_ratio=record.latency_ratio,
            tracking=record.tracking,
            unchanged=True,
            precision=record.precision or request.options.precision,
        )


def package_path(out_dir: str, request: CompileRequest) -> str:
    """``<out>/<package name>.kiln`` (the name carries the device when an entry lists several)."""
    return str(Path(out_dir) / f"{request.package_name}.kiln")


def reuse_unchanged(
    requests: list[CompileRequest], out_dir: str, settings: ZooSettings, results: list[ModelResult]
) -> tuple[list[CompileRequest], list[ModelResult]]:
    """(requests to compile, results with a reused row per unchanged request): see ``tasks.reuse``."""
    from tasks.reuse import unchanged

    workspace = str(Path(settings.workspace).resolve())
    tracking = settings.tracking_enabled()
    fresh = []
    for request in requests:
        record = unchanged(request, package_path(out_dir, request), workspace, tracking=tracking)
        if record is None:
            fresh.append(request)
            continue
        results = [*results, ModelResult.from_record(request, record)]
        progress.emit("done", request.name, request.device, "unchanged")
    return fresh, results


def write_summary(
    results: list[ModelResult], out_dir: str, settings: ZooSettings, seconds: float, *, zoo: str
) -> dict[str, Any]:
    """The run's summary, written atomically to ``<out_dir>/summary.json`` (``kiln compile`` too)."""
    summary = {
        "zoo": zoo,
        "out_dir": out_dir,
        "ok": sum(r.status == "ok" for r in results),
        "failed": sum(r.status != "ok" for r in results),
        "engines_built": sum(r.engines_built for r in results),
        "engines_reused": sum(r.engines_reused for r in results),
        "seconds": round(seconds or sum(r.seconds for r in results), 2),
        "engine_cache": dict(zip(("path", "chosen_by"), settings.engine_cache_choice(), strict=True)),
        "models": [r.to_dict() for r in results],
        "warnings": [f"{r.name}: {w}" for r in results for w in r.warnings],
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(Path(out_dir) / SUMMARY_FILE, json.dumps(summary, indent=2).encode())
    return summary
