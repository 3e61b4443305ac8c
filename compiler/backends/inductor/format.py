"""The Inductor engine file: a stored (uncompressed) zip of a JSON header, the program, tensors and
compiled graphs, and the checks that run before any of it is used (docs/security.md). Split from
``inductor.py``, which builds, loads and runs what this module reads and writes."""

from __future__ import annotations

import io
import json
import re
import threading
import zipfile
from collections.abc import Iterator, Mapping

import torch

from compiler import json_reader
from compiler.backends.inductor.options import check_header
from compiler.errors import EngineCompatibilityError, UnsafeEngineError

# ENGINE_PROGRAM and ENGINE_WEIGHTS: the engine's own entries, not the package's files of the same names
# (compiler.package.manifest PROGRAM, WEIGHTS).
HEADER, ENGINE_PROGRAM, CONSTANTS, ENGINE_WEIGHTS, COMPILED, AOT = (
    "kiln_inductor_engine.json",
    "program.pt2",
    "constants.safetensors",
    "weights.safetensors",
    "inductor_compiled.bin",
    "aot_inductor.pt2",  # backend_options aot: the AOTInductor package (compiler.backends.inductor.aot)
)
_ENTRIES = (HEADER, ENGINE_PROGRAM, CONSTANTS, ENGINE_WEIGHTS, COMPILED, AOT)
# 1: torch.compile at load from cache artifacts (no longer read: rebuild). 2: standalone compiled graph.
FORMAT = 2
MAGIC = "kiln-inductor-engine"


def static_entry(index: int) -> str:
    """The archive entry of the engine's ``index``-th static-shape specialization."""
    return f"inductor_static_{index}.bin"


class EngineEntries(Mapping[str, bytes]):
    """An engine's entries by name, each read (its CRC checked) the first time it is asked for: a load
    that passes the engine its weights never reads the engine's own copy of them (326 MB for GPT-2 in
    fp16). The archive is over bytes already checked (the package's checksum or the engine cache's)."""

    def __init__(self, archive: zipfile.ZipFile, names: tuple[str, ...]):
        self._archive, self._names, self._read = archive, names, {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> bytes:
        if name not in self._names:
            raise KeyError(name)
        with self._lock:
            if name not in self._read:
                try:
                    self._read[name] = self._archive.read(name)
                except (zipfile.BadZipFile, ValueError, RuntimeError, OSError) as exc:
                    raise UnsafeEngineError(f"not a kiln Inductor engine: its {name}: {exc}") from exc
            return self._read[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def read_engine(engine: bytes) -> tuple[dict, EngineEntries]:
    """(header, entries) of an Inductor engine; UnsafeEngineError when the bytes are not one."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(engine))
        entries = archive.infolist()
        # kiln writes its engines uncompressed: nothing is inflated (a deflate bomb) to find out.
        if any(e.compress_type != zipfile.ZIP_STORED for e in entries):
            raise UnsafeEngineError("not a kiln Inductor engine: it holds compressed entries")
        files = EngineEntries(archive, tuple(e.filename for e in entries))
        header = json_reader.loads(files[HEADER], f"the Inductor engine's {HEADER}")
    except (zipfile.BadZipFile, KeyError, ValueError, RuntimeError, OSError) as exc:
        raise UnsafeEngineError(f"not a kiln Inductor engine: {exc}") from exc
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise UnsafeEngineError("not a kiln Inductor engine: its header lacks the magic and format")
    if not isinstance(header.get("format"), int) or isinstance(header["format"], bool):
        raise UnsafeEngineError("not a kiln Inductor engine: its header lacks the magic and format")
    if header["format"] > FORMAT:
        raise EngineCompatibilityError(
            f"Inductor engine format {header['format']} is newer than this kiln reads ({FORMAT}): "
            "upgrade kiln"
        )
    if header["format"] < FORMAT:
        raise EngineCompatibilityError(
            f"Inductor engine format {header['format']} (torch.compile at load) is no longer read: "
            "recompile the model (engine cache entries of the old format are not reused)"
        )
    listed = header.get("specializations") or []
    static = {static_entry(i) for i in range(len(listed))} if isinstance(listed, list) else set()
    strange = sorted(set(files) - set(_ENTRIES) - static)
    if strange or ENGINE_PROGRAM not in files or len(set(files)) != len(entries) or not static <= set(files):
        raise UnsafeEngineError(
            f"not a kiln Inductor engine: entries {sorted(files)[:8]}; expected {ENGINE_PROGRAM}, "
            f"some of {_ENTRIES}"
        )
    check_header(header)
    return header, files


def strip_engine(engine: bytes) -> bytes:
    """The engine without its own weights (``ENGINE_WEIGHTS``), its header saying ``stripped``, as a
    weight-stripped build makes it: what a package stores, whose load passes every engine its weights
    (capabilities' ``package_strip``). Every other entry is kept byte for byte."""
    header, files = read_engine(engine)
    if header["stripped"] and ENGINE_WEIGHTS not in files:
        return engine
    kept = {name: files[name] for name in files if name not in (HEADER, ENGINE_WEIGHTS)}
    # Written as a build writes its header, so a stripped build and a stripped full engine are equal.
    return pack({HEADER: json.dumps({**header, "stripped": True}, sort_keys=True).encode(), **kept})


def save_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    import safetensors.torch

    return safetensors.torch.save({name: t.detach().cpu().contiguous() for name, t in tensors.items()})


def load_tensors(data: bytes | None, device: torch.device) -> dict[str, torch.Tensor]:
    if not data:
        return {}
    import safetensors.torch

    try:
        loaded = safetensors.torch.load(data)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise UnsafeEngineError(
            f"an Inductor engine's tensors do not read: {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
    strange = [k for k in loaded if not re.fullmatch(r"w?\d{1,9}", k)]
    if strange:
        raise UnsafeEngineError(f"an Inductor engine's tensors are named {strange[:5]}; expected w<N> or <N>")
    return {k: v.to(device) for k, v in sorted(loaded.items(), key=lambda kv: int(kv[0].lstrip("w")))}


def pack(files: Mapping[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        static = sorted((n for n in files if n not in _ENTRIES), key=lambda n: int(n.split("_")[-1][:-4]))
        for name in (*_ENTRIES, *static):  # header first: readable alone
            if name in files:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # equal builds, equal bytes
                archive.writestr(info, files[name])
    return buffer.getvalue()
