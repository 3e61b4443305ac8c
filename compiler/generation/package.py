"""The generation package: the prefill program's package, with the decode program's inside it.

    manifest.json, program.pt2, runtime_graph.json, engines/, weights.safetensors   the prefill program
    generation.json      the GenerationSpec (limits, cache layout, token ids, validation) and the
                         decode package's content hash
    decode/manifest.json, decode/program.pt2, decode/runtime_graph.json, decode/engines/
                         the decode program: its manifest lists weights.safetensors with the same
                         checksum as the prefill's, and the file is not repeated (one copy on disk)

Everything is listed in the outer manifest, so its content hash and signature cover the decode
program too, and every tool that reads a package (registry, report, lookup) sees a valid package: the
prefill program's. A load (``compiler.load``) verifies the outer package as any other, then loads the
decode package onto the very weight tensors the prefill program runs on (one copy on the device) after
checking its manifest is the one ``generation.json`` names.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from compiler import json_reader
from compiler.errors import PackageCorruptError, PackageJsonError
from compiler.generation.module import GenerationModule
from compiler.generation.spec import DECODE_DIR, GENERATION_FILE, GenerationSpec
from compiler.package import save_load
from compiler.package.check import manifest_and_signature, read_verified
from compiler.package.manifest import MANIFEST_FILE, WEIGHTS, Manifest
from compiler.package.save_load import PackageInfo, _load, save
from compiler.package.writing import weights_at_engine_precision
from compiler.runtime.module import CompiledModule


def save_generation(
    module: GenerationModule,
    path: str | os.PathLike,
    *,
    validation: Any = None,
    source: Any = None,
    int8_weights_only: bool = False,
    engine_precision_weights: bool = False,
) -> PackageInfo:
    """Write ``module`` (compiled prefill and decode programs) as one package at ``path``; ``validation``
    is the prefill program's forward-pass report; the generation report lives in ``module.spec``.
    ``engine_precision_weights``: as :func:`compiler.save`, for the weights both programs' engines take
    at one precision (the programs share one weights file)."""
    if sorted(module.prefill.weights) != sorted(module.decode.weights):
        raise PackageCorruptError(
            "the prefill and decode programs hold different weights; they must be compiled from one "
            "model (compiler.generation.step)"
        )
    prefill = weights_at_engine_precision(module.prefill, engine_precision_weights)
    decode = weights_at_engine_precision(module.decode, engine_precision_weights)
    reduced = {k: d for k, d in prefill.items() if decode.get(k) == d}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.decode-", dir=path.parent))
    try:
        inner = save(
            module.decode,
            scratch / DECODE_DIR,
            source=source,
            int8_weights_only=int8_weights_only,
            engine_precision_weights=reduced,
            external_weights=True,
        )
        files = {
            f"{DECODE_DIR}/{p.relative_to(scratch / DECODE_DIR).as_posix()}": p.read_bytes()
            for p in sorted((scratch / DECODE_DIR).rglob("*"))
            if p.is_file()
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    spec = GenerationSpec(**{**vars(module.spec), "decode_content_hash": inner.content_hash})
    files[GENERATION_FILE] = json.dumps(spec.to_json(), indent=2, sort_keys=True).encode()
    info = save(
        module.prefill,
        path,
        validation=validation,
        source=source,
        int8_weights_only=int8_weights_only,
        engine_precision_weights=reduced,
        extra_files=files,
    )
    if info.manifest.files[WEIGHTS].sha256 != inner.manifest.files[WEIGHTS].sha256:
        shutil.rmtree(path, ignore_errors=True)
        raise PackageCorruptError(f"{path}: the decode program's weights differ from the prefill's")
    module.spec = spec
    return info


def read_spec(path: str | os.PathLike, manifest: Manifest) -> GenerationSpec:
    """``generation.json`` of a verified package, checked against the manifest's checksum."""
    data = read_verified(Path(path), GENERATION_FILE, manifest)
    where = f"{path}/{GENERATION_FILE}"
    try:
        return GenerationSpec.from_json(json_reader.loads(data, where, error=PackageJsonError))
    except PackageCorruptError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise PackageCorruptError(f"{where} is not a generation spec: {exc}") from exc


def load(
    path: str | os.PathLike,
    *,
    allowed_modules: Sequence[str] | None = None,
    device: str | None = None,
    trust_engine_code: bool | None = None,
    cuda_graphs: str | None = None,
    cache: Any = None,
    defer_output_types: bool = False,
) -> CompiledModule | GenerationModule:
    """``compiler.load``: any package (:func:`compiler.package.save_load.load` says what a load checks
    and what each argument means); a generation package's decode program joins its prefill program.
    Here, above the package stage, so that the package stage never imports generation."""
    start = time.perf_counter()
    prefill = save_load.load(
        path,
        allowed_modules=allowed_modules,
        device=device,
        trust_engine_code=trust_engine_code,
        cuda_graphs=cuda_graphs,
        cache=cache,
        defer_output_types=defer_output_types,
    )
    if GENERATION_FILE not in prefill.manifest.files:
        return prefill
    trust = prefill.trust_engine_code  # what the verified signature (or the caller) decided
    module = with_decode(prefill, Path(path), prefill.manifest, allowed_modules, device, trust, cuda_graphs)
    module.load_seconds["total"] = round(time.perf_counter() - start, 4)
    return module


def with_decode(
    prefill: CompiledModule,
    path: Path,
    manifest: Manifest,
    allowed_modules: Sequence[str] | None,
    device: str | None,
    trust_engine_code: bool,
    cuda_graphs: str | None,
) -> GenerationModule:
    """The loaded prefill program with its decode program (``compiler.load`` of a generation package)."""
    spec = read_spec(path, manifest)
    read_verified(path, f"{DECODE_DIR}/{MANIFEST_FILE}", manifest)  # the bytes the outer hash covers
    decode = load_inner(
        path / DECODE_DIR,
        prefill.weights,
        manifest.files[WEIGHTS].sha256,
        content_hash=spec.decode_content_hash,
        allowed_modules=allowed_modules,
        device=device,
        trust_engine_code=trust_engine_code,
        cuda_graphs=cuda_graphs,
    )
    module = GenerationModule(prefill, decode, spec)
    prefill.load_seconds["decode"] = decode.load_seconds.get("total", 0.0)
    return module


def load_inner(
    path: str | os.PathLike,
    weights: Mapping[str, torch.Tensor],
    weights_sha256: str,
    *,
    content_hash: str,
    allowed_modules: Sequence[str] | None = None,
    device: str | None = None,
    trust_engine_code: bool = False,
    cuda_graphs: str | None = None,
) -> CompiledModule:
    """A package inside another (saved with ``external_weights``) whose weights file is the outer one's:
    its manifest must have ``content_hash`` (what the outer package recorded) and list that weights file
    with ``weights_sha256`` (the outer load checked those bytes); it runs on those same ``weights``
    tensors, so they are on the device once. Its layout and file checksums are checked here."""
    path = Path(path)
    manifest, _ = manifest_and_signature(path, verify=True, signature=False)
    if manifest.content_hash != content_hash:
        raise PackageCorruptError(f"{path}: not the decode package {GENERATION_FILE} names; refused")
    if manifest.files[WEIGHTS].sha256 != weights_sha256:
        raise PackageCorruptError(f"{path}: its {WEIGHTS} record is not the enclosing package's; refused")
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kiln-load")
    try:
        return _load(
            path, manifest, pool, None, allowed_modules, device, trust_engine_code, cuda_graphs, weights
        )
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
