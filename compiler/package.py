"""Package: one self-describing directory per compiled model (seeds 003, 004).

    manifest.json            format version, specs, versions, plan, report, validation, file checksums
    program.pt2              the exported program (torch.export format), weights left hollow
    weights.safetensors      every weight, once
    engines/<fp>.engine      one engine per unique fingerprint (weight-stripped or full); none for a
                             fingerprint whose build fell back to PyTorch (the program runs it)

Loading checks the format version and every checksum before anything is used, never unpickles
(torch.export.load reads weights-only; safetensors is plain bytes), and needs no example inputs.
Saving writes into a temporary directory beside the target and renames it into place, so a failed
save leaves the previous package (or nothing) at the path, never half of one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from compiler.atomic import sha256_file, write_bytes_atomic
from compiler.backends import get_backend
from compiler.backends.base import EngineIO
from compiler.build import TORCH, EngineArtifact
from compiler.dedup import DedupPlan
from compiler.errors import EngineCompatibilityError, PackageCorruptError, PackageError, PackageVersionError
from compiler.export import load_program, save_program
from compiler.partition import program_weights, replay
from compiler.report import CompileReport
from compiler.runtime import CompiledModule, assemble, with_weights
from compiler.version import kiln_version

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROGRAM = "program.pt2"
WEIGHTS = "weights.safetensors"


@dataclass(frozen=True)
class PackageInfo:
    path: Path
    manifest: dict
    bytes: int

    @property
    def content_hash(self) -> str:
        return self.manifest["content_hash"]


def save(
    compiled: CompiledModule, path: str | os.PathLike, *, validation: object | None = None
) -> PackageInfo:
    """Write ``compiled`` as a package directory at ``path`` (replacing an old one atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        plan = compiled.plan
        save_program(_hollow(plan.program), tmp / PROGRAM)
        weights = {k: v.detach().cpu().contiguous().clone() for k, v in sorted(compiled.weights.items())}
        write_bytes_atomic(tmp / WEIGHTS, safetensors.torch.save(weights))
        (tmp / "engines").mkdir()
        engines = {}
        for fp, artifact in sorted(compiled.engines.items()):
            rel = f"engines/{fp}.engine" if artifact.is_engine else None
            if rel is not None:
                write_bytes_atomic(tmp / rel, artifact.engine)
            engines[fp] = {
                "file": rel,
                "io": artifact.io.to_dict(),
                "cache_key": artifact.cache_key,
                "bytes": artifact.bytes,
                "stripped": artifact.stripped,
                "backend": artifact.backend,
                "build_failure": artifact.build_failure,
            }
        report = compiled.report
        files = {
            str(p.relative_to(tmp)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        manifest = {
            "format_version": FORMAT_VERSION,
            "kiln_version": kiln_version(),
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "input_specs": [s.to_dict() for s in compiled.input_specs],
            "backend": report.backend,
            "backend_version": report.backend_version,
            "target_device": report.target_device,
            "precision": report.precision,
            "strip_weights": report.strip_weights,
            "input_weights": sorted(plan.input_weights),
            "plan": plan.to_dict(),
            "dedup": compiled.dedup.to_dict(),
            "engines": engines,
            "report": report.to_dict(),
            "validation": _as_dict(validation),
            "files": files,
        }
        manifest["content_hash"] = content_hash(manifest)
        write_bytes_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
        _swap_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(f["bytes"] for f in manifest["files"].values()) + (path / MANIFEST).stat().st_size
    return PackageInfo(path, manifest, total)


def read_manifest(path: str | os.PathLike, *, verify: bool = True) -> dict:
    """The package's manifest, after checking its format version and (by default) every file's checksum."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise PackageCorruptError(f"{path} is not a kiln package: {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise PackageCorruptError(f"{manifest_path} is not valid JSON: {exc}") from exc
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if not isinstance(version, int):
        raise PackageCorruptError(f"{manifest_path} has no integer format_version")
    if version > FORMAT_VERSION:
        raise PackageVersionError(
            f"{path} was written by package format {version} (kiln {manifest.get('kiln_version')}); "
            "this kiln "
            f"({kiln_version()}) reads formats <= {FORMAT_VERSION}: upgrade kiln to load it"
        )
    if verify:
        # The file checksums cover every file but the manifest; its meaning is covered by the hash.
        try:
            expected = content_hash(manifest)
        except (KeyError, TypeError) as exc:
            raise PackageCorruptError(f"{manifest_path} lacks a field every package has: {exc}") from exc
        if manifest.get("content_hash") != expected:
            raise PackageCorruptError(
                f"{manifest_path} does not match its content_hash: the manifest was edited after saving"
            )
        for rel, entry in manifest.get("files", {}).items():
            file = path / rel
            if not file.is_file():
                raise PackageCorruptError(f"{path}: file {rel} listed in the manifest is missing")
            if file.stat().st_size != entry["bytes"] or sha256_file(file) != entry["sha256"]:
                raise PackageCorruptError(
                    f"{path}: file {rel} does not match its checksum "
                    f"(expected sha256 {entry['sha256'][:16]}..., "
                    f"{entry['bytes']} bytes); the package is corrupt or was modified"
                )
    return manifest


def load(path: str | os.PathLike) -> CompiledModule:
    """Load a package: verify, re-create the split graph from the saved plan, refit engines, ready to call."""
    path = Path(path)
    manifest = read_manifest(path)
    # Each engine runs on the backend that built it (packages from before per-engine backends: the
    # package's); only a backend some engine needs must be present here.
    backends = {fp: entry.get("backend", manifest["backend"]) for fp, entry in manifest["engines"].items()}
    if manifest["backend"] in backends.values():
        backend = get_backend(manifest["backend"])
        if (
            manifest["backend"].startswith("tensorrt")
            and backend.library_version() != manifest["backend_version"]
        ):
            raise EngineCompatibilityError(
                f"{path} holds {manifest['backend']} {manifest['backend_version']} engines; this machine "
                f"has {backend.library_version()}: recompile for it"
            )
    program = load_program(path / PROGRAM)
    weights = safetensors.torch.load_file(path / WEIGHTS)
    own = set(program_weights(program))
    missing = sorted((own | set(manifest["input_weights"])) - set(weights))
    if missing:
        raise PackageCorruptError(f"{path}: {WEIGHTS} lacks weights {missing[:10]}")
    program = with_weights(program, {k: v for k, v in weights.items() if k in own})
    plan = replay(program, manifest["plan"])
    plan.input_weights = {k: weights[k] for k in manifest["input_weights"]}
    engines = {
        fp: EngineArtifact(
            fp,
            entry["cache_key"],
            b"" if backends[fp] == TORCH else (path / entry["file"]).read_bytes(),
            EngineIO.from_dict(entry["io"]),
            entry["stripped"],
            True,
            0.0,
            backend=backends[fp],
            build_failure=entry.get("build_failure"),
        )
        for fp, entry in manifest["engines"].items()
    }
    compiled = assemble(
        plan,
        DedupPlan.from_dict(manifest["dedup"]),
        engines,
        report=CompileReport.from_dict(manifest["report"]),
    )
    compiled.validation = manifest.get("validation")
    return compiled


def refit_package(path: str | os.PathLike, state: Mapping[str, torch.Tensor]) -> PackageInfo:
    """Put new weights of the same structure (a fine-tuned checkpoint) into a saved package: no rebuild.

    The old validation no longer describes these weights, so it is dropped; validate again.
    """
    compiled = load(path).refit(state)
    return save(compiled, path, validation=None)


def _hollow(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The program with every weight replaced by a one-element tensor expanded to its shape.

    The graph and shapes survive torch.export.save; the values live once, in weights.safetensors.
    """

    def hollow(t: torch.Tensor) -> torch.Tensor:
        empty = torch.zeros((), dtype=t.dtype).expand(t.shape)
        return (
            torch.nn.Parameter(empty, requires_grad=t.requires_grad)
            if isinstance(t, torch.nn.Parameter)
            else empty
        )

    new = copy.copy(program)
    new._state_dict = {k: hollow(v) for k, v in program.state_dict.items()}
    new._constants = {
        k: hollow(v) if isinstance(v, torch.Tensor) else v for k, v in program.constants.items()
    }
    return new


def content_hash(manifest: dict) -> str:
    """Equal content, equal hash: weights, engines and the compile's meaning.

    Not timestamps, and not the pt2 zip, whose bytes vary between saves of one program.
    """
    core = {
        "weights": manifest["files"][WEIGHTS]["sha256"],
        "engines": {rel: f["sha256"] for rel, f in manifest["files"].items() if rel.startswith("engines/")},
        # Which fingerprints run on another backend than the package's (build fallbacks). Only present
        # when some do, so packages without fallbacks (every package saved before engines recorded their
        # backend) hash as they always did and still verify. The failure text is diagnostic, like the
        # report, and stays out.
        **_fallback_backends(manifest),
        **{
            k: manifest[k]
            for k in (
                "input_specs",
                "backend",
                "backend_version",
                "target_device",
                "precision",
                "strip_weights",
                "plan",
                "dedup",
            )
        },
    }
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()


def _fallback_backends(manifest: dict) -> dict:
    other = {
        fp: entry["backend"]
        for fp, entry in manifest["engines"].items()
        if entry.get("backend", manifest["backend"]) != manifest["backend"]
    }
    return {"engine_backends": other} if other else {}


def _swap_into_place(tmp: Path, path: Path) -> None:
    if not path.exists():
        os.replace(tmp, path)
        return
    if not (path / MANIFEST).exists() and any(path.iterdir()):
        raise PackageError(f"{path} exists and is not a kiln package; refusing to replace it")
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _as_dict(value: object | None) -> dict | None:
    if value is None:
        return None
    return value.to_dict() if hasattr(value, "to_dict") else dict(value)  # type: ignore[call-overload]
