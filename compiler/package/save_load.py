"""Package: one self-describing directory per compiled model.

    manifest.json            the typed Manifest (package/manifest.py): format version, specs, versions,
                             plan, report, validation, op modules, lineage, file checksums, content hash
    program.pt2              the exported program (torch.export format), weights left hollow
    weights.safetensors      every weight, once
    runtime_graph.json       the split graph as data, what a load runs (partitioning/runtime_graph.py); the
                             program is read only when asked for (absent where the graph holds
                             anything that form cannot: such packages load from the program)
    engines/<fp>.engine      one engine per unique fingerprint (weight-stripped where its backend's load
                             takes the weights from weights.safetensors, whatever strip_weights built:
                             writing.packaged_engine); none for a fingerprint whose build fell back to
                             PyTorch (the program runs it)
    model.sig                optional: the model-signing signature of every other file (never listed
                             in the manifest, which it signs; compiler/package/signing.py)

What loading guarantees (docs/security.md says why):

* ``content_hash`` is the sha256 of the whole manifest but the hash (and signature) itself, and the
  manifest lists the sha256 of every file a load reads, the program included: a changed byte anywhere
  is refused. Each file is read once, checked, and those same bytes are used.
* Every path is relative, inside the package and listed; an engine's file is ``engines/<fp>.engine``;
  symlinks are refused.
* Nothing is unpickled or evaluated: the runtime graph is JSON whose calls name operators; the
  program archive is refused if torch would unpickle any part of it
  (``compiler.program.export.check_archive``); safetensors and engines are plain bytes. The one engine that
  is code, an Inductor compiled graph, runs as stored only from a trusted package
  (``trust_engine_code``, or a signature verified with ``$KILN_SIGNING_PUBLIC_KEY`` or trusted
  certificates); otherwise it is compiled again here from the program it carries, read by the same rule.
* Modules the package needs imported (custom ops, pytree types) are imported only when the loading
  process allows them (``allowed_modules``, ``$KILN_ALLOWED_OP_MODULES``, or already imported).
* With ``$KILN_SIGNING_PRIVATE_KEY`` set, saves sign the package (model-signing's format, ``model.sig``);
  with a verification key set, loads refuse a package whose signature is missing or wrong.

The reading and checking (manifest, file checksums, symlinks) is :mod:`compiler.package.check`, which
needs no torch: :func:`compiler.package.check.read_manifest` (``compiler.read_manifest``) is its function.

Saving writes into a temporary directory beside the target and renames it into place, so a failed
save leaves the previous package (or nothing) at the path, never half of one. Equal compiles give
equal bytes and an equal content hash (no timestamps; the program archive is reproducible).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from compiler.atomic import write_bytes_atomic
from compiler.backends.inductor.backend import warm_inductor_imports
from compiler.cache.local import CacheSetting
from compiler.device import program_on, resolve, same, warm_device
from compiler.errors import KilnError, PackageCorruptError
from compiler.inputs.specs import dtype_name
from compiler.package import reading
from compiler.package.check import checked_manifest, manifest_and_signature, read_verified
from compiler.package.digest import content_hash
from compiler.package.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    PROGRAM,
    RUNTIME_GRAPH,
    WEIGHTS,
    EngineRecord,
    FileRecord,
    Manifest,
    SourceRecord,
    engine_file,
)
from compiler.package.signing import Signer, Trust, sign_package
from compiler.package.weights_file import read_weights
from compiler.package.writing import (
    as_validation_report,
    hollow_program,
    int8_only_weights,
    packaged_engine,
    swap_into_place,
    weights_at_engine_precision,
)
from compiler.partitioning import runtime_graph
from compiler.partitioning.dedup import DedupPlan
from compiler.partitioning.partition import (
    QUANTIZED_PREFIX,
    from_runtime_graph,
    program_weights,
    replay,
    with_weights,
)
from compiler.program.export import (
    check_archive,
    import_modules,
    load_program_bytes,
    program_bytes,
)
from compiler.program.outputs import output_specs
from compiler.runtime.module import CompiledModule, assemble
from compiler.validation.report import ValidationReport
from compiler.version import kiln_version

__all__ = ["PackageInfo", "load", "refit_package", "save"]


@dataclass(frozen=True)
class PackageInfo:
    path: Path
    manifest: Manifest
    bytes: int

    @property
    def content_hash(self) -> str:
        return self.manifest.content_hash


def save(
    compiled: CompiledModule,
    path: str | os.PathLike,
    *,
    validation: ValidationReport | Mapping[str, Any] | None = None,
    source: SourceRecord | None = None,
    int8_weights_only: bool = False,
    engine_precision_weights: bool | Mapping[str, torch.dtype] = False,
    extra_files: Mapping[str, bytes] | None = None,
    external_weights: bool = False,
) -> PackageInfo:
    """Write ``compiled`` as a package directory at ``path`` (replacing an old one atomically).

    ``validation``: the report of :func:`compiler.validate` (or its ``to_dict``); ``source``: where the
    model came from (lineage, recorded and hashed with the rest). ``int8_weights_only``: float weights
    that only int8 engines read are left out (the engines' int8 tensors stand for them; the program
    keeps their shapes): the package shrinks to its int8 size, but none of its int8 partitions can be
    raised to a float precision or compared with its float submodule again (recompile for that).
    ``engine_precision_weights``: fp32 weights that only fp16/bf16 engines read are stored at that
    precision (the engines take the same values; the package, its load's bytes and the loaded module's
    weights halve, no fp32 copy is kept beside the engines' own): a load keeps them so, and no partition
    reading one can be raised to fp32 again (a mapping: exactly those keys, as a generation package's
    two programs agree; a package read back keeps its own).

    ``extra_files``: more files of the package (path -> bytes), listed and hashed with the rest (a
    generation package's ``generation.json`` and decode program: compiler.generation.package).
    ``external_weights``: the weights file is listed (its checksum binds the weights) but not written: a
    package inside another that holds those very bytes.
    """
    path = Path(path)
    signer = Signer.from_env()  # a bad signing configuration fails before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    # The package is built as staging/<name>, so that its signature names it as the package it becomes.
    staging = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp = staging / path.name
    tmp.mkdir(parents=True)
    try:
        plan = compiled.plan
        files: dict[str, bytes] = {PROGRAM: program_bytes(hollow_program(plan.program), record_modules=False)}
        try:  # what loads run from; a graph it cannot hold loads the program (seconds more on a GPU)
            files[RUNTIME_GRAPH] = runtime_graph.encode(plan.graph_module, plan.signature, plan.symbols)
        except runtime_graph.NotData as exc:
            warnings.warn(
                f"{path}: saved without {RUNTIME_GRAPH} ({exc}); its loads read the program instead",
                stacklevel=2,
            )
        elided = set(plan.elided_weights) | (int8_only_weights(compiled) if int8_weights_only else set())
        reduced = weights_at_engine_precision(compiled, engine_precision_weights)
        weights = {
            k: v.detach().to("cpu", reduced.get(k, v.dtype)).contiguous().clone()
            for k, v in sorted(compiled.weights.items())
            if k not in elided
        }
        files[WEIGHTS] = safetensors.torch.save(weights)
        engines = {}
        for fp, built in sorted(compiled.engines.items()):
            artifact = packaged_engine(built)  # its weights are in weights.safetensors: not twice
            rel = engine_file(fp) if artifact.is_engine else None
            if rel is not None:
                files[rel] = artifact.engine
            engines[fp] = EngineRecord(
                file=rel,
                io=artifact.io,
                cache_key=artifact.cache_key,
                bytes=artifact.bytes,
                stripped=artifact.stripped,
                backend=artifact.backend,
                build_failure=artifact.build_failure,
            )
        files.update(extra_files or {})
        (tmp / "engines").mkdir()
        for rel, data in files.items():
            if external_weights and rel == WEIGHTS:
                continue
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(tmp / rel, data)
        report = compiled.report
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            kiln_version=kiln_version(),
            torch_version=torch.__version__,
            input_specs=tuple(compiled.input_specs),
            backend=report.backend,
            backend_version=report.backend_version,
            engine_target=report.engine_target,
            precision=report.precision,
            strip_weights=report.strip_weights,
            input_weights=tuple(sorted(plan.input_weights)),
            plan={
                **plan.to_dict(),
                **({"elided_weights": sorted(elided)} if elided else {}),
                **({"reduced_weights": {k: dtype_name(d) for k, d in reduced.items()}} if reduced else {}),
            },
            dedup=compiled.dedup.to_dict(),
            engines=engines,
            report=report,
            validation=as_validation_report(validation),
            files={rel: FileRecord.of(data) for rel, data in sorted(files.items())},
            op_modules=tuple(import_modules(plan.program)),
            source=source,
            output_specs=output_specs(plan.program, plan.specs),
        )
        # Through JSON first, so the hash is of exactly what a reader will parse (int keys, tuples).
        data = json.loads(json.dumps(manifest.to_json(), sort_keys=True))
        digest = content_hash(data)
        manifest = dataclasses.replace(manifest, content_hash=digest)
        text = json.dumps(manifest.to_json(), indent=2, sort_keys=True)
        write_bytes_atomic(tmp / MANIFEST_FILE, text.encode())
        if signer is not None:  # signed before it is in place: a signed package appears whole
            sign_package(tmp, signer)
        swap_into_place(tmp, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    written = [f.bytes for rel, f in manifest.files.items() if not (external_weights and rel == WEIGHTS)]
    return PackageInfo(path, manifest, sum(written) + (path / MANIFEST_FILE).stat().st_size)


def load(
    path: str | os.PathLike,
    *,
    allowed_modules: Sequence[str] | None = None,
    device: str | None = None,
    trust_engine_code: bool | None = None,
    cuda_graphs: str | None = None,
    cache: CacheSetting = None,
    defer_output_types: bool = False,
) -> CompiledModule:
    """Load a package: verify, re-create the split graph from the saved plan, refit engines, ready to call.

    ``device``: where the model runs; by default the device it was compiled for (``cpu`` for packages
    that predate devices). A device that is not here is a BackendUnavailableError naming it, and an
    engine built for another device an EngineCompatibilityError.

    ``allowed_modules``: module prefixes this call may import for the package's custom ops and
    input/output types (added to ``$KILN_ALLOWED_OP_MODULES``; modules already imported need neither).

    ``trust_engine_code``: whether engines that are code (Inductor's compiled graphs) may run as
    stored. By default only when a verification key is configured (``$KILN_SIGNING_PUBLIC_KEY`` or
    ``$KILN_SIGNING_TRUSTED_CERTIFICATES``), i.e. the package's signature was just verified
    (format-2 packages: their hash covers every file); otherwise such engines are compiled again here
    from their programs with kiln's own settings (slower, runs nothing the package brought).

    ``cuda_graphs``: ``"auto"``, ``"on"`` or ``"off"`` for this load; by default what the package was
    compiled with (``CompileOptions.cuda_graphs``; packages that predate it: ``"auto"``). The capture
    check recorded at compile is trusted: a module it refused runs uncaptured (``"on"``: CudaGraphError).

    ``cache``: the engine cache, as everywhere (None: the default, False: none), where engines that are
    compiled here (Inductor's, untrusted or built elsewhere) are kept for the next load.

    ``defer_output_types``: for callers of ``run_flat`` alone (a serving backend): the modules only the
    outputs' types come from (transformers' ModelOutput, 1.4-2 s to import) are checked now and imported
    on the first ``forward``, if one comes. By default they are imported during the load.
    """
    path = Path(path)
    start = time.perf_counter()
    trust = Trust.from_env()  # read once: what the signature is verified against is what is trusted
    manifest, signature_check = manifest_and_signature(path, verify=True, trust=trust)
    manifest_s = time.perf_counter() - start
    if trust_engine_code is None:
        # The one implicit trust: a signature verified against a configured key (any other is refused;
        # _load waits for the verdict before it acts on anything), over a format-2 manifest (whose hash
        # covers every byte a load reads; format 1's left the program out).
        trust_engine_code = trust is not None and manifest.format_version >= 2
    # Cold start: every file is read and checked on worker threads (sha256 and file reads release the
    # GIL) while this thread imports what the engines' runtime needs and reads the program. Imports stay
    # on this thread: concurrent imports can hand a thread a partly initialised module.
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kiln-load")
    # The signature (model-signing hashes every file) is verified beside the load's own reads, on a
    # thread of its own; _load waits for it before it acts on anything the package holds.
    verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-signature")
    signed = verifier.submit(signature_check) if signature_check is not None else None
    try:
        compiled = _load(
            path, manifest, pool, signed, allowed_modules, device, trust_engine_code, cuda_graphs,
            cache=cache, defer_output_types=defer_output_types,
        )  # fmt: skip
        compiled.load_seconds = {"manifest": round(manifest_s, 4), **compiled.load_seconds}
        # A generation package's decode program is joined above this stage (compiler.generation.package.load).
        compiled.manifest = manifest
        compiled.load_seconds["total"] = round(time.perf_counter() - start, 4)
        return compiled
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        verifier.shutdown(wait=True)


def _load(
    path: Path,
    manifest: Manifest,
    pool: ThreadPoolExecutor,
    signed: Future | None,
    allowed_modules: Sequence[str] | None,
    device: str | None,
    trust_engine_code: bool,
    cuda_graphs: str | None,
    shared_weights: Mapping[str, torch.Tensor] | None = None,
    *,
    cache: CacheSetting = None,
    defer_output_types: bool = False,
) -> CompiledModule:
    try:
        options = manifest.plan["options"]
        recorded_device = options.get("device", "cpu")
    except (KeyError, TypeError, AttributeError) as exc:
        raise PackageCorruptError(f"{path}: the manifest's plan has no options ({exc!r})") from exc
    target = resolve(device if device is not None else recorded_device)
    if target.type == "cuda":  # the GPU's context and cuBLAS are made ready while the files are hashed
        pool.submit(warm_device, target)
    # Weights a package left out (save(int8_weights_only=True)): the hollow program's shapes stand in.
    elided = set(manifest.plan.get("elided_weights", ()))
    light = RUNTIME_GRAPH in manifest.files and not elided
    reads = {
        rel: pool.submit(read_verified, path, rel, manifest)
        for rel in (
            PROGRAM,
            *([RUNTIME_GRAPH] if light else []),
            *(r.file for r in manifest.engines.values() if r.file is not None),
        )
    }
    # The weights are read, checked and put on the device by a worker, while this thread reads the graph.
    if shared_weights is None:
        placed = pool.submit(read_weights, path, WEIGHTS, manifest, target)
    else:  # load_inner: the enclosing package's tensors, already checked and on the device
        placed = Future()
        placed.set_result({k: v.to(target) for k, v in shared_weights.items()})
    stages, mark = {}, time.perf_counter()

    def lap(stage: str) -> None:  # where a load's seconds go (CompiledModule.load_seconds)
        nonlocal mark
        now = time.perf_counter()
        stages[stage], mark = round(now - mark, 4), now

    if signed is not None:  # nothing the package holds is acted on (imported, run) before it verified
        signed.result()
        lap("signature")
    backends = manifest.engine_backends()
    reading.check_library(path, manifest, backends)
    if light:
        checked_program = pool.submit(lambda: check_archive(reads[PROGRAM].result(), str(path / PROGRAM)))
    if "inductor" in backends.values() and not reading.native_engines(options, recorded_device):
        warm_inductor_imports()  # while the workers hash
    lap("imports")
    if light:
        # The modules the package records (custom ops, input types) are imported while the workers read,
        # hash and copy the files; those only its output types need (transformers' ModelOutput, 1-2 s)
        # are checked now and imported on a thread of their own beside the rest of the load (or, with
        # defer_output_types, on the first forward): the first forward decodes its output type.
        deferred = reading.import_recorded_modules(path, manifest, allowed_modules, reads, defer_output_types)
        lap("modules")

    def read_program() -> torch.export.ExportedProgram:
        program = load_program_bytes(
            reads[PROGRAM].result(),
            str(path / PROGRAM),
            # Format 1 recorded the modules inside the archive (checked bytes, read as data).
            modules=manifest.op_modules if manifest.format_version >= 2 else None,
            allowed_modules=allowed_modules,
        )
        return program_on(program, target)

    if light:  # the split graph as data; the program is read only if something asks for it
        moved = None if same(target, resolve(recorded_device)) else target
        modules = checked_program.result()
        lap("program_check")
        graph = reading.read_runtime_graph(path, manifest, reads, modules, moved, allowed_modules, deferred)
        own = set(graph.signature.weight_keys())
        specs = reading.program_tensor_specs(reads[PROGRAM].result(), str(path / PROGRAM))
        lap("runtime_graph")
    else:
        program = read_program()
        specs = {k: (v.dtype, tuple(v.shape)) for k, v in program_weights(program).items()}
        own = set(specs)
        lap("program")
    weights = placed.result()
    reduced = reading.reduced_weights(path, manifest, weights, checked=shared_weights is not None)
    if shared_weights is None:  # an enclosing package's were checked against its own program
        reading.check_weight_specs(path, weights, specs, reduced)
    lap("weights")  # what is left of the weights' read, hash and copy once this thread needs them
    missing = sorted((own | set(manifest.input_weights)) - set(weights) - elided)
    if missing:
        raise PackageCorruptError(f"{path}: {WEIGHTS} lacks weights {missing[:10]}")
    runtime = {"device": str(target), **({"cuda_graphs": cuda_graphs} if cuda_graphs is not None else {})}
    plan_data = {**manifest.plan, "options": {**options, **runtime}}
    try:  # the plan and dedup records are decoded here: malformed ones are the package's fault
        if light:
            plan = from_runtime_graph(
                graph,
                tuple(manifest.input_specs),
                plan_data,
                weights,
                manifest.input_weights,
                read_program,
                origin=str(path),
            )
        else:
            plan = replay(with_weights(program, {k: v for k, v in weights.items() if k in own}), plan_data)
        dedup = DedupPlan.from_dict(manifest.dedup)
    except KilnError:  # a typed answer already (a partition that does not replay, a CUDA graph mode)
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise PackageCorruptError(
            f"{path}: the manifest's plan or dedup is malformed ({exc!r:.200})"
        ) from exc
    plan.input_weights = {k: weights[k] for k in manifest.input_weights}
    plan.quantized = {k: v for k, v in weights.items() if k.startswith(QUANTIZED_PREFIX)}
    plan.elided_weights = frozenset(elided)
    plan.reduced_weights = reduced
    reading.check_dedup(dedup, plan, manifest, path)
    engines = reading.engine_artifacts(manifest, reads)
    reading.check_reduced(path, plan, dedup, engines)
    lap("plan")
    report = copy.deepcopy(manifest.report)
    compiled = assemble(plan, dedup, engines, report=report, trust_engine_code=trust_engine_code, cache=cache)
    # assemble timed its engine loads; the rest of it is the CUDA-graph warm-up (captures) of the profiles.
    engines_s = compiled.report.stage_seconds.get("assemble", 0.0)
    # The report describes the compile: this load's assemble time is not part of it (and would make a
    # re-saved package differ from its source).
    compiled.report.stage_seconds.clear()
    compiled.report.stage_seconds.update(manifest.report.stage_seconds)
    compiled.validation = manifest.validation
    now = time.perf_counter()
    stages["engines"] = round(min(engines_s, now - mark), 4)
    stages["warmup"] = round(max(0.0, now - mark - engines_s), 4)
    compiled.load_seconds = stages
    return compiled


def refit_package(
    path: str | os.PathLike,
    state: Mapping[str, torch.Tensor],
    *,
    allowed_modules: Sequence[str] | None = None,
) -> PackageInfo:
    """Put new weights of the same structure (a fine-tuned checkpoint) into a saved package: no rebuild.

    The old validation no longer describes these weights, so it is dropped; validate again.
    """
    source = checked_manifest(Path(path), verify=True).source  # lineage stays: same model, new weights
    compiled = load(path, allowed_modules=allowed_modules)
    return save(compiled.refit(state), path, validation=None, source=source)
