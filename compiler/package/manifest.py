"""Manifest: the typed contract between a package on disk and everything that reads it.

One frozen :class:`Manifest` per package, with one JSON codec (:meth:`Manifest.from_json`,
:meth:`Manifest.to_json`); the compiler, the tasks and the registry read it by attribute. Format 3
(this code) writes it; format 2 reads without ``output_specs`` (None: servers cannot know the outputs
without running the package); format-1 manifests (kiln before the typed manifest) still read:
``target_device`` becomes ``engine_target``, an engine without a ``backend`` runs on the package's,
the volatile ``created`` stamp is dropped and ``op_modules`` come from the program archive.

Every value is typed at read: :meth:`Manifest.from_json` checks the whole manifest against
:data:`MANIFEST_SCHEMA` (and the report and validation against their own schemas) before it builds
anything, so an integer field holding a string, a list where a number goes or a string where true/false
goes is a :class:`PackageCorruptError` naming the field (``manifest.report.engines_built``), never
coerced.
What the records mean (the plan replays, the dedup fits, the specs are valid) is checked by their
decoders and at load.

The layout rules (:func:`check_layout`) are pure: every path the manifest names is relative, inside
the package and listed in ``files``, and an engine's file is exactly ``engines/<fingerprint>.engine``.
Hashing lives in :mod:`compiler.package.digest`, checksums of the bytes on disk in
:mod:`compiler.package.check`.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compiler.backends import TORCH  # the "backend" of a build that fell back to PyTorch: no engine file
from compiler.backends.base import EngineIO
from compiler.errors import PackageCorruptError
from compiler.inputs.specs import InputSpec, OutputSpec
from compiler.options import CompileOptions
from compiler.package import chunks
from compiler.runtime.compile_report import BUILD_FAILURE, ENGINE_FIELDS, QUANTIZATION, CompileReport
from compiler.typed_json import ANY, DIGITS, ListOf, MapOf, OneOf, Opt, Record, check
from compiler.validation.report import ValidationReport

# 3: output_specs (what a server is told the outputs are, recorded at compile); 2 still reads (none).
FORMAT_VERSION = 3
# File names in a package (MANIFEST_SCHEMA, below, is what the manifest file holds).
MANIFEST_FILE = "manifest.json"
PROGRAM = "program.pt2"
WEIGHTS = "weights.safetensors"
RUNTIME_GRAPH = "runtime_graph.json"  # optional: the split graph as data (partitioning/runtime_graph.py)
GENERATION = "generation.json"  # optional: a prefill program whose decode program is under decode/
SIGNATURE = "model.sig"  # optional, never listed in files: compiler/package/signing.py
ENGINE_DIR = "engines"

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FINGERPRINT = re.compile(r"^[0-9a-zA-Z_-]{1,128}$")
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


_SPEC = Record(  # InputSpec.to_dict()
    {
        "name": str,
        "dtype": str,
        "min_shape": ListOf(int),
        "opt_shape": ListOf(int),
        "max_shape": ListOf(int),
        "dynamic_dims": MapOf(str, keys=DIGITS),
        "value_range": Opt(ListOf(float)),
        "index_bound": Opt(int),
    },
    required=frozenset({"name", "dtype", "min_shape", "opt_shape", "max_shape"}),
)
_OUTPUT_SPEC = Record(  # OutputSpec.to_dict()
    {
        "name": str,
        "dtype": str,
        "min_shape": ListOf(int),
        "max_shape": ListOf(int),
        "dynamic_dims": MapOf(str, keys=DIGITS),
    },
    required=frozenset({"name", "dtype", "min_shape", "max_shape"}),
)
_ENGINE = Record(
    {
        "file": Opt(str),
        "io": Record(
            {"inputs": ListOf(_SPEC), "output_names": ListOf(str), "output_dtypes": ListOf(str)},
            required=frozenset({"inputs", "output_names", "output_dtypes"}),
        ),
        "cache_key": str,
        "bytes": int,
        "stripped": bool,
        "backend": Opt(str),  # format 1: absent, the package's
        "build_failure": Opt(BUILD_FAILURE),
    },
    required=frozenset({"file", "io", "cache_key", "bytes", "stripped"}),
)
_PLAN_PARTITION = Record(  # compiler.partitioning.partition.Partition.to_dict()
    {
        "name": str,
        "nodes": ListOf(str),
        "block": Opt(str),
        "ops": MapOf(int),
        "num_outputs": int,
        "inputs": ListOf(
            Record(
                {"node": str, "kind": OneOf(("activation", "weight")), "weight_key": Opt(str)},
                required=frozenset({"node", "kind"}),
            )
        ),
    },
    required=frozenset({"name", "nodes", "inputs", "num_outputs", "ops"}),
)
_PLAN = Record(  # PartitionPlan.to_dict(); options are decoded by CompileOptions.from_dict where used
    {
        "options": Record({"partition_precision": MapOf(str)}),
        "partitions": ListOf(_PLAN_PARTITION),
        "fallback_ops": MapOf(int),
        "quantization": Opt(QUANTIZATION),
        "elided_weights": ListOf(str),
        "reduced_weights": MapOf(OneOf(("float16", "bfloat16"))),  # writing.weights_at_engine_precision
    }
)
_DEDUP = Record(  # DedupPlan.to_dict()
    {
        "unique": MapOf(str),
        "instances": ListOf(
            Record(
                {"partition": str, "fingerprint": str, "weights": MapOf(str)},
                required=frozenset({"partition", "fingerprint", "weights"}),
            )
        ),
    }
)
_SOURCE = Record(
    {"uri": str, "kind": str, "version": str, "identity": str, "run_id": Opt(str)},
    required=frozenset({"uri"}),
)
MANIFEST_SCHEMA = Record(
    {
        "format_version": int,
        "kiln_version": str,
        "torch_version": str,
        "input_specs": ListOf(_SPEC),
        "output_specs": ListOf(_OUTPUT_SPEC),  # format 3
        **ENGINE_FIELDS,
        "input_weights": ListOf(str),
        "plan": _PLAN,
        "dedup": _DEDUP,
        "engines": MapOf(_ENGINE),
        "report": ANY,  # CompileReport.from_dict checks it
        "validation": ANY,  # ValidationReport.from_dict checks it
        "files": MapOf(
            Record(
                {"sha256": str, "bytes": int, "chunk_bytes": Opt(int), "chunks": ListOf(str)},
                required=frozenset({"sha256", "bytes"}),
            )
        ),
        "op_modules": ListOf(str),
        "source": Opt(_SOURCE),
        "content_hash": str,
        "signature": Opt(str),
    },
    required=frozenset(
        {
            "format_version",
            "kiln_version",
            "torch_version",
            "input_specs",
            "backend",
            "backend_version",
            "precision",
            "strip_weights",
            "input_weights",
            "plan",
            "dedup",
            "engines",
            "report",
            "files",
        }
    ),
)


def engine_file(fingerprint: str) -> str:
    """Where the engine of ``fingerprint`` lives inside a package (the only place it may live)."""
    return f"{ENGINE_DIR}/{fingerprint}.engine"


@dataclass(frozen=True)
class FileRecord:
    """A file of the package: its sha256 and size, checked before its bytes are used. A file larger
    than one chunk also lists each ``chunk_bytes`` piece's sha256 (compiler.package.chunks), so that a
    load checks the pieces on several threads at once."""

    sha256: str
    bytes: int
    chunk_bytes: int | None = None
    chunks: tuple[str, ...] = ()

    @classmethod
    def of(cls, data: bytes | memoryview) -> FileRecord:
        """The record of a file holding ``data``."""
        whole, step, pieces = chunks.file_digests(data)
        return cls(whole, len(data), step, pieces)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"bytes": self.bytes, "sha256": self.sha256}
        if self.chunks:
            data.update(chunk_bytes=self.chunk_bytes, chunks=list(self.chunks))
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], rel: str = "a file") -> FileRecord:
        check(data, MANIFEST_SCHEMA.fields["files"].of, f"the file record of {rel}")
        record = cls(data["sha256"], data["bytes"], data.get("chunk_bytes"), tuple(data.get("chunks", ())))
        wrong = chunks.malformed(record.bytes, record.chunk_bytes, record.chunks)
        if wrong is None and not all(_SHA256.match(c) for c in record.chunks):
            wrong = "a chunk digest that is not a sha256"
        if wrong is not None:
            raise PackageCorruptError(f"the manifest's chunk list of {rel} is malformed: {wrong}")
        return record


@dataclass(frozen=True)
class EngineRecord:
    """One unique engine (per fingerprint): its file (None when its build fell back to PyTorch), the
    activations it takes and returns, and the backend that runs it."""

    file: str | None
    io: EngineIO
    cache_key: str
    bytes: int
    stripped: bool
    backend: str
    build_failure: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "io": self.io.to_dict(),
            "cache_key": self.cache_key,
            "bytes": self.bytes,
            "stripped": self.stripped,
            "backend": self.backend,
            "build_failure": self.build_failure,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], package_backend: str) -> EngineRecord:
        check(data, _ENGINE, "engine record")
        # Format-1 packages from before per-engine backends: every engine runs on the package's.
        return cls(
            file=data["file"],
            io=EngineIO.from_dict(data["io"]),
            cache_key=data["cache_key"],
            bytes=data["bytes"],
            stripped=data["stripped"],
            backend=data.get("backend") or package_backend,
            build_failure=data.get("build_failure"),
        )


@dataclass(frozen=True)
class SourceRecord:
    """Lineage: where the compiled model came from (``zoo.sources``' identity, as data)."""

    uri: str  # as the user wrote it: "factory:zoo.models:tiny_bert", "hf:...", "models:/x/3"
    kind: str = ""  # "factory", "hf", "mlflow", "pt2", ...
    version: str = ""  # the resolved version or revision ("" where the kind has none)
    identity: str = ""  # the source's digest: equal identity, equal model
    run_id: str | None = None  # the source's MLflow run, where there is one

    def to_json(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "kind": self.kind,
            "version": self.version,
            "identity": self.identity,
            "run_id": self.run_id,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SourceRecord:
        check(data, _SOURCE, "source")
        return cls(
            uri=data["uri"],
            kind=data.get("kind", ""),
            version=data.get("version", ""),
            identity=data.get("identity", ""),
            run_id=data.get("run_id"),
        )

    @classmethod
    def of(cls, identity: Any) -> SourceRecord:
        """From anything shaped like ``zoo.sources.base.SourceIdentity`` (kind, uri, version, digest)."""
        return cls(
            uri=str(identity.uri),
            kind=str(getattr(identity, "kind", "")),
            version=str(getattr(identity, "version", "")),
            identity=str(getattr(identity, "digest", "")),
            run_id=getattr(identity, "run_id", None),
        )


@dataclass(frozen=True)
class Manifest:
    """Everything a package says about itself. ``content_hash`` covers all of it (see package.py)."""

    format_version: int
    kiln_version: str
    torch_version: str
    input_specs: tuple[InputSpec, ...]
    backend: str  # the compile's backend (a fingerprint may run on another: EngineRecord.backend)
    backend_version: str
    engine_target: str  # what the engines are built for: "cpu", "cuda:sm_90"
    precision: str
    strip_weights: bool
    input_weights: tuple[str, ...]  # weights fed to engines as inputs (not in the program)
    plan: dict[str, Any]  # PartitionPlan.to_dict(): replayed on the program at load
    dedup: dict[str, Any]  # DedupPlan.to_dict()
    engines: dict[str, EngineRecord]  # fingerprint -> record
    report: CompileReport
    validation: ValidationReport | None
    files: dict[str, FileRecord]  # relative path -> checksum; every file a load reads
    op_modules: tuple[str, ...] = ()  # modules that register the program's custom ops / pytree types
    source: SourceRecord | None = None
    content_hash: str = ""
    # The HMAC that kiln before model-signing wrote (KILN_SIGNING_KEY): read as data, never checked or
    # written now. Signatures are the package's model.sig (compiler/package/signing.py).
    signature: str | None = None
    # What the model returns (format 3; None for a package written before kiln recorded it).
    output_specs: tuple[OutputSpec, ...] | None = None

    @property
    def options(self) -> CompileOptions:
        """The compile's options, as recorded in the plan."""
        return CompileOptions.from_dict(self.plan["options"])

    def engine_backends(self) -> dict[str, str]:
        return {fp: record.backend for fp, record in self.engines.items()}

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON data (format 3). ``signature`` and ``output_specs`` only appear when set."""
        data: dict[str, Any] = {
            "format_version": self.format_version,
            "kiln_version": self.kiln_version,
            "torch_version": self.torch_version,
            "input_specs": [s.to_dict() for s in self.input_specs],
            "backend": self.backend,
            "backend_version": self.backend_version,
            "engine_target": self.engine_target,
            "precision": self.precision,
            "strip_weights": self.strip_weights,
            "input_weights": list(self.input_weights),
            "plan": self.plan,
            "dedup": self.dedup,
            "engines": {fp: record.to_json() for fp, record in sorted(self.engines.items())},
            "report": self.report.to_dict(),
            "validation": None if self.validation is None else self.validation.to_dict(),
            "files": {rel: record.to_json() for rel, record in sorted(self.files.items())},
            "op_modules": list(self.op_modules),
            "source": None if self.source is None else self.source.to_json(),
            "content_hash": self.content_hash,
        }
        if self.signature is not None:
            data["signature"] = self.signature
        if self.output_specs is not None:
            data["output_specs"] = [s.to_dict() for s in self.output_specs]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        """Read a format-1, 2 or 3 manifest. A missing or mistyped field: PackageCorruptError."""
        try:
            return cls._from_json(data)
        except PackageCorruptError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            what = f"field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            raise PackageCorruptError(f"the manifest is malformed ({what})") from exc

    @classmethod
    def _from_json(cls, data: Mapping[str, Any]) -> Manifest:
        check(data, MANIFEST_SCHEMA, "manifest")
        version = data["format_version"]
        backend = data["backend"]
        # Format 1 called the engine target "target_device"; "device" now means where a model runs.
        target_field = "engine_target" if version >= 2 else "target_device"
        check(data, Record({}, required=frozenset({target_field})), "manifest")
        validation = data.get("validation")
        source = data.get("source")
        return cls(
            format_version=version,
            kiln_version=data["kiln_version"],
            torch_version=data["torch_version"],
            input_specs=tuple(InputSpec.from_dict(s) for s in data["input_specs"]),
            backend=backend,
            backend_version=data["backend_version"],
            engine_target=data[target_field],
            precision=data["precision"],
            strip_weights=data["strip_weights"],
            input_weights=tuple(data["input_weights"]),
            plan=dict(data["plan"]),
            dedup=dict(data["dedup"]),
            engines={fp: EngineRecord.from_json(e, backend) for fp, e in data["engines"].items()},
            report=CompileReport.from_dict(data["report"], "manifest.report"),
            validation=None
            if validation is None
            else ValidationReport.from_dict(validation, "manifest.validation"),
            files={rel: FileRecord.from_json(f, rel) for rel, f in data["files"].items()},
            op_modules=tuple(data.get("op_modules", ())),
            source=None if source is None else SourceRecord.from_json(source),
            content_hash=data.get("content_hash", ""),
            signature=data.get("signature"),
            output_specs=None
            if "output_specs" not in data
            else tuple(OutputSpec.from_dict(s) for s in data["output_specs"]),
        )


def safe_relative(rel: str) -> bool:
    """Whether ``rel`` is a plain relative POSIX path that stays inside its root (no ``..``, no ``/x``)."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        return False
    if rel.startswith("/") or re.match(r"^[A-Za-z]:", rel):
        return False
    return posixpath.normpath(rel) == rel and not any(part in ("", ".", "..") for part in rel.split("/"))


def check_layout(manifest: Manifest, where: str) -> None:
    """Refuse a manifest whose paths leave the package or are not the ones a package may hold.

    Listed files are exactly ``program.pt2``, ``weights.safetensors``, optionally
    ``runtime_graph.json``, and one ``engines/<fingerprint>.engine`` per engine that has a file; each
    engine's file is its own. The signature ``model.sig`` is the one file a package may hold beyond
    them and the manifest, and is never listed: it signs the manifest, so no hash in it can cover it.
    Raises PackageCorruptError naming the bad path.
    """
    for rel in manifest.files:
        if not safe_relative(rel):
            raise PackageCorruptError(f"{where}: the manifest lists {rel!r}, a path outside the package")
    if SIGNATURE in manifest.files:
        raise PackageCorruptError(
            f"{where}: the manifest lists {SIGNATURE}, the signature that signs the manifest; a package "
            "never lists it"
        )
    for required in (PROGRAM, WEIGHTS):
        if required not in manifest.files:
            raise PackageCorruptError(f"{where}: the manifest does not list {required}")
    expected = {PROGRAM, WEIGHTS, *({RUNTIME_GRAPH} & set(manifest.files))}
    if GENERATION in manifest.files:  # decode/ is a package of its own, checked where it loads
        expected |= {GENERATION, *(rel for rel in manifest.files if rel.startswith("decode/"))}
    for fp, record in manifest.engines.items():
        if not _FINGERPRINT.match(fp):
            raise PackageCorruptError(f"{where}: engine fingerprint {fp!r} is not a fingerprint")
        if record.backend == TORCH:
            if record.file is not None:
                raise PackageCorruptError(
                    f"{where}: engine {fp[:16]} runs in PyTorch but names a file {record.file!r}"
                )
            continue
        if record.file != engine_file(fp):
            raise PackageCorruptError(
                f"{where}: engine {fp[:16]} points at {record.file!r}; its file must be {engine_file(fp)!r}"
            )
        if record.file not in manifest.files:
            raise PackageCorruptError(f"{where}: engine file {record.file} is not listed in the manifest")
        expected.add(record.file)
    extra = sorted(set(manifest.files) - expected)
    if extra:
        raise PackageCorruptError(f"{where}: the manifest lists files no part of the package uses: {extra}")
    for rel, record in manifest.files.items():
        if not _SHA256.match(record.sha256) or record.bytes < 0:
            raise PackageCorruptError(f"{where}: the checksum of {rel} is malformed")
    for module in manifest.op_modules:
        if not _MODULE.match(module):
            raise PackageCorruptError(f"{where}: op module {module!r} is not a module name")


__all__ = [
    "FORMAT_VERSION",
    "EngineRecord",
    "FileRecord",
    "Manifest",
    "SourceRecord",
    "check_layout",
    "engine_file",
    "safe_relative",
]
