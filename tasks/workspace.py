"""The content-addressed workspace that Prefect tasks pass file references into.

Tasks hand each other small value objects (``ProgramRef``, ``PlanRef``, ``EngineRef``, ``StagedRef``)
that point at files here, never engine bytes or models: results stay tiny to persist, Dask workers
read the files they need, and a crashed run resumes from what is already on disk.

    <root>/programs/<key>.pt2        exported programs, named by the model's content key
    <root>/plans/<sha256>.json       partition + dedup plans, named by their own content
    <root>/engines/<cache_key>.engine + .json   engine bytes and their EngineIO, named by the engine's
                                     cache key (fingerprint + backend + version + device + settings)
    <root>/engines/<cache_key>.torch.json        a failed build that fell back to PyTorch: EngineIO and
                                     the failure, no engine (named apart, so a later real build under the
                                     same key is never shadowed)
    <root>/staged/<key>.kiln         assembled, not yet validated packages
    <root>/results/<stage>/<key>.json  each stage's result (a ref, as plain JSON) under its content key

A stage whose result is here, and whose files still verify, does not run again. Results are our own
JSON, never Prefect's pickled result records: a workspace is data, and reading it must not run code
(docs/security.md). A damaged result or file is evicted and rebuilt; deleting any part of the
workspace is safe.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler import json_reader
from compiler.atomic import sha256_file, write_bytes_atomic
from compiler.version import kiln_version

if TYPE_CHECKING:
    from zoo.request import CompileRequest

ROOT = Path(__file__).resolve().parents[1]
# Code whose change must invalidate cached task results: the compiler and these tasks.
_CODE_PACKAGES = ("compiler", "zoo", "tasks")


@cache
def code_version() -> str:
    """kiln's version plus a hash of the compiler's and the tasks' source, so an edit re-runs stages."""
    digest = hashlib.sha256(kiln_version().encode())
    for package in _CODE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if (package, path.name) in (("tasks", "registry.py"), ("zoo", "models.py")):
                # MLflow recording does not change what is compiled; factory sources are in the key.
                continue
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _jsonable(value: Any) -> Any:
    """A stable JSON form of parameters: refs hash by content, pydantic by fields, paths as strings."""
    identity = getattr(value, "cache_identity", None)
    if callable(identity):
        return _jsonable(identity())
    if hasattr(value, "model_dump"):
        return _jsonable(value.model_dump(mode="json"))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=json.dumps) if isinstance(value, set | frozenset) else items
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def content_hash(*parts: Any) -> str:
    """sha256 of the stable JSON form of ``parts``."""
    text = json.dumps(_jsonable(list(parts)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Workspace:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).resolve())

    def dir(self, kind: str) -> Path:
        # Private to the pipeline's account, like the engine cache: staged Inductor engines run as code.
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.root / kind
        path.mkdir(parents=True, exist_ok=True)
        return path

    def result_path(self, stage: str, key: str) -> Path:
        return self.dir(f"results/{stage}") / f"{key}.json"

    def get_result(self, stage: str, key: str) -> dict | None:
        """A stage's stored result (plain JSON), or None; unreadable results are evicted."""
        path = self.result_path(stage, key)
        try:
            return json_reader.read_file(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            return None

    def put_result(self, stage: str, key: str, data: dict) -> None:
        write_bytes_atomic(self.result_path(stage, key), json.dumps(data, sort_keys=True).encode())

    def evict_result(self, stage: str, key: str) -> None:
        self.result_path(stage, key).unlink(missing_ok=True)

    def program_path(self, key: str) -> Path:
        return self.dir("programs") / f"{key}.pt2"

    def staged_path(self, key: str) -> Path:
        return self.dir("staged") / f"{key}.kiln"

    def put_json(self, kind: str, data: Any) -> tuple[Path, str]:
        """Write JSON named by its own sha256 (atomic; an existing equal file is kept).

        Keys keep their order: the compiler's plans map canonical weight names (w0, w1, ..., w10) in
        insertion order, and sorting them would put w10 before w2.
        """
        blob = json.dumps(data, indent=1).encode()
        sha = hashlib.sha256(blob).hexdigest()
        path = self.dir(kind) / f"{sha}.json"
        if not path.exists():
            write_bytes_atomic(path, blob)
        return path, sha

    def put_blob(self, kind: str, data: bytes, suffix: str) -> tuple[Path, str]:
        """Bytes named by their own sha256 (atomic; an existing equal file is kept)."""
        sha = hashlib.sha256(data).hexdigest()
        path = self.dir(kind) / f"{sha}{suffix}"
        if not path.exists():
            write_bytes_atomic(path, data)
        return path, sha

    def put_engine(self, cache_key: str, engine: bytes, io: dict) -> tuple[Path, str]:
        """Engine bytes under their cache key, with the EngineIO beside them; returns (path, sha256)."""
        path = self.dir("engines") / f"{cache_key}.engine"
        sha = hashlib.sha256(engine).hexdigest()
        if not path.exists() or sha256_file(path) != sha:
            write_bytes_atomic(path, engine)
        meta = path.with_suffix(".json")
        write_bytes_atomic(meta, json.dumps({"io": io, "sha256": sha}, sort_keys=True).encode())
        return path, sha

    def put_fallback(self, cache_key: str, io: dict, build_failure: dict | None) -> tuple[Path, str]:
        """The record of a build that fell back to PyTorch (no engine bytes); returns (path, sha256)."""
        blob = json.dumps({"io": io, "backend": "torch", "build_failure": build_failure}, sort_keys=True)
        path = self.dir("engines") / f"{cache_key}.torch.json"
        write_bytes_atomic(path, blob.encode())
        return path, hashlib.sha256(blob.encode()).hexdigest()


def read_json(path: str | os.PathLike) -> Any:
    return json_reader.read_file(path)


def compile_key(request: CompileRequest) -> str:
    """The root of every stage key: the request, its source's identity and kiln's code. No model loads."""
    return content_hash("compile", code_version(), request.cache_identity())
