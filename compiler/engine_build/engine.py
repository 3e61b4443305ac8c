"""Engine build: one engine per unique fingerprint, through the persistent engine cache.

The cache key is the fingerprint plus backend name and version, target device and build settings,
so a structure built once (by any model, run or worker) is never built again, and a corrupt entry is
rebuilt rather than used.

A build that fails (``EngineBuildError``: the library rejected the graph) falls back as
``CompileOptions.on_build_failure`` says: to the partition's own PyTorch submodule (an artifact of
backend ``"torch"`` with no engine bytes), to an ONNX Runtime engine of the same lowered graph, or
not at all (the error propagates). The artifact keeps the error, partition and node for the report. A
failed build is never written to the engine cache: a later library may build it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from compiler.backends import TORCH, get_backend
from compiler.backends.base import BuildSettings, EngineBackend, EngineIO, graph_format
from compiler.cache.entry import CacheKey
from compiler.cache.local import CacheSetting, EngineCache, resolve_cache
from compiler.errors import EngineBuildError, LoweringError
from compiler.partitioning.dedup import DedupPlan
from compiler.partitioning.partition import PartitionPlan

if TYPE_CHECKING:
    from compiler.engine_build.lower import LoweredPartition


@dataclass(frozen=True)
class EngineArtifact:
    """A built (or cache-hit) engine for one fingerprint, or the PyTorch fallback of a failed build.

    ``backend`` built it and runs it (``"torch"``: nothing was built, the partition's submodule stays in
    the graph and ``engine`` is empty). ``build_failure`` is set when the configured backend failed:
    error text, node, partition, fingerprint, the backend that failed and the one it fell back to.
    """

    fingerprint: str
    cache_key: str
    engine: bytes
    io: EngineIO
    stripped: bool
    cache_hit: bool
    seconds: float
    lower_seconds: float = 0.0
    backend: str = field(kw_only=True)
    build_failure: dict | None = field(default=None, kw_only=True)

    @property
    def bytes(self) -> int:
        return len(self.engine)

    @property
    def is_engine(self) -> bool:
        """Whether an engine runs this fingerprint (not the PyTorch fallback)."""
        return self.backend != TORCH

    def summary(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "cache_key": self.cache_key,
            "backend": self.backend,
            "bytes": self.bytes,
            "stripped": self.stripped,
            "cache_hit": self.cache_hit,
            "seconds": round(self.seconds, 4),
            "lower_seconds": round(self.lower_seconds, 4),
            "build_failure": self.build_failure,
        }


def build_engine(
    plan: PartitionPlan, dedup: DedupPlan, fingerprint: str, *, cache: CacheSetting = None
) -> EngineArtifact:
    """Lower and build the engine for ``fingerprint`` unless the cache already holds it. ``cache``: as
    everywhere (``compiler.cache.paths.choose``): None the default cache, False none, a path, URL or
    ``EngineCache``."""
    start = time.perf_counter()
    cache = resolve_cache(cache)
    # Bound to the model's device: engines build where they will run (CompileOptions.device).
    backend = get_backend(plan.options.backend, device=plan.options.device)
    representative = next(p for p in plan.partitions if p.name == dedup.unique[fingerprint])
    # Per partition: CompileOptions.partition_precision may raise one above the compile's precision.
    settings = plan.options.build_settings(representative.name)
    # Here, not at the top: lowering imports ONNX (0.3-0.6 s), which a package load never needs.
    from compiler.engine_build.lower import engine_io, lower, lower_program

    io = engine_io(plan, representative)
    key = _engine_key(backend, fingerprint, settings)
    if settings.precision == TORCH:  # kept in PyTorch on purpose (partition_precision): nothing to build
        return EngineArtifact(
            fingerprint, str(key), b"", io, False, False, time.perf_counter() - start, backend=TORCH
        )
    lowered: LoweredPartition | None = None

    def build() -> bytes:
        nonlocal lowered
        fmt = graph_format(backend)
        lowered = (lower_program if fmt == "torch.export" else lower)(plan, dedup, fingerprint)
        try:
            return backend.build(
                lowered.graph(fmt),
                lowered.io,
                settings,
                partition=representative.name,
                cache_dir=cache.directory if cache is not None else None,
            )
        except EngineBuildError as exc:
            if exc.partition is None:  # a backend that did not name it: name it for the report
                raise EngineBuildError(
                    f"{representative.name} ({fingerprint[:12]}): {exc}",
                    partition=representative.name,
                    node=exc.node,
                ) from exc
            raise

    try:
        engine, hit = _through_cache(cache, key, build, representative.name, io)
    except EngineBuildError as exc:
        if plan.options.on_build_failure == "error":
            raise
        return _fall_back(
            plan, dedup, fingerprint, str(key), io, backend, settings, lowered, exc, cache, start
        )
    return EngineArtifact(
        fingerprint,
        str(key),
        engine,
        io,
        settings.strip_weights,
        hit,
        time.perf_counter() - start,
        lowered.seconds if lowered is not None else 0.0,
        backend=backend.name,
    )


def _engine_key(backend: EngineBackend, fingerprint: str, settings: BuildSettings) -> CacheKey:
    return EngineCache.key(
        fingerprint=fingerprint,
        backend=backend.name,
        library_version=backend.library_version(),
        engine_target=backend.engine_target(),
        settings=settings.to_dict(),
    )


def _through_cache(
    cache: EngineCache | None, key: CacheKey, build: Callable[[], bytes], partition: str | None, io: EngineIO
) -> tuple[bytes, bool]:
    """(engine, cache hit); get_or_build stores only what build() returned, so a failed build leaves
    no entry."""
    if cache is None:
        return build(), False
    return cache.get_or_build(key, build, meta={"partition": partition, "io": io.to_dict()})


def _fall_back(
    plan: PartitionPlan,
    dedup: DedupPlan,
    fingerprint: str,
    key: str,
    io: EngineIO,
    failed: EngineBackend,
    settings: BuildSettings,
    lowered: LoweredPartition | None,
    exc: EngineBuildError,
    cache: EngineCache | None,
    start: float,
) -> EngineArtifact:
    """The artifact that stands in for a failed build: an ONNX Runtime engine of the same lowered graph
    (``on_build_failure="onnxruntime"``) or, failing that or by choice, the PyTorch submodule."""
    failure = {
        "error": str(exc),
        "node": exc.node,
        "partition": exc.partition,
        "fingerprint": fingerprint,
        "backend": failed.name,
        "fell_back_to": TORCH,
    }
    lower_seconds = lowered.seconds if lowered is not None else 0.0
    wanted = plan.options.on_build_failure == "onnxruntime" and failed.name != "onnxruntime" and lowered
    ort = get_backend("onnxruntime")
    if wanted and plan.options.device != "cpu" and not ort.engine_target().startswith("cuda"):
        # ONNX Runtime runs on the CPU here: its engines could not take the model's tensors.
        failure["fallback_error"] = f"onnxruntime runs on the CPU here, the model on {plan.options.device}"
        wanted = False
    graph = lowered.onnx if wanted and lowered is not None else b""
    if wanted and not graph:  # the failed backend compiled the torch graph: lower to ONNX now
        from compiler.engine_build.lower import lower

        try:
            again = lower(plan, dedup, fingerprint)
            graph, lower_seconds = again.onnx, lower_seconds + again.seconds
        except LoweringError as lower_exc:
            failure["fallback_error"] = str(lower_exc)
    if graph:
        ort_key = _engine_key(ort, fingerprint, settings)

        def build() -> bytes:
            return ort.build(graph, io, settings, partition=exc.partition)

        try:
            engine, hit = _through_cache(cache, ort_key, build, exc.partition, io)
        except EngineBuildError as ort_exc:  # ONNX Runtime cannot run it either: PyTorch it is
            failure["fallback_error"] = str(ort_exc)
        else:
            failure["fell_back_to"] = ort.name
            return EngineArtifact(
                fingerprint,
                str(ort_key),
                engine,
                io,
                settings.strip_weights,
                hit,
                time.perf_counter() - start,
                lower_seconds,
                backend=ort.name,
                build_failure=failure,
            )
    # No engine: the partition's submodule stays in the graph. The key is the one the failed engine
    # would have had, to tell which build to retry.
    return EngineArtifact(
        fingerprint,
        key,
        b"",
        io,
        False,
        False,
        time.perf_counter() - start,
        lower_seconds,
        backend=TORCH,
        build_failure=failure,
    )
