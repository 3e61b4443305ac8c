"""A package's digests: the content hash (every field and, through ``files``, every byte a load reads)
and the meaning hash (the same without what the compile measured). Split from ``package.py`` (which
writes, reads and checks packages) so the rules that decide what a package *is* read in one place
(docs/security.md). Signatures sign the package directory, manifest included:
:mod:`compiler.package.signing`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from compiler.package.manifest import WEIGHTS

# ``signature``: the HMAC that kiln before model-signing wrote into the manifest; still outside the hash
# so that the packages it signed keep their content hash (it is read as data and never checked).
_UNHASHED = ("content_hash", "signature")


def content_hash(data: Mapping[str, Any]) -> str:
    """The content hash of a manifest's JSON data (as written, or as parsed from disk).

    Format 2: sha256 of the canonical JSON of every field but ``content_hash`` and ``signature``: the
    manifest's meaning and, through ``files``, every byte of every file a load reads. Equal content,
    equal hash: the manifest holds no timestamp and the program archive is reproducible.
    Format 1 (kept to verify packages written before): weights, engines and the compile's meaning.
    """
    if int(data.get("format_version", 1)) < 2:
        return _format1_hash(data)
    core = {k: v for k, v in data.items() if k not in _UNHASHED}
    return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# What a compile measured rather than made: two compiles of the same model (two workers, two runs)
# differ here and nowhere else.
_MEASURED = ("report", "validation")


def meaning_hash(data: Mapping[str, Any]) -> str:
    """sha256 of what the package *is*, not of what its compile measured: the manifest (format 2, as
    JSON data) without ``report`` (timings, cache hits) and ``validation`` (latencies, errors), so two
    workers that compiled the same model into the same bytes agree on it even though their measured
    latencies differ. Every file's checksum is in it (``files``): different bytes, different meaning.
    The registry registers one version per meaning (registry.models)."""
    core = {k: v for k, v in data.items() if k not in _UNHASHED and k not in _MEASURED}
    return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _format1_hash(data: Mapping[str, Any]) -> str:
    core = {
        "weights": data["files"][WEIGHTS]["sha256"],
        "engines": {rel: f["sha256"] for rel, f in data["files"].items() if rel.startswith("engines/")},
        **_fallback_backends(data),
        **{
            k: data[k]
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


def _fallback_backends(data: Mapping[str, Any]) -> dict:
    other = {
        fp: entry["backend"]
        for fp, entry in data["engines"].items()
        if entry.get("backend", data["backend"]) != data["backend"]
    }
    return {"engine_backends": other} if other else {}
