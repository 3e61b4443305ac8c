"""kiln's TensorRT engine file: a small JSON header in front of the TensorRT plan, and the checks
that header allows without TensorRT or a GPU.

Layout: ``KILNTRT1``, the header length (uint32, little-endian), the JSON header (sorted keys), then
the plan, raw or xz-compressed (the header's ``plan_encoding``). The header names the library and
its version, the engine target (the compute capabilities the plan runs on), whether the plan is
stripped of its weights, its refit mode, and the shapes and dtypes of its canonical weights.

Guarantees: ``decode_engine(encode_engine(h, plan))`` returns ``h`` (plus ``plan_encoding``) and
``plan`` byte for byte; every engine written since header format 1 decodes, including those from
before compression (no ``plan_encoding``: raw); the header's keys on disk never change meaning
(the engine target is stored under ``targets`` / ``targets_and_later``, read and written only by
:class:`EngineTarget`); foreign, corrupt or newer bytes are an :class:`EngineCompatibilityError`, a
wrong library, version or GPU too, and wrong weights a :class:`RefitError`, all before TensorRT
sees them. :func:`check_header` types every field a load acts on (an untrusted package's header is
attacker-chosen): a malformed one is an :class:`UnsafeEngineError`, never a crash in the checks after it.
"""

from __future__ import annotations

import json
import lzma
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from compiler import json_reader
from compiler.backends.tensorrt.build_settings import REFIT_MODES
from compiler.errors import EngineCompatibilityError, RefitError, UnsafeEngineError
from compiler.inputs.specs import DTYPES, dtype_name

_MAGIC = b"KILNTRT1"
HEADER_FORMAT = 1
# A compressed plan may expand to this many times its size, or to _MIN_PLAN_LIMIT, whichever is more.
_MAX_EXPANSION, _MIN_PLAN_LIMIT = 256, 64 << 20


def sm_number(compute_capability: str) -> int:
    return int(compute_capability.removeprefix("sm_"))


@dataclass(frozen=True)
class EngineTarget:
    """What an engine is built for: the GPU compute capabilities (``sm_86``) its plan runs on, and
    whether later ones run it too (TensorRT-RTX's portable default set)."""

    compute_capabilities: tuple[str, ...]
    and_later: bool = False

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> EngineTarget:
        # Header format 1 names these keys "targets" and "targets_and_later"; engines on disk carry
        # them, so they stay (the one place that reads them).
        return cls(tuple(header.get("targets", [])), bool(header.get("targets_and_later", False)))

    def header_fields(self) -> dict[str, Any]:
        """The header keys that store this engine target (the ones :meth:`from_header` reads)."""
        return {"targets": list(self.compute_capabilities), "targets_and_later": self.and_later}

    def runs_on(self, compute_capability: str) -> bool:
        if compute_capability in self.compute_capabilities:
            return True
        return self.and_later and sm_number(compute_capability) >= max(
            sm_number(c) for c in self.compute_capabilities
        )

    def describe(self) -> str:
        """``sm_80, sm_86 and later``: for error messages."""
        return ", ".join(self.compute_capabilities) + (" and later" if self.and_later else "")

    def __str__(self) -> str:
        """The engine target as cache keys and manifests spell it: ``cuda:sm_90``, ``cuda:sm_80+sm_86+``
        (a trailing ``+``: and later)."""
        return "cuda:" + "+".join(self.compute_capabilities) + ("+" if self.and_later else "")


def encode_engine(header: Mapping[str, Any], plan: bytes, *, compress: bool = False) -> bytes:
    """kiln engine bytes: magic, header length, JSON header, then the TensorRT plan, as it is or
    xz-compressed (``compress``; the header's ``plan_encoding`` says which).

    Stripped plans are compressed: what stays in them is kernel code (PTX and one cubin per target
    for every fused kernel) and the graph, which compress ~70x (a 3.6 MB stripped BERT plan to 47
    KB on TensorRT-RTX 1.7), while a full plan is mostly weights, which do not compress."""
    body = lzma.compress(plan, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64) if compress else bytes(plan)
    meta = {**header, "plan_encoding": "xz" if compress else "raw"}
    text = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return _MAGIC + struct.pack("<I", len(text)) + text + body


def decode_engine(engine: bytes) -> tuple[dict[str, Any], memoryview]:
    """(header, plan) of kiln engine bytes, the plan decompressed; EngineCompatibilityError for
    anything else (foreign bytes, a corrupt header or a corrupt compressed plan)."""
    view = memoryview(engine)
    if len(view) < len(_MAGIC) + 4 or bytes(view[: len(_MAGIC)]) != _MAGIC:
        raise EngineCompatibilityError(
            "these bytes are not a kiln TensorRT engine (no KILNTRT1 header); rebuild the engine with kiln"
        )
    (size,) = struct.unpack("<I", view[len(_MAGIC) : len(_MAGIC) + 4])
    start = len(_MAGIC) + 4
    try:
        header = json_reader.loads(bytes(view[start : start + size]), "the TensorRT engine's header")
    except ValueError as exc:
        raise EngineCompatibilityError(f"kiln TensorRT engine header is corrupt: {exc}") from exc
    if not isinstance(header, dict):
        raise EngineCompatibilityError("kiln TensorRT engine header is corrupt: not a JSON object")
    if header.get("format") != HEADER_FORMAT:
        raise EngineCompatibilityError(
            f"kiln TensorRT engine header format {header.get('format')!r}; this kiln reads {HEADER_FORMAT}"
        )
    body = view[start + size :]
    encoding = header.get("plan_encoding", "raw")  # engines from before compression carry no key
    if encoding == "raw":
        return header, body
    if encoding != "xz":
        raise EngineCompatibilityError(
            f"kiln TensorRT engine plan encoding {encoding!r}; this kiln reads 'raw' and 'xz'"
        )
    # Bounded: a stripped plan compresses ~70x, a plan of zeros thousands of times (an xz bomb).
    limit = max(_MAX_EXPANSION * len(body), _MIN_PLAN_LIMIT)
    try:
        decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
        plan = decompressor.decompress(body, max_length=limit)
    except lzma.LZMAError as exc:
        raise EngineCompatibilityError(
            f"kiln TensorRT engine plan is corrupt (xz: {exc}); rebuild the engine"
        ) from exc
    if not decompressor.eof:
        what = "is truncated" if decompressor.needs_input else f"expands beyond {limit} bytes"
        raise EngineCompatibilityError(f"kiln TensorRT engine plan {what} (xz); rebuild the engine")
    return header, memoryview(plan)


_SM = re.compile(r"^sm_\d{1,4}$")
_DIM_LIMIT = 1 << 40


def _ints(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= 16
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _DIM_LIMIT for d in value)
    )


def check_header(header: Mapping[str, Any]) -> None:
    """UnsafeEngineError unless every header field a load reads has its type and range: the library
    and its version, the engine target, ``stripped``, the refit mode, the weights' shapes and dtypes
    and the optimization profiles (``inputs`` and ``outputs``, only shown, must be lists of names)."""

    def bad(field: str, expected: str) -> UnsafeEngineError:
        shown = repr(header.get(field))
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return UnsafeEngineError(
            f"kiln TensorRT engine header field {field!r} is {shown}; expected {expected}; rebuild the engine"
        )

    for field in ("backend", "library_version"):
        if not isinstance(header.get(field), str):
            raise bad(field, "a string")
    targets = header.get("targets")
    if not (
        isinstance(targets, list)
        and 0 < len(targets) <= 64
        and all(isinstance(t, str) and _SM.match(t) for t in targets)
    ):
        raise bad("targets", "a list of compute capabilities like 'sm_86'")
    if not isinstance(header.get("targets_and_later", False), bool):
        raise bad("targets_and_later", "true or false")
    if not isinstance(header.get("stripped"), bool):
        raise bad("stripped", "true or false")
    if header.get("refit", "none") not in REFIT_MODES:
        raise bad("refit", f"one of {REFIT_MODES}")
    weights = header.get("weights")
    if not isinstance(weights, Mapping) or not all(
        isinstance(name, str)
        and isinstance(entry, Mapping)
        and _ints(entry.get("shape"))
        and isinstance(entry.get("dtype"), str)
        and entry["dtype"] in DTYPES
        for name, entry in weights.items()
    ):
        raise bad("weights", "a mapping of weight names to {shape: [int], dtype: a dtype name}")
    for field in ("inputs", "outputs"):
        names = header.get(field, [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise bad(field, "a list of tensor names")
    profiles = header.get("profiles", [])
    names = set(header.get("inputs") or []) or None  # every profile bounds every input
    if not (
        isinstance(profiles, list)
        and len(profiles) <= 64
        and all(
            isinstance(p, Mapping)
            and set(p) == (names or set(profiles[0]))
            and all(
                isinstance(name, str)
                and isinstance(b, list)
                and len(b) == 3
                and all(_ints(s) for s in b)
                and len({len(s) for s in b}) == 1
                for name, b in p.items()
            )
            for p in profiles
        )
    ):
        raise bad("profiles", "a list of {input: [min, opt, max] shapes}")


def check_engine_compatible(
    header: Mapping[str, Any], backend: str, version: str, compute_capability: str | None
) -> None:
    """EngineCompatibilityError unless an engine with ``header`` can run with this library and GPU
    (``compute_capability`` like ``sm_86``; ``None`` skips the GPU check)."""
    if header.get("backend") != backend or header.get("library_version") != version:
        raise EngineCompatibilityError(
            f"engine was built by {header.get('backend')} {header.get('library_version')}, "
            f"but this backend is "
            f"{backend} {version}; rebuild it here (engines are not portable across libraries or versions)"
        )
    if compute_capability is None:
        return
    engine_target = EngineTarget.from_header(header)
    if not engine_target.runs_on(compute_capability):
        raise EngineCompatibilityError(
            f"engine was built for {engine_target.describe()}; this GPU is {compute_capability}; "
            f"rebuild it for {compute_capability}"
        )


def check_refit_weights(
    declared: Mapping[str, Mapping[str, Any]], weights: Mapping[str, torch.Tensor], *, require_all: bool
) -> None:
    """RefitError unless ``weights`` names only declared weights (a header's ``weights``) with their
    shapes and dtypes (and, when ``require_all``, names every one of them)."""
    unknown = sorted(set(weights) - set(declared))
    if unknown:
        raise RefitError(f"unknown weights {unknown}; this engine's refittable weights are {list(declared)}")
    if require_all:
        missing = [name for name in declared if name not in weights]
        if missing:
            raise RefitError(f"weights {missing} are missing; this engine needs all of {list(declared)}")
    for name, tensor in weights.items():
        want = declared[name]
        if not isinstance(tensor, torch.Tensor):
            raise RefitError(f"weight {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if list(tensor.shape) != list(want["shape"]):
            raise RefitError(
                f"weight {name!r}: expected shape {tuple(want['shape'])}, got {tuple(tensor.shape)}"
            )
        got = dtype_name(tensor.dtype)
        if got != want["dtype"]:
            raise RefitError(f"weight {name!r}: expected dtype {want['dtype']}, got {got}")
