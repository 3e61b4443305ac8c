"""The small values Prefect tasks hand each other, their JSON codec, and the retry policy.

A ref points at files in the workspace (``tasks.workspace``) and carries what the next stage needs to
know without opening them. Refs are stored as plain JSON (one fixed set of types, decoded by field,
never by a class name read from the file), and each can ``verify()`` that the files it names still hold
the bytes they held when it was made: a stored ref whose files were damaged is evicted and its stage
runs again, as a corrupt engine-cache entry is rebuilt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.atomic import sha256_file
from compiler.errors import (
    BackendUnavailableError,
    BuildSettingsError,
    EngineCompatibilityError,
    ExportError,
    InputSpecError,
    KilnError,
    LoweringError,
    PackageError,
    PartitionError,
    RefitError,
)
from compiler.inputs.specs import InputSpec
from compiler.options import CompileOptions
from compiler.runtime.compile_report import CompileReport
from compiler.validation.report import ValidationReport


class ValidationFailedError(KilnError):
    """The compiled model is less accurate (or slower) than the request's tolerances allow."""


def _file_ok(path: str, sha256: str) -> bool:
    p = Path(path)
    return p.is_file() and sha256_file(p) == sha256


@dataclass(frozen=True)
class ProgramRef:
    model: str
    key: str
    path: str
    sha256: str
    input_specs: tuple[InputSpec, ...]
    # The modules its request trusts (the source's own code): the only custom-op modules a load of this
    # program, or of a package made from it, may import (compiler.load's allowed_modules).
    trusted_modules: tuple[str, ...] = ()

    def verify(self) -> bool:
        return _file_ok(self.path, self.sha256)

    def cache_identity(self) -> dict:
        return {"key": self.key, "sha256": self.sha256}

    def to_json(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "input_specs": [s.to_dict() for s in self.input_specs],
            "trusted_modules": list(self.trusted_modules),
        }

    @classmethod
    def from_json(cls, data: dict) -> ProgramRef:
        return cls(
            **{
                **data,
                "input_specs": tuple(InputSpec.from_dict(s) for s in data["input_specs"]),
                "trusted_modules": tuple(data.get("trusted_modules", ())),
            }
        )


@dataclass(frozen=True)
class PlanRef:
    program: ProgramRef
    options: CompileOptions
    plan_path: str
    plan_sha256: str
    dedup_path: str
    dedup_sha256: str
    fingerprints: tuple[str, ...]
    partitions: int
    fallback_ops: dict[str, int] = field(default_factory=dict)
    # int8 partitions: their per-instance tensors and quantized graphs (safetensors, compiler.quantize)
    quantized_path: str = ""
    quantized_sha256: str = ""

    @property
    def sha256(self) -> str:
        sha = f"{self.plan_sha256}-{self.dedup_sha256}"
        return f"{sha}-{self.quantized_sha256}" if self.quantized_sha256 else sha

    def verify(self) -> bool:
        return (
            self.program.verify()
            and _file_ok(self.plan_path, self.plan_sha256)
            and _file_ok(self.dedup_path, self.dedup_sha256)
            and (not self.quantized_path or _file_ok(self.quantized_path, self.quantized_sha256))
        )

    def cache_identity(self) -> dict:
        return {"program": self.program.cache_identity(), "sha256": self.sha256}

    def to_json(self) -> dict:
        return {
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            "program": self.program.to_json(),
            "options": self.options.to_dict(),
            "fingerprints": list(self.fingerprints),
        }

    @classmethod
    def from_json(cls, data: dict) -> PlanRef:
        return cls(
            **{
                **data,
                "program": ProgramRef.from_json(data["program"]),
                "options": CompileOptions.from_dict(data["options"]),
                "fingerprints": tuple(data["fingerprints"]),
            }
        )


@dataclass(frozen=True)
class EngineRef:
    fingerprint: str
    cache_key: str
    path: str  # the engine file; for a PyTorch fallback (no engine) its JSON record
    sha256: str
    bytes: int
    stripped: bool
    cache_hit: bool
    seconds: float
    worker: str  # where it was built: "dask:<address>" or "process:<pid>"
    backend: str  # what runs it: the compile's backend, "onnxruntime" or "torch" after a failed build
    build_failure: dict | None = None
    warnings: tuple[str, ...] = ()  # the engine cache degraded (corrupt entry, read-only, full)

    def verify(self) -> bool:
        return _file_ok(self.path, self.sha256)

    def cache_identity(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "cache_key": self.cache_key,
            "sha256": self.sha256,
            "backend": self.backend,
        }

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> EngineRef:
        return cls(**{**data, "warnings": tuple(data.get("warnings", ()))})


@dataclass(frozen=True)
class StagedRef:
    key: str
    path: str
    content_hash: str
    report: CompileReport
    trusted_modules: tuple[str, ...] = ()  # as ProgramRef's: what loading this package may import

    def load(self) -> Any:
        """The staged CompiledModule (verified; imports only the trusted custom-op modules)."""
        import compiler

        return compiler.load(self.path, allowed_modules=self.trusted_modules)

    def verify(self) -> bool:
        import compiler

        try:
            return compiler.read_manifest(self.path).content_hash == self.content_hash
        except PackageError:
            return False

    def cache_identity(self) -> dict:
        return {"key": self.key, "content_hash": self.content_hash}

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "path": self.path,
            "content_hash": self.content_hash,
            "report": self.report.to_dict(),
        }

    @classmethod
    def from_json(cls, data: dict) -> StagedRef:
        return cls(data["key"], data["path"], data["content_hash"], CompileReport.from_dict(data["report"]))


@dataclass(frozen=True)
class ValidatedRef:
    """A staged package that met its tolerances (after repair, if it needed one) and its report."""

    staged: StagedRef
    report: ValidationReport

    def to_json(self) -> dict:
        return {"staged": self.staged.to_json(), "report": self.report.to_dict()}

    @classmethod
    def from_json(cls, data: dict) -> ValidatedRef:
        return cls(StagedRef.from_json(data["staged"]), ValidationReport.from_dict(data["report"]))


@dataclass(frozen=True)
class PackageRef:
    path: str  # where the package is published (<out>/<name>.kiln)
    content_hash: str
    bytes: int
    run_copy: str  # this run's own copy: what gets recorded, whatever another run wrote to ``path`` since


def is_transient(exc: BaseException | None) -> bool:
    """Whether a failure may pass on a second try (I/O, memory, a busy device): never a deterministic one."""
    deterministic = (
        InputSpecError,
        ExportError,
        PartitionError,
        LoweringError,
        RefitError,
        BackendUnavailableError,
        BuildSettingsError,
        EngineCompatibilityError,
        ValueError,
        TypeError,
        KeyError,
    )
    return not isinstance(exc, deterministic)


def retry_condition(task_: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn``: retry only transient failures (see :func:`is_transient`)."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            state.result(raise_on_failure=True)
        except BaseException as raised:
            exc = raised
    return is_transient(exc)
