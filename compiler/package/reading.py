"""Reading a package: what :func:`compiler.package.save_load.load` does beside assembling the module.

The library check (TensorRT engines run only on the version that built them), whether Inductor's
engines load natively (nothing of Inductor's imported then), the runtime graph read with the
program's modules checked, the weights stored at their engines' precision checked to be that
(:func:`reduced_weights`, :func:`check_reduced`), every weight checked to be the dtype and shape its
program takes (:func:`check_weight_specs`), the engine records with their verified bytes (the weights:
:mod:`compiler.package.weights_file`), and the dedup record checked against the plan.
"""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from compiler import json_reader
from compiler.backends import get_backend
from compiler.engine_build.engine import EngineArtifact
from compiler.engine_build.weights import REDUCED_DTYPES, engine_precision_keys
from compiler.errors import EngineCompatibilityError, PackageCorruptError
from compiler.inputs.specs import dtype_name
from compiler.package.manifest import PROGRAM, RUNTIME_GRAPH, WEIGHTS, Manifest
from compiler.partitioning import runtime_graph
from compiler.partitioning.dedup import DedupPlan
from compiler.program.export import import_allowed_modules
from compiler.program.module_policy import import_in_background


def import_recorded_modules(
    path: Path,
    manifest: Manifest,
    allowed_modules: Sequence[str] | None,
    reads: Mapping[str, Future[bytes]],
    defer_output_types: bool = False,
) -> tuple[str, ...]:
    """The modules the package records (its custom ops, its input and output types), imported where this
    process allows them (else OpModuleNotAllowedError naming them), before the program's own check: a
    load imports them while its workers read the files. Those only the output spec's types need
    (``transformers`` for a ModelOutput: 1.4-2.2 s where a process has not imported it) are checked now
    and decoded on the first ``forward`` (``DeferredSpec``): imported meanwhile on a thread of their own
    (the rest of the load and the first call's engines run beside it), or, where
    ``defer_output_types`` asks, only then: a caller of ``run_flat`` alone (a serving backend) never
    pays for them. Returns those. :func:`read_runtime_graph` then imports only what the program adds."""
    recorded = list(manifest.op_modules)
    deferred = runtime_graph.output_only_modules(
        reads[RUNTIME_GRAPH].result(), str(path / RUNTIME_GRAPH), recorded
    )
    where = str(path / PROGRAM)
    import_allowed_modules(recorded, where, allowed=allowed_modules, recorded=recorded, defer=deferred)
    if not defer_output_types:
        # On the H100 transformers imported on this thread took 1.6-2.2 s of a 2.2-2.4 s load (the
        # weights' read, hash and copy on the workers were done long before); imported at the first call
        # instead, the first answer came 0.6 s later. Beside the load, it overlaps the rest of it.
        import_in_background(deferred)
    return deferred


def read_runtime_graph(
    path: Path,
    manifest: Manifest,
    reads: Mapping[str, Future[bytes]],
    program_modules: Sequence[str],
    moved: torch.device | None,
    allowed_modules: Sequence[str] | None,
    deferred: Sequence[str] = (),
) -> Any:
    """The package's runtime graph, read; the program is checked now as a read of it would be (what
    torch would unpickle, the modules its text names, ``program_modules``): a package whose program
    would be refused is refused at load, as ever. ``deferred``: :func:`import_recorded_modules`'."""
    recorded = list(manifest.op_modules)
    modules = sorted(set(recorded) | set(program_modules))
    defer = [m for m in deferred if m not in program_modules]  # the program's text needs those now
    where = str(path / PROGRAM)
    import_allowed_modules(modules, where, allowed=allowed_modules, recorded=recorded, defer=defer)
    return runtime_graph.read(
        reads[RUNTIME_GRAPH].result(),
        str(path / RUNTIME_GRAPH),
        moved,
        allowed_modules=allowed_modules,
        recorded_modules=recorded,
        deferred=defer,
    )


def check_library(path: Path, manifest: Manifest, backends: Mapping[str, str]) -> None:
    """Each engine runs on the backend that built it; only a backend some engine needs must be present,
    and TensorRT's engines only on the TensorRT version that built them."""
    if manifest.backend in backends.values():
        backend = get_backend(manifest.backend)
        if manifest.backend.startswith("tensorrt") and backend.library_version() != manifest.backend_version:
            raise EngineCompatibilityError(
                f"{path} holds {manifest.backend} {manifest.backend_version} engines; this machine "
                f"has {backend.library_version()}: recompile for it"
            )


def native_engines(options: Mapping[str, Any], recorded_device: object) -> bool:
    """Whether the package's Inductor engines are AOTInductor packages (``backend_options`` aot, on by
    default on CUDA): they load natively (the package's own where trusted, else the one this machine
    built after the first untrusted load), so nothing of Inductor's is imported at load; its compile
    stack is 2.5-6.7 s of a GPT-2 load on the H200 (benchmarks/results/cold_start_default_h200.json)."""
    backend_options = options.get("backend_options")
    backend_options = backend_options if isinstance(backend_options, dict) else {}
    return backend_options.get("aot", str(recorded_device).startswith("cuda")) is True


def engine_artifacts(manifest: Manifest, reads: Mapping[str, Future[bytes]]) -> dict[str, EngineArtifact]:
    """The manifest's engine records with their verified bytes (none for a partition left to PyTorch)."""
    return {
        fp: EngineArtifact(
            fp,
            record.cache_key,
            b"" if record.file is None else reads[record.file].result(),
            record.io,
            record.stripped,
            True,
            0.0,
            backend=record.backend,
            build_failure=record.build_failure,
        )
        for fp, record in manifest.engines.items()
    }


def check_dedup(dedup: DedupPlan, plan: Any, manifest: Manifest, path: Path) -> None:
    """Every partition has exactly one instance, of a fingerprint the manifest has an engine record for,
    whose representative is a partition of the plan, and whose inputs and outputs fit the partition."""
    partitions = {part.name for part in plan.partitions}
    named = [i.partition for i in dedup.instances]
    problems = []
    texts = [*named, *dedup.unique, *dedup.unique.values(), *(i.fingerprint for i in dedup.instances)]
    if not all(isinstance(t, str) for t in texts):
        raise PackageCorruptError(f"{path}: the manifest's dedup names partitions or engines by non-strings")
    weights = set(plan.weights()) | set(plan.elided_weights)
    for instance in dedup.instances:
        refs = instance.weights if isinstance(instance.weights, Mapping) else {}
        if any(
            not isinstance(k, str)
            or not re.fullmatch(r"w\d{1,6}", k)
            or not isinstance(v, str)
            or v not in weights
            for k, v in refs.items()
        ):
            problems.append(f"instance {instance.partition!r} feeds its engine a weight the package lacks")
    if sorted(named) != sorted(partitions):
        problems.append(
            f"instances name partitions {sorted(named)[:5]}, the plan has {sorted(partitions)[:5]}"
        )
    for instance in dedup.instances:
        if instance.fingerprint not in manifest.engines or instance.fingerprint not in dedup.unique:
            problems.append(
                f"instance {instance.partition!r} uses an unknown engine {instance.fingerprint!r:.40}"
            )
        if not isinstance(instance.weights, Mapping):
            problems.append(f"instance {instance.partition!r} has no weight map")
    if not set(dedup.unique.values()) <= partitions:
        problems.append("a unique engine's representative is not a partition of the plan")
    for part in plan.partitions if not problems else ():
        fp = next(i.fingerprint for i in dedup.instances if i.partition == part.name)
        io = manifest.engines[fp].io
        activations = sum(1 for i in part.inputs if i.kind == "activation")
        outputs = {len(io.output_names), len(io.output_dtypes)}
        if len(io.inputs) != activations or outputs != {part.num_outputs}:
            problems.append(
                f"engine {fp[:16]} takes {len(io.inputs)} inputs and gives {sorted(outputs)} outputs; "
                f"partition {part.name} passes {activations} and expects {part.num_outputs}"
            )
    if problems:
        raise PackageCorruptError(
            f"{path}: the manifest's dedup does not fit its plan: {'; '.join(problems[:3])}"
        )


def reduced_weights(
    path: Path, manifest: Manifest, weights: Mapping[str, torch.Tensor], *, checked: bool = False
) -> dict[str, torch.dtype]:
    """The weights the package stores at their engines' lower precision
    (``save(engine_precision_weights=True)``): key -> that dtype, each held so in ``weights`` (else
    PackageCorruptError). They stay so: the engines take them as they are, with no fp32 copy beside
    them. ``checked``: ``weights`` are an enclosing package's, already read so (a generation package's
    decode program)."""
    recorded = manifest.plan.get("reduced_weights", {})
    names = {dtype_name(d): d for d in REDUCED_DTYPES}
    reduced = {}
    for key, name in recorded.items():
        tensor = weights.get(key)
        if name not in names or tensor is None or (not checked and tensor.dtype != names[name]):
            held = "lacks it" if tensor is None else f"holds it as {dtype_name(tensor.dtype)}"
            raise PackageCorruptError(
                f"{path}: the manifest stores weight {key!r:.80} at {name!r:.20}, but {WEIGHTS} {held}"
            )
        reduced[key] = names[name]
    return reduced


def check_reduced(path: Path, plan: Any, dedup: DedupPlan, engines: Mapping[str, EngineArtifact]) -> None:
    """Every weight the package stores at fp16/bf16 is read by engines of that precision only: a
    fallback op or a partition running in PyTorch would get it at a dtype its graph does not take."""
    if not plan.reduced_weights:
        return
    running = {p.name for p in plan.partitions if engines[dedup.instance(p.name).fingerprint].is_engine}
    fits = engine_precision_keys(plan, dedup.instances, running)
    wrong = sorted(k for k, dtype in plan.reduced_weights.items() if fits.get(k) != dtype)
    if wrong:
        raise PackageCorruptError(
            f"{path}: weights {wrong[:5]} are stored at fp16/bf16, but not only engines of that precision "
            "read them"
        )


TensorSpec = tuple[torch.dtype, tuple[int, ...] | None]  # dtype, shape (None: a symbolic size)


# torch.export's archive codes for dtypes (its schema's ScalarType, a versioned format) -> the dtype.
# torch.export.load reads them with torch._export.serde.serialize's table, whose import is ~2 s of a cold
# load; tests/compiler/package/test_weight_specs.py holds this one to it.
SCHEMA_DTYPES: dict[int, torch.dtype] = {
    code: getattr(torch, name)
    for code, name in {
        1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float16", 7: "float32", 8: "float64",
        9: "complex32", 10: "complex64", 11: "complex128", 12: "bool", 13: "bfloat16", 28: "uint16",
        29: "float8_e4m3fn", 30: "float8_e5m2", 31: "float8_e4m3fnuz", 32: "float8_e5m2fnuz",
        33: "float8_e8m0fnu", 34: "uint32", 35: "uint64",
    }.items()
    if hasattr(torch, name)
}  # fmt: skip


def program_tensor_specs(data: bytes, where: str) -> dict[str, TensorSpec]:
    """The dtype and shape the program takes for each of its weights and constants, from its archive's
    tensor records (read as data, after ``check_archive``)."""
    specs: dict[str, TensorSpec] = {}
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for name in archive.namelist():
                if not name.endswith(("/model_weights_config.json", "/model_constants_config.json")):
                    continue
                records = json_reader.loads(archive.read(name), f"{where}: {name}")["config"]
                for key, record in records.items():
                    meta = record["tensor_meta"]
                    sizes = [size.get("as_int") for size in meta["sizes"]]
                    shape = tuple(sizes) if all(isinstance(d, int) for d in sizes) else None
                    specs[key] = (SCHEMA_DTYPES[meta["dtype"]], shape)
    except (KeyError, TypeError, ValueError, AttributeError, zipfile.BadZipFile) as exc:
        raise PackageCorruptError(f"{where}: its tensor records are malformed ({exc!r:.200})") from exc
    return specs


def check_weight_specs(
    path: Path,
    weights: Mapping[str, torch.Tensor],
    specs: Mapping[str, TensorSpec],
    reduced: Mapping[str, torch.dtype],
) -> None:
    """Every weight the program takes is held at the dtype and shape it takes (those stored at their
    engines' precision at that one, :func:`reduced_weights`): else PackageCorruptError naming it.
    Engines check what they read when weights are put in; a weight only PyTorch reads (a fallback op)
    would otherwise fail at the first call, with torch's own error."""
    for key, (dtype, shape) in specs.items():
        tensor = weights.get(key)
        if tensor is None:
            continue  # left out on purpose (int8-only weights) or missing: the load names those
        want = reduced.get(key, dtype)
        if tensor.dtype != want or (shape is not None and tuple(tensor.shape) != shape):
            takes = list(shape) if shape is not None else "(symbolic)"
            raise PackageCorruptError(
                f"{path}: {WEIGHTS} holds {key!r:.80} as {dtype_name(tensor.dtype)} {list(tensor.shape)}, "
                f"but its program takes {dtype_name(want)} {takes}"
            )
